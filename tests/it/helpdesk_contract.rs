//! Issue 19, "an exact agent-API contract": the OpenAPI document the daemon serves and its
//! handlers agree. Each class of mismatch the contract check (tests/contract/schemathesis.sh)
//! found has a case here, judged twice: by the served document (a JSON Schema validator over its
//! own components) and by the daemon (400 for what it refuses, anything else for what it takes),
//! and the two must match the expectation written in the case.
//!
//! Classes: string bounds and "not blank" (agent id, text, card title, button label), the
//! message's shape per type and the service's media types and counts, integral numbers
//! (`2.0` is an integer; ids past 2^53 are not exact), optional bodies that are `null`, the
//! `Idempotency-Key` syntax, the queue's `phase` enum, `limit` range and `after` cursor; then
//! 405 with `Allow` for undeclared methods, and the body read timeout.

use crate::common::agent_api::{call_raw, code, TOKEN_NEW};
use crate::common::{poll_until, Spawn, TestApp};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// Conversation and user ids no daemon here knows: a request the handlers take is answered 404
/// (after its body, query and headers were checked), one they refuse 400.
const NOBODY: &str = "00000000-0000-4000-8000-00000000dead";

fn spawn(extra: &[(&str, &str)]) -> (tempfile::TempDir, TestApp) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut env = vec![("HANDOFF_BRIDGE_HELPDESK_TOKENS", TOKEN_NEW)];
    env.extend_from_slice(extra);
    let app = TestApp::spawn_in(&tmp.path().join("data"), Spawn::with_env(&env));
    (tmp, app)
}

fn document(app: &TestApp) -> Value {
    let (status, text) = app.get("/helpdesk/v1/openapi.json");
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).expect("the document is JSON")
}

/// A validator of `schema`, a schema from the document, whose `$ref`s point into the document.
fn validator(doc: &Value, schema: &Value) -> jsonschema::Validator {
    let mut root = schema.clone();
    root["components"] = doc["components"].clone();
    jsonschema::draft202012::new(&root).expect("the document's schema compiles")
}

/// The request body schema of `method path` in the document.
fn body_schema(doc: &Value, path: &str, method: &str) -> Value {
    doc["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"].clone()
}

/// The schema of the parameter `name` of `method path`.
fn param_schema(doc: &Value, path: &str, method: &str, name: &str) -> Value {
    doc["paths"][path][method]["parameters"]
        .as_array()
        .expect("parameters")
        .iter()
        .find(|p| p["name"] == name)
        .map(|p| p["schema"].clone())
        .unwrap_or_else(|| panic!("no parameter {name} on {method} {path}"))
}

/// A case: a body (`None`: no body at all), whether the contract allows it, and why.
struct Case {
    body: Option<Value>,
    valid: bool,
    what: &'static str,
}

fn ok(body: Value, what: &'static str) -> Case {
    Case {
        body: Some(body),
        valid: true,
        what,
    }
}

fn bad(body: Value, what: &'static str) -> Case {
    Case {
        body: Some(body),
        valid: false,
        what,
    }
}

/// Judge every case by the document and by the daemon; both must say what the case says.
fn agree(app: &TestApp, doc: &Value, template: &str, path: &str, cases: &[Case]) {
    let schema = body_schema(doc, template, "post");
    assert!(!schema.is_null(), "no request body schema for {template}");
    let check = validator(doc, &schema);
    for case in cases {
        let label = format!("{template} {}: {:?}", case.what, case.body);
        if let Some(body) = &case.body {
            assert_eq!(
                check.is_valid(body),
                case.valid,
                "the document disagrees: {label}"
            );
        } else {
            // No body: allowed exactly when the document says the body is optional.
            let required = doc["paths"][template]["post"]["requestBody"]["required"] == true;
            assert_eq!(!required, case.valid, "the document disagrees: {label}");
        }
        let text = case.body.as_ref().map(Value::to_string).unwrap_or_default();
        let r = call_raw(app, "POST", path, Some(TOKEN_NEW), None, text);
        if case.valid {
            assert_ne!(r.status, 400, "the handler refuses: {label}: {}", r.body);
            assert!(
                r.status == 404 || r.status == 409,
                "{label}: {} {}",
                r.status,
                r.body
            );
        } else {
            assert_eq!(
                (r.status, code(&r)),
                (400, "invalid_body"),
                "the handler takes: {label}: {}",
                r.body
            );
        }
    }
}

#[test]
fn the_document_and_the_handlers_agree_on_every_request_body_rule() {
    let (_tmp, app) = spawn(&[]);
    let doc = document(&app);
    let conv = |action: &str| format!("/conversations/{NOBODY}/{action}");
    let template = |action: &str| format!("/helpdesk/v1/conversations/{{id}}/{action}");

    // Strings: bounds in characters, "not blank" as Unicode White_Space, unknown fields.
    agree(
        &app,
        &doc,
        &template("accept"),
        &conv("accept"),
        &[
            ok(json!({"agent": {"id": "alice"}}), "an id"),
            ok(json!({"agent": {"id": "a", "name": null}}), "a null name"),
            ok(json!({"agent": {"id": "가".repeat(200)}}), "200 characters"),
            ok(
                json!({"agent": {"id": "\u{1c}"}}),
                "a control character is not white space",
            ),
            bad(json!({"agent": {"id": "가".repeat(201)}}), "201 characters"),
            bad(json!({"agent": {"id": ""}}), "empty"),
            bad(json!({"agent": {"id": " \t\u{3000}"}}), "blank"),
            bad(json!({"agent": {"id": "a"}, "x": 1}), "an unknown field"),
            bad(json!({}), "no agent"),
            bad(json!(null), "null for a required body"),
        ],
    );

    // Messages: one shape per type, and the service's rules whatever the type.
    let msg = |m: Value| json!({ "message": m });
    let cards = |n: usize| vec![json!({"title": "t"}); n];
    agree(
        &app,
        &doc,
        &template("messages"),
        &conv("messages"),
        &[
            ok(msg(json!({"type": "text", "text": "hi"})), "text"),
            ok(
                msg(json!({"type": "text", "text": "가".repeat(1000)})),
                "1000 characters",
            ),
            ok(
                msg(json!({"type": "text", "text": "hi", "media": null, "cards": []})),
                "other contents null or empty",
            ),
            bad(
                msg(json!({"type": "text", "text": "가".repeat(1001)})),
                "1001 characters",
            ),
            bad(msg(json!({"type": "text", "text": null})), "null text"),
            bad(msg(json!({"type": "text", "text": "  "})), "blank text"),
            bad(
                msg(json!({"type": "text", "text": "hi", "cards": cards(11)})),
                "11 cards on a text",
            ),
            ok(
                msg(json!({"type": "media", "media": {"contentType": "image", "uri": "u"}})),
                "media",
            ),
            bad(
                msg(json!({"type": "media", "media": {"contentType": "image/png", "uri": "u"}})),
                "a content type the service does not know",
            ),
            bad(
                msg(json!({"type": "media", "media": {"contentType": "link", "uri": " "}})),
                "a blank uri",
            ),
            bad(msg(json!({"type": "media", "text": "hi"})), "no media"),
            ok(
                msg(json!({"type": "cards", "cards": cards(10)})),
                "10 cards",
            ),
            bad(msg(json!({"type": "cards", "cards": []})), "no card"),
            bad(
                msg(json!({"type": "cards", "cards": cards(11)})),
                "11 cards",
            ),
            bad(
                msg(json!({"type": "cards", "cards": [{"title": "x".repeat(51)}]})),
                "a 51-character title",
            ),
            bad(
                msg(
                    json!({"type": "cards", "cards": [{"title": "t", "description": "x".repeat(501)}]}),
                ),
                "a 501-character description",
            ),
            ok(
                msg(
                    json!({"type": "cards", "cards": [{"title": "t", "buttons": vec![json!({"label": "b"}); 9]}]}),
                ),
                "9 buttons",
            ),
            bad(
                msg(
                    json!({"type": "cards", "cards": [{"title": "t", "buttons": vec![json!({"label": "b"}); 10]}]}),
                ),
                "10 buttons",
            ),
            bad(
                msg(
                    json!({"type": "cards", "cards": [{"title": "t", "buttons": [{"label": ""}]}]}),
                ),
                "an empty label",
            ),
            bad(
                msg(
                    json!({"type": "cards", "cards": [{"title": "t", "media": {"contentType": "gif", "uri": "u"}}]}),
                ),
                "a card's media of an unknown type",
            ),
            bad(
                msg(json!({"type": "location"})),
                "a type agents cannot send",
            ),
        ],
    );

    // Flow targets: integers as JSON Schema counts them, within 2^53 - 1; id xor title.
    let max = 9_007_199_254_740_991_i64;
    agree(
        &app,
        &doc,
        &template("transfer"),
        &conv("transfer"),
        &[
            ok(json!({"flow_id": 2}), "an id"),
            ok(json!({"flow_id": 2.0}), "2.0 is an integer"),
            ok(json!({"flow_id": max, "node_id": -max}), "2^53 - 1"),
            ok(
                json!({"flow": "Survey", "node_id": 3}),
                "a title and a node",
            ),
            ok(
                json!({"flow_id": 1, "flow": null, "node_id": null}),
                "nulls for what is not given",
            ),
            bad(json!({"flow_id": 2.5}), "a fraction"),
            bad(json!({"flow_id": max + 1}), "past 2^53 - 1"),
            bad(
                serde_json::from_str(r#"{"flow_id": 1, "node_id": -9223372036854775809}"#)
                    .expect("json"),
                "past i64 (read as a double)",
            ),
            bad(json!({"flow": " "}), "a blank title"),
            bad(json!({"flow_id": 1, "flow": "Survey"}), "both"),
            bad(json!({"node_id": 3}), "a node without a flow"),
            bad(json!({}), "no flow"),
        ],
    );

    // Optional bodies: absent, null or an object.
    agree(
        &app,
        &doc,
        &template("release"),
        &conv("release"),
        &[
            Case {
                body: None,
                valid: true,
                what: "no body",
            },
            ok(json!(null), "null"),
            ok(json!({}), "empty"),
            ok(
                json!({"flow_id": null, "flow": null, "node_id": null}),
                "all null",
            ),
            // (`node_id: 2.0` would do too, but the jsonschema crate's 0.33 refuses a float for
            // `type: [integer, null]`; schemathesis' validator takes it, as the handler does.)
            ok(json!({"flow": "Survey", "node_id": 2}), "a title"),
            bad(json!({"node_id": 3}), "a node without a flow"),
            bad(json!([]), "an array"),
        ],
    );
    agree(
        &app,
        &doc,
        "/helpdesk/v1/users/{platform}/{user_key}/block",
        &format!("/users/kakaobiz/{NOBODY}/block"),
        &[
            Case {
                body: None,
                valid: true,
                what: "no body",
            },
            ok(json!(null), "null"),
            ok(json!({"reason": null}), "a null reason"),
            ok(json!({"reason": "spam"}), "a reason"),
            bad(json!({"reason": 1}), "a number"),
            bad(json!({"x": 1}), "an unknown field"),
        ],
    );
}

#[test]
fn the_document_and_the_handlers_agree_on_headers_and_queries() {
    let (_tmp, app) = spawn(&[]);
    let doc = document(&app);

    // Idempotency-Key: its syntax is in the document, and a key outside it is 400.
    let key_schema = param_schema(
        &doc,
        "/helpdesk/v1/conversations/{id}/accept",
        "post",
        "Idempotency-Key",
    );
    let key_ok = validator(&doc, &key_schema);
    let accept = format!("/conversations/{NOBODY}/accept");
    let body = json!({"agent": {"id": "a"}}).to_string();
    for (key, valid) in [
        ("order:42.retry_1".to_owned(), true),
        ("k".repeat(128), true),
        ("k".repeat(129), false),
        ("a b".to_owned(), false),
        ("a/b".to_owned(), false),
        ("ключ".to_owned(), false),
    ] {
        assert_eq!(key_ok.is_valid(&json!(key)), valid, "document: {key:?}");
        let r = call_raw(
            &app,
            "POST",
            &accept,
            Some(TOKEN_NEW),
            Some(&key),
            body.clone(),
        );
        if valid {
            assert_eq!(r.status, 404, "{key:?}: {}", r.body);
        } else {
            assert_eq!((r.status, code(&r)), (400, "invalid_header"), "{key:?}");
            assert_eq!(r.body["error"]["field"], "Idempotency-Key");
        }
    }

    // The queue's query: phase is one of the document's enum, limit within its range.
    let list = "/helpdesk/v1/conversations";
    let phase = param_schema(&doc, list, "get", "phase");
    let phases: Vec<&str> = phase["enum"]
        .as_array()
        .expect("phase is an enum")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        phases,
        [
            "requested",
            "accepted",
            "connected",
            "released",
            "cancelled",
            "ended",
            "bot",
            "all"
        ]
    );
    let limit = validator(&doc, &param_schema(&doc, list, "get", "limit"));
    let query = |q: &str| {
        call_raw(
            &app,
            "GET",
            &format!("/conversations?{q}"),
            Some(TOKEN_NEW),
            None,
            String::new(),
        )
    };
    for p in &phases {
        assert_eq!(query(&format!("phase={p}")).status, 200, "{p}");
    }
    for p in ["", "lost", "Requested"] {
        let r = query(&format!("phase={p}"));
        assert_eq!((r.status, code(&r)), (400, "invalid_query"), "{p:?}");
        assert_eq!(r.body["error"]["field"], "phase");
    }
    for (n, valid) in [
        (1, true),
        (1000, true),
        (0, false),
        (1001, false),
        (-1, false),
    ] {
        assert_eq!(limit.is_valid(&json!(n)), valid, "document: limit {n}");
        let r = query(&format!("limit={n}"));
        if valid {
            assert_eq!(r.status, 200, "limit {n}: {}", r.body);
        } else {
            assert_eq!((r.status, code(&r)), (400, "invalid_query"), "limit {n}");
        }
    }
    let r = query("limit=ten");
    assert_eq!((r.status, code(&r)), (400, "invalid_query"));
    // after: what the document's pattern allows, the daemon takes as a cursor; else 400 on it.
    let after = validator(&doc, &param_schema(&doc, list, "get", "after"));
    let long = "A".repeat(4097);
    for (cursor, valid) in [
        ("AAAA", true),
        ("AQ", true),
        ("_-8", true),
        ("", false),
        ("A", false),
        ("AB", false),
        ("a%2Bb", false),
        ("AAA%3D", false),
        (long.as_str(), false),
    ] {
        let text = cursor.replace("%2B", "+").replace("%3D", "=");
        assert_eq!(
            after.is_valid(&json!(text)),
            valid,
            "document: after {cursor:?}"
        );
        let r = query(&format!("phase=all&after={cursor}"));
        if valid {
            assert_eq!(r.status, 200, "after {cursor:?}: {}", r.body);
            assert!(r.body["next"].is_null(), "{}", r.body);
        } else {
            assert_eq!(
                (r.status, code(&r)),
                (400, "invalid_query"),
                "after {cursor:?}"
            );
            assert_eq!(r.body["error"]["field"], "after");
        }
    }
}

/// Send `method path` on a fresh connection and read the whole answer (the connection closes).
fn raw(app: &TestApp, method: &str, path: &str) -> String {
    let addr = app.base.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {TOKEN_NEW}\r\n\
         Content-Length: 0\r\nConnection: close\r\n\r\n"
    );
    s.write_all(head.as_bytes()).expect("request");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("answer");
    answer
}

fn header<'a>(answer: &'a str, name: &str) -> Option<&'a str> {
    answer
        .split("\r\n\r\n")
        .next()
        .into_iter()
        .flat_map(|head| head.lines())
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim())
        })
}

#[test]
fn an_undeclared_method_on_a_declared_path_is_405_with_the_declared_methods_in_allow() {
    let (_tmp, app) = spawn(&[]);
    let doc = document(&app);
    let paths = doc["paths"].as_object().expect("paths");
    assert!(paths.len() >= 10, "{:?}", paths.keys());
    let methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"];
    for (template, item) in paths {
        let declared: Vec<&str> = methods
            .iter()
            .copied()
            .filter(|m| item.get(m.to_ascii_lowercase()).is_some())
            .collect();
        assert!(!declared.is_empty(), "{template}");
        let path = template
            .replace("{id}", NOBODY)
            .replace("{platform}", "kakaobiz")
            .replace("{user_key}", NOBODY);
        for method in methods.iter().filter(|m| !declared.contains(m)) {
            let answer = raw(&app, method, &path);
            assert!(
                answer.starts_with("HTTP/1.1 405"),
                "{method} {path}: {answer}"
            );
            assert_eq!(
                header(&answer, "allow"),
                Some(declared.join(", ").as_str()),
                "{method} {path}: {answer}"
            );
            let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
            let body: Value = serde_json::from_str(body).expect("a JSON error body");
            assert_eq!(
                body["error"]["code"], "method_not_allowed",
                "{method} {path}"
            );
        }
        // A declared method is routed to its handler (never 405).
        let answer = raw(&app, declared[0], &path);
        assert!(!answer.starts_with("HTTP/1.1 405"), "{path}: {answer}");
    }
    // An undeclared path stays 404; the webhook's path allows POST.
    for path in ["/helpdesk/v1/nothing", "/helpdesk/v1/conversations/a/b/c"] {
        let answer = raw(&app, "GET", path);
        assert!(answer.starts_with("HTTP/1.1 404"), "{path}: {answer}");
        assert_eq!(header(&answer, "allow"), None);
    }
    let answer = raw(&app, "GET", "/webhook/some-token");
    assert!(answer.starts_with("HTTP/1.1 405"), "{answer}");
    assert_eq!(header(&answer, "allow"), Some("POST"));
}

#[test]
fn an_agent_api_body_that_stops_arriving_is_408_after_the_body_read_timeout() {
    let (_tmp, app) = spawn(&[("HANDOFF_BRIDGE__SERVER__BODY_READ_TIMEOUT", "1s")]);
    let addr = app.base.trim_start_matches("http://").to_owned();
    let body = json!({"agent": {"id": "alice"}}).to_string();
    let mut s = std::net::TcpStream::connect(&addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let head = format!(
        "POST /helpdesk/v1/conversations/{NOBODY}/accept HTTP/1.1\r\nHost: {addr}\r\n\
         Authorization: Bearer {TOKEN_NEW}\r\nIdempotency-Key: stalled-1\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let started = Instant::now();
    s.write_all(head.as_bytes()).expect("head");
    s.write_all(&body.as_bytes()[..5])
        .expect("part of the body");
    // Its key is held while the body is awaited...
    poll_until(
        "the stalled call to hold its key",
        Duration::from_secs(20),
        || (app.metric("handoff_helpdesk_calls_in_progress") >= 1.0).then_some(()),
    );
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    let took = started.elapsed();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
    assert!(
        took >= Duration::from_millis(900),
        "answered after {took:?}"
    );
    assert!(took < Duration::from_secs(20), "answered after {took:?}");
    // ...and released with the answer: the same key is free for a whole call.
    assert_eq!(app.metric("handoff_helpdesk_calls_in_progress"), 0.0);
    let r = call_raw(
        &app,
        "POST",
        &format!("/conversations/{NOBODY}/accept"),
        Some(TOKEN_NEW),
        Some("stalled-1"),
        body,
    );
    assert_eq!((r.status, code(&r)), (404, "conversation_not_found"));
}
