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
                    Err(e) if e == crate::store::writer::WRITER_STOPPED => {
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
        if was_empty && !self.busy.contains(&queue) && !self.blocked.contains(&queue) {
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
            && self.pending.get(&queue).is_some_and(|q| !q.is_empty())
        {
            self.ready.push_back(queue);
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
            tokio::select! {
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
        let store = self.store.clone();
        let recorded = match (result, failure) {
            (Ok(_), _) => {
                self.metrics
                    .action_latency_seconds
                    .observe((now - entry.received_at).max(0) as f64 / 1000.0);
                tracing::info!("action carried out");
                let e = entry.clone();
                tokio::task::spawn_blocking(move || {
                    store.outbox_done(&e, 1, now).map(|()| Outcome::Done)
                })
                .await
            }
            (Err(_), None) => {
                // The client stopped (shutdown): leave the entry for the next start.
                return (queue, Outcome::Again(Box::new(entry)));
            }
            (Err(e), Some(reason)) => {
                let blocking = self.settings.blocking.contains(name);
                tracing::warn!(reason = %reason, error = %e, blocking, "action failed; moved to dead letters");
                let letter = DeadLetter {
                    entry: entry.clone(),
                    reason: reason.clone(),
                    error: e.to_string(),
                    attempts: 1,
                    first_attempt_at,
                    last_attempt_at: now,
                    blocking,
                    answered: refused_for_good(&e),
                };
                let metrics = self.metrics.clone();
                tokio::task::spawn_blocking(move || {
                    store.outbox_dead(&letter).map(|()| {
                        metrics.dead_letters.with_label_values(&[&reason]).inc();
                        metrics.dead_letter_entries.inc();
                        Outcome::Dead { blocking }
                    })
                })
                .await
            }
        };
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
