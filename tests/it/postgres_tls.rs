//! TLS to PostgreSQL against a real server: a throwaway PostgreSQL of this test's own (a new
//! cluster in a temporary directory, on a free loopback port, `ssl = on` with a certificate for
//! 127.0.0.1 that `rcgen` made and signed with a CA of its own; stopped by its data directory
//! when the test ends). `verify-full` with that CA (`store.ca_file`) connects and the daemon
//! works; `verify-full` with another CA (`sslrootcert`), or for another host name, is refused at
//! start with an error that names the masked URL and why, and never the password; `verify-ca`
//! checks the chain and not the name; `require` connects without verifying. Skipped (said on
//! stderr) without `HANDOFF_BRIDGE_TEST_PG_URL` or PostgreSQL's programs.

use crate::common::pg_server::PgServer;
use crate::common::*;
use std::time::Duration;
use storage::port::Reads;
use storage_pg::{PgOptions, PgStore};

/// A PostgreSQL cluster of this test's own with TLS on (`cert` and `key`, PEM, for
/// 127.0.0.1); `None` (said) without PostgreSQL.
fn tls_server(cert: &str, key: &str) -> Option<PgServer> {
    PgServer::start(
        "TLS to PostgreSQL",
        "-c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key -c fsync=off",
        &[("server.crt", cert), ("server.key", key)],
    )
}

/// The store opened on `url` with no CA of the daemon's (only `sslrootcert`'s).
fn open(url: &str) -> Result<PgStore, storage::StoreError> {
    let options = PgOptions {
        url: model::secret::Secret::new(url),
        roots: rustls::RootCertStore::empty(),
        schema: None,
    };
    PgStore::open(&options, model::clock::Clock::new())
}

/// A CA of another name (PEM), which signed nothing the server shows.
fn another_ca() -> String {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "another CA");
    let key = KeyPair::generate().expect("key");
    params.self_signed(&key).expect("CA").pem()
}

#[test]
fn tls_to_postgres_verifies_the_server_as_its_sslmode_says() {
    let (ca, cert, key) = upstream::test_support::ca_and_leaf(&["127.0.0.1"]);
    let Some(server) = tls_server(&cert, &key) else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let (ours, theirs) = (tmp.path().join("ca.pem"), tmp.path().join("other-ca.pem"));
    std::fs::write(&ours, &ca).expect("write");
    std::fs::write(&theirs, another_ca()).expect("write");

    // verify-full with the server's CA as store.ca_file: the daemon works.
    let url = server.url("127.0.0.1", "sslmode=verify-full");
    let env = [
        ("HANDOFF_BRIDGE_STORE_URL", url.as_str()),
        (
            "HANDOFF_BRIDGE__STORE__CA_FILE",
            ours.to_str().expect("path"),
        ),
    ];
    let app = TestApp::spawn_in(&tmp.path().join("ok"), Spawn::with_env(&env));
    assert_eq!(
        app.post(&fixture_bytes("message-received-text.json")).0,
        200
    );
    wait_drained(&app);
    let (status, page) = app.admin_get("/admin/v1/conversations");
    assert_eq!((status, page["count"].as_u64()), (200, Some(1)), "{page}");
    assert_eq!(app.terminate().code(), Some(0));

    // Another CA, or another host name than the certificate's: refused at start.
    let other_ca = format!("sslmode=verify-full&sslrootcert={}", theirs.display());
    let other_name = "sslmode=verify-full&hostaddr=127.0.0.1";
    for (what, url, ca, why) in [
        (
            "another CA",
            server.url("127.0.0.1", &other_ca),
            "",
            "not signed by a CA trusted here",
        ),
        (
            "another name",
            server.url("db.example.internal", other_name),
            ours.to_str().expect("path"),
            "not for the host the URL names",
        ),
    ] {
        let env = [
            ("HANDOFF_BRIDGE_STORE_URL", url.as_str()),
            ("HANDOFF_BRIDGE__STORE__CA_FILE", ca),
        ];
        let data = tmp.path().join(what);
        let (status, stderr) = serve_refused_with(&data, &env, Duration::from_secs(60));
        assert_eq!(status.code(), Some(1), "{what}: {stderr}");
        assert!(
            stderr.contains("bridge:****@") && stderr.contains(why),
            "{what}: {stderr}"
        );
        assert!(
            !stderr.contains(&server.password),
            "{what}: the password shows: {stderr}"
        );
    }

    // verify-ca: the chain, not the name; require: neither.
    let chain = format!(
        "sslmode=verify-ca&hostaddr=127.0.0.1&sslrootcert={}",
        ours.display()
    );
    let store = open(&server.url("db.example.internal", &chain)).expect("verify-ca connects");
    assert_eq!(store.sizes().expect("read").conversations, 1);
    let store = open(&server.url("127.0.0.1", "sslmode=require")).expect("require connects");
    assert_eq!(store.sizes().expect("read").conversations, 1);
}
