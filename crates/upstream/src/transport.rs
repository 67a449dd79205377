//! One HTTP exchange with the upstream, without retries. The client's retry and rate-limit logic
//! is generic over this, so tests can drive it with a scripted transport under paused time.

use bytes::Bytes;
use std::future::Future;
use std::time::Duration;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawRequest {
    pub method: &'static str,
    /// Path and query, e.g. `/openapi/bot?limit=5`.
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Option<Vec<u8>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawResponse {
    pub status: u16,
    /// The `Retry-After` header as sent, if any.
    pub retry_after: Option<String>,
    pub body: Bytes,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransportError {
    Connect(String),
    /// The TLS handshake failed (certificate not trusted, expired, for another name...): a
    /// connect failure, retried like one, with its typed reason.
    Tls(crate::tls::TlsFailure),
    Timeout,
    Other(String),
}

impl<T: Transport> Transport for std::sync::Arc<T> {
    fn send(
        &self,
        request: RawRequest,
    ) -> impl Future<Output = Result<RawResponse, TransportError>> {
        (**self).send(request)
    }
}

pub trait Transport {
    fn send(
        &self,
        request: RawRequest,
    ) -> impl Future<Output = Result<RawResponse, TransportError>>;
}

/// The production transport. awc's client is not `Send`: it lives on one actix thread.
pub struct AwcTransport {
    client: awc::Client,
    base: String,
    /// The whole call's bound, answer body included (awc's own timeout ends at the answer's head,
    /// so an answer trickling in would hold the call, and its queue, for as long as it crawls).
    request_timeout: Duration,
    /// Who to name and tell when a handshake fails.
    tls: crate::tls::ClientTls,
}

/// Answers larger than this are refused rather than buffered.
const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;

impl AwcTransport {
    /// `https://` URLs are verified with `tls.config` (the platform's roots and the
    /// destination's private CA; hostname verification always on).
    pub fn new(
        base_url: &str,
        connect_timeout: Duration,
        request_timeout: Duration,
        tls: crate::tls::ClientTls,
    ) -> Self {
        let connector = awc::Connector::new()
            .timeout(connect_timeout)
            .handshake_timeout(connect_timeout)
            .rustls_0_23(tls.config.clone());
        let client = awc::Client::builder()
            .connector(connector)
            .timeout(request_timeout)
            .disable_redirects()
            .finish();
        AwcTransport {
            client,
            base: base_url.trim_end_matches('/').to_owned(),
            request_timeout,
            tls,
        }
    }
}

impl Transport for AwcTransport {
    async fn send(&self, request: RawRequest) -> Result<RawResponse, TransportError> {
        tokio::time::timeout(self.request_timeout, self.exchange(request))
            .await
            .unwrap_or(Err(TransportError::Timeout))
    }
}

impl AwcTransport {
    /// One request and its whole answer, unbounded in time (`send` bounds it).
    async fn exchange(&self, request: RawRequest) -> Result<RawResponse, TransportError> {
        use awc::error::SendRequestError;
        let method = awc::http::Method::from_bytes(request.method.as_bytes())
            .map_err(|e| TransportError::Other(e.to_string()))?;
        let mut req = self
            .client
            .request(method, format!("{}{}", self.base, request.path));
        for (name, value) in &request.headers {
            req = req.insert_header((name.as_str(), value.as_str()));
        }
        let sent = match request.body {
            Some(body) => req.content_type("application/json").send_body(body).await,
            None => req.send().await,
        };
        let mut resp = sent.map_err(|e| match e {
            SendRequestError::Connect(e) => match crate::tls::TlsFailure::from_connect_error(&e) {
                Some(failure) => {
                    self.tls.failed(&failure);
                    TransportError::Tls(failure)
                }
                None => TransportError::Connect(e.to_string()),
            },
            SendRequestError::Timeout => TransportError::Timeout,
            other => TransportError::Other(other.to_string()),
        })?;
        self.tls.succeeded();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = resp
            .body()
            .limit(MAX_ANSWER_BYTES)
            .await
            .map_err(|e| match e {
                awc::error::PayloadError::Io(io) if io.kind() == std::io::ErrorKind::TimedOut => {
                    TransportError::Timeout
                }
                other => TransportError::Other(other.to_string()),
            })?;
        Ok(RawResponse {
            status: resp.status().as_u16(),
            retry_after,
            body,
        })
    }
}
