//! The agent API's handlers: the queue and a conversation (reads), and the mutating calls, each
//! a command built from its body and carried out on the command path ([`super::run`]).

use super::dto::*;
use super::{convert, document, run, AgentApi};
use crate::helpdesk::commands::{self, store_error, store_unavailable};
use crate::helpdesk::contract;
use actix_web::http::StatusCode;
use actix_web::{delete, get, post, web, HttpRequest, HttpResponse};
use api_error::ApiError;
use engine::state::desk::DeskPhase;
use engine::state::ConversationState;
use model::webhook::agent::Command;
use model::webhook::model::Millis;
use serde_json::{json, Value};
use storage::desk::DeskCursor;

/// The OpenAPI document of this API (no token needed).
#[utoipa::path(
    tag = "meta",
    security(()),
    responses((status = 200, description = "OpenAPI 3.1 document", content_type = "application/json"))
)]
#[get("/openapi.json")]
pub(super) async fn openapi_json() -> HttpResponse {
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
pub(super) async fn list_conversations(
    shared: web::Data<AgentApi>,
    req: HttpRequest,
    query: web::Query<QueueQuery>,
) -> Result<HttpResponse, ApiError> {
    super::authorize(&shared, &req)?;
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
pub(super) async fn get_conversation(
    shared: web::Data<AgentApi>,
    req: HttpRequest,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    super::authorize(&shared, &req)?;
    let id = id.into_inner();
    let store = shared.store.clone();
    let (state, positions) = shared
        .commands
        .blocking(move |commands| {
            let state = commands.conversation(&id)?;
            let positions = store
                .waiting_positions(std::slice::from_ref(&state))
                .map_err(store_error)?;
            Ok((state, positions))
        })
        .await?;
    let now = shared.store.clock().now_millis();
    let summary = summary(&state, &positions, now);
    let (transcript, transcript_error) = match shared.transcript_messages {
        0 => (None, None),
        n => match transcript(&shared.upstream, state.id.as_str(), n).await {
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
pub(super) async fn accept(
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
        move |commands, body| {
            let b: AcceptBody = convert::parse_body(body, false)?;
            let agent = convert::agent_of(b.agent, "agent")?;
            let state = commands.conversation(&id)?;
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
pub(super) async fn send_message(
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
        move |commands, body| {
            let b: MessageBody = convert::parse_body(body, false)?;
            let agent = b.agent.map(|a| convert::agent_of(a, "agent")).transpose()?;
            let message = convert::message_of(b.message)?;
            commands.message_command(&id, agent, message)
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
pub(super) async fn release(
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
        move |commands, body| {
            let b: FlowTarget = convert::parse_body(body, true)?;
            let mut target = convert::target_of(b)?;
            if !target.is_some() {
                target = commands.release_target();
            }
            let state = commands.conversation(&id)?;
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
pub(super) async fn transfer(
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
        move |commands, body| {
            let b: FlowTarget = convert::parse_body(body, false)?;
            let target = convert::target_of(b)?;
            if !target.is_some() {
                return Err(convert::invalid_body(
                    "flow_id",
                    "flow_id or flow is required",
                ));
            }
            let state = commands.conversation(&id)?;
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
pub(super) async fn block(
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
        move |commands, body| {
            let b: BlockBody = convert::parse_body(body, true)?;
            let (state, partner) = commands.partner_user(&platform, &user_key)?;
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
pub(super) async fn unblock(
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
        move |commands, _| {
            let (state, partner) = commands.partner_user(&platform, &user_key)?;
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
pub(super) async fn remove_session(
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
        move |commands, _| {
            let (state, partner) = commands.partner_user(&platform, &user_key)?;
            Ok((state, Command::RemoveSession { partner }))
        },
    )
    .await
}

/// The newest `n` messages of a conversation, oldest first. The Open API lists oldest first, so
/// a longer conversation takes a second call at the offset of its last `n`.
pub async fn transcript(
    upstream: &upstream::handle::UpstreamHandle,
    conversation: &str,
    n: u32,
) -> Result<Value, upstream::error::UpstreamError> {
    use model::contract::{MessagesQuery, PageQuery};
    let api = upstream::api::OpenApi::new(upstream.clone());
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

fn summary(
    s: &ConversationState,
    positions: &std::collections::HashMap<String, usize>,
    now: Millis,
) -> QueueItem {
    let phase = DeskPhase::of(s);
    let waiting = phase == DeskPhase::Requested;
    QueueItem {
        id: s.id.as_str().to_owned(),
        bot_id: commands::bot_of(s).map(str::to_owned),
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
        agent: s.desk.agent.as_ref().map(AgentBody::of),
        accepted_at: s.desk.accepted_at.filter(|_| s.desk.agent.is_some()),
    }
}
