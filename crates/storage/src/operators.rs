//! The console's audit list: each action taken from the console (who, as which role, what, how
//! it ended), kept for `admin.console_audit_retention` and pruned by the pruning loop. Keyed by a
//! number drawn in write order, so the list reads newest first as a range and prunes oldest first.
//! Opened by name on use (sled keeps opened trees), not kept in [`SledStore`].

use super::{decode, encode, keys, SledStore, StoreError};
use crate::port::OperatorLog;
use model::webhook::model::Millis;
use serde::{Deserialize, Serialize};

const TREE: &str = "operator_actions/v1";

/// One action taken from the console.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorAction {
    /// The daemon's time (ms).
    pub at: Millis,
    /// The name the person signed in with.
    pub who: String,
    /// `operator` or `viewer`.
    pub role: String,
    /// What, e.g. `accept c-1`, `retry dead letter 7`.
    pub what: String,
    /// How it ended: `applied`, `rejected: ...`, `refused: ...`, `failed: ...`.
    pub result: String,
}

impl SledStore {
    pub(super) fn operators_tree(&self) -> Result<sled::Tree, StoreError> {
        Ok(self.db.open_tree(TREE)?)
    }
}

impl OperatorLog for SledStore {
    /// Add an action to the list; its number (actions recorded later have higher ones).
    fn record_operator_action(&self, action: &OperatorAction) -> Result<u64, StoreError> {
        let id = self.db.generate_id()?;
        self.operators_tree()?
            .insert(keys::seq(id), encode(action)?)?;
        Ok(id)
    }

    /// Up to `limit` actions recorded before number `before` (from the newest when `None`),
    /// newest first, with their numbers.
    fn operator_actions_page(
        &self,
        before: Option<u64>,
        limit: usize,
    ) -> Result<Vec<(u64, OperatorAction)>, StoreError> {
        let tree = self.operators_tree()?;
        let range = match before {
            Some(before) => tree.range(..keys::seq(before)),
            None => tree.iter(),
        };
        let mut out = Vec::with_capacity(limit.min(1_000));
        for item in range.rev().take(limit) {
            let (k, v) = item?;
            let id = keys::parse_seq(&k).ok_or_else(|| super::corrupt("operator action key"))?;
            out.push((id, decode(&v, "operator action")?));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::port::*;

    fn action(at: Millis, what: &str) -> OperatorAction {
        OperatorAction {
            at,
            who: "Kim".into(),
            role: "operator".into(),
            what: what.into(),
            result: "applied".into(),
        }
    }

    fn whats(page: &[(u64, OperatorAction)]) -> Vec<&str> {
        page.iter().map(|(_, a)| a.what.as_str()).collect()
    }

    #[test]
    fn actions_read_newest_first_in_pages_and_survive_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let store = SledStore::open(dir.path(), 1 << 20).expect("open");
            for (at, what) in [(10, "accept c1"), (20, "reply c1"), (30, "release c1")] {
                store
                    .record_operator_action(&action(at, what))
                    .expect("record");
            }
            store.flush().expect("flush");
        }
        let store = SledStore::open(dir.path(), 1 << 20).expect("reopen");
        let first = store.operator_actions_page(None, 2).expect("page");
        assert_eq!(whats(&first), ["release c1", "reply c1"]);
        let next = store
            .operator_actions_page(Some(first[1].0), 2)
            .expect("page");
        assert_eq!(whats(&next), ["accept c1"]);
        // Recorded after the restart: numbered above what was there.
        store
            .record_operator_action(&action(40, "accept c2"))
            .expect("record");
        let all = store.operator_actions_page(None, 10).expect("page");
        assert_eq!(
            whats(&all),
            ["accept c2", "release c1", "reply c1", "accept c1"]
        );
    }

    #[test]
    fn pruning_drops_the_oldest_up_to_the_limit_and_stops_at_a_kept_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(dir.path(), 1 << 20).expect("open");
        for (at, what) in [(10, "a"), (20, "b"), (30, "c"), (40, "d")] {
            store
                .record_operator_action(&action(at, what))
                .expect("record");
        }
        assert_eq!(store.prune_operator_actions(35, 2).expect("prune"), 2);
        assert_eq!(store.prune_operator_actions(35, 10).expect("prune"), 1);
        assert_eq!(store.prune_operator_actions(35, 10).expect("prune"), 0);
        let left = store.operator_actions_page(None, 10).expect("page");
        assert_eq!(whats(&left), ["d"]);
    }
}
