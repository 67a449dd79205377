//! The conversation's end user in the rule context (`end_user.*`).

use super::*;
use crate::decide::DecisionTime;
use crate::state::EndUserState;
use serde_json::json;

const TIER_RULES: &str = r#"
[[rule]]
name = "gold"
on = ["*"]
when = { field = "end_user.params.tier", equals = "gold" }
actions = [{ type = "send_message", text = "{{ end_user.params.tier }} member {{ end_user.user_key }}" }]

[[rule]]
name = "unknown"
on = ["*"]
when = { field = "end_user", exists = false }
"#;

fn gold_user() -> EndUserState {
    let raw = json!({
        "id": "e-u", "event": "bot.end_user.updated", "sourceType": "bot", "sourceId": "B1",
        "timestamp": 1,
        "data": { "endUser": {
            "id": "u1", "platform": "web", "userKey": "k1", "params": { "tier": "gold" },
        } },
    });
    let event = parse_event(&raw.to_string()).expect("event");
    let mut user = EndUserState::new("u1".into());
    if let model::webhook::model::Payload::EndUser(u) = &event.payload {
        user.apply(&event, u);
    }
    user
}

#[test]
fn conditions_and_templates_read_the_end_users_params() {
    let set = rules(TIER_RULES);
    let (event, state) = fixture("message-received-text.json");
    let user = gold_user();
    let inputs = Inputs {
        end_user: Some(&user),
        ..Default::default()
    };
    let decided = set.evaluate(&event, &state, inputs, DecisionTime::at(NOW));
    let fired: Vec<&str> = decided.fired.iter().map(|f| f.rule.as_str()).collect();
    assert_eq!(fired, vec!["gold"]);
    match &decided.decisions[..] {
        [Decision {
            action: Action::SendMessage { message, .. },
            ..
        }] => assert_eq!(message.text.as_deref(), Some("gold member k1")),
        other => panic!("expected one message, got {other:?}"),
    }
    let ctx = context::build_with(&event, &state, inputs, NOW);
    assert_eq!(ctx["end_user"]["id"], "u1");
    assert_eq!(ctx["end_user"]["platform"], "web");
    assert_eq!(ctx["end_user"]["deleted"], false);
}

#[test]
fn an_unknown_end_user_leaves_the_root_out() {
    let set = rules(TIER_RULES);
    let (event, state) = fixture("message-received-text.json");
    let decided = set.evaluate(&event, &state, Inputs::default(), DecisionTime::at(NOW));
    let fired: Vec<&str> = decided.fired.iter().map(|f| f.rule.as_str()).collect();
    assert_eq!(fired, vec!["unknown"]);
}
