//! The writer: two threads that own the intake write path.
//!
//! Handlers hand it parsed deliveries and wait. The writer thread takes every delivery queued at
//! that moment and checks the whole group for duplicates ([`SledStore::check`]: sled reads, no
//! transaction). The syncer thread appends the group's new events to the event log, syncs it
//! (once for all groups that are ready) and answers them; the indexer thread then puts their ids
//! into the dedupe index, advances the checkpoint (one small sled write) and passes the events on
//! to the dispatcher, while the writer already checks the next group. So a group costs at most
//! one `fdatasync`, HTTP workers never wait on sled's global lock, and only one flush is ever in
//! flight (sled 0.34's `flush_async` hangs when several are).
//!
//! Sled itself flushes in the background (every 500 ms); a checkpoint it has not flushed at a
//! crash is advanced again from the log on open. An explicit [`Writer::flush`] flushes it at once.

use super::eventlog::LogPosition;
use super::{
    AcceptRequest, Accepted, Checked, IntakeLog, QuarantineRecord, SledStore, Store, Unindexed,
};
pub use crate::port::Writer;
use crate::port::{IntakeReply, IntakeWriter, Lifecycle};
use model::cursor::Cursor;
use model::ids::{DeliveryId, PartitionKey};
use model::webhook::model::{Event, Millis};
use model::webhook::IncomingEvent;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// At most this many deliveries share a group (bounds its check's and its frames' size).
const MAX_GROUP: usize = 512;

/// A delivery for the writer to store.
pub struct AcceptJob {
    pub delivery: DeliveryId,
    pub events: Vec<IncomingEvent>,
    pub invalid: Vec<QuarantineRecord>,
    pub received_at: Millis,
}

impl AcceptJob {
    pub fn request(&self) -> AcceptRequest<'_> {
        AcceptRequest {
            delivery: &self.delivery,
            events: &self.events,
            invalid: &self.invalid,
            received_at: self.received_at,
        }
    }
}

/// A newly durable event, for the dispatcher.
#[derive(Debug)]
pub struct NewEvent {
    pub seq: u64,
    pub partition: PartitionKey,
    /// Where it is in the log (where a fold reads it back, and the folds' watermark).
    pub at: Cursor,
    pub received_at: Millis,
    pub event: Event,
}

/// What the writer reports after each group, without tying this module to metrics or dispatch.
pub struct WriterHooks {
    /// (time the group took to become durable, deliveries in it).
    pub observe: Observe,
    /// Newly durable events, in acceptance order, and where the log ends after them.
    pub durable: Durable,
}

/// See [`WriterHooks::observe`].
pub type Observe = Box<dyn Fn(Duration, usize) + Send>;
/// See [`WriterHooks::durable`].
pub type Durable = Box<dyn Fn(Vec<NewEvent>, Cursor) + Send>;

enum Job {
    Accept(AcceptJob, oneshot::Sender<Result<Accepted, WriterError>>),
    /// Flush sled: makes durable whatever was written to the store directly before it.
    Flush(oneshot::Sender<Result<(), WriterError>>),
}

/// The sled backend's intake ([`IntakeWriter`]): the writer, syncer and indexer threads, reached
/// through the port's [`Writer`] handle. Cloning is cheap; the threads end when every handle is
/// gone.
#[derive(Clone)]
pub struct SledWriter {
    tx: mpsc::UnboundedSender<Job>,
    /// Straight to the indexer, for [`IntakeWriter::flush_own`].
    indexer: std::sync::mpsc::Sender<ToIndexer>,
    health: Arc<Health>,
    /// The store, once sled is open (see [`SledWriter::start_early`]), for the threads and for
    /// the port.
    store: Arc<Stores>,
    /// The event log (its hand-over count, [`IntakeWriter::handed_over`]).
    log: IntakeLog,
}

/// The store as the writer's threads take it, and as the port hands it out.
struct Stores {
    sled: tokio::sync::watch::Sender<Option<SledStore>>,
    port: tokio::sync::watch::Sender<Option<Store>>,
}

/// What attaches a writer started early to its store once sled is open
/// ([`SledWriter::start_early`]). It lets go of the writer once it has attached, so the writer's
/// threads (and the store) end with their last handle, as after [`SledWriter::start`].
pub struct EarlyAttach {
    writer: std::sync::Mutex<Option<(std::sync::mpsc::Sender<ToIndexer>, Arc<Stores>)>>,
    health: Arc<Health>,
}

/// Set by the writer and syncer (checks, log writes) and by the indexer (checkpoint writes).
#[derive(Debug)]
struct Health {
    log: AtomicBool,
    index: AtomicBool,
    /// Where the indexer reports a store only a restart mends.
    stuck: super::Stuck,
}

/// At most this many logged events wait for the indexer (see [`IndexBacklog`]).
const MAX_INDEX_BACKLOG: usize = 8192;

/// Events the syncer handed the indexer that are not indexed yet. Each holds its typed form and
/// its ids in memory until then, and nothing else slows intake down to the indexer's
/// pace: so the syncer waits while there are [`MAX_INDEX_BACKLOG`] of them, and a burst faster
/// than sled lengthens acknowledgments instead of growing memory without bound.
#[derive(Default)]
struct IndexBacklog {
    events: std::sync::Mutex<usize>,
    room: std::sync::Condvar,
}

impl IndexBacklog {
    /// Wait for room, then count `n` more events. A failing indexer (whose backlog cannot
    /// shrink) is not waited for: intake then fails or succeeds on its own, on the event log.
    fn reserve(&self, n: usize, health: &Health) {
        let Ok(mut events) = self.events.lock() else {
            return;
        };
        while *events >= MAX_INDEX_BACKLOG && health.index.load(Ordering::Relaxed) {
            match self.room.wait_timeout(events, INDEX_RETRY_PAUSE) {
                Ok((guard, _)) => events = guard,
                Err(_) => return,
            }
        }
        *events += n;
    }

    fn release(&self, n: usize) {
        if let Ok(mut events) = self.events.lock() {
            *events = events.saturating_sub(n);
            self.room.notify_all();
        }
    }

    /// The indexer just failed: wake a syncer waiting for room, which then stops waiting.
    fn indexer_failed(&self) {
        self.room.notify_all();
    }

    #[cfg(test)]
    fn count(&self) -> usize {
        self.events.lock().map_or(0, |e| *e)
    }
}

impl SledWriter {
    /// Start the writer threads on an open store (which has already replayed any leftover log).
    /// A store only a restart mends is reported to `stuck`.
    pub fn start(
        store: SledStore,
        hooks: WriterHooks,
        stuck: super::Stuck,
    ) -> Result<Writer, super::StoreError> {
        let log = store.intake_log().clone();
        let (writer, attach) = SledWriter::start_early(log, hooks.observe, stuck)?;
        attach.attach(store, hooks.durable);
        Ok(writer)
    }

    /// Start on an event log opened before sled ([`IntakeLog::open_early`]): deliveries are
    /// checked, logged, synced and answered at once, while their indexing (the checkpoint, in
    /// sled) and their hand-over wait for [`EarlyAttach::attach`]. So at most
    /// [`MAX_INDEX_BACKLOG`] events are answered before the store is attached; later deliveries
    /// wait for it. A delivery with events to quarantine (in sled) is refused until then
    /// ([`super::StoreError::Opening`]): intake waits for [`Writer::store`] first.
    pub fn start_early(
        log: IntakeLog,
        observe: Observe,
        stuck: super::Stuck,
    ) -> Result<(Writer, EarlyAttach), super::StoreError> {
        log.start_writer()?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (indexer, from_syncer) = std::sync::mpsc::channel::<ToIndexer>();
        let health = Arc::new(Health {
            log: AtomicBool::new(true),
            index: AtomicBool::new(true),
            stuck,
        });
        let (sled, store_rx) = tokio::sync::watch::channel(None);
        let store = Arc::new(Stores {
            sled,
            port: tokio::sync::watch::channel(None).0,
        });
        let (flag, to_indexer, thread_log) = (health.clone(), indexer.clone(), log.clone());
        std::thread::Builder::new()
            .name("store-writer".into())
            .spawn(move || {
                run(
                    thread_log,
                    store_rx,
                    rx,
                    (to_indexer, from_syncer),
                    observe,
                    flag,
                )
            })
            .map_err(|e| super::StoreError::Internal(format!("cannot start the writer: {e}")))?;
        let attach = EarlyAttach {
            writer: std::sync::Mutex::new(Some((indexer.clone(), store.clone()))),
            health: health.clone(),
        };
        let writer = SledWriter {
            tx,
            indexer,
            health,
            store,
            log,
        };
        Ok((Writer::new(Arc::new(writer)), attach))
    }
}

impl EarlyAttach {
    /// Give a writer started early its store, now open, and the hook that hands new events to
    /// the dispatcher: the indexer indexes what was logged meanwhile, hands it on, and goes on
    /// as after [`SledWriter::start`].
    pub fn attach(&self, store: SledStore, durable: Durable) {
        let writer = self.writer.lock().ok().and_then(|mut w| w.take());
        let Some((indexer, stores)) = writer else {
            tracing::error!("a writer attached twice; the second store is left alone");
            return;
        };
        stores.sled.send_replace(Some(store.clone()));
        stores.port.send_replace(Some(Arc::new(store.clone())));
        if indexer
            .send(ToIndexer::Attach(Box::new((store, durable))))
            .is_err()
        {
            tracing::error!("the store indexer stopped before the store opened");
            self.health.index.store(false, Ordering::Relaxed);
        }
    }
}

impl IntakeWriter for SledWriter {
    fn accept(&self, job: AcceptJob, reply: IntakeReply<Accepted>) {
        // A stopped writer drops the job and its reply: the caller hears it stopped.
        let _ = self.tx.send(Job::Accept(job, reply));
    }

    fn flush(&self, reply: IntakeReply<()>) {
        let _ = self.tx.send(Job::Flush(reply));
    }

    /// One `Db::flush` by the indexer, which it shares with every flush asked for meanwhile,
    /// without the writer and the syncer (two thread hops).
    fn flush_own(&self, reply: IntakeReply<()>) {
        let waiters = FlushWaiters {
            flushes: vec![reply],
            replies: Vec::new(),
        };
        if let Err(std::sync::mpsc::SendError(ToIndexer::Flush(mut waiters))) =
            self.indexer.send(ToIndexer::Flush(waiters))
        {
            // No indexer (it failed to start, or stopped): the writer's way.
            if let Some(reply) = waiters.flushes.pop() {
                self.flush(reply);
            }
        }
    }

    /// False after a write or sync failed, until one succeeds again.
    fn is_healthy(&self) -> bool {
        self.health.log.load(Ordering::Relaxed) && self.health.index.load(Ordering::Relaxed)
    }

    fn store(&self) -> tokio::sync::watch::Receiver<Option<Store>> {
        self.store.port.subscribe()
    }

    fn handed_over(&self) -> Option<u64> {
        self.log.all_indexed().then(|| self.log.handed_over())
    }
}

/// Why the writer could not take a delivery or flush.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WriterError {
    /// The writer stopped (shutdown): retrying cannot help.
    #[error("writer stopped")]
    Stopped,
    /// The event log or the store failed; a later call may succeed.
    #[error("{0}")]
    Store(String),
    /// The store is still opening (an early start): what needs it waits or is refused.
    #[error("the store is still opening")]
    Opening,
}

/// A checked group on its way to the syncer.
struct Group {
    checked: Checked,
    replies: Vec<oneshot::Sender<Result<Accepted, WriterError>>>,
    new_events: Vec<NewEvent>,
    /// Waiters for a sled flush (folds' decisions, admin writes).
    flushes: Vec<oneshot::Sender<Result<(), WriterError>>>,
    started: Instant,
}

/// The checking side: group, dedupe, pass on. The sync of one group overlaps the check of the
/// next.
fn run(
    log: IntakeLog,
    store_rx: tokio::sync::watch::Receiver<Option<SledStore>>,
    mut rx: mpsc::UnboundedReceiver<Job>,
    indexer: IndexerChannel,
    observe: Observe,
    health: Arc<Health>,
) {
    let healthy = &health.log;
    let (to_syncer, from_writer) = std::sync::mpsc::channel::<Group>();
    let syncer = spawn_syncer(&log, &store_rx, from_writer, indexer, observe, &health);
    // Known once attached (see `Writer::start_early`).
    let mut store: Option<SledStore> = None;
    let syncer = match syncer {
        Ok(handle) => handle,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the store syncer");
            healthy.store(false, Ordering::Relaxed);
            return;
        }
    };
    while let Some(first) = rx.blocking_recv() {
        let (accepts, flushes) = take_jobs(first, &mut rx);
        let group = check_group(&log, (&store_rx, &mut store), accepts, flushes, healthy);
        if to_syncer.send(group).is_err() {
            tracing::error!("the store syncer stopped");
            healthy.store(false, Ordering::Relaxed);
            break;
        }
    }
    drop(to_syncer);
    // The syncer finishes what it has and flushes sled.
    let _ = syncer.join();
}

/// Start the syncer thread on the writer's log, store and channels.
fn spawn_syncer(
    log: &IntakeLog,
    store_rx: &tokio::sync::watch::Receiver<Option<SledStore>>,
    from_writer: std::sync::mpsc::Receiver<Group>,
    indexer: IndexerChannel,
    observe: Observe,
    health: &Arc<Health>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let syncer_log = log.clone();
    let syncer_store = store_rx.clone();
    let syncer_health = health.clone();
    std::thread::Builder::new()
        .name("store-syncer".into())
        .spawn(move || {
            sync_loop(
                (syncer_log, syncer_store),
                from_writer,
                indexer,
                observe,
                syncer_health,
            )
        })
}

/// A delivery waiting for the writer, with its handler's reply channel.
type PendingAccept = (AcceptJob, oneshot::Sender<Result<Accepted, WriterError>>);

/// One group's jobs: `first` and whatever else is queued now, up to [`MAX_GROUP`].
fn take_jobs(
    first: Job,
    rx: &mut mpsc::UnboundedReceiver<Job>,
) -> (
    Vec<PendingAccept>,
    Vec<oneshot::Sender<Result<(), WriterError>>>,
) {
    let mut accepts = Vec::new();
    let mut flushes = Vec::new();
    let mut take = |job| match job {
        Job::Accept(job, reply) => accepts.push((job, reply)),
        Job::Flush(reply) => flushes.push(reply),
    };
    take(first);
    for _ in 1..MAX_GROUP {
        match rx.try_recv() {
            Ok(job) => take(job),
            Err(_) => break,
        }
    }
    (accepts, flushes)
}

/// Check a group's deliveries for duplicates and build what the syncer logs and answers; a
/// group that cannot be checked is answered here and passes on only its flushes.
fn check_group(
    log: &IntakeLog,
    (store_rx, store): (
        &tokio::sync::watch::Receiver<Option<SledStore>>,
        &mut Option<SledStore>,
    ),
    accepts: Vec<PendingAccept>,
    flushes: Vec<oneshot::Sender<Result<(), WriterError>>>,
    healthy: &AtomicBool,
) -> Group {
    let started = Instant::now();
    let requests: Vec<AcceptRequest<'_>> = accepts.iter().map(|(job, _)| job.request()).collect();
    if store.is_none() {
        *store = store_rx.borrow().clone();
    }
    let checked = log.check(&requests, store.as_ref());
    drop(requests);
    let mut group = Group {
        checked: Checked::default(),
        replies: Vec::new(),
        new_events: Vec::new(),
        flushes,
        started,
    };
    match checked {
        Ok(checked) => fill_group(&mut group, accepts, checked),
        // A group with something to quarantine before the store opened (intake waits for the
        // store first): refused, not a failure.
        Err(super::StoreError::Opening) => {
            for (_, reply) in accepts {
                let _ = reply.send(Err(WriterError::Opening));
            }
        }
        Err(e) => {
            tracing::error!(error = %e, deliveries = accepts.len(), "cannot check deliveries");
            healthy.store(false, Ordering::Relaxed);
            for (_, reply) in accepts {
                let _ = reply.send(Err(WriterError::Store(e.to_string())));
            }
            // Flushes still go through the syncer, after what it already has.
        }
    }
    group
}

/// Give a checked group its deliveries' new events (in acceptance order), reply channels and
/// check.
fn fill_group(group: &mut Group, accepts: Vec<PendingAccept>, checked: Checked) {
    for ((job, reply), accepted) in accepts.into_iter().zip(&checked.accepted) {
        let received_at = job.received_at;
        let new = accepted.pick_new(job.events);
        group
            .new_events
            .extend(accepted.new.iter().zip(new).map(|((seq, partition), ev)| {
                NewEvent {
                    seq: *seq,
                    partition: partition.clone(),
                    // Known once the syncer queues the frames.
                    at: Cursor::START,
                    received_at,
                    event: ev.event,
                }
            }));
        group.replies.push(reply);
    }
    group.checked = checked;
}

/// Logged groups waiting for the indexer: what the syncer hands it after each sync, gathered
/// while the indexer was busy (so one round may cover several syncs), and kept after a failed
/// checkpoint write, which the next round retries first.
#[derive(Default)]
struct Backlog {
    groups: Vec<Unindexed>,
    new_events: Vec<NewEvent>,
    /// The log's end after the newest of them.
    to: Option<LogPosition>,
}

/// Callers waiting for a sled flush, answered by the indexer after its next round.
#[derive(Default)]
struct FlushWaiters {
    /// [`Writer::flush`] calls.
    flushes: Vec<oneshot::Sender<Result<(), WriterError>>>,
    /// Deliveries with quarantined events, logged and judged: their answer holds only once the
    /// quarantine records (written to sled by the check) are flushed.
    replies: Vec<(oneshot::Sender<Result<Accepted, WriterError>>, Accepted)>,
}

impl FlushWaiters {
    fn is_empty(&self) -> bool {
        self.flushes.is_empty() && self.replies.is_empty()
    }

    fn append(&mut self, other: &mut FlushWaiters) {
        self.flushes.append(&mut other.flushes);
        self.replies.append(&mut other.replies);
    }

    fn answer(self, flushed: Result<(), WriterError>) {
        for reply in self.flushes {
            let _ = reply.send(flushed.clone());
        }
        for (reply, accepted) in self.replies {
            let _ = reply.send(flushed.clone().map(|()| accepted));
        }
    }
}

impl Backlog {
    /// Index everything waiting; on success hand the events on. The hand-over is counted before
    /// their ids leave the in-flight set and sent after (see `DispatchHandle::wait_drained`).
    fn index(&mut self, store: &SledStore, durable: &Durable) -> Result<(), super::StoreError> {
        let Some(to) = self.to else { return Ok(()) };
        store.index(&self.groups, to).inspect_err(|e| {
            tracing::error!(error = %e, "cannot index logged events; will retry (they are durable)");
        })?;
        self.to = None;
        let events = std::mem::take(&mut self.new_events);
        let handing_on = !events.is_empty();
        let log = store.intake_log();
        if handing_on {
            log.count_hand_over();
        }
        log.release(&self.groups);
        self.groups.clear();
        if handing_on {
            durable(events, to.into());
        }
        Ok(())
    }
}

/// The indexer's channel: the syncer's sender (writers hold clones, see [`Writer::flush_own`])
/// and the indexer's receiver.
type IndexerChannel = (
    std::sync::mpsc::Sender<ToIndexer>,
    std::sync::mpsc::Receiver<ToIndexer>,
);

/// What the syncer (and [`Writer::flush_own`]) hands the indexer.
enum ToIndexer {
    /// Groups just synced, with the log's end after them.
    Index(Backlog),
    /// Callers to answer after a sled flush.
    Flush(FlushWaiters),
    /// The store is open (see [`Writer::attach`]): index from now on.
    Attach(Box<(SledStore, Durable)>),
}

fn flush_store(store: &SledStore) -> Result<(), WriterError> {
    answer_of(&store.flush())
}

/// What those waiting for a flush are answered.
fn answer_of(flushed: &Result<(), super::StoreError>) -> Result<(), WriterError> {
    flushed.as_ref().map_err(|e| {
        tracing::error!(error = %e, "store flush failed");
        WriterError::Store(e.to_string())
    })?;
    Ok(())
}

/// The indexing side: dedupe index, checkpoint and hand-over for what the syncer logged, off the syncer's thread, so
/// the next sync need not wait for the last one's index. Groups arrive in log order and are
/// indexed in that order; until indexed, their ids stay in the in-flight set (see `intake`).
/// It is also the one caller of `Db::flush` while the writer runs: a flush asked for after some
/// groups runs after their checkpoint write, and the syncer never waits for sled.
fn index_loop(
    rx: std::sync::mpsc::Receiver<ToIndexer>,
    health: Arc<Health>,
    waiting: Arc<IndexBacklog>,
) {
    let mut backlog = Backlog::default();
    let mut waiters = FlushWaiters::default();
    // Until attached (an early start's sled still opening), logged groups and flush waiters
    // only gather.
    let mut attached: Option<(SledStore, Durable)> = None;
    // The last failed attempt was followed by a successful probe write: another failure means
    // sled is stuck, not the disk full.
    let mut disk_was_writable = false;
    loop {
        // With a backlog left by a failed checkpoint write, try again after a pause even if nothing
        // new comes.
        let retrying = backlog.to.is_some() && attached.is_some();
        let Ok(next) = next_for_indexer(&rx, retrying) else {
            break;
        };
        if let Some(message) = next {
            absorb(&mut backlog, &mut waiters, &mut attached, message);
            while let Ok(more) = rx.try_recv() {
                absorb(&mut backlog, &mut waiters, &mut attached, more);
            }
        }
        let Some((store, durable)) = &attached else {
            continue;
        };
        let indexed = index_round(
            &mut backlog,
            &mut waiters,
            (store, durable),
            &health,
            &waiting,
        );
        match judge_index_round(indexed, store, disk_was_writable) {
            Ok(writable) => disk_was_writable = writable,
            // Reported; the indexer stops (the daemon ends for a restart).
            Err(_) => {
                health.stuck.report();
                break;
            }
        }
    }
    finish_indexing(backlog, waiters, attached);
}

/// The indexer's next message: `Ok(None)` when retrying and the pause passed without one,
/// `Err` once the syncer (and every writer) is gone.
fn next_for_indexer(
    rx: &std::sync::mpsc::Receiver<ToIndexer>,
    retrying: bool,
) -> Result<Option<ToIndexer>, std::sync::mpsc::RecvError> {
    if retrying {
        match rx.recv_timeout(INDEX_RETRY_PAUSE) {
            Ok(message) => Ok(Some(message)),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Ok(None),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(std::sync::mpsc::RecvError),
        }
    } else {
        rx.recv().map(Some)
    }
}

/// Add a message to what the indexer's next round handles.
fn absorb(
    backlog: &mut Backlog,
    waiters: &mut FlushWaiters,
    attached: &mut Option<(SledStore, Durable)>,
    message: ToIndexer,
) {
    match message {
        ToIndexer::Index(mut more) => {
            backlog.groups.append(&mut more.groups);
            backlog.new_events.append(&mut more.new_events);
            backlog.to = more.to.or(backlog.to);
        }
        ToIndexer::Flush(mut more) => waiters.append(&mut more),
        ToIndexer::Attach(store) => *attached = Some(*store),
    }
}

/// One indexer round: index the backlog, flush sled for the waiters, set the indexer's health
/// and answer the waiters; returns how the store fared.
fn index_round(
    backlog: &mut Backlog,
    waiters: &mut FlushWaiters,
    (store, durable): (&SledStore, &Durable),
    health: &Health,
    waiting: &IndexBacklog,
) -> Result<(), super::StoreError> {
    let events = backlog.new_events.len();
    let indexed = backlog.index(store, durable);
    if indexed.is_ok() {
        waiting.release(events);
    } else {
        waiting.indexer_failed();
    }
    // Whatever the index did: what the waiters wrote is theirs, and a failing sled fails
    // the flush too.
    let flushed = match waiters.is_empty() {
        true => Ok(()),
        false => store.flush(),
    };
    // A failed sync of sled's file fails every flush from then on (`durable`), even while
    // sled's own writes work: the store has failed as much as when sled's writer has.
    let failed = store.sync_failure();
    // Health first: whoever is answered a failed flush finds the writer unhealthy.
    health.index.store(
        indexed.is_ok() && flushed.is_ok() && failed.is_ok(),
        Ordering::Relaxed,
    );
    if !waiters.is_empty() {
        std::mem::take(waiters).answer(answer_of(&flushed));
    }
    indexed.and(flushed).and(failed)
}

/// After a round: whether it failed on a disk that takes writes (probed); a second disk failure
/// once it does means sled is stuck ([`StoreError::Stuck`](super::StoreError::Stuck): the daemon
/// exits for a restart).
fn judge_index_round(
    indexed: Result<(), super::StoreError>,
    store: &SledStore,
    disk_was_writable: bool,
) -> Result<bool, super::StoreError> {
    match indexed {
        Ok(()) => Ok(false),
        Err(e) if disk_was_writable && e.is_disk_failure() => {
            // sled 0.34 keeps the first I/O error of its log writer and returns it from
            // every later call: a store that once hit a full disk stays failed after space
            // returns, and only reopening it helps. Exit as a crash would (everything
            // acknowledged is in the event log, found again on open), so the supervisor
            // restarts the daemon on a store that works.
            tracing::error!(
                error = %e,
                exit_code = STORE_STUCK_EXIT,
                "the store still fails although its disk takes writes again; exiting so a \
                 restart reopens it"
            );
            Err(super::StoreError::Stuck)
        }
        Err(e) if e.is_disk_failure() => Ok(store.takes_writes()),
        Err(_) => Ok(false),
    }
}

/// The syncer is gone: index what is left, so the next start has nothing to index again, and
/// leave sled complete. Not attached: it is all in the log, which the next start indexes.
fn finish_indexing(
    mut backlog: Backlog,
    waiters: FlushWaiters,
    attached: Option<(SledStore, Durable)>,
) {
    match attached {
        Some((store, durable)) => {
            let _ = backlog.index(&store, &durable);
            let flushed = flush_store(&store);
            if flushed.is_err() {
                tracing::error!(
                    "final store flush failed; the next start scans the log's tail again"
                );
            }
            waiters.answer(flushed);
        }
        None => waiters.answer(Err(WriterError::Opening)),
    }
}

/// Give a group's new events their frame locations. They are in the order of the group's rows.
fn locate(events: &mut [NewEvent], group: &Unindexed) {
    let mut located = group.locations();
    for event in events {
        let at = match located.next() {
            Some((seq, at)) if seq == event.seq => Some(at),
            // Not expected (the writer builds both in one order); a wrong location would make a
            // fold read the wrong frame, so look it up.
            _ => {
                tracing::error!(seq = event.seq, "new event out of its group's frame order");
                group
                    .locations()
                    .find(|(seq, _)| *seq == event.seq)
                    .map(|(_, at)| at)
            }
        };
        if let Some(at) = at {
            event.at = at.into();
        }
    }
}

/// Exit status of a daemon whose store failed for good in this process (EX_TEMPFAIL: a
/// restart is expected to help).
pub const STORE_STUCK_EXIT: i32 = 75;

/// Pause after a failed checkpoint write.
const INDEX_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// The durability side: append the groups that are ready to the event log, sync once, answer;
/// hand them to the indexer, and with them those who wait for a sled flush (so an
/// acknowledgment never waits for sled).
fn sync_loop(
    (store, attached): (IntakeLog, tokio::sync::watch::Receiver<Option<SledStore>>),
    rx: std::sync::mpsc::Receiver<Group>,
    (to_indexer, from_syncer): IndexerChannel,
    observe: Observe,
    health: Arc<Health>,
) {
    let waiting = Arc::new(IndexBacklog::default());
    let indexer = spawn_indexer(from_syncer, &health, &waiting);
    while let Ok(first) = rx.recv() {
        let mut groups = vec![first];
        while let Ok(more) = rx.try_recv() {
            groups.push(more);
        }
        let (synced, logged) = log_groups(&store, &mut groups);
        let waiters = answer_groups(&store, &mut groups, &logged, &observe);
        health.log.store(logged.is_ok(), Ordering::Relaxed);
        if synced.to.is_some() {
            waiting.reserve(synced.new_events.len(), &health);
            if to_indexer.send(ToIndexer::Index(synced)).is_err() {
                // Logged and answered, so not lost: the next start indexes the log's tail.
                tracing::error!("the store indexer stopped");
                health.index.store(false, Ordering::Relaxed);
            }
        }
        if !waiters.is_empty() {
            if let Err(std::sync::mpsc::SendError(ToIndexer::Flush(waiters))) =
                to_indexer.send(ToIndexer::Flush(waiters))
            {
                // No indexer (it failed to start, or stopped): flush here rather than leave them
                // waiting.
                waiters.answer(flush_attached(&attached));
            }
        }
    }
    // The writer is gone: let the indexer finish (it leaves sled complete); without one, leave
    // sled complete here.
    drop(to_indexer);
    let finished = indexer.is_some_and(|indexer| indexer.join().is_ok());
    // (Never attached: nothing was written to the store.)
    if !finished && attached.borrow().is_some() {
        if let Err(e) = flush_attached(&attached) {
            tracing::error!(error = %e, "final store flush failed; the next start scans the log's tail again");
        }
    }
}

/// Start the indexer thread; without one, both halves of the writer are unhealthy.
fn spawn_indexer(
    from_syncer: std::sync::mpsc::Receiver<ToIndexer>,
    health: &Arc<Health>,
    waiting: &Arc<IndexBacklog>,
) -> Option<std::thread::JoinHandle<()>> {
    let indexer = {
        let (health, waiting) = (health.clone(), waiting.clone());
        std::thread::Builder::new()
            .name("store-indexer".into())
            .spawn(move || index_loop(from_syncer, health, waiting))
    };
    match indexer {
        Ok(handle) => Some(handle),
        Err(e) => {
            tracing::error!(error = %e, "cannot start the store indexer");
            health.log.store(false, Ordering::Relaxed);
            health.index.store(false, Ordering::Relaxed);
            None
        }
    }
}

/// Append the groups' frames to the event log and sync it once. On success returns what the
/// indexer is to index; on failure discards the frames and frees their ids.
fn log_groups(store: &IntakeLog, groups: &mut [Group]) -> (Backlog, Result<(), WriterError>) {
    let mut queued = Ok(());
    for group in groups.iter_mut() {
        match store.log_queue(std::mem::take(&mut group.checked.frames)) {
            Ok(at) => {
                group.checked.unindexed.located(at);
                locate(&mut group.new_events, &group.checked.unindexed);
            }
            Err(e) => queued = Err(e),
        }
    }
    let committed = queued.and_then(|()| store.log_commit());
    let mut synced = Backlog::default();
    let logged = match committed {
        Ok(to) => {
            synced.to = Some(to);
            for group in groups.iter_mut() {
                synced
                    .groups
                    .push(std::mem::take(&mut group.checked.unindexed));
                synced
                    .new_events
                    .append(&mut std::mem::take(&mut group.new_events));
            }
            Ok(())
        }
        Err(e) => {
            tracing::error!(error = %e, "event log write failed; answering 503");
            store.log_discard();
            for group in groups.iter() {
                store.release_failed(std::slice::from_ref(&group.checked.unindexed));
            }
            Err(WriterError::Store(e.to_string()))
        }
    };
    (synced, logged)
}

/// Answer the groups' deliveries as `logged` says, except those whose answer waits for a sled
/// flush (quarantined events): returned with the groups' flush waiters, for the indexer.
fn answer_groups(
    store: &IntakeLog,
    groups: &mut [Group],
    logged: &Result<(), WriterError>,
    observe: &Observe,
) -> FlushWaiters {
    let mut waiters = FlushWaiters::default();
    for group in groups.iter_mut() {
        observe(group.started.elapsed(), group.replies.len());
        let answer = match logged {
            Ok(()) if !group.checked.duplicates_hold(store) => Err(WriterError::Store(
                "a delivery this one repeats failed to store; retry".to_owned(),
            )),
            other => other.clone(),
        };
        // Quarantine records are in sled only (a delivery itself is known by its frame).
        let after_flush = answer.is_ok() && group.checked.quarantined;
        for (reply, accepted) in group
            .replies
            .drain(..)
            .zip(std::mem::take(&mut group.checked.accepted))
        {
            if after_flush {
                waiters.replies.push((reply, accepted));
            } else {
                // The handler may have gone (client disconnected); the delivery is stored.
                let _ = reply.send(answer.clone().map(|()| accepted));
            }
        }
        waiters.flushes.append(&mut group.flushes);
    }
    waiters
}

/// A flush of the attached store, if any (see [`Writer::attach`]).
fn flush_attached(
    attached: &tokio::sync::watch::Receiver<Option<SledStore>>,
) -> Result<(), WriterError> {
    let store = attached.borrow().clone();
    match store {
        Some(store) => flush_store(&store),
        None => Err(WriterError::Opening),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::port::*;
    use model::webhook::parse_delivery;
    use std::sync::Mutex;

    fn health(index: bool) -> Arc<Health> {
        Arc::new(Health {
            log: AtomicBool::new(true),
            index: AtomicBool::new(index),
            stuck: crate::Stuck::new().0,
        })
    }

    #[test]
    fn the_syncer_waits_for_room_in_a_full_index_backlog_unless_the_indexer_fails() {
        let backlog = Arc::new(IndexBacklog::default());
        let healthy = health(true);
        backlog.reserve(MAX_INDEX_BACKLOG, &healthy);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let waiter = {
            let (backlog, healthy) = (backlog.clone(), healthy.clone());
            std::thread::spawn(move || {
                backlog.reserve(3, &healthy);
                let _ = done_tx.send(());
            })
        };
        assert_eq!(
            done_rx.recv_timeout(Duration::from_millis(200)),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout),
            "a full backlog holds the syncer"
        );
        backlog.release(10);
        done_rx.recv().expect("room made: the syncer goes on");
        waiter.join().expect("waiter");
        assert_eq!(backlog.count(), MAX_INDEX_BACKLOG - 10 + 3);

        // A failing indexer cannot make room: the syncer does not wait for it.
        let failing = health(false);
        backlog.reserve(MAX_INDEX_BACKLOG, &failing);
        assert_eq!(backlog.count(), 2 * MAX_INDEX_BACKLOG - 7);
    }

    fn body(delivery: &str, event: &str, conversation: &str) -> Vec<u8> {
        format!(
            r#"{{"id":"{delivery}","webhookId":"w","webhookUrl":"u","messages":[{{"id":"{event}","event":"bot.message.received","sourceType":"bot","sourceId":"B1","timestamp":1,"data":{{"message":{{"id":"m-{event}","conversationId":"{conversation}","isUser":true,"meta":null,"data":{{"type":"text","text":"x"}}}}}}}}]}}"#
        )
        .into_bytes()
    }

    fn job(delivery: &str, event: &str) -> AcceptJob {
        let parsed = parse_delivery(&body(delivery, event, "c1")).expect("valid");
        AcceptJob {
            delivery: parsed.id,
            events: parsed.events,
            invalid: Vec::new(),
            received_at: 7,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn flushes_and_quarantined_deliveries_are_answered_after_sleds_file_is_synced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(&dir.path().join("store"), 8 * 1024 * 1024).expect("open");
        let writer = SledWriter::start(
            store.clone(),
            WriterHooks {
                observe: Box::new(|_, _| {}),
                durable: Box::new(|_, _| {}),
            },
            crate::Stuck::new().0,
        )
        .expect("start");
        let before = store.file_syncs();
        writer.flush_own().await.expect("flushed");
        assert!(store.file_syncs() > before, "a flush waits for the sync");

        let before = store.file_syncs();
        let mut quarantined = job("d1", "e1");
        quarantined.invalid.push(crate::QuarantineRecord {
            id: 0,
            received_at: 7,
            scope: "event".into(),
            reason: "invalid_event".into(),
            detail: "x".into(),
            delivery_id: Some("d1".into()),
            content_type: None,
            body_base64: "e30=".into(),
            body_gzip: false,
        });
        writer.accept(quarantined).await.expect("accepted");
        assert!(
            store.file_syncs() > before,
            "a quarantined delivery is answered after the sync"
        );
        assert_eq!(store.quarantined().expect("list").len(), 1);

        // A delivery with nothing to quarantine is answered after the event log's sync alone.
        let before = store.file_syncs();
        writer.accept(job("d2", "e2")).await.expect("accepted");
        assert_eq!(store.file_syncs(), before);

        // A failed sync fails the flush and makes the writer unhealthy (`/readyz` 503), though
        // sled's own writes still work. (d2 indexed first, through the writer: an index round
        // after the failure would find the store failed on a writable disk, and exit.)
        writer.flush().await.expect("flushed");
        assert!(writer.is_healthy());
        store.sled_file.fail_next_sync();
        assert!(writer.flush_own().await.is_err(), "the flush fails");
        assert!(!writer.is_healthy(), "not ready until a restart");
        assert!(store.sync_failed());
        // The indexer's next round, the disk found writable, exits the process for a restart
        // (as for a stuck sled), and dropping the writer makes one: keep it.
        std::mem::forget(writer);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_deliveries_are_logged_once_indexed_and_handed_on_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(&dir.path().join("store"), 8 * 1024 * 1024).expect("open");
        // The indexer hands events on after their checkpoint, on its own thread.
        let (handed_tx, handed_rx) = std::sync::mpsc::channel::<u64>();
        let handed_tx = Mutex::new(handed_tx);
        let writer = SledWriter::start(
            store.clone(),
            WriterHooks {
                observe: Box::new(|_, _| {}),
                durable: Box::new(move |events, _| {
                    let tx = handed_tx.lock().expect("lock");
                    for e in &events {
                        let _ = tx.send(e.seq);
                    }
                }),
            },
            crate::Stuck::new().0,
        )
        .expect("start");
        let mut tasks = Vec::new();
        for i in 0..200 {
            let writer = writer.clone();
            // Every event id twice, under two delivery ids: one of each pair is a duplicate.
            tasks.push(tokio::spawn(async move {
                writer
                    .accept(job(&format!("d{i}"), &format!("e{}", i / 2)))
                    .await
            }));
        }
        let mut new = 0;
        let mut duplicates = 0;
        for t in tasks {
            let accepted = t.await.expect("join").expect("stored");
            new += accepted.new.len();
            duplicates += accepted.duplicate_events;
        }
        assert_eq!((new, duplicates), (100, 100));
        // Acknowledged means in the event log, once each.
        let mut logged = Vec::new();
        super::super::eventlog::scan(&store.log_dir, Default::default(), |_, record, _| {
            logged.extend(record.ids);
            std::ops::ControlFlow::Continue(())
        })
        .expect("scan");
        assert_eq!(logged.len(), 100, "every new event logged");
        logged.sort();
        logged.dedup();
        assert_eq!(logged.len(), 100, "once each");
        // Answers go out before the indexer's round; the events are handed on after it.
        let handed: Vec<u64> = (0..100)
            .map(|_| {
                handed_rx
                    .recv_timeout(Duration::from_secs(20))
                    .expect("every new event handed on")
            })
            .collect();

        let mut sorted = handed.clone();
        sorted.sort_unstable();
        assert_eq!(handed, sorted, "in acceptance order");
        sorted.dedup();
        assert_eq!(sorted.len(), 100, "each once");
        assert_eq!(store.pending().expect("pending").events.len(), 100);

        assert!(writer.is_healthy());
    }

    fn invalid(delivery: &str) -> crate::QuarantineRecord {
        crate::QuarantineRecord {
            id: 0,
            received_at: 7,
            scope: "event".into(),
            reason: "invalid_event".into(),
            detail: "x".into(),
            delivery_id: Some(delivery.into()),
            content_type: None,
            body_base64: "e30=".into(),
            body_gzip: false,
        }
    }

    /// The sequence numbers of the log's events, in log order.
    fn logged_seqs(log_dir: &std::path::Path) -> Vec<(String, u64)> {
        let mut logged = Vec::new();
        super::super::eventlog::scan(log_dir, Default::default(), |_, record, _| {
            logged.extend(record.ids.into_iter().zip(record.seqs));
            std::ops::ControlFlow::Continue(())
        })
        .expect("scan");
        logged
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_writer_started_before_sled_opens_answers_deliveries_and_its_store_indexes_them_once()
    {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("store");
        let seg = super::super::eventlog::SEGMENT_BYTES;
        // A store that ran before: one event folded, one still to fold.
        {
            let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
            for (d, e) in [("d1", "e1"), ("d2", "e2")] {
                let job = job(d, e);
                store.accept_many(&[job.request()]).expect("accepted");
            }
        }
        assert!(
            IntakeLog::open_early(&dir.path().join("fresh"), seg)
                .expect("open")
                .is_none(),
            "a store this build never opened waits for sled"
        );
        let log = IntakeLog::open_early(&path, seg)
            .expect("open")
            .expect("a store this build opened takes deliveries before sled");
        assert!(
            matches!(
                SledStore::open(&path, 8 * 1024 * 1024),
                Err(crate::StoreError::Locked { .. })
            ),
            "nobody else opens the store meanwhile"
        );
        let (writer, attach) =
            SledWriter::start_early(log.clone(), Box::new(|_, _| {}), crate::Stuck::new().0)
                .expect("start");
        assert!(!writer.has_store());

        // Answered with sled closed: new, a duplicate of a logged event, a re-send in flight.
        let new = writer.accept(job("d3", "e3")).await.expect("accepted");
        assert_eq!(new.new.len(), 1);
        let old = writer.accept(job("d4", "e1")).await.expect("answered");
        assert_eq!((old.new.len(), old.duplicate_events), (0, 1));
        let again = writer.accept(job("d5", "e3")).await.expect("answered");
        assert_eq!((again.new.len(), again.duplicate_events), (0, 1));
        // Numbered above every event logged before.
        let logged = logged_seqs(&log.dir);
        let seq = |id: &str| logged.iter().find(|(e, _)| e == id).map(|(_, s)| *s);
        assert!(seq("e3") > seq("e2"), "{logged:?}");
        assert_eq!(logged.len(), 3, "logged before the answer, once");
        // What needs sled (a quarantine record) is refused until it is open.
        let mut quarantined = job("d6", "e6");
        quarantined.invalid.push(invalid("d6"));
        assert_eq!(
            writer.accept(quarantined).await.map(|_| ()),
            Err(WriterError::Opening)
        );
        assert!(writer.is_healthy(), "refused, not failed");

        // sled opens: a start's scan leaves the writer's frames to its indexer.
        let store = SledStore::open_after_log(&path, 8 * 1024 * 1024, log).expect("open sled");
        let scanned: Vec<u64> = store
            .pending_before_writer()
            .expect("pending")
            .events
            .iter()
            .map(|p| p.seq)
            .collect();
        assert_eq!(
            scanned,
            vec![seq("e1").expect("e1"), seq("e2").expect("e2")]
        );
        let (handed_tx, handed_rx) = std::sync::mpsc::channel::<u64>();
        let handed_tx = Mutex::new(handed_tx);
        attach.attach(
            store.clone(),
            Box::new(move |events, _| {
                let tx = handed_tx.lock().expect("lock");
                for e in &events {
                    let _ = tx.send(e.seq);
                }
            }),
        );
        assert!(writer.has_store());
        let handed = handed_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("what was logged early is handed on once attached");
        assert_eq!(Some(handed), seq("e3"));
        writer.flush().await.expect("flushed");
        assert!(handed_rx.try_recv().is_err(), "handed on once");
        assert!(store.log.all_indexed());
        // The checkpoint covers it: the next start has nothing to recover, and finds all three
        // still to fold, each once.
        let mut quarantined = job("d7", "e7");
        quarantined.invalid.push(invalid("d7"));
        writer
            .accept(quarantined)
            .await
            .expect("quarantined once open");
        drop((writer, store));
        let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
        let pending: Vec<u64> = store
            .pending()
            .expect("pending")
            .events
            .iter()
            .map(|p| p.seq)
            .collect();
        assert_eq!(pending.len(), 4, "{pending:?}");
        assert_eq!(store.quarantined().expect("list").len(), 1);
    }

    #[test]
    fn an_early_open_waits_for_sled_after_a_torn_write_or_with_an_older_layouts_dedupe_records() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("store");
        let seg = super::super::eventlog::SEGMENT_BYTES;
        {
            let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
            let job = job("d1", "e1");
            store.accept_many(&[job.request()]).expect("accepted");
        }
        assert!(IntakeLog::open_early(&path, seg).expect("open").is_some());
        // A torn last frame: judging it needs sled's checkpoint.
        let segment = super::super::eventlog::segment_path(&path.join("events"), 1);
        let mut bytes = std::fs::read(&segment).expect("read");
        bytes.extend_from_slice(&[9, 0, 0, 0, 1, 2]);
        std::fs::write(&segment, &bytes).expect("write");
        assert!(IntakeLog::open_early(&path, seg).expect("open").is_none());
        // The open with sled cuts it and keeps the file up to date.
        drop(SledStore::open(&path, 8 * 1024 * 1024).expect("open"));
        assert!(IntakeLog::open_early(&path, seg).expect("open").is_some());
        // A store whose older layout's dedupe records are still in sled has no file.
        let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
        store
            .meta
            .insert(crate::keys::meta::LEGACY_DEDUPE_SINCE, &crate::keys::seq(1))
            .expect("insert");
        drop(store);
        drop(SledStore::open(&path, 8 * 1024 * 1024).expect("open"));
        assert!(IntakeLog::open_early(&path, seg).expect("open").is_none());
    }
}
