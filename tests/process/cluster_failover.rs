//! Issue 38, part 4: failover with real processes. Two daemons (`node-a`, `node-b`) on one
//! PostgreSQL schema, `cluster.lease` at 3 s (the shortest allowed) so a takeover takes seconds,
//! and one external emulator as both nodes' upstream (its journal and idempotency records outlive
//! any node), seeded with the conversations the senders write in. An echo rule answers each user
//! message (`c<conversation>-m<number>`) with `echo c<conversation>-m<number>`: the journal shows
//! which messages were folded and carried out, how often, in what order.
//!
//! - The active killed with SIGKILL while 8 senders post to both nodes: for every conversation
//!   acknowledged <= folded <= sent, each folded and carried out once, in order; the standby takes
//!   over within the lease and one renewal of the kill.
//! - The active paused with SIGSTOP past its lease, a call in flight and a fold's transaction open
//!   (held at its write by a row lock of the test's): PostgreSQL ends the paused transaction's
//!   session before the lease runs out (its idle limit is a third of the lease), the standby
//!   takes over once the lease ran out, the lease moves on by one epoch, nothing is folded or
//!   carried out twice (the call in flight is replayed once under its key, and counted), and the
//!   resumed node stands by.
//! - PostgreSQL (a server of the test's own) stopped as if it crashed and started again under
//!   load: posts meanwhile are refused 503 with `Retry-After`, nothing acknowledged is lost, every
//!   node resumes by itself.
//!
//! Each test says on stderr that it was skipped, and passes, without `HANDOFF_BRIDGE_TEST_PG_URL`
//! (`tests/lib/postgres.sh`). Backfill and reconciliation are off: events they read back from the
//! service would add to the counts the tests compare.

use crate::common::cluster::view;
use crate::common::emulator::ExternalEmulator;
use crate::common::pg_server::PgServer;
use crate::common::relay::{daemon_env, journal, rules_dir, set_faults, ECHO_RULE, EMULATOR_KEY};
use crate::common::{agent, poll_until, Spawn, TestApp};
use emulator::JournalEntry;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use storage_pg::testing::TestDb;

/// `cluster.lease`, the shortest allowed: renewed every second.
const LEASE: Duration = Duration::from_secs(3);
/// What a scenario waits for at most (the nodes' pace on a busy 2-core machine, not the lease's).
const WAIT: Duration = Duration::from_secs(60);
/// The seeded conversations' bot.
const BOT: &str = "B7f3a2c";

fn conversation_id(c: usize) -> String {
    format!("5c0e9b1f-4444-4d3e-9f10-{c:012x}")
}

fn end_user_id(c: usize) -> String {
    format!("4e6f0d0a-4444-4a5b-8c9d-{c:012x}")
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

// ---- The emulator's seed, the messages ----

/// The embedded default seed plus `conversations` clones of its first conversation and end user
/// (ids [`conversation_id`], [`end_user_id`]), written to `path`.
fn write_seed(path: &Path, conversations: usize) {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/emulator-seed.json");
    let text = std::fs::read_to_string(&source).expect("the default seed");
    let mut seed: Value = serde_json::from_str(&text).expect("the default seed is JSON");
    let conv0 = seed["conversations"][0].clone();
    let user0 = seed["endUsers"]
        .as_array()
        .and_then(|all| all.iter().find(|u| u["id"] == conv0["endUserId"]))
        .cloned()
        .expect("the first conversation's end user");
    for c in 0..conversations {
        let (conv, user, key) = (conversation_id(c), end_user_id(c), format!("failover-{c}"));
        let mut u = user0.clone();
        u["id"] = json!(user);
        u["userKey"] = json!(key);
        u["lastMessageId"] = Value::Null;
        u["lastConversationId"] = json!(conv);
        let mut v = conv0.clone();
        v["id"] = json!(conv);
        v["endUserId"] = json!(user);
        v["userKey"] = json!(key);
        v["context"]["conversationId"] = json!(conv);
        v["context"]["endUserId"] = json!(user);
        v["context"]["userKey"] = json!(key);
        push(&mut seed["endUsers"], u);
        push(&mut seed["conversations"], v);
    }
    std::fs::write(path, seed.to_string()).expect("write the seed");
}

fn push(list: &mut Value, item: Value) {
    list.as_array_mut().expect("a list").push(item);
}

/// The event id of message `k` of conversation `c` in run `tag`.
fn event_id(tag: u32, c: usize, k: usize) -> String {
    format!("{tag:08x}-{c:04x}-4e00-8000-{k:012x}")
}

/// Message `k` of conversation `c` (text `c<c>-m<k>`), one event in one delivery.
fn message(tag: u32, c: usize, k: usize) -> Vec<u8> {
    let id = |kind: u32| format!("{tag:08x}-{c:04x}-4{kind:03x}-8000-{k:012x}");
    let now = now_ms();
    let event = json!({
        "id": event_id(tag, c, k), "event": "bot.message.received", "sourceType": "bot",
        "sourceId": BOT, "timestamp": now,
        "data": { "message": {
            "id": id(0xa), "endUserId": end_user_id(c), "conversationId": conversation_id(c),
            "data": {"type": "text", "text": format!("c{c}-m{k}")}, "meta": null,
            "isUser": true, "timestamp": now, "requestId": id(0xb),
        }},
    });
    crate::common::delivery(&id(0xd), &[event])
}

/// The (conversation, message) an echo call's body answers, if it is one.
fn echo_of(body: &Value) -> Option<(usize, usize)> {
    let text = body.to_string();
    let rest = &text[text.find("echo c")? + "echo c".len()..];
    let (c, rest) = rest.split_once("-m")?;
    let k: String = rest.chars().take_while(char::is_ascii_digit).collect();
    Some((c.parse().ok()?, k.parse().ok()?))
}

/// An entry that took effect at the service: no injected fault, not a stored answer, 2xx.
fn took_effect(e: &JournalEntry) -> bool {
    e.fault.is_none() && !e.replayed && (200..300).contains(&e.status)
}

// ---- Two nodes on one database ----

/// Two nodes on one database and the emulator they both call; each node's process killed by PID
/// when dropped (`TestApp`), first (fields drop in order), then the emulator, then the files.
struct Pair {
    nodes: Vec<Option<TestApp>>,
    url: String,
    emulator: ExternalEmulator,
    /// The rules and the nodes' data directories.
    tmp: tempfile::TempDir,
    rules: PathBuf,
    /// Rules on (the echo) or off.
    echo: bool,
}

impl Pair {
    /// `node-a` (active once it has claimed), then `node-b`, on `url`; the emulator seeded with
    /// `conversations`.
    fn start(url: String, conversations: usize, echo: bool) -> Pair {
        let tmp = tempfile::tempdir().expect("tempdir");
        let seed = tmp.path().join("seed.json");
        write_seed(&seed, conversations);
        let emulator = ExternalEmulator::start_seeded(EMULATOR_KEY, &seed);
        let rules = rules_dir(tmp.path(), ECHO_RULE);
        let mut pair = Pair {
            nodes: Vec::new(),
            url,
            emulator,
            tmp,
            rules,
            echo,
        };
        let a = pair.spawn("node-a");
        poll_until("node-a active", WAIT, || {
            (view(&a)["role"] == "active").then_some(())
        });
        let b = pair.spawn("node-b");
        pair.nodes = vec![Some(a), Some(b)];
        pair
    }

    fn spawn(&self, name: &str) -> TestApp {
        let lease = format!("{}ms", LEASE.as_millis());
        let mut extra = vec![
            ("HANDOFF_BRIDGE_STORE_URL", self.url.as_str()),
            ("HANDOFF_BRIDGE__CLUSTER__NODE_ID", name),
            ("HANDOFF_BRIDGE__CLUSTER__LEASE", lease.as_str()),
            ("HANDOFF_BRIDGE_UPSTREAM_URL", self.emulator.base.as_str()),
            ("HANDOFF_BRIDGE_UPSTREAM_API_KEY", EMULATOR_KEY),
            ("HANDOFF_BRIDGE__BACKFILL__INTERVAL", "off"),
            ("HANDOFF_BRIDGE__RECONCILE__INTERVAL", "off"),
        ];
        if !self.echo {
            extra.push(("HANDOFF_BRIDGE__RULES__ENABLED", "false"));
        }
        let opts = Spawn {
            env: daemon_env(&self.rules, &extra),
            ..Spawn::default()
        };
        TestApp::spawn_in(&self.tmp.path().join(name), opts)
    }

    fn node(&self, i: usize) -> &TestApp {
        self.nodes[i].as_ref().expect("a node still running")
    }

    /// The one node every running node names as the active one: its index.
    fn active(&self) -> usize {
        poll_until("one active node every node names", WAIT, || {
            let running: Vec<(usize, Value)> = (0..self.nodes.len())
                .filter(|i| self.nodes[*i].is_some())
                .map(|i| (i, view(self.node(i))))
                .collect();
            let active: Vec<&(usize, Value)> = running
                .iter()
                .filter(|(_, v)| v["role"] == "active")
                .collect();
            let [(a, holder)] = active[..] else {
                return None;
            };
            let named = running
                .iter()
                .all(|(_, v)| v["holder"] == holder["node_id"] && v["epoch"] == holder["epoch"]);
            named.then_some(*a)
        })
    }

    fn journal(&self) -> Vec<JournalEntry> {
        journal(&self.emulator.base)
    }
}

/// The epoch a node's view names.
fn epoch(app: &TestApp) -> u64 {
    view(app)["epoch"].as_u64().expect("epoch")
}

/// Everything stored is folded and every action decided is carried out, on the active `app`.
fn settle(app: &TestApp) {
    crate::common::wait_drained(app);
    poll_until("the outbox idle", WAIT, || {
        let (status, _) = app.admin_get("/admin/v1/outbox/idle?timeout_ms=10000");
        (status == 200).then_some(())
    });
}

// ---- Senders ----

/// What one post came to.
#[derive(Clone, Debug, PartialEq)]
enum Answer {
    /// 200: stored, acknowledged.
    Acked,
    /// Another status, and whether it said `Retry-After`.
    Refused(u16, bool),
    /// No answer (the connection refused or cut).
    Failed(String),
}

/// One message posted: conversation, number, node, answer, and the load's stage when the post
/// began and when it was answered.
#[derive(Clone, Debug)]
struct Post {
    c: usize,
    k: usize,
    node: usize,
    answer: Answer,
    stages: (usize, usize),
}

/// Senders posting to both nodes, and what the test's thread sees of them.
struct Load {
    tag: u32,
    urls: [String; 2],
    /// Set by the test's thread as it acts (0 before it does anything).
    stage: AtomicUsize,
    stop: AtomicBool,
    /// Per node: posts acknowledged, posts refused.
    acked: [AtomicUsize; 2],
    refused: [AtomicUsize; 2],
    /// Between two posts of a sender.
    pace: Duration,
}

impl Load {
    fn new(pair: &Pair, pace: Duration) -> Load {
        Load {
            tag: rand::random(),
            urls: [0, 1].map(|i| pair.node(i).webhook_url.clone()),
            stage: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            acked: Default::default(),
            refused: Default::default(),
            pace,
        }
    }

    fn acks(&self) -> usize {
        self.acked.iter().map(|a| a.load(Ordering::SeqCst)).sum()
    }

    fn stage(&self) -> usize {
        self.stage.load(Ordering::SeqCst)
    }

    /// Post message `k` of conversation `c` to `node`.
    fn post(&self, agent: &ureq::Agent, node: usize, c: usize, k: usize) -> Post {
        let begun = self.stage();
        let answer = match agent
            .post(&self.urls[node])
            .header("content-type", "application/json")
            .send(&message(self.tag, c, k))
        {
            Ok(r) if r.status() == 200 => Answer::Acked,
            Ok(r) => Answer::Refused(r.status().as_u16(), r.headers().contains_key("retry-after")),
            Err(e) => Answer::Failed(e.to_string()),
        };
        match answer {
            Answer::Acked => &self.acked[node],
            _ => &self.refused[node],
        }
        .fetch_add(1, Ordering::SeqCst);
        Post {
            c,
            k,
            node,
            answer,
            stages: (begun, self.stage()),
        }
    }

    /// One sender: messages `0..messages` of each of `conversations` in turn, each posted to the
    /// nodes alternately, and after a node did not answer, to the other one only; until done or
    /// stopped.
    fn sender(&self, conversations: &[usize], messages: usize) -> Vec<Post> {
        let agent = agent();
        let mut gone = [false; 2];
        let mut posts = Vec::new();
        for k in 0..messages {
            for &c in conversations {
                let node = match (c + k) % 2 {
                    n if gone[n] => 1 - n,
                    n => n,
                };
                if self.stop.load(Ordering::SeqCst) || gone[node] {
                    return posts;
                }
                let post = self.post(&agent, node, c, k);
                gone[node] |= matches!(post.answer, Answer::Failed(_));
                posts.push(post);
                std::thread::sleep(self.pace);
            }
        }
        posts
    }

    /// `senders` senders, each with `per_sender` conversations of its own (sender `s`: `s`,
    /// `s + senders`...), posting `messages` per conversation while `act` runs on this thread;
    /// every post, and what `act` returned.
    fn run<T>(
        &self,
        (senders, per_sender, messages): (usize, usize, usize),
        act: impl FnOnce(&Load) -> T,
    ) -> (Vec<Post>, T) {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..senders)
                .map(|t| {
                    let mine: Vec<usize> = (0..per_sender).map(|i| t + i * senders).collect();
                    s.spawn(move || self.sender(&mine, messages))
                })
                .collect();
            let out = {
                let _stop = StopOnPanic(&self.stop);
                act(self)
            };
            let posts = handles
                .into_iter()
                .flat_map(|h| h.join().expect("a sender panicked"))
                .collect();
            (posts, out)
        })
    }
}

/// Stops the senders when the test's thread panics (it would wait for them forever otherwise).
struct StopOnPanic<'a>(&'a AtomicBool);

impl Drop for StopOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::SeqCst);
        }
    }
}

// ---- Checks ----

/// What the checks counted: messages sent, acknowledged, stored (and so folded).
#[derive(Debug, Default)]
struct Counted {
    sent: usize,
    acked: usize,
    stored: usize,
}

/// Whether event `id` is stored, as `app` reads the store; stored but still to fold is an error
/// (the checks run once the inbox is drained).
fn stored(app: &TestApp, id: &str) -> Result<bool, String> {
    match app.admin_get(&format!("/admin/v1/events/{id}")) {
        (200, e) if e["pending"] == false => Ok(true),
        (200, e) => Err(format!("event {id} stored but not folded: {e}")),
        (404, _) => Ok(false),
        (status, e) => Err(format!("event {id}: {status} {e}")),
    }
}

/// Conversation `c`'s `events_applied` as `app` reads it (0 when it has none).
fn events_applied(app: &TestApp, c: usize) -> u64 {
    match app.admin_get(&format!("/admin/v1/conversations/{}", conversation_id(c))) {
        (200, s) => s["events_applied"].as_u64().expect("events_applied"),
        (404, _) => 0,
        (status, s) => panic!("conversation {c}: {status} {s}"),
    }
}

/// Per conversation: the numbers of the messages posted, and of those acknowledged.
type Sent = BTreeMap<usize, (BTreeSet<usize>, BTreeSet<usize>)>;

fn by_conversation(posts: &[Post]) -> Sent {
    let mut out = Sent::new();
    for p in posts {
        let (sent, acked) = out.entry(p.c).or_default();
        sent.insert(p.k);
        if p.answer == Answer::Acked {
            acked.insert(p.k);
        }
    }
    out
}

/// Against the settled store, read on `app`, for every conversation posted to: every
/// acknowledged message stored and folded; every stored one folded once (`events_applied` counts
/// them, so acknowledged <= folded <= sent); with `echoes` (per conversation, in the order they
/// took effect at the service), each stored message carried out once, in the order sent.
fn check_folded(
    app: &TestApp,
    tag: u32,
    posts: &[Post],
    echoes: Option<&BTreeMap<usize, Vec<usize>>>,
) -> Counted {
    let mut problems = Vec::new();
    let mut counted = Counted::default();
    for (c, (sent, acked)) in by_conversation(posts) {
        let mut kept = Vec::new();
        for &k in &sent {
            match stored(app, &event_id(tag, c, k)) {
                Ok(true) => kept.push(k),
                Ok(false) if acked.contains(&k) => {
                    problems.push(format!("c{c}-m{k} acknowledged but not stored"))
                }
                Ok(false) => {}
                Err(e) => problems.push(e),
            }
        }
        let applied = events_applied(app, c);
        if applied != kept.len() as u64 {
            problems.push(format!(
                "c{c}: {applied} folded, {} stored: {kept:?}",
                kept.len()
            ));
        }
        let done = echoes.map(|e| e.get(&c).cloned().unwrap_or_default());
        if done.as_ref().is_some_and(|done| *done != kept) {
            problems.push(format!("c{c}: carried out {done:?}, stored {kept:?}"));
        }
        counted.sent += sent.len();
        counted.acked += acked.len();
        counted.stored += kept.len();
    }
    let some = &problems[..problems.len().min(10)];
    assert!(
        problems.is_empty(),
        "{} problems: {some:#?}",
        problems.len()
    );
    counted
}

/// The echoes that took effect at the service, per conversation, in the order they did.
fn echoes(journal: &[JournalEntry]) -> BTreeMap<usize, Vec<usize>> {
    let mut out: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (c, k) in journal
        .iter()
        .filter(|e| took_effect(e))
        .filter_map(|e| echo_of(&e.body))
    {
        out.entry(c).or_default().push(k);
    }
    out
}

/// How many idempotency keys were called twice; none more often (an entry in flight at a
/// takeover is carried out again at most once).
fn keys_called_twice(journal: &[JournalEntry]) -> usize {
    let mut calls: BTreeMap<&str, usize> = BTreeMap::new();
    for key in journal.iter().filter_map(|e| e.idempotency_key.as_deref()) {
        *calls.entry(key).or_default() += 1;
    }
    let more: Vec<_> = calls.iter().filter(|(_, n)| **n > 2).collect();
    assert!(more.is_empty(), "called more than twice: {more:?}");
    calls.values().filter(|n| **n == 2).count()
}

/// Every call the service saw under one key more than once was counted as a replay by the node
/// that made it again (`handoff_outbox_replayed_total` of `nodes`), and nothing became a dead
/// letter.
fn replays_counted(journal: &[JournalEntry], nodes: &[&TestApp]) -> usize {
    let twice = keys_called_twice(journal);
    let counted: f64 = nodes
        .iter()
        .map(|n| n.metric("handoff_outbox_replayed_total"))
        .sum();
    assert!(
        twice as f64 <= counted,
        "{twice} keys called twice, {counted} replays counted"
    );
    for node in nodes {
        let (status, letters) = node.admin_get("/admin/v1/dead-letters");
        assert_eq!(status, 200, "{letters}");
        assert_eq!(letters["count"], 0, "{letters}");
    }
    twice
}

// ---- The active killed ----

/// Scheduling margin on the takeover's bound: the standby's claim and the test's look at its
/// role (every 25 ms) on a 2-core machine that also runs PostgreSQL, the killed node's
/// neighbour and 8 senders, in a debug build.
const MARGIN: Duration = Duration::from_millis(1_000);

#[test]
fn the_active_killed_under_load_loses_nothing_acknowledged_and_the_standby_takes_over_in_time() {
    let Some(db) = TestDb::fresh("failover after SIGKILL") else {
        return;
    };
    const SENDERS: usize = 8;
    const PER_SENDER: usize = 4;
    const MESSAGES: usize = 12;
    let mut pair = Pair::start(db.url_with_schema(), SENDERS * PER_SENDER, true);
    let old = pair.active();
    let survivor = 1 - old;
    let epoch0 = epoch(pair.node(old));
    let load = Load::new(&pair, Duration::ZERO);
    let third = SENDERS * PER_SENDER * MESSAGES / 3;
    let started = Instant::now();
    let (posts, (at_kill, took)) = load.run((SENDERS, PER_SENDER, MESSAGES), |load| {
        poll_until("a third of the messages acknowledged", WAIT, || {
            (load.acks() >= third).then_some(())
        });
        let at_kill = epoch(pair.node(old));
        load.stage.store(1, Ordering::SeqCst);
        let killed = Instant::now();
        pair.nodes[old].take().expect("the active").kill9();
        poll_until("the standby active", WAIT, || {
            (view(pair.node(survivor))["role"] == "active").then_some(())
        });
        (at_kill, killed.elapsed())
    });
    assert_eq!(at_kill, epoch0, "the active kept its lease under load");
    let bound = LEASE + LEASE / 3 + MARGIN;
    assert!(
        took <= bound,
        "taken over {took:?} after the kill (bound {bound:?})"
    );
    assert_eq!(pair.active(), survivor);
    assert_eq!(epoch(pair.node(survivor)), epoch0 + 1, "one takeover");
    check_senders_after_kill(&posts, survivor);
    settle(pair.node(survivor));
    let journal = pair.journal();
    let counted = check_folded(
        pair.node(survivor),
        load.tag,
        &posts,
        Some(&echoes(&journal)),
    );
    let replays = replays_counted(&journal, &[pair.node(survivor)]);
    eprintln!(
        "SIGKILL: taken over {took:?} after the kill; {counted:?}; {replays} calls replayed; \
         {:?} in all",
        started.elapsed()
    );
}

/// The survivor answered every post 200, and took posts after the kill; the killed node
/// acknowledged nothing begun after it.
fn check_senders_after_kill(posts: &[Post], survivor: usize) {
    let refused: Vec<&Post> = posts
        .iter()
        .filter(|p| p.node == survivor && p.answer != Answer::Acked)
        .collect();
    assert!(refused.is_empty(), "the survivor refused: {refused:?}");
    let after = |p: &&Post| p.stages.0 == 1;
    let on = posts
        .iter()
        .filter(after)
        .filter(|p| p.node == survivor)
        .count();
    assert!(on > 0, "no post reached the survivor after the kill");
    let acked_dead = posts
        .iter()
        .filter(after)
        .filter(|p| p.node != survivor && p.answer == Answer::Acked)
        .count();
    assert_eq!(
        acked_dead, 0,
        "the killed node acknowledged posts after the kill"
    );
}

// ---- The active paused ----

/// How long PostgreSQL lets a paused active's open transaction hold the lease row: a third of the
/// lease (crates/storage-pg's `lease::idle_limit`), so it is gone before the lease runs out.
const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(LEASE.as_secs() / 3);

fn signal(app: &TestApp, signal: nix::sys::signal::Signal) {
    let pid = nix::unistd::Pid::from_raw(app.pid() as i32);
    nix::sys::signal::kill(pid, signal).expect("signal the node");
}

/// Post message `k` of conversation `c` to `app`: acknowledged.
fn post_ok(app: &TestApp, tag: u32, c: usize, k: usize) -> Post {
    let (status, answer) = app.post(&message(tag, c, k));
    assert_eq!(status, 200, "c{c}-m{k}: {answer}");
    Post {
        c,
        k,
        node: 0,
        answer: Answer::Acked,
        stages: (0, 0),
    }
}

/// What the active is doing when it is paused: the posts it acknowledged, its call in flight,
/// the connection whose row lock holds its fold inside its transaction, that fold's backend.
struct InFlight {
    posts: Vec<Post>,
    hung: JournalEntry,
    lock: storage_pg::testing::Reader,
    fold_pid: i64,
}

/// The active `app` at work that a pause must not let land later: its call for `c0-m1` in
/// flight (the service never answers it), its fold of `c1-m1` inside its transaction, held at
/// its write by a lock of the test's on conversation 1's row (the lease row share-locked by the
/// fold meanwhile; `COMMIT` on `lock` lets the write through).
fn work_in_flight(app: &TestApp, emulator: &str, db: &TestDb, tag: u32) -> InFlight {
    let prefix = format!("/openapi/conversation/{}/message", conversation_id(0));
    set_faults(emulator, json!({"hang_next": 1, "path_prefix": prefix}));
    let mut posts = vec![post_ok(app, tag, 0, 1)];
    let hung = poll_until("the call for c0-m1 in flight", WAIT, || {
        journal(emulator)
            .into_iter()
            .find(|e| e.fault.as_deref() == Some("hang") && echo_of(&e.body) == Some((0, 1)))
    });
    let lock = db.reader();
    lock.execute(&format!(
        "BEGIN; SELECT 1 FROM conversations WHERE id = '{}' FOR UPDATE",
        conversation_id(1)
    ));
    posts.push(post_ok(app, tag, 1, 1));
    let waiting = "SELECT pid::bigint FROM pg_locks \
                   WHERE NOT granted AND pg_backend_pid() = ANY(pg_blocking_pids(pid))";
    let fold_pid = poll_until("the fold of c1-m1 waiting at its write", WAIT, || {
        lock.numbers(waiting).first().copied()
    });
    InFlight {
        posts,
        hung,
        lock,
        fold_pid,
    }
}

#[test]
fn the_active_paused_past_its_lease_lands_nothing_after_and_comes_back_as_a_standby() {
    paused_active();
}

/// The active paused (SIGSTOP) with a call in flight and a fold's transaction open, messages
/// posted to the standby meanwhile, resumed once the standby took over: PostgreSQL ended the
/// paused transaction's session before the lease ran out, the lease moved on by one epoch, every
/// message is folded and carried out once, in order, the call in flight again once (replayed,
/// counted), and the old active stands by; a pass asked of it then is run by the active.
fn paused_active() {
    let Some(db) = TestDb::fresh("failover after SIGSTOP") else {
        return;
    };
    let tag: u32 = rand::random();
    let pair = Pair::start(db.url_with_schema(), 3, true);
    let (old, new) = (pair.active(), 1 - pair.active());
    let epoch0 = epoch(pair.node(old));
    let mut posts: Vec<Post> = (0..3)
        .map(|c| post_ok(pair.node(c % 2), tag, c, 0))
        .collect();
    settle(pair.node(old));
    let work = work_in_flight(pair.node(old), &pair.emulator.base, &db, tag);
    posts.extend(work.posts.iter().cloned());

    signal(pair.node(old), nix::sys::signal::Signal::SIGSTOP);
    let paused = Instant::now();
    work.lock.execute("COMMIT");
    posts.push(post_ok(pair.node(new), tag, 2, 1));
    session_ended_before_the_lease(&work, paused);
    poll_until("the standby active", WAIT, || {
        (view(pair.node(new))["role"] == "active").then_some(())
    });
    let took = paused.elapsed();
    check_takeover_after_pause(took);
    let (active, standby) = (new, old);
    assert_eq!(epoch(pair.node(active)), epoch0 + 1, "one new epoch");
    posts.push(post_ok(pair.node(new), tag, 2, 2));
    settle(pair.node(active));

    signal(pair.node(old), nix::sys::signal::Signal::SIGCONT);
    back_as_standby(&pair, standby, active, epoch0 + 1);
    let (status, pruned) = pair.node(standby).admin_post("/admin/v1/prune");
    assert_eq!(
        status, 200,
        "a pass asked of the standby, run by the active: {pruned}"
    );
    assert!(pruned["took_ms"].is_u64(), "{pruned}");
    posts.push(post_ok(pair.node(old), tag, 0, 2));
    settle(pair.node(active));
    let journal = pair.journal();
    check_folded(pair.node(active), tag, &posts, Some(&echoes(&journal)));
    check_replayed_once(
        &journal,
        &work.hung,
        [pair.node(active), pair.node(standby)],
    );
    let errors = pair.node(old).metric("handoff_dispatch_errors_total");
    eprintln!(
        "SIGSTOP: node {active} active {took:?} after the pause; the paused node's fold errors: \
         {errors}"
    );
}

/// PostgreSQL ends the paused node's session, whose open transaction holds the lease row, within
/// the idle limit of the pause, while the lease it holds has not yet run out (the database's
/// clock): the takeover waits for the lease alone.
fn session_ended_before_the_lease(work: &InFlight, paused: Instant) {
    let gone = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE pid = {}",
        work.fold_pid
    );
    poll_until("the paused transaction's session ended", WAIT, || {
        (work.lock.numbers(&gone)[0] == 0).then_some(())
    });
    let ended = paused.elapsed();
    let running = "SELECT count(*) FROM lease \
                   WHERE expires_at > (extract(epoch from clock_timestamp()) * 1000)::bigint";
    let held = work.lock.numbers(running)[0];
    assert!(
        ended <= IDLE_IN_TRANSACTION + MARGIN && held == 1,
        "the paused session ended {ended:?} after the pause, lease running then: {held}"
    );
}

/// The takeover `took` after the pause: once the paused node's lease ran out (renewed at most a
/// renewal before the pause), within the lease and a renewal.
fn check_takeover_after_pause(took: Duration) {
    let range = LEASE - LEASE / 3..=LEASE + LEASE / 3 + MARGIN;
    assert!(
        range.contains(&took),
        "taken over {took:?} after the pause (expected {range:?})"
    );
}

/// Node `old` stands by under `new` at `epoch`: its own view, its gauge.
fn back_as_standby(pair: &Pair, old: usize, new: usize, epoch: u64) {
    let holder = view(pair.node(new))["node_id"].clone();
    poll_until("a standby under the new active", WAIT, || {
        let v = view(pair.node(old));
        (v["role"] == "standby" && v["holder"] == holder && v["epoch"] == epoch).then_some(())
    });
    assert_eq!(pair.node(old).metric("handoff_cluster_role"), 0.0);
    assert_eq!(pair.active(), new);
}

/// The call in flight at the pause (`hung`) was carried out again once, by the new active under
/// the same key, and counted; nothing else twice.
fn check_replayed_once(journal: &[JournalEntry], hung: &JournalEntry, [new, old]: [&TestApp; 2]) {
    assert_eq!(
        replays_counted(journal, &[new, old]),
        1,
        "one call made again"
    );
    assert_eq!(new.metric("handoff_outbox_replayed_total"), 1.0);
    let again: Vec<&JournalEntry> = journal
        .iter()
        .filter(|e| e.seq != hung.seq && e.idempotency_key == hung.idempotency_key)
        .collect();
    assert!(
        matches!(again[..], [e] if took_effect(e)),
        "made again once, taking effect: {again:?}"
    );
}

// ---- PostgreSQL restarted ----

/// The load's stages while the database goes away and comes back.
const STOPPING: usize = 1;
const DOWN: usize = 2;
const STARTING: usize = 3;
const UP: usize = 4;

/// The database stopped as if it crashed (`pg_ctl stop -m immediate`: no checkpoint, sessions cut,
/// recovered from its WAL at the next start, so a commit answered before its WAL was written
/// would be lost), while 4 senders post to both nodes; started again once both nodes refuse posts
/// and say they are not ready.
#[test]
fn postgres_restarted_under_load_loses_nothing_acknowledged_and_every_node_resumes() {
    const SENDERS: usize = 4;
    const PER_SENDER: usize = 4;
    let Some(server) = PgServer::start("PostgreSQL restarted under load", "", &[]) else {
        return;
    };
    let pair = Pair::start(server.url("127.0.0.1", "sslmode=disable"), 0, false);
    let load = Load::new(&pair, Duration::from_millis(10));
    let started = Instant::now();
    let (posts, ()) = load.run((SENDERS, PER_SENDER, usize::MAX), |load| {
        poll_until("deliveries acknowledged", WAIT, || {
            (load.acks() >= 40).then_some(())
        });
        load.stage.store(STOPPING, Ordering::SeqCst);
        server.stop("immediate");
        load.stage.store(DOWN, Ordering::SeqCst);
        let refused = [0, 1].map(|i| load.refused[i].load(Ordering::SeqCst));
        poll_until("both nodes refusing and not ready", WAIT, || {
            let each = (0..2).all(|i| {
                load.refused[i].load(Ordering::SeqCst) > refused[i]
                    && pair.node(i).get("/readyz").0 == 503
            });
            each.then_some(())
        });
        load.stage.store(STARTING, Ordering::SeqCst);
        server.start_again();
        load.stage.store(UP, Ordering::SeqCst);
        let acked = [0, 1].map(|i| load.acked[i].load(Ordering::SeqCst));
        poll_until("both nodes ready and taking posts again", WAIT, || {
            let each = (0..2).all(|i| {
                load.acked[i].load(Ordering::SeqCst) >= acked[i] + 10
                    && pair.node(i).get("/readyz").0 == 200
            });
            each.then_some(())
        });
        load.stop.store(true, Ordering::SeqCst);
    });
    check_outage_answers(&posts);
    let active = pair.active();
    settle(pair.node(active));
    let counted = check_folded(pair.node(active), load.tag, &posts, None);
    eprintln!(
        "PostgreSQL restarted: {counted:?}; {} refused while it was down; {:?} in all",
        posts.iter().filter(|p| p.stages == (DOWN, DOWN)).count(),
        started.elapsed()
    );
}

/// Every post was answered (the nodes stayed up); whatever was not acknowledged was refused 503
/// with `Retry-After`, and every post begun and answered while the database was down was.
fn check_outage_answers(posts: &[Post]) {
    let wrong: Vec<&Post> = posts
        .iter()
        .filter(|p| p.answer != Answer::Acked && p.answer != Answer::Refused(503, true))
        .collect();
    assert!(wrong.is_empty(), "answered otherwise: {wrong:?}");
    let down: Vec<&Post> = posts.iter().filter(|p| p.stages == (DOWN, DOWN)).collect();
    assert!(!down.is_empty(), "no post while the database was down");
    let acked: Vec<&&Post> = down.iter().filter(|p| p.answer == Answer::Acked).collect();
    assert!(
        acked.is_empty(),
        "acknowledged while the database was down: {acked:?}"
    );
}
