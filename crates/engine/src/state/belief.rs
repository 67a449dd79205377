//! What the bridge believes of a conversation's manual mode and handoff, as the reconciliation
//! sweeper compares it with the service, and the fold of the drift it finds (`reconcile.drift`).
//!
//! Pure, like the rest of the state: the fold writes last-writer-wins registers stamped with the
//! drift event, so any arrival order gives the same state.

use super::{max_some, ConversationState, HandoffPhase, Stamp};
use model::action::Action;
use model::webhook::drift::{Believed, Drift, DriftKind};
use model::webhook::model::{Event, Millis};

/// The service's manual status while manual mode is on (the only one it is known to use).
pub const MANUAL_ON_STATUS: &str = "HANDOVER";

/// Whether the bridge believes manual mode on: what the newest of three stamped sources says:
/// - the bridge's own last `set_manual` (`manual_set`);
/// - the handoff's phase: `connected` means on, `cancelled` and `ended` mean off (the service
///   turns manual mode on and off with them; its events' `context.manual.status` is empty when
///   off, which the fold cannot tell from "not reported");
/// - the service's last reported status (`manual_status`, from webhooks and drifts): set means on.
///
/// On a tie (the same event) the bridge's decision wins, then the phase: both were taken with
/// that event's report in view.
pub fn believes_manual(s: &ConversationState) -> bool {
    let set = s.manual_set.value.map(|on| (&s.manual_set.stamp, 2, on));
    let phase = match s.handoff.phase.value {
        HandoffPhase::Connected => Some(true),
        HandoffPhase::Cancelled | HandoffPhase::Ended => Some(false),
        HandoffPhase::Bot | HandoffPhase::Requested => None,
    }
    .map(|on| (&s.handoff.phase.stamp, 1, on));
    let reported = s
        .manual_status
        .value
        .as_deref()
        .is_some_and(|v| !v.is_empty());
    let report = Some((&s.manual_status.stamp, 0, reported));
    [set, phase, report]
        .into_iter()
        .flatten()
        .max_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)))
        .is_some_and(|(_, _, on)| on)
}

/// An agent has the conversation: connected at the service, or accepted through the agent API.
pub fn has_agent(s: &ConversationState) -> bool {
    s.desk.agent.is_some() || s.handoff.phase.value == HandoffPhase::Connected
}

/// The bridge's belief, as a drift event records it.
pub fn believed(s: &ConversationState) -> Believed {
    let phase = serde_json::to_value(s.handoff.phase.value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    Believed {
        manual: believes_manual(s),
        phase,
        agent: has_agent(s),
        waiting: super::queue::waiting_since(s).is_some(),
    }
}

/// Whether the conversation is out of plain bot mode: a handoff requested or waiting, an agent
/// connected or accepted, manual mode believed on. The sweeper checks every such conversation
/// (the store keeps them indexed, with those released recently: [`released_at`]).
pub fn is_active(s: &ConversationState) -> bool {
    believes_manual(s)
        || has_agent(s)
        || matches!(
            s.handoff.phase.value,
            HandoffPhase::Requested | HandoffPhase::Connected
        )
}

/// When a conversation that is not active left its handoff (the call cancelled or ended, the
/// desk's release, manual mode turned off): the latest of those times, if any.
pub fn released_at(s: &ConversationState) -> Option<Millis> {
    let manual_off = (!believes_manual(s))
        .then(|| {
            let at = s.manual_set.stamp.at.max(s.manual_status.stamp.at);
            (at > 0).then_some(at)
        })
        .flatten();
    [
        s.handoff.cancelled_at,
        s.handoff.ended_at,
        s.desk.released_at,
        manual_off,
    ]
    .into_iter()
    .flatten()
    .max()
}

impl ConversationState {
    /// A rule decided `set_manual` for `event`: the bridge now believes what it asked for.
    pub fn note_manual_decided(&mut self, enabled: bool, event: &Event) {
        self.manual_set.set(Some(enabled), &Stamp::of(event));
    }

    /// Record the `set_manual` decisions among `actions` (decided for `event`).
    pub fn note_decided<'a>(&mut self, event: &Event, actions: impl Iterator<Item = &'a Action>) {
        for action in actions {
            if let Action::SetManual { enabled, .. } = action {
                self.note_manual_decided(*enabled, event);
            }
        }
    }

    /// A drift found by the sweeper: the service's manual status is taken as reported at the
    /// drift's time. When the service says off while the bridge believed on, the handoff ends
    /// (phase `ended` at that time), so the conversation leaves the waiting queue
    /// (`queue::waiting_since`). Unconditional LWW writes: any order gives the same state.
    pub(super) fn fold_drift(&mut self, drift: &Drift, stamp: &Stamp) {
        let status = drift.service.manual.then(|| {
            drift
                .service
                .status
                .clone()
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| MANUAL_ON_STATUS.to_owned())
        });
        self.manual_status.set(status, stamp);
        if drift.kind == DriftKind::ManualOffUnknown {
            self.handoff.phase.set(HandoffPhase::Ended, stamp);
            self.handoff.ended_at = max_some(self.handoff.ended_at, stamp.at);
        }
    }
}
