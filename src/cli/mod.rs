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

use crate::config::{Config, ConfigError, Overrides};
use crate::datadir::{DataDir, ADMIN_TOKEN_FILE};
use crate::queries::{List, PAGE_MAX};
use clap::{Args, Parser, Subcommand};
use serde_json::Value;
use std::path::PathBuf;
use std::process::ExitCode;
use storage::Store;

#[derive(Parser, Debug)]
#[command(
    name = "handoff-bridge",
    version,
    about = "Bridge between a chatbot-builder service and a help desk"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
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
pub enum Command {
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
    App(#[from] crate::app::AppError),
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
    Backup(#[from] crate::backup::BackupError),
}

impl CliError {
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Config(_) | CliError::Usage(_) | CliError::Rules(_) => ExitCode::from(2),
            // `serve` with bad rule files: invalid configuration, like `check` says.
            CliError::App(crate::app::AppError::Rules(_)) => ExitCode::from(2),
            _ => ExitCode::from(1),
        }
    }
}

fn load(args: &ConfigArgs, listen: Option<String>) -> Result<Config, ConfigError> {
    load_with(
        args,
        Overrides {
            listen,
            ..Overrides::default()
        },
    )
}

/// `serve`: build the application on the configured listeners, say where it accepts webhooks
/// while the store opens, run it until SIGTERM or SIGINT, and print the banner once it serves.
fn serve(config: Config) -> Result<(), CliError> {
    use crate::app::{Application, Listeners, Stopped};
    actix_web::rt::System::new().block_on(async move {
        // SIGTERM and SIGINT from here on stop the daemon in order, an early listener too.
        let signal = shutdown_signal();
        let listeners = Listeners::bind(&config)?;
        let app = Application::build(config, listeners).await?;
        if app.takes_early_deliveries() {
            // Machine-readable, like the `listening:` line that follows once started.
            let addrs = app.addrs();
            say!("accepting webhooks: {}://{}", addrs.scheme, addrs.public);
        }
        match app.run(signal, banner).await? {
            Stopped::InOrder => Ok(()),
            // sled's open still runs on its thread and cannot be cut short: end here, as a
            // crash would (what the early listener answered is in the log).
            Stopped::WhileOpening => std::process::exit(0),
        }
    })
}

/// The start lines on stdout, the public listener's last: tests and scripts wait for it.
fn banner(started: &crate::app::Started) {
    use std::io::IsTerminal as _;
    let addrs = &started.addrs;
    let (scheme, bound) = (addrs.scheme, addrs.public);
    let token_file = started.token_file.display();
    let token_shown = match &started.generated_token {
        // First start with a generated token, by hand: show it once so it can be registered.
        // Under systemd or Kubernetes stdout is a log, and the token stays in its file.
        Some(token) if std::io::stdout().is_terminal() => token.expose().to_owned(),
        Some(_) => format!("<generated token, saved in {token_file}>"),
        None => format!("<token in {token_file} or config>"),
    };
    say!(
        "webhook url: {scheme}://{bound}{}/{token_shown}",
        started.webhook_path
    );
    if let Some(emulator) = addrs.emulator {
        // Loud: a bridge that talks to the fake reaches no real user.
        say!(
            "WARNING: the upstream is the embedded emulator, not the real service: no message \
             reaches a real user (set upstream.url to the service's Open API for production)"
        );
        say!("upstream: embedded emulator at http://{emulator}");
    }
    if let Some(url) = &started.remote_upstream {
        say!("upstream: remote {url}");
    }
    if let Some(at) = addrs.admin {
        say!("admin listening: http://{at}");
    }
    say!("listening: {scheme}://{bound}");
}

/// Wait for SIGTERM or SIGINT; returns which. The handlers are installed when this is called
/// (not when first awaited), so a signal right after the start line is not the default action's.
pub fn shutdown_signal() -> impl std::future::Future<Output = &'static str> {
    use tokio::signal::unix::{signal, SignalKind};
    let handlers = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    );
    async move {
        let (Ok(mut term), Ok(mut int)) = handlers else {
            tracing::error!("cannot install signal handlers; stop with SIGKILL");
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    }
}

/// The config with these flags over it (`--data-dir` from `args`).
fn load_with(args: &ConfigArgs, overrides: Overrides) -> Result<Config, ConfigError> {
    let overrides = Overrides {
        data_dir: args.data_dir.clone(),
        ..overrides
    };
    Config::load(args.config.as_deref(), &overrides)
}

/// Run a parsed command. `serve` blocks until shutdown.
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Serve {
            config,
            listen,
            admin_listen,
            upstream,
        } => {
            let overrides = Overrides {
                listen,
                admin_listen,
                upstream,
                data_dir: None,
                check_files: true,
            };
            let config = load_with(&config, overrides)?;
            crate::telemetry::init(&config.log);
            serve(config)
        }
        Command::Api { config, call } => {
            let overrides = Overrides {
                upstream: call.upstream.clone(),
                ..Overrides::default()
            };
            let config = load_with(&config, overrides)?;
            api(&config, call)
        }
        Command::Emulator {
            listen,
            seed,
            api_key,
            webhook_url,
        } => emulator(listen, seed, api_key, webhook_url),
        Command::Check {
            config,
            listen,
            admin_listen,
        } => {
            let overrides = Overrides {
                listen,
                admin_listen,
                check_files: true,
                ..Overrides::default()
            };
            let config = load_with(&config, overrides)?;
            let rules = crate::app::rule_set(&config)?;
            for note in &config.deprecated {
                out!("# warning: {note}");
            }
            out!("# configuration is valid; effective values (secrets masked):");
            out_raw!("{}", config.to_masked_toml());
            if let Some(set) = rules {
                out!(
                    "# rules valid: {} rule(s), version {}",
                    set.rules().len(),
                    set.version()
                );
                for rule in set.rules() {
                    out!("#   {}", rule_line(rule));
                }
            }
            Ok(())
        }
        Command::Rules { config, action } => rules_command(&config, action),
        Command::Backup { config, out } => {
            let config = load(&config, None)?;
            let data = DataDir::new(&config.store.data_dir);
            let m = crate::backup::backup(&data, &out, config.store.cache_capacity_bytes)?;
            out!(
                "backed up {} to {}: {} sled trees, {} records, {} files ({} bytes)",
                data.root().display(),
                out.display(),
                m.sled.trees,
                m.sled.records,
                m.files.len(),
                m.files.iter().map(|f| f.bytes).sum::<u64>()
            );
            Ok(())
        }
        Command::Restore {
            config,
            from,
            force,
        } => {
            let config = load(&config, None)?;
            let data = DataDir::new(&config.store.data_dir);
            let m = crate::backup::restore(&from, &data, force, config.store.cache_capacity_bytes)?;
            out!(
                "restored {} (taken {}, bridge {}) into {}: {} sled trees, {} records, {} files",
                from.display(),
                m.created_at,
                m.bridge_version,
                data.root().display(),
                m.sled.trees,
                m.sled.records,
                m.files.len()
            );
            Ok(())
        }
        Command::Audit {
            config,
            conversation_id,
        } => {
            let config = load(&config, None)?;
            let path = format!("/admin/v1/conversations/{}/audit", enc(&conversation_id));
            let rules = crate::app::load_rules(&config)?;
            let value = read(&config, "GET", &path, |store| {
                crate::queries::audit(store, rules.as_ref(), &conversation_id.as_str().into())
            })?;
            print_found(value, || format!("no conversation {conversation_id}"))
        }
        Command::State { config, action } => {
            let config = load(&config, None)?;
            match action {
                StateCommand::Show { conversation_id } => {
                    let path = format!("/admin/v1/conversations/{}", enc(&conversation_id));
                    let value = read(&config, "GET", &path, |store| {
                        let state = store.conversation(&conversation_id.as_str().into())?;
                        Ok(state.map(|s| serde_json::to_value(s).unwrap_or(Value::Null)))
                    })?;
                    print_found(value, || format!("no conversation {conversation_id}"))
                }
                StateCommand::Find { platform, user_key } => {
                    let path = format!(
                        "/admin/v1/endusers?platform={}&userKey={}",
                        enc(&platform),
                        enc(&user_key)
                    );
                    let value = read(&config, "GET", &path, |store| {
                        crate::queries::find_end_user(store, &platform, &user_key)
                    })?;
                    print_found(value, || format!("no end user {user_key} on {platform}"))
                }
                StateCommand::Conversations { page } => {
                    list_command(&config, List::Conversations, page, Unpaged::FirstPage)
                }
                StateCommand::Endusers { page } => {
                    list_command(&config, List::EndUsers, page, Unpaged::FirstPage)
                }
            }
        }
        Command::Outbox { config, action } => {
            let config = load(&config, None)?;
            match action {
                OutboxCommand::List { page } => {
                    list_command(&config, List::Outbox, page, Unpaged::Object)
                }
                OutboxCommand::Show { id } => {
                    let path = format!("/admin/v1/outbox/{id}");
                    let value = read(&config, "GET", &path, |store| {
                        let entry = store.outbox_entry(id)?;
                        Ok(entry.map(|e| serde_json::to_value(e).unwrap_or(Value::Null)))
                    })?;
                    print_found(value, || format!("no pending outbox entry {id}"))
                }
                OutboxCommand::Pause | OutboxCommand::Resume => {
                    let verb = if matches!(action, OutboxCommand::Pause) {
                        "pause"
                    } else {
                        "resume"
                    };
                    let path = format!("/admin/v1/outbox/{verb}");
                    match online(&config, "POST", &path)? {
                        Some(value) => print_found(value, String::new),
                        // Offline there is no executor to pause: say so instead of pretending.
                        None => Err(CliError::Usage(format!(
                            "`outbox {verb}` acts on the running daemon, and none is running here"
                        ))),
                    }
                }
                OutboxCommand::Done { page } => {
                    list_command(&config, List::Done, page, Unpaged::FirstPage)
                }
            }
        }
        Command::Reconcile { config, dry_run } => {
            let config = load(&config, None)?;
            let path = format!("/admin/v1/reconcile?dry_run={dry_run}");
            match online(&config, "POST", &path)? {
                Some(value) => print_found(value, String::new),
                // The pass needs the daemon's Open API client and writer.
                None => Err(CliError::Usage(
                    "`reconcile` runs a pass of the running daemon, and none is running here"
                        .into(),
                )),
            }
        }
        Command::Dlq { config, action } => dlq(&load(&config, None)?, action),
        Command::Replay {
            config,
            from,
            to,
            dry_run,
            force,
        } => replay(&load(&config, None)?, &from, &to, dry_run, force),
        Command::Quarantine { config, action } => {
            let config = load(&config, None)?;
            match action {
                QuarantineCommand::List { page } => {
                    list_command(&config, List::Quarantine, page, Unpaged::Array)
                }
                QuarantineCommand::Show { id } => {
                    let value = read(
                        &config,
                        "GET",
                        &format!("/admin/v1/quarantine/{id}"),
                        |store| {
                            Ok(store
                                .quarantined_one(id)?
                                .map(|r| crate::queries::quarantine_view(&r)))
                        },
                    )?;
                    print_found(value, || format!("no quarantine record {id}"))
                }
                QuarantineCommand::Reprocess { id, all } => {
                    let ids: Vec<u64> = match (id, all) {
                        (Some(id), _) => vec![id],
                        (None, true) => {
                            // Ids only, page by page (the pages hold no bodies); the pager, and
                            // the store it may have opened, is gone before re-processing.
                            let mut pages = Pager::new(&config, List::Quarantine);
                            let mut ids = Vec::new();
                            let mut after = None;
                            loop {
                                let page = pages.page(Some(PAGE_MAX), after.as_deref())?;
                                ids.extend(
                                    items(&page, List::Quarantine)
                                        .filter_map(|r| r.get("id").and_then(Value::as_u64)),
                                );
                                match next_cursor(&page) {
                                    Some(next) => after = Some(next),
                                    None => break,
                                }
                            }
                            ids
                        }
                        (None, false) => {
                            return Err(CliError::Usage("give a quarantine id or --all".into()))
                        }
                    };
                    let scrubber = crate::intake::scrub::Scrubber::configured(&config)
                        .map_err(|e| CliError::Usage(format!("webhook tokens: {e}")))?;
                    let mut results = Vec::new();
                    for id in ids {
                        let value = read(
                            &config,
                            "POST",
                            &format!("/admin/v1/quarantine/{id}/reprocess"),
                            |store| {
                                let now = model::clock::system_millis();
                                let checks = model::webhook::Checks::intake(
                                    config.webhook.max_events,
                                    config.webhook.max_clock_skew,
                                    now,
                                );
                                let out = crate::intake::reprocess_offline(
                                    store, id, &checks, now, &scrubber,
                                )?;
                                store.flush()?;
                                Ok(out.map(|o| serde_json::to_value(o).unwrap_or(Value::Null)))
                            },
                        )?;
                        match value {
                            Some(v) => results.push(v),
                            None => {
                                return Err(CliError::NotFound(format!(
                                    "no quarantine record {id}"
                                )))
                            }
                        }
                    }
                    out!(
                        "{}",
                        serde_json::to_string_pretty(&results).unwrap_or_default()
                    );
                    Ok(())
                }
            }
        }
    }
}

/// The seqs of a page of dead letters after `after`.
fn first_letters(store: &Store, after: Option<u64>) -> Result<Vec<u64>, storage::StoreError> {
    Ok(store
        .dead_letters_page(after, crate::queries::PAGE)?
        .iter()
        .map(|l| l.entry.seq)
        .collect())
}

/// Pages of an admin list (`queries::List`): through the running daemon, else from the store
/// (opened once, on the first page that needs it). Both answer the same JSON.
struct Pager<'a> {
    config: &'a Config,
    list: List,
    store: Option<Store>,
}

impl<'a> Pager<'a> {
    fn new(config: &'a Config, list: List) -> Self {
        Pager {
            config,
            list,
            store: None,
        }
    }

    /// The page of `limit` items (the default when `None`) after the cursor `after`; a bad
    /// limit or cursor is refused here, before anything is asked.
    fn page(&mut self, limit: Option<usize>, after: Option<&str>) -> Result<Value, CliError> {
        let limit = limit.map(|l| l.to_string());
        let query = self
            .list
            .query(limit.as_deref(), after)
            .map_err(|e| CliError::Usage(e.to_string()))?;
        if self.store.is_none() {
            let params: Vec<String> = [("limit", limit.as_deref()), ("after", after)]
                .into_iter()
                .filter_map(|(k, v)| v.map(|v| format!("{k}={}", enc(v))))
                .collect();
            let path = format!("{}?{}", self.list.path(), params.join("&"));
            if let Some(found) = online(self.config, "GET", &path)? {
                return Ok(found.unwrap_or(Value::Null));
            }
        }
        let store = match self.store.take() {
            Some(store) => store,
            None => {
                let data = DataDir::new(&self.config.store.data_dir);
                Store::open(&data.store_path(), self.config.store.cache_capacity_bytes)?
            }
        };
        let value = query.read(&store).map(|mut value| {
            // What the daemon's executor adds: a stopped store has no executor running.
            if let (List::Outbox, Some(obj)) = (self.list, value.as_object_mut()) {
                obj.insert("paused".into(), Value::Bool(false));
                obj.insert("depth".into(), store.outbox_len().into());
            }
            value
        });
        self.store = Some(store);
        Ok(value?)
    }
}

/// The items of a page of `list`.
fn items(page: &Value, list: List) -> impl Iterator<Item = &Value> {
    page[list.items()].as_array().into_iter().flatten()
}

/// A page's `next` as the next page's `after` (a number or an opaque string); `None` after the
/// last page.
fn next_cursor(page: &Value) -> Option<String> {
    match page.get("next")? {
        Value::Number(n) => Some(n.to_string()),
        Value::String(s) => Some(s.clone()),
        _ => None,
    }
}

/// What a list command prints without `--limit`, `--after` or `--all`.
#[derive(Clone, Copy)]
enum Unpaged {
    /// The first page (the default limit), as the admin API answers it.
    FirstPage,
    /// Every item, as one JSON object: the first page's own fields, the items, their `count`.
    Object,
    /// Every item, as one JSON array.
    Array,
}

/// A list command: one page (`--limit`, `--after`), every item as JSON lines (`--all`), or what
/// the command shows without flags. Never more than one page in memory.
fn list_command(
    config: &Config,
    list: List,
    args: PageArgs,
    unpaged: Unpaged,
) -> Result<(), CliError> {
    let mut pages = Pager::new(config, list);
    if args.all {
        let limit = Some(args.limit.unwrap_or(PAGE_MAX));
        let mut after = args.after;
        loop {
            let page = pages.page(limit, after.as_deref())?;
            for item in items(&page, list) {
                out!("{item}");
            }
            match next_cursor(&page) {
                Some(next) => after = Some(next),
                None => return Ok(()),
            }
        }
    }
    match (args.paging(), unpaged) {
        (true, _) | (false, Unpaged::FirstPage) => {
            let page = pages.page(args.limit, args.after.as_deref())?;
            print_found(Some(page), String::new)
        }
        (false, Unpaged::Object) => whole_object(pages),
        (false, Unpaged::Array) => whole_array(pages),
    }
}

/// Every item as one JSON array, printed as the pages come.
fn whole_array(mut pages: Pager<'_>) -> Result<(), CliError> {
    let list = pages.list;
    let (mut after, mut first) = (None, true);
    out_raw!("[");
    loop {
        let page = pages.page(Some(PAGE_MAX), after.as_deref())?;
        for item in items(&page, list) {
            let text = serde_json::to_string_pretty(item).unwrap_or_default();
            out_raw!(
                "{}\n  {}",
                if first { "" } else { "," },
                text.replace('\n', "\n  ")
            );
            first = false;
        }
        match next_cursor(&page) {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    out!("{}", if first { "]" } else { "\n]" });
    Ok(())
}

/// Every item as one JSON object (the first page's fields, the items of every page, and their
/// `count`), printed as the pages come.
fn whole_object(mut pages: Pager<'_>) -> Result<(), CliError> {
    let list = pages.list;
    let mut page = pages.page(Some(PAGE_MAX), None)?;
    // The first page's own fields (paused, depth), then the items as they come.
    let mut head = serde_json::Map::new();
    if let Some(obj) = page.as_object() {
        for (k, v) in obj {
            if !matches!(k.as_str(), "count" | "next") && k != list.items() {
                head.insert(k.clone(), v.clone());
            }
        }
    }
    let mut count = 0usize;
    out_raw!("{{");
    for (k, v) in &head {
        out_raw!("\n  {}: {},", Value::String(k.clone()), v);
    }
    out_raw!("\n  \"{}\": [", list.items());
    loop {
        for item in items(&page, list) {
            let text = serde_json::to_string_pretty(item).unwrap_or_default();
            out_raw!(
                "{}\n    {}",
                if count == 0 { "" } else { "," },
                text.replace('\n', "\n    ")
            );
            count += 1;
        }
        match next_cursor(&page) {
            Some(next) => page = pages.page(Some(PAGE_MAX), Some(&next))?,
            None => break,
        }
    }
    out!(
        "{}\n  \"count\": {count}\n}}",
        if count == 0 { "]," } else { "\n  ]," }
    );
    Ok(())
}

fn print_found(value: Option<Value>, missing: impl FnOnce() -> String) -> Result<(), CliError> {
    match value {
        Some(v) => {
            out!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            Ok(())
        }
        None => Err(CliError::NotFound(missing())),
    }
}

/// `handoff-bridge rules check|test`.
fn rules_command(args: &ConfigArgs, action: RulesCommand) -> Result<(), CliError> {
    use engine::rules::{explain, RuleSet};
    // A directory given here, else the configured rules (the shipped set when `rules.dir` is
    // empty), with the configured setting overrides.
    let load_set = |dir: Option<PathBuf>| -> Result<(String, RuleSet), CliError> {
        let config = load(args, None)?;
        let overrides = crate::app::settings_overrides(&config);
        if let Some(dir) = dir {
            let set = RuleSet::load_dir_with(&dir, &overrides)?;
            return Ok((dir.display().to_string(), set));
        }
        if !config.rules.enabled {
            return Err(CliError::Usage(
                "rules are turned off (rules.enabled = false): give a directory".into(),
            ));
        }
        let set = crate::app::rule_set(&config)?.ok_or_else(|| {
            CliError::Usage("rules are turned off (rules.enabled = false)".into())
        })?;
        let label = if config.rules.dir.is_empty() {
            "shipped rules".to_owned()
        } else {
            config.rules.dir.clone()
        };
        Ok((label, set))
    };
    match action {
        RulesCommand::Check { dir } => {
            let (label, set) = load_set(dir)?;
            out!(
                "{}: {} rule(s), version {}",
                label,
                set.rules().len(),
                set.version()
            );
            for rule in set.rules() {
                out!("  {}", rule_line(rule));
            }
            let warnings = explain::lint(&set);
            if warnings.is_empty() {
                out!("no warnings");
            } else {
                out!("{} warning(s):", warnings.len());
                for w in &warnings {
                    out!("  {} rule {}: {}", w.file, w.rule, w.message);
                }
            }
            Ok(())
        }
        RulesCommand::Test {
            dir,
            event,
            state,
            end_user,
            at,
            json,
        } => {
            let (_, set) = load_set(dir)?;
            let read = |path: &PathBuf| {
                std::fs::read(path)
                    .map_err(|e| CliError::Usage(format!("cannot read {}: {e}", path.display())))
            };
            let events = events_of(&read(&event)?)
                .map_err(|e| CliError::Usage(format!("{}: {e}", event.display())))?;
            let before = match &state {
                Some(path) => Some(
                    serde_json::from_slice::<engine::state::ConversationState>(&read(path)?)
                        .map_err(|e| {
                            CliError::Usage(format!(
                                "{}: not a conversation state: {e}",
                                path.display()
                            ))
                        })?,
                ),
                None => None,
            };
            let end_user = match &end_user {
                Some(path) => Some(
                    serde_json::from_slice::<engine::state::EndUserState>(&read(path)?).map_err(
                        |e| {
                            CliError::Usage(format!(
                                "{}: not an end-user state: {e}",
                                path.display()
                            ))
                        },
                    )?,
                ),
                None => None,
            };
            let now = match &at {
                Some(t) => model::clock::parse_time(t).map_err(CliError::Usage)?,
                None => model::clock::system_millis(),
            };
            let mut reports = Vec::new();
            for ev in events {
                let Some(conversation) = ev.payload.conversation_id().cloned() else {
                    let note = format!(
                        "event {} ({}): not a conversation event; rules do not run for it",
                        ev.id, ev.kind
                    );
                    reports.push((note, None));
                    continue;
                };
                // `--state` is the state before the event: `changed` conditions compare with it.
                let prior = before
                    .clone()
                    .unwrap_or_else(|| engine::state::ConversationState::new(conversation.clone()));
                let mut state = prior.clone();
                state.apply(&ev);
                let inputs = engine::decide::Inputs {
                    before: Some(&prior),
                    end_user: end_user.as_ref(),
                    queue: None,
                };
                let head = format!(
                    "event {} ({}), conversation {}, at {now}, rules version {}",
                    ev.id,
                    ev.kind,
                    conversation,
                    set.version()
                );
                reports.push((head, Some(explain::explain(&set, &ev, &state, inputs, now))));
            }
            if json {
                let out: Vec<Value> = reports
                    .iter()
                    .map(|(head, verdicts)| serde_json::json!({"event": head, "rules": verdicts}))
                    .collect();
                out!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
            } else {
                for (head, verdicts) in &reports {
                    out!("{head}");
                    if let Some(verdicts) = verdicts {
                        out_raw!("{}", explain::render_text(verdicts));
                    }
                }
            }
            Ok(())
        }
    }
}

/// One rule as `check` and `rules check` list it: priority, name, file, events, action types.
fn rule_line(rule: &engine::rules::Rule) -> String {
    format!(
        "{:>5}  {}{}  ({})  on {}  -> {}",
        rule.priority,
        rule.name,
        if rule.enabled { "" } else { " (disabled)" },
        rule.file,
        rule.on.join(","),
        rule.action_types().join(", ")
    )
}

/// The events of a file holding one event or a whole delivery.
fn events_of(bytes: &[u8]) -> Result<Vec<model::webhook::model::Event>, String> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    if value.get("messages").is_some() {
        let parsed = model::webhook::parse_delivery(bytes).map_err(|e| e.to_string())?;
        if let Some(bad) = parsed.invalid.first() {
            return Err(format!("invalid event in the delivery: {}", bad.reason));
        }
        return Ok(parsed.events.into_iter().map(|e| e.event).collect());
    }
    let raw =
        serde_json::value::RawValue::from_string(value.to_string()).map_err(|e| e.to_string())?;
    let event = model::webhook::validate_event(&raw).map_err(|e| e.to_string())?;
    Ok(vec![event.event])
}

/// `handoff-bridge replay`: through the running daemon (its rules, its executor), or on the
/// store when it is stopped (with the configured rules; the next start runs what was queued).
fn replay(
    config: &Config,
    from: &str,
    to: &str,
    dry_run: bool,
    force: bool,
) -> Result<(), CliError> {
    let parse = |what: &str, text: &str| {
        model::clock::parse_time(text).map_err(|e| CliError::Usage(format!("--{what}: {e}")))
    };
    let request = storage::replay::ReplayRequest {
        from: parse("from", from)?,
        to: parse("to", to)?,
        dry_run,
        force,
    };
    if request.from >= request.to {
        return Err(CliError::Usage("--from must be before --to".into()));
    }
    let rules = crate::app::load_rules(config)?;
    let path = format!(
        "/admin/v1/replay?from={}&to={}&dry_run={dry_run}&force={force}",
        request.from, request.to
    );
    let value = read(config, "POST", &path, |store| {
        let report = store.replay(&request, rules.as_ref())?;
        if !report.entries.is_empty() {
            store.flush()?;
        }
        Ok(Some(serde_json::to_value(&report).unwrap_or(Value::Null)))
    })?;
    // A running daemon replays with the rules it loaded at start, not the files on disk.
    let used = value.as_ref().and_then(|v| v["rules_version"].as_str());
    if let Some(used) = used.filter(|v| *v != rules.version()) {
        eprintln!(
            "note: replayed with rules version {used} (the running daemon's); the rule files \
             here are version {}. Restart the daemon to replay with them.",
            rules.version()
        );
    }
    print_found(value, String::new)
}

/// `handoff-bridge dlq ...`: through the running daemon, or on the store when it is stopped (the
/// next start then runs what was retried).
fn dlq(config: &Config, action: DlqCommand) -> Result<(), CliError> {
    let now = model::clock::system_millis();
    match action {
        DlqCommand::List { page } => list_command(config, List::DeadLetters, page, Unpaged::Object),
        DlqCommand::Show { id } => {
            let value = read(
                config,
                "GET",
                &format!("/admin/v1/dead-letters/{id}"),
                |store| {
                    Ok(store
                        .dead_letter(id)?
                        .and_then(|l| serde_json::to_value(l).ok()))
                },
            )?;
            print_found(value, || format!("no dead letter {id}"))
        }
        DlqCommand::Retry { id, all } => {
            let (path, wanted) = match (id, all) {
                (Some(id), _) => (format!("/admin/v1/dead-letters/{id}/retry"), Some(id)),
                (None, true) => ("/admin/v1/dead-letters/retry".to_owned(), None),
                (None, false) => {
                    return Err(CliError::Usage("give a dead-letter id or --all".into()))
                }
            };
            let value = read(config, "POST", &path, |store| {
                let mut retried = Vec::new();
                let mut page = match wanted {
                    Some(id) => vec![id],
                    None => first_letters(store, None)?,
                };
                // All of them a page at a time (each page leaves the dead letters as it goes).
                while let Some(&last) = page.last() {
                    for &id in &page {
                        if store.retry_dead_letter(id, now)?.is_some() {
                            retried.push(id);
                        }
                    }
                    page = match wanted {
                        Some(_) => Vec::new(),
                        None => first_letters(store, Some(last))?,
                    };
                }
                store.flush()?;
                Ok((wanted.is_none() || !retried.is_empty())
                    .then(|| serde_json::json!({ "retried": retried })))
            })?;
            print_found(value, || {
                format!("no dead letter {}", id.unwrap_or_default())
            })
        }
        DlqCommand::Drop { id, reason } => {
            if reason.trim().is_empty() {
                return Err(CliError::Usage("--reason must not be empty".into()));
            }
            let path = format!("/admin/v1/dead-letters/{id}?reason={}", enc(&reason));
            let value = read(config, "DELETE", &path, |store| {
                let dropped = store.drop_dead_letter(id, &reason, now)?;
                store.flush()?;
                Ok(dropped.map(|_| serde_json::json!({ "dropped": id, "reason": reason })))
            })?;
            print_found(value, || format!("no dead letter {id}"))
        }
    }
}

fn enc(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// Ask the running daemon; if none runs, open the store and ask it directly.
fn read(
    config: &Config,
    method: &str,
    path: &str,
    offline: impl FnOnce(&Store) -> Result<Option<Value>, storage::StoreError>,
) -> Result<Option<Value>, CliError> {
    if let Some(found) = online(config, method, path)? {
        return Ok(found);
    }
    let data = DataDir::new(&config.store.data_dir);
    let store = Store::open(&data.store_path(), config.store.cache_capacity_bytes)?;
    Ok(offline(&store)?)
}

/// Through the running daemon's admin API; `None` when no daemon runs on this data directory.
/// A `daemon.json` whose process is gone or does not hold the store is stale: its addresses are
/// never called (whoever listens there now must not get the admin token).
fn online(config: &Config, method: &str, path: &str) -> Result<Option<Option<Value>>, CliError> {
    let data = DataDir::new(&config.store.data_dir);
    if let Some(info) = data.running_daemon() {
        let token = if config.admin.token.is_empty() {
            data.read_secret(ADMIN_TOKEN_FILE)
                .map(|s| s.expose().to_owned())
                .unwrap_or_default()
        } else {
            config.admin.token.expose().to_owned()
        };
        match admin_call(info.admin_addr(), &token, method, path) {
            Ok(found) => return Ok(Some(found)),
            Err(AdminCallError::Unreachable) => {} // stale daemon.json: the daemon is gone
            Err(AdminCallError::Failed(msg)) => return Err(CliError::Admin(msg)),
        }
    }
    Ok(None)
}

enum AdminCallError {
    Unreachable,
    Failed(String),
}

fn admin_call(
    listen: &str,
    token: &str,
    method: &str,
    path: &str,
) -> Result<Option<Value>, AdminCallError> {
    let mut addr: std::net::SocketAddr = listen.parse().map_err(|_| AdminCallError::Unreachable)?;
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let url = format!("http://{addr}{path}");
    let method = actix_web::http::Method::from_bytes(method.as_bytes())
        .map_err(|e| AdminCallError::Failed(e.to_string()))?;
    let token = token.to_owned();
    let result = actix_web::rt::System::new().block_on(async move {
        let client = awc::Client::builder()
            .timeout(std::time::Duration::from_secs(30))
            .finish();
        let mut resp = match client.request(method, &url).bearer_auth(token).send().await {
            Ok(r) => r,
            Err(awc::error::SendRequestError::Connect(_)) => {
                return Err(AdminCallError::Unreachable)
            }
            Err(e) => return Err(AdminCallError::Failed(e.to_string())),
        };
        let status = resp.status();
        let body = resp
            .body()
            .limit(64 * 1024 * 1024)
            .await
            .map_err(|e| AdminCallError::Failed(e.to_string()))?;
        Ok((status, body))
    })?;
    let (status, body) = result;
    let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if status.is_success() || status == actix_web::http::StatusCode::CONFLICT {
        Ok(Some(value))
    } else if status == actix_web::http::StatusCode::NOT_FOUND {
        Ok(None)
    } else {
        let msg = value
            .pointer("/error/message")
            .and_then(Value::as_str)
            .unwrap_or("unexpected answer");
        Err(AdminCallError::Failed(format!("{status}: {msg}")))
    }
}

/// `handoff-bridge api`: one call, printed as JSON.
fn api(config: &Config, args: ApiArgs) -> Result<(), CliError> {
    use model::contract::Endpoint;
    use upstream::{ApiCall, Execute};
    if args.list {
        for e in Endpoint::ALL {
            out!("{:<28} {:<6} {}", e.name(), e.method(), e.path_template());
        }
        return Ok(());
    }
    let name = args.endpoint.unwrap_or_default();
    let endpoint = Endpoint::from_name(&name).ok_or_else(|| {
        CliError::Usage(format!(
            "unknown endpoint {name:?}; see `handoff-bridge api --list`"
        ))
    })?;
    let params: Vec<&str> = args.params.iter().map(String::as_str).collect();
    let mut call = ApiCall::new(endpoint, &params);
    call.query = args
        .query
        .iter()
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .ok_or_else(|| CliError::Usage(format!("--query {kv:?} is not KEY=VALUE")))
        })
        .collect::<Result<_, _>>()?;
    if let Some(body) = args.body {
        let text = match body.strip_prefix('@') {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| CliError::Usage(format!("--body @{path}: {e}")))?,
            None => body,
        };
        call.body = Some(
            serde_json::from_str(&text)
                .map_err(|e| CliError::Usage(format!("--body is not JSON: {e}")))?,
        );
    }
    call.idempotency_key = args.idempotency_key;
    call.path_and_query()
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let settings = config.upstream.client_settings().map_err(CliError::Usage)?;
    let limits = upstream::limits::Limits::new(&config.upstream.limits).map_err(CliError::Usage)?;
    let up = &config.upstream;
    let result = actix_web::rt::System::new().block_on(async move {
        if up.is_embedded() {
            return Err(upstream::UpstreamError::InvalidCall(
                "upstream is \"embedded\": give --upstream URL (e.g. a running `handoff-bridge emulator`)".into(),
            ));
        }
        let tls = upstream::tls::ClientTls::new(&upstream::tls::Trust::load(), &up.ca_file, "upstream", None)
            .map_err(|e| upstream::UpstreamError::InvalidCall(format!("upstream.ca_file: {e}")))?;
        let transport = upstream::transport::AwcTransport::new(&up.url, up.connect_timeout, up.request_timeout, tls);
        upstream::Client::new(transport, settings, limits).execute(call).await
    });
    match result {
        Ok(value) => {
            out!(
                "{}",
                serde_json::to_string_pretty(&value).unwrap_or_default()
            );
            Ok(())
        }
        Err(e) => {
            if let upstream::UpstreamError::Status { body, .. } = &e {
                out!("{body}");
            }
            Err(CliError::Upstream(e))
        }
    }
}

/// `handoff-bridge emulator`: a standalone emulator until SIGINT/SIGTERM.
fn emulator(
    listen: String,
    seed: Option<PathBuf>,
    api_key: Option<String>,
    webhook_url: Option<String>,
) -> Result<(), CliError> {
    use emulator::{sender, EmulatorConfig, Seed};
    crate::telemetry::init(&crate::config::LogConfig {
        format: crate::config::LogFormat::Human,
        level: "info".into(),
    });
    let seed = match seed {
        Some(path) => Seed::load(&path).map_err(|e| CliError::Usage(e.to_string()))?,
        None => Seed::default_seed().map_err(|e| CliError::Usage(e.to_string()))?,
    };
    let (key, generated) = match api_key {
        Some(k) if !k.is_empty() => (k, false),
        _ => {
            use rand::distr::{Alphanumeric, SampleString};
            (Alphanumeric.sample_string(&mut rand::rng(), 32), true)
        }
    };
    actix_web::rt::System::new().block_on(async move {
        let running = emulator::start_standalone(
            &listen,
            seed,
            EmulatorConfig::new(model::secret::Secret::new(key.clone())),
        )
        .map_err(|e| CliError::Usage(e.to_string()))?;
        if let Some(url) = webhook_url {
            // An https:// webhook URL is verified against the platform's roots.
            let tls = if url
                .get(..8)
                .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
            {
                upstream::tls::install_provider();
                Some(
                    upstream::tls::Trust::load()
                        .client_config("")
                        .map_err(CliError::Usage)?,
                )
            } else {
                None
            };
            sender::start(
                running.emulator.clone(),
                sender::SenderConfig {
                    url,
                    window: std::time::Duration::from_millis(50),
                    tls,
                },
            );
        }
        for addr in &running.addrs {
            say!("listening: http://{addr}");
        }
        if generated {
            // A throwaway key for a local emulator, shown once so callers can use it.
            say!("api key: {key}");
        }
        let handle = running.server.handle();
        let server = actix_web::rt::spawn(running.server);
        shutdown_signal().await;
        handle.stop(true).await;
        let _ = server.await;
        Ok(())
    })
}
