//! Replay's reads in the sled backend: which stored events a replay re-runs (the loop is the
//! engine's, `engine::replay`; the port's `Folds::replay` runs it in a fold session).

use super::{EventRecord, SledStore, StoreError};
use crate::port::ReplayEvents;
use model::ids::PartitionKey;
use model::webhook::model::Millis;
use std::collections::HashSet;
use std::ops::ControlFlow;

pub use engine::replay::{ReplayCapped, ReplayItem, ReplayReport, ReplayRequest};

impl SledStore {
    /// See [`FoldSession::replay_events`](crate::port::FoldSession::replay_events): two scans of
    /// the log, under the fold lock the caller holds.
    pub(crate) fn replay_events(
        &self,
        from: Millis,
        to: Millis,
    ) -> Result<ReplayEvents, StoreError> {
        let window = |r: &EventRecord| r.received_at >= from && r.received_at < to;
        let mut out = ReplayEvents::default();
        let Some((wanted, last_seq)) = self.replay_scope(window, &mut out.pending)? else {
            return Ok(out);
        };
        out.events = self
            .replay_records(&wanted, last_seq)?
            .into_iter()
            .filter_map(crate::fold::replayed)
            .collect();
        Ok(out)
    }

    /// Pass 1: the conversations with events in the window, and where the window ends (none if
    /// it has no folded conversation event); counts the window's pending events.
    fn replay_scope(
        &self,
        in_window: impl Fn(&EventRecord) -> bool,
        pending_events: &mut u64,
    ) -> Result<Option<(HashSet<String>, u64)>, StoreError> {
        let mut wanted = HashSet::new();
        let mut last_seq = None;
        self.scan_events(|record, pending| {
            let conversation = matches!(
                PartitionKey::decode(&record.partition),
                Some(PartitionKey::Conversation(_))
            );
            if in_window(&record) && conversation {
                if pending {
                    *pending_events += 1;
                } else {
                    wanted.insert(record.partition.clone());
                    last_seq = Some(record.seq);
                }
            }
            ControlFlow::Continue(())
        })?;
        Ok(last_seq.map(|last_seq| (wanted, last_seq)))
    }

    /// Pass 2's input: the wanted conversations' folded events, from their first stored one up
    /// to the window's end.
    fn replay_records(
        &self,
        wanted: &HashSet<String>,
        last_seq: u64,
    ) -> Result<Vec<EventRecord>, StoreError> {
        let mut records = Vec::new();
        self.scan_events(|record, pending| {
            if record.seq > last_seq {
                return ControlFlow::Break(());
            }
            if wanted.contains(&record.partition) && !pending {
                records.push(record);
            }
            ControlFlow::Continue(())
        })?;
        Ok(records)
    }
}
