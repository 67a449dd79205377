//! `POST /helpdesk/chatwoot/webhook` on the public listener: Chatwoot's deliveries (the API
//! inbox's webhook) verified, read, and turned into agent commands of the mapped service
//! conversation on the one command path, stored through the writer before the 200 (nothing waits
//! for the fold: any other answer makes Chatwoot mark the agent's message failed).
//!
//! - Verified: `X-Chatwoot-Signature` over the timestamp and the raw body (constant time), the
//!   timestamp within five minutes: else 401, nothing stored. For Chatwoot before 4.13 (unsigned)
//!   an opt-in secret last path segment instead (`helpdesk.chatwoot.unsigned_path_token`).
//! - Bounded: the body's share of the in-flight budget, at most [`MAX_BODY`], read within
//!   `server.body_read_timeout`.
//! - Once: the commands' event ids come from the signed body (a message's id; a conversation's
//!   id, the event and the signed `updated_at` of the change), so a delivery posted twice, or
//!   replayed re-signed under another `X-Chatwoot-Delivery` (unsigned, kept for the logs), is a
//!   duplicate (200, applied once).
//! - Signed but unreadable: quarantined (scope `chatwoot`), 200.

use super::client::NAME;
use super::inbound::{self, Decision, Intent, Mapped, Standing};
use super::payload::{self, Payload};
use super::signature;
use crate::helpdesk::commands::{store_error, Commands, Stored};
use crate::intake::auth::TokenSet;
use crate::ops::metrics::Metrics;
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use api_error::ApiError;
use engine::state::desk::DeskPhase;
use model::secret::Secret;
use model::webhook::agent::Command;
use serde_json::json;
use std::sync::Arc;
use storage::desk_links::DeskLink;
use storage::QuarantineRecord;

/// Where Chatwoot posts.
pub const PATH: &str = "/helpdesk/chatwoot/webhook";
/// Longest delivery read (a conversation's payload with its last message is a few KiB).
pub const MAX_BODY: usize = 1024 * 1024;

/// The webhook's handler state.
pub struct ChatwootHook {
    commands: Arc<Commands>,
    store: storage::Store,
    metrics: Metrics,
    /// The inbox's webhook secret (empty: signed deliveries are refused, only the path token
    /// authenticates).
    secret: Secret,
    /// `unsigned_path_token`: empty refuses every unsigned delivery.
    path_token: TokenSet,
    account_id: String,
    relay_csat: bool,
    body_read_timeout: std::time::Duration,
}

impl ChatwootHook {
    /// From the validated `[helpdesk.chatwoot]` (its secret resolved).
    pub fn new(
        config: &crate::config::chatwoot::ChatwootConfig,
        commands: Arc<Commands>,
        (store, metrics): (storage::Store, Metrics),
        body_read_timeout: std::time::Duration,
    ) -> Result<Self, String> {
        Ok(ChatwootHook {
            commands,
            store,
            metrics,
            secret: config.resolve_webhook_secret()?,
            path_token: TokenSet::new(vec![config.unsigned_path_token.clone()]),
            account_id: config.account_id.to_string(),
            relay_csat: config.relay_csat,
            body_read_timeout,
        })
    }
}

/// The webhook's routes (on the public listener, with the connector configured).
pub fn routes(cfg: &mut web::ServiceConfig) {
    let not_allowed = || web::to(|| async { api_error::method_not_allowed_allowing("POST") });
    cfg.service(
        web::resource(PATH)
            .route(web::post().to(signed))
            .default_service(not_allowed()),
    )
    .service(
        web::resource(format!("{PATH}/{{token}}"))
            .route(web::post().to(with_token))
            .default_service(not_allowed()),
    );
}

async fn signed(
    hook: web::Data<ChatwootHook>,
    req: HttpRequest,
    body: web::Payload,
) -> HttpResponse {
    receive(&hook, &req, None, body).await
}

async fn with_token(
    hook: web::Data<ChatwootHook>,
    req: HttpRequest,
    token: web::Path<String>,
    body: web::Payload,
) -> HttpResponse {
    receive(&hook, &req, Some(token.into_inner()), body).await
}

/// How a delivery is answered, and counted.
struct Verdict {
    kind: &'static str,
    verdict: &'static str,
    answer: Result<serde_json::Value, ApiError>,
}

async fn receive(
    hook: &web::Data<ChatwootHook>,
    req: &HttpRequest,
    token: Option<String>,
    payload: web::Payload,
) -> HttpResponse {
    let v = match handle(hook, req, token, payload).await {
        Ok(v) => v,
        Err((kind, e)) => Verdict {
            kind,
            verdict: "refused",
            answer: Err(e),
        },
    };
    hook.metrics
        .desk_webhooks
        .with_label_values(&[NAME, v.kind, v.verdict])
        .inc();
    match v.answer {
        Ok(body) => HttpResponse::Ok().json(body),
        Err(e) => actix_web::ResponseError::error_response(&e),
    }
}

type Refusal = (&'static str, ApiError);

async fn handle(
    hook: &web::Data<ChatwootHook>,
    req: &HttpRequest,
    token: Option<String>,
    payload: web::Payload,
) -> Result<Verdict, Refusal> {
    let now_secs = hook.store.clock().now_millis().div_euclid(1000);
    let signed = authenticate(hook, req, token.as_deref(), now_secs)?;
    // The body's share of the in-flight budget, taken once the headers pass.
    let _share = crate::body_budget::admit(req).await.map_err(|_| {
        (
            "busy",
            ApiError::unavailable("too many bodies in flight; retry"),
        )
    })?;
    let limit = MAX_BODY;
    let body = crate::helpdesk::agent_api::read_body(req, payload, limit, hook.body_read_timeout)
        .await
        .map_err(|e| ("body", e))?;
    if let Some((timestamp, signature)) = signed {
        let key = hook.secret.expose().as_bytes();
        if key.is_empty() || !signature::verify(key, &timestamp, &body, &signature) {
            return Err(("signature", unauthorized("the signature does not match")));
        }
    }
    let delivery = delivery_id(req, &body);
    match payload::parse(&body) {
        Ok(p) => {
            let key = event_key(&p, &body);
            tracing::debug!(delivery = %delivery, key = %key, "a Chatwoot delivery");
            relay(hook, &key, p).await
        }
        Err(e) => quarantine(hook, &delivery, &body, &e.0).await,
    }
}

/// The signature's headers (checked once the body is read), or the path token: else 401 before
/// any of the body is read. A stale timestamp is refused at once.
fn authenticate(
    hook: &ChatwootHook,
    req: &HttpRequest,
    token: Option<&str>,
    now_secs: i64,
) -> Result<Option<(String, String)>, Refusal> {
    if let Some(token) = token {
        return match hook.path_token.accepts(token) {
            true => Ok(None),
            false => Err(("token", unauthorized("unknown webhook path"))),
        };
    }
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let (Some(timestamp), Some(signature)) = (
        header(signature::TIMESTAMP_HEADER),
        header(signature::SIGNATURE_HEADER),
    ) else {
        return Err((
            "unsigned",
            unauthorized("X-Chatwoot-Signature and X-Chatwoot-Timestamp are required"),
        ));
    };
    if !signature::fresh(&timestamp, now_secs) {
        return Err((
            "stale_timestamp",
            unauthorized("X-Chatwoot-Timestamp is more than five minutes from the bridge's clock"),
        ));
    }
    Ok(Some((timestamp, signature)))
}

/// `X-Chatwoot-Delivery` (for the logs and the quarantine: it is not signed), else the body's
/// digest.
fn delivery_id(req: &HttpRequest, body: &[u8]) -> String {
    let header = req
        .headers()
        .get(signature::DELIVERY_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|d| !d.is_empty() && d.len() <= 128 && d.bytes().all(|b| b.is_ascii_graphic()));
    match header {
        Some(d) => d.to_owned(),
        None => digest(body),
    }
}

/// What names a delivery's event, from the signed body: the message's id for
/// `message_created`; for a conversation's event its id, the event, the status and when the
/// change was made (`updated_at`: the change's own for `conversation_updated`, whose payload shows
/// the conversation as it is when Chatwoot's job runs); else the body's digest. The same event
/// re-signed (a new timestamp, another delivery id) has the same key.
fn event_key(p: &Payload, body: &[u8]) -> String {
    let key = match p {
        Payload::MessageCreated(m) => Some(format!("m{}", m.id)),
        Payload::ConversationUpdated(c) => c
            .changed("updated_at")
            .filter(|v| !v.is_null())
            .or(c.updated_at.as_ref())
            .map(|at| format!("u{}:{}:{}", c.id, c.status, at_text(at))),
        Payload::StatusChanged(c) => c
            .updated_at
            .as_ref()
            .map(|at| format!("s{}:{}:{}", c.id, c.status, at_text(at))),
        Payload::Other(_) => None,
    };
    // Ids go into the bridge's event ids: short and plain, or the body's digest.
    key.filter(|k| k.len() <= 96 && k.bytes().all(|b| b.is_ascii_graphic()))
        .unwrap_or_else(|| format!("d{}", digest(body)))
}

/// A time as sent (a number's own digits, a text as it is).
fn at_text(at: &serde_json::Value) -> String {
    match at {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The first 16 bytes of the body's SHA-256, in hex.
fn digest(body: &[u8]) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(body);
    digest.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// A readable delivery (its event named `key`): decided against the mapping and the
/// conversation's state, its commands stored.
async fn relay(hook: &web::Data<ChatwootHook>, key: &str, p: Payload) -> Result<Verdict, Refusal> {
    let hook2 = hook.clone().into_inner();
    let (account, relay_csat) = (hook.account_id.clone(), hook.relay_csat);
    let key_owned = key.to_owned();
    let planned = hook
        .commands
        .blocking(move |commands| {
            let link = mapping(&hook2, &p, &account)?;
            let holder = link.as_ref().map(|(l, _)| l.conversation_id.clone());
            let state = holder
                .map(|id| commands.conversation(&id))
                .transpose()
                .ok()
                .flatten();
            let standing = Standing {
                mapped: link.as_ref().map_or(Mapped::No, |(_, m)| *m),
                holder: state.as_ref().and_then(|s| s.desk.agent.as_ref()),
                phase: state.as_ref().map(DeskPhase::of),
            };
            let decision = inbound::decide(&p, standing, relay_csat);
            let stored = match (&decision.intents[..], link) {
                ([], _) | (_, None) => Vec::new(),
                (_, Some((link, _))) => match build(commands, &link, &decision, &key_owned) {
                    Ok(stored) => stored,
                    // Gone, or no partner channel for its bot: nothing to relay it with.
                    Err(e) if e.status.is_client_error() => {
                        tracing::warn!(code = e.code, "a Chatwoot delivery cannot be relayed");
                        return Ok(("not_relayable", Vec::new()));
                    }
                    Err(e) => return Err(e),
                },
            };
            Ok((decision.kind, stored))
        })
        .await
        .map_err(|e| ("store", e))?;
    let (kind, stored) = planned;
    if stored.is_empty() {
        return Ok(Verdict {
            kind,
            verdict: "ignored",
            answer: Ok(json!({"status": "ignored", "kind": kind})),
        });
    }
    let new = hook
        .commands
        .store(
            &model::ids::Internal::Agent.id(format_args!("chatwoot:{key}")),
            stored,
        )
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "cannot store a Chatwoot delivery's commands");
            (
                "store",
                ApiError::unavailable("the store cannot take the delivery now; retry"),
            )
        })?;
    let verdict = if new == 0 { "duplicate" } else { "relayed" };
    Ok(Verdict {
        kind,
        verdict,
        answer: Ok(json!({"status": verdict, "kind": kind, "commands": new})),
    })
}

/// The delivery's conversation's mapping, and how it stands.
fn mapping(
    hook: &ChatwootHook,
    p: &Payload,
    account: &str,
) -> Result<Option<(DeskLink, Mapped)>, ApiError> {
    let other_account = inbound::account_of(p).is_some_and(|a| a != account);
    let Some(remote) = inbound::remote_of(p).filter(|_| !other_account) else {
        return Ok(None);
    };
    let link = hook
        .store
        .desk_link_of_remote(NAME, remote)
        .map_err(store_error)?;
    Ok(link.map(|l| {
        let mapped = match (&l.remote, l.closed_at) {
            (Some(current), _) if current != remote => Mapped::Stale,
            (_, Some(_)) => Mapped::Closed,
            _ => Mapped::Open,
        };
        (l, mapped)
    }))
}

/// The decision's commands for the link's service conversation, each with its event id (from
/// the event's `key`). A conversation the bridge no longer has (deleted) is refused like the
/// agent API refuses it.
fn build(
    commands: &Commands,
    link: &DeskLink,
    decision: &Decision,
    key: &str,
) -> Result<Vec<Stored>, ApiError> {
    let id = link.conversation_id.as_str();
    let mut out = Vec::with_capacity(decision.intents.len());
    let mut parts = 0;
    for intent in &decision.intents {
        let (state, command) = match intent {
            Intent::Accept(agent) => (
                commands.conversation(id)?,
                Command::Accept {
                    agent: agent.clone(),
                },
            ),
            Intent::Release => (
                commands.conversation(id)?,
                Command::Release {
                    target: commands.release_target(),
                },
            ),
            Intent::Message(agent, data) => {
                commands.message_command(id, Some(agent.clone()), data.clone())?
            }
            Intent::Notice(data) => match commands.message_command(id, None, data.clone())? {
                (
                    state,
                    Command::Message {
                        message, partner, ..
                    },
                ) => (state, Command::Notice { message, partner }),
                built => built,
            },
        };
        // Named by what it is, so a repeated delivery that asks for less (an accept folded
        // since) still makes the same ids for the same commands.
        let what = match intent {
            Intent::Accept(_) => "accept".to_owned(),
            Intent::Release => "release".to_owned(),
            Intent::Message(..) | Intent::Notice(_) => {
                parts += 1;
                format!("{}:{parts}", command.name())
            }
        };
        let event_id = model::ids::Internal::Agent.id(format_args!("{id}:chatwoot:{key}:{what}"));
        out.push(Stored {
            event_id,
            state,
            command,
        });
    }
    Ok(out)
}

/// Signed but unreadable: kept in the quarantine (scope `chatwoot`), answered 200.
async fn quarantine(
    hook: &web::Data<ChatwootHook>,
    delivery: &str,
    body: &[u8],
    why: &str,
) -> Result<Verdict, Refusal> {
    let now = hook.store.clock().now_millis();
    let mut record = QuarantineRecord::new("chatwoot", "invalid_chatwoot_payload", why, body, now);
    record.delivery_id = Some(delivery.to_owned());
    record.content_type = Some("application/json".to_owned());
    let store = hook.store.clone();
    let stored = web::block(move || store.quarantine(record)).await;
    // Durable before the 200, by the writer (the one that flushes while it runs).
    let flushed = match &stored {
        Ok(Ok(_)) => hook.commands.flush().await.is_ok(),
        _ => false,
    };
    match stored {
        Ok(Ok(id)) if flushed => {
            hook.metrics.record_quarantined("invalid_chatwoot_payload");
            tracing::warn!(quarantine_id = id, reason = %why, "Chatwoot delivery quarantined");
            Ok(Verdict {
                kind: "malformed",
                verdict: "quarantined",
                answer: Ok(json!({"status": "quarantined", "quarantine_id": id})),
            })
        }
        _ => Err((
            "store",
            ApiError::unavailable("the store cannot take the delivery now; retry"),
        )),
    }
}

fn unauthorized(message: &str) -> ApiError {
    ApiError::new(StatusCode::UNAUTHORIZED, "invalid_signature", message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_of(body: &serde_json::Value) -> String {
        let bytes = body.to_string().into_bytes();
        let p = payload::parse(&bytes).expect("a payload");
        event_key(&p, &bytes)
    }

    #[test]
    fn an_event_is_named_by_its_signed_body_whatever_its_delivery() {
        let reply = json!({
            "event": "message_created", "id": 901, "message_type": "outgoing",
            "conversation": {"id": 57}, "content": "Hello"
        });
        assert_eq!(key_of(&reply), "m901");
        let mut other = reply.clone();
        other["id"] = json!(902);
        assert_ne!(key_of(&other), key_of(&reply));

        // A status change: the conversation, its status and the signed time of the change.
        let resolved = json!({
            "event": "conversation_status_changed", "id": 57, "status": "resolved",
            "updated_at": 1_718_870_043.512_f64, "changed_attributes": null
        });
        assert_eq!(key_of(&resolved), "s57:resolved:1718870043.512");
        let mut reopened = resolved.clone();
        reopened["status"] = json!("open");
        assert_ne!(key_of(&reopened), key_of(&resolved));

        // Two updates whose jobs both ran after the second change show the same conversation:
        // their own changes tell them apart.
        let update = |current: f64| {
            json!({
                "event": "conversation_updated", "id": 57, "status": "open",
                "updated_at": 9.5,
                "changed_attributes": [{"updated_at": {"previous_value": 1.5, "current_value": current}}]
            })
        };
        assert_eq!(key_of(&update(2.5)), "u57:open:2.5");
        assert_ne!(key_of(&update(2.5)), key_of(&update(3.5)));

        // Nothing to name it by (or an id no event id may carry): the body's digest.
        let bare = json!({"event": "conversation_status_changed", "id": 57, "status": "resolved"});
        let named = key_of(&bare);
        assert!(named.starts_with('d') && named.len() == 33, "{named}");
        assert_eq!(key_of(&bare), named);
        let mut odd = reply.clone();
        odd["id"] = json!("has spaces in it");
        assert!(key_of(&odd).starts_with('d'));
    }
}
