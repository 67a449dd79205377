//! What the templates show, made into text here (times, waits, JSON details), so the templates
//! hold markup only. Every value is escaped by the templates.

use model::webhook::model::Millis;
use serde_json::Value;

/// What every page's frame shows: who is signed in, and the token their forms send back.
pub struct Frame {
    pub name: String,
    pub role: &'static str,
    pub csrf: String,
    /// Whether action controls are shown (an operator); the server refuses a viewer regardless.
    pub can_act: bool,
    /// Which tab is open.
    pub tab: &'static str,
    /// A notice after a redirect (`?done=`), from a fixed list: never text from the request.
    pub notice: Option<&'static str>,
}

impl Frame {
    pub fn new(session: &super::Session, tab: &'static str, done: Option<&str>) -> Self {
        Frame {
            name: session.name.clone(),
            role: session.role.as_str(),
            csrf: session.csrf.clone(),
            can_act: session.role == super::Role::Operator,
            tab,
            notice: done.and_then(notice),
        }
    }
}

/// The notices an action's redirect may name.
fn notice(code: &str) -> Option<&'static str> {
    Some(match code {
        "accepted" => "Accepted: the conversation is yours.",
        "replied" => "Reply sent.",
        "released" => "Released to the bot.",
        "transferred" => "Transferred to the flow.",
        "retried" => "Dead letter retried: it is back in the outbox.",
        "retried_all" => "Matching dead letters retried.",
        "discarded" => "Dead letter discarded.",
        "asked" => "Asked of the active node, which has not answered yet: see the audit list.",
        "reprocessed" => "Quarantine record re-processed.",
        _ => return None,
    })
}

/// A time on the daemon's clock, as UTC text.
pub fn time(at: Millis) -> String {
    model::clock::format_iso_millis(at)
}

/// An optional time, or a dash.
pub fn time_or_dash(at: Option<Millis>) -> String {
    at.map_or_else(|| "-".to_owned(), time)
}

/// A duration in ms as `1h 2m`, `3m 4s` or `5s`.
pub fn wait(ms: Millis) -> String {
    let s = (ms / 1000).max(0);
    match (s / 3600, (s % 3600) / 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, min, sec) => format!("{min}m {sec}s"),
        (h, min, _) => format!("{h}h {min}m"),
    }
}

/// A JSON value as compact text (strings without their quotes); empty for null.
pub fn text(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_read_as_hours_minutes_and_seconds() {
        assert_eq!(wait(-5), "0s");
        assert_eq!(wait(59_999), "59s");
        assert_eq!(wait(61_000), "1m 1s");
        assert_eq!(wait(3_723_000), "1h 2m");
    }

    #[test]
    fn only_known_notices_are_shown() {
        assert!(notice("accepted").is_some());
        assert!(notice("<script>").is_none());
    }

    #[test]
    fn json_values_read_as_text() {
        assert_eq!(text(&Value::Null), "");
        assert_eq!(text(&serde_json::json!("a")), "a");
        assert_eq!(text(&serde_json::json!({"k": 1})), r#"{"k":1}"#);
    }
}
