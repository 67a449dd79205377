//! What makes a sled flush durable: an `fdatasync` of sled's file after it.
//!
//! sled 0.34 makes its log writes stable with `sync_file_range` (`IoBufs::write_to_log`), which
//! writes the pages out but neither commits the file's metadata (its new size, the blocks it
//! was given) nor flushes the disk's write cache (sled issues #1351, #1452); its background
//! flusher `fsync`s the file only every `flush_every_ms` (500 ms). After a power loss a write
//! `Db::flush` returned for up to that long before can be missing, and with it what the daemon
//! did on the strength of it: a quarantined delivery answered 200, a decision carried out.
//! [`SledStore::flush`](super::SledStore::flush) therefore syncs sled's file (`db`) after sled's flush,
//! and an open syncs the store's directory once, for a new store's files.
//!
//! Values over a quarter of a segment (about 128 KiB) sled keeps in files of their own under
//! `blobs/`, which it writes without any sync and whose loss it skips on recovery. The daemon
//! keeps its own values under 32 KiB (`MAX_VALUE_BYTES`), but a state grown from large input
//! could pass that size: each sync also syncs the blob files it has not synced yet (none, in
//! normal operation: one directory read), then the directory.
//!
//! A failed `fdatasync` is kept, as sled keeps its first I/O error: the kernel may have dropped
//! the pages it could not write, so a later sync that succeeds proves nothing about them. Every
//! later flush fails, and so does the writer's indexer, whose handling of a failing store (not
//! ready, a probe of the disk, then an exit for the supervisor's restart on a reopened store)
//! takes over. A failure to list or open a blob file is not kept (nothing was synced, nothing
//! dropped): that flush fails, the next one tries again.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
#[cfg(test)]
use std::sync::atomic::AtomicU64;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// sled's data file, kept open to sync it, and its blob directory.
#[derive(Clone)]
pub(super) struct SledFile {
    file: Arc<File>,
    blobs: PathBuf,
    /// The blob files synced so far (those sled removed since are forgotten).
    synced_blobs: Arc<Mutex<HashSet<OsString>>>,
    failed: Arc<AtomicBool>,
    /// Tests: the syncs that succeeded, and whether to make the next `fdatasync` fail.
    #[cfg(test)]
    syncs: Arc<AtomicU64>,
    #[cfg(test)]
    fail_next: Arc<AtomicBool>,
}

/// The file sled 0.34 keeps its log and pages in, under the store's directory.
const SLED_FILE: &str = "db";
/// The directory sled 0.34 keeps its large values in, one file each.
const SLED_BLOBS: &str = "blobs";

/// sled's data file (its log and pages) in the store at `dir`: the file it locks while open, and
/// the file a start replays (see docs/operations.md, "Start time").
pub fn sled_file(dir: &Path) -> PathBuf {
    dir.join(SLED_FILE)
}

impl SledFile {
    /// Open sled's file under `dir` (sled has opened it, so it exists) and sync `dir` itself,
    /// so that a new store's files are found after a power loss.
    pub fn open(dir: &Path) -> std::io::Result<SledFile> {
        let file = File::open(sled_file(dir))?;
        super::eventlog::sync_dir(dir)?;
        Ok(SledFile {
            file: Arc::new(file),
            blobs: dir.join(SLED_BLOBS),
            synced_blobs: Default::default(),
            failed: Default::default(),
            #[cfg(test)]
            syncs: Default::default(),
            #[cfg(test)]
            fail_next: Default::default(),
        })
    }

    /// `fdatasync` sled's file: what sled's flush wrote is on the disk when this returns.
    pub fn sync(&self) -> std::io::Result<()> {
        self.check()?;
        self.sync_blobs()?;
        self.kept(
            self.injected_failure()
                .map_or_else(|| self.file.sync_data(), Err),
        )?;
        #[cfg(test)]
        self.syncs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Make the next `fdatasync` of sled's file fail (tests).
    #[cfg(test)]
    pub fn fail_next_sync(&self) {
        self.fail_next.store(true, Ordering::SeqCst);
    }

    #[cfg(test)]
    fn injected_failure(&self) -> Option<std::io::Error> {
        self.fail_next
            .swap(false, Ordering::SeqCst)
            .then(|| std::io::Error::other("injected sync failure"))
    }

    #[cfg(not(test))]
    fn injected_failure(&self) -> Option<std::io::Error> {
        None
    }

    /// The kept failure of an earlier sync, if any (every flush fails since).
    pub fn check(&self) -> std::io::Result<()> {
        match self.failed.load(Ordering::SeqCst) {
            true => Err(std::io::Error::other(
                "an earlier sync of the store's file failed; a restart reopens it",
            )),
            false => Ok(()),
        }
    }

    /// The result of an `fsync` or `fdatasync`, a failure kept.
    fn kept(&self, synced: std::io::Result<()>) -> std::io::Result<()> {
        if synced.is_err() {
            self.failed.store(true, Ordering::SeqCst);
        }
        synced
    }

    /// Sync the blob files not synced before (a blob is written before the log entry naming
    /// it), then their directory.
    fn sync_blobs(&self) -> std::io::Result<()> {
        let entries = match std::fs::read_dir(&self.blobs) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            other => other?,
        };
        let mut synced = self
            .synced_blobs
            .lock()
            .map_err(|_| std::io::Error::other("blob sync list poisoned"))?;
        let mut present = HashSet::new();
        let mut new = false;
        for entry in entries {
            let name = entry?.file_name();
            if !synced.contains(&name) {
                match File::open(self.blobs.join(&name)) {
                    Ok(file) => self.kept(file.sync_data())?,
                    // sled removed it meanwhile: a newer value replaced it.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(e),
                }
                new = true;
                synced.insert(name.clone());
            }
            present.insert(name);
        }
        synced.retain(|name| present.contains(name));
        if new {
            self.kept(File::open(&self.blobs)?.sync_all())?;
        }
        Ok(())
    }

    /// The blob files synced and still there (tests).
    #[cfg(test)]
    pub fn synced_blobs(&self) -> usize {
        self.synced_blobs.lock().map_or(0, |s| s.len())
    }

    /// Syncs that succeeded since the store was opened (tests).
    #[cfg(test)]
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }
}
