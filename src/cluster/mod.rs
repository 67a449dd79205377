//! Several nodes on one store: which node is the active one, and the turns its work takes.
//!
//! Every node takes the service's webhook, the agent API and the console's actions (stored and
//! acknowledged after commit, whichever node). Exactly one node, the **active**, folds, fires
//! timers, carries out the outbox and runs backfill, reconciliation and pruning: the one holding
//! the store's lease (`storage::lease`). The [`lease_loop`] claims it every third of
//! `cluster.lease` and publishes this node's [`Role`]; a node that cannot renew before its lease
//! runs out steps down by itself, without waiting for the store to answer. The active's work runs
//! in [`Terms`]: each starts when the node becomes active and stops at once when it is no longer
//! (the store fences whatever it still tries to write).
//!
//! On a store one process holds (sled) there is no loop: the node is the active one from start
//! to stop, in one term that is the daemon's run, and nothing else changes.

pub mod lease_loop;

use crate::ops::metrics::Metrics;
use serde::Serialize;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use storage::lease::NodeSeen;
use storage::{Store, StoreError};
use tokio::sync::{watch, Notify};

/// This node's part in the active's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// It holds the lease: it folds, fires timers, carries out the outbox, runs the passes.
    Active,
    /// Another node does (or none yet): it takes intake and serves reads.
    Standby,
}

/// `[cluster]`: this node's name and the lease's length.
#[derive(Clone, Debug)]
pub struct Settings {
    pub node_id: String,
    pub lease: Duration,
}

impl Settings {
    /// From the configuration: `cluster.node_id` (empty: the host name and a random suffix).
    pub fn of(config: &crate::config::ClusterConfig) -> Settings {
        let node_id = match config.node_id.trim() {
            "" => default_node_id(),
            id => id.to_owned(),
        };
        Settings {
            node_id,
            lease: config.lease,
        }
    }
}

/// The host name (`/proc/sys/kernel/hostname`, else `$HOSTNAME`, else `node`) and a random
/// suffix: two processes on one host are two nodes.
fn default_node_id() -> String {
    use rand::distr::{Alphanumeric, SampleString};
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "node".to_owned());
    let suffix = Alphanumeric
        .sample_string(&mut rand::rng(), 6)
        .to_lowercase();
    format!("{host}-{suffix}")
}

/// What the daemon knows of its place among the nodes: cheap to clone, read by the admin API,
/// the console, the metrics and the probes.
#[derive(Clone)]
pub struct Cluster {
    inner: Arc<Inner>,
}

struct Inner {
    settings: Settings,
    store: Store,
    /// Whether other nodes may share the store (else this node is always active).
    shared: bool,
    role: watch::Receiver<Turn>,
    /// Wakes the lease loop (the daemon's clock moved: the test clock).
    wake: Notify,
}

/// What `GET /admin/v1/cluster` answers.
#[derive(Debug, Serialize)]
pub struct View {
    pub node_id: String,
    pub role: Role,
    /// Whether other nodes can share this store (sled: no).
    pub shared: bool,
    pub holder: Option<String>,
    pub epoch: u64,
    /// When the lease runs out on the store's clock (Unix ms); `None` when free.
    pub expires_at: Option<model::webhook::model::Millis>,
    /// The nodes seen in the last minute.
    pub nodes: Vec<NodeSeen>,
}

/// How far back [`Cluster::view`] lists the nodes seen.
const SEEN_WITHIN_MS: model::webhook::model::Millis = 60_000;

impl Cluster {
    /// This node on `store`: on a shared store a standby until the lease loop (started by
    /// [`Cluster::start`]) claims the lease; on sled the active one, its lease claimed once (the
    /// epoch counts the starts).
    pub fn new(settings: Settings, store: Store) -> Result<(Cluster, RoleSender), StoreError> {
        let shared = store.shared();
        let first = match shared {
            true => Role::Standby,
            false => {
                store.claim(&settings.node_id, settings.lease)?;
                Role::Active
            }
        };
        let (tx, role) = watch::channel(Turn {
            role: first,
            turn: 0,
        });
        let cluster = Cluster {
            inner: Arc::new(Inner {
                settings,
                store,
                shared,
                role,
                wake: Notify::new(),
            }),
        };
        Ok((cluster, RoleSender(tx)))
    }

    pub fn node_id(&self) -> &str {
        &self.inner.settings.node_id
    }

    /// Whether other nodes may share the store.
    pub fn shared(&self) -> bool {
        self.inner.shared
    }

    pub fn role(&self) -> Role {
        self.inner.role.borrow().role
    }

    pub fn is_active(&self) -> bool {
        self.role() == Role::Active
    }

    /// The daemon's clock moved (the test clock): the lease loop looks again at once.
    pub fn wake(&self) {
        self.inner.wake.notify_one();
    }

    /// The turns of the active's work until `stop` turns true.
    pub fn terms(&self, stop: &watch::Receiver<bool>) -> Terms {
        match self.inner.shared {
            true => Terms {
                role: self.inner.role.clone(),
                stop: stop.clone(),
                shared: true,
                first: true,
            },
            false => Terms::single(stop),
        }
    }

    /// Start the lease loop (a shared store only), until `stop` turns true; then the lease is
    /// given up by [`Cluster::release`].
    pub fn start(
        &self,
        role: RoleSender,
        metrics: Metrics,
        stop: watch::Receiver<bool>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        metrics.cluster_role.set(i64::from(self.is_active()));
        if let Ok(Some(epoch)) = self
            .inner
            .store
            .lease()
            .map(|l| (l.epoch > 0).then_some(l.epoch))
        {
            metrics
                .lease_epoch
                .set(i64::try_from(epoch).unwrap_or(i64::MAX));
        }
        if !self.inner.shared {
            return None;
        }
        let loop_ = lease_loop::LeaseLoop::new(self.clone(), role, metrics);
        Some(tokio::spawn(loop_.run(stop)))
    }

    /// Give the lease up after a stop in order (its work has stopped): another node takes over at
    /// once instead of after the lease runs out.
    pub async fn release(&self) {
        if !self.inner.shared {
            return;
        }
        let (store, node) = (self.inner.store.clone(), self.node_id().to_owned());
        match tokio::task::spawn_blocking(move || store.release(&node)).await {
            Ok(Ok(())) => tracing::info!(node_id = %self.node_id(), "lease released"),
            Ok(Err(e)) => tracing::warn!(error = %e, "cannot release the lease; it runs out"),
            Err(_) => {}
        }
    }

    /// This node, the lease and the nodes seen in the last minute, read from the store.
    pub async fn view(&self) -> Result<View, StoreError> {
        let store = self.inner.store.clone();
        let since = store.clock().now_millis() - SEEN_WITHIN_MS;
        let read = tokio::task::spawn_blocking(move || {
            Ok::<_, StoreError>((store.lease()?, store.nodes_seen(since)?))
        });
        let (lease, nodes) = read
            .await
            .map_err(|e| StoreError::Internal(format!("lease read: {e}")))??;
        let nodes = match (self.inner.shared, nodes.is_empty()) {
            // sled's one node, before anything claimed.
            (false, true) => vec![NodeSeen {
                node: self.node_id().to_owned(),
                seen_at: self.inner.store.clock().now_millis(),
            }],
            _ => nodes,
        };
        Ok(View {
            node_id: self.node_id().to_owned(),
            role: self.role(),
            shared: self.inner.shared,
            expires_at: lease.holder.as_ref().map(|_| lease.expires_at),
            holder: lease.holder,
            epoch: lease.epoch,
            nodes,
        })
    }
}

/// The role as published: this node's role, and how many times it became the active one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Turn {
    role: Role,
    /// Counts the changes to active. A term belongs to one: it ends when the count moves on, even
    /// if the role is active again by the time its watcher looks (the node stood down and took
    /// the lease again at once, under a new epoch).
    turn: u64,
}

/// Where the lease loop publishes the role.
pub struct RoleSender(watch::Sender<Turn>);

impl RoleSender {
    /// Publish `role`; whether it changed.
    pub(crate) fn publish(&self, role: Role) -> bool {
        self.0.send_if_modified(|t| {
            let changed = t.role != role;
            if changed {
                t.role = role;
                t.turn += u64::from(role == Role::Active);
            }
            changed
        })
    }
}

/// The turns of the active's work: [`Terms::next`] waits until this node is active.
pub struct Terms {
    role: watch::Receiver<Turn>,
    stop: watch::Receiver<bool>,
    shared: bool,
    first: bool,
}

/// One turn of the active's work, from becoming active to no longer being (or the daemon
/// stopping).
pub struct Term {
    /// Turns true when the term ends.
    pub stop: watch::Receiver<bool>,
    daemon: watch::Receiver<bool>,
}

impl Term {
    /// Whether the term ended because the node stopped being active (not the daemon's stop):
    /// what is in flight is dropped at once, not finished.
    pub fn lost(&self) -> bool {
        !*self.daemon.borrow()
    }
}

impl Terms {
    /// One term, until `stop` turns true: a node alone on its store (sled; tests).
    pub fn single(stop: &watch::Receiver<bool>) -> Terms {
        Terms {
            role: watch::channel(Turn {
                role: Role::Active,
                turn: 0,
            })
            .1,
            stop: stop.clone(),
            shared: false,
            first: true,
        }
    }

    /// The next term, once this node is active; `None` once the daemon stops. On sled, one term:
    /// the daemon's run.
    pub async fn next(&mut self) -> Option<Term> {
        if !self.shared {
            let first = std::mem::replace(&mut self.first, false);
            let running = first && !*self.stop.borrow();
            return running.then(|| Term {
                stop: self.stop.clone(),
                daemon: self.stop.clone(),
            });
        }
        let turn = tokio::select! {
            active = self.role.wait_for(|t| t.role == Role::Active) => active.ok()?.turn,
            _ = self.stop.wait_for(|s| *s) => return None,
        };
        if *self.stop.borrow() {
            return None;
        }
        let (tx, stop) = watch::channel(false);
        let (mut role, mut daemon) = (self.role.clone(), self.stop.clone());
        tokio::spawn(async move {
            tokio::select! {
                // Not active, or active again since: either way not this term's turn.
                _ = role.wait_for(|t| t.role != Role::Active || t.turn != turn) => {}
                _ = daemon.wait_for(|s| *s) => {}
                () = tx.closed() => {}
            }
            let _ = tx.send(true);
        });
        Some(Term {
            stop,
            daemon: self.stop.clone(),
        })
    }
}

/// Run `work` for each term until the daemon stops: the active's periodic loops (timers,
/// reconciliation, backfill, pruning), each started afresh when this node becomes active.
pub async fn each_term<F, Fut>(mut terms: Terms, mut work: F)
where
    F: FnMut(watch::Receiver<bool>) -> Fut,
    Fut: Future<Output = ()>,
{
    while let Some(mut term) = terms.next().await {
        work(term.stop.clone()).await;
        // A loop that ended by itself (its passes are off) waits for the term's end.
        let _ = term.stop.wait_for(|s| *s).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node that stood down and took the lease again before a term's watcher looked (its role
    /// is active again by then: a new epoch, another node perhaps active in between) still ends
    /// that term, so the next one starts afresh: the outbox read again from the store, entries
    /// begun under the earlier epoch replayed.
    #[tokio::test]
    async fn a_term_ends_when_the_node_stands_down_even_if_active_again_at_once() {
        let (tx, rx) = watch::channel(Turn {
            role: Role::Standby,
            turn: 0,
        });
        let role = RoleSender(tx);
        let (_daemon, stop) = watch::channel(false);
        let mut terms = Terms {
            role: rx,
            stop,
            shared: true,
            first: true,
        };
        role.publish(Role::Active);
        let mut term = terms.next().await.expect("a term");
        // No await between: the term's watcher sees only the last.
        assert!(role.publish(Role::Standby) && role.publish(Role::Active));
        let ended = tokio::time::timeout(Duration::from_secs(5), term.stop.wait_for(|s| *s))
            .await
            .is_ok();
        assert!(ended, "the term outlived the lease it began under");
        assert!(term.lost(), "lost, not stopped");
        let next = terms.next().await.expect("the next term");
        assert!(!*next.stop.borrow(), "the next term runs");
        role.publish(Role::Active);
        assert!(!*next.stop.borrow(), "a renewal is no new turn");
    }
}
