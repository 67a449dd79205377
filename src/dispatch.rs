//! The dispatcher: folds inbox events into state, in order within a partition (a conversation,
//! end user or bot) and in parallel across partitions, with bounded concurrency.
//!
//! The inbox in sled is the dispatcher's position: an event leaves it in the same transaction that
//! folds it. The in-memory queues are only a cache of the inbox, rebuilt from it on start, so a
//! crash or shutdown at any point loses nothing and repeats nothing.

use crate::ids::PartitionKey;
use crate::ops::metrics::Metrics;
use crate::store::{QuarantineRecord, Store};
use crate::webhook::model::{Event, Millis};
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

/// Pause before a partition whose batch failed is tried again (the store is likely in trouble).
const RETRY_PAUSE: Duration = Duration::from_millis(500);

/// Sends newly durable inbox entries to the dispatcher.
#[derive(Clone)]
pub struct DispatchHandle {
    tx: mpsc::UnboundedSender<Vec<(u64, PartitionKey)>>,
    /// Changes whenever the dispatcher's queue depth changes.
    progress: watch::Receiver<usize>,
}

impl DispatchHandle {
    /// Hand over entries that are already durable in the inbox. Never blocks; if the dispatcher
    /// has stopped the entries simply wait in the inbox for the next start.
    pub fn notify(&self, entries: Vec<(u64, PartitionKey)>) {
        if !entries.is_empty() {
            let _ = self.tx.send(entries);
        }
    }

    /// Wait until the durable inbox is empty (everything accepted so far is folded), or the
    /// timeout passes. Returns whether it drained. Woken by dispatcher progress, not polling.
    pub async fn wait_drained(
        &self,
        store: &Store,
        timeout: Duration,
    ) -> Result<bool, crate::store::StoreError> {
        let mut progress = self.progress.clone();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // Queue depth reaches 0 only after the batch's bookkeeping (metrics) is done.
            let idle = *progress.borrow_and_update() == 0;
            if idle && store.inbox_is_empty()? {
                return Ok(true);
            }
            match tokio::time::timeout_at(deadline, progress.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return store.inbox_is_empty(),
            }
        }
    }
}

pub struct DispatchSettings {
    pub concurrency: usize,
    pub batch_size: usize,
}

/// Start the dispatcher on the current runtime. It recovers the inbox, then runs until `stop`
/// turns true; it then finishes the batches in flight and returns.
pub fn start(
    store: Store,
    metrics: Metrics,
    settings: DispatchSettings,
    stop: watch::Receiver<bool>,
) -> Result<(DispatchHandle, tokio::task::JoinHandle<()>), crate::store::StoreError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let (progress_tx, progress) = watch::channel(0);
    let mut queues = Queues::default();
    for (seq, partition) in store.pending()? {
        queues.push(partition, seq);
    }
    metrics.inbox_depth.set(queues.depth as i64);
    if queues.depth > 0 {
        tracing::info!(pending = queues.depth, "resuming inbox");
    }
    let task = tokio::spawn(run(store, metrics, settings, queues, rx, stop, progress_tx));
    Ok((DispatchHandle { tx, progress }, task))
}

#[derive(Default)]
struct Queues {
    pending: HashMap<PartitionKey, BTreeSet<u64>>,
    ready: VecDeque<PartitionKey>,
    busy: HashSet<PartitionKey>,
    depth: usize,
}

impl Queues {
    fn push(&mut self, partition: PartitionKey, seq: u64) {
        let queue = self.pending.entry(partition.clone()).or_default();
        let was_empty = queue.is_empty();
        if queue.insert(seq) {
            self.depth += 1;
        }
        if was_empty && !self.busy.contains(&partition) {
            self.ready.push_back(partition);
        }
    }

    /// Take the next batch of a partition that is not being processed.
    fn next_batch(&mut self, max: usize) -> Option<(PartitionKey, Vec<u64>)> {
        let partition = self.ready.pop_front()?;
        let queue = self.pending.get_mut(&partition)?;
        let batch: Vec<u64> = queue.iter().take(max).copied().collect();
        for seq in &batch {
            queue.remove(seq);
        }
        if queue.is_empty() {
            self.pending.remove(&partition);
        }
        self.busy.insert(partition.clone());
        Some((partition, batch))
    }

    /// A batch finished: `failed` entries go back to the front of their queue.
    fn finish(&mut self, partition: PartitionKey, done: usize, failed: Vec<u64>) {
        self.busy.remove(&partition);
        self.depth = self.depth.saturating_sub(done);
        if !failed.is_empty() {
            let queue = self.pending.entry(partition.clone()).or_default();
            queue.extend(failed);
        }
        if self.pending.get(&partition).is_some_and(|q| !q.is_empty()) {
            self.ready.push_back(partition);
        }
    }
}

struct BatchResult {
    partition: PartitionKey,
    done: usize,
    failed: Vec<u64>,
}

async fn run(
    store: Store,
    metrics: Metrics,
    settings: DispatchSettings,
    mut queues: Queues,
    mut rx: mpsc::UnboundedReceiver<Vec<(u64, PartitionKey)>>,
    mut stop: watch::Receiver<bool>,
    progress: watch::Sender<usize>,
) {
    let mut inflight: JoinSet<BatchResult> = JoinSet::new();
    let mut open = true;
    loop {
        if *stop.borrow() {
            break;
        }
        while inflight.len() < settings.concurrency {
            let Some((partition, batch)) = queues.next_batch(settings.batch_size) else {
                break;
            };
            let (store, metrics) = (store.clone(), metrics.clone());
            let span =
                tracing::debug_span!("dispatch", partition = %partition, events = batch.len());
            inflight.spawn_blocking(move || {
                span.in_scope(|| process(&store, &metrics, partition, batch))
            });
        }
        tokio::select! {
            msg = rx.recv(), if open => match msg {
                Some(entries) => {
                    for (seq, partition) in entries {
                        queues.push(partition, seq);
                    }
                }
                None => open = false,
            },
            Some(joined) = inflight.join_next(), if !inflight.is_empty() => match joined {
                Ok(result) => queues.finish(result.partition, result.done, result.failed),
                Err(e) => tracing::error!(error = %e, "dispatch worker panicked"),
            },
            _ = stop.changed() => {}
        }
        metrics.inbox_depth.set(queues.depth as i64);
        progress.send_modify(|d| *d = queues.depth);
        if !open && inflight.is_empty() && queues.depth == 0 && queues.ready.is_empty() {
            // Every sender is gone and nothing is left: only happens in tests.
            let _ = stop.changed().await;
            break;
        }
    }
    // Shutdown: let batches in flight commit; what is queued stays in the inbox.
    while let Some(joined) = inflight.join_next().await {
        if let Ok(result) = joined {
            queues.finish(result.partition, result.done, result.failed);
        }
    }
    metrics.inbox_depth.set(queues.depth as i64);
    tracing::info!(left_in_inbox = queues.depth, "dispatcher stopped");
}

/// Fold one batch of a partition's events. Runs on the blocking pool.
fn process(
    store: &Store,
    metrics: &Metrics,
    partition: PartitionKey,
    seqs: Vec<u64>,
) -> BatchResult {
    let mut batch: Vec<(u64, Event)> = Vec::with_capacity(seqs.len());
    let mut received: Vec<Millis> = Vec::with_capacity(seqs.len());
    let mut done = 0;
    for &seq in &seqs {
        match store.event(seq) {
            Ok(Some(record)) => match crate::webhook::parse_event(record.event.get()) {
                Ok(event) => {
                    tracing::debug!(event_id = %event.id, conversation_id = ?event.payload.conversation_id(), kind = %event.kind, "folding event");
                    received.push(record.received_at);
                    batch.push((seq, event));
                }
                Err(e) => {
                    // Only possible if a newer model is stricter than the one that accepted it.
                    done += quarantine_unreadable(
                        store,
                        metrics,
                        seq,
                        record.event.get(),
                        &e.to_string(),
                    );
                }
            },
            Ok(None) => {
                tracing::error!(seq, "inbox entry without event record");
                done += quarantine_unreadable(store, metrics, seq, "", "event record missing");
            }
            Err(e) => {
                metrics.dispatch_errors.inc();
                tracing::error!(error = %e, "reading event failed");
                std::thread::sleep(RETRY_PAUSE);
                return BatchResult {
                    partition,
                    done,
                    failed: seqs,
                };
            }
        }
    }
    match store.apply(&batch) {
        Ok(applied) => {
            let now = crate::clock::now_millis();
            for at in received {
                metrics
                    .processing_seconds
                    .observe((now - at).max(0) as f64 / 1000.0);
            }
            metrics.events_applied.inc_by(applied.applied as u64);
            let entries = &metrics.state_entries;
            entries
                .with_label_values(&["conversations"])
                .add(applied.new_conversations as i64);
            entries
                .with_label_values(&["end_users"])
                .add(applied.new_end_users as i64);
            entries
                .with_label_values(&["bots"])
                .add(applied.new_bots as i64);
            BatchResult {
                partition,
                done: done + batch.len(),
                failed: Vec::new(),
            }
        }
        Err(e) => {
            metrics.dispatch_errors.inc();
            tracing::error!(error = %e, "folding batch failed; will retry");
            std::thread::sleep(RETRY_PAUSE);
            let failed = batch.iter().map(|(seq, _)| *seq).collect();
            BatchResult {
                partition,
                done,
                failed,
            }
        }
    }
}

fn quarantine_unreadable(
    store: &Store,
    metrics: &Metrics,
    seq: u64,
    raw: &str,
    why: &str,
) -> usize {
    let record = QuarantineRecord::new(
        "event",
        "unprocessable_event",
        why,
        raw.as_bytes(),
        crate::clock::now_millis(),
    );
    match store
        .quarantine(record)
        .and_then(|_| store.drop_from_inbox(seq))
    {
        Ok(()) => {
            metrics.record_quarantined("unprocessable_event");
            1
        }
        Err(e) => {
            tracing::error!(error = %e, seq, "cannot quarantine unprocessable event");
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(id: &str) -> PartitionKey {
        PartitionKey::Conversation(id.into())
    }

    #[test]
    fn a_partition_is_handed_out_once_until_its_batch_finishes() {
        let mut q = Queues::default();
        q.push(conv("a"), 2);
        q.push(conv("a"), 1);
        q.push(conv("b"), 3);
        let (p, batch) = q.next_batch(10).expect("batch");
        assert_eq!((p.clone(), batch), (conv("a"), vec![1, 2]));
        q.push(conv("a"), 4);
        let (p2, _) = q.next_batch(10).expect("b");
        assert_eq!(p2, conv("b"));
        assert!(q.next_batch(10).is_none(), "a is busy, b is busy");
        q.finish(conv("a"), 2, vec![]);
        assert_eq!(q.next_batch(10), Some((conv("a"), vec![4])));
        assert_eq!(q.depth, 2);
    }

    #[test]
    fn failed_entries_go_back_in_order() {
        let mut q = Queues::default();
        for s in [5, 6, 7] {
            q.push(conv("a"), s);
        }
        let (_, batch) = q.next_batch(2).expect("batch");
        assert_eq!(batch, vec![5, 6]);
        q.finish(conv("a"), 0, batch);
        assert_eq!(q.next_batch(10), Some((conv("a"), vec![5, 6, 7])));
        assert_eq!(q.depth, 3);
    }
}
