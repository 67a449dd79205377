//! The durable store: the event log (segment files, [`eventlog`]) and, in sled, per-conversation
//! state, the folds' position, outbox and quarantine. This is the only module that imports
//! sled; keys are built in [`keys`].
//!
//! Invariants kept here:
//! - an event is acknowledged only once its frame is synced in the event log; its ids then go
//!   into the in-memory dedupe index (rebuilt from the log on open), so an acknowledged event is
//!   never lost and never accepted twice;
//! - the event log is the inbox (layout 4): an event is still to fold while its sequence number
//!   is above its partition's folded mark (`folded/v1`). Folding an event raises that mark with
//!   the fold's other writes, atomically (one journal, [`journal`]), so a crash can neither lose
//!   nor repeat the fold. A start scans the log from the folds' low watermark
//!   (`meta/fold_from`), which each fold also writes.

pub mod backup;
pub mod dedupe;
mod derived;
pub mod desk;
pub mod desk_links;
mod durable;
pub mod eventlog;
mod history;
pub mod idempotency;
pub mod intake;
mod journal;
pub mod keys;
mod log;
pub mod operators;
pub mod outbox;
mod pages;
pub mod port;
pub mod queue;
pub mod replay;
pub mod retention;
mod sled_port;
#[cfg(any(test, feature = "test-support"))]
pub mod test_support;
pub mod timers;
pub mod watch;
pub mod writer;

use engine::state::{BotState, ConversationState, EndUserState};
use journal::Journal;
use model::ids::{ConversationId, DeliveryId, EndUserId, EventId, PartitionKey};
use model::webhook::model::{Event, Millis, Payload};
use model::webhook::IncomingEvent;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sled::transaction::{ConflictableTransactionError, TransactionError};
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub use durable::sled_file;
pub use eventlog::sync_dir;
pub use intake::{Checked, Unindexed};
pub use log::IntakeLog;
pub use port::Storage;
pub use timers::DueTimer;
pub use writer::{AcceptJob, NewEvent, Writer};

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

/// A failure of the store's backend (sled here), kept opaque: no backend type crosses the port.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct BackendError(sled::Error);

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
    Open { path: String, source: sled::Error },
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
    /// A broken internal rule (a bug), refused instead of risking the store.
    #[error("internal error: {0}")]
    Internal(String),
}

impl StoreError {
    /// Whether the disk failed the store (an I/O error from sled, or a failed sync of its file),
    /// as opposed to what it holds being wrong.
    pub fn is_disk_failure(&self) -> bool {
        matches!(
            self,
            StoreError::Backend(BackendError(sled::Error::Io(_))) | StoreError::Sync(_)
        )
    }
}

impl From<sled::Error> for StoreError {
    fn from(e: sled::Error) -> Self {
        StoreError::Backend(BackendError(e))
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
    pub end: eventlog::LogPosition,
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

/// An event still to fold: its number, ordering domain and frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingEvent {
    pub seq: u64,
    pub partition: PartitionKey,
    pub at: eventlog::LogPosition,
}

/// What a fold records beside the events' effects: how far the folds have come.
#[derive(Debug, Default)]
pub struct Position {
    /// A location at or before every event still to fold once this fold commits (written as
    /// [`keys::meta::FOLD_FROM`]); `None` leaves it as it is.
    pub fold_from: Option<eventlog::LogPosition>,
    /// Events passed over without folding (unreadable, so quarantined instead): marked folded
    /// and indexed by partition.
    pub passed: Vec<PendingEvent>,
    /// Where each event of the batch is in the log, parallel to it: each folded event is
    /// indexed by partition (see [`history`]). Empty for events that are in no log (offline
    /// folds, tests), which are then not indexed.
    pub frames: Vec<eventlog::LogPosition>,
}

/// Folded marks read so far (a scan or a fold reads each partition's once), and those a fold
/// raises, for its journal to write.
#[derive(Default)]
struct Marks {
    read: HashMap<String, Option<u64>>,
    raised: HashMap<String, u64>,
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

    /// Raise a partition's mark to `seq` if it is above it; returns whether it was.
    fn raise(
        &mut self,
        store: &SledStore,
        partition: String,
        seq: u64,
    ) -> Result<bool, StoreError> {
        if !self.above(store, &partition, seq)? {
            return Ok(false);
        }
        self.read.insert(partition.clone(), Some(seq));
        self.raised.insert(partition, seq);
        Ok(true)
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

    /// Above its partition's mark (a fold's check: the batch is pending by construction).
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

/// What folding a batch did.
#[derive(Debug, Default, PartialEq)]
pub struct Applied {
    pub applied: usize,
    pub skipped: usize,
    pub new_conversations: u64,
    pub new_end_users: u64,
    pub new_bots: u64,
    /// Actions the rules decided, now in the outbox (not yet durable: flush before running them).
    pub outbox: Vec<model::action::OutboxEntry>,
    /// Decided actions skipped because their id was decided before.
    pub repeated_actions: usize,
    /// Running timers gained minus lost (started, minus fired, cancelled or replaced).
    pub timers_change: i64,
    /// The rule of each event a firing cap held a rule back for (one per hit, for the metric).
    pub capped: Vec<String>,
    /// The rule of each action whose template failed at run time (one per action, for the
    /// metric; the state keeps the error).
    pub template_errors: Vec<String>,
    /// The verdict on each folded agent command (the agent API waits for them).
    pub agent_verdicts: Vec<engine::state::desk::Verdict>,
    /// Each conversation that left the waiting queue in this fold: why, and how long it had
    /// waited (ms) when it was accepted (for the metrics; the hour records hold the same).
    pub queue_exits: Vec<(engine::state::stats::QueueExit, Option<Millis>)>,
}

/// What a prune pass removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    pub dedupe_records: u64,
    /// Event log segments deleted.
    pub event_segments: u64,
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
    /// Where a failure only a restart mends is reported: see [`SledStore::stuck`].
    stuck: Stuck,
}

/// Where a failure of the store that only a restart mends is reported (a store that still fails
/// after its disk takes writes again; a fold left half applied): the thread that finds it hands
/// its exit code to whoever watches (the daemon ends at once, as a crash would, with that code)
/// and stops for good.
#[derive(Clone, Debug)]
pub struct Stuck(Arc<tokio::sync::watch::Sender<Option<i32>>>);

impl Stuck {
    /// A report point, and what watches it.
    pub fn new() -> (Stuck, tokio::sync::watch::Receiver<Option<i32>>) {
        let (tx, rx) = tokio::sync::watch::channel(None);
        (Stuck(Arc::new(tx)), rx)
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

    /// The daemon's time as this store reads it.
    pub(crate) fn clock(&self) -> &model::clock::Clock {
        &self.clock
    }

    /// The store reporting a failure only a restart mends to `stuck` (see [`Stuck`]). Set before
    /// it is cloned.
    pub fn with_stuck(mut self, stuck: Stuck) -> Self {
        self.stuck = stuck;
        self
    }

    /// Only a restart mends the store: report `exit_code` and stop the calling thread for good
    /// (what it was doing is found again by the next start, as after a crash).
    pub(crate) fn stuck(&self, exit_code: i32) -> ! {
        self.stuck.0.send_replace(Some(exit_code));
        loop {
            std::thread::park();
        }
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
            source: sled::Error::Io(e),
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
            stuck: Stuck::new().0,
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

    /// Whether the store's directory takes a synced write now (a probe file of 64 KiB, removed
    /// again). After a sled call failed with an I/O error, this tells a disk that is still full
    /// from one that has space again (see `writer::index_loop`).
    pub(crate) fn dir_takes_writes(&self) -> bool {
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

    /// Make every write before this call durable: sled's flush, then a sync of its file (sled's
    /// own flush does not reach the disk for certain: see `durable`). Blocking; in the daemon
    /// only the writer's indexer calls it.
    pub(crate) fn flush(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        self.sled_file.sync().map_err(StoreError::Sync)
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

    /// Make sure sled has started its I/O thread pool, from the calling thread, whose scheduling
    /// its threads inherit (see `background`). The pool starts when sled first hands it work: a
    /// recovery of an existing store does, a new store's first write of its log does, and so does
    /// a flush with something to write. Notes when the store was opened, which is that something.
    pub(crate) fn start_io_threads(&self) -> Result<(), StoreError> {
        let now = self.clock.now_millis().max(0) as u64;
        self.meta.insert(keys::meta::OPENED_AT, &keys::seq(now))?;
        self.flush()?;
        Ok(())
    }

    /// Store the new events of a delivery, dedupe the rest; durable when it returns. Offline
    /// tools and tests; the daemon goes through the [`Writer`].
    pub(crate) fn accept(
        &self,
        delivery: &DeliveryId,
        events: &[IncomingEvent],
        now: Millis,
    ) -> Result<Accepted, StoreError> {
        let request = AcceptRequest {
            delivery,
            events,
            invalid: &[],
            received_at: now,
        };
        let mut out = self.accept_many(&[request])?;
        out.pop().ok_or_else(|| corrupt("accept result"))
    }

    /// Every event still to fold, oldest first, and where the log ended when it was read: a
    /// start's work for the dispatcher. Scans the log from the folds' low watermark, against the
    /// partitions' folded marks.
    pub(crate) fn pending(&self) -> Result<Pending, StoreError> {
        self.pending_until(None)
    }

    /// [`pending`](SledStore::pending) up to where the writer's frames begin, once a writer runs
    /// (an early start's, which logs deliveries while sled opens): its indexer hands those to
    /// the dispatcher, so a start's scan must not queue them too.
    pub(crate) fn pending_before_writer(&self) -> Result<Pending, StoreError> {
        self.pending_until(self.log.writer_from())
    }

    fn pending_until(&self, until: Option<eventlog::LogPosition>) -> Result<Pending, StoreError> {
        let mut marks = Marks::default();
        let mut events = Vec::new();
        let fold_from = self.fold_from()?;
        let mut visit = |at, seq, partition: &str| -> Result<(), StoreError> {
            if marks.is_pending(self, fold_from, at, partition, seq)? {
                let partition = PartitionKey::decode(partition)
                    .ok_or_else(|| corrupt("event log partition"))?;
                events.push(PendingEvent { seq, partition, at });
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
                end: end.next,
            }),
        }
    }

    /// A pending event by number, read back (a scan from the watermark: tests only).
    #[cfg(any(test, feature = "test-support"))]
    pub fn event(&self, seq: u64) -> Result<Option<EventRecord>, StoreError> {
        match self.pending()?.events.into_iter().find(|p| p.seq == seq) {
            Some(p) => self.event_at(seq, p.at),
            None => Ok(None),
        }
    }

    /// Backfill's cursor (see [`keys::meta::BACKFILL_CURSOR`]); `None` before its first pass.
    pub(crate) fn backfill_cursor(&self) -> Result<Option<Millis>, StoreError> {
        Ok(self
            .meta
            .get(keys::meta::BACKFILL_CURSOR)?
            .and_then(|v| keys::parse_seq(&v))
            .map(|ms| Millis::try_from(ms).unwrap_or(Millis::MAX)))
    }

    /// Moves backfill's cursor: a plain insert, made durable by the writer's next flush (which
    /// backfill asks for). An older cursor only makes a pass read more, which dedupe absorbs.
    pub(crate) fn set_backfill_cursor(&self, at: Millis) -> Result<(), StoreError> {
        self.meta
            .insert(keys::meta::BACKFILL_CURSOR, &keys::seq(at.max(0) as u64))?;
        Ok(())
    }

    /// Raise the folds' watermark to `to` (never lower it), under the fold lock: for the
    /// dispatcher once everything it received up to `to` is folded. A plain insert, durable with
    /// the next flush; an older watermark after a crash only makes a start scan more.
    pub(crate) fn advance_fold_from(&self, to: eventlog::LogPosition) -> Result<(), StoreError> {
        let _folding = self.fold_guard()?;
        if self.fold_from()? < to {
            self.meta.insert(keys::meta::FOLD_FROM, &to.encode())?;
        }
        Ok(())
    }

    /// Where a start scans the log from (see [`keys::meta::FOLD_FROM`]).
    pub(crate) fn fold_from(&self) -> Result<eventlog::LogPosition, StoreError> {
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

    /// The stored event of an id (as [`event_by_id`](SledStore::event_by_id)), and whether it is
    /// still to fold.
    pub(crate) fn event_status(
        &self,
        id: &EventId,
    ) -> Result<Option<(EventRecord, bool)>, StoreError> {
        let Some((frame, i, at)) = self.log.locate_event(id.as_str())? else {
            return Ok(None);
        };
        let record = EventRecord::from_log(&frame, i)?;
        let mut marks = Marks::default();
        let pending =
            marks.is_pending(self, self.fold_from()?, at, &record.partition, record.seq)?;
        Ok(Some((record, pending)))
    }

    /// The stored event of an id, while its segment is in the dedupe window.
    pub(crate) fn event_by_id(&self, id: &EventId) -> Result<Option<EventRecord>, StoreError> {
        match self
            .log
            .locate_event(id.as_str())?
            .map(|(record, i, _)| (record, i))
        {
            Some((record, i)) => Ok(Some(EventRecord::from_log(&record, i)?)),
            None => Ok(None),
        }
    }

    /// The event `seq` of the frame at `at` (where [`pending`](SledStore::pending) or intake found
    /// it), read back from the log.
    pub(crate) fn event_at(
        &self,
        seq: u64,
        at: eventlog::LogPosition,
    ) -> Result<Option<EventRecord>, StoreError> {
        let record = eventlog::read_at(&self.log_dir, at).map_err(log_error)?;
        match record {
            Some(record) => match record.position(seq) {
                Some(i) => Ok(Some(EventRecord::from_log(&record, i)?)),
                None => Err(corrupt("event log frame (sequence number not in it)")),
            },
            None => Ok(None),
        }
    }

    /// When the oldest stored event was received (the event log is in acceptance order).
    pub(crate) fn oldest_event_received_at(&self) -> Result<Option<Millis>, StoreError> {
        let mut oldest = None;
        eventlog::scan(
            &self.log_dir,
            eventlog::LogPosition::default(),
            |_, record, _| {
                oldest = Some(record.received_at);
                ControlFlow::Break(())
            },
        )
        .map_err(log_error)?;
        Ok(oldest)
    }

    /// Visit the stored events in acceptance order, with whether each is still to fold, until `f`
    /// breaks.
    pub(crate) fn scan_events(
        &self,
        mut f: impl FnMut(EventRecord, bool) -> ControlFlow<()>,
    ) -> Result<(), StoreError> {
        let mut failed = None;
        let mut marks = Marks::default();
        let fold_from = self.fold_from()?;
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

    /// [`apply`](SledStore::apply) with rules (see [`fold`](SledStore::fold)).
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
        self.fold(batch, &partitions, rules, received, &Position::default())
    }

    /// Fold a batch, with the rules deciding actions for each folded event from the
    /// conversation's state after the fold. Internal state actions are applied at once; the
    /// others go to the outbox in the same atomic write (the fold's journal, `journal`), and so
    /// do the changes to the timers tree (timers started, restarted, cancelled or fired), the
    /// partitions' folded marks and the `position`. `partitions` and `received` run parallel to
    /// `batch`: each event's partition as intake stored it (the marks' key) and its receive time.
    ///
    /// Reading and folding happen before anything is written, and the journal then only writes.
    /// That is safe because folds are serialised by `fold_lock` and nothing else writes state or
    /// folded marks (the retention pass removes them under the same lock).
    pub(crate) fn fold(
        &self,
        batch: &[(u64, Event)],
        partitions: &[PartitionKey],
        rules: &dyn engine::decide::Decide,
        received: &[Millis],
        position: &Position,
    ) -> Result<Applied, StoreError> {
        let framed = !position.frames.is_empty();
        if partitions.len() != batch.len() || (framed && position.frames.len() != batch.len()) {
            return Err(StoreError::Internal(
                "fold: a partition (and a frame, if any) per event expected".into(),
            ));
        }
        let _folding = self.fold_guard()?;
        let mut fold = FoldBatch::new(self.clock.now_millis());
        for (i, ((seq, event), partition)) in batch.iter().zip(partitions).enumerate() {
            let key = partition.encode();
            let indexed = position
                .frames
                .get(i)
                .map(|at| history::entry(*at, &key, *seq));
            if !fold.marks.raise(self, key, *seq)? {
                fold.out.skipped += 1;
                continue;
            }
            fold.out.applied += 1;
            fold.history.extend(indexed);
            if let Some(id) = event.payload.conversation_id() {
                let at = received.get(i).copied().unwrap_or(event.timestamp);
                fold.conversation_event(self, (id, event), rules, at)?;
            } else if let Payload::EndUser(u) = &event.payload {
                let new = || EndUserState::new(u.id.clone());
                let user = fold.end_user(self, u.id.as_str(), new)?;
                user.apply(event, u);
            } else {
                fold.bot_event(self, event)?;
            }
        }
        // After the batch: a passed-over event may come after events of its partition that this
        // fold folds, and a mark raised first would skip them.
        for passed in &position.passed {
            let partition = passed.partition.encode();
            fold.history
                .push(history::entry(passed.at, &partition, passed.seq));
            fold.marks.raise(self, partition, passed.seq)?;
        }
        self.commit_fold(fold, position)
    }

    /// Write what a fold batch changed in one journal, under the fold lock the caller holds.
    fn commit_fold(&self, fold: FoldBatch, position: &Position) -> Result<Applied, StoreError> {
        let FoldBatch {
            mut out,
            convs,
            users,
            bots,
            marks,
            timers_before,
            fired,
            queue_fold,
            derived_before,
            convs_active,
            users_active,
            history,
            ..
        } = fold;
        let index_entries: Vec<(Vec<u8>, String)> = users
            .iter()
            .filter_map(|(id, u)| match (&u.platform, &u.user_key) {
                (Some(p), Some(k)) => Some((keys::user_index(p.as_str(), k.as_str()), id.clone())),
                _ => None,
            })
            .collect();
        let timer_writes = self.timer_writes(&timers_before, &convs, &fired)?;
        out.timers_change = timer_writes.change;
        let earliest_timer = timer_writes.earliest;
        let mut activity = retention::ActivityWrites::default();
        activity.of(&convs_active, &convs, retention::conversation_key);
        activity.of(&users_active, &users, retention::end_user_key);
        let writes = FoldWrites {
            marks: marks.raised,
            fold_from: position.fold_from.map(eventlog::LogPosition::encode),
            created: [
                (keys::meta::COUNT_CONVERSATIONS, out.new_conversations),
                (keys::meta::COUNT_END_USERS, out.new_end_users),
                (keys::meta::COUNT_BOTS, out.new_bots),
            ],
            timers: timer_writes,
            queue: queue_fold.writes()?,
            derived: derived::derived_writes(&derived_before, &convs),
            activity,
            conversations: encoded(&convs)?,
            end_users: encoded(&users)?,
            index_entries,
            bots: encoded(&bots)?,
            history,
        };
        out.queue_exits = queue_fold.into_exits();
        let waiting = writes.queue.waiting_changes();
        let journal = self.fold_journal(writes, &out.outbox)?;
        self.commit_journal(&journal)?;
        // Still under the fold lock: the counts follow the commits in order.
        self.note_waiting(&waiting);
        if let Some(due_at) = earliest_timer {
            self.timer_wakeup.started(due_at);
        }
        Ok(out)
    }

    /// A fold's writes (and the entries it `decided`) as one journal (see `journal`), in the
    /// order they are applied, which is
    /// what a reader outside the fold lock may see half done: the outbox entries before the
    /// states that decided them, and the folded marks and the watermark last (a reader that
    /// finds an event folded finds its state). Record counts are read here, under the fold lock,
    /// and written as absolute values, so applying the journal twice is harmless.
    fn fold_journal(
        &self,
        writes: FoldWrites,
        decided: &[model::action::OutboxEntry],
    ) -> Result<Journal, StoreError> {
        use journal::TreeId as T;
        let mut j = Journal::default();
        for key in writes.timers.remove {
            j.remove(T::Timers, key);
        }
        for (key, entry) in writes.timers.insert {
            j.insert(T::Timers, key, entry);
        }
        for key in writes.queue.remove.into_iter().chain(writes.derived.remove) {
            j.remove(T::Queue, key);
        }
        for (key, value) in writes.queue.insert {
            j.insert(T::Queue, key, value);
        }
        for key in writes.derived.insert {
            j.insert(T::Queue, key, Vec::new());
        }
        for key in writes.activity.remove {
            j.remove(T::Activity, key);
        }
        for key in writes.activity.insert {
            j.insert(T::Activity, key, Vec::new());
        }
        outbox::journal_pending(&mut j, decided)?;
        for (id, bytes) in writes.conversations {
            j.insert(T::Conversations, id, bytes);
        }
        for (key, id) in writes.index_entries {
            j.insert(T::UserIndex, key, id);
        }
        for (id, bytes) in writes.end_users {
            j.insert(T::EndUsers, id, bytes);
        }
        for (id, bytes) in writes.bots {
            j.insert(T::Bots, id, bytes);
        }
        // Record counts kept with the records, so a start need not count whole trees (which
        // makes sled load every page: most of a restarted daemon's memory).
        for (key, new) in writes.created.iter().filter(|(_, new)| *new > 0) {
            let count = self
                .meta
                .get(key)?
                .and_then(|b| keys::parse_seq(&b))
                .unwrap_or(0);
            j.insert(T::Meta, *key, keys::seq(count + new));
        }
        for (key, offset) in writes.history {
            j.insert(T::PartitionEvents, key, keys::seq(offset));
        }
        for (partition, seq) in writes.marks {
            j.insert(T::Folded, partition, keys::seq(seq));
        }
        if let Some(at) = writes.fold_from {
            j.insert(T::Meta, keys::meta::FOLD_FROM, at);
        }
        Ok(j)
    }

    /// Apply a fold's internal state actions to `state` and turn the others into outbox entries,
    /// skipping any id decided before (in this fold, or ever: the `actions` ledger).
    fn queue_decisions(
        &self,
        event: &Event,
        state: &mut ConversationState,
        decisions: Vec<model::action::Decision>,
        decided_by: (&str, Millis, Millis),
        decided: &mut std::collections::HashSet<String>,
        out: &mut Applied,
    ) -> Result<(), StoreError> {
        use model::action::{action_id, OutboxEntry};
        for decision in decisions {
            let id = action_id(&event.id, &decision.rule, decision.index);
            if engine::decide::apply_to_state(&decision.action, state, decided_by.2, &id) {
                continue;
            }
            if decided.contains(&id) || self.actions.contains_key(id.as_bytes())? {
                out.repeated_actions += 1;
                continue;
            }
            decided.insert(id.clone());
            let seq = self.db.generate_id()?;
            out.outbox.push(OutboxEntry::decided(
                seq, id, &event.id, decision, decided_by,
            ));
        }
        Ok(())
    }

    pub(crate) fn conversation(
        &self,
        id: &ConversationId,
    ) -> Result<Option<ConversationState>, StoreError> {
        get_decoded(&self.conversations, id.as_str(), "conversation state")
    }

    pub(crate) fn end_user(&self, id: &EndUserId) -> Result<Option<EndUserState>, StoreError> {
        get_decoded(&self.end_users, id.as_str(), "end-user state")
    }

    pub(crate) fn bot(&self, id: &str) -> Result<Option<BotState>, StoreError> {
        get_decoded(&self.bots, id.as_bytes(), "bot state")
    }

    /// Look an end user up by their messenger identity.
    pub(crate) fn find_end_user(
        &self,
        platform: &str,
        user_key: &str,
    ) -> Result<Option<EndUserState>, StoreError> {
        match self.user_index.get(keys::user_index(platform, user_key))? {
            None => Ok(None),
            Some(id) => {
                let id = std::str::from_utf8(&id).map_err(|_| corrupt("user index"))?;
                self.end_user(&EndUserId::new(id))
            }
        }
    }

    /// Put a body in quarantine; returns its id.
    ///
    /// A body longer than [`MAX_VALUE_BYTES`] goes in chunks of that size
    /// (`quarantine_bodies/v1`), written before the record, which notes their number: sled
    /// recovers a prefix of its writes, so a record found has all its chunks.
    pub(crate) fn quarantine(&self, mut record: QuarantineRecord) -> Result<u64, StoreError> {
        record.id = self.db.generate_id()?;
        let mut stored = StoredQuarantine {
            body_chunks: None,
            body_bytes: None,
            record,
        };
        if stored.record.body_base64.len() > MAX_VALUE_BYTES {
            let text = std::mem::take(&mut stored.record.body_base64);
            let mut chunks = 0u32;
            for part in text.as_bytes().chunks(MAX_VALUE_BYTES) {
                self.quarantine_bodies
                    .insert(keys::quarantine_chunk(stored.record.id, chunks), part)?;
                chunks += 1;
            }
            stored.body_chunks = Some(chunks);
            stored.body_bytes = Some(body_len(&text, stored.record.body_gzip));
        }
        let id = stored.record.id;
        self.quarantine.insert(keys::seq(id), encode(&stored)?)?;
        Ok(id)
    }

    /// A stored record with its body (read back from its chunks when it has them).
    fn quarantined_whole(&self, bytes: &[u8]) -> Result<QuarantineRecord, StoreError> {
        let stored: StoredQuarantine = decode(bytes, "quarantine record")?;
        let mut record = stored.record;
        if let Some(chunks) = stored.body_chunks {
            let mut text = Vec::new();
            for i in 0..chunks {
                let part = self
                    .quarantine_bodies
                    .get(keys::quarantine_chunk(record.id, i))?
                    .ok_or_else(|| corrupt("quarantine body: a chunk is missing"))?;
                text.extend_from_slice(&part);
            }
            record.body_base64 =
                String::from_utf8(text).map_err(|_| corrupt("quarantine body: not base64"))?;
        }
        Ok(record)
    }

    /// Every record, bodies included: for tests and small stores only; lists use
    /// [`SledStore::quarantine_page`].
    pub(crate) fn quarantined(&self) -> Result<Vec<QuarantineRecord>, StoreError> {
        self.quarantine
            .iter()
            .map(|item| self.quarantined_whole(&item?.1))
            .collect()
    }

    /// At most `limit` records after id `after` (from the first when `None`), in id order,
    /// without their bodies (a body is neither copied nor decoded), and the id to continue after
    /// when more remain.
    pub(crate) fn quarantine_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<(Vec<QuarantineMeta>, Option<u64>), StoreError> {
        let start = match after {
            None => 0,
            Some(u64::MAX) => return Ok((Vec::new(), None)),
            Some(id) => id + 1,
        };
        let mut page = Vec::new();
        for item in self.quarantine.range(keys::seq(start)..) {
            let (_, value) = item?;
            if page.len() == limit {
                let next = page.last().map(|m: &QuarantineMeta| m.id);
                return Ok((page, next));
            }
            let raw: QuarantineMetaRaw<'_> = decode_borrowed(&value, "quarantine record")?;
            page.push(raw.into_meta());
        }
        Ok((page, None))
    }

    pub(crate) fn quarantined_one(&self, id: u64) -> Result<Option<QuarantineRecord>, StoreError> {
        self.quarantine
            .get(keys::seq(id))?
            .map(|bytes| self.quarantined_whole(&bytes))
            .transpose()
    }

    /// Remove a quarantine record (after it was re-processed, or past its retention), then its
    /// body's chunks: a crash between leaves chunks without a record, which an open removes
    /// ([`SledStore::drop_orphan_quarantine_bodies`]), never a record without its body.
    pub(crate) fn release_quarantined(&self, id: u64) -> Result<bool, StoreError> {
        let removed = self.quarantine.remove(keys::seq(id))?.is_some();
        for key in self.quarantine_bodies.scan_prefix(keys::seq(id)).keys() {
            self.quarantine_bodies.remove(key?)?;
        }
        Ok(removed)
    }

    /// On open: remove body chunks whose record is gone (a crash after the record's removal, or
    /// before it was written: a delivery never acknowledged). Nothing quarantines meanwhile.
    fn drop_orphan_quarantine_bodies(&self) -> Result<(), StoreError> {
        let mut dropped = 0;
        let mut checked: Option<(Vec<u8>, bool)> = None;
        for key in self.quarantine_bodies.iter().keys() {
            let key = key?;
            let id = key.get(..8).unwrap_or(&key).to_vec();
            let kept = match &checked {
                Some((seen, kept)) if *seen == id => *kept,
                _ => {
                    let kept = self.quarantine.contains_key(&id)?;
                    checked = Some((id, kept));
                    kept
                }
            };
            if !kept {
                self.quarantine_bodies.remove(key)?;
                dropped += 1;
            }
        }
        if dropped > 0 {
            tracing::info!(
                chunks = dropped,
                "removed quarantine body chunks without a record"
            );
        }
        Ok(())
    }

    /// Record counts. Linear in the store size: call on start, then track changes.
    pub(crate) fn sizes(&self) -> Sizes {
        Sizes {
            conversations: self.count(keys::meta::COUNT_CONVERSATIONS, &self.conversations),
            end_users: self.count(keys::meta::COUNT_END_USERS, &self.end_users),
            bots: self.count(keys::meta::COUNT_BOTS, &self.bots),
            quarantine: self.quarantine.len() as u64,
        }
    }

    /// A state tree's record count, as the folds keep it in `meta`. A store from before the counts
    /// is counted once (walking the tree) and the count kept from then on. Folds run after this
    /// (the dispatcher starts after the count), so the two cannot race.
    fn count(&self, key: &[u8], tree: &sled::Tree) -> u64 {
        if let Ok(Some(bytes)) = self.meta.get(key) {
            if let Some(count) = keys::parse_seq(&bytes) {
                return count;
            }
        }
        let count = tree.len() as u64;
        if let Err(e) = self.meta.insert(key, &keys::seq(count)) {
            tracing::warn!(error = %e, "cannot keep a record count; it will be counted again");
        }
        count
    }

    /// Bytes on disk: sled's files and the event log.
    pub(crate) fn size_on_disk(&self) -> u64 {
        self.db.size_on_disk().unwrap_or(0) + eventlog::size(&self.log_dir)
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
        let fold_from = self.fold_from()?;
        self.flush()?;
        self.prune_with(dedupe_before, events_before, fold_from)
    }

    /// [`prune`](SledStore::prune) with the folds' watermark read before a sled flush that has
    /// completed since: segments go only below a watermark whose folds (state and marks) are on
    /// disk, so a crash cannot bring back an older watermark that points into a deleted
    /// segment's unfolded events. Then the index by partition forgets the segments gone (see
    /// `history`).
    pub(crate) fn prune_with(
        &self,
        dedupe_before: Millis,
        events_before: Millis,
        fold_from: eventlog::LogPosition,
    ) -> Result<Pruned, StoreError> {
        let mut out = Pruned::default();
        let pruned_to = self.forget_old_ids(dedupe_before, &mut out)?;
        for segment in self.old_segments(dedupe_before, events_before, fold_from, pruned_to)? {
            eventlog::remove_segment(&self.log_dir, segment).map_err(log_error)?;
            dedupe::remove_ids(&self.log_dir, segment);
            out.event_segments += 1;
        }
        self.unindex_removed_segments()?;
        // What an early start reads instead of sled (see `log`): where the dedupe index starts
        // now, and a floor above every number given out, since the segments that held the
        // highest ones may be gone. Without it (a full disk), the next start opens sled first;
        // the pass itself did its work.
        if let Err(e) = self.write_intake_state() {
            tracing::warn!(error = %e, "cannot keep the event log's state file; the next start opens the store before taking deliveries");
            if let Err(e) = log::IntakeState::remove(&self.log_dir) {
                tracing::error!(error = %e, "cannot remove the event log's stale state file");
            }
        }
        Ok(out)
    }

    /// Forget the dedupe ids of the sealed segments whose events are all older than
    /// `dedupe_before`; where the dedupe index starts now.
    fn forget_old_ids(
        &self,
        dedupe_before: Millis,
        out: &mut Pruned,
    ) -> Result<eventlog::LogPosition, StoreError> {
        let start = self.meta_location(keys::meta::DEDUPE_PRUNED_TO)?;
        let sealed = self
            .log
            .dedupe
            .lock()
            .map_err(|_| poisoned_dedupe())?
            .sealed_segments();
        let mut pruned_to = None;
        for (segment, _) in sealed {
            let first_of_next = eventlog::LogPosition {
                segment: segment + 1,
                offset: 0,
            };
            // Sealed means indexed: the log had moved on to the next segment.
            let newer = eventlog::read_at(&self.log_dir, first_of_next).map_err(log_error)?;
            match newer {
                Some(r) if r.received_at < dedupe_before => {}
                _ => break,
            }
            let forgotten = self
                .log
                .dedupe
                .lock()
                .map_err(|_| poisoned_dedupe())?
                .forget(segment);
            out.dedupe_records += forgotten as u64;
            pruned_to = Some(first_of_next);
        }
        if let Some(to) = pruned_to {
            self.meta
                .insert(keys::meta::DEDUPE_PRUNED_TO, &to.encode())?;
        }
        out.dedupe_records += self.prune_legacy(dedupe_before)?;
        Ok(pruned_to.unwrap_or(start))
    }

    /// The oldest segments that may go, in order: each all folded (below the watermark),
    /// indexed, past the dedupe index's start (`pruned_to`), and older than the first event of
    /// the next, which is older than both `events_before` and `dedupe_before`.
    fn old_segments(
        &self,
        dedupe_before: Millis,
        events_before: Millis,
        fold_from: eventlog::LogPosition,
        pruned_to: eventlog::LogPosition,
    ) -> Result<Vec<u64>, StoreError> {
        let indexed_to = self.meta_location(keys::meta::INDEXED_TO)?;
        let segments = eventlog::segments(&self.log_dir).map_err(log_error)?;
        let mut old = Vec::new();
        for pair in segments.windows(2) {
            let (segment, next) = (pair[0], pair[1]);
            let path = eventlog::segment_path(&self.log_dir, segment);
            let len = std::fs::metadata(&path).map_err(log_error)?.len();
            let end = eventlog::LogPosition {
                segment,
                offset: len,
            };
            let folded = fold_from.segment > segment;
            if !folded || pruned_to < end || indexed_to < end {
                break;
            }
            // Everything in `segment` is older than the first event of the next one.
            let start_of_next = eventlog::LogPosition {
                segment: next,
                offset: 0,
            };
            let newer = eventlog::read_at(&self.log_dir, start_of_next).map_err(log_error)?;
            match newer {
                Some(r) if r.received_at < events_before && r.received_at < dedupe_before => {}
                _ => break,
            }
            old.push(segment);
        }
        Ok(old)
    }
}

/// What one fold batch has read and changed so far: the states it touched (read once, then kept
/// here), the marks it raises and what the journal at its end must also write.
struct FoldBatch {
    out: Applied,
    /// The decision's clock for the whole batch.
    now: Millis,
    convs: HashMap<String, ConversationState>,
    users: HashMap<String, EndUserState>,
    bots: HashMap<String, BotState>,
    /// Partitions' marks, and those this fold raises (to its last event of each).
    marks: Marks,
    decided: std::collections::HashSet<String>,
    /// Each conversation's timers as this fold found them, and the keys of folded firings.
    timers_before: HashMap<String, std::collections::BTreeMap<String, engine::state::Timer>>,
    fired: Vec<Vec<u8>>,
    queue_fold: queue::QueueFold,
    /// Each conversation's derived index keys (`derived`) as this fold found it.
    derived_before: HashMap<String, Vec<Vec<u8>>>,
    /// Each state's key in the retention index as this fold found it (`None`: created).
    convs_active: HashMap<String, Option<Vec<u8>>>,
    users_active: HashMap<String, Option<Vec<u8>>>,
    /// The index by partition's entries for the events this fold folds or passes over.
    history: Vec<(Vec<u8>, u64)>,
}

impl FoldBatch {
    fn new(now: Millis) -> Self {
        FoldBatch {
            out: Applied::default(),
            now,
            convs: HashMap::new(),
            users: HashMap::new(),
            bots: HashMap::new(),
            marks: Marks::default(),
            decided: std::collections::HashSet::new(),
            timers_before: HashMap::new(),
            fired: Vec::new(),
            queue_fold: queue::QueueFold::default(),
            derived_before: HashMap::new(),
            convs_active: HashMap::new(),
            users_active: HashMap::new(),
            history: Vec::new(),
        }
    }

    /// The end user `id` as this batch has it, noting its retention key as found.
    fn end_user(
        &mut self,
        store: &SledStore,
        id: &str,
        new: impl FnOnce() -> EndUserState,
    ) -> Result<&mut EndUserState, StoreError> {
        let (user, created) = cached(&store.end_users, &mut self.users, id, new)?;
        self.users_active
            .entry(id.to_owned())
            .or_insert_with(|| (!created).then(|| retention::end_user_key(user)));
        self.out.new_end_users += u64::from(created);
        Ok(user)
    }

    /// Bot events, and events of unknown types, belong to the bot.
    fn bot_event(&mut self, store: &SledStore, event: &Event) -> Result<(), StoreError> {
        let id = match &event.payload {
            Payload::Bot(b) => &b.id,
            _ => &event.source_id,
        };
        let new = || BotState::new(id.clone());
        let (bot, created) = cached(&store.bots, &mut self.bots, id.as_str(), new)?;
        bot.apply(event);
        self.out.new_bots += u64::from(created);
        Ok(())
    }

    /// Fold a conversation's event and decide for it (`fold_and_decide`, with the end user and
    /// the waiting queue it reads), queue its decisions, and note its end user.
    fn conversation_event(
        &mut self,
        store: &SledStore,
        (id, event): (&ConversationId, &Event),
        rules: &dyn engine::decide::Decide,
        received_at: Millis,
    ) -> Result<(), StoreError> {
        if let Payload::Timer(t) = &event.payload {
            self.fired.push(keys::timer(t.due_at, id.as_str(), &t.name));
        }
        let time = engine::decide::DecisionTime {
            now: self.now,
            received_at,
        };
        let first_read = FirstRead {
            timers: &mut self.timers_before,
            derived: &mut self.derived_before,
            active: &mut self.convs_active,
            created: &mut self.out.new_conversations,
        };
        let state = first_read.conversation(store, &mut self.convs, id)?;
        let user = if rules.needs().end_user {
            end_user_of(state, event, &self.users, &store.end_users)?
        } else {
            None
        };
        let queue_fold = &mut self.queue_fold;
        let waited_since = queue_fold.before(state);
        let mut after_fold = |after: &ConversationState| {
            store.queue_after(queue_fold, after, waited_since, event.timestamp)?;
            match rules.needs().queue {
                true => store.standing_in(queue_fold, after).map(Some),
                false => Ok(None),
            }
        };
        let outcome = engine::fold::fold_and_decide(
            state,
            event,
            rules,
            user.as_deref(),
            time,
            &mut after_fold,
        )?;
        note_held_back(&mut self.out, id, event, &outcome);
        if let Payload::Agent(_) = &event.payload {
            if let Some(verdict) = state.desk.verdict(event.id.as_str()) {
                self.out.agent_verdicts.push(verdict.clone());
            }
        }
        let decided_by = (rules.version(), received_at, self.now);
        let (decided, out) = (&mut self.decided, &mut self.out);
        store.queue_decisions(event, state, outcome.decisions, decided_by, decided, out)?;
        if let Payload::Conversation(c) = &event.payload {
            if let Some(uid) = &c.end_user_id {
                let new = || EndUserState::new(uid.clone());
                self.end_user(store, uid.as_str(), new)?
                    .observe_conversation(event, c);
            }
        }
        Ok(())
    }
}

/// What a fold batch notes of a conversation when it first reads it: its timers, derived index
/// keys and retention key as found (the journal writes the difference), and whether it is new.
struct FirstRead<'a> {
    timers: &'a mut HashMap<String, std::collections::BTreeMap<String, engine::state::Timer>>,
    derived: &'a mut HashMap<String, Vec<Vec<u8>>>,
    active: &'a mut HashMap<String, Option<Vec<u8>>>,
    created: &'a mut u64,
}

impl FirstRead<'_> {
    /// The conversation `id` as the batch has it in `convs` (read from the store the first
    /// time, when what the journal compares is noted too).
    fn conversation<'c>(
        self,
        store: &SledStore,
        convs: &'c mut HashMap<String, ConversationState>,
        id: &ConversationId,
    ) -> Result<&'c mut ConversationState, StoreError> {
        let new = || ConversationState::new(id.clone());
        let (state, created) = cached(&store.conversations, convs, id.as_str(), new)?;
        if !self.timers.contains_key(id.as_str()) {
            self.timers
                .insert(id.as_str().to_owned(), state.timers.clone());
            // A new conversation's keys are all new (none is in the tree yet).
            let found = match created {
                true => Vec::new(),
                false => derived::derived_keys(state),
            };
            self.derived.insert(id.as_str().to_owned(), found);
            let key = (!created).then(|| retention::conversation_key(state));
            self.active.insert(id.as_str().to_owned(), key);
        }
        *self.created += u64::from(created);
        Ok(state)
    }
}

/// The rules a fold held back for an event (a firing cap, a failed template): logged, and
/// counted in what the fold applied.
fn note_held_back(
    out: &mut Applied,
    id: &ConversationId,
    event: &Event,
    outcome: &engine::decide::Decided,
) {
    for hit in &outcome.capped {
        tracing::warn!(
            rule = %hit.rule,
            conversation_id = %id,
            event_id = %event.id,
            fired = hit.fired,
            per = %humantime::format_duration(hit.cap.per),
            "rule firing cap reached: the rule is held back for this event"
        );
        out.capped.push(hit.rule.clone());
    }
    for failed in &outcome.failed {
        tracing::warn!(
            rule = %failed.rule,
            conversation_id = %id,
            event_id = %event.id,
            index = failed.index,
            error = %failed.error,
            "rule action's template failed: recorded in the state, the action skipped"
        );
        out.template_errors.push(failed.rule.clone());
    }
}

/// The end user of the conversation `event` belongs to (the one a conversation event names, else
/// the state's), as this fold knows them: from its cache (an end-user event earlier in the batch),
/// else from the tree. Read only: a user the bridge has not seen stays unknown and is not created.
fn end_user_of<'a>(
    state: &ConversationState,
    event: &Event,
    cache: &'a HashMap<String, EndUserState>,
    tree: &sled::Tree,
) -> Result<Option<std::borrow::Cow<'a, EndUserState>>, StoreError> {
    let named = match &event.payload {
        Payload::Conversation(c) => c.end_user_id.as_ref(),
        _ => None,
    };
    let Some(id) = named.or(state.end_user_id.as_ref()) else {
        return Ok(None);
    };
    if let Some(user) = cache.get(id.as_str()) {
        return Ok(Some(std::borrow::Cow::Borrowed(user)));
    }
    Ok(get_decoded(tree, id.as_str(), "end-user state")?.map(std::borrow::Cow::Owned))
}

/// A state record for the rest of the fold: from the cache, else from the tree, else new.
/// Returns whether it was created now.
fn cached<'a, T: for<'de> Deserialize<'de>>(
    tree: &sled::Tree,
    cache: &'a mut HashMap<String, T>,
    key: &str,
    new: impl FnOnce() -> T,
) -> Result<(&'a mut T, bool), StoreError> {
    let mut created = false;
    if !cache.contains_key(key) {
        let state = match tree.get(key.as_bytes())? {
            Some(b) => decode(&b, "state record")?,
            None => {
                created = true;
                new()
            }
        };
        cache.insert(key.to_owned(), state);
    }
    let state = cache
        .get_mut(key)
        .ok_or_else(|| StoreError::Corrupt("state cache".to_owned()))?;
    Ok((state, created))
}

/// Everything a fold writes, by kind, before it becomes the fold's journal.
struct FoldWrites {
    /// Partitions' folded marks raised.
    marks: HashMap<String, u64>,
    fold_from: Option<[u8; eventlog::LogPosition::LEN]>,
    /// Records each state tree gains, by its count key in `meta`.
    created: [(&'static [u8], u64); 3],
    timers: timers::TimerWrites,
    queue: queue::QueueWrites,
    derived: derived::DerivedWrites,
    activity: retention::ActivityWrites,
    conversations: Vec<(String, Vec<u8>)>,
    end_users: Vec<(String, Vec<u8>)>,
    /// `(platform, userKey)` index keys and the end user each names.
    index_entries: Vec<(Vec<u8>, String)>,
    bots: Vec<(String, Vec<u8>)>,
    /// The index by partition's new entries (see [`history`]).
    history: Vec<(Vec<u8>, u64)>,
}

/// Each cached record, encoded for writing.
fn encoded<T: Serialize>(cache: &HashMap<String, T>) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
    cache
        .iter()
        .map(|(id, state)| Ok((id.clone(), encode(state)?)))
        .collect()
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
                    source: other,
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
