//! Rule timers in sled: the `timers/v1` tree, which indexes every conversation's running timers by
//! due time, so the firer (`crate::timers`) finds the next one without reading states.
//!
//! The fold is the only writer: it compares each conversation's timers before and after the batch
//! and writes the difference in its own journal, so the tree equals the states (for a reader
//! outside the fold lock, up to a fold being applied). The
//! firer only reads it, and remembers in memory what it fired; the fold of a firing removes the
//! key. (Removing it after the firing was accepted, outside a fold, would race with a fold that
//! restarts the timer; this way nothing does.)

use super::{decode, encode, keys, Store, StoreError};
use crate::ids::ConversationId;
use crate::state::{ConversationState, Timer};
use crate::webhook::model::{Millis, TimerFiring};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};

/// A timer key's value: what firing it needs besides its key.
#[derive(Debug, Serialize, Deserialize)]
struct Entry {
    started_by: String,
    /// The conversation's bot (the firing event's `sourceId`).
    bot_id: String,
}

/// A timer that is due, as the firer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DueTimer {
    /// Its key in the tree, which stays until the firing is folded.
    pub key: Vec<u8>,
    pub firing: TimerFiring,
    pub bot_id: String,
}

/// What one fold writes to the timers tree.
#[derive(Debug, Default)]
pub(super) struct TimerWrites {
    pub remove: Vec<Vec<u8>>,
    pub insert: Vec<(Vec<u8>, Vec<u8>)>,
    /// Keys the tree gains minus keys it loses (for the pending-timers gauge).
    pub change: i64,
}

impl Store {
    /// The fold's timer writes: each conversation's timers as the batch found them (`before`)
    /// against its state now, plus the keys of the folded firings (`fired`), which go unless the
    /// timer runs again under the same key.
    pub(super) fn timer_writes(
        &self,
        before: &HashMap<String, BTreeMap<String, Timer>>,
        states: &HashMap<String, ConversationState>,
        fired: &[Vec<u8>],
    ) -> Result<TimerWrites, StoreError> {
        let mut out = TimerWrites::default();
        let mut kept = HashSet::new();
        let empty = BTreeMap::new();
        for (id, state) in states {
            let old = before.get(id).unwrap_or(&empty);
            for (name, timer) in &state.timers {
                let key = keys::timer(timer.due_at, id, name);
                kept.insert(key.clone());
                if old.get(name) == Some(timer) {
                    continue;
                }
                let entry = Entry {
                    started_by: timer.started_by.clone(),
                    bot_id: state
                        .bot_id
                        .as_ref()
                        .map(|b| b.to_string())
                        .unwrap_or_default(),
                };
                out.change += i64::from(!self.timers.contains_key(&key)?);
                out.insert.push((key, encode(&entry)?));
            }
            let gone = old
                .iter()
                .map(|(name, timer)| keys::timer(timer.due_at, id, name));
            out.remove.extend(gone.filter(|key| !kept.contains(key)));
        }
        out.remove
            .extend(fired.iter().filter(|key| !kept.contains(*key)).cloned());
        out.remove.sort();
        out.remove.dedup();
        for key in &out.remove {
            // Only folds write the tree, one at a time (the fold lock), so this read is exact.
            out.change -= i64::from(self.timers.contains_key(key)?);
        }
        Ok(out)
    }

    /// Due timers (at or before `now`), earliest first, at most `limit`, leaving out those `skip`
    /// names (already fired, their firing not folded yet); and when the next one is due (`now`
    /// when the limit cut the list short). Unreadable entries are logged and left out.
    pub fn due_timers(
        &self,
        now: Millis,
        limit: usize,
        skip: impl Fn(&[u8]) -> bool,
    ) -> Result<(Vec<DueTimer>, Option<Millis>), StoreError> {
        let mut due = Vec::new();
        for item in self.timers.iter() {
            let (key, value) = item?;
            if skip(&key) {
                continue;
            }
            let Some((due_at, conversation, name)) = keys::parse_timer(&key) else {
                tracing::error!(key = ?key, "unreadable timer key; left alone");
                continue;
            };
            if due_at > now {
                return Ok((due, Some(due_at)));
            }
            if due.len() >= limit {
                return Ok((due, Some(now)));
            }
            let entry = match decode::<Entry>(&value, "timer entry") {
                Ok(entry) => entry,
                Err(e) => {
                    tracing::error!(error = %e, conversation, name, "timer left alone");
                    continue;
                }
            };
            due.push(DueTimer {
                firing: TimerFiring {
                    conversation_id: ConversationId::new(conversation),
                    name: name.to_owned(),
                    due_at,
                    started_by: entry.started_by,
                },
                bot_id: entry.bot_id,
                key: key.to_vec(),
            });
        }
        Ok((due, None))
    }

    /// Whether a timer key is still there (its firing not folded yet).
    pub fn has_timer(&self, key: &[u8]) -> Result<bool, StoreError> {
        Ok(self.timers.contains_key(key)?)
    }

    /// Running timers. Linear in their number: call on start, then track the folds' changes.
    pub fn timers_pending(&self) -> u64 {
        self.timers.len() as u64
    }

    /// Notified after a fold started or restarted a timer, so the firer can wake before the due
    /// time it sleeps towards.
    pub fn timer_wakeup(&self) -> std::sync::Arc<tokio::sync::Notify> {
        self.timer_wakeup.clone()
    }
}
