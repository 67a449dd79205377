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

/// A quarantine record with its body also shown as text when it is UTF-8.
pub fn quarantine_view(record: &crate::store::QuarantineRecord) -> Value {
    let text = record.body().ok().and_then(|b| String::from_utf8(b).ok());
    let mut v = serde_json::to_value(record).unwrap_or(Value::Null);
    if let (Some(obj), Some(text)) = (v.as_object_mut(), text) {
        obj.insert("body_text".into(), Value::String(text));
    }
    v
}

/// Every quarantine record, each as [`quarantine_view`] shows it.
pub fn quarantine_list(store: &Store) -> Result<Value, StoreError> {
    Ok(Value::Array(
        store.quarantined()?.iter().map(quarantine_view).collect(),
    ))
}

/// A conversation's timeline, to answer "why did the bot (not) do that?": each stored event in
/// order, the rules re-evaluated for it (with the rules in force, on the state rebuilt from the
/// conversation's events, with its end user as stored now, at the event's receive time: which matched, and for the others the
/// first condition that failed with the value it saw), and every action recorded for it with its
/// outcome (done, dropped, dead letter, pending) and the rule-set version that decided it.
/// Events older than the event retention are gone from the timeline.
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
    // What was recorded for each event: finished, dead, pending.
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
            let before = state.clone();
            state.apply(&event);
            // The end user as stored now (read once, when the conversation first names them).
            if let (None, Some(id)) = (&end_user, &state.end_user_id) {
                end_user = Some(store.end_user(id)?);
            }
            if let Some(set) = set {
                let inputs = crate::actions::Inputs {
                    before: Some(&before),
                    end_user: end_user.as_ref().and_then(Option::as_ref),
                    queue: None,
                };
                let verdicts = explain::explain(set, &event, &state, inputs, record.received_at);
                let shown: Vec<Value> = verdicts
                    .iter()
                    .filter(|v| !matches!(v.verdict, Verdict::NotListening | Verdict::Disabled))
                    .map(|v| match &v.verdict {
                        Verdict::Matched { actions, .. } => json!({
                            "rule": v.rule,
                            "matched": true,
                            "actions": actions.iter().map(|a| match a {
                                Ok(a) => json!(a.name()),
                                Err(e) => json!({"skipped": e}),
                            }).collect::<Vec<_>>(),
                        }),
                        Verdict::NoMatch { failure } => json!({
                            "rule": v.rule, "matched": false, "failed": failure,
                        }),
                        Verdict::Stopped { by } => json!({
                            "rule": v.rule, "matched": false, "stopped_by": by,
                        }),
                        _ => json!({"rule": v.rule}),
                    })
                    .collect();
                item["rules"] = Value::Array(shown);
                // Rebuild as the fold did: internal actions shape the state for later events.
                use crate::actions::Decide as _;
                let time = crate::actions::DecisionTime::at(record.received_at);
                for decision in set.evaluate(&event, &state, inputs, time).decisions {
                    let id = crate::actions::action_id(&event.id, &decision.rule, decision.index);
                    decision
                        .action
                        .apply_to_state(&mut state, record.received_at, &id);
                }
            }
        }
        let mut actions = recorded.remove(record.id.as_str()).unwrap_or_default();
        // In decision order (outbox position), whatever became of them.
        actions.sort_by_key(|a| a["seq"].as_u64());
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
