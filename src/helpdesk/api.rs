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
use crate::helpdesk::commands::Waiters;
use crate::helpdesk::contract::{self, MAX_TEXT};
use crate::helpdesk::idempotency::{self, InProgress};
use crate::intake::auth::{CidrList, TokenSet};
use actix_web::http::StatusCode;
use actix_web::{delete, get, post, web, HttpRequest, HttpResponse};
use api_error::ApiError;
use engine::state::desk::{DeskPhase, Outcome, Verdict};
use engine::state::ConversationState;
use model::ids::{ConversationId, DeliveryId};
use model::webhook::agent::{AgentCommand, Command, DeskAgent, PartnerUser, Target};
use model::webhook::model::{MessageData, Millis, Platform};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::sync::Arc;
use storage::desk::DeskCursor;
use storage::idempotency::IdempotencyRecord;
use storage::AcceptJob;
use utoipa::{IntoParams, ToSchema};

/// Where the API is mounted.
pub const PREFIX: &str = "/helpdesk/v1";

/// The agent API's handler state: what its handlers read and write (the store, the writer its
/// commands go through, the Open API for transcripts), who may call it, and its settings.
pub struct AgentApi {
    pub tokens: TokenSet,
    /// `helpdesk.allow_cidrs`: who may call at all.
    pub cidrs: CidrList,
    pub config: HelpdeskConfig,
    pub waiters: Arc<Waiters>,
    pub in_progress: Arc<InProgress>,
    store: storage::Store,
    writer: storage::Writer,
    upstream: upstream::handle::UpstreamHandle,
    /// `server.trusted_proxies`: who may name the client.
    proxies: crate::client_addr::Proxies,
    body_read_timeout: std::time::Duration,
}

/// What the agent API reaches besides its own settings.
pub struct Links {
    pub store: storage::Store,
    pub writer: storage::Writer,
    pub upstream: upstream::handle::UpstreamHandle,
    pub proxies: crate::client_addr::Proxies,
    pub body_read_timeout: std::time::Duration,
}

impl AgentApi {
    pub fn new(
        config: HelpdeskConfig,
        waiters: Arc<Waiters>,
        metrics: &crate::ops::metrics::Metrics,
        reach: Links,
    ) -> Self {
        AgentApi {
            tokens: TokenSet::new(config.tokens.clone()),
            cidrs: CidrList::new(config.allow_cidrs.clone()),
            config,
            waiters,
            in_progress: Arc::new(InProgress::with_gauge(
                metrics.helpdesk_calls_in_progress.clone(),
            )),
            store: reach.store,
            writer: reach.writer,
            upstream: reach.upstream,
            proxies: reach.proxies,
            body_read_timeout: reach.body_read_timeout,
        }
    }
}

/// The API's routes, as a scope both the server and the OpenAPI document are built from.
pub fn scope() -> impl actix_web::dev::HttpServiceFactory + utoipa_actix_web::OpenApiFactory {
    utoipa_actix_web::scope::scope(PREFIX)
        .configure(|cfg| {
            cfg.service(openapi_json)
                .service(list_conversations)
                .service(get_conversation)
                .service(accept)
                .service(send_message)
                .service(release)
                .service(transfer)
                .service(block)
                .service(unblock)
                .service(remove_session);
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

// ---- Request and answer bodies ----

// Named `ErrorBody` in the document, as it always was; `AgentError` here, so it is not mistaken
// for the Open API's `model::contract::ErrorBody`. (A doc comment would change the schema's text.)
/// The one error body: `{"error": {"code", "message", "field"?}}`.
#[derive(Serialize, ToSchema)]
#[schema(as = ErrorBody)]
pub struct AgentError {
    pub error: ErrorInner,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorInner {
    /// Stable, for programs.
    pub code: String,
    /// For people.
    pub message: String,
    /// The request field at fault (400 `invalid_body`).
    pub field: Option<String>,
}

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentBody {
    /// The help desk's id of the agent.
    #[schema(schema_with = contract::schema::agent_id)]
    pub id: String,
    pub name: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AcceptBody {
    pub agent: AgentBody,
}

/// An agent's reply: text, media or cards.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MessageBody {
    pub agent: Option<AgentBody>,
    pub message: ReplyMessage,
}

#[derive(Deserialize, Serialize, ToSchema, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ReplyType {
    Text,
    Media,
    Cards,
}

/// Its schema is one shape per `type` ([`contract::schema::reply_message`]), which says what
/// [`message_of`] requires of each.
#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReplyMessage {
    #[serde(rename = "type")]
    pub kind: ReplyType,
    pub text: Option<String>,
    pub media: Option<ReplyMedia>,
    pub cards: Option<Vec<ReplyCard>>,
}

impl utoipa::PartialSchema for ReplyMessage {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        contract::schema::reply_message()
    }
}

impl ToSchema for ReplyMessage {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        use utoipa::PartialSchema as _;
        schemas.push((ReplyMedia::name().into(), ReplyMedia::schema()));
        schemas.push((ReplyCard::name().into(), ReplyCard::schema()));
        schemas.push((ReplyButton::name().into(), ReplyButton::schema()));
        <ReplyCard as ToSchema>::schemas(schemas);
    }
}

#[derive(Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ReplyMedia {
    #[schema(schema_with = contract::schema::media_type)]
    pub content_type: String,
    /// Not blank.
    #[schema(schema_with = contract::schema::non_blank)]
    pub uri: String,
}

#[derive(Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplyCard {
    /// Not blank.
    #[schema(schema_with = contract::schema::card_title)]
    pub title: String,
    #[schema(schema_with = contract::schema::card_description)]
    pub description: Option<String>,
    pub media: Option<ReplyMedia>,
    pub uri: Option<String>,
    #[schema(schema_with = contract::schema::card_buttons)]
    pub buttons: Option<Vec<ReplyButton>>,
}

#[derive(Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplyButton {
    /// Not blank.
    #[schema(schema_with = contract::schema::button_label)]
    pub label: String,
    pub uri: Option<String>,
}

/// Where to send the conversation: a flow by id or by title (`flow`), optionally a node. Its
/// schema ([`contract::schema::flow_target`]) states what [`target_of`] requires.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FlowTarget {
    #[serde(default, deserialize_with = "contract::integral")]
    pub flow_id: Option<i64>,
    pub flow: Option<String>,
    #[serde(default, deserialize_with = "contract::integral")]
    pub node_id: Option<i64>,
}

impl utoipa::PartialSchema for FlowTarget {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        contract::schema::flow_target()
    }
}

impl ToSchema for FlowTarget {}

/// The release call's body: a [`FlowTarget`] or no flow (then `helpdesk.release_flow`). Only a
/// schema: the call parses a [`FlowTarget`].
pub struct ReleaseTarget;

impl utoipa::PartialSchema for ReleaseTarget {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        contract::schema::release_target()
    }
}

impl ToSchema for ReleaseTarget {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        use utoipa::PartialSchema as _;
        schemas.push((FlowTarget::name().into(), FlowTarget::schema()));
    }
}

/// The `Idempotency-Key` header of the mutating calls.
#[derive(IntoParams)]
#[into_params(parameter_in = Header)]
#[allow(dead_code)]
pub struct KeyHeader {
    /// The same key returns the first answer (for the same request; another request with it is
    /// 422 `idempotency_key_reused`).
    #[param(
        rename = "Idempotency-Key",
        schema_with = contract::schema::idempotency_key,
        required = false
    )]
    key: Option<String>,
}

#[derive(Deserialize, Default, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BlockBody {
    pub reason: Option<String>,
}

/// The answer to a mutating call: the command's verdict, once folded.
#[derive(Serialize, ToSchema)]
pub struct CommandAnswer {
    pub conversation_id: String,
    /// `accept`, `message`, `release`, `transfer`, `block`, `unblock`, `remove_session`.
    pub command: String,
    /// The stored `agent.<command>` event (in the conversation's audit timeline).
    pub event_id: String,
    /// `applied`.
    pub status: String,
    /// False for a repeat that had nothing left to do (the same agent accepting again).
    pub changed: bool,
    /// The agent who has the conversation now, if any.
    pub agent: Option<AgentBody>,
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct QueueQuery {
    /// `requested` (default: waiting for an agent), `accepted` (taken through this API),
    /// `connected`, `released`, `cancelled`, `ended`, `bot`, or `all`.
    #[param(schema_with = contract::schema::phase, required = false)]
    pub phase: Option<String>,
    /// Only this bot's conversations.
    pub bot: Option<String>,
    /// At most this many (default 100, 1 to 1000).
    #[param(schema_with = contract::schema::limit, required = false)]
    pub limit: Option<usize>,
    /// The previous page's `next`: the page after it.
    #[param(schema_with = contract::schema::after, required = false)]
    pub after: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub struct QueueItem {
    pub id: String,
    pub bot_id: Option<String>,
    pub platform: Option<String>,
    pub user_key: Option<String>,
    pub end_user_id: Option<String>,
    pub phase: String,
    /// When the user asked for an agent (Unix ms).
    pub requested_at: Option<Millis>,
    /// Seconds since then, while waiting.
    pub wait_seconds: Option<i64>,
    /// 1-based place among the conversations waiting for the same bot, by request time.
    pub position: Option<usize>,
    pub agent: Option<AgentBody>,
    pub accepted_at: Option<Millis>,
}

#[derive(Serialize, ToSchema)]
pub struct QueueAnswer {
    /// In request order (those with no request first), then by id.
    pub conversations: Vec<QueueItem>,
    /// The `after` of the next page; null on the last page. A page may hold fewer than `limit`
    /// conversations and still not be the last.
    pub next: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub struct ConversationAnswer {
    #[serde(flatten)]
    pub summary: QueueItem,
    /// The service's view: manual status, navigation, params, message counters.
    #[schema(value_type = Object)]
    pub state: Value,
    /// The newest messages, read through the Open API (null when it could not be read).
    #[schema(value_type = Option<Vec<Object>>)]
    pub transcript: Option<Value>,
    pub transcript_error: Option<String>,
}

// ---- Handlers ----

/// The OpenAPI document of this API (no token needed).
#[utoipa::path(
    tag = "meta",
    security(()),
    responses((status = 200, description = "OpenAPI 3.1 document", content_type = "application/json"))
)]
#[get("/openapi.json")]
async fn openapi_json() -> HttpResponse {
    static DOC: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let doc = DOC.get_or_init(|| document().to_json().unwrap_or_else(|_| "{}".to_owned()));
    HttpResponse::Ok()
        .content_type("application/json")
        .body(doc.clone())
}

/// The queue: conversations in a phase, in request order, with wait time and position; a page at
/// a time (`next` is the `after` of the page that follows).
#[utoipa::path(
    tag = "conversations",
    params(QueueQuery),
    responses(
        (status = 200, body = QueueAnswer),
        (status = 400, body = AgentError, description = "invalid_query"),
        (status = 401, body = AgentError, description = "unauthorized"),
        (status = 403, body = AgentError, description = "forbidden: the caller's address is outside helpdesk.allow_cidrs"),
        (status = 503, body = AgentError, description = "helpdesk_api_disabled, store_unavailable"),
    )
)]
#[get("/conversations")]
async fn list_conversations(
    shared: web::Data<AgentApi>,
    req: HttpRequest,
    query: web::Query<QueueQuery>,
) -> Result<HttpResponse, ApiError> {
    authorize(&shared, &req)?;
    let q = query.into_inner();
    let phase = q.phase.as_deref().unwrap_or(contract::PHASES[0]);
    let Some(phase) = contract::PhaseQuery::parse(phase) else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_query",
            format!("phase must be one of {}", contract::PHASES.join(", ")),
        )
        .with_field("phase"));
    };
    let limit = q.limit.unwrap_or(contract::LIMIT_DEFAULT);
    if !(contract::LIMIT_MIN..=contract::LIMIT_MAX).contains(&limit) {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_query",
            format!(
                "limit must be {} to {}",
                contract::LIMIT_MIN,
                contract::LIMIT_MAX
            ),
        )
        .with_field("limit"));
    }
    let after = match q.after.as_deref().map(DeskCursor::decode).transpose() {
        Ok(after) => after,
        Err(bad) => {
            return Err(
                ApiError::new(StatusCode::BAD_REQUEST, "invalid_query", bad.to_string())
                    .with_field("after"),
            )
        }
    };
    let store = shared.store.clone();
    let bot = q.bot;
    let (page, positions) = web::block(move || {
        let page = store.desk_page(phase.phase(), bot.as_deref(), after.as_ref(), limit)?;
        let positions = store.waiting_positions(&page.conversations)?;
        Ok::<_, storage::StoreError>((page, positions))
    })
    .await
    .map_err(|_| store_unavailable())?
    .map_err(store_error)?;
    let now = shared.store.clock().now_millis();
    let items: Vec<QueueItem> = page
        .conversations
        .iter()
        .map(|s| summary(s, &positions, now))
        .collect();
    Ok(HttpResponse::Ok().json(QueueAnswer {
        conversations: items,
        next: page.next.map(|c| c.encode()),
    }))
}

/// A conversation: phase, agent, state and recent transcript.
#[utoipa::path(
    tag = "conversations",
    params(("id" = String, Path, description = "conversation id", min_length = 1)),
    responses(
        (status = 200, body = ConversationAnswer),
        (status = 401, body = AgentError, description = "unauthorized"),
        (status = 403, body = AgentError, description = "forbidden: the caller's address is outside helpdesk.allow_cidrs"),
        (status = 404, body = AgentError, description = "conversation_not_found"),
        (status = 503, body = AgentError, description = "helpdesk_api_disabled, store_unavailable"),
    )
)]
#[get("/conversations/{id}")]
async fn get_conversation(
    shared: web::Data<AgentApi>,
    req: HttpRequest,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    authorize(&shared, &req)?;
    let id = id.into_inner();
    let (state, positions) = blocking(&shared, move |shared| {
        let state = conversation(shared, &id)?;
        let positions = shared
            .store
            .waiting_positions(std::slice::from_ref(&state))
            .map_err(store_error)?;
        Ok((state, positions))
    })
    .await?;
    let now = shared.store.clock().now_millis();
    let summary = summary(&state, &positions, now);
    let (transcript, transcript_error) = match shared.config.transcript_messages {
        0 => (None, None),
        n => match transcript(&shared, state.id.as_str(), n).await {
            Ok(messages) => (Some(messages), None),
            Err(e) => (None, Some(e.to_string())),
        },
    };
    Ok(HttpResponse::Ok().json(ConversationAnswer {
        summary,
        state: json!({
            "manual_status": state.manual_status.value,
            "handoff_phase": state.handoff.phase.value,
            "navigation": state.navigation.value,
            "params": state.params.value,
            "messages": state.messages,
            "labels": state.labels,
            "desk": state.desk,
        }),
        transcript,
        transcript_error,
    }))
}

/// An agent takes the conversation: the agent is recorded and manual mode turned on.
#[utoipa::path(
    tag = "commands",
    params(
        ("id" = String, Path, description = "conversation id", min_length = 1),
        KeyHeader,
    ),
    request_body = AcceptBody,
    responses(
        (status = 200, body = CommandAnswer),
        (status = 400, body = AgentError, description = "invalid_body (with field), invalid_header"),
        (status = 401, body = AgentError, description = "unauthorized"),
        (status = 403, body = AgentError, description = "forbidden: the caller's address is outside helpdesk.allow_cidrs"),
        (status = 404, body = AgentError, description = "conversation_not_found"),
        (status = 409, body = AgentError, description = "command_already_applied, already_accepted (by another agent), idempotency_key_in_progress"),
        (status = 408, body = AgentError, description = "body_timeout: the body did not arrive within server.body_read_timeout"),
        (status = 413, body = AgentError, description = "payload_too_large: a body over 64 KiB"),
        (status = 422, body = AgentError, description = "idempotency_key_reused"),
        (status = 503, body = AgentError, description = "helpdesk_api_disabled, store_unavailable, too_many_pending"),
        (status = 504, body = AgentError, description = "command_pending: stored, not yet applied; retry with the same key"),
    )
)]
#[post("/conversations/{id}/accept")]
async fn accept(
    shared: web::Data<AgentApi>,
    req: HttpRequest,
    id: web::Path<String>,
    body: web::Payload,
) -> HttpResponse {
    let id = id.into_inner();
    run(
        &shared,
        &req,
        "accept",
        &id.clone(),
        Some(body),
        move |shared, body| {
            let b: AcceptBody = parse_body(body, false)?;
            let agent = agent_of(b.agent, "agent")?;
            let state = conversation(shared, &id)?;
            Ok((state, Command::Accept { agent }))
        },
    )
    .await
}

/// An agent's reply: through the partner messenger's send-message endpoint for partner-messenger
/// users, otherwise into the conversation.
#[utoipa::path(
    tag = "commands",
    params(
        ("id" = String, Path, description = "conversation id", min_length = 1),
        KeyHeader,
    ),
    request_body = MessageBody,
    responses(
        (status = 200, body = CommandAnswer),
        (status = 400, body = AgentError, description = "invalid_body (with field), invalid_header"),
        (status = 401, body = AgentError, description = "unauthorized"),
        (status = 403, body = AgentError, description = "forbidden: the caller's address is outside helpdesk.allow_cidrs"),
        (status = 404, body = AgentError, description = "conversation_not_found"),
        (status = 409, body = AgentError, description = "command_already_applied, not_with_agent, idempotency_key_in_progress"),
        (status = 408, body = AgentError, description = "body_timeout: the body did not arrive within server.body_read_timeout"),
        (status = 413, body = AgentError, description = "payload_too_large: a body over 64 KiB"),
        (status = 422, body = AgentError, description = "idempotency_key_reused, no_partner_channel"),
        (status = 503, body = AgentError, description = "helpdesk_api_disabled, store_unavailable, too_many_pending"),
        (status = 504, body = AgentError, description = "command_pending"),
    )
)]
#[post("/conversations/{id}/messages")]
async fn send_message(
    shared: web::Data<AgentApi>,
    req: HttpRequest,
    id: web::Path<String>,
    body: web::Payload,
) -> HttpResponse {
    let id = id.into_inner();
    run(
        &shared,
        &req,
        "message",
        &id.clone(),
        Some(body),
        move |shared, body| {
            let b: MessageBody = parse_body(body, false)?;
            let agent = b.agent.map(|a| agent_of(a, "agent")).transpose()?;
            let message = message_of(b.message)?;
            message_command(shared, &id, agent, message)
        },
    )
    .await
}

/// Hand back to the bot: manual mode off, and to `flow_id`/`flow` (else `helpdesk.release_flow`).
#[utoipa::path(
    tag = "commands",
    params(
        ("id" = String, Path, description = "conversation id", min_length = 1),
        KeyHeader,
    ),
    request_body(content = Option<ReleaseTarget>, description = "optional: where the bot picks up"),
    responses(
        (status = 200, body = CommandAnswer),
        (status = 400, body = AgentError, description = "invalid_body (with field), invalid_header"),
        (status = 401, body = AgentError, description = "unauthorized"),
        (status = 403, body = AgentError, description = "forbidden: the caller's address is outside helpdesk.allow_cidrs"),
        (status = 404, body = AgentError, description = "conversation_not_found"),
        (status = 409, body = AgentError, description = "command_already_applied, not_with_agent, idempotency_key_in_progress"),
        (status = 408, body = AgentError, description = "body_timeout: the body did not arrive within server.body_read_timeout"),
        (status = 413, body = AgentError, description = "payload_too_large: a body over 64 KiB"),
        (status = 422, body = AgentError, description = "idempotency_key_reused"),
        (status = 503, body = AgentError, description = "helpdesk_api_disabled, store_unavailable, too_many_pending"),
        (status = 504, body = AgentError, description = "command_pending"),
    )
)]
#[post("/conversations/{id}/release")]
async fn release(
    shared: web::Data<AgentApi>,
    req: HttpRequest,
    id: web::Path<String>,
    body: web::Payload,
) -> HttpResponse {
    let id = id.into_inner();
    run(
        &shared,
        &req,
        "release",
        &id.clone(),
        Some(body),
        move |shared, body| {
            let b: FlowTarget = parse_body(body, true)?;
            let mut target = target_of(b)?;
            if !target.is_some() {
                target = configured_release(&shared.config.release_flow);
            }
            let state = conversation(shared, &id)?;
            Ok((state, Command::Release { target }))
        },
    )
    .await
}

/// Move the conversation to a flow (manual mode and the agent stay as they are).
#[utoipa::path(
    tag = "commands",
    params(
        ("id" = String, Path, description = "conversation id", min_length = 1),
        KeyHeader,
    ),
    request_body = FlowTarget,
    responses(
        (status = 200, body = CommandAnswer),
        (status = 400, body = AgentError, description = "invalid_body (with field), invalid_header"),
        (status = 401, body = AgentError, description = "unauthorized"),
        (status = 403, body = AgentError, description = "forbidden: the caller's address is outside helpdesk.allow_cidrs"),
        (status = 404, body = AgentError, description = "conversation_not_found"),
        (status = 409, body = AgentError, description = "command_already_applied, idempotency_key_in_progress"),
        (status = 408, body = AgentError, description = "body_timeout: the body did not arrive within server.body_read_timeout"),
        (status = 413, body = AgentError, description = "payload_too_large: a body over 64 KiB"),
        (status = 422, body = AgentError, description = "idempotency_key_reused"),
        (status = 503, body = AgentError, description = "helpdesk_api_disabled, store_unavailable, too_many_pending"),
        (status = 504, body = AgentError, description = "command_pending"),
    )
)]
#[post("/conversations/{id}/transfer")]
async fn transfer(
    shared: web::Data<AgentApi>,
    req: HttpRequest,
    id: web::Path<String>,
    body: web::Payload,
) -> HttpResponse {
    let id = id.into_inner();
    run(
        &shared,
        &req,
        "transfer",
        &id.clone(),
        Some(body),
        move |shared, body| {
            let b: FlowTarget = parse_body(body, false)?;
            let target = target_of(b)?;
            if !target.is_some() {
                return Err(invalid_body("flow_id", "flow_id or flow is required"));
            }
            let state = conversation(shared, &id)?;
            Ok((state, Command::Transfer { target }))
        },
    )
    .await
}

/// Block a partner-messenger user (their channel from `helpdesk.partner`).
#[utoipa::path(
    tag = "users",
    params(
        ("platform" = String, Path, description = "the user's platform (the partner messenger's: kakaobiz)", min_length = 1),
        ("user_key" = String, Path, description = "the user's userKey", min_length = 1),
        KeyHeader,
    ),
    request_body(content = Option<BlockBody>),
    responses(
        (status = 200, body = CommandAnswer),
        (status = 400, body = AgentError, description = "invalid_body (with field), invalid_header"),
        (status = 401, body = AgentError, description = "unauthorized"),
        (status = 403, body = AgentError, description = "forbidden: the caller's address is outside helpdesk.allow_cidrs"),
        (status = 404, body = AgentError, description = "user_not_found"),
        (status = 409, body = AgentError, description = "command_already_applied, not_partner_messenger, idempotency_key_in_progress"),
        (status = 408, body = AgentError, description = "body_timeout: the body did not arrive within server.body_read_timeout"),
        (status = 413, body = AgentError, description = "payload_too_large: a body over 64 KiB"),
        (status = 422, body = AgentError, description = "idempotency_key_reused, no_partner_channel"),
        (status = 503, body = AgentError, description = "helpdesk_api_disabled, store_unavailable, too_many_pending"),
        (status = 504, body = AgentError, description = "command_pending"),
    )
)]
#[post("/users/{platform}/{user_key}/block")]
async fn block(
    shared: web::Data<AgentApi>,
    req: HttpRequest,
    path: web::Path<(String, String)>,
    body: web::Payload,
) -> HttpResponse {
    let (platform, user_key) = path.into_inner();
    let route_id = format!("{platform}/{user_key}");
    run(
        &shared,
        &req,
        "block",
        &route_id,
        Some(body),
        move |shared, body| {
            let b: BlockBody = parse_body(body, true)?;
            let (state, partner) = partner_user(shared, &platform, &user_key)?;
            Ok((
                state,
                Command::Block {
                    partner,
                    reason: b.reason,
                },
            ))
        },
    )
    .await
}

/// Unblock a partner-messenger user.
#[utoipa::path(
    tag = "users",
    params(
        ("platform" = String, Path, description = "the user's platform (kakaobiz)", min_length = 1),
        ("user_key" = String, Path, description = "the user's userKey", min_length = 1),
        KeyHeader,
    ),
    responses(
        (status = 200, body = CommandAnswer),
        (status = 400, body = AgentError, description = "invalid_header"),
        (status = 401, body = AgentError, description = "unauthorized"),
        (status = 403, body = AgentError, description = "forbidden: the caller's address is outside helpdesk.allow_cidrs"),
        (status = 404, body = AgentError, description = "user_not_found"),
        (status = 409, body = AgentError, description = "command_already_applied, not_partner_messenger, idempotency_key_in_progress"),
        (status = 422, body = AgentError, description = "idempotency_key_reused, no_partner_channel"),
        (status = 503, body = AgentError, description = "helpdesk_api_disabled, store_unavailable, too_many_pending"),
        (status = 504, body = AgentError, description = "command_pending"),
    )
)]
#[post("/users/{platform}/{user_key}/unblock")]
async fn unblock(
    shared: web::Data<AgentApi>,
    req: HttpRequest,
    path: web::Path<(String, String)>,
) -> HttpResponse {
    let (platform, user_key) = path.into_inner();
    let route_id = format!("{platform}/{user_key}");
    run(
        &shared,
        &req,
        "unblock",
        &route_id,
        None,
        move |shared, _| {
            let (state, partner) = partner_user(shared, &platform, &user_key)?;
            Ok((state, Command::Unblock { partner }))
        },
    )
    .await
}

/// End a partner-messenger user's counseling session.
#[utoipa::path(
    tag = "users",
    params(
        ("platform" = String, Path, description = "the user's platform (kakaobiz)", min_length = 1),
        ("user_key" = String, Path, description = "the user's userKey", min_length = 1),
        KeyHeader,
    ),
    responses(
        (status = 200, body = CommandAnswer),
        (status = 400, body = AgentError, description = "invalid_header"),
        (status = 401, body = AgentError, description = "unauthorized"),
        (status = 403, body = AgentError, description = "forbidden: the caller's address is outside helpdesk.allow_cidrs"),
        (status = 404, body = AgentError, description = "user_not_found"),
        (status = 409, body = AgentError, description = "command_already_applied, not_partner_messenger, idempotency_key_in_progress"),
        (status = 422, body = AgentError, description = "idempotency_key_reused, no_partner_channel"),
        (status = 503, body = AgentError, description = "helpdesk_api_disabled, store_unavailable, too_many_pending"),
        (status = 504, body = AgentError, description = "command_pending"),
    )
)]
#[delete("/users/{platform}/{user_key}/session")]
async fn remove_session(
    shared: web::Data<AgentApi>,
    req: HttpRequest,
    path: web::Path<(String, String)>,
) -> HttpResponse {
    let (platform, user_key) = path.into_inner();
    let route_id = format!("{platform}/{user_key}");
    run(
        &shared,
        &req,
        "remove_session",
        &route_id,
        None,
        move |shared, _| {
            let (state, partner) = partner_user(shared, &platform, &user_key)?;
            Ok((state, Command::RemoveSession { partner }))
        },
    )
    .await
}

/// The newest `n` messages of a conversation, oldest first. The Open API lists oldest first, so
/// a longer conversation takes a second call at the offset of its last `n`.
pub(crate) async fn transcript(
    shared: &AgentApi,
    conversation: &str,
    n: u32,
) -> Result<Value, upstream::error::UpstreamError> {
    use model::contract::{MessagesQuery, PageQuery};
    let api = upstream::api::OpenApi::new(shared.upstream.clone());
    let query = |offset| MessagesQuery {
        page: PageQuery {
            offset: Some(offset),
            limit: Some(n),
        },
        conversation_id: Some(conversation.to_owned()),
        ..Default::default()
    };
    let mut page = api.list_messages(&query(0)).await?;
    if page.paging.total > u64::from(n) {
        let offset = u32::try_from(page.paging.total - u64::from(n)).unwrap_or(u32::MAX);
        page = api.list_messages(&query(offset)).await?;
    }
    Ok(json!(page.data))
}

// ---- The path of a mutating call ----

/// An answer, as sent and as kept for idempotent retries.
struct Answer {
    status: StatusCode,
    body: Value,
}

impl From<ApiError> for Answer {
    fn from(e: ApiError) -> Self {
        Answer {
            status: e.status,
            body: e.body(),
        }
    }
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
    build: impl FnOnce(&AgentApi, &[u8]) -> Result<(ConversationState, Command), ApiError>
        + Send
        + 'static,
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
        match shared.in_progress.claim(route, key) {
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
        Some(p) => match read_body(req, p, shared.body_read_timeout).await {
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
    let built = move |shared: &AgentApi| build(shared, &body);
    let (answer, replayed) = answer_command(shared, route, request, key, share, built).await;
    respond(answer, replayed)
}

/// What an operator asks of a conversation from the console (as `agent`, the name they signed in
/// with, or another they typed).
pub(crate) enum ConsoleCommand {
    Accept { agent: String },
    Reply { agent: String, text: String },
    Release,
    Transfer { flow_id: i64 },
}

impl ConsoleCommand {
    /// Its route, as the agent API names it (the idempotency records are kept per route).
    pub(crate) fn route(&self) -> &'static str {
        match self {
            ConsoleCommand::Accept { .. } => "accept",
            ConsoleCommand::Reply { .. } => "message",
            ConsoleCommand::Release => "release",
            ConsoleCommand::Transfer { .. } => "transfer",
        }
    }

    /// The command, checked as the agent API checks its bodies.
    fn build(self, shared: &AgentApi, id: &str) -> Result<(ConversationState, Command), ApiError> {
        let agent_named = |name: String| {
            let body = AgentBody {
                id: name.clone(),
                name: Some(name),
            };
            agent_of(body, "agent")
        };
        let command = match self {
            ConsoleCommand::Accept { agent } => Command::Accept {
                agent: agent_named(agent)?,
            },
            ConsoleCommand::Reply { agent, text } => {
                let message = message_of(ReplyMessage {
                    kind: ReplyType::Text,
                    text: Some(text),
                    media: None,
                    cards: None,
                })?;
                return message_command(shared, id, Some(agent_named(agent)?), message);
            }
            ConsoleCommand::Release => Command::Release {
                target: configured_release(&shared.config.release_flow),
            },
            ConsoleCommand::Transfer { flow_id } => Command::Transfer {
                target: target_of(FlowTarget {
                    flow_id: Some(flow_id),
                    flow: None,
                    node_id: None,
                })?,
            },
        };
        Ok((conversation(shared, id)?, command))
    }
}

/// A command from the console: the agent API's path after its HTTP (the same claim of `key`,
/// idempotent answer, event, fold, verdict and answer), keyed by the form it came from, so a
/// form sent twice is one command. Returns the status and body the agent API would answer, and
/// whether this was a repeated form's (answered from the first).
pub(crate) async fn console_command(
    shared: &web::Data<AgentApi>,
    conversation_id: String,
    command: ConsoleCommand,
    key: String,
) -> (StatusCode, Value, bool) {
    let route = command.route();
    let Some(_claim) = shared.in_progress.claim(route, &key) else {
        let e = ApiError::new(
            StatusCode::CONFLICT,
            "idempotency_key_in_progress",
            "this form is being answered already",
        );
        return (e.status, e.body(), false);
    };
    let request = format!("{route} {conversation_id} console");
    let build = move |shared: &AgentApi| command.build(shared, &conversation_id);
    let (answer, replayed) = answer_command(shared, route, request, Some(key), None, build).await;
    (answer.status, answer.body, replayed)
}

/// Answer a command: the answer kept for `key` when this is a retry, else build it (`build`
/// validates and resolves: the 400s and 404s), store it as an event, wait for its verdict and
/// keep the answer for `key`. Returns the answer and whether it was a retry's.
async fn answer_command(
    shared: &web::Data<AgentApi>,
    route: &'static str,
    request: String,
    key: Option<String>,
    share: Option<crate::body_budget::Share>,
    build: impl FnOnce(&AgentApi) -> Result<(ConversationState, Command), ApiError> + Send + 'static,
) -> (Answer, bool) {
    if let Some(key) = key.clone() {
        let first = blocking(shared, move |shared| {
            shared
                .store
                .idempotent_answer(route, &key)
                .map_err(store_error)
        })
        .await;
        match first {
            Ok(Some(first)) if first.request == request => {
                let status =
                    StatusCode::from_u16(first.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                return (
                    Answer {
                        status,
                        body: first.body,
                    },
                    true,
                );
            }
            Ok(Some(_)) => {
                let e = ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "idempotency_key_reused",
                    "this Idempotency-Key was used for a different request",
                );
                return (e.into(), false);
            }
            Ok(None) => {}
            Err(e) => return (e.into(), false),
        }
    }
    // Only a command that was stored has an answer to keep: a refusal before that (bad body,
    // unknown conversation, no channel) took no effect, and a retry is judged again, against
    // what may have changed since.
    let built = blocking(shared, move |shared| build(shared)).await;
    drop(share);
    let (answer, submitted) = match built {
        Ok((state, command)) => (
            submit(shared, route, key.as_deref(), state, command).await,
            true,
        ),
        Err(e) => (e.into(), false),
    };
    if let (Some(key), true) = (&key, submitted && answer.status.as_u16() < 500) {
        let record = IdempotencyRecord {
            request,
            status: answer.status.as_u16(),
            body: answer.body.clone(),
            at: shared.store.clock().now_millis(),
        };
        let key = key.clone();
        let recorded = blocking(shared, move |shared| {
            shared
                .store
                .record_idempotent_answer(route, &key, &record)
                .map_err(store_error)
        })
        .await;
        if let Err(e) = recorded {
            // The command itself is stored: a retry becomes a duplicate event and is answered
            // from its recorded verdict, so the call still succeeded.
            tracing::warn!(error = %e, route, "cannot record an idempotent answer");
        }
    }
    (answer, false)
}

/// Longest request body.
pub const MAX_BODY: usize = 64 * 1024;

/// Read the body, at most [`MAX_BODY`] bytes, within `timeout` (`server.body_read_timeout`, as
/// the webhook's): a caller that stops sending gets 408 instead of holding the call open. A
/// `Content-Length` over the maximum is refused at once, before any of the body is read.
async fn read_body(
    req: &HttpRequest,
    mut payload: web::Payload,
    timeout: std::time::Duration,
) -> Result<web::Bytes, ApiError> {
    use futures_util::StreamExt as _;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the body is over {MAX_BODY} bytes"),
        )
    };
    let claimed = req
        .headers()
        .get(actix_web::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if claimed.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(too_large());
    }
    let read = async {
        let mut body = web::BytesMut::new();
        while let Some(chunk) = payload.next().await {
            let chunk = chunk.map_err(|e| invalid_body("body", e.to_string()))?;
            if body.len() + chunk.len() > MAX_BODY {
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

/// Run `f`, which uses the store (sled), on the blocking pool, off the HTTP workers (as the
/// webhook's path does): a slow sled call then never stalls other connections.
async fn blocking<T: Send + 'static>(
    shared: &web::Data<AgentApi>,
    f: impl FnOnce(&AgentApi) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let shared = shared.clone();
    web::block(move || f(&shared))
        .await
        .map_err(|_| store_unavailable())?
}

fn respond(answer: Answer, replayed: bool) -> HttpResponse {
    let mut r = HttpResponse::build(answer.status);
    if replayed {
        r.insert_header(("Idempotent-Replayed", "true"));
    }
    r.json(answer.body)
}

/// Store the command as an event of its conversation and answer from the fold's verdict.
async fn submit(
    shared: &web::Data<AgentApi>,
    route: &str,
    key: Option<&str>,
    state: ConversationState,
    command: Command,
) -> Answer {
    let conversation = state.id.clone();
    let event_id = match key {
        // Deterministic: a retry after a lost answer (or a crash) is a duplicate event.
        Some(k) => model::ids::Internal::Agent.id(format_args!("{conversation}:{route}:{k}")),
        None => {
            use rand::distr::{Alphanumeric, SampleString};
            let nonce = Alphanumeric.sample_string(&mut rand::rng(), 24);
            model::ids::Internal::Agent.id(format_args!("{conversation}:{route}:{nonce}"))
        }
    };
    let cmd = AgentCommand {
        conversation_id: conversation.clone(),
        command,
    };
    let bot = bot_of(&state).unwrap_or("bridge").to_owned();
    let now = shared.store.clock().now_millis();
    let event = match model::webhook::agent_event(&cmd, &event_id, &bot, now) {
        Ok(e) => e,
        Err(e) => {
            tracing::error!(error = %e, "agent command does not make a valid event");
            return ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                "the command could not be stored",
            )
            .into();
        }
    };
    let Some(mut waiter) = shared.waiters.register(&event_id) else {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_pending",
            "too many agent commands are waiting to be applied; retry later",
        )
        .into();
    };
    let job = AcceptJob {
        delivery: DeliveryId::new(event_id.as_str()),
        events: vec![event],
        invalid: Vec::new(),
        received_at: now,
    };
    let accepted = match shared.writer.accept(job).await {
        Ok(a) => a,
        Err(e) => {
            tracing::error!(error = %e, "cannot store an agent command");
            return store_unavailable().into();
        }
    };
    if accepted.new.is_empty() {
        // Stored before (a retry whose first answer was lost): its verdict may be recorded.
        // If not, either the command still waits in the inbox (a restart came between; its
        // fold will answer the waiter), or it was applied so long ago that its verdict is gone,
        // and waiting could only end in a timeout.
        let (id, eid) = (conversation.clone(), event_id.clone());
        let found = blocking(shared, move |shared| {
            // The mark first: a fold writes its states before its marks, so once the event reads
            // as folded its verdict is there to read (a fold may be half applied meanwhile).
            let pending = still_pending(&*shared.store, &eid).map_err(store_error)?;
            let state = shared.store.conversation(&id).map_err(store_error)?;
            if let Some(s) = state.filter(|s| s.desk.verdict(&eid).is_some()) {
                return Ok(Err(s));
            }
            Ok(Ok(pending))
        })
        .await;
        match found {
            Ok(Err(s)) => {
                if let Some(v) = s.desk.verdict(&event_id) {
                    return verdict_answer(v, &s);
                }
            }
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => {
                return ApiError::new(
                    StatusCode::CONFLICT,
                    "command_already_applied",
                    format!(
                        "this command (event {event_id}) was applied earlier and its answer is \
                         no longer kept; read the conversation for its state"
                    ),
                )
                .into()
            }
            Err(e) => return e.into(),
        }
    }
    match waiter.wait(shared.config.command_timeout).await {
        Some(v) => {
            let id = conversation.clone();
            let state = blocking(shared, move |shared| {
                shared.store.conversation(&id).map_err(store_error)
            })
            .await;
            match state {
                Ok(Some(s)) => verdict_answer(&v, &s),
                Ok(None) => store_unavailable().into(),
                Err(e) => e.into(),
            }
        }
        None => ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "command_pending",
            format!(
                "the command is stored as event {event_id} but not applied yet; retry with the \
                 same Idempotency-Key for its answer"
            ),
        )
        .into(),
    }
}

/// Whether the stored event `event_id` is still to fold.
fn still_pending(
    store: &dyn storage::Storage,
    event_id: &str,
) -> Result<bool, storage::StoreError> {
    let status = store.event_status(&model::ids::EventId::new(event_id))?;
    Ok(status.is_some_and(|(_, pending)| pending))
}

fn verdict_answer(v: &Verdict, state: &ConversationState) -> Answer {
    match &v.outcome {
        Outcome::Applied { changed } => Answer {
            status: StatusCode::OK,
            body: json!(CommandAnswer {
                conversation_id: state.id.as_str().to_owned(),
                command: v.command.clone(),
                event_id: v.event_id.clone(),
                status: "applied".into(),
                changed: *changed,
                agent: state.desk.agent.as_ref().map(agent_body),
            }),
        },
        Outcome::Rejected { reason } => {
            let message = match reason {
                engine::state::desk::Rejection::AlreadyAccepted => format!(
                    "accepted by another agent ({})",
                    state.desk.agent.as_ref().map_or("?", |a| a.id.as_str())
                ),
                engine::state::desk::Rejection::NotWithAgent => {
                    "no agent has accepted this conversation".to_owned()
                }
            };
            ApiError::new(StatusCode::CONFLICT, reason.code(), message).into()
        }
    }
}

// ---- Helpers ----

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

fn invalid_body(field: &str, reason: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "invalid_body", reason).with_field(field)
}

/// Parse a JSON body; `optional` bodies may be empty or `null`. A serde error names its field when it
/// can (missing and unknown fields); other errors blame the body as a whole.
fn parse_body<T: serde::de::DeserializeOwned + Default>(
    body: &[u8],
    optional: bool,
) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return if optional {
            Ok(T::default())
        } else {
            Err(invalid_body("body", "a JSON body is required"))
        };
    }
    let parsed = if optional {
        // An optional body may also be JSON `null` (the document's `oneOf: [null, ...]`).
        serde_json::from_slice::<Option<T>>(body).map(Option::unwrap_or_default)
    } else {
        serde_json::from_slice(body)
    };
    parsed.map_err(|e| {
        let text = e.to_string();
        let field = text
            .split('`')
            .nth(1)
            .filter(|_| text.starts_with("missing field") || text.starts_with("unknown field"))
            .unwrap_or("body")
            .to_owned();
        invalid_body(&field, text)
    })
}

fn agent_of(a: AgentBody, at: &str) -> Result<DeskAgent, ApiError> {
    if !contract::valid_agent_id(&a.id) {
        return Err(invalid_body(
            &format!("{at}.id"),
            format!(
                "must be 1 to {} characters, not blank",
                contract::MAX_AGENT_ID
            ),
        ));
    }
    Ok(DeskAgent {
        id: a.id,
        name: a.name.filter(|n| !n.is_empty()),
    })
}

/// Check a reply against the service's rules (those [`contract::schema::reply_message`] states)
/// and turn it into the service's message format.
fn message_of(m: ReplyMessage) -> Result<MessageData, ApiError> {
    use contract::{non_blank_within, within};
    let media = |at: &str, m: &ReplyMedia| {
        if !contract::MEDIA_TYPES.contains(&m.content_type.as_str()) {
            return Err(invalid_body(
                &format!("{at}.contentType"),
                format!("must be one of {}", contract::MEDIA_TYPES.join(", ")),
            ));
        }
        if contract::blank(&m.uri) {
            return Err(invalid_body(&format!("{at}.uri"), "must not be blank"));
        }
        Ok(())
    };
    // Every content present is checked, whatever the type.
    if m.text.as_deref().is_some_and(|t| !within(t, MAX_TEXT)) {
        return Err(invalid_body(
            "message.text",
            format!("at most {MAX_TEXT} characters"),
        ));
    }
    if let Some(m) = &m.media {
        media("message.media", m)?;
    }
    let cards = m.cards.as_deref().unwrap_or_default();
    if cards.len() > contract::MAX_CARDS {
        return Err(invalid_body(
            "message.cards",
            format!("at most {} cards", contract::MAX_CARDS),
        ));
    }
    for (i, card) in cards.iter().enumerate() {
        let at = format!("message.cards[{i}]");
        if !non_blank_within(&card.title, contract::MAX_CARD_TITLE) {
            return Err(invalid_body(
                &format!("{at}.title"),
                format!(
                    "a card needs a title of 1 to {} characters, not blank",
                    contract::MAX_CARD_TITLE
                ),
            ));
        }
        if let Some(d) = card
            .description
            .as_deref()
            .filter(|d| !within(d, contract::MAX_CARD_DESCRIPTION))
        {
            return Err(invalid_body(
                &format!("{at}.description"),
                format!(
                    "at most {} characters, not {}",
                    contract::MAX_CARD_DESCRIPTION,
                    d.chars().count()
                ),
            ));
        }
        if let Some(m) = &card.media {
            media(&format!("{at}.media"), m)?;
        }
        let buttons = card.buttons.as_deref().unwrap_or_default();
        if buttons.len() > contract::MAX_BUTTONS {
            return Err(invalid_body(
                &format!("{at}.buttons"),
                format!("at most {} buttons", contract::MAX_BUTTONS),
            ));
        }
        if let Some(j) = buttons
            .iter()
            .position(|b| !non_blank_within(&b.label, contract::MAX_LABEL))
        {
            return Err(invalid_body(
                &format!("{at}.buttons[{j}].label"),
                format!(
                    "a button needs a label of 1 to {} characters, not blank",
                    contract::MAX_LABEL
                ),
            ));
        }
    }
    match m.kind {
        ReplyType::Text => {
            if m.text.as_deref().is_none_or(contract::blank) {
                return Err(invalid_body(
                    "message.text",
                    format!("a text message needs 1 to {MAX_TEXT} characters of text"),
                ));
            }
        }
        ReplyType::Media => {
            if m.media.is_none() {
                return Err(invalid_body(
                    "message.media",
                    "a media message needs media with contentType and uri",
                ));
            }
        }
        ReplyType::Cards => {
            if cards.is_empty() {
                return Err(invalid_body(
                    "message.cards",
                    "a cards message needs at least one card",
                ));
            }
        }
    }
    let value = serde_json::to_value(&m).map_err(|e| invalid_body("message", e.to_string()))?;
    serde_json::from_value(value).map_err(|e| invalid_body("message", e.to_string()))
}

impl Default for AcceptBody {
    fn default() -> Self {
        AcceptBody {
            agent: AgentBody {
                id: String::new(),
                name: None,
            },
        }
    }
}

impl Default for MessageBody {
    fn default() -> Self {
        MessageBody {
            agent: None,
            message: ReplyMessage {
                kind: ReplyType::Text,
                text: None,
                media: None,
                cards: None,
            },
        }
    }
}

fn target_of(b: FlowTarget) -> Result<Target, ApiError> {
    if b.flow_id.is_some() && b.flow.is_some() {
        return Err(invalid_body("flow", "give flow_id or flow, not both"));
    }
    if b.flow.as_deref().is_some_and(contract::blank) {
        return Err(invalid_body("flow", "a flow title must not be empty"));
    }
    if b.node_id.is_some() && b.flow_id.is_none() && b.flow.is_none() {
        return Err(invalid_body("node_id", "a node needs its flow_id or flow"));
    }
    Ok(Target {
        flow_id: b.flow_id,
        flow: b.flow,
        node_id: b.node_id,
    })
}

/// `helpdesk.release_flow`: digits are a flow id, anything else a title, empty nothing.
fn configured_release(flow: &str) -> Target {
    let flow = flow.trim();
    match flow.parse::<i64>() {
        _ if flow.is_empty() => Target::default(),
        Ok(id) => Target {
            flow_id: Some(id),
            ..Target::default()
        },
        Err(_) => Target {
            flow: Some(flow.to_owned()),
            ..Target::default()
        },
    }
}

fn conversation(shared: &AgentApi, id: &str) -> Result<ConversationState, ApiError> {
    let id = ConversationId::new(id);
    match shared.store.conversation(&id).map_err(store_error)? {
        Some(s) if s.deleted_at.is_none() => Ok(s),
        _ => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "conversation_not_found",
            format!("no conversation {id}"),
        )),
    }
}

/// A message to send in conversation `id` as `agent`, through its partner channel when it is
/// on one (KakaoTalk counseling): the agent API's and the console's replies.
fn message_command(
    shared: &AgentApi,
    id: &str,
    agent: Option<DeskAgent>,
    message: MessageData,
) -> Result<(ConversationState, Command), ApiError> {
    let state = conversation(shared, id)?;
    let partner = match state.platform {
        Some(Platform::Kakaobiz) => Some(partner_of(shared, &state)?),
        _ => None,
    };
    let command = Command::Message {
        agent,
        message: Box::new(message),
        partner,
    };
    Ok((state, command))
}

/// The partner channel of a conversation's bot.
fn partner_of(shared: &AgentApi, state: &ConversationState) -> Result<PartnerUser, ApiError> {
    let sender_key = shared
        .config
        .partner
        .sender_key(bot_of(state))
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "no_partner_channel",
                "no partner-messenger channel is configured for this bot (helpdesk.partner)",
            )
        })?;
    let user_key = state.user_key.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "no_partner_channel",
            "the conversation's userKey is not known yet",
        )
    })?;
    Ok(PartnerUser {
        sender_key: sender_key.to_owned(),
        user_key: user_key.as_str().to_owned(),
    })
}

/// A partner-messenger user and the conversation their command is ordered with: their newest.
fn partner_user(
    shared: &AgentApi,
    platform: &str,
    user_key: &str,
) -> Result<(ConversationState, PartnerUser), ApiError> {
    if platform != Platform::Kakaobiz.as_str() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "not_partner_messenger",
            "block, unblock and session removal are partner-messenger (kakaobiz) actions",
        ));
    }
    let not_found = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "user_not_found",
            "no end user with this platform and userKey has a known conversation",
        )
    };
    let user = shared
        .store
        .find_end_user(platform, user_key)
        .map_err(store_error)?
        .ok_or_else(not_found)?;
    let id = user.last_conversation_id.value.ok_or_else(not_found)?;
    let state = shared
        .store
        .conversation(&id)
        .map_err(store_error)?
        .ok_or_else(not_found)?;
    let sender_key = shared
        .config
        .partner
        .sender_key(bot_of(&state).or(user.bot_id.as_ref().map(|b| b.as_str())))
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "no_partner_channel",
                "no partner-messenger channel is configured for this user's bot",
            )
        })?
        .to_owned();
    Ok((
        state,
        PartnerUser {
            sender_key,
            user_key: user_key.to_owned(),
        },
    ))
}

fn bot_of(s: &ConversationState) -> Option<&str> {
    s.bot_id.as_ref().map(|b| b.as_str())
}

fn summary(
    s: &ConversationState,
    positions: &std::collections::HashMap<String, usize>,
    now: Millis,
) -> QueueItem {
    let phase = DeskPhase::of(s);
    let waiting = phase == DeskPhase::Requested;
    QueueItem {
        id: s.id.as_str().to_owned(),
        bot_id: bot_of(s).map(str::to_owned),
        platform: s.platform.as_ref().map(|p| p.as_str().to_owned()),
        user_key: s.user_key.as_ref().map(|k| k.as_str().to_owned()),
        end_user_id: s.end_user_id.as_ref().map(|e| e.as_str().to_owned()),
        phase: phase.as_str().to_owned(),
        requested_at: s.handoff.requested_at,
        wait_seconds: s
            .handoff
            .requested_at
            .filter(|_| waiting)
            .map(|at| (now.saturating_sub(at) / 1000).max(0)),
        position: positions.get(s.id.as_str()).copied().filter(|_| waiting),
        agent: s.desk.agent.as_ref().map(agent_body),
        accepted_at: s.desk.accepted_at.filter(|_| s.desk.agent.is_some()),
    }
}

fn agent_body(a: &DeskAgent) -> AgentBody {
    AgentBody {
        id: a.id.clone(),
        name: a.name.clone(),
    }
}

fn store_error(e: storage::StoreError) -> ApiError {
    tracing::error!(error = %e, "agent API: store failed");
    store_unavailable()
}

fn store_unavailable() -> ApiError {
    ApiError::unavailable("the store cannot be used now; retry")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_errors_name_the_field() {
        let e = parse_body::<AcceptBody>(br#"{}"#, false).expect_err("missing");
        assert_eq!(e.field.as_deref(), Some("agent"));
        let e =
            parse_body::<AcceptBody>(br#"{"agent":{"id":"a"},"x":1}"#, false).expect_err("unknown");
        assert_eq!(e.field.as_deref(), Some("x"));
        let e = parse_body::<AcceptBody>(b"", false).expect_err("empty");
        assert_eq!((e.code, e.field.as_deref()), ("invalid_body", Some("body")));
        assert!(parse_body::<FlowTarget>(b"", true).is_ok());
        let e = message_of(ReplyMessage {
            kind: ReplyType::Text,
            text: Some("  ".into()),
            media: None,
            cards: None,
        })
        .expect_err("blank text");
        assert_eq!(e.field.as_deref(), Some("message.text"));
        let e = target_of(FlowTarget {
            flow_id: None,
            flow: None,
            node_id: Some(3),
        })
        .expect_err("node without flow");
        assert_eq!(e.field.as_deref(), Some("node_id"));
    }

    #[test]
    fn replies_become_the_service_message_format() {
        let m = message_of(ReplyMessage {
            kind: ReplyType::Media,
            text: None,
            media: Some(ReplyMedia {
                content_type: "image".into(),
                uri: "https://example.com/a.png".into(),
            }),
            cards: None,
        })
        .expect("media");
        assert_eq!(m.kind.as_str(), "media");
        assert_eq!(m.media.expect("media").content_type, "image");
    }

    #[test]
    fn the_release_flow_setting_is_an_id_a_title_or_nothing() {
        assert_eq!(configured_release("9").flow_id, Some(9));
        assert_eq!(
            configured_release("Satisfaction survey").flow.as_deref(),
            Some("Satisfaction survey")
        );
        assert!(!configured_release("").is_some());
    }

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
