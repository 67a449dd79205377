//! handoff-bridge: a sidecar between a chatbot-builder service and a help desk.
//!
//! Data flows one way: [`intake`] -> [`store`] -> [`dispatch`] -> the engine (`engine`); [`ops`] and the CLI
//! sit at the edges. Start reading at `ARCHITECTURE.md`.

pub mod app;
mod backfill;
pub mod background;
pub mod backup;
mod body_budget;
mod client_addr;
pub mod config;
pub mod datadir;
mod dispatch;
mod helpdesk;
pub mod intake;
mod ops;
pub mod outbox;
mod prune;
pub mod queries;
mod reconcile;
#[cfg(test)]
mod store_tests;
pub mod telemetry;
#[cfg(test)]
mod test_support;
mod timers;
mod tls;
