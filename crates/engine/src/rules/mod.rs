//! The rule engine: TOML rule files compiled into a [`RuleSet`], which decides actions for an
//! event. Deciding is pure (event + conversation state + inputs + clock in, decisions out): the fold calls
//! it inside its transaction, and tests call it without a network or a store.
//!
//! The file format is documented in `rules/README.md`. Everything that can be checked is checked
//! when the files are loaded (unknown keys, event types, fields, operators, regexes, template
//! syntax, action shapes, calendars), and every problem is reported at once with its file and
//! place.

mod action;
mod calendar;
pub mod condition;
pub mod context;
pub mod explain;
pub mod live;
pub mod shipped;

pub use condition::Observation;

use crate::decide::{Capped, Decide, Decided, DecisionTime, Failed, Fired, Inputs};

use crate::state::{ConversationState, FiringCap};
use action::{ActionSpec, TemplateView};
use calendar::{Calendars, RawCalendar};
use condition::{Condition, RawCondition};
use minijinja::{Environment, UndefinedBehavior};
use model::action::Decision;
use model::webhook::model::{is_timer_name, Event, EventKind, Millis, TIMER_EVENT_PREFIX};
use serde::Deserialize;
use serde_json::{Map, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::Path;

/// Template work allowed per render, so a runaway loop in a template ends with an error.
const TEMPLATE_FUEL: u64 = 50_000;

/// The firing cap of a rule without `max_firings`: every rule has one, so a loop through the
/// service always ends. Above what one person's messages usually trigger; a rule that answers
/// every message of a busy conversation (a relay) sets its own.
pub const DEFAULT_MAX_FIRINGS: FiringCap = FiringCap {
    count: 20,
    per: std::time::Duration::from_secs(600),
};

/// The largest `max_firings.count`: the state keeps one timestamp per firing in the window.
pub const MAX_FIRINGS_COUNT: u32 = 1000;

/// One problem found while loading rule files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleError {
    pub file: String,
    /// The line (1-based) of the rule the problem is in, when it is in one.
    pub line: Option<usize>,
    /// Where in the file: `rule[2] (handoff).when.all[0].field`; empty for the whole file.
    pub at: String,
    pub message: String,
}

impl fmt::Display for RuleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{line}: ", self.file)?,
            None => write!(f, "{}: ", self.file)?,
        }
        if self.at.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.at, self.message)
        }
    }
}

/// Why rules could not be loaded: every problem found, or the directory itself.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read rule directory {dir}: {source}")]
    Dir { dir: String, source: std::io::Error },
    #[error("cannot read rule file {file}: {source}")]
    File {
        file: String,
        source: std::io::Error,
    },
    #[error("{} problem(s) in rule files:\n  - {}", .0.len(), .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  - "))]
    Invalid(Vec<RuleError>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    /// Spanned, so a problem in a rule can name the line the rule starts on.
    #[serde(default, rename = "rule")]
    rules: Vec<toml::Spanned<RawRule>>,
    /// Business-hours calendars by name; any file's rules may use any file's calendars.
    #[serde(default, rename = "calendar")]
    calendars: BTreeMap<String, RawCalendar>,
    /// Values rules read as `settings.<name>` (the places an operator adapts a rule set: flows,
    /// texts, switches); one file defines each, the configuration may override them.
    #[serde(default)]
    settings: Map<String, Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: String,
    #[serde(default)]
    description: String,
    #[serde(default = "yes")]
    enabled: bool,
    #[serde(default)]
    priority: i64,
    on: Vec<String>,
    when: Option<RawCondition>,
    #[serde(default)]
    actions: Vec<Map<String, Value>>,
    #[serde(default)]
    stop: bool,
    /// Run for the service's echoes of the bridge's own messages too.
    #[serde(default)]
    echoes: bool,
    max_firings: Option<RawCap>,
}

/// `max_firings = { count = 5, per = "10m" }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCap {
    count: i64,
    per: String,
}

impl RawCap {
    /// The cap, or every problem as (key, message).
    fn compile(&self) -> Result<FiringCap, Vec<(String, String)>> {
        let mut problems = Vec::new();
        let count = match u32::try_from(self.count) {
            Ok(n) if (1..=MAX_FIRINGS_COUNT).contains(&n) => Some(n),
            _ => {
                problems.push((
                    "max_firings.count".to_owned(),
                    format!("must be 1 to {MAX_FIRINGS_COUNT}, not {}", self.count),
                ));
                None
            }
        };
        let per = match humantime::parse_duration(&self.per) {
            Ok(d) if d.is_zero() => {
                problems.push(("max_firings.per".into(), "must be longer than zero".into()));
                None
            }
            Ok(d) => Some(d),
            Err(e) => {
                problems.push((
                    "max_firings.per".into(),
                    format!(
                        "`{}` is not a duration ({e}; e.g. `30s`, `10m`, `1h`)",
                        self.per
                    ),
                ));
                None
            }
        };
        match (count, per) {
            (Some(count), Some(per)) => Ok(FiringCap { count, per }),
            _ => Err(problems),
        }
    }
}

fn yes() -> bool {
    true
}

/// A compiled rule.
#[derive(Debug)]
pub struct Rule {
    pub name: String,
    pub description: String,
    pub enabled: bool,
    pub priority: i64,
    pub file: String,
    /// Event types it listens to; `*` is every webhook event of a conversation (timer events
    /// are named one by one: a `*` rule that starts a timer would otherwise wake itself forever).
    pub on: Vec<String>,
    pub stop: bool,
    /// It runs for echoes of the bridge's own messages too (`echoes = true`).
    pub echoes: bool,
    /// How often it may fire per conversation (`max_firings`, else [`DEFAULT_MAX_FIRINGS`]).
    pub max_firings: FiringCap,
    when: Option<Condition>,
    actions: Vec<ActionSpec>,
}

impl Rule {
    fn listens(&self, kind: &str) -> bool {
        // `*` is every webhook event: the bridge's own timer and agent events are named.
        let own = kind.starts_with(TIMER_EVENT_PREFIX)
            || kind.starts_with(model::webhook::agent::AGENT_EVENT_PREFIX)
            || kind.starts_with(model::webhook::drift::RECONCILE_EVENT_PREFIX);
        self.on.iter().any(|o| (o == "*" && !own) || o == kind)
    }

    /// Whether it reached its cap in `state` at `at` (the event's receive time): the firings in
    /// the window when it has.
    fn capped(&self, state: &ConversationState, at: Millis) -> Option<usize> {
        let fired = state.firings_within(&self.name, self.max_firings.per, at);
        let cap = usize::try_from(self.max_firings.count).unwrap_or(usize::MAX);
        (fired >= cap).then_some(fired)
    }

    /// The action types it may take, for listings.
    pub fn action_types(&self) -> Vec<&str> {
        self.actions.iter().map(ActionSpec::kind).collect()
    }
}

/// Every rule of the loaded files, in evaluation order.
pub struct RuleSet {
    rules: Vec<Rule>,
    env: Environment<'static>,
    version: String,
    /// `settings.*` of the rule context.
    settings: Value,
    /// The same, as templates read it (converted once, not for every event).
    settings_view: minijinja::Value,
    /// What its conditions and templates read besides the event and state.
    needs: crate::decide::Needs,
}

impl fmt::Debug for RuleSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RuleSet")
            .field("version", &self.version)
            .field("rules", &self.rules.len())
            .finish()
    }
}

impl RuleSet {
    /// Load every `*.toml` file of `dir` (not recursive), in file-name order.
    pub fn load_dir(dir: &Path) -> Result<RuleSet, LoadError> {
        RuleSet::from_sources(&read_dir(dir)?)
    }

    /// [`load_dir`](RuleSet::load_dir) with settings overrides (see
    /// [`from_sources_with`](RuleSet::from_sources_with)).
    pub fn load_dir_with(dir: &Path, overrides: &Map<String, Value>) -> Result<RuleSet, LoadError> {
        RuleSet::from_sources_with(&read_dir(dir)?, overrides)
    }

    /// The context rules see for an event: [`context::build_with`] plus the settings.
    fn context(
        &self,
        event: &Event,
        state: &ConversationState,
        inputs: Inputs<'_>,
        now: Millis,
    ) -> Value {
        let mut ctx = context::build_with(event, state, inputs, now);
        if let Value::Object(root) = &mut ctx {
            root.insert("settings".into(), self.settings.clone());
        }
        ctx
    }

    /// The settings in force (the files' values with the overrides applied).
    pub fn settings(&self) -> &Value {
        &self.settings
    }

    /// Compile rule files given as (file name, text), in the given order.
    pub fn from_sources(sources: &[(String, String)]) -> Result<RuleSet, LoadError> {
        RuleSet::from_sources_with(sources, &Map::new())
    }

    /// [`from_sources`](RuleSet::from_sources), with `overrides` replacing settings the files
    /// define (from the configuration's `rules.settings`; a name no file defines is an error).
    pub fn from_sources_with(
        sources: &[(String, String)],
        overrides: &Map<String, Value>,
    ) -> Result<RuleSet, LoadError> {
        let mut env = template_env();
        let mut problems = Vec::new();
        let parsed = parse_files(sources, &mut problems);
        // Calendars first: a rule may name one defined in a later file. Timers likewise.
        let calendars = compile_calendars(&parsed, &mut problems);
        let settings = merge_settings(&parsed, overrides, &mut problems);
        let timers = started_timers(&parsed);
        let known = Known {
            calendars: &calendars,
            timers: &timers,
            settings: &settings,
        };
        let mut rules = compile_rules(sources, parsed, known, &mut env, &mut problems);
        if !problems.is_empty() {
            return Err(LoadError::Invalid(problems));
        }
        // Stable: equal priorities keep file order, then position in the file.
        rules.sort_by_key(|r| std::cmp::Reverse(r.priority));
        let version = set_version(sources, overrides);
        let needs = needs_of(&rules, &env);
        let settings = Value::Object(settings);
        Ok(RuleSet {
            rules,
            env,
            version,
            settings_view: minijinja::Value::from(minijinja::value::Serde(&settings)),
            settings,
            needs,
        })
    }

    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// A short digest of the files, so logs and decisions can say which rules were in force.
    pub fn version(&self) -> &str {
        &self.version
    }
}

/// Every file parsed, in order; a file that is not a valid rule file is reported (with the line
/// of the problem) and left out.
fn parse_files<'a>(
    sources: &'a [(String, String)],
    problems: &mut Vec<RuleError>,
) -> Vec<(&'a String, RuleFile)> {
    let mut parsed = Vec::with_capacity(sources.len());
    for (file, text) in sources {
        match toml::from_str::<RuleFile>(text) {
            Ok(f) => parsed.push((file, f)),
            Err(e) => problems.push(RuleError {
                file: file.clone(),
                line: e.span().map(|span| line_of(text, span.start)),
                at: String::new(),
                message: e.to_string().trim_end().to_owned(),
            }),
        }
    }
    parsed
}

/// Every rule of the parsed files compiled, in file order; problems (and a name used twice,
/// reported where it is used again) go to `problems` with the rule's line and place.
fn compile_rules(
    sources: &[(String, String)],
    parsed: Vec<(&String, RuleFile)>,
    known: Known<'_>,
    env: &mut Environment<'static>,
    problems: &mut Vec<RuleError>,
) -> Vec<Rule> {
    let mut rules = Vec::new();
    let mut names = HashMap::new();
    for (file, parsed) in parsed {
        let text = sources
            .iter()
            .find(|(name, _)| name == file)
            .map_or("", |(_, text)| text.as_str());
        for (position, spanned) in parsed.rules.into_iter().enumerate() {
            let line = Some(line_of(text, spanned.span().start));
            let raw = spanned.into_inner();
            let at = format!("rule[{position}] ({})", raw.name);
            let mut report = |key: String, message: String| {
                let at = if key.is_empty() {
                    at.clone()
                } else {
                    format!("{at}.{key}")
                };
                problems.push(RuleError {
                    file: file.clone(),
                    line,
                    at,
                    message,
                });
            };
            if let Some(first) = names.insert(raw.name.clone(), file.clone()) {
                report(
                    "name".into(),
                    format!("`{}` is already the name of a rule in {first}", raw.name),
                );
            }
            if let Some(rule) = compile(raw, file, known, env, &mut report) {
                rules.push(rule);
            }
        }
    }
    rules
}

/// The set's version: the digest of the files, and of the settings overrides when there are any.
fn set_version(sources: &[(String, String)], overrides: &Map<String, Value>) -> String {
    if overrides.is_empty() {
        version_of(sources)
    } else {
        let mut with = sources.to_vec();
        with.push((
            "(rules.settings)".into(),
            Value::Object(overrides.clone()).to_string(),
        ));
        version_of(&with)
    }
}

/// What the rules' conditions and templates read besides the event and state.
fn needs_of(rules: &[Rule], env: &Environment<'static>) -> crate::decide::Needs {
    let reads = |root: &str| {
        let in_conditions = rules
            .iter()
            .filter_map(|r| r.when.as_ref())
            .any(|c| c.reads(root));
        let in_templates = env
            .templates()
            .any(|(_, t)| t.undeclared_variables(false).contains(root));
        in_conditions || in_templates
    };
    crate::decide::Needs {
        before: reads("before"),
        end_user: reads("end_user"),
        queue: reads("queue"),
    }
}

/// Every file's calendars; a name defined twice is reported where it is defined again.
fn compile_calendars(parsed: &[(&String, RuleFile)], problems: &mut Vec<RuleError>) -> Calendars {
    let mut calendars = Calendars::default();
    let mut defined_in = HashMap::new();
    for (file, parsed) in parsed {
        for (name, raw) in &parsed.calendars {
            let report = |key: &str, message: String| RuleError {
                file: (*file).clone(),
                line: None,
                at: if key.is_empty() {
                    format!("calendar.{name}")
                } else {
                    format!("calendar.{name}.{key}")
                },
                message,
            };
            if let Some(first) = defined_in.insert(name.clone(), *file) {
                problems.push(report(
                    "",
                    format!("`{name}` is already the name of a calendar in {first}"),
                ));
                continue;
            }
            match raw.compile() {
                Ok(calendar) => calendars.insert(name.clone(), Some(calendar)),
                Err(list) => {
                    problems.extend(list.into_iter().map(|(key, message)| report(&key, message)));
                    calendars.insert(name.clone(), None);
                }
            }
        }
    }
    calendars
}

/// A timer's `after` may name a setting, `"{{ settings.<name> }}"` (so an operator sets a cadence
/// without editing rules): replaced by the setting's value here, at load, since a due time must not
/// depend on the event. Any other template stays and is refused by the timer checks.
fn settings_after(
    body: &mut Map<String, Value>,
    settings: &Map<String, Value>,
) -> Result<(), String> {
    let Some(Value::String(after)) = body.get("after") else {
        return Ok(());
    };
    let Some(name) = condition::setting_reference(after) else {
        return Ok(());
    };
    match settings.get(name) {
        Some(Value::String(value)) => {
            let value = value.clone();
            body.insert("after".into(), Value::String(value));
            Ok(())
        }
        Some(_) => Err(format!(
            "setting `{name}` must be a duration string (e.g. `2m`)"
        )),
        None => Err(format!("no setting `{name}`")),
    }
}

/// The names of every timer some rule of the files starts (`on = ["timer.<name>"]` needs one).
fn started_timers(parsed: &[(&String, RuleFile)]) -> HashSet<String> {
    let starts = |action: &&Map<String, Value>| {
        action.get("type").and_then(Value::as_str) == Some("start_timer")
    };
    parsed
        .iter()
        .flat_map(|(_, file)| &file.rules)
        .flat_map(|rule| rule.get_ref().actions.iter().filter(starts))
        .filter_map(|action| action.get("name").and_then(Value::as_str))
        .map(str::to_owned)
        .collect()
}

/// What rules may refer to across files.
#[derive(Clone, Copy)]
struct Known<'a> {
    calendars: &'a Calendars,
    timers: &'a HashSet<String>,
    settings: &'a Map<String, Value>,
}

/// One rule compiled, or `None` when it has problems (every one of them reported, in the order
/// of its keys: name, on, when, max_firings, actions).
fn compile(
    raw: RawRule,
    file: &str,
    known: Known<'_>,
    env: &mut Environment<'static>,
    report: &mut impl FnMut(String, String),
) -> Option<Rule> {
    let mut ok = true;
    if !valid_rule_name(&raw.name) {
        report(
            "name".into(),
            "must be non-empty and use only A-Z a-z 0-9 - _ (it is part of action ids)".into(),
        );
        ok = false;
    }
    ok &= check_on(&raw.on, known.timers, report);
    let (when, when_ok) = compile_when(raw.when, known, report);
    let (max_firings, cap_ok) = compile_cap(raw.max_firings.as_ref(), report);
    let prefix = format!("{file}#{}", raw.name);
    let (actions, actions_ok) = compile_actions(raw.actions, &prefix, known.settings, env, report);
    (ok && when_ok && cap_ok && actions_ok).then_some(Rule {
        name: raw.name,
        description: raw.description,
        enabled: raw.enabled,
        priority: raw.priority,
        file: file.to_owned(),
        on: raw.on,
        stop: raw.stop,
        echoes: raw.echoes,
        max_firings,
        when,
        actions,
    })
}

/// A rule name is non-empty and uses only A-Z a-z 0-9 - _ (it is part of action ids).
fn valid_rule_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// Checks the event types of `on`, reporting each problem; whether there were none.
fn check_on(
    on: &[String],
    timers: &HashSet<String>,
    report: &mut impl FnMut(String, String),
) -> bool {
    let mut ok = true;
    if on.is_empty() {
        report("on".into(), "must name at least one event type".into());
        ok = false;
    }
    for (i, kind) in on.iter().enumerate() {
        if let Some(problem) = event_type_problem(kind, timers) {
            report(format!("on[{i}]"), problem);
            ok = false;
        }
    }
    ok
}

/// Why a rule cannot listen to event type `kind`, if it cannot.
fn event_type_problem(kind: &str, timers: &HashSet<String>) -> Option<String> {
    let webhook = EventKind::KNOWN.iter().find(|k| k.as_str() == kind);
    let timer = kind.strip_prefix(TIMER_EVENT_PREFIX);
    match (webhook, timer) {
        _ if kind == "*" => None,
        (None, Some(name)) if !is_timer_name(name) => Some(format!(
            "`{kind}`: a timer name is non-empty and uses only A-Z a-z 0-9 - _"
        )),
        (None, Some(name)) if !timers.contains(name) => Some(format!(
            "`{kind}` never fires: no rule starts a timer named `{name}`"
        )),
        (None, Some(_)) => None,
        (None, None) if model::webhook::agent::is_command_event(kind) => None,
        (None, None) if model::webhook::drift::is_reconcile_event(kind) => None,
        (None, None) => Some(format!(
            "`{kind}` is not a webhook event type (see docs/webhook-format or use \"*\"), \
             a timer (`timer.<name>`), an agent command (`agent.accept`...) nor \
             `reconcile.drift`"
        )),
        // Rules run for a conversation; bot and end-user events only change state.
        (Some(k), _) if !matches!(k.data_key(), Some("conversation" | "message")) => Some(format!(
            "`{kind}` never reaches rules: they run for conversation and message events"
        )),
        (Some(_), _) => None,
    }
}

/// The rule's `when` with settings resolved, compiled; each problem reported. Whether there were
/// none comes second.
fn compile_when(
    raw_when: Option<RawCondition>,
    known: Known<'_>,
    report: &mut impl FnMut(String, String),
) -> (Option<Condition>, bool) {
    let mut condition_problems = Vec::new();
    let mut raw_when = raw_when;
    if let Some(c) = &mut raw_when {
        c.resolve_settings("when", known.settings, &mut condition_problems);
    }
    let when = match condition_problems.is_empty() {
        true => raw_when
            .as_ref()
            .and_then(|c| c.compile("when", known.calendars, &mut condition_problems)),
        false => None,
    };
    let mut ok = true;
    for (key, message) in condition_problems {
        report(key, message);
        ok = false;
    }
    (when, ok)
}

/// The rule's firing cap ([`DEFAULT_MAX_FIRINGS`] without `max_firings` or when it has problems,
/// each reported); whether there were none comes second.
fn compile_cap(raw: Option<&RawCap>, report: &mut impl FnMut(String, String)) -> (FiringCap, bool) {
    match raw.map(RawCap::compile) {
        None => (DEFAULT_MAX_FIRINGS, true),
        Some(Ok(cap)) => (cap, true),
        Some(Err(list)) => {
            for (key, message) in list {
                report(key, message);
            }
            (DEFAULT_MAX_FIRINGS, false)
        }
    }
}

/// The rule's actions compiled, templates named after `prefix` (`<file>#<rule>`); each problem
/// reported as `actions[i]...`. Whether there were none comes second.
fn compile_actions(
    raw_actions: Vec<Map<String, Value>>,
    prefix: &str,
    settings: &Map<String, Value>,
    env: &mut Environment<'static>,
    report: &mut impl FnMut(String, String),
) -> (Vec<ActionSpec>, bool) {
    let mut ok = true;
    let mut actions = Vec::with_capacity(raw_actions.len());
    for (i, mut body) in raw_actions.into_iter().enumerate() {
        let name = format!("{prefix}.actions[{i}]");
        if let Err(message) = settings_after(&mut body, settings) {
            report(format!("actions[{i}].after"), message);
            ok = false;
            continue;
        }
        match ActionSpec::compile(body, &name, env) {
            Ok(spec) => actions.push(spec),
            Err(list) => {
                for (key, message) in list {
                    let key = if key.is_empty() {
                        format!("actions[{i}]")
                    } else {
                        format!("actions[{i}].{key}")
                    };
                    report(key, message);
                }
                ok = false;
            }
        }
    }
    (actions, ok)
}

/// The 1-based line of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()
        .iter()
        .take(offset)
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

/// Every file's settings, then the overrides; a name set by two files, or an override of a name no
/// file sets, is reported.
fn merge_settings(
    parsed: &[(&String, RuleFile)],
    overrides: &Map<String, Value>,
    problems: &mut Vec<RuleError>,
) -> Map<String, Value> {
    let mut settings = Map::new();
    let mut defined_in: HashMap<&str, &str> = HashMap::new();
    for (file, parsed) in parsed {
        for (name, value) in &parsed.settings {
            if let Some(first) = defined_in.insert(name, file) {
                problems.push(RuleError {
                    file: (*file).clone(),
                    line: None,
                    at: format!("settings.{name}"),
                    message: format!("`{name}` is already set in {first}"),
                });
                continue;
            }
            settings.insert(name.clone(), value.clone());
        }
    }
    for (name, value) in overrides {
        if settings.contains_key(name) {
            settings.insert(name.clone(), value.clone());
        } else {
            problems.push(RuleError {
                file: "(configuration)".into(),
                line: None,
                at: format!("rules.settings.{name}"),
                message: "no rule file defines this setting".into(),
            });
        }
    }
    settings
}

/// The `*.toml` files of `dir` (not recursive) as (file name, text), in file-name order.
pub fn read_dir(dir: &Path) -> Result<Vec<(String, String)>, LoadError> {
    let dir_error = |source| LoadError::Dir {
        dir: dir.display().to_string(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(dir_error)? {
        let path = entry.map_err(dir_error)?.path();
        if path.extension().is_some_and(|e| e == "toml") && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    let mut sources = Vec::with_capacity(files.len());
    for path in files {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let text = std::fs::read_to_string(&path).map_err(|source| LoadError::File {
            file: path.display().to_string(),
            source,
        })?;
        sources.push((name, text));
    }
    Ok(sources)
}

/// The version a rule set compiled from `sources` would have, without compiling it (so a watcher
/// can tell whether the files changed).
pub fn version_of_sources(sources: &[(String, String)]) -> String {
    version_of(sources)
}

/// Printing an undefined field is an error (a typo shows), testing one is not; fuel bounds loops.
fn template_env() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_undefined_behavior(UndefinedBehavior::SemiStrict);
    env.set_fuel(Some(TEMPLATE_FUEL));
    // Texts go to an API as JSON strings, never into HTML: no escaping, whatever the name.
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env
}

fn version_of(sources: &[(String, String)]) -> String {
    let mut hasher = crc32fast::Hasher::new();
    for (name, text) in sources {
        hasher.update(name.as_bytes());
        hasher.update(&[0]);
        hasher.update(text.as_bytes());
        hasher.update(&[0]);
    }
    format!("{:08x}", hasher.finalize())
}

impl Decide for RuleSet {
    /// In priority order, each enabled rule that listens to the event (and takes echoes, when the
    /// event is one) and whose `when` holds either fires, deciding its actions, or, having reached
    /// its cap, is held back. Either way its `stop` ends the event: a capped rule does not hand
    /// its events to the rules after it.
    fn needs(&self) -> crate::decide::Needs {
        self.needs
    }

    fn evaluate(
        &self,
        event: &Event,
        state: &ConversationState,
        inputs: Inputs<'_>,
        time: DecisionTime,
    ) -> Decided {
        let kind = event.kind.as_str();
        let echo = model::action::echo::echo_of(event).is_some();
        let ctx = std::cell::OnceCell::new();
        let mut view: Option<TemplateView<'_>> = None;
        let mut out = Decided::default();
        for rule in &self.rules {
            if !rule.enabled || !rule.listens(kind) || (echo && !rule.echoes) {
                continue;
            }
            let ctx = ctx.get_or_init(|| self.context(event, state, inputs, time.now));
            if rule.when.as_ref().is_some_and(|c| !c.holds(ctx)) {
                continue;
            }
            if let Some(fired) = rule.capped(state, time.received_at) {
                out.capped.push(Capped {
                    rule: rule.name.clone(),
                    cap: rule.max_firings,
                    fired,
                });
                if rule.stop {
                    break;
                }
                continue;
            }
            out.fired.push(Fired {
                rule: rule.name.clone(),
                cap: rule.max_firings,
            });
            let view = view.get_or_insert_with(|| TemplateView::new(ctx, &self.settings_view));
            for (index, spec) in rule.actions.iter().enumerate() {
                match spec.render(&self.env, view) {
                    Ok(action) => out.decisions.push(Decision {
                        rule: rule.name.clone(),
                        index,
                        action,
                    }),
                    // Not a panic and not a half-made action: the rest of the rule still runs,
                    // and the fold records the error where the audit shows it.
                    Err(error) => out.failed.push(Failed {
                        rule: rule.name.clone(),
                        index,
                        kind: spec.kind().to_owned(),
                        error,
                    }),
                }
            }
            if rule.stop {
                break;
            }
        }
        out
    }

    fn version(&self) -> &str {
        &self.version
    }
}

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_reconcile;
