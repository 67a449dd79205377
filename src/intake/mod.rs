//! Webhook intake: authenticate, bound and read the body, validate, store, flush, answer.
//!
//! The answer is 200 only once everything the delivery brought is durable (accepted events, or the
//! quarantined body). Authenticated bodies that are not valid deliveries are quarantined and
//! answered 200: the service disables a webhook after three non-200 answers, and a disabled
//! webhook loses every later event.

pub mod auth;
pub mod scrub;

use actix_web::http::StatusCode;
use actix_web::{web, HttpMessage, HttpRequest, HttpResponse};
use api_error::ApiError;
use futures_util::StreamExt;
use model::ids::DeliveryId;
use model::webhook;
use model::webhook::model::EventKind;
use serde::{Deserialize, Serialize};
use storage::writer::WriterError;
use storage::Storage;
use storage::{AcceptJob, Accepted, QuarantineRecord, Store, StoreError};
use tracing::Instrument;

/// What the intake's handlers need: its own state, built before the store opens (an early start
/// takes deliveries while sled replays its log: see `store::log`).
pub struct Intake {
    /// Where deliveries go; also the store, once open (quarantine records wait for it).
    pub writer: storage::Writer,
    pub metrics: crate::ops::metrics::Metrics,
    pub tokens: auth::TokenSet,
    pub cidrs: auth::CidrList,
    /// `server.trusted_proxies`: who may name the client (see `client_addr`).
    pub proxies: crate::client_addr::Proxies,
    /// Replaces every known webhook token in a body before it is stored (`scrub`).
    pub scrubber: scrub::Scrubber,
    /// The webhook's silence (backfill's): a delivery ends it.
    pub watch: crate::backfill::WebhookWatch,
    pub max_body_bytes: usize,
    /// `webhook.max_events` and `webhook.max_clock_skew` (see [`Intake::checks`]).
    pub max_events: usize,
    pub max_clock_skew: std::time::Duration,
    pub body_read_timeout: std::time::Duration,
    /// The daemon's time: a delivery's receive time.
    pub clock: model::clock::Clock,
}

impl Intake {
    /// The webhook's checks for a body received (or re-processed) at `now`.
    pub fn checks(&self, now: i64) -> webhook::Checks {
        webhook::Checks::intake(self.max_events, self.max_clock_skew, now)
    }
}

/// Routes of the intake, mounted at the configured path.
pub fn routes(cfg: &mut web::ServiceConfig, path: &str) {
    cfg.service(
        web::resource(format!("{path}/{{token}}"))
            .route(web::post().to(receive))
            .default_service(web::to(|| async {
                api_error::method_not_allowed_allowing("POST")
            })),
    )
    .service(
        // `{path}/` is the token route with an empty token: unauthenticated, not unknown.
        web::resource([path.to_owned(), format!("{path}/")])
            .route(web::post().to(receive_without_token))
            .default_service(web::to(|| async {
                api_error::method_not_allowed_allowing("POST")
            })),
    );
}

/// The answer to an authenticated delivery (always 200).
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Receipt {
    /// `accepted`, `duplicate` or `quarantined`.
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delivery_id: Option<String>,
    pub accepted: usize,
    pub duplicates: usize,
    pub quarantined: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quarantine_id: Option<u64>,
}

#[derive(Deserialize)]
struct TokenQuery {
    token: Option<String>,
}

async fn receive_without_token(
    req: HttpRequest,
    payload: web::Payload,
    intake: web::Data<Intake>,
) -> Result<HttpResponse, ApiError> {
    receive_inner(req, None, payload, intake).await
}

async fn receive(
    req: HttpRequest,
    token: web::Path<String>,
    payload: web::Payload,
    intake: web::Data<Intake>,
) -> Result<HttpResponse, ApiError> {
    receive_inner(req, Some(token.into_inner()), payload, intake).await
}

/// Every log line about one delivery carries its id (recorded once the body is parsed).
async fn receive_inner(
    req: HttpRequest,
    path_token: Option<String>,
    payload: web::Payload,
    intake: web::Data<Intake>,
) -> Result<HttpResponse, ApiError> {
    let span = tracing::info_span!("delivery", delivery_id = tracing::field::Empty);
    handle(req, path_token, payload, intake)
        .instrument(span)
        .await
}

async fn handle(
    req: HttpRequest,
    path_token: Option<String>,
    payload: web::Payload,
    intake: web::Data<Intake>,
) -> Result<HttpResponse, ApiError> {
    let metrics = &intake.metrics;
    let outcome = |name: &str| metrics.deliveries.with_label_values(&[name]).inc();
    if let Err((name, refusal)) = authenticate(&req, path_token.as_deref(), &intake) {
        outcome(name);
        return Err(refusal);
    }
    // The body's share of the in-flight budget is held until the delivery is handed on.
    let (_share, body) = match receive_body(&req, payload, &intake).await {
        Ok(received) => received,
        Err((name, answer)) => {
            outcome(name);
            return answer;
        }
    };
    let content_type = req.content_type().to_owned();
    let now = intake.clock.now_millis();
    let checks = intake.checks(now);
    // A large body is judged (and, if bad, compressed into quarantine) on the blocking pool: a
    // body at the size limit takes a while, and the HTTP worker keeps answering other deliveries.
    let large = body.len() > OFF_WORKER_OVER;
    let judge_body = {
        let content_type = content_type.clone();
        let scrubber = intake.scrubber.clone();
        move |body: bytes::BytesMut| {
            // Nothing of the body is stored, logged or parsed before its webhook tokens are
            // replaced.
            let body = scrubber.scrub_owned(body);
            let parsed = judge(&body, &content_type, &checks);
            (body, parsed)
        }
    };
    let (body, parsed) = match off_worker_if(large, move || judge_body(body)).await {
        Ok(judged) => judged,
        Err(e) => {
            outcome("unavailable");
            tracing::error!(error = %e, "judging a delivery failed");
            return Err(ApiError::unavailable(
                "the delivery cannot be judged now; retry later",
            ));
        }
    };
    let judged = Judged {
        body,
        content_type,
        now,
        large,
    };
    let ingested = match store_delivery(&intake, parsed, judged).await {
        Ok(i) => i,
        Err(WriterError::Opening) => {
            outcome("unavailable");
            return Ok(api_error::starting_because(
                "the daemon is starting and this delivery needs its store, still opening; retry \
                 shortly",
            ));
        }
        Err(e) => {
            outcome("unavailable");
            tracing::error!(error = %e, "cannot store delivery");
            return Ok(api_error::unavailable_retry_after(
                "the store cannot persist the delivery now; retry later",
                STORE_RETRY_AFTER_SECS,
            ));
        }
    };
    // The webhook works: a silence backfill found is over.
    intake.watch.arrived(now);
    record_metrics(&intake.metrics, &ingested);
    let receipt = ingested.receipt();
    outcome(&receipt.status);
    if let Some(reason) = &receipt.reason {
        tracing::warn!(reason = %reason, quarantine_id = ?receipt.quarantine_id, "delivery quarantined");
    } else {
        tracing::debug!(delivery_id = ?receipt.delivery_id, accepted = receipt.accepted, duplicates = receipt.duplicates, "delivery stored");
    }
    Ok(HttpResponse::Ok().json(receipt))
}

/// What a delivery the store could not take is told to wait before it is sent again.
const STORE_RETRY_AFTER_SECS: u32 = 5;

/// The caller may deliver: its address is allowed and it carries a webhook token, as the last
/// path segment or a `token` query parameter (both forms appear in registered URLs). Else the
/// outcome to count and the refusal.
fn authenticate(
    req: &HttpRequest,
    path_token: Option<&str>,
    intake: &Intake,
) -> Result<(), (&'static str, ApiError)> {
    let client = intake.proxies.of_request(req);
    if !intake.cidrs.allows(client) {
        return Err((
            "forbidden",
            ApiError::forbidden("source address not allowed"),
        ));
    }
    let query_token = web::Query::<TokenQuery>::from_query(req.query_string())
        .ok()
        .and_then(|q| q.into_inner().token);
    let authenticated = [path_token, query_token.as_deref()]
        .into_iter()
        .flatten()
        .fold(false, |ok, t| intake.tokens.accepts(t) | ok);
    if !authenticated {
        return Err((
            "unauthorized",
            ApiError::unauthorized("missing or invalid webhook token"),
        ));
    }
    Ok(())
}

/// An authenticated caller's body: its share of the in-flight budget (taken only now, so a
/// caller without the token never holds any of it) and the body, read within the limit and the
/// timeout. Else the outcome to count and the answer.
async fn receive_body(
    req: &HttpRequest,
    payload: web::Payload,
    intake: &Intake,
) -> Result<
    (Option<crate::body_budget::Share>, bytes::BytesMut),
    (&'static str, Result<HttpResponse, ApiError>),
> {
    let limit = intake.max_body_bytes;
    let declared = req
        .headers()
        .get(actix_web::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(("too_large", Err(too_large(limit))));
    }
    let share = crate::body_budget::admit(req)
        .await
        .map_err(|busy| ("busy", Ok(busy)))?;
    // The buffer is sized once from the declared length (at most the limit), not grown by doubling
    // (which held up to twice the body while it grew).
    let capacity = declared.map_or(0, |len| usize::try_from(len).unwrap_or(limit).min(limit));
    match read_body(payload, limit, capacity, intake.body_read_timeout).await {
        Ok(body) => Ok((share, body)),
        Err(BodyError::TooLarge) => Err(("too_large", Err(too_large(limit)))),
        Err(BodyError::Timeout) => Err((
            "timeout",
            Err(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                "request body was not received in time",
            )),
        )),
        Err(BodyError::Read(e)) => Err((
            "timeout",
            Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "body_read_failed",
                format!("request body could not be read: {e}"),
            )),
        )),
    }
}

/// A judged delivery's body (its tokens scrubbed) and what it was received with.
struct Judged {
    body: bytes::BytesMut,
    content_type: String,
    now: model::webhook::model::Millis,
    /// Handled on the blocking pool (a body over `OFF_WORKER_OVER`).
    large: bool,
}

/// Hand a valid delivery to the writer (its invalid events quarantined, once the store is
/// open), or quarantine an invalid one whole (written once the store is open, then made durable
/// by a flush of the writer).
async fn store_delivery(
    intake: &Intake,
    parsed: Result<webhook::ParsedDelivery, (&'static str, String)>,
    judged: Judged,
) -> Result<Ingested, WriterError> {
    let Judged {
        body,
        content_type,
        now,
        large,
    } = judged;
    match parsed {
        Ok(parsed) => {
            tracing::Span::current().record("delivery_id", tracing::field::display(&parsed.id));
            let (job, kinds, invalid) = accept_job(parsed, Some(&content_type), now);
            let delivery_id = job.delivery.clone();
            // Invalid events are quarantined in sled: a start that logs deliveries while sled
            // opens holds this one until it is open.
            if !job.invalid.is_empty() {
                store_when_open(&intake.writer).await?;
            }
            let accepted = intake.writer.accept(job).await?;
            Ok(Ingested::new(delivery_id, accepted, kinds, invalid))
        }
        Err((reason, detail)) => {
            let store = store_when_open(&intake.writer).await?;
            let quarantine = move || {
                quarantine_delivery(&*store, &body, Some(&content_type), reason, &detail, now)
            };
            match off_worker_if(large, quarantine).await {
                Ok(Ok(ingested)) => intake.writer.flush().await.map(|()| ingested),
                Ok(Err(e)) => Err(WriterError::Store(e.to_string())),
                Err(e) => Err(WriterError::Store(e.to_string())),
            }
        }
    }
}

/// How long a delivery that needs the store (one to quarantine) waits for a start's store to
/// open: meanwhile it holds its share of the body budget.
const STORE_OPEN_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The store, waited for at most [`STORE_OPEN_WAIT`] ([`WriterError::Opening`] after that).
async fn store_when_open(writer: &storage::Writer) -> Result<Store, WriterError> {
    tokio::time::timeout(STORE_OPEN_WAIT, writer.store())
        .await
        .unwrap_or(Err(WriterError::Opening))
}

fn record_metrics(m: &crate::ops::metrics::Metrics, ingested: &Ingested) {
    for (kind, unknown_platform) in &ingested.new_kinds {
        m.events.with_label_values(&[kind.metric_label()]).inc();
        if *unknown_platform {
            m.unknown_platforms.inc();
        }
    }
    m.duplicate_events
        .inc_by(ingested.accepted.duplicate_events as u64);
    for (reason, _) in &ingested.quarantined {
        m.record_quarantined(reason);
    }
}

/// Bodies longer than this are judged on the blocking pool rather than on the HTTP worker.
const OFF_WORKER_OVER: usize = 256 * 1024;

/// `work` on the blocking pool when `large` (the HTTP worker keeps answering meanwhile), else
/// right here.
async fn off_worker_if<T: Send + 'static>(
    large: bool,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, actix_web::error::BlockingError> {
    if large {
        web::block(work).await
    } else {
        Ok(work())
    }
}

/// The verdict on a body: a delivery (maybe with invalid events), or why it is quarantined whole.
fn judge(
    body: &[u8],
    content_type: &str,
    checks: &webhook::Checks,
) -> Result<webhook::ParsedDelivery, (&'static str, String)> {
    if is_json(content_type) {
        webhook::parse_delivery_with(body, checks).map_err(|e| (e.code(), e.to_string()))
    } else if content_type.is_empty() {
        Err(("unsupported_content_type", "no content type".to_owned()))
    } else {
        let why = format!("content type {content_type} is not JSON");
        Err(("unsupported_content_type", why))
    }
}

fn too_large(limit: usize) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        format!("body exceeds the limit of {limit} bytes"),
    )
}

fn is_json(content_type: &str) -> bool {
    let ct = content_type.trim().to_ascii_lowercase();
    ct == "application/json" || (ct.starts_with("application/") && ct.ends_with("+json"))
}

enum BodyError {
    TooLarge,
    Timeout,
    Read(String),
}

/// Read at most `limit` bytes; stop reading as soon as the limit is passed.
async fn read_body(
    mut payload: web::Payload,
    limit: usize,
    capacity: usize,
    timeout: std::time::Duration,
) -> Result<bytes::BytesMut, BodyError> {
    let read = async {
        let mut buf = bytes::BytesMut::with_capacity(capacity);
        while let Some(chunk) = payload.next().await {
            let chunk = chunk.map_err(|e| BodyError::Read(e.to_string()))?;
            if buf.len() + chunk.len() > limit {
                return Err(BodyError::TooLarge);
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(buf)
    };
    tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| BodyError::Timeout)?
}

/// What storing one body did (before it is durable).
#[derive(Debug, Default)]
pub struct Ingested {
    pub delivery_id: Option<DeliveryId>,
    pub accepted: Accepted,
    /// Type of each new event, and whether its platform is unknown (for metrics).
    pub new_kinds: Vec<(EventKind, bool)>,
    /// (reason code, quarantine id) of each quarantine record made (at most one per delivery).
    pub quarantined: Vec<(String, u64)>,
    /// Invalid events of a valid delivery in that record.
    pub quarantined_events: usize,
    pub whole_delivery: Option<(String, String)>,
}

impl Ingested {
    /// What storing a valid delivery did; `kinds` describes each of its valid events, `invalid`
    /// counts its invalid ones.
    fn new(
        delivery_id: DeliveryId,
        accepted: Accepted,
        kinds: Vec<(EventKind, bool)>,
        invalid: usize,
    ) -> Self {
        let new_kinds = accepted.pick_new(kinds);
        Ingested {
            // A re-sent delivery's invalid events were quarantined the first time.
            quarantined_events: if accepted.quarantined.is_empty() {
                0
            } else {
                invalid
            },
            delivery_id: Some(delivery_id),
            quarantined: accepted
                .quarantined
                .iter()
                .map(|&id| ("invalid_event".to_owned(), id))
                .collect(),
            accepted,
            new_kinds,
            whole_delivery: None,
        }
    }

    pub fn receipt(&self) -> Receipt {
        let new = self.accepted.new.len();
        let status = if new > 0 {
            "accepted"
        } else if !self.quarantined.is_empty() {
            "quarantined"
        } else {
            "duplicate"
        };
        let (reason, detail) = match &self.whole_delivery {
            Some((r, d)) => (Some(r.clone()), Some(d.clone())),
            None if new == 0 && !self.quarantined.is_empty() => {
                (Some("invalid_event".to_owned()), None)
            }
            None => (None, None),
        };
        Receipt {
            status: status.to_owned(),
            delivery_id: self.delivery_id.as_ref().map(|d| d.to_string()),
            accepted: new,
            duplicates: self.accepted.duplicate_events,
            // Invalid events quarantined, or 1 for a whole body.
            quarantined: if self.whole_delivery.is_some() {
                self.quarantined.len()
            } else {
                self.quarantined_events
            },
            reason,
            detail,
            quarantine_id: self.quarantined.first().map(|(_, id)| *id),
        }
    }
}

/// The writer's job for a valid delivery (its invalid events become one quarantine record), the
/// type of each valid event, and how many are invalid.
fn accept_job(
    parsed: webhook::ParsedDelivery,
    content_type: Option<&str>,
    now: i64,
) -> (AcceptJob, Vec<(EventKind, bool)>, usize) {
    let invalid_count = parsed.invalid.len();
    let invalid =
        QuarantineRecord::invalid_events(&parsed.invalid, parsed.id.as_str(), content_type, now)
            .into_iter()
            .collect();
    let kinds = parsed
        .events
        .iter()
        .map(|e| (e.event.kind.clone(), e.unknown_platform))
        .collect();
    let job = AcceptJob {
        delivery: parsed.id,
        events: parsed.events,
        invalid,
        received_at: now,
    };
    (job, kinds, invalid_count)
}

fn quarantine_delivery(
    store: &dyn Storage,
    body: &[u8],
    content_type: Option<&str>,
    reason: &str,
    detail: &str,
    now: i64,
) -> Result<Ingested, StoreError> {
    let mut record = QuarantineRecord::new("delivery", reason, detail, body, now);
    record.content_type = content_type.map(str::to_owned);
    let id = store.quarantine(record)?;
    Ok(Ingested {
        quarantined: vec![(reason.to_owned(), id)],
        whole_delivery: Some((reason.to_owned(), detail.to_owned())),
        ..Ingested::default()
    })
}

/// Outcome of re-processing one quarantine record.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct Reprocessed {
    pub quarantine_id: u64,
    /// `accepted` (its events are in the inbox), `duplicate`, or `still_invalid` (left in place).
    pub status: String,
    pub accepted: usize,
    pub duplicates: usize,
    pub detail: Option<String>,
    /// Type of each new event (for the events metric, as on intake).
    #[serde(skip)]
    pub new_kinds: Vec<EventKind>,
    /// The new record holding the events that are still invalid, when others were accepted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requarantined: Option<u64>,
    /// The record left the quarantine here (false when still invalid, or when the pruning pass
    /// removed it meanwhile and counted it): for the quarantine gauge.
    #[serde(skip)]
    pub released: bool,
}

/// A quarantined body judged by today's validation: still invalid (the outcome), or a job to
/// store like a fresh delivery (dedupe applies), with the type of each of its events.
pub enum Reprocess {
    StillInvalid(Reprocessed),
    Accept(AcceptJob, Vec<EventKind>),
}

/// Step 1 of re-processing quarantine record `id` (`None`: no such record) at `now`, judged by
/// `checks` (intake's, for a body received at `now`). Step 2 stores the job: through the writer in the
/// daemon ([`storage::Writer::accept`]), else with [`Store::accept_many`] (offline: no writer
/// may run beside it). Step 3 is [`finish_reprocess`]. The body is scrubbed again: a record stored
/// by an older build may still hold a token.
pub fn prepare_reprocess(
    store: &dyn Storage,
    id: u64,
    checks: &webhook::Checks,
    now: i64,
    scrubber: &scrub::Scrubber,
) -> Result<Option<Reprocess>, StoreError> {
    let Some(record) = store.quarantined_one(id)? else {
        return Ok(None);
    };
    let body = scrubber.scrub(&record.body()?).into_owned();
    let still_invalid = |detail: String| {
        Reprocess::StillInvalid(Reprocessed {
            quarantine_id: id,
            status: "still_invalid".into(),
            accepted: 0,
            duplicates: 0,
            detail: Some(detail),
            new_kinds: Vec::new(),
            requarantined: None,
            released: false,
        })
    };
    if record.scope == "event" || record.scope == "events" {
        // One event, or a JSON array of a delivery's invalid events.
        let raws: Vec<&serde_json::value::RawValue> = if record.scope == "event" {
            match serde_json::from_slice(&body) {
                Ok(raw) => vec![raw],
                Err(e) => return Ok(Some(still_invalid(e.to_string()))),
            }
        } else {
            match serde_json::from_slice(&body) {
                Ok(raws) => raws,
                Err(e) => return Ok(Some(still_invalid(e.to_string()))),
            }
        };
        let mut events = Vec::new();
        let mut invalid = Vec::new();
        for raw in raws {
            match checks.validate(raw) {
                Ok(ev) => events.push(ev),
                Err(e) => invalid.push(webhook::InvalidEvent {
                    raw: raw.get().to_owned(),
                    reason: e.to_string(),
                }),
            }
        }
        if events.is_empty() {
            // An empty array (a damaged or hand-made record) holds nothing to re-process.
            let detail = match (invalid.len(), invalid.first()) {
                (_, None) => "no events in the record".to_owned(),
                (1, Some(first)) => first.reason.clone(),
                (n, Some(first)) => format!("{n} events still invalid; [0] {}", first.reason),
            };
            return Ok(Some(still_invalid(detail)));
        }
        // Its delivery id is already recorded (its siblings were accepted), so use one of its
        // own. Events still invalid go to a new record (one), this one is released.
        let kinds = events.iter().map(|e| e.event.kind.clone()).collect();
        let delivery = record.delivery_id.as_deref().unwrap_or_default();
        let requarantine = QuarantineRecord::invalid_events(
            &invalid,
            delivery,
            record.content_type.as_deref(),
            now,
        );
        let job = AcceptJob {
            delivery: DeliveryId::new(model::ids::Internal::Quarantine.id(id)),
            events,
            invalid: requarantine.into_iter().collect(),
            received_at: now,
        };
        return Ok(Some(Reprocess::Accept(job, kinds)));
    }
    match webhook::parse_delivery_with(&body, checks) {
        Err(e) => Ok(Some(still_invalid(e.to_string()))),
        Ok(parsed) if !parsed.invalid.is_empty() && parsed.events.is_empty() => {
            Ok(Some(still_invalid(parsed.invalid[0].reason.clone())))
        }
        Ok(parsed) => {
            let (job, kinds, _) = accept_job(parsed, record.content_type.as_deref(), now);
            let kinds = kinds.into_iter().map(|(k, _)| k).collect();
            Ok(Some(Reprocess::Accept(job, kinds)))
        }
    }
}

/// Step 3: the stored body leaves quarantine.
pub fn finish_reprocess(
    store: &dyn Storage,
    id: u64,
    accepted: Accepted,
    kinds: Vec<EventKind>,
) -> Result<Reprocessed, StoreError> {
    let released = store.release_quarantined(id)?;
    let status = if accepted.new.is_empty() {
        "duplicate"
    } else {
        "accepted"
    };
    Ok(Reprocessed {
        quarantine_id: id,
        status: status.into(),
        accepted: accepted.new.len(),
        duplicates: accepted.duplicate_events,
        detail: None,
        new_kinds: accepted.pick_new(kinds),
        requarantined: accepted.quarantined.first().copied(),
        released,
    })
}

/// Re-process a quarantine record on a store no writer runs on (the offline CLI). Durable when it
/// returns.
pub fn reprocess_offline(
    store: &dyn Storage,
    id: u64,
    checks: &webhook::Checks,
    now: i64,
    scrubber: &scrub::Scrubber,
) -> Result<Option<Reprocessed>, StoreError> {
    match prepare_reprocess(store, id, checks, now, scrubber)? {
        None => Ok(None),
        Some(Reprocess::StillInvalid(out)) => Ok(Some(out)),
        Some(Reprocess::Accept(job, kinds)) => {
            let accepted = store
                .accept_many(&[job.request()])?
                .pop()
                .ok_or_else(|| StoreError::Corrupt("accept result missing".into()))?;
            finish_reprocess(store, id, accepted, kinds).map(Some)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pruning pass and a re-process racing for one record: each says whether it removed
    /// it, so the quarantine gauge goes down once.
    #[test]
    fn a_record_pruned_during_its_reprocess_is_counted_once() {
        let dir = tempfile::tempdir().expect("tmp");
        let store: Store = std::sync::Arc::new(
            storage::SledStore::open(&dir.path().join("store"), 8 * 1024 * 1024).expect("open"),
        );
        let body = br#"{"id":"d-1","webhookId":"w","webhookUrl":"u","messages":[{"id":"e-1","event":"bot.message.received","sourceType":"bot","sourceId":"B1","timestamp":1,"data":{"message":{"id":"m-1","conversationId":"c-1","isUser":true,"meta":null,"data":{"type":"text","text":"x"}}}}]}"#;
        let record = QuarantineRecord::new("delivery", "invalid_format", "older rules", body, 1);
        let scrubber = scrub::Scrubber::new(["t0ken"]).expect("scrubber");
        // Two records: one re-processed alone, one pruned between the re-process's steps.
        let alone = store.quarantine(record.clone()).expect("quarantine");
        let raced = store.quarantine(record).expect("quarantine");
        let finish = |id| {
            let Some(Reprocess::Accept(job, kinds)) =
                prepare_reprocess(&*store, id, &webhook::Checks::NONE, 2, &scrubber)
                    .expect("prepare")
            else {
                panic!("the body is valid today");
            };
            let accepted = store
                .accept_many(&[job.request()])
                .expect("accept")
                .pop()
                .expect("one");
            (accepted, kinds)
        };
        let (accepted, kinds) = finish(alone);
        let out = finish_reprocess(&*store, alone, accepted, kinds).expect("finish");
        assert!(out.released, "removed by the re-process");
        let (accepted, kinds) = finish(raced);
        assert_eq!(
            store
                .prune_quarantine(i64::MAX, 10)
                .into_result()
                .expect("prune"),
            1
        );
        let out = finish_reprocess(&*store, raced, accepted, kinds).expect("finish");
        assert!(!out.released, "the pass removed it and counted it");
        assert_eq!(
            store
                .prune_quarantine(i64::MAX, 10)
                .into_result()
                .expect("prune"),
            0
        );
    }

    #[test]
    fn an_events_record_with_an_empty_array_is_still_invalid_not_a_panic() {
        let dir = tempfile::tempdir().expect("tmp");
        let store: Store = std::sync::Arc::new(
            storage::SledStore::open(&dir.path().join("store"), 8 * 1024 * 1024).expect("open"),
        );
        let id = store
            .quarantine(QuarantineRecord::new(
                "events",
                "invalid_event",
                "0 invalid events",
                b"[]",
                1,
            ))
            .expect("quarantine");
        let scrubber = scrub::Scrubber::new(["t0ken"]).expect("scrubber");
        let outcome = prepare_reprocess(&*store, id, &webhook::Checks::NONE, 2, &scrubber)
            .expect("store")
            .expect("the record");
        match outcome {
            Reprocess::StillInvalid(r) => {
                assert_eq!(r.status, "still_invalid");
                assert_eq!(r.detail.as_deref(), Some("no events in the record"));
            }
            Reprocess::Accept(..) => panic!("nothing to accept"),
        }
    }
}
