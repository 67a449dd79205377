//! The data directory: the sled store, generated secrets, and the running daemon's address.
//!
//! ```text
//! data/
//!   store/          sled database (state, folded marks, quarantine) and the event log
//!   webhook_token   generated webhook token (0600), when none is configured
//!   admin_token     generated admin token (0600), when none is configured
//!   daemon.json     pid and bound address of the running daemon (removed on clean exit)
//! ```

use crate::config::Secret;
use rand::distr::{Alphanumeric, SampleString};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

pub struct DataDir {
    root: PathBuf,
}

/// Written once the daemon listens; read by the CLI to reach the admin API.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DaemonInfo {
    pub pid: u32,
    pub listen: String,
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
