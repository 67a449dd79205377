//! The help desks: each a connector behind one small port ([`port`]).
//!
//! - Outbound, what the bridge tells a desk: the desk events the rules decide
//!   (`notify_helpdesk`), carried out through the outbox (`outbox::helpdesk`), which hands each
//!   to every configured [`port::DeskTarget`], each its own destination and circuit.
//! - Inbound, what a desk tells the bridge: agent commands, through the one command path
//!   ([`commands`]): built, stored as `agent.*` events through the writer, folded in order with
//!   the conversation's own events.
//!
//! Connectors: `generic` (the signed Standard Webhooks events of `[[helpdesk.endpoints]]`:
//! [`events`], [`sender`], [`signing`]; and the agent API, [`agent_api`]); `chatwoot` (its
//! account API out, its signed webhook in: [`chatwoot`]). docs/connectors.md says how another
//! is added.

pub mod agent_api;
pub mod auth;
pub mod chatwoot;
pub mod commands;
pub mod contract;
pub mod events;
pub mod idempotency;
pub mod port;
pub mod sender;
pub mod signing;

pub use events::{NoQueue, QueueSource};
pub use sender::{DeskError, Desks};
