//! What a rule sees: one JSON document built from the event, the conversation's state (after the
//! event, and before it when known), its end user and its standing in the waiting queue (when
//! known) and the clock. Conditions address
//! it by dotted path; templates render from it. Building it in one place keeps the names
//! conditions and templates use identical, and documented in `rules/README.md`.

use crate::decide::Inputs;
use crate::state::{ConversationState, EndUserState};
use model::webhook::model::{Event, Millis, Payload};
use serde_json::{json, Map, Value};

/// Top-level names of the context; a condition's field must start with one of them (checked when
/// the rule file is loaded, so a typo is a load error rather than a rule that never fires).
pub const ROOTS: [&str; 21] = [
    "event",
    "message",
    "conversation",
    "sender",
    "message_type",
    "platform",
    "bot_id",
    "conversation_id",
    "end_user_id",
    "user_key",
    "state",
    "timer",
    "now",
    "settings",
    "echo",
    "echo_of",
    "before",
    "end_user",
    "agent_command",
    "queue",
    "drift",
];

/// The context for one event of a conversation, after the event was folded into `state`, without
/// other inputs (no `before`).
pub fn build(event: &Event, state: &ConversationState, now: Millis) -> Value {
    build_with(event, state, Inputs::default(), now)
}

/// The context for one event of a conversation, after the event was folded into `state`; the
/// state before the fold, when given, under `before.state` (the same view, at the same `now`, so
/// a `changed` condition compares like with like).
pub fn build_with(
    event: &Event,
    state: &ConversationState,
    inputs: Inputs<'_>,
    now: Millis,
) -> Value {
    let mut root = Map::new();
    root.insert(
        "event".into(),
        json!({
            "id": event.id.as_str(),
            "type": event.kind.as_str(),
            "source_id": event.source_id.as_str(),
            "timestamp": event.timestamp,
            // Read back through the Open API by backfill (the webhook had not delivered it).
            "backfilled": model::webhook::is_backfilled(event),
        }),
    );
    match &event.payload {
        Payload::Message(m) => {
            root.insert("message".into(), to_value(m));
            root.insert("sender".into(), to_value(m.sender()));
            root.insert("message_type".into(), json!(m.data.kind.as_str()));
        }
        Payload::Conversation(c) => {
            root.insert("conversation".into(), to_value(c));
        }
        Payload::Timer(t) => {
            root.insert(
                "timer".into(),
                json!({ "name": t.name, "due_at": t.due_at }),
            );
        }
        Payload::Agent(a) => {
            root.insert("agent_command".into(), to_value(a));
        }
        Payload::Reconcile(d) => {
            root.insert("drift".into(), to_value(d));
        }
        _ => {}
    }
    root.insert("platform".into(), to_value(&state.platform));
    root.insert("bot_id".into(), to_value(&state.bot_id));
    root.insert("conversation_id".into(), json!(state.id.as_str()));
    root.insert("end_user_id".into(), to_value(&state.end_user_id));
    root.insert("user_key".into(), to_value(&state.user_key));
    root.insert("state".into(), state_view(state, now));
    if let Some(before) = inputs.before {
        root.insert("before".into(), json!({ "state": state_view(before, now) }));
    }
    if let Some(user) = inputs.end_user {
        root.insert("end_user".into(), end_user_view(user));
    }
    if let Some(queue) = inputs.queue {
        root.insert("queue".into(), to_value(queue));
    }
    root.insert("now".into(), json!(now));
    let echo = model::action::echo::echo_of(event);
    root.insert("echo".into(), json!(echo.is_some()));
    if let Some(id) = echo {
        root.insert("echo_of".into(), json!(id));
    }
    Value::Object(root)
}

/// The state as rules read it: plain values instead of the stamped registers of the store, plus
/// derived durations (seconds) so a condition can say "no agent message for 5 minutes".
fn state_view(s: &ConversationState, now: Millis) -> Value {
    // Event timestamps are the service's and unchecked: saturate rather than overflow.
    let since = |at: Option<Millis>| at.map(|t| now.saturating_sub(t).max(0) / 1000);
    let phase_since = s.handoff.phase.stamp.at;
    json!({
        "phase": s.handoff.phase.value,
        "phase_since": phase_since,
        "seconds_in_phase": if phase_since > 0 { since(Some(phase_since)) } else { None },
        "manual": s.manual_status.value,
        "agent": s.handoff.agent.value,
        "labels": s.labels,
        "variables": s.variables,
        "params": s.params.value,
        "navigation": s.navigation.value,
        "user_messages": s.messages.user_messages,
        "bot_messages": s.messages.bot_messages,
        "agent_messages": s.messages.agent_messages,
        "last_sender": s.messages.last_message.value.as_ref().map(|m| m.sender),
        "seconds_since_last_user_message": since(s.messages.last_user_message_at),
        "seconds_since_last_bot_message": since(s.messages.last_bot_message_at),
        "seconds_since_last_agent_message": since(s.messages.last_agent_message_at),
        // Newest first: `.9` is how long ago the 10th newest user message came (a flood rule's
        // "10 messages within a minute" is `lt = 60` on it).
        "seconds_since_user_messages": s
            .messages
            .recent_user_at
            .iter()
            .map(|t| since(Some(*t)))
            .collect::<Vec<_>>(),
        "events_applied": s.events_applied,
        "desk_agent": s.desk.agent,
    })
}

/// The conversation's end user as rules read it: their params (from `bot.end_user.*` events) and
/// identity, without the store's stamps and counters.
fn end_user_view(u: &EndUserState) -> Value {
    json!({
        "id": u.id.as_str(),
        "params": u.params.value,
        "platform": u.platform,
        "user_key": u.user_key,
        "bot_id": u.bot_id,
        "last_conversation_id": u.last_conversation_id.value,
        "deleted": u.deleted_at.is_some(),
    })
}

fn to_value<T: serde::Serialize>(value: T) -> Value {
    // The model types serialise infallibly (no maps with non-string keys); Null is never wrong.
    serde_json::to_value(value).unwrap_or(Value::Null)
}

/// The value at a dotted path (`message.data.text`, `state.variables.reason`, `state.labels.0`).
pub fn lookup<'a>(root: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(root, |node, key| match node {
        Value::Object(map) => map.get(key),
        Value::Array(items) => key.parse::<usize>().ok().and_then(|i| items.get(i)),
        _ => None,
    })
}
