use super::test_support::*;
use super::*;
use crate::port::*;
use model::ids::ConversationId;
use model::webhook::{parse_delivery, parse_event};

#[test]
fn accepting_dedupes_by_delivery_and_by_event() {
    let (_d, store) = store();
    let first = accept(
        &store,
        &delivery("d1", &[("e1", "c1", 1), ("e2", "c1", 2), ("e1", "c1", 1)]),
    );
    assert_eq!(first.new.len(), 2);
    assert_eq!(first.new_index, vec![0, 1]);
    assert_eq!(
        first.duplicate_events, 1,
        "the repeated id inside the batch"
    );
    let again = accept(&store, &delivery("d1", &[("e1", "c1", 1)]));
    assert!(again.duplicate_delivery);
    assert!(again.new.is_empty());
    let rebatched = accept(&store, &delivery("d2", &[("e2", "c1", 2), ("e3", "c2", 3)]));
    assert_eq!(rebatched.duplicate_events, 1);
    assert_eq!(rebatched.new.len(), 1);
    assert_eq!(
        rebatched.new[0].1,
        model::ids::PartitionKey::Conversation("c2".into())
    );
    assert_eq!(store.pending().expect("pending").len(), 3);
}

#[test]
fn applying_is_exactly_once_even_when_a_batch_is_repeated() {
    let (_d, store) = store();
    accept(&store, &delivery("d1", &[("e1", "c1", 1), ("e2", "c1", 2)]));
    let pending = store.pending().expect("pending");
    let batch: Vec<(u64, Event)> = pending
        .iter()
        .map(|(seq, _)| {
            (
                seq,
                parse_event(store.event(seq).expect("read").expect("rec").event.get())
                    .expect("parse"),
            )
        })
        .collect();
    let first = store.apply(&batch).expect("apply");
    assert_eq!(
        (first.applied, first.skipped, first.new_conversations),
        (2, 0, 1)
    );
    let second = store.apply(&batch).expect("apply again");
    assert_eq!((second.applied, second.skipped), (0, 2));
    let state = store
        .conversation(&"c1".into())
        .expect("read")
        .expect("state");
    assert_eq!(state.events_applied, 2);
    assert_eq!(state.messages.user_messages, 2);
    assert!(store.pending().expect("pending").is_empty());
}

#[test]
fn state_and_inbox_survive_reopening() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    {
        let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
        accept(&store, &delivery("d1", &[("e1", "c1", 1), ("e2", "c2", 2)]));
        store.flush().expect("flush");
    }
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    assert_eq!(store.pending().expect("pending").len(), 2);
    drain(&store);
    store.flush().expect("flush");
    drop(store);
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    assert!(store.pending().expect("pending").is_empty());
    assert_eq!(
        store
            .conversation(&"c2".into())
            .expect("read")
            .map(|s| s.events_applied),
        Some(1)
    );
    assert_eq!(
        accept(&store, &delivery("d9", &[("e1", "c1", 1)])).duplicate_events,
        1
    );
}

#[test]
fn end_users_are_found_by_platform_and_user_key() {
    let (_d, store) = store();
    let body = br#"{"id":"d","webhookId":"w","webhookUrl":"u","messages":[
        {"id":"e1","event":"bot.end_user.created","sourceType":"bot","sourceId":"B1","timestamp":1,
         "data":{"endUser":{"id":"u1","platform":"kakaobiz","userKey":"k1"}}},
        {"id":"e2","event":"bot.conversation.created","sourceType":"bot","sourceId":"B1","timestamp":2,
         "data":{"conversation":{"id":"c9","endUserId":"u1","platform":"kakaobiz","userKey":"k1"}}}]}"#;
    accept(&store, body);
    drain(&store);
    let user = store
        .find_end_user("kakaobiz", "k1")
        .expect("read")
        .expect("found");
    assert_eq!(user.id.as_str(), "u1");
    assert_eq!(
        user.last_conversation_id.value.as_ref().map(|c| c.as_str()),
        Some("c9")
    );
    assert!(store.find_end_user("web", "k1").expect("read").is_none());
}

#[test]
fn prune_drops_old_dedupe_records_and_whole_old_folded_segments_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Tiny segments: every delivery gets its own.
    let store = SledStore::open_with(&dir.path().join("store"), 8 * 1024 * 1024, 10).expect("open");
    for (d, e, at) in [("d1", "e1", 100), ("d2", "e2", 200), ("d3", "e3", 10_000)] {
        accept_at(&store, &delivery(d, &[(e, "c1", 1)]), at);
    }
    let segments = || eventlog::segments(&store.log_dir).expect("segments");
    assert_eq!(segments(), vec![1, 2, 3, 4]);
    // Nothing is folded yet: no segment may go, though old dedupe records do, a segment at a
    // time: segment 1 (d1, e1) is older than the first event of segment 2, which is old too.
    let p = store.prune(5_000, 5_000).expect("prune");
    assert_eq!(p.event_chunks, 0);
    assert_eq!(p.ids_forgotten, 2, "d1 and e1 are past the dedupe window");
    drain(&store);
    let p = store.prune(5_000, 5_000).expect("prune");
    assert_eq!(p.ids_forgotten, 0, "already pruned");
    // Segment 1 goes: the next one starts with an old event too. Segment 2 stays: its newest
    // event may be as new as the first of segment 3, which is inside the retention.
    assert_eq!(p.event_chunks, 1);
    assert_eq!(segments(), vec![2, 3, 4]);
    assert!(
        !dedupe::ids_path(&store.log_dir, 1).exists(),
        "its ids file too"
    );
    assert_eq!(store.oldest_event_received_at().expect("oldest"), Some(200));
    assert!(store.event_by_id(&"e1".into()).expect("read").is_none());
    assert!(store.event_by_id(&"e3".into()).expect("read").is_some());
    // e3's dedupe record is kept: a re-send is a duplicate; and so is e2's, whose segment may
    // hold events as new as e3 (kept at least the window, not exactly).
    for (d, e) in [("d3b", "e3"), ("d2b", "e2")] {
        let again = parse_delivery(&delivery(d, &[(e, "c1", 2)])).expect("parse");
        let out = store
            .accept(&again.id, &again.events, 10_001)
            .expect("accept");
        assert_eq!(out.duplicate_events, 1, "{e}");
    }
    // A restart keeps what pruning forgot forgotten, and the rest.
    drop(store);
    let store = SledStore::open_with(&dir.path().join("store"), 8 * 1024 * 1024, 10).expect("open");
    let again = parse_delivery(&delivery("d1c", &[("e1", "c1", 2)])).expect("parse");
    let out = store
        .accept(&again.id, &again.events, 10_002)
        .expect("accept");
    assert_eq!(out.new.len(), 1, "e1 is past the window: new again");
    let p = store.prune(50_000, 5_000).expect("prune");
    assert_eq!(
        p.ids_forgotten, 4,
        "segments 2 (d2, e2) and 3 (d3, e3); the newer ones are not sealed or not older"
    );
}

/// The longest value in a tree.
fn longest_value(tree: &sled::Tree) -> usize {
    tree.iter()
        .values()
        .map(|v| v.expect("read").len())
        .max()
        .unwrap_or(0)
}

#[test]
fn a_body_that_stays_large_compressed_goes_in_chunks_sled_keeps_in_its_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    // Bytes that do not compress: 400 KiB of base64 text, a blob for sled if stored whole.
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let body: Vec<u8> = (0..300 * 1024)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let (big, small) = {
        let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
        let record = QuarantineRecord::new("delivery", "invalid_json", "x", &body, 5);
        assert!(
            record.body_base64.len() > 4 * MAX_VALUE_BYTES,
            "{}",
            record.body_base64.len()
        );
        let big = store.quarantine(record).expect("quarantine");
        let small = store
            .quarantine(QuarantineRecord::new(
                "delivery",
                "invalid_json",
                "x",
                b"{bad",
                6,
            ))
            .expect("quarantine");
        // Chunks of a record a crash removed (or never wrote): gone on the next open.
        store
            .quarantine_bodies
            .insert(keys::quarantine_chunk(999_999, 0), b"orphan".to_vec())
            .expect("orphan");
        store.flush().expect("flush");
        (big, small)
    };
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    assert!(longest_value(&store.quarantine) <= MAX_VALUE_BYTES);
    assert!(longest_value(&store.quarantine_bodies) <= MAX_VALUE_BYTES);
    let chunks = store.quarantine_bodies.len();
    assert!(chunks > 4, "{chunks} chunks");
    let back = store.quarantined_one(big).expect("get").expect("record");
    assert_eq!(back.body().expect("body"), body);
    let all = store.quarantined().expect("all");
    assert_eq!(all.len(), 2);
    assert_eq!(all[0].body().expect("body"), body);
    assert_eq!(all[1].body().expect("body"), b"{bad");
    let (page, _) = store.quarantine_page(None, 10).expect("page");
    let sizes: Vec<u64> = page.iter().map(|m| m.body_bytes).collect();
    assert_eq!(sizes, [body.len() as u64, 4]);
    assert!(store.release_quarantined(big).expect("release"));
    assert_eq!(store.quarantine_bodies.len(), 0, "its chunks go with it");
    assert!(store.quarantined_one(small).expect("get").is_some());
}

#[test]
fn a_delivery_s_invalid_events_make_one_record() {
    let bad = |i: usize| model::webhook::InvalidEvent {
        raw: format!(r#"{{"id":"e{i}"}}"#),
        reason: format!("reason {i}"),
    };
    assert!(QuarantineRecord::invalid_events(&[], "d", None, 5).is_none());
    let one = QuarantineRecord::invalid_events(&[bad(0)], "d", None, 5).expect("one");
    assert_eq!(
        (one.scope.as_str(), one.detail.as_str()),
        ("event", "reason 0")
    );
    assert_eq!(one.body().expect("body"), br#"{"id":"e0"}"#);
    let many: Vec<_> = (0..8).map(bad).collect();
    let record =
        QuarantineRecord::invalid_events(&many, "d", Some("application/json"), 5).expect("record");
    assert_eq!(record.scope, "events");
    assert_eq!(record.reason, "invalid_event");
    assert_eq!(record.delivery_id.as_deref(), Some("d"));
    let body: Vec<serde_json::Value> =
        serde_json::from_slice(&record.body().expect("body")).expect("a JSON array");
    assert_eq!(body.len(), 8);
    assert_eq!(body[7]["id"], "e7");
    assert!(
        record.detail.starts_with("8 invalid events; [0] reason 0"),
        "{}",
        record.detail
    );
    assert!(record.detail.ends_with("and 3 more"), "{}", record.detail);
}

#[test]
fn quarantine_round_trips_and_releases() {
    let (_d, store) = store();
    let id = store
        .quarantine(QuarantineRecord {
            id: 0,
            received_at: 5,
            scope: "delivery".into(),
            reason: "invalid_json".into(),
            detail: "x".into(),
            delivery_id: None,
            content_type: Some("application/json".into()),
            body_base64: "e2JhZA==".into(),
            body_gzip: false,
        })
        .expect("quarantine");
    let listed = store.quarantined().expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, id);
    assert_eq!(
        store.quarantined_one(id).expect("get").map(|r| r.reason),
        Some("invalid_json".into())
    );
    assert!(store.release_quarantined(id).expect("release"));
    assert!(!store.release_quarantined(id).expect("release again"));
}

#[test]
fn a_flush_syncs_sleds_file_and_a_failed_sync_fails_every_later_flush_until_reopened() {
    let (dir, store) = store();
    let before = store.file_syncs();
    accept(&store, &delivery("d1", &[("e1", "c1", 1_000)]));
    store.flush().expect("flush");
    assert_eq!(
        store.file_syncs(),
        before + 1,
        "sled's flush, then its file synced"
    );

    store.sled_file.fail_next_sync();
    assert!(matches!(store.flush(), Err(StoreError::Sync(_))));
    // The kernel may have dropped what it could not write: a later sync proves nothing.
    assert!(store.flush().is_err(), "the failure is kept");
    assert_eq!(store.file_syncs(), before + 1);

    drop(store);
    let store = SledStore::open(&dir.path().join("store"), 8 * 1024 * 1024).expect("reopen");
    store.flush().expect("a reopened store flushes");
    assert_eq!(store.pending().expect("pending").events.len(), 1);
}

#[test]
fn a_flush_syncs_the_blob_files_sled_keeps_large_values_in() {
    let (dir, store) = store();
    store.flush().expect("flush");
    assert_eq!(store.sled_file.synced_blobs(), 0, "no large value, no blob");
    // Over a quarter segment: sled writes it to a file of its own, which sled never syncs.
    let large: Vec<u8> = (0..300 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    store
        .meta
        .insert(b"test_large", large.clone())
        .expect("insert");
    store.flush().expect("flush");
    let blobs = std::fs::read_dir(dir.path().join("store").join("blobs"))
        .expect("blobs dir")
        .count();
    assert!(blobs >= 1, "sled kept the value as a blob");
    assert_eq!(store.sled_file.synced_blobs(), blobs, "each blob synced");
    let syncs = store.file_syncs();
    store.flush().expect("flush");
    assert_eq!(store.sled_file.synced_blobs(), blobs, "synced once each");
    assert_eq!(store.file_syncs(), syncs + 1);
    assert_eq!(
        store.meta.get(b"test_large").expect("get").as_deref(),
        Some(&large[..])
    );
}

#[test]
fn a_second_process_cannot_open_a_store_in_use() {
    let (dir, _store) = store();
    // sled locks the directory: a second open in this process fails the same way another
    // process would, and must not be mistaken for an empty store.
    match SledStore::open(&dir.path().join("store"), 8 * 1024 * 1024) {
        Err(StoreError::Locked { .. }) => {}
        Err(other) => panic!("expected Locked, got {other}"),
        Ok(_) => panic!("second open succeeded"),
    }
}

/// Check and log a delivery without indexing it: the state a crash between the log's sync (the
/// acknowledgment) and the index transaction leaves.
fn log_only(store: &SledStore, body: &[u8], received_at: Millis) {
    let parsed = parse_delivery(body).expect("valid");
    let request = AcceptRequest {
        delivery: &parsed.id,
        events: &parsed.events,
        invalid: &[],
        received_at,
    };
    let checked = store.check(&[request]).expect("check");
    store.log.log_queue(checked.frames).expect("queue");
    store.log.log_commit().expect("commit");
}

fn pending_ids(store: &SledStore) -> Vec<String> {
    pending_records(store)
        .0
        .into_iter()
        .map(|(_, rec)| rec.id.to_string())
        .collect()
}

#[test]
fn opening_the_store_indexes_what_only_the_event_log_holds_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    let logged = delivery("d2", &[("e2", "c1", 2), ("e3", "c2", 3)]);
    {
        let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
        accept_at(&store, &delivery("d1", &[("e1", "c1", 1)]), 1_000);
        log_only(&store, &logged, 2_000);
        assert_eq!(
            store.pending().expect("pending").len(),
            3,
            "the event log is the inbox: logged is pending"
        );
    }
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    assert_eq!(pending_ids(&store), vec!["e1", "e2", "e3"]);
    let e2 = store
        .event_by_id(&EventId::new("e2"))
        .expect("read")
        .expect("e2");
    assert_eq!(e2.delivery.as_str(), "d2");
    assert_eq!(e2.received_at, 2_000, "the original receive time is kept");
    assert_eq!(e2.kind, "bot.message.received");
    // The delivery is known now: a retry is a duplicate.
    assert!(accept(&store, &logged).duplicate_delivery);

    drop(store);
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen again");
    assert_eq!(pending_ids(&store).len(), 3, "nothing indexed twice");
}

#[test]
fn a_torn_log_tail_is_cut_and_the_intact_frames_indexed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    let intact = {
        let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
        log_only(&store, &delivery("d1", &[("e1", "c1", 1)]), 1_000);
        let intact = store.log.log_commit().expect("end");
        log_only(&store, &delivery("d2", &[("e2", "c1", 2)]), 2_000);
        intact
    };
    let segment = eventlog::segment_path(&path.join(EVENT_LOG_DIR), intact.segment);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&segment)
        .expect("open log");
    file.set_len(intact.offset + 11).expect("tear");
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    assert_eq!(pending_ids(&store), vec!["e1"]);
    assert_eq!(
        std::fs::metadata(&segment).expect("segment").len(),
        intact.offset,
        "the torn bytes are cut"
    );
    // e2 was never acknowledged: its re-send is new.
    assert_eq!(
        accept(&store, &delivery("d2", &[("e2", "c1", 2)]))
            .new
            .len(),
        1
    );
}

#[test]
fn a_layout_1_store_is_migrated_without_losing_or_repeating_an_event() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    let first = parse_delivery(&delivery("d1", &[("e1", "c1", 1), ("e2", "c2", 2)])).expect("d1");
    {
        // What layout 1 left: bodies in sled, e1 folded, e2 pending, and d3 only in the intake
        // log (acknowledged, sled not flushed).
        let db = sled::open(&path).expect("sled");
        let meta = db.open_tree(keys::tree::META).expect("meta");
        meta.insert(keys::meta::LAYOUT_VERSION, &1u32.to_be_bytes())
            .expect("layout");
        let events = db.open_tree(keys::tree::LEGACY_EVENTS).expect("events");
        let seen = db.open_tree(keys::tree::SEEN).expect("seen");
        let inbox = db.open_tree(keys::tree::INBOX).expect("inbox");
        let deliveries = db.open_tree(keys::tree::DELIVERIES).expect("deliveries");
        deliveries
            .insert("d1", &5i64.to_be_bytes())
            .expect("delivery");
        for (seq, ev) in [(10u64, &first.events[0]), (11, &first.events[1])] {
            let record = EventRecord {
                seq,
                id: ev.event.id.clone(),
                delivery: first.id.clone(),
                received_at: 5,
                partition: ev.partition.encode(),
                kind: ev.event.kind.as_str().to_owned(),
                event: RawValue::from_string(ev.raw.clone()).expect("raw"),
            };
            events
                .insert(keys::seq(seq), serde_json::to_vec(&record).expect("json"))
                .expect("event");
            seen.insert(ev.event.id.as_str(), &keys::seq(seq))
                .expect("seen");
        }
        inbox
            .insert(keys::seq(11), first.events[1].partition.encode().as_bytes())
            .expect("inbox");
        db.flush().expect("flush");
        let logged = raw_events(&delivery("d3", &[("e3", "c1", 3)]));
        let payload = format!(r#"{{"d":"d3","t":7,"e":[{}]}}"#, logged.join(","));
        let mut frame = (payload.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(&crc32fast::hash(payload.as_bytes()).to_le_bytes());
        frame.extend_from_slice(payload.as_bytes());
        std::fs::write(path.join(LEGACY_WAL_FILE), frame).expect("intake log");
    }
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("migrate");
    assert_eq!(pending_ids(&store), vec!["e2", "e3"]);
    for id in ["e1", "e2", "e3"] {
        let record = store.event_by_id(&EventId::new(id)).expect("read");
        assert!(record.is_some(), "{id} is in the event log");
    }
    assert!(
        !path.join(LEGACY_WAL_FILE).exists(),
        "the old intake log is gone"
    );
    assert!(!store
        .db
        .tree_names()
        .iter()
        .any(|n| n.as_ref() == keys::tree::LEGACY_EVENTS.as_bytes()));
    assert!(accept(&store, &delivery("d1", &[("e1", "c1", 1)])).duplicate_delivery);
    assert_eq!(
        accept(&store, &delivery("d9", &[("e3", "c1", 3)])).duplicate_events,
        1
    );
    drop(store);
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    assert_eq!(pending_ids(&store), vec!["e2", "e3"], "migrated once");
}

/// The raw events of a delivery body.
fn raw_events(body: &[u8]) -> Vec<String> {
    parse_delivery(body)
        .expect("valid")
        .events
        .into_iter()
        .map(|e| e.raw)
        .collect()
}

#[test]
fn a_group_dedupes_within_itself_and_quarantines_invalid_events_of_new_deliveries_only() {
    let (_d, store) = store();
    let a = parse_delivery(&delivery("d1", &[("e1", "c1", 1)])).expect("valid");
    let b = parse_delivery(&delivery("d2", &[("e1", "c1", 1), ("e2", "c1", 2)])).expect("valid");
    let bad = [QuarantineRecord::new(
        "event",
        "invalid_event",
        "why",
        b"{}",
        5,
    )];
    let requests = [
        AcceptRequest {
            delivery: &a.id,
            events: &a.events,
            invalid: &bad,
            received_at: 5,
        },
        AcceptRequest {
            delivery: &b.id,
            events: &b.events,
            invalid: &[],
            received_at: 5,
        },
        // d1 again in the same group: a duplicate delivery, its invalid event not stored again.
        AcceptRequest {
            delivery: &a.id,
            events: &a.events,
            invalid: &bad,
            received_at: 5,
        },
    ];
    let out = store.accept_many(&requests).expect("accept");
    assert_eq!(out[0].new.len(), 1);
    assert_eq!(out[0].quarantined.len(), 1);
    assert_eq!((out[1].new.len(), out[1].duplicate_events), (1, 1));
    assert_eq!(out[1].new_index, vec![1]);
    assert!(out[2].duplicate_delivery);
    assert!(out[2].quarantined.is_empty());
    assert_eq!(store.quarantined().expect("list").len(), 1);
    assert_eq!(store.pending().expect("pending").len(), 2);
}

#[test]
fn replay_queues_only_actions_never_decided_unless_forced() {
    use replay::ReplayRequest;
    let (_d, store) = store();
    let old = one_message_rule("greet");
    accept_at(
        &store,
        &delivery("d1", &[("e1", "c1", 1), ("e2", "c2", 2)]),
        1_000,
    );
    accept_at(&store, &delivery("d2", &[("e3", "c1", 3)]), 5_000);
    let applied = drain_with(&store, &old);
    assert_eq!(applied.outbox.len(), 3);
    assert!(
        applied
            .outbox
            .iter()
            .all(|e| e.rules_version == old.version()),
        "each decision records the rule set that made it"
    );
    // Not folded yet: replay leaves it to the dispatcher.
    accept_at(&store, &delivery("d3", &[("e4", "c1", 4)]), 1_500);
    let window = |dry_run, force| ReplayRequest {
        from: 1_000,
        to: 2_000,
        dry_run,
        force,
    };

    // Same rules: everything in the window was decided before; nothing is queued.
    let report = store.replay(&window(false, false), &old).expect("replay");
    assert_eq!(report.events, 2, "e1 and e2 (e3 is outside, e4 pending)");
    assert_eq!(report.pending_events, 1);
    assert_eq!((report.queued, report.skipped), (0, 2));
    assert!(report
        .items
        .iter()
        .all(|i| i.status == "already_decided" && i.previous.as_deref() == Some("pending")));
    assert_eq!(store.outbox().expect("outbox").len(), 3);

    // New rules: their actions are new and queued; the old rule's are still skipped.
    let both = engine::rules::RuleSet::from_sources(&[
        ("a.toml".into(), "[[rule]]\nname = \"greet\"\non = [\"bot.message.received\"]\nactions = [{ type = \"send_message\", text = \"greet {{ event.id }}\" }]\n".into()),
        ("b.toml".into(), "[[rule]]\nname = \"tag\"\non = [\"bot.message.received\"]\nactions = [{ type = \"set_manual\", enabled = true }]\n".into()),
    ])
    .expect("rules");
    let dry = store.replay(&window(true, false), &both).expect("dry run");
    assert_eq!(dry.queued, 0);
    assert_eq!(dry.items.iter().filter(|i| i.status == "new").count(), 2);
    assert_eq!(
        store.outbox().expect("outbox").len(),
        3,
        "a dry run queues nothing"
    );
    let report = store.replay(&window(false, false), &both).expect("replay");
    assert_eq!((report.queued, report.skipped), (2, 2));
    assert!(report
        .entries
        .iter()
        .all(|e| e.rules_version == both.version()));
    assert_ne!(both.version(), old.version());
    let queued: Vec<&str> = report.entries.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(queued, ["e1/tag/0", "e2/tag/0"]);
    assert_eq!(store.outbox().expect("outbox").len(), 5);
    // Replaying again finds them in the ledger.
    let again = store.replay(&window(false, false), &both).expect("replay");
    assert_eq!((again.queued, again.skipped), (0, 4));

    // Forced: queued again under new ids, so the upstream acts again.
    let forced = store.replay(&window(false, true), &old).expect("forced");
    assert_eq!(forced.queued, 2);
    for item in &forced.items {
        assert_eq!(item.status, "forced");
        assert!(item
            .id
            .starts_with(&format!("{}/greet/0~replay-", item.event_id)));
    }
    assert_eq!(store.outbox().expect("outbox").len(), 7);
    // Paged: the pages, in order, are the whole outbox; a page starts after its cursor.
    let whole = store.outbox().expect("outbox");
    let mut paged = Vec::new();
    let mut after = None;
    loop {
        let page = store.outbox_page(after, 3).expect("page");
        assert!(page.len() <= 3);
        let Some(last) = page.last() else { break };
        after = Some(last.seq);
        paged.extend(page);
    }
    assert_eq!(paged, whole);
    assert!(store
        .outbox_page(Some(u64::MAX), 10)
        .expect("page")
        .is_empty());
}

#[test]
fn an_entry_recorded_done_before_a_crash_left_the_outbox_leaves_it_on_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    let (interrupted, finished, waiting) = {
        let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
        accept_at(
            &store,
            &delivery("d1", &[("e1", "c1", 1), ("e2", "c2", 2), ("e3", "c3", 3)]),
            1_000,
        );
        let applied = drain_with(&store, &one_message_rule("greet"));
        let [interrupted, finished, waiting] = &applied.outbox[..] else {
            panic!("three entries: {:?}", applied.outbox);
        };
        store.outbox_done(finished, 1, 2_000).expect("done");
        // A crash between `outbox_done_many`'s writes: the record and the ledger's status are
        // on disk, the removals are not (sled recovers a prefix of its writes).
        let key = keys::seq(interrupted.seq);
        store
            .outbox_retry
            .insert(
                key,
                encode(&model::action::RetryState::default()).expect("encode"),
            )
            .expect("retry state");
        let record = model::action::DoneRecord {
            entry: interrupted.clone(),
            outcome: "done".into(),
            at: 2_000,
            attempts: 1,
            note: None,
        };
        store
            .done
            .insert(key, encode(&record).expect("encode"))
            .expect("record");
        assert_eq!(store.outbox().expect("outbox").len(), 2, "pending and done");
        store.flush().expect("flush");
        (interrupted.clone(), finished.clone(), waiting.clone())
    };
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    let pending: Vec<u64> = store
        .outbox()
        .expect("outbox")
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(
        pending,
        [waiting.seq],
        "the interrupted move is finished, nothing else moves"
    );
    assert!(store
        .outbox_retry_state(interrupted.seq)
        .expect("read")
        .is_none());
    let done: Vec<String> = store
        .finished(10)
        .expect("finished")
        .into_iter()
        .map(|r| r.entry.id)
        .collect();
    assert_eq!(
        done,
        [finished.id.clone(), interrupted.id.clone()],
        "newest first"
    );
    assert_eq!(
        store.settle_done_moves().expect("settle"),
        0,
        "settled once"
    );
}

#[test]
fn the_ledger_forgets_only_finished_actions_older_than_the_audit_window() {
    let (_d, store) = store();
    accept_at(
        &store,
        &delivery("d1", &[("e1", "c1", 1), ("e2", "c2", 2), ("e3", "c3", 3)]),
        1_000,
    );
    let applied = drain_with(&store, &one_message_rule("greet"));
    let [old, recent, pending] = &applied.outbox[..] else {
        panic!("three entries: {:?}", applied.outbox);
    };
    store.outbox_done(old, 1, 100).expect("done");
    store.outbox_done(recent, 1, 9_000).expect("done");
    let finished = store.finished(10).expect("finished");
    let ids: Vec<&str> = finished.iter().map(|r| r.entry.id.as_str()).collect();
    assert_eq!(ids, [recent.id.as_str(), old.id.as_str()], "newest first");
    assert!(finished.iter().all(|r| r.outcome == "done"));
    assert_eq!(store.prune_ledger(5_000, 100).expect("prune"), (1, 1));
    let left = store.finished(10).expect("finished");
    assert_eq!(left.len(), 1);
    assert_eq!(
        left[0].entry.id, recent.id,
        "the record leaves with its ledger entry"
    );
    assert!(store.action_status(&old.id).expect("read").is_none());
    assert_eq!(
        store
            .action_status(&recent.id)
            .expect("read")
            .map(|s| s.state),
        Some("done".into())
    );
    assert_eq!(
        store
            .action_status(&pending.id)
            .expect("read")
            .map(|s| s.state),
        Some("pending".into()),
        "a pending action is never forgotten"
    );
    assert_eq!(store.prune_ledger(5_000, 100).expect("prune"), (0, 0));
}

#[test]
fn a_retried_dead_letter_gets_a_fresh_key_only_when_the_upstream_answered_it() {
    let (_d, store) = store();
    accept_at(
        &store,
        &delivery("d1", &[("e1", "c1", 1), ("e2", "c2", 2)]),
        1_000,
    );
    let applied = drain_with(&store, &one_message_rule("greet"));
    for (entry, answered) in applied.outbox.iter().zip([true, false]) {
        store
            .outbox_dead(&dead_letter(entry, "x", answered))
            .expect("dead");
        let retried = store
            .retry_dead_letter(entry.seq, 5_000)
            .expect("retry")
            .expect("was a dead letter");
        assert_eq!(retried.id, entry.id, "the action id never changes");
        if answered {
            assert_eq!(retried.key(), format!("{}~retry-5000", entry.id));
        } else {
            assert_eq!(
                retried.key(),
                entry.id,
                "it may have taken effect: same key"
            );
        }
        let stored = store.outbox().expect("outbox");
        let again = stored
            .iter()
            .find(|e| e.seq == entry.seq)
            .expect("back in the outbox");
        assert_eq!(again.key(), retried.key(), "the key survives a restart");
    }
}

#[test]
fn a_dead_letter_is_retried_or_dropped_once_whatever_comes_first() {
    let (_d, store) = store();
    accept_at(
        &store,
        &delivery("d1", &[("e1", "c1", 1), ("e2", "c2", 2)]),
        1_000,
    );
    let applied = drain_with(&store, &one_message_rule("greet"));
    for entry in &applied.outbox {
        store
            .outbox_dead(&dead_letter(entry, "conflict", true))
            .expect("dead");
    }
    let (a, b) = (applied.outbox[0].seq, applied.outbox[1].seq);
    assert!(store.retry_dead_letter(a, 10).expect("retry").is_some());
    assert!(
        store.retry_dead_letter(a, 11).expect("retry").is_none(),
        "retried once"
    );
    assert!(store
        .drop_dead_letter(a, "late", 12)
        .expect("drop")
        .is_none());
    assert!(store
        .drop_dead_letter(b, "by hand", 13)
        .expect("drop")
        .is_some());
    assert!(
        store.retry_dead_letter(b, 14).expect("retry").is_none(),
        "dropped stays dropped"
    );
    let outbox = store.outbox().expect("outbox");
    assert_eq!(outbox.len(), 1);
    assert_eq!(
        outbox[0].key(),
        format!("{}~retry-10", applied.outbox[0].id)
    );
    let finished = store.finished(10).expect("finished");
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0].outcome, "dropped");
    assert_eq!(finished[0].note.as_deref(), Some("by hand"));
}

#[test]
fn a_re_send_judged_against_an_in_flight_original_is_voided_when_the_original_fails() {
    let (_d, store) = store();
    let body = delivery("d1", &[("e1", "c1", 1)]);
    let parsed = parse_delivery(&body).expect("valid");
    let request = AcceptRequest {
        delivery: &parsed.id,
        events: &parsed.events,
        invalid: &[],
        received_at: 5,
    };
    let original = store.check(&[request]).expect("check");
    assert_eq!(original.accepted[0].new.len(), 1);
    assert!(
        original.duplicates_hold(&store.log),
        "no in-flight verdicts in it"
    );
    // The service re-sends before the original is logged: a duplicate of an in-flight id.
    let again = store.check(&[request]).expect("check again");
    assert!(again.accepted[0].duplicate_delivery);
    assert!(again.duplicates_hold(&store.log));
    let other = parse_delivery(&delivery("d2", &[("e1", "c1", 1)])).expect("valid");
    let by_event = store
        .check(&[AcceptRequest {
            delivery: &other.id,
            events: &other.events,
            invalid: &[],
            received_at: 5,
        }])
        .expect("check d2");
    assert_eq!(by_event.accepted[0].duplicate_events, 1);
    // The original's log write fails: both verdicts are void, and a third try is new.
    store
        .log
        .release_failed(std::slice::from_ref(&original.unindexed));
    assert!(!again.duplicates_hold(&store.log));
    assert!(!by_event.duplicates_hold(&store.log));
    assert!(
        store.log.all_indexed(),
        "nothing is in flight after the failure"
    );
    let third = store.accept_many(&[request]).expect("accept");
    assert_eq!(third[0].new.len(), 1, "accepted now");
}

#[test]
fn the_fold_writes_replaces_and_cancels_timers_with_the_state() {
    let (dir, store) = store();
    let set = timer_rules();
    accept_at(&store, &said("d1", "e1", "c1", "start"), 7_000);
    let applied = drain_with(&store, &set);
    assert_eq!(applied.timers_change, 1);
    assert!(applied.outbox.is_empty(), "internal: nothing to carry out");
    let timers = all_timers(&store);
    assert_eq!(timers.len(), 1);
    let x = &timers[0];
    assert_eq!(
        (x.firing.conversation_id.as_str(), x.firing.name.as_str()),
        ("c1", "x")
    );
    assert_eq!(x.firing.started_by, "e1/start/0");
    assert_eq!(x.bot_id, "B1");
    assert_eq!(
        x.firing.due_at,
        7_000 + 300_000,
        "5 minutes from its event's receive time"
    );
    let state = store
        .conversation(&"c1".into())
        .expect("read")
        .expect("state");
    assert_eq!(
        state.timers.get("x").map(|t| t.due_at),
        Some(x.firing.due_at)
    );
    assert_eq!(store.timers_pending().expect("timers"), 1);

    // One fold restarts x in c1 and starts y in c2: the old key goes, the earliest is first.
    accept(&store, &said("d2", "e2", "c1", "restart"));
    accept(&store, &said("d3", "e3", "c2", "other"));
    let applied = drain_with(&store, &set);
    assert_eq!(applied.timers_change, 1, "x replaced, y new");
    assert!(
        !store.has_timer(&x.key).expect("read"),
        "the replaced run's key"
    );
    let timers = all_timers(&store);
    let listed: Vec<(&str, &str, &str)> = timers
        .iter()
        .map(|t| {
            let f = &t.firing;
            (
                f.conversation_id.as_str(),
                f.name.as_str(),
                f.started_by.as_str(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [("c2", "y", "e3/other/0"), ("c1", "x", "e2/restart/0")],
        "due order"
    );
    assert_eq!(
        timers[1].firing.due_at,
        1_000 + 600_000,
        "from the restart's receive time"
    );
    // Only what is due by `now`; the next due time; the limit; what the firer skips.
    let y_due = timers[0].firing.due_at;
    let (due, next) = store.due_timers(y_due, 10, &|_| false).expect("due");
    assert_eq!((due.len(), next), (1, Some(timers[1].firing.due_at)));
    let (due, next) = store.due_timers(Millis::MAX, 1, &|_| false).expect("due");
    assert_eq!((due.len(), next), (1, Some(Millis::MAX)), "cut short");
    let (due, _) = store
        .due_timers(Millis::MAX, 10, &|k| *k == timers[0].key)
        .expect("due");
    assert_eq!(due, timers[1..]);

    accept(&store, &said("d4", "e4", "c1", "cancel"));
    let applied = drain_with(&store, &set);
    assert_eq!(applied.timers_change, -1);
    assert_eq!(all_timers(&store), timers[..1]);
    let state = store
        .conversation(&"c1".into())
        .expect("read")
        .expect("state");
    assert!(state.timers.is_empty());

    // Durable with the state: a reopened store has the same timers.
    store.flush().expect("flush");
    let path = dir.path().join("store");
    drop(store);
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    assert_eq!(all_timers(&store), timers[..1]);
}

#[test]
fn a_live_firing_runs_its_rules_once_and_a_stale_one_none() {
    let (_d, store) = store();
    let set = timer_rules();
    accept(&store, &said("d1", "e1", "c1", "start"));
    drain_with(&store, &set);
    let run = all_timers(&store).remove(0);
    assert_eq!(fire(&store, &run).new.len(), 1);
    assert!(
        fire(&store, &run).duplicate_delivery,
        "a re-fire is a duplicate"
    );
    let applied = drain_with(&store, &set);
    assert_eq!(applied.applied, 1, "the firing, once");
    assert_eq!(applied.timers_change, -1);
    let ids: Vec<&str> = applied.outbox.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, [format!("timer:c1:x:{}/fired/0", run.firing.due_at)]);
    assert!(all_timers(&store).is_empty());

    // Restarted before its firing is folded: the firing is stale, the new run stays.
    accept_at(&store, &said("d2", "e2", "c1", "start"), 3_000);
    drain_with(&store, &set);
    let stale = all_timers(&store).remove(0);
    accept_at(&store, &said("d3", "e3", "c1", "restart"), 4_000);
    drain_with(&store, &set);
    assert_eq!(fire(&store, &stale).new.len(), 1);
    let applied = drain_with(&store, &set);
    assert_eq!(
        (applied.applied, applied.outbox.len()),
        (1, 0),
        "stale: no rules"
    );
    assert_eq!(applied.timers_change, 0);
    let running = all_timers(&store);
    assert_eq!(running.len(), 1);
    assert_eq!(running[0].firing.started_by, "e3/restart/0");
    let state = store
        .conversation(&"c1".into())
        .expect("read")
        .expect("state");
    assert_eq!(
        state.timers.get("x").map(|t| t.started_by.as_str()),
        Some("e3/restart/0")
    );

    // Cancelled before its firing is folded: stale too.
    accept(&store, &said("d4", "e4", "c1", "cancel"));
    drain_with(&store, &set);
    assert_eq!(fire(&store, &running[0]).new.len(), 1);
    let applied = drain_with(&store, &set);
    assert_eq!((applied.applied, applied.outbox.len()), (1, 0));
    assert!(all_timers(&store).is_empty());

    // Replay re-decides the live firing (same rules: already decided), not the stale ones, and
    // its timers only shape the rebuilt states: the tree keeps its keys and due times.
    accept(&store, &said("d5", "e5", "c2", "other"));
    drain_with(&store, &set);
    let kept = all_timers(&store);
    let request = replay::ReplayRequest {
        from: 0,
        to: Millis::MAX,
        dry_run: false,
        force: false,
    };
    let report = store.replay(&request, &set).expect("replay");
    let fired: Vec<(&str, &str)> = report
        .items
        .iter()
        .filter(|i| i.rule == "fired")
        .map(|i| (i.id.as_str(), i.status))
        .collect();
    assert_eq!(fired, [(ids[0], "already_decided")]);
    assert_eq!(report.queued, 0);
    assert_eq!(all_timers(&store), kept);
    assert_eq!(store.timers_pending().expect("timers"), 1);
}

/// Fold everything pending with `rules`, each event with its stored receive time (as the
/// dispatcher does).
fn drain_received(store: &SledStore, rules: &dyn engine::decide::Decide) -> Applied {
    let mut batch = Vec::new();
    let mut received = Vec::new();
    for (p, rec) in pending_records(store).0 {
        received.push(rec.received_at);
        batch.push((p.seq, parse_event(rec.event.get()).expect("parse")));
    }
    store.apply_with(&batch, rules, &received).expect("apply")
}

#[test]
fn the_fold_persists_firings_and_cap_hits_and_a_replay_caps_the_same_events() {
    use model::action::Action;
    let (_d, store) = store();
    let rules = engine::rules::RuleSet::from_sources(&[(
        "r.toml".into(),
        "[[rule]]\nname = \"reply\"\non = [\"bot.message.received\"]\n\
         max_firings = { count = 2, per = \"1m\" }\n\
         actions = [{ type = \"send_message\", text = \"ok\" }]\n"
            .into(),
    )])
    .expect("rules");
    for (i, at) in [1_000, 2_000, 3_000, 4_000].into_iter().enumerate() {
        let n = i + 1;
        accept_at(
            &store,
            &delivery(&format!("d{n}"), &[(&format!("e{n}"), "c1", n as i64)]),
            at,
        );
    }
    accept_at(&store, &delivery("d5", &[("e5", "c2", 5)]), 5_000);
    let applied = drain_received(&store, &rules);
    let ids: Vec<&str> = applied.outbox.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["e1/reply/0", "e2/reply/0", "e5/reply/0"]);
    assert_eq!(applied.capped, ["reply", "reply"], "e3 and e4 of c1");
    // What the bridge sends carries its marker, so the service's echo is recognised.
    for entry in &applied.outbox {
        match &entry.action {
            Action::SendMessage { custom, .. } => assert_eq!(
                custom.as_deref(),
                Some(format!("handoff-bridge:{}", entry.id).as_str())
            ),
            other => panic!("a message: {other:?}"),
        }
    }
    assert_eq!(
        store.outbox().expect("outbox"),
        applied.outbox,
        "stored marked"
    );

    // Written in the fold's journal, with the state.
    let c1 = store
        .conversation(&ConversationId::new("c1"))
        .expect("read")
        .expect("c1");
    assert_eq!(c1.firings["reply"].at, [1_000, 2_000]);
    let hit = &c1.capped["reply"];
    assert_eq!(
        (hit.at, hit.event.as_str(), hit.fired, hit.hits),
        (4_000, "e4", 2, 2)
    );
    let c2 = store
        .conversation(&ConversationId::new("c2"))
        .expect("read")
        .expect("c2");
    assert_eq!(c2.firings["reply"].at, [5_000]);
    assert!(c2.capped.is_empty());

    // A replay (today's clock) rebuilds the history by receive time: the same events are capped,
    // and what it would queue is marked alike.
    let request = replay::ReplayRequest {
        from: 0,
        to: 10_000,
        dry_run: false,
        force: true,
    };
    let report = store.replay(&request, &rules).expect("replay");
    let capped: Vec<(&str, &str)> = report
        .capped
        .iter()
        .map(|c| (c.event_id.as_str(), c.rule.as_str()))
        .collect();
    assert_eq!(capped, [("e3", "reply"), ("e4", "reply")]);
    assert_eq!(report.queued, 3);
    for (item, entry) in report.items.iter().zip(&report.entries) {
        assert_eq!(item.action, entry.action);
        match &entry.action {
            Action::SendMessage { custom, .. } => assert_eq!(
                custom.as_deref(),
                Some(format!("handoff-bridge:{}", entry.id).as_str()),
                "named by the id it goes under"
            ),
            other => panic!("a message: {other:?}"),
        }
    }

    // A minute after the first firing the window has slid: c1's rule fires again.
    accept_at(&store, &delivery("d6", &[("e6", "c1", 6)]), 61_500);
    let applied = drain_received(&store, &rules);
    assert_eq!(applied.outbox.len(), 1);
    assert!(applied.capped.is_empty());
    let c1 = store
        .conversation(&ConversationId::new("c1"))
        .expect("read")
        .expect("c1");
    assert_eq!(c1.firings["reply"].at, [2_000, 61_500]);
    assert_eq!(c1.capped["reply"].hits, 2, "the audit stays");
}

#[test]
fn a_template_reads_the_end_users_params_from_the_batch_or_the_store() {
    let (_d, store) = store();
    let rules = engine::rules::RuleSet::from_sources(&[(
        "tier.toml".into(),
        "[[rule]]\nname = \"tier\"\non = [\"bot.message.received\"]\n\
         actions = [{ type = \"send_message\", text = \"tier {{ end_user.params.tier }}\" }]\n"
            .into(),
    )])
    .expect("rules");
    let user = |id: &str, kind: &str, tier: &str| {
        format!(
            r#"{{"id":"{id}","event":"bot.end_user.{kind}","sourceType":"bot","sourceId":"B1","timestamp":1,
            "data":{{"endUser":{{"id":"u1","platform":"web","userKey":"k1","params":{{"tier":"{tier}"}}}}}}}}"#
        )
    };
    let message = |id: &str| {
        format!(
            r#"{{"id":"{id}","event":"bot.message.received","sourceType":"bot","sourceId":"B1","timestamp":3,
            "data":{{"message":{{"id":"m{id}","conversationId":"c9","isUser":true,"meta":null,"data":{{"type":"text","text":"x"}}}}}}}}"#
        )
    };
    let wrap = |id: &str, events: &[String]| {
        format!(
            r#"{{"id":"{id}","webhookId":"w","webhookUrl":"u","messages":[{}]}}"#,
            events.join(",")
        )
        .into_bytes()
    };
    let created = r#"{"id":"e2","event":"bot.conversation.created","sourceType":"bot","sourceId":"B1","timestamp":2,
        "data":{"conversation":{"id":"c9","endUserId":"u1","platform":"web","userKey":"k1"}}}"#;
    let texts = |applied: &Applied| -> Vec<String> {
        applied
            .outbox
            .iter()
            .filter_map(|e| match &e.action {
                model::action::Action::SendMessage { message, .. } => message.text.clone(),
                _ => None,
            })
            .collect()
    };

    // The end user's event is in the same batch: the fold reads it from its cache.
    let first = [
        user("e1", "created", "gold"),
        created.to_owned(),
        message("e3"),
    ];
    accept(&store, &wrap("d1", &first));
    assert_eq!(texts(&drain_with(&store, &rules)), vec!["tier gold"]);

    // Folded in an earlier batch: read from the store.
    accept(&store, &wrap("d2", &[user("e4", "updated", "platinum")]));
    assert!(drain_with(&store, &rules).outbox.is_empty());
    accept(&store, &wrap("d3", &[message("e5")]));
    assert_eq!(texts(&drain_with(&store, &rules)), vec!["tier platinum"]);
}

#[test]
fn record_counts_are_kept_by_the_folds_so_a_start_need_not_walk_the_trees() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    let counted = |store: &SledStore| {
        let meta = |key: &[u8]| {
            store
                .meta
                .get(key)
                .expect("meta")
                .and_then(|b| keys::parse_seq(&b))
        };
        (
            meta(keys::meta::COUNT_CONVERSATIONS),
            meta(keys::meta::COUNT_BOTS),
        )
    };
    {
        let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
        // A fresh store: counted once (nothing), kept from then on.
        assert_eq!(store.sizes().expect("sizes").conversations, 0);
        accept(&store, &delivery("d1", &[("e1", "c1", 1), ("e2", "c2", 2)]));
        drain(&store);
        accept(&store, &delivery("d2", &[("e3", "c1", 3), ("e4", "c3", 4)]));
        drain(&store);
        assert_eq!(
            counted(&store),
            (Some(3), Some(0)),
            "c1, c2, c3; no bot events"
        );
        assert_eq!(
            store.sizes().expect("sizes").conversations,
            store.conversations.len() as u64
        );
        store.flush().expect("flush");
    }
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    assert_eq!(
        store.sizes().expect("sizes").conversations,
        3,
        "read from the kept count"
    );
    // A store from before the counts: counted once, then kept.
    store
        .meta
        .remove(keys::meta::COUNT_CONVERSATIONS)
        .expect("remove");
    assert_eq!(store.sizes().expect("sizes").conversations, 3);
    assert_eq!(counted(&store).0, Some(3));
}

#[test]
fn a_delivery_of_only_invalid_events_is_known_after_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    let id = DeliveryId::new("d-bad");
    let bad = [QuarantineRecord::new(
        "event",
        "invalid_event",
        "why",
        b"{}",
        5,
    )];
    let request = AcceptRequest {
        delivery: &id,
        events: &[],
        invalid: &bad,
        received_at: 5,
    };
    {
        let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
        let out = store.accept_many(&[request]).expect("accept");
        assert_eq!(out[0].quarantined.len(), 1);
    }
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    let out = store.accept_many(&[request]).expect("accept again");
    assert!(out[0].duplicate_delivery, "recorded by its (empty) frame");
    assert_eq!(
        store.quarantined().expect("list").len(),
        1,
        "not quarantined twice"
    );
    assert!(store.pending().expect("pending").is_empty());
}

#[test]
fn a_hash_match_is_only_a_candidate_the_frame_decides() {
    let (_d, store) = store();
    accept(&store, &delivery("d1", &[("e1", "c1", 1)]));
    let at = store
        .log
        .candidates(dedupe::event_hash("e1"))
        .expect("candidates")[0];
    // Pretend "e2" and "d2" collide with what is in that frame.
    store
        .log
        .dedupe
        .lock()
        .expect("lock")
        .insert(at, "d2", &["e2"])
        .expect("insert");
    assert!(!store.seen_event("e2").expect("seen"));
    assert!(!store.seen_delivery("d2").expect("seen"));
    assert!(store.event_by_id(&"e2".into()).expect("read").is_none());
    let out = accept(&store, &delivery("d2", &[("e2", "c1", 2)]));
    assert_eq!((out.new.len(), out.duplicate_delivery), (1, false));
    assert!(store.seen_event("e1").expect("seen"));
}

#[test]
fn a_layout_2_stores_dedupe_records_hold_until_past_the_window_then_go() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    {
        // A layout-2 store: its dedupe records in sled, one of them for an event no longer in
        // the log (layout 1 pruned its body before migrating), and a delivery likewise.
        let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
        accept(&store, &delivery("d1", &[("e1", "c1", 1)]));
        store
            .meta
            .insert(keys::meta::LAYOUT_VERSION, &2u32.to_be_bytes())
            .expect("layout");
        let seen = store.db.open_tree(keys::tree::SEEN).expect("seen");
        seen.insert("gone", &keys::seq(7)).expect("record");
        let deliveries = store
            .db
            .open_tree(keys::tree::DELIVERIES)
            .expect("deliveries");
        deliveries
            .insert("d-gone", &5i64.to_be_bytes())
            .expect("delivery");
        store.flush().expect("flush");
    }
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("upgrade");
    let layout = store.meta.get(keys::meta::LAYOUT_VERSION).expect("read");
    assert_eq!(layout.as_deref(), Some(&LAYOUT_VERSION.to_be_bytes()[..]));
    let out = accept(
        &store,
        &delivery("d9", &[("gone", "c1", 1), ("e1", "c1", 1)]),
    );
    assert_eq!(
        out.duplicate_events, 2,
        "the legacy record and the log both count"
    );
    assert!(accept(&store, &delivery("d-gone", &[("x", "c1", 1)])).duplicate_delivery);
    // Still inside the window (the upgrade was just now): kept, across a restart too.
    assert_eq!(store.prune(0, 0).expect("prune").ids_forgotten, 0);
    drop(store);
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    assert!(store.seen_event("gone").expect("seen"));
    // Past the window: the trees go, and the ids are new again.
    let later = model::clock::system_millis() + 1_000;
    assert_eq!(store.prune(later, 0).expect("prune").ids_forgotten, 2);
    assert!(!store.seen_event("gone").expect("seen"));
    assert!(!store
        .db
        .tree_names()
        .iter()
        .any(|n| n.as_ref() == keys::tree::SEEN.as_bytes()));
    drop(store);
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    assert!(!store.seen_delivery("d-gone").expect("seen"));
    assert!(store.seen_event("e1").expect("seen"), "the log's ids stay");
}

#[test]
fn a_damaged_frame_the_dedupe_index_points_at_is_an_error_not_a_new_id() {
    let (dir, store) = store();
    accept(&store, &delivery("d1", &[("e1", "c1", 1)]));
    // Damage the frame's payload in place.
    let segment = eventlog::segments(&store.log_dir).expect("segments")[0];
    let path = eventlog::segment_path(&store.log_dir, segment);
    let mut bytes = std::fs::read(&path).expect("read");
    let last = bytes.len() - 2;
    bytes[last] ^= 0x55;
    std::fs::write(&path, bytes).expect("write");
    assert!(matches!(store.seen_event("e1"), Err(StoreError::Log(_))));
    let again = parse_delivery(&delivery("d2", &[("e1", "c1", 1)])).expect("parse");
    assert!(
        store.accept(&again.id, &again.events, 5).is_err(),
        "refused (503 for the service), not stored a second time"
    );
    drop(dir);
}

#[test]
fn event_numbers_keep_growing_across_restarts_and_past_a_recovered_tail() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    {
        let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
        for i in 0..50 {
            let body = delivery(&format!("d{i}"), &[(&format!("e{i}"), "c1", i)]);
            assert_eq!(accept(&store, &body).new.len(), 1);
        }
        // Acknowledged, never indexed: its numbers are above the floor the index recorded.
        log_only(
            &store,
            &delivery("dt", &[("et1", "c2", 60), ("et2", "c2", 61)]),
            2_000,
        );
    }
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    let seen: Vec<u64> = store
        .pending()
        .expect("pending")
        .iter()
        .map(|(seq, _)| seq)
        .collect();
    assert_eq!(seen.len(), 52, "50 accepted and 2 recovered events");
    let before = *seen.iter().max().expect("numbers");
    let after = accept(&store, &delivery("dn", &[("en", "c3", 70)])).new;
    assert_eq!(after.len(), 1);
    assert!(
        after[0].0 > before,
        "new event numbered {} after {before}",
        after[0].0
    );
    drop(store);
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen again");
    let again = accept(&store, &delivery("dm", &[("em", "c3", 80)])).new;
    assert!(
        again[0].0 > after[0].0,
        "numbers never repeat after a restart"
    );
}

/// The conversation's folded event count.
fn events_applied(store: &SledStore, conversation: &str) -> Option<u64> {
    store
        .conversation(&conversation.into())
        .expect("read")
        .map(|s| s.events_applied)
}

/// Fold the pending events with these ids, with a given watermark.
fn fold_ids(store: &SledStore, ids: &[&str], fold_from: Option<Cursor>) -> Applied {
    let position = Position {
        fold_from,
        ..Default::default()
    };
    let records = pending_records(store).0;
    fold_picked(
        store,
        &records,
        |rec| ids.contains(&rec.id.as_str()),
        &position,
    )
}

/// Fold the pending event `folded` while `passed` (of the same partition) is passed over in the
/// same fold, as an unreadable event is.
fn fold_passing_over(store: &SledStore, folded: &str, passed: &str) -> Applied {
    let (records, end) = pending_records(store);
    let find = |id: &str| {
        records
            .iter()
            .find(|(_, rec)| rec.id.as_str() == id)
            .map(|(p, _)| p)
            .expect("pending")
    };
    let passed = find(passed);
    let position = Position {
        fold_from: Some(end),
        passed: vec![passed.clone()],
        ..Default::default()
    };
    fold_picked(store, &records, |rec| rec.id.as_str() == folded, &position)
}

/// Turn a store into what layout 3 left, inbox aside: no folded marks, no watermark.
fn as_layout_3(store: &SledStore) {
    store.folded.clear().expect("marks");
    store.meta.remove(keys::meta::FOLD_FROM).expect("watermark");
    store
        .meta
        .insert(keys::meta::LAYOUT_VERSION, &3u32.to_be_bytes())
        .expect("layout");
    store.flush().expect("flush");
}

#[test]
fn a_restart_resumes_each_partition_after_its_folded_mark_wherever_the_watermark_stands() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    {
        let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
        accept(
            &store,
            &delivery("d1", &[("e1", "c1", 1), ("e2", "c2", 2), ("e3", "c1", 3)]),
        );
        accept(&store, &delivery("d2", &[("e4", "c1", 4)]));
        // c1's first event and all of c2 are folded, by a fold that left the watermark where it
        // was (the start of the log): the marks alone must tell what is left.
        let applied = fold_ids(&store, &["e1", "e2"], None);
        assert_eq!(applied.applied, 2);
        assert_eq!(pending_ids(&store), vec!["e3", "e4"]);
        store.flush().expect("flush");
    }
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    assert_eq!(pending_ids(&store), vec!["e3", "e4"]);
    // The rest folds on; then a batch repeating a folded event (e1) skips it.
    let applied = fold_ids(&store, &["e3"], None);
    assert_eq!((applied.applied, applied.skipped), (1, 0));
    let e1 = store.event_by_id(&"e1".into()).expect("read").expect("e1");
    let again = store
        .apply(&[(e1.seq, parse_event(e1.event.get()).expect("parse"))])
        .expect("apply");
    assert_eq!(
        (again.applied, again.skipped),
        (0, 1),
        "e1 is below c1's mark"
    );
    drain(&store);
    assert_eq!(events_applied(&store, "c1"), Some(3));
    assert_eq!(events_applied(&store, "c2"), Some(1));
    // The drain wrote the log's end as the watermark: nothing is left to scan.
    assert_eq!(
        store.fold_from().expect("watermark"),
        store.pending().expect("p").end
    );
    drop(store);
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    assert!(store.pending().expect("pending").is_empty());
}

#[test]
fn an_event_passed_over_is_marked_folded_with_the_fold_and_not_before() {
    let (_d, store) = store();
    accept(&store, &delivery("d1", &[("e1", "c1", 1), ("e2", "c1", 2)]));
    // e1 is passed over (unreadable, quarantined) in the same fold that folds e2: the mark ends
    // at e2, and e2 is folded although e1's number is below it.
    let applied = fold_passing_over(&store, "e2", "e1");
    assert_eq!(applied.applied, 1);
    assert_eq!(events_applied(&store, "c1"), Some(1), "e2 only");
    assert!(store.pending().expect("pending").is_empty());
}

#[test]
fn a_layout_3_store_moves_its_inbox_into_folded_marks_exactly_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    {
        let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
        accept(
            &store,
            &delivery("d1", &[("e1", "c1", 1), ("e2", "c1", 2), ("e3", "c2", 3)]),
        );
        accept(&store, &delivery("d2", &[("e4", "c1", 4)]));
        // Logged (acknowledged) but not indexed before a crash: past the checkpoint.
        log_only(
            &store,
            &delivery("d3", &[("e5", "c1", 5), ("e6", "c3", 6)]),
            3_000,
        );
        fold_ids(&store, &["e1", "e3"], None);
        assert_eq!(events_applied(&store, "c1"), Some(1));
        // Turn it into what layout 3 left: no marks, no watermark, e2 and e4 in the sled inbox.
        let waiting: Vec<PendingEvent> = store
            .pending()
            .expect("pending")
            .events
            .into_iter()
            .filter(|p| {
                let id = store.event_at(p.seq, p.at).expect("read").expect("rec").id;
                ["e2", "e4"].contains(&id.as_str())
            })
            .collect();
        assert_eq!(waiting.len(), 2);
        let inbox = store.db.open_tree(keys::tree::INBOX).expect("inbox");
        for p in &waiting {
            inbox
                .insert(
                    keys::seq(p.seq),
                    keys::inbox_value(p.at.into(), &p.partition.encode()),
                )
                .expect("inbox");
        }
        as_layout_3(&store);
    }
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("migrate");
    assert_eq!(pending_ids(&store), vec!["e2", "e4", "e5", "e6"]);
    assert_eq!(store.check_layout().expect("layout"), LAYOUT_VERSION);
    assert!(
        !store
            .db
            .tree_names()
            .iter()
            .any(|n| n.as_ref() == keys::tree::INBOX.as_bytes()),
        "the inbox is dropped"
    );
    drain(&store);
    assert_eq!(
        events_applied(&store, "c1"),
        Some(4),
        "e1, e2, e4, e5 once each"
    );
    assert_eq!(events_applied(&store, "c2"), Some(1));
    assert_eq!(events_applied(&store, "c3"), Some(1));
    drop(store);
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("reopen");
    assert!(
        store.pending().expect("pending").is_empty(),
        "migrated once"
    );
    assert_eq!(events_applied(&store, "c1"), Some(4));
}

#[test]
fn an_event_passed_over_after_folded_ones_of_its_partition_does_not_hide_them() {
    let (_d, store) = store();
    accept(&store, &delivery("d1", &[("e1", "c1", 1), ("e2", "c1", 2)]));
    // e1 folds, and e2 (later) is passed over in the same fold.
    let applied = fold_passing_over(&store, "e1", "e2");
    assert_eq!(applied.applied, 1);
    assert_eq!(events_applied(&store, "c1"), Some(1), "e1 folded");
    assert!(store.pending().expect("pending").is_empty());
}

#[test]
fn events_folded_before_a_migration_are_not_pending_though_they_have_no_mark() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    {
        let store = SledStore::open(&path, 8 * 1024 * 1024).expect("open");
        accept(&store, &delivery("d1", &[("e1", "c1", 1), ("e2", "c2", 2)]));
        drain(&store);
        // What layout 3 left with everything folded: an empty inbox, no marks, no watermark.
        as_layout_3(&store);
    }
    let store = SledStore::open(&path, 8 * 1024 * 1024).expect("migrate");
    assert!(store.pending().expect("pending").is_empty());
    let (_, e1_pending) = store.event_status(&"e1".into()).expect("read").expect("e1");
    assert!(!e1_pending, "folded before the watermark");
    let mut flags = Vec::new();
    store
        .scan_events(|record, pending| {
            flags.push((record.id.to_string(), pending));
            ControlFlow::Continue(())
        })
        .expect("scan");
    assert_eq!(
        flags,
        vec![("e1".to_owned(), false), ("e2".to_owned(), false)]
    );
}

#[test]
fn an_entrys_retry_state_is_kept_and_leaves_with_its_outcome() {
    let (_d, store) = store();
    accept_at(
        &store,
        &delivery("d1", &[("e1", "c1", 1), ("e2", "c2", 2)]),
        1_000,
    );
    let applied = drain_with(&store, &one_message_rule("greet"));
    let [done, dead] = &applied.outbox[..] else {
        panic!("two entries: {:?}", applied.outbox);
    };
    assert_eq!(
        store.outbox_last_seq().expect("last"),
        Some(dead.seq.max(done.seq))
    );
    let state = model::action::RetryState {
        attempts: 3,
        failures: 3,
        first_failure_at: Some(1_000),
        last_error: Some("the upstream answered 503".into()),
        next_attempt_at: Some(9_000),
        ..Default::default()
    };
    for e in [done, dead] {
        assert_eq!(store.outbox_retry_state(e.seq).expect("read"), None);
        store.set_outbox_retry_state(e.seq, &state).expect("write");
        assert_eq!(
            store.outbox_retry_state(e.seq).expect("read"),
            Some(state.clone())
        );
    }
    store.outbox_done(done, 4, 10_000).expect("done");
    store
        .outbox_dead(&dead_letter(dead, "retries_exhausted", false))
        .expect("dead");
    for e in [done, dead] {
        assert_eq!(
            store.outbox_retry_state(e.seq).expect("read"),
            None,
            "removed in the outcome's transaction"
        );
    }
    assert_eq!(store.outbox_last_seq().expect("last"), None);
}
