//! Issue 37 from the outside: the real daemon (shipped rules, embedded emulator playing the
//! service) with a Chatwoot section and nothing else set, against the fake Chatwoot of
//! `common::chatwoot` (stateful, answering as Chatwoot's running code does).
//!
//! - A whole handoff: the service's agent call; a contact and an open conversation at Chatwoot
//!   with labels, custom attributes and the transcript; a later user message posted `incoming`;
//!   a signed agent reply relayed to the user through the service; the echoes of the bridge's
//!   posts, a private note and a template not relayed; the same delivery twice relayed once; a
//!   bad signature and a stale timestamp refused (401) with nothing stored; a signed resolve that
//!   hands the user back to the bot; the next handoff opening a new conversation.
//! - Chatwoot unreachable for 10 minutes of daemon time: the events held, then carried out in
//!   order; Chatwoot answering 401: dead letters with the reason, shown in the console, retried
//!   from it once the token is valid again.

use crate::common::chatwoot::{self as cw, FakeChatwoot};
use crate::common::*;
use serde_json::{json, Value};
use std::time::Duration;

/// A web conversation of bot B7f3a2c in the emulator's default seed.
pub(crate) const WEB: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
pub(crate) const ALICE: (u64, &str) = (5, "Alice");

/// The daemon with `[helpdesk.chatwoot]` pointing at `url` (and `extra` keys of it); the token
/// and secret from their variables; shipped rules, any time of day.
pub(crate) fn spawn(root: &std::path::Path, url: &str, extra: &str) -> TestApp {
    spawn_with_env(root, url, extra, &[])
}

/// [`spawn`] with more environment.
fn spawn_with_env(
    root: &std::path::Path,
    url: &str,
    extra: &str,
    more: &[(&str, &str)],
) -> TestApp {
    spawn_opts(root, url, extra, more, false)
}

/// [`spawn`] as a process of its own (a test that kills it).
pub(crate) fn spawn_process(root: &std::path::Path, url: &str) -> TestApp {
    spawn_opts(root, url, "", &[], true)
}

fn spawn_opts(
    root: &std::path::Path,
    url: &str,
    extra: &str,
    more: &[(&str, &str)],
    own_process: bool,
) -> TestApp {
    let config = root.join("bridge.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[helpdesk]
transcript_messages = 5

[helpdesk.chatwoot]
url = "{url}"
account_id = {account}
inbox_id = {inbox}
{extra}

[outbox.retry]
base = "50ms"
cap = "200ms"
"#,
            account = cw::ACCOUNT,
            inbox = cw::INBOX,
        ),
    )
    .expect("config");
    TestApp::spawn_in(
        &root.join("data"),
        Spawn {
            env: vec![
                ("HANDOFF_BRIDGE_CHATWOOT_API_TOKEN".into(), cw::TOKEN.into()),
                (
                    "HANDOFF_BRIDGE_CHATWOOT_WEBHOOK_SECRET".into(),
                    cw::SECRET.into(),
                ),
                (
                    "HANDOFF_BRIDGE__RULES__SETTINGS__CHECK_BUSINESS_HOURS".into(),
                    "false".into(),
                ),
                ("HANDOFF_BRIDGE__ADMIN__TEST_CLOCK".into(), "true".into()),
            ]
            .into_iter()
            .chain(more.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())))
            .collect(),
            args: vec!["--config".into(), config.display().to_string()],
            own_process,
        },
    )
}

/// The daemon (`extra` in its Chatwoot section) against a new fake, after the user of `WEB`
/// asked for a person: the conversation that opened there.
pub(crate) fn requested(
    root: &std::path::Path,
    extra: &str,
) -> (FakeChatwoot, TestApp, cw::Conversation) {
    let fake = FakeChatwoot::start();
    let app = spawn(root, &fake.url, extra);
    app.emulator_act(WEB, "request-agent", json!({}));
    app.settle();
    let c = opened(&fake, WEB, 0);
    (fake, app, c)
}

/// The Chatwoot conversation opened for `conversation`'s handoff number `nth` (0 the first).
pub(crate) fn opened(fake: &FakeChatwoot, conversation: &str, nth: usize) -> cw::Conversation {
    poll_until(
        &format!("Chatwoot conversation {nth} of {conversation}"),
        Duration::from_secs(30),
        || {
            fake.conversations()
                .into_iter()
                .filter(|c| c.custom_attributes["handoff_conversation"] == conversation)
                .nth(nth)
        },
    )
}

/// The texts the service was asked to send into `conversation` (that took effect).
pub(crate) fn sent(app: &TestApp, conversation: &str) -> Vec<String> {
    app.journal()
        .into_iter()
        .filter(|e| e["endpoint"] == "send-conversation-message" && took_effect(e))
        .filter(|e| e["path"].as_str().is_some_and(|p| p.contains(conversation)))
        .filter_map(|e| e["body"]["message"]["text"].as_str().map(str::to_owned))
        .collect()
}

pub(crate) fn state(app: &TestApp, conversation: &str) -> Value {
    let (status, state) = app.admin_get(&format!("/admin/v1/conversations/{conversation}"));
    assert_eq!(status, 200, "{state}");
    state
}

/// Quarantine records, all scopes.
fn quarantined(app: &TestApp) -> usize {
    let (status, records) = app.admin_get("/admin/v1/quarantine");
    assert_eq!(status, 200, "{records}");
    records["records"].as_array().map_or(0, Vec::len)
}

/// Events stored for the conversation (its audit timeline's length).
fn stored_events(app: &TestApp, conversation: &str) -> usize {
    let (status, audit) = app.admin_get(&format!("/admin/v1/conversations/{conversation}/audit"));
    assert_eq!(status, 200, "{audit}");
    audit["timeline"].as_array().map_or(0, Vec::len)
}

#[test]
fn a_whole_handoff_goes_through_chatwoot_and_back_to_the_bot() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let fake = FakeChatwoot::start();
    let app = spawn(tmp.path(), &fake.url, "");

    // The user asks for a person: the service's agent call.
    app.emulator_act(WEB, "request-agent", json!({}));
    app.settle();
    let first = opened(&fake, WEB, 0);
    app.settle();
    let first = fake.conversation(first.id).expect("still there");
    assert_eq!((first.status.as_str(), first.inbox_id), ("open", cw::INBOX));
    assert_eq!(first.custom_attributes["handoff_bot"], "B7f3a2c");
    assert_eq!(first.custom_attributes["handoff_queue_position"], 1);
    assert_eq!(first.labels, ["bot-b7f3a2c", "web"]);
    // The contact carries the bridge's identifier, matched exactly.
    let end_user = state(&app, WEB)["end_user_id"]
        .as_str()
        .expect("end user")
        .to_owned();
    let contacts = fake.contacts();
    assert_eq!(contacts.len(), 1, "{contacts:?}");
    assert_eq!(
        contacts[0]["identifier"],
        format!("handoff-bridge:{end_user}")
    );
    // The transcript: the user's messages incoming, each with the bridge's source id.
    assert!(!first.messages.is_empty(), "{first:?}");
    assert!(first.messages.iter().all(|m| m["source_id"]
        .as_str()
        .is_some_and(|s| s.starts_with("handoff-bridge:"))));
    assert!(
        first.messages.iter().any(|m| m["message_type"] == 0),
        "{first:?}"
    );

    // A later user message: posted as incoming.
    app.emulator_act(WEB, "say", json!({"text": "are you there?"}));
    app.settle();
    let later = poll_until("the later message", Duration::from_secs(30), || {
        fake.conversation(first.id)?
            .messages
            .into_iter()
            .find(|m| m["content"] == "are you there?")
    });
    assert_eq!(later["message_type"], 0, "{later}");
    assert_eq!(later["private"], false, "{later}");

    // A bad signature and a stale timestamp: 401, nothing stored (looked at once the daemon is
    // idle: an event stored would have been folded by then), nothing quarantined.
    let reply = cw::agent_reply(first.id, 9001, ALICE, "Hello, Alice here");
    let before = (stored_events(&app, WEB), quarantined(&app));
    let (status, body) = cw::deliver_with(&app, &reply, "d-bad", "not-the-secret", cw::now_secs());
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (401, Some("invalid_signature"))
    );
    let (status, _) = cw::deliver_with(&app, &reply, "d-old", cw::SECRET, cw::now_secs() - 301);
    assert_eq!(status, 401);
    app.settle();
    assert_eq!(
        (stored_events(&app, WEB), quarantined(&app)),
        before,
        "nothing stored"
    );

    // The agent's reply, signed: relayed to the user through the service, once, even posted
    // twice; the first reply also takes the conversation for the agent.
    let (status, body) = cw::deliver(&app, &reply, "d-reply-1");
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("relayed")),
        "{body}"
    );
    let (status, body) = cw::deliver(&app, &reply, "d-reply-1");
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("duplicate")),
        "{body}"
    );
    // Captured and replayed: the same body signed again at another time, under another delivery
    // id (neither is what names it).
    let replayed = cw::deliver_with(&app, &reply, "d-replayed", cw::SECRET, cw::now_secs() - 60);
    assert_eq!(
        (replayed.0, replayed.1["status"].as_str()),
        (200, Some("duplicate")),
        "{}",
        replayed.1
    );
    app.settle();
    let replies: Vec<String> = sent(&app, WEB)
        .into_iter()
        .filter(|t| t == "Hello, Alice here")
        .collect();
    assert_eq!(replies.len(), 1, "relayed once: {replies:?}");
    assert_eq!(state(&app, WEB)["desk"]["agent"]["id"], "chatwoot:5");

    // Never relayed: the echoes of what the bridge posted, a private note, a template.
    let sent_before = sent(&app, WEB).len();
    let posted = fake.conversation(first.id).expect("conversation").messages;
    for (i, m) in posted.iter().enumerate() {
        let (status, body) = cw::deliver(&app, &cw::echo_of(first.id, m), &format!("d-echo-{i}"));
        assert_eq!(
            (status, body["kind"].as_str()),
            (200, Some("echo")),
            "{body}"
        );
    }
    let note = cw::message_created(
        first.id,
        json!({"id": 9100, "content": "internal", "private": true,
               "sender": {"id": 5, "name": "Alice", "type": "user"}}),
    );
    let away = cw::message_created(
        first.id,
        json!({"id": 9101, "content": "We are away", "message_type": "template"}),
    );
    for (payload, kind) in [(note, "private_note"), (away, "template")] {
        let (status, body) = cw::deliver(&app, &payload, &format!("d-{kind}"));
        assert_eq!((status, body["kind"].as_str()), (200, Some(kind)), "{body}");
    }
    app.settle();
    assert_eq!(sent(&app, WEB).len(), sent_before, "nothing more sent");

    // The agent resolves: the user is back with the bot; the conversation resolved.
    let (status, body) = cw::deliver(
        &app,
        &cw::status_changed(first.id, "resolved"),
        "d-resolved",
    );
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("relayed")),
        "{body}"
    );
    app.settle();
    let back = state(&app, WEB);
    assert!(back["desk"]["agent"].is_null(), "{back}");
    let manual = manual_mode(&app);
    assert_eq!(manual.last(), Some(&json!(false)), "{manual:?}");
    assert_eq!(fake.conversation(first.id).expect("c").status, "resolved");

    // The next handoff opens a new conversation; the old one stays resolved.
    app.emulator_act(WEB, "request-agent", json!({}));
    app.settle();
    let second = opened(&fake, WEB, 1);
    assert_ne!(second.id, first.id);
    assert_eq!(fake.conversation(first.id).expect("c").status, "resolved");
    let (status, desks) = app.admin_get(&format!("/admin/v1/conversations/{WEB}/desks"));
    assert_eq!(status, 200, "{desks}");
    assert_eq!(
        desks["chatwoot"]["conversation"],
        second.id.to_string(),
        "{desks}"
    );
    assert_eq!(desks["chatwoot"]["open"], true, "{desks}");
    assert_eq!(
        desks["chatwoot"]["earlier"],
        json!([first.id.to_string()]),
        "{desks}"
    );
    // An event of the earlier conversation is stale now.
    let late = cw::agent_reply(first.id, 9200, ALICE, "late");
    let (_, body) = cw::deliver(&app, &late, "d-late");
    assert_eq!(body["kind"], "stale", "{body}");
    assert_eq!(
        app.metric(r#"handoff_desk_webhooks_total{connector="chatwoot",kind="agent_message",verdict="relayed"}"#),
        1.0
    );
}

/// The Chatwoot state's incoming (user) messages of `c`, in order.
fn user_texts(c: &cw::Conversation) -> Vec<String> {
    c.messages
        .iter()
        .filter(|m| m["message_type"] == 0)
        .filter_map(|m| m["content"].as_str().map(str::to_owned))
        .collect()
}

#[test]
fn while_chatwoot_is_unreachable_for_ten_minutes_the_events_wait_then_go_in_order() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let fake = FakeChatwoot::start();
    let mut fwd = crate::common::forwarder::Forwarder::start(fake.addr);
    let app = spawn(tmp.path(), &fwd.url(), "");
    fwd.close();

    app.emulator_act(WEB, "request-agent", json!({}));
    app.emulator_act(WEB, "say", json!({"text": "first"}));
    app.emulator_act(WEB, "say", json!({"text": "second"}));
    app.emulator_delivered();
    wait_drained(&app);
    // Ten minutes of daemon time pass (the wait runs out at five: a timed_out goes behind).
    for _ in 0..10 {
        app.advance_clock_unsettled("1m");
        wait_drained(&app);
    }
    assert!(fake.calls().is_empty(), "nothing reached Chatwoot");
    let (status, ready) = app.get("/readyz");
    assert_eq!(status, 200, "intake goes on: {ready}");
    let ready: Value = serde_json::from_str(&ready).expect("json");
    assert_eq!(
        ready["checks"]["desks"]["chatwoot"], "circuit open",
        "{ready}"
    );
    assert_eq!(
        app.metric(r#"handoff_circuit_open{destination="chatwoot"}"#),
        1.0
    );

    // Back: the next probe goes, the circuit closes, everything goes in order.
    fwd.open();
    app.advance_clock_unsettled("20s");
    let c = poll_until(
        "the held events carried out",
        Duration::from_secs(60),
        || {
            fake.conversations()
                .into_iter()
                .find(|c| c.status == "resolved")
        },
    );
    app.settle();
    let c = fake.conversation(c.id).expect("conversation");
    let texts = user_texts(&c);
    let at = |t: &str| texts.iter().position(|x| x == t);
    assert!(
        at("first") < at("second") && at("first").is_some(),
        "{texts:?}"
    );
    // The hand-back's note comes after the user's messages, and the resolve last.
    let last = c.messages.last().expect("messages");
    assert_eq!(last["private"], true, "{c:?}");
    assert!(
        last["content"]
            .as_str()
            .is_some_and(|t| t.contains("in time")),
        "{last}"
    );
    let calls: Vec<String> = fake
        .calls()
        .into_iter()
        .filter(|c| c.status == 200)
        .map(|c| {
            format!(
                "{} {}",
                c.method,
                c.path.split('?').next().unwrap_or_default()
            )
        })
        .collect();
    assert_eq!(
        calls.first().map(String::as_str),
        Some("GET /contacts/search")
    );
    assert_eq!(
        calls.last().map(String::as_str),
        Some(format!("POST /conversations/{}/toggle_status", c.id).as_str())
    );
    assert_eq!(
        app.admin_get("/admin/v1/dead-letters").1["dead_letters"]
            .as_array()
            .map_or(0, Vec::len),
        0
    );
}

#[test]
fn a_refused_token_dead_letters_with_its_reason_and_a_retry_from_the_console_goes_through() {
    use crate::common::browser::Browser;
    let tmp = tempfile::tempdir().expect("tempdir");
    let fake = FakeChatwoot::start();
    fake.set_token("a-token-nobody-has");
    let app = spawn(tmp.path(), &fake.url, "");
    app.emulator_act(WEB, "request-agent", json!({}));
    app.settle();
    let (status, letters) = app.admin_get("/admin/v1/dead-letters");
    assert_eq!(status, 200, "{letters}");
    let letters = letters["dead_letters"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0]["reason"], "chatwoot_http_401", "{letters:?}");
    let seq = letters[0]["entry"]["seq"].as_u64().expect("seq");

    // The console shows it, and says why Chatwoot is not used.
    let mut b = Browser::new(&app);
    b.sign_in(ADMIN_TOKEN, "Kim");
    let outbox = b.get("/console/outbox");
    assert!(outbox.body.contains("chatwoot_http_401"), "{}", outbox.body);
    let overview = b.get("/console/");
    assert!(overview.body.contains("unauthorized"), "{}", overview.body);

    // The token is valid again at Chatwoot: retried from the console, carried out.
    fake.set_token(cw::TOKEN);
    let confirm = b.get(&format!("/console/dead-letters/{seq}/retry"));
    let csrf = confirm.field("csrf", "");
    let done = b.post(
        &format!("/console/dead-letters/{seq}/retry"),
        &[("csrf", &csrf)],
    );
    assert_eq!(done.status, 303, "{}", done.body);
    app.settle();
    let c = opened(&fake, WEB, 0);
    assert_eq!(c.status, "open");
    let (_, letters) = app.admin_get("/admin/v1/dead-letters");
    assert_eq!(letters["dead_letters"].as_array().map_or(0, Vec::len), 0);
    let overview = b.get("/console/");
    assert!(!overview.body.contains("unauthorized"), "{}", overview.body);
    // The conversation page links to the Chatwoot conversation.
    let page = b.get(&format!("/console/conversations/{WEB}"));
    let link = format!(
        "{}/app/accounts/{}/conversations/{}",
        fake.url,
        cw::ACCOUNT,
        c.id
    );
    assert!(page.body.contains(&link), "{}", page.body);
}

/// POST `body` to `path` without a signature.
fn post_unsigned(app: &TestApp, path: &str, body: &Value) -> (u16, Value) {
    app.post_to(
        &format!("{}{path}", app.base),
        body.to_string().as_bytes(),
        Some("application/json"),
    )
}

#[test]
fn a_signed_but_unreadable_delivery_is_quarantined_and_an_unsigned_one_needs_the_path_token() {
    const PATH_TOKEN: &str = "old-chatwoot-path-token-0123";
    let tmp = tempfile::tempdir().expect("tempdir");
    let fake = FakeChatwoot::start();
    let app = spawn(
        tmp.path(),
        &fake.url,
        &format!("unsigned_path_token = \"{PATH_TOKEN}\""),
    );
    // Signed, but a message without its conversation: quarantined, 200.
    let broken = json!({"event": "message_created", "id": 1, "message_type": "outgoing"});
    let (status, body) = cw::deliver(&app, &broken, "d-broken");
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("quarantined")),
        "{body}"
    );
    let (_, records) = app.admin_get("/admin/v1/quarantine");
    assert!(
        records.to_string().contains("invalid_chatwoot_payload"),
        "{records}"
    );
    // An event the connector does not read: counted, ignored.
    let (status, body) = cw::deliver(&app, &json!({"event": "contact_created", "id": 3}), "d-c");
    assert_eq!(
        (status, body["kind"].as_str()),
        (200, Some("other_event")),
        "{body}"
    );
    // Unsigned: refused on the signed path, taken on the token's, refused with another token.
    let typing = json!({"event": "conversation_typing_on"});
    assert_eq!(
        post_unsigned(&app, "/helpdesk/chatwoot/webhook", &typing).0,
        401
    );
    let (status, body) = post_unsigned(
        &app,
        &format!("/helpdesk/chatwoot/webhook/{PATH_TOKEN}"),
        &typing,
    );
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("ignored")),
        "{body}"
    );
    let (status, _) = post_unsigned(
        &app,
        "/helpdesk/chatwoot/webhook/not-the-token-0123456",
        &typing,
    );
    assert_eq!(status, 401);
    assert_eq!(
        app.metric(r#"handoff_desk_webhooks_total{connector="chatwoot",kind="malformed",verdict="quarantined"}"#),
        1.0
    );
}

/// The agent API's listing of `phase` (with the desk token).
fn queue_ids(app: &TestApp, phase: &str) -> Vec<String> {
    let mut resp = app
        .agent
        .get(format!(
            "{}/helpdesk/v1/conversations?phase={phase}",
            app.base
        ))
        .header("authorization", format!("Bearer {DESK_TOKEN}"))
        .call()
        .expect("queue");
    let body: Value =
        serde_json::from_str(&resp.body_mut().read_to_string().unwrap_or_default()).expect("json");
    body["conversations"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["id"].as_str().map(str::to_owned))
        .collect()
}

const DESK_TOKEN: &str = "desk-token-for-the-queue-0123";

/// The console overview's figure `name`.
fn figure(page: &str, name: &str) -> String {
    let marker = format!("data-figure=\"{name}\">");
    let at = page
        .find(&marker)
        .map(|i| i + marker.len())
        .expect("figure");
    page[at..].split('<').next().unwrap_or_default().to_owned()
}

#[test]
fn a_wait_that_runs_out_leaves_the_queue_timed_out_and_the_queue_console_and_figures_agree() {
    use crate::common::browser::Browser;
    let tmp = tempfile::tempdir().expect("tempdir");
    let fake = FakeChatwoot::start();
    let app = spawn_with_env(
        tmp.path(),
        &fake.url,
        "",
        &[("HANDOFF_BRIDGE_HELPDESK_TOKENS", DESK_TOKEN)],
    );
    app.emulator_act(WEB, "request-agent", json!({}));
    app.settle();
    let opened = opened(&fake, WEB, 0);
    assert_eq!(queue_ids(&app, "requested"), [WEB]);
    let mut b = Browser::new(&app);
    b.sign_in(ADMIN_TOKEN, "Kim");
    assert_eq!(figure(&b.get("/console/").body, "waiting"), "1");

    // Five minutes: nobody took it; the rules hand the user back to the bot.
    app.advance_clock("5m");
    app.settle();
    assert!(queue_ids(&app, "requested").is_empty(), "out of the queue");
    assert_eq!(queue_ids(&app, "bot"), [WEB]);
    let overview = b.get("/console/").body;
    assert_eq!(figure(&overview, "waiting"), "0");
    assert_eq!(figure(&overview, "abandoned-24h"), "1");
    assert_eq!(
        app.metric(r#"handoff_queue_exits_total{outcome="timed_out"}"#),
        1.0
    );
    // Chatwoot heard the queue update of the wait and the hand-back, and resolved it.
    let c = fake.conversation(opened.id).expect("conversation");
    assert_eq!(c.status, "resolved");
    let notes: Vec<&str> = c
        .messages
        .iter()
        .filter(|m| m["private"] == true)
        .filter_map(|m| m["content"].as_str())
        .collect();
    assert!(
        notes
            .iter()
            .any(|n| n.contains("Still waiting") && n.contains("place in line: 1")),
        "{notes:?}"
    );
    assert!(
        notes.last().is_some_and(|n| n.contains("in time")),
        "{notes:?}"
    );
}

#[test]
fn the_satisfaction_survey_reaches_the_user_after_the_resolve_only_with_relay_csat() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (fake, app, c) = requested(tmp.path(), "relay_csat = true");
    let reply = cw::agent_reply(c.id, 9001, ALICE, "Done, anything else?");
    assert_eq!(cw::deliver(&app, &reply, "d-1").0, 200);
    assert_eq!(
        cw::deliver(&app, &cw::status_changed(c.id, "resolved"), "d-2").0,
        200
    );
    app.settle();
    let (survey, link) = survey(&fake, c.id);
    let (status, body) = cw::deliver(&app, &survey, "d-3");
    assert_eq!(
        (status, body["kind"].as_str()),
        (200, Some("csat")),
        "{body}"
    );
    app.settle();
    assert!(
        sent(&app, WEB).iter().any(|t| t.contains(&link)),
        "{:?}",
        sent(&app, WEB)
    );
}

/// What the bridge set the service's manual mode to, in order (calls that took effect).
pub(crate) fn manual_mode(app: &TestApp) -> Vec<Value> {
    app.journal()
        .into_iter()
        .filter(|e| e["endpoint"] == "set-manual" && took_effect(e))
        .map(|e| e["body"]["enabled"].clone())
        .collect()
}

#[test]
fn assigning_the_conversation_in_chatwoot_takes_it_for_that_agent() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (fake, app, c) = requested(tmp.path(), "");
    let (status, body) = cw::deliver(&app, &cw::assigned(c.id, ALICE), "d-assigned");
    assert_eq!(
        (status, body["status"].as_str(), body["kind"].as_str()),
        (200, Some("relayed"), Some("assignment")),
        "{body}"
    );
    app.settle();
    // Accepted as that agent: the service's manual mode on, Chatwoot told who took it.
    let desk = &state(&app, WEB)["desk"];
    assert_eq!(
        (desk["agent"]["id"].as_str(), desk["agent"]["name"].as_str()),
        (Some("chatwoot:5"), Some("Alice")),
        "{desk}"
    );
    assert_eq!(manual_mode(&app).last(), Some(&json!(true)));
    let notes: Vec<String> = fake
        .conversation(c.id)
        .expect("conversation")
        .messages
        .iter()
        .filter(|m| m["private"] == true)
        .filter_map(|m| m["content"].as_str().map(str::to_owned))
        .collect();
    assert!(
        notes
            .iter()
            .any(|n| n.contains("Taken by an agent") && n.contains("chatwoot:5")),
        "{notes:?}"
    );
    // The same assignment again (re-signed): stored once.
    let again = cw::deliver_with(
        &app,
        &cw::assigned(c.id, ALICE),
        "d-assigned-again",
        cw::SECRET,
        cw::now_secs() - 30,
    );
    assert_eq!(again.1["status"], "duplicate", "{}", again.1);
}

/// Chatwoot's survey after a resolve (`CsatSurveyService`'s template; the webhook's content is
/// its text and link).
fn survey(fake: &FakeChatwoot, conversation: u64) -> (Value, String) {
    let link = format!("{}/survey/responses/uuid-{conversation}", fake.url);
    let survey = cw::message_created(
        conversation,
        json!({"id": 9002, "message_type": "template", "content_type": "input_csat",
               "content": format!("Please rate this conversation, {link}"),
               "content_attributes": {"display_type": "emoji"}}),
    );
    (survey, link)
}

#[test]
fn without_relay_csat_the_survey_never_reaches_the_user() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (fake, app, c) = requested(tmp.path(), "relay_csat = false");
    let reply = cw::agent_reply(c.id, 9001, ALICE, "Done, anything else?");
    assert_eq!(cw::deliver(&app, &reply, "d-1").1["status"], "relayed");
    let resolved = cw::deliver(&app, &cw::status_changed(c.id, "resolved"), "d-2");
    assert_eq!(resolved.1["status"], "relayed", "{}", resolved.1);
    app.settle();
    let (survey, link) = survey(&fake, c.id);
    let (status, body) = cw::deliver(&app, &survey, "d-3");
    assert_eq!(
        (status, body["status"].as_str(), body["kind"].as_str()),
        (200, Some("ignored"), Some("template")),
        "{body}"
    );
    app.settle();
    let sent = sent(&app, WEB);
    assert!(sent.iter().any(|t| t == "Done, anything else?"), "{sent:?}");
    assert!(!sent.iter().any(|t| t.contains(&link)), "{sent:?}");
}

#[test]
fn the_survey_is_not_relayed_after_the_bridge_handed_back_a_user_nobody_answered() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (fake, app, c) = requested(tmp.path(), "relay_csat = true");
    // Nobody took it in five minutes: the bridge resolves it, and Chatwoot sends its survey.
    app.advance_clock("5m");
    app.settle();
    assert_eq!(fake.conversation(c.id).expect("c").status, "resolved");
    let (survey, link) = survey(&fake, c.id);
    let (status, body) = cw::deliver(&app, &survey, "d-survey");
    assert_eq!(
        (status, body["status"].as_str(), body["kind"].as_str()),
        (200, Some("ignored"), Some("closed")),
        "{body}"
    );
    app.settle();
    let sent = sent(&app, WEB);
    assert!(!sent.iter().any(|t| t.contains(&link)), "{sent:?}");
}
