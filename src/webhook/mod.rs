//! The service's webhook format: typed models and the validation that decides, per delivery and
//! per event, whether it is accepted or quarantined.
//!
//! Parsing is pure (bytes in, verdict out) so the intake handler, quarantine re-processing and the
//! dispatcher all judge input the same way.

pub mod agent;
pub mod model;

use crate::ids::{DeliveryId, PartitionKey};
use model::{Delivery, Event, EventHeader, Payload};
use serde_json::value::RawValue;

/// A delivery that passed envelope validation. Individual events may still be invalid.
#[derive(Debug)]
pub struct ParsedDelivery {
    pub id: DeliveryId,
    pub events: Vec<IncomingEvent>,
    pub invalid: Vec<InvalidEvent>,
}

/// A valid event, still in the exact bytes the service sent (that is what gets stored).
#[derive(Debug, Clone)]
pub struct IncomingEvent {
    pub partition: PartitionKey,
    pub raw: String,
    /// The platform named by the event, when it is one the bridge does not know.
    pub unknown_platform: bool,
    /// The typed form, handed to the dispatcher so it need not parse the stored bytes again.
    pub event: Event,
}

/// An event of an otherwise valid delivery that cannot be processed.
#[derive(Debug, Clone)]
pub struct InvalidEvent {
    pub raw: String,
    pub reason: String,
}

/// Why a whole delivery is refused (and quarantined).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeliveryError {
    #[error("body is not valid JSON: {0}")]
    InvalidJson(String),
    #[error("body does not match the delivery format: {0}")]
    InvalidFormat(String),
    #[error("delivery has no events")]
    EmptyBatch,
}

impl DeliveryError {
    /// Stable reason code, used in answers, quarantine records and metrics.
    pub fn code(&self) -> &'static str {
        match self {
            DeliveryError::InvalidJson(_) => "invalid_json",
            DeliveryError::InvalidFormat(_) => "invalid_format",
            DeliveryError::EmptyBatch => "empty_batch",
        }
    }
}

/// Why one event cannot be processed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    #[error("event does not match the format: {0}")]
    Format(String),
    #[error("event field `{0}` must not be empty")]
    Empty(&'static str),
    /// `timer.*` events are made by the bridge for its rule timers, `agent.*` for the agent API;
    /// from outside they could fire (or forge) a conversation's timer or an agent's command.
    #[error("event type `{0}` is reserved for the bridge's own timers and agent commands")]
    Reserved(String),
}

/// Validate a delivery body. Envelope errors reject the whole delivery; event errors only that
/// event.
pub fn parse_delivery(body: &[u8]) -> Result<ParsedDelivery, DeliveryError> {
    let delivery: Delivery<'_> = serde_json::from_slice(body).map_err(classify)?;
    if delivery.id.trim().is_empty() {
        return Err(DeliveryError::InvalidFormat(
            "field `id` must not be empty".into(),
        ));
    }
    if delivery.messages.is_empty() {
        return Err(DeliveryError::EmptyBatch);
    }
    let mut events = Vec::with_capacity(delivery.messages.len());
    let mut invalid = Vec::new();
    for raw in delivery.messages {
        match validate_event(raw) {
            Ok(event) => events.push(event),
            Err(err) => invalid.push(InvalidEvent {
                raw: raw.get().to_owned(),
                reason: err.to_string(),
            }),
        }
    }
    Ok(ParsedDelivery {
        id: DeliveryId::new(delivery.id),
        events,
        invalid,
    })
}

/// Validate one event (as found in `messages[]`) and work out where it is processed. Events from
/// outside may not use the bridge's own event types (`timer.*`).
pub fn validate_event(raw: &RawValue) -> Result<IncomingEvent, EventError> {
    let event = parse(raw.get(), Origin::Outside)?;
    let unknown_platform = match &event.payload {
        Payload::EndUser(u) => !u.platform.is_known(),
        Payload::Conversation(c) => c.platform.as_ref().is_some_and(|p| !p.is_known()),
        _ => false,
    };
    Ok(IncomingEvent {
        partition: partition_of(&event),
        raw: raw.get().to_owned(),
        unknown_platform,
        event,
    })
}

/// Who made an event: the service (or anyone posting to the webhook), or the bridge.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Origin {
    Outside,
    Stored,
}

/// Parse a stored event (accepted from the service, or made by the bridge: timer firings) into
/// its typed form.
pub fn parse_event(raw: &str) -> Result<Event, EventError> {
    parse(raw, Origin::Stored)
}

fn parse(raw: &str, origin: Origin) -> Result<Event, EventError> {
    let header: EventHeader<'_> =
        serde_json::from_str(raw).map_err(|e| EventError::Format(e.to_string()))?;
    if header.id.as_str().trim().is_empty() {
        return Err(EventError::Empty("id"));
    }
    if header.source_id.as_str().is_empty() {
        return Err(EventError::Empty("sourceId"));
    }
    let timer = header.event.timer_name();
    let agent = header.event.agent_command();
    if (timer.is_some() || agent.is_some()) && origin == Origin::Outside {
        return Err(EventError::Reserved(header.event.as_str().to_owned()));
    }
    let payload = match header.event.data_key() {
        None if timer.is_some() => Payload::Timer(timer_payload(timer, header.data.get())?),
        None if agent.is_some() => Payload::Agent(agent_payload(agent, header.data.get())?),
        None => Payload::Unknown(
            serde_json::from_str(header.data.get())
                .map_err(|e| EventError::Format(e.to_string()))?,
        ),
        Some(key) => typed_payload(key, header.data.get())?,
    };
    Ok(Event {
        id: header.id,
        kind: header.event,
        source_id: header.source_id,
        timestamp: header.timestamp,
        payload,
    })
}

fn typed_payload(key: &'static str, data: &str) -> Result<Payload, EventError> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Data {
        bot: Option<model::Bot>,
        end_user: Option<model::EndUser>,
        conversation: Option<model::Conversation>,
        message: Option<model::Message>,
    }
    let data: Data =
        serde_json::from_str(data).map_err(|e| EventError::Format(format!("data: {e}")))?;
    let missing = || EventError::Format(format!("data.{key} is required for this event type"));
    let payload = match key {
        "bot" => Payload::Bot(data.bot.ok_or_else(missing)?),
        "endUser" => Payload::EndUser(data.end_user.ok_or_else(missing)?),
        "conversation" => Payload::Conversation(data.conversation.ok_or_else(missing)?),
        _ => Payload::Message(data.message.ok_or_else(missing)?),
    };
    let empty = match &payload {
        Payload::Bot(b) => b.id.as_str().is_empty().then_some("data.bot.id"),
        Payload::EndUser(u) => u.id.as_str().is_empty().then_some("data.endUser.id"),
        Payload::Conversation(c) => c.id.as_str().is_empty().then_some("data.conversation.id"),
        Payload::Message(m) => m
            .conversation_id
            .as_str()
            .is_empty()
            .then_some("data.message.conversationId"),
        Payload::Timer(_) | Payload::Agent(_) | Payload::Unknown(_) => None,
    };
    match empty {
        Some(field) => Err(EventError::Empty(field)),
        None => Ok(payload),
    }
}

/// `data.timer` of a `timer.<name>` event, checked against the name in its type.
fn timer_payload(name: Option<&str>, data: &str) -> Result<model::TimerFiring, EventError> {
    #[derive(serde::Deserialize)]
    struct Data {
        timer: model::TimerFiring,
    }
    let Data { timer } =
        serde_json::from_str(data).map_err(|e| EventError::Format(format!("data: {e}")))?;
    if timer.conversation_id.as_str().is_empty() {
        return Err(EventError::Empty("data.timer.conversationId"));
    }
    if name != Some(timer.name.as_str()) || !model::is_timer_name(&timer.name) {
        return Err(EventError::Format(
            "data.timer.name must be the name in the event type (A-Z a-z 0-9 - _)".into(),
        ));
    }
    Ok(timer)
}

/// `data.agent` of an `agent.<command>` event, checked against the command in its type.
fn agent_payload(name: Option<&str>, data: &str) -> Result<agent::AgentCommand, EventError> {
    #[derive(serde::Deserialize)]
    struct Data {
        agent: agent::AgentCommand,
    }
    let Data { agent } =
        serde_json::from_str(data).map_err(|e| EventError::Format(format!("data: {e}")))?;
    if agent.conversation_id.as_str().is_empty() {
        return Err(EventError::Empty("data.agent.conversationId"));
    }
    if name != Some(agent.command.name()) {
        return Err(EventError::Format(
            "data.agent.command must be the command in the event type".into(),
        ));
    }
    Ok(agent)
}

/// The event an agent command is stored as. `id` is made by the API (from the request's
/// idempotency key when it has one, so a retried call is a duplicate), `bot` is the
/// conversation's bot (the `sourceId`), `at` when the API received the call.
pub fn agent_event(
    command: &agent::AgentCommand,
    id: &str,
    bot: &str,
    at: model::Millis,
) -> Result<IncomingEvent, EventError> {
    let raw = serde_json::json!({
        "id": id,
        "event": command.event_type(),
        "sourceType": "bridge",
        "sourceId": bot,
        "timestamp": at,
        "data": { "agent": command },
    })
    .to_string();
    let event = parse_event(&raw)?;
    Ok(IncomingEvent {
        partition: partition_of(&event),
        raw,
        unknown_platform: false,
        event,
    })
}

/// The event a due timer fires as, stored and folded like a delivered one. Its id is
/// deterministic (`timer:<conversation>:<name>:<due ms>`), so firing it again after a crash is a
/// duplicate. `bot` is the conversation's bot (the event's `sourceId`).
pub fn timer_event(timer: &model::TimerFiring, bot: &str) -> Result<IncomingEvent, EventError> {
    let id = format!(
        "timer:{}:{}:{}",
        timer.conversation_id, timer.name, timer.due_at
    );
    let raw = serde_json::json!({
        "id": id,
        "event": format!("{}{}", model::TIMER_EVENT_PREFIX, timer.name),
        "sourceType": "bridge",
        "sourceId": bot,
        "timestamp": timer.due_at,
        "data": { "timer": timer },
    })
    .to_string();
    // Parsed back like any stored event, so what is stored is known to be readable.
    let event = parse_event(&raw)?;
    Ok(IncomingEvent {
        partition: partition_of(&event),
        raw,
        unknown_platform: false,
        event,
    })
}

/// The ordering domain of an event.
pub fn partition_of(event: &Event) -> PartitionKey {
    if let Some(id) = event.payload.conversation_id() {
        return PartitionKey::Conversation(id.clone());
    }
    match &event.payload {
        Payload::EndUser(u) => PartitionKey::EndUser(u.id.clone()),
        Payload::Bot(b) => PartitionKey::Bot(b.id.clone()),
        _ => PartitionKey::Bot(event.source_id.clone()),
    }
}

fn classify(err: serde_json::Error) -> DeliveryError {
    use serde_json::error::Category;
    match err.classify() {
        Category::Syntax | Category::Eof | Category::Io => {
            DeliveryError::InvalidJson(err.to_string())
        }
        Category::Data => DeliveryError::InvalidFormat(err.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::{MessageType, Platform, Sender};

    fn fixture(name: &str) -> Vec<u8> {
        let path = format!(
            "{}/../shared/fixtures/webhooks/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// Found by fuzzing (`fuzz/fuzz_targets/webhook_parser.rs`): a 17-digit longitude came back
    /// one unit off in the last place after being written and read again, until serde_json's
    /// `float_roundtrip` parser was turned on.
    #[test]
    fn a_message_payload_with_a_17_digit_float_survives_a_json_round_trip() {
        let path = format!(
            "{}/tests/data/fuzz/webhook-float-round-trip.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let body = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let delivery = parse_delivery(&body).expect("the input is a valid delivery");
        assert!(!delivery.events.is_empty(), "no valid event in the input");
        for incoming in &delivery.events {
            let model::Payload::Message(message) = &incoming.event.payload else {
                panic!("expected a message event: {}", incoming.raw);
            };
            let text = serde_json::to_string(message).expect("to JSON");
            let back: model::Message = serde_json::from_str(&text).expect("reads back");
            assert_eq!(&back, message, "{text}");
        }
    }

    #[test]
    fn every_shared_fixture_parses_without_invalid_events() {
        let dir = format!("{}/../shared/fixtures/webhooks", env!("CARGO_MANIFEST_DIR"));
        let mut seen = 0;
        for entry in std::fs::read_dir(dir).expect("fixtures dir") {
            let path = entry.expect("entry").path();
            let body = std::fs::read(&path).expect("read fixture");
            let parsed = parse_delivery(&body).unwrap_or_else(|e| panic!("{path:?}: {e}"));
            assert!(parsed.invalid.is_empty(), "{path:?}: {:?}", parsed.invalid);
            assert!(!parsed.events.is_empty());
            for e in &parsed.events {
                assert!(e.event.kind.is_known(), "{path:?}: {}", e.event.kind);
                parse_event(&e.raw).expect("stored raw re-parses");
            }
            seen += 1;
        }
        assert!(seen >= 18, "expected the shared fixtures, saw {seen}");
    }

    #[test]
    fn agent_message_is_told_apart_by_meta_sender_or_persona() {
        let parsed = parse_delivery(&fixture("message-sent-agent-text.json")).expect("parse");
        let event = parse_event(&parsed.events[0].raw).expect("event");
        let Payload::Message(m) = event.payload else {
            panic!("not a message")
        };
        assert_eq!(m.sender(), Sender::Agent);
        assert_eq!(m.data.kind, MessageType::Text);

        let persona = r#"{"id":"m","conversationId":"c","isUser":false,"meta":{"persona":{"name":"x"}},"data":{"type":"text","text":"hi"}}"#;
        let m: model::Message = serde_json::from_str(persona).expect("persona message");
        assert_eq!(m.sender(), Sender::Agent);
        let bot = r#"{"id":"m","conversationId":"c","isUser":false,"meta":{"custom":"x"},"data":{"type":"text"}}"#;
        let m: model::Message = serde_json::from_str(bot).expect("bot message");
        assert_eq!(m.sender(), Sender::Bot);
    }

    #[test]
    fn unknown_event_types_platforms_and_message_types_are_kept() {
        let body = br#"{"id":"d1","webhookId":"w","webhookUrl":"u","messages":[
            {"id":"e1","event":"bot.something.new","sourceType":"bot","sourceId":"B1","timestamp":1,"data":{"weird":[1,2]}},
            {"id":"e2","event":"bot.end_user.created","sourceType":"bot","sourceId":"B1","timestamp":2,
             "data":{"endUser":{"id":"u1","platform":"telegram","userKey":"k"}}},
            {"id":"e3","event":"bot.message.received","sourceType":"bot","sourceId":"B1","timestamp":3,
             "data":{"message":{"id":"m","conversationId":"c1","isUser":true,"meta":null,"data":{"type":"sticker","sticker":{}}}}}
        ]}"#;
        let parsed = parse_delivery(body).expect("parse");
        assert!(parsed.invalid.is_empty(), "{:?}", parsed.invalid);
        assert_eq!(
            parsed.events[0].event.kind,
            model::EventKind::Other("bot.something.new".into())
        );
        assert_eq!(parsed.events[0].partition, PartitionKey::Bot("B1".into()));
        assert!(parsed.events[1].unknown_platform);
        let e2 = parse_event(&parsed.events[1].raw).expect("e2");
        let Payload::EndUser(u) = e2.payload else {
            panic!()
        };
        assert_eq!(u.platform, Platform::Other("telegram".into()));
        let e3 = parse_event(&parsed.events[2].raw).expect("e3");
        let Payload::Message(m) = e3.payload else {
            panic!()
        };
        assert_eq!(m.data.kind, MessageType::Other("sticker".into()));
    }

    #[test]
    fn manual_status_is_read_from_the_undocumented_context_field() {
        let c: model::Conversation = serde_json::from_str(
            r#"{"id":"c","context":{"manual":{"status":"HANDOVER"}},"navigation":{}}"#,
        )
        .expect("conversation");
        assert_eq!(c.manual_status(), Some("HANDOVER"));
        assert!(c.effective_navigation().is_none());
    }

    #[test]
    fn bad_envelopes_are_classified() {
        assert!(matches!(
            parse_delivery(b"{not json"),
            Err(DeliveryError::InvalidJson(_))
        ));
        assert!(matches!(
            parse_delivery(br#"{"id":"d","webhookId":"w","webhookUrl":"u","messages":[{"id":"e""#),
            Err(DeliveryError::InvalidJson(_))
        ));
        assert!(matches!(
            parse_delivery(br#"{"id":5,"webhookId":"w","webhookUrl":"u","messages":[]}"#),
            Err(DeliveryError::InvalidFormat(_))
        ));
        assert!(matches!(
            parse_delivery(br#"{"webhookId":"w","webhookUrl":"u","messages":[]}"#),
            Err(DeliveryError::InvalidFormat(_))
        ));
        assert_eq!(
            parse_delivery(br#"{"id":"d","webhookId":"w","webhookUrl":"u","messages":[]}"#)
                .map(|_| ()),
            Err(DeliveryError::EmptyBatch)
        );
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(matches!(
            parse_delivery(deep.as_bytes()),
            Err(DeliveryError::InvalidJson(_) | DeliveryError::InvalidFormat(_))
        ));
    }

    fn firing() -> model::TimerFiring {
        model::TimerFiring {
            conversation_id: "c1".into(),
            name: "agent-wait".into(),
            due_at: 1_763_690_700_000,
            started_by: "e1/ask-agent/2".into(),
        }
    }

    #[test]
    fn a_timer_event_round_trips_through_parse_event_into_its_conversation() {
        let made = timer_event(&firing(), "B7f3a2c").expect("timer event");
        let event = parse_event(&made.raw).expect("stored form parses");
        assert_eq!(event.id.as_str(), "timer:c1:agent-wait:1763690700000");
        assert_eq!(event.kind.as_str(), "timer.agent-wait");
        assert_eq!(event.kind.timer_name(), Some("agent-wait"));
        assert_eq!(event.source_id.as_str(), "B7f3a2c");
        assert_eq!(event.timestamp, 1_763_690_700_000);
        match &event.payload {
            Payload::Timer(t) => assert_eq!(t, &firing()),
            other => panic!("not a timer payload: {other:?}"),
        }
        assert_eq!(made.partition, PartitionKey::Conversation("c1".into()));
        assert_eq!(partition_of(&event), made.partition);
        // Deterministic: the same timer run makes the same event.
        let again = timer_event(&firing(), "B7f3a2c").expect("again");
        assert_eq!(again.raw, made.raw);
    }

    #[test]
    fn a_stored_timer_event_must_name_its_timer_consistently() {
        let raw = timer_event(&firing(), "B1").expect("event").raw;
        let renamed = raw.replace(
            "\"event\":\"timer.agent-wait\"",
            "\"event\":\"timer.other\"",
        );
        assert_ne!(renamed, raw);
        assert!(matches!(parse_event(&renamed), Err(EventError::Format(_))));
        let no_data = raw.replace("\"timer\":{", "\"timers\":{");
        assert!(matches!(parse_event(&no_data), Err(EventError::Format(_))));
    }

    #[test]
    fn the_service_cannot_send_timer_events() {
        let forged = timer_event(&firing(), "B1").expect("event").raw;
        let garbled = r#"{"id":"e2","event":"timer.x","sourceType":"bot","sourceId":"B1","timestamp":1,"data":{}}"#;
        let fine = r#"{"id":"e3","event":"bot.updated","sourceType":"bot","sourceId":"B1","timestamp":3,"data":{"bot":{"id":"B1"}}}"#;
        let body = format!(
            r#"{{"id":"d1","webhookId":"w","webhookUrl":"u","messages":[{forged},{garbled},{fine}]}}"#
        );
        let parsed = parse_delivery(body.as_bytes()).expect("envelope ok");
        assert_eq!(parsed.events.len(), 1, "only the bot event is accepted");
        assert_eq!(parsed.events[0].event.id.as_str(), "e3");
        assert_eq!(parsed.invalid.len(), 2);
        for bad in &parsed.invalid {
            assert!(
                bad.reason.contains("reserved for the bridge's own timers"),
                "{}",
                bad.reason
            );
        }
        // Quarantine re-processing judges the same way.
        let raw: Box<RawValue> = serde_json::from_str(&forged).expect("raw");
        assert!(matches!(validate_event(&raw), Err(EventError::Reserved(_))));
    }

    fn accept() -> agent::AgentCommand {
        agent::AgentCommand {
            conversation_id: "c1".into(),
            command: agent::Command::Accept {
                agent: agent::DeskAgent {
                    id: "a1".into(),
                    name: None,
                },
            },
        }
    }

    #[test]
    fn an_agent_event_round_trips_into_its_conversation() {
        let made = agent_event(&accept(), "agent:c1:accept:k1", "B1", 5).expect("agent event");
        let event = parse_event(&made.raw).expect("stored form parses");
        assert_eq!(event.kind.as_str(), "agent.accept");
        assert_eq!(event.kind.agent_command(), Some("accept"));
        assert!(matches!(&event.payload, Payload::Agent(a) if *a == accept()));
        assert_eq!(made.partition, PartitionKey::Conversation("c1".into()));
        let renamed = made.raw.replace("\"agent.accept\"", "\"agent.release\"");
        assert!(matches!(parse_event(&renamed), Err(EventError::Format(_))));
    }

    #[test]
    fn the_service_cannot_send_agent_events() {
        let forged = agent_event(&accept(), "e1", "B1", 5).expect("event").raw;
        let body =
            format!(r#"{{"id":"d1","webhookId":"w","webhookUrl":"u","messages":[{forged}]}}"#);
        let parsed = parse_delivery(body.as_bytes()).expect("envelope ok");
        assert!(parsed.events.is_empty());
        assert_eq!(parsed.invalid.len(), 1);
        assert!(
            parsed.invalid[0].reason.contains("agent commands"),
            "{}",
            parsed.invalid[0].reason
        );
        let raw: Box<RawValue> = serde_json::from_str(&forged).expect("raw");
        assert!(matches!(validate_event(&raw), Err(EventError::Reserved(_))));
    }

    #[test]
    fn an_event_missing_its_payload_is_invalid_but_its_siblings_are_not() {
        let body = br#"{"id":"d1","webhookId":"w","webhookUrl":"u","messages":[
            {"id":"e1","event":"bot.conversation.updated","sourceType":"bot","sourceId":"B1","timestamp":1,"data":{}},
            {"id":"e2","event":"bot.conversation.updated","sourceType":"bot","sourceId":"B1","timestamp":"soon","data":{}},
            {"id":"e3","event":"bot.updated","sourceType":"bot","sourceId":"B1","timestamp":3,"data":{"bot":{"id":"B1"}}}
        ]}"#;
        let parsed = parse_delivery(body).expect("envelope ok");
        assert_eq!(parsed.events.len(), 1);
        assert_eq!(parsed.invalid.len(), 2);
        assert!(
            parsed.invalid[0].reason.contains("data.conversation"),
            "{}",
            parsed.invalid[0].reason
        );
    }
}
