//! A stateful fake Chatwoot on 127.0.0.1 for the connector's behaviour tests: the account API
//! operations the bridge calls, answered as Chatwoot's running code answers them
//! (`../shared/chatwoot/README.md`: `payload.contact` on a create, the search matching
//! substrings, labels replacing the list, an `incoming` message reopening a resolved conversation,
//! `lock_to_single_conversation`, 401 without the token, 404 for what was deleted), every call
//! recorded, a create's answer held back on request (a crash before it comes); and the webhooks
//! Chatwoot sends, built as its payload builders build them and signed as `Webhooks::Trigger`
//! signs them (`sha256=` + hex HMAC-SHA256 of `"{timestamp}.{body}"`), written here from the
//! README, not from the bridge's code.

use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;
use std::collections::HashMap;
use std::io::Write;
use std::net::TcpListener;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

pub const ACCOUNT: u64 = 1;
pub const INBOX: u64 = 7;
pub const TOKEN: &str = "cw-admin-token-0123456789";
pub const SECRET: &str = "cw-inbox-webhook-secret-0123";

/// One call the fake received, and what it answered.
#[derive(Clone, Debug)]
pub struct Call {
    pub method: String,
    /// Path and query, under the account (`/contacts/search?q=...`).
    pub path: String,
    pub body: Value,
    pub status: u16,
}

#[derive(Clone, Debug, Default)]
pub struct Conversation {
    pub id: u64,
    pub contact_id: u64,
    pub inbox_id: u64,
    pub status: String,
    pub team_id: Option<u64>,
    pub labels: Vec<String>,
    pub custom_attributes: Value,
    pub messages: Vec<Value>,
}

#[derive(Default)]
struct State {
    contacts: Vec<Value>,
    conversations: Vec<Conversation>,
    calls: Vec<Call>,
    token: String,
    lock_to_single_conversation: bool,
    next_id: u64,
}

/// The fake: `url` is its base (what `helpdesk.chatwoot.url` names).
#[derive(Clone)]
pub struct FakeChatwoot {
    pub url: String,
    pub addr: std::net::SocketAddr,
    state: Arc<Mutex<State>>,
    /// While true, a conversation's create is made but its answer waits (see [`hold_creates`]).
    hold: Arc<(Mutex<bool>, Condvar)>,
}

impl FakeChatwoot {
    pub fn start() -> FakeChatwoot {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let fake = FakeChatwoot {
            url: format!("http://{addr}"),
            addr,
            state: Arc::new(Mutex::new(State {
                token: TOKEN.to_owned(),
                next_id: 100,
                ..State::default()
            })),
            hold: Arc::default(),
        };
        let server = fake.clone();
        // Serves until the test process ends; every read is bounded by a timeout.
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                let server = server.clone();
                std::thread::spawn(move || server.serve(stream));
            }
        });
        fake
    }

    /// The token it accepts from now on (another answers 401, as a revoked one does).
    pub fn set_token(&self, token: &str) {
        self.state().token = token.to_owned();
    }

    pub fn lock_to_single_conversation(&self) {
        self.state().lock_to_single_conversation = true;
    }

    /// From now on a conversation's create takes effect (it is in [`conversations`]) but its
    /// answer waits until [`release`]: the bridge's call has happened, its answer not yet.
    pub fn hold_creates(&self) {
        *self.hold.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
    }

    /// Held answers go (to whoever still waits for them), and creates answer at once again.
    pub fn release(&self) {
        *self.hold.0.lock().unwrap_or_else(|e| e.into_inner()) = false;
        self.hold.1.notify_all();
    }

    /// An agent deletes the conversation in Chatwoot: its routes answer 404.
    pub fn delete_conversation(&self, id: u64) {
        self.state().conversations.retain(|c| c.id != id);
    }

    /// An agent deletes the contact: its conversations and contact inboxes go with it.
    pub fn delete_contact(&self, id: u64) {
        let mut state = self.state();
        state.contacts.retain(|c| c["id"] != id);
        state.conversations.retain(|c| c.contact_id != id);
    }

    pub fn calls(&self) -> Vec<Call> {
        self.state().calls.clone()
    }

    pub fn conversations(&self) -> Vec<Conversation> {
        self.state().conversations.clone()
    }

    pub fn contacts(&self) -> Vec<Value> {
        self.state().contacts.clone()
    }

    pub fn conversation(&self, id: u64) -> Option<Conversation> {
        self.conversations().into_iter().find(|c| c.id == id)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One request per connection (answered with `connection: close`).
    fn serve(&self, stream: std::net::TcpStream) {
        let Some(request) = super::helpdesk::read_request(&stream) else {
            return;
        };
        let super::helpdesk::Request {
            method,
            target,
            headers,
            body,
        } = request;
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let (status, answer) = self.answer(&method, &target, &headers, &body);
        if method == "POST" && target == format!("/api/v1/accounts/{ACCOUNT}/conversations") {
            let (held, released) = &*self.hold;
            let mut held = held.lock().unwrap_or_else(|e| e.into_inner());
            while *held {
                held = released.wait(held).unwrap_or_else(|e| e.into_inner());
            }
        }
        let text = answer.to_string();
        let mut stream = stream;
        let _ = write!(
            stream,
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
            text.len()
        );
        let _ = stream.flush();
    }

    fn answer(
        &self,
        method: &str,
        target: &str,
        headers: &HashMap<String, String>,
        body: &Value,
    ) -> (u16, Value) {
        let prefix = format!("/api/v1/accounts/{ACCOUNT}");
        let path = target.strip_prefix(&prefix).unwrap_or(target).to_owned();
        let mut state = self.state();
        let (status, answer) =
            if headers.get("api_access_token").map(String::as_str) != Some(state.token.as_str()) {
                (401, json!({"error": "Invalid Access Token"}))
            } else if !target.starts_with(&prefix) {
                (404, json!({"error": "not found"}))
            } else {
                route(&mut state, method, &path, body)
            };
        state.calls.push(Call {
            method: method.to_owned(),
            path,
            body: body.clone(),
            status,
        });
        (status, answer)
    }
}

/// The account API's routes the connector uses.
fn route(state: &mut State, method: &str, path: &str, body: &Value) -> (u16, Value) {
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match (method, segments.as_slice()) {
        ("GET", ["contacts", "search"]) => search(state, query),
        ("POST", ["contacts"]) => create_contact(state, body),
        ("POST", ["contacts", id, "contact_inboxes"]) => add_inbox(state, id, body),
        ("GET", ["contacts", id, "conversations"]) => {
            let id: u64 = id.parse().unwrap_or(0);
            let all: Vec<Value> = state
                .conversations
                .iter()
                .filter(|c| c.contact_id == id)
                .map(conversation_json)
                .collect();
            (200, json!({ "payload": all }))
        }
        ("POST", ["conversations"]) => create_conversation(state, body),
        (_, ["conversations", id, rest @ ..]) => {
            let id: u64 = id.parse().unwrap_or(0);
            match state.conversations.iter().position(|c| c.id == id) {
                Some(at) => conversation_route(state, at, method, rest, body),
                None => (404, json!({"error": "Resource could not be found"})),
            }
        }
        _ => (404, json!({"error": "no route"})),
    }
}

/// A conversation's own routes: labels, messages, status.
fn conversation_route(
    state: &mut State,
    at: usize,
    method: &str,
    rest: &[&str],
    body: &Value,
) -> (u16, Value) {
    state.next_id += 1;
    let next = state.next_id;
    let c = &mut state.conversations[at];
    match (method, rest) {
        ("GET", []) => (200, conversation_json(c)),
        ("POST", ["labels"]) => {
            // Replaces the list (`LabelConcern#create`).
            c.labels = body["labels"]
                .as_array()
                .map(|l| {
                    l.iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            (200, json!({"payload": c.labels}))
        }
        ("POST", ["messages"]) => post_message(c, next, body),
        ("GET", ["messages"]) => {
            let newest: Vec<Value> = c.messages.iter().rev().take(20).rev().cloned().collect();
            (200, json!({"meta": {}, "payload": newest}))
        }
        ("POST", ["custom_attributes"]) => {
            // Replaces them (`ConversationsController#custom_attributes`).
            c.custom_attributes = body["custom_attributes"].clone();
            (200, json!({"custom_attributes": c.custom_attributes}))
        }
        ("POST", ["toggle_status"]) => {
            let status = body["status"].as_str().unwrap_or("resolved").to_owned();
            c.status = status.clone();
            (
                200,
                json!({"meta": {}, "payload": {"success": true, "current_status": status, "conversation_id": c.id}}),
            )
        }
        _ => (404, json!({"error": "no route"})),
    }
}

fn post_message(c: &mut Conversation, id: u64, body: &Value) -> (u16, Value) {
    let Some(content) = body["content"].as_str() else {
        return (422, json!({"error": "content is required"}));
    };
    let incoming = body["message_type"] == "incoming";
    // An incoming message in a resolved API-inbox conversation reopens it.
    if incoming && c.status == "resolved" {
        c.status = "open".into();
    }
    let message = json!({
        "id": id, "content": content, "conversation_id": c.id,
        "message_type": if incoming { 0 } else { 1 },
        "private": body["private"].as_bool().unwrap_or(false),
        "source_id": body["source_id"], "created_at": 1_718_870_043,
        "sender_type": if incoming { "Contact" } else { "User" },
    });
    c.messages.push(message.clone());
    (200, message)
}

fn create_conversation(state: &mut State, body: &Value) -> (u16, Value) {
    let source = body["source_id"].as_str().unwrap_or_default();
    let contact = state.contacts.iter().find(|c| {
        c["contact_inboxes"]
            .as_array()
            .is_some_and(|l| l.iter().any(|ci| ci["source_id"] == source))
    });
    let Some(contact_id) = contact.and_then(|c| c["id"].as_u64()) else {
        return (404, json!({"error": "contact inbox not found"}));
    };
    let inbox = body["inbox_id"].as_u64().unwrap_or(INBOX);
    if state.lock_to_single_conversation {
        // `ConversationBuilder#look_up_exising_conversation`: the last one, whatever its status.
        if let Some(last) = state
            .conversations
            .iter()
            .rev()
            .find(|c| c.contact_id == contact_id && c.inbox_id == inbox)
        {
            return (200, conversation_json(last));
        }
    }
    state.next_id += 1;
    let c = Conversation {
        id: state.next_id,
        contact_id,
        inbox_id: inbox,
        status: body["status"].as_str().unwrap_or("open").to_owned(),
        team_id: body["team_id"].as_u64(),
        labels: Vec::new(),
        custom_attributes: body["custom_attributes"].clone(),
        messages: Vec::new(),
    };
    let answer = conversation_json(&c);
    state.conversations.push(c);
    (200, answer)
}

fn conversation_json(c: &Conversation) -> Value {
    json!({
        "id": c.id, "uuid": format!("uuid-{}", c.id), "account_id": ACCOUNT, "inbox_id": c.inbox_id,
        "status": c.status, "labels": c.labels, "custom_attributes": c.custom_attributes,
        "meta": {"assignee": null, "team": c.team_id.map(|t| json!({"id": t}))},
    })
}

fn search(state: &State, query: &str) -> (u16, Value) {
    let q = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("q="))
        .map(|q| {
            percent_encoding::percent_decode_str(q)
                .decode_utf8_lossy()
                .into_owned()
        })
        .unwrap_or_default();
    // Substrings, as `ContactsController#search` matches (`ILIKE %q%`).
    let found: Vec<Value> = state
        .contacts
        .iter()
        .filter(|c| {
            ["identifier", "name", "email"]
                .iter()
                .any(|f| c[f].as_str().is_some_and(|v| v.contains(&q)))
        })
        .cloned()
        .collect();
    (
        200,
        json!({"meta": {"count": found.len(), "has_more": false}, "payload": found}),
    )
}

fn create_contact(state: &mut State, body: &Value) -> (u16, Value) {
    let identifier = body["identifier"].as_str().unwrap_or_default().to_owned();
    if body["inbox_id"].as_u64().is_none() {
        return (400, json!({"message": "inbox_id is required"}));
    }
    if !identifier.is_empty() && state.contacts.iter().any(|c| c["identifier"] == identifier) {
        return (422, json!({"message": "Identifier has already been taken"}));
    }
    state.next_id += 1;
    let id = state.next_id;
    let source_id = body["source_id"]
        .as_str()
        .map_or_else(|| format!("src-{id}"), str::to_owned);
    let inbox = body["inbox_id"].as_u64().unwrap_or_default();
    let contact = json!({
        "id": id, "name": body["name"], "identifier": identifier, "email": null,
        "contact_inboxes": [{"source_id": source_id, "inbox": {"id": inbox}}],
    });
    state.contacts.push(contact.clone());
    (
        200,
        json!({"payload": {"contact": contact, "contact_inbox": {"source_id": source_id, "inbox_id": inbox}}}),
    )
}

fn add_inbox(state: &mut State, id: &str, body: &Value) -> (u16, Value) {
    let id: u64 = id.parse().unwrap_or(0);
    let Some(contact) = state.contacts.iter_mut().find(|c| c["id"] == id) else {
        return (404, json!({"error": "Resource could not be found"}));
    };
    let source = body["source_id"].as_str().unwrap_or("generated").to_owned();
    let inbox = body["inbox_id"].clone();
    if let Some(list) = contact["contact_inboxes"].as_array_mut() {
        list.push(json!({"source_id": source, "inbox": {"id": inbox}}));
    }
    (200, json!({"source_id": source, "inbox": {"id": inbox}}))
}

/// `sha256=` + lowercase hex HMAC-SHA256 of `"{timestamp}.{body}"` (`Webhooks::Trigger`).
pub fn sign(secret: &str, timestamp: &str, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("any key length");
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    let hex: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256={hex}")
}

pub fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Post `payload` to the bridge's Chatwoot webhook as Chatwoot would: signed with `secret` at
/// `timestamp`, under `delivery`. Answers (status, body).
pub fn deliver_with(
    app: &super::TestApp,
    payload: &Value,
    delivery: &str,
    secret: &str,
    timestamp: i64,
) -> (u16, Value) {
    let body = payload.to_string();
    let ts = timestamp.to_string();
    let req = ureq::http::Request::builder()
        .method("POST")
        .uri(format!("{}/helpdesk/chatwoot/webhook", app.base))
        .header("content-type", "application/json")
        .header("accept", "application/json")
        .header("x-chatwoot-delivery", delivery)
        .header("x-chatwoot-timestamp", &ts)
        .header("x-chatwoot-signature", sign(secret, &ts, body.as_bytes()))
        .body(body)
        .expect("request");
    let mut resp = app.agent.run(req).expect("post the webhook");
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// [`deliver_with`] the inbox's secret, now.
pub fn deliver(app: &super::TestApp, payload: &Value, delivery: &str) -> (u16, Value) {
    deliver_with(app, payload, delivery, SECRET, now_secs())
}

/// `message_created` of a message (`Message#webhook_data`): `message_type` as its name,
/// `sender` as `User#webhook_data` (`type: "user"`) or null.
pub fn message_created(conversation: u64, message: Value) -> Value {
    let mut body = json!({
        "event": "message_created",
        "account": {"id": ACCOUNT, "name": "Acme"},
        "additional_attributes": {}, "content_attributes": {}, "content_type": "text",
        "conversation": {"id": conversation, "inbox_id": INBOX, "status": "open", "channel": "Channel::Api"},
        "created_at": "2026-06-20T09:14:03.512Z", "id": 9000,
        "inbox": {"id": INBOX, "name": "Bridge"},
        "message_type": "outgoing", "private": false, "sender": null, "source_id": null,
    });
    if let (Some(b), Value::Object(m)) = (body.as_object_mut(), message) {
        b.extend(m);
    }
    body
}

/// An agent's (a user's) reply.
pub fn agent_reply(conversation: u64, id: u64, agent: (u64, &str), text: &str) -> Value {
    message_created(
        conversation,
        json!({"id": id, "content": text,
               "sender": {"id": agent.0, "name": agent.1, "email": "a@example.com", "type": "user"}}),
    )
}

/// The webhook Chatwoot sends for a message the bridge posted (its echo).
pub fn echo_of(conversation: u64, posted: &Value) -> Value {
    let incoming = posted["message_type"] == 0;
    message_created(
        conversation,
        json!({
            "id": posted["id"], "content": posted["content"], "private": posted["private"],
            "source_id": posted["source_id"],
            "message_type": if incoming { "incoming" } else { "outgoing" },
            "sender": if incoming { json!({"id": 1, "name": "user"}) }
                      else { json!({"id": 1, "name": "Admin", "type": "user"}) },
        }),
    )
}

/// `conversation_updated` assigning `agent` (`changed_attributes` from `previous_changes`).
pub fn assigned(conversation: u64, agent: (u64, &str)) -> Value {
    json!({
        "event": "conversation_updated", "id": conversation, "status": "open",
        "account": {"id": ACCOUNT, "name": "Acme"}, "inbox_id": INBOX,
        "changed_attributes": [
            {"assignee_id": {"previous_value": null, "current_value": agent.0}},
            {"updated_at": {"previous_value": 1.5, "current_value": 2.5}}
        ],
        "meta": {"assignee": {"id": agent.0, "name": agent.1, "type": "user"}, "assignee_type": "User"},
    })
}

/// `conversation_status_changed` (its `changed_attributes` is null in practice).
pub fn status_changed(conversation: u64, status: &str) -> Value {
    json!({
        "event": "conversation_status_changed", "id": conversation, "status": status,
        "account": {"id": ACCOUNT, "name": "Acme"}, "inbox_id": INBOX,
        "changed_attributes": null, "meta": {"assignee": null, "assignee_type": null},
    })
}
