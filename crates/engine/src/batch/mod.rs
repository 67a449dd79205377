//! The batch fold: a fold job's events (of several partitions, each partition's in order) folded
//! into their states and decided for, in memory. What it reads comes through [`FoldReads`] (the
//! states, the folded marks, the action ledger, the waiting queue), each record once per batch;
//! what it changes comes out as one [`WriteSet`], which a store commits atomically. The engine
//! keeps its purity: nothing here does I/O, and a store brings only reads and the commit (the
//! storage port's `Folds::begin_fold`).
//!
//! An event at or below its partition's folded mark was folded before and is skipped, so a batch
//! folded again after a crash folds each event once. An action is queued once: its id (event,
//! rule, position) is checked against the batch's own and the ledger's.

mod queue;
mod writes;

pub use writes::{
    IndexChanges, PartitionWrite, QueueChanges, StateWrite, TimerChanges, TimerStart, WriteSet,
};

use crate::decide::{apply_to_state, Capped, Decide, DecisionTime, Failed};
use crate::index::{DerivedFacts, QueueSpot, TimerRef};
use crate::state::stats::{HandoffStats, QueueExit};
use crate::state::{BotState, ConversationState, EndUserState, Timer};
use model::action::{action_id, Decision, OutboxEntry};
use model::cursor::Cursor;
use model::ids::{ConversationId, EndUserId, EventId, PartitionKey};
use model::webhook::model::{Event, Millis, Payload};
use std::collections::{BTreeMap, HashMap, HashSet};

/// What the batch fold reads from the store, under the store's fold lock (or in its
/// transaction): records by key, never a scan. `None` is "not there".
pub trait FoldReads {
    /// The store's error; a broken rule of the fold itself ([`FoldError`]) becomes one.
    type Error: From<FoldError>;

    fn conversation(
        &mut self,
        id: &ConversationId,
    ) -> Result<Option<ConversationState>, Self::Error>;
    fn end_user(&mut self, id: &EndUserId) -> Result<Option<EndUserState>, Self::Error>;
    fn bot(&mut self, id: &str) -> Result<Option<BotState>, Self::Error>;
    /// A partition's folded mark (its encoded key, `PartitionKey::encode`): the number of its
    /// last folded event.
    fn folded_mark(&mut self, partition: &str) -> Result<Option<u64>, Self::Error>;
    /// Whether the action id was ever decided (the ledger).
    fn decided_before(&mut self, action_id: &str) -> Result<bool, Self::Error>;
    /// What the ledger says of an action id (`pending`, `done`, `dead`, `dropped`).
    fn ledger_state(&mut self, action_id: &str) -> Result<Option<String>, Self::Error>;
    /// A bot's recent accepts.
    fn accept_history(
        &mut self,
        bot: &str,
    ) -> Result<Option<crate::state::queue::AcceptHistory>, Self::Error>;
    /// An hour's handoff figures (`hour`: its start). A record the store cannot read is counted
    /// afresh (`None`): the figures never hold the folds up.
    fn hour_stats(&mut self, hour: Millis) -> Result<Option<HandoffStats>, Self::Error>;
    /// The committed waiting queue of `bot`: how many wait, and how many of them sort before
    /// `own` (which may not be among them), leaving out those of `found` that are there (the
    /// batch's conversations as it found them: its own changes decide for them).
    fn waiting_standing(
        &mut self,
        bot: &str,
        own: Option<QueueSpot<'_>>,
        found: &mut dyn Iterator<Item = QueueSpot<'_>>,
    ) -> Result<(usize, usize), Self::Error>;
}

/// A broken rule of the fold itself (a bug), refused instead of risking the store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("fold: {0}")]
pub struct FoldError(pub &'static str);

/// An event still to fold: its number, ordering domain and place in the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingEvent {
    pub seq: u64,
    pub partition: PartitionKey,
    pub at: Cursor,
}

/// What a fold records beside the events' effects: how far the folds have come.
#[derive(Clone, Debug, Default)]
pub struct Position {
    /// At or before every event still to fold once this fold commits (the folds' low
    /// watermark); `None` leaves it as it is.
    pub fold_from: Option<Cursor>,
    /// Events passed over without folding (unreadable, so quarantined instead): marked folded
    /// and indexed by partition.
    pub passed: Vec<PendingEvent>,
    /// Where each event of the batch is in the log, parallel to it: each folded event is indexed
    /// by partition. Empty for events in no log (offline folds, tests), which are then not
    /// indexed.
    pub frames: Vec<Cursor>,
}

/// A fold job's events.
pub struct Batch<'a> {
    /// The events with their sequence numbers, each partition's in order.
    pub events: &'a [(u64, Event)],
    /// Each event's partition as intake stored it (its folded mark's key).
    pub partitions: &'a [PartitionKey],
    /// Each event's receive time (firing caps count by it); the event's own time where missing.
    pub received: &'a [Millis],
    pub position: &'a Position,
    /// When the fold runs: a new record's first sight, an outbox entry's `decided_at`. Decisions
    /// read each event's receive time instead (`received`), so they are the log's alone.
    pub now: Millis,
}

/// What folding a batch did (and, once committed, the outbox entries with their numbers).
#[derive(Debug, Default, PartialEq)]
pub struct Applied {
    pub applied: usize,
    pub skipped: usize,
    pub new_conversations: u64,
    pub new_end_users: u64,
    pub new_bots: u64,
    /// Actions the rules decided, in decision order: in the outbox once committed (numbered
    /// then), and run from there.
    pub outbox: Vec<OutboxEntry>,
    /// Decided actions skipped because their id was decided before.
    pub repeated_actions: usize,
    /// Running timers gained minus lost (started, minus fired, cancelled or replaced).
    pub timers_change: i64,
    /// The rule of each event a firing cap held a rule back for (one per hit, for the metric).
    pub capped: Vec<String>,
    /// The rule of each action whose template failed at run time (one per action, for the
    /// metric; the state keeps the error).
    pub template_errors: Vec<String>,
    /// The verdict on each folded agent command (the agent API waits for them).
    pub agent_verdicts: Vec<crate::state::desk::Verdict>,
    /// Each conversation that left the waiting queue in this fold: why, and how long it had
    /// waited (ms) when it was accepted (for the metrics; the hour records hold the same).
    pub queue_exits: Vec<(QueueExit, Option<Millis>)>,
}

/// The rules held back for one event (firing caps, failed templates), for the store to log.
#[derive(Clone, Debug, PartialEq)]
pub struct HeldBack {
    pub conversation: ConversationId,
    pub event: EventId,
    pub capped: Vec<Capped>,
    pub failed: Vec<Failed>,
}

/// Fold `batch` with `rules` deciding, reading through `reads`; what to commit. Reading and
/// folding happen here, before anything is written: the store commits the result in one atomic
/// write, under the lock (or in the transaction) `reads` holds.
pub fn fold_batch<R: FoldReads + ?Sized>(
    reads: &mut R,
    batch: Batch<'_>,
    rules: &dyn Decide,
) -> Result<WriteSet, R::Error> {
    let Batch {
        events,
        partitions,
        received,
        position,
        now,
    } = batch;
    let framed = !position.frames.is_empty();
    if partitions.len() != events.len() || (framed && position.frames.len() != events.len()) {
        return Err(FoldError("a partition (and a frame, if any) per event expected").into());
    }
    let mut fold = FoldBatch::new(now);
    for (i, ((seq, event), partition)) in events.iter().zip(partitions).enumerate() {
        let at = position.frames.get(i).copied();
        if !fold.partitions.raise(reads, partition, *seq, at)? {
            fold.out.skipped += 1;
            continue;
        }
        fold.out.applied += 1;
        if let Some(id) = event.payload.conversation_id() {
            let at = received.get(i).copied().unwrap_or(event.timestamp);
            fold.conversation_event(reads, (id, event), rules, at)?;
        } else if let Payload::EndUser(u) = &event.payload {
            fold.end_user(reads, &u.id)?.apply(event, u);
        } else {
            fold.bot_event(reads, event)?;
        }
    }
    // After the batch: a passed-over event may come after events of its partition that this
    // fold folds, and a mark raised first would skip them.
    for passed in &position.passed {
        fold.partitions
            .pass(reads, &passed.partition, passed.seq, passed.at)?;
    }
    Ok(fold.finish(position.fold_from))
}

/// A state as a batch holds it: read once (or created), with what the batch noted of it then.
struct Cached<T, F> {
    state: T,
    created: bool,
    found: F,
}

/// What a batch notes of a conversation when it first reads it (the write set compares the state
/// after with it): its timers, derived index facts and activity time; `None`s when created.
struct ConversationFound {
    timers: BTreeMap<String, Timer>,
    derived: Option<DerivedFacts>,
    activity: Option<Millis>,
}

/// The state `key` as `cache` has it, else read, else new (`found` notes what the write set
/// compares, given the state as read, `None` when created). `true` with it when it was created
/// now (the batch's first sight of a new record).
fn cached<'c, T, F, E: From<FoldError>>(
    cache: &'c mut HashMap<String, Cached<T, F>>,
    key: &str,
    read: impl FnOnce() -> Result<Option<T>, E>,
    new: impl FnOnce() -> T,
    found: impl FnOnce(Option<&T>) -> F,
) -> Result<(&'c mut Cached<T, F>, bool), E> {
    let mut created = false;
    if !cache.contains_key(key) {
        let entry = match read()? {
            Some(state) => Cached {
                found: found(Some(&state)),
                state,
                created: false,
            },
            None => {
                created = true;
                Cached {
                    found: found(None),
                    state: new(),
                    created: true,
                }
            }
        };
        cache.insert(key.to_owned(), entry);
    }
    let entry = cache
        .get_mut(key)
        .ok_or(FoldError("a state the batch read went missing"))?;
    Ok((entry, created))
}

/// The partitions a batch folds: each one's folded mark as read (once), the mark it raises, and
/// where its events folded (or passed over) are in the log.
#[derive(Default)]
struct Partitions(HashMap<PartitionKey, PartitionFold>);

struct PartitionFold {
    /// The mark now: as read, or as this batch raised it.
    mark: Option<u64>,
    raised: bool,
    events: Vec<(u64, Cursor)>,
}

impl Partitions {
    fn get<R: FoldReads + ?Sized>(
        &mut self,
        reads: &mut R,
        partition: &PartitionKey,
    ) -> Result<&mut PartitionFold, R::Error> {
        if !self.0.contains_key(partition) {
            let mark = reads.folded_mark(&partition.encode())?;
            let fold = PartitionFold {
                mark,
                raised: false,
                events: Vec::new(),
            };
            self.0.insert(partition.clone(), fold);
        }
        let fold = self.0.get_mut(partition);
        Ok(fold.ok_or(FoldError("a partition the batch read went missing"))?)
    }

    /// Raise a partition's mark to `seq` if it is above it (the event is then folded, and
    /// indexed at `at`); returns whether it was.
    fn raise<R: FoldReads + ?Sized>(
        &mut self,
        reads: &mut R,
        partition: &PartitionKey,
        seq: u64,
        at: Option<Cursor>,
    ) -> Result<bool, R::Error> {
        let fold = self.get(reads, partition)?;
        if fold.mark.is_some_and(|mark| seq <= mark) {
            return Ok(false);
        }
        fold.mark = Some(seq);
        fold.raised = true;
        fold.events.extend(at.map(|at| (seq, at)));
        Ok(true)
    }

    /// An event passed over: indexed, and its partition's mark raised to it if it is above.
    fn pass<R: FoldReads + ?Sized>(
        &mut self,
        reads: &mut R,
        partition: &PartitionKey,
        seq: u64,
        at: Cursor,
    ) -> Result<(), R::Error> {
        let fold = self.get(reads, partition)?;
        fold.events.push((seq, at));
        if fold.mark.is_none_or(|mark| seq > mark) {
            fold.mark = Some(seq);
            fold.raised = true;
        }
        Ok(())
    }
}

/// What one fold batch has read and changed so far: the states it touched (read once, then kept
/// here), the marks it raises and what the write set at its end must also say.
struct FoldBatch {
    out: Applied,
    /// When the fold runs (`Batch::now`); not the decisions' clock.
    now: Millis,
    convs: HashMap<String, Cached<ConversationState, ConversationFound>>,
    /// End users, with their activity time as found (`None`: created).
    users: HashMap<String, Cached<EndUserState, Option<Millis>>>,
    bots: HashMap<String, Cached<BotState, ()>>,
    partitions: Partitions,
    decided: HashSet<String>,
    /// The timers of the firings folded.
    fired: Vec<TimerRef>,
    queue: queue::QueueFold,
    held_back: Vec<HeldBack>,
}

impl FoldBatch {
    fn new(now: Millis) -> Self {
        FoldBatch {
            out: Applied::default(),
            now,
            convs: HashMap::new(),
            users: HashMap::new(),
            bots: HashMap::new(),
            partitions: Partitions::default(),
            decided: HashSet::new(),
            fired: Vec::new(),
            queue: queue::QueueFold::default(),
            held_back: Vec::new(),
        }
    }

    /// The end user `id` as this batch has it.
    fn end_user<R: FoldReads + ?Sized>(
        &mut self,
        reads: &mut R,
        id: &EndUserId,
    ) -> Result<&mut EndUserState, R::Error> {
        let (user, created) = cached(
            &mut self.users,
            id.as_str(),
            || reads.end_user(id),
            || EndUserState::new(id.clone()),
            |found| found.map(crate::index::end_user_activity),
        )?;
        self.out.new_end_users += u64::from(created);
        Ok(&mut user.state)
    }

    /// Bot events, and events of unknown types, belong to the bot.
    fn bot_event<R: FoldReads + ?Sized>(
        &mut self,
        reads: &mut R,
        event: &Event,
    ) -> Result<(), R::Error> {
        let id = match &event.payload {
            Payload::Bot(b) => &b.id,
            _ => &event.source_id,
        };
        let (bot, created) = cached(
            &mut self.bots,
            id.as_str(),
            || reads.bot(id.as_str()),
            || BotState::new(id.clone()),
            |_| (),
        )?;
        bot.state.apply(event);
        self.out.new_bots += u64::from(created);
        Ok(())
    }

    /// Fold a conversation's event and decide for it (`fold_and_decide`, with the end user and
    /// the waiting queue it reads), queue its decisions, and note its end user.
    fn conversation_event<R: FoldReads + ?Sized>(
        &mut self,
        reads: &mut R,
        (id, event): (&ConversationId, &Event),
        rules: &dyn Decide,
        received_at: Millis,
    ) -> Result<(), R::Error> {
        if let Payload::Timer(t) = &event.payload {
            self.fired.push(TimerRef {
                due_at: t.due_at,
                conversation: id.as_str().to_owned(),
                name: t.name.clone(),
            });
        }
        // The decisions' clock is the event's receive time, stored with it: a fold done again
        // (after a crash lost the first, whose actions may have run) decides the same.
        let time = DecisionTime {
            now: received_at,
            received_at,
        };
        let state = conversation(reads, &mut self.convs, id, &mut self.out.new_conversations)?;
        let user = match rules.needs().end_user {
            true => end_user_of(reads, state, event, &self.users)?,
            false => None,
        };
        let queue = &mut self.queue;
        // Since when it waited before each look at it (a second look follows a hand-back the
        // rules decided: `fold_and_decide`).
        let mut waited_since = queue.before(state);
        let mut after_fold = |after: &ConversationState| {
            queue.after(reads, after, waited_since, event.timestamp)?;
            waited_since = crate::state::queue::waiting_since(after);
            match rules.needs().queue {
                true => queue.standing(reads, after).map(Some),
                false => Ok(None),
            }
        };
        let decided = crate::fold::fold_and_decide(
            state,
            event,
            rules,
            user.as_deref(),
            time,
            &mut after_fold,
        )?
        .unwrap_or_default();
        if let Payload::Agent(_) = &event.payload {
            if let Some(verdict) = state.desk.verdict(event.id.as_str()) {
                self.out.agent_verdicts.push(verdict.clone());
            }
        }
        if !decided.capped.is_empty() || !decided.failed.is_empty() {
            let held = HeldBack {
                conversation: id.clone(),
                event: event.id.clone(),
                capped: decided.capped,
                failed: decided.failed,
            };
            note_held_back(&mut self.out, &mut self.held_back, held);
        }
        let decided_by = (rules.version(), received_at, self.now);
        let queued = Queued {
            decided: &mut self.decided,
            out: &mut self.out,
        };
        queued.decisions(reads, event, state, decided.decisions, decided_by)?;
        if let Payload::Conversation(c) = &event.payload {
            if let Some(uid) = &c.end_user_id {
                self.end_user(reads, uid)?.observe_conversation(event, c);
            }
        }
        Ok(())
    }
}

/// The rules a fold held back for an event (a firing cap, a failed template): counted in what the
/// fold applied, and kept for the store to log.
fn note_held_back(out: &mut Applied, kept: &mut Vec<HeldBack>, held: HeldBack) {
    out.capped
        .extend(held.capped.iter().map(|hit| hit.rule.clone()));
    out.template_errors
        .extend(held.failed.iter().map(|failed| failed.rule.clone()));
    kept.push(held);
}

/// The conversation `id` as the batch has it (read the first time, noting what the write set
/// compares: [`ConversationFound`]); counted in `created` when new.
fn conversation<'c, R: FoldReads + ?Sized>(
    reads: &mut R,
    convs: &'c mut HashMap<String, Cached<ConversationState, ConversationFound>>,
    id: &ConversationId,
    created: &mut u64,
) -> Result<&'c mut ConversationState, R::Error> {
    let (conv, new) = cached(
        convs,
        id.as_str(),
        || reads.conversation(id),
        || ConversationState::new(id.clone()),
        |found| ConversationFound {
            timers: found.map(|s| s.timers.clone()).unwrap_or_default(),
            derived: found.map(DerivedFacts::of),
            activity: found.map(crate::index::conversation_activity),
        },
    )?;
    *created += u64::from(new);
    Ok(&mut conv.state)
}

/// Where a batch queues decisions: the ids it queued so far and what it applied.
struct Queued<'a> {
    decided: &'a mut HashSet<String>,
    out: &'a mut Applied,
}

impl Queued<'_> {
    /// Apply a fold's internal state actions to `state` and turn the others into outbox entries
    /// (numbered by the store when it commits), skipping any id decided before (in this batch,
    /// or ever: the ledger).
    fn decisions<R: FoldReads + ?Sized>(
        self,
        reads: &mut R,
        event: &Event,
        state: &mut ConversationState,
        decisions: Vec<Decision>,
        decided_by: (&str, Millis, Millis),
    ) -> Result<(), R::Error> {
        // Timers count from the decisions' clock, the event's receive time.
        let (_, received_at, _) = decided_by;
        for decision in decisions {
            let id = action_id(&event.id, &decision.rule, decision.index);
            if apply_to_state(&decision.action, state, received_at, &id) {
                continue;
            }
            if self.decided.contains(&id) || reads.decided_before(&id)? {
                self.out.repeated_actions += 1;
                continue;
            }
            self.decided.insert(id.clone());
            let entry = OutboxEntry::decided(0, id, &event.id, decision, decided_by);
            self.out.outbox.push(entry);
        }
        Ok(())
    }
}

/// The end user of the conversation `event` belongs to (`fold::end_user_named`), as this batch
/// knows them: from its cache (an end-user event earlier in the batch), else read. Read only: a
/// user the bridge has not seen stays unknown and is not created.
fn end_user_of<'a, R: FoldReads + ?Sized>(
    reads: &mut R,
    state: &ConversationState,
    event: &Event,
    cache: &'a HashMap<String, Cached<EndUserState, Option<Millis>>>,
) -> Result<Option<std::borrow::Cow<'a, EndUserState>>, R::Error> {
    let Some(id) = crate::fold::end_user_named(state, event) else {
        return Ok(None);
    };
    if let Some(user) = cache.get(id.as_str()) {
        return Ok(Some(std::borrow::Cow::Borrowed(&user.state)));
    }
    Ok(reads.end_user(id)?.map(std::borrow::Cow::Owned))
}

#[cfg(test)]
mod tests;
