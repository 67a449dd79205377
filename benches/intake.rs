//! Intake benchmark: durable webhook intake of the real daemon against a bare actix baseline.
//!
//! ```text
//! cargo bench --bench intake                 # full run (a few minutes)
//! cargo bench --bench intake -- --quick      # smoke run of a few seconds (CI)
//! cargo bench --bench intake -- --help       # every option
//! ```
//!
//! What it does, all on 127.0.0.1, every process started here bounded in time:
//!
//! - **baseline**: this same bench binary re-executed as `--baseline-server`: an actix-web server
//!   with the daemon's server settings (workers, connection limits, timeouts from the embedded
//!   defaults) that checks the path token, reads the body with the daemon's size limit, validates
//!   it with `model::webhook::parse_delivery` (serde_json: envelope and every event) and
//!   answers 200 with a receipt, storing nothing.
//! - **daemon**: the release binary `handoff-bridge serve` on a fresh data directory per run:
//!   every 200 it answers means the delivery is durable (sled transaction + group-commit flush).
//! - a closed-loop load generator on one thread (tokio current-thread runtime, a minimal
//!   HTTP/1.1 keep-alive client per connection) posts deliveries built from the shared fixtures
//!   with unique delivery, event and message ids, spread over many conversation ids. Only 200s
//!   whose receipt says `"status":"accepted"` count; their acknowledgment latency (request write
//!   to last response byte) goes into an HdrHistogram.
//! - baseline and daemon runs alternate (the order flips every round); each gets a fresh server.
//! - memory case: a fresh daemon takes N deliveries x M events (default 100,000 x 10 = 1,000,000
//!   events over 100,000 conversations), is waited on until its inbox is drained, then VmRSS and
//!   the data directory size are read and the daemon is restarted (SIGTERM, start on the same
//!   data directory, time until its `listening:` line).
//!
//! The markdown report is printed on stdout and written to `--out` (default
//! `target/tmp/intake-bench.md`). Progress goes to stderr.

mod common;

use common::{
    BenchOptions, BodyRead, CommonOptions, Conn, ConnectError, CpuSample, Http, OptionSpec, Proc,
    Response, Setting, Target, HTTP_TIMEOUT, WEBHOOK_TOKEN,
};
use hdrhistogram::Histogram;
use serde_json::Value;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::rc::Rc;
use std::time::{Duration, Instant};

const BASELINE_FLAG: &str = "--baseline-server";
/// A baseline server stops by itself after this long, whatever happens to the bench.
const BASELINE_LIFETIME: Duration = Duration::from_secs(30 * 60);
/// Longest wait for the daemon to fold everything after the memory case's load.
const DRAIN_LIMIT: Duration = Duration::from_secs(15 * 60);
/// How often a stopping server is checked for its exit: fine, the shutdown time is measured.
const STOP_POLL: Duration = Duration::from_millis(2);
/// Admin and metrics answers are small: read as ureq reads by default (up to 10 MiB, broken
/// UTF-8 as `?`); an unreadable one reads as empty.
const BODY: BodyRead = BodyRead {
    limit: 10 * 1024 * 1024,
    lossy_utf8: true,
    required: false,
};

/// The same allocator as the daemon, so the baseline server differs from it only in storing.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(BASELINE_FLAG) {
        if let Err(e) = baseline::serve() {
            eprintln!("baseline server: {e}");
            std::process::exit(1);
        }
        return;
    }
    OPTIONS.main(&args, run);
}

// ---------------------------------------------------------------------------------------------
// Options

#[derive(Clone, Debug)]
struct Options {
    quick: bool,
    connections: usize,
    warmup: Duration,
    duration: Duration,
    runs: usize,
    /// Which throughput cases run (profiling one side alone): both, baseline or daemon.
    cases: Vec<Case>,
    /// Conversation ids the throughput runs spread over.
    conversations: u64,
    /// Events per delivery in the throughput runs; 0 posts each fixture as it is (1-2 events).
    batch: usize,
    memory: bool,
    mem_deliveries: u64,
    mem_batch: usize,
    mem_conversations: u64,
    /// Upper bound on the memory case's posting phase.
    mem_max: Duration,
    /// Data root, report, daemon binary and its extra environment.
    common: CommonOptions,
}

const USAGE: &str = "\
usage: cargo bench --bench intake -- [options]
  --quick                 smoke run: 1 round of 1 s per case, memory case with 20,000 events
  --connections N         concurrent keep-alive connections (default 64)
  --duration SECS         measured time per run (default 10)
  --warmup SECS           unmeasured time before it, same connections (default 2)
  --runs N                runs of each case, alternating baseline and daemon (default 5)
  --cases WHICH           both (default), baseline or daemon: run one side alone, e.g. to profile it
  --conversations N       conversation ids the throughput runs spread over (default 10000)
  --batch N               events per delivery in throughput runs; 0 = each fixture as is (default 0)
  --no-memory             skip the memory/restart case (or --memory false)
  --mem-deliveries N      memory case deliveries (default 100000)
  --mem-batch N           memory case events per delivery (default 10)
  --mem-conversations N   memory case conversation ids (default 100000)
  --mem-max SECS          stop posting in the memory case after this long (default 900)
  --data-root DIR         where data directories go (default target/tmp; must be a real disk)
  --out FILE              also write the markdown report here (default target/tmp/intake-bench.md)
  --json FILE             also write the results as JSON here (read by benches/run)
  --bin PATH              daemon binary (default: the one cargo built for this bench)
  --daemon-env K=V[,K=V]  extra environment for the daemon, e.g. HANDOFF_BRIDGE__DISPATCH__BATCH_SIZE=512
Every option can also be given as INTAKE_BENCH_<NAME> (e.g. INTAKE_BENCH_CONNECTIONS=32,
INTAKE_BENCH_QUICK=1); flags win over variables.";

const OPTIONS: OptionSpec = OptionSpec {
    name: "intake",
    env_prefix: "INTAKE_BENCH",
    usage: USAGE,
    keys: KEYS,
    off_flag: ("--no-memory", "memory"),
};

const KEYS: &[&str] = &[
    "connections",
    "duration",
    "warmup",
    "runs",
    "cases",
    "conversations",
    "batch",
    "memory",
    "mem-deliveries",
    "mem-batch",
    "mem-conversations",
    "mem-max",
];

impl BenchOptions for Options {
    fn full() -> Self {
        Options {
            quick: false,
            connections: 64,
            warmup: Duration::from_secs(2),
            duration: Duration::from_secs(10),
            runs: 5,
            cases: vec![Case::Baseline, Case::Daemon],
            conversations: 10_000,
            batch: 0,
            memory: true,
            mem_deliveries: 100_000,
            mem_batch: 10,
            mem_conversations: 100_000,
            mem_max: Duration::from_secs(900),
            common: CommonOptions::new("intake-bench.md"),
        }
    }

    fn quick() -> Self {
        Options {
            quick: true,
            warmup: Duration::from_millis(250),
            duration: Duration::from_secs(1),
            runs: 1,
            conversations: 1_000,
            mem_deliveries: 2_000,
            mem_conversations: 2_000,
            mem_max: Duration::from_secs(60),
            ..Options::full()
        }
    }

    fn common(&mut self) -> &mut CommonOptions {
        &mut self.common
    }

    fn set(&mut self, s: &Setting) -> Result<bool, String> {
        match s.key.as_str() {
            "connections" => self.connections = s.size()?,
            "duration" => self.duration = s.secs()?,
            "warmup" => self.warmup = s.secs()?,
            "runs" => self.runs = s.size()?,
            "cases" => {
                self.cases = match s.value.as_str() {
                    "both" => vec![Case::Baseline, Case::Daemon],
                    "baseline" => vec![Case::Baseline],
                    "daemon" => vec![Case::Daemon],
                    other => {
                        return Err(format!(
                            "--cases: `{other}` is not both, baseline or daemon"
                        ))
                    }
                }
            }
            "conversations" => self.conversations = s.num()?,
            "batch" => self.batch = s.size()?,
            "memory" => self.memory = s.truthy(),
            "mem-deliveries" => self.mem_deliveries = s.num()?,
            "mem-batch" => self.mem_batch = s.size()?,
            "mem-conversations" => self.mem_conversations = s.num()?,
            "mem-max" => self.mem_max = s.secs()?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn check(&self) -> Result<(), String> {
        // `--runs 0` with the memory case: only the memory case (benches/run calls it once).
        if self.connections == 0
            || (self.runs == 0 && !self.memory)
            || self.conversations == 0
            || self.mem_conversations == 0
            || self.mem_batch == 0
        {
            return Err("connections, runs (unless the memory case runs), conversations, mem-conversations and mem-batch must be at least 1".into());
        }
        if self.batch > 1_000 || self.mem_batch > 1_000 {
            return Err("batch and mem-batch must be at most 1000 events".into());
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Deliveries built from the shared fixtures

#[derive(Clone, Copy, Debug)]
enum Slot {
    Event,
    Message,
    Conversation,
    EndUser,
    UserKey,
}

#[derive(Debug)]
enum Piece {
    Text(String),
    Slot(Slot),
}

/// One fixture event, compact JSON, with its ids cut out.
#[derive(Debug)]
struct Template(Vec<Piece>);

struct Corpus {
    /// `","webhookId":"..","webhookUrl":"..","messages":[` (follows the delivery id).
    envelope_tail: String,
    /// Every event of every fixture, fixtures in file-name order.
    events: Vec<Template>,
    /// Indexes into `events` of each fixture's events.
    fixtures: Vec<Vec<usize>>,
    names: Vec<String>,
}

fn load_corpus(dir: &Path) -> Result<Corpus, String> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("fixtures {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    let mut corpus = Corpus {
        envelope_tail: String::new(),
        events: Vec::new(),
        fixtures: Vec::new(),
        names: Vec::new(),
    };
    for path in paths {
        let delivery = common::read_fixture(&path)?;
        if corpus.envelope_tail.is_empty() {
            corpus.envelope_tail = common::envelope_tail(&delivery);
        }
        let messages = delivery["messages"]
            .as_array()
            .ok_or_else(|| format!("{}: no messages[]", path.display()))?;
        let mut indexes = Vec::new();
        for message in messages {
            let mut event = message.clone();
            event["id"] = Value::String("@@E@@".into());
            mark_ids(&mut event, "");
            let compact = serde_json::to_string(&event).map_err(|e| e.to_string())?;
            let pieces = compact
                .split("@@")
                .enumerate()
                .map(|(i, part)| {
                    if i % 2 == 0 {
                        Ok(Piece::Text(part.to_owned()))
                    } else {
                        match part {
                            "E" => Ok(Piece::Slot(Slot::Event)),
                            "M" => Ok(Piece::Slot(Slot::Message)),
                            "C" => Ok(Piece::Slot(Slot::Conversation)),
                            "U" => Ok(Piece::Slot(Slot::EndUser)),
                            "K" => Ok(Piece::Slot(Slot::UserKey)),
                            other => Err(format!("unknown marker {other}")),
                        }
                    }
                })
                .collect::<Result<Vec<_>, String>>()?;
            indexes.push(corpus.events.len());
            corpus.events.push(Template(pieces));
        }
        if indexes.is_empty() {
            return Err(format!("{}: empty messages[]", path.display()));
        }
        corpus.fixtures.push(indexes);
        corpus.names.push(
            path.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        );
    }
    if corpus.fixtures.is_empty() {
        return Err(format!("no fixtures in {}", dir.display()));
    }
    Ok(corpus)
}

/// Replace the ids that make an event distinct (conversation, end user, user key, message) by
/// markers, so every rendered event is a new one in a chosen conversation.
fn mark_ids(value: &mut Value, parent: &str) {
    match value {
        Value::Object(map) => {
            for (key, child) in map.iter_mut() {
                if let Value::String(s) = child {
                    let slot = match (parent, key.as_str()) {
                        (_, "conversationId" | "lastConversationId") => Some("C"),
                        (_, "endUserId") => Some("U"),
                        (_, "userKey") => Some("K"),
                        ("conversation", "id") => Some("C"),
                        ("endUser", "id") => Some("U"),
                        ("message", "id") => Some("M"),
                        _ => None,
                    };
                    if let Some(slot) = slot {
                        *s = format!("@@{slot}@@");
                    }
                } else {
                    mark_ids(child, key);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| mark_ids(v, parent)),
        _ => {}
    }
}

/// Which deliveries a load posts: request `n` always renders the same body.
#[derive(Clone)]
struct Plan {
    corpus: Rc<Corpus>,
    /// Events per delivery; 0 posts fixture `n % fixtures` as it is.
    batch: usize,
    conversations: u64,
    /// Distinguishes the ids of different runs.
    run: u16,
}

impl Plan {
    /// Render delivery `n` into `out`; returns its number of events.
    fn body(&self, n: u64, out: &mut String) -> usize {
        let c = &self.corpus;
        common::start_delivery(out, self.run, n, &c.envelope_tail);
        let count = if self.batch == 0 {
            let fixture = &c.fixtures[(n % c.fixtures.len() as u64) as usize];
            let conv = n % self.conversations;
            for (k, &e) in fixture.iter().enumerate() {
                if k > 0 {
                    out.push(',');
                }
                self.event(out, e, n * 16 + k as u64, conv);
            }
            fixture.len()
        } else {
            for k in 0..self.batch {
                if k > 0 {
                    out.push(',');
                }
                let global = n * self.batch as u64 + k as u64;
                self.event(
                    out,
                    (global % c.events.len() as u64) as usize,
                    global,
                    global % self.conversations,
                );
            }
            self.batch
        };
        out.push_str("]}");
        count
    }

    fn event(&self, out: &mut String, template: usize, event_no: u64, conv: u64) {
        let run = self.run;
        for piece in &self.corpus.events[template].0 {
            let _ = match piece {
                Piece::Text(t) => {
                    out.push_str(t);
                    Ok(())
                }
                Piece::Slot(Slot::Event) => {
                    common::write_event_id(out, run, event_no);
                    Ok(())
                }
                Piece::Slot(Slot::Message) => {
                    common::write_message_id(out, run, event_no);
                    Ok(())
                }
                Piece::Slot(Slot::Conversation) => {
                    write!(out, "5c0e9b1f-2222-4d3e-9f10-{conv:012x}")
                }
                Piece::Slot(Slot::EndUser) => write!(out, "4e6f0d0a-1111-4a5b-8c9d-{conv:012x}"),
                Piece::Slot(Slot::UserKey) => write!(out, "bench-user-{conv}"),
            };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Load generator: one thread, C keep-alive connections, closed loop

#[derive(Clone, Copy)]
enum Stop {
    /// Run `warmup` unmeasured, then measure for `measure`.
    Timed { warmup: Duration, measure: Duration },
    /// Post exactly this many deliveries (all measured), but stop posting after `limit`.
    Count { total: u64, limit: Duration },
}

struct LoadStats {
    /// 200s whose receipt says `accepted`.
    accepted: u64,
    /// Events those receipts report as accepted.
    events: u64,
    /// Requests completed in the window, whatever the answer.
    requests: u64,
    body_bytes: u64,
    errors: BTreeMap<String, u64>,
    /// Acknowledgment latency of accepted deliveries, microseconds.
    hist: Histogram<u64>,
    window: Duration,
    /// CPU seconds used in the window by the server process and by this (generator) process.
    server_cpu: Option<f64>,
    generator_cpu: Option<f64>,
    /// CPU seconds the rest of the machine used in the window (other processes: noise).
    other_cpu: Option<f64>,
}

impl LoadStats {
    fn per_sec(&self, n: u64) -> f64 {
        n as f64 / self.window.as_secs_f64().max(1e-9)
    }
    fn ms(&self, q: f64) -> f64 {
        common::quantile_ms(&self.hist, q)
    }
    fn errors_text(&self) -> String {
        common::errors_text(&self.errors)
    }
}

struct LoadState {
    next: Cell<u64>,
    total: Option<u64>,
    /// Completions before this instant are not measured.
    window_start: Instant,
    /// No request starts at or after this instant.
    end: Instant,
    first_start: Cell<Option<Instant>>,
    last_done: Cell<Option<Instant>>,
    stats: RefCell<LoadStats>,
}

fn run_load(
    addr: SocketAddr,
    plan: &Plan,
    connections: usize,
    stop: Stop,
    server_pid: u32,
) -> Result<LoadStats, String> {
    let hist = common::histogram(120_000_000)?;
    let t0 = Instant::now();
    let (total, window_start, end) = match stop {
        Stop::Timed { warmup, measure } => (None, t0 + warmup, t0 + warmup + measure),
        Stop::Count { total, limit } => (Some(total), t0, t0 + limit),
    };
    let state = LoadState {
        next: Cell::new(0),
        total,
        window_start,
        end,
        first_start: Cell::new(None),
        last_done: Cell::new(None),
        stats: RefCell::new(LoadStats {
            accepted: 0,
            events: 0,
            requests: 0,
            body_bytes: 0,
            errors: BTreeMap::new(),
            hist,
            window: Duration::ZERO,
            server_cpu: None,
            generator_cpu: None,
            other_cpu: None,
        }),
    };
    let target = Rc::new(Target::new(addr));
    let state = common::run_local(state, |state| async move {
        let cpu_at_start = CpuSample::take([server_pid], None);
        let sampler = matches!(stop, Stop::Timed { .. })
            .then(|| common::sample_cpu([server_pid], None, state.window_start, state.end));
        common::run_workers(connections, || {
            worker(state.clone(), target.clone(), plan.clone())
        })
        .await;
        let cpu = match sampler {
            Some(s) => s.await.ok(),
            None => Some(cpu_at_start.window(&CpuSample::take([server_pid], None))),
        };
        let mut stats = state.stats.borrow_mut();
        if let Some(cpu) = cpu {
            let [server] = cpu.servers;
            stats.server_cpu = server;
            stats.generator_cpu = cpu.me;
            stats.other_cpu = cpu.other;
        }
        stats.window = match stop {
            Stop::Timed { measure, .. } => measure,
            Stop::Count { .. } => match (state.first_start.get(), state.last_done.get()) {
                (Some(a), Some(b)) => b.saturating_duration_since(a),
                _ => Duration::ZERO,
            },
        };
    })?;
    Ok(state.stats.into_inner())
}

async fn worker(state: Rc<LoadState>, target: Rc<Target>, plan: Plan) {
    let mut conn: Option<Conn> = None;
    let mut body = String::with_capacity(64 * 1024);
    let mut request: Vec<u8> = Vec::with_capacity(64 * 1024);
    loop {
        if Instant::now() >= state.end {
            break;
        }
        let n = state.next.get();
        if state.total.is_some_and(|total| n >= total) {
            break;
        }
        state.next.set(n + 1);
        plan.body(n, &mut body);
        target.request(&body, &mut request);

        if conn.is_none() {
            match target.connect().await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    state.record(Instant::now(), Instant::now(), Err(e.to_string()), 0);
                    // Refused or reset: do not spin; a timeout has waited long enough.
                    if matches!(e, ConnectError::Io(_)) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    continue;
                }
            }
        }
        let Some(c) = conn.as_mut() else { continue };
        let started = Instant::now();
        let outcome = c.send(&request).await;
        let done = Instant::now();
        let reuse = matches!(&outcome, Ok(r) if !r.close);
        state.record(started, done, outcome, body.len());
        if !reuse {
            conn = None;
        }
    }
}

impl LoadState {
    fn record(
        &self,
        started: Instant,
        done: Instant,
        outcome: Result<Response, String>,
        body_len: usize,
    ) {
        if self.first_start.get().is_none() {
            self.first_start.set(Some(started));
        }
        self.last_done.set(Some(done));
        if done < self.window_start || (self.total.is_none() && done > self.end) {
            return;
        }
        let mut stats = self.stats.borrow_mut();
        stats.requests += 1;
        stats.body_bytes += body_len as u64;
        match outcome {
            Ok(r) if r.status == 200 && r.receipt_status == "accepted" => {
                stats.accepted += 1;
                stats.events += r.accepted;
                let micros = common::micros(done.duration_since(started));
                stats.hist.saturating_record(micros.max(1));
            }
            Ok(r) => {
                *stats
                    .errors
                    .entry(format!("HTTP {} `{}`", r.status, r.receipt_status))
                    .or_default() += 1
            }
            Err(e) => *stats.errors.entry(e).or_default() += 1,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Server processes

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Case {
    Baseline,
    Daemon,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Baseline => "baseline",
            Case::Daemon => "daemon",
        }
    }
}

fn daemon_command(opts: &Options, data_dir: &Path) -> Command {
    let mut cmd = common::daemon_command(&opts.common.bin, data_dir);
    // Intake only: the shipped rules would act on the fixtures (the end-to-end case with rules
    // is the actions bench). `--daemon-env HANDOFF_BRIDGE__RULES__ENABLED=true` measures both.
    cmd.env("HANDOFF_BRIDGE__RULES__ENABLED", "false");
    cmd.envs(opts.common.daemon_env.iter().map(|(k, v)| (k, v)));
    cmd
}

fn baseline_command() -> Result<Command, String> {
    let me = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
    let mut cmd = common::clean_command(&me);
    cmd.arg(BASELINE_FLAG)
        .env("INTAKE_BENCH_TOKEN", WEBHOOK_TOKEN);
    Ok(cmd)
}

fn http() -> Http {
    Http::new(HTTP_TIMEOUT, BODY)
}

/// Group-commit and dispatch figures of a daemon, from its /metrics.
#[derive(Clone, Copy, Default)]
struct DaemonMetrics {
    flushes: f64,
    flush_mean_ms: f64,
    writers_per_flush: f64,
    events_accepted: f64,
    events_applied: f64,
    inbox_depth: f64,
}

fn daemon_metrics(http: &Http, base: &str) -> Option<DaemonMetrics> {
    let (status, text) = http.get(&format!("{base}/metrics"), None).ok()?;
    if status != 200 {
        return None;
    }
    let flushes = common::metric(&text, "handoff_store_flush_seconds_count")?;
    Some(DaemonMetrics {
        flushes,
        flush_mean_ms: common::metric(&text, "handoff_store_flush_seconds_sum")? * 1000.0
            / flushes.max(1.0),
        writers_per_flush: common::metric(&text, "handoff_store_flush_writers_sum")?
            / flushes.max(1.0),
        events_accepted: common::metric(&text, "handoff_webhook_events_total").unwrap_or(0.0),
        events_applied: common::metric(&text, "handoff_events_applied_total").unwrap_or(0.0),
        inbox_depth: common::metric(&text, "handoff_inbox_depth").unwrap_or(0.0),
    })
}

// ---------------------------------------------------------------------------------------------
// The benchmark

struct RunResult {
    round: usize,
    case: Case,
    stats: LoadStats,
    daemon: Option<DaemonMetrics>,
}

struct MemoryResult {
    posted_events: u64,
    stats: LoadStats,
    drained_after: Option<Duration>,
    rss_start_kb: Option<u64>,
    rss_kb: Option<u64>,
    hwm_kb: Option<u64>,
    rss_anon_kb: Option<u64>,
    disk: (u64, u64),
    /// Apparent bytes of the event log (`store/events`), the rest being sled and small files.
    event_log: u64,
    metrics: Option<DaemonMetrics>,
    shutdown: Duration,
    restart: Duration,
    first_start: Duration,
    rss_after_restart_kb: Option<u64>,
    /// VmRSS after IDLE_AFTER_DRAIN of quiet (a health probe a second, as an orchestrator would).
    rss_idle_kb: Option<u64>,
    ready_after_restart: bool,
}

fn run(opts: &Options) -> Result<(), String> {
    opts.common.check()?;
    let corpus = Rc::new(load_corpus(&common::fixtures_dir())?);
    let machine = common::machine_info(&opts.common.data_root, true);
    eprintln!(
        "intake bench: daemon {}, {} fixtures, data under {}",
        opts.common.bin.display(),
        corpus.fixtures.len(),
        opts.common.data_root.display()
    );
    for (k, v) in &machine {
        eprintln!("  {k}: {v}");
    }

    let mut run_tag: u16 = 0;
    let mut results: Vec<RunResult> = Vec::new();
    for round in 1..=opts.runs {
        // Alternate the order every round so drift over time hits both cases alike.
        let mut order = opts.cases.clone();
        if round % 2 == 0 {
            order.reverse();
        }
        for case in order {
            run_tag = run_tag.wrapping_add(1);
            let plan = Plan {
                corpus: corpus.clone(),
                batch: opts.batch,
                conversations: opts.conversations,
                run: run_tag,
            };
            let result = throughput_run(opts, case, round, plan)?;
            eprintln!(
                "[round {round}/{}] {:<8} {:>9.0} accepted/s {:>9.0} events/s  p50 {:.2} ms  p99 {:.2} ms  p999 {:.2} ms  errors {}",
                opts.runs,
                case.name(),
                result.stats.per_sec(result.stats.accepted),
                result.stats.per_sec(result.stats.events),
                result.stats.ms(0.5),
                result.stats.ms(0.99),
                result.stats.ms(0.999),
                result.stats.errors_text()
            );
            results.push(result);
        }
    }

    let memory = if opts.memory {
        run_tag = run_tag.wrapping_add(1);
        let plan = Plan {
            corpus: corpus.clone(),
            batch: opts.mem_batch,
            conversations: opts.mem_conversations,
            run: run_tag,
        };
        Some(memory_case(opts, plan)?)
    } else {
        None
    };

    let report = report(opts, &machine, &corpus, &results, memory.as_ref());
    common::publish(&report, &opts.common.out)?;
    common::publish_json(
        &json_results(&results, memory.as_ref()),
        opts.common.json.as_deref(),
    )?;
    eprintln!("report written to {}", opts.common.out.display());
    Ok(())
}

fn throughput_run(
    opts: &Options,
    case: Case,
    round: usize,
    plan: Plan,
) -> Result<RunResult, String> {
    let dir = tempfile::Builder::new()
        .prefix("intake-bench-")
        .tempdir_in(&opts.common.data_root)
        .map_err(|e| e.to_string())?;
    let log = dir.path().join(format!("{}.log", case.name()));
    let mut proc = match case {
        Case::Baseline => Proc::spawn("baseline", baseline_command()?, &log)?,
        Case::Daemon => Proc::spawn(
            "daemon",
            daemon_command(opts, &dir.path().join("data")),
            &log,
        )?,
    };
    let stop = Stop::Timed {
        warmup: opts.warmup,
        measure: opts.duration,
    };
    let stats = run_load(proc.addr, &plan, opts.connections, stop, proc.pid)?;
    let daemon = match case {
        Case::Daemon => daemon_metrics(&http(), &proc.admin_base()),
        Case::Baseline => None,
    };
    proc.stop(STOP_POLL)?;
    Ok(RunResult {
        round,
        case,
        stats,
        daemon,
    })
}

/// The quiet spell after the drain before memory is read again.
const IDLE_AFTER_DRAIN: Duration = Duration::from_secs(10);

fn memory_case(opts: &Options, plan: Plan) -> Result<MemoryResult, String> {
    let dir = tempfile::Builder::new()
        .prefix("intake-bench-mem-")
        .tempdir_in(&opts.common.data_root)
        .map_err(|e| e.to_string())?;
    let data = dir.path().join("data");
    let (mut daemon, first_start) = Proc::spawn_timed(
        "daemon",
        daemon_command(opts, &data),
        &dir.path().join("daemon-1.log"),
    )?;
    let rss_start_kb = common::proc_status_kb(daemon.pid, "VmRSS");
    let posted_events = opts.mem_deliveries * opts.mem_batch as u64;
    eprintln!(
        "[memory] posting {} deliveries x {} events = {posted_events} events over {} conversations",
        opts.mem_deliveries, opts.mem_batch, opts.mem_conversations
    );
    let stop = Stop::Count {
        total: opts.mem_deliveries,
        limit: opts.mem_max,
    };
    let stats = run_load(daemon.addr, &plan, opts.connections, stop, daemon.pid)?;
    let posted_at = Instant::now();
    eprintln!(
        "[memory] {} events accepted in {:.1} s ({:.0} events/s, p99 {:.2} ms), errors {}; waiting for the inbox to drain",
        stats.events,
        stats.window.as_secs_f64(),
        stats.per_sec(stats.events),
        stats.ms(0.99),
        stats.errors_text()
    );
    let http = http();
    let drained_after = common::wait_drained(
        &http,
        &daemon.admin_base(),
        posted_at,
        DRAIN_LIMIT,
        "memory",
    )?;
    let rss_kb = common::proc_status_kb(daemon.pid, "VmRSS");
    let hwm_kb = common::proc_status_kb(daemon.pid, "VmHWM");
    let rss_anon_kb = common::proc_status_kb(daemon.pid, "RssAnon");
    let metrics = daemon_metrics(&http, &daemon.admin_base());
    // The allocator returns freed pages after a delay (jemalloc's background thread purges what
    // stayed free for a second): the memory a daemon keeps is the figure after a quiet spell.
    let idle_from = Instant::now();
    let health_url = format!("{}/healthz", daemon.base());
    while idle_from.elapsed() < IDLE_AFTER_DRAIN {
        std::thread::sleep(Duration::from_secs(1));
        http.get(&health_url, None)?;
    }
    let rss_idle_kb = common::proc_status_kb(daemon.pid, "VmRSS");
    let disk = common::dir_size(&data);
    let event_log = common::dir_size(&data.join("store").join("events")).0;
    eprintln!(
        "[memory] drained after {:?}; VmRSS {} kB (peak {} kB); data dir {} bytes",
        drained_after,
        rss_kb.unwrap_or(0),
        hwm_kb.unwrap_or(0),
        disk.0
    );
    let (shutdown, status) = daemon.stop(STOP_POLL)?;
    if !status.success() {
        return Err(format!(
            "daemon exited with {status} on SIGTERM; log:\n{}",
            common::tail(&daemon.log, 20)
        ));
    }
    let (mut again, restart) = Proc::spawn_timed(
        "daemon (restart)",
        daemon_command(opts, &data),
        &dir.path().join("daemon-2.log"),
    )?;
    let rss_after_restart_kb = common::proc_status_kb(again.pid, "VmRSS");
    let ready_after_restart = matches!(
        http.get(&format!("{}/readyz", again.base()), None),
        Ok((200, _))
    );
    eprintln!("[memory] shutdown took {shutdown:?}; restart to `listening:` took {restart:?}");
    again.stop(STOP_POLL)?;
    Ok(MemoryResult {
        posted_events,
        stats,
        drained_after,
        rss_start_kb,
        rss_kb,
        hwm_kb,
        rss_anon_kb,
        disk,
        event_log,
        metrics,
        shutdown,
        restart,
        first_start,
        rss_after_restart_kb,
        rss_idle_kb,
        ready_after_restart,
    })
}

/// The figures `benches/run` tabulates: per run throughput and latency, the memory case.
fn json_results(results: &[RunResult], memory: Option<&MemoryResult>) -> Value {
    let mib = |kb: Option<u64>| kb.map(|k| k as f64 / 1024.0);
    let runs: Vec<Value> = results
        .iter()
        .map(|r| {
            serde_json::json!({
                "round": r.round,
                "case": r.case.name(),
                "accepted_per_s": r.stats.per_sec(r.stats.accepted),
                "events_per_s": r.stats.per_sec(r.stats.events),
                "p50_ms": r.stats.ms(0.5),
                "p99_ms": r.stats.ms(0.99),
                "p999_ms": r.stats.ms(0.999),
                "errors": r.stats.errors.values().sum::<u64>(),
                "other_cpu": r.stats.other_cpu.map(|c| c / r.stats.window.as_secs_f64().max(1e-9)),
            })
        })
        .collect();
    let memory = memory.map(|m| {
        serde_json::json!({
            "posted_events": m.posted_events,
            "accepted_events": m.stats.events,
            "errors": m.stats.errors.values().sum::<u64>(),
            "drained": m.drained_after.is_some(),
            "rss_after_drain_mib": mib(m.rss_kb),
            "rss_peak_mib": mib(m.hwm_kb),
            "rss_after_restart_mib": mib(m.rss_after_restart_kb),
            "disk_mib": m.disk.0 as f64 / (1024.0 * 1024.0),
            "disk_allocated_mib": m.disk.1 as f64 / (1024.0 * 1024.0),
            "event_log_mib": m.event_log as f64 / (1024.0 * 1024.0),
            "shutdown_s": m.shutdown.as_secs_f64(),
            "restart_s": m.restart.as_secs_f64(),
            "ready_after_restart": m.ready_after_restart,
        })
    });
    serde_json::json!({ "bench": "intake", "runs": runs, "memory": memory })
}

// ---------------------------------------------------------------------------------------------
// Report

fn mib(kb: Option<u64>) -> String {
    kb.map_or("n/a".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0))
}

fn report(
    opts: &Options,
    machine: &[(String, String)],
    corpus: &Corpus,
    results: &[RunResult],
    memory: Option<&MemoryResult>,
) -> String {
    let mut r = String::new();
    common::report_head(&mut r, "Intake", opts.quick, machine);
    let body_mean = {
        let (b, n) = results.iter().fold((0u64, 0u64), |(b, n), x| {
            (b + x.stats.body_bytes, n + x.stats.requests)
        });
        b.checked_div(n).unwrap_or(0)
    };
    let _ = writeln!(
        r,
        "\nSettings: {} connections, {:.1} s measured after {:.1} s warm-up per run, {} runs per case alternating \
         (order flips each round), fresh server and data directory per run; deliveries: {} (mean body {} bytes), \
         {} conversation ids. Load generator: one thread in the bench process, closed loop.\n",
        opts.connections,
        opts.duration.as_secs_f64(),
        opts.warmup.as_secs_f64(),
        opts.runs,
        if opts.batch == 0 { format!("the {} fixtures in turn, as they are (1-2 events each)", corpus.fixtures.len()) } else { format!("{} events each, cycling over the fixtures' events", opts.batch) },
        body_mean,
        opts.conversations
    );
    let _ = writeln!(
        r,
        "Daemon: `{}` (git {}){}.\n",
        opts.common.bin.display(),
        common::git_head(),
        if opts.common.daemon_env.is_empty() {
            String::new()
        } else {
            format!(
                ", extra environment {}",
                opts.common
                    .daemon_env
                    .iter()
                    .map(|(k, v)| format!("`{k}={v}`"))
                    .collect::<Vec<_>>()
                    .join(" ")
            )
        }
    );

    let _ = writeln!(r, "### Every run\n");
    let _ = writeln!(
        r,
        "| round | case | accepted/s | events/s | p50 ms | p99 ms | p999 ms | max ms | errors | server CPU | generator CPU | other CPU | flushes | writers/flush | mean flush ms | inbox left |"
    );
    let _ = writeln!(
        r,
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for x in results {
        let s = &x.stats;
        let cpu = |c: Option<f64>| {
            c.map_or("n/a".into(), |c| {
                format!("{:.0}%", 100.0 * c / s.window.as_secs_f64().max(1e-9))
            })
        };
        let (flushes, writers, flush_ms, inbox) = match &x.daemon {
            Some(d) => (
                format!("{:.0}", d.flushes),
                format!("{:.1}", d.writers_per_flush),
                format!("{:.2}", d.flush_mean_ms),
                format!("{:.0}", d.inbox_depth),
            ),
            None => ("".into(), "".into(), "".into(), "".into()),
        };
        let _ = writeln!(
            r,
            "| {} | {} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} | {flushes} | {writers} | {flush_ms} | {inbox} |",
            x.round,
            x.case.name(),
            s.per_sec(s.accepted),
            s.per_sec(s.events),
            s.ms(0.5),
            s.ms(0.99),
            s.ms(0.999),
            common::max_ms(&s.hist),
            s.errors_text(),
            cpu(s.server_cpu),
            cpu(s.generator_cpu),
            cpu(s.other_cpu),
        );
    }
    let _ = writeln!(r, "\nCPU columns: CPU time over the measured window as a share of one core (the machine has {}): the server process, the bench (generator) process, and every other process (noise from whatever else runs on the machine; near 0% is a clean run).", machine.first().map_or("?", |m| m.1.as_str()));
    let _ = writeln!(r, "flushes .. inbox left: the daemon's own /metrics at the end of the run (warm-up included); inbox left = accepted events not yet folded into state.\n");

    let pick = |case: Case, f: &dyn Fn(&LoadStats) -> f64| -> Vec<f64> {
        results
            .iter()
            .filter(|x| x.case == case)
            .map(|x| f(&x.stats))
            .collect()
    };
    let rate = |s: &LoadStats| s.per_sec(s.accepted);
    let ev_rate = |s: &LoadStats| s.per_sec(s.events);
    let p50 = |s: &LoadStats| s.ms(0.5);
    let p99 = |s: &LoadStats| s.ms(0.99);
    let p999 = |s: &LoadStats| s.ms(0.999);
    // Ratio per round: daemon against the baseline measured next to it.
    let ratios: Vec<f64> = (1..=opts.runs)
        .filter_map(|round| {
            let get = |case| {
                results
                    .iter()
                    .find(|x| x.round == round && x.case == case)
                    .map(|x| rate(&x.stats))
            };
            match (get(Case::Daemon), get(Case::Baseline)) {
                (Some(d), Some(b)) if b > 0.0 => Some(d / b),
                _ => None,
            }
        })
        .collect();

    let _ = writeln!(
        r,
        "### Summary (min / median / max over {} runs each)\n",
        opts.runs
    );
    let _ = writeln!(
        r,
        "| case | accepted deliveries/s | events/s | p50 ms | p99 ms | p999 ms |"
    );
    let _ = writeln!(r, "|---|---:|---:|---:|---:|---:|");
    for case in [Case::Baseline, Case::Daemon] {
        let _ = writeln!(
            r,
            "| {} | {} | {} | {} | {} | {} |",
            case.name(),
            common::mmm(&pick(case, &rate), 0),
            common::mmm(&pick(case, &ev_rate), 0),
            common::mmm(&pick(case, &p50), 2),
            common::mmm(&pick(case, &p99), 2),
            common::mmm(&pick(case, &p999), 2)
        );
    }
    let _ = writeln!(
        r,
        "| daemon / baseline (paired by round) | {} | | | | |",
        common::mmm(&ratios, 3)
    );

    let mut targets: Vec<(String, String, bool)> = Vec::new();
    let (ratio_min, ratio_med, _) = common::summary(&ratios);
    targets.push((
        "durable intake >= 30% of the bare baseline's throughput".into(),
        format!(
            "median ratio {:.1}% (min {:.1}%)",
            ratio_med * 100.0,
            ratio_min * 100.0
        ),
        ratio_med >= 0.30,
    ));
    let (_, p99_med, p99_max) = common::summary(&pick(Case::Daemon, &p99));
    targets.push((
        "daemon p99 acknowledgment latency < 10 ms".into(),
        format!("median p99 {p99_med:.2} ms (worst run {p99_max:.2} ms)"),
        p99_med < 10.0,
    ));

    if let Some(m) = memory {
        let s = &m.stats;
        let _ = writeln!(
            r,
            "\n### Memory, disk and restart after {} events\n",
            m.posted_events
        );
        let _ = writeln!(r, "| measure | value |\n|---|---|");
        let _ = writeln!(
            r,
            "| posted | {} deliveries x {} events over {} conversation ids, {} connections |",
            opts.mem_deliveries, opts.mem_batch, opts.mem_conversations, opts.connections
        );
        let _ = writeln!(
            r,
            "| accepted | {} deliveries, {} events (errors: {}) |",
            s.accepted,
            s.events,
            s.errors_text()
        );
        let _ = writeln!(r, "| intake | {:.1} s: {:.0} deliveries/s, {:.0} events/s; p50 {:.2} ms, p99 {:.2} ms, p999 {:.2} ms |", s.window.as_secs_f64(), s.per_sec(s.accepted), s.per_sec(s.events), s.ms(0.5), s.ms(0.99), s.ms(0.999));
        let _ = writeln!(
            r,
            "| inbox drained | {} after the last acknowledgment |",
            m.drained_after.map_or("NOT drained".into(), |d| format!(
                "{:.1} s",
                d.as_secs_f64()
            ))
        );
        if let Some(d) = &m.metrics {
            let _ = writeln!(r, "| daemon metrics | {:.0} events accepted, {:.0} folded, {:.0} flushes ({:.1} writers/flush, {:.2} ms mean) |", d.events_accepted, d.events_applied, d.flushes, d.writers_per_flush, d.flush_mean_ms);
        }
        let _ = writeln!(r, "| VmRSS at start | {} |", mib(m.rss_start_kb));
        let _ = writeln!(
            r,
            "| **VmRSS after drain** | **{}** (RssAnon {}) |",
            mib(m.rss_kb),
            mib(m.rss_anon_kb)
        );
        let _ = writeln!(
            r,
            "| **VmRSS after {} s idle** (a /healthz a second) | **{}** |",
            IDLE_AFTER_DRAIN.as_secs(),
            mib(m.rss_idle_kb)
        );
        let _ = writeln!(r, "| VmHWM (peak RSS) | {} |", mib(m.hwm_kb));
        let _ = writeln!(
            r,
            "| data directory | {:.1} MiB apparent, {:.1} MiB allocated ({:.0} bytes per event) |",
            m.disk.0 as f64 / 1048576.0,
            m.disk.1 as f64 / 1048576.0,
            m.disk.0 as f64 / (s.events.max(1)) as f64
        );
        let _ = writeln!(
            r,
            "| of which the event log | {:.1} MiB ({:.0} bytes per event); sled and the rest {:.1} MiB |",
            m.event_log as f64 / 1048576.0,
            m.event_log as f64 / (s.events.max(1)) as f64,
            m.disk.0.saturating_sub(m.event_log) as f64 / 1048576.0
        );
        let _ = writeln!(
            r,
            "| first start (empty data dir) | {:.0} ms to `listening:` |",
            m.first_start.as_secs_f64() * 1000.0
        );
        let _ = writeln!(
            r,
            "| shutdown (SIGTERM to exit) | {:.0} ms |",
            m.shutdown.as_secs_f64() * 1000.0
        );
        let _ = writeln!(
            r,
            "| **restart** (spawn to `listening:`, same data dir) | **{:.0} ms** (ready: {}) |",
            m.restart.as_secs_f64() * 1000.0,
            if m.ready_after_restart { "yes" } else { "NO" }
        );
        let _ = writeln!(
            r,
            "| VmRSS after restart | {} |",
            mib(m.rss_after_restart_kb)
        );
        let rss_mb = m.rss_kb.map_or(f64::INFINITY, |k| k as f64 * 1024.0 / 1e6);
        let full = m.posted_events >= 1_000_000 && s.events >= 1_000_000;
        targets.push((
            format!(
                "RSS < 100 MB after 1,000,000 events{}",
                if full { "" } else { " (NOT a 1M-event run)" }
            ),
            format!(
                "{:.1} MB ({}) right after draining {} events; {} after {} s idle",
                rss_mb,
                mib(m.rss_kb),
                s.events,
                mib(m.rss_idle_kb),
                IDLE_AFTER_DRAIN.as_secs()
            ),
            rss_mb < 100.0 && full,
        ));
    }

    let _ = writeln!(
        r,
        "\n### Targets (2 cores, {} connections)\n",
        opts.connections
    );
    let _ = writeln!(r, "| target | measured | met |\n|---|---|---|");
    for (name, measured, ok) in &targets {
        let _ = writeln!(
            r,
            "| {name} | {measured} | {} |",
            if *ok { "yes" } else { "**no**" }
        );
    }
    r
}

// ---------------------------------------------------------------------------------------------
// The bare baseline server (this binary run with --baseline-server)

mod baseline {
    use actix_web::{web, App, HttpMessage, HttpRequest, HttpResponse, HttpServer};
    use futures_util::StreamExt;
    use handoff_bridge::config::{Config, Overrides, Secret};
    use handoff_bridge::intake::auth::TokenSet;
    use handoff_bridge::intake::Receipt;
    use std::time::Duration;

    struct State {
        tokens: TokenSet,
        max_body_bytes: usize,
        body_read_timeout: Duration,
    }

    /// Serve until SIGTERM or the lifetime bound. Settings come from the daemon's embedded
    /// defaults, so both servers run with the same workers, limits and timeouts.
    pub fn serve() -> Result<(), String> {
        let config = Config::load_from(None, Vec::<(String, String)>::new(), &Overrides::default())
            .map_err(|e| e.to_string())?;
        let token = std::env::var("INTAKE_BENCH_TOKEN")
            .map_err(|_| "INTAKE_BENCH_TOKEN is not set".to_owned())?;
        actix_web::rt::System::new().block_on(async move {
            let state = web::Data::new(State {
                tokens: TokenSet::new(vec![Secret::new(token)]),
                max_body_bytes: config.webhook.max_body_bytes,
                body_read_timeout: config.server.body_read_timeout,
            });
            let route = format!("{}/{{token}}", config.webhook.path);
            let workers = match config.server.workers {
                0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
                n => n,
            };
            let server = HttpServer::new(move || App::new().app_data(state.clone()).route(&route, web::post().to(receive)))
                .workers(workers)
                .max_connections(config.server.max_connections)
                .client_request_timeout(config.server.client_request_timeout)
                .keep_alive(config.server.keep_alive)
                .shutdown_timeout(config.server.shutdown_timeout.as_secs().max(1))
                .disable_signals()
                .bind(("127.0.0.1", 0))
                .map_err(|e| e.to_string())?;
            let addr = server.addrs().first().copied().ok_or("no bound address")?;
            let server = server.run();
            let handle = server.handle();
            println!("listening: http://{addr}");
            let mut task = actix_web::rt::spawn(server);
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(|e| e.to_string())?;
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::time::sleep(super::BASELINE_LIFETIME) => {}
                res = &mut task => return res.map_err(|e| e.to_string())?.map_err(|e| e.to_string()),
            }
            handle.stop(true).await;
            let _ = task.await;
            Ok(())
        })
    }

    /// The daemon's handler without the store: token, body limit, validation, receipt.
    async fn receive(
        req: HttpRequest,
        token: web::Path<String>,
        mut payload: web::Payload,
        state: web::Data<State>,
    ) -> HttpResponse {
        if !state.tokens.accepts(&token) {
            return HttpResponse::Unauthorized().finish();
        }
        let limit = state.max_body_bytes;
        let declared = req
            .headers()
            .get(actix_web::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|len| len > limit as u64) {
            return HttpResponse::PayloadTooLarge().finish();
        }
        let read = async {
            let mut buf = bytes::BytesMut::new();
            while let Some(chunk) = payload.next().await {
                let chunk = chunk.map_err(|e| e.to_string())?;
                if buf.len() + chunk.len() > limit {
                    return Err("too large".to_owned());
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(buf)
        };
        let body = match tokio::time::timeout(state.body_read_timeout, read).await {
            Ok(Ok(body)) => body,
            _ => return HttpResponse::BadRequest().finish(),
        };
        let ct = req.content_type().trim().to_ascii_lowercase();
        let json =
            ct == "application/json" || (ct.starts_with("application/") && ct.ends_with("+json"));
        let parsed = if json {
            model::webhook::parse_delivery(&body).ok()
        } else {
            None
        };
        let receipt = match parsed {
            Some(p) if !p.events.is_empty() => Receipt {
                status: "accepted".into(),
                delivery_id: Some(p.id.to_string()),
                accepted: p.events.len(),
                duplicates: 0,
                quarantined: p.invalid.len(),
                reason: None,
                detail: None,
                quarantine_id: None,
            },
            _ => Receipt {
                status: "quarantined".into(),
                delivery_id: None,
                accepted: 0,
                duplicates: 0,
                quarantined: 1,
                reason: Some("invalid".into()),
                detail: None,
                quarantine_id: None,
            },
        };
        HttpResponse::Ok().json(receipt)
    }
}
