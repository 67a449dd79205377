//! The active's work asked of any node (a dead letter's retry or drop, a replay, a pass run now),
//! from the admin API or the console. On the active node (on sled: always) it is carried out at
//! once. On a standby it is stored for the active (`storage::asks`, acknowledged after commit);
//! the active's loop ([`serve`]) carries it out and stores its answer, and the asking node
//! hands that answer back as if it were its own, or, when none came within [`WAIT`] (a takeover
//! under way), answers 202 with the ask's number: `GET /admin/v1/asks/{id}` tells how it ended.

use super::reading::blocking;
use super::Ops;
use actix_web::http::StatusCode;
use actix_web::{web, HttpResponse};
use api_error::ApiError;
use serde_json::{json, Value};
use std::time::Duration;
use storage::asks::{Answer, Ask, AskRecord};
use storage::StoreError;

/// How long a node waits for the active's answer: a takeover (the lease and one renewal, 15 s by
/// default) and the work itself fit in it.
const WAIT: Duration = Duration::from_secs(20);
/// How often a waiting node reads whether its ask was answered.
const LOOK_EVERY: Duration = Duration::from_millis(100);
/// How often the active looks for asks (a statement on an index of the unanswered).
const SERVE_EVERY: Duration = Duration::from_secs(1);
/// Every how many looks the active prunes the old answers (every 10 minutes).
const PRUNE_EVERY: u32 = 600;
/// Asks the active takes at a time.
const SERVE_BATCH: usize = 16;
/// Old answers pruned at a time.
const PRUNE_BATCH: usize = 1_000;
/// How long an answer stays readable (`GET /admin/v1/asks/{id}`).
const KEPT: Duration = Duration::from_secs(24 * 3600);

pub fn routes(scope: actix_web::Scope) -> actix_web::Scope {
    scope.route("/asks/{id}", web::get().to(show))
}

/// How an ask ended for the node that was asked.
pub(crate) enum Ran {
    /// Carried out (here, or by the active): its answer's body.
    Done(Value),
    /// The active refused it or failed: its status and error body, handed on as they are.
    Relayed { status: StatusCode, body: Value },
    /// Stored; the active has not answered yet.
    Waiting(u64),
}

/// Carry `ask` out here when this node is the active one, else ask the active and wait for its
/// answer (at most [`WAIT`]).
pub(crate) async fn run(shared: &Ops, ask: Ask) -> Result<Ran, ApiError> {
    if shared.cluster.is_active() {
        return carry_out(shared, &ask).await.map(Ran::Done);
    }
    let (store, by) = (shared.store.clone(), shared.cluster.node_id().to_owned());
    let stored = blocking(move || store.ask(&ask, &by)).await?;
    let Some(id) = stored else {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_asks",
            format!(
                "{} asks wait for the active node already: is one active? (GET /admin/v1/cluster)",
                storage::asks::WAITING_MAX
            ),
        ));
    };
    tracing::info!(
        ask = id,
        "the active's work asked of this standby: stored for the active"
    );
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let store = shared.store.clone();
        let record = blocking(move || store.ask_record(id)).await?;
        if let Some(answer) = record.and_then(|r| r.answer) {
            return Ok(ran(&answer));
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(Ran::Waiting(id));
        }
        tokio::time::sleep(LOOK_EVERY).await;
    }
}

fn ran(answer: &Answer) -> Ran {
    let body = serde_json::from_str(&answer.body).unwrap_or(Value::Null);
    match StatusCode::from_u16(answer.status) {
        Ok(StatusCode::OK) => Ran::Done(body),
        Ok(status) => Ran::Relayed { status, body },
        Err(_) => Ran::Relayed {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            body,
        },
    }
}

/// The admin API's answer to `ask`: `ok` makes it of a body carried out; a relayed refusal is
/// answered as the active gave it; an ask still waiting is 202 with its number.
pub(crate) async fn answer(
    shared: &Ops,
    ask: Ask,
    ok: impl FnOnce(Value) -> Result<HttpResponse, ApiError>,
) -> Result<HttpResponse, ApiError> {
    match run(shared, ask).await? {
        Ran::Done(body) => ok(body),
        Ran::Relayed { status, body } => Ok(HttpResponse::build(status).json(body)),
        Ran::Waiting(id) => Ok(HttpResponse::Accepted().json(json!({
            "ask": id,
            "state": "waiting",
            "message": "stored for the active node, which has not answered yet; \
                        GET /admin/v1/asks/{ask} tells how it ended",
        }))),
    }
}

/// The work itself, on the active node.
async fn carry_out(shared: &Ops, ask: &Ask) -> Result<Value, ApiError> {
    use super::{admin, outbox_admin, prune_admin, reconcile_admin};
    match ask {
        Ask::Retry { ids } => Ok(json!({ "retried": outbox_admin::retry(shared, ids).await? })),
        Ask::RetryMatching { reason, queue } => {
            let retried = outbox_admin::retry_matching(shared, reason, queue).await?;
            Ok(json!({ "retried": retried }))
        }
        Ask::Drop { id, reason } => match outbox_admin::drop_letter(shared, *id, reason).await? {
            Some(_) => Ok(json!({ "dropped": id, "reason": reason })),
            None => Err(ApiError::not_found(format!("no dead letter {id}"))),
        },
        Ask::Replay(request) => outbox_admin::replay_now(shared, request.clone()).await,
        Ask::Reconcile => reconcile_admin::pass_now(shared).await,
        Ask::Prune => prune_admin::pass_now(shared).await,
        Ask::Backfill => admin::backfill_now(shared).await,
    }
}

/// The active's loop over what other nodes asked of it, each turn as the active one: the
/// unanswered asks, oldest first, carried out and answered; answers past [`KEPT`] pruned now and
/// then.
pub(crate) async fn serve(shared: web::Data<Ops>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(SERVE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for turn in (0..PRUNE_EVERY).cycle() {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        match serve_once(&shared, turn == 0).await {
            Ok(()) => {}
            // The lease moved on: the next active answers them.
            Err(StoreError::Fenced) => return,
            Err(e) => tracing::warn!(error = %e, "the asks of other nodes could not be served"),
        }
    }
}

async fn serve_once(shared: &Ops, prune: bool) -> Result<(), StoreError> {
    let store = shared.store.clone();
    let waiting = on_blocking(move || store.unanswered(SERVE_BATCH)).await?;
    for record in waiting {
        let answer = carried_out(shared, &record).await;
        let (store, id, status) = (shared.store.clone(), record.id, answer.status);
        if on_blocking(move || store.answer(id, &answer)).await? {
            tracing::info!(ask = id, status, by = %record.by, "carried out what another node was asked");
        }
    }
    if prune {
        let now = shared.store.clock().now_millis();
        let before = now.saturating_sub(KEPT.as_millis() as i64);
        let store = shared.store.clone();
        on_blocking(move || store.prune_asks(before, PRUNE_BATCH)).await?;
    }
    Ok(())
}

/// `record`'s ask carried out here, as its answer.
async fn carried_out(shared: &Ops, record: &AskRecord) -> Answer {
    let (status, body) = match carry_out(shared, &record.ask).await {
        Ok(body) => (StatusCode::OK, body),
        Err(e) => (e.status, e.body()),
    };
    Answer {
        status: status.as_u16(),
        body: body.to_string(),
        by: shared.cluster.node_id().to_owned(),
        at: shared.store.clock().now_millis(),
    }
}

async fn on_blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    web::block(work)
        .await
        .map_err(|e| StoreError::Internal(e.to_string()))?
}

/// `GET /admin/v1/asks/{id}`: an ask as stored, its answer's body as JSON.
async fn show(shared: web::Data<Ops>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let id = super::reading::parse_id(&id, "ask id")?;
    let store = shared.store.clone();
    let Some(record) = blocking(move || store.ask_record(id)).await? else {
        return Err(ApiError::not_found(format!("no ask {id}")));
    };
    let answer = record.answer.as_ref().map(|a| {
        let body: Value = serde_json::from_str(&a.body).unwrap_or(Value::Null);
        json!({ "status": a.status, "body": body, "by": a.by, "at": a.at })
    });
    Ok(HttpResponse::Ok().json(json!({
        "id": record.id,
        "ask": record.ask,
        "by": record.by,
        "asked_at": record.asked_at,
        "state": if answer.is_some() { "answered" } else { "waiting" },
        "answer": answer,
    })))
}
