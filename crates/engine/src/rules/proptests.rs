//! Evaluation never panics, whatever the event: arbitrary JSON in every part of a message or
//! conversation event that the service's format allows (and beyond), run through the shipped
//! rules, the example rules, and `rules test`'s explanation.

use super::{explain, shipped, RuleSet};
use crate::decide::{Decide, Inputs};
use crate::state::ConversationState;
use proptest::prelude::*;
use serde_json::{json, Value};

/// Any JSON value, a few levels deep, with the strings rules look for now and then.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "\\PC{0,40}".prop_map(Value::String),
        prop_oneof![
            Just("상담원"),
            Just("agent please"),
            Just("!종료"),
            Just("fuck you"),
            Just("{{ x }}"),
            Just("")
        ]
        .prop_map(|s| Value::String(s.to_owned())),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map("[a-zA-Z]{1,8}", inner, 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn kinds() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        Just("bot.message.received"),
        Just("bot.message.sent"),
        Just("bot.conversation.agent_call_requested"),
        Just("bot.conversation.agent_call_connected"),
        Just("bot.conversation.agent_call_disconnected"),
        Just("bot.conversation.updated"),
        Just("bot.conversation.created"),
        Just("timer.agent-wait"),
    ]
}

fn sets() -> Vec<RuleSet> {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../rules/examples");
    vec![
        RuleSet::from_sources(&shipped::sources()).expect("shipped"),
        RuleSet::load_dir(&examples).expect("examples"),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn deciding_never_panics_on_arbitrary_events(
        kind in kinds(),
        text in any_json(),
        meta in any_json(),
        data in any_json(),
        params in any_json(),
        extra in any_json(),
        now in any::<i64>(),
        timestamp in any::<i64>(),
    ) {
        let message = json!({
            "id": "m1", "conversationId": "c1", "isUser": text.is_string(),
            "meta": meta, "data": {"type": "text", "text": text, "extra": data},
        });
        let conversation = json!({
            "id": "c1", "botId": "B1", "platform": "kakaobiz", "userKey": "k1",
            "params": params, "context": extra,
        });
        let payload = if kind.starts_with("bot.message") {
            json!({"message": message})
        } else if kind.starts_with("timer.") {
            json!({"timer": {"conversationId": "c1", "name": "agent-wait", "dueAt": timestamp, "startedBy": "x/y/0"}})
        } else {
            json!({"conversation": conversation})
        };
        let raw = json!({
            "id": "e1", "event": kind, "sourceType": "bot", "sourceId": "B1",
            "timestamp": timestamp, "data": payload,
        })
        .to_string();
        // Whatever does not parse is quarantined before rules see it; what parses must evaluate.
        if let Ok(event) = model::webhook::parse_event(&raw) {
            if let Some(id) = event.payload.conversation_id() {
                let mut state = ConversationState::new(id.clone());
                state.apply(&event);
                for set in sets() {
                    let decided = set.decide(&event, &state, now);
                    let verdicts = explain::explain(&set, &event, &state, Inputs::default(), now);
                    let rendered: usize = verdicts
                        .iter()
                        .map(|v| match &v.verdict {
                            explain::Judgement::Matched { actions, .. } => {
                                actions.iter().filter(|a| a.is_ok()).count()
                            }
                            _ => 0,
                        })
                        .sum();
                    // `rules test` shows exactly the actions the daemon would decide.
                    prop_assert_eq!(decided.len(), rendered, "{:?}", verdicts);
                    let _ = explain::render_text(&verdicts);
                }
            }
        }
    }
}
