//! The public listener over TLS (`server.tls.cert_file` / `key_file`): the certificate in force
//! sits behind a lock that every new handshake reads, and SIGHUP swaps in the files' current
//! contents (cert-manager style rotation). Connections already open keep the certificate they
//! were made with; a reload that fails keeps the old certificate, logs an error and counts.

use crate::ops::metrics::Metrics;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use tokio::sync::watch;
use upstream::tls::provider;

/// The certificate chain of `cert_file` and the key of `key_file` (PEM), checked to belong
/// together. The error names the file and why, never the key's contents.
pub fn load_certified_key(cert_file: &Path, key_file: &Path) -> Result<CertifiedKey, String> {
    let cert_bytes = std::fs::read(cert_file)
        .map_err(|e| format!("{}: cannot read: {e}", cert_file.display()))?;
    let chain = CertificateDer::pem_slice_iter(&cert_bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: not PEM certificates: {e}", cert_file.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: holds no PEM certificate", cert_file.display()));
    }
    let key_bytes =
        std::fs::read(key_file).map_err(|e| format!("{}: cannot read: {e}", key_file.display()))?;
    // The error of a failed parse is rustls' kind of problem, not the bytes.
    let key = PrivateKeyDer::from_pem_slice(&key_bytes)
        .map_err(|e| format!("{}: no PEM private key: {e}", key_file.display()))?;
    CertifiedKey::from_der(chain, key, &provider()).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => format!(
            "{}: the key does not match the certificate of {}",
            key_file.display(),
            cert_file.display()
        ),
        other => format!("{}: unusable key: {other}", key_file.display()),
    })
}

/// The listener's certificate in force, and where it is reloaded from.
pub struct ServerCert {
    cert_file: PathBuf,
    key_file: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
}

impl std::fmt::Debug for ServerCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerCert")
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .finish_non_exhaustive()
    }
}

impl ResolvesServerCert for ServerCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.resolve_current())
    }
}

impl ServerCert {
    pub fn load(cert_file: &Path, key_file: &Path) -> Result<Arc<ServerCert>, String> {
        let key = load_certified_key(cert_file, key_file)?;
        Ok(Arc::new(ServerCert {
            cert_file: cert_file.to_owned(),
            key_file: key_file.to_owned(),
            current: RwLock::new(Arc::new(key)),
        }))
    }

    /// The certificate a new handshake gets.
    pub fn resolve_current(&self) -> Arc<CertifiedKey> {
        // A poisoned lock still holds a whole `Arc` (the swap is one assignment).
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Read the files again and swap the new certificate in; on any problem the running one
    /// stays. Blocking (reads files).
    pub fn reload(&self) -> Result<(), String> {
        let key = load_certified_key(&self.cert_file, &self.key_file)?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(key);
        Ok(())
    }

    /// The rustls server config with this resolver (actix-web adds the ALPN protocols it
    /// serves, h2 and http/1.1, when it binds).
    pub fn server_config(self: &Arc<Self>) -> Result<rustls::ServerConfig, String> {
        Ok(rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS setup: {e}"))?
            .with_no_client_auth()
            .with_cert_resolver(self.clone()))
    }

    /// Reload on every SIGHUP until `stop` (the rule reloader listens to the same signal: each
    /// listener gets every signal). Counted in `handoff_tls_reloads_total{result}`.
    pub fn spawn_reloader(
        self: Arc<Self>,
        metrics: Metrics,
        mut stop: watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        // Registered before the task runs (and before the start line is printed), so a SIGHUP
        // sent right after the start reloads rather than ends the process.
        let hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
        tokio::spawn(async move {
            let mut hangup = match hangup {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "cannot watch SIGHUP; the TLS certificate is not reloaded");
                    return;
                }
            };
            loop {
                tokio::select! {
                    _ = stop.changed() => return,
                    got = hangup.recv() => if got.is_none() { return },
                }
                let cert = self.clone();
                let result = match tokio::task::spawn_blocking(move || cert.reload()).await {
                    Ok(r) => r,
                    Err(e) => Err(format!("reload task failed: {e}")),
                };
                match result {
                    Ok(()) => {
                        metrics.tls_reloads.with_label_values(&["loaded"]).inc();
                        tracing::info!(cert_file = %self.cert_file.display(), "TLS certificate reloaded");
                    }
                    Err(e) => {
                        metrics.tls_reloads.with_label_values(&["failed"]).inc();
                        tracing::error!(error = %e, "TLS certificate reload failed; the running certificate stays");
                    }
                }
            }
        })
    }
}

/// Trusts exactly the certificate the listener serves at the moment (pinning, compared byte for
/// byte), for the embedded emulator's webhooks to this daemon over loopback: that peer is this
/// process, reached by IP address, which the certificate need not name. Signatures are checked
/// with the provider's algorithms as usual.
#[derive(Debug)]
struct PinnedToListener {
    cert: Arc<ServerCert>,
    algorithms: rustls::crypto::WebPkiSupportedAlgorithms,
}

impl rustls::client::danger::ServerCertVerifier for PinnedToListener {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let current = self.cert.resolve_current();
        if current.cert.first() == Some(end_entity) {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::UnknownIssuer,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// The public listener: plain HTTP, or TLS with a certificate reloaded on SIGHUP.
pub struct PublicTls(Option<Arc<ServerCert>>);

impl PublicTls {
    /// Plain without files, else TLS with the certificate of `(cert_file, key_file)` (the
    /// config's `server.tls`, validated: both files or neither).
    pub fn from_files(files: Option<(&Path, &Path)>) -> Result<PublicTls, String> {
        let Some((cert_file, key_file)) = files else {
            return Ok(PublicTls(None));
        };
        let cert = ServerCert::load(cert_file, key_file)?;
        Ok(PublicTls(Some(cert)))
    }

    /// `https` or `http`, for the start lines.
    pub fn scheme(&self) -> &'static str {
        if self.0.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// What to bind the listener with: `None` for plain HTTP.
    pub fn server_config(&self) -> Result<Option<rustls::ServerConfig>, String> {
        self.0.as_ref().map(|cert| cert.server_config()).transpose()
    }

    /// With TLS, a client for this daemon's own listener over loopback (the embedded
    /// emulator's webhooks): it trusts only the certificate the listener serves.
    pub fn loopback_client(&self) -> Result<Option<Arc<rustls::ClientConfig>>, String> {
        let Some(cert) = &self.0 else {
            return Ok(None);
        };
        let provider = provider();
        let verifier = Arc::new(PinnedToListener {
            cert: cert.clone(),
            algorithms: provider.signature_verification_algorithms,
        });
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS setup: {e}"))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(Some(Arc::new(config)))
    }

    /// With TLS, reload the certificate on SIGHUP until `stop`.
    pub fn spawn_reloader(
        &self,
        metrics: Metrics,
        stop: watch::Receiver<bool>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        self.0
            .as_ref()
            .map(|cert| cert.clone().spawn_reloader(metrics, stop))
    }
}

#[cfg(test)]
mod tests;
