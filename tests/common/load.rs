//! Load generation and exactly-once checks shared by the crash-recovery and graceful-shutdown
//! tests: unique deliveries built from the shared fixtures, client threads that keep a ledger of
//! what was answered 200, and the checks run against a restarted daemon.

use super::{agent, fixtures, wait_drained, TestApp, ADMIN_TOKEN};
use serde_json::{json, Value};
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The middle of `xs` (the upper one of an even count).
pub fn median(xs: &[Duration]) -> Duration {
    let mut v = xs.to_vec();
    v.sort();
    v[v.len() / 2]
}

/// `HANDOFF_BRIDGE_LONG_TESTS=1` asks for the long variants.
pub fn long_tests() -> bool {
    std::env::var("HANDOFF_BRIDGE_LONG_TESTS").is_ok_and(|v| v == "1")
}

/// A seed that differs per run (printed by the tests so a failure can be replayed).
pub fn seed_from_env_or_clock() -> u64 {
    if let Some(seed) = std::env::var("HANDOFF_BRIDGE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return seed;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ (u64::from(std::process::id()) << 32)
}

/// splitmix64: small, deterministic, good enough to pick shapes.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

#[derive(Clone, Debug)]
pub struct SentEvent {
    pub id: String,
    /// Index into [`Generator::conversations`].
    pub conversation: usize,
}

/// One delivery as sent: its id, exact body and the events it carries.
#[derive(Clone, Debug)]
pub struct SentDelivery {
    pub id: String,
    pub body: Vec<u8>,
    pub events: Vec<SentEvent>,
}

/// Builds unique deliveries (fresh delivery, event and message ids every time) from the shapes
/// of the shared fixtures' message and conversation events, spread over a fixed set of
/// conversations.
pub struct Generator {
    tag: u32,
    templates: Vec<Value>,
    webhook_id: String,
    webhook_url: String,
    pub conversations: Vec<String>,
    end_users: Vec<String>,
    counter: AtomicU64,
    base_ts: i64,
}

impl Generator {
    pub fn new(conversations: usize, seed: u64) -> Self {
        let mut templates = Vec::new();
        let mut envelope = None;
        for (name, body) in fixtures() {
            let delivery: Value =
                serde_json::from_slice(&body).unwrap_or_else(|e| panic!("{name}: {e}"));
            if envelope.is_none() {
                envelope = Some((
                    delivery["webhookId"]
                        .as_str()
                        .expect("webhookId")
                        .to_owned(),
                    delivery["webhookUrl"]
                        .as_str()
                        .expect("webhookUrl")
                        .to_owned(),
                ));
            }
            for event in delivery["messages"].as_array().expect("messages") {
                let data = &event["data"];
                if data.get("message").is_some() || data.get("conversation").is_some() {
                    templates.push(event.clone());
                }
            }
        }
        let kinds: std::collections::BTreeSet<&str> = templates
            .iter()
            .filter_map(|t| t["event"].as_str())
            .collect();
        assert!(
            kinds.contains("bot.message.received")
                && kinds.contains("bot.message.sent")
                && kinds.len() >= 5,
            "fixtures lack message/conversation events: {kinds:?}"
        );
        let (webhook_id, webhook_url) = envelope.expect("at least one fixture");
        let tag = (seed ^ (seed >> 32)) as u32;
        let uuid = |kind: u16, n: u64| format!("{tag:08x}-{kind:04x}-4000-8000-{n:012x}");
        Generator {
            tag,
            templates,
            webhook_id,
            webhook_url,
            conversations: (0..conversations as u64).map(|i| uuid(0xc0, i)).collect(),
            end_users: (0..conversations as u64).map(|i| uuid(0xe0, i)).collect(),
            counter: AtomicU64::new(1),
            base_ts: 1_763_690_400_000,
        }
    }

    fn next_id(&self, kind: u16) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        format!("{:08x}-{kind:04x}-4000-8000-{n:012x}", self.tag)
    }

    /// A new delivery of 1-5 events.
    pub fn delivery(&self, rng: &mut Rng) -> SentDelivery {
        let count = 1 + rng.below(5);
        let id = self.next_id(0xd);
        let mut events = Vec::with_capacity(count);
        let mut sent = Vec::with_capacity(count);
        for _ in 0..count {
            let mut event = self.templates[rng.below(self.templates.len())].clone();
            let conv = rng.below(self.conversations.len());
            let (conv_id, user_id) = (&self.conversations[conv], &self.end_users[conv]);
            let event_id = self.next_id(0xe);
            let ts = self.base_ts + (self.counter.load(Ordering::Relaxed) as i64);
            event["id"] = json!(event_id);
            event["timestamp"] = json!(ts);
            let data = &mut event["data"];
            if let Some(m) = data.get_mut("message") {
                m["id"] = json!(self.next_id(0xa));
                m["conversationId"] = json!(conv_id);
                m["endUserId"] = json!(user_id);
                m["timestamp"] = json!(ts);
            } else if let Some(c) = data.get_mut("conversation") {
                c["id"] = json!(conv_id);
                c["endUserId"] = json!(user_id);
                c["userKey"] = json!(format!("load-user-{conv}"));
                if let Some(ctx) = c.get_mut("context").filter(|v| v.is_object()) {
                    ctx["conversationId"] = json!(conv_id);
                    ctx["endUserId"] = json!(user_id);
                    ctx["userKey"] = json!(format!("load-user-{conv}"));
                }
            }
            events.push(event);
            sent.push(SentEvent {
                id: event_id,
                conversation: conv,
            });
        }
        let body = json!({
            "id": id,
            "webhookId": self.webhook_id,
            "webhookUrl": self.webhook_url,
            "messages": events,
        });
        SentDelivery {
            id,
            body: serde_json::to_vec(&body).expect("encode delivery"),
            events: sent,
        }
    }
}

/// POST a delivery body. `Err` is a transport-level failure (refused, reset, timeout).
pub fn post_body(agent: &ureq::Agent, url: &str, body: &[u8]) -> Result<(u16, Value), String> {
    let mut resp = agent
        .post(url)
        .header("content-type", "application/json")
        .send(body)
        .map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    Ok((
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    ))
}

fn admin_get_with(agent: &ureq::Agent, base: &str, path: &str) -> (u16, Value) {
    let mut resp = agent
        .get(format!("{base}{path}"))
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .call()
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// How the load is driven.
pub struct LoadPlan {
    pub threads: usize,
    /// The action runs once this many deliveries have been answered 200.
    pub trigger_after_acks: usize,
    /// Bound on waiting for the trigger.
    pub trigger_timeout: Duration,
    pub seed: u64,
}

/// What the clients saw.
#[derive(Default)]
pub struct LoadReport {
    /// Deliveries answered HTTP 200.
    pub acked: Vec<SentDelivery>,
    /// Deliveries sent but not answered 200 (transport error or another status).
    pub unacked: Vec<SentDelivery>,
    /// Anything unexpected: a failure or non-200 answer before the action, or a 200 whose receipt
    /// is not `accepted` with every event new.
    pub anomalies: Vec<String>,
    /// Requests that were started before the action began and finished after it.
    pub in_flight_at_action: usize,
    pub acked_after_action: usize,
    pub refused_after_action: usize,
    pub transport_errors_after_action: usize,
    pub elapsed_before_action: Duration,
}

/// Run `plan.threads` clients posting fresh deliveries to `url`. Once `trigger_after_acks`
/// deliveries were answered 200 (signalled over a channel), `action` runs on this thread while
/// the clients keep posting. A client stops at its first failure after the action began (or when
/// the action has returned). Panics if the trigger is not reached in time.
pub fn run_load<T>(
    url: &str,
    gen: &Generator,
    plan: &LoadPlan,
    action: impl FnOnce() -> T,
) -> (LoadReport, T) {
    let acted = AtomicBool::new(false);
    let stop = AtomicBool::new(false);
    let acks = AtomicUsize::new(0);
    let (tx, rx) = mpsc::channel::<()>();
    let started = Instant::now();
    std::thread::scope(|s| {
        let mut clients = Vec::new();
        for t in 0..plan.threads {
            let tx = tx.clone();
            let (acted, stop, acks) = (&acted, &stop, &acks);
            let seed = plan.seed ^ ((t as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407));
            let trigger = plan.trigger_after_acks;
            clients.push(s.spawn(move || {
                let agent = agent();
                let mut rng = Rng::new(seed);
                let mut report = LoadReport::default();
                while !stop.load(Ordering::SeqCst) {
                    let delivery = gen.delivery(&mut rng);
                    let before = acted.load(Ordering::SeqCst);
                    let result = post_body(&agent, url, &delivery.body);
                    let after = acted.load(Ordering::SeqCst);
                    if !before && after {
                        report.in_flight_at_action += 1;
                    }
                    match result {
                        Ok((200, receipt)) => {
                            // A 200 status line means the delivery is durable, whatever follows.
                            let n = delivery.events.len() as u64;
                            if receipt["status"] != "accepted"
                                || receipt["accepted"] != n
                                || receipt["duplicates"] != 0
                            {
                                report.anomalies.push(format!(
                                    "delivery {} with {n} new events answered {receipt}",
                                    delivery.id
                                ));
                            }
                            report.acked.push(delivery);
                            if after {
                                report.acked_after_action += 1;
                            }
                            if acks.fetch_add(1, Ordering::SeqCst) + 1 == trigger {
                                let _ = tx.send(());
                            }
                        }
                        Ok((status, body)) => {
                            report.unacked.push(delivery);
                            if after {
                                report.refused_after_action += 1;
                                break;
                            }
                            report
                                .anomalies
                                .push(format!("answered {status} before the action: {body}"));
                        }
                        Err(e) => {
                            report.unacked.push(delivery);
                            if after {
                                report.transport_errors_after_action += 1;
                            } else {
                                report
                                    .anomalies
                                    .push(format!("transport error before the action: {e}"));
                            }
                            break;
                        }
                    }
                }
                report
            }));
        }
        drop(tx);
        let fired = rx.recv_timeout(plan.trigger_timeout);
        let elapsed_before_action = started.elapsed();
        let outcome = match fired {
            Ok(()) => {
                acted.store(true, Ordering::SeqCst);
                Some(action())
            }
            Err(_) => None,
        };
        stop.store(true, Ordering::SeqCst);
        let mut total = LoadReport {
            elapsed_before_action,
            ..LoadReport::default()
        };
        for client in clients {
            let r = client.join().expect("client thread panicked");
            total.acked.extend(r.acked);
            total.unacked.extend(r.unacked);
            total.anomalies.extend(r.anomalies);
            total.in_flight_at_action += r.in_flight_at_action;
            total.acked_after_action += r.acked_after_action;
            total.refused_after_action += r.refused_after_action;
            total.transport_errors_after_action += r.transport_errors_after_action;
        }
        match outcome {
            Some(out) => (total, out),
            None => panic!(
                "trigger ({} acked deliveries) not reached within {:?}: {} acked; anomalies: {:?}",
                plan.trigger_after_acks,
                plan.trigger_timeout,
                total.acked.len(),
                total.anomalies.iter().take(10).collect::<Vec<_>>()
            ),
        }
    })
}

/// Send SIGTERM and wait (on a helper thread, woken by the process exit) at most `limit` for the
/// daemon to exit. Returns the exit status (None if it had to be killed) and the time it took.
pub fn terminate_within(app: TestApp, limit: Duration) -> (Option<ExitStatus>, Duration) {
    let pid = nix::unistd::Pid::from_raw(app.pid() as i32);
    let (tx, rx) = mpsc::channel();
    let started = Instant::now();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let waiter = std::thread::spawn(move || {
        let mut app = app;
        let status = app.child().wait().expect("wait");
        let _ = tx.send(status);
        drop(app);
    });
    match rx.recv_timeout(limit) {
        Ok(status) => {
            let took = started.elapsed();
            waiter.join().expect("waiter");
            (Some(status), took)
        }
        Err(_) => {
            let took = started.elapsed();
            // Still our unreaped child (the waiter has not returned), so the pid is its own.
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            waiter.join().expect("waiter");
            (None, took)
        }
    }
}

/// Run `f` over `items` on a few threads, each with its own HTTP agent.
fn par_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&ureq::Agent, &T) -> R + Sync) -> Vec<R> {
    const THREADS: usize = 8;
    if items.is_empty() {
        return Vec::new();
    }
    let chunk = items.len().div_ceil(THREADS);
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = items
            .chunks(chunk)
            .map(|part| {
                s.spawn(move || {
                    let agent = agent();
                    part.iter().map(|item| f(&agent, item)).collect::<Vec<R>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("worker panicked"))
            .collect()
    })
}

/// What the daemon says about one event id: `None` when it is not stored.
fn lookup_event(
    agent: &ureq::Agent,
    base: &str,
    id: &str,
) -> Result<Option<(String, bool)>, String> {
    match admin_get_with(agent, base, &format!("/admin/v1/events/{id}")) {
        (200, body) => {
            let delivery = body["record"]["delivery"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let pending = body["pending"]
                .as_bool()
                .ok_or_else(|| format!("event {id}: no pending flag: {body}"))?;
            Ok(Some((delivery, pending)))
        }
        (404, _) => Ok(None),
        (status, body) => Err(format!("event {id}: answered {status}: {body}")),
    }
}

/// Every delivery answered 200 so far; accumulates across restarts.
pub struct Ledger {
    pub acked: Vec<SentDelivery>,
    pub conversations: usize,
    /// `acked[..verified]` were looked up one by one and re-posted by an earlier check; later
    /// checks cover them through the per-conversation counts only, so a long kill loop does not
    /// re-read its whole history every cycle ([`Ledger::verify_all`] does, at the end).
    verified: usize,
}

/// What one round of checks found.
#[derive(Debug, Default)]
pub struct CheckSummary {
    pub acked_events: usize,
    pub unacked_deliveries: usize,
    pub unacked_stored: usize,
    pub unacked_lost: usize,
}

impl Ledger {
    pub fn new(conversations: usize) -> Self {
        Ledger {
            acked: Vec::new(),
            conversations,
            verified: 0,
        }
    }

    fn expected_counts<'a>(&self, extra: impl Iterator<Item = &'a SentDelivery>) -> Vec<u64> {
        let mut counts = vec![0u64; self.conversations];
        for d in extra {
            for e in &d.events {
                counts[e.conversation] += 1;
            }
        }
        for d in &self.acked {
            for e in &d.events {
                counts[e.conversation] += 1;
            }
        }
        counts
    }

    /// Against a freshly restarted daemon on the same data dir:
    /// 1. every acknowledged event not verified by an earlier check is stored, folded (not
    ///    pending) and attributed to its delivery;
    /// 2. each unacknowledged delivery is stored entirely or not at all;
    /// 3. every conversation's `events_applied` equals the number of distinct stored events;
    /// 4. re-posting those acknowledged deliveries answers `duplicate` and changes no count;
    /// 5. retrying the unacknowledged deliveries (as the service would) answers `duplicate` for
    ///    stored ones and `accepted` for the others, after which the counts match again.
    ///
    /// Afterwards every delivery in `unacked` is in the ledger.
    pub fn check_after_restart(
        &mut self,
        app: &TestApp,
        gen: &Generator,
        unacked: Vec<SentDelivery>,
    ) -> CheckSummary {
        let base = app.admin_base.as_str();
        wait_drained(app);
        let mut summary = CheckSummary {
            unacked_deliveries: unacked.len(),
            ..CheckSummary::default()
        };

        // 1. Acknowledged events.
        let fresh = &self.acked[self.verified..];
        let acked_events: Vec<(&str, &str)> = fresh
            .iter()
            .flat_map(|d| d.events.iter().map(move |e| (e.id.as_str(), d.id.as_str())))
            .collect();
        summary.acked_events = acked_events.len();
        let problems: Vec<String> = par_map(&acked_events, |agent, (id, delivery)| {
            match lookup_event(agent, base, id) {
                Ok(Some((d, false))) if d == *delivery => None,
                Ok(Some((d, pending))) => Some(format!(
                    "acked event {id}: delivery {d} (want {delivery}), pending {pending}"
                )),
                Ok(None) => Some(format!(
                    "acked event {id} of delivery {delivery} is not stored"
                )),
                Err(e) => Some(e),
            }
        })
        .into_iter()
        .flatten()
        .collect();
        assert!(
            problems.is_empty(),
            "{} of {} acknowledged events are wrong after restart, e.g. {:#?}",
            problems.len(),
            acked_events.len(),
            &problems[..problems.len().min(10)]
        );

        // 2. Unacknowledged deliveries: all or nothing.
        let verdicts: Vec<Result<bool, String>> = par_map(&unacked, |agent, d| {
            let mut stored = 0;
            for e in &d.events {
                match lookup_event(agent, base, &e.id)? {
                    Some((delivery, false)) if delivery == d.id => stored += 1,
                    Some((delivery, pending)) => {
                        return Err(format!(
                            "unacked event {}: delivery {delivery} (want {}), pending {pending}",
                            e.id, d.id
                        ))
                    }
                    None => {}
                }
            }
            if stored == 0 || stored == d.events.len() {
                Ok(stored > 0)
            } else {
                Err(format!(
                    "delivery {} stored partially: {stored} of {} events",
                    d.id,
                    d.events.len()
                ))
            }
        });
        let problems: Vec<&String> = verdicts.iter().filter_map(|v| v.as_ref().err()).collect();
        assert!(
            problems.is_empty(),
            "unacknowledged deliveries: {problems:#?}"
        );
        let stored_unacked: Vec<&SentDelivery> = unacked
            .iter()
            .zip(&verdicts)
            .filter(|(_, v)| matches!(v, Ok(true)))
            .map(|(d, _)| d)
            .collect();
        summary.unacked_stored = stored_unacked.len();
        summary.unacked_lost = unacked.len() - stored_unacked.len();

        // 3. Exactly once per conversation.
        let expected = self.expected_counts(stored_unacked.iter().copied());
        self.assert_counts(app, gen, &expected, "after restart");

        // 4. Re-posting acknowledged deliveries.
        let url = app.webhook_url.as_str();
        let problems: Vec<String> =
            par_map(fresh, |agent, d| match post_body(agent, url, &d.body) {
                Ok((200, r))
                    if r["status"] == "duplicate"
                        && r["accepted"] == 0
                        && r["duplicates"] == d.events.len() as u64 =>
                {
                    None
                }
                Ok((status, r)) => Some(format!("re-posted delivery {}: {status} {r}", d.id)),
                Err(e) => Some(format!("re-posted delivery {}: {e}", d.id)),
            })
            .into_iter()
            .flatten()
            .collect();
        assert!(
            problems.is_empty(),
            "{} of {} re-posted deliveries were not duplicates, e.g. {:#?}",
            problems.len(),
            fresh.len(),
            &problems[..problems.len().min(10)]
        );

        // 5. Retrying the unacknowledged ones.
        let problems: Vec<String> = par_map(
            &unacked.iter().zip(&verdicts).collect::<Vec<_>>(),
            |agent, (d, stored)| {
                let stored = matches!(stored, Ok(true));
                let n = d.events.len() as u64;
                match post_body(agent, url, &d.body) {
                    Ok((200, r))
                        if stored
                            && r["status"] == "duplicate"
                            && r["accepted"] == 0
                            && r["duplicates"] == n =>
                    {
                        None
                    }
                    Ok((200, r)) if !stored && r["status"] == "accepted" && r["accepted"] == n => {
                        None
                    }
                    Ok((status, r)) => Some(format!(
                        "retried delivery {} (stored: {stored}): {status} {r}",
                        d.id
                    )),
                    Err(e) => Some(format!("retried delivery {}: {e}", d.id)),
                }
            },
        )
        .into_iter()
        .flatten()
        .collect();
        assert!(problems.is_empty(), "retries: {problems:#?}");
        // The retried ones are looked up by the next check.
        self.verified = self.acked.len();
        self.acked.extend(unacked);
        wait_drained(app);
        let expected = self.expected_counts(std::iter::empty());
        self.assert_counts(app, gen, &expected, "after re-posting every delivery");
        summary
    }

    /// [`check_after_restart`](Ledger::check_after_restart) over the whole ledger: every
    /// acknowledged event looked up and every delivery re-posted again.
    pub fn verify_all(&mut self, app: &TestApp, gen: &Generator) -> CheckSummary {
        self.verified = 0;
        self.check_after_restart(app, gen, Vec::new())
    }

    /// Every conversation's `events_applied` equals `expected` (404 only where nothing is stored).
    pub fn assert_counts(&self, app: &TestApp, gen: &Generator, expected: &[u64], when: &str) {
        let indexed: Vec<usize> = (0..self.conversations).collect();
        let base = app.admin_base.as_str();
        let problems: Vec<String> = par_map(&indexed, |agent, &i| {
            let id = &gen.conversations[i];
            match admin_get_with(agent, base, &format!("/admin/v1/conversations/{id}")) {
                (200, state) if state["events_applied"] == expected[i] => None,
                (404, _) if expected[i] == 0 => None,
                (status, state) => Some(format!(
                    "conversation {id}: {status}, events_applied {} but {} distinct events stored",
                    state["events_applied"], expected[i]
                )),
            }
        })
        .into_iter()
        .flatten()
        .collect();
        assert!(problems.is_empty(), "{when}: {problems:#?}");
    }

    /// Expected `events_applied` of every conversation, from the ledger alone.
    pub fn counts(&self) -> Vec<u64> {
        self.expected_counts(std::iter::empty())
    }
}
