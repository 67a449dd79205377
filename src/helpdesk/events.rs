//! The events a help desk receives, and their bodies. Pure: the sender reads what a body needs
//! (state, the source event, the transcript) and hands it in, so the shape is tested without I/O.
//!
//! Bodies have the shape the Standard Webhooks specification recommends,
//! `{"type", "timestamp", "data"}`, so a help desk can route on `type` before it reads the rest.

use engine::state::{ConversationState, EndUserState};
use model::ids::ConversationId;
use model::webhook::model::Millis;
use serde::Serialize;
use serde_json::{json, Map, Value};

pub use model::helpdesk::{is_valid_pattern, pattern_matches};

/// Where a waiting conversation stands, from the waiting queue the folds keep (`store::queue`);
/// `None` when it does not wait, or (the wait) while the bot has fewer than 2 recent accepts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QueueInfo {
    /// 1 is next.
    pub position: Option<u32>,
    pub expected_wait_seconds: Option<u64>,
}

/// The queue as the event sender sees it: the store implements it; tests plug in their own.
pub trait QueueSource: Send + Sync {
    fn queue_info(&self, conversation: &ConversationId) -> QueueInfo;
}

/// No queue: position and wait are unknown (`null` in the body). The default of a `Desks`
/// built without a store (tests).
pub struct NoQueue;

impl QueueSource for NoQueue {
    fn queue_info(&self, _: &ConversationId) -> QueueInfo {
        QueueInfo::default()
    }
}

/// The store-backed queue is what the help-desk events read their position and wait from. A
/// store error leaves them unknown (`null`): the event still goes out.
impl QueueSource for storage::Store {
    fn queue_info(&self, conversation: &model::ids::ConversationId) -> QueueInfo {
        match self.queue_standing(conversation) {
            Ok(Some(s)) => QueueInfo {
                position: s.position,
                expected_wait_seconds: s.expected_wait_seconds,
            },
            Ok(None) => QueueInfo::default(),
            Err(e) => {
                tracing::warn!(error = %e, conversation_id = %conversation, "queue unreadable");
                QueueInfo::default()
            }
        }
    }
}

/// The last messages of a conversation, oldest first, as read through the Open API.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Transcript {
    pub messages: Vec<model::webhook::model::Message>,
    /// False when the Open API could not be read: the event goes out without (all of) it rather
    /// than keeping a waiting user from the help desk.
    pub complete: bool,
}

impl Transcript {
    /// As the body carries it: `{"messages": [...], "complete"}`.
    fn json(&self) -> Value {
        let messages: Vec<Value> = self.messages.iter().map(message).collect();
        json!({ "messages": messages, "complete": self.complete })
    }
}

/// Everything a body is made of.
#[derive(Clone, Debug)]
pub struct Source<'a> {
    pub kind: &'a str,
    /// When the event that led to it was received.
    pub occurred_at: Millis,
    pub conversation_id: &'a ConversationId,
    pub conversation: Option<&'a ConversationState>,
    pub end_user: Option<&'a EndUserState>,
    /// The webhook event, rule and action that decided it.
    pub event_id: &'a str,
    pub rule: &'a str,
    pub action_id: &'a str,
    pub reason: Option<&'a str>,
    /// Whatever else the rule put in (`payload`), passed through.
    pub payload: &'a Value,
    /// `conversation.message`: the message as the service reported it.
    pub message: Option<&'a model::webhook::model::Message>,
    /// `handoff.requested`: the context packet's transcript and queue standing.
    pub transcript: Option<&'a Transcript>,
    pub queue: Option<QueueInfo>,
}

/// Unix ms as RFC 3339 (UTC); a time out of range (never from a real clock) as the epoch.
pub fn rfc3339(ms: Millis) -> String {
    jiff::Timestamp::from_millisecond(ms)
        .unwrap_or(jiff::Timestamp::UNIX_EPOCH)
        .to_string()
}

/// The JSON body of one event.
pub fn body(source: &Source<'_>) -> Value {
    let mut data = Map::new();
    data.insert("conversation".into(), conversation(source));
    data.insert(
        "endUser".into(),
        source.end_user.map_or(Value::Null, end_user),
    );
    data.insert(
        "trigger".into(),
        json!({
            "eventId": source.event_id,
            "rule": source.rule,
            "actionId": source.action_id,
        }),
    );
    let reason = source.reason.map(str::to_owned).or_else(|| {
        // Rules written before `reason` existed put it in the payload.
        source.payload["reason"].as_str().map(str::to_owned)
    });
    data.insert("reason".into(), reason.map_or(Value::Null, Value::String));
    if !source.payload.is_null() {
        data.insert("payload".into(), source.payload.clone());
    }
    if let Some(m) = source.message {
        data.insert("message".into(), message(m));
    }
    if let Some(transcript) = &source.transcript {
        data.insert("transcript".into(), transcript.json());
    }
    if let Some(queue) = &source.queue {
        data.insert("queue".into(), json!(queue));
    }
    json!({
        "type": source.kind,
        "timestamp": rfc3339(source.occurred_at),
        "data": data,
    })
}

fn conversation(source: &Source<'_>) -> Value {
    let Some(c) = source.conversation else {
        return json!({ "id": source.conversation_id });
    };
    json!({
        "id": c.id,
        "botId": c.bot_id,
        "endUserId": c.end_user_id,
        "platform": c.platform,
        "userKey": c.user_key,
        "params": c.params.value,
        "phase": c.handoff.phase.value,
        "labels": c.labels,
        "requestedAt": c.handoff.requested_at.map(rfc3339),
        "agent": c.handoff.agent.value,
    })
}

fn end_user(u: &EndUserState) -> Value {
    json!({
        "id": u.id,
        "platform": u.platform,
        "userKey": u.user_key,
        "params": u.params.value,
    })
}

/// A message of the Open API or a webhook as the help desk sees it: who sent it, when, what.
pub fn message(m: &model::webhook::model::Message) -> Value {
    json!({
        "id": m.id,
        "sender": m.sender(),
        "timestamp": m.timestamp.map(rfc3339),
        "data": m.data,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_select_one_kind_a_family_or_all() {
        assert!(pattern_matches("*", "user.blocked"));
        assert!(pattern_matches("handoff.*", "handoff.requested"));
        assert!(!pattern_matches("handoff.*", "conversation.message"));
        assert!(
            !pattern_matches("hand.*", "handoff.requested"),
            "whole segments"
        );
        assert!(pattern_matches("user.blocked", "user.blocked"));
        assert!(!pattern_matches("user.blocked", "user.unblocked"));
        assert!(is_valid_pattern("user.*"));
        assert!(!is_valid_pattern("handof.*"));
        assert!(!is_valid_pattern("handoff.remind"));
    }

    #[test]
    fn a_requested_body_carries_the_context_packet() {
        let id = ConversationId::new("c1");
        let mut state = ConversationState::new(id.clone());
        state.params.value.insert("orderNo".into(), json!("A-7"));
        let payload = json!({ "team": "billing" });
        let transcript = Transcript {
            messages: vec![serde_json::from_value(json!({
                "id": "m1", "conversationId": "c1", "isUser": true,
                "data": { "type": "text", "text": "hi" }
            }))
            .expect("message")],
            complete: true,
        };
        let source = Source {
            kind: "handoff.requested",
            occurred_at: 1_763_690_402_211,
            conversation_id: &id,
            conversation: Some(&state),
            end_user: None,
            event_id: "ev1",
            rule: "tell-helpdesk",
            action_id: "ev1/tell-helpdesk/0",
            reason: Some("user asked"),
            payload: &payload,
            message: None,
            transcript: Some(&transcript),
            queue: Some(QueueInfo::default()),
        };
        let body = body(&source);
        assert_eq!(body["type"], "handoff.requested");
        assert_eq!(body["timestamp"], "2025-11-21T02:00:02.211Z");
        let data = &body["data"];
        assert_eq!(data["conversation"]["id"], "c1");
        assert_eq!(data["conversation"]["params"]["orderNo"], "A-7");
        assert_eq!(data["reason"], "user asked");
        assert_eq!(data["trigger"]["rule"], "tell-helpdesk");
        assert_eq!(data["payload"]["team"], "billing");
        assert_eq!(data["transcript"]["messages"][0]["id"], "m1");
        assert_eq!(data["transcript"]["complete"], true);
        assert!(data["queue"]["position"].is_null());
        assert!(data["queue"]["expectedWaitSeconds"].is_null());
        assert!(data["endUser"].is_null());
        assert!(data.get("message").is_none());
    }

    #[test]
    fn a_reason_in_the_payload_still_counts() {
        let id = ConversationId::new("c1");
        let payload = json!({ "reason": "bot.conversation.agent_call_requested" });
        let source = Source {
            kind: "handoff.cancelled",
            occurred_at: 0,
            conversation_id: &id,
            conversation: None,
            end_user: None,
            event_id: "e",
            rule: "r",
            action_id: "e/r/0",
            reason: None,
            payload: &payload,
            message: None,
            transcript: None,
            queue: None,
        };
        let body = body(&source);
        assert_eq!(
            body["data"]["reason"],
            "bot.conversation.agent_call_requested"
        );
        assert_eq!(body["data"]["conversation"], json!({ "id": "c1" }));
        assert!(body["data"].get("transcript").is_none());
        assert_eq!(body["timestamp"], "1970-01-01T00:00:00Z");
    }
}
