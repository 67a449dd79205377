//! The in-memory store's retention: the same bounds as the sled backend's (nothing a fold, the
//! dedupe window or an open outbox entry still needs goes), without its chunks' costs.

use super::fold::seq_of;
use super::{Data, MemStore};
use crate::port::{Removed, Retention};
use crate::retention::StatesPruned;
use crate::{Pruned, StoreError};
use engine::index::{conversation_activity, end_user_activity};
use model::cursor::Cursor;
use model::webhook::model::Millis;
use std::collections::HashSet;

/// What a state pass must leave: the partitions with an event from the watermark on (still to
/// fold, or folded since), a conversation event's end user among them, and the outbox queues with
/// a pending entry.
struct Needed {
    below: u64,
    partitions: HashSet<String>,
    queues: HashSet<String>,
}

impl Needed {
    fn of(data: &Data) -> Needed {
        let below = seq_of(data.fold_from);
        let mut partitions = HashSet::new();
        for e in data.events.range(below..).map(|(_, e)| e) {
            partitions.insert(e.partition.clone());
            partitions.extend(e.names_end_user.as_ref().map(|u| format!("u:{u}")));
        }
        let queues = data.outbox.values().map(|e| e.queue.clone()).collect();
        Needed {
            below,
            partitions,
            queues,
        }
    }

    /// Whether a state of `partition` (whose entries wait in `queues`) may go.
    fn idle(&self, data: &Data, partition: &str, queues: &[String]) -> bool {
        let folded = data.marks.get(partition).is_none_or(|m| *m < self.below);
        folded
            && !self.partitions.contains(partition)
            && !queues.iter().any(|q| self.queues.contains(q))
    }
}

/// The number of chunks of `chunk` that `n` candidates take.
fn chunks(n: usize, chunk: usize) -> u64 {
    n.div_ceil(chunk.max(1)) as u64
}

impl Data {
    fn prune_conversations(&mut self, before: Millis, chunk: usize, out: &mut StatesPruned) {
        let needed = Needed::of(self);
        let old: Vec<String> = self
            .conversations
            .values()
            .filter(|s| conversation_activity(s) < before)
            .map(|s| s.id.as_str().to_owned())
            .collect();
        out.chunks += chunks(old.len(), chunk);
        for id in old {
            let partition = format!("c:{id}");
            let queues = [partition.clone(), format!("helpdesk:{id}")];
            if !needed.idle(self, &partition, &queues) {
                out.skipped += 1;
                continue;
            }
            self.conversations.remove(&id);
            self.marks.remove(&partition);
            self.queue.retain(|(_, _, c)| *c != id);
            let timers = self.timers.len();
            self.timers.retain(|t, _| t.conversation != id);
            out.timers += (timers - self.timers.len()) as u64;
            out.conversations += 1;
        }
    }

    fn prune_end_users(&mut self, before: Millis, chunk: usize, out: &mut StatesPruned) {
        let needed = Needed::of(self);
        let old: Vec<String> = self
            .end_users
            .values()
            .filter(|u| end_user_activity(u) < before)
            .map(|u| u.id.as_str().to_owned())
            .collect();
        out.chunks += chunks(old.len(), chunk);
        for id in old {
            let partition = format!("u:{id}");
            let last = self
                .end_users
                .get(&id)
                .and_then(|u| u.last_conversation_id.value.clone());
            let kept = last.is_some_and(|c| self.conversations.contains_key(c.as_str()));
            if kept || !needed.idle(self, &partition, std::slice::from_ref(&partition)) {
                out.skipped += 1;
                continue;
            }
            self.end_users.remove(&id);
            self.marks.remove(&partition);
            self.user_index.retain(|_, named| *named != id);
            out.end_users += 1;
        }
    }
}

impl Retention for MemStore {
    fn prune_events(
        &self,
        dedupe_before: Millis,
        events_before: Millis,
        fold_from: Cursor,
    ) -> Result<Pruned, StoreError> {
        let mut data = self.data();
        self.fenced(&data)?;
        let ids = data.event_ids.len() + data.deliveries.len();
        data.event_ids.retain(|_, (_, at)| *at >= dedupe_before);
        data.deliveries.retain(|_, at| *at >= dedupe_before);
        let forgotten = ids - data.event_ids.len() - data.deliveries.len();
        let gone: Vec<u64> = data
            .events
            .range(..seq_of(fold_from))
            .filter(|(_, e)| e.received_at < events_before && e.received_at < dedupe_before)
            .map(|(seq, _)| *seq)
            .collect();
        for seq in &gone {
            data.events.remove(seq);
        }
        Ok(Pruned {
            ids_forgotten: forgotten as u64,
            event_chunks: gone.len() as u64,
        })
    }

    fn prune_states(&self, before: Millis, chunk: usize) -> Removed<StatesPruned> {
        let _folding = self.fold_guard();
        let mut data = self.data();
        let mut removed = StatesPruned::default();
        if let Err(e) = self.fenced(&data) {
            return Removed {
                removed,
                failed: Some(e),
            };
        }
        data.prune_conversations(before, chunk, &mut removed);
        data.prune_end_users(before, chunk, &mut removed);
        Removed {
            removed,
            failed: None,
        }
    }

    fn prune_quarantine(&self, before: Millis, _chunk: usize) -> Removed<u64> {
        let mut data = self.data();
        if let Err(e) = self.fenced(&data) {
            return Removed {
                removed: 0,
                failed: Some(e),
            };
        }
        let old: Vec<u64> = data
            .quarantine
            .iter()
            .take_while(|(_, r)| r.received_at < before)
            .map(|(id, _)| *id)
            .collect();
        for id in &old {
            data.quarantine.remove(id);
        }
        Removed {
            removed: old.len() as u64,
            failed: None,
        }
    }

    fn prune_ledger(&self, before: Millis, limit: usize) -> Result<(u64, u64), StoreError> {
        let mut data = self.data();
        self.fenced(&data)?;
        let finished = |s: &crate::outbox::ActionStatus| {
            (s.state == "done" || s.state == "dropped") && s.at < before
        };
        let ledger: Vec<String> = data
            .ledger
            .iter()
            .filter(|(_, s)| finished(s))
            .take(limit)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &ledger {
            data.ledger.remove(id);
        }
        let done: Vec<u64> = data
            .done
            .iter()
            .filter(|(_, r)| r.at < before)
            .take(limit)
            .map(|(seq, _)| *seq)
            .collect();
        for seq in &done {
            data.done.remove(seq);
        }
        Ok((ledger.len() as u64, done.len() as u64))
    }

    fn prune_idempotency(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        let mut data = self.data();
        self.fenced(&data)?;
        let old: Vec<(String, String)> = data
            .idempotency
            .iter()
            .filter(|(_, r)| r.at < before)
            .take(limit)
            .map(|(k, _)| k.clone())
            .collect();
        for key in &old {
            data.idempotency.remove(key);
        }
        Ok(old.len() as u64)
    }

    fn prune_operator_actions(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        let mut data = self.data();
        self.fenced(&data)?;
        let old: Vec<u64> = data
            .operators
            .iter()
            .take(limit)
            .take_while(|(_, a)| a.at < before)
            .map(|(id, _)| *id)
            .collect();
        for id in &old {
            data.operators.remove(id);
        }
        Ok(old.len() as u64)
    }

    fn prune_handoff_stats(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        let _folding = self.fold_guard();
        let mut data = self.data();
        self.fenced(&data)?;
        let hour = engine::state::stats::hour_of(before);
        let old: Vec<Millis> = data
            .hours
            .range(..hour)
            .take(limit)
            .map(|(h, _)| *h)
            .collect();
        for h in &old {
            data.hours.remove(h);
        }
        Ok(old.len() as u64)
    }

    fn oldest_event_received_at(&self) -> Result<Option<Millis>, StoreError> {
        Ok(self.data().events.values().next().map(|e| e.received_at))
    }
}
