//! The service's webhook format: typed models and the validation that decides, per delivery and
//! per event, whether it is accepted or quarantined.
//!
//! Parsing is pure (bytes in, verdict out) so the intake handler, quarantine re-processing and the
//! dispatcher all judge input the same way.

pub mod agent;
pub mod drift;
pub mod model;

use crate::ids::{DeliveryId, PartitionKey};
use model::{Event, EventHeader, Millis, Payload};
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
    /// More events than `webhook.max_events`: the whole delivery is quarantined (the events
    /// were counted, not built).
    #[error("delivery has {count} events, more than the limit of {max} (webhook.max_events)")]
    TooManyEvents { count: usize, max: usize },
}

impl DeliveryError {
    /// Stable reason code, used in answers, quarantine records and metrics.
    pub fn code(&self) -> &'static str {
        match self {
            DeliveryError::InvalidJson(_) => "invalid_json",
            DeliveryError::InvalidFormat(_) => "invalid_format",
            DeliveryError::EmptyBatch => "empty_batch",
            DeliveryError::TooManyEvents { .. } => "too_many_events",
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
    #[error("event type `{0}` is reserved for the bridge's own timers, agent commands and reconciliation")]
    Reserved(String),
    /// The id starts with a prefix the bridge makes its own ids with (`ids::RESERVED_ID_PREFIXES`):
    /// accepted, it would make the bridge's own event (a timer firing, an agent command, a
    /// re-processed record) a duplicate.
    #[error("event id `{id}` starts with `{prefix}`, which is reserved for the bridge's own ids")]
    ReservedId { id: String, prefix: &'static str },
    /// Stamped further ahead of its receive time than `webhook.max_clock_skew`: it would win
    /// every last-writer-wins field until real time caught up with it.
    #[error("event timestamp {timestamp} is {ahead_ms} ms after its receive time, more than the allowed clock skew of {skew_ms} ms (webhook.max_clock_skew)")]
    Future {
        timestamp: Millis,
        ahead_ms: i64,
        skew_ms: i64,
    },
}

/// What intake checks beyond the format: the event count and how far in the future an event may
/// be stamped. [`Checks::NONE`] checks neither (tools and tests that judge a body on its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checks {
    /// At most this many events per delivery (`webhook.max_events`).
    pub max_events: usize,
    /// `(receive time, max skew)`, both ms: an event stamped after their sum is invalid.
    pub not_after: Option<(Millis, i64)>,
}

impl Checks {
    pub const NONE: Checks = Checks {
        max_events: usize::MAX,
        not_after: None,
    };

    /// The webhook's checks for a body received at `now`.
    pub fn intake(max_events: usize, max_clock_skew: std::time::Duration, now: Millis) -> Checks {
        Checks {
            max_events,
            not_after: Some((
                now,
                i64::try_from(max_clock_skew.as_millis()).unwrap_or(i64::MAX),
            )),
        }
    }

    /// An event stamped too far ahead of its receive time.
    pub fn check_time(&self, event: &Event) -> Result<(), EventError> {
        let Some((now, skew_ms)) = self.not_after else {
            return Ok(());
        };
        let ahead_ms = event.timestamp.saturating_sub(now);
        if ahead_ms > skew_ms {
            return Err(EventError::Future {
                timestamp: event.timestamp,
                ahead_ms,
                skew_ms,
            });
        }
        Ok(())
    }

    /// [`validate_event`], then the time check.
    pub fn validate(&self, raw: &RawValue) -> Result<IncomingEvent, EventError> {
        let event = validate_event(raw)?;
        self.check_time(&event.event)?;
        Ok(event)
    }
}

/// Validate a delivery body. Envelope errors reject the whole delivery; event errors only that
/// event. No count limit, no time check: see [`parse_delivery_with`].
pub fn parse_delivery(body: &[u8]) -> Result<ParsedDelivery, DeliveryError> {
    parse_delivery_with(body, &Checks::NONE)
}

/// [`parse_delivery`] with intake's checks. The envelope is read in one pass that keeps (as
/// borrowed raw slices) at most `max_events` events and only counts the rest, so a body of
/// millions of tiny events costs a count, not millions of typed events.
pub fn parse_delivery_with(body: &[u8], checks: &Checks) -> Result<ParsedDelivery, DeliveryError> {
    use serde::de::DeserializeSeed as _;
    let mut de = serde_json::Deserializer::from_slice(body);
    let delivery = envelope::EnvelopeSeed {
        max_events: checks.max_events,
    }
    .deserialize(&mut de)
    .and_then(|d| de.end().map(|()| d))
    .map_err(classify)?;
    if delivery.id.trim().is_empty() {
        return Err(DeliveryError::InvalidFormat(
            "field `id` must not be empty".into(),
        ));
    }
    if delivery.count == 0 {
        return Err(DeliveryError::EmptyBatch);
    }
    if delivery.count > checks.max_events {
        return Err(DeliveryError::TooManyEvents {
            count: delivery.count,
            max: checks.max_events,
        });
    }
    if let Some(prefix) = crate::ids::reserved_prefix(&delivery.id) {
        return Err(DeliveryError::InvalidFormat(format!(
            "delivery id starts with `{prefix}`, which is reserved for the bridge's own ids"
        )));
    }
    let mut events = Vec::with_capacity(delivery.messages.len());
    let mut invalid = Vec::new();
    for raw in delivery.messages {
        match checks.validate(raw) {
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

/// The delivery envelope read by a visitor that counts `messages[]` past a limit without keeping
/// those entries (`IgnoredAny`). Same fields and errors as [`model::Delivery`].
mod envelope {
    use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use serde::Deserialize;
    use serde_json::value::RawValue;
    use std::fmt;

    pub struct Envelope<'a> {
        pub id: String,
        /// The first `max_events` events.
        pub messages: Vec<&'a RawValue>,
        /// How many events `messages[]` holds.
        pub count: usize,
    }

    pub struct EnvelopeSeed {
        pub max_events: usize,
    }

    #[derive(Deserialize)]
    #[serde(field_identifier, rename_all = "camelCase")]
    enum Field {
        Id,
        WebhookId,
        WebhookUrl,
        Messages,
        #[serde(other)]
        Other,
    }

    impl<'de> DeserializeSeed<'de> for EnvelopeSeed {
        type Value = Envelope<'de>;
        fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_map(self)
        }
    }

    impl<'de> Visitor<'de> for EnvelopeSeed {
        type Value = Envelope<'de>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("struct Delivery")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut id: Option<String> = None;
            let mut webhook_id = false;
            let mut webhook_url = false;
            let mut messages: Option<(Vec<&'de RawValue>, usize)> = None;
            fn once<E: de::Error>(seen: bool, name: &'static str) -> Result<(), E> {
                if seen {
                    return Err(E::duplicate_field(name));
                }
                Ok(())
            }
            while let Some(field) = map.next_key::<Field>()? {
                match field {
                    Field::Id => {
                        once(id.is_some(), "id")?;
                        id = Some(map.next_value()?);
                    }
                    Field::WebhookId => {
                        once(webhook_id, "webhookId")?;
                        map.next_value::<String>()?;
                        webhook_id = true;
                    }
                    Field::WebhookUrl => {
                        once(webhook_url, "webhookUrl")?;
                        map.next_value::<String>()?;
                        webhook_url = true;
                    }
                    Field::Messages => {
                        once(messages.is_some(), "messages")?;
                        messages = Some(map.next_value_seed(Messages {
                            max: self.max_events,
                        })?);
                    }
                    Field::Other => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            let id = id.ok_or_else(|| de::Error::missing_field("id"))?;
            if !webhook_id {
                return Err(de::Error::missing_field("webhookId"));
            }
            if !webhook_url {
                return Err(de::Error::missing_field("webhookUrl"));
            }
            let (messages, count) = messages.ok_or_else(|| de::Error::missing_field("messages"))?;
            Ok(Envelope {
                id,
                messages,
                count,
            })
        }
    }

    /// `messages[]`: keeps the first `max` entries (raw), counts all.
    struct Messages {
        max: usize,
    }

    impl<'de> DeserializeSeed<'de> for Messages {
        type Value = (Vec<&'de RawValue>, usize);
        fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_seq(self)
        }
    }

    impl<'de> Visitor<'de> for Messages {
        type Value = (Vec<&'de RawValue>, usize);

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a sequence of events")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut kept = Vec::new();
            let mut count = 0usize;
            loop {
                let more = if kept.len() < self.max {
                    match seq.next_element::<&'de RawValue>()? {
                        Some(raw) => {
                            kept.push(raw);
                            true
                        }
                        None => false,
                    }
                } else {
                    seq.next_element::<IgnoredAny>()?.is_some()
                };
                if !more {
                    return Ok((kept, count));
                }
                count += 1;
            }
        }
    }
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
    let drift = drift::is_reconcile_event(header.event.as_str())
        || header
            .event
            .as_str()
            .starts_with(drift::RECONCILE_EVENT_PREFIX);
    if (timer.is_some() || agent.is_some() || drift) && origin == Origin::Outside {
        return Err(EventError::Reserved(header.event.as_str().to_owned()));
    }
    if origin == Origin::Outside {
        if let Some(prefix) = crate::ids::reserved_prefix(header.id.as_str()) {
            return Err(EventError::ReservedId {
                id: header.id.as_str().to_owned(),
                prefix,
            });
        }
    }
    let payload = match header.event.data_key() {
        None if timer.is_some() => Payload::Timer(timer_payload(timer, header.data.get())?),
        None if agent.is_some() => Payload::Agent(agent_payload(agent, header.data.get())?),
        None if drift => Payload::Reconcile(drift_payload(&header.event, header.data.get())?),
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
        Payload::Timer(_) | Payload::Agent(_) | Payload::Reconcile(_) | Payload::Unknown(_) => None,
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

/// `data.drift` of a `reconcile.drift` event (the only `reconcile.*` type).
fn drift_payload(kind: &model::EventKind, data: &str) -> Result<drift::Drift, EventError> {
    #[derive(serde::Deserialize)]
    struct Data {
        drift: drift::Drift,
    }
    if !drift::is_reconcile_event(kind.as_str()) {
        return Err(EventError::Format(format!(
            "`{kind}` is not a reconciliation event type (`{}`)",
            drift::DRIFT_EVENT
        )));
    }
    let Data { drift } =
        serde_json::from_str(data).map_err(|e| EventError::Format(format!("data: {e}")))?;
    if drift.conversation_id.as_str().is_empty() {
        return Err(EventError::Empty("data.drift.conversation_id"));
    }
    Ok(drift)
}

/// The event a drift found by the sweeper is stored as: id from [`drift::Drift::event_id`],
/// timestamp its `found_at`, `bot` the conversation's bot (the `sourceId`).
pub fn drift_event(drift: &drift::Drift, bot: &str) -> Result<IncomingEvent, EventError> {
    let raw = serde_json::json!({
        "id": drift.event_id(),
        "event": drift::DRIFT_EVENT,
        "sourceType": "bridge",
        "sourceId": bot,
        "timestamp": drift.found_at,
        "data": { "drift": drift },
    });
    own_event(raw)
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
    });
    own_event(raw)
}

/// The event a due timer fires as, stored and folded like a delivered one. Its id is
/// deterministic (`timer:<conversation>:<name>:<due ms>`), so firing it again after a crash is a
/// duplicate. `bot` is the conversation's bot (the event's `sourceId`).
pub fn timer_event(timer: &model::TimerFiring, bot: &str) -> Result<IncomingEvent, EventError> {
    let id = crate::ids::Internal::Timer.id(format_args!(
        "{}:{}:{}",
        timer.conversation_id, timer.name, timer.due_at
    ));
    let raw = serde_json::json!({
        "id": id,
        "event": format!("{}{}", model::TIMER_EVENT_PREFIX, timer.name),
        "sourceType": "bridge",
        "sourceId": bot,
        "timestamp": timer.due_at,
        "data": { "timer": timer },
    });
    own_event(raw)
}

/// What a backfilled event's raw JSON says of its origin (`"source": "backfill"`), next to the
/// service's own fields: the audit shows it, and the id's prefix (`backfill:`) marks it too.
pub const BACKFILL_SOURCE: &str = "backfill";

/// A message the Open API lists and the webhook never delivered, as the event the service would
/// have sent (`bot.message.received` for a user's, `bot.message.sent` otherwise), marked
/// `source: backfill`. Its id is deterministic (`backfill:message:<message id>`), so reading it
/// again is a duplicate; the fold knows the message by its own id whichever copy came first.
/// Stamped with the message's own time (`at` when it has none).
pub fn backfill_message_event(
    message: &model::Message,
    bot: &str,
    at: model::Millis,
) -> Result<IncomingEvent, EventError> {
    let kind = if message.is_user {
        model::EventKind::MessageReceived
    } else {
        model::EventKind::MessageSent
    };
    let id = crate::ids::Internal::Backfill.id(format_args!("message:{}", message.id));
    let data = serde_json::json!({ "message": message });
    backfill_event(&id, kind, bot, message.timestamp.unwrap_or(at), data)
}

/// A conversation the Open API shows changed (its `updatedAt`), as a `bot.conversation.updated`
/// event carrying the conversation as listed (manual status, params, navigation), marked
/// `source: backfill`; id `backfill:conversation:<id>:<updatedAt ms>`.
pub fn backfill_conversation_event(
    conversation: &model::Conversation,
    bot: &str,
    updated_at: model::Millis,
) -> Result<IncomingEvent, EventError> {
    let id = crate::ids::Internal::Backfill.id(format_args!(
        "conversation:{}:{updated_at}",
        conversation.id
    ));
    let data = serde_json::json!({ "conversation": conversation });
    backfill_event(
        &id,
        model::EventKind::ConversationUpdated,
        bot,
        updated_at,
        data,
    )
}

fn backfill_event(
    id: &str,
    kind: model::EventKind,
    bot: &str,
    at: model::Millis,
    data: serde_json::Value,
) -> Result<IncomingEvent, EventError> {
    let raw = serde_json::json!({
        "id": id,
        "event": kind.as_str(),
        "sourceType": "bot",
        "source": BACKFILL_SOURCE,
        "sourceId": bot,
        "timestamp": at,
        "data": data,
    });
    own_event(raw)
}

/// An event the bridge makes itself (timer firing, agent command, drift, backfilled event) from
/// its JSON: parsed back like any stored event, so what is stored is known to be readable.
fn own_event(json: serde_json::Value) -> Result<IncomingEvent, EventError> {
    let raw = json.to_string();
    let event = parse_event(&raw)?;
    Ok(IncomingEvent {
        partition: partition_of(&event),
        raw,
        unknown_platform: false,
        event,
    })
}

/// Whether an event was made by backfill (its id carries the reserved `backfill:` prefix).
pub fn is_backfilled(event: &model::Event) -> bool {
    event
        .id
        .as_str()
        .starts_with(crate::ids::Internal::Backfill.prefix())
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

/// The events of a file holding one event or a whole delivery.
pub fn events_of(bytes: &[u8]) -> Result<Vec<Event>, String> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    if value.get("messages").is_some() {
        let parsed = parse_delivery(bytes).map_err(|e| e.to_string())?;
        if let Some(bad) = parsed.invalid.first() {
            return Err(format!("invalid event in the delivery: {}", bad.reason));
        }
        return Ok(parsed.events.into_iter().map(|e| e.event).collect());
    }
    let raw =
        serde_json::value::RawValue::from_string(value.to_string()).map_err(|e| e.to_string())?;
    let event = validate_event(&raw).map_err(|e| e.to_string())?;
    Ok(vec![event.event])
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::{MessageType, Platform, Sender};

    fn fixture(name: &str) -> Vec<u8> {
        let path = format!(
            "{}/../../../shared/fixtures/webhooks/{name}",
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
            "{}/../../tests/data/fuzz/webhook-float-round-trip.json",
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
        let dir = format!(
            "{}/../../../shared/fixtures/webhooks",
            env!("CARGO_MANIFEST_DIR")
        );
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

    fn drift() -> drift::Drift {
        drift::Drift {
            conversation_id: "c1".into(),
            kind: drift::DriftKind::ManualOnUnknown,
            believed: drift::Believed {
                manual: false,
                phase: "bot".into(),
                agent: false,
                waiting: false,
            },
            service: drift::Observed {
                manual: true,
                status: Some("HANDOVER".into()),
                updated_at: Some(3),
            },
            found_at: 1_763_690_700_000,
        }
    }

    #[test]
    fn a_drift_event_round_trips_into_its_conversation_and_is_refused_from_outside() {
        let made = drift_event(&drift(), "B1").expect("drift event");
        let event = parse_event(&made.raw).expect("parse");
        assert_eq!(
            event.id.as_str(),
            "reconcile:c1:manual_on_unknown:1763690700000"
        );
        assert_eq!(event.kind.as_str(), "reconcile.drift");
        assert_eq!(event.timestamp, 1_763_690_700_000);
        assert!(matches!(&event.payload, Payload::Reconcile(d) if *d == drift()));
        assert_eq!(
            made.partition,
            PartitionKey::Conversation(crate::ids::ConversationId::new("c1"))
        );
        // From the webhook: the type is the bridge's own, whatever the id.
        let forged = made.raw.replace("reconcile:c1", "e1");
        let raw: Box<RawValue> = serde_json::from_str(&forged).expect("raw");
        assert!(matches!(validate_event(&raw), Err(EventError::Reserved(_))));
        let other = made.raw.replace("reconcile.drift", "reconcile.other");
        assert!(matches!(parse_event(&other), Err(EventError::Format(_))));
    }

    fn bot_event(id: &str, timestamp: i64) -> String {
        format!(
            r#"{{"id":"{id}","event":"bot.updated","sourceType":"bot","sourceId":"B1","timestamp":{timestamp},"data":{{"bot":{{"id":"B1"}}}}}}"#
        )
    }

    fn envelope(id: &str, events: &[String]) -> Vec<u8> {
        format!(
            r#"{{"id":"{id}","webhookId":"w","webhookUrl":"u","messages":[{}]}}"#,
            events.join(",")
        )
        .into_bytes()
    }

    #[test]
    fn events_past_the_limit_are_counted_not_kept() {
        let empties = vec!["{}".to_owned(); 1_000];
        let body = envelope("d1", &empties);
        let checks = Checks {
            max_events: 10,
            ..Checks::NONE
        };
        assert_eq!(
            parse_delivery_with(&body, &checks).map(|_| ()),
            Err(DeliveryError::TooManyEvents {
                count: 1_000,
                max: 10
            })
        );
        assert_eq!(
            DeliveryError::TooManyEvents { count: 2, max: 1 }.code(),
            "too_many_events"
        );
        // At the limit: a delivery, each `{}` an invalid event.
        let checks = Checks {
            max_events: 1_000,
            ..Checks::NONE
        };
        let parsed = parse_delivery_with(&body, &checks).expect("at the limit");
        assert_eq!((parsed.events.len(), parsed.invalid.len()), (0, 1_000));
        // Bad JSON after the limit is still bad JSON; the envelope's own errors are unchanged.
        let mut broken = envelope("d1", &empties);
        broken.truncate(broken.len() - 3);
        let checks = Checks {
            max_events: 10,
            ..Checks::NONE
        };
        assert!(matches!(
            parse_delivery_with(&broken, &checks),
            Err(DeliveryError::InvalidJson(_))
        ));
        let twice = br#"{"id":"d","id":"e","webhookId":"w","webhookUrl":"u","messages":[{}]}"#;
        assert!(matches!(
            parse_delivery(twice),
            Err(DeliveryError::InvalidFormat(e)) if e.contains("duplicate field `id`")
        ));
        let no_url = br#"{"id":"d","webhookId":"w","messages":[{}]}"#;
        assert!(matches!(
            parse_delivery(no_url),
            Err(DeliveryError::InvalidFormat(e)) if e.contains("webhookUrl")
        ));
        let messages_object = br#"{"id":"d","webhookId":"w","webhookUrl":"u","messages":{}}"#;
        assert!(matches!(
            parse_delivery(messages_object),
            Err(DeliveryError::InvalidFormat(_))
        ));
        let trailing = br#"{"id":"d","webhookId":"w","webhookUrl":"u","messages":[{}]} x"#;
        assert!(matches!(
            parse_delivery(trailing),
            Err(DeliveryError::InvalidJson(_))
        ));
    }

    proptest::proptest! {
        /// The counting visitor keeps what fits, counts the rest, and agrees with the unlimited
        /// parse on every delivery within the limit.
        #[test]
        fn the_count_decides_and_within_it_the_parse_is_unchanged(
            kinds in proptest::collection::vec(0u8..3, 0..40),
            max in 1usize..40,
        ) {
            let events: Vec<String> = kinds
                .iter()
                .enumerate()
                .map(|(i, k)| match k {
                    0 => "{}".to_owned(),
                    1 => bot_event(&format!("e{i}"), 1),
                    _ => format!("[{i}]"),
                })
                .collect();
            let body = envelope("d1", &events);
            let checks = Checks { max_events: max, ..Checks::NONE };
            let limited = parse_delivery_with(&body, &checks);
            match (events.len(), limited) {
                (0, out) => proptest::prop_assert_eq!(out.map(|_| ()), Err(DeliveryError::EmptyBatch)),
                (n, out) if n > max => proptest::prop_assert_eq!(
                    out.map(|_| ()),
                    Err(DeliveryError::TooManyEvents { count: n, max })
                ),
                (n, out) => {
                    let out = out.expect("within the limit");
                    let all = parse_delivery(&body).expect("unlimited");
                    proptest::prop_assert_eq!(out.events.len() + out.invalid.len(), n);
                    let ids = |p: &ParsedDelivery| p.events.iter().map(|e| e.raw.clone()).collect::<Vec<_>>();
                    proptest::prop_assert_eq!(ids(&out), ids(&all));
                    proptest::prop_assert_eq!(out.invalid.len(), all.invalid.len());
                }
            }
        }
    }

    #[test]
    fn ids_with_a_reserved_prefix_are_refused_from_outside() {
        for prefix in crate::ids::RESERVED_ID_PREFIXES {
            let forged = bot_event(&format!("{prefix}c1:x:1"), 1);
            let body = envelope("d1", &[forged.clone(), bot_event("e-ok", 2)]);
            let parsed = parse_delivery(&body).expect("envelope ok");
            assert_eq!(parsed.events.len(), 1, "{prefix}");
            assert_eq!(parsed.events[0].event.id.as_str(), "e-ok");
            assert_eq!(parsed.invalid.len(), 1, "{prefix}");
            assert!(
                parsed.invalid[0]
                    .reason
                    .contains("reserved for the bridge's own ids"),
                "{}",
                parsed.invalid[0].reason
            );
            let raw: Box<RawValue> = serde_json::from_str(&forged).expect("raw");
            assert!(matches!(
                validate_event(&raw),
                Err(EventError::ReservedId { prefix: p, .. }) if p == *prefix
            ));
            // The bridge still reads its own stored events with such ids.
            parse_event(&forged).expect("stored events are the bridge's");
            // A delivery id with the prefix is refused whole.
            let body = envelope(&format!("{prefix}7"), &[bot_event("e1", 1)]);
            assert!(matches!(
                parse_delivery(&body),
                Err(DeliveryError::InvalidFormat(e)) if e.contains("reserved")
            ));
        }
    }

    #[test]
    fn events_stamped_beyond_the_clock_skew_are_invalid() {
        let now = 1_763_690_000_000;
        let checks = Checks::intake(10, std::time::Duration::from_secs(300), now);
        let year = 365 * 24 * 3_600_000;
        let body = envelope(
            "d1",
            &[
                bot_event("e-year", now + year),
                bot_event("e-edge", now + 300_000),
                bot_event("e-past", now - year),
            ],
        );
        let parsed = parse_delivery_with(&body, &checks).expect("envelope ok");
        let ids: Vec<&str> = parsed.events.iter().map(|e| e.event.id.as_str()).collect();
        assert_eq!(ids, ["e-edge", "e-past"]);
        assert_eq!(parsed.invalid.len(), 1);
        assert!(
            parsed.invalid[0].reason.contains("max_clock_skew"),
            "{}",
            parsed.invalid[0].reason
        );
        // Without intake's checks (tools), the time is not judged.
        assert!(parse_delivery(&body).expect("ok").invalid.is_empty());
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
