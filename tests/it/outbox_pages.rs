//! Issue 20: the outbox and dead-letter lists page (`?limit=&after=`, `next` the cursor to the
//! next page or null), online and offline, in the API and the CLI; a bad limit or cursor is a 400
//! with a stable code; `depth` stays the executor's exact count; retrying every dead letter walks
//! them a page at a time (more than one page here).

use crate::common::relay::{clear_faults, seeded_message, set_faults, AGAIN_RULE, ECHO_RULE};
use crate::common::{cli, cli_ok, delivery, wait_drained, Spawn, TestApp};
use serde_json::{json, Value};
use std::time::Duration;

fn rules(root: &std::path::Path) -> std::path::PathBuf {
    crate::common::relay::rules_dir(root, &format!("{ECHO_RULE}{AGAIN_RULE}"))
}

fn message(n: usize) -> Value {
    seeded_message("pg", n)
}

fn post_messages(app: &TestApp, range: std::ops::Range<usize>) {
    let events: Vec<Value> = range.clone().map(message).collect();
    let (status, receipt) = app.post(&delivery(&format!("pg-d-{}", range.start), &events));
    assert_eq!(status, 200, "{receipt}");
    assert_eq!(receipt["accepted"], range.len(), "{receipt}");
    wait_drained(app);
}

fn seqs(page: &Value, items: &str) -> Vec<u64> {
    page[items]
        .as_array()
        .unwrap_or_else(|| panic!("no {items}: {page}"))
        .iter()
        .map(|e| {
            e["seq"]
                .as_u64()
                .or_else(|| e["entry"]["seq"].as_u64())
                .expect("seq")
        })
        .collect()
}

/// Every page of `path` with `limit`, following `next`: the seqs in order.
fn walk(app: &TestApp, path: &str, items: &str, limit: usize) -> (Vec<u64>, usize) {
    let (mut all, mut pages, mut after) = (Vec::new(), 0, None::<u64>);
    loop {
        let url = match after {
            Some(a) => format!("{path}?limit={limit}&after={a}"),
            None => format!("{path}?limit={limit}"),
        };
        let (status, page) = app.admin_get(&url);
        assert_eq!(status, 200, "{url}: {page}");
        let got = seqs(&page, items);
        assert!(got.len() <= limit, "{url}: {} items", got.len());
        assert_eq!(page["count"], got.len(), "{page}");
        pages += 1;
        all.extend(&got);
        match page["next"].as_u64() {
            Some(next) => {
                assert_eq!(got.len(), limit, "a page before the last is full");
                assert_eq!(Some(&next), got.last(), "next is the page's last seq");
                after = Some(next);
            }
            None => {
                assert!(
                    page["next"].is_null(),
                    "next is null on the last page: {page}"
                );
                break;
            }
        }
    }
    (all, pages)
}

/// Every decided action finished (asked in turns shorter than the client's 30 s timeout).
fn idle(app: &TestApp) {
    crate::common::poll_until("the outbox to be idle", Duration::from_secs(180), || {
        let (status, _) = app.admin_get("/admin/v1/outbox/idle?timeout_ms=20000");
        (status == 200).then_some(())
    });
}

fn cli_json(app: &TestApp, args: &[&str]) -> Value {
    let out = app.cli_ok(args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {out}"))
}

#[test]
fn the_outbox_and_dead_letter_lists_page_online_and_offline() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules(tmp.path());
    let data = tmp.path().join("data");
    let app = TestApp::spawn_in(
        &data,
        Spawn::with_env(&[("HANDOFF_BRIDGE__RULES__DIR", rules.to_str().expect("utf-8"))]),
    );
    let emu = app.emulator().to_owned();

    // 150 dead letters: every send refused for good (more than the default page).
    const DEAD: usize = 150;
    set_faults(
        &emu,
        json!({"fail_next": DEAD, "status": 400, "path_prefix": "/openapi/"}),
    );
    post_messages(&app, 0..DEAD / 2);
    idle(&app);
    clear_faults(&emu);

    // 8 pending (4 messages): the executor is paused.
    let (status, _) = app.admin_post("/admin/v1/outbox/pause");
    assert_eq!(status, 200);
    post_messages(&app, DEAD..DEAD + 4);
    crate::common::poll_until("8 entries pending", Duration::from_secs(30), || {
        (app.metric("handoff_outbox_depth") == 8.0).then_some(())
    });

    // The outbox in pages of 3: 3, 3, 2; depth is the whole count on every page.
    let (outbox, pages) = walk(&app, "/admin/v1/outbox", "entries", 3);
    assert_eq!((outbox.len(), pages), (8, 3), "{outbox:?}");
    assert!(
        outbox.windows(2).all(|w| w[0] < w[1]),
        "decision order: {outbox:?}"
    );
    let (_, page) = app.admin_get("/admin/v1/outbox?limit=3");
    assert_eq!(page["depth"], 8, "{page}");
    assert_eq!(page["paused"], true, "{page}");
    // The default page holds them all; its next is null.
    let (_, all) = app.admin_get("/admin/v1/outbox");
    assert_eq!(seqs(&all, "entries"), outbox);
    assert!(all["next"].is_null(), "{all}");

    // The dead letters: the default page is 100; pages of 100 are 100 and 50, one of 1000 all.
    let (_, first) = app.admin_get("/admin/v1/dead-letters");
    assert_eq!(seqs(&first, "dead_letters").len(), 100);
    assert_eq!(
        first["next"].as_u64(),
        seqs(&first, "dead_letters").last().copied()
    );
    let (letters, pages) = walk(&app, "/admin/v1/dead-letters", "dead_letters", 100);
    assert_eq!((letters.len(), pages), (DEAD, 2));
    let (whole, pages) = walk(&app, "/admin/v1/dead-letters", "dead_letters", 1000);
    assert_eq!((&whole, pages), (&letters, 1));
    let mut sorted = letters.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted, letters, "in order, each once");
    // Past the last: an empty page.
    let last = *letters.last().expect("letters");
    let (status, empty) = app.admin_get(&format!("/admin/v1/dead-letters?after={last}"));
    assert_eq!(status, 200);
    assert_eq!(empty["count"], 0, "{empty}");
    assert!(empty["next"].is_null(), "{empty}");

    // A bad limit or cursor: 400 with a stable code, for both lists.
    for path in ["/admin/v1/outbox", "/admin/v1/dead-letters"] {
        for (query, code) in [
            ("limit=0", "invalid_limit"),
            ("limit=1001", "invalid_limit"),
            ("limit=ten", "invalid_limit"),
            ("limit=-1", "invalid_limit"),
            ("after=-5", "invalid_cursor"),
            ("after=abc", "invalid_cursor"),
            ("limit=2&after=18446744073709551616", "invalid_cursor"),
        ] {
            let (status, body) = app.admin_get(&format!("{path}?{query}"));
            assert_eq!(status, 400, "{path}?{query}: {body}");
            assert_eq!(body["error"]["code"], code, "{path}?{query}: {body}");
        }
    }

    // The CLI through the running daemon: a page with --limit/--after, everything without.
    let page = cli_json(&app, &["outbox", "list", "--limit", "3"]);
    assert_eq!(seqs(&page, "entries"), outbox[..3]);
    assert_eq!(page["next"].as_u64(), Some(outbox[2]));
    let page = cli_json(
        &app,
        &[
            "outbox",
            "list",
            "--limit",
            "3",
            "--after",
            &outbox[5].to_string(),
        ],
    );
    assert_eq!(seqs(&page, "entries"), outbox[6..]);
    assert!(page["next"].is_null());
    let everything = cli_json(&app, &["outbox", "list"]);
    assert_eq!(seqs(&everything, "entries"), outbox);
    assert_eq!(everything["depth"], 8);
    assert_eq!(everything["paused"], true);
    let everything = cli_json(&app, &["dlq", "list"]);
    assert_eq!(everything["count"], DEAD);
    assert_eq!(seqs(&everything, "dead_letters"), letters);
    let page = cli_json(
        &app,
        &[
            "dlq",
            "list",
            "--limit",
            "2",
            "--after",
            &letters[0].to_string(),
        ],
    );
    assert_eq!(seqs(&page, "dead_letters"), letters[1..3]);
    let refused = cli(&data, &["dlq", "list", "--limit", "0"]);
    assert!(!refused.status.success(), "a zero limit is refused");

    // Stopped: the same pages from the store.
    let online_page = cli_json(&app, &["dlq", "list", "--limit", "5"]);
    assert!(app.terminate().success());
    let offline_page: Value =
        serde_json::from_str(&cli_ok(&data, &["dlq", "list", "--limit", "5"])).expect("JSON");
    assert_eq!(offline_page, online_page);
    let offline_all: Value =
        serde_json::from_str(&cli_ok(&data, &["outbox", "list"])).expect("JSON");
    assert_eq!(seqs(&offline_all, "entries"), outbox);
    assert_eq!(offline_all["count"], 8);

    // Every letter back to the outbox on the stopped store, 100 at a time.
    let retried: Value =
        serde_json::from_str(&cli_ok(&data, &["dlq", "retry", "--all"])).expect("JSON");
    let mut ids: Vec<u64> = retried["retried"]
        .as_array()
        .expect("retried")
        .iter()
        .map(|v| v.as_u64().expect("id"))
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, letters, "every letter, each once");
    let left: Value = serde_json::from_str(&cli_ok(&data, &["dlq", "list"])).expect("JSON");
    assert_eq!(left["count"], 0, "{left}");
    let pending: Value = serde_json::from_str(&cli_ok(&data, &["outbox", "list"])).expect("JSON");
    assert_eq!(pending["count"], 8 + DEAD);
    assert_eq!(pending["depth"], 8 + DEAD);
}

#[test]
fn retrying_every_dead_letter_walks_them_a_page_at_a_time() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let rules = rules(tmp.path());
    let data = tmp.path().join("data");
    let app = TestApp::spawn_in(
        &data,
        Spawn::with_env(&[("HANDOFF_BRIDGE__RULES__DIR", rules.to_str().expect("utf-8"))]),
    );
    let emu = app.emulator().to_owned();
    // More than two pages of letters (the retry reads 100 at a time).
    const DEAD: usize = 250;
    set_faults(
        &emu,
        json!({"fail_next": DEAD, "status": 400, "path_prefix": "/openapi/"}),
    );
    post_messages(&app, 0..DEAD / 2);
    idle(&app);
    clear_faults(&emu);
    let (letters, _) = walk(&app, "/admin/v1/dead-letters", "dead_letters", 100);
    assert_eq!(letters.len(), DEAD);

    let (status, retried) = app.admin_post("/admin/v1/dead-letters/retry");
    assert_eq!(status, 200, "{retried}");
    let mut ids: Vec<u64> = retried["retried"]
        .as_array()
        .expect("retried")
        .iter()
        .map(|v| v.as_u64().expect("id"))
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, letters, "every letter, each once");
    idle(&app);
    let (_, left) = app.admin_get("/admin/v1/dead-letters");
    assert_eq!(left["count"], 0, "{left}");
    // Each retried send took effect once (under a new key: the refusal is kept under the old).
    let sends = app
        .journal()
        .iter()
        .filter(|e| crate::common::took_effect(e) && e["endpoint"] == "send-conversation-message")
        .count();
    assert_eq!(sends, DEAD);
}
