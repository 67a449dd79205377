//! Bounds for one delivery at the maximum body size (issue 19, "Hostile input stays bounded"):
//! 8 MiB of empty events (over `webhook.max_events`), then 8 MiB of events that are all invalid
//! (under it). For each: the answer (200, one quarantine record) comes in under 5 s, the data
//! directory grows by a few MB at most, and small deliveries from a second client keep being
//! acknowledged meanwhile; the daemon's peak RSS (VmHWM) stays under 300 MB throughout. Measured
//! figures: docs/benchmarks.md, "Hostile deliveries at the size limit".

use crate::common::{Spawn, TestApp};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MAX_BODY: usize = 8 * 1024 * 1024;
const MAX_EVENTS: usize = 10_000;
const ANSWER_WITHIN: Duration = Duration::from_secs(5);
const PEAK_RSS_KIB: u64 = 300 * 1024;
const DIR_GROWTH: u64 = 4 * 1024 * 1024;

/// The daemon's peak resident set (`VmHWM`), KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

/// Bytes under the data directory (the daemon's own log file, which tests keep there, aside).
fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("read dir") {
            let entry = entry.expect("entry");
            let meta = entry.metadata().expect("metadata");
            let name = entry.file_name().to_string_lossy().into_owned();
            if meta.is_dir() {
                stack.push(entry.path());
            } else if !(d == dir && name.starts_with("daemon-") && name.ends_with(".log")) {
                total += meta.len();
            }
        }
    }
    total
}

fn envelope_around(id: &str, events: &str) -> Vec<u8> {
    format!(r#"{{"id":"{id}","webhookId":"w","webhookUrl":"u","messages":[{events}]}}"#)
        .into_bytes()
}

/// As many `{}` events as fit in `MAX_BODY` (about 2.8 million).
fn empty_events() -> Vec<u8> {
    let shell = envelope_around("d-empties", "").len();
    let n = (MAX_BODY - shell + 1) / 3;
    let events = vec!["{}"; n].join(",");
    let body = envelope_around("d-empties", &events);
    assert!(body.len() <= MAX_BODY && body.len() > MAX_BODY - 3);
    body
}

/// Just under `MAX_EVENTS` invalid events (no `data.conversation`), padded with text to fill
/// `MAX_BODY`.
fn invalid_events() -> Vec<u8> {
    invalid_events_in("d-invalid")
}

fn invalid_events_in(delivery: &str) -> Vec<u8> {
    let n = MAX_EVENTS - 10;
    let shell = envelope_around(delivery, "").len();
    let event = |i: usize, pad: &str| {
        format!(
            r#"{{"id":"bad-{i:06}","event":"bot.conversation.updated","sourceType":"bot","sourceId":"Bbounds","timestamp":1,"data":{{"note":"{pad}"}}}}"#
        )
    };
    let bare = event(0, "").len() + 1;
    let pad_len = (MAX_BODY - shell) / n - bare;
    let words = "the user asked for an agent and waited while the bot kept answering ";
    let pad: String = words.chars().cycle().take(pad_len).collect();
    let events: Vec<String> = (0..n).map(|i| event(i, &pad)).collect();
    let body = envelope_around(delivery, &events.join(","));
    assert!(body.len() <= MAX_BODY && body.len() > MAX_BODY - 2 * n);
    body
}

struct Small {
    /// (sent, answered, status) of each small delivery.
    answers: Vec<(Instant, Instant, u16)>,
}

/// Post small valid deliveries one after another until `stop`.
fn small_deliveries(
    app: &TestApp,
    tag: &'static str,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Small> {
    let (agent, url) = (app.agent.clone(), app.webhook_url.clone());
    std::thread::spawn(move || {
        let mut answers = Vec::new();
        let mut i = 0u32;
        while !stop.load(Ordering::Relaxed) && i < 10_000 {
            let event = json!({
                "id": format!("small-{tag}-{i}"), "event": "bot.updated", "sourceType": "bot",
                "sourceId": "Bsmall", "timestamp": 1, "data": {"bot": {"id": "Bsmall"}}
            });
            let body = crate::common::delivery(&format!("d-small-{tag}-{i}"), &[event]);
            let sent = Instant::now();
            let status = agent
                .post(&url)
                .header("content-type", "application/json")
                .send(&body[..])
                .map(|r| r.status().as_u16())
                .unwrap_or(0);
            answers.push((sent, Instant::now(), status));
            i += 1;
        }
        Small { answers }
    })
}

/// Post one big body while small deliveries go on; check the answer, the time, the directory's
/// growth and the small deliveries. Returns (seconds to answer, bytes the directory grew).
fn big_delivery(app: &TestApp, tag: &'static str, body: &[u8], reason: &str) -> u64 {
    let before = dir_bytes(&app.data_dir);
    let records_before = quarantine_len(app);
    let accepted = "handoff_webhook_deliveries_total{outcome=\"accepted\"}";
    let accepted_before = app.metric(accepted);
    let stop = Arc::new(AtomicBool::new(false));
    let small = small_deliveries(app, tag, stop.clone());
    // The second client is under way before the big body goes.
    crate::common::poll_until("a small delivery answered", Duration::from_secs(10), || {
        (app.metric(accepted) > accepted_before).then_some(())
    });
    let started = Instant::now();
    let (status, receipt) = app.post(body);
    let finished = Instant::now();
    let took = finished - started;
    stop.store(true, Ordering::Relaxed);
    let small = small.join().expect("small deliveries");

    assert_eq!(status, 200, "{tag}: {receipt}");
    assert_eq!(receipt["status"], "quarantined", "{tag}: {receipt}");
    assert_eq!(receipt["reason"], reason, "{tag}: {receipt}");
    assert!(took < ANSWER_WITHIN, "{tag}: answered in {took:?}");
    assert_eq!(quarantine_len(app), records_before + 1, "{tag}: one record");

    assert!(
        small.answers.iter().all(|(_, _, s)| *s == 200),
        "{tag}: every small delivery is acknowledged: {:?}",
        small.answers.iter().map(|a| a.2).collect::<Vec<_>>()
    );
    let during = small
        .answers
        .iter()
        .filter(|(sent, answered, _)| *sent >= started && *answered <= finished)
        .count();
    assert!(
        during >= 1,
        "{tag}: small deliveries were acknowledged while the big one was handled ({took:?})"
    );

    let grew = dir_bytes(&app.data_dir).saturating_sub(before);
    assert!(
        grew <= DIR_GROWTH,
        "{tag}: the data directory grew by {grew} bytes"
    );
    eprintln!(
        "{tag}: {} bytes answered in {:.2} s; data dir +{} KiB; {} small deliveries acknowledged meanwhile",
        body.len(),
        took.as_secs_f64(),
        grew / 1024,
        during
    );
    receipt["quarantine_id"].as_u64().expect("quarantine id")
}

/// Quarantine records (the gauge: listing them would read every body back).
fn quarantine_len(app: &TestApp) -> usize {
    app.metric("handoff_quarantine_entries") as usize
}

#[test]
fn one_delivery_at_the_size_limit_stays_within_memory_time_and_disk_bounds() {
    let tmp = tempfile::tempdir().expect("tmp");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn::with_env(&[
            (
                "HANDOFF_BRIDGE__WEBHOOK__MAX_BODY_BYTES",
                &MAX_BODY.to_string(),
            ),
            (
                "HANDOFF_BRIDGE__WEBHOOK__MAX_EVENTS",
                &MAX_EVENTS.to_string(),
            ),
        ]),
    );
    let pid = app.pid();
    eprintln!("peak RSS after start: {} MiB", peak_rss_kib(pid) / 1024);
    let empties = empty_events();
    big_delivery(&app, "empties", &empties, "too_many_events");
    drop(empties);
    let invalid = invalid_events();
    let id = big_delivery(&app, "invalid", &invalid, "invalid_event");

    let peak = peak_rss_kib(pid);
    eprintln!("peak RSS (VmHWM): {} MiB", peak / 1024);
    assert!(peak < PEAK_RSS_KIB, "peak RSS {} MiB", peak / 1024);

    // The invalid events are one record of the whole delivery, read back intact.
    let mut resp = app
        .agent
        .get(app.admin_url(&format!("/admin/v1/quarantine/{id}")))
        .header(
            "authorization",
            format!("Bearer {}", crate::common::ADMIN_TOKEN),
        )
        .call()
        .expect("GET");
    assert_eq!(resp.status().as_u16(), 200);
    let text = resp
        .body_mut()
        .with_config()
        .limit(64 * 1024 * 1024)
        .read_to_string()
        .expect("the record");
    let record: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(record["scope"], "events");
    // The view shows the first MiB of the body; the whole is at `/body`.
    assert_eq!(record["body_truncated"], true, "{}", record["body_bytes"]);
    assert!(
        record["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with(&format!("{} invalid events", MAX_EVENTS - 10))),
        "{}",
        record["detail"]
    );
    let mut resp = app
        .agent
        .get(app.admin_url(&format!("/admin/v1/quarantine/{id}/body")))
        .header(
            "authorization",
            format!("Bearer {}", crate::common::ADMIN_TOKEN),
        )
        .call()
        .expect("GET body");
    assert_eq!(resp.status().as_u16(), 200);
    let body = resp
        .body_mut()
        .with_config()
        .limit(64 * 1024 * 1024)
        .read_to_vec()
        .expect("the body");
    assert_eq!(Some(body.len() as u64), record["body_bytes"].as_u64());
    let kept: Vec<Value> = serde_json::from_slice(&body).expect("array");
    assert_eq!(kept.len(), MAX_EVENTS - 10);
    assert_eq!(kept[0]["id"], "bad-000000");
}

#[test]
fn admin_reads_run_off_the_http_worker_so_deliveries_are_acknowledged_meanwhile() {
    // One HTTP worker: an admin call doing its store work (and encoding) on it would hold every
    // delivery back until it answered.
    let tmp = tempfile::tempdir().expect("tmp");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn::with_env(&[
            ("HANDOFF_BRIDGE__SERVER__WORKERS", "1"),
            (
                "HANDOFF_BRIDGE__WEBHOOK__MAX_BODY_BYTES",
                &MAX_BODY.to_string(),
            ),
        ]),
    );
    // Three large records make reading them back slow: each body is read, expanded and
    // encoded.
    let mut ids = Vec::new();
    for i in 0..3 {
        let (status, receipt) = app.post(&invalid_events_in(&format!("d-slow-list-{i}")));
        assert_eq!(
            (status, receipt["reason"].as_str()),
            (200, Some("invalid_event")),
            "{receipt}"
        );
        ids.push(receipt["quarantine_id"].as_u64().expect("id"));
    }
    let lister = {
        let urls: Vec<String> = ids
            .iter()
            .flat_map(|id| {
                [
                    app.admin_url(&format!("/admin/v1/quarantine/{id}")),
                    app.admin_url(&format!("/admin/v1/quarantine/{id}/body")),
                ]
            })
            .collect();
        let agent = app.agent.clone();
        std::thread::spawn(move || {
            let started = Instant::now();
            let (mut answered, mut status, mut len) = (started, 200, 0);
            for url in urls {
                let mut resp = agent
                    .get(&url)
                    .header(
                        "authorization",
                        format!("Bearer {}", crate::common::ADMIN_TOKEN),
                    )
                    .call()
                    .expect("GET");
                // The answer's head: the daemon has done its work (the body is still to be read).
                answered = Instant::now();
                status = status.max(resp.status().as_u16());
                len += resp
                    .body_mut()
                    .with_config()
                    .limit(256 * 1024 * 1024)
                    .read_to_vec()
                    .expect("the record")
                    .len();
            }
            (started, answered, status, len)
        })
    };
    let mut answers = Vec::new();
    let mut i = 0;
    while !lister.is_finished() && i < 10_000 {
        let event = json!({
            "id": format!("list-small-{i}"), "event": "bot.updated", "sourceType": "bot",
            "sourceId": "Bsmall", "timestamp": 1, "data": {"bot": {"id": "Bsmall"}}
        });
        let sent = Instant::now();
        let (status, _) = app.post(&crate::common::delivery(
            &format!("d-list-small-{i}"),
            &[event],
        ));
        answers.push((sent, Instant::now(), status));
        i += 1;
    }
    let (started, finished, status, len) = lister.join().expect("lister");
    assert_eq!(status, 200);
    assert!(
        len > 3 * (MAX_BODY - MAX_BODY / 16),
        "the three bodies were read whole ({len} bytes)"
    );
    assert!(
        answers.iter().all(|a| a.2 == 200),
        "every delivery acknowledged"
    );
    let during = answers
        .iter()
        .filter(|(sent, answered, _)| *sent >= started && *answered <= finished)
        .count();
    eprintln!(
        "reading the records took {:.2} s; {during} deliveries acknowledged meanwhile",
        (finished - started).as_secs_f64()
    );
    assert!(
        during >= 1,
        "deliveries were acknowledged while the records were read"
    );
}
