//! Tools for people who write rules: why each rule did or did not fire for one event
//! (`rules test`), and warnings about rules that can never fire or may loop (`rules check`).
//! Both are pure, like evaluation itself.

use super::condition::{Condition, Observation, Op};
use super::{Rule, RuleSet, TemplateView};
use crate::decide::Inputs;
use crate::state::{ConversationState, EndUserState};
use model::action::Action;
use model::webhook::model::{Event, Millis};
use serde::Serialize;
use serde_json::Value;

/// What happened to one rule for one event.
#[derive(Debug, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Judgement {
    Disabled,
    /// It does not listen to the event's type.
    NotListening,
    /// The event is the service's echo of the bridge's own message (of action `of`), and the rule
    /// does not take echoes.
    Echo {
        of: String,
    },
    /// An earlier rule with `stop` ran.
    Stopped {
        by: String,
    },
    /// Its `when` failed.
    NoMatch {
        failure: Observation,
    },
    Matched {
        /// Each action rendered, or why rendering failed (then it is skipped, as in the daemon).
        actions: Vec<Result<Action, String>>,
        stops: bool,
    },
    /// Its `when` holds, but it fired `fired` times within its cap's window (`per`) already, so
    /// it decides nothing (and still stops the event when it has `stop`).
    Capped {
        fired: usize,
        #[serde(with = "humantime_serde")]
        per: std::time::Duration,
        stops: bool,
    },
}

#[derive(Debug, Serialize)]
pub struct RuleVerdict {
    pub rule: String,
    pub file: String,
    pub priority: i64,
    #[serde(flatten)]
    pub verdict: Judgement,
}

/// Every rule's verdict for `event` on `state` (the state after the event was folded in, as the
/// daemon decides) with `inputs` (the state before it...) at `now`, in evaluation order. `now` is
/// also the caps' clock (the daemon's is the event's receive time).
pub fn explain(
    set: &RuleSet,
    event: &Event,
    state: &ConversationState,
    inputs: Inputs<'_>,
    now: Millis,
) -> Vec<RuleVerdict> {
    let ctx = set.context(event, state, inputs, now);
    let mut view = TemplateView::new(&ctx, &set.settings_view);
    let echo = model::action::echo::echo_of(event);
    let mut stopped_by: Option<String> = None;
    let mut out = Vec::with_capacity(set.rules.len());
    for rule in &set.rules {
        let verdict = if !rule.enabled {
            Judgement::Disabled
        } else if !rule.listens(event.kind.as_str()) {
            Judgement::NotListening
        } else if let Some(of) = echo.filter(|_| !rule.echoes) {
            Judgement::Echo { of: of.to_owned() }
        } else if let Some(by) = &stopped_by {
            Judgement::Stopped { by: by.clone() }
        } else if let Some(failure) = rule.when.as_ref().and_then(|c| c.explain(&ctx, "when")) {
            Judgement::NoMatch { failure }
        } else if let Some(fired) = rule.capped(state, now) {
            if rule.stop {
                stopped_by = Some(rule.name.clone());
            }
            Judgement::Capped {
                fired,
                per: rule.max_firings.per,
                stops: rule.stop,
            }
        } else {
            let actions = rule
                .actions
                .iter()
                .map(|spec| spec.render(&set.env, &mut view))
                .collect();
            if rule.stop {
                stopped_by = Some(rule.name.clone());
            }
            Judgement::Matched {
                actions,
                stops: rule.stop,
            }
        };
        out.push(RuleVerdict {
            rule: rule.name.clone(),
            file: rule.file.clone(),
            priority: rule.priority,
            verdict,
        });
    }
    out
}

/// For each rule whose `when` holds on this event (as [`explain`] sees it), the tests that held
/// with the values they saw (none for a rule without conditions): the audit's "matched because".
pub fn conditions_held(
    set: &RuleSet,
    event: &Event,
    state: &ConversationState,
    inputs: Inputs<'_>,
    now: Millis,
) -> std::collections::HashMap<String, Vec<Observation>> {
    let ctx = set.context(event, state, inputs, now);
    set.rules
        .iter()
        .filter(|r| r.enabled && r.listens(event.kind.as_str()))
        .filter_map(|r| match &r.when {
            None => Some((r.name.clone(), Vec::new())),
            Some(c) if c.holds(&ctx) => Some((r.name.clone(), c.held(&ctx, "when"))),
            Some(_) => None,
        })
        .collect()
}

/// A rule-set problem that is not an error: the set loads, but a rule cannot do what its author
/// meant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Warning {
    pub file: String,
    pub rule: String,
    pub message: String,
}

/// Rules that can never fire (shadowed by an earlier unconditional `stop`, contradictory
/// conditions) and rules that may trigger themselves through the service's echo events: those of
/// their own messages only when they take echoes (`echoes = true`; the rest never see them), those
/// of conversation changes always (the service does not mark them).
pub fn lint(set: &RuleSet) -> Vec<Warning> {
    let mut out = Vec::new();
    for (i, rule) in set.rules.iter().enumerate() {
        let warn = |message: String| Warning {
            file: rule.file.clone(),
            rule: rule.name.clone(),
            message,
        };
        if !rule.enabled {
            continue;
        }
        let shadow = set.rules[..i]
            .iter()
            .find(|r| r.enabled && r.stop && r.when.is_none() && covers(r, rule));
        if let Some(by) = shadow {
            out.push(warn(format!(
                "never fires: `{}` ({}) runs first, has no conditions and stops every event this \
                 rule listens to",
                by.name, by.file
            )));
        }
        if let Some((a, b)) = rule.when.as_ref().and_then(contradiction) {
            out.push(warn(format!(
                "never fires: its conditions contradict each other: ({a}) and ({b})"
            )));
        }
        for (event, kinds, why, marked) in ECHOES {
            if marked && !rule.echoes {
                continue;
            }
            let listens = rule.on.iter().any(|o| o == "*" || o == event);
            let with = if marked { " with echoes = true" } else { "" };
            let acts: Vec<&str> = rule
                .action_types()
                .into_iter()
                .filter(|t| kinds.contains(t))
                .collect();
            if listens && !acts.is_empty() {
                out.push(warn(format!(
                    "may loop: it listens to {event}{with} and takes {} ({why}); make sure its \
                     conditions exclude what the bridge itself caused",
                    acts.join(", ")
                )));
            }
        }
    }
    out
}

/// Event types the service sends back after the bridge's own actions, those actions, and whether
/// the echo carries the bridge's marker (so rules without `echoes = true` skip it).
const ECHOES: [(&str, &[&str], &str, bool); 2] = [
    (
        "bot.message.sent",
        &["send_message", "send_to_end_user"],
        "a message it sends comes back as bot.message.sent",
        true,
    ),
    (
        "bot.conversation.updated",
        &["set_manual", "navigate", "update_params"],
        "a change it makes comes back as bot.conversation.updated",
        false,
    ),
];

/// Whether every event `later` listens to is also one `earlier` listens to.
fn covers(earlier: &Rule, later: &Rule) -> bool {
    if earlier.on.iter().any(|o| o == "*") {
        return true;
    }
    later
        .on
        .iter()
        .all(|kind| kind != "*" && earlier.on.contains(kind))
}

/// Two leaves of the same field, both required by a top-level `all` (or the single leaf and
/// itself), that no value can pass together.
fn contradiction(condition: &Condition) -> Option<(String, String)> {
    let leaves: Vec<(&Vec<String>, &Op)> = match condition {
        Condition::All(items) => items
            .iter()
            .filter_map(|c| match c {
                Condition::Leaf { path, op } => Some((path, op)),
                _ => None,
            })
            .collect(),
        _ => return None,
    };
    for (i, (path_a, a)) in leaves.iter().enumerate() {
        for (path_b, b) in &leaves[i + 1..] {
            if path_a == path_b && a.contradicts(b) {
                let field = path_a.join(".");
                return Some((
                    format!("{field} {}", a.describe()),
                    format!("{field} {}", b.describe()),
                ));
            }
        }
    }
    None
}

/// `explain`'s verdicts as text, one rule per line (actions indented under their rule).
pub fn render_text(verdicts: &[RuleVerdict]) -> String {
    let mut out = String::new();
    for v in verdicts {
        let head = format!("{} (priority {}, {})", v.rule, v.priority, v.file);
        match &v.verdict {
            Judgement::Disabled => out.push_str(&format!("disabled     {head}\n")),
            Judgement::NotListening => out.push_str(&format!("not for it   {head}\n")),
            Judgement::Echo { of } => out.push_str(&format!(
                "echo         {head}: the bridge's own message (action {of}); the rule has no \
                 `echoes = true`\n"
            )),
            Judgement::Capped { fired, per, stops } => {
                let stop = if *stops { ", stops" } else { "" };
                out.push_str(&format!(
                    "capped       {head}{stop}: fired {fired} times in the last {}\n",
                    humantime::format_duration(*per)
                ));
            }
            Judgement::Stopped { by } => {
                out.push_str(&format!("not run      {head}: `{by}` stopped the event\n"))
            }
            Judgement::NoMatch { failure } => {
                let shown = |v: Option<&Value>| v.map_or("absent".to_owned(), Value::to_string);
                let actual = shown(failure.actual.as_ref());
                // `changed`: both values; a `null` before is an absent one.
                let actual = match &failure.before {
                    Some(before) => {
                        let before = shown(Some(before).filter(|v| !v.is_null()));
                        format!("before: {before}, after: {actual}")
                    }
                    None => format!("actual: {actual}"),
                };
                out.push_str(&format!(
                    "no match     {head}: {} failed: {}; {actual}\n",
                    failure.at, failure.test
                ));
            }
            Judgement::Matched { actions, stops } => {
                let stop = if *stops { ", stops" } else { "" };
                out.push_str(&format!("MATCHED      {head}{stop}\n"));
                for (i, action) in actions.iter().enumerate() {
                    let line = match action {
                        Ok(a) => serde_json::to_string(a).unwrap_or_default(),
                        Err(e) => format!("skipped: {e}"),
                    };
                    out.push_str(&format!("    actions[{i}] {line}\n"));
                }
            }
        }
    }
    out
}

/// One event's heading and, for a conversation event, every rule's verdict on it.
pub type EventReport = (String, Option<Vec<RuleVerdict>>);

/// Every event folded into the state `before` (a new conversation when `None`) and explained.
pub fn explain_events(
    set: &RuleSet,
    events: Vec<Event>,
    before: Option<&ConversationState>,
    end_user: Option<&EndUserState>,
    now: Millis,
) -> Vec<EventReport> {
    let mut reports = Vec::new();
    for ev in events {
        let Some(conversation) = ev.payload.conversation_id().cloned() else {
            let note = format!(
                "event {} ({}): not a conversation event; rules do not run for it",
                ev.id, ev.kind
            );
            reports.push((note, None));
            continue;
        };
        // `--state` is the state before the event: `changed` conditions compare with it.
        let prior = before
            .cloned()
            .unwrap_or_else(|| ConversationState::new(conversation.clone()));
        let mut state = prior.clone();
        state.apply(&ev);
        let inputs = crate::decide::Inputs {
            before: Some(&prior),
            end_user,
            queue: None,
        };
        let head = format!(
            "event {} ({}), conversation {}, at {now}, rules version {}",
            ev.id,
            ev.kind,
            conversation,
            set.version()
        );
        reports.push((head, Some(explain(set, &ev, &state, inputs, now))));
    }
    reports
}

#[cfg(test)]
mod tests;
