//! What a Chatwoot delivery asks of the bridge, pure: which agent commands it becomes (relayed),
//! or why none (ignored), by kind (`handoff_desk_webhooks_total{kind}`).
//!
//! - `message_created`, `outgoing`, not private, sent by a `user` (an agent): `agent.message`
//!   (each attachment as the service's media when it can be one, else as a link), the first an
//!   `agent.accept` as that agent unless one holds the conversation already.
//! - `conversation_updated` with a new assignee (a user): `agent.accept` as that agent.
//! - `conversation_status_changed` to `resolved`: `agent.release` (an accept first when no agent
//!   holds it: the resolve ends the handoff whoever resolved).
//! - Only while the handoff lasts: an agent holds the conversation, or it waits or is connected
//!   (its desk phase); after the bridge handed it back (a closed mapping) or the rules did (the
//!   wait ran out, after hours), `closed`.
//! - never relayed: private notes, the bridge's own messages echoed back (its `source_id`),
//!   templates (out-of-office, CSAT: the survey only with `relay_csat`, and only after a handoff
//!   an agent held or the desk resolved), activity, the contact's messages, events of
//!   conversations the bridge does not map or no longer does.

use super::outbound::SOURCE_PREFIX;
use super::payload::{ConversationEvent, MessageEvent, MessageType, Payload, Person};
use crate::helpdesk::contract::MAX_TEXT;
use engine::state::desk::DeskPhase;
use model::webhook::agent::DeskAgent;
use model::webhook::model::{Media, MessageData};

/// What the connector knows of the delivery's conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapped {
    /// Not a conversation the bridge opened (or not of its account).
    No,
    /// One the bridge opened for an earlier handoff.
    Stale,
    /// The current one, handed back to the bot already.
    Closed,
    /// The current one, open.
    Open,
}

/// Where the delivery's conversation stands at the bridge.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Standing<'a> {
    pub mapped: Mapped,
    /// The agent who holds it now.
    pub holder: Option<&'a DeskAgent>,
    /// Its desk phase (`None`: its state was not read).
    pub phase: Option<DeskPhase>,
}

impl Standing<'_> {
    /// The handoff lasts: its mapping is open, and an agent holds it or it waits for one or is
    /// connected at the service.
    fn live(&self) -> bool {
        self.mapped == Mapped::Open
            && (self.holder.is_some()
                || matches!(
                    self.phase,
                    None | Some(DeskPhase::Requested | DeskPhase::Connected)
                ))
    }

    /// The handoff was served (the survey's condition): an agent held it, or the desk resolved
    /// it (the mapping still open while it waits: the resolve's accept and release not folded
    /// yet). Never after the bridge's own hand-back of a user nobody answered.
    fn served(&self) -> bool {
        self.holder.is_some()
            || matches!(
                self.phase,
                Some(
                    DeskPhase::Accepted
                        | DeskPhase::Released
                        | DeskPhase::Connected
                        | DeskPhase::Ended
                )
            )
            || (self.mapped == Mapped::Open && self.phase == Some(DeskPhase::Requested))
    }
}

/// A command the delivery asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum Intent {
    Accept(DeskAgent),
    Message(DeskAgent, MessageData),
    /// A message from the desk itself (the satisfaction survey).
    Notice(MessageData),
    Release,
}

/// The delivery's kind and the commands it asks for (none: ignored).
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub kind: &'static str,
    pub intents: Vec<Intent>,
}

impl Decision {
    fn ignored(kind: &'static str) -> Self {
        Decision {
            kind,
            intents: Vec::new(),
        }
    }
}

/// The Chatwoot conversation (display id) a delivery is about, if it names one.
pub fn remote_of(p: &Payload) -> Option<&str> {
    match p {
        Payload::MessageCreated(m) => Some(&m.conversation.id),
        Payload::ConversationUpdated(c) | Payload::StatusChanged(c) => Some(&c.id),
        Payload::Other(_) => None,
    }
}

/// The delivery's account, when it names one.
pub fn account_of(p: &Payload) -> Option<&str> {
    match p {
        Payload::MessageCreated(m) => m.account_id(),
        Payload::ConversationUpdated(c) | Payload::StatusChanged(c) => c.account_id(),
        Payload::Other(_) => None,
    }
}

/// What `p` asks of a conversation standing so.
pub fn decide(p: &Payload, standing: Standing<'_>, relay_csat: bool) -> Decision {
    if let Payload::Other(_) = p {
        return Decision::ignored("other_event");
    }
    match standing.mapped {
        Mapped::No => return Decision::ignored("unmapped"),
        Mapped::Stale => return Decision::ignored("stale"),
        Mapped::Closed | Mapped::Open => {}
    }
    let live = standing.live();
    match p {
        Payload::MessageCreated(m) => message(m, standing, relay_csat),
        Payload::ConversationUpdated(c) if live => assignment(c),
        Payload::StatusChanged(c) if live => resolve(c, standing.holder),
        Payload::ConversationUpdated(_) | Payload::StatusChanged(_) => Decision::ignored("closed"),
        Payload::Other(_) => Decision::ignored("other_event"),
    }
}

fn message(m: &MessageEvent, standing: Standing<'_>, csat: bool) -> Decision {
    if m.source_id
        .as_deref()
        .is_some_and(|s| s.starts_with(SOURCE_PREFIX))
    {
        return Decision::ignored("echo");
    }
    if m.private {
        return Decision::ignored("private_note");
    }
    match m.message_type {
        MessageType::Incoming => Decision::ignored("incoming"),
        MessageType::Activity => Decision::ignored("activity"),
        MessageType::Template if m.content_type.as_deref() == Some("input_csat") && csat => {
            // After a resolve the conversation is closed: the survey is its last word, when
            // somebody served the user.
            if !standing.served() {
                return Decision::ignored("closed");
            }
            let intents = texts(m.content.as_deref().unwrap_or_default())
                .into_iter()
                .map(Intent::Notice)
                .collect();
            Decision {
                kind: "csat",
                intents,
            }
        }
        MessageType::Template => Decision::ignored("template"),
        MessageType::Outgoing if !standing.live() => Decision::ignored("closed"),
        MessageType::Outgoing => match m.sender.as_ref() {
            Some(agent) if agent.kind.as_deref() == Some("user") => {
                agent_message(m, agent, standing.holder)
            }
            _ => Decision::ignored("bot_message"),
        },
    }
}

fn agent_message(m: &MessageEvent, sender: &Person, holder: Option<&DeskAgent>) -> Decision {
    let agent = desk_agent(sender);
    let mut intents = Vec::new();
    if holder.is_none() {
        intents.push(Intent::Accept(agent.clone()));
    }
    let parts = message_data(m);
    if parts.is_empty() {
        return Decision::ignored("empty_message");
    }
    intents.extend(parts.into_iter().map(|d| Intent::Message(agent.clone(), d)));
    Decision {
        kind: "agent_message",
        intents,
    }
}

fn assignment(c: &ConversationEvent) -> Decision {
    let new = c.changed("assignee_id").filter(|v| !v.is_null());
    match (new, &c.meta.assignee, c.meta.assignee_type.as_deref()) {
        (Some(_), Some(agent), Some("User") | None) => Decision {
            kind: "assignment",
            intents: vec![Intent::Accept(desk_agent(agent))],
        },
        (Some(_), _, _) => Decision::ignored("bot_assignment"),
        (None, _, _) => Decision::ignored("update"),
    }
}

fn resolve(c: &ConversationEvent, holder: Option<&DeskAgent>) -> Decision {
    if c.status != "resolved" {
        return Decision::ignored("status_change");
    }
    let mut intents = Vec::new();
    if holder.is_none() {
        let agent = c.meta.assignee.as_ref().map_or_else(
            || DeskAgent {
                id: "chatwoot".into(),
                name: Some("Chatwoot".into()),
            },
            desk_agent,
        );
        intents.push(Intent::Accept(agent));
    }
    intents.push(Intent::Release);
    Decision {
        kind: "resolved",
        intents,
    }
}

/// A Chatwoot agent as the desk names them: `chatwoot:<user id>`.
pub fn desk_agent(p: &Person) -> DeskAgent {
    DeskAgent {
        id: format!("chatwoot:{}", p.id),
        name: p.name.clone().filter(|n| !n.trim().is_empty()),
    }
}

/// An agent's message in the service's format: its text (in parts of at most the service's
/// limit), then each attachment: an image, video or audio as media, anything else as a link.
pub fn message_data(m: &MessageEvent) -> Vec<MessageData> {
    let mut out = texts(m.content.as_deref().unwrap_or_default());
    for a in &m.attachments {
        let Some(url) = a.data_url.as_deref().filter(|u| !u.trim().is_empty()) else {
            continue;
        };
        match a.file_type.as_deref() {
            Some(kind @ ("image" | "video" | "audio")) => out.push(MessageData {
                media: Some(Media {
                    content_type: kind.to_owned(),
                    uri: url.to_owned(),
                }),
                ..text_data(None)
            }),
            _ => out.extend(texts(url)),
        }
    }
    out
}

/// Text messages of at most [`MAX_TEXT`] characters each (none for blank text).
fn texts(text: &str) -> Vec<MessageData> {
    let text = text.trim();
    if text.is_empty() {
        return Vec::new();
    }
    let chars: Vec<char> = text.chars().collect();
    chars
        .chunks(MAX_TEXT)
        .map(|part| text_data(Some(part.iter().collect())))
        .collect()
}

fn text_data(text: Option<String>) -> MessageData {
    let kind = if text.is_some() {
        model::webhook::model::MessageType::Text
    } else {
        model::webhook::model::MessageType::Media
    };
    MessageData {
        kind,
        text,
        media: None,
        cards: None,
        location: None,
        button: None,
        buttons: None,
    }
}

#[cfg(test)]
mod tests {
    use super::super::payload::parse;
    use super::*;
    use serde_json::{json, Value};

    fn message_event(changes: Value) -> Payload {
        let mut body = json!({
            "event": "message_created", "id": 901, "message_type": "outgoing",
            "private": false, "content": "Hello", "content_type": "text",
            "conversation": {"id": 57}, "account": {"id": 1},
            "sender": {"id": 5, "name": "Alice", "type": "user"}, "source_id": null
        });
        if let (Some(body), Value::Object(changes)) = (body.as_object_mut(), changes) {
            body.extend(changes);
        }
        parse(body.to_string().as_bytes()).expect("a payload")
    }

    fn alice() -> DeskAgent {
        DeskAgent {
            id: "chatwoot:5".into(),
            name: Some("Alice".into()),
        }
    }

    /// Mapped so, in `phase`, held by nobody.
    fn at(mapped: Mapped, phase: DeskPhase) -> Standing<'static> {
        Standing {
            mapped,
            holder: None,
            phase: Some(phase),
        }
    }

    /// The open mapping of a conversation waiting for an agent (or held by `holder`).
    fn waiting(holder: Option<&DeskAgent>) -> Standing<'_> {
        Standing {
            mapped: Mapped::Open,
            holder,
            phase: Some(match holder {
                Some(_) => DeskPhase::Accepted,
                None => DeskPhase::Requested,
            }),
        }
    }

    #[test]
    fn an_agents_first_reply_accepts_then_relays_and_the_next_only_relays() {
        let reply = message_event(json!({}));
        let first = decide(&reply, waiting(None), false);
        assert_eq!(first.kind, "agent_message");
        assert_eq!(first.intents[0], Intent::Accept(alice()));
        assert!(
            matches!(&first.intents[1], Intent::Message(a, d) if *a == alice() && d.text.as_deref() == Some("Hello"))
        );
        let next = decide(&reply, waiting(Some(&alice())), false);
        assert_eq!(next.intents.len(), 1);
    }

    #[test]
    fn echoes_notes_templates_activity_and_unmapped_conversations_are_not_relayed() {
        let cases = [
            (
                json!({"source_id": "handoff-bridge:msg:m1"}),
                Mapped::Open,
                "echo",
            ),
            (json!({"private": true}), Mapped::Open, "private_note"),
            (
                json!({"message_type": "incoming", "sender": {"id": 3}}),
                Mapped::Open,
                "incoming",
            ),
            (json!({"message_type": 2}), Mapped::Open, "activity"),
            (
                json!({"message_type": "template", "sender": null, "content": "We are away"}),
                Mapped::Open,
                "template",
            ),
            (
                json!({"sender": {"id": 2, "name": "Bot", "type": "agent_bot"}}),
                Mapped::Open,
                "bot_message",
            ),
            (json!({}), Mapped::No, "unmapped"),
            (json!({}), Mapped::Stale, "stale"),
            (json!({}), Mapped::Closed, "closed"),
        ];
        for (changes, mapped, kind) in cases {
            let d = decide(
                &message_event(changes.clone()),
                at(mapped, DeskPhase::Requested),
                true,
            );
            assert_eq!((d.kind, d.intents.len()), (kind, 0), "{changes}");
        }
    }

    #[test]
    fn the_survey_goes_to_the_user_only_with_relay_csat_even_after_the_resolve() {
        let csat = message_event(json!({
            "message_type": "template", "content_type": "input_csat", "sender": null,
            "content": "Please rate this conversation, https://chat.example.com/survey/responses/u-1"
        }));
        let resolved = at(Mapped::Closed, DeskPhase::Released);
        assert_eq!(decide(&csat, resolved, false).kind, "template");
        let relayed = decide(&csat, resolved, true);
        assert_eq!(relayed.kind, "csat");
        assert!(
            matches!(&relayed.intents[..], [Intent::Notice(d)] if d.text.as_deref().is_some_and(|t| t.contains("/survey/responses/u-1")))
        );
    }

    #[test]
    fn attachments_become_media_or_links_and_long_text_is_split() {
        let m = message_event(json!({
            "content": "x".repeat(MAX_TEXT + 5),
            "attachments": [
                {"file_type": "image", "data_url": "https://chat.example.com/a.png"},
                {"file_type": "file", "data_url": "https://chat.example.com/a.pdf"},
                {"file_type": "image", "data_url": null}
            ]
        }));
        let Payload::MessageCreated(m) = m else {
            panic!("a message");
        };
        let parts = message_data(&m);
        assert_eq!(parts.len(), 4);
        assert_eq!(
            parts[0].text.as_ref().map(|t| t.chars().count()),
            Some(MAX_TEXT)
        );
        assert_eq!(parts[1].text.as_ref().map(String::len), Some(5));
        let media = parts[2].media.as_ref().expect("media");
        assert_eq!(
            (media.content_type.as_str(), parts[2].kind.as_str()),
            ("image", "media")
        );
        assert_eq!(
            parts[3].text.as_deref(),
            Some("https://chat.example.com/a.pdf")
        );
    }

    #[test]
    fn an_assignment_accepts_and_a_resolve_releases_accepting_first_when_nobody_holds_it() {
        let assigned = parse(json!({
            "event": "conversation_updated", "id": 57, "status": "open",
            "changed_attributes": [{"assignee_id": {"previous_value": null, "current_value": 5}}],
            "meta": {"assignee": {"id": 5, "name": "Alice", "type": "user"}, "assignee_type": "User"}
        }).to_string().as_bytes()).expect("ok");
        let d = decide(&assigned, waiting(None), false);
        assert_eq!(d.intents, [Intent::Accept(alice())]);
        let labels = parse(json!({
            "event": "conversation_updated", "id": 57, "status": "open",
            "changed_attributes": [{"label_list": {"previous_value": [], "current_value": ["x"]}}]
        }).to_string().as_bytes()).expect("ok");
        assert_eq!(decide(&labels, waiting(None), false).kind, "update");
        let resolved = parse(
            json!({
                "event": "conversation_status_changed", "id": 57, "status": "resolved",
                "changed_attributes": null, "meta": {"assignee": null}
            })
            .to_string()
            .as_bytes(),
        )
        .expect("ok");
        let d = decide(&resolved, waiting(Some(&alice())), false);
        assert_eq!(d.intents, [Intent::Release]);
        let d = decide(&resolved, waiting(None), false);
        assert!(
            matches!(&d.intents[..], [Intent::Accept(a), Intent::Release] if a.id == "chatwoot")
        );
        assert_eq!(
            decide(&resolved, at(Mapped::Closed, DeskPhase::Released), false).kind,
            "closed"
        );
    }

    #[test]
    fn after_the_rules_handed_the_user_back_replies_assignments_and_resolves_are_closed() {
        let reply = message_event(json!({}));
        let assigned = parse(json!({
            "event": "conversation_updated", "id": 57, "status": "open",
            "changed_attributes": [{"assignee_id": {"previous_value": null, "current_value": 5}}],
            "meta": {"assignee": {"id": 5, "name": "Alice", "type": "user"}, "assignee_type": "User"}
        }).to_string().as_bytes()).expect("ok");
        let resolved = parse(
            json!({"event": "conversation_status_changed", "id": 57, "status": "resolved"})
                .to_string()
                .as_bytes(),
        )
        .expect("ok");
        // The mapping still open (the hand-back not carried out yet), the state with the bot.
        for phase in [DeskPhase::Bot, DeskPhase::Cancelled, DeskPhase::Ended] {
            for p in [&reply, &assigned, &resolved] {
                let d = decide(p, at(Mapped::Open, phase), true);
                assert_eq!((d.kind, d.intents.len()), ("closed", 0), "{phase}");
            }
        }
        // Connected at the service, or held: still the handoff.
        assert_eq!(
            decide(&reply, at(Mapped::Open, DeskPhase::Connected), false).kind,
            "agent_message"
        );
        let agent = alice();
        let held = Standing {
            holder: Some(&agent),
            ..at(Mapped::Open, DeskPhase::Accepted)
        };
        assert_eq!(decide(&resolved, held, false).intents, [Intent::Release]);
    }

    #[test]
    fn the_survey_is_not_relayed_after_the_bridges_hand_back_of_a_user_nobody_answered() {
        let csat = message_event(json!({
            "message_type": "template", "content_type": "input_csat", "sender": null,
            "content": "Please rate this conversation, https://chat.example.com/survey/responses/u-1"
        }));
        for (standing, kind) in [
            (at(Mapped::Closed, DeskPhase::Bot), "closed"),
            (at(Mapped::Closed, DeskPhase::Cancelled), "closed"),
            (at(Mapped::Open, DeskPhase::Bot), "closed"),
            (at(Mapped::Closed, DeskPhase::Released), "csat"),
            (at(Mapped::Closed, DeskPhase::Ended), "csat"),
            // Resolved at the desk, its accept and release not folded yet.
            (at(Mapped::Open, DeskPhase::Requested), "csat"),
            (at(Mapped::Closed, DeskPhase::Requested), "closed"),
        ] {
            assert_eq!(decide(&csat, standing, true).kind, kind, "{standing:?}");
        }
    }
}
