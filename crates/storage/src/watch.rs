//! The reconciliation sweeper's index (in the `queue/v1` tree, beside the waiting queue): every
//! conversation out of plain bot mode (`a` + id: `state::belief::is_active`) and every one
//! that left its handoff (`r` + the time it did + id: `state::belief::released_at`), so a
//! sweep reads the active ones and a short range of the recently released ones instead of every
//! conversation's state.
//!
//! Like the waiting entries, only folds write these keys, in their journal: each compares a
//! conversation's key as the fold found it with its key after the fold (`store::derived`, which
//! keeps the agent API's phase index the same way). So the index always
//! equals the states (a store from before it is indexed once, on open). A released entry stays
//! while its conversation is unchanged (one key per conversation that ever had a handoff); the
//! sweeper reads only those released within `reconcile.recent`.

use super::{keys, ConversationState, SledStore, StoreError};
use engine::index::Derived;

/// A conversation's key in the sweeper's index, if any.
pub(super) fn watch_key(s: &ConversationState) -> Option<Vec<u8>> {
    let entries = engine::index::derived(s).into_iter();
    let mut watched =
        entries.filter(|e| matches!(e, Derived::Active { .. } | Derived::Released { .. }));
    watched.next().map(|e| crate::derived::key(&e))
}

/// The conversations a sweep looks at (ids), from the index.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Watched {
    /// Out of plain bot mode now.
    pub active: Vec<String>,
    /// Left their handoff at or after the time asked for, newest last.
    pub released: Vec<String>,
}

impl SledStore {
    /// A store from before the sweeper's index: index its conversations once, on open.
    pub(super) fn index_watch_once(&self) -> Result<(), StoreError> {
        self.index_once(keys::meta::WATCH_INDEXED, "reconciliation", |s| {
            watch_key(s).into_iter().collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::port::*;
    use crate::queue::tests::{conversation_event, fold, queue_keys};

    /// Every index entry, scanned.
    fn index(store: &SledStore) -> Vec<Vec<u8>> {
        queue_keys(store, &[keys::WATCH_ACTIVE, keys::WATCH_RELEASED])
    }

    #[test]
    fn the_fold_keeps_active_and_released_conversations_indexed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(dir.path(), 8 << 20).expect("open");
        let requested = "bot.conversation.agent_call_requested";
        fold(
            &store,
            "d1",
            vec![
                conversation_event("e1", requested, "c1", 1_000),
                conversation_event("e2", "bot.conversation.updated", "c2", 1_000),
                conversation_event("e3", requested, "c3", 1_000),
            ],
        );
        assert_eq!(
            store.watched(0, 100).expect("watched"),
            Watched {
                active: vec!["c1".into(), "c3".into()],
                released: vec![],
            },
            "plain bot mode (c2) is not indexed"
        );
        // c1 is cancelled at 5 s, c3 ends at 9 s: released, by time.
        fold(
            &store,
            "d2",
            vec![
                conversation_event(
                    "e4",
                    "bot.conversation.agent_call_disconnected",
                    "c3",
                    9_000,
                ),
                conversation_event("e5", "bot.conversation.agent_call_cancelled", "c1", 5_000),
            ],
        );
        assert_eq!(
            store.watched(0, 100).expect("watched"),
            Watched {
                active: vec![],
                released: vec!["c1".into(), "c3".into()],
            }
        );
        assert_eq!(
            store.watched(6_000, 100).expect("watched").released,
            ["c3"],
            "only those released since"
        );
        assert_eq!(
            store.watched(0, 1).expect("watched").released.len(),
            1,
            "bounded"
        );
        // One key per conversation, equal to the states.
        let expected: Vec<Vec<u8>> = ["c1", "c2", "c3"]
            .iter()
            .filter_map(|id| {
                let state = store.conversation(&(*id).into()).expect("read")?;
                watch_key(&state)
            })
            .collect();
        let mut expected = expected;
        expected.sort();
        assert_eq!(index(&store), expected);
    }

    #[test]
    fn a_store_from_before_the_index_builds_it_on_open_and_the_sample_pages_round() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let store = SledStore::open(dir.path(), 8 << 20).expect("open");
            fold(
                &store,
                "d1",
                vec![
                    conversation_event("e1", "bot.conversation.agent_call_requested", "c1", 1),
                    conversation_event("e2", "bot.conversation.updated", "c2", 1),
                    conversation_event("e3", "bot.conversation.updated", "c3", 1),
                ],
            );
            for key in index(&store) {
                store.queue.remove(key).expect("remove");
            }
            store
                .meta
                .remove(keys::meta::WATCH_INDEXED)
                .expect("unmark");
            store.db.flush().expect("flush");
            assert_eq!(store.watched(0, 10).expect("watched"), Watched::default());
        }
        let store = SledStore::open(dir.path(), 8 << 20).expect("reopen");
        assert_eq!(store.watched(0, 10).expect("watched").active, ["c1"]);
        let ids = |page: Vec<ConversationState>| -> Vec<String> {
            page.iter().map(|s| s.id.as_str().to_owned()).collect()
        };
        assert_eq!(
            ids(store.conversations_page(None, 2).expect("page")),
            ["c1", "c2"]
        );
        assert_eq!(
            ids(store.conversations_page(Some("c2"), 2).expect("page")),
            ["c3"]
        );
        assert!(store
            .conversations_page(Some("c3"), 2)
            .expect("page")
            .is_empty());
    }
}
