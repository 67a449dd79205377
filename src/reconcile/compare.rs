//! The comparison, pure: a conversation's state and the service's answer in, the drift out.

use engine::state::belief::{believed, believes_manual};
use engine::state::{ConversationState, HandoffPhase};
use model::contract::ManualStatus;
use model::webhook::drift::{Drift, DriftKind, Observed};
use model::webhook::model::Millis;

/// The service's answer to `GET /openapi/conversation/{id}/manual`, as a drift records it.
pub fn observed(manual: &ManualStatus) -> Observed {
    Observed {
        manual: manual.enabled,
        status: manual.status.clone(),
        updated_at: Some(manual.updated_at),
    }
}

/// What differs between the bridge's belief and the service, if anything:
/// - [`DriftKind::ManualOnUnknown`]: manual mode on at the service, while the bridge believes it
///   off, knows of no agent (connected, or accepted through the agent API) and of no wait in the
///   queue;
/// - [`DriftKind::ManualOffUnknown`]: the bridge believes manual mode on, or an agent connected
///   (the service's agent call), while the service says it is off.
pub fn compare(state: &ConversationState, service: &Observed) -> Option<DriftKind> {
    let belief = believed(state);
    match service.manual {
        true if !belief.manual && !belief.agent && !belief.waiting => {
            Some(DriftKind::ManualOnUnknown)
        }
        false if believes_manual(state) || state.handoff.phase.value == HandoffPhase::Connected => {
            Some(DriftKind::ManualOffUnknown)
        }
        _ => None,
    }
}

/// The drift of `state` against `service` found at `now`, if any.
pub fn drift(state: &ConversationState, service: &Observed, now: Millis) -> Option<Drift> {
    compare(state, service).map(|kind| Drift {
        conversation_id: state.id.clone(),
        kind,
        believed: believed(state),
        service: service.clone(),
        found_at: now,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::webhook::agent::DeskAgent;
    use model::webhook::model::Event;

    fn event(kind: &str, at: Millis, manual: Option<&str>) -> Event {
        let context = manual.map_or(
            serde_json::json!({}),
            |m| serde_json::json!({ "manual": { "status": m } }),
        );
        let raw = serde_json::json!({
            "id": format!("e{at}"), "event": kind, "sourceType": "bot", "sourceId": "B1",
            "timestamp": at,
            "data": { "conversation": { "id": "c1", "botId": "B1", "context": context } },
        });
        model::webhook::parse_event(&raw.to_string()).expect("event")
    }

    fn state(events: &[Event]) -> ConversationState {
        let mut s = ConversationState::new("c1".into());
        for e in events {
            s.apply(e);
        }
        s
    }

    fn service(manual: bool) -> Observed {
        Observed {
            manual,
            status: manual.then(|| "HANDOVER".to_owned()),
            updated_at: Some(1),
        }
    }

    const REQUESTED: &str = "bot.conversation.agent_call_requested";
    const CONNECTED: &str = "bot.conversation.agent_call_connected";
    const ENDED: &str = "bot.conversation.agent_call_disconnected";
    const UPDATED: &str = "bot.conversation.updated";

    #[test]
    fn agreement_is_no_drift() {
        let bot = state(&[event(UPDATED, 10, None)]);
        assert_eq!(compare(&bot, &service(false)), None);
        let connected = state(&[event(CONNECTED, 10, Some("HANDOVER"))]);
        assert_eq!(compare(&connected, &service(true)), None);
        // Waiting in the queue, manual on as the shipped rule set it.
        let mut waiting = state(&[event(REQUESTED, 10, None)]);
        waiting.note_manual_decided(true, &event(REQUESTED, 10, None));
        assert_eq!(compare(&waiting, &service(true)), None);
    }

    #[test]
    fn manual_on_with_nobody_on_the_bridge_side_is_manual_on_unknown() {
        let bot = state(&[event(UPDATED, 10, None)]);
        assert_eq!(
            compare(&bot, &service(true)),
            Some(DriftKind::ManualOnUnknown)
        );
        let ended = state(&[
            event(CONNECTED, 10, Some("HANDOVER")),
            event(ENDED, 20, None),
        ]);
        let found = drift(&ended, &service(true), 99).expect("drift");
        assert_eq!(found.kind, DriftKind::ManualOnUnknown);
        assert_eq!(found.found_at, 99);
        assert_eq!(found.believed.phase, "ended");
        assert!(!found.believed.manual && !found.believed.agent);
        assert!(found.service.manual);
        // Someone waits for an agent (the request not yet served): not drift, the wait decides.
        let waiting = state(&[event(REQUESTED, 10, None)]);
        assert_eq!(compare(&waiting, &service(true)), None);
        // An agent accepted it through the agent API.
        let mut accepted = state(&[event(UPDATED, 10, None)]);
        accepted.desk.agent = Some(DeskAgent {
            id: "alice".into(),
            name: None,
        });
        assert_eq!(compare(&accepted, &service(true)), None);
    }

    #[test]
    fn manual_off_while_the_bridge_believes_it_on_is_manual_off_unknown() {
        let connected = state(&[event(CONNECTED, 10, Some("HANDOVER"))]);
        assert_eq!(
            compare(&connected, &service(false)),
            Some(DriftKind::ManualOffUnknown)
        );
        // The bridge turned it on itself (a keyword asked for a person): no webhook said so.
        let mut asked = state(&[event(UPDATED, 10, None)]);
        asked.note_manual_decided(true, &event(UPDATED, 10, None));
        assert_eq!(
            compare(&asked, &service(false)),
            Some(DriftKind::ManualOffUnknown)
        );
        // The bridge turned it off later than the service's last report of on.
        let mut off = state(&[
            event(CONNECTED, 10, Some("HANDOVER")),
            event(ENDED, 20, None),
        ]);
        off.note_manual_decided(false, &event(ENDED, 20, None));
        assert_eq!(compare(&off, &service(false)), None);
    }

    #[test]
    fn after_its_drift_is_folded_the_same_answer_is_no_drift_again() {
        for (events, manual) in [
            (vec![event(UPDATED, 10, None)], true),
            (vec![event(CONNECTED, 10, Some("HANDOVER"))], false),
        ] {
            let mut s = state(&events);
            let found = drift(&s, &service(manual), 1_000).expect("drift");
            let made = model::webhook::drift_event(&found, "B1").expect("event");
            s.apply(&made.event);
            assert_eq!(compare(&s, &service(manual)), None, "{found:?}");
        }
    }
}
