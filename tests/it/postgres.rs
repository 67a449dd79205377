//! The daemon whole on PostgreSQL (`store.url`): a handoff end to end with the embedded emulator
//! as the service, a restart that keeps everything, and the database unreachable for a while
//! (intake 503 with `Retry-After`, `/readyz` not ready, all resuming on its own). Each test has a
//! schema of its own in the database `HANDOFF_BRIDGE_TEST_PG_URL` names (`tests/lib/postgres.sh`);
//! without it each says it was skipped and passes.

use crate::common::forwarder::Forwarder;
use crate::common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;
use storage_pg::testing::TestDb;

const CONV: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";

/// The daemon on `url` (its schema in it), the shipped rules on (business hours off), the test
/// clock on.
fn spawn_on(url: &str, data: &Path) -> TestApp {
    let env = [
        ("HANDOFF_BRIDGE_STORE_URL", url),
        ("HANDOFF_BRIDGE__RULES__ENABLED", "true"),
        (
            "HANDOFF_BRIDGE__RULES__SETTINGS__CHECK_BUSINESS_HOURS",
            "false",
        ),
        ("HANDOFF_BRIDGE__ADMIN__TEST_CLOCK", "true"),
    ];
    TestApp::spawn_in(data, Spawn::with_env(&env))
}

/// The Open API calls the daemon made for [`CONV`] that took effect: (endpoint, body).
fn calls(app: &TestApp) -> Vec<(String, Value)> {
    app.journal()
        .iter()
        .filter(|e| e["path"].as_str().is_some_and(|p| p.contains(CONV)))
        .filter(|e| took_effect(e) && e["method"] != "GET")
        .map(|e| {
            (
                e["endpoint"].as_str().unwrap_or_default().to_owned(),
                e["body"].clone(),
            )
        })
        .collect()
}

fn state(app: &TestApp) -> Value {
    let (status, state) = app.admin_get(&format!("/admin/v1/conversations/{CONV}"));
    assert_eq!(status, 200, "{state}");
    state
}

#[test]
fn a_whole_handoff_runs_on_postgres_and_a_restart_keeps_everything() {
    let Some(db) = TestDb::fresh("the daemon on PostgreSQL") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let app = spawn_on(&db.url_with_schema(), &data);
    app.emulator_act(CONV, "request-agent", json!({}));
    app.settle();
    let waiting = state(&app);
    assert_eq!(
        waiting["handoff"]["phase"]["value"], "requested",
        "{waiting}"
    );
    app.emulator_act(CONV, "agent-connect", json!({}));
    app.settle();
    let connected = state(&app);
    assert_eq!(connected["labels"], json!(["with-agent"]), "{connected}");
    assert_eq!(connected["timers"], json!({}), "the wait is cancelled");
    let made: Vec<String> = calls(&app).into_iter().map(|(e, _)| e).collect();
    assert_eq!(
        made,
        ["set-manual", "send-conversation-message"],
        "the handoff's calls, carried out once each"
    );
    let (_, outbox) = app.admin_get("/admin/v1/outbox");
    let events = connected["events_applied"].clone();
    assert_eq!(app.terminate().code(), Some(0));

    // A new process on the same database: everything is there, nothing is carried out again.
    let again = spawn_on(&db.url_with_schema(), &data);
    again.settle();
    let after = state(&again);
    assert_eq!(after["events_applied"], events, "{after}");
    assert_eq!(after["labels"], json!(["with-agent"]));
    assert_eq!(again.admin_get("/admin/v1/outbox").1, outbox);
    assert!(
        calls(&again).is_empty(),
        "nothing decided before is carried out again"
    );
    again.emulator_act(CONV, "agent-end", json!({}));
    again.settle();
    let ended = state(&again);
    assert_eq!(ended["labels"], json!([]), "{ended}");
    let made: Vec<String> = calls(&again).into_iter().map(|(e, _)| e).collect();
    assert_eq!(
        made,
        ["set-manual"],
        "the hand-back, folded on what was kept"
    );
}

/// `postgres://user:password@HOST:PORT/...` with another host and port.
fn through(url: &str, at: std::net::SocketAddr) -> String {
    let (before, rest) = url.split_once('@').expect("user info");
    let (_, path) = rest.split_once('/').expect("database");
    format!("{before}@{at}/{path}")
}

/// The database's address in `url`.
fn address(url: &str) -> std::net::SocketAddr {
    let (_, rest) = url.split_once('@').expect("user info");
    let (host, _) = rest.split_once('/').expect("database");
    host.parse().expect("an IP:port (tests/lib/postgres.sh)")
}

/// A user's message in conversation `c-outage`, as the service sends it.
fn message(n: u32, text: &str) -> Vec<u8> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let id = |kind: u32| format!("0000{n:04x}-{kind:04x}-4000-8000-000000000001");
    let event = json!({
        "id": id(0xe), "event": "bot.message.received", "sourceType": "bot", "sourceId": "B1",
        "timestamp": now,
        "data": { "message": {
            "id": id(0xa), "endUserId": "u-outage", "conversationId": "c-outage",
            "data": {"type": "text", "text": text}, "meta": null, "isUser": true,
            "timestamp": now, "requestId": id(0xb),
        }},
    });
    delivery(&id(0xd), &[event])
}

#[test]
fn the_database_away_for_a_while_is_refused_503_and_everything_resumes_on_its_own() {
    let Some(db) = TestDb::fresh("the database unreachable") else {
        return;
    };
    let mut fwd = Forwarder::start(address(&db.url_with_schema()));
    let tmp = tempfile::tempdir().expect("tempdir");
    let at = fwd
        .url()
        .trim_start_matches("http://")
        .parse()
        .expect("forwarder");
    let url = through(&db.url_with_schema(), at);
    let env = [("HANDOFF_BRIDGE_STORE_URL", url.as_str())];
    let app = TestApp::spawn_in(&tmp.path().join("data"), Spawn::with_env(&env));
    assert_eq!(app.post(&message(1, "before")).0, 200);

    fwd.close();
    let refused = poll_until("a delivery refused", Duration::from_secs(30), || {
        let response = app
            .agent
            .post(&app.webhook_url)
            .header("content-type", "application/json")
            .send(&message(2, "during"))
            .expect("answered");
        (response.status().as_u16() == 503).then(|| response.headers().get("retry-after").cloned())
    });
    assert!(refused.is_some(), "503 with Retry-After");
    poll_until("/readyz not ready", Duration::from_secs(30), || {
        (app.get("/readyz").0 == 503).then_some(())
    });

    fwd.open();
    poll_until("deliveries taken again", Duration::from_secs(60), || {
        (app.post(&message(2, "during")).0 == 200).then_some(())
    });
    poll_until("/readyz ready", Duration::from_secs(30), || {
        (app.get("/readyz").0 == 200).then_some(())
    });
    wait_drained(&app);
    let (status, state) = app.admin_get("/admin/v1/conversations/c-outage");
    assert_eq!(status, 200, "{state}");
    assert_eq!(
        state["events_applied"], 2,
        "both folded, the refused one once: {state}"
    );
}
