//! The shipped rules' repairs of `reconcile.drift` events (rules/handoff.toml, section 9).

use model::action::Action;

use crate::decide::Decide;
use crate::rules::shipped::sources;
use crate::rules::RuleSet;
use crate::state::ConversationState;
use model::webhook::drift::{Believed, Drift, DriftKind, Observed};
use model::webhook::model::Event;

const NOW: i64 = 1_763_690_500_000;

fn drift(kind: DriftKind) -> Event {
    let manual = kind == DriftKind::ManualOnUnknown;
    let drift = Drift {
        conversation_id: "c1".into(),
        kind,
        believed: Believed::default(),
        service: Observed {
            manual,
            status: manual.then(|| "HANDOVER".to_owned()),
            updated_at: Some(NOW - 1),
        },
        found_at: NOW,
    };
    model::webhook::drift_event(&drift, "B1")
        .expect("drift event")
        .event
}

fn rules(settings: &[(&str, serde_json::Value)]) -> RuleSet {
    let overrides = settings
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.clone()))
        .collect();
    RuleSet::from_sources_with(&sources(), &overrides).expect("shipped rules")
}

/// The decisions for `event` folded into `state`, as (rule, action name).
fn decide(set: &RuleSet, state: &mut ConversationState, event: &Event) -> Vec<(String, Action)> {
    assert!(state.apply(event), "a drift reaches rules");
    set.decide(event, state, NOW)
        .into_iter()
        .map(|d| (d.rule, d.action))
        .collect()
}

#[test]
fn manual_on_with_nobody_hands_back_to_the_bot_by_default() {
    let set = rules(&[]);
    let mut state = ConversationState::new("c1".into());
    let decided = decide(&set, &mut state, &drift(DriftKind::ManualOnUnknown));
    let manual: Vec<_> = decided
        .iter()
        .filter_map(|(rule, a)| match a {
            Action::SetManual { enabled, .. } => Some((rule.as_str(), *enabled)),
            _ => None,
        })
        .collect();
    assert_eq!(manual, [("drift-manual-on-bot", false)], "{decided:?}");
    assert!(
        !decided
            .iter()
            .any(|(_, a)| matches!(a, Action::NotifyHelpdesk { .. })),
        "{decided:?}"
    );
}

#[test]
fn manual_on_with_nobody_tells_the_help_desk_when_set_so() {
    let set = rules(&[("reconcile_manual_on", serde_json::json!("helpdesk"))]);
    let mut state = ConversationState::new("c1".into());
    let decided = decide(&set, &mut state, &drift(DriftKind::ManualOnUnknown));
    assert!(
        !decided
            .iter()
            .any(|(_, a)| matches!(a, Action::SetManual { .. })),
        "the conversation is left as the service has it: {decided:?}"
    );
    let told: Vec<_> = decided
        .iter()
        .filter_map(|(rule, a)| match a {
            Action::NotifyHelpdesk { kind, .. } => Some((rule.as_str(), kind.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(
        told,
        [("drift-manual-on-helpdesk", "handoff.reminder")],
        "{decided:?}"
    );
}

#[test]
fn manual_off_ends_the_wait_its_timers_and_labels() {
    let set = rules(&[("notify_helpdesk", serde_json::json!(true))]);
    let mut state = ConversationState::new("c1".into());
    state.labels.insert("waiting-for-agent".into());
    let decided = decide(&set, &mut state, &drift(DriftKind::ManualOffUnknown));
    let cancelled: Vec<&str> = decided
        .iter()
        .filter_map(|(_, a)| match a {
            Action::CancelTimer { name, .. } => Some(name.as_str()),
            _ => None,
        })
        .collect();
    for timer in ["agent-wait", "queue-update", "agent-quiet", "agent-gone"] {
        assert!(cancelled.contains(&timer), "{timer}: {decided:?}");
    }
    assert!(
        decided.iter().any(|(_, a)| matches!(
            a,
            Action::UpdateState { remove_labels, .. } if remove_labels.iter().any(|l| l == "waiting-for-agent")
        )),
        "{decided:?}"
    );
    assert!(
        decided
            .iter()
            .any(|(rule, a)| rule == "drift-manual-off-helpdesk"
                && matches!(a, Action::NotifyHelpdesk { kind, .. } if kind == "handoff.ended")),
        "{decided:?}"
    );
    // Nothing is asked of the service: it already has manual mode off.
    assert!(
        !decided
            .iter()
            .any(|(_, a)| matches!(a, Action::SetManual { .. })),
        "{decided:?}"
    );
}

#[test]
fn rules_may_listen_to_drift_but_star_does_not_bring_it() {
    let set = RuleSet::from_sources(&[(
        "d.toml".into(),
        r#"
[[rule]]
name = "all"
on = ["*"]
actions = [{ type = "update_state", add_labels = ["seen"] }]

[[rule]]
name = "drift"
on = ["reconcile.drift"]
when = { field = "drift.service.manual", equals = true }
actions = [{ type = "update_state", add_labels = ["drift-{{ drift.kind }}"] }]
"#
        .into(),
    )])
    .expect("rules");
    let mut state = ConversationState::new("c1".into());
    let decided = decide(&set, &mut state, &drift(DriftKind::ManualOnUnknown));
    let rules: Vec<&str> = decided.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(rules, ["drift"], "{decided:?}");
    assert!(
        matches!(&decided[0].1, Action::UpdateState { add_labels, .. } if add_labels == &["drift-manual_on_unknown".to_owned()]),
        "{decided:?}"
    );
}
