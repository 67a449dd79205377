//! kill -9 while a load of deliveries is in flight, restart on the same data directory: every
//! delivery answered 200 is present and processed exactly once. Repeated over several cycles with
//! the ledger accumulating (10 by default, 100 with `HANDOFF_BRIDGE_LONG_TESTS=1`); every second
//! restart is itself killed right away, during inbox recovery. Each cycle looks up that cycle's
//! acknowledged events one by one and every conversation's count; the last daemon looks up the
//! whole ledger again. Part of the fault suite (docs/fault-suite.md).

use crate::common::load::{long_tests, seed_from_env_or_clock, Generator, Ledger, LoadPlan, Rng};
use crate::common::*;
use std::time::{Duration, Instant};

const CONVERSATIONS: usize = 50;
const CLIENTS: usize = 16;

#[test]
fn kill_9_under_load_loses_no_acknowledged_delivery_and_repeats_none() {
    let cycles = if long_tests() { 100 } else { 10 };
    let seed = seed_from_env_or_clock();
    eprintln!("seed {seed} (set HANDOFF_BRIDGE_TEST_SEED to replay the delivery shapes)");
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("data");
    let gen = Generator::new(CONVERSATIONS, seed);
    let mut rng = Rng::new(seed);
    let mut ledger = Ledger::new(CONVERSATIONS);
    let started = Instant::now();

    let mut app = TestApp::spawn_in(&dir, Spawn::default());
    for cycle in 1..=cycles {
        let plan = LoadPlan {
            threads: CLIENTS,
            // Vary the kill point so it lands at different moments of the flush cycle. Debug
            // builds are several times slower: less load keeps the default run short.
            trigger_after_acks: if cfg!(debug_assertions) {
                100 + rng.below(400)
            } else {
                300 + rng.below(1500)
            },
            trigger_timeout: Duration::from_secs(60),
            seed: rng.next_u64(),
        };
        let url = app.webhook_url.clone();
        let killed_pid = app.pid();
        let (report, ()) = crate::common::load::run_load(&url, &gen, &plan, move || app.kill9());
        assert!(
            report.anomalies.is_empty(),
            "cycle {cycle}: unexpected answers before the kill: {:#?}",
            &report.anomalies[..report.anomalies.len().min(10)]
        );
        assert!(
            report.acked.len() >= plan.trigger_after_acks,
            "cycle {cycle}: trigger fired early"
        );
        assert!(
            report.in_flight_at_action > 0,
            "cycle {cycle}: no request was in flight when the daemon was killed"
        );
        assert_eq!(
            report.unacked.len(),
            report.transport_errors_after_action + report.refused_after_action,
            "cycle {cycle}: every unacknowledged delivery failed after the kill"
        );

        if cycle == cycles {
            // After a crash daemon.json is stale: the CLI must notice and read the store offline.
            let info: serde_json::Value = serde_json::from_slice(
                &std::fs::read(dir.join("daemon.json"))
                    .expect("daemon.json left by the killed daemon"),
            )
            .expect("daemon.json");
            assert_eq!(
                info["pid"], killed_pid,
                "daemon.json names the killed daemon"
            );
            let conv = &gen.conversations[0];
            let out = cli(&dir, &["state", "show", conv]);
            assert!(
                out.status.success(),
                "CLI with a stale daemon.json: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let state: serde_json::Value = serde_json::from_slice(&out.stdout).expect("state json");
            assert_eq!(state["id"], conv.as_str());
            let upper: usize = ledger
                .acked
                .iter()
                .chain(&report.acked)
                .chain(&report.unacked)
                .flat_map(|d| &d.events)
                .filter(|e| e.conversation == 0)
                .count();
            let applied = state["events_applied"].as_u64().expect("events_applied");
            assert!(
                applied <= upper as u64,
                "offline state counts {applied} events, at most {upper} were sent"
            );
        }

        ledger.acked.extend(report.acked);
        let restarted = Instant::now();
        app = TestApp::spawn_in(&dir, Spawn::default());
        if cycle % 2 == 0 {
            // Crash again as soon as it listens, while it may still be folding the recovered
            // inbox: recovery itself must be crash-safe.
            app.kill9();
            app = TestApp::spawn_in(&dir, Spawn::default());
        }
        let summary = ledger.check_after_restart(&app, &gen, report.unacked);
        eprintln!(
            "cycle {cycle}: killed after {:?} with {} in flight; {} acknowledged events verified, \
             {} unacknowledged deliveries ({} stored, {} not); restart + checks {:?}",
            report.elapsed_before_action,
            report.in_flight_at_action,
            summary.acked_events,
            summary.unacked_deliveries,
            summary.unacked_stored,
            summary.unacked_lost,
            restarted.elapsed()
        );
    }
    let summary = ledger.verify_all(&app, &gen);
    eprintln!(
        "seed {seed}: {cycles} kill/restart cycles, {} deliveries ({} events) in the ledger, \
         each folded once; {:?}",
        ledger.acked.len(),
        summary.acked_events,
        started.elapsed()
    );
}
