//! The event log by partition: a conversation's own events, found without reading the whole log.
//!
//! `partition_events/v1` maps (segment, partition key, sequence number) to the offset of the
//! event's frame in that segment. The folds write an entry for each event they fold or pass over,
//! in the journal that raises its partition's mark, so a folded event is indexed exactly when it
//! is folded. An event not folded yet is past the folds' watermark (`meta/fold_from`), so a reader
//! finds those in the log's tail; [`SledStore::partition_events`] reads both: one short range per
//! live segment (a week of log is a few hundred), then the tail.
//!
//! A segment's entries are one range, consulted only while the segment exists: the retention pass
//! deletes segments, then removes the ranges of every segment below the oldest left (entries a
//! crash kept are removed by the next pass, and never read meanwhile). Nothing reads a segment to
//! forget it. A store from before the index gets its log indexed once, on open.

use super::{eventlog, keys, log_error, SledStore, StoreError};
use std::collections::BTreeMap;
use std::ops::ControlFlow;

/// Entries written or removed per sled batch when a whole log or many segments are (un)indexed.
const BATCH: usize = 10_000;

/// The index entry of event `seq` of `partition` (its text form), logged at `at`: the key and
/// the value (the frame's offset in its segment).
pub(super) fn entry(at: eventlog::LogPosition, partition: &str, seq: u64) -> (Vec<u8>, u64) {
    (keys::partition_event(at.segment, partition, seq), at.offset)
}

impl SledStore {
    /// Add the frames of `partition`'s events from `from` to the log's end.
    pub(super) fn tail_of(
        &self,
        partition: &str,
        from: eventlog::LogPosition,
        frames: &mut BTreeMap<u64, eventlog::LogPosition>,
    ) -> Result<(), StoreError> {
        eventlog::scan(&self.log_dir, from, |at, record, _| {
            for (seq, p) in record.seqs.iter().zip(&record.partitions) {
                if p == partition {
                    frames.insert(*seq, at);
                }
            }
            ControlFlow::Continue(())
        })
        .map_err(log_error)?;
        Ok(())
    }

    /// Remove the entries of every segment below the oldest one left (all of them when the log
    /// is empty): after the retention pass deleted segments.
    pub(super) fn unindex_removed_segments(&self) -> Result<(), StoreError> {
        let oldest = eventlog::segments(&self.log_dir)
            .map_err(log_error)?
            .first()
            .copied();
        let below = keys::seq(oldest.unwrap_or(u64::MAX));
        loop {
            let mut batch = sled::Batch::default();
            let mut n = 0;
            for item in self.partition_events.range(..below).keys().take(BATCH) {
                batch.remove(item?);
                n += 1;
            }
            self.partition_events.apply_batch(batch)?;
            if n < BATCH {
                return Ok(());
            }
        }
    }

    /// A store from before the index: index every event in its log once, on open (before any
    /// fold, so nothing races with it), then mark it done. A new store's log is empty.
    pub(super) fn index_partition_events_once(&self) -> Result<(), StoreError> {
        if self
            .meta
            .contains_key(keys::meta::PARTITION_EVENTS_INDEXED)?
        {
            return Ok(());
        }
        let mut batch = sled::Batch::default();
        let (mut in_batch, mut indexed) = (0, 0u64);
        let mut failed = None;
        let start = eventlog::LogPosition::default();
        eventlog::scan(&self.log_dir, start, |at, record, _| {
            for (seq, partition) in record.seqs.iter().zip(&record.partitions) {
                let (key, offset) = entry(at, partition, *seq);
                batch.insert(key, &keys::seq(offset));
                in_batch += 1;
            }
            if in_batch >= BATCH {
                indexed += in_batch as u64;
                in_batch = 0;
                if let Err(e) = self
                    .partition_events
                    .apply_batch(std::mem::take(&mut batch))
                {
                    failed = Some(e);
                    return ControlFlow::Break(());
                }
            }
            ControlFlow::Continue(())
        })
        .map_err(log_error)?;
        if let Some(e) = failed {
            return Err(e.into());
        }
        self.partition_events.apply_batch(batch)?;
        indexed += in_batch as u64;
        self.meta
            .insert(keys::meta::PARTITION_EVENTS_INDEXED, &[1])?;
        if indexed > 0 {
            tracing::info!(indexed, "event log indexed by partition");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::port::*;
    use crate::test_support::*;
    use crate::Position;
    use model::ids::ConversationId;
    use model::ids::PartitionKey;

    fn conversation(id: &str) -> PartitionKey {
        PartitionKey::Conversation(ConversationId::new(id))
    }

    /// The ids and pending flags of a partition's events as the index reads them.
    fn events_of(store: &SledStore, id: &str) -> Vec<(String, bool)> {
        store
            .partition_events(&conversation(id))
            .expect("read")
            .into_iter()
            .map(|(record, pending)| (record.id.as_str().to_owned(), pending))
            .collect()
    }

    fn entries(store: &SledStore) -> usize {
        store.partition_events.len()
    }

    #[test]
    fn a_partitions_events_are_its_own_in_order_folded_or_not() {
        let (_d, store) = store();
        accept(&store, &delivery("d1", &[("e1", "c1", 1), ("e2", "c2", 2)]));
        accept(&store, &delivery("d2", &[("e3", "c1", 3)]));
        // Nothing folded: found in the log's tail, all pending.
        assert_eq!(
            events_of(&store, "c1"),
            [("e1".into(), true), ("e3".into(), true)]
        );
        assert_eq!(entries(&store), 0, "only folds write the index");
        drain(&store);
        assert_eq!(entries(&store), 3);
        assert_eq!(
            events_of(&store, "c1"),
            [("e1".into(), false), ("e3".into(), false)]
        );
        assert_eq!(events_of(&store, "c2"), [("e2".into(), false)]);
        // A partition whose key another's starts with is not mixed in.
        accept(&store, &delivery("d3", &[("e4", "c11", 4)]));
        assert_eq!(
            events_of(&store, "c1"),
            [("e1".into(), false), ("e3".into(), false)]
        );
        assert_eq!(events_of(&store, "c11"), [("e4".into(), true)]);
        assert!(events_of(&store, "nobody").is_empty());
    }

    #[test]
    fn the_index_is_read_without_the_log_before_the_watermark() {
        let (_d, store) = store();
        accept(&store, &delivery("d1", &[("e1", "c1", 1)]));
        drain(&store);
        // A frame the index does not name is not read: an event of c1 logged before the
        // watermark with no entry (as if the index had lost it) is not found...
        store.partition_events.clear().expect("clear");
        assert!(events_of(&store, "c1").is_empty());
        // ... and one found only by the tail scan is, until the watermark passes it.
        accept(&store, &delivery("d2", &[("e2", "c1", 2)]));
        assert_eq!(events_of(&store, "c1"), [("e2".into(), true)]);
    }

    #[test]
    fn a_store_from_before_the_index_is_indexed_once_on_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("store");
        {
            let store = SledStore::open(&path, 8 << 20).expect("open");
            accept(&store, &delivery("d1", &[("e1", "c1", 1), ("e2", "c2", 2)]));
            drain(&store);
            accept(&store, &delivery("d2", &[("e3", "c1", 3)]));
            // As an older build left it: no index, no mark.
            store.partition_events.clear().expect("clear");
            store
                .meta
                .remove(keys::meta::PARTITION_EVENTS_INDEXED)
                .expect("unmark");
            store.flush().expect("flush");
        }
        let store = SledStore::open(&path, 8 << 20).expect("reopen");
        assert_eq!(entries(&store), 3, "every logged event, folded or not");
        assert_eq!(
            events_of(&store, "c1"),
            [("e1".into(), false), ("e3".into(), true)]
        );
        // Once: a second open does not index again (what the folds removed stays removed).
        store.partition_events.clear().expect("clear");
        drop(store);
        let store = SledStore::open(&path, 8 << 20).expect("reopen");
        assert_eq!(entries(&store), 0);
    }

    #[test]
    fn a_pruned_segments_events_leave_the_index_with_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Tiny segments: every delivery gets its own.
        let store = SledStore::open_with(&dir.path().join("store"), 8 << 20, 10).expect("open");
        for (d, e, at) in [("d1", "e1", 100), ("d2", "e2", 200), ("d3", "e3", 10_000)] {
            accept_at(&store, &delivery(d, &[(e, "c1", 1)]), at);
        }
        drain(&store);
        assert_eq!(entries(&store), 3);
        let pruned = store.prune(5_000, 5_000).expect("prune");
        assert_eq!(pruned.event_chunks, 1, "segment 1 (e1) goes");
        assert_eq!(entries(&store), 2);
        assert_eq!(
            events_of(&store, "c1"),
            [("e2".into(), false), ("e3".into(), false)]
        );
        // An entry a crash kept for a segment gone (segment 1): never read, removed by the next
        // pass even when it deletes nothing.
        let (key, offset) = entry(
            eventlog::LogPosition {
                segment: 1,
                offset: 0,
            },
            "c:c1",
            1,
        );
        store
            .partition_events
            .insert(key, &keys::seq(offset))
            .expect("insert");
        assert_eq!(events_of(&store, "c1").len(), 2);
        assert_eq!(store.prune(5_000, 5_000).expect("prune").event_chunks, 0);
        assert_eq!(entries(&store), 2);
    }

    #[test]
    fn an_event_passed_over_is_indexed_as_the_fold_passes_it() {
        let (_d, store) = store();
        accept(&store, &delivery("d1", &[("e1", "c1", 1), ("e2", "c1", 2)]));
        let (records, end) = pending_records(&store);
        let second = records[1].0.clone();
        let position = Position {
            fold_from: Some(end),
            passed: vec![second],
            ..Default::default()
        };
        fold_picked(&store, &records, |r| r.id.as_str() == "e1", &position);
        assert_eq!(entries(&store), 2);
        assert_eq!(
            events_of(&store, "c1"),
            [("e1".into(), false), ("e2".into(), false)]
        );
    }
}
