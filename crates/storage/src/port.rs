//! The storage port: what the daemon asks of a store, named for its needs and cut in the groups
//! of `docs/storage-port.md` (each group's guarantees are written there). [`Storage`] is all of
//! them; the daemon holds a [`Store`](crate::Store), a shared `dyn Storage`, and its intake as a
//! [`Writer`] (a handle on a backend's [`IntakeWriter`]), and never names a backend outside its
//! composition root (which opens one and starts its writer) and the offline backup (which copies
//! one).
//!
//! A backend implements the groups' traits, a [`FoldSession`] (the reads of the engine's batch
//! fold, `engine::batch::FoldReads`, and the atomic commit of its `WriteSet`) and an [`IntakeWriter`]:
//! the fold's loop, replay's and the audit's are the engine's ([`Folds::fold`] and
//! [`Folds::replay`] are provided). Positions in the event log cross the port as opaque
//! cursors (`model::cursor::Cursor`), running timers as [`TimerKey`](crate::TimerKey)s. Every
//! method is object safe (callbacks are `dyn`). [`SledStore`](crate::SledStore) is today's backend;
//! `storage::mem::MemStore` (tests) the second, and `storage::conformance` checks both. Several
//! nodes share a store through its [`Lease`] group (`storage::lease`), and ask the active node's
//! work of it through [`Asks`] (`storage::asks`).

use crate::asks::Asks;
use crate::desk::{DeskCursor, DeskPage};
use crate::desk_links::DeskLinks;
use crate::idempotency::IdempotencyRecord;
use crate::lease::Lease;
use crate::operators::OperatorAction;
use crate::queue::{BotWaiting, QueueSummary};
use crate::replay::{ReplayReport, ReplayRequest};
use crate::retention::StatesPruned;
use crate::timers::{DueTimer, TimerKey, TimerWakeup};
use crate::watch::Watched;
use crate::writer::{AcceptJob, WriterError};
use crate::{
    AcceptRequest, Accepted, Applied, EventRecord, Pending, Position, Pruned, QuarantineMeta,
    QuarantineRecord, Sizes, StoreError,
};
use engine::batch::{FoldReads, WriteSet};
use engine::decide::Decide;
use engine::replay::Replayed;
use engine::state::desk::DeskPhase;
use engine::state::queue::Standing;
use engine::state::stats::HandoffStats;
use engine::state::{BotState, ConversationState, EndUserState};
use model::action::{DeadLetter, DoneRecord, OutboxEntry, RetryState};
use model::cursor::Cursor;
use model::ids::{ConversationId, DeliveryId, EndUserId, EventId, PartitionKey};
use model::webhook::model::{Event, Millis};
use model::webhook::IncomingEvent;
use std::collections::HashMap;
use std::sync::Arc;

/// Every group of the port: what the daemon's store is.
pub trait Storage:
    Ingest
    + Folds
    + Outbox
    + Timers
    + Reads
    + Quarantine
    + OperatorLog
    + Retention
    + Lifecycle
    + DeskLinks
    + Lease
    + Asks
    + Send
    + Sync
{
}

impl<T> Storage for T where
    T: Ingest
        + Folds
        + Outbox
        + Timers
        + Reads
        + Quarantine
        + OperatorLog
        + Retention
        + Lifecycle
        + DeskLinks
        + Lease
        + Asks
        + Send
        + Sync
{
}

/// A backend's intake writer: its group commit of deliveries, reached through the [`Writer`] handle. Each
/// call answers on its `reply` (a dropped reply: the intake stopped).
pub trait IntakeWriter: Send + Sync {
    /// Take a delivery: answered once its new events are durable (deduplicated against the
    /// dedupe window), or it failed.
    fn accept(&self, job: AcceptJob, reply: IntakeReply<Accepted>);
    /// Answered once everything written to the store before this call is durable (ordered after
    /// the deliveries taken before it).
    fn flush(&self, reply: IntakeReply<()>);
    /// Answered once what the caller itself wrote to the store before this call is durable (a
    /// desk's link before its call); not ordered after the deliveries taken before it, so it may
    /// be quicker.
    fn flush_own(&self, reply: IntakeReply<()>);
    /// False after a write or sync failed, until one succeeds again (`/readyz`).
    fn is_healthy(&self) -> bool;
    /// The store, once open (`None` while an early start's store opens).
    fn store(&self) -> tokio::sync::watch::Receiver<Option<crate::Store>>;
    /// Hand-overs to the dispatcher counted so far, or `None` while an accepted event is still
    /// between its check and its hand-over (a drain waiter then waits).
    fn handed_over(&self) -> Option<u64>;
}

/// Where an [`IntakeWriter`] call is answered.
pub type IntakeReply<T> = tokio::sync::oneshot::Sender<Result<T, WriterError>>;

/// The daemon's handle on the intake, whichever backend's: cheap to clone, each call waits for
/// its answer.
#[derive(Clone)]
pub struct Writer(Arc<dyn IntakeWriter>);

impl Writer {
    /// A backend's intake as the daemon holds it.
    pub fn new(intake: Arc<dyn IntakeWriter>) -> Writer {
        Writer(intake)
    }

    /// Store a delivery; returns once it is durable.
    pub async fn accept(&self, job: AcceptJob) -> Result<Accepted, WriterError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.0.accept(job, reply);
        answer.await.map_err(|_| WriterError::Stopped)?
    }

    /// Wait until everything written to the store before this call is on disk.
    pub async fn flush(&self) -> Result<(), WriterError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.0.flush(reply);
        answer.await.map_err(|_| WriterError::Stopped)?
    }

    /// Wait until what the caller itself wrote to the store (in a transaction or a plain write
    /// that returned before this call) is on disk ([`IntakeWriter::flush_own`]): for a record
    /// that must outlive a crash before a call is made (a desk's link, an operator's audit line),
    /// not for anything the writer wrote.
    pub async fn flush_own(&self) -> Result<(), WriterError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.0.flush_own(reply);
        answer.await.map_err(|_| WriterError::Stopped)?
    }

    /// False after a write or sync failed, until one succeeds again.
    pub fn is_healthy(&self) -> bool {
        self.0.is_healthy()
    }

    /// The store, once open (at once unless an early start's store still opens).
    pub async fn store(&self) -> Result<crate::Store, WriterError> {
        let mut rx = self.0.store();
        let store = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| WriterError::Stopped)?;
        store.clone().ok_or(WriterError::Stopped)
    }

    /// See [`IntakeWriter::handed_over`].
    pub fn handed_over(&self) -> Option<u64> {
        self.0.handed_over()
    }

    /// Whether the store is open (an early start's is once attached).
    #[cfg(test)]
    pub(crate) fn has_store(&self) -> bool {
        self.0.store().borrow().is_some()
    }
}

/// Ingest beside the [`Writer`] (which appends the daemon's deliveries in groups): what stores a
/// delivery with no writer running, and the backfill's position.
pub trait Ingest {
    /// Store one delivery's new events (deduplicated), durable before it returns.
    fn accept(
        &self,
        delivery: &DeliveryId,
        events: &[IncomingEvent],
        now: Millis,
    ) -> Result<Accepted, StoreError>;
    /// Store several deliveries in one append (offline: no writer may run beside it).
    fn accept_many(&self, requests: &[AcceptRequest<'_>]) -> Result<Vec<Accepted>, StoreError>;
    /// Up to when the backfill has read the service's events.
    fn backfill_cursor(&self) -> Result<Option<Millis>, StoreError>;
    fn set_backfill_cursor(&self, at: Millis) -> Result<(), StoreError>;
    /// The answer an agent command got under its idempotency key (a retried command gets it
    /// again instead of being submitted twice).
    fn idempotent_answer(
        &self,
        route: &str,
        idempotency_key: &str,
    ) -> Result<Option<IdempotencyRecord>, StoreError>;
    fn record_idempotent_answer(
        &self,
        route: &str,
        idempotency_key: &str,
        record: &IdempotencyRecord,
    ) -> Result<(), StoreError>;
}

/// The fold: the events still to fold, and fold sessions in which the engine's batch fold
/// (`engine::batch::fold_batch`) reads what it needs and the store commits its write set
/// atomically. A backend implements the reads and the commit ([`FoldSession`]); the loop is the
/// engine's ([`Folds::fold`], [`Folds::replay`]).
pub trait Folds {
    /// The events still to fold, oldest first.
    fn pending(&self) -> Result<Pending, StoreError>;
    /// The events still to fold that the writer will not hand over (those stored before it
    /// started).
    fn pending_before_writer(&self) -> Result<Pending, StoreError>;
    /// Event `seq`, stored at `at`.
    fn event_at(&self, seq: u64, at: Cursor) -> Result<Option<EventRecord>, StoreError>;
    /// [`event_at`](Folds::event_at) of each of `wanted`, in its order: a backend whose reads
    /// are round trips answers them in one.
    fn events_at(&self, wanted: &[(u64, Cursor)]) -> Result<Vec<Option<EventRecord>>, StoreError> {
        wanted
            .iter()
            .map(|&(seq, at)| self.event_at(seq, at))
            .collect()
    }
    /// A fold session: folds run one at a time (the store's fold lock, or a transaction that
    /// serialises them), and whatever else writes what folds write (retention, a replay's
    /// decisions) waits for it. Refused while an earlier fold is half applied
    /// ([`StoreError::HalfApplied`]).
    fn begin_fold(&self) -> Result<Box<dyn FoldSession + '_>, StoreError>;
    /// A position at or before every event still to fold (the folds' low watermark).
    fn fold_from(&self) -> Result<Cursor, StoreError>;
    fn advance_fold_from(&self, to: Cursor) -> Result<(), StoreError>;

    /// About `limit` of the events still to fold stored at or after `from` (more when several
    /// share one position, as a delivery's do in sled's log), oldest first, and
    /// where to read on from (`end`: past every event it returned, the log's end when it found
    /// no more): how the active of several nodes finds what the others stored, reading on from
    /// where it ended. `end` never passes an event that is not stored yet at a lower position
    /// (a table backend: an uncommitted sequence number). Provided over [`Folds::pending`] (a
    /// backend that several nodes share reads only what it returns).
    fn pending_from(&self, from: Cursor, limit: usize) -> Result<Pending, StoreError> {
        let all = self.pending()?;
        let mut events: Vec<_> = all.events.into_iter().filter(|p| p.at >= from).collect();
        if events.len() <= limit {
            return Ok(Pending {
                events,
                end: all.end.max(from),
            });
        }
        // Cut before the first position left out (a delivery's events share one in sled's
        // log): read on from there.
        let cut = events[limit].at;
        let mut keep = events.iter().take_while(|p| p.at < cut).count();
        if keep == 0 {
            keep = events.iter().take_while(|p| p.at == cut).count();
        }
        let end = events.get(keep).map_or(all.end.max(from), |p| p.at);
        events.truncate(keep);
        Ok(Pending { events, end })
    }

    /// Fold a batch (events of several partitions, in order per partition) with `rules`
    /// deciding, in one session and one atomic write: states, folded marks, decided outbox
    /// entries (numbered by the commit), timers, queue, indexes and counters. The engine's loop;
    /// backends do not override it.
    fn fold(
        &self,
        batch: &[(u64, Event)],
        partitions: &[PartitionKey],
        rules: &dyn Decide,
        received: &[Millis],
        position: &Position,
    ) -> Result<Applied, StoreError> {
        let session = self.begin_fold()?;
        fold_in(session, (batch, partitions, received), rules, position)
    }

    /// Re-run stored events through `rules` (`engine::replay`); unless a dry run, queue what is
    /// new (or forced) in one commit, as a fold would. The caller makes it durable (flush)
    /// before telling the executor. The engine's loop; backends do not override it.
    fn replay(
        &self,
        request: &ReplayRequest,
        rules: &dyn Decide,
    ) -> Result<ReplayReport, StoreError> {
        replay_in(self.begin_fold()?, request, rules)
    }
}

/// A fold under way: the reads of the engine's batch fold, and the commit of its write set.
/// Dropping it uncommitted writes nothing.
pub trait FoldSession: FoldReads<Error = StoreError> {
    /// The decisions' clock: the daemon's time now.
    fn now(&self) -> Millis;
    /// Before the engine folds `events` (with their `partitions`): read what it will ask for in
    /// a few round trips, so its reads one record at a time are answered from memory (a
    /// backend across a network). Provided: nothing (a backend in process reads fast enough).
    fn prefetch(
        &mut self,
        events: &[(u64, Event)],
        partitions: &[PartitionKey],
    ) -> Result<(), StoreError> {
        let _ = (events, partitions);
        Ok(())
    }
    /// What a replay of the events received in `[from, to)` re-runs: the folded events of the
    /// conversations with a folded event in the window, from each one's first stored event up
    /// to the window's last, in acceptance order (those that no longer parse left out); and how
    /// many of the window's conversation events are still to fold.
    fn replay_events(&mut self, from: Millis, to: Millis) -> Result<ReplayEvents, StoreError>;
    /// Commit `writes` in one atomic write, numbering its decided outbox entries in order (each
    /// number above every earlier one); what the batch did, those entries with their numbers.
    fn commit(self: Box<Self>, writes: WriteSet) -> Result<Applied, StoreError>;
}

/// See [`FoldSession::replay_events`].
#[derive(Default)]
pub struct ReplayEvents {
    pub events: Vec<Replayed>,
    pub pending: u64,
}

/// [`Folds::fold`] in `session`.
fn fold_in(
    mut session: Box<dyn FoldSession + '_>,
    (events, partitions, received): (&[(u64, Event)], &[PartitionKey], &[Millis]),
    rules: &dyn Decide,
    position: &Position,
) -> Result<Applied, StoreError> {
    session.prefetch(events, partitions)?;
    let batch = engine::batch::Batch {
        events,
        partitions,
        received,
        position,
        now: session.now(),
    };
    let writes = engine::batch::fold_batch(&mut *session, batch, rules)?;
    log_held_back(&writes.held_back);
    session.commit(writes)
}

/// The rules a fold held back (firing caps, failed templates), logged.
fn log_held_back(held_back: &[engine::batch::HeldBack]) {
    for held in held_back {
        let (conversation_id, event_id) = (&held.conversation, &held.event);
        for hit in &held.capped {
            tracing::warn!(
                rule = %hit.rule,
                %conversation_id,
                %event_id,
                fired = hit.fired,
                per = %humantime::format_duration(hit.cap.per),
                "rule firing cap reached: the rule is held back for this event"
            );
        }
        for failed in &held.failed {
            tracing::warn!(
                rule = %failed.rule,
                %conversation_id,
                %event_id,
                index = failed.index,
                error = %failed.error,
                "rule action's template failed: recorded in the state, the action skipped"
            );
        }
    }
}

/// [`Folds::replay`] in `session`.
fn replay_in(
    mut session: Box<dyn FoldSession + '_>,
    request: &ReplayRequest,
    rules: &dyn Decide,
) -> Result<ReplayReport, StoreError> {
    let stored = session.replay_events(request.from, request.to)?;
    let now = session.now();
    let mut report = engine::replay::replay(&mut *session, (request, rules, now), stored.events)?;
    report.pending_events = stored.pending;
    if report.entries.is_empty() {
        return Ok(report);
    }
    let entries = std::mem::take(&mut report.entries);
    report.entries = session.commit(WriteSet::outbox_only(entries))?.outbox;
    Ok(report)
}

/// The outbox: pending entries in decision order, their retry states, and each outcome recorded
/// once, atomically with the entry's removal.
pub trait Outbox {
    fn outbox_page(&self, after: Option<u64>, limit: usize)
        -> Result<Vec<OutboxEntry>, StoreError>;
    fn outbox_entry(&self, seq: u64) -> Result<Option<OutboxEntry>, StoreError>;
    /// Entries pending.
    fn outbox_len(&self) -> Result<usize, StoreError>;
    fn outbox_last_seq(&self) -> Result<Option<u64>, StoreError>;
    fn outbox_retry_state(&self, seq: u64) -> Result<Option<RetryState>, StoreError>;
    fn set_outbox_retry_state(&self, seq: u64, state: &RetryState) -> Result<(), StoreError>;
    fn outbox_done(
        &self,
        entry: &OutboxEntry,
        attempts: u32,
        now: Millis,
    ) -> Result<(), StoreError>;
    /// Entries carried out: their records written, then the entries removed, in one call.
    fn outbox_done_many(&self, records: &[DoneRecord]) -> Result<(), StoreError>;
    fn outbox_dead(&self, letter: &DeadLetter) -> Result<(), StoreError>;
    fn dead_letter(&self, seq: u64) -> Result<Option<DeadLetter>, StoreError>;
    fn dead_letters(&self) -> Result<Vec<DeadLetter>, StoreError>;
    fn dead_letters_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, StoreError>;
    /// A dead letter back into the outbox (`None`: no such letter).
    fn retry_dead_letter(&self, seq: u64, now: Millis) -> Result<Option<OutboxEntry>, StoreError>;
    fn drop_dead_letter(
        &self,
        seq: u64,
        reason: &str,
        now: Millis,
    ) -> Result<Option<DeadLetter>, StoreError>;
    /// Done records, newest first, before `before`.
    fn finished_page(
        &self,
        before: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DoneRecord>, StoreError>;
    fn finished_one(&self, seq: u64) -> Result<Option<DoneRecord>, StoreError>;
    /// The outbox numbers of the actions an event decided.
    fn action_seqs_of_event(&self, event_id: &str) -> Result<Vec<u64>, StoreError>;
}

/// Timers, found by due time without reading states.
pub trait Timers {
    /// At most `limit` timers due at `now` (passing over those `skip` names), and when the next
    /// one is due.
    fn due_timers(
        &self,
        now: Millis,
        limit: usize,
        skip: &dyn Fn(&TimerKey) -> bool,
    ) -> Result<(Vec<DueTimer>, Option<Millis>), StoreError>;
    /// Whether the timer still runs (its firing not folded yet).
    fn has_timer(&self, timer: &TimerKey) -> Result<bool, StoreError>;
    /// Timers running.
    fn timers_pending(&self) -> Result<u64, StoreError>;
    /// Woken by a fold that starts a timer earlier than the firer's next.
    fn timer_wakeup(&self) -> Arc<TimerWakeup>;
}

/// Reads of committed folds: records by key, keyed pages, the queue and the counts kept by the
/// folds (no read scans a whole table).
pub trait Reads {
    fn conversation(&self, id: &ConversationId) -> Result<Option<ConversationState>, StoreError>;
    fn end_user(&self, id: &EndUserId) -> Result<Option<EndUserState>, StoreError>;
    fn bot(&self, id: &str) -> Result<Option<BotState>, StoreError>;
    fn find_end_user(
        &self,
        platform: &str,
        user_key: &str,
    ) -> Result<Option<EndUserState>, StoreError>;
    fn conversations_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ConversationState>, StoreError>;
    fn end_users_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<EndUserState>, StoreError>;
    fn desk_page(
        &self,
        phase: Option<DeskPhase>,
        bot: Option<&str>,
        after: Option<&DeskCursor>,
        limit: usize,
    ) -> Result<DeskPage, StoreError>;
    /// The queue positions of those of `states` that wait, by conversation id.
    fn waiting_positions(
        &self,
        states: &[ConversationState],
    ) -> Result<HashMap<String, usize>, StoreError>;
    /// The reconcile sweep's candidates: every active conversation, then those released at or
    /// after `released_since`, at most `limit` in all (the index only).
    fn watched(&self, released_since: Millis, limit: usize) -> Result<Watched, StoreError>;
    /// How many conversations wait for an agent and since when the longest-waiting one does
    /// (kept by the folds: no scan).
    fn queue_summary(&self) -> Result<QueueSummary, StoreError>;
    /// Each bot's waiting count and oldest request, in bot order (kept by the folds).
    fn waiting_by_bot(&self) -> Result<Vec<BotWaiting>, StoreError>;
    fn queue_standing(&self, id: &ConversationId) -> Result<Option<Standing>, StoreError>;
    /// The handoff figures the folds keep by the hour, merged over the hours that overlap
    /// `[since, until)` (whole hours; at most `engine::state::stats::KEPT_MS` back): joined,
    /// exits by outcome, the time-to-accept histogram. Reads the hour records only.
    fn handoff_stats(&self, since: Millis, until: Millis) -> Result<HandoffStats, StoreError>;
    /// A partition's stored events, oldest first, with whether each is still to fold: its own
    /// frames through an index by partition, and the log's tail past the folds' watermark (never
    /// the whole log). The audit's timeline.
    fn partition_events(
        &self,
        partition: &PartitionKey,
    ) -> Result<Vec<(EventRecord, bool)>, StoreError>;
    /// An event by id, and whether it is folded.
    fn event_status(&self, id: &EventId) -> Result<Option<(EventRecord, bool)>, StoreError>;
    fn event_by_id(&self, id: &EventId) -> Result<Option<EventRecord>, StoreError>;
    /// Record counts (kept by the folds: no scan).
    fn sizes(&self) -> Result<Sizes, StoreError>;
}

/// Quarantine records: durable before the delivery is answered, bodies kept whole.
pub trait Quarantine {
    /// Store a record; returns the id it was given.
    fn quarantine(&self, record: QuarantineRecord) -> Result<u64, StoreError>;
    fn quarantined(&self) -> Result<Vec<QuarantineRecord>, StoreError>;
    fn quarantined_one(&self, id: u64) -> Result<Option<QuarantineRecord>, StoreError>;
    fn quarantine_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<(Vec<QuarantineMeta>, Option<u64>), StoreError>;
    /// Remove a record (it was re-processed); whether it was there.
    fn release_quarantined(&self, id: u64) -> Result<bool, StoreError>;
}

/// The console's audit list: each operator action, kept for its retention (pruned by
/// [`Retention::prune_operator_actions`]).
pub trait OperatorLog {
    /// Add an action; its number (later actions have higher ones).
    fn record_operator_action(&self, action: &OperatorAction) -> Result<u64, StoreError>;
    /// Up to `limit` actions recorded before number `before` (the newest when `None`), newest
    /// first, with their numbers.
    fn operator_actions_page(
        &self,
        before: Option<u64>,
        limit: usize,
    ) -> Result<Vec<(u64, OperatorAction)>, StoreError>;
}

/// Retention: bounded passes that never remove what a fold, the dedupe window or an open outbox
/// entry still needs.
pub trait Retention {
    /// Forget the event ids the dedupe window no longer covers (received before
    /// `dedupe_before`), and remove stored events received before `events_before` that are all
    /// folded: before `fold_from`, the folds' watermark as read before a flush that has completed
    /// since (so a crash cannot bring back an older one that names removed events).
    fn prune_events(
        &self,
        dedupe_before: Millis,
        events_before: Millis,
        fold_from: Cursor,
    ) -> Result<Pruned, StoreError>;
    /// Remove the conversation and end-user states whose newest activity is before `before`,
    /// each with every key derived from it, `chunk` at a time, each chunk under the fold lock;
    /// never one with a pending outbox entry or an event still to fold.
    fn prune_states(&self, before: Millis, chunk: usize) -> Removed<StatesPruned>;
    /// Remove the quarantine records received before `before`, `chunk` at a time.
    fn prune_quarantine(&self, before: Millis, chunk: usize) -> Removed<u64>;
    fn prune_ledger(&self, before: Millis, limit: usize) -> Result<(u64, u64), StoreError>;
    fn prune_idempotency(&self, before: Millis, limit: usize) -> Result<u64, StoreError>;
    /// Remove at most `limit` of the oldest console actions taken before `before`.
    fn prune_operator_actions(&self, before: Millis, limit: usize) -> Result<u64, StoreError>;
    /// Remove at most `limit` handoff-figure hour records of hours before `before`'s.
    fn prune_handoff_stats(&self, before: Millis, limit: usize) -> Result<u64, StoreError>;
    fn oldest_event_received_at(&self) -> Result<Option<Millis>, StoreError>;
}

/// What a bounded removal removed: everything it had to, or what it had when a failure stopped
/// it (gone all the same, so counted).
#[derive(Debug)]
pub struct Removed<T> {
    pub removed: T,
    pub failed: Option<StoreError>,
}

impl<T> Removed<T> {
    /// What was removed, and how the removal ended.
    pub fn split(self) -> (T, Result<(), StoreError>) {
        (self.removed, self.failed.map_or(Ok(()), Err))
    }

    /// What was removed, unless a failure stopped it.
    pub fn into_result(self) -> Result<T, StoreError> {
        match self.failed {
            None => Ok(self.removed),
            Some(e) => Err(e),
        }
    }
}

/// The store as a whole: its clock, its durability and the room it takes.
pub trait Lifecycle {
    /// The daemon's time as this store reads it (the application's clock).
    fn clock(&self) -> &model::clock::Clock;
    /// Make every write so far durable.
    fn flush(&self) -> Result<(), StoreError>;
    /// The room the store takes on its disk, in bytes (the daemon's size gauge).
    fn bytes_on_disk(&self) -> Result<u64, StoreError>;
    /// Whether the store takes a write now (a probe): after a failure, tells a disk that is still
    /// full from one with room again (a fold half applied is then mended only by a restart).
    fn takes_writes(&self) -> bool;
    /// Start the store's own background work, if it has any, from the calling thread, whose
    /// scheduling it inherits (the daemon calls it at the folds' priority).
    fn start_background(&self) -> Result<(), StoreError>;
}
