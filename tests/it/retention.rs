//! Retention with the real daemon and the test clock: conversations (each with its end user) come
//! and go over simulated weeks; each cycle's pruning pass (`POST /admin/v1/prune`) removes the
//! states and quarantine records past `store.state_retention` / `store.quarantine_retention`, so
//! the record counts stay flat. A late event for a pruned conversation starts a fresh state.
//!
//! Quick by default (5 cycles of 40 conversations). `HANDOFF_BRIDGE_LONG_TESTS=1`: 60 cycles of
//! 500, and the daemon's resident memory and the sled files' size (the event log is left out: it
//! keeps events by real time, which the test clock does not move) must not grow past a bound
//! after the first cycles.

use crate::common::load::long_tests;
use crate::common::*;
use serde_json::{json, Value};

/// Both retentions; cycles are `STEP` apart, so a cycle's states are past retention two cycles on.
const RETENTION: &str = "7d";
const STEP: &str = "4d";

fn id(kind: u16, cycle: u64, n: u64) -> String {
    format!("{cycle:08x}-{kind:04x}-4000-8000-{n:012x}")
}

fn conversation(cycle: u64, n: u64) -> String {
    id(0xc0, cycle, n)
}

/// A conversation created for its own end user, and a user message in it.
fn events(cycle: u64, n: u64, ts: i64) -> [Value; 2] {
    let conv = conversation(cycle, n);
    let user = id(0xe0, cycle, n);
    [
        json!({
            "id": id(0xe1, cycle, n), "event": "bot.conversation.created",
            "sourceType": "bot", "sourceId": "B7f3a2c", "timestamp": ts,
            "data": {"conversation": {"id": conv, "botId": "B7f3a2c", "endUserId": user,
                "platform": "web", "userKey": format!("key-{user}"), "params": {}, "navigation": {}}}
        }),
        json!({
            "id": id(0xe2, cycle, n), "event": "bot.message.received",
            "sourceType": "bot", "sourceId": "B7f3a2c", "timestamp": ts,
            "data": {"message": {"id": id(0xa, cycle, n), "conversationId": conv,
                "endUserId": user, "isUser": true, "meta": null,
                "data": {"type": "text", "text": "hello"}}}
        }),
    ]
}

fn send_cycle(app: &TestApp, cycle: u64, conversations: u64, ts: i64) {
    let per_delivery = 100;
    for start in (0..conversations).step_by(per_delivery) {
        let batch: Vec<Value> = (start..conversations.min(start + per_delivery as u64))
            .flat_map(|n| events(cycle, n, ts))
            .collect();
        let (status, receipt) = app.post(&delivery(&id(0xd0, cycle, start), &batch));
        assert_eq!(status, 200, "{receipt}");
        assert_eq!(
            receipt["accepted"].as_u64(),
            Some(batch.len() as u64),
            "{receipt}"
        );
    }
    // One bad body per cycle: a quarantine record.
    let (status, receipt) = app.post(b"{ not json");
    assert_eq!(status, 200, "{receipt}");
    wait_drained(app);
}

fn gauge(app: &TestApp, kind: &str) -> f64 {
    app.metric(&format!("handoff_state_entries{{kind=\"{kind}\"}}"))
}

/// The sled files' size (the store directory without the event log), in bytes.
fn sled_bytes(data_dir: &std::path::Path) -> u64 {
    fn walk(dir: &std::path::Path, skip: &std::path::Path) -> u64 {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return 0;
        };
        entries
            .flatten()
            .map(|e| {
                let path = e.path();
                match e.metadata() {
                    Ok(m) if m.is_dir() && path != skip => walk(&path, skip),
                    Ok(m) if m.is_file() => m.len(),
                    _ => 0,
                }
            })
            .sum()
    }
    let store = data_dir.join("store");
    walk(&store, &store.join("events"))
}

#[test]
fn states_and_quarantine_records_past_retention_go_and_counts_stay_flat() {
    let long = long_tests();
    let (cycles, per_cycle) = if long { (60, 500) } else { (5, 40) };
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            // The long mode bounds the daemon's resident memory: a process of its own.
            own_process: long,
            ..Spawn::with_env(&[
                ("HANDOFF_BRIDGE__ADMIN__TEST_CLOCK", "true"),
                ("HANDOFF_BRIDGE__STORE__STATE_RETENTION", RETENTION),
                ("HANDOFF_BRIDGE__STORE__QUARANTINE_RETENTION", RETENTION),
                // Nothing but the test's events makes state: no backfill or sweeper passes.
                ("HANDOFF_BRIDGE__BACKFILL__INTERVAL", "off"),
                ("HANDOFF_BRIDGE__RECONCILE__INTERVAL", "off"),
            ])
        },
    );
    let data_dir = app.data_dir.clone();
    let mut now = app.advance_clock_unsettled("1s")["now"]
        .as_i64()
        .expect("now");
    let mut sizes = Vec::new();
    for cycle in 0..cycles {
        send_cycle(&app, cycle, per_cycle, now);
        now = app.advance_clock_unsettled(STEP)["now"]
            .as_i64()
            .expect("now");
        let (status, report) = app.admin_post("/admin/v1/prune");
        assert_eq!(status, 200, "{report}");
        // The previous cycle's states are 8 days old now, this cycle's 4: exactly the previous
        // cycle's go, with their end users and quarantine record.
        let gone = if cycle == 0 { 0 } else { per_cycle };
        assert_eq!(report["conversations"].as_u64(), Some(gone), "{report}");
        assert_eq!(report["end_users"].as_u64(), Some(gone), "{report}");
        assert_eq!(
            report["quarantine"].as_u64(),
            Some(u64::from(cycle > 0)),
            "{report}"
        );
        assert_eq!(report["states_skipped"].as_u64(), Some(0), "{report}");
        // Flat: one cycle's records, whatever the cycle.
        assert_eq!(gauge(&app, "conversations"), per_cycle as f64);
        assert_eq!(gauge(&app, "end_users"), per_cycle as f64);
        assert_eq!(app.metric("handoff_quarantine_entries"), 1.0);
        if cycle > 0 {
            let (status, _) = app.admin_get(&format!(
                "/admin/v1/conversations/{}",
                conversation(cycle - 1, 0)
            ));
            assert_eq!(status, 404, "the previous cycle's conversation is gone");
        }
        let (status, _) = app.admin_get(&format!(
            "/admin/v1/conversations/{}",
            conversation(cycle, 0)
        ));
        assert_eq!(status, 200, "this cycle's conversation is kept");
        if long {
            let figures = (proc_status_mb(app.pid(), "VmRSS:"), sled_bytes(&data_dir));
            eprintln!(
                "cycle {cycle}: RSS {:.1} MB, sled {:.1} MB",
                figures.0,
                figures.1 as f64 / 1e6
            );
            sizes.push(figures);
        }
    }
    assert_eq!(
        app.metric(r#"handoff_pruned_total{kind="conversations"}"#),
        ((cycles - 1) * per_cycle) as f64
    );

    // A late event for a pruned conversation (cycle 0's) starts a fresh state.
    let late = json!({
        "id": id(0xe3, 0, 0), "event": "bot.message.received",
        "sourceType": "bot", "sourceId": "B7f3a2c", "timestamp": now,
        "data": {"message": {"id": id(0xb, 0, 0), "conversationId": conversation(0, 0),
            "isUser": true, "meta": null, "data": {"type": "text", "text": "back"}}}
    });
    let (status, receipt) = app.post(&delivery(&id(0xd1, 0, 0), &[late]));
    assert_eq!(status, 200, "{receipt}");
    wait_drained(&app);
    let (status, state) = app.admin_get(&format!("/admin/v1/conversations/{}", conversation(0, 0)));
    assert_eq!(status, 200, "{state}");
    assert_eq!(state["events_applied"], 1, "{state}");
    assert_eq!(
        state["created_at"],
        Value::Null,
        "nothing from before: {state}"
    );
    assert_eq!(gauge(&app, "conversations"), (per_cycle + 1) as f64);

    if long {
        // After the first 10 cycles (sled's caches and files warmed up), neither memory nor the
        // sled files may keep growing: the last cycle within a bound of the largest early one.
        let early = &sizes[..10];
        let rss_bound = early.iter().map(|s| s.0).fold(0.0, f64::max) * 1.25 + 8.0;
        let sled_bound = early.iter().map(|s| s.1).max().unwrap_or(0) * 2 + (16 << 20);
        let (rss, sled) = sizes[sizes.len() - 1];
        assert!(
            rss <= rss_bound,
            "RSS grew: {rss:.1} MB > {rss_bound:.1} MB"
        );
        assert!(
            sled <= sled_bound,
            "sled files grew: {sled} > {sled_bound} bytes"
        );
    }
    app.terminate();
}
