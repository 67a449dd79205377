//! Operations endpoints: liveness, readiness, metrics, and the admin API.

pub mod admin;
pub mod metrics;
pub mod outbox_admin;
pub mod reload;

use crate::app::Shared;
use actix_web::{web, HttpResponse};
use serde_json::json;
use std::sync::atomic::Ordering;

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/healthz", web::get().to(healthz))
        .route("/readyz", web::get().to(readyz))
        .route("/metrics", web::get().to(metrics));
}

/// Alive: the process answers.
async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "ok"}))
}

/// Ready: the store is open and its last flush worked, and the daemon is not shutting down.
async fn readyz(shared: web::Data<Shared>) -> HttpResponse {
    let store_ok = shared.writer.is_healthy();
    let stopping = shared.shutting_down.load(Ordering::Relaxed);
    let outbox_ok = !shared.executor.backed_up();
    let ready = store_ok && !stopping && outbox_ok;
    let body = json!({
        "status": if ready { "ready" } else { "not_ready" },
        "checks": {
            "store": if store_ok { "ok" } else { "failing" },
            "shutting_down": stopping,
            "inbox_depth": shared.metrics.inbox_depth.get(),
            "outbox": if outbox_ok { "ok" } else { "backed_up" },
            "outbox_depth": shared.executor.depth(),
            "outbox_paused": shared.executor.is_paused(),
            "dispatch_paused": shared.dispatch.is_paused(),
            "rules_version": shared.rules.live.current().version(),
            "upstream": {
                "mode": if shared.emulator.is_some() { "embedded" } else { "remote" },
            },
        }
    });
    if ready {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::ServiceUnavailable().json(body)
    }
}

async fn metrics(shared: web::Data<Shared>) -> HttpResponse {
    let m = &shared.metrics;
    m.store_bytes
        .set(i64::try_from(shared.store.size_on_disk()).unwrap_or(i64::MAX));
    m.dispatch_paused
        .set(i64::from(shared.dispatch.is_paused()));
    m.outbox_paused.set(i64::from(shared.executor.is_paused()));
    // The waiting queue is read from the store at each scrape: the folds keep it, so the gauges
    // are exact at any moment, right after a restart too, with no bookkeeping of their own.
    match shared.store.queue_summary() {
        Ok(q) => {
            m.queue_waiting
                .set(i64::try_from(q.waiting).unwrap_or(i64::MAX));
            let age = q.oldest_since.map_or(0.0, |since| {
                (crate::clock::now_millis() - since).max(0) as f64 / 1000.0
            });
            m.queue_oldest_wait_seconds.set(age);
        }
        Err(e) => tracing::warn!(error = %e, "reading the waiting queue for metrics failed"),
    }
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(shared.metrics.render())
}
