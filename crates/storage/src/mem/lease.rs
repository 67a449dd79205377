//! The in-memory store's lease (`Lease`), shared by every handle of one store as a database's
//! lease row is by its nodes, judged by the store's clock (the application's test clock): each
//! handle ([`MemStore::another_node`]) carries the epoch its node holds, and the writes of the
//! active's work check it under the data lock ([`MemStore::fenced`]). For tests, a node's calls
//! can be held at its door ([`MemStore::hold`]), as a paused or cut-off node's would be.

use super::{Data, MemStore};
use crate::lease::{Lease, LeaseState, NodeSeen, Start};
use crate::StoreError;
use model::webhook::model::Millis;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// What a handle knows of the lease.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Fence {
    /// It never claimed the lease: one process alone, not fenced.
    #[default]
    Unclaimed,
    /// It claimed and holds none (a standby), or gave it up.
    Standby,
    /// It holds this epoch.
    Holds(u64),
}

/// A node's calls a test holds back (see [`MemStore::hold`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// Its lease calls (claim, release, heartbeat): it cannot renew.
    Lease,
    /// Its fold commits (each waits after its fold, under the fold lock, before its write).
    Commits,
}

impl Held {
    fn index(self) -> usize {
        match self {
            Held::Lease => 0,
            Held::Commits => 1,
        }
    }
}

/// A node's door: which calls wait at it, and how many wait now.
#[derive(Default)]
pub(super) struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Default)]
struct GateState {
    held: [bool; 2],
    waiting: [usize; 2],
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait here while `calls` are held.
    pub(super) fn pass(&self, calls: Held) {
        let i = calls.index();
        let mut state = self.lock();
        if !state.held[i] {
            return;
        }
        state.waiting[i] += 1;
        self.changed.notify_all();
        while state.held[i] {
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        state.waiting[i] -= 1;
        self.changed.notify_all();
    }
}

/// The lease row.
#[derive(Default)]
pub(super) struct LeaseRow {
    holder: Option<String>,
    epoch: u64,
    expires_at: Millis,
}

impl LeaseRow {
    fn state(&self) -> LeaseState {
        LeaseState {
            holder: self.holder.clone(),
            epoch: self.epoch,
            expires_at: self.expires_at,
        }
    }
}

impl MemStore {
    fn fence(&self) -> MutexGuard<'_, Fence> {
        self.1.fence.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Another node's handle on the same store: the same data, its own epoch (none yet), its own
    /// timer wake-up and door.
    pub fn another_node(&self) -> MemStore {
        MemStore(self.0.clone(), std::sync::Arc::default())
    }

    /// Hold this node's `calls` at its door until [`let_through`](MemStore::let_through).
    pub fn hold(&self, calls: Held) {
        self.1.gate.lock().held[calls.index()] = true;
    }

    /// Let this node's held `calls` through.
    pub fn let_through(&self, calls: Held) {
        self.1.gate.lock().held[calls.index()] = false;
        self.1.gate.changed.notify_all();
    }

    /// Wait until one of this node's `calls` waits at its door (at most `timeout`): whether one
    /// does.
    pub fn wait_held(&self, calls: Held, timeout: Duration) -> bool {
        let gate = &self.1.gate;
        let state = gate.lock();
        let (state, _) = gate
            .changed
            .wait_timeout_while(state, timeout, |s| s.waiting[calls.index()] == 0)
            .unwrap_or_else(|p| p.into_inner());
        state.waiting[calls.index()] > 0
    }

    /// A write of the active's work may go on (called under the data lock): this handle never
    /// claimed the lease, or holds the lease's epoch and the lease has not run out.
    pub(super) fn fenced(&self, data: &Data) -> Result<(), StoreError> {
        match *self.fence() {
            Fence::Unclaimed => Ok(()),
            Fence::Standby => Err(StoreError::Fenced),
            Fence::Holds(epoch) => {
                let lease = &data.lease;
                let now = self.0.clock.now_millis();
                match lease.epoch == epoch && now < lease.expires_at {
                    true => Ok(()),
                    false => Err(StoreError::Fenced),
                }
            }
        }
    }

    /// Pass the door for the lease's calls, then the data.
    fn lease_data(&self) -> MutexGuard<'_, Data> {
        self.1.gate.pass(Held::Lease);
        self.data()
    }

    /// Wait at the door while this node's commits are held (a fold's commit).
    pub(super) fn pass_commit(&self) {
        self.1.gate.pass(Held::Commits);
    }
}

impl Lease for MemStore {
    fn shared(&self) -> bool {
        true
    }

    fn claim(&self, node: &str, ttl: Duration) -> Result<LeaseState, StoreError> {
        let mut data = self.lease_data();
        let now = self.0.clock.now_millis();
        let ttl = Millis::try_from(ttl.as_millis()).unwrap_or(Millis::MAX);
        let lease = &mut data.lease;
        // Free, or run out (its holder's writes are refused from now on): a new epoch.
        if lease.holder.is_none() || now >= lease.expires_at {
            lease.epoch += 1;
            lease.holder = Some(node.to_owned());
        }
        let holds = lease.holder.as_deref() == Some(node);
        if holds {
            lease.expires_at = now.saturating_add(ttl);
        }
        *self.fence() = match holds {
            true => Fence::Holds(lease.epoch),
            false => Fence::Standby,
        };
        Ok(lease.state())
    }

    fn release(&self, node: &str) -> Result<(), StoreError> {
        let mut data = self.lease_data();
        if data.lease.holder.as_deref() == Some(node) {
            data.lease.holder = None;
            data.lease.expires_at = 0;
        }
        *self.fence() = Fence::Standby;
        Ok(())
    }

    fn lease(&self) -> Result<LeaseState, StoreError> {
        Ok(self.data().lease.state())
    }

    fn held_epoch(&self) -> Option<u64> {
        match *self.fence() {
            Fence::Holds(epoch) => Some(epoch),
            Fence::Unclaimed | Fence::Standby => None,
        }
    }

    fn note_seen(&self, node: &str) -> Result<(), StoreError> {
        let now = self.0.clock.now_millis();
        self.lease_data().seen.insert(node.to_owned(), now);
        Ok(())
    }

    fn nodes_seen(&self, since: Millis) -> Result<Vec<NodeSeen>, StoreError> {
        let data = self.data();
        let seen = data.seen.iter().filter(|(_, at)| **at >= since);
        Ok(seen
            .map(|(node, at)| NodeSeen {
                node: node.clone(),
                seen_at: *at,
            })
            .collect())
    }

    fn outbox_started(&self, seqs: &[u64]) -> Result<Vec<Start>, StoreError> {
        let mut data = self.data();
        self.fenced(&data)?;
        let Some(epoch) = self.held_epoch() else {
            return Ok(vec![Start::First; seqs.len()]);
        };
        let mut out = Vec::with_capacity(seqs.len());
        for seq in seqs {
            if !data.outbox.contains_key(seq) {
                out.push(Start::First);
                continue;
            }
            out.push(match data.started.insert(*seq, epoch) {
                Some(earlier) if earlier < epoch => Start::Replay { epoch: earlier },
                _ => Start::First,
            });
        }
        Ok(out)
    }
}
