//! The operator console: the handoffs seen and steered in a browser, at `/console/` on the admin
//! listener only (never the public one). Pages are rendered on the server from templates checked
//! at compile time (askama, `templates/console/`), escaped by default; the one stylesheet is
//! embedded in the binary; there is no script, so every page and form works with JavaScript off.
//!
//! - Who: a person signs in with a token and names themself ([`session`]): the admin token is the
//!   operator role, `admin.viewer_tokens` the read-only viewer. Every state-changing form carries
//!   the session's CSRF token; the server refuses a viewer's action whatever the page showed.
//! - What: the reads are those of the admin API and the agent API (the same store indexes);
//!   every action goes through the path its API takes ([`actions`]): conversation commands
//!   through the agent API's (event, fold, verdict, idempotent per form), dead letters and
//!   quarantine through the admin API's. Each action goes into the audit list ([`audit`]).
//! - Headers: a strict Content-Security-Policy (nothing but this origin's stylesheet, no script,
//!   forms to this origin only), `X-Frame-Options: DENY`, no caching, no referrer.

mod actions;
mod audit;
mod pages;
mod session;
mod view;

use actix_web::dev::Payload;
use actix_web::http::{header, StatusCode};
use actix_web::{web, FromRequest, HttpRequest, HttpResponse, ResponseError};
use askama::Template;
pub use session::Role;
use session::{Session, Sessions};

/// Where the console is served (on the admin listener).
pub const PREFIX: &str = "/console";
/// The longest form body it reads (a pasted event for the rules' dry run is the largest).
pub const MAX_BODY: usize = 256 * 1024;

/// The console's handler state.
pub struct Console {
    ops: web::Data<crate::ops::Ops>,
    /// The command path (the agent API's): accept, reply, release, transfer.
    commands: std::sync::Arc<crate::helpdesk::commands::Commands>,
    /// The Open API, for a conversation's transcript.
    upstream: upstream::handle::UpstreamHandle,
    viewers: crate::intake::auth::TokenSet,
    sessions: Sessions,
}

impl Console {
    pub fn new(
        ops: web::Data<crate::ops::Ops>,
        commands: std::sync::Arc<crate::helpdesk::commands::Commands>,
        upstream: upstream::handle::UpstreamHandle,
        config: &crate::config::AdminConfig,
    ) -> Self {
        Console {
            ops,
            commands,
            upstream,
            viewers: crate::intake::auth::TokenSet::new(config.viewer_tokens.clone()),
            sessions: Sessions::new(config.console_session),
        }
    }

    /// The role a token signs in as, if any.
    fn role_of(&self, token: &str) -> Option<Role> {
        if self.ops.admin_tokens.accepts(token) {
            Some(Role::Operator)
        } else if self.viewers.accepts(token) {
            Some(Role::Viewer)
        } else {
            None
        }
    }
}

/// The console's routes, with its security headers, under [`PREFIX`].
pub fn routes(cfg: &mut web::ServiceConfig) {
    let headers = actix_web::middleware::DefaultHeaders::new()
        .add((
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'",
        ))
        .add((header::X_FRAME_OPTIONS, "DENY"))
        .add((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .add((header::REFERRER_POLICY, "no-referrer"))
        .add((header::CACHE_CONTROL, "no-store"));
    cfg.route(PREFIX, web::get().to(pages::to_overview));
    cfg.service(
        web::scope(PREFIX)
            .wrap(actix_web::middleware::from_fn(allowed_addresses))
            .wrap(headers)
            .configure(pages::routes)
            .configure(actions::routes)
            .default_service(web::to(not_found)),
    );
}

/// The console answers the addresses the admin API answers (`admin.allow_cidrs`), judged on the
/// client address as everywhere ([`crate::client_addr`]): the sign-in form included.
async fn allowed_addresses(
    req: actix_web::dev::ServiceRequest,
    next: actix_web::middleware::Next<impl actix_web::body::MessageBody + 'static>,
) -> Result<actix_web::dev::ServiceResponse<impl actix_web::body::MessageBody>, actix_web::Error> {
    let allowed = req.app_data::<web::Data<Console>>().is_some_and(|c| {
        c.ops
            .admin_cidrs
            .allows(c.ops.proxies.of_request(req.request()))
    });
    if !allowed {
        let refused = ConsoleError::Forbidden("the console is not open to this address".into());
        return Ok(req.error_response(refused).map_into_right_body());
    }
    Ok(next.call(req).await?.map_into_left_body())
}

async fn not_found() -> Result<HttpResponse, ConsoleError> {
    Err(ConsoleError::NotFound("no such page".into()))
}

/// A signed-in request: the extractor redirects to the sign-in page without a session.
pub struct Signed(Session);

impl FromRequest for Signed {
    type Error = ConsoleError;
    type Future = std::future::Ready<Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let session = req
            .app_data::<web::Data<Console>>()
            .and_then(|console| console.sessions.of_request(req));
        std::future::ready(session.map(Signed).ok_or(ConsoleError::SignIn))
    }
}

impl Signed {
    /// An operator's session whose form carried its CSRF token; refused otherwise (a viewer's
    /// forged form included).
    fn acting(&self, csrf: &str) -> Result<&Session, ConsoleError> {
        self.checked(csrf)?;
        self.operator()
    }

    /// An operator's session (a page that only leads to an action: its confirmation).
    fn operator(&self) -> Result<&Session, ConsoleError> {
        if self.0.role != Role::Operator {
            return Err(ConsoleError::Forbidden(
                "viewers cannot change anything: sign in with the admin token to act".into(),
            ));
        }
        Ok(&self.0)
    }

    /// A session whose form carried its CSRF token.
    fn checked(&self, csrf: &str) -> Result<&Session, ConsoleError> {
        if !self.0.csrf_ok(csrf) {
            return Err(ConsoleError::Csrf);
        }
        Ok(&self.0)
    }
}

/// Why a console request was not answered with its page.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    #[error("sign in first")]
    SignIn,
    #[error("the form is missing its security token or it is stale: reload the page and retry")]
    Csrf,
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    BadRequest(String),
    /// Refused because of the conversation's state (409 from the agent API).
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Unavailable(String),
}

impl From<storage::StoreError> for ConsoleError {
    fn from(e: storage::StoreError) -> Self {
        tracing::error!(error = %e, "console read failed");
        ConsoleError::Unavailable("the store cannot be read now; retry in a moment".into())
    }
}

impl ConsoleError {
    /// The page for an API's refusal with `status`, saying `text`.
    fn of_status(status: StatusCode, text: String) -> Self {
        match status {
            StatusCode::NOT_FOUND => ConsoleError::NotFound(text),
            StatusCode::CONFLICT => ConsoleError::Conflict(text),
            s if s.is_client_error() => ConsoleError::BadRequest(text),
            _ => ConsoleError::Unavailable(text),
        }
    }
}

impl From<api_error::ApiError> for ConsoleError {
    fn from(e: api_error::ApiError) -> Self {
        ConsoleError::of_status(e.status, e.message)
    }
}

#[derive(Template)]
#[template(path = "console/error.html")]
struct ErrorPage<'a> {
    status: u16,
    message: &'a str,
}

impl ResponseError for ConsoleError {
    fn status_code(&self) -> StatusCode {
        match self {
            ConsoleError::SignIn => StatusCode::SEE_OTHER,
            ConsoleError::Csrf | ConsoleError::Forbidden(_) => StatusCode::FORBIDDEN,
            ConsoleError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ConsoleError::Conflict(_) => StatusCode::CONFLICT,
            ConsoleError::NotFound(_) => StatusCode::NOT_FOUND,
            ConsoleError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    fn error_response(&self) -> HttpResponse {
        if let ConsoleError::SignIn = self {
            return HttpResponse::SeeOther()
                .insert_header((header::LOCATION, format!("{PREFIX}/sign-in")))
                .finish();
        }
        let message = self.to_string();
        let status = self.status_code();
        html(
            status,
            ErrorPage {
                status: status.as_u16(),
                message: &message,
            },
        )
    }
}

/// A rendered page (a template that fails to render is a bug: said plainly, logged).
fn html(status: StatusCode, page: impl Template) -> HttpResponse {
    match page.render() {
        Ok(body) => HttpResponse::build(status)
            .content_type("text/html; charset=utf-8")
            .body(body),
        Err(e) => {
            tracing::error!(error = %e, "console page failed to render");
            HttpResponse::InternalServerError()
                .content_type("text/plain; charset=utf-8")
                .body("the page failed to render")
        }
    }
}

/// A redirect after a form (303: the browser then GETs `to`).
fn see_other(to: &str) -> HttpResponse {
    HttpResponse::SeeOther()
        .insert_header((header::LOCATION, to.to_owned()))
        .finish()
}
