//! Issue 38's `handoff-bridge store copy` from the outside: a daemon on sled builds a store
//! holding every kind of record (deliveries, a handoff under the shipped rules with its timer
//! and place in the queue, an agent API accept under an `Idempotency-Key`, a console reply, a
//! Chatwoot mapping, a dead letter, an outbox entry pending, a quarantined delivery, an event
//! still to fold), is stopped, and the store is copied into a schema of the test database; the
//! daemon started on PostgreSQL then answers the admin API, the agent API's queue and the
//! console as it did on sled, folds the held event once and takes a new delivery whose numbers
//! go on past the copied ones. And the copy's refusals, each with nothing written and no
//! password shown. Skipped (said on stderr) without `HANDOFF_BRIDGE_TEST_PG_URL`.

use crate::common::agent_api::{post as agent_post, TOKEN_NEW, TOKEN_OLD, WEB};
use crate::common::browser::Browser;
use crate::common::chatwoot::{self as cw, FakeChatwoot};
use crate::common::forwarder::Forwarder;
use crate::common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::process::{Command, Output};
use storage_pg::testing::TestDb;

/// The partner-messenger user's conversation in the emulator's seed (bot B7f3a2c).
const KAKAO: &str = crate::common::agent_api::KAKAO;
/// A conversation whose one event is still to fold when the store is copied.
const HELD: &str = "c-held";

/// The daemon on `root/data`: the shipped rules at any time of day, Chatwoot at `chatwoot`, the
/// agent API, no backfill or reconciliation passes (the second daemon's embedded emulator is a
/// new one), on PostgreSQL at `store_url` when given.
fn spawn(root: &Path, chatwoot: &str, store_url: Option<&str>) -> TestApp {
    let config = root.join("bridge.toml");
    let text = format!(
        "[helpdesk.chatwoot]\nurl = \"{chatwoot}\"\naccount_id = {}\ninbox_id = {}\n\n\
         [outbox.retry]\nbase = \"50ms\"\ncap = \"200ms\"\n\n[backfill]\ninterval = \"off\"\n\n\
         [reconcile]\ninterval = \"off\"\n",
        cw::ACCOUNT,
        cw::INBOX
    );
    std::fs::write(&config, text).expect("config");
    let mut env = vec![
        ("HANDOFF_BRIDGE_CHATWOOT_API_TOKEN", cw::TOKEN.to_owned()),
        (
            "HANDOFF_BRIDGE_CHATWOOT_WEBHOOK_SECRET",
            cw::SECRET.to_owned(),
        ),
        (
            "HANDOFF_BRIDGE_HELPDESK_TOKENS",
            format!("{TOKEN_OLD},{TOKEN_NEW}"),
        ),
        (
            "HANDOFF_BRIDGE__RULES__SETTINGS__CHECK_BUSINESS_HOURS",
            "false".to_owned(),
        ),
    ];
    if let Some(url) = store_url {
        env.push(("HANDOFF_BRIDGE_STORE_URL", url.to_owned()));
    }
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut opts = Spawn::with_env(&env);
    opts.args = vec!["--config".into(), config.display().to_string()];
    TestApp::spawn_in(&root.join("data"), opts)
}

/// `handoff-bridge store copy --from data` into `url` (given by the environment) and `extra`.
fn store_copy(data: &Path, url: &str, extra: &[&str]) -> Output {
    Command::new(bin())
        .args(["store", "copy", "--from"])
        .arg(data)
        .args(extra)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HANDOFF_BRIDGE_STORE_URL", url)
        .output()
        .expect("run store copy")
}

/// The test database's password, which no output may show.
fn password() -> String {
    let url = std::env::var(storage_pg::testing::URL_VAR).unwrap_or_default();
    let userinfo = url.split('@').next().unwrap_or_default();
    userinfo.rsplit(':').next().unwrap_or_default().to_owned()
}

fn text(out: &Output) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let secret = password();
    assert!(
        secret.is_empty() || !text.contains(&secret),
        "the password shows: {text}"
    );
    text
}

/// The console's form on `conversation`'s page, posted with `extra`.
fn console_command(b: &mut Browser, conversation: &str, command: &str, extra: &[(&str, &str)]) {
    let page = b.get(&format!("/console/conversations/{conversation}"));
    assert_eq!(page.status, 200, "{}", page.body);
    let (csrf, key) = (
        page.field("csrf", ""),
        page.field("key", &format!("{command}-")),
    );
    let mut fields = vec![("csrf", csrf.as_str()), ("key", key.as_str())];
    fields.extend_from_slice(extra);
    let path = format!("/console/conversations/{conversation}/{command}");
    let done = b.post(&path, &fields);
    assert_eq!(done.status, 303, "{}", done.body);
}

/// Every kind of record, through the daemon: two handoffs (one waiting, with its timer, one
/// accepted through the agent API and answered from the console), Chatwoot's mappings, a dead
/// letter (Chatwoot refusing the token), a quarantined delivery, and one entry left pending
/// (the outbox paused).
fn build(app: &TestApp, fake: &FakeChatwoot) {
    app.emulator_act(KAKAO, "request-agent", json!({}));
    app.settle();
    app.emulator_act(WEB, "request-agent", json!({}));
    app.settle();
    let alice = json!({"agent": {"id": "alice", "name": "Alice"}});
    let accepted = agent_post(
        app,
        &format!("/conversations/{WEB}/accept"),
        Some("acc-1"),
        alice,
    );
    assert_eq!(accepted.status, 200, "{}", accepted.body);
    app.settle();
    let mut b = Browser::new(app);
    b.sign_in(ADMIN_TOKEN, "Kim");
    console_command(&mut b, WEB, "reply", &[("text", "Hello from Kim")]);
    app.settle();

    fake.set_token("a-token-nobody-has");
    app.emulator_act(WEB, "say", json!({"text": "are you there?"}));
    app.settle();
    fake.set_token(cw::TOKEN);
    let (status, _) = app.post(b"{not json");
    assert_eq!(status, 200);

    assert_eq!(app.admin_post("/admin/v1/outbox/pause").0, 200);
    app.emulator_act(WEB, "say", json!({"text": "still there?"}));
    app.emulator_delivered();
}

/// A user's message in `conversation` of bot B7f3a2c, as the service sends it (`n` keeps ids
/// apart).
fn message(n: u32, conversation: &str, end_user: &str) -> Vec<u8> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let id = |kind: u32| format!("0000{n:04x}-{kind:04x}-4000-8000-0000000000c0");
    let event = json!({
        "id": id(0xe), "event": "bot.message.received", "sourceType": "bot", "sourceId": "B7f3a2c",
        "timestamp": now,
        "data": { "message": {
            "id": id(0xa), "endUserId": end_user, "conversationId": conversation,
            "data": {"type": "text", "text": format!("message {n}")}, "meta": null, "isUser": true,
            "timestamp": now, "requestId": id(0xb),
        }},
    });
    delivery(&id(0xd), &[event])
}

fn admin(app: &TestApp, path: &str) -> Value {
    let (status, body) = app.admin_get(path);
    assert_eq!(status, 200, "{path}: {body}");
    body
}

/// `items` of a list without those that name the held conversation or its user.
fn without_held(mut page: Value, items: &str) -> Value {
    if let Some(list) = page[items].as_array_mut() {
        list.retain(|item| !item.to_string().contains(HELD));
    }
    page["count"] = Value::Null;
    page
}

/// Remove the fields that move with the clock (how long a conversation has waited).
fn timeless(mut value: Value) -> Value {
    match &mut value {
        Value::Object(map) => {
            for key in ["wait_seconds", "expected_wait_seconds", "expected_wait"] {
                map.remove(key);
            }
            for v in map.values_mut() {
                *v = timeless(v.take());
            }
        }
        Value::Array(list) => list.iter_mut().for_each(|v| *v = timeless(v.take())),
        _ => {}
    }
    value
}

/// The agent API's listing of `phase`, positions included.
fn queue(app: &TestApp, phase: &str) -> Value {
    let path = format!("/conversations?phase={phase}");
    let reply = crate::common::agent_api::call(app, "GET", &path, Some(TOKEN_OLD), None, None);
    assert_eq!(reply.status, 200, "{}", reply.body);
    timeless(reply.body)
}

/// The console's overview figures (the oldest wait aside: it moves with the clock; and the node's
/// own, its role and lease: each backend's lease is its own, not copied), and its audit list (who,
/// role, what, result).
fn console(app: &TestApp) -> Value {
    let mut b = Browser::new(app);
    b.sign_in(ADMIN_TOKEN, "Kim");
    let overview = b.get("/console/").body;
    let figures: Vec<&str> = overview
        .split("data-figure=\"")
        .skip(1)
        .filter(|f| !f.starts_with("oldest-wait"))
        .filter(|f| {
            !["node-id", "role", "lease-"]
                .iter()
                .any(|own| f.starts_with(own))
        })
        .filter_map(|f| f.split('<').next())
        .collect();
    let audit = b.get("/console/audit").body;
    let rows: Vec<&str> = audit
        .split("<tr><td>")
        .skip(1)
        .filter_map(|row| row.split_once("</td>").map(|(_, rest)| rest))
        .filter_map(|rest| rest.split("</tr>").next())
        .collect();
    json!({"figures": figures, "audit": rows})
}

/// What the daemon answers about the store (the held conversation and its user aside).
fn reads(app: &TestApp) -> Vec<(String, Value)> {
    let quarantine = admin(app, "/admin/v1/quarantine?limit=1000");
    let mut out = vec![
        (
            "conversations".to_owned(),
            without_held(
                admin(app, "/admin/v1/conversations?limit=1000"),
                "conversations",
            ),
        ),
        (
            "end users".to_owned(),
            without_held(admin(app, "/admin/v1/endusers?limit=1000"), "end_users"),
        ),
        (
            "outbox".to_owned(),
            admin(app, "/admin/v1/outbox?limit=1000")["entries"].clone(),
        ),
        (
            "done".to_owned(),
            admin(app, "/admin/v1/outbox/done?limit=1000"),
        ),
        (
            "dead letters".to_owned(),
            admin(app, "/admin/v1/dead-letters?limit=1000"),
        ),
        ("quarantine".to_owned(), quarantine.clone()),
        ("queue".to_owned(), queue(app, "requested")),
        ("accepted".to_owned(), queue(app, "accepted")),
        ("console".to_owned(), console(app)),
    ];
    for c in [WEB, KAKAO] {
        for tail in ["", "/audit", "/desks"] {
            let path = format!("/admin/v1/conversations/{c}{tail}");
            out.push((path.clone(), admin(app, &path)));
        }
    }
    for record in quarantine["records"]
        .as_array()
        .cloned()
        .unwrap_or_default()
    {
        let path = format!("/admin/v1/quarantine/{}", record["id"]);
        out.push((path.clone(), admin(app, &path)));
    }
    for metric in ["handoff_queue_waiting", "handoff_timers_pending"] {
        out.push((metric.to_owned(), json!(app.metric(metric))));
    }
    out
}

/// The numbers of the events in `conversation`'s timeline, as stored.
fn event_seqs(app: &TestApp, conversation: &str) -> Vec<u64> {
    let audit = admin(
        app,
        &format!("/admin/v1/conversations/{conversation}/audit"),
    );
    let timeline = audit["timeline"].as_array().cloned().unwrap_or_default();
    timeline
        .iter()
        .filter_map(|item| item["event_id"].as_str())
        .map(|id| {
            admin(app, &format!("/admin/v1/events/{id}"))["record"]["seq"]
                .as_u64()
                .expect("seq")
        })
        .collect()
}

/// The outbox numbers the daemon shows: pending, finished, dead.
fn outbox_seqs(app: &TestApp) -> Vec<u64> {
    let mut seqs = Vec::new();
    for (path, items) in [
        ("/admin/v1/outbox?limit=1000", "entries"),
        ("/admin/v1/outbox/done?limit=1000", "finished"),
        ("/admin/v1/dead-letters?limit=1000", "dead_letters"),
    ] {
        for item in admin(app, path)[items]
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            seqs.extend(item["seq"].as_u64().or(item["entry"]["seq"].as_u64()));
        }
    }
    seqs
}

/// The copy's table: each line's (what, sled, postgresql).
fn table(out: &str) -> Vec<(String, u64, u64)> {
    out.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let what = words.next()?.to_owned();
            let sled = words.next()?.parse().ok()?;
            let postgres = words.next()?.parse().ok()?;
            Some((what, sled, postgres))
        })
        .collect()
}

#[test]
fn a_sled_store_with_every_kind_of_record_moves_to_postgres_and_reads_the_same() {
    let Some(db) = TestDb::fresh("store copy of a daemon's store") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let fake = FakeChatwoot::start();
    let mut fwd = Forwarder::start(fake.addr);
    let app = spawn(tmp.path(), &fwd.url(), None);
    build(&app, &fake);
    let before = reads(&app);
    let seqs = (event_seqs(&app, WEB), outbox_seqs(&app));
    // One event still to fold when the store is copied.
    assert_eq!(app.admin_post("/admin/v1/dispatch/pause").0, 200);
    assert_eq!(app.post(&message(1, HELD, "u-held")).0, 200);
    assert_eq!(app.terminate().code(), Some(0));

    let out = store_copy(&tmp.path().join("data"), &db.url_with_schema(), &[]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    let lines = table(&said);
    assert!(lines.iter().all(|(_, s, p)| s == p), "{said}");
    let count = |what: &str| lines.iter().find(|l| l.0 == what).map(|l| l.1);
    for kind in [
        "deliveries",
        "events",
        "folded_marks",
        "conversations",
        "end_users",
        "timers",
        "waiting_queue",
        "accept_histories",
        "hour_figures",
        "outbox",
        "dead_letters",
        "done_records",
        "action_ledger",
        "quarantine",
        "operator_actions",
        "idempotency_answers",
        "desk_links",
        "desk_contacts",
        "derived_index",
    ] {
        assert!(count(kind).is_some_and(|n| n > 0), "{kind} copied: {said}");
    }
    assert_eq!(count("events_to_fold"), Some(1), "{said}");

    // On PostgreSQL, Chatwoot away (the pending entry waits): the same answers.
    fwd.close();
    let pg = spawn(tmp.path(), &fwd.url(), Some(&db.url_with_schema()));
    wait_drained(&pg);
    let after = reads(&pg);
    for ((what, sled), (_, postgres)) in before.iter().zip(&after) {
        assert_eq!(sled, postgres, "{what}");
    }
    let held = admin(&pg, &format!("/admin/v1/conversations/{HELD}"));
    assert_eq!(
        held["events_applied"], 1,
        "the held event folded once: {held}"
    );

    // A new delivery folds once, numbered after every copied event and outbox entry.
    let web = admin(&pg, &format!("/admin/v1/conversations/{WEB}"));
    let user = web["end_user_id"].as_str().expect("end user").to_owned();
    assert_eq!(pg.post(&message(2, WEB, &user)).0, 200);
    wait_drained(&pg);
    let now = admin(&pg, &format!("/admin/v1/conversations/{WEB}"));
    assert_eq!(
        now["events_applied"],
        web["events_applied"].as_u64().expect("n") + 1
    );
    let new_seqs = event_seqs(&pg, WEB);
    assert_eq!(
        new_seqs[..seqs.0.len()],
        seqs.0[..],
        "the copied events keep their numbers"
    );
    assert!(
        new_seqs.last() > seqs.0.iter().max(),
        "{new_seqs:?} after {:?}",
        seqs.0
    );
    let entries = outbox_seqs(&pg);
    let newest = entries.iter().max().copied().unwrap_or(0);
    assert!(
        newest > seqs.1.iter().max().copied().unwrap_or(0),
        "{entries:?} after {:?}",
        seqs.1
    );
}

#[test]
fn a_copy_is_refused_with_nothing_written_and_no_password_shown() {
    let Some(db) = TestDb::fresh("store copy refused") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let url = db.url_with_schema();
    let tables = || {
        db.reader().numbers(&format!(
            "SELECT count(*) FROM pg_tables WHERE schemaname = '{}'",
            db.schema
        ))
    };
    let app = TestApp::spawn_in(&data, Spawn::default());
    assert_eq!(
        app.post(&fixture_bytes("message-received-text.json")).0,
        200
    );
    let out = store_copy(&data, &url, &[]);
    let said = text(&out);
    assert!(
        !out.status.success() && said.contains("stop it first"),
        "{said}"
    );
    assert_eq!(tables(), [0], "nothing written while the daemon runs");
    assert_eq!(app.terminate().code(), Some(0));

    let mysql = "mysql://bridge:s3cret-of-mysql@127.0.0.1/bridge";
    let out = store_copy(&data, mysql, &[]);
    let said = text(&out);
    assert!(
        !out.status.success() && said.contains("not a postgres"),
        "{said}"
    );
    assert!(!said.contains("s3cret-of-mysql"), "{said}");

    let out = store_copy(&data, &url, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let rows = || db.reader().numbers("SELECT count(*) FROM events");
    let copied = rows();
    let out = store_copy(&data, &url, &["--discard-incomplete"]);
    let said = text(&out);
    assert!(
        !out.status.success() && said.contains("not empty"),
        "{said}"
    );
    assert_eq!(
        rows(),
        copied,
        "nothing written into a target that is not empty"
    );

    let newer = TestDb::fresh("store copy into a newer schema").expect("database");
    newer.execute(
        "CREATE TABLE schema_version (version integer NOT NULL); \
                   INSERT INTO schema_version VALUES (99)",
    );
    let out = store_copy(&data, &newer.url_with_schema(), &[]);
    let said = text(&out);
    assert!(
        !out.status.success() && said.contains("newer than this binary"),
        "{said}"
    );
}
