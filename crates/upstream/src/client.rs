//! The Open API client: auth header, idempotency keys, rate limits; one attempt per call (the
//! outbox schedules retries, `outbox::backoff`).

use super::error::UpstreamError;
use super::limits::Limits;
use super::retry::parse_retry_after;
use super::transport::{RawRequest, RawResponse, Transport, TransportError};
use model::contract::Endpoint;
use model::secret::Secret;
use serde_json::Value;
use std::future::Future;
use std::sync::Arc;

/// One call of one endpoint, fully described: what the typed methods build and what crosses to
/// the task that owns the HTTP client.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiCall {
    pub endpoint: Endpoint,
    /// Values of the path template's placeholders, in order.
    pub path: Vec<String>,
    pub query: Vec<(String, String)>,
    pub body: Option<Value>,
    /// Carried as the idempotency header on mutating calls, unchanged across retries.
    pub idempotency_key: Option<String>,
}

impl ApiCall {
    pub fn new(endpoint: Endpoint, path: &[&str]) -> Self {
        ApiCall {
            endpoint,
            path: path.iter().map(|s| (*s).to_owned()).collect(),
            query: Vec::new(),
            body: None,
            idempotency_key: None,
        }
    }

    /// Path with placeholders filled (percent-encoded) and the query appended.
    pub fn path_and_query(&self) -> Result<String, UpstreamError> {
        let params = self.endpoint.path_params();
        if params.len() != self.path.len() {
            return Err(UpstreamError::InvalidCall(format!(
                "{} takes {} path parameters ({}), got {}",
                self.endpoint.name(),
                params.len(),
                params.join(", "),
                self.path.len()
            )));
        }
        let mut values = self.path.iter();
        let mut out = String::new();
        for segment in self
            .endpoint
            .path_template()
            .split('/')
            .filter(|s| !s.is_empty())
        {
            out.push('/');
            if segment.starts_with('{') {
                let value = values.next().map(String::as_str).unwrap_or_default();
                if value.is_empty() {
                    return Err(UpstreamError::InvalidCall(format!(
                        "empty {segment} in {}",
                        self.endpoint.name()
                    )));
                }
                out.push_str(&encode(value));
            } else {
                out.push_str(segment);
            }
        }
        for (i, (k, v)) in self.query.iter().enumerate() {
            out.push(if i == 0 { '?' } else { '&' });
            out.push_str(&encode(k));
            out.push('=');
            out.push_str(&encode(v));
        }
        Ok(out)
    }
}

fn encode(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// Something that carries out calls: the client itself, or a handle to the task owning it.
pub trait Execute {
    fn execute(&self, call: ApiCall) -> impl Future<Output = Result<Value, UpstreamError>>;
}

/// How to authenticate and label calls.
#[derive(Clone, Debug)]
pub struct ClientSettings {
    pub auth_header: String,
    /// Prefix of the header value (`Bearer`); empty sends the key alone.
    pub auth_scheme: String,
    pub api_key: Secret,
    pub idempotency_header: String,
}

pub struct Client<T> {
    transport: T,
    settings: ClientSettings,
    limits: Limits,
    observer: Option<AttemptObserver>,
}

/// Told of every HTTP attempt (endpoint name, outcome: `2xx`, an error status code, or `connect`,
/// `tls`, `timeout`, `transport`, `decode`), retries included: the metrics hook, kept out of this module.
#[derive(Clone)]
pub struct AttemptObserver(Arc<ObserveFn>);

type ObserveFn = dyn Fn(&'static str, &str) + Send + Sync;

impl AttemptObserver {
    pub fn new(f: impl Fn(&'static str, &str) + Send + Sync + 'static) -> Self {
        AttemptObserver(Arc::new(f))
    }
}

impl std::fmt::Debug for AttemptObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AttemptObserver")
    }
}

fn attempt_outcome(result: &Result<Value, UpstreamError>) -> String {
    match result {
        Ok(_) => "2xx".into(),
        Err(UpstreamError::Status { status, .. }) => status.to_string(),
        Err(UpstreamError::Connect(_)) => "connect".into(),
        Err(UpstreamError::Tls(_)) => "tls".into(),
        Err(UpstreamError::Timeout) => "timeout".into(),
        Err(UpstreamError::Decode(_)) => "decode".into(),
        Err(_) => "transport".into(),
    }
}

impl<T: Transport> Client<T> {
    pub fn new(transport: T, settings: ClientSettings, limits: Limits) -> Self {
        Client {
            transport,
            settings,
            limits,
            observer: None,
        }
    }

    /// Report every attempt to `observer` (metrics).
    pub fn with_observer(mut self, observer: Option<AttemptObserver>) -> Self {
        self.observer = observer;
        self
    }

    fn request(&self, call: &ApiCall, key: Option<&str>) -> Result<RawRequest, UpstreamError> {
        let mut headers = vec![("accept".to_owned(), "application/json".to_owned())];
        if !self.settings.api_key.is_empty() {
            let value = if self.settings.auth_scheme.is_empty() {
                self.settings.api_key.expose().to_owned()
            } else {
                format!(
                    "{} {}",
                    self.settings.auth_scheme,
                    self.settings.api_key.expose()
                )
            };
            headers.push((self.settings.auth_header.clone(), value));
        }
        if let Some(key) = key {
            headers.push((self.settings.idempotency_header.clone(), key.to_owned()));
        }
        let body = match &call.body {
            Some(v) => {
                Some(serde_json::to_vec(v).map_err(|e| UpstreamError::InvalidCall(e.to_string()))?)
            }
            None => None,
        };
        Ok(RawRequest {
            method: call.endpoint.method(),
            path: call.path_and_query()?,
            headers,
            body,
        })
    }

    fn classify(
        &self,
        answer: Result<RawResponse, TransportError>,
    ) -> Result<Value, UpstreamError> {
        let resp = match answer {
            Ok(r) => r,
            Err(TransportError::Connect(e)) => return Err(UpstreamError::Connect(e)),
            Err(TransportError::Tls(f)) => return Err(UpstreamError::Tls(f)),
            Err(TransportError::Timeout) => return Err(UpstreamError::Timeout),
            Err(TransportError::Other(e)) => return Err(UpstreamError::Transport(e)),
        };
        if (200..300).contains(&resp.status) {
            if resp.body.is_empty() {
                return Ok(Value::Null);
            }
            // awc hands over a body cut short by a dropped connection as if it were whole, so an
            // unreadable success is a transport failure (retried with the same key), not final.
            return serde_json::from_slice(&resp.body).map_err(|e| {
                UpstreamError::Transport(format!(
                    "unreadable answer ({} bytes): {e}",
                    resp.body.len()
                ))
            });
        }
        let parsed: Option<model::contract::ErrorBody> = serde_json::from_slice(&resp.body).ok();
        let (code, message) = match parsed {
            Some(b) => (b.error.code, b.error.message),
            None => (format!("http_{}", resp.status), String::new()),
        };
        let body = String::from_utf8_lossy(&resp.body[..resp.body.len().min(4096)]).into_owned();
        let retry_after = resp
            .retry_after
            .as_deref()
            .and_then(|v| parse_retry_after(v, std::time::SystemTime::now()));
        Err(UpstreamError::Status {
            status: resp.status,
            code,
            message,
            body,
            retry_after,
        })
    }
}

impl<T: Transport> Execute for Client<T> {
    async fn execute(&self, call: ApiCall) -> Result<Value, UpstreamError> {
        // A mutating call always carries a key, so even a retry the caller did not plan for has
        // one effect.
        let key = match (&call.idempotency_key, call.endpoint.is_mutating()) {
            (Some(k), true) => Some(k.clone()),
            (None, true) => Some(generated_key()),
            (_, false) => None,
        };
        let request = self.request(&call, key.as_deref())?;
        self.limits.acquire(call.endpoint.class()).await;
        let result = self.classify(self.transport.send(request).await);
        if let Some(observe) = &self.observer {
            (observe.0)(call.endpoint.name(), &attempt_outcome(&result));
        }
        match &result {
            Ok(_) => tracing::debug!(endpoint = call.endpoint.name(), "upstream call succeeded"),
            Err(e) => {
                tracing::debug!(endpoint = call.endpoint.name(), error = %e, "upstream call failed")
            }
        }
        result
    }
}

fn generated_key() -> String {
    use rand::distr::{Alphanumeric, SampleString};
    format!("hb-{}", Alphanumeric.sample_string(&mut rand::rng(), 24))
}
