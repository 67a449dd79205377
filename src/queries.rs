//! Read-only views shared by the admin API and the offline CLI, so both print the same JSON.

use serde_json::{json, Value};
use storage::Storage;
use storage::StoreError;

/// An end user by messenger identity, with their newest conversation's state.
pub fn find_end_user(
    store: &dyn Storage,
    platform: &str,
    user_key: &str,
) -> Result<Option<Value>, StoreError> {
    let Some(user) = store.find_end_user(platform, user_key)? else {
        return Ok(None);
    };
    let last = match &user.last_conversation_id.value {
        Some(id) => store.conversation(id)?,
        None => None,
    };
    Ok(Some(json!({ "endUser": user, "lastConversation": last })))
}

/// The most of a body [`quarantine_view`] shows; `GET /admin/v1/quarantine/{id}/body` returns
/// the whole of it.
pub const QUARANTINE_VIEW_BODY: usize = 1024 * 1024;

/// A quarantine record with its body (at most [`QUARANTINE_VIEW_BODY`] bytes of it:
/// `body_truncated` says whether that is all, `body_bytes` is its whole size), also shown as text
/// when it is UTF-8. `body_base64` is the body as received, also when the store keeps it
/// compressed.
pub fn quarantine_view(record: &storage::QuarantineRecord) -> Value {
    use base64::Engine as _;
    let total = record.body_len();
    let body = record.body_prefix(QUARANTINE_VIEW_BODY).ok();
    let mut v = serde_json::to_value(record).unwrap_or(Value::Null);
    if let Some(obj) = v.as_object_mut() {
        obj.remove("body_gzip");
        obj.insert("body_bytes".into(), json!(total));
        let shown = body.as_ref().map_or(0, Vec::len) as u64;
        obj.insert("body_truncated".into(), json!(shown < total));
        if let Some(body) = &body {
            let b64 = base64::engine::general_purpose::STANDARD.encode(body);
            obj.insert("body_base64".into(), Value::String(b64));
        }
        if let Some(text) = body.and_then(utf8_prefix) {
            obj.insert("body_text".into(), Value::String(text));
        }
    }
    v
}

/// The bytes as text when they are UTF-8, but for a character the cut split at their end.
fn utf8_prefix(bytes: Vec<u8>) -> Option<String> {
    match String::from_utf8(bytes) {
        Ok(text) => Some(text),
        Err(e) if e.utf8_error().error_len().is_none() => {
            let valid = e.utf8_error().valid_up_to();
            let mut bytes = e.into_bytes();
            bytes.truncate(valid);
            String::from_utf8(bytes).ok()
        }
        Err(_) => None,
    }
}

/// Items in an admin list page by default, and at most.
pub const PAGE: usize = 100;
pub const PAGE_MAX: usize = 1000;

/// Why a list page's query was refused (the admin API answers 400 with [`PageError::code`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    #[error("limit must be a whole number from 1 to {PAGE_MAX}, not `{0}`")]
    Limit(String),
    #[error("after must be a page's `next`, not `{0}`")]
    Cursor(String),
}

impl PageError {
    pub fn code(&self) -> &'static str {
        match self {
            PageError::Limit(_) => "invalid_limit",
            PageError::Cursor(_) => "invalid_cursor",
        }
    }
}

/// What the query said, cut short: an error never echoes a long string back.
fn shown(text: &str) -> String {
    text.chars().take(40).collect()
}

/// A list's position: what a page's `next` holds and the next page's `after` gives back.
pub trait PageCursor: Sized {
    /// From the query's text; `None` when it is not a cursor of this list.
    fn parse(text: &str) -> Option<Self>;
    /// As a page's `next`.
    fn to_json(&self) -> Value;
}

/// The lists in seq order (outbox, dead letters, finished entries) and the quarantine (by record
/// id) continue after a number.
impl PageCursor for u64 {
    fn parse(text: &str) -> Option<Self> {
        text.parse().ok()
    }

    fn to_json(&self) -> Value {
        json!(self)
    }
}

/// The lists in id order (conversations, end users) continue after an id, given as an opaque
/// string: a marker byte and the id's bytes in URL-safe base64 without padding, so any id travels
/// in a query unescaped, even the empty one (an end user's id may be empty) gives a cursor that
/// is not empty, and a cursor that no page gave is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdCursor(String);

impl IdCursor {
    /// The byte before the id in a cursor.
    const MARKER: u8 = b'i';
    /// The longest cursor read (ids are far shorter).
    const MAX_TEXT: usize = 4096;

    pub fn of(id: &str) -> Self {
        IdCursor(id.to_owned())
    }

    pub fn id(&self) -> &str {
        &self.0
    }
}

impl PageCursor for IdCursor {
    fn parse(text: &str) -> Option<Self> {
        use base64::Engine as _;
        if text.is_empty() || text.len() > Self::MAX_TEXT {
            return None;
        }
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(text)
            .ok()?;
        let id = bytes.strip_prefix(&[Self::MARKER])?;
        String::from_utf8(id.to_vec()).ok().map(IdCursor)
    }

    fn to_json(&self) -> Value {
        use base64::Engine as _;
        let mut bytes = Vec::with_capacity(1 + self.0.len());
        bytes.push(Self::MARKER);
        bytes.extend_from_slice(self.0.as_bytes());
        Value::String(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes))
    }
}

/// A list page's position: `limit` (default [`PAGE`], 1..=[`PAGE_MAX`]) items after the cursor
/// `after` (the previous page's `next`; from the first when absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRequest<C = u64> {
    pub after: Option<C>,
    pub limit: usize,
}

impl<C: PageCursor> PageRequest<C> {
    /// From the query's text values, as given (absent: the default).
    pub fn parse(limit: Option<&str>, after: Option<&str>) -> Result<PageRequest<C>, PageError> {
        let limit = match limit.map(str::trim) {
            None => PAGE,
            Some(text) => text
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=PAGE_MAX).contains(n))
                .ok_or_else(|| PageError::Limit(shown(text)))?,
        };
        let after = match after.map(str::trim) {
            None => None,
            Some(text) => Some(C::parse(text).ok_or_else(|| PageError::Cursor(shown(text)))?),
        };
        Ok(PageRequest { after, limit })
    }
}

#[cfg(test)]
impl<C> PageRequest<C> {
    fn first(limit: usize) -> PageRequest<C> {
        PageRequest { after: None, limit }
    }

    /// The same size of page, after `cursor`.
    fn after(self, cursor: C) -> PageRequest<C> {
        PageRequest {
            after: Some(cursor),
            ..self
        }
    }
}

/// Read one more than the page holds: the extra one only says another page follows, and the
/// cursor to it is the page's last item's.
fn paged<T, C>(
    page: PageRequest<C>,
    read: impl FnOnce(Option<C>, usize) -> Result<Vec<T>, StoreError>,
    cursor: impl Fn(&T) -> C,
) -> Result<(Vec<T>, Option<C>), StoreError> {
    let limit = page.limit.clamp(1, PAGE_MAX);
    let mut items = read(page.after, limit + 1)?;
    let next = if items.len() > limit {
        items.truncate(limit);
        items.last().map(&cursor)
    } else {
        None
    };
    Ok((items, next))
}

/// A page as every list answers it: `{"count": n in this page, <items>: [...], "next": the
/// cursor to the next page, or null after the last}`.
fn page_json<T: serde::Serialize, C: PageCursor>(
    items_key: &str,
    items: &[T],
    next: Option<C>,
) -> Value {
    let mut page = serde_json::Map::new();
    page.insert("count".into(), json!(items.len()));
    page.insert(items_key.into(), json!(items));
    page.insert("next".into(), next.as_ref().map_or(Value::Null, C::to_json));
    Value::Object(page)
}

/// The admin API's lists, each paged the same way (`limit`, `after`, `next`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum List {
    /// Conversation summaries in id order.
    Conversations,
    /// End-user summaries in id order.
    EndUsers,
    /// Quarantine records (metadata only) in id order.
    Quarantine,
    /// Pending outbox entries in decision (seq) order.
    Outbox,
    /// Finished entries (done or dropped), newest (highest seq) first.
    Done,
    /// Dead letters in decision (seq) order.
    DeadLetters,
}

impl List {
    /// Its path under the admin API.
    pub fn path(self) -> &'static str {
        match self {
            List::Conversations => "/admin/v1/conversations",
            List::EndUsers => "/admin/v1/endusers",
            List::Quarantine => "/admin/v1/quarantine",
            List::Outbox => "/admin/v1/outbox",
            List::Done => "/admin/v1/outbox/done",
            List::DeadLetters => "/admin/v1/dead-letters",
        }
    }

    /// The array a page holds its items in.
    pub fn items(self) -> &'static str {
        match self {
            List::Conversations => "conversations",
            List::EndUsers => "end_users",
            List::Quarantine => "records",
            List::Outbox => "entries",
            List::Done => "finished",
            List::DeadLetters => "dead_letters",
        }
    }

    /// The page the query's text values ask for, with this list's kind of cursor.
    pub fn query(self, limit: Option<&str>, after: Option<&str>) -> Result<ListQuery, PageError> {
        Ok(match self {
            List::Conversations => ListQuery::Conversations(PageRequest::parse(limit, after)?),
            List::EndUsers => ListQuery::EndUsers(PageRequest::parse(limit, after)?),
            List::Quarantine => ListQuery::Quarantine(PageRequest::parse(limit, after)?),
            List::Outbox => ListQuery::Outbox(PageRequest::parse(limit, after)?),
            List::Done => ListQuery::Done(PageRequest::parse(limit, after)?),
            List::DeadLetters => ListQuery::DeadLetters(PageRequest::parse(limit, after)?),
        })
    }
}

/// A valid page query of one list ([`List::query`]), read with [`ListQuery::read`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListQuery {
    Conversations(PageRequest<IdCursor>),
    EndUsers(PageRequest<IdCursor>),
    Quarantine(PageRequest),
    Outbox(PageRequest),
    Done(PageRequest),
    DeadLetters(PageRequest),
}

impl ListQuery {
    /// The page from the store, as the admin API answers it (the outbox's caller adds what the
    /// executor knows: `depth`, `paused`).
    pub fn read(self, store: &dyn Storage) -> Result<Value, StoreError> {
        match self {
            ListQuery::Conversations(page) => conversations_list(store, page),
            ListQuery::EndUsers(page) => end_users_list(store, page),
            ListQuery::Quarantine(page) => quarantine_list(store, page),
            ListQuery::Outbox(page) => outbox_list(store, page),
            ListQuery::Done(page) => done_list(store, page),
            ListQuery::DeadLetters(page) => dead_letters_list(store, page),
        }
    }
}

/// A conversation in the list: who and where it stands, not its whole state
/// (`/conversations/{id}` has that).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ConversationSummary {
    pub id: model::ids::ConversationId,
    pub bot_id: Option<model::ids::BotId>,
    pub end_user_id: Option<model::ids::EndUserId>,
    pub platform: Option<model::webhook::model::Platform>,
    pub phase: engine::state::HandoffPhase,
    /// When the phase began.
    pub phase_since: model::webhook::model::Millis,
    pub manual_status: Option<String>,
    pub events_applied: u64,
    pub created_at: Option<model::webhook::model::Millis>,
    pub last_event_at: model::webhook::model::Millis,
    pub deleted_at: Option<model::webhook::model::Millis>,
}

impl From<engine::state::ConversationState> for ConversationSummary {
    fn from(s: engine::state::ConversationState) -> Self {
        ConversationSummary {
            id: s.id,
            bot_id: s.bot_id,
            end_user_id: s.end_user_id,
            platform: s.platform,
            phase: s.handoff.phase.value,
            phase_since: s.handoff.phase.stamp.at,
            manual_status: s.manual_status.value,
            events_applied: s.events_applied,
            created_at: s.created_at,
            last_event_at: s.last_event_at,
            deleted_at: s.deleted_at,
        }
    }
}

/// An end user in the list (`state find` / `?platform=&userKey=` has their newest
/// conversation too).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EndUserSummary {
    pub id: model::ids::EndUserId,
    pub bot_id: Option<model::ids::BotId>,
    pub platform: Option<model::webhook::model::Platform>,
    pub user_key: Option<model::ids::UserKey>,
    pub last_conversation_id: Option<model::ids::ConversationId>,
    pub events_applied: u64,
    pub last_event_at: model::webhook::model::Millis,
    pub deleted_at: Option<model::webhook::model::Millis>,
}

impl From<engine::state::EndUserState> for EndUserSummary {
    fn from(u: engine::state::EndUserState) -> Self {
        EndUserSummary {
            id: u.id,
            bot_id: u.bot_id,
            platform: u.platform,
            user_key: u.user_key,
            last_conversation_id: u.last_conversation_id.value,
            events_applied: u.events_applied,
            last_event_at: u.last_event_at,
            deleted_at: u.deleted_at,
        }
    }
}

/// One page of the conversations in id order, as summaries: `{"count", "conversations",
/// "next"}`, read from the store a page at a time (`Store::conversations_page`).
pub fn conversations_list(
    store: &dyn Storage,
    page: PageRequest<IdCursor>,
) -> Result<Value, StoreError> {
    let (states, next) = paged(
        page,
        |a, l| store.conversations_page(a.as_ref().map(IdCursor::id), l),
        |s| IdCursor::of(s.id.as_str()),
    )?;
    let items: Vec<ConversationSummary> = states.into_iter().map(Into::into).collect();
    Ok(page_json(List::Conversations.items(), &items, next))
}

/// One page of the end users in id order, as summaries: `{"count", "end_users", "next"}`.
pub fn end_users_list(
    store: &dyn Storage,
    page: PageRequest<IdCursor>,
) -> Result<Value, StoreError> {
    let (users, next) = paged(
        page,
        |a, l| store.end_users_page(a.as_ref().map(IdCursor::id), l),
        |u| IdCursor::of(u.id.as_str()),
    )?;
    let items: Vec<EndUserSummary> = users.into_iter().map(Into::into).collect();
    Ok(page_json(List::EndUsers.items(), &items, next))
}

/// One page of the quarantine list, metadata only: `{"count", "records", "next"}`, and
/// `next_after` (the same cursor, the name this list answered with first) while more remain.
pub fn quarantine_list(store: &dyn Storage, page: PageRequest) -> Result<Value, StoreError> {
    let limit = page.limit.clamp(1, PAGE_MAX);
    let (records, next) = store.quarantine_page(page.after, limit)?;
    let mut value = page_json(List::Quarantine.items(), &records, next);
    if let (Some(next), Some(obj)) = (next, value.as_object_mut()) {
        obj.insert("next_after".into(), json!(next));
    }
    Ok(value)
}

/// One page of the pending outbox entries, in decision order: `{"count", "entries", "next"}`.
/// The caller adds what the executor knows (`depth`, `paused`).
pub fn outbox_list(store: &dyn Storage, page: PageRequest) -> Result<Value, StoreError> {
    let (entries, next) = paged(page, |a, l| store.outbox_page(a, l), |e| e.seq)?;
    Ok(page_json(List::Outbox.items(), &entries, next))
}

/// One page of the finished entries (done or dropped) still in the audit window, newest (highest
/// seq) first: `{"count", "finished", "next"}`; `after` a seq gives the older ones below it.
pub fn done_list(store: &dyn Storage, page: PageRequest) -> Result<Value, StoreError> {
    let (records, next) = paged(page, |a, l| store.finished_page(a, l), |r| r.entry.seq)?;
    Ok(page_json(List::Done.items(), &records, next))
}

/// One page of the dead letters, oldest decision first: `{"count", "dead_letters", "next"}`.
pub fn dead_letters_list(store: &dyn Storage, page: PageRequest) -> Result<Value, StoreError> {
    let (letters, next) = paged(page, |a, l| store.dead_letters_page(a, l), |l| l.entry.seq)?;
    Ok(page_json(List::DeadLetters.items(), &letters, next))
}

/// A conversation's timeline, to answer "why did the bot (not) do that?": each stored event in
/// order, rebuilt through the fold's own step (`engine::replay::Rebuilt`, as a replay does: with the rules
/// in force, on the state rebuilt from the conversation's events, with its end user as stored now,
/// at the event's receive time), so a rule its firing cap held back shows as capped, a timer
/// firing whose timer was cancelled or restarted decides nothing (`stale_timer`), a message the
/// other path (webhook or backfill) brought first decides nothing (`duplicate_message`, its
/// `MESSAGE.id`), a backfilled event says so (`source: backfill`), and the echo of the bridge's
/// own message shows as one (`echo_of`). Each rule that listens to the event: matched
/// (with the tests of its `when` that held and the values they saw, and the actions it decides),
/// capped, or not (the first condition that failed with its value, or the rule whose `stop` ended
/// the event). Then every action recorded for the event with its outcome (done, dropped, dead
/// letter, pending, and `template_error` for an action whose template failed when the fold
/// decided it) and the rule-set version that decided it. Events older than the event retention
/// are gone from the timeline. `explain`: the rule set behind `rules`, when it is one (each
/// rule's verdict is then explained; `LiveRules::current_explained` gives both).
pub fn audit(
    store: &dyn Storage,
    rules: &dyn engine::decide::Decide,
    explain: Option<&engine::rules::RuleSet>,
    conversation: &model::ids::ConversationId,
) -> Result<Option<Value>, StoreError> {
    match store.conversation(conversation)? {
        Some(current) => audit_of(store, rules, explain, &current).map(Some),
        None => Ok(None),
    }
}

/// [`audit`] of a conversation whose state the caller read already.
pub fn audit_of(
    store: &dyn Storage,
    rules: &dyn engine::decide::Decide,
    explain: Option<&engine::rules::RuleSet>,
    current: &engine::state::ConversationState,
) -> Result<Value, StoreError> {
    let conversation = &current.id;
    let partition = model::ids::PartitionKey::Conversation(conversation.clone());
    let records = store.partition_events(&partition)?;
    let mut recorded = recorded_actions(store, &records, current)?;
    let mut rebuild = Rebuild {
        store,
        rules,
        explain,
        rebuilt: engine::replay::Rebuilt::new(conversation.clone()),
        end_users: engine::replay::EndUsers::default(),
    };
    let mut timeline = Vec::with_capacity(records.len());
    for (record, pending) in records {
        let mut item = rebuild.item(&record, pending)?;
        let mut actions = recorded.remove(record.id.as_str()).unwrap_or_default();
        // In decision order (outbox position), whatever became of them.
        actions.sort_by_key(|a| a["seq"].as_u64().unwrap_or(u64::MAX));
        item["actions"] = Value::Array(actions);
        timeline.push(item);
    }
    Ok(json!({
        "conversation_id": conversation.as_str(),
        "rules_version": rules.version(),
        "note": "rules are re-evaluated with the rules in force now; each action shows the version that decided it",
        "timers": current.timers,
        "labels": current.labels,
        "phase": current.handoff.phase.value,
        "timeline": timeline,
    }))
}

/// What was recorded for each event of the audit (by event id): finished, dead and pending
/// actions, found through the ledger (a prefix range per event, then the records by seq: never
/// the whole ledger, dead letters or outbox, whatever their size), and failed templates.
fn recorded_actions(
    store: &dyn Storage,
    records: &[(storage::EventRecord, bool)],
    current: &engine::state::ConversationState,
) -> Result<std::collections::HashMap<String, Vec<Value>>, StoreError> {
    let mut recorded: std::collections::HashMap<String, Vec<Value>> = Default::default();
    let mut add = |entry: &model::action::OutboxEntry, status: &str, extra: Value| {
        let mut item = json!({
            "seq": entry.seq,
            "id": entry.id,
            "rule": entry.rule,
            "type": entry.action.name(),
            "rules_version": entry.rules_version,
            "status": status,
        });
        if let (Some(obj), Value::Object(more)) = (item.as_object_mut(), extra) {
            obj.extend(more);
        }
        recorded
            .entry(entry.event_id.as_str().to_owned())
            .or_default()
            .push(item);
    };
    for (record, _) in records {
        let event = record.id.as_str();
        for seq in store.action_seqs_of_event(event)? {
            let ours = |entry: &model::action::OutboxEntry| entry.event_id.as_str() == event;
            if let Some(done) = store.finished_one(seq)?.filter(|d| ours(&d.entry)) {
                let extra = json!({"at": done.at, "attempts": done.attempts, "note": done.note});
                add(&done.entry, &done.outcome, extra);
            }
            if let Some(dead) = store.dead_letter(seq)?.filter(|d| ours(&d.entry)) {
                let extra = json!({"at": dead.last_attempt_at, "attempts": dead.attempts, "reason": dead.reason});
                add(&dead.entry, "dead_letter", extra);
            }
            if let Some(entry) = store.outbox_entry(seq)?.filter(ours) {
                add(&entry, "pending", json!({}));
            }
        }
    }
    // Never queued, so without a seq: listed after the event's queued actions.
    for failed in &current.template_errors {
        recorded
            .entry(failed.event.clone())
            .or_default()
            .push(json!({
                "id": failed.id,
                "rule": failed.rule,
                "index": failed.index,
                "type": failed.kind,
                "status": "template_error",
                "error": failed.error,
                "at": failed.at,
            }));
    }
    Ok(recorded)
}

/// The conversation's state rebuilt event by event as the fold did, for the audit's timeline
/// (the step a replay takes too: `engine::replay::Rebuilt`).
struct Rebuild<'a> {
    store: &'a dyn Storage,
    rules: &'a dyn engine::decide::Decide,
    explain: Option<&'a engine::rules::RuleSet>,
    rebuilt: engine::replay::Rebuilt,
    /// End users as stored now, each read once.
    end_users: engine::replay::EndUsers,
}

impl Rebuild<'_> {
    /// One event's line of the timeline: the event, and (when it parses) what the rules decided
    /// for it and why; the state moves on past it.
    fn item(&mut self, record: &storage::EventRecord, pending: bool) -> Result<Value, StoreError> {
        let mut item = json!({
            "received_at": record.received_at,
            "event_id": record.id.as_str(),
            "type": record.kind,
            "pending": pending,
        });
        let Ok(event) = model::webhook::parse_event(record.event.get()) else {
            return Ok(item);
        };
        if let model::webhook::model::Payload::Message(m) = &event.payload {
            item["sender"] = json!(m.sender());
            item["message_type"] = json!(m.data.kind.as_str());
        }
        if let Some(of) = model::action::echo::echo_of(&event) {
            item["echo_of"] = json!(of);
        }
        let store = self.store;
        let state = &self.rebuilt.state;
        let user = self.end_users.of(state, &event, |id| store.end_user(id))?;
        // The states the rules see, for the explanation (before the event, and after it is
        // folded in, before their firings are recorded); the decision itself is the fold's.
        let before = self.explain.map(|_| state.clone());
        let mut folded = None;
        let time = engine::decide::DecisionTime::at(record.received_at);
        let decided = self
            .rebuilt
            .step(&event, self.rules, user, time, &mut |after| {
                if before.is_some() {
                    folded = Some(after.clone());
                }
            });
        if model::webhook::is_backfilled(&event) {
            item["source"] = json!(model::webhook::BACKFILL_SOURCE);
        }
        let Some(decided) = decided else {
            match &event.payload {
                // The same message came by the other path (webhook or backfill) first.
                model::webhook::model::Payload::Message(m) => {
                    item["duplicate_message"] = json!(m.id);
                }
                _ => item["stale_timer"] = json!(true),
            }
            return Ok(item);
        };
        if let (Some(set), Some(before), Some(folded)) = (self.explain, &before, &folded) {
            let inputs = engine::decide::Inputs {
                before: Some(before),
                end_user: user,
                queue: None,
            };
            item["rules"] = explained(set, (&event, folded), inputs, record.received_at, &decided);
        }
        Ok(item)
    }
}

/// Each rule that listens to the event, with what the fold decided and the explanation's
/// reasons (see [`rule_view`]).
fn explained(
    set: &engine::rules::RuleSet,
    (event, folded): (
        &model::webhook::model::Event,
        &engine::state::ConversationState,
    ),
    inputs: engine::decide::Inputs<'_>,
    at: model::webhook::model::Millis,
    decided: &engine::decide::Decided,
) -> Value {
    use engine::rules::explain::{self, Judgement};
    let verdicts = explain::explain(set, event, folded, inputs, at);
    let mut held = explain::conditions_held(set, event, folded, inputs, at);
    let shown: Vec<Value> = verdicts
        .iter()
        .filter(|v| !matches!(v.verdict, Judgement::NotListening | Judgement::Disabled))
        .map(|v| rule_view(v, decided, held.remove(&v.rule)))
        .collect();
    Value::Array(shown)
}

/// One rule's line in the audit: what the fold decided (fired or capped) wins over the
/// explanation, which supplies the reasons.
fn rule_view(
    v: &engine::rules::explain::RuleVerdict,
    decided: &engine::decide::Decided,
    held: Option<Vec<engine::rules::condition::Observation>>,
) -> Value {
    use engine::rules::explain::Judgement;
    if let Some(hit) = decided.capped.iter().find(|c| c.rule == v.rule) {
        return json!({
            "rule": v.rule,
            "matched": true,
            "capped": true,
            "fired": hit.fired,
            "cap": {"count": hit.cap.count, "per": humantime::format_duration(hit.cap.per).to_string()},
            "conditions": held.unwrap_or_default(),
        });
    }
    if decided.fired.iter().any(|f| f.rule == v.rule) {
        let mut actions: Vec<(usize, Value)> = decided
            .decisions
            .iter()
            .filter(|d| d.rule == v.rule)
            .map(|d| (d.index, json!(d.action.name())))
            .collect();
        actions.extend(
            decided
                .failed
                .iter()
                .filter(|f| f.rule == v.rule)
                .map(|f| (f.index, json!({"type": f.kind, "template_error": f.error}))),
        );
        actions.sort_by_key(|(index, _)| *index);
        return json!({
            "rule": v.rule,
            "matched": true,
            "conditions": held.unwrap_or_default(),
            "actions": actions.into_iter().map(|(_, a)| a).collect::<Vec<_>>(),
        });
    }
    match &v.verdict {
        Judgement::NoMatch { failure } => json!({
            "rule": v.rule, "matched": false, "failed": failure,
        }),
        Judgement::Stopped { by } => json!({
            "rule": v.rule, "matched": false, "stopped_by": by,
        }),
        Judgement::Echo { of } => json!({
            "rule": v.rule, "matched": false, "echo_of": of,
        }),
        _ => json!({"rule": v.rule, "matched": false}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_query_is_a_limit_from_1_to_1000_and_a_seq_cursor() {
        let page = |l: Option<&str>, a: Option<&str>| PageRequest::<u64>::parse(l, a);
        assert_eq!(page(None, None), Ok(PageRequest::first(PAGE)));
        assert_eq!(
            page(Some("1000"), Some("42")),
            Ok(PageRequest::first(1000).after(42))
        );
        assert_eq!(page(Some(" 7 "), None), Ok(PageRequest::first(7)));
        for bad in ["0", "1001", "-1", "ten", "", "1e3"] {
            let e = page(Some(bad), None).expect_err(bad);
            assert_eq!(e.code(), "invalid_limit", "{bad}");
        }
        for bad in ["-1", "x", "", "18446744073709551616"] {
            let e = page(None, Some(bad)).expect_err(bad);
            assert_eq!(e.code(), "invalid_cursor", "{bad}");
        }
        // What the caller sent is echoed, cut short: never a long string back.
        let long = "9".repeat(500);
        let e = page(Some(&long), None).expect_err("long");
        assert!(e.to_string().len() < 200, "{e}");
    }

    #[test]
    fn an_id_cursor_is_the_id_opaque_and_anything_else_is_refused() {
        for id in [
            "5c0e9b1f-2222-4d3e-9f10-000000000001",
            "a b/c?d&e=f",
            "김민지",
            "x",
            "",
        ] {
            let next = IdCursor::of(id).to_json();
            let text = next.as_str().expect("a string");
            assert!(
                text.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
                "travels in a query unescaped: {text}"
            );
            let page = PageRequest::<IdCursor>::parse(Some("5"), Some(text)).expect(id);
            assert_eq!(page.after.as_ref().map(IdCursor::id), Some(id));
            assert_eq!(page.limit, 5);
        }
        let (not_utf8, no_marker) = {
            use base64::Engine as _;
            let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
            (b64.encode([b'i', 0xff, 0xfe]), b64.encode("c1"))
        };
        let long = "A".repeat(5000);
        for bad in ["", "!!", "a+b/", "abc=", "A", &not_utf8, &no_marker, &long] {
            let e = PageRequest::<IdCursor>::parse(None, Some(bad)).expect_err(bad);
            assert_eq!(e.code(), "invalid_cursor", "{bad:?}");
            assert!(e.to_string().len() < 200, "{e}");
        }
    }

    #[test]
    fn every_list_takes_the_same_limits_and_its_own_kind_of_cursor() {
        let id_cursor = IdCursor::of("c1").to_json();
        let id_cursor = id_cursor.as_str().expect("string");
        for list in [
            List::Conversations,
            List::EndUsers,
            List::Quarantine,
            List::Outbox,
            List::Done,
            List::DeadLetters,
        ] {
            for bad in ["0", "1001", "x"] {
                let e = list.query(Some(bad), None).expect_err(bad);
                assert_eq!(e.code(), "invalid_limit", "{list:?} {bad}");
            }
            let by_id = matches!(list, List::Conversations | List::EndUsers);
            // An id cursor is no seq, and "-1" no id cursor (one byte, 0xfb: no marker, not UTF-8).
            let (good, bad) = if by_id {
                (id_cursor, "-1")
            } else {
                ("42", id_cursor)
            };
            assert!(list.query(Some("1000"), Some(good)).is_ok(), "{list:?}");
            let e = list.query(None, Some(bad)).expect_err(bad);
            assert_eq!(e.code(), "invalid_cursor", "{list:?} {bad}");
            assert!(list.path().starts_with("/admin/v1/"), "{list:?}");
        }
    }
}
