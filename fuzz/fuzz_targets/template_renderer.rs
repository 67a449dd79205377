//! Arbitrary text as the template of a rule's `send_message`, compiled and rendered through the
//! path the fold takes: `RuleSet::from_sources` adds it to the rules' template environment (fuel
//! limited), `Decide::evaluate` renders it from the rule context of the sample events (with the
//! state before, the end user and a place in the waiting queue, so every context root is there).
//! A template must compile or be refused, and a render must end (the fuel stops runaway loops;
//! libFuzzer's `-timeout` reports one that does not) with exactly one outcome: the action or a
//! recorded template error. Text without template syntax is sent exactly as written.
#![no_main]

#[path = "fixture.rs"]
mod fixture;

use engine::decide::{Decide, DecisionTime, Inputs};
use model::action::Action;
use model::ids::EndUserId;
use engine::rules::RuleSet;
use engine::state::queue::Standing;
use engine::state::{ConversationState, EndUserState};
use model::webhook::model::Event;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

static EVENTS: OnceLock<Vec<(Event, ConversationState)>> = OnceLock::new();

const NOW: i64 = 1_763_690_500_000;

fuzz_target!(|data: &[u8]| {
    let Ok(template) = std::str::from_utf8(data) else {
        return;
    };
    // Written with the toml crate, so any text is one TOML string (escaped as needed).
    let mut action = toml::Table::new();
    action.insert("type".into(), "send_message".into());
    action.insert("text".into(), template.into());
    let mut rule = toml::Table::new();
    rule.insert("name".into(), "fuzz".into());
    rule.insert("on".into(), toml::Value::Array(vec!["*".into()]));
    rule.insert("actions".into(), toml::Value::Array(vec![action.into()]));
    let mut settings = toml::Table::new();
    settings.insert("greeting".into(), "Hello".into());
    settings.insert("flow_id".into(), 7.into());
    settings.insert(
        "names".into(),
        toml::Value::Array(vec!["a".into(), "b".into()]),
    );
    let mut file = toml::Table::new();
    file.insert("settings".into(), settings.into());
    file.insert("rule".into(), toml::Value::Array(vec![rule.into()]));
    let text = toml::to_string(&file).expect("a table serializes");

    let Ok(set) = RuleSet::from_sources(&[("fuzz.toml".to_owned(), text)]) else {
        // Refused at load (template syntax): the fold never sees it.
        return;
    };
    let literal = !(template.contains("{{") || template.contains("{%"));
    let end_user = EndUserState::new(EndUserId::new("fuzz-user"));
    let queue = Standing {
        waiting: true,
        position: Some(2),
        length: 3,
        expected_wait_seconds: Some(240),
        expected_wait: Some("about 4 minutes".into()),
    };
    for (event, state) in EVENTS.get_or_init(fixture::events) {
        let before = ConversationState::new(state.id.clone());
        let inputs = Inputs {
            before: Some(&before),
            end_user: Some(&end_user),
            queue: Some(&queue),
        };
        let decided = set.evaluate(event, state, inputs, DecisionTime::at(NOW));
        assert_eq!(
            decided.fired.len(),
            1,
            "the one rule listens to every event"
        );
        assert_eq!(
            decided.decisions.len() + decided.failed.len(),
            1,
            "one action, one outcome: {decided:?}"
        );
        if literal && event.payload.conversation_id().is_some() {
            match &decided.decisions[..] {
                [decision] => match &decision.action {
                    Action::SendMessage { message, .. } => {
                        assert_eq!(message.text.as_deref(), Some(template))
                    }
                    other => panic!("not a message: {other:?}"),
                },
                _ => panic!("literal text failed: {decided:?}"),
            }
        }
    }
});
