//! The executor end to end on paused time: an in-memory ledger, fake sinks whose destination is
//! down for a while (5xx, connection refused, 429 with `Retry-After`, a permanent 4xx), and a
//! clock derived from tokio's paused `Instant`, so hours of outage take milliseconds.

use super::backoff::Backoff;
use super::executor::Sinks;
use super::ledger::{Ledger, Letters};
use super::sink::{Attempt, Dead, Job, Reach, Report, Sink, Transient, OPENAPI};
use super::*;
use futures_util::future::BoxFuture;
use model::action::{DeadLetter, DoneRecord, RetryState};
use std::collections::BTreeMap;
use upstream::error::UpstreamError;

const T0: Millis = 1_763_690_400_000;

#[derive(Default)]
struct MemLedger {
    outbox: Mutex<BTreeMap<u64, OutboxEntry>>,
    retry: Mutex<BTreeMap<u64, RetryState>>,
    done: Mutex<Vec<(u64, u32)>>,
    dead: Mutex<Vec<DeadLetter>>,
    /// Retry states written (after each failed attempt).
    writes: AtomicUsize,
}

impl Ledger for MemLedger {
    fn pending(&self) -> Result<usize, StoreError> {
        Ok(self.outbox.lock().expect("outbox").len())
    }
    fn last_seq(&self) -> Result<Option<u64>, StoreError> {
        Ok(self
            .outbox
            .lock()
            .expect("outbox")
            .keys()
            .next_back()
            .copied())
    }
    fn blocking_queues(&self) -> Result<Letters, StoreError> {
        Ok(Letters::default())
    }
    fn page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<(OutboxEntry, Option<RetryState>)>, StoreError> {
        let retry = self.retry.lock().expect("retry");
        Ok(self
            .outbox
            .lock()
            .expect("outbox")
            .values()
            .filter(|e| after.is_none_or(|a| e.seq > a))
            .take(limit)
            .map(|e| (e.clone(), retry.get(&e.seq).cloned()))
            .collect())
    }
    fn set_retry_state(&self, seq: u64, state: &RetryState) -> Result<(), StoreError> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.retry.lock().expect("retry").insert(seq, state.clone());
        Ok(())
    }
    fn done(&self, records: &[DoneRecord]) -> Result<(), StoreError> {
        for r in records {
            self.outbox.lock().expect("outbox").remove(&r.entry.seq);
            self.retry.lock().expect("retry").remove(&r.entry.seq);
            self.done
                .lock()
                .expect("done")
                .push((r.entry.seq, r.attempts));
        }
        Ok(())
    }
    fn dead(&self, letter: &DeadLetter) -> Result<(), StoreError> {
        self.outbox
            .lock()
            .expect("outbox")
            .remove(&letter.entry.seq);
        self.retry.lock().expect("retry").remove(&letter.entry.seq);
        self.dead.lock().expect("dead").push(letter.clone());
        Ok(())
    }
    fn on_blocking_pool(&self) -> bool {
        false
    }
}

/// How the fake destination answers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Answer {
    Ok,
    Unavailable,
    Refused,
    RateLimited(Duration),
}

/// One destination (`openapi`): answers as told, and keeps every call (seq, daemon time, ok).
struct FakeSink {
    answer: Mutex<Answer>,
    /// Entries refused for good (a permanent 4xx) whatever the answer.
    refuse: HashSet<u64>,
    calls: Mutex<Vec<(u64, Millis, bool)>>,
    clock: NowFn,
}

impl FakeSink {
    fn new(clock: NowFn, answer: Answer, refuse: &[u64]) -> Arc<Self> {
        Arc::new(FakeSink {
            answer: Mutex::new(answer),
            refuse: refuse.iter().copied().collect(),
            calls: Mutex::new(Vec::new()),
            clock,
        })
    }
    fn set(&self, answer: Answer) {
        *self.answer.lock().expect("answer") = answer;
    }
    fn calls(&self) -> Vec<(u64, Millis, bool)> {
        self.calls.lock().expect("calls").clone()
    }
}

impl Sink for FakeSink {
    fn destinations(&self, _entry: &OutboxEntry) -> Vec<String> {
        vec![OPENAPI.to_owned()]
    }

    fn attempt<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Report> {
        Box::pin(async move {
            assert_eq!(
                job.allowed,
                [OPENAPI],
                "called only when its circuit allows"
            );
            let answer = *self.answer.lock().expect("answer");
            let refused = self.refuse.contains(&job.entry.seq) && answer == Answer::Ok;
            let ok = answer == Answer::Ok && !refused;
            self.calls
                .lock()
                .expect("calls")
                .push((job.entry.seq, (self.clock)(), ok));
            let status = |s: u16, retry_after| UpstreamError::Status {
                status: s,
                code: String::new(),
                message: String::new(),
                body: String::new(),
                retry_after,
            };
            let (attempt, reach, label) = match answer {
                Answer::Ok if refused => (
                    Attempt::Dead(Dead {
                        reason: "http_404".into(),
                        error: "404".into(),
                        answered: true,
                    }),
                    Reach::Answered,
                    "http_404",
                ),
                Answer::Ok => (Attempt::Done, Reach::Answered, "ok"),
                Answer::Unavailable => (
                    Attempt::Retry {
                        after: None,
                        failure: Transient::Upstream(status(503, None)),
                    },
                    Reach::Failed,
                    "http_503",
                ),
                Answer::Refused => (
                    Attempt::Retry {
                        after: None,
                        failure: Transient::Upstream(UpstreamError::Connect("refused".into())),
                    },
                    Reach::Failed,
                    "connect",
                ),
                Answer::RateLimited(wait) => (
                    Attempt::Retry {
                        after: None,
                        failure: Transient::Upstream(status(429, Some(wait))),
                    },
                    Reach::Failed,
                    "http_429",
                ),
            };
            let mut r = match attempt {
                Attempt::Done => Report::delivered(),
                attempt => Report::new(attempt, label),
            };
            r.reached.push((OPENAPI.into(), reach));
            r
        })
    }
}

/// A help-desk sink that is never used here (every entry is an Open API one).
struct Unused;

impl Sink for Unused {
    fn destinations(&self, _entry: &OutboxEntry) -> Vec<String> {
        Vec::new()
    }
    fn attempt<'a>(&'a self, _job: &'a Job) -> BoxFuture<'a, Report> {
        Box::pin(async { Report::new(Attempt::Done, "ok") })
    }
}

fn entry(seq: u64, queue: &str) -> OutboxEntry {
    OutboxEntry {
        received_at: T0,
        decided_at: T0,
        ..crate::test_support::outbox_entry(seq, queue)
    }
}

/// The daemon's clock on tokio's (paused) time.
fn paused_clock() -> NowFn {
    let start = tokio::time::Instant::now();
    Arc::new(move || T0 + super::backoff::millis(start.elapsed()))
}

fn settings(window: usize) -> ExecutorSettings {
    ExecutorSettings {
        concurrency: 4,
        blocking: HashSet::new(),
        max_depth: 100_000,
        give_up_after: Duration::from_secs(24 * 3600),
        window,
        retry: Backoff {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(300),
            max_retry_after: Duration::from_secs(600),
        },
        breaker: crate::config::BreakerConfig {
            failures: 5,
            probe_interval: Duration::from_secs(15),
        },
    }
}

struct Run {
    ledger: Arc<MemLedger>,
    sink: Arc<FakeSink>,
    handle: ExecutorHandle,
    metrics: Metrics,
    clock: NowFn,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

/// `queues` conversations with `per_queue` entries each, pending in the ledger (seq order
/// interleaves the queues), and the executor started on them.
fn run(queues: usize, per_queue: usize, answer: Answer, refuse: &[u64], window: usize) -> Run {
    let ledger = Arc::new(MemLedger::default());
    let mut seq = 0;
    for _ in 0..per_queue {
        for q in 0..queues {
            seq += 1;
            ledger
                .outbox
                .lock()
                .expect("outbox")
                .insert(seq, entry(seq, &format!("c{q}")));
        }
    }
    let clock = paused_clock();
    let sink = FakeSink::new(clock.clone(), answer, refuse);
    let metrics = Metrics::new().expect("metrics");
    let sinks = Sinks {
        openapi: sink.clone(),
        helpdesk: Arc::new(Unused),
    };
    let (stop, stop_rx) = watch::channel(false);
    let (handle, tasks) = start_with(
        ledger.clone(),
        sinks,
        &[OPENAPI.to_owned()],
        metrics.clone(),
        settings(window),
        clock.clone(),
        stop_rx,
    )
    .expect("start");
    let task = tokio::spawn(tasks.run());
    Run {
        ledger,
        sink,
        handle,
        metrics,
        clock,
        stop,
        task,
    }
}

impl Run {
    async fn finish(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// An outage of `answer` for `outage`, then recovery: nothing dead, everything done once in
/// order, the backlog moving within 30 s of recovery, no call while the circuit was open but
/// probes at most every 15 s.
async fn outage(answer: Answer, outage: Duration) {
    let (queues, per_queue) = (3, 4);
    let total = (queues * per_queue) as u64;
    let r = run(queues, per_queue, answer, &[], 10_000);
    tokio::time::sleep(outage).await;
    let recovered = (r.clock)();
    r.sink.set(Answer::Ok);
    assert!(
        r.handle.wait_idle(Duration::from_secs(3600)).await,
        "idle after recovery"
    );
    let calls = r.sink.calls();
    let failed: Vec<Millis> = calls.iter().filter(|c| !c.2).map(|c| c.1).collect();
    assert!(
        failed.len() >= 5,
        "the outage was felt: {} failed calls",
        failed.len()
    );
    // While open, at most one probe per interval (Retry-After may space them further).
    // (Calls in flight when it opened may fail at the same time as the fifth.)
    let opened_at = failed[4];
    let mut last = opened_at;
    for at in failed.iter().copied().filter(|at| *at > opened_at) {
        assert!(at - last >= 15_000, "probes {} ms apart", at - last);
        last = at;
    }
    let first_ok = calls.iter().find(|c| c.2).map(|c| c.1).expect("a success");
    assert!(first_ok >= recovered);
    assert!(
        first_ok - recovered <= 30_000,
        "the backlog moved {} ms after recovery",
        first_ok - recovered
    );
    assert!(
        r.ledger.dead.lock().expect("dead").is_empty(),
        "no dead letter"
    );
    let mut done: Vec<(u64, u32)> = r.ledger.done.lock().expect("done").clone();
    done.sort_unstable();
    assert_eq!(
        done.iter().map(|d| d.0).collect::<Vec<_>>(),
        (1..=total).collect::<Vec<_>>(),
        "each entry done exactly once"
    );
    // `attempts` counts every attempt: the done record's count is the entry's calls.
    for (seq, attempts) in &done {
        let n = calls.iter().filter(|c| c.0 == *seq).count() as u32;
        assert_eq!(*attempts, n, "attempts of {seq}");
    }
    // Per-queue order: queue q holds seqs q+1, q+1+queues, ...; its successes in that order.
    for q in 0..queues as u64 {
        let oks: Vec<u64> = calls
            .iter()
            .filter(|c| c.2 && (c.0 - 1) % queues as u64 == q)
            .map(|c| c.0)
            .collect();
        let want: Vec<u64> = (0..per_queue as u64)
            .map(|i| q + 1 + i * queues as u64)
            .collect();
        assert_eq!(oks, want, "queue {q} in order");
    }
    assert_eq!(calls.iter().filter(|c| c.2).count() as u64, total);
    assert_eq!(
        r.metrics.circuit_open.with_label_values(&[OPENAPI]).get(),
        0,
        "closed again"
    );
    assert!(
        r.ledger.retry.lock().expect("retry").is_empty(),
        "retry states removed with the outcome"
    );
    r.finish().await;
}

#[tokio::test(start_paused = true)]
async fn a_10_minute_5xx_outage_loses_nothing_and_keeps_order() {
    outage(Answer::Unavailable, Duration::from_secs(600)).await;
}

#[tokio::test(start_paused = true)]
async fn a_6_hour_5xx_outage_loses_nothing_and_keeps_order() {
    outage(Answer::Unavailable, Duration::from_secs(6 * 3600)).await;
}

#[tokio::test(start_paused = true)]
async fn a_10_minute_connection_refused_outage_loses_nothing_and_keeps_order() {
    outage(Answer::Refused, Duration::from_secs(600)).await;
}

#[tokio::test(start_paused = true)]
async fn a_6_hour_connection_refused_outage_loses_nothing_and_keeps_order() {
    outage(Answer::Refused, Duration::from_secs(6 * 3600)).await;
}

#[tokio::test(start_paused = true)]
async fn a_10_minute_429_storm_with_retry_after_loses_nothing_and_keeps_order() {
    outage(
        Answer::RateLimited(Duration::from_secs(20)),
        Duration::from_secs(600),
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_6_hour_429_storm_with_retry_after_loses_nothing_and_keeps_order() {
    outage(
        Answer::RateLimited(Duration::from_secs(20)),
        Duration::from_secs(6 * 3600),
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_honoured_before_the_next_attempt() {
    // One entry, a 429 asking for 90 s: the next call is not earlier (nor much later).
    let r = run(
        1,
        1,
        Answer::RateLimited(Duration::from_secs(90)),
        &[],
        10_000,
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    r.sink.set(Answer::Ok);
    assert!(r.handle.wait_idle(Duration::from_secs(3600)).await);
    let calls = r.sink.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    let gap = calls[1].1 - calls[0].1;
    assert!((90_000..=90_100).contains(&gap), "waited {gap} ms");
    r.finish().await;
}

#[tokio::test(start_paused = true)]
async fn a_permanent_refusal_dead_letters_at_once_and_the_queue_moves_on() {
    // Queue c0 holds 1, 2, 3; entry 1 is refused for good (404).
    let r = run(1, 3, Answer::Ok, &[1], 10_000);
    assert!(r.handle.wait_idle(Duration::from_secs(60)).await);
    let dead = r.ledger.dead.lock().expect("dead").clone();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].entry.seq, 1);
    assert_eq!(dead[0].reason, "http_404");
    assert_eq!(dead[0].attempts, 1, "not tried again");
    assert!(dead[0].answered);
    let calls: Vec<u64> = r.sink.calls().iter().map(|c| c.0).collect();
    assert_eq!(calls, vec![1, 2, 3], "the queue went on, in order");
    assert_eq!(dead[0].last_attempt_at, T0, "at once");
    assert_eq!(
        r.metrics.action_latency_seconds.get_sample_count(),
        2,
        "the latency of the two carried out, not of the dead letter"
    );
    r.finish().await;
}

#[tokio::test(start_paused = true)]
async fn a_transient_failure_gives_up_after_give_up_after_and_not_before() {
    let r = run(1, 2, Answer::Unavailable, &[], 10_000);
    tokio::time::sleep(Duration::from_secs(24 * 3600 - 60)).await;
    assert!(
        r.ledger.dead.lock().expect("dead").is_empty(),
        "not before 24 h"
    );
    // Why it waits is recorded: attempts, the first failure, the error, the next attempt.
    let state = r
        .ledger
        .retry
        .lock()
        .expect("retry")
        .get(&1)
        .cloned()
        .expect("retry state");
    assert!(
        state.attempts >= 5 && state.first_failure_at == Some(T0),
        "{state:?}"
    );
    assert!(
        state
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("503")),
        "{state:?}"
    );
    assert!(r.ledger.writes.load(Ordering::SeqCst) >= 5);
    tokio::time::sleep(Duration::from_secs(120)).await;
    let dead = r.ledger.dead.lock().expect("dead").clone();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].entry.seq, 1);
    assert_eq!(dead[0].reason, "retries_exhausted");
    assert_eq!(dead[0].first_attempt_at, T0);
    assert!(
        dead[0].last_attempt_at - T0 >= 24 * 3_600_000,
        "after 24 h of failing"
    );
    assert!(!dead[0].answered);
    let calls = r.sink.calls();
    assert_eq!(
        dead[0].attempts as usize,
        calls.iter().filter(|c| c.0 == 1).count(),
        "every attempt counted"
    );
    assert!(
        calls
            .iter()
            .filter(|c| c.0 == 2)
            .all(|c| c.1 >= dead[0].last_attempt_at),
        "entry 2 waited behind it"
    );
    r.finish().await;
}

#[tokio::test(start_paused = true)]
async fn the_breaker_opens_after_n_makes_no_calls_while_open_probes_and_closes() {
    // 20 queues of one entry: all due at once.
    let r = run(20, 1, Answer::Unavailable, &[], 10_000);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let calls = r.sink.calls();
    // Concurrency 4: the fifth failure opens it; calls in flight then may add up to 3.
    assert!(
        (5..=8).contains(&calls.len()),
        "{} calls before it opened",
        calls.len()
    );
    assert_eq!(
        r.metrics.circuit_open.with_label_values(&[OPENAPI]).get(),
        1
    );
    let view = r.handle.circuits();
    assert!(
        view[OPENAPI].open && view[OPENAPI].since == Some(T0),
        "{view:?}"
    );
    // A minute later: one probe per 15 s, nothing else.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let more = r.sink.calls().len() - calls.len();
    assert!((3..=4).contains(&more), "{more} probes in 60 s");
    assert_eq!(r.handle.depth(), 20, "nothing lost, nothing dead");
    r.sink.set(Answer::Ok);
    assert!(r.handle.wait_idle(Duration::from_secs(60)).await);
    assert!(!r.handle.circuits()[OPENAPI].open);
    assert_eq!(
        r.metrics.circuit_open.with_label_values(&[OPENAPI]).get(),
        0
    );
    r.finish().await;
}

#[tokio::test(start_paused = true)]
async fn a_window_smaller_than_the_backlog_keeps_its_bound_and_order() {
    // 5 queues of 40 entries, a window of 20 (10 per sink), an outage first.
    let r = run(5, 40, Answer::Unavailable, &[], 20);
    for _ in 0..12 {
        tokio::time::sleep(Duration::from_secs(10)).await;
        let held = r.handle.in_memory();
        assert!(held > 0 && held <= 10, "{held} in memory (10 per sink)");
    }
    assert_eq!(
        r.handle.depth(),
        200,
        "the depth is exact without loading everything"
    );
    r.sink.set(Answer::Ok);
    assert!(r.handle.wait_idle(Duration::from_secs(3600)).await);
    let mut done: Vec<u64> = r
        .ledger
        .done
        .lock()
        .expect("done")
        .iter()
        .map(|d| d.0)
        .collect();
    done.sort_unstable();
    assert_eq!(done, (1..=200).collect::<Vec<_>>());
    for q in 0..5u64 {
        let oks: Vec<u64> = r
            .sink
            .calls()
            .iter()
            .filter(|c| c.2 && (c.0 - 1) % 5 == q)
            .map(|c| c.0)
            .collect();
        let want: Vec<u64> = (0..40u64).map(|i| q + 1 + i * 5).collect();
        assert_eq!(oks, want, "queue {q} in order across refills");
    }
    r.finish().await;
}

#[tokio::test(start_paused = true)]
async fn a_restart_mid_outage_keeps_the_give_up_clock_and_the_attempts() {
    // The state a previous run left: failing for 23 h 59 min, 40 attempts, due now.
    let r = run(1, 1, Answer::Unavailable, &[], 10_000);
    r.finish().await;
    let ledger = Arc::new(MemLedger::default());
    ledger
        .outbox
        .lock()
        .expect("outbox")
        .insert(1, entry(1, "c0"));
    let state = RetryState {
        attempts: 40,
        failures: 40,
        first_attempt_at: Some(T0 - 86_340_000),
        first_failure_at: Some(T0 - 86_340_000),
        last_attempt_at: Some(T0 - 1_000),
        last_error: Some("503".into()),
        next_attempt_at: Some(T0 + 30_000),
    };
    ledger.retry.lock().expect("retry").insert(1, state);
    let clock = paused_clock();
    let sink = FakeSink::new(clock.clone(), Answer::Unavailable, &[]);
    let (stop, stop_rx) = watch::channel(false);
    let (handle, tasks) = start_with(
        ledger.clone(),
        Sinks {
            openapi: sink.clone(),
            helpdesk: Arc::new(Unused),
        },
        &[OPENAPI.to_owned()],
        Metrics::new().expect("metrics"),
        settings(10_000),
        clock,
        stop_rx,
    )
    .expect("start");
    let task = tokio::spawn(tasks.run());
    tokio::time::sleep(Duration::from_secs(29)).await;
    assert!(
        sink.calls().is_empty(),
        "its next attempt time holds after the restart"
    );
    assert!(handle.wait_idle(Duration::from_secs(3600)).await);
    let dead = ledger.dead.lock().expect("dead").clone();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason, "retries_exhausted");
    assert_eq!(
        dead[0].first_attempt_at,
        T0 - 86_340_000,
        "the clock went on"
    );
    assert_eq!(
        dead[0].attempts,
        40 + sink.calls().len() as u32,
        "the count went on"
    );
    assert!(sink.calls()[0].1 >= T0 + 30_000);
    let _ = stop.send(true);
    let _ = task.await;
}

/// A stop sender dropped without saying stop (its owner gone) ends the executor, as a stop does;
/// it must not spin on a `changed` that is ready at once forever. Real time, on two threads: a
/// spinning executor keeps its thread busy, and the bound below then fails the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_stop_sender_ends_the_executor() {
    let Run { stop, task, .. } = run(2, 3, Answer::Unavailable, &[], 100);
    drop(stop);
    let ended = tokio::time::timeout(Duration::from_secs(10), task).await;
    assert!(
        ended.is_ok(),
        "the executor still runs 10 s after its stop sender was dropped"
    );
}
