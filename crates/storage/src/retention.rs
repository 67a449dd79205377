//! Retention of conversation and end-user states (`store.state_retention`), of quarantine
//! records (`store.quarantine_retention`) and of the handoff figures' hour records (kept
//! `engine::state::stats::KEPT_MS`).
//!
//! The retention index (`activity/v1`) holds every conversation and end user by its newest
//! activity time (`engine::index::Activity`), oldest first. Like the
//! waiting queue and the sweeper's index, only folds write it, in their journal, as the
//! difference between a state's key before and after the fold; so a pruning pass reads the
//! states past retention as a range, in chunks, without reading every state. A store from before
//! the index is indexed once, on open.
//!
//! A state goes under the fold lock, re-read first (skipped if it changed since the range was
//! read), only when its partition's events are all folded below the folds' watermark (none in
//! the log from there on, still to fold) and no outbox entry of it is pending; then ONE
//! transaction removes the state and every key derived from it ([`state_keys`]: the waiting
//! entry, the fold-kept indexes' keys (`store::derived`: the sweeper's, the agent API's phase
//! index), the timers, the retention
//! key), its folded mark and its count. A later event of a pruned conversation folds into a fresh
//! state, as for one never seen (see ARCHITECTURE.md, "Retention").

use super::{
    decode, dedupe, eventlog, keys, log, log_error, poisoned_dedupe, ConversationState,
    EndUserState, Pruned, SledStore, StoreError,
};
use crate::idempotency::IdempotencyRecord;
use crate::operators::OperatorAction;
use crate::outbox::ActionStatus;
use crate::port::{Outbox, Quarantine, Removed, Retention};
use engine::index::{Activity, StateKind};
use model::action::DoneRecord;
use model::cursor::Cursor;
use model::ids::PartitionKey;
use model::webhook::model::Millis;
use serde::Serialize;
use std::collections::HashSet;
use std::ops::ControlFlow;

/// States examined per transaction (and per hold of the fold lock).
pub const CHUNK: usize = 1_000;

/// A retention index entry's key: kind, activity time, id.
pub(crate) fn key(entry: &Activity) -> Vec<u8> {
    let kind = match entry.kind {
        StateKind::Conversation => keys::ACTIVITY_CONVERSATION,
        StateKind::EndUser => keys::ACTIVITY_END_USER,
    };
    keys::activity(kind, entry.at, &entry.id)
}

pub(super) fn conversation_key(s: &ConversationState) -> Vec<u8> {
    key(&Activity::of_conversation(s))
}

pub(super) fn end_user_key(u: &EndUserState) -> Vec<u8> {
    key(&Activity::of_end_user(u))
}

/// Every key kept outside the `conversations` tree that is derived from a conversation's state:
/// what pruning the state removes with it. An index kept by the fold joins this list.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct StateKeys {
    /// In `queue/v1`: the waiting entry (`store::queue`) and every `store::derived` key (the
    /// sweeper's index, the agent API's phase index).
    pub queue: Vec<Vec<u8>>,
    /// In `timers/v1`: the running timers.
    pub timers: Vec<Vec<u8>>,
    /// In `activity/v1`: the retention key.
    pub activity: Vec<Vec<u8>>,
}

pub(super) fn state_keys(s: &ConversationState) -> StateKeys {
    let id = s.id.as_str();
    StateKeys {
        queue: super::queue::entry_of(s)
            .into_iter()
            .chain(super::derived::derived_keys(s))
            .collect(),
        timers: s
            .timers
            .iter()
            .map(|(name, t)| keys::timer(t.due_at, id, name))
            .collect(),
        activity: vec![conversation_key(s)],
    }
}

/// What a pruning pass of states removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StatesPruned {
    pub conversations: u64,
    pub end_users: u64,
    /// Running timers removed with their conversations (for the pending-timers gauge).
    pub timers: u64,
    /// States past retention left for a later pass: an outbox entry of theirs pending, their
    /// events not all folded below the watermark (an event of theirs logged at or after it), or
    /// (end users) their last conversation kept.
    pub skipped: u64,
    /// Transactions (chunks of candidates, each judged under the fold lock).
    pub chunks: u64,
}

/// The outbox queues with a pending entry, read once and then only the entries decided since
/// (seqs grow with decision order; only folds decide, and a pass holds the fold lock while it
/// judges a chunk, so nothing is decided meanwhile). A dead letter put back keeps its older seq
/// and is missed: it needs no state to run (a help-desk event leaves out what it cannot read).
#[derive(Default)]
struct PendingQueues {
    queues: HashSet<String>,
    after: Option<u64>,
}

impl PendingQueues {
    fn refresh(&mut self, store: &SledStore) -> Result<(), StoreError> {
        loop {
            let page = store.outbox_page(self.after, CHUNK)?;
            let Some(last) = page.last() else {
                return Ok(());
            };
            self.after = Some(last.seq);
            let full = page.len() == CHUNK;
            self.queues.extend(page.into_iter().map(|e| e.queue));
            if !full {
                return Ok(());
            }
        }
    }

    fn any(&self, queues: &[String]) -> bool {
        queues.iter().any(|q| self.queues.contains(q))
    }
}

/// Events [`Unfolded`] reads at most in a pass: a longer backlog of events still to fold leaves
/// every state for a later pass (bounding the pass's reading of the log and its memory).
const UNFOLDED_MAX: usize = 100_000;

/// The partitions with an event in the log at or after the folds' watermark, which may still be
/// to fold (queued in the dispatcher, or in a job waiting for the fold lock): a partition's folded
/// mark says nothing of events logged after it. Scanned from the watermark once, then only the
/// frames appended since (the log only grows and the watermark only moves on, so a partition seen
/// once stays: that only keeps a state longer). Past [`UNFOLDED_MAX`] events it holds every
/// partition.
struct Unfolded {
    partitions: HashSet<String>,
    /// Events read so far, and at most ([`UNFOLDED_MAX`]).
    events: usize,
    max: usize,
    /// Where the next scan starts (the watermark before the first).
    from: Option<super::eventlog::LogPosition>,
    overflow: bool,
}

/// The end user a logged event names besides its partition: a conversation event's
/// `data.conversation.endUserId`.
#[derive(serde::Deserialize)]
struct Named {
    data: Option<NamedData>,
}

#[derive(serde::Deserialize)]
struct NamedData {
    conversation: Option<NamedConversation>,
}

#[derive(serde::Deserialize)]
struct NamedConversation {
    #[serde(rename = "endUserId")]
    end_user_id: Option<String>,
}

impl Default for Unfolded {
    fn default() -> Self {
        Unfolded {
            partitions: HashSet::new(),
            events: 0,
            max: UNFOLDED_MAX,
            from: None,
            overflow: false,
        }
    }
}

impl Unfolded {
    fn refresh(&mut self, store: &SledStore) -> Result<(), StoreError> {
        if self.overflow {
            return Ok(());
        }
        let from = match self.from {
            Some(at) => at,
            None => store.watermark()?,
        };
        let (partitions, events, overflow, max) = (
            &mut self.partitions,
            &mut self.events,
            &mut self.overflow,
            self.max,
        );
        let end = super::eventlog::scan(&store.log_dir, from, |_, record, _| {
            *events += record.partitions.len();
            // A conversation event's fold writes the end user it names too.
            partitions.extend(record.events.iter().filter_map(|raw| {
                let named: Named = serde_json::from_str(raw.get()).ok()?;
                let id = named.data?.conversation?.end_user_id?;
                Some(PartitionKey::EndUser(model::ids::EndUserId::new(id)).encode())
            }));
            partitions.extend(record.partitions);
            if *events > max {
                *overflow = true;
                return std::ops::ControlFlow::Break(());
            }
            std::ops::ControlFlow::Continue(())
        })
        .map_err(super::log_error)?;
        self.from = Some(end.next);
        if self.overflow {
            self.partitions = HashSet::new();
            tracing::info!(
                events = self.max,
                "more events than this still to fold: states are kept this pass"
            );
        }
        Ok(())
    }

    fn any(&self, partition: &str) -> bool {
        self.overflow || self.partitions.contains(partition)
    }
}

/// What judging one candidate found.
enum Judged {
    /// Past retention: its removals (subject to the pending and folded checks).
    Past(Removal),
    /// Kept for now (`true`: count it as skipped).
    Kept(bool),
    /// Its state's key is another: it was active again since the range was read (the key is
    /// gone then), or the index is stale (an older build folded meanwhile): the state's key
    /// replaces this one.
    Moved(Vec<u8>),
    /// An index key without a state: the key alone goes.
    Orphan,
}

/// A state's removals.
struct Removal {
    partition: PartitionKey,
    tree: StateTree,
    id: String,
    derived: StateKeys,
    user_index: Option<Vec<u8>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum StateTree {
    Conversations,
    EndUsers,
}

/// What one chunk's transaction removed that memory must follow.
struct Committed {
    timers: u64,
    waiting: super::queue::WaitingChanges,
}

impl SledStore {
    /// [`SledStore::prune_states`], adding to `out` as each chunk commits: after an error it holds
    /// what the chunks before it removed (for the gauges that follow the store).
    fn prune_states_into(
        &self,
        before: Millis,
        chunk: usize,
        out: &mut StatesPruned,
    ) -> Result<(), StoreError> {
        let chunk = chunk.max(1);
        let mut pending = PendingQueues::default();
        let mut unfolded = Unfolded::default();
        let mut primed = false;
        for kind in [keys::ACTIVITY_CONVERSATION, keys::ACTIVITY_END_USER] {
            let mut from = vec![kind];
            let end = keys::activity(kind, before, "");
            loop {
                let candidates = self
                    .activity
                    .range(from.clone()..end.clone())
                    .keys()
                    .take(chunk)
                    .collect::<Result<Vec<_>, _>>()?;
                let Some(last) = candidates.last() else {
                    break;
                };
                from = last.to_vec();
                from.push(0);
                if !primed {
                    // The long reads (the whole outbox, the log from the watermark) before the
                    // fold lock: under it each chunk reads only what was decided or logged since.
                    pending.refresh(self)?;
                    unfolded.refresh(self)?;
                    primed = true;
                }
                self.prune_chunk(kind, &candidates, &mut pending, &mut unfolded, out)?;
                out.chunks += 1;
                if candidates.len() < chunk {
                    break;
                }
            }
        }
        Ok(())
    }

    fn prune_chunk(
        &self,
        kind: u8,
        candidates: &[sled::IVec],
        pending: &mut PendingQueues,
        unfolded: &mut Unfolded,
        out: &mut StatesPruned,
    ) -> Result<(), StoreError> {
        let _folding = self.fold_guard()?;
        pending.refresh(self)?;
        unfolded.refresh(self)?;
        let below = self.watermark_seq()?;
        let mut removals = Vec::new();
        let mut orphans = Vec::new();
        let mut repaired = Vec::new();
        for key in candidates {
            let Some((_, _, id)) = keys::parse_activity(key) else {
                tracing::error!(key = ?key, "unreadable retention key; left");
                continue;
            };
            let judged = match kind {
                keys::ACTIVITY_CONVERSATION => self.judge_conversation(id, key)?,
                _ => self.judge_end_user(id, key)?,
            };
            let removal = match judged {
                Judged::Past(removal) => removal,
                Judged::Kept(skipped) => {
                    out.skipped += u64::from(skipped);
                    continue;
                }
                Judged::Orphan => {
                    orphans.push(key.to_vec());
                    continue;
                }
                Judged::Moved(now) => {
                    // Folds wait for the lock held here: a key still there is stale.
                    if self.activity.contains_key(key)? {
                        tracing::warn!(key = ?key, "stale retention key; replaced");
                        orphans.push(key.to_vec());
                        repaired.push(now);
                    }
                    continue;
                }
            };
            let partition = removal.partition.encode();
            let queues = match &removal.partition {
                PartitionKey::Conversation(c) => vec![partition.clone(), format!("helpdesk:{c}")],
                _ => vec![partition.clone()],
            };
            // Its events all folded below the watermark: a start's scan from there meets none
            // of them, so the mark can go (a later event folds as a partition never seen); and
            // none logged since, still to fold (the state is not idle: it stays).
            let folded = self.mark(&partition)?.is_none_or(|m| m < below);
            if pending.any(&queues) || !folded || unfolded.any(&partition) {
                out.skipped += 1;
                continue;
            }
            removals.push(removal);
        }
        let committed = self.commit_prune(&removals, &orphans, &repaired)?;
        for r in &removals {
            match r.tree {
                StateTree::Conversations => out.conversations += 1,
                StateTree::EndUsers => out.end_users += 1,
            }
        }
        out.timers += committed.timers;
        // Still under the fold lock: the counts follow the commits in order.
        self.note_waiting(&committed.waiting);
        Ok(())
    }

    /// Remove the states, every key derived from them, their folded marks and their counts in one
    /// transaction.
    fn commit_prune(
        &self,
        removals: &[Removal],
        orphans: &[Vec<u8>],
        repaired: &[Vec<u8>],
    ) -> Result<Committed, StoreError> {
        use sled::Transactional;
        let queue_removed: Vec<Vec<u8>> = removals
            .iter()
            .flat_map(|r| r.derived.queue.iter().cloned())
            .collect();
        let waiting = super::queue::WaitingChanges::removing(queue_removed);
        let mut timers = 0;
        for r in removals {
            for key in &r.derived.timers {
                // Only folds write the tree, and they wait for the lock held here.
                timers += u64::from(self.timers.contains_key(key)?);
            }
        }
        let conversations = removals
            .iter()
            .filter(|r| r.tree == StateTree::Conversations)
            .count() as u64;
        let end_users = removals.len() as u64 - conversations;
        let trees = (
            &self.conversations,
            &self.end_users,
            &self.user_index,
            &self.folded,
            &self.queue,
            &self.timers,
            &self.activity,
            &self.meta,
        );
        trees.transaction(
            |(conv_tree, user_tree, index, folded, queue, timer_tree, activity, meta)| {
                // The stale keys first: a state found under a stale key and under its own in the
                // same chunk is repaired, then removed (its own key with it).
                for key in orphans {
                    activity.remove(key.as_slice())?;
                }
                for key in repaired {
                    activity.insert(key.as_slice(), &[])?;
                }
                for r in removals {
                    let tree = match r.tree {
                        StateTree::Conversations => conv_tree,
                        StateTree::EndUsers => user_tree,
                    };
                    tree.remove(r.id.as_bytes())?;
                    folded.remove(r.partition.encode().as_bytes())?;
                    for key in &r.derived.queue {
                        queue.remove(key.as_slice())?;
                    }
                    for key in &r.derived.timers {
                        timer_tree.remove(key.as_slice())?;
                    }
                    for key in &r.derived.activity {
                        activity.remove(key.as_slice())?;
                    }
                    if let Some(key) = &r.user_index {
                        index.remove(key.as_slice())?;
                    }
                }
                for (key, gone) in [
                    (keys::meta::COUNT_CONVERSATIONS, conversations),
                    (keys::meta::COUNT_END_USERS, end_users),
                ] {
                    if gone == 0 {
                        continue;
                    }
                    let count = meta
                        .get(key)?
                        .and_then(|b| keys::parse_seq(&b))
                        .unwrap_or(0);
                    meta.insert(key, &keys::seq(count.saturating_sub(gone)))?;
                }
                Ok::<_, sled::transaction::ConflictableTransactionError<String>>(())
            },
        )?;
        Ok(Committed { timers, waiting })
    }

    /// A conversation candidate, read again under the fold lock.
    fn judge_conversation(&self, id: &str, key: &[u8]) -> Result<Judged, StoreError> {
        let Some(bytes) = self.conversations.get(id)? else {
            tracing::warn!(
                conversation_id = id,
                "retention key without a state; removed"
            );
            return Ok(Judged::Orphan);
        };
        let state: ConversationState = decode(&bytes, "conversation state")?;
        let now = conversation_key(&state);
        if now != key {
            return Ok(Judged::Moved(now));
        }
        Ok(Judged::Past(Removal {
            partition: PartitionKey::Conversation(state.id.clone()),
            tree: StateTree::Conversations,
            id: id.to_owned(),
            derived: state_keys(&state),
            user_index: None,
        }))
    }

    /// An end-user candidate, like [`SledStore::judge_conversation`]; kept while the conversation it
    /// last had is (pruning conversations first, a pass usually takes both).
    fn judge_end_user(&self, id: &str, key: &[u8]) -> Result<Judged, StoreError> {
        let Some(bytes) = self.end_users.get(id)? else {
            tracing::warn!(end_user_id = id, "retention key without a state; removed");
            return Ok(Judged::Orphan);
        };
        let user: EndUserState = decode(&bytes, "end-user state")?;
        let now = end_user_key(&user);
        if now != key {
            return Ok(Judged::Moved(now));
        }
        if let Some(conversation) = &user.last_conversation_id.value {
            if self.conversations.contains_key(conversation.as_str())? {
                return Ok(Judged::Kept(true));
            }
        }
        let mut user_index = None;
        if let (Some(platform), Some(user_key)) = (&user.platform, &user.user_key) {
            let index_key = keys::user_index(platform.as_str(), user_key.as_str());
            // Only the entry naming this user: another may have the identity now.
            if self.user_index.get(&index_key)?.as_deref() == Some(id.as_bytes()) {
                user_index = Some(index_key);
            }
        }
        Ok(Judged::Past(Removal {
            partition: PartitionKey::EndUser(user.id.clone()),
            tree: StateTree::EndUsers,
            id: id.to_owned(),
            derived: StateKeys {
                activity: vec![key.to_vec()],
                ..StateKeys::default()
            },
            user_index,
        }))
    }

    /// The sequence number every event still to fold, or folded at or after the watermark, is
    /// at least: the first event at the folds' watermark (or at the next segment's start when
    /// the watermark ends a segment); none there, any number.
    fn watermark_seq(&self) -> Result<u64, StoreError> {
        let at = self.watermark()?;
        let next = super::eventlog::LogPosition {
            segment: at.segment + 1,
            offset: 0,
        };
        for at in [at, next] {
            let record = super::eventlog::read_at(&self.log_dir, at).map_err(super::log_error)?;
            if let Some(seq) = record.and_then(|r| r.seqs.first().copied()) {
                return Ok(seq);
            }
        }
        Ok(u64::MAX)
    }

    /// [`SledStore::prune_quarantine`], adding to `removed` as each chunk goes.
    fn prune_quarantine_into(
        &self,
        before: Millis,
        chunk: usize,
        removed: &mut u64,
    ) -> Result<(), StoreError> {
        let chunk = chunk.max(1);
        let mut after = None;
        loop {
            let (page, next) = self.quarantine_page(after, chunk)?;
            let old: Vec<u64> = page
                .iter()
                .take_while(|m| m.received_at < before)
                .map(|m| m.id)
                .collect();
            let more = old.len() == page.len() && next.is_some();
            // One by one, counting what each removal found: a record re-processed since the
            // page was read is gone already, and the gauge went down with it.
            for id in &old {
                if self.release_quarantined(*id)? {
                    *removed += 1;
                }
            }
            if !more {
                return Ok(());
            }
            after = next;
        }
    }

    /// A store from before the retention index: index its states once, on open (before any
    /// fold). A new store has none and only marks it.
    pub(super) fn index_activity_once(&self) -> Result<(), StoreError> {
        if self.meta.contains_key(keys::meta::ACTIVITY_INDEXED)? {
            return Ok(());
        }
        let mut indexed = 0u64;
        for item in self.conversations.iter() {
            let (_, bytes) = item?;
            let state: ConversationState = decode(&bytes, "conversation state")?;
            self.activity.insert(conversation_key(&state), Vec::new())?;
            indexed += 1;
        }
        for item in self.end_users.iter() {
            let (_, bytes) = item?;
            let user: EndUserState = decode(&bytes, "end-user state")?;
            self.activity.insert(end_user_key(&user), Vec::new())?;
            indexed += 1;
        }
        self.meta.insert(keys::meta::ACTIVITY_INDEXED, &[1])?;
        if indexed > 0 {
            tracing::info!(indexed, "retention index built from the states");
        }
        Ok(())
    }
}

impl Retention for SledStore {
    /// [`prune`](SledStore::prune) with the folds' watermark read before a sled flush that has
    /// completed since: segments go only below a watermark whose folds (state and marks) are on
    /// disk, so a crash cannot bring back an older watermark that points into a deleted
    /// segment's unfolded events. Then the index by partition forgets the segments gone (see
    /// `history`).
    fn prune_events(
        &self,
        dedupe_before: Millis,
        events_before: Millis,
        fold_from: Cursor,
    ) -> Result<Pruned, StoreError> {
        let fold_from = eventlog::LogPosition::from(fold_from);
        let mut out = Pruned::default();
        let pruned_to = self.forget_old_ids(dedupe_before, &mut out)?;
        for segment in self.old_segments(dedupe_before, events_before, fold_from, pruned_to)? {
            eventlog::remove_segment(&self.log_dir, segment).map_err(log_error)?;
            dedupe::remove_ids(&self.log_dir, segment);
            out.event_chunks += 1;
        }
        self.unindex_removed_segments()?;
        // What an early start reads instead of sled (see `log`): where the dedupe index starts
        // now, and a floor above every number given out, since the segments that held the
        // highest ones may be gone. Without it (a full disk), the next start opens sled first;
        // the pass itself did its work.
        if let Err(e) = self.write_intake_state() {
            tracing::warn!(error = %e, "cannot keep the event log's state file; the next start opens the store before taking deliveries");
            if let Err(e) = log::IntakeState::remove(&self.log_dir) {
                tracing::error!(error = %e, "cannot remove the event log's stale state file");
            }
        }
        Ok(out)
    }

    /// Prune the conversation states, then the end-user states, whose newest activity is before
    /// `before`, `chunk` candidates at a time (each chunk read from the index, then judged and
    /// removed under the fold lock in one transaction); what the chunks before a failure removed
    /// is counted.
    fn prune_states(&self, before: Millis, chunk: usize) -> Removed<StatesPruned> {
        let mut removed = StatesPruned::default();
        let failed = self.prune_states_into(before, chunk, &mut removed).err();
        Removed { removed, failed }
    }

    /// Remove the quarantine records received before `before`, in id (arrival) order, read
    /// `chunk` at a time, up to the first one still within retention; counts what it removed
    /// (not one a re-process took meanwhile).
    fn prune_quarantine(&self, before: Millis, chunk: usize) -> Removed<u64> {
        let mut removed = 0;
        let failed = self
            .prune_quarantine_into(before, chunk, &mut removed)
            .err();
        Removed { removed, failed }
    }

    /// Forget finished actions (done or dropped) recorded before `before`, at most `limit` of
    /// them: their ledger entries and their records. Both are scanned (the ledger is keyed by
    /// action id, and records finish out of seq order when a dead letter is retried late).
    /// Returns (ledger entries, records) removed.
    fn prune_ledger(&self, before: Millis, limit: usize) -> Result<(u64, u64), StoreError> {
        let mut pruned = 0;
        for item in self.actions.iter() {
            if pruned as usize >= limit {
                break;
            }
            let (key, value) = item?;
            let status: ActionStatus = decode(&value, "action status")?;
            let finished = status.state == "done" || status.state == "dropped";
            if finished && status.at < before {
                self.actions.remove(&key)?;
                pruned += 1;
            }
        }
        let mut records = 0;
        for item in self.done.iter() {
            if records >= limit {
                break;
            }
            let (key, value) = item?;
            let record: DoneRecord = decode(&value, "finished entry")?;
            if record.at < before {
                self.done.remove(&key)?;
                records += 1;
            }
        }
        Ok((pruned, records as u64))
    }

    /// Drop records answered before `before`, at most `limit`; returns how many went.
    fn prune_idempotency(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        let tree = self.idempotency_tree()?;
        let mut removed = 0;
        for item in tree.iter() {
            if removed >= limit as u64 {
                break;
            }
            let (k, v) = item?;
            let old = decode::<IdempotencyRecord>(&v, "idempotency record")
                .map_or(true, |r| r.at < before);
            if old {
                tree.remove(k)?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Drop at most `limit` of the oldest actions taken before `before`; how many went. An
    /// unreadable record goes too.
    fn prune_operator_actions(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        let tree = self.operators_tree()?;
        let mut removed = 0;
        for item in tree.iter().take(limit) {
            let (k, v) = item?;
            let old =
                decode::<OperatorAction>(&v, "operator action").map_or(true, |a| a.at < before);
            if !old {
                break;
            }
            tree.remove(k)?;
            removed += 1;
        }
        Ok(removed)
    }

    /// Remove the handoff figures' hour records (`keys::queue_stats`) of the hours before the
    /// one `before` is in, oldest first, at most `limit` (a pass normally finds the hour or so
    /// that aged since the last). Under the fold lock: a fold reads an hour's record and writes
    /// it back whole, so a removal beside it could be undone. Returns how many it removed.
    fn prune_handoff_stats(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        let _folding = self.fold_guard()?;
        let from = [keys::QUEUE_STATS].to_vec();
        let to = keys::queue_stats(engine::state::stats::hour_of(before)).to_vec();
        let old = self
            .queue
            .range(from..to)
            .keys()
            .take(limit)
            .collect::<Result<Vec<_>, _>>()?;
        for key in &old {
            self.queue.remove(key)?;
        }
        Ok(old.len() as u64)
    }

    /// When the oldest stored event was received (the event log is in acceptance order).
    fn oldest_event_received_at(&self) -> Result<Option<Millis>, StoreError> {
        let mut oldest = None;
        eventlog::scan(
            &self.log_dir,
            eventlog::LogPosition::default(),
            |_, record, _| {
                oldest = Some(record.received_at);
                ControlFlow::Break(())
            },
        )
        .map_err(log_error)?;
        Ok(oldest)
    }
}

impl SledStore {
    /// Forget the dedupe ids of the sealed segments whose events are all older than
    /// `dedupe_before`; where the dedupe index starts now.
    fn forget_old_ids(
        &self,
        dedupe_before: Millis,
        out: &mut Pruned,
    ) -> Result<eventlog::LogPosition, StoreError> {
        let start = self.meta_location(keys::meta::DEDUPE_PRUNED_TO)?;
        let sealed = self
            .log
            .dedupe
            .lock()
            .map_err(|_| poisoned_dedupe())?
            .sealed_segments();
        let mut pruned_to = None;
        for (segment, _) in sealed {
            let first_of_next = eventlog::LogPosition {
                segment: segment + 1,
                offset: 0,
            };
            // Sealed means indexed: the log had moved on to the next segment.
            let newer = eventlog::read_at(&self.log_dir, first_of_next).map_err(log_error)?;
            match newer {
                Some(r) if r.received_at < dedupe_before => {}
                _ => break,
            }
            let forgotten = self
                .log
                .dedupe
                .lock()
                .map_err(|_| poisoned_dedupe())?
                .forget(segment);
            out.ids_forgotten += forgotten as u64;
            pruned_to = Some(first_of_next);
        }
        if let Some(to) = pruned_to {
            self.meta
                .insert(keys::meta::DEDUPE_PRUNED_TO, &to.encode())?;
        }
        out.ids_forgotten += self.prune_legacy(dedupe_before)?;
        Ok(pruned_to.unwrap_or(start))
    }

    /// The oldest segments that may go, in order: each all folded (below the watermark),
    /// indexed, past the dedupe index's start (`pruned_to`), and older than the first event of
    /// the next, which is older than both `events_before` and `dedupe_before`.
    fn old_segments(
        &self,
        dedupe_before: Millis,
        events_before: Millis,
        fold_from: eventlog::LogPosition,
        pruned_to: eventlog::LogPosition,
    ) -> Result<Vec<u64>, StoreError> {
        let indexed_to = self.meta_location(keys::meta::INDEXED_TO)?;
        let segments = eventlog::segments(&self.log_dir).map_err(log_error)?;
        let mut old = Vec::new();
        for pair in segments.windows(2) {
            let (segment, next) = (pair[0], pair[1]);
            let path = eventlog::segment_path(&self.log_dir, segment);
            let len = std::fs::metadata(&path).map_err(log_error)?.len();
            let end = eventlog::LogPosition {
                segment,
                offset: len,
            };
            let folded = fold_from.segment > segment;
            if !folded || pruned_to < end || indexed_to < end {
                break;
            }
            // Everything in `segment` is older than the first event of the next one.
            let start_of_next = eventlog::LogPosition {
                segment: next,
                offset: 0,
            };
            let newer = eventlog::read_at(&self.log_dir, start_of_next).map_err(log_error)?;
            match newer {
                Some(r) if r.received_at < events_before && r.received_at < dedupe_before => {}
                _ => break,
            }
            old.push(segment);
        }
        Ok(old)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::port::Folds;
    use crate::port::*;
    use crate::{Position, QuarantineRecord};
    use engine::index::{conversation_activity, end_user_activity};
    use model::ids::DeliveryId;
    use model::webhook::IncomingEvent;

    const DAY: Millis = 86_400_000;

    fn event(
        id: &str,
        kind: &str,
        conversation: &str,
        user: Option<&str>,
        at: Millis,
    ) -> IncomingEvent {
        let mut c = serde_json::json!({ "id": conversation, "botId": "B1", "platform": "web" });
        if let Some(user) = user {
            c["endUserId"] = user.into();
            c["userKey"] = format!("key-{user}").into();
        }
        let raw = serde_json::json!({
            "id": id, "event": kind, "sourceType": "bot", "sourceId": "B1", "timestamp": at,
            "data": { "conversation": c },
        });
        let raw = serde_json::value::RawValue::from_string(raw.to_string()).expect("raw");
        model::webhook::validate_event(&raw).expect("event")
    }

    fn message(id: &str, conversation: &str, at: Millis) -> IncomingEvent {
        let raw = serde_json::json!({
            "id": id, "event": "bot.message.received", "sourceType": "bot", "sourceId": "B1",
            "timestamp": at,
            "data": { "message": { "id": format!("m-{id}"), "conversationId": conversation,
                "isUser": true, "meta": null, "data": { "type": "text", "text": "hi" } } },
        });
        let raw = serde_json::value::RawValue::from_string(raw.to_string()).expect("raw");
        model::webhook::validate_event(&raw).expect("event")
    }

    /// A request starts a 5-minute timer; a message is answered (an outbox entry).
    fn rules() -> engine::rules::RuleSet {
        let text = "[[rule]]\nname = \"wait\"\non = [\"bot.conversation.agent_call_requested\"]\n\
             actions = [{ type = \"start_timer\", name = \"t\", after = \"5m\" }]\n\
             [[rule]]\nname = \"answer\"\non = [\"bot.message.received\"]\n\
             actions = [{ type = \"send_message\", text = \"hello\" }]\n";
        engine::rules::RuleSet::from_sources(&[("r.toml".into(), text.to_owned())]).expect("rules")
    }

    /// Accept and fold `events` as one batch, without moving the folds' watermark (like a job
    /// while an older event is still in another).
    fn fold_only(
        store: &SledStore,
        delivery: &str,
        events: Vec<IncomingEvent>,
    ) -> super::super::Applied {
        // Received now, as the tests' pruning clock reads it: timers count from the receive time.
        let now = model::clock::system_millis();
        let batch = super::super::queue::tests::accepted_batch_at(store, delivery, &events, now);
        let received = vec![now; batch.len()];
        store
            .apply_with(&batch, &rules(), &received)
            .expect("apply")
    }

    /// Move the folds' watermark to the log's end (nothing left to fold), as the dispatcher does.
    fn settle(store: &SledStore) {
        let pending = store.pending().expect("pending");
        assert!(pending.is_empty(), "everything folded");
        let position = Position {
            fold_from: Some(pending.end),
            ..Default::default()
        };
        store
            .fold(&[], &[], &engine::decide::NoRules, &[], &position)
            .expect("settle");
    }

    fn fold(
        store: &SledStore,
        delivery: &str,
        events: Vec<IncomingEvent>,
    ) -> super::super::Applied {
        let applied = fold_only(store, delivery, events);
        settle(store);
        applied
    }

    fn keys_of(tree: &sled::Tree) -> Vec<Vec<u8>> {
        tree.iter()
            .keys()
            .map(|k| k.expect("key").to_vec())
            .collect()
    }

    fn open() -> (tempfile::TempDir, SledStore) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(dir.path(), 8 << 20).expect("open");
        (dir, store)
    }

    #[test]
    fn an_idle_conversation_and_its_end_user_go_with_every_derived_key() {
        let (_d, store) = open();
        let now = model::clock::system_millis();
        let requested = "bot.conversation.agent_call_requested";
        fold(
            &store,
            "d1",
            vec![
                event("e1", requested, "c1", Some("U1"), 1_000),
                event("e2", "bot.conversation.updated", "c2", None, now + 10 * DAY),
            ],
        );
        // Everything derived from c1 is there: waiting entry, sweeper key, timer, marks.
        assert_eq!(store.queue_summary().expect("queue summary").waiting, 1);
        assert_eq!(store.watched(0, 10).expect("watched").active, ["c1"]);
        assert_eq!(store.timers_pending().expect("timers"), 1);
        assert_eq!(keys_of(&store.activity).len(), 3, "c1, c2, U1");
        assert!(store.mark("c:c1").expect("mark").is_some());
        assert!(store
            .find_end_user("web", "key-U1")
            .expect("find")
            .is_some());
        assert_eq!(
            (
                store.sizes().expect("sizes").conversations,
                store.sizes().expect("sizes").end_users
            ),
            (2, 1)
        );

        // c1 is not yet past retention (its timer runs until now + 5m); U1 is, but stays while
        // the conversation it last had is kept.
        let early = store.prune_states(now, CHUNK).into_result().expect("prune");
        assert_eq!(
            early,
            StatesPruned {
                skipped: 1,
                chunks: 1,
                ..StatesPruned::default()
            }
        );
        assert!(store.end_user(&"U1".into()).expect("read").is_some());

        let pruned = store
            .prune_states(now + DAY, CHUNK)
            .into_result()
            .expect("prune");
        assert_eq!(
            pruned,
            StatesPruned {
                conversations: 1,
                end_users: 1,
                timers: 1,
                skipped: 0,
                chunks: 2,
            }
        );
        assert_eq!(store.conversation(&"c1".into()).expect("read"), None);
        assert_eq!(store.end_user(&"U1".into()).expect("read"), None);
        assert!(store.conversation(&"c2".into()).expect("read").is_some());
        // No key of c1 or U1 is left anywhere.
        let waiting: Vec<_> = store.queue.scan_prefix([keys::QUEUE_WAITING]).collect();
        assert!(waiting.is_empty());
        assert_eq!(store.watched(0, 10).expect("watched"), Default::default());
        assert!(keys_of(&store.timers).is_empty());
        assert_eq!(store.timers_pending().expect("timers"), 0);
        let c2 = store.conversation(&"c2".into()).expect("read").expect("c2");
        assert_eq!(keys_of(&store.activity), [conversation_key(&c2)]);
        assert_eq!(store.mark("c:c1").expect("mark"), None);
        assert!(
            store.mark("c:c2").expect("mark").is_some(),
            "c2's mark stays"
        );
        assert!(keys_of(&store.user_index).is_empty());
        assert_eq!(
            (
                store.sizes().expect("sizes").conversations,
                store.sizes().expect("sizes").end_users
            ),
            (1, 0)
        );
        assert_eq!(store.queue_summary().expect("queue summary").waiting, 0);
        assert_eq!(
            store.queue_summary_scanned().expect("scan").summary(),
            store.queue_summary().expect("queue summary")
        );
        // A second pass finds nothing.
        let again = store
            .prune_states(now + DAY, CHUNK)
            .into_result()
            .expect("prune");
        assert_eq!((again.conversations, again.end_users), (0, 0));
    }

    #[test]
    fn a_pending_outbox_entry_or_unfolded_events_keep_a_state_for_a_later_pass() {
        let (_d, store) = open();
        let applied = fold(&store, "d1", vec![message("e1", "c1", 1_000)]);
        assert_eq!(applied.outbox.len(), 1);
        let cutoff = 10 * DAY;
        let pruned = store
            .prune_states(cutoff, CHUNK)
            .into_result()
            .expect("prune");
        assert_eq!(
            (pruned.conversations, pruned.skipped),
            (0, 1),
            "its answer is pending"
        );
        assert!(store.conversation(&"c1".into()).expect("read").is_some());
        store
            .outbox_done(&applied.outbox[0], 1, 2_000)
            .expect("done");
        let pruned = store
            .prune_states(cutoff, CHUNK)
            .into_result()
            .expect("prune");
        assert_eq!(
            (pruned.conversations, pruned.skipped),
            (1, 0),
            "once it ran"
        );

        // c2 folded above the folds' watermark (another job still holds an older event): its
        // mark is not below it, so it waits; once the watermark passes it, it goes.
        let at = store.pending().expect("pending").end;
        store
            .fold(
                &[],
                &[],
                &engine::decide::NoRules,
                &[],
                &Position {
                    fold_from: Some(at),
                    ..Default::default()
                },
            )
            .expect("watermark");
        fold_only(
            &store,
            "d2",
            vec![event("e2", "bot.conversation.updated", "c2", None, 1_000)],
        );
        let pruned = store
            .prune_states(cutoff, CHUNK)
            .into_result()
            .expect("prune");
        assert_eq!((pruned.conversations, pruned.skipped), (0, 1));
        settle(&store);
        let pruned = store
            .prune_states(cutoff, CHUNK)
            .into_result()
            .expect("prune");
        assert_eq!((pruned.conversations, pruned.skipped), (1, 0));
        assert_eq!(store.sizes().expect("sizes").conversations, 0);
    }

    #[test]
    fn an_event_logged_but_not_yet_folded_keeps_its_state() {
        let (_d, store) = open();
        let updated = "bot.conversation.updated";
        fold(
            &store,
            "d1",
            vec![event("e1", updated, "c1", Some("U1"), 1_000)],
        );
        // c1's newer event is in the log (acknowledged), still queued for the dispatcher: the
        // folds' watermark is at it, c1's mark below it.
        let batch = super::super::queue::tests::accepted_batch(
            &store,
            "d2",
            &[event("e2", updated, "c1", Some("U1"), 20 * DAY)],
        );
        assert_eq!(batch.len(), 1);
        let pruned = store
            .prune_states(10 * DAY, CHUNK)
            .into_result()
            .expect("prune");
        assert_eq!(
            (pruned.conversations, pruned.end_users, pruned.skipped),
            (0, 0, 2),
            "c1 has an event to fold, and U1's conversation is kept"
        );
        // Folded, it lands on the state it belongs to, not on a fresh one.
        let applied = store.apply_with(&batch, &rules(), &[10]).expect("apply");
        assert_eq!(applied.new_conversations, 0);
        let c1 = store.conversation(&"c1".into()).expect("read").expect("c1");
        assert_eq!(c1.events_applied, 2);
        settle(&store);
        let pruned = store
            .prune_states(10 * DAY, CHUNK)
            .into_result()
            .expect("prune");
        assert_eq!((pruned.conversations, pruned.skipped), (0, 0), "active now");
    }

    #[test]
    fn an_end_user_named_by_an_event_still_to_fold_is_kept() {
        let (_d, store) = open();
        let updated = "bot.conversation.updated";
        fold(
            &store,
            "d1",
            vec![event("e1", updated, "c1", Some("U1"), 1_000)],
        );
        // U1 comes back in a new conversation: logged, still to fold.
        let batch = super::super::queue::tests::accepted_batch(
            &store,
            "d2",
            &[event("e2", updated, "c9", Some("U1"), 20 * DAY)],
        );
        let pruned = store
            .prune_states(10 * DAY, CHUNK)
            .into_result()
            .expect("prune");
        assert_eq!(
            (pruned.conversations, pruned.end_users, pruned.skipped),
            (1, 0, 1),
            "c1 goes; U1, named by c9's event, stays"
        );
        let applied = store.apply_with(&batch, &rules(), &[10]).expect("apply");
        assert_eq!(applied.new_end_users, 0, "U1's state, not a fresh one");
        let u1 = store.end_user(&"U1".into()).expect("read").expect("U1");
        assert_eq!(u1.last_conversation_id.value, Some("c9".into()));
    }

    #[test]
    fn the_partitions_still_to_fold_are_read_from_the_watermark_then_as_appended() {
        let (_d, store) = open();
        let updated = "bot.conversation.updated";
        fold(&store, "d1", vec![event("e1", updated, "c1", None, 1_000)]);
        let accept = |delivery: &str, events: Vec<IncomingEvent>| {
            let accepted = store
                .accept(&DeliveryId::new(delivery), &events, 10)
                .expect("accept");
            assert_eq!(accepted.new.len(), events.len());
        };
        accept(
            "d2",
            vec![
                event("e2", updated, "c2", None, 1_000),
                event("e3", updated, "c3", None, 1_000),
            ],
        );
        let mut unfolded = Unfolded::default();
        unfolded.refresh(&store).expect("scan");
        let holds = |u: &Unfolded| ["c:c1", "c:c2", "c:c3", "c:c4"].map(|p| u.any(p));
        assert_eq!(holds(&unfolded), [false, true, true, false]);
        accept("d3", vec![event("e4", updated, "c4", None, 1_000)]);
        unfolded.refresh(&store).expect("scan");
        assert_eq!(holds(&unfolded), [false, true, true, true]);
        assert_eq!(unfolded.events, 3, "each event read once");
        // More events than it may read: it holds every partition.
        let mut bounded = Unfolded {
            max: 2,
            ..Unfolded::default()
        };
        bounded.refresh(&store).expect("scan");
        assert_eq!(holds(&bounded), [true; 4]);
    }

    #[test]
    fn an_event_folded_after_pruning_starts_a_fresh_state_and_old_timers_are_stale() {
        let (_d, store) = open();
        let requested = "bot.conversation.agent_call_requested";
        fold(
            &store,
            "d1",
            vec![event("e1", requested, "c1", None, 1_000)],
        );
        let old = store.conversation(&"c1".into()).expect("read").expect("c1");
        let timer = old.timers.get("t").expect("timer").clone();
        let far = model::clock::system_millis() + DAY;
        assert_eq!(
            store
                .prune_states(far, CHUNK)
                .into_result()
                .expect("prune")
                .conversations,
            1
        );

        // The old timer's firing (handed to the writer before the pass) and a new event.
        let firing = model::webhook::model::TimerFiring {
            conversation_id: "c1".into(),
            name: "t".into(),
            due_at: timer.due_at,
            started_by: timer.started_by.clone(),
        };
        let fired = model::webhook::timer_event(&firing, "B1").expect("timer event");
        let applied = fold(
            &store,
            "d2",
            vec![
                fired,
                event("e3", "bot.conversation.updated", "c1", None, 5_000),
            ],
        );
        assert_eq!(applied.new_conversations, 1, "a fresh state");
        assert!(
            applied.outbox.is_empty(),
            "the stale firing reached no rule"
        );
        let fresh = store.conversation(&"c1".into()).expect("read").expect("c1");
        assert_eq!(fresh.events_applied, 2);
        assert!(fresh.timers.is_empty(), "no timer from before");
        assert_eq!(fresh.handoff.requested_at, None, "nothing from before");
        assert!(keys_of(&store.timers).is_empty());
        assert_eq!(keys_of(&store.activity), [conversation_key(&fresh)]);
        assert_eq!(store.sizes().expect("sizes").conversations, 1);
        // A duplicate of the old event is still caught by intake's dedupe (the event log's ids).
        let again = store
            .accept(
                &DeliveryId::new("d3"),
                &[event("e1", requested, "c1", None, 1_000)],
                20,
            )
            .expect("accept");
        assert!(again.new.is_empty(), "a duplicate");
    }

    #[test]
    fn a_pass_reads_a_long_range_in_chunks() {
        let (_d, store) = open();
        let events = (0..25)
            .map(|i| {
                event(
                    &format!("e{i}"),
                    "bot.conversation.updated",
                    &format!("c{i:02}"),
                    None,
                    1_000 + i,
                )
            })
            .collect();
        fold(&store, "d1", events);
        fold(
            &store,
            "d2",
            vec![event(
                "late",
                "bot.conversation.updated",
                "new",
                None,
                5 * DAY,
            )],
        );
        let pruned = store.prune_states(DAY, 4).into_result().expect("prune");
        assert_eq!(pruned.conversations, 25);
        assert_eq!(pruned.chunks, 7, "25 in chunks of 4");
        assert_eq!(store.sizes().expect("sizes").conversations, 1);
        assert_eq!(
            keys_of(&store.activity).len(),
            1,
            "only the one within retention"
        );
    }

    #[test]
    fn a_pass_that_fails_part_way_reports_what_the_chunks_before_removed() {
        let (_d, store) = open();
        let events = (0..5)
            .map(|i| {
                let id = format!("c{i}");
                event(
                    &format!("e{i}"),
                    "bot.conversation.updated",
                    &id,
                    None,
                    1_000 + i,
                )
            })
            .collect();
        fold(&store, "d1", events);
        // c3's record cannot be read: the second chunk (c2, c3) fails.
        store.conversations.insert("c3", &b"{"[..]).expect("insert");
        let mut out = StatesPruned::default();
        store
            .prune_states_into(DAY, 2, &mut out)
            .expect_err("c3 is unreadable");
        assert_eq!((out.conversations, out.chunks), (2, 1), "c0 and c1 went");
        assert_eq!(store.sizes().expect("sizes").conversations, 3);
        assert!(store.conversation(&"c2".into()).expect("read").is_some());
    }

    #[test]
    fn the_fold_keeps_one_key_per_state_equal_to_its_activity() {
        let (_d, store) = open();
        let updated = "bot.conversation.updated";
        fold(
            &store,
            "d1",
            vec![
                event("e1", updated, "c1", Some("U1"), 1_000),
                event("e2", updated, "c2", None, 2_000),
                // An older event later in the batch moves nothing.
                event("e3", updated, "c1", Some("U1"), 500),
            ],
        );
        // Newer events in a later fold move c1's and U1's keys; c2's stays.
        fold(
            &store,
            "d2",
            vec![
                event("e4", updated, "c1", Some("U1"), 9_000),
                message("e5", "c2", 1_500),
            ],
        );
        let c1 = store.conversation(&"c1".into()).expect("read").expect("c1");
        let c2 = store.conversation(&"c2".into()).expect("read").expect("c2");
        let u1 = store.end_user(&"U1".into()).expect("read").expect("U1");
        assert_eq!(
            (conversation_activity(&c1), conversation_activity(&c2)),
            (9_000, 2_000)
        );
        assert_eq!(end_user_activity(&u1), 9_000);
        let mut expected = vec![
            conversation_key(&c1),
            conversation_key(&c2),
            end_user_key(&u1),
        ];
        expected.sort();
        assert_eq!(keys_of(&store.activity), expected);
    }

    #[test]
    fn a_stale_index_key_is_replaced_by_the_states_own() {
        let (_d, store) = open();
        fold(
            &store,
            "d1",
            vec![event("e1", "bot.conversation.updated", "c1", None, 5 * DAY)],
        );
        let state = store.conversation(&"c1".into()).expect("read").expect("c1");
        // As if an older build had folded c1's newer event without keeping the index.
        let stale = keys::activity(keys::ACTIVITY_CONVERSATION, 1_000, "c1");
        store.activity.clear().expect("clear");
        store.activity.insert(&stale, Vec::new()).expect("insert");
        let pruned = store.prune_states(DAY, CHUNK).into_result().expect("prune");
        assert_eq!(
            pruned.conversations, 0,
            "c1 is within retention by its state"
        );
        assert_eq!(keys_of(&store.activity), [conversation_key(&state)]);
        assert!(store.conversation(&"c1".into()).expect("read").is_some());
    }

    #[test]
    fn a_state_under_a_stale_key_and_its_own_goes_with_both() {
        let (_d, store) = open();
        fold(
            &store,
            "d1",
            vec![event("e1", "bot.conversation.updated", "c1", None, 5_000)],
        );
        // A stale key older than the state's own (an older build folded meanwhile): both are
        // past retention, in one chunk.
        let stale = keys::activity(keys::ACTIVITY_CONVERSATION, 1_000, "c1");
        store.activity.insert(&stale, Vec::new()).expect("insert");
        let pruned = store.prune_states(DAY, CHUNK).into_result().expect("prune");
        assert_eq!((pruned.conversations, pruned.chunks), (1, 1));
        assert_eq!(store.conversation(&"c1".into()).expect("read"), None);
        assert!(keys_of(&store.activity).is_empty(), "no key left behind");
    }

    #[test]
    fn quarantine_records_past_retention_go_oldest_first() {
        let (_d, store) = open();
        let ids: Vec<u64> = (1..=5)
            .map(|i| {
                let record = QuarantineRecord::new("delivery", "invalid_json", "x", b"{", i * 100);
                store.quarantine(record).expect("quarantine")
            })
            .collect();
        assert_eq!(
            store.prune_quarantine(350, 2).into_result().expect("prune"),
            3
        );
        let left: Vec<u64> = store
            .quarantined()
            .expect("list")
            .iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(left, ids[3..]);
        assert_eq!(
            store.prune_quarantine(350, 2).into_result().expect("prune"),
            0
        );
    }

    #[test]
    fn a_store_from_before_the_index_builds_it_on_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let expected = {
            let store = SledStore::open(dir.path(), 8 << 20).expect("open");
            fold(
                &store,
                "d1",
                vec![
                    event("e1", "bot.conversation.updated", "c1", Some("U1"), 1_000),
                    event("e2", "bot.conversation.updated", "c2", None, 2_000),
                ],
            );
            let expected = keys_of(&store.activity);
            assert_eq!(expected.len(), 3);
            store.activity.clear().expect("clear");
            store
                .meta
                .remove(keys::meta::ACTIVITY_INDEXED)
                .expect("unmark");
            store.db.flush().expect("flush");
            expected
        };
        let store = SledStore::open(dir.path(), 8 << 20).expect("reopen");
        assert_eq!(keys_of(&store.activity), expected);
    }
}
