//! Every shared fixture is accepted and lands in state; re-sent deliveries and re-sent events are
//! recognised as duplicates and change nothing; the CLI prints the same JSON through the admin API
//! and, after SIGTERM, from the store directly.

use crate::common::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;

const CONV1: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
const CONV2: &str = "5c0e9b1f-2222-4d3e-9f10-000000000002";
const USER1: &str = "4e6f0d0a-1111-4a5b-8c9d-000000000001";
const USER2: &str = "4e6f0d0a-1111-4a5b-8c9d-000000000002";
const BOT: &str = "B7f3a2c";

/// Every event of every fixture, in fixture order.
fn all_events() -> Vec<Value> {
    fixtures()
        .iter()
        .flat_map(|(name, body)| {
            let v: Value = serde_json::from_slice(body).unwrap_or_else(|e| panic!("{name}: {e}"));
            v["messages"].as_array().expect("messages").clone()
        })
        .collect()
}

fn metric_events_total(app: &TestApp, kind: &str) -> f64 {
    app.metric(&format!("handoff_webhook_events_total{{type=\"{kind}\"}}"))
}

fn deliveries(app: &TestApp, outcome: &str) -> f64 {
    app.metric(&format!(
        "handoff_webhook_deliveries_total{{outcome=\"{outcome}\"}}"
    ))
}

/// The CLI views whose bytes must not change.
fn snapshot(app: &TestApp) -> Vec<String> {
    vec![
        app.cli_ok(&["state", "show", CONV1]),
        app.cli_ok(&["state", "show", CONV2]),
        app.cli_ok(&[
            "state",
            "find",
            "--platform",
            "web",
            "--user-key",
            "web-visitor-8841",
        ]),
        app.cli_ok(&[
            "state",
            "find",
            "--platform",
            "kakaobiz",
            "--user-key",
            "kb-user-77a9f2",
        ]),
    ]
}

fn assert_same_snapshot(before: &[String], after: &[String], when: &str) {
    assert_eq!(before.len(), after.len());
    for (b, a) in before.iter().zip(after) {
        assert_eq!(b, a, "state changed {when}");
    }
}

/// Post every fixture once; each must be accepted with all its events.
fn post_all_fixtures(app: &TestApp) {
    for (name, body) in fixtures() {
        let fixture: Value = serde_json::from_slice(&body).expect("fixture json");
        let n = fixture["messages"].as_array().expect("messages").len();
        let (status, receipt) = app.post(&body);
        assert_eq!(status, 200, "{name}: {receipt}");
        assert_eq!(receipt["status"], "accepted", "{name}: {receipt}");
        assert_eq!(receipt["delivery_id"], fixture["id"], "{name}: {receipt}");
        assert_eq!(receipt["accepted"], n, "{name}: {receipt}");
        assert_eq!(receipt["duplicates"], 0, "{name}: {receipt}");
        assert_eq!(receipt["quarantined"], 0, "{name}: {receipt}");
    }
}

fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("CLI output is not JSON ({e}): {text}"))
}

#[test]
fn every_fixture_is_accepted_and_folded_into_state() {
    let app = TestApp::spawn();
    let events = all_events();
    assert_eq!(
        fixtures().len(),
        18,
        "the shared fixture set changed; update this test"
    );
    assert_eq!(events.len(), 19);

    post_all_fixtures(&app);
    wait_drained(&app);

    // Metrics: every event accepted once, by type, and folded once.
    assert_eq!(deliveries(&app, "accepted"), 18.0);
    assert_eq!(deliveries(&app, "duplicate"), 0.0);
    assert_eq!(deliveries(&app, "quarantined"), 0.0);
    assert_eq!(app.metric("handoff_events_applied_total"), 19.0);
    assert_eq!(app.metric("handoff_inbox_depth"), 0.0);
    let mut by_type: BTreeMap<String, f64> = BTreeMap::new();
    for e in &events {
        *by_type
            .entry(e["event"].as_str().expect("event type").to_owned())
            .or_default() += 1.0;
    }
    assert_eq!(
        by_type.len(),
        14,
        "fixtures cover every documented event type"
    );
    for (kind, n) in &by_type {
        assert_eq!(
            metric_events_total(&app, kind),
            *n,
            "events_total for {kind}"
        );
    }
    assert_eq!(
        app.metric("handoff_state_entries{kind=\"conversations\"}"),
        2.0
    );
    assert_eq!(app.metric("handoff_state_entries{kind=\"end_users\"}"), 2.0);
    assert_eq!(app.metric("handoff_state_entries{kind=\"bots\"}"), 1.0);

    // Conversation 1: created, navigated, asked for an agent, served, ended, expired.
    let c1 = parse(&app.cli_ok(&["state", "show", CONV1]));
    assert_eq!(c1["id"], CONV1);
    assert_eq!(c1["bot_id"], BOT);
    assert_eq!(c1["end_user_id"], USER1);
    assert_eq!(c1["platform"], "web");
    assert_eq!(c1["user_key"], "web-visitor-8841");
    assert_eq!(c1["events_applied"], 9);
    assert_eq!(c1["created_at"], 1763690400025_i64);
    assert_eq!(c1["deleted_at"], 1763694000011_i64);
    assert_eq!(c1["first_event_at"], 1763690400025_i64);
    assert_eq!(c1["last_event_at"], 1763694000011_i64);
    assert_eq!(
        c1["params"]["value"],
        json!({"name": "김민지", "orderNo": "A-20251121-0042"})
    );
    // The newest navigation is the one of conversation.deleted (no `prev` there).
    assert_eq!(
        c1["navigation"]["value"]["current"],
        json!({"flowId": 3, "nodeId": 12, "visitCount": 1})
    );
    assert_eq!(c1["navigation"]["value"]["prev"], Value::Null);
    assert_eq!(
        c1["navigation"]["stamp"]["event"],
        "3e5f0000-0000-4000-8000-000000000014"
    );
    let h = &c1["handoff"];
    assert_eq!(h["phase"]["value"], "ended");
    assert_eq!(h["phase"]["stamp"]["at"], 1763690800011_i64);
    assert_eq!(h["requested_at"], 1763690402211_i64);
    assert_eq!(h["connected_at"], 1763690465011_i64);
    assert_eq!(h["ended_at"], 1763690800011_i64);
    assert_eq!(h["cancelled_at"], Value::Null);
    // The agent comes from meta.sender of the agent's message.
    assert_eq!(
        h["agent"]["value"],
        json!({"userKey": "U3f9c21", "platform": "closer-chat"})
    );
    let m = &c1["messages"];
    assert_eq!(
        (
            m["user_messages"].as_u64(),
            m["bot_messages"].as_u64(),
            m["agent_messages"].as_u64()
        ),
        (Some(1), Some(1), Some(1))
    );
    assert_eq!(m["last_user_message_at"], 1763690402011_i64);
    assert_eq!(m["last_bot_message_at"], 1763690402111_i64);
    assert_eq!(m["last_agent_message_at"], 1763690470011_i64);
    assert_eq!(
        m["last_message"]["value"],
        json!({"id": "6a1d0000-0000-4000-8000-000000000027", "sender": "agent"})
    );
    assert_eq!(c1["manual_status"]["value"], Value::Null);

    // Conversation 2 (kakaobiz): media + location from the user, bot cards, request, cancel.
    let c2 = parse(&app.cli_ok(&["state", "show", CONV2]));
    assert_eq!(c2["platform"], "kakaobiz");
    assert_eq!(c2["user_key"], "kb-user-77a9f2");
    assert_eq!(c2["end_user_id"], USER2);
    assert_eq!(c2["events_applied"], 5);
    assert_eq!(c2["created_at"], Value::Null);
    assert_eq!(c2["handoff"]["phase"]["value"], "cancelled");
    assert_eq!(c2["handoff"]["requested_at"], 1763690408011_i64);
    assert_eq!(c2["handoff"]["cancelled_at"], 1763690430011_i64);
    assert_eq!(c2["handoff"]["connected_at"], Value::Null);
    assert_eq!(
        c2["handoff"]["agent"]["value"],
        Value::Null,
        "a bot message with meta.custom is not an agent's"
    );
    assert_eq!(c2["messages"]["user_messages"], 2);
    assert_eq!(c2["messages"]["bot_messages"], 1);
    assert_eq!(c2["messages"]["agent_messages"], 0);
    assert_eq!(
        c2["messages"]["last_message"]["value"],
        json!({"id": "6a1d0000-0000-4000-8000-000000000043", "sender": "bot"})
    );
    assert_eq!(
        c2["navigation"]["value"]["current"],
        json!({"flowId": 5, "nodeId": 41, "visitCount": 1})
    );
    assert_eq!(
        c2["navigation"]["value"]["prev"],
        json!({"flowId": 5, "nodeId": 40, "visitCount": 1})
    );
    assert_eq!(c2["params"]["value"], json!({}));

    // End users, found by (platform, userKey).
    let u1 = parse(&app.cli_ok(&[
        "state",
        "find",
        "--platform",
        "web",
        "--user-key",
        "web-visitor-8841",
    ]));
    assert_eq!(u1["endUser"]["id"], USER1);
    assert_eq!(u1["endUser"]["bot_id"], BOT);
    assert_eq!(u1["endUser"]["platform"], "web");
    assert_eq!(
        u1["endUser"]["events_applied"], 2,
        "created + updated; conversation events are not end-user events"
    );
    // created and updated share a timestamp; updated has the greater event id and wins.
    assert_eq!(
        u1["endUser"]["params"]["value"],
        json!({"name": "김민지", "orderNo": "A-20251121-0042"})
    );
    assert_eq!(u1["endUser"]["last_conversation_id"]["value"], CONV1);
    assert_eq!(u1["endUser"]["deleted_at"], Value::Null);
    assert_eq!(
        u1["lastConversation"], c1,
        "find embeds the newest conversation's state"
    );
    let u2 = parse(&app.cli_ok(&[
        "state",
        "find",
        "--platform",
        "kakaobiz",
        "--user-key",
        "kb-user-77a9f2",
    ]));
    assert_eq!(u2["endUser"]["id"], USER2);
    assert_eq!(u2["endUser"]["deleted_at"], 1763690400011_i64);
    assert_eq!(u2["endUser"]["events_applied"], 1);
    assert_eq!(u2["endUser"]["last_conversation_id"]["value"], CONV2);
    assert_eq!(u2["lastConversation"], c2);
    // (platform, userKey) is the key: the same user key on another platform is someone else.
    let other = app.cli(&[
        "state",
        "find",
        "--platform",
        "kakao",
        "--user-key",
        "web-visitor-8841",
    ]);
    assert_eq!(
        other.status.code(),
        Some(1),
        "unknown identity must not be found"
    );

    // The bot: both bot events were stored and folded (no longer pending), into one bot record.
    for (event_id, kind) in [
        ("3e5f0000-0000-4000-8000-000000000001", "bot.updated"),
        ("3e5f0000-0000-4000-8000-000000000003", "bot.deleted"),
    ] {
        let (status, found) = app.admin_get(&format!("/admin/v1/events/{event_id}"));
        assert_eq!(status, 200, "{found}");
        assert_eq!(found["pending"], false, "{found}");
        assert_eq!(found["record"]["kind"], kind);
        assert_eq!(found["record"]["partition"], format!("b:{BOT}"));
    }
    // And every other event is folded too.
    for e in &events {
        let id = e["id"].as_str().expect("id");
        let (status, found) = app.admin_get(&format!("/admin/v1/events/{id}"));
        assert_eq!(status, 200, "{id}: {found}");
        assert_eq!(found["pending"], false, "{id}: {found}");
        assert_eq!(
            found["record"]["event"], *e,
            "the stored event is the event as sent"
        );
    }
}

#[test]
fn resent_deliveries_and_resent_events_are_duplicates_and_change_nothing() {
    let app = TestApp::spawn();
    post_all_fixtures(&app);
    wait_drained(&app);
    let before = snapshot(&app);
    let events_total: Vec<f64> = [
        "bot.updated",
        "bot.message.sent",
        "bot.conversation.created",
    ]
    .iter()
    .map(|k| metric_events_total(&app, k))
    .collect();
    assert_eq!(app.metric("handoff_events_applied_total"), 19.0);

    // 1. The same deliveries again (what the service's retry does).
    for (name, body) in fixtures() {
        let fixture: Value = serde_json::from_slice(&body).expect("fixture json");
        let (status, receipt) = app.post(&body);
        assert_eq!(status, 200, "{name}: {receipt}");
        assert_eq!(receipt["status"], "duplicate", "{name}: {receipt}");
        assert_eq!(receipt["delivery_id"], fixture["id"], "{name}: {receipt}");
        assert_eq!(receipt["accepted"], 0, "{name}: {receipt}");
        // A known delivery id is recognised as a whole: every event in it is a duplicate.
        let events = fixture["messages"].as_array().expect("messages").len();
        assert_eq!(receipt["duplicates"], events, "{name}: {receipt}");
        assert_eq!(receipt["quarantined"], 0, "{name}: {receipt}");
    }
    wait_drained(&app);
    assert_eq!(deliveries(&app, "duplicate"), 18.0);
    assert_eq!(deliveries(&app, "accepted"), 18.0);
    assert_eq!(app.metric("handoff_webhook_duplicate_events_total"), 19.0);
    assert_eq!(app.metric("handoff_events_applied_total"), 19.0);
    assert_eq!(app.metric("handoff_inbox_depth"), 0.0);
    assert_same_snapshot(&before, &snapshot(&app), "after re-sending every delivery");

    // 2. The same events inside NEW delivery ids, one delivery per fixture.
    let mut expected_dup_events = 0;
    for (i, (name, body)) in fixtures().into_iter().enumerate() {
        let fixture: Value = serde_json::from_slice(&body).expect("fixture json");
        let events = fixture["messages"].as_array().expect("messages").clone();
        let id = format!("aaaa0000-0000-4000-8000-{i:012}");
        let (status, receipt) = app.post(&delivery(&id, &events));
        assert_eq!(status, 200, "{name}: {receipt}");
        assert_eq!(receipt["status"], "duplicate", "{name}: {receipt}");
        assert_eq!(receipt["delivery_id"], id.as_str());
        assert_eq!(receipt["accepted"], 0, "{name}: {receipt}");
        assert_eq!(receipt["duplicates"], events.len(), "{name}: {receipt}");
        expected_dup_events += events.len();
    }
    assert_eq!(expected_dup_events, 19);
    wait_drained(&app);
    assert_eq!(deliveries(&app, "duplicate"), 36.0);
    assert_eq!(app.metric("handoff_webhook_duplicate_events_total"), 38.0);
    assert_eq!(app.metric("handoff_events_applied_total"), 19.0);
    assert_same_snapshot(
        &before,
        &snapshot(&app),
        "after re-sending every event under new delivery ids",
    );

    // 3. All 19 events in one new delivery, in reverse order, one of them twice.
    let mut batch = all_events();
    batch.reverse();
    batch.push(batch[0].clone());
    let (status, receipt) = app.post(&delivery("bbbb0000-0000-4000-8000-000000000001", &batch));
    assert_eq!(status, 200, "{receipt}");
    assert_eq!(receipt["status"], "duplicate", "{receipt}");
    assert_eq!(receipt["accepted"], 0, "{receipt}");
    assert_eq!(receipt["duplicates"], 20, "{receipt}");
    wait_drained(&app);
    assert_eq!(deliveries(&app, "duplicate"), 37.0);
    assert_eq!(app.metric("handoff_webhook_duplicate_events_total"), 58.0);
    assert_eq!(app.metric("handoff_events_applied_total"), 19.0);
    let after: Vec<f64> = [
        "bot.updated",
        "bot.message.sent",
        "bot.conversation.created",
    ]
    .iter()
    .map(|k| metric_events_total(&app, k))
    .collect();
    assert_eq!(
        events_total, after,
        "duplicates are not counted as accepted events"
    );
    assert_same_snapshot(&before, &snapshot(&app), "after a batched re-send");

    // 4. A new delivery mixing a known event with a new one: only the new one counts.
    let known = fixture_value("message-received-media.json")["messages"][0].clone();
    let mut fresh = known.clone();
    fresh["id"] = json!("3e5f0000-0000-4000-8000-0000000000f1");
    fresh["timestamp"] = json!(1763690409011_i64);
    fresh["data"]["message"]["id"] = json!("6a1d0000-0000-4000-8000-0000000000f1");
    let (status, receipt) = app.post(&delivery(
        "bbbb0000-0000-4000-8000-000000000002",
        &[known, fresh],
    ));
    assert_eq!(status, 200, "{receipt}");
    assert_eq!(receipt["status"], "accepted", "{receipt}");
    assert_eq!(
        (receipt["accepted"].as_u64(), receipt["duplicates"].as_u64()),
        (Some(1), Some(1)),
        "{receipt}"
    );
    wait_drained(&app);
    assert_eq!(app.metric("handoff_webhook_duplicate_events_total"), 59.0);
    assert_eq!(app.metric("handoff_events_applied_total"), 20.0);
    let c2_before = parse(&before[1]);
    let c2_after = parse(&app.cli_ok(&["state", "show", CONV2]));
    assert_eq!(
        c2_after["events_applied"],
        c2_before["events_applied"].as_u64().expect("n") + 1
    );
    assert_eq!(
        c2_after["messages"]["user_messages"],
        c2_before["messages"]["user_messages"].as_u64().expect("n") + 1
    );
    assert_eq!(
        c2_after["messages"]["last_user_message_at"],
        1763690409011_i64
    );
    // Conversation 1 and the end users did not change.
    let now = snapshot(&app);
    assert_eq!(before[0], now[0]);
    assert_eq!(parse(&before[2]), parse(&now[2]));
    // The known event is still stored once, under its first delivery.
    let (_, found) = app.admin_get("/admin/v1/events/3e5f0000-0000-4000-8000-000000000037");
    assert_eq!(
        found["record"]["delivery"], "1d0c0000-0000-4000-8000-000000000038",
        "{found}"
    );
}

#[test]
fn cli_prints_the_same_json_through_the_admin_api_and_offline_after_sigterm() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    let app = TestApp::spawn_in(&data_dir, Spawn::default());
    post_all_fixtures(&app);
    wait_drained(&app);

    // While the daemon runs it holds the store's lock, so the CLI can only answer through the
    // admin API; its output must match what the admin API serves.
    assert!(
        data_dir.join("daemon.json").exists(),
        "daemon.json is how the CLI finds the daemon"
    );
    let online = snapshot(&app);
    let (status, admin_c1) = app.admin_get(&format!("/admin/v1/conversations/{CONV1}"));
    assert_eq!(status, 200);
    assert_eq!(parse(&online[0]), admin_c1);
    let (status, admin_u1) =
        app.admin_get("/admin/v1/endusers?platform=web&userKey=web-visitor-8841");
    assert_eq!(status, 200);
    assert_eq!(parse(&online[2]), admin_u1);
    assert_eq!(parse(&online[0])["handoff"]["phase"]["value"], "ended");
    let missing = app.cli(&["state", "show", "no-such-conversation"]);
    assert_eq!(
        missing.status.code(),
        Some(1),
        "unknown conversation is an error"
    );
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("no conversation no-such-conversation")
    );

    let status = app.terminate();
    assert!(status.success(), "daemon exit after SIGTERM: {status}");
    assert!(
        !data_dir.join("daemon.json").exists(),
        "clean exit removes daemon.json"
    );

    let offline: Vec<String> = [
        vec!["state", "show", CONV1],
        vec!["state", "show", CONV2],
        vec![
            "state",
            "find",
            "--platform",
            "web",
            "--user-key",
            "web-visitor-8841",
        ],
        vec![
            "state",
            "find",
            "--platform",
            "kakaobiz",
            "--user-key",
            "kb-user-77a9f2",
        ],
    ]
    .iter()
    .map(|args| cli_ok(&data_dir, args))
    .collect();
    assert_same_snapshot(
        &online,
        &offline,
        "between the admin-API and the offline CLI",
    );
    let missing = cli(&data_dir, &["state", "show", "no-such-conversation"]);
    assert_eq!(
        missing.status.code(),
        Some(1),
        "unknown conversation is an error offline too"
    );
}
