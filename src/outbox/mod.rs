//! The executor: carries out outbox entries through its sinks (the Open API, the help desks), in
//! decision order within a queue (a conversation, an end user, a partner-messenger user, a
//! conversation's help-desk events...) and in parallel across queues, with bounded concurrency.
//!
//! - [`scheduler`]: what is due (per-queue order, due times, the in-memory window, breaker
//!   gating), a data structure without I/O;
//! - [`sink`]: `trait Sink` (one attempt -> done, retry, dead), the failure types;
//! - [`openapi`], [`helpdesk`]: the two sinks;
//! - [`backoff`]: the one backoff policy (`[outbox.retry]`) and the give-up time;
//! - [`breaker`]: a circuit per destination;
//! - [`executor`]: the loop that asks the scheduler, runs sinks and records outcomes.
//!
//! The outbox in sled is the executor's position: an entry leaves it only in the transaction that
//! records its outcome (done or dead letter). A crash before that point means the entry runs again
//! on the next start, with the same idempotency key, so the upstream applies it once. The
//! in-memory window is a cache of the outbox, read from it in order.

pub mod backoff;
pub mod breaker;
mod executor;
pub mod helpdesk;
pub mod ledger;
pub mod openapi;
pub mod scheduler;
pub mod sink;
#[cfg(test)]
mod tests;

pub use breaker::CircuitView;
pub use ledger::Ledger;

use crate::helpdesk::Desks;
use crate::ops::metrics::Metrics;
use model::action::OutboxEntry;
use model::webhook::model::Millis;
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use storage::{Store, StoreError};
use tokio::sync::{mpsc, watch};
use upstream::api::OpenApi;
use upstream::handle::UpstreamHandle;

pub struct ExecutorSettings {
    /// Entries carried out at once (each from a different queue).
    pub concurrency: usize,
    /// Action names whose dead letter halts the rest of its queue until retried or dropped.
    pub blocking: HashSet<String>,
    /// Above this many pending entries `/readyz` reports the outbox as backed up.
    pub max_depth: usize,
    /// A transient failure never dead-letters before the entry failed for this long.
    pub give_up_after: Duration,
    /// Pending entries in memory at most.
    pub window: usize,
    pub retry: backoff::Backoff,
    pub breaker: crate::config::BreakerConfig,
}

impl ExecutorSettings {
    pub fn from_config(c: &crate::config::OutboxConfig) -> Self {
        ExecutorSettings {
            concurrency: c.concurrency,
            blocking: c.blocking.iter().cloned().collect(),
            max_depth: c.max_depth,
            give_up_after: c.give_up_after,
            window: c.window,
            retry: c.retry.clone(),
            breaker: c.breaker.clone(),
        }
    }
}

/// The daemon's time as the executor reads it: the store's clock in the daemon, a clock on
/// tokio's paused time in tests.
pub type NowFn = Arc<dyn Fn() -> Millis + Send + Sync>;

enum Msg {
    /// Entries in the outbox to run (a fold's, committed); counted in `in_transit` until they
    /// arrive.
    Entries(Vec<OutboxEntry>),
    /// A dead letter back in the outbox (loaded whatever the window), its queue unblocked.
    Retried(Box<OutboxEntry>),
    /// A blocking dead letter of this queue was dropped.
    Unblock(String),
    /// Look again (after resume, or the test clock moved).
    Wake,
}

/// Hands entries to the executor and controls it. Cloning is cheap.
#[derive(Clone)]
pub struct ExecutorHandle {
    tx: mpsc::UnboundedSender<Msg>,
    paused: Arc<AtomicBool>,
    depth: Arc<AtomicUsize>,
    max_depth: usize,
    /// Changes whenever the executor's pending count, or `in_transit`, changes.
    progress: watch::Receiver<usize>,
    /// Entries decided by a fold and on their way here.
    in_transit: Arc<AtomicUsize>,
    /// Each destination's circuit, as the executor last published it.
    circuits: Arc<Mutex<BTreeMap<String, CircuitView>>>,
    /// Pending entries in memory (at most `outbox.window`).
    in_memory: Arc<AtomicUsize>,
}

/// How a fold hands decided entries to the executor ([`ExecutorHandle::decided_sender`]). They
/// count as pending from the moment they are sent, so [`ExecutorHandle::wait_idle`] cannot report
/// idle while entries are on their way.
#[derive(Clone)]
pub struct DecidedSender {
    tx: mpsc::UnboundedSender<Msg>,
    in_transit: Arc<AtomicUsize>,
}

impl DecidedSender {
    pub fn send(&self, entries: Vec<OutboxEntry>) {
        let n = entries.len();
        if n == 0 {
            return;
        }
        self.in_transit.fetch_add(n, Ordering::SeqCst);
        if self.tx.send(Msg::Entries(entries)).is_err() {
            self.in_transit.fetch_sub(n, Ordering::SeqCst);
        }
    }
}

impl ExecutorHandle {
    /// What a fold hands its decided entries to, straight to the executor: a fold's decisions
    /// run once it committed them, before they reach the disk. Their events are durable in the
    /// event log, and a fold lost in a crash is done again from there to the same decisions
    /// (the decisions' clock is each event's receive time: `engine::batch`), with the same ids,
    /// which the calls send as idempotency keys (ARCHITECTURE.md, "Decided with the fold").
    /// Folds send in fold order, so the executor sees each queue's entries in decision order.
    pub fn decided_sender(&self) -> DecidedSender {
        DecidedSender {
            tx: self.tx.clone(),
            in_transit: self.in_transit.clone(),
        }
    }

    /// Hand over entries that are in the outbox (as a fold's are).
    pub fn notify(&self, entries: Vec<OutboxEntry>) {
        self.decided_sender().send(entries);
    }

    /// A dead letter went back to the outbox: run it (and what waited behind it).
    pub fn retried(&self, entry: OutboxEntry) {
        self.in_transit.fetch_add(1, Ordering::SeqCst);
        if self.tx.send(Msg::Retried(Box::new(entry))).is_err() {
            self.in_transit.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Look at what is due now: the daemon's clock moved (the test clock).
    pub fn wake(&self) {
        let _ = self.tx.send(Msg::Wake);
    }

    /// Pending entries held in memory (the window); the rest wait in the store.
    pub fn in_memory(&self) -> usize {
        self.in_memory.load(Ordering::SeqCst)
    }

    /// Each destination's circuit (`openapi`, `helpdesk:<endpoint>`), for `/readyz`.
    pub fn circuits(&self) -> BTreeMap<String, CircuitView> {
        self.circuits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether `destination`'s circuit is open (as the executor last published it). Reconcile
    /// and backfill skip their periodic passes while the Open API's is.
    pub fn circuit_open(&self, destination: &str) -> bool {
        self.circuits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(destination)
            .is_some_and(|c| c.open)
    }

    /// Whether the Open API's circuit is open: the upstream is down, calls would only fail.
    pub fn openapi_down(&self) -> bool {
        self.circuit_open(sink::OPENAPI)
    }

    /// A dead letter was dropped: its queue goes on.
    pub fn dropped(&self, queue: String) {
        let _ = self.tx.send(Msg::Unblock(queue));
    }

    pub fn pause(&self) {
        self.paused.store(true, Ordering::SeqCst);
    }

    pub fn resume(&self) {
        self.paused.store(false, Ordering::SeqCst);
        self.wake();
    }

    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    /// Pending entries (queued or running).
    pub fn depth(&self) -> usize {
        self.depth.load(Ordering::SeqCst)
    }

    /// More pending entries than the configured limit.
    pub fn backed_up(&self) -> bool {
        self.depth() > self.max_depth
    }

    /// Wait until nothing is pending (every entry done or dead), or the timeout passes.
    pub async fn wait_idle(&self, timeout: Duration) -> bool {
        let mut progress = self.progress.clone();
        let deadline = tokio::time::Instant::now() + timeout;
        // The runner publishes the depth before it decrements `in_transit`, so `in_transit` is
        // read before the depth: seeing the entries arrived implies seeing them counted. Marking
        // the progress seen first means any change after it wakes the wait below.
        let idle = |progress: &watch::Receiver<usize>| {
            self.in_transit.load(Ordering::SeqCst) == 0 && *progress.borrow() == 0
        };
        loop {
            progress.borrow_and_update();
            if idle(&progress) {
                return true;
            }
            match tokio::time::timeout_at(deadline, progress.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return idle(&progress),
            }
        }
    }
}

/// Start the executor on the current runtime: it reads the outbox in pages as it goes, and runs
/// until `stop`.
pub fn start(
    store: Store,
    api: OpenApi<UpstreamHandle>,
    helpdesk: Arc<Desks>,
    metrics: Metrics,
    settings: ExecutorSettings,
    stop: watch::Receiver<bool>,
) -> Result<(ExecutorHandle, Tasks), StoreError> {
    let openapi = Arc::new(openapi::OpenApiSink::new(api.clone(), store.clone()));
    let hd = helpdesk::HelpdeskSink::new(helpdesk, api, store.clone(), metrics.clone());
    let mut destinations = vec![sink::OPENAPI.to_owned()];
    destinations.extend(hd.destinations_known());
    let sinks = executor::Sinks {
        openapi,
        helpdesk: Arc::new(hd),
    };
    let daemon = store.clock().clone();
    let clock: NowFn = Arc::new(move || daemon.now_millis());
    start_with(
        Arc::new(store),
        sinks,
        &destinations,
        metrics,
        settings,
        clock,
        stop,
    )
}

/// [`start`] with any ledger, sinks and clock (tests: in memory, fakes, paused time).
pub fn start_with(
    ledger: Arc<dyn Ledger>,
    sinks: executor::Sinks,
    destinations: &[String],
    metrics: Metrics,
    settings: ExecutorSettings,
    clock: NowFn,
    stop: watch::Receiver<bool>,
) -> Result<(ExecutorHandle, Tasks), StoreError> {
    let scheduler = scheduler(&*ledger, &settings, destinations, &metrics)?;
    let pending = scheduler.depth();
    let (tx, rx) = mpsc::unbounded_channel();
    let (progress_tx, progress) = watch::channel(scheduler.depth());
    let handle = ExecutorHandle {
        tx,
        paused: Arc::new(AtomicBool::new(false)),
        depth: Arc::new(AtomicUsize::new(scheduler.depth())),
        max_depth: settings.max_depth,
        progress,
        in_transit: Arc::new(AtomicUsize::new(0)),
        circuits: Arc::new(Mutex::new(scheduler.circuits())),
        in_memory: Arc::new(AtomicUsize::new(0)),
    };
    if pending > 0 {
        tracing::info!(pending, "resuming the outbox");
    }
    let (to_recorders, recorders) = executor::Recorders::new();
    let runner = executor::Runner {
        ledger,
        recorders: to_recorders,
        sinks,
        metrics,
        settings,
        handle: handle.clone(),
        progress: progress_tx,
        clock,
    };
    let tasks = Tasks {
        runner,
        scheduler,
        rx,
        stop,
        recorders,
        destinations: destinations.to_vec(),
    };
    Ok((handle, tasks))
}

/// The scheduler over the outbox as the store has it: its pending entries counted, the highest
/// known durable, the queues a blocking dead letter halts; every circuit closed.
fn scheduler(
    ledger: &dyn Ledger,
    settings: &ExecutorSettings,
    destinations: &[String],
    metrics: &Metrics,
) -> Result<scheduler::Scheduler, StoreError> {
    let pending = ledger.pending()?;
    let last = ledger.last_seq()?;
    let mut breakers =
        breaker::Breakers::new(settings.breaker.failures, settings.breaker.probe_interval);
    for d in destinations {
        breakers.known(d);
        metrics.circuit_open.with_label_values(&[d]).set(0);
    }
    let mut scheduler = scheduler::Scheduler::new(settings.window, breakers, pending, last);
    let letters = ledger.blocking_queues()?;
    for queue in &letters.blocked {
        scheduler.block(queue);
    }
    metrics.dead_letter_entries.set(letters.count as i64);
    Ok(scheduler)
}

/// The executor's work, built by [`start`] and run where its caller puts it: the daemon runs it
/// beside the Open API client (`UpstreamHandle::spawn_beside`), tests on their own runtime.
pub struct Tasks {
    runner: executor::Runner,
    scheduler: scheduler::Scheduler,
    rx: mpsc::UnboundedReceiver<Msg>,
    stop: watch::Receiver<bool>,
    recorders: executor::Recorders,
    /// Each term's scheduler knows them (several nodes).
    destinations: Vec<String>,
}

impl Tasks {
    /// The loop until a stop (calls in flight finish first), with the tasks that record
    /// outcomes and begun entries beside it on the same runtime.
    pub async fn run(mut self) {
        self.recorders.spawn(&self.runner.ledger);
        let runner = Arc::new(self.runner);
        runner
            .run(self.scheduler, &mut self.rx, self.stop, &|| false)
            .await;
    }

    /// Several nodes on one store: the loop in each term of this node as the active one
    /// (`cluster::Terms`), each on a scheduler read afresh from the store (the outbox where the
    /// last active left it); a term that ends because the node is no longer active drops its
    /// calls in flight at once (the store refuses their outcomes; the next active replays them).
    /// Between terms, what is handed over is dropped (it is in the store).
    pub async fn run_terms(self, mut terms: crate::cluster::Terms) {
        let Tasks {
            runner,
            mut rx,
            recorders,
            destinations,
            ..
        } = self;
        recorders.spawn(&runner.ledger);
        let runner = Arc::new(runner);
        loop {
            let term = tokio::select! {
                term = terms.next() => term,
                msg = rx.recv() => match msg {
                    Some(msg) => { runner.drop_msg(msg); continue }
                    None => break,
                },
            };
            let Some(term) = term else { break };
            let (r, d) = (runner.clone(), destinations.clone());
            let built = tokio::task::spawn_blocking(move || {
                scheduler(&*r.ledger, &r.settings, &d, &r.metrics)
            })
            .await;
            let sched = match built {
                Ok(Ok(sched)) => sched,
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "cannot read the outbox: this term carries nothing out");
                    let mut stop = term.stop.clone();
                    let _ = stop.wait_for(|s| *s).await;
                    continue;
                }
                Err(_) => continue,
            };
            if sched.depth() > 0 {
                tracing::info!(
                    pending = sched.depth(),
                    "taking the outbox over where it stands"
                );
            }
            runner
                .run(sched, &mut rx, term.stop.clone(), &|| term.lost())
                .await;
        }
    }
}
