//! The event log: append-only segment files that hold every accepted event's body, outside sled.
//!
//! Why outside sled: sled 0.34 rewrites what it stores several times over (about 2.8 KB of disk
//! and a matching share of its page cache per 1 KB event), and its memory grows with its log. The
//! bodies are written once, read rarely (a backlog after a restart, a replay, an admin lookup) and
//! dropped a whole segment at a time, which a plain file does best. Sled keeps only small index
//! entries that point here (see `keys`).
//!
//! This log is also what makes a delivery durable: the syncer appends a group's frames and
//! `fdatasync`s once, then acknowledges, then indexes the events in sled. On open, frames past the
//! index checkpoint are indexed again (see `SledStore::open`).
//!
//! Segment files are `<number>.log` (20 digits, so names sort numerically) in the log directory.
//! Frame: `len: u32 LE`, `crc32(payload): u32 LE`, `payload` (JSON [`LogRecord`]). A frame cut
//! short or failing its checksum at the end of the newest segment is a write whose sync never
//! finished (nothing of it was acknowledged) and is cut off on open; anywhere else it is
//! corruption.

use model::webhook::model::Millis;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::fs::{File, OpenOptions};
use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::ops::ControlFlow;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Frames larger than this are treated as corruption (a delivery is at most the body limit).
const MAX_FRAME: usize = 256 * 1024 * 1024;
const HEADER: usize = 8;
/// A new segment is started once the current one is this large.
pub const SEGMENT_BYTES: u64 = 64 * 1024 * 1024;
const SUFFIX: &str = ".log";

/// Where a frame starts: segment number and byte offset. Encoded big-endian so that locations
/// sort in log order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LogPosition {
    pub segment: u64,
    pub offset: u64,
}

/// A log position as the port's opaque cursor: segment and offset in one number, in the same
/// order (and the same 16 bytes encoded).
impl From<LogPosition> for model::cursor::Cursor {
    fn from(at: LogPosition) -> Self {
        model::cursor::Cursor::from_raw((u128::from(at.segment) << 64) | u128::from(at.offset))
    }
}

/// A cursor this backend made, back as its log position.
impl From<model::cursor::Cursor> for LogPosition {
    fn from(cursor: model::cursor::Cursor) -> Self {
        let raw = cursor.raw();
        LogPosition {
            segment: (raw >> 64) as u64,
            offset: raw as u64,
        }
    }
}

impl LogPosition {
    pub const LEN: usize = 16;

    pub fn encode(self) -> [u8; Self::LEN] {
        let mut out = [0; Self::LEN];
        out[..8].copy_from_slice(&self.segment.to_be_bytes());
        out[8..].copy_from_slice(&self.offset.to_be_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Option<LogPosition> {
        Some(LogPosition {
            segment: u64::from_be_bytes(bytes.get(..8)?.try_into().ok()?),
            offset: u64::from_be_bytes(bytes.get(8..Self::LEN)?.try_into().ok()?),
        })
    }
}

/// The new events of one accepted delivery. `seqs`, `ids` and `partitions` run parallel to
/// `events`, so scans (dedupe pruning, replay) need not parse the bodies. The intake log of store
/// layout 1 had only the delivery, the time and the bodies; such frames read with the others
/// empty.
#[derive(Debug, Deserialize)]
pub struct LogRecord {
    #[serde(rename = "d")]
    pub delivery: String,
    #[serde(rename = "t")]
    pub received_at: Millis,
    #[serde(rename = "s", default)]
    pub seqs: Vec<u64>,
    #[serde(rename = "i", default)]
    pub ids: Vec<String>,
    #[serde(rename = "p", default)]
    pub partitions: Vec<String>,
    #[serde(rename = "e")]
    pub events: Vec<Box<RawValue>>,
}

impl LogRecord {
    /// Position of event `seq` in this record.
    pub fn position(&self, seq: u64) -> Option<usize> {
        self.seqs.iter().position(|s| *s == seq)
    }
}

/// One event of a delivery, for [`Frames::push`].
pub struct FrameEvent<'a> {
    pub seq: u64,
    pub id: &'a str,
    pub partition: &'a str,
    /// The exact JSON text accepted on intake, copied in as is.
    pub raw: &'a str,
}

/// Framed records built off the file (by the writer), appended later (by the syncer).
#[derive(Default)]
pub struct Frames {
    buf: Vec<u8>,
    starts: Vec<usize>,
}

impl Frames {
    /// Frame one delivery's new events.
    pub fn push(&mut self, delivery: &str, received_at: Millis, events: &[FrameEvent<'_>]) {
        let start = self.buf.len();
        self.buf.extend_from_slice(&[0; HEADER]);
        let written = write_payload(&mut self.buf, delivery, received_at, events);
        if written.is_err() {
            // Only a string that cannot be JSON-encoded gets here, which `&str` never is.
            self.buf.truncate(start);
            return;
        }
        let payload = &self.buf[start + HEADER..];
        let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        let crc = crc32fast::hash(payload);
        self.buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
        self.buf[start + 4..start + HEADER].copy_from_slice(&crc.to_le_bytes());
        self.starts.push(start);
    }

    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }

    /// Frames pushed so far.
    pub fn len(&self) -> usize {
        self.starts.len()
    }
}

fn write_payload(
    buf: &mut Vec<u8>,
    delivery: &str,
    received_at: Millis,
    events: &[FrameEvent<'_>],
) -> serde_json::Result<()> {
    buf.extend_from_slice(b"{\"d\":");
    serde_json::to_writer(&mut *buf, delivery)?;
    buf.extend_from_slice(format!(",\"t\":{received_at},\"s\":").as_bytes());
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    serde_json::to_writer(&mut *buf, &seqs)?;
    buf.extend_from_slice(b",\"i\":");
    let ids: Vec<&str> = events.iter().map(|e| e.id).collect();
    serde_json::to_writer(&mut *buf, &ids)?;
    buf.extend_from_slice(b",\"p\":");
    let partitions: Vec<&str> = events.iter().map(|e| e.partition).collect();
    serde_json::to_writer(&mut *buf, &partitions)?;
    buf.extend_from_slice(b",\"e\":[");
    for (i, e) in events.iter().enumerate() {
        if i > 0 {
            buf.push(b',');
        }
        buf.extend_from_slice(e.raw.as_bytes());
    }
    buf.extend_from_slice(b"]}");
    Ok(())
}

/// The appending end of the log. One per store (the store keeps it behind a lock).
pub struct Appender {
    dir: PathBuf,
    segment: u64,
    file: File,
    len: u64,
    buf: Vec<u8>,
    segment_bytes: u64,
}

impl Appender {
    /// Open the log for appending: the newest segment, its torn tail (if any) cut off, or a first
    /// segment. Returns the appender and whether a torn tail was cut.
    pub fn open(dir: &Path, segment_bytes: u64) -> std::io::Result<(Appender, bool)> {
        // Owner-only whatever the umask: the bodies are the conversations' messages.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        let segment = segments(dir)?.last().copied().unwrap_or(1);
        let path = segment_path(dir, segment);
        let mut file = OpenOptions::new()
            .mode(0o600)
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)?;
        let (good, torn) = intact_length(&mut file)?;
        if torn {
            file.set_len(good)?;
            file.sync_all()?;
        }
        file.seek(SeekFrom::Start(good))?;
        sync_dir(dir)?;
        let appender = Appender {
            dir: dir.to_owned(),
            segment,
            file,
            len: good,
            buf: Vec::new(),
            segment_bytes: segment_bytes.max(1),
        };
        Ok((appender, torn))
    }

    /// Queue frames for the next [`commit`](Appender::commit); returns where each will be.
    pub fn queue(&mut self, frames: Frames) -> Vec<LogPosition> {
        let base = self.len + self.buf.len() as u64;
        let at = frames
            .starts
            .iter()
            .map(|s| LogPosition {
                segment: self.segment,
                offset: base + *s as u64,
            })
            .collect();
        if self.buf.is_empty() {
            self.buf = frames.buf;
        } else {
            self.buf.extend_from_slice(&frames.buf);
        }
        at
    }

    /// Write what was queued and wait until it is on disk; then start a new segment if this one
    /// is full. On error nothing queued counts: the file is cut back to where it was.
    pub fn commit(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let result = self
            .file
            .write_all(&self.buf)
            .and_then(|()| self.file.sync_data());
        let written = self.buf.len() as u64;
        self.buf.clear();
        if let Err(e) = result {
            // Drop whatever part made it, so later frames do not follow a torn one.
            let _ = self.file.set_len(self.len);
            let _ = self.file.seek(SeekFrom::Start(self.len));
            return Err(e);
        }
        self.len += written;
        if self.len >= self.segment_bytes {
            // A failure here leaves the full segment in use; the next commit tries again.
            if let Err(e) = self.rotate() {
                tracing::warn!(error = %e, "cannot start a new event log segment");
            }
        }
        Ok(())
    }

    /// Drop queued frames (their commit will not happen).
    pub fn discard_pending(&mut self) {
        self.buf.clear();
    }

    /// Where the next frame will go: everything before it is on disk.
    pub fn end(&self) -> LogPosition {
        LogPosition {
            segment: self.segment,
            offset: self.len,
        }
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        let next = self.segment + 1;
        let file = OpenOptions::new()
            .mode(0o600)
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(segment_path(&self.dir, next))?;
        sync_dir(&self.dir)?;
        self.file = file;
        self.segment = next;
        self.len = 0;
        Ok(())
    }
}

/// The segment numbers present, oldest first.
pub fn segments(dir: &Path) -> std::io::Result<Vec<u64>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for entry in entries {
        let name = entry?.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(n) = name.strip_suffix(SUFFIX).and_then(|n| n.parse().ok()) {
            out.push(n);
        }
    }
    out.sort_unstable();
    Ok(out)
}

pub fn segment_path(dir: &Path, segment: u64) -> PathBuf {
    dir.join(format!("{segment:020}{SUFFIX}"))
}

/// Bytes in all segments.
pub fn size(dir: &Path) -> u64 {
    segments(dir)
        .unwrap_or_default()
        .iter()
        .filter_map(|s| std::fs::metadata(segment_path(dir, *s)).ok())
        .map(|m| m.len())
        .sum()
}

/// Delete a segment (after pruning decided that nothing in it is needed).
pub fn remove_segment(dir: &Path, segment: u64) -> std::io::Result<()> {
    std::fs::remove_file(segment_path(dir, segment))
}

/// The frame at `at`, if it is there and intact.
pub fn read_at(dir: &Path, at: LogPosition) -> std::io::Result<Option<LogRecord>> {
    let mut file = match File::open(segment_path(dir, at.segment)) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    file.seek(SeekFrom::Start(at.offset))?;
    Ok(match next_frame(&mut file)? {
        Frame::Record(record, _) => Some(record),
        Frame::End | Frame::Bad => None,
    })
}

/// The frame an index points at: `None` when its segment is gone (pruned meanwhile), an error
/// when the frame is not there or damaged (an index pointing at nothing is corruption, not "no
/// such event": the dedupe path must not take it for a new id).
pub fn read_indexed(dir: &Path, at: LogPosition) -> std::io::Result<Option<LogRecord>> {
    let mut file = match File::open(segment_path(dir, at.segment)) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    file.seek(SeekFrom::Start(at.offset))?;
    match next_frame(&mut file)? {
        Frame::Record(record, _) => Ok(Some(record)),
        Frame::End | Frame::Bad => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "event log segment {} has no intact frame at byte {} (an index points there)",
                segment_path(dir, at.segment).display(),
                at.offset
            ),
        )),
    }
}

/// How a scan ended.
#[derive(Debug, PartialEq, Eq)]
pub struct ScanEnd {
    /// Where the next frame would start (after the last intact one visited).
    pub next: LogPosition,
    /// The newest segment ended in a torn or corrupt frame.
    pub torn_tail: bool,
}

/// Visit every intact frame from `from` on, in log order: `f(where, record, where the next frame
/// starts)`. A bad frame in an older segment is corruption (an error); at the end of the newest
/// one it ends the scan. The newest segment may be growing while it is scanned: a frame still
/// being written ends the scan the same way.
pub fn scan(
    dir: &Path,
    from: LogPosition,
    mut f: impl FnMut(LogPosition, LogRecord, LogPosition) -> ControlFlow<()>,
) -> std::io::Result<ScanEnd> {
    let all = segments(dir)?;
    let mut end = ScanEnd {
        next: from,
        torn_tail: false,
    };
    let wanted: Vec<u64> = all.iter().copied().filter(|s| *s >= from.segment).collect();
    for (i, &segment) in wanted.iter().enumerate() {
        let newest = i + 1 == wanted.len();
        let file = match File::open(segment_path(dir, segment)) {
            Ok(file) => file,
            // Pruned while we were scanning: it was older than anything still wanted.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        let mut reader = BufReader::with_capacity(256 * 1024, file);
        let mut offset = if segment == from.segment {
            from.offset
        } else {
            0
        };
        reader.seek(SeekFrom::Start(offset))?;
        end.next = LogPosition { segment, offset };
        loop {
            match next_frame(&mut reader)? {
                Frame::Record(record, len) => {
                    let here = LogPosition { segment, offset };
                    offset += len;
                    let next = LogPosition { segment, offset };
                    end.next = next;
                    if f(here, record, next).is_break() {
                        return Ok(end);
                    }
                }
                Frame::End => break,
                Frame::Bad if newest => {
                    end.torn_tail = true;
                    break;
                }
                Frame::Bad => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!(
                            "event log segment {} is corrupt at byte {offset}",
                            segment_path(dir, segment).display()
                        ),
                    ))
                }
            }
        }
    }
    Ok(end)
}

/// [`scan`] of the frames before `until` (all, without one): the scan ends there, and so does
/// the returned end.
pub fn scan_before(
    dir: &Path,
    from: LogPosition,
    until: Option<LogPosition>,
    mut f: impl FnMut(LogPosition, LogRecord, LogPosition) -> ControlFlow<()>,
) -> std::io::Result<ScanEnd> {
    let mut end = scan(dir, from, |at, record, next| match until {
        Some(until) if at >= until => ControlFlow::Break(()),
        _ => f(at, record, next),
    })?;
    if let Some(until) = until {
        end.next = end.next.min(until);
    }
    Ok(end)
}

enum Frame {
    /// An intact frame and its length including the header.
    Record(LogRecord, u64),
    /// Clean end of the file.
    End,
    /// Cut short, or failing its checksum or decoding.
    Bad,
}

fn next_frame(reader: &mut impl Read) -> std::io::Result<Frame> {
    let mut header = [0u8; HEADER];
    match read_full(reader, &mut header)? {
        0 => return Ok(Frame::End),
        n if n < HEADER => return Ok(Frame::Bad),
        _ => {}
    }
    let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
    let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
    if len > MAX_FRAME {
        return Ok(Frame::Bad);
    }
    let mut payload = vec![0u8; len];
    if read_full(reader, &mut payload)? < len || crc32fast::hash(&payload) != crc {
        return Ok(Frame::Bad);
    }
    Ok(match serde_json::from_slice(&payload) {
        Ok(record) => Frame::Record(record, (HEADER + len) as u64),
        Err(_) => Frame::Bad,
    })
}

/// Read until `buf` is full or the file ends; returns the bytes read.
fn read_full(reader: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// The newest segment's tail, as [`check_tail`] found it (read only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tail {
    /// Nothing but intact frames.
    Clean,
    /// Intact frames up to `good`, then a write cut short (nothing of it was acknowledged); the
    /// appender cuts it off.
    Torn { segment: u64, good: u64 },
}

impl Tail {
    /// Refuse a torn tail that begins before `indexed`: those frames were indexed, so
    /// acknowledged, and a crash cannot have damaged them.
    pub fn check_indexed(&self, dir: &Path, indexed: LogPosition) -> std::io::Result<()> {
        match *self {
            Tail::Torn { segment, good } if indexed.segment == segment && good < indexed.offset => {
                Err(corrupt_at(
                    dir,
                    segment,
                    good,
                    format!(
                        "the damage lies before byte {}, up to which events are indexed",
                        indexed.offset
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
}

fn corrupt_at(dir: &Path, segment: u64, at: u64, why: String) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!(
            "event log segment {} is corrupt at byte {at}: {why}; refusing to open (a torn write \
             at the end would be cut off, this is not one)",
            segment_path(dir, segment).display()
        ),
    )
}

/// Look at the newest segment without changing it: is it clean, does it end in a torn write
/// (recovered by cutting it off), or is it damaged where a crash cannot have damaged it? A
/// crash leaves the intact frames followed by a prefix of the last write, so an intact frame
/// after the damage is corruption: cutting there would drop acknowledged events, so the error
/// names the segment and the byte, and nothing is touched. (Run before sled opens the store,
/// which writes to its own files.)
pub fn check_tail(dir: &Path) -> std::io::Result<Tail> {
    let Some(&segment) = segments(dir)?.last() else {
        return Ok(Tail::Clean);
    };
    let mut file = File::open(segment_path(dir, segment))?;
    let (good, torn) = intact_length(&mut file)?;
    if !torn {
        return Ok(Tail::Clean);
    }
    if let Some(at) = intact_frame_after(&mut file, good)? {
        return Err(corrupt_at(
            dir,
            segment,
            good,
            format!("an intact frame follows at byte {at}"),
        ));
    }
    Ok(Tail::Torn { segment, good })
}

/// The first offset past `from` where an intact frame starts, if any.
fn intact_frame_after(file: &mut File, from: u64) -> std::io::Result<Option<u64>> {
    file.seek(SeekFrom::Start(from))?;
    let mut rest = Vec::new();
    file.read_to_end(&mut rest)?;
    // Every payload is a JSON object that starts with the delivery id: a cheap filter before
    // the checksum.
    const PREFIX: &[u8] = b"{\"d\":";
    for start in 1..rest.len() {
        let Some(header) = rest.get(start..start + HEADER) else {
            break;
        };
        let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
        let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
        let Some(payload) = rest.get(start + HEADER..start + HEADER + len) else {
            continue;
        };
        if payload.starts_with(PREFIX)
            && crc32fast::hash(payload) == crc
            && serde_json::from_slice::<LogRecord>(payload).is_ok()
        {
            return Ok(Some(from + start as u64));
        }
    }
    Ok(None)
}

/// Length of the intact prefix of a segment, and whether anything followed it.
fn intact_length(file: &mut File) -> std::io::Result<(u64, bool)> {
    let total = file.seek(SeekFrom::End(0))?;
    file.seek(SeekFrom::Start(0))?;
    let mut reader = BufReader::with_capacity(256 * 1024, &mut *file);
    let mut good = 0u64;
    loop {
        match next_frame(&mut reader)? {
            Frame::Record(_, len) => good += len,
            Frame::End => return Ok((good, false)),
            Frame::Bad => return Ok((good, good < total)),
        }
    }
}

/// The highest sequence number in the log: in the newest segment that holds a frame (a new
/// segment starts empty). None for a log without events.
pub fn last_seq(dir: &Path) -> std::io::Result<Option<u64>> {
    for &segment in segments(dir)?.iter().rev() {
        let mut last = None;
        let start = LogPosition { segment, offset: 0 };
        scan(dir, start, |at, record, _| {
            if at.segment != segment {
                return ControlFlow::Break(());
            }
            last = last.max(record.seqs.iter().copied().max());
            ControlFlow::Continue(())
        })?;
        if last.is_some() {
            return Ok(last);
        }
    }
    Ok(None)
}

/// Sync a directory, so the entries made or renamed in it survive a power loss.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Every intact record of a layout-1 intake log at `path` (none if it does not exist).
pub fn read_legacy(path: &Path) -> std::io::Result<Vec<LogRecord>> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut reader = BufReader::new(file);
    let mut out = Vec::new();
    while let Frame::Record(record, _) = next_frame(&mut reader)? {
        out.push(record);
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
