//! Typed identifiers.
//!
//! The service uses opaque strings for every id (UUIDs for most, `Bxxxxx` for bots). Wrapping them
//! keeps a conversation id from being passed where an end-user id is expected, which matters
//! because the two look alike and a user's conversation id changes every session.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            pub fn new(value: impl Into<String>) -> Self {
                Self(value.into())
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<&str> for $name {
            fn from(value: &str) -> Self {
                Self(value.to_owned())
            }
        }
    };
}

string_id!(
    /// A webhook delivery (the envelope's `id`); the service re-sends a delivery with the same id.
    DeliveryId
);
string_id!(
    /// An event inside a delivery; the dedupe key.
    EventId
);
string_id!(
    /// A conversation (one session of one end user); changes when the session changes.
    ConversationId
);
string_id!(
    /// An end user of one bot on one messenger.
    EndUserId
);
string_id!(
    /// A bot (shape `Bxxxxx`).
    BotId
);
string_id!(
    /// The user's key on its messenger; unique only together with the platform.
    UserKey
);

/// Id prefixes the bridge keeps for the ids it makes itself (event and delivery ids): timer
/// firings, agent commands, re-processed quarantine records, reconciliation events, and the
/// service's events read back through the Open API by backfill (`backfill`). The one list:
/// [`Internal`] makes ids from it, and the webhook refuses an event or delivery whose id starts
/// with one of them, so none from outside can pre-empt (be taken as a duplicate of) an id the
/// bridge will make.
pub const RESERVED_ID_PREFIXES: &[&str] =
    &["timer:", "agent:", "quarantine:", "reconcile:", "backfill:"];

/// The kinds of ids the bridge makes for itself; each takes its prefix from
/// [`RESERVED_ID_PREFIXES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Internal {
    Timer = 0,
    Agent = 1,
    Quarantine = 2,
    Reconcile = 3,
    Backfill = 4,
}

impl Internal {
    pub fn prefix(self) -> &'static str {
        RESERVED_ID_PREFIXES[self as usize]
    }

    /// `<prefix><rest>`, for example `timer:<conversation>:<name>:<due>`.
    pub fn id(self, rest: impl fmt::Display) -> String {
        format!("{}{rest}", self.prefix())
    }
}

/// The reserved prefix `id` starts with, if any.
pub fn reserved_prefix(id: &str) -> Option<&'static str> {
    RESERVED_ID_PREFIXES
        .iter()
        .copied()
        .find(|prefix| id.starts_with(prefix))
}

/// The ordering domain of an event: events with the same key are processed one at a time, in
/// arrival order. Conversation and message events are keyed by conversation, end-user events by
/// end user, bot and unknown events by bot.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PartitionKey {
    Conversation(ConversationId),
    EndUser(EndUserId),
    Bot(BotId),
}

impl PartitionKey {
    /// Stable text form, persisted in event log frames and as `folded/v1` keys (`c:`, `u:`, `b:`
    /// prefixes).
    pub fn encode(&self) -> String {
        match self {
            PartitionKey::Conversation(id) => format!("c:{id}"),
            PartitionKey::EndUser(id) => format!("u:{id}"),
            PartitionKey::Bot(id) => format!("b:{id}"),
        }
    }

    pub fn decode(text: &str) -> Option<Self> {
        let (prefix, rest) = text.split_once(':')?;
        match prefix {
            "c" => Some(PartitionKey::Conversation(ConversationId::new(rest))),
            "u" => Some(PartitionKey::EndUser(EndUserId::new(rest))),
            "b" => Some(PartitionKey::Bot(BotId::new(rest))),
            _ => None,
        }
    }
}

impl fmt::Display for PartitionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.encode())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_ids_take_their_prefix_from_the_reserved_list() {
        for (kind, prefix) in [
            (Internal::Timer, "timer:"),
            (Internal::Agent, "agent:"),
            (Internal::Quarantine, "quarantine:"),
            (Internal::Reconcile, "reconcile:"),
            (Internal::Backfill, "backfill:"),
        ] {
            let id = kind.id("x:1");
            assert_eq!(id, format!("{prefix}x:1"));
            assert_eq!(reserved_prefix(&id), Some(prefix));
        }
        assert_eq!(reserved_prefix("timer-ish"), None);
        assert_eq!(reserved_prefix("e1"), None);
        assert_eq!(
            reserved_prefix("Timer:1"),
            None,
            "prefixes are case-sensitive"
        );
    }

    #[test]
    fn partition_key_round_trips_through_its_text_form() {
        for key in [
            PartitionKey::Conversation(ConversationId::new("5c0e:x")),
            PartitionKey::EndUser(EndUserId::new("4e6f")),
            PartitionKey::Bot(BotId::new("B7f3a2c")),
        ] {
            assert_eq!(PartitionKey::decode(&key.encode()), Some(key));
        }
        assert_eq!(PartitionKey::decode("x:1"), None);
        assert_eq!(PartitionKey::decode("nocolon"), None);
    }
}
