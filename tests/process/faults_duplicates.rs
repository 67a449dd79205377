//! Fault suite, duplicate storms (docs/fault-suite.md): the same deliveries, and the same events
//! under new delivery ids, re-sent many times by 16 concurrent clients while the daemon folds
//! and acts, then again once the fold drained, and again after a kill -9 and restart. A relay
//! rule decides two actions per user message, carried out against the embedded emulator. Each
//! event is accepted and folded once (receipts, `events_applied`, the conversations' message
//! counts), each decided action takes effect once (the emulator's journal), and every duplicate
//! is counted (`handoff_webhook_deliveries_total{outcome="duplicate"}`,
//! `handoff_webhook_duplicate_events_total`).
//!
//! Quick by default; `HANDOFF_BRIDGE_LONG_TESTS=1` sends 500 deliveries instead of 100.

use crate::common::load::{long_tests, post_body, seed_from_env_or_clock, Rng};
use crate::common::relay::*;
use crate::common::*;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::Instant;

const CLIENTS: usize = 16;

/// One storm: every client posts every delivery of `all` once, each in its own shuffled order.
/// Returns every answer as (index into `all`, status, receipt).
fn storm(url: &str, all: &[Sent], seed: u64) -> Vec<(usize, u16, Value)> {
    let answers = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..CLIENTS {
            let answers = &answers;
            s.spawn(move || {
                let agent = agent();
                let mut rng = Rng::new(seed ^ (t as u64 + 1).wrapping_mul(0x9E37_79B9));
                let mut order: Vec<usize> = (0..all.len()).collect();
                for i in (1..order.len()).rev() {
                    order.swap(i, rng.below(i + 1));
                }
                let mut mine = Vec::with_capacity(order.len());
                for i in order {
                    let (status, receipt) =
                        post_body(&agent, url, &all[i].body).unwrap_or_else(|e| panic!("{e}"));
                    mine.push((i, status, receipt));
                }
                answers.lock().expect("answers").extend(mine);
            });
        }
    });
    answers.into_inner().expect("answers")
}

/// Counters the daemon keeps about duplicates. (Accepted deliveries also count the emulator's
/// own webhooks about the relayed messages.)
#[derive(Debug, Clone, Copy, PartialEq)]
struct Counters {
    duplicate_deliveries: f64,
    duplicate_events: f64,
}

fn counters(app: &TestApp) -> Counters {
    Counters {
        duplicate_deliveries: app.metric("handoff_webhook_deliveries_total{outcome=\"duplicate\"}"),
        duplicate_events: app.metric("handoff_webhook_duplicate_events_total"),
    }
}

/// Every answer was 200; returns (deliveries answered `duplicate`, events accepted, events
/// answered as duplicates).
fn tally(answers: &[(usize, u16, Value)], all: &[Sent]) -> (usize, u64, u64) {
    let mut duplicate_deliveries = 0;
    let (mut accepted, mut duplicates) = (0, 0);
    for (i, status, r) in answers {
        assert_eq!(*status, 200, "delivery {i}: {r}");
        let (a, d) = (
            r["accepted"].as_u64().expect("accepted"),
            r["duplicates"].as_u64().expect("duplicates"),
        );
        assert_eq!(a + d, all[*i].events.len() as u64, "delivery {i}: {r}");
        if r["status"] == "duplicate" {
            duplicate_deliveries += 1;
            assert_eq!(a, 0, "{r}");
        }
        accepted += a;
        duplicates += d;
    }
    (duplicate_deliveries, accepted, duplicates)
}

/// Per seeded conversation: the user messages folded into its state.
fn user_messages(app: &TestApp) -> Vec<u64> {
    SEEDED
        .iter()
        .map(|(conv, _, _)| {
            let (status, state) = app.admin_get(&format!("/admin/v1/conversations/{conv}"));
            match status {
                200 => state["messages"]["user_messages"].as_u64().expect("count"),
                404 => 0,
                _ => panic!("conversation {conv}: {status} {state}"),
            }
        })
        .collect()
}

/// Effective journal entries per idempotency key.
fn effects_per_key(app: &TestApp) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for e in app.journal().iter().filter(|e| took_effect(e)) {
        if let Some(key) = e["idempotency_key"].as_str() {
            *out.entry(key.to_owned()).or_insert(0) += 1;
        }
    }
    out
}

#[test]
fn duplicate_storms_fold_each_event_once_and_act_once_across_drain_and_restart() {
    let deliveries = if long_tests() { 500 } else { 100 };
    let seed = seed_from_env_or_clock();
    eprintln!("seed {seed} (set HANDOFF_BRIDGE_TEST_SEED to replay)");
    let started = Instant::now();
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules_dir(
        tmp.path(),
        r#"
        [[rule]]
        name = "relay"
        on = ["bot.message.received"]
        max_firings = { count = 1000, per = "1m" }
        when = { field = "sender", equals = "user" }
        actions = [
            { type = "send_message", text = "relay {{ message.data.text }}" },
            { type = "update_params", params = { last_event = "{{ event.id }}" } },
        ]
        "#,
    );
    let dir = tmp.path().join("data");
    let spawn = Spawn {
        env: daemon_env(&rules, &[]),
        ..Spawn::default()
    };
    let mut app = TestApp::spawn_in(&dir, spawn.clone());

    // The deliveries, then the same events again under new delivery ids (a service that
    // re-batches its retries).
    let mut rng = Rng::new(seed);
    let mut ids = Ids::new(seed);
    let mut ts = 1_763_690_400_000i64;
    let mut sent: Vec<Sent> = Vec::new();
    let mut per_conversation = [0u64; SEEDED.len()];
    let mut events: Vec<(String, Value)> = Vec::new();
    for _ in 0..deliveries {
        let batch: Vec<(String, Value)> = (0..1 + rng.below(3))
            .map(|_| {
                ts += 1;
                let conv = rng.below(SEEDED.len());
                per_conversation[conv] += 1;
                user_message(&mut ids, conv, &format!("m{ts}"), ts)
            })
            .collect();
        events.extend(batch.iter().cloned());
        sent.push(make_delivery(&mut ids, batch));
    }
    let regrouped: Vec<Sent> = events
        .chunks(2)
        .map(|pair| make_delivery(&mut ids, pair.to_vec()))
        .collect();
    let distinct = events.len() as u64;
    let mut all = sent.clone();
    all.extend(regrouped);

    // 1. The storm, while the daemon folds and acts.
    let answers = storm(&app.webhook_url, &all, seed);
    let (dup_deliveries, accepted, dup_events) = tally(&answers, &all);
    assert_eq!(accepted, distinct, "each event accepted exactly once");
    let posted_events: u64 =
        all.iter().map(|d| d.events.len() as u64).sum::<u64>() * CLIENTS as u64;
    assert_eq!(dup_events, posted_events - distinct);
    // Each delivery id was answered `accepted` at most once.
    let mut accepted_ids = BTreeSet::new();
    for (i, _, r) in &answers {
        if r["status"] == "accepted" {
            assert!(accepted_ids.insert(*i), "delivery {i} accepted twice");
        }
    }
    app.settle();
    let after_storm = counters(&app);
    assert_eq!(
        after_storm,
        Counters {
            duplicate_deliveries: dup_deliveries as f64,
            duplicate_events: dup_events as f64,
        },
        "the metrics count what the receipts said"
    );
    assert_eq!(user_messages(&app), per_conversation, "folded once each");
    let expected_keys: BTreeSet<String> = events
        .iter()
        .flat_map(|(id, _)| [format!("{id}/relay/0"), format!("{id}/relay/1")])
        .collect();
    let effects = effects_per_key(&app);
    let keys: BTreeSet<String> = effects.keys().cloned().collect();
    assert_eq!(
        keys, expected_keys,
        "one effect per decided action, none missing"
    );
    let repeated: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(repeated.is_empty(), "actions repeated: {repeated:?}");
    let applied = app.metric("handoff_events_applied_total");

    // 2. Again, once the fold drained: every answer a duplicate, nothing changes.
    let answers = storm(&app.webhook_url, &all, seed ^ 1);
    let (dup_deliveries_2, accepted_2, _) = tally(&answers, &all);
    assert_eq!(accepted_2, 0);
    assert_eq!(dup_deliveries_2, answers.len());
    app.settle();
    assert_eq!(
        counters(&app).duplicate_deliveries,
        after_storm.duplicate_deliveries + answers.len() as f64
    );
    assert_eq!(app.metric("handoff_events_applied_total"), applied);
    assert_eq!(user_messages(&app), per_conversation);
    assert_eq!(effects_per_key(&app), effects, "no action ran again");

    // 3. Again after a kill -9 and a restart (the embedded emulator starts afresh with it, so
    // its journal must stay free of the relay's actions).
    app.kill9();
    app = TestApp::spawn_in(&dir, spawn);
    let answers = storm(&app.webhook_url, &all, seed ^ 2);
    let (dup_deliveries_3, accepted_3, _) = tally(&answers, &all);
    assert_eq!((accepted_3, dup_deliveries_3), (0, answers.len()));
    app.settle();
    assert_eq!(counters(&app).duplicate_deliveries, answers.len() as f64);
    assert_eq!(
        app.metric("handoff_events_applied_total"),
        0.0,
        "nothing folded again"
    );
    assert_eq!(user_messages(&app), per_conversation);
    let rerun: Vec<String> = effects_per_key(&app).into_keys().collect();
    assert!(
        rerun.is_empty(),
        "actions ran again after the restart: {rerun:?}"
    );
    eprintln!(
        "seed {seed}: {} deliveries ({} events) sent {} times each by {CLIENTS} clients in 3 \
         storms; each event folded once, {} actions each effective once; {:?}",
        all.len(),
        distinct,
        3 * CLIENTS,
        expected_keys.len(),
        started.elapsed()
    );
}
