//! The outbox end to end, on the real daemon: rule files (written by each test) decide actions for
//! webhook events, the executor carries them out against the emulator, and the emulator's journal
//! shows what reached the upstream.
//!
//! - Order: per conversation, actions reach the upstream in event order, each once, under injected
//!   latency, hangs, dropped connections, 429s and 5xx; conversations proceed side by side.
//! - Exactly once across kill -9: an external emulator (its journal outlives the daemon) sees one
//!   effective call per decided action whatever moment the daemon dies at.
//! - Dead letters: permanent and exhausted failures land in the dead letters, which the CLI lists,
//!   shows, drops and retries; a retried action takes effect once, a dropped one never.
//! - Idle: `/admin/v1/outbox/idle` does not answer while decided actions are still being flushed
//!   on their way to the executor.
//! - Ignored, a bug: retrying a dead letter the upstream itself refused replays the stored error.
//!
//! Quick by default; `HANDOFF_BRIDGE_LONG_TESTS=1` runs more messages and kill cycles (the kill
//! loop: 10 cycles, 100 in the long mode; part of the fault suite, docs/fault-suite.md).
//! `HANDOFF_BRIDGE_TEST_SEED` replays a run's random choices (the seed is printed).

use crate::common::emulator::ExternalEmulator;
use crate::common::load::{long_tests, post_body, seed_from_env_or_clock, Rng};
use crate::common::relay::*;
use crate::common::*;
use ::emulator::JournalEntry;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

/// An action's call took effect here: it reached the state (no injected fault), succeeded, and
/// was not an answer replayed for a key seen before. Actions carry their id as the idempotency
/// key; reads (backfill's list calls after a restart) carry none and are not counted.
fn effective(e: &JournalEntry) -> bool {
    e.idempotency_key.is_some()
        && e.fault.is_none()
        && !e.replayed
        && (200..300).contains(&e.status)
}

/// The conversation id of a `/openapi/conversation/{id}[/...]` call.
fn conversation_of(e: &JournalEntry) -> Option<&str> {
    e.path
        .strip_prefix("/openapi/conversation/")
        .map(|rest| rest.split('/').next().unwrap_or(rest))
}

/// Effective calls per idempotency key.
fn effective_per_key(entries: &[JournalEntry]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for e in entries.iter().filter(|e| effective(e)) {
        let key = action_of(e.idempotency_key.as_deref().unwrap_or_default()).to_owned();
        *out.entry(key).or_insert(0) += 1;
    }
    out
}

/// Calls the emulator answered with an error of its own (not an injected fault): none are
/// expected when every conversation exists and every action is valid.
fn upstream_errors(entries: &[JournalEntry]) -> Vec<&JournalEntry> {
    entries
        .iter()
        .filter(|e| e.fault.is_none() && !(200..300).contains(&e.status))
        .collect()
}

// ---- Waiting for the daemon ----

/// Wait until every accepted event is folded (the inbox drained: the fold decides the actions)
/// and every decided action has finished, done or dead letter (the executor idle, which counts
/// entries still being flushed on their way to it). The durable outbox is then empty.
fn settle(app: &TestApp, limit: Duration) {
    wait_drained(app);
    // Asked in turns shorter than the test client's own 30 s timeout.
    let deadline = Instant::now() + limit;
    loop {
        let (status, idle) = app.admin_get("/admin/v1/outbox/idle?timeout_ms=20000");
        if status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "outbox not idle within {limit:?}: {idle}"
        );
    }
    let (_, outbox) = app.admin_get("/admin/v1/outbox");
    let first: Vec<&Value> = outbox["entries"]
        .as_array()
        .map(|e| e.iter().take(3).map(|e| &e["id"]).collect())
        .unwrap_or_default();
    assert_eq!(
        outbox["depth"], 0,
        "idle, yet the outbox holds entries, e.g. {first:?}"
    );
}

fn dead_letters(app: &TestApp) -> Value {
    let (status, body) = app.admin_get("/admin/v1/dead-letters");
    assert_eq!(status, 200, "{body}");
    body
}

/// Run the CLI against the daemon's data directory and parse its JSON output.
fn cli_json(app: &TestApp, args: &[&str]) -> Value {
    let out = app.cli_ok(args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {out}"))
}

// ---- 1. Order under faults ----

#[test]
fn actions_reach_the_upstream_in_conversation_order_under_faults() {
    let per_conversation: usize = if long_tests() { 150 } else { 30 };
    // Three seeded conversations, of both bots.
    let conversations = [0usize, 1, 3];
    let seed = seed_from_env_or_clock();
    eprintln!("seed {seed} (set HANDOFF_BRIDGE_TEST_SEED to replay)");
    let started = Instant::now();

    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules_dir(
        tmp.path(),
        r#"
        [[rule]]
        name = "echo"
        on = ["bot.message.received"]
        # Many messages per conversation: above the default firing cap.
        max_firings = { count = 1000, per = "1m" }
        when = { field = "sender", equals = "user" }
        actions = [{ type = "send_message", text = "{{ message.data.text }}" }]
        "#,
    );
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: daemon_env(
                &rules,
                &[
                    // Transient failures are tried again until outbox.give_up_after (24 h): a
                    // run of injected failures (at most 10 counted faults in a row, then 25%
                    // random failures) never dead-letters. The circuit they open probes often.
                    ("HANDOFF_BRIDGE__OUTBOX__BREAKER__PROBE_INTERVAL", "200ms"),
                    // Hung calls time out quickly.
                    ("HANDOFF_BRIDGE__UPSTREAM__REQUEST_TIMEOUT", "1s"),
                ],
            ),
            ..Spawn::default()
        },
    );
    let emu = app.emulator_url.clone().expect("embedded emulator");
    set_faults(
        &emu,
        json!({
            "latency_ms": 10,
            "hang_next": 2,
            "drop_next": 2,
            "rate_limit_next": 6,
            "retry_after": "1",
            "error_rate": 0.25,
            "status": 503,
            "seed": seed,
            "path_prefix": "/openapi/conversation/",
        }),
    );

    // One client per conversation, posting its messages in order ("0", "1", ...), 1-3 per
    // delivery, each answered before the next is sent; the clients run side by side.
    let mut ids = Ids::new(seed);
    let mut plans: Vec<Vec<Sent>> = Vec::new();
    let mut rng = Rng::new(seed);
    let base_ts = 1_763_690_400_000i64;
    for (c, &conv) in conversations.iter().enumerate() {
        let mut deliveries = Vec::new();
        let mut n = 0;
        while n < per_conversation {
            let count = (1 + rng.below(3)).min(per_conversation - n);
            let events = (n..n + count)
                .map(|i| user_message(&mut ids, conv, &i.to_string(), base_ts + (i * 4 + c) as i64))
                .collect();
            deliveries.push(make_delivery(&mut ids, events));
            n += count;
        }
        plans.push(deliveries);
    }
    let url = app.webhook_url.clone();
    std::thread::scope(|s| {
        let handles: Vec<_> = plans
            .iter()
            .map(|deliveries| {
                let url = url.clone();
                s.spawn(move || {
                    let agent = agent();
                    for d in deliveries {
                        let (status, receipt) =
                            post_body(&agent, &url, &d.body).expect("post a delivery");
                        assert_eq!(status, 200, "{receipt}");
                        assert_eq!(receipt["status"], "accepted", "{receipt}");
                        assert_eq!(receipt["accepted"], d.events.len(), "{receipt}");
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("client thread");
        }
    });
    let posted = started.elapsed();
    settle(
        &app,
        Duration::from_secs(if long_tests() { 300 } else { 120 }),
    );
    let settled = started.elapsed();

    let letters = dead_letters(&app);
    assert_eq!(
        letters["count"], 0,
        "retryable faults must not dead-letter anything: {letters}"
    );
    let entries = journal(&emu);
    let errors = upstream_errors(&entries);
    assert!(errors.is_empty(), "calls the emulator refused: {errors:#?}");

    // The faults did happen: each kind at least once.
    let faults: BTreeMap<String, usize> = entries.iter().fold(BTreeMap::new(), |mut m, e| {
        if let Some(f) = &e.fault {
            *m.entry(f.clone()).or_insert(0) += 1;
        }
        m
    });
    for kind in ["hang", "drop", "rate_limit", "error_rate"] {
        assert!(
            faults.get(kind).copied().unwrap_or(0) > 0,
            "no `{kind}` fault was injected: {faults:?}"
        );
    }

    // Per conversation: the texts of the effective sends, in journal order, are 0..n exactly.
    let sends: Vec<&JournalEntry> = entries
        .iter()
        .filter(|e| effective(e) && e.endpoint.as_deref() == Some(SEND_MESSAGE))
        .collect();
    let expected: Vec<String> = (0..per_conversation).map(|i| i.to_string()).collect();
    for &conv in &conversations {
        let texts: Vec<String> = sends
            .iter()
            .filter(|e| conversation_of(e) == Some(SEEDED[conv].0))
            .map(|e| e.body["message"]["text"].as_str().unwrap_or("?").to_owned())
            .collect();
        assert_eq!(
            texts, expected,
            "conversation {}: texts as the upstream applied them",
            SEEDED[conv].0
        );
    }
    assert_eq!(sends.len(), per_conversation * conversations.len());
    // One effective call per idempotency key, and every key is an action id of this rule.
    let per_key = effective_per_key(&entries);
    assert_eq!(per_key.len(), sends.len(), "one key per effective call");
    assert!(per_key
        .keys()
        .all(|k| k.ends_with("/echo/0") && k.starts_with(&format!("{:08x}-", ids.tag))));

    // The conversations proceeded side by side: some two of them have their calls interleaved
    // in the journal. (Which pairs overlap depends on how the posting threads are scheduled: on
    // a loaded machine one conversation's client can finish posting before another starts, so
    // asking every pair to overlap made the test flaky.)
    let order: Vec<&str> = sends.iter().filter_map(|e| conversation_of(e)).collect();
    let span = |conv: &str| {
        let first = order.iter().position(|c| *c == conv).expect("first");
        let last = order.iter().rposition(|c| *c == conv).expect("last");
        (first, last)
    };
    let interleaved = conversations.iter().any(|&a| {
        conversations.iter().any(|&b| {
            let ((a_first, a_last), (b_first, _)) = (span(SEEDED[a].0), span(SEEDED[b].0));
            a != b && a_first < b_first && b_first < a_last
        })
    });
    assert!(interleaved, "no two conversations interleaved: {order:?}");
    let switches = order.windows(2).filter(|w| w[0] != w[1]).count();
    let replays = entries.iter().filter(|e| e.replayed).count();
    eprintln!(
        "{} actions in order over {} conversations ({switches} switches between them); \
         faults {faults:?}; {replays} replayed answers; posted in {posted:?}, settled at \
         {settled:?}, checked at {:?}",
        sends.len(),
        conversations.len(),
        started.elapsed()
    );
}

// ---- 2. kill -9 loop, exactly once ----

/// When the daemon is killed during a cycle.
#[derive(Clone, Copy, Debug)]
enum KillAt {
    /// Once this many deliveries of the batch were acknowledged (intake, folds and calls all
    /// under way).
    Acks(usize),
    /// After the whole batch was acknowledged, once the emulator has seen this many effective
    /// calls in all (the executor mid-way through the backlog).
    EffectiveCalls(usize),
    /// As soon as the whole batch was acknowledged (decisions being made and flushed).
    Posted,
}

struct BatchReport {
    acked: Vec<usize>,
    /// Failed, refused, or never sent because the daemon was gone.
    unacked: Vec<usize>,
    in_flight_at_kill: usize,
}

/// Post `batch` from `threads` clients and kill the daemon at `kill`.
fn post_batch_and_kill(
    app: TestApp,
    batch: &[Sent],
    threads: usize,
    kill: KillAt,
    emu: &str,
) -> BatchReport {
    let next = AtomicUsize::new(0);
    let acks = AtomicUsize::new(0);
    let killed = AtomicBool::new(false);
    let in_flight = AtomicUsize::new(0);
    let report = Mutex::new(BatchReport {
        acked: Vec::new(),
        unacked: Vec::new(),
        in_flight_at_kill: 0,
    });
    let url = app.webhook_url.clone();
    let (tx, rx) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        let mut clients = Vec::new();
        for _ in 0..threads {
            let tx = tx.clone();
            let (next, acks, killed, in_flight, report, url) =
                (&next, &acks, &killed, &in_flight, &report, &url);
            clients.push(s.spawn(move || {
                let agent = agent();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= batch.len() {
                        break;
                    }
                    if killed.load(Ordering::SeqCst) {
                        // Not sent: the service keeps it and sends it again later.
                        report.lock().expect("report").unacked.push(i);
                        continue;
                    }
                    let before = killed.load(Ordering::SeqCst);
                    let result = post_body(&agent, url, &batch[i].body);
                    if !before && killed.load(Ordering::SeqCst) {
                        in_flight.fetch_add(1, Ordering::SeqCst);
                    }
                    match result {
                        Ok((200, receipt)) => {
                            assert!(
                                receipt["status"] == "accepted" || receipt["status"] == "duplicate",
                                "{receipt}"
                            );
                            report.lock().expect("report").acked.push(i);
                            acks.fetch_add(1, Ordering::SeqCst);
                            let _ = tx.send(());
                        }
                        Ok((status, body)) => {
                            assert!(
                                killed.load(Ordering::SeqCst),
                                "answered {status} before the kill: {body}"
                            );
                            report.lock().expect("report").unacked.push(i);
                        }
                        Err(e) => {
                            assert!(
                                killed.load(Ordering::SeqCst),
                                "transport error before the kill: {e}"
                            );
                            report.lock().expect("report").unacked.push(i);
                        }
                    }
                }
            }));
        }
        drop(tx);
        let deadline = Instant::now() + Duration::from_secs(60);
        let wait_acks = |want: usize| {
            while acks.load(Ordering::SeqCst) < want {
                let left = deadline.saturating_duration_since(Instant::now());
                rx.recv_timeout(left).unwrap_or_else(|_| {
                    panic!(
                        "only {} of {want} deliveries acknowledged in time",
                        acks.load(Ordering::SeqCst)
                    )
                });
            }
        };
        match kill {
            KillAt::Acks(n) => wait_acks(n),
            KillAt::Posted => wait_acks(batch.len()),
            KillAt::EffectiveCalls(n) => {
                wait_acks(batch.len());
                loop {
                    let seen = journal(emu).iter().filter(|e| effective(e)).count();
                    if seen >= n {
                        break;
                    }
                    assert!(
                        Instant::now() < deadline,
                        "the emulator saw {seen} of {n} effective calls in time"
                    );
                    // Poll interval while the executor works (bounded by the deadline).
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        killed.store(true, Ordering::SeqCst);
        app.kill9();
        for c in clients {
            c.join().expect("client thread");
        }
    });
    let mut report = report.into_inner().expect("report");
    report.in_flight_at_kill = in_flight.load(Ordering::SeqCst);
    report
}

/// Each event's intake sequence number, from the admin API (looked up on a few threads).
fn intake_seqs(app: &TestApp, events: &HashSet<String>) -> std::collections::HashMap<String, u64> {
    let events: Vec<&String> = events.iter().collect();
    let chunk = events.len().div_ceil(8).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = events
            .chunks(chunk)
            .map(|part| {
                s.spawn(move || {
                    part.iter()
                        .map(|id| {
                            let (status, body) = app.admin_get(&format!("/admin/v1/events/{id}"));
                            assert_eq!(status, 200, "event {id}: {body}");
                            let seq = body["record"]["seq"].as_u64().expect("seq");
                            ((*id).clone(), seq)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("lookup thread"))
            .collect()
    })
}

#[test]
fn kill_9_loop_every_decided_action_takes_effect_exactly_once() {
    let cycles = if long_tests() { 100 } else { 10 };
    let batch_size = if long_tests() { 60 } else { 30 };
    const THREADS: usize = 6;
    let seed = seed_from_env_or_clock();
    eprintln!("seed {seed} (set HANDOFF_BRIDGE_TEST_SEED to replay the kill points)");
    let started = Instant::now();
    let mut rng = Rng::new(seed);
    let mut ids = Ids::new(seed);

    let emulator = ExternalEmulator::start(EMULATOR_KEY);
    let emu = emulator.base.clone();
    // A little latency widens the window between a call's effect and its outcome being recorded;
    // a few 5xx make retries part of what gets interrupted.
    set_faults(
        &emu,
        json!({"latency_ms": 2, "error_rate": 0.05, "status": 503, "seed": seed}),
    );
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules_dir(
        tmp.path(),
        r#"
        [[rule]]
        name = "relay"
        on = ["bot.message.received"]
        # Many messages per conversation: above the default firing cap, and the long run's
        # 3,000 per conversation within two minutes above any cap per minute.
        max_firings = { count = 1000, per = "1s" }
        when = { field = "sender", equals = "user" }
        actions = [
            { type = "send_message", text = "relay {{ message.data.text }}" },
            { type = "update_params", params = { last_event = "{{ event.id }}" } },
        ]
        "#,
    );
    let dir = tmp.path().join("data");
    let spawn = Spawn {
        env: daemon_env(
            &rules,
            &[
                ("HANDOFF_BRIDGE_UPSTREAM_URL", emu.as_str()),
                ("HANDOFF_BRIDGE_UPSTREAM_API_KEY", EMULATOR_KEY),
                // A restarted emulator answers again at once: probe it often.
                ("HANDOFF_BRIDGE__OUTBOX__BREAKER__PROBE_INTERVAL", "200ms"),
            ],
        ),
        ..Spawn::default()
    };

    // Every event sent, and those acknowledged (200) so far.
    let mut sent_events: Vec<String> = Vec::new();
    let mut acked: HashSet<String> = HashSet::new();
    // Deliveries not acknowledged yet: sent again after the restart, as the service does.
    let mut resend: Vec<Sent> = Vec::new();
    let mut ts = 1_763_690_400_000i64;

    let mut app = TestApp::spawn_in(&dir, spawn.clone());
    for cycle in 1..=cycles {
        for d in resend.drain(..) {
            let (status, receipt) = post_body(&app.agent, &app.webhook_url, &d.body)
                .unwrap_or_else(|e| panic!("cycle {cycle}: resend: {e}"));
            assert_eq!(status, 200, "cycle {cycle}: resend answered {receipt}");
            acked.extend(d.events.iter().cloned());
        }
        let batch: Vec<Sent> = (0..batch_size)
            .map(|_| {
                let count = 1 + rng.below(3);
                let events = (0..count)
                    .map(|_| {
                        ts += 1;
                        let conv = rng.below(SEEDED.len());
                        let text = format!("c{cycle}-{ts}");
                        user_message(&mut ids, conv, &text, ts)
                    })
                    .collect();
                make_delivery(&mut ids, events)
            })
            .collect();
        sent_events.extend(batch.iter().flat_map(|d| d.events.iter().cloned()));
        let new_calls: usize = batch.iter().map(|d| d.events.len() * 2).sum();
        let kill = match rng.below(3) {
            0 => KillAt::Acks(1 + rng.below(batch_size - 1)),
            1 => {
                let seen = journal(&emu).iter().filter(|e| effective(e)).count();
                KillAt::EffectiveCalls(seen + 1 + rng.below(new_calls))
            }
            _ => KillAt::Posted,
        };
        let report = post_batch_and_kill(app, &batch, THREADS, kill, &emu);
        for &i in &report.acked {
            acked.extend(batch[i].events.iter().cloned());
        }
        resend.extend(report.unacked.iter().map(|&i| batch[i].clone()));

        let restarted = Instant::now();
        app = TestApp::spawn_in(&dir, spawn.clone());
        let crash_in_recovery = rng.below(3) == 0;
        if crash_in_recovery {
            // Killed again as soon as it listens: the outbox it resumed is being carried out.
            app.kill9();
            app = TestApp::spawn_in(&dir, spawn.clone());
        }
        let entries = journal(&emu);
        let replays = entries.iter().filter(|e| e.replayed).count();
        eprintln!(
            "cycle {cycle}: killed at {kill:?} with {} requests in flight; {} acked, {} to \
             resend; crash in recovery: {crash_in_recovery}; journal {} entries ({} effective, \
             {replays} replayed); restart {:?}",
            report.in_flight_at_kill,
            report.acked.len(),
            report.unacked.len(),
            entries.len(),
            entries.iter().filter(|e| effective(e)).count(),
            restarted.elapsed()
        );
    }
    // The last daemon runs to the end: the service's last retries, then everything settles.
    for d in resend.drain(..) {
        let (status, receipt) =
            post_body(&app.agent, &app.webhook_url, &d.body).expect("final resend");
        assert_eq!(status, 200, "final resend answered {receipt}");
        acked.extend(d.events.iter().cloned());
    }
    assert_eq!(acked.len(), sent_events.len(), "every event acknowledged");
    settle(&app, Duration::from_secs(120));

    let letters = dead_letters(&app);
    assert_eq!(letters["count"], 0, "{letters}");
    let outbox = cli_json(&app, &["outbox", "list"]);
    assert_eq!(outbox["depth"], 0, "{outbox}");

    let entries = journal(&emu);
    let errors = upstream_errors(&entries);
    assert!(errors.is_empty(), "calls the emulator refused: {errors:#?}");
    let expected: BTreeSet<String> = acked
        .iter()
        .flat_map(|e| [format!("{e}/relay/0"), format!("{e}/relay/1")])
        .collect();
    let per_key = effective_per_key(&entries);
    let missing: Vec<&String> = expected
        .iter()
        .filter(|k| !per_key.contains_key(*k))
        .collect();
    assert!(
        missing.is_empty(),
        "{} decided actions never took effect, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    let repeated: Vec<(&String, &usize)> = per_key.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        repeated.is_empty(),
        "{} actions took effect more than once, e.g. {:?}",
        repeated.len(),
        &repeated[..repeated.len().min(10)]
    );
    let unknown: BTreeSet<&str> = entries
        .iter()
        .filter_map(|e| e.idempotency_key.as_deref())
        .filter(|k| !expected.contains(*k))
        .collect();
    assert!(
        unknown.is_empty(),
        "calls for actions no acknowledged event decided: {unknown:?}"
    );
    // The right call for each key.
    for e in entries.iter().filter(|e| effective(e)) {
        let key = e.idempotency_key.as_deref().unwrap_or_default();
        let want = if key.ends_with("/relay/0") {
            SEND_MESSAGE
        } else {
            UPDATE_CONVERSATION
        };
        assert_eq!(e.endpoint.as_deref(), Some(want), "{e:?}");
    }
    // Per conversation, the actions took effect in the order the events were accepted (the
    // intake sequence), and an event's actions in their rule order: crashes reorder nothing.
    let seqs = intake_seqs(&app, &acked);
    let mut last: BTreeMap<&str, (u64, usize, &str)> = BTreeMap::new();
    for e in entries.iter().filter(|e| effective(e)) {
        let key = e.idempotency_key.as_deref().unwrap_or_default();
        let (event, index) = key
            .strip_suffix("/relay/0")
            .map(|ev| (ev, 0))
            .or_else(|| key.strip_suffix("/relay/1").map(|ev| (ev, 1)))
            .unwrap_or_else(|| panic!("unexpected key {key}"));
        let conv = conversation_of(e).expect("a conversation call");
        let at = (seqs[event], index, key);
        if let Some(before) = last.insert(conv, at) {
            assert!(
                (before.0, before.1) < (at.0, at.1),
                "conversation {conv}: {key} (intake seq {}) took effect after {} (intake seq {})",
                at.0,
                before.2,
                before.0
            );
        }
    }
    let replays = entries.iter().filter(|e| e.replayed).count();
    eprintln!(
        "seed {seed}: {cycles} kill cycles: {} events, {} actions each effective once; \
         {replays} replayed answers (crash after the call); {} journal entries; {:?}",
        acked.len(),
        expected.len(),
        entries.len(),
        started.elapsed()
    );
}

// ---- 3. Dead letters, CLI drop and retry ----

#[test]
fn dead_letters_are_listed_dropped_and_retried_through_the_cli() {
    let started = Instant::now();
    let seed = seed_from_env_or_clock();
    let mut ids = Ids::new(seed);
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules_dir(
        tmp.path(),
        r#"
        [[rule]]
        name = "ack"
        on = ["bot.message.received"]
        when = { field = "sender", equals = "user" }
        actions = [
            { type = "send_message", text = "got {{ message.data.text }}" },
            { type = "update_params", params = { last_text = "{{ message.data.text }}" } },
        ]
        "#,
    );
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: daemon_env(
                &rules,
                &[
                    // A transient failure gives up after failing this long (24 h by default).
                    ("HANDOFF_BRIDGE__OUTBOX__GIVE_UP_AFTER", "300ms"),
                    ("HANDOFF_BRIDGE__OUTBOX__BREAKER__PROBE_INTERVAL", "100ms"),
                ],
            ),
            ..Spawn::default()
        },
    );
    let emu = app.emulator_url.clone().expect("embedded emulator");
    let post = |events: Vec<(String, Value)>, ids: &mut Ids| {
        let d = make_delivery(ids, events);
        let (status, receipt) = app.post(&d.body);
        assert_eq!(status, 200, "{receipt}");
        assert_eq!(receipt["accepted"], d.events.len(), "{receipt}");
        d.events
    };
    let ts = 1_763_690_500_000i64;

    // A permanent failure (400): dead at the first attempt.
    set_faults(
        &emu,
        json!({"error_rate": 1.0, "status": 400, "path_prefix": "/openapi/conversation/"}),
    );
    let a = post(
        vec![
            user_message(&mut ids, 0, "a1", ts),
            user_message(&mut ids, 0, "a2", ts + 1),
        ],
        &mut ids,
    );
    settle(&app, Duration::from_secs(60));
    // A transient failure that does not end (503): tried again until outbox.give_up_after,
    // then dead (one action at a time: the second waits behind the first).
    set_faults(
        &emu,
        json!({"error_rate": 1.0, "status": 503, "path_prefix": "/openapi/conversation/"}),
    );
    let b = post(vec![user_message(&mut ids, 1, "b1", ts + 2)], &mut ids);
    settle(&app, Duration::from_secs(60));

    let key = |event: &str, i: usize| format!("{event}/ack/{i}");
    let permanent = [key(&a[0], 0), key(&a[0], 1), key(&a[1], 0), key(&a[1], 1)];
    let exhausted = [key(&b[0], 0), key(&b[0], 1)];

    // `dlq list`: every failed action, with its reason and error.
    let list = cli_json(&app, &["dlq", "list"]);
    assert_eq!(list["count"], 6, "{list:#}");
    let letters = list["dead_letters"].as_array().expect("dead_letters");
    let by_id: BTreeMap<String, &Value> = letters
        .iter()
        .map(|l| (l["entry"]["id"].as_str().expect("id").to_owned(), l))
        .collect();
    for (keys, reason) in [
        (&permanent[..], "invalid_body"),
        (&exhausted[..], "retries_exhausted"),
    ] {
        for k in keys {
            let letter = by_id
                .get(k)
                .unwrap_or_else(|| panic!("no dead letter for {k}: {list:#}"));
            assert_eq!(letter["reason"], reason, "{letter:#}");
            assert!(
                !letter["error"].as_str().unwrap_or_default().is_empty(),
                "{letter:#}"
            );
            assert_eq!(letter["blocking"], false, "{letter:#}");
        }
    }
    let seq_of = |k: &str| by_id[k]["entry"]["seq"].as_u64().expect("seq");
    assert_eq!(app.metric("handoff_dead_letter_entries"), 6.0);
    assert_eq!(
        app.metric(r#"handoff_dead_letters_total{reason="invalid_body"}"#),
        4.0
    );
    assert_eq!(
        app.metric(r#"handoff_dead_letters_total{reason="retries_exhausted"}"#),
        2.0
    );
    // The emulator saw each permanent failure once (not retried) and each transient one as
    // often as its dead letter counts (tried again until it gave up); nothing took effect.
    let entries = journal(&emu);
    for (keys, transient) in [(&permanent[..], false), (&exhausted[..], true)] {
        for k in keys {
            let n = entries
                .iter()
                .filter(|e| e.idempotency_key.as_deref() == Some(k.as_str()))
                .count();
            let counted = by_id[k.as_str()]["attempts"].as_u64().expect("attempts");
            assert_eq!(n as u64, counted, "attempts of {k}");
            if transient {
                assert!(n >= 2, "tried again: {k} {n}");
            } else {
                assert_eq!(n, 1, "a permanent failure is not tried again: {k}");
            }
        }
    }
    assert!(entries.iter().all(|e| !effective(e)), "{entries:#?}");

    // `dlq show`.
    let dropped = key(&a[0], 1);
    let shown = cli_json(&app, &["dlq", "show", &seq_of(&dropped).to_string()]);
    assert_eq!(shown["entry"]["id"], dropped.as_str(), "{shown:#}");
    assert_eq!(shown["reason"], "invalid_body", "{shown:#}");

    // `dlq drop`: gone from the list, and never carried out.
    let drop_seq = seq_of(&dropped).to_string();
    let out = cli_json(
        &app,
        &["dlq", "drop", &drop_seq, "--reason", "params set by hand"],
    );
    assert_eq!(out["dropped"], seq_of(&dropped), "{out}");
    let list = cli_json(&app, &["dlq", "list"]);
    assert_eq!(list["count"], 5, "{list:#}");
    assert!(
        list["dead_letters"]
            .as_array()
            .expect("list")
            .iter()
            .all(|l| l["entry"]["id"] != dropped.as_str()),
        "{list:#}"
    );
    assert_eq!(app.metric("handoff_dead_letter_entries"), 5.0);
    let again = app.cli(&["dlq", "show", &drop_seq]);
    assert_eq!(
        again.status.code(),
        Some(1),
        "a dropped letter is not found"
    );
    let again = app.cli(&["dlq", "drop", &drop_seq, "--reason", "twice"]);
    assert_eq!(again.status.code(), Some(1), "dropping twice: not found");

    // The emulator is healthy again; one letter retried by id, then the rest.
    clear_faults(&emu);
    let first = key(&b[0], 0);
    let out = cli_json(&app, &["dlq", "retry", &seq_of(&first).to_string()]);
    assert_eq!(out["retried"], json!([seq_of(&first)]), "{out}");
    let out = cli_json(&app, &["dlq", "retry", "--all"]);
    let mut retried: Vec<u64> = out["retried"]
        .as_array()
        .expect("retried")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    retried.sort_unstable();
    let mut want: Vec<u64> = permanent
        .iter()
        .chain(&exhausted)
        .filter(|k| **k != dropped && **k != first)
        .map(|k| seq_of(k))
        .collect();
    want.sort_unstable();
    assert_eq!(retried, want, "{out}");
    let missing = app.cli(&["dlq", "retry", &seq_of(&first).to_string()]);
    assert_eq!(missing.status.code(), Some(1), "retrying a retried letter");
    settle(&app, Duration::from_secs(60));

    let list = cli_json(&app, &["dlq", "list"]);
    assert_eq!(list["count"], 0, "{list:#}");
    assert_eq!(app.metric("handoff_dead_letter_entries"), 0.0);
    let outbox = cli_json(&app, &["outbox", "list"]);
    assert_eq!(outbox["depth"], 0, "{outbox:#}");
    let entries = journal(&emu);
    let errors = upstream_errors(&entries);
    assert!(errors.is_empty(), "calls the emulator refused: {errors:#?}");
    let per_key = effective_per_key(&entries);
    for k in permanent.iter().chain(&exhausted) {
        let n = per_key.get(k).copied().unwrap_or(0);
        let want = usize::from(*k != dropped);
        assert_eq!(n, want, "effective calls of {k}");
    }
    assert_eq!(per_key.len(), 5, "{per_key:?}");
    // Retried together, a conversation's letters still ran in decision order.
    let conv0: Vec<&str> = entries
        .iter()
        .filter(|e| effective(e) && conversation_of(e) == Some(SEEDED[0].0))
        .filter_map(|e| e.idempotency_key.as_deref().map(action_of))
        .collect();
    assert_eq!(
        conv0,
        vec![key(&a[0], 0), key(&a[1], 0), key(&a[1], 1)],
        "conversation order after the retry"
    );
    // The effects are there: the last params update of the first conversation won.
    let (status, state) = emu_call("GET", &format!("{emu}/_emulator/state"), None);
    assert_eq!(status, 200);
    let conv = state["conversations"]
        .as_array()
        .and_then(|cs| {
            cs.iter()
                .find(|c| c["id"] == SEEDED[0].0 || c["conversation"]["id"] == SEEDED[0].0)
        })
        .cloned()
        .unwrap_or(Value::Null);
    let params = if conv["params"].is_object() {
        &conv["params"]
    } else {
        &conv["conversation"]["params"]
    };
    assert_eq!(params["last_text"], "a2", "{conv:#}");

    // The audit window keeps every finished entry: the dropped one with its reason, the others
    // done.
    let done = cli_json(&app, &["outbox", "done", "--limit", "1000"]);
    let finished = done["finished"].as_array().cloned().unwrap_or_default();
    let outcome_of = |k: &str| {
        finished
            .iter()
            .find(|r| r["entry"]["id"] == k)
            .map(|r| (r["outcome"].clone(), r["note"].clone()))
    };
    assert_eq!(
        outcome_of(&dropped),
        Some((json!("dropped"), json!("params set by hand"))),
        "{done:#}"
    );
    for k in permanent
        .iter()
        .chain(&exhausted)
        .filter(|k| **k != dropped)
    {
        assert_eq!(
            outcome_of(k).map(|o| o.0),
            Some(json!("done")),
            "{k}: {done:#}"
        );
    }

    // Offline (daemon stopped), the CLI reads the same, empty, dead letters from the store.
    let dir = app.data_dir.clone();
    let status = app.terminate();
    assert!(status.success(), "{status}");
    let out = cli_ok(&dir, &["dlq", "list"]);
    let list: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(list["count"], 0, "{list:#}");
    eprintln!("dead-letter round trip in {:?}", started.elapsed());
}

// ---- 4. `/outbox/idle` covers actions still on their way to the executor ----

/// Once the inbox is drained every event is folded and its actions are in the outbox, but the
/// executor hears of them through the folds' channel (`outbox::DecidedSender`), a step later.
/// `GET /admin/v1/outbox/idle` must not answer idle in that window. (Before bb3faeb it did: about
/// one answer in three came before the action ran while other traffic kept the flushes busy.)
#[test]
fn outbox_idle_waits_for_actions_already_decided() {
    const ROUNDS: i64 = 60;
    let seed = seed_from_env_or_clock();
    let mut ids = Ids::new(seed);
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules_dir(
        tmp.path(),
        r#"
        [[rule]]
        name = "echo"
        on = ["bot.message.received"]
        # Many messages per conversation: above the default firing cap.
        max_firings = { count = 1000, per = "1m" }
        actions = [{ type = "send_message", text = "{{ message.data.text }}" }]
        "#,
    );
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: daemon_env(&rules, &[]),
            ..Spawn::default()
        },
    );
    let emu = app.emulator_url.clone().expect("embedded emulator");
    // Other traffic (bot messages of another conversation: no rule fires) keeps the store's
    // flushes busy, as in production, which widens the window.
    let stop = AtomicBool::new(false);
    let mut premature = Vec::new();
    std::thread::scope(|s| {
        for t in 0..3u64 {
            let (stop, url) = (&stop, app.webhook_url.clone());
            let mut ids = Ids::new(seed ^ (t + 1));
            s.spawn(move || {
                let agent = agent();
                let mut n = 0i64;
                while !stop.load(Ordering::SeqCst) {
                    n += 1;
                    let (id, mut event) = user_message(&mut ids, 3, "noise", 1_763_690_400_000 + n);
                    event["event"] = json!("bot.message.sent");
                    event["data"]["message"]["isUser"] = json!(false);
                    let d = make_delivery(&mut ids, vec![(id, event)]);
                    let _ = post_body(&agent, &url, &d.body);
                }
            });
        }
        // Stops the traffic however this thread leaves the scope (a failed assert included).
        let _stop = StopOnDrop(&stop);
        for i in 0..ROUNDS {
            let event = user_message(&mut ids, 0, &i.to_string(), 1_763_690_400_000 + i);
            let d = make_delivery(&mut ids, vec![event]);
            let (status, receipt) = app.post(&d.body);
            assert_eq!(status, 200, "{receipt}");
            wait_drained(&app);
            let (status, idle) = app.admin_get("/admin/v1/outbox/idle?timeout_ms=10000");
            assert_eq!(status, 200, "{idle}");
            // Read the journal first: if the call is there, the executor had the entry.
            let key = format!("{}/echo/0", d.events[0]);
            let done = journal(&emu)
                .iter()
                .any(|e| effective(e) && e.idempotency_key.as_deref() == Some(key.as_str()));
            let (_, outbox) = app.admin_get("/admin/v1/outbox");
            if !done || outbox["depth"] != 0 {
                premature.push(format!(
                    "message {i}: idle said {idle}, then the call was {} and the outbox held {}",
                    if done { "made" } else { "not made" },
                    outbox["depth"]
                ));
            }
        }
    });
    assert!(
        premature.is_empty(),
        "{} of {ROUNDS} idle answers came before the action ran:\n{}",
        premature.len(),
        premature.join("\n")
    );
}

struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

// ---- 5. Bug: a dead letter the upstream itself refused can never be retried ----

/// The Open API stores every answer under its key, errors included (docs/open-api-contract.md,
/// rule 10). So when the upstream really answered the first attempt (here 409: the
/// partner-messenger user is blocked), a retry under the same key would only replay the stored
/// 409. A dead letter the upstream answered is therefore retried under a fresh key (nothing took
/// effect, so no effect can double); one it never answered (timeout, dropped connection) keeps
/// its key.
#[test]
fn a_dead_letter_retried_after_its_cause_is_fixed_takes_effect() {
    const KEY: &str = "outbox-integration-embedded-key-8821";
    let seed = seed_from_env_or_clock();
    let mut ids = Ids::new(seed);
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules_dir(
        tmp.path(),
        r#"
        [[rule]]
        name = "to-partner"
        on = ["bot.message.received"]
        actions = [{ type = "partner_send_message", sender_key = "sk-support-0001", user_key = "kb-user-blocked-03", text = "we read: {{ message.data.text }}" }]
        "#,
    );
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: daemon_env(
                &rules,
                &[
                    ("HANDOFF_BRIDGE_UPSTREAM_API_KEY", KEY),
                    // A key without a URL is refused: the emulator is asked for.
                    ("HANDOFF_BRIDGE_UPSTREAM_URL", "embedded"),
                ],
            ),
            ..Spawn::default()
        },
    );
    let emu = app.emulator_url.clone().expect("embedded emulator");
    // Conversation ...0003 belongs to kb-user-blocked-03, blocked in channel sk-support-0001.
    let (event, body) = user_message(&mut ids, 2, "hello?", 1_763_690_600_000);
    let d = make_delivery(&mut ids, vec![(event.clone(), body)]);
    let (status, receipt) = app.post(&d.body);
    assert_eq!(status, 200, "{receipt}");
    settle(&app, Duration::from_secs(60));
    let list = cli_json(&app, &["dlq", "list"]);
    assert_eq!(list["count"], 1, "{list:#}");
    assert_eq!(list["dead_letters"][0]["reason"], "conflict", "{list:#}");

    // The operator fixes the cause upstream, then retries.
    let mut resp = app
        .agent
        .post(format!(
            "{emu}/openapi/partnerbiz/sk-support-0001/conversation/kb-user-blocked-03/unblock"
        ))
        .header("authorization", format!("Bearer {KEY}"))
        .send_empty()
        .expect("unblock");
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    assert_eq!(resp.status().as_u16(), 200, "unblock: {text}");
    let out = cli_json(&app, &["dlq", "retry", "--all"]);
    assert_eq!(out["retried"].as_array().map(Vec::len), Some(1), "{out}");
    settle(&app, Duration::from_secs(60));

    let key = format!("{event}/to-partner/0");
    let calls: Vec<(u16, bool)> = journal(&emu)
        .iter()
        .filter(|e| {
            e.idempotency_key
                .as_deref()
                .is_some_and(|k| k.starts_with(&key))
        })
        .map(|e| (e.status, e.replayed))
        .collect();
    let retry_keys: Vec<String> = journal(&emu)
        .iter()
        .filter_map(|e| e.idempotency_key.clone())
        .filter(|k| k.starts_with(&format!("{key}~retry-")))
        .collect();
    assert_eq!(
        retry_keys.len(),
        1,
        "one call under one fresh key: {retry_keys:?}"
    );
    let list = cli_json(&app, &["dlq", "list"]);
    assert_eq!(
        list["count"], 0,
        "the retried action died again; its calls (status, replayed): {calls:?}; {list:#}"
    );
    assert_eq!(
        calls,
        [(409, false), (200, false)],
        "the refusal, then one effect"
    );
}
