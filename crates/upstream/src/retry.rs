//! `Retry-After` as the upstream and the help desks send it. The backoff between attempts is
//! the outbox's (`outbox::backoff`): the clients make one attempt per call.

use std::time::{Duration, SystemTime};

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
