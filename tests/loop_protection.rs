//! Loop protection end to end, on the real daemon with its embedded emulator, which echoes every
//! message the bridge sends as a `bot.message.sent` webhook (with the request's `custom` in the
//! echo's `meta.custom`), as the service does.
//!
//! - A rule on `bot.message.sent` that sends a message does not loop: the bridge marks what it
//!   sends, and rules without `echoes = true` never see those echoes.
//! - A rule with `echoes = true` that answers its own echo is stopped by its firing cap: exactly
//!   `count` messages go out, and the cap hit shows in the metric, the log and the state.

mod common;
use common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

/// A conversation of the emulator's default seed.
const CONV: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";

/// A daemon on a fresh data directory with `rules` as its one rule file.
fn spawn(root: &Path, rules: &str) -> TestApp {
    let dir = root.join("rules");
    std::fs::create_dir_all(&dir).expect("rules dir");
    std::fs::write(dir.join("rules.toml"), rules).expect("rule file");
    TestApp::spawn_in(
        &root.join("data"),
        Spawn {
            env: vec![(
                "HANDOFF_BRIDGE__RULES__DIR".into(),
                dir.to_str().expect("utf-8 path").into(),
            )],
            ..Spawn::default()
        },
    )
}

fn emulator(app: &TestApp) -> &str {
    app.emulator_url
        .as_deref()
        .expect("the embedded emulator is the default upstream")
}

/// The user of [`CONV`] writes `text` (the emulator sends the webhook to the daemon).
fn say(app: &TestApp, text: &str) {
    let url = format!("{}/_emulator/conversations/{CONV}/say", emulator(app));
    let (status, body) = app.post_to(
        &url,
        json!({ "text": text }).to_string().as_bytes(),
        Some("application/json"),
    );
    assert_eq!(status, 200, "{body}");
}

/// The bodies of the messages the daemon sent into [`CONV`] that took effect at the emulator, in
/// journal order.
fn sent(app: &TestApp) -> Vec<Value> {
    let mut resp = app
        .agent
        .get(format!("{}/_emulator/journal", emulator(app)))
        .call()
        .expect("journal");
    assert_eq!(resp.status().as_u16(), 200);
    let entries: Vec<Value> = resp.body_mut().read_json().expect("journal JSON");
    entries
        .into_iter()
        .filter(|e| {
            e["endpoint"] == "send-conversation-message"
                && e["path"].as_str().is_some_and(|p| p.contains(CONV))
                && e["fault"].is_null()
                && e["replayed"] == false
                && e["status"]
                    .as_u64()
                    .is_some_and(|s| (200..300).contains(&s))
        })
        .map(|e| e["body"].clone())
        .collect()
}

fn texts(bodies: &[Value]) -> Vec<&str> {
    bodies
        .iter()
        .filter_map(|b| b["message"]["text"].as_str())
        .collect()
}

fn state(app: &TestApp) -> Value {
    let (status, state) = app.admin_get(&format!("/admin/v1/conversations/{CONV}"));
    assert_eq!(status, 200, "{state}");
    state
}

/// Poll `check` until it gives a value; fail after `limit`.
fn wait_for<T>(what: &str, limit: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(found) = check() {
            return found;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Every event folded, every decided action carried out, the echoes of those actions delivered
/// and folded, and whatever those echoes decided carried out too: one more round of a loop would
/// show in the journal. Each step answers when it is done, not by polling.
fn settle(app: &TestApp) {
    wait_drained(app);
    let idle = |app: &TestApp| {
        let (status, idle) = app.admin_get("/admin/v1/outbox/idle?timeout_ms=30000");
        assert_eq!(status, 200, "outbox not idle: {idle}");
    };
    idle(app);
    let mut resp = app
        .agent
        .get(format!(
            "{}/_emulator/webhook/flushed?timeout_ms=30000",
            emulator(app)
        ))
        .call()
        .expect("flushed");
    assert_eq!(
        resp.status().as_u16(),
        200,
        "{:?}",
        resp.body_mut().read_to_string()
    );
    wait_drained(app);
    idle(app);
}

const NO_LOOP: &str = r#"
[[rule]]
name = "ack"
on = ["bot.message.received"]
when = { field = "sender", equals = "user" }
actions = [{ type = "send_message", text = "got it" }]

[[rule]]
name = "relay"
on = ["bot.message.sent"]
actions = [{ type = "send_message", text = "relay: {{ message.data.text }}" }]
"#;

#[test]
fn a_rule_on_sent_messages_does_not_answer_the_bridges_own() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = spawn(tmp.path(), NO_LOOP);
    say(&app, "hello");
    // The echo of "got it" is folded: the state counts it as a bot message.
    wait_for("the echo folded", Duration::from_secs(30), || {
        let (_, state) = app.admin_get(&format!("/admin/v1/conversations/{CONV}"));
        (state["messages"]["bot_messages"] == 1).then_some(())
    });
    settle(&app);
    let bodies = sent(&app);
    assert_eq!(
        texts(&bodies),
        ["got it"],
        "one send for the user's message"
    );
    // The send named its action in `custom`, which the service echoed back.
    let custom = bodies[0]["custom"].as_str().unwrap_or_default();
    assert!(
        custom.starts_with("handoff-bridge:") && custom.ends_with("/ack/0"),
        "{custom}"
    );
    let done = state(&app);
    assert_eq!(done["messages"]["user_messages"], 1);
    assert_eq!(
        done["messages"]["bot_messages"], 1,
        "the echo is still folded"
    );
    assert!(done["firings"].get("ack").is_some(), "{done}");
    assert!(done["firings"].get("relay").is_none(), "{done}");
    assert_eq!(done["capped"], json!({}));
    assert_eq!(
        app.metric(r#"handoff_rule_caps_hit_total{rule="relay"}"#),
        0.0
    );
}

const CHATTER: &str = r#"
[[rule]]
name = "chatter"
on = ["bot.message.received", "bot.message.sent"]
echoes = true
max_firings = { count = 3, per = "10m" }
actions = [{ type = "send_message", text = "again" }]
"#;

#[test]
fn a_rule_that_answers_its_own_echoes_stops_at_its_cap() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = spawn(tmp.path(), CHATTER);
    let metric = r#"handoff_rule_caps_hit_total{rule="chatter"}"#;
    say(&app, "start");
    wait_for("the cap hit", Duration::from_secs(30), || {
        (app.metric(metric) >= 1.0).then_some(())
    });
    settle(&app);
    assert_eq!(texts(&sent(&app)), ["again"; 3], "exactly `count` sends");
    assert_eq!(app.metric(metric), 1.0, "the loop ended at the first hit");
    let done = state(&app);
    assert_eq!(done["messages"]["bot_messages"], 3, "every echo folded");
    let hit = &done["capped"]["chatter"];
    assert_eq!(hit["hits"], 1, "{done}");
    assert_eq!(hit["fired"], 3, "{done}");
    assert_eq!(hit["cap"], json!({ "count": 3, "per": "10m" }), "{done}");
    let held_back = hit["event"].as_str().expect("the event it held back");
    assert_eq!(
        done["firings"]["chatter"]["at"].as_array().map(Vec::len),
        Some(3),
        "{done}"
    );
    let logs = app.terminate_and_logs();
    let line = logs
        .lines()
        .find(|l| l.contains("rule firing cap reached"))
        .unwrap_or_else(|| panic!("no cap warning in:\n{logs}"));
    for needle in ["WARN", "chatter", CONV, held_back] {
        assert!(line.contains(needle), "{needle} missing: {line}");
    }
}
