//! The upstream the daemon talks to: the Open API client on its own thread, and the embedded
//! emulator when `upstream.mode` is `embedded`; the clients' TLS trust.

use super::AppError;
use crate::config::Config;
use crate::ops::metrics::Metrics;
use std::sync::Arc;

/// The Open API client, and the emulator it talks to when the upstream is `embedded`.
pub(super) struct Upstream {
    pub(super) handle: upstream::handle::UpstreamHandle,
    pub(super) emulator: Option<Embedded>,
}

pub(super) struct Embedded {
    pub(super) emulator: emulator::Emulator,
    pub(super) addr: std::net::SocketAddr,
    pub(super) server: actix_web::dev::ServerHandle,
}

/// The platform's trust (read only when a destination is `https://`) and the hook that counts
/// failed handshakes in `handoff_tls_failures_total`.
pub(super) fn client_tls(
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
    pub(super) fn start(
        config: &Config,
        metrics: &Metrics,
        clock: &model::clock::Clock,
        (trust, tls_observer): (&upstream::tls::Trust, upstream::tls::TlsObserver),
    ) -> Result<Upstream, AppError> {
        use upstream::handle::{Remote, UpstreamHandle};
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
            emu_config.clock = clock.clone();
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
        let endpoint = Remote {
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
