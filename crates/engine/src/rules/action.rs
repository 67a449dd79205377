//! Action specs: an [`Action`] as written in a rule file, with templated text and the
//! conversation's own ids filled in when the rule does not name them.
//!
//! A spec is kept as the JSON form of an `Action` (`type` plus its fields) so that every action
//! the outbox knows is available to rules without a second, parallel enum. Loading checks the
//! spec by building an `Action` from it with placeholder text; deciding renders the templates from
//! the rule context and builds the real one.

use super::context;
use minijinja::Environment;
use model::action::Action;
use model::webhook::model::is_timer_name;
use serde_json::{Map, Value};

/// Fields the engine fills from the context when a rule leaves them out.
const DEFAULTS: [(&str, &str, &[&str]); 4] = [
    (
        "conversation_id",
        "conversation_id",
        &[
            "set_manual",
            "navigate",
            "update_params",
            "send_message",
            "update_state",
            "start_timer",
            "cancel_timer",
            "notify_helpdesk",
        ],
    ),
    ("end_user_id", "end_user_id", &["send_to_end_user"]),
    // Only for a navigation by flow title (see `compile`): the bot whose flow list has it.
    ("bot_id", "bot_id", &["navigate"]),
    (
        "user_key",
        "user_key",
        &[
            "partner_update_conversation",
            "partner_block",
            "partner_unblock",
            "partner_remove_session",
            "partner_send_message",
        ],
    ),
];

/// Timer actions: their names and durations are literal and checked at load.
const TIMER_ACTIONS: [&str; 2] = ["start_timer", "cancel_timer"];

/// Problems found in an action, as (key, message).
type Problems = Vec<(String, String)>;

/// Renders the template of the given name.
type Renderer<'a> = &'a dyn Fn(&str) -> Result<String, String>;

/// What a templated field becomes: text, or (for the action fields that are not strings) the
/// number or boolean the rendered text spells, so `flow_id = "{{ settings.fallback_flow_id }}"`
/// works.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Rendered {
    Text,
    Integer,
    Bool,
}

impl Rendered {
    fn of(pointer: &str) -> Rendered {
        match pointer.rsplit('/').next() {
            Some("flow_id" | "node_id") => Rendered::Integer,
            Some("enabled") => Rendered::Bool,
            _ => Rendered::Text,
        }
    }

    /// The rendered text as the field's JSON value.
    fn value(self, text: String, field: &str) -> Result<Value, String> {
        let trimmed = text.trim();
        match self {
            Rendered::Text => Ok(Value::String(text)),
            Rendered::Integer => trimmed
                .parse::<i64>()
                .map(Value::from)
                .map_err(|_| format!("`{field}` rendered to something that is not a whole number")),
            Rendered::Bool => match trimmed {
                "true" => Ok(Value::Bool(true)),
                "false" => Ok(Value::Bool(false)),
                _ => Err(format!(
                    "`{field}` rendered to something other than true or false"
                )),
            },
        }
    }

    /// A placeholder of the right kind, for the load-time shape check.
    fn sample(self) -> Value {
        match self {
            Rendered::Text => Value::String("x".into()),
            Rendered::Integer => Value::from(1),
            Rendered::Bool => Value::Bool(true),
        }
    }
}

/// Actions whose `message` may be given as just `text = "..."`.
const TEXT_SHORTHAND: [&str; 3] = ["send_message", "send_to_end_user", "partner_send_message"];

#[derive(Debug)]
pub struct ActionSpec {
    kind: String,
    /// The action's JSON form; templated strings are replaced on render.
    body: Map<String, Value>,
    /// (JSON pointer of a templated string, template name in the environment, what it renders
    /// to).
    templates: Vec<(String, String, Rendered)>,
    /// Fields to fill from the context: (field, context key).
    defaults: Vec<(&'static str, &'static str)>,
    /// The context's top-level names its templates read (what their scope holds).
    roots: Vec<String>,
}

/// The rule context as templates read it, converted to minijinja's values one top-level name at
/// a time, the first time a rendered template names it, and kept for the event's other
/// templates. (Converting the whole context for each event that renders was two fifths of rule
/// evaluation's instructions: docs/benchmarks.md, "Session 47".) A template sees exactly what the
/// whole context would show it: the names it reads, with the same values. The settings, the
/// same for every event, come converted once with the rule set.
pub(super) struct TemplateView<'a> {
    ctx: &'a Value,
    converted: Vec<(String, minijinja::Value)>,
}

impl<'a> TemplateView<'a> {
    /// The view of `ctx`, whose `settings` are the rule set's, already converted (`settings`).
    pub fn new(ctx: &'a Value, settings: &minijinja::Value) -> Self {
        TemplateView {
            ctx,
            converted: vec![("settings".to_owned(), settings.clone())],
        }
    }

    /// The scope of a template that reads `roots`: those of them the context has.
    fn scope(&mut self, roots: &[String]) -> minijinja::Value {
        let mut scope = std::collections::BTreeMap::new();
        for root in roots {
            if let Some(value) = self.root(root) {
                scope.insert(root.clone(), value);
            }
        }
        minijinja::Value::from_object(scope)
    }

    fn root(&mut self, name: &str) -> Option<minijinja::Value> {
        if let Some((_, value)) = self.converted.iter().find(|(n, _)| n == name) {
            return Some(value.clone());
        }
        let value = minijinja::Value::from(minijinja::value::Serde(self.ctx.get(name)?));
        self.converted.push((name.to_owned(), value.clone()));
        Some(value)
    }
}

impl ActionSpec {
    /// Parse and check one action of a rule. Templates are added to `env` under names starting
    /// with `name`.
    pub fn compile(
        mut body: Map<String, Value>,
        name: &str,
        env: &mut Environment<'static>,
    ) -> Result<ActionSpec, Vec<(String, String)>> {
        let kind = action_kind(&body)?;
        check_kind(&kind, &body)?;
        expand_text_shorthand(&kind, &mut body);
        if kind == "navigate" && body.contains_key("flow_id") == body.contains_key("flow") {
            return Err(vec![(
                String::new(),
                "a `navigate` names its flow by id (`flow_id`) or by title (`flow`): exactly one \
                 of them"
                    .into(),
            )]);
        }
        let defaults = defaults_for(&kind, &body);
        let templates = add_templates(&body, name, env)?;
        let roots = template_roots(templates.iter().map(|(_, name, _)| name.as_str()), env);
        let spec = ActionSpec {
            kind,
            body,
            templates,
            defaults,
            roots,
        };
        spec.check_shape()?;
        Ok(spec)
    }

    /// The shape check: every templated text and default id becomes a placeholder. Keys the
    /// action does not have would be dropped silently by serde; they are reported instead.
    fn check_shape(&self) -> Result<(), Problems> {
        let sample = self.fill(None, |_| Ok(Value::String("x".into())), true);
        let built = match sample.map(|a| serde_json::to_value(a).unwrap_or(Value::Null)) {
            Ok(built) => built,
            Err(e) => return Err(vec![(String::new(), e)]),
        };
        let mut unknown = Vec::new();
        unknown_keys(&Value::Object(self.body.clone()), &built, "", &mut unknown);
        if unknown.is_empty() {
            Ok(())
        } else {
            Err(unknown
                .into_iter()
                .map(|key| (key, format!("not a field of a `{}` action", self.kind)))
                .collect())
        }
    }

    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The action for one event, from its rule context as `view` holds it (one view per event:
    /// what it converted serves the event's other templates).
    pub fn render(
        &self,
        env: &Environment<'static>,
        view: &mut TemplateView<'_>,
    ) -> Result<Action, String> {
        let scope = view.scope(&self.roots);
        let ctx = view.ctx;
        let render = |name: &str| {
            env.get_template(name)
                .and_then(|t| t.render(&scope))
                .map_err(|e| format!("template {name}: {e}"))
        };
        self.fill(
            Some(&render),
            |key| match context::lookup(ctx, &[key.to_owned()]) {
                Some(v) if !v.is_null() => Ok(v.clone()),
                _ => Err(format!(
                    "the rule names no `{key}` and the conversation has none"
                )),
            },
            false,
        )
    }

    /// Build the action: templates rendered by `render` (`None`: placeholders, for the load-time
    /// check), missing ids from `default`.
    fn fill(
        &self,
        render: Option<Renderer<'_>>,
        default: impl Fn(&str) -> Result<Value, String>,
        explain: bool,
    ) -> Result<Action, String> {
        let mut body = Value::Object(self.body.clone());
        for (pointer, name, rendered) in &self.templates {
            let value = match render {
                Some(render) => rendered.value(render(name)?, &pointer_to_key(pointer))?,
                None => rendered.sample(),
            };
            if let Some(slot) = body.pointer_mut(pointer) {
                *slot = value;
            }
        }
        if let Value::Object(map) = &mut body {
            for (field, key) in &self.defaults {
                map.insert((*field).to_owned(), default(key)?);
            }
        }
        // serde's message quotes the offending value, which after rendering may be a user's
        // text: it is only shown for the load-time check, where values are placeholders.
        serde_json::from_value::<Action>(body).map_err(|e| match explain {
            true => format!("invalid `{}` action: {e}", self.kind),
            false => format!(
                "invalid `{}` action: a rendered value does not fit its field",
                self.kind
            ),
        })
    }
}

/// The action's `type`, when it is one the outbox knows.
fn action_kind(body: &Map<String, Value>) -> Result<String, Problems> {
    match body.get("type").and_then(Value::as_str) {
        Some(k) if Action::NAMES.contains(&k) => Ok(k.to_owned()),
        Some(k) => Err(vec![(
            "type".into(),
            format!(
                "unknown action `{k}` (one of: {})",
                Action::NAMES.join(", ")
            ),
        )]),
        None => Err(vec![("type".into(), "missing action type".into())]),
    }
}

/// The checks of particular action types: timers' and help-desk events'.
fn check_kind(kind: &str, body: &Map<String, Value>) -> Result<(), Problems> {
    if TIMER_ACTIONS.contains(&kind) {
        let problems = check_timer(kind, body);
        if !problems.is_empty() {
            return Err(problems);
        }
    }
    if kind == "notify_helpdesk" {
        let problems = check_helpdesk(body);
        if !problems.is_empty() {
            return Err(problems);
        }
    }
    Ok(())
}

/// `text = "..."` becomes a text `message`, for the actions that take the shorthand.
fn expand_text_shorthand(kind: &str, body: &mut Map<String, Value>) {
    if TEXT_SHORTHAND.contains(&kind) && !body.contains_key("message") {
        if let Some(text) = body.remove("text") {
            body.insert(
                "message".into(),
                serde_json::json!({ "type": "text", "text": text }),
            );
        }
    }
}

/// The fields of a `kind` action to fill from the context: those it takes and `body` leaves out
/// (`bot_id` only for a navigation by flow title).
fn defaults_for(kind: &str, body: &Map<String, Value>) -> Vec<(&'static str, &'static str)> {
    let by_title = body.contains_key("flow");
    DEFAULTS
        .iter()
        .filter(|(field, _, kinds)| {
            kinds.contains(&kind) && !body.contains_key(*field) && (*field != "bot_id" || by_title)
        })
        .map(|(field, key, _)| (*field, *key))
        .collect()
}

/// Adds every templated string of `body` to `env` as `name` + its JSON pointer; every template
/// that does not parse is reported.
fn add_templates(
    body: &Map<String, Value>,
    name: &str,
    env: &mut Environment<'static>,
) -> Result<Vec<(String, String, Rendered)>, Problems> {
    let mut templates = Vec::new();
    let mut problems = Vec::new();
    let mut strings = Vec::new();
    collect_strings(&Value::Object(body.clone()), String::new(), &mut strings);
    for (pointer, text) in strings {
        if !is_template(&text) {
            continue;
        }
        let template = format!("{name}{pointer}");
        match env.add_template_owned(template.clone(), text) {
            Ok(()) => {
                let rendered = Rendered::of(&pointer);
                templates.push((pointer, template, rendered))
            }
            Err(e) => problems.push((pointer_to_key(&pointer), format!("template: {e}"))),
        }
    }
    if problems.is_empty() {
        Ok(templates)
    } else {
        Err(problems)
    }
}

/// The context's top-level names the templates named `templates` read, each once. (minijinja is
/// built without `multi_template`: no template brings in another, whose names would not be its
/// own.)
fn template_roots<'a>(
    templates: impl Iterator<Item = &'a str>,
    env: &Environment<'static>,
) -> Vec<String> {
    let mut roots = std::collections::BTreeSet::new();
    for name in templates {
        if let Ok(template) = env.get_template(name) {
            roots.extend(template.undeclared_variables(false));
        }
    }
    roots.into_iter().collect()
}

/// A timer action's own checks: a literal, well-formed `name`; for `start_timer` a literal
/// duration over zero in `after`; no `conversation_id` (a timer is its event's conversation's).
fn check_timer(kind: &str, body: &Map<String, Value>) -> Vec<(String, String)> {
    let mut problems = Vec::new();
    let mut report = |key: &str, message: String| problems.push((key.to_owned(), message));
    if body.contains_key("conversation_id") {
        report(
            "conversation_id",
            "a timer belongs to the conversation of the event that starts it; leave this out"
                .into(),
        );
    }
    match body.get("name") {
        None => report("name", "missing timer name".into()),
        Some(Value::String(name)) if is_template(name) => {
            report("name", "must be literal (no template)".into())
        }
        Some(Value::String(name)) if !is_timer_name(name) => report(
            "name",
            "must be non-empty and use only A-Z a-z 0-9 - _ (it is part of event ids)".into(),
        ),
        Some(Value::String(_)) => {}
        Some(_) => report("name", "must be a string".into()),
    }
    if kind != "start_timer" {
        return problems;
    }
    match body.get("after") {
        None => report("after", "missing duration (e.g. `5m`)".into()),
        Some(Value::String(after)) if is_template(after) => {
            report("after", "must be literal (no template)".into())
        }
        Some(Value::String(after)) => match humantime::parse_duration(after) {
            Ok(d) if d.is_zero() => report("after", "must be longer than zero".into()),
            Ok(_) => {}
            Err(e) => report(
                "after",
                format!("`{after}` is not a duration ({e}; e.g. `30s`, `5m`, `1h 30m`)"),
            ),
        },
        Some(_) => report("after", "must be a duration string (e.g. `5m`)".into()),
    }
    problems
}

/// A help-desk event's `kind` is literal and one the help desks know: a help desk routes on it,
/// so a typo must fail the load, not reach it (or be dead-lettered) later.
fn check_helpdesk(body: &Map<String, Value>) -> Vec<(String, String)> {
    use model::helpdesk::DeskEventKind;
    let problem = match body.get("kind") {
        None => format!("missing event kind (one of: {})", DeskEventKind::names()),
        Some(Value::String(kind)) if is_template(kind) => "must be literal (no template)".into(),
        Some(Value::String(kind)) if DeskEventKind::parse(kind).is_none() => format!(
            "unknown help-desk event kind `{kind}` (one of: {})",
            DeskEventKind::names()
        ),
        Some(Value::String(_)) => return Vec::new(),
        Some(_) => "must be a string".into(),
    };
    vec![("kind".into(), problem)]
}

fn is_template(text: &str) -> bool {
    text.contains("{{") || text.contains("{%")
}

/// Keys of `given` (recursively) that `built` (the action made from it) does not have.
fn unknown_keys(given: &Value, built: &Value, at: &str, out: &mut Vec<String>) {
    match (given, built) {
        (Value::Object(g), Value::Object(b)) => {
            for (key, value) in g {
                let path = if at.is_empty() {
                    key.clone()
                } else {
                    format!("{at}.{key}")
                };
                match b.get(key) {
                    Some(inner) => unknown_keys(value, inner, &path, out),
                    None => out.push(path),
                }
            }
        }
        (Value::Array(g), Value::Array(b)) => {
            for (i, (value, inner)) in g.iter().zip(b).enumerate() {
                unknown_keys(value, inner, &format!("{at}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// Every string in `value` with its JSON pointer.
fn collect_strings(value: &Value, pointer: String, out: &mut Vec<(String, String)>) {
    match value {
        Value::String(s) => out.push((pointer, s.clone())),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                collect_strings(item, format!("{pointer}/{i}"), out);
            }
        }
        Value::Object(map) => {
            for (k, v) in map {
                let escaped = k.replace('~', "~0").replace('/', "~1");
                collect_strings(v, format!("{pointer}/{escaped}"), out);
            }
        }
        _ => {}
    }
}

/// `/message/text` -> `message.text`, for error messages in the rule file's terms.
fn pointer_to_key(pointer: &str) -> String {
    pointer
        .trim_start_matches('/')
        .replace('/', ".")
        .replace("~1", "/")
        .replace("~0", "~")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever a template does with the context (a path, a root it tests for, a whole root
    /// sorted, a loop, a global), it renders the same through the view as from the whole context.
    #[test]
    fn a_template_renders_the_same_through_the_view_as_from_the_whole_context() {
        let ctx = serde_json::json!({
            "message": {"data": {"text": "hi", "n": 3}},
            "state": {"labels": ["a", "b"], "phase": null, "variables": {}},
            "queue": {"position": 2, "expected_wait": "5 minutes"},
            "settings": {"x": "y"},
        });
        let texts = [
            "{{ message.data.text }}",
            "{{ state.labels | join(',') }} {{ state.variables.none is defined }}",
            "{% if end_user is defined %}yes{% else %}no{% endif %}",
            "{{ queue | dictsort }} {{ state | length }}",
            "{% for l in state.labels %}{{ loop.index }}{{ l }}{% endfor %}",
            "{{ settings.x ~ message.data.n }} {{ state.phase is none }} {{ range(2) | list }}",
            "{% set m = message %}{{ m.data.text | upper }} {{ missing | default('none') }}",
        ];
        let mut env = Environment::new();
        for (i, text) in texts.iter().enumerate() {
            env.add_template_owned(format!("t{i}"), (*text).to_owned())
                .expect("template");
        }
        let whole = minijinja::Value::from(minijinja::value::Serde(&ctx));
        let settings = minijinja::Value::from(minijinja::value::Serde(&ctx["settings"]));
        let mut view = TemplateView::new(&ctx, &settings);
        for (i, text) in texts.iter().enumerate() {
            let name = format!("t{i}");
            let template = env.get_template(&name).expect("added");
            let roots = template_roots(std::iter::once(name.as_str()), &env);
            let scoped = template.render(view.scope(&roots)).expect("renders");
            assert_eq!(scoped, template.render(&whole).expect("renders"), "{text}");
        }
        // Only the names read were converted, each once (the settings were given).
        let converted: Vec<&str> = view.converted.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(converted, ["settings", "message", "state", "queue"]);
    }
}
