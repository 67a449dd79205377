//! Echo marking: the service reports every message the bridge sends back to it as
//! `bot.message.sent`. The bridge marks what it sends (`custom`, which the service returns in the
//! echo's `meta.custom`) so that rules meant for people can tell its own messages apart and a rule
//! cannot trigger itself through them.
//!
//! Marking happens in [`OutboxEntry::decided`](super::OutboxEntry::decided), the one place a
//! decision becomes an outbox entry, so the fold and a replay mark alike.

use super::Action;
use crate::webhook::model::{Event, EventKind, Payload};

/// What every marker starts with; the rest names the action that sent the message.
pub const MARKER_PREFIX: &str = "handoff-bridge:";

/// The service's bound on `custom`, in characters (it counts characters, not bytes).
pub const MAX_CUSTOM_CHARS: usize = 1000;

/// The marker for the action `id`: `handoff-bridge:<id>`, cut to the service's bound (on a
/// character boundary; a cut id is still recognised as the bridge's, by its prefix).
pub fn marker(id: &str) -> String {
    let mut marker = format!("{MARKER_PREFIX}{id}");
    if let Some((end, _)) = marker.char_indices().nth(MAX_CUSTOM_CHARS) {
        marker.truncate(end);
    }
    marker
}

/// `action` with its echo marker: a message action whose rule gave no `custom` gets
/// [`marker`]`(id)`. A rule's own `custom` is sent as it is (its echo is then recognised only if
/// it starts with [`MARKER_PREFIX`]); other actions are not echoed and stay as they are.
pub fn marked(mut action: Action, id: &str) -> Action {
    if let Action::SendMessage { custom, .. } | Action::SendToEndUser { custom, .. } = &mut action {
        if custom.is_none() {
            *custom = Some(marker(id));
        }
    }
    action
}

/// The id of the bridge's action whose message `event` reports back, when it is such an echo: a
/// `bot.message.sent` of a bot message whose `meta.custom` carries the marker.
pub fn echo_of(event: &Event) -> Option<&str> {
    if event.kind != EventKind::MessageSent {
        return None;
    }
    let Payload::Message(message) = &event.payload else {
        return None;
    };
    if message.is_user {
        return None;
    }
    message
        .meta
        .as_ref()?
        .custom
        .as_deref()?
        .strip_prefix(MARKER_PREFIX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{ConversationId, EndUserId};
    use crate::webhook::model::{MessageData, MessageType};
    use crate::webhook::parse_event;

    fn text(t: &str) -> MessageData {
        MessageData {
            kind: MessageType::Text,
            text: Some(t.into()),
            media: None,
            cards: None,
            location: None,
            button: None,
            buttons: None,
        }
    }

    fn send(custom: Option<&str>) -> Action {
        Action::SendMessage {
            conversation_id: ConversationId::new("c1"),
            message: text("hi"),
            custom: custom.map(str::to_owned),
        }
    }

    fn custom_of(action: &Action) -> Option<&str> {
        match action {
            Action::SendMessage { custom, .. } | Action::SendToEndUser { custom, .. } => {
                custom.as_deref()
            }
            _ => None,
        }
    }

    #[test]
    fn a_message_without_custom_is_marked_with_its_action_id() {
        let action = marked(send(None), "e1/greet/0");
        assert_eq!(custom_of(&action), Some("handoff-bridge:e1/greet/0"));
        let to_user = Action::SendToEndUser {
            end_user_id: EndUserId::new("u1"),
            message: text("hi"),
            custom: None,
        };
        let action = marked(to_user, "e1/greet/1");
        assert_eq!(custom_of(&action), Some("handoff-bridge:e1/greet/1"));
    }

    #[test]
    fn a_rule_given_custom_is_kept_and_other_actions_are_untouched() {
        let action = marked(send(Some("ticket-7")), "e1/greet/0");
        assert_eq!(custom_of(&action), Some("ticket-7"));
        let manual = Action::SetManual {
            conversation_id: ConversationId::new("c1"),
            enabled: true,
        };
        assert_eq!(marked(manual.clone(), "e1/greet/0"), manual);
        // Marking twice (the replay marks its items, then its entries) changes nothing.
        let once = marked(send(None), "e1/greet/0");
        assert_eq!(marked(once.clone(), "other"), once);
    }

    #[test]
    fn a_long_id_is_cut_to_the_bound_on_a_character_boundary() {
        // Multi-byte characters: a cut by bytes would split one (and panic on slicing).
        let id = "상".repeat(2 * MAX_CUSTOM_CHARS);
        let m = marker(&id);
        assert_eq!(m.chars().count(), MAX_CUSTOM_CHARS);
        assert!(m.starts_with(MARKER_PREFIX));
        assert!(m.ends_with('상'));
        let exact = "x".repeat(MAX_CUSTOM_CHARS - MARKER_PREFIX.len());
        assert_eq!(
            marker(&exact),
            format!("{MARKER_PREFIX}{exact}"),
            "fits whole"
        );
        let one_more = format!("{exact}y");
        assert_eq!(marker(&one_more), format!("{MARKER_PREFIX}{exact}"));
    }

    fn message_event(kind: &str, is_user: bool, meta: &str) -> Event {
        let raw = format!(
            r#"{{"id":"e9","event":"{kind}","sourceType":"bot","sourceId":"B1","timestamp":1000,
            "data":{{"message":{{"id":"m9","conversationId":"c1","isUser":{is_user},"meta":{meta},
            "data":{{"type":"text","text":"hi"}}}}}}}}"#
        );
        parse_event(&raw).expect("event")
    }

    #[test]
    fn an_echo_is_a_sent_bot_message_carrying_the_marker() {
        let echo = message_event(
            "bot.message.sent",
            false,
            r#"{"custom":"handoff-bridge:e1/greet/0"}"#,
        );
        assert_eq!(echo_of(&echo), Some("e1/greet/0"));
        for (kind, is_user, meta) in [
            // The flow's own messages, and other systems' custom values.
            ("bot.message.sent", false, "null"),
            ("bot.message.sent", false, r#"{"custom":"ticket-7"}"#),
            (
                "bot.message.sent",
                false,
                r#"{"custom":"x handoff-bridge:e1/a/0"}"#,
            ),
            // A user cannot make their message pass for the bridge's.
            (
                "bot.message.received",
                true,
                r#"{"custom":"handoff-bridge:e1/greet/0"}"#,
            ),
            (
                "bot.message.sent",
                true,
                r#"{"custom":"handoff-bridge:e1/greet/0"}"#,
            ),
        ] {
            let event = message_event(kind, is_user, meta);
            assert_eq!(echo_of(&event), None, "{kind} isUser={is_user} meta={meta}");
        }
    }
}
