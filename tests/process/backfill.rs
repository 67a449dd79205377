//! Backfill when the webhook goes missing (issue 20, part 3), end to end: the bridge is killed
//! (kill -9) while a user writes and asks for an agent at the service; the service (an emulator in
//! its own process, which outlives the bridge) fails its deliveries and disables the webhook; the
//! bridge restarts on the same data directory, reads what it missed through the Open API and folds
//! it (the test rule's handoff runs once); the webhook is reported silent; once the webhook is
//! enabled again the service re-sends everything and nothing is folded twice.

use crate::common::emulator::ExternalEmulator;
use crate::common::relay::{daemon_env, emu_call, journal, rules_dir, EMULATOR_KEY, SEEDED};
use crate::common::{poll_until, wait_drained, Spawn, TestApp};
use serde_json::{json, Value};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(30);

/// A user asking for an agent in words: manual mode on, one message, a label. No guard against
/// firing again, so a message folded twice would show as a second send.
const RULES: &str = r#"
[[rule]]
name = "ask-agent"
on = ["bot.message.received"]
when = { all = [
  { field = "sender", equals = "user" },
  { field = "message.data.text", matches = "agent" },
] }
actions = [
  { type = "set_manual", enabled = true },
  { type = "send_message", text = "queued for an agent" },
  { type = "update_state", add_labels = ["waiting"] },
]
"#;

fn say(emu: &str, conversation: &str, text: &str) {
    let (status, body) = emu_call(
        "POST",
        &format!("{emu}/_emulator/conversations/{conversation}/say"),
        Some(&json!({ "text": text })),
    );
    assert_eq!(status, 200, "say: {body}");
}

fn webhook_status(emu: &str) -> Value {
    let (status, body) = emu_call("GET", &format!("{emu}/_emulator/webhook"), None);
    assert_eq!(status, 200, "{body}");
    body
}

/// The conversation's state (null until the bridge has one).
fn conversation(app: &TestApp, id: &str) -> Value {
    let (status, body) = app.admin_get(&format!("/admin/v1/conversations/{id}"));
    match status {
        200 => body,
        404 => Value::Null,
        _ => panic!("conversation {id}: {status} {body}"),
    }
}

fn readyz_webhook(app: &TestApp) -> Value {
    let (status, body) = app.get("/readyz");
    assert_eq!(
        status, 200,
        "a silent webhook never makes the bridge unready: {body}"
    );
    let body: Value = serde_json::from_str(&body).expect("readyz JSON");
    body["checks"]["webhook"].clone()
}

/// Calls of `endpoint` that took effect at the service.
fn effective(emu: &str, endpoint: &str) -> usize {
    journal(emu)
        .iter()
        .filter(|e| e.endpoint.as_deref() == Some(endpoint))
        .filter(|e| e.fault.is_none() && !e.replayed && (200..300).contains(&e.status))
        .count()
}

/// Every action decided so far was carried out.
fn outbox_idle(app: &TestApp) {
    wait_drained(app);
    let (status, body) = app.admin_get("/admin/v1/outbox/idle?timeout_ms=20000");
    assert_eq!(status, 200, "outbox not idle: {body}");
}

#[test]
fn after_an_outage_that_disabled_the_webhook_backfill_folds_what_was_missed_once() {
    // The emulator starts with a dead webhook URL; each bridge registers its own (the bot's
    // webhook settings).
    let emulator =
        ExternalEmulator::start_with_webhook(EMULATOR_KEY, "http://127.0.0.1:9/webhook/x");
    let emu = emulator.base.clone();
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules_dir(tmp.path(), RULES);
    let dir = tmp.path().join("data");
    let spawn = Spawn {
        env: daemon_env(
            &rules,
            &[
                ("HANDOFF_BRIDGE_UPSTREAM_URL", emu.as_str()),
                ("HANDOFF_BRIDGE_UPSTREAM_API_KEY", EMULATOR_KEY),
                ("HANDOFF_BRIDGE__ADMIN__TEST_CLOCK", "true"),
                // Passes on start and on demand only: the test decides when.
                ("HANDOFF_BRIDGE__BACKFILL__INTERVAL", "1h"),
            ],
        ),
        ..Spawn::default()
    };
    let (conv, _, _) = SEEDED[0];
    let enable = |url: &str| {
        let (status, body) = emu_call(
            "POST",
            &format!("{emu}/_emulator/webhook/enable"),
            Some(&json!({ "url": url })),
        );
        assert_eq!(status, 200, "{body}");
        body
    };

    // 1. The webhook works: a first message is delivered and folded.
    let app = TestApp::spawn_in(&dir, spawn.clone());
    enable(&app.webhook_url);
    say(&emu, conv, "hi");
    poll_until("the first message folded", LIMIT, || {
        (conversation(&app, conv)["messages"]["user_messages"] == 1).then_some(())
    });
    assert_eq!(readyz_webhook(&app)["silent"], false);
    // A pass has read a window and made its cursor durable (the one on start normally has).
    poll_until("a pass that reads a window", LIMIT, || {
        let (status, pass) = app.admin_post("/admin/v1/backfill");
        assert_eq!(status, 200, "{pass}");
        assert_eq!(
            pass["pass"]["missing"], 0,
            "the webhook delivered everything: {pass}"
        );
        pass["pass"]["to"].as_i64()
    });
    app.kill9();

    // 2. The bridge is down: the user writes and asks for an agent, and the agent call is made.
    // The deliveries fail, and the third failure disables the webhook.
    say(&emu, conv, "hello again");
    say(&emu, conv, "I want an agent please");
    let (status, body) = emu_call(
        "POST",
        &format!("{emu}/_emulator/conversations/{conv}/request-agent"),
        Some(&json!({})),
    );
    assert_eq!(status, 200, "{body}");
    let disabled = poll_until("the webhook disabled", LIMIT, || {
        let w = webhook_status(&emu);
        (w["enabled"] == false).then_some(w)
    });
    assert_eq!(
        disabled["failures"].as_array().map(Vec::len),
        Some(3),
        "{disabled}"
    );
    assert!(
        disabled["reason"]
            .as_str()
            .is_some_and(|r| r.contains("3 failed deliveries")),
        "{disabled}"
    );
    assert!(
        journal(&emu)
            .iter()
            .any(|e| e.endpoint.as_deref() == Some("webhook-disabled")),
        "the journal shows the webhook disabled"
    );
    let (status, _) = emu_call(
        "GET",
        &format!("{emu}/_emulator/webhook/flushed?timeout_ms=1000"),
        None,
    );
    assert_eq!(status, 409, "disabled: nothing will be flushed");

    // 3. The bridge restarts on the same data: its start pass backfills the two messages, and
    // the rule's handoff runs (once).
    let app = TestApp::spawn_in(&dir, spawn.clone());
    poll_until("the missed messages backfilled", LIMIT, || {
        (conversation(&app, conv)["messages"]["user_messages"] == 3).then_some(())
    });
    outbox_idle(&app);
    assert_eq!(effective(&emu, "set-manual"), 1);
    assert_eq!(effective(&emu, "send-conversation-message"), 1);
    let state = emu_call("GET", &format!("{emu}/_emulator/state"), None).1;
    let record = state["conversations"]
        .as_array()
        .and_then(|c| c.iter().find(|r| r["conversation"]["id"] == conv))
        .cloned()
        .expect("the conversation at the service");
    assert_eq!(
        record["manual"]["enabled"], true,
        "the handoff reached the service"
    );
    let backfilled = app.metric("handoff_backfill_events_total");
    assert!(backfilled >= 2.0, "{backfilled}");
    assert_eq!(
        readyz_webhook(&app)["silent"],
        false,
        "missing for seconds only: not silent yet"
    );

    // 4. Still disabled, the user writes again; ten minutes on, a pass finds the webhook silent.
    say(&emu, conv, "still there?");
    app.advance_clock_unsettled("15m");
    let (status, pass) = app.admin_post("/admin/v1/backfill");
    assert_eq!(status, 200, "{pass}");
    assert_eq!(pass["pass"]["silent"], true, "{pass}");
    assert!(
        pass["pass"]["stored"].as_u64().is_some_and(|n| n >= 1),
        "{pass}"
    );
    assert_eq!(app.metric("handoff_webhook_silent"), 1.0);
    let detail = readyz_webhook(&app);
    assert_eq!(detail["silent"], true, "{detail}");
    assert!(detail["since"].is_i64(), "{detail}");
    assert!(
        app.logs()
            .contains("the service may have disabled the webhook after failed deliveries"),
        "the warn line names the likely cause"
    );
    poll_until("the newest message backfilled", LIMIT, || {
        (conversation(&app, conv)["messages"]["user_messages"] == 4).then_some(())
    });
    outbox_idle(&app);
    let before = conversation(&app, conv);
    assert!(
        before["labels"]
            .as_array()
            .is_some_and(|l| l.contains(&json!("waiting"))),
        "the rule's handoff is in the state: {before}"
    );
    assert_eq!(
        before["manual_status"]["value"], "HANDOVER",
        "inferred from the conversation as the Open API shows it: {before}"
    );
    let (status, audit_before) = app.admin_get(&format!("/admin/v1/conversations/{conv}/audit"));
    assert_eq!(status, 200, "{audit_before}");
    let decided = |audit: &Value| -> usize {
        audit["timeline"]
            .as_array()
            .map(|t| {
                t.iter()
                    .map(|e| e["actions"].as_array().map_or(0, Vec::len))
                    .sum()
            })
            .unwrap_or(0)
    };
    let actions_before = decided(&audit_before);
    assert_eq!(
        actions_before, 2,
        "set_manual and send_message: {audit_before}"
    );

    // 5. The webhook is enabled again: the service re-sends every held event with its ids. The
    // messages are duplicates of the backfilled ones (no state change, no rule); the agent call,
    // which the Open API could not show, arrives now; the silence ends.
    let enabled = enable(&app.webhook_url);
    assert_eq!(enabled["enabled"], true);
    let (status, body) = emu_call(
        "GET",
        &format!("{emu}/_emulator/webhook/flushed?timeout_ms=30000"),
        None,
    );
    assert_eq!(status, 200, "the held events re-sent: {body}");
    assert!(
        journal(&emu)
            .iter()
            .any(|e| e.endpoint.as_deref() == Some("webhook-enabled")),
        "the journal shows the webhook enabled again"
    );
    poll_until("the agent call folded", LIMIT, || {
        (conversation(&app, conv)["handoff"]["phase"]["value"] == "requested").then_some(())
    });
    outbox_idle(&app);
    let after = conversation(&app, conv);
    assert_eq!(
        after["messages"]["user_messages"], 4,
        "no message counted twice"
    );
    assert_eq!(
        after["messages"]["bot_messages"], before["messages"]["bot_messages"],
        "the re-sent echo of the bot's message is a duplicate too"
    );
    assert_eq!(
        after["events_applied"].as_u64(),
        before["events_applied"].as_u64().map(|n| n + 1),
        "only the agent call was new"
    );
    assert_eq!(effective(&emu, "set-manual"), 1, "the handoff ran once");
    assert_eq!(
        effective(&emu, "send-conversation-message"),
        1,
        "one message to the user"
    );
    let (status, audit_after) = app.admin_get(&format!("/admin/v1/conversations/{conv}/audit"));
    assert_eq!(status, 200);
    assert_eq!(
        decided(&audit_after),
        actions_before,
        "no action decided again"
    );
    let timeline = audit_after["timeline"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        timeline.iter().any(|e| e["source"] == "backfill"),
        "backfilled events are marked in the audit"
    );
    assert!(
        timeline
            .iter()
            .filter(|e| e["duplicate_message"].is_string())
            .count()
            >= 3,
        "the re-sent copies show as duplicates: {audit_after}"
    );
    assert_eq!(
        readyz_webhook(&app)["silent"],
        false,
        "deliveries arrive again"
    );
    assert_eq!(app.metric("handoff_webhook_silent"), 0.0);
    assert!(app.terminate().success(), "a clean stop, backfill included");
}

#[test]
fn the_webhook_refuses_backfill_ids_from_outside() {
    let app = TestApp::spawn();
    let body = crate::common::delivery(
        "d-backfill-1",
        &[json!({
            "id": "backfill:message:m1",
            "event": "bot.message.received",
            "sourceType": "bot",
            "sourceId": "B1",
            "timestamp": 1_763_690_400_000i64,
            "data": {"message": {"id": "m1", "conversationId": "c1", "isUser": true, "meta": null,
                     "data": {"type": "text", "text": "x"}}}
        })],
    );
    let (status, answer) = app.post(&body);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["accepted"], 0, "{answer}");
    assert!(answer["quarantine_id"].is_number(), "{answer}");
}

/// The other order: the webhook's copy of a message is stored first (folding held back, so the
/// state does not know it yet and backfill reads it as missing), then backfill's copy; once
/// folding resumes the first copy is folded and the second is a duplicate.
#[test]
fn a_message_stored_by_the_webhook_then_by_backfill_is_folded_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules_dir(tmp.path(), RULES);
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: daemon_env(&rules, &[("HANDOFF_BRIDGE__BACKFILL__INTERVAL", "1h")]),
            ..Spawn::default()
        },
    );
    let emu = app.emulator().to_owned();
    let (conv, _, _) = SEEDED[1];
    // A new store's first pass (normally the one on start) only sets the cursor.
    poll_until("a pass that reads a window", LIMIT, || {
        let (status, pass) = app.admin_post("/admin/v1/backfill");
        assert_eq!(status, 200, "{pass}");
        pass["pass"]["to"].as_i64()
    });
    let (status, body) = app.admin_post("/admin/v1/dispatch/pause");
    assert_eq!(status, 200, "{body}");
    say(&emu, conv, "an agent please");
    let (status, body) = emu_call(
        "GET",
        &format!("{emu}/_emulator/webhook/flushed?timeout_ms=30000"),
        None,
    );
    assert_eq!(status, 200, "the webhook delivered it: {body}");
    let (status, pass) = app.admin_post("/admin/v1/backfill");
    assert_eq!(status, 200, "{pass}");
    // The message, and the conversation the bridge has no state for yet (inferred).
    assert_eq!(pass["pass"]["messages_read"], 1, "{pass}");
    assert_eq!(
        pass["pass"]["stored"], 2,
        "not folded yet, so read as missing: {pass}"
    );
    assert_eq!(
        pass["pass"]["silent"], false,
        "seconds late is not silence: {pass}"
    );
    let (status, body) = app.admin_post("/admin/v1/dispatch/resume");
    assert_eq!(status, 200, "{body}");
    app.settle();
    let state = conversation(&app, conv);
    assert_eq!(state["messages"]["user_messages"], 1, "{state}");
    assert_eq!(effective_embedded(&app, "set-manual"), 1);
    assert_eq!(effective_embedded(&app, "send-conversation-message"), 1);
    let (status, audit) = app.admin_get(&format!("/admin/v1/conversations/{conv}/audit"));
    assert_eq!(status, 200);
    let timeline = audit["timeline"].as_array().cloned().unwrap_or_default();
    let dup = timeline
        .iter()
        .find(|e| e["duplicate_message"].is_string())
        .unwrap_or_else(|| panic!("a duplicate in {audit}"));
    assert_eq!(
        dup["source"], "backfill",
        "the second copy is backfill's: {audit}"
    );
    // A later pass finds nothing missing.
    let (status, pass) = app.admin_post("/admin/v1/backfill");
    assert_eq!(status, 200, "{pass}");
    assert_eq!(pass["pass"]["missing"], 0, "{pass}");
    assert_eq!(readyz_webhook(&app)["silent"], false);
}

/// Calls of `endpoint` that took effect at the embedded emulator.
fn effective_embedded(app: &TestApp, endpoint: &str) -> usize {
    app.journal()
        .iter()
        .filter(|e| e["endpoint"] == endpoint && crate::common::took_effect(e))
        .count()
}

/// A failed Open API read ends the pass without moving its cursor: the next pass reads the same
/// window again and finds what the failed one could not.
#[test]
fn a_failed_read_leaves_the_cursor_for_the_next_pass() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules_dir(tmp.path(), RULES);
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: daemon_env(&rules, &[("HANDOFF_BRIDGE__BACKFILL__INTERVAL", "1h")]),
            ..Spawn::default()
        },
    );
    let emu = app.emulator().to_owned();
    // A new store's first pass (normally the one on start) only sets the cursor.
    let cursor = poll_until("a pass that reads a window", LIMIT, || {
        let (status, pass) = app.admin_post("/admin/v1/backfill");
        assert_eq!(status, 200, "{pass}");
        pass["pass"]["to"].as_i64()
    });
    // Held back from folding, the message is one the state does not know.
    let (status, body) = app.admin_post("/admin/v1/dispatch/pause");
    assert_eq!(status, 200, "{body}");
    let (conv, _, _) = SEEDED[2];
    say(&emu, conv, "hello");
    crate::common::relay::set_faults(
        &emu,
        json!({"error_rate": 1.0, "status": 503, "path_prefix": "/openapi/messages"}),
    );
    let (status, failed) = app.admin_post("/admin/v1/backfill");
    assert_eq!(status, 502, "{failed}");
    assert_eq!(failed["error"]["code"], "backfill_failed", "{failed}");
    crate::common::relay::clear_faults(&emu);
    let (status, again) = app.admin_post("/admin/v1/backfill");
    assert_eq!(status, 200, "{again}");
    assert_eq!(
        again["pass"]["from"].as_i64(),
        Some(cursor - 120_000),
        "from the last good pass's end, minus the overlap: {again}"
    );
    assert!(
        again["pass"]["stored"].as_u64().is_some_and(|n| n >= 1),
        "{again}"
    );
    let (status, body) = app.admin_post("/admin/v1/dispatch/resume");
    assert_eq!(status, 200, "{body}");
    app.settle();
    assert_eq!(conversation(&app, conv)["messages"]["user_messages"], 1);
}

/// The emulator's webhook controls refuse what they cannot use, and its state shows the webhook.
#[test]
fn the_emulator_webhook_controls_check_their_input_and_show_the_status() {
    let emulator =
        ExternalEmulator::start_with_webhook(EMULATOR_KEY, "http://127.0.0.1:9/webhook/x");
    let emu = emulator.base.clone();
    let status = webhook_status(&emu);
    assert_eq!(status["enabled"], true, "{status}");
    assert!(
        status.get("url").is_none(),
        "the URL (its token) is not shown: {status}"
    );
    for bad in [
        json!({"url": "ftp://x"}),
        json!({"bogus": 1}),
        json!("text"),
    ] {
        let (code, body) = emu_call(
            "POST",
            &format!("{emu}/_emulator/webhook/enable"),
            Some(&bad),
        );
        assert_eq!(code, 400, "{bad}: {body}");
        assert_eq!(body["error"]["code"], "invalid_body", "{body}");
    }
    let (code, body) = emu_call("POST", &format!("{emu}/_emulator/webhook/enable"), None);
    assert_eq!(code, 200, "no body: enable as it is: {body}");
    let (code, state) = emu_call("GET", &format!("{emu}/_emulator/state"), None);
    assert_eq!(code, 200);
    assert_eq!(state["webhook"]["enabled"], true, "{}", state["webhook"]);
    assert!(
        !journal(&emu).iter().any(|e| e.method == "WEBHOOK"),
        "enabling an enabled webhook changes nothing worth a journal entry"
    );
}
