//! handoff-bridge: a sidecar between a chatbot-builder service and a help desk.
//!
//! Data flows one way: [`intake`] -> [`store`] -> [`dispatch`] -> the engine (`engine`); [`ops`] and the CLI
//! sit at the edges. Start reading at `ARCHITECTURE.md`.

pub mod app;
pub mod backfill;
pub mod background;
pub mod backup;
pub mod body_budget;
pub mod cli;
pub mod client_addr;
pub mod config;
pub mod datadir;
pub mod dispatch;
pub mod helpdesk;
pub mod intake;
pub mod ops;
pub mod outbox;
pub mod prune;
pub mod queries;
pub mod reconcile;
#[cfg(test)]
mod store_tests;
pub mod telemetry;
#[cfg(test)]
mod test_support;
pub mod timers;
pub mod tls;
