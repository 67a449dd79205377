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

/// Each of the daemon's threads: (name, nice value), read from /proc.
fn thread_niceness(pid: u32) -> Vec<(String, i32)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("/proc task list");
    tasks
        .filter_map(|t| {
            let path = t.ok()?.path();
            let name = std::fs::read_to_string(path.join("comm")).ok()?;
            let stat = std::fs::read_to_string(path.join("stat")).ok()?;
            let nice = handoff_bridge::background::niceness_in_stat(&stat)?;
            Some((name.trim().to_owned(), nice))
        })
        .collect()
}

/// The allocator's options are built in by `.cargo/config.toml`; a build that missed them (cargo
/// run from outside the repository) would keep a burst's memory. Their visible sign: jemalloc's
/// purging threads.
#[test]
fn the_allocator_purges_from_its_own_threads() {
    let app = TestApp::spawn();
    let threads = thread_niceness(app.child.id());
    assert!(
        threads.iter().any(|(name, _)| name == "jemalloc_bg_thd"),
        "no jemalloc background thread in {threads:?}"
    );
}

#[test]
fn folds_run_at_the_fold_nice_value_and_intake_at_the_daemons_own() {
    let base = handoff_bridge::background::this_thread_niceness().expect("own nice value");
    let want = (base + 7).min(19);
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn::with_env(&[("HANDOFF_BRIDGE__DISPATCH__FOLD_NICENESS", &want.to_string())]),
    );
    // Folded, so the fold threads have run a job and sled has started its I/O threads.
    let (status, receipt) = app.post(&fixture_bytes("agent-call-requested.json"));
    assert_eq!(status, 200, "{receipt}");
    wait_drained(&app);
    let threads = thread_niceness(app.child.id());
    let nice_of = |prefix: &str| -> Vec<i32> {
        threads
            .iter()
            .filter(|(name, _)| name.starts_with(prefix))
            .map(|(_, n)| *n)
            .collect()
    };
    let folds = nice_of("fold-");
    assert!(!folds.is_empty(), "no fold thread in {threads:?}");
    assert!(
        folds.iter().all(|&n| n == want),
        "folds: {folds:?}, want {want}"
    );
    // The acknowledgment path, and the indexing that hands events to the fold, keep the daemon's
    // own priority.
    for intake in [
        "store-writer",
        "store-syncer",
        "store-indexer",
        "sled-io",
        "actix-rt",
    ] {
        let found = nice_of(intake);
        assert!(!found.is_empty(), "no {intake} thread in {threads:?}");
        assert!(
            found.iter().all(|&n| n == base),
            "{intake}: {found:?}, want {base}"
        );
    }
}
