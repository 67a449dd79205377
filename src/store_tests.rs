//! The daemon's views over a real store: the audit and the quarantine view (`queries`), the
//! executor's ledger of dead letters (`outbox`). Their store helpers mirror the storage crate's
//! own tests.

use model::ids::ConversationId;
use storage::port::*;
use storage::test_support::*;
use storage::*;

#[test]
fn a_large_quarantined_body_is_stored_compressed_and_read_back_whole() {
    let (_d, store) = store();
    let body = format!(
        r#"{{"id":"d","webhookId":"w","webhookUrl":"u","messages":[{}]}}"#,
        vec!["{}"; 200_000].join(",")
    );
    let record = QuarantineRecord::new("delivery", "too_many_events", "x", body.as_bytes(), 5);
    assert!(record.body_gzip, "{} bytes are compressed", body.len());
    assert!(
        record.body_base64.len() < body.len() / 20,
        "stored {} bytes for {}",
        record.body_base64.len(),
        body.len()
    );
    let id = store.quarantine(record).expect("quarantine");
    let back = store.quarantined_one(id).expect("get").expect("record");
    assert_eq!(back.body().expect("body"), body.as_bytes());
    let view = crate::queries::quarantine_view(&back);
    assert!(view.get("body_gzip").is_none(), "{view:?}");
    assert_eq!(view["body_text"].as_str(), Some(body.as_str()));
    // Small bodies stay as they were, and a record from before the field reads as uncompressed.
    let small = QuarantineRecord::new("delivery", "invalid_json", "x", b"{bad", 5);
    assert!(!small.body_gzip);
    let old = r#"{"id":1,"received_at":5,"scope":"delivery","reason":"invalid_json","detail":"x","delivery_id":null,"content_type":null,"body_base64":"e2JhZA=="}"#;
    let old: QuarantineRecord = serde_json::from_str(old).expect("old record");
    assert_eq!(old.body().expect("body"), b"{bad");
}

#[test]
fn the_audit_finds_each_events_actions_through_the_ledger_and_only_its_own() {
    let (_d, store) = store();
    // `e1/x` (another conversation) has action ids starting with `e1/`, as `e1`'s do.
    accept_at(
        &store,
        &delivery(
            "d1",
            &[
                ("e1", "c1", 1),
                ("e2", "c1", 2),
                ("e3", "c1", 3),
                ("e1/x", "c2", 4),
            ],
        ),
        1_000,
    );
    let rules = one_message_rule("greet");
    let applied = drain_with(&store, &rules);
    let [done, dead, pending, other] = &applied.outbox[..] else {
        panic!("four entries: {:?}", applied.outbox);
    };
    assert_eq!(other.id, "e1/x/greet/0");
    store.outbox_done(done, 1, 2_000).expect("done");
    store
        .outbox_dead(&dead_letter(dead, "http_400", true))
        .expect("dead");
    store.outbox_done(other, 1, 2_000).expect("done");
    let audit = crate::queries::audit(&store, &rules, Some(&rules), &ConversationId::new("c1"))
        .expect("audit")
        .expect("conversation");
    let actions = |i: usize| -> Vec<(String, String)> {
        audit["timeline"][i]["actions"]
            .as_array()
            .expect("actions")
            .iter()
            .map(|a| {
                let field = |k: &str| a[k].as_str().unwrap_or_default().to_owned();
                (field("id"), field("status"))
            })
            .collect()
    };
    let status = |id: &str, s: &str| vec![(id.to_owned(), s.to_owned())];
    assert_eq!(actions(0), status("e1/greet/0", "done"), "{audit:#}");
    assert_eq!(actions(1), status("e2/greet/0", "dead_letter"));
    assert_eq!(actions(2), status("e3/greet/0", "pending"));
    assert_eq!(audit["timeline"].as_array().map(Vec::len), Some(3));
    assert_eq!(pending.id, "e3/greet/0");
}

#[test]
fn the_fold_a_replay_and_the_audit_compare_with_the_state_before_each_event() {
    use replay::ReplayRequest;
    let (_d, store) = store();
    let rules = engine::rules::RuleSet::from_sources(&[(
        "first.toml".into(),
        "[[rule]]\nname = \"first\"\non = [\"bot.message.received\"]\n\
         when = { field = \"state.user_messages\", changed = { from = 0 } }\n\
         actions = [{ type = \"send_message\", text = \"welcome\" }]\n"
            .into(),
    )])
    .expect("rules");
    accept_at(
        &store,
        &delivery("d1", &[("e1", "c1", 1), ("e2", "c1", 2)]),
        1_000,
    );
    let applied = drain_with(&store, &rules);
    let ids: Vec<&str> = applied.outbox.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, vec!["e1/first/0"], "only the first message: 0 -> 1");

    let request = ReplayRequest {
        from: 0,
        to: 2_000,
        dry_run: true,
        force: false,
    };
    let report = store.replay(&request, &rules).expect("replay");
    let replayed: Vec<&str> = report.items.iter().map(|i| i.id.as_str()).collect();
    assert_eq!(replayed, vec!["e1/first/0"]);

    let audit = crate::queries::audit(&store, &rules, Some(&rules), &ConversationId::new("c1"))
        .expect("audit")
        .expect("conversation");
    let second = &audit["timeline"][1]["rules"][0];
    assert_eq!(second["matched"], false, "{audit:#}");
    assert_eq!(second["failed"]["before"], 1);
    assert_eq!(second["failed"]["actual"], 2);
    assert_eq!(audit["timeline"][0]["rules"][0]["matched"], true);
}

#[test]
fn the_audit_shows_a_firing_of_a_cancelled_timer_as_stale_and_a_live_one_as_matched() {
    let (_d, store) = store();
    let set = timer_rules();
    accept(&store, &said("d1", "e1", "c1", "start"));
    drain_with(&store, &set);
    let first = all_timers(&store);
    // The firing is on its way when the cancel is folded first: it decides nothing.
    accept(&store, &said("d2", "e2", "c1", "cancel"));
    fire(&store, &first[0]);
    let applied = drain_with(&store, &set);
    assert!(applied.outbox.is_empty(), "{:?}", applied.outbox);
    // Started again, later (the timer's due time counts from the receive time), and fired on
    // time: it decides.
    accept_at(&store, &said("d3", "e3", "c1", "start"), 3_000);
    drain_with(&store, &set);
    let second = all_timers(&store);
    fire(&store, &second[0]);
    let applied = drain_with(&store, &set);
    assert_eq!(applied.outbox.len(), 1, "x fired");

    let audit = crate::queries::audit(&store, &set, Some(&set), &ConversationId::new("c1"))
        .expect("audit")
        .expect("conversation");
    let firings: Vec<&serde_json::Value> = audit["timeline"]
        .as_array()
        .expect("timeline")
        .iter()
        .filter(|e| e["type"] == "timer.x")
        .collect();
    assert_eq!(firings.len(), 2, "{audit:#}");
    assert_eq!(firings[0]["stale_timer"], true, "{audit:#}");
    assert!(firings[0].get("rules").is_none(), "no rule ran: {audit:#}");
    assert_eq!(firings[0]["actions"], serde_json::json!([]), "{audit:#}");
    assert!(firings[1].get("stale_timer").is_none(), "{audit:#}");
    let fired = &firings[1]["rules"][0];
    assert_eq!(fired["rule"], "fired", "{audit:#}");
    assert_eq!(fired["matched"], true, "{audit:#}");
    assert_eq!(fired["actions"], serde_json::json!(["send_message"]));
}

#[test]
fn the_quarantine_list_pages_metadata_with_the_body_size_as_received() {
    let (_d, store) = store();
    let big = vec![b'x'; 200_000];
    let mut ids = Vec::new();
    for i in 0..5u8 {
        let body: &[u8] = if i == 2 { &big } else { b"{bad" };
        let record = QuarantineRecord::new("delivery", "invalid_json", "x", body, i64::from(i));
        ids.push(store.quarantine(record).expect("quarantine"));
    }
    let (first, next) = store.quarantine_page(None, 2).expect("page");
    assert_eq!(first.iter().map(|m| m.id).collect::<Vec<_>>(), ids[..2]);
    assert_eq!(next, Some(ids[1]));
    let (second, next) = store.quarantine_page(next, 2).expect("page");
    assert_eq!(second.iter().map(|m| m.id).collect::<Vec<_>>(), ids[2..4]);
    // The gzip-compressed body's size as received, from its trailer.
    assert!(second[0].body_gzip);
    assert_eq!(second[0].body_bytes, 200_000);
    assert_eq!((second[1].body_gzip, second[1].body_bytes), (false, 4));
    let (last, next) = store.quarantine_page(next, 2).expect("page");
    assert_eq!(last.iter().map(|m| m.id).collect::<Vec<_>>(), ids[4..]);
    assert_eq!(next, None, "no more");
    // Exactly a page left: no `next`, and after the last id nothing.
    assert_eq!(
        store.quarantine_page(Some(ids[2]), 2).expect("page").1,
        None
    );
    assert!(store
        .quarantine_page(Some(ids[4]), 2)
        .expect("page")
        .0
        .is_empty());
    // The view shows at most its cap of the body, and says so.
    let record = store.quarantined_one(ids[2]).expect("get").expect("record");
    assert_eq!(record.body_len(), 200_000);
    assert_eq!(record.body_prefix(1000).expect("prefix"), vec![b'x'; 1000]);
    let view = crate::queries::quarantine_view(&record);
    assert_eq!(
        (
            view["body_bytes"].as_u64(),
            view["body_truncated"].as_bool()
        ),
        (Some(200_000), Some(false))
    );
    let huge = vec![b'y'; crate::queries::QUARANTINE_VIEW_BODY + 10];
    let record = QuarantineRecord::new("delivery", "invalid_json", "x", &huge, 9);
    let view = crate::queries::quarantine_view(&record);
    assert_eq!(
        (
            view["body_bytes"].as_u64(),
            view["body_truncated"].as_bool()
        ),
        (Some(huge.len() as u64), Some(true))
    );
    assert_eq!(
        view["body_text"].as_str().map(str::len),
        Some(crate::queries::QUARANTINE_VIEW_BODY)
    );
}

#[test]
fn the_executor_reads_the_dead_letters_page_by_page_on_start() {
    use crate::outbox::Ledger;
    let (_d, store) = store();
    let store: Store = std::sync::Arc::new(store);
    let n = 2_345u64;
    for seq in 1..=n {
        let entry = crate::test_support::outbox_entry(seq, &format!("c:q{}", seq % 7));
        let mut letter = dead_letter(&entry, "retries_exhausted", false);
        letter.blocking = seq % 1_000 == 0;
        store.outbox_dead(&letter).expect("dead");
    }
    let letters = store.blocking_queues().expect("letters");
    assert_eq!(letters.count as u64, n, "every page counted");
    let mut blocked: Vec<String> = letters.blocked.into_iter().collect();
    blocked.sort();
    // Seqs 1000 and 2000 (queues 1000 % 7 = 6, 2000 % 7 = 5), on two different pages.
    assert_eq!(blocked, ["c:q5", "c:q6"]);
}
