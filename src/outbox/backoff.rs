//! The one backoff policy of the outbox (`[outbox.retry]`), for the Open API and the help-desk
//! events alike: capped exponential backoff with full jitter, a `Retry-After` honoured and
//! clamped, and the give-up time (`outbox.give_up_after`) measured from an entry's first failed
//! attempt.

use model::action::RetryState;
use model::webhook::model::Millis;
use rand::Rng;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// `[outbox.retry]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Backoff {
    /// The ceiling of the first wait; doubles after each failed attempt up to `cap`.
    #[serde(with = "humantime_serde")]
    pub base: Duration,
    /// The largest ceiling.
    #[serde(with = "humantime_serde")]
    pub cap: Duration,
    /// A `Retry-After` longer than this is clamped to it.
    #[serde(with = "humantime_serde")]
    pub max_retry_after: Duration,
}

impl Backoff {
    /// The ceiling of the wait after `failures` failed attempts (counted from 1).
    pub fn ceiling(&self, failures: u32) -> Duration {
        let factor = 2u32.saturating_pow(failures.saturating_sub(1).min(31));
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// The wait after `failures` failed attempts: a `Retry-After` the destination sent wins
    /// (clamped to `max_retry_after`); else full jitter, uniform in [ceiling / 10, ceiling], so
    /// many waiting queues do not return in step and an attempt never follows a failure at once.
    pub fn delay(
        &self,
        failures: u32,
        retry_after: Option<Duration>,
        rng: &mut impl Rng,
    ) -> Duration {
        if let Some(wait) = retry_after {
            return wait.min(self.max_retry_after);
        }
        let nanos = u64::try_from(self.ceiling(failures).as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rng.random_range(nanos / 10..=nanos))
    }
}

/// What follows a transient failure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AfterFailure {
    /// Try again at this daemon time; the state to keep (and persist) meanwhile.
    RetryAt(RetryState),
    /// Failing for `give_up_after` already: a dead letter.
    GiveUp(RetryState),
}

/// Count a transient failure at `now` into `state` and decide: the next attempt's time, or give
/// up when the entry has been failing (from its first failed attempt to this one) for
/// `give_up_after`. The last attempt comes at the give-up time, not a whole backoff past it.
pub fn after_failure(
    mut state: RetryState,
    now: Millis,
    error: String,
    retry_after: Option<Duration>,
    policy: &Backoff,
    give_up_after: Duration,
    rng: &mut impl Rng,
) -> AfterFailure {
    state.attempts = state.attempts.saturating_add(1);
    state.failures = state.failures.saturating_add(1);
    let first = *state.first_failure_at.get_or_insert(now);
    state.last_attempt_at = Some(now);
    state.last_error = Some(error);
    let failing_for = Duration::from_millis(u64::try_from(now - first).unwrap_or(0));
    if failing_for >= give_up_after {
        state.next_attempt_at = None;
        return AfterFailure::GiveUp(state);
    }
    let wait = policy
        .delay(state.failures, retry_after, rng)
        .min(give_up_after - failing_for)
        .max(Duration::from_millis(1));
    state.next_attempt_at = Some(now.saturating_add(millis(wait)));
    AfterFailure::RetryAt(state)
}

pub(crate) fn millis(d: Duration) -> Millis {
    Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn policy() -> Backoff {
        Backoff {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(300),
            max_retry_after: Duration::from_secs(600),
        }
    }

    #[test]
    fn ceilings_double_then_cap_without_overflow() {
        let p = policy();
        let got: Vec<u64> = (1..=11).map(|f| p.ceiling(f).as_secs()).collect();
        assert_eq!(got, vec![1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert_eq!(p.ceiling(u32::MAX), Duration::from_secs(300));
    }

    #[test]
    fn jitter_stays_under_its_ceiling_varies_and_honours_retry_after() {
        let p = policy();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for failures in 1..40 {
            let waits: Vec<Duration> = (0..50).map(|_| p.delay(failures, None, &mut rng)).collect();
            let ceiling = p.ceiling(failures);
            assert!(
                waits.iter().all(|w| *w <= ceiling && *w >= ceiling / 10),
                "{failures}"
            );
        }
        let spread: std::collections::HashSet<_> =
            (0..200).map(|_| p.delay(5, None, &mut rng)).collect();
        assert!(spread.len() > 100, "full jitter spreads the waits");
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(30)), &mut rng),
            Duration::from_secs(30),
            "Retry-After wins over a 1 s ceiling"
        );
        assert_eq!(
            p.delay(9, Some(Duration::from_secs(86_400)), &mut rng),
            Duration::from_secs(600),
            "and is clamped"
        );
    }

    #[test]
    fn failures_retry_until_the_give_up_time_then_give_up() {
        let p = policy();
        let give_up = Duration::from_secs(24 * 3600);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut state = RetryState::default();
        let start: Millis = 1_000_000;
        let mut now = start;
        let mut failures = 0;
        loop {
            match after_failure(state, now, "503".into(), None, &p, give_up, &mut rng) {
                AfterFailure::RetryAt(s) => {
                    failures += 1;
                    let next = s.next_attempt_at.expect("next");
                    assert!(next > now && next <= start + millis(give_up));
                    assert!(next - now <= 300_000, "never more than the cap");
                    now = next;
                    state = s;
                }
                AfterFailure::GiveUp(s) => {
                    assert_eq!(now - start, millis(give_up), "exactly at the give-up time");
                    assert_eq!(s.first_failure_at, Some(start));
                    assert_eq!(s.attempts, failures + 1);
                    assert_eq!(s.last_error.as_deref(), Some("503"));
                    break;
                }
            }
        }
        assert!(
            failures > 280,
            "a day of attempts, about every 2.5 min: {failures}"
        );
    }
}
