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
//!   it with `handoff_bridge::webhook::parse_delivery` (serde_json: envelope and every event) and
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

use hdrhistogram::Histogram;
use serde_json::Value;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write as _};
use std::net::SocketAddr;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::rc::Rc;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const WEBHOOK_TOKEN: &str = "bench-webhook-token-0123456789";
const ADMIN_TOKEN: &str = "bench-admin-token-0123456789";
const BASELINE_FLAG: &str = "--baseline-server";
/// A baseline server stops by itself after this long, whatever happens to the bench.
const BASELINE_LIFETIME: Duration = Duration::from_secs(30 * 60);
const START_TIMEOUT: Duration = Duration::from_secs(120);
const STOP_TIMEOUT: Duration = Duration::from_secs(60);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for the daemon to fold everything after the memory case's load.
const DRAIN_LIMIT: Duration = Duration::from_secs(15 * 60);

/// The same allocator as the daemon, so the baseline server differs from it only in storing.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(BASELINE_FLAG) {
        if let Err(e) = baseline::serve() {
            eprintln!("baseline server: {e}");
            std::process::exit(1);
        }
        return;
    }
    let opts = match Options::parse(&args) {
        Ok(o) => o,
        Err(msg) => {
            eprintln!("{msg}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&opts) {
        eprintln!("intake bench failed: {e}");
        std::process::exit(1);
    }
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
    data_root: PathBuf,
    out: PathBuf,
    bin: PathBuf,
    /// Extra environment for the daemon (tuning experiments), e.g.
    /// `HANDOFF_BRIDGE__DISPATCH__CONCURRENCY=4`.
    daemon_env: Vec<(String, String)>,
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
  --bin PATH              daemon binary (default: the one cargo built for this bench)
  --daemon-env K=V[,K=V]  extra environment for the daemon, e.g. HANDOFF_BRIDGE__DISPATCH__BATCH_SIZE=512
Every option can also be given as INTAKE_BENCH_<NAME> (e.g. INTAKE_BENCH_CONNECTIONS=32,
INTAKE_BENCH_QUICK=1); flags win over variables.";

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
    "data-root",
    "out",
    "bin",
    "daemon-env",
];

impl Options {
    fn full() -> Self {
        let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
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
            out: tmp.join("intake-bench.md"),
            data_root: tmp,
            bin: PathBuf::from(env!("CARGO_BIN_EXE_handoff-bridge")),
            daemon_env: Vec::new(),
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

    fn parse(args: &[String]) -> Result<Self, String> {
        let env = |name: &str| {
            std::env::var(format!(
                "INTAKE_BENCH_{}",
                name.to_uppercase().replace('-', "_")
            ))
            .ok()
        };
        let truthy = |v: &str| !matches!(v, "" | "0" | "false" | "no");
        let quick = args.iter().any(|a| a == "--quick") || env("quick").is_some_and(|v| truthy(&v));
        let mut opts = if quick {
            Options::quick()
        } else {
            Options::full()
        };
        let mut settings: Vec<(String, String)> = KEYS
            .iter()
            .filter_map(|k| env(k).map(|v| ((*k).to_owned(), v)))
            .collect();
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            match arg.as_str() {
                // cargo passes --bench to every bench binary.
                "--quick" | "--bench" => {}
                "--no-memory" => settings.push(("memory".into(), "false".into())),
                "--help" | "-h" => return Err(USAGE.to_owned()),
                flag if flag.starts_with("--") => {
                    let (name, value) = match flag[2..].split_once('=') {
                        Some((n, v)) => (n.to_owned(), v.to_owned()),
                        None => {
                            let v = it
                                .next()
                                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
                            (flag[2..].to_owned(), v.clone())
                        }
                    };
                    settings.push((name, value));
                }
                other => return Err(format!("unexpected argument `{other}`\n{USAGE}")),
            }
        }
        for (key, value) in settings {
            opts.set(&key, &value, truthy(&value))?;
        }
        if opts.connections == 0
            || opts.runs == 0
            || opts.conversations == 0
            || opts.mem_conversations == 0
            || opts.mem_batch == 0
        {
            return Err("connections, runs, conversations, mem-conversations and mem-batch must be at least 1".into());
        }
        if opts.batch > 1_000 || opts.mem_batch > 1_000 {
            return Err("batch and mem-batch must be at most 1000 events".into());
        }
        Ok(opts)
    }

    fn set(&mut self, key: &str, value: &str, truthy: bool) -> Result<(), String> {
        let num = || {
            value
                .parse::<u64>()
                .map_err(|_| format!("--{key}: `{value}` is not a whole number"))
        };
        let secs = || {
            value
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| format!("--{key}: `{value}` is not a number of seconds"))
        };
        let size =
            || num().and_then(|n| usize::try_from(n).map_err(|_| format!("--{key}: too large")));
        match key {
            "connections" => self.connections = size()?,
            "duration" => self.duration = secs()?,
            "warmup" => self.warmup = secs()?,
            "runs" => self.runs = size()?,
            "cases" => {
                self.cases = match value {
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
            "conversations" => self.conversations = num()?,
            "batch" => self.batch = size()?,
            "memory" => self.memory = truthy,
            "mem-deliveries" => self.mem_deliveries = num()?,
            "mem-batch" => self.mem_batch = size()?,
            "mem-conversations" => self.mem_conversations = num()?,
            "mem-max" => self.mem_max = secs()?,
            "data-root" => self.data_root = PathBuf::from(value),
            "out" => self.out = PathBuf::from(value),
            "bin" => self.bin = PathBuf::from(value),
            "daemon-env" => {
                for pair in value.split(',').filter(|p| !p.is_empty()) {
                    let (k, v) = pair
                        .split_once('=')
                        .ok_or_else(|| format!("--daemon-env: `{pair}` is not K=V"))?;
                    self.daemon_env.push((k.to_owned(), v.to_owned()));
                }
            }
            other => return Err(format!("unknown option --{other}\n{USAGE}")),
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

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/webhooks")
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
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        if text.contains("@@") {
            return Err(format!(
                "{}: contains `@@`, which the templates use as a marker",
                path.display()
            ));
        }
        let delivery: Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        if corpus.envelope_tail.is_empty() {
            let field =
                |k: &str| serde_json::to_string(&delivery[k]).unwrap_or_else(|_| "\"\"".into());
            corpus.envelope_tail = format!(
                "\",\"webhookId\":{},\"webhookUrl\":{},\"messages\":[",
                field("webhookId"),
                field("webhookUrl")
            );
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
        out.clear();
        let _ = write!(
            out,
            "{{\"id\":\"1d0c{:04x}-0000-4000-8000-{n:012x}",
            self.run
        );
        out.push_str(&c.envelope_tail);
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
                    write!(out, "3e5f{run:04x}-0000-4000-8000-{event_no:012x}")
                }
                Piece::Slot(Slot::Message) => {
                    write!(out, "6a1d{run:04x}-0000-4000-8000-{event_no:012x}")
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
        self.hist.value_at_quantile(q) as f64 / 1000.0
    }
    fn errors_text(&self) -> String {
        if self.errors.is_empty() {
            "0".into()
        } else {
            self.errors
                .iter()
                .map(|(k, v)| format!("{v} {k}"))
                .collect::<Vec<_>>()
                .join("; ")
        }
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

struct Target {
    addr: SocketAddr,
    head_prefix: String,
}

impl Target {
    fn new(addr: SocketAddr) -> Self {
        let head_prefix = format!(
            "POST /webhook/{WEBHOOK_TOKEN} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nUser-Agent: CLOSER/webhook\r\nContent-Length: "
        );
        Target { addr, head_prefix }
    }
}

fn run_load(
    addr: SocketAddr,
    plan: &Plan,
    connections: usize,
    stop: Stop,
    server_pid: u32,
) -> Result<LoadStats, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let local = tokio::task::LocalSet::new();
    let hist = Histogram::<u64>::new_with_bounds(1, 120_000_000, 3).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let (total, window_start, end) = match stop {
        Stop::Timed { warmup, measure } => (None, t0 + warmup, t0 + warmup + measure),
        Stop::Count { total, limit } => (Some(total), t0, t0 + limit),
    };
    let state = Rc::new(LoadState {
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
    });
    let target = Rc::new(Target::new(addr));
    local.block_on(&rt, async {
        let cpu_at_start = CpuSample::take(server_pid);
        let sampler = matches!(stop, Stop::Timed { .. }).then(|| {
            let state = state.clone();
            tokio::task::spawn_local(async move {
                tokio::time::sleep_until(state.window_start.into()).await;
                let a = CpuSample::take(server_pid);
                tokio::time::sleep_until(state.end.into()).await;
                let b = CpuSample::take(server_pid);
                (a, b)
            })
        });
        let workers: Vec<_> = (0..connections)
            .map(|_| tokio::task::spawn_local(worker(state.clone(), target.clone(), plan.clone())))
            .collect();
        for w in workers {
            let _ = w.await;
        }
        let cpu = match sampler {
            Some(s) => s.await.ok(),
            None => Some((cpu_at_start, CpuSample::take(server_pid))),
        };
        let mut stats = state.stats.borrow_mut();
        if let Some((a, b)) = cpu {
            stats.server_cpu = a.server.zip(b.server).map(|(x, y)| y - x);
            stats.generator_cpu = a.me.zip(b.me).map(|(x, y)| y - x);
            let busy = a.machine_busy.zip(b.machine_busy).map(|(x, y)| y - x);
            stats.other_cpu = match (busy, stats.server_cpu, stats.generator_cpu) {
                (Some(all), Some(server), Some(me)) => Some((all - server - me).max(0.0)),
                _ => None,
            };
        }
        stats.window = match stop {
            Stop::Timed { measure, .. } => measure,
            Stop::Count { .. } => match (state.first_start.get(), state.last_done.get()) {
                (Some(a), Some(b)) => b.saturating_duration_since(a),
                _ => Duration::ZERO,
            },
        };
    });
    drop(local);
    let state = Rc::try_unwrap(state).map_err(|_| "load state still shared".to_owned())?;
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
        request.clear();
        request.extend_from_slice(target.head_prefix.as_bytes());
        let _ = write!(request, "{}\r\n\r\n", body.len());
        request.extend_from_slice(body.as_bytes());

        if conn.is_none() {
            match tokio::time::timeout(REQUEST_TIMEOUT, Conn::open(target.addr)).await {
                Ok(Ok(c)) => conn = Some(c),
                Ok(Err(e)) => {
                    state.record(
                        Instant::now(),
                        Instant::now(),
                        Err(format!("connect: {}", e.kind())),
                        0,
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Err(_) => {
                    state.record(
                        Instant::now(),
                        Instant::now(),
                        Err("connect timeout".into()),
                        0,
                    );
                    continue;
                }
            }
        }
        let Some(c) = conn.as_mut() else { continue };
        let started = Instant::now();
        let outcome = match tokio::time::timeout(REQUEST_TIMEOUT, c.exchange(&request)).await {
            Ok(r) => r,
            Err(_) => Err("request timeout".to_owned()),
        };
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
                stats.events += r.accepted_events;
                let micros =
                    u64::try_from(done.duration_since(started).as_micros()).unwrap_or(u64::MAX);
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

struct Response {
    status: u16,
    /// The receipt's `status` field (`accepted`, `duplicate`, `quarantined`), or empty.
    receipt_status: String,
    accepted_events: u64,
    close: bool,
}

/// A minimal HTTP/1.1 client connection: one request at a time, `Content-Length` bodies (what
/// actix sends for these answers).
struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    async fn open(addr: SocketAddr) -> std::io::Result<Conn> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Conn {
            stream,
            buf: Vec::with_capacity(8 * 1024),
        })
    }

    async fn exchange(&mut self, request: &[u8]) -> Result<Response, String> {
        self.stream
            .write_all(request)
            .await
            .map_err(|e| format!("write: {}", e.kind()))?;
        self.buf.clear();
        let head_len = loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                break i + 4;
            }
            if self.buf.len() > 64 * 1024 {
                return Err("response head too large".into());
            }
            self.read_more().await?;
        };
        let (status, length, close) = {
            let head = std::str::from_utf8(&self.buf[..head_len])
                .map_err(|_| "response head is not UTF-8".to_owned())?;
            let mut lines = head.split("\r\n");
            let status = lines
                .next()
                .and_then(|l| l.split(' ').nth(1))
                .and_then(|s| s.parse::<u16>().ok())
                .ok_or_else(|| "bad status line".to_owned())?;
            let (mut length, mut close) = (None, false);
            for line in lines {
                let Some((name, value)) = line.split_once(':') else {
                    continue;
                };
                let value = value.trim();
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.parse::<usize>().ok();
                } else if name.eq_ignore_ascii_case("connection") {
                    close = value.eq_ignore_ascii_case("close");
                } else if name.eq_ignore_ascii_case("transfer-encoding") {
                    return Err("chunked responses are not supported by the bench client".into());
                }
            }
            (
                status,
                length.ok_or_else(|| "response without content-length".to_owned())?,
                close,
            )
        };
        while self.buf.len() < head_len + length {
            self.read_more().await?;
        }
        let body = &self.buf[head_len..head_len + length];
        Ok(Response {
            status,
            receipt_status: receipt_str(body, b"\"status\":\"").unwrap_or_default(),
            accepted_events: receipt_num(body, b"\"accepted\":").unwrap_or(0),
            close,
        })
    }

    async fn read_more(&mut self) -> Result<(), String> {
        if self.buf.capacity() - self.buf.len() < 1024 {
            self.buf.reserve(8 * 1024);
        }
        match self.stream.read_buf(&mut self.buf).await {
            Ok(0) => Err("connection closed by server".into()),
            Ok(_) => Ok(()),
            Err(e) => Err(format!("read: {}", e.kind())),
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn receipt_str(body: &[u8], key: &[u8]) -> Option<String> {
    let start = find(body, key)? + key.len();
    let len = body[start..].iter().position(|&b| b == b'"')?;
    Some(String::from_utf8_lossy(&body[start..start + len]).into_owned())
}

fn receipt_num(body: &[u8], key: &[u8]) -> Option<u64> {
    let start = find(body, key)? + key.len();
    let digits: String = body[start..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .map(|&b| b as char)
        .collect();
    digits.parse().ok()
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

/// A child process started here. Dropping it kills it (by its PID) if it still runs; it also gets
/// SIGKILL from the kernel if this process dies first.
struct Proc {
    name: String,
    child: Child,
    pid: u32,
    addr: SocketAddr,
    /// From spawn to the `listening:` line.
    started_in: Duration,
    log: PathBuf,
}

/// `cmd` run under `setpriv --pdeathsig KILL` when setpriv is installed.
fn with_parent_death_signal(cmd: Command) -> Command {
    let setpriv = Path::new("/usr/bin/setpriv");
    if !setpriv.exists() {
        return cmd;
    }
    let mut wrapped = Command::new(setpriv);
    wrapped
        .args(["--pdeathsig", "KILL", "--"])
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => wrapped.env(k, v),
            None => wrapped.env_remove(k),
        };
    }
    if let Some(dir) = cmd.get_current_dir() {
        wrapped.current_dir(dir);
    }
    wrapped
}

impl Proc {
    fn spawn(name: &str, cmd: Command, log: &Path) -> Result<Proc, String> {
        let log_file = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
        // Dies with the bench even if the bench is killed: setpriv sets the parent-death signal
        // and execs the program in place (same PID). Without setpriv, the stop-by-PID path and
        // the servers' own time limits still apply.
        let mut cmd = with_parent_death_signal(cmd);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file));
        let t0 = Instant::now();
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {name}: {e}"))?;
        let pid = child.id();
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, rx) = mpsc::channel();
        // Reads the start line, then keeps draining stdout until the process exits.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.trim().strip_prefix("listening: http://") {
                    let _ = tx.send((rest.to_owned(), Instant::now()));
                }
            }
        });
        let mut proc = Proc {
            name: name.to_owned(),
            child,
            pid,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            started_in: Duration::ZERO,
            log: log.to_path_buf(),
        };
        match rx.recv_timeout(START_TIMEOUT) {
            Ok((addr, at)) => {
                proc.addr = addr
                    .parse()
                    .map_err(|_| format!("{name}: bad listening address {addr}"))?;
                proc.started_in = at.duration_since(t0);
                Ok(proc)
            }
            Err(_) => {
                let _ = proc.child.kill();
                let status = proc.child.wait();
                Err(format!(
                    "{name} did not start (exit {status:?}); log {}:\n{}",
                    log.display(),
                    tail(&proc.log, 20)
                ))
            }
        }
    }

    /// SIGTERM, then wait for the exit (SIGKILL after STOP_TIMEOUT). Returns how long it took.
    fn stop(&mut self) -> Result<(Duration, ExitStatus), String> {
        let t0 = Instant::now();
        if let Ok(Some(status)) = self.child.try_wait() {
            return Err(format!(
                "{} had already exited: {status}; log:\n{}",
                self.name,
                tail(&self.log, 20)
            ));
        }
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.pid).map_err(|_| "pid")?);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)
            .map_err(|e| format!("SIGTERM {}: {e}", self.name))?;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Ok((t0.elapsed(), status)),
                Ok(None) if t0.elapsed() < STOP_TIMEOUT => {
                    std::thread::sleep(Duration::from_millis(2))
                }
                _ => {
                    let _ = self.child.kill();
                    let status = self.child.wait().map_err(|e| e.to_string())?;
                    return Err(format!(
                        "{} did not stop within {STOP_TIMEOUT:?} of SIGTERM; killed ({status})",
                        self.name
                    ));
                }
            }
        }
    }

    fn base(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn daemon_command(opts: &Options, data_dir: &Path) -> Command {
    let mut cmd = Command::new(&opts.bin);
    cmd.arg("serve")
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--data-dir")
        .arg(data_dir)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HANDOFF_BRIDGE_WEBHOOK_TOKENS", WEBHOOK_TOKEN)
        .env("HANDOFF_BRIDGE_ADMIN_TOKEN", ADMIN_TOKEN)
        .env("RUST_LOG", "warn")
        .envs(opts.daemon_env.iter().map(|(k, v)| (k, v)));
    cmd
}

fn baseline_command() -> Result<Command, String> {
    let me = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
    let mut cmd = Command::new(me);
    cmd.arg(BASELINE_FLAG)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("INTAKE_BENCH_TOKEN", WEBHOOK_TOKEN);
    Ok(cmd)
}

/// CPU time used so far by the server, by this process and by the whole machine.
struct CpuSample {
    server: Option<f64>,
    me: Option<f64>,
    machine_busy: Option<f64>,
}

impl CpuSample {
    fn take(server_pid: u32) -> CpuSample {
        CpuSample {
            server: cpu_seconds(Some(server_pid)),
            me: cpu_seconds(None),
            machine_busy: machine_busy_seconds(),
        }
    }
}

/// Busy (not idle, not iowait) CPU time of the whole machine, from /proc/stat, in seconds.
fn machine_busy_seconds() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let line = text.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    let busy = v
        .iter()
        .take(8)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, x)| x)
        .sum::<u64>();
    Some(busy as f64 / 100.0)
}

/// utime + stime of a process (this one when `None`), in seconds.
fn cpu_seconds(pid: Option<u32>) -> Option<f64> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/stat"),
        None => "/proc/self/stat".to_owned(),
    };
    let text = std::fs::read_to_string(path).ok()?;
    // Fields after the `(comm)`: state is field 3, utime 14, stime 15.
    let rest = &text[text.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on Linux.
    Some(ticks as f64 / 100.0)
}

/// A `/proc/<pid>/status` field in kB (VmRSS, VmHWM, RssAnon, RssFile).
fn proc_status_kb(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field).and_then(|r| r.strip_prefix(':')))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// (apparent bytes, allocated bytes) under a directory.
fn dir_size(path: &Path) -> (u64, u64) {
    let mut total = (0, 0);
    let Ok(entries) = std::fs::read_dir(path) else {
        return total;
    };
    for entry in entries.flatten() {
        let Ok(meta) = entry.metadata() else { continue };
        if meta.is_dir() {
            let (a, b) = dir_size(&entry.path());
            total.0 += a;
            total.1 += b;
        } else {
            total.0 += meta.len();
            total.1 += meta.blocks() * 512;
        }
    }
    total
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(90)))
        .build()
        .into()
}

fn http_get(agent: &ureq::Agent, url: &str, bearer: Option<&str>) -> Result<(u16, String), String> {
    let mut req = agent.get(url);
    if let Some(token) = bearer {
        req = req.header("authorization", format!("Bearer {token}"));
    }
    let mut resp = req.call().map_err(|e| format!("GET {url}: {e}"))?;
    let status = resp.status().as_u16();
    Ok((status, resp.body_mut().read_to_string().unwrap_or_default()))
}

/// Sum of every series of a metric in the Prometheus text format.
fn metric(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let value = if rest.starts_with('{') {
            rest.rsplit_once(' ').map(|(_, v)| v)
        } else {
            rest.strip_prefix(' ')
        };
        if let Some(v) = value.and_then(|v| v.trim().parse::<f64>().ok()) {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
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

fn daemon_metrics(agent: &ureq::Agent, base: &str) -> Option<DaemonMetrics> {
    let (status, text) = http_get(agent, &format!("{base}/metrics"), None).ok()?;
    if status != 200 {
        return None;
    }
    let flushes = metric(&text, "handoff_store_flush_seconds_count")?;
    Some(DaemonMetrics {
        flushes,
        flush_mean_ms: metric(&text, "handoff_store_flush_seconds_sum")? * 1000.0
            / flushes.max(1.0),
        writers_per_flush: metric(&text, "handoff_store_flush_writers_sum")? / flushes.max(1.0),
        events_accepted: metric(&text, "handoff_webhook_events_total").unwrap_or(0.0),
        events_applied: metric(&text, "handoff_events_applied_total").unwrap_or(0.0),
        inbox_depth: metric(&text, "handoff_inbox_depth").unwrap_or(0.0),
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
    metrics: Option<DaemonMetrics>,
    shutdown: Duration,
    restart: Duration,
    first_start: Duration,
    rss_after_restart_kb: Option<u64>,
    ready_after_restart: bool,
}

fn run(opts: &Options) -> Result<(), String> {
    std::fs::create_dir_all(&opts.data_root)
        .map_err(|e| format!("{}: {e}", opts.data_root.display()))?;
    if !opts.bin.is_file() {
        return Err(format!("daemon binary {} not found: build it with `cargo build --release --bin handoff-bridge` or pass --bin", opts.bin.display()));
    }
    let corpus = Rc::new(load_corpus(&fixtures_dir())?);
    let machine = machine_info(&opts.data_root);
    eprintln!(
        "intake bench: daemon {}, {} fixtures, data under {}",
        opts.bin.display(),
        corpus.fixtures.len(),
        opts.data_root.display()
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
    println!("{report}");
    if let Some(dir) = opts.out.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(&opts.out, &report).map_err(|e| format!("{}: {e}", opts.out.display()))?;
    eprintln!("report written to {}", opts.out.display());
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
        .tempdir_in(&opts.data_root)
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
        Case::Daemon => daemon_metrics(&agent(), &proc.base()),
        Case::Baseline => None,
    };
    proc.stop()?;
    Ok(RunResult {
        round,
        case,
        stats,
        daemon,
    })
}

fn memory_case(opts: &Options, plan: Plan) -> Result<MemoryResult, String> {
    let dir = tempfile::Builder::new()
        .prefix("intake-bench-mem-")
        .tempdir_in(&opts.data_root)
        .map_err(|e| e.to_string())?;
    let data = dir.path().join("data");
    let mut daemon = Proc::spawn(
        "daemon",
        daemon_command(opts, &data),
        &dir.path().join("daemon-1.log"),
    )?;
    let first_start = daemon.started_in;
    let rss_start_kb = proc_status_kb(daemon.pid, "VmRSS");
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
    let agent = agent();
    let drain_url = format!("{}/admin/v1/inbox/drained?timeout_ms=60000", daemon.base());
    let mut drained_after = None;
    while posted_at.elapsed() < DRAIN_LIMIT {
        let (status, body) = http_get(&agent, &drain_url, Some(ADMIN_TOKEN))?;
        match status {
            200 => {
                drained_after = Some(posted_at.elapsed());
                break;
            }
            504 => eprintln!(
                "[memory] still draining after {:.0} s: {body}",
                posted_at.elapsed().as_secs_f64()
            ),
            other => return Err(format!("drain wait answered {other}: {body}")),
        }
    }
    let rss_kb = proc_status_kb(daemon.pid, "VmRSS");
    let hwm_kb = proc_status_kb(daemon.pid, "VmHWM");
    let rss_anon_kb = proc_status_kb(daemon.pid, "RssAnon");
    let metrics = daemon_metrics(&agent, &daemon.base());
    let disk = dir_size(&data);
    eprintln!(
        "[memory] drained after {:?}; VmRSS {} kB (peak {} kB); data dir {} bytes",
        drained_after,
        rss_kb.unwrap_or(0),
        hwm_kb.unwrap_or(0),
        disk.0
    );
    let (shutdown, status) = daemon.stop()?;
    if !status.success() {
        return Err(format!(
            "daemon exited with {status} on SIGTERM; log:\n{}",
            tail(&daemon.log, 20)
        ));
    }
    let mut again = Proc::spawn(
        "daemon (restart)",
        daemon_command(opts, &data),
        &dir.path().join("daemon-2.log"),
    )?;
    let restart = again.started_in;
    let rss_after_restart_kb = proc_status_kb(again.pid, "VmRSS");
    let ready_after_restart = matches!(
        http_get(&agent, &format!("{}/readyz", again.base()), None),
        Ok((200, _))
    );
    eprintln!("[memory] shutdown took {shutdown:?}; restart to `listening:` took {restart:?}");
    again.stop()?;
    Ok(MemoryResult {
        posted_events,
        stats,
        drained_after,
        rss_start_kb,
        rss_kb,
        hwm_kb,
        rss_anon_kb,
        disk,
        metrics,
        shutdown,
        restart,
        first_start,
        rss_after_restart_kb,
        ready_after_restart,
    })
}

// ---------------------------------------------------------------------------------------------
// Machine description

fn machine_info(data_root: &Path) -> Vec<(String, String)> {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .and_then(|r| r.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    let mhz = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("cpu MHz")
                .and_then(|r| r.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_default();
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let meminfo = read("/proc/meminfo");
    let mem_kb = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    let root = std::fs::canonicalize(data_root).unwrap_or_else(|_| data_root.to_path_buf());
    let mounts = read("/proc/mounts");
    let mount = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 4 && root.starts_with(f[1])).then(|| {
                (
                    f[0].to_owned(),
                    f[1].to_owned(),
                    f[2].to_owned(),
                    f[3].to_owned(),
                )
            })
        })
        .max_by_key(|m| m.1.len());
    let disk = match mount {
        Some((dev, at, fs, flags)) => {
            let name = dev.trim_start_matches("/dev/").to_owned();
            let rota = std::fs::read_to_string(format!("/sys/block/{name}/queue/rotational"))
                .map(|r| r.trim().to_owned())
                .unwrap_or_else(|_| "?".into());
            let kind = match rota.as_str() {
                "0" => "non-rotational",
                "1" => "reported rotational (virtual disk)",
                _ => "unknown kind",
            };
            format!("{dev} ({kind}) mounted at {at}, {fs} ({flags})")
        }
        None => "unknown".into(),
    };
    let probe = fsync_probe(data_root)
        .map(|(p50, p99)| {
            format!("4 KiB write + fdatasync: p50 {p50:.2} ms, p99 {p99:.2} ms (200 samples)")
        })
        .unwrap_or_else(|e| format!("failed: {e}"));
    vec![
        ("nproc".into(), nproc.to_string()),
        (
            "CPU".into(),
            if mhz.is_empty() {
                model
            } else {
                format!("{model} @ {mhz} MHz")
            },
        ),
        (
            "memory".into(),
            format!("{:.1} GiB", mem_kb as f64 / 1024.0 / 1024.0),
        ),
        ("disk (data dir)".into(), disk),
        ("disk sync latency".into(), probe),
        (
            "kernel".into(),
            read("/proc/sys/kernel/osrelease").trim().to_owned(),
        ),
    ]
}

/// The cost of one durable write on the data directory's disk, the floor of a group commit.
fn fsync_probe(dir: &Path) -> Result<(f64, f64), String> {
    let path = dir.join(format!("fsync-probe-{}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| e.to_string())?;
    let block = [0x5au8; 4096];
    let mut samples = Vec::with_capacity(200);
    for i in 0..200u64 {
        let t0 = Instant::now();
        file.write_all_at(&block, i * 4096)
            .map_err(|e| e.to_string())?;
        file.sync_data().map_err(|e| e.to_string())?;
        samples.push(t0.elapsed().as_secs_f64() * 1000.0);
    }
    drop(file);
    let _ = std::fs::remove_file(&path);
    samples.sort_by(f64::total_cmp);
    Ok((samples[100], samples[198]))
}

// ---------------------------------------------------------------------------------------------
// Report

/// The commit the daemon was built from, as far as git knows (and whether src/ had changes).
fn git_head() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let head = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    match git(&[
        "status",
        "--porcelain",
        "--",
        "src",
        "Cargo.toml",
        "Cargo.lock",
    ]) {
        Some(s) if !s.is_empty() => format!("{head} + uncommitted changes"),
        _ => head,
    }
}

fn summary(values: &[f64]) -> (f64, f64, f64) {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let median = if v.len() % 2 == 1 {
        v[v.len() / 2]
    } else {
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    };
    (v[0], median, v[v.len() - 1])
}

fn mmm(values: &[f64], decimals: usize) -> String {
    let (a, b, c) = summary(values);
    format!("{a:.decimals$} / {b:.decimals$} / {c:.decimals$}")
}

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
    let _ = writeln!(
        r,
        "## Intake benchmark{}\n",
        if opts.quick {
            " (quick smoke run: not a measurement)"
        } else {
            ""
        }
    );
    let _ = writeln!(r, "| machine | |\n|---|---|");
    for (k, v) in machine {
        let _ = writeln!(r, "| {k} | {v} |");
    }
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
        opts.bin.display(),
        git_head(),
        if opts.daemon_env.is_empty() {
            String::new()
        } else {
            format!(
                ", extra environment {}",
                opts.daemon_env
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
            s.hist.max() as f64 / 1000.0,
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
            mmm(&pick(case, &rate), 0),
            mmm(&pick(case, &ev_rate), 0),
            mmm(&pick(case, &p50), 2),
            mmm(&pick(case, &p99), 2),
            mmm(&pick(case, &p999), 2)
        );
    }
    let _ = writeln!(
        r,
        "| daemon / baseline (paired by round) | {} | | | | |",
        mmm(&ratios, 3)
    );

    let mut targets: Vec<(String, String, bool)> = Vec::new();
    let (ratio_min, ratio_med, _) = summary(&ratios);
    targets.push((
        "durable intake >= 30% of the bare baseline's throughput".into(),
        format!(
            "median ratio {:.1}% (min {:.1}%)",
            ratio_med * 100.0,
            ratio_min * 100.0
        ),
        ratio_med >= 0.30,
    ));
    let (_, p99_med, p99_max) = summary(&pick(Case::Daemon, &p99));
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
                "{:.1} MB ({}) after {} events",
                rss_mb,
                mib(m.rss_kb),
                s.events
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
            handoff_bridge::webhook::parse_delivery(&body).ok()
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
