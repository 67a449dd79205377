//! The executor: carries out outbox entries through the Open API client, in decision order within
//! a queue (a conversation, an end user, a partner-messenger user...) and in parallel across
//! queues, with bounded concurrency.
//!
//! The outbox in sled is the executor's position: an entry leaves it only in the transaction that
//! records its outcome (done or dead letter). A crash before that point means the entry runs again
//! on the next start, with the same idempotency key, so the upstream applies it once. The
//! in-memory queues are a cache of the outbox, rebuilt on start.

use crate::actions::execute::{execute, flow_title_bot, resolve_flow, ExecuteError};
use crate::actions::{Action, DeadLetter, OutboxEntry};
use crate::helpdesk::events::{self as hd_events, EventKind, Transcript};
use crate::helpdesk::{DeliveryError, Helpdesk};
use crate::ops::metrics::Metrics;
use crate::store::{Store, StoreError};
use crate::upstream::api::OpenApi;
use crate::upstream::contract::Flow;
use crate::upstream::error::UpstreamError;
use crate::upstream::handle::UpstreamHandle;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Pause before an entry whose outcome could not be recorded is tried again.
const STORE_RETRY_PAUSE: Duration = Duration::from_millis(500);

pub struct ExecutorSettings {
    /// Entries carried out at once (each from a different queue).
    pub concurrency: usize,
    /// Action names whose dead letter halts the rest of its queue until retried or dropped.
    pub blocking: HashSet<String>,
    /// Above this many pending entries `/readyz` reports the outbox as backed up.
    pub max_depth: usize,
}

enum Msg {
    /// Durable entries to run; counted in `in_transit` until they arrive.
    Entries(Vec<OutboxEntry>),
    /// Entries sent through a [`DecidedSender`] that will not come (the writer stopped; they
    /// stay in the outbox and run after the next start).
    Withdrawn(usize),
    /// A blocking dead letter of this queue was retried or dropped.
    Unblock(String),
    /// Re-check (after resume).
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
    /// Entries decided by a fold and on their way here (being flushed).
    in_transit: Arc<AtomicUsize>,
}

/// How the fold hands decided entries on. They count as pending from the moment they are sent,
/// so [`ExecutorHandle::wait_idle`] cannot report idle while entries are still being flushed.
#[derive(Clone)]
pub struct DecidedSender {
    tx: mpsc::UnboundedSender<Vec<OutboxEntry>>,
    in_transit: Arc<AtomicUsize>,
}

impl DecidedSender {
    pub fn send(&self, entries: Vec<OutboxEntry>) {
        let n = entries.len();
        if n == 0 {
            return;
        }
        self.in_transit.fetch_add(n, Ordering::SeqCst);
        if self.tx.send(entries).is_err() {
            self.in_transit.fetch_sub(n, Ordering::SeqCst);
        }
    }
}

impl ExecutorHandle {
    /// The channel a fold sends decided entries into; its receiver goes to
    /// [`forward_decided`](Self::forward_decided).
    pub fn decided_channel(&self) -> (DecidedSender, mpsc::UnboundedReceiver<Vec<OutboxEntry>>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let sender = DecidedSender {
            tx,
            in_transit: self.in_transit.clone(),
        };
        (sender, rx)
    }

    /// Hand newly decided actions (from [`decided_channel`](Self::decided_channel)) to the
    /// executor once their decision is durable. A decision lost in a crash is made again when its
    /// event is folded again, possibly differently (rules may read the clock), so an action must
    /// not run before the fold that decided it is on disk. One task, in fold order, so the
    /// executor sees each queue's entries in decision order.
    pub async fn forward_decided(
        self,
        mut rx: mpsc::UnboundedReceiver<Vec<OutboxEntry>>,
        writer: crate::store::writer::Writer,
    ) {
        while let Some(mut entries) = rx.recv().await {
            while let Ok(more) = rx.try_recv() {
                entries.extend(more);
            }
            // Entries are never dropped here while the writer runs: a later batch of the same
            // conversation must not overtake them, and idle must not be reported without them.
            let mut pause = Duration::from_millis(50);
            loop {
                match writer.flush().await {
                    Ok(()) => {
                        self.notify_decided(entries);
                        break;
                    }
                    Err(crate::store::writer::WriterError::Stopped) => {
                        // Shutting down: they stay in the outbox and run after the next start.
                        self.withdraw_decided(entries.len());
                        return;
                    }
                    Err(e) => {
                        tracing::error!(error = %e, actions = entries.len(), retry_in = ?pause, "cannot make decided actions durable");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_secs(5));
                    }
                }
            }
        }
    }

    /// Hand over entries received from a [`DecidedSender`] (already counted), now durable.
    fn notify_decided(&self, entries: Vec<OutboxEntry>) {
        let n = entries.len();
        if n > 0 && self.tx.send(Msg::Entries(entries)).is_err() {
            self.in_transit.fetch_sub(n, Ordering::SeqCst);
        }
    }

    /// Entries received from a [`DecidedSender`] that will not come (the writer stopped).
    fn withdraw_decided(&self, n: usize) {
        if n > 0 && self.tx.send(Msg::Withdrawn(n)).is_err() {
            self.in_transit.fetch_sub(n, Ordering::SeqCst);
        }
    }

    /// Hand over entries that are durable in the outbox.
    pub fn notify(&self, entries: Vec<OutboxEntry>) {
        self.in_transit.fetch_add(entries.len(), Ordering::SeqCst);
        self.notify_decided(entries);
    }

    /// A dead letter went back to the outbox: run it (and what waited behind it).
    pub fn retried(&self, entry: OutboxEntry) {
        let queue = entry.queue.clone();
        self.notify(vec![entry]);
        let _ = self.tx.send(Msg::Unblock(queue));
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
        let _ = self.tx.send(Msg::Wake);
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

/// Start the executor on the current runtime: it loads the outbox, then runs until `stop`.
pub fn start(
    store: Store,
    api: OpenApi<UpstreamHandle>,
    helpdesk: Arc<Helpdesk>,
    metrics: Metrics,
    settings: ExecutorSettings,
    stop: watch::Receiver<bool>,
) -> Result<(ExecutorHandle, tokio::task::JoinHandle<()>), StoreError> {
    let mut queues = Queues::default();
    for entry in store.outbox()? {
        queues.push(entry);
    }
    let letters = store.dead_letters()?;
    for letter in &letters {
        if letter.blocking {
            queues.blocked.insert(letter.entry.queue.clone());
        }
    }
    metrics.dead_letter_entries.set(letters.len() as i64);
    let (tx, rx) = mpsc::unbounded_channel();
    let (progress_tx, progress) = watch::channel(queues.depth);
    let handle = ExecutorHandle {
        tx,
        paused: Arc::new(AtomicBool::new(false)),
        depth: Arc::new(AtomicUsize::new(queues.depth)),
        max_depth: settings.max_depth,
        progress,
        in_transit: Arc::new(AtomicUsize::new(0)),
    };
    if queues.depth > 0 {
        tracing::info!(pending = queues.depth, "resuming the outbox");
    }
    let runner = Runner {
        store,
        api,
        metrics,
        settings,
        handle: handle.clone(),
        progress: progress_tx,
        flows: Mutex::new(HashMap::new()),
        helpdesk,
        deliveries: Mutex::new(HashMap::new()),
    };
    let task = tokio::spawn(runner.run(queues, rx, stop));
    Ok((handle, task))
}

#[derive(Default)]
struct Queues {
    pending: HashMap<String, BTreeMap<u64, OutboxEntry>>,
    ready: VecDeque<String>,
    busy: HashSet<String>,
    blocked: HashSet<String>,
    /// Queues whose first entry waits for a retry (a help desk was down) until the given time.
    delayed: HashMap<String, Instant>,
    depth: usize,
}

impl Queues {
    fn push(&mut self, entry: OutboxEntry) {
        let queue = entry.queue.clone();
        let entries = self.pending.entry(queue.clone()).or_default();
        let was_empty = entries.is_empty();
        if entries.insert(entry.seq, entry).is_none() {
            self.depth += 1;
        }
        if was_empty
            && !self.busy.contains(&queue)
            && !self.blocked.contains(&queue)
            && !self.delayed.contains_key(&queue)
        {
            self.ready.push_back(queue);
        }
    }

    /// The first entry of the next queue that is neither running nor blocked.
    fn next(&mut self) -> Option<OutboxEntry> {
        while let Some(queue) = self.ready.pop_front() {
            if self.busy.contains(&queue) || self.blocked.contains(&queue) {
                continue;
            }
            let Some(entries) = self.pending.get_mut(&queue) else {
                continue;
            };
            let Some((_, entry)) = entries.pop_first() else {
                self.pending.remove(&queue);
                continue;
            };
            if entries.is_empty() {
                self.pending.remove(&queue);
            }
            self.busy.insert(queue);
            return Some(entry);
        }
        None
    }

    /// The running entry of `queue` finished; `Again` puts it back at the front.
    fn finish(&mut self, queue: String, outcome: Outcome) {
        self.busy.remove(&queue);
        match outcome {
            Outcome::Again(entry) => {
                self.pending
                    .entry(queue.clone())
                    .or_default()
                    .insert(entry.seq, *entry);
            }
            Outcome::Later { entry, at } => {
                self.pending
                    .entry(queue.clone())
                    .or_default()
                    .insert(entry.seq, *entry);
                self.delayed.insert(queue, at);
                return;
            }
            Outcome::Done | Outcome::Dead { blocking: false } => {
                self.depth = self.depth.saturating_sub(1)
            }
            Outcome::Dead { blocking: true } => {
                self.depth = self.depth.saturating_sub(1);
                self.blocked.insert(queue.clone());
            }
        }
        self.requeue(queue);
    }

    fn requeue(&mut self, queue: String) {
        if !self.blocked.contains(&queue)
            && !self.busy.contains(&queue)
            && !self.delayed.contains_key(&queue)
            && self.pending.get(&queue).is_some_and(|q| !q.is_empty())
        {
            self.ready.push_back(queue);
        }
    }

    /// When the next delayed queue is due.
    fn next_wake(&self) -> Option<Instant> {
        self.delayed.values().min().copied()
    }

    /// Delayed queues due at `now` go back in line.
    fn wake_due(&mut self, now: Instant) {
        let due: Vec<String> = self
            .delayed
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(q, _)| q.clone())
            .collect();
        for queue in due {
            self.delayed.remove(&queue);
            self.requeue(queue);
        }
    }

    fn oldest_decided_at(&self) -> Option<i64> {
        self.pending
            .values()
            .filter_map(|q| q.values().next().map(|e| e.decided_at))
            .min()
    }
}

enum Outcome {
    Done,
    Dead {
        blocking: bool,
    },
    /// Not finished (the outcome could not be recorded, or the client stopped): run it again.
    Again(Box<OutboxEntry>),
    /// Not finished (a help desk is down): run it again at `at`, its queue waiting until then.
    Later {
        entry: Box<OutboxEntry>,
        at: Instant,
    },
}

/// A help-desk event between attempts. Kept in memory: after a restart the event is built and
/// sent again under the same `webhook-id`, which the help desk dedupes.
struct Delivery {
    /// The body, built once so every attempt sends the same event.
    body: Option<Arc<Vec<u8>>>,
    /// Endpoints that took it already (not sent to again on a retry).
    delivered: HashSet<String>,
    attempts: u32,
    failures: u32,
    first_attempt_at: i64,
    first_failure_at: Option<i64>,
}

/// How carrying out a help-desk event ended.
enum Step {
    Done,
    Dead { reason: String, error: String },
    Later(Duration),
}

struct Runner {
    store: Store,
    api: OpenApi<UpstreamHandle>,
    metrics: Metrics,
    settings: ExecutorSettings,
    handle: ExecutorHandle,
    progress: watch::Sender<usize>,
    /// Each bot's flow list, for navigations by flow title.
    flows: Mutex<HashMap<String, BotFlows>>,
    helpdesk: Arc<Helpdesk>,
    /// Help-desk events between attempts, by entry id.
    deliveries: Mutex<HashMap<String, Delivery>>,
}

/// A bot's flow list as fetched, with the bot's `events_applied` then: a bot event folded since
/// (`bot.updated`, sent when flows change) makes it stale.
struct BotFlows {
    seen: u64,
    flows: Arc<Vec<Flow>>,
}

impl Runner {
    /// The action as it is called: a navigation by flow title gets its flow id from the bot's
    /// flow list (cached per bot until the fold records a newer event of the bot).
    async fn resolved<'a>(&self, action: &'a Action) -> Result<Cow<'a, Action>, ExecuteError> {
        let Some(bot) = flow_title_bot(action) else {
            return Ok(Cow::Borrowed(action));
        };
        let Some(bot) = bot else {
            return resolve_flow(action, &[]).map(Cow::Owned);
        };
        // A store that cannot be read leaves the cache alone: the list is fetched for this call.
        let seen = match self.store.bot(bot.as_str()) {
            Ok(state) => Some(state.map_or(0, |b| b.events_applied)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the bot's state; fetching its flows");
                None
            }
        };
        let cached = seen.and_then(|seen| {
            let flows = self.flows.lock().unwrap_or_else(|e| e.into_inner());
            flows
                .get(bot.as_str())
                .filter(|cached| cached.seen == seen)
                .map(|cached| cached.flows.clone())
        });
        let list = match cached {
            Some(list) => list,
            None => {
                let list = Arc::new(self.api.list_flows(bot.as_str()).await?.data);
                if let Some(seen) = seen {
                    let fetched = BotFlows {
                        seen,
                        flows: list.clone(),
                    };
                    self.flows
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(bot.as_str().to_owned(), fetched);
                }
                list
            }
        };
        resolve_flow(action, &list).map(Cow::Owned)
    }

    async fn run(
        self,
        mut queues: Queues,
        mut rx: mpsc::UnboundedReceiver<Msg>,
        mut stop: watch::Receiver<bool>,
    ) {
        let runner = Arc::new(self);
        let mut inflight: JoinSet<(String, Outcome)> = JoinSet::new();
        loop {
            if *stop.borrow() {
                break;
            }
            while !runner.handle.is_paused() && inflight.len() < runner.settings.concurrency.max(1)
            {
                let Some(entry) = queues.next() else {
                    break;
                };
                let runner = runner.clone();
                let span = tracing::info_span!("action", action_id = %entry.id, event_id = %entry.event_id, queue = %entry.queue, action = entry.action.name());
                inflight.spawn(tracing::Instrument::instrument(
                    async move { runner.carry_out(entry).await },
                    span,
                ));
            }
            let mut arrived = 0;
            let wake = queues.next_wake();
            tokio::select! {
                _ = sleep_until(wake), if wake.is_some() => queues.wake_due(Instant::now()),
                msg = rx.recv() => match msg {
                    Some(Msg::Entries(entries)) => {
                        arrived = entries.len();
                        for e in entries {
                            queues.push(e);
                        }
                    }
                    Some(Msg::Withdrawn(n)) => arrived = n,
                    Some(Msg::Unblock(queue)) => {
                        queues.blocked.remove(&queue);
                        queues.requeue(queue);
                    }
                    Some(Msg::Wake) => {}
                    None => break,
                },
                Some(joined) = inflight.join_next(), if !inflight.is_empty() => match joined {
                    Ok((queue, outcome)) => queues.finish(queue, outcome),
                    Err(e) => tracing::error!(error = %e, "action task failed"),
                },
                _ = stop.changed() => {}
            }
            runner.publish(&queues);
            if arrived > 0 {
                // After the publish, so a waiter never sees neither the entries nor their transit.
                runner
                    .handle
                    .in_transit
                    .fetch_sub(arrived, Ordering::SeqCst);
                runner.progress.send_modify(|_| {});
            }
        }
        // Shutdown: calls in flight finish (bounded by the client's timeouts); queued entries stay
        // in the outbox for the next start.
        while let Some(joined) = inflight.join_next().await {
            if let Ok((queue, outcome)) = joined {
                queues.finish(queue, outcome);
            }
        }
        runner.publish(&queues);
        tracing::info!(left_in_outbox = queues.depth, "executor stopped");
    }

    fn publish(&self, queues: &Queues) {
        self.handle.depth.store(queues.depth, Ordering::SeqCst);
        self.metrics.outbox_depth.set(queues.depth as i64);
        let age = queues.oldest_decided_at().map_or(0.0, |at| {
            (crate::clock::now_millis() - at).max(0) as f64 / 1000.0
        });
        self.metrics.outbox_oldest_seconds.set(age);
        self.progress.send_if_modified(|d| {
            let changed = *d != queues.depth;
            *d = queues.depth;
            changed
        });
    }

    /// Make the call and record the outcome. Returns the entry when it must run again.
    async fn carry_out(self: Arc<Self>, entry: OutboxEntry) -> (String, Outcome) {
        if matches!(entry.action, Action::NotifyHelpdesk { .. }) {
            return self.notify_helpdesk(entry).await;
        }
        let queue = entry.queue.clone();
        let first_attempt_at = crate::clock::now_millis();
        let result = match self.resolved(&entry.action).await {
            Ok(action) => execute(&self.api, &action, entry.key()).await,
            Err(e) => Err(e),
        };
        let now = crate::clock::now_millis();
        let name = entry.action.name();
        let (status, failure) = match &result {
            Ok(_) => ("ok".to_owned(), None),
            Err(e) => classify(e),
        };
        self.metrics
            .action_attempts
            .with_label_values(&[name, &status])
            .inc();
        match (result, failure) {
            (Ok(_), _) => {
                self.metrics
                    .action_latency_seconds
                    .observe((now - entry.received_at).max(0) as f64 / 1000.0);
                tracing::info!("action carried out");
                self.record_done(entry, 1, now).await
            }
            // The client stopped (shutdown): leave the entry for the next start.
            (Err(_), None) => (queue, Outcome::Again(Box::new(entry))),
            (Err(e), Some(reason)) => {
                let blocking = self.settings.blocking.contains(name);
                tracing::warn!(reason = %reason, error = %e, blocking, "action failed; moved to dead letters");
                let letter = DeadLetter {
                    entry,
                    reason,
                    error: e.to_string(),
                    attempts: 1,
                    first_attempt_at,
                    last_attempt_at: now,
                    blocking,
                    answered: refused_for_good(&e),
                };
                self.record_dead(letter).await
            }
        }
    }

    async fn record_done(&self, entry: OutboxEntry, attempts: u32, now: i64) -> (String, Outcome) {
        let store = self.store.clone();
        let e = entry.clone();
        let recorded = tokio::task::spawn_blocking(move || {
            store.outbox_done(&e, attempts, now).map(|()| Outcome::Done)
        })
        .await;
        self.recorded(entry, recorded).await
    }

    async fn record_dead(&self, letter: DeadLetter) -> (String, Outcome) {
        let store = self.store.clone();
        let metrics = self.metrics.clone();
        let entry = letter.entry.clone();
        let blocking = letter.blocking;
        let recorded = tokio::task::spawn_blocking(move || {
            store.outbox_dead(&letter).map(|()| {
                metrics
                    .dead_letters
                    .with_label_values(&[&letter.reason])
                    .inc();
                metrics.dead_letter_entries.inc();
                Outcome::Dead { blocking }
            })
        })
        .await;
        self.recorded(entry, recorded).await
    }

    /// The outcome once recorded; an entry whose outcome could not be recorded runs again.
    async fn recorded(
        &self,
        entry: OutboxEntry,
        recorded: Result<Result<Outcome, StoreError>, tokio::task::JoinError>,
    ) -> (String, Outcome) {
        let queue = entry.queue.clone();
        match recorded {
            Ok(Ok(outcome)) => (queue, outcome),
            Ok(Err(e)) => {
                tracing::error!(error = %e, "cannot record the action's outcome; it will run again");
                tokio::time::sleep(STORE_RETRY_PAUSE).await;
                (queue, Outcome::Again(Box::new(entry)))
            }
            Err(e) => {
                tracing::error!(error = %e, "recording the action's outcome failed");
                (queue, Outcome::Again(Box::new(entry)))
            }
        }
    }

    /// A help-desk event: built once, signed and POSTed to every endpoint that takes its kind,
    /// and tried again later (its queue waiting, no executor slot held) while one is down.
    async fn notify_helpdesk(self: Arc<Self>, entry: OutboxEntry) -> (String, Outcome) {
        let queue = entry.queue.clone();
        // Real time: the help desk checks the signature's timestamp against its own clock, and
        // the give-up time is a promise about real hours.
        let now = crate::clock::system_millis();
        let taken = self
            .deliveries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&entry.id);
        let mut delivery = taken.unwrap_or_else(|| Delivery {
            body: None,
            delivered: HashSet::new(),
            attempts: 0,
            failures: 0,
            first_attempt_at: now,
            first_failure_at: None,
        });
        delivery.attempts += 1;
        let (step, status) = self.deliver(&entry, &mut delivery, now).await;
        self.metrics
            .action_attempts
            .with_label_values(&["notify_helpdesk", &status])
            .inc();
        match step {
            Step::Done => {
                if status == "ok" {
                    self.metrics
                        .action_latency_seconds
                        .observe((now - entry.received_at).max(0) as f64 / 1000.0);
                }
                self.record_done(entry, delivery.attempts, now).await
            }
            Step::Dead { reason, error } => {
                let blocking = self.settings.blocking.contains("notify_helpdesk");
                tracing::warn!(reason = %reason, error = %error, blocking, "help-desk event failed; moved to dead letters");
                let letter = DeadLetter {
                    entry,
                    reason,
                    error,
                    attempts: delivery.attempts,
                    first_attempt_at: delivery.first_attempt_at,
                    last_attempt_at: now,
                    blocking,
                    // The help desk keeps no answer under the id: a retry keeps it, so a help
                    // desk that took it from another attempt still dedupes.
                    answered: false,
                };
                self.record_dead(letter).await
            }
            Step::Later(wait) => {
                self.deliveries
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(entry.id.clone(), delivery);
                let at = Instant::now() + wait;
                (
                    queue,
                    Outcome::Later {
                        entry: Box::new(entry),
                        at,
                    },
                )
            }
        }
    }

    /// One attempt at a help-desk event; with the metric status of the attempt.
    async fn deliver(&self, entry: &OutboxEntry, d: &mut Delivery, now: i64) -> (Step, String) {
        let dead = |reason: &str, error: String| {
            (
                Step::Dead {
                    reason: reason.to_owned(),
                    error,
                },
                reason.to_owned(),
            )
        };
        let Action::NotifyHelpdesk {
            conversation_id,
            kind,
            reason,
            payload,
        } = &entry.action
        else {
            return dead("invalid_call", "not a help-desk event".into());
        };
        if EventKind::parse(kind).is_none() {
            // Rules refuse unknown kinds at load; this is an entry from an older rule set.
            return dead(
                "unknown_event_kind",
                format!(
                    "`{kind}` is not a help-desk event kind ({})",
                    EventKind::names()
                ),
            );
        }
        if !self.helpdesk.is_configured() {
            tracing::debug!(kind = %kind, "no help desk configured; the event is recorded as done");
            return (Step::Done, "no_helpdesk".into());
        }
        let targets: Vec<String> = self
            .helpdesk
            .targets(kind)
            .into_iter()
            .filter(|name| !d.delivered.contains(*name))
            .map(str::to_owned)
            .collect();
        if targets.is_empty() {
            if d.delivered.is_empty() {
                tracing::debug!(kind = %kind, "no help-desk endpoint takes this kind; recorded as done");
                return (Step::Done, "no_endpoint".into());
            }
            return (Step::Done, "ok".into());
        }
        let body = match &d.body {
            Some(body) => body.clone(),
            None => {
                let built = self
                    .helpdesk_body(entry, conversation_id, kind, reason.as_deref(), payload)
                    .await;
                let Some(built) = built else {
                    return (Step::Done, "skipped".into());
                };
                let built = Arc::new(built);
                d.body = Some(built.clone());
                built
            }
        };
        let timestamp = now.div_euclid(1000);
        let mut refused = None;
        let mut unavailable = None;
        for name in &targets {
            let result = self
                .helpdesk
                .post(name, entry.key(), &body, timestamp)
                .await;
            let outcome = match &result {
                Ok(()) => "delivered".to_owned(),
                Err(e) => e.outcome(),
            };
            self.metrics
                .helpdesk_deliveries
                .with_label_values(&[name, &outcome])
                .inc();
            match result {
                Ok(()) => {
                    tracing::info!(endpoint = %name, kind = %kind, "help-desk event delivered");
                    d.delivered.insert(name.clone());
                }
                Err(e @ DeliveryError::Refused { .. }) => {
                    refused.get_or_insert(e);
                }
                Err(e) => {
                    unavailable.get_or_insert(e);
                }
            }
        }
        if let Some(e) = refused {
            return dead(&format!("helpdesk_{}", e.outcome()), e.to_string());
        }
        let Some(e) = unavailable else {
            return (Step::Done, "ok".into());
        };
        d.failures += 1;
        let first_failure = *d.first_failure_at.get_or_insert(now);
        let give_up = self.helpdesk.give_up_after();
        let failing_for = Duration::from_millis(u64::try_from(now - first_failure).unwrap_or(0));
        if failing_for >= give_up {
            // A help desk whose certificate never verified says so in the reason.
            let reason = match &e {
                DeliveryError::Tls { failure, .. } => format!("tls_{}", failure.reason.label()),
                _ => "retries_exhausted".to_owned(),
            };
            return dead(
                &reason,
                format!(
                    "{e}; gave up after {} of failed attempts",
                    humantime::format_duration(give_up)
                ),
            );
        }
        let retry_after = match &e {
            DeliveryError::Unavailable { retry_after, .. } => *retry_after,
            DeliveryError::Refused { .. } | DeliveryError::Tls { .. } => None,
        };
        let wait = self
            .helpdesk
            .backoff(d.failures, retry_after, &mut rand::rng())
            // The last attempt comes at the give-up time, not a whole backoff past it.
            .min(give_up - failing_for)
            .max(Duration::from_millis(1));
        // Warned once per event; the attempts after it (up to a day of them) are counted in the
        // metrics and logged at debug.
        if d.failures == 1 {
            tracing::warn!(error = %e, retry_in = ?wait, "help desk unavailable; the event and its conversation's next ones wait");
        } else {
            tracing::debug!(error = %e, failures = d.failures, retry_in = ?wait, "help desk still unavailable");
        }
        (Step::Later(wait), e.outcome())
    }

    /// The event's JSON body, from the conversation's state, the source event and (for
    /// `handoff.requested`) the transcript and queue standing. `None`: not to be sent (a bot's
    /// message while `helpdesk.bot_messages` is off).
    async fn helpdesk_body(
        &self,
        entry: &OutboxEntry,
        conversation_id: &crate::ids::ConversationId,
        kind: &str,
        reason: Option<&str>,
        payload: &serde_json::Value,
    ) -> Option<Vec<u8>> {
        // A state that cannot be read leaves its part out: the help desk still learns of the
        // event, which matters more than its details.
        let conversation = self
            .store
            .conversation(conversation_id)
            .inspect_err(|e| tracing::warn!(error = %e, "cannot read the conversation's state for a help-desk event"))
            .ok()
            .flatten();
        let mut end_user = conversation
            .as_ref()
            .and_then(|c| c.end_user_id.as_ref())
            .and_then(|id| self.store.end_user(id).ok().flatten());
        let requested = kind == EventKind::HandoffRequested.as_str();
        let mut conversation = conversation;
        if requested {
            self.complete_from_api(conversation_id, &mut conversation, &mut end_user)
                .await;
        }
        let mut message = None;
        if kind == EventKind::ConversationMessage.as_str() {
            if let Some(m) = self.source_message(entry) {
                if m.sender() == crate::webhook::model::Sender::Bot && !self.helpdesk.bot_messages {
                    tracing::debug!("a bot message; helpdesk.bot_messages is off");
                    return None;
                }
                message = Some(hd_events::message(&m));
            }
        }
        let (transcript, queue) = if requested {
            (
                Some(self.transcript(conversation_id).await),
                Some(self.helpdesk.queue.queue_info(conversation_id)),
            )
        } else {
            (None, None)
        };
        let source = hd_events::Source {
            kind,
            occurred_at: entry.received_at,
            conversation_id,
            conversation: conversation.as_ref(),
            end_user: end_user.as_ref(),
            event_id: entry.event_id.as_str(),
            rule: &entry.rule,
            action_id: &entry.id,
            reason,
            payload,
            message,
            transcript,
            queue,
        };
        serde_json::to_vec(&hd_events::body(&source)).ok()
    }

    /// The context packet needs who the user is, which the state lacks when the bridge has seen
    /// only messages of the conversation: what is missing is read through the Open API (a
    /// failure leaves it out).
    async fn complete_from_api(
        &self,
        conversation_id: &crate::ids::ConversationId,
        conversation: &mut Option<crate::state::ConversationState>,
        end_user: &mut Option<crate::state::EndUserState>,
    ) {
        let known = conversation
            .as_ref()
            .is_some_and(|c| c.platform.is_some() && c.user_key.is_some());
        if !known {
            match self.api.get_conversation(conversation_id.as_str()).await {
                Ok(fetched) => {
                    let state = conversation.get_or_insert_with(|| {
                        crate::state::ConversationState::new(conversation_id.clone())
                    });
                    state.bot_id = state.bot_id.take().or(fetched.bot_id);
                    state.end_user_id = state.end_user_id.take().or(fetched.end_user_id);
                    state.platform = state.platform.take().or(fetched.platform);
                    state.user_key = state.user_key.take().or(fetched.user_key);
                    if state.params.value.is_empty() {
                        state.params.value = fetched.params.unwrap_or_default();
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the conversation for a help-desk event")
                }
            }
        }
        if end_user.is_some() {
            return;
        }
        let Some(id) = conversation.as_ref().and_then(|c| c.end_user_id.clone()) else {
            return;
        };
        match self.api.get_end_user(id.as_str()).await {
            Ok(fetched) => {
                let mut state = crate::state::EndUserState::new(id);
                state.bot_id = fetched.bot_id;
                state.platform = Some(fetched.platform);
                state.user_key = Some(fetched.user_key);
                state.params.value = fetched.params.unwrap_or_default();
                *end_user = Some(state);
            }
            Err(e) => tracing::warn!(error = %e, "cannot read the end user for a help-desk event"),
        }
    }

    /// The message of the webhook event that decided the entry, if it was a message event.
    fn source_message(&self, entry: &OutboxEntry) -> Option<crate::webhook::model::Message> {
        let record = self.store.event_by_id(&entry.event_id).ok().flatten()?;
        if !record.kind.starts_with("bot.message.") {
            return None;
        }
        let mut event: serde_json::Value = serde_json::from_str(record.event.get()).ok()?;
        let message = event.get_mut("data")?.get_mut("message")?.take();
        serde_json::from_value(message).ok()
    }

    /// The conversation's last `helpdesk.transcript_messages` messages, oldest first. The Open
    /// API lists oldest first, so past one page the last page is asked for by offset.
    async fn transcript(&self, conversation_id: &crate::ids::ConversationId) -> Transcript {
        use crate::upstream::contract::{MessagesQuery, PageQuery};
        let n = self.helpdesk.transcript_messages;
        if n == 0 {
            return Transcript {
                messages: Vec::new(),
                complete: true,
            };
        }
        let query = |offset: Option<u32>| MessagesQuery {
            page: PageQuery {
                offset,
                limit: Some(n),
            },
            conversation_id: Some(conversation_id.as_str().to_owned()),
            ..MessagesQuery::default()
        };
        let messages = |page: &crate::upstream::contract::Page<crate::webhook::model::Message>| {
            page.data.iter().map(hd_events::message).collect::<Vec<_>>()
        };
        let first = match self.api.list_messages(&query(None)).await {
            Ok(page) => page,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the transcript for a help-desk event");
                return Transcript::default();
            }
        };
        let total = first.paging.total;
        if total <= u64::from(n) {
            return Transcript {
                messages: messages(&first),
                complete: true,
            };
        }
        let offset = u32::try_from(total - u64::from(n)).unwrap_or(u32::MAX);
        match self.api.list_messages(&query(Some(offset))).await {
            Ok(last) => Transcript {
                messages: messages(&last),
                complete: true,
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the end of the transcript for a help-desk event");
                Transcript {
                    messages: Vec::new(),
                    complete: false,
                }
            }
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The upstream refused with a permanent error status. Only that proves nothing took effect: a
/// retryable status (or a timeout) may follow an attempt that did, whose answer the upstream
/// keeps under the key.
fn refused_for_good(e: &ExecuteError) -> bool {
    matches!(e, ExecuteError::Upstream(u @ UpstreamError::Status { .. }) if !u.is_retryable())
}

/// The metric status of a failed attempt, and its dead-letter reason (`None`: not a failure of
/// the action, run it again later).
fn classify(e: &ExecuteError) -> (String, Option<String>) {
    match e {
        ExecuteError::NotUpstream(_) => ("no_helpdesk".into(), Some("no_helpdesk".into())),
        ExecuteError::UnknownFlow { .. } => ("unknown_flow".into(), Some("unknown_flow".into())),
        ExecuteError::Upstream(u) => match u {
            UpstreamError::Stopped => ("stopped".into(), None),
            UpstreamError::Status { status, code, .. } => {
                let label = format!("http_{status}");
                if u.is_retryable() {
                    (label, Some("retries_exhausted".into()))
                } else if code.is_empty() || code.starts_with("http_") {
                    (label.clone(), Some(label))
                } else {
                    (label, Some(code.clone()))
                }
            }
            UpstreamError::Connect(_) => ("connect".into(), Some("retries_exhausted".into())),
            // Retried by the client like a refused connection; the reason names why.
            UpstreamError::Tls(f) => ("tls".into(), Some(format!("tls_{}", f.reason.label()))),
            UpstreamError::Timeout => ("timeout".into(), Some("retries_exhausted".into())),
            UpstreamError::Transport(_) => ("transport".into(), Some("retries_exhausted".into())),
            UpstreamError::Decode(_) => ("bad_answer".into(), Some("bad_answer".into())),
            UpstreamError::InvalidCall(_) => ("invalid_call".into(), Some("invalid_call".into())),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actions::Action;
    use crate::ids::{ConversationId, EventId};

    fn entry(seq: u64, queue: &str) -> OutboxEntry {
        OutboxEntry {
            seq,
            id: format!("e{seq}/r/0"),
            queue: queue.into(),
            event_id: EventId::new(format!("e{seq}")),
            rule: "r".into(),
            action: Action::SetManual {
                conversation_id: ConversationId::new(queue),
                enabled: true,
            },
            received_at: 0,
            decided_at: seq as i64,
            rules_version: String::new(),
            idempotency_key: None,
        }
    }

    #[test]
    fn one_entry_per_queue_runs_at_a_time_in_order() {
        let mut q = Queues::default();
        q.push(entry(2, "a"));
        q.push(entry(1, "a"));
        q.push(entry(3, "b"));
        assert_eq!(q.next().map(|e| e.seq), Some(1));
        assert_eq!(q.next().map(|e| e.seq), Some(3));
        assert!(q.next().is_none(), "a's next waits for a's first");
        q.finish("a".into(), Outcome::Done);
        assert_eq!(q.next().map(|e| e.seq), Some(2));
        assert_eq!(q.depth, 2);
        assert_eq!(q.oldest_decided_at(), None, "everything left is running");
    }

    #[test]
    fn a_blocking_dead_letter_halts_its_queue_until_unblocked() {
        let mut q = Queues::default();
        q.push(entry(1, "a"));
        q.push(entry(2, "a"));
        q.push(entry(3, "b"));
        let first = q.next().expect("a1");
        q.finish(first.queue.clone(), Outcome::Dead { blocking: true });
        assert_eq!(q.next().map(|e| e.seq), Some(3), "b goes on");
        assert!(q.next().is_none(), "a is blocked");
        q.blocked.remove("a");
        q.requeue("a".into());
        assert_eq!(q.next().map(|e| e.seq), Some(2));
    }

    #[test]
    fn an_entry_that_must_run_again_keeps_its_place() {
        let mut q = Queues::default();
        q.push(entry(1, "a"));
        q.push(entry(2, "a"));
        let first = q.next().expect("a1");
        q.finish("a".into(), Outcome::Again(Box::new(first)));
        assert_eq!(q.next().map(|e| e.seq), Some(1));
        assert_eq!(q.depth, 2);
    }

    #[test]
    fn a_delayed_queue_waits_until_due_while_others_go_on() {
        let mut q = Queues::default();
        q.push(entry(1, "helpdesk:a"));
        q.push(entry(2, "helpdesk:a"));
        q.push(entry(3, "a"));
        let first = q.next().expect("helpdesk:a 1");
        assert_eq!(first.seq, 1);
        let at = Instant::now() + Duration::from_secs(60);
        q.finish(
            "helpdesk:a".into(),
            Outcome::Later {
                entry: Box::new(first),
                at,
            },
        );
        assert_eq!(
            q.next().map(|e| e.seq),
            Some(3),
            "the conversation's queue goes on"
        );
        q.push(entry(4, "helpdesk:a"));
        assert!(
            q.next().is_none(),
            "the delayed queue waits, new entries too"
        );
        assert_eq!(q.next_wake(), Some(at));
        q.wake_due(at - Duration::from_secs(1));
        assert!(q.next().is_none(), "not yet due");
        q.wake_due(at);
        assert_eq!(q.next().map(|e| e.seq), Some(1), "the same entry first");
        assert_eq!(q.next_wake(), None);
        assert_eq!(q.depth, 4, "nothing was lost");
    }

    #[test]
    fn failures_are_classified_into_stable_reasons() {
        let status = |s: u16, code: &str| {
            ExecuteError::Upstream(UpstreamError::Status {
                status: s,
                code: code.into(),
                message: String::new(),
                body: String::new(),
                retry_after: None,
            })
        };
        assert_eq!(
            classify(&status(404, "not_found")).1.as_deref(),
            Some("not_found")
        );
        assert_eq!(
            classify(&status(400, "http_400")).1.as_deref(),
            Some("http_400")
        );
        assert_eq!(
            classify(&status(503, "x")).1.as_deref(),
            Some("retries_exhausted")
        );
        assert_eq!(
            classify(&ExecuteError::Upstream(UpstreamError::Stopped)).1,
            None
        );
        // Only a permanent refusal may be retried under a fresh key.
        assert!(refused_for_good(&status(409, "conflict")));
        assert!(refused_for_good(&status(400, "http_400")));
        assert!(
            !refused_for_good(&status(503, "x")),
            "an earlier attempt may have worked"
        );
        assert!(!refused_for_good(&status(429, "x")));
        assert!(!refused_for_good(&ExecuteError::Upstream(
            UpstreamError::Timeout
        )));
        // A handshake that never verified: retried by the client, then a dead letter that says
        // why; never "refused for good" (nothing was sent, the key stays).
        let tls = ExecuteError::Upstream(UpstreamError::Tls(crate::tls::TlsFailure {
            reason: crate::tls::TlsReason::NameMismatch,
            detail: "invalid peer certificate: NotValidForName".into(),
        }));
        assert_eq!(
            classify(&tls),
            ("tls".to_owned(), Some("tls_name_mismatch".to_owned()))
        );
        assert!(!refused_for_good(&tls));
        assert_eq!(
            classify(&ExecuteError::NotUpstream("notify_helpdesk"))
                .1
                .as_deref(),
            Some("no_helpdesk")
        );
        let unknown = ExecuteError::UnknownFlow {
            bot: "B1".into(),
            title: "Nowhere".into(),
        };
        assert_eq!(classify(&unknown).1.as_deref(), Some("unknown_flow"));
        assert!(!refused_for_good(&unknown), "nothing was called");
    }
}
