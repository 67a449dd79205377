//! Issue 19, "the upstream is never silently the fake": an API key without `upstream.url` is
//! refused by `serve` and `check`; the embedded emulator runs only when nothing is configured or
//! when asked for; `/readyz`, `handoff_upstream_info` and the banner say which upstream runs; and
//! credentials inside `upstream.url` are masked wherever it is shown, and a mistyped key's value is
//! never echoed.

use crate::common::emulator::ExternalEmulator;
use crate::common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

const KEY: &str = "upstream-key-never-shown-0123";

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(bin())
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run")
}

/// `serve` on free loopback ports with nothing configured but `env`, its output piped.
fn serve_command(data: &Path, extra: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(bin());
    cmd.args(["serve", "--listen", "127.0.0.1:0"])
        .args(["--admin-listen", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .args(extra)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// `serve` that must refuse: it exits on its own (bounded by `serve_refused`-like waiting: the
/// refusal comes before anything listens).
fn serve_output(data: &Path, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let child = serve_command(data, extra, env).spawn().expect("spawn");
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let out = child.wait_with_output().expect("wait");
        let _ = tx.send(());
        out
    });
    if rx.recv_timeout(Duration::from_secs(30)).is_err() {
        // Still our unreaped child, so the pid is its own.
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let out = waiter.join().expect("waiter");
        panic!(
            "serve did not refuse: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    waiter.join().expect("waiter")
}

fn assert_refused(what: &str, out: &Output) {
    let err = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{what}: {err}{stdout}");
    let line = err
        .lines()
        .find(|l| l.contains("upstream.url"))
        .unwrap_or_else(|| panic!("{what}: no line names upstream.url:\n{err}"));
    assert!(line.contains("API key"), "{what}: {line}");
    assert!(
        !err.contains(KEY) && !stdout.contains(KEY),
        "{what} shows the key"
    );
}

#[test]
fn an_api_key_without_a_url_is_refused_by_serve_and_check() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("bridge.toml");
    std::fs::write(&file, format!("[upstream]\napi_key = \"{KEY}\"\n")).expect("config");
    let key_file = tmp.path().join("api_key");
    std::fs::write(&key_file, format!("{KEY}\n")).expect("key file");
    let file = file.to_str().expect("utf8").to_owned();
    let key_file = key_file.to_str().expect("utf8").to_owned();
    type Case<'a> = (&'a str, Vec<&'a str>, Vec<(&'a str, &'a str)>);
    let cases: [Case; 3] = [
        ("config file", vec!["--config", &file], vec![]),
        (
            "env",
            vec![],
            vec![("HANDOFF_BRIDGE_UPSTREAM_API_KEY", KEY)],
        ),
        (
            "api_key_file",
            vec![],
            vec![("HANDOFF_BRIDGE__UPSTREAM__API_KEY_FILE", &key_file)],
        ),
    ];
    for (i, (what, args, env)) in cases.iter().enumerate() {
        let mut check = vec!["check"];
        check.extend(args.iter().copied());
        assert_refused(&format!("check ({what})"), &run(&check, env));
        let data = tmp.path().join(format!("data-{i}"));
        let out = serve_output(&data, args, env);
        assert_refused(&format!("serve ({what})"), &out);
        assert!(
            !data.exists(),
            "serve ({what}) touched nothing before refusing"
        );
    }
}

/// A daemon started with `serve`, its stdout read up to the `listening:` line.
struct Started {
    child: Child,
    base: String,
    stdout: Vec<String>,
}

impl Drop for Started {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `serve` with nothing configured but `env` (the quick start's `handoff-bridge serve`).
fn start(data: &Path, extra: &[&str], env: &[(&str, &str)]) -> Started {
    let mut child = serve_command(data, extra, env).spawn().expect("spawn");
    let mut stdout = Vec::new();
    let mut base = None;
    for line in BufReader::new(child.stdout.take().expect("stdout")).lines() {
        let line = line.expect("line");
        if let Some(rest) = line.strip_prefix("listening: ") {
            base = Some(rest.to_owned());
            break;
        }
        stdout.push(line);
    }
    let Some(base) = base else {
        let _ = child.kill();
        let out = child.wait_with_output().expect("wait");
        panic!(
            "the daemon did not start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    Started {
        child,
        base,
        stdout,
    }
}

fn readyz(base: &str) -> Value {
    let mut resp = agent()
        .get(format!("{base}/readyz"))
        .call()
        .expect("readyz");
    resp.body_mut().read_json().expect("JSON")
}

#[test]
fn no_configuration_runs_the_embedded_emulator_and_says_so_loudly() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let daemon = start(&tmp.path().join("data"), &[], &[]);
    let banner = daemon.stdout.join("\n");
    assert!(
        daemon
            .stdout
            .iter()
            .any(|l| l.starts_with("WARNING") && l.contains("not the real service")),
        "{banner}"
    );
    assert!(
        banner.contains("upstream: embedded emulator at http://127.0.0.1:"),
        "{banner}"
    );
    let ready = readyz(&daemon.base);
    assert_eq!(ready["checks"]["upstream"]["mode"], "embedded", "{ready}");
    drop(daemon);
    // The gauge, read where the tests read metrics (TestApp sets no upstream either).
    let app = TestApp::spawn();
    assert_eq!(
        app.metric_sample("handoff_upstream_info{mode=\"embedded\"}"),
        Some(1.0)
    );
    assert_eq!(
        app.metric_sample("handoff_upstream_info{mode=\"remote\"}"),
        None
    );
}

#[test]
fn embedded_asked_for_runs_even_with_a_key() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: vec![("HANDOFF_BRIDGE_UPSTREAM_API_KEY".into(), KEY.into())],
            args: vec!["--upstream".into(), "embedded".into()],
            ..Spawn::default()
        },
    );
    assert!(app.emulator_url.is_some(), "the emulator runs");
    let (status, body) = app.get("/readyz");
    assert_eq!(status, 200, "{body}");
    let ready: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(ready["checks"]["upstream"]["mode"], "embedded", "{ready}");
    assert_eq!(
        app.metric_sample("handoff_upstream_info{mode=\"embedded\"}"),
        Some(1.0)
    );
    let logs = app.terminate_and_logs();
    assert!(logs.contains("not the real service"), "warn log: {logs}");
    assert!(!logs.contains(KEY), "the key is not logged");
    // In a config file too.
    let file = tmp.path().join("bridge.toml");
    std::fs::write(
        &file,
        format!("[upstream]\nurl = \"embedded\"\napi_key = \"{KEY}\"\n"),
    )
    .expect("config");
    let out = run(&["check", "--config", file.to_str().expect("utf8")], &[]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("url = \"embedded\"") && !text.contains(KEY),
        "{text}"
    );
}

/// A standalone emulator, the service the remote mode talks to.
fn start_emulator() -> ExternalEmulator {
    ExternalEmulator::start(KEY)
}

#[test]
fn a_remote_upstream_is_reported_and_its_url_credentials_are_masked() {
    let emu = start_emulator();
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn::with_env(&[
            ("HANDOFF_BRIDGE_UPSTREAM_URL", emu.base.as_str()),
            ("HANDOFF_BRIDGE_UPSTREAM_API_KEY", KEY),
        ]),
    );
    assert!(app.emulator_url.is_none(), "no embedded emulator");
    let (status, body) = app.get("/readyz");
    assert_eq!(status, 200, "{body}");
    let ready: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(ready["checks"]["upstream"]["mode"], "remote", "{ready}");
    assert_eq!(
        app.metric_sample("handoff_upstream_info{mode=\"remote\"}"),
        Some(1.0)
    );
    assert_eq!(
        app.metric_sample("handoff_upstream_info{mode=\"embedded\"}"),
        None
    );
    let logs = app.terminate_and_logs();
    assert!(!logs.contains("not the real service"), "{logs}");

    // Credentials inside the URL: masked by check and by serve's start log and banner.
    let url = "http://bridge:pa55w0rd-in-url@127.0.0.1:9/api?token=t0k3n-in-url&region=eu";
    let env = [
        ("HANDOFF_BRIDGE_UPSTREAM_URL", url),
        ("HANDOFF_BRIDGE_UPSTREAM_API_KEY", KEY),
    ];
    let out = run(&["check"], &env);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("http://bridge:****@127.0.0.1:9/api?token=****&region=eu"),
        "{text}"
    );
    let daemon = start(&tmp.path().join("data2"), &[], &env);
    let banner = daemon.stdout.join("\n");
    assert!(
        banner.contains("upstream: remote http://bridge:****@127.0.0.1:9/api?token=****"),
        "{banner}"
    );
    let pid = nix::unistd::Pid::from_raw(daemon.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let mut daemon = daemon;
    let mut stderr = String::new();
    use std::io::Read as _;
    daemon
        .child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("read stderr");
    assert!(stderr.contains("http://bridge:****@"), "{stderr}");
    for shown in [text.as_ref(), banner.as_str(), stderr.as_str()] {
        for secret in ["pa55w0rd-in-url", "t0k3n-in-url", KEY] {
            assert!(!shown.contains(secret), "{secret} shown in: {shown}");
        }
    }
}

#[test]
fn a_mistyped_secret_key_is_named_by_check_and_serve_never_echoed() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("bridge.toml");
    std::fs::write(
        &file,
        "[upstream]\napikey = \"s3cr3t-in-file\"\n[admin]\ntokn = \"s3cr3t-admin-tokn\"\n",
    )
    .expect("config");
    let file = file.to_str().expect("utf8");
    let env = [("HANDOFF_BRIDGE__UPSTREAM__APIKEY", "s3cr3t-in-env")];
    let check = run(&["check", "--config", file], &env);
    let data = tmp.path().join("data");
    let serve = serve_output(&data, &["--config", file], &env);
    for (what, out) in [("check", check), ("serve", serve)] {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{what}: {err}");
        for key in [
            "upstream.apikey",
            "admin.tokn",
            "HANDOFF_BRIDGE__UPSTREAM__APIKEY",
        ] {
            assert!(err.contains(key), "{what} names {key}: {err}");
        }
        let all = format!("{err}{}", String::from_utf8_lossy(&out.stdout));
        assert!(!all.contains("s3cr3t"), "{what} echoes a value: {all}");
    }
}
