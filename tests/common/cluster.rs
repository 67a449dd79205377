//! Several nodes on one store, and the scenarios they must pass, written once for any way of
//! running the nodes ([`Nodes`]): in this process on the in-memory store (`tests/it/cluster.rs`),
//! and, with the PostgreSQL store, as processes on one database, where "stops renewing" is a
//! SIGSTOP (or a SIGKILL, which never comes back) and time is real (a short `cluster.lease`).
//! Each scenario finds which node is active itself and asserts through HTTP only.

use super::agent_api::{self, TOKEN_NEW};
use super::relay::{journal, make_delivery, set_faults, user_message, Ids, SEEDED};
use super::{fixture_bytes, poll_until, TestApp};
use serde_json::{json, Value};
use std::time::Duration;

/// Nodes sharing one store, however they run.
pub trait Nodes {
    /// How many there are.
    fn count(&self) -> usize;
    /// Node `i`.
    fn node(&self, i: usize) -> &TestApp;
    /// Node `i` can no longer renew its lease (paused, cut off from the store); the rest of it
    /// runs on until it steps down by itself.
    fn stop_renewing(&self, i: usize);
    /// Node `i` reaches the store again (resumed).
    fn renew_again(&self, i: usize);
    /// The nodes' time moves on by `by` ("11s"); each node's lease loop looks again.
    fn advance(&self, by: &str);
}

/// How long a scenario waits for what it expects (the nodes' own pace, not the lease's).
const WAIT: Duration = Duration::from_secs(30);

/// `GET /admin/v1/cluster` of a node.
pub fn view(app: &TestApp) -> Value {
    let (status, view) = app.admin_get("/admin/v1/cluster");
    assert_eq!(status, 200, "{view}");
    view
}

/// The node that is active once every node agrees on it (the others stand by, each names it
/// as the holder): its index.
pub fn active(nodes: &dyn Nodes) -> usize {
    poll_until("one active node that every node names", WAIT, || {
        let views: Vec<Value> = (0..nodes.count()).map(|i| view(nodes.node(i))).collect();
        let active: Vec<usize> = (0..views.len())
            .filter(|i| views[*i]["role"] == "active")
            .collect();
        let [one] = active[..] else { return None };
        let holder = &views[one]["node_id"];
        views
            .iter()
            .all(|v| v["holder"] == *holder && (v["role"] == "standby") == (v != &views[one]))
            .then_some(one)
    })
}

/// Every delivery in `events` posted to node `i % count` in turn, each acknowledged.
fn post_round_robin(nodes: &dyn Nodes, deliveries: &[Vec<u8>]) {
    for (i, body) in deliveries.iter().enumerate() {
        let (status, answer) = nodes.node(i % nodes.count()).post(body);
        assert_eq!(status, 200, "delivery {i}: {answer}");
    }
}

/// A conversation's state as node `app` reads it.
fn conversation(app: &TestApp, id: &str) -> Value {
    let (status, state) = app.admin_get(&format!("/admin/v1/conversations/{id}"));
    assert_eq!(status, 200, "{state}");
    state
}

/// Every node shows the one active node: `GET /admin/v1/cluster` (this node, its role, the
/// holder, the epoch, when the lease runs out, the nodes seen), the gauges, `/readyz` (200 on
/// every node) and the console's overview.
pub fn every_node_shows_the_one_active_node(nodes: &dyn Nodes) {
    let a = active(nodes);
    let lease = view(nodes.node(a));
    let epoch = lease["epoch"].as_u64().expect("epoch");
    assert!(
        epoch >= 1 && lease["expires_at"].as_i64().is_some(),
        "{lease}"
    );
    let ids: Vec<Value> = (0..nodes.count())
        .map(|i| view(nodes.node(i))["node_id"].clone())
        .collect();
    for i in 0..nodes.count() {
        let app = nodes.node(i);
        let v = view(app);
        assert_eq!(
            (v["holder"].clone(), v["epoch"].as_u64()),
            (ids[a].clone(), Some(epoch))
        );
        let seen: Vec<Value> = v["nodes"]
            .as_array()
            .expect("nodes")
            .iter()
            .map(|n| n["node"].clone())
            .collect();
        assert!(ids.iter().all(|id| seen.contains(id)), "{v}");
        let role = if i == a { 1.0 } else { 0.0 };
        assert_eq!(app.metric("handoff_cluster_role"), role, "node {i}");
        let epoch_seen = poll_until("the node's epoch gauge", WAIT, || {
            let e = app.metric("handoff_lease_epoch");
            (e == epoch as f64).then_some(e)
        });
        assert_eq!(epoch_seen, epoch as f64);
        let (status, ready) = app.get("/readyz");
        assert_eq!(status, 200, "every node takes intake: {ready}");
        let ready: Value = serde_json::from_str(&ready).expect("JSON");
        assert_eq!(ready["checks"]["cluster"]["role"], v["role"]);
        let mut browser = super::browser::Browser::new(app);
        assert_eq!(browser.sign_in(super::ADMIN_TOKEN, "Kim").status, 303);
        let page = browser.get("/console/");
        assert_eq!(page.status, 200);
        let role = v["role"].as_str().expect("role");
        assert!(
            page.body.contains(&format!(">{role}</dd>")),
            "{}",
            page.body
        );
        let holder = ids[a].as_str().expect("id");
        assert!(
            page.body.contains(&format!("<code>{holder}</code>")),
            "{}",
            page.body
        );
    }
}

/// Deliveries posted to every node in turn are all folded, each once, in order per
/// conversation: each conversation's state counts its messages once, and the active node's
/// echoes (one per message) reach the service once each, in the order the messages were sent.
/// Every node reads the same states.
pub fn deliveries_to_every_node_are_folded_once_in_order(nodes: &dyn Nodes) {
    const PER_CONVERSATION: usize = 4;
    let a = active(nodes);
    let mut ids = Ids::new(0x5eed_c105);
    let deliveries: Vec<Vec<u8>> = (0..3 * PER_CONVERSATION)
        .map(|i| {
            let event = user_message(
                &mut ids,
                i % 3,
                &format!("m{i}"),
                1_763_690_500_000 + i as i64,
            );
            make_delivery(&mut ids, vec![event]).body
        })
        .collect();
    post_round_robin(nodes, &deliveries);
    for i in 0..nodes.count() {
        nodes.node(i).settle();
    }
    for (c, (conversation_id, _, _)) in SEEDED.iter().take(3).enumerate() {
        for i in 0..nodes.count() {
            let state = conversation(nodes.node(i), conversation_id);
            let messages = &state["messages"];
            assert_eq!(
                messages["user_messages"], PER_CONVERSATION,
                "node {i}: {state}"
            );
        }
        let texts: Vec<String> = nodes
            .node(a)
            .journal()
            .iter()
            .filter(|e| super::took_effect(e))
            .filter(|e| {
                e["path"]
                    .as_str()
                    .is_some_and(|p| p.contains(conversation_id))
            })
            .filter_map(|e| echo_of(&e["body"]))
            .collect();
        let sent: Vec<String> = (0..3 * PER_CONVERSATION)
            .filter(|i| i % 3 == c)
            .map(|i| format!("echo m{i}"))
            .collect();
        assert_eq!(texts, sent, "conversation {c}: each once, in order");
    }
}

/// The echo text of a send-message call's body.
fn echo_of(body: &Value) -> Option<String> {
    let text = body.to_string();
    let at = text.find("echo m")?;
    let rest = &text[at..];
    Some(rest[..rest.find('"')?].to_owned())
}

/// An agent's command posted to a standby is stored there and answered from the verdict the
/// active node's fold recorded; the standby's agent API lists the queue as the store has it.
pub fn an_agent_command_on_a_standby_gets_its_verdict(nodes: &dyn Nodes) {
    let a = active(nodes);
    let standby = nodes.node((a + 1) % nodes.count());
    let (status, answer) = standby.post(&fixture_bytes("agent-call-requested.json"));
    assert_eq!(status, 200, "{answer}");
    let web = agent_api::WEB;
    let listed = poll_until("the request in the standby's queue", WAIT, || {
        let r = agent_api::call(
            standby,
            "GET",
            "/conversations?phase=requested",
            Some(TOKEN_NEW),
            None,
            None,
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let found = r.body["conversations"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c["id"] == web));
        found.then_some(r.body)
    });
    assert_eq!(listed["conversations"][0]["position"], 1, "{listed}");
    let accept = format!("/conversations/{web}/accept");
    let alice = json!({"agent": {"id": "alice", "name": "Alice"}});
    let first = agent_api::post(standby, &accept, Some("standby-accept-1"), alice);
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.body["status"], "applied");
    assert_eq!(first.body["agent"]["id"], "alice");
    let bob = agent_api::post(standby, &accept, None, json!({"agent": {"id": "bob"}}));
    assert_eq!(bob.status, 409, "the fold's verdict: {}", bob.body);
    assert_eq!(agent_api::code(&bob), "already_accepted");
    let state = conversation(nodes.node(a), web);
    assert_eq!(state["desk"]["agent"]["id"], "alice", "{state}");
}

/// The active node stops renewing: the standby takes over within the lease and one renewal
/// (not before the lease ran out), with a higher epoch; the old active steps down by itself
/// without the store's answer, and comes back as a standby once it reaches the store again. The
/// new active folds what any node stores.
pub fn a_standby_takes_over_within_the_lease_and_one_renewal(nodes: &dyn Nodes) {
    let old = active(nodes);
    let new = (old + 1) % nodes.count();
    let before = view(nodes.node(old));
    let epoch = before["epoch"].as_u64().expect("epoch");
    nodes.stop_renewing(old);
    nodes.advance("0s");
    let expires = view(nodes.node(new))["expires_at"]
        .as_i64()
        .expect("expires");
    let now = clock_now(nodes.node(new));
    // Three seconds before the lease runs out (real time moves the clock on meanwhile): the
    // standby claims (seen from then on), and the lease stays the old one's.
    let at = expires - 3_000;
    nodes.advance(&format!("{}ms", (at - now).max(0)));
    poll_until("the standby's claim", WAIT, || {
        seen_since(nodes.node(new), at)
    });
    let still = view(nodes.node(new));
    assert_eq!(
        (still["holder"].clone(), still["epoch"].as_u64()),
        (before["holder"].clone(), Some(epoch)),
        "expires {expires}, now {now}, at {at}: {still}"
    );
    // Within the lease and one renewal after the last renewal: taken over.
    nodes.advance("6300ms");
    let taken = active(nodes);
    assert_eq!(taken, new);
    assert_eq!(view(nodes.node(new))["epoch"].as_u64(), Some(epoch + 1));
    assert_eq!(
        view(nodes.node(old))["role"],
        "standby",
        "stepped down by itself"
    );
    let at = clock_now(nodes.node(old));
    nodes.renew_again(old);
    nodes.advance("0s");
    poll_until("the old active's claim", WAIT, || {
        seen_since(nodes.node(old), at)
    });
    assert_eq!(view(nodes.node(old))["role"], "standby");
    assert_eq!(active(nodes), new);
    let (status, _) = nodes
        .node(old)
        .post(&fixture_bytes("message-received-text.json"));
    assert_eq!(status, 200);
    nodes.node(old).settle();
    let state = conversation(nodes.node(new), SEEDED[0].0);
    assert!(state["events_applied"].as_u64() >= Some(1), "{state}");
}

/// The daemon's time on `app` (a zero advance of its test clock answers it).
pub fn clock_now(app: &TestApp) -> i64 {
    app.advance_clock_unsettled("0s")["now"]
        .as_i64()
        .expect("now")
}

/// Whether `app`'s node was seen (it claimed) at or after `at`.
fn seen_since(app: &TestApp, at: i64) -> Option<()> {
    let v = view(app);
    let me = v["node_id"].clone();
    let nodes = v["nodes"].as_array()?;
    nodes
        .iter()
        .any(|n| n["node"] == me && n["seen_at"].as_i64().is_some_and(|s| s >= at))
        .then_some(())
}

/// The active's work asked of a standby (a pass run now, a dead letter's retry or drop, a
/// replay) is stored for the active, which carries it out; the standby answers with the active's
/// answer, refusals included. A dead letter retried through the standby is carried out by the
/// active's executor, and only by it.
pub fn the_actives_work_asked_of_a_standby_is_carried_out_by_the_active(nodes: &dyn Nodes) {
    let a = active(nodes);
    let (active_node, standby) = (nodes.node(a), nodes.node((a + 1) % nodes.count()));
    let (status, pruned) = standby.admin_post("/admin/v1/prune");
    assert_eq!(status, 200, "{pruned}");
    assert!(pruned["took_ms"].is_u64(), "the pruning report: {pruned}");
    let (status, swept) = standby.admin_post("/admin/v1/reconcile");
    assert_eq!(status, 200, "{swept}");
    let (status, replayed) = standby.admin_post("/admin/v1/replay?from=0&to=1");
    assert_eq!(status, 200, "{replayed}");
    assert_eq!(replayed["queued"], 0, "{replayed}");
    let (status, refused) = standby.admin_post("/admin/v1/dead-letters/999999/retry");
    assert_eq!(status, 404, "the active's refusal handed on: {refused}");
    assert_eq!(refused["error"]["code"], "not_found", "{refused}");
    let emulator = active_node.emulator();
    set_faults(
        emulator,
        json!({"fail_next": 2, "status": 400, "path_prefix": "/openapi/"}),
    );
    let mut ids = Ids::new(0x0a5c_ed1e);
    let asked = user_message(&mut ids, 2, "asked", 1_763_690_600_000);
    let other = user_message(&mut ids, 2, "discarded", 1_763_690_600_001);
    let (status, answer) = standby.post(&make_delivery(&mut ids, vec![asked, other]).body);
    assert_eq!(status, 200, "{answer}");
    let letters = poll_until("both echoes dead letters", Duration::from_secs(30), || {
        let (_, page) = standby.admin_get("/admin/v1/dead-letters");
        let seqs: Option<Vec<u64>> = page["dead_letters"]
            .as_array()?
            .iter()
            .map(|l| l["entry"]["seq"].as_u64())
            .collect();
        seqs.filter(|s| s.len() == 2)
    });
    let (seq, discard) = (letters[0], letters[1]);
    let mut console = super::browser::Browser::new(standby);
    console.sign_in(super::ADMIN_TOKEN, "Kim");
    let confirm = console.get(&format!("/console/dead-letters/{discard}/discard"));
    let csrf = confirm.field("csrf", "");
    let done = console.post(
        &format!("/console/dead-letters/{discard}/discard"),
        &[("csrf", &csrf)],
    );
    assert_eq!(done.status, 303, "{}", done.body);
    assert_eq!(
        done.header("location"),
        Some("/console/outbox?done=discarded"),
        "discarded by the active through the standby's console"
    );
    let (status, retried) = standby.admin_post(&format!("/admin/v1/dead-letters/{seq}/retry"));
    assert_eq!(status, 200, "{retried}");
    assert_eq!(retried["retried"], json!([seq]), "{retried}");
    let echoed = |app: &TestApp| {
        journal(app.emulator())
            .into_iter()
            .filter(|e| e.body.to_string().contains("echo asked") && (200..300).contains(&e.status))
            .count()
    };
    poll_until(
        "the retried letter carried out",
        Duration::from_secs(30),
        || (echoed(active_node) == 1).then_some(()),
    );
    assert_eq!(echoed(standby), 0, "the standby carries nothing out");
    let (_, letters) = standby.admin_get("/admin/v1/dead-letters");
    assert_eq!(letters["dead_letters"], json!([]), "{letters}");
}
