//! The PostgreSQL backend in the benches: a fresh database on a server someone else started
//! (`benches/run` starts a throwaway one with `tests/lib/postgres.sh`) for each daemon, dropped
//! when done, and the CPU of the server's processes.
//!
//! `--pg-url postgres://user:password@127.0.0.1:PORT/DB` names a database the harness may run
//! `CREATE DATABASE` from (through `psql`, under `timeout`); each daemon then gets
//! `HANDOFF_BRIDGE_STORE_URL` naming a database of its own. `--pg-data DIR` (the cluster's data
//! directory) lets the harness find the postmaster (`postmaster.pid`) and count its CPU.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// The options' keys (each bench lists them with its own).
pub const KEYS: [&str; 2] = ["pg-url", "pg-data"];

/// How long one `psql` call may take (a `CREATE DATABASE` copies template1 and checkpoints).
const PSQL_DEADLINE: Duration = Duration::from_secs(120);

/// Databases made by this process, numbered.
static MADE: AtomicU32 = AtomicU32::new(0);

/// The PostgreSQL server the daemons run on, as the options name it (started by someone else:
/// unlike the tests' `pg_server::PgServer`, this starts nothing).
#[derive(Clone, Debug, Default)]
pub struct PgTarget {
    /// A database on it to run `CREATE DATABASE` from (its password never printed).
    url: Option<String>,
    /// The cluster's data directory, for the postmaster's PID.
    data: Option<PathBuf>,
}

impl PgTarget {
    /// Apply `--pg-url` or `--pg-data`; `Ok(false)` for another key.
    pub fn set(&mut self, key: &str, value: &str) -> Result<bool, String> {
        match key {
            "pg-url" if value.is_empty() => self.url = None,
            "pg-url" => {
                parse_url(value)?;
                self.url = Some(value.to_owned());
            }
            "pg-data" => self.data = (!value.is_empty()).then(|| PathBuf::from(value)),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Whether the daemons run on PostgreSQL (else sled).
    pub fn enabled(&self) -> bool {
        self.url.is_some()
    }

    /// `--pg-data` without `--pg-url` is a mistake.
    pub fn check(&self) -> Result<(), String> {
        if self.data.is_some() && self.url.is_none() {
            return Err("--pg-data needs --pg-url".into());
        }
        Ok(())
    }

    /// A new empty database for one daemon (`None` when the daemons run on sled).
    pub fn fresh(&self, tag: &str) -> Result<Option<PgDatabase>, String> {
        let Some(url) = &self.url else {
            return Ok(None);
        };
        let n = MADE.fetch_add(1, Ordering::Relaxed);
        let name = format!("hb_bench_{}_{}_{n}", std::process::id(), sanitize(tag));
        psql(url, &format!("CREATE DATABASE {name}"))?;
        Ok(Some(PgDatabase {
            admin: url.clone(),
            url: with_database(url, &name)?,
            name,
        }))
    }

    /// For a report's machine table: the server's version and settings that bear on speed.
    pub fn describe(&self) -> Option<String> {
        let url = self.url.as_ref()?;
        let sql =
            "SELECT version(), current_setting('fsync'), current_setting('synchronous_commit'), \
                   current_setting('shared_buffers'), current_setting('max_wal_size')";
        Some(match psql(url, sql) {
            Ok(out) => {
                let f: Vec<&str> = out.trim().split('|').collect();
                let version = f
                    .first()
                    .and_then(|v| v.split(" on ").next())
                    .unwrap_or("?");
                format!(
                    "{version} on this machine (loopback), a fresh database per daemon; fsync {}, \
                     synchronous_commit {}, shared_buffers {}, max_wal_size {}",
                    f.get(1).unwrap_or(&"?"),
                    f.get(2).unwrap_or(&"?"),
                    f.get(3).unwrap_or(&"?"),
                    f.get(4).unwrap_or(&"?")
                )
            }
            Err(e) => format!("PostgreSQL (not described: {e})"),
        })
    }

    /// The postmaster's PID: line 1 of `postmaster.pid` in the data directory.
    pub fn postmaster_pid(&self) -> Option<u32> {
        let text = std::fs::read_to_string(self.data.as_ref()?.join("postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok()
    }
}

/// A database made for one daemon, dropped (with its connections ended) when this is.
pub struct PgDatabase {
    admin: String,
    name: String,
    /// What the daemon's `HANDOFF_BRIDGE_STORE_URL` is set to.
    pub url: String,
}

impl PgDatabase {
    /// Its size on disk, bytes (`pg_database_size`; the scale bench's).
    #[allow(dead_code)]
    pub fn size_bytes(&self) -> Option<u64> {
        let out = psql(
            &self.admin,
            &format!("SELECT pg_database_size('{}')", self.name),
        )
        .ok()?;
        out.trim().parse().ok()
    }
}

impl Drop for PgDatabase {
    fn drop(&mut self) {
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        if let Err(e) = psql(&self.admin, &sql) {
            eprintln!("  could not drop database {}: {e}", self.name);
        }
    }
}

/// Letters, digits and `_` of `tag`, lower case, at most 20 (a database name's part).
fn sanitize(tag: &str) -> String {
    tag.chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
        .map(|c| c.to_ascii_lowercase())
        .take(20)
        .collect()
}

/// `postgres://user:password@host:port/db?query`: (everything but the password, the password).
fn parse_url(url: &str) -> Result<(String, Option<String>), String> {
    let rest = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
        .ok_or("--pg-url: not a postgres:// URL")?;
    let (userinfo, host) = rest
        .split_once('@')
        .ok_or("--pg-url: no user@ in the URL")?;
    if !host.contains('/') {
        return Err("--pg-url: no /database in the URL".into());
    }
    Ok(match userinfo.split_once(':') {
        Some((user, password)) => (
            format!("postgres://{user}@{host}"),
            Some(password.to_owned()),
        ),
        None => (format!("postgres://{userinfo}@{host}"), None),
    })
}

/// `url` naming database `name` instead of its own (its query kept).
fn with_database(url: &str, name: &str) -> Result<String, String> {
    let at = url.rfind('@').ok_or("--pg-url: no user@ in the URL")?;
    let slash = url[at..]
        .find('/')
        .map(|i| at + i)
        .ok_or("--pg-url: no /database in the URL")?;
    let query = url[slash..].find('?').map_or("", |i| &url[slash + i..]);
    Ok(format!("{}/{name}{query}", &url[..slash]))
}

/// `psql -c sql` on `url` under `timeout` (the password in the environment, not the arguments):
/// its unaligned output.
fn psql(url: &str, sql: &str) -> Result<String, String> {
    let (bare, password) = parse_url(url)?;
    let mut cmd = Command::new("timeout");
    cmd.arg("--kill-after=5")
        .arg(PSQL_DEADLINE.as_secs().to_string())
        .arg(psql_path())
        .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d"])
        .arg(&bare)
        .arg("-c")
        .arg(sql);
    if let Some(p) = password {
        cmd.env("PGPASSWORD", p);
    }
    let out = cmd.output().map_err(|e| format!("psql: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "psql `{sql}`: {} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// PostgreSQL 15's `psql` when installed where the tests' server is, else the one on PATH.
fn psql_path() -> PathBuf {
    let v15 = Path::new("/usr/lib/postgresql/15/bin/psql");
    if v15.is_file() {
        v15.to_path_buf()
    } else {
        PathBuf::from("psql")
    }
}

// ---------------------------------------------------------------------------------------------
// The server's CPU

/// CPU seconds the server has used so far: the postmaster's own and its reaped children's
/// (`cutime`, `cstime`: a backend that exited is counted there once the postmaster has waited
/// for it), plus every live child's (each connection's backend, the WAL writer, the
/// checkpointer...). The difference of two readings is the server's CPU between them, backends
/// that came and went included, unless the postmaster had not yet reaped one at the second.
pub fn server_cpu_seconds(postmaster: u32) -> Option<f64> {
    let own = stat_fields(postmaster)?;
    let mut ticks = own.utime + own.stime + own.cutime + own.cstime;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        match stat_fields(pid) {
            Some(s) if s.ppid == postmaster => ticks += s.utime + s.stime,
            _ => {}
        }
    }
    // USER_HZ is 100 on Linux.
    Some(ticks as f64 / 100.0)
}

/// The fields of `/proc/<pid>/stat` read here.
struct Stat {
    ppid: u32,
    utime: u64,
    stime: u64,
    cutime: u64,
    cstime: u64,
}

fn stat_fields(pid: u32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the `(comm)`: state is field 3, ppid 4, utime 14 ... cstime 17.
    let rest = text.get(text.rfind(')')? + 2..)?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| f.get(i)?.parse::<u64>().ok();
    Some(Stat {
        ppid: u32::try_from(num(1)?).ok()?,
        utime: num(11)?,
        stime: num(12)?,
        cutime: num(13)?,
        cstime: num(14)?,
    })
}
