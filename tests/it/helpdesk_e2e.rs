//! Issue 6, done-when 1, in one story on the real daemon (shipped rules, embedded emulator) with a
//! test help desk (`common::helpdesk`): users ask for an agent; the help desk receives a signed
//! `handoff.requested` with the transcript and the user's place in the waiting queue (and the
//! expected wait once the desk's pace is known); agents accept through the agent API and reply
//! (into the conversation for a web user, through the partner send-message endpoint for a
//! partner-messenger user); an agent blocks and unblocks the partner user (the help desk hears
//! of it); the web user's agent releases; the conversation is back with the bot
//! on the configured release flow; the audit timeline shows every step.

use crate::common::helpdesk::*;
use crate::common::*;
use serde_json::{json, Value};
use std::time::Duration;

const TOKEN: &str = "helpdesk-token-e2e-0123456789";
/// Three conversations of bot B7f3a2c in the emulator's default seed.
const WEB: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
const KAKAO: &str = "5c0e9b1f-2222-4d3e-9f10-000000000002";
const KAKAO_USER: &str = "kb-user-77a9f2";
const THIRD: &str = "5c0e9b1f-2222-4d3e-9f10-000000000003";
const SENDER_KEY: &str = "sk-support-0001";
const RELEASE_FLOW: i64 = 1;

fn spawn(root: &std::path::Path, desk: &HelpDesk) -> TestApp {
    let config = root.join("bridge.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[helpdesk]
release_flow = "{RELEASE_FLOW}"
transcript_messages = 5

[helpdesk.partner.bots]
B7f3a2c = "{SENDER_KEY}"

[[helpdesk.endpoints]]
name = "desk"
url = "{url}"
secrets = ["{OLD_SECRET}", "{NEW_SECRET}"]

[outbox.retry]
base = "50ms"
cap = "200ms"
"#,
            url = desk.url
        ),
    )
    .expect("config");
    TestApp::spawn_in(
        &root.join("data"),
        Spawn {
            env: vec![
                ("HANDOFF_BRIDGE_HELPDESK_TOKENS".into(), TOKEN.into()),
                (
                    "HANDOFF_BRIDGE__RULES__SETTINGS__NOTIFY_HELPDESK".into(),
                    "true".into(),
                ),
                (
                    "HANDOFF_BRIDGE__RULES__SETTINGS__CHECK_BUSINESS_HOURS".into(),
                    "false".into(),
                ),
            ],
            args: vec!["--config".into(), config.display().to_string()],
            ..Spawn::default()
        },
    )
}

/// One agent API call with the token; answers (status, body).
fn agent_call(app: &TestApp, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let url = format!("{}/helpdesk/v1{path}", app.base);
    let req = ureq::http::Request::builder()
        .method(method)
        .uri(&url)
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/json")
        .body(body.map(|b| b.to_string()).unwrap_or_default())
        .expect("request");
    let mut resp = app.agent.run(req).expect("call");
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn post_ok(app: &TestApp, path: &str, body: Value) -> Value {
    let (status, answer) = agent_call(app, "POST", path, Some(body));
    assert_eq!(status, 200, "{path}: {answer}");
    assert_eq!(answer["status"], "applied", "{path}: {answer}");
    answer
}

/// The `handoff.requested` the help desk accepted for `conversation`.
fn requested_for(desk: &HelpDesk, conversation: &str) -> Received {
    poll_until(
        &format!("handoff.requested for {conversation}"),
        Duration::from_secs(30),
        || {
            desk.accepted().into_iter().find(|r| {
                let body = r.json();
                body["type"] == "handoff.requested"
                    && body["data"]["conversation"]["id"] == conversation
            })
        },
    )
}

/// Journal entries of `endpoint` that took effect and whose path contains `part`.
fn calls(app: &TestApp, endpoint: &str, part: &str) -> Vec<Value> {
    app.journal()
        .into_iter()
        .filter(|e| e["endpoint"] == endpoint && took_effect(e))
        .filter(|e| e["path"].as_str().is_some_and(|p| p.contains(part)))
        .collect()
}

#[test]
fn a_request_reaches_the_help_desk_and_an_agent_takes_answers_and_hands_back() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let desk = HelpDesk::start(&[], 200);
    let app = spawn(tmp.path(), &desk);

    // The web user asks for an agent (the service's agent call), then the partner user.
    app.emulator_act(WEB, "request-agent", json!({}));
    app.emulator_delivered();
    app.settle();
    app.emulator_act(KAKAO, "request-agent", json!({}));
    app.emulator_delivered();
    app.settle();

    // The help desk receives a correctly signed request with the context packet.
    let now = now_secs();
    let web_request = requested_for(&desk, WEB);
    verify_received(OLD_SECRET, &web_request, now).expect("signed (old secret)");
    verify_received(NEW_SECRET, &web_request, now).expect("signed (new secret)");
    let data = &web_request.json()["data"];
    assert_eq!(data["conversation"]["platform"], "web");
    assert_eq!(data["trigger"]["rule"], "tell-helpdesk");
    let transcript = data["transcript"]["messages"]
        .as_array()
        .expect("transcript");
    assert!(
        !transcript.is_empty() && data["transcript"]["complete"] == true,
        "{data:#}"
    );
    // First in line; no expected wait before the desk has accepted anyone.
    assert_eq!(data["queue"]["position"], 1, "{data:#}");
    assert!(data["queue"]["expectedWaitSeconds"].is_null(), "{data:#}");
    let kakao_request = requested_for(&desk, KAKAO);
    verify_received(NEW_SECRET, &kakao_request, now).expect("signed");
    assert_eq!(kakao_request.json()["data"]["queue"]["position"], 2);
    // The users heard their place in line.
    let told: Vec<String> = calls(&app, "send-conversation-message", WEB)
        .iter()
        .filter_map(|e| e["body"]["message"]["text"].as_str().map(str::to_owned))
        .collect();
    assert!(
        told.iter().any(|t| t.contains("You are number 1 in line.")),
        "{told:?}"
    );

    // Agents accept through the API: the queue empties in order.
    post_ok(
        &app,
        &format!("/conversations/{WEB}/accept"),
        json!({"agent": {"id": "alice", "name": "Alice"}}),
    );
    post_ok(
        &app,
        &format!("/conversations/{KAKAO}/accept"),
        json!({"agent": {"id": "bob"}}),
    );
    app.settle();
    let (status, state) = app.admin_get(&format!("/admin/v1/conversations/{WEB}"));
    assert_eq!(status, 200, "{state}");
    assert_eq!(
        state["timers"],
        json!({}),
        "the accept stops the queue updates and the wait: {state}"
    );
    // With two accepts the desk's pace is known: a third user hears an expected wait.
    app.emulator_act(THIRD, "request-agent", json!({}));
    app.emulator_delivered();
    app.settle();
    let third = requested_for(&desk, THIRD).json();
    assert_eq!(third["data"]["queue"]["position"], 1, "{third:#}");
    assert!(
        third["data"]["queue"]["expectedWaitSeconds"]
            .as_u64()
            .is_some_and(|s| s >= 1),
        "{third:#}"
    );

    // Replies: into the conversation for the web user, through the partner channel for the
    // partner-messenger user.
    post_ok(
        &app,
        &format!("/conversations/{WEB}/messages"),
        json!({"message": {"type": "text", "text": "Hello, Alice here"}}),
    );
    post_ok(
        &app,
        &format!("/conversations/{KAKAO}/messages"),
        json!({"message": {"type": "text", "text": "Hello, Bob here"}}),
    );
    app.settle();
    let web_reply: Vec<Value> = calls(&app, "send-conversation-message", WEB)
        .into_iter()
        .filter(|e| e["body"]["message"]["text"] == "Hello, Alice here")
        .collect();
    assert_eq!(web_reply.len(), 1, "{web_reply:?}");
    let relayed = calls(&app, "pb-send-message", SENDER_KEY);
    assert_eq!(relayed.len(), 1, "{relayed:?}");
    assert_eq!(relayed[0]["body"]["userKey"], KAKAO_USER);
    assert_eq!(relayed[0]["body"]["message"]["text"], "Hello, Bob here");
    assert!(
        !calls(&app, "send-conversation-message", KAKAO)
            .iter()
            .any(|e| e["body"]["message"]["text"] == "Hello, Bob here"),
        "not into the partner user's conversation"
    );

    // An agent blocks the partner user: the help desk hears of it as of a block by the rules.
    post_ok(
        &app,
        &format!("/users/kakaobiz/{KAKAO_USER}/block"),
        json!({"reason": "abuse"}),
    );
    post_ok(
        &app,
        &format!("/users/kakaobiz/{KAKAO_USER}/unblock"),
        json!({}),
    );
    let kinds = |desk: &HelpDesk| -> Vec<Value> {
        desk.accepted()
            .iter()
            .map(Received::json)
            .filter(|b| b["type"].as_str().is_some_and(|t| t.starts_with("user.")))
            .collect()
    };
    let user_events = poll_until(
        "user.blocked and user.unblocked",
        Duration::from_secs(30),
        || {
            let found = kinds(&desk);
            (found.len() >= 2).then_some(found)
        },
    );
    assert_eq!(user_events[0]["type"], "user.blocked");
    assert_eq!(user_events[0]["data"]["conversation"]["id"], KAKAO);
    assert_eq!(user_events[0]["data"]["reason"], "abuse");
    assert_eq!(user_events[1]["type"], "user.unblocked");

    // Release: back with the bot (manual off) on the configured release flow.
    post_ok(&app, &format!("/conversations/{WEB}/release"), json!({}));
    app.settle();
    let manual: Vec<Value> = calls(&app, "set-manual", WEB)
        .iter()
        .map(|e| e["body"]["enabled"].clone())
        .collect();
    assert_eq!(manual.last(), Some(&json!(false)), "{manual:?}");
    let nav = calls(&app, "set-navigation", WEB);
    assert_eq!(nav.len(), 1, "{nav:?}");
    assert_eq!(nav[0]["body"]["flowId"], RELEASE_FLOW);
    let (status, view) = agent_call(&app, "GET", &format!("/conversations/{WEB}"), None);
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["phase"], "released", "{view}");
    assert!(view["agent"].is_null(), "{view}");

    // The audit timeline shows every step with what it decided and how that ended.
    let (status, audit) = app.admin_get(&format!("/admin/v1/conversations/{WEB}/audit"));
    assert_eq!(status, 200, "{audit}");
    let steps: Vec<(String, Vec<(String, String)>)> = audit["timeline"]
        .as_array()
        .expect("timeline")
        .iter()
        .filter(|i| {
            i["type"] == "bot.conversation.agent_call_requested"
                || i["type"].as_str().is_some_and(|t| t.starts_with("agent."))
        })
        .map(|i| {
            let actions = i["actions"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|x| {
                            (
                                x["type"].as_str().unwrap_or("").to_owned(),
                                x["status"].as_str().unwrap_or("").to_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            (i["type"].as_str().unwrap_or("").to_owned(), actions)
        })
        .collect();
    let done = |names: &[&str]| -> Vec<(String, String)> {
        names
            .iter()
            .map(|n| ((*n).to_owned(), "done".to_owned()))
            .collect()
    };
    assert_eq!(
        steps,
        vec![
            (
                "bot.conversation.agent_call_requested".to_owned(),
                done(&["set_manual", "send_message", "notify_helpdesk"])
            ),
            // The accept and the release are told to the help desk (shipped rules).
            (
                "agent.accept".to_owned(),
                done(&["set_manual", "notify_helpdesk"])
            ),
            ("agent.message".to_owned(), done(&["send_message"])),
            (
                "agent.release".to_owned(),
                done(&["set_manual", "navigate", "notify_helpdesk"])
            ),
        ],
        "{audit:#}"
    );
}
