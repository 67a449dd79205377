//! The root's part for several nodes on one store: the store an application runs on (sled in its
//! data directory, or one the caller opened), and the active's work started per term
//! (`cluster::Terms`) instead of once. Kept apart from `mod.rs`, which only calls these.

use super::AppError;
use crate::cluster::{Cluster, Terms};
use crate::dispatch::{DispatchHandle, DispatchSettings};
use crate::ops::metrics::Metrics;
use std::future::Future;
use storage::writer::WriterHooks;
use storage::{Store, StoreError, Writer};
use tokio::sync::watch;

/// A store opened by the caller instead of sled in the data directory, and how its intake
/// starts once the dispatcher is there (`Application::build_on`): several applications in one
/// process sharing one store (tests of several nodes, on the in-memory store), and any backend
/// the daemon does not open itself.
pub struct GivenStore {
    pub store: Store,
    pub writer: Box<dyn FnOnce(WriterHooks) -> Result<Writer, StoreError> + Send>,
}

/// The dispatcher: on a store other nodes may share, folding only in this node's terms as the
/// active one; else from the start, handed each event by intake.
pub(super) fn start_dispatch(
    store: &Store,
    metrics: &Metrics,
    settings: DispatchSettings,
    (cluster, stop): (&Cluster, &watch::Receiver<bool>),
) -> Result<(DispatchHandle, tokio::task::JoinHandle<()>), StoreError> {
    match cluster.shared() {
        true => crate::dispatch::start_shared(
            store.clone(),
            metrics.clone(),
            settings,
            cluster.terms(stop),
        ),
        false => crate::dispatch::start(store.clone(), metrics.clone(), settings, stop.clone()),
    }
}

/// The executor's loop: in this node's terms as the active one on a shared store, else once.
pub(super) async fn run_executor(tasks: crate::outbox::Tasks, terms: Terms, shared: bool) {
    match shared {
        true => tasks.run_terms(terms).await,
        false => tasks.run().await,
    }
}

/// One of the active's periodic loops (timers, reconciliation, backfill, pruning), started
/// afresh in each term of this node as the active one (on sled: once, for the daemon's run).
pub(super) fn active_loop<F, Fut>(terms: Terms, work: F) -> tokio::task::JoinHandle<()>
where
    F: FnMut(watch::Receiver<bool>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    tokio::spawn(crate::cluster::each_term(terms, work))
}

/// The writer of a store the caller opened, its hand-overs to the dispatcher.
pub(super) fn given_writer(given: GivenStore, hooks: WriterHooks) -> Result<Writer, AppError> {
    Ok((given.writer)(hooks)?)
}

/// How often a node of several reads a command's verdict from the store while it waits (the
/// active node may fold it).
const VERDICT_LOOK_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// The command path's settings: on a shared store, a command's verdict is also read from the
/// store, where the active node's fold records it.
pub(super) fn command_settings(
    config: &crate::config::HelpdeskConfig,
    cluster: &Cluster,
) -> crate::helpdesk::commands::Settings {
    let mut settings = crate::helpdesk::commands::Settings::of(config);
    if cluster.shared() {
        settings.verdicts_elsewhere = Some(VERDICT_LOOK_EVERY);
    }
    settings
}
