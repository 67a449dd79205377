//! Slow clients against the real daemon (issue 7's fault suite): many connections that send their
//! headers or their bodies a byte at a time (slowloris).
//!
//! - Legitimate webhook deliveries on fresh connections keep answering 200 while they hang on,
//!   with a median latency within a generous ratio of the unloaded median of the same run.
//! - Each slow connection is closed once `server.client_request_timeout` (headers) or
//!   `server.body_read_timeout` (body, answered 408 `body_timeout`) has passed, both set to 1 s.
//! - The connections the daemon holds open never exceed `server.max_connections` (per worker; one
//!   worker here), counted as the daemon's open sockets in /proc; the rest wait in the backlog.
//!
//! Quick by default (200 slow connections); `HANDOFF_BRIDGE_LONG_TESTS=1` opens 1000.

use crate::common::load::{long_tests, median, post_body};
use crate::common::*;
use serde_json::json;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const CONV: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
const END_USER: &str = "4e6f0d0a-1111-4a5b-8c9d-000000000001";
/// Generous: a slowloris that worked would stall intake for whole seconds, not a few ratios.
const LATENCY_RATIO: f64 = 10.0;
/// How much earlier than `client_request_timeout` actix-http may cut a head: it computes the
/// deadline from its cached clock (the date service, refreshed every 500 ms), not the instant of
/// accept. The body timeout is the daemon's own (tokio) and needs no slack.
const HEAD_TIMER_SLACK: Duration = Duration::from_millis(550);
/// How long after its timeout a slow connection may still be open (a loaded 2-core machine).
const CLOSE_SLACK: Duration = Duration::from_secs(8);

/// A daemon with 1 s client timeouts; the temp dir lives as long as the returned guard.
fn spawn(extra: &[(&str, &str)]) -> (tempfile::TempDir, TestApp) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut env = vec![
        ("HANDOFF_BRIDGE__SERVER__CLIENT_REQUEST_TIMEOUT", "1s"),
        ("HANDOFF_BRIDGE__SERVER__BODY_READ_TIMEOUT", "1s"),
    ];
    env.extend_from_slice(extra);
    let app = TestApp::spawn_in(&tmp.path().join("data"), Spawn::with_env(&env));
    (tmp, app)
}

/// One delivery with one user message, unique by `n`.
fn legit_delivery(run: &str, n: usize) -> Vec<u8> {
    let id = |kind: u16| format!("{run}-{kind:04x}-4000-8000-{n:012x}");
    let ts = 1_763_690_400_000i64 + n as i64;
    let event = json!({
        "id": id(0xe),
        "event": "bot.message.received",
        "sourceType": "bot",
        "sourceId": "B7f3a2c",
        "timestamp": ts,
        "data": {"message": {
            "id": id(0xa),
            "endUserId": END_USER,
            "conversationId": CONV,
            "data": {"type": "text", "text": format!("legit {n}")},
            "meta": null,
            "isUser": true,
            "timestamp": ts,
            "requestId": id(0xb),
        }}
    });
    delivery(&id(0xd), &[event])
}

/// Post `count` deliveries, each on a fresh connection (a new client: no pooled connection);
/// every one must be accepted. Returns their latencies.
fn legit_posts(app: &TestApp, run: &str, from: usize, count: usize) -> Vec<Duration> {
    (from..from + count)
        .map(|n| {
            let body = legit_delivery(run, n);
            let started = Instant::now();
            let (status, receipt) = post_body(&agent(), &app.webhook_url, &body).expect("post");
            let took = started.elapsed();
            assert_eq!(status, 200, "legitimate delivery {n}: {receipt}");
            assert_eq!(receipt["accepted"], 1, "{receipt}");
            took
        })
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Slow {
    /// The request line, then header bytes one at a time, never the blank line.
    Headers,
    /// Complete headers to the webhook with a `Content-Length`, then body bytes one at a time.
    Body,
    /// Connects and sends nothing.
    Silent,
}

/// What a slow connection saw: how long after connecting the daemon closed it, and what it
/// answered before closing (empty: closed without a word).
#[derive(Debug)]
struct Closed {
    after: Duration,
    answer: String,
}

/// Hold a slow connection to `addr` until the daemon closes it (or `give_up` passes: `None`).
/// `opened` counts connections established.
fn slow_client(
    addr: &str,
    path: &str,
    kind: Slow,
    gap: Duration,
    give_up: Duration,
    opened: &AtomicUsize,
) -> Option<Closed> {
    let mut stream = TcpStream::connect(addr).expect("connect");
    let started = Instant::now();
    opened.fetch_add(1, Ordering::SeqCst);
    stream.set_read_timeout(Some(gap)).expect("read timeout");
    let head = match kind {
        Slow::Headers => format!("POST {path} HTTP/1.1\r\nHost: x\r\n"),
        Slow::Body => format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: 100000\r\n\r\n"
        ),
        Slow::Silent => String::new(),
    };
    if stream.write_all(head.as_bytes()).is_err() {
        return Some(Closed {
            after: started.elapsed(),
            answer: String::new(),
        });
    }
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    while started.elapsed() < give_up {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                // Still open: one more byte, as slowly as a slowloris does.
                let byte: &[u8] = match kind {
                    Slow::Headers => b"a",
                    Slow::Body => b" ",
                    Slow::Silent => b"",
                };
                if stream.write_all(byte).is_err() {
                    break;
                }
                continue;
            }
            Err(_) => break, // reset: closed
        }
    }
    (started.elapsed() < give_up).then(|| Closed {
        after: started.elapsed(),
        answer: String::from_utf8_lossy(&answer).into_owned(),
    })
}

fn addr_of(app: &TestApp) -> String {
    app.base
        .strip_prefix("http://")
        .expect("http base")
        .to_owned()
}

#[test]
fn slowloris_headers_and_bodies_are_cut_at_their_timeouts_and_intake_keeps_its_latency() {
    let slow_count = if long_tests() { 1000 } else { 200 };
    let (_tmp, app) = spawn(&[]);
    let addr = addr_of(&app);
    let webhook_path = app
        .webhook_url
        .strip_prefix(&app.base)
        .expect("webhook path")
        .to_owned();
    let timeout = Duration::from_secs(1);
    let give_up = timeout + CLOSE_SLACK + Duration::from_secs(if long_tests() { 10 } else { 0 });

    // Unloaded latency, same run.
    let unloaded = legit_posts(&app, "0000aaaa", 0, 20);

    let opened = AtomicUsize::new(0);
    let (closed, loaded) = std::thread::scope(|s| {
        let slow: Vec<_> = (0..slow_count)
            .map(|i| {
                let kind = if i % 2 == 0 {
                    Slow::Headers
                } else {
                    Slow::Body
                };
                let (addr, path, opened) = (&addr, &webhook_path, &opened);
                let handle = std::thread::Builder::new()
                    .stack_size(128 * 1024)
                    .spawn_scoped(s, move || {
                        (
                            kind,
                            slow_client(
                                addr,
                                path,
                                kind,
                                Duration::from_millis(100),
                                give_up,
                                opened,
                            ),
                        )
                    })
                    .expect("slow client thread");
                handle
            })
            .collect();
        // Legitimate deliveries once the slow connections are all open and trickling.
        poll_until(
            "the slow connections to open",
            Duration::from_secs(30),
            || (opened.load(Ordering::SeqCst) == slow_count).then_some(()),
        );
        let loaded = legit_posts(&app, "0000bbbb", 1000, 20);
        let closed: Vec<(Slow, Option<Closed>)> = slow
            .into_iter()
            .map(|h| h.join().expect("slow client"))
            .collect();
        (closed, loaded)
    });

    // Intake kept its latency.
    let (before, during) = (median(&unloaded), median(&loaded));
    eprintln!(
        "{slow_count} slow connections: legitimate median {during:?} (unloaded {before:?}); \
         max {:?}",
        loaded.iter().max()
    );
    assert!(
        during.as_secs_f64() <= before.as_secs_f64() * LATENCY_RATIO,
        "legitimate deliveries slowed from a median of {before:?} to {during:?}"
    );

    // Every slow connection was closed at its timeout, not before, and not much after.
    let mut afters = Vec::new();
    for (i, (kind, c)) in closed.iter().enumerate() {
        let c = c.as_ref().unwrap_or_else(|| {
            panic!("slow connection {i} ({kind:?}) still open after {give_up:?}")
        });
        let earliest = match kind {
            Slow::Body => timeout - Duration::from_millis(50),
            _ => timeout - HEAD_TIMER_SLACK,
        };
        assert!(
            c.after >= earliest,
            "{kind:?} connection {i} closed after {:?}, before the {timeout:?} timeout",
            c.after
        );
        match kind {
            Slow::Body => assert!(
                c.answer.starts_with("HTTP/1.1 408") && c.answer.contains("body_timeout"),
                "a slow body is answered 408 body_timeout: {:?}",
                c.answer
            ),
            _ => assert!(
                c.answer.is_empty() || c.answer.starts_with("HTTP/1.1 408"),
                "slow headers: closed, or answered 408: {:?}",
                c.answer
            ),
        }
        afters.push(c.after);
    }
    afters.sort();
    eprintln!(
        "closed after: min {:?}, median {:?}, max {:?}",
        afters[0],
        afters[afters.len() / 2],
        afters[afters.len() - 1]
    );
    let (_, counted) = app.admin_get_text("/metrics");
    assert!(
        counted.contains("handoff_webhook_deliveries_total{outcome=\"timeout\"}"),
        "timeouts are counted"
    );
    assert_eq!(
        app.metric("handoff_webhook_deliveries_total{outcome=\"timeout\"}") as usize,
        slow_count / 2,
        "each slow body counted as a timeout"
    );
}

/// The connections the daemon holds on its listening `port`: sockets among its open files
/// (/proc/PID/fd) that /proc/net/tcp shows on that local port, listener aside. Connections the
/// kernel completed but the daemon has not accepted (the backlog) are not its files yet.
fn held_connections(pid: u32, port: u16) -> usize {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.filter_map(Result::ok)
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy().into_owned();
                    l.strip_prefix("socket:[")
                        .and_then(|r| r.strip_suffix(']'))
                        .map(str::to_owned)
                })
                .collect()
        })
        .unwrap_or_default();
    let port = format!(":{port:04X}");
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter_map(|row| {
            let cols: Vec<&str> = row.split_whitespace().collect();
            (cols.len() > 9
                && cols[1].ends_with(&port)
                && cols[3] != "0A"
                && inodes.contains(cols[9]))
            .then(|| cols[9].to_owned())
        })
        // By inode: the kernel builds the table across several reads, so a socket can be listed
        // twice while other sockets come and go.
        .collect::<std::collections::HashSet<String>>()
        .len()
}

#[test]
fn open_connections_are_bounded_by_max_connections_and_the_rest_wait_their_turn() {
    let max = 16;
    let extra = 8;
    let (_tmp, app) = spawn(&[
        ("HANDOFF_BRIDGE__SERVER__WORKERS", "1"),
        ("HANDOFF_BRIDGE__SERVER__MAX_CONNECTIONS", "16"),
    ]);
    let addr = addr_of(&app);
    let pid = app.pid();
    let port: u16 = addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port");
    assert_eq!(held_connections(pid, port), 0, "nothing connected yet");
    let timeout = Duration::from_secs(1);
    let give_up = Duration::from_secs(30);

    let opened = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let (closed, peak, legit) = std::thread::scope(|s| {
        let clients: Vec<_> = (0..max + extra)
            .map(|_| {
                let (addr, opened, done) = (&addr, &opened, &done);
                s.spawn(move || {
                    let c = slow_client(
                        addr,
                        "/healthz",
                        Slow::Silent,
                        Duration::from_millis(50),
                        give_up,
                        opened,
                    );
                    done.fetch_add(1, Ordering::SeqCst);
                    c
                })
            })
            .collect();
        // The daemon takes connections up to its bound.
        let mut peak = poll_until(
            "the daemon to take max_connections connections",
            Duration::from_secs(10),
            || {
                let held = held_connections(pid, port);
                (held >= max).then_some(held)
            },
        );
        // A fresh request now waits in the backlog until a silent connection times out.
        let legit = s.spawn(|| {
            let started = Instant::now();
            let (status, _) = app.get("/healthz");
            (status, started.elapsed())
        });
        // Watch the count until every silent client saw its close.
        poll_until("every silent connection to close", give_up, || {
            peak = peak.max(held_connections(pid, port));
            (done.load(Ordering::SeqCst) == max + extra).then_some(())
        });
        let closed: Vec<Option<Closed>> = clients
            .into_iter()
            .map(|h| h.join().expect("client"))
            .collect();
        (closed, peak, legit.join().expect("legit request"))
    });

    eprintln!(
        "max_connections {max}: peak {peak} held; a request behind them answered after {:?}",
        legit.1
    );
    assert!(
        peak <= max,
        "{peak} connections held open, over max_connections {max}"
    );
    assert_eq!(
        legit.0, 200,
        "the waiting request is served once a slot frees"
    );
    // An unloaded request takes milliseconds; this one waited for the first slot to free, at
    // the head timeout (less actix's coarse clock).
    assert!(
        legit.1 >= timeout / 4,
        "the request did not wait for a slot: {:?}",
        legit.1
    );
    for (i, c) in closed.iter().enumerate() {
        let c = c
            .as_ref()
            .unwrap_or_else(|| panic!("connection {i} never closed"));
        assert!(
            c.after >= timeout - HEAD_TIMER_SLACK,
            "connection {i} closed after {:?}",
            c.after
        );
    }
    // Those that waited in the backlog got their turn, and their own timeout, later.
    let mut afters: Vec<Duration> = closed.iter().flatten().map(|c| c.after).collect();
    afters.sort();
    assert!(
        afters[afters.len() - 1] >= afters[0] + timeout / 4,
        "no connection waited for a slot: {afters:?}"
    );
}
