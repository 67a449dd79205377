//! The agent API (`/helpdesk/v1`): what a help desk's agents call to see the queue, take a
//! conversation, answer, hand it back, move it, and block or unblock a partner-messenger user.
//!
//! Every mutating call becomes an `agent.<command>` event of its conversation
//! ([`model::webhook::agent`]) accepted through the writer like a webhook delivery, so it is
//! durable, deduped and folded in order with the conversation's own events. The fold decides
//! (an accept raced by another agent's loses there, not in a pre-check that could be stale), its
//! actions go to the outbox in the fold's journal, and the call waits for the verdict and
//! answers from it. The OpenAPI document (`/helpdesk/v1/openapi.json`) is generated from the
//! handlers' annotations and the same [`scope`] that mounts them, so it lists exactly what is
//! served.

use crate::config::helpdesk::HelpdeskConfig;
use crate::helpdesk::commands::{Answer, Built, Commands};
use crate::helpdesk::idempotency;
use crate::intake::auth::{CidrList, TokenSet};
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use api_error::ApiError;
use serde_json::Value;
use std::sync::Arc;

pub mod convert;
pub mod dto;
mod routes;

pub use routes::transcript;

/// Where the API is mounted.
pub const PREFIX: &str = "/helpdesk/v1";

/// The agent API's handler state: who may call it, what its reads need (the store, the Open API
/// for transcripts), and the command path its mutating calls take.
pub struct AgentApi {
    pub tokens: TokenSet,
    /// `helpdesk.allow_cidrs`: who may call at all.
    pub cidrs: CidrList,
    /// `server.trusted_proxies`: who may name the client.
    proxies: crate::client_addr::Proxies,
    body_read_timeout: std::time::Duration,
    /// `helpdesk.transcript_messages`.
    transcript_messages: u32,
    store: storage::Store,
    upstream: upstream::handle::UpstreamHandle,
    commands: Arc<Commands>,
}

/// What the agent API reaches besides its own settings.
pub struct Links {
    pub store: storage::Store,
    pub upstream: upstream::handle::UpstreamHandle,
    pub proxies: crate::client_addr::Proxies,
    pub body_read_timeout: std::time::Duration,
    pub commands: Arc<Commands>,
}

impl AgentApi {
    pub fn new(config: &HelpdeskConfig, reach: Links) -> Self {
        AgentApi {
            tokens: TokenSet::new(config.tokens.clone()),
            cidrs: CidrList::new(config.allow_cidrs.clone()),
            proxies: reach.proxies,
            body_read_timeout: reach.body_read_timeout,
            transcript_messages: config.transcript_messages,
            store: reach.store,
            upstream: reach.upstream,
            commands: reach.commands,
        }
    }
}

/// The API's routes, as a scope both the server and the OpenAPI document are built from.
pub fn scope() -> impl actix_web::dev::HttpServiceFactory + utoipa_actix_web::OpenApiFactory {
    utoipa_actix_web::scope::scope(PREFIX)
        .configure(|cfg| {
            cfg.service(routes::openapi_json)
                .service(routes::list_conversations)
                .service(routes::get_conversation)
                .service(routes::accept)
                .service(routes::send_message)
                .service(routes::release)
                .service(routes::transfer)
                .service(routes::block)
                .service(routes::unblock)
                .service(routes::remove_session);
        })
        .default_service(web::to(unmatched))
}

/// A request under [`PREFIX`] no handler took: 405 with `Allow` when its path is declared (in
/// the document, so with exactly the methods it lists), else 404.
async fn unmatched(req: HttpRequest) -> HttpResponse {
    match allowed_methods(req.path()) {
        Some(allow) => api_error::method_not_allowed_allowing(allow),
        None => api_error::not_found().await,
    }
}

/// The methods the document declares for `path` (a request path, matched against its path
/// templates the way actix routes), as an `Allow` value.
fn allowed_methods(path: &str) -> Option<&'static str> {
    use actix_web::dev::ResourceDef;
    static ROUTES: std::sync::OnceLock<Vec<(ResourceDef, String)>> = std::sync::OnceLock::new();
    let routes = ROUTES.get_or_init(|| {
        let doc = serde_json::to_value(document()).unwrap_or_default();
        let methods = [
            "get", "put", "post", "delete", "options", "head", "patch", "trace",
        ];
        doc["paths"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(template, item)| {
                let allow: Vec<String> = methods
                    .iter()
                    .filter(|m| item.get(**m).is_some())
                    .map(|m| m.to_ascii_uppercase())
                    .collect();
                (ResourceDef::new(template.as_str()), allow.join(", "))
            })
            .collect()
    });
    routes
        .iter()
        .find(|(def, _)| def.is_match(path))
        .map(|(_, allow)| allow.as_str())
}

/// The OpenAPI document of [`scope`].
pub fn document() -> utoipa::openapi::OpenApi {
    use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
    use utoipa_actix_web::OpenApiFactory as _;
    let scope = scope();
    let mut schemas = Vec::new();
    scope.schemas(&mut schemas);
    let mut doc = utoipa::openapi::OpenApiBuilder::new()
        .info(
            utoipa::openapi::InfoBuilder::new()
                .title("handoff-bridge agent API")
                .version(env!("CARGO_PKG_VERSION"))
                .description(Some(
                    "Help-desk agents take, answer, hand back and move conversations. Every \
                     mutating call accepts an Idempotency-Key header.",
                ))
                .build(),
        )
        .paths(scope.paths())
        .build();
    let components = doc
        .components
        .get_or_insert_with(utoipa::openapi::Components::new);
    components.schemas.extend(schemas);
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
    );
    doc.security = Some(vec![utoipa::openapi::security::SecurityRequirement::new(
        "bearer",
        Vec::<String>::new(),
    )]);
    doc
}

/// Authorize, honour the `Idempotency-Key`, read the body, build the command (`build` validates
/// and resolves: the 400s and 404s), store it as an event, wait for its verdict and answer from
/// it. The key is claimed before the body is read, so a second call with it while the first is
/// still sending or waiting gets 409 at once.
async fn run(
    shared: &web::Data<AgentApi>,
    req: &HttpRequest,
    route: &'static str,
    target: &str,
    payload: Option<web::Payload>,
    build: impl FnOnce(&Commands, &[u8]) -> Result<Built, ApiError> + Send + 'static,
) -> HttpResponse {
    if let Err(e) = authorize(shared, req) {
        return respond(e.into(), false);
    }
    let key = match idempotency_key(req) {
        Ok(key) => key,
        Err(e) => return respond(e.into(), false),
    };
    let mut _claim = None;
    if let Some(key) = &key {
        match shared.commands.claim(route, key) {
            Some(c) => _claim = Some(c),
            None => {
                let e = ApiError::new(
                    StatusCode::CONFLICT,
                    "idempotency_key_in_progress",
                    "a call with this Idempotency-Key is being answered; retry later",
                );
                return respond(e.into(), false);
            }
        }
    }
    // The body's share of the in-flight budget, taken once the caller is authenticated, and given
    // back once the body is built into a command (not held while the verdict is awaited).
    let share = match payload {
        Some(_) => match crate::body_budget::admit(req).await {
            Ok(share) => share,
            Err(busy) => return busy,
        },
        None => None,
    };
    let body = match payload {
        Some(p) => match read_body(req, p, MAX_BODY, shared.body_read_timeout).await {
            Ok(b) => b,
            Err(e) => return respond(e.into(), false),
        },
        None => web::Bytes::new(),
    };
    // What was asked, to tell a retry from a reuse of the key for something else.
    let request = format!(
        "{route} {target} {}",
        serde_json::from_slice::<Value>(&body).map_or_else(
            |_| String::from_utf8_lossy(&body).into_owned(),
            |v| v.to_string()
        )
    );
    let built = move |commands: &Commands| build(commands, &body);
    let (answer, replayed) = shared
        .commands
        .answer(route, request, key, share, built)
        .await;
    respond(answer, replayed)
}

/// Longest request body.
pub const MAX_BODY: usize = 64 * 1024;

/// Read the body, at most `limit` bytes, within `timeout` (`server.body_read_timeout`, as
/// the webhook's): a caller that stops sending gets 408 instead of holding the call open. A
/// `Content-Length` over the maximum is refused at once, before any of the body is read.
pub(crate) async fn read_body(
    req: &HttpRequest,
    mut payload: web::Payload,
    limit: usize,
    timeout: std::time::Duration,
) -> Result<web::Bytes, ApiError> {
    use futures_util::StreamExt as _;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the body is over {limit} bytes"),
        )
    };
    let claimed = req
        .headers()
        .get(actix_web::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if claimed.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let read = async {
        let mut body = web::BytesMut::new();
        while let Some(chunk) = payload.next().await {
            let chunk = chunk.map_err(|e| convert::invalid_body("body", e.to_string()))?;
            if body.len() + chunk.len() > limit {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body.freeze())
    };
    tokio::time::timeout(timeout, read).await.map_err(|_| {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "body_timeout",
            "request body was not received in time",
        )
    })?
}

fn respond(answer: Answer, replayed: bool) -> HttpResponse {
    let mut r = HttpResponse::build(answer.status);
    if replayed {
        r.insert_header(("Idempotent-Replayed", "true"));
    }
    r.json(answer.body)
}

fn authorize(shared: &AgentApi, req: &HttpRequest) -> Result<(), ApiError> {
    crate::helpdesk::auth::check_peer(&shared.cidrs, shared.proxies.of_request(req))?;
    let header = req
        .headers()
        .get(actix_web::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    crate::helpdesk::auth::check(&shared.tokens, header)
}

fn idempotency_key(req: &HttpRequest) -> Result<Option<String>, ApiError> {
    let Some(value) = req.headers().get(idempotency::HEADER) else {
        return Ok(None);
    };
    match value.to_str() {
        Ok(k) if idempotency::valid_key(k) => Ok(Some(k.to_owned())),
        _ => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_header",
            format!(
                "Idempotency-Key must be 1 to {} characters of A-Z a-z 0-9 - _ . :",
                idempotency::MAX_KEY_LEN
            ),
        )
        .with_field(idempotency::HEADER)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_lists_every_route_with_its_method() {
        let doc = serde_json::to_value(document()).expect("json");
        let paths = doc["paths"].as_object().expect("paths");
        for (path, method) in [
            ("/helpdesk/v1/openapi.json", "get"),
            ("/helpdesk/v1/conversations", "get"),
            ("/helpdesk/v1/conversations/{id}", "get"),
            ("/helpdesk/v1/conversations/{id}/accept", "post"),
            ("/helpdesk/v1/conversations/{id}/messages", "post"),
            ("/helpdesk/v1/conversations/{id}/release", "post"),
            ("/helpdesk/v1/conversations/{id}/transfer", "post"),
            ("/helpdesk/v1/users/{platform}/{user_key}/block", "post"),
            ("/helpdesk/v1/users/{platform}/{user_key}/unblock", "post"),
            ("/helpdesk/v1/users/{platform}/{user_key}/session", "delete"),
        ] {
            assert!(
                paths.get(path).and_then(|p| p.get(method)).is_some(),
                "{method} {path} missing from {:?}",
                paths.keys().collect::<Vec<_>>()
            );
        }
        assert!(doc["components"]["schemas"]["AcceptBody"].is_object());
    }
}
