//! What the bridge tells Chatwoot, by desk event kind. Every step is written into the
//! conversation's mapping ([`DeskLink`]) as it is done, so a retry (after a failure, a crash, an
//! uncertain answer) resumes: a conversation is created once (an uncertain create is looked for
//! first, by the action id in its custom attributes), a message is posted once (by its
//! `source_id`, looked for after an uncertain post).
//!
//! - `handoff.requested`: the contact found (its identifier matched exactly) or created; a new
//!   conversation in the inbox, `open`, with custom attributes and team; its labels (the full
//!   list: labels replace); then the transcript, the user's messages as `incoming`, the bot's and
//!   agents' as private notes.
//! - `conversation.message`: the user's message as `incoming` (a bot's as a private note).
//! - reminders, connects, blocks: a private note.
//! - the hand-back (`timed_out`, `cancelled`, `ended`): a private note, the mapping closed (the
//!   next handoff opens a new conversation: posting into a resolved API-inbox conversation would
//!   reopen it), then the conversation resolved.

use super::client::{id_at, Post, NAME};
use super::Chatwoot;
use crate::helpdesk::port::{DeskError, DeskEvent};
use model::helpdesk::DeskEventKind;
use model::webhook::model::{Message, MessageData, Sender};
use serde_json::{json, Value};
use storage::desk_links::{DeskContact, DeskLink};

/// What marks the bridge's own messages (`source_id`), so their echoes are recognised.
pub const SOURCE_PREFIX: &str = "handoff-bridge:";

/// The mapping's marker for a create whose outcome is not known.
const CREATING: &str = "conversation";
/// The mapping's marker for the labels set.
const LABELS: &str = "labels";

/// The bridge-owned id of a service message posted into Chatwoot.
pub fn message_source_id(message_id: &str) -> String {
    format!("{SOURCE_PREFIX}msg:{message_id}")
}

impl Chatwoot {
    /// One attempt at `event` (`again`: an earlier one failed, so a call may have taken effect).
    pub(super) async fn carry_out(&self, event: &DeskEvent, again: bool) -> Result<(), DeskError> {
        match event.kind {
            DeskEventKind::HandoffRequested => self.open(event, again).await,
            DeskEventKind::ConversationMessage => self.user_message(event, again).await,
            DeskEventKind::HandoffTimedOut
            | DeskEventKind::HandoffCancelled
            | DeskEventKind::HandoffEnded => self.hand_back(event, again).await,
            DeskEventKind::HandoffReminder
            | DeskEventKind::QueueUpdated
            | DeskEventKind::HandoffConnected
            | DeskEventKind::UserBlocked
            | DeskEventKind::UserUnblocked => {
                let Some(mut link) = self.open_link(event)? else {
                    return Ok(());
                };
                self.note(&mut link, event, again).await
            }
        }
    }

    /// The conversation's mapping, when it has an open Chatwoot conversation.
    fn open_link(&self, event: &DeskEvent) -> Result<Option<DeskLink>, DeskError> {
        let link = self.link(event)?;
        Ok(link.filter(|l| l.remote.is_some() && l.closed_at.is_none()))
    }

    fn link(&self, event: &DeskEvent) -> Result<Option<DeskLink>, DeskError> {
        self.store
            .desk_link(NAME, &event.conversation_id)
            .map_err(store_failed)
    }

    fn save(&self, link: &mut DeskLink) -> Result<(), DeskError> {
        link.updated_at = self.store.clock().now_millis();
        self.store.put_desk_link(link).map_err(store_failed)
    }

    /// `handoff.requested`: a conversation opened (or resumed) and filled.
    async fn open(&self, event: &DeskEvent, again: bool) -> Result<(), DeskError> {
        let mut link = self.link(event)?.unwrap_or_else(|| DeskLink {
            connector: NAME.to_owned(),
            conversation_id: event.conversation_id.as_str().to_owned(),
            ..DeskLink::default()
        });
        let open = link.remote.is_some() && link.closed_at.is_none();
        if open && link.opened_by != event.action_id {
            // Asked again while its conversation is still open: said there, nothing reopened.
            return self.note(&mut link, event, again).await;
        }
        if link.opened_by != event.action_id || link.closed_at.is_some() {
            link.reopen(&event.action_id);
            self.save(&mut link)?;
        }
        let bot = event.conversation.as_ref().and_then(|c| c.bot_id.as_ref());
        let (inbox, team, labels) = self.config.bot(bot.map(|b| b.as_str()));
        let (contact, source) = self.contact(event, inbox).await?;
        if link.remote.is_none() {
            link.contact = Some(contact.clone());
            let remote = self
                .conversation(&mut link, event, (&contact, &source), (inbox, team))
                .await?;
            link.remote = Some(remote);
            link.uncertain = None;
            self.save(&mut link)?;
        }
        let remote = link.remote.clone().unwrap_or_default();
        if !link.was_posted(LABELS) {
            self.api
                .set_labels(&remote, &self.labels(event, labels))
                .await?;
            link.posted(LABELS);
            self.save(&mut link)?;
        }
        let transcript = event.transcript.as_ref().map(|t| t.messages.as_slice());
        for m in transcript.unwrap_or_default() {
            self.post_message(&mut link, m, again).await?;
        }
        Ok(())
    }

    /// `conversation.message`: posted into the open conversation.
    async fn user_message(&self, event: &DeskEvent, again: bool) -> Result<(), DeskError> {
        let (Some(mut link), Some(m)) = (self.open_link(event)?, &event.message) else {
            return Ok(());
        };
        self.post_message(&mut link, m, again).await
    }

    /// The hand-back: a note, the mapping closed, the conversation resolved.
    async fn hand_back(&self, event: &DeskEvent, again: bool) -> Result<(), DeskError> {
        let Some(mut link) = self.link(event)? else {
            return Ok(());
        };
        let Some(remote) = link.remote.clone() else {
            return Ok(());
        };
        if link.closed_at.is_none() {
            self.note(&mut link, event, again).await?;
            // Closed before the resolve: its echo, and any late event of it, is then stale.
            link.closed_at = Some(self.store.clock().now_millis());
            self.save(&mut link)?;
        }
        // Resolving a resolved conversation changes nothing: a retry (or a crash between the
        // close and the resolve) resolves again.
        self.api.resolve(&remote).await
    }

    /// A private note about `event` in the linked conversation.
    async fn note(
        &self,
        link: &mut DeskLink,
        event: &DeskEvent,
        again: bool,
    ) -> Result<(), DeskError> {
        let source = format!("{SOURCE_PREFIX}note:{}", event.action_id);
        let text = note_text(event);
        self.post(link, &text, (false, true), &source, again).await
    }

    /// A service message: the user's as `incoming`, another's as a private note.
    async fn post_message(
        &self,
        link: &mut DeskLink,
        m: &Message,
        again: bool,
    ) -> Result<(), DeskError> {
        let source = message_source_id(&m.id);
        let text = content_of(&m.data);
        match m.sender() {
            Sender::User => self.post(link, &text, (true, false), &source, again).await,
            Sender::Bot => {
                let note = format!("Bot: {text}");
                self.post(link, &note, (false, true), &source, again).await
            }
            Sender::Agent => {
                let note = format!("Agent (at the service): {text}");
                self.post(link, &note, (false, true), &source, again).await
            }
        }
    }

    /// Post once: skipped when posted before; after an uncertain attempt, looked for first.
    async fn post(
        &self,
        link: &mut DeskLink,
        content: &str,
        (incoming, private): (bool, bool),
        source: &str,
        again: bool,
    ) -> Result<(), DeskError> {
        let Some(remote) = link.remote.clone() else {
            return Ok(());
        };
        if link.was_posted(source) {
            return Ok(());
        }
        if (again || link.uncertain.as_deref() == Some(source))
            && self.already_there(&remote, source).await?
        {
            link.posted(source);
            return self.save(link);
        }
        link.uncertain = Some(source.to_owned());
        self.save(link)?;
        let post = Post {
            content,
            incoming,
            private,
            source_id: source,
        };
        self.api.post_message(&remote, &post).await?;
        link.posted(source);
        self.save(link)
    }

    /// Whether a message with `source` is among the conversation's newest.
    async fn already_there(&self, remote: &str, source: &str) -> Result<bool, DeskError> {
        let answer = self.api.list_messages(remote).await?;
        let messages = answer["payload"].as_array().map(Vec::as_slice);
        Ok(messages
            .unwrap_or_default()
            .iter()
            .any(|m| m["source_id"].as_str() == Some(source)))
    }

    /// The Chatwoot conversation of this handoff: the one an uncertain earlier attempt created
    /// (found by the action id among the contact's conversations), else a new one.
    async fn conversation(
        &self,
        link: &mut DeskLink,
        event: &DeskEvent,
        (contact, source): (&str, &str),
        (inbox, team): (u64, Option<u64>),
    ) -> Result<String, DeskError> {
        if again_or_uncertain(link) {
            let answer = self.api.contact_conversations(contact).await?;
            let found = answer["payload"].as_array().and_then(|all| {
                all.iter().find(|c| {
                    c["custom_attributes"]["handoff_action"].as_str() == Some(&event.action_id)
                })
            });
            if let Some(id) = found.and_then(|c| id_at(c, "/id")) {
                return Ok(id);
            }
        }
        link.uncertain = Some(CREATING.to_owned());
        self.save(link)?;
        let mut body = json!({
            "source_id": source,
            "inbox_id": inbox,
            "contact_id": contact.parse::<u64>().map_or_else(|_| json!(contact), |n| json!(n)),
            "status": "open",
            "custom_attributes": custom_attributes(event),
        });
        if let Some(team) = team {
            body["team_id"] = json!(team);
        }
        let answer = self.api.create_conversation(body).await?;
        let id = id_at(&answer, "/id").ok_or_else(|| bad_answer("a conversation without id"))?;
        if link.earlier.contains(&id) {
            tracing::warn!(conversation = %id, "Chatwoot answered an earlier conversation: the inbox locks to a single conversation (turn lock_to_single_conversation off)");
        }
        Ok(id)
    }

    /// The end user's contact (its id, and its source id in `inbox`): kept in the mappings,
    /// else found by the bridge's identifier (matched exactly), else created.
    async fn contact(&self, event: &DeskEvent, inbox: u64) -> Result<(String, String), DeskError> {
        let user = identifier(event);
        let inbox_key = inbox.to_string();
        let kept = self.store.desk_contact(NAME, &user).map_err(store_failed)?;
        if let Some(c) = &kept {
            if let Some(source) = c.extra[&inbox_key].as_str() {
                return Ok((c.contact.clone(), source.to_owned()));
            }
        }
        let (contact, source) = match self.find_contact(&user, inbox).await? {
            Some(found) => found,
            None => self.create_contact(event, &user, inbox).await?,
        };
        let source = match source {
            Some(source) => source,
            None => {
                let answer = self.api.add_contact_inbox(&contact, inbox, &user).await?;
                id_at(&answer, "/source_id").unwrap_or_else(|| user.clone())
            }
        };
        let mut record = kept.unwrap_or_else(|| DeskContact {
            connector: NAME.to_owned(),
            user: user.clone(),
            ..DeskContact::default()
        });
        record.contact = contact.clone();
        if !record.extra.is_object() {
            record.extra = json!({});
        }
        record.extra[&inbox_key] = json!(source);
        record.updated_at = self.store.clock().now_millis();
        self.store.put_desk_contact(&record).map_err(store_failed)?;
        Ok((contact, source))
    }

    /// The contact whose identifier is exactly `user`, and its source id in `inbox` if it has
    /// one there.
    async fn find_contact(
        &self,
        user: &str,
        inbox: u64,
    ) -> Result<Option<(String, Option<String>)>, DeskError> {
        let answer = self.api.search_contacts(user).await?;
        let found = answer["payload"]
            .as_array()
            .and_then(|all| all.iter().find(|c| c["identifier"].as_str() == Some(user)));
        let Some(c) = found else {
            return Ok(None);
        };
        let id = id_at(c, "/id").ok_or_else(|| bad_answer("a contact without id"))?;
        let source = c["contact_inboxes"].as_array().and_then(|all| {
            all.iter()
                .find(|ci| ci["inbox"]["id"].as_u64() == Some(inbox))
                .and_then(|ci| id_at(ci, "/source_id"))
        });
        Ok(Some((id, source)))
    }

    /// A new contact in `inbox` with the bridge's identifier (and its own source id there). One
    /// that exists already (a create whose answer was lost: 422) is found instead.
    async fn create_contact(
        &self,
        event: &DeskEvent,
        user: &str,
        inbox: u64,
    ) -> Result<(String, Option<String>), DeskError> {
        let body = json!({
            "inbox_id": inbox,
            "name": contact_name(event),
            "identifier": user,
            "source_id": user,
        });
        let answer = match self.api.create_contact(body).await {
            Err(DeskError::Refused { status: 422, .. }) => {
                return self
                    .find_contact(user, inbox)
                    .await?
                    .ok_or_else(|| bad_answer("the contact exists (422) but is not found"));
            }
            other => other?,
        };
        // The running code answers `payload.contact`; the document shows the contact's `id`.
        let id = id_at(&answer, "/payload/contact/id")
            .or_else(|| id_at(&answer, "/id"))
            .ok_or_else(|| bad_answer("a contact without id"))?;
        let source =
            id_at(&answer, "/payload/contact_inbox/source_id").unwrap_or_else(|| user.to_owned());
        Ok((id, Some(source)))
    }

    /// The conversation's labels: its bot's and platform's, then the bot's own.
    fn labels(&self, event: &DeskEvent, own: &[String]) -> Vec<String> {
        let c = event.conversation.as_ref();
        let mut labels = Vec::new();
        if let Some(bot) = c.and_then(|c| c.bot_id.as_ref()) {
            labels.push(label(&format!("bot-{bot}")));
        }
        if let Some(platform) = c.and_then(|c| c.platform.as_ref()) {
            labels.push(label(platform.as_str()));
        }
        labels.extend(own.iter().cloned());
        labels.dedup();
        labels
    }
}

/// Whether an earlier create of this link may have taken effect.
fn again_or_uncertain(link: &DeskLink) -> bool {
    link.uncertain.as_deref() == Some(CREATING)
}

/// The conversation's custom attributes: the service's conversation, bot, queue position, and
/// the handoff's action id (to find it again after an uncertain create).
fn custom_attributes(event: &DeskEvent) -> Value {
    let c = event.conversation.as_ref();
    json!({
        "handoff_conversation": event.conversation_id.as_str(),
        "handoff_bot": c.and_then(|c| c.bot_id.as_ref()).map(|b| b.as_str()),
        "handoff_platform": c.and_then(|c| c.platform.as_ref()).map(|p| p.as_str()),
        "handoff_queue_position": event.queue.and_then(|q| q.position),
        "handoff_action": event.action_id,
    })
}

/// The bridge's identifier of the end user at Chatwoot (its contacts' `identifier`).
pub fn identifier(event: &DeskEvent) -> String {
    let c = event.conversation.as_ref();
    match c.and_then(|c| c.end_user_id.as_ref()) {
        Some(user) => format!("{SOURCE_PREFIX}{user}"),
        None => format!("{SOURCE_PREFIX}conversation:{}", event.conversation_id),
    }
}

/// The contact's name: the user's `name` param, else platform and key.
fn contact_name(event: &DeskEvent) -> String {
    let named = event
        .end_user
        .as_ref()
        .and_then(|u| u.params.value.get("name"))
        .and_then(Value::as_str)
        .filter(|n| !n.trim().is_empty());
    if let Some(name) = named {
        return name.to_owned();
    }
    let c = event.conversation.as_ref();
    let platform = c
        .and_then(|c| c.platform.as_ref())
        .map_or("user", |p| p.as_str());
    let key = c
        .and_then(|c| c.user_key.as_ref())
        .map_or("", |k| k.as_str());
    let short: String = key.chars().take(12).collect();
    format!("{platform} user {short}").trim().to_owned()
}

/// A label as Chatwoot takes it: lowercase letters, digits, `-` and `_`.
fn label(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

/// A service message as text: its text, a media's link, the cards' titles and links.
pub fn content_of(data: &MessageData) -> String {
    let mut parts = Vec::new();
    if let Some(text) = data.text.as_deref().filter(|t| !t.trim().is_empty()) {
        parts.push(text.to_owned());
    }
    if let Some(media) = &data.media {
        parts.push(format!("[{}] {}", media.content_type, media.uri));
    }
    for card in data.cards.iter().flatten() {
        parts.push(format!("[card] {}", card.title));
    }
    if let Some(location) = &data.location {
        parts.push(format!("[location] {}", json!(location)));
    }
    if parts.is_empty() {
        parts.push(format!("[{}]", data.kind.as_str()));
    }
    parts.join("\n")
}

/// A private note's text for `event`.
fn note_text(event: &DeskEvent) -> String {
    let what = match event.kind {
        DeskEventKind::HandoffRequested => "The user asked for a person again",
        DeskEventKind::HandoffTimedOut => {
            "Nobody took the conversation in time: the user is back with the bot"
        }
        DeskEventKind::HandoffCancelled => "The user cancelled: back with the bot",
        DeskEventKind::HandoffEnded => "Handed back to the bot",
        DeskEventKind::HandoffConnected => "Taken by an agent",
        DeskEventKind::HandoffReminder => "Reminder",
        DeskEventKind::QueueUpdated => "Still waiting",
        DeskEventKind::ConversationMessage => "A message",
        DeskEventKind::UserBlocked => "The user is blocked",
        DeskEventKind::UserUnblocked => "The user is unblocked",
    };
    let mut text = format!("[handoff-bridge] {what}");
    if let Some(reason) = &event.reason {
        text.push_str(&format!(" ({reason})"));
    }
    if let Some(agent) = event.payload["desk_agent"]
        .as_str()
        .filter(|a| !a.is_empty())
    {
        text.push_str(&format!("; agent: {agent}"));
    }
    let position = &event.payload["queue_position"];
    if let Some(position) = position.as_u64().map(|p| p.to_string()).or_else(|| {
        position
            .as_str()
            .filter(|p| !p.is_empty())
            .map(str::to_owned)
    }) {
        text.push_str(&format!("; place in line: {position}"));
    }
    text
}

fn bad_answer(detail: &str) -> DeskError {
    DeskError::BadAnswer {
        endpoint: NAME.to_owned(),
        detail: detail.to_owned(),
    }
}

/// The store failed: a transient failure (the mapping must be written before going on).
fn store_failed(e: storage::StoreError) -> DeskError {
    tracing::error!(error = %e, "cannot read or write Chatwoot's mapping");
    DeskError::Unavailable {
        endpoint: NAME.to_owned(),
        cause: "store".to_owned(),
        retry_after: None,
    }
}
