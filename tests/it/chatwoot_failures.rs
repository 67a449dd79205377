//! The Chatwoot connector when things go wrong, from the outside (the daemon with its shipped
//! rules against the fake Chatwoot of `common::chatwoot`, helpers from `chatwoot.rs`):
//!
//! - a crash while Chatwoot creates the conversation (the daemon killed before the answer): after
//!   the restart the conversation is found by its handoff, not created twice;
//! - a refused `handoff.requested` (401): the user's later message is a dead letter, not a
//!   silent success; the hand-back closes the mapping; a retry of the request after the handoff
//!   ended opens nothing;
//! - a conversation or contact deleted in Chatwoot: the hand-back still closes, the next handoff
//!   opens anew, a new contact is made;
//! - an agent's reply, assignment or resolve after the rules handed the user back: `closed`;
//! - `lock_to_single_conversation`: the conversation Chatwoot answers from before is opened again
//!   for the new handoff.

use crate::chatwoot::{opened, requested, spawn, spawn_process, state, ALICE, WEB};
use crate::common::chatwoot::{self as cw, FakeChatwoot};
use crate::common::*;
use serde_json::{json, Value};
use std::time::Duration;

/// The dead letters: (the desk event's kind, the reason).
fn letters(app: &TestApp) -> Vec<(String, String)> {
    let (status, letters) = app.admin_get("/admin/v1/dead-letters");
    assert_eq!(status, 200, "{letters}");
    letters["dead_letters"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|l| {
            let kind = l["entry"]["action"]["kind"].as_str().unwrap_or_default();
            let reason = l["reason"].as_str().unwrap_or_default();
            (kind.to_owned(), reason.to_owned())
        })
        .collect()
}

/// The conversation's mapping as the admin API shows it.
fn desks(app: &TestApp) -> Value {
    let (status, desks) = app.admin_get(&format!("/admin/v1/conversations/{WEB}/desks"));
    assert_eq!(status, 200, "{desks}");
    desks["chatwoot"].clone()
}

#[test]
fn a_crash_while_chatwoot_creates_the_conversation_makes_no_second_one() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let fake = FakeChatwoot::start();
    fake.hold_creates();
    let app = spawn_process(tmp.path(), &fake.url);
    app.emulator_act(WEB, "request-agent", json!({}));
    // Chatwoot made the conversation; the daemon dies before the answer reaches it.
    let made = opened(&fake, WEB, 0);
    app.kill9();
    fake.release();

    let app = spawn_process(tmp.path(), &fake.url);
    poll_until(
        "the handoff resumed after the restart",
        Duration::from_secs(60),
        || {
            let ours = fake.conversations().into_iter();
            ours.filter(|c| c.custom_attributes["handoff_conversation"] == WEB)
                .find(|c| !c.labels.is_empty())
        },
    );
    app.settle();
    let ours: Vec<u64> = fake
        .conversations()
        .iter()
        .filter(|c| c.custom_attributes["handoff_conversation"] == WEB)
        .map(|c| c.id)
        .collect();
    assert_eq!(ours, [made.id], "one conversation");
    let creates = fake
        .calls()
        .iter()
        .filter(|c| c.method == "POST" && c.path == "/conversations")
        .count();
    assert_eq!(creates, 1, "created once: {:?}", fake.calls());
    // The restarted attempt looked among the contact's conversations before creating.
    assert!(fake
        .calls()
        .iter()
        .any(|c| c.method == "GET" && c.path.ends_with("/conversations")));
    let labelled = fake.conversation(made.id).expect("conversation");
    assert_eq!(labelled.labels, ["bot-b7f3a2c", "web"]);
    assert_eq!(desks(&app)["conversation"], made.id.to_string());
}

#[test]
fn after_a_refused_request_a_message_is_a_dead_letter_and_a_retry_after_the_end_opens_nothing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let fake = FakeChatwoot::start();
    fake.set_token("a-token-nobody-has");
    let app = spawn(tmp.path(), &fake.url, "");
    app.emulator_act(WEB, "request-agent", json!({}));
    app.settle();
    let refused = (
        "handoff.requested".to_owned(),
        "chatwoot_http_401".to_owned(),
    );
    assert_eq!(letters(&app), std::slice::from_ref(&refused));
    let seq = app.admin_get("/admin/v1/dead-letters").1["dead_letters"][0]["entry"]["seq"]
        .as_u64()
        .expect("seq");

    // The user writes: no conversation to post it into, which is said, not counted delivered.
    app.emulator_act(WEB, "say", json!({"text": "hello? anyone?"}));
    app.settle();
    let message = (
        "conversation.message".to_owned(),
        "chatwoot_not_opened".to_owned(),
    );
    assert!(letters(&app).contains(&message), "{:?}", letters(&app));

    // Nobody in five minutes: the hand-back closes the mapping (nothing to resolve).
    app.advance_clock("5m");
    app.settle();
    assert_eq!(desks(&app)["open"], false, "{}", desks(&app));
    assert!(
        letters(&app)
            .iter()
            .all(|(kind, _)| kind != "handoff.timed_out"),
        "{:?}",
        letters(&app)
    );

    // The token is fixed and the request retried: its handoff is over, nothing is opened.
    fake.set_token(cw::TOKEN);
    let (status, retried) = app.admin_post(&format!("/admin/v1/dead-letters/{seq}/retry"));
    assert_eq!(status, 200, "{retried}");
    app.settle();
    assert!(
        fake.conversations().is_empty(),
        "{:?}",
        fake.conversations()
    );
    assert!(!letters(&app).contains(&refused), "{:?}", letters(&app));
    assert!(letters(&app).contains(&message));
}

#[test]
fn a_conversation_or_contact_deleted_in_chatwoot_does_not_block_the_next_handoffs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (fake, app, first) = requested(tmp.path(), "");
    // An agent deletes it; then nobody answers in time: the hand-back's note and resolve find
    // nothing (404), the mapping is closed anyway.
    fake.delete_conversation(first.id);
    app.advance_clock("5m");
    app.settle();
    // The note of the wait's last queue update found it gone (a dead letter: it was not told);
    // the hand-back did not fail.
    let gone = ("queue.updated".to_owned(), "chatwoot_http_404".to_owned());
    assert_eq!(letters(&app), std::slice::from_ref(&gone));
    assert_eq!(desks(&app)["open"], false, "{}", desks(&app));

    // The next handoff opens a new one.
    app.emulator_act(WEB, "request-agent", json!({}));
    app.settle();
    let second = opened(&fake, WEB, 0);
    assert_ne!(second.id, first.id);
    let desk = desks(&app);
    assert_eq!(desk["conversation"], second.id.to_string(), "{desk}");
    assert_eq!(desk["earlier"], json!([first.id.to_string()]), "{desk}");
    app.advance_clock("5m");
    app.settle();

    // The contact is deleted (with its conversations): the kept one is dropped, a new made.
    let contact = fake.contacts()[0]["id"].as_u64().expect("contact id");
    fake.delete_contact(contact);
    app.emulator_act(WEB, "request-agent", json!({}));
    app.settle();
    let third = opened(&fake, WEB, 0);
    assert_ne!(third.contact_id, contact);
    assert_eq!(fake.contacts().len(), 1, "{:?}", fake.contacts());
    assert_eq!(third.status, "open");
    assert_eq!(letters(&app), [gone]);
}

#[test]
fn after_the_rules_handed_the_user_back_an_agents_reply_assignment_or_resolve_is_closed() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let fake = FakeChatwoot::start();
    let mut fwd = crate::common::forwarder::Forwarder::start(fake.addr);
    let app = spawn(tmp.path(), &fwd.url(), "");
    app.emulator_act(WEB, "request-agent", json!({}));
    app.settle();
    let c = opened(&fake, WEB, 0);
    // Chatwoot out of reach: the bridge's hand-back waits, its mapping still open.
    fwd.close();
    let fired = app.metric("handoff_timers_fired_total");
    let due = app.advance_clock_unsettled("5m")["due_timers"]
        .as_f64()
        .expect("due_timers");
    poll_until("the wait to run out", Duration::from_secs(30), || {
        (app.metric("handoff_timers_fired_total") >= fired + due).then_some(())
    });
    wait_drained(&app);
    assert_eq!(desks(&app)["open"], true, "{}", desks(&app));
    let handoff = &state(&app, WEB)["handoff"];
    assert!(handoff["handed_back_at"].is_number(), "{handoff}");

    let reply = cw::agent_reply(c.id, 9001, ALICE, "Sorry, I am here now");
    let resolved = cw::status_changed(c.id, "resolved");
    for (payload, delivery) in [
        (reply, "d-reply"),
        (cw::assigned(c.id, ALICE), "d-assigned"),
        (resolved, "d-resolved"),
    ] {
        let (status, body) = cw::deliver(&app, &payload, delivery);
        assert_eq!(
            (status, body["status"].as_str(), body["kind"].as_str()),
            (200, Some("ignored"), Some("closed")),
            "{delivery}: {body}"
        );
    }
    wait_drained(&app);
    let desk = &state(&app, WEB)["desk"];
    assert!(desk["agent"].is_null(), "{desk}");
    assert!(
        desk["verdicts"].as_array().is_none_or(Vec::is_empty),
        "no command: {desk}"
    );
}

#[test]
fn with_lock_to_single_conversation_the_earlier_conversation_is_opened_again_for_the_handoff() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let fake = FakeChatwoot::start();
    fake.lock_to_single_conversation();
    let app = spawn(tmp.path(), &fake.url, "");
    app.emulator_act(WEB, "request-agent", json!({}));
    app.settle();
    let first = opened(&fake, WEB, 0);
    let first_action = first.custom_attributes["handoff_action"].clone();
    let reply = cw::agent_reply(first.id, 9001, ALICE, "Hello");
    assert_eq!(cw::deliver(&app, &reply, "d-1").1["status"], "relayed");
    let resolved = cw::deliver(&app, &cw::status_changed(first.id, "resolved"), "d-2");
    assert_eq!(resolved.1["status"], "relayed", "{}", resolved.1);
    app.settle();
    assert_eq!(fake.conversation(first.id).expect("c").status, "resolved");

    // The next handoff: Chatwoot answers the create with that conversation, resolved.
    app.emulator_act(WEB, "request-agent", json!({}));
    app.settle();
    assert_eq!(fake.conversations().len(), 1, "{:?}", fake.conversations());
    let again = fake.conversation(first.id).expect("c");
    assert_eq!(again.status, "open");
    let action = &again.custom_attributes["handoff_action"];
    assert!(action.is_string() && *action != first_action, "{again:?}");
    assert_eq!(again.custom_attributes["handoff_conversation"], WEB);
    let desk = desks(&app);
    assert_eq!(
        (&desk["conversation"], &desk["open"], &desk["earlier"]),
        (&json!(first.id.to_string()), &json!(true), &json!([])),
        "{desk}"
    );
    // It is the handoff's conversation: an agent's reply there is relayed, not stale.
    let reply = cw::agent_reply(first.id, 9003, ALICE, "Back again?");
    let (_, body) = cw::deliver(&app, &reply, "d-3");
    assert_eq!(body["kind"], "agent_message", "{body}");
}
