//! The thread that commits folds.
//!
//! A fold computes on a `fold-N` thread, which may run under `SCHED_IDLE` (see `background`):
//! such a thread loses its CPU to any waking thread and gets it back only when a CPU is idle. Its
//! commit holds sled's global lock exclusively, and the indexer's checkpoint write, on the way
//! from an acknowledgment to the fold, waits for that lock. So the commit runs here, on a thread
//! started from one at the daemon's own priority: the lock is never held by a thread that waits
//! for idle time.

use super::StoreError;
use std::sync::mpsc::{sync_channel, Sender};
use std::sync::{Arc, OnceLock};

type Job = Box<dyn FnOnce() + Send>;

/// Where a store runs its fold commits: on the committer thread once
/// [`started`](Committer::start), inline before (tests, offline tools).
#[derive(Clone, Default)]
pub(super) struct Committer {
    jobs: Arc<OnceLock<Sender<Job>>>,
}

impl Committer {
    /// Start the thread, at the calling thread's priority (threads inherit it). The thread ends
    /// when every clone of the store is gone. Starting twice keeps the first.
    pub(super) fn start(&self) -> std::io::Result<()> {
        if self.jobs.get().is_some() {
            return Ok(());
        }
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("store-committer".into())
            .spawn(move || {
                for job in rx {
                    // A panicking commit fails its fold (its result channel drops), not the
                    // thread: later commits keep this thread's priority.
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                        tracing::error!("a fold's commit panicked; the fold is retried");
                    }
                }
            })?;
        // Lost a race with another start: its thread serves, this one ends with its channel.
        let _ = self.jobs.set(tx);
        Ok(())
    }

    /// Run `commit` on the committer thread and wait for it.
    pub(super) fn run(
        &self,
        commit: impl FnOnce() -> Result<(), StoreError> + Send + 'static,
    ) -> Result<(), StoreError> {
        let Some(jobs) = self.jobs.get() else {
            return commit();
        };
        let (done_tx, done_rx) = sync_channel(1);
        let job: Job = Box::new(move || {
            let _ = done_tx.send(commit());
        });
        if let Err(unsent) = jobs.send(job) {
            // The thread is gone (it cannot be, short of a panic in sled's own unwinding):
            // commit here rather than not at all.
            tracing::error!("the fold commit thread is gone; committing on the fold's thread");
            (unsent.0)();
        }
        done_rx.recv().unwrap_or_else(|_| {
            Err(StoreError::Internal(
                "the fold commit thread stopped during a commit".into(),
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn thread_name() -> Option<String> {
        std::thread::current().name().map(str::to_owned)
    }

    #[test]
    fn commits_run_inline_until_started_then_on_the_commit_thread() {
        let committer = Committer::default();
        let (tx, rx) = std::sync::mpsc::channel();
        let send = |tx: std::sync::mpsc::Sender<Option<String>>| {
            move || {
                tx.send(thread_name())
                    .map_err(|e| StoreError::Internal(e.to_string()))
            }
        };
        committer.run(send(tx.clone())).expect("inline");
        assert_eq!(rx.recv().expect("name"), thread_name());
        committer.start().expect("start");
        committer.run(send(tx)).expect("on the thread");
        assert_eq!(rx.recv().expect("name").as_deref(), Some("store-committer"));
    }

    #[test]
    fn a_commits_error_comes_back_and_the_thread_goes_on() {
        let committer = Committer::default();
        committer.start().expect("start");
        let err = committer.run(|| Err(StoreError::Internal("no".into())));
        assert!(matches!(err, Err(StoreError::Internal(m)) if m == "no"));
        assert!(committer.run(|| Ok(())).is_ok());
    }

    #[test]
    fn a_panicking_commit_is_an_error_and_later_commits_run_on_the_same_thread() {
        let committer = Committer::default();
        committer.start().expect("start");
        let err = committer.run(|| panic!("a commit panicked"));
        assert!(matches!(err, Err(StoreError::Internal(_))), "{err:?}");
        let (tx, rx) = std::sync::mpsc::channel();
        committer
            .run(move || {
                tx.send(thread_name())
                    .map_err(|e| StoreError::Internal(e.to_string()))
            })
            .expect("a commit after the panic");
        assert_eq!(rx.recv().expect("name").as_deref(), Some("store-committer"));
    }
}
