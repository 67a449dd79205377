use super::*;
use crate::config::{Config, ConfigError, Overrides};
use rustls::CertificateError as C;
use rustls::ClientConfig;
use std::sync::Arc;
use upstream::test_support::ca_and_leaf;

#[test]
fn a_server_certificate_needs_its_own_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, leaf, key) = ca_and_leaf(&["localhost"]);
    let (_, _, other_key) = ca_and_leaf(&["localhost"]);
    let cert_file = dir.path().join("cert.pem");
    let key_file = dir.path().join("key.pem");
    let wrong_key = dir.path().join("wrong.pem");
    std::fs::write(&cert_file, &leaf).expect("write");
    std::fs::write(&key_file, &key).expect("write");
    std::fs::write(&wrong_key, &other_key).expect("write");
    let cert = ServerCert::load(&cert_file, &key_file).expect("matching pair");
    assert!(cert.server_config().is_ok());

    let err = load_certified_key(&cert_file, &wrong_key).expect_err("mismatch");
    assert!(err.contains("does not match"), "{err}");
    assert!(
        !err.contains("PRIVATE KEY") && !err.contains(other_key.lines().nth(1).unwrap_or("-")),
        "the key is never shown: {err}"
    );
    let err = load_certified_key(&key_file, &key_file).expect_err("no certificate");
    assert!(err.contains("no PEM certificate"), "{err}");

    // A reload from broken files keeps the certificate in force.
    let before = cert.resolve_current();
    std::fs::write(&cert_file, "garbage").expect("write");
    assert!(cert.reload().is_err());
    assert_eq!(cert.resolve_current().cert, before.cert);
    // A good pair is swapped in.
    let (_, new_leaf, new_key) = ca_and_leaf(&["localhost"]);
    std::fs::write(&cert_file, &new_leaf).expect("write");
    std::fs::write(&key_file, &new_key).expect("write");
    cert.reload().expect("reload");
    assert_ne!(cert.resolve_current().cert, before.cert);
}

fn problems(err: ConfigError) -> Vec<(String, String)> {
    match err {
        ConfigError::Invalid(p) => p.into_iter().map(|p| (p.key, p.why)).collect(),
        other => panic!("not a validation error: {other}"),
    }
}

fn env(pairs: &[(&str, String)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.clone()))
        .collect()
}

#[test]
fn https_and_the_tls_options_are_validated_every_problem_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = |name: &str| dir.path().join(name).to_str().expect("utf-8").to_owned();
    let (ca, leaf, key) = ca_and_leaf(&["localhost"]);
    let (_, _, other_key) = ca_and_leaf(&["localhost"]);
    std::fs::write(path("ca.pem"), &ca).expect("write");
    std::fs::write(path("cert.pem"), &leaf).expect("write");
    std::fs::write(path("key.pem"), &key).expect("write");
    std::fs::write(path("other.pem"), &other_key).expect("write");
    std::fs::write(path("empty.pem"), "").expect("write");

    // The files are read for `serve` and `check` (`check_files`), after the other checks.
    let files = Overrides {
        check_files: true,
        ..Overrides::default()
    };
    let good = Config::load_from(
        None,
        env(&[
            (
                "HANDOFF_BRIDGE_UPSTREAM_URL",
                "https://api.example.com/v1".into(),
            ),
            ("HANDOFF_BRIDGE__UPSTREAM__CA_FILE", path("ca.pem")),
            ("HANDOFF_BRIDGE__SERVER__TLS__CERT_FILE", path("cert.pem")),
            ("HANDOFF_BRIDGE__SERVER__TLS__KEY_FILE", path("key.pem")),
        ]),
        &files,
    )
    .expect("https with a private CA and a server certificate");
    assert_eq!(good.upstream.url, "https://api.example.com/v1");
    assert!(good.server.tls.enabled());

    let p = problems(
        Config::load_from(
            None,
            env(&[
                ("HANDOFF_BRIDGE_UPSTREAM_URL", "https://".into()),
                ("HANDOFF_BRIDGE__UPSTREAM__CA_FILE", path("empty.pem")),
                ("HANDOFF_BRIDGE__SERVER__TLS__CERT_FILE", path("cert.pem")),
                ("HANDOFF_BRIDGE__SERVER__TLS__KEY_FILE", path("other.pem")),
            ]),
            &files,
        )
        .expect_err("invalid"),
    );
    let keys: Vec<&str> = p.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        ["upstream.url", "server.tls", "upstream.ca_file"],
        "{p:?}"
    );
    assert!(p[1].1.contains("does not match"), "{p:?}");
    assert!(p[2].1.contains("no PEM certificate"), "{p:?}");

    let p = problems(
        Config::load_from(
            None,
            env(&[
                ("HANDOFF_BRIDGE__UPSTREAM__CA_FILE", path("missing.pem")),
                ("HANDOFF_BRIDGE__SERVER__TLS__CERT_FILE", path("cert.pem")),
            ]),
            &files,
        )
        .expect_err("invalid"),
    );
    let keys: Vec<&str> = p.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["server.tls.key_file", "upstream.ca_file"], "{p:?}");
}

/// A whole handshake in memory between a client and a server config; the client's verdict.
fn handshake(
    client: Arc<ClientConfig>,
    server: Arc<rustls::ServerConfig>,
) -> Result<(), rustls::Error> {
    let io = |e: std::io::Error| rustls::Error::General(e.to_string());
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name");
    let mut c = rustls::ClientConnection::new(client, name)?;
    let mut s = rustls::ServerConnection::new(server)?;
    for _ in 0..10 {
        let mut to_server = Vec::new();
        while c.wants_write() {
            c.write_tls(&mut to_server).map_err(io)?;
        }
        s.read_tls(&mut &to_server[..]).map_err(io)?;
        // The server's own verdict does not matter here: the client's is tested.
        let _ = s.process_new_packets();
        let mut to_client = Vec::new();
        while s.wants_write() {
            s.write_tls(&mut to_client).map_err(io)?;
        }
        c.read_tls(&mut &to_client[..]).map_err(io)?;
        c.process_new_packets()?;
        if !c.is_handshaking() {
            return Ok(());
        }
    }
    Err(rustls::Error::General("the handshake did not end".into()))
}

#[test]
fn the_loopback_client_trusts_exactly_the_certificate_the_listener_serves() {
    let dir = tempfile::tempdir().expect("tempdir");
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        path.to_str().expect("utf-8").to_owned()
    };
    // For another name than the address it is reached by: pinning does not look at names.
    let (_, leaf, key) = ca_and_leaf(&["bridge.example"]);
    let own = crate::config::ServerTlsConfig {
        cert_file: write("cert.pem", &leaf),
        key_file: write("key.pem", &key),
    };
    let (_, other_leaf, other_key) = ca_and_leaf(&["bridge.example"]);
    let other = ServerCert::load(
        Path::new(&write("other.pem", &other_leaf)),
        Path::new(&write("other-key.pem", &other_key)),
    )
    .expect("other");

    let listener = PublicTls::from_files(own.files()).expect("listener");
    let client = listener
        .loopback_client()
        .expect("client")
        .expect("TLS is on");
    let served = Arc::new(
        listener
            .server_config()
            .expect("config")
            .expect("TLS is on"),
    );
    handshake(client.clone(), served.clone()).expect("its own certificate");
    let err = handshake(
        client.clone(),
        Arc::new(other.server_config().expect("config")),
    )
    .expect_err("another certificate, even from the same kind of CA");
    assert!(
        matches!(err, rustls::Error::InvalidCertificate(C::UnknownIssuer)),
        "{err:?}"
    );
    assert!(
        PublicTls::from_files(None)
            .expect("plain")
            .loopback_client()
            .expect("client")
            .is_none(),
        "no TLS, no client"
    );
}
