//! Loop protection: echoes of the bridge's own messages reach only rules that take them, and
//! firing caps hold back a rule that fired too often in a conversation.

use super::*;
use crate::decide::DecisionTime;
use model::action::echo;

/// A message event of conversation `conv`; `custom` goes in `meta.custom`.
fn message(id: &str, kind: &str, conv: &str, is_user: bool, custom: Option<&str>) -> Event {
    let meta = match custom {
        Some(c) => serde_json::json!({ "custom": c }),
        None => Value::Null,
    };
    let raw = serde_json::json!({
        "id": id, "event": kind, "sourceType": "bot", "sourceId": "B1", "timestamp": 1000,
        "data": { "message": {
            "id": format!("m-{id}"), "conversationId": conv, "isUser": is_user, "meta": meta,
            "data": { "type": "text", "text": "hi" },
        } },
    });
    parse_event(&raw.to_string()).expect("event")
}

fn user_says(id: &str, conv: &str) -> Event {
    message(id, "bot.message.received", conv, true, None)
}

/// The service's echo of the bridge's action `action`.
fn echo_of(id: &str, conv: &str, action: &str) -> Event {
    message(
        id,
        "bot.message.sent",
        conv,
        false,
        Some(&echo::marker(action)),
    )
}

/// What the fold does for one event: fold it in, decide, record firings and cap hits (at `at`,
/// the event's receive time).
fn fold(set: &RuleSet, state: &mut ConversationState, event: &Event, at: Millis) -> Decided {
    assert!(state.apply(event));
    let decided = set.evaluate(event, state, Inputs::default(), DecisionTime::at(at));
    decided.record(state, &event.id, at);
    decided
}

fn rule_names(decided: &Decided) -> Vec<&str> {
    decided.fired.iter().map(|f| f.rule.as_str()).collect()
}

const ECHO_RULES: &str = r#"
[[rule]]
name = "people-only"
on = ["bot.message.sent"]
actions = [{ type = "send_message", text = "again" }]

[[rule]]
name = "takes-echoes"
on = ["bot.message.sent"]
echoes = true
when = { field = "echo", equals = true }
actions = [{ type = "update_state", variables = { of = "{{ echo_of }}" } }]

[[rule]]
name = "everything"
on = ["*"]
actions = [{ type = "update_state", add_labels = ["seen"] }]
"#;

#[test]
fn echoes_reach_only_rules_that_take_them() {
    let set = rules(ECHO_RULES);
    let event = echo_of("e2", "c1", "e1/greet/0");
    let mut state = ConversationState::new("c1".into());
    state.apply(&event);
    let ctx = context::build(&event, &state, NOW);
    assert_eq!(ctx["echo"], true);
    assert_eq!(ctx["echo_of"], "e1/greet/0");
    let decided = set.evaluate(&event, &state, Inputs::default(), DecisionTime::at(NOW));
    assert_eq!(rule_names(&decided), ["takes-echoes"]);
    let vars = match &decided.decisions[..] {
        [Decision {
            action: Action::UpdateState { variables, .. },
            ..
        }] => variables,
        other => panic!("one update_state: {other:?}"),
    };
    assert_eq!(vars.get("of"), Some(&Value::String("e1/greet/0".into())));
    // Folded all the same: the echo is a bot message of the conversation.
    assert_eq!(state.messages.bot_messages, 1);
}

#[test]
fn messages_that_are_not_echoes_reach_every_rule() {
    let set = rules(ECHO_RULES);
    // The flow's own message (no marker), a message with another system's custom, a user's.
    for event in [
        message("e3", "bot.message.sent", "c1", false, None),
        message("e4", "bot.message.sent", "c1", false, Some("ticket-7")),
        user_says("e5", "c1"),
    ] {
        let mut state = ConversationState::new("c1".into());
        state.apply(&event);
        let ctx = context::build(&event, &state, NOW);
        assert_eq!(ctx["echo"], false, "{}", event.id);
        assert!(ctx.get("echo_of").is_none(), "{}", event.id);
        let decided = set.evaluate(&event, &state, Inputs::default(), DecisionTime::at(NOW));
        let expected: &[&str] = match event.kind.as_str() {
            "bot.message.sent" => &["people-only", "everything"],
            _ => &["everything"],
        };
        assert_eq!(rule_names(&decided), expected, "{}", event.id);
    }
}

#[test]
fn an_explicit_cap_fires_count_times_then_holds_back_until_the_window_slides() {
    let set = rules(
        r#"
        [[rule]]
        name = "reply"
        on = ["bot.message.received"]
        max_firings = { count = 3, per = "10s" }
        actions = [{ type = "send_message", text = "ok" }]
        "#,
    );
    let mut state = ConversationState::new("c1".into());
    for (i, at) in [NOW, NOW + 100, NOW + 200].into_iter().enumerate() {
        let decided = fold(&set, &mut state, &user_says(&format!("e{i}"), "c1"), at);
        assert_eq!(decided.decisions.len(), 1, "firing {i}");
        assert!(decided.capped.is_empty());
    }
    for (i, at) in [NOW + 300, NOW + 9_999].into_iter().enumerate() {
        let event = user_says(&format!("held{i}"), "c1");
        let decided = fold(&set, &mut state, &event, at);
        assert!(decided.decisions.is_empty(), "capped at {at}: {decided:?}");
        assert!(decided.fired.is_empty());
        assert_eq!(decided.capped.len(), 1);
        assert_eq!(decided.capped[0].rule, "reply");
        assert_eq!(decided.capped[0].fired, 3);
    }
    let hit = state.capped.get("reply").expect("the cap hit is recorded");
    assert_eq!(
        (hit.at, hit.event.as_str(), hit.fired, hit.hits),
        (NOW + 9_999, "held1", 3, 2)
    );
    assert_eq!(state.firings["reply"].at, [NOW, NOW + 100, NOW + 200]);
    // 10 s after the first firing it has left the window: one more may fire.
    let decided = fold(&set, &mut state, &user_says("later", "c1"), NOW + 10_000);
    assert_eq!(decided.decisions.len(), 1, "{decided:?}");
    assert_eq!(
        state.firings["reply"].at,
        [NOW + 100, NOW + 200, NOW + 10_000],
        "only firings inside the window, at most `count`"
    );
    let decided = fold(&set, &mut state, &user_says("again", "c1"), NOW + 10_001);
    assert_eq!(decided.capped.len(), 1, "full again: {decided:?}");
}

#[test]
fn a_rule_without_max_firings_has_the_default_cap() {
    let set = rules(
        r#"
        [[rule]]
        name = "reply"
        on = ["bot.message.received"]
        actions = [{ type = "send_message", text = "ok" }]
        "#,
    );
    assert_eq!(set.rules()[0].max_firings, DEFAULT_MAX_FIRINGS);
    let count = DEFAULT_MAX_FIRINGS.count as usize;
    let mut state = ConversationState::new("c1".into());
    let mut sent = 0;
    for i in 0..count + 5 {
        let event = user_says(&format!("e{i}"), "c1");
        sent += fold(&set, &mut state, &event, NOW + i as Millis)
            .decisions
            .len();
    }
    assert_eq!(sent, count);
    assert_eq!(state.capped["reply"].hits, 5);
    assert_eq!(state.firings["reply"].at.len(), count);
}

#[test]
fn caps_are_per_rule_and_per_conversation() {
    let set = rules(
        r#"
        [[rule]]
        name = "once"
        on = ["bot.message.received"]
        max_firings = { count = 1, per = "1h" }
        actions = [{ type = "send_message", text = "once" }]

        [[rule]]
        name = "twice"
        on = ["bot.message.received"]
        max_firings = { count = 2, per = "1h" }
        actions = [{ type = "send_message", text = "twice" }]
        "#,
    );
    let mut c1 = ConversationState::new("c1".into());
    let first = fold(&set, &mut c1, &user_says("e1", "c1"), NOW);
    assert_eq!(rule_names(&first), ["once", "twice"]);
    let second = fold(&set, &mut c1, &user_says("e2", "c1"), NOW + 1);
    assert_eq!(rule_names(&second), ["twice"], "`once` is capped alone");
    assert_eq!(second.capped.len(), 1);
    assert_eq!(second.capped[0].rule, "once");
    let third = fold(&set, &mut c1, &user_says("e3", "c1"), NOW + 2);
    assert!(third.fired.is_empty());
    assert_eq!(third.capped.len(), 2);

    // Another conversation has its own history.
    let mut c2 = ConversationState::new("c2".into());
    let other = fold(&set, &mut c2, &user_says("e4", "c2"), NOW + 3);
    assert_eq!(rule_names(&other), ["once", "twice"]);
    assert!(c2.capped.is_empty());
}

#[test]
fn a_capped_rule_with_stop_still_stops_the_event() {
    let set = rules(
        r#"
        [[rule]]
        name = "first"
        priority = 10
        on = ["bot.message.received"]
        stop = true
        max_firings = { count = 1, per = "1h" }
        actions = [{ type = "send_message", text = "first" }]

        [[rule]]
        name = "fallback"
        on = ["bot.message.received"]
        actions = [{ type = "send_message", text = "fallback" }]
        "#,
    );
    let mut state = ConversationState::new("c1".into());
    assert_eq!(
        rule_names(&fold(&set, &mut state, &user_says("e1", "c1"), NOW)),
        ["first"]
    );
    let held = fold(&set, &mut state, &user_says("e2", "c1"), NOW + 1);
    assert!(
        held.fired.is_empty(),
        "the rules after it do not take its events: {held:?}"
    );
    assert_eq!(held.capped.len(), 1);
}

#[test]
fn a_runaway_echo_loop_ends_at_the_cap() {
    // A rule that answers its own echoes: each answer comes back as the next echo.
    let set = rules(
        r#"
        [[rule]]
        name = "chatter"
        on = ["bot.message.received", "bot.message.sent"]
        echoes = true
        max_firings = { count = 4, per = "1m" }
        actions = [{ type = "send_message", text = "again" }]
        "#,
    );
    let mut state = ConversationState::new("c1".into());
    let mut event = user_says("e0", "c1");
    let mut sent = 0;
    for i in 1..100 {
        let decided = fold(&set, &mut state, &event, NOW + i);
        let Some(decision) = decided.decisions.first() else {
            break;
        };
        sent += 1;
        let id = model::action::action_id(&event.id, &decision.rule, decision.index);
        event = echo_of(&format!("e{i}"), "c1", &id);
    }
    assert_eq!(sent, 4);
    assert_eq!(state.capped["chatter"].hits, 1);
    assert_eq!(state.messages.bot_messages, 4, "every echo was folded");
}

#[test]
fn bad_max_firings_are_load_errors_with_their_place() {
    let found = problems(
        r#"
        [[rule]]
        name = "zero"
        on = ["*"]
        max_firings = { count = 0, per = "0s" }

        [[rule]]
        name = "negative"
        on = ["*"]
        max_firings = { count = -1, per = "soon" }

        [[rule]]
        name = "too-many"
        on = ["*"]
        max_firings = { count = 1001, per = "1m" }
        "#,
    );
    let has = |needle: &str| assert_mentioned(&found, needle);
    has("rule[0] (zero).max_firings.count: must be 1 to 1000, not 0");
    has("rule[0] (zero).max_firings.per: must be longer than zero");
    has("rule[1] (negative).max_firings.count: must be 1 to 1000, not -1");
    has("rule[1] (negative).max_firings.per: `soon` is not a duration");
    has("rule[2] (too-many).max_firings.count: must be 1 to 1000, not 1001");
    assert_eq!(found.len(), 5, "{found:#?}");

    // The cap's shape and `echoes` are checked as the file is read.
    for text in [
        "[[rule]]\nname = \"a\"\non = [\"*\"]\nmax_firings = { count = 1 }\n",
        "[[rule]]\nname = \"a\"\non = [\"*\"]\nmax_firings = { count = 1, per = \"1m\", burst = 2 }\n",
        "[[rule]]\nname = \"a\"\non = [\"*\"]\nmax_firings = 5\n",
        "[[rule]]\nname = \"a\"\non = [\"*\"]\nechoes = \"yes\"\n",
    ] {
        let found = problems(text);
        assert_eq!(found.len(), 1, "{text}: {found:#?}");
        assert_eq!(found[0].at, "", "a whole-file problem: {text}");
    }
}

#[test]
fn rules_test_shows_a_capped_rule_and_an_echo_as_their_own_verdicts() {
    use crate::rules::explain::{explain, render_text, Judgement};
    let set = rules(
        r#"
        [[rule]]
        name = "reply"
        on = ["bot.message.received", "bot.message.sent"]
        max_firings = { count = 2, per = "10m" }
        actions = [{ type = "send_message", text = "ok" }]
        "#,
    );
    let mut state = ConversationState::new("c1".into());
    fold(&set, &mut state, &user_says("e1", "c1"), NOW - 60_000);
    fold(&set, &mut state, &user_says("e2", "c1"), NOW - 30_000);
    let event = user_says("e3", "c1");
    state.apply(&event);
    let verdicts = explain(&set, &event, &state, Inputs::default(), NOW);
    assert!(
        matches!(
            verdicts[0].verdict,
            Judgement::Capped {
                fired: 2,
                stops: false,
                ..
            }
        ),
        "{:?}",
        verdicts[0].verdict
    );
    assert_eq!(
        render_text(&verdicts),
        "capped       reply (priority 0, test.toml): fired 2 times in the last 10m\n"
    );
    // Past the window (by `--at`), it matches again.
    let later = explain(&set, &event, &state, Inputs::default(), NOW + 600_000);
    assert!(matches!(later[0].verdict, Judgement::Matched { .. }));

    let echo = echo_of("e4", "c1", "e3/reply/0");
    let verdicts = explain(&set, &echo, &state, Inputs::default(), NOW);
    assert_eq!(
        render_text(&verdicts),
        "echo         reply (priority 0, test.toml): the bridge's own message (action \
         e3/reply/0); the rule has no `echoes = true`\n"
    );
}
