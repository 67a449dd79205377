//! Per-conversation, per-end-user and per-bot state, and the pure fold that applies one event.
//!
//! Events arrive out of order and are sometimes re-sent, so every field is a last-writer-wins
//! register stamped with the (timestamp, event id) of the event that set it, counters only grow,
//! and "last seen" times take the maximum. Applying the same set of events in any order therefore
//! gives the same state: an older event never rolls state back. (Exactly-once application of an
//! event is the store's job. The fold dedupes one thing itself: a message the webhook and backfill
//! both bring, under two event ids, by its own id; see [`ConversationState::knows_message`].)

use model::ids::{BotId, ConversationId, EndUserId, UserKey};
use model::webhook::model::{
    AgentRef, Bot, Conversation, EndUser, Event, EventKind, Message, Millis, Navigation, Payload,
    Platform, Sender, TimerFiring,
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub mod belief;
pub mod desk;
mod firings;
pub mod queue;
pub mod stats;
pub use desk::Desk;
pub use firings::{CapHit, FiringCap, Firings, TemplateError, TEMPLATE_ERRORS_KEPT};

/// Version of the persisted state layout; bump with a migration when the shape changes. Fields
/// added with a serde default (labels, variables, timers, firings, capped) decode from older
/// records as they are.
pub const STATE_VERSION: u32 = 1;

/// Total order on events, used to decide which of two writes is newer.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Stamp {
    pub at: Millis,
    pub event: String,
}

impl Stamp {
    pub fn of(event: &Event) -> Self {
        Stamp {
            at: event.timestamp,
            event: event.id.as_str().to_owned(),
        }
    }
}

/// A value with the stamp of the event that wrote it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Lww<T> {
    pub value: T,
    pub stamp: Stamp,
}

impl<T> Lww<T> {
    /// Write `value` if `stamp` is newer than the current one.
    fn set(&mut self, value: T, stamp: &Stamp) {
        if *stamp > self.stamp {
            self.value = value;
            self.stamp = stamp.clone();
        }
    }
}

/// Where a conversation stands in the agent-call lifecycle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HandoffPhase {
    #[default]
    Bot,
    Requested,
    Connected,
    Cancelled,
    Ended,
}

impl HandoffPhase {
    fn from_event(kind: &EventKind) -> Option<Self> {
        match kind {
            EventKind::AgentCallRequested => Some(HandoffPhase::Requested),
            EventKind::AgentCallConnected => Some(HandoffPhase::Connected),
            EventKind::AgentCallCancelled => Some(HandoffPhase::Cancelled),
            EventKind::AgentCallDisconnected => Some(HandoffPhase::Ended),
            _ => None,
        }
    }
}

/// The handoff as derived from `agent_call_*` events.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Handoff {
    /// Current phase; its stamp's time is when the phase began.
    pub phase: Lww<HandoffPhase>,
    pub requested_at: Option<Millis>,
    pub connected_at: Option<Millis>,
    pub cancelled_at: Option<Millis>,
    pub ended_at: Option<Millis>,
    /// When the rules handed the waiting user back to the bot without anyone taking the
    /// conversation (the wait ran out, after hours): the wait for that request is over
    /// ([`queue::hand_back`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handed_back_at: Option<Millis>,
    /// The agent who answered last (from `meta.sender` of agent messages).
    pub agent: Lww<Option<AgentRef>>,
}

/// Message counters and last-message times by sender.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MessageStats {
    pub user_messages: u64,
    pub bot_messages: u64,
    pub agent_messages: u64,
    pub last_user_message_at: Option<Millis>,
    pub last_bot_message_at: Option<Millis>,
    pub last_agent_message_at: Option<Millis>,
    /// Id and sender of the newest message.
    pub last_message: Lww<Option<LastMessage>>,
    /// The newest messages' own ids (at most [`RECENT_MESSAGE_IDS`], within
    /// [`RECENT_MESSAGE_HORIZON_MS`] of the newest; newest first): a second
    /// event carrying one of them (webhook and backfill, in either order) is a duplicate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recent_ids: Vec<SeenMessage>,
    /// When the newest user messages were sent (at most [`RECENT_USER_MESSAGES`], newest
    /// first): how fast a user writes, for flood rules.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recent_user_at: Vec<Millis>,
}

/// User message times kept per conversation (a flood rule can look this far back).
pub const RECENT_USER_MESSAGES: usize = 20;

/// Message ids kept per conversation (the newest by time): a message that comes again under
/// another event id (the webhook's copy and the backfilled one) within this many newer messages
/// is recognised as a duplicate.
pub const RECENT_MESSAGE_IDS: usize = 100;

/// ... and within this long (ms) of the conversation's newest message: the default event dedupe
/// window (`webhook.dedupe_retention`), so a state does not carry ids older than the store's.
pub const RECENT_MESSAGE_HORIZON_MS: Millis = 48 * 3600 * 1000;

/// A message folded into a conversation: its own id (`MESSAGE.id`) and its event's time.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SeenMessage {
    pub at: Millis,
    pub id: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LastMessage {
    pub id: String,
    pub sender: Sender,
}

/// What the bridge knows about one conversation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConversationState {
    pub version: u32,
    pub id: ConversationId,
    pub bot_id: Option<BotId>,
    pub end_user_id: Option<EndUserId>,
    pub platform: Option<Platform>,
    pub user_key: Option<UserKey>,
    pub params: Lww<Map<String, Value>>,
    pub navigation: Lww<Navigation>,
    /// `context.manual.status` as last reported by the service (or found by the reconciliation
    /// sweeper: a `reconcile.drift` event).
    pub manual_status: Lww<Option<String>>,
    /// The bridge's own last `set_manual` decision here (stamped with the event it was decided
    /// for): with `manual_status`, what the bridge believes of manual mode
    /// ([`reconcile::believed`]).
    #[serde(default)]
    pub manual_set: Lww<Option<bool>>,
    pub handoff: Handoff,
    pub messages: MessageStats,
    pub created_at: Option<Millis>,
    pub deleted_at: Option<Millis>,
    /// Events applied to this conversation; with exactly-once processing this equals the number
    /// of distinct events stored for it, less the second copies of messages (not applied).
    pub events_applied: u64,
    pub first_event_at: Millis,
    pub last_event_at: Millis,
    /// The bridge's own labels and variables (set by rules' internal actions).
    #[serde(default)]
    pub labels: std::collections::BTreeSet<String>,
    #[serde(default)]
    pub variables: std::collections::BTreeMap<String, Value>,
    /// Running rule timers by name. The store keeps its timer index (what the firer reads) equal
    /// to these, in the fold's journal.
    #[serde(default)]
    pub timers: std::collections::BTreeMap<String, Timer>,
    /// Each rule's recent firings here, which its firing cap counts (see [`FiringCap`]).
    #[serde(default)]
    pub firings: std::collections::BTreeMap<String, Firings>,
    /// The last time a firing cap held each rule back here: the audit of caps.
    #[serde(default)]
    pub capped: std::collections::BTreeMap<String, CapHit>,
    /// The newest actions whose templates failed at run time here (at most
    /// [`TEMPLATE_ERRORS_KEPT`], oldest first): the durable record the audit shows.
    #[serde(default)]
    pub template_errors: Vec<TemplateError>,
    /// The agent API's side: the agent who accepted it, and the verdicts on agent commands.
    #[serde(default)]
    pub desk: Desk,
}

/// A running rule timer: it fires as a `timer.<name>` event at `due_at`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timer {
    /// Unix ms, the bridge's clock: the decision's clock plus the rule's `after`.
    pub due_at: Millis,
    /// When it was started (the decision's clock).
    pub started_at: Millis,
    /// The action that started it (`<event id>/<rule>/<index>`); its firing carries the same, so
    /// a firing of an earlier run of the timer is recognised as stale.
    pub started_by: String,
}

impl ConversationState {
    /// A rule's internal state change: labels added and removed, variables set (`null` removes).
    pub fn update(
        &mut self,
        add: &[String],
        remove: &[String],
        variables: &std::collections::BTreeMap<String, Value>,
    ) {
        self.labels.extend(add.iter().cloned());
        for label in remove {
            self.labels.remove(label);
        }
        for (k, v) in variables {
            if v.is_null() {
                self.variables.remove(k);
            } else {
                self.variables.insert(k.clone(), v.clone());
            }
        }
    }

    /// A rule starts timer `name`, or restarts it (a new due time and starter replace the old).
    pub fn start_timer(&mut self, name: &str, timer: Timer) {
        self.timers.insert(name.to_owned(), timer);
    }

    /// A rule cancels timer `name` (nothing happens when it does not run).
    pub fn cancel_timer(&mut self, name: &str) {
        self.timers.remove(name);
    }

    /// A timer event: the timer stops running if this firing is its current run. Returns false
    /// for a stale firing (the timer was cancelled or restarted after this run was fired), which
    /// must not reach rules.
    fn fire_timer(&mut self, firing: &TimerFiring) -> bool {
        let live = self
            .timers
            .get(&firing.name)
            .is_some_and(|t| t.started_by == firing.started_by);
        if live {
            self.timers.remove(&firing.name);
        }
        live
    }

    pub fn new(id: ConversationId) -> Self {
        ConversationState {
            version: STATE_VERSION,
            id,
            bot_id: None,
            end_user_id: None,
            platform: None,
            user_key: None,
            params: Lww::default(),
            navigation: Lww::default(),
            manual_status: Lww::default(),
            manual_set: Lww::default(),
            handoff: Handoff::default(),
            messages: MessageStats::default(),
            created_at: None,
            deleted_at: None,
            events_applied: 0,
            first_event_at: Millis::MAX,
            last_event_at: Millis::MIN,
            labels: Default::default(),
            variables: Default::default(),
            timers: Default::default(),
            firings: Default::default(),
            capped: Default::default(),
            template_errors: Default::default(),
            desk: Default::default(),
        }
    }

    /// Fold one conversation, message, timer or agent event in. Returns whether rules may decide
    /// for it: false for a stale timer firing (see [`Timer::started_by`]), for an agent command
    /// the state refused (see [`desk`]) and for a message already folded under another event id
    /// (see [`ConversationState::knows_message`]).
    pub fn apply(&mut self, event: &Event) -> bool {
        let stamp = Stamp::of(event);
        if let Payload::Message(m) = &event.payload {
            if self.knows_message(&m.id) {
                self.merge_duplicate(event, m, &stamp);
                return false;
            }
        }
        self.events_applied += 1;
        self.first_event_at = self.first_event_at.min(event.timestamp);
        self.last_event_at = self.last_event_at.max(event.timestamp);
        if self.bot_id.is_none() {
            self.bot_id = Some(event.source_id.clone());
        }
        let decides = match &event.payload {
            Payload::Conversation(c) => {
                self.apply_conversation(&event.kind, c, &stamp);
                true
            }
            Payload::Message(m) => {
                self.apply_message(m, &stamp);
                true
            }
            Payload::Timer(t) => self.fire_timer(t),
            Payload::Agent(cmd) => self.fold_agent(event, cmd),
            Payload::Reconcile(drift) => {
                self.fold_drift(drift, &stamp);
                true
            }
            _ => true,
        };
        queue::hand_back(self, event, decides);
        decides
    }

    fn apply_conversation(&mut self, kind: &EventKind, c: &Conversation, stamp: &Stamp) {
        fill(&mut self.bot_id, c.bot_id.as_ref());
        fill(&mut self.end_user_id, c.end_user_id.as_ref());
        fill(&mut self.platform, c.platform.as_ref());
        fill(&mut self.user_key, c.user_key.as_ref());
        if let Some(params) = &c.params {
            self.params.set(params.clone(), stamp);
        }
        if let Some(nav) = c.effective_navigation() {
            self.navigation.set(nav.clone(), stamp);
        }
        if let Some(status) = c.manual_status() {
            self.manual_status.set(Some(status.to_owned()), stamp);
        }
        let at = stamp.at;
        match kind {
            EventKind::ConversationCreated => self.created_at = min_some(self.created_at, at),
            EventKind::ConversationDeleted => self.deleted_at = max_some(self.deleted_at, at),
            _ => {}
        }
        if let Some(phase) = HandoffPhase::from_event(kind) {
            let h = &mut self.handoff;
            h.phase.set(phase, stamp);
            let slot = match phase {
                HandoffPhase::Requested => &mut h.requested_at,
                HandoffPhase::Connected => &mut h.connected_at,
                HandoffPhase::Cancelled => &mut h.cancelled_at,
                HandoffPhase::Ended | HandoffPhase::Bot => &mut h.ended_at,
            };
            *slot = max_some(*slot, at);
        }
    }

    /// Whether a message with this own id (`MESSAGE.id`) was folded here (among the newest
    /// [`RECENT_MESSAGE_IDS`]): the webhook and backfill may both bring it, under different
    /// event ids.
    pub fn knows_message(&self, id: &str) -> bool {
        self.messages.recent_ids.iter().any(|m| m.id == id)
    }

    /// A second copy of a folded message: counters, lists and rules are left alone; only what
    /// commutes is merged (the times seen, and the stamps of the registers the message set, whose
    /// values are the same), so the state does not depend on which copy came first.
    fn merge_duplicate(&mut self, event: &Event, m: &Message, stamp: &Stamp) {
        self.first_event_at = self.first_event_at.min(event.timestamp);
        self.last_event_at = self.last_event_at.max(event.timestamp);
        let stats = &mut self.messages;
        let sender = m.sender();
        let last_at = match sender {
            Sender::User => &mut stats.last_user_message_at,
            Sender::Bot => &mut stats.last_bot_message_at,
            Sender::Agent => &mut stats.last_agent_message_at,
        };
        *last_at = max_some(*last_at, stamp.at);
        // The copies may carry different times (the webhook's event time, backfill's the
        // message's own): the lists keep the earlier, whichever copy came first.
        let at = stamp.at;
        if let Some(pos) = stats.recent_ids.iter().position(|s| s.id == m.id) {
            let old = stats.recent_ids[pos].at;
            if at < old {
                let mut seen = stats.recent_ids.remove(pos);
                seen.at = at;
                let p = stats.recent_ids.partition_point(|s| *s > seen);
                stats.recent_ids.insert(p, seen);
                if sender == Sender::User {
                    if let Some(i) = stats.recent_user_at.iter().position(|t| *t == old) {
                        stats.recent_user_at.remove(i);
                        let p = stats.recent_user_at.partition_point(|t| *t > at);
                        stats.recent_user_at.insert(p, at);
                    }
                }
            }
        }
        let last = LastMessage {
            id: m.id.clone(),
            sender,
        };
        stats.last_message.set(Some(last), stamp);
        if sender == Sender::Agent {
            let agent = m.meta.as_ref().and_then(|meta| meta.sender.clone());
            if agent.is_some() {
                self.handoff.agent.set(agent, stamp);
            }
        }
    }

    fn apply_message(&mut self, m: &Message, stamp: &Stamp) {
        fill(&mut self.end_user_id, m.end_user_id.as_ref());
        let at = stamp.at;
        let stats = &mut self.messages;
        let seen = SeenMessage {
            at,
            id: m.id.clone(),
        };
        let pos = stats.recent_ids.partition_point(|s| *s > seen);
        stats.recent_ids.insert(pos, seen);
        stats.recent_ids.truncate(RECENT_MESSAGE_IDS);
        if let Some(newest) = stats.recent_ids.first().map(|s| s.at) {
            let horizon = newest.saturating_sub(RECENT_MESSAGE_HORIZON_MS);
            stats.recent_ids.retain(|s| s.at >= horizon);
        }
        let sender = m.sender();
        match sender {
            Sender::User => {
                stats.user_messages += 1;
                stats.last_user_message_at = max_some(stats.last_user_message_at, at);
                // Newest first whatever order the events came in; the oldest drop out.
                let pos = stats.recent_user_at.partition_point(|t| *t > at);
                stats.recent_user_at.insert(pos, at);
                stats.recent_user_at.truncate(RECENT_USER_MESSAGES);
            }
            Sender::Bot => {
                stats.bot_messages += 1;
                stats.last_bot_message_at = max_some(stats.last_bot_message_at, at);
            }
            Sender::Agent => {
                stats.agent_messages += 1;
                stats.last_agent_message_at = max_some(stats.last_agent_message_at, at);
                let agent = m.meta.as_ref().and_then(|meta| meta.sender.clone());
                if agent.is_some() {
                    self.handoff.agent.set(agent, stamp);
                }
            }
        }
        let last = LastMessage {
            id: m.id.clone(),
            sender,
        };
        stats.last_message.set(Some(last), stamp);
    }
}

/// What the bridge knows about one end user.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EndUserState {
    pub version: u32,
    pub id: EndUserId,
    pub bot_id: Option<BotId>,
    pub platform: Option<Platform>,
    pub user_key: Option<UserKey>,
    pub params: Lww<Map<String, Value>>,
    /// The user's newest conversation: conversation ids change with every session.
    pub last_conversation_id: Lww<Option<ConversationId>>,
    pub deleted_at: Option<Millis>,
    pub events_applied: u64,
    pub last_event_at: Millis,
}

impl EndUserState {
    pub fn new(id: EndUserId) -> Self {
        EndUserState {
            version: STATE_VERSION,
            id,
            bot_id: None,
            platform: None,
            user_key: None,
            params: Lww::default(),
            last_conversation_id: Lww::default(),
            deleted_at: None,
            events_applied: 0,
            last_event_at: Millis::MIN,
        }
    }

    /// Fold one `bot.end_user.*` event in.
    pub fn apply(&mut self, event: &Event, user: &EndUser) {
        let stamp = Stamp::of(event);
        self.events_applied += 1;
        self.last_event_at = self.last_event_at.max(event.timestamp);
        fill(
            &mut self.bot_id,
            user.bot_id.as_ref().or(Some(&event.source_id)),
        );
        fill(&mut self.platform, Some(&user.platform));
        fill(&mut self.user_key, Some(&user.user_key));
        if let Some(params) = &user.params {
            self.params.set(params.clone(), &stamp);
        }
        if let Some(conv) = &user.last_conversation_id {
            self.last_conversation_id.set(Some(conv.clone()), &stamp);
        }
        if event.kind == EventKind::EndUserDeleted {
            self.deleted_at = max_some(self.deleted_at, event.timestamp);
        }
    }

    /// A conversation event names its end user: remember the conversation as theirs. This does not
    /// count as an event applied to the end user.
    pub fn observe_conversation(&mut self, event: &Event, c: &Conversation) {
        fill(&mut self.bot_id, c.bot_id.as_ref());
        fill(&mut self.platform, c.platform.as_ref());
        fill(&mut self.user_key, c.user_key.as_ref());
        self.last_conversation_id
            .set(Some(c.id.clone()), &Stamp::of(event));
    }
}

/// What the bridge knows about one bot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BotState {
    pub version: u32,
    pub id: BotId,
    pub info: Lww<Option<Bot>>,
    pub deleted_at: Option<Millis>,
    /// Events of types the bridge does not know, attributed to the bot that sent them.
    pub unknown_events: u64,
    pub events_applied: u64,
    pub last_event_at: Millis,
}

impl BotState {
    pub fn new(id: BotId) -> Self {
        BotState {
            version: STATE_VERSION,
            id,
            info: Lww::default(),
            deleted_at: None,
            unknown_events: 0,
            events_applied: 0,
            last_event_at: Millis::MIN,
        }
    }

    /// Fold a `bot.*` event, or an event of an unknown type, in.
    pub fn apply(&mut self, event: &Event) {
        self.events_applied += 1;
        self.last_event_at = self.last_event_at.max(event.timestamp);
        match &event.payload {
            Payload::Bot(bot) => {
                self.info.set(Some(bot.clone()), &Stamp::of(event));
                if event.kind == EventKind::BotDeleted {
                    self.deleted_at = max_some(self.deleted_at, event.timestamp);
                }
            }
            _ => self.unknown_events += 1,
        }
    }
}

fn fill<T: Clone>(slot: &mut Option<T>, value: Option<&T>) {
    if slot.is_none() {
        if let Some(v) = value {
            *slot = Some(v.clone());
        }
    }
}

fn max_some(current: Option<Millis>, at: Millis) -> Option<Millis> {
    Some(current.map_or(at, |c| c.max(at)))
}

fn min_some(current: Option<Millis>, at: Millis) -> Option<Millis> {
    Some(current.map_or(at, |c| c.min(at)))
}

#[cfg(test)]
mod tests;
