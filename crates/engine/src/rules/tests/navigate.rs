//! `navigate` by flow id or by flow title.

use super::*;

fn navigation(action: &str) -> Action {
    let set = rules(&format!(
        "[[rule]]\nname = \"go\"\non = [\"*\"]\nactions = [{action}]\n"
    ));
    let (event, state) = fixture("message-received-text.json");
    let mut decisions = set.decide(&event, &state, NOW);
    assert_eq!(decisions.len(), 1, "{decisions:?}");
    decisions.remove(0).action
}

#[test]
fn a_title_carries_the_conversations_bot_and_an_id_does_not() {
    let (_, state) = fixture("message-received-text.json");
    match navigation(r#"{ type = "navigate", flow = "{{ 'Fall' ~ 'back' }}" }"#) {
        Action::Navigate {
            flow_id: None,
            flow: Some(title),
            bot_id: Some(bot),
            ..
        } => {
            assert_eq!(title, "Fallback");
            assert_eq!(Some(&bot), state.bot_id.as_ref());
        }
        other => panic!("a navigation by title, got {other:?}"),
    }
    match navigation(r#"{ type = "navigate", flow_id = 2 }"#) {
        Action::Navigate {
            flow_id: Some(2),
            flow: None,
            bot_id: None,
            ..
        } => {}
        other => panic!("a navigation by id, got {other:?}"),
    }
}

#[test]
fn a_navigation_names_its_flow_exactly_once() {
    let found = problems(
        r#"
        [[rule]]
        name = "both"
        on = ["*"]
        actions = [{ type = "navigate", flow_id = 2, flow = "Fallback" }, { type = "navigate" }]
        "#,
    );
    assert_mentioned(&found, "actions[0]: a `navigate` names its flow by id");
    assert_mentioned(&found, "actions[1]: a `navigate` names its flow by id");
}
