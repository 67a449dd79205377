//! Keyed pages of a tree keyed by id ([`id_page`]): one sled `range` from the cursor, never a
//! whole tree (the end users' and the conversations' pages in `reads`, the finished entries'
//! in `outbox`).

use super::{decode, StoreError};

/// At most `limit` records of a tree keyed by id, with ids after `after` (from the first when
/// `None`), in id order (byte order: the id right after `after` is `after` and a zero byte).
pub(super) fn id_page<T: for<'de> serde::Deserialize<'de>>(
    tree: &sled::Tree,
    after: Option<&str>,
    limit: usize,
    what: &str,
) -> Result<Vec<T>, StoreError> {
    let iter = match after {
        Some(id) => {
            let mut from = id.as_bytes().to_vec();
            from.push(0);
            tree.range(from..)
        }
        None => tree.iter(),
    };
    iter.take(limit)
        .map(|item| decode(&item?.1, what))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::encode;
    use crate::port::*;
    use crate::{keys, SledStore};
    use engine::state::EndUserState;
    use model::action::DoneRecord;
    use model::action::{Action, OutboxEntry};
    use model::ids::{ConversationId, EndUserId, EventId};

    fn store() -> (tempfile::TempDir, SledStore) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(&dir.path().join("store"), 8 * 1024 * 1024).expect("open");
        (dir, store)
    }

    fn finished(seq: u64) -> DoneRecord {
        let conversation_id = ConversationId::new("c1");
        DoneRecord {
            entry: OutboxEntry {
                seq,
                id: format!("a{seq}"),
                queue: "c:c1".into(),
                event_id: EventId::new(format!("e{seq}")),
                rule: "r".into(),
                action: Action::SetManual {
                    conversation_id,
                    enabled: true,
                },
                received_at: 1,
                decided_at: 2,
                rules_version: String::new(),
                idempotency_key: None,
            },
            outcome: "done".into(),
            at: 3,
            attempts: 1,
            note: None,
        }
    }

    #[test]
    fn end_users_continue_right_after_the_cursor_id() {
        let (_dir, store) = store();
        // Key order is byte order: "a\0" is the first id after "a".
        for id in ["b", "a", "ab", "a\0"] {
            let user = EndUserState::new(EndUserId::new(id));
            let bytes = encode(&user).expect("encode");
            store.end_users.insert(id, bytes).expect("insert");
        }
        let ids = |after: Option<&str>, limit| -> Vec<String> {
            let page = store.end_users_page(after, limit).expect("page");
            page.into_iter().map(|u| u.id.as_str().to_owned()).collect()
        };
        assert_eq!(ids(None, 10), ["a", "a\0", "ab", "b"]);
        assert_eq!(ids(None, 2), ["a", "a\0"]);
        assert_eq!(ids(Some("a"), 10), ["a\0", "ab", "b"]);
        assert_eq!(ids(Some("aa"), 10), ["ab", "b"]);
        assert_eq!(ids(Some("b"), 10), Vec::<String>::new());
    }

    #[test]
    fn finished_entries_page_newest_first_below_the_cursor_seq() {
        let (_dir, store) = store();
        for seq in [1, 2, 5, 9, u64::MAX] {
            let bytes = encode(&finished(seq)).expect("encode");
            store.done.insert(keys::seq(seq), bytes).expect("insert");
        }
        let seqs = |before: Option<u64>, limit| -> Vec<u64> {
            let page = store.finished_page(before, limit).expect("page");
            page.into_iter().map(|r| r.entry.seq).collect()
        };
        assert_eq!(seqs(None, 10), [u64::MAX, 9, 5, 2, 1]);
        assert_eq!(seqs(None, 2), [u64::MAX, 9]);
        assert_eq!(seqs(Some(9), 2), [5, 2]);
        assert_eq!(seqs(Some(6), 10), [5, 2, 1]);
        assert_eq!(seqs(Some(1), 10), Vec::<u64>::new());
        assert_eq!(seqs(Some(0), 10), Vec::<u64>::new());
        // The same records as the whole list, in the same order.
        let whole: Vec<u64> = store
            .finished(usize::MAX)
            .expect("all")
            .iter()
            .map(|r| r.entry.seq)
            .collect();
        assert_eq!(whole, seqs(None, 10));
    }
}
