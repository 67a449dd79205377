//! handoff-bridge: a sidecar between a chatbot-builder service and a help desk.
//!
//! The daemon: the composition root ([`app`]), its configuration and HTTP surfaces, the
//! dispatcher, the outbox, timers, reconciliation, backfill and pruning, on the workspace's
//! crates (`model`, `engine`, `storage`, `upstream`, `emulator`). Data flows one way: [`intake`]
//! -> `storage` -> `dispatch` -> `engine` -> [`outbox`] -> `upstream`; the ops surface, the agent
//! API and the CLI (the binary's) sit at the edges. Start reading at `ARCHITECTURE.md`.

pub mod app;
mod backfill;
pub mod background;
pub mod backup;
mod body_budget;
mod client_addr;
mod cluster;
pub mod config;
mod console;
pub mod datadir;
mod dispatch;
mod helpdesk;
pub mod intake;
mod ops;
pub mod outbox;
mod prune;
pub mod queries;
mod reconcile;
pub mod store_copy;
#[cfg(test)]
mod store_tests;
pub mod telemetry;
#[cfg(test)]
mod test_support;
mod timers;
mod tls;
