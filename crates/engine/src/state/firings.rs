//! Firing caps' memory in a conversation's state: when each rule fired lately (what its cap
//! counts) and when a cap last held a rule back (the audit `state show` displays); and the
//! actions whose templates failed at run time (the audit shows them with their event).
//!
//! Times are the receive times of the events the rules fired for. The history stays bounded: only
//! firings inside their rule's window are kept, at most the cap's count per rule, and a rule's
//! entry goes once its window has passed.

use super::ConversationState;
use model::webhook::model::Millis;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// At most `count` firings of a rule per conversation in any window of length `per`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FiringCap {
    pub count: u32,
    #[serde(with = "humantime_serde")]
    pub per: Duration,
}

impl FiringCap {
    /// The window in ms (saturating: a window longer than the clock's range is "ever").
    pub fn per_ms(&self) -> Millis {
        Millis::try_from(self.per.as_millis()).unwrap_or(Millis::MAX)
    }
}

/// A rule's recent firings in one conversation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Firings {
    /// The window they are kept for (the rule's cap when it last fired), so that the entry of a
    /// rule that stopped firing is dropped too.
    #[serde(with = "humantime_serde")]
    pub per: Duration,
    /// When it fired, oldest first.
    pub at: Vec<Millis>,
}

/// The last time a cap held a rule back in this conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapHit {
    /// The receive time of the event it was held back for.
    pub at: Millis,
    /// That event's id.
    pub event: String,
    /// Its firings inside the window then, and the cap.
    pub fired: usize,
    pub cap: FiringCap,
    /// How many events the cap held it back for in this conversation, in all.
    pub hits: u64,
}

/// How many failed templates a conversation keeps: enough for an audit of recent events, bounded
/// so a rule that fails on every message cannot grow the state.
pub const TEMPLATE_ERRORS_KEPT: usize = 20;

/// An action of a fired rule whose template failed at run time: no action was made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateError {
    /// The id the action would have had (`<event>/<rule>/<index>`).
    pub id: String,
    pub event: String,
    pub rule: String,
    pub index: usize,
    /// The action's type.
    pub kind: String,
    /// The template engine's message (which names the template, never a value from the event).
    pub error: String,
    /// The event's receive time.
    pub at: Millis,
}

/// Whether a firing at `t` lies in the window of `per_ms` that ends at `at`. A firing stamped
/// after `at` counts as inside: a clock set back must not reopen a cap.
fn inside(t: Millis, per_ms: Millis, at: Millis) -> bool {
    t > at.saturating_sub(per_ms)
}

impl ConversationState {
    /// How often `rule` fired in the window of `per` that ends at `at`.
    pub fn firings_within(&self, rule: &str, per: Duration, at: Millis) -> usize {
        let per_ms = FiringCap { count: 0, per }.per_ms();
        self.firings.get(rule).map_or(0, |f| {
            f.at.iter().filter(|&&t| inside(t, per_ms, at)).count()
        })
    }

    /// `rule` fired at `at`: remember it for its cap, and forget the firings of every rule that
    /// have left their windows by `at`.
    pub fn record_firing(&mut self, rule: &str, cap: FiringCap, at: Millis) {
        let entry = self.firings.entry(rule.to_owned()).or_default();
        entry.per = cap.per;
        let position = entry.at.partition_point(|&t| t <= at);
        entry.at.insert(position, at);
        let keep = usize::try_from(cap.count).unwrap_or(usize::MAX);
        let excess = entry.at.len().saturating_sub(keep);
        entry.at.drain(..excess);
        self.firings.retain(|_, f| {
            let per_ms = FiringCap {
                count: 0,
                per: f.per,
            }
            .per_ms();
            f.at.retain(|&t| inside(t, per_ms, at));
            !f.at.is_empty()
        });
    }

    /// `rule`'s cap held it back for `event` at `at`, after `fired` firings in the window.
    pub fn record_cap_hit(
        &mut self,
        rule: &str,
        cap: FiringCap,
        event: &str,
        fired: usize,
        at: Millis,
    ) {
        let hits = self.capped.get(rule).map_or(0, |h| h.hits);
        self.capped.insert(
            rule.to_owned(),
            CapHit {
                at,
                event: event.to_owned(),
                fired,
                cap,
                hits: hits.saturating_add(1),
            },
        );
    }

    /// Keep `error`, forgetting the oldest beyond [`TEMPLATE_ERRORS_KEPT`]. The same action
    /// failing again (a replay's rebuild) is kept once.
    pub fn record_template_error(&mut self, error: TemplateError) {
        if self.template_errors.iter().any(|e| e.id == error.id) {
            return;
        }
        self.template_errors.push(error);
        let excess = self
            .template_errors
            .len()
            .saturating_sub(TEMPLATE_ERRORS_KEPT);
        self.template_errors.drain(..excess);
    }
}
