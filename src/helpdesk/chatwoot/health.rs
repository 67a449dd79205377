//! How the connector last found Chatwoot, for the console's overview and `/readyz`'s detail
//! (never a reason for a 503: intake must not stop while a desk is down).

use crate::helpdesk::port::DeskError;
use std::sync::Mutex;

/// What the last call found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum Seen {
    /// Nothing called yet.
    #[default]
    Unknown,
    Ok,
    /// 401 or 403: the token is wrong, revoked, or lacks the rights.
    Unauthorized,
    /// Connect, TLS, timeout, 408/425/429/5xx.
    Unreachable,
    /// Another refusal, or an answer the connector could not read.
    Refused,
}

/// The connector's health, as its calls find it.
#[derive(Debug, Default)]
pub struct Health {
    last: Mutex<Seen>,
}

impl Health {
    /// A call's outcome.
    pub fn saw(&self, outcome: Result<(), &DeskError>) {
        let seen = match outcome {
            Ok(()) => Seen::Ok,
            Err(DeskError::Refused {
                status: 401 | 403, ..
            }) => Seen::Unauthorized,
            Err(e) if e.is_transient() => Seen::Unreachable,
            Err(_) => Seen::Refused,
        };
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = seen;
    }

    /// What the last call found.
    pub fn seen(&self) -> Seen {
        *self.last.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// As the overview says it: `ok`, `unauthorized`, `unreachable`, `circuit open`... The open
    /// circuit (the executor's view) comes first.
    pub fn status(&self, circuit_open: bool) -> &'static str {
        if circuit_open {
            return "circuit open";
        }
        match self.seen() {
            Seen::Unknown => "not called yet",
            other => other.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_says_what_the_last_call_found_and_an_open_circuit_first() {
        let h = Health::default();
        assert_eq!(h.status(false), "not called yet");
        let refused = |status| DeskError::Refused {
            endpoint: "chatwoot".into(),
            status,
        };
        h.saw(Err(&refused(401)));
        assert_eq!(h.status(false), "unauthorized");
        h.saw(Err(&DeskError::Unavailable {
            endpoint: "chatwoot".into(),
            cause: "connect".into(),
            retry_after: None,
        }));
        assert_eq!(h.status(false), "unreachable");
        assert_eq!(h.status(true), "circuit open");
        h.saw(Ok(()));
        assert_eq!(h.status(false), "ok");
        h.saw(Err(&refused(422)));
        assert_eq!(h.status(false), "refused");
    }
}
