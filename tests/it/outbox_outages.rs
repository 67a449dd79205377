//! Issue 20, part 1, from the outside: the upstream goes away for minutes or hours and the outbox
//! holds its actions, in order, and carries each out once when it is back.
//!
//! The real daemon with the test clock on runs a rule of the test's own that decides two actions
//! per user message (`set_manual`, then `send_message` with the message's text) in several
//! conversations. The upstream is an emulator in its own process (its journal shows every call
//! and its idempotency records apply each key once) behind a TCP forwarder of the test's own, so
//! an outage is one of: every call answered 503; every call answered 429 with `Retry-After`;
//! nothing listening at the upstream's address (connect refused). Daemon time passes by advancing
//! the test clock in steps; there is no real waiting beyond bounded polls.
//!
//! - A 10-minute and a 6-hour outage of each kind (users write during some): after recovery no
//!   dead letter, every decided action took effect exactly once (one effective call per
//!   idempotency key), in per-conversation order, the backlog started moving within 30 s of daemon
//!   time and drained without more time passing; during the outage the breaker kept the calls few
//!   and `/readyz` stayed 200.
//! - A permanent 4xx for one action: a dead letter at once (one attempt, no time passing), and the
//!   conversation's later actions go on.
//! - The breaker opens after `outbox.breaker.failures` transient failures (gauge, `/readyz`
//!   detail, still 200), makes no calls but probes while open, probes at most every ~15 s, and
//!   closes on the first successful probe.
//!
//! Quick by default (10-minute clock steps through the 6-hour outages, 3 conversations);
//! `HANDOFF_BRIDGE_LONG_TESTS=1` (the fault suite's long mode, docs/fault-suite.md) steps by one
//! minute and writes more messages.

use crate::common::emulator::ExternalEmulator;
use crate::common::forwarder::Forwarder;
use crate::common::load::long_tests;
use crate::common::relay::*;
use crate::common::*;
use ::emulator::JournalEntry;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const RULE: &str = "outage";
/// The breaker's settings the daemon runs with (the defaults, named so the test can count).
const BREAKER_FAILURES: usize = 5;
const PROBE_INTERVAL_MS: i64 = 15_000;
/// After the upstream is back, the backlog moves within this much daemon time (issue 20).
const MOVES_WITHIN_MS: i64 = 30_000;
const CIRCUIT: &str = r#"handoff_circuit_open{destination="openapi"}"#;

fn system_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The call took effect: no injected fault, a 2xx, not an answer replayed for a key seen before.
fn effective(e: &JournalEntry) -> bool {
    e.fault.is_none() && !e.replayed && (200..300).contains(&e.status)
}

/// The conversation id of a `/openapi/conversation/{id}[/...]` call.
fn conversation_of(e: &JournalEntry) -> Option<&str> {
    e.path
        .strip_prefix("/openapi/conversation/")
        .map(|rest| rest.split('/').next().unwrap_or(rest))
}

fn key_of(e: &JournalEntry) -> String {
    action_of(e.idempotency_key.as_deref().unwrap_or_default()).to_owned()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Outage {
    /// Every Open API call answered 503.
    Status5xx,
    /// Nothing listens at the upstream's address.
    ConnectRefused,
    /// Every Open API call answered 429 with `Retry-After: 20`.
    RateLimited,
}

/// The daemon, its upstream (an external emulator behind a forwarder), and what the test decided.
struct Rig {
    app: TestApp,
    emu: ExternalEmulator,
    fwd: Forwarder,
    ids: Ids,
    /// The test clock's offset, as the daemon answered the last advance.
    offset_ms: i64,
    /// Each advance: (system time just before it was asked for, the offset after it).
    advances: Vec<(i64, i64)>,
    /// Per seeded conversation (index into `SEEDED`): the action ids decided, in order.
    expected: BTreeMap<usize, Vec<String>>,
    conversations: Vec<usize>,
    written: usize,
    _tmp: tempfile::TempDir,
}

impl Rig {
    fn new(conversations: &[usize]) -> Rig {
        Rig::with_env(conversations, &[])
    }

    /// With `extra` settings over the rig's own.
    fn with_env(conversations: &[usize], extra: &[(&str, &str)]) -> Rig {
        let tmp = tempfile::tempdir().expect("tempdir");
        let rules = rules_dir(
            tmp.path(),
            &format!(
                r#"
                [[rule]]
                name = "{RULE}"
                on = ["bot.message.received"]
                max_firings = {{ count = 1000, per = "1m" }}
                when = {{ field = "sender", equals = "user" }}
                actions = [
                  {{ type = "set_manual", enabled = true }},
                  {{ type = "send_message", text = "{{{{ message.data.text }}}}" }},
                ]
                "#
            ),
        );
        let emu = ExternalEmulator::start(EMULATOR_KEY);
        let fwd = Forwarder::start(emu.addr());
        let url = fwd.url();
        let env: Vec<(String, String)> = [
            ("HANDOFF_BRIDGE__RULES__DIR", rules.to_str().expect("utf-8")),
            ("HANDOFF_BRIDGE_UPSTREAM_URL", url.as_str()),
            ("HANDOFF_BRIDGE_UPSTREAM_API_KEY", EMULATOR_KEY),
            ("HANDOFF_BRIDGE__ADMIN__TEST_CLOCK", "true"),
            ("HANDOFF_BRIDGE__UPSTREAM__CONNECT_TIMEOUT", "1s"),
            ("HANDOFF_BRIDGE__UPSTREAM__REQUEST_TIMEOUT", "2s"),
            // Generous limits: these tests are about holding and order, not pacing.
            (
                "HANDOFF_BRIDGE__UPSTREAM__LIMITS__GLOBAL__PER_SECOND",
                "5000.0",
            ),
            ("HANDOFF_BRIDGE__UPSTREAM__LIMITS__GLOBAL__BURST", "1000"),
            (
                "HANDOFF_BRIDGE__UPSTREAM__LIMITS__WRITE__PER_SECOND",
                "5000.0",
            ),
            ("HANDOFF_BRIDGE__UPSTREAM__LIMITS__WRITE__BURST", "1000"),
            // The outbox's policy as shipped, named so the counts below follow from it.
            ("HANDOFF_BRIDGE__OUTBOX__GIVE_UP_AFTER", "24h"),
            ("HANDOFF_BRIDGE__OUTBOX__RETRY__BASE", "1s"),
            ("HANDOFF_BRIDGE__OUTBOX__RETRY__CAP", "5m"),
            ("HANDOFF_BRIDGE__OUTBOX__RETRY__MAX_RETRY_AFTER", "10m"),
            ("HANDOFF_BRIDGE__OUTBOX__BREAKER__FAILURES", "5"),
            ("HANDOFF_BRIDGE__OUTBOX__BREAKER__PROBE_INTERVAL", "15s"),
        ]
        .iter()
        .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
        .chain(extra)
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let app = TestApp::spawn_in(
            &tmp.path().join("data"),
            Spawn {
                env,
                ..Spawn::default()
            },
        );
        Rig {
            app,
            emu,
            fwd,
            ids: Ids::new(crate::common::load::seed_from_env_or_clock()),
            offset_ms: 0,
            advances: Vec::new(),
            expected: BTreeMap::new(),
            conversations: conversations.to_vec(),
            written: 0,
            _tmp: tmp,
        }
    }

    fn daemon_now(&self) -> i64 {
        system_ms() + self.offset_ms
    }

    /// The daemon time a journal entry (stamped by the emulator in system time) happened at, or
    /// later: the offset of the last advance asked for before it.
    fn daemon_time_of(&self, e: &JournalEntry) -> i64 {
        let offset = self
            .advances
            .iter()
            .rev()
            .find(|(asked, _)| *asked <= e.at)
            .map_or(0, |(_, offset)| *offset);
        e.at + offset
    }

    /// Move the daemon's time forward (without waiting for the outbox to be idle, which it is
    /// not during an outage).
    fn advance(&mut self, by: Duration) {
        let asked = system_ms();
        let mut resp = self
            .app
            .agent
            .post(self.app.admin_url("/admin/v1/clock/advance"))
            .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
            .header("content-type", "application/json")
            .send(json!({ "by": format!("{}ms", by.as_millis()) }).to_string())
            .expect("POST clock/advance");
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        assert_eq!(resp.status().as_u16(), 200, "test clock: {text}");
        let answer: Value = serde_json::from_str(&text).expect("JSON");
        self.offset_ms = answer["offset_ms"].as_i64().expect("offset_ms");
        self.advances.push((asked, self.offset_ms));
    }

    /// Each conversation's user writes `per` messages (one delivery per round, a message of
    /// every conversation in it), stamped with the daemon's time; records the actions decided.
    fn write(&mut self, per: usize) {
        for _ in 0..per {
            let ts = self.daemon_now();
            let mut events = Vec::new();
            for &conv in &self.conversations.clone() {
                let text = format!("c{conv}-m{}", self.written);
                let (id, event) = user_message(&mut self.ids, conv, &text, ts);
                let keys = self.expected.entry(conv).or_default();
                keys.push(format!("{id}/{RULE}/0"));
                keys.push(format!("{id}/{RULE}/1"));
                events.push((id, event));
            }
            self.written += 1;
            let sent = make_delivery(&mut self.ids, events);
            let (status, receipt) = self.app.post(&sent.body);
            assert_eq!(status, 200, "{receipt}");
            assert_eq!(receipt["accepted"], sent.events.len(), "{receipt}");
        }
        wait_drained(&self.app);
    }

    fn decided(&self) -> usize {
        self.expected.values().map(Vec::len).sum()
    }

    fn journal(&self) -> Vec<JournalEntry> {
        journal(&self.emu.base)
    }

    fn start(&mut self, kind: Outage) {
        match kind {
            Outage::Status5xx => set_faults(
                &self.emu.base,
                json!({"error_rate": 1.0, "status": 503, "path_prefix": "/openapi/"}),
            ),
            Outage::RateLimited => set_faults(
                &self.emu.base,
                json!({"rate_limit_next": 4_000_000_000u32, "retry_after": "20",
                       "path_prefix": "/openapi/"}),
            ),
            Outage::ConnectRefused => self.fwd.close(),
        }
    }

    fn end(&mut self, kind: Outage) {
        match kind {
            Outage::Status5xx | Outage::RateLimited => clear_faults(&self.emu.base),
            Outage::ConnectRefused => self.fwd.open(),
        }
    }

    fn dead_letters(&self) -> Value {
        let (status, body) = self.app.admin_get("/admin/v1/dead-letters");
        assert_eq!(status, 200, "{body}");
        body
    }

    fn readyz(&self) -> (u16, Value) {
        let (status, text) = self.app.get("/readyz");
        (status, serde_json::from_str(&text).expect("readyz JSON"))
    }

    /// `/readyz` answers 200 whatever the circuit (an upstream outage must not take the bridge
    /// out of rotation), with the circuit's detail.
    fn circuit_detail(&self) -> Value {
        let (status, ready) = self.readyz();
        assert_eq!(status, 200, "an upstream outage made /readyz fail: {ready}");
        ready["checks"]["circuits"]["openapi"].clone()
    }

    /// Wait (bounded, real time, no clock moving) until nothing is pending.
    fn wait_idle(&self, limit: Duration) {
        wait_drained(&self.app);
        let (status, idle) = self.app.admin_get(&format!(
            "/admin/v1/outbox/idle?timeout_ms={}",
            limit.as_millis()
        ));
        assert_eq!(
            status, 200,
            "the backlog did not drain within {limit:?} without more daemon time passing: {idle}"
        );
    }

    /// After recovery at daemon time `recovered`: step the clock by 5 s until a call takes
    /// effect, which must come within 30 s of daemon time; returns that call's daemon time. Each
    /// step waits up to 1.5 s of real time for it, the last one within the bound up to 15 s (no
    /// more daemon time passes then, so a loaded machine's slowness cannot fail the test, and
    /// the call's daemon time still must be within the bound).
    fn first_effect_after(&mut self, journal_len: usize, recovered: i64) -> i64 {
        let step = Duration::from_secs(5);
        loop {
            let last = self.daemon_now() - recovered + step.as_millis() as i64 > MOVES_WITHIN_MS;
            let budget = Duration::from_millis(if last { 15_000 } else { 1_500 });
            let waited = Instant::now();
            let found = loop {
                let j = self.journal();
                if let Some(e) = j.iter().skip(journal_len).find(|e| effective(e)) {
                    break Some(self.daemon_time_of(e));
                }
                if waited.elapsed() > budget {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            if let Some(at) = found {
                return at;
            }
            assert!(
                !last,
                "no call took effect within {MOVES_WITHIN_MS} ms of daemon time after the \
                 upstream recovered (circuit: {})",
                self.circuit_detail()
            );
            self.advance(step);
        }
    }

    /// Everything decided took effect exactly once, in per-conversation order, and nothing else
    /// reached the upstream's state; no dead letter; the outbox is empty.
    fn assert_all_done_once_in_order(&self) {
        let letters = self.dead_letters();
        assert_eq!(
            letters["count"], 0,
            "dead letters after recovery: {letters}"
        );
        let (_, outbox) = self.app.admin_get("/admin/v1/outbox");
        assert_eq!(outbox["depth"], 0, "{outbox}");
        let j = self.journal();
        let refused: Vec<&JournalEntry> = j
            .iter()
            .filter(|e| e.fault.is_none() && !(200..300).contains(&e.status) && e.status != 0)
            .collect();
        assert!(
            refused.is_empty(),
            "calls the emulator refused: {refused:#?}"
        );
        let mut per_key: BTreeMap<String, usize> = BTreeMap::new();
        for e in j.iter().filter(|e| effective(e)) {
            *per_key.entry(key_of(e)).or_insert(0) += 1;
        }
        let twice: Vec<_> = per_key.iter().filter(|(_, n)| **n > 1).collect();
        assert!(
            twice.is_empty(),
            "actions carried out more than once: {twice:?}"
        );
        assert_eq!(
            per_key.len(),
            self.decided(),
            "every decided action took effect once, and nothing else did"
        );
        for (&conv, keys) in &self.expected {
            let applied: Vec<String> = j
                .iter()
                .filter(|e| effective(e) && conversation_of(e) == Some(SEEDED[conv].0))
                .map(key_of)
                .collect();
            assert_eq!(
                &applied, keys,
                "conversation {}: actions as the upstream applied them",
                SEEDED[conv].0
            );
        }
    }
}

/// One outage of `kind` lasting `length` of daemon time, crossed in `step`s; users write before
/// it and, when `write_during`, in its middle. Then recovery and the checks.
fn outage(kind: Outage, length: Duration, step: Duration, write_during: bool) {
    let started = Instant::now();
    let per = if long_tests() { 8 } else { 3 };
    let mut rig = Rig::new(&[0, 1, 3]);
    assert_eq!(
        rig.app.metric_sample(CIRCUIT),
        Some(0.0),
        "the breaker's gauge is published, closed"
    );
    // Before: the upstream works and the first messages' actions are carried out.
    rig.write(1);
    rig.wait_idle(Duration::from_secs(30));
    let before = rig.journal().len();

    rig.start(kind);
    let outage_began = rig.daemon_now();
    let real_began = Instant::now();
    rig.write(per);
    let steps = (length.as_millis() / step.as_millis()).max(1) as usize;
    for n in 0..steps {
        if write_during && n == steps / 2 {
            rig.write(per);
        }
        // Let the executor act on the time that passed (its probe, for the breaker), bounded.
        let seen = match kind {
            Outage::ConnectRefused => None,
            _ => Some(rig.journal().len()),
        };
        rig.advance(step);
        if let Some(seen) = seen {
            let _ = wait_a_little(|| rig.journal().len() > seen);
        }
    }
    // Held, not given up: nothing dead-lettered, everything still pending, /readyz 200.
    let letters = rig.dead_letters();
    assert_eq!(
        letters["count"], 0,
        "a transient outage dead-lettered: {letters}"
    );
    // Every action decided in the outage waits (the last ones reach the executor after their
    // flush: bounded wait for its count).
    let after_first = rig.decided() - 2 * rig.conversations.len();
    let counted = wait_a_little(|| {
        let (_, outbox) = rig.app.admin_get("/admin/v1/outbox?limit=1");
        outbox["depth"].as_u64() == Some(after_first as u64)
    });
    let (_, outbox) = rig.app.admin_get("/admin/v1/outbox?limit=1000");
    assert!(counted, "{after_first} actions wait: {outbox}");
    assert_eq!(outbox["count"], after_first, "{outbox}");
    let circuit = rig.circuit_detail();
    assert_eq!(
        circuit["open"], true,
        "the breaker is open during the outage: {circuit}"
    );
    assert_eq!(rig.app.metric(CIRCUIT), 1.0);
    if kind != Outage::ConnectRefused {
        // The breaker kept the calls few: its opening failures (and what was in flight then),
        // then at most one probe per advance of the clock or per probe interval of real time.
        let calls = rig.journal().len() - before;
        let real_probes = real_began.elapsed().as_millis() as i64 / PROBE_INTERVAL_MS + 2;
        let most = BREAKER_FAILURES + rig.conversations.len() + steps + real_probes as usize;
        assert!(
            calls <= most,
            "{calls} calls in a {length:?} outage (at most {most} with a breaker)"
        );
        assert!(
            calls >= BREAKER_FAILURES,
            "{calls} calls: the outage was never met"
        );
    }

    let mid = rig.journal().len();
    rig.end(kind);
    let recovered = rig.daemon_now();
    let moved = rig.first_effect_after(mid, recovered);
    assert!(
        moved - recovered <= MOVES_WITHIN_MS,
        "the backlog started {} ms after recovery",
        moved - recovered
    );
    rig.wait_idle(Duration::from_secs(60));
    assert_eq!(rig.app.metric(CIRCUIT), 0.0, "the breaker closed");
    rig.assert_all_done_once_in_order();
    eprintln!(
        "{kind:?} outage of {length:?} ({} actions, outage from daemon time {outage_began}): \
         {:?} real time",
        rig.decided(),
        started.elapsed()
    );
}

/// Poll `check` for up to 2 s; whether it held.
fn wait_a_little(check: impl FnMut() -> bool) -> bool {
    wait_for(Duration::from_secs(2), check)
}

/// Poll `check` for up to `limit`; whether it held.
fn wait_for(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if check() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

fn short_step() -> Duration {
    Duration::from_secs(if long_tests() { 15 } else { 60 })
}

fn long_step() -> Duration {
    Duration::from_secs(if long_tests() { 60 } else { 600 })
}

const TEN_MINUTES: Duration = Duration::from_secs(600);
const SIX_HOURS: Duration = Duration::from_secs(6 * 3600);

#[test]
fn a_ten_minute_5xx_outage_is_held_and_carried_out_once_in_order() {
    outage(Outage::Status5xx, TEN_MINUTES, short_step(), false);
}

#[test]
fn a_six_hour_5xx_outage_is_held_and_carried_out_once_in_order() {
    outage(Outage::Status5xx, SIX_HOURS, long_step(), true);
}

#[test]
fn a_ten_minute_connect_refused_outage_is_held_and_carried_out_once_in_order() {
    outage(Outage::ConnectRefused, TEN_MINUTES, short_step(), true);
}

#[test]
fn a_six_hour_connect_refused_outage_is_held_and_carried_out_once_in_order() {
    outage(Outage::ConnectRefused, SIX_HOURS, long_step(), false);
}

#[test]
fn a_ten_minute_429_outage_is_held_and_carried_out_once_in_order() {
    outage(Outage::RateLimited, TEN_MINUTES, short_step(), false);
}

#[test]
fn a_six_hour_429_outage_is_held_and_carried_out_once_in_order() {
    outage(Outage::RateLimited, SIX_HOURS, long_step(), true);
}

#[test]
fn a_permanent_4xx_is_a_dead_letter_at_once_and_the_conversation_goes_on() {
    let mut rig = Rig::new(&[0, 1]);
    // The first call for conversation 1 is refused for good (404), once.
    let refused_conv = SEEDED[1].0;
    set_faults(
        &rig.emu.base,
        json!({"fail_next": 1, "status": 404,
               "path_prefix": format!("/openapi/conversation/{refused_conv}")}),
    );
    rig.write(3);
    // No daemon time passes: the dead letter is immediate, and the rest runs.
    rig.wait_idle(Duration::from_secs(30));
    let letters = rig.dead_letters();
    assert_eq!(letters["count"], 1, "{letters:#}");
    let letter = &letters["dead_letters"][0];
    let first = rig.expected[&1][0].clone();
    assert_eq!(letter["entry"]["id"], first.as_str(), "{letter:#}");
    assert_eq!(
        letter["attempts"], 1,
        "a permanent failure is not retried: {letter:#}"
    );
    assert_ne!(letter["reason"], "retries_exhausted", "{letter:#}");
    assert!(
        letter["error"].as_str().is_some_and(|r| r.contains("404")),
        "{letter:#}"
    );
    // The refusal was its only call; everything else took effect once, in order.
    let j = rig.journal();
    let calls_for_first = j.iter().filter(|e| key_of(e) == first).count();
    assert_eq!(calls_for_first, 1);
    let mut expected = rig.expected.clone();
    expected.get_mut(&1).expect("conversation 1").remove(0);
    for (&conv, keys) in &expected {
        let applied: Vec<String> = j
            .iter()
            .filter(|e| effective(e) && conversation_of(e) == Some(SEEDED[conv].0))
            .map(key_of)
            .collect();
        assert_eq!(&applied, keys, "conversation {}", SEEDED[conv].0);
    }
    assert_eq!(
        rig.app.metric(CIRCUIT),
        0.0,
        "a 4xx is no transient failure"
    );
}

#[test]
fn the_breaker_opens_makes_no_calls_but_probes_and_closes_on_the_first_success() {
    let mut rig = Rig::new(&[0, 1, 3]);
    assert_eq!(rig.app.metric_sample(CIRCUIT), Some(0.0));
    let closed = rig.circuit_detail();
    assert_eq!(closed["open"], false, "{closed}");
    rig.start(Outage::Status5xx);
    rig.write(3);

    // Opens after `failures` consecutive transient failures (backoffs pass in 5 s steps).
    let mut guard = 0;
    while rig.app.metric(CIRCUIT) != 1.0 {
        guard += 1;
        assert!(
            guard < 40,
            "the breaker never opened: {}",
            rig.circuit_detail()
        );
        rig.advance(Duration::from_secs(1));
        let _ = wait_a_little(|| rig.app.metric(CIRCUIT) == 1.0);
    }
    let at_open = rig.journal().len();
    let failed = rig.journal().iter().filter(|e| e.fault.is_some()).count();
    assert!(
        failed >= BREAKER_FAILURES,
        "opened after {failed} failures (outbox.breaker.failures = {BREAKER_FAILURES})"
    );
    // In flight when it opened: at most one call per conversation queue more.
    assert!(
        failed <= BREAKER_FAILURES + rig.conversations.len(),
        "{failed} failures"
    );
    let open = rig.circuit_detail();
    assert_eq!(open["open"], true, "{open}");
    assert!(open["since"].as_i64().is_some(), "{open}");
    assert!(
        open["consecutive_failures"].as_u64().unwrap_or(0) >= BREAKER_FAILURES as u64,
        "{open}"
    );

    // While open: only probes, at most one per ~15 s of daemon time, for 2 minutes in 5 s steps.
    let window_start = rig.daemon_now();
    for n in 0..24 {
        let seen = rig.journal().len();
        rig.advance(Duration::from_secs(5));
        // A probe is due every third step: wait for it then (bounded), not on the others.
        if n % 3 == 2 {
            let _ = wait_a_little(|| rig.journal().len() > seen);
        }
    }
    let window = rig.daemon_now() - window_start;
    let j = rig.journal();
    let probes: Vec<&JournalEntry> = j.iter().skip(at_open).collect();
    let most = (window / PROBE_INTERVAL_MS) as usize + 1;
    assert!(
        !probes.is_empty() && probes.len() <= most,
        "{} calls in {window} ms with the breaker open (probes: at least 1, at most {most})",
        probes.len()
    );
    let times: Vec<i64> = probes.iter().map(|e| rig.daemon_time_of(e)).collect();
    for pair in times.windows(2) {
        // ~15 s: a jittered interval may come a little early, never at twice the rate.
        assert!(
            pair[1] - pair[0] >= PROBE_INTERVAL_MS * 8 / 10,
            "probes {} ms apart (probe interval 15 s): {times:?}",
            pair[1] - pair[0]
        );
    }
    assert_eq!(rig.app.metric(CIRCUIT), 1.0, "still open while probes fail");
    let letters = rig.dead_letters();
    assert_eq!(letters["count"], 0, "{letters}");

    // Recovery: the next probe succeeds and closes it; the backlog drains.
    let mid = rig.journal().len();
    rig.end(Outage::Status5xx);
    let recovered = rig.daemon_now();
    rig.first_effect_after(mid, recovered);
    poll_until("the breaker to close", Duration::from_secs(10), || {
        (rig.app.metric(CIRCUIT) == 0.0).then_some(())
    });
    let closed = rig.circuit_detail();
    assert_eq!(closed["open"], false, "{closed}");
    rig.wait_idle(Duration::from_secs(60));
    rig.assert_all_done_once_in_order();
}

/// However long each action's own backoff has grown, the backlog moves within 30 s of the
/// upstream's recovery: the breaker's probe (every ~15 s) finds it back, and closing releases the
/// waiting queues. One conversation (no other queue happens to be due), every backoff at 5 m
/// (base = cap: each wait uniform in 30 s..5 m), a 20-minute outage crossed in 15 s steps as real
/// time would pass.
#[test]
fn the_backlog_moves_within_30s_of_recovery_whatever_the_backoff() {
    let mut rig = Rig::with_env(
        &[0],
        &[
            ("HANDOFF_BRIDGE__OUTBOX__RETRY__BASE", "5m"),
            ("HANDOFF_BRIDGE__OUTBOX__RETRY__CAP", "5m"),
        ],
    );
    rig.start(Outage::Status5xx);
    rig.write(3);
    for _ in 0..80 {
        let seen = rig.journal().len();
        rig.advance(Duration::from_secs(15));
        let _ = wait_for(Duration::from_millis(300), || rig.journal().len() > seen);
    }
    let letters = rig.dead_letters();
    assert_eq!(letters["count"], 0, "{letters}");
    let mid = rig.journal().len();
    rig.end(Outage::Status5xx);
    let recovered = rig.daemon_now();
    let moved = rig.first_effect_after(mid, recovered);
    assert!(moved - recovered <= MOVES_WITHIN_MS);
    rig.wait_idle(Duration::from_secs(60));
    rig.assert_all_done_once_in_order();
}
