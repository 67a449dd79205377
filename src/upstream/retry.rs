//! Retry policy as data: capped exponential backoff with full jitter, and `Retry-After`.

use rand::Rng;
use serde::{Deserialize, Serialize};
use std::time::{Duration, SystemTime};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    /// Attempts in all, the first included.
    pub max_attempts: u32,
    /// First backoff ceiling; doubles each attempt.
    #[serde(with = "humantime_serde")]
    pub base: Duration,
    /// Largest backoff ceiling.
    #[serde(with = "humantime_serde")]
    pub cap: Duration,
    /// A `Retry-After` longer than this is clamped to it.
    #[serde(with = "humantime_serde")]
    pub max_retry_after: Duration,
}

impl RetryPolicy {
    /// The ceiling of the wait before attempt `retry` + 1 (retry counts from 1).
    pub fn ceiling(&self, retry: u32) -> Duration {
        let factor = 2u32.saturating_pow(retry.saturating_sub(1));
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// Full jitter (uniform in [0, ceiling]): spreads retries of many callers so they do not
    /// return in step. A `Retry-After` from the upstream wins, clamped.
    pub fn delay(&self, retry: u32, retry_after: Option<Duration>, rng: &mut impl Rng) -> Duration {
        if let Some(wait) = retry_after {
            return wait.min(self.max_retry_after);
        }
        let ceiling = self.ceiling(retry);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rng.random_range(0..=nanos))
    }
}

/// `Retry-After` as delta-seconds or an HTTP date; anything else is ignored (`None`).
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 5,
            base: Duration::from_millis(100),
            cap: Duration::from_secs(1),
            max_retry_after: Duration::from_secs(30),
        }
    }

    #[test]
    fn ceilings_double_then_cap() {
        let p = policy();
        let got: Vec<u128> = (1..=6).map(|r| p.ceiling(r).as_millis()).collect();
        assert_eq!(got, vec![100, 200, 400, 800, 1000, 1000]);
        assert_eq!(p.ceiling(200), Duration::from_secs(1), "no overflow");
    }

    #[test]
    fn jittered_delays_stay_within_the_ceiling_and_vary() {
        let p = policy();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let delays: Vec<Duration> = (0..200).map(|_| p.delay(3, None, &mut rng)).collect();
        assert!(delays.iter().all(|d| *d <= Duration::from_millis(400)));
        let distinct: std::collections::HashSet<_> = delays.iter().collect();
        assert!(distinct.len() > 100, "full jitter spreads the waits");
    }

    #[test]
    fn retry_after_wins_and_is_clamped() {
        let p = policy();
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(3)), &mut rng),
            Duration::from_secs(3)
        );
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(3600)), &mut rng),
            Duration::from_secs(30)
        );
    }

    #[test]
    fn retry_after_parses_seconds_and_dates_and_ignores_garbage() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(45));
        assert_eq!(
            parse_retry_after(&later, now),
            Some(Duration::from_secs(45))
        );
        let past = httpdate::fmt_http_date(now - Duration::from_secs(45));
        assert_eq!(parse_retry_after(&past, now), Some(Duration::ZERO));
        for garbage in ["", "soon", "-5", "1.5", "Mon, 99 Foo 2020"] {
            assert_eq!(parse_retry_after(garbage, now), None, "{garbage:?}");
        }
    }
}
