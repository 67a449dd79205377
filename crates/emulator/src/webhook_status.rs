//! The webhook as the service judges it: three failed deliveries (non-200 answers or connection
//! failures) within 30 minutes disable it until it is enabled again. Pure: times are passed in.

use model::webhook::model::Millis;
use serde::Serialize;

/// Failed deliveries (non-200 answers or connection failures) within [`FAILURE_WINDOW_MS`] that
/// disable the webhook, as the service does.
pub const DISABLE_AFTER_FAILURES: usize = 3;
/// 30 minutes.
pub const FAILURE_WINDOW_MS: Millis = 30 * 60 * 1000;
/// One failed delivery attempt.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryFailure {
    pub at: Millis,
    /// `status 503`, or the connection error.
    pub what: String,
}

/// The webhook as the service judges it: enabled until [`DISABLE_AFTER_FAILURES`] failures fall
/// within [`FAILURE_WINDOW_MS`], then disabled until enabled again. Pure: the times are passed in.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WebhookStatus {
    pub enabled: bool,
    /// When it was disabled last, and why.
    pub disabled_at: Option<Millis>,
    pub reason: Option<String>,
    pub enabled_at: Option<Millis>,
    /// Failures within the window (the oldest go as it moves).
    pub failures: Vec<DeliveryFailure>,
    /// Deliveries answered 200.
    pub delivered: u64,
    /// Held events dropped past `state::MAX_HELD_EVENTS`.
    pub dropped: u64,
    /// Where deliveries go when enable named a new URL (not shown: it holds the token).
    #[serde(skip)]
    pub url: Option<String>,
}

impl Default for WebhookStatus {
    fn default() -> Self {
        WebhookStatus {
            enabled: true,
            disabled_at: None,
            reason: None,
            enabled_at: None,
            failures: Vec::new(),
            delivered: 0,
            dropped: 0,
            url: None,
        }
    }
}

impl WebhookStatus {
    /// A delivery answered 200.
    pub fn delivered(&mut self) {
        self.delivered += 1;
    }

    /// A failed attempt at `at`. Returns true when it disables the webhook (the third failure
    /// within the window).
    pub fn failed(&mut self, at: Millis, what: String) -> bool {
        self.failures
            .retain(|f| at.saturating_sub(f.at) < FAILURE_WINDOW_MS);
        self.failures.push(DeliveryFailure { at, what });
        if self.enabled && self.failures.len() >= DISABLE_AFTER_FAILURES {
            self.enabled = false;
            self.disabled_at = Some(at);
            self.reason = Some(format!(
                "{} failed deliveries within 30 minutes (last: {})",
                self.failures.len(),
                self.failures.last().map_or("", |f| f.what.as_str())
            ));
            return true;
        }
        false
    }

    /// Enabled again (the bot's webhook settings): the failures are forgotten. Returns whether
    /// it was disabled.
    pub fn enable(&mut self, at: Millis) -> bool {
        let was_disabled = !self.enabled;
        self.enabled = true;
        self.enabled_at = Some(at);
        self.failures.clear();
        was_disabled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Millis = 60_000;

    #[test]
    fn three_failures_within_30_minutes_disable_the_webhook() {
        let mut w = WebhookStatus::default();
        assert!(w.enabled);
        assert!(!w.failed(0, "status 503".into()));
        w.delivered();
        assert!(!w.failed(10 * MIN, "status 500".into()));
        assert!(w.enabled, "two failures leave it enabled");
        assert!(w.failed(29 * MIN, "connection failed: refused".into()));
        assert!(!w.enabled);
        assert_eq!(w.disabled_at, Some(29 * MIN));
        let reason = w.reason.clone().unwrap_or_default();
        assert!(reason.contains("3 failed deliveries"), "{reason}");
        assert!(reason.contains("connection failed"), "{reason}");
        assert!(
            !w.failed(29 * MIN + 1, "status 503".into()),
            "disabled once"
        );
    }

    #[test]
    fn failures_further_apart_than_30_minutes_do_not_disable_it() {
        let mut w = WebhookStatus::default();
        assert!(!w.failed(0, "status 503".into()));
        assert!(!w.failed(20 * MIN, "status 503".into()));
        // The first failure is 30 minutes old: out of the window.
        assert!(!w.failed(30 * MIN, "status 503".into()));
        assert!(w.enabled);
        assert_eq!(w.failures.len(), 2);
        assert!(w.failed(31 * MIN, "status 503".into()));
    }

    #[test]
    fn enabling_again_forgets_the_failures() {
        let mut w = WebhookStatus::default();
        for t in 0..3 {
            w.failed(t, "status 500".into());
        }
        assert!(!w.enabled);
        assert!(w.enable(5 * MIN));
        assert!(w.enabled && w.failures.is_empty());
        assert_eq!(w.enabled_at, Some(5 * MIN));
        assert!(!w.enable(6 * MIN), "already enabled");
        assert!(
            !w.failed(7 * MIN, "status 500".into()),
            "counting starts afresh"
        );
    }
}
