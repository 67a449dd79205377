//! The writer: one thread that owns the intake write path.
//!
//! Handlers hand it parsed deliveries and wait. It takes every delivery queued at that moment and
//! stores the whole group in one sled transaction. A second thread, the syncer, appends the
//! group's new events to the intake log (`wal`), syncs it (once for all groups that are ready),
//! then answers them and passes the new events on, while the writer already runs the next
//! transaction. So a group costs one transaction and at most one `fdatasync`, HTTP workers never
//! wait on sled's global lock, and only one flush is ever in flight (sled 0.34's `flush_async`
//! hangs when several are).
//!
//! Sled itself is flushed when the log grows past a size or an age, and on every explicit
//! [`Writer::flush`]; the log is emptied after each such flush, because it then holds nothing sled
//! does not.

use super::wal::{Frames, Wal};
use super::{AcceptRequest, Accepted, QuarantineRecord, Store, StoreError};
use crate::ids::{DeliveryId, PartitionKey};
use crate::webhook::model::{Event, Millis};
use crate::webhook::IncomingEvent;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// At most this many deliveries share a transaction (bounds its size and the lock hold time).
const MAX_GROUP: usize = 512;
/// Flush sled and empty the log once it is this large...
const ROTATE_BYTES: u64 = 32 * 1024 * 1024;
/// ...or this old.
const ROTATE_AGE: Duration = Duration::from_secs(2);

/// A delivery for the writer to store.
pub struct AcceptJob {
    pub delivery: DeliveryId,
    pub events: Vec<IncomingEvent>,
    pub invalid: Vec<QuarantineRecord>,
    pub received_at: Millis,
}

impl AcceptJob {
    pub fn request(&self) -> AcceptRequest<'_> {
        AcceptRequest {
            delivery: &self.delivery,
            events: &self.events,
            invalid: &self.invalid,
            received_at: self.received_at,
        }
    }
}

/// A newly durable event, for the dispatcher.
#[derive(Debug)]
pub struct NewEvent {
    pub seq: u64,
    pub partition: PartitionKey,
    pub received_at: Millis,
    pub event: Event,
}

/// What the writer reports after each group, without tying this module to metrics or dispatch.
pub struct WriterHooks {
    /// (time the group took to become durable, deliveries in it).
    pub observe: Box<dyn Fn(Duration, usize) + Send>,
    /// Newly durable events, in acceptance order.
    pub durable: Box<dyn Fn(Vec<NewEvent>) + Send>,
}

enum Job {
    Accept(AcceptJob, oneshot::Sender<Result<Accepted, String>>),
    /// Flush sled: makes durable whatever was written to the store directly before it.
    Flush(oneshot::Sender<Result<(), String>>),
}

/// Handle to the writer thread. Cloning is cheap; the thread ends when every handle is gone.
#[derive(Clone)]
pub struct Writer {
    tx: mpsc::UnboundedSender<Job>,
    healthy: Arc<AtomicBool>,
}

impl Writer {
    /// Start the writer thread. The store has already replayed any leftover log on open.
    pub fn start(store: Store, hooks: WriterHooks) -> Result<Writer, StoreError> {
        let wal = Wal::open(store.wal_path()).map_err(|e| StoreError::Sled(sled::Error::Io(e)))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let healthy = Arc::new(AtomicBool::new(true));
        let flag = healthy.clone();
        std::thread::Builder::new()
            .name("store-writer".into())
            .spawn(move || run(store, wal, rx, hooks, flag))
            .map_err(|e| StoreError::Sled(sled::Error::Io(e)))?;
        Ok(Writer { tx, healthy })
    }

    /// Store a delivery; returns once it is durable.
    pub async fn accept(&self, job: AcceptJob) -> Result<Accepted, String> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Job::Accept(job, tx))
            .map_err(|_| WRITER_STOPPED.to_owned())?;
        rx.await.map_err(|_| WRITER_STOPPED.to_owned())?
    }

    /// Wait until everything written to the store before this call is on disk.
    pub async fn flush(&self) -> Result<(), String> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Job::Flush(tx))
            .map_err(|_| WRITER_STOPPED.to_owned())?;
        rx.await.map_err(|_| WRITER_STOPPED.to_owned())?
    }

    /// False after a write or sync failed, until one succeeds again.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
}

/// The error of a writer call made after the writer stopped (shutdown): retrying cannot help.
pub const WRITER_STOPPED: &str = "writer stopped";

/// A stored group on its way to the syncer.
struct Stored {
    /// The group's records, framed for the intake log.
    log: Frames,
    replies: Vec<(oneshot::Sender<Result<Accepted, String>>, Accepted)>,
    new_events: Vec<NewEvent>,
    /// The replies are durable only after a sled flush: the group wrote quarantine records,
    /// which the intake log does not hold.
    replies_need_sled: bool,
    /// Waiters for a sled flush (folds' decisions, admin writes).
    flushes: Vec<oneshot::Sender<Result<(), String>>>,
    started: Instant,
}

/// The transaction side: group, store, pass on. The sync of one group overlaps the transaction of
/// the next.
fn run(
    store: Store,
    wal: Wal,
    mut rx: mpsc::UnboundedReceiver<Job>,
    hooks: WriterHooks,
    healthy: Arc<AtomicBool>,
) {
    let (to_syncer, from_writer) = std::sync::mpsc::channel::<Stored>();
    let syncer_store = store.clone();
    let syncer_healthy = healthy.clone();
    let syncer = std::thread::Builder::new()
        .name("store-syncer".into())
        .spawn(move || sync_loop(syncer_store, wal, from_writer, hooks, syncer_healthy));
    let syncer = match syncer {
        Ok(handle) => handle,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the store syncer");
            healthy.store(false, Ordering::Relaxed);
            return;
        }
    };
    while let Some(first) = rx.blocking_recv() {
        let mut accepts = Vec::new();
        let mut flushes = Vec::new();
        let mut take = |job| match job {
            Job::Accept(job, reply) => accepts.push((job, reply)),
            Job::Flush(reply) => flushes.push(reply),
        };
        take(first);
        for _ in 1..MAX_GROUP {
            match rx.try_recv() {
                Ok(job) => take(job),
                Err(_) => break,
            }
        }
        let started = Instant::now();
        let results = match store_group(&store, &accepts) {
            Ok(results) => results,
            Err(e) => {
                tracing::error!(error = %e, deliveries = accepts.len(), "cannot store deliveries");
                healthy.store(false, Ordering::Relaxed);
                for (_, reply) in accepts {
                    let _ = reply.send(Err(e.to_string()));
                }
                // Flushes still go through the syncer, after what it already has.
                let _ = to_syncer.send(Stored {
                    log: Frames::default(),
                    replies: Vec::new(),
                    new_events: Vec::new(),
                    replies_need_sled: false,
                    flushes,
                    started,
                });
                continue;
            }
        };
        let mut log = Frames::default();
        let mut replies_need_sled = false;
        let mut new_events = Vec::new();
        let mut replies = Vec::with_capacity(accepts.len());
        for ((job, reply), accepted) in accepts.into_iter().zip(results) {
            // Quarantined events are not in the intake log; a sled flush covers them.
            replies_need_sled |= !accepted.quarantined.is_empty();
            let AcceptJob {
                delivery,
                events,
                received_at,
                ..
            } = job;
            let new = accepted.pick_new(events);
            if !new.is_empty() {
                let raws: Vec<&str> = new.iter().map(|e| e.raw.as_str()).collect();
                log.push(delivery.as_str(), received_at, &raws);
            }
            new_events.extend(accepted.new.iter().zip(new).map(|((seq, partition), ev)| {
                NewEvent {
                    seq: *seq,
                    partition: partition.clone(),
                    received_at,
                    event: ev.event,
                }
            }));
            replies.push((reply, accepted));
        }
        let stored = Stored {
            log,
            replies,
            new_events,
            replies_need_sled,
            flushes,
            started,
        };
        if to_syncer.send(stored).is_err() {
            tracing::error!("the store syncer stopped");
            healthy.store(false, Ordering::Relaxed);
            break;
        }
    }
    drop(to_syncer);
    // The syncer finishes what it has, flushes sled and empties the log.
    let _ = syncer.join();
}

/// The durability side: append the groups that are ready to the intake log, sync once, answer;
/// then flush sled for those who asked (after the answers, so an acknowledgment never waits for a
/// sled flush it does not need).
fn sync_loop(
    store: Store,
    mut wal: Wal,
    rx: std::sync::mpsc::Receiver<Stored>,
    hooks: WriterHooks,
    healthy: Arc<AtomicBool>,
) {
    let mut last_rotation = Instant::now();
    let flush = |wal: &mut Wal, last_rotation: &mut Instant| {
        *last_rotation = Instant::now();
        let result = flush_and_reset(&store, wal);
        healthy.store(result.is_ok(), Ordering::Relaxed);
        result
    };
    while let Ok(first) = rx.recv() {
        let mut groups = vec![first];
        while let Ok(more) = rx.try_recv() {
            groups.push(more);
        }
        let replies_need_sled = groups.iter().any(|g| g.replies_need_sled);
        let flush_wanted = groups.iter().any(|g| !g.flushes.is_empty());
        for group in &mut groups {
            wal.queue(std::mem::take(&mut group.log));
        }
        // A sled flush made in this round, if any (it covers every group and empties the log).
        let mut flushed = None;
        let replies_durable = if replies_need_sled {
            wal.discard_pending();
            let result = flush(&mut wal, &mut last_rotation);
            flushed = Some(result.clone());
            result
        } else {
            match wal.commit() {
                Ok(()) => {
                    healthy.store(true, Ordering::Relaxed);
                    Ok(())
                }
                Err(e) => {
                    tracing::error!(error = %e, "intake log sync failed; flushing the store instead");
                    let result = flush(&mut wal, &mut last_rotation);
                    flushed = Some(result.clone());
                    result
                }
            }
        };
        for group in &mut groups {
            let deliveries = group.replies.len();
            (hooks.observe)(group.started.elapsed(), deliveries);
            let replies = std::mem::take(&mut group.replies);
            match &replies_durable {
                Ok(()) => {
                    for (reply, accepted) in replies {
                        // The handler may have gone (client disconnected); the delivery is stored.
                        let _ = reply.send(Ok(accepted));
                    }
                    let new_events = std::mem::take(&mut group.new_events);
                    if !new_events.is_empty() {
                        (hooks.durable)(new_events);
                    }
                }
                Err(e) => {
                    for (reply, _) in replies {
                        let _ = reply.send(Err(e.clone()));
                    }
                }
            }
        }
        let rotate =
            !wal.is_empty() && (wal.len() >= ROTATE_BYTES || last_rotation.elapsed() >= ROTATE_AGE);
        let flushed = match flushed {
            Some(result) => result,
            None if flush_wanted || rotate => flush(&mut wal, &mut last_rotation),
            None => Ok(()),
        };
        for group in groups {
            for reply in group.flushes {
                let _ = reply.send(flushed.clone());
            }
        }
    }
    // The writer is gone: leave sled complete and the log empty for the next start.
    if let Err(e) = flush_and_reset(&store, &mut wal) {
        tracing::error!(error = %e, "final store flush failed; the intake log will be replayed");
    }
}

fn store_group(
    store: &Store,
    accepts: &[(AcceptJob, oneshot::Sender<Result<Accepted, String>>)],
) -> Result<Vec<Accepted>, StoreError> {
    if accepts.is_empty() {
        return Ok(Vec::new());
    }
    let requests: Vec<AcceptRequest<'_>> = accepts.iter().map(|(job, _)| job.request()).collect();
    store.accept_many(&requests)
}

/// Flush sled; then the log holds nothing sled lacks and is emptied.
fn flush_and_reset(store: &Store, wal: &mut Wal) -> Result<(), String> {
    store.flush().map_err(|e| {
        tracing::error!(error = %e, "store flush failed");
        e.to_string()
    })?;
    if let Err(e) = wal.reset() {
        // Harmless for correctness (replay is idempotent), but the log keeps growing.
        tracing::warn!(error = %e, path = %wal.path().display(), "cannot empty the intake log");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::parse_delivery;
    use std::sync::Mutex;

    fn body(delivery: &str, event: &str, conversation: &str) -> Vec<u8> {
        format!(
            r#"{{"id":"{delivery}","webhookId":"w","webhookUrl":"u","messages":[{{"id":"{event}","event":"bot.message.received","sourceType":"bot","sourceId":"B1","timestamp":1,"data":{{"message":{{"id":"m-{event}","conversationId":"{conversation}","isUser":true,"meta":null,"data":{{"type":"text","text":"x"}}}}}}}}]}}"#
        )
        .into_bytes()
    }

    fn job(delivery: &str, event: &str) -> AcceptJob {
        let parsed = parse_delivery(&body(delivery, event, "c1")).expect("valid");
        AcceptJob {
            delivery: parsed.id,
            events: parsed.events,
            invalid: Vec::new(),
            received_at: 7,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_deliveries_are_stored_once_logged_and_handed_on_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("store"), 8 * 1024 * 1024).expect("open");
        let handed: Arc<Mutex<Vec<u64>>> = Arc::default();
        let seen = handed.clone();
        let writer = Writer::start(
            store.clone(),
            WriterHooks {
                observe: Box::new(|_, _| {}),
                durable: Box::new(move |events| {
                    seen.lock()
                        .expect("lock")
                        .extend(events.iter().map(|e| e.seq));
                }),
            },
        )
        .expect("start");
        let mut tasks = Vec::new();
        for i in 0..200 {
            let writer = writer.clone();
            // Every event id twice, under two delivery ids: one of each pair is a duplicate.
            tasks.push(tokio::spawn(async move {
                writer
                    .accept(job(&format!("d{i}"), &format!("e{}", i / 2)))
                    .await
            }));
        }
        let mut new = 0;
        let mut duplicates = 0;
        for t in tasks {
            let accepted = t.await.expect("join").expect("stored");
            new += accepted.new.len();
            duplicates += accepted.duplicate_events;
        }
        assert_eq!((new, duplicates), (100, 100));
        // Acknowledged means in the intake log (until a sled flush empties it) or flushed.
        let (logged, torn) = super::super::wal::read(store.wal_path()).expect("read log");
        assert!(!torn);
        let logged_events: usize = logged.iter().map(|r| r.events.len()).sum();
        assert!(
            logged_events == 100 || logged_events == 0,
            "{logged_events}"
        );
        let handed = handed.lock().expect("lock").clone();
        assert_eq!(handed.len(), 100, "every new event handed on once");
        let mut sorted = handed.clone();
        sorted.sort_unstable();
        assert_eq!(handed, sorted, "in acceptance order");
        assert_eq!(store.pending().expect("pending").len(), 100);

        writer.flush().await.expect("flush");
        assert_eq!(
            std::fs::metadata(store.wal_path()).expect("log").len(),
            0,
            "a flush empties the log"
        );
        assert!(writer.is_healthy());
    }
}
