//! A PostgreSQL server of a test's own, for what the shared test database cannot be used for (a
//! server with TLS on, a server the test stops and starts again): a new cluster in a temporary
//! directory, on a free loopback port, owned by `postgres` when the tests run as root (initdb
//! refuses root), its superuser `bridge` with a random password. Stopped (`pg_ctl -D`, which
//! signals the postmaster by the PID in its data directory) when dropped. Its programs are
//! `tests/lib/postgres.sh`'s (`PG_BIN`, else `/usr/lib/postgresql/15/bin`).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A running cluster of the test's own.
pub struct PgServer {
    dir: tempfile::TempDir,
    pub port: u16,
    pub password: String,
    /// The server's options (`pg_ctl -o`), kept for a start again.
    options: String,
}

/// PostgreSQL's programs.
pub fn pg_bin() -> PathBuf {
    std::env::var_os("PG_BIN").map_or_else(|| "/usr/lib/postgresql/15/bin".into(), PathBuf::from)
}

/// Whether this process runs as root (then the cluster's owner is `postgres`).
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

pub fn write_private(path: &Path, text: &str) {
    std::fs::write(path, text).expect("write");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("address").port()
}

/// Whether a server of the test's own can run here: `None` (said on stderr, for `test`) without
/// `HANDOFF_BRIDGE_TEST_PG_URL` (PostgreSQL's tests are asked for) or without initdb.
fn available(test: &str) -> Option<()> {
    let var = storage_pg::testing::URL_VAR;
    if std::env::var(var).is_err() {
        eprintln!("skipped: {test} needs PostgreSQL ({var} unset; see tests/lib/postgres.sh)");
        return None;
    }
    if !pg_bin().join("initdb").exists() {
        eprintln!(
            "skipped: {test}: no initdb in {} (PG_BIN)",
            pg_bin().display()
        );
        return None;
    }
    Some(())
}

impl PgServer {
    /// A new cluster on 127.0.0.1 with the server options `extra` (`-c name=value ...`) and, in
    /// its data directory before it starts, `files` (name, text; `server.crt`...); `None` (said
    /// on stderr, naming `test`) when PostgreSQL is not there.
    pub fn start(test: &str, extra: &str, files: &[(&str, &str)]) -> Option<PgServer> {
        available(test)?;
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
                .args(["-U", "bridge", "--auth=scram-sha-256", "-E", "UTF8"])
                .args(["--no-sync", "--locale=C.UTF-8"])
                .arg(format!("--pwfile={}", dir.path().join("pwfile").display()))
                .stdout(std::fs::File::create(&log).expect("log"))
                .stderr(Stdio::null()),
            &log,
        );
        for (name, text) in files {
            write_private(&data.join(name), text);
        }
        give_to_owner(dir.path());
        let port = free_port();
        let options = format!(
            "-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={} {extra}",
            dir.path().display()
        );
        let server = PgServer {
            dir,
            port,
            password,
            options,
        };
        server.start_again();
        Some(server)
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// Start the server (stopped by [`stop`](Self::stop)) and wait until it accepts
    /// connections.
    pub fn start_again(&self) {
        let mut start = as_owner("pg_ctl");
        start.arg("-D").arg(self.data()).arg("-l").arg(self.log());
        run(
            start
                .args(["-w", "-t", "60", "-o", &self.options, "start"])
                .stdout(Stdio::null()),
            &self.log(),
        );
    }

    /// Stop the server in `mode` (`fast`: sessions ended, a checkpoint; `immediate`: as a
    /// crash, recovered from the WAL at the next start) and wait until it is down.
    pub fn stop(&self, mode: &str) {
        run(
            as_owner("pg_ctl")
                .arg("-D")
                .arg(self.data())
                .args(["-m", mode, "-w", "-t", "60", "stop"])
                .stdout(Stdio::null()),
            &self.log(),
        );
    }

    /// Its URL (database `postgres`, user `bridge`) for `host` (resolved, or reached at
    /// `hostaddr` in `query`), with `query`.
    pub fn url(&self, host: &str, query: &str) -> String {
        format!(
            "postgres://bridge:{}@{host}:{}/postgres?{query}",
            self.password, self.port
        )
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = as_owner("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "-w", "-t", "30", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
