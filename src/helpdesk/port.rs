//! The desk port, outbound: what a connector is handed (a [`DeskEvent`], everything the bridge
//! tells a desk about one decided `notify_helpdesk`, built once per outbox entry) and what it does
//! with it (one attempt, [`DeskTarget::deliver`]). The outbox's help-desk sink
//! (`outbox::helpdesk`) gives each event to every target that takes its kind, each its own
//! destination and circuit; a target that took it is not given it again.
//!
//! Inbound, a desk's agents reach the bridge through the one command path
//! ([`crate::helpdesk::commands`]), whatever their HTTP surface.

use super::events::{QueueInfo, Transcript};
use engine::state::{ConversationState, EndUserState};
use futures_util::future::BoxFuture;
use model::helpdesk::DeskEventKind;
use model::ids::ConversationId;
use model::webhook::model::{Message, Millis};
use serde_json::Value;
use std::time::Duration;
use upstream::retry::parse_retry_after;
use upstream::transport::{RawResponse, TransportError};

/// One desk event, as every target receives it.
#[derive(Clone, Debug)]
pub struct DeskEvent {
    /// The outbox entry's id (the action's): the same on every attempt.
    pub action_id: String,
    pub kind: DeskEventKind,
    /// When the event that led to it was received.
    pub occurred_at: Millis,
    pub conversation_id: ConversationId,
    /// The conversation's state (completed from the Open API for `handoff.requested`).
    pub conversation: Option<ConversationState>,
    pub end_user: Option<EndUserState>,
    pub reason: Option<String>,
    /// What the rule's `payload` gave.
    pub payload: Value,
    /// `conversation.message`: the message as the service reported it.
    pub message: Option<Message>,
    /// `handoff.requested`: the transcript and the queue standing.
    pub transcript: Option<Transcript>,
    pub queue: Option<QueueInfo>,
    /// The generic connector's Standard Webhooks body, built once so every attempt (and every
    /// endpoint) sends the same bytes.
    pub body: Vec<u8>,
}

/// Where desk events go: one generic endpoint, or a connector (Chatwoot).
pub trait DeskTarget: Send + Sync {
    /// Its name in logs and metrics (never a URL).
    fn name(&self) -> &str;
    /// Its outbox destination: the breaker's and `/readyz`'s name (`helpdesk:<endpoint>`,
    /// `chatwoot`).
    fn destination(&self) -> String;
    /// The first word of its dead letters' reasons (`helpdesk_http_400`, `chatwoot_http_401`).
    fn reason_prefix(&self) -> &'static str;
    /// Whether it takes events of `kind`.
    fn takes(&self, kind: DeskEventKind) -> bool;
    /// It can send (its client started).
    fn ready(&self) -> bool;
    /// One attempt at `event`; `again` when an earlier attempt of the same entry failed (a call
    /// of it may have taken effect: look before doing it again).
    fn deliver<'a>(
        &'a self,
        event: &'a DeskEvent,
        again: bool,
    ) -> BoxFuture<'a, Result<(), DeskError>>;
}

/// Why an attempt failed. Names the target by its configured name, never its URL (which may
/// carry credentials).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeskError {
    /// A 4xx other than 408/425/429 (or a redirect): the desk will not take it as it is.
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
    /// It answered 2xx with a body the connector cannot read (what it needs is missing).
    #[error("help desk {endpoint} answered what the bridge cannot read: {detail}")]
    BadAnswer { endpoint: String, detail: String },
    /// The desk cannot take the event as things stand there (Chatwoot: no conversation to post
    /// into): a dead letter with `reason` (`chatwoot_not_opened`).
    #[error("help desk {endpoint} cannot take the event: {detail}")]
    Unusable {
        endpoint: String,
        reason: &'static str,
        detail: String,
    },
}

impl DeskError {
    /// The metric outcome: `http_<status>`, `connect`, `timeout`, `transport`, `tls`,
    /// `bad_answer`, or an unusable event's reason.
    pub fn outcome(&self) -> String {
        match self {
            DeskError::Refused { status, .. } => format!("http_{status}"),
            DeskError::Unavailable { cause, .. } => cause.clone(),
            DeskError::Tls { .. } => "tls".into(),
            DeskError::BadAnswer { .. } => "bad_answer".into(),
            DeskError::Unusable { reason, .. } => (*reason).into(),
        }
    }

    /// A failure to reach the desk (tried again later), not an answer.
    pub fn is_transient(&self) -> bool {
        matches!(self, DeskError::Unavailable { .. } | DeskError::Tls { .. })
    }
}

/// A desk's answer judged: a 2xx, or why not (transient: connect, TLS, timeout, 408, 425, 429,
/// 5xx; else refused).
pub fn judge(
    endpoint: &str,
    sent: Result<RawResponse, TransportError>,
) -> Result<RawResponse, DeskError> {
    let unavailable = |cause: &str| DeskError::Unavailable {
        endpoint: endpoint.to_owned(),
        cause: cause.to_owned(),
        retry_after: None,
    };
    match sent {
        Ok(resp) if (200..300).contains(&resp.status) => Ok(resp),
        Ok(resp) if upstream::error::is_retryable_status(resp.status) => {
            Err(DeskError::Unavailable {
                endpoint: endpoint.to_owned(),
                cause: format!("http_{}", resp.status),
                retry_after: resp
                    .retry_after
                    .as_deref()
                    .and_then(|v| parse_retry_after(v, std::time::SystemTime::now())),
            })
        }
        Ok(resp) => Err(DeskError::Refused {
            endpoint: endpoint.to_owned(),
            status: resp.status,
        }),
        Err(TransportError::Connect(_)) => Err(unavailable("connect")),
        Err(TransportError::Tls(failure)) => Err(DeskError::Tls {
            endpoint: endpoint.to_owned(),
            failure,
        }),
        Err(TransportError::Timeout) => Err(unavailable("timeout")),
        Err(TransportError::Other(_)) => Err(unavailable("transport")),
    }
}
