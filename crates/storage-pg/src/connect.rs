//! Connecting: the URL (its password a [`Secret`], never shown: [`mask`]), `sslmode` and
//! `sslrootcert` read from it (tokio-postgres knows neither `verify-ca` nor `verify-full`), TLS
//! over the daemon's rustls with ring, and the pool of connections.

use crate::PgError;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use model::secret::Secret;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// Connections a store keeps at most (the writer, a fold, the executor, reads).
const POOL_SIZE: usize = 8;
/// How long a connection is waited for, made, or checked before the call fails (so a database
/// that is away fails calls instead of holding them).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How to reach the database.
#[derive(Clone)]
pub struct PgOptions {
    /// `postgres://user:password@host:port/database?sslmode=...` (the password is a secret).
    pub url: Secret,
    /// The certificates TLS trusts: the platform's roots and a private CA (`store.ca_file`),
    /// as the daemon's other TLS clients do. `sslrootcert` in the URL adds its own.
    pub roots: RootCertStore,
    /// Tables in this schema instead of the connection's default (tests: one per test).
    pub schema: Option<String>,
}

impl PgOptions {
    /// The URL with its password masked: what errors and logs say.
    pub fn masked_url(&self) -> String {
        mask(self.url.expose())
    }

    /// Whether the URL is one this store can use (a `postgres://` URL, a known `sslmode`),
    /// without connecting. The error never quotes the URL.
    pub fn check(&self) -> Result<(), PgError> {
        parse(self.url.expose()).map(drop)
    }
}

/// `sslmode`, as libpq names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    /// TLS if the server offers it, unverified (libpq's default).
    Prefer,
    /// TLS, the certificate not verified.
    Require,
    /// TLS, the certificate's chain verified, not its name.
    VerifyCa,
    /// TLS, chain and host name verified.
    VerifyFull,
}

impl FromStr for SslMode {
    type Err = PgError;

    fn from_str(s: &str) -> Result<Self, PgError> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "prefer" | "allow" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(PgError::Url(format!(
                "sslmode {other:?} is not one of disable, prefer, require, verify-ca, verify-full"
            )))
            }
        })
    }
}

/// A URL split into what tokio-postgres reads and what this crate reads itself.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub config: tokio_postgres::Config,
    pub ssl: SslMode,
    pub root_cert: Option<String>,
}

/// `url` read: `sslmode` and `sslrootcert` taken out of its query, the rest tokio-postgres'.
pub(crate) fn parse(url: &str) -> Result<Parsed, PgError> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let (mut ssl, mut root_cert, mut kept) = (SslMode::Prefer, None, Vec::new());
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("sslmode", mode)) => ssl = mode.parse()?,
            Some(("sslrootcert", path)) => root_cert = Some(path.to_owned()),
            _ => kept.push(pair),
        }
    }
    let rest = match kept.is_empty() {
        true => base.to_owned(),
        false => format!("{base}?{}", kept.join("&")),
    };
    if !(rest.starts_with("postgres://") || rest.starts_with("postgresql://")) {
        return Err(PgError::Url("not a postgres:// URL".into()));
    }
    // tokio-postgres' message never quotes the URL.
    let mut config = tokio_postgres::Config::from_str(&rest)
        .map_err(|e| PgError::Url(format!("cannot read the URL: {e}")))?;
    config.ssl_mode(match ssl {
        SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        _ => tokio_postgres::config::SslMode::Require,
    });
    Ok(Parsed {
        config,
        ssl,
        root_cert,
    })
}

/// `url` with the password of its user info masked (`user:****@`), and a `password` parameter's
/// value too.
pub fn mask(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "(not a URL)".into();
    };
    let (authority, tail) = rest
        .find(['/', '?'])
        .map_or((rest, ""), |i| rest.split_at(i));
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{user}:****@{host}"),
            None => format!("{userinfo}@{host}"),
        },
        None => authority.to_owned(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((name, _)) if name.eq_ignore_ascii_case("password") => {
                        format!("{name}=****")
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}?{}", pairs.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{scheme}://{authority}{tail}")
}

/// How long a session may sit in a transaction waiting for its client (a fold computes for
/// milliseconds between its reads and its commit).
const IDLE_IN_TRANSACTION: &str = "5s";

/// An error's text with its causes (why a TLS handshake failed is only in a cause), and, for a
/// server certificate TLS refused, what to check. Causes carry no secret: the URL is never in
/// them.
pub(crate) fn explain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut hint = None;
    let mut cause = Some(e);
    while let Some(c) = cause {
        let shown = c.to_string();
        if !text.contains(&shown) {
            text = format!("{text}: {shown}");
        }
        hint = hint.or_else(|| certificate_hint(c));
        cause = c.source();
    }
    match hint {
        Some(hint) => format!("{text} ({hint})"),
        None => text,
    }
}

/// What to check when TLS refused the server's certificate (`e` a rustls error, or the I/O error
/// a handshake wraps it in).
fn certificate_hint(e: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    use rustls::CertificateError as Cert;
    let tls = e.downcast_ref::<rustls::Error>().or_else(|| {
        e.downcast_ref::<std::io::Error>()?
            .get_ref()?
            .downcast_ref::<rustls::Error>()
    })?;
    let rustls::Error::InvalidCertificate(why) = tls else {
        return None;
    };
    Some(match why {
        // A CA of the same name as the one that signed it: its signature does not verify.
        Cert::UnknownIssuer | Cert::BadSignature => {
            "the server's certificate is not signed by a CA trusted here: name its CA with \
             store.ca_file (store copy: --ca-file) or sslrootcert in the URL"
        }
        Cert::NotValidForName | Cert::NotValidForNameContext { .. } => {
            "the server's certificate is not for the host the URL names (verify-full checks the \
             name; verify-ca does not)"
        }
        _ => "TLS refused the server's certificate",
    })
}

/// The pool of connections for `options`, in `schema` when given (each connection's
/// `search_path`). Nothing is connected yet.
pub(crate) fn pool(options: &PgOptions) -> Result<Pool, PgError> {
    let Parsed {
        mut config,
        ssl,
        root_cert,
    } = parse(options.url.expose())?;
    // A session that stops in the middle of a transaction (its node paused or cut off) is ended
    // by the database, so the locks it holds (the lease row, `lease`) never hold others for good.
    // Added to the URL's own `options` (a search_path, say), never in their place.
    let mut session = config
        .get_options()
        .map_or_else(String::new, |own| format!("{own} "));
    session.push_str(&format!(
        "-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION}"
    ));
    if let Some(schema) = &options.schema {
        session.push_str(&format!(" -c search_path={schema}"));
    }
    config.options(session);
    config.connect_timeout(CONNECT_TIMEOUT);
    config.keepalives_idle(Duration::from_secs(30));
    let tls = tls(ssl, options.roots.clone(), root_cert.as_deref())?;
    let manager = Manager::from_config(
        config,
        tls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(POOL_SIZE)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(CONNECT_TIMEOUT))
        .create_timeout(Some(CONNECT_TIMEOUT))
        .recycle_timeout(Some(CONNECT_TIMEOUT))
        .build()
        .map_err(|e| PgError::Url(format!("connection pool: {e}")))
}

/// The TLS connector of `ssl`: ring, the given roots (and `root_cert`'s certificates), the
/// verifier the mode asks for.
fn tls(
    ssl: SslMode,
    mut roots: RootCertStore,
    root_cert: Option<&str>,
) -> Result<tokio_postgres_rustls::MakeRustlsConnect, PgError> {
    if let Some(path) = root_cert {
        for cert in read_pem(path)? {
            roots
                .add(cert)
                .map_err(|e| PgError::Tls(format!("sslrootcert {path}: {e}")))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| PgError::Tls(e.to_string()))?;
    let config = match ssl {
        SslMode::VerifyFull => builder.with_root_certificates(roots),
        SslMode::VerifyCa if roots.is_empty() => {
            return Err(PgError::Tls(
                "sslmode verify-ca needs a CA: store.ca_file or sslrootcert".into(),
            ))
        }
        mode => {
            let verifier = Verifier::new(mode, roots, provider)?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(verifier))
        }
    }
    .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

fn read_pem(path: &str) -> Result<Vec<CertificateDer<'static>>, PgError> {
    use rustls::pki_types::pem::PemObject;
    let bytes =
        std::fs::read(path).map_err(|e| PgError::Tls(format!("sslrootcert {path}: {e}")))?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| PgError::Tls(format!("sslrootcert {path}: not PEM: {e}")))?;
    Ok(certs)
}

/// `require` (and `prefer`): any certificate, the handshake's signatures still checked;
/// `verify-ca`: the chain verified against the roots, the name not.
#[derive(Debug)]
struct Verifier {
    chain: Option<Arc<rustls::client::WebPkiServerVerifier>>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl Verifier {
    fn new(
        mode: SslMode,
        roots: RootCertStore,
        provider: Arc<rustls::crypto::CryptoProvider>,
    ) -> Result<Verifier, PgError> {
        let chain = match mode {
            SslMode::VerifyCa => Some(
                rustls::client::WebPkiServerVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider.clone(),
                )
                .build()
                .map_err(|e| PgError::Tls(e.to_string()))?,
            ),
            _ => None,
        };
        Ok(Verifier { chain, provider })
    }
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Ok(ok) => Ok(ok),
            // verify-ca: a valid chain for another name is trusted.
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName))
            | Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            Err(e) => Err(e),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_shows_its_causes_and_what_to_check_for_a_refused_certificate() {
        #[derive(Debug, thiserror::Error)]
        #[error("error performing TLS handshake")]
        struct Handshake(#[source] std::io::Error);
        let refused = |why| {
            let tls = rustls::Error::InvalidCertificate(why);
            explain(&Handshake(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                tls,
            )))
        };
        let text = refused(rustls::CertificateError::UnknownIssuer);
        assert!(
            text.starts_with("error performing TLS handshake: "),
            "{text}"
        );
        assert!(text.contains("not signed by a CA trusted here"), "{text}");
        let text = refused(rustls::CertificateError::NotValidForName);
        assert!(text.contains("not for the host the URL names"), "{text}");
        let plain = explain(&std::io::Error::other("connection refused"));
        assert_eq!(plain, "connection refused");
    }

    #[test]
    fn the_password_is_masked_and_ssl_settings_are_read() {
        let url = "postgres://bridge:s3cret@db:5432/bridge?sslmode=verify-full&password=x";
        assert_eq!(
            mask(url),
            "postgres://bridge:****@db:5432/bridge?sslmode=verify-full&password=****"
        );
        let parsed = parse("postgres://u:p@h/d?sslmode=require&sslrootcert=/ca.pem").expect("url");
        assert_eq!(parsed.ssl, SslMode::Require);
        assert_eq!(parsed.root_cert.as_deref(), Some("/ca.pem"));
        assert_eq!(
            parse("postgres://u:p@h/d").expect("url").ssl,
            SslMode::Prefer
        );
        let bad = parse("postgres://u:s3cret@h/d?sslmode=maybe").expect_err("refused");
        assert!(!bad.to_string().contains("s3cret"));
        let bad = parse("mysql://u:s3cret@h/d").expect_err("refused");
        assert!(!bad.to_string().contains("s3cret"));
    }
}
