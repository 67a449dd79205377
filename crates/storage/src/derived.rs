//! The keys a conversation's state derives in the `queue/v1` tree, kept by the folds: the
//! reconciliation sweeper's index (`store::watch`) and the agent API's phase index
//! (`store::desk`). One mechanism for both: each is a pure function of the state
//! ([`derived_keys`]); a fold notes a conversation's keys as it found it and writes, in its
//! journal, the difference with its keys after the fold ([`derived_writes`]). Only folds write
//! these keys, so the indexes always equal the states. A store from before an index gets it once,
//! on open, behind its own `meta` flag ([`SledStore::index_once`]).
//!
//! (The waiting queue, `store::queue`, is kept beside them in the same way but apart: a fold also
//! reads it, with its own changes over it, for the rules' `queue` input.)

use super::{desk, watch, ConversationState, SledStore, StoreError};
use std::collections::HashMap;

/// Every key the state derives (none, one or several per index).
pub(super) fn derived_keys(s: &ConversationState) -> Vec<Vec<u8>> {
    let mut out = desk::desk_keys(s);
    out.extend(watch::watch_key(s));
    out
}

/// What a fold writes to the derived indexes.
#[derive(Debug, Default)]
pub(super) struct DerivedWrites {
    pub remove: Vec<Vec<u8>>,
    pub insert: Vec<Vec<u8>>,
}

/// The indexes' changes: each folded conversation's keys before the fold (`before`, by id)
/// against its keys now.
pub(super) fn derived_writes(
    before: &HashMap<String, Vec<Vec<u8>>>,
    states: &HashMap<String, ConversationState>,
) -> DerivedWrites {
    let mut out = DerivedWrites::default();
    let none = Vec::new();
    for (id, state) in states {
        let old = before.get(id).unwrap_or(&none);
        let now = derived_keys(state);
        out.remove
            .extend(old.iter().filter(|k| !now.contains(k)).cloned());
        out.insert
            .extend(now.iter().filter(|k| !old.contains(k)).cloned());
    }
    out
}

impl SledStore {
    /// A store from before an index: index its conversations once, on open (before any fold,
    /// so nothing races with it), then set `flag` in `meta`. A new store has none and only marks
    /// it.
    pub(super) fn index_once(
        &self,
        flag: &[u8],
        what: &str,
        keys_of: impl Fn(&ConversationState) -> Vec<Vec<u8>>,
    ) -> Result<(), StoreError> {
        if self.meta.contains_key(flag)? {
            return Ok(());
        }
        let mut indexed = 0u64;
        for item in self.conversations.iter() {
            let (_, bytes) = item?;
            let state: ConversationState = super::decode(&bytes, "conversation state")?;
            for key in keys_of(&state) {
                self.queue.insert(key, Vec::new())?;
                indexed += 1;
            }
        }
        self.meta.insert(flag, &[1])?;
        if indexed > 0 {
            tracing::info!(
                indexed,
                index = what,
                "index built from the conversation states"
            );
        }
        Ok(())
    }
}
