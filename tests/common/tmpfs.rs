//! A tmpfs for tests that need the store to really fail: the daemon's data directory on a small
//! filesystem of its own that the test can fill (writes then fail with ENOSPC, even for root,
//! whose writes a chmod would not stop) and free again.
//!
//! A read-only remount is not used: the kernel refuses it (EBUSY) while the daemon holds files
//! open for writing, which it always does.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A mounted tmpfs; unmounted when dropped (drop the daemon using it first).
pub struct Tmpfs {
    pub path: PathBuf,
}

impl Tmpfs {
    /// Mount a tmpfs of `size_mb` MiB at `path` (created). Fails the test, with the reason, when
    /// mounting is not permitted: these tests need root, as CI has.
    pub fn mount(path: &Path, size_mb: u32) -> Tmpfs {
        std::fs::create_dir_all(path).expect("mount point");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size_mb}m"), "tmpfs"])
            .arg(path)
            .output()
            .unwrap_or_else(|e| panic!("cannot run mount: {e}"));
        assert!(
            out.status.success(),
            "cannot mount a tmpfs at {} ({}): {}; this test needs root (as in CI)",
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Tmpfs {
            path: path.to_owned(),
        }
    }

    /// Fill the filesystem until a write fails with ENOSPC; the space comes back when the
    /// returned guard is dropped.
    pub fn fill(&self) -> Filler {
        let path = self.path.join("filler");
        let mut file = std::fs::File::create(&path).expect("filler");
        for chunk in [1 << 20, 4096, 1] {
            let buf = vec![0xa5u8; chunk];
            loop {
                match file.write_all(&buf).and_then(|()| file.sync_data()) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(nix::libc::ENOSPC) => break,
                    Err(e) => panic!("filling {}: {e}", self.path.display()),
                }
            }
        }
        Filler { path }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.path)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            // Still busy (a process of the test not reaped yet): detach it now, freed when idle.
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
    }
}

/// The file that fills a [`Tmpfs`]; removed when dropped.
pub struct Filler {
    path: PathBuf,
}

impl Drop for Filler {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
