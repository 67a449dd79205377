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

/// A pass now (after one in progress ends). The answer: counts and the drifts found.
async fn reconcile(
    shared: web::Data<Ops>,
    query: web::Query<ReconcileQuery>,
) -> Result<HttpResponse, ApiError> {
    let dry_run = query.dry_run;
    // A dry run changes nothing: any node may make one.
    if !dry_run {
        super::active_only(&shared).await?;
    }
    tracing::info!(dry_run, "reconciliation pass asked for by an operator");
    match shared.reconcile.pass(dry_run).await {
        Ok(report) => Ok(HttpResponse::Ok().json(report)),
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
