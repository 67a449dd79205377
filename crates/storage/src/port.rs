//! The storage port: what the daemon asks of a store, named for its needs and cut in the groups
//! of `docs/storage-port.md` (each group's guarantees are written there). [`Storage`] is all of
//! them; the daemon holds a [`Store`](crate::Store), a shared `dyn Storage`, and never names a
//! backend outside its composition root (which opens one) and the offline backup (which copies
//! one). [`SledStore`](crate::SledStore) is today's backend: sled plus the event log.
//!
//! A second backend implements these traits (and its own intake [`Writer`](crate::Writer)
//! inside): the engine and the HTTP surfaces do not change. Every method is object safe (callbacks
//! are `dyn`), so backends are chosen at start, not compiled in.

use crate::desk::{DeskCursor, DeskPage};
use crate::desk_links::DeskLinks;
use crate::eventlog::LogPosition;
use crate::idempotency::IdempotencyRecord;
use crate::operators::OperatorAction;
use crate::queue::{BotWaiting, QueueSummary};
use crate::replay::{ReplayReport, ReplayRequest};
use crate::retention::StatesPruned;
use crate::timers::{DueTimer, TimerWakeup};
use crate::watch::Watched;
use crate::{
    AcceptRequest, Accepted, Applied, EventRecord, Pending, Position, Pruned, QuarantineMeta,
    QuarantineRecord, Sizes, StoreError,
};
use engine::decide::Decide;
use engine::state::desk::DeskPhase;
use engine::state::queue::Standing;
use engine::state::stats::HandoffStats;
use engine::state::{BotState, ConversationState, EndUserState};
use model::action::{DeadLetter, DoneRecord, OutboxEntry, RetryState};
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
        + Send
        + Sync
{
}

/// Ingest beside the [`Writer`](crate::Writer) (which appends the daemon's deliveries in
/// groups): what stores a delivery with no writer running, and the backfill's position.
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
    /// Hand-overs to the dispatcher counted so far, or `None` while an accepted event is still
    /// between its check and its hand-over (a drain waiter then waits).
    fn handed_over(&self) -> Option<u64>;
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

/// The fold: read a batch's states, call the engine per event, commit the write set atomically.
pub trait Folds {
    /// The events still to fold, oldest first.
    fn pending(&self) -> Result<Pending, StoreError>;
    /// The events still to fold that the writer will not hand over (those stored before it
    /// started).
    fn pending_before_writer(&self) -> Result<Pending, StoreError>;
    /// Event `seq`, stored at `at`.
    fn event_at(&self, seq: u64, at: LogPosition) -> Result<Option<EventRecord>, StoreError>;
    /// Fold a batch (events of several partitions, in order per partition) in one atomic write:
    /// states, folded marks, decided outbox entries, timers, queue, indexes and counters.
    fn fold(
        &self,
        batch: &[(u64, Event)],
        partitions: &[PartitionKey],
        rules: &dyn Decide,
        received: &[Millis],
        position: &Position,
    ) -> Result<Applied, StoreError>;
    /// A position at or before every event still to fold (the folds' low watermark).
    fn fold_from(&self) -> Result<LogPosition, StoreError>;
    fn advance_fold_from(&self, to: LogPosition) -> Result<(), StoreError>;
    /// Fold stored events again with `rules`, writing nothing (the audit and `replay`).
    fn replay(
        &self,
        request: &ReplayRequest,
        rules: &dyn Decide,
    ) -> Result<ReplayReport, StoreError>;
}

/// The outbox: pending entries in decision order, their retry states, and each outcome recorded
/// once, atomically with the entry's removal.
pub trait Outbox {
    fn outbox_page(&self, after: Option<u64>, limit: usize)
        -> Result<Vec<OutboxEntry>, StoreError>;
    fn outbox_entry(&self, seq: u64) -> Result<Option<OutboxEntry>, StoreError>;
    fn outbox_len(&self) -> usize;
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
        skip: &dyn Fn(&[u8]) -> bool,
    ) -> Result<(Vec<DueTimer>, Option<Millis>), StoreError>;
    fn has_timer(&self, key: &[u8]) -> Result<bool, StoreError>;
    fn timers_pending(&self) -> u64;
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
    fn queue_summary(&self) -> QueueSummary;
    /// Each bot's waiting count and oldest request, in bot order (kept by the folds in memory).
    fn waiting_by_bot(&self) -> Vec<BotWaiting>;
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
    fn sizes(&self) -> Sizes;
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
    fn prune_with(
        &self,
        dedupe_before: Millis,
        events_before: Millis,
        fold_from: LogPosition,
    ) -> Result<Pruned, StoreError>;
    fn prune_states_into(
        &self,
        before: Millis,
        chunk: usize,
        out: &mut StatesPruned,
    ) -> Result<(), StoreError>;
    fn prune_quarantine_into(
        &self,
        before: Millis,
        chunk: usize,
        removed: &mut u64,
    ) -> Result<(), StoreError>;
    fn prune_quarantine(&self, before: Millis, chunk: usize) -> Result<u64, StoreError>;
    fn prune_ledger(&self, before: Millis, limit: usize) -> Result<(u64, u64), StoreError>;
    fn prune_idempotency(&self, before: Millis, limit: usize) -> Result<u64, StoreError>;
    /// Remove at most `limit` of the oldest console actions taken before `before`.
    fn prune_operator_actions(&self, before: Millis, limit: usize) -> Result<u64, StoreError>;
    /// Remove at most `limit` handoff-figure hour records of hours before `before`'s.
    fn prune_handoff_stats(&self, before: Millis, limit: usize) -> Result<u64, StoreError>;
    fn oldest_event_received_at(&self) -> Result<Option<Millis>, StoreError>;
}

/// The store as a whole: its clock, its health and durability.
pub trait Lifecycle {
    /// The daemon's time as this store reads it (the application's clock).
    fn clock(&self) -> &model::clock::Clock;
    /// Report a failure only a restart mends (see [`Stuck`](crate::Stuck)) and stop this thread.
    fn stuck(&self, exit_code: i32) -> !;
    /// Make every write so far durable.
    fn flush(&self) -> Result<(), StoreError>;
    /// An earlier failed sync, kept until the store is reopened.
    fn sync_failure(&self) -> Result<(), StoreError>;
    fn size_on_disk(&self) -> u64;
    /// Whether the store's directory takes a write now (a probe).
    fn dir_takes_writes(&self) -> bool;
    fn start_io_threads(&self) -> Result<(), StoreError>;
}
