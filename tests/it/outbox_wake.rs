//! The outbox schedules retries in daemon time: a failed action waits for its next attempt (here
//! minutes away, `outbox.retry.base` 10 min) without holding a slot, and the test clock's advance
//! (`POST /admin/v1/clock/advance`) wakes the executor, so the retry runs at once. Its retry state
//! is kept meanwhile; the action is done exactly once, never a dead letter.

use crate::common::relay::*;
use crate::common::*;
use serde_json::json;
use std::time::Duration;

#[test]
fn a_failed_action_waits_in_daemon_time_and_the_test_clock_wakes_its_retry() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules_dir(
        tmp.path(),
        r#"
        [[rule]]
        name = "ack"
        on = ["bot.message.received"]
        when = { field = "sender", equals = "user" }
        actions = [{ type = "send_message", text = "got it" }]
        "#,
    );
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: daemon_env(
                &rules,
                &[
                    ("HANDOFF_BRIDGE__ADMIN__TEST_CLOCK", "true"),
                    ("HANDOFF_BRIDGE__OUTBOX__RETRY__BASE", "10m"),
                    ("HANDOFF_BRIDGE__OUTBOX__RETRY__CAP", "10m"),
                ],
            ),
            ..Spawn::default()
        },
    );
    let emu = app.emulator_url.clone().expect("embedded emulator");
    set_faults(
        &emu,
        json!({"fail_next": 1, "status": 503, "path_prefix": "/openapi/conversation/"}),
    );
    let mut ids = Ids::new(7);
    let event = user_message(&mut ids, 0, "hello", 1_763_690_400_000);
    let d = make_delivery(&mut ids, vec![event]);
    let (status, receipt) = app.post(&d.body);
    assert_eq!(status, 200, "{receipt}");
    let key = format!("{}/ack/0", d.events[0]);

    // The first attempt fails (503): the action waits, pending, with its next attempt minutes
    // away in daemon time; no dead letter.
    poll_until("the failed attempt", Duration::from_secs(30), || {
        journal(&emu)
            .iter()
            .any(|e| e.idempotency_key.as_deref() == Some(key.as_str()) && e.status == 503)
            .then_some(())
    });
    let (status, idle) = app.admin_get("/admin/v1/outbox/idle?timeout_ms=1000");
    assert_ne!(status, 200, "pending while it waits: {idle}");
    assert_eq!(idle["depth"], 1, "{idle}");
    let (_, letters) = app.admin_get("/admin/v1/dead-letters");
    assert_eq!(letters["count"], 0, "{letters}");
    let calls = |key: &str| {
        journal(&emu)
            .iter()
            .filter(|e| e.idempotency_key.as_deref() == Some(key))
            .count()
    };
    assert_eq!(calls(&key), 1, "no retry inside the client");

    // Daemon time moves past the next attempt: the executor is woken and runs it now.
    app.advance_clock_unsettled("11m");
    let (status, idle) = app.admin_get("/admin/v1/outbox/idle?timeout_ms=20000");
    assert_eq!(status, 200, "the retry ran after the advance: {idle}");
    let effective: Vec<_> = journal(&emu)
        .into_iter()
        .filter(|e| e.idempotency_key.as_deref() == Some(key.as_str()) && e.status == 200)
        .collect();
    assert_eq!(effective.len(), 1, "done exactly once");
    assert_eq!(calls(&key), 2);
    let (_, letters) = app.admin_get("/admin/v1/dead-letters");
    assert_eq!(letters["count"], 0, "{letters}");
    assert_eq!(
        app.metric(r#"handoff_action_attempts_total{action="send_message",status="http_503"}"#),
        1.0
    );
}
