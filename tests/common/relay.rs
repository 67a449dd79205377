//! Deliveries of user messages to the emulator's seeded conversations, and a daemon running a
//! rule file of the test's own against a generously rate-limited upstream, and the emulator's
//! control API (faults, journal): shared by the outbox tests and the fault suite.

use super::{agent, delivery};
use ::emulator::JournalEntry;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// Conversations of the emulator's default seed (`deploy/emulator-seed.json`):
/// (conversation id, end user id, bot id).
pub const SEEDED: [(&str, &str, &str); 4] = [
    (
        "5c0e9b1f-2222-4d3e-9f10-000000000001",
        "4e6f0d0a-1111-4a5b-8c9d-000000000001",
        "B7f3a2c",
    ),
    (
        "5c0e9b1f-2222-4d3e-9f10-000000000002",
        "4e6f0d0a-1111-4a5b-8c9d-000000000002",
        "B7f3a2c",
    ),
    (
        "5c0e9b1f-2222-4d3e-9f10-000000000003",
        "4e6f0d0a-1111-4a5b-8c9d-000000000003",
        "B7f3a2c",
    ),
    (
        "5c0e9b1f-2222-4d3e-9f10-000000000004",
        "4e6f0d0a-1111-4a5b-8c9d-000000000004",
        "B2c9d10",
    ),
];

pub const SEND_MESSAGE: &str = "send-conversation-message";
pub const UPDATE_CONVERSATION: &str = "update-conversation";
pub const EMULATOR_KEY: &str = "outbox-integration-emulator-key-4411";

// ---- Talking to the emulator's control API ----

pub fn emu_call(method: &str, url: &str, body: Option<&Value>) -> (u16, Value) {
    let agent = agent();
    let result = match (method, body) {
        ("GET", _) => agent.get(url).call(),
        ("DELETE", _) => agent.delete(url).call(),
        ("POST", Some(b)) => agent
            .post(url)
            .header("content-type", "application/json")
            .send(b.to_string().as_bytes()),
        ("POST", None) => agent.post(url).send_empty(),
        _ => panic!("unsupported method {method}"),
    };
    let mut resp = result.unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    let status = resp.status().as_u16();
    // The journal of a long kill loop is tens of MB: past ureq's default 10 MB limit.
    let text = resp
        .body_mut()
        .with_config()
        .limit(1 << 30)
        .read_to_string()
        .unwrap_or_else(|e| panic!("{method} {url}: reading the answer: {e}"));
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

pub fn set_faults(emu: &str, faults: Value) {
    let (status, body) = emu_call("POST", &format!("{emu}/_emulator/faults"), Some(&faults));
    assert_eq!(status, 200, "faults refused: {body}");
}

pub fn clear_faults(emu: &str) {
    let (status, body) = emu_call("DELETE", &format!("{emu}/_emulator/faults"), None);
    assert_eq!(status, 204, "{body}");
}

pub fn journal(emu: &str) -> Vec<JournalEntry> {
    let (status, body) = emu_call("GET", &format!("{emu}/_emulator/journal"), None);
    assert_eq!(status, 200, "{body}");
    serde_json::from_value(body).expect("journal entries")
}

/// The action id a call's idempotency key belongs to: a dead letter the upstream refused is
/// retried under `<action id>~retry-<time>`.
pub fn action_of(key: &str) -> &str {
    key.split("~retry-").next().unwrap_or(key)
}

// ---- Building deliveries ----

/// Unique ids for one test run (a tag from the seed, then a counter).
pub struct Ids {
    pub tag: u32,
    next: u64,
}

impl Ids {
    pub fn new(seed: u64) -> Self {
        Ids {
            tag: (seed ^ (seed >> 32)) as u32,
            next: 1,
        }
    }

    /// How many ids were handed out (a clock for timestamps that must grow across a run).
    pub fn issued(&self) -> u64 {
        self.next - 1
    }

    pub fn next(&mut self, kind: u16) -> String {
        let n = self.next;
        self.next += 1;
        format!("{:08x}-{kind:04x}-4000-8000-{n:012x}", self.tag)
    }
}

/// A `bot.message.received` event: the user of seeded conversation `conv` wrote `text`.
pub fn user_message(ids: &mut Ids, conv: usize, text: &str, ts: i64) -> (String, Value) {
    let (conversation, end_user, bot) = SEEDED[conv];
    let id = ids.next(0xe);
    let event = json!({
        "id": id,
        "event": "bot.message.received",
        "sourceType": "bot",
        "sourceId": bot,
        "timestamp": ts,
        "data": {
            "message": {
                "id": ids.next(0xa),
                "endUserId": end_user,
                "conversationId": conversation,
                "data": {"type": "text", "text": text},
                "meta": null,
                "isUser": true,
                "timestamp": ts,
                "requestId": ids.next(0xb),
            }
        }
    });
    (id, event)
}

/// One delivery as sent: its body and the ids of the events it carries.
#[derive(Clone, Debug)]
pub struct Sent {
    pub body: Vec<u8>,
    pub events: Vec<String>,
}

pub fn make_delivery(ids: &mut Ids, events: Vec<(String, Value)>) -> Sent {
    let id = ids.next(0xd);
    let (event_ids, bodies): (Vec<String>, Vec<Value>) = events.into_iter().unzip();
    Sent {
        body: delivery(&id, &bodies),
        events: event_ids,
    }
}

// ---- Rules and daemon configuration ----

/// Write `text` as the only rule file of a fresh directory under `root`.
pub fn rules_dir(root: &Path, text: &str) -> PathBuf {
    let dir = root.join("rules");
    std::fs::create_dir_all(&dir).expect("rules dir");
    std::fs::write(dir.join("test.toml"), text).expect("rule file");
    dir
}

/// Environment for a daemon running `rules`: generous rate limits (the tests are about order and
/// effects, not pacing) and short retry waits; `extra` is added last, so it wins.
pub fn daemon_env(rules: &Path, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut env = vec![
        (
            "HANDOFF_BRIDGE__RULES__DIR",
            rules.to_str().expect("utf-8 path"),
        ),
        (
            "HANDOFF_BRIDGE__UPSTREAM__LIMITS__GLOBAL__PER_SECOND",
            "5000.0",
        ),
        ("HANDOFF_BRIDGE__UPSTREAM__LIMITS__GLOBAL__BURST", "1000"),
        (
            "HANDOFF_BRIDGE__UPSTREAM__LIMITS__WRITE__PER_SECOND",
            "5000.0",
        ),
        ("HANDOFF_BRIDGE__UPSTREAM__LIMITS__WRITE__BURST", "1000"),
        ("HANDOFF_BRIDGE__OUTBOX__RETRY__BASE", "5ms"),
        ("HANDOFF_BRIDGE__OUTBOX__RETRY__CAP", "40ms"),
        ("HANDOFF_BRIDGE__OUTBOX__RETRY__MAX_RETRY_AFTER", "50ms"),
    ];
    env.extend_from_slice(extra);
    env.into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// A rule that answers each user message with `echo <text>` (up to 1,000 a minute): one action
/// per message, for the outbox and dead-letter tests.
pub const ECHO_RULE: &str = r#"
[[rule]]
name = "echo"
on = ["bot.message.received"]
max_firings = { count = 1000, per = "1m" }
when = { field = "sender", equals = "user" }
actions = [{ type = "send_message", text = "echo {{ message.data.text }}" }]
"#;

/// A second rule answering each user message (`again <text>`): two actions per message with
/// [`ECHO_RULE`], more letters or finished entries than a page within the firing caps.
pub const AGAIN_RULE: &str = r#"
[[rule]]
name = "again"
on = ["bot.message.received"]
max_firings = { count = 1000, per = "1m" }
when = { field = "sender", equals = "user" }
actions = [{ type = "send_message", text = "again {{ message.data.text }}" }]
"#;

/// User message `n` of the fixtures' seeded conversation, its ids fresh under `prefix` (two
/// letters: each test its own), its text `m<n>`, its time `n` ms after the fixture's.
pub fn seeded_message(prefix: &str, n: usize) -> Value {
    let mut ev = super::fixture_value("message-received-text.json")["messages"][0].clone();
    ev["id"] = json!(format!("{prefix}000000-0000-4000-8000-{n:012}"));
    ev["timestamp"] = json!(1_763_690_500_000_i64 + n as i64);
    ev["data"]["message"]["id"] = json!(format!("{prefix}-m-{n}"));
    ev["data"]["message"]["data"]["text"] = json!(format!("m{n}"));
    ev
}
