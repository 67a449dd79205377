//! The dedupe index: which event and delivery ids are in the event log, kept in memory.
//!
//! Why not in sled: a dedupe record per event was the largest thing sled held (about 130 MiB of
//! its memory while a million were written) and half of every intake transaction. The event log
//! already holds every id; this index only says where to look: by a 64-bit hash (xxh3, a fixed
//! algorithm: hashes are written to disk) to the frames that may hold it.
//!
//! A hash match is a candidate, not a verdict: the caller reads the frame and compares the id
//! ([`SledStore::seen_event`](super::SledStore)), so a collision can never drop an event. That is why
//! sealed ids keep only 48 bits of their hash: a false match costs a rare extra frame read.
//!
//! The newest segment's ids are in a hash map; when the log moves to a new segment the old one is
//! sealed: merged into one array of every sealed id, so a lookup costs the same however many
//! segments the dedupe window spans. 10 bytes per sealed id (at 16, the 1.1M ids of a million
//! events took 17 MB of a daemon meant to stay under 100 MB): the top 16 bits of the hash pick
//! one of 2^16 buckets (a fence table of 256 KiB; about 16 ids per bucket per million held,
//! binary-searched) and are not stored, the low 32 are; the frame's offset takes 32 bits and its
//! segment a 16-bit ordinal among the sealed segments, renumbered whenever they change. So at
//! most 65,536 segments (4 TiB of log) fit in the window at once; one more is refused (an open
//! fails, the indexer retries until pruning makes room) rather than letting an ordinal wrap and
//! name wrong frames.
//!
//! Each sealed segment's ids are also written to `<segment>.ids` beside it, with full hashes, so
//! an open need not read the whole log. That file is only a cache of the log: it is written
//! without a sync, checked by length and CRC when read, and rebuilt from the segment when
//! missing or bad.

use super::eventlog::{self, LogPosition};
use std::collections::HashMap;
use std::io::Write;
use std::ops::ControlFlow;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

const IDS_MAGIC: &[u8; 8] = b"HBIDS\x00\x00\x01";
const IDS_SUFFIX: &str = ".ids";

/// Hash of an event id.
pub fn event_hash(id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(id.as_bytes(), 0)
}

/// Hash of a delivery id (another seed: the two kinds share the index).
pub fn delivery_hash(id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(id.as_bytes(), 1)
}

/// A sealed segment's ids: hashes sorted, the frame offsets beside them.
#[derive(Debug, Default, PartialEq, Eq)]
struct Sealed {
    hashes: Vec<u64>,
    offsets: Vec<u32>,
}

impl Sealed {
    fn from_pairs(mut pairs: Vec<(u64, u32)>) -> Sealed {
        pairs.sort_unstable();
        pairs.dedup();
        let (hashes, offsets) = pairs.into_iter().unzip();
        Sealed { hashes, offsets }
    }

    fn len(&self) -> usize {
        self.hashes.len()
    }

    fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(self.len() * 12);
        for h in &self.hashes {
            body.extend_from_slice(&h.to_le_bytes());
        }
        for o in &self.offsets {
            body.extend_from_slice(&o.to_le_bytes());
        }
        let mut out = Vec::with_capacity(body.len() + 20);
        out.extend_from_slice(IDS_MAGIC);
        out.extend_from_slice(&(self.len() as u64).to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    fn decode(bytes: &[u8]) -> Option<Sealed> {
        let magic = bytes.get(..8)?;
        let count = u64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?);
        let crc = u32::from_le_bytes(bytes.get(16..20)?.try_into().ok()?);
        let body = bytes.get(20..)?;
        let count = usize::try_from(count).ok()?;
        if magic != IDS_MAGIC || body.len() != count.checked_mul(12)? {
            return None;
        }
        if crc32fast::hash(body) != crc {
            return None;
        }
        let (h, o) = body.split_at(count * 8);
        let hashes: Vec<u64> = h
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect();
        let offsets = o
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        // Sorted is what lookups rely on; an unsorted file is not one we wrote.
        hashes
            .windows(2)
            .all(|w| w[0] <= w[1])
            .then_some(Sealed { hashes, offsets })
    }
}

/// The newest segment's ids, still growing.
#[derive(Debug, Default)]
struct Open {
    segment: u64,
    first: HashMap<u64, u32>,
    /// Further frames under a hash already in `first` (a collision, or an id logged twice).
    more: Vec<(u64, u32)>,
}

impl Open {
    fn insert(&mut self, hash: u64, offset: u32) {
        match self.first.get(&hash) {
            None => {
                self.first.insert(hash, offset);
            }
            Some(o) if *o == offset => {}
            Some(_) => {
                if !self.more.contains(&(hash, offset)) {
                    self.more.push((hash, offset));
                }
            }
        }
    }

    fn seal(self) -> Sealed {
        let mut pairs: Vec<(u64, u32)> = self.first.into_iter().collect();
        pairs.extend(self.more);
        Sealed::from_pairs(pairs)
    }
}

/// Hash bits that pick an id's bucket in [`Merged`] (so they need not be stored).
const BUCKET_BITS: u32 = 16;
const BUCKETS: usize = 1 << BUCKET_BITS;

/// Sealed segments the index holds at once: an id names its segment by a 16-bit ordinal. With
/// 64 MiB segments that is 4 TiB of event log in the dedupe window.
pub const MAX_SEALED_SEGMENTS: usize = 1 << 16;

/// Ids [`Merged`] holds at once (its fences are 32-bit).
const MAX_SEALED_IDS: usize = u32::MAX as usize;

fn bucket(hash: u64) -> usize {
    (hash >> (64 - BUCKET_BITS)) as usize
}

/// The hash bits kept beside the bucket's: 48 of the 64 in all.
fn low(hash: u64) -> u32 {
    (hash & u64::from(u32::MAX)) as u32
}

/// A position in the columns as a fence (below [`MAX_SEALED_IDS`], which `Merged::add` checks).
fn fence(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

/// The sealed index cannot take more segments or ids: sealing is refused rather than letting an
/// ordinal or a fence wrap and name wrong frames. Pruning (a shorter dedupe window) makes room.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the dedupe index would hold {segments} sealed segments and {ids} ids, over its limits of \
     {max_segments} and {max_ids}: the dedupe window spans too much of the event log",
    max_segments = MAX_SEALED_SEGMENTS,
    max_ids = MAX_SEALED_IDS
)]
pub struct IndexFull {
    segments: usize,
    ids: usize,
}

fn check_room(segments: usize, ids: usize) -> Result<(), IndexFull> {
    if segments > MAX_SEALED_SEGMENTS || ids > MAX_SEALED_IDS {
        return Err(IndexFull { segments, ids });
    }
    Ok(())
}

/// Sealed ids, a column per field, sorted by bucket, then by (low hash bits, segment, offset).
#[derive(Debug, Default, PartialEq, Eq)]
struct Columns {
    /// The low 32 bits of each hash (its bucket holds the top 16).
    low: Vec<u32>,
    offsets: Vec<u32>,
    /// Each frame's segment as its position in [`Merged::segments`], which is in segment order,
    /// so ordinals sort as segment numbers do.
    ordinals: Vec<u16>,
    /// `fences[b]..fences[b + 1]` holds bucket `b`; empty while no id is held.
    fences: Vec<u32>,
}

impl Columns {
    fn len(&self) -> usize {
        self.low.len()
    }

    fn range(&self, b: usize) -> std::ops::Range<usize> {
        match (self.fences.get(b), self.fences.get(b + 1)) {
            (Some(start), Some(end)) => *start as usize..*end as usize,
            _ => 0..0,
        }
    }

    fn key(&self, i: usize) -> (u32, u16, u32) {
        (self.low[i], self.ordinals[i], self.offsets[i])
    }

    /// Sealed segments' ids, each run with its segment's ordinal: placed by bucket (a counting
    /// sort, linear however many runs), then each bucket sorted (a few dozen ids).
    fn from_runs(runs: &[(u16, &Sealed)]) -> Columns {
        let total = runs.iter().map(|(_, ids)| ids.len()).sum();
        let mut fences = vec![0u32; BUCKETS + 1];
        for (_, ids) in runs {
            for h in &ids.hashes {
                fences[bucket(*h)] += 1;
            }
        }
        let mut sum = 0;
        for f in &mut fences {
            (*f, sum) = (sum, sum + *f);
        }
        let mut next = fences.clone();
        let mut columns = Columns {
            low: vec![0; total],
            offsets: vec![0; total],
            ordinals: vec![0; total],
            fences,
        };
        for (ordinal, ids) in runs {
            for (h, offset) in ids.hashes.iter().zip(&ids.offsets) {
                let slot = &mut next[bucket(*h)];
                let i = *slot as usize;
                *slot += 1;
                columns.low[i] = low(*h);
                columns.offsets[i] = *offset;
                columns.ordinals[i] = *ordinal;
            }
        }
        drop(next);
        let mut bucket_ids = Vec::new();
        for b in 0..BUCKETS {
            let range = columns.range(b);
            if range.len() < 2 {
                continue;
            }
            bucket_ids.clear();
            bucket_ids.extend(range.clone().map(|i| columns.key(i)));
            bucket_ids.sort_unstable();
            for (i, (low, ordinal, offset)) in range.zip(&bucket_ids) {
                columns.low[i] = *low;
                columns.ordinals[i] = *ordinal;
                columns.offsets[i] = *offset;
            }
        }
        columns
    }

    /// Merge `new` in (its ordinals final; `remap[o]` is what this one's ordinal `o` becomes).
    ///
    /// One column at a time, after a pass that records which side each id comes from (a bit
    /// per id): the rebuild holds the old columns, `new` and one new column (10 + 4 bytes per id
    /// held), not two whole copies.
    fn merge(&mut self, remap: &[u16], new: Columns) {
        let total = self.len() + new.len();
        let mut from_old = vec![0u64; total.div_ceil(64)];
        let mut fences = Vec::with_capacity(BUCKETS + 1);
        let mut p = 0;
        for b in 0..BUCKETS {
            fences.push(fence(p));
            let (mut old, mut added) = (self.range(b), new.range(b));
            loop {
                let take_old = match (old.start < old.end, added.start < added.end) {
                    (true, true) => {
                        let (low, ordinal, offset) = self.key(old.start);
                        (low, remap[usize::from(ordinal)], offset) <= new.key(added.start)
                    }
                    (true, false) => true,
                    (false, true) => false,
                    (false, false) => break,
                };
                if take_old {
                    from_old[p / 64] |= 1 << (p % 64);
                    old.start += 1;
                } else {
                    added.start += 1;
                }
                p += 1;
            }
        }
        fences.push(fence(p));
        let Columns {
            low,
            offsets,
            ordinals,
            fences: _,
        } = new;
        self.low = interleave(&from_old, total, self.low.iter().copied(), low);
        self.offsets = interleave(&from_old, total, self.offsets.iter().copied(), offsets);
        let old_ordinals = self.ordinals.iter().map(|o| remap[usize::from(*o)]);
        self.ordinals = interleave(&from_old, total, old_ordinals, ordinals);
        self.fences = fences;
    }
}

/// `total` items, from `old` where `from_old` has the item's bit set and from `new` elsewhere.
fn interleave<T>(
    from_old: &[u64],
    total: usize,
    mut old: impl Iterator<Item = T>,
    new: Vec<T>,
) -> Vec<T> {
    let mut new = new.into_iter();
    let mut out = Vec::with_capacity(total);
    for p in 0..total {
        let is_old = from_old
            .get(p / 64)
            .is_some_and(|bits| (bits >> (p % 64)) & 1 == 1);
        out.extend(if is_old { old.next() } else { new.next() });
    }
    out
}

/// Every sealed segment's ids (see the module doc).
#[derive(Debug, Default)]
struct Merged {
    ids: Columns,
    /// The sealed segments in order, with their id counts: an id's ordinal is its segment's
    /// position here. Every change renumbers them, so ordinals are reused as old segments are
    /// forgotten; only how many are sealed at once is bounded ([`MAX_SEALED_SEGMENTS`]).
    segments: Vec<(u64, usize)>,
}

fn ordinal(segments: &[(u64, usize)], segment: u64) -> Option<u16> {
    let i = segments.binary_search_by_key(&segment, |(s, _)| *s).ok()?;
    u16::try_from(i).ok()
}

impl Merged {
    fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether a segment of `ids` ids can be sealed (what [`add`](Merged::add) checks).
    fn room_for(&self, segment: u64, ids: usize) -> Result<(), IndexFull> {
        let new = usize::from(ordinal(&self.segments, segment).is_none());
        check_room(self.segments.len() + new, self.len() + ids)
    }

    /// Add sealed segments' ids (a segment already in, as in recovery, gains them). Refused,
    /// changing nothing, beyond [`MAX_SEALED_SEGMENTS`] segments or [`MAX_SEALED_IDS`] ids.
    ///
    /// This rebuilds the columns: a few passes over the ids held, once per sealed segment, under
    /// the index's lock (intake waits that long once per 64 MiB of log). The new ids are sorted
    /// into columns of their own first ([`Columns::from_runs`], which at an open takes every
    /// segment at once), then merged in ([`Columns::merge`]).
    fn add(&mut self, runs: Vec<(u64, Sealed)>) -> Result<(), IndexFull> {
        let runs: Vec<(u64, Sealed)> = runs.into_iter().filter(|(_, ids)| ids.len() > 0).collect();
        if runs.is_empty() {
            return Ok(());
        }
        let mut segments = self.segments.clone();
        segments.extend(runs.iter().map(|(segment, ids)| (*segment, ids.len())));
        segments.sort_by_key(|(segment, _)| *segment);
        segments.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                kept.1 += later.1;
            }
            same
        });
        let ids = self.len() + runs.iter().map(|(_, ids)| ids.len()).sum::<usize>();
        check_room(segments.len(), ids)?;
        let placed: Option<Vec<(u16, &Sealed)>> = runs
            .iter()
            .map(|(segment, ids)| Some((ordinal(&segments, *segment)?, ids)))
            .collect();
        let remap: Option<Vec<u16>> = self
            .segments
            .iter()
            .map(|(segment, _)| ordinal(&segments, *segment))
            .collect();
        let (Some(placed), Some(remap)) = (placed, remap) else {
            // Cannot happen: every number is in `segments`, which fits in 16 bits.
            return Err(IndexFull {
                segments: segments.len(),
                ids,
            });
        };
        let new = Columns::from_runs(&placed);
        drop(placed);
        drop(runs);
        if self.len() == 0 {
            self.ids = new;
        } else {
            self.ids.merge(&remap, new);
        }
        self.segments = segments;
        Ok(())
    }

    /// Forget a segment's ids; returns how many.
    fn remove(&mut self, segment: u64) -> usize {
        let Ok(position) = self.segments.binary_search_by_key(&segment, |(s, _)| *s) else {
            return 0;
        };
        let Ok(gone) = u16::try_from(position) else {
            return 0;
        };
        let (_, count) = self.segments.remove(position);
        // Compacted in place, bucket by bucket; the ordinals after the gone one move down.
        let ids = &mut self.ids;
        let mut kept = 0;
        for b in 0..ids.fences.len().saturating_sub(1) {
            let range = ids.range(b);
            ids.fences[b] = fence(kept);
            for i in range {
                let ordinal = ids.ordinals[i];
                if ordinal == gone {
                    continue;
                }
                ids.low[kept] = ids.low[i];
                ids.offsets[kept] = ids.offsets[i];
                ids.ordinals[kept] = if ordinal > gone { ordinal - 1 } else { ordinal };
                kept += 1;
            }
        }
        if let Some(last) = ids.fences.last_mut() {
            *last = fence(kept);
        }
        if kept == 0 {
            *ids = Columns::default();
        } else {
            for column in [&mut ids.low, &mut ids.offsets] {
                column.truncate(kept);
                column.shrink_to_fit();
            }
            ids.ordinals.truncate(kept);
            ids.ordinals.shrink_to_fit();
        }
        count
    }

    fn find(&self, hash: u64, out: &mut Vec<LogPosition>) {
        let range = self.ids.range(bucket(hash));
        let Some(lows) = self.ids.low.get(range.clone()) else {
            return;
        };
        let want = low(hash);
        let first = range.start + lows.partition_point(|l| *l < want);
        for i in first..range.end {
            if self.ids.low[i] != want {
                break;
            }
            if let Some((segment, _)) = self.segments.get(usize::from(self.ids.ordinals[i])) {
                out.push(LogPosition {
                    segment: *segment,
                    offset: u64::from(self.ids.offsets[i]),
                });
            }
        }
    }

    /// Heap bytes held (by capacity).
    fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        let ids = &self.ids;
        (ids.low.capacity() + ids.offsets.capacity() + ids.fences.capacity()) * size_of::<u32>()
            + ids.ordinals.capacity() * size_of::<u16>()
            + self.segments.capacity() * size_of::<(u64, usize)>()
    }
}

/// Every id of the retained segments (see the module doc).
#[derive(Debug)]
pub struct DedupeIndex {
    dir: PathBuf,
    sealed: Merged,
    open: Open,
}

impl DedupeIndex {
    /// Load the ids of segments `from` on: sealed segments from their `.ids` file (rebuilt from
    /// the segment when missing or bad), the newest by reading it.
    pub fn load(dir: &Path, from: u64) -> std::io::Result<DedupeIndex> {
        let segments: Vec<u64> = eventlog::segments(dir)?
            .into_iter()
            .filter(|s| *s >= from)
            .collect();
        let mut index = DedupeIndex {
            dir: dir.to_owned(),
            sealed: Merged::default(),
            open: Open {
                segment: segments.last().copied().unwrap_or(from),
                ..Open::default()
            },
        };
        let mut sealed = Vec::new();
        for (i, &segment) in segments.iter().enumerate() {
            let newest = i + 1 == segments.len();
            if !newest {
                if let Some(ids) = read_ids(&ids_path(dir, segment)) {
                    sealed.push((segment, ids));
                    continue;
                }
            }
            let mut open = Open {
                segment,
                ..Open::default()
            };
            let start = LogPosition { segment, offset: 0 };
            eventlog::scan(dir, start, |at, record, _| {
                if at.segment != segment {
                    return ControlFlow::Break(());
                }
                let Ok(offset) = u32::try_from(at.offset) else {
                    return ControlFlow::Break(());
                };
                open.insert(delivery_hash(&record.delivery), offset);
                for id in &record.ids {
                    open.insert(event_hash(id), offset);
                }
                ControlFlow::Continue(())
            })?;
            if newest {
                index.open = open;
            } else {
                let ids = open.seal();
                write_ids(dir, segment, &ids);
                sealed.push((segment, ids));
            }
        }
        index.sealed.add(sealed).map_err(std::io::Error::other)?;
        Ok(index)
    }

    /// Record a frame's delivery and event ids at `at`.
    ///
    /// Refused when the frame would seal the open segment into a full sealed index: nothing
    /// changes then (the open segment keeps its ids), and the same frames may come again.
    pub fn insert(
        &mut self,
        at: LogPosition,
        delivery: &str,
        ids: &[&str],
    ) -> Result<(), IndexFull> {
        let Ok(offset) = u32::try_from(at.offset) else {
            // Segments are far smaller than 4 GiB (`SledStore::open_with` checks the size).
            tracing::error!(?at, "event log offset out of range for the dedupe index");
            return Ok(());
        };
        let hashes =
            std::iter::once(delivery_hash(delivery)).chain(ids.iter().map(|id| event_hash(id)));
        if at.segment > self.open.segment {
            // The log moved on: the open segment is complete.
            if !self.open.first.is_empty() {
                let ids = self.open.first.len() + self.open.more.len();
                self.sealed.room_for(self.open.segment, ids)?;
            }
            let done = std::mem::replace(
                &mut self.open,
                Open {
                    segment: at.segment,
                    ..Open::default()
                },
            );
            if !done.first.is_empty() {
                let segment = done.segment;
                let ids = done.seal();
                write_ids(&self.dir, segment, &ids);
                // Room was checked above.
                self.sealed.add(vec![(segment, ids)])?;
            }
        }
        if at.segment == self.open.segment {
            for h in hashes {
                self.open.insert(h, offset);
            }
        } else {
            // Recovery indexing frames of a segment sealed before a crash: mostly there already.
            let mut found = Vec::new();
            let missing: Vec<(u64, u32)> = hashes
                .filter(|h| {
                    found.clear();
                    self.sealed.find(*h, &mut found);
                    !found.contains(&at)
                })
                .map(|h| (h, offset))
                .collect();
            if !missing.is_empty() {
                self.sealed
                    .add(vec![(at.segment, Sealed::from_pairs(missing))])?;
            }
        }
        Ok(())
    }

    /// Frames that may hold an id of this hash.
    pub fn candidates(&self, hash: u64) -> Vec<LogPosition> {
        let mut out = Vec::new();
        let segment = self.open.segment;
        if let Some(o) = self.open.first.get(&hash) {
            out.push(LogPosition {
                segment,
                offset: u64::from(*o),
            });
            for (h, o) in &self.open.more {
                if *h == hash {
                    out.push(LogPosition {
                        segment,
                        offset: u64::from(*o),
                    });
                }
            }
        }
        self.sealed.find(hash, &mut out);
        out
    }

    /// Sealed segments, oldest first, with their id counts.
    pub fn sealed_segments(&self) -> Vec<(u64, usize)> {
        self.sealed.segments.clone()
    }

    /// Forget a sealed segment's ids (pruning). Its `.ids` file goes with the segment.
    pub fn forget(&mut self, segment: u64) -> usize {
        self.sealed.remove(segment)
    }

    /// Ids held (events and deliveries).
    pub fn ids(&self) -> usize {
        self.open.first.len() + self.open.more.len() + self.sealed.len()
    }

    /// Heap bytes of the sealed segments' ids (by capacity): about 10 per id, plus 256 KiB of
    /// fences once any is held.
    pub fn sealed_heap_bytes(&self) -> usize {
        self.sealed.heap_bytes()
    }
}

pub fn ids_path(dir: &Path, segment: u64) -> PathBuf {
    let mut path = eventlog::segment_path(dir, segment);
    path.set_extension(&IDS_SUFFIX[1..]);
    path
}

/// Delete a segment's `.ids` file (with its segment).
pub fn remove_ids(dir: &Path, segment: u64) {
    match std::fs::remove_file(ids_path(dir, segment)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            tracing::warn!(segment, error = %e, "cannot delete a dedupe index file");
        }
        _ => {}
    }
}

fn read_ids(path: &Path) -> Option<Sealed> {
    let bytes = std::fs::read(path).ok()?;
    let sealed = Sealed::decode(&bytes);
    if sealed.is_none() {
        tracing::warn!(path = %path.display(), "dedupe index file unreadable; rebuilding it from its segment");
    }
    sealed
}

/// Write a sealed segment's `.ids` (atomically by rename; no sync: it is a cache of the log).
/// A failure is logged: the next open reads the segment instead.
fn write_ids(dir: &Path, segment: u64, sealed: &Sealed) {
    let path = ids_path(dir, segment);
    let tmp = path.with_extension("ids.tmp");
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| f.write_all(&sealed.encode()))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        tracing::warn!(path = %path.display(), error = %e, "cannot write a dedupe index file; the next start reads its segment instead");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eventlog::{Appender, FrameEvent, Frames};

    fn append(log: &mut Appender, delivery: &str, ids: &[&str]) -> LogPosition {
        let mut frames = Frames::default();
        let events: Vec<FrameEvent<'_>> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| FrameEvent {
                seq: i as u64,
                id,
                partition: "c:x",
                raw: "{}",
            })
            .collect();
        frames.push(delivery, 1, &events);
        let at = log.queue(frames)[0];
        log.commit().expect("commit");
        at
    }

    #[test]
    fn sealed_segments_round_trip_through_their_file_and_bad_files_are_refused() {
        let sealed = Sealed::from_pairs(vec![(9, 1), (3, 7), (9, 0), (3, 7)]);
        assert_eq!(sealed.hashes, vec![3, 9, 9]);
        assert_eq!(sealed.offsets, vec![7, 0, 1]);
        let bytes = sealed.encode();
        assert_eq!(Sealed::decode(&bytes), Some(sealed));
        let mut flipped = bytes.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert_eq!(Sealed::decode(&flipped), None, "CRC");
        assert_eq!(Sealed::decode(&bytes[..bytes.len() - 4]), None, "cut short");
        assert_eq!(Sealed::decode(b"HBIDS"), None);
    }

    #[test]
    fn ids_are_found_in_the_open_and_sealed_segments_and_survive_a_reload() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Tiny segments: every frame starts a new one.
        let (mut log, _) = Appender::open(dir.path(), 10).expect("open");
        let mut index = DedupeIndex::load(dir.path(), 0).expect("load");
        let a = append(&mut log, "d1", &["e1", "e2"]);
        index.insert(a, "d1", &["e1", "e2"]).expect("insert");
        let b = append(&mut log, "d2", &["e3"]);
        index.insert(b, "d2", &["e3"]).expect("insert");
        assert_eq!(a.segment + 1, b.segment);
        assert_eq!(index.candidates(event_hash("e1")), vec![a]);
        assert_eq!(index.candidates(event_hash("e3")), vec![b]);
        assert_eq!(index.candidates(delivery_hash("d2")), vec![b]);
        assert!(index.candidates(event_hash("d2")).is_empty(), "kinds apart");
        assert!(ids_path(dir.path(), a.segment).exists(), "sealed: written");
        assert_eq!(index.sealed_segments(), vec![(a.segment, 3)]);

        // Reloaded: from the file for segment a, and from a re-read of a segment without one.
        let again = DedupeIndex::load(dir.path(), 0).expect("reload");
        assert_eq!(again.candidates(event_hash("e2")), vec![a]);
        assert_eq!(again.candidates(event_hash("e3")), vec![b]);
        std::fs::write(ids_path(dir.path(), a.segment), b"garbage").expect("spoil");
        let rebuilt = DedupeIndex::load(dir.path(), 0).expect("rebuild");
        assert_eq!(rebuilt.candidates(event_hash("e1")), vec![a]);
        assert!(
            read_ids(&ids_path(dir.path(), a.segment)).is_some(),
            "the file was rewritten"
        );
        // Loading from a later segment leaves the earlier ids out.
        let later = DedupeIndex::load(dir.path(), b.segment).expect("load later");
        assert!(later.candidates(event_hash("e1")).is_empty());
        assert_eq!(later.ids(), 2);
    }

    /// Hash parts drawn from few values, so that ids share a bucket (the top 16 bits), share
    /// the low 32 bits too while their middle bits differ (one candidate for both: harmless),
    /// or are equal. The first and last buckets are among them.
    const TOPS: [u64; 4] = [0, 1, 0x8000, 0xFFFF];
    const MIDS: [u64; 3] = [0, 1, 0xFFFF];
    const LOWS: [u64; 4] = [0, 7, 0x8000_0000, 0xFFFF_FFFF];
    /// Segment numbers far apart, past 16 and 32 bits.
    const SEGMENT_NUMBERS: [u64; 7] = [0, 1, 5, 6, 70_000, 70_001, 1 << 40];

    fn model_hash((top, mid, low): (usize, usize, usize)) -> u64 {
        TOPS[top] << 48 | MIDS[mid] << 32 | LOWS[low]
    }

    fn spread(x: u64) -> u64 {
        x.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    /// What a lookup compares: the bucket's bits and the low 32.
    fn kept_bits(hash: u64) -> u64 {
        hash & 0xFFFF_0000_FFFF_FFFF
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Seal a segment (`SEGMENT_NUMBERS[i]`) with these ids; one already in gains them.
        Add(usize, Vec<(u64, u32)>),
        Remove(usize),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let hash = prop_oneof![
            (0..TOPS.len(), 0..MIDS.len(), 0..LOWS.len()).prop_map(model_hash),
            (0u64..16).prop_map(spread),
        ];
        let offset = prop_oneof![0u32..8, Just(u32::MAX), any::<u32>()];
        prop_oneof![
            3 => (0..SEGMENT_NUMBERS.len(), proptest::collection::vec((hash, offset), 0..40))
                .prop_map(|(s, ids)| Op::Add(s, ids)),
            1 => (0..SEGMENT_NUMBERS.len()).prop_map(Op::Remove),
        ]
    }

    /// The columns' own rules: fences cut sorted buckets, ordinals name the listed segments and
    /// the counts agree.
    fn assert_consistent(merged: &Merged) {
        let ids = &merged.ids;
        assert_eq!(ids.offsets.len(), ids.len());
        assert_eq!(ids.ordinals.len(), ids.len());
        if ids.len() == 0 {
            assert!(ids.fences.is_empty(), "no fences while empty");
        } else {
            assert_eq!(ids.fences.len(), BUCKETS + 1);
            assert_eq!(ids.fences.first().copied(), Some(0));
            assert_eq!(ids.fences.last().copied(), Some(fence(ids.len())));
            assert!(ids.fences.windows(2).all(|w| w[0] <= w[1]));
            for b in 0..BUCKETS {
                let range = ids.range(b);
                assert!(range
                    .clone()
                    .zip(range.skip(1))
                    .all(|(i, j)| ids.key(i) <= ids.key(j)));
            }
        }
        assert!(merged.segments.windows(2).all(|w| w[0].0 < w[1].0));
        let mut counts = vec![0; merged.segments.len()];
        for o in &ids.ordinals {
            counts[usize::from(*o)] += 1;
        }
        let listed: Vec<usize> = merged.segments.iter().map(|(_, n)| *n).collect();
        assert_eq!(counts, listed);
        assert!(listed.iter().all(|n| *n > 0));
    }

    proptest::proptest! {
        /// The merged columns find what a plain list of (hash, where) finds, through additions
        /// (in any segment order, to a segment already in too) and removals: every id whose
        /// hash matches in the bucket's and the low 32 bits, in frame order. So no id with the
        /// hash asked for is missed, and ids that differ only in the middle bits come along.
        #[test]
        fn merged_finds_what_a_plain_list_finds(
            ops in proptest::collection::vec(op(), 1..12),
        ) {
            let mut merged = Merged::default();
            let mut plain: Vec<(u64, LogPosition)> = Vec::new();
            // What is sealed now, run by run, to load all at once at the end.
            let mut runs: Vec<(u64, Vec<(u64, u32)>)> = Vec::new();
            for op in ops {
                match op {
                    Op::Add(s, pairs) => {
                        let segment = SEGMENT_NUMBERS[s];
                        let sealed = Sealed::from_pairs(pairs.clone());
                        for (hash, o) in sealed.hashes.iter().zip(&sealed.offsets) {
                            plain.push((*hash, LogPosition { segment, offset: u64::from(*o) }));
                        }
                        merged.add(vec![(segment, sealed)]).expect("room");
                        runs.push((segment, pairs));
                    }
                    Op::Remove(s) => {
                        let segment = SEGMENT_NUMBERS[s];
                        let before = plain.len();
                        plain.retain(|(_, at)| at.segment != segment);
                        runs.retain(|(s, _)| *s != segment);
                        proptest::prop_assert_eq!(merged.remove(segment), before - plain.len());
                    }
                }
                assert_consistent(&merged);
                let mut listed: Vec<(u64, usize)> = Vec::new();
                for (_, at) in &plain {
                    match listed.iter_mut().find(|(s, _)| *s == at.segment) {
                        Some((_, n)) => *n += 1,
                        None => listed.push((at.segment, 1)),
                    }
                }
                listed.sort();
                proptest::prop_assert_eq!(&merged.segments, &listed);
            }
            // One segment at a time (sealing while running) and all at once (an open) agree.
            let mut loaded = Merged::default();
            loaded
                .add(runs.into_iter().map(|(s, pairs)| (s, Sealed::from_pairs(pairs))).collect())
                .expect("room");
            assert_consistent(&loaded);
            proptest::prop_assert_eq!(&loaded.ids, &merged.ids);
            proptest::prop_assert_eq!(&loaded.segments, &merged.segments);

            let mut asked: Vec<u64> = (0u64..16).map(spread).collect();
            for top in 0..TOPS.len() {
                for low in 0..LOWS.len() {
                    for mid in 0..MIDS.len() {
                        asked.push(model_hash((top, mid, low)));
                    }
                    // Middle bits no id has: still the candidates of its bucket and low bits.
                    asked.push(model_hash((top, 0, low)) | 0x1234 << 32);
                }
            }
            for hash in asked {
                let mut found = Vec::new();
                merged.find(hash, &mut found);
                let mut exact: Vec<LogPosition> =
                    plain.iter().filter(|(h, _)| *h == hash).map(|(_, at)| *at).collect();
                exact.sort();
                let mut want: Vec<LogPosition> = plain
                    .iter()
                    .filter(|(h, _)| kept_bits(*h) == kept_bits(hash))
                    .map(|(_, at)| *at)
                    .collect();
                want.sort();
                proptest::prop_assert!(
                    exact.iter().all(|at| found.contains(at)),
                    "a candidate missed: {:?} not all in {:?}", exact, found
                );
                proptest::prop_assert_eq!(found, want, "hash {:#x}", hash);
            }
        }
    }

    /// Pseudo-random, well-spread hashes (splitmix64).
    fn hashes(seed: u64) -> impl Iterator<Item = u64> {
        let mut state = seed;
        std::iter::repeat_with(move || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        })
    }

    #[test]
    fn the_sealed_index_holds_10_bytes_per_id() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut index = DedupeIndex::load(dir.path(), 0).expect("load");
        assert_eq!(
            index.sealed_heap_bytes(),
            0,
            "nothing before the first seal"
        );
        let fences = (BUCKETS + 1) * std::mem::size_of::<u32>();
        let per_id = |index: &DedupeIndex| {
            (index.sealed_heap_bytes() - fences) as f64 / index.sealed.len() as f64
        };
        // Four sealed segments of 262,144 ids: 1,048,576 in all.
        let per_segment = 1 << 18;
        let numbers = [3u64, 4, 9, 70_000];
        let runs = |seed: u64| {
            let offsets = (0u32..).map(|i| i * 61);
            Sealed::from_pairs(hashes(seed).zip(offsets).take(per_segment).collect())
        };
        for segment in numbers {
            // As while running: one segment at a time, merged in.
            index
                .sealed
                .add(vec![(segment, runs(segment))])
                .expect("add");
            let bytes = per_id(&index);
            assert!(
                bytes <= 10.5,
                "{bytes} bytes per id after sealing {segment}"
            );
        }
        assert_eq!(index.ids(), 1 << 20);
        println!(
            "sealed index: {} ids, {} heap bytes, {:.3} bytes per id beside the fences ({fences} \
             bytes), {:.1} ids per bucket",
            index.ids(),
            index.sealed_heap_bytes(),
            per_id(&index),
            index.ids() as f64 / BUCKETS as f64,
        );
        let widest = (0..BUCKETS).map(|b| index.sealed.ids.range(b).len()).max();
        println!("widest bucket: {widest:?} ids");
        // Every id is found at its own frame.
        for segment in numbers {
            let first = hashes(segment).next().expect("a hash");
            assert!(index
                .candidates(first)
                .contains(&LogPosition { segment, offset: 0 }));
        }
        // Forgetting one shrinks the columns to fit.
        assert_eq!(index.forget(4), per_segment);
        let bytes = per_id(&index);
        assert!(
            bytes <= 10.5,
            "{bytes} bytes per id after forgetting a segment"
        );
        // As an open loads them: all at once.
        let mut loaded = DedupeIndex::load(dir.path(), 0).expect("load");
        loaded
            .sealed
            .add(numbers.iter().map(|s| (*s, runs(*s))).collect())
            .expect("add");
        let bytes = per_id(&loaded);
        assert!(bytes <= 10.5, "{bytes} bytes per id loaded at once");
    }

    #[test]
    fn sealing_past_the_ordinal_range_is_refused_and_ordinals_are_reused() {
        // One id per segment, at an offset and a hash of its own.
        let hash_of = spread;
        let run = |segment: u64| {
            let offset = u32::try_from(segment % 1000).expect("small");
            (
                segment,
                Sealed::from_pairs(vec![(hash_of(segment), offset)]),
            )
        };
        let frame_of = |segment: u64| LogPosition {
            segment,
            offset: segment % 1000,
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let mut index = DedupeIndex::load(dir.path(), 100_000).expect("load");
        let full = MAX_SEALED_SEGMENTS as u64;
        index
            .sealed
            .add((0..full).map(run).collect())
            .expect("65,536 sealed segments fit");
        assert_eq!(index.sealed_segments().len(), MAX_SEALED_SEGMENTS);
        assert_eq!(
            index.candidates(hash_of(full - 1)),
            vec![frame_of(full - 1)]
        );

        // One more is refused, and nothing changes.
        let refused = index.sealed.add(vec![run(99_999)]);
        let too_many = IndexFull {
            segments: MAX_SEALED_SEGMENTS + 1,
            ids: MAX_SEALED_SEGMENTS + 1,
        };
        assert_eq!(refused, Err(too_many));
        assert_eq!(index.sealed_segments().len(), MAX_SEALED_SEGMENTS);
        assert!(index.candidates(hash_of(99_999)).is_empty());
        assert_consistent(&index.sealed);

        // Nor can the open segment be sealed: the frame that would seal it is refused and the
        // open segment keeps its ids (the indexer tries that frame again).
        let open = LogPosition {
            segment: 100_000,
            offset: 0,
        };
        let next = LogPosition {
            segment: 100_001,
            offset: 0,
        };
        index.insert(open, "d1", &["e1"]).expect("open segment");
        let no_room = IndexFull {
            segments: MAX_SEALED_SEGMENTS + 1,
            ids: MAX_SEALED_SEGMENTS + 2,
        };
        assert_eq!(index.insert(next, "d2", &["e2"]), Err(no_room));
        assert_eq!(index.candidates(event_hash("e1")), vec![open]);
        assert!(index.candidates(event_hash("e2")).is_empty());
        assert_eq!(index.ids(), MAX_SEALED_SEGMENTS + 2);

        // Pruning makes room; ordinals are renumbered, so any number of segments can pass
        // through over the daemon's life.
        for segment in 0..10 {
            assert_eq!(index.forget(segment), 1);
        }
        index.insert(next, "d2", &["e2"]).expect("room now");
        assert_eq!(index.candidates(event_hash("e1")), vec![open]);
        assert_eq!(index.candidates(event_hash("e2")), vec![next]);
        for segment in 200_000..200_009 {
            index.sealed.add(vec![run(segment)]).expect("room");
        }
        assert_eq!(index.sealed_segments().len(), MAX_SEALED_SEGMENTS);
        assert_consistent(&index.sealed);
        // Each id still names its own segment: no ordinal names another's.
        for (segment, count) in index.sealed_segments() {
            let want = if segment == open.segment {
                open
            } else {
                frame_of(segment)
            };
            let hash = if segment == open.segment {
                event_hash("e1")
            } else {
                hash_of(segment)
            };
            assert!(index.candidates(hash).contains(&want), "segment {segment}");
            assert_eq!(count, if segment == open.segment { 2 } else { 1 });
        }
        assert_eq!(
            index.sealed.add(vec![run(300_000)]).map_err(|e| e.segments),
            Err(MAX_SEALED_SEGMENTS + 1)
        );
    }

    #[test]
    fn the_ids_file_format_is_unchanged() {
        let sealed = Sealed::from_pairs(vec![(0x0102_0304_0506_0708, 9), (1, 2)]);
        let mut want = b"HBIDS\0\0\x01".to_vec();
        want.extend_from_slice(&2u64.to_le_bytes());
        let body: Vec<u8> = [
            &1u64.to_le_bytes()[..],
            &0x0102_0304_0506_0708u64.to_le_bytes(),
            &2u32.to_le_bytes(),
            &9u32.to_le_bytes(),
        ]
        .concat();
        want.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        want.extend_from_slice(&body);
        assert_eq!(sealed.encode(), want);
    }

    #[test]
    fn the_same_hash_at_two_frames_keeps_both_candidates() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut index = DedupeIndex::load(dir.path(), 1).expect("load");
        let at = |offset| LogPosition { segment: 1, offset };
        index.insert(at(0), "d1", &["e1"]).expect("insert");
        index.insert(at(50), "d2", &["e1"]).expect("insert");
        index.insert(at(50), "d2", &["e1"]).expect("insert");
        assert_eq!(index.candidates(event_hash("e1")), vec![at(0), at(50)]);
        index
            .insert(
                LogPosition {
                    segment: 2,
                    offset: 0,
                },
                "d3",
                &[],
            )
            .expect("insert");
        assert_eq!(index.candidates(event_hash("e1")), vec![at(0), at(50)]);
        assert_eq!(index.forget(1), 4, "d1, d2 and e1 twice");
        assert!(index.candidates(event_hash("e1")).is_empty());
    }
}
