//! An in-memory backend of the storage port ([`MemStore`]), with its own intake writer
//! ([`MemStore::writer`]): every group of the port, kept in maps behind one lock, durable only as
//! long as the process. For tests only (the conformance suite runs against it beside sled, and
//! against any later backend): it proves the port can be implemented without sled, and it can
//! fail a commit on purpose ([`MemStore::fail_next_commit`]).
//!
//! Its cursor is an event's sequence number (as a table backend's would be). Reads that a real
//! backend answers from an index (the agent API's listing, the sweeper's candidates, a
//! partition's events) walk the maps here: the answers are the port's, the costs are not.

mod asks;
mod desk_links;
mod fold;
mod groups;
mod lease;
mod retention;

pub use lease::Held;

use crate::idempotency::IdempotencyRecord;
use crate::operators::OperatorAction;
use crate::outbox::ActionStatus;
use crate::port::{Ingest, IntakeReply, IntakeWriter, Lifecycle, Writer};
use crate::timers::TimerWakeup;
use crate::writer::{AcceptJob, Durable, WriterError, WriterHooks};
use crate::{AcceptRequest, Accepted, EventRecord, NewEvent, QuarantineRecord, Store, StoreError};
use engine::index::TimerRef;
use engine::state::queue::AcceptHistory;
use engine::state::stats::HandoffStats;
use engine::state::{BotState, ConversationState, EndUserState};
use model::action::{DeadLetter, DoneRecord, OutboxEntry, RetryState};
use model::cursor::Cursor;
use model::ids::{DeliveryId, EventId};
use model::webhook::model::Millis;
use model::webhook::IncomingEvent;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// The in-memory store. Clones share it, as one node; [`MemStore::another_node`] is another
/// node's handle on the same data (see `lease`).
#[derive(Clone)]
pub struct MemStore(Arc<Shared>, Arc<Node>);

struct Shared {
    data: Mutex<Data>,
    /// Held by a fold session (and whatever writes what folds write), as sled's fold lock.
    fold_lock: Mutex<()>,
    fail_next_commit: AtomicBool,
    clock: model::clock::Clock,
}

/// One node's handle: the epoch it holds, the wake-up of its timer firer (its folds wake it),
/// and its door (calls a test holds back).
#[derive(Default)]
struct Node {
    fence: Mutex<lease::Fence>,
    timer_wakeup: Arc<TimerWakeup>,
    gate: lease::Gate,
}

/// An accepted event as kept.
struct StoredEvent {
    id: EventId,
    delivery: DeliveryId,
    received_at: Millis,
    partition: String,
    kind: String,
    raw: Box<serde_json::value::RawValue>,
    /// A conversation event's end user (a fold of it writes that user too).
    names_end_user: Option<String>,
}

/// Everything the store holds.
#[derive(Default)]
struct Data {
    /// The event log by sequence number (the cursor).
    events: BTreeMap<u64, StoredEvent>,
    /// Event ids (and delivery ids) the dedupe window holds: id -> when received.
    event_ids: HashMap<String, (u64, Millis)>,
    deliveries: HashMap<String, Millis>,
    next_seq: u64,
    /// Where a running writer's events begin (see `Folds::pending_before_writer`).
    writer_from: Option<u64>,
    handed_over: u64,
    marks: HashMap<String, u64>,
    fold_from: Cursor,
    conversations: BTreeMap<String, ConversationState>,
    end_users: BTreeMap<String, EndUserState>,
    user_index: HashMap<(String, String), String>,
    bots: BTreeMap<String, BotState>,
    outbox: BTreeMap<u64, OutboxEntry>,
    retry: HashMap<u64, RetryState>,
    dead: BTreeMap<u64, DeadLetter>,
    done: BTreeMap<u64, DoneRecord>,
    ledger: BTreeMap<String, ActionStatus>,
    /// Numbers of outbox entries, quarantine records and operator actions (as sled's id
    /// counter: one sequence for all).
    next_id: u64,
    timers: BTreeMap<TimerRef, (String, String)>,
    /// Waiting entries: (bot, since, conversation).
    queue: BTreeSet<(String, Millis, String)>,
    accepts: HashMap<String, AcceptHistory>,
    hours: BTreeMap<Millis, HandoffStats>,
    quarantine: BTreeMap<u64, QuarantineRecord>,
    operators: BTreeMap<u64, OperatorAction>,
    idempotency: HashMap<(String, String), IdempotencyRecord>,
    backfill_cursor: Option<Millis>,
    /// The desks' mappings: links by (connector, conversation), the desk's conversations back
    /// to theirs, contacts by (connector, user).
    desk_links: BTreeMap<(String, String), crate::desk_links::DeskLink>,
    desk_remotes: HashMap<(String, String), String>,
    desk_contacts: HashMap<(String, String), crate::desk_links::DeskContact>,
    /// The lease, the nodes seen (node -> when), and the epoch that began each outbox entry's
    /// attempts (see `lease`).
    lease: lease::LeaseRow,
    seen: BTreeMap<String, Millis>,
    started: HashMap<u64, u64>,
    /// Work asked of the active node, by number (see `crate::asks`).
    asks: BTreeMap<u64, crate::asks::AskRecord>,
}

impl Data {
    fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn record(&self, seq: u64) -> Option<EventRecord> {
        let e = self.events.get(&seq)?;
        Some(EventRecord {
            seq,
            id: e.id.clone(),
            delivery: e.delivery.clone(),
            received_at: e.received_at,
            partition: e.partition.clone(),
            kind: e.kind.clone(),
            event: e.raw.clone(),
        })
    }

    /// Still to fold: at or past the watermark and above its partition's mark.
    fn is_pending(&self, seq: u64) -> bool {
        let Some(e) = self.events.get(&seq) else {
            return false;
        };
        let mark = self.marks.get(&e.partition);
        Cursor::from_raw(u128::from(seq)) >= self.fold_from && mark.is_none_or(|m| seq > *m)
    }
}

impl Default for MemStore {
    fn default() -> Self {
        MemStore::new()
    }
}

impl MemStore {
    pub fn new() -> MemStore {
        MemStore::with_clock(model::clock::Clock::new())
    }

    /// A store reading the daemon's time from `clock`.
    pub fn with_clock(clock: model::clock::Clock) -> MemStore {
        let data = Data {
            next_seq: 1,
            ..Data::default()
        };
        let shared = Shared {
            data: Mutex::new(data),
            fold_lock: Mutex::new(()),
            fail_next_commit: AtomicBool::new(false),
            clock,
        };
        MemStore(Arc::new(shared), Arc::default())
    }

    /// The next fold commit fails, writing nothing (a failing store).
    pub fn fail_next_commit(&self) {
        self.0.fail_next_commit.store(true, Ordering::SeqCst);
    }

    /// Its intake: each delivery stored at once (in memory), then its new events handed to
    /// `hooks.durable`.
    pub fn writer(&self, hooks: WriterHooks) -> Writer {
        {
            let mut data = self.data();
            data.writer_from = Some(data.next_seq);
        }
        let (port, _) = tokio::sync::watch::channel(Some(Arc::new(self.clone()) as Store));
        Writer::new(Arc::new(MemWriter {
            store: self.clone(),
            durable: Mutex::new(hooks.durable),
            port,
        }))
    }

    fn data(&self) -> MutexGuard<'_, Data> {
        // Every change is made whole before the guard drops: a poisoned lock's data is whole.
        self.0
            .data
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn fold_guard(&self) -> MutexGuard<'_, ()> {
        self.0
            .fold_lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Store deliveries (deduplicated as the sled backend does); the new events of each.
    fn store(&self, requests: &[AcceptRequest<'_>]) -> Result<Vec<Accepted>, StoreError> {
        let mut data = self.data();
        requests.iter().map(|r| accept_one(&mut data, r)).collect()
    }
}

/// One delivery: a known delivery id makes all its events duplicates; each new event gets the
/// next number; invalid events of a delivery seen first are quarantined; a delivery is known
/// once it stored something.
fn accept_one(data: &mut Data, request: &AcceptRequest<'_>) -> Result<Accepted, StoreError> {
    let delivery = request.delivery.as_str();
    if data.deliveries.contains_key(delivery) {
        return Ok(Accepted {
            duplicate_delivery: true,
            duplicate_events: request.events.len(),
            ..Accepted::default()
        });
    }
    let mut accepted = Accepted::default();
    for (index, ev) in request.events.iter().enumerate() {
        if data.event_ids.contains_key(ev.event.id.as_str()) {
            accepted.duplicate_events += 1;
            continue;
        }
        let seq = data.next_seq;
        data.next_seq += 1;
        let stored = stored_event(ev, request)?;
        data.event_ids
            .insert(ev.event.id.as_str().to_owned(), (seq, request.received_at));
        data.events.insert(seq, stored);
        accepted.new.push((seq, ev.partition.clone()));
        accepted.new_index.push(index);
    }
    for bad in request.invalid {
        let id = data.next_id();
        data.quarantine
            .insert(id, QuarantineRecord { id, ..bad.clone() });
        accepted.quarantined.push(id);
    }
    if !accepted.new.is_empty() || !accepted.quarantined.is_empty() {
        data.deliveries
            .insert(delivery.to_owned(), request.received_at);
    }
    Ok(accepted)
}

fn stored_event(
    ev: &IncomingEvent,
    request: &AcceptRequest<'_>,
) -> Result<StoredEvent, StoreError> {
    #[derive(serde::Deserialize)]
    struct Kind {
        event: String,
    }
    let raw = serde_json::value::RawValue::from_string(ev.raw.clone())
        .map_err(|e| StoreError::Corrupt(format!("event: {e}")))?;
    let kind = serde_json::from_str::<Kind>(raw.get()).map_or_else(|_| String::new(), |k| k.event);
    let names_end_user = match &ev.event.payload {
        model::webhook::model::Payload::Conversation(c) => {
            c.end_user_id.as_ref().map(|u| u.as_str().to_owned())
        }
        _ => None,
    };
    Ok(StoredEvent {
        id: ev.event.id.clone(),
        delivery: request.delivery.clone(),
        received_at: request.received_at,
        partition: ev.partition.encode(),
        kind,
        raw,
        names_end_user,
    })
}

impl Ingest for MemStore {
    fn accept(
        &self,
        delivery: &DeliveryId,
        events: &[IncomingEvent],
        now: Millis,
    ) -> Result<Accepted, StoreError> {
        let request = AcceptRequest {
            delivery,
            events,
            invalid: &[],
            received_at: now,
        };
        let mut out = self.store(&[request])?;
        out.pop()
            .ok_or_else(|| StoreError::Internal("accept: no answer".into()))
    }

    fn accept_many(&self, requests: &[AcceptRequest<'_>]) -> Result<Vec<Accepted>, StoreError> {
        self.store(requests)
    }

    fn backfill_cursor(&self) -> Result<Option<Millis>, StoreError> {
        Ok(self.data().backfill_cursor)
    }

    fn set_backfill_cursor(&self, at: Millis) -> Result<(), StoreError> {
        let mut data = self.data();
        self.fenced(&data)?;
        data.backfill_cursor = Some(at);
        Ok(())
    }

    fn idempotent_answer(
        &self,
        route: &str,
        idempotency_key: &str,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        let key = (route.to_owned(), idempotency_key.to_owned());
        Ok(self.data().idempotency.get(&key).cloned())
    }

    fn record_idempotent_answer(
        &self,
        route: &str,
        idempotency_key: &str,
        record: &IdempotencyRecord,
    ) -> Result<(), StoreError> {
        let key = (route.to_owned(), idempotency_key.to_owned());
        self.data().idempotency.insert(key, record.clone());
        Ok(())
    }
}

impl Lifecycle for MemStore {
    fn clock(&self) -> &model::clock::Clock {
        &self.0.clock
    }

    /// Nothing to make durable: the process is all the durability it has.
    fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn bytes_on_disk(&self) -> Result<u64, StoreError> {
        Ok(0)
    }

    fn takes_writes(&self) -> bool {
        true
    }

    fn start_background(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// The in-memory store's intake: a delivery is stored (and so acknowledged) at once, and its new
/// events handed to the dispatcher in their order.
struct MemWriter {
    store: MemStore,
    /// Also keeps hand-overs in acceptance order.
    durable: Mutex<Durable>,
    port: tokio::sync::watch::Sender<Option<Store>>,
}

impl IntakeWriter for MemWriter {
    fn accept(&self, job: AcceptJob, reply: IntakeReply<Accepted>) {
        let durable = self.durable.lock().unwrap_or_else(|p| p.into_inner());
        let accepted = self.store.store(&[job.request()]).and_then(|mut out| {
            out.pop()
                .ok_or_else(|| StoreError::Internal("accept: no answer".into()))
        });
        let accepted = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                let _ = reply.send(Err(WriterError::Store(e.to_string())));
                return;
            }
        };
        let received_at = job.received_at;
        let new: Vec<NewEvent> = accepted
            .new
            .iter()
            .zip(accepted.pick_new(job.events))
            .map(|((seq, partition), ev)| NewEvent {
                seq: *seq,
                partition: partition.clone(),
                at: Cursor::from_raw(u128::from(*seq)),
                received_at,
                event: ev.event,
            })
            .collect();
        if !new.is_empty() {
            let end = Cursor::from_raw(u128::from(self.store.data().next_seq));
            self.store.data().handed_over += 1;
            durable(new, end);
        }
        let _ = reply.send(Ok(accepted));
    }

    fn flush(&self, reply: IntakeReply<()>) {
        let _ = reply.send(Ok(()));
    }

    fn flush_own(&self, reply: IntakeReply<()>) {
        let _ = reply.send(Ok(()));
    }

    fn is_healthy(&self) -> bool {
        true
    }

    fn store(&self) -> tokio::sync::watch::Receiver<Option<Store>> {
        self.port.subscribe()
    }

    fn handed_over(&self) -> Option<u64> {
        Some(self.store.data().handed_over)
    }
}
