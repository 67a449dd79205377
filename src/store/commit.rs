//! Group commit: one flush in flight, shared by every writer waiting for durability.
//!
//! sled 0.34's `flush_async` can hang forever when several run at once, so a single task calls the
//! blocking `Db::flush` on the blocking pool. A writer registers *after* its write is in sled; the
//! flush that starts after the registration therefore covers the write. Writers arriving while a
//! flush runs wait for the next one, which covers all of them at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

type Waiter = oneshot::Sender<Result<(), String>>;

/// Handle to the flusher task. Cloning is cheap.
#[derive(Clone)]
pub struct GroupCommit {
    tx: mpsc::UnboundedSender<Waiter>,
    healthy: Arc<AtomicBool>,
}

/// Observes each flush (for the latency histogram) without tying this module to metrics.
pub type FlushObserver = Arc<dyn Fn(std::time::Duration, usize) + Send + Sync>;

impl GroupCommit {
    /// Start the flusher on the current tokio runtime. It stops when every handle is dropped.
    pub fn start(db: sled::Db, observe: FlushObserver) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<Waiter>();
        let healthy = Arc::new(AtomicBool::new(true));
        let flag = healthy.clone();
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut waiters = vec![first];
                while let Ok(w) = rx.try_recv() {
                    waiters.push(w);
                }
                let db = db.clone();
                let started = Instant::now();
                let result = match tokio::task::spawn_blocking(move || db.flush()).await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(e) => Err(format!("flush task failed: {e}")),
                };
                observe(started.elapsed(), waiters.len());
                if let Err(e) = &result {
                    tracing::error!(error = %e, "store flush failed");
                }
                flag.store(result.is_ok(), Ordering::Relaxed);
                for w in waiters {
                    // The writer may have gone away (client disconnected); nothing to do then.
                    let _ = w.send(result.clone());
                }
            }
        });
        GroupCommit { tx, healthy }
    }

    /// Wait until everything written before this call is on disk.
    pub async fn durable(&self) -> Result<(), String> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(tx).map_err(|_| "flusher stopped".to_owned())?;
        rx.await.map_err(|_| "flusher stopped".to_owned())?
    }

    /// False after a flush failed, until one succeeds again.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_writers_share_flushes_and_all_see_success() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("open");
        let flushes = Arc::new(AtomicUsize::new(0));
        let covered = Arc::new(AtomicUsize::new(0));
        let (f, c) = (flushes.clone(), covered.clone());
        let gc = GroupCommit::start(
            db.clone(),
            Arc::new(move |_, n| {
                f.fetch_add(1, Ordering::SeqCst);
                c.fetch_add(n, Ordering::SeqCst);
            }),
        );
        let mut tasks = Vec::new();
        for i in 0..200u32 {
            let (gc, db) = (gc.clone(), db.clone());
            tasks.push(tokio::spawn(async move {
                db.insert(i.to_be_bytes(), &b"v"[..]).expect("insert");
                gc.durable().await
            }));
        }
        for t in tasks {
            assert_eq!(t.await.expect("join"), Ok(()));
        }
        assert_eq!(covered.load(Ordering::SeqCst), 200);
        assert!(flushes.load(Ordering::SeqCst) <= 200);
        assert!(gc.is_healthy());
        drop(db);
    }
}
