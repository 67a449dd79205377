//! The Chatwoot connector's calls against a mock generated from Chatwoot's own OpenAPI document
//! that validates every request (`prism mock --errors ../shared/chatwoot/swagger.json`, started
//! by `.ci/run`, pinned in `tests/chatwoot/package.json`): a call outside the document (a path,
//! a method, a missing required field, a wrong type, no `api_access_token`) is answered 4xx and
//! becomes a dead letter, which fails the test. Prism answers with the document's examples, not
//! with what Chatwoot's running code returns; the connector copes as docs/chatwoot.md says (a
//! created contact's `id` at the top, its source id its own).
//!
//! `HANDOFF_BRIDGE_CHATWOOT_MOCK_URL` names the mock; without it the test says it was skipped and
//! passes (a plain `cargo test` on a fresh machine).

use crate::common::*;
use serde_json::json;

const WEB: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
const MOCK_URL: &str = "HANDOFF_BRIDGE_CHATWOOT_MOCK_URL";

#[test]
fn a_handoff_calls_only_what_chatwoots_openapi_document_declares() {
    let Ok(url) = std::env::var(MOCK_URL) else {
        eprintln!("skipped: {MOCK_URL} is not set (.ci/run starts the validating mock)");
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let config = tmp.path().join("bridge.toml");
    std::fs::write(
        &config,
        format!(
            "[helpdesk.chatwoot]\nurl = \"{}\"\naccount_id = 1\ninbox_id = 7\n\n\
             [helpdesk.chatwoot.bots.B7f3a2c]\nteam_id = 3\nlabels = [\"vip\"]\n",
            url.trim_end_matches('/')
        ),
    )
    .expect("config");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: vec![
                (
                    "HANDOFF_BRIDGE_CHATWOOT_API_TOKEN".into(),
                    "prism-token".into(),
                ),
                (
                    "HANDOFF_BRIDGE_CHATWOOT_WEBHOOK_SECRET".into(),
                    "prism-secret-0123456789".into(),
                ),
                (
                    "HANDOFF_BRIDGE__RULES__SETTINGS__CHECK_BUSINESS_HOURS".into(),
                    "false".into(),
                ),
                ("HANDOFF_BRIDGE__ADMIN__TEST_CLOCK".into(), "true".into()),
            ],
            args: vec!["--config".into(), config.display().to_string()],
            ..Spawn::default()
        },
    );
    // A handoff, a later user message, a queue update, the wait running out (note, resolve).
    app.emulator_act(WEB, "request-agent", json!({}));
    app.settle();
    app.emulator_act(WEB, "say", json!({"text": "still there?"}));
    app.settle();
    app.advance_clock("5m");
    app.settle();
    let (status, letters) = app.admin_get("/admin/v1/dead-letters");
    assert_eq!(status, 200, "{letters}");
    assert_eq!(
        letters["dead_letters"].as_array().map_or(0, Vec::len),
        0,
        "every call validated against the document: {letters:#}"
    );
    let ok = |operation: &str| {
        app.metric(&format!(
            r#"handoff_desk_calls_total{{connector="chatwoot",operation="{operation}",outcome="ok"}}"#
        ))
    };
    for operation in [
        "search_contact",
        "create_contact",
        "create_conversation",
        "set_labels",
        "post_message",
        "toggle_status",
    ] {
        assert!(ok(operation) >= 1.0, "{operation} went through the mock");
    }
    eprintln!(
        "validated by the mock: {} messages posted",
        ok("post_message")
    );
}
