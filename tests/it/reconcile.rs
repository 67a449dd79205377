//! The reconciliation sweeper on the real daemon with the embedded emulator as the service: a
//! manual status changed at the service without a webhook (the emulator's silent switch, as an
//! agent in the builder's UI) is found by `POST /admin/v1/reconcile`, becomes a `reconcile.drift`
//! event of its conversation (in the audit timeline), the shipped rules repair it (the call
//! reaches the emulator's journal), and `handoff_reconcile_drift_total{kind}` counts it. A dry run
//! writes nothing; a conversation with pending outbox actions is skipped; the periodic pass runs
//! on the daemon's (test) clock; the CLI reaches the running daemon's pass.

use crate::common::{poll_until, Spawn, TestApp};
use serde_json::{json, Value};
use std::time::Duration;

const CONV1: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
const CONV2: &str = "5c0e9b1f-2222-4d3e-9f10-000000000002";
const CONV3: &str = "5c0e9b1f-2222-4d3e-9f10-000000000003";
const DRIFT_ON: &str = "handoff_reconcile_drift_total{kind=\"manual_on_unknown\"}";
const DRIFT_OFF: &str = "handoff_reconcile_drift_total{kind=\"manual_off_unknown\"}";

/// The daemon with the shipped rules, the test clock and the given reconcile interval.
fn spawn(dir: &std::path::Path, interval: &str) -> TestApp {
    TestApp::spawn_in(
        dir,
        Spawn::with_env(&[
            ("HANDOFF_BRIDGE__RULES__ENABLED", "true"),
            // Any time of day: the after-hours rule would turn manual mode off at once.
            (
                "HANDOFF_BRIDGE__RULES__SETTINGS__CHECK_BUSINESS_HOURS",
                "false",
            ),
            ("HANDOFF_BRIDGE__ADMIN__TEST_CLOCK", "true"),
            ("HANDOFF_BRIDGE__RECONCILE__INTERVAL", interval),
            // Quick passes: the seeded conversations are few.
            ("HANDOFF_BRIDGE__RECONCILE__PER_SECOND", "20.0"),
        ]),
    )
}

/// Switch a conversation's manual status at the emulator without any webhook.
fn switch_silently(app: &TestApp, conversation: &str, enabled: bool) {
    let url = format!(
        "{}/_emulator/conversations/{conversation}/manual",
        app.emulator()
    );
    let (status, answer) = app.post_to(
        &url,
        json!({ "enabled": enabled }).to_string().as_bytes(),
        Some("application/json"),
    );
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["enabled"], enabled, "{answer}");
}

fn pass(app: &TestApp, dry_run: bool) -> Value {
    let path = if dry_run {
        "/admin/v1/reconcile?dry_run=true"
    } else {
        "/admin/v1/reconcile"
    };
    let (status, report) = app.admin_post(path);
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["dry_run"], dry_run);
    report
}

/// The drifts of a pass's answer as (conversation, kind).
fn drifts(report: &Value) -> Vec<(String, String)> {
    report["drifts"]
        .as_array()
        .expect("drifts")
        .iter()
        .map(|d| {
            (
                d["conversation_id"].as_str().unwrap_or_default().to_owned(),
                d["kind"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

fn audit_types(app: &TestApp, conversation: &str) -> Vec<String> {
    let (status, audit) = app.admin_get(&format!("/admin/v1/conversations/{conversation}/audit"));
    assert_eq!(status, 200, "{audit}");
    audit["timeline"]
        .as_array()
        .expect("timeline")
        .iter()
        .filter_map(|e| e["type"].as_str().map(str::to_owned))
        .collect()
}

fn conversation(app: &TestApp, id: &str) -> Value {
    let (status, state) = app.admin_get(&format!("/admin/v1/conversations/{id}"));
    assert_eq!(status, 200, "{state}");
    state
}

/// `set-manual` calls the emulator carried out for `conversation`, as their `enabled`.
fn manual_calls(app: &TestApp, conversation: &str) -> Vec<bool> {
    app.journal()
        .iter()
        .filter(|e| e["endpoint"] == "set-manual" && crate::common::took_effect(e))
        .filter(|e| e["path"].as_str().is_some_and(|p| p.contains(conversation)))
        .filter_map(|e| e["body"]["enabled"].as_bool())
        .collect()
}

#[test]
fn manual_on_at_the_service_is_found_folded_repaired_and_counted_and_a_dry_run_writes_nothing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = spawn(&tmp.path().join("data"), "off");
    app.emulator_act(CONV1, "say", json!({ "text": "hello" }));
    app.settle();
    assert_eq!(app.metric_sample(DRIFT_ON), Some(0.0), "exported at 0");
    // The emulator's silent switch: an unknown conversation or a bad body changes nothing.
    let switch = |conversation: &str, body: &str| {
        let url = format!(
            "{}/_emulator/conversations/{conversation}/manual",
            app.emulator()
        );
        app.post_to(&url, body.as_bytes(), Some("application/json"))
    };
    assert_eq!(switch("nobody", r#"{"enabled": true}"#).0, 404);
    assert_eq!(switch(CONV1, r#"{"enabled": "yes"}"#).0, 400);
    let agreed = pass(&app, false);
    assert!(drifts(&agreed).is_empty(), "{agreed}");
    assert!(agreed["checked"].as_u64().unwrap_or(0) >= 1, "{agreed}");

    // An agent turns manual mode on in the builder: the service sends no webhook.
    switch_silently(&app, CONV1, true);

    let dry = pass(&app, true);
    assert_eq!(
        drifts(&dry),
        [(CONV1.to_owned(), "manual_on_unknown".to_owned())],
        "{dry}"
    );
    assert_eq!(dry["written"], 0);
    app.settle();
    assert_eq!(app.metric(DRIFT_ON), 0.0, "a dry run counts nothing");
    assert!(
        !audit_types(&app, CONV1)
            .iter()
            .any(|t| t == "reconcile.drift"),
        "a dry run stores no event"
    );
    assert!(manual_calls(&app, CONV1).is_empty(), "and repairs nothing");

    // Folding held back: the drift waits in the inbox, and a second pass does not report it again.
    let (status, _) = app.admin_post("/admin/v1/dispatch/pause");
    assert_eq!(status, 200);
    let real = pass(&app, false);
    assert_eq!(
        drifts(&real),
        [(CONV1.to_owned(), "manual_on_unknown".to_owned())],
        "{real}"
    );
    let drift = &real["drifts"][0];
    assert_eq!(drift["believed"]["manual"], false, "{drift}");
    assert_eq!(drift["service"]["manual"], true, "{drift}");
    assert_eq!(real["written"], 1);
    assert_eq!(app.metric(DRIFT_ON), 1.0);
    let held = pass(&app, false);
    assert!(drifts(&held).is_empty(), "not folded yet: {held}");
    assert_eq!(held["skipped_pending"], 1, "{held}");
    assert_eq!(app.metric(DRIFT_ON), 1.0, "counted once");
    let (status, _) = app.admin_post("/admin/v1/dispatch/resume");
    assert_eq!(status, 200);
    app.settle();

    // Folded into the conversation's timeline, and the shipped rule handed it back to the bot.
    assert!(
        audit_types(&app, CONV1)
            .iter()
            .any(|t| t == "reconcile.drift"),
        "{:?}",
        audit_types(&app, CONV1)
    );
    assert_eq!(
        manual_calls(&app, CONV1),
        [false],
        "the repair reached the service"
    );
    // Now both agree: a further pass finds nothing and counts nothing more.
    let after = pass(&app, false);
    assert!(drifts(&after).is_empty(), "{after}");
    assert_eq!(app.metric(DRIFT_ON), 1.0);
}

#[test]
fn manual_off_at_the_service_ends_the_wait_and_pending_actions_hold_the_sweeper_back() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = spawn(&tmp.path().join("data"), "off");
    // A user asks for an agent: the shipped rule turns manual mode on and the user waits.
    app.emulator_act(CONV2, "request-agent", json!({}));
    app.settle();
    assert_eq!(manual_calls(&app, CONV2), [true]);
    assert_eq!(app.metric("handoff_queue_waiting"), 1.0);
    let waiting = conversation(&app, CONV2);
    assert!(
        waiting["timers"].as_object().is_some_and(|t| !t.is_empty()),
        "the wait is timed: {waiting}"
    );

    // With the outbox paused, CONV3's request leaves a pending set_manual: that conversation is
    // skipped, even though the service (manual off) differs from what the bridge asked for.
    let (status, _) = app.admin_post("/admin/v1/outbox/pause");
    assert_eq!(status, 200);
    app.emulator_act(CONV3, "request-agent", json!({}));
    app.emulator_delivered();
    // An agent turns manual mode off for CONV2 in the builder.
    switch_silently(&app, CONV2, false);

    let report = pass(&app, false);
    assert_eq!(
        drifts(&report),
        [(CONV2.to_owned(), "manual_off_unknown".to_owned())],
        "{report}"
    );
    assert!(
        report["skipped_pending"].as_u64().unwrap_or(0) >= 1,
        "{report}"
    );
    assert_eq!(app.metric(DRIFT_OFF), 1.0);

    // CONV2's state is brought in line by the fold: the handoff ended, the wait is over.
    let (status, _) = app.admin_post("/admin/v1/outbox/resume");
    assert_eq!(status, 200);
    app.settle();
    let after = conversation(&app, CONV2);
    assert_eq!(after["handoff"]["phase"]["value"], "ended", "{after}");
    assert_eq!(after["manual_status"]["value"], Value::Null, "{after}");
    assert!(
        after["timers"].as_object().is_none_or(|t| t.is_empty()),
        "the wait's timers are cancelled: {after}"
    );
    let labels = after["labels"].as_array().cloned().unwrap_or_default();
    assert!(!labels.contains(&json!("waiting-for-agent")), "{after}");
    assert_eq!(
        app.metric("handoff_queue_waiting"),
        1.0,
        "CONV2 left the queue; CONV3 waits"
    );
    assert!(audit_types(&app, CONV2)
        .iter()
        .any(|t| t == "reconcile.drift"));

    // CONV3's actions ran: the service now agrees with it; nothing drifts.
    let again = pass(&app, false);
    assert!(drifts(&again).is_empty(), "{again}");
    assert_eq!(again["skipped_pending"], 0, "{again}");
}

#[test]
fn the_periodic_pass_runs_on_the_daemon_clock_and_the_cli_reaches_the_daemon() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = spawn(&tmp.path().join("data"), "5m");
    app.emulator_act(CONV1, "say", json!({ "text": "hello" }));
    app.settle();
    switch_silently(&app, CONV1, true);

    // The CLI's dry run asks the running daemon and prints what it found.
    let out = app.cli_ok(&["reconcile", "--dry-run"]);
    let printed: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(
        drifts(&printed),
        [(CONV1.to_owned(), "manual_on_unknown".to_owned())],
        "{out}"
    );
    assert_eq!(app.metric(DRIFT_ON), 0.0, "a dry run counts nothing");

    // No pass before the interval; one after it, on the test clock.
    app.advance_clock("6m");
    poll_until("the periodic pass", Duration::from_secs(30), || {
        (app.metric(DRIFT_ON) >= 1.0).then_some(())
    });
    app.settle();
    assert_eq!(manual_calls(&app, CONV1), [false], "repaired");
    assert!(app.metric("handoff_reconcile_passes_total{outcome=\"done\"}") >= 1.0);

    // Without a running daemon there is no pass to run: a usage error, nothing touched.
    let dir = tmp.path().join("data");
    assert!(app.terminate().success());
    let out = crate::common::cli(&dir, &["reconcile"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("running daemon"),
        "{out:?}"
    );
}
