//! `handoff-bridge emulator` as a standalone process and `handoff-bridge api` against it, with
//! the API key kept out of every output.

use crate::common::bin;
use crate::common::emulator::ExternalEmulator;
use std::process::Command;

const KEY: &str = "emulator-key-for-cli-tests-77";

fn start_emulator() -> ExternalEmulator {
    ExternalEmulator::start(KEY)
}

fn api(emu: &ExternalEmulator, key: &str, args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .arg("api")
        .args(args)
        .args(["--upstream", &emu.base])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HANDOFF_BRIDGE_UPSTREAM_API_KEY", key)
        .output()
        .expect("run api")
}

#[test]
fn api_lists_all_24_endpoints() {
    let out = Command::new(bin())
        .args(["api", "--list"])
        .output()
        .expect("run");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().count(), 24, "{text}");
    assert!(text.contains("pb-remove-session") && text.contains("DELETE"));
}

#[test]
fn api_calls_the_standalone_emulator_and_changes_its_state() {
    let emu = start_emulator();
    let out = api(&emu, KEY, &["get-bot", "B7f3a2c"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bot: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(bot["id"], "B7f3a2c");

    let conv = "5c0e9b1f-2222-4d3e-9f10-000000000001";
    let out = api(
        &emu,
        KEY,
        &[
            "set-manual",
            conv,
            "--body",
            r#"{"enabled":true}"#,
            "--idempotency-key",
            "cli-1",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = api(&emu, KEY, &["get-manual", conv]);
    let manual: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(manual["enabled"], true);
    assert_eq!(manual["status"], "HANDOVER");

    let out = api(
        &emu,
        KEY,
        &[
            "list-messages",
            "--query",
            &format!("conversationId={conv}"),
            "--query",
            "limit=2",
        ],
    );
    let page: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(page["paging"]["limit"], 2);
}

#[test]
fn api_errors_are_clear_and_never_show_the_key() {
    let emu = start_emulator();
    let out = api(&emu, "a-wrong-key-123456789", &["get-bot", "B7f3a2c"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("401"), "{err}");
    let out = api(&emu, KEY, &["get-conversation", "no-such-conversation"]);
    assert_eq!(out.status.code(), Some(1));
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(all.contains("404") && all.contains("not_found"), "{all}");
    assert!(!all.contains(KEY));
    let out = api(&emu, KEY, &["no-such-endpoint"]);
    assert_eq!(out.status.code(), Some(2));
    let out = api(&emu, KEY, &["pb-block", "only-one-param"]);
    assert_eq!(out.status.code(), Some(2), "wrong arity is a usage error");

    // The emulator's journal records calls without the key.
    let journal = crate::common::agent()
        .get(format!("{}/_emulator/journal", emu.base))
        .call()
        .expect("journal")
        .body_mut()
        .read_to_string()
        .expect("body");
    assert!(journal.contains("/openapi/bot/B7f3a2c"));
    assert!(!journal.contains(KEY));
}
