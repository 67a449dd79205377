//! TLS to PostgreSQL against a real server: a throwaway PostgreSQL of this test's own (a new
//! cluster in a temporary directory, on a free loopback port, `ssl = on` with a certificate for
//! 127.0.0.1 that `rcgen` made and signed with a CA of its own; stopped by its data directory
//! when the test ends). `verify-full` with that CA (`store.ca_file`) connects and the daemon
//! works; `verify-full` with another CA (`sslrootcert`), or for another host name, is refused at
//! start with an error that names the masked URL and why, and never the password; `verify-ca`
//! checks the chain and not the name; `require` connects without verifying. Skipped (said on
//! stderr) without `HANDOFF_BRIDGE_TEST_PG_URL` or PostgreSQL's programs.

use crate::common::*;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use storage::port::Reads;
use storage_pg::{PgOptions, PgStore};

/// A PostgreSQL cluster of this test's own with TLS on, stopped (`pg_ctl -D`) when dropped.
struct TlsServer {
    dir: tempfile::TempDir,
    port: u16,
    password: String,
}

/// PostgreSQL's programs (`tests/lib/postgres.sh`'s).
fn pg_bin() -> PathBuf {
    std::env::var_os("PG_BIN").map_or_else(|| "/usr/lib/postgresql/15/bin".into(), PathBuf::from)
}

/// Whether this process runs as root (then the cluster's owner is `postgres`: initdb refuses
/// root).
fn root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// One of PostgreSQL's programs, run as the cluster's owner.
fn as_owner(program: &str) -> Command {
    let path = pg_bin().join(program);
    if !root() {
        return Command::new(path);
    }
    let mut cmd = Command::new("runuser");
    cmd.args(["-u", "postgres", "--"]).arg(path);
    cmd
}

fn run(cmd: &mut Command, log: &Path) {
    let status = cmd.status().expect("run a PostgreSQL program");
    let text = std::fs::read_to_string(log).unwrap_or_default();
    assert!(status.success(), "{cmd:?}: {status}\n{text}");
}

/// `path`, and everything under it, owned by the cluster's owner.
fn give_to_owner(path: &Path) {
    if root() {
        let status = Command::new("chown")
            .args(["-R", "postgres"])
            .arg(path)
            .status();
        assert!(
            status.is_ok_and(|s| s.success()),
            "chown {}",
            path.display()
        );
    }
}

fn write_private(path: &Path, text: &str) {
    std::fs::write(path, text).expect("write");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
}

impl TlsServer {
    /// A new cluster serving `cert` and `key` (PEM) on 127.0.0.1; `None` (said) without
    /// PostgreSQL.
    fn start(cert: &str, key: &str) -> Option<TlsServer> {
        let var = storage_pg::testing::URL_VAR;
        if std::env::var(var).is_err() {
            eprintln!("skipped: TLS to PostgreSQL needs PostgreSQL ({var} unset; see tests/lib/postgres.sh)");
            return None;
        }
        if !pg_bin().join("initdb").exists() {
            eprintln!(
                "skipped: TLS to PostgreSQL: no initdb in {} (PG_BIN)",
                pg_bin().display()
            );
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let password = format!(
            "{:016x}{:016x}",
            rand::random::<u64>(),
            rand::random::<u64>()
        );
        let (data, log) = (dir.path().join("data"), dir.path().join("server.log"));
        write_private(&dir.path().join("pwfile"), &password);
        give_to_owner(dir.path());
        run(
            as_owner("initdb")
                .arg("-D")
                .arg(&data)
                .args([
                    "-U",
                    "bridge",
                    "--auth=scram-sha-256",
                    "-E",
                    "UTF8",
                    "--no-sync",
                ])
                .arg(format!("--pwfile={}", dir.path().join("pwfile").display()))
                .stdout(std::fs::File::create(&log).expect("log"))
                .stderr(std::process::Stdio::null()),
            &log,
        );
        write_private(&data.join("server.crt"), cert);
        write_private(&data.join("server.key"), key);
        give_to_owner(dir.path());
        let port = free_port();
        let options = format!(
            "-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={} \
             -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key -c fsync=off",
            dir.path().display()
        );
        let mut start = as_owner("pg_ctl");
        start.arg("-D").arg(&data).arg("-l").arg(&log);
        run(
            start.args(["-w", "-t", "30", "-o", &options, "start"]),
            &log,
        );
        Some(TlsServer {
            dir,
            port,
            password,
        })
    }

    /// Its URL for `host` (resolved, or reached at `hostaddr` in `query`), with `query`.
    fn url(&self, host: &str, query: &str) -> String {
        format!(
            "postgres://bridge:{}@{host}:{}/postgres?{query}",
            self.password, self.port
        )
    }
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        let _ = as_owner("pg_ctl")
            .arg("-D")
            .arg(&data)
            .args(["-m", "immediate", "-w", "-t", "30", "stop"])
            .stdout(std::process::Stdio::null())
            .status();
    }
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("address").port()
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
    let Some(server) = TlsServer::start(&cert, &key) else {
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
