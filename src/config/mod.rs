//! Configuration: embedded defaults, then a TOML file, then `HANDOFF_BRIDGE_*` variables, then
//! flags. Validated once; every problem is reported together, with the key, the value and why.

pub mod chatwoot;
pub mod helpdesk;
pub mod legacy;
pub mod reconcile;
mod validate;

pub use helpdesk::{HelpdeskConfig, HelpdeskEndpoint};
pub use reconcile::ReconcileConfig;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The embedded defaults (every key the daemon reads).
pub const DEFAULTS: &str = include_str!("defaults.toml");

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    pub webhook: WebhookConfig,
    pub store: StoreConfig,
    pub dispatch: DispatchConfig,
    pub outbox: OutboxConfig,
    pub reconcile: ReconcileConfig,
    pub rules: RulesConfig,
    pub admin: AdminConfig,
    pub log: LogConfig,
    pub upstream: UpstreamConfig,
    pub helpdesk: HelpdeskConfig,
    pub backfill: BackfillConfig,
    pub cluster: ClusterConfig,
    /// Notes on old keys the configuration used ([`legacy`]), logged at start.
    #[serde(skip)]
    pub deprecated: Vec<String>,
}

/// Backfill: the service's events the webhook did not deliver, read back through the Open API
/// (`backfill`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BackfillConfig {
    /// A pass on start and then this often; `0` or `"off"` turns the periodic passes off (the
    /// admin API's `POST /admin/v1/backfill` still runs one).
    #[serde(with = "duration_or_off")]
    pub interval: Duration,
    /// Events the webhook has not delivered this long after they happened make the bridge say
    /// the webhook is silent (gauge, warn log, `/readyz` detail).
    #[serde(with = "humantime_serde")]
    pub silence_alert_after: Duration,
    /// Each pass reads from its cursor minus this (events delivered late, clocks apart).
    #[serde(with = "humantime_serde")]
    pub overlap: Duration,
    /// Open API reads per second a pass makes at most (its own limiter; never more than half of
    /// `upstream.limits.global`, whatever is set: the outbox's calls come first, a backlog drains
    /// after an outage while backfill reads the gap).
    pub per_second: f64,
}

/// Several nodes on one database (`cluster`): this node's name and the lease that makes one of
/// them the active one. Read only with a store several nodes can share.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// This node's name among the nodes (logs, `GET /admin/v1/cluster`, the console). Empty: the
    /// host name and a random suffix, new at each start.
    pub node_id: String,
    /// How long the active node's lease lasts; it is renewed every third of it, and a standby
    /// takes over within the lease and one renewal after the active stops renewing.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
}

/// A duration, or `"off"` for zero.
mod duration_or_off {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        humantime_serde::serialize(d, s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        if text.trim().eq_ignore_ascii_case("off") || text.trim() == "0" {
            return Ok(Duration::ZERO);
        }
        humantime::parse_duration(text.trim()).map_err(serde::de::Error::custom)
    }
}

/// Where the Open API is and how to call it.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// `embedded`, an `http://` / `https://` base address, or empty: the embedded emulator,
    /// unless an API key is configured (then the configuration is refused: production never
    /// silently gets the fake). Shown with its credentials masked ([`mask_url`]).
    #[serde(serialize_with = "serialize_masked_url")]
    pub url: String,
    /// A private CA (PEM, one or more certificates) trusted for an `https://` URL besides the
    /// platform's roots (`SSL_CERT_FILE` / `SSL_CERT_DIR` or the system store). Empty: none.
    pub ca_file: String,
    pub api_key: Secret,
    pub api_key_file: String,
    pub auth_header: String,
    pub auth_scheme: String,
    pub idempotency_header: String,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    pub limits: upstream::limits::LimitsConfig,
}

impl UpstreamConfig {
    /// The embedded emulator: asked for (`embedded`), or no URL (the first-run default; refused
    /// by `validate` when an API key is configured).
    pub fn is_embedded(&self) -> bool {
        self.url == "embedded" || self.url.is_empty()
    }

    /// `embedded` or `remote`, for `/readyz`, the `handoff_upstream_info` gauge and the banner.
    pub fn mode(&self) -> &'static str {
        if self.is_embedded() {
            "embedded"
        } else {
            "remote"
        }
    }

    /// The key from `api_key`, else from `api_key_file` (first line).
    /// Client settings from this configuration (the key resolved from env or file).
    pub fn client_settings(&self) -> Result<upstream::ClientSettings, String> {
        Ok(upstream::ClientSettings {
            auth_header: self.auth_header.clone(),
            auth_scheme: self.auth_scheme.clone(),
            api_key: self.resolve_api_key()?,
            idempotency_header: self.idempotency_header.clone(),
        })
    }

    pub fn resolve_api_key(&self) -> Result<Secret, String> {
        if !self.api_key.is_empty() || self.api_key_file.is_empty() {
            return Ok(self.api_key.clone());
        }
        let text = std::fs::read_to_string(&self.api_key_file)
            .map_err(|e| format!("upstream.api_key_file {}: {e}", self.api_key_file))?;
        Ok(Secret::new(text.lines().next().unwrap_or_default().trim()))
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Address to listen on; port 0 picks a free port (the bound address is printed).
    pub listen: String,
    /// HTTP worker threads; 0 means one per core.
    pub workers: usize,
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    /// Time a client has to send its request head.
    #[serde(with = "humantime_serde")]
    pub client_request_timeout: Duration,
    /// Time a client has to send the whole body (slow senders are cut off): the webhook's and
    /// the agent API's.
    #[serde(with = "humantime_serde")]
    pub body_read_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub keep_alive: Duration,
    /// Open connections per worker.
    pub max_connections: usize,
    /// Reverse proxies whose `X-Forwarded-For` (or `Forwarded`) names the client; empty: the
    /// headers are ignored and the TCP peer is the client (see `client_addr`).
    pub trusted_proxies: Vec<IpNet>,
    /// Which header a trusted proxy writes: `x-forwarded-for` or `forwarded` (RFC 7239).
    pub proxy_header: ProxyHeader,
    /// Request bodies held in memory at once, all connections together; over it a new body waits
    /// (at most `body_read_timeout`), then gets 503.
    pub max_inflight_body_bytes: usize,
    /// TLS for the public listener (both files, or neither: plain HTTP).
    pub tls: ServerTlsConfig,
}

/// The header trusted proxies append the client's address to. Only that one is read: a header
/// the proxy passes through untouched would be the client's own words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProxyHeader {
    XForwardedFor,
    Forwarded,
}

/// The public listener's certificate: PEM files, reloaded on SIGHUP.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerTlsConfig {
    /// The certificate chain, leaf first.
    pub cert_file: String,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: String,
}

impl ServerTlsConfig {
    pub fn enabled(&self) -> bool {
        !self.cert_file.is_empty() || !self.key_file.is_empty()
    }

    /// The certificate and key files, when TLS is on.
    pub fn files(&self) -> Option<(&Path, &Path)> {
        self.enabled()
            .then(|| (Path::new(&self.cert_file), Path::new(&self.key_file)))
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    /// Path prefix; the token is the last segment: `{path}/{token}`.
    pub path: String,
    /// Valid tokens; several at once allow rotation. Empty: one is generated on first start.
    pub tokens: Vec<Secret>,
    /// Source addresses allowed to deliver; empty allows any.
    pub allow_cidrs: Vec<IpNet>,
    pub max_body_bytes: usize,
    /// Events per delivery; a delivery with more is quarantined whole (`too_many_events`).
    pub max_events: usize,
    /// How far ahead of its receive time an event may be stamped; later ones are quarantined.
    #[serde(with = "humantime_serde")]
    pub max_clock_skew: Duration,
    /// How long event and delivery ids are remembered to drop re-sent deliveries.
    #[serde(with = "humantime_serde")]
    pub dedupe_retention: Duration,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// sled's store, and the daemon's own files (tokens, `daemon.json`) with any backend.
    pub data_dir: PathBuf,
    /// `postgres://user:password@host:port/database?sslmode=...`: the PostgreSQL store instead of
    /// sled (`HANDOFF_BRIDGE_STORE_URL`). A secret (its password): never shown.
    pub url: Secret,
    /// A file whose first line is `url` (the password kept out of the config).
    pub url_file: String,
    /// A private CA (PEM) trusted for the database's certificate besides the platform's roots
    /// (`sslmode=verify-ca` / `verify-full`; `sslrootcert` in the URL works too).
    pub ca_file: String,
    /// sled's page cache; bounds most of the daemon's memory.
    pub cache_capacity_bytes: u64,
    /// How long processed events stay in the event log.
    #[serde(with = "humantime_serde")]
    pub event_retention: Duration,
    #[serde(with = "humantime_serde")]
    pub prune_interval: Duration,
    /// How long a conversation's or end user's state is kept after its last activity
    /// (`store::retention`); zero (`"off"`): forever.
    #[serde(with = "duration_or_off")]
    pub state_retention: Duration,
    /// How long a quarantine record is kept after it was received; zero (`"off"`): until it is
    /// re-processed.
    #[serde(with = "duration_or_off")]
    pub quarantine_retention: Duration,
}

impl StoreConfig {
    /// The PostgreSQL store's URL: `url` (or its variable), else `url_file`'s first line;
    /// `None`: sled in `data_dir`.
    pub fn resolve_url(&self) -> Result<Option<Secret>, String> {
        if !self.url.is_empty() {
            return Ok(Some(self.url.clone()));
        }
        if self.url_file.is_empty() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&self.url_file)
            .map_err(|e| format!("store.url_file {}: {e}", self.url_file))?;
        let url = text.lines().next().unwrap_or_default().trim();
        Ok((!url.is_empty()).then(|| Secret::new(url)))
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DispatchConfig {
    /// Fold jobs in flight (folds themselves run one at a time).
    pub concurrency: usize,
    /// Events folded in one atomic write, across conversations.
    pub batch_size: usize,
    /// How the fold's threads and sled's I/O threads are scheduled. See `background`.
    pub fold_priority: FoldPriority,
    /// Their nice value under `fold_priority = "nice"` (0: the daemon's own).
    pub fold_niceness: u8,
    /// Under `fold_priority = "idle"`: a fold still running this long after it started waits
    /// for a CPU that other programs keep busy; the fold threads then run at the daemon's own
    /// priority until the inbox is empty (`background::Lift`). "off": never (a busy host can
    /// then hold handoffs back for as long as it stays busy).
    #[serde(with = "duration_or_off")]
    pub lift_after: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FoldPriority {
    /// Linux's `SCHED_IDLE`.
    Idle,
    /// `fold_niceness`.
    Nice,
}

impl DispatchConfig {
    /// `lift_after`, `None` when off.
    pub fn lift_after(&self) -> Option<Duration> {
        (!self.lift_after.is_zero()).then_some(self.lift_after)
    }

    pub fn priority(&self) -> crate::background::Priority {
        match self.fold_priority {
            FoldPriority::Idle => crate::background::Priority::Idle,
            FoldPriority::Nice => crate::background::Priority::Nice(self.fold_niceness),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OutboxConfig {
    /// Actions carried out at once (each from a different conversation or target).
    pub concurrency: usize,
    /// Above this many pending actions `/readyz` reports the outbox as backed up.
    pub max_depth: usize,
    /// Action names whose dead letter halts the rest of its conversation until retried/dropped.
    pub blocking: Vec<String>,
    /// How long the ledger remembers a finished action (done or dropped); at least
    /// `store.event_retention`, so a replay of any stored event still knows what already ran.
    #[serde(with = "humantime_serde")]
    pub audit_retention: Duration,
    /// A transient failure (connect, TLS handshake, timeout, 408, 425, 429, 5xx) never
    /// dead-letters before the entry has been failing this long (from its first failed attempt).
    #[serde(with = "humantime_serde")]
    pub give_up_after: Duration,
    /// Pending entries held in memory at most (half for the Open API, half for the help-desk
    /// events); the rest wait in the store and are read in order as room frees.
    pub window: usize,
    /// The one backoff policy, for both sinks.
    pub retry: crate::outbox::backoff::Backoff,
    /// The circuit breaker of each destination (`openapi`, `helpdesk:<endpoint>`).
    pub breaker: BreakerConfig,
}

/// `[outbox.breaker]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerConfig {
    /// Consecutive transient failures that open a destination's circuit.
    pub failures: u32,
    /// While open, at most one call (the probe) this often.
    #[serde(with = "humantime_serde")]
    pub probe_interval: Duration,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RulesConfig {
    /// Directory of rule files (`*.toml`, read in file-name order). Empty: the shipped agent
    /// handoff rules built into the binary (the files of the repository's `rules/`).
    pub dir: String,
    /// How often the directory is checked for changed files, which are then reloaded (as on
    /// SIGHUP or `POST /admin/v1/rules/reload`). 0 turns watching off.
    #[serde(with = "humantime_serde")]
    pub watch_interval: Duration,
    /// False: no rules at all (the bridge keeps state and takes no action).
    pub enabled: bool,
    /// Overrides of the rule files' `[settings]` (flows, texts, switches), by name.
    pub settings: toml::Table,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// The admin API's and `/metrics`' own listener; empty: served on `server.listen`.
    pub listen: String,
    /// Bearer token of the admin API. Empty: one is generated on first start.
    pub token: Secret,
    /// Source addresses allowed to call the admin API (loopback by default).
    pub allow_cidrs: Vec<IpNet>,
    /// Allow `POST /admin/v1/clock/advance`, which moves the daemon's time forward (timers,
    /// business hours, waits): for rehearsing a handoff and for tests, never in production.
    pub test_clock: bool,
    /// Tokens that sign in to the console (`/console/` on `admin.listen`) read-only: they see
    /// what an operator sees and change nothing. The admin token signs in as an operator.
    pub viewer_tokens: Vec<Secret>,
    /// How long a console sign-in lasts (then the browser signs in again).
    #[serde(with = "humantime_serde")]
    pub console_session: Duration,
    /// How long the console's audit list keeps an action (then the pruning pass drops it).
    #[serde(with = "humantime_serde")]
    pub console_audit_retention: Duration,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    pub format: LogFormat,
    /// Default filter when `RUST_LOG` is not set.
    pub level: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Human,
    Json,
}

pub use model::secret::Secret;

/// One thing wrong with the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub key: String,
    pub value: String,
    pub why: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} = {}: {}", self.key, self.value, self.why)
    }
}

/// Every problem found, or a file that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid TOML: {message}")]
    Syntax { path: String, message: String },
    #[error("invalid configuration:\n{}", .0.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Problem>),
}

/// Overrides given on the command line.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub listen: Option<String>,
    pub admin_listen: Option<String>,
    pub upstream: Option<String>,
    pub data_dir: Option<PathBuf>,
    /// Also read the files the config names (`server.tls`, `ca_file`s): `serve` and `check`
    /// only, so other commands work whatever those files hold ([`Config::validate_files`]).
    pub check_files: bool,
}

/// Named environment variables and the key each sets. Any key can also be set as
/// `HANDOFF_BRIDGE__SECTION__KEY`.
pub const ENV_KEYS: &[(&str, &str)] = &[
    ("HANDOFF_BRIDGE_LISTEN", "server.listen"),
    ("HANDOFF_BRIDGE_ADMIN_LISTEN", "admin.listen"),
    ("HANDOFF_BRIDGE_DATA_DIR", "store.data_dir"),
    ("HANDOFF_BRIDGE_STORE_URL", "store.url"),
    ("HANDOFF_BRIDGE_WEBHOOK_TOKENS", "webhook.tokens"),
    ("HANDOFF_BRIDGE_ADMIN_TOKEN", "admin.token"),
    ("HANDOFF_BRIDGE_LOG_FORMAT", "log.format"),
    ("HANDOFF_BRIDGE_LOG_LEVEL", "log.level"),
    ("HANDOFF_BRIDGE_UPSTREAM_URL", "upstream.url"),
    ("HANDOFF_BRIDGE_UPSTREAM_API_KEY", "upstream.api_key"),
    ("HANDOFF_BRIDGE_HELPDESK_TOKENS", "helpdesk.tokens"),
    (
        "HANDOFF_BRIDGE_CHATWOOT_API_TOKEN",
        "helpdesk.chatwoot.api_token",
    ),
    (
        "HANDOFF_BRIDGE_CHATWOOT_WEBHOOK_SECRET",
        "helpdesk.chatwoot.webhook_secret",
    ),
];

impl Config {
    /// Load from the process environment.
    pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
        Self::load_from(file, std::env::vars(), overrides)
    }

    /// Load with an explicit environment (tests).
    pub fn load_from(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        overrides: &Overrides,
    ) -> Result<Config, ConfigError> {
        let mut layers = Layers::embedded_defaults()?;
        if let Some(path) = file {
            layers.file(path)?;
        }
        layers.env(env);
        layers.flags(overrides);
        layers.finish(overrides.check_files)
    }

    /// Semantic checks, all at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Problems::default();
        validate::check_all(self, &mut problems);
        problems.into_result()
    }

    /// The files the config names, read: the public listener's certificate and key, and every
    /// `ca_file`. For `serve` and `check` ([`Overrides::check_files`]); the other commands never
    /// use them, so an unreadable key (readable only by the service's user) does not stop them.
    pub fn validate_files(&self) -> Result<(), ConfigError> {
        let mut problems = Problems::default();
        let mut bad =
            |key: &str, value: &dyn fmt::Display, why: &str| problems.add(key, value, why);
        let tls = &self.server.tls;
        if !tls.cert_file.is_empty() && !tls.key_file.is_empty() {
            if let Err(e) =
                crate::tls::load_certified_key(Path::new(&tls.cert_file), Path::new(&tls.key_file))
            {
                bad("server.tls", &tls.cert_file, &e);
            }
        }
        if let Err(e) = self.store.resolve_url() {
            bad("store.url_file", &self.store.url_file, &e);
        }
        if !self.store.ca_file.is_empty() {
            if let Err(e) = upstream::tls::read_ca_file(Path::new(&self.store.ca_file)) {
                bad("store.ca_file", &self.store.ca_file, &e);
            }
        }
        let up = &self.upstream;
        if !up.ca_file.is_empty() {
            if let Err(e) = upstream::tls::read_ca_file(Path::new(&up.ca_file)) {
                bad("upstream.ca_file", &up.ca_file, &e);
            }
        }
        for (i, ep) in self.helpdesk.endpoints.iter().enumerate() {
            if !ep.ca_file.is_empty() {
                if let Err(e) = upstream::tls::read_ca_file(Path::new(&ep.ca_file)) {
                    bad(&format!("helpdesk.endpoints[{i}].ca_file"), &ep.ca_file, &e);
                }
            }
        }
        let cw = &self.helpdesk.chatwoot;
        if cw.enabled() {
            if let Err(e) = cw.resolve_api_token() {
                bad("helpdesk.chatwoot.api_token_file", &cw.api_token_file, &e);
            }
            if let Err(e) = cw.resolve_webhook_secret() {
                bad(
                    "helpdesk.chatwoot.webhook_secret_file",
                    &cw.webhook_secret_file,
                    &e,
                );
            }
            if !cw.ca_file.is_empty() {
                if let Err(e) = upstream::tls::read_ca_file(Path::new(&cw.ca_file)) {
                    bad("helpdesk.chatwoot.ca_file", &cw.ca_file, &e);
                }
            }
        }
        problems.into_result()
    }

    pub fn listen_addr(&self) -> SocketAddr {
        // Validated in `validate`; the fallback is never reached for a loaded config.
        self.server
            .listen
            .parse()
            .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 8080)))
    }

    /// The admin listener's address; `None` when the admin API shares `server.listen`.
    pub fn admin_listen_addr(&self) -> Option<SocketAddr> {
        // Validated in `validate`, like `listen_addr`.
        self.admin.listen.parse().ok()
    }

    /// The effective configuration as TOML, secrets masked.
    pub fn to_masked_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }
}

/// The configuration being layered: the embedded defaults with each source merged on top, and
/// what the merging found so far.
struct Layers {
    /// The embedded defaults: every key there is, and its type.
    defaults: toml::Table,
    /// The defaults with the sources merged so far.
    merged: toml::Table,
    /// Keys and values rejected so far (not merged).
    problems: Vec<Problem>,
    /// Notes on old keys the sources used ([`legacy`]).
    deprecated: Vec<String>,
}

impl Layers {
    /// Start from the embedded defaults.
    fn embedded_defaults() -> Result<Self, ConfigError> {
        let defaults: toml::Table = toml::from_str(DEFAULTS).map_err(|e| ConfigError::Syntax {
            path: "<embedded defaults>".into(),
            message: e.to_string(),
        })?;
        Ok(Layers {
            merged: defaults.clone(),
            defaults,
            problems: Vec::new(),
            deprecated: Vec::new(),
        })
    }

    /// Merge the TOML file at `path`, its old keys rewritten first.
    fn file(&mut self, path: &Path) -> Result<(), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let mut table: toml::Table = toml::from_str(&text).map_err(|e| ConfigError::Syntax {
            path: path.display().to_string(),
            message: syntax_message(&text, &e),
        })?;
        legacy::rewrite(&mut table, &mut self.deprecated);
        merge(
            &mut self.merged,
            table,
            &self.defaults,
            "",
            &mut self.problems,
        );
        Ok(())
    }

    /// Set the keys the bridge's variables among `env` name; other variables are ignored.
    fn env(&mut self, env: impl IntoIterator<Item = (String, String)>) {
        for (name, value) in env {
            if let Some(key) = self.env_key(&name) {
                self.set(&key, &value, &format!("env {name}"));
            }
        }
    }

    /// The key variable `name` sets, an old key renamed (with a note); `None` when the variable
    /// is not the bridge's or its key is gone.
    fn env_key(&mut self, name: &str) -> Option<String> {
        let key = if let Some((_, key)) = ENV_KEYS.iter().find(|(n, _)| *n == name) {
            (*key).to_owned()
        } else {
            name.strip_prefix("HANDOFF_BRIDGE__")?
                .to_lowercase()
                .replace("__", ".")
        };
        match legacy::renamed(&key) {
            Some(new) => {
                self.deprecated.push(legacy::note(&key, new));
                new.map(str::to_owned)
            }
            None => Some(key),
        }
    }

    /// Set the keys the command line's flags give.
    fn flags(&mut self, overrides: &Overrides) {
        let data_dir = overrides.data_dir.as_ref().map(|d| d.display().to_string());
        let flags = [
            (&overrides.listen, "server.listen", "--listen"),
            (&overrides.admin_listen, "admin.listen", "--admin-listen"),
            (&overrides.upstream, "upstream.url", "--upstream"),
            (&data_dir, "store.data_dir", "--data-dir"),
        ];
        for (value, key, flag) in flags {
            if let Some(value) = value {
                self.set(key, value, flag);
            }
        }
    }

    /// Set dotted `key` from text, coerced to the default's type ([`set_path`]).
    fn set(&mut self, key: &str, text: &str, source: &str) {
        set_path(
            &mut self.merged,
            &self.defaults,
            key,
            text,
            source,
            &mut self.problems,
        );
    }

    /// The merged configuration, checked ([`Config::validate`], and the files it names when
    /// `check_files`); every problem of every layer together.
    fn finish(self, check_files: bool) -> Result<Config, ConfigError> {
        let Layers {
            merged,
            mut problems,
            deprecated,
            ..
        } = self;
        // Rejected values were not merged, so the table still has the right shape: check the
        // semantics too, and report everything together.
        let mut config: Config = match merged.try_into() {
            Ok(c) => c,
            Err(e) => {
                problems.push(Problem {
                    key: "(config)".into(),
                    value: String::new(),
                    why: scrub_secret_values(e.to_string().trim()),
                });
                return Err(ConfigError::Invalid(problems));
            }
        };
        if let Err(ConfigError::Invalid(more)) = config.validate() {
            problems.extend(more);
        }
        if check_files {
            if let Err(ConfigError::Invalid(more)) = config.validate_files() {
                problems.extend(more);
            }
        }
        if problems.is_empty() {
            // No URL and no API key: the first-run default, said explicitly from here on.
            if config.upstream.url.is_empty() {
                config.upstream.url = "embedded".into();
            }
            config.deprecated = deprecated;
            Ok(config)
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }
}

/// The one table whose keys are not known in advance (checked by the rule loader instead).
/// Tables whose keys are names the config does not know: rule settings, and the agent API's bots.
const FREE_FORM: &[&str] = &[
    "rules.settings",
    "helpdesk.partner.bots",
    "helpdesk.chatwoot.bots",
];

/// Deep-merge `src` into `dst`, checking each key and type against the defaults.
fn merge(
    dst: &mut toml::Table,
    src: toml::Table,
    defaults: &toml::Table,
    prefix: &str,
    problems: &mut Vec<Problem>,
) {
    for (key, value) in src {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        let Some(default) = defaults.get(&key) else {
            // Never its value: a mistyped key may be a secret's (`api_kye = "..."`).
            problems.push(Problem {
                value: "(not shown)".into(),
                key: path,
                why: "unknown key".into(),
            });
            continue;
        };
        match (value, default) {
            // Free-form: the names are the rule files' settings, checked when rules load.
            (toml::Value::Table(sub), toml::Value::Table(_))
                if FREE_FORM.contains(&path.as_str()) =>
            {
                dst.insert(key, toml::Value::Table(sub));
            }
            (toml::Value::Table(sub), toml::Value::Table(def_sub)) => {
                if let Some(toml::Value::Table(dst_sub)) = dst.get_mut(&key) {
                    merge(dst_sub, sub, def_sub, &path, problems);
                }
            }
            (value, default) if same_type(&value, default) => {
                dst.insert(key, value);
            }
            // `per_second = 50` means 50.0.
            (toml::Value::Integer(i), toml::Value::Float(_)) => {
                dst.insert(key, toml::Value::Float(i as f64));
            }
            (value, default) => problems.push(Problem {
                value: shown(&path, &value),
                key: path,
                why: format!(
                    "expected {}, found {}",
                    default.type_str(),
                    value.type_str()
                ),
            }),
        }
    }
}

/// Set a dotted key from a text value (env or flag), coerced to the default's type.
fn set_path(
    dst: &mut toml::Table,
    defaults: &toml::Table,
    key: &str,
    text: &str,
    source: &str,
    problems: &mut Vec<Problem>,
) {
    let parts: Vec<&str> = key.split('.').collect();
    let (Some((leaf, sections)), true) = (parts.split_last(), parts.len() >= 2) else {
        problems.push(Problem {
            key: key.into(),
            value: format!("({source})"),
            why: "unknown key".into(),
        });
        return;
    };
    let mut table = dst;
    let mut def = defaults;
    for section in sections {
        match (table.get_mut(*section), def.get(*section)) {
            (Some(toml::Value::Table(t)), Some(toml::Value::Table(d))) => {
                table = t;
                def = d;
            }
            _ => {
                problems.push(Problem {
                    key: key.into(),
                    value: format!("({source})"),
                    why: "unknown key".into(),
                });
                return;
            }
        }
    }
    if FREE_FORM.contains(&sections.join(".").as_str()) {
        // A setting from the environment: TOML if it parses (numbers, booleans), else text.
        let value = toml::from_str::<toml::Table>(&format!("v = {text}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(text.to_owned()));
        table.insert((*leaf).to_owned(), value);
        return;
    }
    let Some(default) = def.get(*leaf) else {
        problems.push(Problem {
            key: key.into(),
            value: format!("({source})"),
            why: "unknown key".into(),
        });
        return;
    };
    let value = match default {
        toml::Value::String(_) => Some(toml::Value::String(text.to_owned())),
        toml::Value::Integer(_) => text.trim().parse::<i64>().ok().map(toml::Value::Integer),
        toml::Value::Boolean(_) => text.trim().parse::<bool>().ok().map(toml::Value::Boolean),
        toml::Value::Float(_) => text.trim().parse::<f64>().ok().map(toml::Value::Float),
        toml::Value::Array(_) => Some(toml::Value::Array(
            text.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| toml::Value::String(s.to_owned()))
                .collect(),
        )),
        _ => None,
    };
    match value {
        Some(v) => {
            table.insert((*leaf).to_owned(), v);
        }
        None => problems.push(Problem {
            key: key.into(),
            value: if SECRET_KEYS.contains(&key) {
                format!("**** ({source})")
            } else {
                format!("{text:?} ({source})")
            },
            why: format!("expected {}", default.type_str()),
        }),
    }
}

/// Problems found by a check that reports every one of them.
#[derive(Default)]
struct Problems(Vec<Problem>);

impl Problems {
    fn add(&mut self, key: &str, value: &dyn fmt::Display, why: &str) {
        self.0.push(Problem {
            key: key.into(),
            value: value.to_string(),
            why: why.into(),
        });
    }

    fn into_result(self) -> Result<(), ConfigError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(self.0))
        }
    }
}

/// A TOML syntax error without the source line `toml` quotes (the line may hold a secret): its
/// place and its message.
fn syntax_message(text: &str, e: &toml::de::Error) -> String {
    let place = e.span().map(|span| {
        let before = &text.as_bytes()[..span.start.min(text.len())];
        let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
        let column = before.iter().rev().take_while(|&&b| b != b'\n').count() + 1;
        format!("line {line}, column {column}: ")
    });
    format!("{}{}", place.unwrap_or_default(), e.message().trim())
}

/// `url` with its credentials masked: the userinfo's password (`user:****@`) and the values of
/// query parameters whose name says secret (token, key, secret, password, auth, signature...).
/// Text that is not a URL is returned as is.
pub fn mask_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, tail) = rest
        .find(['/', '?', '#'])
        .map_or((rest, ""), |i| rest.split_at(i));
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{user}:****@{host}"),
            // A bare userinfo is a token as often as a user name.
            None => format!("****@{host}"),
        },
        None => authority.to_owned(),
    };
    let (before_fragment, fragment) = tail
        .split_once('#')
        .map_or((tail, None), |(a, f)| (a, Some(f)));
    let tail = match before_fragment.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((name, value)) if secret_name(name) && !value.is_empty() => {
                        format!("{name}=****")
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => before_fragment.to_owned(),
    };
    let fragment = fragment.map(|f| format!("#{f}")).unwrap_or_default();
    format!("{scheme}://{authority}{tail}{fragment}")
}

/// A query parameter name that carries a credential.
fn secret_name(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [
        "token",
        "key",
        "secret",
        "password",
        "passwd",
        "pwd",
        "auth",
        "signature",
        "sig",
        "credential",
        "session",
    ]
    .iter()
    .any(|word| name.contains(word))
}

fn serialize_masked_url<S: serde::Serializer>(url: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&mask_url(url))
}

fn same_type(a: &toml::Value, b: &toml::Value) -> bool {
    std::mem::discriminant(a) == std::mem::discriminant(b)
}

/// Keys whose values are never shown, even in error messages.
const SECRET_KEYS: &[&str] = &[
    "store.url",
    "webhook.tokens",
    "admin.token",
    "admin.viewer_tokens",
    "upstream.api_key",
    "helpdesk.endpoints",
    "helpdesk.tokens",
    "helpdesk.chatwoot.api_token",
    "helpdesk.chatwoot.webhook_secret",
    "helpdesk.chatwoot.unsigned_path_token",
];

/// A deserialization error quotes the value it could not take (`invalid type: string "...",
/// expected a sequence\nin `helpdesk.endpoints.secrets``): masked when the key it names is a
/// secret's, or when it names none.
fn scrub_secret_values(message: &str) -> String {
    let path = message
        .rsplit_once("in `")
        .and_then(|(_, rest)| rest.split_once('`'))
        .map(|(path, _)| path);
    let secret = path.is_none_or(|p| {
        SECRET_KEYS
            .iter()
            .any(|k| p == *k || p.starts_with(&format!("{k}.")) || p.starts_with(&format!("{k}[")))
    });
    if !secret {
        return message.to_owned();
    }
    let mut out = String::with_capacity(message.len());
    let mut quoted = false;
    for c in message.chars() {
        if c == '"' {
            if !quoted {
                out.push_str("\"****");
            } else {
                out.push('"');
            }
            quoted = !quoted;
        } else if !quoted {
            out.push(c);
        }
    }
    out
}

fn shown(path: &str, value: &toml::Value) -> String {
    // A secret's key, a key inside one, or a section holding one given as a value
    // (`upstream = "..."`).
    if SECRET_KEYS.iter().any(|k| {
        path == *k || path.starts_with(&format!("{k}.")) || k.starts_with(&format!("{path}."))
    }) {
        "****".into()
    } else {
        short(value)
    }
}

fn short(value: &toml::Value) -> String {
    let text = value.to_string();
    if text.len() > 60 {
        format!(
            "{}…",
            &text[..text.char_indices().nth(57).map_or(text.len(), |(i, _)| i)]
        )
    } else {
        text
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod secret_tests;
