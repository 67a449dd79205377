//! The emulator as the service's webhook sender: user and agent actions posted to
//! `/_emulator/conversations/{id}/...` (and messages the bot sends through the API) become webhook
//! deliveries in the documented format, batched over a short window, POSTed to a configured URL.
//! This closes the local loop: emulator -> webhook -> bridge -> Open API -> emulator.

use super::state::PendingEvent;
use super::Emulator;
use crate::http_error::ApiError;
use crate::webhook::model::MessageData;
use actix_web::{web, HttpResponse};
use rand::distr::{Alphanumeric, SampleString};
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::Duration;

/// Where deliveries go and how events are batched.
#[derive(Clone, Debug)]
pub struct SenderConfig {
    /// The registered webhook URL (token included).
    pub url: String,
    /// Events of this window share one delivery, as the service batches them.
    pub window: Duration,
    /// How an `https://` URL is verified (`None`: plain HTTP only).
    pub tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

/// Routes under `/_emulator` (the scope's data is the emulator).
pub(super) fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/conversations/{id}/say", web::post().to(say))
        .route(
            "/conversations/{id}/request-agent",
            web::post().to(request_agent),
        )
        .route(
            "/conversations/{id}/agent-connect",
            web::post().to(agent_connect),
        )
        .route("/conversations/{id}/agent-end", web::post().to(agent_end))
        .route("/conversations/{id}/cancel", web::post().to(cancel))
        .route("/webhook/flushed", web::get().to(flushed));
}

#[derive(Deserialize)]
struct FlushedQuery {
    timeout_ms: Option<u64>,
}

/// Answers once every event emitted so far has been through the sender (200), or when the
/// timeout passes (504): lets tests and scripts wait for deliveries without polling.
async fn flushed(emu: web::Data<Emulator>, q: web::Query<FlushedQuery>) -> HttpResponse {
    let deadline = tokio::time::Instant::now()
        + Duration::from_millis(q.timeout_ms.unwrap_or(10_000).min(300_000));
    loop {
        let (undelivered, progress) = emu.with_state(|s| s.delivery_status());
        let notified = progress.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        // Re-read after registering, so a completion in between is not missed.
        let undelivered = undelivered.min(emu.with_state(|s| s.delivery_status().0));
        if undelivered == 0 {
            return HttpResponse::Ok().json(json!({ "undelivered": 0 }));
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            return HttpResponse::GatewayTimeout().json(json!({
                "error": { "code": "not_flushed", "message": "webhook events still undelivered" },
                "undelivered": undelivered,
            }));
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SayBody {
    /// `{"text": "..."}`
    Text { text: String },
    /// Any MESSAGE.DATA (`{"message": {"type": "location", ...}}`).
    Message { message: Box<MessageData> },
}

async fn say(
    emu: web::Data<Emulator>,
    id: web::Path<String>,
    body: web::Json<SayBody>,
) -> Result<HttpResponse, ApiError> {
    let data = match body.into_inner() {
        SayBody::Text { text } => MessageData {
            kind: crate::webhook::model::MessageType::Text,
            text: Some(text),
            media: None,
            cards: None,
            location: None,
            button: None,
            buttons: None,
        },
        SayBody::Message { message } => *message,
    };
    let now = emu.now_ms();
    let message = emu
        .with_state(|s| s.user_says(&id, data, now))
        .map_err(failure)?;
    Ok(HttpResponse::Ok().json(message))
}

async fn step(emu: web::Data<Emulator>, id: String, step: &str) -> Result<HttpResponse, ApiError> {
    let now = emu.now_ms();
    let conversation = emu
        .with_state(|s| s.agent_call(&id, step, now))
        .map_err(failure)?;
    Ok(HttpResponse::Ok().json(conversation))
}

async fn request_agent(
    emu: web::Data<Emulator>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    step(emu, id.into_inner(), "agent_call_requested").await
}

async fn agent_connect(
    emu: web::Data<Emulator>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    step(emu, id.into_inner(), "agent_call_connected").await
}

async fn agent_end(
    emu: web::Data<Emulator>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    step(emu, id.into_inner(), "agent_call_disconnected").await
}

async fn cancel(emu: web::Data<Emulator>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    step(emu, id.into_inner(), "agent_call_cancelled").await
}

fn failure(f: super::state::Failure) -> ApiError {
    let status = actix_web::http::StatusCode::from_u16(f.status)
        .unwrap_or(actix_web::http::StatusCode::BAD_REQUEST);
    ApiError::new(status, f.code, f.message)
}

/// A delivery envelope around events, as the service sends it.
pub fn delivery(webhook_id: &str, url: &str, events: &[PendingEvent]) -> Value {
    let id = || uuid_like();
    let messages: Vec<Value> = events
        .iter()
        .map(|e| {
            json!({
                "id": id(),
                "event": e.kind,
                "sourceType": "bot",
                "sourceId": e.bot_id,
                "timestamp": e.at,
                "data": e.data,
            })
        })
        .collect();
    json!({ "id": id(), "webhookId": webhook_id, "webhookUrl": url, "messages": messages })
}

fn uuid_like() -> String {
    let hex = |n: usize| {
        let mut s = String::with_capacity(n);
        for _ in 0..n {
            let d = rand::random_range(0..16u32);
            s.push(char::from_digit(d, 16).unwrap_or('0'));
        }
        s
    };
    format!("{}-{}-4{}-8{}-{}", hex(8), hex(4), hex(3), hex(3), hex(12))
}

/// Start sending: collect the emulator's events every `window` and POST them as one delivery.
/// A delivery that is not answered 200 is retried up to 3 times, as the service does, then
/// dropped with an error log. Runs on the current actix runtime (awc is not `Send`) until the
/// runtime stops.
pub fn start(emulator: Emulator, config: SenderConfig) {
    emulator.with_state(|s| s.enable_events());
    let webhook_id = format!(
        "emulator-{}",
        Alphanumeric.sample_string(&mut rand::rng(), 8)
    );
    actix_web::rt::spawn(async move {
        let mut connector = awc::Connector::new();
        if let Some(tls) = config.tls.clone() {
            connector = connector.rustls_0_23(tls);
        }
        let client = awc::Client::builder()
            .connector(connector)
            .timeout(Duration::from_secs(10))
            .finish();
        let mut tick = tokio::time::interval(config.window);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let events = emulator.with_state(|s| s.take_events());
            if events.is_empty() {
                continue;
            }
            let body = delivery(&webhook_id, &config.url, &events);
            let mut delivered = false;
            for attempt in 1..=4u32 {
                match client
                    .post(&config.url)
                    .insert_header(("user-agent", "CLOSER/webhook"))
                    .send_json(&body)
                    .await
                {
                    Ok(resp) if resp.status().as_u16() == 200 => {
                        delivered = true;
                        break;
                    }
                    Ok(resp) => tracing::warn!(
                        status = resp.status().as_u16(),
                        attempt,
                        "webhook delivery refused"
                    ),
                    Err(e) => tracing::warn!(error = %e, attempt, "webhook delivery failed"),
                }
                tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt))).await;
            }
            if !delivered {
                tracing::error!(
                    events = events.len(),
                    "webhook delivery dropped after retries"
                );
            }
            emulator.with_state(|s| s.events_done(events.len() as u64));
        }
    });
}
