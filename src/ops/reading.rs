//! What the admin API's handlers share: store work on the blocking pool, a page of a list, a
//! record id from the path, the store's failure as an answer.

use super::Ops;
use crate::queries::List;
use actix_web::http::StatusCode;
use actix_web::{web, HttpResponse};
use api_error::ApiError;
use serde::Deserialize;

pub(super) fn store_error(e: storage::StoreError) -> ApiError {
    tracing::error!(error = %e, "admin read failed");
    ApiError::unavailable("the store cannot be read now")
}

/// Store work of an admin call, on the blocking pool: sled calls can wait for its lock (a
/// transaction) or its I/O, and must not hold an HTTP worker, which also answers the webhook.
pub(super) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, storage::StoreError> + Send + 'static,
) -> Result<T, ApiError> {
    web::block(work)
        .await
        .map_err(|e| {
            ApiError::new(
                actix_web::http::StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                e.to_string(),
            )
        })?
        .map_err(store_error)
}

/// A value as JSON text (for answers encoded off the HTTP workers; a `Value` always encodes).
pub(super) fn json_bytes(value: &serde_json::Value) -> Result<Vec<u8>, storage::StoreError> {
    serde_json::to_vec(value).map_err(|e| storage::StoreError::Corrupt(e.to_string()))
}

/// A numeric record id from the path; `what` names it in the error ("quarantine id").
pub(super) fn parse_id(text: &str, what: &str) -> Result<u64, ApiError> {
    text.parse().map_err(|_| {
        ApiError::new(
            actix_web::http::StatusCode::BAD_REQUEST,
            "invalid_id",
            format!("{what} must be a number"),
        )
    })
}

/// `?limit=` (default 100, 1 to 1000) and `?after=` (the previous page's `next`), as text: a
/// bad value is answered 400 with its own code (`invalid_limit`, `invalid_cursor`), not the
/// extractor's.
#[derive(Deserialize)]
pub(super) struct ListQuery {
    limit: Option<String>,
    after: Option<String>,
}

/// One page of `list` (`queries::List`) with the fields of `extra` added, read and encoded on
/// the blocking pool (a page of a thousand items is not encoded on an HTTP worker).
pub(super) async fn list_page(
    shared: &Ops,
    list: List,
    q: &ListQuery,
    extra: serde_json::Map<String, serde_json::Value>,
) -> Result<HttpResponse, ApiError> {
    let query = list
        .query(q.limit.as_deref(), q.after.as_deref())
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.code(), e.to_string()))?;
    let store = shared.store.clone();
    let json = blocking(move || {
        let mut page = query.read(&*store)?;
        if let Some(obj) = page.as_object_mut() {
            obj.extend(extra);
        }
        json_bytes(&page)
    })
    .await?;
    Ok(HttpResponse::Ok()
        .content_type(actix_web::http::header::ContentType::json())
        .body(json))
}

/// How often [`wait_in_store`] looks.
const LOOK_EVERY: std::time::Duration = std::time::Duration::from_millis(20);

/// Wait until `done` says so of the store (read on the blocking pool every [`LOOK_EVERY`]), at
/// most `timeout`: whether it did. For several nodes on one store, where what this process
/// holds in memory is not the whole truth (another node folds, carries the outbox out).
pub(super) async fn wait_in_store(
    store: &storage::Store,
    timeout: std::time::Duration,
    done: fn(&dyn storage::Storage) -> Result<bool, storage::StoreError>,
) -> Result<bool, storage::StoreError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let s = store.clone();
        let found = web::block(move || done(&*s))
            .await
            .map_err(|e| storage::StoreError::Internal(e.to_string()))??;
        if found || tokio::time::Instant::now() >= deadline {
            return Ok(found);
        }
        tokio::time::sleep(LOOK_EVERY).await;
    }
}
