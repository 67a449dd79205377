//! Reconcile and backfill during an outage: while the outbox's `openapi` circuit is open (the
//! service is down) the sweeper's periodic passes and backfill's passes wait instead of reading a
//! service that only fails, and the sweeper reads nothing; after the circuit closes the sweeper's
//! next pass runs and reads the service again. While backfill reports the webhook silent, a
//! `manual_on_unknown` drift (whose repair turns manual mode off) is held: the bridge may only
//! have missed the agent call.

use crate::common::relay::*;
use crate::common::*;
use serde_json::json;
use std::time::Duration;

const OPEN: &str = r#"handoff_circuit_open{destination="openapi"}"#;
const SKIPPED: &str = r#"handoff_reconcile_passes_total{outcome="skipped"}"#;
const DONE: &str = r#"handoff_reconcile_passes_total{outcome="done"}"#;

fn manual_reads(emu: &str) -> usize {
    journal(emu)
        .iter()
        .filter(|e| e.endpoint.as_deref() == Some("get-manual"))
        .count()
}

#[test]
fn reconcile_and_backfill_wait_while_the_openapi_circuit_is_open() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // Only "ping" is answered: the other conversation has a state and nothing pending, so a
    // sweeper pass would read its manual status.
    let rules = rules_dir(
        tmp.path(),
        r#"
        [[rule]]
        name = "ack"
        on = ["bot.message.received"]
        when = { field = "message.data.text", equals = "ping" }
        actions = [{ type = "send_message", text = "pong" }]
        "#,
    );
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: daemon_env(
                &rules,
                &[
                    ("HANDOFF_BRIDGE__ADMIN__TEST_CLOCK", "true"),
                    ("HANDOFF_BRIDGE__OUTBOX__BREAKER__FAILURES", "1"),
                    ("HANDOFF_BRIDGE__OUTBOX__RETRY__BASE", "10m"),
                    ("HANDOFF_BRIDGE__OUTBOX__RETRY__CAP", "10m"),
                    ("HANDOFF_BRIDGE__RECONCILE__INTERVAL", "1m"),
                    ("HANDOFF_BRIDGE__RECONCILE__PER_SECOND", "20.0"),
                    ("HANDOFF_BRIDGE__BACKFILL__INTERVAL", "1s"),
                ],
            ),
            // Its own process: the test reads the daemon's log.
            own_process: true,
            ..Spawn::default()
        },
    );
    let emu = app.emulator_url.clone().expect("embedded emulator");
    let mut ids = Ids::new(11);
    let quiet = user_message(&mut ids, 1, "hello", 1_763_690_400_000);
    let d = make_delivery(&mut ids, vec![quiet]);
    assert_eq!(app.post(&d.body).0, 200);
    app.settle();

    // The service goes down: the answer's attempt fails and opens the circuit (one failure).
    set_faults(
        &emu,
        json!({"fail_next": 100_000, "status": 503, "path_prefix": "/openapi/"}),
    );
    let ping = user_message(&mut ids, 0, "ping", 1_763_690_401_000);
    let d = make_delivery(&mut ids, vec![ping]);
    assert_eq!(app.post(&d.body).0, 200);
    poll_until("the circuit opens", Duration::from_secs(30), || {
        (app.metric_sample(OPEN) == Some(1.0)).then_some(())
    });
    let reads = manual_reads(&emu);

    // Passes fall due in daemon time while the circuit is open: skipped, nothing read.
    app.advance_clock_unsettled("2m");
    poll_until("a skipped pass", Duration::from_secs(30), || {
        (app.metric_sample(SKIPPED).unwrap_or(0.0) >= 1.0).then_some(())
    });
    poll_until("backfill waits", Duration::from_secs(30), || {
        app.logs()
            .contains("backfill passes wait: the Open API's circuit is open")
            .then_some(())
    });
    // An asked-for pass reads nothing either: the conversation is left for the next pass.
    let (status, report) = app.admin_post("/admin/v1/reconcile");
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["checked"], 0, "{report}");
    assert!(report["read_failed"].as_u64().unwrap_or(0) >= 1, "{report}");
    assert_eq!(
        app.metric_sample(DONE),
        Some(1.0),
        "only the asked-for pass"
    );
    assert_eq!(
        manual_reads(&emu),
        reads,
        "no read while the circuit is open"
    );

    // The service recovers: the next probe closes the circuit and the next pass reads again.
    clear_faults(&emu);
    app.advance_clock_unsettled("1m");
    poll_until("the circuit closes", Duration::from_secs(30), || {
        (app.metric_sample(OPEN) == Some(0.0)).then_some(())
    });
    app.advance_clock_unsettled("2m");
    poll_until("a periodic pass runs", Duration::from_secs(30), || {
        (app.metric_sample(DONE).unwrap_or(0.0) >= 2.0).then_some(())
    });
    assert!(manual_reads(&emu) > reads, "the service is read again");
}

const CONV1: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
const DRIFT_ON: &str = "handoff_reconcile_drift_total{kind=\"manual_on_unknown\"}";

fn say(emu: &str, text: &str) {
    let (status, body) = emu_call(
        "POST",
        &format!("{emu}/_emulator/conversations/{CONV1}/say"),
        Some(&json!({ "text": text })),
    );
    assert_eq!(status, 200, "say: {body}");
}

fn webhook_to(emu: &str, url: &str) {
    let (status, body) = emu_call(
        "POST",
        &format!("{emu}/_emulator/webhook/enable"),
        Some(&json!({ "url": url })),
    );
    assert_eq!(status, 200, "{body}");
}

#[test]
fn manual_on_unknown_is_held_while_the_webhook_is_silent_and_found_once_it_delivers_again() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn::with_env(&[
            ("HANDOFF_BRIDGE__RULES__ENABLED", "true"),
            (
                "HANDOFF_BRIDGE__RULES__SETTINGS__CHECK_BUSINESS_HOURS",
                "false",
            ),
            ("HANDOFF_BRIDGE__ADMIN__TEST_CLOCK", "true"),
            ("HANDOFF_BRIDGE__RECONCILE__INTERVAL", "off"),
            ("HANDOFF_BRIDGE__RECONCILE__PER_SECOND", "20.0"),
            // Passes on start and on demand only.
            ("HANDOFF_BRIDGE__BACKFILL__INTERVAL", "1h"),
        ]),
    );
    let emu = app.emulator().to_owned();
    say(&emu, "hello");
    poll_until("the message folded", Duration::from_secs(30), || {
        let (status, state) = app.admin_get(&format!("/admin/v1/conversations/{CONV1}"));
        (status == 200 && state["messages"]["user_messages"] == 1).then_some(())
    });
    poll_until(
        "a pass that reads a window",
        Duration::from_secs(30),
        || {
            let (status, pass) = app.admin_post("/admin/v1/backfill");
            assert_eq!(status, 200, "{pass}");
            pass["pass"]["to"].as_i64()
        },
    );

    // The service's deliveries fail (a dead address) and it disables the webhook; the user
    // writes meanwhile, and fifteen minutes on backfill finds the webhook silent.
    webhook_to(&emu, "http://127.0.0.1:9/webhook/x");
    for text in ["one", "two", "three"] {
        say(&emu, text);
    }
    poll_until("the webhook disabled", Duration::from_secs(60), || {
        let (status, w) = emu_call("GET", &format!("{emu}/_emulator/webhook"), None);
        assert_eq!(status, 200, "{w}");
        (w["enabled"] == false).then_some(())
    });
    app.advance_clock_unsettled("15m");
    let (status, pass) = app.admin_post("/admin/v1/backfill");
    assert_eq!(status, 200, "{pass}");
    assert_eq!(pass["pass"]["silent"], true, "{pass}");
    // The pass wrote the messages the webhook did not bring: folded before the sweeper reads
    // the state, or it finds the state moved on under it (`skipped_changed`), not the silence.
    wait_drained(&app);

    // Manual mode on at the service, no agent known here: held while silent.
    let (status, answer) = app.post_to(
        &format!("{emu}/_emulator/conversations/{CONV1}/manual"),
        br#"{"enabled": true}"#,
        Some("application/json"),
    );
    assert_eq!(status, 200, "{answer}");
    let (status, report) = app.admin_post("/admin/v1/reconcile");
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["skipped_silent"], 1, "{report}");
    assert_eq!(report["drifts"], json!([]), "{report}");
    assert_eq!(report["written"], 0, "{report}");
    assert_eq!(app.metric_sample(DRIFT_ON), Some(0.0));
    assert_eq!(
        app.metric_sample(r#"handoff_reconcile_skipped_total{reason="webhook_silent"}"#),
        Some(1.0)
    );

    // The webhook delivers again (the held events re-sent): the silence ends, the drift is found.
    webhook_to(&emu, &app.webhook_url);
    poll_until("the silence ends", Duration::from_secs(60), || {
        let (_, body) = app.get("/readyz");
        let body: serde_json::Value = serde_json::from_str(&body).ok()?;
        (body["checks"]["webhook"]["silent"] == false).then_some(())
    });
    // The re-sent events folded first, as above.
    app.emulator_delivered();
    let (status, report) = app.admin_post("/admin/v1/reconcile?dry_run=true");
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["skipped_silent"], 0, "{report}");
    assert_eq!(report["drifts"][0]["kind"], "manual_on_unknown", "{report}");
}
