//! The console's audit list: who did what from the console, when, as which role, and how it
//! ended. Kept in memory, newest first, at most [`KEPT`] entries (a restart empties it), and
//! each entry is also logged (`console action` at info), so the log keeps the whole history.

use serde::Serialize;
use std::collections::VecDeque;
use std::sync::Mutex;

/// Entries kept.
pub const KEPT: usize = 1_000;

/// One action taken from the console.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Entry {
    /// The daemon's time (ms).
    pub at: i64,
    /// The name the person signed in with.
    pub who: String,
    pub role: &'static str,
    /// What, e.g. `accept c-1`, `retry dead letter 7`.
    pub what: String,
    /// How it ended: `applied`, `rejected: ...`, `refused: ...`, `failed: ...`.
    pub result: String,
}

#[derive(Default)]
pub struct AuditLog(Mutex<VecDeque<Entry>>);

impl AuditLog {
    /// Record an entry (and log it).
    pub fn record(&self, entry: Entry) {
        tracing::info!(who = %entry.who, role = entry.role, what = %entry.what, result = %entry.result, "console action");
        let mut list = match self.0.lock() {
            Ok(list) => list,
            Err(poisoned) => poisoned.into_inner(),
        };
        list.push_front(entry);
        list.truncate(KEPT);
    }

    /// The entries, newest first.
    pub fn entries(&self) -> Vec<Entry> {
        match self.0.lock() {
            Ok(list) => list.iter().cloned().collect(),
            Err(poisoned) => poisoned.into_inner().iter().cloned().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_is_newest_first_and_bounded() {
        let log = AuditLog::default();
        for i in 0..(KEPT as i64 + 5) {
            log.record(Entry {
                at: i,
                who: "Kim".into(),
                role: "operator",
                what: format!("accept c-{i}"),
                result: "applied".into(),
            });
        }
        let entries = log.entries();
        assert_eq!(entries.len(), KEPT);
        assert_eq!(entries[0].at, KEPT as i64 + 4);
        assert_eq!(entries[KEPT - 1].at, 5);
    }
}
