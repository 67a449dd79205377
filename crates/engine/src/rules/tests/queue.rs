//! The conversation's standing in the waiting queue in the rule context (`queue.*`), the shipped
//! honest-waiting texts, and timers whose `after` names a setting.

use super::*;
use crate::decide::DecisionTime;
use crate::state::queue::{Accept, AcceptHistory, Standing};

fn shipped_open_all_hours() -> RuleSet {
    let mut overrides = Map::new();
    overrides.insert("check_business_hours".into(), Value::Bool(false));
    RuleSet::from_sources_with(&crate::rules::shipped::sources(), &overrides).expect("shipped")
}

fn texts(decided: &crate::decide::Decided) -> Vec<String> {
    decided
        .decisions
        .iter()
        .filter_map(|d| match &d.action {
            Action::SendMessage { message, .. } => message.text.clone(),
            _ => None,
        })
        .collect()
}

fn standing(position: Option<u32>, accepts: &[Millis]) -> Standing {
    let mut history = AcceptHistory::default();
    for &at in accepts {
        history.record(Accept { at, waited_ms: 0 });
    }
    Standing::new(position, 5, &history)
}

#[test]
fn joining_the_queue_tells_the_place_in_line_and_the_wait_when_known() {
    let set = shipped_open_all_hours();
    let (event, state) = fixture("agent-call-requested.json");
    let settings = set.settings();
    let queue_text = settings["queue_text"]
        .as_str()
        .expect("queue_text")
        .to_owned();

    // Two accepts 2 minutes apart: position 2 waits about 4 minutes.
    let queue = standing(Some(2), &[0, 120_000]);
    let inputs = Inputs {
        queue: Some(&queue),
        ..Default::default()
    };
    let decided = set.evaluate(&event, &state, inputs, DecisionTime::at(NOW));
    assert_eq!(
        texts(&decided),
        [format!(
            "{queue_text} You are number 2 in line. Expected wait: about 4 minutes."
        )]
    );
    let timers: Vec<(&str, u128)> = decided
        .decisions
        .iter()
        .filter_map(|d| match &d.action {
            Action::StartTimer { name, after, .. } => Some((name.as_str(), after.as_millis())),
            _ => None,
        })
        .collect();
    assert!(
        timers.contains(&("queue-update", 120_000)),
        "queue_update_every (2m) starts the updates: {timers:?}"
    );

    // No rate yet: the place only.
    let queue = standing(Some(1), &[0]);
    let inputs = Inputs {
        queue: Some(&queue),
        ..Default::default()
    };
    let decided = set.evaluate(&event, &state, inputs, DecisionTime::at(NOW));
    assert_eq!(
        texts(&decided),
        [format!("{queue_text} You are number 1 in line.")]
    );

    // Not in the queue (or no queue known: `rules test`, the audit): the plain text.
    for queue in [Some(standing(None, &[])), None] {
        let inputs = Inputs {
            queue: queue.as_ref(),
            ..Default::default()
        };
        let decided = set.evaluate(&event, &state, inputs, DecisionTime::at(NOW));
        assert_eq!(texts(&decided), std::slice::from_ref(&queue_text));
    }
}

#[test]
fn the_queue_update_repeats_only_while_waiting() {
    let set = shipped_open_all_hours();
    let (_, state) = fixture("agent-call-requested.json");
    let firing = model::webhook::model::TimerFiring {
        conversation_id: state.id.clone(),
        name: "queue-update".into(),
        due_at: NOW,
        started_by: "x".into(),
    };
    let event = model::webhook::timer_event(&firing, "B1")
        .expect("timer event")
        .event;
    let waiting = standing(Some(3), &[0, 60_000]);
    let inputs = Inputs {
        queue: Some(&waiting),
        ..Default::default()
    };
    let decided = set.evaluate(&event, &state, inputs, DecisionTime::at(NOW));
    assert_eq!(
        texts(&decided),
        ["You are number 3 in line. Expected wait: about 3 minutes."]
    );
    assert!(decided.decisions.iter().any(|d| matches!(
        &d.action,
        Action::StartTimer { name, .. } if name == "queue-update"
    )));

    let taken = standing(None, &[0, 60_000]);
    let inputs = Inputs {
        queue: Some(&taken),
        ..Default::default()
    };
    let decided = set.evaluate(&event, &state, inputs, DecisionTime::at(NOW));
    assert!(
        decided.decisions.is_empty(),
        "no longer waiting: no message, no restart: {decided:?}"
    );
}

#[test]
fn a_timer_after_may_name_a_setting_resolved_at_load() {
    let text = |after: &str| {
        format!(
            "[settings]\nevery = \"90s\"\nnumber = 5\n\n[[rule]]\nname = \"t\"\n\
             on = [\"bot.message.received\"]\n\
             actions = [{{ type = \"start_timer\", name = \"tick\", after = \"{after}\" }}]\n\
             [[rule]]\nname = \"f\"\non = [\"timer.tick\"]\n"
        )
    };
    let set = RuleSet::from_sources(&[("t.toml".into(), text("{{ settings.every }}"))])
        .expect("a setting holding a duration");
    let (event, state) = fixture("message-received-text.json");
    let decided = set.decide(&event, &state, NOW);
    assert!(matches!(
        &decided[..],
        [Decision { action: Action::StartTimer { after, .. }, .. }] if after.as_secs() == 90
    ));
    for (after, want) in [
        ("{{ settings.nope }}", "no setting `nope`"),
        ("{{ settings.number }}", "must be a duration string"),
        ("{{ message.data.text }}", "must be literal"),
    ] {
        let Err(LoadError::Invalid(problems)) =
            RuleSet::from_sources(&[("t.toml".into(), text(after))])
        else {
            panic!("{after} loaded");
        };
        assert!(
            problems.iter().any(|p| p.message.contains(want)),
            "{after}: {problems:?}"
        );
    }
}
