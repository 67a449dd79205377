//! The one path of an agent command, whichever desk it comes from (the agent API, the console,
//! a connector's webhook): built against the conversation's state (the 400s, 404s and 422s),
//! stored as an `agent.<command>` event of its conversation through the writer (durable, deduped,
//! folded in order with the conversation's own events), and, for callers that answer from it,
//! the fold's verdict awaited and the answer kept for the caller's `Idempotency-Key`.
//!
//! - [`Commands::answer`]: the agent API's and the console's way (key, idempotent answer,
//!   verdict);
//! - [`Commands::store`]: a connector's way (its delivery id makes the event ids, so a delivery
//!   posted twice is stored once; nothing waits for the fold);
//! - [`Commands::conversation`], [`Commands::message_command`], [`Commands::partner_user`]: what
//!   every builder resolves (a reply goes through the partner channel on KakaoTalk).

mod console;
mod waiters;

pub use console::ConsoleCommand;
pub use waiters::{Waiter, Waiters};

use crate::config::helpdesk::PartnerConfig;
use crate::helpdesk::agent_api::dto::{AgentBody, CommandAnswer};
use crate::helpdesk::idempotency::{Claim, InProgress};
use actix_web::http::StatusCode;
use api_error::ApiError;
use engine::state::desk::{Outcome, Rejection, Verdict};
use engine::state::ConversationState;
use model::ids::{ConversationId, DeliveryId};
use model::webhook::agent::{AgentCommand, Command, DeskAgent, PartnerUser, Target};
use model::webhook::model::{MessageData, Platform};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use storage::idempotency::IdempotencyRecord;
use storage::AcceptJob;

/// What the command path needs besides the store and the writer.
#[derive(Clone, Debug)]
pub struct Settings {
    /// `helpdesk.command_timeout`: how long a caller waits for its verdict.
    pub command_timeout: Duration,
    /// `helpdesk.release_flow`: where a release without a flow sends the conversation.
    pub release_flow: String,
    /// `helpdesk.partner`: each bot's partner-messenger channel.
    pub partner: PartnerConfig,
    /// Several nodes on one store: a command may be folded on another node (the active one),
    /// whose verdict this node reads from the store this often while it waits. `None`: every
    /// fold is this node's, and its waiters are told.
    pub verdicts_elsewhere: Option<Duration>,
}

impl Settings {
    pub fn of(config: &crate::config::HelpdeskConfig) -> Self {
        Settings {
            command_timeout: config.command_timeout,
            release_flow: config.release_flow.clone(),
            partner: config.partner.clone(),
            verdicts_elsewhere: None,
        }
    }
}

/// The command path: shared by every desk's inbound side.
pub struct Commands {
    store: storage::Store,
    writer: storage::Writer,
    waiters: Arc<Waiters>,
    in_progress: Arc<InProgress>,
    settings: Settings,
}

/// An answer, as sent and as kept for idempotent retries.
pub struct Answer {
    pub status: StatusCode,
    pub body: Value,
}

impl From<ApiError> for Answer {
    fn from(e: ApiError) -> Self {
        Answer {
            status: e.status,
            body: e.body(),
        }
    }
}

/// A built command: the state it was judged against and the command.
pub type Built = (ConversationState, Command);

/// One command of a connector's delivery, with its event id (made from the delivery's).
pub struct Stored {
    pub event_id: String,
    pub state: ConversationState,
    pub command: Command,
}
impl Commands {
    pub fn new(
        settings: Settings,
        store: storage::Store,
        writer: storage::Writer,
        waiters: Arc<Waiters>,
        in_progress: Arc<InProgress>,
    ) -> Self {
        Commands {
            store,
            writer,
            waiters,
            in_progress,
            settings,
        }
    }

    /// Claim `route`'s `key` while its call is answered; `None` while another call holds it.
    pub fn claim(&self, route: &str, key: &str) -> Option<Claim> {
        self.in_progress.claim(route, key)
    }

    /// Answer a command: the answer kept for `key` when this is a retry, else build it (`build`
    /// validates and resolves: the 400s and 404s), store it as an event, wait for its verdict and
    /// keep the answer for `key`. `share` (the body's part of the in-flight budget) is given back
    /// once the command is built. Returns the answer and whether it was a retry's.
    pub async fn answer(
        self: &Arc<Self>,
        route: &'static str,
        request: String,
        key: Option<String>,
        share: Option<crate::body_budget::Share>,
        build: impl FnOnce(&Commands) -> Result<Built, ApiError> + Send + 'static,
    ) -> (Answer, bool) {
        if let Some(key) = key.clone() {
            match self.kept_answer(route, key, &request).await {
                Ok(Some(kept)) => return (kept, true),
                Ok(None) => {}
                Err(e) => return (e.into(), false),
            }
        }
        // Only a command that was stored has an answer to keep: a refusal before that (bad body,
        // unknown conversation, no channel) took no effect, and a retry is judged again, against
        // what may have changed since.
        let built = self.blocking(build).await;
        drop(share);
        let (answer, submitted) = match built {
            Ok((state, command)) => (
                self.submit(route, key.as_deref(), state, command).await,
                true,
            ),
            Err(e) => (e.into(), false),
        };
        if let (Some(key), true) = (key, submitted && answer.status.as_u16() < 500) {
            self.keep_answer(route, key, request, &answer).await;
        }
        (answer, false)
    }

    /// The answer kept for `key`: `Ok(Some)` for a retry of the same request, an error for a key
    /// reused for another one.
    async fn kept_answer(
        self: &Arc<Self>,
        route: &'static str,
        key: String,
        request: &str,
    ) -> Result<Option<Answer>, ApiError> {
        let first = self
            .blocking(move |c| c.store.idempotent_answer(route, &key).map_err(store_error))
            .await?;
        match first {
            Some(first) if first.request == request => {
                let status =
                    StatusCode::from_u16(first.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                Ok(Some(Answer {
                    status,
                    body: first.body,
                }))
            }
            Some(_) => Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency_key_reused",
                "this Idempotency-Key was used for a different request",
            )),
            None => Ok(None),
        }
    }

    /// Keep the answer to a stored command for `key`.
    async fn keep_answer(
        self: &Arc<Self>,
        route: &'static str,
        key: String,
        request: String,
        answer: &Answer,
    ) {
        let record = IdempotencyRecord {
            request,
            status: answer.status.as_u16(),
            body: answer.body.clone(),
            at: self.store.clock().now_millis(),
        };
        let recorded = self
            .blocking(move |c| {
                c.store
                    .record_idempotent_answer(route, &key, &record)
                    .map_err(store_error)
            })
            .await;
        if let Err(e) = recorded {
            // The command itself is stored: a retry becomes a duplicate event and is answered
            // from its recorded verdict, so the call still succeeded.
            tracing::warn!(error = %e, route, "cannot record an idempotent answer");
        }
    }

    /// Run `f`, which uses the store (sled), on the blocking pool, off the HTTP workers: a slow
    /// sled call then never stalls other connections.
    pub async fn blocking<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Commands) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let commands = self.clone();
        actix_web::web::block(move || f(&commands))
            .await
            .map_err(|_| store_unavailable())?
    }

    /// Store a connector's commands (in order) as events of their conversations, without waiting
    /// for their fold. Event ids are the caller's (made from its delivery id), so a delivery
    /// posted twice is a duplicate. Returns how many were new.
    pub async fn store(
        &self,
        delivery: &str,
        commands: Vec<Stored>,
    ) -> Result<usize, storage::writer::WriterError> {
        let now = self.store.clock().now_millis();
        let mut events = Vec::with_capacity(commands.len());
        for c in commands {
            match command_event(&c.state, c.command, &c.event_id, now) {
                Ok(event) => events.push(event),
                Err(e) => {
                    tracing::error!(error = %e, "a desk's command does not make a valid event")
                }
            }
        }
        let job = AcceptJob {
            delivery: DeliveryId::new(delivery),
            events,
            invalid: Vec::new(),
            received_at: now,
        };
        Ok(self.writer.accept(job).await?.new.len())
    }

    /// Make what the writer took durable (a quarantine record written beside it).
    pub async fn flush(&self) -> Result<(), storage::writer::WriterError> {
        self.writer.flush().await
    }

    /// Store the command as an event of its conversation and answer from the fold's verdict.
    async fn submit(
        self: &Arc<Self>,
        route: &str,
        key: Option<&str>,
        state: ConversationState,
        command: Command,
    ) -> Answer {
        let conversation = state.id.clone();
        let event_id = match key {
            // Deterministic: a retry after a lost answer (or a crash) is a duplicate event.
            Some(k) => model::ids::Internal::Agent.id(format_args!("{conversation}:{route}:{k}")),
            None => {
                use rand::distr::{Alphanumeric, SampleString};
                let nonce = Alphanumeric.sample_string(&mut rand::rng(), 24);
                model::ids::Internal::Agent.id(format_args!("{conversation}:{route}:{nonce}"))
            }
        };
        let now = self.store.clock().now_millis();
        let event = match command_event(&state, command, &event_id, now) {
            Ok(e) => e,
            Err(e) => {
                tracing::error!(error = %e, "agent command does not make a valid event");
                return ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal_error",
                    "the command could not be stored",
                )
                .into();
            }
        };
        let Some(mut waiter) = self.waiters.register(&event_id) else {
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "too_many_pending",
                "too many agent commands are waiting to be applied; retry later",
            )
            .into();
        };
        let job = AcceptJob {
            delivery: DeliveryId::new(event_id.as_str()),
            events: vec![event],
            invalid: Vec::new(),
            received_at: now,
        };
        let accepted = match self.writer.accept(job).await {
            Ok(a) => a,
            Err(e) => {
                tracing::error!(error = %e, "cannot store an agent command");
                return store_unavailable().into();
            }
        };
        if accepted.new.is_empty() {
            if let Some(answer) = self.stored_before(&conversation, &event_id).await {
                return answer;
            }
        }
        match self.verdict(&mut waiter, &conversation, &event_id).await {
            Some(v) => self.answer_from(conversation, &v).await,
            None => ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "command_pending",
                format!(
                    "the command is stored as event {event_id} but not applied yet; retry with \
                     the same Idempotency-Key for its answer"
                ),
            )
            .into(),
        }
    }

    /// The command's verdict, or `None` when `helpdesk.command_timeout` passed first: told by
    /// this node's fold, or (several nodes) read from the conversation's state, where the active
    /// node's fold recorded it.
    async fn verdict(
        self: &Arc<Self>,
        waiter: &mut Waiter,
        conversation: &ConversationId,
        event_id: &str,
    ) -> Option<Verdict> {
        let timeout = self.settings.command_timeout;
        let Some(every) = self.settings.verdicts_elsewhere else {
            return waiter.wait(timeout).await;
        };
        let told = waiter.wait(timeout);
        tokio::pin!(told);
        let mut look = tokio::time::interval(every);
        look.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                told = &mut told => return told,
                _ = look.tick() => {}
            }
            let (id, eid) = (conversation.clone(), event_id.to_owned());
            let folded = self
                .blocking(move |c| {
                    let state = c.store.conversation(&id).map_err(store_error)?;
                    Ok(state.and_then(|s| s.desk.verdict(&eid).cloned()))
                })
                .await;
            if let Ok(Some(v)) = folded {
                return Some(v);
            }
        }
    }

    /// A command stored before (a retry whose first answer was lost): its verdict when it is
    /// recorded; `None` when it still waits in the inbox (a restart came between; its fold will
    /// answer the waiter); 409 when it was applied so long ago that its verdict is gone.
    async fn stored_before(
        self: &Arc<Self>,
        conversation: &ConversationId,
        event_id: &str,
    ) -> Option<Answer> {
        let (id, eid) = (conversation.clone(), event_id.to_owned());
        let found = self
            .blocking(move |c| {
                // The mark first: a fold writes its states before its marks, so once the event
                // reads as folded its verdict is there to read.
                let pending = still_pending(&*c.store, &eid).map_err(store_error)?;
                let state = c.store.conversation(&id).map_err(store_error)?;
                Ok((state.filter(|s| s.desk.verdict(&eid).is_some()), pending))
            })
            .await;
        match found {
            Ok((Some(s), _)) => s.desk.verdict(event_id).map(|v| verdict_answer(v, &s)),
            Ok((None, true)) => None,
            Ok((None, false)) => Some(
                ApiError::new(
                    StatusCode::CONFLICT,
                    "command_already_applied",
                    format!(
                        "this command (event {event_id}) was applied earlier and its answer is \
                         no longer kept; read the conversation for its state"
                    ),
                )
                .into(),
            ),
            Err(e) => Some(e.into()),
        }
    }

    /// The answer to a verdict, with the conversation's state after it.
    async fn answer_from(self: &Arc<Self>, conversation: ConversationId, v: &Verdict) -> Answer {
        let state = self
            .blocking(move |c| c.store.conversation(&conversation).map_err(store_error))
            .await;
        match state {
            Ok(Some(s)) => verdict_answer(v, &s),
            Ok(None) => store_unavailable().into(),
            Err(e) => e.into(),
        }
    }

    /// A conversation the store knows and that is not deleted (404 otherwise).
    pub fn conversation(&self, id: &str) -> Result<ConversationState, ApiError> {
        let id = ConversationId::new(id);
        match self.store.conversation(&id).map_err(store_error)? {
            Some(s) if s.deleted_at.is_none() => Ok(s),
            _ => Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "conversation_not_found",
                format!("no conversation {id}"),
            )),
        }
    }

    /// Where a release without a flow sends the conversation (`helpdesk.release_flow`).
    pub fn release_target(&self) -> Target {
        configured_release(&self.settings.release_flow)
    }

    /// A message to send in conversation `id` as `agent`, through its partner channel when it
    /// is on one (KakaoTalk counseling): every desk's replies.
    pub fn message_command(
        &self,
        id: &str,
        agent: Option<DeskAgent>,
        message: MessageData,
    ) -> Result<Built, ApiError> {
        let state = self.conversation(id)?;
        let partner = match state.platform {
            Some(Platform::Kakaobiz) => Some(self.partner_of(&state)?),
            _ => None,
        };
        let command = Command::Message {
            agent,
            message: Box::new(message),
            partner,
        };
        Ok((state, command))
    }

    /// The partner channel of a conversation's bot.
    fn partner_of(&self, state: &ConversationState) -> Result<PartnerUser, ApiError> {
        let sender_key = self
            .settings
            .partner
            .sender_key(bot_of(state))
            .ok_or_else(no_partner_channel)?;
        let user_key = state.user_key.as_ref().ok_or_else(|| {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "no_partner_channel",
                "the conversation's userKey is not known yet",
            )
        })?;
        Ok(PartnerUser {
            sender_key: sender_key.to_owned(),
            user_key: user_key.as_str().to_owned(),
        })
    }

    /// A partner-messenger user and the conversation their command is ordered with: their
    /// newest.
    pub fn partner_user(
        &self,
        platform: &str,
        user_key: &str,
    ) -> Result<(ConversationState, PartnerUser), ApiError> {
        if platform != Platform::Kakaobiz.as_str() {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "not_partner_messenger",
                "block, unblock and session removal are partner-messenger (kakaobiz) actions",
            ));
        }
        let not_found = || {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "user_not_found",
                "no end user with this platform and userKey has a known conversation",
            )
        };
        let store = &self.store;
        let user = store
            .find_end_user(platform, user_key)
            .map_err(store_error)?
            .ok_or_else(not_found)?;
        let id = user.last_conversation_id.value.ok_or_else(not_found)?;
        let state = store
            .conversation(&id)
            .map_err(store_error)?
            .ok_or_else(not_found)?;
        let bot = bot_of(&state).or(user.bot_id.as_ref().map(|b| b.as_str()));
        let sender_key = self
            .settings
            .partner
            .sender_key(bot)
            .ok_or_else(no_partner_channel)?
            .to_owned();
        let partner = PartnerUser {
            sender_key,
            user_key: user_key.to_owned(),
        };
        Ok((state, partner))
    }
}

/// The stored event of a command of `state`'s conversation.
fn command_event(
    state: &ConversationState,
    command: Command,
    event_id: &str,
    now: model::webhook::model::Millis,
) -> Result<model::webhook::IncomingEvent, model::webhook::EventError> {
    let cmd = AgentCommand {
        conversation_id: state.id.clone(),
        command,
    };
    let bot = bot_of(state).unwrap_or("bridge");
    model::webhook::agent_event(&cmd, event_id, bot, now)
}

fn no_partner_channel() -> ApiError {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "no_partner_channel",
        "no partner-messenger channel is configured for this conversation's bot \
         (helpdesk.partner)",
    )
}

/// Whether the stored event `event_id` is still to fold.
fn still_pending(
    store: &dyn storage::Storage,
    event_id: &str,
) -> Result<bool, storage::StoreError> {
    let status = store.event_status(&model::ids::EventId::new(event_id))?;
    Ok(status.is_some_and(|(_, pending)| pending))
}

fn verdict_answer(v: &Verdict, state: &ConversationState) -> Answer {
    match &v.outcome {
        Outcome::Applied { changed } => Answer {
            status: StatusCode::OK,
            body: json!(CommandAnswer {
                conversation_id: state.id.as_str().to_owned(),
                command: v.command.clone(),
                event_id: v.event_id.clone(),
                status: "applied".into(),
                changed: *changed,
                agent: state.desk.agent.as_ref().map(AgentBody::of),
            }),
        },
        Outcome::Rejected { reason } => {
            let message = match reason {
                Rejection::AlreadyAccepted => format!(
                    "accepted by another agent ({})",
                    state.desk.agent.as_ref().map_or("?", |a| a.id.as_str())
                ),
                Rejection::NotWithAgent => "no agent has accepted this conversation".to_owned(),
            };
            ApiError::new(StatusCode::CONFLICT, reason.code(), message).into()
        }
    }
}

/// `helpdesk.release_flow`: digits are a flow id, anything else a title, empty nothing.
fn configured_release(flow: &str) -> Target {
    let flow = flow.trim();
    match flow.parse::<i64>() {
        _ if flow.is_empty() => Target::default(),
        Ok(id) => Target {
            flow_id: Some(id),
            ..Target::default()
        },
        Err(_) => Target {
            flow: Some(flow.to_owned()),
            ..Target::default()
        },
    }
}

pub fn bot_of(s: &ConversationState) -> Option<&str> {
    s.bot_id.as_ref().map(|b| b.as_str())
}

pub fn store_error(e: storage::StoreError) -> ApiError {
    tracing::error!(error = %e, "agent command: store failed");
    store_unavailable()
}

pub fn store_unavailable() -> ApiError {
    ApiError::unavailable("the store cannot be used now; retry")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_release_flow_setting_is_an_id_a_title_or_nothing() {
        assert_eq!(configured_release("9").flow_id, Some(9));
        assert_eq!(
            configured_release("Satisfaction survey").flow.as_deref(),
            Some("Satisfaction survey")
        );
        assert!(!configured_release("").is_some());
    }
}
