use super::*;
use model::action::Action;
use model::ids::ConversationId;
use model::webhook::parse_event;

/// The first event of a shared fixture, folded into a fresh state.
fn fixture(name: &str) -> (Event, ConversationState) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/fixtures/webhooks")
        .join(name);
    let text = std::fs::read_to_string(&path).expect("fixture");
    let delivery: Value = serde_json::from_str(&text).expect("fixture json");
    let raw = delivery["messages"][0].to_string();
    let event = parse_event(&raw).expect("fixture event");
    let id = event
        .payload
        .conversation_id()
        .cloned()
        .unwrap_or_else(|| ConversationId::new("none"));
    let mut state = ConversationState::new(id);
    state.apply(&event);
    (event, state)
}

fn rules(text: &str) -> RuleSet {
    RuleSet::from_sources(&[("test.toml".into(), text.into())]).expect("rules compile")
}

fn problems(text: &str) -> Vec<RuleError> {
    match RuleSet::from_sources(&[("bad.toml".into(), text.into())]) {
        Err(LoadError::Invalid(p)) => p,
        other => panic!("expected problems, got {other:?}"),
    }
}

const NOW: Millis = 1_763_690_500_000;

/// Some reported problem (as printed: file, place, message) contains `needle`.
fn assert_mentioned(found: &[RuleError], needle: &str) {
    let text: Vec<String> = found.iter().map(ToString::to_string).collect();
    assert!(
        text.iter().any(|t| t.contains(needle)),
        "no problem mentions {needle:?}: {text:#?}"
    );
}

#[test]
fn a_matching_rule_decides_its_actions_with_rendered_text_and_the_conversation_filled_in() {
    let set = rules(
        r#"
        [[rule]]
        name = "ask-agent"
        on = ["bot.message.received"]
        when = { all = [
            { field = "sender", equals = "user" },
            { field = "message.data.text", contains = "상담원" },
        ] }
        actions = [
            { type = "set_manual", enabled = true },
            { type = "send_message", text = "{{ event.source_id }}: connecting you ({{ state.user_messages }})" },
        ]
        "#,
    );
    let (event, state) = fixture("message-received-text.json");
    let decisions = set.decide(&event, &state, NOW);
    assert_eq!(decisions.len(), 2, "{decisions:?}");
    assert_eq!(decisions[0].rule, "ask-agent");
    assert_eq!(decisions[0].index, 0);
    assert_eq!(decisions[1].index, 1);
    let conv = state.id.clone();
    assert_eq!(
        decisions[0].action,
        Action::SetManual {
            conversation_id: conv.clone(),
            enabled: true
        }
    );
    match &decisions[1].action {
        Action::SendMessage {
            conversation_id,
            message,
            ..
        } => {
            assert_eq!(conversation_id, &conv);
            let bot = event.source_id.as_str();
            assert_eq!(
                message.text.as_deref(),
                Some(format!("{bot}: connecting you (1)").as_str())
            );
        }
        other => panic!("not a message: {other:?}"),
    }
}

#[test]
fn conditions_that_do_not_hold_and_other_event_types_decide_nothing() {
    let set = rules(
        r#"
        [[rule]]
        name = "bot-only"
        on = ["bot.message.received"]
        when = { field = "sender", equals = "agent" }
        actions = [{ type = "set_manual", enabled = false }]

        [[rule]]
        name = "other-event"
        on = ["bot.conversation.agent_call_connected"]
        actions = [{ type = "set_manual", enabled = false }]
        "#,
    );
    let (event, state) = fixture("message-received-text.json");
    assert!(set.decide(&event, &state, NOW).is_empty());
}

#[test]
fn priority_orders_rules_and_stop_ends_the_evaluation() {
    let set = rules(
        r#"
        [[rule]]
        name = "low"
        priority = 1
        on = ["*"]
        actions = [{ type = "update_state", add_labels = ["low"] }]

        [[rule]]
        name = "high"
        priority = 10
        on = ["*"]
        actions = [{ type = "update_state", add_labels = ["high"] }]

        [[rule]]
        name = "middle"
        priority = 5
        on = ["*"]
        actions = [{ type = "update_state", add_labels = ["middle"] }]
        "#,
    );
    let (event, state) = fixture("agent-call-requested.json");
    let order: Vec<String> = set
        .decide(&event, &state, NOW)
        .into_iter()
        .map(|d| d.rule)
        .collect();
    assert_eq!(order, ["high", "middle", "low"]);

    let stopping = rules(
        r#"
        [[rule]]
        name = "first"
        priority = 10
        on = ["*"]
        stop = true
        actions = [{ type = "update_state", add_labels = ["a"] }]

        [[rule]]
        name = "never"
        on = ["*"]
        actions = [{ type = "update_state", add_labels = ["b"] }]
        "#,
    );
    let rules: Vec<String> = stopping
        .decide(&event, &state, NOW)
        .into_iter()
        .map(|d| d.rule)
        .collect();
    assert_eq!(rules, ["first"]);
}

#[test]
fn disabled_rules_are_kept_but_never_fire() {
    let set = rules(
        r#"
        [[rule]]
        name = "off"
        enabled = false
        on = ["*"]
        actions = [{ type = "set_manual", enabled = true }]
        "#,
    );
    assert_eq!(set.rules().len(), 1);
    let (event, state) = fixture("agent-call-requested.json");
    assert!(set.decide(&event, &state, NOW).is_empty());
}

#[test]
fn every_operator_tests_what_it_says() {
    let (event, state) = fixture("message-received-text.json");
    let ctx = context::build(&event, &state, NOW);
    let holds = |cond: &str| {
        let raw: RawCondition = toml::from_str(cond).expect("condition toml");
        let mut p = Vec::new();
        let c = raw
            .compile("when", &calendar::Calendars::default(), &mut p)
            .expect("compiles");
        c.holds(&ctx)
    };
    let text = "field = \"message.data.text\"";
    assert!(holds(&format!("{text}\ncontains = \"상담원\"")));
    assert!(!holds(&format!("{text}\ncontains = \"nope\"")));
    assert!(holds(&format!("{text}\nstarts_with = \"주문\"")));
    assert!(holds(&format!("{text}\nends_with = \"주세요\"")));
    assert!(holds(&format!("{text}\nmatches = \"상담원\\\\s+연결\"")));
    assert!(!holds(&format!("{text}\nmatches = \"^상담원\"")));
    assert!(holds(&format!("{text}\nexists = true")));
    assert!(holds("field = \"message.meta.nothing\"\nexists = false"));
    assert!(holds("field = \"sender\"\nin = [\"bot\", \"user\"]"));
    assert!(!holds("field = \"sender\"\nin = [\"bot\", \"agent\"]"));
    assert!(holds("field = \"sender\"\nnot_equals = \"agent\""));
    assert!(holds("field = \"state.user_messages\"\nequals = 1"));
    assert!(holds("field = \"state.user_messages\"\ngte = 1"));
    assert!(!holds("field = \"state.user_messages\"\ngt = 1"));
    assert!(holds("field = \"state.user_messages\"\nlt = 2.5"));
    assert!(holds("field = \"state.user_messages\"\nlte = 1"));
    assert!(holds("field = \"state.phase\"\nequals = \"bot\""));
    assert!(holds(
        "field = \"event.type\"\nequals = \"bot.message.received\""
    ));
    assert!(holds(
        "not = { field = \"state.labels\", contains = \"vip\" }"
    ));
    assert!(holds(
        "any = [{ field = \"sender\", equals = \"bot\" }, { field = \"sender\", equals = \"user\" }]"
    ));
    assert!(!holds(
        "all = [{ field = \"sender\", equals = \"bot\" }, { field = \"sender\", equals = \"user\" }]"
    ));
    // A missing field fails every positive test.
    assert!(!holds("field = \"state.variables.none\"\nequals = \"x\""));
    assert!(!holds("field = \"state.variables.none\"\ngt = 0"));
}

#[test]
fn every_problem_of_a_file_is_reported_with_its_place() {
    let found = problems(
        r#"
        [[rule]]
        name = "bad name!"
        on = ["bot.message.recieved"]
        when = { field = "mesage.data.text", contains = "x" }
        actions = [
            { type = "set_manul" },
            { type = "send_message", text = "{{ unclosed" },
            { type = "navigate" },
        ]

        [[rule]]
        name = "two-ops"
        on = ["*"]
        when = { field = "sender", equals = "user", contains = "u" }

        [[rule]]
        name = "regex"
        on = ["*"]
        when = { field = "sender", matches = "(" }
        "#,
    );
    let has = |needle: &str| assert_mentioned(&found, needle);
    has("rule[0] (bad name!).name");
    has("rule[0] (bad name!).on[0]: `bot.message.recieved` is not a webhook event type");
    has("when.field: `mesage.data.text` is not a field");
    has("actions[0].type: unknown action `set_manul`");
    has("actions[1].message.text: template");
    has("actions[2]: a `navigate` names its flow by id (`flow_id`) or by title (`flow`)");
    has("rule[1] (two-ops).when: a `field` condition needs exactly one operator");
    has("rule[2] (regex).when.matches: invalid regex");
    assert!(found.iter().all(|p| p.file == "bad.toml"));
    // Each names the line its rule starts on (the text begins with a newline).
    let line_of = |rule: &str| {
        found
            .iter()
            .find(|p| p.at.starts_with(rule))
            .and_then(|p| p.line)
    };
    assert_eq!(line_of("rule[0]"), Some(2));
    assert_eq!(line_of("rule[1]"), Some(12));
    assert_eq!(line_of("rule[2]"), Some(17));
    assert!(found[0].to_string().starts_with("bad.toml:2: rule[0]"));
}

#[test]
fn unknown_keys_syntax_errors_and_duplicate_names_are_refused() {
    let found = problems("[[rule]]\nname = \"a\"\non = [\"*\"]\nwhen_ = 1\n");
    assert!(found[0].message.contains("when_"), "{found:?}");
    let found = problems("[[rule]\n");
    assert_eq!(found.len(), 1);
    let dup = RuleSet::from_sources(&[
        (
            "a.toml".into(),
            "[[rule]]\nname = \"x\"\non = [\"*\"]\n".into(),
        ),
        (
            "b.toml".into(),
            "[[rule]]\nname = \"x\"\non = [\"*\"]\n".into(),
        ),
    ]);
    match dup {
        Err(LoadError::Invalid(p)) => {
            assert_eq!(p.len(), 1);
            assert!(p[0].to_string().starts_with("b.toml:1: rule[0] (x).name"));
            assert_eq!(p[0].line, Some(1), "the line the rule starts on");
            assert!(p[0].message.contains("a.toml"));
        }
        other => panic!("duplicate names accepted: {other:?}"),
    }
}

#[test]
fn a_template_that_fails_at_run_time_skips_only_that_action() {
    let set = rules(
        r#"
        [[rule]]
        name = "partial"
        on = ["*"]
        actions = [
            { type = "send_message", text = "{{ state.variables.missing }}" },
            { type = "set_manual", enabled = true },
        ]
        "#,
    );
    let (event, state) = fixture("agent-call-requested.json");
    let decisions = set.decide(&event, &state, NOW);
    assert_eq!(decisions.len(), 1, "{decisions:?}");
    // The surviving action keeps its own index, so its id does not depend on the failure.
    assert_eq!(decisions[0].index, 1);
    assert!(matches!(decisions[0].action, Action::SetManual { .. }));
    // The failure is part of what was decided, and the state keeps it for the audit.
    let mut state = state;
    let decided = set.evaluate(&event, &state, Inputs::default(), DecisionTime::at(NOW));
    assert_eq!(decided.failed.len(), 1, "{decided:?}");
    let failed = &decided.failed[0];
    assert_eq!((failed.rule.as_str(), failed.index), ("partial", 0));
    assert_eq!(failed.kind, "send_message");
    assert!(failed.error.contains("undefined"), "{}", failed.error);
    decided.record(&mut state, &event.id, NOW);
    decided.record(&mut state, &event.id, NOW);
    assert_eq!(state.template_errors.len(), 1, "kept once per action");
    let kept = &state.template_errors[0];
    assert_eq!(kept.id, format!("{}/partial/0", event.id));
    assert_eq!((kept.event.as_str(), kept.at), (event.id.as_str(), NOW));
}

#[test]
fn a_conversation_keeps_only_its_newest_template_errors() {
    let (_, mut state) = fixture("agent-call-requested.json");
    for i in 0..crate::state::TEMPLATE_ERRORS_KEPT + 5 {
        state.record_template_error(crate::state::TemplateError {
            id: format!("e-{i}/r/0"),
            event: format!("e-{i}"),
            rule: "r".into(),
            index: 0,
            kind: "send_message".into(),
            error: "undefined value".into(),
            at: NOW,
        });
    }
    assert_eq!(
        state.template_errors.len(),
        crate::state::TEMPLATE_ERRORS_KEPT
    );
    assert_eq!(state.template_errors[0].id, "e-5/r/0", "the oldest went");
}

#[test]
fn a_matches_condition_may_name_a_setting_read_at_load() {
    let text = r#"
        [settings]
        keywords = "(상담원|agent)"
        [[rule]]
        name = "ask"
        on = ["bot.message.received"]
        when = { all = [
            { field = "sender", equals = "user" },
            { not = { field = "message.data.text", matches = "{{ settings.keywords }}" } },
        ] }
        actions = [{ type = "set_manual", enabled = true }]
    "#;
    let sources = [("test.toml".to_owned(), text.to_owned())];
    let (event, state) = fixture("message-received-text.json");
    let text_of = event.payload.clone();
    let model::webhook::model::Payload::Message(m) = text_of else {
        panic!("a message fixture")
    };
    let said = m.data.text.clone().unwrap_or_default();
    // The fixture's text matches a pattern made of itself; `not` then fails.
    let mut overrides = Map::new();
    overrides.insert("keywords".into(), Value::String(regex::escape(&said)));
    let matching = RuleSet::from_sources_with(&sources, &overrides).expect("load");
    assert!(matching.decide(&event, &state, NOW).is_empty());
    overrides.insert("keywords".into(), Value::String("^never this$".into()));
    let other = RuleSet::from_sources_with(&sources, &overrides).expect("load");
    assert_eq!(other.decide(&event, &state, NOW).len(), 1);
    // A bad pattern in the setting is a load error at the condition, like a literal one.
    overrides.insert("keywords".into(), Value::String("(".into()));
    match RuleSet::from_sources_with(&sources, &overrides) {
        Err(LoadError::Invalid(found)) => assert_mentioned(&found, "when.all[1].not.matches"),
        other => panic!("expected problems, got {other:?}"),
    }
    // A setting no file defines, or one that is not text.
    let missing = text.replace("settings.keywords", "settings.nope");
    assert_mentioned(&problems(&missing), "no setting `nope`");
    let number = text.replace("keywords = \"(상담원|agent)\"", "keywords = 3");
    assert_mentioned(&problems(&number), "must be text (a regex)");
}

#[test]
fn partner_actions_default_to_the_conversations_user_key() {
    let set = rules(
        r#"
        [[rule]]
        name = "relay"
        on = ["bot.message.received"]
        actions = [{ type = "partner_send_message", sender_key = "sk-1", text = "hi {{ user_key }}" }]
        "#,
    );
    let (event, mut state) = fixture("message-received-text.json");
    state.user_key = Some("uk-9".into());
    let decisions = set.decide(&event, &state, NOW);
    match &decisions[0].action {
        Action::PartnerSendMessage {
            sender_key,
            user_key,
            message,
        } => {
            assert_eq!(sender_key, "sk-1");
            assert_eq!(user_key, "uk-9");
            assert_eq!(message.text.as_deref(), Some("hi uk-9"));
        }
        other => panic!("{other:?}"),
    }
    // Without a user key the action cannot be made; it is skipped, not sent to nobody.
    state.user_key = None;
    assert!(set.decide(&event, &state, NOW).is_empty());
}

#[test]
fn the_version_changes_with_the_files() {
    let a = rules("[[rule]]\nname = \"a\"\non = [\"*\"]\n");
    let b = rules("[[rule]]\nname = \"b\"\non = [\"*\"]\n");
    assert_ne!(a.version(), b.version());
    assert_eq!(
        a.version(),
        rules("[[rule]]\nname = \"a\"\non = [\"*\"]\n").version()
    );
}

#[test]
fn load_dir_reads_toml_files_in_name_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("b.toml"),
        "[[rule]]\nname = \"second\"\non = [\"*\"]\nactions = [{ type = \"set_manual\", enabled = true }]\n",
    )
    .expect("write");
    std::fs::write(
        dir.path().join("a.toml"),
        "[[rule]]\nname = \"first\"\non = [\"*\"]\nactions = [{ type = \"set_manual\", enabled = false }]\n",
    )
    .expect("write");
    std::fs::write(dir.path().join("notes.md"), "not a rule file").expect("write");
    let set = RuleSet::load_dir(dir.path()).expect("load");
    let names: Vec<&str> = set.rules().iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["first", "second"]);
    assert!(matches!(
        RuleSet::load_dir(&dir.path().join("missing")),
        Err(LoadError::Dir { .. })
    ));
}

#[test]
fn the_example_rule_set_in_the_repository_compiles_and_decides() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../rules/examples");
    let set = RuleSet::load_dir(&dir).expect("rules/examples must stay valid");
    assert_eq!(set.rules().len(), 5);
    let (event, state) = fixture("message-received-text.json");
    let kinds = |now: Millis| -> Vec<&str> {
        set.decide(&event, &state, now)
            .iter()
            .map(|d| d.action.name())
            .collect()
    };
    // NOW is a Friday morning in Seoul: the agent is called, and the wait timed.
    assert_eq!(
        kinds(NOW),
        ["set_manual", "send_message", "update_state", "start_timer"]
    );
    // The next day is a Saturday: only the after-hours reply, and the bot stays on.
    assert_eq!(kinds(NOW + 24 * 3_600_000), ["send_message"]);

    // Five minutes after asking, nobody has answered: the timer's rule says so.
    let mut waiting = state.clone();
    let asked = set.decide(&event, &waiting, NOW);
    let started_by = format!("{}/ask-agent/3", event.id);
    assert!(crate::decide::apply_to_state(
        &asked[3].action,
        &mut waiting,
        NOW,
        &started_by
    ));
    let firing = model::webhook::model::TimerFiring {
        conversation_id: waiting.id.clone(),
        name: "agent-wait".into(),
        due_at: NOW + 300_000,
        started_by,
    };
    let timer = model::webhook::timer_event(&firing, event.source_id.as_str())
        .expect("timer event")
        .event;
    assert!(waiting.apply(&timer));
    let decided = set.decide(&timer, &waiting, NOW + 300_000);
    let by: Vec<(&str, &str)> = decided
        .iter()
        .map(|d| (d.rule.as_str(), d.action.name()))
        .collect();
    assert_eq!(by, [("still-waiting", "send_message")]);
}

#[test]
fn keys_an_action_does_not_have_stray_operators_and_rule_less_events_are_refused() {
    let found = problems(
        r#"
        [[rule]]
        name = "typos"
        on = ["bot.message.received"]
        when = { not = { field = "sender", equals = "bot" }, equals = 1 }
        actions = [
            { type = "update_state", add_label = ["x"] },
            { type = "navigate", flow_id = 3, node = 4 },
            { type = "send_message", text = "a", message = { type = "text", text = "b" } },
        ]

        [[rule]]
        name = "bot-event"
        on = ["bot.updated", "bot.end_user.created"]
        "#,
    );
    let has = |needle: &str| assert_mentioned(&found, needle);
    has("(typos).when: an operator belongs to a `field` condition");
    has("actions[0].add_label: not a field of a `update_state` action");
    has("actions[1].node: not a field of a `navigate` action");
    has("actions[2].text: not a field of a `send_message` action");
    has("(bot-event).on[0]: `bot.updated` never reaches rules");
    has("(bot-event).on[1]: `bot.end_user.created` never reaches rules");
}

#[test]
fn templates_are_not_html_escaped_and_old_timestamps_do_not_overflow() {
    let set = rules(
        r#"
        [[rule]]
        name = "raw"
        on = ["*"]
        actions = [{ type = "update_params", params = { "page.html" = "<b>{{ event.source_id }}</b> & co" } }]
        "#,
    );
    let (mut event, _) = fixture("message-received-text.json");
    event.timestamp = Millis::MIN;
    if let model::webhook::model::Payload::Message(m) = &mut event.payload {
        m.timestamp = Some(Millis::MIN);
    }
    let mut state = ConversationState::new(ConversationId::new("c-old"));
    state.apply(&event);
    let ctx = context::build(&event, &state, NOW);
    assert_eq!(
        ctx["state"]["seconds_since_last_user_message"],
        Value::from(Millis::MAX / 1000),
        "saturated, not overflowed"
    );
    let decisions = set.decide(&event, &state, NOW);
    match &decisions[0].action {
        Action::UpdateParams { params, .. } => {
            let want = format!("<b>{}</b> & co", event.source_id);
            assert_eq!(params["page.html"], Value::String(want));
        }
        other => panic!("{other:?}"),
    }
}

/// Seoul hours for the fixtures' bot; `NOW` is Friday 2025-11-21 11:01 in Seoul.
const SUPPORT_CALENDAR: &str = r#"
    [calendar.support]
    time_zone = "Asia/Seoul"
    bots = ["B7f3a2c"]
    holidays = ["2025-12-22"]
    [calendar.support.hours]
    mon = ["09:00-18:00"]
    fri = ["09:00-12:00", "13:00-18:00"]

    [calendar.other-bot]
    time_zone = "UTC"
    bots = ["someone-else"]
    [calendar.other-bot.hours]
    fri = ["00:00-24:00"]
"#;

#[test]
fn business_hours_holds_when_the_conversations_bot_is_open_in_the_calendar() {
    // The calendar is defined in a later file than the rules that use it.
    let set = RuleSet::from_sources(&[
        (
            "a.toml".into(),
            r#"
            [[rule]]
            name = "open"
            on = ["*"]
            when = { business_hours = "support" }
            actions = [{ type = "update_state", add_labels = ["open"] }]

            [[rule]]
            name = "closed"
            on = ["*"]
            when = { not = { business_hours = "support" } }
            actions = [{ type = "update_state", add_labels = ["closed"] }]

            [[rule]]
            name = "other-bot"
            on = ["*"]
            when = { business_hours = "other-bot" }
            actions = [{ type = "update_state", add_labels = ["other"] }]
            "#
            .into(),
        ),
        ("b.toml".into(), SUPPORT_CALENDAR.into()),
    ])
    .expect("rules compile");
    let (event, state) = fixture("message-received-text.json");
    assert_eq!(state.bot_id.as_ref().map(|b| b.as_str()), Some("B7f3a2c"));
    let fired = |now: Millis| -> Vec<String> {
        set.decide(&event, &state, now)
            .into_iter()
            .map(|d| d.rule)
            .collect()
    };
    let hour = 3_600_000;
    // Fri 11:01 and 13:01 are open, the lunch break (12:01) is not; `other-bot` is open all
    // Friday, but not for this conversation's bot.
    assert_eq!(fired(NOW), ["open"]);
    assert_eq!(fired(NOW + hour), ["closed"]);
    assert_eq!(fired(NOW + 2 * hour), ["open"]);
    // Saturday 11:01; Monday 11:01, open a week before the holiday and closed on it.
    let day = 24 * hour;
    assert_eq!(fired(NOW + day), ["closed"]);
    assert_eq!(fired(NOW + 24 * day), ["open"], "Mon 2025-12-15");
    assert_eq!(
        fired(NOW + 31 * day),
        ["closed"],
        "Mon 2025-12-22, a holiday"
    );
}

#[test]
fn every_calendar_problem_is_reported_with_its_place() {
    let found = problems(
        r#"
        [calendar.support]
        time_zone = "Asia/Seol"
        holidays = ["2026-12-25", "2026-02-30", "12/25/2026"]
        [calendar.support.hours]
        mon = ["09:00-12:00", "11:00-13:00"]
        tue = ["22:00-06:00"]
        wed = ["9:00-18:00", "09:00-24:01"]
        thu = ["10:00-10:00"]
        monday = ["09:00-18:00"]

        [calendar.fine]
        time_zone = "UTC"
        [calendar.fine.hours]
        mon = ["00:00-24:00"]

        [[rule]]
        name = "typo"
        on = ["*"]
        when = { business_hours = "suport" }

        [[rule]]
        name = "uses-broken"
        on = ["*"]
        when = { any = [{ business_hours = "fine" }, { not = { business_hours = "support" } }] }

        [[rule]]
        name = "stray"
        on = ["*"]
        when = { business_hours = "fine", equals = true }

        [[rule]]
        name = "both"
        on = ["*"]
        when = { business_hours = "fine", field = "now", gt = 0 }
        "#,
    );
    let has = |needle: &str| assert_mentioned(&found, needle);
    has("bad.toml: calendar.support.time_zone: `Asia/Seol` is not a time zone");
    has("calendar.support.holidays[1]: `2026-02-30` is not a date YYYY-MM-DD");
    has("calendar.support.holidays[2]: `12/25/2026` is not a date");
    has("calendar.support.hours.mon[1]: `11:00-13:00` overlaps `09:00-12:00`");
    has("calendar.support.hours.tue[0]: `22:00-06:00` does not end after it starts; a range lies within one day (overnight: split it into two days");
    has("calendar.support.hours.wed[0]: `9:00-18:00` is not a range HH:MM-HH:MM");
    has("calendar.support.hours.wed[1]: `09:00-24:01` is not a range");
    has("calendar.support.hours.thu[0]: `10:00-10:00` does not end after it starts");
    has("calendar.support.hours.monday: `monday` is not a day");
    has("rule[0] (typo).when.business_hours: no calendar `suport` is defined (defined: fine, support)");
    has("rule[1] (uses-broken).when.any[1].not.business_hours: calendar `support` has problems");
    has("rule[2] (stray).when: an operator belongs to a `field` condition");
    has("rule[3] (both).when: a condition needs exactly one of");
    assert_eq!(found.len(), 13, "{found:#?}");
}

#[test]
fn a_calendar_name_defined_twice_and_unknown_calendar_keys_are_refused() {
    let calendar = "[calendar.support]\ntime_zone = \"UTC\"\nhours = {}\n";
    match RuleSet::from_sources(&[
        ("a.toml".into(), calendar.into()),
        ("b.toml".into(), calendar.into()),
    ]) {
        Err(LoadError::Invalid(p)) => {
            assert_eq!(p.len(), 1, "{p:?}");
            assert_eq!(
                p[0].to_string(),
                "b.toml: calendar.support: `support` is already the name of a calendar in a.toml"
            );
        }
        other => panic!("duplicate calendar accepted: {other:?}"),
    }
    let found = problems("[calendar.support]\ntimezone = \"UTC\"\nhours = {}\n");
    assert_mentioned(&found, "timezone");
    let found = problems("[calendar.support]\ntime_zone = \"UTC\"\n");
    assert_mentioned(&found, "hours");
}

const TIMER_RULES: &str = r#"
    [[rule]]
    name = "ask"
    on = ["bot.message.received"]
    actions = [
      { type = "start_timer", name = "agent-wait", after = "5m" },
      { type = "cancel_timer", name = "nudge" },
    ]

    [[rule]]
    name = "nudge"
    on = ["timer.agent-wait"]
    when = { field = "timer.due_at", gt = 0 }
    actions = [{ type = "send_message", text = "{{ timer.name }} at {{ timer.due_at }} ({{ event.type }})" }]

    [[rule]]
    name = "everything"
    on = ["*"]
    actions = [{ type = "update_state", add_labels = ["seen"] }]
"#;

#[test]
fn timer_actions_decide_and_a_timer_event_reaches_only_rules_that_name_it() {
    let set = rules(TIMER_RULES);
    let (event, mut state) = fixture("message-received-text.json");
    let decisions = set.decide(&event, &state, NOW);
    let actions: Vec<&Action> = decisions.iter().map(|d| &d.action).collect();
    assert_eq!(
        actions[..2],
        [
            &Action::StartTimer {
                conversation_id: state.id.clone(),
                name: "agent-wait".into(),
                after: std::time::Duration::from_secs(300),
            },
            &Action::CancelTimer {
                conversation_id: state.id.clone(),
                name: "nudge".into(),
            },
        ]
    );
    assert_eq!(decisions[2].rule, "everything");
    // Applied in the fold: due `after` the decision's clock, remembered with what started it.
    let started_at = NOW - 300_005;
    assert!(crate::decide::apply_to_state(
        &decisions[0].action,
        &mut state,
        started_at,
        "e/ask/0"
    ));
    assert_eq!(
        state
            .timers
            .get("agent-wait")
            .map(|t| (t.due_at, t.started_by.as_str())),
        Some((NOW - 5, "e/ask/0"))
    );

    let firing = model::webhook::model::TimerFiring {
        conversation_id: state.id.clone(),
        name: "agent-wait".into(),
        due_at: NOW - 5,
        started_by: "e/ask/0".into(),
    };
    let timer = model::webhook::timer_event(&firing, event.source_id.as_str())
        .expect("timer event")
        .event;
    assert!(state.apply(&timer));
    let ctx = context::build(&timer, &state, NOW);
    assert_eq!(ctx["timer"]["name"], "agent-wait");
    assert_eq!(ctx["timer"]["due_at"], NOW - 5);
    let decisions = set.decide(&timer, &state, NOW);
    assert_eq!(
        decisions.len(),
        1,
        "`*` does not take timer events: {decisions:?}"
    );
    assert_eq!(decisions[0].rule, "nudge");
    match &decisions[0].action {
        Action::SendMessage { message, .. } => assert_eq!(
            message.text.as_deref(),
            Some(format!("agent-wait at {} (timer.agent-wait)", NOW - 5).as_str())
        ),
        other => panic!("not a message: {other:?}"),
    }
}

#[test]
fn timer_names_durations_and_timer_events_are_checked_at_load() {
    let found = problems(
        r#"
        [[rule]]
        name = "starts"
        on = ["bot.message.received"]
        actions = [
          { type = "start_timer", name = "agent wait", after = "5m" },
          { type = "start_timer", name = "{{ sender }}", after = "5m" },
          { type = "start_timer", name = "a", after = "soon" },
          { type = "start_timer", name = "b", after = "0s" },
          { type = "start_timer", name = "c", after = "{{ state.variables.wait }}" },
          { type = "start_timer", name = "d", after = 300 },
          { type = "start_timer", name = "e" },
          { type = "cancel_timer", name = "" },
          { type = "cancel_timer", name = "f", conversation_id = "other" },
          { type = "start_timer", name = "g", after = "1m", every = "1m" },
        ]

        [[rule]]
        name = "listens"
        on = ["timer.never-started", "timer.bad name", "timer.a"]
        "#,
    );
    let has = |needle: &str| assert_mentioned(&found, needle);
    has("actions[0].name: must be non-empty and use only A-Z a-z 0-9 - _");
    has("actions[1].name: must be literal");
    has("actions[2].after: `soon` is not a duration");
    has("actions[3].after: must be longer than zero");
    has("actions[4].after: must be literal");
    has("actions[5].after: must be a duration string");
    has("actions[6].after: missing duration");
    has("actions[7].name: must be non-empty");
    has("actions[8].conversation_id: a timer belongs to the conversation");
    has("actions[9].every: not a field of a `start_timer` action");
    has("(listens).on[0]: `timer.never-started` never fires: no rule starts a timer named `never-started`");
    has("(listens).on[1]: `timer.bad name`: a timer name is non-empty");
    let on_a = found.iter().any(|p| p.at == "rule[1] (listens).on[2]");
    assert!(
        !on_a,
        "a timer started by some rule may be listened to: {found:#?}"
    );
    assert_eq!(found.len(), 12, "{found:#?}");
}

mod changed;
mod end_user;
mod loops;
mod navigate;
mod queue;

#[test]
fn notify_helpdesk_kinds_are_checked_at_load_and_take_a_reason() {
    let found = problems(
        r#"
[[rule]]
name = "typo"
on = ["*"]
actions = [
  { type = "notify_helpdesk", kind = "handoff.remind" },
  { type = "notify_helpdesk", kind = "{{ event.type }}" },
  { type = "notify_helpdesk" },
]
"#,
    );
    assert_mentioned(&found, "unknown help-desk event kind `handoff.remind`");
    assert_mentioned(&found, "must be literal");
    assert_mentioned(&found, "missing event kind");
    assert_eq!(found.len(), 3, "{found:#?}");

    let set = rules(
        r#"
[[rule]]
name = "tell"
on = ["bot.conversation.agent_call_requested"]
actions = [{ type = "notify_helpdesk", kind = "handoff.requested", reason = "asked via {{ event.type }}", payload = { team = "billing" } }]
"#,
    );
    let (event, state) = fixture("agent-call-requested.json");
    let decided = set.decide(&event, &state, NOW);
    assert_eq!(decided.len(), 1, "{decided:?}");
    match &decided[0].action {
        Action::NotifyHelpdesk {
            conversation_id,
            kind,
            reason,
            payload,
        } => {
            assert_eq!(conversation_id, &state.id);
            assert_eq!(kind, "handoff.requested");
            assert_eq!(
                reason.as_deref(),
                Some("asked via bot.conversation.agent_call_requested")
            );
            assert_eq!(payload["team"], "billing");
        }
        other => panic!("not a help-desk event: {other:?}"),
    }
}

#[test]
fn a_rule_set_needs_the_before_state_end_user_and_queue_only_when_it_reads_them() {
    use crate::decide::{Decide, Needs};
    let set = |text: &str| RuleSet::from_sources(&[("n.toml".into(), text.into())]).expect("rules");
    let plain = "[[rule]]\nname = \"p\"\non = [\"bot.message.received\"]\n\
                 when = { field = \"state.manual\", equals = true }\n\
                 actions = [{ type = \"send_message\", text = \"hi {{ state.platform }}\" }]\n";
    assert_eq!(set(plain).needs(), Needs::NONE);
    let changed = "[[rule]]\nname = \"c\"\non = [\"bot.message.received\"]\n\
                   when = { not = { field = \"state.phase\", changed = true } }\n\
                   actions = [{ type = \"set_manual\", enabled = true }]\n";
    assert_eq!(
        set(changed).needs(),
        Needs {
            before: true,
            end_user: false,
            queue: false
        }
    );
    let templated = "[[rule]]\nname = \"t\"\non = [\"bot.message.received\"]\n\
                     actions = [{ type = \"send_message\", text = \"{{ end_user.params.name }}\" }]\n";
    assert_eq!(
        set(templated).needs(),
        Needs {
            before: false,
            end_user: true,
            queue: false
        }
    );
    let queued = "[[rule]]\nname = \"q\"\non = [\"bot.message.received\"]\n\
                  when = { field = \"queue.waiting\", equals = true }\n\
                  actions = [{ type = \"set_manual\", enabled = true }]\n";
    assert_eq!(
        set(queued).needs(),
        Needs {
            before: false,
            end_user: false,
            queue: true
        }
    );
    let shipped = RuleSet::from_sources(&crate::rules::shipped::sources()).expect("shipped");
    assert_eq!(
        shipped.needs(),
        Needs {
            before: false,
            end_user: true,
            queue: true
        },
        "the shipped rules read the queue (honest waiting) and the user's name (the call-back \
         notification), not the state before"
    );
}

#[test]
fn rules_may_listen_to_agent_commands_by_name_but_not_through_the_wildcard() {
    let set = rules(
        r#"
        [[rule]]
        name = "greet-agent"
        on = ["agent.accept"]
        when = { field = "agent_command.agent.id", equals = "alice" }
        actions = [{ type = "send_message", text = "An agent is with you" }]

        [[rule]]
        name = "everything"
        on = ["*"]
        actions = [{ type = "update_state", add_labels = ["seen"] }]
        "#,
    );
    let cmd = model::webhook::agent::AgentCommand {
        conversation_id: "c1".into(),
        command: model::webhook::agent::Command::Accept {
            agent: model::webhook::agent::DeskAgent {
                id: "alice".into(),
                name: None,
            },
        },
    };
    let event = model::webhook::agent_event(&cmd, "agent:c1:accept:k", "B1", NOW)
        .expect("event")
        .event;
    let mut state = ConversationState::new("c1".into());
    assert!(state.apply(&event), "an applied command reaches rules");
    let decided = set.decide(&event, &state, NOW);
    let rules: Vec<&str> = decided.iter().map(|d| d.rule.as_str()).collect();
    assert_eq!(rules, vec!["greet-agent"]);
    assert_mentioned(
        &problems(
            r#"
        [[rule]]
        name = "x"
        on = ["agent.nope"]
        actions = [{ type = "set_manual", enabled = true }]
        "#,
        ),
        "an agent command (`agent.accept`...) nor `reconcile.drift`",
    );
}
