//! A fold's writes made atomic without a sled transaction: a redo journal in one key.
//!
//! A sled 0.34 transaction (and `Tree::apply_batch`) rolls the log buffer twice (`pin_log`), so
//! each costs two log writes on sled's I/O pool, on top of the flush the fold's decisions wait
//! for; at a handoff's pace that was most of the store's CPU (docs/benchmarks.md, session 16).
//! A fold instead writes its whole write set as **one** value (`meta/fold_journal`, one sled
//! insert, which is atomic), then applies each write as a plain insert or remove, then removes
//! the journal. sled recovers a prefix of its writes, so after a crash either the journal is
//! absent and so is every write applied after it, or it is present and an open applies it again
//! ([`Store::finish_journal`]): its writes are absolute values (record counts included), so
//! applying them twice is applying them once. Only one fold writes at a time (the fold lock), so
//! one key is enough.
//!
//! What a transaction also gave and this does not: a reader outside the fold lock may see a fold
//! half applied. The writes go in the order [`Journal`] gets them, chosen so that what readers
//! combine stays safe: a fold's outbox entries are in before the states that decided them (the
//! sweeper's "unchanged since" check reads states, then the outbox).
//!
//! If the store fails between the journal and its removal, the fold is left half applied in the
//! trees: every later fold refuses ([`StoreError::HalfApplied`]) until a restart completes it
//! (sled 0.34 fails every call after its first I/O error anyway; the writer's indexer then exits
//! for a restart, `writer::STORE_STUCK_EXIT`).

use super::{keys, Store, StoreError};

/// The trees a fold writes, by a number the journal stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TreeId {
    Folded,
    Conversations,
    EndUsers,
    UserIndex,
    Bots,
    Outbox,
    Actions,
    Timers,
    Queue,
    Activity,
    Meta,
}

impl TreeId {
    const ALL: [TreeId; 11] = [
        TreeId::Folded,
        TreeId::Conversations,
        TreeId::EndUsers,
        TreeId::UserIndex,
        TreeId::Bots,
        TreeId::Outbox,
        TreeId::Actions,
        TreeId::Timers,
        TreeId::Queue,
        TreeId::Activity,
        TreeId::Meta,
    ];

    fn code(self) -> u8 {
        self as u8
    }

    fn of_code(code: u8) -> Option<TreeId> {
        Self::ALL.get(usize::from(code)).copied()
    }
}

/// One write: a value put under a key, or the key removed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Op {
    tree: TreeId,
    key: Vec<u8>,
    value: Option<Vec<u8>>,
}

/// A fold's writes, in the order they are applied.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Journal {
    ops: Vec<Op>,
}

/// The encoding's version (the first byte).
const FORMAT: u8 = 1;

impl Journal {
    pub fn insert(&mut self, tree: TreeId, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) {
        self.ops.push(Op {
            tree,
            key: key.into(),
            value: Some(value.into()),
        });
    }

    pub fn remove(&mut self, tree: TreeId, key: impl Into<Vec<u8>>) {
        self.ops.push(Op {
            tree,
            key: key.into(),
            value: None,
        });
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// `FORMAT`, the number of writes (u32 BE), then per write: the tree's code, 0 (remove) or 1 (insert), the key's length
    /// (u32 BE) and the key, and for an insert the value's length and the value.
    fn encode(&self) -> Vec<u8> {
        let size: usize = self
            .ops
            .iter()
            .map(|op| 10 + op.key.len() + op.value.as_ref().map_or(0, Vec::len))
            .sum();
        let mut out = Vec::with_capacity(1 + size);
        out.push(FORMAT);
        put_len(&mut out, self.ops.len());
        for op in &self.ops {
            out.push(op.tree.code());
            out.push(u8::from(op.value.is_some()));
            put_bytes(&mut out, &op.key);
            if let Some(value) = &op.value {
                put_bytes(&mut out, value);
            }
        }
        out
    }

    fn decode(bytes: &[u8]) -> Result<Journal, StoreError> {
        let bad = |what: &str| StoreError::Corrupt(format!("fold journal: {what}"));
        let (&format, mut rest) = bytes.split_first().ok_or_else(|| bad("empty"))?;
        if format != FORMAT {
            return Err(bad(&format!("unknown format {format}")));
        }
        let (count, after) = rest
            .split_first_chunk::<4>()
            .ok_or_else(|| bad("cut short"))?;
        let count = u32::from_be_bytes(*count) as usize;
        rest = after;
        let mut ops = Vec::with_capacity(count.min(rest.len() / 10));
        while let Some((&code, after)) = rest.split_first() {
            let tree = TreeId::of_code(code).ok_or_else(|| bad("unknown tree"))?;
            let (&kind, after) = after.split_first().ok_or_else(|| bad("cut short"))?;
            let (key, after) = take_bytes(after).ok_or_else(|| bad("cut short"))?;
            let (value, after) = match kind {
                0 => (None, after),
                1 => {
                    let (value, after) = take_bytes(after).ok_or_else(|| bad("cut short"))?;
                    (Some(value.to_vec()), after)
                }
                _ => return Err(bad("unknown write")),
            };
            ops.push(Op {
                tree,
                key: key.to_vec(),
                value,
            });
            rest = after;
        }
        if ops.len() != count {
            return Err(bad("cut short"));
        }
        Ok(Journal { ops })
    }
}

fn put_len(out: &mut Vec<u8>, len: usize) {
    // Counts, keys and values are far below 4 GiB (a sled value is at most that).
    let len = u32::try_from(len).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_be_bytes());
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_len(out, bytes.len());
    out.extend_from_slice(bytes);
}

fn take_bytes(from: &[u8]) -> Option<(&[u8], &[u8])> {
    let (len, rest) = from.split_first_chunk::<4>()?;
    let len = usize::try_from(u32::from_be_bytes(*len)).ok()?;
    (rest.len() >= len).then(|| rest.split_at(len))
}

impl Store {
    fn journal_tree(&self, tree: TreeId) -> &sled::Tree {
        match tree {
            TreeId::Folded => &self.folded,
            TreeId::Conversations => &self.conversations,
            TreeId::EndUsers => &self.end_users,
            TreeId::UserIndex => &self.user_index,
            TreeId::Bots => &self.bots,
            TreeId::Outbox => &self.outbox,
            TreeId::Actions => &self.actions,
            TreeId::Timers => &self.timers,
            TreeId::Queue => &self.queue,
            TreeId::Activity => &self.activity,
            TreeId::Meta => &self.meta,
        }
    }

    /// Write a fold's journal, apply it, remove it (see the module). The caller holds the fold
    /// lock.
    pub(super) fn commit_journal(&self, journal: &Journal) -> Result<(), StoreError> {
        if self.half_applied.load(std::sync::atomic::Ordering::Acquire) {
            return Err(StoreError::HalfApplied);
        }
        if journal.is_empty() {
            return Ok(());
        }
        // Nothing is written yet if this fails: the fold can simply be tried again.
        self.meta
            .insert(keys::meta::FOLD_JOURNAL, journal.encode())?;
        #[cfg(test)]
        if let Some(writes) = tests::CRASH_AFTER.with(std::cell::Cell::take) {
            let first = Journal {
                ops: journal.ops.iter().take(writes).cloned().collect(),
            };
            self.apply_journal(&first)?;
            return Err(StoreError::Internal("a simulated crash".into()));
        }
        let applied = self
            .apply_journal(journal)
            .and_then(|()| Ok(self.meta.remove(keys::meta::FOLD_JOURNAL).map(drop)?));
        if let Err(e) = applied {
            self.half_applied
                .store(true, std::sync::atomic::Ordering::Release);
            tracing::error!(error = %e, "a fold's writes failed half applied; folds stop until a restart completes them from the journal");
            return Err(e);
        }
        Ok(())
    }

    fn apply_journal(&self, journal: &Journal) -> Result<(), StoreError> {
        for op in &journal.ops {
            let tree = self.journal_tree(op.tree);
            match &op.value {
                Some(value) => tree.insert(op.key.as_slice(), value.as_slice())?,
                None => tree.remove(op.key.as_slice())?,
            };
        }
        Ok(())
    }

    /// On open: apply the journal of a fold a crash interrupted, if any, and remove it. Returns
    /// whether there was one.
    pub(super) fn finish_journal(&self) -> Result<bool, StoreError> {
        let Some(bytes) = self.meta.get(keys::meta::FOLD_JOURNAL)? else {
            return Ok(false);
        };
        let journal = Journal::decode(&bytes)?;
        self.apply_journal(&journal)?;
        self.meta.remove(keys::meta::FOLD_JOURNAL)?;
        self.db.flush()?;
        tracing::info!(
            writes = journal.ops.len(),
            "completed a fold a stop interrupted"
        );
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{delivery, one_message_rule, pending_records};
    use super::*;

    thread_local! {
        /// The next fold on this thread writes its journal and this many of its writes, then
        /// stops as a crash would.
        pub(super) static CRASH_AFTER: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    }

    /// Fold every event still to fold with `rules`.
    fn fold_all(
        store: &Store,
        rules: &dyn crate::actions::Decide,
    ) -> Result<super::super::Applied, StoreError> {
        let batch: Vec<(u64, crate::webhook::model::Event)> = pending_records(store)
            .0
            .iter()
            .map(|(p, record)| {
                let event = crate::webhook::parse_event(record.event.get()).expect("parse");
                (p.seq, event)
            })
            .collect();
        let received = vec![1_000; batch.len()];
        store.apply_with(&batch, rules, &received)
    }

    fn accept_three(store: &Store) {
        let body = delivery("d1", &[("e1", "c1", 1), ("e2", "c2", 2), ("e3", "c1", 3)]);
        let parsed = crate::webhook::parse_delivery(&body).expect("delivery");
        store
            .accept(&parsed.id, &parsed.events, 1_000)
            .expect("accept");
    }

    /// How many of the journal's writes the trees show.
    fn shown(store: &Store, journal: &Journal) -> usize {
        journal
            .ops
            .iter()
            .filter(|op| {
                let found = store.journal_tree(op.tree).get(&op.key).expect("read");
                found.as_deref() == op.value.as_deref()
            })
            .count()
    }

    #[test]
    fn a_fold_a_crash_interrupted_is_completed_from_its_journal_on_open() {
        for crash_after in [0, 1, 4, 9] {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("store");
            let journal = {
                let store = Store::open(&path, 8 * 1024 * 1024).expect("open");
                accept_three(&store);
                CRASH_AFTER.with(|c| c.set(Some(crash_after)));
                assert!(
                    fold_all(&store, &one_message_rule("greet")).is_err(),
                    "the fold stopped"
                );
                let bytes = store
                    .meta
                    .get(keys::meta::FOLD_JOURNAL)
                    .expect("read")
                    .expect("the journal is left");
                let journal = Journal::decode(&bytes).expect("decode");
                assert!(
                    journal.ops.len() > crash_after,
                    "{} writes",
                    journal.ops.len()
                );
                assert!(
                    shown(&store, &journal) < journal.ops.len(),
                    "half applied before the restart"
                );
                store.flush().expect("flush");
                journal
            };
            let store = Store::open(&path, 8 * 1024 * 1024).expect("reopen");
            assert_eq!(
                shown(&store, &journal),
                journal.ops.len(),
                "every write in after {crash_after}"
            );
            assert!(store
                .meta
                .get(keys::meta::FOLD_JOURNAL)
                .expect("read")
                .is_none());
            // The fold counts as done: nothing to fold again, its three actions queued once.
            let again = fold_all(&store, &one_message_rule("greet")).expect("fold");
            assert_eq!(
                (again.applied, again.outbox.len()),
                (0, 0),
                "after {crash_after}"
            );
            assert_eq!(store.outbox().expect("outbox").len(), 3);
            assert_eq!(store.sizes().conversations, 2);
        }
    }

    #[test]
    fn a_fold_half_applied_stops_later_folds_until_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("store"), 8 * 1024 * 1024).expect("open");
        accept_three(&store);
        // As a store failing between the journal and its last write leaves it.
        store
            .half_applied
            .store(true, std::sync::atomic::Ordering::Release);
        assert!(matches!(
            fold_all(&store, &one_message_rule("greet")),
            Err(StoreError::HalfApplied)
        ));
        assert!(store
            .conversation(&crate::ids::ConversationId::new("c1"))
            .expect("read")
            .is_none());
    }

    fn sample() -> Journal {
        let mut j = Journal::default();
        j.insert(TreeId::Folded, b"c:1".to_vec(), 7u64.to_be_bytes().to_vec());
        j.remove(TreeId::Queue, b"w/old".to_vec());
        j.insert(
            TreeId::Conversations,
            b"1".to_vec(),
            br#"{"id":"1"}"#.to_vec(),
        );
        j.insert(TreeId::Meta, b"empty".to_vec(), Vec::new());
        j
    }

    #[test]
    fn a_journal_reads_back_as_written() {
        let j = sample();
        assert_eq!(Journal::decode(&j.encode()).expect("decode"), j);
        assert_eq!(
            Journal::decode(&Journal::default().encode()).expect("empty"),
            Journal::default()
        );
    }

    #[test]
    fn a_damaged_journal_is_refused() {
        let bytes = sample().encode();
        for cut in 0..bytes.len() {
            assert!(Journal::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        assert!(Journal::decode(&[]).is_err());
        assert!(Journal::decode(&[9]).is_err(), "unknown format");
        let mut bad_tree = bytes.clone();
        bad_tree[5] = 200;
        assert!(Journal::decode(&bad_tree).is_err());
        let mut bad_kind = bytes;
        bad_kind[6] = 7;
        assert!(Journal::decode(&bad_kind).is_err());
    }

    #[test]
    fn every_tree_code_reads_back() {
        for tree in TreeId::ALL {
            assert_eq!(TreeId::of_code(tree.code()), Some(tree));
        }
        assert_eq!(TreeId::of_code(TreeId::ALL.len() as u8), None);
    }
}
