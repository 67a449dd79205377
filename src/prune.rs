//! The pruning pass: every `store.prune_interval`, and on `POST /admin/v1/prune`. One pass at a
//! time. It forgets dedupe ids and deletes event log segments past their retention
//! (`Store::prune_with`), drops finished actions from the ledger, the agent API's old answers,
//! and the conversation and end-user states past `store.state_retention` with every key derived
//! from them (`store::retention`), the quarantine records past `store.quarantine_retention`, and
//! the handoff figures' hour records past `engine::state::stats::KEPT_MS` (48 h), and the
//! console's audit list past `admin.console_audit_retention`.
//!
//! The event log, the ledger and the answers are judged by real time (the test clock must not
//! make data look old enough to drop); states and quarantine records by the daemon's clock (the
//! test clock moves it), since they carry the service's event times and intake's receive times.

use crate::config::Config;
use crate::ops::metrics::Metrics;
use model::webhook::model::Millis;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;
use storage::retention::StatesPruned;
use storage::{Store, StoreError, Writer};

/// Records removed per transaction by the ledger, answer and quarantine pruning.
const BATCH: usize = 10_000;

/// What one pass removed (the admin API's answer).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PruneReport {
    /// Event and delivery ids forgotten by dedupe.
    pub dedupe_records: u64,
    /// Event log segments deleted.
    pub event_segments: u64,
    /// Finished actions dropped from the ledger, and their audit records.
    pub actions: u64,
    pub finished: u64,
    /// Agent API idempotency answers.
    pub idempotency_answers: u64,
    pub conversations: u64,
    pub end_users: u64,
    /// States past retention left for a later pass (see `StatesPruned::skipped`).
    pub states_skipped: u64,
    /// Transactions the state pruning took (each a chunk of at most `store::retention::CHUNK`).
    pub state_chunks: u64,
    pub quarantine: u64,
    /// Hour records of the handoff figures (older than 48 hours).
    pub handoff_hours: u64,
    /// Entries of the console's audit list (past `admin.console_audit_retention`).
    pub console_actions: u64,
    /// Desk mappings handed back longer than `store.state_retention` ago.
    pub desk_links: u64,
    /// How long the pass took.
    pub took_ms: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum PruneError {
    /// The writer could not flush (segments go only below a watermark that is on disk).
    #[error("the store did not flush: {0}")]
    Flush(#[from] storage::writer::WriterError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the pruning task failed: {0}")]
    Task(String),
}

/// The retentions a pass applies (zero: kept forever).
#[derive(Clone, Copy, Debug)]
struct Retentions {
    dedupe: Duration,
    events: Duration,
    audit: Duration,
    answers: Duration,
    states: Duration,
    quarantine: Duration,
    console_audit: Duration,
}

/// Runs passes, one at a time.
#[derive(Clone)]
pub struct Pruner {
    store: Store,
    writer: Writer,
    metrics: Metrics,
    retentions: Retentions,
    running: Arc<tokio::sync::Mutex<()>>,
}

fn millis(d: Duration) -> Millis {
    Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX)
}

impl Pruner {
    pub fn new(store: Store, writer: Writer, metrics: Metrics, config: &Config) -> Self {
        Pruner {
            store,
            writer,
            metrics,
            retentions: Retentions {
                dedupe: config.webhook.dedupe_retention,
                events: config.store.event_retention,
                audit: config.outbox.audit_retention,
                answers: config.helpdesk.idempotency_retention,
                states: config.store.state_retention,
                quarantine: config.store.quarantine_retention,
                console_audit: config.admin.console_audit_retention,
            },
            running: Default::default(),
        }
    }

    /// One pass now (after the one running, if any).
    pub async fn pass(&self) -> Result<PruneReport, PruneError> {
        // Held by the blocking part to its end, which also counts what it removed: a caller that
        // stops waiting (an admin request cut off) neither lets a second pass run beside it nor
        // leaves the gauges above what the store holds.
        let one = self.running.clone().lock_owned().await;
        let started = std::time::Instant::now();
        let r = self.retentions;
        let now = model::clock::system_millis();
        let dedupe_before = now - millis(r.dedupe);
        let events_before = now - millis(r.events);
        let audit_before = now - millis(r.audit);
        let answers_before = now - millis(r.answers);
        let daemon_now = self.store.clock().now_millis();
        let states_before = (!r.states.is_zero()).then(|| daemon_now - millis(r.states));
        let quarantine_before =
            (!r.quarantine.is_zero()).then(|| daemon_now - millis(r.quarantine));
        let figures_before = daemon_now.saturating_sub(engine::state::stats::KEPT_MS);
        let console_before = daemon_now - millis(r.console_audit);
        // The folds' watermark, then a flush (the writer's: the one flusher): segments below it
        // go only once the folds before it are on disk.
        let fold_from = self.store.fold_from()?;
        self.writer.flush().await?;
        let store = self.store.clone();
        let pruner = self.clone();
        let removing = move |report: &mut PruneReport, states: &mut StatesPruned| {
            let pruned = store.prune_events(dedupe_before, events_before, fold_from)?;
            report.dedupe_records = pruned.ids_forgotten;
            report.event_segments = pruned.event_chunks;
            // Event pruning can lag its retention (it stops at an event still in the inbox): the
            // ledger outlives every stored event, so a replay of any of them still knows what
            // already ran.
            let oldest = store.oldest_event_received_at()?.unwrap_or(audit_before);
            (report.actions, report.finished) =
                store.prune_ledger(audit_before.min(oldest), BATCH)?;
            // Every old answer each round, so the tree cannot outgrow the pruning however busy
            // the agent API is.
            loop {
                let removed = store.prune_idempotency(answers_before, BATCH)?;
                report.idempotency_answers += removed;
                if removed < BATCH as u64 {
                    break;
                }
            }
            // A few small records (about one an hour), before the long steps.
            report.handoff_hours = store.prune_handoff_stats(figures_before, BATCH)?;
            report.console_actions = store.prune_operator_actions(console_before, BATCH)?;
            // The quarantine first: a state the pass cannot read stops it, and must not keep
            // the quarantine's records past their retention too.
            if let Some(before) = quarantine_before {
                let ended;
                (report.quarantine, ended) = store.prune_quarantine(before, BATCH).split();
                ended?;
            }
            if let Some(before) = states_before {
                // A handed-back conversation's desk mapping goes with its state's retention.
                report.desk_links = store.prune_desk_links(before, BATCH)?;
                let ended;
                (*states, ended) = store
                    .prune_states(before, storage::retention::CHUNK)
                    .split();
                ended?;
            }
            Ok::<_, StoreError>(())
        };
        let pruning = move || {
            let _one = one;
            let (mut report, mut states) = (PruneReport::default(), StatesPruned::default());
            // Counted even when a step failed: what the steps before it removed is gone.
            let result = removing(&mut report, &mut states);
            report.conversations = states.conversations;
            report.end_users = states.end_users;
            report.states_skipped = states.skipped;
            report.state_chunks = states.chunks;
            report.took_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
            pruner.count(&report, states.timers);
            result.map(|()| report)
        };
        Ok(tokio::task::spawn_blocking(pruning)
            .await
            .map_err(|e| PruneError::Task(e.to_string()))??)
    }

    /// The pass's counters, and the gauges of what it removed.
    fn count(&self, report: &PruneReport, timers: u64) {
        let m = &self.metrics;
        for (kind, n) in [
            ("dedupe", report.dedupe_records),
            ("event_segments", report.event_segments),
            ("actions", report.actions),
            ("finished", report.finished),
            ("idempotency", report.idempotency_answers),
            ("conversations", report.conversations),
            ("end_users", report.end_users),
            ("quarantine", report.quarantine),
            ("handoff_hours", report.handoff_hours),
            ("console_actions", report.console_actions),
            ("desk_links", report.desk_links),
        ] {
            m.pruned.with_label_values(&[kind]).inc_by(n);
        }
        let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        m.state_entries
            .with_label_values(&["conversations"])
            .sub(gauge(report.conversations));
        m.state_entries
            .with_label_values(&["end_users"])
            .sub(gauge(report.end_users));
        m.quarantine_entries.sub(gauge(report.quarantine));
        m.timers_pending.sub(gauge(timers));
        if report.dedupe_records
            + report.event_segments
            + report.conversations
            + report.end_users
            + report.quarantine
            > 0
        {
            tracing::debug!(
                dedupe = report.dedupe_records,
                event_segments = report.event_segments,
                conversations = report.conversations,
                end_users = report.end_users,
                quarantine = report.quarantine,
                skipped = report.states_skipped,
                "pruned"
            );
        }
    }
}

/// A pass every `interval` until `stop`.
pub async fn run(pruner: Pruner, interval: Duration, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(interval);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        if let Err(e) = pruner.pass().await {
            tracing::warn!(error = %e, "prune failed");
        }
    }
}
