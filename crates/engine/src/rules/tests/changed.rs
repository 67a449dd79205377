//! `changed` conditions: a `state.*` field's value before the event against after it.

use super::*;
use crate::decide::DecisionTime;
use crate::rules::explain::{explain, render_text};
use serde_json::json;

/// The names of the rules that fired for `event` on `after`, with `before` as the state before.
fn fired(
    set: &RuleSet,
    event: &Event,
    before: Option<&ConversationState>,
    after: &ConversationState,
) -> Vec<String> {
    let inputs = Inputs {
        before,
        ..Default::default()
    };
    let decided = set.evaluate(event, after, inputs, DecisionTime::at(NOW));
    decided.fired.into_iter().map(|f| f.rule).collect()
}

/// One rule per `changed` test of `state.phase`, named after it.
const PHASE_RULES: &str = r#"
[[rule]]
name = "any"
on = ["*"]
when = { field = "state.phase", changed = true }

[[rule]]
name = "requested-to-connected"
on = ["*"]
when = { field = "state.phase", changed = { from = "requested", to = "connected" } }

[[rule]]
name = "to-connected"
on = ["*"]
when = { field = "state.phase", changed = { to = "connected" } }

[[rule]]
name = "from-requested"
on = ["*"]
when = { field = "state.phase", changed = { from = "requested" } }

[[rule]]
name = "from-bot"
on = ["*"]
when = { field = "state.phase", changed = { from = "bot" } }

[[rule]]
name = "to-requested"
on = ["*"]
when = { field = "state.phase", changed = { to = "requested" } }
"#;

#[test]
fn changed_compares_the_state_before_the_event_with_the_state_after_it() {
    let set = rules(PHASE_RULES);
    let (_, requested) = fixture("agent-call-requested.json");
    let (connected_event, _) = fixture("agent-call-connected.json");
    let mut connected = requested.clone();
    connected.apply(&connected_event);
    assert_eq!(
        fired(&set, &connected_event, Some(&requested), &connected),
        vec![
            "any",
            "requested-to-connected",
            "to-connected",
            "from-requested"
        ],
        "requested -> connected"
    );

    let (requested_event, requested) = fixture("agent-call-requested.json");
    let fresh = ConversationState::new(requested.id.clone());
    assert_eq!(
        fired(&set, &requested_event, Some(&fresh), &requested),
        vec!["any", "from-bot", "to-requested"],
        "bot -> requested"
    );
}

#[test]
fn an_unchanged_field_fails_every_changed_test() {
    let set = rules(PHASE_RULES);
    let (event, connected) = fixture("agent-call-connected.json");
    let mut again = connected.clone();
    again.apply(&event);
    assert!(fired(&set, &event, Some(&connected), &again).is_empty());
}

#[test]
fn a_field_absent_before_changes_when_it_appears_and_when_it_goes() {
    let set = rules(
        r#"
        [[rule]]
        name = "any"
        on = ["*"]
        when = { field = "state.variables.reason", changed = true }

        [[rule]]
        name = "to-late"
        on = ["*"]
        when = { field = "state.variables.reason", changed = { to = "late" } }

        [[rule]]
        name = "from-early"
        on = ["*"]
        when = { field = "state.variables.reason", changed = { from = "early" } }
        "#,
    );
    let (event, before) = fixture("message-received-text.json");
    let mut after = before.clone();
    after.update(
        &[],
        &[],
        &BTreeMap::from([("reason".into(), json!("late"))]),
    );
    assert_eq!(
        fired(&set, &event, Some(&before), &after),
        vec!["any", "to-late"],
        "absent -> late"
    );
    // Gone again (a null variable is removed): a change, but from nothing the rules name.
    let mut gone = after.clone();
    gone.update(&[], &[], &BTreeMap::from([("reason".into(), Value::Null)]));
    assert_eq!(fired(&set, &event, Some(&after), &gone), vec!["any"]);
    // Absent on both sides: no change.
    assert!(fired(&set, &event, Some(&before), &before).is_empty());
}

#[test]
fn the_state_before_is_in_the_context_and_templates_read_it() {
    let set = rules(
        r#"
        [[rule]]
        name = "say"
        on = ["*"]
        when = { field = "state.phase", changed = true }
        actions = [{ type = "send_message", text = "{{ before.state.phase }} -> {{ state.phase }}" }]
        "#,
    );
    let (event, requested) = fixture("agent-call-requested.json");
    let before = ConversationState::new(requested.id.clone());
    let inputs = Inputs {
        before: Some(&before),
        ..Default::default()
    };
    let decided = set.evaluate(&event, &requested, inputs, DecisionTime::at(NOW));
    let texts: Vec<String> = decided
        .decisions
        .iter()
        .filter_map(|d| match &d.action {
            Action::SendMessage { message, .. } => message.text.clone(),
            _ => None,
        })
        .collect();
    assert_eq!(texts, vec!["bot -> requested"]);
    // Without a before-state (`decide`), `before` is left out.
    let ctx = context::build(&event, &requested, NOW);
    assert!(ctx.get("before").is_none());
}

#[test]
fn a_bad_changed_is_a_load_error_with_its_place() {
    let found = problems(
        r#"
        [[rule]]
        name = "bad"
        on = ["*"]
        when = { all = [
            { field = "state.phase", changed = false },
            { field = "state.phase", changed = { from = "bot", to = "bot" } },
            { field = "state.phase", changed = { form = "bot" } },
            { field = "message.data.text", changed = true },
            { field = "state.phase", changed = true, equals = "bot" },
            { field = "state.phase", changed = {} },
        ] }
        "#,
    );
    assert_mentioned(&found, "when.all[0].changed: must be `true` (any change)");
    assert_mentioned(&found, "when.all[1].changed: never holds");
    assert_mentioned(&found, "when.all[2].changed: unknown key `form`");
    assert_mentioned(&found, "`message.data.text` has no value before it");
    assert_mentioned(
        &found,
        "when.all[4]: `changed` is the field's only operator",
    );
    assert_mentioned(&found, "when.all[5].changed: must be `true`");
    assert_eq!(found.len(), 6, "{found:#?}");
}

#[test]
fn rules_test_shows_both_values_of_a_failing_changed() {
    let set = rules(
        r#"
        [[rule]]
        name = "connected"
        on = ["*"]
        when = { field = "state.phase", changed = { to = "connected" } }
        "#,
    );
    let (event, requested) = fixture("agent-call-requested.json");
    let before = ConversationState::new(requested.id.clone());
    let inputs = Inputs {
        before: Some(&before),
        ..Default::default()
    };
    let verdicts = explain(&set, &event, &requested, inputs, NOW);
    let text = render_text(&verdicts);
    assert!(
        text.contains(
            "no match     connected (priority 0, test.toml): when failed: state.phase changed \
             to \"connected\"; before: \"bot\", after: \"requested\""
        ),
        "{text}"
    );
    let json = serde_json::to_value(&verdicts).expect("json");
    assert_eq!(json[0]["failure"]["before"], "bot");
    assert_eq!(json[0]["failure"]["actual"], "requested");
}
