//! The body budget's share per route (issue 19's review): a body of unknown length takes the
//! most its route reads, not the most any route reads, and the agent API refuses a claimed
//! `Content-Length` over its 64 KiB at once, without waiting for the body.

use crate::common::agent_api::{spawn_with, TOKEN_NEW, WEB};
use crate::common::poll_until;
use std::io::{Read as _, Write as _};
use std::time::Duration;

/// The agent API on a daemon whose body read timeout is long: an answer that waits for the body
/// would come only after it.
fn daemon(tmp: &std::path::Path) -> crate::common::TestApp {
    spawn_with(
        tmp,
        &tmp.join("data"),
        "\n[server]\nbody_read_timeout = \"60s\"",
        false,
    )
}

fn open(app: &crate::common::TestApp, head: &str) -> std::net::TcpStream {
    let addr = app.base.trim_start_matches("http://").to_owned();
    let mut stream = std::net::TcpStream::connect(&addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    stream
        .write_all(head.replace("{addr}", &addr).as_bytes())
        .expect("head");
    stream
}

#[test]
fn a_chunked_agent_api_body_takes_its_routes_share_and_an_oversized_length_is_413_at_once() {
    let tmp = tempfile::tempdir().expect("tmp");
    let app = daemon(tmp.path());
    let accept = format!("/helpdesk/v1/conversations/{WEB}/accept");

    // A chunked body held open: its share is the agent API's 64 KiB, not the webhook's 8 MiB.
    let mut chunked = open(
        &app,
        &format!(
            "POST {accept} HTTP/1.1\r\nhost: {{addr}}\r\nauthorization: Bearer {TOKEN_NEW}\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n1\r\n{{\r\n"
        ),
    );
    poll_until(
        "the chunked body to take its share",
        Duration::from_secs(10),
        || (app.metric("handoff_inflight_body_bytes") > 0.0).then_some(()),
    );
    assert_eq!(app.metric("handoff_inflight_body_bytes"), 65536.0);
    // It ends: its share is given back.
    chunked.write_all(b"0\r\n\r\n").expect("end");
    let mut answer = [0u8; 64];
    let n = chunked.read(&mut answer).expect("answer");
    // `{` is no command: refused.
    assert!(
        answer[..n].starts_with(b"HTTP/1.1 4"),
        "{}",
        String::from_utf8_lossy(&answer[..n])
    );
    poll_until(
        "the share to be given back",
        Duration::from_secs(10),
        || (app.metric("handoff_inflight_body_bytes") == 0.0).then_some(()),
    );

    // A Content-Length over 64 KiB: 413 before a byte of the body is sent.
    let started = std::time::Instant::now();
    let mut over = open(
        &app,
        &format!(
            "POST {accept} HTTP/1.1\r\nhost: {{addr}}\r\nauthorization: Bearer {TOKEN_NEW}\r\ncontent-type: application/json\r\ncontent-length: 10000000\r\n\r\n"
        ),
    );
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&answer).contains("payload_too_large") {
        match over.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e) => panic!("no answer ({e}) after {:?}", started.elapsed()),
        }
    }
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("payload_too_large"), "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "answered without waiting for the body: {:?}",
        started.elapsed()
    );
}
