//! Issue 19, "no secrets at rest": webhook tokens never reach a stored file (in any encoding the
//! store uses), a backup, the admin API or the CLI; and everything the daemon writes is
//! owner-only whatever the umask it was started with.

use crate::common::*;
use base64::Engine;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A second configured token (a rotation), and the generated one left in the data directory.
const OTHER_TOKEN: &str = "rotation-token-second-0123456789";
const GENERATED_TOKEN: &str = "GeneratedToken0123456789abcdefABCDEFxyzw";
const MARKER: &str = "[webhook-token]";

fn event(id: &str, conversation: &str, text: &str) -> Value {
    serde_json::json!({
        "id": id, "event": "bot.message.received", "sourceType": "bot", "sourceId": "B1",
        "timestamp": 1_700_000_000_000i64,
        "data": {"message": {"id": format!("m-{id}"), "conversationId": conversation,
            "isUser": true, "meta": null, "data": {"type": "text", "text": text}}}
    })
}

fn envelope(id: &str, url: &str, events: &[Value]) -> String {
    serde_json::json!({
        "id": id, "webhookId": "2b1c1e7a-5f0e-4c61-9d1e-0c3f4a9b8e01", "webhookUrl": url,
        "messages": events,
    })
    .to_string()
}

/// `\uXXXX` for every character.
fn json_escaped(s: &str) -> String {
    s.chars().map(|c| format!("\\u{:04x}", c as u32)).collect()
}

/// Undo the encodings a stored body may carry: JSON `\uXXXX` (ASCII) and `\/` escapes, then
/// percent-encoding.
fn unescape(bytes: &[u8]) -> Vec<u8> {
    let mut json = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && bytes.get(i + 1) == Some(&b'u') {
            let hex = bytes
                .get(i + 2..i + 6)
                .and_then(|h| std::str::from_utf8(h).ok());
            if let Some(b) = hex
                .and_then(|h| u16::from_str_radix(h, 16).ok())
                .filter(|c| *c < 0x80)
            {
                json.push(b as u8);
                i += 6;
                continue;
            }
        }
        if bytes[i] == b'\\' && bytes.get(i + 1) == Some(&b'/') {
            json.push(b'/');
            i += 2;
            continue;
        }
        json.push(bytes[i]);
        i += 1;
    }
    percent_encoding::percent_decode(&json).collect()
}

/// What every gzip stream starting in `bytes` decompresses to (the quarantine keeps a large body
/// gzip-compressed), as far as it decodes: a stream cut short still yields its beginning.
fn gunzipped(bytes: &[u8]) -> Vec<Vec<u8>> {
    use std::io::Read;
    let magic = [0x1f, 0x8b, 0x08];
    (0..bytes.len().saturating_sub(2))
        .filter(|&at| bytes[at..].starts_with(&magic))
        .map(|at| {
            let mut decoder = flate2::read::GzDecoder::new(&bytes[at..]);
            let mut out = Vec::new();
            let mut chunk = [0u8; 16 * 1024];
            while let Ok(n) = decoder.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                out.extend_from_slice(&chunk[..n]);
            }
            out
        })
        .filter(|out| !out.is_empty())
        .collect()
}

/// Whether `token` is in `bytes`: as is, JSON-escaped or percent-encoded, inside any gzip stream,
/// and inside any base64 run (the quarantine keeps bodies as base64, large ones gzipped first),
/// decoded the same way.
fn holds(bytes: &[u8], token: &str) -> bool {
    let found_as_text = |b: &[u8]| {
        let t = token.as_bytes();
        let plain = b.windows(t.len()).any(|w| w == t);
        let once = unescape(b);
        plain
            || once.windows(t.len()).any(|w| w == t)
            || unescape(&once).windows(t.len()).any(|w| w == t)
    };
    let found =
        |b: &[u8]| found_as_text(b) || gunzipped(b).iter().any(|inflated| found_as_text(inflated));
    if found(bytes) {
        return true;
    }
    let runs = regex::bytes::Regex::new(r"[A-Za-z0-9+/]{16,}={0,2}").expect("regex");
    let in_base64 = runs.find_iter(bytes).any(|run| {
        let run = run.as_bytes();
        // A run cut at a page boundary: try every start within one quantum.
        (0..4).any(|skip| {
            let body = &run[skip.min(run.len())..];
            let body = &body[..body.len() - body.len() % 4];
            base64::engine::general_purpose::STANDARD
                .decode(body)
                .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(body))
                .is_ok_and(|decoded| found(&decoded))
        })
    });
    in_base64
}

/// Every regular file under `dir`, except the ones named in `skip` (the secret files).
fn files(dir: &Path, skip: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at).expect("read_dir") {
            let path = entry.expect("entry").path();
            let meta = std::fs::symlink_metadata(&path).expect("metadata");
            if meta.is_dir() {
                stack.push(path);
            } else if !skip
                .iter()
                .any(|s| path.file_name().is_some_and(|n| n == *s))
            {
                out.push(path);
            }
        }
    }
    out
}

fn assert_clean(what: &str, text: &[u8]) {
    for token in [WEBHOOK_TOKEN, OTHER_TOKEN, GENERATED_TOKEN] {
        assert!(
            !holds(text, token),
            "{what} holds a webhook token: {}",
            String::from_utf8_lossy(text)
        );
    }
}

#[test]
fn the_detector_finds_the_token_in_every_encoding_it_checks() {
    let body = format!(
        r#"{{"u":"https:\/\/h\/webhook\/{}"}}"#,
        json_escaped(WEBHOOK_TOKEN)
    );
    let encoded = base64::engine::general_purpose::STANDARD.encode(body.as_bytes());
    let record = format!(r#"{{"id":3,"body_base64":"{encoded}"}}"#);
    let percent: String = WEBHOOK_TOKEN.bytes().map(|b| format!("%{b:02x}")).collect();
    for text in [
        WEBHOOK_TOKEN.to_owned(),
        body.clone(),
        record,
        format!("x?token={percent}&y"),
    ] {
        assert!(holds(text.as_bytes(), WEBHOOK_TOKEN), "not found in {text}");
    }
    // Gzipped, bare and inside base64 (a large quarantined body).
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut gz, body.as_bytes()).expect("gzip");
    let gz = gz.finish().expect("gzip");
    let mut framed = b"frame:".to_vec();
    framed.extend_from_slice(&gz);
    assert!(holds(&framed, WEBHOOK_TOKEN), "not found gzipped");
    let encoded = base64::engine::general_purpose::STANDARD.encode(&gz);
    let record = format!(r#"{{"id":4,"body_base64":"{encoded}"}}"#);
    assert!(
        holds(record.as_bytes(), WEBHOOK_TOKEN),
        "not found in {record}"
    );
    assert!(!holds(b"[webhook-token] and nothing else", WEBHOOK_TOKEN));
}

#[test]
fn webhook_tokens_never_reach_the_data_dir_a_backup_the_admin_api_or_the_cli() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    std::fs::create_dir_all(&data).expect("data dir");
    // A generated token from an earlier start, before tokens were configured.
    std::fs::write(data.join("webhook_token"), GENERATED_TOKEN).expect("token file");
    let tokens = format!("{WEBHOOK_TOKEN},{OTHER_TOKEN}");
    let app = TestApp::spawn_in(
        &data,
        Spawn::with_env(&[
            ("HANDOFF_BRIDGE_WEBHOOK_TOKENS", tokens.as_str()),
            ("RUST_LOG", "debug"),
        ]),
    );
    let conv = "5c0e9b1f-3333-4d3e-9f10-000000000001";
    let all = format!("{WEBHOOK_TOKEN} {OTHER_TOKEN} {GENERATED_TOKEN}");
    let path_url = format!("https://bridge.example.com/webhook/{WEBHOOK_TOKEN}");

    // A valid delivery, the tokens in its URL and in a message text.
    let valid = envelope("d-valid", &path_url, &[event("e-1", conv, &all)]);
    let (status, answer) = app.post(valid.as_bytes());
    assert_eq!(
        (status, answer["status"].as_str()),
        (200, Some("accepted")),
        "{answer}"
    );
    // The same delivery again: a duplicate (dedupe is unchanged by scrubbing).
    let (status, answer) = app.post(valid.as_bytes());
    assert_eq!(
        (status, answer["status"].as_str()),
        (200, Some("duplicate")),
        "{answer}"
    );
    // The same event in a new delivery: still a duplicate event.
    let again = envelope("d-again", &path_url, &[event("e-1", conv, &all)]);
    let (_, answer) = app.post(again.as_bytes());
    assert_eq!(answer["duplicates"], 1, "{answer}");
    // The token spelled with JSON escapes in the URL and the text, sent with `?token=`.
    let escaped_url = format!(
        r#"https:\/\/bridge.example.com\/webhook\/closer?token={}"#,
        json_escaped(OTHER_TOKEN)
    );
    let escaped = format!(
        r#"{{"id":"d-escaped","webhookId":"w","webhookUrl":"{escaped_url}","messages":[{}]}}"#,
        event("e-2", conv, "see below")
            .to_string()
            .replace("see below", &json_escaped(GENERATED_TOKEN))
    );
    let query_url = format!("{}/webhook/closer?token={OTHER_TOKEN}", app.base);
    let (status, answer) = app.post_to(&query_url, escaped.as_bytes(), Some("application/json"));
    assert_eq!(
        (status, answer["status"].as_str()),
        (200, Some("accepted")),
        "{answer}"
    );
    // Percent-encoded in the URL, and an invalid event beside a valid one (quarantined alone).
    let percent: String = WEBHOOK_TOKEN.bytes().map(|b| format!("%{b:02X}")).collect();
    let mut invalid = event("e-bad", conv, &all);
    invalid["timestamp"] = Value::String(all.clone());
    let mixed = envelope(
        "d-mixed",
        &format!("https://bridge.example.com/webhook/x?token={percent}"),
        &[event("e-3", conv, "fine"), invalid],
    );
    let (_, answer) = app.post(mixed.as_bytes());
    assert_eq!(
        (answer["accepted"].as_u64(), answer["quarantined"].as_u64()),
        (Some(1), Some(1)),
        "{answer}"
    );
    // Broken bodies: not JSON, and not even declared JSON.
    let broken = format!("{{\"id\":\"d-broken\",\"webhookUrl\":\"{path_url}\" {all} ");
    let (_, answer) = app.post(broken.as_bytes());
    assert_eq!(answer["status"], "quarantined", "{answer}");
    let (_, answer) = app.post_to(&app.webhook_url, all.as_bytes(), Some("text/plain"));
    assert_eq!(answer["status"], "quarantined", "{answer}");
    // A large broken body: the quarantine keeps it gzip-compressed (over 64 KiB).
    let large = format!("{broken} {}", all.repeat(4096));
    assert!(large.len() > 128 * 1024);
    let (_, answer) = app.post(large.as_bytes());
    assert_eq!(answer["status"], "quarantined", "{answer}");
    wait_drained(&app);

    // The admin API: quarantine list and each record, the events.
    let (status, list) = app.admin_get("/admin/v1/quarantine");
    assert_eq!(status, 200);
    assert_clean("the quarantine list", list.to_string().as_bytes());
    let ids: Vec<u64> = list
        .as_array()
        .or_else(|| list["records"].as_array())
        .or_else(|| list["items"].as_array())
        .expect("a list of records")
        .iter()
        .filter_map(|r| r["id"].as_u64())
        .collect();
    assert_eq!(ids.len(), 4, "{list}");
    let mut shown = String::new();
    for id in &ids {
        let (status, record) = app.admin_get(&format!("/admin/v1/quarantine/{id}"));
        assert_eq!(status, 200);
        shown.push_str(&record.to_string());
        let cli = app.cli_ok(&["quarantine", "show", &id.to_string()]);
        assert_clean("`quarantine show` (online)", cli.as_bytes());
        shown.push_str(&cli);
    }
    assert_clean("the quarantine records", shown.as_bytes());
    assert!(
        shown.contains(MARKER),
        "bodies kept, tokens marked: {shown}"
    );
    for event_id in ["e-1", "e-2", "e-3"] {
        let (status, body) = app.admin_get(&format!("/admin/v1/events/{event_id}"));
        assert_eq!(status, 200, "{event_id}: {body}");
        assert_clean("an event", body.to_string().as_bytes());
    }
    let (_, e1) = app.admin_get("/admin/v1/events/e-1");
    assert!(e1.to_string().contains(MARKER), "{e1}");
    let (_, state) = app.admin_get(&format!("/admin/v1/conversations/{conv}"));
    assert_clean("the conversation state", state.to_string().as_bytes());
    assert_clean(
        "`quarantine list` (online)",
        app.cli_ok(&["quarantine", "list"]).as_bytes(),
    );
    let logs = app.terminate_and_logs();
    assert_clean("the daemon's log", logs.as_bytes());

    // Offline CLI, then every file of the data directory but the secret files themselves.
    assert_clean(
        "`quarantine list` (offline)",
        cli_ok(&data, &["quarantine", "list"]).as_bytes(),
    );
    for id in &ids {
        let out = cli_ok(&data, &["quarantine", "show", &id.to_string()]);
        assert_clean("`quarantine show` (offline)", out.as_bytes());
    }
    let stored = files(&data, &["webhook_token", "admin_token"]);
    assert!(
        stored
            .iter()
            .any(|p| p.extension().is_some_and(|e| e == "log")),
        "the event log is walked: {stored:?}"
    );
    for path in &stored {
        let bytes = std::fs::read(path).expect("read");
        assert_clean(&path.display().to_string(), &bytes);
    }
    // A backup: every file but its copies of the secret files.
    let out = tmp.path().join("backup");
    let backup = cli(&data, &["backup", "--out", out.to_str().expect("utf8")]);
    assert!(backup.status.success(), "{backup:?}");
    assert_clean("the backup's output", &backup.stdout);
    let copied = files(&out, &["webhook_token", "admin_token"]);
    assert!(
        copied.iter().any(|p| p.ends_with("sled.dump")),
        "{copied:?}"
    );
    for path in copied {
        assert_clean(
            &path.display().to_string(),
            &std::fs::read(&path).expect("read"),
        );
    }
}

/// Every directory 0700 and every file 0600 under `dir`.
fn assert_owner_only(dir: &Path) -> usize {
    let mut seen = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        let meta = std::fs::symlink_metadata(&at).expect("metadata");
        let mode = meta.permissions().mode() & 0o777;
        if meta.is_dir() {
            assert_eq!(mode, 0o700, "{} is {mode:o}", at.display());
            for entry in std::fs::read_dir(&at).expect("read_dir") {
                stack.push(entry.expect("entry").path());
            }
        } else {
            assert_eq!(mode, 0o600, "{} is {mode:o}", at.display());
        }
        seen += 1;
    }
    seen
}

/// The binary started under `umask 000`.
fn under_umask_000(args: &[&str]) -> Command {
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "umask 000; exec \"$0\" \"$@\"", bin()])
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HANDOFF_BRIDGE_ADMIN_TOKEN", ADMIN_TOKEN)
        .env("HANDOFF_BRIDGE__RULES__ENABLED", "false");
    cmd
}

#[test]
fn everything_written_is_owner_only_whatever_the_umask() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // Not created beforehand: the daemon makes it (and its parent).
    let data = tmp.path().join("var").join("data");
    let mut child = under_umask_000(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--data-dir",
    ])
    .arg(&data)
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .stdin(Stdio::null())
    .spawn()
    .expect("start");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut base = None;
    let mut admin = None;
    let mut webhook_url = None;
    for line in lines.by_ref() {
        let line = line.expect("line");
        if let Some(url) = line.strip_prefix("webhook url: ") {
            webhook_url = Some(url.to_owned());
        }
        if let Some(rest) = line.strip_prefix("admin listening: ") {
            admin = Some(rest.to_owned());
        }
        if let Some(rest) = line.strip_prefix("listening: ") {
            base = Some(rest.to_owned());
            break;
        }
    }
    let (Some(base), Some(admin), Some(shown_url)) = (base, admin, webhook_url) else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the daemon did not start");
    };
    // Stdout is no terminal: the line names the token's file, and the token is read from it.
    let token = std::fs::read_to_string(data.join("webhook_token")).expect("the token file");
    assert!(!shown_url.contains(&token), "{shown_url}");
    let webhook_url = format!("{base}/webhook/{token}");
    let agent = agent();
    let post = |body: String| {
        let mut resp = agent
            .post(&webhook_url)
            .header("content-type", "application/json")
            .send(body)
            .expect("POST");
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        serde_json::from_str::<Value>(&text).expect("JSON answer")
    };
    let conv = "5c0e9b1f-4444-4d3e-9f10-000000000001";
    let answer = post(envelope("d-1", "u", &[event("e-1", conv, "hello")]));
    assert_eq!(answer["status"], "accepted", "{answer}");
    let answer = post("not json".to_owned());
    assert_eq!(answer["status"], "quarantined", "{answer}");
    let mut resp = agent
        .get(format!("{admin}/admin/v1/inbox/drained?timeout_ms=30000"))
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .call()
        .expect("drained");
    assert_eq!(
        resp.status().as_u16(),
        200,
        "{:?}",
        resp.body_mut().read_to_string()
    );
    drop(lines);
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    assert!(child.wait().expect("wait").success());

    let out = tmp.path().join("backup");
    let backup = under_umask_000(&["backup", "--data-dir"])
        .arg(&data)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("backup");
    assert!(backup.status.success(), "{backup:?}");

    let seen = assert_owner_only(&tmp.path().join("var"));
    assert!(
        seen >= 8,
        "the store, its log and secrets were walked ({seen} entries)"
    );
    assert!(data.join("webhook_token").exists() && data.join("store").join("db").exists());
    assert_owner_only(&out);
    assert!(out.join("sled.dump").exists());
}

#[test]
fn scrubbing_does_not_hide_a_body_from_dedupe_or_the_fold() {
    let app = TestApp::spawn();
    let conv = "5c0e9b1f-5555-4d3e-9f10-000000000001";
    let text = format!("my link is https://bridge.example.com/webhook/{WEBHOOK_TOKEN}");
    let body = envelope("d-1", &app.webhook_url, &[event("e-1", conv, &text)]);
    let (_, answer) = app.post(body.as_bytes());
    assert_eq!(answer["status"], "accepted", "{answer}");
    let (_, answer) = app.post(body.as_bytes());
    assert_eq!(answer["status"], "duplicate", "{answer}");
    wait_drained(&app);
    let (status, state) = app.admin_get(&format!("/admin/v1/conversations/{conv}"));
    assert_eq!(status, 200, "{state}");
    let (_, stored) = app.admin_get("/admin/v1/events/e-1");
    let shown = stored.to_string();
    assert!(!shown.contains(WEBHOOK_TOKEN), "{shown}");
    assert!(
        shown.contains(&format!("https://bridge.example.com/webhook/{MARKER}")),
        "only the token's text is replaced: {shown}"
    );
}
