//! Where entries go (the Open API, the help desks) behind one interface: a sink makes ONE
//! attempt at an entry and says how it went ([`Attempt`]); the executor decides what follows
//! (record, reschedule with the one backoff, give up) and the scheduler what runs next.

use crate::helpdesk::DeskError;
use futures_util::future::BoxFuture;
use model::action::{OutboxEntry, RetryState};
use std::time::Duration;
use upstream::error::UpstreamError;
use upstream::execute::ExecuteError;

/// The Open API's destination name (breaker, metrics, `/readyz`).
pub const OPENAPI: &str = "openapi";

/// A help-desk endpoint's destination name.
pub fn helpdesk_destination(endpoint: &str) -> String {
    format!("helpdesk:{endpoint}")
}

/// Which sink carries an entry out (each has its own window and store cursor, indexed by the
/// discriminant). The list of all kinds ([`SinkKind::ALL`]) comes from the enum itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, strum::VariantArray, strum::EnumCount)]
pub enum SinkKind {
    OpenApi = 0,
    Helpdesk = 1,
}

impl SinkKind {
    /// Every kind, in declaration order (each at its discriminant's index). A constant: the
    /// `unwrap` runs at compile time (strum's list has exactly `COUNT` kinds), never at run time.
    pub const ALL: [SinkKind; <SinkKind as strum::EnumCount>::COUNT] =
        *<SinkKind as strum::VariantArray>::VARIANTS
            .first_chunk()
            .unwrap();

    pub fn of(entry: &OutboxEntry) -> SinkKind {
        match entry.action {
            model::action::Action::NotifyHelpdesk { .. } => SinkKind::Helpdesk,
            _ => SinkKind::OpenApi,
        }
    }
}

/// One attempt to make: the entry, its attempts so far, and the destinations its circuits let
/// through now (a help-desk event's other endpoints wait for theirs).
#[derive(Clone, Debug)]
pub struct Job {
    pub entry: OutboxEntry,
    pub state: RetryState,
    pub allowed: Vec<String>,
}

/// A transient failure: worth another attempt later.
#[derive(Debug, thiserror::Error)]
pub enum Transient {
    #[error(transparent)]
    Upstream(UpstreamError),
    #[error(transparent)]
    Helpdesk(DeskError),
}

impl Transient {
    /// A wait the destination asked for.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Transient::Upstream(UpstreamError::Status { retry_after, .. }) => *retry_after,
            Transient::Helpdesk(DeskError::Unavailable { retry_after, .. }) => *retry_after,
            _ => None,
        }
    }

    /// The dead letter's reason when the entry gives up: `tls_<reason>` when the handshake
    /// never verified (the certificate needs fixing), else `retries_exhausted`.
    pub fn give_up_reason(&self) -> String {
        let tls = match self {
            Transient::Upstream(UpstreamError::Tls(f)) => Some(f),
            Transient::Helpdesk(DeskError::Tls { failure, .. }) => Some(failure),
            _ => None,
        };
        match tls {
            Some(f) => format!("tls_{}", f.reason.label()),
            None => "retries_exhausted".into(),
        }
    }
}

/// Why an entry failed for good.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dead {
    /// The dead letter's stable reason code ([`model::action::DeadLetter::reason`]).
    pub reason: String,
    pub error: String,
    /// The upstream refused it with a permanent status (a retry needs a fresh key).
    pub answered: bool,
}

/// How one attempt went.
#[derive(Debug)]
pub enum Attempt {
    Done,
    /// A transient failure: try again later (`after`: a wait the destination asked for).
    Retry {
        after: Option<Duration>,
        failure: Transient,
    },
    Dead(Dead),
    /// Not finished only because destinations it still needs were not allowed (their circuits
    /// are open): it waits for them, no failure counted.
    Held,
    /// Nothing attempted: the client is stopping. Runs again after the next start.
    Stopped,
}

/// What a destination showed in this attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// It answered in a way that shows it works (a success, or a permanent refusal).
    Answered,
    /// A transient failure.
    Failed,
}

/// An attempt's outcome, with what it learnt of each destination and its metric status.
#[derive(Debug)]
pub struct Report {
    pub attempt: Attempt,
    /// Something was sent (an attempt to count).
    pub attempted: bool,
    pub reached: Vec<(String, Reach)>,
    /// The `status` label of `handoff_action_attempts_total`.
    pub status: String,
    /// The destination took it in this attempt (its end-to-end latency is observed); false for
    /// an entry done with nothing to send (no help desk, no endpoint for its kind).
    pub delivered: bool,
}

impl Report {
    pub fn new(attempt: Attempt, status: impl Into<String>) -> Self {
        Report {
            attempt,
            attempted: true,
            reached: Vec::new(),
            status: status.into(),
            delivered: false,
        }
    }

    /// Done: the destination took it (status `ok`).
    pub fn delivered() -> Self {
        Report {
            delivered: true,
            ..Report::new(Attempt::Done, "ok")
        }
    }
}

/// A destination kind of the outbox.
pub trait Sink: Send + Sync + 'static {
    /// The destinations `entry` still needs (empty: none, it goes without a circuit).
    fn destinations(&self, entry: &OutboxEntry) -> Vec<String>;

    /// One attempt at `job.entry`, to the destinations in `job.allowed` only.
    fn attempt<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Report>;

    /// The entry finished (done or dead): forget what was kept between its attempts.
    fn forget(&self, _entry: &OutboxEntry) {}
}

/// The Open API's answer judged: `Ok(dead)` for a permanent failure, `Err(failure)` for a
/// transient one, and whether the destination answered (reached).
pub fn judge_upstream(e: ExecuteError) -> Result<(Dead, bool), Transient> {
    match e {
        ExecuteError::Upstream(UpstreamError::Stopped) => {
            Err(Transient::Upstream(UpstreamError::Stopped))
        }
        ExecuteError::Upstream(u) if u.is_retryable() => Err(Transient::Upstream(u)),
        other => {
            let answered = refused_for_good(&other);
            let reached = matches!(
                &other,
                ExecuteError::Upstream(UpstreamError::Status { .. } | UpstreamError::Decode(_))
            );
            let dead = Dead {
                reason: dead_reason(&other),
                error: other.to_string(),
                answered,
            };
            Ok((dead, reached))
        }
    }
}

/// The upstream refused with a permanent error status. Only that proves nothing took effect: a
/// retryable status (or a timeout) may follow an attempt that did, whose answer the upstream
/// keeps under the key.
pub fn refused_for_good(e: &ExecuteError) -> bool {
    matches!(e, ExecuteError::Upstream(u @ UpstreamError::Status { .. }) if !u.is_retryable())
}

/// The dead-letter reason of a permanent failure.
fn dead_reason(e: &ExecuteError) -> String {
    match e {
        ExecuteError::NotUpstream(_) => "no_helpdesk".into(),
        ExecuteError::UnknownFlow { .. } => "unknown_flow".into(),
        ExecuteError::Upstream(u) => match u {
            UpstreamError::Status { status, code, .. } => {
                if code.is_empty() || code.starts_with("http_") {
                    format!("http_{status}")
                } else {
                    code.clone()
                }
            }
            UpstreamError::Decode(_) => "bad_answer".into(),
            UpstreamError::InvalidCall(_) => "invalid_call".into(),
            // Transient ones never get here (judged before); named for completeness.
            UpstreamError::Tls(f) => format!("tls_{}", f.reason.label()),
            UpstreamError::Connect(_)
            | UpstreamError::Timeout
            | UpstreamError::Transport(_)
            | UpstreamError::Stopped => "retries_exhausted".into(),
        },
    }
}

/// The metric status of a failed Open API attempt.
pub fn upstream_status(e: &ExecuteError) -> String {
    match e {
        ExecuteError::NotUpstream(_) => "no_helpdesk".into(),
        ExecuteError::UnknownFlow { .. } => "unknown_flow".into(),
        ExecuteError::Upstream(u) => match u {
            UpstreamError::Stopped => "stopped".into(),
            UpstreamError::Status { status, .. } => format!("http_{status}"),
            UpstreamError::Connect(_) => "connect".into(),
            UpstreamError::Tls(_) => "tls".into(),
            UpstreamError::Timeout => "timeout".into(),
            UpstreamError::Transport(_) => "transport".into(),
            UpstreamError::Decode(_) => "bad_answer".into(),
            UpstreamError::InvalidCall(_) => "invalid_call".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(s: u16, code: &str) -> ExecuteError {
        ExecuteError::Upstream(UpstreamError::Status {
            status: s,
            code: code.into(),
            message: String::new(),
            body: String::new(),
            retry_after: None,
        })
    }

    #[test]
    fn all_lists_each_sink_kind_once_at_its_index() {
        assert_eq!(SinkKind::ALL, [SinkKind::OpenApi, SinkKind::Helpdesk]);
        for (i, kind) in SinkKind::ALL.into_iter().enumerate() {
            assert_eq!(kind as usize, i);
        }
    }

    fn dead(e: ExecuteError) -> Dead {
        judge_upstream(e).expect("permanent").0
    }

    #[test]
    fn failures_are_judged_transient_or_permanent_with_stable_reasons() {
        for s in [408, 425, 429, 500, 502, 503, 504] {
            assert!(judge_upstream(status(s, "x")).is_err(), "{s} is transient");
        }
        for e in [
            UpstreamError::Connect("refused".into()),
            UpstreamError::Timeout,
            UpstreamError::Transport("cut".into()),
        ] {
            assert!(judge_upstream(ExecuteError::Upstream(e)).is_err());
        }
        assert_eq!(dead(status(404, "not_found")).reason, "not_found");
        assert_eq!(dead(status(400, "http_400")).reason, "http_400");
        assert_eq!(dead(status(422, "")).reason, "http_422");
        assert!(
            judge_upstream(status(409, "conflict"))
                .expect("permanent")
                .1,
            "reached"
        );
        // Only a permanent refusal may be retried under a fresh key.
        assert!(dead(status(409, "conflict")).answered);
        assert!(
            !refused_for_good(&status(503, "x")),
            "an earlier attempt may have worked"
        );
        assert!(!refused_for_good(&status(429, "x")));
        let unknown = ExecuteError::UnknownFlow {
            bot: "B1".into(),
            title: "Nowhere".into(),
        };
        let (d, reached) = judge_upstream(unknown).expect("permanent");
        assert_eq!(d.reason, "unknown_flow");
        assert!(!d.answered && !reached, "nothing was called");
        assert_eq!(
            dead(ExecuteError::NotUpstream("notify_helpdesk")).reason,
            "no_helpdesk"
        );
        assert_eq!(
            dead(ExecuteError::Upstream(UpstreamError::Decode("x".into()))).reason,
            "bad_answer"
        );
        // A handshake that never verified is transient; when it gives up the reason says why.
        let tls = UpstreamError::Tls(upstream::tls::TlsFailure {
            reason: upstream::tls::TlsReason::NameMismatch,
            detail: "invalid peer certificate: NotValidForName".into(),
        });
        let failure = judge_upstream(ExecuteError::Upstream(tls)).expect_err("transient");
        assert_eq!(failure.give_up_reason(), "tls_name_mismatch");
        let unavailable = Transient::Upstream(UpstreamError::Status {
            status: 429,
            code: String::new(),
            message: String::new(),
            body: String::new(),
            retry_after: Some(Duration::from_secs(7)),
        });
        assert_eq!(unavailable.retry_after(), Some(Duration::from_secs(7)));
        assert_eq!(unavailable.give_up_reason(), "retries_exhausted");
    }
}
