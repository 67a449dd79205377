//! The keys a conversation's state derives in the `queue/v1` tree, kept by the folds: the
//! reconciliation sweeper's index (`store::watch`) and the agent API's phase index
//! (`store::desk`). One mechanism for both: each entry is a pure function of the state
//! (`engine::index::Derived`, here as a key: [`key`]); the engine's batch fold compares a
//! conversation's entries as it found it with its entries after the fold, and the fold's journal
//! writes the difference. Only folds write these keys, so the indexes always equal the states. A
//! store from before an index gets it once, on open, behind its own `meta` flag
//! ([`SledStore::index_once`]).
//!
//! (The waiting queue, `store::queue`, is kept beside them in the same way but apart: a fold also
//! reads it, with its own changes over it, for the rules' `queue` input.)

use super::{keys, ConversationState, SledStore, StoreError};
use engine::index::Derived;

/// A derived entry's key.
pub fn key(entry: &Derived) -> Vec<u8> {
    match entry {
        Derived::Phase {
            phase,
            requested_at,
            conversation,
        } => keys::desk_phase(phase.byte(), *requested_at, conversation),
        Derived::BotPhase {
            bot,
            phase,
            requested_at,
            conversation,
        } => keys::desk_bot(bot, phase.byte(), *requested_at, conversation),
        Derived::Active { conversation } => keys::watch_active(conversation),
        Derived::Released { at, conversation } => keys::watch_released(*at, conversation),
    }
}

/// Every key the state derives (none, one or several per index).
pub(super) fn derived_keys(s: &ConversationState) -> Vec<Vec<u8>> {
    engine::index::derived(s).iter().map(key).collect()
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
