//! Integration tests that need the daemon (or the CLI) as a real process of its own: killed with
//! SIGKILL and restarted on the same data directory, stopped or reloaded by a signal, run under
//! strace, setpriv, prlimit or another umask, measured from /proc (its threads, memory, sockets),
//! or run as a command whose exit status and output are the point. One test binary:
//! `cargo test --test process`.

#[path = "../common/mod.rs"]
mod common;

/// The daemon runs as a process of its own (`common::TestApp`).
pub const IN_PROCESS: bool = false;

mod api_cli;
mod backfill;
mod backup_restore;
mod busy_host;
mod cli_and_secrets;
mod cluster_failover;
mod config_files;
mod crash_recovery;
mod durable_syscalls;
mod early_intake;
mod faults_clients;
mod faults_disk;
mod faults_duplicates;
mod graceful_shutdown;
mod helpdesk_events_crash;
mod hostile_bounds;
mod intake_smoke;
mod listeners;
mod outbox_backlog;
mod outbox_integration;
mod replay_cli;
mod rules_cli;
mod rules_reload;
mod secrets_at_rest;
mod tls;
mod upstream_mode;
