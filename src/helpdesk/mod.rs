//! The help-desk side of the bridge.
//!
//! Outbound (`events`, `sender`, `signing`): events about conversations (handoff requested,
//! connected, ended, messages...) signed the Standard Webhooks way and delivered through the
//! outbox, so a help desk learns of them reliably, in order, with the context it needs.
//!
//! Inbound (`api`, `auth`, `commands`, `contract`, `idempotency`): the agent API (`/helpdesk/v1`), whose
//! mutating calls become stored `agent.*` events folded in order with the conversation's webhook
//! events; `contract` holds the input rules the handlers check and the OpenAPI document states.

pub mod api;
pub mod auth;
pub mod commands;
pub mod contract;
pub mod events;
pub mod idempotency;
pub mod sender;
pub mod signing;

pub use events::{NoQueue, QueueSource};
pub use sender::{DeskError, Desks};
