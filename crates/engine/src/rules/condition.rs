//! Conditions: `all` / `any` / `not` over leaves that test one field of the rule context, or
//! whether a business-hours calendar is open.
//!
//! A condition is written as a table with exactly one of `all`, `any`, `not`, `field` (+ one
//! operator) or `business_hours`. It is parsed into [`RawCondition`] (every key optional, unknown
//! keys refused) and then compiled, so every mistake is reported with its place instead of serde's
//! guess at an untagged enum.

use super::calendar::{Calendar, Calendars};
use super::context;
use regex::Regex;
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;

/// A condition as written in a rule file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCondition {
    all: Option<Vec<RawCondition>>,
    any: Option<Vec<RawCondition>>,
    not: Option<Box<RawCondition>>,
    field: Option<String>,
    business_hours: Option<String>,
    equals: Option<Value>,
    not_equals: Option<Value>,
    #[serde(rename = "in")]
    one_of: Option<Vec<Value>>,
    contains: Option<Value>,
    starts_with: Option<String>,
    ends_with: Option<String>,
    matches: Option<String>,
    exists: Option<bool>,
    gt: Option<f64>,
    gte: Option<f64>,
    lt: Option<f64>,
    lte: Option<f64>,
    /// `true`, or `{ from = X, to = Y }` with either left out.
    changed: Option<Value>,
}

/// A compiled condition.
#[derive(Clone, Debug)]
pub enum Condition {
    All(Vec<Condition>),
    Any(Vec<Condition>),
    Not(Box<Condition>),
    Leaf {
        path: Vec<String>,
        op: Op,
    },
    /// A `state.*` field's value differs between the state before the event and after it (and
    /// was `from`, is `to`, when given). Its own variant, not an [`Op`]: it reads two values.
    Changed {
        path: Vec<String>,
        /// The same field in the before-state: `before.` + `path`.
        before: Vec<String>,
        from: Option<Value>,
        to: Option<Value>,
    },
    /// The calendar is open for the conversation's bot at the context's `now`.
    BusinessHours {
        name: String,
        calendar: Arc<Calendar>,
    },
}

#[derive(Clone, Debug)]
pub enum Op {
    Equals(Value),
    NotEquals(Value),
    In(Vec<Value>),
    /// Substring of a string, or element of an array.
    Contains(Value),
    StartsWith(String),
    EndsWith(String),
    Matches(Regex),
    Exists(bool),
    Gt(f64),
    Gte(f64),
    Lt(f64),
    Lte(f64),
}

impl RawCondition {
    /// Compile, reporting problems as `(key path, message)`; `at` is where this condition sits,
    /// `calendars` what `business_hours` may name.
    pub fn compile(
        &self,
        at: &str,
        calendars: &Calendars,
        problems: &mut Vec<(String, String)>,
    ) -> Option<Condition> {
        let shapes = [
            self.all.is_some(),
            self.any.is_some(),
            self.not.is_some(),
            self.field.is_some(),
            self.business_hours.is_some(),
        ];
        if shapes.iter().filter(|s| **s).count() != 1 {
            problems.push((
                at.to_owned(),
                "a condition needs exactly one of `all`, `any`, `not`, `field` or `business_hours`"
                    .into(),
            ));
            return None;
        }
        let list = |items: &[RawCondition], key: &str, problems: &mut Vec<(String, String)>| {
            if items.is_empty() {
                problems.push((format!("{at}.{key}"), "must not be empty".into()));
            }
            let compiled: Vec<Condition> = items
                .iter()
                .enumerate()
                .filter_map(|(i, c)| c.compile(&format!("{at}.{key}[{i}]"), calendars, problems))
                .collect();
            (compiled.len() == items.len()).then_some(compiled)
        };
        if self.field.is_none() && self.op_count() > 0 {
            problems.push((
                at.to_owned(),
                "an operator belongs to a `field` condition, not next to `all`, `any`, `not` or \
                 `business_hours`"
                    .into(),
            ));
            return None;
        }
        if let Some(items) = &self.all {
            return list(items, "all", problems).map(Condition::All);
        }
        if let Some(items) = &self.any {
            return list(items, "any", problems).map(Condition::Any);
        }
        if let Some(inner) = &self.not {
            return inner
                .compile(&format!("{at}.not"), calendars, problems)
                .map(|c| Condition::Not(Box::new(c)));
        }
        if let Some(name) = &self.business_hours {
            return match calendars.get(name) {
                Ok(calendar) => Some(Condition::BusinessHours {
                    name: name.clone(),
                    calendar,
                }),
                Err(message) => {
                    problems.push((format!("{at}.business_hours"), message));
                    None
                }
            };
        }
        let field = self.field.as_deref().unwrap_or_default();
        let path: Vec<String> = field.split('.').map(str::to_owned).collect();
        if path.iter().any(String::is_empty) || !context::ROOTS.contains(&path[0].as_str()) {
            problems.push((
                format!("{at}.field"),
                format!(
                    "`{field}` is not a field of the rule context (it starts with one of: {})",
                    context::ROOTS.join(", ")
                ),
            ));
            return None;
        }
        if let Some(change) = &self.changed {
            return self.changed(at, path, change, problems);
        }
        let op = self.op(at, problems)?;
        Some(Condition::Leaf { path, op })
    }

    /// A `changed` leaf: only on `state.*` fields (nothing else has a value before the event), as
    /// the only operator, and with a test that can hold.
    fn changed(
        &self,
        at: &str,
        path: Vec<String>,
        change: &Value,
        problems: &mut Vec<(String, String)>,
    ) -> Option<Condition> {
        let key = format!("{at}.changed");
        if self.op_count() > 1 {
            problems.push((
                at.to_owned(),
                "`changed` is the field's only operator here; combine tests with `all`".into(),
            ));
            return None;
        }
        if path.len() < 2 || path[0] != "state" {
            problems.push((
                key,
                format!(
                    "`changed` compares a `state.*` field before and after the event; `{}` has no \
                     value before it",
                    path.join(".")
                ),
            ));
            return None;
        }
        let (from, to) = match change {
            Value::Bool(true) => (None, None),
            Value::Object(map) if !map.is_empty() => {
                if let Some(other) = map.keys().find(|k| *k != "from" && *k != "to") {
                    problems.push((key, format!("unknown key `{other}` (use `from`, `to`)")));
                    return None;
                }
                (map.get("from").cloned(), map.get("to").cloned())
            }
            _ => {
                problems.push((
                    key,
                    format!(
                        "must be `true` (any change) or a table with `from`, `to` or both, not \
                         {change} (for \"did not change\", wrap it in `not`)"
                    ),
                ));
                return None;
            }
        };
        if let (Some(a), Some(b)) = (&from, &to) {
            if same(a, b) {
                problems.push((key, format!("never holds: `from` and `to` are both {a}")));
                return None;
            }
        }
        let mut before = vec!["before".to_owned()];
        before.extend(path.iter().cloned());
        Some(Condition::Changed {
            path,
            before,
            from,
            to,
        })
    }

    fn op_count(&self) -> usize {
        [
            self.equals.is_some(),
            self.not_equals.is_some(),
            self.one_of.is_some(),
            self.contains.is_some(),
            self.starts_with.is_some(),
            self.ends_with.is_some(),
            self.matches.is_some(),
            self.exists.is_some(),
            self.gt.is_some(),
            self.gte.is_some(),
            self.lt.is_some(),
            self.lte.is_some(),
            self.changed.is_some(),
        ]
        .iter()
        .filter(|set| **set)
        .count()
    }

    fn op(&self, at: &str, problems: &mut Vec<(String, String)>) -> Option<Op> {
        let mut ops = Vec::new();
        if let Some(v) = &self.equals {
            ops.push(Op::Equals(v.clone()));
        }
        if let Some(v) = &self.not_equals {
            ops.push(Op::NotEquals(v.clone()));
        }
        if let Some(v) = &self.one_of {
            ops.push(Op::In(v.clone()));
        }
        if let Some(v) = &self.contains {
            ops.push(Op::Contains(v.clone()));
        }
        if let Some(v) = &self.starts_with {
            ops.push(Op::StartsWith(v.clone()));
        }
        if let Some(v) = &self.ends_with {
            ops.push(Op::EndsWith(v.clone()));
        }
        if let Some(pattern) = &self.matches {
            match Regex::new(pattern) {
                Ok(re) => ops.push(Op::Matches(re)),
                Err(e) => {
                    problems.push((format!("{at}.matches"), format!("invalid regex: {e}")));
                    return None;
                }
            }
        }
        if let Some(v) = self.exists {
            ops.push(Op::Exists(v));
        }
        for (value, make) in [
            (self.gt, Op::Gt as fn(f64) -> Op),
            (self.gte, Op::Gte),
            (self.lt, Op::Lt),
            (self.lte, Op::Lte),
        ] {
            if let Some(v) = value {
                ops.push(make(v));
            }
        }
        if ops.len() != 1 {
            problems.push((
                at.to_owned(),
                format!(
                    "a `field` condition needs exactly one operator (equals, not_equals, in, \
                     contains, starts_with, ends_with, matches, exists, gt, gte, lt, lte, changed); found \
                     {}",
                    ops.len()
                ),
            ));
            return None;
        }
        ops.pop()
    }
}

impl RawCondition {
    /// A `matches` of exactly `"{{ settings.<name> }}"` takes the setting's pattern, here, at load
    /// (the regex is compiled and checked once, like a literal one), so operators change a
    /// keyword list in `[rules.settings]` without editing rules. Reports (key, message) for a
    /// setting that is missing or not text.
    pub fn resolve_settings(
        &mut self,
        at: &str,
        settings: &serde_json::Map<String, Value>,
        problems: &mut Vec<(String, String)>,
    ) {
        for (key, items) in [("all", &mut self.all), ("any", &mut self.any)] {
            for (i, item) in items.iter_mut().flatten().enumerate() {
                item.resolve_settings(&format!("{at}.{key}[{i}]"), settings, problems);
            }
        }
        if let Some(inner) = &mut self.not {
            inner.resolve_settings(&format!("{at}.not"), settings, problems);
        }
        let Some(name) = self.matches.as_deref().and_then(setting_reference) else {
            return;
        };
        match settings.get(name) {
            Some(Value::String(pattern)) => self.matches = Some(pattern.clone()),
            Some(_) => problems.push((
                format!("{at}.matches"),
                format!("setting `{name}` must be text (a regex)"),
            )),
            None => problems.push((format!("{at}.matches"), format!("no setting `{name}`"))),
        }
    }
}

/// The name in a value that is exactly `{{ settings.<name> }}`.
pub fn setting_reference(text: &str) -> Option<&str> {
    text.trim()
        .strip_prefix("{{")
        .and_then(|rest| rest.strip_suffix("}}"))
        .map(str::trim)
        .and_then(|inner| inner.strip_prefix("settings."))
        .map(str::trim)
}

impl Condition {
    /// Whether it reads the context's `root` (`before`, `end_user`...).
    pub fn reads(&self, root: &str) -> bool {
        match self {
            Condition::All(items) | Condition::Any(items) => items.iter().any(|c| c.reads(root)),
            Condition::Not(inner) => inner.reads(root),
            Condition::Leaf { path, .. } => path.first().is_some_and(|p| p == root),
            Condition::Changed { path, before, .. } => [path, before]
                .iter()
                .any(|p| p.first().is_some_and(|p| p == root)),
            Condition::BusinessHours { .. } => false,
        }
    }

    pub fn holds(&self, ctx: &Value) -> bool {
        match self {
            Condition::All(items) => items.iter().all(|c| c.holds(ctx)),
            Condition::Any(items) => items.iter().any(|c| c.holds(ctx)),
            Condition::Not(inner) => !inner.holds(ctx),
            Condition::Leaf { path, op } => op.holds(context::lookup(ctx, path)),
            Condition::Changed {
                path,
                before,
                from,
                to,
            } => {
                let was = present(context::lookup(ctx, before));
                let is = present(context::lookup(ctx, path));
                let differs = match (was, is) {
                    (Some(a), Some(b)) => !same(a, b),
                    (None, None) => false,
                    _ => true,
                };
                let matches = |want: &Option<Value>, value: Option<&Value>| match want {
                    None => true,
                    Some(want) => value.is_some_and(|v| same(v, want)),
                };
                differs && matches(from, was) && matches(to, is)
            }
            Condition::BusinessHours { calendar, .. } => {
                let bot_id = ctx.get("bot_id").and_then(Value::as_str);
                let now = ctx.get("now").and_then(Value::as_i64);
                now.is_some_and(|now| calendar.is_open(now, bot_id))
            }
        }
    }
}

/// A test of a condition and the value it saw: why a condition did not hold (`rules test`), or,
/// listed by [`Condition::held`], what made it hold (the audit).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Observation {
    /// Key path in the rule (`when.all[1]`).
    pub at: String,
    /// The test, as written (`state.phase in ["requested","connected"]`).
    pub test: String,
    /// The field's value (`None`: absent), or the clock for business hours.
    pub actual: Option<Value>,
    /// `changed` conditions: the field's value before the event (`null`: absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub before: Option<Value>,
}

impl Condition {
    /// The tests that made this condition hold on `ctx`, each with the value it saw (as a
    /// [`Observation`] records a failing one): every item of an `all`, the first branch of an `any`
    /// that holds, a `not` as a whole. Empty when it does not hold.
    pub fn held(&self, ctx: &Value, at: &str) -> Vec<Observation> {
        if !self.holds(ctx) {
            return Vec::new();
        }
        match self {
            Condition::All(items) => items
                .iter()
                .enumerate()
                .flat_map(|(i, c)| c.held(ctx, &format!("{at}.all[{i}]")))
                .collect(),
            Condition::Any(items) => items
                .iter()
                .enumerate()
                .find(|(_, c)| c.holds(ctx))
                .map(|(i, c)| c.held(ctx, &format!("{at}.any[{i}]")))
                .unwrap_or_default(),
            Condition::Not(inner) => {
                let actual = match inner.as_ref() {
                    Condition::Leaf { path, .. } => context::lookup(ctx, path).cloned(),
                    _ => None,
                };
                vec![Observation {
                    at: format!("{at}.not"),
                    test: self.describe(),
                    actual,
                    before: None,
                }]
            }
            // A leaf, `changed` or calendar holds: the same record as when it fails.
            _ => self.explain_leaf(ctx, at).into_iter().collect(),
        }
    }

    /// The first reason this condition fails on `ctx`, or `None` when it holds. For `any`, the
    /// first branch's reason (all of them failed).
    pub fn explain(&self, ctx: &Value, at: &str) -> Option<Observation> {
        if self.holds(ctx) {
            return None;
        }
        match self {
            Condition::All(items) => items
                .iter()
                .enumerate()
                .find_map(|(i, c)| c.explain(ctx, &format!("{at}.all[{i}]"))),
            Condition::Any(items) => items
                .first()
                .and_then(|c| c.explain(ctx, &format!("{at}.any[0]")))
                .map(|mut f| {
                    f.test = format!("{} (and every other `any` branch failed)", f.test);
                    f
                }),
            Condition::Not(inner) => Some(Observation {
                at: format!("{at}.not"),
                test: format!("not ({})", inner.describe()),
                actual: None,
                before: None,
            }),
            _ => self.explain_leaf(ctx, at),
        }
    }

    /// A leaf, `changed` or calendar condition with the value it tests (`None` for the others).
    fn explain_leaf(&self, ctx: &Value, at: &str) -> Option<Observation> {
        match self {
            Condition::All(_) | Condition::Any(_) | Condition::Not(_) => None,
            Condition::Leaf { path, .. } => Some(Observation {
                at: at.to_owned(),
                test: self.describe(),
                actual: context::lookup(ctx, path).cloned(),
                before: None,
            }),
            Condition::Changed { path, before, .. } => Some(Observation {
                at: at.to_owned(),
                test: self.describe(),
                actual: present(context::lookup(ctx, path)).cloned(),
                before: Some(
                    present(context::lookup(ctx, before))
                        .cloned()
                        .unwrap_or(Value::Null),
                ),
            }),
            Condition::BusinessHours { .. } => Some(Observation {
                at: at.to_owned(),
                test: self.describe(),
                actual: ctx.get("now").cloned(),
                before: None,
            }),
        }
    }

    /// The condition written out on one line.
    pub fn describe(&self) -> String {
        let join = |items: &[Condition], word: &str| {
            let parts: Vec<String> = items
                .iter()
                .map(|c| format!("({})", c.describe()))
                .collect();
            parts.join(&format!(" {word} "))
        };
        match self {
            Condition::All(items) => join(items, "and"),
            Condition::Any(items) => join(items, "or"),
            Condition::Not(inner) => format!("not ({})", inner.describe()),
            Condition::Leaf { path, op } => format!("{} {}", path.join("."), op.describe()),
            Condition::Changed { path, from, to, .. } => {
                let mut text = format!("{} changed", path.join("."));
                if let Some(from) = from {
                    text.push_str(&format!(" from {from}"));
                }
                if let Some(to) = to {
                    text.push_str(&format!(" to {to}"));
                }
                text
            }
            Condition::BusinessHours { name, .. } => format!("inside business hours `{name}`"),
        }
    }
}

impl Op {
    pub fn describe(&self) -> String {
        match self {
            Op::Equals(v) => format!("equals {v}"),
            Op::NotEquals(v) => format!("not_equals {v}"),
            Op::In(options) => format!("in {}", Value::Array(options.clone())),
            Op::Contains(v) => format!("contains {v}"),
            Op::StartsWith(p) => format!("starts_with {}", Value::String(p.clone())),
            Op::EndsWith(p) => format!("ends_with {}", Value::String(p.clone())),
            Op::Matches(re) => format!("matches {}", Value::String(re.as_str().to_owned())),
            Op::Exists(want) => format!("exists = {want}"),
            Op::Gt(n) => format!("gt {n}"),
            Op::Gte(n) => format!("gte {n}"),
            Op::Lt(n) => format!("lt {n}"),
            Op::Lte(n) => format!("lte {n}"),
        }
    }

    /// Whether no value can pass both tests (a contradiction in an `all`).
    pub fn contradicts(&self, other: &Op) -> bool {
        use Op::*;
        match (self, other) {
            (Equals(a), Equals(b)) => !same(a, b),
            (Equals(a), NotEquals(b)) | (NotEquals(b), Equals(a)) => same(a, b),
            (Equals(a), In(list)) | (In(list), Equals(a)) => !list.iter().any(|o| same(a, o)),
            (In(x), In(y)) => !x.iter().any(|a| y.iter().any(|b| same(a, b))),
            (Exists(a), Exists(b)) => a != b,
            // A field that must be absent passes no value test.
            (Exists(false), op) | (op, Exists(false)) => !matches!(op, NotEquals(_)),
            (Gt(a) | Gte(a), Lt(b) | Lte(b)) | (Lt(b) | Lte(b), Gt(a) | Gte(a)) => {
                let strict = matches!(self, Gt(_) | Lt(_)) || matches!(other, Gt(_) | Lt(_));
                if strict {
                    a >= b
                } else {
                    a > b
                }
            }
            (Equals(v), Gt(n)) | (Gt(n), Equals(v)) => v.as_f64().is_some_and(|x| x <= *n),
            (Equals(v), Lt(n)) | (Lt(n), Equals(v)) => v.as_f64().is_some_and(|x| x >= *n),
            _ => false,
        }
    }

    /// A missing field (or `null`) fails every test except `exists = false` and `not_equals`.
    fn holds(&self, value: Option<&Value>) -> bool {
        let value = value.filter(|v| !v.is_null());
        match self {
            Op::Exists(want) => value.is_some() == *want,
            Op::NotEquals(other) => !matches!(value, Some(v) if same(v, other)),
            _ => value.is_some_and(|v| self.test(v)),
        }
    }

    fn test(&self, v: &Value) -> bool {
        match self {
            Op::Equals(other) => same(v, other),
            Op::In(options) => options.iter().any(|o| same(v, o)),
            Op::Contains(needle) => match (v, needle) {
                (Value::String(s), Value::String(n)) => s.contains(n.as_str()),
                (Value::Array(items), n) => items.iter().any(|i| same(i, n)),
                _ => false,
            },
            Op::StartsWith(p) => v.as_str().is_some_and(|s| s.starts_with(p.as_str())),
            Op::EndsWith(p) => v.as_str().is_some_and(|s| s.ends_with(p.as_str())),
            Op::Matches(re) => v.as_str().is_some_and(|s| re.is_match(s)),
            Op::Gt(n) => v.as_f64().is_some_and(|x| x > *n),
            Op::Gte(n) => v.as_f64().is_some_and(|x| x >= *n),
            Op::Lt(n) => v.as_f64().is_some_and(|x| x < *n),
            Op::Lte(n) => v.as_f64().is_some_and(|x| x <= *n),
            Op::Exists(_) | Op::NotEquals(_) => false,
        }
    }
}

/// A value that is there: absent and `null` are alike (as for every other test).
fn present(value: Option<&Value>) -> Option<&Value> {
    value.filter(|v| !v.is_null())
}

/// Equality that treats `1` and `1.0` alike (TOML integers meet JSON numbers).
fn same(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}
