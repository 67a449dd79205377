//! The help-desk side of the bridge.

pub mod api;
pub mod auth;
pub mod commands;
pub mod idempotency;
