//! `POST /admin/v1/reconcile` (mounted under `/admin/v1` by `admin`): run a reconciliation pass
//! now and answer what it found (`?dry_run=true`: find without handing anything to the writer).

use super::Ops;
use crate::reconcile::SweepError;
use actix_web::http::StatusCode;
use actix_web::{web, HttpResponse};
use api_error::ApiError;
use serde::Deserialize;

pub fn routes(scope: actix_web::Scope) -> actix_web::Scope {
    scope.route("/reconcile", web::post().to(reconcile))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReconcileQuery {
    #[serde(default)]
    dry_run: bool,
}

/// A pass now (after one in progress ends). The answer: counts and the drifts found. A dry run
/// changes nothing: any node makes one; else the active's work (see `asks`).
async fn reconcile(
    shared: web::Data<Ops>,
    query: web::Query<ReconcileQuery>,
) -> Result<HttpResponse, ApiError> {
    let ok = |body| Ok(HttpResponse::Ok().json(body));
    match query.dry_run {
        true => pass(&shared, true).await.and_then(ok),
        false => super::asks::answer(&shared, storage::asks::Ask::Reconcile, ok).await,
    }
}

/// A pass that hands what it finds to the writer, on the active node: its report.
pub(crate) async fn pass_now(shared: &Ops) -> Result<serde_json::Value, ApiError> {
    pass(shared, false).await
}

async fn pass(shared: &Ops, dry_run: bool) -> Result<serde_json::Value, ApiError> {
    tracing::info!(dry_run, "reconciliation pass asked for by an operator");
    match shared.reconcile.pass(dry_run).await {
        Ok(report) => serde_json::to_value(report).map_err(|e| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
        }),
        Err(SweepError::WriterStopped) => Err(ApiError::unavailable(
            "the daemon is shutting down: the pass was not finished",
        )),
        Err(e) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "reconcile_failed",
            e.to_string(),
        )),
    }
}
