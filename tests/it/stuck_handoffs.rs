//! The stuck-handoff gauges on the real daemon: `handoff_queue_waiting` counts the conversations
//! waiting for an agent and `handoff_queue_oldest_wait_seconds` ages the longest wait on the
//! daemon's clock (the test clock here); both follow the queue as users ask, agents connect and
//! users cancel, and are right on the first scrape after a restart (the store counts the queue on
//! open and the folds keep the counts; a scrape scans nothing).

use crate::common::{Spawn, TestApp};
use serde_json::json;

const CONV1: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
const CONV2: &str = "5c0e9b1f-2222-4d3e-9f10-000000000002";
const WAITING: &str = "handoff_queue_waiting";
const OLDEST: &str = "handoff_queue_oldest_wait_seconds";

fn spawn_in(dir: &std::path::Path) -> TestApp {
    TestApp::spawn_in(
        dir,
        Spawn {
            env: vec![("HANDOFF_BRIDGE__ADMIN__TEST_CLOCK".into(), "true".into())],
            ..Spawn::default()
        },
    )
}

#[test]
fn the_queue_gauges_follow_requests_and_connects_and_survive_a_restart() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("data");
    let app = spawn_in(&dir);
    // Both gauges are exported, at 0, from the first scrape.
    assert_eq!(app.metric_sample(WAITING), Some(0.0));
    assert_eq!(app.metric_sample(OLDEST), Some(0.0));

    // A user asks for an agent: one waits, and the wait ages with the daemon's clock.
    app.emulator_act(CONV1, "request-agent", json!({}));
    app.emulator_delivered();
    assert_eq!(app.metric(WAITING), 1.0);
    let young = app.metric(OLDEST);
    assert!((0.0..300.0).contains(&young), "{young}");
    app.advance_clock("10m");
    let old = app.metric(OLDEST);
    assert!(
        (600.0..900.0).contains(&old),
        "10 minutes on the test clock: {old}"
    );

    // An agent connects: nobody waits, and there is no age.
    app.emulator_act(CONV1, "agent-connect", json!({}));
    app.emulator_delivered();
    assert_eq!(app.metric(WAITING), 0.0);
    assert_eq!(app.metric(OLDEST), 0.0);

    // Another asks; after a restart the first scrape already knows (the queue is in the store).
    app.emulator_act(CONV2, "request-agent", json!({}));
    app.emulator_delivered();
    assert_eq!(app.metric(WAITING), 1.0);
    assert!(app.terminate().success());
    let app = spawn_in(&dir);
    assert_eq!(app.metric(WAITING), 1.0, "right after the restart");
    // The new process's test clock starts over at the system time, which is behind the request
    // stamped 10 minutes ahead: the age never goes negative.
    assert!(app.metric(OLDEST) >= 0.0);
    app.advance_clock("30m");
    let old = app.metric(OLDEST);
    assert!(
        (1200.0..1800.0 + 300.0).contains(&old),
        "30 minutes on, less the 10 the request was stamped ahead: {old}"
    );

    // The user cancels: the restarted daemon's kept counts follow too.
    app.emulator_act(CONV2, "cancel", json!({}));
    app.emulator_delivered();
    assert_eq!(app.metric(WAITING), 0.0, "after a cancel");
    assert_eq!(app.metric(OLDEST), 0.0);
}
