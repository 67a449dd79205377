//! Actions: every side effect the bridge can take, as data.
//!
//! Rules decide actions; the fold stores them in the outbox in the same atomic write as the state
//! change (`store::Store::apply`); the executor (`outbox`) carries them out. Keeping an action
//! plain data (serde, no closures) is what lets it be persisted, listed, retried and replayed.

pub mod echo;

use crate::contract::{ChannelSetting, NotifyRequest, UpdatePbConversation};
use crate::ids::{ConversationId, EndUserId, EventId, PartitionKey};
use crate::webhook::model::{MessageData, Millis};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// One side effect. Each external action maps to exactly one Open API call (the upstream crate's `execute`).
#[derive(
    Clone, Debug, PartialEq, Serialize, Deserialize, strum::IntoStaticStr, strum::VariantNames,
)]
#[serde(tag = "type", rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Action {
    /// Turn the conversation's agent-connection ("manual") status on or off.
    SetManual {
        conversation_id: ConversationId,
        enabled: bool,
    },
    /// Move the conversation to another flow (its first node without `node_id`), given by id or
    /// by title (`flow`, with the conversation's bot, whose flow list the executor resolves it
    /// through: a title is looked up where I/O is allowed, not in the pure rules).
    Navigate {
        conversation_id: ConversationId,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        flow_id: Option<i64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        node_id: Option<i64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        flow: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bot_id: Option<crate::ids::BotId>,
    },
    /// Merge params into the conversation (`null` removes a key).
    UpdateParams {
        conversation_id: ConversationId,
        params: Map<String, Value>,
    },
    /// Send a message into a conversation (text, media, cards, location, buttons).
    SendMessage {
        conversation_id: ConversationId,
        message: MessageData,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        custom: Option<String>,
    },
    /// Send a message to an end user (their newest conversation).
    SendToEndUser {
        end_user_id: EndUserId,
        message: MessageData,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        custom: Option<String>,
    },
    /// Partner messenger: change a counseling conversation's status, assignee or memo.
    PartnerUpdateConversation {
        sender_key: String,
        user_key: String,
        update: UpdatePbConversation,
    },
    PartnerBlock {
        sender_key: String,
        user_key: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    PartnerUnblock {
        sender_key: String,
        user_key: String,
    },
    PartnerRemoveSession {
        sender_key: String,
        user_key: String,
    },
    /// Partner messenger: relay a message to a user of the counseling channel.
    PartnerSendMessage {
        sender_key: String,
        user_key: String,
        message: MessageData,
    },
    PartnerChannelSetting {
        sender_key: String,
        setting: ChannelSetting,
    },
    /// A notification message from a template.
    SendNotification { request: NotifyRequest },
    /// Internal: change the conversation's own state. Applied in the fold itself, never queued.
    UpdateState {
        conversation_id: ConversationId,
        #[serde(default)]
        add_labels: Vec<String>,
        #[serde(default)]
        remove_labels: Vec<String>,
        /// `null` removes a variable.
        #[serde(default)]
        variables: BTreeMap<String, Value>,
    },
    /// Internal: start the conversation's timer `name`, or restart it (a new due time replaces
    /// the old); it fires as a `timer.<name>` event `after` the decision. Applied in the fold.
    StartTimer {
        conversation_id: ConversationId,
        name: String,
        #[serde(with = "humantime_serde")]
        after: std::time::Duration,
    },
    /// Internal: stop the conversation's timer `name` before it fires. Applied in the fold.
    CancelTimer {
        conversation_id: ConversationId,
        name: String,
    },
    /// Tell the help desks (`helpdesk`): an event of `kind` (one of
    /// `helpdesk::DeskEventKind`, checked when rules load; kept as text so an entry stored by an
    /// older build still reads) about the conversation, signed and POSTed by the executor.
    NotifyHelpdesk {
        conversation_id: ConversationId,
        kind: String,
        /// Why, in the help desk's terms (shown to agents).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        #[serde(default)]
        payload: Value,
    },
}

impl Action {
    /// Stable name, for metrics, listings and config (`outbox.blocking`): the serde tag.
    pub fn name(&self) -> &'static str {
        self.into()
    }

    /// Every action name, for config validation.
    pub const NAMES: &'static [&'static str] = <Action as strum::VariantNames>::VARIANTS;

    /// Where the action is ordered: actions of one queue run one at a time, in decision order.
    /// Actions about a conversation queue behind that conversation; the others behind their
    /// target (end user, partner user, channel, notification recipient).
    pub fn queue(&self) -> String {
        match self {
            Action::SetManual {
                conversation_id, ..
            }
            | Action::Navigate {
                conversation_id, ..
            }
            | Action::UpdateParams {
                conversation_id, ..
            }
            | Action::SendMessage {
                conversation_id, ..
            }
            | Action::UpdateState {
                conversation_id, ..
            }
            | Action::StartTimer {
                conversation_id, ..
            }
            | Action::CancelTimer {
                conversation_id, ..
            } => PartitionKey::Conversation(conversation_id.clone()).encode(),
            // Its own queue: ordered within the conversation's help-desk events, but a help desk
            // that is down never holds up the conversation's Open API actions.
            Action::NotifyHelpdesk {
                conversation_id, ..
            } => format!("helpdesk:{conversation_id}"),
            Action::SendToEndUser { end_user_id, .. } => {
                PartitionKey::EndUser(end_user_id.clone()).encode()
            }
            Action::PartnerUpdateConversation {
                sender_key,
                user_key,
                ..
            }
            | Action::PartnerBlock {
                sender_key,
                user_key,
                ..
            }
            | Action::PartnerUnblock {
                sender_key,
                user_key,
            }
            | Action::PartnerRemoveSession {
                sender_key,
                user_key,
            }
            | Action::PartnerSendMessage {
                sender_key,
                user_key,
                ..
            } => format!("pb:{sender_key}:{user_key}"),
            Action::PartnerChannelSetting { sender_key, .. } => format!("pb:{sender_key}"),
            Action::SendNotification { request } => {
                format!("notify:{}:{}", request.sender_key, request.recipient)
            }
        }
    }
}

/// The stable id of a decided action: the same event, rule and position always give the same id,
/// so a re-decided action (after a crash, or a replay) is recognised, and the upstream, which
/// gets it as the idempotency key, applies it once.
pub fn action_id(event: &EventId, rule: &str, index: usize) -> String {
    format!("{event}/{rule}/{index}")
}

/// An action as decided for one event by one rule.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub rule: String,
    /// The action's position in its rule: with the event and rule, its stable id.
    pub index: usize,
    pub action: Action,
}

/// An outbox entry: a decided action waiting to be carried out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OutboxEntry {
    /// Position in the outbox (global decision order).
    pub seq: u64,
    /// [`action_id`], also the idempotency key.
    pub id: String,
    pub queue: String,
    pub event_id: EventId,
    pub rule: String,
    pub action: Action,
    /// When the source event was received (for end-to-end latency).
    pub received_at: Millis,
    pub decided_at: Millis,
    /// The rule set version that decided it ([`Decide::version`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub rules_version: String,
    /// The idempotency key when it is not `id`: a dead letter the upstream refused is retried
    /// under a fresh key, because the upstream keeps its error answer under the old one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

impl OutboxEntry {
    /// A decided action as queued: `seq` is its outbox position, `id` its action id. A message it
    /// sends is marked with the id ([`echo::marked`]), so its echo is recognised.
    pub fn decided(
        seq: u64,
        id: String,
        event_id: &EventId,
        decision: Decision,
        (rules_version, received_at, decided_at): (&str, Millis, Millis),
    ) -> Self {
        OutboxEntry {
            seq,
            queue: decision.action.queue(),
            event_id: event_id.clone(),
            rule: decision.rule,
            action: echo::marked(decision.action, &id),
            received_at,
            decided_at,
            rules_version: rules_version.to_owned(),
            idempotency_key: None,
            id,
        }
    }

    /// The idempotency key of the entry's next call.
    pub fn key(&self) -> &str {
        self.idempotency_key.as_deref().unwrap_or(&self.id)
    }
}

/// Why a pending entry waits: its attempts so far, kept (in the store, by seq) after each failed
/// attempt and removed in the transaction that records its outcome, so a restart keeps the
/// give-up clock and the count, and an operator sees why it waits. No secrets: the error is the
/// failure's display text, which names endpoints, never URLs or keys.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryState {
    /// Attempts made (every one, failed or not).
    #[serde(default)]
    pub attempts: u32,
    /// Transient failures in a row (the backoff's exponent).
    #[serde(default)]
    pub failures: u32,
    /// Daemon time of the first attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_attempt_at: Option<Millis>,
    /// Daemon time of the first failed attempt: the give-up clock (`outbox.give_up_after`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_failure_at: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_attempt_at: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// When it is tried again (daemon time); `None`: when its destination's circuit lets it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_attempt_at: Option<Millis>,
}

/// A finished entry, kept for the audit window (`outbox.audit_retention`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DoneRecord {
    pub entry: OutboxEntry,
    /// `done`, or `dropped` when an operator dropped its dead letter.
    pub outcome: String,
    pub at: Millis,
    pub attempts: u32,
    /// Why it was dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// An entry that could not be carried out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeadLetter {
    pub entry: OutboxEntry,
    /// Stable reason code: `http_<status>`, the service's error code, `retries_exhausted`,
    /// `tls_<reason>` (retries ran out on a TLS handshake that failed: `tls::TlsReason::label`),
    /// `invalid_call`, `no_helpdesk`, `unknown_flow` (a navigation's flow title is not in the
    /// bot's flow list); for help-desk events `helpdesk_http_<status>` (a help desk refused it),
    /// `retries_exhausted` (unreachable for `outbox.give_up_after`), `tls_<reason>` (its
    /// certificate never verified meanwhile) and `unknown_event_kind` (a kind from an older rule
    /// set).
    pub reason: String,
    pub error: String,
    pub attempts: u32,
    pub first_attempt_at: Millis,
    pub last_attempt_at: Millis,
    /// Later entries of its queue wait for it (the action is configured as blocking).
    pub blocking: bool,
    /// The upstream refused the call with a permanent error status (not a retryable one, which
    /// may follow an attempt that took effect): nothing took effect, and the refusal is stored
    /// under the call's key, so a retry needs a new key.
    #[serde(default)]
    pub answered: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_round_trip_through_json_with_a_stable_tag() {
        let a = Action::Navigate {
            conversation_id: ConversationId::new("c1"),
            flow_id: Some(5),
            node_id: Some(40),
            flow: None,
            bot_id: None,
        };
        let json = serde_json::to_value(&a).expect("json");
        assert_eq!(json["type"], "navigate");
        assert_eq!(json["flow_id"], 5);
        let back: Action = serde_json::from_value(json).expect("back");
        assert_eq!(back, a);
        assert_eq!(a.name(), "navigate");
        assert!(Action::NAMES.contains(&a.name()));
        assert_eq!(Action::NAMES.len(), 16);
    }

    #[test]
    fn ids_are_stable_and_distinct_per_rule_and_position() {
        let e = EventId::new("ev-1");
        assert_eq!(action_id(&e, "handoff", 0), action_id(&e, "handoff", 0));
        assert_ne!(action_id(&e, "handoff", 0), action_id(&e, "handoff", 1));
        assert_ne!(action_id(&e, "handoff", 0), action_id(&e, "greet", 0));
    }

    #[test]
    fn conversation_actions_share_their_conversation_queue() {
        let c = ConversationId::new("c1");
        let manual = Action::SetManual {
            conversation_id: c.clone(),
            enabled: true,
        };
        let nav = Action::Navigate {
            conversation_id: c,
            flow_id: Some(1),
            node_id: None,
            flow: None,
            bot_id: None,
        };
        assert_eq!(manual.queue(), nav.queue());
        let other = Action::PartnerUnblock {
            sender_key: "s".into(),
            user_key: "u".into(),
        };
        assert_ne!(other.queue(), manual.queue());
    }

    #[test]
    fn help_desk_events_queue_apart_from_their_conversation() {
        let notify = |kind: &str| Action::NotifyHelpdesk {
            conversation_id: ConversationId::new("c1"),
            kind: kind.into(),
            reason: None,
            payload: Value::Null,
        };
        let manual = Action::SetManual {
            conversation_id: ConversationId::new("c1"),
            enabled: true,
        };
        assert_eq!(notify("handoff.requested").queue(), "helpdesk:c1");
        assert_eq!(
            notify("handoff.requested").queue(),
            notify("handoff.ended").queue()
        );
        assert_ne!(notify("handoff.requested").queue(), manual.queue());
        // Entries stored before `reason` existed still read.
        let old: Action = serde_json::from_value(serde_json::json!({
            "type": "notify_helpdesk", "conversation_id": "c1", "kind": "handoff.requested"
        }))
        .expect("old entry");
        assert_eq!(old, notify("handoff.requested"));
    }
}
