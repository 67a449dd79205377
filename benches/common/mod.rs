//! What the two benchmark harnesses, `benches/intake.rs` and `benches/actions.rs`, share: option
//! parsing, starting and stopping the processes under test (`setpriv --pdeathsig KILL`, the
//! `listening:` line), the load generators' minimal HTTP/1.1 keep-alive webhook client, CPU and
//! machine readings from /proc, admin/metrics GETs, HdrHistogram and markdown report helpers;
//! `pg`: a fresh PostgreSQL database per daemon and the server's CPU. One copy, so that the
//! benches start, load, measure and report in the same way.
//!
//! It lives in a subdirectory so that cargo does not take it for a bench target of its own; each
//! bench includes it with `mod common;`. Bench-specific code (load shapes, cases, reports) stays
//! in the benches.

use hdrhistogram::Histogram;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::future::Future;
use std::io::{BufRead, BufReader, Write as _};
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::rc::Rc;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

// The intake bench runs on sled only.
#[allow(dead_code)]
pub mod pg;

pub const WEBHOOK_TOKEN: &str = "bench-webhook-token-0123456789";
pub const ADMIN_TOKEN: &str = "bench-admin-token-0123456789";
/// Longest wait for a started process's `listening:` line.
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// Longest wait for a process to exit after SIGTERM (then SIGKILL).
const STOP_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest wait for a connection or for one webhook exchange of the load generator.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Timeout of every admin and metrics GET of the benches' main HTTP agents.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(90);

// ---------------------------------------------------------------------------------------------
// Options

/// How a bench reads its options: `--key value` (or `--key=value`) flags over `<PREFIX>_<KEY>`
/// environment variables.
pub struct OptionSpec {
    /// `intake`: the bench's name in messages.
    pub name: &'static str,
    /// `INTAKE_BENCH`: `--mem-batch` can also be given as `INTAKE_BENCH_MEM_BATCH`.
    pub env_prefix: &'static str,
    pub usage: &'static str,
    /// The bench's own options that take a value (the [`CommonOptions`] follow).
    pub keys: &'static [&'static str],
    /// A flag without a value that turns a boolean key off: (`--no-memory`, `memory`).
    pub off_flag: (&'static str, &'static str),
}

/// A bench's options: its full and quick defaults and its own settings.
pub trait BenchOptions: Sized {
    fn full() -> Self;
    fn quick() -> Self;
    fn common(&mut self) -> &mut CommonOptions;
    /// Apply one of the bench's own settings; `Ok(false)` when the key is not one of them.
    fn set(&mut self, setting: &Setting) -> Result<bool, String>;
    /// Whether the options, all settings applied, go together.
    fn check(&self) -> Result<(), String>;
}

/// The options both benches take: where the data and the report go, the daemon binary and its
/// extra environment.
#[derive(Clone, Debug)]
pub struct CommonOptions {
    pub data_root: PathBuf,
    pub out: PathBuf,
    pub bin: PathBuf,
    /// Extra environment for the daemon (tuning experiments), e.g.
    /// `HANDOFF_BRIDGE__DISPATCH__CONCURRENCY=4`.
    pub daemon_env: Vec<(String, String)>,
    /// Also write the results as JSON here (`benches/run` aggregates them into its table).
    pub json: Option<PathBuf>,
}

const COMMON_KEYS: &[&str] = &["data-root", "out", "bin", "daemon-env", "json"];

impl CommonOptions {
    /// Data directories under cargo's `target/tmp`, the report there as `report`, the daemon
    /// binary cargo built for the bench, no extra environment.
    pub fn new(report: &str) -> Self {
        let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        CommonOptions {
            out: tmp.join(report),
            data_root: tmp,
            bin: PathBuf::from(env!("CARGO_BIN_EXE_handoff-bridge")),
            daemon_env: Vec::new(),
            json: None,
        }
    }

    fn set(&mut self, s: &Setting) -> Result<bool, String> {
        match s.key.as_str() {
            "data-root" => self.data_root = PathBuf::from(&s.value),
            "out" => self.out = PathBuf::from(&s.value),
            "bin" => self.bin = PathBuf::from(&s.value),
            "daemon-env" => self.daemon_env.extend(s.pairs()?),
            "json" => self.json = Some(PathBuf::from(&s.value)),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The data root exists (it is created) and the daemon binary is there.
    pub fn check(&self) -> Result<(), String> {
        std::fs::create_dir_all(&self.data_root)
            .map_err(|e| format!("{}: {e}", self.data_root.display()))?;
        if !self.bin.is_file() {
            return Err(format!("daemon binary {} not found: build it with `cargo build --release --bin handoff-bridge` or pass --bin", self.bin.display()));
        }
        Ok(())
    }
}

/// One option as given, to be applied to the bench's options.
pub struct Setting {
    pub key: String,
    pub value: String,
}

fn truthy(v: &str) -> bool {
    !matches!(v, "" | "0" | "false" | "no" | "off")
}

impl OptionSpec {
    /// A bench's `main`: parse the options (the usage, or what is wrong with them, on stderr:
    /// exit 2) and `run` the bench (failure: exit 1).
    pub fn main<O: BenchOptions>(&self, args: &[String], run: fn(&O) -> Result<(), String>) {
        let opts: O = match self.parse(args) {
            Ok(o) => o,
            Err(msg) => {
                eprintln!("{msg}");
                std::process::exit(2);
            }
        };
        if let Err(e) = run(&opts) {
            eprintln!("{} bench failed: {e}", self.name);
            std::process::exit(1);
        }
    }

    /// The options: the quick defaults with `--quick` (or `<PREFIX>_QUICK`), else the full
    /// ones, then the environment's settings, then the flags' (flags win). `Err` holds the usage
    /// (for `--help`) or what is wrong with the arguments.
    fn parse<O: BenchOptions>(&self, args: &[String]) -> Result<O, String> {
        let (quick, settings) = self.read(args)?;
        let mut opts = if quick { O::quick() } else { O::full() };
        for s in &settings {
            if !opts.common().set(s)? && !opts.set(s)? {
                return Err(format!("unknown option --{}\n{}", s.key, self.usage));
            }
        }
        opts.check()?;
        Ok(opts)
    }

    /// Whether the run is a quick one, and the settings in the order they apply.
    fn read(&self, args: &[String]) -> Result<(bool, Vec<Setting>), String> {
        let env = |name: &str| {
            std::env::var(format!(
                "{}_{}",
                self.env_prefix,
                name.to_uppercase().replace('-', "_")
            ))
            .ok()
        };
        let usage = self.usage;
        let quick = args.iter().any(|a| a == "--quick") || env("quick").is_some_and(|v| truthy(&v));
        let mut settings: Vec<Setting> = self
            .keys
            .iter()
            .chain(COMMON_KEYS)
            .filter_map(|k| {
                env(k).map(|value| Setting {
                    key: (*k).to_owned(),
                    value,
                })
            })
            .collect();
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            match arg.as_str() {
                // cargo passes --bench to every bench binary.
                "--quick" | "--bench" => {}
                "--help" | "-h" => return Err(usage.to_owned()),
                flag if flag == self.off_flag.0 => settings.push(Setting {
                    key: self.off_flag.1.to_owned(),
                    value: "false".to_owned(),
                }),
                flag if flag.starts_with("--") => {
                    let (key, value) = match flag[2..].split_once('=') {
                        Some((n, v)) => (n.to_owned(), v.to_owned()),
                        None => {
                            let v = it
                                .next()
                                .ok_or_else(|| format!("{flag} needs a value\n{usage}"))?;
                            (flag[2..].to_owned(), v.clone())
                        }
                    };
                    settings.push(Setting { key, value });
                }
                other => return Err(format!("unexpected argument `{other}`\n{usage}")),
            }
        }
        Ok((quick, settings))
    }
}

impl Setting {
    /// The value as a boolean: anything but empty, `0`, `false` and `no` is true.
    pub fn truthy(&self) -> bool {
        truthy(&self.value)
    }

    pub fn num(&self) -> Result<u64, String> {
        self.value
            .parse::<u64>()
            .map_err(|_| format!("--{}: `{}` is not a whole number", self.key, self.value))
    }

    pub fn size(&self) -> Result<usize, String> {
        self.num()
            .and_then(|n| usize::try_from(n).map_err(|_| format!("--{}: too large", self.key)))
    }

    pub fn secs(&self) -> Result<Duration, String> {
        self.value
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| {
                format!(
                    "--{}: `{}` is not a number of seconds",
                    self.key, self.value
                )
            })
    }

    /// A `K=V[,K=V]` list (`--daemon-env`).
    pub fn pairs(&self) -> Result<Vec<(String, String)>, String> {
        self.value
            .split(',')
            .filter(|p| !p.is_empty())
            .map(|pair| {
                pair.split_once('=')
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .ok_or_else(|| format!("--{}: `{pair}` is not K=V", self.key))
            })
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Processes

/// A child process started here. Dropping it kills it (by its PID) if it still runs; it also gets
/// SIGKILL from the kernel if this process dies first.
pub struct Proc {
    name: String,
    child: Child,
    pub pid: u32,
    pub addr: SocketAddr,
    /// The daemon's admin listener (its `admin listening:` line), when it printed one.
    pub admin_addr: Option<SocketAddr>,
    pub log: PathBuf,
    /// From spawn to the daemon's `accepting webhooks:` line (an early start, before its store
    /// opened), when it printed one.
    pub accepting_after: Option<Duration>,
}

/// `cmd` run under `setpriv --pdeathsig KILL` when setpriv is installed. The wrapper starts from
/// an empty environment too: every command here is built by [`clean_command`], which clears it,
/// and `Command` cannot tell whether `env_clear` was called.
fn with_parent_death_signal(cmd: Command) -> Command {
    let setpriv = Path::new("/usr/bin/setpriv");
    if !setpriv.exists() {
        return cmd;
    }
    let mut wrapped = Command::new(setpriv);
    wrapped
        .env_clear()
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
    /// Start `cmd` (stderr to `log`) and wait (bounded) for its `listening: http://ADDR` line
    /// on stdout.
    pub fn spawn(name: &str, cmd: Command, log: &Path) -> Result<Proc, String> {
        Proc::spawn_timed(name, cmd, log).map(|(proc, _)| proc)
    }

    /// [`Proc::spawn`], also returning the time from spawn to the `listening:` line.
    pub fn spawn_timed(name: &str, cmd: Command, log: &Path) -> Result<(Proc, Duration), String> {
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
        // Reads the start lines (the admin one comes first), then keeps draining stdout until
        // the process exits.
        std::thread::spawn(move || {
            let mut admin = None;
            let mut accepting = None;
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.trim().starts_with("accepting webhooks: ") {
                    accepting = Some(Instant::now());
                }
                if let Some(rest) = line.trim().strip_prefix("admin listening: http://") {
                    admin = Some(rest.to_owned());
                }
                if let Some(rest) = line.trim().strip_prefix("listening: http://") {
                    let _ = tx.send((rest.to_owned(), admin.take(), Instant::now(), accepting));
                }
            }
        });
        let mut proc = Proc {
            name: name.to_owned(),
            child,
            pid,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin_addr: None,
            log: log.to_path_buf(),
            accepting_after: None,
        };
        match rx.recv_timeout(START_TIMEOUT) {
            Ok((addr, admin, at, accepting)) => {
                proc.accepting_after = accepting.map(|a| a.duration_since(t0));
                proc.addr = addr
                    .parse()
                    .map_err(|_| format!("{name}: bad listening address {addr}"))?;
                proc.admin_addr = match admin {
                    Some(a) => Some(
                        a.parse()
                            .map_err(|_| format!("{name}: bad admin address {a}"))?,
                    ),
                    None => None,
                };
                Ok((proc, at.duration_since(t0)))
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

    /// SIGTERM, then wait for the exit, checking every `poll` (SIGKILL after STOP_TIMEOUT).
    /// Returns how long it took.
    pub fn stop(&mut self, poll: Duration) -> Result<(Duration, ExitStatus), String> {
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
                Ok(None) if t0.elapsed() < STOP_TIMEOUT => std::thread::sleep(poll),
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

    pub fn base(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The admin API's and /metrics' base: the admin listener, or the public one when the
    /// daemon serves them there.
    pub fn admin_base(&self) -> String {
        format!("http://{}", self.admin_addr.unwrap_or(self.addr))
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

/// The last `lines` lines of a file (a log).
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `program` with an empty environment but for `PATH`.
pub fn clean_command(program: &Path) -> Command {
    let mut cmd = Command::new(program);
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default());
    cmd
}

/// The `handoff-bridge` binary `bin`, clean environment, logging warnings and errors only.
pub fn bin_command(bin: &Path) -> Command {
    let mut cmd = clean_command(bin);
    cmd.env("RUST_LOG", "warn");
    cmd
}

/// `bin serve` on a free port with the bench's tokens and `data_dir`; each bench adds its own
/// environment.
pub fn daemon_command(bin: &Path, data_dir: &Path) -> Command {
    let mut cmd = bin_command(bin);
    cmd.arg("serve")
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--admin-listen")
        .arg("127.0.0.1:0")
        .arg("--data-dir")
        .arg(data_dir)
        .env("HANDOFF_BRIDGE_WEBHOOK_TOKENS", WEBHOOK_TOKEN)
        .env("HANDOFF_BRIDGE_ADMIN_TOKEN", ADMIN_TOKEN);
    cmd
}

// ---------------------------------------------------------------------------------------------
// Load generator: one thread, keep-alive connections posting webhook deliveries

/// Run the load generator on one thread (a tokio current-thread runtime and a `LocalSet`):
/// `load` gets the shared state; once it is done, the state is handed back.
pub fn run_local<S, F, Fut>(state: S, load: F) -> Result<S, String>
where
    F: FnOnce(Rc<S>) -> Fut,
    Fut: Future<Output = ()>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let local = tokio::task::LocalSet::new();
    let state = Rc::new(state);
    local.block_on(&rt, load(state.clone()));
    drop(local);
    Rc::try_unwrap(state).map_err(|_| "load state still shared".to_owned())
}

/// Start `connections` tasks made by `worker` (inside [`run_local`]) and wait for them all.
pub async fn run_workers<Fut>(connections: usize, mut worker: impl FnMut() -> Fut)
where
    Fut: Future + 'static,
    Fut::Output: 'static,
{
    let workers: Vec<_> = (0..connections)
        .map(|_| tokio::task::spawn_local(worker()))
        .collect();
    for w in workers {
        let _ = w.await;
    }
}

/// Where the generator posts: the daemon's (or baseline's) webhook.
pub struct Target {
    addr: SocketAddr,
    head_prefix: String,
}

/// Why a connection could not be opened; displayed as the load stats count it.
pub enum ConnectError {
    Io(std::io::ErrorKind),
    Timeout,
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Io(kind) => write!(f, "connect: {kind}"),
            ConnectError::Timeout => f.write_str("connect timeout"),
        }
    }
}

impl Target {
    pub fn new(addr: SocketAddr) -> Self {
        let head_prefix = format!(
            "POST /webhook/{WEBHOOK_TOKEN} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nUser-Agent: CLOSER/webhook\r\nContent-Length: "
        );
        Target { addr, head_prefix }
    }

    /// The POST of `body` into `request`.
    pub fn request(&self, body: &str, request: &mut Vec<u8>) {
        request.clear();
        request.extend_from_slice(self.head_prefix.as_bytes());
        let _ = write!(request, "{}\r\n\r\n", body.len());
        request.extend_from_slice(body.as_bytes());
    }

    /// A new keep-alive connection, within REQUEST_TIMEOUT.
    pub async fn connect(&self) -> Result<Conn, ConnectError> {
        match tokio::time::timeout(REQUEST_TIMEOUT, Conn::open(self.addr)).await {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err(ConnectError::Io(e.kind())),
            Err(_) => Err(ConnectError::Timeout),
        }
    }
}

/// An answer to a webhook POST, as far as the benches read it.
pub struct Response {
    pub status: u16,
    /// The receipt's `status` field (`accepted`, `duplicate`, `quarantined`), or empty.
    pub receipt_status: String,
    /// The receipt's `accepted` field: events accepted.
    pub accepted: u64,
    /// The server closes the connection after it.
    pub close: bool,
}

/// A minimal HTTP/1.1 client connection: one request at a time, `Content-Length` bodies (what
/// actix sends for receipts).
pub struct Conn {
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

    /// Write `request` and read its answer, within REQUEST_TIMEOUT.
    pub async fn send(&mut self, request: &[u8]) -> Result<Response, String> {
        match tokio::time::timeout(REQUEST_TIMEOUT, self.exchange(request)).await {
            Ok(r) => r,
            Err(_) => Err("request timeout".to_owned()),
        }
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
            accepted: receipt_num(body, b"\"accepted\":").unwrap_or(0),
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
// Deliveries built from the shared webhook fixtures

/// The shared webhook fixtures (`../shared/fixtures/webhooks`).
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/webhooks")
}

/// A fixture delivery, parsed; it must not contain `@@`, the marker of the ids cut out of the
/// bench's event templates.
pub fn read_fixture(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if text.contains("@@") {
        return Err(format!(
            "{}: contains `@@`, which the templates use as a marker",
            path.display()
        ));
    }
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// `","webhookId":..,"webhookUrl":..,"messages":[` of a fixture delivery (what follows the
/// delivery id).
pub fn envelope_tail(delivery: &Value) -> String {
    let field = |k: &str| serde_json::to_string(&delivery[k]).unwrap_or_else(|_| "\"\"".into());
    format!(
        "\",\"webhookId\":{},\"webhookUrl\":{},\"messages\":[",
        field("webhookId"),
        field("webhookUrl")
    )
}

/// Start delivery `n` of run `run` in `out`: its id, then `envelope_tail`; the events follow.
pub fn start_delivery(out: &mut String, run: u16, n: u64, envelope_tail: &str) {
    out.clear();
    let _ = write!(out, "{{\"id\":\"1d0c{run:04x}-0000-4000-8000-{n:012x}");
    out.push_str(envelope_tail);
}

/// The id of event `e` of run `run` (the run tag keeps runs apart).
pub fn write_event_id(out: &mut String, run: u16, e: u64) {
    let _ = write!(out, "3e5f{run:04x}-0000-4000-8000-{e:012x}");
}

/// The id of the message of event `e` of run `run`.
pub fn write_message_id(out: &mut String, run: u16, e: u64) {
    let _ = write!(out, "6a1d{run:04x}-0000-4000-8000-{e:012x}");
}

// ---------------------------------------------------------------------------------------------
// CPU time from /proc

/// CPU time used so far by `N` server processes, by a PostgreSQL server (the postmaster and its
/// children: [`pg::server_cpu_seconds`]), by this process and by the whole machine.
pub struct CpuSample<const N: usize> {
    servers: [Option<f64>; N],
    postgres: Option<f64>,
    me: Option<f64>,
    machine_busy: Option<f64>,
}

/// CPU seconds between two samples.
pub struct CpuWindow<const N: usize> {
    /// Each server process, in the order of the pids sampled.
    pub servers: [Option<f64>; N],
    /// The PostgreSQL server's processes, when one was sampled (not by the intake bench).
    #[allow(dead_code)]
    pub postgres: Option<f64>,
    /// This (generator) process.
    pub me: Option<f64>,
    /// Every other process of the machine (noise); known when all the others are.
    pub other: Option<f64>,
}

impl<const N: usize> CpuSample<N> {
    /// The CPU so far of `pids`, and of the PostgreSQL server of `postmaster` when given.
    pub fn take(pids: [u32; N], postmaster: Option<u32>) -> Self {
        CpuSample {
            servers: pids.map(|pid| cpu_seconds(Some(pid))),
            postgres: postmaster.and_then(pg::server_cpu_seconds),
            me: cpu_seconds(None),
            machine_busy: machine_busy_seconds(),
        }
    }

    /// The CPU seconds from `self` to `later`.
    pub fn window(&self, later: &Self) -> CpuWindow<N> {
        let delta = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(x, y)| y - x);
        let servers: [Option<f64>; N] =
            std::array::from_fn(|i| delta(self.servers[i], later.servers[i]));
        let postgres = delta(self.postgres, later.postgres);
        let me = delta(self.me, later.me);
        let busy = delta(self.machine_busy, later.machine_busy);
        let other = me.and_then(|me| rest_of_machine(busy, &servers, me + postgres.unwrap_or(0.0)));
        CpuWindow {
            servers,
            postgres,
            me,
            other,
        }
    }
}

/// The machine's busy time less the servers' and `counted` (this process's and PostgreSQL's),
/// never below 0.
fn rest_of_machine(busy: Option<f64>, servers: &[Option<f64>], counted: f64) -> Option<f64> {
    let mut rest = busy?;
    for server in servers {
        rest -= (*server)?;
    }
    Some((rest - counted).max(0.0))
}

/// Sample the CPU of `pids` (and of the PostgreSQL server of `postmaster`, when given) at
/// `start` and `end` (in [`run_local`]): the measured window.
pub fn sample_cpu<const N: usize>(
    pids: [u32; N],
    postmaster: Option<u32>,
    start: Instant,
    end: Instant,
) -> tokio::task::JoinHandle<CpuWindow<N>> {
    tokio::task::spawn_local(async move {
        tokio::time::sleep_until(start.into()).await;
        let a = CpuSample::take(pids, postmaster);
        tokio::time::sleep_until(end.into()).await;
        let b = CpuSample::take(pids, postmaster);
        a.window(&b)
    })
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

// ---------------------------------------------------------------------------------------------
// Admin API and metrics

/// How [`Http::get`] reads an answer's body.
#[derive(Clone, Copy)]
pub struct BodyRead {
    /// The most it reads, bytes.
    pub limit: u64,
    /// Broken UTF-8 reads as `?` (else it makes the body unreadable).
    pub lossy_utf8: bool,
    /// An unreadable (or too large) body is an error; otherwise it reads as empty.
    pub required: bool,
}

/// A blocking HTTP client for the daemon's admin API and /metrics (and the emulator's journal).
pub struct Http {
    agent: ureq::Agent,
    body: BodyRead,
}

impl Http {
    pub fn new(timeout: Duration, body: BodyRead) -> Self {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(timeout))
            .build()
            .into();
        Http { agent, body }
    }

    /// GET with an optional bearer token: the status and the body.
    pub fn get(&self, url: &str, bearer: Option<&str>) -> Result<(u16, String), String> {
        let mut req = self.agent.get(url);
        if let Some(token) = bearer {
            req = req.header("authorization", format!("Bearer {token}"));
        }
        let resp = req.call().map_err(|e| format!("GET {url}: {e}"))?;
        let (status, body) = self.read(resp);
        let body = match body {
            Ok(body) => body,
            Err(e) if self.body.required => return Err(format!("GET {url}: body: {e}")),
            Err(_) => String::new(),
        };
        Ok((status, body))
    }

    /// An answer's status and its body, read as [`BodyRead`] says.
    fn read(
        &self,
        mut resp: ureq::http::Response<ureq::Body>,
    ) -> (u16, Result<String, ureq::Error>) {
        let status = resp.status().as_u16();
        let body = resp
            .body_mut()
            .with_config()
            .limit(self.body.limit)
            .lossy_utf8(self.body.lossy_utf8)
            .read_to_string();
        (status, body)
    }

    /// POST a JSON body (or an empty one) with an optional bearer token: the status and the body.
    #[allow(dead_code)] // scale and actions, not intake
    pub fn post(
        &self,
        url: &str,
        bearer: Option<&str>,
        json: Option<&str>,
    ) -> Result<(u16, String), String> {
        let mut req = self.agent.post(url);
        if let Some(token) = bearer {
            req = req.header("authorization", format!("Bearer {token}"));
        }
        let sent = match json {
            Some(body) => req.content_type("application/json").send(body),
            None => req.send_empty(),
        };
        let resp = sent.map_err(|e| format!("POST {url}: {e}"))?;
        let (status, body) = self.read(resp);
        Ok((status, body.unwrap_or_default()))
    }
}

/// Wait until the daemon's folds have caught up with everything it accepted
/// (`/admin/v1/inbox/drained`, long polls), until `limit` after `since`: how long after `since`
/// it drained, or `None` when it did not in time.
#[allow(dead_code)] // intake and scale, not actions
pub fn wait_drained(
    http: &Http,
    admin_base: &str,
    since: Instant,
    limit: Duration,
    what: &str,
) -> Result<Option<Duration>, String> {
    let url = format!("{admin_base}/admin/v1/inbox/drained?timeout_ms=30000");
    while since.elapsed() < limit {
        let (status, body) = http.get(&url, Some(ADMIN_TOKEN))?;
        match status {
            200 => return Ok(Some(since.elapsed())),
            504 => eprintln!(
                "[{what}] still draining after {:.0} s: {body}",
                since.elapsed().as_secs_f64()
            ),
            other => return Err(format!("drain wait answered {other}: {body}")),
        }
    }
    Ok(None)
}

/// A `/proc/<pid>/status` field in kB (VmRSS, VmHWM, RssAnon, RssFile).
#[allow(dead_code)] // intake and scale, not actions
pub fn proc_status_kb(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field).and_then(|r| r.strip_prefix(':')))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// (apparent bytes, allocated bytes) under a directory.
#[allow(dead_code)] // intake and scale, not actions
pub fn dir_size(path: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
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

/// Sum of every series of a metric in the Prometheus text format.
pub fn metric(text: &str, name: &str) -> Option<f64> {
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

// ---------------------------------------------------------------------------------------------
// Latency histograms and error counts

/// A latency histogram in microseconds, 1 µs to `max_us`, 3 significant digits.
pub fn histogram(max_us: u64) -> Result<Histogram<u64>, String> {
    Histogram::<u64>::new_with_bounds(1, max_us, 3).map_err(|e| e.to_string())
}

/// Quantile `q` of a histogram in µs, as milliseconds.
pub fn quantile_ms(hist: &Histogram<u64>, q: f64) -> f64 {
    hist.value_at_quantile(q) as f64 / 1000.0
}

/// The largest value of a histogram in µs, as milliseconds.
pub fn max_ms(hist: &Histogram<u64>) -> f64 {
    hist.max() as f64 / 1000.0
}

/// Whole microseconds of `d` (saturating).
pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Errors by kind, `N kind; N kind`, or `0`.
pub fn errors_text(errors: &BTreeMap<String, u64>) -> String {
    if errors.is_empty() {
        "0".into()
    } else {
        errors
            .iter()
            .map(|(k, v)| format!("{v} {k}"))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

// ---------------------------------------------------------------------------------------------
// Machine description

/// The machine the bench runs on, as (name, value) rows. With `describe_disk`, a row says which
/// disk the data root is on (and the sync probe row names no place); otherwise the sync probe
/// row says it was run in the data directory.
pub fn machine_info(data_root: &Path, describe_disk: bool) -> Vec<(String, String)> {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let field = |name: &str| {
        cpuinfo.lines().find_map(|l| {
            l.strip_prefix(name)
                .and_then(|r| r.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
    };
    let model = field("model name").unwrap_or_else(|| "unknown".into());
    let mhz = field("cpu MHz").unwrap_or_default();
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_kb = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    let disk = describe_disk.then(|| disk_description(data_root));
    let probe = fsync_probe(data_root)
        .map(|(p50, p99)| {
            format!("4 KiB write + fdatasync: p50 {p50:.2} ms, p99 {p99:.2} ms (200 samples)")
        })
        .unwrap_or_else(|e| format!("failed: {e}"));
    let mut rows = vec![
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
    ];
    match disk {
        Some(disk) => {
            rows.push(("disk (data dir)".into(), disk));
            rows.push(("disk sync latency".into(), probe));
        }
        None => rows.push(("disk sync latency (data dir)".into(), probe)),
    }
    rows.push((
        "kernel".into(),
        read("/proc/sys/kernel/osrelease").trim().to_owned(),
    ));
    rows
}

/// The device, kind, mount point, file system and mount flags `path` is on.
fn disk_description(path: &Path) -> String {
    let root = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
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
    match mount {
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
    }
}

/// The cost of one durable write on the data directory's disk (the floor of a group commit):
/// p50 and p99 of 200 4 KiB writes + fdatasync, ms.
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
// Markdown report

/// The report's title (`## {title} benchmark`, marked when quick) and the machine table.
pub fn report_head(r: &mut String, title: &str, quick: bool, machine: &[(String, String)]) {
    let _ = writeln!(
        r,
        "## {title} benchmark{}\n",
        if quick {
            " (quick smoke run: not a measurement)"
        } else {
            ""
        }
    );
    let _ = writeln!(r, "| machine | |\n|---|---|");
    for (k, v) in machine {
        let _ = writeln!(r, "| {k} | {v} |");
    }
}

/// Print the report on stdout and write it to `out`.
pub fn publish(report: &str, out: &Path) -> Result<(), String> {
    println!("{report}");
    write_file(out, report)
}

/// Write `results` as JSON to `--json FILE`, when given: the machine-readable form of the report,
/// which `benches/run` reads to build its table across benches and rounds.
pub fn publish_json(results: &serde_json::Value, out: Option<&Path>) -> Result<(), String> {
    let Some(out) = out else { return Ok(()) };
    let text = serde_json::to_string_pretty(results).map_err(|e| e.to_string())?;
    write_file(out, &text)
}

/// Write `text` to `out`, creating its directory.
fn write_file(out: &Path, text: &str) -> Result<(), String> {
    if let Some(dir) = out.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(out, text).map_err(|e| format!("{}: {e}", out.display()))
}

/// The commit the daemon was built from, as far as git knows (and whether src/ had changes).
pub fn git_head() -> String {
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

/// (min, median, max); NaNs when empty.
pub fn summary(values: &[f64]) -> (f64, f64, f64) {
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

/// `min / median / max` with `decimals` decimals.
pub fn mmm(values: &[f64], decimals: usize) -> String {
    let (a, b, c) = summary(values);
    format!("{a:.decimals$} / {b:.decimals$} / {c:.decimals$}")
}
