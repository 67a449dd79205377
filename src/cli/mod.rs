//! Command line: `serve`, `check`, `state`, `quarantine`, `backup`, `restore`, ...
//!
//! Store-reading commands talk to the running daemon's admin API when it runs (sled allows one
//! process), and open the store directly when it does not. Both paths print the same JSON.

/// `println!` for a command's output: when stdout is closed early (`| head`), the command ends
/// quietly with success, as a Unix tool killed by SIGPIPE would, instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout(), $($arg)*).is_err() {
            std::process::exit(0);
        }
    }};
}

/// `print!` with [`out!`]'s handling of a closed stdout.
macro_rules! out_raw {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if write!(std::io::stdout(), $($arg)*).is_err() {
            std::process::exit(0);
        }
    }};
}

/// `println!` for a long-running server's notices: a closed stdout must not stop it.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

mod admin;
mod api;
mod backup;
mod emulate;
mod pages;
mod query;
mod rules;
mod serve;
mod store;

pub use serve::shutdown_signal;

use clap::{Args, Parser, Subcommand};
use handoff_bridge::config::{Config, ConfigError, Overrides};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "handoff-bridge",
    version,
    about = "Bridge between a chatbot-builder service and a help desk"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: CliCommand,
}

#[derive(Args, Debug, Clone)]
pub struct ConfigArgs {
    /// TOML config file (merged over the embedded defaults).
    #[arg(long, env = "HANDOFF_BRIDGE_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// Data directory (store, generated tokens).
    #[arg(long, global = true)]
    pub data_dir: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum CliCommand {
    /// Run the daemon.
    Serve {
        #[command(flatten)]
        config: ConfigArgs,
        /// Address to listen on (port 0 picks a free one).
        #[arg(long)]
        listen: Option<String>,
        /// Address of the admin API and /metrics (admin.listen; "" serves them on --listen).
        #[arg(long)]
        admin_listen: Option<String>,
        /// The Open API base address, or `embedded` for the built-in emulator.
        #[arg(long)]
        upstream: Option<String>,
    },
    /// Validate the configuration and print the effective config, secrets masked.
    Check {
        #[command(flatten)]
        config: ConfigArgs,
        #[arg(long)]
        listen: Option<String>,
        #[arg(long)]
        admin_listen: Option<String>,
    },
    /// Read per-conversation and end-user state.
    State {
        #[command(flatten)]
        config: ConfigArgs,
        #[command(subcommand)]
        action: StateCommand,
    },
    /// Call one Open API endpoint with the configured credentials and print the JSON answer.
    Api {
        #[command(flatten)]
        config: ConfigArgs,
        #[command(flatten)]
        call: ApiArgs,
    },
    /// Run the emulator of the service's Open API (and, with --webhook-url, its webhook sender).
    Emulator {
        /// Address to listen on (port 0 picks a free one).
        #[arg(long, default_value = "127.0.0.1:9090")]
        listen: String,
        /// Seed file (JSON); the embedded default seed when absent.
        #[arg(long)]
        seed: Option<PathBuf>,
        /// API key callers must present; generated (and printed) when absent.
        #[arg(long, env = "HANDOFF_BRIDGE_EMULATOR_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
        /// Deliver webhook events (user/agent actions, bot messages) to this URL.
        #[arg(long)]
        webhook_url: Option<String>,
    },
    /// Inspect and re-process quarantined deliveries.
    Quarantine {
        #[command(flatten)]
        config: ConfigArgs,
        #[command(subcommand)]
        action: QuarantineCommand,
    },
    /// Decided actions waiting to be carried out.
    Outbox {
        #[command(flatten)]
        config: ConfigArgs,
        #[command(subcommand)]
        action: OutboxCommand,
    },
    /// Compare the bridge's conversations with the service now (the running daemon's
    /// reconciliation pass) and print the drifts found; each becomes a `reconcile.drift` event.
    Reconcile {
        #[command(flatten)]
        config: ConfigArgs,
        /// Find and print the drifts without handing any to the daemon's writer.
        #[arg(long)]
        dry_run: bool,
    },
    /// Actions that failed for good: list, show, retry, drop.
    Dlq {
        #[command(flatten)]
        config: ConfigArgs,
        #[command(subcommand)]
        action: DlqCommand,
    },
    /// A conversation's timeline: its events in order, the rules re-evaluated for each (which
    /// matched, and why the others did not), and every action recorded with its outcome. Answers
    /// "why is the bot silent?". Through the running daemon (its rules) or on the stopped store
    /// (the configured rules).
    Audit {
        #[command(flatten)]
        config: ConfigArgs,
        conversation_id: String,
    },
    /// Tools for rule authors: validate a rule directory, or see what it decides for one event.
    Rules {
        #[command(flatten)]
        config: ConfigArgs,
        #[command(subcommand)]
        action: RulesCommand,
    },
    /// Re-run the events received in a time window through the current rules and queue the
    /// actions (or only show them with --dry-run). An action decided before is never queued
    /// again unless --force is given.
    Replay {
        #[command(flatten)]
        config: ConfigArgs,
        /// Start of the window (inclusive): Unix ms or RFC 3339, e.g. 2026-11-22T09:00:00Z.
        #[arg(long)]
        from: String,
        /// End of the window (exclusive).
        #[arg(long)]
        to: String,
        /// Show what the rules decide; queue nothing.
        #[arg(long)]
        dry_run: bool,
        /// Queue actions that were decided before too, under new ids (the upstream acts again).
        #[arg(long)]
        force: bool,
    },
    /// Copy the stopped daemon's data directory into a new backup directory: the sled trees
    /// (sled's export), the event log segments, the generated secrets and a manifest with
    /// checksums. Refused while the daemon runs.
    Backup {
        #[command(flatten)]
        config: ConfigArgs,
        /// Backup directory to create (must be absent or empty).
        #[arg(long)]
        out: PathBuf,
    },
    /// The store as a whole: `store copy` moves a stopped sled store into PostgreSQL.
    Store {
        #[command(subcommand)]
        action: StoreCommand,
    },
    /// Restore a backup into a data directory (checked against its manifest first). Refused
    /// while a daemon runs there, and into a non-empty directory unless --force.
    Restore {
        #[command(flatten)]
        config: ConfigArgs,
        /// Backup directory written by `backup`.
        #[arg(long)]
        from: PathBuf,
        /// Replace the store and generated secrets of a non-empty data directory.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum StoreCommand {
    /// Copy a stopped daemon's sled store into an empty PostgreSQL database and check it by
    /// counts.
    ///
    /// Every kind of record a restart needs (events, states, folded marks, outbox, dead letters,
    /// done records and the action ledger, timers, the waiting queue and its figures, quarantine,
    /// the console's audit list, the agent API's idempotency answers, the desks' mappings, the
    /// backfill cursor) goes into an empty PostgreSQL database, then is checked by counts: a table of
    /// each kind's records on sled and rows in PostgreSQL, exit 1 when any differ. Refused,
    /// with nothing written, while a daemon holds the store, into a database that is not empty
    /// or whose schema is newer than this binary, and for a URL that is not postgres://. The
    /// numbers continue: events, outbox entries, quarantine records and console actions keep
    /// theirs, and PostgreSQL numbers new ones above them. Written in batches of 1,000 records,
    /// each in one transaction; a copy cut short is not resumed: run it again with
    /// --discard-incomplete. Then start the daemon with store.url set to the same database
    /// (docs/operations.md, "Moving to PostgreSQL").
    Copy {
        /// The stopped daemon's data directory (its store is DATA_DIR/store).
        #[arg(long, value_name = "DATA_DIR")]
        from: PathBuf,
        /// The target database: postgres://user:password@host:port/database?sslmode=...
        /// (better from the environment, which other users cannot read as they can a command
        /// line). Never shown: the output masks its password.
        #[arg(
            long,
            value_name = "URL",
            env = "HANDOFF_BRIDGE_STORE_URL",
            hide_env_values = true,
            value_parser = secret
        )]
        to: model::secret::Secret,
        /// A private CA (PEM) to trust for TLS besides the platform's roots (as store.ca_file).
        #[arg(long, value_name = "PEM")]
        ca_file: Option<PathBuf>,
        /// The target holds what an interrupted copy left: empty it first (its tables and
        /// sequences are dropped), then copy. Refused for a target no copy left.
        #[arg(long)]
        discard_incomplete: bool,
    },
}

/// A command-line value kept as a secret (never in `Debug`).
fn secret(text: &str) -> Result<model::secret::Secret, std::convert::Infallible> {
    Ok(model::secret::Secret::new(text))
}

#[derive(Subcommand, Debug)]
pub enum RulesCommand {
    /// Validate the rules (every error at once, exit 2), list them in evaluation order, and warn
    /// about rules that can never fire or may loop.
    Check {
        /// Rule directory; the configured rules when absent (the shipped set if `rules.dir` is
        /// empty).
        dir: Option<PathBuf>,
    },
    /// Show which rules match one event, why the others do not (the first failing condition and
    /// the value it saw), and the rendered actions. Calls nothing, stores nothing.
    Test {
        /// Rule directory; the configured rules when absent (the shipped set if `rules.dir` is
        /// empty).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// One event as the service sends it (a JSON object), or a whole delivery (each of its
        /// events in turn).
        #[arg(long)]
        event: PathBuf,
        /// The conversation's state before the event (JSON, as `state show` prints it); a new
        /// conversation when absent. The event is folded into it first, as the daemon does.
        #[arg(long)]
        state: Option<PathBuf>,
        /// The conversation's end user (JSON, as `GET /admin/v1/endusers` prints its
        /// `endUser`), for `end_user.*` fields; unknown when absent.
        #[arg(long)]
        end_user: Option<PathBuf>,
        /// The clock: Unix ms or RFC 3339; now when absent.
        #[arg(long)]
        at: Option<String>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum OutboxCommand {
    /// Pending entries, in decision order. Without flags: every entry as one JSON object (read
    /// page by page). With `--limit` or `--after`: one page, as the admin API answers (`next`:
    /// the next page's cursor, a seq). With `--all`: every entry, one JSON line each.
    List {
        #[command(flatten)]
        page: PageArgs,
    },
    /// One pending entry.
    Show { id: u64 },
    /// Stop carrying out actions (the running daemon; they stay queued, intake goes on).
    Pause,
    /// Carry out actions again.
    Resume,
    /// Finished entries (done, or dropped) still in the audit window, newest (highest seq)
    /// first: one page (`next`: the seq to continue after, towards older ones), or with `--all`
    /// every entry, one JSON line each.
    Done {
        #[command(flatten)]
        page: PageArgs,
    },
}

#[derive(Subcommand, Debug)]
pub enum DlqCommand {
    /// Dead letters, in decision order. Without flags: every letter as one JSON object (read
    /// page by page). With `--limit` or `--after`: one page, as the admin API answers (`next`:
    /// the next page's cursor, a seq). With `--all`: every letter, one JSON line each.
    List {
        #[command(flatten)]
        page: PageArgs,
    },
    /// One dead letter, with its error.
    Show { id: u64 },
    /// Put a dead letter (or all) back in the outbox. It keeps its idempotency key unless the
    /// upstream answered it with an error (the upstream keeps that answer under the key).
    Retry {
        id: Option<u64>,
        #[arg(long, conflicts_with = "id")]
        all: bool,
    },
    /// Remove a dead letter for good; the reason is kept in the action ledger.
    Drop {
        id: u64,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Args, Debug, Clone)]
pub struct ApiArgs {
    /// Endpoint name (`--list` shows them all), e.g. `get-conversation`.
    #[arg(required_unless_present = "list")]
    pub endpoint: Option<String>,
    /// Path parameters, in the order of the path (e.g. senderKey userKey).
    pub params: Vec<String>,
    /// Query parameter `key=value` (repeatable).
    #[arg(long = "query", value_name = "KEY=VALUE")]
    pub query: Vec<String>,
    /// Request body: JSON text, or `@FILE`.
    #[arg(long)]
    pub body: Option<String>,
    /// Idempotency key of a mutating call (generated when absent).
    #[arg(long)]
    pub idempotency_key: Option<String>,
    /// The Open API base address, or `embedded` (overrides the config).
    #[arg(long)]
    pub upstream: Option<String>,
    /// List the endpoints with their method and path.
    #[arg(long)]
    pub list: bool,
}

#[derive(Subcommand, Debug)]
pub enum StateCommand {
    /// One conversation's state.
    Show { conversation_id: String },
    /// An end user by messenger identity, with their newest conversation.
    Find {
        #[arg(long)]
        platform: String,
        #[arg(long)]
        user_key: String,
    },
    /// Conversation summaries in id order (id, bot, end user, phase, last event): one page
    /// (`next`: the opaque cursor to the next), or with `--all` every one, one JSON line each.
    Conversations {
        #[command(flatten)]
        page: PageArgs,
    },
    /// End-user summaries in id order: one page (`next`: the opaque cursor to the next), or
    /// with `--all` every one, one JSON line each.
    Endusers {
        #[command(flatten)]
        page: PageArgs,
    },
}

/// The paging flags every list command takes.
#[derive(Args, Debug, Clone, Default)]
pub struct PageArgs {
    /// Items in a page (default 100, at most 1000).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Start after this cursor: a page's `next` (a seq, a record id, or an opaque string for the
    /// lists in id order).
    #[arg(long)]
    pub after: Option<String>,
    /// Every item from the start (or from `--after`), following `next` to the end, one JSON
    /// object a line as each page comes (pages of `--limit`, else of 1000).
    #[arg(long)]
    pub all: bool,
}

impl PageArgs {
    /// Whether a page was asked for (rather than the command's default).
    fn paging(&self) -> bool {
        self.limit.is_some() || self.after.is_some()
    }
}

#[derive(Subcommand, Debug)]
pub enum QuarantineCommand {
    /// Quarantined deliveries and events, without their bodies (`show` has them). Without
    /// flags: every record, as one JSON array (read page by page). With `--limit` or `--after`:
    /// one page, as the admin API answers (`records`, `next`: the record id to continue after).
    /// With `--all`: every record, one JSON line each.
    List {
        #[command(flatten)]
        page: PageArgs,
    },
    /// One record, with its body.
    Show { id: u64 },
    /// Run a record (or all) through current validation; valid ones are accepted.
    Reprocess {
        id: Option<u64>,
        #[arg(long, conflicts_with = "id")]
        all: bool,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Store(#[from] storage::StoreError),
    #[error(transparent)]
    App(#[from] handoff_bridge::app::AppError),
    #[error("{0}")]
    NotFound(String),
    #[error("admin API: {0}")]
    Admin(String),
    #[error("{0}")]
    Usage(String),
    #[error("upstream: {0}")]
    Upstream(upstream::UpstreamError),
    #[error(transparent)]
    Rules(#[from] engine::rules::LoadError),
    #[error(transparent)]
    Backup(#[from] handoff_bridge::backup::BackupError),
    #[error(transparent)]
    Copy(#[from] handoff_bridge::store_copy::CopyError),
}

impl CliError {
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Config(_) | CliError::Usage(_) | CliError::Rules(_) => ExitCode::from(2),
            // `serve` with bad rule files: invalid configuration, like `check` says.
            CliError::App(handoff_bridge::app::AppError::Rules(_)) => ExitCode::from(2),
            _ => ExitCode::from(1),
        }
    }
}

/// The config with `--listen` (and `--data-dir` from `args`) over it.
fn load(args: &ConfigArgs, listen: Option<String>) -> Result<Config, ConfigError> {
    load_with(
        args,
        Overrides {
            listen,
            ..Overrides::default()
        },
    )
}

/// The config with these flags over it (`--data-dir` from `args`).
fn load_with(args: &ConfigArgs, overrides: Overrides) -> Result<Config, ConfigError> {
    let overrides = Overrides {
        data_dir: args.data_dir.clone(),
        ..overrides
    };
    Config::load(args.config.as_deref(), &overrides)
}

/// The configured store, opened for a command run with no daemon (which would hold it).
fn open_store(config: &Config) -> Result<storage::Store, handoff_bridge::app::AppError> {
    handoff_bridge::app::open_offline(config)
}

/// Run a parsed command. `serve` blocks until shutdown.
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        CliCommand::Serve {
            config,
            listen,
            admin_listen,
            upstream,
        } => serve::serve_command(&config, listen, admin_listen, upstream),
        CliCommand::Api { config, call } => api::api_command(&config, call),
        CliCommand::Emulator {
            listen,
            seed,
            api_key,
            webhook_url,
        } => emulate::emulator(listen, seed, api_key, webhook_url),
        CliCommand::Check {
            config,
            listen,
            admin_listen,
        } => rules::check(&config, listen, admin_listen),
        CliCommand::Rules { config, action } => rules::rules_command(&config, action),
        CliCommand::Backup { config, out } => backup::backup(&config, &out),
        CliCommand::Restore {
            config,
            from,
            force,
        } => backup::restore(&config, &from, force),
        CliCommand::Store { action } => store::store_command(action),
        CliCommand::Audit {
            config,
            conversation_id,
        } => query::audit(&load(&config, None)?, &conversation_id),
        CliCommand::State { config, action } => query::state(&load(&config, None)?, action),
        CliCommand::Outbox { config, action } => query::outbox(&load(&config, None)?, action),
        CliCommand::Reconcile { config, dry_run } => {
            query::reconcile(&load(&config, None)?, dry_run)
        }
        CliCommand::Dlq { config, action } => query::dlq(&load(&config, None)?, action),
        CliCommand::Replay {
            config,
            from,
            to,
            dry_run,
            force,
        } => query::replay(&load(&config, None)?, &from, &to, dry_run, force),
        CliCommand::Quarantine { config, action } => {
            query::quarantine(&load(&config, None)?, action)
        }
    }
}
