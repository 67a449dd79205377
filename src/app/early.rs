//! The early start: the webhook served on the public socket while sled opens (every other path
//! answers 503 `starting`), and the sockets themselves.

use super::AppError;
use crate::body_budget::BodyBudget;
use crate::config::Config;
use crate::intake::Intake;
use actix_web::{web, App, HttpServer};
use model::secret::Secret;
use std::net::{SocketAddr, TcpListener};
#[cfg(debug_assertions)]
use std::time::Duration;

/// Intake running before the store opens: the webhook tokens it checks, its handlers' state
/// (with the writer, attached to the store once open), the listening socket (the server takes
/// it over) and the early server.
pub(super) struct EarlyIntake {
    pub(super) tokens: (Vec<Secret>, bool),
    pub(super) intake: web::Data<Intake>,
    /// Attaches the intake's writer to the store once it is open.
    pub(super) attach: storage::writer::EarlyAttach,
    /// Taken by the server (the early server has its own handle on the socket).
    pub(super) listener: Option<TcpListener>,
    pub(super) handle: actix_web::dev::ServerHandle,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Debug builds only, for tests: hold the store's open while the file named by
/// `HANDOFF_BRIDGE_TEST_HOLD_STORE_OPEN` exists (at most a minute), as a long replay of sled's
/// log would, so a test can catch a start before its store is open.
#[cfg(debug_assertions)]
pub(super) fn hold_store_open_for_tests() {
    let Some(path) = std::env::var_os("HANDOFF_BRIDGE_TEST_HOLD_STORE_OPEN") else {
        return;
    };
    let until = std::time::Instant::now() + Duration::from_secs(60);
    while std::path::Path::new(&path).exists() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What the early server is started with: its tokens and handler state, the shared body budget
/// and the number of workers.
pub(super) struct EarlyParts {
    pub(super) tokens: (Vec<Secret>, bool),
    pub(super) intake: web::Data<Intake>,
    pub(super) attach: storage::writer::EarlyAttach,
    pub(super) body_budget: web::Data<BodyBudget>,
    pub(super) workers: usize,
}

impl EarlyIntake {
    /// Stop the early server: what it has in hand is finished first.
    pub(super) async fn stop(self) {
        self.handle.stop(true).await;
        let _ = self.task.await;
    }

    /// Serve the webhook on the public socket `listener` with `parts.intake` (whose writer has
    /// no store yet).
    pub(super) fn start(
        config: &Config,
        tls: Option<rustls::ServerConfig>,
        listener: TcpListener,
        parts: EarlyParts,
    ) -> Result<EarlyIntake, AppError> {
        let addr = listener.local_addr().map_err(|source| AppError::Bind {
            addr: config.server.listen.clone(),
            source,
        })?;
        let server = early_server(
            config,
            listener.try_clone().map_err(|source| AppError::Bind {
                addr: addr.to_string(),
                source,
            })?,
            tls,
            parts.intake.clone(),
            parts.body_budget,
            parts.workers,
        )?;
        let handle = server.handle();
        let task = tokio::spawn(server);
        tracing::info!(bound = %addr, "taking webhook deliveries while the store opens");
        Ok(EarlyIntake {
            tokens: parts.tokens,
            intake: parts.intake,
            attach: parts.attach,
            listener: Some(listener),
            handle,
            task,
        })
    }
}

/// Bind a listener's socket, as actix does (address reuse, a backlog of 1,024), so an early
/// server and the server after it can share it.
pub fn listen_on(addr: SocketAddr) -> Result<TcpListener, AppError> {
    use socket2::{Domain, Socket, Type};
    let bind = || {
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
        socket.set_reuse_address(true)?;
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        Ok::<_, std::io::Error>(TcpListener::from(socket))
    };
    bind().map_err(|source| AppError::Bind {
        addr: addr.to_string(),
        source,
    })
}

/// The public listener while the store opens: the webhook only (deliveries are logged and
/// answered; see `SledWriter::start_early`); every other path answers 503 `starting`.
fn early_server(
    config: &Config,
    listener: TcpListener,
    tls: Option<rustls::ServerConfig>,
    intake: web::Data<Intake>,
    body_budget: web::Data<BodyBudget>,
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
