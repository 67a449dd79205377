//! Hot reload of rule files, on the real daemon with its embedded emulator.
//!
//! - Under load, with the rule set swapped back and forth many times, every event is decided by
//!   exactly one complete set: both of its actions carry the same rule-set version, and their texts
//!   come from that set.
//! - An invalid set is refused with every problem, and the running set stays.
//! - A changed file is picked up by the watcher, and SIGHUP reloads too; `/readyz` reports the
//!   version in force.

use crate::common::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A conversation, its end user and bot in the emulator's default seed.
const CONV: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
const END_USER: &str = "4e6f0d0a-1111-4a5b-8c9d-000000000001";
const BOT: &str = "B7f3a2c";

/// A set whose one rule sends two messages tagged with `tag`: an event decided by a mix of two
/// sets would show two different tags.
fn set(tag: &str) -> String {
    format!(
        r#"
[[rule]]
name = "tagged"
on = ["bot.message.received"]
when = {{ field = "sender", equals = "user" }}
# The whole load goes to one conversation: above the default firing cap.
max_firings = {{ count = 1000, per = "1m" }}
actions = [
  {{ type = "send_message", text = "{tag} first {{{{ event.id }}}}" }},
  {{ type = "send_message", text = "{tag} second {{{{ event.id }}}}" }},
]
"#
    )
}

/// Replace the rule file atomically (write beside it, then rename), as an editor or a deploy
/// tool would.
fn install(dir: &Path, text: &str) {
    let tmp = dir.join(".rules.toml.tmp");
    std::fs::write(&tmp, text).expect("write rules");
    std::fs::rename(&tmp, dir.join("rules.toml")).expect("rename rules");
}

fn spawn(root: &Path, watch: &str) -> TestApp {
    let rules = root.join("rules");
    std::fs::create_dir_all(&rules).expect("rules dir");
    install(&rules, &set("A"));
    let env = [
        ("HANDOFF_BRIDGE__RULES__DIR", rules.to_str().expect("utf-8")),
        ("HANDOFF_BRIDGE__RULES__WATCH_INTERVAL", watch),
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
    ];
    TestApp::spawn_in(
        &root.join("data"),
        Spawn {
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..Spawn::default()
        },
    )
}

fn message(n: usize) -> Vec<u8> {
    let event = json!({
        "id": format!("reload-e{n}"),
        "event": "bot.message.received",
        "sourceType": "bot",
        "sourceId": BOT,
        "timestamp": 1_763_690_400_000i64 + n as i64,
        "data": {"message": {
            "id": format!("reload-m{n}"),
            "endUserId": END_USER,
            "conversationId": CONV,
            "data": {"type": "text", "text": format!("hello {n}")},
            "meta": null,
            "isUser": true,
            "timestamp": 1_763_690_400_000i64 + n as i64,
        }},
    });
    delivery(&format!("reload-d{n}"), &[event])
}

fn readyz_version(app: &TestApp) -> String {
    let (_, body) = app.get("/readyz");
    let body: Value = serde_json::from_str(&body).expect("readyz JSON");
    body["checks"]["rules_version"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// The version `text` compiles to, as `rules check` reports it.
fn version_of(root: &Path, text: &str) -> String {
    let dir = root.join(format!("probe-{}", text.len()));
    std::fs::create_dir_all(&dir).expect("probe dir");
    install(&dir, text);
    let out = std::process::Command::new(bin())
        .args(["rules", "check"])
        .arg(&dir)
        .output()
        .expect("rules check");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .next()
        .and_then(|l| l.rsplit(' ').next())
        .expect("version")
        .to_owned()
}

/// Poll `check` (an observable condition) until it holds; fail after `limit`.
fn wait_until(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

#[test]
fn under_load_every_event_is_decided_by_one_complete_rule_set() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path();
    // Admin reloads only: the swaps happen exactly when the test says.
    let app = spawn(root, "0s");
    let rules = root.join("rules");
    let (a, b) = (version_of(root, &set("A")), version_of(root, &set("B")));
    assert_eq!(readyz_version(&app), a);
    const EVENTS: usize = 150;
    let posting = AtomicBool::new(true);
    let mut swaps = 0;
    std::thread::scope(|s| {
        let poster = s.spawn(|| {
            for n in 0..EVENTS {
                let (status, receipt) = app.post(&message(n));
                assert_eq!(status, 200, "{receipt}");
            }
            posting.store(false, Ordering::SeqCst);
        });
        // Swap while events are being posted and folded.
        let mut tag = "B";
        while posting.load(Ordering::SeqCst) || swaps < 4 {
            install(&rules, &set(tag));
            let (status, body) = app.admin_post("/admin/v1/rules/reload");
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["changed"], true, "{body}");
            swaps += 1;
            tag = if tag == "A" { "B" } else { "A" };
        }
        poster.join().expect("poster");
    });
    assert!(swaps >= 4, "{swaps} swaps");
    wait_drained(&app);
    let (status, idle) = app.admin_get("/admin/v1/outbox/idle?timeout_ms=30000");
    assert_eq!(status, 200, "{idle}");

    let (status, done) = app.admin_get("/admin/v1/outbox/done?limit=1000");
    assert_eq!(status, 200, "{done}");
    assert!(
        done["next"].is_null(),
        "every record in one page: {}",
        done["count"]
    );
    let mut by_event: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    for record in done["finished"].as_array().expect("done records") {
        let entry = &record["entry"];
        let event = entry["event_id"].as_str().unwrap_or_default().to_owned();
        let version = entry["rules_version"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let text = entry["action"]["message"]["text"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        by_event.entry(event).or_default().push((version, text));
    }
    assert_eq!(by_event.len(), EVENTS, "every event decided");
    let mut used = BTreeMap::new();
    for (event, actions) in &by_event {
        assert_eq!(actions.len(), 2, "{event}: {actions:?}");
        let version = &actions[0].0;
        assert!(
            actions.iter().all(|(v, _)| v == version),
            "{event} decided by two sets: {actions:?}"
        );
        let tag = if *version == a {
            "A"
        } else if *version == b {
            "B"
        } else {
            panic!("{event}: unknown version {version}")
        };
        assert!(
            actions.iter().all(|(_, t)| t.starts_with(tag)),
            "{event}: texts not from set {tag}: {actions:?}"
        );
        *used.entry(tag).or_insert(0) += 1;
    }
    assert_eq!(
        app.metric(r#"handoff_rules_reloads_total{outcome="loaded",trigger="admin"}"#),
        swaps as f64
    );
    eprintln!("events per set: {used:?} over {swaps} swaps");
}

#[test]
fn an_invalid_set_is_refused_and_a_changed_file_is_picked_up_by_the_watcher() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path();
    let app = spawn(root, "100ms");
    let rules = root.join("rules");
    let (a, b) = (version_of(root, &set("A")), version_of(root, &set("B")));
    assert_eq!(readyz_version(&app), a);

    // Broken: the reload is refused with every problem; A stays in force and keeps deciding.
    install(
        &rules,
        r#"
[[rule]]
name = "broken"
on = ["bot.message.recieved"]
actions = [{ type = "send_message", txt = "x" }]
"#,
    );
    let (status, body) = app.admin_post("/admin/v1/rules/reload");
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["code"], "invalid_rules");
    assert_eq!(body["version"], a.as_str());
    let problems = body["error"]["problems"].as_array().expect("problems");
    let places: Vec<&str> = problems.iter().filter_map(|p| p["at"].as_str()).collect();
    assert!(places.contains(&"rule[0] (broken).on[0]"), "{body}");
    assert!(
        places
            .iter()
            .any(|p| p.starts_with("rule[0] (broken).actions[0]")),
        "{body}"
    );
    assert!(problems.iter().all(|p| p["file"] == "rules.toml"), "{body}");
    assert!(
        problems.iter().all(|p| p["line"] == 2),
        "the rule's line: {body}"
    );
    let (status, receipt) = app.post(&message(1));
    assert_eq!(status, 200, "{receipt}");
    wait_drained(&app);
    let (_, done) = app.admin_get("/admin/v1/outbox/idle?timeout_ms=30000");
    assert_eq!(done["idle"], true, "{done}");
    let (_, done) = app.admin_get("/admin/v1/outbox/done?limit=10");
    let versions: Vec<&str> = done["finished"]
        .as_array()
        .expect("done")
        .iter()
        .filter_map(|r| r["entry"]["rules_version"].as_str())
        .collect();
    assert_eq!(versions, [a.as_str(), a.as_str()], "still decided by A");
    assert_eq!(readyz_version(&app), a);

    // The watcher picks up a good change by itself.
    install(&rules, &set("B"));
    wait_until("the watcher to load B", Duration::from_secs(20), || {
        readyz_version(&app) == b
    });
    assert!(app.metric(r#"handoff_rules_reloads_total{outcome="loaded",trigger="file"}"#) >= 1.0);

    app.terminate();
}

#[test]
fn sighup_reloads_the_rule_files() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path();
    // No watching: only the signal can reload.
    let app = spawn(root, "0s");
    let (a, b) = (version_of(root, &set("A")), version_of(root, &set("B")));
    assert_eq!(readyz_version(&app), a);
    install(&root.join("rules"), &set("B"));
    let pid = nix::unistd::Pid::from_raw(app.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).expect("SIGHUP");
    wait_until("SIGHUP to load B", Duration::from_secs(20), || {
        readyz_version(&app) == b
    });
    assert_eq!(
        app.metric(r#"handoff_rules_reloads_total{outcome="loaded",trigger="signal"}"#),
        1.0
    );
    let status = app.terminate();
    assert!(status.success(), "a clean exit after SIGHUP: {status}");
}

#[test]
fn sighup_without_a_rule_directory_is_caught_not_fatal() {
    // No rules.dir (the shipped rules, or rules off as here): nothing to reload, but a reload
    // request (`systemctl reload` sends SIGHUP) must not end the daemon, whose default action
    // for SIGHUP would.
    let app = TestApp::spawn();
    let pid = nix::unistd::Pid::from_raw(app.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).expect("SIGHUP");
    poll_until("the SIGHUP to be logged", Duration::from_secs(20), || {
        app.logs().contains("nothing to reload").then_some(())
    });
    let (status, _) = app.get("/healthz");
    assert_eq!(status, 200, "still serving after SIGHUP");
    let status = app.terminate();
    assert!(status.success(), "a clean exit after SIGHUP: {status}");
}
