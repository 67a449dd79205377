//! The event log as intake owns it: the appending end, the dedupe index, the ids in flight, the
//! sequence numbers, and the log's lock. Everything intake needs up to the acknowledgment, none
//! of it in sled.
//!
//! A [`SledStore`](super::SledStore) holds one, opened with sled (`SledStore::open`). A start can also open
//! it first, without sled ([`IntakeLog::open_early`]), so the writer takes deliveries while
//! sled replays its own log, which after a long run takes seconds to minutes
//! (`docs/operations.md`, "Start time"). That needs the two things an open otherwise reads from
//! sled's `meta` tree to be known without it, kept in a small file next to the segments
//! ([`IntakeState`], `events/intake-state.json`) by every open and every prune pass:
//! - where the dedupe index starts (`DEDUPE_PRUNED_TO`);
//! - a floor for the sequence numbers: the number counter then, so above every number given out
//!   so far, including those of segments the pass deleted. New numbers go above it and above
//!   the highest in the log (what was numbered since the file was written).
//!
//! And the index checkpoint (`INDEXED_TO`), which judges a torn tail, is not needed when the tail
//! is clean: an early open is refused (the start opens sled first, as before) when the tail is
//! torn, when the file is missing (a store this build has not opened yet) or when the store keeps
//! an older layout's dedupe trees in sled.

use super::dedupe::DedupeIndex;
use super::eventlog::{self, Appender, LogPosition, Tail};
use super::intake::InFlight;
use super::{StoreError, LOCK_RETRIES};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The file (in the event log's directory) that lets a start open the log without sled.
const STATE_FILE: &str = "intake-state.json";
/// The log's lock file: held by whoever appends (the daemon, an offline command).
const LOCK_FILE: &str = "lock";

/// What an early open needs from sled's `meta` tree, kept beside the log (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct IntakeState {
    /// The store's layout when written: an early open needs the current one.
    pub layout: u32,
    /// The first segment whose ids the dedupe index holds.
    pub dedupe_from: u64,
    /// Every sequence number given out when written is at or below it: numbers go above it.
    pub seq_floor: u64,
}

impl IntakeState {
    fn read(log_dir: &Path) -> Option<IntakeState> {
        let bytes = std::fs::read(log_dir.join(STATE_FILE)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Write it whole (a temporary file, synced, renamed over the old one).
    pub(super) fn write(&self, log_dir: &Path) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let tmp = log_dir.join(format!("{STATE_FILE}.tmp"));
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(&serde_json::to_vec(self).map_err(std::io::Error::other)?)?;
        file.sync_all()?;
        std::fs::rename(&tmp, log_dir.join(STATE_FILE))?;
        eventlog::sync_dir(log_dir)
    }

    /// Remove it: the store keeps something only sled knows (an older layout's dedupe trees).
    pub(super) fn remove(log_dir: &Path) -> std::io::Result<()> {
        match std::fs::remove_file(log_dir.join(STATE_FILE)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// See the module doc. Cloning is cheap (shared parts); the lock is held while any clone lives.
#[derive(Clone)]
pub struct IntakeLog {
    pub(super) dir: PathBuf,
    pub(super) appender: Arc<Mutex<Appender>>,
    /// Which ids are in the event log (see `dedupe`).
    pub(super) dedupe: Arc<Mutex<DedupeIndex>>,
    /// Accepted ids not yet indexed (see `intake`).
    pub(super) in_flight: Arc<Mutex<InFlight>>,
    /// The next event's sequence number (see [`IntakeLog::next_seq`]).
    pub(super) next_seq: Arc<AtomicU64>,
    /// Messages of new events handed to the dispatcher (see `SledStore::count_hand_over`).
    pub(super) handed_over: Arc<AtomicU64>,
    /// A [`Writer`](super::Writer) owns intake: `SledStore::accept_many` must not run beside it
    /// (both would advance the index checkpoint over the other's frames).
    pub(super) writer_started: Arc<AtomicBool>,
    /// Where the log ended when the writer started: frames before it were there at the open
    /// (a start's recovery and scan take them), frames from it on are the writer's (its indexer
    /// indexes them and hands them to the dispatcher).
    pub(super) writer_from: Arc<OnceLock<LogPosition>>,
    /// The newest segment ended in a torn write, cut off at the open.
    pub(super) torn_tail: bool,
    _lock: Arc<File>,
}

impl IntakeLog {
    /// Open the log of the store at `store_dir` without sled, if it can be (see the module doc):
    /// `Ok(None)` when sled must open first. Takes the log's lock (`StoreError::Locked` when
    /// another process holds it).
    pub fn open_early(
        store_dir: &Path,
        segment_bytes: u64,
    ) -> Result<Option<IntakeLog>, StoreError> {
        let dir = store_dir.join(super::EVENT_LOG_DIR);
        let Some(state) = IntakeState::read(&dir) else {
            return Ok(None);
        };
        if state.layout != super::LAYOUT_VERSION {
            return Ok(None);
        }
        let lock = lock(store_dir, &dir)?;
        // A daemon of a build from before the log's lock holds sled's instead, and appends.
        if super::held_by_another_process(store_dir) {
            return Err(StoreError::Locked {
                path: store_dir.display().to_string(),
            });
        }
        match eventlog::check_tail(&dir) {
            Ok(Tail::Clean) => {}
            // Torn (its judgement needs sled's checkpoint) or damaged (the open with sled says
            // why, as before).
            _ => return Ok(None),
        }
        let log = IntakeLog::open_locked(&dir, segment_bytes, state.dedupe_from, lock)?;
        let last = eventlog::last_seq(&dir).map_err(log_io(&dir))?;
        let next = last
            .max(Some(state.seq_floor))
            .map_or(0, |n| n.saturating_add(1));
        log.next_seq.fetch_max(next, Ordering::SeqCst);
        Ok(Some(log))
    }

    /// Open the log in `dir` under its `lock`, its dedupe index from segment `dedupe_from`
    /// (with sled: sled's record of it; early: the state file's), a torn tail cut off.
    pub(super) fn open_locked(
        dir: &Path,
        segment_bytes: u64,
        dedupe_from: u64,
        lock: Arc<File>,
    ) -> Result<IntakeLog, StoreError> {
        if segment_bytes > super::MAX_SEGMENT_BYTES {
            return Err(StoreError::Internal(format!(
                "event log segments of {segment_bytes} bytes exceed {}",
                super::MAX_SEGMENT_BYTES
            )));
        }
        let (appender, torn_tail) = Appender::open(dir, segment_bytes).map_err(log_io(dir))?;
        let dedupe = DedupeIndex::load(dir, dedupe_from).map_err(log_io(dir))?;
        Ok(IntakeLog {
            dir: dir.to_owned(),
            appender: Arc::new(Mutex::new(appender)),
            dedupe: Arc::new(Mutex::new(dedupe)),
            in_flight: Default::default(),
            next_seq: Default::default(),
            handed_over: Default::default(),
            writer_started: Default::default(),
            writer_from: Default::default(),
            torn_tail,
            _lock: lock,
        })
    }

    /// A new event's sequence number. Drawn from an in-memory counter rather than sled's
    /// `generate_id`, which takes sled's global concurrency lock: on the writer's path (before
    /// the acknowledgment) it waited for every sled transaction to commit.
    pub(crate) fn next_seq(&self) -> u64 {
        self.next_seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Where the writer's frames begin, once a writer started (see the field).
    pub fn writer_from(&self) -> Option<LogPosition> {
        self.writer_from.get().copied()
    }

    /// A writer takes intake over: refused for a second one. Records where its frames begin.
    pub(super) fn start_writer(&self) -> Result<(), StoreError> {
        if self.writer_started.swap(true, Ordering::SeqCst) {
            return Err(StoreError::Internal("a second writer on one store".into()));
        }
        let end = self.appender.lock().map_err(|_| poisoned())?.end();
        let _ = self.writer_from.set(end);
        Ok(())
    }
}

/// Take the log's lock (its directory made if needed), waiting as long as for sled's: a store
/// this process just closed is released within moments.
pub(super) fn lock(store_dir: &Path, dir: &Path) -> Result<Arc<File>, StoreError> {
    use fs2::FileExt;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    // Owner-only whatever the umask: the bodies are the conversations' messages.
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(log_io(dir))?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(dir.join(LOCK_FILE))
        .map_err(log_io(dir))?;
    for _ in 0..=LOCK_RETRIES {
        if file.try_lock_exclusive().is_ok() {
            return Ok(Arc::new(file));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Err(StoreError::Locked {
        path: store_dir.display().to_string(),
    })
}

fn log_io(dir: &Path) -> impl Fn(std::io::Error) -> StoreError + '_ {
    move |e| StoreError::Log(format!("{}: {e}", dir.display()))
}

fn poisoned() -> StoreError {
    StoreError::Corrupt("event log lock poisoned (a writer panicked)".into())
}
