//! The in-memory store's folds: a session under its fold lock, and the commit of a write set
//! under its data lock, wholly or (a failure injected) not at all.

use super::{Data, MemStore};
use crate::outbox::ActionStatus;
use crate::port::{FoldSession, Folds, ReplayEvents};
use crate::{Applied, EventRecord, Pending, PendingEvent, StoreError};
use engine::batch::{FoldReads, WriteSet};
use engine::index::QueueSpot;
use engine::state::queue::AcceptHistory;
use engine::state::stats::HandoffStats;
use engine::state::{BotState, ConversationState, EndUserState};
use model::cursor::Cursor;
use model::ids::{ConversationId, EndUserId, PartitionKey};
use model::webhook::model::Millis;
use std::collections::HashSet;
use std::sync::atomic::Ordering;

fn cursor(seq: u64) -> Cursor {
    Cursor::from_raw(u128::from(seq))
}

/// A cursor this store made, back as a sequence number.
pub(super) fn seq_of(at: Cursor) -> u64 {
    u64::try_from(at.raw()).unwrap_or(u64::MAX)
}

impl MemStore {
    fn pending_until(&self, until: Option<u64>) -> Result<Pending, StoreError> {
        let data = self.data();
        let mut events = Vec::new();
        for seq in data.events.range(seq_of(data.fold_from)..).map(|(s, _)| *s) {
            if until.is_some_and(|until| seq >= until) {
                break;
            }
            if data.is_pending(seq) {
                events.push(pending_event(&data, seq)?);
            }
        }
        let end = cursor(until.unwrap_or(data.next_seq));
        Ok(Pending { events, end })
    }
}

/// Event `seq` (stored) as the dispatcher queues it.
fn pending_event(data: &Data, seq: u64) -> Result<PendingEvent, StoreError> {
    let partition = data.events.get(&seq).map(|e| e.partition.as_str());
    let partition = partition
        .and_then(PartitionKey::decode)
        .ok_or_else(|| StoreError::Corrupt("event partition".into()))?;
    Ok(PendingEvent {
        seq,
        partition,
        at: cursor(seq),
    })
}

impl Folds for MemStore {
    fn pending(&self) -> Result<Pending, StoreError> {
        self.pending_until(None)
    }

    fn pending_before_writer(&self) -> Result<Pending, StoreError> {
        let until = self.data().writer_from;
        self.pending_until(until)
    }

    fn event_at(&self, seq: u64, at: Cursor) -> Result<Option<EventRecord>, StoreError> {
        match seq_of(at) == seq {
            true => Ok(self.data().record(seq)),
            false => Err(StoreError::Corrupt(
                "an event's cursor is its number".into(),
            )),
        }
    }

    fn begin_fold(&self) -> Result<Box<dyn FoldSession + '_>, StoreError> {
        Ok(Box::new(MemFold {
            store: self,
            _folding: self.fold_guard(),
        }))
    }

    fn fold_from(&self) -> Result<Cursor, StoreError> {
        Ok(self.data().fold_from)
    }

    /// A range of the events by number (the cursor), not a scan from the watermark.
    fn pending_from(&self, from: Cursor, limit: usize) -> Result<Pending, StoreError> {
        let data = self.data();
        let mut events = Vec::new();
        let start = seq_of(from.max(data.fold_from));
        for seq in data.events.range(start..).map(|(s, _)| *s) {
            if !data.is_pending(seq) {
                continue;
            }
            if events.len() == limit {
                return Ok(Pending {
                    events,
                    end: cursor(seq),
                });
            }
            events.push(pending_event(&data, seq)?);
        }
        let end = cursor(data.next_seq).max(from);
        Ok(Pending { events, end })
    }

    fn advance_fold_from(&self, to: Cursor) -> Result<(), StoreError> {
        let _folding = self.fold_guard();
        let mut data = self.data();
        self.fenced(&data)?;
        data.fold_from = data.fold_from.max(to);
        Ok(())
    }
}

/// A fold under way: holds the fold lock; each read takes the data lock briefly.
struct MemFold<'s> {
    store: &'s MemStore,
    _folding: std::sync::MutexGuard<'s, ()>,
}

impl FoldReads for MemFold<'_> {
    type Error = StoreError;

    fn conversation(
        &mut self,
        id: &ConversationId,
    ) -> Result<Option<ConversationState>, StoreError> {
        Ok(self.store.data().conversations.get(id.as_str()).cloned())
    }

    fn end_user(&mut self, id: &EndUserId) -> Result<Option<EndUserState>, StoreError> {
        Ok(self.store.data().end_users.get(id.as_str()).cloned())
    }

    fn bot(&mut self, id: &str) -> Result<Option<BotState>, StoreError> {
        Ok(self.store.data().bots.get(id).cloned())
    }

    fn folded_mark(&mut self, partition: &str) -> Result<Option<u64>, StoreError> {
        Ok(self.store.data().marks.get(partition).copied())
    }

    fn decided_before(&mut self, action_id: &str) -> Result<bool, StoreError> {
        Ok(self.store.data().ledger.contains_key(action_id))
    }

    fn ledger_state(&mut self, action_id: &str) -> Result<Option<String>, StoreError> {
        let data = self.store.data();
        Ok(data.ledger.get(action_id).map(|s| s.state.clone()))
    }

    fn accept_history(&mut self, bot: &str) -> Result<Option<AcceptHistory>, StoreError> {
        Ok(self.store.data().accepts.get(bot).cloned())
    }

    fn hour_stats(&mut self, hour: Millis) -> Result<Option<HandoffStats>, StoreError> {
        Ok(self.store.data().hours.get(&hour).cloned())
    }

    fn waiting_standing(
        &mut self,
        bot: &str,
        own: Option<QueueSpot<'_>>,
        found: &mut dyn Iterator<Item = QueueSpot<'_>>,
    ) -> Result<(usize, usize), StoreError> {
        Ok(waiting_standing(&self.store.data(), bot, own, found))
    }
}

/// See `FoldReads::waiting_standing`.
pub(super) fn waiting_standing(
    data: &Data,
    bot: &str,
    own: Option<QueueSpot<'_>>,
    found: &mut dyn Iterator<Item = QueueSpot<'_>>,
) -> (usize, usize) {
    let mine = data.queue.iter().filter(|(b, _, _)| b == bot);
    let (mut length, mut ahead) = (0, 0);
    for (_, since, conversation) in mine {
        let spot = QueueSpot {
            since: *since,
            conversation,
        };
        length += 1;
        ahead += usize::from(own.is_some_and(|o| spot < o));
    }
    for f in found {
        let key = (bot.to_owned(), f.since, f.conversation.to_owned());
        if data.queue.contains(&key) {
            length -= 1;
            ahead -= usize::from(own.is_some_and(|o| f < o));
        }
    }
    (length, ahead)
}

impl FoldSession for MemFold<'_> {
    fn now(&self) -> Millis {
        self.store.0.clock.now_millis()
    }

    fn replay_events(&mut self, from: Millis, to: Millis) -> Result<ReplayEvents, StoreError> {
        let data = self.store.data();
        let conversation =
            |p: &str| matches!(PartitionKey::decode(p), Some(PartitionKey::Conversation(_)));
        let mut out = ReplayEvents::default();
        let mut wanted = HashSet::new();
        let mut last = None;
        for (seq, e) in &data.events {
            if e.received_at >= from && e.received_at < to && conversation(&e.partition) {
                match data.is_pending(*seq) {
                    true => out.pending += 1,
                    false => {
                        wanted.insert(e.partition.as_str());
                        last = Some(*seq);
                    }
                }
            }
        }
        let Some(last) = last else { return Ok(out) };
        for (seq, e) in data.events.range(..=last) {
            if wanted.contains(e.partition.as_str()) && !data.is_pending(*seq) {
                out.events
                    .extend(data.record(*seq).and_then(crate::fold::replayed));
            }
        }
        Ok(out)
    }

    /// Under the data lock at once: every write, or (a failure injected) none.
    fn commit(self: Box<Self>, writes: WriteSet) -> Result<Applied, StoreError> {
        self.store.pass_commit();
        if self.store.0.fail_next_commit.swap(false, Ordering::SeqCst) {
            return Err(StoreError::Internal("a commit failed on purpose".into()));
        }
        let earliest = writes.timers.earliest;
        let applied = {
            let mut data = self.store.data();
            self.store.fenced(&data)?;
            commit(&mut data, writes)
        };
        if let Some(due_at) = earliest {
            self.store.1.timer_wakeup.started(due_at);
        }
        Ok(applied)
    }
}

/// Apply a write set: outbox entries numbered, states, marks, the watermark, timers and queue.
fn commit(data: &mut Data, writes: WriteSet) -> Applied {
    let WriteSet {
        conversations,
        end_users,
        bots,
        partitions,
        fold_from,
        timers,
        queue,
        mut applied,
        ..
    } = writes;
    for entry in &mut applied.outbox {
        entry.seq = data.next_id();
        let status = ActionStatus::pending(entry.seq, entry.decided_at);
        data.ledger.insert(entry.id.clone(), status);
        data.outbox.insert(entry.seq, entry.clone());
    }
    for w in conversations {
        data.conversations
            .insert(w.state.id.as_str().to_owned(), w.state);
    }
    for w in end_users {
        if let (Some(p), Some(k)) = (&w.state.platform, &w.state.user_key) {
            let key = (p.as_str().to_owned(), k.as_str().to_owned());
            data.user_index.insert(key, w.state.id.as_str().to_owned());
        }
        data.end_users
            .insert(w.state.id.as_str().to_owned(), w.state);
    }
    for w in bots {
        data.bots.insert(w.state.id.as_str().to_owned(), w.state);
    }
    for p in partitions {
        if let Some(mark) = p.mark {
            data.marks.insert(p.partition.encode(), mark);
        }
    }
    if let Some(at) = fold_from {
        data.fold_from = at;
    }
    for t in timers.stopped {
        data.timers.remove(&t);
    }
    for s in timers.started {
        data.timers.insert(s.timer, (s.started_by, s.bot_id));
    }
    for e in queue.left {
        data.queue.remove(&(e.bot, e.since, e.conversation));
    }
    for e in queue.joined {
        data.queue.insert((e.bot, e.since, e.conversation));
    }
    data.accepts.extend(queue.accepts);
    data.hours.extend(queue.hours);
    applied
}
