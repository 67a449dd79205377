//! Wiring: open the store, start the writer, dispatcher, executor, timer firer, reconciliation
//! sweeper, backfill and pruner, serve HTTP, and shut down in order (stop accepting, finish
//! requests, stop firing timers, sweeping, backfilling and dispatching, flush).

use crate::config::Config;
use crate::datadir::{DaemonInfo, DataDir, ADMIN_TOKEN_FILE, WEBHOOK_TOKEN_FILE};
use crate::dispatch::{self, DispatchHandle, DispatchSettings};
use crate::intake::auth::{CidrList, TokenSet};
use crate::ops::metrics::Metrics;
use crate::store::writer::WriterHooks;
use crate::store::{Store, StoreError, Writer};
use actix_web::{web, App, HttpServer};
use std::io::IsTerminal as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// State every handler shares.
pub struct Shared {
    pub store: Store,
    pub writer: Writer,
    pub dispatch: DispatchHandle,
    pub executor: crate::outbox::ExecutorHandle,
    pub metrics: Metrics,
    /// The webhook's intake (its handlers' own state, also served before the store opens).
    pub intake: web::Data<crate::intake::Intake>,
    pub admin_tokens: TokenSet,
    pub admin_cidrs: CidrList,
    /// `server.trusted_proxies`: who may name the client (see `client_addr`).
    pub proxies: crate::client_addr::Proxies,
    /// `admin.test_clock`: `POST /admin/v1/clock/advance` is served.
    pub test_clock: bool,
    pub body_read_timeout: Duration,
    pub shutting_down: AtomicBool,
    /// The Open API client (owned by its own arbiter thread).
    pub upstream: upstream::handle::UpstreamHandle,
    /// The in-process emulator when the upstream is `embedded`.
    pub emulator: Option<emulator::Emulator>,
    /// The rules in force (also used by replay), and how to reload them.
    pub rules: crate::ops::reload::Reloader,
    /// The agent API (`/helpdesk/v1`).
    pub helpdesk: crate::helpdesk::api::Helpdesk,
    /// The reconciliation sweeper (`POST /admin/v1/reconcile`).
    pub reconcile: crate::reconcile::Sweeper,
    /// Backfill's passes (periodic, and `POST /admin/v1/backfill`) and the webhook's silence.
    pub backfill: crate::backfill::Backfill,
    /// The pruning passes (periodic, and `POST /admin/v1/prune`).
    pub pruner: crate::prune::Pruner,
}

impl Shared {
    /// The webhook's checks for a body received (or re-processed) at `now`.
    pub fn webhook_checks(&self, now: i64) -> model::webhook::Checks {
        self.intake.checks(now)
    }
}

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

/// `rules.settings` as JSON values, for the rule loader.
pub fn settings_overrides(config: &Config) -> serde_json::Map<String, serde_json::Value> {
    match serde_json::to_value(&config.rules.settings) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    }
}

/// The configured rules; loaded before the store opens, so a bad rule file stops the start
/// before anything is touched.
pub fn load_rules(
    config: &Config,
) -> Result<Arc<dyn engine::decide::Decide>, engine::rules::LoadError> {
    let Some(set) = rule_set(config)? else {
        return Ok(Arc::new(engine::decide::NoRules));
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
    Ok(Arc::new(set))
}

impl Shared {
    /// The client address the allow-lists judge: the peer, or what a trusted proxy says.
    pub fn client_ip(&self, req: &actix_web::HttpRequest) -> Option<std::net::IpAddr> {
        self.proxies
            .client_ip(req.peer_addr().map(|a| a.ip()), req.headers())
    }
}

/// Run the daemon until SIGTERM or SIGINT. Must run inside an actix system.
pub async fn serve(config: Config) -> Result<(), AppError> {
    let data = DataDir::new(&config.store.data_dir);
    let io_err = |source| AppError::DataDir {
        path: config.store.data_dir.display().to_string(),
        source,
    };
    for note in &config.deprecated {
        tracing::warn!("config: {note}");
    }
    let rules = engine::rules::live::LiveRules::new(load_rules(&config)?);
    data.create().map_err(io_err)?;
    if let Some(mode) = data.loose_mode() {
        tracing::warn!(
            data_dir = %data.root().display(),
            mode = format_args!("{mode:o}"),
            "the data directory is readable by others than its owner (it holds message texts and \
             secrets): chmod 700 it"
        );
    }
    let store_path = data.store_path();
    // A store this build opened before has an event log that can take deliveries while sled
    // replays its own log, which after a long run takes seconds to minutes (docs/operations.md,
    // "Start time"): the webhook is then answered during a start, not refused. The log's lock
    // is taken here, so a store in use stops the start before anything else.
    let early_log =
        crate::store::IntakeLog::open_early(&store_path, crate::store::eventlog::SEGMENT_BYTES)?;
    let metrics = Metrics::new()?;
    let public_tls =
        crate::tls::PublicTls::from_config(&config.server.tls).map_err(AppError::Tls)?;
    let webhook_tokens = || {
        if config.webhook.tokens.is_empty() {
            let (t, generated) = data.secret(WEBHOOK_TOKEN_FILE).map_err(io_err)?;
            Ok::<_, AppError>((vec![t], generated))
        } else {
            Ok((config.webhook.tokens.clone(), false))
        }
    };
    let webhook_watch = crate::backfill::WebhookWatch::new(&metrics);
    let body_budget = web::Data::new(crate::body_budget::BodyBudget::new(
        config.server.max_inflight_body_bytes,
        crate::body_budget::RouteCaps::daemon(&config.webhook.path, config.webhook.max_body_bytes),
        config.server.body_read_timeout,
        metrics.clone(),
    ));
    let workers = match config.server.workers {
        0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
        n => n,
    };
    let addr = config.listen_addr();
    let intake_state = |writer: Writer, tokens: &[model::secret::Secret]| {
        Ok::<_, AppError>(web::Data::new(crate::intake::Intake {
            writer,
            metrics: metrics.clone(),
            tokens: TokenSet::new(tokens.to_vec()),
            cidrs: CidrList::new(config.webhook.allow_cidrs.clone()),
            proxies: crate::client_addr::Proxies::new(
                config.server.trusted_proxies.clone(),
                config.server.proxy_header,
            ),
            // Every token a delivery may carry: the ones in force, and a generated one left in
            // the data directory (from before tokens were configured).
            scrubber: crate::intake::scrub::Scrubber::configured(&config)?,
            watch: webhook_watch.clone(),
            max_body_bytes: config.webhook.max_body_bytes,
            max_events: config.webhook.max_events,
            max_clock_skew: config.webhook.max_clock_skew,
            body_read_timeout: config.server.body_read_timeout,
        }))
    };
    let mut early = match early_log.clone() {
        None => None,
        Some(log) => {
            let writer = Writer::start_early(log, observe_groups(&metrics))?;
            let tokens = webhook_tokens()?;
            let intake = intake_state(writer, &tokens.0)?;
            Some(EarlyIntake::start(
                &config,
                &public_tls,
                (tokens, intake),
                body_budget.clone(),
                workers,
            )?)
        }
    };
    // The store first (after its log, above): one that cannot be opened (in use, corrupt) stops
    // the start before a generated secret is written next to it.
    // Opened on a thread at the fold's priority: sled starts its I/O threads and its log flusher
    // from there (during recovery, or at the first write of its log), and they inherit it.
    let cache_capacity = config.store.cache_capacity_bytes;
    let open = move || {
        #[cfg(debug_assertions)]
        hold_store_open_for_tests();
        let store = match early_log {
            Some(log) => Store::open_after_log(&store_path, cache_capacity, log)?,
            None => Store::open(&store_path, cache_capacity)?,
        };
        store.start_io_threads()?;
        Ok::<_, AppError>(store)
    };
    // sled replays what it wrote since the previous start: after a long run, seconds to minutes
    // (docs/operations.md, "Start time"). Said, so a slow start is not a mystery.
    let sled_file = crate::store::sled_file(&data.store_path());
    let sled_file_bytes = std::fs::metadata(sled_file).map_or(0, |m| m.len());
    tracing::info!(
        sled_file_bytes,
        "opening the store (sled replays its log written since the previous start)"
    );
    let opening = std::time::Instant::now();
    let fold_priority = fold_priority(&config.dispatch);
    // SIGTERM and SIGINT from here on stop the daemon in order, an early listener too.
    let mut signals = std::pin::pin!(shutdown_signal());
    // Off this thread, which serves the early listener's control meanwhile.
    let opening_task = tokio::task::spawn_blocking(move || {
        crate::background::on_thread_at(fold_priority, "store-open", open)
    });
    let opened = tokio::select! {
        opened = opening_task => opened.map_err(|e| AppError::Thread {
            name: "store-open",
            source: std::io::Error::other(e.to_string()),
        }),
        signal = &mut signals => {
            // sled's replay cannot be cut short, and need not be: the process ends here, as a
            // crash would (sled recovers; what the early listener answered is in the log),
            // once the early listener has answered what it has.
            tracing::info!(signal, "shutting down while the store opens");
            if let Some(early) = early.take() {
                early.stop().await;
            }
            tracing::info!("stopped before the store opened");
            std::process::exit(0);
        }
    };
    let thread = |name| move |source| AppError::Thread { name, source };
    let store = match opened.and_then(|opened| opened.map_err(thread("store-open"))) {
        Ok(Ok(store)) => store,
        Ok(Err(e)) | Err(e) => {
            // The early listener finishes what it has: what it answered is in the log.
            if let Some(early) = early.take() {
                early.stop().await;
            }
            return Err(e);
        }
    };
    tracing::info!(
        took_ms = opening.elapsed().as_millis() as u64,
        "store opened"
    );

    let (webhook_token, generated_webhook) = match &early {
        Some(early) => early.tokens.clone(),
        None => webhook_tokens()?,
    };
    let admin_token = if config.admin.token.is_empty() {
        data.secret(ADMIN_TOKEN_FILE).map_err(io_err)?.0
    } else {
        config.admin.token.clone()
    };

    let sizes = store.sizes();
    metrics
        .state_entries
        .with_label_values(&["conversations"])
        .set(sizes.conversations as i64);
    metrics
        .state_entries
        .with_label_values(&["end_users"])
        .set(sizes.end_users as i64);
    metrics
        .state_entries
        .with_label_values(&["bots"])
        .set(sizes.bots as i64);
    metrics.quarantine_entries.set(sizes.quarantine as i64);
    metrics.timers_pending.set(store.timers_pending() as i64);
    metrics
        .store_bytes
        .set(i64::try_from(store.size_on_disk()).unwrap_or(i64::MAX));

    let (stop_tx, stop_rx) = watch::channel(false);
    let (trust, tls_observer) = client_tls(&config, &metrics);
    let upstream = Upstream::start(&config, &metrics, &trust, tls_observer.clone())?;
    metrics
        .upstream_info
        .with_label_values(&[config.upstream.mode()])
        .set(1);
    let mut helpdesk =
        crate::helpdesk::Helpdesk::start(&config.helpdesk, &trust, Some(tls_observer))
            .map_err(AppError::Upstream)?;
    // `handoff.requested` carries the conversation's place in the waiting queue the folds keep.
    helpdesk.queue = std::sync::Arc::new(store.clone());
    if helpdesk.is_configured() {
        let names: Vec<&str> = config
            .helpdesk
            .endpoints
            .iter()
            .map(|e| e.name.as_str())
            .collect();
        tracing::info!(endpoints = ?names, "help-desk events go to the configured endpoints");
    }
    let (executor, executor_tasks) = crate::outbox::start(
        store.clone(),
        upstream::api::OpenApi::new(upstream.handle.clone()),
        std::sync::Arc::new(helpdesk),
        metrics.clone(),
        crate::outbox::ExecutorSettings::from_config(&config.outbox),
        stop_rx.clone(),
    )?;
    let (decided_tx, decided_rx) = executor.decided_channel();
    let verdicts = Arc::new(crate::helpdesk::commands::Waiters::new(
        config.helpdesk.max_pending_commands,
    ));
    let settings = DispatchSettings {
        concurrency: config.dispatch.concurrency,
        batch_size: config.dispatch.batch_size,
        rules: rules.clone(),
        decided: Some(decided_tx),
        verdicts: Some(verdicts.clone()),
        priority: fold_priority,
        lift_after: config.dispatch.lift_after(),
    };
    let (dispatch, dispatcher) =
        dispatch::start(store.clone(), metrics.clone(), settings, stop_rx.clone())?;
    let to_dispatch = dispatch.clone();
    let durable: crate::store::writer::Durable =
        Box::new(move |events, log_end| to_dispatch.notify_events(events, log_end));
    let writer = match &early {
        Some(early) => {
            // What it logged meanwhile is indexed and handed to the dispatcher now.
            early.intake.writer.attach(store.clone(), durable);
            early.intake.writer.clone()
        }
        None => Writer::start(
            store.clone(),
            WriterHooks {
                observe: observe_groups(&metrics),
                durable,
            },
        )?,
    };
    // The executor and the task that hands it durable decisions run beside the Open API client,
    // so a handoff's calls reach the client without crossing threads (a hop each way per call).
    let executor_task = upstream
        .handle
        .spawn_beside(executor_tasks.run())
        .map_err(AppError::Upstream)?;
    upstream
        .handle
        .spawn_beside(executor.clone().forward_decided(decided_rx, writer.clone()))
        .map_err(AppError::Upstream)?;
    // Overdue timers (due while the daemon was down) fire on its first pass.
    let firer = crate::timers::start(
        store.clone(),
        writer.clone(),
        metrics.clone(),
        stop_rx.clone(),
    );
    let sweeper = crate::reconcile::Sweeper::new(
        store.clone(),
        writer.clone(),
        upstream.handle.clone(),
        metrics.clone(),
        config.reconcile.clone(),
        executor.clone(),
        webhook_watch.clone(),
    )
    .map_err(AppError::Upstream)?;
    let sweeper_task = crate::reconcile::start(sweeper.clone(), stop_rx.clone());
    let backfill = crate::backfill::Backfill::new(
        store.clone(),
        writer.clone(),
        upstream.handle.clone(),
        metrics.clone(),
        crate::backfill::Settings::from_config(
            &config.backfill,
            config.upstream.limits.global.per_second,
        ),
        webhook_watch.clone(),
        executor.clone(),
    )
    .map_err(AppError::Upstream)?;
    // The first pass at once: what the service did while the daemon was down.
    let backfiller = crate::backfill::start(backfill.clone(), stop_rx.clone());
    tokio::spawn(store_size_loop(
        store.clone(),
        metrics.clone(),
        stop_rx.clone(),
    ));
    let prune = crate::prune::Pruner::new(store.clone(), writer.clone(), metrics.clone(), &config);
    let pruner = tokio::spawn(crate::prune::run(
        prune.clone(),
        config.store.prune_interval,
        stop_rx.clone(),
    ));
    let reloader = crate::ops::reload::Reloader {
        live: rules,
        // The shipped set is built in: there is nothing to reload.
        dir: (config.rules.enabled && !config.rules.dir.is_empty())
            .then(|| std::path::PathBuf::from(&config.rules.dir)),
        overrides: settings_overrides(&config),
        metrics: metrics.clone(),
    };
    let watcher = reloader
        .clone()
        .spawn_watchers(config.rules.watch_interval, stop_rx.clone());

    let intake = match &early {
        Some(early) => early.intake.clone(),
        None => intake_state(writer.clone(), &webhook_token)?,
    };
    let helpdesk = crate::helpdesk::api::Helpdesk::new(config.helpdesk.clone(), verdicts, &metrics);
    let shared = web::Data::new(Shared {
        store: store.clone(),
        writer: writer.clone(),
        dispatch,
        executor,
        metrics,
        intake: intake.clone(),
        admin_tokens: TokenSet::new(vec![admin_token]),
        admin_cidrs: CidrList::new(config.admin.allow_cidrs.clone()),
        proxies: crate::client_addr::Proxies::new(
            config.server.trusted_proxies.clone(),
            config.server.proxy_header,
        ),
        test_clock: config.admin.test_clock,
        body_read_timeout: config.server.body_read_timeout,
        shutting_down: AtomicBool::new(false),
        upstream: upstream.handle.clone(),
        emulator: upstream.emulator.as_ref().map(|e| e.emulator.clone()),
        rules: reloader,
        helpdesk,
        reconcile: sweeper,
        backfill,
        pruner: prune,
    });

    let webhook_path = config.webhook.path.clone();
    let app_data = shared.clone();
    // One budget for every listener (made above); each route's share is capped at what it reads
    // (the webhook `webhook.max_body_bytes`, the agent API 64 KiB, the admin API 256 KiB).
    let admin_body_budget = body_budget.clone();
    // With `admin.listen` empty the admin API and /metrics stay on this listener.
    let admin_here = config.admin_listen_addr().is_none();
    let intake_data = intake.clone();
    let server = HttpServer::new(move || {
        let path = webhook_path.clone();
        App::new()
            .wrap(actix_web::middleware::from_fn(crate::body_budget::limit))
            .app_data(body_budget.clone())
            .app_data(app_data.clone())
            .app_data(intake_data.clone())
            .app_data(api_error::query_config())
            .configure(|cfg| crate::intake::routes(cfg, &path))
            .configure(crate::ops::probe_routes)
            .configure(|cfg| {
                if admin_here {
                    crate::ops::admin_routes(cfg);
                }
            })
            .service(crate::helpdesk::api::scope())
            .default_service(web::to(api_error::not_found))
    })
    .workers(workers)
    .max_connections(config.server.max_connections)
    .client_request_timeout(config.server.client_request_timeout)
    .keep_alive(config.server.keep_alive)
    .shutdown_timeout(config.server.shutdown_timeout.as_secs().max(1))
    .disable_signals();
    // The early listener's socket, or a new one: the server takes over from the early one on
    // the same socket, so no connection is refused in between.
    let listener = match early.as_mut().and_then(|early| early.listener.take()) {
        Some(listener) => listener,
        None => listen_on(addr)?,
    };
    let bound_server = match public_tls.server_config().map_err(AppError::Tls)? {
        None => server.listen(listener),
        Some(tls) => server.listen_rustls_0_23(listener, tls),
    };
    let server = bound_server.map_err(|source| AppError::Bind {
        addr: addr.to_string(),
        source,
    })?;
    let scheme = public_tls.scheme();
    let cert_reloader = public_tls.spawn_reloader(shared.metrics.clone(), stop_rx.clone());
    let bound = server.addrs().first().copied().unwrap_or(addr);
    let admin = admin_server(&config, &shared, admin_body_budget)?;
    let admin_bound = admin.as_ref().map(|(_, at)| *at);
    if let Some(at) = admin_bound.filter(|at| !at.ip().is_loopback()) {
        if !shared.admin_cidrs.loopback_only() {
            tracing::warn!(
                %at,
                "the admin API listens beyond loopback over plain HTTP and admin.allow_cidrs admits \
                 other hosts: the admin token would cross the network in clear; keep \
                 admin.allow_cidrs to loopback (the default), or reach it through a TLS proxy"
            );
        }
    }
    // The early server stops taking connections (made meanwhile, they wait in the socket's
    // backlog); the server takes them from here on. The early one is stopped once a connection
    // it took just before has had `server.client_request_timeout` to send its request (a stop
    // closes one whose request has not begun), in the background; a shutdown stops it at once.
    if let Some(early) = &early {
        early.handle.pause().await;
    }
    let server = server.run();
    let handle = server.handle();
    let early_handle = early.as_ref().map(|early| early.handle.clone());
    if let Some(early) = early.take() {
        let grace = config.server.client_request_timeout;
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            early.stop().await;
            tracing::info!("the early webhook listener handed over to the server");
        });
    }

    data.write_daemon_info(&DaemonInfo {
        pid: std::process::id(),
        listen: bound.to_string(),
        admin: Some(admin_bound.unwrap_or(bound).to_string()),
    })
    .map_err(io_err)?;
    let token_shown = if generated_webhook && std::io::stdout().is_terminal() {
        // First start with a generated token, by hand: show it once so it can be registered.
        // Under systemd or Kubernetes stdout is a log, and the token stays in its file.
        webhook_token
            .first()
            .map_or("<token>".to_owned(), |t| t.expose().to_owned())
    } else if generated_webhook {
        format!(
            "<generated token, saved in {}>",
            data.root().join(WEBHOOK_TOKEN_FILE).display()
        )
    } else {
        format!(
            "<token in {} or config>",
            data.root().join(WEBHOOK_TOKEN_FILE).display()
        )
    };
    println!(
        "webhook url: {scheme}://{bound}{}/{token_shown}",
        config.webhook.path
    );
    if let (Some(embedded), Some(token)) = (&upstream.emulator, webhook_token.first()) {
        // The embedded emulator plays the service: its webhook events come back to this daemon
        // (over TLS too, trusting exactly the listener's certificate).
        let mut to = bound;
        if to.ip().is_unspecified() {
            to.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let url = format!("{scheme}://{to}{}/{}", config.webhook.path, token.expose());
        emulator::sender::start(
            embedded.emulator.clone(),
            emulator::sender::SenderConfig {
                url,
                window: Duration::from_millis(50),
                tls: public_tls.loopback_client().map_err(AppError::Tls)?,
            },
        );
        // Loud: a bridge that talks to the fake reaches no real user.
        println!(
            "WARNING: the upstream is the embedded emulator, not the real service: no message \
             reaches a real user (set upstream.url to the service's Open API for production)"
        );
        tracing::warn!(
            addr = %embedded.addr,
            "upstream is the embedded emulator, not the real service"
        );
        println!("upstream: embedded emulator at http://{}", embedded.addr);
    }
    if upstream.emulator.is_none() {
        let url = crate::config::mask_url(&config.upstream.url);
        println!("upstream: remote {url}");
        tracing::info!(%url, "upstream is the service's Open API");
    }
    // Machine-readable start lines on stdout, the public one last: tests and scripts wait for it.
    {
        // A closed stdout must not stop the daemon (a panic here would).
        use std::io::Write as _;
        if let Some(at) = admin_bound {
            let _ = writeln!(std::io::stdout(), "admin listening: http://{at}");
        }
        let _ = writeln!(std::io::stdout(), "listening: {scheme}://{bound}");
    }
    tracing::info!(%bound, scheme, admin = ?admin_bound, data_dir = %data.root().display(), upstream = config.upstream.mode(), "handoff-bridge started");

    let mut server_task = tokio::spawn(server);
    let (admin_handle, mut admin_task) = match admin {
        Some((server, _)) => (Some(server.handle()), tokio::spawn(server)),
        // Never ends: only the public server's end or a signal stops the daemon.
        None => (
            None,
            tokio::spawn(std::future::pending::<std::io::Result<()>>()),
        ),
    };
    // Which server ended on its own, if one did (its task is then finished).
    let (server_result, public_ended, admin_ended) = tokio::select! {
        signal = &mut signals => {
            tracing::info!(signal, "shutting down");
            (None, false, false)
        }
        res = &mut server_task => (Some(res), true, false),
        res = &mut admin_task => {
            tracing::error!("the admin listener stopped; shutting down");
            (Some(res), false, true)
        }
    };

    shared.shutting_down.store(true, Ordering::Relaxed);
    // Stop accepting on both listeners; requests in flight finish (they wait for their flush)
    // within the timeout.
    let stop_public = async {
        if let Some(early) = &early_handle {
            // Its deliveries in hand finish too (a stopped server's handle answers at once).
            early.stop(true).await;
        }
        if !public_ended {
            handle.stop(true).await;
            let _ = (&mut server_task).await;
        }
    };
    let stop_admin = async {
        match &admin_handle {
            Some(h) if !admin_ended => {
                h.stop(true).await;
                let _ = (&mut admin_task).await;
            }
            _ => admin_task.abort(),
        }
    };
    tokio::join!(stop_public, stop_admin);
    let _ = stop_tx.send(true);
    // A pass in progress is cut short: what it handed the writer is stored, the rest is found
    // again by the next start's passes.
    sweeper_task.abort();
    // A firing handed over as the dispatcher stops waits in the inbox for the next start.
    if tokio::time::timeout(config.server.shutdown_timeout, firer)
        .await
        .is_err()
    {
        tracing::warn!("timer firer did not stop in time; due timers fire on the next start");
    }
    if let Some(backfiller) = backfiller {
        // It stops at once: a pass in progress is dropped at its next await.
        let _ = backfiller.await;
    }
    if tokio::time::timeout(config.server.shutdown_timeout, dispatcher)
        .await
        .is_err()
    {
        tracing::warn!("dispatcher did not stop in time; its events stay in the inbox");
    }
    if tokio::time::timeout(config.server.shutdown_timeout, executor_task)
        .await
        .is_err()
    {
        tracing::warn!("executor did not stop in time; its entries stay in the outbox");
    }
    let _ = pruner.await;
    let _ = watcher.await;
    if let Some(reloader) = cert_reloader {
        let _ = reloader.await;
    }
    if let Some(embedded) = upstream.emulator {
        embedded.server.stop(true).await;
    }
    // Flush sled, so the next start has nothing to index again.
    let flushed = writer.flush().await;
    data.remove_daemon_info();
    match flushed {
        Ok(()) => tracing::info!("stopped cleanly"),
        Err(e) => {
            tracing::error!(error = %e, "final flush failed; the next start scans the event log's tail again")
        }
    }
    match server_result {
        Some(Ok(Err(e))) => Err(AppError::Server(e)),
        _ => Ok(()),
    }
}

/// The admin listener (`admin.listen`): the admin API, `/metrics` and the probes, with the
/// public server's limits, timeouts and body budget. `None` when `admin.listen` is empty (the admin API is
/// then served on `server.listen`). Bound here, run by the caller.
/// The writer's report of each group, as metrics.
fn observe_groups(metrics: &Metrics) -> crate::store::writer::Observe {
    let metrics = metrics.clone();
    Box::new(move |took, deliveries| {
        metrics.flush_seconds.observe(took.as_secs_f64());
        metrics.flush_writers.observe(deliveries as f64);
    })
}

/// Intake running before the store opens: the webhook tokens it checks, its handlers' state
/// (with the writer, attached to the store once open), the listening socket (the server takes
/// it over) and the early server.
struct EarlyIntake {
    tokens: (Vec<model::secret::Secret>, bool),
    intake: web::Data<crate::intake::Intake>,
    /// Taken by the server (the early server has its own handle on the socket).
    listener: Option<std::net::TcpListener>,
    handle: actix_web::dev::ServerHandle,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Debug builds only, for tests: hold the store's open while the file named by
/// `HANDOFF_BRIDGE_TEST_HOLD_STORE_OPEN` exists (at most a minute), as a long replay of sled's
/// log would, so a test can catch a start before its store is open.
#[cfg(debug_assertions)]
fn hold_store_open_for_tests() {
    let Some(path) = std::env::var_os("HANDOFF_BRIDGE_TEST_HOLD_STORE_OPEN") else {
        return;
    };
    let until = std::time::Instant::now() + Duration::from_secs(60);
    while std::path::Path::new(&path).exists() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl EarlyIntake {
    /// Stop the early server: what it has in hand is finished first.
    async fn stop(self) {
        self.handle.stop(true).await;
        let _ = self.task.await;
    }

    /// Serve the webhook on the public socket, bound here, with `intake` (whose writer has no
    /// store yet), and say so on stdout.
    fn start(
        config: &Config,
        public_tls: &crate::tls::PublicTls,
        (tokens, intake): (
            (Vec<model::secret::Secret>, bool),
            web::Data<crate::intake::Intake>,
        ),
        body_budget: web::Data<crate::body_budget::BodyBudget>,
        workers: usize,
    ) -> Result<EarlyIntake, AppError> {
        let addr = config.listen_addr();
        let listener = listen_on(addr)?;
        let server = early_server(
            config,
            listener.try_clone().map_err(|source| AppError::Bind {
                addr: addr.to_string(),
                source,
            })?,
            public_tls.server_config().map_err(AppError::Tls)?,
            intake.clone(),
            body_budget,
            workers,
        )?;
        let handle = server.handle();
        let task = tokio::spawn(server);
        let bound = listener.local_addr().map_or(addr, |a| a);
        tracing::info!(%bound, "taking webhook deliveries while the store opens");
        {
            // Machine-readable, like the `listening:` line that follows once started.
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stdout(),
                "accepting webhooks: {}://{bound}",
                public_tls.scheme()
            );
        }
        Ok(EarlyIntake {
            tokens,
            intake,
            listener: Some(listener),
            handle,
            task,
        })
    }
}

/// Bind the public listener's socket, as actix does (address reuse, a backlog of 1,024), so an
/// early server and the server after it can share it.
fn listen_on(addr: std::net::SocketAddr) -> Result<std::net::TcpListener, AppError> {
    use socket2::{Domain, Socket, Type};
    let bind = || {
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
        socket.set_reuse_address(true)?;
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        Ok::<_, std::io::Error>(std::net::TcpListener::from(socket))
    };
    bind().map_err(|source| AppError::Bind {
        addr: addr.to_string(),
        source,
    })
}

/// The public listener while the store opens: the webhook only (deliveries are logged and
/// answered; see `Writer::start_early`); every other path answers 503 `starting`.
fn early_server(
    config: &Config,
    listener: std::net::TcpListener,
    tls: Option<rustls::ServerConfig>,
    intake: web::Data<crate::intake::Intake>,
    body_budget: web::Data<crate::body_budget::BodyBudget>,
    workers: usize,
) -> Result<actix_web::dev::Server, AppError> {
    let webhook_path = config.webhook.path.clone();
    let server = HttpServer::new(move || {
        let path = webhook_path.clone();
        App::new()
            .wrap(actix_web::middleware::from_fn(crate::body_budget::limit))
            .app_data(body_budget.clone())
            .app_data(intake.clone())
            .configure(|cfg| crate::intake::routes(cfg, &path))
            .default_service(web::to(api_error::starting))
    })
    .workers(workers)
    .max_connections(config.server.max_connections)
    .client_request_timeout(config.server.client_request_timeout)
    // No connection outlives its delivery: none is open when the server takes over, which a
    // client could otherwise find closed under its next request.
    .keep_alive(actix_web::http::KeepAlive::Disabled)
    .shutdown_timeout(config.server.shutdown_timeout.as_secs().max(1))
    .disable_signals();
    let addr = listener
        .local_addr()
        .map_or_else(|_| "?".to_owned(), |a| a.to_string());
    let bound = match tls {
        None => server.listen(listener),
        Some(tls) => server.listen_rustls_0_23(listener, tls),
    };
    let server = bound.map_err(|source| AppError::Bind { addr, source })?;
    Ok(server.run())
}

fn admin_server(
    config: &Config,
    shared: &web::Data<Shared>,
    body_budget: web::Data<crate::body_budget::BodyBudget>,
) -> Result<Option<(actix_web::dev::Server, std::net::SocketAddr)>, AppError> {
    let Some(addr) = config.admin_listen_addr() else {
        return Ok(None);
    };
    let app_data = shared.clone();
    let server = HttpServer::new(move || {
        App::new()
            // The same budget as the public listener's: bodies in memory are counted together.
            .wrap(actix_web::middleware::from_fn(crate::body_budget::limit))
            .app_data(body_budget.clone())
            .app_data(app_data.clone())
            .app_data(api_error::query_config())
            .configure(crate::ops::probe_routes)
            .configure(crate::ops::admin_routes)
            .default_service(web::to(api_error::not_found))
    })
    // Operators' and Prometheus' calls: a couple of workers are plenty.
    .workers(2)
    .max_connections(config.server.max_connections)
    .client_request_timeout(config.server.client_request_timeout)
    .keep_alive(config.server.keep_alive)
    .shutdown_timeout(config.server.shutdown_timeout.as_secs().max(1))
    .disable_signals()
    .bind(addr)
    .map_err(|source| AppError::Bind {
        addr: addr.to_string(),
        source,
    })?;
    let bound = server.addrs().first().copied().unwrap_or(addr);
    Ok(Some((server.run(), bound)))
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
        if let Ok(bytes) = tokio::task::spawn_blocking(move || store.size_on_disk()).await {
            metrics
                .store_bytes
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
    }
}

/// The Open API client, and the emulator it talks to when the upstream is `embedded`.
struct Upstream {
    handle: upstream::handle::UpstreamHandle,
    emulator: Option<Embedded>,
}

struct Embedded {
    emulator: emulator::Emulator,
    addr: std::net::SocketAddr,
    server: actix_web::dev::ServerHandle,
}

/// The platform's trust (read only when a destination is `https://`) and the hook that counts
/// failed handshakes in `handoff_tls_failures_total`.
fn client_tls(
    config: &Config,
    metrics: &Metrics,
) -> (upstream::tls::Trust, upstream::tls::TlsObserver) {
    upstream::tls::install_provider();
    let https = std::iter::once(config.upstream.url.as_str())
        .chain(config.helpdesk.endpoints.iter().map(|e| e.url.expose()))
        .any(|url| {
            url.get(..8)
                .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
        });
    let trust = if https {
        upstream::tls::Trust::load()
    } else {
        upstream::tls::Trust::empty()
    };
    let failures = metrics.tls_failures.clone();
    let observer: upstream::tls::TlsObserver = Arc::new(move |destination, failure| {
        failures
            .with_label_values(&[destination, failure.reason.label()])
            .inc();
    });
    (trust, observer)
}

impl Upstream {
    fn start(
        config: &Config,
        metrics: &Metrics,
        trust: &upstream::tls::Trust,
        tls_observer: upstream::tls::TlsObserver,
    ) -> Result<Upstream, AppError> {
        use upstream::handle::{Endpoint, UpstreamHandle};
        let up = &config.upstream;
        let mut settings = up.client_settings().map_err(AppError::Upstream)?;
        let (base_url, emulator) = if up.is_embedded() {
            if settings.api_key.is_empty() {
                use rand::distr::{Alphanumeric, SampleString};
                settings.api_key =
                    model::secret::Secret::new(Alphanumeric.sample_string(&mut rand::rng(), 32));
            }
            let mut emu_config = emulator::EmulatorConfig::new(settings.api_key.clone());
            emu_config.auth_header = up.auth_header.clone();
            emu_config.auth_scheme = (!up.auth_scheme.is_empty()).then(|| up.auth_scheme.clone());
            emu_config.idempotency_header = up.idempotency_header.clone();
            let seed =
                emulator::Seed::default_seed().map_err(|e| AppError::Upstream(e.to_string()))?;
            let running = emulator::start_standalone("127.0.0.1:0", seed, emu_config)
                .map_err(|e| AppError::Upstream(e.to_string()))?;
            let addr = running
                .addrs
                .first()
                .copied()
                .ok_or_else(|| AppError::Upstream("emulator bound no address".into()))?;
            let server = running.server.handle();
            tokio::spawn(running.server);
            tracing::info!(%addr, "embedded Open API emulator started");
            (
                format!("http://{addr}"),
                Some(Embedded {
                    emulator: running.emulator,
                    addr,
                    server,
                }),
            )
        } else {
            (up.url.clone(), None)
        };
        let ca_file = if emulator.is_some() { "" } else { &up.ca_file };
        let tls = upstream::tls::ClientTls::new(trust, ca_file, "upstream", Some(tls_observer))
            .map_err(|e| AppError::Upstream(format!("upstream.ca_file: {e}")))?;
        let endpoint = Endpoint {
            base_url,
            connect_timeout: up.connect_timeout,
            request_timeout: up.request_timeout,
            tls,
        };
        let attempts = metrics.upstream_attempts.clone();
        let observer = upstream::client::AttemptObserver::new(move |endpoint, status| {
            attempts.with_label_values(&[endpoint, status]).inc();
        });
        let handle = UpstreamHandle::start(endpoint, settings, &up.limits, Some(observer))
            .map_err(AppError::Upstream)?;
        Ok(Upstream { handle, emulator })
    }
}
