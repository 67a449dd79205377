//! An emulator of the service's Open API (`docs/open-api-contract.md`), so the client, the bridge
//! and their tests can run against something that behaves like the service (state, errors,
//! idempotency, rate limits, outages) without the service.
//!
//! Use it in one of three ways:
//!
//! - in-process in a test: `test::init_service(App::new().configure(|c| emu.configure(c)))`;
//! - mounted into another `App` the same way (it adds the `/openapi` and `/_emulator` scopes);
//! - standalone: [`run_standalone`] or [`start_standalone`].
//!
//! `/openapi/*` needs the API key (default `Authorization: Bearer <key>`). `/_emulator/*` (journal,
//! faults, state, reset) needs **no key**: it is for tests and operators, so bind a standalone
//! emulator to loopback. The key is never logged, journaled or echoed.
//!
//! Rules the contract leaves open, as the emulator settles them:
//!
//! - Every success is 200. Objects are listed in seed order, then creation order; messages by
//!   `timestamp`, oldest first, in both message lists.
//! - Unknown query parameters, an empty text filter and a repeated parameter are 400
//!   `invalid_query`; a body that is not a JSON object is 400 `invalid_body`. Request bodies
//!   over 1 MiB are 400. The 9-button bound applies to the message's `buttons` and to each
//!   card's; a text is required (non-blank) only for `type: text`; a media `contentType` must be
//!   image, video, audio or link.
//! - `PUT .../navigation` to a flow or node the bot does not have is 400 `invalid_body`: 404 is
//!   kept for "the conversation does not exist". `visitCount` counts visits to that node.
//! - `PUT .../manual` mirrors the status into `context.manual.status`; setting the value it has
//!   changes nothing (`updatedAt` stays). Sending a message, navigation, params and a manual change
//!   bump the conversation's `updatedAt` (which the `from`/`to` filters of
//!   `GET /openapi/conversations` use).
//! - `POST /openapi/message` to an end user without a conversation is 409 `conflict`; "newest"
//!   means latest `createdAt`.
//! - `PUT /openapi/partnerbiz/.../conversation/{userKey}`: an explicit `null` clears `assignee` or
//!   `memo`; an absent field is left alone. Block, unblock and session removal do not change
//!   each other or `status`. Sending to a blocked user is 409 whether or not a session is active.
//! - Notifications: 404 for an unknown `senderKey` or template; 422 when the variable names are
//!   not exactly the template's; the recipient is not checked against channel users (it may be a
//!   phone number).
//! - An idempotency key is global (not per path): a repeat returns the first answer whatever the
//!   method, path or body. Every answer after authentication is stored, errors included; faulted
//!   and unauthorized calls are not, so their retry is a first attempt.
//! - Faults apply before authentication, to every `/openapi` call matching `path_prefix`. A
//!   dropped call answers 200 with `Content-Length: 4096`, sends a few bytes, then cuts the
//!   connection; awc 3 returns such a short body without an error, so a client should treat a
//!   2xx body that is not valid JSON as a transport failure.
//! - Admin calls (`/_emulator/*`) are not journaled. The webhook's changes are: a `WEBHOOK`
//!   entry (`webhook-disabled` after three failed deliveries within 30 minutes, `webhook-enabled`)
//!   with the reason in `body` (see `sender`).

mod faults;
mod http;
mod journal;
pub mod seed;
pub mod sender;
pub mod state;
pub mod validate;
pub mod webhook_status;

pub use faults::{Fault, FaultConfig};
pub use journal::JournalEntry;
pub use seed::{Seed, SeedError};
pub use state::EmulatorState;

use actix_web::http::header::HeaderName;
use actix_web::{web, App, HttpServer};
use faults::FaultState;
use journal::Journal;
use model::secret::Secret;
use model::webhook::model::Millis;
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// How the emulator authenticates, and its starting faults.
#[derive(Clone, Debug)]
pub struct EmulatorConfig {
    pub api_key: Secret,
    /// Header that carries the key (default `Authorization`).
    pub auth_header: String,
    /// Scheme before the key (default `Bearer`, compared case-insensitively); `None`: the header
    /// holds the bare key.
    pub auth_scheme: Option<String>,
    /// Default `Idempotency-Key`.
    pub idempotency_header: String,
    pub faults: FaultConfig,
    pub journal_capacity: usize,
    /// Idempotency keys remembered; past this the oldest are forgotten.
    pub idempotency_capacity: usize,
    /// The daemon's clock when embedded: the emulator's time follows its test clock.
    pub clock: model::clock::Clock,
}

impl EmulatorConfig {
    pub fn new(api_key: Secret) -> Self {
        EmulatorConfig {
            api_key,
            auth_header: "Authorization".to_owned(),
            auth_scheme: Some("Bearer".to_owned()),
            idempotency_header: "Idempotency-Key".to_owned(),
            faults: FaultConfig::default(),
            journal_capacity: journal::DEFAULT_CAPACITY,
            idempotency_capacity: 100_000,
            clock: model::clock::Clock::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EmulatorError {
    #[error(transparent)]
    Seed(#[from] SeedError),
    #[error("invalid emulator configuration: {0}")]
    Config(String),
    #[error("cannot listen on {listen}: {source}")]
    Bind {
        listen: String,
        source: std::io::Error,
    },
    #[error("the emulator's server failed: {0}")]
    Server(std::io::Error),
}

/// A handle to one emulator: cheap to clone, shared by every worker and by the test that drives
/// it.
#[derive(Clone)]
pub struct Emulator {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Emulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Emulator").finish_non_exhaustive()
    }
}

struct Inner {
    seed: Seed,
    auth: http::Auth,
    idempotency_header: HeaderName,
    /// State and idempotency records change together under one lock, so a key is checked and its
    /// answer stored atomically. Never held across an `.await`.
    core: Mutex<Core>,
    journal: Mutex<Journal>,
    faults: Mutex<FaultState>,
    clock: Clock,
}

struct Core {
    state: EmulatorState,
    idempotency: http::IdempotencyStore,
}

/// Wall time derived from a `tokio` instant, so tests under `tokio::time::pause()` see virtual
/// time in timestamps and the journal.
struct Clock {
    /// Unix µs at `start`.
    start_wall_us: i64,
    start: tokio::time::Instant,
    /// The daemon's clock, whose test-clock offset this one follows.
    daemon: model::clock::Clock,
}

impl Clock {
    fn new(daemon: model::clock::Clock) -> Self {
        let wall_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
        Clock {
            start_wall_us: wall_us,
            start: tokio::time::Instant::now(),
            daemon,
        }
    }

    /// Unix µs; includes the daemon's test-clock offset (`model::clock::Clock::advance`), so an embedded
    /// emulator's events move with the daemon's time.
    fn now_us(&self) -> i64 {
        let elapsed = i64::try_from(self.start.elapsed().as_micros()).unwrap_or(i64::MAX);
        self.start_wall_us
            .saturating_add(elapsed)
            .saturating_add(self.daemon.offset_millis().saturating_mul(1000))
    }

    /// [`now_us`](Self::now_us) in ms.
    fn now_ms(&self) -> Millis {
        self.now_us().div_euclid(1000)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not take the emulator down with it; the data stays usable.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Emulator {
    /// Checks the seed and the configuration. Call it inside the runtime that will drive it (the
    /// clock starts here).
    pub fn new(seed: Seed, config: EmulatorConfig) -> Result<Emulator, EmulatorError> {
        seed.validate()?;
        if config.api_key.is_empty() {
            return Err(EmulatorError::Config("the API key is empty".to_owned()));
        }
        let header = |name: &str, what: &str| {
            HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                EmulatorError::Config(format!("{what} {name:?} is not a valid header name"))
            })
        };
        let auth_header = header(&config.auth_header, "auth_header")?;
        let idempotency_header = header(&config.idempotency_header, "idempotency_header")?;
        if let Some(scheme) = &config.auth_scheme {
            if scheme.is_empty() || scheme.contains(char::is_whitespace) {
                return Err(EmulatorError::Config(format!(
                    "auth_scheme {scheme:?} must be one word"
                )));
            }
        }
        config.faults.validate().map_err(EmulatorError::Config)?;
        let state = EmulatorState::from_seed(&seed);
        Ok(Emulator {
            inner: Arc::new(Inner {
                seed,
                auth: http::Auth {
                    header: auth_header,
                    scheme: config.auth_scheme,
                    key: config.api_key,
                },
                idempotency_header,
                core: Mutex::new(Core {
                    state,
                    idempotency: http::IdempotencyStore::new(config.idempotency_capacity),
                }),
                journal: Mutex::new(Journal::new(config.journal_capacity)),
                faults: Mutex::new(FaultState::new(config.faults)),
                clock: Clock::new(config.clock),
            }),
        })
    }

    /// With the embedded default seed.
    pub fn with_default_seed(config: EmulatorConfig) -> Result<Emulator, EmulatorError> {
        Emulator::new(Seed::default_seed()?, config)
    }

    /// Registers `/openapi/*` and `/_emulator/*`, each a scope carrying this emulator as its
    /// data. Use as `App::new().configure(|cfg| emulator.configure(cfg))`.
    pub fn configure(&self, cfg: &mut web::ServiceConfig) {
        http::configure(self.clone(), cfg);
    }

    /// The emulator's clock, in Unix ms.
    pub fn now_ms(&self) -> Millis {
        self.inner.clock.now_ms()
    }

    /// [`now_ms`](Self::now_ms) in µs.
    pub fn now_us(&self) -> i64 {
        self.inner.clock.now_us()
    }

    pub fn journal(&self) -> Vec<JournalEntry> {
        lock(&self.inner.journal).entries()
    }

    /// A change of the webhook's state (disabled, enabled) in the journal: `method` `WEBHOOK`,
    /// `endpoint` the change, `body` why.
    pub fn journal_webhook(&self, at: Millis, change: &str, why: Value) {
        lock(&self.inner.journal).push(JournalEntry {
            seq: 0,
            at,
            at_us: at.saturating_mul(1000),
            method: "WEBHOOK".to_owned(),
            path: "/_emulator/webhook".to_owned(),
            query: String::new(),
            endpoint: Some(change.to_owned()),
            body: why,
            idempotency_key: None,
            status: 0,
            answer: Value::Null,
            replayed: false,
            fault: None,
        });
    }

    pub fn clear_journal(&self) {
        lock(&self.inner.journal).clear();
    }

    /// The fault configuration, with counters as they are now.
    pub fn faults(&self) -> FaultConfig {
        lock(&self.inner.faults).config().clone()
    }

    /// Replaces the fault configuration (counters and PRNG start afresh).
    pub fn set_faults(&self, faults: FaultConfig) -> Result<(), EmulatorError> {
        faults.validate().map_err(EmulatorError::Config)?;
        *lock(&self.inner.faults) = FaultState::new(faults);
        Ok(())
    }

    pub fn clear_faults(&self) {
        *lock(&self.inner.faults) = FaultState::new(FaultConfig::default());
    }

    /// The whole state as JSON (what `GET /_emulator/state` answers).
    pub fn state_snapshot(&self) -> Value {
        lock(&self.inner.core).state.snapshot()
    }

    /// Runs `f` on the state, under its lock (keep it short, and do not call the emulator from
    /// inside).
    pub fn with_state<R>(&self, f: impl FnOnce(&mut EmulatorState) -> R) -> R {
        f(&mut lock(&self.inner.core).state)
    }

    /// Back to the seed, and forgets idempotency keys. The journal and faults stay.
    pub fn reset(&self) {
        let mut core = lock(&self.inner.core);
        core.state = EmulatorState::from_seed(&self.inner.seed);
        core.idempotency.clear();
    }
}

/// A running standalone emulator.
pub struct Standalone {
    pub emulator: Emulator,
    /// The addresses actually bound (port 0 picks a free one).
    pub addrs: Vec<SocketAddr>,
    /// Await it to run until stopped; `handle()` stops it.
    pub server: actix_web::dev::Server,
}

/// Binds and starts the emulator's own HTTP server; must be called inside a Tokio runtime.
pub fn start_standalone(
    listen: &str,
    seed: Seed,
    config: EmulatorConfig,
) -> Result<Standalone, EmulatorError> {
    let emulator = Emulator::new(seed, config)?;
    let app_emulator = emulator.clone();
    let server = HttpServer::new(move || {
        let emu = app_emulator.clone();
        App::new()
            .configure(move |cfg| emu.configure(cfg))
            .default_service(web::to(api_error::not_found))
    })
    .workers(2)
    .bind(listen)
    .map_err(|source| EmulatorError::Bind {
        listen: listen.to_owned(),
        source,
    })?;
    let addrs = server.addrs();
    if addrs.iter().any(|a| !a.ip().is_loopback()) {
        tracing::warn!(
            ?addrs,
            "emulator listens beyond loopback; its /_emulator admin paths need no key"
        );
    }
    Ok(Standalone {
        emulator,
        addrs,
        server: server.run(),
    })
}

/// Runs a standalone emulator until the server stops (SIGINT or SIGTERM stop it gracefully).
pub async fn run_standalone(
    listen: &str,
    seed: Seed,
    api_key: Secret,
) -> Result<(), EmulatorError> {
    let running = start_standalone(listen, seed, EmulatorConfig::new(api_key))?;
    tracing::info!(addrs = ?running.addrs, "Open API emulator listening");
    running.server.await.map_err(EmulatorError::Server)
}
