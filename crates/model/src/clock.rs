//! Wall-clock time in the service's unit (Unix milliseconds): the daemon's [`Clock`], and times
//! given as text.

use crate::webhook::model::Millis;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// The daemon's clock: the system's time plus the test clock's offset (`admin.test_clock`), 0
/// unless an operator rehearsing a handoff advanced it. Each application owns one (clones share
/// it), so two daemons in one process keep their own time.
#[derive(Clone, Debug, Default)]
pub struct Clock {
    offset_ms: Arc<AtomicI64>,
}

impl Clock {
    /// A clock at the system's time.
    pub fn new() -> Clock {
        Clock::default()
    }

    /// The daemon's time: the system's, plus the test clock's offset. What the handoff sees (rule
    /// timers, business hours, event receive times).
    pub fn now_millis(&self) -> Millis {
        system_millis().saturating_add(self.offset_millis())
    }

    /// The test clock's offset.
    pub fn offset_millis(&self) -> Millis {
        self.offset_ms.load(Ordering::SeqCst)
    }

    /// Move the daemon's time forward by `by` (the test clock; it never goes back). Returns the
    /// new offset. Whoever sleeps until a wall-clock time must be woken by the caller.
    pub fn advance(&self, by: std::time::Duration) -> Millis {
        let by = Millis::try_from(by.as_millis()).unwrap_or(Millis::MAX);
        let step = |offset: Millis| Some(offset.saturating_add(by));
        let before = self
            .offset_ms
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, step)
            .unwrap_or_else(|offset| offset);
        before.saturating_add(by)
    }
}

/// The system's time, never moved by the test clock: for what other systems or the data's safety
/// judge by real time (retention and pruning, help-desk signature timestamps and give-up times).
pub fn system_millis() -> Millis {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| {
        Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX)
    })
}

/// A time given by an operator: Unix milliseconds, or RFC 3339 (`2026-11-22T09:00:00Z`).
pub fn parse_time(text: &str) -> Result<Millis, String> {
    let text = text.trim();
    if let Ok(ms) = text.parse::<Millis>() {
        return Ok(ms);
    }
    let at = humantime::parse_rfc3339_weak(text)
        .map_err(|e| format!("`{text}` is neither Unix milliseconds nor RFC 3339 ({e})"))?;
    let since = at
        .duration_since(UNIX_EPOCH)
        .map_err(|_| format!("`{text}` is before 1970"))?;
    Millis::try_from(since.as_millis()).map_err(|_| format!("`{text}` is too far away"))
}

/// ISO-8601 (RFC 3339) to Unix milliseconds, as the objects carry times as text but the queries
/// filter by milliseconds.
pub fn parse_iso_millis(text: &str) -> Result<Millis, String> {
    let t = humantime::parse_rfc3339_weak(text)
        .map_err(|e| format!("{text:?} is not an RFC 3339 time: {e}"))?;
    let d = t
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| format!("{text:?} is before 1970"))?;
    Millis::try_from(d.as_millis()).map_err(|_| format!("{text:?} is out of range"))
}

/// Unix milliseconds to the `2025-11-21T02:00:00.000Z` form the service uses.
pub fn format_iso_millis(ms: Millis) -> String {
    let d = std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + d).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_clock_keeps_its_own_offset_and_clones_share_it() {
        let (one, other) = (Clock::new(), Clock::new());
        let shared = one.clone();
        assert_eq!(one.advance(std::time::Duration::from_secs(60)), 60_000);
        assert_eq!(shared.offset_millis(), 60_000, "a clone moves with it");
        assert_eq!(other.offset_millis(), 0, "another clock does not");
        assert!(one.now_millis() >= other.now_millis() + 59_000);
        assert_eq!(one.advance(std::time::Duration::from_secs(1)), 61_000);
    }

    #[test]
    fn operator_times_parse_as_millis_or_rfc3339() {
        assert_eq!(parse_time("1763690400000"), Ok(1_763_690_400_000));
        assert_eq!(parse_time("2025-11-21T02:00:00Z"), Ok(1_763_690_400_000));
        assert_eq!(
            parse_time(" 2025-11-21T02:00:00.5Z "),
            Ok(1_763_690_400_500)
        );
        assert!(parse_time("yesterday").is_err());
        assert!(parse_time("").is_err());
    }
}
