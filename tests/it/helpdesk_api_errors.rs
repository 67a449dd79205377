//! The agent API's errors that need a daemon set up for them, against the real daemon and its
//! embedded emulator: 403 outside `helpdesk.allow_cidrs`, 422 `no_partner_channel`, 413
//! `payload_too_large`, 504 `command_pending` and 503 `too_many_pending` while folding is held
//! back, 409 `command_already_applied`, and 503 `store_unavailable` on a full disk (on a tmpfs;
//! needs root, as in CI). Each checks that a refused call took no effect.

use crate::common::agent_api::{
    audit_types, call, call_raw, calls, code, post, spawn_with, KAKAO, KAKAO_USER, TOKEN_NEW, WEB,
};
use crate::common::tmpfs::Tmpfs;
use crate::common::{delivery, fixture_value, poll_until};
use serde_json::{json, Value};
use std::time::Duration;

#[test]
fn callers_outside_the_allowed_addresses_get_403_before_their_token_is_looked_at() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let outside = spawn_with(
        tmp.path(),
        &tmp.path().join("outside"),
        "allow_cidrs = [\"10.0.0.0/8\", \"::1/128\"]",
        true,
    );
    for token in [Some(TOKEN_NEW), None, Some("wrong-token-0123456789")] {
        let r = call(&outside, "GET", "/conversations", token, None, None);
        assert_eq!((r.status, code(&r)), (403, "forbidden"), "{}", r.body);
        let r = call(
            &outside,
            "POST",
            &format!("/conversations/{WEB}/accept"),
            token,
            None,
            Some(json!({"agent": {"id": "alice"}})),
        );
        assert_eq!((r.status, code(&r)), (403, "forbidden"), "{}", r.body);
    }
    // The document stays open: it holds nothing that needs guarding.
    assert_eq!(outside.get("/helpdesk/v1/openapi.json").0, 200);
    drop(outside);

    let inside = spawn_with(
        tmp.path(),
        &tmp.path().join("inside"),
        "allow_cidrs = [\"10.0.0.0/8\", \"127.0.0.1/32\"]",
        true,
    );
    let r = call(
        &inside,
        "GET",
        "/conversations",
        Some(TOKEN_NEW),
        None,
        None,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    // Inside the list the token is checked as before.
    let r = call(&inside, "GET", "/conversations", None, None, None);
    assert_eq!((r.status, code(&r)), (401, "unauthorized"));
}

#[test]
fn a_reply_to_a_partner_user_without_a_channel_is_422_and_an_oversized_body_413() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // No [helpdesk.partner]: the seed bot has no partner-messenger channel.
    let app = spawn_with(tmp.path(), &tmp.path().join("data"), "", false);
    app.emulator_act(KAKAO, "request-agent", json!({}));
    app.emulator_delivered();
    let r = post(
        &app,
        &format!("/conversations/{KAKAO}/accept"),
        None,
        json!({"agent": {"id": "bob"}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);

    let messages = format!("/conversations/{KAKAO}/messages");
    let hello = json!({"message": {"type": "text", "text": "Hello, Bob here"}});
    let r = post(&app, &messages, Some("nochan-1"), hello.clone());
    assert_eq!(
        (r.status, code(&r)),
        (422, "no_partner_channel"),
        "{}",
        r.body
    );
    let user = format!("/users/kakaobiz/{KAKAO_USER}");
    for path in [format!("{user}/block"), format!("{user}/unblock")] {
        let r = post(&app, &path, None, json!({}));
        assert_eq!((r.status, code(&r)), (422, "no_partner_channel"), "{path}");
    }
    let r = call(
        &app,
        "DELETE",
        &format!("{user}/session"),
        Some(TOKEN_NEW),
        None,
        None,
    );
    assert_eq!((r.status, code(&r)), (422, "no_partner_channel"));

    // 413 for a body over the 64 KiB limit, whatever it holds.
    let big = json!({"message": {"type": "text", "text": "x".repeat(65 * 1024)}}).to_string();
    let r = call_raw(&app, "POST", &messages, Some(TOKEN_NEW), Some("big-1"), big);
    assert_eq!(
        (r.status, code(&r)),
        (413, "payload_too_large"),
        "{}",
        r.body
    );

    // None of them took effect: no command stored, nothing sent anywhere.
    app.settle();
    assert_eq!(audit_types(&app, KAKAO, "agent."), ["agent.accept"]);
    for endpoint in [
        "pb-send-message",
        "pb-block",
        "pb-unblock",
        "pb-remove-session",
        "send-conversation-message",
    ] {
        assert!(calls(&app, endpoint, "").is_empty(), "{endpoint}");
    }
    // A refusal before the command was stored is judged again: still no channel.
    let r = post(&app, &messages, Some("nochan-1"), hello);
    assert_eq!(
        (r.status, code(&r), r.replayed),
        (422, "no_partner_channel", false)
    );
}

fn admin_post(app: &crate::common::TestApp, path: &str) {
    let (status, body) = app.admin_post(path);
    assert_eq!(status, 200, "{path}: {body}");
}

#[test]
fn while_folding_is_held_back_calls_answer_504_pending_and_503_over_the_limit_and_a_retry_gets_the_verdict(
) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = spawn_with(
        tmp.path(),
        &tmp.path().join("data"),
        "command_timeout = \"5s\"\nmax_pending_commands = 2",
        true,
    );
    app.emulator_act(WEB, "request-agent", json!({}));
    app.emulator_delivered();
    // Folded before the pause, so the inbox depth read below cannot drop under the test.
    app.settle();
    let accept = format!("/conversations/{WEB}/accept");
    let transfer = format!("/conversations/{WEB}/transfer");
    let alice = json!({"agent": {"id": "alice"}});
    let to_flow = json!({"flow_id": 3});

    admin_post(&app, "/admin/v1/dispatch/pause");
    assert_eq!(app.metric("handoff_dispatch_paused"), 1.0);
    let inbox_before = app.metric("handoff_inbox_depth");
    let (pending_accept, pending_transfer) = std::thread::scope(|s| {
        let a = s.spawn(|| post(&app, &accept, Some("pend-1"), alice.clone()));
        let t = s.spawn(|| post(&app, &transfer, Some("pend-2"), to_flow.clone()));
        // Both commands are stored (their waiters registered before): the limit is reached.
        poll_until("both commands to wait", Duration::from_secs(20), || {
            (app.metric("handoff_inbox_depth") >= inbox_before + 2.0).then_some(())
        });
        let over = post(
            &app,
            &accept,
            Some("over-1"),
            json!({"agent": {"id": "bob"}}),
        );
        assert_eq!(
            (over.status, code(&over)),
            (503, "too_many_pending"),
            "{}",
            over.body
        );
        (a.join().expect("accept"), t.join().expect("transfer"))
    });
    for r in [&pending_accept, &pending_transfer] {
        assert_eq!((r.status, code(r)), (504, "command_pending"), "{}", r.body);
    }
    // Stored, not applied: nothing reached the service while folding was held back.
    assert!(calls(&app, "set-manual", WEB).is_empty());
    assert!(calls(&app, "set-navigation", WEB).is_empty());

    admin_post(&app, "/admin/v1/dispatch/resume");
    assert_eq!(app.metric_sample("handoff_dispatch_paused"), Some(0.0));
    app.settle();
    // A retry with the same key gets the command's verdict; it acted once.
    let verdict = post(&app, &accept, Some("pend-1"), alice.clone());
    assert_eq!(verdict.status, 200, "{}", verdict.body);
    assert_eq!(
        (&verdict.body["status"], &verdict.body["agent"]["id"]),
        (&json!("applied"), &json!("alice"))
    );
    assert_eq!(calls(&app, "set-manual", WEB).len(), 1);
    assert_eq!(calls(&app, "set-navigation", WEB).len(), 1);
    // The call refused over the limit was not stored: judged now, against alice's accept.
    let over = post(
        &app,
        &accept,
        Some("over-1"),
        json!({"agent": {"id": "bob"}}),
    );
    assert_eq!((over.status, code(&over)), (409, "already_accepted"));

    // 409 command_already_applied: the transfer's first answer was a 504 (not kept), and its
    // verdict has left the conversation's kept verdicts (the newest 32) since.
    for _ in 0..32 {
        let r = post(&app, &accept, None, alice.clone());
        assert_eq!(
            (r.status, &r.body["changed"]),
            (200, &json!(false)),
            "{}",
            r.body
        );
    }
    let late = post(&app, &transfer, Some("pend-2"), to_flow);
    assert_eq!(
        (late.status, code(&late)),
        (409, "command_already_applied"),
        "{}",
        late.body
    );
    app.settle();
    assert_eq!(
        calls(&app, "set-navigation", WEB).len(),
        1,
        "the transfer acted once"
    );
}

/// Two long user messages (about 6 KB), more than the page the event log may have left.
fn long_user_messages(delivery_id: &str) -> Vec<u8> {
    let events: Vec<Value> = (1..=2)
        .map(|i| {
            let mut e = fixture_value("message-received-text.json")["messages"][0].clone();
            e["id"] = json!(format!("3e5f0000-0000-4000-8000-0000000000f{i}"));
            e["data"]["message"]["id"] = json!(format!("6a1d0000-0000-4000-8000-0000000000f{i}"));
            e["data"]["message"]["data"]["text"] = json!("배송 문의드립니다 ".repeat(100));
            e
        })
        .collect();
    delivery(delivery_id, &events)
}

#[test]
fn a_full_disk_is_503_store_unavailable_with_nothing_applied_and_the_api_recovers_when_space_returns(
) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let disk = Tmpfs::mount(&tmp.path().join("data"), 64);
    let app = spawn_with(tmp.path(), &disk.path, "", true);
    app.emulator_act(WEB, "request-agent", json!({}));
    app.emulator_delivered();
    let r = post(
        &app,
        &format!("/conversations/{WEB}/accept"),
        None,
        json!({"agent": {"id": "alice"}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    app.settle();

    // An agent's reply of product cards (about 8 KB, more than the page the event log may
    // have left, so storing it needs new space).
    let messages = format!("/conversations/{WEB}/messages");
    let cards: Vec<Value> = (1..=8)
        .map(|i| {
            json!({
                "title": format!("주문 상품 {i}"),
                "description": "배송 예정일과 교환 안내입니다. ".repeat(25),
                "uri": format!("https://example.com/orders/42/items/{i}"),
            })
        })
        .collect();
    let reply = json!({"message": {"type": "cards", "cards": cards}});
    let webhook_delivery = long_user_messages("1d0c0000-0000-4000-8000-0000000000f1");

    let full = disk.fill();
    let r = post(&app, &messages, Some("full-1"), reply.clone());
    assert_eq!(
        (r.status, code(&r)),
        (503, "store_unavailable"),
        "{}",
        r.body
    );
    // The webhook refuses too, so the service sends the delivery again later.
    let (status, body) = app.post(&webhook_delivery);
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("store_unavailable")),
        "{body}"
    );
    // Nothing was applied: no command or message stored, nothing sent.
    assert!(calls(&app, "send-conversation-message", WEB).is_empty());
    assert_eq!(audit_types(&app, WEB, "agent."), ["agent.accept"]);
    let user_event = "/admin/v1/events/3e5f0000-0000-4000-8000-0000000000f1";
    let (status, stored) = app.admin_get(user_event);
    assert_eq!(status, 404, "the user's message is not stored: {stored}");

    // Space comes back: the same calls succeed, and act once.
    drop(full);
    let r = post(&app, &messages, Some("full-1"), reply);
    assert_eq!(r.status, 200, "{}", r.body);
    let (status, body) = app.post(&webhook_delivery);
    assert_eq!(status, 200, "{body}");
    app.settle();
    let sent = calls(&app, "send-conversation-message", WEB);
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(
        sent[0]["body"]["message"]["cards"][7]["title"],
        "주문 상품 8"
    );
    assert_eq!(
        audit_types(&app, WEB, "agent."),
        ["agent.accept", "agent.message"]
    );
    assert_eq!(app.admin_get(user_event).0, 200, "stored now");
    // The daemon goes before its disk.
    drop(app);
    drop(disk);
}
