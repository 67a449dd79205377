//! The generic connector's outbound side: each `[[helpdesk.endpoints]]` entry a [`DeskTarget`]
//! that signs the event's Standard Webhooks body and POSTs it; and [`Desks`], every target the
//! configuration names (these endpoints, and a connector such as Chatwoot). The outbox decides
//! when to try again (`outbox::Runner`); a target makes single attempts, so an unreachable desk
//! holds no executor slot while it waits.

use super::events::pattern_matches;
use super::port::{judge, DeskEvent, DeskTarget};
use super::signing::{self, SigningKey};
use super::{NoQueue, QueueSource};
use crate::config::HelpdeskConfig;
use futures_util::future::BoxFuture;
use model::helpdesk::DeskEventKind;
use std::sync::Arc;
use upstream::handle::TransportHandle;
use upstream::transport::{RawRequest, Transport};

pub use super::port::DeskError;

/// One configured endpoint, its secrets decoded, and its own client (its own TLS trust).
pub struct Endpoint<T> {
    name: String,
    url: String,
    keys: Vec<SigningKey>,
    events: Vec<String>,
    http: Option<T>,
}

/// The help desks: every target events go to, and what the events carry. Tests build their own
/// targets.
pub struct Desks {
    targets: Vec<Arc<dyn DeskTarget>>,
    pub transcript_messages: u32,
    pub bot_messages: bool,
    /// Position and expected wait of a waiting conversation.
    pub queue: Arc<dyn QueueSource>,
}

impl Desks {
    /// From the validated `[helpdesk]` configuration: one HTTP client thread per endpoint
    /// (none without endpoints), each trusting the platform's roots (`trust`) and its `ca_file`.
    /// A failed TLS handshake is logged and told to `observer`.
    pub fn start(
        config: &HelpdeskConfig,
        trust: &upstream::tls::Trust,
        observer: Option<upstream::tls::TlsObserver>,
    ) -> Result<Self, String> {
        let mut targets: Vec<Arc<dyn DeskTarget>> = Vec::new();
        for (i, ep) in config.endpoints.iter().enumerate() {
            let tls = upstream::tls::ClientTls::new(trust, &ep.ca_file, &ep.name, observer.clone())
                .map_err(|e| format!("helpdesk.endpoints[{i}].ca_file: {e}"))?;
            let http = TransportHandle::start(config.connect_timeout, config.timeout, tls)?;
            targets.push(Arc::new(Endpoint::new(config, i, Some(http))?));
        }
        Ok(Self::with_targets(config, targets))
    }

    /// The desks of `config` with these targets.
    pub fn with_targets(config: &HelpdeskConfig, targets: Vec<Arc<dyn DeskTarget>>) -> Self {
        Desks {
            targets,
            transcript_messages: config.transcript_messages,
            bot_messages: config.bot_messages,
            queue: Arc::new(NoQueue),
        }
    }

    /// Add a target (a connector).
    pub fn add(&mut self, target: Arc<dyn DeskTarget>) {
        self.targets.push(target);
    }

    /// Any desk to send to.
    pub fn is_configured(&self) -> bool {
        !self.targets.is_empty() && self.targets.iter().all(|t| t.ready())
    }

    /// Every target's destination, in configuration order.
    pub fn destinations(&self) -> Vec<String> {
        self.targets.iter().map(|t| t.destination()).collect()
    }

    /// Every target's name, in configuration order.
    pub fn names(&self) -> Vec<&str> {
        self.targets.iter().map(|t| t.name()).collect()
    }

    /// The targets that take `kind`, in configuration order.
    pub fn targets(&self, kind: DeskEventKind) -> Vec<Arc<dyn DeskTarget>> {
        self.targets
            .iter()
            .filter(|t| t.takes(kind))
            .cloned()
            .collect()
    }
}

impl<T> Endpoint<T> {
    /// The `i`th endpoint of `config`, sending through `http` (`None`: nothing to send with).
    pub fn new(config: &HelpdeskConfig, i: usize, http: Option<T>) -> Result<Self, String> {
        let ep = config
            .endpoints
            .get(i)
            .ok_or_else(|| format!("helpdesk.endpoints[{i}]: no such endpoint"))?;
        let keys = ep
            .secrets
            .iter()
            .enumerate()
            .map(|(j, s)| {
                SigningKey::from_secret(s)
                    .map_err(|e| format!("helpdesk.endpoints[{i}].secrets[{j}]: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Endpoint {
            name: ep.name.clone(),
            url: ep.url.expose().to_owned(),
            keys,
            events: ep.events.clone(),
            http,
        })
    }

    fn selects(&self, kind: &str) -> bool {
        self.events.iter().any(|p| pattern_matches(p, kind))
    }
}

impl<T: Transport> Endpoint<T> {
    /// One signed POST of `body`. `id` is the event's stable id (the help desk dedupes by it);
    /// `timestamp` (Unix seconds) is the attempt's, signed with it.
    pub async fn post(&self, id: &str, body: &[u8], timestamp: i64) -> Result<(), DeskError> {
        let Some(http) = &self.http else {
            return Err(DeskError::Unavailable {
                endpoint: self.name.clone(),
                cause: "transport".into(),
                retry_after: None,
            });
        };
        let mut headers = vec![("accept".to_owned(), "application/json".to_owned())];
        headers.extend(signing::headers(&self.keys, id, timestamp, body));
        let request = RawRequest {
            method: "POST",
            path: self.url.clone(),
            headers,
            body: Some(body.to_vec()),
        };
        judge(&self.name, http.send(request).await).map(|_| ())
    }
}

impl DeskTarget for Endpoint<TransportHandle> {
    fn name(&self) -> &str {
        &self.name
    }

    fn destination(&self) -> String {
        crate::outbox::sink::helpdesk_destination(&self.name)
    }

    fn reason_prefix(&self) -> &'static str {
        "helpdesk"
    }

    fn takes(&self, kind: DeskEventKind) -> bool {
        self.selects(kind.as_str())
    }

    fn ready(&self) -> bool {
        self.http.is_some()
    }

    fn deliver<'a>(
        &'a self,
        event: &'a DeskEvent,
        _again: bool,
    ) -> BoxFuture<'a, Result<(), DeskError>> {
        // Real time: the help desk checks the signature's timestamp against its own clock.
        let timestamp = model::clock::system_millis().div_euclid(1000);
        Box::pin(self.post(&event.action_id, &event.body, timestamp))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{HelpdeskEndpoint, Secret};
    use std::sync::Mutex;
    use std::time::Duration;
    use upstream::transport::{RawResponse, TransportError};

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
        let config = config(&["handoff.*"]);
        let endpoints: Vec<Endpoint<Arc<Scripted>>> = (0..2)
            .map(|i| Endpoint::new(&config, i, Some(Arc::new(Scripted::default()))).expect("ep"))
            .collect();
        assert!(endpoints.iter().all(|ep| ep.http.is_some()));
        let takes = |kind: &str| -> Vec<&str> {
            endpoints
                .iter()
                .filter(|ep| ep.selects(kind))
                .map(|ep| ep.name.as_str())
                .collect()
        };
        assert_eq!(takes("handoff.ended"), vec!["desk", "audit"]);
        assert_eq!(takes("user.blocked"), vec!["audit"]);
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
        let hd = Endpoint::new(&config(&["*"]), 0, Some(http.clone())).expect("endpoint");
        let results = run(async {
            let mut out = Vec::new();
            for _ in 0..9 {
                out.push(hd.post("ev/r/0", b"{}", 1_700_000_000).await);
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
