//! The executor's loop: it asks the scheduler what is due, runs sinks with bounded concurrency
//! (each attempt its own task, no slot held between attempts), and records outcomes: done or
//! dead in the store, or a failure's retry state and next attempt time (the one backoff).

use super::backoff::{after_failure, AfterFailure};
use super::breaker::Transition;
use super::ledger::Ledger;
use super::scheduler::{Finish, Scheduler};
use super::sink::{Attempt, Dead, Job, Reach, Sink, SinkKind, Transient};
use super::{ExecutorHandle, ExecutorSettings, Msg, NowFn};
use crate::ops::metrics::Metrics;
use model::action::{DeadLetter, DoneRecord, OutboxEntry, RetryState};
use model::webhook::model::Millis;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use storage::lease::Start;
use storage::StoreError;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;

/// Pause before an entry whose outcome could not be recorded is tried again, and before a page
/// that could not be read is read again.
const STORE_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// Page reads per turn of the loop (the rest on the next turns, which come at once).
const PAGES_PER_TURN: usize = 4;

/// Most items a recording task writes in one call.
const RECORD_BATCH: usize = 512;

/// Batches of at most this many items a recording task writes on its own thread (the
/// executor's), not on the blocking pool: a few sled inserts cost less than the two thread
/// wake-ups of a trip there, which at a handoff every few milliseconds were a tenth of the
/// daemon's CPU (docs/benchmarks.md, "Session 47"). Larger batches (a busy executor) still go
/// to the pool, so the executor's thread never holds its calls for long.
const RECORD_INLINE: usize = 4;

/// An item on its way to a recording task ([`record`]), and who waits for its answer.
type Recording<I, A> = (I, oneshot::Sender<Result<A, Arc<StoreError>>>);

/// What a recording task writes a batch with: each item's answer, in order.
type Write<I, A> = fn(&dyn Ledger, &[I]) -> Result<Vec<A>, StoreError>;

/// The recording tasks, which run beside the executor's loop and write what arrives while their
/// last write ran in the next (one store call, on the blocking pool unless the batch is small:
/// [`RECORD_INLINE`]), not one write per entry: the `done`
/// outcomes of carried-out entries (an entry leaves the outbox only once its outcome is
/// recorded, `Store::outbox_done_many`, and its task waits for that write before its queue goes
/// on), and, with several nodes, the marks of entries begun (`Store::outbox_started`), each
/// written before its call.
pub(super) struct Recorders {
    done: mpsc::UnboundedReceiver<Recording<DoneRecord, ()>>,
    started: mpsc::UnboundedReceiver<Recording<u64, Start>>,
}

/// The way to the [`Recorders`], the runner's.
pub(super) struct ToRecorders {
    done: mpsc::UnboundedSender<Recording<DoneRecord, ()>>,
    started: mpsc::UnboundedSender<Recording<u64, Start>>,
}

impl Recorders {
    pub(super) fn new() -> (ToRecorders, Recorders) {
        let (done, done_rx) = mpsc::unbounded_channel();
        let (started, started_rx) = mpsc::unbounded_channel();
        let recorders = Recorders {
            done: done_rx,
            started: started_rx,
        };
        (ToRecorders { done, started }, recorders)
    }

    /// Start both on the current runtime; each ends when its senders are gone.
    pub(super) fn spawn(self, ledger: &Arc<dyn Ledger>) {
        tokio::spawn(record(ledger.clone(), self.done, |l, records| {
            l.done(records).map(|()| vec![(); records.len()])
        }));
        tokio::spawn(record(ledger.clone(), self.started, |l, seqs| {
            l.started(seqs)
        }));
    }
}

/// Write what arrives on `rx` with `call`, a batch at a time (at most [`RECORD_BATCH`]); each
/// waiter gets its item's answer, or the batch's error.
async fn record<I: Send + 'static, A: Send + 'static>(
    ledger: Arc<dyn Ledger>,
    mut rx: mpsc::UnboundedReceiver<Recording<I, A>>,
    call: Write<I, A>,
) {
    while let Some((first, reply)) = rx.recv().await {
        let (mut items, mut replies) = (vec![first], vec![reply]);
        while items.len() < RECORD_BATCH {
            let Ok((item, reply)) = rx.try_recv() else {
                break;
            };
            items.push(item);
            replies.push(reply);
        }
        // A waiter may have gone (shutdown); its item is recorded all the same.
        let written = match items.len() <= RECORD_INLINE {
            true => call(ledger.as_ref(), &items),
            false => on_ledger(&ledger, move |l| call(l, &items)).await,
        };
        match written {
            Ok(answers) => {
                for (reply, answer) in replies.into_iter().zip(answers) {
                    let _ = reply.send(Ok(answer));
                }
            }
            Err(e) => {
                let e = Arc::new(e);
                for reply in replies {
                    let _ = reply.send(Err(e.clone()));
                }
            }
        }
    }
}

/// `item` through a recording task: its answer once written.
async fn ask<I, A>(
    to: &mpsc::UnboundedSender<Recording<I, A>>,
    item: I,
) -> Result<A, Arc<StoreError>> {
    let stopped = || {
        Arc::new(StoreError::Internal(
            "a recording task stopped (the executor is shutting down)".into(),
        ))
    };
    let (reply, answer) = oneshot::channel();
    match to.send((item, reply)) {
        Ok(()) => answer.await.unwrap_or_else(|_| Err(stopped())),
        Err(_) => Err(stopped()),
    }
}

/// A ledger call, on the blocking pool when the ledger is the store.
async fn on_ledger<T: Send + 'static>(
    ledger: &Arc<dyn Ledger>,
    f: impl FnOnce(&dyn Ledger) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    if !ledger.on_blocking_pool() {
        return f(ledger.as_ref());
    }
    let ledger = ledger.clone();
    tokio::task::spawn_blocking(move || f(ledger.as_ref()))
        .await
        .unwrap_or_else(|e| Err(StoreError::Internal(format!("store task failed: {e}"))))
}

/// The two sinks.
#[derive(Clone)]
pub struct Sinks {
    pub openapi: Arc<dyn Sink>,
    pub helpdesk: Arc<dyn Sink>,
}

impl Sinks {
    fn of(&self, entry: &OutboxEntry) -> &Arc<dyn Sink> {
        match SinkKind::of(entry) {
            SinkKind::OpenApi => &self.openapi,
            SinkKind::Helpdesk => &self.helpdesk,
        }
    }
}

pub(super) struct Runner {
    pub ledger: Arc<dyn Ledger>,
    pub recorders: ToRecorders,
    pub sinks: Sinks,
    pub metrics: Metrics,
    pub settings: ExecutorSettings,
    pub handle: ExecutorHandle,
    pub progress: watch::Sender<usize>,
    pub clock: NowFn,
}

/// When an attempt started and ended, in daemon time.
#[derive(Clone, Copy)]
struct AttemptTimes {
    started: Millis,
    now: Millis,
}

/// A finished attempt, back to the loop.
struct Finished {
    queue: String,
    seq: u64,
    outcome: Finish,
    reached: Vec<(String, Reach)>,
}

impl Runner {
    /// A store call ([`on_ledger`]).
    async fn store<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn Ledger) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        on_ledger(&self.ledger, f).await
    }

    /// The executor's loop, until `stop` turns true or every sender is gone; then the calls in
    /// flight finish, or are dropped when `lost` says the node is no longer the active one.
    pub(super) async fn run(
        self: &Arc<Self>,
        mut sched: Scheduler,
        rx: &mut mpsc::UnboundedReceiver<Msg>,
        mut stop: watch::Receiver<bool>,
        lost: &(dyn Fn() -> bool + Sync),
    ) {
        let runner = self;
        let mut inflight: JoinSet<Finished> = JoinSet::new();
        let mut page_failed_at: Option<tokio::time::Instant> = None;
        loop {
            if *stop.borrow() {
                break;
            }
            // Room in the window: read the next pages of the outbox.
            let more_pages = runner.read_pages(&mut sched, &mut page_failed_at).await;
            let now = (runner.clock)();
            runner.start_due(&mut sched, &mut inflight, now);
            runner.publish(&sched);
            let wait = runner.wait(&sched, inflight.len(), more_pages, page_failed_at, now);
            let mut arrived = 0;
            tokio::select! {
                _ = sleep(wait), if wait.is_some() => {}
                msg = rx.recv() => match msg {
                    Some(msg) => arrived = runner.take(&mut sched, msg),
                    None => break,
                },
                Some(joined) = inflight.join_next(), if !inflight.is_empty() => match joined {
                    Ok(f) => runner.finished(&mut sched, f),
                    Err(e) => tracing::error!(error = %e, "action task failed"),
                },
                // A dropped sender stops it too: `changed` would be ready at once forever.
                changed = stop.changed() => if changed.is_err() { break },
            }
            runner.publish(&sched);
            if arrived > 0 {
                // After the publish, so a waiter never sees neither the entries nor their transit.
                runner
                    .handle
                    .in_transit
                    .fetch_sub(arrived, Ordering::SeqCst);
                runner.progress.send_modify(|_| {});
            }
        }
        // Shutdown: calls in flight finish (bounded by the clients' timeouts); the rest stay in
        // the outbox for the next start. No longer the active node: dropped at once.
        if lost() {
            inflight.abort_all();
        }
        while let Some(joined) = inflight.join_next().await {
            if let Ok(f) = joined {
                runner.finished(&mut sched, f);
            }
        }
        runner.publish(&sched);
        tracing::info!(left_in_outbox = sched.depth(), "executor stopped");
    }

    /// Read up to [`PAGES_PER_TURN`] pages of the outbox into the scheduler, unless a read failed
    /// less than [`STORE_RETRY_PAUSE`] ago. Returns whether more pages are to read at once.
    async fn read_pages(
        &self,
        sched: &mut Scheduler,
        page_failed_at: &mut Option<tokio::time::Instant>,
    ) -> bool {
        if !page_failed_at.is_none_or(|at| at.elapsed() >= STORE_RETRY_PAUSE) {
            return false;
        }
        *page_failed_at = None;
        for _ in 0..PAGES_PER_TURN {
            let Some((kind, after, limit)) = sched.refill() else {
                break;
            };
            match self.store(move |l| l.page(after, limit)).await {
                Ok(page) => sched.refilled(kind, page, limit, (self.clock)()),
                Err(e) => {
                    tracing::error!(error = %e, "cannot read the outbox; trying again");
                    *page_failed_at = Some(tokio::time::Instant::now());
                    break;
                }
            }
        }
        page_failed_at.is_none() && sched.refill().is_some()
    }

    /// Whether another attempt may start: not paused, and below the concurrency limit.
    fn can_start(&self, inflight: usize) -> bool {
        !self.handle.is_paused() && inflight < self.settings.concurrency.max(1)
    }

    /// Start the entries due at `now`, each attempt its own task, while another may start.
    fn start_due(
        self: &Arc<Self>,
        sched: &mut Scheduler,
        inflight: &mut JoinSet<Finished>,
        now: Millis,
    ) {
        let sinks = self.sinks.clone();
        let dests = move |e: &OutboxEntry| sinks.of(e).destinations(e);
        while self.can_start(inflight.len()) {
            let Some(job) = sched.next(now, &dests) else {
                break;
            };
            let runner = self.clone();
            let e = &job.entry;
            let span = tracing::info_span!("action", action_id = %e.id, event_id = %e.event_id, queue = %e.queue, action = e.action.name());
            // Boxed: the attempt's future is kilobytes (its sink's call and every outcome's
            // store write inline), and a task moves its future on spawn, each poll's stage
            // change and the read of its output; boxed, it is moved once (docs/benchmarks.md,
            // "Session 47": 7% of the daemon's instructions a handoff, in memcpy).
            inflight.spawn(tracing::Instrument::instrument(
                Box::pin(runner.carry_out(job)),
                span,
            ));
        }
    }

    /// How long the loop sleeps unless woken: not at all while pages are left to read, else until
    /// the next due time in daemon time (the test clock's advance wakes it) or the page read's
    /// retry; `None`: until a message or a finished call.
    fn wait(
        &self,
        sched: &Scheduler,
        inflight: usize,
        more_pages: bool,
        page_failed_at: Option<tokio::time::Instant>,
        now: Millis,
    ) -> Option<Duration> {
        if more_pages {
            return Some(Duration::ZERO);
        }
        let page_retry = page_failed_at.map(|at| STORE_RETRY_PAUSE.saturating_sub(at.elapsed()));
        // Nothing can start while paused or at the concurrency limit: then only a message or a
        // finished call wakes the loop (no spinning on a past due time).
        let can_start = self.can_start(inflight);
        let due = sched
            .next_wake()
            .filter(|_| can_start)
            .map(|at| Duration::from_millis(u64::try_from(at - now).unwrap_or(0)));
        match (due, page_retry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// A message while no term runs (this node stands by): what it hands over is in the store,
    /// for the active to carry out; only its count in transit is settled.
    pub(super) fn drop_msg(&self, msg: Msg) {
        let arrived = match msg {
            Msg::Entries(entries) => entries.len(),
            Msg::Retried(_) => 1,
            Msg::Unblock(_) | Msg::Wake => 0,
        };
        if arrived > 0 {
            self.handle.in_transit.fetch_sub(arrived, Ordering::SeqCst);
            self.progress.send_modify(|_| {});
        }
    }

    /// A message to the executor, taken into the scheduler. Returns how many entries in transit
    /// it accounts for.
    fn take(&self, sched: &mut Scheduler, msg: Msg) -> usize {
        match msg {
            Msg::Entries(entries) => {
                let arrived = entries.len();
                sched.decided(entries, (self.clock)());
                arrived
            }
            Msg::Retried(entry) => {
                sched.retried(*entry, (self.clock)());
                1
            }
            Msg::Unblock(queue) => {
                sched.unblock(&queue, (self.clock)());
                0
            }
            Msg::Wake => 0,
        }
    }

    /// A finished attempt into the scheduler, and the circuits it opened or closed.
    fn finished(&self, sched: &mut Scheduler, f: Finished) {
        let changes = sched.finish(&f.queue, f.seq, f.outcome, &f.reached, (self.clock)());
        self.transitions(&changes);
    }

    fn transitions(&self, changes: &[Transition]) {
        for change in changes {
            match change {
                Transition::Opened {
                    destination,
                    failures,
                } => {
                    tracing::warn!(destination = %destination, failures, probe_every = ?self.settings.breaker.probe_interval, "circuit open: no calls to the destination but a probe; its entries wait");
                    self.metrics
                        .circuit_open
                        .with_label_values(&[destination])
                        .set(1);
                }
                Transition::Closed {
                    destination,
                    open_for,
                } => {
                    tracing::info!(destination = %destination, open_for = %humantime::format_duration(Duration::from_secs(open_for.as_secs())), "circuit closed: the destination answered; its waiting entries go now");
                    self.metrics
                        .circuit_open
                        .with_label_values(&[destination])
                        .set(0);
                }
            }
        }
    }

    fn publish(&self, sched: &Scheduler) {
        let depth = sched.depth();
        self.handle.depth.store(depth, Ordering::SeqCst);
        self.handle
            .in_memory
            .store(sched.loaded(), Ordering::SeqCst);
        self.metrics.outbox_depth.set(depth as i64);
        let age = sched
            .oldest_decided_at()
            .map_or(0.0, |at| ((self.clock)() - at).max(0) as f64 / 1000.0);
        self.metrics.outbox_oldest_seconds.set(age);
        *self
            .handle
            .circuits
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = sched.circuits();
        self.progress.send_if_modified(|d| {
            let changed = *d != depth;
            *d = depth;
            changed
        });
    }

    /// One attempt through the entry's sink, and its outcome recorded.
    async fn carry_out(self: Arc<Self>, job: Job) -> Finished {
        if let Err(e) = self.begin(&job.entry).await {
            tracing::warn!(error = %e, "the action was not begun: it runs again");
            tokio::time::sleep(STORE_RETRY_PAUSE).await;
            return Finished {
                queue: job.entry.queue.clone(),
                seq: job.entry.seq,
                outcome: Finish::Again(job.state),
                reached: Vec::new(),
            };
        }
        let sink = self.sinks.of(&job.entry).clone();
        let started = (self.clock)();
        let report = sink.attempt(&job).await;
        let now = (self.clock)();
        let Job {
            entry, mut state, ..
        } = job;
        let name = entry.action.name();
        if report.attempted {
            state.attempts = state.attempts.saturating_add(1);
            state.first_attempt_at.get_or_insert(started);
            self.metrics
                .action_attempts
                .with_label_values(&[name, &report.status])
                .inc();
        }
        let queue = entry.queue.clone();
        let seq = entry.seq;
        let at = AttemptTimes { started, now };
        let sink = sink.as_ref();
        let outcome = match report.attempt {
            Attempt::Done => {
                self.carried_out(sink, entry, state, report.delivered, now)
                    .await
            }
            Attempt::Dead(dead) => self.failed_for_good(sink, entry, state, dead, at).await,
            Attempt::Retry { after, failure } => {
                self.failed_for_now(sink, entry, state, after, failure, at)
                    .await
            }
            Attempt::Held => {
                if report.attempted {
                    self.save_state(seq, &state).await;
                }
                Finish::Held(state)
            }
            Attempt::Stopped => Finish::Again(state),
        };
        Finished {
            queue,
            seq,
            outcome,
            reached: report.reached,
        }
    }

    /// Several nodes on one store: mark the entry begun by this node's epoch before its call (a
    /// refusal: this node is no longer the active one, and makes no call). An entry a node that
    /// is gone had begun is carried out again, once, and counted
    /// (`handoff_outbox_replayed_total`); the idempotency key it carries lets the destination
    /// apply it once.
    async fn begin(&self, entry: &OutboxEntry) -> Result<(), Arc<StoreError>> {
        if !self.ledger.shared() {
            return Ok(());
        }
        if let Start::Replay { epoch } = ask(&self.recorders.started, entry.seq).await? {
            self.metrics.outbox_replayed.inc();
            tracing::warn!(
                began_under_epoch = epoch,
                "action begun by an active node that is gone: carried out again (its idempotency \
                 key lets the destination apply it once)"
            );
        }
        Ok(())
    }

    /// Done: its latency observed (when the destination took it now), the sink's memory of it
    /// dropped, and its outcome recorded.
    async fn carried_out(
        &self,
        sink: &dyn Sink,
        entry: OutboxEntry,
        state: RetryState,
        delivered: bool,
        now: Millis,
    ) -> Finish {
        if delivered {
            self.metrics
                .action_latency_seconds
                .observe((now - entry.received_at).max(0) as f64 / 1000.0);
        }
        tracing::info!(attempts = state.attempts, "action carried out");
        sink.forget(&entry);
        self.record_done(entry, state, now).await
    }

    /// Failed for good (the sink said so): moved to the dead letters.
    async fn failed_for_good(
        &self,
        sink: &dyn Sink,
        entry: OutboxEntry,
        state: RetryState,
        dead: Dead,
        at: AttemptTimes,
    ) -> Finish {
        let blocking = self.settings.blocking.contains(entry.action.name());
        tracing::warn!(reason = %dead.reason, error = %dead.error, blocking, "action failed for good; moved to dead letters");
        let letter = DeadLetter {
            reason: dead.reason,
            error: dead.error,
            attempts: state.attempts,
            first_attempt_at: state.first_attempt_at.unwrap_or(at.started),
            last_attempt_at: at.now,
            blocking,
            answered: dead.answered,
            entry,
        };
        sink.forget(&letter.entry);
        self.record_dead(letter, state).await
    }

    /// A transient failure: the entry is tried again after the backoff, or moved to the dead
    /// letters once it has failed for `outbox.give_up_after`.
    async fn failed_for_now(
        &self,
        sink: &dyn Sink,
        entry: OutboxEntry,
        mut state: RetryState,
        after: Option<Duration>,
        failure: Transient,
        at: AttemptTimes,
    ) -> Finish {
        // `after_failure` counts the attempt itself.
        state.attempts = state.attempts.saturating_sub(1);
        let error = failure.to_string();
        let retry_after = after.or_else(|| failure.retry_after());
        let verdict = after_failure(
            state,
            at.now,
            error.clone(),
            retry_after,
            &self.settings.retry,
            self.settings.give_up_after,
            &mut rand::rng(),
        );
        match verdict {
            AfterFailure::RetryAt(state) => {
                self.retry_at(entry.seq, state, &error, retry_after, at.now)
                    .await
            }
            AfterFailure::GiveUp(state) => {
                self.give_up(sink, entry, state, failure, error, at).await
            }
        }
    }

    /// Tried again at its next attempt time, and not before the wait the destination asked for
    /// (at most `max_retry_after`): logged (a warning at the first failure), its state saved.
    async fn retry_at(
        &self,
        seq: u64,
        state: RetryState,
        error: &str,
        retry_after: Option<Duration>,
        now: Millis,
    ) -> Finish {
        let next = state.next_attempt_at.unwrap_or(now);
        if state.failures == 1 {
            tracing::warn!(error = %error, retry_in_ms = next - now, "action failed; its queue waits and it is tried again");
        } else {
            tracing::debug!(error = %error, failures = state.failures, retry_in_ms = next - now, "action failed again");
        }
        self.save_state(seq, &state).await;
        let not_before = retry_after.map(|d| {
            let d = d.min(self.settings.retry.max_retry_after);
            now.saturating_add(super::backoff::millis(d))
        });
        Finish::Retry { state, not_before }
    }

    /// Failed for `outbox.give_up_after`: moved to the dead letters.
    async fn give_up(
        &self,
        sink: &dyn Sink,
        entry: OutboxEntry,
        state: RetryState,
        failure: Transient,
        error: String,
        at: AttemptTimes,
    ) -> Finish {
        let blocking = self.settings.blocking.contains(entry.action.name());
        let reason = failure.give_up_reason();
        tracing::warn!(reason = %reason, error = %error, attempts = state.attempts, blocking, "action failed for outbox.give_up_after; moved to dead letters");
        let letter = DeadLetter {
            reason,
            error: format!(
                "{error}; gave up after {} of failed attempts",
                humantime::format_duration(self.settings.give_up_after)
            ),
            attempts: state.attempts,
            first_attempt_at: state.first_attempt_at.unwrap_or(at.started),
            last_attempt_at: at.now,
            blocking,
            // A transient failure may follow an attempt that took effect.
            answered: false,
            entry,
        };
        sink.forget(&letter.entry);
        self.record_dead(letter, state).await
    }

    /// Why the entry waits, kept for a restart and the operator. A failure to write it costs
    /// the count after a restart, never the entry: logged, and the entry waits as planned.
    async fn save_state(&self, seq: u64, state: &RetryState) {
        let s = state.clone();
        if let Err(e) = self.store(move |l| l.set_retry_state(seq, &s)).await {
            tracing::error!(error = %e, "cannot record the action's retry state");
        }
    }

    /// Through the recording task, with the outcomes of the entries finished meanwhile.
    async fn record_done(&self, entry: OutboxEntry, state: RetryState, now: Millis) -> Finish {
        let record = DoneRecord {
            entry,
            outcome: "done".into(),
            at: now,
            attempts: state.attempts,
            note: None,
        };
        let recorded = ask(&self.recorders.done, record).await;
        self.recorded(recorded.map(|()| Finish::Done), state).await
    }

    async fn record_dead(&self, letter: DeadLetter, state: RetryState) -> Finish {
        let metrics = self.metrics.clone();
        let blocking = letter.blocking;
        let reason = letter.reason.clone();
        let recorded = self.store(move |l| l.dead(&letter)).await.map(|()| {
            metrics.dead_letters.with_label_values(&[&reason]).inc();
            metrics.dead_letter_entries.inc();
            Finish::Dead { blocking }
        });
        self.recorded(recorded.map_err(Arc::new), state).await
    }

    /// The outcome once recorded; an entry whose outcome could not be recorded runs again.
    async fn recorded(
        &self,
        recorded: Result<Finish, Arc<StoreError>>,
        state: RetryState,
    ) -> Finish {
        match recorded {
            Ok(outcome) => outcome,
            Err(e) => {
                tracing::error!(error = %e, "cannot record the action's outcome; it will run again");
                tokio::time::sleep(STORE_RETRY_PAUSE).await;
                Finish::Again(state)
            }
        }
    }
}

async fn sleep(wait: Option<Duration>) {
    match wait {
        Some(wait) => tokio::time::sleep(wait).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::ledger::Letters;
    use std::sync::Mutex;
    use std::thread::ThreadId;

    /// A store-like ledger (its calls belong on the blocking pool) that notes, for each batch of
    /// begun marks it writes, its size and whether it ran on the given thread.
    struct WhereWritten {
        runtime: ThreadId,
        batches: Mutex<Vec<(usize, bool)>>,
    }

    impl Ledger for WhereWritten {
        fn pending(&self) -> Result<usize, StoreError> {
            Ok(0)
        }
        fn last_seq(&self) -> Result<Option<u64>, StoreError> {
            Ok(None)
        }
        fn blocking_queues(&self) -> Result<Letters, StoreError> {
            Ok(Letters::default())
        }
        fn page(
            &self,
            _after: Option<u64>,
            _limit: usize,
        ) -> Result<Vec<(OutboxEntry, Option<RetryState>)>, StoreError> {
            Ok(Vec::new())
        }
        fn set_retry_state(&self, _seq: u64, _state: &RetryState) -> Result<(), StoreError> {
            Ok(())
        }
        fn done(&self, _records: &[DoneRecord]) -> Result<(), StoreError> {
            Ok(())
        }
        fn dead(&self, _letter: &DeadLetter) -> Result<(), StoreError> {
            Ok(())
        }
        fn started(&self, seqs: &[u64]) -> Result<Vec<Start>, StoreError> {
            let here = std::thread::current().id() == self.runtime;
            let mut batches = self.batches.lock().expect("batches");
            batches.push((seqs.len(), here));
            Ok(vec![Start::First; seqs.len()])
        }
    }

    #[tokio::test]
    async fn small_batches_are_recorded_on_the_executors_thread_large_ones_on_the_pool() {
        let ledger = Arc::new(WhereWritten {
            runtime: std::thread::current().id(),
            batches: Mutex::new(Vec::new()),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let shared: Arc<dyn Ledger> = ledger.clone();
        // A current-thread runtime: the task first runs when this one waits, and finds every
        // item sent before then in one batch.
        tokio::spawn(record(shared, rx, |l, seqs| l.started(seqs)));
        let large = (0..=RECORD_INLINE as u64).map(|seq| ask(&tx, seq));
        for answer in futures_util::future::join_all(large).await {
            assert_eq!(answer.expect("recorded"), Start::First);
        }
        assert_eq!(ask(&tx, 99).await.expect("recorded"), Start::First);
        let batches = ledger.batches.lock().expect("batches").clone();
        assert_eq!(batches, [(RECORD_INLINE + 1, false), (1, true)]);
    }
}
