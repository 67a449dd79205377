//! The composition root: [`Application::build`] binds nothing of its own (the caller hands it
//! the [`Listeners`]), opens the data directory and the event log, serves the webhook early when
//! the store has a log from before, starts the upstream (the embedded emulator too) and starts
//! opening the store; [`Application::run`] waits for the store, starts the writer, dispatcher,
//! executor, timer firer, reconciliation sweeper, backfill and pruner, serves HTTP, and when its
//! shutdown future resolves stops in order (stop accepting, finish requests, stop firing timers,
//! sweeping, backfilling and dispatching, flush).
//!
//! No stdout, signals or process exit here: the binary (`cli`) prints the banner from
//! [`Started`] and hands `run` its signal; tests start applications in process.

mod early;
mod roles;
mod servers;
mod service;
mod store;

pub use early::listen_on;
pub use roles::GivenStore;
pub use store::{open_offline, postgres_options, Backend};

use crate::config::Config;
use crate::datadir::{DaemonInfo, DataDir, ADMIN_TOKEN_FILE, WEBHOOK_TOKEN_FILE};
use crate::dispatch::{DispatchHandle, DispatchSettings};
use crate::intake::auth::{CidrList, TokenSet};
use crate::ops::metrics::Metrics;
use crate::ops::Ops;
use actix_web::web;
use early::{EarlyIntake, EarlyParts};
use engine::rules::live::LiveRules;
use model::secret::Secret;
use service::{client_tls, Upstream};
use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use storage::port::Lifecycle as _;
use storage::writer::{SledWriter, WriterHooks};
use storage::{SledStore, Store, StoreError, Writer};
use tokio::sync::watch;

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("data directory {path}: {source}")]
    DataDir {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("server failed: {0}")]
    Server(std::io::Error),
    #[error("upstream: {0}")]
    Upstream(String),
    #[error("webhook tokens: {0}")]
    Tokens(#[from] regex::Error),
    #[error("rules: {0}")]
    Rules(#[from] engine::rules::LoadError),
    #[error("TLS: {0}")]
    Tls(String),
    /// `store.url_file` or `store.ca_file` unusable.
    #[error("store: {0}")]
    StoreConfig(String),
    /// Only a restart mends the store (see `storage::Stuck`): end the process with this code, at
    /// once, as a crash would.
    #[error("the store is stuck; a restart mends it (exit code {exit_code})")]
    Stuck { exit_code: i32 },
    #[error("cannot start thread {name}: {source}")]
    Thread {
        name: &'static str,
        source: std::io::Error,
    },
}

/// The configured rules, compiled: `rules.dir`'s files, or the shipped set when it is empty;
/// `None` when rules are turned off (`rules.enabled = false`).
pub fn rule_set(
    config: &Config,
) -> Result<Option<engine::rules::RuleSet>, engine::rules::LoadError> {
    if !config.rules.enabled {
        return Ok(None);
    }
    let overrides = settings_overrides(config);
    if config.rules.dir.is_empty() {
        return engine::rules::RuleSet::from_sources_with(
            &engine::rules::shipped::sources(),
            &overrides,
        )
        .map(Some);
    }
    engine::rules::RuleSet::load_dir_with(std::path::Path::new(&config.rules.dir), &overrides)
        .map(Some)
}

/// `rules.settings` as JSON values, for the rule loader. With the shipped rules and a help desk
/// configured (an endpoint, or Chatwoot), `notify_helpdesk` is on unless set: configuring a desk
/// is all it takes for handoffs to reach it.
pub fn settings_overrides(config: &Config) -> serde_json::Map<String, serde_json::Value> {
    let mut map = match serde_json::to_value(&config.rules.settings) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    };
    if config.rules.dir.is_empty() && config.helpdesk.has_desk() {
        map.entry(NOTIFY_HELPDESK)
            .or_insert(serde_json::Value::Bool(true));
    }
    map
}

/// The shipped rules' switch that tells the help desks of handoffs (rules/settings.toml).
const NOTIFY_HELPDESK: &str = "notify_helpdesk";

/// The configured rules; loaded before the store opens, so a bad rule file stops the start
/// before anything is touched.
pub fn load_rules(config: &Config) -> Result<LiveRules, engine::rules::LoadError> {
    let Some(set) = rule_set(config)? else {
        return Ok(LiveRules::new(Arc::new(engine::decide::NoRules)));
    };
    tracing::info!(
        dir = if config.rules.dir.is_empty() {
            "(shipped)"
        } else {
            config.rules.dir.as_str()
        },
        rules = set.rules().len(),
        version = set.version(),
        "rules loaded"
    );
    Ok(LiveRules::of_set(set))
}

/// The listening sockets, bound by the caller (`127.0.0.1:0` for an ephemeral port).
pub struct Listeners {
    /// `server.listen`: the webhook, the agent API, the probes.
    pub public: TcpListener,
    /// `admin.listen`; `None` when the admin API shares the public listener.
    pub admin: Option<TcpListener>,
}

impl Listeners {
    /// Bind `server.listen` and `admin.listen` as configured.
    pub fn bind(config: &Config) -> Result<Listeners, AppError> {
        Ok(Listeners {
            public: listen_on(config.listen_addr())?,
            admin: config.admin_listen_addr().map(listen_on).transpose()?,
        })
    }
}

/// Where a built application listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Addrs {
    pub public: SocketAddr,
    /// The admin listener; `None`: the admin API is on the public one.
    pub admin: Option<SocketAddr>,
    /// The embedded emulator (`upstream.mode = "embedded"`).
    pub emulator: Option<SocketAddr>,
    /// `https` when the public listener has TLS.
    pub scheme: &'static str,
}

/// What the banner says once the application serves (handed to `run`'s `started`).
#[derive(Debug)]
pub struct Started {
    pub addrs: Addrs,
    /// `webhook.path`: the webhook's URL is `{scheme}://{public}{path}/{token}`.
    pub webhook_path: String,
    /// The webhook token this start generated, to be shown once to a person; `None` when the
    /// tokens were configured or generated by an earlier start.
    pub generated_token: Option<Secret>,
    /// Where a generated webhook token is kept.
    pub token_file: PathBuf,
    /// The Open API's URL, masked, when the upstream is the real service.
    pub remote_upstream: Option<String>,
}

/// How [`Application::run`] ended without an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stopped {
    /// Stopped in the documented order; the store was flushed.
    InOrder,
    /// Stopped while the store was still opening: the early listener finished what it had, and
    /// sled's open (which cannot be cut short) still runs on its thread; the process should end
    /// now, as a crash would (sled recovers; what the early listener answered is in the log).
    WhileOpening,
}

/// The store being opened off the runtime's threads.
type Opening = tokio::task::JoinHandle<Result<Result<Backend, AppError>, std::io::Error>>;

/// A daemon built and not yet running: see the module's docs.
pub struct Application {
    config: Config,
    data: DataDir,
    metrics: Metrics,
    rules: engine::rules::live::LiveRules,
    public_tls: crate::tls::PublicTls,
    webhook_watch: crate::backfill::WebhookWatch,
    body_budget: web::Data<crate::body_budget::BodyBudget>,
    workers: usize,
    /// The public socket, unless the early intake holds it.
    public: Option<TcpListener>,
    admin: Option<TcpListener>,
    addrs: Addrs,
    early: Option<EarlyIntake>,
    upstream: Upstream,
    trust: upstream::tls::Trust,
    tls_observer: upstream::tls::TlsObserver,
    fold_priority: crate::background::Priority,
    clock: model::clock::Clock,
    /// A store only a restart mends (see `storage::Stuck`): where it is reported, and what
    /// watches that.
    stuck_report: storage::Stuck,
    stuck: watch::Receiver<Option<i32>>,
    opening: Opening,
    opening_since: Instant,
}

impl Application {
    /// Everything that does not wait for the store: see the module's docs. Must run inside an
    /// actix system.
    pub async fn build(config: Config, listeners: Listeners) -> Result<Application, AppError> {
        Self::build_with(config, listeners, None).await
    }

    /// [`build`](Application::build) on a store the caller opened instead of sled in the data
    /// directory (which still holds the tokens and `daemon.json`), its clock the application's:
    /// several applications in one process on one shared store are several nodes.
    pub async fn build_on(
        config: Config,
        listeners: Listeners,
        store: GivenStore,
    ) -> Result<Application, AppError> {
        Self::build_with(config, listeners, Some(store)).await
    }

    async fn build_with(
        config: Config,
        listeners: Listeners,
        given: Option<GivenStore>,
    ) -> Result<Application, AppError> {
        let data = DataDir::new(&config.store.data_dir);
        for note in &config.deprecated {
            tracing::warn!("config: {note}");
        }
        let rules = load_rules(&config)?;
        // This application's time: its test clock moves it, and no other's (a given store's
        // clock is the application's: its nodes share it).
        let clock = given
            .as_ref()
            .map_or_else(model::clock::Clock::new, |g| g.store.clock().clone());
        let (stuck, stuck_rx) = storage::Stuck::new();
        data.create().map_err(data_dir_error(&config))?;
        if let Some(mode) = data.loose_mode() {
            tracing::warn!(
                data_dir = %data.root().display(),
                mode = format_args!("{mode:o}"),
                "the data directory is readable by others than its owner (it holds message texts \
                 and secrets): chmod 700 it"
            );
        }
        // A store this build opened before has an event log that can take deliveries while sled
        // replays its own log, which after a long run takes seconds to minutes
        // (docs/operations.md, "Start time"): the webhook is then answered during a start, not
        // refused. The log's lock is taken here, so a store in use stops the start before
        // anything else.
        let metrics = Metrics::new()?;
        let (trust, tls_observer) = client_tls(&config, &metrics);
        let postgres = store::postgres_options(&config, &trust)?;
        // PostgreSQL answers at once once connected, a given store is open: no early intake
        // (sled's log only).
        let early_log = match (&postgres, &given) {
            (Some(_), _) | (_, Some(_)) => None,
            (None, None) => storage::IntakeLog::open_early(
                &data.store_path(),
                storage::eventlog::SEGMENT_BYTES,
            )?,
        };
        let public_tls =
            crate::tls::PublicTls::from_files(config.server.tls.files()).map_err(AppError::Tls)?;
        let webhook_watch = crate::backfill::WebhookWatch::new(&metrics);
        let body_budget = web::Data::new(crate::body_budget::BodyBudget::new(
            config.server.max_inflight_body_bytes,
            route_caps(&config),
            config.server.body_read_timeout,
            metrics.clone(),
        ));
        let workers = match config.server.workers {
            0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
            n => n,
        };
        let bound = |listener: &TcpListener, configured: &str| {
            listener.local_addr().map_err(|source| AppError::Bind {
                addr: configured.to_owned(),
                source,
            })
        };
        let public_addr = bound(&listeners.public, &config.server.listen)?;
        let admin_addr = match &listeners.admin {
            Some(admin) => Some(bound(admin, &config.admin.listen)?),
            None => None,
        };
        let (public, early) = match early_log.clone() {
            None => (Some(listeners.public), None),
            Some(log) => {
                let observe = observe_groups(&metrics);
                let (writer, attach) = SledWriter::start_early(log, observe, stuck.clone())?;
                let tokens = webhook_tokens(&config, &data)?;
                let intake = intake_state(
                    &config,
                    (&metrics, &clock),
                    &webhook_watch,
                    writer,
                    &tokens.0,
                )?;
                let parts = EarlyParts {
                    tokens,
                    intake,
                    attach,
                    body_budget: body_budget.clone(),
                    workers,
                };
                let tls = public_tls.server_config().map_err(AppError::Tls)?;
                let early = EarlyIntake::start(&config, tls, listeners.public, parts)?;
                (None, Some(early))
            }
        };
        let upstream = Upstream::start(&config, &metrics, &clock, (&trust, tls_observer.clone()))?;
        let fold_priority = fold_priority(&config.dispatch);
        let opening = match given {
            Some(given) => tokio::spawn(async move { Ok(Ok(Backend::Given(given))) }),
            None => open_store(
                &config,
                &data,
                (early_log, postgres),
                (fold_priority, clock.clone()),
            ),
        };
        let addrs = Addrs {
            public: public_addr,
            admin: admin_addr,
            emulator: upstream.emulator.as_ref().map(|e| e.addr),
            scheme: public_tls.scheme(),
        };
        Ok(Application {
            config,
            data,
            metrics,
            rules,
            public_tls,
            webhook_watch,
            body_budget,
            workers,
            public,
            admin: listeners.admin,
            addrs,
            early,
            upstream,
            trust,
            tls_observer,
            fold_priority,
            clock,
            stuck_report: stuck,
            stuck: stuck_rx,
            opening,
            opening_since: Instant::now(),
        })
    }

    /// Where it listens.
    pub fn addrs(&self) -> Addrs {
        self.addrs
    }

    /// Whether the webhook is served already, while the store opens (a store from before).
    pub fn takes_early_deliveries(&self) -> bool {
        self.early.is_some()
    }

    /// Run until `shutdown` resolves (with the reason, for the log) or a server fails, then stop
    /// in order; `started` is called once everything serves. See the module's docs.
    pub async fn run(
        mut self,
        shutdown: impl Future<Output = &'static str>,
        started: impl FnOnce(&Started),
    ) -> Result<Stopped, AppError> {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut stuck = self.stuck.clone();
        let opened = tokio::select! {
            opened = &mut self.opening => opened,
            code = stuck_code(&mut stuck) => return Err(AppError::Stuck { exit_code: code }),
            signal = &mut shutdown => {
                // sled's replay cannot be cut short, and need not be: the caller ends the
                // process, as a crash would, once the early listener has answered what it has.
                tracing::info!(signal, "shutting down while the store opens");
                if let Some(early) = self.early.take() {
                    early.stop().await;
                }
                tracing::info!("stopped before the store opened");
                return Ok(Stopped::WhileOpening);
            }
        };
        let thread = |source| AppError::Thread {
            name: "store-open",
            source,
        };
        let opened = opened
            .map_err(|e| thread(std::io::Error::other(e.to_string())))
            .and_then(|opened| opened.map_err(thread));
        let store = match opened {
            Ok(Ok(store)) => store,
            Ok(Err(e)) | Err(e) => {
                // The early listener finishes what it has: what it answered is in the log.
                if let Some(early) = self.early.take() {
                    early.stop().await;
                }
                return Err(e);
            }
        };
        tracing::info!(
            took_ms = self.opening_since.elapsed().as_millis() as u64,
            "store opened"
        );
        let mut running = self.start_services(store)?;
        let mut serving = self.serve(&mut running).await?;
        started(&serving.started);
        let addrs = self.addrs;
        tracing::info!(bound = %addrs.public, scheme = addrs.scheme, admin = ?addrs.admin, data_dir = %self.data.root().display(), upstream = self.config.upstream.mode(), "handoff-bridge started");
        let result = tokio::select! {
            result = serving.wait(shutdown.as_mut()) => result,
            // As a crash would: no stop in order (the next start finds what was in flight).
            code = stuck_code(&mut stuck) => return Err(AppError::Stuck { exit_code: code }),
        };
        running.shared.shutting_down.store(true, Ordering::Relaxed);
        serving.stop().await;
        self.stop(running).await;
        match result {
            Some(Ok(Err(e))) => Err(AppError::Server(e)),
            _ => Ok(Stopped::InOrder),
        }
    }
}

/// What runs once the store is open: the handlers' shared state, the writer, and the tasks the
/// stop waits for.
struct Running {
    shared: web::Data<Ops>,
    agent_api: web::Data<crate::helpdesk::agent_api::AgentApi>,
    /// The command path the agent API, the console and the desks' webhooks share.
    commands: Arc<crate::helpdesk::commands::Commands>,
    /// Chatwoot's webhook, when the connector is configured.
    chatwoot_hook: Option<web::Data<crate::helpdesk::chatwoot::webhook::ChatwootHook>>,
    intake: web::Data<crate::intake::Intake>,
    writer: Writer,
    /// The webhook tokens in force, and whether this start generated the one.
    webhook_token: (Vec<Secret>, bool),
    stop_tx: watch::Sender<bool>,
    stop_rx: watch::Receiver<bool>,
    /// This node among the nodes on the store (its lease given up after the stop).
    cluster: crate::cluster::Cluster,
    tasks: Tasks,
}

struct Tasks {
    executor: tokio::sync::oneshot::Receiver<()>,
    dispatcher: tokio::task::JoinHandle<()>,
    firer: tokio::task::JoinHandle<()>,
    sweeper: tokio::task::JoinHandle<()>,
    backfiller: Option<tokio::task::JoinHandle<()>>,
    pruner: tokio::task::JoinHandle<()>,
    watcher: tokio::task::JoinHandle<()>,
    cert_reloader: Option<tokio::task::JoinHandle<()>>,
    /// The lease loop (a store other nodes may share).
    lease: Option<tokio::task::JoinHandle<()>>,
    /// The active's loop over what other nodes ask of it (a store other nodes may share).
    asks: Option<tokio::task::JoinHandle<()>>,
}

/// The background work's handles (the admin API steers them) and tasks (the stop waits for them).
struct Background {
    sweeper: crate::reconcile::Sweeper,
    backfill: crate::backfill::Backfill,
    pruner: crate::prune::Pruner,
    reloader: crate::ops::reload::Reloader,
    tasks: BackgroundTasks,
}

struct BackgroundTasks {
    firer: tokio::task::JoinHandle<()>,
    sweeper: tokio::task::JoinHandle<()>,
    backfiller: Option<tokio::task::JoinHandle<()>>,
    pruner: tokio::task::JoinHandle<()>,
    watcher: tokio::task::JoinHandle<()>,
}

/// The parts of the pipeline the handlers need, started on an open store.
struct Pipeline {
    writer: Writer,
    dispatch: DispatchHandle,
    executor: crate::outbox::ExecutorHandle,
    /// The Chatwoot connector's view (health, links), when it is configured.
    chatwoot: Option<crate::helpdesk::chatwoot::ChatwootView>,
    verdicts: Arc<crate::helpdesk::commands::Waiters>,
    executor_task: tokio::sync::oneshot::Receiver<()>,
    dispatcher: tokio::task::JoinHandle<()>,
}

impl Application {
    /// The store's gauges, the pipeline (help desks, executor, dispatcher, writer) and the
    /// background tasks (timers, reconciliation, backfill, pruning, rule reloads), and the
    /// handlers' state.
    fn start_services(&mut self, backend: Backend) -> Result<Running, AppError> {
        // The rest of the daemon sees the store through its port only.
        let store: Store = backend.port();
        let webhook_token = match &self.early {
            Some(early) => early.tokens.clone(),
            None => webhook_tokens(&self.config, &self.data)?,
        };
        let admin_token = if self.config.admin.token.is_empty() {
            let file = self.data.secret(ADMIN_TOKEN_FILE);
            file.map_err(data_dir_error(&self.config))?.0
        } else {
            self.config.admin.token.clone()
        };
        record_sizes(&*store, &self.metrics)?;
        let (stop_tx, stop_rx) = watch::channel(false);
        self.metrics
            .upstream_info
            .with_label_values(&[self.config.upstream.mode()])
            .set(1);
        let (cluster, role) = crate::cluster::Cluster::new(
            crate::cluster::Settings::of(&self.config.cluster),
            store.clone(),
        )?;
        let pipeline = self.start_pipeline(&store, backend, (&cluster, &stop_rx))?;
        let writer = pipeline.writer.clone();
        let background = self.start_background(&store, &pipeline, (&cluster, &stop_rx))?;
        let config = &self.config;
        let metrics = &self.metrics;
        let upstream = &self.upstream.handle;
        let executor = pipeline.executor.clone();
        let intake = match &self.early {
            Some(early) => early.intake.clone(),
            None => intake_state(
                config,
                (metrics, &self.clock),
                &self.webhook_watch,
                writer.clone(),
                &webhook_token.0,
            )?,
        };
        let proxies = crate::client_addr::Proxies::new(
            config.server.trusted_proxies.clone(),
            config.server.proxy_header,
        );
        let commands = Arc::new(crate::helpdesk::commands::Commands::new(
            roles::command_settings(&config.helpdesk, &cluster),
            store.clone(),
            writer.clone(),
            pipeline.verdicts.clone(),
            Arc::new(crate::helpdesk::idempotency::InProgress::with_gauge(
                metrics.helpdesk_calls_in_progress.clone(),
            )),
        ));
        let chatwoot_hook = match config.helpdesk.chatwoot.enabled() {
            true => Some(web::Data::new(
                crate::helpdesk::chatwoot::webhook::ChatwootHook::new(
                    &config.helpdesk.chatwoot,
                    commands.clone(),
                    (store.clone(), metrics.clone()),
                    config.server.body_read_timeout,
                )
                .map_err(AppError::Upstream)?,
            )),
            false => None,
        };
        let agent_api = web::Data::new(crate::helpdesk::agent_api::AgentApi::new(
            &config.helpdesk,
            crate::helpdesk::agent_api::Links {
                store: store.clone(),
                upstream: upstream.clone(),
                proxies: proxies.clone(),
                body_read_timeout: config.server.body_read_timeout,
                commands: commands.clone(),
            },
        ));
        let shared = web::Data::new(Ops {
            store,
            writer: writer.clone(),
            dispatch: pipeline.dispatch.clone(),
            executor,
            metrics: metrics.clone(),
            intake: intake.clone(),
            admin_tokens: TokenSet::new(vec![admin_token]),
            admin_cidrs: CidrList::new(config.admin.allow_cidrs.clone()),
            proxies,
            test_clock: config.admin.test_clock,
            shutting_down: AtomicBool::new(false),
            emulator: self.upstream.emulator.as_ref().map(|e| e.emulator.clone()),
            rules: background.reloader,
            reconcile: background.sweeper,
            backfill: background.backfill,
            pruner: background.pruner,
            chatwoot: pipeline.chatwoot.clone(),
            cluster: cluster.clone(),
        });
        // What other nodes ask of the active (none asks on a store one process holds).
        let asks = cluster.shared().then(|| {
            let ops = shared.clone();
            roles::active_loop(cluster.terms(&stop_rx), move |stop| {
                crate::ops::asks::serve(ops.clone(), stop)
            })
        });
        // Last: the active's work waits for its terms, which the lease loop starts.
        let lease = cluster.start(role, self.metrics.clone(), stop_rx.clone());
        Ok(Running {
            shared,
            agent_api,
            commands,
            chatwoot_hook,
            intake,
            writer,
            webhook_token,
            stop_tx,
            stop_rx,
            cluster,
            tasks: Tasks {
                executor: pipeline.executor_task,
                dispatcher: pipeline.dispatcher,
                firer: background.tasks.firer,
                sweeper: background.tasks.sweeper,
                backfiller: background.tasks.backfiller,
                pruner: background.tasks.pruner,
                watcher: background.tasks.watcher,
                cert_reloader: None,
                lease,
                asks,
            },
        })
    }

    /// The background work on an open store: the timer firer, the reconciliation sweeper, the
    /// backfill, the store's size gauge, the pruner and the rule reloads.
    fn start_background(
        &self,
        store: &Store,
        pipeline: &Pipeline,
        (cluster, stop_rx): (&crate::cluster::Cluster, &watch::Receiver<bool>),
    ) -> Result<Background, AppError> {
        let config = &self.config;
        let metrics = &self.metrics;
        let writer = pipeline.writer.clone();
        let upstream = &self.upstream.handle;
        // Overdue timers (due while the daemon was down) fire on its first pass.
        let firer = crate::timers::start(
            store.clone(),
            writer.clone(),
            metrics.clone(),
            cluster.terms(stop_rx),
        );
        let executor = pipeline.executor.clone();
        let sweeper = crate::reconcile::Sweeper::new(
            store.clone(),
            writer.clone(),
            upstream.clone(),
            metrics.clone(),
            config.reconcile.clone(),
            executor.clone(),
            self.webhook_watch.clone(),
        )
        .map_err(AppError::Upstream)?;
        let sweeper_task = crate::reconcile::start(sweeper.clone(), cluster.terms(stop_rx));
        let backfill = crate::backfill::Backfill::new(
            store.clone(),
            writer.clone(),
            upstream.clone(),
            metrics.clone(),
            crate::backfill::Settings::from_config(
                &config.backfill,
                config.upstream.limits.global.per_second,
            ),
            self.webhook_watch.clone(),
            executor.clone(),
        )
        .map_err(AppError::Upstream)?;
        // The first pass at once: what the service did while the daemon was down.
        let backfiller = crate::backfill::start(backfill.clone(), cluster.terms(stop_rx));
        tokio::spawn(store_size_loop(
            store.clone(),
            metrics.clone(),
            stop_rx.clone(),
        ));
        let prune =
            crate::prune::Pruner::new(store.clone(), writer.clone(), metrics.clone(), config);
        let (pass, every) = (prune.clone(), config.store.prune_interval);
        let pruner = roles::active_loop(cluster.terms(stop_rx), move |stop| {
            crate::prune::run(pass.clone(), every, stop)
        });
        let reloader = crate::ops::reload::Reloader {
            live: self.rules.clone(),
            // The shipped set is built in: there is nothing to reload.
            dir: (config.rules.enabled && !config.rules.dir.is_empty())
                .then(|| std::path::PathBuf::from(&config.rules.dir)),
            overrides: settings_overrides(config),
            metrics: metrics.clone(),
        };
        let watcher = reloader
            .clone()
            .spawn_watchers(config.rules.watch_interval, stop_rx.clone());
        Ok(Background {
            sweeper,
            backfill,
            pruner: prune,
            reloader,
            tasks: BackgroundTasks {
                firer,
                sweeper: sweeper_task,
                backfiller,
                pruner,
                watcher,
            },
        })
    }

    /// The help desks, the executor, the dispatcher and the writer (the early one attached to
    /// the store, or a new one), and the executor beside the Open API client.
    fn start_pipeline(
        &self,
        store: &Store,
        backend: Backend,
        (cluster, stop_rx): (&crate::cluster::Cluster, &watch::Receiver<bool>),
    ) -> Result<Pipeline, AppError> {
        let config = &self.config;
        let metrics = &self.metrics;
        let mut helpdesk = crate::helpdesk::Desks::start(
            &config.helpdesk,
            &self.trust,
            Some(self.tls_observer.clone()),
        )
        .map_err(AppError::Upstream)?;
        // `handoff.requested` carries the conversation's place in the waiting queue the folds keep.
        helpdesk.queue = Arc::new(store.clone());
        let chatwoot = if config.helpdesk.chatwoot.enabled() {
            let (target, view) = crate::helpdesk::chatwoot::Chatwoot::start(
                &config.helpdesk,
                (&self.trust, Some(self.tls_observer.clone())),
                store.clone(),
                metrics.clone(),
            )
            .map_err(AppError::Upstream)?;
            helpdesk.add(target);
            Some(view)
        } else {
            None
        };
        if helpdesk.is_configured() {
            tracing::info!(targets = ?helpdesk.names(), "help-desk events go to the configured desks");
        }
        let upstream = &self.upstream.handle;
        let (executor, executor_tasks) = crate::outbox::start(
            store.clone(),
            upstream::api::OpenApi::new(upstream.clone()),
            Arc::new(helpdesk),
            metrics.clone(),
            crate::outbox::ExecutorSettings::from_config(&config.outbox),
            stop_rx.clone(),
        )?;
        let verdicts = Arc::new(crate::helpdesk::commands::Waiters::new(
            config.helpdesk.max_pending_commands,
        ));
        let settings = DispatchSettings {
            concurrency: config.dispatch.concurrency,
            batch_size: config.dispatch.batch_size,
            rules: self.rules.clone(),
            decided: Some(executor.decided_sender()),
            verdicts: Some(verdicts.clone()),
            stuck: Some(self.stuck_report.clone()),
            priority: self.fold_priority,
            lift_after: config.dispatch.lift_after(),
        };
        let (dispatch, dispatcher) =
            roles::start_dispatch(store, metrics, settings, (cluster, stop_rx))?;
        let to_dispatch = dispatch.clone();
        let durable: storage::writer::Durable =
            Box::new(move |events, log_end| to_dispatch.notify_events(events, log_end));
        let hooks = WriterHooks {
            observe: observe_groups(metrics),
            durable,
        };
        let writer = match (backend, &self.early) {
            (Backend::Sled(sled), Some(early)) => {
                // What it logged meanwhile is indexed and handed to the dispatcher now.
                early.attach.attach(*sled, hooks.durable);
                early.intake.writer.clone()
            }
            (Backend::Sled(sled), None) => {
                SledWriter::start(*sled, hooks, self.stuck_report.clone())?
            }
            (Backend::Postgres(pg), _) => storage_pg::PgWriter::start(pg, hooks)?,
            (Backend::Given(given), _) => roles::given_writer(given, hooks)?,
        };
        if let Some(view) = &chatwoot {
            // Its marks of calls that may take effect are flushed through the writer.
            view.attach(writer.clone());
        }
        // The executor runs beside the Open API client, so a handoff's calls reach the client
        // without crossing threads (a hop each way per call).
        let terms = cluster.terms(stop_rx);
        let executor_task = upstream
            .spawn_beside(roles::run_executor(executor_tasks, terms, cluster.shared()))
            .map_err(AppError::Upstream)?;
        Ok(Pipeline {
            writer,
            dispatch,
            executor,
            chatwoot,
            verdicts,
            executor_task,
            dispatcher,
        })
    }
}

/// The servers, running.
struct Serving {
    started: Started,
    handle: actix_web::dev::ServerHandle,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    admin_handle: Option<actix_web::dev::ServerHandle>,
    admin_task: tokio::task::JoinHandle<std::io::Result<()>>,
    early_handle: Option<actix_web::dev::ServerHandle>,
    /// Which server ended on its own, if one did (its task is then finished).
    public_ended: bool,
    admin_ended: bool,
}

impl Application {
    /// Serve on the public socket (taken over from the early server, which stops once a
    /// connection it took just before has had its time) and the admin one; the embedded
    /// emulator's webhooks start coming; `daemon.json` says where the daemon listens.
    async fn serve(&mut self, running: &mut Running) -> Result<Serving, AppError> {
        let config = &self.config;
        // The early listener's socket, or the one handed in: the server takes over from the
        // early one on the same socket, so no connection is refused in between.
        let listener = match self.early.as_mut().and_then(|early| early.listener.take()) {
            Some(listener) => listener,
            None => self
                .public
                .take()
                .ok_or_else(|| AppError::Upstream("the public listener is gone".into()))?,
        };
        let tls = self.public_tls.server_config().map_err(AppError::Tls)?;
        running.tasks.cert_reloader = self
            .public_tls
            .spawn_reloader(self.metrics.clone(), running.stop_rx.clone());
        let admin = match self.admin.take() {
            Some(listener) => Some(servers::admin_server(
                config,
                &running.shared,
                web::Data::new(crate::console::Console::new(
                    running.shared.clone(),
                    running.commands.clone(),
                    self.upstream.handle.clone(),
                    &config.admin,
                )),
                self.body_budget.clone(),
                listener,
            )?),
            None => None,
        };
        if let Some((_, at)) = admin.as_ref().filter(|(_, at)| !at.ip().is_loopback()) {
            if !running.shared.admin_cidrs.loopback_only() {
                tracing::warn!(
                    %at,
                    "the admin API listens beyond loopback over plain HTTP and admin.allow_cidrs \
                     admits other hosts: the admin token would cross the network in clear; keep \
                     admin.allow_cidrs to loopback (the default), or reach it through a TLS proxy"
                );
            }
        }
        // The early server stops taking connections (made meanwhile, they wait in the socket's
        // backlog); the server takes them from here on. The early one is stopped once a
        // connection it took just before has had `server.client_request_timeout` to send its
        // request (a stop closes one whose request has not begun), in the background; a shutdown
        // stops it at once.
        if let Some(early) = &self.early {
            early.handle.pause().await;
        }
        let data = servers::PublicData {
            shared: running.shared.clone(),
            agent_api: running.agent_api.clone(),
            chatwoot: running.chatwoot_hook.clone(),
            intake: running.intake.clone(),
            body_budget: self.body_budget.clone(),
        };
        let server = servers::public_server(config, self.workers, data, listener, tls)?;
        let handle = server.handle();
        let early_handle = self.early.as_ref().map(|early| early.handle.clone());
        if let Some(early) = self.early.take() {
            let grace = config.server.client_request_timeout;
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                early.stop().await;
                tracing::info!("the early webhook listener handed over to the server");
            });
        }
        let bound = self.addrs.public;
        self.data
            .write_daemon_info(&DaemonInfo {
                pid: std::process::id(),
                listen: bound.to_string(),
                admin: Some(self.addrs.admin.unwrap_or(bound).to_string()),
            })
            .map_err(data_dir_error(config))?;
        self.start_emulator_webhooks(&running.webhook_token.0)?;
        let remote_upstream = self
            .upstream
            .emulator
            .is_none()
            .then(|| crate::config::mask_url(&config.upstream.url));
        if let Some(url) = &remote_upstream {
            tracing::info!(%url, "upstream is the service's Open API");
        }
        let (generated, tokens) = (running.webhook_token.1, &running.webhook_token.0);
        let started = Started {
            addrs: self.addrs,
            webhook_path: config.webhook.path.clone(),
            generated_token: tokens.first().filter(|_| generated).cloned(),
            token_file: self.data.root().join(WEBHOOK_TOKEN_FILE),
            remote_upstream,
        };
        let task = tokio::spawn(server);
        let (admin_handle, admin_task) = match admin {
            Some((server, _)) => (Some(server.handle()), tokio::spawn(server)),
            // Never ends: only the public server's end or the shutdown stops the daemon.
            None => (
                None,
                tokio::spawn(std::future::pending::<std::io::Result<()>>()),
            ),
        };
        Ok(Serving {
            started,
            handle,
            task,
            admin_handle,
            admin_task,
            early_handle,
            public_ended: false,
            admin_ended: false,
        })
    }

    /// The embedded emulator plays the service: its webhook events come back to this daemon
    /// (over TLS too, trusting exactly the listener's certificate).
    fn start_emulator_webhooks(&self, tokens: &[Secret]) -> Result<(), AppError> {
        let (Some(embedded), Some(token)) = (&self.upstream.emulator, tokens.first()) else {
            return Ok(());
        };
        let mut to = self.addrs.public;
        if to.ip().is_unspecified() {
            to.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let (scheme, path) = (self.addrs.scheme, &self.config.webhook.path);
        emulator::sender::start(
            embedded.emulator.clone(),
            emulator::sender::SenderConfig {
                url: format!("{scheme}://{to}{path}/{}", token.expose()),
                window: Duration::from_millis(50),
                tls: self.public_tls.loopback_client().map_err(AppError::Tls)?,
            },
        );
        tracing::warn!(
            addr = %embedded.addr,
            "upstream is the embedded emulator, not the real service"
        );
        Ok(())
    }

    /// After the servers: the background tasks, the dispatcher and the executor stop (each
    /// within `server.shutdown_timeout`), the emulator stops, and sled is flushed.
    async fn stop(self, running: Running) {
        let timeout = self.config.server.shutdown_timeout;
        let tasks = running.tasks;
        let _ = running.stop_tx.send(true);
        // A pass in progress is cut short: what it handed the writer is stored, the rest is found
        // again by the next start's passes.
        tasks.sweeper.abort();
        // A firing handed over as the dispatcher stops waits in the inbox for the next start.
        if tokio::time::timeout(timeout, tasks.firer).await.is_err() {
            tracing::warn!("timer firer did not stop in time; due timers fire on the next start");
        }
        if let Some(backfiller) = tasks.backfiller {
            // It stops at once: a pass in progress is dropped at its next await.
            let _ = backfiller.await;
        }
        if tokio::time::timeout(timeout, tasks.dispatcher)
            .await
            .is_err()
        {
            tracing::warn!("dispatcher did not stop in time; its events stay in the inbox");
        }
        if tokio::time::timeout(timeout, tasks.executor).await.is_err() {
            tracing::warn!("executor did not stop in time; its entries stay in the outbox");
        }
        let _ = tasks.pruner.await;
        if let Some(asks) = tasks.asks {
            let _ = asks.await;
        }
        let _ = tasks.watcher.await;
        if let Some(lease) = tasks.lease {
            let _ = lease.await;
        }
        // Its work has stopped: another node takes over at once.
        running.cluster.release().await;
        if let Some(reloader) = tasks.cert_reloader {
            let _ = reloader.await;
        }
        // At once: the executor has stopped, so what the emulator still holds is a call whose
        // caller gave up (a hung fault), which a graceful stop would wait 30 s for.
        if let Some(embedded) = self.upstream.emulator {
            embedded.server.stop(false).await;
        }
        // Flush sled, so the next start has nothing to index again.
        let flushed = running.writer.flush().await;
        self.data.remove_daemon_info();
        match flushed {
            Ok(()) => tracing::info!("stopped cleanly"),
            Err(e) => {
                tracing::error!(error = %e, "final flush failed; the next start scans the event log's tail again")
            }
        }
    }
}

impl Serving {
    /// Until `shutdown` resolves or a server ends on its own; that server's result.
    async fn wait(
        &mut self,
        shutdown: std::pin::Pin<&mut impl Future<Output = &'static str>>,
    ) -> Option<Result<std::io::Result<()>, tokio::task::JoinError>> {
        tokio::select! {
            signal = shutdown => {
                tracing::info!(signal, "shutting down");
                None
            }
            res = &mut self.task => {
                self.public_ended = true;
                Some(res)
            }
            res = &mut self.admin_task => {
                tracing::error!("the admin listener stopped; shutting down");
                self.admin_ended = true;
                Some(res)
            }
        }
    }

    /// Stop accepting on both listeners; requests in flight finish (they wait for their flush)
    /// within the timeout.
    async fn stop(self) {
        let Serving {
            handle,
            task,
            admin_handle,
            admin_task,
            early_handle,
            public_ended,
            admin_ended,
            ..
        } = self;
        let stop_public = async {
            if let Some(early) = &early_handle {
                // Its deliveries in hand finish too (a stopped server's handle answers at once).
                early.stop(true).await;
            }
            if !public_ended {
                handle.stop(true).await;
                let _ = task.await;
            }
        };
        let stop_admin = async {
            match &admin_handle {
                Some(h) if !admin_ended => {
                    h.stop(true).await;
                    let _ = admin_task.await;
                }
                _ => admin_task.abort(),
            }
        };
        tokio::join!(stop_public, stop_admin);
    }
}

/// The exit code once the store is reported stuck (never, while it is not).
async fn stuck_code(stuck: &mut watch::Receiver<Option<i32>>) -> i32 {
    match stuck.wait_for(Option::is_some).await {
        Ok(code) => code.unwrap_or(storage::writer::STORE_STUCK_EXIT),
        // The store and its report point are gone: nothing will be reported.
        Err(_) => std::future::pending().await,
    }
}

/// Each surface's limit on the bodies it reads: the admin API's (taken by the middleware), the
/// webhook's and the agent API's (taken by their handlers, after authentication).
fn route_caps(config: &Config) -> crate::body_budget::RouteCaps {
    let admin = (
        crate::ops::admin::PREFIX.to_owned(),
        crate::ops::admin::MAX_BODY,
    );
    let console = (crate::console::PREFIX.to_owned(), crate::console::MAX_BODY);
    let caps = crate::body_budget::RouteCaps::new(vec![admin, console])
        .handled_by_route(&config.webhook.path, config.webhook.max_body_bytes)
        .handled_by_route(
            crate::helpdesk::agent_api::PREFIX,
            crate::helpdesk::agent_api::MAX_BODY,
        );
    use crate::helpdesk::chatwoot::webhook as chatwoot;
    match config.helpdesk.chatwoot.enabled() {
        true => caps.handled_by_route(chatwoot::PATH, chatwoot::MAX_BODY),
        false => caps,
    }
}

/// A failure of the data directory, named by its configured path.
fn data_dir_error(config: &Config) -> impl Fn(std::io::Error) -> AppError + '_ {
    |source| AppError::DataDir {
        path: config.store.data_dir.display().to_string(),
        source,
    }
}

/// The webhook tokens in force: the configured ones, or the data directory's (generated at the
/// first start: then `true`).
fn webhook_tokens(config: &Config, data: &DataDir) -> Result<(Vec<Secret>, bool), AppError> {
    if config.webhook.tokens.is_empty() {
        let (token, generated) = data
            .secret(WEBHOOK_TOKEN_FILE)
            .map_err(data_dir_error(config))?;
        Ok((vec![token], generated))
    } else {
        Ok((config.webhook.tokens.clone(), false))
    }
}

/// The webhook's handler state.
fn intake_state(
    config: &Config,
    (metrics, clock): (&Metrics, &model::clock::Clock),
    watch: &crate::backfill::WebhookWatch,
    writer: Writer,
    tokens: &[Secret],
) -> Result<web::Data<crate::intake::Intake>, AppError> {
    Ok(web::Data::new(crate::intake::Intake {
        writer,
        metrics: metrics.clone(),
        tokens: TokenSet::new(tokens.to_vec()),
        cidrs: CidrList::new(config.webhook.allow_cidrs.clone()),
        proxies: crate::client_addr::Proxies::new(
            config.server.trusted_proxies.clone(),
            config.server.proxy_header,
        ),
        // Every token a delivery may carry: the ones in force, and a generated one left in the
        // data directory (from before tokens were configured).
        scrubber: crate::intake::scrub::Scrubber::configured(config)?,
        watch: watch.clone(),
        max_body_bytes: config.webhook.max_body_bytes,
        max_events: config.webhook.max_events,
        max_clock_skew: config.webhook.max_clock_skew,
        body_read_timeout: config.server.body_read_timeout,
        clock: clock.clone(),
    }))
}

/// Open the store (after its log, when `early_log` has it) on a thread at the fold's priority:
/// sled starts its I/O threads and its log flusher from there (during recovery, or at the first
/// write of its log), and they inherit it. Off the runtime's threads, which serve the early
/// listener meanwhile.
fn open_store(
    config: &Config,
    data: &DataDir,
    (early_log, postgres): (Option<storage::IntakeLog>, Option<storage_pg::PgOptions>),
    (priority, clock): (crate::background::Priority, model::clock::Clock),
) -> Opening {
    if let Some(options) = postgres {
        return tokio::task::spawn_blocking(move || {
            Ok(store::open_postgres(&options, clock).map_err(AppError::from))
        });
    }
    let store_path = data.store_path();
    let cache_capacity = config.store.cache_capacity_bytes;
    // sled replays what it wrote since the previous start: after a long run, seconds to minutes
    // (docs/operations.md, "Start time"). Said, so a slow start is not a mystery.
    let sled_file = storage::sled_file(&store_path);
    let sled_file_bytes = std::fs::metadata(sled_file).map_or(0, |m| m.len());
    tracing::info!(
        sled_file_bytes,
        "opening the store (sled replays its log written since the previous start)"
    );
    let open = move || {
        #[cfg(debug_assertions)]
        early::hold_store_open_for_tests();
        let store = match early_log {
            Some(log) => SledStore::open_after_log(&store_path, cache_capacity, log)?,
            None => SledStore::open(&store_path, cache_capacity)?,
        };
        store.start_background()?;
        Ok::<_, AppError>(Backend::Sled(Box::new(store.with_clock(clock))))
    };
    tokio::task::spawn_blocking(move || {
        crate::background::on_thread_at(priority, "store-open", open)
    })
}

/// The store's size gauges, as it opened.
fn record_sizes(store: &dyn storage::Storage, metrics: &Metrics) -> Result<(), StoreError> {
    let sizes = store.sizes()?;
    for (kind, count) in [
        ("conversations", sizes.conversations),
        ("end_users", sizes.end_users),
        ("bots", sizes.bots),
    ] {
        metrics
            .state_entries
            .with_label_values(&[kind])
            .set(count as i64);
    }
    metrics.quarantine_entries.set(sizes.quarantine as i64);
    metrics.timers_pending.set(store.timers_pending()? as i64);
    metrics
        .store_bytes
        .set(i64::try_from(store.bytes_on_disk()?).unwrap_or(i64::MAX));
    Ok(())
}

/// The writer's report of each group, as metrics.
fn observe_groups(metrics: &Metrics) -> storage::writer::Observe {
    let metrics = metrics.clone();
    Box::new(move |took, deliveries| {
        metrics.flush_seconds.observe(took.as_secs_f64());
        metrics.flush_writers.observe(deliveries as f64);
    })
}

/// How the fold threads (and sled's I/O threads) run. `SCHED_IDLE` only where a starving fold can
/// be lifted out of it again (`dispatch.lift_after`, which needs `CAP_SYS_NICE` or an
/// `RLIMIT_NICE` allowing nice 0): otherwise a host whose other programs keep the CPUs busy would
/// hold every handoff back, so the fold runs at nice 19 instead, which keeps a share of the CPU.
fn fold_priority(dispatch: &crate::config::DispatchConfig) -> crate::background::Priority {
    use crate::background::{can_lift_from_idle, Priority, MAX_NICENESS};
    match dispatch.priority() {
        Priority::Idle if dispatch.lift_after().is_some() && !can_lift_from_idle() => {
            tracing::warn!(
                "dispatch.fold_priority = \"idle\" needs a way back out of SCHED_IDLE for a fold \
                 that starves on a busy host (CAP_SYS_NICE, or RLIMIT_NICE allowing nice 0: \
                 systemd LimitNICE=+0), and this process has none: the fold runs at nice 19"
            );
            Priority::Nice(MAX_NICENESS)
        }
        priority => priority,
    }
}

/// How often `handoff_store_size_bytes` is measured (a walk of the store's files).
const STORE_SIZE_EVERY: Duration = Duration::from_secs(15);

/// Keep `handoff_store_size_bytes` current, measured off the HTTP workers, so a scrape reads a
/// gauge instead of walking the directory.
async fn store_size_loop(store: Store, metrics: Metrics, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(STORE_SIZE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await; // measured at the start already
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let store = store.clone();
        match tokio::task::spawn_blocking(move || store.bytes_on_disk()).await {
            Ok(Ok(bytes)) => metrics
                .store_bytes
                .set(i64::try_from(bytes).unwrap_or(i64::MAX)),
            Ok(Err(e)) => tracing::warn!(error = %e, "cannot measure the store's size"),
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(toml: &str) -> Config {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("bridge.toml");
        std::fs::write(&path, toml).expect("write");
        Config::load_from(Some(&path), Vec::new(), &Default::default()).expect("config")
    }

    #[test]
    fn a_configured_desk_turns_the_shipped_rules_notifications_on_unless_set() {
        let none = config("");
        assert!(!settings_overrides(&none).contains_key(NOTIFY_HELPDESK));
        let desk = r#"
[helpdesk.chatwoot]
url = "https://chat.example.com"
account_id = 1
inbox_id = 2
api_token = "t0ken-0123456789"
webhook_secret = "s3cret-0123456789"
"#;
        let on = config(desk);
        assert_eq!(settings_overrides(&on)[NOTIFY_HELPDESK], true);
        let off = config(&format!(
            "[rules.settings]\nnotify_helpdesk = false\n{desk}"
        ));
        assert_eq!(settings_overrides(&off)[NOTIFY_HELPDESK], false);
        // The shipped set compiles with it.
        assert!(rule_set(&on).expect("rules").is_some());
    }
}
