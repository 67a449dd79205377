//! `check` (the configuration and its rules) and `rules check|test` (tools for rule authors).

use super::{load, load_with, CliError, ConfigArgs, RulesCommand};
use engine::rules::{explain, RuleSet};
use engine::state::{ConversationState, EndUserState};
use handoff_bridge::config::Overrides;
use model::webhook::model::{Event, Millis};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// One event's heading and, for a conversation event, every rule's verdict on it.
type Report = (String, Option<Vec<explain::RuleVerdict>>);

/// `handoff-bridge check`: validate the config and its rules, print the effective values.
pub(super) fn check(
    args: &ConfigArgs,
    listen: Option<String>,
    admin_listen: Option<String>,
) -> Result<(), CliError> {
    let overrides = Overrides {
        listen,
        admin_listen,
        check_files: true,
        ..Overrides::default()
    };
    let config = load_with(args, overrides)?;
    let rules = handoff_bridge::app::rule_set(&config)?;
    for note in &config.deprecated {
        out!("# warning: {note}");
    }
    out!("# configuration is valid; effective values (secrets masked):");
    out_raw!("{}", config.to_masked_toml());
    if let Some(set) = rules {
        out!(
            "# rules valid: {} rule(s), version {}",
            set.rules().len(),
            set.version()
        );
        for rule in set.rules() {
            out!("#   {}", rule_line(rule));
        }
    }
    Ok(())
}

/// `handoff-bridge rules check|test`.
pub(super) fn rules_command(args: &ConfigArgs, action: RulesCommand) -> Result<(), CliError> {
    match action {
        RulesCommand::Check { dir } => rules_check(args, dir),
        RulesCommand::Test {
            dir,
            event,
            state,
            end_user,
            at,
            json,
        } => {
            let (_, set) = load_rule_set(args, dir)?;
            let inputs = TestInputs {
                event: &event,
                state: state.as_deref(),
                end_user: end_user.as_deref(),
                at: at.as_deref(),
            };
            rules_test(&set, inputs, json)
        }
    }
}

/// A directory given here, else the configured rules (the shipped set when `rules.dir` is
/// empty), with the configured setting overrides; with the label to print for them.
fn load_rule_set(args: &ConfigArgs, dir: Option<PathBuf>) -> Result<(String, RuleSet), CliError> {
    let config = load(args, None)?;
    let overrides = handoff_bridge::app::settings_overrides(&config);
    if let Some(dir) = dir {
        let set = RuleSet::load_dir_with(&dir, &overrides)?;
        return Ok((dir.display().to_string(), set));
    }
    if !config.rules.enabled {
        return Err(CliError::Usage(
            "rules are turned off (rules.enabled = false): give a directory".into(),
        ));
    }
    let set = handoff_bridge::app::rule_set(&config)?
        .ok_or_else(|| CliError::Usage("rules are turned off (rules.enabled = false)".into()))?;
    let label = if config.rules.dir.is_empty() {
        "shipped rules".to_owned()
    } else {
        config.rules.dir.clone()
    };
    Ok((label, set))
}

/// `rules check`: list the rules in evaluation order, then the lint warnings.
fn rules_check(args: &ConfigArgs, dir: Option<PathBuf>) -> Result<(), CliError> {
    let (label, set) = load_rule_set(args, dir)?;
    out!(
        "{}: {} rule(s), version {}",
        label,
        set.rules().len(),
        set.version()
    );
    for rule in set.rules() {
        out!("  {}", rule_line(rule));
    }
    let warnings = explain::lint(&set);
    if warnings.is_empty() {
        out!("no warnings");
    } else {
        out!("{} warning(s):", warnings.len());
        for w in &warnings {
            out!("  {} rule {}: {}", w.file, w.rule, w.message);
        }
    }
    Ok(())
}

/// The files and clock `rules test` was given.
struct TestInputs<'a> {
    /// One event or a whole delivery.
    event: &'a Path,
    /// The conversation's state before the event.
    state: Option<&'a Path>,
    /// The conversation's end user.
    end_user: Option<&'a Path>,
    /// The clock, Unix ms or RFC 3339.
    at: Option<&'a str>,
}

/// `rules test`: what `set` decides for each event of the input, as text or JSON.
fn rules_test(set: &RuleSet, inputs: TestInputs<'_>, json: bool) -> Result<(), CliError> {
    let events = events_of(&read_input(inputs.event)?)
        .map_err(|e| CliError::Usage(format!("{}: {e}", inputs.event.display())))?;
    let before = inputs
        .state
        .map(|path| parse_input::<ConversationState>(path, "a conversation state"))
        .transpose()?;
    let end_user = inputs
        .end_user
        .map(|path| parse_input::<EndUserState>(path, "an end-user state"))
        .transpose()?;
    let now = match inputs.at {
        Some(t) => model::clock::parse_time(t).map_err(CliError::Usage)?,
        None => model::clock::system_millis(),
    };
    let reports = explain_events(set, events, before.as_ref(), end_user.as_ref(), now);
    print_reports(&reports, json);
    Ok(())
}

/// The bytes of an input file of `rules test`.
fn read_input(path: &Path) -> Result<Vec<u8>, CliError> {
    std::fs::read(path).map_err(|e| CliError::Usage(format!("cannot read {}: {e}", path.display())))
}

/// An input file of `rules test` as JSON of a `T` (`what`, for the error).
fn parse_input<T: DeserializeOwned>(path: &Path, what: &str) -> Result<T, CliError> {
    serde_json::from_slice(&read_input(path)?)
        .map_err(|e| CliError::Usage(format!("{}: not {what}: {e}", path.display())))
}

/// Every event folded into the state `before` (a new conversation when `None`) and explained.
fn explain_events(
    set: &RuleSet,
    events: Vec<Event>,
    before: Option<&ConversationState>,
    end_user: Option<&EndUserState>,
    now: Millis,
) -> Vec<Report> {
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
        let inputs = engine::decide::Inputs {
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
        reports.push((head, Some(explain::explain(set, &ev, &state, inputs, now))));
    }
    reports
}

/// The reports of `rules test`: one JSON array, or each heading with its verdicts as text.
fn print_reports(reports: &[Report], json: bool) {
    if json {
        let out: Vec<Value> = reports
            .iter()
            .map(|(head, verdicts)| serde_json::json!({"event": head, "rules": verdicts}))
            .collect();
        out!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
    } else {
        for (head, verdicts) in reports {
            out!("{head}");
            if let Some(verdicts) = verdicts {
                out_raw!("{}", explain::render_text(verdicts));
            }
        }
    }
}

/// One rule as `check` and `rules check` list it: priority, name, file, events, action types.
fn rule_line(rule: &engine::rules::Rule) -> String {
    format!(
        "{:>5}  {}{}  ({})  on {}  -> {}",
        rule.priority,
        rule.name,
        if rule.enabled { "" } else { " (disabled)" },
        rule.file,
        rule.on.join(","),
        rule.action_types().join(", ")
    )
}

/// The events of a file holding one event or a whole delivery.
fn events_of(bytes: &[u8]) -> Result<Vec<Event>, String> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    if value.get("messages").is_some() {
        let parsed = model::webhook::parse_delivery(bytes).map_err(|e| e.to_string())?;
        if let Some(bad) = parsed.invalid.first() {
            return Err(format!("invalid event in the delivery: {}", bad.reason));
        }
        return Ok(parsed.events.into_iter().map(|e| e.event).collect());
    }
    let raw =
        serde_json::value::RawValue::from_string(value.to_string()).map_err(|e| e.to_string())?;
    let event = model::webhook::validate_event(&raw).map_err(|e| e.to_string())?;
    Ok(vec![event.event])
}
