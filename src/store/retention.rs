//! Retention of conversation and end-user states (`store.state_retention`) and of quarantine
//! records (`store.quarantine_retention`).
//!
//! The retention index (`activity/v1`) holds every conversation and end user by its newest
//! activity time ([`conversation_activity`], [`end_user_activity`]), oldest first. Like the
//! waiting queue and the sweeper's index, only folds write it, in their transaction, as the
//! difference between a state's key before and after the fold; so a pruning pass reads the
//! states past retention as a range, in chunks, without reading every state. A store from before
//! the index is indexed once, on open.
//!
//! A state goes under the fold lock, re-read first (skipped if it changed since the range was
//! read), only when its partition's events are all folded below the folds' watermark and no
//! outbox entry of it is pending; then ONE transaction removes the state and every key derived
//! from it ([`derived_keys`]: the waiting entry, the sweeper's key, the timers, the retention
//! key), its folded mark and its count. A later event of a pruned conversation folds into a fresh
//! state, as for one never seen (see ARCHITECTURE.md, "Retention").

use super::{decode, keys, ConversationState, EndUserState, Store, StoreError};
use crate::ids::PartitionKey;
use crate::webhook::model::Millis;
use serde::Serialize;
use std::collections::{HashMap, HashSet};

/// States examined per transaction (and per hold of the fold lock).
pub const CHUNK: usize = 1_000;

/// When a conversation was last active: its newest event (a deletion is one), or a running
/// timer's due time if later (a conversation waiting on a timer is not idle).
pub fn conversation_activity(s: &ConversationState) -> Millis {
    let timers = s.timers.values().map(|t| t.due_at);
    timers
        .chain(s.deleted_at)
        .fold(s.last_event_at, Millis::max)
}

/// When an end user was last active: their newest own event, or the newest conversation event
/// that named them.
pub fn end_user_activity(u: &EndUserState) -> Millis {
    u.deleted_at.into_iter().fold(
        u.last_event_at.max(u.last_conversation_id.stamp.at),
        Millis::max,
    )
}

pub(super) fn conversation_key(s: &ConversationState) -> Vec<u8> {
    keys::activity(
        keys::ACTIVITY_CONVERSATION,
        conversation_activity(s),
        s.id.as_str(),
    )
}

pub(super) fn end_user_key(u: &EndUserState) -> Vec<u8> {
    keys::activity(keys::ACTIVITY_END_USER, end_user_activity(u), u.id.as_str())
}

/// Every key kept outside the `conversations` tree that is derived from a conversation's state:
/// what pruning the state removes with it. An index kept by the fold joins this list.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct DerivedKeys {
    /// In `queue/v1`: the waiting entry (`store::queue`), the sweeper's key (`store::watch`).
    pub queue: Vec<Vec<u8>>,
    /// In `timers/v1`: the running timers.
    pub timers: Vec<Vec<u8>>,
    /// In `activity/v1`: the retention key.
    pub activity: Vec<Vec<u8>>,
}

pub(super) fn derived_keys(s: &ConversationState) -> DerivedKeys {
    let id = s.id.as_str();
    DerivedKeys {
        queue: super::queue::entry_of(s)
            .into_iter()
            .chain(super::watch::watch_key(s))
            .collect(),
        timers: s
            .timers
            .iter()
            .map(|(name, t)| keys::timer(t.due_at, id, name))
            .collect(),
        activity: vec![conversation_key(s)],
    }
}

/// What a fold writes to the retention index.
#[derive(Debug, Default)]
pub(super) struct ActivityWrites {
    pub remove: Vec<Vec<u8>>,
    pub insert: Vec<Vec<u8>>,
}

impl ActivityWrites {
    /// The index's changes: each folded state's key as the fold found it (`before`, by id; `None`
    /// for a state the fold created) against its key now.
    pub fn of<T>(
        &mut self,
        before: &HashMap<String, Option<Vec<u8>>>,
        states: &HashMap<String, T>,
        key: impl Fn(&T) -> Vec<u8>,
    ) {
        for (id, state) in states {
            let old = before.get(id).cloned().flatten();
            let now = key(state);
            if old.as_ref() == Some(&now) {
                continue;
            }
            self.remove.extend(old);
            self.insert.push(now);
        }
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
    /// events not all folded below the watermark, or (end users) their last conversation kept.
    pub skipped: u64,
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
    fn refresh(&mut self, store: &Store) -> Result<(), StoreError> {
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

/// What judging one candidate found.
enum Judged {
    /// Past retention: its removals (subject to the pending and folded checks).
    Past(Removal),
    /// Its key moved (active again since the range was read), or it is kept for now (`true`:
    /// count it as skipped).
    Kept(bool),
    /// An index key without a state: the key alone goes.
    Orphan,
}

/// A state's removals.
struct Removal {
    partition: PartitionKey,
    tree: StateTree,
    id: String,
    derived: DerivedKeys,
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

impl Store {
    /// Prune the conversation states, then the end-user states, whose newest activity is before
    /// `before`, `chunk` candidates at a time (each chunk read from the index, then judged and
    /// removed under the fold lock in one transaction).
    pub fn prune_states(&self, before: Millis, chunk: usize) -> Result<StatesPruned, StoreError> {
        let chunk = chunk.max(1);
        let mut out = StatesPruned::default();
        let mut pending = PendingQueues::default();
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
                self.prune_chunk(kind, &candidates, &mut pending, &mut out)?;
                if candidates.len() < chunk {
                    break;
                }
            }
        }
        Ok(out)
    }

    fn prune_chunk(
        &self,
        kind: u8,
        candidates: &[sled::IVec],
        pending: &mut PendingQueues,
        out: &mut StatesPruned,
    ) -> Result<(), StoreError> {
        let _folding = self
            .fold_lock
            .lock()
            .map_err(|_| StoreError::Corrupt("a fold panicked".into()))?;
        pending.refresh(self)?;
        let below = self.watermark_seq()?;
        let mut removals = Vec::new();
        let mut orphans = Vec::new();
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
            };
            let partition = removal.partition.encode();
            let queues = match &removal.partition {
                PartitionKey::Conversation(c) => vec![partition.clone(), format!("helpdesk:{c}")],
                _ => vec![partition.clone()],
            };
            // Its events all folded below the watermark: a start's scan from there meets none
            // of them, so the mark can go (a later event folds as a partition never seen).
            let folded = self.mark(&partition)?.map_or(true, |m| m < below);
            if pending.any(&queues) || !folded {
                out.skipped += 1;
                continue;
            }
            removals.push(removal);
        }
        let committed = self.commit_prune(&removals, &orphans)?;
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
    ) -> Result<Committed, StoreError> {
        use sled::Transactional;
        let queue_removed: Vec<Vec<u8>> = removals
            .iter()
            .flat_map(|r| r.derived.queue.iter().cloned())
            .collect();
        let waiting = super::queue::QueueWrites {
            remove: queue_removed,
            insert: Vec::new(),
        }
        .waiting_changes();
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
                for key in orphans {
                    activity.remove(key.as_slice())?;
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
        if conversation_key(&state) != key {
            return Ok(Judged::Kept(false));
        }
        Ok(Judged::Past(Removal {
            partition: PartitionKey::Conversation(state.id.clone()),
            tree: StateTree::Conversations,
            id: id.to_owned(),
            derived: derived_keys(&state),
            user_index: None,
        }))
    }

    /// An end-user candidate, like [`Store::judge_conversation`]; kept while the conversation it
    /// last had is (pruning conversations first, a pass usually takes both).
    fn judge_end_user(&self, id: &str, key: &[u8]) -> Result<Judged, StoreError> {
        let Some(bytes) = self.end_users.get(id)? else {
            tracing::warn!(end_user_id = id, "retention key without a state; removed");
            return Ok(Judged::Orphan);
        };
        let user: EndUserState = decode(&bytes, "end-user state")?;
        if end_user_key(&user) != key {
            return Ok(Judged::Kept(false));
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
            derived: DerivedKeys {
                activity: vec![key.to_vec()],
                ..DerivedKeys::default()
            },
            user_index,
        }))
    }

    /// The sequence number every event still to fold, or folded at or after the watermark, is
    /// at least: the first event at the folds' watermark (or at the next segment's start when
    /// the watermark ends a segment); none there, any number.
    fn watermark_seq(&self) -> Result<u64, StoreError> {
        let at = self.fold_from()?;
        let next = super::eventlog::Location {
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

    /// Remove the quarantine records received before `before`, in id (arrival) order, `chunk`
    /// per transaction, up to the first one still within retention.
    pub fn prune_quarantine(&self, before: Millis, chunk: usize) -> Result<u64, StoreError> {
        let chunk = chunk.max(1);
        let mut removed = 0;
        let mut after = None;
        loop {
            let (page, next) = self.quarantine_page(after, chunk)?;
            let old: Vec<u64> = page
                .iter()
                .take_while(|m| m.received_at < before)
                .map(|m| m.id)
                .collect();
            let more = old.len() == page.len() && next.is_some();
            let mut batch = sled::Batch::default();
            for id in &old {
                batch.remove(&keys::seq(*id));
            }
            self.quarantine.apply_batch(batch)?;
            removed += old.len() as u64;
            if !more {
                return Ok(removed);
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
