//! A sled store with every kind of record, built through the port, copied into a schema of the
//! test database: the port reads the same on both, the numbers go on past the copied ones, and
//! an interrupted copy is refused until discarded. Skipped (said on stderr) without
//! `HANDOFF_BRIDGE_TEST_PG_URL`.

use super::*;
use model::ids::{ConversationId, DeliveryId, PartitionKey};
use model::webhook::model::Millis;
use model::webhook::{parse_delivery, parse_event, IncomingEvent};
use storage::desk_links::{DeskContact, DeskLink};
use storage::idempotency::IdempotencyRecord;
use storage::operators::OperatorAction;
use storage::port::*;
use storage::test_support::{dead_letter, one_message_rule, said, timer_rules};
use storage::{Position, QuarantineRecord};
use storage_pg::testing::TestDb;

const HOUR: Millis = 1_763_690_400_000;

#[test]
fn a_line_agrees_when_postgres_holds_what_sled_held_less_what_it_merged() {
    assert!(Line::new("conversations", 3, 3).agrees());
    assert!(!Line::new("conversations", 3, 2).agrees());
    let merged = Line {
        merged: 1,
        ..Line::new("events", 5, 4)
    };
    assert!(merged.agrees());
    let report = Report {
        lines: vec![merged, Line::new("outbox", 2, 1)],
        records: 7,
        took: Duration::ZERO,
    };
    assert!(!report.agrees());
    assert_eq!(report.differences(), ["outbox"]);
}

fn accept(store: &dyn Storage, body: &[u8]) {
    let parsed = parse_delivery(body).expect("delivery");
    store
        .accept(&parsed.id, &parsed.events, 1_000)
        .expect("accept");
}

/// Fold everything still to fold with `rules`, as the dispatcher does (the watermark moved to
/// the log's end).
fn fold_all(store: &dyn Storage, rules: &dyn engine::decide::Decide) -> storage::Applied {
    let pending = store.pending().expect("pending");
    let (mut batch, mut partitions, mut frames) = (Vec::new(), Vec::new(), Vec::new());
    for p in &pending.events {
        let record = store.event_at(p.seq, p.at).expect("read").expect("event");
        batch.push((p.seq, parse_event(record.event.get()).expect("parse")));
        partitions.push(p.partition.clone());
        frames.push(p.at);
    }
    let position = Position {
        fold_from: Some(pending.end),
        passed: Vec::new(),
        frames,
    };
    let received = vec![1_000; batch.len()];
    store
        .fold(&batch, &partitions, rules, &received, &position)
        .expect("fold")
}

fn conversation_event(id: &str, kind: &str, conversation: &str, at: Millis) -> IncomingEvent {
    let raw = serde_json::json!({
        "id": id, "event": kind, "sourceType": "bot", "sourceId": "B1", "timestamp": at,
        "data": { "conversation": { "id": conversation, "botId": "B1", "platform": "web" } },
    });
    let raw = serde_json::value::RawValue::from_string(raw.to_string()).expect("raw");
    model::webhook::validate_event(&raw).expect("event")
}

/// Deliveries folded with rules (states, marks, a timer, outbox entries, one done, one dead,
/// one waiting with a retry state), the waiting queue and its figures, quarantine, the
/// console's audit list, an idempotency answer, desk mappings, the backfill cursor, and one
/// event still to fold.
fn fill(store: &dyn Storage) {
    accept(store, &said("d1", "e1", "c1", "start"));
    accept(store, &said("d2", "e2", "c2", "hello"));
    fold_all(store, &timer_rules());
    for (d, e, c) in [("d3", "e3", "c3"), ("d4", "e4", "c4"), ("d5", "e5", "c5")] {
        accept(store, &said(d, e, c, "hi"));
    }
    let decided = fold_all(store, &one_message_rule("greet")).outbox;
    assert_eq!(decided.len(), 3);
    store.outbox_done(&decided[0], 1, 2_000).expect("done");
    store
        .outbox_dead(&dead_letter(&decided[1], "http_400", true))
        .expect("dead");
    let retry = model::action::RetryState::default();
    store
        .set_outbox_retry_state(decided[2].seq, &retry)
        .expect("retry state");
    let requested = "bot.conversation.agent_call_requested";
    let events = [
        conversation_event("q1", requested, "c6", HOUR + 1),
        conversation_event("q2", requested, "c7", HOUR + 2),
        conversation_event(
            "q3",
            "bot.conversation.agent_call_connected",
            "c6",
            HOUR + 60_000,
        ),
    ];
    store
        .accept(&DeliveryId::new("dq"), &events, 1_000)
        .expect("accept");
    fold_all(store, &one_message_rule("greet"));
    fill_records(store);
    accept(store, &said("d9", "e9", "c1", "later"));
}

/// The records written beside the folds.
fn fill_records(store: &dyn Storage) {
    let body = b"{not json";
    store
        .quarantine(QuarantineRecord::new(
            "delivery",
            "invalid_json",
            "x",
            body,
            1_500,
        ))
        .expect("quarantine");
    let action = OperatorAction {
        at: 1_600,
        who: "Kim".into(),
        role: "operator".into(),
        what: "accept c6".into(),
        result: "applied".into(),
    };
    store.record_operator_action(&action).expect("action");
    let answer = IdempotencyRecord {
        request: "accept c6 {}".into(),
        status: 200,
        body: serde_json::json!({"status": "applied"}),
        at: 1_700,
    };
    store
        .record_idempotent_answer("accept", "k1", &answer)
        .expect("answer");
    let link = DeskLink {
        connector: "chatwoot".into(),
        conversation_id: "c6".into(),
        remote: Some("41".into()),
        earlier: vec!["40".into()],
        opened_by: "q1/tell-helpdesk/0".into(),
        updated_at: 1_800,
        ..DeskLink::default()
    };
    store.put_desk_link(&link).expect("link");
    let contact = DeskContact {
        connector: "chatwoot".into(),
        user: "u6".into(),
        contact: "9".into(),
        extra: serde_json::Value::Null,
        updated_at: 1_800,
    };
    store.put_desk_contact(&contact).expect("contact");
    store.set_backfill_cursor(12_345).expect("cursor");
}

/// Every read the daemon makes of what `fill` wrote, as text.
fn reads(s: &dyn Storage) -> Vec<String> {
    let conversations = s.conversations_page(None, 100).expect("page");
    let c = |id: &str| ConversationId::new(id);
    let mut out = vec![
        format!("{conversations:?}"),
        format!("{:?}", s.end_users_page(None, 100)),
        format!("{:?}", s.bot("B1")),
        format!("{:?}", s.outbox_page(None, 100)),
        format!("{:?}", s.dead_letters_page(None, 100)),
        format!("{:?}", s.finished_page(None, 100)),
        format!("{:?}", s.due_timers(Millis::MAX, 100, &|_| false)),
        format!("{:?}", s.queue_summary()),
        format!("{:?}", s.waiting_by_bot()),
        format!("{:?}", s.queue_standing(&c("c7"))),
        format!("{:?}", s.handoff_stats(HOUR, HOUR + 3_600_000)),
        format!("{:?}", s.desk_page(None, None, None, 100)),
        format!("{:?}", s.watched(0, 100)),
        format!("{:?}", s.quarantine_page(None, 100)),
        format!("{:?}", s.operator_actions_page(None, 100)),
        format!("{:?}", s.idempotent_answer("accept", "k1")),
        format!("{:?}", s.desk_link_of_remote("chatwoot", "40")),
        format!("{:?}", s.desk_contact("chatwoot", "u6")),
        format!("{:?}", s.backfill_cursor()),
        format!("{:?}", s.sizes()),
        format!("{:?}", s.outbox_len()),
        format!("{:?}", s.timers_pending()),
        format!("{:?}", s.find_end_user("web", "nobody")),
    ];
    for seq in s
        .outbox_page(None, 100)
        .expect("outbox")
        .iter()
        .map(|e| e.seq)
    {
        out.push(format!("{:?}", s.outbox_retry_state(seq)));
    }
    for state in &conversations {
        let partition = PartitionKey::Conversation(state.id.clone());
        out.push(format!("{:?}", s.partition_events(&partition)));
        out.push(format!(
            "{:?}",
            s.waiting_positions(std::slice::from_ref(state))
        ));
    }
    for id in ["e1", "e3", "e4", "e5", "q1"] {
        out.push(format!("{:?}", s.action_seqs_of_event(id)));
    }
    out
}

/// The events still to fold: number and partition (the cursors are each backend's own).
fn still_to_fold(s: &dyn Storage) -> Vec<(u64, PartitionKey)> {
    let pending = s.pending().expect("pending");
    pending.iter().map(|(n, p)| (n, p.clone())).collect()
}

fn copy_into(data: &DataDir, db: &TestDb, discard_incomplete: bool) -> Result<Report, CopyError> {
    let request = Request {
        from: data,
        to: &db.options(),
        discard_incomplete,
        cache_capacity: 8 << 20,
    };
    copy(&request, &mut |_| {})
}

#[test]
fn every_kind_of_record_is_copied_and_the_numbers_go_on_past_the_copied_ones() {
    let Some(db) = TestDb::fresh("store copy") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = DataDir::new(&tmp.path().join("data"));
    let sled = SledStore::open(&data.store_path(), 8 << 20).expect("open");
    fill(&sled);
    let (before, pending) = (reads(&sled), still_to_fold(&sled));
    assert_eq!(pending.len(), 1, "e9 waits");
    let highest_seq = sled.outbox_last_seq().expect("last").expect("some");
    let highest_event = pending[0].0;
    drop(sled);

    let report = copy_into(&data, &db, false).expect("copy");
    assert!(report.agrees(), "{report:#?}");
    assert!(report
        .lines
        .iter()
        .any(|l| l.what == "events" && l.sled == 9));
    let pg = PgStore::open(&db.options(), model::clock::Clock::new()).expect("open");
    assert_eq!(reads(&pg), before);
    assert_eq!(still_to_fold(&pg), pending, "what sled had to fold");

    // It goes on: e9 folds once, new numbers are above the copied ones.
    let applied = fold_all(&pg, &one_message_rule("greet"));
    assert_eq!(applied.outbox.len(), 1);
    assert!(applied.outbox[0].seq > highest_seq, "{applied:?}");
    assert!(still_to_fold(&pg).is_empty());
    let c1 = pg.conversation(&ConversationId::new("c1")).expect("read");
    assert_eq!(c1.expect("c1").events_applied, 2);
    accept(&pg, &said("d10", "e10", "c1", "more"));
    assert!(still_to_fold(&pg)[0].0 > highest_event);
    let next = pg.record_operator_action(&OperatorAction {
        at: 1,
        who: "Kim".into(),
        role: "operator".into(),
        what: "x".into(),
        result: "applied".into(),
    });
    let first = pg.operator_actions_page(None, 10).expect("page");
    assert_eq!(first.len(), 2);
    assert_eq!(next.expect("recorded"), first[0].0);
    assert!(first[0].0 > first[1].0);
    let record = QuarantineRecord::new("delivery", "invalid_json", "y", b"{", 1);
    let id = pg.quarantine(record).expect("quarantine");
    let (page, _) = pg.quarantine_page(None, 10).expect("page");
    assert!(page.iter().all(|m| m.id <= id) && page.len() == 2);

    // The target is no longer empty: a second copy is refused, nothing written.
    let again = copy_into(&data, &db, false).expect_err("refused");
    assert!(
        matches!(again, CopyError::Target(TargetError::NotEmpty { .. })),
        "{again}"
    );
}

#[test]
fn an_interrupted_copy_is_refused_by_the_daemon_and_the_copy_until_discarded() {
    let Some(db) = TestDb::fresh("store copy interrupted") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = DataDir::new(&tmp.path().join("data"));
    let sled = SledStore::open(&data.store_path(), 8 << 20).expect("open");
    accept(&sled, &said("d1", "e1", "c1", "hello"));
    fold_all(&sled, &one_message_rule("greet"));
    drop(sled);
    // A copy cut short after its first batch: the mark stays, beside part of the store.
    let mut loader = Loader::start(&db.options(), false).expect("start");
    let source = SledStore::open(&data.store_path(), 8 << 20).expect("open");
    let batch: Vec<Record> = source
        .dump()
        .records(Kind::Conversation)
        .expect("records")
        .collect::<Result<_, _>>()
        .expect("read");
    loader.load(Kind::Conversation, batch).expect("load");
    drop((loader, source));

    let refused = PgStore::open(&db.options(), model::clock::Clock::new()).err();
    let text = refused.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        text.contains("did not finish"),
        "the daemon refuses it: {text}"
    );
    let again = copy_into(&data, &db, false).expect_err("refused");
    assert!(matches!(again, CopyError::Incomplete), "{again}");
    let report = copy_into(&data, &db, true).expect("discarded, then copied");
    assert!(report.agrees(), "{report:#?}");
    PgStore::open(&db.options(), model::clock::Clock::new()).expect("complete now");
}

#[test]
fn a_schema_newer_than_this_binary_is_refused_with_nothing_written() {
    let Some(db) = TestDb::fresh("store copy too new") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = DataDir::new(&tmp.path().join("data"));
    drop(SledStore::open(&data.store_path(), 8 << 20).expect("open"));
    db.execute(
        "CREATE TABLE schema_version (version integer NOT NULL); \
                INSERT INTO schema_version VALUES (99)",
    );
    let refused = copy_into(&data, &db, true).expect_err("refused");
    assert!(
        matches!(
            refused,
            CopyError::Target(TargetError::TooNew { found: 99, .. })
        ),
        "{refused}"
    );
    let tables = db.reader().numbers(&format!(
        "SELECT count(*) FROM pg_tables WHERE schemaname = '{}'",
        db.schema
    ));
    assert_eq!(tables, [1], "nothing created beside schema_version");
}

/// How long a copy of many events takes (a measurement, not run by default):
/// `HANDOFF_BRIDGE_COPY_EVENTS=100000 cargo test --lib copy_speed -- --ignored --nocapture`
/// with `HANDOFF_BRIDGE_TEST_PG_URL` set. The events are spread over 1,000 conversations, 10 a
/// delivery, and folded (states, marks) before the copy.
#[test]
#[ignore = "a measurement: run it by name"]
fn copy_speed() {
    let Some(db) = TestDb::fresh("store copy speed") else {
        return;
    };
    let n: usize = std::env::var("HANDOFF_BRIDGE_COPY_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = DataDir::new(&tmp.path().join("data"));
    let sled = SledStore::open(&data.store_path(), 8 << 20).expect("open");
    let built = Instant::now();
    for chunk in 0..n.div_ceil(1_000) {
        let bodies: Vec<Vec<u8>> = (0..100)
            .map(|d| {
                let events: Vec<(String, String)> = (0..10)
                    .map(|e| {
                        let i = chunk * 1_000 + d * 10 + e;
                        (format!("e{i}"), format!("c{}", i % 1_000))
                    })
                    .collect();
                let refs: Vec<(&str, &str, i64)> = events
                    .iter()
                    .map(|(e, c)| (e.as_str(), c.as_str(), 1))
                    .collect();
                storage::test_support::delivery(&format!("d{chunk}-{d}"), &refs)
            })
            .collect();
        let parsed: Vec<_> = bodies
            .iter()
            .map(|b| parse_delivery(b).expect("delivery"))
            .collect();
        let requests: Vec<storage::AcceptRequest<'_>> = parsed
            .iter()
            .map(|p| storage::AcceptRequest {
                delivery: &p.id,
                events: &p.events,
                invalid: &[],
                received_at: 1_000,
            })
            .collect();
        sled.accept_many(&requests).expect("accept");
        fold_all(&sled, &engine::decide::NoRules);
    }
    drop(sled);
    eprintln!("built {n} events in {:.1}s", built.elapsed().as_secs_f64());
    let report = copy_into(&data, &db, false).expect("copy");
    assert!(report.agrees(), "{report:#?}");
    eprintln!(
        "copied {} records ({n} events) in {:.1}s",
        report.records,
        report.took.as_secs_f64()
    );
}

fn event(seq: u64, id: &str, delivery: &str) -> storage::EventRecord {
    let body = format!(r#"{{"id":"{id}","event":"bot.message.received"}}"#);
    storage::EventRecord {
        seq,
        id: model::ids::EventId::new(id),
        delivery: DeliveryId::new(delivery),
        received_at: i64::try_from(seq).unwrap_or(0),
        partition: "c:c1".into(),
        kind: "bot.message.received".into(),
        event: serde_json::value::RawValue::from_string(body).expect("raw"),
    }
}

fn stored(id: &str, events: Vec<storage::EventRecord>) -> Record {
    Record::Delivery {
        id: DeliveryId::new(id),
        received_at: events.first().map_or(0, |e| e.received_at),
        events,
    }
}

#[test]
fn an_id_the_log_holds_twice_is_one_row_the_later_copy_and_counted() {
    let Some(db) = TestDb::fresh("store copy of ids held twice") else {
        return;
    };
    let mut loader = Loader::start(&db.options(), false).expect("start");
    let first = vec![
        stored("d1", vec![event(1, "e1", "d1"), event(2, "e2", "d1")]),
        stored("d2", vec![event(3, "e1", "d2")]),
    ];
    loader.load(Kind::Delivery, first).expect("load");
    let second = vec![stored("d1", vec![event(4, "e2", "d1")])];
    loader.load(Kind::Delivery, second).expect("load");
    let merged = loader.merged();
    assert_eq!((merged.events, merged.deliveries), (2, 1));
    assert_eq!(loader.rows(Rows::Events).expect("rows"), 2);
    assert_eq!(loader.rows(Rows::Of(Kind::Delivery)).expect("rows"), 2);
    let seqs = db.reader().numbers("SELECT seq FROM events ORDER BY id");
    assert_eq!(seqs, [3, 4], "the later copies");
}
