//! What the executor reads and writes in the store, behind a trait: the store in the daemon
//! (each call on the blocking pool), a map in memory in tests.

use model::action::{DeadLetter, DoneRecord, OutboxEntry, RetryState};
use std::collections::HashSet;
use storage::lease::Start;
use storage::{Store, StoreError};

/// Dead letters read per page on start.
const LETTERS_PAGE: usize = 1_000;

/// The dead letters as the executor needs them on start.
#[derive(Default)]
pub struct Letters {
    pub count: usize,
    /// Queues halted by a blocking dead letter.
    pub blocked: HashSet<String>,
}

pub trait Ledger: Send + Sync + 'static {
    /// Pending entries (counted on start, without reading them).
    fn pending(&self) -> Result<usize, StoreError>;
    /// The highest pending seq (on start: every entry up to it is durable).
    fn last_seq(&self) -> Result<Option<u64>, StoreError>;
    fn blocking_queues(&self) -> Result<Letters, StoreError>;
    /// At most `limit` pending entries after `after`, in seq order, each with its retry state.
    fn page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<(OutboxEntry, Option<RetryState>)>, StoreError>;
    fn set_retry_state(&self, seq: u64, state: &RetryState) -> Result<(), StoreError>;
    /// The entries were carried out (each as its `done` record): they leave the outbox, their
    /// retry states with them, all in one call (in the store: the records first, the removals
    /// last, see `Store::outbox_done_many`).
    fn done(&self, records: &[DoneRecord]) -> Result<(), StoreError>;
    /// The entry failed for good (it moves to the dead letters, its retry state removed).
    fn dead(&self, letter: &DeadLetter) -> Result<(), StoreError>;
    /// Calls go to the blocking pool (sled), not the async workers.
    fn on_blocking_pool(&self) -> bool {
        true
    }
    /// Whether other nodes share it (then an attempt is marked before its call, see
    /// [`started`](Ledger::started)).
    fn shared(&self) -> bool {
        false
    }
    /// Mark the entries as begun by this node's epoch, before their calls: for each, whether a
    /// node that is gone began it (a replay).
    fn started(&self, seqs: &[u64]) -> Result<Vec<Start>, StoreError> {
        Ok(vec![Start::First; seqs.len()])
    }
}

impl Ledger for Store {
    fn pending(&self) -> Result<usize, StoreError> {
        self.outbox_len()
    }

    fn last_seq(&self) -> Result<Option<u64>, StoreError> {
        self.outbox_last_seq()
    }

    /// Read a page at a time: an outage longer than `outbox.give_up_after` may leave many
    /// dead letters, which are not all held in memory on start.
    fn blocking_queues(&self) -> Result<Letters, StoreError> {
        let mut letters = Letters::default();
        let mut after = None;
        loop {
            let page = self.dead_letters_page(after, LETTERS_PAGE)?;
            let Some(last) = page.last() else { break };
            after = Some(last.entry.seq);
            let full = page.len() == LETTERS_PAGE;
            letters.count += page.len();
            letters.blocked.extend(
                page.into_iter()
                    .filter(|l| l.blocking)
                    .map(|l| l.entry.queue),
            );
            if !full {
                break;
            }
        }
        Ok(letters)
    }

    fn page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<(OutboxEntry, Option<RetryState>)>, StoreError> {
        self.outbox_page(after, limit)?
            .into_iter()
            .map(|e| {
                let state = self.outbox_retry_state(e.seq)?;
                Ok((e, state))
            })
            .collect()
    }

    fn set_retry_state(&self, seq: u64, state: &RetryState) -> Result<(), StoreError> {
        self.set_outbox_retry_state(seq, state)
    }

    fn done(&self, records: &[DoneRecord]) -> Result<(), StoreError> {
        self.outbox_done_many(records)
    }

    fn dead(&self, letter: &DeadLetter) -> Result<(), StoreError> {
        self.outbox_dead(letter)
    }

    fn shared(&self) -> bool {
        storage::lease::Lease::shared(&**self)
    }

    fn started(&self, seqs: &[u64]) -> Result<Vec<Start>, StoreError> {
        self.outbox_started(seqs)
    }
}
