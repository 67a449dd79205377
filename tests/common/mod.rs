//! `TestApp`: start the daemon on random loopback ports with its own data directory, and talk to
//! it over HTTP. In the `it` binary (`crate::IN_PROCESS`) the application runs in this process,
//! on a thread and runtime of its own (`Application::build` and `run`); in `process`, and for a
//! test that asks for its own process, the real `handoff-bridge` binary runs as a child, killed
//! (by PID, via `Child`) when the `TestApp` is dropped. An app in process is stopped in order.

#![allow(dead_code)]

pub mod agent_api;
pub mod browser;
pub mod chatwoot;
pub mod cluster;
pub mod emulator;
pub mod forwarder;
pub mod helpdesk;
pub mod load;
pub mod pg_server;
pub mod relay;
pub mod tmpfs;

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Output, Stdio};
use std::time::Duration;

pub const WEBHOOK_TOKEN: &str = "test-webhook-token-0123456789";
pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789";

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_handoff-bridge")
}

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/webhooks")
}

/// Every shared fixture: (file name, body), sorted by name.
pub fn fixtures() -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(fixtures_dir())
        .expect("shared fixtures")
        .map(|e| {
            let path = e.expect("entry").path();
            let name = path
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned();
            (name, std::fs::read(&path).expect("read fixture"))
        })
        .collect();
    out.sort();
    out
}

pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into()
}

pub struct TestApp {
    daemon: Daemon,
    /// The public listener (webhook, agent API, probes).
    pub base: String,
    /// The admin listener (admin API, /metrics); reach it through [`TestApp::admin_url`].
    pub admin_base: String,
    pub webhook_url: String,
    /// The embedded emulator's base URL, when the upstream is embedded (the default).
    pub emulator_url: Option<String>,
    pub data_dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    pub agent: ureq::Agent,
}

/// Where the daemon runs: in this process (the application on a thread of its own, with its own
/// runtime), or as a child process of the real binary.
enum Daemon {
    InProcess(InProcess),
    Child {
        child: Child,
        log_path: PathBuf,
        _stdout: BufReader<ChildStdout>,
    },
}

/// An application running on its own thread until its stop is sent.
struct InProcess {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl InProcess {
    /// Stop it in order (as SIGTERM stops the binary) and wait; its result.
    fn stop(&mut self) -> Result<(), String> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.thread.take() {
            Some(thread) => thread
                .join()
                .unwrap_or_else(|_| Err("the app panicked".into())),
            None => Ok(()),
        }
    }
}

/// Options for starting the daemon.
#[derive(Default, Clone)]
pub struct Spawn {
    pub env: Vec<(String, String)>,
    pub args: Vec<String>,
    /// Run the real binary as a child process even in the in-process test binary: for a test
    /// that reads the daemon's log or measures its process.
    pub own_process: bool,
}

impl Spawn {
    /// Options with this environment, no extra arguments.
    pub fn with_env(env: &[(&str, &str)]) -> Spawn {
        Spawn {
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Spawn::default()
        }
    }

    /// The daemon's environment: the tokens the tests use, no rules unless the test gives some
    /// (its own directory, or the shipped set by turning rules on: most tests are about intake
    /// and state, and the shipped handoff would act), then the test's own.
    fn daemon_env(&self) -> Vec<(String, String)> {
        let mut env = vec![
            (
                "HANDOFF_BRIDGE_WEBHOOK_TOKENS".to_owned(),
                WEBHOOK_TOKEN.to_owned(),
            ),
            (
                "HANDOFF_BRIDGE_ADMIN_TOKEN".to_owned(),
                ADMIN_TOKEN.to_owned(),
            ),
        ];
        if !self
            .env
            .iter()
            .any(|(k, _)| k.starts_with("HANDOFF_BRIDGE__RULES__"))
        {
            env.push((
                "HANDOFF_BRIDGE__RULES__ENABLED".to_owned(),
                "false".to_owned(),
            ));
        }
        env.extend(self.env.iter().cloned());
        env
    }

    /// The admin listener on a free port too, unless the test chooses it (flags beat the
    /// environment, so the flag is left out then).
    fn admin_chosen(&self) -> bool {
        self.args.iter().any(|a| a.starts_with("--admin-listen"))
            || self.env.iter().any(|(k, _)| {
                k == "HANDOFF_BRIDGE_ADMIN_LISTEN" || k == "HANDOFF_BRIDGE__ADMIN__LISTEN"
            })
    }
}

impl TestApp {
    /// A daemon on a fresh data directory.
    pub fn spawn() -> TestApp {
        Self::spawn_with(Spawn::default())
    }

    /// A daemon with these options on a fresh data directory, removed when the app is dropped.
    pub fn spawn_with(opts: Spawn) -> TestApp {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("data");
        let mut app = Self::spawn_in(&dir, opts);
        app._tmp = Some(tmp);
        app
    }

    /// A daemon on `data_dir` (kept after the app is dropped: restart tests reuse it): in this
    /// process in the `it` binary (unless `opts.own_process`), the real binary in `process`.
    pub fn spawn_in(data_dir: &Path, opts: Spawn) -> TestApp {
        if crate::IN_PROCESS && !opts.own_process {
            Self::start_in_process(data_dir, opts)
        } else {
            Self::spawn_under(&[], data_dir, opts)
        }
    }

    /// A daemon in this process on `store` instead of sled in its data directory (which holds
    /// its tokens), its clock the store's: several of them on clones of one store (each its own
    /// node's handle, `MemStore::another_node`) are several nodes on one database.
    pub fn spawn_on(store: storage::mem::MemStore, opts: Spawn) -> TestApp {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("data");
        let mut app = Self::start_in_process_on(&dir, opts, Some(store));
        app._tmp = Some(tmp);
        app
    }

    /// The application in this process, on its own thread and runtime, on ephemeral loopback
    /// ports, configured as the binary would be by the same environment and flags.
    fn start_in_process(data_dir: &Path, opts: Spawn) -> TestApp {
        Self::start_in_process_on(data_dir, opts, None)
    }

    /// [`start_in_process`](Self::start_in_process), on `store` when given.
    fn start_in_process_on(
        data_dir: &Path,
        opts: Spawn,
        store: Option<storage::mem::MemStore>,
    ) -> TestApp {
        use handoff_bridge::app::{Application, Listeners};
        use handoff_bridge::config::{Config, Overrides};
        std::fs::create_dir_all(data_dir).expect("data dir");
        let config_file = match opts.args.as_slice() {
            [] => None,
            [flag, path] if flag == "--config" => Some(PathBuf::from(path)),
            other => panic!("in process, only --config is understood: {other:?}"),
        };
        let overrides = Overrides {
            listen: Some("127.0.0.1:0".into()),
            admin_listen: (!opts.admin_chosen()).then(|| "127.0.0.1:0".into()),
            upstream: None,
            data_dir: Some(data_dir.to_path_buf()),
            check_files: true,
        };
        let config = Config::load_from(config_file.as_deref(), opts.daemon_env(), &overrides)
            .unwrap_or_else(|e| panic!("config: {e}"));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let listeners = Listeners::bind(&config).map_err(|e| e.to_string())?;
                let app = match store {
                    None => Application::build(config, listeners).await,
                    Some(mem) => {
                        let given = handoff_bridge::app::GivenStore {
                            store: std::sync::Arc::new(mem.clone()),
                            writer: Box::new(move |hooks| Ok(mem.writer(hooks))),
                        };
                        Application::build_on(config, listeners, given).await
                    }
                };
                let app = app.map_err(|e| e.to_string())?;
                let shutdown = async move {
                    let _ = stop_rx.await;
                    "the test's stop"
                };
                let started = move |s: &handoff_bridge::app::Started| {
                    let _ = ready_tx.send(s.addrs);
                };
                app.run(shutdown, started)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            })
        });
        let mut daemon = InProcess {
            stop: Some(stop_tx),
            thread: Some(thread),
        };
        let Ok(addrs) = ready_rx.recv() else {
            panic!("the app stopped before it served: {:?}", daemon.stop());
        };
        let base = format!("{}://{}", addrs.scheme, addrs.public);
        TestApp {
            webhook_url: format!("{base}/webhook/{WEBHOOK_TOKEN}"),
            emulator_url: addrs.emulator.map(|at| format!("http://{at}")),
            admin_base: addrs
                .admin
                .map_or_else(|| base.clone(), |at| format!("http://{at}")),
            base,
            daemon: Daemon::InProcess(daemon),
            data_dir: data_dir.to_path_buf(),
            _tmp: None,
            agent: agent(),
        }
    }

    /// [`spawn_in`](Self::spawn_in) as a child process, the daemon started by `wrapper` (a
    /// program and its arguments, which run the command after them). `setpriv ... --` and
    /// `prlimit ... --` run it in their own process, so the child is the daemon; `strace` runs
    /// it as its child, which the test must stop itself (by the PID in `daemon.json`).
    pub fn spawn_under(wrapper: &[&str], data_dir: &Path, opts: Spawn) -> TestApp {
        std::fs::create_dir_all(data_dir).expect("data dir");
        let log_path = data_dir.join(format!(
            "daemon-{}.log",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        let log = std::fs::File::create(&log_path).expect("log file");
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(bin());
                cmd
            }
            None => Command::new(bin()),
        };
        cmd.arg("serve").arg("--listen").arg("127.0.0.1:0");
        if !opts.admin_chosen() {
            cmd.arg("--admin-listen").arg("127.0.0.1:0");
        }
        cmd.arg("--data-dir")
            .arg(data_dir)
            .args(&opts.args)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("RUST_LOG", "info")
            .envs(opts.daemon_env())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log));
        let mut child = cmd.spawn().expect("start handoff-bridge");
        let stdout = child.stdout.take().expect("stdout");
        let mut reader = BufReader::new(stdout);
        let mut base = None;
        let mut admin_base = None;
        let mut upstream = None;
        let mut line = String::new();
        // The daemon prints `listening: http://ADDR` once it accepts connections.
        while base.is_none() {
            line.clear();
            let n = reader.read_line(&mut line).expect("read daemon stdout");
            if n == 0 {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                panic!("daemon exited before listening: {:?}\n{log}", child.wait());
            }
            if let Some(rest) = line.trim().strip_prefix("listening: ") {
                base = Some(rest.to_owned());
            }
            if let Some(rest) = line.trim().strip_prefix("admin listening: ") {
                admin_base = Some(rest.to_owned());
            }
            if let Some(rest) = line.trim().strip_prefix("upstream: embedded emulator at ") {
                upstream = Some(rest.to_owned());
            }
        }
        let base = base.expect("base url");
        TestApp {
            webhook_url: format!("{base}/webhook/{WEBHOOK_TOKEN}"),
            emulator_url: upstream,
            // `admin.listen = ""` (a test's own flag or variable): all on the public listener.
            admin_base: admin_base.unwrap_or_else(|| base.clone()),
            base,
            daemon: Daemon::Child {
                child,
                log_path,
                _stdout: reader,
            },
            data_dir: data_dir.to_path_buf(),
            _tmp: None,
            agent: agent(),
        }
    }

    /// The daemon's process (a child process only).
    pub fn child(&mut self) -> &mut Child {
        match &mut self.daemon {
            Daemon::Child { child, .. } => child,
            Daemon::InProcess(_) => panic!("the app runs in this process: spawn it own_process"),
        }
    }

    /// Where the daemon's log is written (a child process only).
    pub fn log_path(&self) -> &Path {
        match &self.daemon {
            Daemon::Child { log_path, .. } => log_path,
            Daemon::InProcess(_) => panic!("the app runs in this process: spawn it own_process"),
        }
    }

    /// The daemon's process id (this process's for an app in process).
    pub fn pid(&self) -> u32 {
        match &self.daemon {
            Daemon::Child { child, .. } => child.id(),
            Daemon::InProcess(_) => std::process::id(),
        }
    }
    /// POST a body to the webhook with the JSON content type. Returns status and parsed body.
    pub fn post(&self, body: &[u8]) -> (u16, Value) {
        self.post_to(&self.webhook_url, body, Some("application/json"))
    }

    pub fn post_to(&self, url: &str, body: &[u8], content_type: Option<&str>) -> (u16, Value) {
        let mut req = self.agent.post(url);
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        let mut resp = req.send(body).expect("POST");
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        let mut resp = self
            .agent
            .get(format!("{}{path}", self.base))
            .call()
            .expect("GET");
        let status = resp.status().as_u16();
        (status, resp.body_mut().read_to_string().unwrap_or_default())
    }

    /// The full URL of an admin API path (`/admin/v1/...`) or `/metrics`: tests reach the admin
    /// endpoints only through this (and the helpers that use it), never through `base`.
    pub fn admin_url(&self, path: &str) -> String {
        format!("{}{path}", self.admin_base)
    }

    /// GET an admin-listener path without a token (`/metrics`, or an admin call that must be
    /// refused): status and text.
    pub fn admin_get_text(&self, path: &str) -> (u16, String) {
        let mut resp = self.agent.get(self.admin_url(path)).call().expect("GET");
        let status = resp.status().as_u16();
        (status, resp.body_mut().read_to_string().unwrap_or_default())
    }

    pub fn admin_get(&self, path: &str) -> (u16, Value) {
        let mut resp = self
            .agent
            .get(self.admin_url(path))
            .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
            .call()
            .expect("GET");
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// Scrape one metric sample (exact name with labels, e.g. `handoff_inbox_depth`); 0 when the
    /// daemon does not publish it.
    pub fn metric(&self, sample: &str) -> f64 {
        self.metric_sample(sample).unwrap_or(0.0)
    }

    /// Scrape one metric sample, `None` when it is not published (to tell a gauge at 0 from a
    /// missing one).
    pub fn metric_sample(&self, sample: &str) -> Option<f64> {
        let mut resp = self
            .agent
            .get(self.admin_url("/metrics"))
            .call()
            .expect("GET /metrics");
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        text.lines()
            .find_map(|l| {
                l.strip_prefix(sample)
                    .and_then(|rest| rest.strip_prefix(' '))
            })
            .and_then(|v| v.trim().parse().ok())
    }

    /// Run a CLI command against this daemon's data directory.
    pub fn cli(&self, args: &[&str]) -> Output {
        cli(&self.data_dir, args)
    }

    /// Stop it in order (SIGTERM for a child) and wait for its end.
    pub fn terminate(mut self) -> ExitStatus {
        use std::os::unix::process::ExitStatusExt as _;
        match &mut self.daemon {
            Daemon::Child { child, .. } => {
                sigterm(child);
                child.wait().expect("wait")
            }
            // As the binary would exit: 0 after a stop in order, 1 after an error.
            Daemon::InProcess(app) => match app.stop() {
                Ok(()) => ExitStatus::from_raw(0),
                Err(e) => {
                    eprintln!("the app failed: {e}");
                    ExitStatus::from_raw(1 << 8)
                }
            },
        }
    }

    /// SIGKILL (kill -9) and reap (a child process only).
    pub fn kill9(mut self) {
        let child = self.child();
        let _ = child.kill();
        let _ = child.wait();
    }

    /// SIGTERM, wait, and return everything the daemon logged (a child process only).
    pub fn terminate_and_logs(mut self) -> String {
        let child = self.child();
        sigterm(child);
        let status = child.wait().expect("wait");
        assert!(status.success(), "daemon exited with {status}");
        // Read before `self` drops: its temp dir holds the log.
        self.logs()
    }

    /// Everything the daemon logged so far (a child process only: an app in this process has
    /// no log of its own).
    pub fn logs(&self) -> String {
        match &self.daemon {
            Daemon::Child { log_path, .. } => std::fs::read_to_string(log_path).unwrap_or_default(),
            Daemon::InProcess(_) => panic!("the app runs in this process: spawn it own_process"),
        }
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        match &mut self.daemon {
            Daemon::Child { child, .. } => {
                if let Ok(None) = child.try_wait() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
            Daemon::InProcess(app) => {
                let _ = app.stop();
            }
        }
    }
}

/// Run the CLI on a data directory (the daemon may or may not be running).
pub fn cli(data_dir: &Path, args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .arg("--data-dir")
        .arg(data_dir)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HANDOFF_BRIDGE_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .expect("run cli")
}

/// Wait until every accepted event is folded into state. The daemon answers when its dispatcher
/// drains the inbox (an event, not a poll); bounded so a stuck dispatcher fails the test.
pub fn wait_drained(app: &TestApp) {
    let (status, body) = app.admin_get("/admin/v1/inbox/drained?timeout_ms=60000");
    assert_eq!(status, 200, "inbox not drained: {body}");
}

// ---- Helpers for the fixture, bad-input and out-of-order tests. ----

impl TestApp {
    /// Like `post_to`, but a transport error (e.g. the daemon closing the connection while a large
    /// body is still being sent) is returned instead of panicking.
    pub fn try_post_to(
        &self,
        url: &str,
        body: &[u8],
        content_type: Option<&str>,
    ) -> Result<(u16, Value), String> {
        let mut req = self.agent.post(url);
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        let mut resp = req.send(body).map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let text = resp
            .body_mut()
            .read_to_string()
            .map_err(|e| e.to_string())?;
        Ok((
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        ))
    }

    /// POST (no body) to the admin API with the admin token.
    pub fn admin_post(&self, path: &str) -> (u16, Value) {
        let mut resp = self
            .agent
            .post(self.admin_url(path))
            .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
            .send_empty()
            .expect("POST");
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// Run a CLI command that must succeed; returns its stdout.
    pub fn cli_ok(&self, args: &[&str]) -> String {
        cli_ok(&self.data_dir, args)
    }

    /// Move the daemon's time forward by `by` ("5m") with the test clock (the daemon must run
    /// with `HANDOFF_BRIDGE__ADMIN__TEST_CLOCK=true`), once everything in flight has settled, so
    /// timers decided so far are scheduled before their time comes.
    /// Move the test clock by `by` without settling first (an outbox that waits on a failing
    /// upstream never settles) and without waiting for timers; the clock's answer.
    pub fn advance_clock_unsettled(&self, by: &str) -> Value {
        let mut resp = self
            .agent
            .post(self.admin_url("/admin/v1/clock/advance"))
            .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
            .header("content-type", "application/json")
            .send(serde_json::json!({ "by": by }).to_string())
            .expect("POST");
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        assert_eq!(resp.status().as_u16(), 200, "test clock: {text}");
        serde_json::from_str(&text).expect("JSON answer")
    }

    pub fn advance_clock(&self, by: &str) {
        self.settle();
        let fired = self.metric("handoff_timers_fired_total");
        let answer = self.advance_clock_unsettled(by);
        // Every timer now due has fired (been handed to the writer) before this returns, so a
        // test's next step sees its effects or, after `settle`, their absence.
        let due = answer["due_timers"].as_f64().expect("due_timers");
        poll_until("the due timers to fire", Duration::from_secs(30), || {
            (self.metric("handoff_timers_fired_total") >= fired + due).then_some(())
        });
    }
}

/// Run a CLI command on a data directory that must succeed; returns its stdout.
pub fn cli_ok(data_dir: &Path, args: &[&str]) -> String {
    let out = cli(data_dir, args);
    assert!(
        out.status.success(),
        "handoff-bridge {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("CLI output is UTF-8")
}

/// One shared fixture by file name.
pub fn fixture_bytes(name: &str) -> Vec<u8> {
    let path = fixtures_dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One shared fixture by file name, parsed.
pub fn fixture_value(name: &str) -> Value {
    serde_json::from_slice(&fixture_bytes(name)).expect("fixture is JSON")
}

/// A delivery envelope around `events` (the shape the service sends).
pub fn delivery(id: &str, events: &[Value]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "id": id,
        "webhookId": "2b1c1e7a-5f0e-4c61-9d1e-0c3f4a9b8e01",
        "webhookUrl": "https://bridge.example.com/webhook/closer?token=REDACTED",
        "messages": events,
    }))
    .expect("serialize delivery")
}

// ---- The embedded emulator as the service: its user acts, its journal shows the calls ----

impl TestApp {
    /// The embedded emulator's base URL (the default upstream).
    pub fn emulator(&self) -> &str {
        self.emulator_url
            .as_deref()
            .expect("the embedded emulator is the default upstream")
    }

    /// The emulator's user (or the service, for agent-call steps) acts in `conversation`:
    /// `say` (`{"text": ...}`), `request-agent`, `agent-connect`, `agent-end`, `cancel`. The
    /// emulator sends the resulting webhook to the daemon.
    pub fn emulator_act(&self, conversation: &str, step: &str, body: Value) {
        let url = format!(
            "{}/_emulator/conversations/{conversation}/{step}",
            self.emulator()
        );
        let (status, answer) =
            self.post_to(&url, body.to_string().as_bytes(), Some("application/json"));
        assert_eq!(status, 200, "{step}: {answer}");
    }

    /// The emulator's journal: every call it received, in order.
    pub fn journal(&self) -> Vec<Value> {
        let mut resp = self
            .agent
            .get(format!("{}/_emulator/journal", self.emulator()))
            .call()
            .expect("journal");
        assert_eq!(resp.status().as_u16(), 200);
        resp.body_mut().read_json().expect("journal JSON")
    }

    /// Every webhook the emulator has emitted so far is delivered and folded. Both waits answer
    /// when done (no polling).
    pub fn emulator_delivered(&self) {
        let mut resp = self
            .agent
            .get(format!(
                "{}/_emulator/webhook/flushed?timeout_ms=30000",
                self.emulator()
            ))
            .call()
            .expect("flushed");
        assert_eq!(
            resp.status().as_u16(),
            200,
            "{:?}",
            resp.body_mut().read_to_string()
        );
        wait_drained(self);
    }

    /// Nothing left in flight: events folded, decided actions carried out, and the webhooks the
    /// emulator sends about them (`bot.message.sent`...) delivered and folded too (twice, for the
    /// actions those decide).
    pub fn settle(&self) {
        self.settle_within(Duration::from_secs(30));
    }

    /// [`settle`](Self::settle), the outbox given up to `limit` to become idle (a long outage
    /// takes minutes to give up); asked in turns shorter than the client's own 30 s timeout.
    pub fn settle_within(&self, limit: Duration) {
        for _ in 0..2 {
            wait_drained(self);
            let deadline = std::time::Instant::now() + limit;
            loop {
                let (status, idle) = self.admin_get("/admin/v1/outbox/idle?timeout_ms=20000");
                if status == 200 {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "outbox not idle within {limit:?}: {idle}"
                );
            }
            self.emulator_delivered();
        }
    }
}

/// A journal entry that took effect: no injected fault, not a replay, a 2xx answer.
pub fn took_effect(entry: &Value) -> bool {
    entry["fault"].is_null()
        && entry["replayed"] == false
        && entry["status"]
            .as_u64()
            .is_some_and(|s| (200..300).contains(&s))
}

/// Poll `check` (an observable condition: the journal, the state) until it gives a value; fail
/// after `limit`. The test waits only as long as the daemon needs.
pub fn poll_until<T>(what: &str, limit: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(found) = check() {
            return found;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

// ---- A start that must be refused, and a directory's exact contents ----

/// SIGTERM to a process the test started (by its PID).
pub fn sigterm(child: &Child) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
}

/// `serve` on `data_dir` on free loopback ports, in the test environment of
/// [`TestApp::spawn_in`] (its tokens, rules off), for tests that watch a start themselves.
pub fn serve_command(data_dir: &Path) -> Command {
    let mut cmd = Command::new(bin());
    cmd.arg("serve")
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--admin-listen")
        .arg("127.0.0.1:0")
        .arg("--data-dir")
        .arg(data_dir)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HANDOFF_BRIDGE_WEBHOOK_TOKENS", WEBHOOK_TOKEN)
        .env("HANDOFF_BRIDGE_ADMIN_TOKEN", ADMIN_TOKEN)
        .env("HANDOFF_BRIDGE__RULES__ENABLED", "false")
        .env("RUST_LOG", "info");
    cmd
}

/// Run `serve` on `data_dir` (the test environment of [`TestApp::spawn_in`], its stderr kept
/// instead of written into the directory, which must not change) and wait at most `limit` for
/// it to exit. Returns the exit status and stderr; panics, after killing it, if it started.
pub fn serve_refused(data_dir: &Path, limit: Duration) -> (ExitStatus, String) {
    serve_refused_with(data_dir, &[], limit)
}

/// [`serve_refused`] with `env` added to the daemon's environment.
pub fn serve_refused_with(
    data_dir: &Path,
    env: &[(&str, &str)],
    limit: Duration,
) -> (ExitStatus, String) {
    use std::io::Read;
    let mut child = serve_command(data_dir)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start handoff-bridge");
    let mut stderr = child.stderr.take().expect("stderr");
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        let status = child.wait().expect("wait");
        let _ = tx.send(());
        (status, text)
    });
    if rx.recv_timeout(limit).is_err() {
        // Still our unreaped child (the waiter has not returned), so the pid is its own.
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let (_, text) = waiter.join().expect("waiter");
        panic!("the daemon did not refuse to start within {limit:?}:\n{text}");
    }
    waiter.join().expect("waiter")
}

/// Every entry under `dir` (relative path) with its kind, size and SHA-256: equal digests mean
/// the directory is byte-for-byte the same.
pub fn dir_digest(dir: &Path) -> std::collections::BTreeMap<PathBuf, String> {
    use sha2::{Digest, Sha256};
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        let meta = std::fs::symlink_metadata(&at).expect("metadata");
        let rel = at.strip_prefix(dir).expect("under dir").to_path_buf();
        if meta.is_dir() {
            out.insert(rel, "dir".to_owned());
            for entry in std::fs::read_dir(&at).expect("read_dir") {
                stack.push(entry.expect("entry").path());
            }
        } else {
            let bytes = std::fs::read(&at).expect("read");
            let hash: String = Sha256::digest(&bytes)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            out.insert(rel, format!("{} bytes {hash}", bytes.len()));
        }
    }
    out
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS:`, `VmHWM:`, `RssFile:`...), in MB (MiB).
pub fn proc_status_mb(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<f64>()
                .ok()
        })
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        / 1024.0
}
