//! The agent API's idempotency records: the first answer to each `Idempotency-Key`, so a retried
//! call gets it again instead of acting twice. Kept for `helpdesk.idempotency_retention`, pruned
//! by the pruning loop. Opened by name on use (sled keeps opened trees), not kept in [`SledStore`].

use super::{decode, encode, SledStore, StoreError};
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
fn key(route: &str, idempotency_key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(route.len() + 1 + idempotency_key.len());
    k.extend_from_slice(route.as_bytes());
    k.push(0);
    k.extend_from_slice(idempotency_key.as_bytes());
    k
}

impl SledStore {
    fn idempotency_tree(&self) -> Result<sled::Tree, StoreError> {
        Ok(self.db.open_tree(TREE)?)
    }

    /// The answer recorded under a route's key, if any.
    pub(crate) fn idempotent_answer(
        &self,
        route: &str,
        idempotency_key: &str,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        let tree = self.idempotency_tree()?;
        tree.get(key(route, idempotency_key))?
            .map(|b| decode(&b, "idempotency record"))
            .transpose()
    }

    /// Record the first answer under a route's key. Written without a flush of its own: the
    /// command it answers is durable in the event log under an id made from the same key, so
    /// after a crash that lost this record a retry is a duplicate event and gets the verdict
    /// the fold recorded.
    pub(crate) fn record_idempotent_answer(
        &self,
        route: &str,
        idempotency_key: &str,
        record: &IdempotencyRecord,
    ) -> Result<(), StoreError> {
        self.idempotency_tree()?
            .insert(key(route, idempotency_key), encode(record)?)?;
        Ok(())
    }

    /// Drop records answered before `before`, at most `limit`; returns how many went.
    pub(crate) fn prune_idempotency(
        &self,
        before: Millis,
        limit: usize,
    ) -> Result<u64, StoreError> {
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
