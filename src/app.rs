//! Wiring: open the store, start the writer, dispatcher, executor, timer firer and pruner, serve
//! HTTP, and shut down in order (stop accepting, finish requests, stop firing timers and
//! dispatching, flush).

use crate::config::Config;
use crate::datadir::{DaemonInfo, DataDir, ADMIN_TOKEN_FILE, WEBHOOK_TOKEN_FILE};
use crate::dispatch::{self, DispatchHandle, DispatchSettings};
use crate::intake::auth::{CidrList, TokenSet};
use crate::ops::metrics::Metrics;
use crate::store::writer::WriterHooks;
use crate::store::{Store, StoreError, Writer};
use actix_web::{web, App, HttpServer};
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
    pub webhook_tokens: TokenSet,
    pub webhook_cidrs: CidrList,
    pub admin_tokens: TokenSet,
    pub admin_cidrs: CidrList,
    /// `admin.test_clock`: `POST /admin/v1/clock/advance` is served.
    pub test_clock: bool,
    pub max_body_bytes: usize,
    pub body_read_timeout: Duration,
    pub shutting_down: AtomicBool,
    /// The Open API client (owned by its own arbiter thread).
    pub upstream: crate::upstream::handle::UpstreamHandle,
    /// The in-process emulator when the upstream is `embedded`.
    pub emulator: Option<crate::emulator::Emulator>,
    /// The rules in force (also used by replay), and how to reload them.
    pub rules: crate::ops::reload::Reloader,
    /// The agent API (`/helpdesk/v1`).
    pub helpdesk: crate::helpdesk::api::Helpdesk,
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
    #[error("rules: {0}")]
    Rules(#[from] crate::rules::LoadError),
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
pub fn rule_set(config: &Config) -> Result<Option<crate::rules::RuleSet>, crate::rules::LoadError> {
    if !config.rules.enabled {
        return Ok(None);
    }
    let overrides = settings_overrides(config);
    if config.rules.dir.is_empty() {
        return crate::rules::RuleSet::from_sources_with(
            &crate::rules::shipped::sources(),
            &overrides,
        )
        .map(Some);
    }
    crate::rules::RuleSet::load_dir_with(std::path::Path::new(&config.rules.dir), &overrides)
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
) -> Result<Arc<dyn crate::actions::Decide>, crate::rules::LoadError> {
    let Some(set) = rule_set(config)? else {
        return Ok(Arc::new(crate::actions::NoRules));
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

/// Run the daemon until SIGTERM or SIGINT. Must run inside an actix system.
pub async fn serve(config: Config) -> Result<(), AppError> {
    let data = DataDir::new(&config.store.data_dir);
    let io_err = |source| AppError::DataDir {
        path: config.store.data_dir.display().to_string(),
        source,
    };
    let rules = crate::rules::live::LiveRules::new(load_rules(&config)?);
    data.create().map_err(io_err)?;
    // The store first: one that cannot be opened (in use, corrupt) stops the start before a
    // generated secret is written next to it.
    // Opened on a thread at the fold's priority: sled starts its I/O threads and its log flusher
    // from there (during recovery, or at the first write of its log), and they inherit it.
    let open = || {
        let store = Store::open(&data.store_path(), config.store.cache_capacity_bytes)?;
        store.start_io_threads()?;
        Ok::<_, AppError>(store)
    };
    let opened = crate::background::on_thread_at(config.dispatch.priority(), "store-open", open);
    let thread = |name| move |source| AppError::Thread { name, source };
    let store = opened.map_err(thread("store-open"))??;
    // The folds' commits hold sled's lock: they run at this thread's (the daemon's) priority.
    store
        .start_fold_committer()
        .map_err(thread("store-committer"))?;

    let (webhook_token, generated_webhook) = if config.webhook.tokens.is_empty() {
        let (t, generated) = data.secret(WEBHOOK_TOKEN_FILE).map_err(io_err)?;
        (vec![t], generated)
    } else {
        (config.webhook.tokens.clone(), false)
    };
    let admin_token = if config.admin.token.is_empty() {
        data.secret(ADMIN_TOKEN_FILE).map_err(io_err)?.0
    } else {
        config.admin.token.clone()
    };

    let metrics = Metrics::new()?;
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

    let (stop_tx, stop_rx) = watch::channel(false);
    let (trust, tls_observer) = client_tls(&config, &metrics);
    let upstream = Upstream::start(&config, &metrics, &trust, tls_observer.clone())?;
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
    let (executor, executor_task) = crate::outbox::start(
        store.clone(),
        crate::upstream::api::OpenApi::new(upstream.handle.clone()),
        std::sync::Arc::new(helpdesk),
        metrics.clone(),
        crate::outbox::ExecutorSettings {
            concurrency: config.outbox.concurrency,
            blocking: config.outbox.blocking.iter().cloned().collect(),
            max_depth: config.outbox.max_depth,
        },
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
        priority: config.dispatch.priority(),
    };
    let (dispatch, dispatcher) =
        dispatch::start(store.clone(), metrics.clone(), settings, stop_rx.clone())?;
    let flush_metrics = metrics.clone();
    let to_dispatch = dispatch.clone();
    let writer = Writer::start(
        store.clone(),
        WriterHooks {
            observe: Box::new(move |took, deliveries| {
                flush_metrics.flush_seconds.observe(took.as_secs_f64());
                flush_metrics.flush_writers.observe(deliveries as f64);
            }),
            durable: Box::new(move |events, log_end| to_dispatch.notify_events(events, log_end)),
        },
    )?;
    tokio::spawn(executor.clone().forward_decided(decided_rx, writer.clone()));
    // Overdue timers (due while the daemon was down) fire on its first pass.
    let firer = crate::timers::start(
        store.clone(),
        writer.clone(),
        metrics.clone(),
        stop_rx.clone(),
    );
    let pruner = tokio::spawn(prune_loop(
        store.clone(),
        writer.clone(),
        metrics.clone(),
        config.clone(),
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

    let helpdesk = crate::helpdesk::api::Helpdesk::new(config.helpdesk.clone(), verdicts, &metrics);
    let shared = web::Data::new(Shared {
        store: store.clone(),
        writer: writer.clone(),
        dispatch,
        executor,
        metrics,
        webhook_tokens: TokenSet::new(webhook_token.clone()),
        webhook_cidrs: CidrList::new(config.webhook.allow_cidrs.clone()),
        admin_tokens: TokenSet::new(vec![admin_token]),
        admin_cidrs: CidrList::new(config.admin.allow_cidrs.clone()),
        test_clock: config.admin.test_clock,
        max_body_bytes: config.webhook.max_body_bytes,
        body_read_timeout: config.server.body_read_timeout,
        shutting_down: AtomicBool::new(false),
        upstream: upstream.handle.clone(),
        emulator: upstream.emulator.as_ref().map(|e| e.emulator.clone()),
        rules: reloader,
        helpdesk,
    });

    let webhook_path = config.webhook.path.clone();
    let app_data = shared.clone();
    let workers = match config.server.workers {
        0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
        n => n,
    };
    let addr = config.listen_addr();
    let public_tls =
        crate::tls::server::PublicTls::from_config(&config.server.tls).map_err(AppError::Tls)?;
    let server = HttpServer::new(move || {
        let path = webhook_path.clone();
        App::new()
            .app_data(app_data.clone())
            .app_data(crate::http_error::query_config())
            .configure(|cfg| crate::intake::routes(cfg, &path))
            .configure(crate::ops::routes)
            .configure(crate::ops::admin::routes)
            .service(crate::helpdesk::api::scope())
            .default_service(web::to(crate::http_error::not_found))
    })
    .workers(workers)
    .max_connections(config.server.max_connections)
    .client_request_timeout(config.server.client_request_timeout)
    .keep_alive(config.server.keep_alive)
    .shutdown_timeout(config.server.shutdown_timeout.as_secs().max(1))
    .disable_signals();
    let bound_server = match public_tls.server_config().map_err(AppError::Tls)? {
        None => server.bind(addr),
        Some(tls) => server.bind_rustls_0_23(addr, tls),
    };
    let server = bound_server.map_err(|source| AppError::Bind {
        addr: addr.to_string(),
        source,
    })?;
    let scheme = public_tls.scheme();
    let cert_reloader = public_tls.spawn_reloader(shared.metrics.clone(), stop_rx.clone());
    let bound = server.addrs().first().copied().unwrap_or(addr);
    let server = server.run();
    let handle = server.handle();

    data.write_daemon_info(&DaemonInfo {
        pid: std::process::id(),
        listen: bound.to_string(),
    })
    .map_err(io_err)?;
    let token_shown = if generated_webhook {
        // First start with a generated token: show it once so it can be registered.
        webhook_token
            .first()
            .map_or("<token>".to_owned(), |t| t.expose().to_owned())
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
        crate::emulator::sender::start(
            embedded.emulator.clone(),
            crate::emulator::sender::SenderConfig {
                url,
                window: Duration::from_millis(50),
                tls: public_tls.loopback_client().map_err(AppError::Tls)?,
            },
        );
        println!("upstream: embedded emulator at http://{}", embedded.addr);
    }
    // Machine-readable start line on stdout, printed last: tests and scripts wait for it.
    {
        // A closed stdout must not stop the daemon (a panic here would).
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), "listening: {scheme}://{bound}");
    }
    tracing::info!(%bound, scheme, data_dir = %data.root().display(), "handoff-bridge started");

    let mut server_task = tokio::spawn(server);
    let server_result = tokio::select! {
        signal = shutdown_signal() => {
            tracing::info!(signal, "shutting down");
            None
        }
        res = &mut server_task => Some(res),
    };

    shared.shutting_down.store(true, Ordering::Relaxed);
    if server_result.is_none() {
        // Stop accepting; requests in flight finish (they wait for their flush) within the timeout.
        handle.stop(true).await;
        let _ = server_task.await;
    }
    let _ = stop_tx.send(true);
    // A firing handed over as the dispatcher stops waits in the inbox for the next start.
    if tokio::time::timeout(config.server.shutdown_timeout, firer)
        .await
        .is_err()
    {
        tracing::warn!("timer firer did not stop in time; due timers fire on the next start");
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

/// Wait for SIGTERM or SIGINT; returns which.
pub async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; stop with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

/// Retention: drop dedupe records and processed log entries past their windows.
async fn prune_loop(
    store: Store,
    writer: Writer,
    metrics: Metrics,
    config: Config,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(config.store.prune_interval);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        // Real time: the test clock must not make data look old enough to drop.
        let now = crate::clock::system_millis();
        let dedupe_before = now - millis(config.webhook.dedupe_retention);
        let events_before = now - millis(config.store.event_retention);
        let audit_before = now - millis(config.outbox.audit_retention);
        let answers_before = now - millis(config.helpdesk.idempotency_retention);
        // The folds' watermark, then a flush (the writer's: the one flusher): segments below
        // it go only once the folds before it are on disk.
        let fold_from = match store.fold_from() {
            Ok(at) => at,
            Err(e) => {
                tracing::warn!(error = %e, "prune failed");
                continue;
            }
        };
        if let Err(e) = writer.flush().await {
            tracing::warn!(error = %e, "prune skipped: the store did not flush");
            continue;
        }
        let store = store.clone();
        let pruning = move || {
            let pruned = store.prune_with(dedupe_before, events_before, fold_from)?;
            // Event pruning can lag its retention (it stops at an event still in the inbox): the
            // ledger outlives every stored event, so a replay of any
            // of them still knows what already ran.
            let oldest = store.oldest_event_received_at()?.unwrap_or(audit_before);
            let finished = store.prune_ledger(audit_before.min(oldest), 10_000)?;
            // Every old answer each round (10,000 at a time), so the tree cannot outgrow the
            // pruning however busy the agent API is.
            let mut answers = 0;
            loop {
                let removed = store.prune_idempotency(answers_before, 10_000)?;
                answers += removed;
                if removed < 10_000 {
                    break;
                }
            }
            if answers > 0 {
                tracing::debug!(answers, "pruned agent API idempotency records");
            }
            Ok::<_, crate::store::StoreError>((pruned, finished))
        };
        match tokio::task::spawn_blocking(pruning).await {
            Ok(Ok((p, (actions, records)))) => {
                metrics
                    .pruned
                    .with_label_values(&["actions"])
                    .inc_by(actions);
                metrics
                    .pruned
                    .with_label_values(&["finished"])
                    .inc_by(records);
                metrics
                    .pruned
                    .with_label_values(&["dedupe"])
                    .inc_by(p.dedupe_records);
                metrics
                    .pruned
                    .with_label_values(&["event_segments"])
                    .inc_by(p.event_segments);
                if p.dedupe_records + p.event_segments > 0 {
                    tracing::debug!(
                        dedupe = p.dedupe_records,
                        event_segments = p.event_segments,
                        "pruned"
                    );
                }
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "prune failed"),
            Err(e) => tracing::warn!(error = %e, "prune task failed"),
        }
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The Open API client, and the emulator it talks to when the upstream is `embedded`.
struct Upstream {
    handle: crate::upstream::handle::UpstreamHandle,
    emulator: Option<Embedded>,
}

struct Embedded {
    emulator: crate::emulator::Emulator,
    addr: std::net::SocketAddr,
    server: actix_web::dev::ServerHandle,
}

/// The platform's trust (read only when a destination is `https://`) and the hook that counts
/// failed handshakes in `handoff_tls_failures_total`.
fn client_tls(config: &Config, metrics: &Metrics) -> (crate::tls::Trust, crate::tls::TlsObserver) {
    crate::tls::install_provider();
    let https = std::iter::once(config.upstream.url.as_str())
        .chain(config.helpdesk.endpoints.iter().map(|e| e.url.expose()))
        .any(|url| {
            url.get(..8)
                .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
        });
    let trust = if https {
        crate::tls::Trust::load()
    } else {
        crate::tls::Trust::empty()
    };
    let failures = metrics.tls_failures.clone();
    let observer: crate::tls::TlsObserver = Arc::new(move |destination, failure| {
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
        trust: &crate::tls::Trust,
        tls_observer: crate::tls::TlsObserver,
    ) -> Result<Upstream, AppError> {
        use crate::upstream::handle::{Endpoint, UpstreamHandle};
        let up = &config.upstream;
        let mut settings = crate::upstream::settings(up).map_err(AppError::Upstream)?;
        let (base_url, emulator) = if up.is_embedded() {
            if settings.api_key.is_empty() {
                use rand::distr::{Alphanumeric, SampleString};
                settings.api_key =
                    crate::config::Secret::new(Alphanumeric.sample_string(&mut rand::rng(), 32));
            }
            let mut emu_config = crate::emulator::EmulatorConfig::new(settings.api_key.clone());
            emu_config.auth_header = up.auth_header.clone();
            emu_config.auth_scheme = (!up.auth_scheme.is_empty()).then(|| up.auth_scheme.clone());
            emu_config.idempotency_header = up.idempotency_header.clone();
            let seed = crate::emulator::Seed::default_seed()
                .map_err(|e| AppError::Upstream(e.to_string()))?;
            let running = crate::emulator::start_standalone("127.0.0.1:0", seed, emu_config)
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
        let tls = crate::tls::ClientTls::new(trust, ca_file, "upstream", Some(tls_observer))
            .map_err(|e| AppError::Upstream(format!("upstream.ca_file: {e}")))?;
        let endpoint = Endpoint {
            base_url,
            connect_timeout: up.connect_timeout,
            request_timeout: up.request_timeout,
            tls,
        };
        let attempts = metrics.upstream_attempts.clone();
        let observer = crate::upstream::client::AttemptObserver::new(move |endpoint, status| {
            attempts.with_label_values(&[endpoint, status]).inc();
        });
        let handle = UpstreamHandle::start(endpoint, settings, &up.limits, Some(observer))
            .map_err(AppError::Upstream)?;
        Ok(Upstream { handle, emulator })
    }
}
