//! The reconciliation sweeper: finds where the service drifted from what the bridge believes
//! (an agent turned manual mode off in the builder, which sends no webhook; a lost webhook) and
//! hands each drift to the writer as a `reconcile.drift` event of its conversation.
//!
//! A pass:
//! 1. reads the candidates from the store's index (`store::watch`, kept by the folds): every
//!    conversation out of plain bot mode, those released within `reconcile.recent`, and a
//!    rotating sample of `reconcile.sample` others (a page of the conversations tree after the
//!    last pass's cursor);
//! 2. reads their states 200 at a time and, after each chunk's states, the outbox's pending
//!    entries (`Store::outbox_page`: all of them once, then only those decided since), and skips
//!    every conversation with a pending action in any of its queues (`c:<id>`, `helpdesk:<id>`):
//!    the sweeper never fights a change in flight;
//! 3. asks the service (`GET /openapi/conversation/{id}/manual`) at `reconcile.per_second` (its
//!    own limiter); a failed read leaves the conversation for the next pass;
//! 4. compares ([`compare`], pure) and, unless it is a dry run, hands each drift to the writer,
//!    unless an event was folded for its conversation meanwhile (then the next pass looks again).
//!
//! The sweeper writes nothing else: no state, no outbox. What a drift changes is its fold's and
//! the rules' business, in order with the conversation's other events.

pub mod compare;

use crate::backfill::WebhookWatch;
use crate::config::ReconcileConfig;
use crate::ops::metrics::Metrics;
use crate::outbox::ExecutorHandle;
use engine::state::ConversationState;
use model::action::OutboxEntry;
use model::ids::{ConversationId, DeliveryId};
use model::webhook::drift::{Drift, DriftKind};
use model::webhook::model::Millis;
use serde::Serialize;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use storage::writer::WriterError;
use storage::{AcceptJob, Store, StoreError, Writer};
use tokio::sync::watch;
use upstream::api::OpenApi;
use upstream::handle::UpstreamHandle;
use upstream::limits::OwnLimit;

/// Outbox entries read per page when collecting the pending queues.
const OUTBOX_PAGE: usize = 1_000;
/// Candidates whose states are read (and the outbox's pending queues with them) at a time.
const CHUNK: usize = 200;
/// How often the loop looks at the daemon's clock (which the test clock moves) for a due pass.
const TICK: Duration = Duration::from_secs(1);
/// The `sourceId` of a drift whose conversation's bot is unknown.
const NO_BOT: &str = "bridge";

/// Why a pass could not run.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the writer has stopped")]
    WriterStopped,
    #[error("the writer could not store the drift: {0}")]
    Writer(String),
    #[error("the store task failed: {0}")]
    Task(String),
}

/// What one pass did (the admin API's answer).
#[derive(Clone, Debug, Default, Serialize)]
pub struct SweepReport {
    pub dry_run: bool,
    /// Daemon time the pass started (Unix ms).
    pub started_at: Millis,
    /// Conversations compared with the service.
    pub checked: u64,
    /// Left for the next pass: pending outbox actions of theirs.
    pub skipped_pending: u64,
    /// Left for the next pass: the Open API read failed.
    pub read_failed: u64,
    /// Left for the next pass: an event was folded for them while the pass ran.
    pub skipped_changed: u64,
    /// Held: manual mode on at the service with no agent known to the bridge, while backfill
    /// reports the webhook silent (the bridge may only have missed the agent call's events).
    pub skipped_silent: u64,
    /// The drifts found (and, unless a dry run, handed to the writer).
    pub drifts: Vec<Drift>,
    /// Drift events newly stored (a drift handed on twice is stored once).
    pub written: u64,
}

struct Inner {
    store: Store,
    writer: Writer,
    api: OpenApi<UpstreamHandle>,
    metrics: Metrics,
    config: ReconcileConfig,
    limit: OwnLimit,
    /// The last conversation id the rotating sample reached.
    cursor: Mutex<Option<String>>,
    /// Conversations whose drift the last passes handed to the writer, with their
    /// `events_applied` then: until that changes (the drift is folded), they are not read again,
    /// so a drift waiting in the inbox is not reported twice. Holds at most the drifts of one
    /// pass and those still unfolded from before.
    unfolded: Mutex<std::collections::HashMap<String, u64>>,
    /// One pass at a time (the periodic one and those asked for).
    running: tokio::sync::Mutex<()>,
    /// The outbox's circuits: while the Open API's is open the service is down, so the
    /// periodic passes wait and no pass reads it (each read would only fail).
    executor: ExecutorHandle,
    /// The webhook's silence (backfill's): while silent, the bridge's view of the handoff may
    /// only be behind, and `manual_on_unknown` (whose repair turns manual mode off at the
    /// service) is held.
    webhook: WebhookWatch,
}

/// The sweeper; cheap to clone.
#[derive(Clone)]
pub struct Sweeper {
    inner: Arc<Inner>,
}

impl Sweeper {
    /// A sweeper over `store`, reading the service through `upstream`. The config is validated
    /// (`per_second` positive and finite).
    pub fn new(
        store: Store,
        writer: Writer,
        upstream: UpstreamHandle,
        metrics: Metrics,
        config: ReconcileConfig,
        executor: ExecutorHandle,
        webhook: WebhookWatch,
    ) -> Result<Self, String> {
        let limit = OwnLimit::new("reconcile.per_second", config.per_second)?;
        Ok(Sweeper {
            inner: Arc::new(Inner {
                store,
                writer,
                api: OpenApi::new(upstream),
                metrics,
                config,
                limit,
                cursor: Mutex::new(None),
                unfolded: Mutex::default(),
                running: tokio::sync::Mutex::new(()),
                executor,
                webhook,
            }),
        })
    }

    /// Run one pass now (after a pass in progress ends). A dry run reads and compares but hands
    /// nothing to the writer and counts nothing.
    pub async fn pass(&self, dry_run: bool) -> Result<SweepReport, SweepError> {
        let _one = self.inner.running.lock().await;
        let started = std::time::Instant::now();
        let result = self.run_pass(dry_run).await;
        if !dry_run {
            let outcome = if result.is_ok() { "done" } else { "failed" };
            let m = &self.inner.metrics;
            m.reconcile_passes.with_label_values(&[outcome]).inc();
            m.reconcile_pass_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        result
    }

    async fn run_pass(&self, dry_run: bool) -> Result<SweepReport, SweepError> {
        let inner = &self.inner;
        let now = self.inner.store.clock().now_millis();
        let mut report = SweepReport {
            dry_run,
            started_at: now,
            ..SweepReport::default()
        };
        let candidates = self.candidates(now).await?;
        let before = std::mem::take(&mut *lock(&inner.unfolded));
        let mut unfolded = std::collections::HashMap::new();
        let result = self
            .sweep(candidates, &before, &mut unfolded, &mut report)
            .await;
        // A dry run wrote nothing: what earlier passes wrote stays remembered.
        if dry_run {
            unfolded.extend(before);
        }
        *lock(&inner.unfolded) = unfolded;
        result?;
        if !dry_run {
            let m = &inner.metrics.reconcile_skipped;
            m.with_label_values(&["pending"])
                .inc_by(report.skipped_pending);
            m.with_label_values(&["read_failed"])
                .inc_by(report.read_failed);
            m.with_label_values(&["changed"])
                .inc_by(report.skipped_changed);
            m.with_label_values(&["webhook_silent"])
                .inc_by(report.skipped_silent);
        }
        Ok(report)
    }

    /// Compare the candidates a chunk at a time, writing (unless a dry run) the drifts found.
    /// `before`: the drifts earlier passes handed on, by conversation (see `Inner::unfolded`);
    /// `unfolded` gets those still unfolded and this pass's.
    async fn sweep(
        &self,
        candidates: Vec<ConversationId>,
        before: &std::collections::HashMap<String, u64>,
        unfolded: &mut std::collections::HashMap<String, u64>,
        report: &mut SweepReport,
    ) -> Result<(), SweepError> {
        if self.inner.executor.openapi_down() {
            // The service is down (the outbox's circuit is open): nothing to read, so neither
            // the states nor the outbox (an outage's backlog) are read either.
            report.read_failed += candidates.len() as u64;
            return Ok(());
        }
        let mut pending = PendingQueues::new(&candidates);
        for ids in candidates.chunks(CHUNK) {
            let (states, now_pending) = self.chunk(ids.to_vec(), pending).await?;
            pending = now_pending;
            let found = self
                .compare_chunk(states, &pending, before, unfolded, report)
                .await;
            self.hand_on(found, unfolded, report).await?;
        }
        Ok(())
    }

    /// Read the service for each state of a chunk; the drifts found with their states.
    async fn compare_chunk(
        &self,
        states: Vec<ConversationState>,
        pending: &PendingQueues,
        before: &std::collections::HashMap<String, u64>,
        unfolded: &mut std::collections::HashMap<String, u64>,
        report: &mut SweepReport,
    ) -> Vec<(ConversationState, Drift)> {
        let inner = &self.inner;
        let mut found = Vec::new();
        for state in states {
            let id = state.id.as_str();
            if before.get(id) == Some(&state.events_applied) {
                // Its drift event is not folded yet: pending too.
                unfolded.insert(id.to_owned(), state.events_applied);
                report.skipped_pending += 1;
                continue;
            }
            if pending.contains(&state.id) {
                report.skipped_pending += 1;
                continue;
            }
            if inner.executor.openapi_down() {
                // The outbox's circuit is open: a read would only fail (and add to the load
                // of a service that is down). Left for the next pass.
                report.read_failed += 1;
                continue;
            }
            inner.limit.wait().await;
            let answer = match inner.api.get_manual(state.id.as_str()).await {
                Ok(answer) => answer,
                Err(e) => {
                    tracing::debug!(conversation_id = %state.id, error = %e, "reconcile: cannot read manual status; next pass");
                    report.read_failed += 1;
                    continue;
                }
            };
            report.checked += 1;
            let service = compare::observed(&answer);
            if let Some(drift) =
                compare::drift(&state, &service, self.inner.store.clock().now_millis())
            {
                found.push((state, drift));
            }
        }
        found
    }

    /// Hand the drifts of a chunk on (a dry run: only report them). The states may have moved
    /// on while the service was read: an event folded since (whatever it was) means the comparison
    /// is stale; the next pass looks again.
    async fn hand_on(
        &self,
        found: Vec<(ConversationState, Drift)>,
        unfolded: &mut std::collections::HashMap<String, u64>,
        report: &mut SweepReport,
    ) -> Result<(), SweepError> {
        if found.is_empty() {
            return Ok(());
        }
        let inner = &self.inner;
        let dry_run = report.dry_run;
        let store = inner.store.clone();
        let checked = blocking(move || {
            found
                .into_iter()
                .map(|(before, drift)| {
                    let now = store.conversation(&before.id)?;
                    let same = now
                        .as_ref()
                        .is_some_and(|s| s.events_applied == before.events_applied);
                    Ok((same.then_some(before.events_applied), before.bot_id, drift))
                })
                .collect::<Result<Vec<_>, StoreError>>()
        })
        .await??;
        for (applied, bot, drift) in checked {
            let Some(applied) = applied else {
                report.skipped_changed += 1;
                continue;
            };
            if held_while_silent(drift.kind, inner.webhook.is_silent()) {
                tracing::debug!(conversation_id = %drift.conversation_id, kind = %drift.kind, "reconcile: drift held while the webhook is silent");
                report.skipped_silent += 1;
                continue;
            }
            tracing::info!(
                conversation_id = %drift.conversation_id,
                kind = %drift.kind,
                believed_manual = drift.believed.manual,
                service_manual = drift.service.manual,
                dry_run,
                "reconcile: drift found"
            );
            if !dry_run {
                inner
                    .metrics
                    .reconcile_drift
                    .with_label_values(&[drift.kind.as_str()])
                    .inc();
                // Remembered even when the writer fails: it may have stored it.
                unfolded.insert(drift.conversation_id.as_str().to_owned(), applied);
                report.written += self.write(&drift, bot.as_ref().map(|b| b.as_str())).await?;
            }
            report.drifts.push(drift);
        }
        Ok(())
    }

    /// The pass's conversations (watched, then the sample), as ids: their states are read a
    /// chunk at a time ([`Sweeper::chunk`]), so a long pass holds few in memory.
    async fn candidates(&self, now: Millis) -> Result<Vec<ConversationId>, SweepError> {
        let inner = self.inner.clone();
        blocking(move || {
            let config = &inner.config;
            let recent = i64::try_from(config.recent.as_millis()).unwrap_or(i64::MAX);
            let watched = inner
                .store
                .watched(now.saturating_sub(recent), config.max_per_pass)?;
            let mut seen = HashSet::new();
            let mut ids = Vec::new();
            for id in watched.active.into_iter().chain(watched.released) {
                if seen.insert(id.clone()) {
                    ids.push(ConversationId::new(id));
                }
            }
            let room = config.max_per_pass.saturating_sub(ids.len());
            let sample = config.sample.min(room);
            if sample > 0 {
                let mut cursor = lock(&inner.cursor);
                let mut page = inner.store.conversations_page(cursor.as_deref(), sample)?;
                if page.len() < sample {
                    // Wrapped around: start again from the first conversation.
                    let more = inner.store.conversations_page(None, sample - page.len())?;
                    page.extend(more);
                }
                *cursor = page.last().map(|s| s.id.as_str().to_owned());
                for state in page {
                    if seen.insert(state.id.as_str().to_owned()) {
                        ids.push(state.id);
                    }
                }
            }
            Ok(ids)
        })
        .await?
    }

    /// The states of a chunk of candidates (deleted ones left out: the service has nothing to
    /// compare), and then the queues with pending outbox entries brought up to date. Read in
    /// this order, so a conversation whose state is unchanged when its drift is handed on had no
    /// entry decided after this look at the outbox (entries are decided only with a fold of its
    /// events).
    async fn chunk(
        &self,
        ids: Vec<ConversationId>,
        mut pending: PendingQueues,
    ) -> Result<(Vec<ConversationState>, PendingQueues), SweepError> {
        let store = self.inner.store.clone();
        blocking(move || {
            let mut states = Vec::with_capacity(ids.len());
            for id in &ids {
                if let Some(state) = store.conversation(id)? {
                    if state.deleted_at.is_none() {
                        states.push(state);
                    }
                }
            }
            pending.refresh(|after, limit| store.outbox_page(after, limit))?;
            Ok((states, pending))
        })
        .await?
    }

    /// Hand a drift to the writer; 1 when it was stored now (0: a duplicate).
    async fn write(&self, drift: &Drift, bot: Option<&str>) -> Result<u64, SweepError> {
        let bot = bot.filter(|b| !b.is_empty()).unwrap_or(NO_BOT);
        let event = match model::webhook::drift_event(drift, bot) {
            Ok(event) => event,
            Err(e) => {
                // Cannot happen for a drift made here; logged, not stored.
                tracing::error!(error = %e, conversation_id = %drift.conversation_id, "reconcile: drift event refused");
                return Ok(0);
            }
        };
        let job = AcceptJob {
            delivery: DeliveryId::new(event.event.id.as_str()),
            events: vec![event],
            invalid: Vec::new(),
            received_at: self.inner.store.clock().now_millis(),
        };
        match self.inner.writer.accept(job).await {
            Ok(accepted) => Ok(accepted.new.len() as u64),
            Err(WriterError::Stopped) => Err(SweepError::WriterStopped),
            Err(WriterError::Store(e)) => Err(SweepError::Writer(e)),
            Err(e @ WriterError::Opening) => Err(SweepError::Writer(e.to_string())),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Whether a drift of `kind` waits while the webhook is `silent`: manual mode on at the service
/// with no agent known here may be an agent call whose events the webhook has not delivered
/// (backfill cannot infer them), and its repair would turn manual mode off under a real agent.
/// The service's re-send (once the webhook is enabled) or the next pass after it settles it.
/// Manual mode off at the service is the service's truth whatever the bridge missed.
fn held_while_silent(kind: DriftKind, silent: bool) -> bool {
    silent && kind == DriftKind::ManualOnUnknown
}

/// A conversation's outbox queues: its Open API actions' and its help-desk events'.
fn queues_of(id: &ConversationId) -> [String; 2] {
    [
        model::ids::PartitionKey::Conversation(id.clone()).encode(),
        format!("helpdesk:{id}"),
    ]
}

/// The queues of a pass's candidates that have a pending outbox entry. The outbox is read whole
/// once, with the first chunk, and after each later chunk's states only past the last entry read
/// (an entry's seq grows with decision order, and folds commit one at a time), so a pass reads a
/// large backlog (an outage's) once, not once per chunk. Only the candidates' queues are kept, so
/// memory follows `reconcile.max_per_pass`, not the backlog. An entry finished since it was read
/// still counts: its conversation waits for the next pass.
struct PendingQueues {
    wanted: HashSet<String>,
    found: HashSet<String>,
    /// The last entry read (`None`: none yet, the next read starts at the first).
    after: Option<u64>,
}

impl PendingQueues {
    fn new(candidates: &[ConversationId]) -> Self {
        PendingQueues {
            wanted: candidates.iter().flat_map(queues_of).collect(),
            found: HashSet::new(),
            after: None,
        }
    }

    /// Read the entries decided since the last read (all of them the first time), page by page
    /// through `page(after, limit)` (`Store::outbox_page`).
    fn refresh(
        &mut self,
        mut page: impl FnMut(Option<u64>, usize) -> Result<Vec<OutboxEntry>, StoreError>,
    ) -> Result<(), StoreError> {
        loop {
            let entries = page(self.after, OUTBOX_PAGE)?;
            let Some(last) = entries.last() else { break };
            self.after = Some(last.seq);
            let full = entries.len() == OUTBOX_PAGE;
            for entry in entries {
                if self.wanted.contains(&entry.queue) {
                    self.found.insert(entry.queue);
                }
            }
            if !full {
                break;
            }
        }
        Ok(())
    }

    /// Whether any of a conversation's queues has a pending action.
    fn contains(&self, id: &ConversationId) -> bool {
        queues_of(id).iter().any(|q| self.found.contains(q))
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, SweepError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| SweepError::Task(e.to_string()))
}

/// Run passes every `reconcile.interval` of daemon time (the test clock moves it) in each of
/// `terms` (this node as the active one); none when the interval is off. A term's first pass
/// runs one interval after it begins.
pub fn start(sweeper: Sweeper, terms: crate::cluster::Terms) -> tokio::task::JoinHandle<()> {
    tokio::spawn(crate::cluster::each_term(terms, move |stop| {
        run(sweeper.clone(), stop)
    }))
}

/// [`start`]'s passes until `stop` turns true.
async fn run(sweeper: Sweeper, mut stop: watch::Receiver<bool>) {
    let interval = sweeper.inner.config.interval;
    if interval.is_zero() {
        tracing::info!("reconciliation sweeper: periodic passes off (reconcile.interval)");
        return;
    }
    let every = i64::try_from(interval.as_millis()).unwrap_or(i64::MAX);
    let mut due = sweeper
        .inner
        .store
        .clock()
        .now_millis()
        .saturating_add(every);
    let mut waiting = false;
    loop {
        if *stop.borrow() {
            break;
        }
        let now = sweeper.inner.store.clock().now_millis();
        if now >= due && sweeper.inner.executor.openapi_down() {
            // The service is down (the outbox's circuit is open): every read would fail.
            // The pass waits for the next interval; nothing is lost, the drift stays.
            if !waiting {
                tracing::info!("reconciliation passes wait: the Open API's circuit is open");
                waiting = true;
            }
            sweeper
                .inner
                .metrics
                .reconcile_passes
                .with_label_values(&["skipped"])
                .inc();
            due = now.saturating_add(every);
            continue;
        }
        if now >= due {
            waiting = false;
            match sweeper.pass(false).await {
                Ok(report) if !report.drifts.is_empty() => tracing::info!(
                    drifts = report.drifts.len(),
                    checked = report.checked,
                    "reconciliation pass found drift"
                ),
                Ok(report) => tracing::debug!(checked = report.checked, "reconciliation pass"),
                Err(SweepError::WriterStopped) => break,
                Err(e) => {
                    tracing::error!(error = %e, "reconciliation pass failed; next interval")
                }
            }
            due = sweeper
                .inner
                .store
                .clock()
                .now_millis()
                .saturating_add(every);
            continue;
        }
        tokio::select! {
            _ = tokio::time::sleep(TICK) => {}
            changed = stop.changed() => if changed.is_err() { break },
        }
    }
    tracing::info!("reconciliation sweeper stopped");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outbox(queues: &[&str]) -> Vec<OutboxEntry> {
        (1..)
            .zip(queues)
            .map(|(seq, q)| crate::test_support::outbox_entry(seq, q))
            .collect()
    }

    /// `Store::outbox_page` over `entries`, counting the entries it hands out.
    fn pages<'a>(
        entries: &'a [OutboxEntry],
        read: &'a mut usize,
    ) -> impl FnMut(Option<u64>, usize) -> Result<Vec<OutboxEntry>, StoreError> + 'a {
        move |after, limit| {
            let page: Vec<OutboxEntry> = entries
                .iter()
                .filter(|e| after.is_none_or(|a| e.seq > a))
                .take(limit)
                .cloned()
                .collect();
            *read += page.len();
            Ok(page)
        }
    }

    #[test]
    fn only_manual_on_unknown_waits_while_the_webhook_is_silent() {
        for &kind in DriftKind::ALL {
            assert!(!held_while_silent(kind, false), "{kind}");
        }
        assert!(held_while_silent(DriftKind::ManualOnUnknown, true));
        assert!(!held_while_silent(DriftKind::ManualOffUnknown, true));
    }

    #[test]
    fn a_conversation_is_pending_by_either_of_its_queues() {
        let ids = [ConversationId::new("c1"), ConversationId::new("c3")];
        let mut pending = PendingQueues::new(&ids);
        let mut read = 0;
        pending
            .refresh(pages(&outbox(&["c:c2", "u:c1"]), &mut read))
            .expect("read");
        assert!(!pending.contains(&ids[0]), "another's queues");
        let mut pending = PendingQueues::new(&ids);
        pending
            .refresh(pages(&outbox(&["helpdesk:c1"]), &mut read))
            .expect("read");
        assert!(pending.contains(&ids[0]));
        assert!(!pending.contains(&ids[1]));
        let mut pending = PendingQueues::new(&ids);
        pending
            .refresh(pages(&outbox(&["c:c1"]), &mut read))
            .expect("read");
        assert!(pending.contains(&ids[0]));
    }

    #[test]
    fn a_pass_reads_a_large_backlog_once_and_keeps_only_its_candidates_queues() {
        let ids = [ConversationId::new("c1"), ConversationId::new("c2")];
        let mut pending = PendingQueues::new(&ids);
        let queues: Vec<String> = (0..2_500).map(|i| format!("c:other{i}")).collect();
        let mut backlog = outbox(&queues.iter().map(String::as_str).collect::<Vec<_>>());
        let mut read = 0;
        pending.refresh(pages(&backlog, &mut read)).expect("read");
        assert_eq!(read, 2_500, "the whole outbox, page by page");
        assert!(pending.found.is_empty(), "none of the candidates'");
        // A fold decides an entry for c2 before the next chunk: only it is read then.
        backlog.push(crate::test_support::outbox_entry(2_501, "c:c2"));
        let mut read = 0;
        pending.refresh(pages(&backlog, &mut read)).expect("read");
        assert_eq!(read, 1, "only what was decided since");
        assert!(pending.contains(&ids[1]));
        assert!(!pending.contains(&ids[0]));
        let mut read = 0;
        pending.refresh(pages(&backlog, &mut read)).expect("read");
        assert_eq!(read, 0);
    }
}
