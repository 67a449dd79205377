//! Reconcile and backfill during an outage: while the outbox's `openapi` circuit is open (the
//! service is down) the sweeper's periodic passes and backfill's passes wait instead of reading a
//! service that only fails, and the sweeper reads nothing; after the circuit closes the sweeper's
//! next pass runs and reads the service again.

mod common;

use common::relay::*;
use common::*;
use serde_json::json;
use std::time::Duration;

const OPEN: &str = r#"handoff_circuit_open{destination="openapi"}"#;
const SKIPPED: &str = r#"handoff_reconcile_passes_total{outcome="skipped"}"#;
const DONE: &str = r#"handoff_reconcile_passes_total{outcome="done"}"#;

fn advance(app: &TestApp, by: &str) {
    let mut resp = agent()
        .post(app.admin_url("/admin/v1/clock/advance"))
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .header("content-type", "application/json")
        .send(json!({ "by": by }).to_string())
        .expect("POST");
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    assert_eq!(resp.status().as_u16(), 200, "test clock: {text}");
}

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
    advance(&app, "2m");
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
    advance(&app, "1m");
    poll_until("the circuit closes", Duration::from_secs(30), || {
        (app.metric_sample(OPEN) == Some(0.0)).then_some(())
    });
    advance(&app, "2m");
    poll_until("a periodic pass runs", Duration::from_secs(30), || {
        (app.metric_sample(DONE).unwrap_or(0.0) >= 2.0).then_some(())
    });
    assert!(manual_reads(&emu) > reads, "the service is read again");
}
