//! What the bridge tells Chatwoot, by desk event kind. Every step is written into the
//! conversation's mapping ([`DeskLink`]) as it is done, so a retry (after a failure, a crash, an
//! uncertain answer) resumes: a conversation is created once (an uncertain create is looked for
//! first, by the action id in its custom attributes), a message is posted once (by its
//! `source_id`, looked for after an uncertain post). The mark of a call that may take effect is
//! durable (flushed through the writer) before the call, so a crash after it still finds it.
//!
//! - `handoff.requested`: the contact found (its identifier matched exactly) or created; a new
//!   conversation in the inbox, `open`, with custom attributes and team (one Chatwoot answers
//!   from before, with `lock_to_single_conversation`, opened again and named for this handoff);
//!   its labels (the full list: labels replace); then the transcript, the user's messages as
//!   `incoming`, the bot's and agents' as private notes. Nothing once this handoff was handed
//!   back or is over (a console retry after its end).
//! - `conversation.message`: the user's message as `incoming` (a bot's as a private note); with
//!   no conversation to post into, a failure (`chatwoot_not_opened`), never a silent success.
//! - reminders, connects, blocks: a private note.
//! - the hand-back (`timed_out`, `cancelled`, `ended`): a private note (a refused one does not
//!   stop it), the mapping closed (the next handoff opens a new conversation: posting into a
//!   resolved API-inbox conversation would reopen it), then the conversation resolved.
//! - A linked conversation Chatwoot no longer has (404: deleted) becomes an earlier one; a cached
//!   contact it no longer has is found or made again.

use super::client::{id_at, Post, NAME};
use super::Chatwoot;
use crate::helpdesk::port::{DeskError, DeskEvent};
use engine::state::desk::DeskPhase;
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
/// The dead letter's reason (after the connector's prefix) of an event with no conversation.
const NOT_OPENED: &str = "not_opened";

/// The bridge-owned id of a service message posted into Chatwoot.
pub fn message_source_id(message_id: &str) -> String {
    format!("{SOURCE_PREFIX}msg:{message_id}")
}

/// The end user's contact, and its source id in the inbox.
struct Contact {
    id: String,
    source: String,
    /// From the mappings (Chatwoot may have deleted it since), not from Chatwoot just now.
    cached: bool,
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
            | DeskEventKind::UserUnblocked => self.tell(event, again).await,
        }
    }

    /// A note into the handoff's conversation. Nothing when there is no handoff at Chatwoot (no
    /// mapping: a block outside one) or it was handed back; a failure while its conversation
    /// was not opened.
    async fn tell(&self, event: &DeskEvent, again: bool) -> Result<(), DeskError> {
        match self.link(event)? {
            None => Ok(()),
            Some(link) if link.closed_at.is_some() => Ok(()),
            Some(link) if link.remote.is_none() => Err(self.not_opened(Some(&link))),
            Some(mut link) => self.note(&mut link, event, again).await,
        }
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

    /// Save `link` and make it durable before the call its mark announces: through the writer,
    /// the one flusher while the daemon runs.
    async fn save_durable(&self, link: &mut DeskLink) -> Result<(), DeskError> {
        self.save(link)?;
        let Some(writer) = self.writer.get() else {
            tracing::warn!("the Chatwoot connector has no writer yet; the call waits");
            return Err(unavailable("store"));
        };
        writer.flush_own().await.map_err(|e| {
            tracing::error!(error = %e, "cannot make Chatwoot's mapping durable");
            unavailable("store")
        })
    }

    /// `handoff.requested`: a conversation opened (or resumed) and filled.
    async fn open(&self, event: &DeskEvent, again: bool) -> Result<(), DeskError> {
        let mut link = self.link(event)?.unwrap_or_else(|| DeskLink {
            connector: NAME.to_owned(),
            conversation_id: event.conversation_id.as_str().to_owned(),
            ..DeskLink::default()
        });
        let mine = link.opened_by == event.action_id;
        if (mine && link.closed_at.is_some()) || handoff_over(event) {
            // Handed back already (a retry from the console after its end): nothing to open.
            tracing::info!(action = %event.action_id, "the handoff is over: no Chatwoot conversation is opened for it");
            return Ok(());
        }
        if !mine && link.remote.is_some() && link.closed_at.is_none() {
            // Asked again while its conversation is still open: said there, nothing reopened,
            // unless Chatwoot no longer has it (then opened anew below).
            match self.note(&mut link, event, again).await {
                Err(e) if gone(&e) => {}
                other => return other,
            }
        }
        if !mine {
            link.reopen(&event.action_id);
            self.save(&mut link)?;
        }
        let bot = event.conversation.as_ref().and_then(|c| c.bot_id.as_ref());
        let (inbox, team, labels) = self.config.bot(bot.map(|b| b.as_str()));
        if link.remote.is_none() {
            let remote = self.create(&mut link, event, again, (inbox, team)).await?;
            link.remote = Some(remote);
            link.uncertain = None;
            self.save(&mut link)?;
        }
        let remote = link.remote.clone().unwrap_or_default();
        if !link.was_posted(LABELS) {
            let set = self
                .api
                .set_labels(&remote, &self.labels(event, labels))
                .await;
            self.checked(&mut link, set)?;
            link.posted(LABELS);
            self.save(&mut link)?;
        }
        let transcript = event.transcript.as_ref().map(|t| t.messages.as_slice());
        for m in transcript.unwrap_or_default() {
            self.post_message(&mut link, m, again).await?;
        }
        Ok(())
    }

    /// This handoff's conversation, with the end user's contact: a cached contact Chatwoot no
    /// longer has (the create answers 404) is dropped, then found or made again.
    async fn create(
        &self,
        link: &mut DeskLink,
        event: &DeskEvent,
        again: bool,
        (inbox, team): (u64, Option<u64>),
    ) -> Result<String, DeskError> {
        let contact = self.contact(event, inbox).await?;
        link.contact = Some(contact.id.clone());
        let made = self
            .conversation(link, event, again, &contact, (inbox, team))
            .await;
        match made {
            Err(e) if gone(&e) && contact.cached => {
                tracing::warn!(contact = %contact.id, "Chatwoot no longer has the end user's contact: found or made again");
                // Refused: nothing was created.
                link.uncertain = None;
                self.forget_contact(event, inbox)?;
                let contact = self.contact(event, inbox).await?;
                link.contact = Some(contact.id.clone());
                self.conversation(link, event, again, &contact, (inbox, team))
                    .await
            }
            other => other,
        }
    }

    /// `conversation.message`: posted into the open conversation; with none, a failure.
    async fn user_message(&self, event: &DeskEvent, again: bool) -> Result<(), DeskError> {
        let Some(m) = &event.message else {
            return Ok(());
        };
        match self.link(event)? {
            Some(mut link) if link.remote.is_some() && link.closed_at.is_none() => {
                self.post_message(&mut link, m, again).await
            }
            other => Err(self.not_opened(other.as_ref())),
        }
    }

    /// The hand-back: a note (a refused one does not stop it), the mapping closed (even when
    /// no conversation was ever opened), the conversation resolved (a deleted one needs none).
    async fn hand_back(&self, event: &DeskEvent, again: bool) -> Result<(), DeskError> {
        let Some(mut link) = self.link(event)? else {
            return Ok(());
        };
        if link.closed_at.is_none() {
            if link.remote.is_some() {
                match self.note(&mut link, event, again).await {
                    Err(e) if e.is_transient() => return Err(e),
                    Err(e) => {
                        tracing::warn!(error = %e, "Chatwoot refused the hand-back's note; the conversation is resolved anyway")
                    }
                    Ok(()) => {}
                }
            }
            // Closed before the resolve: its echo, and any late event of it, is then stale.
            link.closed_at = Some(self.store.clock().now_millis());
            self.save(&mut link)?;
        }
        let Some(remote) = link.remote.clone() else {
            return Ok(());
        };
        // Resolving a resolved conversation changes nothing: a retry (or a crash between the
        // close and the resolve) resolves again.
        match self.api.resolve(&remote).await {
            Err(e) if gone(&e) => self.lost(&mut link),
            other => other,
        }
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
            return Err(self.not_opened(Some(link)));
        };
        if link.was_posted(source) {
            return Ok(());
        }
        if again || link.uncertain.as_deref() == Some(source) {
            let listed = self.api.list_messages(&remote).await;
            if posted_in(&self.checked(link, listed)?, source) {
                link.posted(source);
                return self.save(link);
            }
        }
        link.uncertain = Some(source.to_owned());
        self.save_durable(link).await?;
        let post = Post {
            content,
            incoming,
            private,
            source_id: source,
        };
        let sent = self.api.post_message(&remote, &post).await;
        self.checked(link, sent)?;
        link.posted(source);
        self.save(link)
    }

    /// A call on the linked conversation: a 404 (Chatwoot deleted it) makes it an earlier one.
    fn checked<T>(
        &self,
        link: &mut DeskLink,
        result: Result<T, DeskError>,
    ) -> Result<T, DeskError> {
        if let Err(e) = &result {
            if gone(e) {
                self.lost(link)?;
            }
        }
        result
    }

    /// Chatwoot no longer has the linked conversation: an earlier one now, so the next handoff
    /// opens anew and its late events are stale.
    fn lost(&self, link: &mut DeskLink) -> Result<(), DeskError> {
        tracing::warn!(conversation = ?link.remote, "Chatwoot no longer has the conversation (404): the next handoff opens a new one");
        link.forget_remote();
        self.save(link)
    }

    /// Why there is no conversation to post into: transient while the `handoff.requested` that
    /// opens it is still in the outbox (a retry racing this entry), else for good.
    fn not_opened(&self, link: Option<&DeskLink>) -> DeskError {
        let opening = link.filter(|l| l.closed_at.is_none() && l.remote.is_none());
        match opening.map(|l| self.opening_pending(&l.opened_by)) {
            Some(Ok(true)) => unavailable("not_opened_yet"),
            Some(Err(e)) => e,
            _ => DeskError::Unusable {
                endpoint: NAME.to_owned(),
                reason: NOT_OPENED,
                detail: "no Chatwoot conversation to post into (the handoff's \
                         handoff.requested failed, or the handoff is over)"
                    .to_owned(),
            },
        }
    }

    /// Whether the action `action_id` waits in the outbox.
    fn opening_pending(&self, action_id: &str) -> Result<bool, DeskError> {
        let Some(event_id) = event_of_action(action_id) else {
            return Ok(false);
        };
        let seqs = self
            .store
            .action_seqs_of_event(event_id)
            .map_err(store_failed)?;
        for seq in seqs {
            let entry = self.store.outbox_entry(seq).map_err(store_failed)?;
            if entry.is_some_and(|e| e.id == action_id) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The Chatwoot conversation of this handoff: the one an earlier attempt may have created
    /// (found by the action id among the contact's conversations), else a new one.
    async fn conversation(
        &self,
        link: &mut DeskLink,
        event: &DeskEvent,
        again: bool,
        contact: &Contact,
        (inbox, team): (u64, Option<u64>),
    ) -> Result<String, DeskError> {
        if again_or_uncertain(link, again) {
            if let Some(id) = self.created_before(&contact.id, &event.action_id).await? {
                return Ok(id);
            }
        }
        link.uncertain = Some(CREATING.to_owned());
        self.save_durable(link).await?;
        let mut body = json!({
            "source_id": contact.source,
            "inbox_id": inbox,
            "contact_id": contact.id.parse::<u64>().map_or_else(|_| json!(contact.id), |n| json!(n)),
            "status": "open",
            "custom_attributes": custom_attributes(event),
        });
        if let Some(team) = team {
            body["team_id"] = json!(team);
        }
        let answer = self.api.create_conversation(body).await?;
        let id = id_at(&answer, "/id").ok_or_else(|| bad_answer("a conversation without id"))?;
        if reused(&answer, link, &event.action_id) {
            self.reuse(link, &id, &answer, event).await?;
        }
        Ok(id)
    }

    /// The conversation of the contact whose custom attributes name `action` (a create of it
    /// that took effect); none when Chatwoot no longer has the contact.
    async fn created_before(
        &self,
        contact: &str,
        action: &str,
    ) -> Result<Option<String>, DeskError> {
        match self.api.contact_conversations(contact).await {
            Ok(answer) => Ok(by_action(&answer, action)),
            Err(e) if gone(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Chatwoot answered a create with a conversation it had (the inbox locks to a single
    /// conversation): opened again, named for this handoff, and what it holds not posted again.
    async fn reuse(
        &self,
        link: &mut DeskLink,
        remote: &str,
        answer: &Value,
        event: &DeskEvent,
    ) -> Result<(), DeskError> {
        tracing::warn!(conversation = %remote, "Chatwoot answered an existing conversation (the inbox locks to a single conversation): opened again for this handoff");
        if answer["status"].as_str().is_some_and(|s| s != "open") {
            self.api.reopen(remote).await?;
        }
        self.api
            .set_custom_attributes(remote, custom_attributes(event))
            .await?;
        link.earlier.retain(|e| e != remote);
        let listed = self.api.list_messages(remote).await?;
        for source in sources_in(&listed) {
            link.posted(&source);
        }
        Ok(())
    }

    /// The end user's contact in `inbox`: kept in the mappings, else found by the bridge's
    /// identifier (matched exactly), else created.
    async fn contact(&self, event: &DeskEvent, inbox: u64) -> Result<Contact, DeskError> {
        let user = identifier(event);
        let inbox_key = inbox.to_string();
        let kept = self.store.desk_contact(NAME, &user).map_err(store_failed)?;
        if let Some(c) = &kept {
            if let Some(source) = c.extra[&inbox_key].as_str() {
                return Ok(Contact {
                    id: c.contact.clone(),
                    source: source.to_owned(),
                    cached: true,
                });
            }
        }
        let (id, source) = match self.find_contact(&user, inbox).await? {
            Some(found) => found,
            None => self.create_contact(event, &user, inbox).await?,
        };
        let source = match source {
            Some(source) => source,
            None => {
                let answer = self.api.add_contact_inbox(&id, inbox, &user).await?;
                id_at(&answer, "/source_id").unwrap_or_else(|| user.clone())
            }
        };
        let mut record = kept.unwrap_or_else(|| DeskContact {
            connector: NAME.to_owned(),
            user: user.clone(),
            ..DeskContact::default()
        });
        record.contact = id.clone();
        if !record.extra.is_object() {
            record.extra = json!({});
        }
        record.extra[&inbox_key] = json!(source);
        record.updated_at = self.store.clock().now_millis();
        self.store.put_desk_contact(&record).map_err(store_failed)?;
        Ok(Contact {
            id,
            source,
            cached: false,
        })
    }

    /// The kept contact's source id in `inbox` dropped (Chatwoot no longer has it there).
    fn forget_contact(&self, event: &DeskEvent, inbox: u64) -> Result<(), DeskError> {
        let user = identifier(event);
        let kept = self.store.desk_contact(NAME, &user).map_err(store_failed)?;
        let Some(mut record) = kept else {
            return Ok(());
        };
        if let Some(extra) = record.extra.as_object_mut() {
            extra.remove(&inbox.to_string());
        }
        record.updated_at = self.store.clock().now_millis();
        self.store.put_desk_contact(&record).map_err(store_failed)
    }

    /// The contact whose identifier is exactly `user`, and its source id in `inbox` if it has
    /// one there.
    async fn find_contact(
        &self,
        user: &str,
        inbox: u64,
    ) -> Result<Option<(String, Option<String>)>, DeskError> {
        let answer = self.api.search_contacts(user).await?;
        exact_contact(&answer, user, inbox)
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
        match self.api.create_contact(body).await {
            Err(DeskError::Refused { status: 422, .. }) => self
                .find_contact(user, inbox)
                .await?
                .ok_or_else(|| bad_answer("the contact exists (422) but is not found")),
            answer => created_contact(&answer?, user),
        }
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

/// Whether an earlier create of this link may have taken effect: an earlier attempt failed
/// (`again`), or its durable mark says a create was under way (a crash: the attempt was never
/// counted).
pub(super) fn again_or_uncertain(link: &DeskLink, again: bool) -> bool {
    again || link.uncertain.as_deref() == Some(CREATING)
}

/// The conversation's handoff is over (handed back, cancelled, ended, served): nothing to open
/// for it. A state without a request (not read) is not judged.
fn handoff_over(event: &DeskEvent) -> bool {
    event.conversation.as_ref().is_some_and(|s| {
        s.handoff.requested_at.is_some()
            && !matches!(
                DeskPhase::of(s),
                DeskPhase::Requested | DeskPhase::Accepted | DeskPhase::Connected
            )
    })
}

/// Chatwoot does not have what the call named (deleted).
fn gone(e: &DeskError) -> bool {
    matches!(e, DeskError::Refused { status: 404, .. })
}

/// The event id of an action id (`{event}/{rule}/{index}`).
pub(super) fn event_of_action(action_id: &str) -> Option<&str> {
    let mut parts = action_id.rsplitn(3, '/');
    let (_index, _rule) = (parts.next()?, parts.next()?);
    parts.next().filter(|e| !e.is_empty())
}

/// The bridge's source ids among a conversation's listed messages.
fn sources_in(listed: &Value) -> Vec<String> {
    let messages = listed["payload"].as_array().map(Vec::as_slice);
    messages
        .unwrap_or_default()
        .iter()
        .filter_map(|m| m["source_id"].as_str())
        .filter(|s| s.starts_with(SOURCE_PREFIX))
        .map(str::to_owned)
        .collect()
}

/// Whether a message with `source` is among a conversation's listed (newest) messages.
pub(super) fn posted_in(listed: &Value, source: &str) -> bool {
    sources_in(listed).iter().any(|s| s == source)
}

/// Among a contact's conversations, the one whose custom attributes name `action`.
pub(super) fn by_action(listed: &Value, action: &str) -> Option<String> {
    let all = listed["payload"].as_array()?;
    let found = all
        .iter()
        .find(|c| c["custom_attributes"]["handoff_action"].as_str() == Some(action))?;
    id_at(found, "/id")
}

/// Whether a create's answer is a conversation Chatwoot had before (not open, an earlier one of
/// this link, or named for another handoff) rather than a new one.
fn reused(answer: &Value, link: &DeskLink, action: &str) -> bool {
    let id = id_at(answer, "/id");
    answer["status"].as_str().is_some_and(|s| s != "open")
        || id.is_some_and(|id| link.earlier.contains(&id))
        || answer["custom_attributes"]["handoff_action"]
            .as_str()
            .is_some_and(|a| a != action)
}

/// In a contact search's answer, the contact whose identifier is exactly `user` (the search
/// matches substrings), and its source id in `inbox` if it has one there.
fn exact_contact(
    answer: &Value,
    user: &str,
    inbox: u64,
) -> Result<Option<(String, Option<String>)>, DeskError> {
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

/// A created contact's id and source id: the running code answers `payload.contact` and
/// `payload.contact_inbox`, the document the contact's `id` (then the bridge's own source id).
fn created_contact(answer: &Value, user: &str) -> Result<(String, Option<String>), DeskError> {
    let id = id_at(answer, "/payload/contact/id")
        .or_else(|| id_at(answer, "/id"))
        .ok_or_else(|| bad_answer("a contact without id"))?;
    let source =
        id_at(answer, "/payload/contact_inbox/source_id").unwrap_or_else(|| user.to_owned());
    Ok((id, Some(source)))
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
    unavailable("store")
}

/// A transient failure of the connector's own (`cause`): tried again with the outbox's backoff.
fn unavailable(cause: &str) -> DeskError {
    DeskError::Unavailable {
        endpoint: NAME.to_owned(),
        cause: cause.to_owned(),
        retry_after: None,
    }
}
