//! A host whose other programs keep every CPU busy: the fold runs under `SCHED_IDLE` by default
//! and would get almost no CPU there (and hold the fold lock meanwhile). The dispatcher lifts a
//! fold that waits past `dispatch.lift_after` (or, without the privilege to, runs it at nice
//! 19), so handoffs are still decided within seconds.

mod common;
use common::*;
use serde_json::json;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

const CONVS: [&str; 2] = [
    "5c0e9b1f-2222-4d3e-9f10-000000000001",
    "5c0e9b1f-2222-4d3e-9f10-000000000002",
];

/// Busy loops, one per CPU: each ends on its own after two minutes (bash's `SECONDS`, no child
/// process) and is killed by its PID when the test ends.
struct Hogs(Vec<Child>);

impl Drop for Hogs {
    fn drop(&mut self) {
        for hog in &mut self.0 {
            let _ = hog.kill();
            let _ = hog.wait();
        }
    }
}

fn hogs() -> Hogs {
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    Hogs(
        (0..cpus.max(2))
            .map(|_| {
                Command::new("bash")
                    .args(["-c", "while [ $SECONDS -lt 120 ]; do :; done"])
                    .spawn()
                    .expect("a busy loop")
            })
            .collect(),
    )
}

fn phase(app: &TestApp, conv: &str) -> serde_json::Value {
    let (_, state) = app.admin_get(&format!("/admin/v1/conversations/{conv}"));
    state["handoff"]["phase"]["value"].clone()
}

#[test]
fn handoffs_are_decided_within_seconds_while_other_programs_keep_every_cpu_busy() {
    let app = TestApp::spawn();
    let _hogs = hogs();
    let mut took = Vec::new();
    for round in 0..4 {
        let conv = CONVS[round % 2];
        let asked = Instant::now();
        app.emulator_act(conv, "request-agent", json!({}));
        poll_until("the handoff decided", Duration::from_secs(60), || {
            (phase(&app, conv) == "requested").then_some(())
        });
        took.push(asked.elapsed());
        // Back to the bot for the next round, and everything it decided carried out.
        app.emulator_act(conv, "agent-end", json!({}));
        app.settle_within(Duration::from_secs(60));
        assert_ne!(phase(&app, conv), "requested");
    }
    eprintln!(
        "handoffs decided after {took:?}; fold lifts: {}",
        app.metric("handoff_fold_lifts_total")
    );
    // A fold takes milliseconds; under SCHED_IDLE alone it took up to 16 s here (4 busy loops
    // on 2 cores). Lifted, it is the time for intake and one fold to get their share of a CPU.
    for (round, t) in took.iter().enumerate() {
        assert!(
            *t < Duration::from_secs(10),
            "handoff {round} decided after {t:?}"
        );
    }
}
