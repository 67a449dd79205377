//! What the kernel is asked, seen by `strace`: a quarantined delivery is answered 200 only after
//! what sled wrote for it was synced with `fdatasync`. sled 0.34's own flush stops at
//! `sync_file_range`, which neither commits the file's size and blocks nor flushes the disk's
//! write cache, so a power loss could take a quarantine record the service was told is kept
//! (`store::durable`).

use crate::common::*;
use std::collections::HashMap;
use std::time::Duration;

/// Stops the traced daemon by its PID (from `daemon.json`) when dropped, so strace, which
/// started it, ends with it.
struct Daemon(nix::unistd::Pid);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGTERM);
    }
}

/// One traced call: its name, its text (arguments, with `-y` paths), and whether it returned
/// success (`= 0` or a count).
#[derive(Debug)]
struct Call {
    name: String,
    text: String,
    ok: bool,
}

/// The trace's calls in the order they happened: a call split by another thread (`<unfinished
/// ...>`, `<... name resumed>`) is put where it returned, with the text of its start, except that
/// writes are put where they started (their bytes are on their way from then).
fn calls(trace: &str) -> Vec<Call> {
    let mut pending: HashMap<String, String> = HashMap::new();
    let mut out = Vec::new();
    for line in trace.lines() {
        // `PID TIME CALL`, the PID padded with spaces to a width.
        let Some((pid, after)) = line.trim_start().split_once(' ') else {
            continue;
        };
        let Some((_time, rest)) = after.trim_start().split_once(' ') else {
            continue;
        };
        let name = |text: &str| text.split('(').next().unwrap_or("").to_owned();
        if let Some(start) = rest.strip_suffix(" <unfinished ...>") {
            if name(start).starts_with("write") || name(start).starts_with("send") {
                out.push(Call {
                    name: name(start),
                    text: start.to_owned(),
                    ok: true,
                });
            } else {
                pending.insert(pid.to_owned(), start.to_owned());
            }
        } else if rest.starts_with("<... ") {
            if let Some(start) = pending.remove(pid) {
                out.push(Call {
                    name: name(&start),
                    ok: !rest.contains("= -1"),
                    text: start,
                });
            }
        } else {
            out.push(Call {
                name: name(rest),
                ok: !rest.contains("= -1"),
                text: rest.to_owned(),
            });
        }
    }
    out
}

#[test]
fn a_quarantined_delivery_is_answered_only_after_sleds_file_is_fdatasynced() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let trace_path = tmp.path().join("trace");
    let trace_arg = trace_path.to_str().expect("utf-8 path");
    let strace = [
        "strace",
        "-f",
        "-qq",
        "-ttt",
        "-y",
        "-s",
        "400",
        "-e",
        "trace=pwrite64,sync_file_range,fdatasync,write,writev,sendto,sendmsg",
        "-o",
        trace_arg,
        "--",
    ];
    let app = TestApp::spawn_under(&strace, &tmp.path().join("data"), Spawn::default());
    let info: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(app.data_dir.join("daemon.json")).expect("daemon.json"),
    )
    .expect("daemon.json is JSON");
    let pid = info["pid"].as_i64().expect("pid") as i32;
    let daemon = Daemon(nix::unistd::Pid::from_raw(pid));
    app.settle_within(Duration::from_secs(30));
    let start = std::fs::metadata(&trace_path).expect("trace").len() as usize;

    let (status, body) = app.post(b"{\"id\": \"d1\", \"messages\": [tr");
    assert_eq!(status, 200);
    assert_eq!(body["status"], "quarantined", "{body}");

    // Stop the daemon, so strace has written every line and exits.
    drop(daemon);
    let mut strace_process = app;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while strace_process.child().try_wait().expect("wait").is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "strace did not end with the daemon"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let trace = std::fs::read_to_string(&trace_path).expect("trace");
    let calls = calls(&trace[start..]);

    let answer = calls
        .iter()
        .position(|c| c.text.contains("HTTP/1.1 200") && c.text.contains("quarantined"))
        .unwrap_or_else(|| panic!("the 200 is in the trace:\n{}", &trace[start..]));
    let on_sled_file =
        |c: &Call, name: &str| c.name == name && c.ok && c.text.contains("/store/db>");
    // Nothing was written since the daemon settled: sled's first write after the POST is the
    // quarantine record's (only `Store::flush` calls `fdatasync` on sled's file; sled's own
    // background flusher calls `fsync`, every 500 ms).
    let wrote = calls[..answer]
        .iter()
        .position(|c| on_sled_file(c, "pwrite64"))
        .unwrap_or_else(|| {
            panic!(
                "sled wrote the quarantine record to its file before the answer:\n{}",
                &trace[start..]
            )
        });
    let between = &calls[wrote..answer];
    assert!(
        between.iter().any(|c| on_sled_file(c, "sync_file_range")),
        "sled's own flush: {between:#?}"
    );
    assert!(
        between.iter().any(|c| on_sled_file(c, "fdatasync")),
        "sled's file synced after the record's write and before the 200: {between:#?}"
    );
}
