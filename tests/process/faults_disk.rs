//! Fault suite, disk trouble (docs/fault-suite.md):
//! - the data directory's filesystem fills up under load: intake answers 503 `store_unavailable`
//!   (never 200) while it is full; once space returns the same deliveries are accepted, each
//!   event folded once, and the store reopens sound;
//! - a store that cannot be opened (damaged sled files, an event log segment damaged in the
//!   middle, a data directory that is a file, one in use by a running daemon) refuses to start:
//!   non-zero exit, one line naming the path and the cause, the directory byte-for-byte as it
//!   was;
//! - a torn write at the end of the event log (what a crash leaves) is cut off, not refused.

use crate::common::load::{
    post_body, seed_from_env_or_clock, Generator, Ledger, Rng, SentDelivery,
};
use crate::common::tmpfs::Tmpfs;
use crate::common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const CONVERSATIONS: usize = 20;

/// A fresh delivery whose events each carry about 6 KB more than the page the event log may
/// have left, so storing it always needs new space.
fn padded(gen: &Generator, rng: &mut Rng) -> SentDelivery {
    let mut d = gen.delivery(rng);
    let mut body: Value = serde_json::from_slice(&d.body).expect("delivery");
    for event in body["messages"].as_array_mut().expect("messages") {
        event["padding"] = json!("fault-suite ".repeat(500));
    }
    d.body = serde_json::to_vec(&body).expect("encode");
    d
}

#[test]
fn a_full_disk_under_load_answers_503_never_200_and_the_same_deliveries_are_accepted_once_after() {
    const CLIENTS: usize = 6;
    const REFUSALS_PER_CLIENT: usize = 3;
    let seed = seed_from_env_or_clock();
    eprintln!("seed {seed} (set HANDOFF_BRIDGE_TEST_SEED to replay)");
    let tmp = tempfile::tempdir().expect("tempdir");
    // The store on a small filesystem of its own; the daemon's log beside it keeps working.
    let dir = tmp.path().join("data");
    let disk = Tmpfs::mount(&dir.join("store"), 64);
    let app = TestApp::spawn_in(&dir, Spawn::default());
    let gen = Generator::new(CONVERSATIONS, seed);
    let mut ledger = Ledger::new(CONVERSATIONS);

    // Clients post fresh deliveries; once 60 were acknowledged the disk fills, and every
    // delivery sent after that must be refused with 503 and the JSON error.
    let full = AtomicBool::new(false);
    let acks = AtomicUsize::new(0);
    let acked = Mutex::new(Vec::new());
    let refused = Mutex::new(Vec::new());
    let wrong = Mutex::new(Vec::new());
    let url = app.webhook_url.clone();
    let filler = std::thread::scope(|s| {
        for t in 0..CLIENTS {
            let (full, acks, acked, refused, wrong, url, gen) =
                (&full, &acks, &acked, &refused, &wrong, &url, &gen);
            s.spawn(move || {
                let agent = agent();
                let mut rng = Rng::new(seed ^ (t as u64 + 1));
                let mut refusals = 0;
                while refusals < REFUSALS_PER_CLIENT {
                    let d = padded(gen, &mut rng);
                    let after_fill = full.load(Ordering::SeqCst);
                    match post_body(&agent, url, &d.body) {
                        Ok((200, r)) if !after_fill && r["status"] == "accepted" => {
                            acks.fetch_add(1, Ordering::SeqCst);
                            acked.lock().expect("acked").push(d);
                        }
                        Ok((503, r)) if r["error"]["code"] == "store_unavailable" => {
                            refusals += usize::from(after_fill);
                            refused.lock().expect("refused").push(d);
                        }
                        Ok((status, r)) => {
                            wrong.lock().expect("wrong").push(format!(
                                "{status} {r} (sent after the disk filled: {after_fill})"
                            ));
                            return;
                        }
                        Err(e) => {
                            wrong.lock().expect("wrong").push(e);
                            return;
                        }
                    }
                }
            });
        }
        poll_until(
            "60 acknowledged deliveries",
            Duration::from_secs(60),
            || {
                (acks.load(Ordering::SeqCst) >= 60 || !wrong.lock().expect("wrong").is_empty())
                    .then_some(())
            },
        );
        let filler = disk.fill();
        full.store(true, Ordering::SeqCst);
        filler
    });
    let wrong = wrong.into_inner().expect("wrong");
    if !wrong.is_empty() {
        drop(filler);
        let mut app = app;
        let exited = app.child().try_wait();
        panic!(
            "unexpected answers: {wrong:#?}\ndaemon: {exited:?}\n{}",
            app.logs()
        );
    }
    let refused = refused.into_inner().expect("refused");
    ledger.acked.extend(acked.into_inner().expect("acked"));
    assert!(refused.len() >= CLIENTS * REFUSALS_PER_CLIENT);
    assert_eq!(
        app.metric("handoff_webhook_deliveries_total{outcome=\"unavailable\"}"),
        refused.len() as f64,
        "every refusal is counted"
    );
    // Space comes back. sled 0.34 keeps a write error it hit while the disk was full (it fails
    // every later call), so the daemon may exit (status 75) for a restart to reopen the store,
    // as its supervisor would; either way the service's retries of the refused deliveries are
    // accepted and every event is folded once.
    drop(filler);
    let mut app = app;
    let mut restarts = 0;
    for d in &refused {
        let mut lost_answer = false;
        let receipt =
            poll_until(
                "the retry to be accepted",
                Duration::from_secs(60),
                || match post_body(&app.agent, &app.webhook_url, &d.body) {
                    Ok((200, r)) => Some(r),
                    Ok((503, r)) if r["error"]["code"] == "store_unavailable" => None,
                    Ok((status, r)) => panic!("retry answered {status} {r}"),
                    Err(_) => {
                        lost_answer = true;
                        if let Ok(Some(status)) = app.child().try_wait() {
                            assert_eq!(status.code(), Some(75), "{}", app.logs());
                            assert!(app.logs().contains("exiting so a restart reopens it"));
                            restarts += 1;
                            app = TestApp::spawn_in(&dir, Spawn::default());
                        }
                        None
                    }
                },
            );
        let n = d.events.len() as u64;
        let ok = (receipt["status"] == "accepted" && receipt["accepted"] == n)
            // The daemon exited after storing it, before answering.
            || (lost_answer && receipt["status"] == "duplicate");
        assert!(ok, "retry of {}: {receipt}", d.id);
        ledger.acked.push(d.clone());
    }
    wait_drained(&app);
    ledger.assert_counts(&app, &gen, &ledger.counts(), "after space returned");
    for d in &refused {
        let (status, r) = post_body(&app.agent, &app.webhook_url, &d.body).expect("again");
        assert_eq!(
            (status, r["status"].as_str()),
            (200, Some("duplicate")),
            "{r}"
        );
    }

    // The store went through ENOSPC and reopens sound: every event found, nothing repeated.
    let status = app.terminate();
    assert!(status.success(), "{status}");
    let app = TestApp::spawn_in(&dir, Spawn::default());
    let summary = ledger.verify_all(&app, &gen);
    eprintln!(
        "seed {seed}: {} deliveries refused with 503 while full, then accepted once ({restarts} \
         restarts of a stuck store); {} events verified after a restart",
        refused.len(),
        summary.acked_events
    );
    drop(app);
    drop(disk);
}

// ---- Stores that must not open ----

/// A data directory with a few deliveries in it, its daemon stopped cleanly. Returns the
/// directory and the deliveries' events.
fn stopped_store(root: &Path) -> (PathBuf, Vec<String>) {
    let dir = root.join("data");
    let app = TestApp::spawn_in(&dir, Spawn::default());
    let gen = Generator::new(5, 7);
    let mut rng = Rng::new(7);
    let mut events = Vec::new();
    for _ in 0..40 {
        let d = gen.delivery(&mut rng);
        let (status, r) = app.post(&d.body);
        assert_eq!(
            (status, r["status"].as_str()),
            (200, Some("accepted")),
            "{r}"
        );
        events.extend(d.events.into_iter().map(|e| e.id));
    }
    wait_drained(&app);
    // The daemon's own log lives in the directory: gone with it, so only the store is left.
    let log = app.log_path().to_path_buf();
    assert!(app.terminate().success());
    std::fs::remove_file(log).expect("remove the daemon log");
    (dir, events)
}

/// Start on `dir` must fail: non-zero exit, a last line naming `path` and containing `cause`,
/// and `dir` exactly as before.
fn assert_refused(dir: &Path, path: &Path, cause: &str) -> String {
    let before = dir_digest(dir);
    let started = Instant::now();
    let (status, stderr) = serve_refused(dir, Duration::from_secs(30));
    assert!(!status.success(), "started anyway: {status}\n{stderr}");
    // The daemon's error line (an actix worker thread may log its own stop after it as the
    // process exits, so it need not be the last).
    let line = stderr
        .lines()
        .rev()
        .find(|l| l.starts_with("handoff-bridge: "))
        .unwrap_or_else(|| panic!("no error line: {stderr}"))
        .to_owned();
    assert!(
        line.contains(&path.display().to_string()),
        "names {}: {line}",
        path.display()
    );
    assert!(line.contains(cause), "says `{cause}`: {line}");
    assert_eq!(
        before,
        dir_digest(dir),
        "the refused directory changed ({line})"
    );
    eprintln!("refused in {:?}: {line}", started.elapsed());
    line
}

fn first_segment(dir: &Path) -> PathBuf {
    dir.join("store/events/00000000000000000001.log")
}

#[test]
fn an_event_log_segment_damaged_in_the_middle_is_refused_and_left_untouched() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (dir, _) = stopped_store(tmp.path());
    let segment = first_segment(&dir);
    let len = std::fs::metadata(&segment).expect("segment").len();
    let mut bytes = std::fs::read(&segment).expect("read");
    let middle = (len / 2) as usize;
    bytes[middle..middle + 16].copy_from_slice(b"garbage!garbage!");
    std::fs::write(&segment, &bytes).expect("damage");
    assert_refused(&dir, &segment, "is corrupt at byte");
}

#[test]
fn damaged_sled_files_are_refused_and_left_untouched() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (dir, _) = stopped_store(tmp.path());
    let conf = dir.join("store/conf");
    let mut bytes = std::fs::read(&conf).expect("sled conf");
    for b in bytes.iter_mut().take(24) {
        *b ^= 0x5a;
    }
    std::fs::write(&conf, &bytes).expect("damage");
    assert_refused(&dir, &dir.join("store"), "cannot open the store");
}

#[test]
fn a_data_directory_that_is_a_file_is_refused_and_left_untouched() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("data");
    std::fs::write(&file, b"not a directory\n").expect("file");
    assert_refused(&file, &file, "is not a directory");
}

#[test]
fn a_data_directory_in_use_by_a_running_daemon_is_refused_and_left_untouched() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("data");
    let app = TestApp::spawn_in(&dir, Spawn::default());
    let (status, _) = app.post(&fixture_bytes("message-received-text.json"));
    assert_eq!(status, 200);
    wait_drained(&app);
    // Hold the running daemon still (it keeps its lock) so that only the second start could
    // change the directory.
    let pid = nix::unistd::Pid::from_raw(app.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    let line = std::panic::catch_unwind(|| {
        assert_refused(&dir, &dir.join("store"), "in use by another process")
    });
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).expect("SIGCONT");
    line.expect("refused");
    // The first daemon carries on.
    let (status, r) = app.post(&fixture_bytes("message-received-text.json"));
    assert_eq!(
        (status, r["status"].as_str()),
        (200, Some("duplicate")),
        "{r}"
    );
}

#[test]
fn a_torn_write_at_the_end_of_the_event_log_is_cut_off_and_the_store_opens() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (dir, events) = stopped_store(tmp.path());
    let segment = first_segment(&dir);
    let intact = std::fs::read(&segment).expect("read");
    // What a crash in the middle of an append leaves: the start of a frame (a header announcing
    // 4000 bytes, then only some of them).
    let mut torn = intact.clone();
    torn.extend_from_slice(&4000u32.to_le_bytes());
    torn.extend_from_slice(&0x1234_5678u32.to_le_bytes());
    torn.extend_from_slice(br#"{"d":"cut-short-delivery","t":1,"s":[99"#);
    std::fs::write(&segment, &torn).expect("tear");

    let app = TestApp::spawn_in(&dir, Spawn::default());
    wait_drained(&app);
    assert_eq!(
        std::fs::read(&segment).expect("read"),
        intact,
        "exactly the torn bytes were cut"
    );
    for id in &events {
        let (status, body) = app.admin_get(&format!("/admin/v1/events/{id}"));
        assert_eq!(status, 200, "event {id} after the cut: {body}");
        assert_eq!(body["pending"], false, "{body}");
    }
    // Appending carries on after the intact frames.
    let (status, r) = app.post(&fixture_bytes("message-received-text.json"));
    assert_eq!(
        (status, r["status"].as_str()),
        (200, Some("accepted")),
        "{r}"
    );
    let logs = app.logs();
    assert!(
        logs.contains("indexed the event log's tail") && logs.contains("torn_tail"),
        "the cut is logged: {logs}"
    );
}
