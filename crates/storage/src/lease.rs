//! The lease: which node of several sharing one store is the active one (it folds, fires timers,
//! carries out the outbox, runs backfill, reconciliation and pruning), with an epoch that only
//! grows (a fencing token). The port's group for several nodes ([`Lease`]); `docs/storage-port.md`
//! states its guarantees and how a table backend maps it.
//!
//! **Fencing.** A store handle carries the epoch its node holds, set by [`Lease::claim`] (none
//! after a claim that found another holder, or a [`Lease::release`]). Every write of the
//! active's work (a fold commit and the watermark, an outbox outcome, retry state, started mark
//! or dead letter, the desks' mappings, a retention pass, the backfill cursor) checks that epoch
//! against the lease in its own transaction (or under its own lock) and fails with
//! [`StoreError::Fenced`](crate::StoreError::Fenced), writing nothing, when the lease moved on
//! or ran out: a node that lost the lease (paused, cut off) commits nothing. Intake (events and
//! their quarantine, the agent commands' answers, the console's audit list, an operator's retry
//! or drop of a dead letter) is taken on every node and is not fenced. A handle that never
//! claimed the lease is not fenced (one process alone: offline tools, tests).
//!
//! sled is one process's store: its lease is always the claiming node's, the epoch counts the
//! starts (kept in `meta`), and fencing holds trivially.

use crate::{keys, SledStore, StoreError};
use model::webhook::model::Millis;
use serde::Serialize;
use std::sync::Mutex;
use std::time::Duration;

/// The lease as the store has it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LeaseState {
    /// The node holding it; `None` when it is free (never claimed, or released).
    pub holder: Option<String>,
    /// The epoch of the last claim that acquired it (0: never acquired).
    pub epoch: u64,
    /// When it runs out, on the store's clock (a holder that does not renew by then loses it).
    pub expires_at: Millis,
}

impl LeaseState {
    /// Whether `node` holds it at `now`.
    pub fn held_by(&self, node: &str, now: Millis) -> bool {
        self.holder.as_deref() == Some(node) && now < self.expires_at
    }

    /// Whether someone holds it at `now`.
    pub fn is_held(&self, now: Millis) -> bool {
        self.holder.is_some() && now < self.expires_at
    }
}

/// A node that took part in the lease, and when it was last seen (its last heartbeat).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NodeSeen {
    pub node: String,
    pub seen_at: Millis,
}

/// How an outbox entry's attempt begins ([`Lease::outbox_started`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// No attempt of an earlier epoch began: a first attempt, or one more of this epoch.
    First,
    /// An attempt began under this earlier epoch and its outcome was never recorded: the active
    /// that made it is gone, and this one carries the entry out again (a replay).
    Replay { epoch: u64 },
}

/// The lease on the active's work, and the fencing of its writes (see the module's docs).
pub trait Lease {
    /// Whether several nodes can share this store (a database): then the nodes take turns
    /// through the lease. `false` for one process's store (sled): its node is always active.
    fn shared(&self) -> bool;
    /// Claim the lease for `node` for `ttl` from now, on the store's clock (the database's, never
    /// the node's): acquired when free or run out (epoch + 1), renewed when `node` holds it
    /// (same epoch). Returns the lease as it then stands (another holder's when it is held); this
    /// handle then carries the epoch it holds, or none.
    fn claim(&self, node: &str, ttl: Duration) -> Result<LeaseState, StoreError>;
    /// Give the lease up if `node` holds it (a clean stop): free at once, its epoch kept. This
    /// handle carries no epoch after.
    fn release(&self, node: &str) -> Result<(), StoreError>;
    /// The lease as it stands, without claiming it.
    fn lease(&self) -> Result<LeaseState, StoreError>;
    /// The epoch this handle holds (`None`: it holds none, or never claimed).
    fn held_epoch(&self) -> Option<u64>;
    /// Note `node` as seen now (a heartbeat).
    fn note_seen(&self, node: &str) -> Result<(), StoreError>;
    /// The nodes seen at or after `since`, by name.
    fn nodes_seen(&self, since: Millis) -> Result<Vec<NodeSeen>, StoreError>;
    /// Mark outbox entries `seqs` as started by this handle's epoch, before their calls (fenced,
    /// all or none): for each, in order, whether an attempt of an earlier epoch had begun (a
    /// replay). `First` for an entry no longer in the outbox, and for a store that is not
    /// [`shared`](Lease::shared).
    fn outbox_started(&self, seqs: &[u64]) -> Result<Vec<Start>, StoreError>;
}

/// The sled backend's lease: this node's, always (one process holds the store).
#[derive(Default)]
pub(crate) struct SledLease {
    /// The epoch of this open (counted in `meta` at the first claim) and the claiming node.
    held: Mutex<Option<(u64, String)>>,
}

impl SledStore {
    fn sled_lease(&self) -> std::sync::MutexGuard<'_, Option<(u64, String)>> {
        self.lease.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lease of this open: the node, and the epoch counted once per open.
    fn hold_lease(&self, node: &str) -> Result<u64, StoreError> {
        let mut held = self.sled_lease();
        if let Some((epoch, holder)) = held.as_mut() {
            node.clone_into(holder);
            return Ok(*epoch);
        }
        let before = match self.meta.get(keys::meta::LEASE_EPOCH)? {
            Some(b) => keys::parse_seq(&b).ok_or_else(|| crate::corrupt("lease epoch"))?,
            None => 0,
        };
        let epoch = before.saturating_add(1);
        self.meta
            .insert(keys::meta::LEASE_EPOCH, &keys::seq(epoch))?;
        *held = Some((epoch, node.to_owned()));
        Ok(epoch)
    }
}

impl Lease for SledStore {
    fn shared(&self) -> bool {
        false
    }

    fn claim(&self, node: &str, ttl: Duration) -> Result<LeaseState, StoreError> {
        let epoch = self.hold_lease(node)?;
        let ttl = Millis::try_from(ttl.as_millis()).unwrap_or(Millis::MAX);
        Ok(LeaseState {
            holder: Some(node.to_owned()),
            epoch,
            expires_at: self.clock.now_millis().saturating_add(ttl),
        })
    }

    /// Nothing to give up: no other process can take the store.
    fn release(&self, _node: &str) -> Result<(), StoreError> {
        Ok(())
    }

    fn lease(&self) -> Result<LeaseState, StoreError> {
        Ok(match self.sled_lease().as_ref() {
            Some((epoch, node)) => LeaseState {
                holder: Some(node.clone()),
                epoch: *epoch,
                expires_at: Millis::MAX,
            },
            None => LeaseState {
                holder: None,
                epoch: 0,
                expires_at: 0,
            },
        })
    }

    fn held_epoch(&self) -> Option<u64> {
        self.sled_lease().as_ref().map(|(epoch, _)| *epoch)
    }

    fn note_seen(&self, _node: &str) -> Result<(), StoreError> {
        Ok(())
    }

    /// The one node: the claiming one, seen now.
    fn nodes_seen(&self, _since: Millis) -> Result<Vec<NodeSeen>, StoreError> {
        let now = self.clock.now_millis();
        Ok(self
            .sled_lease()
            .iter()
            .map(|(_, node)| NodeSeen {
                node: node.clone(),
                seen_at: now,
            })
            .collect())
    }

    /// No other node can have begun it: never a replay, and nothing written.
    fn outbox_started(&self, seqs: &[u64]) -> Result<Vec<Start>, StoreError> {
        Ok(vec![Start::First; seqs.len()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sleds_lease_is_always_this_nodes_and_its_epoch_counts_the_opens() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("store");
        {
            let store = SledStore::open(&path, 8 << 20).expect("open");
            assert!(!store.shared());
            assert_eq!(store.lease().expect("lease").holder, None);
            let first = store.claim("n1", Duration::from_secs(10)).expect("claim");
            assert_eq!((first.holder.as_deref(), first.epoch), (Some("n1"), 1));
            let again = store.claim("n1", Duration::from_secs(10)).expect("renew");
            assert_eq!(again.epoch, 1, "a renewal keeps the epoch");
            assert_eq!(store.held_epoch(), Some(1));
            assert_eq!(store.outbox_started(&[7]).expect("start"), [Start::First]);
        }
        let store = SledStore::open(&path, 8 << 20).expect("reopen");
        let next = store.claim("n1", Duration::from_secs(10)).expect("claim");
        assert_eq!(next.epoch, 2, "the next open's epoch is higher");
        let seen = store.nodes_seen(0).expect("seen");
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].node, "n1");
    }
}
