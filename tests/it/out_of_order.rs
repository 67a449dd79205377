//! Events of one conversation end in the same state whatever order they arrive in, one delivery
//! each or batched, and an older event arriving last never rolls state back.

use crate::common::*;
use serde_json::{json, Value};

const CONV1: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";

/// Every fixture event of conversation 1 (created, updated, user/bot/agent messages, the agent
/// call's request, connect and disconnect, and the session's deletion).
fn fixture_events() -> Vec<Value> {
    let events: Vec<Value> = fixtures()
        .iter()
        .flat_map(|(_, body)| {
            serde_json::from_slice::<Value>(body).expect("fixture")["messages"]
                .as_array()
                .expect("messages")
                .clone()
        })
        .filter(|e| {
            e["data"]["conversation"]["id"] == CONV1
                || e["data"]["message"]["conversationId"] == CONV1
        })
        .collect();
    let mut kinds: Vec<&str> = events
        .iter()
        .map(|e| e["event"].as_str().expect("type"))
        .collect();
    kinds.sort_unstable();
    assert_eq!(
        kinds,
        [
            "bot.conversation.agent_call_connected",
            "bot.conversation.agent_call_disconnected",
            "bot.conversation.agent_call_requested",
            "bot.conversation.created",
            "bot.conversation.deleted",
            "bot.conversation.updated",
            "bot.message.received",
            "bot.message.sent",
            "bot.message.sent",
        ],
        "the shared fixtures for {CONV1} changed; update this test"
    );
    events
}

/// An older conversation.updated (new event id, earlier timestamp) whose params and navigation
/// differ from everything newer.
fn older_update() -> Value {
    let mut e = fixture_value("conversation-updated.json")["messages"][0].clone();
    e["id"] = json!("3e5f0000-0000-4000-8000-0000000000e1");
    e["timestamp"] = json!(1763690400500_i64);
    let stale_params = json!({"name": "예전 이름", "orderNo": "A-OLD-0001", "stale": true});
    let stale_nav = json!({"current": {"flowId": 9, "nodeId": 99, "visitCount": 4}, "prev": {"flowId": 8, "nodeId": 88}});
    let c = &mut e["data"]["conversation"];
    c["params"] = stale_params.clone();
    c["navigation"] = stale_nav.clone();
    c["context"]["params"] = stale_params;
    c["context"]["navigation"] = stale_nav;
    c["context"]["manual"] = json!({"status": "HANDOVER"});
    c["updatedAt"] = json!("2025-11-21T02:00:00.500Z");
    e
}

/// An older agent message from another agent (between the connect and the real agent's message).
fn older_agent_message() -> Value {
    let mut e = fixture_value("message-sent-agent-text.json")["messages"][0].clone();
    e["id"] = json!("3e5f0000-0000-4000-8000-0000000000e2");
    e["timestamp"] = json!(1763690466011_i64);
    let m = &mut e["data"]["message"];
    m["id"] = json!("6a1d0000-0000-4000-8000-0000000000e2");
    m["timestamp"] = json!(1763690466000_i64);
    m["meta"]["sender"] = json!({"userKey": "U0000old", "platform": "closer-chat"});
    m["data"]["text"] = json!("잠시만요");
    e
}

fn key(e: &Value) -> (i64, String) {
    (
        e["timestamp"].as_i64().expect("timestamp"),
        e["id"].as_str().expect("id").to_owned(),
    )
}

/// All events of the scenario, oldest first.
fn in_order() -> Vec<Value> {
    let mut events = fixture_events();
    events.push(older_update());
    events.push(older_agent_message());
    events.sort_by_key(key);
    events
}

/// Deterministic Fisher-Yates with a fixed xorshift generator.
fn shuffled(mut events: Vec<Value>, mut seed: u64) -> Vec<Value> {
    for i in (1..events.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let j = (seed % (i as u64 + 1)) as usize;
        events.swap(i, j);
    }
    events
}

fn ids(events: &[Value]) -> Vec<(i64, String)> {
    events.iter().map(key).collect()
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    /// One delivery per event, each folded before the next is sent.
    Separate,
    /// All events in one delivery.
    Batched,
}

/// The CLI views of the conversation and its end user after the events arrived in this order.
struct Final {
    state: String,
    end_user: String,
}

fn post_events(app: &TestApp, events: &[Value], mode: Mode, tag: &str) {
    match mode {
        Mode::Separate => {
            for e in events {
                let id = format!("{tag}-{}", e["id"].as_str().expect("id"));
                let (status, receipt) = app.post(&delivery(&id, std::slice::from_ref(e)));
                assert_eq!(
                    (
                        status,
                        receipt["status"].as_str(),
                        receipt["accepted"].as_u64()
                    ),
                    (200, Some("accepted"), Some(1)),
                    "{receipt}"
                );
                wait_drained(app);
            }
        }
        Mode::Batched => {
            let (status, receipt) = app.post(&delivery(&format!("{tag}-batch"), events));
            assert_eq!(
                (status, receipt["status"].as_str()),
                (200, Some("accepted")),
                "{receipt}"
            );
            assert_eq!(receipt["accepted"], events.len(), "{receipt}");
            wait_drained(app);
        }
    }
}

fn final_views(app: &TestApp) -> Final {
    Final {
        state: app.cli_ok(&["state", "show", CONV1]),
        end_user: app.cli_ok(&[
            "state",
            "find",
            "--platform",
            "web",
            "--user-key",
            "web-visitor-8841",
        ]),
    }
}

/// Send `events` in this order to a fresh daemon and return what the CLI shows afterwards.
fn run(events: &[Value], mode: Mode) -> Final {
    let app = TestApp::spawn();
    post_events(&app, events, mode, "d");
    assert_eq!(
        app.metric("handoff_events_applied_total"),
        events.len() as f64,
        "{mode:?}"
    );
    final_views(&app)
}

fn assert_same(reference: &Final, other: &Final, what: &str) {
    assert_eq!(
        reference.state, other.state,
        "conversation state differs: {what}"
    );
    assert_eq!(
        reference.end_user, other.end_user,
        "end-user view differs: {what}"
    );
}

#[test]
fn in_order_sequence_gives_the_expected_state() {
    let events = in_order();
    let reference = run(&events, Mode::Separate);
    let s: Value = serde_json::from_str(&reference.state).expect("JSON");
    assert_eq!(s["events_applied"], 11);
    assert_eq!(s["created_at"], 1763690400025_i64);
    assert_eq!(s["deleted_at"], 1763694000011_i64);
    assert_eq!(s["first_event_at"], 1763690400025_i64);
    assert_eq!(s["last_event_at"], 1763694000011_i64);
    assert_eq!(s["handoff"]["phase"]["value"], "ended");
    assert_eq!(s["handoff"]["requested_at"], 1763690402211_i64);
    assert_eq!(s["handoff"]["connected_at"], 1763690465011_i64);
    assert_eq!(s["handoff"]["ended_at"], 1763690800011_i64);
    assert_eq!(
        s["handoff"]["agent"]["value"],
        json!({"userKey": "U3f9c21", "platform": "closer-chat"})
    );
    assert_eq!(s["messages"]["agent_messages"], 2);
    assert_eq!(s["messages"]["user_messages"], 1);
    assert_eq!(s["messages"]["bot_messages"], 1);
    assert_eq!(s["messages"]["last_agent_message_at"], 1763690470011_i64);
    assert_eq!(
        s["messages"]["last_message"]["value"]["id"],
        "6a1d0000-0000-4000-8000-000000000027"
    );
    assert_eq!(
        s["params"]["value"],
        json!({"name": "김민지", "orderNo": "A-20251121-0042"})
    );
    assert_eq!(
        s["navigation"]["value"]["current"],
        json!({"flowId": 3, "nodeId": 12, "visitCount": 1})
    );
    // Only the older update reports a manual status, so it is the one on record.
    assert_eq!(s["manual_status"]["value"], "HANDOVER");
    let u: Value = serde_json::from_str(&reference.end_user).expect("JSON");
    assert_eq!(u["endUser"]["last_conversation_id"]["value"], CONV1);
    assert_eq!(u["lastConversation"], s);

    // The same order as one batch.
    assert_same(
        &reference,
        &run(&events, Mode::Batched),
        "in order, batched",
    );
}

#[test]
fn reversed_order_gives_identical_state() {
    let events = in_order();
    let reference = run(&events, Mode::Separate);
    let mut reversed = events.clone();
    reversed.reverse();
    assert_same(
        &reference,
        &run(&reversed, Mode::Separate),
        "reversed, one delivery each",
    );
    assert_same(
        &reference,
        &run(&reversed, Mode::Batched),
        "reversed, batched",
    );
}

#[test]
fn shuffled_orders_give_identical_state() {
    let events = in_order();
    let reference = run(&events, Mode::Separate);
    let mut reversed = events.clone();
    reversed.reverse();
    for seed in [0x9E37_79B9_7F4A_7C15_u64, 0xD1B5_4A32_D192_ED03] {
        let order = shuffled(events.clone(), seed);
        assert_ne!(ids(&order), ids(&events), "seed {seed:#x} must permute");
        assert_ne!(
            ids(&order),
            ids(&reversed),
            "seed {seed:#x} must differ from reversed"
        );
        let mut sorted = order.clone();
        sorted.sort_by_key(key);
        assert_eq!(
            ids(&sorted),
            ids(&events),
            "a permutation of the same events"
        );
        assert_same(
            &reference,
            &run(&order, Mode::Separate),
            &format!("shuffle {seed:#x}, one delivery each"),
        );
        assert_same(
            &reference,
            &run(&order, Mode::Batched),
            &format!("shuffle {seed:#x}, batched"),
        );
    }
}

#[test]
fn older_events_arriving_last_do_not_roll_state_back() {
    let events = in_order();
    let reference = run(&events, Mode::Separate);
    let older = [older_update(), older_agent_message()];
    let newer: Vec<Value> = events
        .iter()
        .filter(|e| !older.iter().any(|o| o["id"] == e["id"]))
        .cloned()
        .collect();
    assert_eq!(newer.len(), events.len() - 2);

    for mode in [Mode::Separate, Mode::Batched] {
        let app = TestApp::spawn();
        post_events(&app, &newer, mode, "new");
        let before: Value =
            serde_json::from_str(&app.cli_ok(&["state", "show", CONV1])).expect("JSON");
        assert_eq!(before["manual_status"]["value"], Value::Null);

        // The older update arrives last, in a delivery of its own.
        post_events(&app, &older[..1], Mode::Separate, "old");
        let after: Value =
            serde_json::from_str(&app.cli_ok(&["state", "show", CONV1])).expect("JSON");
        assert_eq!(
            after["params"], before["params"],
            "{mode:?}: params rolled back"
        );
        assert_eq!(
            after["navigation"], before["navigation"],
            "{mode:?}: navigation rolled back"
        );
        assert_eq!(after["handoff"], before["handoff"], "{mode:?}");
        assert_eq!(after["messages"], before["messages"], "{mode:?}");
        assert_eq!(
            after["manual_status"]["value"], "HANDOVER",
            "{mode:?}: a field no newer event set is taken"
        );
        // Nothing else moved but the count of applied events.
        let mut expected = before.clone();
        expected["events_applied"] = json!(before["events_applied"].as_u64().expect("n") + 1);
        expected["manual_status"] = after["manual_status"].clone();
        assert_eq!(
            after, expected,
            "{mode:?}: only the event count and the manual status may change"
        );

        // The older agent message arrives last: counted, but the newer agent stays on record.
        post_events(&app, &older[1..], Mode::Separate, "old");
        let last: Value =
            serde_json::from_str(&app.cli_ok(&["state", "show", CONV1])).expect("JSON");
        assert_eq!(
            last["handoff"]["agent"], before["handoff"]["agent"],
            "{mode:?}: agent rolled back"
        );
        assert_eq!(last["handoff"]["agent"]["value"]["userKey"], "U3f9c21");
        assert_eq!(
            last["messages"]["last_message"], before["messages"]["last_message"],
            "{mode:?}: last message rolled back"
        );
        assert_eq!(
            last["messages"]["agent_messages"],
            before["messages"]["agent_messages"].as_u64().expect("n") + 1
        );
        assert_eq!(
            last["messages"]["last_agent_message_at"],
            before["messages"]["last_agent_message_at"]
        );

        // And the end result is byte-identical to receiving everything in order.
        assert_same(
            &reference,
            &final_views(&app),
            &format!("older events last ({mode:?})"),
        );
    }
}
