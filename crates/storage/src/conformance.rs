//! The storage port's conformance suite: the guarantees `docs/storage-port.md` states, group by
//! group, checked against any backend through the port alone. Each check is a function of a
//! [`Subject`] (a backend under test); [`conformance_tests!`](crate::conformance_tests) makes a
//! `#[test]` of each for one backend, so a backend plugs in with one line:
//!
//! ```text
//! storage::conformance_tests!(memory, Box::new(storage::conformance::MemSubject::default()));
//! ```
//!
//! What a backend cannot do is said by its subject ([`Subject::reopen`],
//! [`Subject::fail_next_commit`]), and the checks that need it check what remains.

use crate::mem::MemStore;
use crate::port::*;
use crate::test_support::{delivery, one_message_rule, said, timer_rules};
use crate::writer::WriterHooks;
use crate::{Applied, Position, QuarantineRecord, SledStore, Store, StoreError};
use engine::decide::Decide;
use model::ids::{ConversationId, DeliveryId, EventId};
use model::webhook::model::{Event, Millis};
use model::webhook::{parse_delivery, parse_event, IncomingEvent};
use std::sync::Arc;

/// A backend under test.
pub trait Subject {
    /// The store, as the daemon holds it.
    fn store(&self) -> Store;
    /// The backend's intake, its hand-overs discarded (the checks fold what is pending).
    fn writer(&self) -> Writer;
    /// Close the store and open it again (every handle of it dropped first); `false` for a
    /// backend whose data lives only as long as its handles.
    fn reopen(&mut self) -> bool;
    /// Make the next fold commit fail part way (or wholly); `false` when the backend cannot.
    fn fail_next_commit(&mut self) -> bool;
    /// Another node's handle on the same store (its own lease epoch); `None` for a backend one
    /// process holds (`Lease::shared` is false).
    fn another_node(&self) -> Option<Store>;
}

fn no_hooks() -> WriterHooks {
    WriterHooks {
        observe: Box::new(|_, _| {}),
        durable: Box::new(|_, _| {}),
    }
}

/// The sled backend in a temporary directory.
pub struct SledSubject {
    dir: tempfile::TempDir,
    store: Option<SledStore>,
}

impl Default for SledSubject {
    fn default() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(&dir.path().join("store"), 8 << 20).expect("open");
        SledSubject {
            dir,
            store: Some(store),
        }
    }
}

impl SledSubject {
    fn sled(&self) -> SledStore {
        self.store.clone().expect("open")
    }
}

impl Subject for SledSubject {
    fn store(&self) -> Store {
        Arc::new(self.sled())
    }

    fn writer(&self) -> Writer {
        let stuck = crate::Stuck::new().0;
        crate::writer::SledWriter::start(self.sled(), no_hooks(), stuck).expect("writer")
    }

    fn reopen(&mut self) -> bool {
        self.store = None;
        let path = self.dir.path().join("store");
        self.store = Some(SledStore::open(&path, 8 << 20).expect("reopen"));
        true
    }

    #[cfg(test)]
    fn fail_next_commit(&mut self) -> bool {
        crate::journal::tests::fail_writes_after(2);
        true
    }

    #[cfg(not(test))]
    fn fail_next_commit(&mut self) -> bool {
        false
    }

    fn another_node(&self) -> Option<Store> {
        None
    }
}

/// The in-memory backend.
#[derive(Default)]
pub struct MemSubject(MemStore);

impl Subject for MemSubject {
    fn store(&self) -> Store {
        Arc::new(self.0.clone())
    }

    fn writer(&self) -> Writer {
        self.0.writer(no_hooks())
    }

    fn reopen(&mut self) -> bool {
        false
    }

    fn fail_next_commit(&mut self) -> bool {
        self.0.fail_next_commit();
        true
    }

    fn another_node(&self) -> Option<Store> {
        Some(Arc::new(self.0.another_node()))
    }
}

/// A `#[test]` of every check for one backend: `conformance_tests!(name, subject)`, `subject` an
/// expression making a `Box<dyn Subject>` afresh for each test; or `conformance_tests!(name,
/// optional subject)`, `subject` making an `Option<Box<dyn Subject>>`, `None` for a backend this
/// machine cannot run (its subject says why), which passes each test unchecked.
#[macro_export]
macro_rules! conformance_tests {
    ($backend:ident, $subject:expr) => {
        $crate::conformance_tests!($backend, optional Some($subject));
    };
    // `subject` makes an `Option<Box<dyn Subject>>`: `None` (a backend this machine cannot run,
    // which its subject says) passes each test without checking.
    ($backend:ident, optional $subject:expr) => {
        mod $backend {
            use $crate::conformance as c;
            fn subject() -> Option<Box<dyn c::Subject>> {
                $subject
            }
            $crate::conformance_tests!(@checks
                intake_stores_a_retried_delivery_once,
                intake_acknowledges_only_what_is_durable,
                folds_keep_each_partitions_order_and_fold_each_event_once,
                a_fold_batch_is_committed_whole_or_not_at_all,
                a_replay_queues_only_what_was_never_decided,
                the_outbox_keeps_decision_order_and_records_each_outcome_once,
                timers_are_found_by_due_time_and_an_earlier_one_wakes_the_firer,
                retention_keeps_what_folds_and_the_outbox_still_need,
                the_waiting_queue_and_its_figures_are_kept_by_the_folds,
                keyed_pages_continue_right_after_their_cursor,
                desk_mappings_are_found_both_ways_and_closed_ones_pruned,
                the_lease_is_renewed_by_its_holder_and_taken_over_with_a_higher_epoch,
                a_write_of_a_node_whose_lease_moved_on_is_refused_and_leaves_nothing,
                an_entry_begun_under_an_earlier_epoch_is_a_replay_once,
                a_released_lease_is_free_at_once,
                pending_events_are_read_on_from_where_a_read_ended,
                asks_of_the_active_are_stored_by_any_node_and_answered_once_by_it,
            );
        }
    };
    // One `#[test]` per check, each on a subject of its own.
    (@checks $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                if let Some(mut s) = subject() {
                    c::$check(&mut *s);
                }
            }
        )*
    };
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(f)
}

/// A delivery of user messages `(event id, conversation)`, received at `at`.
fn job(id: &str, events: &[(&str, &str)], at: Millis) -> crate::AcceptJob {
    let events: Vec<(&str, &str, i64)> = events.iter().map(|(e, c)| (*e, *c, at)).collect();
    let parsed = parse_delivery(&delivery(id, &events)).expect("delivery");
    crate::AcceptJob {
        delivery: parsed.id,
        events: parsed.events,
        invalid: Vec::new(),
        received_at: at,
    }
}

fn accept(store: &dyn Storage, body: &[u8], at: Millis) -> crate::Accepted {
    let parsed = parse_delivery(body).expect("delivery");
    store
        .accept(&parsed.id, &parsed.events, at)
        .expect("accept")
}

/// The ids of the events still to fold, in the order a start would queue them.
fn pending_ids(store: &dyn Storage) -> Vec<String> {
    let pending = store.pending().expect("pending");
    let ids = pending.events.iter().map(|p| {
        let record = store.event_at(p.seq, p.at).expect("read").expect("event");
        record.id.as_str().to_owned()
    });
    ids.collect()
}

/// Fold everything still to fold in one batch, as the dispatcher would.
fn fold_pending(store: &dyn Storage, rules: &dyn Decide) -> Result<Applied, StoreError> {
    let pending = store.pending()?;
    let (mut events, mut partitions, mut received) = (Vec::new(), Vec::new(), Vec::new());
    let mut frames = Vec::new();
    for p in pending.events {
        let record = store.event_at(p.seq, p.at)?.expect("event");
        events.push((p.seq, parse_event(record.event.get()).expect("parse")));
        partitions.push(p.partition);
        received.push(record.received_at);
        frames.push(p.at);
    }
    let position = Position {
        fold_from: Some(pending.end),
        passed: Vec::new(),
        frames,
    };
    store.fold(&events, &partitions, rules, &received, &position)
}

/// Fold `events` (already folded or not) again, as a batch a start repeats after a crash.
fn fold_again(store: &dyn Storage, events: &[(u64, Event)]) -> Applied {
    let partitions: Vec<_> = events
        .iter()
        .map(|(_, e)| model::webhook::partition_of(e))
        .collect();
    let rules = one_message_rule("greet");
    let position = Position::default();
    let applied = store.fold(events, &partitions, &rules, &[], &position);
    applied.expect("fold")
}

fn outbox_ids(store: &dyn Storage) -> Vec<String> {
    let page = store.outbox_page(None, 1_000).expect("outbox");
    page.into_iter().map(|e| e.id).collect()
}

fn conversation(store: &dyn Storage, id: &str) -> Option<engine::state::ConversationState> {
    store.conversation(&ConversationId::new(id)).expect("read")
}

/// Intake: a retried delivery is stored once, whichever way it comes (the writer, `accept`):
/// its delivery id is a duplicate, and so is each event id under a new delivery id.
pub fn intake_stores_a_retried_delivery_once(subject: &mut dyn Subject) {
    let store = subject.store();
    let first = accept(
        &*store,
        &delivery("d1", &[("e1", "c1", 5), ("e2", "c1", 6)]),
        1_000,
    );
    assert_eq!(first.new.len(), 2);
    let offline = accept(&*store, &delivery("d2", &[("e1", "c1", 5)]), 1_001);
    assert_eq!((offline.new.len(), offline.duplicate_events), (0, 1));
    // The daemon's way in (a writer owns intake from here on).
    let writer = subject.writer();
    let again = block_on(writer.accept(job("d1", &[("e1", "c1"), ("e2", "c1")], 1_002)));
    let again = again.expect("answered");
    assert!(
        again.duplicate_delivery && again.new.is_empty(),
        "{again:?}"
    );
    let mixed = block_on(writer.accept(job("d3", &[("e2", "c1"), ("e3", "c2")], 1_003)));
    let mixed = mixed.expect("answered");
    assert_eq!((mixed.new.len(), mixed.duplicate_events), (1, 1));
    assert_eq!(pending_ids(&*store), ["e1", "e2", "e3"], "each stored once");
}

/// Intake: an acknowledged delivery is durable: found again after the store is reopened (a
/// backend that cannot be reopened: found at once).
pub fn intake_acknowledges_only_what_is_durable(subject: &mut dyn Subject) {
    {
        let writer = subject.writer();
        let accepted = block_on(writer.accept(job("d1", &[("e1", "c1")], 1_000)));
        assert_eq!(accepted.expect("acknowledged").new.len(), 1);
    }
    subject.reopen();
    let store = subject.store();
    let found = store.event_status(&EventId::new("e1")).expect("read");
    let (record, pending) = found.expect("an acknowledged event is stored");
    assert!(pending, "and still to fold");
    assert_eq!(record.received_at, 1_000);
    let retried = accept(&*store, &delivery("d1", &[("e1", "c1", 5)]), 2_000);
    assert!(retried.duplicate_delivery, "and known to dedupe");
}

/// Folds: a partition's events are still to fold in acceptance order; a fold raises each
/// partition's mark, so a batch folded again (a start after a crash) folds none twice and
/// decides nothing twice.
pub fn folds_keep_each_partitions_order_and_fold_each_event_once(subject: &mut dyn Subject) {
    let store = subject.store();
    accept(
        &*store,
        &delivery("d1", &[("e1", "c1", 1), ("e2", "c2", 2)]),
        1_000,
    );
    accept(&*store, &delivery("d2", &[("e3", "c1", 3)]), 1_001);
    let pending = store.pending().expect("pending");
    let seqs: Vec<u64> = pending.events.iter().map(|p| p.seq).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "in order: {seqs:?}");
    assert_eq!(pending_ids(&*store), ["e1", "e2", "e3"]);
    let batch: Vec<(u64, Event)> = pending
        .events
        .iter()
        .map(|p| {
            let record = store.event_at(p.seq, p.at).expect("read").expect("event");
            (p.seq, parse_event(record.event.get()).expect("parse"))
        })
        .collect();
    let applied = fold_pending(&*store, &one_message_rule("greet")).expect("fold");
    assert_eq!((applied.applied, applied.outbox.len()), (3, 3));
    assert_eq!(conversation(&*store, "c1").expect("c1").events_applied, 2);
    assert!(store.pending().expect("pending").is_empty());
    let again = fold_again(&*store, &batch);
    assert_eq!(
        (again.applied, again.skipped, again.outbox.len()),
        (0, 3, 0)
    );
    assert_eq!(outbox_ids(&*store).len(), 3, "each action queued once");
}

/// Folds: a batch's write set is committed whole or not at all. A commit that fails (where the
/// backend can be made to) leaves every event of the batch folded with its decisions, or none
/// (after a reopen, for a backend that completes a commit then); folding what is left then
/// decides each action once.
pub fn a_fold_batch_is_committed_whole_or_not_at_all(subject: &mut dyn Subject) {
    {
        let store = subject.store();
        let events = [("e1", "c1", 1), ("e2", "c2", 2), ("e3", "c3", 3)];
        accept(&*store, &delivery("d1", &events), 1_000);
    }
    if !subject.fail_next_commit() {
        return; // nothing to check beyond the other checks
    }
    {
        let store = subject.store();
        let failed = fold_pending(&*store, &one_message_rule("greet"));
        assert!(failed.is_err(), "the commit failed: {failed:?}");
    }
    subject.reopen();
    let store = subject.store();
    let pending = pending_ids(&*store);
    let queued = outbox_ids(&*store);
    assert!(
        pending.len() == 3 || pending.is_empty(),
        "whole or nothing: {pending:?}"
    );
    for event in ["e1", "e2", "e3"] {
        let decided = queued.iter().any(|id| id.starts_with(&format!("{event}/")));
        assert_ne!(pending.iter().any(|p| p == event), decided, "{event}");
    }
    fold_pending(&*store, &one_message_rule("greet")).expect("fold what is left");
    assert_eq!(outbox_ids(&*store).len(), 3, "each action decided once");
    assert!(store.pending().expect("pending").is_empty());
}

/// Folds: a replay decides the window's events again and queues only what the ledger has never
/// seen (new entries numbered after every earlier one).
pub fn a_replay_queues_only_what_was_never_decided(subject: &mut dyn Subject) {
    let store = subject.store();
    accept(&*store, &delivery("d1", &[("e1", "c1", 1)]), 1_000);
    let applied = fold_pending(&*store, &one_message_rule("greet")).expect("fold");
    let first = applied.outbox[0].seq;
    let window = crate::replay::ReplayRequest {
        from: 0,
        to: Millis::MAX,
        dry_run: false,
        force: false,
    };
    let same = store
        .replay(&window, &one_message_rule("greet"))
        .expect("replay");
    assert_eq!((same.events, same.queued, same.skipped), (1, 0, 1));
    let other = store
        .replay(&window, &one_message_rule("other"))
        .expect("replay");
    assert_eq!((other.queued, other.entries.len()), (1, 1));
    assert!(other.entries[0].seq > first, "numbered after the fold's");
    assert_eq!(outbox_ids(&*store), ["e1/greet/0", "e1/other/0"]);
}

/// Outbox: entries in decision order, numbered so; each outcome (done, dead, retried, dropped)
/// recorded once, with the entry's leaving.
pub fn the_outbox_keeps_decision_order_and_records_each_outcome_once(subject: &mut dyn Subject) {
    let store = subject.store();
    let events = [("e1", "c1", 1), ("e2", "c2", 2), ("e3", "c1", 3)];
    accept(&*store, &delivery("d1", &events), 1_000);
    let applied = fold_pending(&*store, &one_message_rule("greet")).expect("fold");
    let seqs: Vec<u64> = applied.outbox.iter().map(|e| e.seq).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    let (first, second) = (&applied.outbox[0], &applied.outbox[1]);
    let page = store.outbox_page(None, 10).expect("page");
    assert_eq!(page.iter().map(|e| e.seq).collect::<Vec<_>>(), seqs);
    let rest = store.outbox_page(Some(first.seq), 10).expect("page");
    assert_eq!(rest.len(), 2);
    assert_eq!(store.outbox_last_seq().expect("last"), seqs.last().copied());
    store.outbox_done(first, 1, 5_000).expect("done");
    store.outbox_done(first, 1, 5_001).expect("done again");
    assert_eq!(store.outbox_entry(first.seq).expect("read"), None);
    let finished = store.finished_page(None, 10).expect("finished");
    assert_eq!(
        finished.iter().filter(|r| r.entry.seq == first.seq).count(),
        1
    );
    let letter = crate::test_support::dead_letter(second, "gave up", false);
    store.outbox_dead(&letter).expect("dead");
    assert_eq!(store.outbox_len().expect("len"), 1);
    assert!(store.dead_letter(second.seq).expect("read").is_some());
    let retried = store.retry_dead_letter(second.seq, 6_000).expect("retry");
    assert_eq!(retried.map(|e| e.seq), Some(second.seq));
    assert_eq!(store.dead_letter(second.seq).expect("read"), None);
    store.outbox_dead(&letter).expect("dead again");
    let dropped = store
        .drop_dead_letter(second.seq, "no", 7_000)
        .expect("drop");
    assert!(dropped.is_some());
    assert_eq!(
        store
            .drop_dead_letter(second.seq, "no", 7_001)
            .expect("drop"),
        None
    );
    let record = store
        .finished_one(second.seq)
        .expect("read")
        .expect("record");
    assert_eq!(record.outcome, "dropped");
    assert_eq!(
        store.action_seqs_of_event("e1").expect("ledger"),
        [first.seq]
    );
}

/// Timers: found by due time without reading states, the next due time with them; a fold that
/// starts one due before the firer's next look wakes it; its folded firing stops it.
pub fn timers_are_found_by_due_time_and_an_earlier_one_wakes_the_firer(subject: &mut dyn Subject) {
    use futures_util::FutureExt;
    let store = subject.store();
    let rules = timer_rules();
    accept(&*store, &said("d1", "e1", "c1", "start"), 1_000);
    fold_pending(&*store, &rules).expect("fold");
    let (due, next) = store.due_timers(0, 10, &|_| false).expect("timers");
    let due_at = next.expect("one runs");
    assert!(due.is_empty(), "none due yet");
    let (due, _) = store.due_timers(due_at, 10, &|_| false).expect("timers");
    assert_eq!(due.len(), 1);
    let timer = &due[0];
    assert!(store.has_timer(&timer.key).expect("read"));
    let (skipped, _) = store
        .due_timers(due_at, 10, &|k| *k == timer.key)
        .expect("timers");
    assert!(skipped.is_empty(), "the firer's own are left out");
    let wakeup = store.timer_wakeup();
    wakeup.sleeping_until(Millis::MAX - 1);
    while wakeup.notified().now_or_never().is_some() {}
    accept(&*store, &said("d2", "e2", "c2", "start"), 1_001);
    fold_pending(&*store, &rules).expect("fold");
    assert!(wakeup.notified().now_or_never().is_some(), "woken");
    assert_eq!(store.timers_pending().expect("timers"), 2);
    let firing = model::webhook::timer_event(&timer.firing, &timer.bot_id).expect("firing");
    let firing_delivery = DeliveryId::new(firing.event.id.as_str());
    store
        .accept(&firing_delivery, &[firing], 2_000)
        .expect("fire");
    fold_pending(&*store, &rules).expect("fold the firing");
    assert!(
        !store.has_timer(&timer.key).expect("read"),
        "its firing stops it"
    );
    assert_eq!(store.timers_pending().expect("timers"), 1);
}

/// Retention: a state goes only when nothing still needs it (no event of its still to fold, no
/// pending outbox entry); events still to fold are never removed.
pub fn retention_keeps_what_folds_and_the_outbox_still_need(subject: &mut dyn Subject) {
    let store = subject.store();
    accept(&*store, &delivery("d1", &[("e1", "c1", 1)]), 1_000);
    fold_pending(&*store, &engine::decide::NoRules).expect("fold");
    accept(&*store, &delivery("d2", &[("e2", "c1", 2)]), 1_001);
    let later = Millis::MAX / 2;
    let pruned = store.prune_states(later, 10).into_result().expect("prune");
    assert_eq!(pruned.conversations, 0, "an event of it is still to fold");
    let kept = store.prune_events(later, later, store.fold_from().expect("watermark"));
    kept.expect("prune");
    assert_eq!(pending_ids(&*store), ["e2"], "what is still to fold stays");
    let applied = fold_pending(&*store, &one_message_rule("greet")).expect("fold");
    let pruned = store.prune_states(later, 10).into_result().expect("prune");
    assert_eq!(pruned.conversations, 0, "its outbox entry is pending");
    let done = model::action::DoneRecord {
        entry: applied.outbox[0].clone(),
        outcome: "done".into(),
        at: 3_000,
        attempts: 1,
        note: None,
    };
    store.outbox_done_many(&[done]).expect("done");
    let pruned = store.prune_states(later, 10).into_result().expect("prune");
    assert_eq!(pruned.conversations, 1, "nothing needs it now");
    assert!(conversation(&*store, "c1").is_none());
}

/// A conversation event of bot `B1` as the service sends it.
fn conversation_event(id: &str, kind: &str, conversation: &str, at: Millis) -> IncomingEvent {
    let raw = serde_json::json!({
        "id": id, "event": kind, "sourceType": "bot", "sourceId": "B1", "timestamp": at,
        "data": { "conversation": { "id": conversation, "botId": "B1", "platform": "web" } },
    });
    let raw = serde_json::value::RawValue::from_string(raw.to_string()).expect("raw");
    model::webhook::validate_event(&raw).expect("event")
}

/// Reads: the waiting queue the folds keep (counts, standings, positions) and the handoff
/// figures by the hour, read without a scan of the states.
pub fn the_waiting_queue_and_its_figures_are_kept_by_the_folds(subject: &mut dyn Subject) {
    let store = subject.store();
    let hour = 1_763_690_400_000;
    let requested = "bot.conversation.agent_call_requested";
    let events = [
        conversation_event("e1", requested, "c1", hour + 1),
        conversation_event("e2", requested, "c2", hour + 2),
        conversation_event("e3", requested, "c3", hour + 3),
        conversation_event(
            "e4",
            "bot.conversation.agent_call_cancelled",
            "c1",
            hour + 4,
        ),
    ];
    store
        .accept(&DeliveryId::new("d1"), &events, 1_000)
        .expect("accept");
    let applied = fold_pending(&*store, &engine::decide::NoRules).expect("fold");
    assert_eq!(applied.queue_exits.len(), 1, "c1 left");
    let summary = store.queue_summary().expect("summary");
    assert_eq!((summary.waiting, summary.oldest_since), (2, Some(hour + 2)));
    let by_bot = store.waiting_by_bot().expect("by bot");
    assert_eq!(
        by_bot
            .iter()
            .map(|b| (b.bot.as_str(), b.waiting))
            .collect::<Vec<_>>(),
        [("B1", 2)]
    );
    let standing = store
        .queue_standing(&ConversationId::new("c3"))
        .expect("read");
    let standing = standing.expect("known");
    assert_eq!((standing.position, standing.length), (Some(2), 2));
    let states: Vec<_> = ["c2", "c3"]
        .iter()
        .filter_map(|c| conversation(&*store, c))
        .collect();
    let positions = store.waiting_positions(&states).expect("positions");
    assert_eq!(
        (positions.get("c2"), positions.get("c3")),
        (Some(&1), Some(&2))
    );
    let figures = store
        .handoff_stats(hour, hour + 3_600_000)
        .expect("figures");
    assert_eq!(figures.joined, 3);
}

/// Reads: records by key, and keyed pages that go on right after their cursor, with none left
/// out or repeated.
pub fn keyed_pages_continue_right_after_their_cursor(subject: &mut dyn Subject) {
    let store = subject.store();
    let events: Vec<(String, String)> = (1..=5)
        .map(|i| (format!("e{i}"), format!("c{i}")))
        .collect();
    let events: Vec<(&str, &str, i64)> = events
        .iter()
        .map(|(e, c)| (e.as_str(), c.as_str(), 1))
        .collect();
    accept(&*store, &delivery("d1", &events), 1_000);
    fold_pending(&*store, &one_message_rule("greet")).expect("fold");
    let page = |after: Option<&str>| -> Vec<String> {
        let page = store.conversations_page(after, 2).expect("page");
        page.into_iter().map(|s| s.id.as_str().to_owned()).collect()
    };
    assert_eq!(page(None), ["c1", "c2"]);
    assert_eq!(page(Some("c2")), ["c3", "c4"]);
    assert_eq!(page(Some("c4")), ["c5"]);
    let mut listed = Vec::new();
    let mut after = None;
    loop {
        let desk = store
            .desk_page(None, None, after.as_ref(), 2)
            .expect("desk");
        listed.extend(
            desk.conversations
                .into_iter()
                .map(|s| s.id.as_str().to_owned()),
        );
        match desk.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    listed.sort();
    assert_eq!(
        listed,
        ["c1", "c2", "c3", "c4", "c5"],
        "every one listed once"
    );
    quarantine_and_operator_pages(&*store);
}

fn quarantine_and_operator_pages(store: &dyn Storage) {
    let ids: Vec<u64> = (0..3)
        .map(|i| {
            let record = QuarantineRecord::new("delivery", "invalid_json", "x", b"{", i);
            store.quarantine(record).expect("quarantine")
        })
        .collect();
    let (first, next) = store.quarantine_page(None, 2).expect("page");
    assert_eq!(first.iter().map(|m| m.id).collect::<Vec<_>>(), ids[..2]);
    assert_eq!(next, Some(ids[1]));
    let (rest, next) = store.quarantine_page(Some(ids[1]), 2).expect("page");
    assert_eq!(
        (rest.iter().map(|m| m.id).collect::<Vec<_>>(), next),
        (vec![ids[2]], None)
    );
    let action = |what: &str| crate::operators::OperatorAction {
        at: 1,
        who: "admin".into(),
        role: "operator".into(),
        what: what.into(),
        result: "applied".into(),
    };
    let numbers: Vec<u64> = ["a", "b", "c"]
        .iter()
        .map(|w| store.record_operator_action(&action(w)).expect("record"))
        .collect();
    let newest = store.operator_actions_page(None, 2).expect("page");
    let newest: Vec<u64> = newest.iter().map(|(n, _)| *n).collect();
    assert_eq!(newest, [numbers[2], numbers[1]]);
    let older = store
        .operator_actions_page(Some(numbers[1]), 2)
        .expect("page");
    assert_eq!(
        older.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        [numbers[0]]
    );
}

/// Desk mappings (`DeskLinks`): a link found by its conversation and by its desk conversations
/// (earlier ones too), per connector; contacts per connector; only closed links pruned, with
/// their index entries.
pub fn desk_mappings_are_found_both_ways_and_closed_ones_pruned(subject: &mut dyn Subject) {
    use crate::desk_links::{DeskContact, DeskLink};
    let store = subject.store();
    let link = |conversation: &str, remote: &str| DeskLink {
        connector: "chatwoot".into(),
        conversation_id: conversation.into(),
        remote: Some(remote.into()),
        contact: Some("c9".into()),
        opened_by: "e1/tell-helpdesk/0".into(),
        updated_at: 10,
        ..DeskLink::default()
    };
    let mut l = link("c1", "41");
    l.posted("hb:m1");
    store.put_desk_link(&l).expect("put");
    let id = ConversationId::new("c1");
    assert_eq!(
        store.desk_link("chatwoot", &id).expect("get"),
        Some(l.clone())
    );
    assert_eq!(store.desk_link("other", &id).expect("get"), None);
    assert_eq!(
        store.desk_link_of_remote("chatwoot", "41").expect("get"),
        Some(l.clone())
    );
    assert_eq!(
        store.desk_link_of_remote("chatwoot", "42").expect("get"),
        None
    );

    // Reopened: the earlier desk conversation still leads to the link, whose current is new.
    l.closed_at = Some(20);
    l.reopen("e2/tell-helpdesk/0");
    l.remote = Some("57".into());
    store.put_desk_link(&l).expect("put");
    let old = store
        .desk_link_of_remote("chatwoot", "41")
        .expect("get")
        .expect("found");
    assert_eq!(
        (old.remote.as_deref(), old.earlier.as_slice()),
        (Some("57"), &["41".to_owned()][..])
    );

    let contact = DeskContact {
        connector: "chatwoot".into(),
        user: "u1".into(),
        contact: "c9".into(),
        extra: serde_json::json!({"7": "src-1"}),
        updated_at: 5,
    };
    store.put_desk_contact(&contact).expect("put");
    assert_eq!(
        store.desk_contact("chatwoot", "u1").expect("get"),
        Some(contact)
    );
    assert_eq!(store.desk_contact("other", "u1").expect("get"), None);

    let mut closed = link("c2", "42");
    closed.closed_at = Some(10);
    store.put_desk_link(&closed).expect("put");
    assert_eq!(
        store.prune_desk_links(11, 10).expect("prune"),
        1,
        "only the closed one"
    );
    assert_eq!(
        store.desk_link_of_remote("chatwoot", "42").expect("get"),
        None
    );
    assert!(store
        .desk_link_of_remote("chatwoot", "57")
        .expect("get")
        .is_some());
    assert_eq!(store.prune_desk_links(11, 10).expect("prune"), 0);

    // A desk conversation a newer link took over stays that link's when the old one goes.
    let mut old = link("c3", "61");
    old.closed_at = Some(10);
    store.put_desk_link(&old).expect("put");
    let mut taker = link("c4", "62");
    taker.earlier = vec!["61".into()];
    store.put_desk_link(&taker).expect("put");
    assert_eq!(store.prune_desk_links(11, 10).expect("prune"), 1);
    let found = store.desk_link_of_remote("chatwoot", "61").expect("get");
    assert_eq!(found.map(|l| l.conversation_id), Some("c4".to_owned()));
}

const TTL: std::time::Duration = std::time::Duration::from_secs(10);

/// Move the store's clock (the daemon's, which judges the lease) forward by `secs`.
fn advance(store: &dyn Storage, secs: u64) {
    store.clock().advance(std::time::Duration::from_secs(secs));
}

/// Lease: acquired when free (a first epoch), renewed by its holder (same epoch, later expiry),
/// refused to another node while held, taken over with a higher epoch once run out; each handle
/// carries the epoch it holds; the nodes seen are listed. A backend one process holds: its
/// node always holds it.
pub fn the_lease_is_renewed_by_its_holder_and_taken_over_with_a_higher_epoch(
    subject: &mut dyn Subject,
) {
    let store = subject.store();
    let first = store.claim("n1", TTL).expect("claim");
    let now = store.clock().now_millis();
    assert_eq!(first.holder.as_deref(), Some("n1"));
    assert!(first.epoch >= 1 && first.held_by("n1", now), "{first:?}");
    assert_eq!(store.held_epoch(), Some(first.epoch));
    advance(&*store, 3);
    let renewed = store.claim("n1", TTL).expect("renew");
    assert_eq!(renewed.epoch, first.epoch, "a renewal keeps the epoch");
    assert!(renewed.expires_at > first.expires_at, "and runs later");
    let Some(other) = subject.another_node() else {
        assert!(!store.shared(), "a shared store has other nodes");
        return;
    };
    store.note_seen("n1").expect("seen");
    other.note_seen("n2").expect("seen");
    let refused = other.claim("n2", TTL).expect("claim");
    assert_eq!(
        (refused.holder.as_deref(), other.held_epoch()),
        (Some("n1"), None)
    );
    advance(&*store, 11);
    let taken = other.claim("n2", TTL).expect("take over");
    assert_eq!(taken.holder.as_deref(), Some("n2"));
    assert_eq!(taken.epoch, first.epoch + 1, "a higher epoch");
    assert_eq!(other.held_epoch(), Some(taken.epoch));
    let lost = store.claim("n1", TTL).expect("claim");
    assert_eq!(
        (lost.holder.as_deref(), store.held_epoch()),
        (Some("n2"), None)
    );
    assert_eq!(store.lease().expect("lease"), taken);
    let since = store.clock().now_millis() - 60_000;
    let seen: Vec<String> = store
        .nodes_seen(since)
        .expect("seen")
        .into_iter()
        .map(|n| n.node)
        .collect();
    assert_eq!(seen, ["n1", "n2"]);
    assert!(store.nodes_seen(Millis::MAX).expect("seen").is_empty());
}

/// Fencing: a write of the active's work by a node that holds no epoch (a standby), or whose
/// lease moved on, is refused (`StoreError::Fenced`) and leaves nothing: a fold, the
/// watermark, an outbox outcome, the backfill cursor, a retention pass. Intake is taken on every
/// node. The node that holds the lease writes.
pub fn a_write_of_a_node_whose_lease_moved_on_is_refused_and_leaves_nothing(
    subject: &mut dyn Subject,
) {
    let Some(standby) = subject.another_node() else {
        return; // one process: its node always holds the lease, nothing to fence
    };
    let old = subject.store();
    accept(&*old, &delivery("d1", &[("e1", "c1", 1)]), 1_000);
    old.claim("n1", TTL).expect("claim");
    standby.claim("n2", TTL).expect("claim");
    let greet = one_message_rule("greet");
    let refused = fold_pending(&*standby, &greet);
    assert!(matches!(refused, Err(StoreError::Fenced)), "{refused:?}");
    advance(&*old, 11);
    let new = standby;
    new.claim("n2", TTL).expect("take over");
    let late = fold_pending(&*old, &greet);
    assert!(matches!(late, Err(StoreError::Fenced)), "{late:?}");
    assert_eq!(pending_ids(&*new), ["e1"], "nothing folded");
    assert!(outbox_ids(&*new).is_empty(), "nothing decided");
    assert!(conversation(&*new, "c1").is_none());
    let fenced = |r: Result<(), StoreError>| matches!(r, Err(StoreError::Fenced));
    assert!(fenced(old.set_backfill_cursor(5)));
    assert!(fenced(
        old.advance_fold_from(model::cursor::Cursor::from_raw(u128::MAX))
    ));
    let pass = old.prune_states(Millis::MAX / 2, 10);
    assert!(matches!(pass.failed, Some(StoreError::Fenced)));
    assert_eq!(new.backfill_cursor().expect("cursor"), None);
    accept(&*old, &delivery("d2", &[("e2", "c2", 2)]), 1_001);
    assert_eq!(pending_ids(&*new), ["e1", "e2"], "intake is every node's");
    let applied = fold_pending(&*new, &greet).expect("the active folds");
    let entry = applied.outbox[0].clone();
    assert!(fenced(old.outbox_done(&entry, 1, 2_000)));
    assert!(
        outbox_ids(&*new).contains(&entry.id),
        "its outcome not recorded"
    );
    new.outbox_done(&entry, 1, 2_000)
        .expect("the active records it");
    assert!(!outbox_ids(&*new).contains(&entry.id));
}

/// Outbox under several nodes: an entry whose attempt began under an earlier epoch (its active
/// died before recording the outcome) is a replay for the next active, once; its own further
/// attempts are not.
pub fn an_entry_begun_under_an_earlier_epoch_is_a_replay_once(subject: &mut dyn Subject) {
    let store = subject.store();
    accept(&*store, &delivery("d1", &[("e1", "c1", 1)]), 1_000);
    store.claim("n1", TTL).expect("claim");
    let applied = fold_pending(&*store, &one_message_rule("greet")).expect("fold");
    let seq = applied.outbox[0].seq;
    use crate::lease::Start;
    assert_eq!(store.outbox_started(&[seq]).expect("start"), [Start::First]);
    assert_eq!(store.outbox_started(&[seq]).expect("again"), [Start::First]);
    let Some(next) = subject.another_node() else {
        return;
    };
    let epoch = store.held_epoch().expect("held");
    advance(&*store, 11);
    next.claim("n2", TTL).expect("take over");
    assert!(matches!(
        store.outbox_started(&[seq]),
        Err(StoreError::Fenced)
    ));
    // A batch: the replay, an entry not in the outbox, the replay's own second attempt.
    assert_eq!(
        next.outbox_started(&[seq, seq + 1_000]).expect("start"),
        [Start::Replay { epoch }, Start::First]
    );
    assert_eq!(next.outbox_started(&[seq]).expect("again"), [Start::First]);
}

/// Lease: a release (a clean stop) frees it at once, for another node to take with a higher
/// epoch without waiting for it to run out.
pub fn a_released_lease_is_free_at_once(subject: &mut dyn Subject) {
    let store = subject.store();
    let held = store.claim("n1", TTL).expect("claim");
    let Some(other) = subject.another_node() else {
        store.release("n1").expect("release");
        return;
    };
    store.release("n1").expect("release");
    assert_eq!(store.held_epoch(), None);
    assert_eq!(store.lease().expect("lease").holder, None);
    let taken = other.claim("n2", TTL).expect("claim");
    assert_eq!(
        (taken.holder.as_deref(), taken.epoch),
        (Some("n2"), held.epoch + 1)
    );
}

/// Asks of the active: any node stores one (numbered in order, bounded by
/// [`WAITING_MAX`](crate::asks::WAITING_MAX)); the unanswered are read oldest first; the answer
/// is the active's write (a standby's refused, the first answer kept) and survives a reopen;
/// pruning takes only answers older than its bound.
pub fn asks_of_the_active_are_stored_by_any_node_and_answered_once_by_it(
    subject: &mut dyn Subject,
) {
    use crate::asks::{Answer, Ask, WAITING_MAX};
    let store = subject.store();
    store.claim("n1", TTL).expect("claim");
    let asker = subject.another_node().unwrap_or_else(|| store.clone());
    asker.claim("n2", TTL).expect("claim");
    let prune = asker.ask(&Ask::Prune, "n2").expect("ask").expect("stored");
    let retry = Ask::Retry { ids: vec![7, 9] };
    let second = asker.ask(&retry, "n2").expect("ask").expect("stored");
    assert!(second > prune, "later asks have higher numbers");
    let waiting = store.unanswered(10).expect("unanswered");
    let ids: Vec<u64> = waiting.iter().map(|a| a.id).collect();
    assert_eq!(ids, [prune, second], "oldest first");
    assert_eq!((&waiting[1].ask, waiting[1].by.as_str()), (&retry, "n2"));
    let answer = |status: u16, at: Millis| Answer {
        status,
        body: format!("{{\"status\":{status}}}"),
        by: "n1".into(),
        at,
    };
    if subject.another_node().is_some() {
        let refused = asker.answer(prune, &answer(200, 5));
        assert!(matches!(refused, Err(StoreError::Fenced)), "{refused:?}");
    }
    assert!(store.answer(prune, &answer(200, 5)).expect("answer"));
    assert!(
        !store.answer(prune, &answer(500, 6)).expect("again"),
        "answered once"
    );
    assert!(!store.answer(second + 1_000, &answer(200, 6)).expect("none"));
    drop((store, asker));
    subject.reopen();
    let store = subject.store();
    let record = store.ask_record(prune).expect("read").expect("kept");
    assert_eq!(
        record.answer,
        Some(answer(200, 5)),
        "the first answer stays"
    );
    let waiting = store.unanswered(10).expect("unanswered");
    assert_eq!(waiting.iter().map(|a| a.id).collect::<Vec<_>>(), [second]);
    assert!(store.answer(second, &answer(404, 50)).expect("answer"));
    assert_eq!(
        store.prune_asks(6, 10).expect("prune"),
        1,
        "only the older answer"
    );
    assert!(store.ask_record(prune).expect("read").is_none());
    assert!(store.ask_record(second).expect("read").is_some());
    for i in 0..WAITING_MAX {
        let drop = Ask::Drop {
            id: i as u64,
            reason: "r".into(),
        };
        assert!(store.ask(&drop, "n1").expect("ask").is_some(), "ask {i}");
    }
    assert_eq!(
        store.ask(&Ask::Backfill, "n1").expect("ask"),
        None,
        "bounded"
    );
}

/// Folds: the events still to fold are read on from where a read ended, a page at a time, none
/// left out or read twice; folded ones are not returned.
pub fn pending_events_are_read_on_from_where_a_read_ended(subject: &mut dyn Subject) {
    let store = subject.store();
    for (i, (event, conversation)) in [("e1", "c1"), ("e2", "c2"), ("e3", "c1")]
        .iter()
        .enumerate()
    {
        let id = format!("d{i}");
        accept(&*store, &delivery(&id, &[(event, conversation, 1)]), 1_000);
    }
    let from = store.fold_from().expect("watermark");
    let first = store.pending_from(from, 2).expect("read");
    assert_eq!(first.events.len(), 2);
    let rest = store.pending_from(first.end, 2).expect("read on");
    let seqs: Vec<u64> = first
        .events
        .iter()
        .chain(&rest.events)
        .map(|p| p.seq)
        .collect();
    let all: Vec<u64> = store
        .pending()
        .expect("pending")
        .iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(seqs, all, "each once, in order");
    let none = store.pending_from(rest.end, 2).expect("read on");
    assert!(none.events.is_empty());
    accept(&*store, &delivery("d9", &[("e4", "c3", 4)]), 1_001);
    let new = store.pending_from(none.end, 2).expect("read on");
    assert_eq!(new.events.len(), 1, "what came since");
    fold_pending(&*store, &engine::decide::NoRules).expect("fold");
    let after = store.pending_from(from, 10).expect("read");
    assert!(after.events.is_empty(), "folded events are not pending");
}

#[cfg(test)]
mod tests {
    crate::conformance_tests!(sled, Box::new(crate::conformance::SledSubject::default()));
    crate::conformance_tests!(memory, Box::new(crate::conformance::MemSubject::default()));
}
