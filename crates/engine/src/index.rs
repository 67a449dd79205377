//! What a store's indexes derive from the states, in words of no backend: the waiting queue's
//! entries, the agent API's phase listing and the sweeper's index ([`Derived`]), the retention
//! index ([`Activity`]) and the running timers ([`TimerRef`]). The batch fold
//! ([`crate::batch`]) says how they change; each backend keeps them its own way (sled as keys in
//! its trees, a table backend as columns it indexes).

use crate::state::desk::DeskPhase;
use crate::state::{belief, queue, ConversationState, EndUserState};
use model::ids::BotId;
use model::webhook::model::Millis;

/// When a conversation was last active: its newest event (a deletion is one), or a running
/// timer's due time if later (a conversation waiting on a timer is not idle).
pub fn conversation_activity(s: &ConversationState) -> Millis {
    let timers = s.timers.values().map(|t| t.due_at);
    timers
        .chain(s.deleted_at)
        .fold(s.last_event_at, Millis::max)
}

/// When an end user was last active: their newest own event, or the newest conversation event
/// that named them.
pub fn end_user_activity(u: &EndUserState) -> Millis {
    u.deleted_at.into_iter().fold(
        u.last_event_at.max(u.last_conversation_id.stamp.at),
        Millis::max,
    )
}

/// Which states the retention index holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateKind {
    Conversation,
    EndUser,
}

/// A state in the retention index: by its newest activity, oldest first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Activity {
    pub kind: StateKind,
    pub at: Millis,
    pub id: String,
}

impl Activity {
    pub fn of_conversation(s: &ConversationState) -> Activity {
        Activity {
            kind: StateKind::Conversation,
            at: conversation_activity(s),
            id: s.id.as_str().to_owned(),
        }
    }

    pub fn of_end_user(u: &EndUserState) -> Activity {
        Activity {
            kind: StateKind::EndUser,
            at: end_user_activity(u),
            id: u.id.as_str().to_owned(),
        }
    }
}

/// A conversation waiting in its bot's queue. A bot's queue is in [`QueueSpot`] order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueEntry {
    pub bot: String,
    /// Since when it waits (times before 1970 count as 1970, as the queue orders them).
    pub since: Millis,
    pub conversation: String,
}

impl QueueEntry {
    /// A conversation's entry, when it waits (`queue::waiting_since`) and has a bot.
    pub fn of(s: &ConversationState) -> Option<QueueEntry> {
        let since = queue::waiting_since(s)?;
        let bot = s.bot_id.as_ref()?;
        Some(QueueEntry {
            bot: bot.as_str().to_owned(),
            since: since.max(0),
            conversation: s.id.as_str().to_owned(),
        })
    }

    pub fn spot(&self) -> QueueSpot<'_> {
        QueueSpot {
            since: self.since,
            conversation: &self.conversation,
        }
    }
}

/// A place in one bot's waiting queue: request time, then conversation id (byte order), which is
/// the queue's order (the derived `Ord` compares the fields in this order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct QueueSpot<'a> {
    pub since: Millis,
    pub conversation: &'a str,
}

/// An entry a conversation's state derives in the agent API's listing or the reconciliation
/// sweeper's index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Derived {
    /// The listing of a phase, in request-time-then-id order (no request first).
    Phase {
        phase: DeskPhase,
        requested_at: Option<Millis>,
        conversation: String,
    },
    /// The same within the conversation's bot.
    BotPhase {
        bot: String,
        phase: DeskPhase,
        requested_at: Option<Millis>,
        conversation: String,
    },
    /// The sweeper's: out of plain bot mode now.
    Active { conversation: String },
    /// The sweeper's: back with the bot since `at`.
    Released { at: Millis, conversation: String },
}

/// What the [`Derived`] entries read of a state: equal facts, equal entries. A fold compares a
/// conversation's facts as it found them with its facts after, and lists entries only when they
/// differ.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DerivedFacts {
    phase: DeskPhase,
    requested_at: Option<Millis>,
    bot: Option<BotId>,
    watch: Option<Watch>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Watch {
    Active,
    Released(Millis),
}

impl DerivedFacts {
    pub fn of(s: &ConversationState) -> DerivedFacts {
        let watch = match belief::is_active(s) {
            true => Some(Watch::Active),
            false => belief::released_at(s).map(Watch::Released),
        };
        DerivedFacts {
            phase: DeskPhase::of(s),
            requested_at: s.handoff.requested_at,
            bot: s.bot_id.clone(),
            watch,
        }
    }

    /// The entries of conversation `id` with these facts: its phase's, its bot's phase's (with a
    /// bot), the sweeper's (when watched).
    pub fn entries(&self, id: &str) -> Vec<Derived> {
        let (phase, requested_at) = (self.phase, self.requested_at);
        let mut out = vec![Derived::Phase {
            phase,
            requested_at,
            conversation: id.to_owned(),
        }];
        if let Some(bot) = &self.bot {
            out.push(Derived::BotPhase {
                bot: bot.as_str().to_owned(),
                phase,
                requested_at,
                conversation: id.to_owned(),
            });
        }
        out.extend(self.watch.map(|watch| match watch {
            Watch::Active => Derived::Active {
                conversation: id.to_owned(),
            },
            Watch::Released(at) => Derived::Released {
                at,
                conversation: id.to_owned(),
            },
        }));
        out
    }
}

/// Every entry a conversation's state derives.
pub fn derived(s: &ConversationState) -> Vec<Derived> {
    DerivedFacts::of(s).entries(s.id.as_str())
}

/// A running timer: due time, conversation, name (the timers index's order).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TimerRef {
    pub due_at: Millis,
    pub conversation: String,
    pub name: String,
}

/// A conversation's running timers.
pub fn timers(s: &ConversationState) -> Vec<TimerRef> {
    s.timers
        .iter()
        .map(|(name, t)| TimerRef {
            due_at: t.due_at,
            conversation: s.id.as_str().to_owned(),
            name: name.clone(),
        })
        .collect()
}
