//! The data directory: the sled store, generated secrets, and the running daemon's address.
//!
//! ```text
//! data/
//!   store/          sled database (state, folded marks, quarantine) and the event log
//!   webhook_token   generated webhook token (0600), when none is configured
//!   admin_token     generated admin token (0600), when none is configured
//!   daemon.json     pid and bound addresses of the running daemon (removed on clean exit)
//! ```

use model::secret::Secret;
use rand::distr::{Alphanumeric, SampleString};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

pub struct DataDir {
    root: PathBuf,
}

/// Written once the daemon listens; read by the CLI to reach the admin API.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DaemonInfo {
    pub pid: u32,
    /// The public listener (`server.listen`).
    pub listen: String,
    /// Where the admin API is (`admin.listen`, or `listen` when that is empty). Absent in the
    /// files of daemons from before the admin listener, which served it on `listen`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin: Option<String>,
}

impl DaemonInfo {
    /// The admin API's address.
    pub fn admin_addr(&self) -> &str {
        self.admin.as_deref().unwrap_or(&self.listen)
    }
}

impl DataDir {
    pub fn new(root: &Path) -> Self {
        DataDir {
            root: root.to_path_buf(),
        }
    }

    /// Create the directory if needed, owner-only (0700, parents too) whatever the umask. A path
    /// that is something else (a file) is refused with that reason, not the bare `File exists`
    /// of `mkdir`. An existing directory keeps its mode (the operator chose it).
    pub fn create(&self) -> std::io::Result<()> {
        match std::fs::metadata(&self.root) {
            Ok(meta) if !meta.is_dir() => Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "exists and is not a directory",
            )),
            Ok(_) => Ok(()),
            Err(_) => std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&self.root),
        }
    }

    /// The data directory's mode when others than its owner may enter or read it (an existing
    /// directory keeps the mode it was given: the operator is told instead).
    pub fn loose_mode(&self) -> Option<u32> {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&self.root).ok()?.permissions().mode() & 0o777;
        (mode & 0o077 != 0).then_some(mode)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn store_path(&self) -> PathBuf {
        self.root.join("store")
    }

    fn daemon_file(&self) -> PathBuf {
        self.root.join("daemon.json")
    }

    /// The secret in `name`, generating and saving one (mode 0600) if absent. Returns whether it
    /// was generated now.
    pub fn secret(&self, name: &str) -> std::io::Result<(Secret, bool)> {
        let path = self.root.join(name);
        match std::fs::read_to_string(&path) {
            Ok(text) if !text.trim().is_empty() => return Ok((Secret::new(text.trim()), false)),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let token = Alphanumeric.sample_string(&mut rand::rng(), 40);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)?;
        file.write_all(token.as_bytes())?;
        file.sync_all()?;
        Ok((Secret::new(token), true))
    }

    /// A stored secret, without generating one.
    pub fn read_secret(&self, name: &str) -> Option<Secret> {
        std::fs::read_to_string(self.root.join(name))
            .ok()
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty())
            .map(Secret::new)
    }

    pub fn write_daemon_info(&self, info: &DaemonInfo) -> std::io::Result<()> {
        let tmp = self.root.join("daemon.json.tmp");
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(&serde_json::to_vec(info).unwrap_or_default())?;
        drop(file);
        std::fs::rename(tmp, self.daemon_file())
    }

    pub fn daemon_info(&self) -> Option<DaemonInfo> {
        let bytes = std::fs::read(self.daemon_file()).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    pub fn remove_daemon_info(&self) {
        let _ = std::fs::remove_file(self.daemon_file());
    }

    /// The daemon recorded in `daemon.json`, if it still runs on this directory: its process is
    /// alive and the store's lock is held. A file left by a daemon that died (or whose pid was
    /// reused by another program) names nobody: the CLI must not send it the admin token.
    pub fn running_daemon(&self) -> Option<DaemonInfo> {
        let info = self.daemon_info()?;
        let alive = i32::try_from(info.pid).is_ok_and(|pid| pid > 0)
            && Path::new("/proc").join(info.pid.to_string()).exists();
        if !alive || !storage::lock_is_held(&self.store_path()) {
            return None;
        }
        // Held, and by that process: where the kernel says who holds it (`/proc/locks`), the
        // recorded pid must be among the holders (a reused pid next to another holder is not it).
        let db = storage::sled_file(&self.store_path());
        let holders = std::fs::metadata(&db).ok().and_then(|meta| {
            let locks = std::fs::read_to_string("/proc/locks").ok()?;
            Some(lock_holders(&locks, meta.ino()))
        });
        match holders {
            Some(pids) if !pids.is_empty() => pids.contains(&info.pid).then_some(info),
            _ => Some(info),
        }
    }
}

/// The pids that `/proc/locks` (its text in `locks`) shows holding a lock on the file with inode
/// `ino` (waiters, `->`, left out).
fn lock_holders(locks: &str, ino: u64) -> Vec<u32> {
    locks
        .lines()
        .filter_map(|line| {
            // `1: FLOCK  ADVISORY  WRITE 2795 08:02:1234567 0 EOF`
            let mut fields = line.split_whitespace().skip(1);
            if fields.next()? == "->" {
                return None;
            }
            let pid: u32 = fields.nth(2)?.parse().ok()?;
            let inode: u64 = fields.next()?.rsplit(':').next()?.parse().ok()?;
            (inode == ino).then_some(pid)
        })
        .collect()
}

/// Set the process umask to 0077: files the process creates (sled's included) are 0600 and
/// directories 0700, whatever the umask it was started with.
pub fn private_umask() {
    use nix::sys::stat::{umask, Mode};
    umask(Mode::S_IRWXG | Mode::S_IRWXO);
}

pub const WEBHOOK_TOKEN_FILE: &str = "webhook_token";
pub const ADMIN_TOKEN_FILE: &str = "admin_token";

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn lock_holders_are_read_from_proc_locks_lines() {
        let locks = "1: FLOCK  ADVISORY  WRITE 2795 08:02:1234567 0 EOF\n\
                     1: -> FLOCK  ADVISORY  WRITE 2800 08:02:1234567 0 EOF\n\
                     2: POSIX  ADVISORY  READ 311 00:1a:99 0 EOF\n\
                     3: OFDLCK ADVISORY  WRITE -1 08:02:1234567 0 EOF\n\
                     garbage\n";
        assert_eq!(lock_holders(locks, 1_234_567), [2795]);
        assert_eq!(lock_holders(locks, 99), [311]);
        assert!(lock_holders(locks, 5).is_empty());
    }

    #[test]
    fn an_older_daemon_json_without_the_admin_address_means_the_public_one() {
        let old: DaemonInfo =
            serde_json::from_str(r#"{"pid": 7, "listen": "127.0.0.1:8080"}"#).expect("old file");
        assert_eq!(old.admin_addr(), "127.0.0.1:8080");
        let new: DaemonInfo = serde_json::from_str(
            r#"{"pid": 7, "listen": "127.0.0.1:8080", "admin": "127.0.0.1:8081"}"#,
        )
        .expect("new file");
        assert_eq!(new.admin_addr(), "127.0.0.1:8081");
    }

    #[test]
    fn a_recorded_daemon_counts_only_while_alive_and_holding_the_store() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = DataDir::new(dir.path());
        let info = DaemonInfo {
            pid: std::process::id(),
            listen: "127.0.0.1:1".into(),
            admin: None,
        };
        data.write_daemon_info(&info).expect("write");
        // Alive (this test), but nobody holds the store: not running.
        assert_eq!(data.running_daemon(), None);
        // A store locked by another open file description: this process's pid now counts.
        std::fs::create_dir_all(data.store_path()).expect("store dir");
        let db = std::fs::File::create(data.store_path().join("db")).expect("db");
        fs2::FileExt::try_lock_exclusive(&db).expect("lock");
        assert_eq!(data.running_daemon(), Some(info.clone()));
        // A live pid that is not the holder (this process holds the lock): not running.
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn");
        data.write_daemon_info(&DaemonInfo {
            pid: other.id(),
            ..info.clone()
        })
        .expect("write");
        let seen = data.running_daemon();
        let _ = other.kill();
        let _ = other.wait();
        assert_eq!(seen, None, "alive, but another process holds the store");
        // A dead pid with the lock held by someone else: not running either.
        let mut child = std::process::Command::new("true").spawn().expect("spawn");
        let dead = child.id();
        child.wait().expect("reap");
        data.write_daemon_info(&DaemonInfo { pid: dead, ..info })
            .expect("write");
        assert_eq!(data.running_daemon(), None);
    }

    #[test]
    fn a_generated_secret_is_private_and_stable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = DataDir::new(dir.path());
        let (first, generated) = data.secret("webhook_token").expect("secret");
        assert!(generated);
        assert_eq!(first.expose().len(), 40);
        let (again, generated) = data.secret("webhook_token").expect("secret");
        assert!(!generated);
        assert_eq!(first, again);
        let mode = std::fs::metadata(dir.path().join("webhook_token"))
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
