//! `navigate` by flow id or by flow title.

use super::*;
use crate::actions::execute::{resolve_flow, ExecuteError};
use crate::upstream::contract::Flow;

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

#[test]
fn a_title_resolves_to_its_flow_id_or_to_an_unknown_flow() {
    let flows = vec![
        Flow {
            id: 1,
            title: "Welcome".into(),
            nodes: vec![],
        },
        Flow {
            id: 2,
            title: "Fallback".into(),
            nodes: vec![],
        },
    ];
    let by_title = |title: &str| Action::Navigate {
        conversation_id: "c1".into(),
        flow_id: None,
        node_id: None,
        flow: Some(title.into()),
        bot_id: Some("B1".into()),
    };
    match resolve_flow(&by_title("Fallback"), &flows) {
        Ok(Action::Navigate {
            flow_id: Some(2), ..
        }) => {}
        other => panic!("flow 2, got {other:?}"),
    }
    assert_eq!(
        resolve_flow(&by_title("fallback"), &flows).err(),
        Some(ExecuteError::UnknownFlow {
            bot: "B1".into(),
            title: "fallback".into()
        }),
        "titles compare exactly"
    );
}
