//! The emulated service's data and the semantics of all 24 endpoints, as pure logic: one call in,
//! one `(status, JSON body)` out, with the time passed in. No HTTP, no clock, no locks, so every
//! rule is unit-testable and the HTTP layer only adds auth, idempotency, faults and the journal.
//!
//! Rules the contract leaves open are settled here (and listed in the module docs of
//! `emulator`): every success is 200; a flow or node that does not exist in the bot is a 400
//! `invalid_body` (a 404 would look like the conversation itself is gone); unknown query
//! parameters are a 400 `invalid_query`.

use super::seed::{Seed, SeedChannel, SeedPbConversation};
use super::validate;
use model::clock::{format_iso_millis, parse_iso_millis};
use model::contract::{
    BlockRequest, BotConversationsQuery, ChannelSetting, ConversationsQuery, EndUsersQuery,
    Endpoint, ErrorBody, ErrorDetail, Flow, FlowList, ManualStatus, MessageRangeQuery,
    MessagesQuery, NotifyRequest, NotifyResult, Page, PageQuery, Paging, PbConversation, PbSent,
    PbSession, PbStatus, SendMessage, SendToEndUser, UpdatePbConversation,
};
use model::ids::{BotId, ConversationId, EndUserId, UserKey};
// Some request types share their names with endpoints.
use model::contract as api;
use model::webhook::model::{
    Bot, Context, Conversation, EndUser, Message, MessageData, MessageMeta, Millis, Navigation,
    Node,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap, HashSet};

/// The answer of one call: HTTP status and JSON body.
pub type Reply = (u16, Value);

pub const DEFAULT_LIMIT: u32 = 20;
pub const MAX_LIMIT: u32 = 100;
/// The only manual status the service is known to use.
pub const HANDOVER: &str = "HANDOVER";

/// An error answer before it becomes a body.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorAnswer {
    pub status: u16,
    pub code: &'static str,
    pub message: String,
}

impl ErrorAnswer {
    fn new(status: u16, code: &'static str, message: impl Into<String>) -> Self {
        ErrorAnswer {
            status,
            code,
            message: message.into(),
        }
    }
    pub fn invalid_body(message: impl Into<String>) -> Self {
        Self::new(400, "invalid_body", message)
    }
    pub fn invalid_query(message: impl Into<String>) -> Self {
        Self::new(400, "invalid_query", message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(404, "not_found", message)
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(409, "conflict", message)
    }
    pub fn template_mismatch(message: impl Into<String>) -> Self {
        Self::new(422, "template_mismatch", message)
    }
    fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "internal", message)
    }

    pub fn into_reply(self) -> Reply {
        (self.status, error_body(self.code, &self.message))
    }
}

/// The contract's error body.
pub fn error_body(code: &str, message: &str) -> Value {
    serde_json::to_value(ErrorBody {
        error: ErrorDetail {
            code: code.to_owned(),
            message: message.to_owned(),
        },
    })
    .unwrap_or(Value::Null)
}

/// A conversation with what the objects do not carry: times as milliseconds, the manual record
/// and node visit counts.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct ConversationRecord {
    conversation: Conversation,
    created_ms: Millis,
    updated_ms: Millis,
    manual: ManualRecord,
    /// Visits per `(flowId, nodeId)`, so navigation can report `visitCount`.
    #[serde(skip)]
    visits: HashMap<(i64, i64), i64>,
}

#[derive(Clone, Copy, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct ManualRecord {
    enabled: bool,
    updated_at: Millis,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Channel {
    bot_id: BotId,
    /// By userKey; the PBCONV as answered.
    users: BTreeMap<String, PbConversation>,
    /// Reasons given to block, kept for the state dump only.
    block_reasons: BTreeMap<String, String>,
    setting: ChannelSetting,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Template {
    text: String,
    variables: Vec<String>,
}

/// A message sent through a partner channel (kept for the state dump and tests).
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PartnerMessage {
    pub message_id: String,
    pub sender_key: String,
    pub user_key: String,
    pub message: MessageData,
    pub sent_at: Millis,
}

/// A notification accepted for sending, with its rendered text.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SentNotification {
    pub message_id: String,
    pub sender_key: String,
    pub template_code: String,
    pub recipient: String,
    pub text: String,
    pub sent_at: Millis,
}

/// Everything the emulated service knows.
#[derive(Clone, Debug)]
pub struct EmulatorState {
    bots: Vec<Bot>,
    flows: BTreeMap<BotId, Vec<Flow>>,
    end_users: Vec<EndUser>,
    end_user_index: HashMap<EndUserId, usize>,
    conversations: Vec<ConversationRecord>,
    conversation_index: HashMap<ConversationId, usize>,
    /// In arrival order; listed sorted by timestamp (stable).
    messages: Vec<Message>,
    message_ids: HashSet<String>,
    channels: BTreeMap<String, Channel>,
    /// By `(senderKey, code)`.
    templates: BTreeMap<(String, String), Template>,
    partner_messages: Vec<PartnerMessage>,
    notifications: Vec<SentNotification>,
    next_id: u64,
    /// Webhook events caused by changes, waiting for the webhook sender; collected only while
    /// a sender is attached, so a plain API emulator does not accumulate them.
    events: Option<std::collections::VecDeque<PendingWebhook>>,
    /// Events emitted and not yet delivered (taken but unanswered count too).
    undelivered: u64,
    /// Woken whenever deliveries complete, for `/_emulator/webhook/flushed`.
    delivery_progress: std::sync::Arc<tokio::sync::Notify>,
    /// The webhook's health as the service judges it (the rule that disables it).
    webhook: crate::webhook_status::WebhookStatus,
}

/// Events held for the webhook at most (the oldest go past it, counted in the webhook status):
/// a webhook disabled for long does not grow the emulator without bound.
pub const MAX_HELD_EVENTS: usize = 100_000;

/// An event the service would send by webhook: its id (the same on every re-send), type and
/// `data` object.
#[derive(Clone, Debug, PartialEq)]
pub struct PendingWebhook {
    pub id: String,
    pub kind: String,
    pub bot_id: String,
    pub at: Millis,
    pub data: Value,
}

/// Named path parameters of one call.
struct PathParams<'a>(&'a [(&'a str, &'a str)]);

impl PathParams<'_> {
    fn get(&self, name: &str) -> Result<&str, ErrorAnswer> {
        self.0
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| *v)
            .ok_or_else(|| ErrorAnswer::not_found(format!("path parameter {name} is missing")))
    }
}

/// How a query parameter's text is read.
#[derive(Clone, Copy)]
enum Kind {
    /// `offset`, `limit`.
    Count,
    /// `from`, `to`.
    Millis,
    Bool,
    Text,
}

const PAGE: [(&str, Kind); 2] = [("offset", Kind::Count), ("limit", Kind::Count)];

impl EmulatorState {
    /// Builds the state from a seed. The seed should have passed [`Seed::validate`]; this does
    /// not fail, but skips what it cannot use.
    pub fn from_seed(seed: &Seed) -> Self {
        let mut state = EmulatorState {
            bots: seed.bots.clone(),
            flows: seed.flows.clone(),
            end_users: Vec::new(),
            end_user_index: HashMap::new(),
            conversations: Vec::new(),
            conversation_index: HashMap::new(),
            messages: Vec::new(),
            message_ids: HashSet::new(),
            channels: BTreeMap::new(),
            templates: BTreeMap::new(),
            partner_messages: Vec::new(),
            events: None,
            undelivered: 0,
            delivery_progress: std::sync::Arc::new(tokio::sync::Notify::new()),
            webhook: crate::webhook_status::WebhookStatus::default(),
            notifications: Vec::new(),
            next_id: 1,
        };
        for eu in &seed.end_users {
            state
                .end_user_index
                .insert(eu.id.clone(), state.end_users.len());
            state.end_users.push(eu.clone());
        }
        for c in &seed.conversations {
            let record = state.seed_conversation(c);
            state
                .conversation_index
                .insert(record.conversation.id.clone(), state.conversations.len());
            state.conversations.push(record);
        }
        for m in &seed.messages {
            state.message_ids.insert(m.id.clone());
            state.messages.push(m.clone());
        }
        for ch in &seed.channels {
            state
                .channels
                .insert(ch.sender_key.clone(), seed_channel(ch));
        }
        for t in &seed.templates {
            state.templates.insert(
                (t.sender_key.clone(), t.code.clone()),
                Template {
                    text: t.text.clone(),
                    variables: t.variables.clone(),
                },
            );
        }
        state
    }

    /// A seeded conversation's record: platform and user key default to its end user's (the end
    /// users must be in already), times become milliseconds, and the manual record and the
    /// current node's visit count come from the conversation.
    fn seed_conversation(&self, c: &Conversation) -> ConversationRecord {
        let mut c = c.clone();
        if let Some(eu) = c
            .end_user_id
            .as_ref()
            .and_then(|id| self.end_user_index.get(id))
            .and_then(|&i| self.end_users.get(i))
        {
            c.platform.get_or_insert_with(|| eu.platform.clone());
            c.user_key.get_or_insert_with(|| eu.user_key.clone());
        }
        let ms = |t: &Option<String>| t.as_deref().and_then(|t| parse_iso_millis(t).ok());
        let created_ms = ms(&c.created_at).unwrap_or(0);
        let updated_ms = ms(&c.updated_at).unwrap_or(created_ms);
        let manual = ManualRecord {
            enabled: c.manual_status() == Some(HANDOVER),
            updated_at: updated_ms,
        };
        let mut visits = HashMap::new();
        if let Some(cur) = c.effective_navigation().and_then(|n| n.current) {
            visits.insert((cur.flow_id, cur.node_id), cur.visit_count.unwrap_or(1));
        }
        ConversationRecord {
            conversation: c,
            created_ms,
            updated_ms,
            manual,
            visits,
        }
    }

    /// One call. `path` holds the endpoint's path parameters by name, `query` a JSON object of
    /// query parameters (strings as they come from a URL, or typed values), `body` the parsed
    /// JSON body if there was one.
    pub fn handle(
        &mut self,
        endpoint: Endpoint,
        path: &[(&str, &str)],
        query: &Value,
        body: Option<&Value>,
        now: Millis,
    ) -> Reply {
        match self.dispatch(endpoint, &PathParams(path), query, body, now) {
            Ok(value) => (200, value),
            Err(failure) => failure.into_reply(),
        }
    }

    /// Runs one endpoint's rule: refuses query parameters on mutating endpoints, then hands the
    /// call to the endpoint's handler.
    fn dispatch(
        &mut self,
        endpoint: Endpoint,
        path: &PathParams<'_>,
        query: &Value,
        body: Option<&Value>,
        now: Millis,
    ) -> Result<Value, ErrorAnswer> {
        use Endpoint::*;
        if endpoint.is_mutating() {
            no_query(query)?;
        }
        match endpoint {
            // Bots and flows.
            ListBots => self.list_bots(query),
            GetBot => self.get_bot(path, query),
            ListBotConversations => self.list_bot_conversations(path, query),
            ListFlows => self.list_flows(path, query),
            // Conversations.
            GetConversation => self.get_conversation(path, query),
            UpdateConversation => self.update_conversation(path, body, now),
            SetManual => self.put_manual(path, body, now),
            GetManual => self.get_manual(path, query),
            ListConversationMessages => self.list_conversation_messages(path, query),
            SendConversationMessage => self.send_conversation_message(path, body, now),
            SetNavigation => self.set_navigation(path, body, now),
            ListConversations => self.list_conversations(query),
            // End users and messages.
            GetEndUser => self.get_end_user(path, query),
            ListEndUsers => self.list_end_users(query),
            SendEndUserMessage => self.send_end_user_message(body, now),
            ListMessages => self.list_messages(query),
            // Partner channel.
            PbGetConversation => self.pb_get_conversation(path, query),
            PbUpdateConversation => self.pb_update_conversation(path, body, now),
            PbBlock => self.pb_block(path, body, now),
            PbUnblock => self.pb_unblock(path, now),
            PbRemoveSession => self.pb_remove_session(path, now),
            PbSendMessage => self.pb_send_message(path, body, now),
            PbUpdateSetting => self.pb_update_setting(path, body),
            // Notifications.
            NotifySend => self.notify_send(body, now),
        }
    }

    /// `ListBots`: a page of all bots.
    fn list_bots(&self, query: &Value) -> Result<Value, ErrorAnswer> {
        let q: PageQuery = parse_query(query, &PAGE)?;
        page(self.bots.iter().collect(), &q)
    }

    /// `GetBot`: one bot by id.
    fn get_bot(&self, path: &PathParams<'_>, query: &Value) -> Result<Value, ErrorAnswer> {
        no_query(query)?;
        to_json(self.bot(path.get("botId")?)?)
    }

    /// `ListBotConversations`: a page of one bot's conversations, filtered by end user, platform
    /// and user key.
    fn list_bot_conversations(
        &self,
        path: &PathParams<'_>,
        query: &Value,
    ) -> Result<Value, ErrorAnswer> {
        let bot_id = path.get("botId")?;
        self.bot(bot_id)?;
        let q: BotConversationsQuery = parse_query(
            query,
            &[
                PAGE[0],
                PAGE[1],
                ("endUserId", Kind::Text),
                ("platform", Kind::Text),
                ("userKey", Kind::Text),
            ],
        )?;
        let items = self
            .conversations
            .iter()
            .map(|r| &r.conversation)
            .filter(|c| c.bot_id.as_ref().is_some_and(|b| b.as_str() == bot_id))
            .filter(|c| {
                conversation_matches(
                    c,
                    q.end_user_id.as_deref(),
                    q.platform.as_deref(),
                    q.user_key.as_deref(),
                )
            })
            .collect();
        page(items, &q.page)
    }

    /// `ListFlows`: all flows of one bot (none is an empty list).
    fn list_flows(&self, path: &PathParams<'_>, query: &Value) -> Result<Value, ErrorAnswer> {
        no_query(query)?;
        let bot = self.bot(path.get("botId")?)?;
        let data = self.flows.get(&bot.id).cloned().unwrap_or_default();
        to_json(&FlowList { data })
    }

    /// `GetConversation`: one conversation by id.
    fn get_conversation(&self, path: &PathParams<'_>, query: &Value) -> Result<Value, ErrorAnswer> {
        no_query(query)?;
        let i = self.conversation_index(path.get("conversationId")?)?;
        to_json(&self.conversations[i].conversation)
    }

    /// `UpdateConversation`: merges params into a conversation and answers it.
    fn update_conversation(
        &mut self,
        path: &PathParams<'_>,
        body: Option<&Value>,
        now: Millis,
    ) -> Result<Value, ErrorAnswer> {
        let i = self.conversation_index(path.get("conversationId")?)?;
        let req: api::UpdateConversation = parse_body(body)?;
        self.update_params(i, req.params, now);
        to_json(&self.conversations[i].conversation)
    }

    /// `SetManual`: turns a conversation's manual mode on or off and answers the manual record.
    fn put_manual(
        &mut self,
        path: &PathParams<'_>,
        body: Option<&Value>,
        now: Millis,
    ) -> Result<Value, ErrorAnswer> {
        let i = self.conversation_index(path.get("conversationId")?)?;
        let req: api::SetManual = parse_body(body)?;
        self.set_manual(i, req.enabled, now);
        to_json(&self.manual(i))
    }

    /// `GetManual`: a conversation's manual record.
    fn get_manual(&self, path: &PathParams<'_>, query: &Value) -> Result<Value, ErrorAnswer> {
        no_query(query)?;
        let i = self.conversation_index(path.get("conversationId")?)?;
        to_json(&self.manual(i))
    }

    /// `ListConversationMessages`: a page of one conversation's messages in a time range.
    fn list_conversation_messages(
        &self,
        path: &PathParams<'_>,
        query: &Value,
    ) -> Result<Value, ErrorAnswer> {
        let i = self.conversation_index(path.get("conversationId")?)?;
        let q: MessageRangeQuery = parse_query(
            query,
            &[
                PAGE[0],
                PAGE[1],
                ("from", Kind::Millis),
                ("to", Kind::Millis),
            ],
        )?;
        let id = self.conversations[i].conversation.id.clone();
        let items =
            self.messages_where(|m| m.conversation_id == id && in_range(m.timestamp, q.from, q.to));
        page(items, &q.page)
    }

    /// `SendConversationMessage`: the bot sends a message into a conversation.
    fn send_conversation_message(
        &mut self,
        path: &PathParams<'_>,
        body: Option<&Value>,
        now: Millis,
    ) -> Result<Value, ErrorAnswer> {
        let i = self.conversation_index(path.get("conversationId")?)?;
        let req: SendMessage = parse_body(body)?;
        check_message(&req.message, req.custom.as_deref())?;
        let m = self.append_bot_message(i, req.message, req.custom, now);
        to_json(&m)
    }

    /// `SetNavigation`: moves a conversation to a flow and node, answering the navigation.
    fn set_navigation(
        &mut self,
        path: &PathParams<'_>,
        body: Option<&Value>,
        now: Millis,
    ) -> Result<Value, ErrorAnswer> {
        let i = self.conversation_index(path.get("conversationId")?)?;
        let req: api::SetNavigation = parse_body(body)?;
        let nav = self.navigate(i, req, now)?;
        to_json(&nav)
    }

    /// `ListConversations`: a page of all conversations, filtered by bot, end user, platform,
    /// user key and update time.
    fn list_conversations(&self, query: &Value) -> Result<Value, ErrorAnswer> {
        let q: ConversationsQuery = parse_query(
            query,
            &[
                PAGE[0],
                PAGE[1],
                ("botId", Kind::Text),
                ("endUserId", Kind::Text),
                ("platform", Kind::Text),
                ("userKey", Kind::Text),
                ("from", Kind::Millis),
                ("to", Kind::Millis),
            ],
        )?;
        let items = self
            .conversations
            .iter()
            .filter(|r| {
                filter_eq(
                    q.bot_id.as_deref(),
                    r.conversation.bot_id.as_ref().map(BotId::as_str),
                )
            })
            .filter(|r| {
                conversation_matches(
                    &r.conversation,
                    q.end_user_id.as_deref(),
                    q.platform.as_deref(),
                    q.user_key.as_deref(),
                )
            })
            .filter(|r| in_range(Some(r.updated_ms), q.from, q.to))
            .map(|r| &r.conversation)
            .collect();
        page(items, &q.page)
    }

    /// `GetEndUser`: one end user by id.
    fn get_end_user(&self, path: &PathParams<'_>, query: &Value) -> Result<Value, ErrorAnswer> {
        no_query(query)?;
        let i = self.end_user_index(path.get("id")?)?;
        to_json(&self.end_users[i])
    }

    /// `ListEndUsers`: a page of end users, filtered by bot, platform and user key.
    fn list_end_users(&self, query: &Value) -> Result<Value, ErrorAnswer> {
        let q: EndUsersQuery = parse_query(
            query,
            &[
                PAGE[0],
                PAGE[1],
                ("botId", Kind::Text),
                ("platform", Kind::Text),
                ("userKey", Kind::Text),
            ],
        )?;
        let items = self
            .end_users
            .iter()
            .filter(|e| {
                filter_eq(q.bot_id.as_deref(), e.bot_id.as_ref().map(BotId::as_str))
                    && filter_eq(q.platform.as_deref(), Some(e.platform.as_str()))
                    && filter_eq(q.user_key.as_deref(), Some(e.user_key.as_str()))
            })
            .collect();
        page(items, &q.page)
    }

    /// `SendEndUserMessage`: the bot sends a message into the end user's newest conversation.
    fn send_end_user_message(
        &mut self,
        body: Option<&Value>,
        now: Millis,
    ) -> Result<Value, ErrorAnswer> {
        let req: SendToEndUser = parse_body(body)?;
        check_message(&req.message, req.custom.as_deref())?;
        let eu = self.end_user_index(&req.end_user_id)?;
        let eu_id = self.end_users[eu].id.clone();
        let i = self.newest_conversation(&eu_id).ok_or_else(|| {
            ErrorAnswer::conflict(format!("end user {eu_id} has no conversation"))
        })?;
        let m = self.append_bot_message(i, req.message, req.custom, now);
        to_json(&m)
    }

    /// `ListMessages`: a page of all messages, filtered by conversation, end user, sender and
    /// time.
    fn list_messages(&self, query: &Value) -> Result<Value, ErrorAnswer> {
        let q: MessagesQuery = parse_query(
            query,
            &[
                PAGE[0],
                PAGE[1],
                ("conversationId", Kind::Text),
                ("endUserId", Kind::Text),
                ("isUser", Kind::Bool),
                ("from", Kind::Millis),
                ("to", Kind::Millis),
            ],
        )?;
        let items = self.messages_where(|m| {
            filter_eq(
                q.conversation_id.as_deref(),
                Some(m.conversation_id.as_str()),
            ) && filter_eq(
                q.end_user_id.as_deref(),
                m.end_user_id.as_ref().map(EndUserId::as_str),
            ) && q.is_user.is_none_or(|u| m.is_user == u)
                && in_range(m.timestamp, q.from, q.to)
        });
        page(items, &q.page)
    }

    /// `PbGetConversation`: one user's counseling state in a partner channel.
    fn pb_get_conversation(
        &self,
        path: &PathParams<'_>,
        query: &Value,
    ) -> Result<Value, ErrorAnswer> {
        no_query(query)?;
        let (s, u) = (path.get("senderKey")?, path.get("userKey")?);
        to_json(self.pb_user(s, u)?)
    }

    /// `PbUpdateConversation`: changes a partner-channel user's status, assignee or memo.
    fn pb_update_conversation(
        &mut self,
        path: &PathParams<'_>,
        body: Option<&Value>,
        now: Millis,
    ) -> Result<Value, ErrorAnswer> {
        let (s, u) = (path.get("senderKey")?, path.get("userKey")?);
        self.pb_user(s, u)?;
        let req: UpdatePbConversation = parse_body(body)?;
        let raw = body.and_then(Value::as_object);
        // An explicit `null` clears assignee or memo; an absent field leaves it alone.
        let cleared = |name: &str| raw.and_then(|o| o.get(name)).is_some_and(Value::is_null);
        if raw.is_some_and(|o| o.get("status").is_some_and(Value::is_null)) {
            return Err(ErrorAnswer::invalid_body("`status` cannot be null"));
        }
        let (clear_assignee, clear_memo) = (cleared("assignee"), cleared("memo"));
        let conv = self.pb_user_mut(s, u)?;
        if let Some(status) = req.status {
            conv.status = status;
        }
        if let Some(a) = req.assignee {
            conv.assignee = Some(a);
        } else if clear_assignee {
            conv.assignee = None;
        }
        if let Some(m) = req.memo {
            conv.memo = Some(m);
        } else if clear_memo {
            conv.memo = None;
        }
        conv.updated_at = now;
        to_json(&*conv)
    }

    /// `PbBlock`: blocks a partner-channel user (409 if already blocked), keeping the reason.
    fn pb_block(
        &mut self,
        path: &PathParams<'_>,
        body: Option<&Value>,
        now: Millis,
    ) -> Result<Value, ErrorAnswer> {
        let (s, u) = (path.get("senderKey")?, path.get("userKey")?);
        self.pb_user(s, u)?;
        let req: BlockRequest = match body {
            None | Some(Value::Null) => BlockRequest::default(),
            Some(_) => parse_body(body)?,
        };
        let conv = self.pb_user_mut(s, u)?;
        if conv.blocked {
            return Err(ErrorAnswer::conflict(format!(
                "user {u} is already blocked"
            )));
        }
        conv.blocked = true;
        conv.blocked_at = Some(now);
        conv.updated_at = now;
        let answer = to_json(&*conv)?;
        if let (Some(reason), Some(ch)) = (req.reason, self.channels.get_mut(s)) {
            ch.block_reasons.insert(u.to_owned(), reason);
        }
        Ok(answer)
    }

    /// `PbUnblock`: unblocks a partner-channel user (409 if not blocked).
    fn pb_unblock(&mut self, path: &PathParams<'_>, now: Millis) -> Result<Value, ErrorAnswer> {
        let (s, u) = (path.get("senderKey")?, path.get("userKey")?);
        let conv = self.pb_user_mut(s, u)?;
        if !conv.blocked {
            return Err(ErrorAnswer::conflict(format!("user {u} is not blocked")));
        }
        conv.blocked = false;
        conv.blocked_at = None;
        conv.updated_at = now;
        let answer = to_json(&*conv)?;
        if let Some(ch) = self.channels.get_mut(s) {
            ch.block_reasons.remove(u);
        }
        Ok(answer)
    }

    /// `PbRemoveSession`: ends a partner-channel user's active session (409 if none).
    fn pb_remove_session(
        &mut self,
        path: &PathParams<'_>,
        now: Millis,
    ) -> Result<Value, ErrorAnswer> {
        let (s, u) = (path.get("senderKey")?, path.get("userKey")?);
        let conv = self.pb_user_mut(s, u)?;
        if !conv.session.active {
            return Err(ErrorAnswer::conflict(format!(
                "user {u} has no active session"
            )));
        }
        conv.session = PbSession {
            active: false,
            started_at: None,
        };
        conv.updated_at = now;
        to_json(&*conv)
    }

    /// `PbSendMessage`: sends a message to an unblocked user through a partner channel.
    fn pb_send_message(
        &mut self,
        path: &PathParams<'_>,
        body: Option<&Value>,
        now: Millis,
    ) -> Result<Value, ErrorAnswer> {
        let s = path.get("senderKey")?;
        self.channel(s)?;
        let req: api::PbSendMessage = parse_body(body)?;
        validate::user_key(&req.user_key, "userKey").map_err(ErrorAnswer::invalid_body)?;
        validate::message_data(&req.message, "message").map_err(ErrorAnswer::invalid_body)?;
        if self.pb_user(s, &req.user_key)?.blocked {
            return Err(ErrorAnswer::conflict(format!(
                "user {} is blocked in channel {s}",
                req.user_key
            )));
        }
        let message_id = self.new_id("e5000000");
        self.partner_messages.push(PartnerMessage {
            message_id: message_id.clone(),
            sender_key: s.to_owned(),
            user_key: req.user_key.clone(),
            message: req.message,
            sent_at: now,
        });
        to_json(&PbSent {
            message_id,
            user_key: req.user_key,
            sent_at: now,
        })
    }

    /// `PbUpdateSetting`: changes the given fields of a partner channel's setting.
    fn pb_update_setting(
        &mut self,
        path: &PathParams<'_>,
        body: Option<&Value>,
    ) -> Result<Value, ErrorAnswer> {
        let s = path.get("senderKey")?;
        self.channel(s)?;
        let req: ChannelSetting = parse_body(body)?;
        validate::channel_setting(&req).map_err(ErrorAnswer::invalid_body)?;
        let ch = self
            .channels
            .get_mut(s)
            .ok_or_else(|| ErrorAnswer::not_found(format!("no channel {s}")))?;
        if let Some(v) = req.auto_reply {
            ch.setting.auto_reply = Some(v);
        }
        if let Some(v) = req.welcome_message {
            ch.setting.welcome_message = Some(v);
        }
        if let Some(v) = req.business_hours {
            ch.setting.business_hours = Some(v);
        }
        to_json(&ch.setting)
    }

    /// `NotifySend`: renders a template for a recipient and records the notification.
    fn notify_send(&mut self, body: Option<&Value>, now: Millis) -> Result<Value, ErrorAnswer> {
        let req: NotifyRequest = parse_body(body)?;
        if req.recipient.trim().is_empty() {
            return Err(ErrorAnswer::invalid_body("`recipient` must not be empty"));
        }
        validate::user_key(&req.recipient, "recipient").map_err(ErrorAnswer::invalid_body)?;
        let text = self.render_notification(&req)?;
        let message_id = self.new_id("e6000000");
        self.notifications.push(SentNotification {
            message_id: message_id.clone(),
            sender_key: req.sender_key,
            template_code: req.template_code,
            recipient: req.recipient,
            text,
            sent_at: now,
        });
        to_json(&NotifyResult {
            message_id,
            status: "accepted".to_owned(),
        })
    }

    /// The text of a notification: the sender's template with the request's variables filled
    /// in. The channel and template must exist (404) and the variables match exactly (422).
    fn render_notification(&self, req: &NotifyRequest) -> Result<String, ErrorAnswer> {
        self.channel(&req.sender_key)?;
        let key = (req.sender_key.clone(), req.template_code.clone());
        let template = self.templates.get(&key).ok_or_else(|| {
            ErrorAnswer::not_found(format!(
                "no template {} for sender {}",
                req.template_code, req.sender_key
            ))
        })?;
        let missing: Vec<&str> = template
            .variables
            .iter()
            .filter(|v| !req.variables.contains_key(*v))
            .map(String::as_str)
            .collect();
        let extra: Vec<&str> = req
            .variables
            .keys()
            .filter(|k| !template.variables.contains(k))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() || !extra.is_empty() {
            return Err(ErrorAnswer::template_mismatch(format!(
                "template {} needs variables {:?}; missing {missing:?}, not in the template {extra:?}",
                req.template_code, template.variables
            )));
        }
        let mut text = template.text.clone();
        for (name, value) in &req.variables {
            text = text.replace(&format!("#{{{name}}}"), value);
        }
        Ok(text)
    }

    fn bot(&self, id: &str) -> Result<&Bot, ErrorAnswer> {
        self.bots
            .iter()
            .find(|b| b.id.as_str() == id)
            .ok_or_else(|| ErrorAnswer::not_found(format!("no bot {id}")))
    }

    fn conversation_index(&self, id: &str) -> Result<usize, ErrorAnswer> {
        self.conversation_index
            .get(&ConversationId::new(id))
            .copied()
            .ok_or_else(|| ErrorAnswer::not_found(format!("no conversation {id}")))
    }

    fn end_user_index(&self, id: &str) -> Result<usize, ErrorAnswer> {
        self.end_user_index
            .get(&EndUserId::new(id))
            .copied()
            .ok_or_else(|| ErrorAnswer::not_found(format!("no end user {id}")))
    }

    fn channel(&self, sender_key: &str) -> Result<&Channel, ErrorAnswer> {
        self.channels
            .get(sender_key)
            .ok_or_else(|| ErrorAnswer::not_found(format!("no channel {sender_key}")))
    }

    fn pb_user(&self, sender_key: &str, user_key: &str) -> Result<&PbConversation, ErrorAnswer> {
        self.channel(sender_key)?
            .users
            .get(user_key)
            .ok_or_else(|| {
                ErrorAnswer::not_found(format!("no user {user_key} in channel {sender_key}"))
            })
    }

    fn pb_user_mut(
        &mut self,
        sender_key: &str,
        user_key: &str,
    ) -> Result<&mut PbConversation, ErrorAnswer> {
        self.channels
            .get_mut(sender_key)
            .ok_or_else(|| ErrorAnswer::not_found(format!("no channel {sender_key}")))?
            .users
            .get_mut(user_key)
            .ok_or_else(|| {
                ErrorAnswer::not_found(format!("no user {user_key} in channel {sender_key}"))
            })
    }

    fn manual(&self, i: usize) -> ManualStatus {
        let r = &self.conversations[i];
        ManualStatus {
            conversation_id: r.conversation.id.as_str().to_owned(),
            enabled: r.manual.enabled,
            status: r.manual.enabled.then(|| HANDOVER.to_owned()),
            updated_at: r.manual.updated_at,
        }
    }

    /// Change a conversation's manual status as an agent in the builder would: no webhook, no
    /// journal entry (the `/_emulator/conversations/{id}/manual` control path). The drift the
    /// reconciliation sweeper must find.
    pub fn set_manual_silently(
        &mut self,
        conversation_id: &str,
        enabled: bool,
        now: Millis,
    ) -> Result<ManualStatus, ErrorAnswer> {
        let i = self.conversation_index(conversation_id)?;
        self.set_manual(i, enabled, now);
        Ok(self.manual(i))
    }

    /// Also mirrored into `context.manual.status`, where webhook consumers read it. Setting the
    /// value it already has changes nothing, not even `updatedAt`.
    fn set_manual(&mut self, i: usize, enabled: bool, now: Millis) {
        let r = &mut self.conversations[i];
        if r.manual.enabled == enabled {
            return;
        }
        r.manual = ManualRecord {
            enabled,
            updated_at: now,
        };
        let ctx = r.conversation.context.get_or_insert_with(Context::default);
        ctx.manual.get_or_insert_with(Default::default).status =
            enabled.then(|| HANDOVER.to_owned());
        touch(r, now);
    }

    /// Merges params (a `null` value removes the key), in the conversation and its context.
    fn update_params(&mut self, i: usize, params: Map<String, Value>, now: Millis) {
        let r = &mut self.conversations[i];
        let merge = |target: &mut Map<String, Value>| {
            for (k, v) in &params {
                if v.is_null() {
                    target.remove(k);
                } else {
                    target.insert(k.clone(), v.clone());
                }
            }
        };
        merge(r.conversation.params.get_or_insert_with(Map::new));
        if let Some(ctx) = r.conversation.context.as_mut() {
            merge(ctx.params.get_or_insert_with(Map::new));
        }
        touch(r, now);
    }

    /// Moves the conversation: `prev` becomes where it was. The flow and node must exist in the
    /// conversation's bot, else 400 (the conversation exists; the body is wrong).
    fn navigate(
        &mut self,
        i: usize,
        req: api::SetNavigation,
        now: Millis,
    ) -> Result<Navigation, ErrorAnswer> {
        let bot_id = self.conversations[i].conversation.bot_id.clone();
        let flow = bot_id
            .as_ref()
            .and_then(|b| self.flows.get(b))
            .and_then(|flows| flows.iter().find(|f| f.id == req.flow_id))
            .ok_or_else(|| {
                ErrorAnswer::invalid_body(format!(
                    "flow {} does not exist in bot {}",
                    req.flow_id,
                    bot_id.as_ref().map_or("?", BotId::as_str)
                ))
            })?;
        let node_id = match req.node_id {
            Some(n) if flow.nodes.iter().any(|x| x.id == n) => n,
            Some(n) => {
                return Err(ErrorAnswer::invalid_body(format!(
                    "node {n} does not exist in flow {}",
                    flow.id
                )))
            }
            None => flow.nodes.first().map(|n| n.id).ok_or_else(|| {
                ErrorAnswer::invalid_body(format!("flow {} has no nodes", flow.id))
            })?,
        };
        let r = &mut self.conversations[i];
        let prev = r
            .conversation
            .effective_navigation()
            .and_then(|n| n.current);
        let visits = r.visits.entry((req.flow_id, node_id)).or_insert(0);
        *visits += 1;
        let nav = Navigation {
            current: Some(Node {
                flow_id: req.flow_id,
                node_id,
                visit_count: Some(*visits),
            }),
            prev,
        };
        r.conversation.navigation = Some(nav.clone());
        if let Some(ctx) = r.conversation.context.as_mut() {
            ctx.navigation = Some(nav.clone());
        }
        touch(r, now);
        Ok(nav)
    }

    /// The end user's conversation created last (ties: the one added last).
    fn newest_conversation(&self, end_user: &EndUserId) -> Option<usize> {
        self.conversations
            .iter()
            .enumerate()
            .filter(|(_, r)| r.conversation.end_user_id.as_ref() == Some(end_user))
            .max_by_key(|(i, r)| (r.created_ms, *i))
            .map(|(i, _)| i)
    }

    fn append_bot_message(
        &mut self,
        i: usize,
        data: MessageData,
        custom: Option<String>,
        now: Millis,
    ) -> Message {
        let id = self.new_id("e4000000");
        let r = &mut self.conversations[i];
        let message = Message {
            id: id.clone(),
            end_user_id: r.conversation.end_user_id.clone(),
            conversation_id: r.conversation.id.clone(),
            is_user: false,
            meta: custom.map(|c| MessageMeta {
                custom: Some(c),
                ..MessageMeta::default()
            }),
            data,
            timestamp: Some(now),
            request_id: None,
        };
        touch(r, now);
        if let Some(eu) = message
            .end_user_id
            .as_ref()
            .and_then(|e| self.end_user_index.get(e))
            .and_then(|&k| self.end_users.get_mut(k))
        {
            eu.last_message_id = Some(id.clone());
            eu.last_conversation_id = Some(message.conversation_id.clone());
        }
        self.message_ids.insert(id);
        self.messages.push(message.clone());
        // The service echoes what the bot sends as `bot.message.sent`.
        let bot_id = self.conversations[i].conversation.bot_id.clone();
        self.emit(
            "bot.message.sent",
            bot_id,
            now,
            json!({ "message": message }),
        );
        message
    }

    /// Start collecting webhook events (a webhook sender is attached).
    pub fn enable_events(&mut self) {
        self.events.get_or_insert_with(Default::default);
    }

    /// Events collected since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<PendingWebhook> {
        self.events
            .as_mut()
            .map(|events| std::mem::take(events).into())
            .unwrap_or_default()
    }

    /// The oldest `max` events collected (a delivery's worth), the rest left for the next.
    pub fn take_events_up_to(&mut self, max: usize) -> Vec<PendingWebhook> {
        match self.events.as_mut() {
            Some(events) if events.len() > max => events.drain(..max).collect(),
            Some(events) => std::mem::take(events).into(),
            None => Vec::new(),
        }
    }

    /// Taken events the sender could not deliver (the webhook was disabled meanwhile) go back in
    /// front of the queue, to be re-sent with the same ids once it is enabled again.
    pub fn requeue_events(&mut self, taken: Vec<PendingWebhook>) {
        if let Some(events) = self.events.as_mut() {
            for event in taken.into_iter().rev() {
                events.push_front(event);
            }
            let over = events.len().saturating_sub(MAX_HELD_EVENTS);
            if over > 0 {
                events.drain(..over);
                self.webhook.dropped += over as u64;
                self.undelivered = self.undelivered.saturating_sub(over as u64);
            }
        }
        self.delivery_progress.notify_waiters();
    }

    /// The webhook's health (enabled or disabled, and why).
    pub fn webhook(&self) -> &crate::webhook_status::WebhookStatus {
        &self.webhook
    }

    pub fn webhook_mut(&mut self) -> &mut crate::webhook_status::WebhookStatus {
        &mut self.webhook
    }

    fn emit(&mut self, kind: &str, bot_id: Option<BotId>, at: Millis, data: Value) {
        if let Some(events) = self.events.as_mut() {
            if events.len() >= MAX_HELD_EVENTS {
                // The oldest goes: O(1), a webhook disabled for long emits at full speed.
                events.pop_front();
                self.webhook.dropped += 1;
            } else {
                self.undelivered += 1;
            }
            events.push_back(PendingWebhook {
                id: uuid::Uuid::new_v4().to_string(),
                kind: kind.to_owned(),
                bot_id: bot_id.map(|b| b.as_str().to_owned()).unwrap_or_default(),
                at,
                data,
            });
        }
    }

    /// The sender finished with `n` taken events (delivered, or given up on).
    pub fn events_done(&mut self, n: u64) {
        self.undelivered = self.undelivered.saturating_sub(n);
        self.delivery_progress.notify_waiters();
    }

    /// Events emitted but not yet through the sender, and the signal of its progress.
    pub fn delivery_status(&self) -> (u64, std::sync::Arc<tokio::sync::Notify>) {
        (self.undelivered, self.delivery_progress.clone())
    }

    /// A conversation as the webhook shows it.
    pub fn conversation_object(&self, id: &str) -> Option<Conversation> {
        let i = self.conversation_index.get(&ConversationId::new(id))?;
        self.conversations.get(*i).map(|r| r.conversation.clone())
    }

    /// What a user typing into the messenger does: a user message in the conversation, and its
    /// `bot.message.received` event.
    pub fn user_says(
        &mut self,
        conversation_id: &str,
        data: MessageData,
        now: Millis,
    ) -> Result<Message, ErrorAnswer> {
        let i = self.conversation_index(conversation_id)?;
        let id = self.new_id("e5000000");
        let r = &mut self.conversations[i];
        let message = Message {
            id: id.clone(),
            end_user_id: r.conversation.end_user_id.clone(),
            conversation_id: r.conversation.id.clone(),
            is_user: true,
            meta: None,
            data,
            timestamp: Some(now),
            request_id: None,
        };
        touch(r, now);
        let bot_id = r.conversation.bot_id.clone();
        self.message_ids.insert(id);
        self.messages.push(message.clone());
        self.emit(
            "bot.message.received",
            bot_id,
            now,
            json!({ "message": message }),
        );
        Ok(message)
    }

    /// An agent-call lifecycle step (`agent_call_requested`, `_connected`, `_cancelled`,
    /// `_disconnected`) as the service would report it. Connecting turns manual mode on; ending
    /// or cancelling turns it off, as the service's own agent console does.
    pub fn agent_call(
        &mut self,
        conversation_id: &str,
        step: &str,
        now: Millis,
    ) -> Result<Conversation, ErrorAnswer> {
        let i = self.conversation_index(conversation_id)?;
        match step {
            "agent_call_connected" => self.set_manual(i, true, now),
            "agent_call_disconnected" | "agent_call_cancelled" => self.set_manual(i, false, now),
            "agent_call_requested" => {}
            other => {
                return Err(ErrorAnswer::invalid_body(format!(
                    "unknown agent-call step {other}"
                )))
            }
        }
        let conversation = self.conversations[i].conversation.clone();
        let kind = format!("bot.conversation.{step}");
        self.emit(
            &kind,
            conversation.bot_id.clone(),
            now,
            json!({ "conversation": conversation }),
        );
        Ok(conversation)
    }

    fn messages_where(&self, keep: impl Fn(&Message) -> bool) -> Vec<&Message> {
        let mut out: Vec<&Message> = self.messages.iter().filter(|m| keep(m)).collect();
        out.sort_by_key(|m| m.timestamp.unwrap_or(0));
        out
    }

    /// A UUID-shaped id, unique in this state; deterministic so test runs repeat.
    fn new_id(&mut self, prefix: &str) -> String {
        loop {
            let id = format!("{prefix}-0000-4000-8000-{:012x}", self.next_id);
            self.next_id += 1;
            if !self.message_ids.contains(&id) {
                return id;
            }
        }
    }

    /// Messages sent through partner channels, oldest first.
    pub fn partner_messages(&self) -> &[PartnerMessage] {
        &self.partner_messages
    }

    /// Notifications accepted, oldest first.
    pub fn notifications(&self) -> &[SentNotification] {
        &self.notifications
    }

    /// Everything, for `GET /_emulator/state` and tests.
    pub fn snapshot(&self) -> Value {
        json!({
            "bots": self.bots,
            "flows": self.flows,
            "endUsers": self.end_users,
            "conversations": self.conversations,
            "messages": self.messages_where(|_| true),
            "channels": self.channels,
            "templates": self.templates.iter().map(|((s, c), t)| json!({
                "senderKey": s, "code": c, "text": t.text, "variables": t.variables,
            })).collect::<Vec<_>>(),
            "partnerMessages": self.partner_messages,
            "notifications": self.notifications,
            "webhook": self.webhook,
        })
    }
}

/// A seeded partner channel: each of its users with the counseling state the seed states, or
/// the starting one.
fn seed_channel(ch: &SeedChannel) -> Channel {
    let mut users = BTreeMap::new();
    for key in &ch.user_keys {
        let stated = ch.conversations.iter().find(|c| &c.user_key == key);
        users.insert(
            key.clone(),
            seed_pb_conversation(&ch.sender_key, key, stated),
        );
    }
    Channel {
        bot_id: ch.bot_id.clone(),
        users,
        block_reasons: BTreeMap::new(),
        setting: ch.setting.clone(),
    }
}

/// One partner-channel user's starting counseling state: as stated in the seed, else waiting,
/// unblocked and without a session.
fn seed_pb_conversation(
    sender_key: &str,
    user_key: &str,
    stated: Option<&SeedPbConversation>,
) -> PbConversation {
    match stated {
        Some(s) => PbConversation {
            sender_key: sender_key.to_owned(),
            user_key: user_key.to_owned(),
            status: s.status.unwrap_or(PbStatus::Waiting),
            assignee: s.assignee.clone(),
            memo: s.memo.clone(),
            blocked: s.blocked,
            blocked_at: s.blocked_at.filter(|_| s.blocked),
            session: PbSession {
                active: s.session_started_at.is_some(),
                started_at: s.session_started_at,
            },
            updated_at: s.updated_at.unwrap_or(0),
        },
        None => PbConversation {
            sender_key: sender_key.to_owned(),
            user_key: user_key.to_owned(),
            status: PbStatus::Waiting,
            assignee: None,
            memo: None,
            blocked: false,
            blocked_at: None,
            session: PbSession {
                active: false,
                started_at: None,
            },
            updated_at: 0,
        },
    }
}

fn touch(r: &mut ConversationRecord, now: Millis) {
    r.updated_ms = now;
    r.conversation.updated_at = Some(format_iso_millis(now));
}

fn conversation_matches(
    c: &Conversation,
    end_user_id: Option<&str>,
    platform: Option<&str>,
    user_key: Option<&str>,
) -> bool {
    filter_eq(end_user_id, c.end_user_id.as_ref().map(EndUserId::as_str))
        && filter_eq(platform, c.platform.as_ref().map(|p| p.as_str()))
        && filter_eq(user_key, c.user_key.as_ref().map(UserKey::as_str))
}

/// An absent filter matches everything; a present one only an equal value.
fn filter_eq(filter: Option<&str>, value: Option<&str>) -> bool {
    filter.is_none() || filter == value
}

/// `from` and `to` are inclusive; an item without a time matches only an open range.
fn in_range(t: Option<Millis>, from: Option<Millis>, to: Option<Millis>) -> bool {
    match t {
        Some(t) => from.is_none_or(|f| t >= f) && to.is_none_or(|x| t <= x),
        None => from.is_none() && to.is_none(),
    }
}

fn check_message(data: &MessageData, custom: Option<&str>) -> Result<(), ErrorAnswer> {
    validate::message_data(data, "message").map_err(ErrorAnswer::invalid_body)?;
    if let Some(c) = custom {
        validate::custom(c, "custom").map_err(ErrorAnswer::invalid_body)?;
    }
    Ok(())
}

fn to_json<T: Serialize + ?Sized>(value: &T) -> Result<Value, ErrorAnswer> {
    serde_json::to_value(value)
        .map_err(|e| ErrorAnswer::internal(format!("cannot encode answer: {e}")))
}

fn page<T: Serialize>(items: Vec<&T>, q: &PageQuery) -> Result<Value, ErrorAnswer> {
    let offset = q.offset.unwrap_or(0);
    let limit = q.limit.unwrap_or(DEFAULT_LIMIT);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(ErrorAnswer::invalid_query(format!(
            "`limit` is {limit}; it must be from 1 to {MAX_LIMIT}"
        )));
    }
    let total = items.len() as u64;
    let data: Vec<&T> = items
        .into_iter()
        .skip(offset as usize)
        .take(limit as usize)
        .collect();
    to_json(&Page {
        data,
        paging: Paging {
            offset,
            limit,
            total,
        },
    })
}

/// A body is required and must be a JSON object of the request type.
fn parse_body<T: DeserializeOwned>(body: Option<&Value>) -> Result<T, ErrorAnswer> {
    let body = body.ok_or_else(|| ErrorAnswer::invalid_body("a JSON body is required"))?;
    if !body.is_object() {
        return Err(ErrorAnswer::invalid_body("the body must be a JSON object"));
    }
    T::deserialize(body).map_err(|e| ErrorAnswer::invalid_body(format!("invalid body: {e}")))
}

/// Endpoints without query parameters still refuse unknown ones.
fn no_query(query: &Value) -> Result<(), ErrorAnswer> {
    parse_query::<Map<String, Value>>(query, &[]).map(|_| ())
}

/// Reads query parameters that arrive as text into the typed query struct. Unknown names are
/// refused, so a misspelt filter is not silently ignored.
fn parse_query<T: DeserializeOwned>(
    query: &Value,
    known: &[(&str, Kind)],
) -> Result<T, ErrorAnswer> {
    let empty = Map::new();
    let params = match query {
        Value::Null => &empty,
        Value::Object(o) => o,
        _ => {
            return Err(ErrorAnswer::invalid_query(
                "the query must be a set of name=value pairs",
            ))
        }
    };
    let mut typed = Map::new();
    for (name, value) in params {
        let Some((_, kind)) = known.iter().find(|(k, _)| k == name) else {
            let names: Vec<&str> = known.iter().map(|(k, _)| *k).collect();
            return Err(ErrorAnswer::invalid_query(if names.is_empty() {
                format!("unknown query parameter `{name}`; this endpoint takes none")
            } else {
                format!(
                    "unknown query parameter `{name}`; known: {}",
                    names.join(", ")
                )
            }));
        };
        let text = match value {
            Value::String(s) => s.clone(),
            Value::Number(_) | Value::Bool(_) => value.to_string(),
            _ => {
                return Err(ErrorAnswer::invalid_query(format!(
                    "`{name}` must be a single value"
                )))
            }
        };
        let parsed = match kind {
            Kind::Count => text.parse::<u32>().map(Value::from).map_err(|_| {
                format!(
                    "`{name}` is {text:?}; expected a whole number from 0 to {}",
                    u32::MAX
                )
            }),
            Kind::Millis => text
                .parse::<i64>()
                .map(Value::from)
                .map_err(|_| format!("`{name}` is {text:?}; expected Unix milliseconds")),
            Kind::Bool => match text.as_str() {
                "true" => Ok(Value::Bool(true)),
                "false" => Ok(Value::Bool(false)),
                _ => Err(format!("`{name}` is {text:?}; expected true or false")),
            },
            Kind::Text if text.is_empty() => Err(format!("`{name}` must not be empty")),
            Kind::Text => Ok(Value::String(text)),
        };
        typed.insert(name.clone(), parsed.map_err(ErrorAnswer::invalid_query)?);
    }
    T::deserialize(Value::Object(typed)).map_err(|e| ErrorAnswer::invalid_query(e.to_string()))
}

#[cfg(test)]
mod tests;
