//! Waiting for an agent command's verdict: the API answers from what the fold decided, not from a
//! guess made before the command was ordered with the conversation's other events.
//!
//! A waiter is registered under the command's event id before the command is handed to the
//! writer, and the dispatcher completes it after the fold's writes are in. The map is
//! bounded, and a waiter leaves it when dropped (answered, timed out or the request went away), so
//! nothing is left behind.

use engine::state::desk::Verdict;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

pub struct Waiters {
    inner: Mutex<HashMap<String, oneshot::Sender<Verdict>>>,
    /// Agent calls waiting for their fold at once (`helpdesk.max_pending_commands`); more are
    /// answered 503 (`too_many_pending`).
    limit: usize,
}

/// One registered wait; leaves the map when dropped.
pub struct Waiter {
    id: String,
    rx: Option<oneshot::Receiver<Verdict>>,
    waiters: Arc<Waiters>,
}

impl Waiters {
    pub fn new(limit: usize) -> Self {
        Waiters {
            inner: Mutex::default(),
            limit,
        }
    }

    /// Wait for `event_id`'s verdict; `None` when `limit` calls wait already, or the same id
    /// is waited for (a concurrent retry of the same command, which the idempotency layer keeps
    /// out, so this is a safety net).
    pub fn register(self: &Arc<Self>, event_id: &str) -> Option<Waiter> {
        let mut map = self.inner.lock().ok()?;
        if map.len() >= self.limit || map.contains_key(event_id) {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        map.insert(event_id.to_owned(), tx);
        Some(Waiter {
            id: event_id.to_owned(),
            rx: Some(rx),
            waiters: Arc::clone(self),
        })
    }

    /// The fold committed these verdicts: wake whoever waits for them.
    pub fn complete(&self, verdicts: &[Verdict]) {
        if verdicts.is_empty() {
            return;
        }
        let Ok(mut map) = self.inner.lock() else {
            return;
        };
        for verdict in verdicts {
            if let Some(tx) = map.remove(&verdict.event_id) {
                let _ = tx.send(verdict.clone());
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().map_or(0, |m| m.len())
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Waiter {
    /// The verdict, or `None` when `timeout` passed first.
    pub async fn wait(&mut self, timeout: std::time::Duration) -> Option<Verdict> {
        let rx = self.rx.as_mut()?;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(verdict)) => Some(verdict),
            _ => None,
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        if let Ok(mut map) = self.waiters.inner.lock() {
            map.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::state::desk::Outcome;
    use std::time::Duration;

    fn verdict(id: &str) -> Verdict {
        Verdict {
            event_id: id.into(),
            command: "accept".into(),
            at: 1,
            outcome: Outcome::Applied { changed: true },
        }
    }

    #[tokio::test]
    async fn a_waiter_gets_its_verdict_and_leaves_the_map() {
        let waiters = Arc::new(Waiters::new(8));
        let mut w = waiters.register("e1").expect("registered");
        assert!(waiters.register("e1").is_none(), "one waiter per id");
        waiters.complete(&[verdict("other"), verdict("e1")]);
        assert_eq!(w.wait(Duration::from_secs(5)).await, Some(verdict("e1")));
        drop(w);
        assert!(waiters.is_empty());
    }

    #[tokio::test]
    async fn a_timed_out_waiter_leaves_nothing_behind_and_the_map_is_bounded() {
        const LIMIT: usize = 16;
        let waiters = Arc::new(Waiters::new(LIMIT));
        let mut w = waiters.register("e1").expect("registered");
        assert_eq!(w.wait(Duration::from_millis(1)).await, None);
        drop(w);
        assert!(waiters.is_empty());
        let held: Vec<Waiter> = (0..LIMIT)
            .map(|i| waiters.register(&format!("e{i}")).expect("room"))
            .collect();
        assert!(waiters.register("one-more").is_none());
        drop(held);
        assert!(waiters.is_empty());
    }
}
