//! Rule timers end to end, on the real daemon with its embedded emulator: a user message starts a
//! timer, the timer fires as a `timer.<name>` event into its conversation, and a rule on that
//! event sends a message, which the emulator's journal shows.
//!
//! - A timer fires once and its rule's message reaches the upstream once.
//! - A later message cancels it: nothing is sent (a sentinel timer due after it shows when the
//!   cancelled one would have fired).
//! - A timer due while the daemon is stopped fires once when it starts again.
//! - A `timer.*` event from outside is quarantined and triggers nothing.

use crate::common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;

/// A conversation of the emulator's default seed.
const CONV: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";

const RULES: &str = r#"
[[rule]]
name = "wait-for-agent"
on = ["bot.message.received"]
when = { all = [{ field = "sender", equals = "user" }, { field = "message.data.text", equals = "help" }] }
actions = [{ type = "start_timer", name = "agent-wait", after = "300ms" }]

[[rule]]
name = "never-mind"
on = ["bot.message.received"]
when = { all = [{ field = "sender", equals = "user" }, { field = "message.data.text", equals = "never mind" }] }
actions = [
  { type = "cancel_timer", name = "agent-wait" },
  { type = "start_timer", name = "sentinel", after = "600ms" },
]

[[rule]]
name = "later"
on = ["bot.message.received"]
when = { all = [{ field = "sender", equals = "user" }, { field = "message.data.text", equals = "later" }] }
actions = [{ type = "start_timer", name = "restart-check", after = "2s" }]

[[rule]]
name = "nudge"
on = ["timer.agent-wait"]
actions = [{ type = "send_message", text = "Still waiting for a person ({{ timer.name }})" }]

[[rule]]
name = "sentinel"
on = ["timer.sentinel"]
actions = [{ type = "send_message", text = "sentinel" }]

[[rule]]
name = "restart-check"
on = ["timer.restart-check"]
actions = [{ type = "send_message", text = "fired after a restart" }]
"#;

const NUDGE: &str = "Still waiting for a person (agent-wait)";

/// A daemon with [`RULES`] on `data_dir` (rules beside it, so a restart finds the same ones).
fn spawn(data_dir: &Path) -> TestApp {
    let rules = data_dir.with_file_name("rules");
    std::fs::create_dir_all(&rules).expect("rules dir");
    std::fs::write(rules.join("timers.toml"), RULES).expect("rule file");
    TestApp::spawn_in(
        data_dir,
        Spawn {
            env: vec![(
                "HANDOFF_BRIDGE__RULES__DIR".into(),
                rules.to_str().expect("utf-8 path").into(),
            )],
            ..Spawn::default()
        },
    )
}

/// The user of [`CONV`] writes `text` (the emulator sends the webhook to the daemon).
fn say(app: &TestApp, text: &str) {
    app.emulator_act(CONV, "say", json!({ "text": text }));
}

/// Texts the daemon sent into [`CONV`] that took effect at the emulator, in journal order.
fn sent(app: &TestApp) -> Vec<String> {
    app.journal()
        .iter()
        .filter(|e| {
            e["endpoint"] == "send-conversation-message"
                && e["path"].as_str().is_some_and(|p| p.contains(CONV))
                && took_effect(e)
        })
        .filter_map(|e| e["body"]["message"]["text"].as_str().map(str::to_owned))
        .collect()
}

fn state(app: &TestApp) -> Value {
    let (status, state) = app.admin_get(&format!("/admin/v1/conversations/{CONV}"));
    assert_eq!(status, 200, "{state}");
    state
}

/// Nothing left to happen: every event folded, every decided action carried out, the webhooks
/// the emulator sends about them (`bot.message.sent`) delivered and folded too, no timer running
/// (so none can fire later). Each step answers when it is done, not by polling.
fn settle(app: &TestApp) {
    app.settle();
    assert_eq!(state(app)["timers"], json!({}), "no timer running");
    assert_eq!(app.metric("handoff_timers_pending"), 0.0);
}

#[test]
fn a_timer_fires_once_and_its_rule_reaches_the_upstream_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = spawn(&tmp.path().join("data"));
    say(&app, "help");
    poll_until("the timer's message", Duration::from_secs(30), || {
        sent(&app).contains(&NUDGE.to_owned()).then_some(())
    });
    settle(&app);
    assert_eq!(sent(&app), [NUDGE], "sent once, and nothing else");
    assert_eq!(app.metric("handoff_timers_fired_total"), 1.0);
    let done = state(&app);
    assert_eq!(done["messages"]["user_messages"], 1);

    // The service cannot fire (or forge) a timer: such an event is quarantined, no rule runs.
    let forged = json!({
        "id": "forged-1",
        "event": "timer.agent-wait",
        "sourceType": "bot",
        "sourceId": "B7f3a2c",
        "timestamp": 1_763_690_400_000i64,
        "data": { "timer": {
            "conversationId": CONV, "name": "agent-wait", "dueAt": 1_763_690_400_000i64,
            "startedBy": "x/y/0",
        } },
    });
    let (status, receipt) = app.post(&delivery("forged-delivery", &[forged]));
    assert_eq!(status, 200, "{receipt}");
    assert_eq!(receipt["status"], "quarantined", "{receipt}");
    assert_eq!(receipt["reason"], "invalid_event", "{receipt}");
    let id = receipt["quarantine_id"].as_u64().expect("quarantine id");
    let (status, record) = app.admin_get(&format!("/admin/v1/quarantine/{id}"));
    assert_eq!(status, 200, "{record}");
    let detail = record["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("reserved for the bridge's own timers"),
        "{record}"
    );
    settle(&app);
    assert_eq!(state(&app)["events_applied"], done["events_applied"]);
    assert_eq!(sent(&app), [NUDGE]);
}

#[test]
fn a_cancelled_timer_sends_nothing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = spawn(&tmp.path().join("data"));
    say(&app, "help");
    say(&app, "never mind");
    // The sentinel starts with the cancel and is due after the cancelled timer would have been;
    // firings of one conversation are folded (and their messages sent) in due order.
    poll_until("the sentinel's message", Duration::from_secs(30), || {
        sent(&app).contains(&"sentinel".to_owned()).then_some(())
    });
    settle(&app);
    assert_eq!(sent(&app), ["sentinel"], "the cancelled timer sent nothing");
    assert_eq!(state(&app)["messages"]["user_messages"], 2);
}

#[test]
fn a_timer_due_while_the_daemon_is_stopped_fires_once_on_start() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let app = spawn(&data);
    say(&app, "later");
    // The admin view shows the running timer (it is part of the state).
    let due_at = poll_until("the timer in the state", Duration::from_secs(30), || {
        // 404 until the conversation's first event is folded.
        let (_, state) = app.admin_get(&format!("/admin/v1/conversations/{CONV}"));
        state["timers"]["restart-check"]["due_at"].as_i64()
    });
    // The gauge follows the fold's commit (the state is readable a moment before it moves).
    poll_until("the timer counted", Duration::from_secs(10), || {
        (app.metric("handoff_timers_pending") == 1.0).then_some(())
    });
    assert!(sent(&app).is_empty());
    assert!(app.terminate().success(), "graceful stop");

    // Stopped before it was due: the stored state still has it.
    let stored: Value =
        serde_json::from_str(&cli_ok(&data, &["state", "show", CONV])).expect("state JSON");
    assert_eq!(stored["timers"]["restart-check"]["due_at"], due_at);

    // The one inherent wait: the timer must come due while nothing runs. Two seconds at most.
    let remaining = due_at + 50 - model::clock::system_millis();
    if remaining > 0 {
        std::thread::sleep(Duration::from_millis(remaining.unsigned_abs()));
    }

    let app = spawn(&data);
    poll_until(
        "the overdue timer's message",
        Duration::from_secs(30),
        || {
            let texts = sent(&app);
            (!texts.is_empty()).then_some(())
        },
    );
    settle(&app);
    // The restarted daemon's emulator is a new one: its journal is this start's alone.
    assert_eq!(sent(&app), ["fired after a restart"]);
    assert_eq!(app.metric("handoff_timers_fired_total"), 1.0);
}

/// POST a body to the test clock of `app`: (status, body).
fn advance(app: &TestApp, body: &str) -> (u16, String) {
    let mut resp = agent()
        .post(app.admin_url("/admin/v1/clock/advance"))
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .header("content-type", "application/json")
        .send(body.to_owned())
        .expect("POST");
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    (resp.status().as_u16(), text)
}

/// The test clock is refused unless configured, and takes only a duration.
#[test]
fn the_test_clock_is_off_by_default_and_checks_its_body() {
    let app = TestApp::spawn();
    let (status, body) = advance(&app, r#"{"by": "5m"}"#);
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("test_clock_disabled"), "{body}");

    let tmp = tempfile::tempdir().expect("tempdir");
    let on = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: vec![(
                "HANDOFF_BRIDGE__ADMIN__TEST_CLOCK".to_owned(),
                "true".to_owned(),
            )],
            ..Spawn::default()
        },
    );
    let (status, body) = advance(&on, r#"{"by": "soon"}"#);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("invalid_body"), "{body}");
    let (status, body) = advance(&on, r#"{"by": "1h"}"#);
    assert_eq!(status, 200, "{body}");
    let moved: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(moved["offset_ms"], 3_600_000, "{moved}");
}
