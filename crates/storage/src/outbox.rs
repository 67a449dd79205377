//! The outbox, dead letters and the action ledger in sled.
//!
//! - `outbox`: seq -> [`OutboxEntry`], decided actions not yet carried out;
//! - `dead_letters`: seq -> [`DeadLetter`], entries that failed for good (same seq as in the outbox);
//! - `outbox_retry`: seq -> [`RetryState`], why a pending entry waits (its failed attempts);
//!   removed in the transaction that records the entry's outcome;
//! - `actions`: action id -> [`ActionStatus`], every action ever decided (pruned after the audit
//!   window), so a re-decided action is recognised and never queued twice.
//!
//! Entries enter the outbox only in a fold's or a replay's journal (the commit of the engine's
//! write set: `fold`; the port's `Folds::fold`, `Folds::replay`). An
//! entry leaves the outbox only after its outcome is recorded: a dead letter in one transaction
//! with the removal; a `done` record by plain writes, the record first and the removal last (see
//! [`SledStore::outbox_done_many`]), so a crash between leaves it pending *and* done, never neither,
//! and the next open finishes the move (`SledStore::settle_done_moves`) before anything reads the
//! outbox.

use super::{all_decoded, decode, encode, get_decoded, keys, page_decoded, SledStore, StoreError};
use crate::port::Outbox;
use model::action::{DeadLetter, DoneRecord, OutboxEntry, RetryState};
use model::webhook::model::Millis;
use serde::{Deserialize, Serialize};
use sled::Transactional;

/// Where an action stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionStatus {
    /// `pending`, `done`, `dead` or `dropped`.
    pub state: String,
    pub seq: u64,
    pub at: Millis,
    #[serde(default)]
    pub attempts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl ActionStatus {
    /// A decided entry's status (for backends).
    pub fn pending(seq: u64, at: Millis) -> Self {
        ActionStatus {
            state: "pending".into(),
            seq,
            at,
            attempts: 0,
            note: None,
        }
    }

    /// A carried-out entry's status, as its `done` record says (for backends).
    pub fn done(record: &DoneRecord) -> Self {
        ActionStatus {
            state: "done".into(),
            seq: record.entry.seq,
            at: record.at,
            attempts: record.attempts,
            note: None,
        }
    }
}

/// Newly decided entries into a journal (a fold's, a replay's): each outbox entry with its
/// `pending` ledger status.
pub(super) fn journal_pending(
    journal: &mut super::Journal,
    entries: &[OutboxEntry],
) -> Result<(), StoreError> {
    use super::journal::TreeId;
    for e in entries {
        journal.insert(TreeId::Outbox, keys::seq(e.seq), encode(e)?);
        let status = encode(&ActionStatus::pending(e.seq, e.decided_at))?;
        journal.insert(TreeId::Actions, e.id.as_bytes(), status);
    }
    Ok(())
}

impl SledStore {
    /// Every pending outbox entry, in decision order (used on start).
    pub fn outbox(&self) -> Result<Vec<OutboxEntry>, StoreError> {
        all_decoded(&self.outbox, "outbox entry")
    }

    pub fn action_status(&self, id: &str) -> Result<Option<ActionStatus>, StoreError> {
        get_decoded(&self.actions, id.as_bytes(), "action status")
    }

    /// Finish the moves a crash interrupted in [`outbox_done_many`](SledStore::outbox_done_many):
    /// a pending entry with a `done` record was carried out, and leaves the outbox (with its
    /// retry state). Run by [`open`](SledStore::open) before anything reads the outbox. Returns how
    /// many it removed.
    pub(super) fn settle_done_moves(&self) -> Result<usize, StoreError> {
        let mut settled = 0;
        for key in self.outbox.iter().keys() {
            let key = key?;
            if self.done.contains_key(&key)? {
                self.outbox_retry.remove(&key)?;
                self.outbox.remove(&key)?;
                settled += 1;
            }
        }
        if settled > 0 {
            tracing::info!(
                entries = settled,
                "outbox entries recorded done before a crash removed from the outbox"
            );
        }
        Ok(settled)
    }

    /// Finished entries (done or dropped) still in the audit window, newest first.
    pub fn finished(&self, limit: usize) -> Result<Vec<DoneRecord>, StoreError> {
        self.done
            .iter()
            .rev()
            .take(limit)
            .map(|item| decode(&item?.1, "finished entry"))
            .collect()
    }
}

impl Outbox for SledStore {
    /// At most `limit` pending entries after seq `after` (from the first when `None`), in
    /// decision order: a page of the outbox, which is never read whole while the daemon runs.
    fn outbox_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<OutboxEntry>, StoreError> {
        page_decoded(&self.outbox, after, limit, "outbox entry")
    }

    /// One pending entry.
    fn outbox_entry(&self, seq: u64) -> Result<Option<OutboxEntry>, StoreError> {
        get_decoded(&self.outbox, keys::seq(seq), "outbox entry")
    }

    fn outbox_len(&self) -> Result<usize, StoreError> {
        Ok(self.outbox.len())
    }

    /// The highest seq in the outbox (`None`: empty).
    fn outbox_last_seq(&self) -> Result<Option<u64>, StoreError> {
        Ok(self.outbox.last()?.and_then(|(k, _)| keys::parse_seq(&k)))
    }

    /// Why the pending entry `seq` waits (its failed attempts), if it failed before.
    fn outbox_retry_state(&self, seq: u64) -> Result<Option<RetryState>, StoreError> {
        get_decoded(&self.outbox_retry, keys::seq(seq), "outbox retry state")
    }

    /// Record why the pending entry `seq` waits, after a failed attempt. Not flushed: a crash
    /// may lose the last few, which costs an attempt count and a later give-up, never an entry.
    fn set_outbox_retry_state(&self, seq: u64, state: &RetryState) -> Result<(), StoreError> {
        self.outbox_retry
            .insert(keys::seq(seq), encode(state)?)
            .map(drop)
            .map_err(StoreError::from)
    }

    /// The entry was carried out: it leaves the outbox and the ledger says `done`.
    fn outbox_done(
        &self,
        entry: &OutboxEntry,
        attempts: u32,
        now: Millis,
    ) -> Result<(), StoreError> {
        self.outbox_done_many(&[DoneRecord {
            entry: entry.clone(),
            outcome: "done".into(),
            at: now,
            attempts,
            note: None,
        }])
    }

    /// Entries carried out (each as its `done` record): all leave the outbox, and the ledger
    /// says `done` for each.
    ///
    /// Plain writes, not a transaction: the `done` records and the ledger's statuses first, then
    /// the removals from the outbox and its retry states. sled recovers a prefix of its writes,
    /// so after a crash an entry is pending, or done and still pending (the next open removes
    /// it: `settle_done_moves`), or done; never gone without its record. A sled 0.34
    /// transaction writes its log twice (a buffer, then its batch manifest), each write a task on
    /// sled's I/O pool, whose seven threads all wake for every task: measured, a handoff's two
    /// `done` transactions were most of that pool's CPU (`docs/benchmarks.md`). Not flushed,
    /// as before: a crash may lose the last records, and their entries run again with the same
    /// idempotency keys.
    fn outbox_done_many(&self, records: &[DoneRecord]) -> Result<(), StoreError> {
        if records.is_empty() {
            return Ok(());
        }
        let rows = records
            .iter()
            .map(|r| {
                let status = ActionStatus::done(r);
                Ok((
                    keys::seq(r.entry.seq),
                    r.entry.id.as_bytes(),
                    encode(&status)?,
                    encode(r)?,
                ))
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        for (key, id, status, record) in &rows {
            self.done.insert(key, record.as_slice())?;
            self.actions.insert(*id, status.as_slice())?;
        }
        for (key, _, _, _) in &rows {
            self.outbox_retry.remove(key)?;
            self.outbox.remove(key)?;
        }
        Ok(())
    }

    /// The entry failed for good: it moves from the outbox to the dead letters.
    fn outbox_dead(&self, letter: &DeadLetter) -> Result<(), StoreError> {
        let status = ActionStatus {
            state: "dead".into(),
            seq: letter.entry.seq,
            at: letter.last_attempt_at,
            attempts: letter.attempts,
            note: Some(letter.reason.clone()),
        };
        let (status, bytes) = (encode(&status)?, encode(letter)?);
        let seq = keys::seq(letter.entry.seq);
        (
            &self.outbox,
            &self.dead_letters,
            &self.actions,
            &self.outbox_retry,
        )
            .transaction(|(outbox, dead, actions, retry)| {
                outbox.remove(&seq)?;
                retry.remove(&seq)?;
                dead.insert(&seq, bytes.as_slice())?;
                actions.insert(letter.entry.id.as_bytes(), status.as_slice())?;
                Ok(())
            })?;
        Ok(())
    }

    fn dead_letter(&self, seq: u64) -> Result<Option<DeadLetter>, StoreError> {
        get_decoded(&self.dead_letters, keys::seq(seq), "dead letter")
    }

    fn dead_letters(&self) -> Result<Vec<DeadLetter>, StoreError> {
        all_decoded(&self.dead_letters, "dead letter")
    }

    /// At most `limit` dead letters after seq `after` (from the first when `None`), in order.
    fn dead_letters_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        page_decoded(&self.dead_letters, after, limit, "dead letter")
    }

    /// Put a dead letter back in the outbox (same seq and id). It keeps its idempotency key,
    /// unless the upstream refused it for good (then a fresh one, see [`DeadLetter::answered`]).
    /// Read and moved in one transaction: of two concurrent retries (or a retry and a drop) only
    /// one finds the letter.
    fn retry_dead_letter(&self, seq: u64, now: Millis) -> Result<Option<OutboxEntry>, StoreError> {
        let key = keys::seq(seq);
        let entry = (&self.outbox, &self.dead_letters, &self.actions).transaction(
            |(outbox, dead, actions)| {
                let Some(bytes) = dead.remove(&key)? else {
                    return Ok(None);
                };
                let letter: DeadLetter = decode(&bytes, "dead letter").map_err(super::abort)?;
                let mut entry = letter.entry;
                if letter.answered {
                    // The upstream keeps its refusal under the old key: a retry under it would
                    // only get that answer back. Nothing took effect, so no effect can double.
                    entry.idempotency_key = Some(format!("{}~retry-{now}", entry.id));
                }
                let status =
                    encode(&ActionStatus::pending(entry.seq, now)).map_err(super::abort)?;
                outbox.insert(&key, encode(&entry).map_err(super::abort)?)?;
                actions.insert(entry.id.as_bytes(), status)?;
                Ok(Some(entry))
            },
        )?;
        Ok(entry)
    }

    /// Remove a dead letter for good; the ledger and the audit record keep why. One
    /// transaction, like [`SledStore::retry_dead_letter`].
    fn drop_dead_letter(
        &self,
        seq: u64,
        reason: &str,
        now: Millis,
    ) -> Result<Option<DeadLetter>, StoreError> {
        let key = keys::seq(seq);
        let letter = (&self.dead_letters, &self.actions, &self.done).transaction(
            |(dead, actions, done)| {
                let Some(bytes) = dead.remove(&key)? else {
                    return Ok(None);
                };
                let letter: DeadLetter = decode(&bytes, "dead letter").map_err(super::abort)?;
                let status = encode(&ActionStatus {
                    state: "dropped".into(),
                    seq,
                    at: now,
                    attempts: letter.attempts,
                    note: Some(reason.to_owned()),
                })
                .map_err(super::abort)?;
                let record = encode(&DoneRecord {
                    entry: letter.entry.clone(),
                    outcome: "dropped".into(),
                    at: now,
                    attempts: letter.attempts,
                    note: Some(reason.to_owned()),
                })
                .map_err(super::abort)?;
                actions.insert(letter.entry.id.as_bytes(), status)?;
                done.insert(&key, record)?;
                Ok(Some(letter))
            },
        )?;
        Ok(letter)
    }

    /// At most `limit` finished entries (done or dropped) with seqs below `before` (from the
    /// newest when `None`), newest first: the ledger's records are keyed by their entry's seq.
    fn finished_page(
        &self,
        before: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DoneRecord>, StoreError> {
        let iter = match before {
            Some(seq) => self.done.range(..keys::seq(seq)),
            None => self.done.iter(),
        };
        iter.rev()
            .take(limit)
            .map(|item| decode(&item?.1, "finished entry"))
            .collect()
    }

    /// The finished (done or dropped) entry `seq`, if its record is still in the audit window.
    fn finished_one(&self, seq: u64) -> Result<Option<DoneRecord>, StoreError> {
        get_decoded(&self.done, keys::seq(seq), "finished entry")
    }

    /// The seqs of the actions the ledger holds for event `event_id` (action ids are
    /// `{event id}/{rule}/{index}`): a prefix range of the ledger, not a scan. An event id that is
    /// a prefix of another's (`a` and `a/b`) brings the other's too: callers check the entry's
    /// event id.
    fn action_seqs_of_event(&self, event_id: &str) -> Result<Vec<u64>, StoreError> {
        self.actions
            .scan_prefix(format!("{event_id}/").as_bytes())
            .map(|item| {
                let (_, bytes) = item?;
                let status: ActionStatus = decode(&bytes, "action status")?;
                Ok(status.seq)
            })
            .collect()
    }
}
