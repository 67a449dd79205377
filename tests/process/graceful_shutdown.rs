//! Graceful shutdown under load loses nothing and exits 0: SIGTERM while clients post, the daemon
//! exits with status 0 within a bound, every delivery answered 200 is stored and processed
//! exactly once after a restart, nothing is answered 200 once it is gone, and `daemon.json`
//! lets the CLI read state offline while stopped and through the daemon after the restart.

use crate::common::load::{
    post_body, seed_from_env_or_clock, terminate_within, Generator, Ledger, LoadPlan, Rng,
};
use crate::common::*;
use serde_json::Value;
use std::time::Duration;

const CONVERSATIONS: usize = 50;
const CLIENTS: usize = 8;
/// The daemon must be gone this long after SIGTERM (its shutdown timeout is 15 s by default).
const EXIT_BOUND: Duration = Duration::from_secs(20);

fn daemon_json(dir: &std::path::Path) -> Option<Value> {
    let bytes = std::fs::read(dir.join("daemon.json")).ok()?;
    Some(serde_json::from_slice(&bytes).expect("daemon.json is JSON"))
}

#[test]
fn sigterm_under_load_exits_zero_and_loses_nothing() {
    let seed = seed_from_env_or_clock();
    eprintln!("seed {seed} (set HANDOFF_BRIDGE_TEST_SEED to replay the delivery shapes)");
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("data");
    let gen = Generator::new(CONVERSATIONS, seed);
    let mut rng = Rng::new(seed);
    let mut ledger = Ledger::new(CONVERSATIONS);

    let app = TestApp::spawn_in(&dir, Spawn::default());
    let info = daemon_json(&dir).expect("daemon.json written while running");
    assert_eq!(info["pid"], app.pid());
    let url = app.webhook_url.clone();
    // One delivery folded before the load: the offline read below must find its conversation.
    // (What the load posts may still wait in the log at exit, since the fold runs at a lower
    // priority than intake and a graceful stop does not wait for it; the restart folds it.)
    let agent = agent();
    let first = gen.delivery(&mut rng);
    let (status, body) = post_body(&agent, &url, &first.body).expect("first delivery");
    assert_eq!(status, 200, "first delivery: {body}");
    wait_drained(&app);
    let folded_conv = first.events[0].conversation;
    let folded_events = first
        .events
        .iter()
        .filter(|e| e.conversation == folded_conv)
        .count() as u64;
    ledger.acked.push(first);
    let plan = LoadPlan {
        threads: CLIENTS,
        trigger_after_acks: 500 + rng.below(1000),
        trigger_timeout: Duration::from_secs(60),
        seed: rng.next_u64(),
    };
    let (report, (status, took)) =
        crate::common::load::run_load(&url, &gen, &plan, move || terminate_within(app, EXIT_BOUND));
    eprintln!(
        "SIGTERM after {:?} and {} acknowledged deliveries, {} in flight; exit {status:?} after {took:?}; \
         after SIGTERM: {} answered 200, {} refused, {} transport errors",
        report.elapsed_before_action,
        plan.trigger_after_acks,
        report.in_flight_at_action,
        report.acked_after_action,
        report.refused_after_action,
        report.transport_errors_after_action
    );
    let status = status
        .unwrap_or_else(|| panic!("daemon still running {EXIT_BOUND:?} after SIGTERM (killed)"));
    assert!(
        status.success(),
        "graceful shutdown exit status: {status:?}"
    );
    assert!(took <= EXIT_BOUND, "shutdown took {took:?}");
    assert!(
        report.anomalies.is_empty(),
        "unexpected answers before SIGTERM: {:#?}",
        &report.anomalies[..report.anomalies.len().min(10)]
    );
    assert!(
        report.in_flight_at_action > 0,
        "no request was in flight at SIGTERM"
    );
    assert!(
        report.acked_after_action > 0,
        "no request in flight at SIGTERM was finished with a 200"
    );
    assert_eq!(
        report.unacked.len(),
        report.refused_after_action + report.transport_errors_after_action
    );

    // Gone: a request now is refused at transport level (or at least not answered 200).
    let mut late_rng = Rng::new(seed ^ 0x5eed);
    let mut late = Vec::new();
    for _ in 0..5 {
        let d = gen.delivery(&mut late_rng);
        match post_body(&agent, &url, &d.body) {
            Err(_) => {}
            Ok((status, body)) => {
                assert_ne!(status, 200, "answered 200 after the daemon exited: {body}")
            }
        }
        late.push(d);
    }

    // Clean exit removes daemon.json; the CLI then reads the store directly.
    assert!(
        daemon_json(&dir).is_none(),
        "daemon.json left behind by a clean exit"
    );
    let sent_for_conv = ledger
        .acked
        .iter()
        .chain(&report.acked)
        .chain(&report.unacked)
        .flat_map(|d| &d.events)
        .filter(|e| e.conversation == folded_conv)
        .count() as u64;
    let conv = gen.conversations[folded_conv].clone();
    let out = cli(&dir, &["state", "show", &conv]);
    assert!(
        out.status.success(),
        "offline state show: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let offline: Value = serde_json::from_slice(&out.stdout).expect("offline state json");
    assert_eq!(offline["id"], conv.as_str());
    let offline_applied = offline["events_applied"].as_u64().expect("events_applied");
    assert!(
        offline_applied >= folded_events && offline_applied <= sent_for_conv,
        "offline events_applied {offline_applied}: folded before the load {folded_events}, sent {sent_for_conv}"
    );

    // Restart: every acknowledged delivery is there exactly once; late ones count as unacknowledged.
    ledger.acked.extend(report.acked);
    let mut unacked = report.unacked;
    unacked.extend(late);
    let app = TestApp::spawn_in(&dir, Spawn::default());
    let info = daemon_json(&dir).expect("daemon.json after restart");
    assert_eq!(info["pid"], app.pid(), "daemon.json names the new daemon");
    assert_eq!(
        format!("http://{}", info["listen"].as_str().expect("listen")),
        app.base
    );
    assert_eq!(
        format!("http://{}", info["admin"].as_str().expect("admin")),
        app.admin_base,
        "daemon.json names the admin listener"
    );
    let summary = ledger.check_after_restart(&app, &gen, unacked);
    eprintln!("after restart: {summary:?}");
    // A graceful stop finishes every request it began processing; one it never read is not stored.
    // So no delivery may be stored without having been answered 200.
    assert_eq!(
        summary.unacked_stored, 0,
        "deliveries stored during shutdown but not answered 200"
    );

    // Online: the store is locked by the daemon, so this answer came through its admin API.
    let expected = ledger.counts()[folded_conv];
    let out = cli(&dir, &["state", "show", &conv]);
    assert!(
        out.status.success(),
        "online state show: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let online: Value = serde_json::from_slice(&out.stdout).expect("online state json");
    let (status, api) = app.admin_get(&format!("/admin/v1/conversations/{conv}"));
    assert_eq!(status, 200);
    assert_eq!(online, api, "CLI and admin API disagree");
    assert_eq!(online["events_applied"], expected);

    // An idle daemon also stops cleanly within the bound, and removes daemon.json again.
    let (status, took) = terminate_within(app, EXIT_BOUND);
    let status = status.expect("idle daemon did not exit after SIGTERM");
    assert!(status.success(), "idle shutdown exit status: {status:?}");
    assert!(
        daemon_json(&dir).is_none(),
        "daemon.json left behind by a clean exit"
    );
    eprintln!("idle shutdown took {took:?}");
}
