//! Arbitrary bytes as a webhook delivery body: `parse_delivery` must answer (never panic), and
//! what it accepts must read back the same way, because the intake stores each event's raw text
//! and the dispatcher, the quarantine re-processing and a restart parse it again
//! (`parse_event`). Properties checked, all promised by `src/webhook`:
//! - an accepted delivery has a non-blank id and at least one event (valid or invalid);
//! - each valid event's raw parses again as a stored event into the same typed event and the same
//!   partition, whose stored text form (`PartitionKey::encode`) decodes back to it;
//! - the typed payload of a valid event survives a JSON round trip (the state stores parts of it);
//! - an invalid event stays invalid as a stored event, for the same reason, unless the reason is
//!   that it used the bridge's own reserved event types (stored events may use them);
//! - a delivery rebuilt from the accepted id and the raw events is judged the same way (parsing is
//!   pure: bytes in, verdict out).
#![no_main]

use model::ids::PartitionKey;
use model::webhook::model::Payload;
use model::webhook::{parse_delivery, parse_event, partition_of, EventError};
use libfuzzer_sys::fuzz_target;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fmt::Debug;

fuzz_target!(|body: &[u8]| {
    let Ok(delivery) = parse_delivery(body) else {
        return;
    };
    assert!(!delivery.id.as_str().trim().is_empty(), "blank delivery id");
    assert!(
        !(delivery.events.is_empty() && delivery.invalid.is_empty()),
        "accepted delivery without events"
    );

    for incoming in &delivery.events {
        let again = parse_event(&incoming.raw).expect("a valid event must parse as a stored one");
        assert_eq!(
            serde_json::to_value(&again).expect("event to JSON"),
            serde_json::to_value(&incoming.event).expect("event to JSON"),
            "stored event reads back differently: {}",
            incoming.raw
        );
        assert_eq!(partition_of(&again), incoming.partition);
        assert_eq!(
            PartitionKey::decode(&incoming.partition.encode()).as_ref(),
            Some(&incoming.partition),
            "partition key does not survive its stored form"
        );
        match &incoming.event.payload {
            Payload::Bot(v) => round_trip(v),
            Payload::EndUser(v) => round_trip(v),
            Payload::Conversation(v) => round_trip(v),
            Payload::Message(v) => round_trip(v),
            Payload::Timer(_) | Payload::Agent(_) | Payload::Reconcile(_) => {
                panic!("reserved event accepted from outside: {}", incoming.raw)
            }
            Payload::Unknown(_) => {}
        }
    }

    for invalid in &delivery.invalid {
        // Refused for using a reserved type, a stored event may still parse (or fail on its data:
        // a stored timer or agent event is checked further); any other reason holds for both.
        let kind = serde_json::from_str::<serde_json::Value>(&invalid.raw)
            .ok()
            .and_then(|v| v.get("event").and_then(|k| k.as_str()).map(str::to_owned));
        let reserved = kind.map(|k| EventError::Reserved(k).to_string());
        if reserved.as_deref() == Some(invalid.reason.as_str()) {
            continue;
        }
        match parse_event(&invalid.raw) {
            Err(err) => assert_eq!(err.to_string(), invalid.reason, "{}", invalid.raw),
            Ok(_) => panic!(
                "invalid ({}), yet a valid stored event: {}",
                invalid.reason, invalid.raw
            ),
        }
    }

    // The same delivery, rebuilt from what was kept: valid events first, then the invalid ones.
    let raws: Vec<&str> = delivery
        .events
        .iter()
        .map(|e| e.raw.as_str())
        .chain(delivery.invalid.iter().map(|e| e.raw.as_str()))
        .collect();
    let rebuilt = format!(
        r#"{{"id":{},"webhookId":"w","webhookUrl":"u","messages":[{}]}}"#,
        serde_json::to_string(delivery.id.as_str()).expect("id to JSON"),
        raws.join(",")
    );
    let again = parse_delivery(rebuilt.as_bytes()).expect("the rebuilt delivery must parse");
    assert_eq!(again.id, delivery.id);
    let raw_of = |events: &[model::webhook::IncomingEvent]| {
        events.iter().map(|e| e.raw.clone()).collect::<Vec<_>>()
    };
    assert_eq!(raw_of(&again.events), raw_of(&delivery.events));
    let reasons = |invalid: &[model::webhook::InvalidEvent]| {
        invalid
            .iter()
            .map(|e| (e.raw.clone(), e.reason.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(reasons(&again.invalid), reasons(&delivery.invalid));
});

/// Serialized and read back as JSON text (what the store does with state), the value is equal.
fn round_trip<T: Serialize + DeserializeOwned + PartialEq + Debug>(value: &T) {
    let text = serde_json::to_string(value).expect("payload to JSON");
    let back: T = serde_json::from_str(&text).expect("payload JSON reads back");
    assert_eq!(&back, value, "payload JSON round trip: {text}");
}
