//! Admin endpoints of the outbox and the dead letters (mounted under `/admin/v1` by `admin`).

use super::reading::{self, blocking, list_page, ListQuery};
use super::Ops;
use crate::queries::List;
use actix_web::http::StatusCode;
use actix_web::{web, HttpResponse};
use api_error::ApiError;
use serde::Deserialize;
use serde_json::json;
use storage::asks::Ask;

pub fn routes(scope: actix_web::Scope) -> actix_web::Scope {
    scope
        .route("/outbox", web::get().to(list_outbox))
        .route("/outbox/pause", web::post().to(pause))
        .route("/outbox/resume", web::post().to(resume))
        .route("/outbox/idle", web::get().to(idle))
        .route("/outbox/done", web::get().to(list_done))
        .route("/outbox/{id}", web::get().to(show_pending))
        .route("/dead-letters", web::get().to(list_dead))
        .route("/dead-letters/retry", web::post().to(retry_all))
        .route("/dead-letters/{id}", web::get().to(show_dead))
        .route("/dead-letters/{id}", web::delete().to(drop_dead))
        .route("/dead-letters/{id}/retry", web::post().to(retry_dead))
        .route("/replay", web::post().to(replay))
        .route("/rules/reload", web::post().to(reload_rules))
}

fn parse_id(text: &str) -> Result<u64, ApiError> {
    reading::parse_id(text, "dead-letter id")
}

fn not_found(id: u64) -> ApiError {
    ApiError::not_found(format!("no dead letter {id}"))
}

/// One page of the pending entries, in decision order; `depth` is the executor's exact count of
/// what it holds pending, in its window or not, `in_memory` how many of them are in the window.
async fn list_outbox(
    shared: web::Data<Ops>,
    q: web::Query<ListQuery>,
) -> Result<HttpResponse, ApiError> {
    let mut executor = serde_json::Map::new();
    executor.insert("paused".into(), json!(shared.executor.is_paused()));
    executor.insert("depth".into(), json!(super::outbox_depth(&shared).await));
    executor.insert("in_memory".into(), json!(shared.executor.in_memory()));
    list_page(&shared, List::Outbox, &q, executor).await
}

async fn show_pending(
    shared: web::Data<Ops>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = reading::parse_id(&id, "outbox entry id")?;
    let store = shared.store.clone();
    match blocking(move || store.outbox_entry(id)).await? {
        Some(entry) => Ok(HttpResponse::Ok().json(entry)),
        None => Err(ApiError::not_found(format!("no pending outbox entry {id}"))),
    }
}

/// Finished entries (done, or dropped by an operator) in the audit window, newest first, a page
/// at a time (`after`: a seq; the next page holds the older ones).
async fn list_done(
    shared: web::Data<Ops>,
    q: web::Query<ListQuery>,
) -> Result<HttpResponse, ApiError> {
    list_page(&shared, List::Done, &q, Default::default()).await
}

async fn pause(shared: web::Data<Ops>) -> HttpResponse {
    shared.executor.pause();
    tracing::info!("outbox execution paused by an operator");
    HttpResponse::Ok().json(json!({"paused": true}))
}

async fn resume(shared: web::Data<Ops>) -> HttpResponse {
    shared.executor.resume();
    tracing::info!("outbox execution resumed by an operator");
    HttpResponse::Ok().json(json!({"paused": false}))
}

#[derive(Deserialize)]
struct IdleQuery {
    timeout_ms: Option<u64>,
}

/// Wait until no action is pending (for scripts and tests): 200 when idle, 504 on timeout.
async fn idle(shared: web::Data<Ops>, q: web::Query<IdleQuery>) -> HttpResponse {
    let timeout = std::time::Duration::from_millis(q.timeout_ms.unwrap_or(10_000).min(300_000));
    let idle = match shared.cluster.shared() {
        // Several nodes: the store's outbox, whichever node carries it out.
        true => {
            let empty = |s: &dyn storage::Storage| Ok(s.outbox_len()? == 0);
            super::reading::wait_in_store(&shared.store, timeout, empty)
                .await
                .unwrap_or(false)
        }
        false => shared.executor.wait_idle(timeout).await,
    };
    let body = json!({"idle": idle, "depth": super::outbox_depth(&shared).await});
    if idle {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::GatewayTimeout().json(body)
    }
}

/// One page of the dead letters (`count` is the page's).
async fn list_dead(
    shared: web::Data<Ops>,
    q: web::Query<ListQuery>,
) -> Result<HttpResponse, ApiError> {
    list_page(&shared, List::DeadLetters, &q, Default::default()).await
}

async fn show_dead(
    shared: web::Data<Ops>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = parse_id(&id)?;
    let store = shared.store.clone();
    match blocking(move || store.dead_letter(id)).await? {
        Some(letter) => Ok(HttpResponse::Ok().json(letter)),
        None => Err(not_found(id)),
    }
}

async fn retry_dead(
    shared: web::Data<Ops>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = parse_id(&id)?;
    let ask = Ask::Retry { ids: vec![id] };
    super::asks::answer(&shared, ask, |body| {
        match body["retried"].as_array().is_some_and(|r| !r.is_empty()) {
            true => Ok(HttpResponse::Ok().json(body)),
            false => Err(not_found(id)),
        }
    })
    .await
}

/// Every dead letter back to the outbox ([`retry_matching`] of every letter).
async fn retry_all(shared: web::Data<Ops>) -> Result<HttpResponse, ApiError> {
    let ask = Ask::RetryMatching {
        reason: String::new(),
        queue: String::new(),
    };
    super::asks::answer(&shared, ask, |body| Ok(HttpResponse::Ok().json(body))).await
}

/// The dead letters whose reason and queue contain `reason` and `queue` (empty: any) back to the
/// outbox, 100 at a time (never all letters in memory at once): each page is retried, made
/// durable and handed to the executor before the next is read. The numbers retried.
pub(crate) async fn retry_matching(
    shared: &Ops,
    reason: &str,
    queue: &str,
) -> Result<Vec<u64>, ApiError> {
    let (mut retried, mut after) = (Vec::new(), None);
    loop {
        let (reason, queue) = (reason.to_owned(), queue.to_owned());
        let takes = move |l: &model::action::DeadLetter| matches(l, &reason, &queue);
        let (ids, next) = letters_page(shared, after, takes).await?;
        retried.extend(retry(shared, &ids).await?);
        let Some(next) = next else { break };
        after = Some(next);
    }
    Ok(retried)
}

/// Whether `letter`'s reason and queue contain `reason` and `queue` (trimmed; empty: any).
pub(crate) fn matches(letter: &model::action::DeadLetter, reason: &str, queue: &str) -> bool {
    letter.reason.contains(reason.trim()) && letter.entry.queue.contains(queue.trim())
}

/// One page of the dead letters after number `after`, oldest first ([`crate::queries::PAGE`]
/// read): the numbers of those `takes` keeps, and where the next page starts (`None`: no more).
pub(crate) async fn letters_page(
    shared: &Ops,
    after: Option<u64>,
    takes: impl Fn(&model::action::DeadLetter) -> bool + Send + 'static,
) -> Result<(Vec<u64>, Option<u64>), ApiError> {
    let (store, limit) = (shared.store.clone(), crate::queries::PAGE);
    blocking(move || {
        let page = store.dead_letters_page(after, limit)?;
        let next = page.last().filter(|_| page.len() == limit);
        let next = next.map(|l| l.entry.seq);
        Ok((
            page.iter()
                .filter(|l| takes(l))
                .map(|l| l.entry.seq)
                .collect(),
            next,
        ))
    })
    .await
}

/// Back to the outbox, made durable with one flush, then to the executor (the active's work:
/// see `asks`). Returns the ids that were dead letters.
pub(crate) async fn retry(shared: &Ops, ids: &[u64]) -> Result<Vec<u64>, ApiError> {
    let now = shared.store.clock().now_millis();
    let (store, ids) = (shared.store.clone(), ids.to_vec());
    let entries = blocking(move || {
        let mut entries = Vec::new();
        for id in ids {
            if let Some(entry) = store.retry_dead_letter(id, now)? {
                entries.push(entry);
            }
        }
        Ok(entries)
    })
    .await?;
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    shared
        .writer
        .flush()
        .await
        .map_err(|_| ApiError::unavailable("the store cannot persist now"))?;
    let retried = entries.iter().map(|e| e.seq).collect();
    for entry in entries {
        shared.metrics.dead_letter_entries.dec();
        tracing::info!(action_id = %entry.id, "dead letter retried by an operator");
        shared.executor.retried(entry);
    }
    Ok(retried)
}

#[derive(Deserialize)]
struct DropQuery {
    reason: Option<String>,
}

async fn drop_dead(
    shared: web::Data<Ops>,
    id: web::Path<String>,
    q: web::Query<DropQuery>,
) -> Result<HttpResponse, ApiError> {
    let id = parse_id(&id)?;
    let reason = q
        .into_inner()
        .reason
        .filter(|r| !r.trim().is_empty())
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "reason_required",
                "dropping a dead letter needs a reason (?reason=...)",
            )
        })?;
    let ask = Ask::Drop { id, reason };
    super::asks::answer(&shared, ask, |body| Ok(HttpResponse::Ok().json(body))).await
}

/// Drop dead letter `id` for `reason`, made durable, and tell the executor (the active's work:
/// see `asks`). `None`: no such letter.
pub(crate) async fn drop_letter(
    shared: &Ops,
    id: u64,
    reason: &str,
) -> Result<Option<model::action::DeadLetter>, ApiError> {
    let now = shared.store.clock().now_millis();
    let (store, why) = (shared.store.clone(), reason.to_owned());
    let Some(letter) = blocking(move || store.drop_dead_letter(id, &why, now)).await? else {
        return Ok(None);
    };
    shared
        .writer
        .flush()
        .await
        .map_err(|_| ApiError::unavailable("the store cannot persist now"))?;
    shared.metrics.dead_letter_entries.dec();
    tracing::info!(action_id = %letter.entry.id, reason = %reason, "dead letter dropped by an operator");
    shared.executor.dropped(letter.entry.queue.clone());
    Ok(Some(letter))
}

/// Re-run stored events through the current rules (`POST /admin/v1/replay?from=&to=`, times as
/// Unix ms or RFC 3339): the active's work ([`replay_now`]).
async fn replay(
    shared: web::Data<Ops>,
    q: web::Query<ReplayQuery>,
) -> Result<HttpResponse, ApiError> {
    let request = q.into_inner().request()?;
    let ask = Ask::Replay(request);
    super::asks::answer(&shared, ask, |body| Ok(HttpResponse::Ok().json(body))).await
}

/// A replay on the active node: queued actions are made durable before they reach the executor.
/// The report, as JSON.
pub(crate) async fn replay_now(
    shared: &Ops,
    request: storage::replay::ReplayRequest,
) -> Result<serde_json::Value, ApiError> {
    let store = shared.store.clone();
    let rules = shared.rules.live.current();
    let report = blocking(move || store.replay(&request, rules.as_ref())).await?;
    if !report.entries.is_empty() {
        shared
            .writer
            .flush()
            .await
            .map_err(|_| ApiError::unavailable("the store cannot persist now"))?;
        tracing::info!(
            queued = report.queued,
            "replayed actions queued by an operator"
        );
        shared.executor.notify(report.entries.clone());
    }
    serde_json::to_value(&report)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))
}

#[derive(Deserialize)]
struct ReplayQuery {
    from: String,
    to: String,
    #[serde(default)]
    dry_run: bool,
    #[serde(default)]
    force: bool,
}

impl ReplayQuery {
    fn request(self) -> Result<storage::replay::ReplayRequest, ApiError> {
        let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, "invalid_query", m);
        let from = model::clock::parse_time(&self.from).map_err(|e| bad(format!("from: {e}")))?;
        let to = model::clock::parse_time(&self.to).map_err(|e| bad(format!("to: {e}")))?;
        if from >= to {
            return Err(bad("`from` must be before `to`".into()));
        }
        Ok(storage::replay::ReplayRequest {
            from,
            to,
            dry_run: self.dry_run,
            force: self.force,
        })
    }
}

/// Compile the rule directory and swap it in (`POST /admin/v1/rules/reload`): 200 with the
/// version in force, or 422 with every problem (the running rules stay).
async fn reload_rules(shared: web::Data<Ops>) -> Result<HttpResponse, ApiError> {
    let reloader = shared.rules.clone();
    let result = web::block(move || reloader.reload(crate::ops::reload::Trigger::Admin))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    match result {
        Ok(reloaded) => Ok(HttpResponse::Ok().json(reloaded)),
        Err(e) => {
            let problems: Vec<serde_json::Value> = match &e {
                engine::rules::LoadError::Invalid(list) => list
                    .iter()
                    .map(|p| json!({"file": p.file, "line": p.line, "at": p.at, "message": p.message}))
                    .collect(),
                other => vec![json!({"file": "", "at": "", "message": other.to_string()})],
            };
            Ok(HttpResponse::UnprocessableEntity().json(json!({
                "error": {
                    "code": "invalid_rules",
                    "message": "the rule files were not loaded; the running rules stay",
                    "problems": problems,
                },
                "version": shared.rules.live.current().version(),
            })))
        }
    }
}
