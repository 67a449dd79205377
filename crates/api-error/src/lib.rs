//! The one error body every HTTP endpoint answers with: `{"error": {"code", "message"}}`, where
//! `code` is stable and meant for programs, `message` for people.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;
use std::fmt;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// The request field at fault (a `400 invalid_body`), shown as `error.field`.
    pub field: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            field: None,
        }
    }
    /// Name the request field at fault.
    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }
    /// The body this error answers with, as JSON (the agent API stores it for idempotent
    /// retries).
    pub fn body(&self) -> serde_json::Value {
        serde_json::to_value(Body {
            error: Inner {
                code: self.code,
                message: &self.message,
                field: self.field.as_deref(),
            },
        })
        .unwrap_or(serde_json::Value::Null)
    }
    pub fn unauthorized(message: &str) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }
    pub fn forbidden(message: &str) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            message,
        )
    }
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    code: &'a str,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<&'a str>,
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }
    fn error_response(&self) -> HttpResponse {
        HttpResponse::build(self.status).json(self.body())
    }
}

/// JSON 404 for unknown paths, JSON 405 for known paths with the wrong method.
pub async fn not_found() -> HttpResponse {
    ApiError::not_found("no such endpoint").error_response()
}

pub async fn method_not_allowed() -> HttpResponse {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "method not allowed on this endpoint",
    )
    .error_response()
}

/// JSON 503 `starting` with `Retry-After`: the daemon takes webhook deliveries while its store
/// opens, and nothing else yet.
pub async fn starting() -> HttpResponse {
    starting_because("the daemon is starting (its store is opening); retry shortly")
}

/// [`starting`] with its own message.
pub fn starting_because(message: &str) -> HttpResponse {
    let mut response =
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "starting", message).error_response();
    response.headers_mut().insert(
        actix_web::http::header::RETRY_AFTER,
        actix_web::http::header::HeaderValue::from_static("1"),
    );
    response
}

/// JSON 503 `store_unavailable` with `Retry-After` (seconds): the store cannot take a write now
/// (the database away, a failing disk); nothing was acknowledged.
pub fn unavailable_retry_after(message: &str, seconds: u32) -> HttpResponse {
    let mut response = ApiError::unavailable(message).error_response();
    if let Ok(value) = actix_web::http::header::HeaderValue::from_str(&seconds.to_string()) {
        response
            .headers_mut()
            .insert(actix_web::http::header::RETRY_AFTER, value);
    }
    response
}

/// JSON 405 with the `Allow` header: the methods the path does serve (`allow`, e.g. `"GET"` or
/// `"GET, POST"`), as RFC 9110 asks of a 405.
pub fn method_not_allowed_allowing(allow: &str) -> HttpResponse {
    let mut response = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("method not allowed on this endpoint (allowed: {allow})"),
    )
    .error_response();
    if let Ok(value) = actix_web::http::header::HeaderValue::from_str(allow) {
        response
            .headers_mut()
            .insert(actix_web::http::header::ALLOW, value);
    }
    response
}

/// Query strings that do not parse get the JSON error body too (actix answers plain text).
pub fn query_config() -> actix_web::web::QueryConfig {
    actix_web::web::QueryConfig::default().error_handler(|err, _| {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_query", err.to_string()).into()
    })
}
