//! A stopped sled store read out record by record, in words of no backend, for a move to another
//! one (`handoff-bridge store copy`): every kind of record the store keeps that a restart needs
//! ([`Kind`]), each as an iterator ([`Dump::records`]) that reads as it goes (the event log a few
//! frames at a time, sled's trees in key order), so a store of millions of records is never held
//! in memory; and where its numbers stand ([`Positions`]).
//!
//! What the other backend derives from these (the agent API's phase index and the sweeper's,
//! the retention index, each bot's waiting count, the end users' index by messenger identity,
//! the desks' conversations back to their links, the record counts) is not dumped: it is rebuilt
//! from the states and links, as that backend's folds would keep it.
//!
//! Left out: an older layout's dedupe records (`seen/v1`, `deliveries/v1`, kept until they are
//! past the dedupe window): their events are no longer in the log, and the window ends soon.

use super::{decode, eventlog, keys, EventRecord, QuarantineRecord, SledStore, StoreError};
use crate::desk_links::{DeskContact, DeskLink};
use crate::idempotency::IdempotencyRecord;
use crate::operators::OperatorAction;
use crate::outbox::ActionStatus;
use engine::batch::TimerStart;
use engine::index::{QueueEntry, TimerRef};
use engine::state::queue::AcceptHistory;
use engine::state::stats::HandoffStats;
use engine::state::{BotState, ConversationState, EndUserState};
use model::action::{DeadLetter, DoneRecord, OutboxEntry, RetryState};
use model::ids::DeliveryId;
use model::webhook::model::Millis;
use std::collections::VecDeque;
use std::ops::ControlFlow;

/// One record of a dumped store. Its kind ([`Kind`], derived from the variants) names the
/// table-like collection it belongs to.
#[derive(Debug, strum::EnumDiscriminants)]
#[strum_discriminants(
    name(Kind),
    derive(Hash, strum::IntoStaticStr, strum::VariantArray),
    strum(serialize_all = "snake_case")
)]
pub enum Record {
    /// A stored delivery with its events, as the log holds it (an empty frame: a delivery
    /// whose events were all quarantined, kept so a re-send is known).
    #[strum_discriminants(strum(serialize = "deliveries"))]
    Delivery {
        id: DeliveryId,
        received_at: Millis,
        events: Vec<EventRecord>,
    },
    /// A partition's folded mark: the number of its last folded event.
    #[strum_discriminants(strum(serialize = "folded_marks"))]
    FoldedMark { partition: String, mark: u64 },
    #[strum_discriminants(strum(serialize = "conversations"))]
    Conversation(Box<ConversationState>),
    #[strum_discriminants(strum(serialize = "end_users"))]
    EndUser(Box<EndUserState>),
    #[strum_discriminants(strum(serialize = "bots"))]
    Bot(Box<BotState>),
    /// A running timer.
    #[strum_discriminants(strum(serialize = "timers"))]
    Timer(TimerStart),
    /// A conversation in its bot's waiting queue.
    #[strum_discriminants(strum(serialize = "waiting_queue"))]
    Waiting(QueueEntry),
    #[strum_discriminants(strum(serialize = "accept_histories"))]
    AcceptHistory { bot: String, history: AcceptHistory },
    /// An hour's handoff figures (its start).
    #[strum_discriminants(strum(serialize = "hour_figures"))]
    HourFigures { hour: Millis, stats: HandoffStats },
    /// A decided action not carried out yet.
    #[strum_discriminants(strum(serialize = "outbox"))]
    Outbox(Box<OutboxEntry>),
    #[strum_discriminants(strum(serialize = "retry_states"))]
    RetryState { seq: u64, state: RetryState },
    #[strum_discriminants(strum(serialize = "dead_letters"))]
    DeadLetter(Box<DeadLetter>),
    /// A finished action (done or dropped) in the audit window.
    #[strum_discriminants(strum(serialize = "done_records"))]
    Done(Box<DoneRecord>),
    /// Where a decided action stands (the ledger: every action decided, by its id).
    #[strum_discriminants(strum(serialize = "action_ledger"))]
    Ledger {
        action_id: String,
        status: ActionStatus,
    },
    #[strum_discriminants(strum(serialize = "quarantine"))]
    Quarantine(Box<QuarantineRecord>),
    /// One entry of the console's audit list.
    #[strum_discriminants(strum(serialize = "operator_actions"))]
    OperatorAction { id: u64, action: OperatorAction },
    /// The agent API's first answer under an `Idempotency-Key`.
    #[strum_discriminants(strum(serialize = "idempotency_answers"))]
    Idempotency {
        route: String,
        key: String,
        record: IdempotencyRecord,
    },
    #[strum_discriminants(strum(serialize = "desk_links"))]
    DeskLink(Box<DeskLink>),
    #[strum_discriminants(strum(serialize = "desk_contacts"))]
    DeskContact(Box<DeskContact>),
}

impl Kind {
    /// Every kind, in the order a copy takes them.
    pub const ALL: &'static [Kind] = <Kind as strum::VariantArray>::VARIANTS;

    /// Its name (`conversations`, `dead_letters`...).
    pub fn name(self) -> &'static str {
        self.into()
    }
}

impl Record {
    pub fn kind(&self) -> Kind {
        Kind::from(self)
    }

    /// About how many bytes it takes in memory (to bound a batch by size): its bodies', or a
    /// state's typical size.
    pub fn weight(&self) -> usize {
        const SMALL: usize = 512;
        const STATE: usize = 4096;
        match self {
            Record::Delivery { events, .. } => events
                .iter()
                .map(|e| e.event.get().len() + SMALL)
                .sum::<usize>()
                .max(SMALL),
            Record::Quarantine(q) => q.body_base64.len() + SMALL,
            Record::Conversation(_) | Record::EndUser(_) | Record::Bot(_) => STATE,
            Record::DeskLink(_) | Record::Outbox(_) | Record::DeadLetter(_) | Record::Done(_) => {
                STATE
            }
            _ => SMALL,
        }
    }
}

/// Where a dumped store's numbers stand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Positions {
    /// The folds' watermark as an event number: the first event at or after sled's watermark (a
    /// log position), or [`next_event`](Self::next_event) when none is. Every event still to
    /// fold is at or above it (and above its partition's mark); every event below it is folded.
    pub fold_from: u64,
    /// The number the next new event would get: above every number ever given out (the folded
    /// marks included, also those of events since pruned).
    pub next_event: u64,
    /// Backfill's cursor.
    pub backfill_cursor: Option<Millis>,
}

/// A sled store read out ([`SledStore::dump`]). The store must not change meanwhile: it is opened
/// offline, no daemon beside it.
pub struct Dump<'a> {
    store: &'a SledStore,
}

/// What a dump iterator yields.
pub type Records<'a> = Box<dyn Iterator<Item = Result<Record, StoreError>> + 'a>;

impl SledStore {
    /// The store read out record by record (see [`dump`](crate::dump)).
    pub fn dump(&self) -> Dump<'_> {
        Dump { store: self }
    }
}

impl<'a> Dump<'a> {
    /// Every record of `kind`, in the store's order (deliveries in log order, the rest in key
    /// order), read as the iterator is.
    pub fn records(&self, kind: Kind) -> Result<Records<'a>, StoreError> {
        let s = self.store;
        Ok(match kind {
            Kind::Delivery => Box::new(LogFrames::new(s)),
            Kind::FoldedMark => each(&s.folded, folded_mark),
            Kind::Conversation => each(&s.conversations, |_, v| {
                Ok(Record::Conversation(decode(v, "conversation state")?))
            }),
            Kind::EndUser => each(&s.end_users, |_, v| {
                Ok(Record::EndUser(decode(v, "end-user state")?))
            }),
            Kind::Bot => each(&s.bots, |_, v| Ok(Record::Bot(decode(v, "bot state")?))),
            Kind::Timer => each(&s.timers, timer),
            Kind::Waiting => prefixed(s.queue.clone(), &[keys::QUEUE_WAITING], waiting),
            Kind::AcceptHistory => prefixed(s.queue.clone(), b"h", accept_history),
            Kind::HourFigures => prefixed(s.queue.clone(), &[keys::QUEUE_STATS], hour_figures),
            Kind::Outbox => each(&s.outbox, |_, v| {
                Ok(Record::Outbox(decode(v, "outbox entry")?))
            }),
            Kind::RetryState => each(&s.outbox_retry, |k, v| {
                let seq = seq_key(k, "retry state key")?;
                let state = decode(v, "outbox retry state")?;
                Ok(Record::RetryState { seq, state })
            }),
            Kind::DeadLetter => each(&s.dead_letters, |_, v| {
                Ok(Record::DeadLetter(decode(v, "dead letter")?))
            }),
            Kind::Done => each(&s.done, |_, v| {
                Ok(Record::Done(decode(v, "finished entry")?))
            }),
            Kind::Ledger => each(&s.actions, ledger),
            Kind::Quarantine => Box::new(s.quarantine.iter().map(move |item| {
                let (_, value) = item?;
                Ok(Record::Quarantine(Box::new(s.quarantined_whole(&value)?)))
            })),
            Kind::OperatorAction => each(&s.operators_tree()?, operator_action),
            Kind::Idempotency => each(&s.idempotency_tree()?, idempotency),
            // A desk mapping's key: its kind byte, then a 0 (`keys::desk_link`).
            Kind::DeskLink => prefixed(s.desk_links_tree()?, b"l\0", |_, v| {
                Ok(Record::DeskLink(decode(v, "desk link")?))
            }),
            Kind::DeskContact => prefixed(s.desk_links_tree()?, b"u\0", |_, v| {
                Ok(Record::DeskContact(decode(v, "desk contact")?))
            }),
        })
    }

    /// Where the store's numbers stand: the watermark as an event number (a scan of the log
    /// from the watermark, which the folds keep close to the log's end), the next event number,
    /// the backfill cursor.
    pub fn positions(&self) -> Result<Positions, StoreError> {
        let s = self.store;
        let next_event = s.log.next_seq.load(std::sync::atomic::Ordering::SeqCst);
        let mut first = None;
        eventlog::scan(&s.log_dir, s.watermark()?, |_, record, _| {
            first = record.seqs.iter().min().copied();
            match first {
                Some(_) => ControlFlow::Break(()),
                None => ControlFlow::Continue(()),
            }
        })
        .map_err(super::log_error)?;
        let backfill_cursor = s
            .meta
            .get(keys::meta::BACKFILL_CURSOR)?
            .and_then(|b| keys::parse_seq(&b))
            .map(|at| at as Millis);
        Ok(Positions {
            fold_from: first.unwrap_or(next_event),
            next_event,
            backfill_cursor,
        })
    }

    /// The entries of the agent API's phase index and the sweeper's index (which another
    /// backend rebuilds from the states): counted, to compare with what it rebuilt.
    pub fn derived_entries(&self) -> Result<u64, StoreError> {
        let mut count = 0;
        for prefix in [
            keys::DESK_PHASE,
            keys::DESK_BOT,
            keys::WATCH_ACTIVE,
            keys::WATCH_RELEASED,
        ] {
            for key in self.store.queue.scan_prefix([prefix]).keys() {
                key?;
                count += 1;
            }
        }
        Ok(count)
    }
}

/// Each entry of `tree` whose key starts with `prefix` (all: an empty one) as a record (the
/// iterator holds the tree: sled's handles are shared).
fn prefixed<'a>(
    tree: sled::Tree,
    prefix: &[u8],
    read: impl Fn(&[u8], &[u8]) -> Result<Record, StoreError> + 'a,
) -> Records<'a> {
    Box::new(tree.scan_prefix(prefix).map(move |item| {
        let (key, value) = item?;
        read(&key, &value)
    }))
}

/// Each entry of `tree` as a record.
fn each<'a>(
    tree: &sled::Tree,
    read: impl Fn(&[u8], &[u8]) -> Result<Record, StoreError> + 'a,
) -> Records<'a> {
    prefixed(tree.clone(), &[], read)
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("unreadable {what}"))
}

fn text(bytes: &[u8], what: &str) -> Result<String, StoreError> {
    String::from_utf8(bytes.to_vec()).map_err(|_| corrupt(what))
}

fn seq_key(key: &[u8], what: &str) -> Result<u64, StoreError> {
    keys::parse_seq(key).ok_or_else(|| corrupt(what))
}

fn folded_mark(key: &[u8], value: &[u8]) -> Result<Record, StoreError> {
    Ok(Record::FoldedMark {
        partition: text(key, "folded mark's partition")?,
        mark: seq_key(value, "folded mark")?,
    })
}

fn timer(key: &[u8], value: &[u8]) -> Result<Record, StoreError> {
    let (due_at, conversation, name) = keys::parse_timer(key).ok_or_else(|| corrupt("timer"))?;
    let entry: crate::timers::Entry = decode(value, "timer entry")?;
    Ok(Record::Timer(TimerStart {
        timer: TimerRef {
            due_at,
            conversation: conversation.to_owned(),
            name: name.to_owned(),
        },
        started_by: entry.started_by,
        bot_id: entry.bot_id,
    }))
}

fn waiting(key: &[u8], _: &[u8]) -> Result<Record, StoreError> {
    let unreadable = || corrupt("waiting queue entry");
    let prefix = keys::queue_bot_of(key).ok_or_else(unreadable)?;
    let bot = text(
        prefix.get(3..).ok_or_else(unreadable)?,
        "waiting entry's bot",
    )?;
    let since = keys::parse_queue_requested_at(key).ok_or_else(unreadable)?;
    let conversation = keys::parse_queue_entry(prefix, key).ok_or_else(unreadable)?;
    Ok(Record::Waiting(QueueEntry {
        bot,
        since,
        conversation: conversation.to_owned(),
    }))
}

fn accept_history(key: &[u8], value: &[u8]) -> Result<Record, StoreError> {
    Ok(Record::AcceptHistory {
        bot: text(key.get(1..).unwrap_or_default(), "accept history's bot")?,
        history: decode(value, "accept history")?,
    })
}

fn hour_figures(key: &[u8], value: &[u8]) -> Result<Record, StoreError> {
    Ok(Record::HourFigures {
        hour: keys::parse_queue_stats(key).ok_or_else(|| corrupt("hour figures' key"))?,
        stats: decode(value, "handoff stats")?,
    })
}

fn ledger(key: &[u8], value: &[u8]) -> Result<Record, StoreError> {
    Ok(Record::Ledger {
        action_id: text(key, "action id")?,
        status: decode(value, "action status")?,
    })
}

fn operator_action(key: &[u8], value: &[u8]) -> Result<Record, StoreError> {
    Ok(Record::OperatorAction {
        id: seq_key(key, "operator action key")?,
        action: decode(value, "operator action")?,
    })
}

/// `route`, a 0 byte, the caller's key (`idempotency::key`).
fn idempotency(key: &[u8], value: &[u8]) -> Result<Record, StoreError> {
    let split = key
        .iter()
        .position(|b| *b == 0)
        .ok_or_else(|| corrupt("idempotency key"))?;
    Ok(Record::Idempotency {
        route: text(&key[..split], "idempotency route")?,
        key: text(&key[split + 1..], "idempotency key")?,
        record: decode(value, "idempotency record")?,
    })
}

/// Frames read from the log at most this many at a time...
const FRAMES_PER_READ: usize = 256;
/// ...or until their bodies hold this many bytes.
const BYTES_PER_READ: usize = 4 << 20;

/// The event log's frames as records, read a bounded run of frames at a time from where the last
/// run ended.
struct LogFrames<'a> {
    store: &'a SledStore,
    next: eventlog::LogPosition,
    done: bool,
    ready: VecDeque<Record>,
}

impl<'a> LogFrames<'a> {
    fn new(store: &'a SledStore) -> Self {
        LogFrames {
            store,
            next: eventlog::LogPosition::default(),
            done: false,
            ready: VecDeque::new(),
        }
    }

    /// The next run of frames into `ready`; the log's end sets `done`.
    fn fill(&mut self) -> Result<(), StoreError> {
        let (mut bytes, mut cut, mut failed) = (0, false, None);
        let ready = &mut self.ready;
        let end = eventlog::scan(&self.store.log_dir, self.next, |_, record, _| {
            match delivery(&record) {
                Ok(r) => {
                    bytes += r.weight();
                    ready.push_back(r);
                }
                Err(e) => {
                    failed = Some(e);
                    return ControlFlow::Break(());
                }
            }
            cut = ready.len() >= FRAMES_PER_READ || bytes >= BYTES_PER_READ;
            match cut {
                true => ControlFlow::Break(()),
                false => ControlFlow::Continue(()),
            }
        })
        .map_err(super::log_error)?;
        if let Some(e) = failed {
            return Err(e);
        }
        self.next = end.next;
        self.done = !cut;
        Ok(())
    }
}

impl Iterator for LogFrames<'_> {
    type Item = Result<Record, StoreError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.ready.is_empty() && !self.done {
            if let Err(e) = self.fill() {
                self.done = true;
                return Some(Err(e));
            }
        }
        self.ready.pop_front().map(Ok)
    }
}

/// A log frame as the delivery it stored.
fn delivery(record: &eventlog::LogRecord) -> Result<Record, StoreError> {
    let events = (0..record.events.len())
        .map(|i| EventRecord::from_log(record, i))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Record::Delivery {
        id: DeliveryId::new(record.delivery.clone()),
        received_at: record.received_at,
        events,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::port::*;
    use crate::test_support::{accept, drain, said, store};

    fn all(dump: &Dump<'_>, kind: Kind) -> Vec<Record> {
        dump.records(kind)
            .expect("records")
            .collect::<Result<_, _>>()
            .expect("read")
    }

    #[test]
    fn the_log_is_read_in_runs_of_frames_each_delivery_once_in_order() {
        let (_dir, store) = store();
        let n = FRAMES_PER_READ * 2 + 3;
        for i in 0..n {
            accept(
                &store,
                &said(&format!("d{i}"), &format!("e{i}"), "c1", "hi"),
            );
        }
        let deliveries = all(&store.dump(), Kind::Delivery);
        let ids: Vec<String> = deliveries
            .iter()
            .map(|r| match r {
                Record::Delivery { id, events, .. } => {
                    assert_eq!(events.len(), 1);
                    id.as_str().to_owned()
                }
                other => panic!("{other:?}"),
            })
            .collect();
        let wanted: Vec<String> = (0..n).map(|i| format!("d{i}")).collect();
        assert_eq!(ids, wanted);
    }

    #[test]
    fn the_watermark_is_the_first_event_at_or_after_it_and_numbers_go_past_every_one() {
        let (_dir, store) = store();
        accept(&store, &said("d1", "e1", "c1", "a"));
        accept(&store, &said("d2", "e2", "c2", "b"));
        drain(&store);
        let at = store.dump().positions().expect("positions");
        assert_eq!(
            (at.fold_from, at.next_event),
            (3, 3),
            "all folded: the log's end"
        );
        accept(&store, &said("d3", "e3", "c1", "c"));
        let at = store.dump().positions().expect("positions");
        assert_eq!((at.fold_from, at.next_event), (3, 4), "e3 waits");
        store.set_backfill_cursor(77).expect("cursor");
        assert_eq!(
            store.dump().positions().expect("read").backfill_cursor,
            Some(77)
        );
        let marks = all(&store.dump(), Kind::FoldedMark);
        assert_eq!(marks.len(), 2, "{marks:?}");
        assert_eq!(all(&store.dump(), Kind::Conversation).len(), 2);
    }

    #[test]
    fn every_kind_has_its_name() {
        let names: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
        assert!(names.contains(&"deliveries") && names.contains(&"desk_contacts"));
        let unique: std::collections::HashSet<&&str> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
    }
}
