//! The help desk's side of a conversation: which agent took it through the agent API, and the
//! verdict on each agent command.
//!
//! Unlike the rest of the state, which observes the service and is last-writer-wins (any arrival
//! order gives the same state), agent commands are requests that may be refused: whether an accept
//! wins depends on what was folded before it. They are folded in their conversation's sequence
//! order, which the store keeps, so the fold, a replay and an audit all reach the same verdicts.
//! The fold is the authority: the API's answer is the verdict recorded here.

use super::ConversationState;
use crate::actions::Action;
use crate::webhook::agent::{AgentCommand, Command, DeskAgent};
use crate::webhook::model::{Event, Millis};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Verdicts kept per conversation: enough for an API call to find its own (and a retry after a
/// lost answer), bounded so the state does not grow with every command.
pub const KEPT_VERDICTS: usize = 32;

/// The rule name of the actions an agent command decides (not a valid rule name, so no rule's
/// action ids can collide with them).
pub const BUILTIN_RULE: &str = "@agent-api";

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Desk {
    /// The agent who accepted the conversation, until it is released.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<DeskAgent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_at: Option<Millis>,
    /// The accept's event id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_at: Option<Millis>,
    /// The newest verdicts, oldest first.
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    pub verdicts: VecDeque<Verdict>,
}

/// What the fold made of one agent command.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub event_id: String,
    pub command: String,
    pub at: Millis,
    pub outcome: Outcome,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Outcome {
    /// Carried out (its actions are in the outbox). `changed` is false for a repeat that had
    /// nothing left to do (the same agent accepting again).
    Applied {
        changed: bool,
    },
    Rejected {
        reason: Rejection,
    },
}

/// Why the state refused a command (a stable code: the API's 409 answers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rejection {
    /// Another agent accepted it first.
    AlreadyAccepted,
    /// Release or reply for a conversation no agent accepted.
    NotWithAgent,
}

impl Rejection {
    pub fn code(self) -> &'static str {
        match self {
            Rejection::AlreadyAccepted => "already_accepted",
            Rejection::NotWithAgent => "not_with_agent",
        }
    }
}

impl Desk {
    /// The verdict recorded for an event, if it is still kept.
    pub fn verdict(&self, event_id: &str) -> Option<&Verdict> {
        self.verdicts.iter().rev().find(|v| v.event_id == event_id)
    }

    fn record(&mut self, verdict: Verdict) {
        while self.verdicts.len() >= KEPT_VERDICTS {
            self.verdicts.pop_front();
        }
        self.verdicts.push_back(verdict);
    }
}

impl ConversationState {
    /// Fold an agent command: check it against the state, apply it, record the verdict. Returns
    /// whether it was applied (a refused command reaches no rule and decides nothing).
    pub(super) fn fold_agent(&mut self, event: &Event, cmd: &AgentCommand) -> bool {
        let desk = &mut self.desk;
        let outcome = match &cmd.command {
            Command::Accept { agent } => match &desk.agent {
                Some(current) if current.id != agent.id => Outcome::Rejected {
                    reason: Rejection::AlreadyAccepted,
                },
                Some(_) => Outcome::Applied { changed: false },
                None => {
                    desk.agent = Some(agent.clone());
                    desk.accepted_at = Some(event.timestamp);
                    desk.accepted_by = Some(event.id.as_str().to_owned());
                    Outcome::Applied { changed: true }
                }
            },
            Command::Release { .. } | Command::Message { .. } if desk.agent.is_none() => {
                Outcome::Rejected {
                    reason: Rejection::NotWithAgent,
                }
            }
            Command::Release { .. } => {
                desk.agent = None;
                desk.released_at = Some(event.timestamp);
                Outcome::Applied { changed: true }
            }
            Command::Message { .. }
            | Command::Transfer { .. }
            | Command::Block { .. }
            | Command::Unblock { .. }
            | Command::RemoveSession { .. } => Outcome::Applied { changed: true },
        };
        let applied = matches!(outcome, Outcome::Applied { .. });
        desk.record(Verdict {
            event_id: event.id.as_str().to_owned(),
            command: cmd.command.name().to_owned(),
            at: event.timestamp,
            outcome,
        });
        applied
    }
}

/// The actions an applied agent command takes (before any rule's), decided from its verdict in
/// `after` (the state with the command folded in). Pure, so a replay decides the same.
pub fn builtin_actions(
    event: &Event,
    cmd: &AgentCommand,
    after: &ConversationState,
) -> Vec<Action> {
    let changed = matches!(
        after.desk.verdict(event.id.as_str()).map(|v| &v.outcome),
        Some(Outcome::Applied { changed: true })
    );
    if !changed {
        return Vec::new();
    }
    let conversation_id = cmd.conversation_id.clone();
    let navigate = |target: &crate::webhook::agent::Target| Action::Navigate {
        conversation_id: conversation_id.clone(),
        flow_id: target.flow_id,
        node_id: target.node_id,
        flow: target.flow.clone(),
        bot_id: after.bot_id.clone(),
    };
    match &cmd.command {
        Command::Accept { .. } => vec![Action::SetManual {
            conversation_id: conversation_id.clone(),
            enabled: true,
        }],
        Command::Message {
            message, partner, ..
        } => vec![match partner {
            Some(p) => Action::PartnerSendMessage {
                sender_key: p.sender_key.clone(),
                user_key: p.user_key.clone(),
                message: (**message).clone(),
            },
            None => Action::SendMessage {
                conversation_id: conversation_id.clone(),
                message: (**message).clone(),
                custom: None,
            },
        }],
        Command::Release { target } => {
            let mut out = vec![Action::SetManual {
                conversation_id: conversation_id.clone(),
                enabled: false,
            }];
            if target.is_some() {
                out.push(navigate(target));
            }
            out
        }
        Command::Transfer { target } => vec![navigate(target)],
        // The help desk hears of a block or unblock by an agent as it does of one by the abuse
        // rules (`user.blocked` / `user.unblocked`), so every desk sees the user's standing.
        Command::Block { partner, reason } => vec![
            Action::PartnerBlock {
                sender_key: partner.sender_key.clone(),
                user_key: partner.user_key.clone(),
                reason: reason.clone(),
            },
            Action::NotifyHelpdesk {
                conversation_id: conversation_id.clone(),
                kind: "user.blocked".to_owned(),
                reason: reason.clone(),
                payload: serde_json::json!({ "by": "agent-api" }),
            },
        ],
        Command::Unblock { partner } => vec![
            Action::PartnerUnblock {
                sender_key: partner.sender_key.clone(),
                user_key: partner.user_key.clone(),
            },
            Action::NotifyHelpdesk {
                conversation_id: conversation_id.clone(),
                kind: "user.unblocked".to_owned(),
                reason: None,
                payload: serde_json::json!({ "by": "agent-api" }),
            },
        ],
        Command::RemoveSession { partner } => vec![Action::PartnerRemoveSession {
            sender_key: partner.sender_key.clone(),
            user_key: partner.user_key.clone(),
        }],
    }
}
