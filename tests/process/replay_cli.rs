//! `handoff-bridge replay`: stored events through the current rules, offline and through the
//! running daemon; an action decided before is never queued again unless forced.

use crate::common::{fixture_bytes, Spawn, TestApp, ADMIN_TOKEN};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

const GREET: &str = r#"
[[rule]]
name = "greet"
on = ["bot.message.received"]
actions = [{ type = "send_message", text = "hello {{ event.id }}" }]
"#;

const FLAG: &str = r#"
[[rule]]
name = "flag"
on = ["bot.message.received"]
actions = [{ type = "set_manual", enabled = true }]
"#;

fn spawn(data: &Path, rules: &Path) -> TestApp {
    TestApp::spawn_in(
        data,
        Spawn {
            env: vec![(
                "HANDOFF_BRIDGE__RULES__DIR".into(),
                rules.display().to_string(),
            )],
            ..Spawn::default()
        },
    )
}

/// The CLI with this test's rules (the shared helper clears the environment).
fn replay(data: &Path, rules: &Path, extra: &[&str]) -> Value {
    let out = Command::new(crate::common::bin())
        .args(["replay", "--from", "0", "--to", "4102444800000"])
        .args(extra)
        .arg("--data-dir")
        .arg(data)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HANDOFF_BRIDGE_ADMIN_TOKEN", ADMIN_TOKEN)
        .env("HANDOFF_BRIDGE__RULES__DIR", rules)
        .output()
        .expect("run replay");
    assert!(
        out.status.success(),
        "replay {extra:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("replay prints JSON")
}

/// Idempotency keys of the embedded emulator's effective (not replayed) calls.
fn effective_keys(app: &TestApp) -> Vec<String> {
    let (status, idle) = app.admin_get("/admin/v1/outbox/idle?timeout_ms=30000");
    assert_eq!(status, 200, "outbox not idle: {idle}");
    let (status, journal) = app.admin_get("/admin/v1/emulator/journal");
    assert_eq!(status, 200, "{journal}");
    let entries = journal
        .as_array()
        .or_else(|| journal["entries"].as_array())
        .cloned()
        .unwrap_or_default();
    entries
        .iter()
        .filter(|e| e["replayed"] != Value::Bool(true))
        .filter_map(|e| e["idempotency_key"].as_str().map(str::to_owned))
        .collect()
}

fn statuses(report: &Value) -> Vec<(String, String, bool)> {
    report["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|i| {
            (
                i["id"].as_str().unwrap_or_default().to_owned(),
                i["status"].as_str().unwrap_or_default().to_owned(),
                i["queued"].as_bool().unwrap_or_default(),
            )
        })
        .collect()
}

#[test]
fn replay_queues_new_decisions_once_and_repeats_old_ones_only_when_forced() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let rules = tmp.path().join("rules");
    std::fs::create_dir_all(&rules).expect("rules dir");
    std::fs::write(rules.join("a.toml"), GREET).expect("write rules");

    // The event is decided and carried out once by the running daemon.
    let app = spawn(&data, &rules);
    let (status, body) = app.post(&fixture_bytes("message-received-text.json"));
    assert_eq!(status, 200, "{body}");
    crate::common::wait_drained(&app);
    let event_id = "3e5f0000-0000-4000-8000-000000000018";
    let greet = format!("{event_id}/greet/0");
    assert_eq!(effective_keys(&app), vec![greet.clone()]);
    assert!(app.terminate().success());

    // Offline, same rules: already decided, nothing queued (dry run or not).
    let report = replay(&data, &rules, &["--dry-run"]);
    assert_eq!(
        statuses(&report),
        [(greet.clone(), "already_decided".into(), false)]
    );
    let report = replay(&data, &rules, &[]);
    assert_eq!(report["queued"], 0);

    // A new rule: a dry run shows its action, a real run queues it on the store.
    std::fs::write(rules.join("b.toml"), FLAG).expect("write rules");
    let flag = format!("{event_id}/flag/0");
    let report = replay(&data, &rules, &["--dry-run"]);
    assert_eq!(
        statuses(&report),
        [
            (greet.clone(), "already_decided".into(), false),
            (flag.clone(), "new".into(), false)
        ]
    );
    let report = replay(&data, &rules, &[]);
    assert_eq!(report["queued"], 1);
    assert_eq!(replay(&data, &rules, &[])["queued"], 0, "queued once only");

    // The next start carries it out (a fresh embedded emulator: a fresh journal).
    let app = spawn(&data, &rules);
    assert_eq!(effective_keys(&app), vec![flag.clone()]);

    // Through the running daemon, forced: both actions again, under new ids.
    let report = replay(&data, &rules, &["--force"]);
    assert_eq!(report["queued"], 2, "{report}");
    let forced: Vec<String> = statuses(&report)
        .into_iter()
        .map(|(id, status, queued)| {
            assert_eq!(status, "forced");
            assert!(queued);
            id
        })
        .collect();
    assert!(
        forced[0].starts_with(&format!("{greet}~replay-")),
        "{forced:?}"
    );
    assert!(
        forced[1].starts_with(&format!("{flag}~replay-")),
        "{forced:?}"
    );
    let keys = effective_keys(&app);
    assert_eq!(keys.len(), 3, "{keys:?}");
    assert_eq!(keys[0], flag);
    assert!(keys[1..].iter().all(|k| forced.contains(k)), "{keys:?}");
    assert!(app.terminate().success());
}

#[test]
fn replay_refuses_a_bad_window_and_the_daemon_refuses_bad_rules() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let out = crate::common::cli(&data, &["replay", "--from", "tomorrow", "--to", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--from"));
    let out = crate::common::cli(&data, &["replay", "--from", "10", "--to", "5"]);
    assert_eq!(out.status.code(), Some(2));

    let rules = tmp.path().join("rules");
    std::fs::create_dir_all(&rules).expect("rules dir");
    std::fs::write(
        rules.join("bad.toml"),
        "[[rule]]\nname = \"x\"\non = [\"bot.nope\"]\n",
    )
    .expect("write");
    let out = Command::new(crate::common::bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(&data)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HANDOFF_BRIDGE__RULES__DIR", &rules)
        .output()
        .expect("run serve");
    assert_eq!(
        out.status.code(),
        Some(2),
        "bad rules are invalid configuration"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad.toml:1: rule[0] (x).on[0]: `bot.nope` is not a webhook event type"),
        "{stderr}"
    );
    assert!(!data.join("store").exists(), "nothing was created");
}

#[test]
fn admin_query_strings_that_do_not_parse_get_the_json_error_body() {
    let app = TestApp::spawn();
    for path in [
        "/admin/v1/inbox/drained?timeout_ms=abc",
        "/admin/v1/outbox/idle?timeout_ms=-1",
    ] {
        let (status, body) = app.admin_get(path);
        assert_eq!(status, 400, "{path}: {body}");
        assert_eq!(body["error"]["code"], "invalid_query", "{path}: {body}");
    }
    // A list's page size has the lists' own code (issue 21).
    let (status, body) = app.admin_get("/admin/v1/outbox/done?limit=abc");
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "invalid_limit", "{body}");
    let mut resp = app
        .agent
        .post(app.admin_url("/admin/v1/replay?from=0"))
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .send_empty()
        .expect("POST");
    assert_eq!(resp.status().as_u16(), 400);
    let body: Value =
        serde_json::from_str(&resp.body_mut().read_to_string().unwrap_or_default()).expect("JSON");
    assert_eq!(body["error"]["code"], "invalid_query", "{body}");
}
