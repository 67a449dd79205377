//! Rule timers in sled: the `timers/v1` tree, which indexes every conversation's running timers by
//! due time, so the firer (`crate::timers`) finds the next one without reading states.
//!
//! The fold is the only writer: it compares each conversation's timers before and after the batch
//! and writes the difference in its own journal, so the tree equals the states (for a reader
//! outside the fold lock, up to a fold being applied). The
//! firer only reads it, and remembers in memory what it fired; the fold of a firing removes the
//! key. (Removing it after the firing was accepted, outside a fold, would race with a fold that
//! restarts the timer; this way nothing does.)

use super::{decode, encode, keys, SledStore, StoreError};
use crate::port::Timers;
use engine::batch::TimerStart;
use engine::index::TimerRef;
use model::ids::ConversationId;
use model::webhook::model::{Millis, TimerFiring};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

/// A timer key's value: what firing it needs besides its key.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Entry {
    pub(crate) started_by: String,
    /// The conversation's bot (the firing event's `sourceId`).
    pub(crate) bot_id: String,
}

/// A running timer as the port names it, opaque above the store: the firer keeps the keys of the
/// timers it fired until their firings are folded, and compares them, nothing more.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TimerKey(TimerRef);

impl TimerKey {
    /// For backends: the timer a key names.
    pub fn of(timer: TimerRef) -> TimerKey {
        TimerKey(timer)
    }

    /// For backends: the timer this key names.
    pub fn timer(&self) -> &TimerRef {
        &self.0
    }
}

/// A timer that is due, as the firer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DueTimer {
    /// The timer, which runs until its firing is folded.
    pub key: TimerKey,
    pub firing: TimerFiring,
    pub bot_id: String,
}

/// A running timer's key in the tree: due time, conversation, name.
pub(crate) fn key(timer: &TimerRef) -> Vec<u8> {
    keys::timer(timer.due_at, &timer.conversation, &timer.name)
}

/// A started timer's value in the tree.
pub(crate) fn value(start: &TimerStart) -> Result<Vec<u8>, StoreError> {
    encode(&Entry {
        started_by: start.started_by.clone(),
        bot_id: start.bot_id.clone(),
    })
}

impl Timers for SledStore {
    /// Due timers (at or before `now`), earliest first, at most `limit`, leaving out those `skip`
    /// names (already fired, their firing not folded yet); and when the next one is due (`now`
    /// when the limit cut the list short). Unreadable entries are logged and left out.
    fn due_timers(
        &self,
        now: Millis,
        limit: usize,
        skip: &dyn Fn(&TimerKey) -> bool,
    ) -> Result<(Vec<DueTimer>, Option<Millis>), StoreError> {
        let mut due = Vec::new();
        for item in self.timers.iter() {
            let (key, value) = item?;
            let Some((due_at, conversation, name)) = keys::parse_timer(&key) else {
                tracing::error!(key = ?key, "unreadable timer key; left alone");
                continue;
            };
            let timer = TimerKey(TimerRef {
                due_at,
                conversation: conversation.to_owned(),
                name: name.to_owned(),
            });
            if skip(&timer) {
                continue;
            }
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
                key: timer,
            });
        }
        Ok((due, None))
    }

    /// Whether a timer still runs (its firing not folded yet).
    fn has_timer(&self, timer: &TimerKey) -> Result<bool, StoreError> {
        Ok(self.timers.contains_key(key(timer.timer()))?)
    }

    /// Running timers. Linear in their number: call on start, then track the folds' changes.
    fn timers_pending(&self) -> Result<u64, StoreError> {
        Ok(self.timers.len() as u64)
    }

    /// How the firer is woken before the time it sleeps towards: by a fold that started or
    /// restarted a timer due before it, or by the test clock.
    fn timer_wakeup(&self) -> Arc<TimerWakeup> {
        self.timer_wakeup.clone()
    }
}

/// Wakes the firer when it must look at the timers before it would: a fold wakes it only for a
/// timer due before the firer's next look, so the many timers due later (each handoff's, say)
/// cost the firer nothing.
#[derive(Debug)]
pub struct TimerWakeup {
    notify: tokio::sync::Notify,
    /// When the firer looks next (ms, daemon time); `Millis::MAX` from the moment it starts
    /// looking until it knows, so a timer a fold starts meanwhile wakes it (the permit is kept
    /// for its sleep).
    next_look: AtomicI64,
}

impl Default for TimerWakeup {
    fn default() -> Self {
        TimerWakeup {
            notify: tokio::sync::Notify::new(),
            next_look: AtomicI64::new(Millis::MAX),
        }
    }
}

impl TimerWakeup {
    /// The firer starts reading the timers.
    pub fn looking(&self) {
        self.next_look.store(Millis::MAX, Ordering::SeqCst);
        // Before the tree is read (a fold writes the tree, then reads this: see `started`).
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// The firer read them and sleeps until `at` (ms, daemon time) unless woken.
    pub fn sleeping_until(&self, at: Millis) {
        self.next_look.store(at, Ordering::SeqCst);
    }

    /// Wait for a wake-up (kept if it came since the last wait).
    pub async fn notified(&self) {
        self.notify.notified().await
    }

    /// Wake the firer whatever it sleeps towards (the test clock moved).
    pub fn wake(&self) {
        self.notify.notify_one();
    }

    /// A fold wrote a timer due at `due_at` (after writing it; for backends).
    pub fn started(&self, due_at: Millis) {
        // After the tree was written: either the firer's read sees the timer, or this sees the
        // firer looking (`looking`).
        std::sync::atomic::fence(Ordering::SeqCst);
        if due_at < self.next_look.load(Ordering::SeqCst) {
            self.notify.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::TimerWakeup;
    use futures_util::FutureExt;
    use model::webhook::model::Millis;

    /// Whether a wake-up is waiting for the firer.
    fn woken(w: &TimerWakeup) -> bool {
        w.notified().now_or_never().is_some()
    }

    #[test]
    fn a_fold_wakes_the_firer_only_for_a_timer_due_before_its_next_look() {
        let w = TimerWakeup::default();
        w.started(5_000);
        assert!(woken(&w), "a firer that has not looked yet is woken");

        w.sleeping_until(1_000);
        w.started(2_000);
        w.started(1_000);
        assert!(
            !woken(&w),
            "due at or after its next look: it finds them then"
        );
        w.started(999);
        assert!(woken(&w), "due before it: woken");

        // A timer started while the firer reads the tree wakes it, whenever it is due: the read
        // may have missed it.
        w.looking();
        w.started(Millis::MAX - 1);
        w.sleeping_until(1_000);
        assert!(woken(&w), "the wake-up is kept for the sleep");

        w.sleeping_until(1_000);
        w.wake();
        assert!(
            woken(&w),
            "the test clock wakes it whatever it sleeps towards"
        );
    }
}
