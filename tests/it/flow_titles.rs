//! Navigation by flow title end to end, on the real daemon with its embedded emulator: the
//! executor resolves the title through the bot's flow list (`list-flows`), caches the list per bot
//! until a bot event (`bot.updated`) is folded, and turns an unknown title into an `unknown_flow`
//! dead letter.

use crate::common::*;
use serde_json::{json, Value};
use std::path::Path;

/// A conversation of the emulator's default seed (bot B7f3a2c: flow 2 is "Fallback").
const CONV: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";

const RULES: &str = r#"
[[rule]]
name = "lost"
on = ["bot.message.received"]
when = { all = [{ field = "sender", equals = "user" }, { field = "message.data.text", equals = "lost" }] }
actions = [{ type = "navigate", flow = "Fallback" }]

[[rule]]
name = "nowhere"
on = ["bot.message.received"]
when = { all = [{ field = "sender", equals = "user" }, { field = "message.data.text", equals = "nowhere" }] }
actions = [{ type = "navigate", flow = "No such flow" }]
"#;

fn spawn(dir: &Path) -> TestApp {
    let rules = dir.join("rules");
    std::fs::create_dir_all(&rules).expect("rules dir");
    std::fs::write(rules.join("flows.toml"), RULES).expect("rule file");
    TestApp::spawn_in(
        &dir.join("data"),
        Spawn {
            env: vec![(
                "HANDOFF_BRIDGE__RULES__DIR".into(),
                rules.to_str().expect("utf-8 path").into(),
            )],
            ..Spawn::default()
        },
    )
}

/// The user of [`CONV`] writes `text`, and everything it causes is done.
fn say(app: &TestApp, text: &str) {
    app.emulator_act(CONV, "say", json!({ "text": text }));
    app.settle();
}

/// The journal's calls to `endpoint` that took effect.
fn calls(app: &TestApp, endpoint: &str) -> Vec<Value> {
    app.journal()
        .into_iter()
        .filter(|e| e["endpoint"] == endpoint && took_effect(e))
        .collect()
}

#[test]
fn a_flow_title_resolves_through_the_bots_flow_list_cached_until_the_bot_changes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = spawn(tmp.path());

    say(&app, "lost");
    let navigations = calls(&app, "set-navigation");
    assert_eq!(navigations.len(), 1, "{navigations:#?}");
    assert!(
        navigations[0]["path"]
            .as_str()
            .is_some_and(|p| p.contains(CONV)),
        "{navigations:#?}"
    );
    assert_eq!(navigations[0]["body"]["flowId"], 2, "Fallback is flow 2");
    assert_eq!(calls(&app, "list-flows").len(), 1);

    // Cached: the second navigation does not fetch the list again.
    say(&app, "lost");
    assert_eq!(calls(&app, "set-navigation").len(), 2);
    assert_eq!(calls(&app, "list-flows").len(), 1, "served from the cache");

    // A bot.updated folded for the bot: the next navigation fetches the list afresh.
    let updated = json!({
        "id": "flow-titles-bot-updated-1",
        "event": "bot.updated",
        "sourceType": "bot",
        "sourceId": "B7f3a2c",
        "timestamp": 1_763_690_400_011i64,
        "data": { "bot": { "id": "B7f3a2c", "title": "Support bot" } },
    });
    let (status, receipt) = app.post(&delivery("flow-titles-bot-updated", &[updated]));
    assert_eq!(status, 200, "{receipt}");
    app.settle();
    say(&app, "lost");
    let navigations = calls(&app, "set-navigation");
    assert_eq!(navigations.len(), 3);
    assert_eq!(navigations[2]["body"]["flowId"], 2);
    assert_eq!(
        calls(&app, "list-flows").len(),
        2,
        "refreshed after bot.updated"
    );
}

#[test]
fn an_unknown_flow_title_becomes_an_unknown_flow_dead_letter() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = spawn(tmp.path());
    say(&app, "nowhere");
    assert!(calls(&app, "set-navigation").is_empty(), "no navigation");
    let (status, dead) = app.admin_get("/admin/v1/dead-letters");
    assert_eq!(status, 200, "{dead}");
    let letters = dead["dead_letters"].as_array().cloned().unwrap_or_default();
    assert_eq!(letters.len(), 1, "{dead:#}");
    assert_eq!(letters[0]["reason"], "unknown_flow", "{dead:#}");
    assert!(
        letters[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("No such flow")),
        "{dead:#}"
    );
}
