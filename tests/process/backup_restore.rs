//! `handoff-bridge backup` / `restore`: a daemon filled with the shared fixtures (the shipped
//! rules acting on them) is stopped, backed up and restored into a new directory; a daemon there
//! shows the same state, ledger and quarantine, answers re-sent deliveries and events as
//! duplicates, and carries out nothing again. Also the refusals: beside a running daemon, into a
//! non-empty directory, from a damaged backup.

use crate::common::*;
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

const CONV1: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
const CONV2: &str = "5c0e9b1f-2222-4d3e-9f10-000000000002";

/// The shipped rules on (the default rule directory), so the fixtures decide and run actions.
fn spawn(dir: &Path) -> TestApp {
    TestApp::spawn_in(
        dir,
        Spawn {
            env: vec![("HANDOFF_BRIDGE__RULES__ENABLED".into(), "true".into())],
            ..Spawn::default()
        },
    )
}

/// What must survive a backup: conversation state, the action ledger, dead letters, quarantine.
fn views(app: &TestApp) -> Vec<String> {
    let list = app.cli_ok(&["quarantine", "list"]);
    let ids: Vec<u64> = serde_json::from_str::<Value>(&list)
        .expect("quarantine list JSON")
        .as_array()
        .expect("an array")
        .iter()
        .filter_map(|r| r["id"].as_u64())
        .collect();
    let mut views = vec![
        app.cli_ok(&["state", "show", CONV1]),
        app.cli_ok(&["state", "show", CONV2]),
        app.cli_ok(&["outbox", "done", "--all"]),
        app.cli_ok(&["outbox", "list"]),
        app.cli_ok(&["dlq", "list"]),
        list,
    ];
    // The list holds no bodies: each record, with its body.
    for id in ids {
        views.push(app.cli_ok(&["quarantine", "show", &id.to_string()]));
    }
    views
}

fn events_of(body: &[u8]) -> Vec<Value> {
    let v: Value = serde_json::from_slice(body).expect("fixture JSON");
    v["messages"].as_array().expect("messages").clone()
}

#[test]
fn a_restored_backup_has_the_same_state_and_knows_every_event() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let source = tmp.path().join("source");
    let app = spawn(&source);
    for (name, body) in fixtures() {
        let (status, receipt) = app.post(&body);
        assert_eq!(status, 200, "{name}: {receipt}");
    }
    let (status, receipt) = app.post(b"{not json");
    assert_eq!(
        (status, &receipt["status"]),
        (200, &Value::from("quarantined"))
    );
    app.settle();
    let decided = app.journal().iter().filter(|e| took_effect(e)).count();
    assert!(
        decided > 0,
        "the shipped rules made no call on the fixtures"
    );
    let before = views(&app);
    assert!(before[5].contains("invalid_json"), "{}", before[5]);

    // Refused while the daemon runs, and nothing is written.
    let out_dir = tmp.path().join("backup");
    let running = cli(
        &source,
        &["backup", "--out", out_dir.to_str().expect("utf-8")],
    );
    assert_eq!(running.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&running.stderr);
    assert!(stderr.contains("stop it first"), "{stderr}");
    assert!(!out_dir.exists());

    assert!(app.terminate().success());
    // A generated secret in the data directory travels with the backup.
    std::fs::write(source.join("webhook_token"), "generated-token-0123456789").expect("write");
    let printed = cli_ok(
        &source,
        &["backup", "--out", out_dir.to_str().expect("utf-8")],
    );
    assert!(printed.contains("backed up"), "{printed}");
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("manifest.json")).expect("manifest"))
            .expect("manifest JSON");
    assert_eq!(manifest["format"], 1);
    let files = manifest["files"].as_array().expect("files");
    assert!(files.iter().any(|f| f["path"] == "sled.dump"), "{manifest}");
    assert!(
        files
            .iter()
            .any(|f| f["path"].as_str().is_some_and(|p| p.starts_with("events/"))),
        "{manifest}"
    );

    // Restore into a new directory and start a daemon there.
    let restored = tmp.path().join("restored");
    cli_ok(
        &restored,
        &["restore", "--from", out_dir.to_str().expect("utf-8")],
    );
    let token = restored.join("webhook_token");
    assert_eq!(
        std::fs::read_to_string(&token).expect("token"),
        "generated-token-0123456789"
    );
    let mode = std::fs::metadata(&token)
        .expect("meta")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);

    let again = spawn(&restored);
    again.settle();
    assert_eq!(
        views(&again),
        before,
        "the restored daemon shows other state"
    );
    // Nothing decided before is carried out again (the new embedded emulator saw no write).
    let repeated: Vec<Value> = again
        .journal()
        .into_iter()
        .filter(|e| e["method"] != "GET")
        .collect();
    assert!(repeated.is_empty(), "carried out again: {repeated:?}");

    // Every delivery and every event is known: re-sent as they were, and under new delivery ids.
    for (name, body) in fixtures() {
        let (status, receipt) = again.post(&body);
        assert_eq!(status, 200, "{name}: {receipt}");
        assert_eq!(receipt["status"], "duplicate", "{name}: {receipt}");
        let events = events_of(&body);
        let fresh = delivery(&format!("resent-{name}"), &events);
        let (status, receipt) = again.post(&fresh);
        assert_eq!(status, 200, "{name}: {receipt}");
        assert_eq!(receipt["accepted"], 0, "{name}: {receipt}");
        assert_eq!(receipt["duplicates"], events.len(), "{name}: {receipt}");
    }
    again.settle();
    assert_eq!(
        views(&again),
        before,
        "duplicates changed the restored state"
    );

    // A restore over a daemon's directory is refused, and so is one into a non-empty directory.
    let over_running = cli(
        &restored,
        &[
            "restore",
            "--from",
            out_dir.to_str().expect("utf-8"),
            "--force",
        ],
    );
    assert_eq!(over_running.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&over_running.stderr);
    assert!(stderr.contains("stop it first"), "{stderr}");
    assert!(again.terminate().success());
    let not_empty = cli(
        &restored,
        &["restore", "--from", out_dir.to_str().expect("utf-8")],
    );
    assert_eq!(not_empty.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&not_empty.stderr);
    assert!(stderr.contains("not empty"), "{stderr}");

    // With --force over the stopped directory the store is swapped whole: no staging or old
    // store is left beside it, and the daemon shows the backup's state.
    cli_ok(
        &restored,
        &[
            "restore",
            "--from",
            out_dir.to_str().expect("utf-8"),
            "--force",
        ],
    );
    for leftover in ["store.restoring", "store.old", "webhook_token.restoring"] {
        assert!(!restored.join(leftover).exists(), "{leftover} left behind");
    }
    let forced = spawn(&restored);
    forced.settle();
    assert_eq!(views(&forced), before, "a forced restore shows other state");
    assert!(forced.terminate().success());
}

#[test]
fn a_damaged_backup_is_refused_before_anything_is_written() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let source = tmp.path().join("source");
    let app = TestApp::spawn_in(&source, Spawn::default());
    let (status, receipt) = app.post(&fixture_bytes("message-received-text.json"));
    assert_eq!(status, 200, "{receipt}");
    wait_drained(&app);
    assert!(app.terminate().success());
    let out_dir = tmp.path().join("backup");
    cli_ok(
        &source,
        &["backup", "--out", out_dir.to_str().expect("utf-8")],
    );

    // A second backup into the same directory would mix two: refused.
    let twice = cli(
        &source,
        &["backup", "--out", out_dir.to_str().expect("utf-8")],
    );
    assert_eq!(twice.status.code(), Some(1));

    let dump = out_dir.join("sled.dump");
    let mut bytes = std::fs::read(&dump).expect("dump");
    let last = bytes.len() - 2;
    bytes[last] ^= 0xff;
    std::fs::write(&dump, bytes).expect("write");
    let target = tmp.path().join("restored");
    let refused = cli(
        &target,
        &["restore", "--from", out_dir.to_str().expect("utf-8")],
    );
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("sled.dump does not match"), "{stderr}");
    assert!(!target.join("store").exists());
}
