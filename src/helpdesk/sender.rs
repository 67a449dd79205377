//! Delivering one event to the help desks: sign, POST, and judge the answer. The outbox decides
//! when to try again (`outbox::Runner`); this makes single attempts, so an unreachable help desk
//! holds no executor slot while it waits.

use super::events::pattern_matches;
use super::signing::{self, SigningKey};
use super::{NoQueue, QueueSource};
use crate::config::HelpdeskConfig;
use std::sync::Arc;
use std::time::Duration;
use upstream::handle::TransportHandle;
use upstream::retry::parse_retry_after;
use upstream::transport::{RawRequest, Transport, TransportError};

/// One configured help desk, its secrets decoded, and its own client (its own TLS trust).
struct Endpoint<T> {
    name: String,
    url: String,
    keys: Vec<SigningKey>,
    events: Vec<String>,
    http: Option<T>,
}

/// Why an attempt failed. Names the endpoint by its configured name, never its URL (which may
/// carry credentials).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeskError {
    /// A 4xx other than 408/425/429 (or a redirect): the help desk will not take it as it is.
    #[error("help desk {endpoint} refused the event: HTTP {status}")]
    Refused { endpoint: String, status: u16 },
    /// Down, slow, overloaded: worth another attempt later.
    #[error("help desk {endpoint} is unavailable ({cause})")]
    Unavailable {
        endpoint: String,
        /// `http_<status>`, `connect`, `timeout` or `transport`.
        cause: String,
        retry_after: Option<Duration>,
    },
    /// Its TLS handshake failed (certificate not trusted, expired, for another name...): tried
    /// again later like a connect failure, the certificate may be fixed meanwhile.
    #[error("help desk {endpoint}: {failure}")]
    Tls {
        endpoint: String,
        failure: upstream::tls::TlsFailure,
    },
}

impl DeskError {
    /// The metric outcome: `http_<status>`, `connect`, `timeout`, `transport`, `tls`.
    pub fn outcome(&self) -> String {
        match self {
            DeskError::Refused { status, .. } => format!("http_{status}"),
            DeskError::Unavailable { cause, .. } => cause.clone(),
            DeskError::Tls { .. } => "tls".into(),
        }
    }
}

/// The help desks and how to reach them. Generic over the transport so tests can script answers.
pub struct Desks<T = TransportHandle> {
    endpoints: Vec<Endpoint<T>>,
    pub transcript_messages: u32,
    pub bot_messages: bool,
    /// Position and expected wait of a waiting conversation.
    pub queue: Arc<dyn QueueSource>,
}

impl Desks<TransportHandle> {
    /// From the validated `[helpdesk]` configuration; starts one HTTP client thread per
    /// endpoint (none without endpoints), each trusting the platform's roots (`trust`) and its
    /// `ca_file`. A failed TLS handshake is logged and told to `observer`.
    pub fn start(
        config: &HelpdeskConfig,
        trust: &upstream::tls::Trust,
        observer: Option<upstream::tls::TlsObserver>,
    ) -> Result<Self, String> {
        let mut http = Vec::new();
        for (i, ep) in config.endpoints.iter().enumerate() {
            let tls = upstream::tls::ClientTls::new(trust, &ep.ca_file, &ep.name, observer.clone())
                .map_err(|e| format!("helpdesk.endpoints[{i}].ca_file: {e}"))?;
            http.push(Some(TransportHandle::start(
                config.connect_timeout,
                config.timeout,
                tls,
            )?));
        }
        Self::build(config, http)
    }
}

impl<T: Transport> Desks<T> {
    /// Every endpoint sends through (a clone of) `http`; `None`: nothing to send with.
    pub fn with_transport(config: &HelpdeskConfig, http: Option<T>) -> Result<Self, String>
    where
        T: Clone,
    {
        Self::build(
            config,
            config.endpoints.iter().map(|_| http.clone()).collect(),
        )
    }

    /// `http[i]` is the client of the `i`th endpoint.
    fn build(config: &HelpdeskConfig, http: Vec<Option<T>>) -> Result<Self, String> {
        let mut endpoints = Vec::new();
        for ((i, ep), http) in config.endpoints.iter().enumerate().zip(http) {
            let keys = ep
                .secrets
                .iter()
                .enumerate()
                .map(|(j, s)| {
                    SigningKey::from_secret(s)
                        .map_err(|e| format!("helpdesk.endpoints[{i}].secrets[{j}]: {e}"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            endpoints.push(Endpoint {
                name: ep.name.clone(),
                url: ep.url.expose().to_owned(),
                keys,
                events: ep.events.clone(),
                http,
            });
        }
        Ok(Desks {
            endpoints,
            transcript_messages: config.transcript_messages,
            bot_messages: config.bot_messages,
            queue: Arc::new(NoQueue),
        })
    }

    /// Any help desk to send to.
    pub fn is_configured(&self) -> bool {
        !self.endpoints.is_empty() && self.endpoints.iter().all(|ep| ep.http.is_some())
    }

    /// Every endpoint's name, in configuration order.
    pub fn endpoint_names(&self) -> impl Iterator<Item = &str> {
        self.endpoints.iter().map(|ep| ep.name.as_str())
    }

    /// The names of the endpoints that take `kind`, in configuration order.
    pub fn targets(&self, kind: &str) -> Vec<&str> {
        self.endpoints
            .iter()
            .filter(|ep| ep.events.iter().any(|p| pattern_matches(p, kind)))
            .map(|ep| ep.name.as_str())
            .collect()
    }

    /// One signed POST of `body` to the endpoint `name`. `id` is the event's stable id (the
    /// help desk dedupes by it); `timestamp` (Unix seconds) is the attempt's, signed with it.
    pub async fn post(
        &self,
        name: &str,
        id: &str,
        body: &[u8],
        timestamp: i64,
    ) -> Result<(), DeskError> {
        let unavailable = |cause: &str| DeskError::Unavailable {
            endpoint: name.to_owned(),
            cause: cause.to_owned(),
            retry_after: None,
        };
        let Some((ep, Some(http))) = self
            .endpoints
            .iter()
            .find(|ep| ep.name == name)
            .map(|ep| (ep, ep.http.as_ref()))
        else {
            return Err(unavailable("transport"));
        };
        let mut headers = vec![("accept".to_owned(), "application/json".to_owned())];
        headers.extend(signing::headers(&ep.keys, id, timestamp, body));
        let request = RawRequest {
            method: "POST",
            path: ep.url.clone(),
            headers,
            body: Some(body.to_vec()),
        };
        match http.send(request).await {
            Ok(resp) if (200..300).contains(&resp.status) => Ok(()),
            Ok(resp) if upstream::error::is_retryable_status(resp.status) => {
                Err(DeskError::Unavailable {
                    endpoint: name.to_owned(),
                    cause: format!("http_{}", resp.status),
                    retry_after: resp
                        .retry_after
                        .as_deref()
                        .and_then(|v| parse_retry_after(v, std::time::SystemTime::now())),
                })
            }
            Ok(resp) => Err(DeskError::Refused {
                endpoint: name.to_owned(),
                status: resp.status,
            }),
            Err(TransportError::Connect(_)) => Err(unavailable("connect")),
            Err(TransportError::Tls(failure)) => Err(DeskError::Tls {
                endpoint: name.to_owned(),
                failure,
            }),
            Err(TransportError::Timeout) => Err(unavailable("timeout")),
            Err(TransportError::Other(_)) => Err(unavailable("transport")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{HelpdeskEndpoint, Secret};
    use std::sync::Mutex;
    use upstream::transport::RawResponse;

    /// Answers with the scripted statuses in turn and keeps every request.
    #[derive(Default)]
    struct Scripted {
        answers: Mutex<Vec<Result<RawResponse, TransportError>>>,
        seen: Mutex<Vec<RawRequest>>,
    }

    impl Transport for Scripted {
        async fn send(&self, request: RawRequest) -> Result<RawResponse, TransportError> {
            self.seen.lock().expect("seen").push(request);
            self.answers.lock().expect("answers").remove(0)
        }
    }

    fn status(status: u16, retry_after: Option<&str>) -> Result<RawResponse, TransportError> {
        Ok(RawResponse {
            status,
            retry_after: retry_after.map(str::to_owned),
            body: bytes::Bytes::new(),
        })
    }

    fn config(events: &[&str]) -> HelpdeskConfig {
        let defaults: crate::config::Config =
            toml::from_str(crate::config::DEFAULTS).expect("defaults");
        let mut hd = defaults.helpdesk;
        hd.endpoints = vec![
            HelpdeskEndpoint {
                name: "desk".into(),
                url: Secret::new("http://127.0.0.1:9/events"),
                secrets: vec![Secret::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")],
                events: events.iter().map(|s| (*s).to_owned()).collect(),
                ca_file: String::new(),
            },
            HelpdeskEndpoint {
                name: "audit".into(),
                url: Secret::new("http://127.0.0.1:9/audit"),
                secrets: vec![Secret::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")],
                events: vec!["*".into()],
                ca_file: String::new(),
            },
        ];
        hd
    }

    fn run<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    #[test]
    fn endpoints_take_the_kinds_they_select() {
        let hd =
            Desks::with_transport(&config(&["handoff.*"]), Some(Arc::new(Scripted::default())))
                .expect("helpdesk");
        assert!(hd.is_configured());
        assert_eq!(hd.targets("handoff.ended"), vec!["desk", "audit"]);
        assert_eq!(hd.targets("user.blocked"), vec!["audit"]);
    }

    #[test]
    fn answers_are_judged_retryable_or_refused() {
        let http = Arc::new(Scripted::default());
        *http.answers.lock().expect("answers") = vec![
            status(204, None),
            status(503, None),
            status(429, Some("7")),
            status(408, None),
            status(400, None),
            status(302, None),
            Err(TransportError::Connect("refused".into())),
            Err(TransportError::Timeout),
            Err(TransportError::Tls(upstream::tls::TlsFailure {
                reason: upstream::tls::TlsReason::Expired,
                detail: "invalid peer certificate: Expired".into(),
            })),
        ];
        let hd = Desks::with_transport(&config(&["*"]), Some(http.clone())).expect("helpdesk");
        let results = run(async {
            let mut out = Vec::new();
            for _ in 0..9 {
                out.push(hd.post("desk", "ev/r/0", b"{}", 1_700_000_000).await);
            }
            out
        });
        assert_eq!(results[0], Ok(()));
        let outcomes: Vec<String> = results[1..]
            .iter()
            .map(|r| r.as_ref().expect_err("failed").outcome())
            .collect();
        assert_eq!(
            outcomes,
            [
                "http_503", "http_429", "http_408", "http_400", "http_302", "connect", "timeout",
                "tls"
            ]
        );
        // A failed handshake is a failure to reach it (tried again later), with its reason.
        assert!(matches!(
            &results[8],
            Err(DeskError::Tls { endpoint, failure })
                if endpoint == "desk" && failure.reason == upstream::tls::TlsReason::Expired
        ));
        assert!(results[8]
            .as_ref()
            .expect_err("tls")
            .to_string()
            .contains("certificate expired"));
        assert!(matches!(
            &results[2],
            Err(DeskError::Unavailable { retry_after: Some(d), .. }) if *d == Duration::from_secs(7)
        ));
        assert!(matches!(
            results[4],
            Err(DeskError::Refused { status: 400, .. })
        ));
        assert!(matches!(
            results[5],
            Err(DeskError::Refused { status: 302, .. })
        ));
        let seen = http.seen.lock().expect("seen").clone();
        let first = &seen[0];
        assert_eq!(first.path, "http://127.0.0.1:9/events");
        let header = |n: &str| {
            first
                .headers
                .iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(header("webhook-id").as_deref(), Some("ev/r/0"));
        assert_eq!(header("webhook-timestamp").as_deref(), Some("1700000000"));
        assert!(header("webhook-signature").is_some_and(|s| s.starts_with("v1,")));
        assert!(
            !format!("{:?}", results[6]).contains("127.0.0.1"),
            "errors name the endpoint, not its URL"
        );
    }
}
