//! Read-only views shared by the admin API and the offline CLI, so both print the same JSON.

use crate::store::{Store, StoreError};
use serde_json::{json, Value};

/// An end user by messenger identity, with their newest conversation's state.
pub fn find_end_user(
    store: &Store,
    platform: &str,
    user_key: &str,
) -> Result<Option<Value>, StoreError> {
    let Some(user) = store.find_end_user(platform, user_key)? else {
        return Ok(None);
    };
    let last = match &user.last_conversation_id.value {
        Some(id) => store.conversation(id)?,
        None => None,
    };
    Ok(Some(json!({ "endUser": user, "lastConversation": last })))
}

/// The most of a body [`quarantine_view`] shows; `GET /admin/v1/quarantine/{id}/body` returns
/// the whole of it.
pub const QUARANTINE_VIEW_BODY: usize = 1024 * 1024;

/// A quarantine record with its body (at most [`QUARANTINE_VIEW_BODY`] bytes of it:
/// `body_truncated` says whether that is all, `body_bytes` is its whole size), also shown as text
/// when it is UTF-8. `body_base64` is the body as received, also when the store keeps it
/// compressed.
pub fn quarantine_view(record: &crate::store::QuarantineRecord) -> Value {
    use base64::Engine as _;
    let total = record.body_len();
    let body = record.body_prefix(QUARANTINE_VIEW_BODY).ok();
    let mut v = serde_json::to_value(record).unwrap_or(Value::Null);
    if let Some(obj) = v.as_object_mut() {
        obj.remove("body_gzip");
        obj.insert("body_bytes".into(), json!(total));
        let shown = body.as_ref().map_or(0, Vec::len) as u64;
        obj.insert("body_truncated".into(), json!(shown < total));
        if let Some(body) = &body {
            let b64 = base64::engine::general_purpose::STANDARD.encode(body);
            obj.insert("body_base64".into(), Value::String(b64));
        }
        if let Some(text) = body.and_then(utf8_prefix) {
            obj.insert("body_text".into(), Value::String(text));
        }
    }
    v
}

/// The bytes as text when they are UTF-8, but for a character the cut split at their end.
fn utf8_prefix(bytes: Vec<u8>) -> Option<String> {
    match String::from_utf8(bytes) {
        Ok(text) => Some(text),
        Err(e) if e.utf8_error().error_len().is_none() => {
            let valid = e.utf8_error().valid_up_to();
            let mut bytes = e.into_bytes();
            bytes.truncate(valid);
            String::from_utf8(bytes).ok()
        }
        Err(_) => None,
    }
}

/// Records in a quarantine list page by default, and at most.
pub const QUARANTINE_PAGE: usize = 100;
pub const QUARANTINE_PAGE_MAX: usize = 1000;

/// One page of the quarantine list: at most `limit` records (clamped to
/// 1..=[`QUARANTINE_PAGE_MAX`]) after id `after`, metadata only, as
/// `{"records": [...], "next_after": id}` (`next_after` only when more remain).
pub fn quarantine_list(
    store: &Store,
    after: Option<u64>,
    limit: usize,
) -> Result<Value, StoreError> {
    let (records, next) = store.quarantine_page(after, limit.clamp(1, QUARANTINE_PAGE_MAX))?;
    let mut page = json!({ "records": records });
    if let (Some(next), Some(obj)) = (next, page.as_object_mut()) {
        obj.insert("next_after".into(), json!(next));
    }
    Ok(page)
}

/// Entries in an outbox or dead-letter list page by default, and at most.
pub const OUTBOX_PAGE: usize = 100;
pub const OUTBOX_PAGE_MAX: usize = 1000;

/// Why a list page's query was refused (the admin API answers 400 with [`PageError::code`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    #[error("limit must be a whole number from 1 to {OUTBOX_PAGE_MAX}, not `{0}`")]
    Limit(String),
    #[error("after must be an entry's seq (a page's `next`), not `{0}`")]
    Cursor(String),
}

impl PageError {
    pub fn code(&self) -> &'static str {
        match self {
            PageError::Limit(_) => "invalid_limit",
            PageError::Cursor(_) => "invalid_cursor",
        }
    }
}

/// A list page's position: `limit` (default [`OUTBOX_PAGE`], 1..=[`OUTBOX_PAGE_MAX`]) entries
/// after seq `after` (the previous page's `next`; from the first when absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Page {
    pub after: Option<u64>,
    pub limit: usize,
}

impl Page {
    /// From the query's text values, as given (absent: the default).
    pub fn parse(limit: Option<&str>, after: Option<&str>) -> Result<Page, PageError> {
        let limit = match limit.map(str::trim) {
            None => OUTBOX_PAGE,
            Some(text) => text
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=OUTBOX_PAGE_MAX).contains(n))
                .ok_or_else(|| PageError::Limit(text.chars().take(40).collect()))?,
        };
        let after = match after.map(str::trim) {
            None => None,
            Some(text) => Some(
                text.parse::<u64>()
                    .map_err(|_| PageError::Cursor(text.chars().take(40).collect()))?,
            ),
        };
        Ok(Page { after, limit })
    }

    pub fn first(limit: usize) -> Page {
        Page { after: None, limit }
    }

    /// The same size of page, after `seq`.
    pub fn after(self, seq: u64) -> Page {
        Page {
            after: Some(seq),
            ..self
        }
    }
}

/// Read one more than the page holds: the extra one only says another page follows, and the
/// cursor to it is the page's last seq.
fn paged<T>(
    page: Page,
    read: impl FnOnce(Option<u64>, usize) -> Result<Vec<T>, StoreError>,
    seq: impl Fn(&T) -> u64,
) -> Result<(Vec<T>, Option<u64>), StoreError> {
    let limit = page.limit.clamp(1, OUTBOX_PAGE_MAX);
    let mut items = read(page.after, limit + 1)?;
    let next = if items.len() > limit {
        items.truncate(limit);
        items.last().map(&seq)
    } else {
        None
    };
    Ok((items, next))
}

/// One page of the pending outbox entries, in decision order: `{"entries": [...], "next": seq
/// or null}`. The caller adds what the executor knows (`depth`, `paused`).
pub fn outbox_list(store: &Store, page: Page) -> Result<Value, StoreError> {
    let (entries, next) = paged(page, |a, l| store.outbox_page(a, l), |e| e.seq)?;
    Ok(json!({ "count": entries.len(), "entries": entries, "next": next }))
}

/// One page of the dead letters, oldest decision first: `{"count": n in this page,
/// "dead_letters": [...], "next": seq or null}`.
pub fn dead_letters_list(store: &Store, page: Page) -> Result<Value, StoreError> {
    let (letters, next) = paged(page, |a, l| store.dead_letters_page(a, l), |l| l.entry.seq)?;
    Ok(json!({ "count": letters.len(), "dead_letters": letters, "next": next }))
}

/// A conversation's timeline, to answer "why did the bot (not) do that?": each stored event in
/// order, rebuilt through the fold's own path (`fold_and_decide`, as a replay does: with the rules
/// in force, on the state rebuilt from the conversation's events, with its end user as stored now,
/// at the event's receive time), so a rule its firing cap held back shows as capped, a timer
/// firing whose timer was cancelled or restarted decides nothing (`stale_timer`), a message the
/// other path (webhook or backfill) brought first decides nothing (`duplicate_message`, its
/// `MESSAGE.id`), a backfilled event says so (`source: backfill`), and the echo of the bridge's
/// own message shows as one (`echo_of`). Each rule that listens to the event: matched
/// (with the tests of its `when` that held and the values they saw, and the actions it decides),
/// capped, or not (the first condition that failed with its value, or the rule whose `stop` ended
/// the event). Then every action recorded for the event with its outcome (done, dropped, dead
/// letter, pending, and `template_error` for an action whose template failed when the fold
/// decided it) and the rule-set version that decided it. Events older than the event retention
/// are gone from the timeline.
pub fn audit(
    store: &Store,
    rules: &dyn crate::actions::Decide,
    conversation: &crate::ids::ConversationId,
) -> Result<Option<Value>, StoreError> {
    use crate::rules::explain::{self, Verdict};
    let Some(current) = store.conversation(conversation)? else {
        return Ok(None);
    };
    let partition = crate::ids::PartitionKey::Conversation(conversation.clone()).encode();
    let mut records = Vec::new();
    store.scan_events(|record, pending| {
        if record.partition == partition {
            records.push((record, pending));
        }
        std::ops::ControlFlow::Continue(())
    })?;
    // What was recorded for each event: finished, dead, pending, failed templates.
    let mut recorded: std::collections::HashMap<String, Vec<Value>> = Default::default();
    let mut add = |entry: &crate::actions::OutboxEntry, status: &str, extra: Value| {
        let mut item = json!({
            "seq": entry.seq,
            "id": entry.id,
            "rule": entry.rule,
            "type": entry.action.name(),
            "rules_version": entry.rules_version,
            "status": status,
        });
        if let (Some(obj), Value::Object(more)) = (item.as_object_mut(), extra) {
            obj.extend(more);
        }
        recorded
            .entry(entry.event_id.as_str().to_owned())
            .or_default()
            .push(item);
    };
    for done in store.finished(usize::MAX)? {
        let extra = json!({"at": done.at, "attempts": done.attempts, "note": done.note});
        add(&done.entry, &done.outcome, extra);
    }
    for dead in store.dead_letters()? {
        let extra =
            json!({"at": dead.last_attempt_at, "attempts": dead.attempts, "reason": dead.reason});
        add(&dead.entry, "dead_letter", extra);
    }
    for entry in store.outbox()? {
        add(&entry, "pending", json!({}));
    }
    // Never queued, so without a seq: listed after the event's queued actions.
    for failed in &current.template_errors {
        recorded
            .entry(failed.event.clone())
            .or_default()
            .push(json!({
                "id": failed.id,
                "rule": failed.rule,
                "index": failed.index,
                "type": failed.kind,
                "status": "template_error",
                "error": failed.error,
                "at": failed.at,
            }));
    }
    let set = rules.rule_set();
    let mut state = crate::state::ConversationState::new(conversation.clone());
    let mut timeline = Vec::with_capacity(records.len());
    let mut end_user = None;
    for (record, pending) in records {
        let mut item = json!({
            "received_at": record.received_at,
            "event_id": record.id.as_str(),
            "type": record.kind,
            "pending": pending,
        });
        if let Ok(event) = crate::webhook::parse_event(record.event.get()) {
            if let crate::webhook::model::Payload::Message(m) = &event.payload {
                item["sender"] = json!(m.sender());
                item["message_type"] = json!(m.data.kind.as_str());
            }
            if let Some(of) = crate::actions::echo::echo_of(&event) {
                item["echo_of"] = json!(of);
            }
            // The end user as stored now (read once, when the conversation first names them).
            let named = match &event.payload {
                crate::webhook::model::Payload::Conversation(c) => c.end_user_id.clone(),
                _ => None,
            };
            if let (None, Some(id)) = (&end_user, named.or_else(|| state.end_user_id.clone())) {
                end_user = Some(store.end_user(&id)?);
            }
            let user = end_user.as_ref().and_then(Option::as_ref);
            // The state the rules see (after the fold, before their firings are recorded), for
            // the explanation; the decision itself comes from the fold's path below.
            let before = state.clone();
            let mut folded = state.clone();
            let decides = folded.apply(&event);
            let time = crate::actions::DecisionTime::at(record.received_at);
            let decided =
                crate::store::fold_and_decide(&mut state, &event, rules, user, time, &mut |_| {
                    Ok(None)
                })?;
            if crate::webhook::is_backfilled(&event) {
                item["source"] = json!(crate::webhook::BACKFILL_SOURCE);
            }
            if !decides {
                match &event.payload {
                    // The same message came by the other path (webhook or backfill) first.
                    crate::webhook::model::Payload::Message(m) => {
                        item["duplicate_message"] = json!(m.id);
                    }
                    _ => item["stale_timer"] = json!(true),
                }
            }
            if let (Some(set), true) = (set, decides) {
                let inputs = crate::actions::Inputs {
                    before: Some(&before),
                    end_user: user,
                    queue: None,
                };
                let at = record.received_at;
                let verdicts = explain::explain(set, &event, &folded, inputs, at);
                let mut held = explain::conditions_held(set, &event, &folded, inputs, at);
                let shown: Vec<Value> = verdicts
                    .iter()
                    .filter(|v| !matches!(v.verdict, Verdict::NotListening | Verdict::Disabled))
                    .map(|v| rule_view(v, &decided, held.remove(&v.rule)))
                    .collect();
                item["rules"] = Value::Array(shown);
            }
            // Rebuild as the fold did: internal actions shape the state for later events.
            for decision in &decided.decisions {
                let id = crate::actions::action_id(&event.id, &decision.rule, decision.index);
                decision
                    .action
                    .apply_to_state(&mut state, record.received_at, &id);
            }
        }
        let mut actions = recorded.remove(record.id.as_str()).unwrap_or_default();
        // In decision order (outbox position), whatever became of them.
        actions.sort_by_key(|a| a["seq"].as_u64().unwrap_or(u64::MAX));
        item["actions"] = Value::Array(actions);
        timeline.push(item);
    }
    Ok(Some(json!({
        "conversation_id": conversation.as_str(),
        "rules_version": rules.version(),
        "note": "rules are re-evaluated with the rules in force now; each action shows the version that decided it",
        "timers": current.timers,
        "labels": current.labels,
        "phase": current.handoff.phase.value,
        "timeline": timeline,
    })))
}

/// One rule's line in the audit: what the fold decided (fired or capped) wins over the
/// explanation, which supplies the reasons.
fn rule_view(
    v: &crate::rules::explain::RuleVerdict,
    decided: &crate::actions::Decided,
    held: Option<Vec<crate::rules::condition::Failure>>,
) -> Value {
    use crate::rules::explain::Verdict;
    if let Some(hit) = decided.capped.iter().find(|c| c.rule == v.rule) {
        return json!({
            "rule": v.rule,
            "matched": true,
            "capped": true,
            "fired": hit.fired,
            "cap": {"count": hit.cap.count, "per": humantime::format_duration(hit.cap.per).to_string()},
            "conditions": held.unwrap_or_default(),
        });
    }
    if decided.fired.iter().any(|f| f.rule == v.rule) {
        let mut actions: Vec<(usize, Value)> = decided
            .decisions
            .iter()
            .filter(|d| d.rule == v.rule)
            .map(|d| (d.index, json!(d.action.name())))
            .collect();
        actions.extend(
            decided
                .failed
                .iter()
                .filter(|f| f.rule == v.rule)
                .map(|f| (f.index, json!({"type": f.kind, "template_error": f.error}))),
        );
        actions.sort_by_key(|(index, _)| *index);
        return json!({
            "rule": v.rule,
            "matched": true,
            "conditions": held.unwrap_or_default(),
            "actions": actions.into_iter().map(|(_, a)| a).collect::<Vec<_>>(),
        });
    }
    match &v.verdict {
        Verdict::NoMatch { failure } => json!({
            "rule": v.rule, "matched": false, "failed": failure,
        }),
        Verdict::Stopped { by } => json!({
            "rule": v.rule, "matched": false, "stopped_by": by,
        }),
        Verdict::Echo { of } => json!({
            "rule": v.rule, "matched": false, "echo_of": of,
        }),
        _ => json!({"rule": v.rule, "matched": false}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_query_is_a_limit_from_1_to_1000_and_a_seq_cursor() {
        let page = |l: Option<&str>, a: Option<&str>| Page::parse(l, a);
        assert_eq!(page(None, None), Ok(Page::first(OUTBOX_PAGE)));
        assert_eq!(
            page(Some("1000"), Some("42")),
            Ok(Page::first(1000).after(42))
        );
        assert_eq!(page(Some(" 7 "), None), Ok(Page::first(7)));
        for bad in ["0", "1001", "-1", "ten", "", "1e3"] {
            let e = page(Some(bad), None).expect_err(bad);
            assert_eq!(e.code(), "invalid_limit", "{bad}");
        }
        for bad in ["-1", "x", "", "18446744073709551616"] {
            let e = page(None, Some(bad)).expect_err(bad);
            assert_eq!(e.code(), "invalid_cursor", "{bad}");
        }
        // What the caller sent is echoed, cut short: never a long string back.
        let long = "9".repeat(500);
        let e = page(Some(&long), None).expect_err("long");
        assert!(e.to_string().len() < 200, "{e}");
    }
}
