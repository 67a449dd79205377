mod common;
use common::*;

#[test]
fn a_fixture_is_accepted_and_shown_by_the_cli() {
    let app = TestApp::spawn();
    let (_, body) = fixtures()
        .into_iter()
        .find(|(n, _)| n == "agent-call-requested.json")
        .expect("fixture");
    let (status, receipt) = app.post(&body);
    assert_eq!(status, 200, "{receipt}");
    assert_eq!(receipt["status"], "accepted");
    wait_drained(&app);
    let out = app.cli(&["state", "show", "5c0e9b1f-2222-4d3e-9f10-000000000001"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let state: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(state["handoff"]["phase"]["value"], "requested");
}
