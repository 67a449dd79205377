//! The intake log: an append-only file that makes accepted deliveries durable with one
//! `fdatasync` per group, instead of a sled flush.
//!
//! Why: sled 0.34's flush holds its global lock for the whole disk write and costs several times
//! an `fdatasync` of the few kilobytes a group adds. The writer records each group's new events
//! here, syncs, and only then answers; sled gets the same writes in a transaction that it persists
//! in its own time. Once a sled flush has covered everything in the log, the log is emptied. On
//! open, whatever is still in the log is accepted into sled again (dedupe makes that idempotent).
//!
//! Frame: `len: u32 LE`, `crc32(payload): u32 LE`, `payload` (JSON [`WalRecord`]). A frame that
//! is cut short or fails its checksum ends the log: it can only be a write whose sync never
//! finished, so none of it was acknowledged.

use crate::webhook::model::Millis;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Frames larger than this are treated as corruption (a delivery is at most the body limit).
const MAX_FRAME: usize = 256 * 1024 * 1024;

/// The new events of one accepted delivery.
#[derive(Debug, Deserialize)]
pub struct WalRecord {
    #[serde(rename = "d")]
    pub delivery: String,
    #[serde(rename = "t")]
    pub received_at: Millis,
    #[serde(rename = "e")]
    pub events: Vec<Box<RawValue>>,
}

/// Framed records built off the file (by the writer), queued on it later (by the syncer).
#[derive(Default)]
pub struct Frames {
    buf: Vec<u8>,
}

impl Frames {
    /// Frame one delivery's new events. Each event is the exact JSON text accepted on intake, so
    /// it is copied in as is.
    pub fn push(&mut self, delivery: &str, received_at: Millis, events: &[&str]) {
        let start = self.buf.len();
        self.buf.extend_from_slice(&[0; 8]);
        self.buf.extend_from_slice(b"{\"d\":");
        if serde_json::to_writer(&mut self.buf, delivery).is_err() {
            self.buf.truncate(start);
            return;
        }
        self.buf
            .extend_from_slice(format!(",\"t\":{received_at},\"e\":[").as_bytes());
        for (i, raw) in events.iter().enumerate() {
            if i > 0 {
                self.buf.push(b',');
            }
            self.buf.extend_from_slice(raw.as_bytes());
        }
        self.buf.extend_from_slice(b"]}");
        let payload = &self.buf[start + 8..];
        let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        let crc = crc32fast::hash(payload);
        self.buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
        self.buf[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

pub struct Wal {
    file: File,
    path: PathBuf,
    len: u64,
    buf: Vec<u8>,
}

impl Wal {
    /// Open the log for appending, creating it if needed. Call [`read`] first to recover.
    pub fn open(path: &Path) -> std::io::Result<Wal> {
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)?;
        let len = file.seek(SeekFrom::End(0))?;
        Ok(Wal {
            file,
            path: path.to_owned(),
            len,
            buf: Vec::new(),
        })
    }

    /// Queue frames for the next [`commit`](Wal::commit).
    pub fn queue(&mut self, frames: Frames) {
        if self.buf.is_empty() {
            self.buf = frames.buf;
        } else {
            self.buf.extend_from_slice(&frames.buf);
        }
    }

    /// Drop the queued frames (a sled flush is about to cover them).
    pub fn discard_pending(&mut self) {
        self.buf.clear();
    }

    /// Write what was queued and wait until it is on disk.
    pub fn commit(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let result = self
            .file
            .write_all(&self.buf)
            .and_then(|()| self.file.sync_data());
        match result {
            Ok(()) => {
                self.len += self.buf.len() as u64;
                self.buf.clear();
                Ok(())
            }
            Err(e) => {
                self.buf.clear();
                // Drop whatever part made it, so later frames do not follow a torn one.
                let _ = self.file.set_len(self.len);
                let _ = self.file.seek(SeekFrom::Start(self.len));
                Err(e)
            }
        }
    }

    /// Bytes in the log.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Empty the log. Only after a sled flush covered every record in it.
    pub fn reset(&mut self) -> std::io::Result<()> {
        self.file.set_len(0)?;
        self.file.seek(SeekFrom::Start(0))?;
        self.file.sync_all()?;
        self.len = 0;
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Every intact record of the log at `path` (none if it does not exist), and whether a torn or
/// corrupt tail was cut off.
pub fn read(path: &Path) -> std::io::Result<(Vec<WalRecord>, bool)> {
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut bytes)?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), false)),
        Err(e) => return Err(e),
    }
    let mut records = Vec::new();
    let mut rest = bytes.as_slice();
    while !rest.is_empty() {
        let Some((record, after)) = frame(rest) else {
            return Ok((records, true));
        };
        records.push(record);
        rest = after;
    }
    Ok((records, false))
}

fn frame(bytes: &[u8]) -> Option<(WalRecord, &[u8])> {
    let len = u32::from_le_bytes(bytes.get(0..4)?.try_into().ok()?) as usize;
    let crc = u32::from_le_bytes(bytes.get(4..8)?.try_into().ok()?);
    if len > MAX_FRAME {
        return None;
    }
    let payload = bytes.get(8..8 + len)?;
    if crc32fast::hash(payload) != crc {
        return None;
    }
    let record = serde_json::from_slice(payload).ok()?;
    Some((record, &bytes[8 + len..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(records: &[(&str, Millis, &[&str])]) -> Frames {
        let mut f = Frames::default();
        for (d, t, e) in records {
            f.push(d, *t, e);
        }
        f
    }

    #[test]
    fn committed_records_read_back_and_a_torn_tail_is_cut() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("intake.wal");
        let mut wal = Wal::open(&path).expect("open");
        wal.queue(frames(&[("d1", 5, &[r#"{"id":"e1"}"#, r#"{"id":"e2"}"#])]));
        wal.queue(frames(&[("d2", 6, &[r#"{"id":"e3"}"#])]));
        wal.commit().expect("commit");
        let full = wal.len();
        let (records, torn) = read(&path).expect("read");
        assert!(!torn);
        let ids: Vec<_> = records
            .iter()
            .map(|r| (r.delivery.as_str(), r.received_at, r.events.len()))
            .collect();
        assert_eq!(ids, vec![("d1", 5, 2), ("d2", 6, 1)]);
        assert_eq!(records[0].events[1].get(), r#"{"id":"e2"}"#);

        // A third frame cut in the middle, as a crash during its write would leave it.
        wal.queue(frames(&[("d3", 7, &[r#"{"id":"e4"}"#])]));
        wal.commit().expect("commit");
        let file = OpenOptions::new().write(true).open(&path).expect("open");
        file.set_len(full + 5).expect("truncate");
        let (records, torn) = read(&path).expect("read");
        assert!(torn);
        assert_eq!(records.len(), 2);

        // A flipped byte fails the checksum.
        let mut bytes = std::fs::read(&path).expect("read");
        bytes[10] ^= 0xff;
        std::fs::write(&path, &bytes).expect("write");
        let (records, torn) = read(&path).expect("read");
        assert!(torn);
        assert!(records.is_empty());
    }

    #[test]
    fn reset_empties_the_log_and_appending_continues() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("intake.wal");
        let mut wal = Wal::open(&path).expect("open");
        wal.queue(frames(&[("d1", 1, &[r#"{"id":"e1"}"#])]));
        wal.commit().expect("commit");
        wal.reset().expect("reset");
        assert!(wal.is_empty());
        assert!(read(&path).expect("read").0.is_empty());
        wal.queue(frames(&[("d2", 2, &[r#"{"id":"e2"}"#])]));
        wal.commit().expect("commit");
        drop(wal);
        let reopened = Wal::open(&path).expect("reopen");
        assert!(!reopened.is_empty());
        let (records, _) = read(&path).expect("read");
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].delivery, "d2");
    }
}
