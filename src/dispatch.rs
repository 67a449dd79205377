//! The dispatcher: folds inbox events into state, in order within a partition (a conversation,
//! end user or bot) and in parallel across partitions, with bounded concurrency.
//!
//! The inbox in sled is the dispatcher's position: an event leaves it in the same transaction that
//! folds it. The in-memory queues are only a cache of the inbox, rebuilt from it on start, so a
//! crash or shutdown at any point loses nothing and repeats nothing.
//!
//! Sled runs one transaction at a time (a global lock), so a job is not one partition but the next
//! batches of many ready partitions, folded in one transaction. Events arrive typed from intake
//! and are only read back from the store after a restart (or when the backlog is too large to
//! keep them in memory).
//!
//! Folds run on the dispatcher's own threads (`fold-N`), at `dispatch.fold_niceness` (19 by
//! default): they are never on an acknowledgment's path, so they yield the CPU to intake.

use crate::ids::PartitionKey;
use crate::ops::metrics::Metrics;
use crate::store::{NewEvent, QuarantineRecord, Store};
use crate::webhook::model::{Event, Millis};
use futures_util::stream::{FuturesUnordered, StreamExt};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};

/// Pause before a partition whose batch failed is tried again (the store is likely in trouble).
const RETRY_PAUSE: Duration = Duration::from_millis(500);

/// Beyond this many queued events, new ones are queued without their typed form (and read back
/// from the store when their turn comes), so a backlog does not grow memory without bound.
const MAX_EVENTS_IN_MEMORY: usize = 10_000;

/// An inbox entry as queued: the typed event when intake handed it over.
type Entry = Option<Box<(Millis, Event)>>;

/// Sends newly durable inbox entries to the dispatcher.
#[derive(Clone)]
pub struct DispatchHandle {
    tx: mpsc::UnboundedSender<Vec<NewEvent>>,
    /// Changes whenever the dispatcher's queue depth changes.
    progress: watch::Receiver<usize>,
    /// True while an operator holds folding back (`POST /admin/v1/dispatch/pause`).
    paused: std::sync::Arc<watch::Sender<bool>>,
}

impl DispatchHandle {
    /// Hold folding back: events are still accepted, made durable and queued (the inbox keeps
    /// them), but no new batch starts; batches in flight finish. For an operator who needs the
    /// state to stand still (and for tests of what waits on a fold). Not kept across restarts.
    pub fn pause(&self) {
        self.paused.send_replace(true);
    }

    /// Fold again, from where the inbox stands.
    pub fn resume(&self) {
        self.paused.send_replace(false);
    }

    pub fn is_paused(&self) -> bool {
        *self.paused.borrow()
    }

    /// Hand over newly durable events with their typed form.
    pub fn notify_events(&self, events: Vec<NewEvent>) {
        if !events.is_empty() {
            let _ = self.tx.send(events);
        }
    }

    /// Wait until everything accepted so far is folded (indexed, and out of the inbox), or the
    /// timeout passes. Returns whether it drained. Woken by dispatcher progress, not polling.
    pub async fn wait_drained(
        &self,
        store: &Store,
        timeout: Duration,
    ) -> Result<bool, crate::store::StoreError> {
        let mut progress = self.progress.clone();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // Queue depth reaches 0 only after the batch's bookkeeping (metrics) is done.
            let idle = *progress.borrow_and_update() == 0;
            if idle && store.all_indexed() && store.inbox_is_empty()? {
                return Ok(true);
            }
            match tokio::time::timeout_at(deadline, progress.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return Ok(store.all_indexed() && store.inbox_is_empty()?),
            }
        }
    }
}

pub struct DispatchSettings {
    /// Fold transactions in flight at once.
    pub concurrency: usize,
    /// Events per fold transaction (across partitions).
    pub batch_size: usize,
    /// Decides actions for each folded event.
    /// The rules in force; each job takes the current set once, so a reload never splits a batch.
    pub rules: crate::rules::live::LiveRules,
    /// Receives the outbox entries of each committed fold, in fold order.
    pub decided: Option<crate::outbox::DecidedSender>,
    /// Agent API calls waiting for their command's verdict.
    pub verdicts: Option<std::sync::Arc<crate::helpdesk::commands::Waiters>>,
    /// Nice value of the fold threads (0: the daemon's own).
    pub niceness: u8,
}

/// Start the dispatcher on the current runtime. It recovers the inbox, then runs until `stop`
/// turns true; it then finishes the batches in flight and returns.
pub fn start(
    store: Store,
    metrics: Metrics,
    settings: DispatchSettings,
    stop: watch::Receiver<bool>,
) -> Result<(DispatchHandle, tokio::task::JoinHandle<()>), crate::store::StoreError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let (progress_tx, progress) = watch::channel(0);
    let (paused_tx, paused) = watch::channel(false);
    let mut queues = Queues::default();
    for (seq, partition) in store.pending()? {
        queues.push(partition, seq, None);
    }
    metrics.inbox_depth.set(queues.depth as i64);
    if queues.depth > 0 {
        tracing::info!(pending = queues.depth, "resuming inbox");
    }
    let inputs = Inputs {
        typed: rx,
        open: true,
        paused,
    };
    let niceness = settings.niceness;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(settings.concurrency.max(1))
        .thread_name(|i| format!("fold-{i}"))
        .start_handler(move |_| crate::background::lower_this_thread(niceness))
        .panic_handler(|_| tracing::error!("a fold panicked; its partitions stay queued"))
        .build()
        .map_err(|e| {
            crate::store::StoreError::Internal(format!("cannot start fold threads: {e}"))
        })?;
    let workers = Workers {
        store,
        metrics,
        pool,
    };
    let task = tokio::spawn(run(workers, settings, queues, inputs, stop, progress_tx));
    let handle = DispatchHandle {
        tx,
        progress,
        paused: std::sync::Arc::new(paused_tx),
    };
    Ok((handle, task))
}

#[derive(Default)]
struct Queues {
    pending: HashMap<PartitionKey, BTreeMap<u64, Entry>>,
    ready: VecDeque<PartitionKey>,
    busy: HashSet<PartitionKey>,
    depth: usize,
}

/// One fold job: the next batch of each of several partitions.
type Job = Vec<(PartitionKey, Vec<(u64, Entry)>)>;

impl Queues {
    fn push(&mut self, partition: PartitionKey, seq: u64, entry: Entry) {
        let queue = self.pending.entry(partition.clone()).or_default();
        let was_empty = queue.is_empty();
        if queue.insert(seq, entry).is_none() {
            self.depth += 1;
        }
        if was_empty && !self.busy.contains(&partition) {
            self.ready.push_back(partition);
        }
    }

    /// Take up to `max` events from partitions that are not being processed, oldest partition
    /// first, each partition's events in order.
    fn next_job(&mut self, max: usize) -> Option<Job> {
        let mut job = Vec::new();
        let mut taken = 0;
        while taken < max {
            let Some(partition) = self.ready.pop_front() else {
                break;
            };
            let Some(queue) = self.pending.get_mut(&partition) else {
                continue;
            };
            let mut batch = Vec::new();
            while taken < max {
                let Some(first) = queue.pop_first() else {
                    break;
                };
                batch.push(first);
                taken += 1;
            }
            if queue.is_empty() {
                self.pending.remove(&partition);
            }
            self.busy.insert(partition.clone());
            job.push((partition, batch));
        }
        (!job.is_empty()).then_some(job)
    }

    /// A partition's batch finished: `failed` entries go back to the front of their queue.
    fn finish(&mut self, partition: PartitionKey, done: usize, failed: Vec<u64>) {
        self.busy.remove(&partition);
        self.depth = self.depth.saturating_sub(done);
        if !failed.is_empty() {
            let queue = self.pending.entry(partition.clone()).or_default();
            queue.extend(failed.into_iter().map(|seq| (seq, None)));
        }
        if self.pending.get(&partition).is_some_and(|q| !q.is_empty()) {
            self.ready.push_back(partition);
        }
        self.release_drained();
    }

    /// Give back the tables a burst grew once everything is folded: a map and a deque sized for
    /// every partition of the burst (about 12 MB for 100,000 conversations) never shrink by
    /// themselves, and an idle daemon would keep them.
    fn release_drained(&mut self) {
        if self.pending.is_empty() && self.pending.capacity() > KEEP_CAPACITY {
            self.pending = HashMap::new();
        }
        if self.ready.is_empty() && self.ready.capacity() > KEEP_CAPACITY {
            self.ready = VecDeque::new();
        }
        if self.busy.is_empty() && self.busy.capacity() > KEEP_CAPACITY {
            self.busy = HashSet::new();
        }
    }
}

/// Capacity the dispatcher's tables keep when empty (see [`Queues::release_drained`]).
const KEEP_CAPACITY: usize = 1024;

/// Per partition of a job: how many entries left the inbox, and which must be tried again.
type JobResult = Vec<(PartitionKey, usize, Vec<u64>)>;

struct Inputs {
    typed: mpsc::UnboundedReceiver<Vec<NewEvent>>,
    open: bool,
    paused: watch::Receiver<bool>,
}

/// What folds run with.
struct Workers {
    store: Store,
    metrics: Metrics,
    /// The `fold-N` threads.
    pool: rayon::ThreadPool,
}

async fn run(
    workers: Workers,
    settings: DispatchSettings,
    mut queues: Queues,
    mut inputs: Inputs,
    mut stop: watch::Receiver<bool>,
    progress: watch::Sender<usize>,
) {
    let Workers {
        store,
        metrics,
        pool,
    } = workers;
    // One receiver per fold on the pool; a fold that panics drops its sender.
    let mut inflight: FuturesUnordered<oneshot::Receiver<JobResult>> = FuturesUnordered::new();
    loop {
        if *stop.borrow() {
            break;
        }
        let paused = *inputs.paused.borrow_and_update();
        while !paused && inflight.len() < settings.concurrency.max(1) {
            let Some(job) = queues.next_job(settings.batch_size.max(1)) else {
                break;
            };
            let (store, metrics) = (store.clone(), metrics.clone());
            let events: usize = job.iter().map(|(_, b)| b.len()).sum();
            let span = tracing::debug_span!("dispatch", partitions = job.len(), events);
            let (rules, decided) = (settings.rules.current(), settings.decided.clone());
            let verdicts = settings.verdicts.clone();
            let (done_tx, done_rx) = oneshot::channel();
            pool.spawn(move || {
                let results = span.in_scope(|| {
                    let fold = Fold {
                        store: &store,
                        metrics: &metrics,
                        rules: rules.as_ref(),
                        decided: decided.as_ref(),
                        verdicts: verdicts.as_deref(),
                    };
                    process(&fold, job)
                });
                let _ = done_tx.send(results);
            });
            inflight.push(done_rx);
        }
        tokio::select! {
            msg = inputs.typed.recv(), if inputs.open => match msg {
                Some(events) => {
                    for e in events {
                        let keep = queues.depth < MAX_EVENTS_IN_MEMORY;
                        queues.push(e.partition, e.seq, keep.then(|| Box::new((e.received_at, e.event))));
                    }
                }
                None => inputs.open = false,
            },
            Some(joined) = inflight.next(), if !inflight.is_empty() => match joined {
                Ok(results) => {
                    for (partition, done, failed) in results {
                        queues.finish(partition, done, failed);
                    }
                }
                Err(_) => tracing::error!("a fold ended without a result (it panicked)"),
            },
            _ = stop.changed() => {}
            // Resumed (or paused): look at the queues again.
            Ok(()) = inputs.paused.changed() => {}
        }
        metrics.inbox_depth.set(queues.depth as i64);
        progress.send_modify(|d| *d = queues.depth);
        if !inputs.open && inflight.is_empty() && queues.depth == 0 && queues.ready.is_empty() {
            // Every sender is gone and nothing is left: only happens in tests.
            let _ = stop.changed().await;
            break;
        }
    }
    // Shutdown: let batches in flight commit; what is queued stays in the inbox.
    while let Some(joined) = inflight.next().await {
        if let Ok(results) = joined {
            for (partition, done, failed) in results {
                queues.finish(partition, done, failed);
            }
        }
    }
    metrics.inbox_depth.set(queues.depth as i64);
    tracing::info!(left_in_inbox = queues.depth, "dispatcher stopped");
}

/// What a fold job works with.
struct Fold<'a> {
    store: &'a Store,
    metrics: &'a Metrics,
    rules: &'a dyn crate::actions::Decide,
    decided: Option<&'a crate::outbox::DecidedSender>,
    verdicts: Option<&'a crate::helpdesk::commands::Waiters>,
}

/// Fold one job (several partitions' batches) in one transaction. Runs on the blocking pool.
fn process(fold: &Fold<'_>, job: Job) -> JobResult {
    let (store, metrics) = (fold.store, fold.metrics);
    let mut batch: Vec<(u64, Event)> = Vec::new();
    let mut received: Vec<Millis> = Vec::new();
    // Index into `results` of each batch entry's partition.
    let mut owner: Vec<usize> = Vec::new();
    let mut results: JobResult = Vec::with_capacity(job.len());
    for (partition, entries) in job {
        let index = results.len();
        let mut done = 0;
        let mut failed = Vec::new();
        for (seq, entry) in entries {
            if !failed.is_empty() {
                // Keep the partition's order: nothing after a failed read goes ahead of it.
                failed.push(seq);
                continue;
            }
            match entry.map_or_else(|| load(store, metrics, seq), Loaded::Event) {
                Loaded::Event(typed) => {
                    let (at, event) = *typed;
                    received.push(at);
                    batch.push((seq, event));
                    owner.push(index);
                }
                Loaded::Quarantined => done += 1,
                Loaded::Failed => failed.push(seq),
            }
        }
        results.push((partition, done, failed));
    }
    for (seq, event) in &batch {
        tracing::debug!(seq, event_id = %event.id, conversation_id = ?event.payload.conversation_id(), kind = %event.kind, "folding event");
    }
    match store.apply_with(&batch, fold.rules, &received) {
        Ok(applied) => {
            if let (Some(tx), false) = (fold.decided, applied.outbox.is_empty()) {
                tx.send(applied.outbox);
            }
            // Committed: the agent API may answer from these verdicts now.
            if let Some(waiters) = fold.verdicts {
                waiters.complete(&applied.agent_verdicts);
            }
            let now = crate::clock::now_millis();
            for at in received {
                metrics
                    .processing_seconds
                    .observe((now - at).max(0) as f64 / 1000.0);
            }
            metrics.events_applied.inc_by(applied.applied as u64);
            metrics.timers_pending.add(applied.timers_change);
            for rule in &applied.capped {
                metrics.rule_caps_hit.with_label_values(&[rule]).inc();
            }
            for rule in &applied.template_errors {
                metrics
                    .rule_template_errors
                    .with_label_values(&[rule])
                    .inc();
            }
            let entries = &metrics.state_entries;
            entries
                .with_label_values(&["conversations"])
                .add(applied.new_conversations as i64);
            entries
                .with_label_values(&["end_users"])
                .add(applied.new_end_users as i64);
            entries
                .with_label_values(&["bots"])
                .add(applied.new_bots as i64);
            // Every folded (or skipped) event has left the inbox.
            for &i in &owner {
                results[i].1 += 1;
            }
            results
        }
        Err(e) => {
            metrics.dispatch_errors.inc();
            tracing::error!(error = %e, "folding batch failed; will retry");
            std::thread::sleep(RETRY_PAUSE);
            // Queues are ordered by sequence, so putting these back restores each partition's order.
            for ((seq, _), &i) in batch.iter().zip(&owner) {
                results[i].2.push(*seq);
            }
            results
        }
    }
}

enum Loaded {
    Event(Box<(Millis, Event)>),
    /// Unreadable: quarantined and out of the inbox.
    Quarantined,
    /// The store failed: try again later.
    Failed,
}

/// Read an inbox entry's event back from the log (after a restart, or a backlog).
fn load(store: &Store, metrics: &Metrics, seq: u64) -> Loaded {
    match store.event(seq) {
        Ok(Some(record)) => match crate::webhook::parse_event(record.event.get()) {
            Ok(event) => Loaded::Event(Box::new((record.received_at, event))),
            // Only possible if a newer model is stricter than the one that accepted it.
            Err(e) => {
                match quarantine_unreadable(store, metrics, seq, record.event.get(), &e.to_string())
                {
                    1 => Loaded::Quarantined,
                    _ => Loaded::Failed,
                }
            }
        },
        Ok(None) => {
            tracing::error!(seq, "inbox entry without event record");
            match quarantine_unreadable(store, metrics, seq, "", "event record missing") {
                1 => Loaded::Quarantined,
                _ => Loaded::Failed,
            }
        }
        Err(e) => {
            metrics.dispatch_errors.inc();
            tracing::error!(error = %e, seq, "reading event failed");
            std::thread::sleep(RETRY_PAUSE);
            Loaded::Failed
        }
    }
}

fn quarantine_unreadable(
    store: &Store,
    metrics: &Metrics,
    seq: u64,
    raw: &str,
    why: &str,
) -> usize {
    let record = QuarantineRecord::new(
        "event",
        "unprocessable_event",
        why,
        raw.as_bytes(),
        crate::clock::now_millis(),
    );
    match store
        .quarantine(record)
        .and_then(|_| store.drop_from_inbox(seq))
    {
        Ok(()) => {
            metrics.record_quarantined("unprocessable_event");
            1
        }
        Err(e) => {
            tracing::error!(error = %e, seq, "cannot quarantine unprocessable event");
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(id: &str) -> PartitionKey {
        PartitionKey::Conversation(id.into())
    }

    fn seqs(job: &Job) -> Vec<(PartitionKey, Vec<u64>)> {
        job.iter()
            .map(|(p, b)| (p.clone(), b.iter().map(|(s, _)| *s).collect()))
            .collect()
    }

    #[test]
    fn a_partition_is_handed_out_once_until_its_batch_finishes() {
        let mut q = Queues::default();
        q.push(conv("a"), 2, None);
        q.push(conv("a"), 1, None);
        q.push(conv("b"), 3, None);
        let job = q.next_job(10).expect("job");
        assert_eq!(
            seqs(&job),
            vec![(conv("a"), vec![1, 2]), (conv("b"), vec![3])]
        );
        q.push(conv("a"), 4, None);
        assert!(q.next_job(10).is_none(), "a and b are busy");
        q.finish(conv("a"), 2, vec![]);
        assert_eq!(
            seqs(&q.next_job(10).expect("job")),
            vec![(conv("a"), vec![4])]
        );
        assert_eq!(q.depth, 2);
    }

    #[test]
    fn a_job_stops_at_the_event_limit_and_leaves_the_rest_queued() {
        let mut q = Queues::default();
        for s in 1..=3 {
            q.push(conv("a"), s, None);
        }
        q.push(conv("b"), 4, None);
        let job = q.next_job(2).expect("job");
        assert_eq!(seqs(&job), vec![(conv("a"), vec![1, 2])]);
        // b is next in line; a's remaining event waits for a's batch to finish.
        let job = q.next_job(2).expect("job");
        assert_eq!(seqs(&job), vec![(conv("b"), vec![4])]);
        assert!(q.next_job(2).is_none());
        q.finish(conv("a"), 2, vec![]);
        assert_eq!(
            seqs(&q.next_job(2).expect("job")),
            vec![(conv("a"), vec![3])]
        );
    }

    #[test]
    fn a_drained_burst_gives_its_tables_back() {
        let mut q = Queues::default();
        for i in 0..20_000u64 {
            q.push(conv(&format!("c{i}")), i, None);
        }
        assert!(q.pending.capacity() >= 20_000);
        while let Some(job) = q.next_job(256) {
            for (partition, batch) in job {
                q.finish(partition, batch.len(), Vec::new());
            }
        }
        assert_eq!(q.depth, 0);
        assert!(
            q.pending.capacity() <= KEEP_CAPACITY
                && q.ready.capacity() <= KEEP_CAPACITY
                && q.busy.capacity() <= KEEP_CAPACITY,
            "capacities left: pending {}, ready {}, busy {}",
            q.pending.capacity(),
            q.ready.capacity(),
            q.busy.capacity()
        );
        // Still works after giving them back.
        q.push(conv("again"), 30_000, None);
        assert_eq!(
            seqs(&q.next_job(10).expect("job")),
            vec![(conv("again"), vec![30_000])]
        );
    }

    #[test]
    fn failed_entries_go_back_in_order() {
        let mut q = Queues::default();
        for s in [5, 6, 7] {
            q.push(conv("a"), s, None);
        }
        let job = q.next_job(2).expect("job");
        assert_eq!(seqs(&job), vec![(conv("a"), vec![5, 6])]);
        q.finish(conv("a"), 0, vec![5, 6]);
        assert_eq!(
            seqs(&q.next_job(10).expect("job")),
            vec![(conv("a"), vec![5, 6, 7])]
        );
        assert_eq!(q.depth, 3);
    }
}
