//! Issue 21: every admin list pages the same way (`?limit=` 1..1000, default 100; `?after=` the
//! previous page's `next`; `next` null after the last page), the conversations and end users (new
//! lists, in id order, summaries only), the quarantine and the finished entries too; a bad limit
//! or cursor is a 400 with a stable code; the CLI prints a page, or with `--all` every item as
//! JSON lines, through the running daemon and on the stopped store alike. (The outbox and the
//! dead letters: tests/it/outbox_pages.rs.)

use crate::common::relay::{daemon_env, rules_dir, seeded_message, AGAIN_RULE, ECHO_RULE, SEEDED};
use crate::common::{cli, cli_ok, delivery, fixture_value, Spawn, TestApp};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::Duration;

const CONVERSATIONS: usize = 250;
const MESSAGES: usize = 125;
const QUARANTINED: usize = 120;

fn conversation_id(n: usize) -> String {
    format!("cp-{n:04}")
}

fn end_user_id(n: usize) -> String {
    format!("eu-{n:04}")
}

/// A `bot.conversation.created` of a conversation of its own and its own end user.
fn conversation_created(n: usize) -> Value {
    let mut ev =
        fixture_value("end-user-updated-and-conversation-created.json")["messages"][1].clone();
    let (conv, user) = (conversation_id(n), end_user_id(n));
    ev["id"] = json!(format!("cp000000-0000-4000-8000-{n:012}"));
    ev["timestamp"] = json!(1_763_690_400_000_i64 + n as i64);
    let c = &mut ev["data"]["conversation"];
    c["id"] = json!(conv);
    c["endUserId"] = json!(user);
    c["userKey"] = json!(format!("visitor-{n}"));
    c["context"]["conversationId"] = json!(conv);
    c["context"]["endUserId"] = json!(user);
    c["context"]["userKey"] = json!(format!("visitor-{n}"));
    ev
}

fn message(n: usize) -> Value {
    seeded_message("ap", n)
}

fn post_all(app: &TestApp, name: &str, events: Vec<Value>) {
    for (i, chunk) in events.chunks(50).enumerate() {
        let (status, receipt) = app.post(&delivery(&format!("{name}-{i}"), chunk));
        assert_eq!(status, 200, "{receipt}");
        assert_eq!(receipt["accepted"], chunk.len(), "{receipt}");
    }
}

/// Every page of `path` with `limit`, following `next`: the items in order, and how many pages.
fn walk(app: &TestApp, path: &str, items: &str, limit: usize) -> (Vec<Value>, usize) {
    let (mut all, mut pages, mut after) = (Vec::new(), 0, None::<String>);
    loop {
        let url = match &after {
            Some(a) => format!("{path}?limit={limit}&after={a}"),
            None => format!("{path}?limit={limit}"),
        };
        let (status, page) = app.admin_get(&url);
        assert_eq!(status, 200, "{url}: {page}");
        let got = page[items]
            .as_array()
            .unwrap_or_else(|| panic!("{url}: no {items}: {page}"))
            .clone();
        assert_eq!(page["count"], got.len(), "{url}");
        pages += 1;
        let full = got.len() == limit;
        all.extend(got);
        match &page["next"] {
            Value::Null => break,
            next => {
                assert!(full, "{url}: a page before the last is full");
                let next = match next {
                    Value::Number(n) => n.to_string(),
                    Value::String(s) => s.clone(),
                    other => panic!("{url}: next is {other}"),
                };
                after = Some(next);
            }
        }
        assert!(pages <= 1000, "{path}: runaway paging");
    }
    (all, pages)
}

fn field(items: &[Value], name: &str) -> Vec<String> {
    items
        .iter()
        .map(|i| match &i[name] {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
        .collect()
}

/// The JSON lines `--all` printed.
fn lines(out: &str) -> Vec<Value> {
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect()
}

/// The same items in the same order (a short message when not).
fn same(got: &[Value], want: &[Value], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: how many");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!("{what}: item {i} differs:\n{}\n{}", got[i], want[i]);
    }
}

fn bad_queries(app: &TestApp, path: &str) {
    for (query, code) in [
        ("limit=0", "invalid_limit"),
        ("limit=1001", "invalid_limit"),
        ("limit=ten", "invalid_limit"),
        ("after=not%20a%20cursor!", "invalid_cursor"),
        ("limit=5&after=", "invalid_cursor"),
    ] {
        let (status, body) = app.admin_get(&format!("{path}?{query}"));
        assert_eq!(status, 400, "{path}?{query}: {body}");
        assert_eq!(body["error"]["code"], code, "{path}?{query}: {body}");
    }
}

#[test]
fn every_admin_list_pages_online_and_offline() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // Two sends per user message: 250 finished entries from 125 messages.
    let rules = rules_dir(tmp.path(), &format!("{ECHO_RULE}{AGAIN_RULE}"));
    let data = tmp.path().join("data");
    let env = daemon_env(&rules, &[]);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let app = TestApp::spawn_in(&data, Spawn::with_env(&env));

    post_all(
        &app,
        "ap-conv",
        (0..CONVERSATIONS).map(conversation_created).collect(),
    );
    post_all(&app, "ap-msg", (0..MESSAGES).map(message).collect());
    for i in 0..QUARANTINED {
        let (status, receipt) = app.post(format!("{{not json {i}").as_bytes());
        assert_eq!(status, 200, "{receipt}");
    }
    // Sent, and the emulator's echoes of the sends folded: nothing changes after this.
    app.settle_within(Duration::from_secs(180));

    // Conversations: id order, each once; the seeded one got the messages.
    let mut expected: BTreeSet<String> = (0..CONVERSATIONS).map(conversation_id).collect();
    expected.insert(SEEDED[0].0.to_owned());
    let expected: Vec<String> = expected.into_iter().collect();
    let (conversations, pages) = walk(&app, "/admin/v1/conversations", "conversations", 100);
    assert_eq!(field(&conversations, "id"), expected);
    assert_eq!(pages, 3);
    let mine = conversations
        .iter()
        .find(|c| c["id"] == "cp-0007")
        .expect("cp-0007");
    assert_eq!(mine["bot_id"], "B7f3a2c", "{mine}");
    assert_eq!(mine["end_user_id"], "eu-0007", "{mine}");
    assert_eq!(mine["phase"], "bot", "{mine}");
    for whole_state_field in ["params", "messages", "firings", "navigation"] {
        assert!(mine.get(whole_state_field).is_none(), "a summary: {mine}");
    }
    // The default page is bounded, and its next starts the second page.
    let (status, first) = app.admin_get("/admin/v1/conversations");
    assert_eq!(status, 200);
    assert_eq!(
        field(first["conversations"].as_array().expect("page"), "id"),
        expected[..100]
    );
    let cursor = first["next"].as_str().expect("an opaque cursor").to_owned();
    bad_queries(&app, "/admin/v1/conversations");

    // End users: id order, each once; both platform and userKey still look one up.
    let users: Vec<String> = (0..CONVERSATIONS).map(end_user_id).collect();
    let (end_users, pages) = walk(&app, "/admin/v1/endusers", "end_users", 100);
    assert_eq!((field(&end_users, "id"), pages), (users.clone(), 3));
    assert_eq!(end_users[3]["last_conversation_id"], "cp-0003");
    let (status, first_users) = app.admin_get("/admin/v1/endusers");
    assert_eq!(status, 200);
    assert_eq!(first_users["count"], 100, "{}", first_users["next"]);
    assert!(first_users["next"].is_string());
    bad_queries(&app, "/admin/v1/endusers");
    let (status, found) = app.admin_get("/admin/v1/endusers?platform=web&userKey=visitor-3");
    assert_eq!(status, 200, "{found}");
    assert_eq!(found["endUser"]["id"], "eu-0003");
    assert_eq!(found["lastConversation"]["id"], "cp-0003");
    for half in ["platform=web", "userKey=visitor-3"] {
        let (status, body) = app.admin_get(&format!("/admin/v1/endusers?{half}"));
        assert_eq!(status, 400, "{half}: {body}");
        assert_eq!(body["error"]["code"], "invalid_query", "{body}");
    }

    // Finished entries: newest (highest seq) first, each once, every decided action.
    let (done, pages) = walk(&app, "/admin/v1/outbox/done", "finished", 100);
    assert_eq!((done.len(), pages), (2 * MESSAGES, 3));
    let seqs: Vec<u64> = done
        .iter()
        .map(|r| r["entry"]["seq"].as_u64().expect("seq"))
        .collect();
    assert!(
        seqs.windows(2).all(|w| w[0] > w[1]),
        "newest first: {seqs:?}"
    );
    let decided: BTreeSet<(String, String)> = done
        .iter()
        .map(|r| {
            let e = &r["entry"];
            (e["event_id"].to_string(), e["rule"].to_string())
        })
        .collect();
    assert_eq!(decided.len(), 2 * MESSAGES, "every (event, rule) once");
    let (_, first_done) = app.admin_get("/admin/v1/outbox/done");
    assert_eq!(first_done["count"], 100);
    assert_eq!(first_done["next"].as_u64(), Some(seqs[99]));
    let (_, older) = app.admin_get(&format!("/admin/v1/outbox/done?after={}&limit=3", seqs[99]));
    let older: Vec<u64> = older["finished"]
        .as_array()
        .expect("finished")
        .iter()
        .map(|r| r["entry"]["seq"].as_u64().expect("seq"))
        .collect();
    assert_eq!(older, seqs[100..103]);
    bad_queries(&app, "/admin/v1/outbox/done");

    // Quarantine: id order, each once, in pages of 50; the default page holds 100.
    let (records, pages) = walk(&app, "/admin/v1/quarantine", "records", 50);
    let ids: Vec<u64> = records
        .iter()
        .map(|r| r["id"].as_u64().expect("id"))
        .collect();
    assert_eq!((ids.len(), pages), (QUARANTINED, 3));
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    let (_, first_records) = app.admin_get("/admin/v1/quarantine");
    assert_eq!(first_records["count"], 100);
    assert_eq!(first_records["next"].as_u64(), Some(ids[99]));
    bad_queries(&app, "/admin/v1/quarantine");

    // The CLI through the daemon: a page as the API answers it, and --all as JSON lines.
    let page: Value = serde_json::from_str(&app.cli_ok(&["state", "conversations"])).expect("JSON");
    assert_eq!(page, first);
    let page: Value = serde_json::from_str(&app.cli_ok(&["outbox", "done"])).expect("JSON");
    assert_eq!(page, first_done);
    let online = [
        app.cli_ok(&["state", "conversations", "--all"]),
        app.cli_ok(&["state", "endusers", "--all", "--limit", "100"]),
        app.cli_ok(&["outbox", "done", "--all"]),
        app.cli_ok(&["quarantine", "list", "--all", "--limit", "50"]),
    ];
    same(
        &lines(&online[0]),
        &conversations,
        "state conversations --all",
    );
    same(&lines(&online[1]), &end_users, "state endusers --all");
    same(&lines(&online[2]), &done, "outbox done --all");
    same(&lines(&online[3]), &records, "quarantine list --all");
    // From a cursor on: the rest.
    let rest = app.cli_ok(&["state", "conversations", "--all", "--after", &cursor]);
    same(&lines(&rest), &conversations[100..], "--all --after");
    let refused = cli(&data, &["state", "endusers", "--limit", "1001"]);
    assert!(!refused.status.success(), "a limit over 1000 is refused");
    let refused = cli(&data, &["state", "conversations", "--after", "@@"]);
    assert!(!refused.status.success(), "a garbage cursor is refused");
    assert!(app.terminate().success());

    // Stopped: the same pages and lines from the store.
    let offline = [
        cli_ok(&data, &["state", "conversations", "--all"]),
        cli_ok(&data, &["state", "endusers", "--all", "--limit", "100"]),
        cli_ok(&data, &["outbox", "done", "--all"]),
        cli_ok(&data, &["quarantine", "list", "--all", "--limit", "50"]),
    ];
    for (off, on) in offline.iter().zip(&online) {
        same(&lines(off), &lines(on), "offline --all");
    }
    let page: Value = serde_json::from_str(&cli_ok(
        &data,
        &[
            "state",
            "conversations",
            "--limit",
            "100",
            "--after",
            &cursor,
        ],
    ))
    .expect("JSON");
    assert_eq!(
        field(page["conversations"].as_array().expect("page"), "id"),
        expected[100..200]
    );
    let page: Value = serde_json::from_str(&cli_ok(&data, &["state", "endusers"])).expect("JSON");
    assert_eq!(page, first_users);
    let refused = cli(&data, &["outbox", "done", "--limit", "0"]);
    assert!(!refused.status.success(), "a zero limit is refused offline");
    let refused = cli(&data, &["state", "endusers", "--after", "@@"]);
    assert!(
        !refused.status.success(),
        "a garbage cursor is refused offline"
    );
}
