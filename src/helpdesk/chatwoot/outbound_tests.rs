//! The outbound side's decisions, call by call: the connector against a scripted Chatwoot (a
//! loopback server answering each request with the next scripted answer, recording them all) and
//! the in-memory store, its writer one that notes each flush in the same record as the calls.

use super::client::{Api, NAME};
use super::Chatwoot;
use crate::config::chatwoot::ChatwootConfig;
use crate::helpdesk::port::{DeskError, DeskEvent};
use model::helpdesk::DeskEventKind;
use model::ids::ConversationId;
use model::secret::Secret;
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use storage::desk_links::{DeskContact, DeskLink};
use storage::port::{IntakeReply, IntakeWriter};
use storage::writer::{AcceptJob, WriterError};
use storage::Accepted;

const CONV: &str = "c-1";
const ACTION: &str = "e1/tell-helpdesk/0";
/// The bridge's identifier of the end user of [`CONV`] (no state: by its conversation).
const USER: &str = "handoff-bridge:conversation:c-1";

/// What happened, in order: `"POST /conversations"` for a call, `"flush <mark>"` for a flush
/// (with the link's mark of a call that may take effect, as the store holds it then).
type Record = Arc<Mutex<Vec<String>>>;

/// A scripted Chatwoot: answers requests in turn with `answers` (then 500), each recorded.
struct Scripted {
    url: String,
    answers: Arc<Mutex<VecDeque<(u16, Value)>>>,
}

impl Scripted {
    fn start(record: Record, answers: Vec<(u16, Value)>) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let answers = Arc::new(Mutex::new(VecDeque::from(answers)));
        let script = answers.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                let Some(line) = request_line(&stream) else {
                    continue;
                };
                lock(&record).push(line);
                let (status, body) = lock(&script)
                    .pop_front()
                    .unwrap_or((500, json!({"error": "unscripted"})));
                let text = body.to_string();
                let mut stream = stream;
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                    text.len()
                );
            }
        });
        Scripted { url, answers }
    }

    fn left(&self) -> usize {
        lock(&self.answers).len()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `METHOD /path` under the account (the body read and dropped).
fn request_line(stream: &std::net::TcpStream) -> Option<String> {
    let mut reader = BufReader::new(stream);
    let mut first = String::new();
    reader.read_line(&mut first).ok()?;
    let mut length = 0;
    loop {
        let mut header = String::new();
        reader.read_line(&mut header).ok()?;
        let header = header.trim();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    let mut parts = first.split_whitespace();
    let (method, target) = (parts.next()?, parts.next()?);
    let path = target.strip_prefix("/api/v1/accounts/1").unwrap_or(target);
    Some(format!("{method} {path}"))
}

/// A writer whose flushes are noted in the record, with the link's mark as the store has it.
struct Noting {
    store: storage::Store,
    record: Record,
}

impl IntakeWriter for Noting {
    fn accept(&self, _job: AcceptJob, reply: IntakeReply<Accepted>) {
        let _ = reply.send(Err(WriterError::Stopped));
    }
    fn flush(&self, reply: IntakeReply<()>) {
        self.flush_own(reply);
    }
    fn flush_own(&self, reply: IntakeReply<()>) {
        let link = self.store.desk_link(NAME, &ConversationId::new(CONV));
        let mark = link.ok().flatten().and_then(|l| l.uncertain);
        lock(&self.record).push(format!("flush {}", mark.unwrap_or_default()));
        let _ = reply.send(Ok(()));
    }
    fn is_healthy(&self) -> bool {
        true
    }
    fn store(&self) -> tokio::sync::watch::Receiver<Option<storage::Store>> {
        tokio::sync::watch::channel(Some(self.store.clone())).1
    }
    fn handed_over(&self) -> Option<u64> {
        Some(0)
    }
}

/// The connector against `answers`, on a fresh in-memory store; the record of calls and flushes.
fn connector(answers: Vec<(u16, Value)>) -> (Chatwoot, Scripted, Record) {
    // The HTTP client's thread belongs to the test thread's actix system.
    RUNNER.with(|r| *r.borrow_mut() = Some(actix_rt::System::new()));
    let record = Record::default();
    let chatwoot = Scripted::start(record.clone(), answers);
    let store: storage::Store = Arc::new(storage::mem::MemStore::new());
    let tls =
        upstream::tls::ClientTls::new(&upstream::tls::Trust::empty(), "", NAME, None).expect("tls");
    let http = upstream::handle::TransportHandle::start(
        Duration::from_secs(5),
        Duration::from_secs(5),
        tls,
    )
    .expect("client");
    let metrics = crate::ops::metrics::Metrics::new().expect("metrics");
    let token = Secret::new("token-0123456789");
    let api = Api::new(&chatwoot.url, 1, token, http, (metrics, Arc::default()));
    let writer = Arc::new(OnceLock::new());
    let noting = Noting {
        store: store.clone(),
        record: record.clone(),
    };
    let _ = writer.set(storage::Writer::new(Arc::new(noting)));
    let connector = Chatwoot {
        api,
        config: config(&chatwoot.url),
        store,
        writer,
    };
    (connector, chatwoot, record)
}

fn config(url: &str) -> ChatwootConfig {
    ChatwootConfig {
        url: url.to_owned(),
        account_id: 1,
        inbox_id: 7,
        api_token: Secret::new("token-0123456789"),
        api_token_file: String::new(),
        webhook_secret: Secret::new("secret-0123456789"),
        webhook_secret_file: String::new(),
        relay_csat: false,
        unsigned_path_token: Secret::default(),
        ca_file: String::new(),
        bots: BTreeMap::new(),
    }
}

fn event(kind: DeskEventKind) -> DeskEvent {
    DeskEvent {
        action_id: ACTION.to_owned(),
        kind,
        occurred_at: 1,
        conversation_id: ConversationId::new(CONV),
        conversation: None,
        end_user: None,
        reason: None,
        payload: Value::Null,
        message: None,
        transcript: None,
        queue: None,
        body: Vec::new(),
    }
}

/// A user's message `id` of [`CONV`].
fn user_message(id: &str) -> DeskEvent {
    let mut e = event(DeskEventKind::ConversationMessage);
    e.action_id = format!("e-{id}/helpdesk-message/0");
    let message = json!({"id": id, "conversationId": CONV, "isUser": true,
                         "data": {"type": "text", "text": "hello?"}});
    e.message = Some(serde_json::from_value(message).expect("a message"));
    e
}

fn link(remote: Option<&str>) -> DeskLink {
    DeskLink {
        connector: NAME.to_owned(),
        conversation_id: CONV.to_owned(),
        remote: remote.map(str::to_owned),
        opened_by: ACTION.to_owned(),
        ..DeskLink::default()
    }
}

/// The end user's contact 9, kept with its source id in inbox 7.
fn kept_contact(c: &Chatwoot) {
    let contact = DeskContact {
        connector: NAME.to_owned(),
        user: USER.to_owned(),
        contact: "9".to_owned(),
        extra: json!({"7": "src-9"}),
        updated_at: 1,
    };
    c.store.put_desk_contact(&contact).expect("put");
}

fn stored(c: &Chatwoot) -> DeskLink {
    let link = c.store.desk_link(NAME, &ConversationId::new(CONV));
    link.expect("read").expect("a link")
}

thread_local! {
    static RUNNER: std::cell::RefCell<Option<actix_rt::SystemRunner>> =
        const { std::cell::RefCell::new(None) };
}

/// `f` on the test thread's actix system (made by [`connector`]).
fn run<F: std::future::Future>(f: F) -> F::Output {
    RUNNER.with(|r| r.borrow().as_ref().expect("a connector first").block_on(f))
}

fn calls(record: &Record) -> Vec<String> {
    lock(record)
        .iter()
        .filter(|l| !l.starts_with("flush"))
        .cloned()
        .collect()
}

/// A conversation the create answers, named for [`ACTION`].
fn created(id: u64) -> (u16, Value) {
    let attributes = json!({"handoff_action": ACTION});
    (
        200,
        json!({"id": id, "status": "open", "custom_attributes": attributes}),
    )
}

#[test]
fn each_mark_is_flushed_through_the_writer_before_its_call() {
    let (c, script, record) = connector(vec![created(41), (200, json!({})), (200, json!({}))]);
    kept_contact(&c);
    let mut e = event(DeskEventKind::HandoffRequested);
    let first = json!({"id": "m1", "conversationId": CONV, "isUser": true,
                       "data": {"type": "text", "text": "I need a person"}});
    e.transcript = Some(crate::helpdesk::events::Transcript {
        messages: vec![serde_json::from_value(first).expect("a message")],
        complete: true,
    });
    run(c.carry_out(&e, false)).expect("opened");
    let record = lock(&record).clone();
    let before = |call: &str| {
        let at = record.iter().position(|l| l == call).expect(call);
        record[at - 1].clone()
    };
    assert_eq!(before("POST /conversations"), "flush conversation");
    assert_eq!(
        before("POST /conversations/41/messages"),
        "flush handoff-bridge:msg:m1"
    );
    assert_eq!(script.left(), 0);
    let l = stored(&c);
    assert_eq!((l.remote.as_deref(), l.uncertain), (Some("41"), None));
}

#[test]
fn a_create_marked_under_way_is_looked_for_by_its_action_before_creating() {
    // A crash after the create: the mark is on disk, the attempt was never counted.
    let found = json!({"payload": [
        {"id": 40, "custom_attributes": {"handoff_action": "e0/tell-helpdesk/0"}},
        {"id": 41, "custom_attributes": {"handoff_action": ACTION}}
    ]});
    let (c, _script, record) = connector(vec![(200, found), (200, json!({}))]);
    kept_contact(&c);
    let mut l = link(None);
    l.uncertain = Some("conversation".to_owned());
    c.store.put_desk_link(&l).expect("put");
    run(c.carry_out(&event(DeskEventKind::HandoffRequested), false)).expect("resumed");
    assert_eq!(
        calls(&record),
        [
            "GET /contacts/9/conversations",
            "POST /conversations/41/labels"
        ]
    );
    assert_eq!(stored(&c).remote.as_deref(), Some("41"));
    // After a failed attempt (`again`) it is looked for too, mark or not.
    assert!(super::outbound::again_or_uncertain(&link(None), true));
    assert!(!super::outbound::again_or_uncertain(&link(None), false));
}

#[test]
fn a_contact_that_exists_already_422_is_found_and_used() {
    let none = json!({"payload": []});
    let found = json!({"payload": [
        {"id": 8, "identifier": format!("{USER}-other"), "contact_inboxes": []},
        {"id": 9, "identifier": USER,
         "contact_inboxes": [{"source_id": "src-9", "inbox": {"id": 7}}]}
    ]});
    let (c, _script, record) = connector(vec![
        (200, none),
        (422, json!({"message": "Identifier has already been taken"})),
        (200, found),
        created(41),
        (200, json!({})),
    ]);
    run(c.carry_out(&event(DeskEventKind::HandoffRequested), false)).expect("opened");
    let calls = calls(&record);
    assert_eq!(calls[1], "POST /contacts");
    assert!(calls[2].starts_with("GET /contacts/search?q="), "{calls:?}");
    assert_eq!(calls[3], "POST /conversations");
    let kept = c
        .store
        .desk_contact(NAME, USER)
        .expect("read")
        .expect("kept");
    assert_eq!(
        (kept.contact.as_str(), &kept.extra["7"]),
        ("9", &json!("src-9"))
    );
}

#[test]
fn an_uncertain_post_is_looked_for_and_not_posted_again() {
    let listed = json!({"payload": [{"id": 7, "source_id": "handoff-bridge:msg:m2"}]});
    let (c, _script, record) = connector(vec![(200, listed)]);
    let mut l = link(Some("41"));
    l.uncertain = Some("handoff-bridge:msg:m2".to_owned());
    c.store.put_desk_link(&l).expect("put");
    run(c.carry_out(&user_message("m2"), false)).expect("found there");
    assert_eq!(calls(&record), ["GET /conversations/41/messages"]);
    let l = stored(&c);
    assert!(l.was_posted("handoff-bridge:msg:m2") && l.uncertain.is_none());
}

#[test]
fn with_no_conversation_a_user_message_fails_and_the_hand_back_closes_anyway() {
    let (c, _script, record) = connector(Vec::new());
    // No mapping at all, then one whose handoff.requested failed for good (not in the outbox).
    for stored_link in [None, Some(link(None))] {
        if let Some(l) = &stored_link {
            c.store.put_desk_link(l).expect("put");
        }
        let failed = run(c.carry_out(&user_message("m3"), false));
        assert!(
            matches!(
                &failed,
                Err(DeskError::Unusable {
                    reason: "not_opened",
                    ..
                })
            ),
            "{failed:?}"
        );
    }
    let queue = run(c.carry_out(&event(DeskEventKind::QueueUpdated), false));
    assert!(
        matches!(queue, Err(DeskError::Unusable { .. })),
        "{queue:?}"
    );
    let mut timed_out = event(DeskEventKind::HandoffTimedOut);
    timed_out.action_id = "e9/helpdesk-timed-out/0".to_owned();
    run(c.carry_out(&timed_out, false)).expect("closed");
    assert!(stored(&c).closed_at.is_some());
    // A retry of the failed request from the console, after its end: nothing opened.
    run(c.carry_out(&event(DeskEventKind::HandoffRequested), true)).expect("nothing to do");
    // Handed back: a note has nowhere to go, and needs none.
    run(c.carry_out(&event(DeskEventKind::HandoffReminder), false)).expect("nothing to do");
    assert!(calls(&record).is_empty(), "{:?}", calls(&record));
}

#[test]
fn a_deleted_conversation_is_closed_at_the_hand_back_and_becomes_an_earlier_one() {
    let (c, _script, record) = connector(vec![
        (422, json!({"error": "refused"})),
        (404, json!({"error": "Resource could not be found"})),
    ]);
    c.store.put_desk_link(&link(Some("41"))).expect("put");
    run(c.carry_out(&event(DeskEventKind::HandoffTimedOut), false)).expect("handed back");
    // The refused note did not stop it; a resolve that finds nothing needs nothing more.
    assert_eq!(
        calls(&record),
        [
            "POST /conversations/41/messages",
            "POST /conversations/41/toggle_status"
        ]
    );
    let l = stored(&c);
    assert!(l.closed_at.is_some());
    assert_eq!((l.remote, l.earlier), (None, vec!["41".to_owned()]));
}

#[test]
fn a_conversation_deleted_mid_handoff_lets_the_next_request_open_anew() {
    let (c, _script, record) = connector(vec![
        (404, json!({"error": "Resource could not be found"})),
        created(42),
        (200, json!({})),
    ]);
    kept_contact(&c);
    let mut l = link(Some("41"));
    l.opened_by = "e0/tell-helpdesk/0".to_owned();
    c.store.put_desk_link(&l).expect("put");
    run(c.carry_out(&event(DeskEventKind::HandoffRequested), false)).expect("opened anew");
    assert_eq!(
        calls(&record),
        [
            "POST /conversations/41/messages",
            "POST /conversations",
            "POST /conversations/42/labels"
        ]
    );
    let l = stored(&c);
    assert_eq!(
        (l.remote.as_deref(), l.earlier),
        (Some("42"), vec!["41".to_owned()])
    );
}

#[test]
fn a_kept_contact_chatwoot_deleted_is_found_or_made_again() {
    let (c, _script, record) = connector(vec![
        (404, json!({"error": "contact inbox not found"})),
        (200, json!({"payload": []})),
        (
            200,
            json!({"payload": {"contact": {"id": 12}, "contact_inbox": {"source_id": "src-12"}}}),
        ),
        created(42),
        (200, json!({})),
    ]);
    kept_contact(&c);
    run(c.carry_out(&event(DeskEventKind::HandoffRequested), false)).expect("opened");
    let calls = calls(&record);
    assert_eq!(calls.len(), 5, "{calls:?}");
    assert_eq!(
        (calls[0].as_str(), calls[3].as_str()),
        ("POST /conversations", "POST /conversations")
    );
    let kept = c
        .store
        .desk_contact(NAME, USER)
        .expect("read")
        .expect("kept");
    assert_eq!(
        (kept.contact.as_str(), &kept.extra["7"]),
        ("12", &json!("src-12"))
    );
    assert_eq!(stored(&c).contact.as_deref(), Some("12"));
}

#[test]
fn a_conversation_chatwoot_answers_from_before_is_opened_again_for_this_handoff() {
    let before = json!({"id": 41, "status": "resolved",
                        "custom_attributes": {"handoff_action": "e0/tell-helpdesk/0"}});
    let listed = json!({"payload": [{"id": 5, "source_id": "handoff-bridge:msg:m1"}]});
    let (c, _script, record) = connector(vec![
        (200, before),
        (200, json!({})),
        (200, json!({})),
        (200, listed),
        (200, json!({})),
    ]);
    kept_contact(&c);
    let mut l = link(Some("41"));
    l.opened_by = "e0/tell-helpdesk/0".to_owned();
    l.closed_at = Some(1);
    c.store.put_desk_link(&l).expect("put");
    run(c.carry_out(&event(DeskEventKind::HandoffRequested), false)).expect("opened");
    assert_eq!(
        calls(&record),
        [
            "POST /conversations",
            "POST /conversations/41/toggle_status",
            "POST /conversations/41/custom_attributes",
            "GET /conversations/41/messages",
            "POST /conversations/41/labels"
        ]
    );
    let l = stored(&c);
    assert_eq!((l.remote.as_deref(), l.closed_at), (Some("41"), None));
    assert!(l.earlier.is_empty() && l.was_posted("handoff-bridge:msg:m1"));
}

#[test]
fn an_action_names_its_event_and_listings_are_read_exactly() {
    use super::outbound::{by_action, event_of_action, posted_in};
    assert_eq!(event_of_action("e/1/tell-helpdesk/0"), Some("e/1"));
    assert_eq!(event_of_action("tell-helpdesk/0"), None);
    let listed = json!({"payload": [{"source_id": "handoff-bridge:msg:m10"}, {"source_id": null}]});
    assert!(posted_in(&listed, "handoff-bridge:msg:m10"));
    assert!(!posted_in(&listed, "handoff-bridge:msg:m1"));
    assert!(!posted_in(&json!({"error": "x"}), "handoff-bridge:msg:m10"));
    let conversations = json!({"payload": [{"id": 3, "custom_attributes": null}]});
    assert_eq!(by_action(&conversations, ACTION), None);
}
