//! `check` (the configuration and its rules) and `rules check|test` (tools for rule authors).

use super::{load, load_with, CliError, ConfigArgs, RulesCommand};
use engine::rules::{explain, RuleSet};
use engine::state::{ConversationState, EndUserState};
use explain::EventReport;
use handoff_bridge::config::Overrides;
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::path::{Path, PathBuf};

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
    let events = model::webhook::events_of(&read_input(inputs.event)?)
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
    let reports = explain::explain_events(set, events, before.as_ref(), end_user.as_ref(), now);
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

/// The reports of `rules test`: one JSON array, or each heading with its verdicts as text.
fn print_reports(reports: &[EventReport], json: bool) {
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
