//! `Idempotency-Key` for the agent API's mutating calls: the key's format, and which keys are
//! being answered right now.
//!
//! "In progress" lives in memory only: a call cut short by a crash leaves no claim behind, and
//! its retry is safe anyway, because the command's event id is made from the key (the writer
//! drops the retry's event as a duplicate and the answer comes from the recorded verdict).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

/// The header agents send.
pub const HEADER: &str = "Idempotency-Key";
/// Longest key accepted.
pub const MAX_KEY_LEN: usize = 128;

/// What a key may hold besides ASCII letters and digits.
pub const KEY_PUNCTUATION: &[u8] = b"-_.:";

/// Keys become part of event ids, sled keys and logs: visible ASCII without `/` (the action id
/// separator) only.
pub fn valid_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= MAX_KEY_LEN
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || KEY_PUNCTUATION.contains(&b))
}

/// Keys being answered now, by route; their number is the `handoff_helpdesk_calls_in_progress`
/// gauge.
#[derive(Default)]
pub struct InProgress {
    keys: Mutex<HashSet<String>>,
    gauge: Option<prometheus::IntGauge>,
}

/// A claimed key; released when dropped.
pub struct Claim {
    key: String,
    set: Arc<InProgress>,
}

impl InProgress {
    pub fn with_gauge(gauge: prometheus::IntGauge) -> Self {
        InProgress {
            keys: Mutex::default(),
            gauge: Some(gauge),
        }
    }

    /// Claim `route`'s `key`; `None` while another call holds it.
    pub fn claim(self: &Arc<Self>, route: &str, key: &str) -> Option<Claim> {
        let full = format!("{route}\0{key}");
        let mut set = self.keys.lock().ok()?;
        if !set.insert(full.clone()) {
            return None;
        }
        if let Some(g) = &self.gauge {
            g.inc();
        }
        Some(Claim {
            key: full,
            set: Arc::clone(self),
        })
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Ok(mut set) = self.set.keys.lock() {
            if set.remove(&self.key) {
                if let Some(g) = &self.set.gauge {
                    g.dec();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_short_visible_and_free_of_separators() {
        assert!(valid_key("3f1c2a9e-7b7d-4d0e-a1b2-000000000001"));
        assert!(valid_key("order:42.retry_1"));
        assert!(!valid_key(""));
        assert!(!valid_key("a/b"));
        assert!(!valid_key("has space"));
        assert!(!valid_key(&"k".repeat(MAX_KEY_LEN + 1)));
    }

    #[test]
    fn a_key_is_claimed_once_per_route_until_released() {
        let set = Arc::new(InProgress::default());
        let claim = set.claim("accept", "k1").expect("first");
        assert!(set.claim("accept", "k1").is_none());
        assert!(set.claim("release", "k1").is_some(), "per route");
        drop(claim);
        assert!(set.claim("accept", "k1").is_some());
    }
}
