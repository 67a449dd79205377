//! Integration tests that drive the daemon as a client would (webhooks, the admin and agent
//! APIs, the embedded or an external emulator), and the in-process tests of the emulator and the
//! Open API client. One test binary: `cargo test --test it`.
//!
//! The daemon runs in this process (`common::TestApp`: `Application::build` and `run` on a
//! thread and runtime of its own, on ephemeral loopback ports); what these tests check is not a
//! process (those are in `tests/process`). The few that read the daemon's log, and `retention`'s
//! long mode (it bounds the daemon's resident memory), ask for a process of its own
//! (`Spawn::own_process`).

#[path = "../common/mod.rs"]
mod common;

/// The daemon runs in this process (`common::TestApp`), unless a test asks for its own.
pub const IN_PROCESS: bool = true;

mod actions_execute;
mod admin_pages;
mod bad_input;
mod body_budget_routes;
mod chatwoot;
mod chatwoot_failures;
mod chatwoot_prism;
mod cluster;
mod console;
mod deploy_files;
mod emulator_http;
mod emulator_standalone;
mod faults_upstream;
mod fixtures_and_duplicates;
mod flow_titles;
mod full_loop;
mod helpdesk_api;
mod helpdesk_api_errors;
mod helpdesk_contract;
mod helpdesk_e2e;
mod helpdesk_events;
mod helpdesk_openapi;
mod helpdesk_queue_pages;
mod hostile_input;
mod loop_protection;
mod out_of_order;
mod outbox_backpressure;
mod outbox_outages;
mod outbox_pages;
mod outbox_wake;
mod postgres;
mod postgres_tls;
mod quarantine_pages;
mod reconcile;
mod reconcile_outage;
mod retention;
mod shipped_rules;
mod store_copy;
mod stuck_handoffs;
mod timers;
mod trusted_proxies;
mod upstream_contract;
mod upstream_faults;
