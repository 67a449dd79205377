//! The two HTTP servers once the store is open: the public one (webhook, agent API, probes, and
//! the admin API when it has no listener of its own) and the admin listener.

use super::AppError;
use crate::body_budget::BodyBudget;
use crate::config::Config;
use crate::intake::Intake;
use crate::ops::Ops;
use actix_web::{web, App, HttpServer};
use std::net::{SocketAddr, TcpListener};

/// The public server's handler states and the budget every listener shares.
pub(super) struct PublicData {
    pub(super) shared: web::Data<Ops>,
    pub(super) agent_api: web::Data<crate::helpdesk::agent_api::AgentApi>,
    /// Chatwoot's webhook, when the connector is configured.
    pub(super) chatwoot: Option<web::Data<crate::helpdesk::chatwoot::webhook::ChatwootHook>>,
    pub(super) intake: web::Data<Intake>,
    pub(super) body_budget: web::Data<BodyBudget>,
}

/// The public server on `listener` (over TLS when `tls` is given), not yet running. With
/// `admin.listen` empty the admin API and /metrics are served here.
pub(super) fn public_server(
    config: &Config,
    workers: usize,
    data: PublicData,
    listener: TcpListener,
    tls: Option<rustls::ServerConfig>,
) -> Result<actix_web::dev::Server, AppError> {
    let webhook_path = config.webhook.path.clone();
    let admin_here = config.admin_listen_addr().is_none();
    let PublicData {
        shared,
        agent_api,
        chatwoot,
        intake,
        body_budget,
    } = data;
    let server = HttpServer::new(move || {
        let path = webhook_path.clone();
        App::new()
            .wrap(actix_web::middleware::from_fn(crate::body_budget::limit))
            .app_data(body_budget.clone())
            .app_data(shared.clone())
            .app_data(agent_api.clone())
            .app_data(intake.clone())
            .app_data(api_error::query_config())
            .configure(|cfg| crate::intake::routes(cfg, &path))
            .configure(crate::ops::probe_routes)
            .configure(|cfg| {
                if admin_here {
                    crate::ops::admin_routes(cfg);
                }
            })
            .service(crate::helpdesk::agent_api::scope())
            .configure(|cfg| {
                if let Some(hook) = &chatwoot {
                    cfg.app_data(hook.clone());
                    crate::helpdesk::chatwoot::webhook::routes(cfg);
                }
            })
            .default_service(web::to(api_error::not_found))
    })
    .workers(workers)
    .max_connections(config.server.max_connections)
    .client_request_timeout(config.server.client_request_timeout)
    .keep_alive(config.server.keep_alive)
    .shutdown_timeout(config.server.shutdown_timeout.as_secs().max(1))
    .disable_signals();
    let addr = listener
        .local_addr()
        .map_or_else(|_| config.server.listen.clone(), |a| a.to_string());
    let bound = match tls {
        None => server.listen(listener),
        Some(tls) => server.listen_rustls_0_23(listener, tls),
    };
    bound
        .map(|server| server.run())
        .map_err(|source| AppError::Bind { addr, source })
}

/// The admin listener (`admin.listen`) on its socket: the admin API, `/metrics` and the probes,
/// with the public server's limits, timeouts and body budget. Not yet running.
pub(super) fn admin_server(
    config: &Config,
    shared: &web::Data<Ops>,
    console: web::Data<crate::console::Console>,
    body_budget: web::Data<BodyBudget>,
    listener: TcpListener,
) -> Result<(actix_web::dev::Server, SocketAddr), AppError> {
    let app_data = shared.clone();
    let addr = listener.local_addr().map_err(|source| AppError::Bind {
        addr: config.admin.listen.clone(),
        source,
    })?;
    let server = HttpServer::new(move || {
        App::new()
            // The same budget as the public listener's: bodies in memory are counted together.
            .wrap(actix_web::middleware::from_fn(crate::body_budget::limit))
            .app_data(body_budget.clone())
            .app_data(app_data.clone())
            .app_data(console.clone())
            .app_data(api_error::query_config())
            .configure(crate::ops::probe_routes)
            .configure(crate::ops::admin_routes)
            // The console: on the admin listener only, never the public one.
            .configure(crate::console::routes)
            .default_service(web::to(api_error::not_found))
    })
    // Operators' and Prometheus' calls: a couple of workers are plenty.
    .workers(2)
    .max_connections(config.server.max_connections)
    .client_request_timeout(config.server.client_request_timeout)
    .keep_alive(config.server.keep_alive)
    .shutdown_timeout(config.server.shutdown_timeout.as_secs().max(1))
    .disable_signals()
    .listen(listener)
    .map_err(|source| AppError::Bind {
        addr: addr.to_string(),
        source,
    })?;
    Ok((server.run(), addr))
}
