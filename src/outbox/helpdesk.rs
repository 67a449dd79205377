//! The help-desk sink: a help-desk event built once (state, source event, transcript) and kept
//! between attempts, signed and POSTed to every endpoint that takes its kind and has not taken
//! it yet, each endpoint its own destination (`helpdesk:<name>`, its own circuit): an endpoint
//! whose circuit is open does not hold back the others; the entry is done when every target
//! took it.

use super::sink::{Attempt, Dead, Job, Reach, Report, Sink, Transient};
use crate::helpdesk::events::{self as hd_events, Transcript};
use crate::helpdesk::port::{DeskEvent, DeskTarget};
use crate::helpdesk::{DeskError, Desks};
use crate::ops::metrics::Metrics;
use futures_util::future::BoxFuture;
use model::action::{Action, OutboxEntry};
use model::helpdesk::DeskEventKind;
use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};
use storage::Store;
use upstream::api::OpenApi;
use upstream::handle::UpstreamHandle;

pub struct HelpdeskSink {
    helpdesk: Arc<Desks>,
    api: OpenApi<UpstreamHandle>,
    store: Store,
    metrics: Metrics,
    /// Help-desk events between attempts, by entry id. Kept in memory: after a restart the event
    /// is built and sent again under the same `webhook-id`, which the help desk dedupes.
    deliveries: Mutex<HashMap<String, Delivery>>,
}

#[derive(Default)]
struct Delivery {
    /// The event, built once so every attempt sends the same.
    event: Option<Arc<DeskEvent>>,
    /// Destinations that took it already (not sent to again on a retry).
    delivered: HashSet<String>,
}

impl Sink for HelpdeskSink {
    fn destinations(&self, entry: &OutboxEntry) -> Vec<String> {
        let Action::NotifyHelpdesk { kind, .. } = &entry.action else {
            return Vec::new();
        };
        let Some(kind) = DeskEventKind::parse(kind) else {
            return Vec::new();
        };
        if !self.helpdesk.is_configured() {
            return Vec::new();
        }
        let deliveries = self.deliveries.lock().unwrap_or_else(|e| e.into_inner());
        let delivered = deliveries.get(&entry.id).map(|d| &d.delivered);
        self.helpdesk
            .targets(kind)
            .into_iter()
            .map(|t| t.destination())
            .filter(|d| !delivered.is_some_and(|done| done.contains(d)))
            .collect()
    }

    fn attempt<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Report> {
        Box::pin(async move {
            let mut d = self
                .deliveries
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&job.entry.id)
                .unwrap_or_default();
            let report = self.deliver(job, &mut d).await;
            if matches!(report.attempt, Attempt::Retry { .. } | Attempt::Held) {
                self.deliveries
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(job.entry.id.clone(), d);
            }
            report
        })
    }

    fn forget(&self, entry: &OutboxEntry) {
        self.deliveries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&entry.id);
    }
}

impl HelpdeskSink {
    pub fn new(
        helpdesk: Arc<Desks>,
        api: OpenApi<UpstreamHandle>,
        store: Store,
        metrics: Metrics,
    ) -> Self {
        HelpdeskSink {
            helpdesk,
            api,
            store,
            metrics,
            deliveries: Mutex::new(HashMap::new()),
        }
    }

    /// The targets' destination names.
    pub fn destinations_known(&self) -> Vec<String> {
        self.helpdesk.destinations()
    }

    /// One attempt at a help-desk event, to the targets its circuits allow.
    async fn deliver(&self, job: &Job, d: &mut Delivery) -> Report {
        let entry = &job.entry;
        let Action::NotifyHelpdesk { kind, .. } = &entry.action else {
            return dead("invalid_call", "not a help-desk event".into());
        };
        let targets = match self.targets_left(kind, d) {
            ControlFlow::Continue(targets) => targets,
            ControlFlow::Break(report) => return report,
        };
        let (now_targets, later): (Vec<_>, Vec<_>) = targets
            .into_iter()
            .partition(|t| job.allowed.contains(&t.destination()));
        let event = match &d.event {
            Some(event) => event.clone(),
            None => {
                let Some(built) = self.desk_event(entry).await else {
                    return Report::new(Attempt::Done, "skipped");
                };
                let built = Arc::new(built);
                d.event = Some(built.clone());
                built
            }
        };
        // An earlier attempt failed: a call of it may have taken effect.
        let again = job.state.attempts > 0;
        let posted = self.post_to(&now_targets, &event, again, d).await;
        posted.report(job, !now_targets.is_empty(), !later.is_empty())
    }

    /// The targets that take `kind` and have not taken the event yet, or the attempt's report
    /// when none is left (an unknown kind, no help desk, no target for it, every one took it).
    fn targets_left(
        &self,
        kind: &str,
        d: &Delivery,
    ) -> ControlFlow<Report, Vec<Arc<dyn DeskTarget>>> {
        let Some(kind) = DeskEventKind::parse(kind) else {
            // Rules refuse unknown kinds at load; this is an entry from an older rule set.
            return ControlFlow::Break(dead(
                "unknown_event_kind",
                format!(
                    "`{kind}` is not a help-desk event kind ({})",
                    DeskEventKind::names()
                ),
            ));
        };
        if !self.helpdesk.is_configured() {
            tracing::debug!(kind = %kind.as_str(), "no help desk configured; the event is recorded as done");
            return ControlFlow::Break(Report::new(Attempt::Done, "no_helpdesk"));
        }
        let targets: Vec<_> = self
            .helpdesk
            .targets(kind)
            .into_iter()
            .filter(|t| !d.delivered.contains(&t.destination()))
            .collect();
        if targets.is_empty() {
            if d.delivered.is_empty() {
                tracing::debug!(kind = %kind.as_str(), "no help-desk endpoint takes this kind; recorded as done");
                return ControlFlow::Break(Report::new(Attempt::Done, "no_endpoint"));
            }
            return ControlFlow::Break(Report::delivered());
        }
        ControlFlow::Continue(targets)
    }

    /// Give the event to each of `targets` in turn, counting each outcome; a target that took it
    /// is added to `d.delivered`.
    async fn post_to(
        &self,
        targets: &[Arc<dyn DeskTarget>],
        event: &DeskEvent,
        again: bool,
        d: &mut Delivery,
    ) -> Posted {
        let mut posted = Posted::default();
        for target in targets {
            let name = target.name();
            let result = target.deliver(event, again).await;
            let outcome = match &result {
                Ok(()) => "delivered".to_owned(),
                Err(e) => e.outcome(),
            };
            self.metrics
                .helpdesk_deliveries
                .with_label_values(&[name, &outcome])
                .inc();
            let destination = target.destination();
            match result {
                Ok(()) => {
                    tracing::info!(endpoint = %name, kind = %event.kind.as_str(), "help-desk event delivered");
                    d.delivered.insert(destination.clone());
                    posted.reached.push((destination, Reach::Answered));
                }
                Err(e) if !e.is_transient() => {
                    posted.reached.push((destination, Reach::Answered));
                    posted.refused.get_or_insert((e, target.reason_prefix()));
                }
                Err(e) => {
                    posted.reached.push((destination, Reach::Failed));
                    posted.unavailable.get_or_insert(e);
                }
            }
        }
        posted
    }

    /// The event as the targets receive it: the conversation's state, the source event's message
    /// and (for `handoff.requested`) the transcript and queue standing. `None`: not to be sent (a
    /// bot's message while `helpdesk.bot_messages` is off).
    async fn desk_event(&self, entry: &OutboxEntry) -> Option<DeskEvent> {
        let Action::NotifyHelpdesk {
            conversation_id,
            kind,
            reason,
            payload,
        } = &entry.action
        else {
            return None;
        };
        let kind = DeskEventKind::parse(kind)?;
        // A state that cannot be read leaves its part out: the help desk still learns of the
        // event, which matters more than its details.
        let mut conversation = self
            .store
            .conversation(conversation_id)
            .inspect_err(|e| tracing::warn!(error = %e, "cannot read the conversation's state for a help-desk event"))
            .ok()
            .flatten();
        let mut end_user = conversation
            .as_ref()
            .and_then(|c| c.end_user_id.as_ref())
            .and_then(|id| self.store.end_user(id).ok().flatten());
        let requested = kind == DeskEventKind::HandoffRequested;
        if requested {
            self.complete_from_api(conversation_id, &mut conversation, &mut end_user)
                .await;
        }
        let message = match kind {
            DeskEventKind::ConversationMessage => self.source_message(entry),
            _ => None,
        };
        if let Some(m) = &message {
            if m.sender() == model::webhook::model::Sender::Bot && !self.helpdesk.bot_messages {
                tracing::debug!("a bot message; helpdesk.bot_messages is off");
                return None;
            }
        }
        let (transcript, queue) = if requested {
            (
                Some(self.transcript(conversation_id).await),
                Some(self.helpdesk.queue.queue_info(conversation_id)),
            )
        } else {
            (None, None)
        };
        let source = hd_events::Source {
            kind: kind.as_str(),
            occurred_at: entry.received_at,
            conversation_id,
            conversation: conversation.as_ref(),
            end_user: end_user.as_ref(),
            event_id: entry.event_id.as_str(),
            rule: &entry.rule,
            action_id: &entry.id,
            reason: reason.as_deref(),
            payload,
            message: message.as_ref(),
            transcript: transcript.as_ref(),
            queue,
        };
        let body = serde_json::to_vec(&hd_events::body(&source)).ok()?;
        Some(DeskEvent {
            action_id: entry.id.clone(),
            kind,
            occurred_at: entry.received_at,
            conversation_id: conversation_id.clone(),
            conversation,
            end_user,
            reason: reason.clone(),
            payload: payload.clone(),
            message,
            transcript,
            queue,
            body,
        })
    }

    /// The context packet needs who the user is, which the state lacks when the bridge has seen
    /// only messages of the conversation: what is missing is read through the Open API (a
    /// failure leaves it out).
    async fn complete_from_api(
        &self,
        conversation_id: &model::ids::ConversationId,
        conversation: &mut Option<engine::state::ConversationState>,
        end_user: &mut Option<engine::state::EndUserState>,
    ) {
        let known = conversation
            .as_ref()
            .is_some_and(|c| c.platform.is_some() && c.user_key.is_some());
        if !known {
            match self.api.get_conversation(conversation_id.as_str()).await {
                Ok(fetched) => {
                    let state = conversation.get_or_insert_with(|| {
                        engine::state::ConversationState::new(conversation_id.clone())
                    });
                    state.bot_id = state.bot_id.take().or(fetched.bot_id);
                    state.end_user_id = state.end_user_id.take().or(fetched.end_user_id);
                    state.platform = state.platform.take().or(fetched.platform);
                    state.user_key = state.user_key.take().or(fetched.user_key);
                    if state.params.value.is_empty() {
                        state.params.value = fetched.params.unwrap_or_default();
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the conversation for a help-desk event")
                }
            }
        }
        if end_user.is_some() {
            return;
        }
        let Some(id) = conversation.as_ref().and_then(|c| c.end_user_id.clone()) else {
            return;
        };
        match self.api.get_end_user(id.as_str()).await {
            Ok(fetched) => {
                let mut state = engine::state::EndUserState::new(id);
                state.bot_id = fetched.bot_id;
                state.platform = Some(fetched.platform);
                state.user_key = Some(fetched.user_key);
                state.params.value = fetched.params.unwrap_or_default();
                *end_user = Some(state);
            }
            Err(e) => tracing::warn!(error = %e, "cannot read the end user for a help-desk event"),
        }
    }

    /// The message of the webhook event that decided the entry, if it was a message event.
    fn source_message(&self, entry: &OutboxEntry) -> Option<model::webhook::model::Message> {
        let record = self.store.event_by_id(&entry.event_id).ok().flatten()?;
        if !record.kind.starts_with("bot.message.") {
            return None;
        }
        let mut event: serde_json::Value = serde_json::from_str(record.event.get()).ok()?;
        let message = event.get_mut("data")?.get_mut("message")?.take();
        serde_json::from_value(message).ok()
    }

    /// The conversation's last `helpdesk.transcript_messages` messages, oldest first. The Open
    /// API lists oldest first, so past one page the last page is asked for by offset.
    async fn transcript(&self, conversation_id: &model::ids::ConversationId) -> Transcript {
        use model::contract::{MessagesQuery, PageQuery};
        let n = self.helpdesk.transcript_messages;
        if n == 0 {
            return Transcript {
                messages: Vec::new(),
                complete: true,
            };
        }
        let query = |offset: Option<u32>| MessagesQuery {
            page: PageQuery {
                offset,
                limit: Some(n),
            },
            conversation_id: Some(conversation_id.as_str().to_owned()),
            ..MessagesQuery::default()
        };
        let messages =
            |page: &model::contract::Page<model::webhook::model::Message>| page.data.clone();
        let first = match self.api.list_messages(&query(None)).await {
            Ok(page) => page,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the transcript for a help-desk event");
                return Transcript::default();
            }
        };
        let total = first.paging.total;
        if total <= u64::from(n) {
            return Transcript {
                messages: messages(&first),
                complete: true,
            };
        }
        let offset = u32::try_from(total - u64::from(n)).unwrap_or(u32::MAX);
        match self.api.list_messages(&query(Some(offset))).await {
            Ok(last) => Transcript {
                messages: messages(&last),
                complete: true,
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the end of the transcript for a help-desk event");
                Transcript {
                    messages: Vec::new(),
                    complete: false,
                }
            }
        }
    }
}

/// A dead letter's report: the event is not to be sent again.
fn dead(reason: &str, error: String) -> Report {
    Report::new(
        Attempt::Dead(Dead {
            reason: reason.to_owned(),
            error,
            // The help desk keeps no answer under the id: a retry keeps it, so a help desk that
            // took it from another attempt still dedupes.
            answered: false,
        }),
        reason,
    )
}

/// What one attempt's POSTs came to: each endpoint's reach, and the first refusal and the first
/// failure to reach one.
#[derive(Default)]
struct Posted {
    reached: Vec<(String, Reach)>,
    /// The first refusal, with its target's reason prefix.
    refused: Option<(DeskError, &'static str)>,
    unavailable: Option<DeskError>,
}

impl Posted {
    /// The attempt's report: dead on a refusal, else a retry on a failure, else held while
    /// endpoints not allowed now (`held`) still need it, else delivered. `attempted`: something
    /// was posted.
    fn report(self, job: &Job, attempted: bool, held: bool) -> Report {
        let Posted {
            reached,
            refused,
            unavailable,
        } = self;
        let mut report = if let Some((e, prefix)) = refused {
            dead(&format!("{prefix}_{}", e.outcome()), e.to_string())
        } else if let Some(e) = unavailable {
            let status = e.outcome();
            // Warned once per event; the attempts after it (up to a day of them) are counted in
            // the metrics and logged at debug.
            if job.state.failures == 0 {
                tracing::warn!(error = %e, "help desk unavailable; the event and its conversation's next ones wait");
            } else {
                tracing::debug!(error = %e, failures = job.state.failures, "help desk still unavailable");
            }
            let failure = Transient::Helpdesk(e);
            Report::new(
                Attempt::Retry {
                    after: failure.retry_after(),
                    failure,
                },
                status,
            )
        } else if held {
            let mut r = Report::new(Attempt::Held, "held");
            r.attempted = attempted;
            r
        } else {
            Report::delivered()
        };
        report.reached = reached;
        report
    }
}
