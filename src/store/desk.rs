//! Reads for the agent API's queue.

use super::{decode, Store, StoreError};
use crate::state::ConversationState;

impl Store {
    /// The conversations `keep` selects, at most `limit`. Walks the whole conversations tree: the
    /// queue is read by agents now and then, not per event; an index by phase is future work if
    /// stores grow past what a scan answers quickly.
    pub fn conversations_where(
        &self,
        mut keep: impl FnMut(&ConversationState) -> bool,
        limit: usize,
    ) -> Result<Vec<ConversationState>, StoreError> {
        let mut out = Vec::new();
        for item in self.conversations.iter() {
            let (_, v) = item?;
            let state: ConversationState = decode(&v, "conversation state")?;
            if keep(&state) {
                out.push(state);
                if out.len() >= limit {
                    break;
                }
            }
        }
        Ok(out)
    }
}
