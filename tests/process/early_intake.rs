//! A start takes webhook deliveries before its store (sled) has opened: sled replays its log on
//! open, seconds to minutes after a long run, and a webhook refused meanwhile may be disabled by
//! the service. The tests hold the daemon's open of sled, as a long replay would (a debug build's
//! hook: the open waits while a file the test names exists), so the daemon is caught between
//! its early listener and its full start.

use crate::common::*;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Stdio};

fn delivery(id: &str, event: &str, conversation: &str) -> Vec<u8> {
    format!(
        r#"{{"id":"{id}","webhookId":"w","webhookUrl":"u","messages":[{{"id":"{event}","event":"bot.message.received","sourceType":"bot","sourceId":"B1","timestamp":1700000000000,"data":{{"message":{{"id":"m-{event}","conversationId":"{conversation}","isUser":true,"meta":null,"data":{{"type":"text","text":"hello"}}}}}}}}]}}"#
    )
    .into_bytes()
}

/// A data directory in `tmp` a daemon ran on and stopped (an open of this build wrote the event
/// log's state file then), with event e1 of conversation c1 folded when `with_e1`.
fn ran_before(tmp: &tempfile::TempDir, with_e1: bool) -> PathBuf {
    let dir = tmp.path().join("data");
    let app = TestApp::spawn_in(&dir, Spawn::default());
    if with_e1 {
        let (status, body) = app.post(&delivery("d1", "e1", "c1"));
        assert_eq!(status, 200, "{body}");
        wait_drained(&app);
    }
    assert!(app.terminate().success());
    dir
}

/// Held while the returned file exists: the daemons [`start`]ed on `dir` wait with their store's
/// open until it is removed.
fn hold_open(dir: &std::path::Path) -> PathBuf {
    let gate = dir.join("hold-store-open");
    std::fs::write(&gate, b"").expect("gate");
    gate
}

/// Start the daemon on `dir`: the process, its stdout and its log file.
fn start(dir: &std::path::Path, name: &str) -> (Child, BufReader<ChildStdout>, PathBuf) {
    let log_path = dir.join(format!("daemon-{name}.log"));
    let mut child = serve_command(dir)
        .env(
            "HANDOFF_BRIDGE_TEST_HOLD_STORE_OPEN",
            dir.join("hold-store-open"),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(match name {
            // Read as it is written.
            "stopped" => Stdio::piped(),
            _ => Stdio::from(std::fs::File::create(&log_path).expect("log file")),
        })
        .spawn()
        .expect("start handoff-bridge");
    let stdout = BufReader::new(child.stdout.take().expect("stdout"));
    (child, stdout, log_path)
}

/// Read the daemon's stdout up to the line starting with `prefix`; the rest of that line.
fn read_until(
    stdout: &mut BufReader<ChildStdout>,
    child: &mut Child,
    log_path: &std::path::Path,
    prefix: &str,
) -> String {
    loop {
        let mut line = String::new();
        let n = stdout.read_line(&mut line).expect("read stdout");
        if n == 0 {
            let _ = child.kill();
            let log = std::fs::read_to_string(log_path).unwrap_or_default();
            panic!("daemon exited before `{prefix}`:\n{log}");
        }
        if let Some(rest) = line.trim().strip_prefix(prefix) {
            return rest.to_owned();
        }
        assert!(
            !line.starts_with("listening: "),
            "the daemon started without printing `{prefix}`"
        );
    }
}

fn post(agent: &ureq::Agent, url: &str, body: &[u8]) -> (u16, serde_json::Value) {
    let mut resp = agent
        .post(url)
        .header("content-type", "application/json")
        .send(body)
        .expect("POST");
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    (resp.status().as_u16(), json)
}

#[test]
fn deliveries_are_answered_while_the_store_opens_and_folded_once_after() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = ran_before(&tmp, true);

    // The daemon's open of sled waits, as for a long replay.
    let gate = hold_open(&dir);
    let (mut child, mut stdout, log_path) = start(&dir, "early");
    let mut line_starting = |prefix: &str| read_until(&mut stdout, &mut child, &log_path, prefix);
    let early = line_starting("accepting webhooks: ");
    let agent = agent();
    let post = |url: &str, body: &[u8]| post(&agent, url, body);
    let webhook = format!("{early}/webhook/{WEBHOOK_TOKEN}");
    let (status, body) = post(&webhook, &delivery("d2", "e2", "c1"));
    let (again, again_body) = post(&webhook, &delivery("d3", "e1", "c1"));
    let (wrong, _) = post(&format!("{early}/webhook/not-the-token"), b"{}");
    let mut probe = agent
        .get(format!("{early}/helpdesk/v1/conversations"))
        .call()
        .expect("GET");
    let (probe_status, retry_after) = (
        probe.status().as_u16(),
        probe
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap_or_default().to_owned()),
    );
    let probe_body: serde_json::Value =
        serde_json::from_str(&probe.body_mut().read_to_string().unwrap_or_default())
            .unwrap_or_default();
    let opened_yet = std::fs::read_to_string(&log_path)
        .unwrap_or_default()
        .contains("store opened");
    // A body to quarantine needs the store: it waits for it.
    let quarantined = std::thread::spawn({
        let webhook = webhook.clone();
        move || self::post(&crate::common::agent(), &webhook, b"not json")
    });
    // Let sled open; the daemon then starts on the same socket.
    std::fs::remove_file(&gate).expect("open the gate");
    let base = line_starting("listening: ");
    let (quarantined, quarantined_body) = quarantined.join().expect("quarantined delivery");

    assert!(!opened_yet, "the answers came before the store opened");
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (body["status"].as_str(), body["accepted"].as_u64()),
        (Some("accepted"), Some(1))
    );
    assert_eq!(again, 200, "{again_body}");
    assert_eq!(
        again_body["status"], "duplicate",
        "an event logged before is known"
    );
    assert_eq!(wrong, 401, "tokens are checked as ever");
    assert_eq!(
        (quarantined, quarantined_body["status"].as_str()),
        (200, Some("quarantined")),
        "{quarantined_body}"
    );
    assert_eq!(probe_status, 503);
    assert_eq!(probe_body["error"]["code"], "starting");
    assert_eq!(retry_after.as_deref(), Some("1"));
    assert_eq!(
        base, early,
        "the daemon took over the early listener's socket"
    );

    // Folded once the store opened: c1 has both events, each once.
    let admin = admin_base(&dir);
    let mut resp = agent
        .get(format!("{admin}/admin/v1/inbox/drained?timeout_ms=60000"))
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .call()
        .expect("drained");
    assert_eq!(resp.status().as_u16(), 200);
    let _ = resp.body_mut().read_to_string();
    let mut state = agent
        .get(format!("{admin}/admin/v1/conversations/c1"))
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .call()
        .expect("state");
    let state: serde_json::Value =
        serde_json::from_str(&state.body_mut().read_to_string().unwrap_or_default())
            .expect("state json");
    assert_eq!(state["events_applied"], 2, "{state}");
    // The webhook keeps working on the full server.
    let (status, body) = post(
        &format!("{base}/webhook/{WEBHOOK_TOKEN}"),
        &delivery("d4", "e4", "c1"),
    );
    assert_eq!(
        (status, body["accepted"].as_u64()),
        (200, Some(1)),
        "{body}"
    );
    sigterm(&child);
    assert!(child.wait().expect("wait").success());
}

/// The admin listener's address, from the `daemon.json` the started daemon wrote.
fn admin_base(dir: &std::path::Path) -> String {
    let info: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("daemon.json")).expect("daemon.json"))
            .expect("daemon.json");
    format!("http://{}", info["admin"].as_str().expect("admin address"))
}

#[test]
fn a_delivery_answered_before_the_store_opened_survives_a_kill_9_then() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = ran_before(&tmp, true);

    let gate = hold_open(&dir);
    let (mut child, mut stdout, log_path) = start(&dir, "killed");
    let early = read_until(&mut stdout, &mut child, &log_path, "accepting webhooks: ");
    let (status, body) = post(
        &agent(),
        &format!("{early}/webhook/{WEBHOOK_TOKEN}"),
        &delivery("d2", "e2", "c1"),
    );
    assert_eq!(
        (status, body["accepted"].as_u64()),
        (200, Some(1)),
        "{body}"
    );
    // Killed before sled opened: nothing was indexed, only logged and synced.
    child.kill().expect("kill -9");
    let _ = child.wait();
    std::fs::remove_file(&gate).expect("open the gate");

    let app = TestApp::spawn_in(&dir, Spawn::default());
    wait_drained(&app);
    let (status, state) = app.admin_get("/admin/v1/conversations/c1");
    assert_eq!(status, 200, "{state}");
    assert_eq!(state["events_applied"], 2, "{state}");
    // Still known: a re-send is a duplicate.
    let (status, body) = app.post(&delivery("d2", "e2", "c1"));
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("duplicate")),
        "{body}"
    );
    assert!(app.terminate().success());
}

#[test]
fn a_stop_while_the_store_opens_finishes_the_early_deliveries_and_exits_cleanly() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = ran_before(&tmp, false);

    let gate = hold_open(&dir);
    let (mut child, mut stdout, log_path) = start(&dir, "stopped");
    // The log as it is written (to a pipe instead of the file).
    let logs = BufReader::new(child.stderr.take().expect("stderr"));
    let early = read_until(&mut stdout, &mut child, &log_path, "accepting webhooks: ");
    let (status, body) = post(
        &agent(),
        &format!("{early}/webhook/{WEBHOOK_TOKEN}"),
        &delivery("d2", "e2", "c1"),
    );
    assert_eq!(
        (status, body["accepted"].as_u64()),
        (200, Some(1)),
        "{body}"
    );
    sigterm(&child);
    // Stopped while the store opens: the early listener closes at once, and the process ends
    // without waiting for sled's open.
    let mut seen = Vec::new();
    let mut logs = logs.lines();
    for line in logs.by_ref() {
        let line = line.expect("log line");
        let stopping = line.contains("shutting down while the store opens");
        seen.push(line);
        if stopping {
            break;
        }
    }
    assert!(
        seen.last()
            .is_some_and(|l| l.contains("shutting down while the store opens")),
        "{seen:#?}"
    );
    // The log's reader goes away (as a log shipper may): writing the next line must not kill
    // the daemon (it did: tracing reported the failed write on stderr, and that write panicked).
    drop(logs);
    std::fs::remove_file(&gate).expect("open the gate");
    let status = child.wait().expect("wait");
    assert!(status.success(), "{status:?}");

    let app = TestApp::spawn_in(&dir, Spawn::default());
    wait_drained(&app);
    let (status, state) = app.admin_get("/admin/v1/conversations/c1");
    assert_eq!(
        (status, &state["events_applied"]),
        (200, &serde_json::json!(1)),
        "{state}"
    );
    assert!(app.terminate().success());
}
