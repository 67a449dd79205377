//! The durable store: the storage port ([`port`]: what the daemon asks of a store, in nine groups,
//! the intake [`Writer`] and the fold sessions in which the engine's batch fold reads and a
//! backend commits its write set), and its backend today, [`SledStore`]: the event log (segment
//! files, [`eventlog`]) and, in sled, per-conversation state, the folds' position, outbox and
//! quarantine, each port group implemented in the module that owns it (`intake`, `fold`,
//! `outbox`, `timers`, `reads`, `quarantine`, `operators`, `retention`, this one). This is the only
//! crate that imports sled; keys are built in [`keys`]. For tests (`test-support`): an
//! in-memory backend (`mem`) and the port's conformance suite (`conformance`), which runs against
//! both.
//!
//! Invariants the sled backend keeps:
//! - an event is acknowledged only once its frame is synced in the event log; its ids then go
//!   into the in-memory dedupe index (rebuilt from the log on open), so an acknowledged event is
//!   never lost and never accepted twice;
//! - the event log is the inbox (layout 4): an event is still to fold while its sequence number
//!   is above its partition's folded mark (`folded/v1`). Folding an event raises that mark with
//!   the fold's other writes, atomically (one journal, [`journal`]), so a crash can neither lose
//!   nor repeat the fold. A start scans the log from the folds' low watermark
//!   (`meta/fold_from`), which each fold also writes.

pub mod asks;
pub mod backup;
#[cfg(any(test, feature = "test-support"))]
pub mod conformance;
pub mod dedupe;
mod derived;
pub mod desk;
pub mod desk_links;
pub mod dump;
mod durable;
pub mod eventlog;
mod fold;
mod history;
pub mod idempotency;
pub mod intake;
mod journal;
pub mod keys;
pub mod lease;
mod log;
#[cfg(any(test, feature = "test-support"))]
pub mod mem;
pub mod operators;
pub mod outbox;
mod pages;
pub mod port;
mod quarantine;
pub mod queue;
mod reads;
pub mod replay;
pub mod retention;
#[cfg(any(test, feature = "test-support"))]
pub mod test_support;
pub mod timers;
pub mod watch;
pub mod writer;

use engine::state::{ConversationState, EndUserState};
use journal::Journal;
use model::cursor::Cursor;
use model::ids::{DeliveryId, EventId, PartitionKey};
use model::webhook::model::{Event, Millis};
use model::webhook::IncomingEvent;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sled::transaction::{ConflictableTransactionError, TransactionError};
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub use derived::key as derived_key;
pub use durable::sled_file;
pub use eventlog::sync_dir;
pub use fold::replayed;
pub use intake::{Checked, Unindexed};
pub use log::IntakeLog;
use port::{Lifecycle, Retention};
pub use port::{Storage, Writer};
pub use timers::{DueTimer, TimerKey};
pub use writer::{AcceptJob, NewEvent};

/// The daemon's store: whichever backend was opened, shared (see [`port`]).
pub type Store = Arc<dyn Storage>;

/// Layout 1's intake log, inside the store directory (read once, when migrating).
const LEGACY_WAL_FILE: &str = "intake.wal";
/// How often (50 ms apart) a locked store is tried again before it is reported in use.
const LOCK_RETRIES: u32 = 20;
/// The event log's directory, inside the store directory.
const EVENT_LOG_DIR: &str = "events";

/// Layout version written on first open; a newer one refuses to open, an older one is migrated.
/// 2: event bodies in the event log instead of sled. 3: dedupe records out of sled (the event
/// log's ids, indexed in memory: `dedupe`). 4: no sled inbox (the event log with per-partition
/// folded marks and a low watermark; see `docs/store-layout-4.md`).
pub const LAYOUT_VERSION: u32 = 4;
/// Event log segments larger than this would not fit the dedupe index's 32-bit offsets.
const MAX_SEGMENT_BYTES: u64 = 1 << 30;

/// A failure of the store's backend, kept opaque: no backend type crosses the port. It says
/// whether the disk (or whatever holds the store) failed, which the daemon tells apart from a
/// store that holds something wrong ([`StoreError::is_disk_failure`]). Shown as its cause.
#[derive(Debug)]
pub struct BackendError {
    cause: Box<dyn std::error::Error + Send + Sync>,
    disk: bool,
}

impl BackendError {
    /// For backends: a failure, and whether it is the disk's (an I/O error).
    pub fn new(cause: impl Into<Box<dyn std::error::Error + Send + Sync>>, disk: bool) -> Self {
        BackendError {
            cause: cause.into(),
            disk,
        }
    }
}

impl std::fmt::Display for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.cause.fmt(f)
    }
}

impl std::error::Error for BackendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause.source()
    }
}

/// sled's failures: its I/O errors are the disk's.
impl From<sled::Error> for BackendError {
    fn from(e: sled::Error) -> Self {
        let disk = matches!(e, sled::Error::Io(_));
        BackendError::new(e, disk)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store I/O failed: {0}")]
    Backend(BackendError),
    #[error("store is corrupt: {0}")]
    Corrupt(String),
    #[error("store layout version {found} is newer than this binary supports ({supported})")]
    TooNew { found: u32, supported: u32 },
    #[error("the store at {path} is in use by another process (is the daemon running?)")]
    Locked { path: String },
    /// sled refused to open its files (damaged, unreadable): named with the path, since the
    /// daemon stops on it.
    #[error("cannot open the store at {path}: {source}")]
    Open { path: String, source: BackendError },
    #[error("event log: {0}")]
    Log(String),
    /// An `fsync`/`fdatasync` of sled's files failed (`durable`), now or earlier (a failure is
    /// kept): every flush fails until the store is reopened.
    #[error("syncing the store's file to disk failed: {0}")]
    Sync(std::io::Error),
    /// A fold's writes were left half applied by a failing store (`journal`): folds wait for a
    /// restart, which completes them.
    #[error(
        "an earlier fold's writes are half applied after a store failure; a restart completes them"
    )]
    HalfApplied,
    /// The event log takes deliveries but sled is still opening (an early start, see `log`):
    /// what needs sled (a quarantine record) waits for it.
    #[error("the store is still opening")]
    Opening,
    /// Only a restart mends the store (a backend that keeps failing although its disk takes
    /// writes again, a fold half applied): whoever finds it reports it to [`Stuck`].
    #[error("the store fails until it is reopened; a restart mends it")]
    Stuck,
    /// A write of the active's work by a node whose lease moved on or ran out (see [`lease`]):
    /// refused, nothing written. The node is not the active one (any more).
    #[error("this node no longer holds the lease: the write was refused (another node is active)")]
    Fenced,
    /// A broken internal rule (a bug), refused instead of risking the store.
    #[error("internal error: {0}")]
    Internal(String),
}

impl StoreError {
    /// Whether the disk failed the store (an I/O error from sled, or a failed sync of its file),
    /// as opposed to what it holds being wrong.
    pub fn is_disk_failure(&self) -> bool {
        match self {
            StoreError::Backend(e) => e.disk,
            StoreError::Sync(_) => true,
            _ => false,
        }
    }
}

impl From<sled::Error> for StoreError {
    fn from(e: sled::Error) -> Self {
        StoreError::Backend(e.into())
    }
}

impl From<TransactionError<String>> for StoreError {
    fn from(e: TransactionError<String>) -> Self {
        match e {
            TransactionError::Abort(msg) => StoreError::Corrupt(msg),
            TransactionError::Storage(e) => e.into(),
        }
    }
}

/// The largest value written where it could grow past it (a fold's journal, a quarantined
/// body); more goes in chunks of this size. sled 0.34 keeps a value over a quarter segment (128
/// KiB by default, less its headers) as a blob file of its own, which it writes without a sync
/// and whose loss it skips on recovery: a write in one could vanish after a power loss while
/// later writes survive (a store flush syncs the blobs, `durable`, but the journal's writes
/// between flushes must recover as a prefix too). Values well under that stay in sled's log,
/// whose recovery is a prefix.
const MAX_VALUE_BYTES: usize = 32 * 1024;

/// A quarantine record as stored: a large body is in chunks, of which the record notes the
/// number and the body's size (for lists, which do not read bodies).
#[derive(Serialize, Deserialize)]
struct StoredQuarantine {
    #[serde(flatten)]
    record: QuarantineRecord,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    body_chunks: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    body_bytes: Option<u64>,
}

/// One accepted event as kept in the event log.
#[derive(Debug, Serialize, Deserialize)]
pub struct EventRecord {
    pub seq: u64,
    pub id: EventId,
    pub delivery: DeliveryId,
    pub received_at: Millis,
    pub partition: String,
    pub kind: String,
    /// The event exactly as the service sent it.
    pub event: Box<RawValue>,
}

impl EventRecord {
    /// Event `i` of a log frame.
    fn from_log(record: &eventlog::LogRecord, i: usize) -> Result<EventRecord, StoreError> {
        #[derive(Deserialize)]
        struct Kind {
            event: String,
        }
        let field = |v: Option<&String>| v.cloned().ok_or_else(|| corrupt("event log frame"));
        let raw = record
            .events
            .get(i)
            .ok_or_else(|| corrupt("event log frame"))?;
        let kind = serde_json::from_str::<Kind>(raw.get())
            .map(|k| k.event)
            .unwrap_or_default();
        Ok(EventRecord {
            seq: *record
                .seqs
                .get(i)
                .ok_or_else(|| corrupt("event log frame"))?,
            id: EventId::new(field(record.ids.get(i))?),
            delivery: DeliveryId::new(record.delivery.clone()),
            received_at: record.received_at,
            partition: field(record.partitions.get(i))?,
            kind,
            event: raw.clone(),
        })
    }
}

/// The events still to fold when a store opens (see [`SledStore::pending`]).
#[derive(Debug, Default)]
pub struct Pending {
    pub events: Vec<PendingEvent>,
    /// Where the log ended: every event after it reaches the dispatcher from intake.
    pub end: Cursor,
}

impl Pending {
    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Numbers and partitions, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &PartitionKey)> {
        self.events.iter().map(|p| (p.seq, &p.partition))
    }
}

/// Folded marks read so far (a scan reads each partition's once).
#[derive(Default)]
struct Marks {
    read: HashMap<String, Option<u64>>,
}

impl Marks {
    fn get(&mut self, store: &SledStore, partition: &str) -> Result<Option<u64>, StoreError> {
        if let Some(mark) = self.read.get(partition) {
            return Ok(*mark);
        }
        let mark = store.mark(partition)?;
        self.read.insert(partition.to_owned(), mark);
        Ok(mark)
    }

    /// Still to fold: at or past the watermark (everything before it is folded, and a store
    /// migrated from layout 3 has no marks for what was folded before its watermark) and above
    /// its partition's mark.
    fn is_pending(
        &mut self,
        store: &SledStore,
        fold_from: eventlog::LogPosition,
        at: eventlog::LogPosition,
        partition: &str,
        seq: u64,
    ) -> Result<bool, StoreError> {
        Ok(at >= fold_from && self.above(store, partition, seq)?)
    }

    /// Above its partition's mark.
    fn above(&mut self, store: &SledStore, partition: &str, seq: u64) -> Result<bool, StoreError> {
        Ok(self.get(store, partition)?.is_none_or(|mark| seq > mark))
    }
}

/// What `accept` did with a delivery.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Accepted {
    /// Newly stored events: (sequence number, partition), in delivery order.
    pub new: Vec<(u64, PartitionKey)>,
    /// Position in the given slice of each newly stored event.
    pub new_index: Vec<usize>,
    /// Events already stored earlier (or twice in this delivery).
    pub duplicate_events: usize,
    /// The delivery id itself was seen before: its events were not looked at one by one (they
    /// all count as duplicates).
    pub duplicate_delivery: bool,
    /// Quarantine ids of the delivery's invalid events (stored only for a delivery seen first).
    pub quarantined: Vec<u64>,
}

impl Accepted {
    /// The items (one per event of the delivery, in its order) of the newly stored events.
    pub fn pick_new<T>(&self, items: Vec<T>) -> Vec<T> {
        let mut wanted = self.new_index.iter().copied().peekable();
        items
            .into_iter()
            .enumerate()
            .filter_map(|(i, item)| wanted.next_if_eq(&i).map(|_| item))
            .collect()
    }
}

/// One delivery to store: its valid events, and its invalid ones for quarantine.
#[derive(Clone, Copy)]
pub struct AcceptRequest<'a> {
    pub delivery: &'a DeliveryId,
    pub events: &'a [IncomingEvent],
    pub invalid: &'a [QuarantineRecord],
    pub received_at: Millis,
}

/// A quarantined body: a whole delivery, one invalid event of one, or all the invalid events of
/// one (`events`: the body is a JSON array of them, in delivery order).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct QuarantineRecord {
    pub id: u64,
    pub received_at: Millis,
    /// `delivery`, `event` or `events`.
    pub scope: String,
    /// Stable reason code (`invalid_json`, `invalid_format`, `empty_batch`, `too_many_events`,
    /// `unsupported_content_type`, `invalid_event`).
    pub reason: String,
    pub detail: String,
    pub delivery_id: Option<String>,
    pub content_type: Option<String>,
    /// The body as received, base64 so any bytes survive; gzip-compressed first when
    /// `body_gzip` (bodies over [`QuarantineRecord::GZIP_OVER`]).
    pub body_base64: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub body_gzip: bool,
}

impl QuarantineRecord {
    /// Bodies longer than this are stored gzip-compressed: a hostile body at the size limit is
    /// mostly repetition (millions of `{}` events) and shrinks to a few KiB.
    pub const GZIP_OVER: usize = 64 * 1024;
    /// The most a stored body may expand to when read (a damaged record cannot exhaust memory).
    const MAX_EXPANDED: u64 = 256 * 1024 * 1024;

    /// A record for `store.quarantine` (which assigns the id).
    pub fn new(scope: &str, reason: &str, detail: &str, body: &[u8], received_at: Millis) -> Self {
        use base64::Engine;
        let gzipped = (body.len() > Self::GZIP_OVER)
            .then(|| gzip(body))
            .and_then(|z| z.ok());
        QuarantineRecord {
            id: 0,
            received_at,
            scope: scope.to_owned(),
            reason: reason.to_owned(),
            detail: detail.to_owned(),
            delivery_id: None,
            content_type: None,
            body_base64: base64::engine::general_purpose::STANDARD
                .encode(gzipped.as_deref().unwrap_or(body)),
            body_gzip: gzipped.is_some(),
        }
    }

    /// A record for one invalid event of an otherwise valid delivery.
    pub fn invalid_event(
        reason: &str,
        raw: &str,
        delivery_id: &str,
        content_type: Option<&str>,
        received_at: Millis,
    ) -> Self {
        let mut record = QuarantineRecord::new(
            "event",
            "invalid_event",
            reason,
            raw.as_bytes(),
            received_at,
        );
        record.delivery_id = Some(delivery_id.to_owned());
        record.content_type = content_type.map(str::to_owned);
        record
    }

    /// The one record for all the invalid events of a delivery (`None` when it has none): scope
    /// `event` with the event as its body when there is one, else scope `events` with a JSON
    /// array of them as its body, in delivery order, and the first reasons in `detail` (each is
    /// found again by re-processing: validation is pure).
    pub fn invalid_events(
        bad: &[model::webhook::InvalidEvent],
        delivery_id: &str,
        content_type: Option<&str>,
        received_at: Millis,
    ) -> Option<Self> {
        /// Reasons quoted in `detail`.
        const QUOTED: usize = 5;
        match bad {
            [] => None,
            [one] => Some(Self::invalid_event(
                &one.reason,
                &one.raw,
                delivery_id,
                content_type,
                received_at,
            )),
            many => {
                let mut body = Vec::with_capacity(many.iter().map(|b| b.raw.len() + 1).sum());
                body.push(b'[');
                for (i, b) in many.iter().enumerate() {
                    if i > 0 {
                        body.push(b',');
                    }
                    body.extend_from_slice(b.raw.as_bytes());
                }
                body.push(b']');
                let mut detail = format!("{} invalid events", many.len());
                for (i, b) in many.iter().take(QUOTED).enumerate() {
                    detail.push_str(&format!("; [{i}] {}", b.reason));
                }
                if many.len() > QUOTED {
                    detail.push_str(&format!("; and {} more", many.len() - QUOTED));
                }
                let mut record =
                    QuarantineRecord::new("events", "invalid_event", &detail, &body, received_at);
                record.delivery_id = Some(delivery_id.to_owned());
                record.content_type = content_type.map(str::to_owned);
                Some(record)
            }
        }
    }

    /// The body's size as received (without expanding it).
    pub fn body_len(&self) -> u64 {
        body_len(&self.body_base64, self.body_gzip)
    }

    /// What a list shows of it (as [`Quarantine::quarantine_page`](crate::port::Quarantine)
    /// reads it), without the body.
    pub fn meta(&self) -> QuarantineMeta {
        QuarantineMeta {
            id: self.id,
            received_at: self.received_at,
            scope: self.scope.clone(),
            reason: self.reason.clone(),
            detail: self.detail.clone(),
            delivery_id: self.delivery_id.clone(),
            content_type: self.content_type.clone(),
            body_bytes: self.body_len(),
            body_gzip: self.body_gzip,
        }
    }

    /// At most the first `limit` bytes of the body as received (a compressed body is expanded
    /// only that far).
    pub fn body_prefix(&self, limit: usize) -> Result<Vec<u8>, StoreError> {
        use base64::Engine;
        use std::io::Read as _;
        let mut stored = base64::engine::general_purpose::STANDARD
            .decode(&self.body_base64)
            .map_err(|e| StoreError::Corrupt(format!("quarantine body: {e}")))?;
        if !self.body_gzip {
            stored.truncate(limit);
            return Ok(stored);
        }
        let mut body = Vec::new();
        flate2::read::GzDecoder::new(stored.as_slice())
            .take(limit as u64)
            .read_to_end(&mut body)
            .map_err(|e| StoreError::Corrupt(format!("quarantine body: {e}")))?;
        Ok(body)
    }

    /// The body as received.
    pub fn body(&self) -> Result<Vec<u8>, StoreError> {
        use base64::Engine;
        use std::io::Read as _;
        let stored = base64::engine::general_purpose::STANDARD
            .decode(&self.body_base64)
            .map_err(|e| StoreError::Corrupt(format!("quarantine body: {e}")))?;
        if !self.body_gzip {
            return Ok(stored);
        }
        let mut body = Vec::new();
        flate2::read::GzDecoder::new(stored.as_slice())
            .take(Self::MAX_EXPANDED)
            .read_to_end(&mut body)
            .map_err(|e| StoreError::Corrupt(format!("quarantine body: {e}")))?;
        Ok(body)
    }
}

/// A quarantine record without its body: what the list shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QuarantineMeta {
    pub id: u64,
    pub received_at: Millis,
    pub scope: String,
    pub reason: String,
    pub detail: String,
    pub delivery_id: Option<String>,
    pub content_type: Option<String>,
    /// The body's size as received.
    pub body_bytes: u64,
    /// Whether the store keeps it gzip-compressed.
    pub body_gzip: bool,
}

/// A stored record read without copying its body out.
#[derive(Deserialize)]
struct QuarantineMetaRaw<'a> {
    id: u64,
    received_at: Millis,
    scope: String,
    reason: String,
    detail: String,
    delivery_id: Option<String>,
    content_type: Option<String>,
    #[serde(borrow)]
    body_base64: std::borrow::Cow<'a, str>,
    #[serde(default)]
    body_gzip: bool,
    /// A body kept in chunks: its size, noted in the record (see [`StoredQuarantine`]).
    #[serde(default)]
    body_bytes: Option<u64>,
}

impl QuarantineMetaRaw<'_> {
    fn into_meta(self) -> QuarantineMeta {
        QuarantineMeta {
            body_bytes: self
                .body_bytes
                .unwrap_or_else(|| body_len(&self.body_base64, self.body_gzip)),
            id: self.id,
            received_at: self.received_at,
            scope: self.scope,
            reason: self.reason,
            detail: self.detail,
            delivery_id: self.delivery_id,
            content_type: self.content_type,
            body_gzip: self.body_gzip,
        }
    }
}

/// The size of a stored body as received, from its base64 text without decoding it all: the
/// decoded length, or for a gzip stream its trailer's ISIZE (the size modulo 2^32; bodies are far
/// smaller). 0 when the text is not valid base64 (reading the body then says so).
fn body_len(base64_text: &str, gzipped: bool) -> u64 {
    use base64::Engine as _;
    let text = base64_text.as_bytes();
    if !text.len().is_multiple_of(4) {
        return 0;
    }
    let padding = text.iter().rev().take(2).filter(|&&b| b == b'=').count();
    let stored = (text.len() / 4 * 3 - padding) as u64;
    if !gzipped {
        return stored;
    }
    // The last 8 characters hold the stream's last 4 to 6 bytes.
    let tail = &text[text.len().saturating_sub(8)..];
    match base64::engine::general_purpose::STANDARD.decode(tail) {
        Ok(bytes) if bytes.len() >= 4 => {
            let isize: [u8; 4] = bytes[bytes.len() - 4..].try_into().unwrap_or([0; 4]);
            u64::from(u32::from_le_bytes(isize))
        }
        _ => 0,
    }
}

fn gzip(body: &[u8]) -> std::io::Result<Vec<u8>> {
    use std::io::Write as _;
    let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    z.write_all(body)?;
    z.finish()
}

/// Counts of stored records, for metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Sizes {
    pub conversations: u64,
    pub end_users: u64,
    pub bots: u64,
    pub quarantine: u64,
}

pub use engine::batch::{Applied, PendingEvent, Position};

/// What a pass of [`Retention::prune_events`](port::Retention::prune_events) removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Event and delivery ids the dedupe window no longer holds.
    pub ids_forgotten: u64,
    /// The stored events' units removed (the sled backend's: event log segment files).
    pub event_chunks: u64,
}

#[derive(Clone)]
pub struct SledStore {
    db: sled::Db,
    /// Dedupe records of a store from before layout 3, consulted until they are past the dedupe
    /// window (see [`Legacy`]).
    legacy: Arc<std::sync::RwLock<Option<Legacy>>>,
    /// Per partition, the last folded event (see [`keys::tree::FOLDED`]).
    folded: sled::Tree,
    conversations: sled::Tree,
    end_users: sled::Tree,
    user_index: sled::Tree,
    bots: sled::Tree,
    quarantine: sled::Tree,
    /// Large quarantine bodies, in chunks (see [`SledStore::quarantine`]).
    quarantine_bodies: sled::Tree,
    outbox: sled::Tree,
    dead_letters: sled::Tree,
    outbox_retry: sled::Tree,
    actions: sled::Tree,
    done: sled::Tree,
    timers: sled::Tree,
    /// The waiting queue (see [`queue`]).
    queue: sled::Tree,
    /// The retention index (see [`retention`]).
    activity: sled::Tree,
    /// The event log by partition (see [`history`]).
    partition_events: sled::Tree,
    meta: sled::Tree,
    /// sled's file, synced after each flush (see `durable`).
    sled_file: durable::SledFile,
    /// See [`SledStore::timer_wakeup`].
    timer_wakeup: Arc<timers::TimerWakeup>,
    log_dir: PathBuf,
    /// The event log's intake side: appending end, dedupe index, ids in flight, sequence
    /// numbers, lock (see `log`).
    log: IntakeLog,
    /// Layout 1's intake log (migrated on open).
    wal_path: PathBuf,
    /// Held for a whole fold (see `apply`).
    fold_lock: std::sync::Arc<std::sync::Mutex<()>>,
    /// A fold's journal was written but not all applied (see `journal`).
    half_applied: Arc<std::sync::atomic::AtomicBool>,
    /// The waiting queue's request times, counted (see [`SledStore::queue_summary`]).
    waiting: Arc<Mutex<queue::WaitingCounts>>,
    /// The daemon's time (its test clock's offset included): see [`SledStore::with_clock`].
    clock: model::clock::Clock,
    /// This open's lease (see [`lease`]): always this node's.
    lease: Arc<lease::SledLease>,
}

/// Where a failure of the store that only a restart mends is reported (a store that still fails
/// after its disk takes writes again; a fold left half applied): whoever finds it
/// ([`StoreError::Stuck`]) reports it, and whoever watches ends the daemon at once, as a crash
/// would, with the exit code it carries. Nothing parks: what was under way is found again by the
/// next start.
#[derive(Clone, Debug)]
pub struct Stuck(Arc<tokio::sync::watch::Sender<Option<i32>>>);

impl Stuck {
    /// A report point, and what watches it (the exit code the daemon ends with).
    pub fn new() -> (Stuck, tokio::sync::watch::Receiver<Option<i32>>) {
        let (tx, rx) = tokio::sync::watch::channel(None);
        (Stuck(Arc::new(tx)), rx)
    }

    /// Only a restart mends the store ([`StoreError::Stuck`]): the daemon ends at once, with
    /// [`writer::STORE_STUCK_EXIT`], as a crash would.
    pub fn report(&self) {
        self.0.send_replace(Some(writer::STORE_STUCK_EXIT));
    }
}

/// The sled dedupe trees of layouts 1 and 2. Layout 1's records may name events whose bodies
/// were pruned before its migration (so they are in no log segment): rather than sort them out,
/// every record is kept and consulted until the whole set is past the dedupe window (it was
/// complete when the store was migrated), then the trees are dropped.
struct Legacy {
    seen: sled::Tree,
    deliveries: sled::Tree,
    /// When the store was migrated to layout 3: every record is older.
    since: Millis,
}

impl SledStore {
    /// The store reading the daemon's time from `clock` (the application's, which its test clock
    /// moves) instead of a clock of its own at the system's time. Set before it is cloned.
    pub fn with_clock(mut self, clock: model::clock::Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Open (or create) the store under `dir`.
    pub fn open(dir: &Path, cache_capacity: u64) -> Result<Self, StoreError> {
        Self::open_with(dir, cache_capacity, eventlog::SEGMENT_BYTES)
    }

    /// [`open`](SledStore::open) with a given event log segment size (tests use small ones).
    pub fn open_with(
        dir: &Path,
        cache_capacity: u64,
        segment_bytes: u64,
    ) -> Result<Self, StoreError> {
        let log_dir = dir.join(EVENT_LOG_DIR);
        let lock = log::lock(dir, &log_dir)?;
        // Judge the log's tail before sled opens (which writes to its files): a store refused
        // for a damaged log is left exactly as it was found.
        let tail = match eventlog::check_tail(&log_dir) {
            Ok(tail) => tail,
            // A daemon of an older build (without the log's lock) appending while we read can
            // look damaged: report it as in use.
            Err(_) if held_by_another_process(dir) => {
                return Err(StoreError::Locked {
                    path: dir.display().to_string(),
                })
            }
            Err(e) => return Err(log_check_error(&log_dir)(e)),
        };
        let db = open_sled(dir, cache_capacity)?;
        let meta = db.open_tree(keys::tree::META)?;
        // Frames up to the index checkpoint were acknowledged: damage there is no torn write.
        let indexed = meta
            .get(keys::meta::INDEXED_TO)?
            .and_then(|b| eventlog::LogPosition::decode(&b))
            .unwrap_or_default();
        tail.check_indexed(&log_dir, indexed)
            .map_err(log_check_error(&log_dir))?;
        let dedupe_from = meta
            .get(keys::meta::DEDUPE_PRUNED_TO)?
            .and_then(|b| eventlog::LogPosition::decode(&b))
            .map_or(0, |at| at.segment);
        let log = IntakeLog::open_locked(&log_dir, segment_bytes, dedupe_from, lock)?;
        SledStore::finish_open(dir, db, log)
    }

    /// Open sled for an event log opened before it ([`IntakeLog::open_early`]), whose writer
    /// may be taking deliveries meanwhile: its frames are its indexer's, not this open's.
    pub fn open_after_log(
        dir: &Path,
        cache_capacity: u64,
        log: IntakeLog,
    ) -> Result<Self, StoreError> {
        let db = open_sled(dir, cache_capacity)?;
        SledStore::finish_open(dir, db, log)
    }

    fn finish_open(dir: &Path, db: sled::Db, log: IntakeLog) -> Result<Self, StoreError> {
        let sled_file = durable::SledFile::open(dir).map_err(|e| StoreError::Open {
            path: dir.display().to_string(),
            source: sled::Error::Io(e).into(),
        })?;
        let t = |name: &str| db.open_tree(name);
        let torn_tail = log.torn_tail;
        let store = SledStore {
            legacy: Default::default(),
            folded: t(keys::tree::FOLDED)?,
            conversations: t(keys::tree::CONVERSATIONS)?,
            end_users: t(keys::tree::END_USERS)?,
            user_index: t(keys::tree::USER_INDEX)?,
            bots: t(keys::tree::BOTS)?,
            quarantine: t(keys::tree::QUARANTINE)?,
            quarantine_bodies: t(keys::tree::QUARANTINE_BODIES)?,
            outbox: t(keys::tree::OUTBOX)?,
            dead_letters: t(keys::tree::DEAD_LETTERS)?,
            outbox_retry: t(keys::tree::OUTBOX_RETRY)?,
            actions: t(keys::tree::ACTIONS)?,
            done: t(keys::tree::DONE)?,
            timers: t(keys::tree::TIMERS)?,
            queue: t(keys::tree::QUEUE)?,
            activity: t(keys::tree::ACTIVITY)?,
            partition_events: t(keys::tree::PARTITION_EVENTS)?,
            meta: t(keys::tree::META)?,
            sled_file,
            timer_wakeup: Default::default(),
            db,
            log_dir: log.dir.clone(),
            log,
            wal_path: dir.join(LEGACY_WAL_FILE),
            fold_lock: Default::default(),
            half_applied: Default::default(),
            waiting: Default::default(),
            clock: model::clock::Clock::new(),
            lease: Default::default(),
        };
        store.number_events_above_floor()?;
        let layout = store.check_layout()?;
        // A store this build may open, before anything reads what a fold writes.
        store.finish_journal()?;
        store.open_legacy(layout)?;
        if layout < 2 {
            store.migrate_layout_1()?;
        }
        if layout < LAYOUT_VERSION {
            // Layouts 2 and 3 differ only in the dedupe records, kept by `open_legacy`.
            store.migrate_to_layout_4()?;
            tracing::info!(from = layout, to = LAYOUT_VERSION, "store layout upgraded");
        }
        store.recover_log(torn_tail)?;
        store.settle_done_moves()?;
        store.drop_orphan_quarantine_bodies()?;
        // Recovery indexed the log's tail, whose numbers may be above the floor read before.
        store.number_events_above_floor()?;
        store.index_queue_once()?;
        store.index_watch_once()?;
        store.index_desk_once()?;
        store.index_activity_once()?;
        store.index_partition_events_once()?;
        store.count_waiting()?;
        store.write_intake_state()?;
        Ok(store)
    }

    /// Keep what the next start needs to take deliveries before sled opens (see `log`), or, for
    /// a store with an older layout's dedupe trees (which only sled has), remove it.
    pub(crate) fn write_intake_state(&self) -> Result<(), StoreError> {
        let legacy = self.legacy.read().map_err(|_| poisoned_legacy())?.is_some();
        let written = if legacy {
            log::IntakeState::remove(&self.log_dir)
        } else {
            // Above every number given out so far (the counter starts above sled's floor, or
            // sled's id counter in a store from before the floor).
            let next = self.log.next_seq.load(std::sync::atomic::Ordering::SeqCst);
            log::IntakeState {
                layout: LAYOUT_VERSION,
                dedupe_from: self.meta_location(keys::meta::DEDUPE_PRUNED_TO)?.segment,
                seq_floor: next.saturating_sub(1),
            }
            .write(&self.log_dir)
        };
        written.map_err(log_error)
    }

    /// The event log's intake side (the writer's).
    pub fn intake_log(&self) -> &IntakeLog {
        &self.log
    }

    /// Raise the event counter above every number already given out: the floor the index
    /// transactions keep or, in a store from before the floor, sled's own id counter, which
    /// numbered its events (sled keeps it monotonic across crashes).
    fn number_events_above_floor(&self) -> Result<(), StoreError> {
        let next = match self.meta.get(keys::meta::SEQ_FLOOR)? {
            Some(b) => keys::parse_seq(&b)
                .ok_or_else(|| corrupt("event sequence floor"))?
                .saturating_add(1),
            None => self.db.generate_id()?,
        };
        self.log
            .next_seq
            .fetch_max(next, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// A new event's sequence number (see [`IntakeLog::next_seq`]).
    #[cfg(any(test, feature = "test-support"))]
    pub fn next_seq(&self) -> u64 {
        self.log.next_seq()
    }

    /// The store's layout version (a new store gets the current one). Refuses a newer one.
    fn check_layout(&self) -> Result<u32, StoreError> {
        match self.meta.get(keys::meta::LAYOUT_VERSION)? {
            None => {
                self.meta
                    .insert(keys::meta::LAYOUT_VERSION, &LAYOUT_VERSION.to_be_bytes())?;
                Ok(LAYOUT_VERSION)
            }
            Some(v) => {
                let found = v
                    .as_ref()
                    .try_into()
                    .map(u32::from_be_bytes)
                    .map_err(|_| StoreError::Corrupt("layout version unreadable".into()))?;
                if found > LAYOUT_VERSION {
                    Err(StoreError::TooNew {
                        found,
                        supported: LAYOUT_VERSION,
                    })
                } else {
                    Ok(found)
                }
            }
        }
    }

    /// Keep the dedupe trees of a store from before layout 3 (see [`Legacy`]).
    fn open_legacy(&self, layout: u32) -> Result<(), StoreError> {
        let since = match self.meta.get(keys::meta::LEGACY_DEDUPE_SINCE)? {
            Some(b) => keys::parse_seq(&b)
                .map(|v| v as Millis)
                .ok_or_else(|| corrupt("legacy dedupe time"))?,
            None if layout < 3 => {
                let now = self.clock.now_millis();
                self.meta
                    .insert(keys::meta::LEGACY_DEDUPE_SINCE, &keys::seq(now as u64))?;
                now
            }
            None => return Ok(()),
        };
        let legacy = Legacy {
            seen: self.db.open_tree(keys::tree::SEEN)?,
            deliveries: self.db.open_tree(keys::tree::DELIVERIES)?,
            since,
        };
        *self.legacy.write().map_err(|_| poisoned_legacy())? = Some(legacy);
        Ok(())
    }

    fn legacy_seen(&self, id: &str, delivery: bool) -> Result<bool, StoreError> {
        let legacy = self.legacy.read().map_err(|_| poisoned_legacy())?;
        Ok(match legacy.as_ref() {
            None => false,
            Some(l) if delivery => l.deliveries.contains_key(id)?,
            Some(l) => l.seen.contains_key(id)?,
        })
    }

    /// Drop the legacy dedupe trees once every record in them is past the dedupe window.
    /// Returns the records dropped.
    fn prune_legacy(&self, dedupe_before: Millis) -> Result<u64, StoreError> {
        let mut legacy = self.legacy.write().map_err(|_| poisoned_legacy())?;
        let Some(l) = legacy.as_ref() else {
            return Ok(0);
        };
        if l.since >= dedupe_before {
            return Ok(0);
        }
        let records = (l.seen.len() + l.deliveries.len()) as u64;
        *legacy = None;
        self.db.drop_tree(keys::tree::SEEN)?;
        self.db.drop_tree(keys::tree::DELIVERIES)?;
        self.meta.remove(keys::meta::LEGACY_DEDUPE_SINCE)?;
        tracing::info!(
            records,
            "dropped the dedupe records of the store's older layout"
        );
        Ok(records)
    }

    /// Record indexed frames in the dedupe index.
    fn remember<'a>(
        &self,
        frames: impl Iterator<Item = (eventlog::LogPosition, &'a str, Vec<&'a str>)>,
    ) -> Result<(), StoreError> {
        let mut index = self.log.dedupe.lock().map_err(|_| poisoned_dedupe())?;
        for (at, delivery, ids) in frames {
            index
                .insert(at, delivery, &ids)
                .map_err(|e| StoreError::Log(e.to_string()))?;
        }
        Ok(())
    }

    /// The kept failure of a sync of sled's file: every flush fails until the store is reopened.
    pub(crate) fn sync_failure(&self) -> Result<(), StoreError> {
        self.sled_file.check().map_err(StoreError::Sync)
    }

    /// Whether a sync of sled's file failed (tests).
    #[cfg(test)]
    pub(crate) fn sync_failed(&self) -> bool {
        self.sync_failure().is_err()
    }

    /// How many times [`flush`](SledStore::flush) synced sled's file since the store was opened.
    #[cfg(test)]
    pub(crate) fn file_syncs(&self) -> u64 {
        self.sled_file.syncs()
    }

    fn pending_until(&self, until: Option<eventlog::LogPosition>) -> Result<Pending, StoreError> {
        let mut marks = Marks::default();
        let mut events = Vec::new();
        let fold_from = self.watermark()?;
        let mut visit = |at, seq, partition: &str| -> Result<(), StoreError> {
            if marks.is_pending(self, fold_from, at, partition, seq)? {
                let partition = PartitionKey::decode(partition)
                    .ok_or_else(|| corrupt("event log partition"))?;
                events.push(PendingEvent {
                    seq,
                    partition,
                    at: at.into(),
                });
            }
            Ok(())
        };
        let mut failed = None;
        let end = eventlog::scan_before(&self.log_dir, fold_from, until, |at, record, _| {
            for (seq, partition) in record.seqs.iter().zip(&record.partitions) {
                if let Err(e) = visit(at, *seq, partition) {
                    failed = Some(e);
                    return ControlFlow::Break(());
                }
            }
            ControlFlow::Continue(())
        })
        .map_err(log_error)?;
        match failed {
            Some(e) => Err(e),
            None => Ok(Pending {
                events,
                end: end.next.into(),
            }),
        }
    }

    /// A pending event by number, read back (a scan from the watermark: tests only).
    #[cfg(any(test, feature = "test-support"))]
    pub fn event(&self, seq: u64) -> Result<Option<EventRecord>, StoreError> {
        use port::Folds;
        match self.pending()?.events.into_iter().find(|p| p.seq == seq) {
            Some(p) => self.event_at(seq, p.at),
            None => Ok(None),
        }
    }

    /// The folds' low watermark, where a start scans the log from (see
    /// [`keys::meta::FOLD_FROM`]; the port's cursor is its encoding).
    pub(crate) fn watermark(&self) -> Result<eventlog::LogPosition, StoreError> {
        self.meta_location(keys::meta::FOLD_FROM)
    }

    /// A log location kept in `meta` (the start of the log if there is none yet).
    fn meta_location(&self, key: &[u8]) -> Result<eventlog::LogPosition, StoreError> {
        Ok(self
            .meta
            .get(key)?
            .and_then(|b| eventlog::LogPosition::decode(&b))
            .unwrap_or_default())
    }

    /// A partition's folded mark: the number of its last folded event, if any.
    fn mark(&self, partition: &str) -> Result<Option<u64>, StoreError> {
        match self.folded.get(partition.as_bytes())? {
            None => Ok(None),
            Some(b) => Ok(Some(
                keys::parse_seq(&b).ok_or_else(|| corrupt("folded mark"))?,
            )),
        }
    }

    /// Visit the stored events in acceptance order, with whether each is still to fold, until `f`
    /// breaks.
    pub(crate) fn scan_events(
        &self,
        mut f: impl FnMut(EventRecord, bool) -> ControlFlow<()>,
    ) -> Result<(), StoreError> {
        let mut failed = None;
        let mut marks = Marks::default();
        let fold_from = self.watermark()?;
        let mut visit = |at, record: eventlog::LogRecord| -> Result<ControlFlow<()>, StoreError> {
            for (i, (seq, partition)) in record.seqs.iter().zip(&record.partitions).enumerate() {
                let pending = marks.is_pending(self, fold_from, at, partition, *seq)?;
                if f(EventRecord::from_log(&record, i)?, pending).is_break() {
                    return Ok(ControlFlow::Break(()));
                }
            }
            Ok(ControlFlow::Continue(()))
        };
        eventlog::scan(
            &self.log_dir,
            eventlog::LogPosition::default(),
            |at, record, _| match visit(at, record) {
                Ok(flow) => flow,
                Err(e) => {
                    failed = Some(e);
                    ControlFlow::Break(())
                }
            },
        )
        .map_err(log_error)?;
        failed.map_or(Ok(()), Err)
    }

    /// Fold a batch of events (of any partitions, each partition's in order) into state, each
    /// exactly once: an event at or below its partition's folded mark was folded before and is
    /// skipped. For tests and offline tools: the partitions are worked out from the events.
    pub fn apply(&self, batch: &[(u64, Event)]) -> Result<Applied, StoreError> {
        self.apply_with(batch, &engine::decide::NoRules, &[])
    }

    /// [`apply`](SledStore::apply) with rules (see [`Folds::fold`](port::Folds::fold)).
    pub fn apply_with(
        &self,
        batch: &[(u64, Event)],
        rules: &dyn engine::decide::Decide,
        received: &[Millis],
    ) -> Result<Applied, StoreError> {
        let partitions: Vec<PartitionKey> = batch
            .iter()
            .map(|(_, event)| model::webhook::partition_of(event))
            .collect();
        let position = Position::default();
        port::Folds::fold(self, batch, &partitions, rules, received, &position)
    }

    /// Forget the dedupe ids of segments whose events are all older than `dedupe_before`, and
    /// delete the event log's segments that hold only events older than `events_before`, all
    /// folded, and past the dedupe window. Driven by the event log, which is in acceptance (so
    /// receive-time) order: a segment's events are all older than the first event of the next.
    ///
    /// Offline (no writer running): it reads the folds' watermark and flushes sled itself. The
    /// daemon uses [`prune_with`](SledStore::prune_with).
    pub fn prune(
        &self,
        dedupe_before: Millis,
        events_before: Millis,
    ) -> Result<Pruned, StoreError> {
        let fold_from = self.watermark()?;
        self.flush()?;
        self.prune_events(dedupe_before, events_before, fold_from.into())
    }
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value).map_err(|e| StoreError::Corrupt(format!("encode: {e}")))
}

fn decode_borrowed<'a, T: Deserialize<'a>>(bytes: &'a [u8], what: &str) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8], what: &str) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

/// The record at `key` of `tree`, if any.
fn get_decoded<T: for<'de> Deserialize<'de>>(
    tree: &sled::Tree,
    key: impl AsRef<[u8]>,
    what: &str,
) -> Result<Option<T>, StoreError> {
    tree.get(key)?.map(|b| decode(&b, what)).transpose()
}

/// Every record of `tree`, in key order.
fn all_decoded<T: for<'de> Deserialize<'de>>(
    tree: &sled::Tree,
    what: &str,
) -> Result<Vec<T>, StoreError> {
    tree.iter().map(|item| decode(&item?.1, what)).collect()
}

/// At most `limit` records of a tree keyed by sequence number, those after `after` (from the
/// start when `None`), in order: one page of a list too long to hold whole.
fn page_decoded<T: for<'de> Deserialize<'de>>(
    tree: &sled::Tree,
    after: Option<u64>,
    limit: usize,
    what: &str,
) -> Result<Vec<T>, StoreError> {
    let from = match after {
        Some(seq) => match seq.checked_add(1) {
            Some(next) => std::ops::Bound::Included(keys::seq(next)),
            None => return Ok(Vec::new()),
        },
        None => std::ops::Bound::Unbounded,
    };
    tree.range::<[u8; 8], _>((from, std::ops::Bound::Unbounded))
        .take(limit)
        .map(|item| decode(&item?.1, what))
        .collect()
}

impl port::Lifecycle for SledStore {
    /// The daemon's time as this store reads it.
    fn clock(&self) -> &model::clock::Clock {
        &self.clock
    }

    /// Make every write before this call durable: sled's flush, then a sync of its file (sled's
    /// own flush does not reach the disk for certain: see `durable`). Blocking; in the daemon
    /// only the writer's indexer calls it.
    fn flush(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        self.sled_file.sync().map_err(StoreError::Sync)
    }

    /// Bytes on disk: sled's files and the event log.
    fn bytes_on_disk(&self) -> Result<u64, StoreError> {
        Ok(self.db.size_on_disk()? + eventlog::size(&self.log_dir))
    }

    /// Whether the store's directory takes a synced write now (a probe file of 64 KiB, removed
    /// again). After a sled call failed with an I/O error, this tells a disk that is still full
    /// from one that has space again (see `writer::index_loop`).
    fn takes_writes(&self) -> bool {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let probe = self.log_dir.join(".write-probe");
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&probe)
            .and_then(|mut f| f.write_all(&[0u8; 64 * 1024]).and_then(|()| f.sync_data()));
        let _ = std::fs::remove_file(&probe);
        written.is_ok()
    }

    /// Make sure sled has started its I/O thread pool, from the calling thread, whose scheduling
    /// its threads inherit (see `background`). The pool starts when sled first hands it work: a
    /// recovery of an existing store does, a new store's first write of its log does, and so does
    /// a flush with something to write. Notes when the store was opened, which is that something.
    fn start_background(&self) -> Result<(), StoreError> {
        let now = self.clock.now_millis().max(0) as u64;
        self.meta.insert(keys::meta::OPENED_AT, &keys::seq(now))?;
        self.flush()?;
        Ok(())
    }
}

/// Whether some process (another one, or another open of the file) holds the lock sled takes on
/// the store at `dir` while it is open: one probe of the `db` file's lock, without opening sled
/// and without waiting. A missing store is not held.
pub fn lock_is_held(dir: &Path) -> bool {
    use fs2::FileExt;
    let Ok(file) = std::fs::File::open(sled_file(dir)) else {
        return false;
    };
    if FileExt::try_lock_shared(&file).is_ok() {
        let _ = FileExt::unlock(&file);
        return false;
    }
    true
}

/// Open sled at `dir`. A store this process just closed stays locked until sled's background
/// thread notices (well under a second): wait that long before calling it in use.
fn open_sled(dir: &Path, cache_capacity: u64) -> Result<sled::Db, StoreError> {
    let open = || {
        sled::Config::new()
            .path(dir)
            .cache_capacity(cache_capacity)
            .mode(sled::Mode::HighThroughput)
            .open()
            .map_err(|e| match e {
                sled::Error::Io(io) if io.kind() == std::io::ErrorKind::WouldBlock => {
                    StoreError::Locked {
                        path: dir.display().to_string(),
                    }
                }
                sled::Error::Io(io) if io.to_string().contains("lock") => StoreError::Locked {
                    path: dir.display().to_string(),
                },
                other => StoreError::Open {
                    path: dir.display().to_string(),
                    source: other.into(),
                },
            })
    };
    let mut tries = 0;
    loop {
        match open() {
            Err(StoreError::Locked { .. }) if tries < LOCK_RETRIES => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            other => return other,
        }
    }
}

/// Whether another process holds the exclusive lock sled takes on the store's `db` file, probed
/// without opening sled. Tried as long as [`SledStore::open`] waits for a lock this process just
/// released.
fn held_by_another_process(dir: &Path) -> bool {
    use fs2::FileExt;
    let Ok(file) = std::fs::File::open(sled_file(dir)) else {
        return false;
    };
    for _ in 0..=LOCK_RETRIES {
        if file.try_lock_exclusive().is_ok() {
            let _ = FileExt::unlock(&file);
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    true
}

/// A failed [`eventlog::check_tail`]: damage is corruption, anything else an I/O error.
fn log_check_error(log_dir: &Path) -> impl Fn(std::io::Error) -> StoreError + '_ {
    move |e| match e.kind() {
        std::io::ErrorKind::InvalidData => StoreError::Corrupt(e.to_string()),
        _ => StoreError::Log(format!("{}: {e}", log_dir.display())),
    }
}

fn log_error(e: std::io::Error) -> StoreError {
    StoreError::Log(e.to_string())
}

fn poisoned_dedupe() -> StoreError {
    StoreError::Corrupt("dedupe index lock poisoned (a thread panicked)".into())
}

fn poisoned_legacy() -> StoreError {
    StoreError::Corrupt("legacy dedupe lock poisoned (a thread panicked)".into())
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("unreadable {what}"))
}

fn abort(e: impl std::fmt::Display) -> ConflictableTransactionError<String> {
    ConflictableTransactionError::Abort(e.to_string())
}

#[cfg(test)]
mod tests;
