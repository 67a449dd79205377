//! Serde models of the service's webhook format (`shared/docs/webhook-format.md`).
//!
//! Everything is lenient where the format is vague: unknown fields are ignored, unknown event
//! types, platforms and message types are kept as opaque strings, and only the fields the bridge
//! keys on are required. A required field that is missing makes the event invalid (quarantined).

use crate::ids::{BotId, ConversationId, EndUserId, EventId, UserKey};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// Unix milliseconds, as the service sends them.
pub type Millis = i64;

/// A string-backed enum that keeps values it does not know, so a new event type or platform is
/// recorded rather than rejected. Each value's name is written once, here: `as_str`, serde (both
/// ways), `Display` and the list of the known values (`KNOWN`) come from it.
///
/// Kept as a macro rather than strum derives: strum's `EnumString` (`#[strum(default)]` on
/// `Other`) and `AsRefStr` (`#[strum(transparent)]`) would give the parser and the name, but serde
/// would still need a hand-written `From<String>` and `From<_> for String` per type (serde's
/// `try_from = "&str"` refuses strings it cannot borrow, e.g. from a `Value` or with escapes),
/// and `VariantArray` cannot list an enum with a non-unit variant (`Other`), so `KNOWN` would
/// stay a list kept by hand.
macro_rules! open_enum {
    ($(#[$doc:meta])* $name:ident { $($variant:ident => $text:literal),* $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(from = "String", into = "String")]
        pub enum $name {
            $($variant,)*
            Other(String),
        }

        impl $name {
            /// Every known value, in declaration order (for metrics, docs and checks).
            pub const KNOWN: [$name; [$($text),*].len()] = [$($name::$variant),*];

            pub fn as_str(&self) -> &str {
                match self {
                    $($name::$variant => $text,)*
                    $name::Other(s) => s,
                }
            }
            pub fn is_known(&self) -> bool {
                !matches!(self, $name::Other(_))
            }
        }

        impl From<String> for $name {
            fn from(s: String) -> Self {
                match s.as_str() {
                    $($text => $name::$variant,)*
                    _ => $name::Other(s),
                }
            }
        }

        impl From<$name> for String {
            fn from(v: $name) -> String {
                match v {
                    $name::Other(s) => s,
                    known => known.as_str().to_owned(),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

open_enum!(
    /// EVENT_TYPE.
    EventKind {
        BotUpdated => "bot.updated",
        BotDeleted => "bot.deleted",
        EndUserCreated => "bot.end_user.created",
        EndUserUpdated => "bot.end_user.updated",
        EndUserDeleted => "bot.end_user.deleted",
        ConversationCreated => "bot.conversation.created",
        ConversationUpdated => "bot.conversation.updated",
        ConversationDeleted => "bot.conversation.deleted",
        AgentCallRequested => "bot.conversation.agent_call_requested",
        AgentCallConnected => "bot.conversation.agent_call_connected",
        AgentCallCancelled => "bot.conversation.agent_call_cancelled",
        AgentCallDisconnected => "bot.conversation.agent_call_disconnected",
        MessageSent => "bot.message.sent",
        MessageReceived => "bot.message.received",
    }
);

impl EventKind {
    /// The `data` key this event type carries, or `None` for types the bridge does not know.
    pub fn data_key(&self) -> Option<&'static str> {
        use EventKind::*;
        match self {
            BotUpdated | BotDeleted => Some("bot"),
            EndUserCreated | EndUserUpdated | EndUserDeleted => Some("endUser"),
            ConversationCreated
            | ConversationUpdated
            | ConversationDeleted
            | AgentCallRequested
            | AgentCallConnected
            | AgentCallCancelled
            | AgentCallDisconnected => Some("conversation"),
            MessageSent | MessageReceived => Some("message"),
            Other(_) => None,
        }
    }

    /// The timer's name of a `timer.<name>` event (made by the bridge itself, never the service).
    pub fn timer_name(&self) -> Option<&str> {
        match self {
            EventKind::Other(kind) => kind.strip_prefix(TIMER_EVENT_PREFIX),
            _ => None,
        }
    }

    /// The command of an `agent.<command>` event (made by the bridge for the agent API).
    pub fn agent_command(&self) -> Option<&str> {
        match self {
            EventKind::Other(kind) => kind.strip_prefix(super::agent::AGENT_EVENT_PREFIX),
            _ => None,
        }
    }

    /// Metric label: the type itself when known, `other` otherwise (bounded cardinality).
    pub fn metric_label(&self) -> &str {
        if self.is_known() {
            self.as_str()
        } else {
            "other"
        }
    }
}

open_enum!(
    /// PLATFORM_TYPE.
    Platform {
        Kakao => "kakao",
        Kakaobiz => "kakaobiz",
        Facebook => "facebook",
        Line => "line",
        Navertalk => "navertalk",
        Bizchat => "bizchat",
        Wechat => "wechat",
        Web => "web",
        Test => "test",
    }
);

open_enum!(
    /// MESSAGE.DATA `type`.
    MessageType {
        Text => "text",
        Media => "media",
        Cards => "cards",
        Location => "location",
    }
);

/// Event types the bridge makes for its own timers: `timer.<name>`.
pub const TIMER_EVENT_PREFIX: &str = "timer.";

/// A timer name: non-empty, `A-Z a-z 0-9 - _` only, so it is safe in event ids, sled keys and
/// event types.
pub fn is_timer_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// DELIVERY: the envelope. Events stay raw here so each can be validated, stored and quarantined
/// on its own.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Delivery<'a> {
    pub id: String,
    pub webhook_id: String,
    pub webhook_url: String,
    #[serde(borrow)]
    pub messages: Vec<&'a RawValue>,
}

/// EVENT with its payload still raw: enough to dedupe, route and store it.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EventHeader<'a> {
    pub id: EventId,
    pub event: EventKind,
    pub source_type: String,
    pub source_id: BotId,
    pub timestamp: Millis,
    #[serde(borrow)]
    pub data: &'a RawValue,
}

/// A fully typed event.
#[derive(Clone, Debug, Serialize)]
pub struct Event {
    pub id: EventId,
    pub kind: EventKind,
    pub source_id: BotId,
    pub timestamp: Millis,
    pub payload: Payload,
}

/// `data`, by event family. Unknown event types keep their data as raw JSON.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Payload {
    Bot(Bot),
    EndUser(EndUser),
    Conversation(Conversation),
    Message(Message),
    /// A rule timer fired (`timer.<name>`; the bridge's own, refused from the service).
    Timer(TimerFiring),
    /// An agent's command from the agent API (`agent.<command>`; the bridge's own too).
    Agent(super::agent::AgentCommand),
    /// Drift the reconciliation sweeper found (`reconcile.drift`; the bridge's own too).
    Reconcile(super::drift::Drift),
    Unknown(Value),
}

impl Payload {
    /// The conversation a conversation or message event belongs to.
    pub fn conversation_id(&self) -> Option<&ConversationId> {
        match self {
            Payload::Conversation(c) => Some(&c.id),
            Payload::Message(m) => Some(&m.conversation_id),
            Payload::Timer(t) => Some(&t.conversation_id),
            Payload::Agent(a) => Some(&a.conversation_id),
            Payload::Reconcile(d) => Some(&d.conversation_id),
            _ => None,
        }
    }
}

/// `data.timer` of a `timer.<name>` event: which timer of which conversation fired.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TimerFiring {
    pub conversation_id: ConversationId,
    pub name: String,
    /// When it was due (Unix ms, the bridge's clock).
    pub due_at: Millis,
    /// The action that started it (`<event id>/<rule>/<index>`). The conversation's state keeps
    /// it with the running timer, so a firing of a timer replaced or cancelled since is told apart
    /// from the live one, also by a replay (whose clock gives other due times).
    pub started_by: String,
}

/// BOT.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Bot {
    pub id: BotId,
    #[serde(default)]
    pub title: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub integration: Option<Value>,
    #[serde(default)]
    pub preference: Option<Value>,
    #[serde(default)]
    pub data: Option<Value>,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(default)]
    pub updated_at: Option<String>,
    #[serde(default)]
    pub deleted_at: Option<String>,
}

/// ENDUSER.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EndUser {
    pub id: EndUserId,
    #[serde(default)]
    pub bot_id: Option<BotId>,
    pub platform: Platform,
    pub user_key: UserKey,
    #[serde(default)]
    pub params: Option<Map<String, Value>>,
    #[serde(default)]
    pub last_message_id: Option<String>,
    #[serde(default)]
    pub last_conversation_id: Option<ConversationId>,
    #[serde(default)]
    pub last_conversation: Option<Box<Conversation>>,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(default)]
    pub updated_at: Option<String>,
    #[serde(default)]
    pub deleted_at: Option<String>,
}

/// CONVERSATION.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Conversation {
    pub id: ConversationId,
    #[serde(default)]
    pub bot_id: Option<BotId>,
    #[serde(default)]
    pub end_user_id: Option<EndUserId>,
    #[serde(default)]
    pub platform: Option<Platform>,
    #[serde(default)]
    pub user_key: Option<UserKey>,
    #[serde(default)]
    pub params: Option<Map<String, Value>>,
    #[serde(default)]
    pub context: Option<Context>,
    #[serde(default)]
    pub navigation: Option<Navigation>,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(default)]
    pub updated_at: Option<String>,
}

impl Conversation {
    /// The undocumented agent-connection marker real consumers read (`context.manual.status`).
    pub fn manual_status(&self) -> Option<&str> {
        self.context.as_ref()?.manual.as_ref()?.status.as_deref()
    }

    /// Navigation from the conversation, else from its context.
    pub fn effective_navigation(&self) -> Option<&Navigation> {
        self.navigation
            .as_ref()
            .filter(|n| n.current.is_some())
            .or_else(|| self.context.as_ref()?.navigation.as_ref())
            .filter(|n| n.current.is_some())
    }
}

/// CONTEXT.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Context {
    #[serde(default)]
    pub bot_id: Option<BotId>,
    #[serde(default)]
    pub conversation_id: Option<ConversationId>,
    #[serde(default)]
    pub end_user_id: Option<EndUserId>,
    #[serde(default)]
    pub navigation: Option<Navigation>,
    #[serde(default)]
    pub params: Option<Map<String, Value>>,
    #[serde(default)]
    pub platform: Option<Platform>,
    #[serde(default)]
    pub user_key: Option<UserKey>,
    #[serde(default)]
    pub manual: Option<Manual>,
}

/// `context.manual` (undocumented; one known status: `HANDOVER`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Manual {
    #[serde(default)]
    pub status: Option<String>,
}

/// NAVIGATION. Both nodes may be absent (`{}`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Navigation {
    #[serde(default)]
    pub current: Option<Node>,
    #[serde(default)]
    pub prev: Option<Node>,
}

/// NODE.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Node {
    pub flow_id: i64,
    pub node_id: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub visit_count: Option<i64>,
}

/// MESSAGE.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Message {
    pub id: String,
    #[serde(default)]
    pub end_user_id: Option<EndUserId>,
    pub conversation_id: ConversationId,
    pub is_user: bool,
    #[serde(default)]
    pub meta: Option<MessageMeta>,
    pub data: MessageData,
    #[serde(default)]
    pub timestamp: Option<Millis>,
    #[serde(default)]
    pub request_id: Option<String>,
}

/// Who sent a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Sender {
    User,
    Bot,
    Agent,
}

impl Message {
    /// The guide marks agent messages with `meta.sender`; a public consumer uses `meta.persona`.
    /// Either makes a non-user message an agent's.
    pub fn sender(&self) -> Sender {
        if self.is_user {
            return Sender::User;
        }
        match &self.meta {
            Some(meta) if meta.sender.is_some() || meta.persona.is_some() => Sender::Agent,
            _ => Sender::Bot,
        }
    }
}

/// `meta`: null for bot messages, `sender` (or `persona`) for agents, `custom` on bot messages.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MessageMeta {
    #[serde(default)]
    pub sender: Option<AgentRef>,
    #[serde(default)]
    pub persona: Option<Value>,
    #[serde(default)]
    pub custom: Option<String>,
}

/// An agent as the service identifies it in `meta.sender`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AgentRef {
    #[serde(default)]
    pub user_key: Option<String>,
    #[serde(default)]
    pub platform: Option<String>,
}

/// MESSAGE.DATA.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct MessageData {
    #[serde(rename = "type")]
    pub kind: MessageType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media: Option<Media>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cards: Option<Vec<Card>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<Location>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub button: Option<Button>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buttons: Option<Vec<FlowButton>>,
}

/// MEDIA.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Media {
    pub content_type: String,
    pub uri: String,
}

/// CARD.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Card {
    pub title: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media: Option<Media>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uri: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buttons: Option<Vec<Button>>,
}

/// BUTTON.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Button {
    pub label: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uri: Option<String>,
}

/// A button as exported flows show it: `{type: postback|link|goto, label, payload?}`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FlowButton {
    #[serde(rename = "type")]
    pub kind: String,
    pub label: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<Value>,
}

/// LOCATION.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Location {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    pub latitude: f64,
    pub longitude: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each known value's name round-trips through the parser (`From<String>`) and serde, and
    /// names no other value; an unknown name is kept as it came.
    fn names_round_trip<T>(known: &[T], unknown: &str)
    where
        T: Clone
            + std::fmt::Debug
            + PartialEq
            + From<String>
            + Serialize
            + for<'de> Deserialize<'de>,
        String: From<T>,
    {
        let mut names = std::collections::HashSet::new();
        for value in known {
            let name = String::from(value.clone());
            assert!(names.insert(name.clone()), "{name} twice");
            assert_eq!(T::from(name.clone()), *value);
            let json = serde_json::to_value(value).expect("json");
            assert_eq!(json, Value::String(name));
            let back: T = serde_json::from_value(json).expect("back");
            assert_eq!(back, *value);
        }
        let other = T::from(unknown.to_owned());
        assert!(!known.contains(&other));
        assert_eq!(String::from(other.clone()), unknown);
        let json = serde_json::to_string(&other).expect("json");
        assert_eq!(serde_json::from_str::<T>(&json).expect("back"), other);
    }

    #[test]
    fn open_enums_round_trip_their_known_names_and_keep_unknown_ones() {
        names_round_trip(&EventKind::KNOWN, "timer.t1");
        names_round_trip(&Platform::KNOWN, "telegram");
        names_round_trip(&MessageType::KNOWN, "sticker");
        assert_eq!(EventKind::KNOWN.len(), 14);
        assert_eq!(EventKind::KNOWN[0].as_str(), "bot.updated");
        assert_eq!(EventKind::KNOWN[13].as_str(), "bot.message.received");
        assert!(EventKind::KNOWN.iter().all(EventKind::is_known));
        assert_eq!(
            EventKind::from("timer.t1".to_owned()),
            EventKind::Other("timer.t1".into())
        );
        assert_eq!(Platform::KNOWN.len(), 9);
        assert_eq!(MessageType::KNOWN.len(), 4);
    }
}
