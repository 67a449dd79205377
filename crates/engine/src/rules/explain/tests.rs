use super::*;
use model::webhook::parse_event;

fn set(text: &str) -> RuleSet {
    RuleSet::from_sources(&[("r.toml".into(), text.to_owned())]).expect("rules load")
}

fn user_message(text: &str) -> (Event, ConversationState) {
    let raw = format!(
        r#"{{"id":"e1","event":"bot.message.received","sourceType":"bot","sourceId":"B1","timestamp":1000,
        "data":{{"message":{{"id":"m1","conversationId":"c1","isUser":true,"meta":null,"data":{{"type":"text","text":"{text}"}}}}}}}}"#
    );
    let event = parse_event(&raw).expect("event");
    let mut state = ConversationState::new("c1".into());
    state.apply(&event);
    (event, state)
}

const RULES: &str = r#"
[[rule]]
name = "off"
enabled = false
on = ["*"]
actions = [{ type = "set_manual", enabled = true }]

[[rule]]
name = "agent"
priority = 10
on = ["bot.message.received"]
stop = true
when = { all = [
  { field = "sender", equals = "user" },
  { field = "message.data.text", matches = "agent" },
] }
actions = [{ type = "set_manual", enabled = true }, { type = "send_message", text = "{{ nope.x }}" }]

[[rule]]
name = "greet"
on = ["bot.message.received"]
actions = [{ type = "send_message", text = "hi" }]

[[rule]]
name = "created"
on = ["bot.conversation.created"]
actions = [{ type = "send_message", text = "hello" }]
"#;

#[test]
fn a_match_renders_its_actions_and_a_stop_holds_back_the_rest() {
    let rules = set(RULES);
    let (event, state) = user_message("an agent please");
    let verdicts = explain(&rules, &event, &state, Inputs::default(), 5_000);
    let names: Vec<&str> = verdicts.iter().map(|v| v.rule.as_str()).collect();
    assert_eq!(
        names,
        vec!["agent", "off", "greet", "created"],
        "evaluation order"
    );
    match &verdicts[0].verdict {
        Judgement::Matched { actions, stops } => {
            assert!(*stops);
            assert!(matches!(
                actions[0],
                Ok(Action::SetManual { enabled: true, .. })
            ));
            let error = actions[1].as_ref().expect_err("undefined field");
            assert!(
                error.contains("actions[1]") && error.contains("undefined value"),
                "{error}"
            );
        }
        other => panic!("agent: {other:?}"),
    }
    assert!(matches!(verdicts[1].verdict, Judgement::Disabled));
    assert!(matches!(&verdicts[2].verdict, Judgement::Stopped { by } if by == "agent"));
    assert!(matches!(verdicts[3].verdict, Judgement::NotListening));
}

#[test]
fn a_failed_condition_names_its_place_its_test_and_the_value_seen() {
    let rules = set(RULES);
    let (event, state) = user_message("hello");
    let verdicts = explain(&rules, &event, &state, Inputs::default(), 5_000);
    match &verdicts[0].verdict {
        Judgement::NoMatch { failure } => {
            assert_eq!(failure.at, "when.all[1]");
            assert_eq!(failure.test, r#"message.data.text matches "agent""#);
            assert_eq!(failure.actual, Some(Value::String("hello".into())));
        }
        other => panic!("agent: {other:?}"),
    }
    assert!(
        matches!(verdicts[2].verdict, Judgement::Matched { .. }),
        "greet runs"
    );
    let text = render_text(&verdicts);
    assert!(
        text.contains(r#"no match     agent (priority 10, r.toml): when.all[1] failed: message.data.text matches "agent"; actual: "hello""#),
        "{text}"
    );
    assert!(
        text.contains("MATCHED      greet (priority 0, r.toml)\n    actions[0] "),
        "{text}"
    );
}

#[test]
fn any_and_not_and_absent_fields_are_explained() {
    let rules = set(r#"
[[rule]]
name = "a"
on = ["bot.message.received"]
when = { any = [{ field = "state.variables.vip", exists = true }, { field = "sender", equals = "agent" }] }
actions = [{ type = "send_message", text = "x" }]

[[rule]]
name = "b"
on = ["bot.message.received"]
when = { not = { field = "sender", equals = "user" } }
actions = [{ type = "send_message", text = "x" }]
"#);
    let (event, state) = user_message("x");
    let verdicts = explain(&rules, &event, &state, Inputs::default(), 5_000);
    let Judgement::NoMatch { failure } = &verdicts[0].verdict else {
        panic!("a: {:?}", verdicts[0].verdict)
    };
    assert_eq!(failure.at, "when.any[0]");
    assert!(
        failure.test.contains("every other `any` branch failed"),
        "{}",
        failure.test
    );
    assert_eq!(failure.actual, None, "the variable is absent");
    let Judgement::NoMatch { failure } = &verdicts[1].verdict else {
        panic!("b: {:?}", verdicts[1].verdict)
    };
    assert_eq!(failure.at, "when.not");
    assert_eq!(failure.test, r#"not (sender equals "user")"#);
}

#[test]
fn lint_finds_shadowed_contradictory_and_looping_rules() {
    let rules = set(r#"
[[rule]]
name = "catch-all"
priority = 100
on = ["bot.message.received"]
stop = true
actions = [{ type = "set_manual", enabled = false }]

[[rule]]
name = "shadowed"
on = ["bot.message.received"]
actions = [{ type = "set_manual", enabled = true }]

[[rule]]
name = "not-shadowed"
on = ["bot.message.received", "bot.conversation.created"]
actions = [{ type = "set_manual", enabled = true }]

[[rule]]
name = "impossible"
on = ["bot.conversation.created"]
when = { all = [{ field = "platform", equals = "web" }, { field = "platform", in = ["kakao", "line"] }] }
actions = [{ type = "set_manual", enabled = true }]

[[rule]]
name = "bounds"
on = ["bot.conversation.created"]
when = { all = [{ field = "state.user_messages", gt = 5 }, { field = "state.user_messages", lte = 5 }] }
actions = [{ type = "set_manual", enabled = true }]

[[rule]]
name = "fine"
on = ["bot.conversation.created"]
when = { all = [{ field = "state.user_messages", gte = 5 }, { field = "state.user_messages", lte = 5 }] }
actions = [{ type = "set_manual", enabled = true }]

[[rule]]
name = "echo"
on = ["bot.message.sent"]
actions = [{ type = "send_message", text = "again" }, { type = "update_state", add_labels = ["x"] }]

[[rule]]
name = "own-echoes"
on = ["bot.message.sent"]
echoes = true
actions = [{ type = "send_to_end_user", text = "again" }]

[[rule]]
name = "any-echoes"
on = ["*"]
actions = [{ type = "send_message", text = "again" }]

[[rule]]
name = "nav"
on = ["*"]
actions = [{ type = "navigate", flow_id = 3 }]
"#);
    let warnings = lint(&rules);
    let by_rule: Vec<(&str, &str)> = warnings
        .iter()
        .map(|w| (w.rule.as_str(), w.message.split(':').next().unwrap_or("")))
        .collect();
    assert_eq!(
        by_rule,
        vec![
            ("shadowed", "never fires"),
            ("impossible", "never fires"),
            ("bounds", "never fires"),
            // `echo` and `any-echoes` never see the bridge's own messages: no warning.
            ("own-echoes", "may loop"),
            ("nav", "may loop"),
        ],
        "{warnings:#?}"
    );
    assert!(
        warnings[0].message.contains("`catch-all`"),
        "{}",
        warnings[0].message
    );
    assert!(
        warnings[1]
            .message
            .contains(r#"(platform equals "web") and (platform in ["kakao","line"])"#),
        "{}",
        warnings[1].message
    );
    assert!(
        warnings[3]
            .message
            .contains("listens to bot.message.sent with echoes = true and takes send_to_end_user"),
        "{}",
        warnings[3].message
    );
    // The service does not mark its echoes of conversation changes: warned whatever `echoes` says.
    assert!(
        warnings[4]
            .message
            .contains("listens to bot.conversation.updated and takes navigate"),
        "{}",
        warnings[4].message
    );
}
