//! Bad input gets its documented answer and leaves the store as it was (quarantine aside):
//! 401 for a missing or wrong token, 200 + quarantine for authenticated bodies that are not valid
//! deliveries, 413 for oversized bodies, JSON 404/405 for wrong paths and methods. Quarantined
//! bodies can be inspected and re-processed.

use crate::common::*;
use base64::Engine;
use serde_json::{json, Value};
use std::io::{Read, Write};

const CONV1: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
const CONV2: &str = "5c0e9b1f-2222-4d3e-9f10-000000000002";

/// What must not change: the CLI's view of the known state, and how many events were folded.
struct Baseline {
    views: Vec<String>,
    applied: f64,
    accepted_events: f64,
}

fn views(app: &TestApp) -> Vec<String> {
    vec![
        app.cli_ok(&["state", "show", CONV1]),
        app.cli_ok(&["state", "show", CONV2]),
        app.cli_ok(&[
            "state",
            "find",
            "--platform",
            "web",
            "--user-key",
            "web-visitor-8841",
        ]),
    ]
}

fn accepted_events(app: &TestApp) -> f64 {
    let (_, text) = app.admin_get_text("/metrics");
    text.lines()
        .filter(|l| l.starts_with("handoff_webhook_events_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Load every fixture and wait until it is folded; return what must stay the same.
fn baseline(app: &TestApp) -> Baseline {
    for (name, body) in fixtures() {
        let (status, receipt) = app.post(&body);
        assert_eq!(
            (status, receipt["status"].as_str()),
            (200, Some("accepted")),
            "{name}: {receipt}"
        );
    }
    wait_drained(app);
    let b = Baseline {
        views: views(app),
        applied: app.metric("handoff_events_applied_total"),
        accepted_events: accepted_events(app),
    };
    assert_eq!(b.applied, 19.0);
    assert_eq!(b.accepted_events, 19.0);
    b
}

fn assert_unchanged(app: &TestApp, base: &Baseline, case: &str) {
    wait_drained(app);
    assert_eq!(
        app.metric("handoff_events_applied_total"),
        base.applied,
        "{case}: an event was folded"
    );
    assert_eq!(
        accepted_events(app),
        base.accepted_events,
        "{case}: an event was accepted"
    );
    assert_eq!(app.metric("handoff_inbox_depth"), 0.0, "{case}");
    let now = views(app);
    for (b, a) in base.views.iter().zip(&now) {
        assert_eq!(b, a, "{case}: state changed");
    }
}

/// Every quarantine record with its body: the list (metadata, one page) then each record.
fn quarantine(app: &TestApp) -> Vec<Value> {
    let (status, list) = app.admin_get("/admin/v1/quarantine?limit=1000");
    assert_eq!(status, 200, "{list}");
    assert!(list.get("next_after").is_none(), "one page: {list}");
    list["records"]
        .as_array()
        .expect("quarantine list has records")
        .iter()
        .map(|meta| {
            let id = meta["id"].as_u64().expect("id");
            let (status, record) = app.admin_get(&format!("/admin/v1/quarantine/{id}"));
            assert_eq!(status, 200, "{record}");
            assert_eq!(record["body_bytes"], meta["body_bytes"], "{record}");
            record
        })
        .collect()
}

fn decode_body(record: &Value) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(record["body_base64"].as_str().expect("body_base64"))
        .expect("base64 body")
}

fn assert_error_body(body: &Value, code: &str, what: &str) {
    assert_eq!(body["error"]["code"], code, "{what}: {body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{what}: {body}"
    );
    assert_eq!(
        body.as_object().map(|o| o.len()),
        Some(1),
        "{what}: only `error` at top level: {body}"
    );
    assert_eq!(
        body["error"].as_object().map(|o| o.len()),
        Some(2),
        "{what}: error has code and message: {body}"
    );
}

fn event(id: &str, kind: &str, timestamp: Value, data: Value) -> Value {
    json!({"id": id, "event": kind, "sourceType": "bot", "sourceId": "B7f3a2c", "timestamp": timestamp, "data": data})
}

/// A conversation.updated for CONV1 that, if it were applied, would visibly change its state.
fn rogue_update(id: &str) -> Value {
    let mut e = fixture_value("conversation-updated.json")["messages"][0].clone();
    e["id"] = json!(id);
    e["timestamp"] = json!(1763699999999_i64);
    e["data"]["conversation"]["params"] = json!({"name": "rogue"});
    e["data"]["conversation"]["navigation"] = json!({"current": {"flowId": 99, "nodeId": 99}});
    e
}

fn deep_array(depth: usize) -> String {
    format!("{}{}", "[".repeat(depth), "]".repeat(depth))
}

fn deep_object(depth: usize) -> String {
    format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth))
}

fn raw_delivery(id: &str, events_json: &str) -> Vec<u8> {
    format!(r#"{{"id":"{id}","webhookId":"w","webhookUrl":"u","messages":[{events_json}]}}"#)
        .into_bytes()
}

struct Case {
    name: &'static str,
    body: Vec<u8>,
    content_type: Option<&'static str>,
    /// Acceptable reason codes (one, except where the parser may legitimately report either).
    reasons: &'static [&'static str],
    /// `delivery` (the whole body) or `event` (one event of the delivery).
    scope: &'static str,
    /// For event-scope records: the event that must be what was kept.
    event: Option<Value>,
}

fn delivery_case(name: &'static str, body: Vec<u8>, reason: &'static [&'static str]) -> Case {
    Case {
        name,
        body,
        content_type: Some("application/json"),
        reasons: reason,
        scope: "delivery",
        event: None,
    }
}

fn event_case(name: &'static str, delivery_id: &str, bad: Value) -> Case {
    Case {
        name,
        body: delivery(delivery_id, std::slice::from_ref(&bad)),
        content_type: Some("application/json"),
        reasons: &["invalid_event"],
        scope: "event",
        event: Some(bad),
    }
}

fn bad_cases() -> Vec<Case> {
    let fixture = fixture_bytes("message-received-text.json");
    let mut wrong_type_ts = rogue_update("bad00000-0000-4000-8000-000000000001");
    wrong_type_ts["timestamp"] = json!("1763699999999");
    let mut no_source = rogue_update("bad00000-0000-4000-8000-000000000002");
    no_source
        .as_object_mut()
        .expect("object")
        .remove("sourceId");
    let mut no_event_type = rogue_update("bad00000-0000-4000-8000-000000000003");
    no_event_type
        .as_object_mut()
        .expect("object")
        .remove("event");
    let mut empty_id = rogue_update("");
    empty_id["data"]["conversation"]["params"] = json!({"name": "rogue-empty-id"});
    let mut id_number = rogue_update("x");
    id_number["id"] = json!(12345);
    let mut no_conversation = rogue_update("bad00000-0000-4000-8000-000000000004");
    no_conversation["data"] = json!({"message": {"id": "m", "conversationId": CONV1, "isUser": true, "data": {"type": "text"}}});
    let mut message_no_conv = fixture_value("message-received-text.json")["messages"][0].clone();
    message_no_conv["id"] = json!("bad00000-0000-4000-8000-000000000005");
    message_no_conv["data"]["message"]
        .as_object_mut()
        .expect("object")
        .remove("conversationId");
    let mut message_is_user_string =
        fixture_value("message-received-text.json")["messages"][0].clone();
    message_is_user_string["id"] = json!("bad00000-0000-4000-8000-000000000006");
    message_is_user_string["data"]["message"]["isUser"] = json!("yes");
    let deep_params = format!(
        r#"{{"id":"bad00000-0000-4000-8000-000000000007","event":"bot.conversation.updated","sourceType":"bot","sourceId":"B7f3a2c","timestamp":1763699999999,"data":{{"conversation":{{"id":"{CONV1}","params":{{"x":{}}}}}}}}}"#,
        deep_array(10_000)
    );
    let deep_unknown = format!(
        r#"{{"id":"bad00000-0000-4000-8000-000000000008","event":"bot.brand_new","sourceType":"bot","sourceId":"B7f3a2c","timestamp":1763699999999,"data":{}}}"#,
        deep_object(10_000)
    );

    vec![
        delivery_case("malformed JSON", b"{not json".to_vec(), &["invalid_json"]),
        delivery_case(
            "truncated JSON",
            fixture[..fixture.len() / 2].to_vec(),
            &["invalid_json"],
        ),
        delivery_case("empty body", Vec::new(), &["invalid_json"]),
        delivery_case(
            "not UTF-8",
            b"\xff\xfe{\"id\":1}".to_vec(),
            &["invalid_json"],
        ),
        delivery_case(
            "id as number",
            br#"{"id":5,"webhookId":"w","webhookUrl":"u","messages":[]}"#.to_vec(),
            &["invalid_format"],
        ),
        delivery_case(
            "id missing",
            br#"{"webhookId":"w","webhookUrl":"u","messages":[{}]}"#.to_vec(),
            &["invalid_format"],
        ),
        delivery_case(
            "id empty",
            br#"{"id":" ","webhookId":"w","webhookUrl":"u","messages":[{}]}"#.to_vec(),
            &["invalid_format"],
        ),
        delivery_case(
            "messages missing",
            br#"{"id":"d-nomsg","webhookId":"w","webhookUrl":"u"}"#.to_vec(),
            &["invalid_format"],
        ),
        delivery_case(
            "messages not an array",
            br#"{"id":"d-obj","webhookId":"w","webhookUrl":"u","messages":{}}"#.to_vec(),
            &["invalid_format"],
        ),
        delivery_case(
            "body is a string",
            br#""hello""#.to_vec(),
            &["invalid_format"],
        ),
        delivery_case(
            "empty messages",
            br#"{"id":"d-empty","webhookId":"w","webhookUrl":"u","messages":[]}"#.to_vec(),
            &["empty_batch"],
        ),
        delivery_case(
            "10,000-deep array",
            deep_array(10_000).into_bytes(),
            &["invalid_format", "invalid_json"],
        ),
        delivery_case(
            "10,000-deep object",
            deep_object(10_000).into_bytes(),
            &["invalid_format", "invalid_json"],
        ),
        event_case("timestamp as string", "d-ts-string", wrong_type_ts),
        event_case("sourceId missing", "d-no-source", no_source),
        event_case("event type missing", "d-no-type", no_event_type),
        event_case("event id empty", "d-empty-id", empty_id),
        event_case("event id as number", "d-id-number", id_number),
        event_case(
            "data.conversation missing",
            "d-no-conversation",
            no_conversation,
        ),
        event_case(
            "message without conversationId",
            "d-msg-no-conv",
            message_no_conv,
        ),
        event_case(
            "isUser as string",
            "d-isuser-string",
            message_is_user_string,
        ),
        event_case("event is not an object", "d-event-number", json!(42)),
        Case {
            name: "10,000-deep nesting in an event's params",
            body: raw_delivery("d-deep-params", &deep_params),
            content_type: Some("application/json"),
            reasons: &["invalid_event"],
            scope: "event",
            event: None,
        },
        Case {
            name: "10,000-deep nesting in an unknown event's data",
            body: raw_delivery("d-deep-unknown", &deep_unknown),
            content_type: Some("application/json"),
            reasons: &["invalid_event"],
            scope: "event",
            event: None,
        },
        Case {
            name: "valid delivery as text/plain",
            body: fixture_bytes("message-received-text.json"),
            content_type: Some("text/plain"),
            reasons: &["unsupported_content_type"],
            scope: "delivery",
            event: None,
        },
        Case {
            name: "valid delivery as form data",
            body: fixture_bytes("conversation-updated.json"),
            content_type: Some("application/x-www-form-urlencoded"),
            reasons: &["unsupported_content_type"],
            scope: "delivery",
            event: None,
        },
        Case {
            name: "valid delivery without content type",
            body: fixture_bytes("agent-call-connected.json"),
            content_type: None,
            reasons: &["unsupported_content_type"],
            scope: "delivery",
            event: None,
        },
    ]
}

#[test]
fn authenticated_bad_bodies_are_quarantined_and_change_nothing() {
    let app = TestApp::spawn();
    let base = baseline(&app);
    let cases = bad_cases();
    let mut expected_ids: Vec<u64> = Vec::new();
    for case in &cases {
        let (status, receipt) = app.post_to(&app.webhook_url, &case.body, case.content_type);
        let name = case.name;
        assert_eq!(status, 200, "{name}: {receipt}");
        assert_eq!(receipt["status"], "quarantined", "{name}: {receipt}");
        let reason = receipt["reason"]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: no reason: {receipt}"));
        assert!(
            case.reasons.contains(&reason),
            "{name}: reason {reason}, expected one of {:?}",
            case.reasons
        );
        assert_eq!(receipt["accepted"], 0, "{name}: {receipt}");
        assert_eq!(receipt["quarantined"], 1, "{name}: {receipt}");
        let qid = receipt["quarantine_id"]
            .as_u64()
            .unwrap_or_else(|| panic!("{name}: no quarantine_id: {receipt}"));
        assert!(
            !expected_ids.contains(&qid),
            "{name}: quarantine id {qid} reused"
        );
        expected_ids.push(qid);

        assert_unchanged(&app, &base, name);

        // The quarantine holds exactly the records so far, the newest being this body.
        let list = quarantine(&app);
        let ids: Vec<u64> = list.iter().map(|r| r["id"].as_u64().expect("id")).collect();
        assert_eq!(ids, expected_ids, "{name}: quarantine contents");
        let record = list.last().expect("record");
        assert_eq!(record["reason"], reason, "{name}");
        assert_eq!(record["scope"], case.scope, "{name}: {record}");
        match case.content_type {
            Some(ct) => assert_eq!(record["content_type"], ct, "{name}: {record}"),
            None => assert!(
                record["content_type"].is_null() || record["content_type"] == "",
                "{name}: {record}"
            ),
        }
        let kept = decode_body(record);
        match case.scope {
            "delivery" => assert!(
                kept == case.body,
                "{name}: the quarantined body is the body as received"
            ),
            _ => {
                assert!(receipt["delivery_id"].is_string(), "{name}: {receipt}");
                assert_eq!(
                    record["delivery_id"], receipt["delivery_id"],
                    "{name}: {record}"
                );
                if let Some(ev) = &case.event {
                    let kept: Value = serde_json::from_slice(&kept).expect("kept event is JSON");
                    assert_eq!(
                        &kept, ev,
                        "{name}: the quarantined event is the event as sent"
                    );
                }
            }
        }
    }

    // Metrics agree with the receipts.
    assert_eq!(
        app.metric("handoff_webhook_deliveries_total{outcome=\"quarantined\"}"),
        cases.len() as f64
    );
    assert_eq!(app.metric("handoff_quarantine_entries"), cases.len() as f64);
    let list = quarantine(&app);
    for reason in [
        "invalid_json",
        "invalid_format",
        "empty_batch",
        "invalid_event",
        "unsupported_content_type",
    ] {
        let n = list.iter().filter(|r| r["reason"] == reason).count();
        assert!(n > 0, "no case produced {reason}");
        assert_eq!(
            app.metric(&format!("handoff_quarantined_total{{reason=\"{reason}\"}}")),
            n as f64,
            "{reason}"
        );
    }

    // The CLI lists the same records (through the admin API while the daemon runs).
    let cli_list: Value =
        serde_json::from_str(&app.cli_ok(&["quarantine", "list"])).expect("CLI JSON");
    let cli_ids: Vec<u64> = cli_list
        .as_array()
        .expect("array")
        .iter()
        .map(|r| r["id"].as_u64().expect("id"))
        .collect();
    assert_eq!(cli_ids, expected_ids);
    for (cli_record, admin_record) in cli_list.as_array().expect("array").iter().zip(&list) {
        for key in [
            "reason",
            "scope",
            "detail",
            "delivery_id",
            "content_type",
            "body_bytes",
            "received_at",
        ] {
            assert_eq!(
                cli_record[key], admin_record[key],
                "CLI and admin API differ on {key}"
            );
        }
    }
}

#[test]
fn missing_or_wrong_token_is_401_and_nothing_is_stored() {
    let app = TestApp::spawn();
    let base = baseline(&app);
    // A body that would be accepted if authentication were skipped.
    let mut ev = fixture_value("agent-call-connected.json")["messages"][0].clone();
    ev["id"] = json!("a0700000-0000-4000-8000-000000000001");
    ev["timestamp"] = json!(1763699999999_i64);
    let body = delivery("a0700000-0000-4000-8000-0000000000d1", &[ev]);
    let urls = [
        format!("{}/webhook", app.base),
        format!("{}/webhook/", app.base),
        format!("{}/webhook/wrong-token-0123456789", app.base),
        format!("{}/webhook/{}x", app.base, WEBHOOK_TOKEN),
        format!("{}/webhook?token=wrong-token-0123456789", app.base),
        format!("{}/webhook/wrong-token-0123456789?token=", app.base),
    ];
    for url in &urls {
        let (status, answer) = app.post_to(url, &body, Some("application/json"));
        let shown = url.replace(&app.base, "");
        assert_eq!(status, 401, "{shown}: {answer}");
        assert_error_body(&answer, "unauthorized", &shown);
    }
    assert_eq!(
        app.metric("handoff_webhook_deliveries_total{outcome=\"unauthorized\"}"),
        urls.len() as f64
    );
    assert_unchanged(&app, &base, "unauthenticated deliveries");
    assert!(
        quarantine(&app).is_empty(),
        "unauthenticated bodies are not quarantined"
    );
    let (status, _) = app.admin_get("/admin/v1/events/a0700000-0000-4000-8000-000000000001");
    assert_eq!(status, 404, "the event was not stored");

    // Control: the token as path segment or as query parameter is accepted.
    let (status, receipt) = app.post_to(
        &format!("{}/webhook?token={WEBHOOK_TOKEN}", app.base),
        &body,
        Some("application/json"),
    );
    assert_eq!(
        (status, receipt["status"].as_str()),
        (200, Some("accepted")),
        "{receipt}"
    );
}

#[test]
fn wrong_methods_and_unknown_paths_answer_json_errors() {
    let app = TestApp::spawn();
    let base = baseline(&app);
    let (status, text) = app.get(&format!("/webhook/{WEBHOOK_TOKEN}"));
    assert_eq!(status, 405, "{text}");
    assert_error_body(
        &serde_json::from_str(&text).expect("JSON 405"),
        "method_not_allowed",
        "GET webhook",
    );
    let (status, text) = app.get("/webhook");
    assert_eq!(status, 405, "{text}");
    assert_error_body(
        &serde_json::from_str(&text).expect("JSON 405"),
        "method_not_allowed",
        "GET webhook without token",
    );
    let mut resp = app
        .agent
        .put(format!("{}/webhook/{WEBHOOK_TOKEN}", app.base))
        .header("content-type", "application/json")
        .send(&fixture_bytes("bot-updated.json")[..])
        .expect("PUT");
    assert_eq!(resp.status().as_u16(), 405);
    let text = resp.body_mut().read_to_string().expect("body");
    assert_error_body(
        &serde_json::from_str(&text).expect("JSON 405"),
        "method_not_allowed",
        "PUT webhook",
    );

    for path in ["/nope", "/webhooks", "/admin/v2/quarantine"] {
        let (status, text) = app.get(path);
        assert_eq!(status, 404, "{path}: {text}");
        assert_error_body(
            &serde_json::from_str(&text).expect("JSON 404"),
            "not_found",
            path,
        );
    }
    let (status, answer) = app.post_to(
        &format!("{}/nope", app.base),
        &fixture_bytes("bot-updated.json"),
        Some("application/json"),
    );
    assert_eq!(status, 404);
    assert_error_body(&answer, "not_found", "POST /nope");
    let (status, answer) = app.admin_get("/admin/v1/nope");
    assert_eq!(status, 404);
    assert_error_body(&answer, "not_found", "admin /nope");
    let (status, text) = app.admin_get_text("/admin/v1/quarantine");
    assert_eq!(status, 401, "{text}");
    assert_error_body(
        &serde_json::from_str(&text).expect("JSON 401"),
        "unauthorized",
        "admin without token",
    );

    assert_unchanged(&app, &base, "wrong methods and paths");
    assert!(quarantine(&app).is_empty());
    assert_eq!(
        app.metric("handoff_webhook_deliveries_total{outcome=\"accepted\"}"),
        18.0
    );
}

/// Outcome of sending an oversized body: the 413 answer, or a transport error (the daemon may
/// answer and close before the client finished sending).
fn assert_too_large(result: Result<(u16, Value), String>, what: &str) -> bool {
    match result {
        Ok((status, body)) => {
            assert_eq!(status, 413, "{what}: {body}");
            assert_error_body(&body, "payload_too_large", what);
            true
        }
        Err(e) => {
            eprintln!("{what}: transport error (accepted only with the too_large metric): {e}");
            false
        }
    }
}

/// A valid one-event delivery padded with trailing whitespace to exactly `size` bytes.
fn padded_delivery(id_suffix: &str, size: usize) -> (Vec<u8>, String) {
    let mut ev = fixture_value("message-received-text.json")["messages"][0].clone();
    let event_id = format!("5123e000-0000-4000-8000-{id_suffix:0>12}");
    ev["id"] = json!(event_id);
    let mut body = delivery(&format!("5123d000-0000-4000-8000-{id_suffix:0>12}"), &[ev]);
    assert!(body.len() <= size, "delivery already larger than {size}");
    body.resize(size, b' ');
    (body, event_id)
}

#[test]
fn a_body_over_the_default_8_mib_limit_is_413() {
    let app = TestApp::spawn();
    let base = baseline(&app);
    let (body, event_id) = padded_delivery("1", 8 * 1024 * 1024 + 1);
    let answered = assert_too_large(
        app.try_post_to(&app.webhook_url, &body, Some("application/json")),
        "8 MiB + 1",
    );
    assert_eq!(
        app.metric("handoff_webhook_deliveries_total{outcome=\"too_large\"}"),
        1.0,
        "answered with 413: {answered}"
    );
    assert_unchanged(&app, &base, "oversized body");
    assert!(
        quarantine(&app).is_empty(),
        "oversized bodies are not quarantined"
    );
    let (status, _) = app.admin_get(&format!("/admin/v1/events/{event_id}"));
    assert_eq!(status, 404);
}

/// Send `body` with chunked transfer encoding (no content-length) over a raw connection; returns
/// the status code, or None when the connection was cut.
fn post_chunked(app: &TestApp, body: &[u8]) -> Option<(u16, String)> {
    let addr = app.base.strip_prefix("http://").expect("http base");
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(15)))
        .expect("timeout");
    stream
        .set_write_timeout(Some(std::time::Duration::from_secs(15)))
        .expect("timeout");
    let head = format!(
        "POST /webhook/{WEBHOOK_TOKEN} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    let mut sent = stream.write_all(head.as_bytes()).is_ok();
    for chunk in body.chunks(512) {
        if !sent {
            break;
        }
        sent = stream
            .write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
            .is_ok()
            && stream.write_all(chunk).is_ok()
            && stream.write_all(b"\r\n").is_ok();
    }
    let _ = stream.write_all(b"0\r\n\r\n");
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

#[test]
fn a_configured_small_limit_is_enforced_at_the_exact_boundary() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spawn = Spawn {
        env: vec![(
            "HANDOFF_BRIDGE__WEBHOOK__MAX_BODY_BYTES".into(),
            "2048".into(),
        )],
        ..Spawn::default()
    };
    let app = TestApp::spawn_in(&tmp.path().join("data"), spawn);
    let (status, _) = app.admin_get("/admin/v1/inbox/drained");
    assert_eq!(status, 200);
    let too_large = || app.metric("handoff_webhook_deliveries_total{outcome=\"too_large\"}");

    // Exactly at the limit: accepted.
    let (at_limit, at_limit_event) = padded_delivery("2", 2048);
    let (status, receipt) = app.post(&at_limit);
    assert_eq!(
        (status, receipt["status"].as_str()),
        (200, Some("accepted")),
        "{receipt}"
    );
    wait_drained(&app);
    let before = app.cli_ok(&["state", "show", CONV1]);
    let applied = app.metric("handoff_events_applied_total");
    assert_eq!(applied, 1.0);
    let (status, _) = app.admin_get(&format!("/admin/v1/events/{at_limit_event}"));
    assert_eq!(status, 200);

    // One byte over, with a content-length: refused before the body is read.
    let (over, over_event) = padded_delivery("3", 2049);
    let answered = assert_too_large(
        app.try_post_to(&app.webhook_url, &over, Some("application/json")),
        "2049 bytes",
    );
    assert_eq!(too_large(), 1.0, "answered with 413: {answered}");

    // Over the limit without a content-length (chunked): cut off while reading.
    let (chunked, chunked_event) = padded_delivery("4", 4096);
    match post_chunked(&app, &chunked) {
        Some((status, body)) => {
            assert_eq!(status, 413, "{body}");
            let body: Value = serde_json::from_str(&body)
                .unwrap_or_else(|e| panic!("413 body is not JSON ({e}): {body}"));
            assert_error_body(&body, "payload_too_large", "chunked");
        }
        None => eprintln!("chunked: connection cut (accepted only with the too_large metric)"),
    }
    assert_eq!(too_large(), 2.0);

    wait_drained(&app);
    assert_eq!(app.metric("handoff_events_applied_total"), applied);
    assert_eq!(app.cli_ok(&["state", "show", CONV1]), before);
    for id in [over_event, chunked_event] {
        let (status, _) = app.admin_get(&format!("/admin/v1/events/{id}"));
        assert_eq!(status, 404, "{id} must not be stored");
    }
    assert!(quarantine(&app).is_empty());
}

#[test]
fn unknown_event_types_and_platforms_are_accepted_and_counted() {
    let app = TestApp::spawn();
    let events = vec![
        event(
            "0e000000-0000-4000-8000-000000000001",
            "bot.something.new",
            json!(1763690500000_i64),
            json!({"weird": [1, 2, {"x": null}]}),
        ),
        event(
            "0e000000-0000-4000-8000-000000000002",
            "bot.end_user.created",
            json!(1763690500001_i64),
            json!({"endUser": {"id": "4e6f0d0a-1111-4a5b-8c9d-0000000000f1", "botId": "B7f3a2c", "platform": "telegram", "userKey": "tg-42", "params": {"lang": "ko"}}}),
        ),
        event(
            "0e000000-0000-4000-8000-000000000003",
            "bot.conversation.created",
            json!(1763690500002_i64),
            json!({"conversation": {"id": "5c0e9b1f-2222-4d3e-9f10-0000000000f1", "botId": "B7f3a2c", "endUserId": "4e6f0d0a-1111-4a5b-8c9d-0000000000f1", "platform": "telegram", "userKey": "tg-42", "params": {}, "navigation": {}}}),
        ),
        event(
            "0e000000-0000-4000-8000-000000000004",
            "bot.message.received",
            json!(1763690500003_i64),
            json!({"message": {"id": "m-sticker", "conversationId": "5c0e9b1f-2222-4d3e-9f10-0000000000f1", "isUser": true, "meta": null, "data": {"type": "sticker", "sticker": {"id": 7}}}}),
        ),
    ];
    let (status, receipt) = app.post(&delivery("0e00d000-0000-4000-8000-000000000001", &events));
    assert_eq!(status, 200, "{receipt}");
    assert_eq!(receipt["status"], "accepted", "{receipt}");
    assert_eq!(receipt["accepted"], 4, "{receipt}");
    assert_eq!(receipt["quarantined"], 0, "{receipt}");
    wait_drained(&app);
    assert_eq!(
        app.metric("handoff_webhook_events_total{type=\"other\"}"),
        1.0
    );
    assert_eq!(
        app.metric("handoff_webhook_events_total{type=\"bot.end_user.created\"}"),
        1.0
    );
    assert_eq!(
        app.metric("handoff_webhook_unknown_platform_events_total"),
        2.0
    );
    assert_eq!(app.metric("handoff_events_applied_total"), 4.0);
    assert_eq!(
        app.metric("handoff_state_entries{kind=\"bots\"}"),
        1.0,
        "the unknown event is attributed to its bot"
    );
    assert!(quarantine(&app).is_empty());

    let found: Value = serde_json::from_str(&app.cli_ok(&[
        "state",
        "find",
        "--platform",
        "telegram",
        "--user-key",
        "tg-42",
    ]))
    .expect("JSON");
    assert_eq!(found["endUser"]["platform"], "telegram");
    assert_eq!(found["endUser"]["params"]["value"], json!({"lang": "ko"}));
    assert_eq!(
        found["lastConversation"]["id"],
        "5c0e9b1f-2222-4d3e-9f10-0000000000f1"
    );
    assert_eq!(found["lastConversation"]["platform"], "telegram");
    assert_eq!(
        found["lastConversation"]["messages"]["user_messages"], 1,
        "an unknown message type still counts"
    );
    let (status, ev) = app.admin_get("/admin/v1/events/0e000000-0000-4000-8000-000000000001");
    assert_eq!(status, 200);
    assert_eq!(ev["record"]["kind"], "bot.something.new");
    assert_eq!(ev["record"]["partition"], "b:B7f3a2c");
    assert_eq!(ev["pending"], false);
}

#[test]
fn quarantine_show_and_reprocess() {
    let app = TestApp::spawn();
    let base = baseline(&app);

    // A valid delivery of a conversation the store does not know yet, sent as text/plain.
    let mut valid = fixture_value("agent-call-requested.json");
    let new_conv = "5c0e9b1f-2222-4d3e-9f10-0000000000a1";
    valid["id"] = json!("9e000000-0000-4000-8000-0000000000d1");
    valid["messages"][0]["id"] = json!("9e000000-0000-4000-8000-000000000001");
    valid["messages"][0]["data"]["conversation"]["id"] = json!(new_conv);
    let valid_body = serde_json::to_vec_pretty(&valid).expect("json");
    // A fixture the store already holds, sent as text/plain: valid, but a duplicate.
    let dup_body = fixture_bytes("bot-updated.json");
    // Invalid under any rules: bad JSON, and an event whose timestamp is a string.
    let junk = b"{\"id\": \"9e00d\", \"messages\": [".to_vec();
    let mut bad_event = rogue_update("9e000000-0000-4000-8000-000000000002");
    bad_event["timestamp"] = json!("yesterday");
    let bad_event_body = delivery(
        "9e000000-0000-4000-8000-0000000000d2",
        std::slice::from_ref(&bad_event),
    );

    let mut ids = Vec::new();
    for (body, ct, reason) in [
        (&valid_body, "text/plain", "unsupported_content_type"),
        (
            &dup_body,
            "text/plain; charset=utf-8",
            "unsupported_content_type",
        ),
        (&junk, "application/json", "invalid_json"),
        (&bad_event_body, "application/json", "invalid_event"),
    ] {
        let (status, receipt) = app.post_to(&app.webhook_url, body, Some(ct));
        assert_eq!(
            (
                status,
                receipt["status"].as_str(),
                receipt["reason"].as_str()
            ),
            (200, Some("quarantined"), Some(reason)),
            "{receipt}"
        );
        ids.push(receipt["quarantine_id"].as_u64().expect("quarantine id"));
    }
    assert_unchanged(&app, &base, "quarantining");
    let [valid_id, dup_id, junk_id, bad_event_id] = ids[..] else {
        panic!("four ids")
    };
    assert_eq!(app.metric("handoff_quarantine_entries"), 4.0);

    // show: the record with its body.
    let shown: Value =
        serde_json::from_str(&app.cli_ok(&["quarantine", "show", &valid_id.to_string()]))
            .expect("JSON");
    assert_eq!(shown["id"], valid_id);
    assert_eq!(shown["reason"], "unsupported_content_type");
    assert_eq!(shown["scope"], "delivery");
    assert_eq!(shown["content_type"], "text/plain");
    assert!(
        decode_body(&shown) == valid_body,
        "show returns the body as received"
    );
    let (status, admin_shown) = app.admin_get(&format!("/admin/v1/quarantine/{valid_id}"));
    assert_eq!(status, 200);
    assert_eq!(admin_shown["body_base64"], shown["body_base64"]);
    let shown_event: Value =
        serde_json::from_str(&app.cli_ok(&["quarantine", "show", &bad_event_id.to_string()]))
            .expect("JSON");
    assert_eq!(shown_event["scope"], "event");
    assert_eq!(
        shown_event["delivery_id"],
        "9e000000-0000-4000-8000-0000000000d2"
    );
    assert!(
        shown_event["detail"]
            .as_str()
            .is_some_and(|d| d.contains("yesterday")),
        "{shown_event}"
    );
    let missing = app.cli(&["quarantine", "show", "999999999"]);
    assert_eq!(missing.status.code(), Some(1), "unknown record");
    let (status, answer) = app.admin_get("/admin/v1/quarantine/999999999");
    assert_eq!(status, 404);
    assert_error_body(&answer, "not_found", "unknown quarantine id");
    let (status, answer) = app.admin_get("/admin/v1/quarantine/abc");
    assert_eq!(status, 400);
    assert_error_body(&answer, "invalid_id", "non-numeric quarantine id");

    // reprocess, still invalid: the CLI reports it (exit 0, the 409 is a result, not a failure)
    // and the record stays.
    for id in [junk_id, bad_event_id] {
        let out: Value =
            serde_json::from_str(&app.cli_ok(&["quarantine", "reprocess", &id.to_string()]))
                .expect("JSON");
        assert_eq!(out.as_array().map(Vec::len), Some(1), "{out}");
        assert_eq!(out[0]["quarantine_id"], id);
        assert_eq!(out[0]["status"], "still_invalid", "{out}");
        assert_eq!(out[0]["accepted"], 0);
        assert!(
            out[0]["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "{out}"
        );
    }
    let (status, answer) = app.admin_post(&format!("/admin/v1/quarantine/{junk_id}/reprocess"));
    assert_eq!(status, 409, "{answer}");
    assert_eq!(answer["status"], "still_invalid");
    assert_unchanged(&app, &base, "reprocessing invalid records");
    assert_eq!(app.metric("handoff_quarantine_entries"), 4.0);

    // reprocess, a duplicate: leaves quarantine, changes nothing.
    let out: Value =
        serde_json::from_str(&app.cli_ok(&["quarantine", "reprocess", &dup_id.to_string()]))
            .expect("JSON");
    assert_eq!(out[0]["status"], "duplicate", "{out}");
    assert_eq!(out[0]["accepted"], 0);
    assert_unchanged(&app, &base, "reprocessing a duplicate");

    // reprocess, valid now: accepted, folded into state, and gone from quarantine.
    let requested = "handoff_webhook_events_total{type=\"bot.conversation.agent_call_requested\"}";
    let requested_before = app.metric(requested);
    let out: Value =
        serde_json::from_str(&app.cli_ok(&["quarantine", "reprocess", &valid_id.to_string()]))
            .expect("JSON");
    assert_eq!(out[0]["quarantine_id"], valid_id);
    assert_eq!(out[0]["status"], "accepted", "{out}");
    assert_eq!(out[0]["accepted"], 1, "{out}");
    assert_eq!(
        app.metric(requested),
        requested_before + 1.0,
        "a reprocessed event counts like one taken in"
    );
    wait_drained(&app);
    assert_eq!(
        app.metric("handoff_events_applied_total"),
        base.applied + 1.0
    );
    let state: Value =
        serde_json::from_str(&app.cli_ok(&["state", "show", new_conv])).expect("JSON");
    assert_eq!(state["handoff"]["phase"]["value"], "requested");
    assert_eq!(state["events_applied"], 1);
    assert_eq!(
        state["params"]["value"],
        json!({"name": "김민지", "orderNo": "A-20251121-0042"})
    );
    for (b, a) in base.views.iter().zip(views(&app)) {
        assert_eq!(*b, a, "other conversations are untouched");
    }
    let remaining: Vec<u64> = quarantine(&app)
        .iter()
        .map(|r| r["id"].as_u64().expect("id"))
        .collect();
    assert_eq!(remaining, vec![junk_id, bad_event_id]);
    assert_eq!(app.metric("handoff_quarantine_entries"), 2.0);
    let again = app.cli(&["quarantine", "reprocess", &valid_id.to_string()]);
    assert_eq!(again.status.code(), Some(1), "a released record is gone");
    let (status, _) = app.admin_post(&format!("/admin/v1/quarantine/{valid_id}/reprocess"));
    assert_eq!(status, 404);

    // reprocess --all: the two invalid ones stay.
    let out: Value =
        serde_json::from_str(&app.cli_ok(&["quarantine", "reprocess", "--all"])).expect("JSON");
    let statuses: Vec<&str> = out
        .as_array()
        .expect("array")
        .iter()
        .map(|r| r["status"].as_str().expect("status"))
        .collect();
    assert_eq!(statuses, vec!["still_invalid", "still_invalid"]);
    let remaining: Vec<u64> = quarantine(&app)
        .iter()
        .map(|r| r["id"].as_u64().expect("id"))
        .collect();
    assert_eq!(remaining, vec![junk_id, bad_event_id]);
}

#[test]
fn cli_quarantine_output_is_the_same_online_and_offline() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    let app = TestApp::spawn_in(&data_dir, Spawn::default());
    let (status, receipt) = app.post(b"{not json");
    assert_eq!(
        (status, receipt["status"].as_str()),
        (200, Some("quarantined")),
        "{receipt}"
    );
    let id = receipt["quarantine_id"].as_u64().expect("id").to_string();
    let online_list = app.cli_ok(&["quarantine", "list"]);
    let online_show = app.cli_ok(&["quarantine", "show", &id]);
    assert!(app.terminate().success());
    let offline_list = cli_ok(&data_dir, &["quarantine", "list"]);
    let offline_show = cli_ok(&data_dir, &["quarantine", "show", &id]);
    let shown: Value = serde_json::from_str(&offline_show).expect("JSON");
    assert_eq!(
        shown["body_text"], "{not json",
        "offline view shows the body as text"
    );
    assert_eq!(
        online_show, offline_show,
        "quarantine show differs between admin API and offline"
    );
    assert_eq!(
        online_list, offline_list,
        "quarantine list differs between admin API and offline"
    );
}

#[test]
fn offline_reprocess_is_folded_after_restart() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    let app = TestApp::spawn_in(&data_dir, Spawn::default());
    let body = fixture_bytes("agent-call-requested.json");
    let (status, receipt) = app.post_to(&app.webhook_url, &body, Some("text/plain"));
    assert_eq!(
        (status, receipt["status"].as_str()),
        (200, Some("quarantined")),
        "{receipt}"
    );
    let id = receipt["quarantine_id"].as_u64().expect("id").to_string();
    let (status, junk) = app.post(b"[1, 2");
    assert_eq!(status, 200);
    let junk_id = junk["quarantine_id"].as_u64().expect("id");
    assert!(app.terminate().success());

    // The daemon is stopped: the CLI opens the store itself.
    assert_eq!(
        cli(&data_dir, &["state", "show", CONV1]).status.code(),
        Some(1),
        "nothing in state yet"
    );
    let out: Value =
        serde_json::from_str(&cli_ok(&data_dir, &["quarantine", "reprocess", &id])).expect("JSON");
    assert_eq!(out[0]["status"], "accepted", "{out}");
    assert_eq!(out[0]["accepted"], 1, "{out}");
    let list: Value =
        serde_json::from_str(&cli_ok(&data_dir, &["quarantine", "list"])).expect("JSON");
    let ids: Vec<u64> = list
        .as_array()
        .expect("array")
        .iter()
        .map(|r| r["id"].as_u64().expect("id"))
        .collect();
    assert_eq!(ids, vec![junk_id]);

    // The accepted event waits in the inbox and is folded once the daemon is back.
    let app = TestApp::spawn_in(&data_dir, Spawn::default());
    wait_drained(&app);
    let state: Value = serde_json::from_str(&app.cli_ok(&["state", "show", CONV1])).expect("JSON");
    assert_eq!(state["handoff"]["phase"]["value"], "requested");
    assert_eq!(state["events_applied"], 1);
    assert_eq!(app.metric("handoff_events_applied_total"), 1.0);
    assert_eq!(app.metric("handoff_quarantine_entries"), 1.0);
    // It was accepted once: the original delivery is now a duplicate.
    let (status, receipt) = app.post(&body);
    assert_eq!(
        (status, receipt["status"].as_str()),
        (200, Some("duplicate")),
        "{receipt}"
    );
}
