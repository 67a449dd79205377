//! Scale benchmark (issue 21): a large store built through the webhook, then the reads agents
//! and operators make on it, a pruning pass, a restart and intake on it against an empty store.
//!
//! ```text
//! cargo bench --bench scale                 # 1,000,000 conversations over 100,000 end users
//! cargo bench --bench scale -- --quick      # 20,000 / 2,000 / 200 waiting: a smoke run
//! cargo bench --bench scale -- --help       # every option
//! ```
//!
//! All on 127.0.0.1, every process started here stopped by its PID (and killed with the bench):
//!
//! 1. **build**: the release daemon on a fresh data directory (rules off: see [`daemon_command`])
//!    takes deliveries of many events over several keep-alive connections: per end user a
//!    `bot.end_user.created`, per conversation a `bot.conversation.created` and a user message
//!    (`bot.message.received`), and for the last `--waiting` conversations a
//!    `bot.conversation.agent_call_requested`, which leaves them waiting (`phase=requested`).
//!    Then the bench waits for the folds to drain (`/admin/v1/inbox/drained`).
//! 2. **queue**: `GET /helpdesk/v1/conversations?phase=requested&bot=B&limit=N` first pages, one
//!    after the other, bots in turn; then a cursor walk (`after`, `next`) of every waiting
//!    conversation, which must find exactly `--waiting` of them.
//! 3. **admin lists**: `GET /admin/v1/conversations` and `/admin/v1/endusers` first pages, then a
//!    cursor walk into deep pages.
//! 4. **console**: signs in to the operator console as a browser does (the sign-in form and its
//!    cookie, then the form posted with the admin token: the session cookie), then times GETs of
//!    its overview, its queue (all bots, then one bot), and a waiting conversation's page (its
//!    summary, its audit timeline re-evaluated from the event log and its newest messages read
//!    from the embedded emulator's Open API); target p99 < 100 ms each.
//! 5. **intake ratio**: the same short closed-loop load (user messages to random conversation ids
//!    of the large store's id space) on a fresh empty daemon and on the large one, alternating,
//!    twice: accepted events/s on the large store over the empty one (target >= 0.8).
//! 6. **prune**: `POST /admin/v1/prune` (one pruning pass), its time and the daemon's RSS.
//! 7. **restart**: SIGTERM, time to exit, start again, time to `accepting webhooks:` (the webhook
//!    answered while sled opens), to `listening:` and to `/readyz` 200;
//!    then stop and start once more, time to `listening:` (sled replays the log written since
//!    the previous start: the first start after the build reads all of it).
//!
//! A step whose endpoint the daemon does not have (404) or that answers otherwise than a paged
//! list is reported as `n/a`, so the bench runs on builds with and without those endpoints.
//! The markdown report is printed on stdout and written to `--out` (default
//! `target/tmp/scale-bench.md`); `--json FILE` writes the figures. Progress goes to stderr.

#[allow(dead_code)]
mod common;

use common::pg::{PgDatabase, PgTarget};
use common::{
    BenchOptions, BodyRead, CommonOptions, Conn, ConnectError, Http, OptionSpec, Proc, Setting,
    Target, ADMIN_TOKEN, HTTP_TIMEOUT,
};
use hdrhistogram::Histogram;
use serde_json::{json, Value};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The agent API's token of the daemons started here.
const HELPDESK_TOKEN: &str = "bench-helpdesk-token-0123456789";
/// How often a stopping daemon is checked for its exit: fine, the shutdown time is measured.
const STOP_POLL: Duration = Duration::from_millis(2);
/// Pages of a list are read whole (a page of 1,000 queue items is a few hundred KiB).
const BODY: BodyRead = BodyRead {
    limit: 64 * 1024 * 1024,
    lossy_utf8: true,
    required: true,
};
/// Attempts of one build delivery (a retry re-sends the same ids: a duplicate if it was stored).
const DELIVERY_ATTEMPTS: u32 = 5;
/// The longest wait for a restarted daemon's `/readyz` 200.
const READY_LIMIT: Duration = Duration::from_secs(300);

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    OPTIONS.main::<Options>(&args, run);
}

// ---------------------------------------------------------------------------------------------
// Options

#[derive(Clone, Debug)]
struct Options {
    quick: bool,
    conversations: u64,
    end_users: u64,
    waiting: u64,
    bots: u64,
    /// Conversations per build delivery (2 events each, plus the end users' and the calls').
    batch: u64,
    connections: usize,
    /// Queue first pages requested.
    queries: usize,
    /// Page size of the queue and admin lists.
    page: usize,
    /// Admin first pages requested per list.
    admin_queries: usize,
    /// The most pages of an admin cursor walk.
    walk_pages: usize,
    /// GETs of each console page timed.
    console_queries: usize,
    /// Each reading step stops after this long (what it did is reported).
    step_limit: Duration,
    /// The build stops posting after this long.
    build_limit: Duration,
    /// The longest wait for the folds after the build.
    drain_limit: Duration,
    ratio_warmup: Duration,
    ratio_duration: Duration,
    /// Events per delivery in the intake ratio load.
    ratio_batch: u64,
    /// Webhook dedupe and event retention of 60 s (the shortest allowed), so the pruning pass
    /// has old data to remove; off: the shipped retention (nothing is old enough).
    short_retention: bool,
    /// The PostgreSQL server the daemons run on, a fresh database per store (else sled).
    pg: PgTarget,
    common: CommonOptions,
}

const USAGE: &str = "\
usage: cargo bench --bench scale -- [options]
  --quick                 smoke run: 20,000 conversations, 2,000 end users, 200 waiting, 10 s per reading step,
                          50 GETs per console page
  --conversations N       conversations built through the webhook (default 1000000)
  --end-users N           end users they belong to (default 100000)
  --waiting N             conversations left waiting for an agent (default 10000)
  --bots N                bots the end users are spread over (default 10)
  --batch N               conversations per build delivery, ~2 events each (default 50)
  --connections N         keep-alive connections of the build and intake loads (default 64)
  --queries N             queue first pages requested (default 2000)
  --page N                page size of the queue and admin lists (default 100)
  --admin-queries N       first pages requested per admin list (default 500)
  --walk-pages N          the most pages of an admin cursor walk (default 2000)
  --console-queries N     GETs of each console page timed (default 200)
  --step-limit SECS       each reading step stops after this long (default 300)
  --build-limit SECS      stop posting the build after this long (default 3600)
  --drain-limit SECS      longest wait for the folds after the build (default 3600)
  --ratio-duration SECS   measured time of each intake-ratio run (default 5)
  --ratio-warmup SECS     unmeasured time before it (default 1)
  --ratio-batch N         events per delivery of the intake-ratio load (default 10)
  --default-retention     keep the shipped retention (default: 60 s, so the pruning pass has work)
  --pg-url URL            run the daemons on PostgreSQL: a fresh database for the large store and
                          each empty one, made (and dropped) from this postgres:// URL's database
                          with psql (default: sled)
  --pg-data DIR           that server's data directory (accepted for symmetry with the actions bench)
  --data-root DIR         where data directories go (default target/tmp; must be a real disk)
  --out FILE              also write the markdown report here (default target/tmp/scale-bench.md)
  --json FILE             also write the results as JSON here (read by benches/run)
  --bin PATH              daemon binary (default: the one cargo built for this bench)
  --daemon-env K=V[,K=V]  extra environment for the daemon
Every option can also be given as SCALE_BENCH_<NAME> (e.g. SCALE_BENCH_CONVERSATIONS=100000);
flags win over variables.";

const OPTIONS: OptionSpec = OptionSpec {
    name: "scale",
    env_prefix: "SCALE_BENCH",
    usage: USAGE,
    keys: KEYS,
    off_flag: ("--default-retention", "short-retention"),
};

const KEYS: &[&str] = &[
    "conversations",
    "end-users",
    "waiting",
    "bots",
    "batch",
    "connections",
    "queries",
    "page",
    "admin-queries",
    "walk-pages",
    "console-queries",
    "step-limit",
    "build-limit",
    "drain-limit",
    "ratio-duration",
    "ratio-warmup",
    "ratio-batch",
    "short-retention",
    common::pg::KEYS[0],
    common::pg::KEYS[1],
];

impl BenchOptions for Options {
    fn full() -> Self {
        Options {
            quick: false,
            conversations: 1_000_000,
            end_users: 100_000,
            waiting: 10_000,
            bots: 10,
            batch: 50,
            connections: 64,
            queries: 2_000,
            page: 100,
            admin_queries: 500,
            walk_pages: 2_000,
            console_queries: 200,
            step_limit: Duration::from_secs(300),
            build_limit: Duration::from_secs(3600),
            drain_limit: Duration::from_secs(3600),
            ratio_warmup: Duration::from_secs(1),
            ratio_duration: Duration::from_secs(5),
            ratio_batch: 10,
            short_retention: true,
            pg: PgTarget::default(),
            common: CommonOptions::new("scale-bench.md"),
        }
    }

    fn quick() -> Self {
        Options {
            quick: true,
            conversations: 20_000,
            end_users: 2_000,
            waiting: 200,
            connections: 16,
            queries: 200,
            admin_queries: 50,
            walk_pages: 100,
            console_queries: 50,
            step_limit: Duration::from_secs(10),
            build_limit: Duration::from_secs(60),
            drain_limit: Duration::from_secs(60),
            ratio_warmup: Duration::from_millis(250),
            ratio_duration: Duration::from_secs(1),
            ..Options::full()
        }
    }

    fn common(&mut self) -> &mut CommonOptions {
        &mut self.common
    }

    fn set(&mut self, s: &Setting) -> Result<bool, String> {
        if self.pg.set(&s.key, &s.value)? {
            return Ok(true);
        }
        match s.key.as_str() {
            "conversations" => self.conversations = s.num()?,
            "end-users" => self.end_users = s.num()?,
            "waiting" => self.waiting = s.num()?,
            "bots" => self.bots = s.num()?,
            "batch" => self.batch = s.num()?,
            "connections" => self.connections = s.size()?,
            "queries" => self.queries = s.size()?,
            "page" => self.page = s.size()?,
            "admin-queries" => self.admin_queries = s.size()?,
            "walk-pages" => self.walk_pages = s.size()?,
            "console-queries" => self.console_queries = s.size()?,
            "step-limit" => self.step_limit = s.secs()?,
            "build-limit" => self.build_limit = s.secs()?,
            "drain-limit" => self.drain_limit = s.secs()?,
            "ratio-duration" => self.ratio_duration = s.secs()?,
            "ratio-warmup" => self.ratio_warmup = s.secs()?,
            "ratio-batch" => self.ratio_batch = s.num()?,
            "short-retention" => self.short_retention = s.truthy(),
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn check(&self) -> Result<(), String> {
        if self.conversations == 0
            || self.end_users == 0
            || self.bots == 0
            || self.batch == 0
            || self.connections == 0
            || self.page == 0
            || self.ratio_batch == 0
        {
            return Err(
                "conversations, end-users, bots, batch, connections, page and ratio-batch must be at least 1"
                    .into(),
            );
        }
        if self.end_users > self.conversations || self.waiting > self.conversations {
            return Err("end-users and waiting must be at most conversations".into());
        }
        if self.page > 1_000 {
            return Err("page must be at most 1000 (the lists' largest limit)".into());
        }
        // Events per delivery within the webhook's max_events (10,000) and body size.
        if self.batch > 1_000 || self.ratio_batch > 1_000 {
            return Err("batch and ratio-batch must be at most 1000".into());
        }
        self.pg.check()
    }
}

// ---------------------------------------------------------------------------------------------
// The store's shape and its events

/// Who is who: conversation `c` belongs to end user `c % end_users`, end user `u` to bot
/// `u % bots`; the last `waiting` conversations asked for an agent.
#[derive(Clone, Copy)]
struct Shape {
    conversations: u64,
    end_users: u64,
    waiting: u64,
    bots: u64,
}

impl Shape {
    fn of(opts: &Options) -> Self {
        Shape {
            conversations: opts.conversations,
            end_users: opts.end_users,
            waiting: opts.waiting,
            bots: opts.bots,
        }
    }

    fn user_of(&self, c: u64) -> u64 {
        c % self.end_users
    }

    fn bot_of_user(&self, u: u64) -> u64 {
        u % self.bots
    }

    fn waits(&self, c: u64) -> bool {
        c >= self.conversations - self.waiting
    }

    /// Waiting conversations per bot.
    fn waiting_per_bot(&self) -> Vec<u64> {
        let mut per = vec![0; usize::try_from(self.bots).unwrap_or(0)];
        for c in self.conversations - self.waiting..self.conversations {
            let b = self.bot_of_user(self.user_of(c));
            if let Some(n) = usize::try_from(b).ok().and_then(|b| per.get_mut(b)) {
                *n += 1;
            }
        }
        per
    }
}

fn bot_id(b: u64) -> String {
    format!("B{:06x}", 0xb0_0000 + b)
}

fn write_conversation_id(out: &mut String, c: u64) {
    let _ = write!(out, "5c0e9b1f-2222-4d3e-9f10-{c:012x}");
}

fn write_user_id(out: &mut String, u: u64) {
    let _ = write!(out, "4e6f0d0a-1111-4a5b-8c9d-{u:012x}");
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Writes deliveries: the envelope of the shared fixtures, events with ids unique per run.
struct Writer {
    envelope_tail: String,
    run: u16,
    shape: Shape,
}

const ISO: &str = "2026-11-01T00:00:00.000Z";

impl Writer {
    fn new(run: u16, shape: Shape) -> Result<Self, String> {
        let fixture =
            common::read_fixture(&common::fixtures_dir().join("message-received-text.json"))?;
        Ok(Writer {
            envelope_tail: common::envelope_tail(&fixture),
            run,
            shape,
        })
    }

    fn event_head(&self, out: &mut String, e: u64, kind: &str, bot: &str, ts: i64) {
        out.push_str("{\"id\":\"");
        common::write_event_id(out, self.run, e);
        let _ = write!(
            out,
            "\",\"event\":\"{kind}\",\"sourceType\":\"bot\",\"sourceId\":\"{bot}\",\"timestamp\":{ts},\"data\":"
        );
    }

    fn end_user_created(&self, out: &mut String, e: u64, u: u64, ts: i64) {
        let bot = bot_id(self.shape.bot_of_user(u));
        self.event_head(out, e, "bot.end_user.created", &bot, ts);
        out.push_str("{\"endUser\":{\"id\":\"");
        write_user_id(out, u);
        let _ = write!(
            out,
            "\",\"botId\":\"{bot}\",\"platform\":\"web\",\"userKey\":\"visitor-{u}\",\"params\":{{}},\"createdAt\":\"{ISO}\",\"updatedAt\":\"{ISO}\"}}}}}}"
        );
    }

    /// `bot.conversation.created` or `...agent_call_requested` (at an agent-call node).
    fn conversation(&self, out: &mut String, e: u64, c: u64, kind: &str, ts: i64) {
        let u = self.shape.user_of(c);
        let bot = bot_id(self.shape.bot_of_user(u));
        self.event_head(out, e, kind, &bot, ts);
        out.push_str("{\"conversation\":{\"id\":\"");
        write_conversation_id(out, c);
        let _ = write!(out, "\",\"botId\":\"{bot}\",\"endUserId\":\"");
        write_user_id(out, u);
        let navigation = if kind.ends_with("agent_call_requested") {
            "{\"current\":{\"flowId\":5,\"nodeId\":40,\"visitCount\":1}}"
        } else {
            "{}"
        };
        let _ = write!(
            out,
            "\",\"platform\":\"web\",\"userKey\":\"visitor-{u}\",\"params\":{{}},\"navigation\":{navigation},\"createdAt\":\"{ISO}\",\"updatedAt\":\"{ISO}\"}}}}}}"
        );
    }

    fn user_message(&self, out: &mut String, e: u64, c: u64, ts: i64) {
        let u = self.shape.user_of(c);
        let bot = bot_id(self.shape.bot_of_user(u));
        self.event_head(out, e, "bot.message.received", &bot, ts);
        out.push_str("{\"message\":{\"id\":\"");
        common::write_message_id(out, self.run, e);
        out.push_str("\",\"endUserId\":\"");
        write_user_id(out, u);
        out.push_str("\",\"conversationId\":\"");
        write_conversation_id(out, c);
        let _ = write!(
            out,
            "\",\"data\":{{\"type\":\"text\",\"text\":\"Where is my order? message {e}\"}},\"meta\":null,\"isUser\":true,\"timestamp\":{ts}}}}}}}"
        );
    }

    /// Build delivery `n`: conversations `n * batch ..`, each with its events (its end user's
    /// creation first when it is the user's first conversation). Returns the event count.
    fn build_delivery(&self, out: &mut String, n: u64, batch: u64) -> u64 {
        common::start_delivery(out, self.run, n, &self.envelope_tail);
        let ts = unix_ms();
        let first = n * batch;
        let last = (first + batch).min(self.shape.conversations);
        // Event ids: 4 slots per conversation, unique within the run.
        let mut events = 0;
        for c in first..last {
            let mut e = c * 4;
            let mut next = |out: &mut String| {
                if events > 0 {
                    out.push(',');
                }
                events += 1;
                e += 1;
                e
            };
            if c < self.shape.end_users {
                let id = next(out);
                self.end_user_created(out, id, c, ts);
            }
            let id = next(out);
            self.conversation(out, id, c, "bot.conversation.created", ts);
            let id = next(out);
            self.user_message(out, id, c, ts);
            if self.shape.waits(c) {
                let id = next(out);
                self.conversation(out, id, c, "bot.conversation.agent_call_requested", ts);
            }
        }
        out.push_str("]}");
        events
    }

    /// Intake-ratio delivery `n`: `batch` user messages to conversations picked at random (a
    /// fixed sequence) from the large store's ids.
    fn message_delivery(&self, out: &mut String, n: u64, batch: u64) -> u64 {
        common::start_delivery(out, self.run, n, &self.envelope_tail);
        let ts = unix_ms();
        for j in 0..batch {
            if j > 0 {
                out.push(',');
            }
            let e = n * batch + j;
            let c = splitmix64(e ^ (u64::from(self.run) << 48)) % self.shape.conversations;
            self.user_message(out, e, c, ts);
        }
        out.push_str("]}");
        batch
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

// ---------------------------------------------------------------------------------------------
// Load: closed loop over keep-alive connections

#[derive(Clone, Copy)]
enum Load {
    /// The build: every delivery `0..total` once (retried on failure), posting stops at `limit`.
    Build {
        total: u64,
        batch: u64,
        limit: Duration,
    },
    /// The intake ratio: `warmup` unmeasured, then `measure`.
    Timed {
        warmup: Duration,
        measure: Duration,
        batch: u64,
    },
}

struct LoadStats {
    /// Deliveries answered 200 with an `accepted` (or, for a retry, `duplicate`) receipt.
    deliveries: u64,
    /// Events in those deliveries.
    events: u64,
    /// Build deliveries given up after DELIVERY_ATTEMPTS.
    lost: u64,
    errors: BTreeMap<String, u64>,
    /// Acknowledgment latency, microseconds.
    hist: Histogram<u64>,
    window: Duration,
}

impl LoadStats {
    fn per_sec(&self, n: u64) -> f64 {
        n as f64 / self.window.as_secs_f64().max(1e-9)
    }
}

struct LoadState {
    next: Cell<u64>,
    load: Load,
    writer: Writer,
    window_start: Instant,
    end: Instant,
    first_start: Cell<Option<Instant>>,
    last_done: Cell<Option<Instant>>,
    stats: RefCell<LoadStats>,
}

fn run_load(
    addr: SocketAddr,
    writer: Writer,
    connections: usize,
    load: Load,
) -> Result<LoadStats, String> {
    let t0 = Instant::now();
    let (window_start, end) = match load {
        Load::Build { limit, .. } => (t0, t0 + limit),
        Load::Timed {
            warmup, measure, ..
        } => (t0 + warmup, t0 + warmup + measure),
    };
    let state = LoadState {
        next: Cell::new(0),
        load,
        writer,
        window_start,
        end,
        first_start: Cell::new(None),
        last_done: Cell::new(None),
        stats: RefCell::new(LoadStats {
            deliveries: 0,
            events: 0,
            lost: 0,
            errors: BTreeMap::new(),
            hist: common::histogram(120_000_000)?,
            window: Duration::ZERO,
        }),
    };
    let target = Rc::new(Target::new(addr));
    let state = common::run_local(state, |state| async move {
        common::run_workers(connections, || worker(state.clone(), target.clone())).await;
        let mut stats = state.stats.borrow_mut();
        stats.window = match load {
            Load::Timed { measure, .. } => measure,
            Load::Build { .. } => match (state.first_start.get(), state.last_done.get()) {
                (Some(a), Some(b)) => b.saturating_duration_since(a),
                _ => Duration::ZERO,
            },
        };
    })?;
    Ok(state.stats.into_inner())
}

async fn worker(state: Rc<LoadState>, target: Rc<Target>) {
    let mut conn: Option<Conn> = None;
    let mut body = String::with_capacity(256 * 1024);
    let mut request: Vec<u8> = Vec::with_capacity(256 * 1024);
    loop {
        if Instant::now() >= state.end {
            break;
        }
        let n = state.next.get();
        let events = match state.load {
            Load::Build { total, batch, .. } => {
                if n >= total {
                    break;
                }
                state.writer.build_delivery(&mut body, n, batch)
            }
            Load::Timed { batch, .. } => state.writer.message_delivery(&mut body, n, batch),
        };
        state.next.set(n + 1);
        target.request(&body, &mut request);
        let attempts = match state.load {
            Load::Build { .. } => DELIVERY_ATTEMPTS,
            Load::Timed { .. } => 1,
        };
        let mut stored = false;
        for attempt in 0..attempts {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(100 << attempt.min(5))).await;
            }
            if conn.is_none() {
                match target.connect().await {
                    Ok(c) => conn = Some(c),
                    Err(e) => {
                        state.error(e.to_string());
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
            if !matches!(&outcome, Ok(r) if !r.close) {
                conn = None;
            }
            if state.first_start.get().is_none() {
                state.first_start.set(Some(started));
            }
            state.last_done.set(Some(done));
            match outcome {
                Ok(r)
                    if r.status == 200
                        && (r.receipt_status == "accepted"
                            || (attempt > 0 && r.receipt_status == "duplicate")) =>
                {
                    stored = true;
                    let measured = done >= state.window_start
                        && (matches!(state.load, Load::Build { .. }) || done <= state.end);
                    if measured {
                        let mut stats = state.stats.borrow_mut();
                        stats.deliveries += 1;
                        stats.events += events;
                        stats
                            .hist
                            .saturating_record(common::micros(done.duration_since(started)).max(1));
                    }
                    break;
                }
                Ok(r) => state.error(format!("HTTP {} `{}`", r.status, r.receipt_status)),
                Err(e) => state.error(e),
            }
        }
        if !stored && matches!(state.load, Load::Build { .. }) {
            state.stats.borrow_mut().lost += 1;
        }
    }
}

impl LoadState {
    fn error(&self, what: String) {
        *self.stats.borrow_mut().errors.entry(what).or_default() += 1;
    }
}

// ---------------------------------------------------------------------------------------------
// The daemon

/// The release daemon with the shipped rules turned off: the queue is the fold's doing (an
/// `agent_call_requested` event makes a conversation wait, with or without rules), and the
/// shipped rules would only add two upstream calls per call (the actions bench measures those)
/// and need an upstream. The agent API's token; with `short_retention`, 60 s dedupe and event
/// retention (the shortest allowed) so the pruning pass removes what the build wrote; the
/// periodic pruning is pushed out of the run so only the measured pass prunes.
fn daemon_command(opts: &Options, data_dir: &Path, db: Option<&PgDatabase>) -> Command {
    let mut cmd = common::daemon_command(&opts.common.bin, data_dir);
    if let Some(db) = db {
        cmd.env("HANDOFF_BRIDGE_STORE_URL", &db.url);
    }
    cmd.env("HANDOFF_BRIDGE__RULES__ENABLED", "false")
        .env("HANDOFF_BRIDGE_HELPDESK_TOKENS", HELPDESK_TOKEN)
        .env("HANDOFF_BRIDGE__STORE__PRUNE_INTERVAL", "24h");
    if opts.short_retention {
        cmd.env("HANDOFF_BRIDGE__WEBHOOK__DEDUPE_RETENTION", "60s")
            .env("HANDOFF_BRIDGE__STORE__EVENT_RETENTION", "60s");
    }
    cmd.envs(opts.common.daemon_env.iter().map(|(k, v)| (k, v)));
    cmd
}

fn http() -> Http {
    Http::new(HTTP_TIMEOUT, BODY)
}

/// Wait for the daemon's folds to catch up with everything accepted: the time it took.
fn wait_drained(
    http: &Http,
    daemon: &Proc,
    limit: Duration,
    what: &str,
) -> Result<Duration, String> {
    common::wait_drained(http, &daemon.admin_base(), Instant::now(), limit, what)?
        .ok_or_else(|| format!("[{what}] not drained within {limit:?}"))
}

fn rss_mib(pid: u32, field: &str) -> Option<f64> {
    common::proc_status_kb(pid, field).map(|kb| kb as f64 / 1024.0)
}

// ---------------------------------------------------------------------------------------------
// Reading lists

/// Latencies of a series of requests and what came of them.
struct Series {
    hist: Histogram<u64>,
    requests: u64,
    /// Answers that were not what the step expected (wrong size, not 200, unreadable).
    wrong: u64,
    /// Set when the endpoint is missing or is not a paged list: the step is `n/a`.
    absent: Option<String>,
    /// Stopped at the step limit.
    cut: bool,
    elapsed: Duration,
    notes: Vec<String>,
}

impl Series {
    fn new() -> Result<Self, String> {
        Ok(Series {
            hist: common::histogram(600_000_000)?,
            requests: 0,
            wrong: 0,
            absent: None,
            cut: false,
            elapsed: Duration::ZERO,
            notes: Vec::new(),
        })
    }

    fn record(&mut self, took: Duration) {
        self.requests += 1;
        self.hist.saturating_record(common::micros(took).max(1));
    }

    fn json(&self) -> Value {
        if let Some(why) = &self.absent {
            return json!({ "na": why });
        }
        json!({
            "requests": self.requests,
            "p50_ms": common::quantile_ms(&self.hist, 0.5),
            "p99_ms": common::quantile_ms(&self.hist, 0.99),
            "max_ms": common::max_ms(&self.hist),
            "wrong": self.wrong,
            "cut_at_step_limit": self.cut,
            "seconds": self.elapsed.as_secs_f64(),
            "notes": self.notes,
        })
    }

    /// `p50 / p99 / max ms (N requests)` or `n/a (why)`.
    fn cell(&self) -> String {
        if let Some(why) = &self.absent {
            return format!("n/a ({why})");
        }
        if self.requests == 0 {
            return "n/a (no request)".into();
        }
        format!(
            "{:.2} / {:.2} / {:.2} ms ({} requests{}{})",
            common::quantile_ms(&self.hist, 0.5),
            common::quantile_ms(&self.hist, 0.99),
            common::max_ms(&self.hist),
            self.requests,
            if self.wrong > 0 {
                format!(", **{} wrong**", self.wrong)
            } else {
                String::new()
            },
            if self.cut {
                ", stopped at the step limit"
            } else {
                ""
            }
        )
    }
}

/// One GET, timed; `Err` only when the request itself failed.
fn timed_get(http: &Http, url: &str, token: &str) -> Result<(u16, String, Duration), String> {
    let t0 = Instant::now();
    let (status, body) = http.get(url, Some(token))?;
    Ok((status, body, t0.elapsed()))
}

/// Why a list answer is not a page: `n/a` text for a missing endpoint or another status.
fn absent_reason(status: u16, body: &str) -> String {
    let code = serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["code"].as_str().map(str::to_owned))
        .unwrap_or_default();
    match status {
        404 => "endpoint absent: 404".into(),
        other if code.is_empty() => format!("HTTP {other}"),
        other => format!("HTTP {other} `{code}`"),
    }
}

/// A page's items (the answer's `conversations`, else its first array) and its cursor: `None`
/// when the answer has no `next` (no cursor), `Some(None)` at the end of the list.
#[allow(clippy::type_complexity)]
fn page_of(body: &str) -> Option<(Vec<Value>, Option<Option<String>>)> {
    let v: Value = serde_json::from_str(body).ok()?;
    let obj = v.as_object()?;
    let items = ["conversations", "endusers", "end_users", "items"]
        .iter()
        .find_map(|k| obj.get(*k).and_then(Value::as_array))
        .or_else(|| obj.values().find_map(Value::as_array))?
        .clone();
    let next = ["next", "next_after"]
        .iter()
        .find_map(|k| obj.get(*k))
        .map(|n| match n {
            Value::String(s) => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            _ => None,
        });
    Some((items, next))
}

fn encode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// The result of a cursor walk.
struct Walk {
    pages: Series,
    /// Items seen, distinct ids.
    items: u64,
    distinct: u64,
    /// The walk reached the list's end.
    complete: bool,
    /// The first answer has no `next`: the list has no cursor.
    no_cursor: bool,
}

impl Walk {
    fn json(&self) -> Value {
        let mut v = self.pages.json();
        if let Some(o) = v.as_object_mut() {
            if !o.contains_key("na") {
                o.insert("items".into(), json!(self.items));
                o.insert("distinct".into(), json!(self.distinct));
                o.insert("complete".into(), json!(self.complete));
                o.insert("no_cursor".into(), json!(self.no_cursor));
            }
        }
        v
    }
}

/// Walk `base` (a URL with its query, `limit` included) page by page through `after`, at most
/// `max_pages` pages and `limit` time.
fn walk(
    http: &Http,
    base: &str,
    token: &str,
    max_pages: usize,
    limit: Duration,
) -> Result<Walk, String> {
    let t0 = Instant::now();
    let mut w = Walk {
        pages: Series::new()?,
        items: 0,
        distinct: 0,
        complete: false,
        no_cursor: false,
    };
    let mut seen = HashSet::new();
    let mut after: Option<String> = None;
    while w.pages.requests < max_pages as u64 {
        if t0.elapsed() >= limit {
            w.pages.cut = true;
            break;
        }
        let url = match &after {
            Some(a) => format!("{base}&after={}", encode(a)),
            None => base.to_owned(),
        };
        let (status, body, took) = timed_get(http, &url, token)?;
        if status != 200 {
            if w.pages.requests == 0 {
                w.pages.absent = Some(absent_reason(status, &body));
            } else {
                w.pages.wrong += 1;
                w.pages.notes.push(format!(
                    "page {} answered {}",
                    w.pages.requests + 1,
                    absent_reason(status, &body)
                ));
            }
            break;
        }
        w.pages.record(took);
        let Some((items, next)) = page_of(&body) else {
            w.pages.wrong += 1;
            w.pages.notes.push("an answer is not a page".into());
            break;
        };
        w.items += items.len() as u64;
        for item in &items {
            if let Some(id) = item["id"].as_str() {
                seen.insert(id.to_owned());
            }
        }
        match next {
            // No `next` on the first page: no cursor; on a later one: the end (an API may leave
            // out a null).
            None if w.pages.requests == 1 => {
                w.no_cursor = true;
                break;
            }
            None | Some(None) => {
                w.complete = true;
                break;
            }
            Some(Some(n)) => after = Some(n),
        }
    }
    w.distinct = seen.len() as u64;
    w.pages.elapsed = t0.elapsed();
    Ok(w)
}

/// `count` first pages of `url_of(i)`, one after the other; `expect(i, items)` says whether an
/// answer is right.
fn first_pages(
    http: &Http,
    token: &str,
    count: usize,
    limit: Duration,
    url_of: impl Fn(usize) -> String,
    expect: impl Fn(usize, &[Value]) -> bool,
) -> Result<Series, String> {
    let t0 = Instant::now();
    let mut s = Series::new()?;
    for i in 0..count {
        if t0.elapsed() >= limit {
            s.cut = true;
            break;
        }
        let (status, body, took) = timed_get(http, &url_of(i), token)?;
        if status != 200 {
            if i == 0 {
                s.absent = Some(absent_reason(status, &body));
                break;
            }
            s.wrong += 1;
            continue;
        }
        s.record(took);
        match page_of(&body) {
            Some((items, _)) if expect(i, &items) => {}
            Some((items, _)) => {
                if s.wrong == 0 {
                    s.notes.push(format!(
                        "first wrong answer: request {} had {} items",
                        i + 1,
                        items.len()
                    ));
                }
                s.wrong += 1;
            }
            None => s.wrong += 1,
        }
    }
    s.elapsed = t0.elapsed();
    Ok(s)
}

// ---------------------------------------------------------------------------------------------
// The operator console

/// Rows the console's queue page shows at most (`PAGE` in `src/console/pages.rs`).
const CONSOLE_ROWS: u64 = 100;
/// The least time between the starts of two conversation pages: each reads the Open API (the
/// embedded emulator), and the daemon's shipped global upstream limit is 50 calls/s (burst 20),
/// so pages back to back would time its rate limiter; 20 pages/s stays under it even with the
/// second call a conversation of more than 10 messages takes.
const CONVERSATION_PACE: Duration = Duration::from_millis(50);

/// A browser's side of the console: no redirect followed (the sign-in's 303 carries the session
/// cookie), cookies sent by hand.
struct Browser {
    agent: ureq::Agent,
    base: String,
    session: String,
}

/// What a console answer was: its status, its `Set-Cookie` name/value pairs, its content type and
/// its body.
struct Page {
    status: u16,
    cookies: Vec<(String, String)>,
    html: bool,
    body: String,
}

fn browser_agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .timeout_global(Some(HTTP_TIMEOUT))
        .build()
        .into()
}

fn read_page(what: &str, mut resp: ureq::http::Response<ureq::Body>) -> Result<Page, String> {
    let status = resp.status().as_u16();
    let cookies = resp
        .headers()
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .filter_map(|v| {
            let pair = v.split(';').next()?;
            let (name, value) = pair.split_once('=')?;
            Some((name.trim().to_owned(), value.trim().to_owned()))
        })
        .collect();
    let html = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/html"));
    let body = resp
        .body_mut()
        .with_config()
        .limit(BODY.limit)
        .lossy_utf8(true)
        .read_to_string()
        .map_err(|e| format!("{what}: body: {e}"))?;
    Ok(Page {
        status,
        cookies,
        html,
        body,
    })
}

fn cookie_of<'a>(page: &'a Page, name: &str) -> Option<&'a str> {
    page.cookies
        .iter()
        .find(|(n, v)| n == name && !v.is_empty())
        .map(|(_, v)| v.as_str())
}

/// An HTML answer that is a page (not an empty body).
fn is_html_page(page: &Page) -> bool {
    page.html && page.body.len() > 100 && page.body.contains("</html>")
}

impl Browser {
    /// Sign in as a browser does: the form (its token in a hidden field and in the cookie
    /// `hb_console_sign_in`), then the form posted with the admin token, which answers 303 with
    /// the session cookie `hb_console`. `Ok(Err(why))`: the daemon has no console (`n/a`).
    fn sign_in(admin_base: &str) -> Result<Result<Browser, String>, String> {
        let agent = browser_agent();
        let url = format!("{admin_base}/console/sign-in");
        let resp = agent
            .get(&url)
            .call()
            .map_err(|e| format!("GET {url}: {e}"))?;
        let form = read_page("GET /console/sign-in", resp)?;
        if form.status == 404 {
            return Ok(Err("endpoint absent: 404".into()));
        }
        if form.status != 200 || !is_html_page(&form) {
            return Err(format!(
                "GET /console/sign-in answered {} ({} bytes, html {})",
                form.status,
                form.body.len(),
                form.html
            ));
        }
        let cookie = cookie_of(&form, "hb_console_sign_in")
            .ok_or("GET /console/sign-in set no hb_console_sign_in cookie")?
            .to_owned();
        let marker = "name=\"form\" value=\"";
        let token = form
            .body
            .find(marker)
            .map(|at| &form.body[at + marker.len()..])
            .and_then(|rest| rest.split('"').next())
            .filter(|t| !t.is_empty())
            .ok_or("the sign-in page has no hidden `form` field")?;
        let resp = agent
            .post(&url)
            .header("cookie", format!("hb_console_sign_in={cookie}"))
            .content_type("application/x-www-form-urlencoded")
            .send(format!(
                "token={}&name=bench&form={}",
                encode(ADMIN_TOKEN),
                encode(token)
            ))
            .map_err(|e| format!("POST {url}: {e}"))?;
        let signed = read_page("POST /console/sign-in", resp)?;
        let session = match (signed.status, cookie_of(&signed, "hb_console")) {
            (303, Some(id)) => id.to_owned(),
            (status, _) => {
                return Err(format!(
                    "POST /console/sign-in answered {status} without a session cookie: {}",
                    signed.body.chars().take(300).collect::<String>()
                ))
            }
        };
        Ok(Ok(Browser {
            agent,
            base: admin_base.to_owned(),
            session,
        }))
    }

    /// One signed-in GET of `path`, timed to the last byte of the body.
    fn get(&self, path: &str) -> Result<(Page, Duration), String> {
        let url = format!("{}{path}", self.base);
        let t0 = Instant::now();
        let resp = self
            .agent
            .get(&url)
            .header("cookie", format!("hb_console={}", self.session))
            .call()
            .map_err(|e| format!("GET {url}: {e}"))?;
        let page = read_page(&format!("GET {path}"), resp)?;
        Ok((page, t0.elapsed()))
    }
}

/// The console's pages timed, each a [`Series`]: (name, an example path, its series).
struct ConsolePages {
    pages: Vec<(&'static str, String, Series)>,
    /// What the conversation page showed of its messages (the Open API's part).
    messages: Option<String>,
}

impl ConsolePages {
    fn absent(why: &str) -> Result<Self, String> {
        let mut pages = Vec::new();
        for (name, path) in CONSOLE_PAGES {
            let mut s = Series::new()?;
            s.absent = Some(why.to_owned());
            pages.push((name, path.to_owned(), s));
        }
        Ok(ConsolePages {
            pages,
            messages: None,
        })
    }

    fn json(&self) -> Value {
        json!({
            "pages": self.pages.iter().map(|(name, path, s)| {
                let mut v = s.json();
                if let Some(o) = v.as_object_mut() {
                    o.insert("page".into(), json!(name));
                    o.insert("path".into(), json!(path));
                    if !o.contains_key("na") {
                        o.insert("target_p99_ms".into(), json!(100));
                        o.insert("met".into(), json!(console_met(s)));
                    }
                }
                v
            }).collect::<Vec<_>>(),
            "conversation_messages": self.messages,
        })
    }
}

/// The pages and the paths the report names them by.
const CONSOLE_PAGES: [(&str, &str); 4] = [
    ("overview", "/console/"),
    ("queue", "/console/queue"),
    ("queue of one bot", "/console/queue?bot=B"),
    ("conversation", "/console/conversations/{id}"),
];

/// Whether a console page met its target (p99 < 100 ms with every answer right).
fn console_met(s: &Series) -> bool {
    s.absent.is_none()
        && s.requests > 0
        && s.wrong == 0
        && common::quantile_ms(&s.hist, 0.99) < 100.0
}

/// How many rows a console queue page lists.
fn queue_rows(body: &str) -> u64 {
    body.matches("<td><a href=\"/console/conversations/")
        .count() as u64
}

/// The timeline's events on a conversation page.
fn timeline_items(body: &str) -> u64 {
    body.matches("<article class=\"event\">").count() as u64
}

/// What the conversation page shows of the Open API's messages.
fn messages_shown(body: &str) -> String {
    let Some(at) = body.find("<h2 id=\"messages\">") else {
        return "no messages section".into();
    };
    let section = &body[at..];
    let section = &section[..section.find("</section>").unwrap_or(section.len())];
    if let Some(note) = section
        .split("<p class=\"error\">")
        .nth(1)
        .and_then(|rest| rest.split("</p>").next())
    {
        return format!("a note: \"{note}\"");
    }
    let rows = section.matches("<td class=\"message\">").count();
    if rows == 0 {
        "\"No messages.\" (the Open API answered, with none for it)".into()
    } else {
        format!("{rows} messages")
    }
}

/// `count` signed-in GETs of `path_of(i)`, one after the other (starts at least `pace` apart);
/// `check(i, body)` says whether a page is right (else it counts as wrong, with a note). A
/// status other than 200 or an answer that is not an HTML page stops the series: `Err` says
/// which (the phase fails).
#[allow(clippy::too_many_arguments)]
fn console_series(
    browser: &Browser,
    name: &str,
    count: usize,
    limit: Duration,
    pace: Duration,
    path_of: impl Fn(usize) -> String,
    check: impl Fn(usize, &str) -> Result<(), String>,
    mut seen: impl FnMut(&str),
) -> Result<(Series, Option<String>), String> {
    let t0 = Instant::now();
    let mut s = Series::new()?;
    let mut failed = None;
    let mut last_start: Option<Instant> = None;
    for i in 0..count {
        if t0.elapsed() >= limit {
            s.cut = true;
            break;
        }
        if let Some(wait) = last_start.and_then(|at| pace.checked_sub(at.elapsed())) {
            std::thread::sleep(wait);
        }
        last_start = Some(Instant::now());
        let path = path_of(i);
        let (page, took) = browser.get(&path)?;
        if page.status != 200 || !is_html_page(&page) {
            failed = Some(format!(
                "console {name}: GET {path} (request {}) answered {} with {} bytes{}",
                i + 1,
                page.status,
                page.body.len(),
                if page.html { "" } else { ", not HTML" }
            ));
            break;
        }
        s.record(took);
        if i == 0 {
            seen(&page.body);
        }
        if let Err(why) = check(i, &page.body) {
            if s.wrong == 0 {
                s.notes.push(format!(
                    "console {name}: first wrong page: request {}: {why}",
                    i + 1
                ));
            }
            s.wrong += 1;
        }
    }
    s.elapsed = t0.elapsed();
    Ok((s, failed))
}

/// The console phase: sign in, then each page timed; the failures it met go to `failures`.
fn console_phase(
    opts: &Options,
    shape: &Shape,
    admin_base: &str,
    failures: &mut Vec<String>,
) -> Result<ConsolePages, String> {
    let browser = match Browser::sign_in(admin_base) {
        Ok(Ok(b)) => b,
        Ok(Err(why)) => return ConsolePages::absent(&why),
        Err(e) => {
            failures.push(format!("console sign-in: {e}"));
            return ConsolePages::absent("sign-in failed");
        }
    };
    let per_bot = shape.waiting_per_bot();
    let bots_waiting: Vec<u64> = (0..opts.bots)
        .filter(|b| per_bot.get(*b as usize).copied().unwrap_or(0) > 0)
        .collect();
    let n = opts.console_queries;
    let limit = opts.step_limit;
    let mut out = ConsolePages {
        pages: Vec::new(),
        messages: None,
    };
    let mut record = |name: &'static str, path: &str, result: (Series, Option<String>)| {
        let (series, failed) = result;
        eprintln!("[console] {name}: {}", series.cell());
        if let Some(f) = failed {
            eprintln!("[console] FAILED: {f}");
            failures.push(f);
        }
        out.pages.push((name, path.to_owned(), series));
    };

    let waiting = opts.waiting;
    let figure = format!("data-figure=\"waiting\">{waiting}</dd>");
    record(
        "overview",
        "/console/",
        console_series(
            &browser,
            "overview",
            n,
            limit,
            Duration::ZERO,
            |_| "/console/".into(),
            |_, body| {
                if body.contains(&figure) {
                    Ok(())
                } else {
                    Err(format!("no `{figure}`"))
                }
            },
            |_| {},
        )?,
    );

    let rows_check = |want: u64, body: &str| {
        let rows = queue_rows(body);
        if rows == want {
            Ok(())
        } else {
            Err(format!(
                "{rows} rows where {want} wait (up to {CONSOLE_ROWS})"
            ))
        }
    };
    record(
        "queue",
        "/console/queue",
        console_series(
            &browser,
            "queue",
            n,
            limit,
            Duration::ZERO,
            |_| "/console/queue".into(),
            |_, body| rows_check(waiting.min(CONSOLE_ROWS), body),
            |_| {},
        )?,
    );

    if bots_waiting.is_empty() {
        let mut s = Series::new()?;
        s.absent = Some("no bot has waiting conversations".into());
        record("queue of one bot", "/console/queue?bot=B", (s, None));
    } else {
        let bot_of = |i: usize| bots_waiting[i % bots_waiting.len()];
        record(
            "queue of one bot",
            &format!("/console/queue?bot={}", bot_id(bots_waiting[0])),
            console_series(
                &browser,
                "queue of one bot",
                n,
                limit,
                Duration::ZERO,
                |i| format!("/console/queue?bot={}", bot_id(bot_of(i))),
                |i, body| {
                    let want = per_bot.get(bot_of(i) as usize).copied().unwrap_or(0);
                    rows_check(want.min(CONSOLE_ROWS), body)
                },
                |_| {},
            )?,
        );
    }

    if waiting == 0 {
        let mut s = Series::new()?;
        s.absent = Some("no conversation waits".into());
        record("conversation", "/console/conversations/{id}", (s, None));
    } else {
        // The waiting conversations in turn, newest first: each has 3 events of its own
        // (created, a user message, the agent call).
        let conversation = |i: usize| {
            let mut id = String::new();
            write_conversation_id(&mut id, opts.conversations - 1 - (i as u64 % waiting));
            id
        };
        let mut messages = None;
        let result = console_series(
            &browser,
            "conversation",
            n,
            limit,
            CONVERSATION_PACE,
            |i| format!("/console/conversations/{}", conversation(i)),
            |i, body| {
                let id = conversation(i);
                let items = timeline_items(body);
                if !body.contains(&format!("<code>{id}</code></h1>")) {
                    Err(format!("not the page of {id}"))
                } else if items != 3 {
                    Err(format!("{items} timeline events where it has 3"))
                } else {
                    Ok(())
                }
            },
            |body| messages = Some(messages_shown(body)),
        )?;
        record(
            "conversation",
            &format!("/console/conversations/{}", conversation(0)),
            result,
        );
        if let Some(m) = &messages {
            eprintln!("[console] the conversation page's messages: {m}");
        }
        out.messages = messages;
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// The benchmark

struct Build {
    deliveries: u64,
    stats: LoadStats,
    drained_after: Duration,
    rss_mib: Option<f64>,
    hwm_mib: Option<f64>,
    disk: (u64, u64),
    /// The PostgreSQL database's size, bytes (on PostgreSQL).
    database: Option<u64>,
    start: Duration,
}

struct Ratio {
    /// (round, store, events/s, p50 ms, p99 ms, errors)
    runs: Vec<(usize, &'static str, f64, f64, f64, u64)>,
}

impl Ratio {
    fn mean(&self, store: &str) -> f64 {
        let v: Vec<f64> = self
            .runs
            .iter()
            .filter(|r| r.1 == store)
            .map(|r| r.2)
            .collect();
        v.iter().sum::<f64>() / (v.len().max(1) as f64)
    }

    fn ratio(&self) -> f64 {
        self.mean("large") / self.mean("empty").max(1e-9)
    }
}

struct Prune {
    /// `n/a` reason when there is no such endpoint.
    absent: Option<String>,
    took: Duration,
    answer: Value,
    rss_before: Option<f64>,
    rss_peak: Option<f64>,
    rss_after: Option<f64>,
    disk_before: u64,
    disk_after: u64,
}

struct Restart {
    shutdown: Duration,
    listening: Duration,
    ready: Duration,
    rss_ready: Option<f64>,
    /// The queue's first page right after the restart, items (expected: min(page, waiting)).
    queue_items: Option<usize>,
    /// The start after that one, to `listening:`: sled 0.34 replays its log from the snapshot it
    /// writes at each open, so the first start after heavy writing reads everything written
    /// since the previous start, and the next one reads little.
    listening_next: Duration,
    /// Each of the two starts to its `accepting webhooks:` line (the webhook answered while
    /// sled opens), when it printed one.
    accepting: Option<Duration>,
    accepting_next: Option<Duration>,
}

/// A time in seconds, or `-` when there was none.
fn seconds_text(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".to_owned(), |d| format!("{:.2} s", d.as_secs_f64()))
}

fn run(opts: &Options) -> Result<(), String> {
    opts.common.check()?;
    let shape = Shape::of(opts);
    let mut machine = common::machine_info(&opts.common.data_root, true);
    if let Some(store) = opts.pg.describe() {
        machine.push(("store".into(), store));
    }
    eprintln!(
        "scale bench: daemon {}, {} conversations over {} end users and {} bots, {} waiting; data under {}",
        opts.common.bin.display(),
        opts.conversations,
        opts.end_users,
        opts.bots,
        opts.waiting,
        opts.common.data_root.display()
    );
    let dir = tempfile::Builder::new()
        .prefix("scale-bench-")
        .tempdir_in(&opts.common.data_root)
        .map_err(|e| e.to_string())?;
    let data = dir.path().join("data");
    // On PostgreSQL, the large store's database (dropped at the end, after every daemon).
    let db = opts.pg.fresh("scale")?;
    let http = http();
    let mut failures: Vec<String> = Vec::new();

    // 1. Build.
    let (mut daemon, start) = Proc::spawn_timed(
        "daemon",
        daemon_command(opts, &data, db.as_ref()),
        &dir.path().join("daemon-1.log"),
    )?;
    let deliveries = opts.conversations.div_ceil(opts.batch);
    eprintln!(
        "[build] {deliveries} deliveries of {} conversations each",
        opts.batch
    );
    let stats = run_load(
        daemon.addr,
        Writer::new(1, shape)?,
        opts.connections,
        Load::Build {
            total: deliveries,
            batch: opts.batch,
            limit: opts.build_limit,
        },
    )?;
    eprintln!(
        "[build] {} events in {} deliveries accepted in {:.1} s ({:.0} events/s, p99 {:.1} ms); errors {}; waiting for the folds",
        stats.events,
        stats.deliveries,
        stats.window.as_secs_f64(),
        stats.per_sec(stats.events),
        common::quantile_ms(&stats.hist, 0.99),
        common::errors_text(&stats.errors)
    );
    if stats.deliveries < deliveries {
        return Err(format!(
            "the build stored {} of {deliveries} deliveries ({} given up, the rest not posted within {:?}); errors {}",
            stats.deliveries,
            stats.lost,
            opts.build_limit,
            common::errors_text(&stats.errors)
        ));
    }
    let drained_after = wait_drained(&http, &daemon, opts.drain_limit, "build")?;
    let build = Build {
        deliveries,
        drained_after,
        rss_mib: rss_mib(daemon.pid, "VmRSS"),
        hwm_mib: rss_mib(daemon.pid, "VmHWM"),
        disk: common::dir_size(&data),
        database: db.as_ref().and_then(PgDatabase::size_bytes),
        stats,
        start,
    };
    eprintln!(
        "[build] drained {:.1} s after the last delivery; VmRSS {:.1} MiB (peak {:.1}); data dir {:.1} MiB",
        build.drained_after.as_secs_f64(),
        build.rss_mib.unwrap_or(0.0),
        build.hwm_mib.unwrap_or(0.0),
        build.disk.0 as f64 / 1048576.0
    );

    // 2. The queue.
    let per_bot = shape.waiting_per_bot();
    let queue_base = format!(
        "{}/helpdesk/v1/conversations?phase=requested&limit={}",
        daemon.base(),
        opts.page
    );
    let queue = first_pages(
        &http,
        HELPDESK_TOKEN,
        opts.queries,
        opts.step_limit,
        |i| format!("{queue_base}&bot={}", bot_id(i as u64 % opts.bots)),
        |i, items| {
            let want = per_bot
                .get(i % per_bot.len())
                .copied()
                .unwrap_or(0)
                .min(opts.page as u64);
            items.len() as u64 == want && items.iter().all(|it| it["phase"] == "requested")
        },
    )?;
    eprintln!("[queue] first pages: {}", queue.cell());
    let queue_walk = walk(
        &http,
        &queue_base,
        HELPDESK_TOKEN,
        usize::MAX,
        opts.step_limit,
    )?;
    eprintln!(
        "[queue] walk: {} pages, {} items ({} distinct), complete {}, cursor {}",
        queue_walk.pages.requests,
        queue_walk.items,
        queue_walk.distinct,
        queue_walk.complete,
        !queue_walk.no_cursor
    );
    // A walk must find every waiting conversation once (where the list has a cursor).
    let walked = queue_walk.pages.absent.is_none() && !queue_walk.no_cursor;
    if walked
        && (!queue_walk.complete
            || queue_walk.distinct != opts.waiting
            || queue_walk.items != opts.waiting)
    {
        failures.push(format!(
            "the queue walk found {} items ({} distinct){} where {} wait",
            queue_walk.items,
            queue_walk.distinct,
            if queue_walk.complete {
                ""
            } else {
                " and did not reach the end"
            },
            opts.waiting
        ));
    }
    if queue.wrong > 0 {
        eprintln!(
            "[queue] {} first pages were not what the store holds",
            queue.wrong
        );
    }

    // 3. Admin lists.
    let admin = daemon.admin_base();
    let mut admin_lists = Vec::new();
    for (name, total) in [
        ("conversations", opts.conversations),
        ("endusers", opts.end_users),
    ] {
        let base = format!("{admin}/admin/v1/{name}?limit={}", opts.page);
        let want = total.min(opts.page as u64) as usize;
        let first = first_pages(
            &http,
            ADMIN_TOKEN,
            opts.admin_queries,
            opts.step_limit,
            |_| base.clone(),
            |_, items| items.len() == want,
        )?;
        let deep = walk(&http, &base, ADMIN_TOKEN, opts.walk_pages, opts.step_limit)?;
        eprintln!(
            "[admin] {name}: first pages {}; walk {} pages, {} items",
            first.cell(),
            deep.pages.requests,
            deep.items
        );
        // A walk to the end must have seen every one once (items without an `id` counted).
        let found = if deep.distinct > 0 {
            deep.distinct
        } else {
            deep.items
        };
        if deep.pages.absent.is_none() && deep.complete && (found != total || deep.items != total) {
            failures.push(format!(
                "the admin {name} walk found {} items ({} distinct) of {total}",
                deep.items, deep.distinct
            ));
        }
        admin_lists.push((name, first, deep));
    }

    // 4. The operator console.
    let console = console_phase(opts, &shape, &admin, &mut failures)?;

    // 5. Intake on the large store against an empty one, alternating, twice.
    let mut ratio = Ratio { runs: Vec::new() };
    let mut run_tag: u16 = 1;
    for round in 1..=2 {
        for store in ["empty", "large"] {
            run_tag += 1;
            let load = Load::Timed {
                warmup: opts.ratio_warmup,
                measure: opts.ratio_duration,
                batch: opts.ratio_batch,
            };
            let writer = Writer::new(run_tag, shape)?;
            let stats = if store == "empty" {
                let empty_dir = dir.path().join(format!("empty-{round}"));
                let empty_db = opts.pg.fresh("empty")?;
                let mut empty = Proc::spawn(
                    "daemon (empty)",
                    daemon_command(opts, &empty_dir, empty_db.as_ref()),
                    &dir.path().join(format!("empty-{round}.log")),
                )?;
                let stats = run_load(empty.addr, writer, opts.connections, load)?;
                empty.stop(STOP_POLL)?;
                let _ = std::fs::remove_dir_all(&empty_dir);
                stats
            } else {
                let stats = run_load(daemon.addr, writer, opts.connections, load)?;
                wait_drained(&http, &daemon, opts.drain_limit, "intake ratio")?;
                stats
            };
            let errors = stats.errors.values().sum::<u64>();
            eprintln!(
                "[intake] round {round} {store}: {:.0} events/s, p50 {:.2} ms, p99 {:.2} ms, errors {}",
                stats.per_sec(stats.events),
                common::quantile_ms(&stats.hist, 0.5),
                common::quantile_ms(&stats.hist, 0.99),
                common::errors_text(&stats.errors)
            );
            ratio.runs.push((
                round,
                store,
                stats.per_sec(stats.events),
                common::quantile_ms(&stats.hist, 0.5),
                common::quantile_ms(&stats.hist, 0.99),
                errors,
            ));
        }
    }

    // 6. A pruning pass.
    let prune = prune_pass(&http, &daemon, &data)?;
    eprintln!(
        "[prune] {}",
        match &prune.absent {
            Some(why) => format!("n/a ({why})"),
            None => format!("{:.2} s, answer {}", prune.took.as_secs_f64(), prune.answer),
        }
    );

    // 7. Restart.
    let (shutdown, status) = daemon.stop(STOP_POLL)?;
    if !status.success() {
        return Err(format!(
            "daemon exited with {status} on SIGTERM; log:\n{}",
            common::tail(&daemon.log, 20)
        ));
    }
    let t0 = Instant::now();
    let (again, listening) = Proc::spawn_timed(
        "daemon (restart)",
        daemon_command(opts, &data, db.as_ref()),
        &dir.path().join("daemon-2.log"),
    )?;
    let ready_url = format!("{}/readyz", again.base());
    loop {
        if let Ok((200, _)) = http.get(&ready_url, None) {
            break;
        }
        if t0.elapsed() > READY_LIMIT {
            return Err(format!("restarted daemon not ready within {READY_LIMIT:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let ready = t0.elapsed();
    let accepting = again.accepting_after;
    let rss_ready = rss_mib(again.pid, "VmRSS");
    let queue_items = match http.get(
        &format!(
            "{}/helpdesk/v1/conversations?phase=requested&limit={}",
            again.base(),
            opts.page
        ),
        Some(HELPDESK_TOKEN),
    ) {
        Ok((200, body)) => page_of(&body).map(|(items, _)| items.len()),
        _ => None,
    };
    eprintln!(
        "[restart] shutdown {:.2} s, listening after {:.2} s, ready after {:.2} s, VmRSS {:.1} MiB",
        shutdown.as_secs_f64(),
        listening.as_secs_f64(),
        ready.as_secs_f64(),
        rss_ready.unwrap_or(0.0)
    );
    let mut again = again;
    again.stop(STOP_POLL)?;
    let (mut third, listening_next) = Proc::spawn_timed(
        "daemon (second restart)",
        daemon_command(opts, &data, db.as_ref()),
        &dir.path().join("daemon-3.log"),
    )?;
    let accepting_next = third.accepting_after;
    third.stop(STOP_POLL)?;
    eprintln!(
        "[restart] webhook answered after {:?} s; the start after that: listening after {:.2} s, webhook answered after {:?} s",
        accepting.map(|a| a.as_secs_f64()),
        listening_next.as_secs_f64(),
        accepting_next.map(|a| a.as_secs_f64())
    );
    let restart = Restart {
        shutdown,
        listening,
        ready,
        rss_ready,
        queue_items,
        listening_next,
        accepting,
        accepting_next,
    };

    let results = Results {
        build,
        queue,
        queue_walk,
        admin_lists,
        console,
        ratio,
        prune,
        restart,
        failures,
    };
    let report = report(opts, &machine, &results);
    common::publish(&report, &opts.common.out)?;
    common::publish_json(&json_results(opts, &results), opts.common.json.as_deref())?;
    eprintln!("report written to {}", opts.common.out.display());
    if !results.failures.is_empty() {
        return Err(results.failures.join("; "));
    }
    Ok(())
}

/// `POST /admin/v1/prune`, timed, with the daemon's VmRSS sampled every 10 ms while it runs.
fn prune_pass(http: &Http, daemon: &Proc, data: &Path) -> Result<Prune, String> {
    let pid = daemon.pid;
    let rss_before = rss_mib(pid, "VmRSS");
    let disk_before = common::dir_size(data).0;
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (stop, peak) = (stop.clone(), peak.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Some(kb) = common::proc_status_kb(pid, "VmRSS") {
                    peak.fetch_max(kb, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let t0 = Instant::now();
    let answer = http.post(
        &format!("{}/admin/v1/prune", daemon.admin_base()),
        Some(ADMIN_TOKEN),
        None,
    );
    let took = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    let (status, body) = answer?;
    let absent = (status != 200).then(|| absent_reason(status, &body));
    Ok(Prune {
        absent,
        took,
        answer: serde_json::from_str(&body).unwrap_or(Value::String(body)),
        rss_before,
        rss_peak: Some(peak.load(Ordering::Relaxed) as f64 / 1024.0).filter(|p| *p > 0.0),
        rss_after: rss_mib(pid, "VmRSS"),
        disk_before,
        disk_after: common::dir_size(data).0,
    })
}

struct Results {
    build: Build,
    queue: Series,
    queue_walk: Walk,
    admin_lists: Vec<(&'static str, Series, Walk)>,
    console: ConsolePages,
    ratio: Ratio,
    prune: Prune,
    restart: Restart,
    failures: Vec<String>,
}

fn mib_text(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |m| format!("{m:.1} MiB"))
}

fn json_results(opts: &Options, r: &Results) -> Value {
    let b = &r.build;
    json!({
        "quick": opts.quick,
        "conversations": opts.conversations,
        "end_users": opts.end_users,
        "waiting": opts.waiting,
        "bots": opts.bots,
        "build": {
            "deliveries": b.deliveries,
            "events": b.stats.events,
            "seconds": b.stats.window.as_secs_f64(),
            "events_per_s": b.stats.per_sec(b.stats.events),
            "ack_p99_ms": common::quantile_ms(&b.stats.hist, 0.99),
            "errors": b.stats.errors.values().sum::<u64>(),
            "drained_after_s": b.drained_after.as_secs_f64(),
            "rss_mib": b.rss_mib,
            "rss_peak_mib": b.hwm_mib,
            "disk_mib": b.disk.0 as f64 / 1048576.0,
            "database_mib": b.database.map(|d| d as f64 / 1048576.0),
            "first_start_s": b.start.as_secs_f64(),
        },
        "queue_first_pages": r.queue.json(),
        "queue_walk": r.queue_walk.json(),
        "admin": r.admin_lists.iter().map(|(name, first, deep)| json!({
            "list": name, "first_pages": first.json(), "walk": deep.json(),
        })).collect::<Vec<_>>(),
        "console": r.console.json(),
        "intake": {
            "runs": r.ratio.runs.iter().map(|(round, store, eps, p50, p99, errors)| json!({
                "round": round, "store": store, "events_per_s": eps, "p50_ms": p50, "p99_ms": p99, "errors": errors,
            })).collect::<Vec<_>>(),
            "ratio": r.ratio.ratio(),
        },
        "prune": match &r.prune.absent {
            Some(why) => json!({ "na": why }),
            None => json!({
                "seconds": r.prune.took.as_secs_f64(),
                "answer": r.prune.answer,
                "rss_before_mib": r.prune.rss_before,
                "rss_peak_mib": r.prune.rss_peak,
                "rss_after_mib": r.prune.rss_after,
                "disk_before_mib": r.prune.disk_before as f64 / 1048576.0,
                "disk_after_mib": r.prune.disk_after as f64 / 1048576.0,
            }),
        },
        "restart": {
            "shutdown_s": r.restart.shutdown.as_secs_f64(),
            "listening_s": r.restart.listening.as_secs_f64(),
            "ready_s": r.restart.ready.as_secs_f64(),
            "listening_next_s": r.restart.listening_next.as_secs_f64(),
            "accepting_webhooks_s": r.restart.accepting.map(|a| a.as_secs_f64()),
            "accepting_webhooks_next_s": r.restart.accepting_next.map(|a| a.as_secs_f64()),
            "rss_mib": r.restart.rss_ready,
            "queue_first_page_items": r.restart.queue_items,
        },
        "failures": r.failures,
    })
}

fn report(opts: &Options, machine: &[(String, String)], res: &Results) -> String {
    let mut r = String::new();
    common::report_head(&mut r, "Scale", opts.quick, machine);
    let b = &res.build;
    let _ = writeln!(
        r,
        "\nStore: {} conversations over {} end users and {} bots, {} of them waiting (`phase=requested`), \
         built through the webhook ({} deliveries of {} conversations, {} connections, closed loop). \
         Daemon `{}` (git {}), rules off{}.\n",
        opts.conversations,
        opts.end_users,
        opts.bots,
        opts.waiting,
        b.deliveries,
        opts.batch,
        opts.connections,
        opts.common.bin.display(),
        common::git_head(),
        if opts.short_retention { ", dedupe and event retention 60 s" } else { "" }
    );
    let _ = writeln!(r, "| step | figure | |\n|---|---|---|");
    let row = |r: &mut String, step: &str, figure: String, note: String| {
        let _ = writeln!(r, "| {step} | {figure} | {note} |");
    };
    row(
        &mut r,
        "build",
        format!(
            "{} events in {:.1} s ({:.0} events/s, ack p99 {:.1} ms), folds drained {:.1} s later",
            b.stats.events,
            b.stats.window.as_secs_f64(),
            b.stats.per_sec(b.stats.events),
            common::quantile_ms(&b.stats.hist, 0.99),
            b.drained_after.as_secs_f64()
        ),
        format!("errors {}", common::errors_text(&b.stats.errors)),
    );
    row(
        &mut r,
        "store after the build",
        format!(
            "VmRSS {} (peak {}), data dir {:.1} MiB{}",
            mib_text(b.rss_mib),
            mib_text(b.hwm_mib),
            b.disk.0 as f64 / 1048576.0,
            b.database.map_or(String::new(), |d| format!(
                ", PostgreSQL database {:.1} MiB",
                d as f64 / 1048576.0
            ))
        ),
        String::new(),
    );
    row(
        &mut r,
        "queue first pages (p50 / p99 / max)",
        res.queue.cell(),
        format!(
            "`phase=requested&bot=B&limit={}`, bots in turn; target p99 < 50 ms{}",
            opts.page,
            match res.queue.absent {
                None if res.queue.requests > 0 => {
                    if common::quantile_ms(&res.queue.hist, 0.99) < 50.0 {
                        " **met**"
                    } else {
                        " **not met**"
                    }
                }
                _ => "",
            }
        ),
    );
    let w = &res.queue_walk;
    row(
        &mut r,
        "queue cursor walk (per page)",
        w.pages.cell(),
        if w.pages.absent.is_some() {
            String::new()
        } else if w.no_cursor {
            let want = opts.waiting.min(opts.page as u64);
            format!(
                "n/a (no cursor: the first page had {} items{})",
                w.items,
                if w.items == want {
                    String::new()
                } else {
                    format!(", **wrong**: {want} wait")
                }
            )
        } else {
            format!(
                "{} pages, {} waiting found of {}{}, {:.2} s",
                w.pages.requests,
                w.distinct,
                opts.waiting,
                if w.complete { "" } else { ", **incomplete**" },
                w.pages.elapsed.as_secs_f64()
            )
        },
    );
    for (name, first, deep) in &res.admin_lists {
        row(
            &mut r,
            &format!("admin {name} first pages"),
            first.cell(),
            format!("`limit={}`", opts.page),
        );
        row(
            &mut r,
            &format!("admin {name} cursor walk (per page)"),
            deep.pages.cell(),
            if deep.pages.absent.is_some() {
                String::new()
            } else if deep.no_cursor {
                "n/a (no cursor)".into()
            } else {
                format!(
                    "{} pages, {} items deep{}, {:.2} s",
                    deep.pages.requests,
                    deep.items,
                    if deep.complete {
                        " (the whole list)"
                    } else {
                        ""
                    },
                    deep.pages.elapsed.as_secs_f64()
                )
            },
        );
    }
    for (name, path, s) in &res.console.pages {
        row(
            &mut r,
            &format!("console {name} (p50 / p99 / max)"),
            s.cell(),
            if s.absent.is_some() {
                String::new()
            } else {
                format!(
                    "`GET {path}` signed in{}; target p99 < 100 ms **{}**",
                    match (*name, &res.console.messages) {
                        ("conversation", Some(m)) => format!(
                            ", waiting conversations in turn, at most {:.0}/s; includes an upstream call to the embedded emulator (messages: {m})",
                            1.0 / CONVERSATION_PACE.as_secs_f64()
                        ),
                        ("queue of one bot", _) => ", bots with waiting conversations in turn".into(),
                        _ => String::new(),
                    },
                    if console_met(s) { "met" } else { "not met" }
                )
            },
        );
    }
    let ratio = res.ratio.ratio();
    row(
        &mut r,
        "intake: large / empty store",
        format!(
            "{:.2} ({:.0} vs {:.0} events/s, means of 2 runs each)",
            ratio,
            res.ratio.mean("large"),
            res.ratio.mean("empty")
        ),
        format!(
            "target >= 0.8 **{}**; {} user messages per delivery to random conversations, {} connections, {:.1} s after {:.1} s warm-up",
            if ratio >= 0.8 { "met" } else { "not met" },
            opts.ratio_batch,
            opts.connections,
            opts.ratio_duration.as_secs_f64(),
            opts.ratio_warmup.as_secs_f64()
        ),
    );
    let p = &res.prune;
    match &p.absent {
        Some(why) => row(
            &mut r,
            "pruning pass",
            format!("n/a ({why})"),
            String::new(),
        ),
        None => row(
            &mut r,
            "pruning pass",
            format!(
                "{:.3} s; VmRSS {} before, {} peak, {} after; data dir {:.1} -> {:.1} MiB",
                p.took.as_secs_f64(),
                mib_text(p.rss_before),
                mib_text(p.rss_peak),
                mib_text(p.rss_after),
                p.disk_before as f64 / 1048576.0,
                p.disk_after as f64 / 1048576.0
            ),
            format!("answer `{}`", p.answer),
        ),
    }
    let s = &res.restart;
    row(
        &mut r,
        "restart",
        format!(
            "shutdown {:.2} s; start: webhook answered after {}, `listening:` after {:.2} s, `/readyz` 200 after {:.2} s; VmRSS {}; the start after it: webhook answered after {}, `listening:` after {:.2} s",
            s.shutdown.as_secs_f64(),
            seconds_text(s.accepting),
            s.listening.as_secs_f64(),
            s.ready.as_secs_f64(),
            mib_text(s.rss_ready),
            seconds_text(s.accepting_next),
            s.listening_next.as_secs_f64()
        ),
        format!(
            "queue first page after it: {} items",
            s.queue_items.map_or("n/a".into(), |n| n.to_string())
        ),
    );
    let _ = writeln!(r, "\nIntake runs:\n\n| round | store | events/s | ack p50 ms | ack p99 ms | errors |\n|---:|---|---:|---:|---:|---:|");
    for (round, store, eps, p50, p99, errors) in &res.ratio.runs {
        let _ = writeln!(
            r,
            "| {round} | {store} | {eps:.0} | {p50:.2} | {p99:.2} | {errors} |"
        );
    }
    let notes: Vec<&String> = std::iter::once(&res.queue.notes)
        .chain(
            res.admin_lists
                .iter()
                .flat_map(|(_, a, b)| [&a.notes, &b.pages.notes]),
        )
        .chain(res.console.pages.iter().map(|(_, _, s)| &s.notes))
        .flatten()
        .collect();
    if !notes.is_empty() || !res.failures.is_empty() {
        let _ = writeln!(r, "\nNotes:\n");
        for n in notes {
            let _ = writeln!(r, "- {n}");
        }
        for f in &res.failures {
            let _ = writeln!(r, "- **failed**: {f}");
        }
    }
    r
}
