//! Backfill: the service's events the webhook did not deliver, read back through the Open API.
//!
//! The service disables a webhook after three failed deliveries within 30 minutes (an outage of
//! ours, a network split) and then sends nothing until someone re-enables it. So on every start
//! and every `backfill.interval` a pass reads what happened at the service since its cursor
//! (minus `backfill.overlap`): `GET /openapi/messages?from=&to=` and
//! `GET /openapi/conversations?from=&to=` (on `updatedAt`), page by page. What the bridge never
//! received becomes an event marked as backfilled (`source: backfill`, ids under the reserved
//! `backfill:` prefix), accepted through the writer like a timer firing, so it is durable,
//! deduped, folded in order with its conversation, audited and reaches rules:
//!
//! - a message the conversation's state does not know (by its own id, `MESSAGE.id`) becomes the
//!   `bot.message.received` / `bot.message.sent` event the webhook would have carried;
//! - a conversation changed at the service after the bridge last heard of it, whose manual
//!   status, params or navigation differ from the state's, becomes a `bot.conversation.updated`
//!   carrying the conversation as listed, but only where the webhook demonstrably missed
//!   something (messages of it missing, the webhook silent) or the bridge has no state for it.
//!   Agent-call steps (requested, connected...) have no trace in the Open API, and changes made
//!   without a webhook (the bridge's own calls, the builder) are not the webhook's to miss: both
//!   are left to the reconciliation sweeper (and agent-call steps to the webhook's re-send once it
//!   is enabled again).
//!
//! A message is folded once whichever path brings it first: the fold knows a conversation's
//! recent message ids (`state::ConversationState::knows_message`).
//!
//! Messages missing longer than `backfill.silence_alert_after` (with no delivery since) mean the
//! webhook is silent: the
//! `handoff_webhook_silent` gauge, a `warn` line naming the likely cause, and `/readyz`'s
//! `checks.webhook` (detail only, never a 503) say so until a delivery arrives again
//! ([`WebhookWatch::arrived`]). A failed Open API read ends the pass without moving the cursor:
//! the next pass tries again.

use crate::ops::metrics::Metrics;
use crate::outbox::ExecutorHandle;
use engine::state::ConversationState;
use model::contract::{ConversationsQuery, MessagesQuery, Page, PageQuery};
use model::ids::{ConversationId, DeliveryId};
use model::webhook::model::{Conversation, Message, Millis};
use model::webhook::IncomingEvent;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use storage::writer::WriterError;
use storage::{AcceptJob, Store, StoreError, Writer};
use tokio::sync::watch;
use upstream::api::OpenApi;
use upstream::error::UpstreamError;
use upstream::handle::UpstreamHandle;
use upstream::limits::OwnLimit;

/// Items per Open API page (the contract's maximum).
const PAGE_LIMIT: u32 = 100;
/// Pages of each list one pass reads at most; a pass that stops there moves its cursor only as
/// far as the messages it read, and the next pass goes on.
const MAX_PAGES: u32 = 50;
/// Events handed to the writer in one job.
const JOB_EVENTS: usize = 256;
/// `sourceId` of a backfilled event whose bot is not known (the conversation's bot always is
/// when the service lists the conversation).
const NO_BOT: &str = "bridge";
/// "Not silent" in [`WebhookWatch`]'s atomic.
const NOT_SILENT: i64 = i64::MIN;

/// How backfill runs (`[backfill]`).
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    pub interval: Duration,
    pub silence_alert_after: Duration,
    pub overlap: Duration,
    /// Open API reads per second at most (validated positive).
    pub per_second: f64,
}

impl Settings {
    /// `global`: `upstream.limits.global.per_second`, of which backfill reads at most half.
    pub fn from_config(c: &crate::config::BackfillConfig, global: f64) -> Self {
        Settings {
            interval: c.interval,
            silence_alert_after: c.silence_alert_after,
            overlap: c.overlap,
            per_second: c.per_second.min(global / 2.0),
        }
    }
}

fn millis(d: Duration) -> Millis {
    Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX)
}

/// Whether the webhook is silent: shared by backfill (which finds out), intake (whose deliveries
/// end it), `/readyz` and the admin API. Cheap to clone.
#[derive(Clone)]
pub struct WebhookWatch {
    inner: Arc<WatchInner>,
}

struct WatchInner {
    /// Since when (daemon ms) the webhook is silent, or [`NOT_SILENT`].
    silent_since: AtomicI64,
    /// When the last authenticated delivery arrived (daemon ms), or `i64::MIN`.
    last_delivery_at: AtomicI64,
    /// The oldest message backfill found missing since that delivery, or `i64::MAX`.
    first_missing_at: AtomicI64,
    /// Events backfilled since start.
    backfilled: AtomicU64,
    gauge: prometheus::IntGauge,
}

impl WebhookWatch {
    pub fn new(metrics: &Metrics) -> Self {
        metrics.webhook_silent.set(0);
        WebhookWatch {
            inner: Arc::new(WatchInner {
                silent_since: AtomicI64::new(NOT_SILENT),
                last_delivery_at: AtomicI64::new(i64::MIN),
                first_missing_at: AtomicI64::new(i64::MAX),
                backfilled: AtomicU64::new(0),
                gauge: metrics.webhook_silent.clone(),
            }),
        }
    }

    /// A delivery from the service was accepted (intake): the webhook works, silence ends.
    pub fn arrived(&self, now: Millis) {
        // Every delivery comes here: read before writing, so the usual case writes one atomic.
        self.inner
            .last_delivery_at
            .fetch_max(now, Ordering::Relaxed);
        if self.inner.first_missing_at.load(Ordering::Relaxed) != i64::MAX {
            self.inner
                .first_missing_at
                .store(i64::MAX, Ordering::Relaxed);
        }
        if self.is_silent()
            && self.inner.silent_since.swap(NOT_SILENT, Ordering::Relaxed) != NOT_SILENT
        {
            self.inner.gauge.set(0);
            tracing::info!("webhook deliveries arrive again: the webhook is no longer silent");
        }
    }

    fn last_delivery_at(&self) -> Millis {
        self.inner.last_delivery_at.load(Ordering::Relaxed)
    }

    /// A pass that began at `started` found messages missing, the oldest from `oldest`. Returns
    /// the oldest message missing since the last delivery, unless a delivery arrived since the
    /// pass began (then the webhook works, and what the pass found was only late).
    fn missing(&self, oldest: Option<Millis>, started: Millis) -> Option<Millis> {
        if self.last_delivery_at() >= started {
            return None;
        }
        if let Some(oldest) = oldest {
            self.inner
                .first_missing_at
                .fetch_min(oldest, Ordering::Relaxed);
        }
        let first = self.inner.first_missing_at.load(Ordering::Relaxed);
        (first != i64::MAX).then_some(first)
    }

    /// Backfill found events the webhook should have delivered long ago. Returns true when this
    /// starts the silence.
    fn silent(&self, since: Millis) -> bool {
        let started = self
            .inner
            .silent_since
            .compare_exchange(NOT_SILENT, since, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok();
        self.inner.gauge.set(1);
        started
    }

    pub fn is_silent(&self) -> bool {
        self.inner.silent_since.load(Ordering::Relaxed) != NOT_SILENT
    }

    fn count(&self, n: u64) {
        self.inner.backfilled.fetch_add(n, Ordering::Relaxed);
    }

    /// `/readyz`'s `checks.webhook`: `{"silent", "since" (ms or null), "backfilled"}`.
    pub fn detail(&self) -> Value {
        let since = self.inner.silent_since.load(Ordering::Relaxed);
        json!({
            "silent": since != NOT_SILENT,
            "since": (since != NOT_SILENT).then_some(since),
            "backfilled": self.inner.backfilled.load(Ordering::Relaxed),
        })
    }
}

/// Why a pass stopped (its cursor stays; the next pass tries again).
#[derive(Debug, thiserror::Error)]
pub enum BackfillError {
    #[error("reading the Open API failed: {0}")]
    Upstream(#[from] UpstreamError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the writer refused backfilled events: {0}")]
    Writer(#[from] WriterError),
    #[error("a store read failed on the blocking pool: {0}")]
    Join(String),
}

/// What one pass did (the admin API's answer).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct BackfillReport {
    /// The window read (daemon ms); both null on a first pass, which only sets the cursor.
    pub from: Option<Millis>,
    pub to: Option<Millis>,
    pub messages_read: u64,
    pub conversations_read: u64,
    /// Events handed to the writer as backfilled, and how many of them were new to the store.
    pub missing: u64,
    pub stored: u64,
    /// The oldest missing event's time, if any.
    pub oldest_missing_at: Option<Millis>,
    /// The pass found the webhook silent.
    pub silent: bool,
    /// A list was longer than one pass reads: the cursor moved only as far as the messages read
    /// (the next pass goes on from there).
    pub truncated: bool,
}

/// The backfill worker: a pass at a time (the periodic loop and the admin API share it).
#[derive(Clone)]
pub struct Backfill {
    store: Store,
    writer: Writer,
    api: Arc<OpenApi<UpstreamHandle>>,
    metrics: Metrics,
    settings: Settings,
    watch: WebhookWatch,
    running: Arc<tokio::sync::Mutex<()>>,
    /// The outbox's circuits: while the Open API's is open the periodic passes wait.
    executor: ExecutorHandle,
    /// Its reads' own rate limit (`backfill.per_second`), below the outbox's share.
    limit: Arc<OwnLimit>,
}

impl Backfill {
    pub fn new(
        store: Store,
        writer: Writer,
        upstream: UpstreamHandle,
        metrics: Metrics,
        settings: Settings,
        watch: WebhookWatch,
        executor: ExecutorHandle,
    ) -> Result<Self, String> {
        Ok(Backfill {
            store,
            writer,
            api: Arc::new(OpenApi::new(upstream)),
            metrics,
            settings,
            watch,
            running: Arc::new(tokio::sync::Mutex::new(())),
            executor,
            limit: Arc::new(OwnLimit::new("backfill.per_second", settings.per_second)?),
        })
    }

    pub fn watch(&self) -> &WebhookWatch {
        &self.watch
    }

    /// Run one pass now (after the one running, if any).
    pub async fn pass(&self) -> Result<BackfillReport, BackfillError> {
        let _one = self.running.lock().await;
        let started = self.store.clock().now_millis();
        let Some(cursor) = self.blocking(|s| s.backfill_cursor()).await? else {
            // A new store: the service's history before the bridge existed is not its to fold.
            self.blocking(move |s| s.set_backfill_cursor(started))
                .await?;
            self.writer.flush().await?;
            tracing::info!("backfill starts from now (first pass on this store)");
            return Ok(BackfillReport::default());
        };
        let from = cursor.saturating_sub(millis(self.settings.overlap));
        let to = started;
        let mut report = BackfillReport {
            from: Some(from),
            to: Some(to),
            ..BackfillReport::default()
        };

        let (mut conversations, conv_full) = self.conversations(from, to).await?;
        let (messages, msg_full) = self.messages(from, to).await?;
        report.conversations_read = conversations.len() as u64;
        report.messages_read = messages.len() as u64;
        report.truncated = !(conv_full && msg_full);

        let states = self.known_states(&conversations, &messages).await?;
        self.read_unseen(&mut conversations, &messages, &states)
            .await?;
        let found = Found::new(&conversations, &messages, &states);
        let (mut missing, oldest_message) = found.missing(to, self.watch.is_silent());
        // Oldest first: each conversation's events reach its fold in the order they happened.
        missing.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.raw.cmp(&b.1.raw)));
        report.missing = missing.len() as u64;
        report.oldest_missing_at = missing.first().map(|(at, _)| *at);
        report.stored = self.hand_over(missing, started).await?;
        self.metrics.backfill_events.inc_by(report.stored);
        self.watch.count(report.stored);
        report.silent = self.note_silence(&report, oldest_message, started);

        // Up to where everything is known now. Messages come oldest first: when their list was
        // cut short the next pass starts at the newest one read (its `from` is the cursor minus
        // the overlap). The conversations' list is in no time order: cut short, what it did not
        // show is not inferred (their messages still are).
        if !conv_full {
            tracing::warn!(
                read = report.conversations_read,
                "more conversations changed than one backfill pass reads: changes of the others are not inferred"
            );
        }
        let newest_read = messages.iter().filter_map(|m| m.timestamp).max();
        let next = next_cursor(
            cursor,
            to,
            msg_full,
            newest_read,
            millis(self.settings.overlap),
        );
        self.blocking(move |s| s.set_backfill_cursor(next)).await?;
        // Durable before the pass is done (the writer's indexer is the one that flushes).
        self.writer.flush().await?;
        if report.stored > 0 {
            tracing::info!(
                stored = report.stored,
                missing = report.missing,
                from,
                to,
                "backfilled events the webhook had not delivered"
            );
        }
        Ok(report)
    }

    /// What the pass needs of the state of every conversation named, read once (not the states
    /// themselves: a pass may name thousands).
    async fn known_states(
        &self,
        conversations: &[Conversation],
        messages: &[Message],
    ) -> Result<HashMap<ConversationId, Option<Known>>, BackfillError> {
        let mut named: HashMap<ConversationId, Vec<String>> = conversations
            .iter()
            .map(|c| (c.id.clone(), Vec::new()))
            .collect();
        for m in messages {
            named
                .entry(m.conversation_id.clone())
                .or_default()
                .push(m.id.clone());
        }
        self.blocking(move |s| {
            named
                .into_iter()
                .map(|(id, listed)| {
                    let known = s.conversation(&id)?.map(|st| Known::of(&st, &listed));
                    Ok((id, known))
                })
                .collect()
        })
        .await
    }

    /// A message of a conversation the bridge has no state for and the list did not show
    /// (changed before the window): read the conversation itself, for its bot and end user.
    async fn read_unseen(
        &self,
        conversations: &mut Vec<Conversation>,
        messages: &[Message],
        states: &HashMap<ConversationId, Option<Known>>,
    ) -> Result<(), BackfillError> {
        let listed_ids: std::collections::HashSet<&ConversationId> =
            conversations.iter().map(|c| &c.id).collect();
        let mut unseen: Vec<ConversationId> = messages
            .iter()
            .map(|m| &m.conversation_id)
            .filter(|id| !matches!(states.get(*id), Some(Some(_))))
            .filter(|id| !listed_ids.contains(*id))
            .cloned()
            .collect();
        drop(listed_ids);
        unseen.sort();
        unseen.dedup();
        for id in unseen {
            self.limit.wait().await;
            match self.api.get_conversation(id.as_str()).await {
                Ok(c) => conversations.push(c),
                // Gone at the service: its messages are still folded, under an unknown bot.
                Err(UpstreamError::Status { status: 404, .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Silence: messages the webhook should have brought, missing for longer than
    /// `silence_alert_after` with no delivery since (a delivery during this pass means the
    /// webhook works, and what the pass found was only late). Whether the webhook is silent.
    fn note_silence(
        &self,
        report: &BackfillReport,
        oldest_message: Option<Millis>,
        started: Millis,
    ) -> bool {
        let silence_after = millis(self.settings.silence_alert_after);
        let Some(first) = self.watch.missing(oldest_message, started) else {
            return false;
        };
        if started.saturating_sub(first) <= silence_after {
            return false;
        }
        if self.watch.silent(first) {
            tracing::warn!(
                missing = report.missing,
                first_missing_at = first,
                "the webhook has not delivered messages for longer than \
                 backfill.silence_alert_after: the service may have disabled the webhook \
                 after failed deliveries: re-enable it in the bot's webhook settings"
            );
        }
        true
    }

    async fn messages(
        &self,
        from: Millis,
        to: Millis,
    ) -> Result<(Vec<Message>, bool), BackfillError> {
        let (api, limit) = (&self.api, &self.limit);
        read_pages(|page| async move {
            limit.wait().await;
            let q = MessagesQuery {
                page,
                from: Some(from),
                to: Some(to),
                ..MessagesQuery::default()
            };
            api.list_messages(&q).await
        })
        .await
    }

    async fn conversations(
        &self,
        from: Millis,
        to: Millis,
    ) -> Result<(Vec<Conversation>, bool), BackfillError> {
        let (api, limit) = (&self.api, &self.limit);
        read_pages(|page| async move {
            limit.wait().await;
            let q = ConversationsQuery {
                page,
                from: Some(from),
                to: Some(to),
                ..ConversationsQuery::default()
            };
            api.list_conversations(&q).await
        })
        .await
    }

    /// Hand the events to the writer in jobs; returns how many were new to the store.
    async fn hand_over(
        &self,
        events: Vec<(Millis, IncomingEvent)>,
        now: Millis,
    ) -> Result<u64, BackfillError> {
        let mut stored = 0u64;
        let mut events = events.into_iter().map(|(_, e)| e).peekable();
        let mut n = 0u32;
        while events.peek().is_some() {
            let chunk: Vec<IncomingEvent> = events.by_ref().take(JOB_EVENTS).collect();
            n += 1;
            let job = AcceptJob {
                delivery: DeliveryId::new(
                    model::ids::Internal::Backfill.id(format_args!("pass:{now}:{n}")),
                ),
                events: chunk,
                invalid: Vec::new(),
                received_at: now,
            };
            let accepted = self.writer.accept(job).await?;
            stored += accepted.new.len() as u64;
        }
        Ok(stored)
    }

    /// A store call on the blocking pool (sled calls may wait for its lock).
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, BackfillError> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|e| BackfillError::Join(e.to_string()))?
            .map_err(BackfillError::from)
    }
}

/// Read a list page by page (`PAGE_LIMIT` items each), at most `MAX_PAGES`; the items and
/// whether the list was read to its end.
async fn read_pages<T, F, Fut>(mut read: F) -> Result<(Vec<T>, bool), BackfillError>
where
    F: FnMut(PageQuery) -> Fut,
    Fut: std::future::Future<Output = Result<Page<T>, UpstreamError>>,
{
    let mut out = Vec::new();
    for page in 0..MAX_PAGES {
        let answer = read(PageQuery {
            offset: Some(page * PAGE_LIMIT),
            limit: Some(PAGE_LIMIT),
        })
        .await?;
        let n = answer.data.len() as u64;
        out.extend(answer.data);
        if n == 0 || out.len() as u64 >= answer.paging.total {
            return Ok((out, true));
        }
    }
    Ok((out, false))
}

/// Where the next pass reads from (before its overlap): the end of this pass's window, or, when
/// the messages' list was cut short, the newest message read (plus the overlap the next pass
/// What a pass read (the service's lists, the conversations' known states), from which it
/// finds what the webhook did not deliver.
struct Found<'a> {
    conversations: &'a [Conversation],
    messages: &'a [Message],
    states: &'a HashMap<ConversationId, Option<Known>>,
    /// The listed conversations by id.
    listed: HashMap<&'a ConversationId, &'a Conversation>,
}

impl<'a> Found<'a> {
    fn new(
        conversations: &'a [Conversation],
        messages: &'a [Message],
        states: &'a HashMap<ConversationId, Option<Known>>,
    ) -> Self {
        let listed = conversations.iter().map(|c| (&c.id, c)).collect();
        Found {
            conversations,
            messages,
            states,
            listed,
        }
    }

    /// The conversation's bot: as the bridge knows it, else as the service listed it.
    fn bot_of(&self, id: &ConversationId) -> String {
        self.states
            .get(id)
            .and_then(|s| s.as_ref())
            .and_then(|s| s.bot_id.as_ref())
            .or_else(|| self.listed.get(id).and_then(|c| c.bot_id.as_ref()))
            .map_or(NO_BOT.to_owned(), |b| b.as_str().to_owned())
    }

    /// The events the webhook did not deliver (messages the bridge does not know, and the
    /// changes of conversations it missed), each at its time; and the oldest missing message's.
    fn missing(&self, to: Millis, silent: bool) -> (Vec<(Millis, IncomingEvent)>, Option<Millis>) {
        let mut missing: Vec<(Millis, IncomingEvent)> = Vec::new();
        let mut with_missing: std::collections::HashSet<&ConversationId> = Default::default();
        let mut oldest_message: Option<Millis> = None;
        for m in self.messages {
            let known = self
                .states
                .get(&m.conversation_id)
                .and_then(|s| s.as_ref())
                .is_some_and(|s| s.messages.contains(&m.id));
            if known {
                continue;
            }
            let at = m.timestamp.unwrap_or(to);
            match model::webhook::backfill_message_event(m, &self.bot_of(&m.conversation_id), at) {
                Ok(event) => {
                    with_missing.insert(&m.conversation_id);
                    oldest_message = Some(oldest_message.map_or(at, |o| o.min(at)));
                    missing.push((at, event));
                }
                Err(e) => {
                    tracing::warn!(error = %e, conversation_id = %m.conversation_id, "a listed message cannot be backfilled")
                }
            }
        }
        // A conversation's change is inferred only where the webhook demonstrably missed
        // something (messages of it missing, the webhook silent) or the bridge never heard of
        // it: changes the service makes without a webhook (the bridge's own API calls, the
        // builder) are the reconciliation sweeper's.
        for c in self.conversations {
            let Some(updated) = updated_ms(c) else {
                continue;
            };
            let state = self.states.get(&c.id).and_then(|s| s.as_ref());
            let missed = silent || state.is_none() || with_missing.contains(&c.id);
            if !missed || !differs(state, c, updated) {
                continue;
            }
            match model::webhook::backfill_conversation_event(c, &self.bot_of(&c.id), updated) {
                Ok(event) => missing.push((updated, event)),
                Err(e) => {
                    tracing::warn!(error = %e, conversation_id = %c.id, "a listed conversation cannot be backfilled")
                }
            }
        }
        (missing, oldest_message)
    }
}

/// takes off again), never behind the cursor nor past the window.
fn next_cursor(
    cursor: Millis,
    to: Millis,
    complete: bool,
    newest_read: Option<Millis>,
    overlap: Millis,
) -> Millis {
    if complete {
        return to;
    }
    newest_read
        .map_or(cursor, |n| n.saturating_add(overlap))
        .max(cursor)
        .min(to)
}

/// `updatedAt` of a listed conversation, in ms.
fn updated_ms(c: &Conversation) -> Option<Millis> {
    c.updated_at
        .as_deref()
        .and_then(|t| model::clock::parse_iso_millis(t).ok())
}

/// What a pass needs of a conversation's state: its bot, which of the listed messages it knows,
/// and what [`differs`] compares.
struct Known {
    bot_id: Option<model::ids::BotId>,
    /// The listed messages of the conversation the state knows (by their own ids).
    messages: std::collections::HashSet<String>,
    last_event_at: Millis,
    manual_status: Option<String>,
    params: serde_json::Map<String, Value>,
    navigation: model::webhook::model::Navigation,
}

impl Known {
    fn of(state: &ConversationState, listed: &[String]) -> Self {
        Known {
            bot_id: state.bot_id.clone(),
            messages: listed
                .iter()
                .filter(|id| state.knows_message(id))
                .cloned()
                .collect(),
            last_event_at: state.last_event_at,
            manual_status: state.manual_status.value.clone(),
            params: state.params.value.clone(),
            navigation: state.navigation.value.clone(),
        }
    }
}

/// Whether a conversation the service shows changed after the bridge last heard of it, in what
/// the Open API shows of it (manual status, params, navigation). A conversation the bridge has
/// no state for counts as changed (its messages are being backfilled too).
fn differs(state: Option<&Known>, c: &Conversation, updated: Millis) -> bool {
    let Some(state) = state else {
        return true;
    };
    if state.last_event_at >= updated {
        return false;
    }
    let manual = c.manual_status().map(str::to_owned);
    let params_differ = c.params.as_ref().is_some_and(|p| *p != state.params);
    let nav_differs = c
        .effective_navigation()
        .is_some_and(|n| *n != state.navigation);
    manual != state.manual_status || params_differ || nav_differs
}

/// Start the periodic passes on the current runtime, in each of `terms` (this node as the active
/// one; a term's first pass at once); `None` when `backfill.interval` is off.
pub fn start(
    backfill: Backfill,
    terms: crate::cluster::Terms,
) -> Option<tokio::task::JoinHandle<()>> {
    if backfill.settings.interval.is_zero() {
        tracing::info!("backfill passes are off (backfill.interval = 0)");
        return None;
    }
    Some(tokio::spawn(crate::cluster::each_term(
        terms,
        move |stop| run(backfill.clone(), stop),
    )))
}

/// [`start`]'s passes until `stop` turns true.
async fn run(backfill: Backfill, mut stop: watch::Receiver<bool>) {
    let interval = backfill.settings.interval;
    {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut waiting = false;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                changed = stop.changed() => if changed.is_err() || *stop.borrow() { break },
            }
            if *stop.borrow() {
                break;
            }
            if backfill.executor.openapi_down() {
                // The service is down (the outbox's circuit is open): the reads would only fail.
                // The cursor stays, so the first pass after recovery reads the whole gap.
                if !waiting {
                    tracing::info!("backfill passes wait: the Open API's circuit is open");
                    waiting = true;
                }
                continue;
            }
            waiting = false;
            // A pass cut off by the stop is harmless: what it handed over is stored, its cursor
            // did not move, and the next start reads the window again (dedupe absorbs it).
            tokio::select! {
                done = backfill.pass() => if let Err(e) = done {
                    tracing::warn!(error = %e, "backfill pass failed; the next pass tries again");
                },
                _ = stop.changed() => break,
            }
        }
        tracing::info!("backfill stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conversation(manual: Option<&str>, updated: &str) -> Conversation {
        let manual = manual.map_or(String::new(), |m| {
            format!(r#","context":{{"manual":{{"status":"{m}"}}}}"#)
        });
        serde_json::from_str(&format!(
            r#"{{"id":"c1","botId":"B1","updatedAt":"{updated}"{manual}}}"#
        ))
        .expect("conversation")
    }

    #[test]
    fn a_conversation_differs_only_when_changed_after_the_bridge_last_heard_of_it() {
        let c = conversation(Some("HANDOVER"), "2026-01-01T00:00:10.000Z");
        let updated = updated_ms(&c).expect("updatedAt");
        assert!(differs(None, &c, updated), "unknown to the bridge");
        let mut state = ConversationState::new("c1".into());
        state.last_event_at = updated - 1;
        assert!(
            differs(Some(&Known::of(&state, &[])), &c, updated),
            "manual on at the service only"
        );
        state.manual_status.value = Some("HANDOVER".into());
        assert!(
            !differs(Some(&Known::of(&state, &[])), &c, updated),
            "the same manual status"
        );
        state.manual_status.value = None;
        state.last_event_at = updated;
        assert!(
            !differs(Some(&Known::of(&state, &[])), &c, updated),
            "the bridge heard of it since"
        );
    }

    /// A list of `total` items served a page at a time; the offsets asked for.
    async fn read_list(total: u64) -> (Vec<u64>, bool, Vec<u32>) {
        let asked = std::cell::RefCell::new(Vec::new());
        let (items, complete) = read_pages(|q| {
            let offset = q.offset.unwrap_or(0);
            let limit = q.limit.unwrap_or(0);
            asked.borrow_mut().push(offset);
            async move {
                let data: Vec<u64> = (u64::from(offset)..total).take(limit as usize).collect();
                Ok(Page {
                    data,
                    paging: model::contract::Paging {
                        offset,
                        limit,
                        total,
                    },
                })
            }
        })
        .await
        .expect("read");
        (items, complete, asked.into_inner())
    }

    #[tokio::test]
    async fn lists_are_read_page_by_page_up_to_the_pages_a_pass_reads() {
        let (items, complete, asked) = read_list(250).await;
        assert_eq!(items, (0..250).collect::<Vec<_>>());
        assert!(complete);
        assert_eq!(asked, [0, 100, 200]);
        let (items, complete, asked) = read_list(0).await;
        assert!(items.is_empty() && complete);
        assert_eq!(asked, [0]);
        let (items, complete, asked) = read_list(u64::from(MAX_PAGES * PAGE_LIMIT) + 1).await;
        assert_eq!(items.len() as u32, MAX_PAGES * PAGE_LIMIT);
        assert!(!complete, "cut short");
        assert_eq!(asked.len() as u32, MAX_PAGES);
    }

    #[test]
    fn backfill_reads_at_most_half_the_global_rate() {
        let mut c = crate::config::Config::load_from(
            None,
            Vec::<(String, String)>::new(),
            &crate::config::Overrides::default(),
        )
        .expect("defaults")
        .backfill;
        c.per_second = 5.0;
        assert_eq!(Settings::from_config(&c, 50.0).per_second, 5.0);
        assert_eq!(Settings::from_config(&c, 4.0).per_second, 2.0);
    }

    #[test]
    fn a_pass_keeps_of_a_state_only_the_listed_messages_it_knows() {
        let mut state = ConversationState::new("c1".into());
        state.messages.recent_ids = ["m1", "m2", "m3"]
            .iter()
            .map(|id| engine::state::SeenMessage {
                at: 1,
                id: (*id).into(),
            })
            .collect();
        let known = Known::of(&state, &["m2".into(), "m9".into()]);
        assert_eq!(
            known.messages,
            std::collections::HashSet::from(["m2".to_owned()])
        );
    }

    #[test]
    fn a_pass_cut_short_moves_the_cursor_only_as_far_as_it_read() {
        assert_eq!(next_cursor(1_000, 9_000, true, Some(5_000), 100), 9_000);
        // The next pass reads from the newest message read (its from = cursor - overlap).
        assert_eq!(next_cursor(1_000, 9_000, false, Some(5_000), 100), 5_100);
        assert_eq!(next_cursor(1_000, 9_000, false, None, 100), 1_000);
        assert_eq!(
            next_cursor(1_000, 9_000, false, Some(500), 100),
            1_000,
            "never back"
        );
        assert_eq!(
            next_cursor(1_000, 9_000, false, Some(8_950), 100),
            9_000,
            "never past"
        );
        // A clock stepped back: no panic, the window's end.
        assert_eq!(next_cursor(10_000, 9_000, false, Some(5_000), 100), 9_000);
    }

    #[test]
    fn the_watch_goes_silent_once_and_a_delivery_ends_it() {
        let metrics = Metrics::new().expect("metrics");
        let watch = WebhookWatch::new(&metrics);
        assert_eq!(watch.detail()["silent"], false);
        assert_eq!(watch.missing(Some(1_000), 2_000), Some(1_000));
        assert_eq!(watch.missing(Some(1_500), 2_500), Some(1_000), "the oldest");
        assert_eq!(
            watch.missing(None, 3_000),
            Some(1_000),
            "kept until a delivery"
        );
        assert!(watch.silent(1_000), "starts the silence");
        assert!(!watch.silent(2_000), "already silent");
        assert_eq!(metrics.webhook_silent.get(), 1);
        assert_eq!(watch.detail()["since"], 1_000);
        watch.count(3);
        watch.arrived(5_000);
        assert!(!watch.is_silent());
        assert_eq!(metrics.webhook_silent.get(), 0);
        assert_eq!(watch.detail()["since"], Value::Null);
        assert_eq!(watch.detail()["backfilled"], 3);
        assert_eq!(watch.last_delivery_at(), 5_000);
        assert_eq!(
            watch.missing(None, 6_000),
            None,
            "a delivery forgets what was missing"
        );
        assert_eq!(
            watch.missing(Some(5_500), 5_000),
            None,
            "a delivery since the pass began: only late"
        );
    }
}
