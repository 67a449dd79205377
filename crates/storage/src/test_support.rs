//! What the store's tests, and the daemon's tests over a real store, share: a store in a
//! temporary directory, deliveries made from a few fields, and folding as the dispatcher would.
//! Built for tests only (and with the `test-support` feature).

use crate::port::*;
use crate::*;
use model::webhook::model::{Event, Millis};
use model::webhook::{parse_delivery, parse_event};

pub fn store() -> (tempfile::TempDir, SledStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SledStore::open(&dir.path().join("store"), 8 * 1024 * 1024).expect("open");
    (dir, store)
}

pub fn delivery(id: &str, events: &[(&str, &str, i64)]) -> Vec<u8> {
    let events: Vec<String> = events
        .iter()
        .map(|(eid, conv, at)| {
            format!(
                r#"{{"id":"{eid}","event":"bot.message.received","sourceType":"bot","sourceId":"B1","timestamp":{at},
                "data":{{"message":{{"id":"m{eid}","conversationId":"{conv}","isUser":true,"meta":null,"data":{{"type":"text","text":"x"}}}}}}}}"#
            )
        })
        .collect();
    format!(
        r#"{{"id":"{id}","webhookId":"w","webhookUrl":"u","messages":[{}]}}"#,
        events.join(",")
    )
    .into_bytes()
}

pub fn accept(store: &SledStore, body: &[u8]) -> Accepted {
    let parsed = parse_delivery(body).expect("valid delivery");
    store
        .accept(&parsed.id, &parsed.events, 1_000)
        .expect("accept")
}

/// Every event still to fold, read back once each, and where the log ended.
pub fn pending_records(store: &SledStore) -> (Vec<(PendingEvent, EventRecord)>, Cursor) {
    let pending = store.pending().expect("pending");
    let records = pending
        .events
        .into_iter()
        .map(|p| {
            let rec = store.event_at(p.seq, p.at).expect("read").expect("record");
            (p, rec)
        })
        .collect();
    (records, pending.end)
}

/// Fold the events of `records` that `keep` picks, without rules, recording `position`.
pub fn fold_picked(
    store: &SledStore,
    records: &[(PendingEvent, EventRecord)],
    keep: impl Fn(&EventRecord) -> bool,
    position: &Position,
) -> Applied {
    let picked: Vec<&(PendingEvent, EventRecord)> =
        records.iter().filter(|(_, rec)| keep(rec)).collect();
    let (batch, partitions): (Vec<(u64, Event)>, Vec<PartitionKey>) = picked
        .iter()
        .map(|(p, rec)| {
            let event = parse_event(rec.event.get()).expect("parse");
            ((p.seq, event), p.partition.clone())
        })
        .unzip();
    // As the dispatcher does: each event's frame, so the fold indexes it by partition.
    let position = Position {
        fold_from: position.fold_from,
        passed: position.passed.clone(),
        frames: picked.iter().map(|(p, _)| p.at).collect(),
    };
    store
        .fold(
            &batch,
            &partitions,
            &engine::decide::NoRules,
            &[],
            &position,
        )
        .expect("fold")
}

/// Fold everything still to fold, as the dispatcher would: in one batch whose watermark is the
/// log's end.
pub fn drain(store: &SledStore) -> Applied {
    let (records, end) = pending_records(store);
    let position = Position {
        fold_from: Some(end),
        ..Default::default()
    };
    fold_picked(store, &records, |_| true, &position)
}

pub fn accept_at(store: &SledStore, body: &[u8], received_at: Millis) {
    let parsed = parse_delivery(body).expect("valid delivery");
    store
        .accept(&parsed.id, &parsed.events, received_at)
        .expect("accept");
}

pub fn one_message_rule(name: &str) -> engine::rules::RuleSet {
    let text = format!(
        "[[rule]]\nname = \"{name}\"\non = [\"bot.message.received\"]\n\
         actions = [{{ type = \"send_message\", text = \"{name} {{{{ event.id }}}}\" }}]\n"
    );
    engine::rules::RuleSet::from_sources(&[("r.toml".into(), text)]).expect("rules")
}

pub fn dead_letter(
    entry: &model::action::OutboxEntry,
    reason: &str,
    answered: bool,
) -> model::action::DeadLetter {
    model::action::DeadLetter {
        entry: entry.clone(),
        reason: reason.into(),
        error: "x".into(),
        attempts: 1,
        first_attempt_at: 1,
        last_attempt_at: 2,
        blocking: false,
        answered,
    }
}

pub fn drain_with(store: &SledStore, rules: &dyn engine::decide::Decide) -> Applied {
    let records = pending_records(store).0;
    let batch: Vec<(u64, Event)> = records
        .iter()
        .map(|(p, rec)| (p.seq, parse_event(rec.event.get()).expect("parse")))
        .collect();
    // Each event's receive time as stored, the decisions' clock (as the dispatcher passes it).
    let received: Vec<Millis> = records.iter().map(|(_, rec)| rec.received_at).collect();
    store.apply_with(&batch, rules, &received).expect("apply")
}

/// A delivery of one user message `text` in conversation `conv`.
pub fn said(delivery: &str, event: &str, conv: &str, text: &str) -> Vec<u8> {
    format!(
        r#"{{"id":"{delivery}","webhookId":"w","webhookUrl":"u","messages":[{{"id":"{event}","event":"bot.message.received","sourceType":"bot","sourceId":"B1","timestamp":1,
        "data":{{"message":{{"id":"m{event}","conversationId":"{conv}","isUser":true,"meta":null,"data":{{"type":"text","text":"{text}"}}}}}}}}]}}"#
    )
    .into_bytes()
}

/// Messages "start", "restart", "other" and "cancel" start, restart, start another and cancel
/// timers; timer `x` firing sends a message.
pub fn timer_rules() -> engine::rules::RuleSet {
    let rule = |name: &str, action: &str| {
        format!(
            "[[rule]]\nname = \"{name}\"\non = [\"bot.message.received\"]\n\
             when = {{ field = \"message.data.text\", equals = \"{name}\" }}\nactions = [{action}]\n"
        )
    };
    let text = [
        rule(
            "start",
            r#"{ type = "start_timer", name = "x", after = "5m" }"#,
        ),
        rule(
            "restart",
            r#"{ type = "start_timer", name = "x", after = "10m" }"#,
        ),
        rule(
            "other",
            r#"{ type = "start_timer", name = "y", after = "1m" }"#,
        ),
        rule("cancel", r#"{ type = "cancel_timer", name = "x" }"#),
        "[[rule]]\nname = \"fired\"\non = [\"timer.x\"]\n\
         actions = [{ type = \"send_message\", text = \"x fired\" }]\n"
            .to_owned(),
    ]
    .concat();
    engine::rules::RuleSet::from_sources(&[("timers.toml".into(), text)]).expect("rules")
}

pub fn all_timers(store: &SledStore) -> Vec<DueTimer> {
    let (due, next) = store
        .due_timers(Millis::MAX, 1_000, &|_| false)
        .expect("timers");
    assert_eq!(next, None);
    due
}

/// Fire a due timer as the firer does (its deterministic event, through intake's dedupe).
pub fn fire(store: &SledStore, timer: &DueTimer) -> Accepted {
    fire_at(store, timer, 2_000)
}

/// [`fire`], the firing received at `received_at` (the firer's clock when it fired).
pub fn fire_at(store: &SledStore, timer: &DueTimer, received_at: Millis) -> Accepted {
    let event = model::webhook::timer_event(&timer.firing, &timer.bot_id).expect("timer event");
    let delivery = DeliveryId::new(event.event.id.as_str());
    store
        .accept(&delivery, &[event], received_at)
        .expect("accept")
}
