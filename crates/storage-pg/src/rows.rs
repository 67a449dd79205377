//! Values to and from columns: JSON documents as text, numbers as `bigint`, cursors as event
//! numbers.

use crate::PgError;
use model::cursor::Cursor;
use serde::de::DeserializeOwned;
use serde::Serialize;

pub(crate) fn json<T: Serialize>(value: &T) -> Result<String, PgError> {
    serde_json::to_string(value).map_err(|e| PgError::Corrupt {
        what: "a value to store",
        detail: e.to_string(),
    })
}

pub(crate) fn parse<T: DeserializeOwned>(text: &str, what: &'static str) -> Result<T, PgError> {
    serde_json::from_str(text).map_err(|e| PgError::Corrupt {
        what,
        detail: e.to_string(),
    })
}

/// A number as a `bigint` column holds it (numbers here stay far below 2^63).
pub(crate) fn big(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// A `bigint` column's number (never negative here).
pub(crate) fn num(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// An event's place in the log: its number.
pub(crate) fn cursor(seq: u64) -> Cursor {
    Cursor::from_raw(u128::from(seq))
}

/// A cursor this store made, back as an event number.
pub(crate) fn seq_of(at: Cursor) -> u64 {
    u64::try_from(at.raw()).unwrap_or(u64::MAX)
}

/// The event an action id (`event/rule/index`) was decided for.
pub(crate) fn event_of_action(action_id: &str) -> &str {
    action_id.rsplitn(3, '/').nth(2).unwrap_or(action_id)
}
