//! Drift found by the reconciliation sweeper, as the bridge's own stored events
//! (`reconcile.drift`).
//!
//! The sweeper (`crate::reconcile`) compares what the bridge believes of a conversation with what
//! the service answers; each difference becomes an event of its conversation, so it is durable,
//! deduped, folded in order with the conversation's webhook events, shown in the audit timeline
//! and seen by rules. Like `timer.*` and `agent.*`, the type is refused from the service's
//! webhook, and its ids start with the reserved `reconcile:` prefix.

use crate::ids::ConversationId;
use crate::webhook::model::Millis;
use serde::{Deserialize, Serialize};

/// The event type of a drift.
pub const DRIFT_EVENT: &str = "reconcile.drift";

/// The event types the bridge makes for reconciliation (one today).
pub const RECONCILE_EVENT_PREFIX: &str = "reconcile.";

/// What kind of difference a drift is. Its snake_case names ([`DriftKind::as_str`], serde, the
/// event field, metric label and rules' `drift.kind`) and the list of all kinds
/// ([`DriftKind::ALL`], which metrics, docs tests and rules' checks read) come from the enum
/// itself: no second list is kept by hand.
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
#[strum(serialize_all = "snake_case")]
pub enum DriftKind {
    /// Manual mode is on at the service, while the bridge believes it off and knows of no agent
    /// and no wait (someone turned it on where the bridge could not see, or a webhook was lost).
    ManualOnUnknown,
    /// The bridge believes manual mode on (it set it, or an agent is connected), while the
    /// service says it is off (an agent turned it off in the builder, which sends no webhook).
    ManualOffUnknown,
}

impl DriftKind {
    /// Every kind, in declaration order.
    pub const ALL: &'static [DriftKind] = <DriftKind as strum::VariantArray>::VARIANTS;

    /// The kind's name (event field, metric label, rules' `drift.kind`).
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

impl std::fmt::Display for DriftKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the bridge believed of the conversation when the sweeper read the service.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub struct Believed {
    /// Manual mode as the bridge believes it (the newer of the service's last report and the
    /// bridge's own last `set_manual`).
    pub manual: bool,
    /// The handoff phase (`bot`, `requested`, `connected`, `cancelled`, `ended`).
    pub phase: String,
    /// An agent has it: connected at the service, or accepted through the agent API.
    pub agent: bool,
    /// It waits in the queue for an agent.
    pub waiting: bool,
}

/// What the service answered.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub struct Observed {
    /// `GET /openapi/conversation/{id}/manual`'s `enabled`.
    pub manual: bool,
    /// Its `status` (`HANDOVER` while on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    /// When the service last changed it (Unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Millis>,
}

/// `data.drift` of a `reconcile.drift` event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub struct Drift {
    pub conversation_id: ConversationId,
    pub kind: DriftKind,
    pub believed: Believed,
    pub service: Observed,
    /// When the sweeper read the service (Unix ms, the bridge's clock): the event's timestamp,
    /// which stamps what its fold writes.
    pub found_at: Millis,
}

impl Drift {
    /// The event's id: `reconcile:<conversation>:<kind>:<found at>`, so a pass that hands the
    /// same drift to the writer twice (a retry after a writer error) stores it once.
    pub fn event_id(&self) -> String {
        crate::ids::Internal::Reconcile.id(format_args!(
            "{}:{}:{}",
            self.conversation_id, self.kind, self.found_at
        ))
    }
}

/// Whether `kind` is an event type the sweeper makes.
pub fn is_reconcile_event(kind: &str) -> bool {
    kind == DRIFT_EVENT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_serialise_as_their_names_and_all_lists_each_once() {
        for kind in DriftKind::ALL {
            let json = serde_json::to_value(kind).expect("json");
            assert_eq!(json, serde_json::json!(kind.as_str()));
            let back: DriftKind = serde_json::from_value(json).expect("back");
            assert_eq!(back, *kind);
        }
        let mut names: Vec<&str> = DriftKind::ALL.iter().map(|k| k.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), DriftKind::ALL.len());
        assert!(names.contains(&"manual_on_unknown"));
        assert!(names.contains(&"manual_off_unknown"));
    }

    #[test]
    fn the_event_id_is_reserved_and_deterministic() {
        let drift = Drift {
            conversation_id: "c1".into(),
            kind: DriftKind::ManualOffUnknown,
            believed: Believed::default(),
            service: Observed::default(),
            found_at: 7,
        };
        assert_eq!(drift.event_id(), "reconcile:c1:manual_off_unknown:7");
        assert_eq!(
            crate::ids::reserved_prefix(&drift.event_id()),
            Some("reconcile:")
        );
    }
}
