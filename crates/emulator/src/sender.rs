//! The emulator as the service's webhook sender: user and agent actions posted to
//! `/_emulator/conversations/{id}/...` (and messages the bot sends through the API) become webhook
//! deliveries in the documented format, batched over a short window, POSTed to a configured URL.
//! This closes the local loop: emulator -> webhook -> bridge -> Open API -> emulator.
//!
//! It follows the real sender's rule: three non-200 answers (or connection failures) within 30
//! minutes disable the webhook ([`WebhookStatus`](crate::webhook_status::WebhookStatus)). While disabled nothing is sent (the service's
//! state still changes, and the events are held); `POST /_emulator/webhook/enable` enables it
//! again, and what was not delivered is re-sent with the same event ids. The state
//! (`GET /_emulator/state`, `GET /_emulator/webhook`) and the journal show each change and why.

use super::state::PendingWebhook;
use super::Emulator;
use actix_web::{web, HttpResponse};
use api_error::ApiError;
use model::webhook::model::MessageData;
use model::webhook::model::Millis;
use rand::distr::{Alphanumeric, SampleString};
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::Duration;

/// Events in one delivery at most: a long backlog (the re-send after the webhook is enabled
/// again) goes in several, each within the bridge's `webhook.max_events`.
pub const MAX_DELIVERY_EVENTS: usize = 100;

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
        .route("/webhook/flushed", web::get().to(flushed))
        .route("/webhook", web::get().to(webhook_status))
        .route("/webhook/enable", web::post().to(enable));
}

async fn webhook_status(emu: web::Data<Emulator>) -> HttpResponse {
    HttpResponse::Ok().json(emu.with_state(|s| s.webhook().clone()))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct EnableBody {
    /// Deliver to this URL from now on (the bot's webhook settings, where it is re-enabled).
    url: Option<String>,
}

/// The bot's webhook settings: enable the webhook again (optionally at a new URL). What was not
/// delivered is re-sent by the sender with the same event ids.
async fn enable(emu: web::Data<Emulator>, body: web::Bytes) -> Result<HttpResponse, ApiError> {
    let body: EnableBody = if body.is_empty() {
        EnableBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            ApiError::new(
                actix_web::http::StatusCode::BAD_REQUEST,
                "invalid_body",
                format!("expected {{\"url\": ...}} or no body: {e}"),
            )
        })?
    };
    if let Some(url) = &body.url {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(ApiError::new(
                actix_web::http::StatusCode::BAD_REQUEST,
                "invalid_body",
                "`url` must be an http:// or https:// URL",
            ));
        }
    }
    let now = emu.now_ms();
    let (was_disabled, status) = emu.with_state(|s| {
        let w = s.webhook_mut();
        if let Some(url) = body.url {
            w.url = Some(url);
        }
        let was = w.enable(now);
        (was, w.clone())
    });
    if was_disabled {
        tracing::info!("emulator webhook enabled again");
        emu.journal_webhook(
            now,
            "webhook-enabled",
            json!({ "reason": "enabled through /_emulator/webhook/enable" }),
        );
    }
    emu.with_state(|s| s.events_done(0));
    Ok(HttpResponse::Ok().json(status))
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
        if !emu.with_state(|s| s.webhook().enabled) {
            return HttpResponse::Conflict().json(json!({
                "error": { "code": "webhook_disabled", "message": "the webhook is disabled (re-enable it: POST /_emulator/webhook/enable)" },
                "undelivered": undelivered,
            }));
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
            kind: model::webhook::model::MessageType::Text,
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

fn failure(f: super::state::ErrorAnswer) -> ApiError {
    let status = actix_web::http::StatusCode::from_u16(f.status)
        .unwrap_or(actix_web::http::StatusCode::BAD_REQUEST);
    ApiError::new(status, f.code, f.message)
}

/// A delivery envelope around events, as the service sends it.
pub fn delivery(webhook_id: &str, url: &str, events: &[PendingWebhook]) -> Value {
    let messages: Vec<Value> = events
        .iter()
        .map(|e| {
            json!({
                "id": e.id,
                "event": e.kind,
                "sourceType": "bot",
                "sourceId": e.bot_id,
                "timestamp": e.at,
                "data": e.data,
            })
        })
        .collect();
    json!({ "id": uuid::Uuid::new_v4().to_string(), "webhookId": webhook_id, "webhookUrl": url, "messages": messages })
}

/// Start sending: collect the emulator's events every `window` and POST them as one delivery.
/// A delivery that is not answered 200 is retried (up to 4 attempts, as the service does); every
/// failed attempt counts toward the rule that disables the webhook ([`WebhookStatus::failed`](crate::webhook_status::WebhookStatus::failed)).
/// Events of a delivery that disabled it are held and re-sent, with the same ids, once it is
/// enabled again. Runs on the current actix runtime (awc is not `Send`) until the runtime stops.
pub fn start(emulator: Emulator, config: SenderConfig) {
    emulator.with_state(|s| s.enable_events());
    let webhook_id = format!(
        "emulator-{}",
        Alphanumeric.sample_string(&mut rand::rng(), 8)
    );
    actix_web::rt::spawn(send_loop(emulator, config, webhook_id));
}

/// How one delivery ended.
enum Outcome {
    /// Answered 200.
    Delivered,
    /// Every attempt failed; the events are given up on.
    GaveUp,
    /// The webhook is disabled: the events are held for the re-send.
    Disabled,
}

/// The sender's loop: every `window` (or at once while a backlog waits), one delivery of the
/// oldest events, unless the webhook is disabled.
async fn send_loop(emulator: Emulator, config: SenderConfig, webhook_id: String) {
    let client = http_client(&config);
    let mut tick = tokio::time::interval(config.window);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // More events wait than one delivery took: the next goes at once.
    let mut backlog = false;
    loop {
        if !backlog {
            tick.tick().await;
        }
        backlog = false;
        // Disabled: nothing is sent; the events wait (the state keeps changing).
        let Some((events, url)) = take_delivery(&emulator, &config) else {
            continue;
        };
        backlog = events.len() == MAX_DELIVERY_EVENTS;
        if events.is_empty() {
            continue;
        }
        let body = delivery(&webhook_id, &url, &events);
        match deliver(&emulator, &client, &url, &body, events.len()).await {
            Outcome::Disabled => {
                // Held for the re-send: still undelivered.
                emulator.with_state(|s| s.requeue_events(events));
                backlog = false;
                continue;
            }
            Outcome::GaveUp => {
                tracing::error!(
                    events = events.len(),
                    "webhook delivery dropped after retries"
                );
            }
            Outcome::Delivered => {}
        }
        emulator.with_state(|s| s.events_done(events.len() as u64));
    }
}

/// The HTTP client deliveries go through (TLS as configured, 10 s timeout).
fn http_client(config: &SenderConfig) -> awc::Client {
    let mut connector = awc::Connector::new();
    if let Some(tls) = config.tls.clone() {
        connector = connector.rustls_0_23(tls);
    }
    awc::Client::builder()
        .connector(connector)
        .timeout(Duration::from_secs(10))
        .finish()
}

/// The next delivery's events (at most [`MAX_DELIVERY_EVENTS`]) and the URL they go to, or
/// `None` while the webhook is disabled.
fn take_delivery(
    emulator: &Emulator,
    config: &SenderConfig,
) -> Option<(Vec<PendingWebhook>, String)> {
    emulator.with_state(|s| {
        let w = s.webhook();
        if !w.enabled {
            return None;
        }
        let url = w.url.clone().unwrap_or_else(|| config.url.clone());
        Some((s.take_events_up_to(MAX_DELIVERY_EVENTS), url))
    })
}

/// POSTs one delivery of `held` events, up to 4 attempts with a growing pause; each failure is
/// recorded, and a webhook disabled meanwhile stops the attempts.
async fn deliver(
    emulator: &Emulator,
    client: &awc::Client,
    url: &str,
    body: &Value,
    held: usize,
) -> Outcome {
    for attempt in 1..=4u32 {
        let failure = post_delivery(client, url, body, attempt).await;
        let now = emulator.now_ms();
        match failure {
            None => {
                emulator.with_state(|s| s.webhook_mut().delivered());
                return Outcome::Delivered;
            }
            Some(what) => {
                if record_failure(emulator, now, what, held) {
                    return Outcome::Disabled;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt))).await;
    }
    Outcome::GaveUp
}

/// One attempt: `None` when answered 200, else what went wrong.
async fn post_delivery(
    client: &awc::Client,
    url: &str,
    body: &Value,
    attempt: u32,
) -> Option<String> {
    match client
        .post(url)
        .insert_header(("user-agent", "CLOSER/webhook"))
        .send_json(body)
        .await
    {
        Ok(resp) if resp.status().as_u16() == 200 => None,
        Ok(resp) => {
            let status = resp.status().as_u16();
            tracing::warn!(status, attempt, "webhook delivery refused");
            Some(format!("status {status}"))
        }
        Err(e) => {
            tracing::warn!(error = %e, attempt, "webhook delivery failed");
            Some(format!("connection failed: {e}"))
        }
    }
}

/// Counts a failed attempt toward the disabling rule, logging and journaling the change when it
/// disables the webhook. Returns whether the webhook is disabled now (by this failure or
/// meanwhile).
fn record_failure(emulator: &Emulator, now: Millis, what: String, held: usize) -> bool {
    let (now_disabled, reason) = emulator.with_state(|s| {
        let w = s.webhook_mut();
        (w.failed(now, what), w.reason.clone())
    });
    if now_disabled {
        tracing::error!(
            reason = reason.as_deref().unwrap_or(""),
            held,
            "emulator webhook disabled after failed deliveries"
        );
        emulator.journal_webhook(now, "webhook-disabled", json!({ "reason": reason }));
    }
    !emulator.with_state(|s| s.webhook().enabled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_events_keep_their_ids_and_go_back_in_front() {
        let seed = super::super::Seed::default_seed().expect("seed");
        let mut state = super::super::EmulatorState::from_seed(&seed);
        state.enable_events();
        let conv = "5c0e9b1f-2222-4d3e-9f10-000000000001";
        let text = |t: &str| MessageData {
            kind: model::webhook::model::MessageType::Text,
            text: Some(t.into()),
            media: None,
            cards: None,
            location: None,
            button: None,
            buttons: None,
        };
        state.user_says(conv, text("one"), 1).expect("say");
        let taken = state.take_events();
        let ids: Vec<String> = taken.iter().map(|e| e.id.clone()).collect();
        state.user_says(conv, text("two"), 2).expect("say");
        state.requeue_events(taken);
        let again = state.take_events();
        assert_eq!(again.len(), 2);
        assert_eq!(again[0].id, ids[0], "the same id on the re-send");
        let body = delivery("w", "http://x", &again);
        assert_eq!(body["messages"][0]["id"], json!(ids[0]));
        assert_eq!(state.delivery_status().0, 2, "both still undelivered");
        state.requeue_events(again);
        assert_eq!(state.take_events_up_to(1).len(), 1, "a delivery's worth");
        assert_eq!(state.take_events_up_to(10).len(), 1, "then the rest");
    }
}
