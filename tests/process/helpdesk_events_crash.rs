//! Help-desk events across a crash (split from tests/it/helpdesk_events.rs; both set up the help
//! desk and the daemon with `common::helpdesk`): an event the help desk has not yet accepted
//! survives a kill -9 of the daemon and, after a restart on the same data directory, reaches the
//! help desk once with the id it had before.

use crate::common::helpdesk::*;
use crate::common::*;
use serde_json::json;
use std::path::Path;
use std::time::Duration;

/// A web conversation of the emulator's default seed.
const CONV: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";

/// The daemon with the shipped rules telling the help desk, at any hour, and `desk` as its one
/// endpoint with both secrets; `retry` is the `[outbox]` settings (give-up, backoff, breaker).
fn spawn(root: &Path, desk: &HelpDesk, retry: &str) -> TestApp {
    spawn_desk(root, desk, retry, false)
}

#[test]
fn an_event_waiting_for_the_help_desk_survives_a_crash_and_keeps_its_id() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let desk = HelpDesk::start(&[], 503);
    let app = spawn(tmp.path(), &desk, FAST_RETRY);
    app.emulator_act(CONV, "request-agent", json!({}));
    app.emulator_delivered();
    poll_until("failed attempts", Duration::from_secs(30), || {
        (desk.received().len() >= 2).then_some(())
    });
    let id = desk.received()[0].header("webhook-id").to_owned();
    app.kill9();

    desk.set_then(200);
    let app = spawn(tmp.path(), &desk, FAST_RETRY);
    let delivered = poll_until(
        "the event after the restart",
        Duration::from_secs(30),
        || desk.accepted().into_iter().next(),
    );
    app.settle();
    assert_eq!(delivered.json()["type"], "handoff.requested");
    assert_eq!(
        delivered.header("webhook-id"),
        id,
        "the same id: the help desk dedupes"
    );
    assert_eq!(desk.accepted().len(), 1, "delivered once");
    assert!(dead_letters(&app).is_empty());
}
