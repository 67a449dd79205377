//! Loop protection end to end, on the real daemon with its embedded emulator, which echoes every
//! message the bridge sends as a `bot.message.sent` webhook (with the request's `custom` in the
//! echo's `meta.custom`), as the service does.
//!
//! - A rule on `bot.message.sent` that sends a message does not loop: the bridge marks what it
//!   sends, and rules without `echoes = true` never see those echoes.
//! - A rule with `echoes = true` that answers its own echo is stopped by its firing cap: exactly
//!   `count` messages go out, and the cap hit shows in the metric, the log, the state and the
//!   audit.
//! - An action whose template fails at run time is recorded: the audit shows the error for that
//!   action, the rule's other actions still ran, and a metric counts it.

use crate::common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

/// A conversation of the emulator's default seed.
const CONV: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";

/// A daemon on a fresh data directory with `rules` as its one rule file.
fn spawn(root: &Path, rules: &str) -> TestApp {
    spawn_as(root, rules, false)
}

/// [`spawn`], in a process of its own when `own_process` (a test that reads its log).
fn spawn_as(root: &Path, rules: &str, own_process: bool) -> TestApp {
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
            own_process,
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
    // The audit shows the echo as one, and `relay` as not run for it.
    let timeline = audit(&app);
    let echo = timeline
        .iter()
        .find(|e| e["type"] == "bot.message.sent")
        .unwrap_or_else(|| panic!("the echo is in the timeline: {timeline:?}"));
    let of = echo["echo_of"].as_str().expect("echo_of");
    assert!(of.ends_with("/ack/0"), "{echo}");
    let relay = rule_in(echo, "relay");
    assert_eq!(relay["matched"], false, "{echo}");
    assert_eq!(relay["echo_of"], of, "{echo}");
}

/// The audit's timeline for [`CONV`].
fn audit(app: &TestApp) -> Vec<Value> {
    let (status, audit) = app.admin_get(&format!("/admin/v1/conversations/{CONV}/audit"));
    assert_eq!(status, 200, "{audit}");
    audit["timeline"].as_array().cloned().expect("timeline")
}

/// The line of `rule` in a timeline event.
fn rule_in(event: &Value, rule: &str) -> Value {
    event["rules"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["rule"] == rule).cloned())
        .unwrap_or_else(|| panic!("{rule} not in {event}"))
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
    // Its own process: the test reads the daemon's log.
    let app = spawn_as(tmp.path(), CHATTER, true);
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
    // The audit, rebuilt as the fold decided, shows the held-back event's rule as capped, and
    // the three before it as fired.
    let timeline = audit(&app);
    let capped = timeline
        .iter()
        .find(|e| e["event_id"] == held_back)
        .expect("the held-back event is in the timeline");
    let line = rule_in(capped, "chatter");
    assert_eq!(line["capped"], true, "{line}");
    assert_eq!(line["fired"], 3, "{line}");
    assert_eq!(line["cap"], json!({ "count": 3, "per": "10m" }), "{line}");
    assert!(
        line.get("actions").is_none(),
        "a capped rule decides nothing: {line}"
    );
    let fired = timeline
        .iter()
        .filter(|e| {
            e["rules"].as_array().is_some_and(|r| {
                r.iter()
                    .any(|r| r["rule"] == "chatter" && r["actions"] == json!(["send_message"]))
            })
        })
        .count();
    assert_eq!(fired, 3, "{timeline:?}");
    let logs = app.terminate_and_logs();
    let line = logs
        .lines()
        .find(|l| l.contains("rule firing cap reached"))
        .unwrap_or_else(|| panic!("no cap warning in:\n{logs}"));
    for needle in ["WARN", "chatter", CONV, held_back] {
        assert!(line.contains(needle), "{needle} missing: {line}");
    }
}

const PARTLY_BROKEN: &str = r#"
[[rule]]
name = "greet"
on = ["bot.message.received"]
when = { field = "sender", equals = "user" }
actions = [
  { type = "send_message", text = "hello" },
  { type = "send_message", text = "your order {{ state.params.orderNo }}" },
  { type = "update_state", add_labels = ["greeted"] },
]
"#;

#[test]
fn a_template_that_fails_at_run_time_is_recorded_and_the_rest_of_the_rule_runs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = spawn(tmp.path(), PARTLY_BROKEN);
    say(&app, "hi");
    settle(&app);
    // The rule's other actions ran: the message went out, the label is set.
    assert_eq!(texts(&sent(&app)), ["hello"]);
    let done = state(&app);
    assert_eq!(done["labels"], json!(["greeted"]), "{done}");
    // The failure is kept in the state, with the id the action would have had.
    let kept = done["template_errors"].as_array().expect("template_errors");
    assert_eq!(kept.len(), 1, "{done}");
    let id = kept[0]["id"].as_str().expect("id");
    assert!(id.ends_with("/greet/1"), "{id}");
    assert_eq!(
        app.metric(r#"handoff_rule_template_errors_total{rule="greet"}"#),
        1.0
    );
    // The audit shows it among the event's actions, after the one that ran.
    let timeline = audit(&app);
    let event = timeline
        .iter()
        .find(|e| e["type"] == "bot.message.received")
        .expect("the user's message is in the timeline");
    let actions = event["actions"].as_array().expect("actions");
    let outcomes: Vec<(&str, &str, &str)> = actions
        .iter()
        .map(|a| {
            (
                a["id"].as_str().unwrap_or(""),
                a["type"].as_str().unwrap_or(""),
                a["status"].as_str().unwrap_or(""),
            )
        })
        .collect();
    let first = id.replace("/greet/1", "/greet/0");
    assert_eq!(
        outcomes,
        [
            (first.as_str(), "send_message", "done"),
            (id, "send_message", "template_error")
        ],
        "{event}"
    );
    let error = actions[1]["error"].as_str().expect("error");
    assert!(error.contains("undefined"), "{error}");
    // The rule's line: matched, the failed action in its place.
    let greet = rule_in(event, "greet");
    assert_eq!(greet["matched"], true, "{greet}");
    assert_eq!(greet["actions"][0], "send_message", "{greet}");
    assert!(greet["actions"][1]["template_error"].is_string(), "{greet}");
    assert_eq!(greet["actions"][2], "update_state", "{greet}");
}
