//! The sled backend's side of a fold: a session under the fold lock ([`SledFold`]: the reads the
//! engine's batch fold makes, `engine::batch::FoldReads`), and the commit of the engine's
//! [`WriteSet`] as one journal (`journal`).
//!
//! Reading and folding happen before anything is written, and the journal then only writes.
//! That is safe because folds are serialised by the fold lock and nothing else writes states or
//! folded marks (the retention pass removes them under the same lock).

use super::{corrupt, eventlog, log_error, EventRecord, Pending};
use super::{encode, get_decoded, keys, outbox, SledStore, StoreError};
use crate::journal::{Journal, TreeId as T};
use crate::port::{FoldSession, Folds, ReplayEvents};
use engine::batch::{Applied, FoldError, FoldReads, StateWrite, WriteSet};
use engine::index::QueueSpot;
use engine::state::queue::AcceptHistory;
use engine::state::stats::HandoffStats;
use engine::state::{BotState, ConversationState, EndUserState};
use model::cursor::Cursor;
use model::ids::{ConversationId, EndUserId};
use model::webhook::model::Millis;
use serde::Serialize;

/// A fold under way on the sled store: holds the fold lock until committed or dropped.
pub(crate) struct SledFold<'s> {
    store: &'s SledStore,
    _folding: std::sync::MutexGuard<'s, ()>,
}

impl From<FoldError> for StoreError {
    fn from(e: FoldError) -> Self {
        StoreError::Internal(e.to_string())
    }
}

impl Folds for SledStore {
    /// Every event still to fold, oldest first, and where the log ended when it was read: a
    /// start's work for the dispatcher. Scans the log from the folds' low watermark, against the
    /// partitions' folded marks.
    fn pending(&self) -> Result<Pending, StoreError> {
        self.pending_until(None)
    }

    /// [`pending`](SledStore::pending) up to where the writer's frames begin, once a writer runs
    /// (an early start's, which logs deliveries while sled opens): its indexer hands those to
    /// the dispatcher, so a start's scan must not queue them too.
    fn pending_before_writer(&self) -> Result<Pending, StoreError> {
        self.pending_until(self.log.writer_from())
    }

    /// The event `seq` of the frame at `at` (where [`pending`](SledStore::pending) or intake found
    /// it), read back from the log.
    fn event_at(&self, seq: u64, at: Cursor) -> Result<Option<EventRecord>, StoreError> {
        let record = eventlog::read_at(&self.log_dir, at.into()).map_err(log_error)?;
        match record {
            Some(record) => match record.position(seq) {
                Some(i) => Ok(Some(EventRecord::from_log(&record, i)?)),
                None => Err(corrupt("event log frame (sequence number not in it)")),
            },
            None => Ok(None),
        }
    }

    /// A fold session: the fold lock, refused while a fold is half applied (`journal`).
    fn begin_fold(&self) -> Result<Box<dyn FoldSession + '_>, StoreError> {
        Ok(Box::new(SledFold {
            store: self,
            _folding: self.fold_guard()?,
        }))
    }

    fn fold_from(&self) -> Result<Cursor, StoreError> {
        Ok(self.watermark()?.into())
    }

    /// Raise the folds' watermark to `to` (never lower it), under the fold lock: for the
    /// dispatcher once everything it received up to `to` is folded. A plain insert, durable with
    /// the next flush; an older watermark after a crash only makes a start scan more.
    fn advance_fold_from(&self, to: Cursor) -> Result<(), StoreError> {
        let _folding = self.fold_guard()?;
        if Cursor::from(self.watermark()?) < to {
            self.meta.insert(keys::meta::FOLD_FROM, &to.encode())?;
        }
        Ok(())
    }
}

impl FoldReads for SledFold<'_> {
    type Error = StoreError;

    fn conversation(
        &mut self,
        id: &ConversationId,
    ) -> Result<Option<ConversationState>, StoreError> {
        get_decoded(&self.store.conversations, id.as_str(), "state record")
    }

    fn end_user(&mut self, id: &EndUserId) -> Result<Option<EndUserState>, StoreError> {
        get_decoded(&self.store.end_users, id.as_str(), "end-user state")
    }

    fn bot(&mut self, id: &str) -> Result<Option<BotState>, StoreError> {
        get_decoded(&self.store.bots, id.as_bytes(), "state record")
    }

    fn folded_mark(&mut self, partition: &str) -> Result<Option<u64>, StoreError> {
        self.store.mark(partition)
    }

    fn decided_before(&mut self, action_id: &str) -> Result<bool, StoreError> {
        Ok(self.store.actions.contains_key(action_id.as_bytes())?)
    }

    fn ledger_state(&mut self, action_id: &str) -> Result<Option<String>, StoreError> {
        Ok(self.store.action_status(action_id)?.map(|s| s.state))
    }

    fn accept_history(&mut self, bot: &str) -> Result<Option<AcceptHistory>, StoreError> {
        get_decoded(
            &self.store.queue,
            keys::queue_history(bot),
            "accept history",
        )
    }

    fn hour_stats(&mut self, hour: Millis) -> Result<Option<HandoffStats>, StoreError> {
        let key = keys::queue_stats(hour);
        match get_decoded(&self.store.queue, key, "handoff stats") {
            Err(StoreError::Corrupt(e)) => {
                tracing::error!(hour, error = %e, "unreadable handoff figures; the hour is counted afresh");
                Ok(None)
            }
            other => other,
        }
    }

    fn waiting_standing(
        &mut self,
        bot: &str,
        own: Option<QueueSpot<'_>>,
        found: &mut dyn Iterator<Item = QueueSpot<'_>>,
    ) -> Result<(usize, usize), StoreError> {
        Ok(self.store.waiting_standing(bot, own, found))
    }
}

impl FoldSession for SledFold<'_> {
    fn now(&self) -> Millis {
        self.store.clock.now_millis()
    }

    fn replay_events(&mut self, from: Millis, to: Millis) -> Result<ReplayEvents, StoreError> {
        self.store.replay_events(from, to)
    }

    /// One journal, under the fold lock this session holds: see [`SledStore::commit_fold`].
    fn commit(self: Box<Self>, writes: WriteSet) -> Result<Applied, StoreError> {
        self.store.commit_fold(writes)
    }
}

impl SledStore {
    /// Write what a fold batch changed in one journal, under the fold lock the caller holds;
    /// its outbox entries are numbered first, in decision order.
    fn commit_fold(&self, writes: WriteSet) -> Result<Applied, StoreError> {
        let mut writes = writes;
        for entry in &mut writes.applied.outbox {
            entry.seq = self.db.generate_id()?;
        }
        let waiting = crate::queue::WaitingChanges::of(&writes.queue);
        let earliest_timer = writes.timers.earliest;
        let journal = self.fold_journal(&writes)?;
        self.commit_journal(&journal)?;
        // Still under the fold lock: the counts follow the commits in order.
        self.note_waiting(&waiting);
        if let Some(due_at) = earliest_timer {
            self.timer_wakeup.started(due_at);
        }
        Ok(writes.applied)
    }

    /// A fold's writes (and the entries it decided) as one journal (see `journal`), in the order
    /// they are applied, which is what a reader outside the fold lock may see half done: the
    /// outbox entries before the states that decided them, and the folded marks and the
    /// watermark last (a reader that finds an event folded finds its state). Record counts are
    /// read here, under the fold lock, and written as absolute values, so applying the journal
    /// twice is harmless.
    fn fold_journal(&self, writes: &WriteSet) -> Result<Journal, StoreError> {
        let mut j = Journal::default();
        journal_indexes(&mut j, writes)?;
        outbox::journal_pending(&mut j, &writes.applied.outbox)?;
        journal_states(&mut j, writes)?;
        // Record counts kept with the records, so a start need not count whole trees (which
        // makes sled load every page: most of a restarted daemon's memory).
        let applied = &writes.applied;
        for (key, new) in [
            (keys::meta::COUNT_CONVERSATIONS, applied.new_conversations),
            (keys::meta::COUNT_END_USERS, applied.new_end_users),
            (keys::meta::COUNT_BOTS, applied.new_bots),
        ] {
            if new == 0 {
                continue;
            }
            let count = self.meta.get(key)?.and_then(|b| keys::parse_seq(&b));
            j.insert(T::Meta, key, keys::seq(count.unwrap_or(0) + new));
        }
        for partition in &writes.partitions {
            let key = partition.partition.encode();
            for (seq, at) in &partition.events {
                let (key, offset) = crate::history::entry((*at).into(), &key, *seq);
                j.insert(T::PartitionEvents, key, keys::seq(offset));
            }
        }
        for partition in &writes.partitions {
            if let Some(mark) = partition.mark {
                j.insert(T::Folded, partition.partition.encode(), keys::seq(mark));
            }
        }
        if let Some(at) = writes.fold_from {
            j.insert(T::Meta, keys::meta::FOLD_FROM, at.encode());
        }
        Ok(j)
    }
}

/// The index trees' part of a fold's journal: timers, the queue tree (waiting entries, accept
/// histories, hour figures, derived keys), the retention index.
fn journal_indexes(j: &mut Journal, writes: &WriteSet) -> Result<(), StoreError> {
    for timer in &writes.timers.stopped {
        j.remove(T::Timers, crate::timers::key(timer));
    }
    for start in &writes.timers.started {
        j.insert(
            T::Timers,
            crate::timers::key(&start.timer),
            crate::timers::value(start)?,
        );
    }
    let queue = &writes.queue;
    let left = queue.left.iter().map(crate::queue::key);
    for key in left.chain(writes.derived.removed.iter().map(crate::derived::key)) {
        j.remove(T::Queue, key);
    }
    for entry in &queue.joined {
        j.insert(T::Queue, crate::queue::key(entry), Vec::new());
    }
    for (bot, history) in &queue.accepts {
        j.insert(T::Queue, keys::queue_history(bot), encode(history)?);
    }
    for (hour, figures) in &queue.hours {
        j.insert(
            T::Queue,
            keys::queue_stats(*hour).to_vec(),
            encode(figures)?,
        );
    }
    for entry in &writes.derived.added {
        j.insert(T::Queue, crate::derived::key(entry), Vec::new());
    }
    for entry in &writes.activity.removed {
        j.remove(T::Activity, crate::retention::key(entry));
    }
    for entry in &writes.activity.added {
        j.insert(T::Activity, crate::retention::key(entry), Vec::new());
    }
    Ok(())
}

/// The states' part of a fold's journal: conversations, the `(platform, userKey)` index, end
/// users, bots.
fn journal_states(j: &mut Journal, writes: &WriteSet) -> Result<(), StoreError> {
    journal_records(j, T::Conversations, &writes.conversations, |s| {
        s.id.as_str()
    })?;
    for user in &writes.end_users {
        if let (Some(p), Some(k)) = (&user.state.platform, &user.state.user_key) {
            let id = user.state.id.as_str().as_bytes();
            j.insert(T::UserIndex, keys::user_index(p.as_str(), k.as_str()), id);
        }
    }
    journal_records(j, T::EndUsers, &writes.end_users, |u| u.id.as_str())?;
    journal_records(j, T::Bots, &writes.bots, |b| b.id.as_str())
}

fn journal_records<S: Serialize>(
    j: &mut Journal,
    tree: T,
    states: &[StateWrite<S>],
    id: impl Fn(&S) -> &str,
) -> Result<(), StoreError> {
    for write in states {
        j.insert(tree, id(&write.state).as_bytes(), encode(&write.state)?);
    }
    Ok(())
}

/// A stored event re-run by a replay, parsed (one that no longer parses is left out).
pub fn replayed(record: super::EventRecord) -> Option<engine::replay::Replayed> {
    let event = model::webhook::parse_event(record.event.get()).ok()?;
    Some(engine::replay::Replayed {
        partition: record.partition,
        received_at: record.received_at,
        event,
    })
}
