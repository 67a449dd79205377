//! Help-desk events across a crash (split from tests/it/helpdesk_events.rs, whose help desk and
//! daemon set-up are repeated here): an event the help desk has not yet accepted survives a
//! kill -9 of the daemon and, after a restart on the same data directory, reaches the help desk
//! once with the id it had before.

use crate::common::helpdesk::*;
use crate::common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;

/// A web conversation of the emulator's default seed.
const CONV: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";

/// The daemon with the shipped rules telling the help desk, at any hour, and `desk` as its one
/// endpoint with both secrets; `retry` is the `[outbox]` settings (give-up, backoff, breaker).
fn spawn(root: &Path, desk: &HelpDesk, retry: &str) -> TestApp {
    let config = format!(
        "[helpdesk]\ntranscript_messages = 5\n\n{}\n{retry}\n",
        endpoint(
            "desk",
            desk,
            Some(r#"["handoff.*", "conversation.message"]"#)
        )
    );
    spawn_with(root, &config, &[])
}

/// One `[[helpdesk.endpoints]]` table for `desk`, signed with both secrets; `events` is the
/// TOML array of patterns (`None`: the default, every kind).
fn endpoint(name: &str, desk: &HelpDesk, events: Option<&str>) -> String {
    let events = events.map_or(String::new(), |e| format!("events = {e}\n"));
    format!(
        "[[helpdesk.endpoints]]\nname = \"{name}\"\nurl = \"{url}\"\nsecrets = [\"{OLD_SECRET}\", \"{NEW_SECRET}\"]\n{events}\n",
        url = desk.url
    )
}

/// The daemon on the configuration file `config`, with the shipped rules telling the help desk at
/// any hour, and `env` added (more settings, the test clock, agent API tokens).
fn spawn_with(root: &Path, config: &str, env: &[(&str, &str)]) -> TestApp {
    let path = root.join("bridge.toml");
    std::fs::write(&path, config).expect("config");
    let mut all = vec![
        (
            "HANDOFF_BRIDGE__RULES__SETTINGS__NOTIFY_HELPDESK".to_owned(),
            "true".to_owned(),
        ),
        (
            "HANDOFF_BRIDGE__RULES__SETTINGS__CHECK_BUSINESS_HOURS".to_owned(),
            "false".to_owned(),
        ),
    ];
    all.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    TestApp::spawn_in(
        &root.join("data"),
        Spawn {
            env: all,
            args: vec!["--config".into(), path.to_str().expect("utf-8").into()],
            ..Spawn::default()
        },
    )
}

const FAST_RETRY: &str = r#"[outbox]
give_up_after = "1h"
[outbox.retry]
base = "50ms"
cap = "200ms"
[outbox.breaker]
probe_interval = "100ms""#;

/// The dead letters, through the admin API.
fn dead_letters(app: &TestApp) -> Vec<Value> {
    let (status, body) = app.admin_get("/admin/v1/dead-letters");
    assert_eq!(status, 200, "{body}");
    body["dead_letters"]
        .as_array()
        .cloned()
        .expect("dead_letters")
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
