//! The agent API's queue at scale, against the real daemon: 30,000 conversations sent through
//! the webhook, of which 60 wait for an agent across two bots. Paging `phase=requested` with a
//! small limit lists all 60, each once, in request order, with their positions in their bot's
//! queue; `bot=` lists that bot's only; `phase=bot` and `phase=all` page through everything.
//! (Before the phase index, the listing scanned the first 10,000 states and found a fraction.)

use crate::common::agent_api::{call, code, TOKEN_NEW, TOKEN_OLD};
use crate::common::{delivery, Spawn, TestApp};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};

const CONVERSATIONS: usize = 30_000;
const PER_DELIVERY: usize = 500;
const BOTS: [&str; 2] = ["B-one", "B-two"];
/// Request times start here (in the past, so no event is past the clock skew).
const T0: i64 = 1_763_690_400_000;

fn conversation_id(i: usize) -> String {
    format!("conv-{i:05}")
}

fn bot_of(i: usize) -> &'static str {
    BOTS[i % 2]
}

fn event(id: &str, kind: &str, i: usize, at: i64) -> Value {
    json!({
        "id": id, "event": kind, "sourceType": "bot", "sourceId": bot_of(i), "timestamp": at,
        "data": { "conversation": {
            "id": conversation_id(i), "botId": bot_of(i), "platform": "web",
            "userKey": format!("user-{i}"),
        } },
    })
}

/// The daemon with the agent API open to loopback. Its folds run at its own priority: this test
/// is about the listing, and at the default (idle) priority the folds of 30,000 conversations
/// wait for whatever else the machine runs.
fn spawn(dir: &std::path::Path) -> TestApp {
    let config = dir.join("bridge.toml");
    std::fs::write(&config, "[helpdesk]\nallow_cidrs = [\"127.0.0.0/8\"]\n").expect("config");
    let env = [
        (
            "HANDOFF_BRIDGE_HELPDESK_TOKENS",
            format!("{TOKEN_OLD},{TOKEN_NEW}"),
        ),
        ("HANDOFF_BRIDGE__DISPATCH__FOLD_PRIORITY", "nice".to_owned()),
        ("HANDOFF_BRIDGE__DISPATCH__FOLD_NICENESS", "0".to_owned()),
    ];
    let opts = Spawn {
        env: env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect(),
        args: vec!["--config".into(), config.display().to_string()],
        ..Spawn::default()
    };
    TestApp::spawn_in(&dir.join("data"), opts)
}

/// Send `events` in deliveries of [`PER_DELIVERY`], each answered 200.
fn send(app: &TestApp, name: &str, events: &[Value]) {
    for (n, chunk) in events.chunks(PER_DELIVERY).enumerate() {
        let (status, body) = app.post(&delivery(&format!("{name}-{n}"), chunk));
        assert_eq!(status, 200, "{body}");
    }
}

/// Wait until every accepted event is folded (the daemon answers when its dispatcher drains:
/// an event, not a poll), asked in turns shorter than the client's timeout; at most 3 minutes.
fn drained(app: &TestApp) {
    let started = std::time::Instant::now();
    for _ in 0..9 {
        let (status, _) = app.admin_get("/admin/v1/inbox/drained?timeout_ms=20000");
        if status == 200 {
            eprintln!("drained after {:?}", started.elapsed());
            return;
        }
    }
    panic!("the inbox did not drain in 3 minutes");
}

/// GET the queue; the answer's body (200 asserted).
fn get(app: &TestApp, query: &str) -> Value {
    let r = call(
        app,
        "GET",
        &format!("/conversations?{query}"),
        Some(TOKEN_OLD),
        None,
        None,
    );
    assert_eq!(r.status, 200, "{query}: {}", r.body);
    r.body
}

/// Every page of `query`, `limit` at a time: the conversations in the order listed.
fn pages(app: &TestApp, query: &str, limit: usize) -> Vec<Value> {
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    for _ in 0..=CONVERSATIONS {
        let cursor = after.map(|a| format!("&after={a}")).unwrap_or_default();
        let body = get(app, &format!("{query}&limit={limit}{cursor}"));
        let page = body["conversations"].as_array().expect("conversations");
        assert!(page.len() <= limit, "{query}: a page over its limit");
        out.extend(page.iter().cloned());
        match body["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => {
                assert!(body["next"].is_null(), "{body}");
                return out;
            }
        }
    }
    panic!("{query}: paging did not end");
}

fn ids(items: &[Value]) -> Vec<String> {
    items
        .iter()
        .map(|c| c["id"].as_str().expect("id").to_owned())
        .collect()
}

/// Each listed id appears once.
fn assert_each_once(what: &str, items: &[Value]) {
    let unique: HashSet<String> = ids(items).into_iter().collect();
    assert_eq!(
        unique.len(),
        items.len(),
        "{what}: a conversation listed twice"
    );
}

#[test]
fn the_queue_lists_every_waiting_conversation_in_request_order_among_thirty_thousand() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = spawn(tmp.path());

    // Every conversation, with its bot.
    let created: Vec<Value> = (0..CONVERSATIONS)
        .map(|i| {
            event(
                &format!("u-{i}"),
                "bot.conversation.updated",
                i,
                T0 - 60_000,
            )
        })
        .collect();
    send(&app, "created", &created);

    // 75 ask for an agent, spread over the whole id range, their request times in another
    // order than their ids (two share a time: then the id decides); 10 of them are then
    // connected and 5 cancelled, so 60 wait.
    let askers: Vec<usize> = (0..75).map(|k| k * 397 + 11).collect();
    let requested_at = |k: usize| T0 + ((k * 37) % 75) as i64 * 1_000 - i64::from(k == 5) * 1_000;
    let mut later: Vec<Value> = askers
        .iter()
        .enumerate()
        .map(|(k, i)| {
            let kind = "bot.conversation.agent_call_requested";
            event(&format!("q-{i}"), kind, *i, requested_at(k))
        })
        .collect();
    for (k, i) in askers.iter().enumerate().skip(60) {
        let kind = match k < 70 {
            true => "bot.conversation.agent_call_connected",
            false => "bot.conversation.agent_call_cancelled",
        };
        later.push(event(&format!("s-{i}"), kind, *i, requested_at(k) + 500));
    }
    send(&app, "handoffs", &later);
    drained(&app);

    // What waits, in request order then id, and each one's rank in its bot's queue.
    let mut waiting: Vec<(i64, String, &str)> = askers[..60]
        .iter()
        .enumerate()
        .map(|(k, i)| (requested_at(k), conversation_id(*i), bot_of(*i)))
        .collect();
    waiting.sort();
    assert!(
        waiting.windows(2).any(|w| w[0].0 == w[1].0),
        "two requests at one time"
    );
    let mut rank: HashMap<String, usize> = HashMap::new();
    for bot in BOTS {
        for (n, (_, id, _)) in waiting.iter().filter(|w| w.2 == bot).enumerate() {
            rank.insert(id.clone(), n + 1);
        }
    }

    // phase=requested (the default), 7 at a time: all 60, once each, in order, positions right.
    let listed = pages(&app, "phase=requested", 7);
    assert_each_once("requested", &listed);
    let expected: Vec<String> = waiting.iter().map(|w| w.1.clone()).collect();
    assert_eq!(ids(&listed), expected);
    for item in &listed {
        let id = item["id"].as_str().expect("id");
        assert_eq!(item["phase"], "requested", "{item}");
        assert_eq!(item["position"], json!(rank[id]), "{item}");
        assert!(item["requested_at"].as_i64().is_some(), "{item}");
    }

    // bot=: that bot's only, in order, with the same positions.
    for bot in BOTS {
        let listed = pages(&app, &format!("phase=requested&bot={bot}"), 4);
        let expected: Vec<String> = waiting
            .iter()
            .filter(|w| w.2 == bot)
            .map(|w| w.1.clone())
            .collect();
        assert_eq!(expected.len(), 30);
        assert_eq!(ids(&listed), expected, "{bot}");
        for item in &listed {
            let id = item["id"].as_str().expect("id");
            assert_eq!(item["position"], json!(rank[id]), "{item}");
            assert_eq!(item["bot_id"], bot, "{item}");
        }
    }
    assert_eq!(pages(&app, "phase=connected", 3).len(), 10);
    assert_eq!(pages(&app, "phase=cancelled&bot=B-one", 2).len(), 2);

    // phase=bot: every conversation that never asked, once each, by id (no request time).
    let bots = pages(&app, "phase=bot", 1000);
    assert_eq!(bots.len(), CONVERSATIONS - 75);
    assert_each_once("bot", &bots);
    let mut sorted = ids(&bots);
    sorted.sort();
    assert_eq!(ids(&bots), sorted, "phase=bot in id order");

    // phase=all: everything once; those without a request first (by id), then by request time.
    let all = pages(&app, "phase=all", 1000);
    assert_eq!(all.len(), CONVERSATIONS);
    assert_each_once("all", &all);
    let keys: Vec<(Option<i64>, String)> = all
        .iter()
        .map(|c| {
            (
                c["requested_at"].as_i64(),
                c["id"].as_str().expect("id").to_owned(),
            )
        })
        .collect();
    assert!(keys.windows(2).all(|w| w[0] < w[1]), "phase=all in order");
    let with_bot = pages(&app, "phase=all&bot=B-two", 1000);
    assert_eq!(with_bot.len(), CONVERSATIONS / 2);
    assert!(with_bot.iter().all(|c| c["bot_id"] == "B-two"));

    // A cursor that is not one: 400 invalid_query on `after`, whatever the phase.
    for bad in ["!!", "AB", "x", "AAA%3D", &"A".repeat(5000)] {
        let r = call(
            &app,
            "GET",
            &format!("/conversations?phase=all&after={bad}"),
            Some(TOKEN_OLD),
            None,
            None,
        );
        assert_eq!((r.status, code(&r)), (400, "invalid_query"), "{bad}");
        assert_eq!(r.body["error"]["field"], "after", "{bad}");
    }
    // The last page's cursor, asked again, gives an empty page with no next.
    let first = get(&app, "phase=requested&limit=59");
    let next = first["next"].as_str().expect("more after 59").to_owned();
    let last = get(&app, &format!("phase=requested&limit=5&after={next}"));
    assert_eq!(
        ids(last["conversations"].as_array().expect("page")),
        [expected[59].clone()]
    );
    assert!(last["next"].is_null());
    assert!(app.terminate().success());
}
