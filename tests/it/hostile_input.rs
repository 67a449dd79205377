//! Hostile input stays bounded (issue 19): too many events, deliveries of mostly invalid events,
//! ids the bridge reserves for itself, timestamps far in the future, and the budget on request
//! bodies held in memory. The bounds at the maximum body size are in
//! `tests/process/hostile_bounds.rs`.

use crate::common::{delivery, poll_until, wait_drained, Spawn, TestApp};
use base64::Engine as _;
use serde_json::{json, Value};
use std::time::Duration;

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn bot_updated(id: &str, timestamp: i64) -> Value {
    json!({
        "id": id, "event": "bot.updated", "sourceType": "bot", "sourceId": "Bhostile",
        "timestamp": timestamp, "data": {"bot": {"id": "Bhostile", "name": id}}
    })
}

fn conversation_updated(id: &str, conversation: &str, timestamp: i64, params: Value) -> Value {
    json!({
        "id": id, "event": "bot.conversation.updated", "sourceType": "bot", "sourceId": "Bhostile",
        "timestamp": timestamp,
        "data": {"conversation": {"id": conversation, "botId": "Bhostile", "params": params}}
    })
}

/// An event without the `data.conversation` its type needs: invalid.
fn invalid(id: &str) -> Value {
    json!({
        "id": id, "event": "bot.conversation.updated", "sourceType": "bot", "sourceId": "Bhostile",
        "timestamp": 1, "data": {}
    })
}

/// Every quarantine record with its body: the list (metadata, one page) then each record.
fn quarantine(app: &TestApp) -> Vec<Value> {
    let (status, list) = app.admin_get("/admin/v1/quarantine?limit=1000");
    assert_eq!(status, 200, "{list}");
    assert!(list.get("next_after").is_none(), "one page: {list}");
    list["records"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|meta| {
            let id = meta["id"].as_u64().expect("id");
            let (status, record) = app.admin_get(&format!("/admin/v1/quarantine/{id}"));
            assert_eq!(status, 200, "{record}");
            record
        })
        .collect()
}

fn body_of(record: &Value) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(record["body_base64"].as_str().expect("body_base64"))
        .expect("base64")
}

fn conversation(app: &TestApp, id: &str) -> (u16, Value) {
    app.admin_get(&format!("/admin/v1/conversations/{id}"))
}

#[test]
fn a_delivery_over_max_events_is_one_record_answered_200_and_nothing_is_accepted() {
    let tmp = tempfile::tempdir().expect("tmp");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn::with_env(&[("HANDOFF_BRIDGE__WEBHOOK__MAX_EVENTS", "20")]),
    );
    let events: Vec<Value> = (0..21)
        .map(|i| bot_updated(&format!("many-{i}"), 1_000 + i))
        .collect();
    let body = delivery("d-too-many", &events);
    let (status, receipt) = app.post(&body);
    assert_eq!(status, 200, "{receipt}");
    assert_eq!(receipt["status"], "quarantined", "{receipt}");
    assert_eq!(receipt["reason"], "too_many_events", "{receipt}");
    assert_eq!(
        (
            receipt["accepted"].as_u64(),
            receipt["quarantined"].as_u64()
        ),
        (Some(0), Some(1))
    );
    assert!(
        receipt["detail"]
            .as_str()
            .is_some_and(|d| d.contains("21 events")),
        "{receipt}"
    );
    let list = quarantine(&app);
    assert_eq!(list.len(), 1, "one record: {list:?}");
    assert_eq!(list[0]["scope"], "delivery");
    assert_eq!(list[0]["reason"], "too_many_events");
    assert!(
        body_of(&list[0]) == body,
        "the whole body is kept as received"
    );
    assert_eq!(
        app.metric("handoff_quarantined_total{reason=\"too_many_events\"}"),
        1.0
    );
    wait_drained(&app);
    let (status, answer) = app.admin_get("/admin/v1/events/many-0");
    assert_eq!(status, 404, "no event of it was accepted: {answer}");

    // At the limit the same events are a delivery.
    let (status, receipt) = app.post(&delivery("d-at-limit", &events[..20]));
    assert_eq!(
        (status, receipt["accepted"].as_u64()),
        (200, Some(20)),
        "{receipt}"
    );

    // Re-processing judges with the same limit: still too many, the record stays.
    let id = list[0]["id"].as_u64().expect("id");
    let (status, answer) = app.admin_post(&format!("/admin/v1/quarantine/{id}/reprocess"));
    assert_eq!(status, 409, "{answer}");
    assert!(
        answer["detail"]
            .as_str()
            .is_some_and(|d| d.contains("max_events")),
        "{answer}"
    );
    assert_eq!(quarantine(&app).len(), 1);
}

#[test]
fn a_delivery_s_invalid_events_are_one_record_its_valid_events_accepted_and_it_reprocesses() {
    let tmp = tempfile::tempdir().expect("tmp");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn::with_env(&[("HANDOFF_BRIDGE__ADMIN__TEST_CLOCK", "true")]),
    );
    let now = now_ms();
    let hour = 3_600_000;
    let conv = "c-hostile-mixed";
    // One valid event, two stamped an hour ahead (valid once that hour has come), and three that
    // no time makes valid.
    let mut events = vec![conversation_updated(
        "mixed-ok",
        conv,
        now,
        json!({"v": "now"}),
    )];
    events.push(conversation_updated(
        "mixed-later-1",
        conv,
        now + hour,
        json!({"v": "later"}),
    ));
    events.push(bot_updated("mixed-later-2", now + hour));
    events.extend((0..3).map(|i| invalid(&format!("mixed-bad-{i}"))));
    let body = delivery("d-mixed", &events);
    let (status, receipt) = app.post(&body);
    assert_eq!(status, 200, "{receipt}");
    assert_eq!(receipt["status"], "accepted", "{receipt}");
    assert_eq!(receipt["accepted"], 1, "{receipt}");
    assert_eq!(receipt["quarantined"], 5, "five invalid events: {receipt}");
    let first = receipt["quarantine_id"].as_u64().expect("quarantine id");

    let list = quarantine(&app);
    assert_eq!(list.len(), 1, "one record for the delivery: {list:?}");
    let record = &list[0];
    assert_eq!(record["id"], first);
    assert_eq!(record["scope"], "events");
    assert_eq!(record["reason"], "invalid_event");
    assert_eq!(record["delivery_id"], "d-mixed");
    let detail = record["detail"].as_str().expect("detail");
    assert!(detail.starts_with("5 invalid events; [0] "), "{detail}");
    assert!(detail.contains("max_clock_skew"), "{detail}");
    let kept: Vec<Value> = serde_json::from_slice(&body_of(record)).expect("a JSON array");
    assert_eq!(
        kept,
        events[1..].to_vec(),
        "the invalid events, as sent, in order"
    );
    assert_eq!(app.metric("handoff_quarantine_entries"), 1.0);
    assert_eq!(
        app.metric("handoff_quarantined_total{reason=\"invalid_event\"}"),
        1.0
    );

    // A re-send is a duplicate and makes no second record.
    let (status, receipt) = app.post(&body);
    assert_eq!(
        (status, receipt["status"].as_str()),
        (200, Some("duplicate")),
        "{receipt}"
    );
    assert_eq!(quarantine(&app).len(), 1);

    // Re-processed now: nothing became valid, the record stays.
    let (status, answer) = app.admin_post(&format!("/admin/v1/quarantine/{first}/reprocess"));
    assert_eq!(status, 409, "{answer}");
    assert_eq!(answer["status"], "still_invalid");
    assert!(
        answer["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with("5 events still invalid")),
        "{answer}"
    );

    // Once their hour has come the two are accepted; the three others move to one new record.
    app.advance_clock("2h");
    let (status, answer) = app.admin_post(&format!("/admin/v1/quarantine/{first}/reprocess"));
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["status"], "accepted", "{answer}");
    assert_eq!(answer["accepted"], 2, "{answer}");
    let second = answer["requarantined"].as_u64().expect("the new record");
    let list = quarantine(&app);
    let ids: Vec<u64> = list.iter().filter_map(|r| r["id"].as_u64()).collect();
    assert_eq!(ids, vec![second], "the first record is released");
    let kept: Vec<Value> = serde_json::from_slice(&body_of(&list[0])).expect("array");
    assert_eq!(kept, events[3..].to_vec());
    assert_eq!(list[0]["delivery_id"], "d-mixed");
    assert_eq!(app.metric("handoff_quarantine_entries"), 1.0);
    wait_drained(&app);
    let (status, state) = conversation(&app, conv);
    assert_eq!(status, 200, "{state}");
    assert_eq!(state["params"]["value"], json!({"v": "later"}), "{state}");
    let (status, _) = app.admin_get("/admin/v1/events/mixed-later-2");
    assert_eq!(status, 200, "the re-processed bot event is stored");
}

#[test]
fn ids_the_bridge_reserves_are_quarantined_from_outside() {
    let tmp = tempfile::tempdir().expect("tmp");
    let app = TestApp::spawn_in(&tmp.path().join("data"), Spawn::default());
    let forged = [
        "timer:c1:agent-wait:1763690700000",
        "agent:c1:accept:k1",
        "quarantine:1",
        "reconcile:c1",
    ];
    let mut events: Vec<Value> = forged.iter().map(|id| bot_updated(id, 5)).collect();
    events.push(bot_updated("reserved-fine", 6));
    let (status, receipt) = app.post(&delivery("d-reserved", &events));
    assert_eq!(status, 200, "{receipt}");
    assert_eq!(
        (
            receipt["accepted"].as_u64(),
            receipt["quarantined"].as_u64()
        ),
        (Some(1), Some(4)),
        "{receipt}"
    );
    let list = quarantine(&app);
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["reason"], "invalid_event");
    let detail = list[0]["detail"].as_str().expect("detail");
    assert!(
        detail.contains("reserved for the bridge's own ids"),
        "{detail}"
    );
    wait_drained(&app);
    for id in forged {
        let (status, _) = app.admin_get(&format!("/admin/v1/events/{id}"));
        assert_eq!(status, 404, "{id} was not stored");
    }
    // A delivery id with a reserved prefix (the bridge's own deliveries use them) is refused whole.
    let (status, receipt) = app.post(&delivery("quarantine:2", &[bot_updated("reserved-d", 7)]));
    assert_eq!(status, 200, "{receipt}");
    assert_eq!(receipt["status"], "quarantined", "{receipt}");
    assert_eq!(receipt["reason"], "invalid_format", "{receipt}");
    let (status, _) = app.admin_get("/admin/v1/events/reserved-d");
    assert_eq!(status, 404);
}

#[test]
fn an_event_stamped_a_year_ahead_cannot_win_over_a_later_normal_one() {
    let tmp = tempfile::tempdir().expect("tmp");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn::with_env(&[("HANDOFF_BRIDGE__WEBHOOK__MAX_CLOCK_SKEW", "5m")]),
    );
    let conv = "c-hostile-future";
    let now = now_ms();
    let year = 365 * 24 * 3_600_000_i64;
    let ahead = conversation_updated(
        "future-1",
        conv,
        now + year,
        json!({"v": "from the future"}),
    );
    let (status, receipt) = app.post(&delivery("d-future", &[ahead]));
    assert_eq!(status, 200, "{receipt}");
    assert_eq!(
        (receipt["status"].as_str(), receipt["reason"].as_str()),
        (Some("quarantined"), Some("invalid_event")),
        "{receipt}"
    );
    // Within the skew is fine: a sender's clock a little ahead is normal.
    let normal = conversation_updated("future-2", conv, now + 1_000, json!({"v": "normal"}));
    let (status, receipt) = app.post(&delivery("d-normal", &[normal]));
    assert_eq!(
        (status, receipt["accepted"].as_u64()),
        (200, Some(1)),
        "{receipt}"
    );
    wait_drained(&app);
    let (status, state) = conversation(&app, conv);
    assert_eq!(status, 200, "{state}");
    assert_eq!(state["params"]["value"], json!({"v": "normal"}), "{state}");
    let (status, _) = app.admin_get("/admin/v1/events/future-1");
    assert_eq!(
        status, 404,
        "the future event is in quarantine, not the log"
    );
}

/// Open a webhook request that claims `length` bytes of body and sends only its head.
fn stalled_body(app: &TestApp, length: usize) -> std::net::TcpStream {
    use std::io::Write as _;
    let addr = app.base.trim_start_matches("http://").to_owned();
    let mut stream = std::net::TcpStream::connect(&addr).expect("connect");
    let head = format!(
        "POST /webhook/{} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n\r\n",
        crate::common::WEBHOOK_TOKEN
    );
    stream.write_all(head.as_bytes()).expect("head");
    stream
}

/// Open a connection that sends part of a request head and never the rest, and wait until the
/// daemon cuts it off (`server.client_request_timeout` after it was opened, on the daemon's own
/// clock): whatever the daemon began before the call is then at least that much older.
fn cut_off_head(app: &TestApp, limit: Duration) {
    use std::io::{Read as _, Write as _};
    let addr = app.base.trim_start_matches("http://").to_owned();
    let mut stream = std::net::TcpStream::connect(&addr).expect("connect");
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\n")
        .expect("part of a head");
    stream.set_read_timeout(Some(limit)).expect("read timeout");
    let mut answer = Vec::new();
    // Ends on the daemon's close (EOF, or a reset after its 408); a timeout is a hang.
    if let Err(e) = stream.read_to_end(&mut answer) {
        assert!(
            !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "the daemon did not cut off an unfinished head within {limit:?}"
        );
    }
}

#[test]
fn bodies_over_the_in_flight_budget_wait_then_get_503_with_retry_after() {
    // A budget of one body at the limit. Bodies that never finish arriving hold it: each for
    // the body read timeout, which is also the longest a body waits for room.
    //
    // Every order the test relies on comes from the daemon's own timers and is checked on its
    // gauges and counters, never assumed from how long a step takes. One timeout both ends a
    // stalled body's hold and a waiting body's wait, so a hold and a wait that begin close
    // together end close together, and which ends first is a race. So the second stalled body
    // gets in line only once the daemon has cut off a connection opened after the first took
    // the budget (`server.client_request_timeout`: `CUT_OFF` later, on the daemon's clock): the
    // first's read times out at least `CUT_OFF` before the second would stop waiting. The small
    // body gets in line right after the second and is seen waiting while the first still holds
    // the budget; its wait ends about `READ_TIMEOUT - CUT_OFF` before the second's read does.
    const READ_TIMEOUT: Duration = Duration::from_secs(6);
    const CUT_OFF: Duration = Duration::from_secs(2);
    let tmp = tempfile::tempdir().expect("tmp");
    // Its own process: the test reads the daemon's log.
    let read_timeout = format!("{}s", READ_TIMEOUT.as_secs());
    let cut_off = format!("{}s", CUT_OFF.as_secs());
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            own_process: true,
            ..Spawn::with_env(&[
                ("HANDOFF_BRIDGE__WEBHOOK__MAX_BODY_BYTES", "1048576"),
                ("HANDOFF_BRIDGE__SERVER__MAX_INFLIGHT_BODY_BYTES", "1048576"),
                ("HANDOFF_BRIDGE__SERVER__BODY_READ_TIMEOUT", &read_timeout),
                ("HANDOFF_BRIDGE__SERVER__CLIENT_REQUEST_TIMEOUT", &cut_off),
            ])
        },
    );
    let budget = |outcome: &str| {
        app.metric(&format!(
            "handoff_body_budget_total{{outcome=\"{outcome}\"}}"
        ))
    };
    // Bounds on waits that end on an event: generous, they only turn a hang into a failure.
    let patience = Duration::from_secs(30);
    let mut first = stalled_body(&app, 1_048_576);
    poll_until(
        "the first stalled body to hold the budget",
        patience,
        || (app.metric("handoff_inflight_body_bytes") >= 1_048_576.0).then_some(()),
    );
    cut_off_head(&app, patience);
    // The second waits first in line: it takes the budget when the first's read times out, and
    // holds it for its own read timeout.
    let second = stalled_body(&app, 1_048_576);
    poll_until("the second stalled body to wait", patience, || {
        (app.metric("handoff_body_budget_waiting") == 1.0).then_some(())
    });
    // A caller without the token takes no share and never queues behind them: 401 while the
    // budget is still full, and nothing waited for room, took it or was refused meanwhile (it
    // would otherwise wait in line ahead of real deliveries).
    let wrong = format!("{}/webhook/wrong-token-0123456789", app.base);
    let body = delivery("d-stranger", &[bot_updated("stranger-1", 1)]);
    let (status, answer) = app.post_to(&wrong, &body, Some("application/json"));
    assert_eq!(status, 401, "{answer}");
    assert_eq!(
        (
            app.metric("handoff_body_budget_waiting"),
            budget("waited"),
            budget("refused")
        ),
        (1.0, 0.0, 0.0),
        "answered without waiting for room: only the second body waits, and no room came up"
    );
    // A small body waits behind them, then is refused with a stable code and Retry-After.
    let small = {
        let (agent, url) = (app.agent.clone(), app.webhook_url.clone());
        std::thread::spawn(move || {
            let started = std::time::Instant::now();
            let mut resp = agent
                .post(&url)
                .header("content-type", "application/json")
                .send(delivery("d-budget", &[bot_updated("budget-1", 1)]))
                .expect("POST");
            let waited = started.elapsed();
            let retry_after = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let text = resp.body_mut().read_to_string().expect("body");
            (resp.status().as_u16(), retry_after, text, waited)
        })
    };
    poll_until("the small body to wait behind them", patience, || {
        (app.metric("handoff_body_budget_waiting") == 2.0).then_some(())
    });
    // Both got in line while the first still held the budget: the second is ahead of the small
    // body when room comes up.
    assert_eq!(
        (budget("waited"), budget("refused")),
        (0.0, 0.0),
        "the first stalled body still holds the budget while both wait"
    );
    assert!(!small.is_finished(), "the small body waits for room");
    // Requests without a body are not held back, not even while the budget is full.
    let (status, _) = app.get("/healthz");
    assert_eq!(status, 200);
    let (status, retry_after, text, waited) = small.join().expect("thread");
    assert_eq!(status, 503, "{text}");
    assert_eq!(retry_after.as_deref(), Some("1"));
    let answer: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(answer["error"]["code"], "server_busy", "{answer}");
    assert!(
        waited >= READ_TIMEOUT,
        "it waited for room as long as a body may: {waited:?}"
    );
    // The first's read timed out, which gave the second its room; the second holds the whole
    // budget still, and nothing waits any more.
    assert_eq!(
        (budget("refused"), budget("waited")),
        (1.0, 1.0),
        "the small body was refused, the second body waited and got in"
    );
    assert_eq!(app.metric("handoff_body_budget_waiting"), 0.0);
    assert_eq!(app.metric("handoff_inflight_body_bytes"), 1_048_576.0);
    {
        use std::io::Read as _;
        first
            .set_read_timeout(Some(patience))
            .expect("read timeout");
        let mut head = [0u8; 12];
        first
            .read_exact(&mut head)
            .expect("the first body's answer");
        assert_eq!(
            &head,
            b"HTTP/1.1 408",
            "the first body's read timed out: {}",
            String::from_utf8_lossy(&head)
        );
    }
    // The stalled connections end, which ends their reads and gives their shares back.
    drop((first, second));
    poll_until("the budget to be free", patience, || {
        (app.metric("handoff_inflight_body_bytes") == 0.0).then_some(())
    });
    let (status, receipt) = app.post(&delivery("d-budget-2", &[bot_updated("budget-2", 1)]));
    assert_eq!(
        (status, receipt["accepted"].as_u64()),
        (200, Some(1)),
        "{receipt}"
    );
    let logs = app.logs();
    assert!(
        logs.contains("request body refused"),
        "the refusal is logged"
    );
    // By its route, never its path: the webhook's path holds the token.
    assert!(
        logs.contains("/webhook/{token}"),
        "the refusal names the route: {logs}"
    );
    assert!(
        !logs.contains(crate::common::WEBHOOK_TOKEN),
        "no webhook token in the log: {logs}"
    );
}

#[test]
fn a_body_waits_for_room_and_is_then_accepted() {
    let tmp = tempfile::tempdir().expect("tmp");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn::with_env(&[
            ("HANDOFF_BRIDGE__WEBHOOK__MAX_BODY_BYTES", "1048576"),
            ("HANDOFF_BRIDGE__SERVER__MAX_INFLIGHT_BODY_BYTES", "1048576"),
            ("HANDOFF_BRIDGE__SERVER__BODY_READ_TIMEOUT", "20s"),
        ]),
    );
    let addr = app.base.trim_start_matches("http://").to_owned();
    let body = delivery("d-slow", &[bot_updated("slow-1", 1)]);
    let mut slow = std::net::TcpStream::connect(&addr).expect("connect");
    use std::io::{Read as _, Write as _};
    // It claims the whole budget but sends only its first byte, for now.
    let head = format!(
        "POST /webhook/{} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        crate::common::WEBHOOK_TOKEN,
        1_048_576
    );
    let mut padded = body.clone();
    padded.resize(1_048_576, b' ');
    slow.write_all(head.as_bytes()).expect("head");
    slow.write_all(&padded[..1]).expect("first byte");
    poll_until(
        "the slow body to hold the budget",
        Duration::from_secs(10),
        || (app.metric("handoff_inflight_body_bytes") >= 1_048_576.0).then_some(()),
    );
    let waiting = {
        let (agent, url) = (app.agent.clone(), app.webhook_url.clone());
        std::thread::spawn(move || {
            let mut resp = agent
                .post(&url)
                .header("content-type", "application/json")
                .send(delivery("d-waits", &[bot_updated("waits-1", 1)]))
                .expect("POST");
            let text = resp.body_mut().read_to_string().unwrap_or_default();
            (resp.status().as_u16(), text)
        })
    };
    poll_until("the second body to wait", Duration::from_secs(10), || {
        (app.metric("handoff_body_budget_waiting") == 1.0).then_some(())
    });
    assert!(!waiting.is_finished());
    // The slow body arrives: it is answered, and the waiting one gets in.
    slow.write_all(&padded[1..]).expect("rest");
    let mut answer = String::new();
    slow.read_to_string(&mut answer).expect("answer");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let (status, text) = waiting.join().expect("thread");
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        app.metric("handoff_body_budget_total{outcome=\"waited\"}"),
        1.0
    );
    assert_eq!(
        app.metric("handoff_body_budget_total{outcome=\"refused\"}"),
        0.0
    );
}
