//! Agent commands from the help desk's agent API, as the bridge's own stored events
//! (`agent.<command>`).
//!
//! An agent's call becomes an event of its conversation so it is durable, deduped and folded in
//! order with that conversation's webhook events (an accept can never overtake the user's
//! cancellation it raced with), and so it shows in the audit timeline. Like `timer.*`, the
//! `agent.*` types are refused from the service's webhook: from there they could forge an agent.
//! Everything an action needs (the partner channel's sender key, the route of a reply) is resolved
//! by the API and written into the command, so folding and replaying it needs no configuration.

use crate::ids::ConversationId;
use crate::webhook::model::MessageData;
use serde::{Deserialize, Serialize};

/// Event types the bridge makes for agent commands: `agent.<command>`.
pub const AGENT_EVENT_PREFIX: &str = "agent.";

/// `data.agent` of an `agent.<command>` event.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentCommand {
    pub conversation_id: ConversationId,
    #[serde(flatten)]
    pub command: Command,
}

/// An agent as the help desk names them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeskAgent {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A user of a partner-messenger counseling channel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PartnerUser {
    pub sender_key: String,
    pub user_key: String,
}

/// Where a navigation goes: a flow by id or by title, and optionally a node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Target {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow_id: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<i64>,
}

impl Target {
    pub fn is_some(&self) -> bool {
        self.flow_id.is_some() || self.flow.is_some()
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "command",
    rename_all = "snake_case",
    rename_all_fields = "camelCase"
)]
pub enum Command {
    Accept {
        agent: DeskAgent,
    },
    /// A reply: through the partner channel when `partner` is set, else into the conversation.
    Message {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        agent: Option<DeskAgent>,
        message: Box<MessageData>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        partner: Option<PartnerUser>,
    },
    Release {
        #[serde(default)]
        target: Target,
    },
    Transfer {
        target: Target,
    },
    Block {
        partner: PartnerUser,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    Unblock {
        partner: PartnerUser,
    },
    RemoveSession {
        partner: PartnerUser,
    },
    /// A message from the help desk itself, not an agent (Chatwoot's satisfaction survey after a
    /// resolve): needs no agent; through the partner channel when `partner` is set.
    Notice {
        message: Box<MessageData>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        partner: Option<PartnerUser>,
    },
}

impl Command {
    /// The command's name: the event type's suffix and the API's audit label.
    pub fn name(&self) -> &'static str {
        match self {
            Command::Accept { .. } => "accept",
            Command::Message { .. } => "message",
            Command::Release { .. } => "release",
            Command::Transfer { .. } => "transfer",
            Command::Block { .. } => "block",
            Command::Unblock { .. } => "unblock",
            Command::RemoveSession { .. } => "remove_session",
            Command::Notice { .. } => "notice",
        }
    }
}

/// Every command's name, as `agent.<name>` event types use them.
pub const COMMANDS: [&str; 8] = [
    "accept",
    "message",
    "release",
    "transfer",
    "block",
    "unblock",
    "remove_session",
    "notice",
];

/// Whether `kind` is an agent command's event type (rules may listen to them).
pub fn is_command_event(kind: &str) -> bool {
    kind.strip_prefix(AGENT_EVENT_PREFIX)
        .is_some_and(|c| COMMANDS.contains(&c))
}

impl AgentCommand {
    /// The event type it is stored as.
    pub fn event_type(&self) -> String {
        format!("{AGENT_EVENT_PREFIX}{}", self.command.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::model::MessageType;

    #[test]
    fn commands_round_trip_with_a_command_tag_and_camel_case_fields() {
        let cmd = AgentCommand {
            conversation_id: "c1".into(),
            command: Command::Message {
                agent: None,
                message: Box::new(MessageData {
                    kind: MessageType::Text,
                    text: Some("hi".into()),
                    media: None,
                    cards: None,
                    location: None,
                    button: None,
                    buttons: None,
                }),
                partner: Some(PartnerUser {
                    sender_key: "sk".into(),
                    user_key: "u".into(),
                }),
            },
        };
        let json = serde_json::to_value(&cmd).expect("json");
        assert_eq!(json["command"], "message");
        assert_eq!(json["conversationId"], "c1");
        assert_eq!(json["partner"]["senderKey"], "sk");
        let back: AgentCommand = serde_json::from_value(json).expect("back");
        assert_eq!(back, cmd);
        assert_eq!(cmd.event_type(), "agent.message");
    }
}
