//! The agent API's idempotency records: the first answer to each `Idempotency-Key`, so a retried
//! call gets it again instead of acting twice. Kept for `helpdesk.idempotency_retention`, pruned
//! by the pruning loop. Opened by name on use (sled keeps opened trees), not kept in [`SledStore`].

use super::{SledStore, StoreError};
use model::webhook::model::Millis;
use serde::{Deserialize, Serialize};

const TREE: &str = "helpdesk_idempotency/v1";

/// The first answer given under a key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IdempotencyRecord {
    /// What was asked (route, path parameters, body), to tell a reuse of the key for another
    /// request apart from a retry.
    pub request: String,
    pub status: u16,
    pub body: serde_json::Value,
    pub at: Millis,
}

/// A record's key: the route and the caller's key (not the token, so a rotated token still finds
/// the answer).
pub(super) fn key(route: &str, idempotency_key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(route.len() + 1 + idempotency_key.len());
    k.extend_from_slice(route.as_bytes());
    k.push(0);
    k.extend_from_slice(idempotency_key.as_bytes());
    k
}

impl SledStore {
    pub(super) fn idempotency_tree(&self) -> Result<sled::Tree, StoreError> {
        Ok(self.db.open_tree(TREE)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::port::*;

    fn record(at: Millis) -> IdempotencyRecord {
        IdempotencyRecord {
            request: "accept c1 {}".into(),
            status: 200,
            body: serde_json::json!({"ok": true}),
            at,
        }
    }

    #[test]
    fn answers_are_kept_per_route_and_key_until_pruned() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(dir.path(), 1 << 20).expect("open");
        store
            .record_idempotent_answer("accept", "k1", &record(10))
            .expect("record");
        store
            .record_idempotent_answer("release", "k1", &record(30))
            .expect("record");
        assert_eq!(
            store.idempotent_answer("accept", "k1").expect("get"),
            Some(record(10))
        );
        assert_eq!(store.idempotent_answer("accept", "k2").expect("get"), None);
        assert_eq!(store.prune_idempotency(20, 100).expect("prune"), 1);
        assert_eq!(store.idempotent_answer("accept", "k1").expect("get"), None);
        assert_eq!(
            store.idempotent_answer("release", "k1").expect("get"),
            Some(record(30))
        );
    }
}
