//! `POST /admin/v1/prune` (mounted under `/admin/v1` by `admin`): run a pruning pass now (after
//! the one running, if any) and answer what it removed (`prune::PruneReport`).

use super::Ops;
use crate::prune::PruneError;
use actix_web::http::StatusCode;
use actix_web::{web, HttpResponse};
use api_error::ApiError;
use storage::writer::WriterError;

pub fn routes(scope: actix_web::Scope) -> actix_web::Scope {
    scope.route("/prune", web::post().to(prune))
}

/// The active's work (see `asks`).
async fn prune(shared: web::Data<Ops>) -> Result<HttpResponse, ApiError> {
    let ask = storage::asks::Ask::Prune;
    super::asks::answer(&shared, ask, |body| Ok(HttpResponse::Ok().json(body))).await
}

/// A pass on the active node: its report.
pub(crate) async fn pass_now(shared: &Ops) -> Result<serde_json::Value, ApiError> {
    tracing::info!("pruning pass asked for by an operator");
    match shared.pruner.pass().await {
        Ok(report) => serde_json::to_value(report).map_err(|e| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
        }),
        Err(PruneError::Flush(WriterError::Stopped)) => Err(ApiError::unavailable(
            "the daemon is shutting down: the pass was not run",
        )),
        Err(e) => {
            tracing::warn!(error = %e, "prune failed");
            Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "prune_failed",
                format!("the pruning pass failed; the next one tries again: {e}"),
            ))
        }
    }
}
