//! Operations endpoints: liveness, readiness, metrics, and the admin API.

pub mod admin;
pub(crate) mod asks;
pub mod metrics;
pub mod outbox_admin;
pub mod prune_admin;
mod reading;
pub mod reconcile_admin;
pub mod reload;

use actix_web::{web, HttpResponse};
use serde_json::json;
use std::sync::atomic::Ordering;

/// The ops surface's handler state (probes, `/metrics`, the admin API): what its handlers read
/// and steer.
pub struct Ops {
    pub store: storage::Store,
    pub writer: storage::Writer,
    pub dispatch: crate::dispatch::DispatchHandle,
    pub executor: crate::outbox::ExecutorHandle,
    pub metrics: metrics::Metrics,
    /// The webhook's intake (its handlers' own state, also served before the store opens).
    pub intake: web::Data<crate::intake::Intake>,
    pub admin_tokens: crate::intake::auth::TokenSet,
    pub admin_cidrs: crate::intake::auth::CidrList,
    /// `server.trusted_proxies`: who may name the client (see `client_addr`).
    pub proxies: crate::client_addr::Proxies,
    /// `admin.test_clock`: `POST /admin/v1/clock/advance` is served.
    pub test_clock: bool,
    pub shutting_down: std::sync::atomic::AtomicBool,
    /// The in-process emulator when the upstream is `embedded`.
    pub emulator: Option<emulator::Emulator>,
    /// The rules in force (also used by replay), and how to reload them.
    pub rules: reload::Reloader,
    /// The reconciliation sweeper (`POST /admin/v1/reconcile`).
    pub reconcile: crate::reconcile::Sweeper,
    /// Backfill's passes (periodic, and `POST /admin/v1/backfill`) and the webhook's silence.
    pub backfill: crate::backfill::Backfill,
    /// The pruning passes (periodic, and `POST /admin/v1/prune`).
    pub pruner: crate::prune::Pruner,
    /// The Chatwoot connector, when configured: its health (`/readyz` detail, the console).
    pub chatwoot: Option<crate::helpdesk::chatwoot::ChatwootView>,
    /// This node among the nodes on the store: its role, the lease (`GET /admin/v1/cluster`).
    pub cluster: crate::cluster::Cluster,
}

impl Ops {
    /// The webhook's checks for a body received (or re-processed) at `now`.
    pub fn webhook_checks(&self, now: i64) -> model::webhook::Checks {
        self.intake.checks(now)
    }
}

/// The probes, served on both listeners (a probe may use either).
pub fn probe_routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/healthz", web::get().to(healthz))
        .route("/readyz", web::get().to(readyz));
}

/// What only the admin listener serves (`admin.listen`), or the public one when that is empty:
/// `/metrics` (unauthenticated, Prometheus's convention) and the admin API.
pub fn admin_routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/metrics", web::get().to(metrics));
    let scope = outbox_admin::routes(web::scope(admin::PREFIX));
    let scope = reconcile_admin::routes(scope);
    let scope = prune_admin::routes(scope);
    let scope = asks::routes(scope);
    admin::routes(cfg, scope);
}

/// Alive: the process answers.
async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "ok"}))
}

/// Ready: the store is open and its last flush worked, and the daemon is not shutting down.
/// What waits downstream (a deep outbox, an open circuit, a silent webhook) is detail only: a
/// bridge taken out of rotation would answer the service's deliveries with errors, and the
/// service disables a webhook after three of them, which loses far more than a slow outbox.
async fn readyz(shared: web::Data<Ops>) -> HttpResponse {
    let h = health(&shared);
    // Every node that can accept is ready, the active one and those standing by alike.
    let ready = h.store_ok && !h.stopping;
    let outbox_depth = outbox_depth(&shared).await;
    let body = json!({
        "status": if ready { "ready" } else { "not_ready" },
        "checks": {
            "store": if h.store_ok { "ok" } else { "failing" },
            "shutting_down": h.stopping,
            "inbox_depth": shared.metrics.inbox_depth.get(),
            "outbox": if h.outbox_backed_up { "backed_up" } else { "ok" },
            "outbox_depth": outbox_depth,
            "outbox_paused": h.outbox_paused,
            // Detail only, never a reason for 503: a bridge taken out of rotation while the
            // upstream is down would get the service to disable its webhook.
            "circuits": shared.executor.circuits(),
            "dispatch_paused": h.dispatch_paused,
            "rules_version": shared.rules.live.current().version(),
            "upstream": {
                "mode": h.upstream_mode,
            },
            // Detail only: a silent webhook is never a reason for 503.
            "webhook": shared.backfill.watch().detail(),
            // Detail only: a desk that is down never stops intake.
            "desks": desks(&shared),
            // Detail only: a standby takes intake as the active one does.
            "cluster": {
                "node_id": shared.cluster.node_id(),
                "role": shared.cluster.role(),
            },
        }
    });
    if ready {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::ServiceUnavailable().json(body)
    }
}

/// Each connector's state as its calls found it (`ok`, `unauthorized`, `unreachable`,
/// `circuit open`...): detail for `/readyz` and the console.
pub(crate) fn desks(shared: &Ops) -> serde_json::Map<String, serde_json::Value> {
    let mut out = serde_json::Map::new();
    if let Some(cw) = &shared.chatwoot {
        let name = crate::helpdesk::chatwoot::client::NAME;
        let status = cw.health.status(shared.executor.circuit_open(name));
        out.insert(name.to_owned(), json!(status));
    }
    out
}

/// Pending outbox entries: this node's executor's count, or, with several nodes on the store,
/// the store's (another node may carry it out).
pub(crate) async fn outbox_depth(shared: &Ops) -> usize {
    if !shared.cluster.shared() {
        return shared.executor.depth();
    }
    let store = shared.store.clone();
    let read = web::block(move || store.outbox_len()).await;
    read.ok().and_then(Result::ok).unwrap_or(0)
}

/// Several nodes on one store: the gauges of the store's counts that the folds and the
/// executor keep in this process (stale on a standby, short of the others' intake on the
/// active) read from the store at the scrape instead.
async fn store_gauges(shared: &Ops) {
    let store = shared.store.clone();
    let read = web::block(move || {
        let sizes = store.sizes()?;
        Ok::<_, storage::StoreError>((sizes, store.timers_pending()?, store.outbox_len()?))
    })
    .await;
    let m = &shared.metrics;
    match read {
        Ok(Ok((sizes, timers, outbox))) => {
            for (kind, count) in [
                ("conversations", sizes.conversations),
                ("end_users", sizes.end_users),
                ("bots", sizes.bots),
            ] {
                let count = i64::try_from(count).unwrap_or(i64::MAX);
                m.state_entries.with_label_values(&[kind]).set(count);
            }
            m.quarantine_entries
                .set(i64::try_from(sizes.quarantine).unwrap_or(i64::MAX));
            m.timers_pending
                .set(i64::try_from(timers).unwrap_or(i64::MAX));
            m.outbox_depth
                .set(i64::try_from(outbox).unwrap_or(i64::MAX));
        }
        Ok(Err(e)) => tracing::warn!(error = %e, "cannot read the store's counts"),
        Err(_) => {}
    }
}

/// The daemon's health as the probes see it (`/readyz`, the console's overview).
pub(crate) struct Health {
    /// The store is open and its last flush worked.
    pub store_ok: bool,
    pub stopping: bool,
    /// More outbox entries pending than `outbox.max_depth`.
    pub outbox_backed_up: bool,
    pub outbox_paused: bool,
    pub dispatch_paused: bool,
    /// `embedded` or `remote`.
    pub upstream_mode: &'static str,
    /// The webhook has been silent long enough that backfill reads the Open API.
    pub webhook_silent: bool,
}

pub(crate) fn health(shared: &Ops) -> Health {
    Health {
        store_ok: shared.writer.is_healthy(),
        stopping: shared.shutting_down.load(Ordering::Relaxed),
        outbox_backed_up: shared.executor.backed_up(),
        outbox_paused: shared.executor.is_paused(),
        dispatch_paused: shared.dispatch.is_paused(),
        upstream_mode: if shared.emulator.is_some() {
            "embedded"
        } else {
            "remote"
        },
        webhook_silent: shared.backfill.watch().is_silent(),
    }
}

/// A scrape reads gauges only: no store scan, no directory walk. The store keeps the waiting
/// queue's counts as folds change it, and the store size is refreshed by a periodic task
/// (`app::store_size_loop`); with several nodes, the record counts too are read from the store
/// (kept counts, no scan).
async fn metrics(shared: web::Data<Ops>) -> HttpResponse {
    if shared.cluster.shared() {
        store_gauges(&shared).await;
    }
    let m = &shared.metrics;
    m.dispatch_paused
        .set(i64::from(shared.dispatch.is_paused()));
    m.outbox_paused.set(i64::from(shared.executor.is_paused()));
    match shared.store.queue_summary() {
        Ok(q) => {
            m.queue_waiting
                .set(i64::try_from(q.waiting).unwrap_or(i64::MAX));
            // The age on the daemon's clock (the test clock included) at the scrape.
            let age = q.oldest_since.map_or(0.0, |since| {
                (shared.store.clock().now_millis() - since).max(0) as f64 / 1000.0
            });
            m.queue_oldest_wait_seconds.set(age);
        }
        Err(e) => tracing::warn!(error = %e, "cannot read the waiting queue's counts"),
    }
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(shared.metrics.render())
}
