//! The console's actions (POST): sign in and out, a conversation's commands, dead letters and
//! quarantine, the rules' dry run. Every form carries the session's CSRF token; every action
//! needs the operator role (the dry run, which changes nothing, any role). An action takes the
//! path its API takes, goes into the audit list, and redirects back (303) with a notice.

use super::pages::{rules_page, SignInPage};
use super::session::{self, Session};
use super::view::Frame;
use super::{html, see_other, Console, ConsoleError, Signed, PREFIX};
use crate::helpdesk::commands::ConsoleCommand;
use crate::ops::asks::Ran;
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::Deserialize;
use storage::asks::Ask;

/// The longest reply typed in the console: the agent API's.
const MAX_REPLY: usize = crate::helpdesk::contract::MAX_TEXT;

pub(super) fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/sign-in", web::post().to(sign_in))
        .route("/sign-out", web::post().to(sign_out))
        .route("/conversations/{id}/{command}", web::post().to(command))
        .route("/dead-letters/{seq}/{what}", web::get().to(confirm_letter))
        .route("/dead-letters/{seq}/{what}", web::post().to(letter))
        .route("/dead-letters-retry", web::get().to(confirm_retry_matching))
        .route("/dead-letters-retry", web::post().to(retry_matching))
        .route("/quarantine/{id}/reprocess", web::post().to(reprocess))
        .route("/rules/test", web::post().to(rules_test));
}

// ---- Sign in and out ----

#[derive(Deserialize)]
struct SignInForm {
    #[serde(default)]
    token: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    form: String,
}

async fn sign_in(
    console: web::Data<Console>,
    req: HttpRequest,
    form: web::Form<SignInForm>,
) -> HttpResponse {
    let form = form.into_inner();
    let secure = console.ops.proxies.over_tls(&req);
    let opened = if !session::sign_in_form_ok(&req, &form.form) {
        Err(session::SignInError::Form)
    } else {
        match console.role_of(form.token.trim()) {
            Some(role) => console.sessions.open(role, &form.name),
            None => Err(session::SignInError::BadToken),
        }
    };
    match opened {
        Ok(id) => {
            let mut response = see_other(&format!("{PREFIX}/"));
            let cookies = [
                console.sessions.cookie(id, secure),
                session::removal(session::SIGN_IN_COOKIE, secure),
            ];
            for cookie in cookies {
                if let Err(e) = response.add_cookie(&cookie) {
                    tracing::error!(error = %e, "cannot set a console cookie");
                }
            }
            response
        }
        Err(e) => {
            tracing::info!(reason = %e, "console sign-in refused");
            let (form_token, cookie) = session::sign_in_form(secure);
            let status = match e {
                session::SignInError::Full => StatusCode::SERVICE_UNAVAILABLE,
                session::SignInError::BadToken => StatusCode::UNAUTHORIZED,
                _ => StatusCode::BAD_REQUEST,
            };
            let page = SignInPage {
                form_token,
                error: Some(e.to_string()),
            };
            let mut response = html(status, page);
            if let Err(e) = response.add_cookie(&cookie) {
                tracing::error!(error = %e, "cannot set the sign-in cookie");
            }
            response
        }
    }
}

#[derive(Deserialize)]
struct Csrf {
    #[serde(default)]
    csrf: String,
}

async fn sign_out(
    console: web::Data<Console>,
    req: HttpRequest,
    signed: Signed,
    form: web::Form<Csrf>,
) -> Result<HttpResponse, ConsoleError> {
    signed.checked(&form.csrf)?;
    console.sessions.close(&req);
    let mut response = see_other(&format!("{PREFIX}/sign-in"));
    let removal = session::removal(session::COOKIE, console.ops.proxies.over_tls(&req));
    if let Err(e) = response.add_cookie(&removal) {
        tracing::error!(error = %e, "cannot end the console cookie");
    }
    Ok(response)
}

// ---- A conversation's commands ----

#[derive(Deserialize)]
struct CommandForm {
    #[serde(default)]
    csrf: String,
    /// The form's own key: sending it twice is one command.
    #[serde(default)]
    key: String,
    /// As whom (accept, reply): the signed-in name unless another is typed.
    #[serde(default)]
    agent: String,
    #[serde(default)]
    text: String,
    #[serde(default)]
    flow_id: String,
}

async fn command(
    console: web::Data<Console>,
    signed: Signed,
    path: web::Path<(String, String)>,
    form: web::Form<CommandForm>,
) -> Result<HttpResponse, ConsoleError> {
    let session = signed.acting(&form.csrf)?;
    let (id, name) = path.into_inner();
    let form = form.into_inner();
    let agent = Some(form.agent.trim())
        .filter(|a| !a.is_empty())
        .unwrap_or(&session.name)
        .to_owned();
    let (cmd, done) = match name.as_str() {
        "accept" => (ConsoleCommand::Accept { agent }, "accepted"),
        "reply" => {
            let text = form.text.trim().to_owned();
            if text.is_empty() || text.chars().count() > MAX_REPLY {
                return Err(ConsoleError::BadRequest(format!(
                    "a reply is 1 to {MAX_REPLY} characters"
                )));
            }
            (ConsoleCommand::Reply { agent, text }, "replied")
        }
        "release" => (ConsoleCommand::Release, "released"),
        "transfer" => {
            let flow_id = form.flow_id.trim().parse::<i64>().map_err(|_| {
                ConsoleError::BadRequest("a flow id is a number (the flow to move to)".into())
            })?;
            (ConsoleCommand::Transfer { flow_id }, "transferred")
        }
        _ => return Err(ConsoleError::NotFound("no such command".into())),
    };
    if form.key.is_empty() || form.key.len() > 64 {
        return Err(ConsoleError::Csrf);
    }
    let what = format!("{name} {id}");
    let key = format!("console:{}", form.key);
    let (status, body, replayed) = console.commands.console(id.clone(), cmd, key).await;
    let mut result = command_result(status, &body);
    if replayed {
        result.push_str(" (the same form again: its first answer, nothing done twice)");
    }
    record(&console, session, what, result.clone()).await;
    if status.is_success() {
        return Ok(see_other(&format!(
            "{PREFIX}/conversations/{}?done={done}",
            encode(&id)
        )));
    }
    Err(ConsoleError::of_status(status, result))
}

/// How a command ended, from the agent API's answer.
fn command_result(status: StatusCode, body: &serde_json::Value) -> String {
    if status.is_success() {
        let changed = body["changed"].as_bool() == Some(true);
        return if changed {
            "applied"
        } else {
            "applied (no change)"
        }
        .to_owned();
    }
    let message = body["error"]["message"].as_str().unwrap_or("refused");
    format!("refused ({}): {message}", status.as_u16())
}

// ---- Dead letters ----

#[derive(askama::Template)]
#[template(path = "console/confirm.html")]
struct ConfirmPage {
    frame: Frame,
    question: String,
    action: String,
    /// Hidden fields the confirming form sends (besides the CSRF token).
    fields: Vec<(&'static str, String)>,
    back: String,
}

/// `retry` or `discard` a dead letter: asked first.
async fn confirm_letter(
    signed: Signed,
    path: web::Path<(u64, String)>,
) -> Result<HttpResponse, ConsoleError> {
    signed.operator()?;
    let (seq, what) = path.into_inner();
    let question = match what.as_str() {
        "retry" => format!(
            "Retry dead letter {seq}? It goes back into the outbox and is carried out again."
        ),
        "discard" => {
            format!("Discard dead letter {seq}? It is dropped for good (the audit keeps it).")
        }
        _ => return Err(ConsoleError::NotFound("no such action".into())),
    };
    let page = ConfirmPage {
        frame: Frame::new(&signed.0, "outbox", None),
        question,
        action: format!("{PREFIX}/dead-letters/{seq}/{what}"),
        fields: Vec::new(),
        back: format!("{PREFIX}/outbox"),
    };
    Ok(html(StatusCode::OK, page))
}

async fn letter(
    console: web::Data<Console>,
    signed: Signed,
    path: web::Path<(u64, String)>,
    form: web::Form<Csrf>,
) -> Result<HttpResponse, ConsoleError> {
    let session = signed.acting(&form.csrf)?;
    let (seq, what) = path.into_inner();
    let (ask, done) = match what.as_str() {
        "retry" => (Ask::Retry { ids: vec![seq] }, "retried"),
        "discard" => {
            let reason = format!("discarded from the console by {}", session.name);
            (Ask::Drop { id: seq, reason }, "discarded")
        }
        _ => return Err(ConsoleError::NotFound("no such action".into())),
    };
    let what = format!("{what} dead letter {seq}");
    // A letter gone is refused whichever node found it so (here: an error; the active: its 404).
    let found = match crate::ops::asks::run(&console.ops, ask).await {
        Ok(Ran::Done(body)) => match done {
            "retried" => body["retried"].as_array().is_some_and(|r| !r.is_empty()),
            _ => true,
        },
        Ok(Ran::Relayed { status, .. }) if status == StatusCode::NOT_FOUND => false,
        Err(e) if e.status == StatusCode::NOT_FOUND => false,
        Ok(Ran::Relayed { status, body }) => return Err(relayed(status, &body)),
        Ok(Ran::Waiting(id)) => return Ok(asked(&console, session, what, id).await),
        Err(e) => return Err(e.into()),
    };
    if !found {
        record(
            &console,
            session,
            what,
            "refused: no such dead letter".into(),
        )
        .await;
        return Err(ConsoleError::NotFound(format!("no dead letter {seq}")));
    }
    record(&console, session, what, "applied".into()).await;
    Ok(see_other(&format!("{PREFIX}/outbox?done={done}")))
}

/// The active node refused or failed what this standby asked of it: its message, as a page.
fn relayed(status: StatusCode, body: &serde_json::Value) -> ConsoleError {
    let message = body["error"]["message"]
        .as_str()
        .unwrap_or("the active node failed");
    ConsoleError::of_status(status, message.to_owned())
}

/// Stored for the active node, not answered yet: recorded as asked, and said so.
async fn asked(console: &Console, session: &Session, what: String, id: u64) -> HttpResponse {
    record(
        console,
        session,
        what,
        format!("asked of the active node (ask {id})"),
    )
    .await;
    see_other(&format!("{PREFIX}/outbox?done=asked"))
}

/// Which dead letters "retry all matching" takes: those whose reason and queue contain these
/// (empty: any).
#[derive(Clone, Deserialize)]
struct Matching {
    #[serde(default)]
    reason: String,
    #[serde(default)]
    queue: String,
}

impl Matching {
    fn takes(&self, letter: &model::action::DeadLetter) -> bool {
        crate::ops::outbox_admin::matches(letter, &self.reason, &self.queue)
    }

    fn describe(&self) -> String {
        match (self.reason.trim(), self.queue.trim()) {
            ("", "") => "every dead letter".into(),
            (r, "") => format!("dead letters whose reason contains \"{r}\""),
            ("", q) => format!("dead letters whose queue contains \"{q}\""),
            (r, q) => format!("dead letters whose reason contains \"{r}\" and queue \"{q}\""),
        }
    }
}

/// Every matching dead letter's number, a page at a time (never all letters in memory).
async fn matching_letters(console: &Console, m: &Matching) -> Result<Vec<u64>, ConsoleError> {
    let (mut found, mut after) = (Vec::new(), None);
    loop {
        let m = m.clone();
        let page = crate::ops::outbox_admin::letters_page(&console.ops, after, move |l| m.takes(l));
        let (seqs, next) = page.await?;
        found.extend(seqs);
        let Some(next) = next else { break };
        after = Some(next);
    }
    Ok(found)
}

async fn confirm_retry_matching(
    console: web::Data<Console>,
    signed: Signed,
    m: web::Query<Matching>,
) -> Result<HttpResponse, ConsoleError> {
    signed.operator()?;
    let m = m.into_inner();
    let count = matching_letters(&console, &m).await?.len();
    let page = ConfirmPage {
        frame: Frame::new(&signed.0, "outbox", None),
        question: format!("Retry {} ({count} now)?", m.describe()),
        action: format!("{PREFIX}/dead-letters-retry"),
        fields: vec![("reason", m.reason), ("queue", m.queue)],
        back: format!("{PREFIX}/outbox"),
    };
    Ok(html(StatusCode::OK, page))
}

#[derive(Deserialize)]
struct RetryMatchingForm {
    #[serde(default)]
    csrf: String,
    #[serde(flatten)]
    matching: Matching,
}

async fn retry_matching(
    console: web::Data<Console>,
    signed: Signed,
    form: web::Form<RetryMatchingForm>,
) -> Result<HttpResponse, ConsoleError> {
    let session = signed.acting(&form.csrf)?;
    let what = format!("retry {}", form.matching.describe());
    let ask = Ask::RetryMatching {
        reason: form.matching.reason.clone(),
        queue: form.matching.queue.clone(),
    };
    let retried = match crate::ops::asks::run(&console.ops, ask).await? {
        Ran::Done(body) => body["retried"].as_array().map_or(0, Vec::len),
        Ran::Relayed { status, body } => return Err(relayed(status, &body)),
        Ran::Waiting(id) => return Ok(asked(&console, session, what, id).await),
    };
    record(
        &console,
        session,
        what,
        format!("applied: {retried} retried"),
    )
    .await;
    Ok(see_other(&format!("{PREFIX}/outbox?done=retried_all")))
}

// ---- Quarantine ----

async fn reprocess(
    console: web::Data<Console>,
    signed: Signed,
    id: web::Path<u64>,
    form: web::Form<Csrf>,
) -> Result<HttpResponse, ConsoleError> {
    let session = signed.acting(&form.csrf)?;
    let id = id.into_inner();
    let what = format!("re-process quarantine record {id}");
    match crate::ops::admin::reprocess(&console.ops, id).await {
        Ok(outcome) => {
            record(&console, session, what, outcome.status.clone()).await;
            Ok(see_other(&format!("{PREFIX}/quarantine?done=reprocessed")))
        }
        Err(e) => {
            record(&console, session, what, format!("refused: {}", e.message)).await;
            Err(e.into())
        }
    }
}

// ---- Rules: the dry run ----

#[derive(Deserialize)]
struct DryRun {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    event: String,
}

/// `rules test` in the browser: what the rules in force decide for a pasted event or delivery,
/// folded into a new conversation at the daemon's time. Nothing is stored.
async fn rules_test(
    console: web::Data<Console>,
    signed: Signed,
    form: web::Form<DryRun>,
) -> Result<HttpResponse, ConsoleError> {
    signed.checked(&form.csrf)?;
    let frame = Frame::new(&signed.0, "rules", None);
    let event = form.into_inner().event;
    let (_, set) = console.ops.rules.live.current_explained();
    let now = console.ops.store.clock().now_millis();
    let (report, error) = match (set, model::webhook::events_of(event.as_bytes())) {
        (None, _) => (Vec::new(), Some("rules are turned off".to_owned())),
        (_, Err(e)) => (Vec::new(), Some(format!("not an event or delivery: {e}"))),
        (Some(set), Ok(events)) => {
            let reports = engine::rules::explain::explain_events(&set, events, None, None, now);
            let text = reports
                .iter()
                .map(|(head, verdicts)| {
                    let body = verdicts
                        .as_ref()
                        .map(|v| engine::rules::explain::render_text(v))
                        .unwrap_or_default();
                    (head.clone(), body)
                })
                .collect();
            (text, None)
        }
    };
    let page = rules_page(&console, frame, event, report, error);
    Ok(html(StatusCode::OK, page))
}

// ---- Helpers ----

/// An action into the audit list.
async fn record(console: &Console, session: &Session, what: String, result: String) {
    let action = storage::operators::OperatorAction {
        at: console.ops.store.clock().now_millis(),
        who: session.name.clone(),
        role: session.role.as_str().to_owned(),
        what,
        result,
    };
    super::audit::record(&console.ops, action).await;
}

/// A path segment, percent-encoded (RFC 3986's unreserved characters kept).
fn encode(segment: &str) -> String {
    const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'_')
        .remove(b'.')
        .remove(b'~');
    percent_encoding::utf8_percent_encode(segment, SEGMENT).to_string()
}
