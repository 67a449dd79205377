//! The bridge's vocabulary, with no I/O: ids and time, the service's webhook format and its
//! validation, the Open API contract (shared with the emulator), actions as data and the outbox's
//! records, the help-desk event kinds, a store's opaque [`cursor::Cursor`], and
//! [`secret::Secret`].
//!
//! Every other crate of the workspace speaks these types; this one depends on none of them.

pub mod action;
pub mod clock;
pub mod contract;
pub mod cursor;
pub mod helpdesk;
pub mod ids;
pub mod secret;
pub mod webhook;
