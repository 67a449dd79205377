//! Actions benchmark: webhook events in, Open API calls out, end to end, with the standalone
//! emulator as the upstream (issue 4).
//!
//! ```text
//! cargo bench --bench actions                 # full run (about 5-10 minutes)
//! cargo bench --bench actions -- --quick      # smoke run (CI): one 2 s run at 1,000 events/s
//! cargo bench --bench actions -- --help       # every option
//! ```
//!
//! What it does, all on 127.0.0.1, every process started here bounded in time:
//!
//! - writes a **seed** for the emulator: the embedded default seed (`deploy/emulator-seed.json`)
//!   plus N conversations (default 2,000), each with its own end user, cloned from the seed's
//!   first conversation and end user with new ids;
//! - writes a **rule file**: on `bot.message.received` from the user, one `send_message`
//!   (`"echo {{ message.data.text }}"`). Each decided action's idempotency key is
//!   `{event id}/bench-echo/0`, which is how a journal entry is matched to the event posted;
//! - per run, starts a fresh **emulator** (`handoff-bridge emulator --seed ... --api-key ...`)
//!   and a fresh **daemon** (`handoff-bridge serve`, fresh data directory) whose upstream is that
//!   emulator, with the upstream rate limits raised out of the way (the defaults, 20 writes/s,
//!   would be the whole result) and `outbox.concurrency` as given;
//! - an **open-loop** load generator on one thread (tokio current-thread runtime, a minimal
//!   HTTP/1.1 keep-alive client per connection) posts deliveries of `bot.message.received`
//!   events (built from the shared fixture `message-received-text.json`, unique delivery, event
//!   and message ids, spread over the seeded conversations) on a fixed schedule: delivery `n` is
//!   due at `t0 + n x batch / rate`, whatever the answers to earlier ones. A warm-up precedes the
//!   measured window. For each delivery it stamps (Unix µs, the machine's wall clock) when the
//!   POST was written and when its 200 came back;
//! - after the window it waits (bounded) for the daemon's inbox to drain and its outbox to go
//!   idle, then reads the emulator's journal (`GET /_emulator/journal`: each call's `at_us`, Unix
//!   µs on the same clock, its idempotency key, status, replayed), the daemon's dead letters and
//!   `/metrics`, and stops both processes;
//! - **latency** of an action = journal `at_us` minus the moment the bench wrote the POST of its
//!   event: from webhook receipt to the upstream call, including the durable acknowledgment.
//!   (Until session 16 the journal had only `at`, in ms, from a start time cut to the ms: each
//!   run's figures were off by one constant within ±0.5 ms.) The same against the moment the 200
//!   came back is reported too;
//! - **cases**: the fixed rate (1,000 events/s) and the maximum sustained rate, found by a search
//!   (one run per step, same window as the measured runs: double from 1,000 events/s until a
//!   step fails, then bisect down to `--resolution`), then measured in `--runs` rounds
//!   alternating with the fixed case (the order flips each round).
//!   A run is *sustained* when every POST was accepted, the generator kept its schedule, no
//!   action is a dead letter or missing, actions/s in the window are at least 95% of the target
//!   events/s and the p99 latency is under `--p99-bound-ms`.
//!
//! The markdown report is printed on stdout and written to `--out` (default
//! `target/tmp/actions-bench.md`). Progress goes to stderr.

mod common;

use common::pg::{PgDatabase, PgTarget};
use common::{
    BenchOptions, BodyRead, CommonOptions, Conn, Http, OptionSpec, Proc, Response, Setting, Target,
    ADMIN_TOKEN, HTTP_TIMEOUT, WEBHOOK_TOKEN,
};
use hdrhistogram::Histogram;
use serde::Deserialize;
use serde_json::Value;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const UPSTREAM_KEY: &str = "bench-upstream-key-0123456789";
/// The bench's one rule; part of every action id (`{event id}/bench-echo/0`).
const RULE_NAME: &str = "bench-echo";
/// How often a stopping process is checked for its exit.
const STOP_POLL: Duration = Duration::from_millis(5);
/// The emulator's journal is large: read up to 1 GiB; an unreadable body is an error.
const BODY: BodyRead = BodyRead {
    limit: 1 << 30,
    lossy_utf8: false,
    required: true,
};
/// The emulator's journal keeps the last 100,000 calls (`emulator::journal::DEFAULT_CAPACITY`);
/// a run posts at most this many events so none is evicted before it is read.
const JOURNAL_BUDGET: f64 = 90_000.0;
/// The upstream limits while benchmarking: high enough never to wait.
const LIMIT_PER_SECOND: &str = "1000000";
const LIMIT_BURST: &str = "100000";
/// The generator is on schedule when its p99 lag (send time after due time) is under this.
const MAX_LAG_P99: Duration = Duration::from_millis(50);

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    OPTIONS.main(&args, run);
}

// ---------------------------------------------------------------------------------------------
// Options

#[derive(Clone, Debug)]
struct Options {
    quick: bool,
    /// Events/s of the fixed-rate case.
    rate: f64,
    /// Measured window of each measured run (fixed and max cases).
    duration: Duration,
    /// Unmeasured load at the same rate before each window.
    warmup: Duration,
    /// Rounds of the measured cases.
    runs: usize,
    /// Search for the maximum sustained rate (and measure it) unless `max_rate` is given.
    max_case: bool,
    /// Skip the search and measure this rate as the maximum (0: search).
    max_rate: f64,
    search_duration: Duration,
    search_from: f64,
    search_limit: f64,
    /// The search stops when the passing and failing rates are this close (events/s).
    resolution: f64,
    p99_bound: Duration,
    /// Longest wait for drain + idle after a measured run's window.
    drain_limit: Duration,
    /// The same after a search step (a failing step can leave a long backlog).
    search_drain_limit: Duration,
    conversations: u64,
    connections: usize,
    /// Events per delivery.
    batch: usize,
    outbox_concurrency: usize,
    /// What the events are and which upstream calls they must cause.
    scenario: Scenario,
    /// The emulator's port on 127.0.0.1 (0: any free one). `benches/run` fixes it so a peer
    /// started before the runs (Node-RED) can be pointed at each run's fresh emulator.
    emulator_port: u16,
    /// Post the webhooks to this address instead of starting a daemon (a peer such as the
    /// Node-RED flow; it must answer like the daemon and call the emulator).
    target: Option<SocketAddr>,
    /// The peer's PID, for its CPU share (0: not reported).
    target_pid: u32,
    /// The emulator sends its webhook events back to the target, as the service does: every
    /// message the bot sends comes back as `bot.message.sent` (batched over 50 ms).
    echo_webhooks: bool,
    /// The PostgreSQL server the daemon runs on, a fresh database per run (else sled).
    pg: PgTarget,
    /// Data root, report, daemon binary and its extra environment.
    common: CommonOptions,
}

/// The events posted and the upstream calls each must cause (matched in the emulator's journal
/// by their idempotency keys, `{event id}/{rule}/{index}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    /// The bench's own one-rule file: each user message echoed with one `send_message`.
    Echo,
    /// The shipped rules (built into the daemon): each `bot.conversation.agent_call_requested`
    /// is queued for a person by `agent-requested`: `set_manual` (0), then `send_message` (1).
    Handoff,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Echo => "echo",
            Scenario::Handoff => "handoff",
        }
    }
    fn fixture(self) -> &'static str {
        match self {
            Scenario::Echo => "message-received-text.json",
            Scenario::Handoff => "agent-call-requested.json",
        }
    }
    fn event_type(self) -> &'static str {
        match self {
            Scenario::Echo => "bot.message.received",
            Scenario::Handoff => "bot.conversation.agent_call_requested",
        }
    }
    fn rule(self) -> &'static str {
        match self {
            Scenario::Echo => RULE_NAME,
            Scenario::Handoff => "agent-requested",
        }
    }
    /// Upstream calls per event (action indexes 0..calls of the rule).
    fn calls(self) -> usize {
        match self {
            Scenario::Echo => 1,
            Scenario::Handoff => 2,
        }
    }
}

const USAGE: &str = "\
usage: cargo bench --bench actions -- [options]
  --quick                   smoke run: one 2 s run at 1,000 events/s, no search
  --rate N                  events/s of the fixed-rate case (default 1000)
  --duration SECS           measured window of each measured run (default 10)
  --warmup SECS             unmeasured load before each window, same rate (default 1)
  --runs N                  rounds of the fixed and max cases, alternating (default 3)
  --no-max                  only the fixed-rate case: no search, no max case
  --max-rate N              measure this rate as the max case instead of searching for it
  --search-duration SECS    window of each search step (default 10)
  --search-from N           first search step, events/s (default 1000; doubles until a step fails)
  --search-limit N          highest step tried (default 64000)
  --resolution N            stop bisecting when pass and fail are this close (default 250)
  --p99-bound-ms N          a sustained run's p99 latency bound (default 500)
  --drain-limit SECS        wait for drain + idle after a measured window (default 60)
  --search-drain-limit SECS the same after a search step (default 20)
  --conversations N         seeded conversations the events spread over (default 2000)
  --connections N           keep-alive connections of the generator (default 512)
  --batch N                 events per delivery (default 1)
  --outbox-concurrency N    the daemon's outbox.concurrency (default 64; shipped default 16)
  --scenario NAME           echo (default: the bench's one rule, one send_message per user message)
                            or handoff (the shipped rules; agent calls, 2 upstream calls each)
  --emulator-port N         the emulator's port on 127.0.0.1 (default 0: any free one)
  --target ADDR             post to this address (a peer, e.g. the Node-RED flow) instead of a daemon
  --target-pid N            the peer's PID, for its CPU share in the report
  --echo-webhooks on|off    the emulator posts its webhook events (each sent message's
                            `bot.message.sent` echo) back to the daemon or peer, as the service
                            does (default on)
  --pg-url URL              run each daemon on PostgreSQL: a fresh database per run, made (and
                            dropped) from this postgres:// URL's database with psql (default: sled)
  --pg-data DIR             that server's data directory: its processes' CPU (the postmaster and
                            its children) is measured and reported with the daemon's
  --data-root DIR           where data directories go (default target/tmp)
  --out FILE                also write the markdown report here (default target/tmp/actions-bench.md)
  --json FILE               also write the results as JSON here (read by benches/run)
  --bin PATH                daemon binary (default: the one cargo built for this bench)
  --daemon-env K=V[,K=V]    extra environment for the daemon, e.g. HANDOFF_BRIDGE__DISPATCH__CONCURRENCY=4
Every option can also be given as ACTIONS_BENCH_<NAME> (e.g. ACTIONS_BENCH_RUNS=5,
ACTIONS_BENCH_QUICK=1); flags win over variables.";

const OPTIONS: OptionSpec = OptionSpec {
    name: "actions",
    env_prefix: "ACTIONS_BENCH",
    usage: USAGE,
    keys: KEYS,
    off_flag: ("--no-max", "max"),
};

const KEYS: &[&str] = &[
    "rate",
    "duration",
    "warmup",
    "runs",
    "max",
    "max-rate",
    "search-duration",
    "search-from",
    "search-limit",
    "resolution",
    "p99-bound-ms",
    "drain-limit",
    "search-drain-limit",
    "conversations",
    "connections",
    "batch",
    "outbox-concurrency",
    "scenario",
    "emulator-port",
    "target",
    "target-pid",
    "echo-webhooks",
    common::pg::KEYS[0],
    common::pg::KEYS[1],
];

impl BenchOptions for Options {
    fn full() -> Self {
        Options {
            quick: false,
            rate: 1_000.0,
            duration: Duration::from_secs(10),
            warmup: Duration::from_secs(1),
            runs: 3,
            max_case: true,
            max_rate: 0.0,
            search_duration: Duration::from_secs(10),
            search_from: 1_000.0,
            search_limit: 64_000.0,
            resolution: 250.0,
            p99_bound: Duration::from_millis(500),
            drain_limit: Duration::from_secs(60),
            search_drain_limit: Duration::from_secs(20),
            conversations: 2_000,
            connections: 512,
            batch: 1,
            outbox_concurrency: 64,
            scenario: Scenario::Echo,
            emulator_port: 0,
            target: None,
            target_pid: 0,
            echo_webhooks: true,
            pg: PgTarget::default(),
            common: CommonOptions::new("actions-bench.md"),
        }
    }

    fn quick() -> Self {
        Options {
            quick: true,
            duration: Duration::from_secs(2),
            warmup: Duration::from_millis(500),
            runs: 1,
            max_case: false,
            conversations: 500,
            connections: 32,
            drain_limit: Duration::from_secs(15),
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
        let rate = || {
            s.value
                .parse::<f64>()
                .ok()
                .filter(|r| r.is_finite() && *r >= 0.0)
                .ok_or_else(|| format!("--{}: `{}` is not a rate", s.key, s.value))
        };
        match s.key.as_str() {
            "rate" => self.rate = rate()?,
            "duration" => self.duration = s.secs()?,
            "warmup" => self.warmup = s.secs()?,
            "runs" => self.runs = s.size()?,
            "max" => self.max_case = s.truthy(),
            "max-rate" => self.max_rate = rate()?,
            "search-duration" => self.search_duration = s.secs()?,
            "search-from" => self.search_from = rate()?,
            "search-limit" => self.search_limit = rate()?,
            "resolution" => self.resolution = rate()?,
            "p99-bound-ms" => self.p99_bound = Duration::from_millis(s.num()?),
            "drain-limit" => self.drain_limit = s.secs()?,
            "search-drain-limit" => self.search_drain_limit = s.secs()?,
            "conversations" => self.conversations = s.num()?,
            "connections" => self.connections = s.size()?,
            "batch" => self.batch = s.size()?,
            "outbox-concurrency" => self.outbox_concurrency = s.size()?,
            "scenario" => {
                self.scenario = match s.value.as_str() {
                    "echo" => Scenario::Echo,
                    "handoff" => Scenario::Handoff,
                    other => return Err(format!("--scenario: `{other}` is not echo or handoff")),
                }
            }
            "emulator-port" => {
                self.emulator_port = u16::try_from(s.num()?)
                    .map_err(|_| format!("--emulator-port: `{}` is not a port", s.value))?
            }
            "target" => {
                let addr: SocketAddr = s
                    .value
                    .parse()
                    .map_err(|_| format!("--target: `{}` is not IP:PORT", s.value))?;
                if !addr.ip().is_loopback() {
                    return Err("--target must be a loopback address".into());
                }
                self.target = Some(addr);
            }
            "target-pid" => {
                self.target_pid = u32::try_from(s.num()?)
                    .map_err(|_| format!("--target-pid: `{}` is not a PID", s.value))?
            }
            "echo-webhooks" => self.echo_webhooks = s.truthy(),
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn check(&self) -> Result<(), String> {
        if self.runs == 0
            || self.conversations == 0
            || self.connections == 0
            || self.batch == 0
            || self.outbox_concurrency == 0
        {
            return Err(
                "runs, conversations, connections, batch and outbox-concurrency must be at least 1"
                    .into(),
            );
        }
        if self.batch > 1_000 || self.outbox_concurrency > 1_024 {
            return Err("batch must be at most 1000 and outbox-concurrency at most 1024".into());
        }
        if self.rate <= 0.0 || self.search_from <= 0.0 || self.resolution <= 0.0 {
            return Err("rate, search-from and resolution must be positive".into());
        }
        if self.duration.is_zero() || self.search_duration.is_zero() {
            return Err("duration and search-duration must be positive".into());
        }
        if self.pg.enabled() && self.target.is_some() {
            return Err("--pg-url is for the daemon, not a peer (--target)".into());
        }
        self.pg.check()
    }
}

impl Options {
    /// The daemon's settings for every run (besides tokens, data dir, rules and upstream).
    fn daemon_settings(&self) -> Vec<(String, String)> {
        let mut env = Vec::new();
        for class in ["GLOBAL", "WRITE", "PARTNER_SEND", "NOTIFY"] {
            env.push((
                format!("HANDOFF_BRIDGE__UPSTREAM__LIMITS__{class}__PER_SECOND"),
                LIMIT_PER_SECOND.to_owned(),
            ));
            env.push((
                format!("HANDOFF_BRIDGE__UPSTREAM__LIMITS__{class}__BURST"),
                LIMIT_BURST.to_owned(),
            ));
        }
        env.push((
            "HANDOFF_BRIDGE__OUTBOX__CONCURRENCY".to_owned(),
            self.outbox_concurrency.to_string(),
        ));
        env.extend(self.common.daemon_env.iter().cloned());
        env
    }
}

// ---------------------------------------------------------------------------------------------
// Ids, seed, rule file

/// The run tag and the event number are in the event id (`common::write_event_id`), so a
/// journal entry's idempotency key (`{event id}/bench-echo/0`) leads back to the event.
fn event_prefix(run: u16) -> String {
    format!("3e5f{run:04x}-0000-4000-8000-")
}

/// Seeded conversation `c` (a different id block than the default seed's, which stays as is).
fn conversation_id(c: u64) -> String {
    format!("5c0e9b1f-3333-4d3e-9f10-{c:012x}")
}

fn end_user_id(c: u64) -> String {
    format!("4e6f0d0a-3333-4a5b-8c9d-{c:012x}")
}

/// The embedded default seed plus `conversations` clones of its first conversation, each with
/// a clone of that conversation's end user (new ids, a unique `userKey`, no last message).
fn write_seed(path: &Path, conversations: u64) -> Result<(), String> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/emulator-seed.json");
    let text =
        std::fs::read_to_string(&source).map_err(|e| format!("{}: {e}", source.display()))?;
    let mut seed: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", source.display()))?;
    let conv0 = seed
        .pointer("/conversations/0")
        .cloned()
        .ok_or("the default seed has no conversation")?;
    let eu0_id = conv0["endUserId"]
        .as_str()
        .ok_or("the seed's first conversation has no endUserId")?
        .to_owned();
    let eu0 = seed["endUsers"]
        .as_array()
        .and_then(|all| all.iter().find(|eu| eu["id"] == eu0_id.as_str()))
        .cloned()
        .ok_or("the seed's first conversation's end user is not in endUsers")?;
    let mut users = Vec::new();
    let mut convs = Vec::new();
    for c in 0..conversations {
        let (conv_id, eu_id, key) = (
            conversation_id(c),
            end_user_id(c),
            format!("bench-user-{c}"),
        );
        let mut eu = eu0.clone();
        let fields = eu.as_object_mut().ok_or("end user is not an object")?;
        fields.insert("id".into(), eu_id.clone().into());
        fields.insert("userKey".into(), key.clone().into());
        fields.insert("lastMessageId".into(), Value::Null);
        fields.insert("lastConversationId".into(), conv_id.clone().into());
        users.push(eu);
        let mut conv = conv0.clone();
        let fields = conv
            .as_object_mut()
            .ok_or("conversation is not an object")?;
        fields.insert("id".into(), conv_id.clone().into());
        fields.insert("endUserId".into(), eu_id.clone().into());
        if fields.contains_key("userKey") {
            fields.insert("userKey".into(), key.clone().into());
        }
        if let Some(ctx) = fields.get_mut("context").and_then(Value::as_object_mut) {
            ctx.insert("conversationId".into(), conv_id.into());
            ctx.insert("endUserId".into(), eu_id.into());
            if ctx.contains_key("userKey") {
                ctx.insert("userKey".into(), key.into());
            }
        }
        convs.push(conv);
    }
    seed["endUsers"]
        .as_array_mut()
        .ok_or("endUsers is not a list")?
        .extend(users);
    seed["conversations"]
        .as_array_mut()
        .ok_or("conversations is not a list")?
        .extend(convs);
    let text = serde_json::to_string(&seed).map_err(|e| e.to_string())?;
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// One rule, one action: every user message is echoed back through the Open API.
const RULE_FILE: &str = r#"# Written by benches/actions.rs.
[[rule]]
name = "bench-echo"
description = "Echo every user message: one send_message per event"
on = ["bot.message.received"]
when = { field = "sender", equals = "user" }
# Far more events per conversation than a person sends: out of the default firing cap's way.
max_firings = { count = 1000, per = "1s" }
actions = [ { type = "send_message", text = "echo {{ message.data.text }}" } ]
"#;

// ---------------------------------------------------------------------------------------------
// Deliveries built from the shared fixture

enum Piece {
    Text(String),
    Event,
    Message,
    Conversation,
    EndUser,
}

/// The scenario's fixture (`message-received-text.json` or `agent-call-requested.json`), compact,
/// with its ids cut out: every rendered event is a new one of the same type in a chosen seeded
/// conversation (wherever the fixture names its conversation or end user, the new ids go).
struct Template {
    /// `","webhookId":..,"webhookUrl":..,"messages":[` (follows the delivery id).
    envelope_tail: String,
    event: Vec<Piece>,
}

/// Every string of `value` equal to `from` becomes `to`.
fn replace_strings(value: &mut Value, from: &str, to: &str) {
    match value {
        Value::String(s) if s == from => *s = to.to_owned(),
        Value::Array(items) => items.iter_mut().for_each(|v| replace_strings(v, from, to)),
        Value::Object(fields) => fields
            .values_mut()
            .for_each(|v| replace_strings(v, from, to)),
        _ => {}
    }
}

fn load_template(scenario: Scenario) -> Result<Template, String> {
    let path = common::fixtures_dir().join(scenario.fixture());
    let delivery = common::read_fixture(&path)?;
    let envelope_tail = common::envelope_tail(&delivery);
    let mut event = delivery
        .pointer("/messages/0")
        .cloned()
        .ok_or_else(|| format!("{}: no messages[0]", path.display()))?;
    if event["event"] != scenario.event_type() {
        return Err(format!(
            "{}: messages[0] is not {}",
            path.display(),
            scenario.event_type()
        ));
    }
    event
        .as_object_mut()
        .ok_or("messages[0] is not an object")?
        .insert("id".into(), "@@E@@".into());
    let id_at = |pointers: &[&str]| {
        pointers
            .iter()
            .find_map(|p| event.pointer(p).and_then(Value::as_str))
            .map(str::to_owned)
    };
    let conversation = id_at(&["/data/message/conversationId", "/data/conversation/id"])
        .ok_or_else(|| format!("{}: no conversation id", path.display()))?;
    let end_user = id_at(&["/data/message/endUserId", "/data/conversation/endUserId"])
        .ok_or_else(|| format!("{}: no end user id", path.display()))?;
    let message = id_at(&["/data/message/id"]);
    replace_strings(&mut event, &conversation, "@@C@@");
    replace_strings(&mut event, &end_user, "@@U@@");
    if let Some(m) = message {
        replace_strings(&mut event, &m, "@@M@@");
    }
    let compact = serde_json::to_string(&event).map_err(|e| e.to_string())?;
    let pieces = compact
        .split("@@")
        .enumerate()
        .map(|(i, part)| match (i % 2, part) {
            (0, text) => Piece::Text(text.to_owned()),
            (_, "E") => Piece::Event,
            (_, "M") => Piece::Message,
            (_, "C") => Piece::Conversation,
            _ => Piece::EndUser,
        })
        .collect();
    Ok(Template {
        envelope_tail,
        event: pieces,
    })
}

// ---------------------------------------------------------------------------------------------
// Open-loop load generator: one thread, C keep-alive connections, a fixed schedule

/// What one run posts and when.
struct LoadPlan {
    template: Rc<Template>,
    run: u16,
    /// Events per second.
    rate: f64,
    batch: usize,
    conversations: u64,
    /// Deliveries posted in all (warm-up included).
    deliveries: u64,
    /// Deliveries due before this one are warm-up (not measured).
    first_measured: u64,
    /// Delivery 0 is due then.
    t0: Instant,
    window_start: Instant,
    window_end: Instant,
}

impl LoadPlan {
    fn due(&self, n: u64) -> Instant {
        self.t0 + Duration::from_secs_f64((n * self.batch as u64) as f64 / self.rate)
    }

    /// Render delivery `n` (events `n x batch ..`) into `out`.
    fn body(&self, n: u64, out: &mut String) {
        let run = self.run;
        common::start_delivery(out, run, n, &self.template.envelope_tail);
        for k in 0..self.batch as u64 {
            if k > 0 {
                out.push(',');
            }
            let e = n * self.batch as u64 + k;
            let c = e % self.conversations;
            for piece in &self.template.event {
                let _ = match piece {
                    Piece::Text(t) => {
                        out.push_str(t);
                        Ok(())
                    }
                    Piece::Event => {
                        common::write_event_id(out, run, e);
                        Ok(())
                    }
                    Piece::Message => {
                        common::write_message_id(out, run, e);
                        Ok(())
                    }
                    Piece::Conversation => write!(out, "{}", conversation_id(c)),
                    Piece::EndUser => write!(out, "{}", end_user_id(c)),
                };
            }
        }
        out.push_str("]}");
    }
}

/// One delivery as posted: Unix µs when the request was written and when its 200 came back.
#[derive(Clone, Copy, Default)]
struct Posted {
    sent_us: i64,
    acked_us: i64,
    /// 200 with `"status":"accepted"` and every event accepted.
    ok: bool,
}

struct LoadOutcome {
    /// Indexed by delivery number.
    posted: Vec<Posted>,
    errors: BTreeMap<String, u64>,
    /// Acknowledgment latency (write to 200) of measured deliveries, µs.
    ack: Histogram<u64>,
    /// Send time minus due time of measured deliveries, µs (the generator falling behind).
    lag: Histogram<u64>,
    /// Unix µs of the measured window.
    window_start_us: i64,
    window_end_us: i64,
    /// CPU seconds over the window: daemon, emulator, this process, everything else.
    cpu: Option<[f64; 4]>,
    /// The PostgreSQL server's CPU seconds over the window (the daemon on PostgreSQL).
    postgres_cpu: Option<f64>,
}

struct LoadState {
    plan: LoadPlan,
    next: Cell<u64>,
    out: RefCell<LoadOutcome>,
}

fn unix_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

fn run_load(
    daemon: SocketAddr,
    plan: LoadPlan,
    connections: usize,
    pids: (u32, u32),
    postmaster: Option<u32>,
) -> Result<LoadOutcome, String> {
    let hist = || common::histogram(600_000_000);
    // Instants to Unix time: both clocks read together once.
    let (inst0, unix0) = (Instant::now(), unix_us());
    let to_unix =
        |i: Instant| unix0 + i64::try_from(common::micros(i.duration_since(inst0))).unwrap_or(0);
    let out = LoadOutcome {
        posted: vec![Posted::default(); usize::try_from(plan.deliveries).unwrap_or(0)],
        errors: BTreeMap::new(),
        ack: hist()?,
        lag: hist()?,
        window_start_us: to_unix(plan.window_start),
        window_end_us: to_unix(plan.window_end),
        cpu: None,
        postgres_cpu: None,
    };
    let state = LoadState {
        plan,
        next: Cell::new(0),
        out: RefCell::new(out),
    };
    let target = Rc::new(Target::new(daemon));
    let state = common::run_local(state, |state| async move {
        // CPU over exactly the measured window.
        let sampler = common::sample_cpu(
            [pids.0, pids.1],
            postmaster,
            state.plan.window_start,
            state.plan.window_end,
        );
        common::run_workers(connections, || worker(state.clone(), target.clone())).await;
        let window = sampler.await.ok();
        let cpu = window.as_ref().and_then(|w| {
            let [daemon, emulator] = w.servers;
            Some([daemon?, emulator?, w.me?, w.other?])
        });
        let mut out = state.out.borrow_mut();
        out.cpu = cpu;
        out.postgres_cpu = window.and_then(|w| w.postgres);
    })?;
    Ok(state.out.into_inner())
}

async fn worker(state: Rc<LoadState>, target: Rc<Target>) {
    // Connect before the schedule starts, so the first requests do not pay for it.
    let mut conn: Option<Conn> = target.connect().await.ok();
    let mut body = String::with_capacity(4 * 1024);
    let mut request: Vec<u8> = Vec::with_capacity(4 * 1024);
    loop {
        let n = state.next.get();
        if n >= state.plan.deliveries {
            break;
        }
        state.next.set(n + 1);
        let due = state.plan.due(n);
        tokio::time::sleep_until(due.into()).await;
        state.plan.body(n, &mut body);
        target.request(&body, &mut request);
        if conn.is_none() {
            match target.connect().await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    state.error(e.to_string());
                    continue;
                }
            }
        }
        let Some(c) = conn.as_mut() else { continue };
        let lag = Instant::now().saturating_duration_since(due);
        let sent_us = unix_us();
        let outcome = c.send(&request).await;
        let acked_us = unix_us();
        if !matches!(&outcome, Ok(r) if !r.close) {
            conn = None;
        }
        state.record(n, lag, sent_us, acked_us, outcome);
    }
}

impl LoadState {
    fn error(&self, what: String) {
        *self.out.borrow_mut().errors.entry(what).or_default() += 1;
    }

    fn record(
        &self,
        n: u64,
        lag: Duration,
        sent_us: i64,
        acked_us: i64,
        outcome: Result<Response, String>,
    ) {
        let mut out = self.out.borrow_mut();
        let measured = n >= self.plan.first_measured;
        if measured {
            out.lag.saturating_record(common::micros(lag).max(1));
        }
        let batch = self.plan.batch as u64;
        match outcome {
            Ok(r) if r.status == 200 && r.receipt_status == "accepted" && r.accepted == batch => {
                if let Some(p) = usize::try_from(n).ok().and_then(|i| out.posted.get_mut(i)) {
                    *p = Posted {
                        sent_us,
                        acked_us,
                        ok: true,
                    };
                }
                if measured {
                    let us = u64::try_from(acked_us - sent_us).unwrap_or(0).max(1);
                    out.ack.saturating_record(us);
                }
            }
            Ok(r) => {
                *out.errors
                    .entry(format!(
                        "HTTP {} `{}` ({} of {batch} accepted)",
                        r.status, r.receipt_status, r.accepted
                    ))
                    .or_default() += 1
            }
            Err(e) => *out.errors.entry(e).or_default() += 1,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Processes

fn emulator_command(opts: &Options, seed: &Path) -> Command {
    let mut cmd = common::bin_command(&opts.common.bin);
    cmd.arg("emulator")
        .arg("--listen")
        .arg(format!("127.0.0.1:{}", opts.emulator_port))
        .arg("--seed")
        .arg(seed)
        .arg("--api-key")
        .arg(UPSTREAM_KEY);
    if opts.echo_webhooks {
        // The sender needs a URL to start; the daemon's port is known only once it runs, so the
        // real one is set through the bot's webhook settings (`point_webhook`) before any load.
        cmd.arg("--webhook-url")
            .arg("http://127.0.0.1:9/webhook/not-yet-set");
    }
    cmd
}

/// Point the emulator's webhook at the daemon or peer under test.
fn point_webhook(http: &Http, emulator: &str, target: SocketAddr) -> Result<(), String> {
    let body = serde_json::json!({ "url": format!("http://{target}/webhook/{WEBHOOK_TOKEN}") });
    let (status, answer) = http.post(
        &format!("{emulator}/_emulator/webhook/enable"),
        None,
        Some(&body.to_string()),
    )?;
    if status != 200 {
        return Err(format!(
            "/_emulator/webhook/enable answered {status}: {answer}"
        ));
    }
    Ok(())
}

/// Wait (bounded) until every webhook event the emulator emitted has been delivered.
fn wait_echoes(http: &Http, emulator: &str, limit: Duration) -> Result<bool, String> {
    let (status, body) = http.get(
        &format!(
            "{emulator}/_emulator/webhook/flushed?timeout_ms={}",
            limit.as_millis()
        ),
        None,
    )?;
    match status {
        200 => Ok(true),
        504 => Ok(false),
        other => Err(format!(
            "/_emulator/webhook/flushed answered {other}: {body}"
        )),
    }
}

fn daemon_command(
    opts: &Options,
    data_dir: &Path,
    rules: &Path,
    upstream: &str,
    db: Option<&PgDatabase>,
) -> Command {
    let mut cmd = common::daemon_command(&opts.common.bin, data_dir);
    if let Some(db) = db {
        cmd.env("HANDOFF_BRIDGE_STORE_URL", &db.url);
    }
    match opts.scenario {
        Scenario::Echo => {
            cmd.env("HANDOFF_BRIDGE__RULES__DIR", rules);
        }
        // The shipped set (rules.dir unset). Business hours off: otherwise the outcome would
        // depend on the hour of the run (closed: the after-hours rules answer instead).
        Scenario::Handoff => {
            cmd.env_remove("HANDOFF_BRIDGE__RULES__DIR").env(
                "HANDOFF_BRIDGE__RULES__SETTINGS__CHECK_BUSINESS_HOURS",
                "false",
            );
        }
    }
    cmd.env("HANDOFF_BRIDGE_UPSTREAM_URL", upstream)
        .env("HANDOFF_BRIDGE_UPSTREAM_API_KEY", UPSTREAM_KEY)
        .envs(opts.daemon_settings());
    cmd
}

// ---------------------------------------------------------------------------------------------
// Admin API, metrics, journal

/// The daemon's queue depths over time, read from /metrics every 250 ms on a thread of its own.
struct Sample {
    at: Instant,
    inbox: f64,
    outbox: f64,
}

fn start_sampler(base: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Vec<Sample>> {
    std::thread::spawn(move || {
        let http = Http::new(Duration::from_secs(2), BODY);
        let url = format!("{base}/metrics");
        let mut samples = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let at = Instant::now();
            if let Ok((200, text)) = http.get(&url, None) {
                samples.push(Sample {
                    at,
                    inbox: common::metric(&text, "handoff_inbox_depth").unwrap_or(0.0),
                    outbox: common::metric(&text, "handoff_outbox_depth").unwrap_or(0.0),
                });
            }
            std::thread::sleep(Duration::from_millis(250).saturating_sub(at.elapsed()));
        }
        samples
    })
}

/// Wait until the inbox is drained and then the outbox idle, within `limit`. Returns how long
/// it took, or `None` when the limit passed first.
fn wait_quiet(http: &Http, base: &str, limit: Duration) -> Result<Option<Duration>, String> {
    let t0 = Instant::now();
    for path in ["/admin/v1/inbox/drained", "/admin/v1/outbox/idle"] {
        loop {
            let left = limit.saturating_sub(t0.elapsed());
            if left.is_zero() {
                return Ok(None);
            }
            let ms = left.as_millis().clamp(1, 10_000);
            let (status, body) =
                http.get(&format!("{base}{path}?timeout_ms={ms}"), Some(ADMIN_TOKEN))?;
            match status {
                200 => break,
                504 => continue,
                other => return Err(format!("{path} answered {other}: {body}")),
            }
        }
    }
    Ok(Some(t0.elapsed()))
}

/// For a peer (no admin API): wait until the emulator's journal holds at least `expected` calls,
/// within `limit`, or until it stops growing for 5 s (calls that never come). Returns how long it
/// took, or `None` when it did not get there.
fn wait_journal(
    http: &Http,
    base: &str,
    expected: u64,
    limit: Duration,
) -> Result<Option<Duration>, String> {
    let t0 = Instant::now();
    let (mut seen, mut grew_at) = (0u64, Instant::now());
    while t0.elapsed() < limit && grew_at.elapsed() < Duration::from_secs(5) {
        let (status, body) = http.get(&format!("{base}/_emulator/journal"), None)?;
        if status != 200 {
            return Err(format!("journal answered {status}"));
        }
        let rows: Vec<serde::de::IgnoredAny> =
            serde_json::from_str(&body).map_err(|e| format!("journal: {e}"))?;
        let count = rows.len() as u64;
        if count >= expected {
            return Ok(Some(t0.elapsed()));
        }
        if count > seen {
            (seen, grew_at) = (count, Instant::now());
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(None)
}

/// The journal fields the bench reads (the rest, bodies and answers, is ignored).
#[derive(Deserialize)]
struct JournalRow {
    seq: u64,
    /// Unix ms when the emulator handled the call.
    at: i64,
    /// The same in µs (an emulator from before it: none, and `at`'s middle is taken).
    #[serde(default)]
    at_us: Option<i64>,
    idempotency_key: Option<String>,
    status: u16,
    replayed: bool,
}

// ---------------------------------------------------------------------------------------------
// One run: fresh emulator, fresh daemon, load, drain, journal, analysis

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Case {
    /// A step of the search for the maximum sustained rate.
    Search,
    /// The fixed rate (1,000 events/s).
    Fixed,
    /// The maximum sustained rate found by the search.
    Max,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Search => "search",
            Case::Fixed => "fixed",
            Case::Max => "max",
        }
    }
}

/// Files every run shares: the seed and the rule directory.
struct Inputs {
    template: Rc<Template>,
    seed: PathBuf,
    rules: PathBuf,
}

struct RunResult {
    case: Case,
    round: usize,
    target: f64,
    window: Duration,
    /// Events of the measured window whose delivery was accepted.
    posted: u64,
    /// `posted` over the window, or over the span until the last measured send when later.
    posted_rate: f64,
    errors: BTreeMap<String, u64>,
    lag_p99_ms: f64,
    ack_p50_ms: f64,
    ack_p99_ms: f64,
    /// Effective upstream calls (200, not replayed, ours) handled during the window.
    actions_in_window: u64,
    /// From the POST's write to the upstream call, µs, events of the measured window.
    latency: Histogram<u64>,
    /// From the 200 to the upstream call, µs.
    latency_from_ack: Histogram<u64>,
    /// Accepted events sent before the window's end whose action had not run by then.
    backlog_at_end: i64,
    /// From the window's end to the last action (any event), seconds.
    last_action_after: Option<f64>,
    /// Drain + idle reached within the limit, and how long after the last send.
    quiet_after: Option<Duration>,
    dead_letters: u64,
    /// Accepted events without an effective call in the journal.
    missing: u64,
    /// Effective calls for the same event more than once (must be 0).
    doubled: u64,
    /// Our calls the emulator answered with another status, or replayed.
    other_calls: u64,
    journal_overflow: bool,
    cpu: Option<[f64; 4]>,
    /// The PostgreSQL server's CPU seconds over the window (`None`: on sled, or a peer).
    postgres_cpu: Option<f64>,
    max_inbox: f64,
    max_outbox: f64,
    /// The daemon's own `handoff_action_latency_seconds` (event received -> upstream answered):
    /// mean over the whole run, ms.
    daemon_mean_ms: Option<f64>,
    /// Echo webhook deliveries answered 200 (`None`: echo webhooks off).
    echo_deliveries: Option<u64>,
    /// Warning and error lines of the daemon's and the emulator's logs.
    log_problems: Vec<String>,
    sustained: bool,
    why_not: Vec<String>,
}

impl RunResult {
    fn actions_per_s(&self) -> f64 {
        self.actions_in_window as f64 / self.window.as_secs_f64().max(1e-9)
    }
    /// CPU time over the window per event carried out in it, ms: the server (daemon or peer)
    /// and the emulator.
    fn cpu_ms_per_event(&self) -> Option<[f64; 2]> {
        let done = self.actions_in_window as f64;
        let c = self.cpu?;
        (done > 0.0).then(|| [c[0] * 1000.0 / done, c[1] * 1000.0 / done])
    }
    /// The PostgreSQL server's CPU over the window per event carried out in it, ms.
    fn postgres_ms_per_event(&self) -> Option<f64> {
        let done = self.actions_in_window as f64;
        let c = self.postgres_cpu?;
        (done > 0.0).then(|| c * 1000.0 / done)
    }
    fn ms(&self, q: f64) -> f64 {
        common::quantile_ms(&self.latency, q)
    }
    fn ack_ms(&self, q: f64) -> f64 {
        common::quantile_ms(&self.latency_from_ack, q)
    }
    fn max_ms(&self) -> f64 {
        common::max_ms(&self.latency)
    }
    fn errors_text(&self) -> String {
        common::errors_text(&self.errors)
    }
}

struct RunSpec {
    case: Case,
    round: usize,
    rate: f64,
    duration: Duration,
    drain_limit: Duration,
    run_tag: u16,
}

fn one_run(opts: &Options, inputs: &Inputs, spec: &RunSpec) -> Result<RunResult, String> {
    // Keep the run under the emulator's journal capacity.
    let mut duration = spec.duration;
    let calls = opts.scenario.calls() as f64;
    let budget = Duration::from_secs_f64(JOURNAL_BUDGET / calls / spec.rate);
    if opts.warmup + duration > budget {
        duration = budget
            .saturating_sub(opts.warmup)
            .max(Duration::from_secs(1));
        eprintln!(
            "  ({} events/s: window shortened to {:.1} s to stay within the emulator's journal)",
            spec.rate,
            duration.as_secs_f64()
        );
    }
    // The shipped `agent-requested` has the default firing cap (20 per 10 minutes per
    // conversation): more events per conversation would be capped, not slow.
    let planned = spec.rate * (opts.warmup + duration).as_secs_f64();
    if opts.scenario == Scenario::Handoff && planned > 20.0 * opts.conversations as f64 {
        return Err(format!(
            "{planned:.0} agent calls over {} conversations exceed the shipped rule's firing cap \
             (20 per conversation in 10 minutes): raise --conversations",
            opts.conversations
        ));
    }
    let dir = tempfile::Builder::new()
        .prefix("actions-bench-")
        .tempdir_in(&opts.common.data_root)
        .map_err(|e| e.to_string())?;
    let mut emulator = Proc::spawn(
        "emulator",
        emulator_command(opts, &inputs.seed),
        &dir.path().join("emulator.log"),
    )?;
    // A fresh database for the daemon on PostgreSQL, dropped after it stopped (declared first).
    let db = match opts.target {
        Some(_) => None,
        None => opts.pg.fresh(spec.case.name())?,
    };
    // No daemon when the webhooks go to a peer (`--target`).
    let mut daemon = match opts.target {
        Some(_) => None,
        None => Some(Proc::spawn(
            "daemon",
            daemon_command(
                opts,
                &dir.path().join("data"),
                &inputs.rules,
                &emulator.base(),
                db.as_ref(),
            ),
            &dir.path().join("daemon.log"),
        )?),
    };
    let (load_addr, load_pid) = match (&daemon, opts.target) {
        (Some(d), _) => (d.addr, d.pid),
        (None, Some(addr)) => (addr, opts.target_pid),
        (None, None) => return Err("neither a daemon nor a target".into()),
    };
    let http = Http::new(HTTP_TIMEOUT, BODY);
    if opts.echo_webhooks {
        point_webhook(&http, &emulator.base(), load_addr)?;
    }

    let batch = opts.batch as u64;
    let per_delivery = opts.batch as f64 / spec.rate;
    let deliveries_before = |d: Duration| (d.as_secs_f64() / per_delivery).ceil() as u64;
    let t0 = Instant::now() + Duration::from_millis(200);
    let plan = LoadPlan {
        template: inputs.template.clone(),
        run: spec.run_tag,
        rate: spec.rate,
        batch: opts.batch,
        conversations: opts.conversations,
        deliveries: deliveries_before(opts.warmup + duration),
        first_measured: deliveries_before(opts.warmup),
        t0,
        window_start: t0 + opts.warmup,
        window_end: t0 + opts.warmup + duration,
    };
    let (first_measured, deliveries) = (plan.first_measured, plan.deliveries);

    let stop = Arc::new(AtomicBool::new(false));
    let sampler = daemon
        .as_ref()
        .map(|d| start_sampler(d.admin_base(), stop.clone()));
    let postmaster = db.as_ref().and_then(|_| opts.pg.postmaster_pid());
    let load = run_load(
        load_addr,
        plan,
        opts.connections,
        (load_pid, emulator.pid),
        postmaster,
    );
    let quiet = match (&load, &daemon) {
        (Ok(_), Some(d)) => wait_quiet(&http, &d.admin_base(), spec.drain_limit),
        // A peer has no drain or idle wait: wait until the journal holds every expected call.
        (Ok(l), None) => {
            let accepted = l.posted.iter().filter(|p| p.ok).count() as u64;
            let expected = accepted * batch * opts.scenario.calls() as u64;
            wait_journal(&http, &emulator.base(), expected, spec.drain_limit)
        }
        (Err(_), _) => Ok(None),
    };
    // The echoes of the last calls are still on their way (the sender batches over 50 ms): the
    // run ends when they are delivered and, for the daemon, folded. An error stays a value, as
    // above: the sampler is stopped below whatever happened.
    let echoes_in = |took: Duration| -> Result<Option<Duration>, String> {
        let t0 = Instant::now();
        if !wait_echoes(&http, &emulator.base(), spec.drain_limit)? {
            eprintln!("  the emulator's webhook events not all delivered in time");
        }
        let folded = match &daemon {
            Some(d) => wait_quiet(&http, &d.admin_base(), spec.drain_limit)?.is_some(),
            None => true,
        };
        Ok(folded.then(|| took + t0.elapsed()))
    };
    let quiet = match (quiet, opts.echo_webhooks) {
        (Ok(Some(took)), true) => echoes_in(took),
        (other, _) => other,
    };
    let quiet_after = quiet.as_ref().ok().copied().flatten();
    stop.store(true, Ordering::Relaxed);
    let samples = sampler
        .map(|s| s.join().unwrap_or_default())
        .unwrap_or_default();
    let load = load?;
    let quiet = quiet?;
    if quiet.is_none() {
        eprintln!(
            "  not quiet within {:.0} s of the window's end (reading what was done)",
            spec.drain_limit.as_secs_f64()
        );
    }

    let (metrics_text, dead_letters) = match &daemon {
        Some(d) => {
            let (_, metrics_text) = http.get(&format!("{}/metrics", d.admin_base()), None)?;
            let (status, dead_body) = http.get(
                &format!("{}/admin/v1/dead-letters", d.admin_base()),
                Some(ADMIN_TOKEN),
            )?;
            if status != 200 {
                return Err(format!("dead letters answered {status}: {dead_body}"));
            }
            let dead: Value = serde_json::from_str(&dead_body).map_err(|e| e.to_string())?;
            (metrics_text, dead["count"].as_u64().unwrap_or(0))
        }
        None => (String::new(), 0),
    };
    // Deliveries of the emulator's webhook events answered 200 (the echoes' batches).
    let echo_deliveries = if opts.echo_webhooks {
        let (status, body) = http.get(&format!("{}/_emulator/webhook", emulator.base()), None)?;
        if status != 200 {
            return Err(format!("/_emulator/webhook answered {status}: {body}"));
        }
        let webhook: Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
        webhook["delivered"].as_u64()
    } else {
        None
    };
    let (status, journal_body) =
        http.get(&format!("{}/_emulator/journal", emulator.base()), None)?;
    if status != 200 {
        return Err(format!("journal answered {status}"));
    }
    let journal: Vec<JournalRow> =
        serde_json::from_str(&journal_body).map_err(|e| format!("journal: {e}"))?;
    drop(journal_body);
    if let Some(d) = daemon.as_mut() {
        let (_, daemon_status) = d.stop(STOP_POLL)?;
        if !daemon_status.success() {
            eprintln!(
                "  daemon exited with {daemon_status}; log:\n{}",
                common::tail(&d.log, 10)
            );
        }
    }
    emulator.stop(STOP_POLL)?;
    let log_problems = daemon
        .iter()
        .map(|d| &d.log)
        .chain([&emulator.log])
        .flat_map(|log| {
            let name = log.file_name().map(|n| n.to_string_lossy().into_owned());
            std::fs::read_to_string(log)
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
                .map(|l| format!("{}: {l}", name.clone().unwrap_or_default()))
                .collect::<Vec<_>>()
        })
        .collect::<Vec<_>>();

    // ---- analysis
    let total_events = usize::try_from(deliveries * batch).map_err(|_| "too many events")?;
    // Unix µs of each effective call (event x call index), if any; an event is done when all its
    // calls are, at the last one.
    let calls = opts.scenario.calls();
    let mut call_at: Vec<Option<i64>> = vec![None; total_events * calls];
    let prefix = event_prefix(spec.run_tag);
    let rule_part = format!("/{}/", opts.scenario.rule());
    let (mut doubled, mut other_calls) = (0u64, 0u64);
    let journal_overflow = journal.first().is_some_and(|r| r.seq != 1);
    let mut last_at = None::<i64>;
    for row in &journal {
        let Some(slot) = row
            .idempotency_key
            .as_deref()
            .and_then(|k| k.strip_prefix(prefix.as_str()))
            .and_then(|k| k.split_once(rule_part.as_str()))
            .and_then(|(hex, index)| {
                let e = usize::try_from(u64::from_str_radix(hex, 16).ok()?).ok()?;
                let i = index.parse::<usize>().ok()?;
                (e < total_events && i < calls).then_some(e * calls + i)
            })
        else {
            other_calls += 1;
            continue;
        };
        if row.status != 200 || row.replayed {
            other_calls += 1;
            continue;
        }
        match &mut call_at[slot] {
            Some(_) => doubled += 1,
            // Without µs, the call happened somewhere in millisecond `at`: take its middle.
            free => *free = Some(row.at_us.unwrap_or(row.at * 1000 + 500)),
        }
        last_at = Some(last_at.map_or(row.at, |l: i64| l.max(row.at)));
    }
    let done_at: Vec<Option<i64>> = call_at
        .chunks(calls)
        .map(|c| c.iter().try_fold(i64::MIN, |m, at| at.map(|a| m.max(a))))
        .collect();
    let hist = || common::histogram(600_000_000);
    let (mut latency, mut latency_from_ack) = (hist()?, hist()?);
    let (win_start_us, win_end_us) = (load.window_start_us, load.window_end_us);
    let win_end_ms = win_end_us / 1000;
    // `measured`: accepted events of the window; `missing`: accepted events (warm-up included)
    // without an effective call.
    let (mut measured, mut missing, mut backlog_at_end) = (0u64, 0u64, 0i64);
    let mut last_measured_send = load.window_start_us;
    for (e, done) in done_at.iter().enumerate() {
        let n = e as u64 / batch;
        let Some(p) = usize::try_from(n).ok().and_then(|i| load.posted.get(i)) else {
            continue;
        };
        if !p.ok {
            continue;
        }
        let done_by_end = matches!(done, Some(at) if *at < win_end_us);
        if p.sent_us < load.window_end_us && !done_by_end {
            backlog_at_end += 1;
        }
        if done.is_none() {
            missing += 1;
        }
        if n < first_measured {
            continue;
        }
        measured += 1;
        last_measured_send = last_measured_send.max(p.sent_us);
        if let Some(at_us) = *done {
            latency.saturating_record(u64::try_from(at_us - p.sent_us).unwrap_or(0).max(1));
            latency_from_ack
                .saturating_record(u64::try_from(at_us - p.acked_us).unwrap_or(0).max(1));
        }
    }
    let actions_in_window = done_at
        .iter()
        .flatten()
        .filter(|&&at| at >= win_start_us && at < win_end_us)
        .count() as u64;
    let span = Duration::from_micros(
        u64::try_from(last_measured_send - load.window_start_us).unwrap_or(0),
    )
    .max(duration);
    let posted_rate = measured as f64 / span.as_secs_f64();
    let in_window = |s: &&Sample| s.at <= t0 + opts.warmup + duration;
    let max_inbox = samples
        .iter()
        .filter(in_window)
        .map(|s| s.inbox)
        .fold(0.0, f64::max);
    let max_outbox = samples
        .iter()
        .filter(in_window)
        .map(|s| s.outbox)
        .fold(0.0, f64::max);
    let daemon_mean_ms = match (
        common::metric(&metrics_text, "handoff_action_latency_seconds_sum"),
        common::metric(&metrics_text, "handoff_action_latency_seconds_count"),
    ) {
        (Some(sum), Some(count)) if count > 0.0 => Some(sum * 1000.0 / count),
        _ => None,
    };

    let mut result = RunResult {
        case: spec.case,
        round: spec.round,
        target: spec.rate,
        window: duration,
        posted: measured,
        posted_rate,
        errors: load.errors,
        lag_p99_ms: common::quantile_ms(&load.lag, 0.99),
        ack_p50_ms: common::quantile_ms(&load.ack, 0.5),
        ack_p99_ms: common::quantile_ms(&load.ack, 0.99),
        actions_in_window,
        latency,
        latency_from_ack,
        backlog_at_end,
        last_action_after: last_at.map(|at| (at - win_end_ms) as f64 / 1000.0),
        quiet_after,
        dead_letters,
        missing,
        doubled,
        other_calls,
        journal_overflow,
        cpu: load.cpu,
        postgres_cpu: load.postgres_cpu,
        max_inbox,
        max_outbox,
        daemon_mean_ms,
        echo_deliveries,
        log_problems,
        sustained: false,
        why_not: Vec::new(),
    };
    judge(opts, &mut result);
    Ok(result)
}

/// A run is sustained when the daemon kept up with the target rate for the whole window.
fn judge(opts: &Options, r: &mut RunResult) {
    let mut why = Vec::new();
    if !r.errors.is_empty() {
        why.push(format!("webhook errors: {}", r.errors_text()));
    }
    if r.lag_p99_ms > MAX_LAG_P99.as_secs_f64() * 1000.0 || r.posted_rate < 0.97 * r.target {
        why.push(format!(
            "generator behind schedule (posted {:.0}/s, lag p99 {:.1} ms)",
            r.posted_rate, r.lag_p99_ms
        ));
    }
    if r.dead_letters > 0 {
        why.push(format!("{} dead letters", r.dead_letters));
    }
    if r.echo_deliveries == Some(0) && r.posted > 0 {
        why.push("echo webhooks on, but none delivered".into());
    }
    if r.missing > 0 {
        why.push(if r.quiet_after.is_some() {
            format!("{} actions MISSING after drain + idle", r.missing)
        } else {
            format!("{} actions not done within the drain limit", r.missing)
        });
    }
    if r.doubled > 0 {
        why.push(format!("{} actions carried out twice", r.doubled));
    }
    if r.journal_overflow {
        why.push("journal overflowed (entries evicted)".into());
    }
    if r.actions_per_s() < 0.95 * r.target {
        why.push(format!(
            "{:.0} actions/s < 95% of {:.0} events/s",
            r.actions_per_s(),
            r.target
        ));
    }
    let bound = opts.p99_bound.as_secs_f64() * 1000.0;
    if r.ms(0.99) > bound {
        why.push(format!("p99 {:.0} ms > {bound:.0} ms", r.ms(0.99)));
    }
    r.sustained = why.is_empty();
    r.why_not = why;
}

fn progress(r: &RunResult) {
    eprintln!(
        "[{} {}] target {:>6.0} ev/s: posted {} events, {:>6.0}/s, actions {:>6.0}/s, latency p50 {:.1} ms p99 {:.1} ms max {:.1} ms, ack p99 {:.1} ms, backlog at end {}, dead {}, missing {}, max outbox {:.0}, max inbox {:.0}, echo deliveries {}, CPU ms per event: server {} -> {}",
        r.case.name(),
        r.round,
        r.target,
        r.posted,
        r.posted_rate,
        r.actions_per_s(),
        r.ms(0.5),
        r.ms(0.99),
        r.max_ms(),
        r.ack_p99_ms,
        r.backlog_at_end,
        r.dead_letters,
        r.missing,
        r.max_outbox,
        r.max_inbox,
        r.echo_deliveries
            .map_or("off".to_owned(), |n| n.to_string()),
        r.cpu_ms_per_event()
            .map_or("n/a".to_owned(), |[server, _]| format!("{server:.2}"))
            + &r
                .postgres_ms_per_event()
                .map_or(String::new(), |p| format!(" + postgres {p:.2}")),
        if r.sustained {
            "sustained".to_owned()
        } else {
            format!("NOT sustained: {}", r.why_not.join("; "))
        }
    );
}

// ---------------------------------------------------------------------------------------------
// The benchmark

fn run(opts: &Options) -> Result<(), String> {
    opts.common.check()?;
    let shared = tempfile::Builder::new()
        .prefix("actions-bench-inputs-")
        .tempdir_in(&opts.common.data_root)
        .map_err(|e| e.to_string())?;
    let seed = shared.path().join("seed.json");
    write_seed(&seed, opts.conversations)?;
    let rules = shared.path().join("rules");
    std::fs::create_dir_all(&rules).map_err(|e| e.to_string())?;
    std::fs::write(rules.join("bench.toml"), RULE_FILE).map_err(|e| e.to_string())?;
    let inputs = Inputs {
        template: Rc::new(load_template(opts.scenario)?),
        seed,
        rules,
    };
    let mut machine = common::machine_info(&opts.common.data_root, false);
    if let Some(store) = opts.pg.describe() {
        machine.push(("store".into(), store));
    }
    eprintln!(
        "actions bench: daemon {}, {} seeded conversations, data under {}",
        opts.common.bin.display(),
        opts.conversations,
        opts.common.data_root.display()
    );
    for (k, v) in &machine {
        eprintln!("  {k}: {v}");
    }
    let started = Instant::now();
    let mut run_tag: u16 = 0;
    let mut next_tag = || {
        run_tag = run_tag.wrapping_add(1);
        run_tag
    };

    // Search: double from `search_from` until a step fails (or halve until one passes), then
    // bisect between the highest pass and the lowest failure.
    let mut steps: Vec<RunResult> = Vec::new();
    let mut max_rate = (opts.max_rate > 0.0).then_some(opts.max_rate);
    if opts.max_case && max_rate.is_none() {
        let mut step = |rate: f64, steps: &mut Vec<RunResult>| -> Result<bool, String> {
            let spec = RunSpec {
                case: Case::Search,
                round: steps.len() + 1,
                rate,
                duration: opts.search_duration,
                drain_limit: opts.search_drain_limit,
                run_tag: next_tag(),
            };
            let r = one_run(opts, &inputs, &spec)?;
            progress(&r);
            let ok = r.sustained;
            steps.push(r);
            Ok(ok)
        };
        let (mut pass, mut fail): (Option<f64>, Option<f64>) = (None, None);
        let mut rate = opts.search_from;
        loop {
            if step(rate, &mut steps)? {
                pass = Some(rate);
                if fail.is_some() || rate * 2.0 > opts.search_limit {
                    break;
                }
                rate *= 2.0;
            } else {
                fail = Some(rate);
                if pass.is_some() || rate / 2.0 < opts.resolution {
                    break;
                }
                rate /= 2.0;
            }
        }
        if let (Some(mut lo), Some(mut hi)) = (pass, fail) {
            while hi - lo > opts.resolution {
                let mid = ((lo + hi) / 2.0 / 50.0).round() * 50.0;
                if mid <= lo || mid >= hi {
                    break;
                }
                if step(mid, &mut steps)? {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            pass = Some(lo);
        }
        max_rate = pass;
        match pass {
            Some(r) => eprintln!("search: highest sustained step {r:.0} events/s"),
            None => eprintln!("search: no step was sustained"),
        }
    }

    // Measured rounds, alternating the fixed and the max case (the order flips every round).
    let mut results: Vec<RunResult> = Vec::new();
    for round in 1..=opts.runs {
        let mut order = vec![(Case::Fixed, opts.rate)];
        if let (true, Some(r)) = (opts.max_case, max_rate) {
            order.push((Case::Max, r));
        }
        if round % 2 == 0 {
            order.reverse();
        }
        for (case, rate) in order {
            let spec = RunSpec {
                case,
                round,
                rate,
                duration: opts.duration,
                drain_limit: opts.drain_limit,
                run_tag: next_tag(),
            };
            let r = one_run(opts, &inputs, &spec)?;
            progress(&r);
            results.push(r);
        }
    }
    let elapsed = started.elapsed();

    let report = report(opts, &machine, &steps, max_rate, &results, elapsed);
    common::publish(&report, &opts.common.out)?;
    common::publish_json(
        &json_results(opts, max_rate, &results),
        opts.common.json.as_deref(),
    )?;
    eprintln!(
        "report written to {} ({:.0} s in all)",
        opts.common.out.display(),
        elapsed.as_secs_f64()
    );
    // A defect, not a slow machine: fail the bench (and CI) on lost or repeated actions, and on
    // refused webhooks outside the search (whose failing steps overload the daemon on purpose).
    let broken: Vec<&RunResult> = steps
        .iter()
        .chain(&results)
        .filter(|r| {
            r.dead_letters > 0
                || r.doubled > 0
                || (r.missing > 0 && r.quiet_after.is_some())
                || (r.case != Case::Search && !r.errors.is_empty())
        })
        .collect();
    if !broken.is_empty() {
        return Err(format!(
            "{} run(s) lost, repeated or refused events/actions (see the report)",
            broken.len()
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Report

/// The figures `benches/run` tabulates: per measured run, events carried out per second (all
/// their upstream calls done) and the latency to the last call.
fn json_results(opts: &Options, max_rate: Option<f64>, results: &[RunResult]) -> Value {
    let runs: Vec<Value> = results
        .iter()
        .map(|x| {
            serde_json::json!({
                "case": x.case.name(),
                "round": x.round,
                "target_per_s": x.target,
                "posted_per_s": x.posted_rate,
                "done_per_s": x.actions_per_s(),
                "p50_ms": x.ms(0.5),
                "p99_ms": x.ms(0.99),
                "p999_ms": x.ms(0.999),
                "max_ms": x.max_ms(),
                "ack_p99_ms": x.ack_p99_ms,
                "sustained": x.sustained,
                "why_not": x.why_not,
                "missing": x.missing,
                "doubled": x.doubled,
                "dead_letters": x.dead_letters,
                "echo_deliveries": x.echo_deliveries,
                "errors": x.errors.values().sum::<u64>(),
                "cpu_share": cpu_share_json(x),
                "cpu_ms_per_event": cpu_per_event_json(x),
            })
        })
        .collect();
    serde_json::json!({
        "bench": "actions",
        "scenario": opts.scenario.name(),
        "calls_per_event": opts.scenario.calls(),
        "target": opts.target.map(|a| a.to_string()),
        "echo_webhooks": opts.echo_webhooks,
        "max_rate": max_rate,
        "runs": runs,
    })
}

/// Each process's share of one core over the window.
fn cpu_share_json(x: &RunResult) -> Option<Value> {
    let w = x.window.as_secs_f64().max(1e-9);
    x.cpu.map(|c| {
        serde_json::json!({ "server": c[0] / w, "emulator": c[1] / w, "bench": c[2] / w,
            "other": c[3] / w, "postgres": x.postgres_cpu.map(|p| p / w) })
    })
}

/// CPU time over the window per event carried out in it (ms): the daemon or peer, the emulator,
/// and on PostgreSQL the server's processes and the daemon's and theirs together.
fn cpu_per_event_json(x: &RunResult) -> Option<Value> {
    let pg = x.postgres_ms_per_event();
    x.cpu_ms_per_event().map(|[server, emulator]| {
        serde_json::json!({ "server": server, "emulator": emulator, "postgres": pg,
            "server_and_postgres": pg.map(|p| server + p) })
    })
}

fn run_table(r: &mut String, runs: &[RunResult]) {
    let _ = writeln!(
        r,
        "| case | # | target ev/s | window s | posted ev/s | **actions/s** | p50 ms | **p99 ms** | max ms | p50 / p99 from 200 ms | webhook ack p50 / p99 ms | backlog at end | last action after s | max inbox | max outbox | dead | missing | daemon / emulator / bench / other CPU (postgres) | sustained |"
    );
    let _ = writeln!(
        r,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
    );
    for x in runs {
        let cpu = x.cpu.map_or("n/a".into(), |c| {
            let w = x.window.as_secs_f64().max(1e-9);
            format!(
                "{:.0}% / {:.0}% / {:.0}% / {:.0}%",
                100.0 * c[0] / w,
                100.0 * c[1] / w,
                100.0 * c[2] / w,
                100.0 * c[3] / w
            ) + &x
                .postgres_cpu
                .map_or(String::new(), |p| format!(" ({:.0}%)", 100.0 * p / w))
        });
        let _ = writeln!(
            r,
            "| {} | {} | {:.0} | {:.1} | {:.0} | **{:.0}** | {:.1} | **{:.1}** | {:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {} | {} | {:.0} | {:.0} | {} | {} | {cpu} | {} |",
            x.case.name(),
            x.round,
            x.target,
            x.window.as_secs_f64(),
            x.posted_rate,
            x.actions_per_s(),
            x.ms(0.5),
            x.ms(0.99),
            x.max_ms(),
            x.ack_ms(0.5),
            x.ack_ms(0.99),
            x.ack_p50_ms,
            x.ack_p99_ms,
            x.backlog_at_end,
            x.last_action_after.map_or("n/a".into(), |s| format!("{s:.2}")),
            x.max_inbox,
            x.max_outbox,
            x.dead_letters,
            x.missing,
            if x.sustained {
                "yes".to_owned()
            } else {
                format!("**no**: {}", x.why_not.join("; "))
            }
        );
    }
}

fn report(
    opts: &Options,
    machine: &[(String, String)],
    steps: &[RunResult],
    max_rate: Option<f64>,
    results: &[RunResult],
    elapsed: Duration,
) -> String {
    let mut r = String::new();
    common::report_head(&mut r, "Actions", opts.quick, machine);
    let _ = writeln!(
        r,
        "\nDaemon: `{}` (git {}), upstream: a standalone `handoff-bridge emulator` per run (fresh, \
         seeded with {} extra conversations); {}. Store: {}. Daemon settings: {}. Load: open loop, {} connection(s), {} event(s) per \
         delivery, events spread round-robin over the {} conversations, {:.1} s warm-up before \
         each window. {}. Total time {:.0} s.\n",
        opts.common.bin.display(),
        common::git_head(),
        opts.conversations,
        match (opts.target, opts.scenario) {
            (Some(addr), _) => format!(
                "**no daemon**: the webhooks go to the peer at {addr}, which calls the same \
                 emulator; events: `{}`, {} upstream call(s) each (rule `{}`'s keys)",
                opts.scenario.event_type(),
                opts.scenario.calls(),
                opts.scenario.rule()
            ),
            (None, Scenario::Echo) => format!(
                "one rule (`{RULE_NAME}`: one `send_message` per user message)"
            ),
            (None, Scenario::Handoff) => "the shipped rules (business hours off): each \
                 `bot.conversation.agent_call_requested` makes `agent-requested`'s 2 upstream \
                 calls, `set_manual` and `send_message`; an event counts as done at the last"
                .to_owned(),
        },
        match (opts.target, opts.pg.enabled()) {
            (Some(_), _) => "the peer's own",
            (None, false) => "sled in a fresh data directory per run",
            (None, true) => {
                "PostgreSQL, a fresh database per run; its server's processes' CPU (the \
                 postmaster, its reaped children and every live child) in parentheses"
            }
        },
        opts.daemon_settings()
            .iter()
            .map(|(k, v)| format!("`{k}={v}`"))
            .collect::<Vec<_>>()
            .join(" "),
        opts.connections,
        opts.batch,
        opts.conversations,
        opts.warmup.as_secs_f64(),
        if opts.echo_webhooks {
            "Echo webhooks on: the emulator posts each message the bot sends back as \
             `bot.message.sent` (batched over 50 ms), as the service does; a run ends when they \
             are delivered (and, for the daemon, folded)"
        } else {
            "Echo webhooks off (`--echo-webhooks off`): the emulator sends no webhooks"
        },
        elapsed.as_secs_f64()
    );
    let _ = writeln!(
        r,
        "Latency: from the bench writing an event's POST to the emulator handling its upstream call \
         (journal `at_us`, Unix µs on the same clock), for the events of \
         the measured window; \"from 200\" starts when the acknowledgment came back instead. \
         actions/s: effective upstream calls (200, not replayed) handled during the window. \
         Backlog at end: accepted events sent before the window's end whose call had not happened \
         by then. Max inbox/outbox: the daemon's `handoff_inbox_depth` / `handoff_outbox_depth` \
         sampled every 250 ms during the load. CPU: share of one core over the window. A run is \
         sustained when every POST was accepted, the generator kept its schedule (lag p99 under \
         {} ms), no action is a dead letter, missing or repeated, actions/s >= 95% of the target \
         and p99 <= {} ms.\n",
        MAX_LAG_P99.as_millis(),
        opts.p99_bound.as_millis()
    );
    if !steps.is_empty() {
        let _ = writeln!(
            r,
            "### Search for the maximum sustained rate (one {:.0} s run per step)\n",
            opts.search_duration.as_secs_f64()
        );
        run_table(&mut r, steps);
        let _ = writeln!(
            r,
            "\nHighest sustained step: **{}**.\n",
            max_rate.map_or("none".into(), |m| format!("{m:.0} events/s"))
        );
    } else if let (true, Some(m)) = (opts.max_case, max_rate) {
        let _ = writeln!(r, "Max case rate given: {m:.0} events/s (no search).\n");
    }
    let _ = writeln!(r, "### Every measured run\n");
    run_table(&mut r, results);
    let _ = writeln!(
        r,
        "\n### Summary (min / median / max over {} run(s) per case)\n",
        opts.runs
    );
    let _ = writeln!(
        r,
        "| case | target events/s | actions/s | latency p50 ms | latency p99 ms | latency max ms | p99 from 200 ms | webhook ack p99 ms | daemon's own mean ms | sustained runs |"
    );
    let _ = writeln!(r, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for case in [Case::Fixed, Case::Max] {
        let runs: Vec<&RunResult> = results.iter().filter(|x| x.case == case).collect();
        let Some(first) = runs.first() else { continue };
        let pick = |f: &dyn Fn(&RunResult) -> f64| runs.iter().map(|x| f(x)).collect::<Vec<_>>();
        let _ = writeln!(
            r,
            "| {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} of {} |",
            case.name(),
            first.target,
            common::mmm(&pick(&|x| x.actions_per_s()), 0),
            common::mmm(&pick(&|x| x.ms(0.5)), 1),
            common::mmm(&pick(&|x| x.ms(0.99)), 1),
            common::mmm(&pick(&|x| x.max_ms()), 1),
            common::mmm(&pick(&|x| x.ack_ms(0.99)), 1),
            common::mmm(&pick(&|x| x.ack_p99_ms), 1),
            common::mmm(&pick(&|x| x.daemon_mean_ms.unwrap_or(f64::NAN)), 1),
            runs.iter().filter(|x| x.sustained).count(),
            runs.len()
        );
    }
    let problems: Vec<String> = steps
        .iter()
        .chain(results)
        .flat_map(|x| {
            x.log_problems
                .iter()
                .map(move |l| format!("{} {}: {l}", x.case.name(), x.round))
        })
        .collect();
    if !problems.is_empty() {
        let _ = writeln!(
            r,
            "\n{} warning/error line(s) in the daemon's and emulator's logs; the first ones:\n\n```",
            problems.len()
        );
        for line in problems.iter().take(10) {
            let _ = writeln!(r, "{line}");
        }
        let _ = writeln!(r, "```");
    }
    let others: u64 = steps.iter().chain(results).map(|x| x.other_calls).sum();
    let _ = writeln!(
        r,
        "\nUpstream calls other than the runs' effective actions (errors, replays, unknown keys): {others}."
    );
    r
}
