//! The shipped agent handoff (`rules/*.toml`), end to end on the real daemon with its embedded
//! emulator: the emulator's user and agent act (webhooks in), the journal shows the Open API
//! calls the rules made (calls out). The shipped files are used as they are (for the after-hours
//! cases every day is closed), adapted only through their settings; the daemon runs on the test
//! clock, so the waits (minutes, a day) run out when a test moves the clock.

use crate::common::helpdesk::HelpDesk;
use crate::common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A web conversation of the emulator's default seed, its bot's fallback and survey flows.
const CONV: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
const FALLBACK_FLOW: &str = "2";
const AFTERCARE_FLOW: &str = "9";

/// The shipped rules, copied as they are; `edit` may change them.
fn rules(root: &Path, edit: impl Fn(&str, String) -> String) -> PathBuf {
    let dir = root.join("rules");
    std::fs::create_dir_all(&dir).expect("rules dir");
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("rules");
    for entry in std::fs::read_dir(&shipped).expect("rules/") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "toml") {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .expect("name")
                .to_owned();
            let text = std::fs::read_to_string(&path).expect("read");
            std::fs::write(dir.join(&name), edit(&name, text)).expect("write");
        }
    }
    dir
}

/// The daemon on `rules`, with `settings` overridden, and the test clock on: the shipped waits
/// (5 minutes, 10, 20, a day) run out when a test moves the clock, not in real time.
fn spawn(root: &Path, rules: &Path, settings: &[(&str, &str)]) -> TestApp {
    spawn_with(root, rules, settings, Vec::new())
}

/// The daemon on the shipped rules as they are, with `settings` overridden (see [`spawn`]); the
/// directory lives as long as the returned guard.
fn shipped(settings: &[(&str, &str)]) -> (tempfile::TempDir, TestApp) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules(tmp.path(), |_, t| t);
    let app = spawn(tmp.path(), &rules, settings);
    (tmp, app)
}

/// [`spawn`] with more command-line arguments (a `--config` file).
fn spawn_with(root: &Path, rules: &Path, settings: &[(&str, &str)], args: Vec<String>) -> TestApp {
    let mut env = vec![
        (
            "HANDOFF_BRIDGE__RULES__DIR".to_owned(),
            rules.to_str().expect("utf-8").to_owned(),
        ),
        (
            "HANDOFF_BRIDGE__ADMIN__TEST_CLOCK".to_owned(),
            "true".to_owned(),
        ),
    ];
    for (name, value) in settings {
        env.push((
            format!("HANDOFF_BRIDGE__RULES__SETTINGS__{}", name.to_uppercase()),
            (*value).to_owned(),
        ));
    }
    TestApp::spawn_in(
        &root.join("data"),
        Spawn {
            env,
            args,
            ..Spawn::default()
        },
    )
}

/// The daemon as [`spawn`] makes it, sending help-desk events to `desk` (unsigned checks: the
/// help-desk tests own signatures).
fn spawn_with_desk(
    root: &Path,
    rules: &Path,
    settings: &[(&str, &str)],
    desk: &HelpDesk,
) -> TestApp {
    let config = root.join("bridge.toml");
    std::fs::write(
        &config,
        format!(
            "[[helpdesk.endpoints]]\nname = \"desk\"\nurl = \"{}\"\nsecrets = [\"{}\"]\n",
            desk.url,
            crate::common::helpdesk::OLD_SECRET
        ),
    )
    .expect("config");
    spawn_with(
        root,
        rules,
        settings,
        vec!["--config".into(), config.display().to_string()],
    )
}

/// The emulator's user or the service act on [`CONV`].
fn act(app: &TestApp, step: &str, body: Value) {
    app.emulator_act(CONV, step, body);
}

/// The calls the daemon made for [`CONV`] that took effect, in order: (endpoint, what).
fn calls(app: &TestApp) -> Vec<(String, String)> {
    calls_for(app, CONV)
}

/// The calls that took effect whose path or body names `key` (a conversation id, or a partner
/// user key).
fn calls_for(app: &TestApp, key: &str) -> Vec<(String, String)> {
    app.journal()
        .iter()
        .filter(|e| {
            (e["path"].as_str().is_some_and(|p| p.contains(key))
                || e["body"].to_string().contains(key))
                && took_effect(e)
                && e["method"] != "GET"
        })
        .map(|e| {
            let endpoint = e["endpoint"].as_str().unwrap_or_default().to_owned();
            let body = &e["body"];
            let what = match endpoint.as_str() {
                "send-conversation-message" => body["message"]["text"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                "set-manual" => body["enabled"].to_string(),
                "set-navigation" => body["flowId"].to_string(),
                "pb-send-message" => body["message"]["text"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                "pb-block" | "pb-unblock" | "pb-remove-session" => String::new(),
                _ => body.to_string(),
            };
            (endpoint, what)
        })
        .collect()
}

/// Poll the journal until `want` holds; fail after `limit`.
fn wait_for(
    app: &TestApp,
    what: &str,
    limit: Duration,
    want: impl Fn(&[(String, String)]) -> bool,
) {
    wait_for_in(app, CONV, what, limit, want)
}

fn wait_for_in(
    app: &TestApp,
    key: &str,
    what: &str,
    limit: Duration,
    want: impl Fn(&[(String, String)]) -> bool,
) {
    poll_until(what, limit, || want(&calls_for(app, key)).then_some(()));
}

/// The connected agent writes `text` into `conv` (the service reports it as `bot.message.sent`
/// with `meta.sender`; the emulator has no agent-side endpoint, so the test posts the webhook).
fn agent_says(app: &TestApp, conv: &str, n: u32, text: &str) {
    let event = json!({
        "id": format!("agent-event-{conv}-{n}"),
        "event": "bot.message.sent",
        "sourceType": "bot",
        "sourceId": "B7f3a2c",
        "timestamp": 1_763_690_470_000i64 + i64::from(n),
        "data": {"message": {
            "id": format!("agent-message-{conv}-{n}"),
            "conversationId": conv,
            "data": {"type": "text", "text": text},
            "meta": {"sender": {"userKey": "U3f9c21", "platform": "closer-chat"}},
            "isUser": false,
            "timestamp": 1_763_690_470_000i64 + i64::from(n),
        }},
    });
    let (status, receipt) = app.post(&delivery(&format!("agent-delivery-{conv}-{n}"), &[event]));
    assert_eq!(status, 200, "{receipt}");
}

fn state(app: &TestApp) -> Value {
    state_of(app, CONV)
}

fn state_of(app: &TestApp, conv: &str) -> Value {
    let (status, state) = app.admin_get(&format!("/admin/v1/conversations/{conv}"));
    assert_eq!(status, 200, "{state}");
    state
}

fn call(endpoint: &str, what: &str) -> (String, String) {
    (endpoint.to_owned(), what.to_owned())
}

fn setting(name: &str) -> String {
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("rules/settings.toml"))
            .expect("settings.toml");
    let table: toml::Table = toml::from_str(&text).expect("settings TOML");
    table["settings"][name]
        .as_str()
        .expect("a text setting")
        .to_owned()
}

/// What a user hears on joining the queue at `position` while the bot has no accept rate yet:
/// the queue text and their place in line.
fn queued(position: u32) -> String {
    format!(
        "{} {}",
        setting("queue_text"),
        setting("queue_position_text").replace("{position}", &position.to_string())
    )
}

#[test]
fn nobody_answers_in_time_the_user_is_told_and_the_bot_takes_over_in_the_fallback_flow() {
    let (_tmp, app) = shipped(&[
        ("check_business_hours", "false"),
        ("fallback_flow_id", FALLBACK_FLOW),
    ]);
    act(&app, "request-agent", json!({}));
    // Five minutes at once: the place-in-line update (every 2 minutes) comes due first, once,
    // then the wait runs out and stops the updates.
    app.advance_clock("5m");
    wait_for(&app, "the fallback", Duration::from_secs(30), |c| {
        c.contains(&call("set-navigation", FALLBACK_FLOW))
    });
    app.settle();
    assert_eq!(
        calls(&app),
        [
            call("set-manual", "true"),
            call("send-conversation-message", &queued(1)),
            call(
                "send-conversation-message",
                &setting("queue_position_text").replace("{position}", "1")
            ),
            call("set-manual", "false"),
            call("send-conversation-message", &setting("no_agent_text")),
            call("set-navigation", FALLBACK_FLOW),
        ]
    );
    let state = state(&app);
    assert_eq!(state["timers"], json!({}), "{state}");
    assert_eq!(state["labels"], json!([]), "{state}");

    // The audit timeline tells the story: the request, the rules that matched and why the
    // others did not, the timer's event, and each action's outcome.
    let audit: Value = serde_json::from_str(&app.cli_ok(&["audit", CONV])).expect("audit JSON");
    let timeline = audit["timeline"].as_array().expect("timeline");
    let requested = timeline
        .iter()
        .find(|e| e["type"] == "bot.conversation.agent_call_requested")
        .expect("the request is in the timeline");
    let rule = |event: &Value, name: &str| {
        event["rules"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["rule"] == name).cloned())
            .unwrap_or_else(|| panic!("{name} not evaluated: {event}"))
    };
    assert_eq!(rule(requested, "agent-requested")["matched"], true);
    let closed = rule(requested, "after-hours");
    assert_eq!(closed["matched"], false);
    assert_eq!(closed["failed"]["at"], "when.all[0]", "{closed}");
    assert_eq!(
        closed["failed"]["actual"], false,
        "check_business_hours is off: {closed}"
    );
    let statuses: Vec<(&str, &str)> = requested["actions"]
        .as_array()
        .expect("actions")
        .iter()
        .map(|a| {
            (
                a["type"].as_str().unwrap_or(""),
                a["status"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(statuses, [("set_manual", "done"), ("send_message", "done")]);
    let fired = timeline
        .iter()
        .find(|e| e["type"] == "timer.agent-wait")
        .expect("the timer's event is in the timeline");
    assert_eq!(rule(fired, "no-agent")["matched"], true);
    // A matched rule shows the conditions that held, with the values seen.
    let fallback = rule(fired, "no-agent-fallback");
    assert_eq!(fallback["matched"], true);
    let conditions: Vec<(String, String)> = fallback["conditions"]
        .as_array()
        .expect("conditions")
        .iter()
        .map(|c| {
            (
                c["test"].as_str().unwrap_or("").to_owned(),
                c["actual"].to_string(),
            )
        })
        .collect();
    assert_eq!(
        conditions,
        [
            (
                "state.phase not_equals \"connected\"".to_owned(),
                "\"requested\"".to_owned()
            ),
            (
                "settings.fallback_flow_id gt 0".to_owned(),
                FALLBACK_FLOW.to_owned()
            ),
        ],
        "{fallback}"
    );
    assert_eq!(fallback["actions"], json!(["navigate"]), "{fallback}");
    let done: Vec<&str> = fired["actions"]
        .as_array()
        .expect("actions")
        .iter()
        .filter(|a| a["status"] == "done")
        .filter_map(|a| a["type"].as_str())
        .collect();
    assert_eq!(done, ["set_manual", "send_message", "navigate"]);
}

#[test]
fn an_agent_in_time_cancels_the_wait_and_the_end_of_the_call_leads_to_after_care() {
    let (_tmp, app) = shipped(&[
        ("check_business_hours", "false"),
        ("fallback_flow_id", FALLBACK_FLOW),
        ("aftercare_flow_id", AFTERCARE_FLOW),
    ]);
    // Connect in time. The request's own calls go first.
    act(&app, "request-agent", json!({}));
    app.settle();
    act(&app, "agent-connect", json!({}));
    app.settle();
    let connected = state(&app);
    assert_eq!(
        connected["timers"],
        json!({}),
        "the wait is cancelled: {connected}"
    );
    assert_eq!(connected["labels"], json!(["with-agent"]), "{connected}");
    // Past the wait: it was cancelled, so no apology and no fallback.
    app.advance_clock("5m");
    act(&app, "agent-end", json!({}));
    wait_for(&app, "the after-care flow", Duration::from_secs(30), |c| {
        c.contains(&call("set-navigation", AFTERCARE_FLOW))
    });
    app.settle();
    assert_eq!(
        calls(&app),
        [
            call("set-manual", "true"),
            call("send-conversation-message", &queued(1)),
            call("set-manual", "false"),
            call("set-navigation", AFTERCARE_FLOW),
        ],
        "no apology, no fallback: the agent came in time"
    );
    assert_eq!(state(&app)["labels"], json!([]));
}

#[test]
fn outside_business_hours_a_request_is_not_queued() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // Every day closed, whatever the clock says.
    let rules = rules(tmp.path(), |name, text| {
        if name == "hours.toml" {
            text.replace("[\"09:00-18:00\"]", "[]")
        } else {
            text
        }
    });
    let app = spawn(tmp.path(), &rules, &[("fallback_flow_id", FALLBACK_FLOW)]);
    act(&app, "say", json!({"text": "can I talk to an agent?"}));
    wait_for(&app, "the fallback", Duration::from_secs(30), |c| {
        c.contains(&call("set-navigation", FALLBACK_FLOW))
    });
    app.settle();
    assert_eq!(
        calls(&app),
        [
            call("set-manual", "false"),
            call("send-conversation-message", &setting("after_hours_text")),
            call("set-navigation", FALLBACK_FLOW),
        ],
        "told the hours, never queued"
    );
    let state = state(&app);
    assert_eq!(state["timers"], json!({}), "no wait timed: {state}");
    assert_eq!(state["labels"], json!(["asked-after-hours"]), "{state}");
}

#[test]
fn a_user_who_cancels_before_an_agent_connects_is_cleaned_up_and_never_apologised_to() {
    let (_tmp, app) = shipped(&[("check_business_hours", "false")]);
    act(&app, "request-agent", json!({}));
    app.settle();
    act(&app, "cancel", json!({}));
    // The wait's time comes and goes: its timer was cancelled, nobody is apologised to.
    app.advance_clock("5m");
    app.settle();
    let state = state(&app);
    assert_eq!(state["timers"], json!({}), "the wait is cancelled: {state}");
    assert_eq!(state["labels"], json!([]), "{state}");
    assert_eq!(
        calls(&app),
        [
            call("set-manual", "true"),
            call("send-conversation-message", &queued(1)),
            call("set-manual", "false"),
        ]
    );
}

#[test]
fn a_silent_agent_is_waited_for_then_the_bot_takes_over_and_an_answer_stops_the_clock() {
    let (_tmp, app) = shipped(&[
        ("check_business_hours", "false"),
        ("fallback_flow_id", FALLBACK_FLOW),
        // No help desk is configured: its events are decided and recorded as done.
        ("notify_helpdesk", "true"),
    ]);
    act(&app, "request-agent", json!({}));
    app.settle();
    act(&app, "agent-connect", json!({}));
    app.settle();
    // The agent answers the first question at once: no reassurance for it.
    act(&app, "say", json!({"text": "where is my order?"}));
    app.emulator_delivered();
    assert!(
        state(&app)["timers"]["agent-quiet"].is_object(),
        "the question starts the clock"
    );
    agent_says(&app, CONV, 1, "Let me check.");
    app.settle();
    assert_eq!(
        state(&app)["timers"],
        json!({}),
        "the answer stopped the clock"
    );
    // The next question stays unanswered: reassurance after the first wait, the bot after the
    // second.
    act(&app, "say", json!({"text": "hello?"}));
    app.advance_clock("10m");
    wait_for(&app, "the reassurance", Duration::from_secs(30), |c| {
        c.contains(&call(
            "send-conversation-message",
            &setting("agent_quiet_text"),
        ))
    });
    app.advance_clock("20m");
    wait_for(&app, "the fallback", Duration::from_secs(30), |c| {
        c.contains(&call("set-navigation", FALLBACK_FLOW))
    });
    app.settle();
    assert_eq!(
        calls(&app),
        [
            call("set-manual", "true"),
            call("send-conversation-message", &queued(1)),
            call("send-conversation-message", &setting("agent_quiet_text")),
            call("set-manual", "false"),
            call("send-conversation-message", &setting("agent_gone_text")),
            call("set-navigation", FALLBACK_FLOW),
        ]
    );
    assert_eq!(state(&app)["labels"], json!([]));
    // The first wait also reminded the help desk, once.
    let audit: Value = serde_json::from_str(&app.cli_ok(&["audit", CONV])).expect("audit JSON");
    let reminders: Vec<Value> = audit["timeline"]
        .as_array()
        .expect("timeline")
        .iter()
        .filter(|e| e["type"] == "timer.agent-quiet")
        .flat_map(|e| e["actions"].as_array().cloned().unwrap_or_default())
        .filter(|a| a["type"] == "notify_helpdesk")
        .collect();
    assert_eq!(reminders.len(), 1, "{reminders:?}");
    assert_eq!(reminders[0]["status"], "done", "{reminders:?}");
    assert_eq!(
        reminders[0]["rule"], "agent-quiet-helpdesk",
        "{reminders:?}"
    );
}

#[test]
fn a_waiting_user_hears_their_place_in_line_again_until_an_agent_connects() {
    let (_tmp, app) = shipped(&[
        ("check_business_hours", "false"),
        ("queue_update_every", "2m"),
    ]);
    act(&app, "request-agent", json!({}));
    app.settle();
    let update = setting("queue_position_text").replace("{position}", "1");
    let updates = |c: &[(String, String)]| {
        c.iter()
            .filter(|(endpoint, text)| endpoint == "send-conversation-message" && *text == update)
            .count()
    };
    assert_eq!(
        updates(&calls(&app)),
        0,
        "no update before the first 2 minutes"
    );
    // Two updates within the 5-minute wait, one per 2 minutes.
    for n in 1..=2 {
        app.advance_clock("2m");
        wait_for(&app, "an update", Duration::from_secs(30), |c| {
            updates(c) >= n
        });
    }
    assert!(
        state(&app)["timers"]["queue-update"].is_object(),
        "the update timer restarts itself while the user waits"
    );
    act(&app, "agent-connect", json!({}));
    app.settle();
    let connected = state(&app);
    assert_eq!(
        connected["timers"],
        json!({}),
        "the connect stops the updates (and the wait): {connected}"
    );
    // Another 2 minutes: nothing more is said.
    app.advance_clock("2m");
    app.settle();
    let calls = calls(&app);
    assert_eq!(
        calls[..2],
        [
            call("set-manual", "true"),
            call("send-conversation-message", &queued(1)),
        ],
        "joining tells the place in line once, with the queue text"
    );
    assert_eq!(updates(&calls), 2, "{calls:?}");
    assert_eq!(calls.len(), 4, "only the two updates after that: {calls:?}");
}

/// Step 1 by keyword: a user who writes "상담원" during open hours is queued like an agent call,
/// and when nobody comes within the wait the bot takes over in the fallback flow.
#[test]
fn a_user_who_asks_for_an_agent_in_words_is_queued_then_handed_back_after_the_wait() {
    let (_tmp, app) = shipped(&[
        ("check_business_hours", "false"),
        ("fallback_flow_id", FALLBACK_FLOW),
    ]);
    act(&app, "say", json!({"text": "상담원 연결해 주세요"}));
    app.settle();
    assert_eq!(
        calls(&app),
        [
            call("set-manual", "true"),
            call("send-conversation-message", &setting("queue_text")),
        ],
        "manual on, the user is told they are queued"
    );
    let waiting = state(&app);
    assert_eq!(waiting["labels"], json!(["waiting-for-agent"]), "{waiting}");
    assert!(waiting["timers"]["agent-wait"].is_object(), "{waiting}");
    app.advance_clock("5m");
    wait_for(&app, "the fallback", Duration::from_secs(30), |c| {
        c.contains(&call("set-navigation", FALLBACK_FLOW))
    });
    app.settle();
    assert_eq!(
        calls(&app),
        [
            call("set-manual", "true"),
            call("send-conversation-message", &setting("queue_text")),
            call("set-manual", "false"),
            call("send-conversation-message", &setting("no_agent_text")),
            call("set-navigation", FALLBACK_FLOW),
        ]
    );
    let after = state(&app);
    assert_eq!(after["labels"], json!([]), "{after}");
    assert_eq!(after["timers"], json!({}), "{after}");
}

/// The waits are settings: with `agent_wait = "1m"` the wait runs out after one minute (the
/// shipped 5 minutes would not).
#[test]
fn an_operator_shortens_the_agent_wait_through_a_setting() {
    let (_tmp, app) = shipped(&[
        ("check_business_hours", "false"),
        ("fallback_flow_id", FALLBACK_FLOW),
        ("agent_wait", "1m"),
    ]);
    act(&app, "request-agent", json!({}));
    app.settle();
    let timer = state(&app)["timers"]["agent-wait"].clone();
    let due = timer["due_at"].as_i64().expect("due_at");
    let started = timer["started_at"].as_i64().expect("started_at");
    assert_eq!(due - started, 60_000, "{timer}");
    app.advance_clock("1m");
    wait_for(&app, "the fallback", Duration::from_secs(30), |c| {
        c.contains(&call("set-navigation", FALLBACK_FLOW))
    });
    app.settle();
    let calls = calls(&app);
    assert!(
        calls.contains(&call(
            "send-conversation-message",
            &setting("no_agent_text")
        )),
        "{calls:?}"
    );
    assert_eq!(state(&app)["timers"], json!({}));
}

/// A partner-messenger (kakaobiz) conversation of the seed, its user and channel.
const KB_CONV: &str = "5c0e9b1f-2222-4d3e-9f10-000000000002";
const KB_USER: &str = "kb-user-77a9f2";
const SENDER_KEY: &str = "sk-support-0001";

#[test]
fn partner_messenger_replies_are_relayed_a_session_end_is_honoured_and_abuse_is_blocked_for_a_while(
) {
    let (_tmp, app) = shipped(&[
        ("check_business_hours", "false"),
        ("partner_sender_key", SENDER_KEY),
    ]);
    // The agent call makes the conversation known (platform, user key), then the agent answers.
    app.emulator_act(KB_CONV, "request-agent", json!({}));
    app.settle();
    app.emulator_act(KB_CONV, "agent-connect", json!({}));
    app.settle();
    agent_says(&app, KB_CONV, 1, "안녕하세요, 무엇을 도와드릴까요?");
    wait_for_in(
        &app,
        KB_USER,
        "the relayed reply",
        Duration::from_secs(30),
        |c| c.contains(&call("pb-send-message", "안녕하세요, 무엇을 도와드릴까요?")),
    );
    // Abuse: blocked at once, unblocked when the day is over.
    app.emulator_act(KB_CONV, "say", json!({"text": "fuck you"}));
    wait_for_in(&app, KB_USER, "the block", Duration::from_secs(30), |c| {
        c.contains(&call("pb-block", ""))
    });
    app.advance_clock("24h");
    wait_for_in(&app, KB_USER, "the unblock", Duration::from_secs(30), |c| {
        c.contains(&call("pb-unblock", ""))
    });
    // The user ends the session.
    app.emulator_act(KB_CONV, "say", json!({"text": "!종료"}));
    wait_for_in(
        &app,
        KB_USER,
        "the session removal",
        Duration::from_secs(30),
        |c| c.contains(&call("pb-remove-session", "")),
    );
    app.settle();
    assert_eq!(
        calls_for(&app, KB_USER),
        [
            call("pb-send-message", "안녕하세요, 무엇을 도와드릴까요?"),
            call("pb-block", ""),
            call("pb-unblock", ""),
            call("pb-remove-session", ""),
        ]
    );
    let (status, state) = app.admin_get(&format!("/admin/v1/conversations/{KB_CONV}"));
    assert_eq!(status, 200, "{state}");
    assert_eq!(state["labels"], json!([]), "{state}");
}

#[test]
fn outside_business_hours_a_conversation_already_with_an_agent_is_left_alone() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules(tmp.path(), |name, text| {
        if name == "hours.toml" {
            text.replace("[\"09:00-18:00\"]", "[]")
        } else {
            text
        }
    });
    let app = spawn(tmp.path(), &rules, &[]);
    // An agent working late takes the conversation anyway.
    act(&app, "request-agent", json!({}));
    app.settle();
    act(&app, "agent-connect", json!({}));
    app.settle();
    let before = calls(&app);
    assert_eq!(
        before,
        [
            call("set-manual", "false"),
            call("send-conversation-message", &setting("after_hours_text")),
        ],
        "the request itself was answered with the hours"
    );
    // The user's keyword while connected must not hand the conversation back to the bot.
    act(&app, "say", json!({"text": "thanks, agent"}));
    app.settle();
    assert_eq!(calls(&app), before, "nothing more was done");
    assert_eq!(state(&app)["handoff"]["phase"]["value"], "connected");
}

/// A partner-messenger user nobody could take gets the call-back notification, its template's
/// variables filled in (the user has no `name` param: the default).
#[test]
fn a_partner_messenger_user_nobody_answered_gets_the_call_back_notification() {
    let (_tmp, app) = shipped(&[
        ("check_business_hours", "false"),
        ("partner_sender_key", SENDER_KEY),
        ("callback_template_code", "CALLBACK"),
        ("callback_time", "내일 오전"),
        ("fallback_flow_id", FALLBACK_FLOW),
    ]);
    app.emulator_act(KB_CONV, "request-agent", json!({}));
    app.advance_clock("5m");
    wait_for_in(
        &app,
        KB_USER,
        "the call-back",
        Duration::from_secs(30),
        |c| c.iter().any(|(endpoint, _)| endpoint == "notify-send"),
    );
    app.settle();
    let sent: Vec<Value> = app
        .journal()
        .into_iter()
        .filter(|e| e["endpoint"] == "notify-send" && took_effect(e))
        .collect();
    assert_eq!(sent.len(), 1, "{sent:?}");
    let body = &sent[0]["body"];
    assert_eq!(body["senderKey"], SENDER_KEY, "{body}");
    assert_eq!(body["templateCode"], "CALLBACK", "{body}");
    assert_eq!(body["recipient"], KB_USER, "{body}");
    assert_eq!(
        body["variables"],
        json!({"name": "고객", "time": "내일 오전"}),
        "{body}"
    );
}

/// Closed: a partner-messenger user asking for a person is told the hours, sent to the fallback
/// flow, and gets the call-back notification.
#[test]
fn outside_business_hours_a_partner_messenger_user_gets_the_call_back_notification() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules(tmp.path(), |name, text| {
        if name == "hours.toml" {
            text.replace("[\"09:00-18:00\"]", "[]")
        } else {
            text
        }
    });
    let app = spawn(
        tmp.path(),
        &rules,
        &[
            ("partner_sender_key", SENDER_KEY),
            ("callback_template_code", "CALLBACK"),
            ("fallback_flow_id", FALLBACK_FLOW),
        ],
    );
    app.emulator_act(KB_CONV, "request-agent", json!({}));
    wait_for_in(
        &app,
        KB_USER,
        "the call-back",
        Duration::from_secs(30),
        |c| c.iter().any(|(endpoint, _)| endpoint == "notify-send"),
    );
    app.settle();
    let sent: Vec<Value> = app
        .journal()
        .into_iter()
        .filter(|e| e["endpoint"] == "notify-send" && took_effect(e))
        .collect();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0]["body"]["recipient"], KB_USER, "{sent:?}");
    assert_eq!(
        sent[0]["body"]["variables"],
        json!({"name": "고객", "time": "영업시간 중"}),
        "the shipped defaults: {sent:?}"
    );
    // Told the hours and never queued: the bot keeps the conversation.
    let calls = calls_for(&app, KB_CONV);
    assert!(
        calls.contains(&call("set-manual", "false")),
        "bot kept on: {calls:?}"
    );
    assert!(
        !calls.contains(&call("set-manual", "true")),
        "never queued: {calls:?}"
    );
}

/// A partner-messenger user who floods (10 messages within a minute) is blocked once, and
/// unblocked a day later.
#[test]
fn a_partner_messenger_user_who_floods_is_blocked_once_and_unblocked_a_day_later() {
    let (_tmp, app) = shipped(&[
        ("check_business_hours", "false"),
        ("partner_sender_key", SENDER_KEY),
    ]);
    // The agent call makes the conversation known (platform, user key).
    app.emulator_act(KB_CONV, "request-agent", json!({}));
    app.settle();
    // Nine messages are fine; the tenth within the minute is a flood; more do not block again.
    for i in 1..=9 {
        app.emulator_act(KB_CONV, "say", json!({"text": format!("hello {i}")}));
    }
    app.settle();
    assert!(
        !calls_for(&app, KB_USER).contains(&call("pb-block", "")),
        "nine messages are not a flood"
    );
    for i in 10..=12 {
        app.emulator_act(KB_CONV, "say", json!({"text": format!("hello {i}")}));
    }
    app.settle();
    assert_eq!(
        calls_for(&app, KB_USER),
        [call("pb-block", "")],
        "blocked once"
    );
    let labels = state_of(&app, KB_CONV)["labels"].clone();
    assert!(
        labels
            .as_array()
            .is_some_and(|l| l.contains(&json!("flood-blocked"))),
        "{labels}"
    );
    app.advance_clock("24h");
    wait_for_in(&app, KB_USER, "the unblock", Duration::from_secs(30), |c| {
        c.contains(&call("pb-unblock", ""))
    });
    app.settle();
    let labels = state_of(&app, KB_CONV)["labels"].clone();
    assert!(
        !labels
            .as_array()
            .is_some_and(|l| l.contains(&json!("flood-blocked"))),
        "{labels}"
    );
    assert_eq!(
        calls_for(&app, KB_USER),
        [call("pb-block", ""), call("pb-unblock", "")]
    );
}

/// The help desk at `desk` got these `user.blocked` reasons, in order.
fn blocked_reasons(desk: &HelpDesk) -> Vec<String> {
    desk.accepted()
        .iter()
        .map(|r| r.json())
        .filter(|b| b["type"] == "user.blocked")
        .map(|b| b["data"]["reason"].as_str().unwrap_or("").to_owned())
        .collect()
}

/// A partner-messenger user's messages up to a flood, with the help desk told (`notify_helpdesk`):
/// nine plain messages, then `tenth`. Returns the daemon and the help desk.
fn flood_until(root: &Path, tenth: &str) -> (TestApp, HelpDesk) {
    let desk = HelpDesk::start(&[], 200);
    let rules = rules(root, |_, t| t);
    let app = spawn_with_desk(
        root,
        &rules,
        &[
            ("check_business_hours", "false"),
            ("partner_sender_key", SENDER_KEY),
            ("notify_helpdesk", "true"),
        ],
        &desk,
    );
    app.emulator_act(KB_CONV, "request-agent", json!({}));
    app.settle();
    for i in 1..=9 {
        app.emulator_act(KB_CONV, "say", json!({"text": format!("hello {i}")}));
    }
    app.settle();
    assert!(
        blocked_reasons(&desk).is_empty(),
        "nine messages are no flood"
    );
    app.emulator_act(KB_CONV, "say", json!({"text": tenth}));
    (app, desk)
}

#[test]
fn the_help_desk_learns_of_a_flood_block_with_its_reason() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (app, desk) = flood_until(tmp.path(), "hello 10");
    poll_until("the help desk's notice", Duration::from_secs(30), || {
        (!blocked_reasons(&desk).is_empty()).then_some(())
    });
    app.settle();
    assert_eq!(blocked_reasons(&desk), ["message flood"]);
    let notice = desk
        .accepted()
        .iter()
        .map(|r| r.json())
        .find(|b| b["type"] == "user.blocked")
        .expect("the notice");
    assert_eq!(notice["data"]["conversation"]["id"], KB_CONV, "{notice}");
    assert_eq!(calls_for(&app, KB_USER), [call("pb-block", "")]);
}

/// An abusive 10th message is a flood and abuse at once: block-abuse takes it (one block, with
/// its reason), and the flood rules do not also tell of a "message flood".
#[test]
fn an_abusive_tenth_message_is_one_block_for_abuse_not_also_a_flood() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (app, desk) = flood_until(tmp.path(), "fuck you");
    poll_until("the help desk's notice", Duration::from_secs(30), || {
        (!blocked_reasons(&desk).is_empty()).then_some(())
    });
    app.settle();
    assert_eq!(blocked_reasons(&desk), ["abusive language"]);
    assert_eq!(calls_for(&app, KB_USER), [call("pb-block", "")]);
    let labels = state_of(&app, KB_CONV)["labels"].clone();
    assert!(
        !labels
            .as_array()
            .is_some_and(|l| l.contains(&json!("flood-blocked"))),
        "{labels}"
    );
}

/// Issue 37's queue definition after hours: the service's agent call is answered with the
/// hours, and the conversation leaves the waiting queue at once, counted as `timed_out`.
#[test]
fn outside_business_hours_an_agent_call_leaves_the_queue_timed_out() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules(tmp.path(), |name, text| {
        if name == "hours.toml" {
            text.replace("[\"09:00-18:00\"]", "[]")
        } else {
            text
        }
    });
    let app = spawn(tmp.path(), &rules, &[]);
    act(&app, "request-agent", json!({}));
    poll_until("the wait over", Duration::from_secs(30), || {
        (app.metric(r#"handoff_queue_exits_total{outcome="timed_out"}"#) == 1.0).then_some(())
    });
    app.settle();
    let state = state(&app);
    assert!(state["handoff"]["handed_back_at"].is_i64(), "{state}");
    let (_, queue) = app.admin_get("/admin/v1/queue");
    assert!(!queue.to_string().contains(CONV), "{queue}");
}
