//! Every sled key and tree name the bridge uses. No other module builds keys.

/// Tree names. Changing one is a data migration.
pub mod tree {
    /// event id -> inbox sequence number of its first (and only) acceptance.
    pub const SEEN: &str = "seen/v1";
    /// delivery id -> receive time; a re-sent delivery is recognised before its events are read.
    pub const DELIVERIES: &str = "deliveries/v1";
    /// sequence number -> event record (the event log, in acceptance order).
    pub const EVENTS: &str = "events/v1";
    /// sequence number -> partition key, for events not yet folded into state.
    pub const INBOX: &str = "inbox/v1";
    pub const CONVERSATIONS: &str = "conversations/v1";
    pub const END_USERS: &str = "end_users/v1";
    /// (platform, userKey) -> end user id.
    pub const USER_INDEX: &str = "user_index/v1";
    pub const BOTS: &str = "bots/v1";
    /// quarantine id -> quarantined delivery or event.
    pub const QUARANTINE: &str = "quarantine/v1";
    /// sequence number -> decided action not yet carried out.
    pub const OUTBOX: &str = "outbox/v1";
    /// sequence number (as in the outbox) -> action that failed for good.
    pub const DEAD_LETTERS: &str = "dead_letters/v1";
    /// action id -> its status (pending, done, dead, dropped): every decided action.
    pub const ACTIONS: &str = "actions/v1";
    /// sequence number (as in the outbox) -> finished entry (done or dropped), for the audit
    /// window.
    pub const DONE: &str = "done/v1";
    /// Bookkeeping: layout version, prune cursor.
    pub const META: &str = "meta";
}

pub mod meta {
    pub const LAYOUT_VERSION: &[u8] = b"layout_version";
    pub const DEDUPE_PRUNED_THROUGH: &[u8] = b"dedupe_pruned_through";
}

/// Sequence numbers are big-endian so sled's byte order is numeric order.
pub fn seq(n: u64) -> [u8; 8] {
    n.to_be_bytes()
}

pub fn parse_seq(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(bytes.try_into().ok()?))
}

/// `(platform, userKey)`: the platform is length-prefixed so no user key can forge another
/// platform's entry.
pub fn user_index(platform: &str, user_key: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(2 + platform.len() + user_key.len());
    let len = u16::try_from(platform.len()).unwrap_or(u16::MAX);
    key.extend_from_slice(&len.to_be_bytes());
    key.extend_from_slice(&platform.as_bytes()[..usize::from(len)]);
    key.extend_from_slice(user_key.as_bytes());
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_keys_sort_numerically() {
        assert!(seq(9) < seq(10));
        assert!(seq(255) < seq(256));
        assert_eq!(parse_seq(&seq(123_456)), Some(123_456));
        assert_eq!(parse_seq(b"short"), None);
    }

    #[test]
    fn user_index_keys_do_not_collide_across_platforms() {
        assert_ne!(user_index("web", "kakaoX"), user_index("webkakao", "X"));
        assert_eq!(user_index("web", "k"), user_index("web", "k"));
    }
}
