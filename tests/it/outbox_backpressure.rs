//! Backpressure and operator control: a paused executor lets the outbox grow past its depth;
//! `/readyz` and the metrics say so while intake keeps accepting; resuming drains it.

use crate::common::{cli_ok, delivery, fixture_value, wait_drained, Spawn, TestApp};
use serde_json::{json, Value};

const RULES: &str = r#"
[[rule]]
name = "echo"
on = ["bot.message.received"]
when = { field = "sender", equals = "user" }
actions = [{ type = "send_message", text = "echo {{ message.data.text }}" }]
"#;

/// A user message of the fixtures' seeded conversation, with fresh ids.
fn message(n: usize) -> Value {
    let mut ev = fixture_value("message-received-text.json")["messages"][0].clone();
    ev["id"] = json!(format!("bp000000-0000-4000-8000-{n:012}"));
    ev["timestamp"] = json!(1_763_690_500_000_i64 + n as i64);
    ev["data"]["message"]["id"] = json!(format!("bp-m-{n}"));
    ev["data"]["message"]["data"]["text"] = json!(format!("m{n}"));
    ev
}

#[test]
fn a_paused_outbox_backs_up_readiness_not_intake_and_drains_on_resume() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = tmp.path().join("rules");
    std::fs::create_dir_all(&rules).expect("rules dir");
    std::fs::write(rules.join("echo.toml"), RULES).expect("write rules");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: vec![
                (
                    "HANDOFF_BRIDGE__RULES__DIR".into(),
                    rules.display().to_string(),
                ),
                ("HANDOFF_BRIDGE__OUTBOX__MAX_DEPTH".into(), "3".into()),
            ],
            ..Spawn::default()
        },
    );
    let (status, ready) = app.get("/readyz");
    assert_eq!(status, 200, "{ready}");

    let paused: Value = serde_json::from_str(&cli_ok(&app.data_dir, &["outbox", "pause"]))
        .expect("pause prints JSON");
    assert_eq!(paused["paused"], true);
    assert_eq!(app.metric("handoff_outbox_paused"), 1.0);

    // Intake keeps accepting whatever the outbox depth.
    for n in 0..6 {
        let (status, receipt) = app.post(&delivery(&format!("bp-d-{n}"), &[message(n)]));
        assert_eq!(status, 200, "{receipt}");
        assert_eq!(receipt["status"], "accepted", "{receipt}");
    }
    wait_drained(&app);
    // The decided entries reach the (paused) executor after their flush; wait for that, bounded,
    // on the metric the executor publishes.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while app.metric("handoff_outbox_depth") < 6.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the outbox never held the 6 decided actions"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (status, body) = app.get("/readyz");
    let ready: Value = serde_json::from_str(&body).expect("readyz JSON");
    // Detail only: a bridge out of rotation would get its webhook disabled by the service.
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["status"], "ready", "{ready}");
    assert_eq!(ready["checks"]["outbox"], "backed_up", "{ready}");
    assert_eq!(ready["checks"]["outbox_paused"], true, "{ready}");
    assert!(app.metric("handoff_outbox_oldest_seconds") >= 0.0);

    // Operators can look at what waits.
    let list: Value =
        serde_json::from_str(&cli_ok(&app.data_dir, &["outbox", "list"])).expect("JSON");
    let entries = list["entries"].as_array().cloned().unwrap_or_default();
    assert_eq!(entries.len(), 6, "{list:#}");
    let first = entries[0]["seq"].as_u64().expect("seq");
    let shown: Value = serde_json::from_str(&cli_ok(
        &app.data_dir,
        &["outbox", "show", &first.to_string()],
    ))
    .expect("JSON");
    assert_eq!(shown["id"], entries[0]["id"]);
    assert_eq!(shown["action"]["message"]["text"], "echo m0", "{shown:#}");
    let missing = app.cli(&["outbox", "show", "999999999"]);
    assert_eq!(missing.status.code(), Some(1));

    // Nothing ran while paused.
    let (_, journal) = app.admin_get("/admin/v1/emulator/journal");
    assert_eq!(journal.as_array().map(Vec::len), Some(0), "{journal}");

    let resumed: Value = serde_json::from_str(&cli_ok(&app.data_dir, &["outbox", "resume"]))
        .expect("resume prints JSON");
    assert_eq!(resumed["paused"], false);
    assert_eq!(app.metric_sample("handoff_outbox_paused"), Some(0.0));
    let (status, idle) = app.admin_get("/admin/v1/outbox/idle?timeout_ms=30000");
    assert_eq!(status, 200, "{idle}");
    let (status, ready) = app.get("/readyz");
    assert_eq!(status, 200, "{ready}");
    let (_, journal) = app.admin_get("/admin/v1/emulator/journal");
    let texts: Vec<&str> = journal
        .as_array()
        .expect("journal")
        .iter()
        .filter_map(|e| e["body"]["message"]["text"].as_str())
        .collect();
    assert_eq!(
        texts,
        ["echo m0", "echo m1", "echo m2", "echo m3", "echo m4", "echo m5"]
    );

    // Offline there is no executor to pause: a clear error, not a silent success.
    let dir = app.data_dir.clone();
    assert!(app.terminate().success());
    let out = crate::common::cli(&dir, &["outbox", "pause"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("running daemon"));
}
