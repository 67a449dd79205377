//! The write set: everything a batch fold changed, in words of no backend, for the store to
//! commit in one atomic write (the sled backend: one journal; a table backend: one transaction).

use super::{Applied, Cached, ConversationFound, FoldBatch, HeldBack};
use crate::index::{Activity, Derived, DerivedFacts, QueueEntry, StateKind, TimerRef};
use crate::state::queue::AcceptHistory;
use crate::state::stats::HandoffStats;
use crate::state::{BotState, ConversationState, EndUserState};
use model::action::OutboxEntry;
use model::cursor::Cursor;
use model::ids::PartitionKey;
use model::webhook::model::Millis;
use std::collections::{HashMap, HashSet};

/// Everything a batch fold changed. Committed wholly or not at all: a crash leaves the batch's
/// events above their marks, to be folded again, and its decisions undecided.
#[derive(Debug, Default)]
pub struct WriteSet {
    /// The states the batch touched, whole, each with whether the batch created it.
    pub conversations: Vec<StateWrite<ConversationState>>,
    pub end_users: Vec<StateWrite<EndUserState>>,
    pub bots: Vec<StateWrite<BotState>>,
    /// Each partition the batch folded or passed over events of: its folded mark raised, and
    /// where those events are in the log (the index by partition).
    pub partitions: Vec<PartitionWrite>,
    /// The folds' low watermark to record (`None`: leave it).
    pub fold_from: Option<Cursor>,
    /// The agent API's listing and the sweeper's index: entries gone, entries new.
    pub derived: IndexChanges<Derived>,
    /// The retention index: entries gone, entries new.
    pub activity: IndexChanges<Activity>,
    pub timers: TimerChanges,
    pub queue: QueueChanges,
    /// What the batch did; its decided outbox entries (`applied.outbox`, in decision order) are
    /// numbered by the store as it commits them.
    pub applied: Applied,
    /// The rules held back per event (firing caps, failed templates), for the store to log.
    pub held_back: Vec<HeldBack>,
}

impl WriteSet {
    /// A write set of decided entries alone (a replay's).
    pub fn outbox_only(entries: Vec<OutboxEntry>) -> WriteSet {
        WriteSet {
            applied: Applied {
                outbox: entries,
                ..Applied::default()
            },
            ..WriteSet::default()
        }
    }
}

/// A state to write, and whether the batch created it (a record the store did not hold).
#[derive(Debug)]
pub struct StateWrite<T> {
    pub state: T,
    pub created: bool,
}

/// A partition's part of a write set.
#[derive(Debug)]
pub struct PartitionWrite {
    pub partition: PartitionKey,
    /// Its new folded mark, when the batch raised it.
    pub mark: Option<u64>,
    /// Its events the batch folded or passed over (number, place in the log), for the index by
    /// partition (none when the batch's events came from no log).
    pub events: Vec<(u64, Cursor)>,
}

/// An index's changes: entries removed, entries added.
#[derive(Debug)]
pub struct IndexChanges<T> {
    pub removed: Vec<T>,
    pub added: Vec<T>,
}

impl<T> Default for IndexChanges<T> {
    fn default() -> Self {
        IndexChanges {
            removed: Vec::new(),
            added: Vec::new(),
        }
    }
}

/// A timer started (or restarted: a new due time is a new timer), with what firing it needs.
#[derive(Debug, PartialEq, Eq)]
pub struct TimerStart {
    pub timer: TimerRef,
    pub started_by: String,
    /// The conversation's bot (the firing event's `sourceId`); empty when it has none.
    pub bot_id: String,
}

/// The running timers' changes.
#[derive(Debug, Default)]
pub struct TimerChanges {
    /// Fired, cancelled or replaced (each once).
    pub stopped: Vec<TimerRef>,
    pub started: Vec<TimerStart>,
    /// The earliest due time among `started` (a firer sleeping past it is woken).
    pub earliest: Option<Millis>,
}

/// The waiting queue's changes, and the figures kept beside it.
#[derive(Debug, Default)]
pub struct QueueChanges {
    /// Entries of conversations that stopped waiting (or now wait since another time).
    pub left: Vec<QueueEntry>,
    /// Entries of conversations that wait now.
    pub joined: Vec<QueueEntry>,
    /// Each bot's accept history that grew, whole.
    pub accepts: Vec<(String, AcceptHistory)>,
    /// Each hour's handoff figures the batch added to, whole (its start, the figures).
    pub hours: Vec<(Millis, HandoffStats)>,
}

impl FoldBatch {
    /// The write set of what the batch did, recording `fold_from` as the folds' watermark.
    pub(super) fn finish(self, fold_from: Option<Cursor>) -> WriteSet {
        let FoldBatch {
            mut out,
            convs,
            users,
            bots,
            partitions,
            fired,
            queue,
            held_back,
            ..
        } = self;
        let timers = timer_changes(&convs, &fired, &mut out.timers_change);
        let mut derived = IndexChanges::default();
        let mut activity = IndexChanges::default();
        for (id, c) in &convs {
            derived_changes(&mut derived, id, c);
            let now = crate::index::conversation_activity(&c.state);
            activity_change(
                &mut activity,
                (StateKind::Conversation, id),
                c.found.activity,
                now,
            );
        }
        for (id, u) in &users {
            let now = crate::index::end_user_activity(&u.state);
            activity_change(&mut activity, (StateKind::EndUser, id), u.found, now);
        }
        let (queue, exits) = queue.finish();
        out.queue_exits = exits;
        WriteSet {
            conversations: written(convs),
            end_users: written(users),
            bots: written(bots),
            partitions: partitions
                .0
                .into_iter()
                .filter(|(_, p)| p.raised || !p.events.is_empty())
                .map(|(partition, p)| PartitionWrite {
                    partition,
                    mark: p.mark.filter(|_| p.raised),
                    events: p.events,
                })
                .collect(),
            fold_from,
            derived,
            activity,
            timers,
            queue,
            applied: out,
            held_back,
        }
    }
}

fn written<T, F>(cache: HashMap<String, Cached<T, F>>) -> Vec<StateWrite<T>> {
    cache
        .into_values()
        .map(|c| StateWrite {
            state: c.state,
            created: c.created,
        })
        .collect()
}

/// A state's retention entry as found (`found`: its activity time then, `None` when created)
/// against its activity time `now`.
fn activity_change(
    out: &mut IndexChanges<Activity>,
    (kind, id): (StateKind, &str),
    found: Option<Millis>,
    now: Millis,
) {
    if found == Some(now) {
        return;
    }
    let entry = |at| Activity {
        kind,
        at,
        id: id.to_owned(),
    };
    out.removed.extend(found.map(entry));
    out.added.push(entry(now));
}

/// A conversation's derived entries as found against its entries now (listed only when the
/// facts they derive from changed).
fn derived_changes(
    out: &mut IndexChanges<Derived>,
    id: &str,
    c: &Cached<ConversationState, ConversationFound>,
) {
    let now = DerivedFacts::of(&c.state);
    if c.found.derived.as_ref() == Some(&now) {
        return;
    }
    let old = c
        .found
        .derived
        .as_ref()
        .map(|facts| facts.entries(id))
        .unwrap_or_default();
    let new = now.entries(id);
    out.removed
        .extend(old.iter().filter(|e| !new.contains(e)).cloned());
    out.added
        .extend(new.into_iter().filter(|e| !old.contains(e)));
}

/// The timers' changes: each conversation's timers as the batch found them against its timers
/// now, plus the folded firings (`fired`), whose timers stop unless they run again under the same
/// due time and name. Only folds change the timers, one at a time, so what the store holds is
/// what the batch found: `change` (gained minus lost) needs no read.
fn timer_changes(
    convs: &HashMap<String, Cached<ConversationState, ConversationFound>>,
    fired: &[TimerRef],
    change: &mut i64,
) -> TimerChanges {
    type Key<'a> = (Millis, &'a str, &'a str);
    let mut out = TimerChanges::default();
    let stored: HashSet<Key<'_>> = convs
        .iter()
        .flat_map(|(id, c)| {
            let timers = c.found.timers.iter();
            timers.map(move |(name, t)| (t.due_at, id.as_str(), name.as_str()))
        })
        .collect();
    let mut kept: HashSet<Key<'_>> = HashSet::new();
    let mut stopped: Vec<Key<'_>> = Vec::new();
    for (id, c) in convs {
        for (name, timer) in &c.state.timers {
            let key = (timer.due_at, id.as_str(), name.as_str());
            kept.insert(key);
            if c.found.timers.get(name) == Some(timer) {
                continue;
            }
            *change += i64::from(!stored.contains(&key));
            out.earliest = Some(out.earliest.map_or(timer.due_at, |e| e.min(timer.due_at)));
            out.started.push(TimerStart {
                timer: timer_ref(key),
                started_by: timer.started_by.clone(),
                bot_id: c
                    .state
                    .bot_id
                    .as_ref()
                    .map(|b| b.to_string())
                    .unwrap_or_default(),
            });
        }
        let gone = c.found.timers.iter();
        let gone = gone.map(|(name, t)| (t.due_at, id.as_str(), name.as_str()));
        stopped.extend(gone.filter(|key| !kept.contains(key)));
    }
    let fired = fired
        .iter()
        .map(|t| (t.due_at, t.conversation.as_str(), t.name.as_str()));
    stopped.extend(fired.filter(|key| !kept.contains(key)));
    stopped.sort_unstable();
    stopped.dedup();
    for key in &stopped {
        *change -= i64::from(stored.contains(key));
    }
    out.stopped = stopped.into_iter().map(timer_ref).collect();
    out
}

fn timer_ref((due_at, conversation, name): (Millis, &str, &str)) -> TimerRef {
    TimerRef {
        due_at,
        conversation: conversation.to_owned(),
        name: name.to_owned(),
    }
}
