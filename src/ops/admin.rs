//! The admin API (`/admin/v1`): read state, inspect and re-process quarantine. Bearer token of its
//! own, and loopback-only unless configured otherwise.

use super::reading::{blocking, json_bytes, list_page, parse_id, store_error, ListQuery};
use super::Ops;
use crate::queries::List;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::middleware::Next;
use actix_web::{web, HttpResponse};
use api_error::ApiError;
use model::ids::{ConversationId, EventId};
use serde::Deserialize;
use serde_json::json;

/// Where the admin API is served.
pub const PREFIX: &str = "/admin/v1";
/// The longest body it reads (actix's default limit for `web::Bytes`).
pub const MAX_BODY: usize = 256 * 1024;

/// The reads, quarantine and operator switches, added to `scope` (the admin API's, which the
/// other `*_admin` modules fill too), behind the admin token's guard.
pub(super) fn routes(cfg: &mut web::ServiceConfig, scope: actix_web::Scope) {
    cfg.service(
        scope
            .wrap(actix_web::middleware::from_fn(guard))
            .route("/conversations", web::get().to(conversations_list))
            .route("/conversations/{id}", web::get().to(conversation))
            .route("/conversations/{id}/audit", web::get().to(audit))
            .route("/conversations/{id}/desks", web::get().to(desks))
            .route("/endusers", web::get().to(end_users))
            .route("/events/{id}", web::get().to(event))
            .route("/inbox/drained", web::get().to(inbox_drained))
            .route("/dispatch/pause", web::post().to(dispatch_pause))
            .route("/dispatch/resume", web::post().to(dispatch_resume))
            .route("/clock/advance", web::post().to(clock_advance))
            .route("/cluster", web::get().to(cluster))
            .route("/backfill", web::post().to(backfill_pass))
            .route("/emulator/journal", web::get().to(emulator_journal))
            .route("/quarantine", web::get().to(quarantine_list))
            .route("/quarantine/{id}", web::get().to(quarantine_show))
            .route("/quarantine/{id}/body", web::get().to(quarantine_body))
            .route(
                "/quarantine/{id}/reprocess",
                web::post().to(quarantine_reprocess),
            )
            .default_service(web::to(api_error::not_found)),
    );
}

/// Run a backfill pass now (after the one running, if any): what it read, what it stored, and
/// whether the webhook looks silent. The active's work (see `asks`).
async fn backfill_pass(shared: web::Data<Ops>) -> Result<HttpResponse, ApiError> {
    let ask = storage::asks::Ask::Backfill;
    super::asks::answer(&shared, ask, |body| Ok(HttpResponse::Ok().json(body))).await
}

/// A backfill pass on the active node: its report and the webhook's watch.
pub(crate) async fn backfill_now(shared: &Ops) -> Result<serde_json::Value, ApiError> {
    match shared.backfill.pass().await {
        Ok(report) => Ok(json!({
            "pass": report,
            "webhook": shared.backfill.watch().detail(),
        })),
        Err(e) => {
            tracing::warn!(error = %e, "backfill pass failed");
            Err(ApiError::new(
                actix_web::http::StatusCode::BAD_GATEWAY,
                "backfill_failed",
                format!("the backfill pass failed; the next one tries again: {e}"),
            ))
        }
    }
}

/// Hold folding back: webhooks and agent calls are still accepted and stored, nothing is
/// folded (so no rule runs and no agent call gets its verdict) until resumed.
async fn dispatch_pause(shared: web::Data<Ops>) -> HttpResponse {
    shared.dispatch.pause();
    tracing::info!("folding paused by an operator");
    HttpResponse::Ok().json(json!({"paused": true}))
}

async fn dispatch_resume(shared: web::Data<Ops>) -> HttpResponse {
    shared.dispatch.resume();
    tracing::info!("folding resumed by an operator");
    HttpResponse::Ok().json(json!({"paused": false}))
}

async fn guard(
    req: ServiceRequest,
    next: Next<impl actix_web::body::MessageBody + 'static>,
) -> Result<
    ServiceResponse<actix_web::body::EitherBody<impl actix_web::body::MessageBody>>,
    actix_web::Error,
> {
    let Some(shared) = req.app_data::<web::Data<Ops>>().cloned() else {
        return Err(ApiError::unavailable("admin API not configured").into());
    };
    if !shared
        .admin_cidrs
        .allows(shared.proxies.of_request(req.request()))
    {
        return Ok(req
            .error_response(ApiError::forbidden("admin API is not open to this address"))
            .map_into_right_body());
    }
    let token = req
        .headers()
        .get(actix_web::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(crate::intake::auth::bearer_token);
    if !token.is_some_and(|t| shared.admin_tokens.accepts(t)) {
        return Ok(req
            .error_response(ApiError::unauthorized("missing or invalid admin token"))
            .map_into_right_body());
    }
    Ok(next.call(req).await?.map_into_left_body())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Advance {
    #[serde(with = "humantime_serde")]
    by: std::time::Duration,
}

/// The test clock: move the daemon's time forward (rule timers come due, waits run out), so a
/// handoff can be rehearsed, and tested, without waiting for real. Served only with
/// `admin.test_clock = true`.
async fn clock_advance(shared: web::Data<Ops>, body: web::Bytes) -> Result<HttpResponse, ApiError> {
    if !shared.test_clock {
        return Err(ApiError::new(
            actix_web::http::StatusCode::FORBIDDEN,
            "test_clock_disabled",
            "the test clock is off (admin.test_clock = false)",
        ));
    }
    let advance: Advance = serde_json::from_slice(&body).map_err(|e| {
        ApiError::new(
            actix_web::http::StatusCode::BAD_REQUEST,
            "invalid_body",
            format!("expected {{\"by\": \"<duration>\"}}: {e}"),
        )
    })?;
    let offset = shared.store.clock().advance(advance.by);
    tracing::warn!(
        by = %humantime::format_duration(advance.by),
        offset_ms = offset,
        "test clock advanced"
    );
    // The timer firer sleeps until a due time: let it look again.
    shared.store.timer_wakeup().wake();
    // And the executor: retries due in daemon time run now.
    shared.executor.wake();
    // And the lease loop: a lease may have run out, or be due for renewal.
    shared.cluster.wake();
    let now = shared.store.clock().now_millis();
    // How many timers are due now: a caller can wait for that many firings.
    let store = shared.store.clone();
    let due = blocking(move || {
        store
            .due_timers(now, 100_000, &|_| false)
            .map(|(due, _)| due.len())
    })
    .await?;
    Ok(HttpResponse::Ok().json(json!({
        "offset_ms": offset,
        "now": now,
        "due_timers": due,
    })))
}

/// This node among the nodes on the store: its id and role, the lease's holder, epoch and end,
/// and the nodes seen in the last minute (read from the store).
async fn cluster(shared: web::Data<Ops>) -> Result<HttpResponse, ApiError> {
    let view = shared.cluster.view().await.map_err(store_error)?;
    Ok(HttpResponse::Ok().json(view))
}

async fn conversation(
    shared: web::Data<Ops>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = ConversationId::new(id.into_inner());
    let (store, key) = (shared.store.clone(), id.clone());
    match blocking(move || store.conversation(&key)).await? {
        Some(state) => Ok(HttpResponse::Ok().json(state)),
        None => Err(ApiError::not_found(format!("no conversation {id}"))),
    }
}

/// The conversation at its desks (the console's conversation page): the Chatwoot conversation,
/// its link, whether it is still open; `{}` without a connector or a mapping.
async fn desks(shared: web::Data<Ops>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let id = ConversationId::new(id.into_inner());
    let (store, key) = (shared.store.clone(), id.clone());
    let name = crate::helpdesk::chatwoot::client::NAME;
    let link = blocking(move || store.desk_link(name, &key)).await?;
    let mut out = serde_json::Map::new();
    if let (Some(view), Some(link)) = (&shared.chatwoot, link) {
        out.insert(
            name.to_owned(),
            serde_json::json!({
                "conversation": link.remote,
                "url": link.remote.as_deref().map(|r| view.conversation_url(r)),
                "contact": link.contact,
                "open": link.remote.is_some() && link.closed_at.is_none(),
                "closed_at": link.closed_at,
                "earlier": link.earlier,
            }),
        );
    }
    Ok(HttpResponse::Ok().json(out))
}

/// The conversation's timeline (`queries::audit`), with the rules in force.
async fn audit(shared: web::Data<Ops>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let id = ConversationId::new(id.into_inner());
    let store = shared.store.clone();
    let (rules, set) = shared.rules.live.current_explained();
    let lookup = id.clone();
    let found =
        blocking(move || crate::queries::audit(&*store, rules.as_ref(), set.as_deref(), &lookup))
            .await?;
    match found {
        Some(timeline) => Ok(HttpResponse::Ok().json(timeline)),
        None => Err(ApiError::not_found(format!("no conversation {id}"))),
    }
}

/// One page of the conversations in id order, as summaries.
async fn conversations_list(
    shared: web::Data<Ops>,
    q: web::Query<ListQuery>,
) -> Result<HttpResponse, ApiError> {
    list_page(&shared, List::Conversations, &q, Default::default()).await
}

/// Either the lookup of one end user by `platform` and `userKey` (both), or a page of the end
/// users in id order (`limit`, `after`; neither of the two).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct EndUsersQuery {
    platform: Option<String>,
    user_key: Option<String>,
    #[serde(flatten)]
    page: ListQuery,
}

async fn end_users(
    shared: web::Data<Ops>,
    q: web::Query<EndUsersQuery>,
) -> Result<HttpResponse, ApiError> {
    let q = q.into_inner();
    match (q.platform, q.user_key) {
        (Some(platform), Some(user_key)) => find_end_user(&shared, platform, user_key).await,
        (None, None) => list_page(&shared, List::EndUsers, &q.page, Default::default()).await,
        _ => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_query",
            "give both platform and userKey (one end user), or neither (the list)",
        )),
    }
}

/// An end user by `(platform, userKey)`, with their newest conversation.
async fn find_end_user(
    shared: &Ops,
    platform: String,
    user_key: String,
) -> Result<HttpResponse, ApiError> {
    let store = shared.store.clone();
    let (p, k) = (platform.clone(), user_key.clone());
    let found = blocking(move || crate::queries::find_end_user(&*store, &p, &k)).await?;
    match found {
        Some(v) => Ok(HttpResponse::Ok().json(v)),
        None => Err(ApiError::not_found(format!(
            "no end user {user_key} on {platform}"
        ))),
    }
}

async fn event(shared: web::Data<Ops>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let id = EventId::new(id.into_inner());
    let (store, key) = (shared.store.clone(), id.clone());
    match blocking(move || store.event_status(&key)).await? {
        Some((record, pending)) => {
            Ok(HttpResponse::Ok().json(json!({"record": record, "pending": pending})))
        }
        None => Err(ApiError::not_found(format!(
            "no event {id} within the dedupe window"
        ))),
    }
}

/// One page of the quarantine list, metadata only (the bodies: `/quarantine/{id}` and
/// `/quarantine/{id}/body`).
async fn quarantine_list(
    shared: web::Data<Ops>,
    q: web::Query<ListQuery>,
) -> Result<HttpResponse, ApiError> {
    list_page(&shared, List::Quarantine, &q, Default::default()).await
}

/// A record's whole body as received, as bytes.
async fn quarantine_body(
    shared: web::Data<Ops>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = parse_id(&id, "quarantine id")?;
    let store = shared.store.clone();
    let found = blocking(move || store.quarantined_one(id)?.map(|r| r.body()).transpose()).await?;
    match found {
        Some(body) => Ok(HttpResponse::Ok()
            .content_type(actix_web::http::header::ContentType::octet_stream())
            .body(body)),
        None => Err(ApiError::not_found(format!("no quarantine record {id}"))),
    }
}

async fn quarantine_show(
    shared: web::Data<Ops>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = parse_id(&id, "quarantine id")?;
    let store = shared.store.clone();
    let found = blocking(move || {
        store
            .quarantined_one(id)?
            .map(|r| json_bytes(&crate::queries::quarantine_view(&r)))
            .transpose()
    })
    .await?;
    match found {
        Some(json) => Ok(HttpResponse::Ok()
            .content_type(actix_web::http::header::ContentType::json())
            .body(json)),
        None => Err(ApiError::not_found(format!("no quarantine record {id}"))),
    }
}

async fn quarantine_reprocess(
    shared: web::Data<Ops>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = parse_id(&id, "quarantine id")?;
    let outcome = reprocess(&shared, id).await?;
    let status = if outcome.status == "still_invalid" {
        actix_web::http::StatusCode::CONFLICT
    } else {
        actix_web::http::StatusCode::OK
    };
    Ok(HttpResponse::build(status).json(outcome))
}

/// Re-process quarantine record `id` through today's checks (the admin API's and the
/// console's path).
pub(crate) async fn reprocess(
    shared: &Ops,
    id: u64,
) -> Result<crate::intake::Reprocessed, ApiError> {
    let now = shared.store.clock().now_millis();
    let checks = shared.webhook_checks(now);
    let store = shared.store.clone();
    let scrubber = shared.intake.scrubber.clone();
    let prepared =
        blocking(move || crate::intake::prepare_reprocess(&*store, id, &checks, now, &scrubber))
            .await?;
    let unavailable = |_| ApiError::unavailable("the store cannot persist now");
    let outcome = match prepared {
        None => return Err(ApiError::not_found(format!("no quarantine record {id}"))),
        Some(crate::intake::Reprocess::StillInvalid(outcome)) => outcome,
        // Through the writer, like any delivery: it hands the new events to the dispatcher.
        Some(crate::intake::Reprocess::Accept(job, kinds)) => {
            let accepted = shared.writer.accept(job).await.map_err(unavailable)?;
            let store = shared.store.clone();
            let outcome =
                blocking(move || crate::intake::finish_reprocess(&*store, id, accepted, kinds))
                    .await?;
            shared.writer.flush().await.map_err(unavailable)?;
            outcome
        }
    };
    if outcome.released {
        shared.metrics.quarantine_entries.dec();
    }
    if outcome.requarantined.is_some() {
        shared.metrics.record_quarantined("invalid_event");
    }
    for kind in &outcome.new_kinds {
        shared
            .metrics
            .events
            .with_label_values(&[kind.metric_label()])
            .inc();
    }
    Ok(outcome)
}

#[derive(Deserialize)]
struct DrainQuery {
    /// How long to wait, in milliseconds (default 10 s, at most 5 min).
    timeout_ms: Option<u64>,
}

/// Wait until every accepted event is folded into state: for scripts (backups, tests) that need
/// a quiet store. 200 when drained, 504 when the wait timed out.
async fn inbox_drained(
    shared: web::Data<Ops>,
    q: web::Query<DrainQuery>,
) -> Result<HttpResponse, ApiError> {
    let timeout = std::time::Duration::from_millis(q.timeout_ms.unwrap_or(10_000).min(300_000));
    let drained = match shared.cluster.shared() {
        // Several nodes: the store's truth, whichever node folds.
        true => super::reading::wait_in_store(&shared.store, timeout, nothing_to_fold).await,
        false => shared.dispatch.wait_drained(&shared.writer, timeout).await,
    };
    let drained = drained.map_err(store_error)?;
    let depth = shared.metrics.inbox_depth.get();
    if drained {
        Ok(HttpResponse::Ok().json(json!({"drained": true, "inbox_depth": depth})))
    } else {
        Ok(HttpResponse::GatewayTimeout().json(json!({"error": {"code": "not_drained", "message": format!("inbox still holds events after {} ms", timeout.as_millis())}, "inbox_depth": depth})))
    }
}

/// Nothing in the store is still to fold (several nodes: what any of them stored).
fn nothing_to_fold(store: &dyn storage::Storage) -> Result<bool, storage::StoreError> {
    Ok(store.pending_from(store.fold_from()?, 1)?.is_empty())
}

/// The embedded emulator's call journal: what the bridge really sent to the (emulated) service.
async fn emulator_journal(shared: web::Data<Ops>) -> Result<HttpResponse, ApiError> {
    match &shared.emulator {
        Some(emu) => Ok(HttpResponse::Ok().json(emu.journal())),
        None => Err(ApiError::not_found(
            "the upstream is not the embedded emulator",
        )),
    }
}
