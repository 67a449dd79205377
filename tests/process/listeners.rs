//! Two listeners: the public one (`server.listen`: webhook, agent API, probes) and the admin one
//! (`admin.listen`: admin API, /metrics, probes). `admin.listen = ""` keeps everything on the
//! public listener. The CLI finds the admin listener through `daemon.json`, and never calls the
//! addresses of a stale one (its process dead, or alive without holding the store).

use crate::common::{Spawn, TestApp, ADMIN_TOKEN};
use serde_json::Value;
use std::net::TcpListener;

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

fn daemon_json(app: &TestApp) -> Value {
    json(&std::fs::read_to_string(app.data_dir.join("daemon.json")).expect("daemon.json"))
}

/// GET `url` with the admin token: status and text.
fn get_with_token(app: &TestApp, url: &str) -> (u16, String) {
    let mut resp = app
        .agent
        .get(url)
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .call()
        .expect("GET");
    let status = resp.status().as_u16();
    (status, resp.body_mut().read_to_string().unwrap_or_default())
}

#[test]
fn the_admin_api_and_metrics_live_on_the_admin_listener_only() {
    let app = TestApp::spawn();
    assert_ne!(app.admin_base, app.base, "two listeners");
    let (status, receipt) = app.post(b"{}");
    assert_eq!(
        status, 200,
        "the webhook is on the public listener: {receipt}"
    );

    // The admin listener: admin API, /metrics, probes.
    let (status, body) = app.admin_get("/admin/v1/quarantine");
    assert_eq!(status, 200, "{body}");
    let (status, metrics) = app.admin_get_text("/metrics");
    assert_eq!(status, 200);
    assert!(metrics.contains("handoff_queue_waiting"), "{metrics}");
    for probe in ["/healthz", "/readyz"] {
        assert_eq!(
            app.admin_get_text(probe).0,
            200,
            "{probe} on the admin listener"
        );
        assert_eq!(app.get(probe).0, 200, "{probe} on the public listener");
    }

    // The public listener: the admin API and /metrics are not there, even with the token.
    for path in [
        "/admin/v1/quarantine",
        "/admin/v1/inbox/drained",
        "/metrics",
    ] {
        let (status, text) = get_with_token(&app, &format!("{}{path}", app.base));
        assert_eq!(status, 404, "{path} on the public listener: {text}");
        assert_eq!(json(&text)["error"]["code"], "not_found", "{path}: {text}");
    }
    // ... and the webhook and agent API are not on the admin listener.
    let (status, text) = app.post_to(
        &app.webhook_url.replace(&app.base, &app.admin_base),
        b"{}",
        Some("application/json"),
    );
    assert_eq!(status, 404, "webhook on the admin listener: {text}");
    assert_eq!(
        app.admin_get_text("/helpdesk/v1/conversations").0,
        404,
        "agent API on the admin listener"
    );

    // daemon.json names both; the CLI's online commands reach the admin listener (the store is
    // locked by the daemon, so only the online path can answer).
    let info = daemon_json(&app);
    assert_eq!(
        format!("http://{}", info["listen"].as_str().expect("listen")),
        app.base
    );
    assert_eq!(
        format!("http://{}", info["admin"].as_str().expect("admin")),
        app.admin_base
    );
    let listed = json(&app.cli_ok(&["quarantine", "list"]));
    assert!(listed.is_array() || listed.is_object(), "{listed}");
    let out = app.cli(&["outbox", "pause"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(app.metric("handoff_outbox_paused"), 1.0, "paused online");

    // Both listeners stop on SIGTERM, cleanly.
    let logs = app.terminate_and_logs();
    assert!(logs.contains("stopped cleanly"), "{logs}");
}

#[test]
fn an_empty_admin_listen_serves_everything_on_the_public_listener() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn::with_env(&[("HANDOFF_BRIDGE__ADMIN__LISTEN", "")]),
    );
    assert_eq!(app.admin_base, app.base, "no admin listening line");
    let (status, body) = app.admin_get("/admin/v1/quarantine");
    assert_eq!(status, 200, "{body}");
    let (status, metrics) = app.admin_get_text("/metrics");
    assert_eq!(status, 200);
    assert!(metrics.contains("handoff_queue_waiting"), "{metrics}");
    let info = daemon_json(&app);
    assert_eq!(info["admin"], info["listen"], "{info}");
    let out = app.cli(&["outbox", "pause"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(app.metric("handoff_outbox_paused"), 1.0);
    assert!(app.terminate().success());
}

/// A listener the test owns, standing in for whoever took over a stale daemon.json's address:
/// nothing may connect to it.
struct Bait(TcpListener);

impl Bait {
    fn new() -> Bait {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        Bait(listener)
    }

    fn addr(&self) -> String {
        self.0.local_addr().expect("addr").to_string()
    }

    /// Whether anything connected (a finished CLI's connection waits in the backlog).
    fn was_called(&self) -> bool {
        match self.0.accept() {
            Ok(_) => true,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
            Err(e) => panic!("accept: {e}"),
        }
    }
}

fn write_daemon_json(data: &std::path::Path, pid: u32, addr: &str) {
    std::fs::create_dir_all(data).expect("data dir");
    let info = serde_json::json!({"pid": pid, "listen": addr, "admin": addr});
    std::fs::write(data.join("daemon.json"), info.to_string()).expect("daemon.json");
}

#[test]
fn the_cli_never_calls_the_address_of_a_stale_daemon_json() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    // A store that exists (a daemon ran here once) and is not open.
    let app = TestApp::spawn_in(&data, Spawn::default());
    assert!(app.terminate().success());

    // A live pid that does not hold the store: this test's own.
    let bait = Bait::new();
    write_daemon_json(&data, std::process::id(), &bait.addr());
    let out = crate::common::cli(&data, &["quarantine", "list"]);
    assert!(
        out.status.success(),
        "the offline path answers: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!bait.was_called(), "the stale address was called");

    // A dead pid: a command with no offline path says no daemon runs, and calls nobody.
    let mut child = std::process::Command::new("true").spawn().expect("spawn");
    let dead = child.id();
    child.wait().expect("reap");
    write_daemon_json(&data, dead, &bait.addr());
    let out = crate::common::cli(&data, &["outbox", "pause"]);
    assert!(!out.status.success(), "no daemon to pause");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("none is running"), "{err}");
    assert!(!err.contains(ADMIN_TOKEN), "{err}");
    assert!(!bait.was_called(), "the stale address was called");
}
