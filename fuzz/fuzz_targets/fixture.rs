//! The fixed input the rule targets decide on: the service's sample deliveries (the same files the
//! unit tests use), each event folded into a fresh conversation state as the fold would.

use model::ids::ConversationId;
use engine::state::ConversationState;
use model::webhook::model::Event;
use model::webhook::parse_delivery;

/// Sample deliveries from `../shared/fixtures/webhooks`, built in so a run needs no files.
const DELIVERIES: [&str; 4] = [
    include_str!("../../../shared/fixtures/webhooks/message-received-text.json"),
    include_str!("../../../shared/fixtures/webhooks/agent-call-requested.json"),
    include_str!("../../../shared/fixtures/webhooks/message-sent-bot-cards.json"),
    include_str!(
        "../../../shared/fixtures/webhooks/end-user-updated-and-conversation-created.json"
    ),
];

/// Every event of the sample deliveries with its conversation's state after it.
pub fn events() -> Vec<(Event, ConversationState)> {
    let mut out = Vec::new();
    for body in DELIVERIES {
        let delivery = parse_delivery(body.as_bytes()).expect("fixture delivery parses");
        for incoming in delivery.events {
            let event = incoming.event;
            let id = event
                .payload
                .conversation_id()
                .cloned()
                .unwrap_or_else(|| ConversationId::new("none"));
            let mut state = ConversationState::new(id);
            state.apply(&event);
            out.push((event, state));
        }
    }
    out
}
