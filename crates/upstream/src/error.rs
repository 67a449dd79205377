//! The one error type of the Open API boundary.

use std::time::Duration;

/// Why a call failed. Transient failures are retried by the client before they surface;
/// permanent ones (most 4xx) come back at once, with the service's status and body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamError {
    #[error("cannot connect to the upstream: {0}")]
    Connect(String),
    /// The TLS handshake failed (certificate not trusted, expired, for another name...).
    #[error("cannot connect to the upstream: {0}")]
    Tls(crate::tls::TlsFailure),
    #[error("the upstream did not answer in time")]
    Timeout,
    #[error("the upstream connection failed: {0}")]
    Transport(String),
    #[error("the upstream answered {status} {code}: {message}")]
    Status {
        status: u16,
        /// `error.code` of the answer, or `http_<status>` when the body has none.
        code: String,
        message: String,
        /// The raw answer body (bounded), for dead-letter records.
        body: String,
        /// A `Retry-After` the upstream asked for, already parsed and clamped.
        retry_after: Option<Duration>,
    },
    #[error("the upstream answer could not be read: {0}")]
    Decode(String),
    #[error("invalid call: {0}")]
    InvalidCall(String),
    #[error("the upstream client has stopped")]
    Stopped,
}

impl UpstreamError {
    /// Connect errors, timeouts, dropped connections, 408, 425, 429 and 5xx may succeed later.
    pub fn is_retryable(&self) -> bool {
        match self {
            UpstreamError::Connect(_)
            | UpstreamError::Tls(_)
            | UpstreamError::Timeout
            | UpstreamError::Transport(_) => true,
            UpstreamError::Status { status, .. } => is_retryable_status(*status),
            UpstreamError::Decode(_) | UpstreamError::InvalidCall(_) | UpstreamError::Stopped => {
                false
            }
        }
    }

    /// HTTP status of a permanent (or last) failure, if the upstream answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            UpstreamError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

pub fn is_retryable_status(status: u16) -> bool {
    matches!(status, 408 | 425 | 429) || (500..=599).contains(&status)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(s: u16) -> UpstreamError {
        UpstreamError::Status {
            status: s,
            code: String::new(),
            message: String::new(),
            body: String::new(),
            retry_after: None,
        }
    }

    #[test]
    fn only_transient_failures_are_retryable() {
        for s in [408, 425, 429, 500, 502, 503, 504, 599] {
            assert!(status(s).is_retryable(), "{s}");
        }
        for s in [400, 401, 403, 404, 409, 422, 600] {
            assert!(!status(s).is_retryable(), "{s}");
        }
        assert!(UpstreamError::Timeout.is_retryable());
        assert!(UpstreamError::Connect("refused".into()).is_retryable());
        assert!(UpstreamError::Tls(crate::tls::TlsFailure {
            reason: crate::tls::TlsReason::UnknownIssuer,
            detail: "invalid peer certificate: UnknownIssuer".into(),
        })
        .is_retryable());
        assert!(!UpstreamError::Decode("x".into()).is_retryable());
        assert_eq!(status(404).status(), Some(404));
    }
}
