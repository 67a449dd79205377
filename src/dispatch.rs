//! The dispatcher: folds accepted events into state, in order within a partition (a
//! conversation, end user or bot) and in parallel across partitions, with bounded concurrency.
//!
//! The store keeps the dispatcher's position: each partition's folded mark, raised in the same
//! atomic write that folds (the store's journal), and a low watermark in the event log
//! (`Position`), so the in-memory queues are only a cache of what is still to fold, rebuilt by a
//! scan on start: a crash or shutdown at any point loses nothing and repeats nothing. The watermark
//! a fold writes is the oldest event not in it and not folded yet (queued, or in another fold), or
//! where the log ended after the newest event received.
//!
//! Folds run one at a time (the store's fold lock), so a job is not one partition but the next
//! batches of many ready partitions, folded in one atomic write. Events arrive typed from intake
//! and are only read back from the store after a restart (or when the backlog is too large to
//! keep them in memory).
//!
//! Folds run on the dispatcher's own threads (`fold-N`), at `dispatch.fold_priority` (Linux's
//! `SCHED_IDLE` by default, see `background`): they are never on an acknowledgment's path, so they
//! yield the CPU to intake.

use crate::ops::metrics::Metrics;
use futures_util::stream::{FuturesUnordered, StreamExt};
use model::cursor::Cursor;
use model::ids::PartitionKey;
use model::webhook::model::{Event, Millis};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;
use storage::Storage;
use storage::{EventRecord, NewEvent, Position, QuarantineRecord, Store};
use tokio::sync::{mpsc, oneshot, watch};

/// Pause before a partition whose batch failed is tried again (the store is likely in trouble).
const RETRY_PAUSE: Duration = Duration::from_millis(500);

/// How often at most a drained dispatcher raises the folds' watermark to the log's end
/// (`Watermark`). A raise follows every drain where an event arrived while a job ran (at 200
/// events/s, much of the time), and each costs a task on a fold thread and a sled write.
const RAISE_EVERY: Duration = Duration::from_secs(1);

/// Beyond this many queued events, new ones are queued without their typed form (and read back
/// from the store when their turn comes), so a backlog does not grow memory without bound.
const MAX_EVENTS_IN_MEMORY: usize = 10_000;

/// An event as queued: where it is in the log, and its typed form when intake handed it over.
#[derive(Debug)]
struct Entry {
    at: Cursor,
    typed: Option<Box<(Millis, Event)>>,
}

/// Newly durable events, and where the log ended after them.
type Received = (Vec<NewEvent>, Cursor);

/// The dispatcher's progress, for [`DispatchHandle::wait_drained`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Progress {
    /// Events queued or being folded.
    depth: usize,
    /// Messages taken from intake so far (compared with those sent).
    received: u64,
}

/// Sends newly durable events to the dispatcher.
#[derive(Clone)]
pub struct DispatchHandle {
    tx: mpsc::UnboundedSender<Received>,
    /// Changes whenever the dispatcher's queue depth changes or it takes a message.
    progress: watch::Receiver<Progress>,
    /// True while an operator holds folding back (`POST /admin/v1/dispatch/pause`).
    paused: std::sync::Arc<watch::Sender<bool>>,
}

impl DispatchHandle {
    /// Hold folding back: events are still accepted, made durable and queued (the event log keeps
    /// them), but no new batch starts; batches in flight finish. For an operator who needs the
    /// state to stand still (and for tests of what waits on a fold). Not kept across restarts.
    pub fn pause(&self) {
        self.paused.send_replace(true);
    }

    /// Fold again, from where the queues stand.
    pub fn resume(&self) {
        self.paused.send_replace(false);
    }

    pub fn is_paused(&self) -> bool {
        *self.paused.borrow()
    }

    /// Hand over newly durable events with their typed form, and where the log ends after them.
    pub fn notify_events(&self, events: Vec<NewEvent>, log_end: Cursor) {
        if !events.is_empty() {
            // Counted by the store already (`Store::count_hand_over`); a stopped dispatcher
            // leaves them to the next start's scan.
            let _ = self.tx.send((events, log_end));
        }
    }

    /// Wait until everything accepted so far is folded, or the timeout passes. Returns whether
    /// it drained. Woken by dispatcher progress, not polling.
    ///
    /// An accepted event is in intake's in-flight set until its hand-over is counted
    /// (`Store::count_hand_over`), then in the channel until the dispatcher takes it, then
    /// queued until folded. The progress is read first: every step that ends later is followed
    /// by a progress change (the send comes after the release), which wakes the waiter.
    pub async fn wait_drained(
        &self,
        writer: &storage::Writer,
        timeout: Duration,
    ) -> Result<bool, storage::StoreError> {
        let mut progress = self.progress.clone();
        let deadline = tokio::time::Instant::now() + timeout;
        let drained = |progress: &mut watch::Receiver<Progress>| {
            // Progress first: any step that ends after this read changes it again, and wakes us.
            // Queue depth reaches 0 only after the batch's bookkeeping (metrics) is done.
            let now = *progress.borrow_and_update();
            writer.handed_over() == Some(now.received) && now.depth == 0
        };
        loop {
            if drained(&mut progress) {
                return Ok(true);
            }
            match tokio::time::timeout_at(deadline, progress.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return Ok(drained(&mut progress)),
            }
        }
    }
}

pub struct DispatchSettings {
    /// Fold jobs in flight at once.
    pub concurrency: usize,
    /// Events per fold job (across partitions).
    pub batch_size: usize,
    /// Decides actions for each folded event.
    /// The rules in force; each job takes the current set once, so a reload never splits a batch.
    pub rules: engine::rules::live::LiveRules,
    /// Receives the outbox entries of each committed fold, in fold order.
    pub decided: Option<crate::outbox::DecidedSender>,
    /// Agent API calls waiting for their command's verdict.
    pub verdicts: Option<std::sync::Arc<crate::helpdesk::commands::Waiters>>,
    /// Where a fold that only a restart completes is reported (the daemon exits).
    pub stuck: Option<storage::Stuck>,
    /// How the fold threads are scheduled.
    pub priority: crate::background::Priority,
    /// Under `SCHED_IDLE`: lift the fold threads to the daemon's scheduling when a fold has been
    /// running this long (it waits for a CPU), until the inbox is empty. `None`: never.
    pub lift_after: Option<Duration>,
}

/// Start the dispatcher on the current runtime. It queues what the store still has to fold,
/// then runs until `stop` turns true; it then finishes the batches in flight and returns.
pub fn start(
    store: Store,
    metrics: Metrics,
    settings: DispatchSettings,
    stop: watch::Receiver<bool>,
) -> Result<(DispatchHandle, tokio::task::JoinHandle<()>), storage::StoreError> {
    let mut queues = Queues::default();
    let pending = store.pending_before_writer()?;
    queues.received_end = pending.end;
    for event in pending.events {
        let entry = Entry {
            at: event.at,
            typed: None,
        };
        queues.push(event.partition, event.seq, entry);
    }
    metrics.inbox_depth.set(queues.depth as i64);
    if queues.depth > 0 {
        tracing::info!(pending = queues.depth, "resuming the events still to fold");
    }
    let (handle, mut dispatcher) = Dispatcher::new(store, metrics, settings, queues.depth)?;
    let task = tokio::spawn(async move {
        let watermark = dispatcher.workers.store.fold_from().unwrap_or_default();
        let term = TermState::new(queues, watermark, None);
        dispatcher.term(term, stop).await;
        tracing::info!("dispatcher stopped");
    });
    Ok((handle, task))
}

/// Start the dispatcher of a node that shares the store with others: it folds only while this
/// node is the active one, a term at a time (`cluster::Terms`). A term finds every event still
/// to fold in the store, whichever node stored it, reading on from where its last read ended:
/// at once when this node's writer stored something, else every [`POLL_EVERY`]. Between terms
/// the writer's hand-overs are dropped (the store has them; the active reads them there).
pub fn start_shared(
    store: Store,
    metrics: Metrics,
    settings: DispatchSettings,
    mut terms: crate::cluster::Terms,
) -> Result<(DispatchHandle, tokio::task::JoinHandle<()>), storage::StoreError> {
    metrics.inbox_depth.set(0);
    let (handle, mut dispatcher) = Dispatcher::new(store, metrics, settings, 0)?;
    let task = tokio::spawn(async move {
        loop {
            let term = tokio::select! {
                term = terms.next() => term,
                msg = dispatcher.inputs.typed.recv(), if dispatcher.inputs.open => {
                    dispatcher.inputs.open = msg.is_some();
                    continue;
                }
            };
            let Some(term) = term else { break };
            let store = dispatcher.workers.store.clone();
            let from = match tokio::task::spawn_blocking(move || store.fold_from()).await {
                Ok(Ok(from)) => from,
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "cannot read the folds' watermark; folding waits");
                    continue;
                }
                Err(_) => continue,
            };
            let poll = Poller::new(dispatcher.workers.store.clone(), from);
            let state = TermState::new(Queues::default(), from, Some(poll));
            let lost = dispatcher.term(state, term.stop.clone()).await;
            if term.lost() {
                tracing::info!(dropped = lost, "no longer the active node: folding stopped");
            }
        }
        tracing::info!("dispatcher stopped");
    });
    Ok((handle, task))
}

/// How often the active of several nodes reads the store for what the others stored (its own
/// writer's events make it read at once).
const POLL_EVERY: Duration = Duration::from_millis(100);

/// Events read from the store in one go by [`Poller`].
const POLL_PAGE: usize = 1_000;

/// The active's reads of what is still to fold, on from where the last read ended.
struct Poller {
    store: Store,
    next: Cursor,
    /// Read at the next turn of the loop.
    due: bool,
    tick: tokio::time::Interval,
}

impl Poller {
    fn new(store: Store, from: Cursor) -> Poller {
        let mut tick = tokio::time::interval(POLL_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Poller {
            store,
            next: from,
            due: true,
            tick,
        }
    }

    /// Read the next page into `queues` when due and there is room (bounded memory): its events
    /// (read back when folded), and the read's end as the received end.
    async fn read(&mut self, queues: &mut Queues) {
        if !self.due || queues.depth >= MAX_EVENTS_IN_MEMORY {
            return;
        }
        let (store, from) = (self.store.clone(), self.next);
        let read = tokio::task::spawn_blocking(move || store.pending_from(from, POLL_PAGE)).await;
        let pending = match read {
            Ok(Ok(pending)) => pending,
            Ok(Err(e)) => {
                tracing::error!(error = %e, "cannot read the events still to fold; trying again");
                self.due = false;
                return;
            }
            Err(_) => return,
        };
        self.due = pending.len() >= POLL_PAGE;
        self.next = self.next.max(pending.end);
        for event in pending.events {
            let entry = Entry {
                at: event.at,
                typed: None,
            };
            queues.push(event.partition, event.seq, entry);
        }
        queues.received_end = queues.received_end.max(pending.end);
    }
}

/// Tick until the next read is due (never without a poller).
async fn poll_tick(poller: Option<&mut Poller>) {
    match poller {
        Some(p) => {
            p.tick.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// The dispatcher: what it folds with, and what outlives a term (its inputs and progress).
struct Dispatcher {
    workers: Workers,
    settings: DispatchSettings,
    inputs: Inputs,
    progress: watch::Sender<Progress>,
    /// Messages taken from intake so far.
    received: u64,
}

/// A term's queues, the folds in flight and the watermark, and (several nodes) its reads.
struct TermState {
    queues: Queues,
    watermark: Watermark,
    poller: Option<Poller>,
}

impl TermState {
    fn new(queues: Queues, watermark: Cursor, poller: Option<Poller>) -> Self {
        TermState {
            queues,
            watermark: Watermark::new(watermark),
            poller,
        }
    }
}

impl Dispatcher {
    /// The handle and the dispatcher: its fold threads started, nothing queued yet.
    fn new(
        store: Store,
        metrics: Metrics,
        settings: DispatchSettings,
        depth: usize,
    ) -> Result<(DispatchHandle, Dispatcher), storage::StoreError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let (paused_tx, paused) = watch::channel(false);
        let (progress_tx, progress) = watch::channel(Progress { depth, received: 0 });
        let priority = settings.priority;
        let lift = std::sync::Arc::new(crate::background::Lift::default());
        let pool =
            FoldThreads::start(settings.concurrency.max(1), priority, &lift).map_err(|e| {
                storage::StoreError::Internal(format!("cannot start fold threads: {e}"))
            })?;
        // Only threads under SCHED_IDLE starve on a busy host; a nice value keeps a share.
        let lift_after = settings
            .lift_after
            .filter(|_| priority == crate::background::Priority::Idle);
        let workers = Workers {
            store,
            metrics,
            pool,
            lift: Lifter::new(lift, lift_after),
        };
        let inputs = Inputs {
            typed: rx,
            open: true,
            paused,
        };
        let handle = DispatchHandle {
            tx,
            progress,
            paused: std::sync::Arc::new(paused_tx),
        };
        let dispatcher = Dispatcher {
            workers,
            settings,
            inputs,
            progress: progress_tx,
            received: 0,
        };
        Ok((handle, dispatcher))
    }
}

#[derive(Default)]
struct Queues {
    pending: HashMap<PartitionKey, BTreeMap<u64, Entry>>,
    ready: VecDeque<PartitionKey>,
    busy: HashSet<PartitionKey>,
    depth: usize,
    /// How many events queued or being folded each frame holds: the oldest frame with one not
    /// in a fold is that fold's watermark. Counted per frame, not per event: a burst's frames
    /// hold several events each, and this map is as large as the backlog.
    unfinished: BTreeMap<Cursor, u32>,
    /// Where the log ended after the newest event received: every event not received yet is
    /// past it.
    received_end: Cursor,
}

/// One fold job: the next batch of each of several partitions.
type Job = Vec<(PartitionKey, Vec<(u64, Entry)>)>;

impl Queues {
    fn push(&mut self, partition: PartitionKey, seq: u64, entry: Entry) {
        let queue = self.pending.entry(partition.clone()).or_default();
        let was_empty = queue.is_empty();
        let at = entry.at;
        match queue.entry(seq) {
            std::collections::btree_map::Entry::Vacant(slot) => {
                slot.insert(entry);
                self.depth += 1;
                *self.unfinished.entry(at).or_default() += 1;
            }
            // Queued already: one copy is enough (keep a typed form if either has one).
            std::collections::btree_map::Entry::Occupied(mut queued) => {
                if queued.get().typed.is_none() {
                    queued.get_mut().typed = entry.typed;
                }
            }
        }
        if was_empty && !self.busy.contains(&partition) {
            self.ready.push_back(partition);
        }
    }

    /// Queue newly durable events (typed while the queues hold fewer than
    /// [`MAX_EVENTS_IN_MEMORY`]), and where the log ended after them.
    fn receive(&mut self, events: Vec<NewEvent>, log_end: Cursor) {
        for e in events {
            let keep = self.depth < MAX_EVENTS_IN_MEMORY;
            let typed = keep.then(|| Box::new((e.received_at, e.event)));
            self.push(e.partition, e.seq, Entry { at: e.at, typed });
        }
        self.received_end = self.received_end.max(log_end);
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

    /// The watermark for a job: the oldest unfinished event not in it, or the received end.
    /// Whatever is not folded once the job commits was unfinished then (and not in the job), or
    /// comes later, past the received end.
    fn watermark(&self, job: &Job) -> Cursor {
        let mut mine: HashMap<Cursor, u32> = HashMap::new();
        for (_, entry) in job.iter().flat_map(|(_, batch)| batch) {
            *mine.entry(entry.at).or_default() += 1;
        }
        self.unfinished
            .iter()
            .find(|(at, count)| **count > mine.get(*at).copied().unwrap_or(0))
            .map_or(self.received_end, |(at, _)| *at)
    }

    /// A partition's batch finished: `failed` entries go back to the front of their queue.
    fn finish(&mut self, finished: Finished) {
        let Finished {
            partition,
            done,
            failed,
        } = finished;
        self.busy.remove(&partition);
        for (_, at) in done {
            self.settle(at);
        }
        if !failed.is_empty() {
            let queue = self.pending.entry(partition.clone()).or_default();
            let mut copies = Vec::new();
            for (seq, at) in failed {
                match queue.entry(seq) {
                    std::collections::btree_map::Entry::Vacant(slot) => {
                        slot.insert(Entry { at, typed: None });
                    }
                    // A second copy was queued meanwhile: this one is settled with it.
                    std::collections::btree_map::Entry::Occupied(_) => copies.push(at),
                }
            }
            for at in copies {
                self.settle(at);
            }
        }
        if self.pending.get(&partition).is_some_and(|q| !q.is_empty()) {
            self.ready.push_back(partition);
        }
        self.release_drained();
    }

    /// A fold job's partitions' batches finished ([`Queues::finish`]).
    fn finish_job(&mut self, results: JobResult) {
        for finished in results {
            self.finish(finished);
        }
    }

    /// One event (a copy) queued or being folded is gone.
    fn settle(&mut self, at: Cursor) {
        self.depth = self.depth.saturating_sub(1);
        if let Some(count) = self.unfinished.get_mut(&at) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.unfinished.remove(&at);
            }
        }
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

/// A partition's batch after its fold: the entries folded (or passed over), and those to try
/// again.
#[derive(Debug)]
struct Finished {
    partition: PartitionKey,
    done: Vec<(u64, Cursor)>,
    failed: Vec<(u64, Cursor)>,
}

type JobResult = Vec<Finished>;

struct Inputs {
    typed: mpsc::UnboundedReceiver<Received>,
    open: bool,
    paused: watch::Receiver<bool>,
}

/// The `fold-N` threads: each takes the next job from one channel and sleeps while there is
/// none; a job wakes one of them.
///
/// Not a work-stealing pool: rayon's idle workers spin and `sched_yield` before they sleep, and
/// at a handoff every few milliseconds that was a quarter of the fold threads' CPU. A job here
/// is a whole fold (one atomic write), and folds are serialised by the store's lock anyway.
struct FoldThreads {
    jobs: crossbeam_channel::Sender<Box<dyn FnOnce() + Send>>,
}

impl FoldThreads {
    /// Start `n` threads at `priority`, each registered with `lift`. They end when this is
    /// dropped (after the job they run).
    fn start(
        n: usize,
        priority: crate::background::Priority,
        lift: &std::sync::Arc<crate::background::Lift>,
    ) -> std::io::Result<Self> {
        let (jobs, rx) = crossbeam_channel::unbounded::<Box<dyn FnOnce() + Send>>();
        for i in 0..n {
            let (rx, lift) = (rx.clone(), lift.clone());
            std::thread::Builder::new()
                .name(format!("fold-{i}"))
                .spawn(move || {
                    priority.apply_to_this_thread();
                    lift.register_this_thread();
                    // Ends when the sender is dropped.
                    for job in rx {
                        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                        if ran.is_err() {
                            tracing::error!("a fold panicked; its partitions stay queued");
                        }
                    }
                })?;
        }
        Ok(FoldThreads { jobs })
    }

    fn spawn(&self, job: impl FnOnce() + Send + 'static) {
        // The threads end only when this is dropped: a send cannot fail while it exists. If it
        // did, the job's result sender drops with it and the dispatcher sees a failed fold.
        if self.jobs.send(Box::new(job)).is_err() {
            tracing::error!("the fold threads are gone");
        }
    }
}

/// The folds' watermark as the dispatcher last wrote it or saw a fold write it, and when a
/// drained dispatcher raises it to the log's end.
///
/// Each fold writes the watermark its job started with (the oldest event queued or in another
/// job), and the job that commits last in a burst may have started long before the others
/// ended: the watermark would stay a whole burst behind until the next event, and a restart
/// would check every event of the burst against its folded mark again. Drained, every event
/// received is folded, so the log's end as received is a watermark to write. (A job that holds
/// every unfinished event writes that end itself; a raise is needed when an event arrived while
/// a job ran.) At most once per `RAISE_EVERY`, and once more that long after the last if still
/// behind; and once at a stop, so a raise held back is not lost.
struct Watermark {
    written: Cursor,
    last_raise: Option<tokio::time::Instant>,
}

/// What to do about the watermark now.
#[derive(Debug, PartialEq, Eq)]
enum Raise {
    Nothing,
    /// Write this (the log's end as received).
    Now(Cursor),
    /// Look again then.
    Later(tokio::time::Instant),
}

impl Watermark {
    fn new(written: Cursor) -> Self {
        Watermark {
            written,
            last_raise: None,
        }
    }

    /// A fold committed the watermark its job started with.
    fn committed(&mut self, fold_from: Cursor) {
        self.written = fold_from;
    }

    /// At a stop: the end to raise the watermark to, if drained and behind, whenever the last
    /// raise.
    fn at_stop(&mut self, drained: bool, end: Cursor) -> Option<Cursor> {
        (drained && self.written < end).then(|| {
            self.written = end;
            end
        })
    }

    fn next(&mut self, drained: bool, end: Cursor, now: tokio::time::Instant) -> Raise {
        if !drained || self.written >= end {
            return Raise::Nothing;
        }
        if let Some(due) = self.last_raise.map(|at| at + RAISE_EVERY) {
            if due > now {
                return Raise::Later(due);
            }
        }
        self.last_raise = Some(now);
        self.written = end;
        Raise::Now(end)
    }
}

/// What folds run with.
struct Workers {
    store: Store,
    metrics: Metrics,
    /// The `fold-N` threads.
    pool: FoldThreads,
    /// Lifts them out of `SCHED_IDLE` while a fold starves.
    lift: Lifter,
}

/// The dispatcher's side of [`Lift`](crate::background::Lift): when the oldest fold in flight
/// started, and whether the fold threads run lifted.
///
/// A fold takes milliseconds; one still running `lift_after` after it started is waiting for a
/// CPU that programs outside the daemon keep busy (under `SCHED_IDLE` it gets a CPU only when no
/// other thread wants one), and it holds the fold lock, so every conversation's events wait
/// with it. The threads are lifted to the daemon's own scheduling then, and put back under
/// `SCHED_IDLE` once the inbox is empty, where they yield to intake again.
struct Lifter {
    lift: std::sync::Arc<crate::background::Lift>,
    after: Option<Duration>,
    /// Start times of the folds in flight, oldest first.
    started: VecDeque<tokio::time::Instant>,
}

impl Lifter {
    fn new(lift: std::sync::Arc<crate::background::Lift>, after: Option<Duration>) -> Self {
        Lifter {
            lift,
            after,
            started: VecDeque::new(),
        }
    }

    fn started(&mut self) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        self.started.push_back(now);
        now
    }

    fn finished(&mut self, started: tokio::time::Instant) {
        if let Some(i) = self.started.iter().position(|t| *t == started) {
            self.started.remove(i);
        }
    }

    /// When the oldest fold in flight will have waited long enough to lift (none while lifted).
    fn deadline(&self) -> Option<tokio::time::Instant> {
        let after = self.after?;
        if self.lift.is_lifted() {
            return None;
        }
        self.started.front().map(|t| *t + after)
    }

    /// Lift if the oldest fold in flight has waited past the deadline.
    fn check(&self, metrics: &Metrics) {
        let Some(deadline) = self.deadline() else {
            return;
        };
        if tokio::time::Instant::now() < deadline {
            return;
        }
        let lifted = self.lift.lift();
        metrics.fold_lifts.inc();
        metrics.fold_lifted.set(1);
        tracing::warn!(
            threads = lifted,
            waited_ms = self.after.map_or(0, |d| d.as_millis() as u64),
            "a fold waited for a CPU past dispatch.lift_after (other programs keep the CPUs busy): \
             the fold threads run at the daemon's priority until the inbox is empty"
        );
    }

    /// Back under `SCHED_IDLE` once nothing is left to fold.
    fn settle(&self, metrics: &Metrics, drained: bool) {
        if drained && self.lift.is_lifted() {
            self.lift.lower();
            metrics.fold_lifted.set(0);
            tracing::info!("the inbox is empty: the fold threads are back under SCHED_IDLE");
        }
    }
}

/// A fold's end as the dispatcher sees it: when it started, the watermark it wrote, and its
/// partitions' batches (an error: it panicked).
type Folded = (
    tokio::time::Instant,
    Cursor,
    Result<JobResult, oneshot::error::RecvError>,
);

/// A fold in flight: its partitions' batches when it ends, with when it started and the
/// watermark its commit writes.
struct InFlight {
    started: tokio::time::Instant,
    fold_from: Cursor,
    done: oneshot::Receiver<JobResult>,
}

impl std::future::Future for InFlight {
    type Output = Folded;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Folded> {
        let (started, fold_from) = (self.started, self.fold_from);
        std::pin::Pin::new(&mut self.done)
            .poll(cx)
            .map(|joined| (started, fold_from, joined))
    }
}

impl Dispatcher {
    /// The dispatcher's loop for one term, until `stop` turns true (or, in tests, every sender
    /// is gone and nothing is left); then the folds in flight commit. Returns how many events
    /// were left queued (found again by the next start, or the next term).
    async fn term(&mut self, state: TermState, mut stop: watch::Receiver<bool>) -> usize {
        let TermState {
            mut queues,
            mut watermark,
            mut poller,
        } = state;
        // A fold that panics drops its sender.
        let mut inflight: FuturesUnordered<InFlight> = FuturesUnordered::new();
        loop {
            if *stop.borrow() {
                break;
            }
            if let Some(poller) = poller.as_mut() {
                poller.read(&mut queues).await;
            }
            self.start_jobs(&mut queues, &mut inflight);
            let drained = queues.depth == 0 && inflight.is_empty();
            let (pool, store) = (&self.workers.pool, &self.workers.store);
            let raise_at = raise_when_drained(&mut watermark, &queues, drained, pool, store);
            let lift_at = self.workers.lift.deadline();
            tokio::select! {
                msg = self.inputs.typed.recv(), if self.inputs.open => match msg {
                    Some(msg) => self.take(msg, &mut queues, poller.as_mut()),
                    None => self.inputs.open = false,
                },
                Some(folded) = inflight.next(), if !inflight.is_empty() => {
                    fold_ended(folded, &mut self.workers.lift, &mut watermark, &mut queues);
                }
                // A fold in flight has waited for a CPU past `lift_after`.
                () = sleep_until_some(lift_at) => self.workers.lift.check(&self.workers.metrics),
                // Time to raise the watermark (above), if still drained.
                () = sleep_until_some(raise_at) => {}
                // Time to read what the other nodes stored.
                () = poll_tick(poller.as_mut()) => if let Some(p) = poller.as_mut() { p.due = true },
                // A dropped sender stops it too: `changed` would be ready at once forever.
                changed = stop.changed() => if changed.is_err() { break },
                // Resumed (or paused): look at the queues again.
                Ok(()) = self.inputs.paused.changed() => {}
            }
            let drained = queues.depth == 0 && inflight.is_empty();
            let w = &self.workers;
            publish(
                &w.metrics,
                &w.lift,
                &self.progress,
                &queues,
                drained,
                self.received,
            );
            if !self.inputs.open
                && inflight.is_empty()
                && queues.depth == 0
                && queues.ready.is_empty()
            {
                // Every sender is gone and nothing is left: only happens in tests.
                let _ = stop.changed().await;
                break;
            }
        }
        // Several nodes: the next term (here or elsewhere) reads from the watermark anyway.
        let raise_at_stop = poller.is_none();
        let w = &self.workers;
        wind_down(
            inflight,
            watermark,
            &mut queues,
            (&w.pool, &w.store),
            raise_at_stop,
        )
        .await;
        w.metrics.inbox_depth.set(queues.depth as i64);
        tracing::info!(left_to_fold = queues.depth, "folding stopped");
        queues.depth
    }

    /// Start the next jobs while folding is not paused and fewer than `dispatch.concurrency`
    /// are in flight.
    fn start_jobs(&mut self, queues: &mut Queues, inflight: &mut FuturesUnordered<InFlight>) {
        let paused = *self.inputs.paused.borrow_and_update();
        let settings = &self.settings;
        while !paused && inflight.len() < settings.concurrency.max(1) {
            let Some(job) = queues.next_job(settings.batch_size.max(1)) else {
                break;
            };
            let fold_from = queues.watermark(&job);
            let w = &self.workers;
            let done = spawn_fold(&w.pool, &w.store, &w.metrics, settings, job, fold_from);
            let started = self.workers.lift.started();
            inflight.push(InFlight {
                started,
                fold_from,
                done,
            });
        }
    }

    /// A hand-over from intake: queued (one node), or a read of the store made due (several
    /// nodes: every node's events are read there, in the store's order).
    fn take(
        &mut self,
        (events, log_end): Received,
        queues: &mut Queues,
        poller: Option<&mut Poller>,
    ) {
        self.received += 1;
        match poller {
            Some(poller) => poller.due = true,
            None => queues.receive(events, log_end),
        }
    }
}

/// Start folding `job` on a fold thread, under the rules in force now, `fold_from` the watermark
/// its commit writes; the receiver gets its partitions' batches.
fn spawn_fold(
    pool: &FoldThreads,
    store: &Store,
    metrics: &Metrics,
    settings: &DispatchSettings,
    job: Job,
    fold_from: Cursor,
) -> oneshot::Receiver<JobResult> {
    let (store, metrics) = (store.clone(), metrics.clone());
    let events: usize = job.iter().map(|(_, b)| b.len()).sum();
    let span = tracing::debug_span!("dispatch", partitions = job.len(), events);
    let (rules, decided) = (settings.rules.current(), settings.decided.clone());
    let (verdicts, stuck) = (settings.verdicts.clone(), settings.stuck.clone());
    let (done_tx, done_rx) = oneshot::channel();
    pool.spawn(move || {
        let results = span.in_scope(|| {
            let fold = Fold {
                store: &*store,
                metrics: &metrics,
                rules: rules.as_ref(),
                decided: decided.as_ref(),
                verdicts: verdicts.as_deref(),
                stuck: stuck.as_ref(),
            };
            process(&fold, job, fold_from)
        });
        let _ = done_tx.send(results);
    });
    done_rx
}

/// Drained: raise the folds' watermark to the log's end as received (`Watermark`), now on a fold
/// thread, or say when to look again.
fn raise_when_drained(
    watermark: &mut Watermark,
    queues: &Queues,
    drained: bool,
    pool: &FoldThreads,
    store: &Store,
) -> Option<tokio::time::Instant> {
    match watermark.next(drained, queues.received_end, tokio::time::Instant::now()) {
        Raise::Nothing => None,
        Raise::Later(at) => Some(at),
        Raise::Now(to) => {
            drop(raise_watermark(pool, store, to));
            None
        }
    }
}

/// A fold ended: it is no longer in flight, its watermark is written, and its partitions'
/// batches finish.
fn fold_ended(
    (started, fold_from, joined): Folded,
    lift: &mut Lifter,
    watermark: &mut Watermark,
    queues: &mut Queues,
) {
    lift.finished(started);
    watermark.committed(fold_from);
    match joined {
        Ok(results) => queues.finish_job(results),
        Err(_) => tracing::error!("a fold ended without a result (it panicked)"),
    }
}

/// After each turn of the loop: the inbox depth, the fold threads lowered once drained, then
/// the progress for [`DispatchHandle::wait_drained`].
fn publish(
    metrics: &Metrics,
    lift: &Lifter,
    progress: &watch::Sender<Progress>,
    queues: &Queues,
    drained: bool,
    received: u64,
) {
    metrics.inbox_depth.set(queues.depth as i64);
    // Before the progress: whoever sees the inbox drained sees the threads lowered.
    lift.settle(metrics, drained);
    progress.send_replace(Progress {
        depth: queues.depth,
        received,
    });
}

/// Shutdown: let batches in flight commit (what is queued is found again by the next start),
/// and make a raise held back by `RAISE_EVERY`, so the next start does not scan again.
async fn wind_down(
    mut inflight: impl futures_util::Stream<Item = Folded> + Unpin,
    mut watermark: Watermark,
    queues: &mut Queues,
    (pool, store): (&FoldThreads, &Store),
    raise: bool,
) {
    while let Some((_, fold_from, joined)) = inflight.next().await {
        watermark.committed(fold_from);
        if let Ok(results) = joined {
            queues.finish_job(results);
        }
    }
    if !raise {
        return;
    }
    if let Some(to) = watermark.at_stop(queues.depth == 0, queues.received_end) {
        let _ = raise_watermark(pool, store, to).await;
    }
}

/// Raise the folds' watermark to `to` on a fold thread (`Store::advance_fold_from` takes the fold
/// lock); the receiver says when it is done.
fn raise_watermark(pool: &FoldThreads, store: &Store, to: Cursor) -> oneshot::Receiver<()> {
    let (done_tx, done_rx) = oneshot::channel();
    let store = store.clone();
    pool.spawn(move || {
        if let Err(e) = store.advance_fold_from(to) {
            tracing::warn!(error = %e, "cannot advance the folds' watermark to the log's end");
        }
        let _ = done_tx.send(());
    });
    done_rx
}

/// Sleep until `at`, or forever when there is nothing to wait for.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What a fold job works with.
struct Fold<'a> {
    store: &'a dyn Storage,
    metrics: &'a Metrics,
    rules: &'a dyn engine::decide::Decide,
    decided: Option<&'a crate::outbox::DecidedSender>,
    verdicts: Option<&'a crate::helpdesk::commands::Waiters>,
    stuck: Option<&'a storage::Stuck>,
}

/// Fold one job (several partitions' batches) in one atomic write, which also records
/// `fold_from` as the folds' watermark. Runs on a fold thread.
fn process(fold: &Fold<'_>, job: Job, fold_from: Cursor) -> JobResult {
    let (store, metrics) = (fold.store, fold.metrics);
    let Prepared {
        batch,
        partitions,
        received,
        mut position,
        settled,
        mut results,
    } = Prepared::read(store, metrics, job);
    position.fold_from = Some(job_fold_from(&results, fold_from));
    for (seq, event) in &batch {
        tracing::debug!(seq, event_id = %event.id, conversation_id = ?event.payload.conversation_id(), kind = %event.kind, "folding event");
    }
    if batch.is_empty() && position.passed.is_empty() {
        return results;
    }
    match store.fold(&batch, &partitions, fold.rules, &received, &position) {
        Ok(applied) => {
            fold_committed(fold, applied, received);
            // Every folded (or skipped, or passed over) event is settled.
            for (result, mine) in results.iter_mut().zip(settled) {
                result.done = mine;
            }
            results
        }
        Err(e) => {
            fold_failed(fold, e);
            // Queues are ordered by sequence, so putting these back restores each partition's
            // order. A passed-over event is quarantined again on the retry.
            for (result, mine) in results.iter_mut().zip(settled) {
                result.failed.extend(mine);
            }
            results
        }
    }
}

/// A job's events as its fold takes them, and what becomes of each partition's batch.
struct Prepared {
    /// The events to fold, in order within each partition.
    batch: Vec<(u64, Event)>,
    /// Each event's partition.
    partitions: Vec<PartitionKey>,
    /// When each event was received.
    received: Vec<Millis>,
    /// The events passed over (quarantined); the watermark is set later.
    position: Position,
    /// Per partition: the entries this fold settles (folded or passed over), in order.
    settled: Vec<Vec<(u64, Cursor)>>,
    /// Per partition: the entries that go back to its queue (nothing done yet).
    results: JobResult,
}

impl Prepared {
    /// Each queued event of `job` in its typed form, read back from the log when it has none.
    fn read(store: &dyn Storage, metrics: &Metrics, job: Job) -> Self {
        let mut prepared = Prepared {
            batch: Vec::new(),
            partitions: Vec::new(),
            received: Vec::new(),
            position: Position::default(),
            settled: Vec::with_capacity(job.len()),
            results: Vec::with_capacity(job.len()),
        };
        let mut loaded = load_all(store, metrics, &job);
        for (partition, entries) in job {
            prepared.add(partition, entries, &mut loaded);
        }
        prepared
    }

    /// One partition's batch: its events up to the first that cannot be read (it and those after
    /// it go back to the queue, in order).
    fn add(
        &mut self,
        partition: PartitionKey,
        entries: Vec<(u64, Entry)>,
        loaded: &mut HashMap<u64, Loaded>,
    ) {
        let mut mine = Vec::new();
        let mut failed = Vec::new();
        for (seq, entry) in entries {
            let at = entry.at;
            if !failed.is_empty() {
                // Keep the partition's order: nothing after a failed read goes ahead of it.
                failed.push((seq, at));
                continue;
            }
            let loaded = match entry.typed {
                Some(typed) => Loaded::Event(typed),
                None => loaded.remove(&seq).unwrap_or(Loaded::Failed),
            };
            match loaded {
                Loaded::Event(typed) => {
                    let (received_at, event) = *typed;
                    self.received.push(received_at);
                    self.batch.push((seq, event));
                    self.partitions.push(partition.clone());
                    self.position.frames.push(at);
                    mine.push((seq, at));
                }
                Loaded::Quarantined => {
                    self.position.passed.push(storage::PendingEvent {
                        seq,
                        partition: partition.clone(),
                        at,
                    });
                    mine.push((seq, at));
                }
                Loaded::Failed => failed.push((seq, at)),
            }
        }
        self.settled.push(mine);
        self.results.push(Finished {
            partition,
            done: Vec::new(),
            failed,
        });
    }
}

/// The watermark the fold writes: the job's own counted every entry of the job as folded by
/// this commit, so it is held back to the first that goes back to its queue (a failed read,
/// and what follows it in its partition).
fn job_fold_from(results: &JobResult, fold_from: Cursor) -> Cursor {
    let first_failed = results
        .iter()
        .flat_map(|r| r.failed.iter().map(|(_, at)| *at))
        .min();
    first_failed.map_or(fold_from, |at| at.min(fold_from))
}

/// A fold committed: its outbox entries to the executor, its verdicts to the agent API's
/// waiters, then its metrics.
fn fold_committed(fold: &Fold<'_>, applied: storage::Applied, received: Vec<Millis>) {
    let (store, metrics) = (fold.store, fold.metrics);
    if let (Some(tx), false) = (fold.decided, applied.outbox.is_empty()) {
        tx.send(applied.outbox);
    }
    // Committed: the agent API may answer from these verdicts now.
    if let Some(waiters) = fold.verdicts {
        waiters.complete(&applied.agent_verdicts);
    }
    let now = store.clock().now_millis();
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
    for (exit, waited_ms) in &applied.queue_exits {
        metrics
            .queue_exits
            .with_label_values(&[exit.as_str()])
            .inc();
        if let Some(ms) = waited_ms {
            metrics
                .time_to_accept_seconds
                .observe((*ms).max(0) as f64 / 1000.0);
        }
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
}

/// A fold failed: counted, then the store is reported stuck when the fold is half applied (only
/// a restart completes it: the daemon exits), else a pause before its batches are tried again
/// (none when the store fenced it: this node is no longer the active one).
fn fold_failed(fold: &Fold<'_>, e: storage::StoreError) {
    fold.metrics.dispatch_errors.inc();
    if matches!(e, storage::StoreError::Fenced) {
        // Several nodes: the lease moved on while the fold ran; the new active folds these
        // events, and this node's term is ending (no pause: it waits for this fold).
        tracing::warn!("the store refused a fold: this node no longer holds the lease");
        return;
    }
    if matches!(e, storage::StoreError::HalfApplied) && fold.store.takes_writes() {
        // Only a restart completes the fold (from its journal); while the disk is still
        // full, a restart could not, so folds keep failing here until it has room.
        tracing::error!(
            exit_code = storage::writer::STORE_STUCK_EXIT,
            "a fold is half applied; exiting so a restart completes it"
        );
        if let Some(stuck) = fold.stuck {
            stuck.report();
        }
    }
    tracing::error!(error = %e, "folding batch failed; will retry");
    std::thread::sleep(RETRY_PAUSE);
}

enum Loaded {
    Event(Box<(Millis, Event)>),
    /// Unreadable: quarantined; the fold marks it folded.
    Quarantined,
    /// The store failed: try again later.
    Failed,
}

/// Read the queued events of `job` that have no typed form back from the log (after a restart,
/// or a backlog), in one call; when it fails, each alone, so one that cannot be read holds back
/// only its own partition.
fn load_all(store: &dyn Storage, metrics: &Metrics, job: &Job) -> HashMap<u64, Loaded> {
    let wanted: Vec<(u64, Cursor)> = job
        .iter()
        .flat_map(|(_, entries)| entries.iter())
        .filter(|(_, entry)| entry.typed.is_none())
        .map(|(seq, entry)| (*seq, entry.at))
        .collect();
    if wanted.is_empty() {
        return HashMap::new();
    }
    match store.events_at(&wanted) {
        Ok(records) => wanted
            .iter()
            .zip(records)
            .map(|(&(seq, _), record)| (seq, load(store, metrics, seq, record)))
            .collect(),
        Err(_) => {
            let mut loaded = HashMap::new();
            for (_, entries) in job {
                for (seq, entry) in entries.iter().filter(|(_, e)| e.typed.is_none()) {
                    let one = load_one(store, metrics, *seq, entry.at);
                    let failed = matches!(one, Loaded::Failed);
                    loaded.insert(*seq, one);
                    if failed {
                        // The rest of its partition waits behind it (`Prepared::add`).
                        break;
                    }
                }
            }
            loaded
        }
    }
}

/// One queued event read back from the log; a failed read is tried again later.
fn load_one(store: &dyn Storage, metrics: &Metrics, seq: u64, at: Cursor) -> Loaded {
    match store.event_at(seq, at) {
        Ok(record) => load(store, metrics, seq, record),
        Err(e) => {
            metrics.dispatch_errors.inc();
            tracing::error!(error = %e, seq, "reading event failed");
            std::thread::sleep(RETRY_PAUSE);
            Loaded::Failed
        }
    }
}

/// A queued event as read back from the log.
fn load(store: &dyn Storage, metrics: &Metrics, seq: u64, record: Option<EventRecord>) -> Loaded {
    match record {
        Some(record) => match model::webhook::parse_event(record.event.get()) {
            Ok(event) => Loaded::Event(Box::new((record.received_at, event))),
            // Only possible if a newer model is stricter than the one that accepted it.
            Err(e) => {
                quarantine_unreadable(store, metrics, seq, record.event.get(), &e.to_string())
            }
        },
        None => {
            tracing::error!(seq, "queued event without its frame in the event log");
            quarantine_unreadable(store, metrics, seq, "", "event record missing")
        }
    }
}

fn quarantine_unreadable(
    store: &dyn Storage,
    metrics: &Metrics,
    seq: u64,
    raw: &str,
    why: &str,
) -> Loaded {
    let record = QuarantineRecord::new(
        "event",
        "unprocessable_event",
        why,
        raw.as_bytes(),
        store.clock().now_millis(),
    );
    match store.quarantine(record) {
        Ok(_) => {
            metrics.record_quarantined("unprocessable_event");
            Loaded::Quarantined
        }
        Err(e) => {
            tracing::error!(error = %e, seq, "cannot quarantine unprocessable event");
            Loaded::Failed
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(id: &str) -> PartitionKey {
        PartitionKey::Conversation(id.into())
    }

    /// Event `seq`'s frame: the tests put one event per frame, in sequence order.
    fn at(seq: u64) -> Cursor {
        Cursor::from_raw(u128::from(seq) * 100)
    }

    fn entry(seq: u64) -> Entry {
        untyped(at(seq))
    }

    /// An entry to read back from the log at `at` (as after a restart).
    fn untyped(at: Cursor) -> Entry {
        Entry { at, typed: None }
    }

    #[test]
    fn fold_threads_run_jobs_on_their_threads_and_survive_a_panic() {
        let lift = std::sync::Arc::new(crate::background::Lift::default());
        let threads =
            FoldThreads::start(2, crate::background::Priority::Nice(0), &lift).expect("start");
        let (tx, rx) = std::sync::mpsc::channel();
        let name = |tx: std::sync::mpsc::Sender<Option<String>>| {
            move || {
                let _ = tx.send(std::thread::current().name().map(str::to_owned));
            }
        };
        threads.spawn(name(tx.clone()));
        let first = rx.recv().expect("ran");
        assert!(first.is_some_and(|n| n.starts_with("fold-")));
        threads.spawn(|| panic!("a fold panicked"));
        // Both threads still take jobs after the panic (each job goes to one of them).
        for _ in 0..4 {
            threads.spawn(name(tx.clone()));
        }
        for _ in 0..4 {
            let ran_on = rx
                .recv_timeout(Duration::from_secs(10))
                .expect("a job after the panic ran");
            assert!(ran_on.is_some_and(|n| n.starts_with("fold-")));
        }
    }

    fn new_store() -> (tempfile::TempDir, Store) {
        let (dir, store) = sled_store();
        (dir, std::sync::Arc::new(store))
    }

    /// The backend itself, for what reaches under the port (its event log).
    fn sled_store() -> (tempfile::TempDir, storage::SledStore) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("store");
        let store = storage::SledStore::open(&path, 8 * 1024 * 1024).expect("open");
        (dir, store)
    }

    /// Store a delivery of one user message of conversation `conv`; its typed event.
    fn accept(store: &dyn Storage, delivery: &str, event: &str, conv: &str) -> Event {
        let body = format!(
            r#"{{"id":"{delivery}","webhookId":"w","webhookUrl":"u","messages":[{{"id":"{event}","event":"bot.message.received","sourceType":"bot","sourceId":"B1","timestamp":1,"data":{{"message":{{"id":"m-{event}","conversationId":"{conv}","isUser":true,"meta":null,"data":{{"type":"text","text":"x"}}}}}}}}]}}"#
        );
        let parsed = model::webhook::parse_delivery(body.as_bytes()).expect("valid");
        store.accept(&parsed.id, &parsed.events, 1).expect("accept");
        parsed.events.into_iter().next().expect("one event").event
    }

    /// One fold at a time, no rules, the daemon's own priority, no lifting.
    fn plain_settings() -> DispatchSettings {
        DispatchSettings {
            concurrency: 1,
            batch_size: 10,
            rules: engine::rules::live::LiveRules::new(std::sync::Arc::new(
                engine::decide::NoRules,
            )),
            decided: None,
            verdicts: None,
            stuck: None,
            priority: crate::background::Priority::Nice(0),
            lift_after: None,
        }
    }

    /// Fold a job as a fold thread does, without rules.
    fn process_without_rules(store: &dyn Storage, job: Job, fold_from: Cursor) -> JobResult {
        let metrics = Metrics::new().expect("metrics");
        let fold = Fold {
            store,
            metrics: &metrics,
            rules: &engine::decide::NoRules,
            decided: None,
            verdicts: None,
            stuck: None,
        };
        process(&fold, job, fold_from)
    }

    fn push(q: &mut Queues, partition: &str, seq: u64) {
        q.push(conv(partition), seq, entry(seq));
    }

    fn finish(q: &mut Queues, partition: &str, done: &[u64], failed: &[u64]) {
        q.finish(Finished {
            partition: conv(partition),
            done: done.iter().map(|s| (*s, at(*s))).collect(),
            failed: failed.iter().map(|s| (*s, at(*s))).collect(),
        });
    }

    fn seqs(job: &Job) -> Vec<(PartitionKey, Vec<u64>)> {
        job.iter()
            .map(|(p, b)| (p.clone(), b.iter().map(|(s, _)| *s).collect()))
            .collect()
    }

    /// Several nodes: the active's dispatcher folds what another node stored (never handed to
    /// it), reading the store on from where it last read, each event once and in order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_active_of_a_shared_store_folds_what_another_node_stored_once_each() {
        let mem = storage::mem::MemStore::new();
        let other = mem.another_node();
        let lease = Duration::from_secs(3600);
        storage::lease::Lease::claim(&mem, "active", lease).expect("claim");
        let store: Store = std::sync::Arc::new(mem);
        let (stop_tx, stop_rx) = watch::channel(false);
        let terms = crate::cluster::Terms::single(&stop_rx);
        let metrics = Metrics::new().expect("metrics");
        let (handle, task) =
            start_shared(store.clone(), metrics.clone(), plain_settings(), terms).expect("start");
        let mut progress = handle.progress.clone();
        let conversation = |id: &str| {
            let state = store.conversation(&model::ids::ConversationId::new(id));
            state.expect("read").map_or(0, |s| s.events_applied)
        };
        for round in 0..2 {
            for i in 0..3 {
                let n = round * 3 + i;
                accept(
                    &other,
                    &format!("d{n}"),
                    &format!("e{n}"),
                    &format!("c{}", n % 2),
                );
            }
            while !store.pending().expect("pending").is_empty() {
                let changed = tokio::time::timeout(Duration::from_secs(20), progress.changed());
                changed.await.expect("folded in time").expect("running");
            }
        }
        assert_eq!((conversation("c0"), conversation("c1")), (3, 3));
        assert_eq!(metrics.events_applied.get(), 6, "each once");
        stop_tx.send(true).expect("stop");
        task.await.expect("stopped");
    }

    #[test]
    fn a_committed_fold_counts_its_queue_exits_and_the_accepted_waits() {
        use engine::state::stats::QueueExit;
        let (_dir, store) = new_store();
        let metrics = Metrics::new().expect("metrics");
        let fold = Fold {
            store: store.as_ref(),
            metrics: &metrics,
            rules: &engine::decide::NoRules,
            decided: None,
            verdicts: None,
            stuck: None,
        };
        let applied = storage::Applied {
            queue_exits: vec![
                (QueueExit::Accepted, Some(40_000)),
                (QueueExit::Accepted, Some(7_000_000)),
                (QueueExit::Cancelled, None),
                (QueueExit::TimedOut, None),
            ],
            ..Default::default()
        };
        fold_committed(&fold, applied, Vec::new());
        let exits = |exit: QueueExit| {
            metrics
                .queue_exits
                .with_label_values(&[exit.as_str()])
                .get()
        };
        assert_eq!(exits(QueueExit::Accepted), 2);
        assert_eq!(exits(QueueExit::Cancelled), 1);
        assert_eq!(exits(QueueExit::TimedOut), 1);
        assert_eq!(exits(QueueExit::Ended), 0);
        let waits = &metrics.time_to_accept_seconds;
        assert_eq!(waits.get_sample_count(), 2);
        assert_eq!(waits.get_sample_sum(), 7_040.0);
        let text = metrics.render();
        assert!(
            text.contains("handoff_time_to_accept_seconds_bucket{le=\"30\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("handoff_time_to_accept_seconds_bucket{le=\"45\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("handoff_time_to_accept_seconds_bucket{le=\"3600\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("handoff_time_to_accept_seconds_bucket{le=\"+Inf\"} 2"),
            "{text}"
        );
    }

    #[test]
    fn a_partition_is_handed_out_once_until_its_batch_finishes() {
        let mut q = Queues::default();
        push(&mut q, "a", 2);
        push(&mut q, "a", 1);
        push(&mut q, "b", 3);
        let job = q.next_job(10).expect("job");
        assert_eq!(
            seqs(&job),
            vec![(conv("a"), vec![1, 2]), (conv("b"), vec![3])]
        );
        push(&mut q, "a", 4);
        assert!(q.next_job(10).is_none(), "a and b are busy");
        finish(&mut q, "a", &[1, 2], &[]);
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
            push(&mut q, "a", s);
        }
        push(&mut q, "b", 4);
        let job = q.next_job(2).expect("job");
        assert_eq!(seqs(&job), vec![(conv("a"), vec![1, 2])]);
        // b is next in line; a's remaining event waits for a's batch to finish.
        let job = q.next_job(2).expect("job");
        assert_eq!(seqs(&job), vec![(conv("b"), vec![4])]);
        assert!(q.next_job(2).is_none());
        finish(&mut q, "a", &[1, 2], &[]);
        assert_eq!(
            seqs(&q.next_job(2).expect("job")),
            vec![(conv("a"), vec![3])]
        );
    }

    #[test]
    fn a_drained_burst_gives_its_tables_back() {
        let mut q = Queues::default();
        for i in 0..20_000u64 {
            push(&mut q, &format!("c{i}"), i);
        }
        assert!(q.pending.capacity() >= 20_000);
        while let Some(job) = q.next_job(256) {
            for (partition, batch) in job {
                q.finish(Finished {
                    partition,
                    done: batch.iter().map(|(s, e)| (*s, e.at)).collect(),
                    failed: Vec::new(),
                });
            }
        }
        assert_eq!(q.depth, 0);
        assert!(q.unfinished.is_empty());
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
        push(&mut q, "again", 30_000);
        assert_eq!(
            seqs(&q.next_job(10).expect("job")),
            vec![(conv("again"), vec![30_000])]
        );
    }

    #[test]
    fn failed_entries_go_back_in_order() {
        let mut q = Queues::default();
        for s in [5, 6, 7] {
            push(&mut q, "a", s);
        }
        let job = q.next_job(2).expect("job");
        assert_eq!(seqs(&job), vec![(conv("a"), vec![5, 6])]);
        finish(&mut q, "a", &[], &[5, 6]);
        assert_eq!(
            seqs(&q.next_job(10).expect("job")),
            vec![(conv("a"), vec![5, 6, 7])]
        );
        assert_eq!(q.depth, 3);
    }

    #[test]
    fn a_jobs_watermark_is_the_oldest_event_outside_it_whatever_order_jobs_commit_in() {
        let mut q = Queues {
            received_end: at(10),
            ..Queues::default()
        };
        for (p, s) in [("a", 1), ("b", 2), ("a", 3), ("c", 4)] {
            push(&mut q, p, s);
        }
        // Two jobs in flight at once: {a: 1, 3} and {b: 2, c: 4}.
        let first = q.next_job(2).expect("first");
        assert_eq!(seqs(&first), vec![(conv("a"), vec![1, 3])]);
        let second = q.next_job(2).expect("second");
        assert_eq!(
            seqs(&second),
            vec![(conv("b"), vec![2]), (conv("c"), vec![4])]
        );
        // Each stops at the oldest event the other holds: neither may claim it folded.
        assert_eq!(q.watermark(&first), at(2));
        assert_eq!(q.watermark(&second), at(1));
        // The second commits first; the first's watermark (computed at its start) stays at or
        // before everything unfolded after either commit.
        finish(&mut q, "b", &[2], &[]);
        finish(&mut q, "c", &[4], &[]);
        // A failed event keeps holding the watermark back.
        finish(&mut q, "a", &[1], &[3]);
        assert!(
            q.unfinished.keys().all(|where_| at(2) <= *where_),
            "the first job's watermark, committed last, is at or before what is left"
        );
        push(&mut q, "d", 9);
        let retry = q.next_job(1).expect("retry");
        assert_eq!(seqs(&retry), vec![(conv("a"), vec![3])]);
        assert_eq!(
            q.watermark(&retry),
            at(9),
            "the oldest event not in the retry"
        );
        let last = q.next_job(1).expect("last");
        assert_eq!(q.watermark(&last), at(3), "the retry is still unfinished");
        finish(&mut q, "a", &[3], &[]);
        finish(&mut q, "d", &[9], &[]);
        // Nothing left: the next job (of new events) may claim up to the received end.
        q.received_end = at(12);
        push(&mut q, "e", 11);
        let next = q.next_job(5).expect("next");
        assert_eq!(q.watermark(&next), at(12));
    }

    #[test]
    fn an_unreadable_event_is_quarantined_and_the_partitions_later_events_still_fold() {
        use storage::eventlog::{FrameEvent, Frames};
        let (_dir, backend) = sled_store();
        // An event this model cannot read (valid JSON, not an event), then a readable one, both
        // of conversation c1.
        let bad_seq = backend.next_seq();
        let mut frames = Frames::default();
        let partition = conv("c1").encode();
        frames.push(
            "d0",
            1,
            &[FrameEvent {
                seq: bad_seq,
                id: "e0",
                partition: &partition,
                raw: r#"{"id":"e0"}"#,
            }],
        );
        backend.intake_log().log_queue(frames).expect("queue");
        backend.intake_log().log_commit().expect("commit");
        let store: Store = std::sync::Arc::new(backend);
        accept(&*store, "d1", "e1", "c1");
        let pending = store.pending().expect("pending");
        assert_eq!(pending.len(), 2);
        let job: Job = vec![(
            conv("c1"),
            pending
                .events
                .iter()
                .map(|p| (p.seq, untyped(p.at)))
                .collect(),
        )];
        let results = process_without_rules(&*store, job, pending.end);
        assert_eq!(results.len(), 1);
        assert_eq!(results[0].done.len(), 2, "both settled");
        assert!(results[0].failed.is_empty());
        assert_eq!(store.quarantined().expect("quarantine").len(), 1);
        let state = store.conversation(&"c1".into()).expect("read").expect("c1");
        assert_eq!(state.events_applied, 1, "the readable event is folded");
        assert!(
            store.pending().expect("pending").is_empty(),
            "neither is to fold again (so not quarantined again after a restart)"
        );
    }

    #[test]
    fn a_fold_whose_read_failed_keeps_the_watermark_at_or_before_that_event() {
        let (_dir, store) = new_store();
        accept(&*store, "d0", "e0", "c0");
        let folded = store.pending().expect("pending");
        let e0 = &folded.events[0];
        let job = vec![(conv("c0"), vec![(e0.seq, untyped(e0.at))])];
        process_without_rules(&*store, job, folded.end);
        accept(&*store, "d1", "e1", "c1");
        accept(&*store, "d2", "e2", "c2");
        let pending = store.pending().expect("pending");
        let (e1, e2) = (&pending.events[0], &pending.events[1]);
        // e1's read fails (its entry names a frame that does not hold it, as a read error
        // would), while e2 of another partition folds in the same job.
        let job: Job = vec![
            (conv("c1"), vec![(e1.seq, untyped(e0.at))]),
            (conv("c2"), vec![(e2.seq, untyped(e2.at))]),
        ];
        // The dispatcher's watermark for a job holding every unfinished event: the log's end.
        let results = process_without_rules(&*store, job, pending.end);
        assert_eq!(results[0].failed.len(), 1, "e1 goes back to its queue");
        assert_eq!(results[1].done.len(), 1, "e2 folded");
        assert!(
            store.fold_from().expect("watermark") <= e1.at,
            "the watermark stays at or before the event that goes back"
        );
        let left: Vec<u64> = store
            .pending()
            .expect("pending")
            .events
            .iter()
            .map(|p| p.seq)
            .collect();
        assert_eq!(left, vec![e1.seq], "a restart still finds e1");
    }

    #[test]
    fn an_event_queued_twice_counts_once() {
        let mut q = Queues::default();
        push(&mut q, "a", 1);
        push(&mut q, "a", 1);
        assert_eq!((q.depth, q.unfinished.get(&at(1)).copied()), (1, Some(1)));
        // Queued again while its first copy is being folded (not done today: the start's scan
        // runs before intake starts; kept safe anyway): both copies count until both settle.
        let job = q.next_job(1).expect("job");
        push(&mut q, "a", 1);
        assert_eq!((q.depth, q.unfinished.get(&at(1)).copied()), (2, Some(2)));
        assert_eq!(q.watermark(&job), at(1), "the second copy holds it");
        finish(&mut q, "a", &[1], &[]);
        let again = q.next_job(1).expect("again");
        finish(&mut q, "a", &[1], &[]);
        assert_eq!(seqs(&again), vec![(conv("a"), vec![1])]);
        assert_eq!((q.depth, q.unfinished.len()), (0, 0));
    }

    /// Rules that hold the fold until the test opens the gate: a fold that does not get a CPU.
    struct Gate(std::sync::Mutex<std::sync::mpsc::Receiver<()>>);

    impl engine::decide::Decide for Gate {
        fn needs(&self) -> engine::decide::Needs {
            engine::decide::Needs::NONE
        }

        fn evaluate(
            &self,
            _: &Event,
            _: &engine::state::ConversationState,
            _: engine::decide::Inputs<'_>,
            _: engine::decide::DecisionTime,
        ) -> engine::decide::Decided {
            if let Ok(gate) = self.0.lock() {
                let _ = gate.recv_timeout(Duration::from_secs(60));
            }
            engine::decide::Decided::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_fold_waiting_past_lift_after_lifts_the_fold_threads_until_the_inbox_is_empty() {
        let (_dir, backend) = sled_store();
        let store: Store = std::sync::Arc::new(backend.clone());
        accept(&*store, "d1", "e1", "c1");
        // The intake a drain waits for (nothing reaches the dispatcher through it here).
        let hooks = storage::writer::WriterHooks {
            observe: Box::new(|_, _| {}),
            durable: Box::new(|_, _| {}),
        };
        let stuck = storage::Stuck::new().0;
        let writer = storage::writer::SledWriter::start(backend, hooks, stuck).expect("writer");
        let (open, gate) = std::sync::mpsc::channel();
        let settings = DispatchSettings {
            concurrency: 1,
            batch_size: 10,
            rules: engine::rules::live::LiveRules::new(std::sync::Arc::new(Gate(
                std::sync::Mutex::new(gate),
            ))),
            decided: None,
            verdicts: None,
            stuck: None,
            priority: crate::background::Priority::Idle,
            lift_after: Some(Duration::from_secs(1)),
        };
        let metrics = Metrics::new().expect("metrics");
        let (stop, stop_rx) = watch::channel(false);
        let (handle, task) =
            start(store.clone(), metrics.clone(), settings, stop_rx).expect("start");
        // The fold is held; daemon time passes (paused: at once) until the lift's deadline.
        let started = tokio::time::Instant::now();
        for _ in 0..100 {
            if metrics.fold_lifts.get() > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(metrics.fold_lifts.get(), 1, "lifted once");
        assert_eq!(metrics.fold_lifted.get(), 1);
        assert!(
            started.elapsed() >= Duration::from_secs(1),
            "not before lift_after: {:?}",
            started.elapsed()
        );
        // Lifted, it stays lifted (no second lift) while the fold is still held.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(metrics.fold_lifts.get(), 1);
        // The fold gets its CPU: the inbox empties and the threads go back under SCHED_IDLE.
        // Real time from here: the fold runs on its own thread, outside tokio's paused clock.
        tokio::time::resume();
        open.send(()).expect("open the gate");
        let drained = handle
            .wait_drained(&writer, Duration::from_secs(60))
            .await
            .expect("store");
        assert!(drained, "the held fold finished");
        assert_eq!(
            metrics.fold_lifted.get(),
            0,
            "lowered once the inbox is empty"
        );
        assert_eq!(metrics.fold_lifts.get(), 1);
        drop(stop);
        let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
    }

    /// A drained dispatcher raises the watermark at once the first time, then at most once per
    /// `RAISE_EVERY` (looking again when that is up), and never while events are queued or
    /// being folded, or when a fold already wrote the log's end.
    #[test]
    fn the_watermark_is_raised_at_most_once_a_second() {
        let at = |offset: u128| Cursor::from_raw((1 << 64) + offset);
        let t0 = tokio::time::Instant::now();
        let mut w = Watermark::new(at(0));
        assert_eq!(w.next(false, at(10), t0), Raise::Nothing, "not drained");
        assert_eq!(w.next(true, at(10), t0), Raise::Now(at(10)));
        assert_eq!(w.next(true, at(10), t0), Raise::Nothing, "already there");
        // The next event's fold wrote the watermark its job started with: behind again.
        w.committed(at(10));
        let soon = t0 + Duration::from_millis(5);
        assert_eq!(w.next(true, at(20), soon), Raise::Later(t0 + RAISE_EVERY));
        assert_eq!(w.next(false, at(30), soon), Raise::Nothing, "not drained");
        assert_eq!(w.next(true, at(30), t0 + RAISE_EVERY), Raise::Now(at(30)));
        // A fold that wrote the end itself needs no raise.
        w.committed(at(40));
        let later = t0 + RAISE_EVERY * 3;
        assert_eq!(w.next(true, at(40), later), Raise::Nothing);
        w.committed(at(40));
        assert_eq!(w.next(true, at(50), later), Raise::Now(at(50)));
    }

    /// Fold every event still to fold with the oldest possible watermark, as by a job that started
    /// first and committed last.
    fn fold_pending_behind(store: &dyn Storage) {
        let job: Job = store
            .pending()
            .expect("pending")
            .events
            .iter()
            .map(|p| (p.partition.clone(), vec![(p.seq, untyped(p.at))]))
            .collect();
        process_without_rules(store, job, Cursor::START);
    }

    /// Wait in real time until `done`, yielding to the dispatcher's task in between, without
    /// letting a paused clock move (it moves only when the runtime has nothing to run).
    async fn wait_unpaused(what: &str, done: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tokio::task::yield_now().await;
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// A dispatcher whose raise is held back by `RAISE_EVERY`: two jobs in flight at once each
    /// committed a watermark behind the log's end (the other's frame), within a second of the
    /// start's raise. Paused clock: it moves only when the test sleeps; the folds run on their
    /// threads in real time. Returns the log's end, the handle (the dispatcher stops waiting for
    /// events once it is dropped), the stop and the task.
    async fn held_back_raise(
        store: &Store,
    ) -> (
        Cursor,
        DispatchHandle,
        watch::Sender<bool>,
        tokio::task::JoinHandle<()>,
    ) {
        accept(store.as_ref(), "d1", "e1", "c1");
        fold_pending_behind(store.as_ref());
        let first_end = store.pending().expect("pending").end;
        let settings = DispatchSettings {
            concurrency: 2,
            batch_size: 1,
            ..plain_settings()
        };
        let metrics = Metrics::new().expect("metrics");
        let (stop, stop_rx) = watch::channel(false);
        let (handle, task) =
            start(store.clone(), metrics.clone(), settings, stop_rx).expect("start");
        let started = tokio::time::Instant::now();
        let at_first_end = || store.fold_from().expect("watermark") == first_end;
        wait_unpaused("the start's raise", at_first_end).await;

        handle.pause();
        let typed = [("d2", "e2", "c2"), ("d3", "e3", "c3")]
            .map(|(d, e, c)| accept(store.as_ref(), d, e, c));
        let pending = store.pending().expect("pending");
        let new: Vec<NewEvent> = pending
            .events
            .iter()
            .zip(typed)
            .map(|(p, event)| NewEvent {
                seq: p.seq,
                partition: p.partition.clone(),
                at: p.at,
                received_at: 1,
                event,
            })
            .collect();
        assert_eq!(new.len(), 2);
        handle.notify_events(new, pending.end);
        handle.resume();
        let folded = || store.pending().expect("pending").events.is_empty();
        wait_unpaused("the two events folded", folded).await;
        tokio::task::yield_now().await;
        assert!(tokio::time::Instant::now() < started + RAISE_EVERY);
        assert!(
            store.fold_from().expect("watermark") < pending.end,
            "raised again within a second of the last raise"
        );
        (pending.end, handle, stop, task)
    }

    /// A raise held back by `RAISE_EVERY` still comes once that is up, with no event to wake the
    /// dispatcher.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_raise_held_back_a_second_comes_when_the_second_is_up() {
        let (_dir, store) = new_store();
        let (end, _handle, stop, task) = held_back_raise(&store).await;
        tokio::time::sleep(RAISE_EVERY).await;
        let at_end = || store.fold_from().expect("watermark") == end;
        wait_unpaused("the held-back raise once the second is up", at_end).await;
        let _ = stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
    }

    /// A stop within the second makes the raise held back, so the next start does not scan
    /// those events again.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_stop_makes_the_raise_held_back() {
        let (_dir, store) = new_store();
        let (end, _handle, stop, task) = held_back_raise(&store).await;
        let _ = stop.send(true);
        wait_unpaused("the stop", || task.is_finished()).await;
        task.await.expect("no panic");
        assert_eq!(store.fold_from().expect("watermark"), end);
    }

    /// A start that finds everything folded behind an old watermark (the commit that wrote it
    /// last had started before others ended), and a drain, leave it at the log's end: the next
    /// start does not scan those events again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_drained_dispatcher_raises_the_watermark_to_the_log_s_end() {
        let (_dir, store) = new_store();
        accept(&*store, "d1", "e1", "c1");
        accept(&*store, "d2", "e2", "c2");
        let end = store.pending().expect("pending").end;
        fold_pending_behind(&*store);
        assert_eq!(store.fold_from().expect("watermark"), Cursor::START);
        assert!(store.pending().expect("pending").events.is_empty());

        let settings = plain_settings();
        let metrics = Metrics::new().expect("metrics");
        let (stop, stop_rx) = watch::channel(false);
        let (_handle, task) =
            start(store.clone(), metrics.clone(), settings, stop_rx).expect("start");
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while store.fold_from().expect("watermark") != end {
            assert!(
                std::time::Instant::now() < deadline,
                "the watermark stayed at {:?}, the log ends at {end:?}",
                store.fold_from()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
    }

    /// A stop sender dropped without saying stop (its owner gone) ends the dispatcher, as a stop
    /// does; it must not spin on a `changed` that is ready at once forever. Real time, on two
    /// threads: a spinning dispatcher keeps its thread busy, and the bound below then fails.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_stop_sender_ends_the_dispatcher() {
        let (_dir, store) = new_store();
        let settings = plain_settings();
        let metrics = Metrics::new().expect("metrics");
        let (stop, stop_rx) = watch::channel(false);
        let (_handle, task) = start(store, metrics, settings, stop_rx).expect("start");
        drop(stop);
        let ended = tokio::time::timeout(std::time::Duration::from_secs(10), task).await;
        assert!(
            ended.is_ok(),
            "the dispatcher still runs 10 s after its stop sender was dropped"
        );
    }
}
