//! Chatwoot's webhook payloads, as its running code builds them (`../shared/chatwoot/README.md`,
//! section 2): `message_created` is `Message#webhook_data` (`message_type` a string there, an
//! integer inside `conversation.messages`), `conversation_*` is `Conversation#webhook_data` with
//! `changed_attributes` (null on `conversation_status_changed`). Only what the connector reads is
//! typed; the rest is left alone. A payload of an event the connector reads that lacks what it
//! needs is [`Malformed`] (quarantined).

use serde::Deserialize;
use serde_json::Value;

/// One delivery, as the connector reads it.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    MessageCreated(MessageEvent),
    ConversationUpdated(ConversationEvent),
    StatusChanged(ConversationEvent),
    /// Any other event (`conversation_created`, typing, `message_updated`, contact events...).
    Other(String),
}

/// Why a payload cannot be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Malformed(pub String);

/// `message_type`, from its name or its number (0 incoming, 1 outgoing, 2 activity, 3 template).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MessageType {
    Incoming,
    Outgoing,
    Activity,
    Template,
}

impl<'de> Deserialize<'de> for MessageType {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(d)?;
        let kind = match &value {
            Value::String(s) => match s.as_str() {
                "incoming" => Some(MessageType::Incoming),
                "outgoing" => Some(MessageType::Outgoing),
                "activity" => Some(MessageType::Activity),
                "template" => Some(MessageType::Template),
                _ => None,
            },
            Value::Number(n) => match n.as_u64() {
                Some(0) => Some(MessageType::Incoming),
                Some(1) => Some(MessageType::Outgoing),
                Some(2) => Some(MessageType::Activity),
                Some(3) => Some(MessageType::Template),
                _ => None,
            },
            _ => None,
        };
        kind.ok_or_else(|| serde::de::Error::custom(format!("unknown message_type {value}")))
    }
}

/// Who sent a message, or is assigned.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Person {
    #[serde(deserialize_with = "id_text")]
    pub id: String,
    #[serde(default)]
    pub name: Option<String>,
    /// `user` (an agent), `agent_bot`, `contact`, `captain_assistant`; absent on a contact's
    /// `webhook_data`.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
}

/// An attachment of a message (`Attachment#push_event_data`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Attachment {
    /// `image`, `audio`, `video`, `file`, `location`, `fallback`, `share`, `story_mention`,
    /// `contact`, `ig_reel`...
    #[serde(default)]
    pub file_type: Option<String>,
    #[serde(default)]
    pub data_url: Option<String>,
}

/// The conversation a message belongs to, as `message_created` carries it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct ConversationRef {
    /// The display id.
    #[serde(deserialize_with = "id_text")]
    pub id: String,
}

/// `{id, name}` of the account or inbox.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Named {
    #[serde(deserialize_with = "id_text")]
    pub id: String,
}

/// `message_created`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct MessageEvent {
    #[serde(deserialize_with = "id_text")]
    pub id: String,
    pub message_type: MessageType,
    #[serde(default)]
    pub private: bool,
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default)]
    pub content_type: Option<String>,
    #[serde(default)]
    pub source_id: Option<String>,
    /// `null` for templates.
    #[serde(default)]
    pub sender: Option<Person>,
    #[serde(default)]
    pub attachments: Vec<Attachment>,
    pub conversation: ConversationRef,
    #[serde(default)]
    pub account: Option<Named>,
}

/// `conversation_updated`, `conversation_status_changed`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct ConversationEvent {
    /// The display id.
    #[serde(deserialize_with = "id_text")]
    pub id: String,
    pub status: String,
    #[serde(default)]
    pub meta: ConversationMeta,
    /// `[{attr: {previous_value, current_value}}, ...]` or null.
    #[serde(default)]
    pub changed_attributes: Option<Vec<serde_json::Map<String, Value>>>,
    #[serde(default)]
    pub account: Option<Named>,
    /// When the conversation last changed (`updated_at.to_f`, seconds): with the event, what
    /// makes one change's delivery unique (a replayed one is the same).
    #[serde(default)]
    pub updated_at: Option<Value>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct ConversationMeta {
    #[serde(default)]
    pub assignee: Option<Person>,
    /// `User`, `AgentBot` or null.
    #[serde(default)]
    pub assignee_type: Option<String>,
}

impl ConversationEvent {
    /// The new value of `attr` when this event changed it.
    pub fn changed(&self, attr: &str) -> Option<&Value> {
        self.changed_attributes
            .iter()
            .flatten()
            .find_map(|c| c.get(attr))
            .map(|change| &change["current_value"])
    }

    /// The account, when the payload names it (4.15 and later).
    pub fn account_id(&self) -> Option<&str> {
        self.account.as_ref().map(|a| a.id.as_str())
    }
}

impl MessageEvent {
    pub fn account_id(&self) -> Option<&str> {
        self.account.as_ref().map(|a| a.id.as_str())
    }
}

/// Read a delivery's body.
pub fn parse(body: &[u8]) -> Result<Payload, Malformed> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| Malformed(format!("not JSON: {e}")))?;
    let event = value["event"]
        .as_str()
        .ok_or_else(|| Malformed("no `event`".into()))?
        .to_owned();
    let typed = |what: &str| Malformed(format!("{event}: {what}"));
    match event.as_str() {
        "message_created" => serde_json::from_value(value)
            .map(Payload::MessageCreated)
            .map_err(|e| typed(&e.to_string())),
        "conversation_updated" => serde_json::from_value(value)
            .map(Payload::ConversationUpdated)
            .map_err(|e| typed(&e.to_string())),
        "conversation_status_changed" => serde_json::from_value(value)
            .map(Payload::StatusChanged)
            .map_err(|e| typed(&e.to_string())),
        _ => Ok(Payload::Other(event)),
    }
}

/// An id sent as a number or as text, as text.
fn id_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    match Value::deserialize(d)? {
        Value::Number(n) => Ok(n.to_string()),
        Value::String(s) if !s.is_empty() => Ok(s),
        other => Err(serde::de::Error::custom(format!("an id, not {other}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `Message#webhook_data` of an agent's reply, as README section 2 shows its fields.
    fn agent_reply() -> Value {
        json!({
            "event": "message_created",
            "account": {"id": 1, "name": "Acme"},
            "additional_attributes": {},
            "content_attributes": {},
            "content_type": "text",
            "content": "Hello, how can I help?",
            "conversation": {"id": 57, "status": "open", "messages": [
                {"id": 901, "message_type": 1, "created_at": 1_718_870_043}
            ]},
            "created_at": "2026-06-20T09:14:03.512Z",
            "id": 901,
            "inbox": {"id": 7, "name": "Bridge"},
            "message_type": "outgoing",
            "private": false,
            "sender": {"id": 5, "name": "Alice", "email": "alice@example.com", "type": "user"},
            "source_id": null
        })
    }

    #[test]
    fn a_message_created_reads_its_type_as_a_name_or_a_number() {
        let Payload::MessageCreated(m) = parse(agent_reply().to_string().as_bytes()).expect("ok")
        else {
            panic!("a message");
        };
        assert_eq!(m.message_type, MessageType::Outgoing);
        assert_eq!((m.id.as_str(), m.conversation.id.as_str()), ("901", "57"));
        assert_eq!(
            m.sender.as_ref().and_then(|s| s.kind.as_deref()),
            Some("user")
        );
        assert_eq!(m.account_id(), Some("1"));
        let mut numbered = agent_reply();
        numbered["message_type"] = json!(3);
        numbered["sender"] = Value::Null;
        let Payload::MessageCreated(m) = parse(numbered.to_string().as_bytes()).expect("ok") else {
            panic!("a message");
        };
        assert_eq!(m.message_type, MessageType::Template);
        assert!(m.sender.is_none());
    }

    #[test]
    fn a_status_change_with_null_changed_attributes_reads_its_status() {
        let body = json!({
            "event": "conversation_status_changed",
            "id": 57, "status": "resolved", "changed_attributes": null,
            "meta": {"assignee": null, "assignee_type": null, "sender": {"id": 3}},
            "account": {"id": 1, "name": "Acme"}
        });
        let Payload::StatusChanged(c) = parse(body.to_string().as_bytes()).expect("ok") else {
            panic!("a status change");
        };
        assert_eq!((c.id.as_str(), c.status.as_str()), ("57", "resolved"));
        assert_eq!(c.changed("status"), None);
        let updated = json!({
            "event": "conversation_updated",
            "id": "57", "status": "open",
            "changed_attributes": [
                {"assignee_id": {"previous_value": null, "current_value": 5}},
                {"updated_at": {"previous_value": 1.0, "current_value": 2.0}}
            ],
            "meta": {"assignee": {"id": 5, "name": "Alice", "type": "user"}, "assignee_type": "User"}
        });
        let Payload::ConversationUpdated(c) = parse(updated.to_string().as_bytes()).expect("ok")
        else {
            panic!("an update");
        };
        assert_eq!(c.changed("assignee_id"), Some(&json!(5)));
        assert_eq!(c.meta.assignee.map(|a| a.id), Some("5".to_owned()));
    }

    #[test]
    fn other_events_are_named_and_broken_ones_are_malformed() {
        let typing = json!({"event": "conversation_typing_on", "user": {}});
        assert_eq!(
            parse(typing.to_string().as_bytes()),
            Ok(Payload::Other("conversation_typing_on".into()))
        );
        assert!(parse(b"not json").is_err());
        assert!(parse(br#"{"no":"event"}"#).is_err());
        let mut broken = agent_reply();
        broken["message_type"] = json!("sideways");
        assert!(parse(broken.to_string().as_bytes()).is_err());
        let mut no_conversation = agent_reply();
        no_conversation["conversation"] = Value::Null;
        assert!(parse(no_conversation.to_string().as_bytes()).is_err());
    }
}
