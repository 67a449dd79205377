//! The budget on request bodies held in memory at once, across every connection and route
//! (`server.max_inflight_body_bytes`): a byte-counting semaphore (permits are KiB). A request that
//! brings a body takes its share before its handler reads it and gives it back when the handler
//! has answered (the body parsed and handed on). The share is the `Content-Length`, at most the
//! largest body its route reads (`RouteCaps`: the webhook's `webhook.max_body_bytes`, the agent
//! API's 64 KiB, the admin API's 256 KiB; other routes read no body and take none). A body
//! without a length (chunked, or any body over HTTP/2) takes its route's largest size. Methods
//! that carry no body for any of our routes (GET, HEAD, OPTIONS, TRACE) take none: no handler of
//! theirs reads one.
//!
//! The webhook and the agent API take their share in the handler, once the caller's token and
//! address were accepted ([`admit`]): a caller without a valid token never holds any of the budget
//! nor queues for it ahead of real deliveries. Other routes (the admin API) take it in the
//! middleware, before their extractors read the body.
//!
//! Over the budget a request waits for room, at most `server.body_read_timeout`, then gets
//! `503 server_busy` with `Retry-After`. Waiting first: the service disables the webhook after
//! three non-200 answers in 30 minutes, and a burst of large bodies drains in well under a second
//! each, so a short wait turns a refusal into a slower 200.

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::{header, Method, Version};
use actix_web::middleware::Next;
use actix_web::{web, HttpRequest, HttpResponse, ResponseError as _};
use api_error::ApiError;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Seconds a refused client is told to wait.
pub const RETRY_AFTER_SECS: u64 = 1;

/// The largest body each route that reads one reads, by path prefix (a prefix matches itself
/// and what follows it after a `/`). A path under none reads no body. Routes whose handlers take
/// their share themselves, once they have authenticated the caller ([`BodyBudget::admit`]), are
/// passed over by the middleware: a caller without a valid token never holds any of the budget.
#[derive(Clone, Debug, Default)]
pub struct RouteCaps {
    caps: Vec<(String, usize)>,
    by_handler: Vec<String>,
}

impl RouteCaps {
    /// These caps, every share taken by the middleware.
    pub fn new(caps: Vec<(String, usize)>) -> Self {
        RouteCaps {
            caps,
            by_handler: Vec::new(),
        }
    }

    /// A route below `prefix` that reads at most `cap` bytes and whose handler takes its share
    /// itself, after authenticating the caller (the webhook, the agent API); the middleware takes
    /// the share of the others.
    pub fn handled_by_route(mut self, prefix: &str, cap: usize) -> Self {
        let prefix = prefix.trim_end_matches('/').to_owned();
        self.caps.push((prefix.clone(), cap));
        self.by_handler.push(prefix);
        self
    }

    /// The most the route of `path` reads; `None` when it reads no body.
    fn cap(&self, path: &str) -> Option<usize> {
        self.caps
            .iter()
            .filter(|(prefix, _)| under(path, prefix))
            .map(|(_, cap)| *cap)
            .max()
    }

    /// Whether the handler of `path` takes its share itself.
    fn by_handler(&self, path: &str) -> bool {
        self.by_handler.iter().any(|prefix| under(path, prefix))
    }
}

/// `path` is `prefix` or below it.
fn under(path: &str, prefix: &str) -> bool {
    path.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// The shared budget (one per daemon, in every listener's app data).
#[derive(Clone)]
pub struct BodyBudget {
    permits: Arc<Semaphore>,
    /// Total permits (KiB).
    total_kib: u32,
    /// The largest body each route reads: the share of a body of unknown length there, and the
    /// cap on a claimed `Content-Length` (its handler refuses more without reading it).
    routes: RouteCaps,
    wait: Duration,
    metrics: crate::ops::metrics::Metrics,
}

/// A body's share of the budget, given back when dropped.
pub struct Share {
    _permit: OwnedSemaphorePermit,
    kib: u32,
    metrics: crate::ops::metrics::Metrics,
}

impl Drop for Share {
    fn drop(&mut self) {
        self.metrics
            .inflight_body_bytes
            .sub(i64::from(self.kib) * 1024);
    }
}

/// No room came up within the wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no room for a request body of {bytes} bytes within {wait:?}")]
pub struct Busy {
    pub bytes: usize,
    pub wait: Duration,
}

impl BodyBudget {
    pub fn new(
        max_inflight_bytes: usize,
        routes: RouteCaps,
        wait: Duration,
        metrics: crate::ops::metrics::Metrics,
    ) -> Self {
        let total_kib = u32::try_from(max_inflight_bytes / 1024)
            .unwrap_or(u32::MAX)
            .min(Semaphore::MAX_PERMITS as u32)
            .max(1);
        BodyBudget {
            permits: Arc::new(Semaphore::new(total_kib as usize)),
            total_kib,
            routes,
            wait,
            metrics,
        }
    }

    /// Take a share for a body of `bytes`, waiting at most the configured wait.
    pub async fn take(&self, bytes: usize) -> Result<Share, Busy> {
        let kib = u32::try_from(bytes.div_ceil(1024))
            .unwrap_or(u32::MAX)
            .clamp(1, self.total_kib);
        let outcome = |name: &str| self.metrics.body_budget.with_label_values(&[name]).inc();
        let permit = match self.permits.clone().try_acquire_many_owned(kib) {
            Ok(p) => {
                outcome("immediate");
                p
            }
            Err(_) => {
                let counted = Waiting::count(&self.metrics.body_budget_waiting);
                let waited =
                    tokio::time::timeout(self.wait, self.permits.clone().acquire_many_owned(kib))
                        .await;
                drop(counted);
                match waited {
                    Ok(Ok(p)) => {
                        outcome("waited");
                        p
                    }
                    // Timed out (the semaphore is never closed).
                    _ => {
                        outcome("refused");
                        return Err(Busy {
                            bytes,
                            wait: self.wait,
                        });
                    }
                }
            }
        };
        self.metrics.inflight_body_bytes.add(i64::from(kib) * 1024);
        Ok(Share {
            _permit: permit,
            kib,
            metrics: self.metrics.clone(),
        })
    }

    /// For a handler that takes its body's share itself, after authenticating the caller: the
    /// share `req`'s body takes (`None` when it brings none), held until dropped. A refusal is
    /// logged with the route's pattern (never the path: the webhook's holds its token).
    pub async fn admit(&self, req: &HttpRequest) -> Result<Option<Share>, Busy> {
        let Some(bytes) = self.share_of(req.method(), req.version(), req.path(), req.headers())
        else {
            return Ok(None);
        };
        match self.take(bytes).await {
            Ok(share) => Ok(Some(share)),
            Err(busy) => {
                log_refusal(req.match_pattern(), &busy);
                Err(busy)
            }
        }
    }

    /// The share a request's body takes: `None` when it brings none, or its route reads none.
    fn share_of(
        &self,
        method: &Method,
        version: Version,
        path: &str,
        headers: &header::HeaderMap,
    ) -> Option<usize> {
        if [Method::GET, Method::HEAD, Method::OPTIONS, Method::TRACE].contains(method) {
            return None;
        }
        let cap = self.routes.cap(path)?;
        if headers.contains_key(header::TRANSFER_ENCODING) {
            return Some(cap);
        }
        let Some(length) = headers.get(header::CONTENT_LENGTH) else {
            // HTTP/1: no length and no chunking is no body. HTTP/2 and later send bodies in
            // frames, with the length optional: unknown, so the most the route reads.
            return (version >= Version::HTTP_2).then_some(cap);
        };
        match length
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            Some(0) => None,
            Some(n) => Some(usize::try_from(n).map_or(cap, |n| n.min(cap))),
            // Unreadable: actix refuses the request before any handler reads it.
            None => None,
        }
    }
}

/// The middleware (`actix_web::middleware::from_fn(body_budget::limit)`) on every listener's app.
pub async fn limit(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    let Some(budget) = req.app_data::<web::Data<BodyBudget>>().cloned() else {
        return Ok(next.call(req).await?.map_into_left_body());
    };
    if budget.routes.by_handler(req.path()) {
        return Ok(next.call(req).await?.map_into_left_body());
    }
    let Some(bytes) = budget.share_of(req.method(), req.version(), req.path(), req.headers())
    else {
        return Ok(next.call(req).await?.map_into_left_body());
    };
    match budget.take(bytes).await {
        Ok(share) => {
            let response = next.call(req).await;
            drop(share);
            Ok(response?.map_into_left_body())
        }
        Err(busy) => {
            log_refusal(req.match_pattern(), &busy);
            Ok(req.into_response(busy_response()).map_into_right_body())
        }
    }
}

/// A refusal in the log: the route's pattern, never the raw path (the webhook's holds its token).
fn log_refusal(pattern: Option<String>, busy: &Busy) {
    let route = pattern.unwrap_or_else(|| "<unmatched>".to_owned());
    tracing::warn!(%route, bytes = busy.bytes, wait = ?busy.wait, "request body refused: the body budget stayed full");
}

/// The answer to a body the budget had no room for: 503 `server_busy` with `Retry-After`.
pub fn busy_response() -> HttpResponse {
    let error = ApiError::new(
        actix_web::http::StatusCode::SERVICE_UNAVAILABLE,
        "server_busy",
        "too many request bodies are being read at once; retry later",
    );
    let mut response: HttpResponse = error.error_response();
    response.headers_mut().insert(
        header::RETRY_AFTER,
        header::HeaderValue::from(RETRY_AFTER_SECS),
    );
    response
}

/// [`BodyBudget::admit`] with the daemon's budget (none in an app without one: no share), the
/// refusal as its answer.
pub async fn admit(req: &HttpRequest) -> Result<Option<Share>, HttpResponse> {
    let Some(budget) = req.app_data::<web::Data<BodyBudget>>() else {
        return Ok(None);
    };
    budget.admit(req).await.map_err(|_| busy_response())
}

/// One caller counted in `body_budget_waiting` while it waits, uncounted when dropped: also when
/// the caller goes away mid-wait (a client that disconnects drops its request's future).
struct Waiting(prometheus::IntGauge);

impl Waiting {
    fn count(gauge: &prometheus::IntGauge) -> Waiting {
        gauge.inc();
        Waiting(gauge.clone())
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(kib: usize, wait_ms: u64) -> BodyBudget {
        let metrics = crate::ops::metrics::Metrics::new().expect("metrics");
        BodyBudget::new(
            kib * 1024,
            RouteCaps::new(vec![("/hook".to_owned(), 8 * 1024)]),
            Duration::from_millis(wait_ms),
            metrics,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_gone_while_it_waits_is_no_longer_counted_as_waiting() {
        let b = budget(16, 60_000);
        let _full = b.take(16 * 1024).await.expect("room");
        let waiting = {
            let b = b.clone();
            tokio::spawn(async move { b.take(1).await.map(|_| ()) })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(b.metrics.body_budget_waiting.get(), 1);
        // A client that disconnects: its request's future is dropped mid-wait.
        waiting.abort();
        assert!(waiting.await.is_err_and(|e| e.is_cancelled()));
        assert_eq!(b.metrics.body_budget_waiting.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_over_the_budget_waits_for_room_then_is_refused() {
        let b = budget(16, 1_000);
        let first = b.take(10 * 1024).await.expect("room");
        assert_eq!(b.metrics.inflight_body_bytes.get(), 10 * 1024);
        // 10 + 8 > 16 KiB: waits, and gets room once the first is given back.
        let waiting = {
            let b = b.clone();
            tokio::spawn(async move { b.take(8 * 1024).await.map(|_| ()) })
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!waiting.is_finished(), "waits while the budget is full");
        assert_eq!(b.metrics.body_budget_waiting.get(), 1);
        drop(first);
        assert_eq!(waiting.await.expect("task"), Ok(()));
        assert_eq!(
            b.metrics.body_budget.with_label_values(&["waited"]).get(),
            1
        );
        // Nothing gives room back: refused after the wait.
        let _held = b.take(16 * 1024).await.expect("room");
        let start = tokio::time::Instant::now();
        assert!(b.take(1).await.is_err());
        assert_eq!(start.elapsed(), Duration::from_millis(1_000));
        assert_eq!(
            b.metrics.body_budget.with_label_values(&["refused"]).get(),
            1
        );
        assert_eq!(b.metrics.inflight_body_bytes.get(), 16 * 1024);
    }

    fn headers(pairs: &[(header::HeaderName, &str)]) -> header::HeaderMap {
        let mut h = header::HeaderMap::new();
        for (k, v) in pairs {
            h.insert(k.clone(), header::HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    #[test]
    fn a_share_is_the_claimed_length_capped_at_the_largest_body() {
        let b = budget(64, 10);
        let post =
            |h: &header::HeaderMap| b.share_of(&Method::POST, Version::HTTP_11, "/hook/t", h);
        assert_eq!(post(&headers(&[])), None, "HTTP/1 without length: no body");
        assert_eq!(post(&headers(&[(header::CONTENT_LENGTH, "0")])), None);
        assert_eq!(
            post(&headers(&[(header::CONTENT_LENGTH, "100")])),
            Some(100)
        );
        assert_eq!(
            post(&headers(&[(header::CONTENT_LENGTH, "99999999999")])),
            Some(8 * 1024)
        );
        assert_eq!(
            post(&headers(&[(header::TRANSFER_ENCODING, "chunked")])),
            Some(8 * 1024)
        );
    }

    #[test]
    fn a_body_of_unknown_length_takes_its_routes_largest_share() {
        let b = budget(64, 10);
        // HTTP/2 sends no Transfer-Encoding, and Content-Length is optional.
        for version in [Version::HTTP_2, Version::HTTP_3] {
            assert_eq!(
                b.share_of(&Method::POST, version, "/hook/t", &headers(&[])),
                Some(8 * 1024)
            );
            assert_eq!(
                b.share_of(&Method::PUT, version, "/hook", &headers(&[])),
                Some(8 * 1024)
            );
        }
        // Methods none of our routes reads a body with take none, whatever they send.
        for method in [Method::GET, Method::HEAD, Method::OPTIONS, Method::TRACE] {
            let chunked = headers(&[(header::TRANSFER_ENCODING, "chunked")]);
            assert_eq!(
                b.share_of(&method, Version::HTTP_11, "/hook/t", &chunked),
                None
            );
            assert_eq!(
                b.share_of(&method, Version::HTTP_2, "/hook/t", &headers(&[])),
                None
            );
        }
    }

    #[test]
    fn each_route_s_share_is_capped_at_what_it_reads() {
        // As the daemon's root builds them from each surface's limits.
        let caps = RouteCaps::new(vec![("/admin/v1".to_owned(), 256 * 1024)])
            .handled_by_route("/webhook", 1024 * 1024)
            .handled_by_route("/helpdesk/v1", 64 * 1024);
        let metrics = crate::ops::metrics::Metrics::new().expect("metrics");
        let b = BodyBudget::new(8 << 20, caps, Duration::from_millis(10), metrics);
        let huge = headers(&[(header::CONTENT_LENGTH, "99999999")]);
        let chunked = headers(&[(header::TRANSFER_ENCODING, "chunked")]);
        let share = |path: &str, h: &header::HeaderMap| {
            b.share_of(&Method::POST, Version::HTTP_11, path, h)
        };
        for h in [&huge, &chunked] {
            assert_eq!(share("/webhook/tok", h), Some(1024 * 1024));
            assert_eq!(
                share("/helpdesk/v1/conversations/c1/accept", h),
                Some(64 * 1024)
            );
            assert_eq!(
                share("/admin/v1/quarantine/1/reprocess", h),
                Some(256 * 1024)
            );
            // Routes that read no body (probes, unknown paths) take no share.
            assert_eq!(share("/healthz", h), None);
            assert_eq!(share("/webhookx", h), None);
            assert_eq!(share("/nowhere", h), None);
        }
        assert_eq!(
            share(
                "/helpdesk/v1/x",
                &headers(&[(header::CONTENT_LENGTH, "100")])
            ),
            Some(100)
        );
    }
}
