use crate::common::*;

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

/// One of the daemon's threads as /proc shows it.
#[derive(Debug)]
struct Thread {
    name: String,
    nice: i32,
    /// Scheduling policy: 0 normal, 5 idle.
    policy: i32,
}

fn threads_of(pid: u32) -> Vec<Thread> {
    use handoff_bridge::background::{niceness_in_stat, policy_in_stat};
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("/proc task list");
    tasks
        .filter_map(|t| {
            let path = t.ok()?.path();
            let name = std::fs::read_to_string(path.join("comm")).ok()?;
            let stat = std::fs::read_to_string(path.join("stat")).ok()?;
            Some(Thread {
                name: name.trim().to_owned(),
                nice: niceness_in_stat(&stat)?,
                policy: policy_in_stat(&stat)?,
            })
        })
        .collect()
}

/// The threads whose name starts with `prefix`; panics if there is none.
fn named<'a>(threads: &'a [Thread], prefix: &str) -> Vec<&'a Thread> {
    let found: Vec<&Thread> = threads
        .iter()
        .filter(|t| t.name.starts_with(prefix))
        .collect();
    assert!(!found.is_empty(), "no {prefix} thread in {threads:?}");
    found
}

/// A daemon that has folded one delivery, so the fold threads have run a job and sled has
/// written its log.
fn spawn_folded(data: &std::path::Path, env: &[(&str, &str)]) -> TestApp {
    let app = TestApp::spawn_in(data, Spawn::with_env(env));
    let (status, receipt) = app.post(&fixture_bytes("agent-call-requested.json"));
    assert_eq!(status, 200, "{receipt}");
    wait_drained(&app);
    app
}

/// The acknowledgment path and the indexing that hands events to the fold keep the daemon's own
/// priority.
const NORMAL_THREADS: [&str; 4] = ["store-writer", "store-syncer", "store-indexer", "actix-rt"];

/// The test's own (policy, nice value): what the daemon's threads start with.
fn own_scheduling() -> (i32, i32) {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("own stat");
    let policy = handoff_bridge::background::policy_in_stat(&stat).expect("own policy");
    let nice = handoff_bridge::background::niceness_in_stat(&stat).expect("own nice value");
    (policy, nice)
}

/// Fold threads and sled's (I/O, log flusher) under `SCHED_IDLE`, the rest as the daemon started.
fn assert_idle_background(app: &TestApp) {
    let own = own_scheduling();
    let idle = handoff_bridge::background::SCHED_IDLE_POLICY;
    assert_ne!(own.0, idle, "the test must not itself run under SCHED_IDLE");
    let threads = threads_of(app.pid());
    for background in ["fold-", "sled-io", "log flusher"] {
        for t in named(&threads, background) {
            assert_eq!(t.policy, idle, "{t:?} in {threads:?}");
        }
    }
    for normal in NORMAL_THREADS {
        for t in named(&threads, normal) {
            assert_eq!((t.policy, t.nice), own, "{t:?}");
        }
    }
}

#[test]
fn folds_and_sleds_io_threads_run_under_sched_idle_by_default_and_intake_does_not() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let app = spawn_folded(&data, &[]);
    assert_idle_background(&app);
    // On a store that exists, sled starts its threads while it recovers: the same.
    assert!(app.terminate().success());
    let app = spawn_folded(&data, &[]);
    assert_idle_background(&app);
}

#[test]
fn folds_and_sleds_io_threads_run_at_the_fold_nice_value_when_asked() {
    let own = own_scheduling();
    let want = (own.1 + 7).min(19);
    assert_ne!(want, own.1, "the test must run below nice 19");
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = spawn_folded(
        &tmp.path().join("data"),
        &[
            ("HANDOFF_BRIDGE__DISPATCH__FOLD_PRIORITY", "nice"),
            ("HANDOFF_BRIDGE__DISPATCH__FOLD_NICENESS", &want.to_string()),
        ],
    );
    let threads = threads_of(app.pid());
    for background in ["fold-", "sled-io"] {
        for t in named(&threads, background) {
            assert_eq!((t.policy, t.nice), (own.0, want), "{t:?} in {threads:?}");
        }
    }
    for normal in NORMAL_THREADS {
        for t in named(&threads, normal) {
            assert_eq!((t.policy, t.nice), own, "{t:?}");
        }
    }
}

/// The allocator's options are built in by `.cargo/config.toml`; a build that missed them (cargo
/// run from outside the repository) would keep a burst's memory. Their visible sign: jemalloc's
/// purging threads.
#[test]
fn the_allocator_purges_from_its_own_threads() {
    let app = TestApp::spawn();
    let threads = threads_of(app.pid());
    let purgers = named(&threads, "jemalloc_bg_thd");
    assert!(!purgers.is_empty(), "jemalloc's purging threads run");
}
