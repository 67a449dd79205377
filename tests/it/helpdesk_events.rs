//! Help-desk events end to end: the real daemon (shipped rules, embedded emulator) sends signed
//! events to a test help desk, a small HTTP server in this process on 127.0.0.1 that records
//! every request and answers as scripted. Signatures are checked by a Standard Webhooks verifier
//! written here from the specification, not by the bridge's own code.

use crate::common::helpdesk::*;
use crate::common::*;
use base64::Engine;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;

/// A web conversation of the emulator's default seed.
const CONV: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";

/// The daemon with the shipped rules telling the help desk, at any hour, and `desk` as its one
/// endpoint with both secrets; `retry` is the `[outbox]` settings (give-up, backoff, breaker).
fn spawn(root: &Path, desk: &HelpDesk, retry: &str) -> TestApp {
    spawn_desk(root, desk, retry, false)
}

/// The daemon on the configuration file `config`, with the shipped rules telling the help desk at
/// any hour, and `env` added (more settings, the test clock, agent API tokens).
fn spawn_with(root: &Path, config: &str, env: &[(&str, &str)]) -> TestApp {
    spawn_configured(root, config, env, false)
}

/// Calls the daemon made to the Open API for [`CONV`] that took effect: endpoint names.
fn upstream_calls(app: &TestApp) -> Vec<String> {
    app.journal()
        .iter()
        .filter(|e| {
            took_effect(e)
                && e["method"] != "GET"
                && e["path"].as_str().is_some_and(|p| p.contains(CONV))
        })
        .map(|e| e["endpoint"].as_str().unwrap_or_default().to_owned())
        .collect()
}

#[test]
fn a_user_asking_for_an_agent_reaches_the_help_desk_signed_with_its_context() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let desk = HelpDesk::start(&[], 200);
    // Its own process: the test reads the daemon's log for the secrets.
    let app = spawn_desk(tmp.path(), &desk, FAST_RETRY, true);
    app.emulator_act(CONV, "say", json!({"text": "상담원 연결해 주세요"}));
    app.settle();

    let requested = poll_until(
        "handoff.requested at the help desk",
        Duration::from_secs(30),
        || {
            desk.accepted()
                .into_iter()
                .find(|r| r.json()["type"] == "handoff.requested")
        },
    );
    let body = requested.json();
    let data = &body["data"];
    assert_eq!(data["conversation"]["id"], CONV);
    assert!(data["conversation"]["platform"].is_string(), "{body:#}");
    assert!(data["conversation"]["userKey"].is_string(), "{body:#}");
    assert!(data["conversation"]["params"].is_object(), "{body:#}");
    assert!(data["endUser"]["id"].is_string(), "{body:#}");
    assert_eq!(data["trigger"]["rule"], "tell-helpdesk");
    assert_eq!(data["reason"], "asked in a message");
    assert!(
        body["timestamp"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z') && t.contains('T')),
        "RFC 3339: {body:#}"
    );
    // The transcript, read through the Open API: the newest messages, the request among them.
    let transcript = data["transcript"]["messages"]
        .as_array()
        .expect("transcript");
    assert_eq!(data["transcript"]["complete"], true);
    assert!(
        !transcript.is_empty() && transcript.len() <= 5,
        "{transcript:#?}"
    );
    assert!(
        transcript
            .iter()
            .any(|m| m["data"]["text"] == "상담원 연결해 주세요" && m["sender"] == "user"),
        "{transcript:#?}"
    );
    // A request in words leaves the service's handoff phase as it was: the conversation is not
    // in the waiting queue (the service's agent call puts it there), so no position; present.
    assert!(
        data["queue"].is_object() && data["queue"]["position"].is_null(),
        "{body:#}"
    );
    // The id is the action's: stable across retries, so the help desk can dedupe.
    assert!(
        requested.header("webhook-id").ends_with("/tell-helpdesk/0"),
        "{:?}",
        requested.headers
    );

    // Signatures verify independently, with either secret of the rotation...
    let now = now_secs();
    verify_received(OLD_SECRET, &requested, now).expect("old secret verifies");
    verify_received(NEW_SECRET, &requested, now).expect("new secret verifies");
    assert_eq!(requested.header("webhook-signature").split(' ').count(), 2);
    let other = format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode([9u8; 32])
    );
    assert!(
        verify_received(&other, &requested, now).is_err(),
        "a foreign secret fails"
    );
    // ...but not over a tampered body...
    let mut tampered = requested.clone();
    tampered.body = String::from_utf8(requested.body.clone())
        .expect("utf-8")
        .replace("asked in a message", "asked in a messagE")
        .into_bytes();
    assert_ne!(tampered.body, requested.body);
    assert!(
        verify_received(OLD_SECRET, &tampered, now).is_err(),
        "tampered body"
    );
    // ...nor with a stale timestamp: replayed an hour later, or re-stamped to look fresh.
    assert!(
        verify_received(OLD_SECRET, &requested, now + 3600).is_err(),
        "stale timestamp"
    );
    let mut restamped = requested.clone();
    restamped
        .headers
        .insert("webhook-timestamp".into(), (now + 3600).to_string());
    assert!(
        verify_received(OLD_SECRET, &restamped, now + 3600).is_err(),
        "the timestamp is signed"
    );

    // The Open API side went on as before, and the delivery is counted by endpoint name.
    assert!(upstream_calls(&app).contains(&"set-manual".to_owned()));
    assert!(
        app.metric(r#"handoff_helpdesk_deliveries_total{endpoint="desk",outcome="delivered"}"#)
            >= 1.0
    );
    let logs = app.logs();
    for secret in [OLD_SECRET, NEW_SECRET] {
        let b64 = secret.trim_start_matches("whsec_");
        assert!(!logs.contains(b64), "a secret reached the log");
    }
}

#[test]
fn events_wait_while_the_help_desk_is_down_and_arrive_in_order_when_it_returns() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // Down: every request gets 503 until the test brings it back.
    let desk = HelpDesk::start(&[], 503);
    let app = spawn(tmp.path(), &desk, FAST_RETRY);
    app.emulator_act(CONV, "request-agent", json!({}));
    app.emulator_act(CONV, "say", json!({"text": "is anyone there?"}));
    // A bot message meanwhile (the service's own, not an echo of the bridge's): not sent, as
    // `helpdesk.bot_messages` is off. Posted once the request is folded, so it is part of the
    // handoff.
    app.emulator_delivered();
    let bot_message = json!({
        "id": "bot-message-event-1",
        "event": "bot.message.sent",
        "sourceType": "bot",
        "sourceId": "B7f3a2c",
        "timestamp": 1_763_690_470_000i64,
        "data": {"message": {
            "id": "bot-message-1",
            "conversationId": CONV,
            "data": {"type": "text", "text": "A person will be with you soon."},
            "isUser": false,
            "timestamp": 1_763_690_470_000i64,
        }},
    });
    let (status, answer) = app.post(&delivery("bot-message-delivery-1", &[bot_message]));
    assert_eq!(status, 200, "{answer}");
    app.emulator_act(CONV, "agent-connect", json!({}));
    app.emulator_act(CONV, "agent-end", json!({}));
    app.emulator_delivered();

    // The help desk being down holds up none of the conversation's Open API actions: the
    // agent call's manual on and off both went through while it refused everything.
    poll_until(
        "manual on and off at the Open API",
        Duration::from_secs(30),
        || {
            let calls = upstream_calls(&app);
            (calls.iter().filter(|c| *c == "set-manual").count() >= 2).then_some(())
        },
    );
    // Counted once the answer is judged (the desk sees the request before that).
    let failed_503 =
        || app.metric(r#"handoff_helpdesk_deliveries_total{endpoint="desk",outcome="http_503"}"#);
    poll_until("a few failed attempts", Duration::from_secs(30), || {
        (desk.received().len() >= 3 && failed_503() >= 3.0).then_some(())
    });
    assert!(desk.accepted().is_empty());
    let failed = desk.received();
    assert!(
        failed
            .iter()
            .all(|r| r.json()["type"] == "handoff.requested"),
        "later events wait behind the first: {:?}",
        failed
            .iter()
            .map(|r| r.json()["type"].clone())
            .collect::<Vec<_>>()
    );
    let first_id = failed[0].header("webhook-id").to_owned();
    assert!(
        failed.iter().all(|r| r.header("webhook-id") == first_id),
        "retries keep the id"
    );
    desk.set_then(200);
    let kinds = poll_until(
        "every event once the help desk is back",
        Duration::from_secs(30),
        || {
            let kinds: Vec<String> = desk
                .accepted()
                .iter()
                .map(|r| r.json()["type"].as_str().unwrap_or_default().to_owned())
                .collect();
            kinds.contains(&"handoff.ended".to_owned()).then_some(kinds)
        },
    );
    app.settle();
    let accepted = desk.accepted();
    let kinds_now: Vec<String> = accepted
        .iter()
        .map(|r| r.json()["type"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(kinds_now, kinds, "nothing more arrived after the end");
    assert_eq!(
        kinds,
        [
            "handoff.requested",
            "conversation.message",
            "handoff.connected",
            "handoff.ended"
        ],
        "in order, none lost, none twice"
    );
    assert_eq!(accepted[0].header("webhook-id"), first_id);
    assert_eq!(
        accepted[1].json()["data"]["message"]["data"]["text"],
        "is anyone there?"
    );
    assert_eq!(accepted[1].json()["data"]["message"]["sender"], "user");
    assert_eq!(
        app.metric(r#"handoff_action_attempts_total{action="notify_helpdesk",status="skipped"}"#),
        1.0,
        "the bot's message was decided but not sent"
    );
    for r in &accepted {
        verify_received(NEW_SECRET, r, now_secs()).expect("each delivery is signed");
    }
    assert!(dead_letters(&app).is_empty());
}

#[test]
fn a_help_desk_that_refuses_produces_a_dead_letter_with_the_reason() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let desk = HelpDesk::start(&[], 400);
    let app = spawn(tmp.path(), &desk, FAST_RETRY);
    app.emulator_act(CONV, "request-agent", json!({}));
    app.settle();

    let letters = dead_letters(&app);
    assert_eq!(letters.len(), 1, "{letters:#?}");
    let letter = &letters[0];
    assert_eq!(letter["reason"], "helpdesk_http_400");
    assert_eq!(letter["entry"]["action"]["type"], "notify_helpdesk");
    assert_eq!(letter["entry"]["action"]["kind"], "handoff.requested");
    assert!(
        letter["error"]
            .as_str()
            .is_some_and(|e| e.contains("desk") && !e.contains("127.0.0.1")),
        "names the endpoint, not its URL: {letter}"
    );
    assert_eq!(desk.received().len(), 1, "a refusal is not retried");
    assert!(app.metric(r#"handoff_dead_letters_total{reason="helpdesk_http_400"}"#) >= 1.0);
    // The conversation's own actions were carried out regardless.
    assert!(upstream_calls(&app).contains(&"set-manual".to_owned()));
}

#[test]
fn a_help_desk_down_past_give_up_after_produces_a_retries_exhausted_dead_letter() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let desk = HelpDesk::start(&[], 503);
    let app = spawn(
        tmp.path(),
        &desk,
        r#"[outbox]
give_up_after = "500ms"
[outbox.retry]
base = "50ms"
cap = "100ms"
[outbox.breaker]
probe_interval = "100ms""#,
    );
    app.emulator_act(CONV, "request-agent", json!({}));
    app.settle();
    let letters = dead_letters(&app);
    assert_eq!(letters.len(), 1, "{letters:#?}");
    assert_eq!(letters[0]["reason"], "retries_exhausted");
    assert!(
        letters[0]["attempts"].as_u64().is_some_and(|n| n >= 2),
        "{}",
        letters[0]
    );
    assert!(desk.received().len() >= 2);
}

// An event waiting for the help desk across a kill -9 and a restart on the same data directory:
// tests/process/helpdesk_events_crash.rs.

#[test]
fn without_a_help_desk_configured_the_events_are_recorded_as_done() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: vec![
                (
                    "HANDOFF_BRIDGE__RULES__SETTINGS__NOTIFY_HELPDESK".into(),
                    "true".into(),
                ),
                (
                    "HANDOFF_BRIDGE__RULES__SETTINGS__CHECK_BUSINESS_HOURS".into(),
                    "false".into(),
                ),
            ],
            ..Spawn::default()
        },
    );
    app.emulator_act(CONV, "request-agent", json!({}));
    app.settle();
    assert!(dead_letters(&app).is_empty());
    let (status, done) = app.admin_get("/admin/v1/outbox/done?limit=100");
    assert_eq!(status, 200, "{done}");
    let text = done.to_string();
    assert!(
        text.contains("\"notify_helpdesk\"") && text.contains("handoff.requested"),
        "the event is among the finished actions: {done:#}"
    );
    assert_eq!(
        app.metric(
            r#"handoff_action_attempts_total{action="notify_helpdesk",status="no_helpdesk"}"#
        ),
        1.0
    );
}

// ---- The kinds the other tests do not reach, endpoint filters, and the agent API's accept and
// release (issue 6: every event kind, end to end). ----

/// A partner-messenger (kakaobiz) conversation of the emulator's seed, and its channel.
const KAKAO: &str = "5c0e9b1f-2222-4d3e-9f10-000000000002";
const SENDER_KEY: &str = "sk-support-0001";
const TOKEN: &str = "helpdesk-token-events-0123456789";
/// The shipped waits (5 minutes, a day) run out when the test moves the clock.
const TEST_CLOCK: (&str, &str) = ("HANDOFF_BRIDGE__ADMIN__TEST_CLOCK", "true");

/// The kinds `desk` accepted, in arrival order.
fn kinds(desk: &HelpDesk) -> Vec<String> {
    desk.accepted()
        .iter()
        .map(|r| r.json()["type"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// The events of `kind` `desk` accepted, once there are `count` of them.
fn wait_for_kind(desk: &HelpDesk, kind: &str, count: usize) -> Vec<Received> {
    poll_until(
        &format!("{count} {kind} at the help desk"),
        Duration::from_secs(30),
        || {
            let found: Vec<Received> = desk
                .accepted()
                .into_iter()
                .filter(|r| r.json()["type"] == kind)
                .collect();
            (found.len() >= count).then_some(found)
        },
    )
}

fn timestamp_of(r: &Received) -> jiff::Timestamp {
    r.json()["timestamp"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("an RFC 3339 timestamp: {}", r.json()))
}

/// Every accepted event verifies with the independent Standard Webhooks verifier.
fn assert_all_signed(desk: &HelpDesk) {
    let now = now_secs();
    for r in desk.accepted() {
        verify_received(NEW_SECRET, &r, now)
            .unwrap_or_else(|e| panic!("{e}: {}", r.json()["type"]));
    }
}

#[test]
fn the_wait_running_out_reaches_the_help_desk_as_timed_out() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let desk = HelpDesk::start(&[], 200);
    let config = format!("[helpdesk]\n\n{}", endpoint("desk", &desk, None));
    let app = spawn_with(tmp.path(), &config, &[TEST_CLOCK]);
    app.emulator_act(CONV, "request-agent", json!({}));
    let requested = wait_for_kind(&desk, "handoff.requested", 1).remove(0);

    // Four minutes into the five-minute wait: nothing yet.
    app.advance_clock("4m");
    app.settle();
    assert!(
        !kinds(&desk).contains(&"handoff.timed_out".to_owned()),
        "{:?}",
        kinds(&desk)
    );
    app.advance_clock("2m");
    let timed_out = wait_for_kind(&desk, "handoff.timed_out", 1).remove(0);
    app.settle();
    let handoff: Vec<String> = kinds(&desk)
        .into_iter()
        .filter(|k| k.starts_with("handoff."))
        .collect();
    assert_eq!(handoff, ["handoff.requested", "handoff.timed_out"], "once");
    let body = timed_out.json();
    assert_eq!(body["data"]["conversation"]["id"], CONV);
    assert_eq!(body["data"]["trigger"]["rule"], "helpdesk-timed-out");
    assert_eq!(body["data"]["reason"], "no agent within the wait");
    assert!(
        body["data"].get("transcript").is_none(),
        "only a request carries the context packet: {body:#}"
    );
    // Stamped when the timer fired: the wait later than the request, on the daemon's clock.
    let waited = timestamp_of(&timed_out).duration_since(timestamp_of(&requested));
    assert!(
        waited >= jiff::SignedDuration::from_mins(5),
        "{waited:?} between request and time-out"
    );
    assert_ne!(
        timed_out.header("webhook-id"),
        requested.header("webhook-id")
    );
    assert_all_signed(&desk);
}

#[test]
fn bot_messages_reach_the_help_desk_only_with_bot_messages_on() {
    for bot_messages in [true, false] {
        let tmp = tempfile::tempdir().expect("tempdir");
        let desk = HelpDesk::start(&[], 200);
        let config = format!(
            "[helpdesk]\nbot_messages = {bot_messages}\n\n{}",
            endpoint("desk", &desk, None)
        );
        let app = spawn_with(tmp.path(), &config, &[]);
        app.emulator_act(CONV, "request-agent", json!({}));
        app.emulator_act(CONV, "agent-connect", json!({}));
        app.emulator_delivered();
        // The service's own bot message (not an echo of the bridge's) while a person has the
        // conversation, then the user's.
        let bot_message = json!({
            "id": "bot-message-event-2",
            "event": "bot.message.sent",
            "sourceType": "bot",
            "sourceId": "B7f3a2c",
            "timestamp": 1_763_690_470_000i64,
            "data": {"message": {
                "id": "bot-message-2",
                "conversationId": CONV,
                "data": {"type": "text", "text": "While you wait: our opening hours are 9-18."},
                "isUser": false,
                "timestamp": 1_763_690_470_000i64,
            }},
        });
        let (status, answer) = app.post(&delivery("bot-message-delivery-2", &[bot_message]));
        assert_eq!(status, 200, "{answer}");
        app.emulator_act(CONV, "say", json!({"text": "hello?"}));
        wait_for_kind(&desk, "conversation.message", 1);
        app.settle();
        let messages: Vec<(Value, Value)> = desk
            .accepted()
            .iter()
            .map(Received::json)
            .filter(|b| b["type"] == "conversation.message")
            .map(|b| {
                let m = &b["data"]["message"];
                (m["sender"].clone(), m["data"]["text"].clone())
            })
            .collect();
        let user = (json!("user"), json!("hello?"));
        let bot = (
            json!("bot"),
            json!("While you wait: our opening hours are 9-18."),
        );
        if bot_messages {
            assert_eq!(messages, [bot, user], "bot_messages = true");
        } else {
            assert_eq!(messages, [user], "bot_messages = false");
            assert_eq!(
                app.metric(
                    r#"handoff_action_attempts_total{action="notify_helpdesk",status="skipped"}"#
                ),
                1.0,
                "the bot's message was decided, then not sent"
            );
        }
        assert_eq!(
            kinds(&desk)[..2],
            ["handoff.requested", "handoff.connected"],
            "the messages come after the handoff's start"
        );
        assert_all_signed(&desk);
    }
}

#[test]
fn each_endpoint_receives_only_the_kinds_it_selects_in_order_signed() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let users = HelpDesk::start(&[], 200);
    let all = HelpDesk::start(&[], 200);
    let config = format!(
        "[helpdesk]\n\n{}{}",
        endpoint("users", &users, Some(r#"["user.*"]"#)),
        endpoint("all", &all, None)
    );
    let app = spawn_with(
        tmp.path(),
        &config,
        &[
            TEST_CLOCK,
            (
                "HANDOFF_BRIDGE__RULES__SETTINGS__PARTNER_SENDER_KEY",
                SENDER_KEY,
            ),
        ],
    );
    // The agent call makes the partner-messenger conversation known (platform, user key); the
    // service connects an agent; the user swears: blocked (the shipped rules), for a day.
    app.emulator_act(KAKAO, "request-agent", json!({}));
    app.settle();
    app.emulator_act(KAKAO, "agent-connect", json!({}));
    app.settle();
    app.emulator_act(KAKAO, "say", json!({"text": "fuck you"}));
    let blocked = wait_for_kind(&users, "user.blocked", 1).remove(0);
    app.settle();
    assert!(
        !kinds(&all).contains(&"user.unblocked".to_owned()) && users.accepted().len() == 1,
        "no unblock before the day is over: {:?} {:?}",
        kinds(&users),
        kinds(&all)
    );
    app.advance_clock("24h");
    let unblocked = wait_for_kind(&users, "user.unblocked", 1).remove(0);
    wait_for_kind(&all, "user.unblocked", 1);
    app.settle();

    assert_eq!(kinds(&users), ["user.blocked", "user.unblocked"]);
    assert_eq!(
        kinds(&all),
        [
            "handoff.requested",
            "handoff.connected",
            "user.blocked",
            "user.unblocked"
        ]
    );
    let body = blocked.json();
    assert_eq!(body["data"]["conversation"]["id"], KAKAO);
    assert_eq!(body["data"]["conversation"]["platform"], "kakaobiz");
    assert_eq!(body["data"]["trigger"]["rule"], "helpdesk-blocked");
    assert_eq!(body["data"]["reason"], "abusive language");
    let body = unblocked.json();
    assert_eq!(body["data"]["trigger"]["rule"], "helpdesk-unblocked");
    assert_eq!(body["data"]["reason"], "the block ran out");
    // One event, one id and one body for every desk that takes it.
    let all_blocked = all
        .accepted()
        .into_iter()
        .find(|r| r.json()["type"] == "user.blocked")
        .expect("user.blocked at the other desk");
    assert_eq!(
        all_blocked.header("webhook-id"),
        blocked.header("webhook-id")
    );
    assert_eq!(all_blocked.body, blocked.body);
    // The block itself went to the partner messenger, and the unblock a day later.
    let partner: Vec<String> = app
        .journal()
        .iter()
        .filter(|e| took_effect(e) && e["path"].as_str().is_some_and(|p| p.contains(SENDER_KEY)))
        .map(|e| e["endpoint"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(partner, ["pb-block", "pb-unblock"]);
    assert_all_signed(&users);
    assert_all_signed(&all);
    for (name, n) in [("users", 2.0), ("all", 4.0)] {
        assert_eq!(
            app.metric(&format!(
                r#"handoff_helpdesk_deliveries_total{{endpoint="{name}",outcome="delivered"}}"#
            )),
            n,
            "{name}"
        );
    }
}

/// One agent API call with the token and an idempotency key; answers (status, body).
fn agent_post(app: &TestApp, path: &str, key: &str, body: Value) -> (u16, Value) {
    let mut resp = app
        .agent
        .post(format!("{}/helpdesk/v1{path}", app.base))
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .send(body.to_string())
        .expect("POST");
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

#[test]
fn accepts_and_releases_through_the_agent_api_reach_every_help_desk() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = HelpDesk::start(&[], 200);
    let b = HelpDesk::start(&[], 200);
    let config = format!(
        "[helpdesk]\n\n{}{}",
        endpoint("a", &a, Some(r#"["handoff.*"]"#)),
        endpoint("b", &b, None)
    );
    let app = spawn_with(
        tmp.path(),
        &config,
        &[("HANDOFF_BRIDGE_HELPDESK_TOKENS", TOKEN)],
    );
    app.emulator_act(CONV, "request-agent", json!({}));
    app.settle();
    let accept = format!("/conversations/{CONV}/accept");
    let release = format!("/conversations/{CONV}/release");
    let alice = json!({"agent": {"id": "alice", "name": "Alice"}});

    let (status, answer) = agent_post(&app, &accept, "accept-1", alice.clone());
    assert_eq!(
        (status, &answer["status"]),
        (200, &json!("applied")),
        "{answer}"
    );
    // Alice again under another key (applied, nothing new), and Bob, refused: the desks hear
    // of neither.
    let (status, answer) = agent_post(&app, &accept, "accept-2", alice);
    assert_eq!(
        (status, &answer["status"]),
        (200, &json!("applied")),
        "{answer}"
    );
    let (status, answer) = agent_post(&app, &accept, "accept-3", json!({"agent": {"id": "bob"}}));
    assert_eq!(status, 409, "{answer}");
    assert_eq!(answer["error"]["code"], "already_accepted", "{answer}");
    app.settle();

    let (status, answer) = agent_post(&app, &release, "release-1", json!({}));
    assert_eq!(
        (status, &answer["status"]),
        (200, &json!("applied")),
        "{answer}"
    );
    // A second release finds no agent: refused, nothing told.
    let (status, answer) = agent_post(&app, &release, "release-2", json!({}));
    assert_eq!(status, 409, "{answer}");
    assert_eq!(answer["error"]["code"], "not_with_agent", "{answer}");
    app.settle();
    // Once released, Bob may take it: the desks hear of that accept too.
    let (status, answer) = agent_post(&app, &accept, "accept-4", json!({"agent": {"id": "bob"}}));
    assert_eq!(
        (status, &answer["status"]),
        (200, &json!("applied")),
        "{answer}"
    );
    wait_for_kind(&a, "handoff.connected", 2);
    wait_for_kind(&b, "handoff.connected", 2);
    app.settle();

    let expected = [
        "handoff.requested",
        "handoff.connected",
        "handoff.ended",
        "handoff.connected",
    ];
    assert_eq!(kinds(&a), expected);
    assert_eq!(kinds(&b), expected);
    for desk in [&a, &b] {
        let bodies: Vec<Value> = desk.accepted().iter().map(Received::json).collect();
        let told: Vec<(Value, Value, Value)> = bodies[1..]
            .iter()
            .map(|b| {
                (
                    b["data"]["trigger"]["rule"].clone(),
                    b["data"]["payload"]["desk_agent"].clone(),
                    b["data"]["payload"]["by"].clone(),
                )
            })
            .collect();
        assert_eq!(
            told,
            [
                (
                    json!("helpdesk-accepted"),
                    json!("alice"),
                    json!("agent-api")
                ),
                (
                    json!("helpdesk-released"),
                    json!("alice"),
                    json!("agent-api")
                ),
                (json!("helpdesk-accepted"), json!("bob"), json!("agent-api")),
            ]
        );
        assert_eq!(
            bodies[1]["data"]["reason"],
            "accepted through the agent API"
        );
        assert_eq!(
            bodies[2]["data"]["reason"],
            "released through the agent API"
        );
        assert!(
            bodies
                .iter()
                .all(|b| b["data"]["conversation"]["id"] == CONV),
            "{bodies:#?}"
        );
        assert_all_signed(desk);
    }
    // Each desk got the same event under the same id.
    assert_eq!(
        a.accepted()
            .iter()
            .map(|r| r.header("webhook-id").to_owned())
            .collect::<Vec<_>>(),
        b.accepted()
            .iter()
            .map(|r| r.header("webhook-id").to_owned())
            .collect::<Vec<_>>()
    );
}
