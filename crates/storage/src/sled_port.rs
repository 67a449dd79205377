//! [`SledStore`] as the storage port: each method is the store's own (see the groups in
//! [`port`](crate::port)).

use crate::desk::{DeskCursor, DeskPage};
use crate::idempotency::IdempotencyRecord;
use crate::operators::OperatorAction;
use crate::port::*;
use crate::queue::{BotWaiting, QueueSummary};
use crate::retention::StatesPruned;
use crate::timers::{DueTimer, TimerKey, TimerWakeup};
use crate::watch::Watched;
use crate::{
    AcceptRequest, Accepted, EventRecord, Pending, Pruned, QuarantineMeta, QuarantineRecord, Sizes,
    SledStore, StoreError,
};
use engine::state::desk::DeskPhase;
use engine::state::queue::Standing;
use engine::state::stats::HandoffStats;
use engine::state::{BotState, ConversationState, EndUserState};
use model::action::{DeadLetter, DoneRecord, OutboxEntry, RetryState};
use model::cursor::Cursor;
use model::ids::{ConversationId, DeliveryId, EndUserId, EventId, PartitionKey};
use model::webhook::model::Millis;
use model::webhook::IncomingEvent;
use std::collections::HashMap;
use std::sync::Arc;

impl Ingest for SledStore {
    fn accept(
        &self,
        delivery: &DeliveryId,
        events: &[IncomingEvent],
        now: Millis,
    ) -> Result<Accepted, StoreError> {
        SledStore::accept(self, delivery, events, now)
    }

    fn accept_many(&self, requests: &[AcceptRequest<'_>]) -> Result<Vec<Accepted>, StoreError> {
        SledStore::accept_many(self, requests)
    }

    fn backfill_cursor(&self) -> Result<Option<Millis>, StoreError> {
        SledStore::backfill_cursor(self)
    }

    fn set_backfill_cursor(&self, at: Millis) -> Result<(), StoreError> {
        SledStore::set_backfill_cursor(self, at)
    }

    fn idempotent_answer(
        &self,
        route: &str,
        idempotency_key: &str,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        SledStore::idempotent_answer(self, route, idempotency_key)
    }

    fn record_idempotent_answer(
        &self,
        route: &str,
        idempotency_key: &str,
        record: &IdempotencyRecord,
    ) -> Result<(), StoreError> {
        SledStore::record_idempotent_answer(self, route, idempotency_key, record)
    }
}

impl Folds for SledStore {
    fn pending(&self) -> Result<Pending, StoreError> {
        SledStore::pending(self)
    }

    fn pending_before_writer(&self) -> Result<Pending, StoreError> {
        SledStore::pending_before_writer(self)
    }

    fn event_at(&self, seq: u64, at: Cursor) -> Result<Option<EventRecord>, StoreError> {
        SledStore::event_at(self, seq, at)
    }

    fn begin_fold(&self) -> Result<Box<dyn FoldSession + '_>, StoreError> {
        Ok(Box::new(SledStore::begin_fold(self)?))
    }

    fn fold_from(&self) -> Result<Cursor, StoreError> {
        Ok(SledStore::watermark(self)?.into())
    }

    fn advance_fold_from(&self, to: Cursor) -> Result<(), StoreError> {
        SledStore::advance_fold_from(self, to)
    }
}

impl Outbox for SledStore {
    fn outbox_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<OutboxEntry>, StoreError> {
        SledStore::outbox_page(self, after, limit)
    }

    fn outbox_entry(&self, seq: u64) -> Result<Option<OutboxEntry>, StoreError> {
        SledStore::outbox_entry(self, seq)
    }

    fn outbox_len(&self) -> usize {
        SledStore::outbox_len(self)
    }

    fn outbox_last_seq(&self) -> Result<Option<u64>, StoreError> {
        SledStore::outbox_last_seq(self)
    }

    fn outbox_retry_state(&self, seq: u64) -> Result<Option<RetryState>, StoreError> {
        SledStore::outbox_retry_state(self, seq)
    }

    fn set_outbox_retry_state(&self, seq: u64, state: &RetryState) -> Result<(), StoreError> {
        SledStore::set_outbox_retry_state(self, seq, state)
    }

    fn outbox_done(
        &self,
        entry: &OutboxEntry,
        attempts: u32,
        now: Millis,
    ) -> Result<(), StoreError> {
        SledStore::outbox_done(self, entry, attempts, now)
    }

    fn outbox_done_many(&self, records: &[DoneRecord]) -> Result<(), StoreError> {
        SledStore::outbox_done_many(self, records)
    }

    fn outbox_dead(&self, letter: &DeadLetter) -> Result<(), StoreError> {
        SledStore::outbox_dead(self, letter)
    }

    fn dead_letter(&self, seq: u64) -> Result<Option<DeadLetter>, StoreError> {
        SledStore::dead_letter(self, seq)
    }

    fn dead_letters(&self) -> Result<Vec<DeadLetter>, StoreError> {
        SledStore::dead_letters(self)
    }

    fn dead_letters_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        SledStore::dead_letters_page(self, after, limit)
    }

    fn retry_dead_letter(&self, seq: u64, now: Millis) -> Result<Option<OutboxEntry>, StoreError> {
        SledStore::retry_dead_letter(self, seq, now)
    }

    fn drop_dead_letter(
        &self,
        seq: u64,
        reason: &str,
        now: Millis,
    ) -> Result<Option<DeadLetter>, StoreError> {
        SledStore::drop_dead_letter(self, seq, reason, now)
    }

    fn finished_page(
        &self,
        before: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DoneRecord>, StoreError> {
        SledStore::finished_page(self, before, limit)
    }

    fn finished_one(&self, seq: u64) -> Result<Option<DoneRecord>, StoreError> {
        SledStore::finished_one(self, seq)
    }

    fn action_seqs_of_event(&self, event_id: &str) -> Result<Vec<u64>, StoreError> {
        SledStore::action_seqs_of_event(self, event_id)
    }
}

impl Timers for SledStore {
    fn due_timers(
        &self,
        now: Millis,
        limit: usize,
        skip: &dyn Fn(&TimerKey) -> bool,
    ) -> Result<(Vec<DueTimer>, Option<Millis>), StoreError> {
        SledStore::due_timers(self, now, limit, skip)
    }

    fn has_timer(&self, key: &TimerKey) -> Result<bool, StoreError> {
        SledStore::has_timer(self, key)
    }

    fn timers_pending(&self) -> u64 {
        SledStore::timers_pending(self)
    }

    fn timer_wakeup(&self) -> Arc<TimerWakeup> {
        SledStore::timer_wakeup(self)
    }
}

impl Reads for SledStore {
    fn conversation(&self, id: &ConversationId) -> Result<Option<ConversationState>, StoreError> {
        SledStore::conversation(self, id)
    }

    fn end_user(&self, id: &EndUserId) -> Result<Option<EndUserState>, StoreError> {
        SledStore::end_user(self, id)
    }

    fn bot(&self, id: &str) -> Result<Option<BotState>, StoreError> {
        SledStore::bot(self, id)
    }

    fn find_end_user(
        &self,
        platform: &str,
        user_key: &str,
    ) -> Result<Option<EndUserState>, StoreError> {
        SledStore::find_end_user(self, platform, user_key)
    }

    fn conversations_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ConversationState>, StoreError> {
        SledStore::conversations_page(self, after, limit)
    }

    fn end_users_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<EndUserState>, StoreError> {
        SledStore::end_users_page(self, after, limit)
    }

    fn desk_page(
        &self,
        phase: Option<DeskPhase>,
        bot: Option<&str>,
        after: Option<&DeskCursor>,
        limit: usize,
    ) -> Result<DeskPage, StoreError> {
        SledStore::desk_page(self, phase, bot, after, limit)
    }

    fn waiting_positions(
        &self,
        states: &[ConversationState],
    ) -> Result<HashMap<String, usize>, StoreError> {
        SledStore::waiting_positions(self, states)
    }

    fn watched(&self, released_since: Millis, limit: usize) -> Result<Watched, StoreError> {
        SledStore::watched(self, released_since, limit)
    }

    fn queue_summary(&self) -> QueueSummary {
        SledStore::queue_summary(self)
    }

    fn waiting_by_bot(&self) -> Vec<BotWaiting> {
        SledStore::waiting_by_bot(self)
    }

    fn queue_standing(&self, id: &ConversationId) -> Result<Option<Standing>, StoreError> {
        SledStore::queue_standing(self, id)
    }

    fn handoff_stats(&self, since: Millis, until: Millis) -> Result<HandoffStats, StoreError> {
        SledStore::handoff_stats(self, since, until)
    }

    fn partition_events(
        &self,
        partition: &PartitionKey,
    ) -> Result<Vec<(EventRecord, bool)>, StoreError> {
        SledStore::partition_events(self, partition)
    }

    fn event_status(&self, id: &EventId) -> Result<Option<(EventRecord, bool)>, StoreError> {
        SledStore::event_status(self, id)
    }

    fn event_by_id(&self, id: &EventId) -> Result<Option<EventRecord>, StoreError> {
        SledStore::event_by_id(self, id)
    }

    fn sizes(&self) -> Sizes {
        SledStore::sizes(self)
    }
}

impl Quarantine for SledStore {
    fn quarantine(&self, record: QuarantineRecord) -> Result<u64, StoreError> {
        SledStore::quarantine(self, record)
    }

    fn quarantined(&self) -> Result<Vec<QuarantineRecord>, StoreError> {
        SledStore::quarantined(self)
    }

    fn quarantined_one(&self, id: u64) -> Result<Option<QuarantineRecord>, StoreError> {
        SledStore::quarantined_one(self, id)
    }

    fn quarantine_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<(Vec<QuarantineMeta>, Option<u64>), StoreError> {
        SledStore::quarantine_page(self, after, limit)
    }

    fn release_quarantined(&self, id: u64) -> Result<bool, StoreError> {
        SledStore::release_quarantined(self, id)
    }
}

impl Retention for SledStore {
    fn prune_with(
        &self,
        dedupe_before: Millis,
        events_before: Millis,
        fold_from: Cursor,
    ) -> Result<Pruned, StoreError> {
        SledStore::prune_with(self, dedupe_before, events_before, fold_from)
    }

    fn prune_states_into(
        &self,
        before: Millis,
        chunk: usize,
        out: &mut StatesPruned,
    ) -> Result<(), StoreError> {
        SledStore::prune_states_into(self, before, chunk, out)
    }

    fn prune_quarantine_into(
        &self,
        before: Millis,
        chunk: usize,
        removed: &mut u64,
    ) -> Result<(), StoreError> {
        SledStore::prune_quarantine_into(self, before, chunk, removed)
    }

    fn prune_quarantine(&self, before: Millis, chunk: usize) -> Result<u64, StoreError> {
        SledStore::prune_quarantine(self, before, chunk)
    }

    fn prune_ledger(&self, before: Millis, limit: usize) -> Result<(u64, u64), StoreError> {
        SledStore::prune_ledger(self, before, limit)
    }

    fn prune_idempotency(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        SledStore::prune_idempotency(self, before, limit)
    }

    fn prune_operator_actions(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        SledStore::prune_operator_actions(self, before, limit)
    }

    fn prune_handoff_stats(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        SledStore::prune_handoff_stats(self, before, limit)
    }

    fn oldest_event_received_at(&self) -> Result<Option<Millis>, StoreError> {
        SledStore::oldest_event_received_at(self)
    }
}

impl Lifecycle for SledStore {
    fn clock(&self) -> &model::clock::Clock {
        SledStore::clock(self)
    }

    fn stuck(&self, exit_code: i32) -> ! {
        SledStore::stuck(self, exit_code)
    }

    fn flush(&self) -> Result<(), StoreError> {
        SledStore::flush(self)
    }

    fn sync_failure(&self) -> Result<(), StoreError> {
        SledStore::sync_failure(self)
    }

    fn size_on_disk(&self) -> u64 {
        SledStore::size_on_disk(self)
    }

    fn dir_takes_writes(&self) -> bool {
        SledStore::dir_takes_writes(self)
    }

    fn start_io_threads(&self) -> Result<(), StoreError> {
        SledStore::start_io_threads(self)
    }
}

impl OperatorLog for SledStore {
    fn record_operator_action(&self, action: &OperatorAction) -> Result<u64, StoreError> {
        SledStore::record_operator_action(self, action)
    }

    fn operator_actions_page(
        &self,
        before: Option<u64>,
        limit: usize,
    ) -> Result<Vec<(u64, OperatorAction)>, StoreError> {
        SledStore::operator_actions_page(self, before, limit)
    }
}
