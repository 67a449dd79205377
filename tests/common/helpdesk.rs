//! A test help desk for integration tests: a small HTTP server in the test process on 127.0.0.1
//! that records every request and answers as scripted, and a Standard Webhooks verifier written
//! from the specification (not the bridge's own code), so signatures are checked independently.

use base64::Engine;
use hmac::{Hmac, Mac};
use serde_json::Value;
use sha2::Sha256;
use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Two valid secrets at once: the old one and the new one of a rotation.
pub const OLD_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
pub const NEW_SECRET: &str = "whsec_BwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwc=";

/// One request the test help desk received, and the status it answered.
#[derive(Clone, Debug)]
pub struct Received {
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
    pub status: u16,
}

impl Received {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("event body is JSON")
    }
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("no {name} header"))
    }
}

/// The test help desk: answers the scripted statuses first, then `then` for every request.
#[derive(Clone)]
pub struct HelpDesk {
    pub url: String,
    received: Arc<Mutex<Vec<Received>>>,
    script: Arc<Mutex<VecDeque<u16>>>,
    then: Arc<Mutex<u16>>,
}

impl HelpDesk {
    pub fn start(script: &[u16], then: u16) -> HelpDesk {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let desk = HelpDesk {
            url: format!("http://{}/events", listener.local_addr().expect("addr")),
            received: Arc::default(),
            script: Arc::new(Mutex::new(script.iter().copied().collect())),
            then: Arc::new(Mutex::new(then)),
        };
        let server = desk.clone();
        // Serves until the test process ends; every read is bounded by a timeout.
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                server.serve(stream);
            }
        });
        desk
    }

    /// One request per connection (answered with `connection: close`).
    pub fn serve(&self, stream: std::net::TcpStream) {
        let Some(request) = read_request(&stream) else {
            return;
        };
        let (headers, body) = (request.headers, request.body);
        let status = self
            .script
            .lock()
            .expect("script")
            .pop_front()
            .unwrap_or_else(|| *self.then.lock().expect("then"));
        self.received.lock().expect("received").push(Received {
            headers,
            body,
            status,
        });
        let mut stream = stream;
        let _ = write!(
            stream,
            "HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        );
        let _ = stream.flush();
    }

    pub fn received(&self) -> Vec<Received> {
        self.received.lock().expect("received").clone()
    }

    /// The events it accepted (answered 2xx), in arrival order.
    pub fn accepted(&self) -> Vec<Received> {
        self.received()
            .into_iter()
            .filter(|r| (200..300).contains(&r.status))
            .collect()
    }

    pub fn set_then(&self, status: u16) {
        *self.then.lock().expect("then") = status;
    }
}

/// One HTTP/1.1 request as a test server reads it: no keep-alive, a `content-length` body.
pub struct Request {
    pub method: String,
    /// Path and query.
    pub target: String,
    /// Names lowercased.
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
}

/// Read one request from `stream` (`None`: the client went away or sent garbage).
pub fn read_request(stream: &std::net::TcpStream) -> Option<Request> {
    let mut reader = BufReader::new(stream.try_clone().ok()?);
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_owned();
    let target = parts.next().unwrap_or_default().to_owned();
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
        }
    }
    let len: usize = headers
        .get("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; len];
    reader.read_exact(&mut body).ok()?;
    Some(Request {
        method,
        target,
        headers,
        body,
    })
}

/// A Standard Webhooks verifier written from the specification: the signed content is
/// `{id}.{timestamp}.{body}`, the key the base64 after `whsec_`, the header a space-separated
/// list of `v1,<base64 HMAC-SHA256>`; a timestamp more than five minutes from `now` is refused.
pub fn verify(
    secret: &str,
    id: &str,
    timestamp: &str,
    signatures: &str,
    body: &[u8],
    now: i64,
) -> Result<(), String> {
    let ts: i64 = timestamp.parse().map_err(|_| "bad timestamp".to_owned())?;
    if (now - ts).abs() > 300 {
        return Err("timestamp outside the tolerance".into());
    }
    let key = base64::engine::general_purpose::STANDARD
        .decode(secret.strip_prefix("whsec_").ok_or("no whsec_ prefix")?)
        .map_err(|e| e.to_string())?;
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).map_err(|e| e.to_string())?;
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    let expected = mac.finalize().into_bytes();
    for sig in signatures.split(' ') {
        let Some(("v1", b64)) = sig.split_once(',') else {
            continue;
        };
        let Ok(given) = base64::engine::general_purpose::STANDARD.decode(b64) else {
            continue;
        };
        // Constant-time comparison, as a real receiver must do.
        let verifier = {
            let mut m = Hmac::<Sha256>::new_from_slice(&key).map_err(|e| e.to_string())?;
            m.update(format!("{id}.{timestamp}.").as_bytes());
            m.update(body);
            m
        };
        if verifier.verify_slice(&given).is_ok() {
            assert_eq!(given.as_slice(), expected.as_slice());
            return Ok(());
        }
    }
    Err("no signature matches".into())
}

pub fn verify_received(secret: &str, r: &Received, now: i64) -> Result<(), String> {
    verify(
        secret,
        r.header("webhook-id"),
        r.header("webhook-timestamp"),
        r.header("webhook-signature"),
        &r.body,
        now,
    )
}

pub fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// The daemon with the shipped rules telling the help desk, at any hour, and `desk` as its one
/// endpoint with both secrets; `retry` is the `[outbox]` settings (give-up, backoff, breaker); in a
/// process of its own when `own_process` (a test that reads its log or kills it).
pub fn spawn_desk(
    root: &std::path::Path,
    desk: &HelpDesk,
    retry: &str,
    own_process: bool,
) -> super::TestApp {
    let config = format!(
        "[helpdesk]\ntranscript_messages = 5\n\n{}\n{retry}\n",
        endpoint(
            "desk",
            desk,
            Some(r#"["handoff.*", "conversation.message"]"#)
        )
    );
    spawn_configured(root, &config, &[], own_process)
}

/// One `[[helpdesk.endpoints]]` table for `desk`, signed with both secrets; `events` is the
/// TOML array of patterns (`None`: the default, every kind).
pub fn endpoint(name: &str, desk: &HelpDesk, events: Option<&str>) -> String {
    let events = events.map_or(String::new(), |e| format!("events = {e}\n"));
    format!(
        "[[helpdesk.endpoints]]\nname = \"{name}\"\nurl = \"{url}\"\nsecrets = [\"{OLD_SECRET}\", \"{NEW_SECRET}\"]\n{events}\n",
        url = desk.url
    )
}

/// The daemon on the configuration file `config`, with the shipped rules telling the help desk at
/// any hour, and `env` added (more settings, the test clock, agent API tokens); in a process of its
/// own when `own_process`.
pub fn spawn_configured(
    root: &std::path::Path,
    config: &str,
    env: &[(&str, &str)],
    own_process: bool,
) -> super::TestApp {
    let path = root.join("bridge.toml");
    std::fs::write(&path, config).expect("config");
    let mut all = vec![
        (
            "HANDOFF_BRIDGE__RULES__SETTINGS__NOTIFY_HELPDESK".to_owned(),
            "true".to_owned(),
        ),
        (
            "HANDOFF_BRIDGE__RULES__SETTINGS__CHECK_BUSINESS_HOURS".to_owned(),
            "false".to_owned(),
        ),
    ];
    all.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    super::TestApp::spawn_in(
        &root.join("data"),
        super::Spawn {
            env: all,
            args: vec!["--config".into(), path.to_str().expect("utf-8").into()],
            own_process,
        },
    )
}

/// Fast retries and probes, an hour before giving up.
pub const FAST_RETRY: &str = r#"[outbox]
give_up_after = "1h"
[outbox.retry]
base = "50ms"
cap = "200ms"
[outbox.breaker]
probe_interval = "100ms""#;

/// The dead letters, through the admin API.
pub fn dead_letters(app: &super::TestApp) -> Vec<serde_json::Value> {
    let (status, body) = app.admin_get("/admin/v1/dead-letters");
    assert_eq!(status, 200, "{body}");
    body["dead_letters"]
        .as_array()
        .cloned()
        .expect("dead_letters")
}
