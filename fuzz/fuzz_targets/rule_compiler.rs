//! Arbitrary bytes as a rule file (read as UTF-8, invalid sequences replaced, as an operator's
//! editor might leave them), loaded after the shipped `settings.toml`: `RuleSet::from_sources`
//! must answer Ok or a list of problems, never panic, and the same text must always get the same
//! verdict. A set that compiles is pure, so it must also decide on the sample events without
//! panicking, each decision naming one of its rules and an action that rule has.
#![no_main]

#[path = "fixture.rs"]
mod fixture;

use engine::decide::{Decide, DecisionTime, Inputs};
use engine::rules::{version_of_sources, LoadError, RuleSet};
use engine::state::ConversationState;
use model::webhook::model::Event;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

static EVENTS: OnceLock<Vec<(Event, ConversationState)>> = OnceLock::new();

const NOW: i64 = 1_763_690_500_000;

/// The shipped rules' settings file.
const SETTINGS: &str = include_str!("../../rules/settings.toml");

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data).into_owned();
    // Beside the shipped settings, so mutations of the shipped rule files (the seeds), which read
    // `settings.*`, compile often enough to be evaluated.
    let sources = [
        ("settings.toml".to_owned(), SETTINGS.to_owned()),
        ("fuzz.toml".to_owned(), text),
    ];
    let set = match RuleSet::from_sources(&sources) {
        Ok(set) => set,
        Err(LoadError::Invalid(problems)) => {
            assert!(!problems.is_empty(), "an error without problems");
            match RuleSet::from_sources(&sources) {
                Err(LoadError::Invalid(again)) => assert_eq!(again, problems),
                other => panic!("same text, other verdict: {other:?}"),
            }
            return;
        }
        Err(other) => panic!("compiling text is not file I/O: {other}"),
    };
    assert_eq!(set.version(), version_of_sources(&sources));
    for (event, state) in EVENTS.get_or_init(fixture::events) {
        let decided = set.evaluate(event, state, Inputs::default(), DecisionTime::at(NOW));
        for decision in &decided.decisions {
            let rule = set
                .rules()
                .iter()
                .find(|r| r.name == decision.rule)
                .expect("a decision names a rule of the set");
            assert!(decision.index < rule.action_types().len());
        }
    }
});
