//! The help-desk side of the bridge. Outbound: events about conversations (handoff requested,
//! connected, ended, messages...) signed the Standard Webhooks way and delivered through the
//! outbox, so a help desk learns of them reliably, in order, with the context it needs.

pub mod events;
pub mod sender;
pub mod signing;

pub use events::{EventKind, NoQueue, QueueInfo, QueueSource};
pub use sender::{DeliveryError, Helpdesk};
