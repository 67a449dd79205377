//! The agent API (`/helpdesk/v1`) against the real daemon and its embedded emulator: the queue,
//! accept, replies to a web and a partner-messenger user, release, transfer, block / unblock /
//! session removal, idempotency of every mutating route, the audit, the errors of requests and
//! of the conversation's state, and the OpenAPI document. Errors that need a daemon set up for
//! them (addresses, channels, the fold held back, a failing store) are in helpdesk_api_errors.rs.

use crate::common::agent_api::{
    assert_replayed, audit_types, call, calls, code, post, spawn_with, KAKAO, KAKAO_USER,
    SENDER_KEY, TOKEN_NEW, TOKEN_OLD, WEB,
};
use crate::common::{poll_until, TestApp};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::time::Duration;

fn spawn() -> (tempfile::TempDir, TestApp) {
    let tmp = tempfile::tempdir().expect("tempdir");
    // The agent API open to loopback only: every call of these tests comes from inside the list.
    let app = spawn_with(
        tmp.path(),
        &tmp.path().join("data"),
        "release_flow = \"1\"\ntranscript_messages = 2\nallow_cidrs = [\"127.0.0.0/8\"]",
        true,
    );
    (tmp, app)
}

fn queue(app: &TestApp, phase: &str) -> Vec<Value> {
    let r = call(
        app,
        "GET",
        &format!("/conversations?phase={phase}"),
        Some(TOKEN_OLD),
        None,
        None,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    r.body["conversations"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

#[test]
fn agents_take_answer_hand_back_and_move_conversations_through_the_ordered_path() {
    let (_tmp, app) = spawn();
    let asked = std::time::Instant::now();
    // Both users ask for an agent, the web visitor first.
    app.emulator_act(WEB, "request-agent", json!({}));
    app.emulator_delivered();
    app.emulator_act(KAKAO, "request-agent", json!({}));
    app.emulator_delivered();

    // The queue, with positions per bot by request time; either token is valid (rotation).
    let waiting = queue(&app, "requested");
    let ids: Vec<&str> = waiting.iter().filter_map(|c| c["id"].as_str()).collect();
    assert_eq!(ids, vec![WEB, KAKAO], "{waiting:?}");
    assert_eq!(waiting[0]["position"], 1);
    assert_eq!(waiting[1]["position"], 2);
    assert_eq!(waiting[0]["platform"], "web");
    assert_eq!(waiting[1]["platform"], "kakaobiz");
    assert_eq!(waiting[0]["bot_id"], "B7f3a2c");
    // Waiting since the request: no longer than this test has run (the daemon's clock is real).
    let most = i64::try_from(asked.elapsed().as_secs()).unwrap_or(i64::MAX) + 1;
    let wait = waiting[0]["wait_seconds"].as_i64();
    assert!(
        wait.is_some_and(|s| (0..=most).contains(&s)),
        "{wait:?}, at most {most}"
    );

    // Accept: recorded, and manual mode on in the emulator, once for a repeated key.
    let alice = json!({"agent": {"id": "alice", "name": "Alice"}});
    let first = post(
        &app,
        &format!("/conversations/{WEB}/accept"),
        Some("acc-1"),
        alice.clone(),
    );
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.body["status"], "applied");
    assert_eq!(first.body["agent"]["id"], "alice");
    let again = post(
        &app,
        &format!("/conversations/{WEB}/accept"),
        Some("acc-1"),
        alice.clone(),
    );
    assert_eq!((again.status, &again.body), (200, &first.body));
    assert!(again.replayed && !first.replayed);
    app.settle();
    let manual_on: Vec<Value> = calls(&app, "set-manual", WEB)
        .into_iter()
        .filter(|e| e["body"]["enabled"] == true)
        .collect();
    assert_eq!(manual_on.len(), 1, "one effect for the repeated key");
    // The queue no longer lists it as waiting; the partner user moved up.
    let waiting = queue(&app, "requested");
    assert_eq!(waiting.len(), 1);
    assert_eq!(waiting[0]["id"], KAKAO);
    assert_eq!(waiting[0]["position"], 1);
    assert_eq!(queue(&app, "accepted")[0]["id"], WEB);

    // 409s from the fold's verdict: another agent's accept, a release of one with no agent.
    let bob = json!({"agent": {"id": "bob"}});
    let taken = post(
        &app,
        &format!("/conversations/{WEB}/accept"),
        None,
        bob.clone(),
    );
    assert_eq!((taken.status, code(&taken)), (409, "already_accepted"));
    let loose = post(
        &app,
        &format!("/conversations/{KAKAO}/release"),
        None,
        json!({}),
    );
    assert_eq!((loose.status, code(&loose)), (409, "not_with_agent"));
    let loose = post(
        &app,
        &format!("/conversations/{KAKAO}/messages"),
        None,
        json!({"message": {"type": "text", "text": "hello?"}}),
    );
    assert_eq!((loose.status, code(&loose)), (409, "not_with_agent"));

    // A reply to the web visitor goes into the conversation, once for a repeated key.
    let hello = json!({"message": {"type": "text", "text": "Hello, Alice here"}});
    let sent = post(
        &app,
        &format!("/conversations/{WEB}/messages"),
        Some("msg-1"),
        hello.clone(),
    );
    assert_eq!(sent.status, 200, "{}", sent.body);
    let sent_again = post(
        &app,
        &format!("/conversations/{WEB}/messages"),
        Some("msg-1"),
        hello,
    );
    assert_eq!(sent_again.body, sent.body);
    app.settle();
    let replies = calls(&app, "send-conversation-message", WEB);
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0]["body"]["message"]["text"], "Hello, Alice here");
    // The conversation view: phase, agent, and the newest messages (transcript_messages = 2 of
    // the seed's 3 and the reply), read through the Open API.
    let r = call(
        &app,
        "GET",
        &format!("/conversations/{WEB}"),
        Some(TOKEN_OLD),
        None,
        None,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        (&r.body["id"], &r.body["phase"]),
        (&json!(WEB), &json!("accepted"))
    );
    assert_eq!(r.body["agent"]["name"], "Alice");
    let transcript = r.body["transcript"].as_array().expect("transcript");
    assert_eq!(transcript.len(), 2, "{transcript:?}");
    assert_eq!(
        transcript[1]["data"]["text"], "Hello, Alice here",
        "newest last"
    );
    assert!(!calls(&app, "list-messages", "").is_empty());

    // The partner-messenger user: accepted by bob, the reply goes through the channel.
    let r = post(&app, &format!("/conversations/{KAKAO}/accept"), None, bob);
    assert_eq!(r.status, 200, "{}", r.body);
    let card = json!({"message": {"type": "cards", "cards": [{"title": "Your order", "uri": "https://example.com/o/42"}]}});
    let r = post(
        &app,
        &format!("/conversations/{KAKAO}/messages"),
        Some("msg-2"),
        card,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    app.settle();
    let relayed = calls(&app, "pb-send-message", SENDER_KEY);
    assert_eq!(relayed.len(), 1, "{relayed:?}");
    assert_eq!(relayed[0]["body"]["userKey"], KAKAO_USER);
    assert_eq!(
        relayed[0]["body"]["message"]["cards"][0]["title"],
        "Your order"
    );
    assert!(
        calls(&app, "send-conversation-message", KAKAO).is_empty(),
        "not into the conversation"
    );

    // Release without a flow: manual off, and the configured flow (release_flow = "1"); once
    // for a repeated key.
    let release = format!("/conversations/{WEB}/release");
    let r = post(&app, &release, Some("rel-1"), json!({}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body["agent"].is_null());
    assert_replayed(
        &r,
        &post(&app, &release, Some("rel-1"), json!({})),
        "release",
    );
    app.settle();
    assert_eq!(
        calls(&app, "set-manual", WEB)
            .iter()
            .filter(|e| e["body"]["enabled"] == false)
            .count(),
        1
    );
    let nav = calls(&app, "set-navigation", WEB);
    assert_eq!(nav.len(), 1, "{nav:?}");
    assert_eq!(nav[0]["body"]["flowId"], 1);
    let again = post(
        &app,
        &format!("/conversations/{WEB}/release"),
        None,
        json!({}),
    );
    assert_eq!((again.status, code(&again)), (409, "not_with_agent"));

    // Transfer moves the partner user's conversation to a flow and node, once for a repeated key.
    let transfer = format!("/conversations/{KAKAO}/transfer");
    let to = json!({"flow_id": 3, "node_id": 12});
    let r = post(&app, &transfer, Some("trf-1"), to.clone());
    assert_eq!(r.status, 200, "{}", r.body);
    assert_replayed(&r, &post(&app, &transfer, Some("trf-1"), to), "transfer");
    app.settle();
    let nav = calls(&app, "set-navigation", KAKAO);
    assert_eq!(nav.len(), 1, "{nav:?}");
    assert_eq!(
        (&nav[0]["body"]["flowId"], &nav[0]["body"]["nodeId"]),
        (&json!(3), &json!(12))
    );

    // Block, unblock and end the session of the partner user, addressed by platform and key;
    // each once for a repeated key.
    let user = format!("/users/kakaobiz/{KAKAO_USER}");
    let block = format!("{user}/block");
    let abuse = json!({"reason": "abuse"});
    let r = post(&app, &block, Some("blk-1"), abuse.clone());
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["conversation_id"], KAKAO);
    assert_replayed(&r, &post(&app, &block, Some("blk-1"), abuse), "block");
    let unblock = format!("{user}/unblock");
    let r = post(&app, &unblock, Some("unb-1"), json!({}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_replayed(
        &r,
        &post(&app, &unblock, Some("unb-1"), json!({})),
        "unblock",
    );
    let session = format!("{user}/session");
    let end = || {
        call(
            &app,
            "DELETE",
            &session,
            Some(TOKEN_NEW),
            Some("ses-1"),
            None,
        )
    };
    let r = end();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_replayed(&r, &end(), "session removal");
    app.settle();
    for endpoint in ["pb-block", "pb-unblock", "pb-remove-session"] {
        let done = calls(&app, endpoint, KAKAO_USER);
        assert_eq!(done.len(), 1, "one effect each: {endpoint}: {done:?}");
        assert!(done[0]["path"]
            .as_str()
            .is_some_and(|p| p.contains(SENDER_KEY)));
    }

    let r = call(
        &app,
        "GET",
        &format!("/conversations/{WEB}"),
        Some(TOKEN_OLD),
        None,
        None,
    );
    assert_eq!(
        (r.status, &r.body["phase"]),
        (200, &json!("released")),
        "{}",
        r.body
    );

    // The audit shows every step, with the actions each decided and their outcome.
    let (status, audit) = app.admin_get(&format!("/admin/v1/conversations/{WEB}/audit"));
    assert_eq!(status, 200, "{audit}");
    let timeline = audit["timeline"].as_array().expect("timeline");
    let agent_steps: Vec<(&str, Vec<&str>)> = timeline
        .iter()
        .filter(|i| i["type"].as_str().is_some_and(|t| t.starts_with("agent.")))
        .map(|i| {
            let actions = i["actions"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x["type"].as_str()).collect())
                .unwrap_or_default();
            (i["type"].as_str().unwrap_or(""), actions)
        })
        .collect();
    assert_eq!(
        agent_steps,
        vec![
            ("agent.accept", vec!["set_manual"]),
            ("agent.accept", vec![]),
            ("agent.message", vec!["send_message"]),
            ("agent.release", vec!["set_manual", "navigate"]),
            ("agent.release", vec![]),
        ],
        "{timeline:?}"
    );
    let accept_actions = &timeline
        .iter()
        .find(|i| i["type"] == "agent.accept")
        .expect("accept")["actions"];
    assert_eq!(accept_actions[0]["status"], "done");
    assert_eq!(accept_actions[0]["rule"], "@agent-api");

    // The partner user's conversation shows every command of this test too (the refused ones
    // before the accept included), a repeat under the same key once.
    assert_eq!(
        audit_types(&app, KAKAO, "agent."),
        [
            "agent.release",
            "agent.message",
            "agent.accept",
            "agent.message",
            "agent.transfer",
            "agent.block",
            "agent.unblock",
            "agent.remove_session",
        ],
    );
}

#[test]
fn request_and_state_errors_have_their_status_and_code() {
    let (_tmp, app) = spawn();
    app.emulator_act(WEB, "request-agent", json!({}));
    app.emulator_delivered();
    let accept = format!("/conversations/{WEB}/accept");
    let alice = json!({"agent": {"id": "alice"}});

    // 401: no token, a wrong one. The token never shows in an answer.
    for token in [None, Some("wrong-token-0123456789")] {
        let r = call(&app, "POST", &accept, token, None, Some(alice.clone()));
        assert_eq!((r.status, code(&r)), (401, "unauthorized"));
        assert!(!r.body.to_string().contains(TOKEN_NEW));
    }
    let r = call(&app, "GET", "/conversations", None, None, None);
    assert_eq!((r.status, code(&r)), (401, "unauthorized"));

    // 400 with the field at fault.
    for (body, field) in [
        (json!({}), "agent"),
        (json!({"agent": {"id": ""}}), "agent.id"),
        (json!({"agent": {"id": "a"}, "extra": 1}), "extra"),
    ] {
        let r = post(&app, &accept, None, body);
        assert_eq!((r.status, code(&r)), (400, "invalid_body"), "{}", r.body);
        assert_eq!(r.body["error"]["field"], field);
    }
    let messages = format!("/conversations/{WEB}/messages");
    for (body, field) in [
        (json!({"message": {"type": "text"}}), "message.text"),
        // Over the service's 1000 characters (Korean counted by characters, not bytes).
        (
            json!({"message": {"type": "text", "text": "가".repeat(1001)}}),
            "message.text",
        ),
        (
            json!({"message": {"type": "media", "media": {"contentType": "image", "uri": ""}}}),
            "message.media.uri",
        ),
        // The service's media types are image, video, audio and link.
        (
            json!({"message": {"type": "media", "media": {"contentType": "image/png", "uri": "https://example.com/a.png"}}}),
            "message.media.contentType",
        ),
        (
            json!({"message": {"type": "cards", "cards": [{"title": " "}]}}),
            "message.cards[0].title",
        ),
    ] {
        let r = post(&app, &messages, None, body);
        assert_eq!((r.status, code(&r)), (400, "invalid_body"), "{}", r.body);
        assert_eq!(r.body["error"]["field"], field);
    }
    let r = post(
        &app,
        &format!("/conversations/{WEB}/transfer"),
        None,
        json!({"node_id": 3}),
    );
    assert_eq!(
        (r.status, r.body["error"]["field"].as_str()),
        (400, Some("node_id"))
    );
    let r = call(&app, "POST", &accept, Some(TOKEN_NEW), None, None);
    assert_eq!(
        (r.status, r.body["error"]["field"].as_str()),
        (400, Some("body"))
    );
    let r = call(
        &app,
        "GET",
        "/conversations?phase=lost",
        Some(TOKEN_NEW),
        None,
        None,
    );
    assert_eq!((r.status, code(&r)), (400, "invalid_query"));
    let r = post(&app, &accept, Some("bad key/with slash"), alice.clone());
    assert_eq!((r.status, code(&r)), (400, "invalid_header"));

    // 404: unknown conversation and user.
    let r = post(
        &app,
        "/conversations/no-such-conversation/accept",
        None,
        alice.clone(),
    );
    assert_eq!((r.status, code(&r)), (404, "conversation_not_found"));
    let r = call(
        &app,
        "GET",
        "/conversations/no-such-conversation",
        Some(TOKEN_NEW),
        None,
        None,
    );
    assert_eq!((r.status, code(&r)), (404, "conversation_not_found"));
    let r = post(&app, "/users/kakaobiz/nobody/block", None, json!({}));
    assert_eq!((r.status, code(&r)), (404, "user_not_found"));
    // 409: block is a partner-messenger action.
    let r = post(&app, "/users/web/web-visitor-8841/block", None, json!({}));
    assert_eq!((r.status, code(&r)), (409, "not_partner_messenger"));

    // 422: a key reused for another request; the first answer stays.
    let first = post(&app, &accept, Some("reuse-1"), alice.clone());
    assert_eq!(first.status, 200, "{}", first.body);
    let other = post(
        &app,
        &accept,
        Some("reuse-1"),
        json!({"agent": {"id": "bob"}}),
    );
    assert_eq!(
        (other.status, code(&other)),
        (422, "idempotency_key_reused")
    );
    let same = post(&app, &accept, Some("reuse-1"), alice.clone());
    assert_eq!((same.status, &same.body), (200, &first.body));
    // A refusal is an answer too: kept under its key.
    let bob = json!({"agent": {"id": "bob"}});
    let refused = post(&app, &accept, Some("bob-1"), bob.clone());
    assert_eq!((refused.status, code(&refused)), (409, "already_accepted"));
    let refused_again = post(&app, &accept, Some("bob-1"), bob);
    assert_eq!((refused_again.status, refused_again.replayed), (409, true));

    // 409 idempotency_key_in_progress: a call holding the key (its body still arriving).
    let body = json!({"message": {"type": "text", "text": "slow"}}).to_string();
    let addr = app.base.trim_start_matches("http://").to_owned();
    let mut slow = std::net::TcpStream::connect(&addr).expect("connect");
    slow.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let head = format!(
        "POST /helpdesk/v1{messages} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {TOKEN_NEW}\r\n\
         Idempotency-Key: slow-1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    slow.write_all(head.as_bytes()).expect("head");
    slow.write_all(&body.as_bytes()[..5]).expect("part");
    poll_until(
        "the slow call to hold its key",
        Duration::from_secs(20),
        || (app.metric("handoff_helpdesk_calls_in_progress") >= 1.0).then_some(()),
    );
    let busy = post(
        &app,
        &messages,
        Some("slow-1"),
        serde_json::from_str(&body).expect("json"),
    );
    assert_eq!(
        (busy.status, code(&busy)),
        (409, "idempotency_key_in_progress")
    );
    slow.write_all(&body.as_bytes()[5..]).expect("rest");
    let mut answer = String::new();
    let _ = slow.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    app.settle();
    assert_eq!(calls(&app, "send-conversation-message", WEB).len(), 1);
    assert_eq!(app.metric("handoff_helpdesk_calls_in_progress"), 0.0);
}

#[test]
fn without_tokens_the_api_answers_503_disabled_and_the_document_covers_every_route() {
    let app = TestApp::spawn();
    let r = call(
        &app,
        "GET",
        "/conversations",
        Some("anything-at-all-01"),
        None,
        None,
    );
    assert_eq!((r.status, code(&r)), (503, "helpdesk_api_disabled"));
    let r = call(
        &app,
        "POST",
        &format!("/conversations/{WEB}/accept"),
        None,
        None,
        Some(json!({"agent": {"id": "a"}})),
    );
    assert_eq!((r.status, code(&r)), (503, "helpdesk_api_disabled"));

    // The document needs no token, parses as OpenAPI 3.1, and lists every mounted route.
    let (status, text) = app.get("/helpdesk/v1/openapi.json");
    assert_eq!(status, 200);
    let spec = oas3::from_json(&text).expect("a valid OpenAPI document");
    assert!(spec.openapi.starts_with("3.1"), "{}", spec.openapi);
    let paths = spec.paths.as_ref().expect("paths");
    let mounted = [
        ("get", "/helpdesk/v1/openapi.json"),
        ("get", "/helpdesk/v1/conversations"),
        ("get", "/helpdesk/v1/conversations/{id}"),
        ("post", "/helpdesk/v1/conversations/{id}/accept"),
        ("post", "/helpdesk/v1/conversations/{id}/messages"),
        ("post", "/helpdesk/v1/conversations/{id}/release"),
        ("post", "/helpdesk/v1/conversations/{id}/transfer"),
        ("post", "/helpdesk/v1/users/{platform}/{user_key}/block"),
        ("post", "/helpdesk/v1/users/{platform}/{user_key}/unblock"),
        ("delete", "/helpdesk/v1/users/{platform}/{user_key}/session"),
    ];
    for (method, path) in mounted {
        let item = paths
            .get(path)
            .unwrap_or_else(|| panic!("{path} not documented"));
        let op = match method {
            "get" => item.get.as_ref(),
            "post" => item.post.as_ref(),
            _ => item.delete.as_ref(),
        };
        let op = op.unwrap_or_else(|| panic!("{method} {path} not documented"));
        assert!(
            !op.responses(&spec).is_empty(),
            "{method} {path} has no responses"
        );
    }
    let documented: usize = paths
        .values()
        .map(|p| {
            [&p.get, &p.post, &p.put, &p.delete, &p.patch]
                .iter()
                .filter(|o| o.is_some())
                .count()
        })
        .sum();
    assert_eq!(
        documented,
        mounted.len(),
        "nothing documented that is not mounted"
    );
    // Every documented route is served (not the 404 of an unknown path).
    for (method, path) in mounted {
        let concrete = path
            .replace("{id}", "nope")
            .replace("{platform}", "kakaobiz")
            .replace("{user_key}", "nobody")
            .replace("/helpdesk/v1", "");
        let r = call(&app, &method.to_uppercase(), &concrete, None, None, None);
        assert_ne!(code(&r), "not_found", "{method} {path}");
    }
}
