//! The reconciliation sweeper's index (in the `queue/v1` tree, beside the waiting queue): every
//! conversation out of plain bot mode (`a` + id: `state::reconcile::is_active`) and every one
//! that left its handoff (`r` + the time it did + id: `state::reconcile::released_at`), so a
//! sweep reads the active ones and a short range of the recently released ones instead of every
//! conversation's state.
//!
//! Like the waiting entries, only folds write these keys, in their transaction: each compares a
//! conversation's key as the fold found it with its key after the fold. So the index always
//! equals the states (a store from before it is indexed once, on open). A released entry stays
//! while its conversation is unchanged (one key per conversation that ever had a handoff); the
//! sweeper reads only those released within `reconcile.recent`.

use super::{keys, ConversationState, Store, StoreError};
use crate::state::reconcile as belief;
use crate::webhook::model::Millis;
use std::collections::HashMap;

/// A conversation's key in the sweeper's index, if any.
pub(super) fn watch_key(s: &ConversationState) -> Option<Vec<u8>> {
    if belief::is_active(s) {
        return Some(keys::watch_active(s.id.as_str()));
    }
    belief::released_at(s).map(|at| keys::watch_released(at, s.id.as_str()))
}

/// What a fold writes to the index.
#[derive(Debug, Default)]
pub(super) struct WatchWrites {
    pub remove: Vec<Vec<u8>>,
    pub insert: Vec<Vec<u8>>,
}

/// The index's changes: each folded conversation's key before the fold (`before`, by id) against
/// its key now.
pub(super) fn watch_writes(
    before: &HashMap<String, Option<Vec<u8>>>,
    states: &HashMap<String, ConversationState>,
) -> WatchWrites {
    let mut out = WatchWrites::default();
    for (id, state) in states {
        let old = before.get(id).cloned().flatten();
        let now = watch_key(state);
        if old == now {
            continue;
        }
        out.remove.extend(old);
        out.insert.extend(now);
    }
    out
}

/// The conversations a sweep looks at (ids), from the index.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Watched {
    /// Out of plain bot mode now.
    pub active: Vec<String>,
    /// Left their handoff at or after the time asked for, newest last.
    pub released: Vec<String>,
}

impl Store {
    /// The sweeper's candidates: every active conversation and those released at or after
    /// `released_since`, at most `limit` in all (active first). Reads the index only.
    pub fn watched(&self, released_since: Millis, limit: usize) -> Result<Watched, StoreError> {
        let mut out = Watched::default();
        for item in self.queue.scan_prefix([keys::WATCH_ACTIVE]) {
            if out.active.len() >= limit {
                return Ok(out);
            }
            let (key, _) = item?;
            match keys::parse_watch_active(&key) {
                Some(id) => out.active.push(id.to_owned()),
                None => tracing::error!(key = ?key, "unreadable watch key; left out"),
            }
        }
        let from = keys::watch_released(released_since, "");
        let end = [keys::WATCH_RELEASED + 1];
        for item in self.queue.range(from..end.to_vec()) {
            if out.active.len() + out.released.len() >= limit {
                break;
            }
            let (key, _) = item?;
            match keys::parse_watch_released(&key) {
                Some((_, id)) => out.released.push(id.to_owned()),
                None => tracing::error!(key = ?key, "unreadable watch key; left out"),
            }
        }
        Ok(out)
    }

    /// Up to `limit` conversation states after id `after` (from the first when `None`), in id
    /// order: the sweeper's rotating sample of the conversations it does not watch.
    pub fn conversations_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ConversationState>, StoreError> {
        let mut out = Vec::with_capacity(limit.min(1024));
        let iter = match after {
            Some(id) => {
                let mut from = id.as_bytes().to_vec();
                from.push(0);
                self.conversations.range(from..)
            }
            None => self.conversations.iter(),
        };
        for item in iter.take(limit) {
            let (_, bytes) = item?;
            out.push(super::decode(&bytes, "conversation state")?);
        }
        Ok(out)
    }

    /// A store from before the sweeper's index: index its conversations once, on open (before
    /// any fold). A new store has none and only marks it.
    pub(super) fn index_watch_once(&self) -> Result<(), StoreError> {
        if self.meta.contains_key(keys::meta::WATCH_INDEXED)? {
            return Ok(());
        }
        let mut indexed = 0u64;
        for item in self.conversations.iter() {
            let (_, bytes) = item?;
            let state: ConversationState = super::decode(&bytes, "conversation state")?;
            if let Some(key) = watch_key(&state) {
                self.queue.insert(key, Vec::new())?;
                indexed += 1;
            }
        }
        self.meta.insert(keys::meta::WATCH_INDEXED, &[1])?;
        if indexed > 0 {
            tracing::info!(indexed, "reconciliation index built from the conversation states");
        }
        Ok(())
    }
}
