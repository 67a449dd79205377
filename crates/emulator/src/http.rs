//! The HTTP face of the emulator: routing by the contract's own path templates, then, per call,
//! latency and faults, authentication, idempotency, the state, and the journal. Plus the
//! `/_emulator` admin paths, which need no key.

use super::faults::{Fault, FaultConfig};
use super::journal::JournalEntry;
use super::state::{error_body, ErrorAnswer, Reply};
use super::{lock, Emulator};
use actix_web::http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use futures_util::StreamExt;
use model::contract::Endpoint;
use model::secret::Secret;
use serde_json::{Map, Value};
use std::collections::{HashMap, VecDeque};
use subtle::ConstantTimeEq;

/// Larger bodies are refused (400) without being read to the end.
const MAX_BODY_BYTES: usize = 1024 * 1024;
const REPLAYED: &str = "idempotent-replayed";
/// How long a dropped call's partial answer stands before the connection is cut.
const DROP_PAUSE: std::time::Duration = std::time::Duration::from_millis(20);
/// A dropped call announces this `Content-Length` and sends far less, so any client can tell
/// the body was cut (a chunked body cut at a chunk boundary can pass for complete).
const DROP_PROMISED_BYTES: u64 = 4096;

pub(super) fn configure(emulator: Emulator, cfg: &mut web::ServiceConfig) {
    let data = web::Data::new(emulator);
    let not_allowed = || web::to(api_error::method_not_allowed);
    cfg.service(
        web::scope("/openapi")
            .app_data(data.clone())
            .default_service(web::to(openapi)),
    )
    .service(
        web::scope("/_emulator")
            .app_data(data)
            .service(
                web::resource("/journal")
                    .route(web::get().to(get_journal))
                    .route(web::delete().to(clear_journal))
                    .default_service(not_allowed()),
            )
            .service(
                web::resource("/faults")
                    .route(web::get().to(get_faults))
                    .route(web::post().to(set_faults))
                    .route(web::delete().to(clear_faults))
                    .default_service(not_allowed()),
            )
            .service(
                web::resource("/state")
                    .route(web::get().to(get_state))
                    .default_service(not_allowed()),
            )
            .service(
                web::resource("/conversations/{id}/manual")
                    .route(web::post().to(set_manual_silently))
                    .default_service(not_allowed()),
            )
            .service(
                web::resource("/reset")
                    .route(web::post().to(reset))
                    .default_service(not_allowed()),
            )
            .configure(super::sender::routes)
            .default_service(web::to(api_error::not_found)),
    );
}

/// The API key check. Only a yes or no leaves it: the key is never echoed or logged.
pub(super) struct Auth {
    pub header: HeaderName,
    pub scheme: Option<String>,
    pub key: Secret,
}

impl Auth {
    fn accepts(&self, req: &HttpRequest) -> bool {
        let Some(value) = req
            .headers()
            .get(&self.header)
            .and_then(|v| v.to_str().ok())
        else {
            return false;
        };
        let candidate = match &self.scheme {
            Some(scheme) => match value.trim().split_once(' ') {
                Some((s, rest)) if s.eq_ignore_ascii_case(scheme) => rest.trim(),
                _ => return false,
            },
            None => value.trim(),
        };
        bool::from(self.key.expose().as_bytes().ct_eq(candidate.as_bytes()))
    }
}

/// First answers by idempotency key, bounded (oldest forgotten first).
pub(super) struct IdempotencyStore {
    answers: HashMap<String, Reply>,
    order: VecDeque<String>,
    capacity: usize,
}

impl IdempotencyStore {
    pub fn new(capacity: usize) -> Self {
        IdempotencyStore {
            answers: HashMap::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    fn get(&self, key: &str) -> Option<&Reply> {
        self.answers.get(key)
    }

    fn insert(&mut self, key: String, reply: Reply) {
        if self.answers.len() >= self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.answers.remove(&old);
            }
        }
        self.order.push_back(key.clone());
        self.answers.insert(key, reply);
    }

    pub fn clear(&mut self) {
        self.answers.clear();
        self.order.clear();
    }
}

/// Path parameters by template name, decoded.
type PathParams = Vec<(&'static str, String)>;

#[derive(Debug, PartialEq, Eq)]
enum RouteMiss {
    NotFound,
    MethodNotAllowed,
}

/// Matches a path against every endpoint's template; path parameters come back decoded.
fn route(method: &str, path: &str) -> Result<(Endpoint, PathParams), RouteMiss> {
    let segments: Vec<&str> = path.split('/').collect();
    let mut path_known = false;
    for endpoint in Endpoint::ALL {
        if let Some(params) = match_template(endpoint.path_template(), &segments) {
            if endpoint.method() == method {
                return Ok((endpoint, params));
            }
            path_known = true;
        }
    }
    Err(if path_known {
        RouteMiss::MethodNotAllowed
    } else {
        RouteMiss::NotFound
    })
}

fn match_template(template: &'static str, segments: &[&str]) -> Option<PathParams> {
    let parts: Vec<&'static str> = template.split('/').collect();
    if parts.len() != segments.len() {
        return None;
    }
    let mut params = Vec::new();
    for (part, seg) in parts.into_iter().zip(segments) {
        match part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
            Some(name) => {
                if seg.is_empty() {
                    return None;
                }
                let value = percent_encoding::percent_decode_str(seg)
                    .decode_utf8()
                    .ok()?
                    .into_owned();
                params.push((name, value));
            }
            None if part == *seg => {}
            None => return None,
        }
    }
    Some(params)
}

async fn read_body(mut payload: web::Payload) -> Result<Option<Value>, ErrorAnswer> {
    let mut buf = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk
            .map_err(|e| ErrorAnswer::invalid_body(format!("the body cannot be read: {e}")))?;
        if buf.len() + chunk.len() > MAX_BODY_BYTES {
            return Err(ErrorAnswer::invalid_body(format!(
                "the body is larger than {MAX_BODY_BYTES} bytes"
            )));
        }
        buf.extend_from_slice(&chunk);
    }
    if buf.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    serde_json::from_slice(&buf)
        .map(Some)
        .map_err(|e| ErrorAnswer::invalid_body(format!("the body is not valid JSON: {e}")))
}

/// The query string as a JSON object of strings, for [`super::EmulatorState::handle`].
fn parse_query_string(query: &str) -> Result<Value, ErrorAnswer> {
    let pairs = web::Query::<Vec<(String, String)>>::from_query(query)
        .map_err(|e| ErrorAnswer::invalid_query(format!("the query cannot be parsed: {e}")))?
        .into_inner();
    let mut map = Map::new();
    for (name, value) in pairs {
        if map.insert(name.clone(), Value::String(value)).is_some() {
            return Err(ErrorAnswer::invalid_query(format!(
                "`{name}` is given more than once"
            )));
        }
    }
    Ok(Value::Object(map))
}

/// The stable error code for an injected status.
fn fault_code(status: u16) -> &'static str {
    match status {
        400 => "invalid_body",
        401 => "unauthorized",
        404 => "not_found",
        409 => "conflict",
        422 => "template_mismatch",
        429 => "rate_limited",
        500..=599 => "unavailable",
        _ => "injected",
    }
}

async fn openapi(
    req: HttpRequest,
    payload: web::Payload,
    emu: web::Data<Emulator>,
) -> HttpResponse {
    emu.get_ref().serve(req, payload).await
}

impl Emulator {
    async fn serve(&self, req: HttpRequest, payload: web::Payload) -> HttpResponse {
        let inner = &self.inner;
        let body = read_body(payload).await;
        let mut entry = JournalEntry {
            seq: 0,
            at: 0,
            at_us: 0,
            method: req.method().as_str().to_owned(),
            // The scope consumed "/openapi"; the rest is what the templates describe.
            path: format!("/openapi{}", req.match_info().unprocessed()),
            query: req.query_string().to_owned(),
            endpoint: None,
            body: body.as_ref().ok().cloned().flatten().unwrap_or(Value::Null),
            idempotency_key: req
                .headers()
                .get(&inner.idempotency_header)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
            status: 0,
            answer: Value::Null,
            replayed: false,
            fault: None,
        };

        let decision = lock(&inner.faults).decide(&entry.path);
        if let Some(delay) = decision.latency {
            tokio::time::sleep(delay).await;
        }
        entry.at_us = self.now_us();
        entry.at = entry.at_us.div_euclid(1000);
        let mut trickle = None;
        if let Some(fault) = decision.fault {
            entry.fault = Some(fault.name().to_owned());
            match fault {
                // Not a failure: the call goes on and only its answer crawls.
                Fault::Trickle { byte_delay } => trickle = Some(byte_delay),
                fault => return self.answer_fault(fault, entry).await,
            }
        }
        let resp = self.serve_call(&req, entry, body).await;
        match trickle {
            Some(delay) => trickled(resp, delay).await,
            None => resp,
        }
    }

    /// A call that got past the faults: authentication, routing, idempotency, the state.
    async fn serve_call(
        &self,
        req: &HttpRequest,
        mut entry: JournalEntry,
        body: Result<Option<Value>, ErrorAnswer>,
    ) -> HttpResponse {
        let inner = &self.inner;

        if !inner.auth.accepts(req) {
            let answer = error_body("unauthorized", "missing or invalid API key");
            return self.finish(entry, 401, answer, false);
        }
        let (endpoint, params) = match route(&entry.method, &entry.path) {
            Ok(found) => found,
            Err(RouteMiss::NotFound) => {
                let answer = error_body("not_found", "no such endpoint");
                return self.finish(entry, 404, answer, false);
            }
            Err(RouteMiss::MethodNotAllowed) => {
                let answer = error_body("method_not_allowed", "method not allowed on this path");
                return self.finish(entry, 405, answer, false);
            }
        };
        entry.endpoint = Some(endpoint.name().to_owned());
        let query = parse_query_string(&entry.query);
        let key = entry
            .idempotency_key
            .clone()
            .filter(|_| endpoint.is_mutating());

        let ((status, answer), replayed) = {
            let mut core = lock(&inner.core);
            match key.as_deref().and_then(|k| core.idempotency.get(k)) {
                Some(stored) => (stored.clone(), true),
                None => {
                    let reply = match (&body, query) {
                        (Err(failure), _) => failure.clone().into_reply(),
                        (_, Err(failure)) => failure.into_reply(),
                        (Ok(body), Ok(query)) => {
                            let params: Vec<(&str, &str)> =
                                params.iter().map(|(k, v)| (*k, v.as_str())).collect();
                            core.state
                                .handle(endpoint, &params, &query, body.as_ref(), entry.at)
                        }
                    };
                    if let Some(key) = key {
                        core.idempotency.insert(key, reply.clone());
                    }
                    (reply, false)
                }
            }
        };
        self.finish(entry, status, answer, replayed)
    }

    fn record(&self, entry: JournalEntry) {
        tracing::debug!(
            method = %entry.method,
            path = %entry.path,
            status = entry.status,
            fault = ?entry.fault,
            "emulator call"
        );
        lock(&self.inner.journal).push(entry);
    }

    fn finish(
        &self,
        mut entry: JournalEntry,
        status: u16,
        answer: Value,
        replayed: bool,
    ) -> HttpResponse {
        entry.status = status;
        entry.answer = answer.clone();
        entry.replayed = replayed;
        self.record(entry);
        let mut resp = HttpResponse::build(
            StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        );
        if replayed {
            resp.insert_header((REPLAYED, "true"));
        }
        resp.json(answer)
    }

    async fn answer_fault(&self, fault: Fault, mut entry: JournalEntry) -> HttpResponse {
        match fault {
            Fault::Hang => {
                self.record(entry);
                // Dropped when the client gives up and the connection closes.
                std::future::pending::<HttpResponse>().await
            }
            Fault::Drop => {
                self.record(entry);
                // The pause lets the server flush the head and the first chunk, so the client
                // sees a response start and then break, not a connection that never answered.
                let body = futures_util::stream::unfold(0u8, |step| async move {
                    match step {
                        0 => Some((Ok(web::Bytes::from_static(b"{\"data\": [")), 1)),
                        1 => {
                            tokio::time::sleep(DROP_PAUSE).await;
                            let cut = std::io::Error::new(
                                std::io::ErrorKind::ConnectionAborted,
                                "emulator: injected connection drop",
                            );
                            Some((Err(cut), 2))
                        }
                        _ => None,
                    }
                });
                HttpResponse::Ok()
                    .content_type("application/json")
                    .no_chunking(DROP_PROMISED_BYTES)
                    .streaming::<_, std::io::Error>(body)
            }
            Fault::RateLimit { retry_after } => {
                let answer = error_body("rate_limited", "rate limit exceeded (injected fault)");
                entry.status = 429;
                entry.answer = answer.clone();
                self.record(entry);
                let mut resp = HttpResponse::TooManyRequests();
                if let Ok(v) = HeaderValue::from_str(&retry_after) {
                    resp.insert_header((RETRY_AFTER, v));
                }
                resp.json(answer)
            }
            // `serve` carries trickled calls out itself; answered as a failure here only so the
            // match stays total (no panic on a path that cannot be reached).
            Fault::Trickle { .. } => {
                let answer = error_body("injected", "injected fault");
                self.finish(entry, 500, answer, false)
            }
            Fault::Fail { status } | Fault::Random { status } => {
                let answer = error_body(fault_code(status), "injected fault");
                self.finish(entry, status, answer, false)
            }
        }
    }
}

/// `resp` with its head now and its body one byte per `delay`, `Content-Length` kept, so the
/// client sees a well-formed answer that arrives too slowly.
async fn trickled(resp: HttpResponse, delay: std::time::Duration) -> HttpResponse {
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = actix_web::body::to_bytes(resp.into_body())
        .await
        .unwrap_or_default();
    let len = bytes.len() as u64;
    let body = futures_util::stream::unfold(0usize, move |at| {
        let bytes = bytes.clone();
        async move {
            let byte = bytes.get(at..at + 1)?;
            tokio::time::sleep(delay).await;
            Some((
                Ok::<_, std::io::Error>(web::Bytes::copy_from_slice(byte)),
                at + 1,
            ))
        }
    });
    let mut out = HttpResponse::build(status);
    for (name, value) in headers.iter() {
        if name != actix_web::http::header::CONTENT_LENGTH {
            out.insert_header((name.clone(), value.clone()));
        }
    }
    out.no_chunking(len).streaming(body)
}

async fn get_journal(emu: web::Data<Emulator>) -> HttpResponse {
    HttpResponse::Ok().json(emu.journal())
}

async fn clear_journal(emu: web::Data<Emulator>) -> HttpResponse {
    emu.clear_journal();
    HttpResponse::NoContent().finish()
}

async fn get_faults(emu: web::Data<Emulator>) -> HttpResponse {
    HttpResponse::Ok().json(emu.faults())
}

/// Replaces the whole fault configuration; omitted fields take their defaults.
async fn set_faults(emu: web::Data<Emulator>, body: web::Bytes) -> HttpResponse {
    let bad =
        |message: String| HttpResponse::BadRequest().json(error_body("invalid_body", &message));
    let config: FaultConfig = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => return bad(format!("not a fault configuration: {e}")),
    };
    if let Err(e) = emu.set_faults(config) {
        return bad(e.to_string());
    }
    HttpResponse::Ok().json(emu.faults())
}

async fn clear_faults(emu: web::Data<Emulator>) -> HttpResponse {
    emu.clear_faults();
    HttpResponse::NoContent().finish()
}

async fn get_state(emu: web::Data<Emulator>) -> HttpResponse {
    HttpResponse::Ok().json(emu.state_snapshot())
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SilentManual {
    enabled: bool,
}

/// `POST /_emulator/conversations/{id}/manual` `{"enabled": bool}`: change the manual status
/// the way the builder's UI does, with no webhook (the service sends none for it). Answers the
/// status as `GET /openapi/conversation/{id}/manual` would; 404 for an unknown conversation.
async fn set_manual_silently(
    emu: web::Data<Emulator>,
    id: web::Path<String>,
    body: web::Bytes,
) -> HttpResponse {
    let reply = match serde_json::from_slice::<SilentManual>(&body) {
        Err(e) => {
            ErrorAnswer::invalid_body(format!("expected {{\"enabled\": bool}}: {e}")).into_reply()
        }
        Ok(req) => {
            let now = emu.now_ms();
            match emu.with_state(|state| state.set_manual_silently(&id, req.enabled, now)) {
                Ok(manual) => (200, serde_json::to_value(manual).unwrap_or(Value::Null)),
                Err(failure) => failure.into_reply(),
            }
        }
    };
    let status = StatusCode::from_u16(reply.0).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    HttpResponse::build(status).json(reply.1)
}

async fn reset(emu: web::Data<Emulator>) -> HttpResponse {
    emu.reset();
    HttpResponse::NoContent().finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_endpoint_routes_from_its_own_template() {
        for e in Endpoint::ALL {
            let path = e
                .path_template()
                .replace("{botId}", "B1")
                .replace("{conversationId}", "c%201")
                .replace("{id}", "u1")
                .replace("{senderKey}", "sk")
                .replace("{userKey}", "k");
            let (found, params) = route(e.method(), &path).expect("routes");
            assert_eq!(found, e);
            assert_eq!(params.len(), e.path_params().len());
            if let Some((_, v)) = params.iter().find(|(k, _)| *k == "conversationId") {
                assert_eq!(v, "c 1");
            }
        }
        assert_eq!(route("GET", "/openapi/nope"), Err(RouteMiss::NotFound));
        assert_eq!(route("GET", "/openapi/bot/"), Err(RouteMiss::NotFound));
        assert_eq!(
            route("DELETE", "/openapi/bot/B1"),
            Err(RouteMiss::MethodNotAllowed)
        );
    }

    #[test]
    fn query_strings_become_objects_and_repeats_are_refused() {
        let q = parse_query_string("limit=5&userKey=a%20b").expect("query");
        assert_eq!(q, serde_json::json!({"limit": "5", "userKey": "a b"}));
        assert!(parse_query_string("").expect("empty").as_object().is_some());
        assert!(parse_query_string("a=1&a=2").is_err());
    }

    #[test]
    fn idempotency_store_forgets_the_oldest_past_capacity() {
        let mut s = IdempotencyStore::new(2);
        for k in ["a", "b", "c"] {
            s.insert(k.into(), (200, Value::Null));
        }
        assert!(s.get("a").is_none());
        assert!(s.get("b").is_some() && s.get("c").is_some());
    }
}
