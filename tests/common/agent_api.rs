//! Calling the agent API (`/helpdesk/v1`) of a daemon started for a test, and the daemon's
//! config for it: two tokens (rotation), the partner-messenger channel of the seed's bot.

use super::{took_effect, Spawn, TestApp};
use serde_json::Value;
use std::path::Path;

pub const TOKEN_OLD: &str = "helpdesk-token-old-0123456789";
pub const TOKEN_NEW: &str = "helpdesk-token-new-0123456789";
/// The web visitor's conversation and the partner-messenger (kakaobiz) user's, both of bot
/// B7f3a2c in the emulator's default seed.
pub const WEB: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
pub const KAKAO: &str = "5c0e9b1f-2222-4d3e-9f10-000000000002";
pub const KAKAO_USER: &str = "kb-user-77a9f2";
pub const SENDER_KEY: &str = "sk-support-0001";

/// Start a daemon on `data` with `[helpdesk]` keys `helpdesk` (TOML lines) and, if `partner`,
/// the seed bot's partner channel; its config file goes into `config_dir`.
pub fn spawn_with(config_dir: &Path, data: &Path, helpdesk: &str, partner: bool) -> TestApp {
    let config = config_dir.join("bridge.toml");
    let mut text = format!("[helpdesk]\n{helpdesk}\n");
    if partner {
        text.push_str(&format!(
            "\n[helpdesk.partner.bots]\nB7f3a2c = \"{SENDER_KEY}\"\n"
        ));
    }
    std::fs::write(&config, text).expect("config");
    let opts = Spawn {
        env: vec![(
            "HANDOFF_BRIDGE_HELPDESK_TOKENS".into(),
            format!("{TOKEN_OLD},{TOKEN_NEW}"),
        )],
        args: vec!["--config".into(), config.display().to_string()],
        ..Spawn::default()
    };
    TestApp::spawn_in(data, opts)
}

pub struct Reply {
    pub status: u16,
    pub body: Value,
    pub replayed: bool,
}

/// One agent API call: `token` None sends no Authorization header.
pub fn call(
    app: &TestApp,
    method: &str,
    path: &str,
    token: Option<&str>,
    key: Option<&str>,
    body: Option<Value>,
) -> Reply {
    let text = body.map(|b| b.to_string()).unwrap_or_default();
    call_raw(app, method, path, token, key, text)
}

/// Like [`call`], with the body as sent.
pub fn call_raw(
    app: &TestApp,
    method: &str,
    path: &str,
    token: Option<&str>,
    key: Option<&str>,
    body: String,
) -> Reply {
    let url = format!("{}/helpdesk/v1{path}", app.base);
    let mut req = ureq::http::Request::builder().method(method).uri(&url);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    req = req.header("content-type", "application/json");
    let req = req.body(body).expect("request");
    let mut resp = app.agent.run(req).expect("call");
    let status = resp.status().as_u16();
    let replayed = resp.headers().contains_key("idempotent-replayed");
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    Reply {
        status,
        body: serde_json::from_str(&text).unwrap_or(Value::String(text)),
        replayed,
    }
}

pub fn post(app: &TestApp, path: &str, key: Option<&str>, body: Value) -> Reply {
    call(app, "POST", path, Some(TOKEN_NEW), key, Some(body))
}

pub fn code(r: &Reply) -> &str {
    r.body["error"]["code"].as_str().unwrap_or("")
}

/// A repeat of `first` under the same key: the same status and body, marked as replayed.
pub fn assert_replayed(first: &Reply, again: &Reply, what: &str) {
    assert!(!first.replayed, "{what}: the first answer is not a replay");
    assert_eq!(
        (again.status, &again.body, again.replayed),
        (first.status, &first.body, true),
        "{what}: the repeat gets the first answer"
    );
}

/// Journal entries of `endpoint` that took effect and whose path contains `part`.
pub fn calls(app: &TestApp, endpoint: &str, part: &str) -> Vec<Value> {
    app.journal()
        .into_iter()
        .filter(|e| e["endpoint"] == endpoint && took_effect(e))
        .filter(|e| e["path"].as_str().is_some_and(|p| p.contains(part)))
        .collect()
}

/// The types of a conversation's audit timeline items that start with `prefix`, in order.
pub fn audit_types(app: &TestApp, conversation: &str, prefix: &str) -> Vec<String> {
    let (status, audit) = app.admin_get(&format!("/admin/v1/conversations/{conversation}/audit"));
    assert_eq!(status, 200, "{audit}");
    audit["timeline"]
        .as_array()
        .expect("timeline")
        .iter()
        .filter_map(|i| i["type"].as_str())
        .filter(|t| t.starts_with(prefix))
        .map(str::to_owned)
        .collect()
}
