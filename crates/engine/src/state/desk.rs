//! The help desk's side of a conversation: which agent took it through the agent API, and the
//! verdict on each agent command.
//!
//! Unlike the rest of the state, which observes the service and is last-writer-wins (any arrival
//! order gives the same state), agent commands are requests that may be refused: whether an accept
//! wins depends on what was folded before it. They are folded in their conversation's sequence
//! order, which the store keeps, so the fold, a replay and an audit all reach the same verdicts.
//! The fold is the authority: the API's answer is the verdict recorded here.

use super::ConversationState;
use model::action::Action;
use model::webhook::agent::{AgentCommand, Command, DeskAgent};
use model::webhook::model::{Event, Millis};
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
            | Command::RemoveSession { .. }
            | Command::Notice { .. } => Outcome::Applied { changed: true },
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
    let navigate = |target: &model::webhook::agent::Target| Action::Navigate {
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
        }
        | Command::Notice { message, partner } => vec![match partner {
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

/// The phase a conversation is in as the agent API shows it: the service's handoff phase, refined
/// by what the agent API did ([`DeskPhase::of`]). Its wire names ([`DeskPhase::as_str`], serde),
/// the byte its index keys carry ([`DeskPhase::byte`], the discriminant: stored, so never
/// renumbered) and the list of all phases ([`DeskPhase::ALL`], from which the API's allowed values
/// are built) come from the enum itself: no second list is kept by hand.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    strum::IntoStaticStr,
    strum::VariantArray,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case", const_into_str)]
#[repr(u8)]
pub enum DeskPhase {
    /// Waiting for an agent: exactly the conversations in the waiting queue
    /// ([`super::queue::waiting_since`]).
    Requested = b'1',
    /// Taken by an agent through the agent API.
    Accepted = b'2',
    /// Connected to an agent by the service.
    Connected = b'3',
    /// Handed back after an accept that served its request.
    Released = b'4',
    /// The request was cancelled.
    Cancelled = b'5',
    /// The agent call ended.
    Ended = b'6',
    /// With the bot: never handed off, or handed back by the rules before anyone took it (the
    /// wait ran out, after hours).
    Bot = b'7',
}

impl DeskPhase {
    /// Every phase, in declaration order (the first is the queue's default).
    pub const ALL: &'static [DeskPhase] = <DeskPhase as strum::VariantArray>::VARIANTS;

    /// The phase's wire name.
    pub const fn as_str(self) -> &'static str {
        self.into_str()
    }

    /// The byte that names the phase in the store's index keys.
    pub const fn byte(self) -> u8 {
        self as u8
    }
}

impl DeskPhase {
    /// The phase named `name` (its wire name), if any.
    pub fn parse(name: &str) -> Option<DeskPhase> {
        DeskPhase::ALL.iter().copied().find(|p| p.as_str() == name)
    }

    /// A conversation's phase. `Requested` exactly when it waits in the queue
    /// ([`super::queue::waiting_since`]), so the listing and the queue agree by construction.
    pub fn of(s: &ConversationState) -> DeskPhase {
        use super::HandoffPhase;
        if s.desk.agent.is_some() {
            return DeskPhase::Accepted;
        }
        if super::queue::waiting_since(s).is_some() {
            return DeskPhase::Requested;
        }
        // Released after this request: the request was served.
        let served = match (s.desk.accepted_at, s.handoff.requested_at) {
            (Some(accepted), Some(requested)) => accepted >= requested,
            (Some(_), None) => true,
            _ => false,
        };
        match s.handoff.phase.value {
            // Not waiting although requested: an accept served this request, or the rules
            // handed the user back to the bot without one.
            HandoffPhase::Requested if served => DeskPhase::Released,
            HandoffPhase::Requested if super::queue::handed_back(s) => DeskPhase::Bot,
            HandoffPhase::Requested => DeskPhase::Released,
            HandoffPhase::Bot if served => DeskPhase::Released,
            HandoffPhase::Bot => DeskPhase::Bot,
            HandoffPhase::Connected => DeskPhase::Connected,
            HandoffPhase::Cancelled => DeskPhase::Cancelled,
            HandoffPhase::Ended => DeskPhase::Ended,
        }
    }
}

impl std::fmt::Display for DeskPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::HandoffPhase;

    fn waiting(id: &str, requested_at: Millis) -> ConversationState {
        let mut s = ConversationState::new(id.into());
        s.bot_id = Some("B1".into());
        s.handoff.requested_at = Some(requested_at);
        s.handoff.phase.value = HandoffPhase::Requested;
        s
    }

    #[test]
    fn phase_names_bytes_and_serde_come_from_one_list() {
        let mut bytes: Vec<u8> = DeskPhase::ALL.iter().map(|p| p.byte()).collect();
        bytes.sort_unstable();
        bytes.dedup();
        assert_eq!(bytes.len(), DeskPhase::ALL.len(), "bytes are distinct");
        for phase in DeskPhase::ALL {
            assert_eq!(DeskPhase::parse(phase.as_str()), Some(*phase));
            let json = serde_json::to_value(phase).expect("json");
            assert_eq!(json, serde_json::json!(phase.as_str()));
            let back: DeskPhase = serde_json::from_value(json).expect("back");
            assert_eq!(back, *phase);
        }
        assert_eq!(DeskPhase::parse("all"), None);
        assert_eq!(DeskPhase::ALL[0], DeskPhase::Requested);
        // The wire names and the stored bytes, pinned: neither may change.
        let pinned: Vec<(&str, u8)> = DeskPhase::ALL
            .iter()
            .map(|p| (p.as_str(), p.byte()))
            .collect();
        assert_eq!(
            pinned,
            [
                ("requested", b'1'),
                ("accepted", b'2'),
                ("connected", b'3'),
                ("released", b'4'),
                ("cancelled", b'5'),
                ("ended", b'6'),
                ("bot", b'7'),
            ]
        );
    }

    #[test]
    fn the_requested_phase_is_the_waiting_queue() {
        let mut accepted = waiting("c0", 1);
        accepted.desk.agent = Some(DeskAgent {
            id: "a".into(),
            name: None,
        });
        accepted.desk.accepted_at = Some(2);
        let mut released = waiting("c4", 1);
        released.desk.accepted_at = Some(5);
        let mut back_to_bot = ConversationState::new("c5".into());
        back_to_bot.desk.accepted_at = Some(5);
        let mut ended = waiting("c6", 1);
        ended.handoff.phase.value = HandoffPhase::Ended;
        let states = vec![
            waiting("c1", 10),
            accepted,
            released,
            back_to_bot,
            ended,
            ConversationState::new("c7".into()),
        ];
        for s in &states {
            assert_eq!(
                DeskPhase::of(s) == DeskPhase::Requested,
                super::super::queue::waiting_since(s).is_some(),
                "{}",
                s.id
            );
        }
        let phases: Vec<DeskPhase> = states.iter().map(DeskPhase::of).collect();
        assert_eq!(
            phases,
            [
                DeskPhase::Requested,
                DeskPhase::Accepted,
                DeskPhase::Released,
                DeskPhase::Released,
                DeskPhase::Ended,
                DeskPhase::Bot,
            ]
        );
        // Asked again after the release: waiting again.
        let mut again = states[2].clone();
        again.handoff.requested_at = Some(9);
        assert_eq!(DeskPhase::of(&again), DeskPhase::Requested);
    }
}
