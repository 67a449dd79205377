//! The record of every Open API call the emulator saw, so a test can assert what a client sent,
//! in what order and how often, without a proxy. Headers are not recorded (they carry the key).

use model::webhook::model::Millis;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::VecDeque;

pub const DEFAULT_CAPACITY: usize = 100_000;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JournalEntry {
    /// Increases by one per call since the emulator started (not reset by clearing).
    pub seq: u64,
    /// Unix ms on the emulator's clock (virtual under `tokio::time::pause`) when the call was
    /// handled, after any injected latency; the same time the state stamps its changes with.
    pub at: Millis,
    /// The same moment in Unix µs (same clock), for latencies finer than a millisecond
    /// (`benches/actions.rs`).
    #[serde(default)]
    pub at_us: i64,
    pub method: String,
    /// As routed, without the query.
    pub path: String,
    /// The raw query string (empty when there is none).
    pub query: String,
    /// The endpoint's stable name, when the path and method matched one.
    pub endpoint: Option<String>,
    /// The request body when it was JSON, else null.
    pub body: Value,
    pub idempotency_key: Option<String>,
    /// 0 when the call was never answered (hang) or its connection was cut (drop).
    pub status: u16,
    pub answer: Value,
    /// The answer is a stored one (repeated idempotency key).
    pub replayed: bool,
    /// The injected fault, if any: `hang`, `drop`, `rate_limit`, `fail`, `error_rate`.
    pub fault: Option<String>,
}

/// Bounded: past the capacity the oldest entries go.
#[derive(Debug)]
pub struct Journal {
    entries: VecDeque<JournalEntry>,
    capacity: usize,
    next_seq: u64,
}

impl Journal {
    pub fn new(capacity: usize) -> Self {
        Journal {
            entries: VecDeque::new(),
            capacity: capacity.max(1),
            next_seq: 1,
        }
    }

    /// Appends, filling in `seq`.
    pub fn push(&mut self, mut entry: JournalEntry) {
        entry.seq = self.next_seq;
        self.next_seq += 1;
        if self.entries.len() >= self.capacity {
            self.entries.pop_front();
        }
        self.entries.push_back(entry);
    }

    pub fn entries(&self) -> Vec<JournalEntry> {
        self.entries.iter().cloned().collect()
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> JournalEntry {
        JournalEntry {
            seq: 0,
            at: 1,
            at_us: 1_000,
            method: "GET".into(),
            path: "/openapi/bot".into(),
            query: String::new(),
            endpoint: Some("list-bots".into()),
            body: Value::Null,
            idempotency_key: None,
            status: 200,
            answer: Value::Null,
            replayed: false,
            fault: None,
        }
    }

    #[test]
    fn the_oldest_entries_go_past_the_capacity_and_seq_keeps_counting() {
        let mut j = Journal::new(2);
        for _ in 0..3 {
            j.push(entry());
        }
        let seqs: Vec<u64> = j.entries().iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![2, 3]);
        j.clear();
        assert!(j.entries().is_empty());
        j.push(entry());
        assert_eq!(j.entries()[0].seq, 4);
    }
}
