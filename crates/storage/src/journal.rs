//! A fold's writes made atomic without a sled transaction: a redo journal.
//!
//! A sled 0.34 transaction (and `Tree::apply_batch`) rolls the log buffer twice (`pin_log`), so
//! each costs two log writes on sled's I/O pool, on top of the flush the fold's decisions wait
//! for; at a handoff's pace that was most of the store's CPU (docs/benchmarks-history.md, session 16).
//! A fold instead writes its whole write set first (`meta/fold_journal` + chunk index, in
//! chunks of at most `MAX_VALUE_BYTES`, the first led by their number), then applies each write
//! as a plain insert or remove, then removes the chunks. sled recovers a prefix of its writes (of
//! values kept in its log: see `MAX_VALUE_BYTES` for why none is a blob), so after a crash either
//! a chunk is missing and so is every write applied after it (the journal is dropped and the
//! fold done again: its events are above their marks), or the journal is whole and an open
//! applies it again ([`SledStore::finish_journal`]): its writes are absolute values (record counts
//! included), so applying them twice is applying them once. Only one fold writes at a time (the
//! fold lock), so one journal is enough.
//!
//! What a transaction also gave and this does not: a reader outside the fold lock may see a fold
//! half applied. The writes go in the order [`Journal`] gets them, chosen so that what readers
//! combine stays safe: a fold's outbox entries before the states that decided them (the sweeper's
//! "unchanged since" check reads states, then the outbox), the folded marks and the watermark
//! last (the agent API reads an event's mark, then its conversation's verdict).
//!
//! If the store fails between the journal and its removal, the fold is left half applied in the
//! trees: whatever writes what folds write (folds, the retention pass, replay: all through
//! [`SledStore::fold_guard`]) refuses ([`StoreError::HalfApplied`]) until a restart completes it,
//! and the dispatcher exits for that restart (`writer::STORE_STUCK_EXIT`) once the store's disk
//! takes writes again.

use super::{keys, SledStore, StoreError, MAX_VALUE_BYTES};
use crate::port::Lifecycle;

/// Defines the trees a fold writes once: the enum, the code the journal stores for each (stored,
/// so never renumbered), the list of all ([`TreeId::ALL`]) and the store's tree for each
/// ([`SledStore::journal_tree`]). No second list is kept by hand.
macro_rules! journal_trees {
    ($($variant:ident = $code:literal => $field:ident,)*) => {
        /// The trees a fold writes, by a number the journal stores.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(super) enum TreeId {
            $($variant,)*
        }

        impl TreeId {
            #[cfg(test)]
            const ALL: &'static [TreeId] = &[$(TreeId::$variant,)*];

            fn code(self) -> u8 {
                match self {
                    $(TreeId::$variant => $code,)*
                }
            }

            fn of_code(code: u8) -> Option<TreeId> {
                match code {
                    $($code => Some(TreeId::$variant),)*
                    _ => None,
                }
            }
        }

        impl SledStore {
            fn journal_tree(&self, tree: TreeId) -> &sled::Tree {
                match tree {
                    $(TreeId::$variant => &self.$field,)*
                }
            }
        }
    };
}

journal_trees! {
    Folded = 0 => folded,
    Conversations = 1 => conversations,
    EndUsers = 2 => end_users,
    UserIndex = 3 => user_index,
    Bots = 4 => bots,
    Outbox = 5 => outbox,
    Actions = 6 => actions,
    Timers = 7 => timers,
    Queue = 8 => queue,
    Activity = 9 => activity,
    Meta = 10 => meta,
    PartitionEvents = 11 => partition_events,
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

    /// `FORMAT`, the number of writes (u32 BE), then per write: the tree's code, 0 (remove) or 1
    /// (insert), the key's length (u32 BE) and the key, and for an insert the value's length and
    /// the value.
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

impl SledStore {
    /// The fold lock, for whoever writes what folds write (folds, the retention pass, replay);
    /// refused while a fold is half applied (see the module).
    pub(super) fn fold_guard(&self) -> Result<std::sync::MutexGuard<'_, ()>, StoreError> {
        let guard = self
            .fold_lock
            .lock()
            .map_err(|_| StoreError::Corrupt("a fold panicked".into()))?;
        if self.half_applied.load(std::sync::atomic::Ordering::Acquire) {
            return Err(StoreError::HalfApplied);
        }
        Ok(guard)
    }

    /// Write a fold's journal, apply it, remove it (see the module). The caller holds the fold
    /// lock ([`fold_guard`](Self::fold_guard)).
    pub(super) fn commit_journal(&self, journal: &Journal) -> Result<(), StoreError> {
        if journal.is_empty() {
            return Ok(());
        }
        let chunks = journal_chunks(&journal.encode());
        // Nothing is applied yet if this fails, and an open discards a journal with a chunk
        // missing: the fold can simply be tried again.
        for (key, chunk) in &chunks {
            self.meta.insert(key.as_slice(), chunk.as_slice())?;
        }
        let applied = self.apply_journal(journal).and_then(|()| {
            for (key, _) in &chunks {
                self.meta.remove(key.as_slice())?;
            }
            Ok(())
        });
        if let Err(e) = applied {
            self.half_applied
                .store(true, std::sync::atomic::Ordering::Release);
            tracing::error!(error = %e, "a fold's writes failed half applied; folds stop until a restart completes them from the journal");
            return Err(StoreError::HalfApplied);
        }
        Ok(())
    }

    fn apply_journal(&self, journal: &Journal) -> Result<(), StoreError> {
        for op in &journal.ops {
            #[cfg(test)]
            tests::before_write()?;
            let tree = self.journal_tree(op.tree);
            match &op.value {
                Some(value) => tree.insert(op.key.as_slice(), value.as_slice())?,
                None => tree.remove(op.key.as_slice())?,
            };
        }
        Ok(())
    }

    /// The journal's chunks in the store (none unless a fold is being applied, or a crash
    /// interrupted one), and the journal they hold when none is missing.
    fn stored_journal(&self) -> Result<(Vec<sled::IVec>, Option<Journal>), StoreError> {
        let chunks: Vec<(sled::IVec, sled::IVec)> = self
            .meta
            .scan_prefix(keys::meta::FOLD_JOURNAL)
            .collect::<Result<_, _>>()?;
        let in_order = chunks.iter().enumerate().all(|(i, (key, _))| {
            let index = u32::try_from(i).unwrap_or(u32::MAX).to_be_bytes();
            key.get(keys::meta::FOLD_JOURNAL.len()..) == Some(&index[..])
        });
        let declared = chunks
            .first()
            .and_then(|(_, first)| first.first_chunk::<4>())
            .map(|count| u32::from_be_bytes(*count) as usize);
        let whole = match in_order && declared == Some(chunks.len()) {
            true => {
                let mut bytes = Vec::new();
                for (i, (_, chunk)) in chunks.iter().enumerate() {
                    bytes.extend_from_slice(chunk.get(if i == 0 { 4 } else { 0 }..).unwrap_or(&[]));
                }
                Some(Journal::decode(&bytes)?)
            }
            false => None,
        };
        Ok((chunks.into_iter().map(|(key, _)| key).collect(), whole))
    }

    /// On open: apply the journal of a fold a crash interrupted, if any, and remove it. A journal
    /// with a chunk missing was cut by the crash before any of its writes was applied (they come
    /// after every chunk): it is removed unapplied. Returns whether one was applied.
    pub(super) fn finish_journal(&self) -> Result<bool, StoreError> {
        let (keys, whole) = self.stored_journal()?;
        if keys.is_empty() {
            return Ok(false);
        }
        match &whole {
            Some(journal) => {
                self.apply_journal(journal)?;
                tracing::info!(
                    writes = journal.ops.len(),
                    "completed a fold a stop interrupted"
                );
            }
            None => tracing::warn!(
                chunks = keys.len(),
                "a fold's journal was cut before any of its writes: the fold is done again"
            ),
        }
        for key in keys {
            self.meta.remove(key)?;
        }
        self.flush()?;
        Ok(whole.is_some())
    }
}

/// The journal's encoding in values of at most `MAX_VALUE_BYTES` (the first led by the number of
/// chunks, u32 BE), each under `meta/fold_journal` + its index (u32 BE).
fn journal_chunks(encoded: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let parts: Vec<&[u8]> = encoded.chunks(MAX_VALUE_BYTES).collect();
    let count = u32::try_from(parts.len()).unwrap_or(u32::MAX);
    parts
        .into_iter()
        .enumerate()
        .map(|(i, part)| {
            let mut key = keys::meta::FOLD_JOURNAL.to_vec();
            key.extend_from_slice(&u32::try_from(i).unwrap_or(u32::MAX).to_be_bytes());
            let value = match i {
                0 => [&count.to_be_bytes()[..], part].concat(),
                _ => part.to_vec(),
            };
            (key, value)
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::port::*;
    use crate::test_support::{delivery, one_message_rule, pending_records};

    thread_local! {
        /// The journal writes applied on this thread fail (as a failing store would) after this
        /// many more succeeded.
        static FAIL_AT: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    }

    /// The journal writes on this thread fail after `n` more succeeded (a failing store).
    pub(crate) fn fail_writes_after(n: usize) {
        FAIL_AT.with(|f| f.set(Some(n)));
    }

    pub(super) fn before_write() -> Result<(), StoreError> {
        match FAIL_AT.with(std::cell::Cell::get) {
            Some(0) => {
                FAIL_AT.with(|f| f.set(None));
                Err(StoreError::Internal("a simulated store failure".into()))
            }
            Some(n) => {
                FAIL_AT.with(|f| f.set(Some(n - 1)));
                Ok(())
            }
            None => Ok(()),
        }
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
        let mut codes = std::collections::HashSet::new();
        for tree in TreeId::ALL {
            assert_eq!(TreeId::of_code(tree.code()), Some(*tree));
            assert!(codes.insert(tree.code()), "{tree:?}'s code is taken");
        }
        assert_eq!(TreeId::of_code(TreeId::ALL.len() as u8), None);
        // The codes are stored: pinned here, so an edit of the macro's list cannot renumber one.
        let pinned = [
            (TreeId::Folded, 0),
            (TreeId::Conversations, 1),
            (TreeId::EndUsers, 2),
            (TreeId::UserIndex, 3),
            (TreeId::Bots, 4),
            (TreeId::Outbox, 5),
            (TreeId::Actions, 6),
            (TreeId::Timers, 7),
            (TreeId::Queue, 8),
            (TreeId::Activity, 9),
            (TreeId::Meta, 10),
            (TreeId::PartitionEvents, 11),
        ];
        assert_eq!(pinned.len(), TreeId::ALL.len());
        for (tree, code) in pinned {
            assert_eq!(tree.code(), code, "{tree:?}");
        }
    }

    #[test]
    fn a_long_journal_is_cut_in_chunks_that_read_back_whole() {
        let encoded: Vec<u8> = (0..MAX_VALUE_BYTES * 2 + 10).map(|i| i as u8).collect();
        let chunks = journal_chunks(&encoded);
        assert_eq!(chunks.len(), 3);
        assert!(chunks.iter().all(|(_, v)| v.len() <= MAX_VALUE_BYTES + 4));
        assert_eq!(chunks[0].1[..4], 3u32.to_be_bytes());
        let joined: Vec<u8> = chunks
            .iter()
            .enumerate()
            .flat_map(|(i, (_, v))| v[if i == 0 { 4 } else { 0 }..].to_vec())
            .collect();
        assert_eq!(joined, encoded);
    }

    /// Fold every event still to fold with `rules`.
    fn fold_all(
        store: &SledStore,
        rules: &dyn engine::decide::Decide,
    ) -> Result<super::super::Applied, StoreError> {
        let batch: Vec<(u64, model::webhook::model::Event)> = pending_records(store)
            .0
            .iter()
            .map(|(p, record)| {
                let event = model::webhook::parse_event(record.event.get()).expect("parse");
                (p.seq, event)
            })
            .collect();
        let received = vec![1_000; batch.len()];
        store.apply_with(&batch, rules, &received)
    }

    /// One message event for each of `conversations`, c0 to c(n-1).
    fn accept_messages(store: &SledStore, conversations: usize) {
        let ids: Vec<(String, String)> = (0..conversations)
            .map(|i| (format!("e{i}"), format!("c{i}")))
            .collect();
        let events: Vec<(&str, &str, i64)> = ids
            .iter()
            .enumerate()
            .map(|(i, (e, c))| (e.as_str(), c.as_str(), i as i64))
            .collect();
        let parsed = model::webhook::parse_delivery(&delivery("d1", &events)).expect("delivery");
        store
            .accept(&parsed.id, &parsed.events, 1_000)
            .expect("accept");
    }

    /// The journal left in the store, read as an open would (complete ones only).
    fn left_journal(store: &SledStore) -> Option<Journal> {
        let (keys, whole) = store.stored_journal().expect("read");
        assert!(keys.is_empty() || whole.is_some(), "every chunk is there");
        whole
    }

    /// How many of the journal's writes the trees show.
    fn shown(store: &SledStore, journal: &Journal) -> usize {
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
    fn a_fold_the_store_failed_half_way_stops_later_folds_and_an_open_completes_it() {
        // 3 conversations: one chunk; 120: several (about 1.6 KB of journal each).
        for (conversations, fail_at) in [(3, 0), (3, 1), (3, 9), (120, 5), (120, 400)] {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("store");
            let rules = one_message_rule("greet");
            let journal = {
                let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
                accept_messages(&store, conversations);
                FAIL_AT.with(|f| f.set(Some(fail_at)));
                let failed = fold_all(&store, &rules);
                assert!(matches!(failed, Err(StoreError::HalfApplied)), "{failed:?}");
                let journal = left_journal(&store).expect("the journal is left");
                let chunks = store.meta.scan_prefix(keys::meta::FOLD_JOURNAL).count();
                assert_eq!(chunks > 1, conversations > 100, "{chunks} chunks");
                assert!(journal.ops.len() > fail_at, "{} writes", journal.ops.len());
                assert!(shown(&store, &journal) < journal.ops.len(), "half applied");
                // Nothing that writes what folds write goes on over it.
                let again = fold_all(&store, &rules);
                assert!(matches!(again, Err(StoreError::HalfApplied)), "{again:?}");
                assert!(matches!(store.fold_guard(), Err(StoreError::HalfApplied)));
                store.flush().expect("flush");
                journal
            };
            let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
            let case = format!("{conversations} conversations, failed at {fail_at}");
            assert_eq!(shown(&store, &journal), journal.ops.len(), "{case}");
            assert_eq!(store.meta.scan_prefix(keys::meta::FOLD_JOURNAL).count(), 0);
            // The fold counts as done: nothing to fold again, each action queued once.
            let again = fold_all(&store, &rules).expect("fold");
            assert_eq!((again.applied, again.outbox.len()), (0, 0), "{case}");
            assert_eq!(store.outbox().expect("outbox").len(), conversations);
            assert_eq!(
                store.sizes().expect("sizes").conversations,
                conversations as u64
            );
        }
    }

    /// The handoff figures' hour record is written whole in the fold's journal: a fold an open
    /// completes from its journal adds its events to the hour once, whichever of its writes the
    /// failure stopped at, and folding again afterwards adds nothing.
    #[test]
    fn a_fold_completed_from_its_journal_counts_its_handoff_figures_once() {
        use crate::queue::tests::conversation_event;
        let requested = "bot.conversation.agent_call_requested";
        let hour = 1_763_690_400_000;
        let mut stopped_before_the_record = std::collections::BTreeSet::new();
        for fail_at in [0, 2, 3, 4, 6, 12] {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("store");
            {
                let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
                let first = [conversation_event("e0", requested, "c0", hour + 1)];
                store.accept(&"d0".into(), &first, 1_000).expect("accept");
                fold_all(&store, &engine::decide::NoRules).expect("fold");
                let events: Vec<_> = (1..4)
                    .map(|i| {
                        conversation_event(&format!("e{i}"), requested, &format!("c{i}"), hour + i)
                    })
                    .collect();
                store.accept(&"d1".into(), &events, 1_000).expect("accept");
                FAIL_AT.with(|f| f.set(Some(fail_at)));
                let failed = fold_all(&store, &engine::decide::NoRules);
                assert!(matches!(failed, Err(StoreError::HalfApplied)), "{failed:?}");
                let journal = left_journal(&store).expect("the journal is left");
                let record = journal
                    .ops
                    .iter()
                    .position(|op| {
                        op.tree == TreeId::Queue && op.key.first() == Some(&keys::QUEUE_STATS)
                    })
                    .expect("the hour record is in the journal");
                // Failures before and after the record's own write are both tried.
                stopped_before_the_record.insert(fail_at <= record);
                store.flush().expect("flush");
            }
            let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
            let figures = |store: &SledStore| {
                store
                    .handoff_stats(hour, hour + engine::state::stats::HOUR_MS)
                    .expect("figures")
            };
            assert_eq!(figures(&store).joined, 4, "failed at write {fail_at}");
            let again = fold_all(&store, &engine::decide::NoRules).expect("fold");
            assert_eq!(again.applied, 0);
            assert_eq!(figures(&store).joined, 4, "failed at write {fail_at}");
            assert_eq!(store.waiting_for("B1").expect("queue").len(), 4);
        }
        assert_eq!(
            stopped_before_the_record.len(),
            2,
            "both sides of the record's write"
        );
    }

    #[test]
    fn a_journal_cut_before_its_last_chunk_is_dropped_and_its_fold_done_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("store");
        let rules = one_message_rule("greet");
        {
            let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
            accept_messages(&store, 120);
            FAIL_AT.with(|f| f.set(Some(0)));
            assert!(fold_all(&store, &rules).is_err());
            // A crash after the first chunk: the others and every write after them are gone.
            let (keys, _) = store.stored_journal().expect("read");
            assert!(keys.len() > 1);
            for key in &keys[1..] {
                store.meta.remove(key).expect("remove");
            }
            store.flush().expect("flush");
        }
        let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
        assert_eq!(store.meta.scan_prefix(keys::meta::FOLD_JOURNAL).count(), 0);
        assert_eq!(
            store.sizes().expect("sizes").conversations,
            0,
            "nothing of it applied"
        );
        let again = fold_all(&store, &rules).expect("fold");
        assert_eq!((again.applied, again.outbox.len()), (120, 120));
    }
}
