//! The floor of a durable handoff (issue 39): a peer for the actions harness (`--target`), beside
//! Node-RED, that does only the I/O a handoff relay cannot skip without dropping the bridge's
//! first guarantee (durable before acknowledged), on the bridge's own stack (actix-web, awc, a
//! syncer thread): read the delivery, parse it, append it to a log file and `fdatasync` it
//! (group commit: one sync for every delivery queued meanwhile), answer 200 with a receipt, then
//! make the two calls of the shipped rule `agent-requested` for each agent call, one after the
//! other, as `benches/node-red/flow.json` does (same paths, bodies and idempotency keys).
//!
//! No dedupe, no state, no rules, no outbox: nothing of what the bridge's engine and store add.
//! Its CPU per handoff, measured in the same sitting as the bridge's and Node-RED's, is what a
//! durable relay pays on this machine before any of that (`benches/run --cases e2e,node-red,floor`;
//! docs/benchmarks.md).
//!
//! Run by `benches/run` as `floor --listen 127.0.0.1:PORT --upstream http://127.0.0.1:PORT
//! --log-dir DIR`, with `BENCH_WEBHOOK_TOKEN`, `UPSTREAM_API_KEY` and `QUEUE_TEXT` in its
//! environment. Loopback only; it stops on SIGTERM or after an hour.

use actix_web::{web, App, HttpResponse, HttpServer};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde::Deserialize;
use std::io::{Seek, Write};
use std::path::PathBuf;
use std::time::Duration;
use tokio::sync::oneshot;

/// Its lifetime bound: it stops on its own if nobody stops it.
const LIFETIME: Duration = Duration::from_secs(3600);

/// The log starts again from empty past this size (as a real log drops segments it no longer
/// needs), so a sitting's deliveries do not fill the disk.
const LOG_ROLL_BYTES: u64 = 64 * 1024 * 1024;

/// What `encodeURIComponent` leaves as it is (the Node-RED flow's path segments).
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'!')
    .remove(b'~')
    .remove(b'*')
    .remove(b'\'')
    .remove(b'(')
    .remove(b')');

#[derive(Deserialize)]
struct Delivery {
    id: String,
    messages: Vec<Message>,
}

#[derive(Deserialize)]
struct Message {
    id: String,
    event: String,
    #[serde(default)]
    data: Option<Data>,
}

#[derive(Deserialize)]
struct Data {
    #[serde(default)]
    conversation: Option<Conversation>,
}

#[derive(Deserialize)]
struct Conversation {
    id: String,
}

/// A delivery's body for the syncer, and who waits for its sync (true: synced).
type ToSync = (web::Bytes, oneshot::Sender<bool>);

struct Settings {
    token: String,
    upstream: String,
    authorization: String,
    queue_text: String,
}

struct Shared {
    settings: Settings,
    syncer: std::sync::mpsc::Sender<ToSync>,
}

fn main() -> Result<(), String> {
    let (mut listen, mut upstream, mut log_dir) = (None, None, None);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        // `cargo bench` passes `--bench`.
        if flag == "--bench" {
            continue;
        }
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--listen" => listen = Some(value),
            "--upstream" => upstream = Some(value),
            "--log-dir" => log_dir = Some(PathBuf::from(value)),
            other => return Err(format!("unknown option {other}")),
        }
    }
    let Some(listen) = listen else {
        // `cargo bench` on its own: a peer has nothing to measure by itself.
        println!("floor: a peer for the actions harness; run by `benches/run --cases floor`");
        return Ok(());
    };
    let listen: std::net::SocketAddr = listen.parse().map_err(|e| format!("--listen: {e}"))?;
    if !listen.ip().is_loopback() {
        return Err("--listen must be a loopback address".into());
    }
    let env = |name: &str| std::env::var(name).map_err(|_| format!("{name} is not set"));
    let settings = Settings {
        token: env("BENCH_WEBHOOK_TOKEN")?,
        upstream: upstream.ok_or("--upstream is required")?,
        authorization: format!("Bearer {}", env("UPSTREAM_API_KEY")?),
        queue_text: env("QUEUE_TEXT")?,
    };
    let log = log_dir.ok_or("--log-dir is required")?.join("floor.log");
    let syncer = start_syncer(&log)?;
    serve(listen, Shared { settings, syncer })
}

/// The syncer thread: appends every body queued at that moment to the log, syncs once, answers.
fn start_syncer(path: &std::path::Path) -> Result<std::sync::mpsc::Sender<ToSync>, String> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let (tx, rx) = std::sync::mpsc::channel::<ToSync>();
    std::thread::Builder::new()
        .name("floor-syncer".into())
        .spawn(move || {
            while let Ok(first) = rx.recv() {
                let mut group = vec![first];
                group.extend(rx.try_iter());
                let mut buf = Vec::new();
                for (body, _) in &group {
                    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
                    buf.extend_from_slice(body);
                }
                let synced = file.write_all(&buf).and_then(|()| file.sync_data()).is_ok();
                for (_, reply) in group {
                    let _ = reply.send(synced);
                }
                if file.stream_position().is_ok_and(|at| at > LOG_ROLL_BYTES) {
                    let _ = file.set_len(0).and_then(|()| file.rewind());
                }
            }
        })
        .map_err(|e| format!("syncer: {e}"))?;
    Ok(tx)
}

fn serve(listen: std::net::SocketAddr, shared: Shared) -> Result<(), String> {
    let shared = web::Data::new(shared);
    actix_web::rt::System::new().block_on(async move {
        let server = HttpServer::new(move || {
            App::new()
                .app_data(shared.clone())
                // awc's client is not `Send`: one per worker, on its thread.
                .app_data(web::Data::new(awc::Client::default()))
                .route("/webhook/{token}", web::post().to(receive))
                .route("/healthz", web::get().to(HttpResponse::Ok))
        })
        .disable_signals()
        .bind(listen)
        .map_err(|e| e.to_string())?
        .run();
        let handle = server.handle();
        let mut task = actix_web::rt::spawn(server);
        let kind = tokio::signal::unix::SignalKind::terminate();
        let mut term = tokio::signal::unix::signal(kind).map_err(|e| e.to_string())?;
        tokio::select! {
            _ = term.recv() => {}
            () = tokio::time::sleep(LIFETIME) => {}
            ran = &mut task => return ran.map_err(|e| e.to_string())?.map_err(|e| e.to_string()),
        }
        handle.stop(true).await;
        let _ = task.await;
        Ok(())
    })
}

/// Token, parse, durable, receipt; then the calls.
async fn receive(
    token: web::Path<String>,
    body: web::Bytes,
    shared: web::Data<Shared>,
    client: web::Data<awc::Client>,
) -> HttpResponse {
    if token.as_str() != shared.settings.token {
        return HttpResponse::Unauthorized()
            .json(serde_json::json!({"error": {"code": "unauthorized"}}));
    }
    let Ok(delivery) = serde_json::from_slice::<Delivery>(&body) else {
        return HttpResponse::BadRequest()
            .json(serde_json::json!({"error": {"code": "invalid_delivery"}}));
    };
    let (reply, synced) = oneshot::channel();
    if shared.syncer.send((body, reply)).is_err() || !matches!(synced.await, Ok(true)) {
        return HttpResponse::ServiceUnavailable()
            .json(serde_json::json!({"error": {"code": "store_unavailable"}}));
    }
    let receipt = serde_json::json!({
        "status": "accepted",
        "delivery_id": delivery.id,
        "accepted": delivery.messages.len(),
        "duplicates": 0,
        "quarantined": 0,
    });
    let calls: Vec<(String, String)> = delivery
        .messages
        .into_iter()
        .filter(|m| m.event == "bot.conversation.agent_call_requested")
        .filter_map(|m| Some((m.id, m.data?.conversation?.id)))
        .collect();
    if !calls.is_empty() {
        let client = client.into_inner();
        actix_web::rt::spawn(async move {
            for (event, conversation) in calls {
                call_agent(&client, &shared.settings, &event, &conversation).await;
            }
        });
    }
    HttpResponse::Ok().json(receipt)
}

/// `agent-requested`'s two calls: bot off (manual on), then the queue message.
async fn call_agent(client: &awc::Client, settings: &Settings, event: &str, conversation: &str) {
    let path = format!(
        "{}/openapi/conversation/{}",
        settings.upstream,
        utf8_percent_encode(conversation, SEGMENT)
    );
    let key = format!("{event}/agent-requested/");
    let manual = client
        .put(format!("{path}/manual"))
        .insert_header(("Authorization", settings.authorization.as_str()))
        .insert_header(("Idempotency-Key", format!("{key}0")))
        .send_json(&serde_json::json!({"enabled": true}));
    let Ok(mut answer) = manual.await else { return };
    if answer.body().await.is_err() {
        return;
    }
    let message = serde_json::json!({
        "custom": format!("floor:{key}1"),
        "message": {"type": "text", "text": settings.queue_text},
    });
    let sent = client
        .post(format!("{path}/message"))
        .insert_header(("Authorization", settings.authorization.as_str()))
        .insert_header(("Idempotency-Key", format!("{key}1")))
        .send_json(&message);
    if let Ok(mut r) = sent.await {
        let _ = r.body().await;
    }
}
