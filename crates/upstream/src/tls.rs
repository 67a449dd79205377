//! TLS with rustls and the ring provider: the client trust of the Open API client and the
//! help-desk sender (the platform's roots, honouring `SSL_CERT_FILE` / `SSL_CERT_DIR`, plus a
//! private CA per destination), the typed reasons a handshake fails for, and the public
//! listener's certificate (`server`: served over TLS, reloaded on SIGHUP).

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::{ClientConfig, RootCertStore};
use std::path::Path;
use std::sync::Arc;

/// The one crypto provider: ring (see Cargo.toml). Every config names it explicitly.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Install ring as the process-wide default too, for any code that builds a config without
/// naming a provider. Idempotent.
pub fn install_provider() {
    // Err: a default is installed already (this process did it before).
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The certificates of a PEM file (one or more). A missing file, one that does not parse, or
/// one without a certificate is an error naming why (never the file's contents).
pub fn read_ca_file(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read: {e}"))?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not PEM certificates: {e}"))?;
    if certs.is_empty() {
        return Err("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into());
    }
    Ok(certs)
}

/// Trust shared by every TLS client of the daemon: the platform's roots, loaded once (reading
/// them can take a while). Each destination adds its own private CA to a copy.
#[derive(Clone)]
pub struct Trust {
    platform: Arc<RootCertStore>,
}

impl Trust {
    /// The platform's roots as OpenSSL-based tools find them: `SSL_CERT_FILE` and/or
    /// `SSL_CERT_DIR` when set (then only those), else the system store. Problems are logged, not
    /// fatal: a destination with a private CA needs no system roots.
    pub fn load() -> Trust {
        let found = rustls_native_certs::load_native_certs();
        for e in &found.errors {
            tracing::warn!(error = %e, "cannot read some of the platform's trusted certificates");
        }
        let mut store = RootCertStore::empty();
        let (added, ignored) = store.add_parsable_certificates(found.certs);
        if ignored > 0 {
            tracing::warn!(
                ignored,
                "some of the platform's trusted certificates could not be parsed"
            );
        }
        if added == 0 {
            tracing::warn!("no trusted root certificate found on this system: an https destination needs its ca_file (or SSL_CERT_FILE)");
        }
        tracing::debug!(roots = added, "platform trust loaded");
        Trust {
            platform: Arc::new(store),
        }
    }

    /// No platform roots at all (tests; a client that trusts only its private CA).
    pub fn empty() -> Trust {
        Trust {
            platform: Arc::new(RootCertStore::empty()),
        }
    }

    /// The certificates one destination trusts: the platform's roots plus those of `ca_file`
    /// (empty: none). For a client that builds its own config (the PostgreSQL store's).
    pub fn roots(&self, ca_file: &str) -> Result<RootCertStore, String> {
        let mut roots = (*self.platform).clone();
        if !ca_file.is_empty() {
            for cert in read_ca_file(Path::new(ca_file)).map_err(|e| format!("{ca_file}: {e}"))? {
                roots
                    .add(cert)
                    .map_err(|e| format!("{ca_file}: not a usable CA certificate: {e}"))?;
            }
        }
        Ok(roots)
    }

    /// A client config for one destination: the platform's roots plus the certificates of
    /// `ca_file` (empty: none). Hostname verification is always on (rustls' webpki verifier;
    /// there is no way to turn it off here).
    pub fn client_config(&self, ca_file: &str) -> Result<Arc<ClientConfig>, String> {
        let roots = self.roots(ca_file)?;
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS setup: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        // HTTP/1.1 only, as over plain http (awc's HTTP/2 would need ALPN "h2").
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// Why a TLS handshake failed: a small fixed set (a metric label). The labels
/// ([`TlsReason::label`], snake_case) and the list of all reasons ([`TlsReason::ALL`]) come from
/// the enum itself.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    strum::IntoStaticStr,
    strum::VariantArray,
    strum::EnumCount,
)]
#[strum(serialize_all = "snake_case")]
pub enum TlsReason {
    /// The chain does not lead to a trusted root (unknown or private CA not configured).
    UnknownIssuer,
    Expired,
    NotYetValid,
    /// The certificate is not for the host the URL names.
    NameMismatch,
    /// Any other problem with the certificate (bad signature, wrong purpose, revoked...).
    BadCertificate,
    /// The handshake failed otherwise (protocol, an alert from the peer, no common cipher...).
    Handshake,
}

impl TlsReason {
    /// Every reason, in declaration order.
    pub const ALL: [TlsReason; <TlsReason as strum::EnumCount>::COUNT] =
        *<TlsReason as strum::VariantArray>::VARIANTS
            .first_chunk()
            .unwrap();

    /// The metric label and dead-letter suffix.
    pub fn label(self) -> &'static str {
        self.into()
    }

    fn text(self) -> &'static str {
        match self {
            TlsReason::UnknownIssuer => "certificate not trusted",
            TlsReason::Expired => "certificate expired",
            TlsReason::NotYetValid => "certificate not yet valid",
            TlsReason::NameMismatch => "name mismatch",
            TlsReason::BadCertificate => "certificate refused",
            TlsReason::Handshake => "handshake failed",
        }
    }
}

/// A failed TLS handshake: why (typed) and rustls' own words (e.g. `invalid peer certificate:
/// UnknownIssuer`). A retryable connect failure: the certificate may be fixed or rotated.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("TLS: {} ({detail})", .reason.text())]
pub struct TlsFailure {
    pub reason: TlsReason,
    pub detail: String,
}

impl TlsFailure {
    /// From rustls' error.
    pub fn from_rustls(e: &rustls::Error) -> TlsFailure {
        use rustls::CertificateError as C;
        let reason = match e {
            rustls::Error::InvalidCertificate(c) => match c {
                C::UnknownIssuer => TlsReason::UnknownIssuer,
                C::Expired | C::ExpiredContext { .. } => TlsReason::Expired,
                C::NotValidYet | C::NotValidYetContext { .. } => TlsReason::NotYetValid,
                C::NotValidForName | C::NotValidForNameContext { .. } => TlsReason::NameMismatch,
                _ => TlsReason::BadCertificate,
            },
            _ => TlsReason::Handshake,
        };
        TlsFailure {
            reason,
            detail: e.to_string(),
        }
    }

    /// The failed handshake behind an awc connect error: awc reports it as `ConnectError::Io`
    /// around the `io::Error` tokio-rustls made of rustls' error (awc's error has no `source`).
    pub fn from_connect_error(error: &awc::error::ConnectError) -> Option<TlsFailure> {
        match error {
            awc::error::ConnectError::Io(io) => Self::find(io),
            other => Self::find(other),
        }
    }

    /// The rustls error somewhere in `error`'s chain (awc reports a failed handshake as
    /// `ConnectError::Io` around an `io::Error` that holds rustls' error), if there is one.
    pub fn find(error: &(dyn std::error::Error + 'static)) -> Option<TlsFailure> {
        let mut at: Option<&(dyn std::error::Error + 'static)> = Some(error);
        while let Some(e) = at {
            if let Some(r) = e.downcast_ref::<rustls::Error>() {
                return Some(Self::from_rustls(r));
            }
            // An io::Error's payload is its `get_ref`, which `source` may skip.
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                if let Some(r) = io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
                    return Some(Self::from_rustls(r));
                }
            }
            at = e.source();
        }
        None
    }
}

/// Told of every failed handshake (destination, failure): the metric, kept out of this module.
pub type TlsObserver = Arc<dyn Fn(&str, &TlsFailure) + Send + Sync>;

/// How one client reaches its destination over TLS.
#[derive(Clone)]
pub struct ClientTls {
    pub config: Arc<ClientConfig>,
    /// `upstream` or the help-desk endpoint's name (never a URL: it may carry credentials).
    pub destination: String,
    pub observer: Option<TlsObserver>,
    /// The reason last logged at error level: the same failure again (every retry of every
    /// queued call) goes to debug, a new reason to error, a success after failures to info.
    logged: Arc<std::sync::Mutex<Option<TlsReason>>>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("destination", &self.destination)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    /// The client of `destination`: `trust`'s roots plus `ca_file` (empty: none).
    pub fn new(
        trust: &Trust,
        ca_file: &str,
        destination: &str,
        observer: Option<TlsObserver>,
    ) -> Result<ClientTls, String> {
        Ok(ClientTls {
            config: trust.client_config(ca_file)?,
            destination: destination.to_owned(),
            observer,
            logged: Arc::default(),
        })
    }

    /// Log and count a failed handshake: an error the first time for its reason, debug while
    /// the same failure repeats (each is counted).
    pub fn failed(&self, failure: &TlsFailure) {
        let first = {
            let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
            logged.replace(failure.reason) != Some(failure.reason)
        };
        if first {
            tracing::error!(
                destination = %self.destination,
                reason = failure.reason.label(),
                error = %failure,
                "TLS handshake failed; the call is retried (fix the certificate or the CA option)"
            );
        } else {
            tracing::debug!(
                destination = %self.destination,
                reason = failure.reason.label(),
                error = %failure,
                "TLS handshake failed again"
            );
        }
        if let Some(observe) = &self.observer {
            observe(&self.destination, failure);
        }
    }

    /// An exchange got through: after failures, say so once.
    pub fn succeeded(&self) {
        let was = self.logged.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(reason) = was {
            tracing::info!(destination = %self.destination, after = reason.label(), "TLS handshakes succeed again");
        }
    }
}

#[cfg(test)]
mod tests;
