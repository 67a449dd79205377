//! Helpers the daemon's unit tests share.

use model::action::{Action, OutboxEntry};
use model::ids::{ConversationId, EventId};

/// A `set_manual` entry of `queue` at `seq` (decided at `seq` ms).
pub(crate) fn outbox_entry(seq: u64, queue: &str) -> OutboxEntry {
    OutboxEntry {
        seq,
        id: format!("e{seq}/r/0"),
        queue: queue.into(),
        event_id: EventId::new(format!("e{seq}")),
        rule: "r".into(),
        action: Action::SetManual {
            conversation_id: ConversationId::new(queue),
            enabled: true,
        },
        received_at: 0,
        decided_at: seq as i64,
        rules_version: String::new(),
        idempotency_key: None,
    }
}
