//! Deciding: what decides actions for an event ([`Decide`]), what it reads besides the event
//! and the state ([`Inputs`]), and all it yields ([`Decided`]). Pure: the callers hand in what
//! was read.

use crate::state::queue::Standing;
use crate::state::{ConversationState, EndUserState, FiringCap, TemplateError};
use model::action::{action_id, Action, Decision};
use model::ids::EventId;
use model::webhook::model::{Event, Millis};

/// The clocks of one decision. `now` is the decision's clock: conditions, templates and timer due
/// times read it; a fold decides with the event's receive time (`engine::batch`), so a fold done
/// again after a crash decides as the first did. `received_at` is when the event was received:
/// firing caps count by it, so a replay (which decides with today's `now`) counts each rule's
/// firings as the fold did, and decides the same events capped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecisionTime {
    pub now: Millis,
    pub received_at: Millis,
}

impl DecisionTime {
    /// One clock for both (tests, `rules test`).
    pub fn at(now: Millis) -> Self {
        DecisionTime {
            now,
            received_at: now,
        }
    }
}

/// What a decision reads besides the event, the conversation's state after the fold and the
/// clocks. Borrowed and passed in by the caller, which has them at hand (the fold, a replay, an
/// audit, `rules test`), so deciding stays pure. `None` is unknown: the rule context leaves the
/// root out (tests and benchmarks that call [`Decide::decide`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Inputs<'a> {
    /// The conversation's state before the event was folded in (`changed` conditions compare it
    /// with the state after).
    pub before: Option<&'a ConversationState>,
    /// The conversation's end user, as the bridge knows them (params from `bot.end_user.*`).
    pub end_user: Option<&'a EndUserState>,
    /// The conversation's standing in its bot's waiting queue after the event (position,
    /// length, expected wait), as the fold keeps the queue.
    pub queue: Option<&'a Standing>,
}

/// A rule that fired for an event (matched, under its cap): the fold records it in the
/// conversation's firing history, which its cap reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fired {
    pub rule: String,
    pub cap: FiringCap,
}

/// A rule that matched an event but had fired `fired` times in its cap's window already, so it
/// decided nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capped {
    pub rule: String,
    pub cap: FiringCap,
    pub fired: usize,
}

/// An action of a fired rule whose template failed at run time (e.g. a filter on a value the
/// event lacks): no action is made; the fold records why in the state (`template_errors`), and the
/// rule's other actions still run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failed {
    pub rule: String,
    /// The action's position in its rule: its id is the one it would have had.
    pub index: usize,
    /// The action's type (`send_message`...).
    pub kind: String,
    pub error: String,
}

/// Everything deciding one event yields: the decisions, and what the state must remember of it
/// (firings, cap hits, failed templates). Kept apart from the decisions because a rule may fire
/// without deciding an action (every template failed, or it has none) and a capped rule decides
/// none.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decided {
    pub decisions: Vec<Decision>,
    pub fired: Vec<Fired>,
    pub capped: Vec<Capped>,
    pub failed: Vec<Failed>,
}

impl Decided {
    /// Record the firings, cap hits and failed templates in the conversation's state, stamped with the event's
    /// receive time. The fold and a replay both call it, so they keep the same history.
    pub fn record(&self, state: &mut ConversationState, event: &EventId, at: Millis) {
        for fired in &self.fired {
            state.record_firing(&fired.rule, fired.cap, at);
        }
        for capped in &self.capped {
            state.record_cap_hit(&capped.rule, capped.cap, event.as_str(), capped.fired, at);
        }
        for failed in &self.failed {
            state.record_template_error(TemplateError {
                id: action_id(event, &failed.rule, failed.index),
                event: event.as_str().to_owned(),
                rule: failed.rule.clone(),
                index: failed.index,
                kind: failed.kind.clone(),
                error: failed.error.clone(),
                at,
            });
        }
    }
}

/// Which optional [`Inputs`] a rule set reads: a fold builds only those (a copy of the state
/// before each event, a read of the end user, the conversation's standing in the waiting queue),
/// since most rule sets read none of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Needs {
    pub before: bool,
    pub end_user: bool,
    pub queue: bool,
}

impl Needs {
    pub const ALL: Needs = Needs {
        before: true,
        end_user: true,
        queue: true,
    };
    pub const NONE: Needs = Needs {
        before: false,
        end_user: false,
        queue: false,
    };
}

/// What decides actions: event + state (+ [`Inputs`]) + clocks in, decisions out. Pure (no I/O),
/// so the fold can call it before it writes and tests can call it without a network. The
/// rule engine implements it.
pub trait Decide: Send + Sync {
    /// The optional inputs [`evaluate`](Decide::evaluate) reads; the others may be left out.
    fn needs(&self) -> Needs {
        Needs::ALL
    }

    /// Everything decided for one event, given the conversation's state after the event was
    /// folded (its firing history included) and the other `inputs`.
    fn evaluate(
        &self,
        event: &Event,
        conversation: &ConversationState,
        inputs: Inputs<'_>,
        time: DecisionTime,
    ) -> Decided;

    /// Just the decisions, with one clock and no other inputs (tests, benchmarks).
    fn decide(
        &self,
        event: &Event,
        conversation: &ConversationState,
        now: Millis,
    ) -> Vec<Decision> {
        self.evaluate(
            event,
            conversation,
            Inputs::default(),
            DecisionTime::at(now),
        )
        .decisions
    }

    /// Which rules decided (recorded with every decision, for audits).
    fn version(&self) -> &str {
        "none"
    }
}

/// Decides nothing: the bridge only keeps state.
pub struct NoRules;

impl Decide for NoRules {
    fn needs(&self) -> Needs {
        Needs::NONE
    }

    fn evaluate(
        &self,
        _: &Event,
        _: &ConversationState,
        _: Inputs<'_>,
        _: DecisionTime,
    ) -> Decided {
        Decided::default()
    }
}

/// Whether an action changes the conversation's state in the fold itself (labels, variables,
/// timers: [`apply_to_state`]) rather than go to the outbox.
pub fn is_internal(action: &Action) -> bool {
    matches!(
        action,
        Action::UpdateState { .. } | Action::StartTimer { .. } | Action::CancelTimer { .. }
    )
}

/// Apply an internal state action to `state` (in the fold, never queued); false for the
/// actions that go to the outbox ([`is_internal`]). `now` is the decision's clock (a timer is due `after` it)
/// and `id` the action's id (a timer remembers what started it).
pub fn apply_to_state(
    action: &Action,
    state: &mut ConversationState,
    now: Millis,
    id: &str,
) -> bool {
    match action {
        Action::UpdateState {
            add_labels,
            remove_labels,
            variables,
            ..
        } => {
            state.update(add_labels, remove_labels, variables);
            true
        }
        Action::StartTimer { name, after, .. } => {
            let after = Millis::try_from(after.as_millis()).unwrap_or(Millis::MAX);
            let timer = crate::state::Timer {
                due_at: now.saturating_add(after),
                started_at: now,
                started_by: id.to_owned(),
            };
            state.start_timer(name, timer);
            true
        }
        Action::CancelTimer { name, .. } => {
            state.cancel_timer(name);
            true
        }
        _ => false,
    }
}
