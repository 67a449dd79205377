//! The local loop on embedded defaults: the emulator (playing the service) sends webhook
//! deliveries to the running bridge, and the bridge's state reflects them.

use crate::common::*;
use serde_json::Value;

const CONV: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";

fn emulator_post(app: &TestApp, path: &str, body: Option<&str>) -> (u16, Value) {
    let base = app
        .emulator_url
        .as_deref()
        .expect("embedded emulator by default");
    app.post_to(
        &format!("{base}/_emulator/conversations/{CONV}/{path}"),
        body.unwrap_or("{}").as_bytes(),
        Some("application/json"),
    )
}

/// Wait until the emulator has delivered every event (it answers when its sender is done, not
/// by polling), then until the bridge has folded them, and return the conversation's state.
fn settled_state(app: &TestApp) -> Value {
    let base = app.emulator_url.as_deref().expect("emulator");
    let mut resp = app
        .agent
        .get(format!("{base}/_emulator/webhook/flushed?timeout_ms=20000"))
        .call()
        .expect("flushed");
    assert_eq!(
        resp.status().as_u16(),
        200,
        "{}",
        resp.body_mut().read_to_string().unwrap_or_default()
    );
    wait_drained(app);
    let (status, state) = app.admin_get(&format!("/admin/v1/conversations/{CONV}"));
    assert_eq!(status, 200, "{state}");
    state
}

#[test]
fn emulator_webhooks_reach_the_bridge_and_fold_into_state() {
    let app = TestApp::spawn();
    assert!(
        app.emulator_url.is_some(),
        "the default upstream is the embedded emulator"
    );

    let (status, _) = emulator_post(&app, "request-agent", None);
    assert_eq!(status, 200);
    let (status, msg) = emulator_post(&app, "say", Some(r#"{"text":"상담원 연결해 주세요"}"#));
    assert_eq!(status, 200, "{msg}");
    let state = settled_state(&app);
    assert_eq!(state["messages"]["user_messages"], 1);
    assert_eq!(state["handoff"]["phase"]["value"], "requested");
    assert_eq!(state["messages"]["last_message"]["value"]["id"], msg["id"]);

    emulator_post(&app, "agent-connect", None);
    let state = settled_state(&app);
    assert_eq!(state["handoff"]["phase"]["value"], "connected");
    assert_eq!(
        state["manual_status"]["value"], "HANDOVER",
        "the emulator mirrors manual mode into context"
    );

    emulator_post(&app, "agent-end", None);
    let state = settled_state(&app);
    assert_eq!(state["handoff"]["phase"]["value"], "ended");
    assert!(state["handoff"]["ended_at"].is_number());
    assert_eq!(state["events_applied"], 4);

    // Unknown conversation: the emulator refuses, nothing is sent.
    let base = app.emulator_url.clone().expect("emulator");
    let (status, body) = app.post_to(
        &format!("{base}/_emulator/conversations/nope/say"),
        br#"{"text":"x"}"#,
        Some("application/json"),
    );
    assert_eq!(status, 404, "{body}");

    // The bridge's admin API exposes the embedded emulator's journal (no Open API calls yet:
    // the bridge takes no actions until rules exist).
    let (status, journal) = app.admin_get("/admin/v1/emulator/journal");
    assert_eq!(status, 200);
    assert!(journal.as_array().is_some());
}

#[test]
fn a_bridge_with_a_real_upstream_has_no_emulator_journal() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: vec![(
                "HANDOFF_BRIDGE_UPSTREAM_URL".into(),
                "http://127.0.0.1:9".into(),
            )],
            ..Spawn::default()
        },
    );
    assert!(app.emulator_url.is_none());
    let (status, body) = app.admin_get("/admin/v1/emulator/journal");
    assert_eq!(status, 404, "{body}");
}
