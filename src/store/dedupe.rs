//! The dedupe index: which event and delivery ids are in the event log, kept in memory.
//!
//! Why not in sled: a dedupe record per event was the largest thing sled held (about 130 MiB of
//! its memory while a million were written) and half of every intake transaction. The event log
//! already holds every id; this index only says where to look. Per id it keeps a 64-bit hash
//! (xxh3, a fixed algorithm: hashes are written to disk) and where its frame is: 16 bytes per id
//! once its segment is sealed.
//!
//! A hash match is a candidate, not a verdict: the caller reads the frame and compares the id
//! ([`Store::seen_event`](super::Store)), so a collision can never drop an event.
//!
//! The newest segment's ids are in a hash map; when the log moves to a new segment the old one is
//! sealed: merged into one sorted array of every sealed id (so a lookup costs the same however
//! many segments the dedupe window spans: a fence per 16 ids narrows it to a cache line or two),
//! and written to `<segment>.ids` beside it so an open need not read the whole log. That file is only a cache of the log: it is written without a sync, checked by
//! length and CRC when read, and rebuilt from the segment when missing or bad.

use super::eventlog::{self, Location};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::ops::ControlFlow;
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

/// Ids per fence of [`Merged`], on average.
const IDS_PER_FENCE: usize = 16;

/// Every sealed segment's ids, sorted by hash, with where each frame is (`segment << 32 |
/// offset`).
#[derive(Debug, Default)]
struct Merged {
    hashes: Vec<u64>,
    at: Vec<u64>,
    /// `fences[b]..fences[b + 1]` holds the hashes of bucket `b` (the top bits, scaled).
    fences: Vec<u32>,
    /// Ids per sealed segment.
    segments: BTreeMap<u64, usize>,
}

fn pack(segment: u64, offset: u32) -> u64 {
    (segment << 32) | u64::from(offset)
}

fn unpack(at: u64) -> Location {
    Location {
        segment: at >> 32,
        offset: at & u64::from(u32::MAX),
    }
}

impl Merged {
    /// Add sealed segments (not already in).
    ///
    /// This rebuilds the arrays: O(ids held) once per sealed segment (a few milliseconds per
    /// million ids, under the index's lock, so intake waits that long once per 64 MiB of log).
    fn add(&mut self, new: Vec<(u64, Sealed)>) {
        let runs: Vec<(u64, Sealed)> = new.into_iter().filter(|(_, ids)| ids.len() > 0).collect();
        if let [(segment, ids)] = runs.as_slice() {
            self.merge_one(*segment, ids);
            return;
        }
        // A k-way merge of sorted runs (what is merged already, and each new segment) straight
        // into the new arrays: an open with many segments holds each id twice at most.
        let total = self.hashes.len() + runs.iter().map(|(_, ids)| ids.len()).sum::<usize>();
        let (mut hashes, mut at) = (Vec::with_capacity(total), Vec::with_capacity(total));
        // Run 0 is the current array; run k > 0 is `runs[k - 1]`.
        let item = |run: usize, i: usize| -> Option<(u64, u64)> {
            if run == 0 {
                Some((*self.hashes.get(i)?, self.at[i]))
            } else {
                let (segment, ids) = &runs[run - 1];
                Some((*ids.hashes.get(i)?, pack(*segment, ids.offsets[i])))
            }
        };
        let mut heap = std::collections::BinaryHeap::new();
        for run in 0..=runs.len() {
            if let Some((h, a)) = item(run, 0) {
                heap.push(std::cmp::Reverse((h, a, run, 0usize)));
            }
        }
        while let Some(std::cmp::Reverse((h, a, run, i))) = heap.pop() {
            hashes.push(h);
            at.push(a);
            if let Some((h, a)) = item(run, i + 1) {
                heap.push(std::cmp::Reverse((h, a, run, i + 1)));
            }
        }
        for (segment, ids) in &runs {
            *self.segments.entry(*segment).or_default() += ids.len();
        }
        self.hashes = hashes;
        self.at = at;
        self.fence();
    }

    /// The common case (a segment sealed while running): a plain two-way merge.
    fn merge_one(&mut self, segment: u64, ids: &Sealed) {
        let total = self.hashes.len() + ids.len();
        let (mut hashes, mut at) = (Vec::with_capacity(total), Vec::with_capacity(total));
        let (mut i, mut j) = (0, 0);
        while i < self.hashes.len() || j < ids.len() {
            let new = (j < ids.len()).then(|| (ids.hashes[j], pack(segment, ids.offsets[j])));
            let old = (i < self.hashes.len()).then(|| (self.hashes[i], self.at[i]));
            let take_old = match (old, new) {
                (Some(o), Some(n)) => o <= n,
                (Some(_), None) => true,
                _ => false,
            };
            let (h, a) = if take_old {
                i += 1;
                old
            } else {
                j += 1;
                new
            }
            .unwrap_or_default();
            hashes.push(h);
            at.push(a);
        }
        *self.segments.entry(segment).or_default() += ids.len();
        self.hashes = hashes;
        self.at = at;
        self.fence();
    }

    /// Forget a segment's ids; returns how many.
    fn remove(&mut self, segment: u64) -> usize {
        let Some(count) = self.segments.remove(&segment) else {
            return 0;
        };
        let mut keep = self.at.iter().map(|a| a >> 32 != segment);
        self.hashes.retain(|_| keep.next().unwrap_or(true));
        self.at.retain(|a| a >> 32 != segment);
        self.hashes.shrink_to_fit();
        self.at.shrink_to_fit();
        self.fence();
        count
    }

    fn bucket(hash: u64, buckets: usize) -> usize {
        ((u128::from(hash) * buckets as u128) >> 64) as usize
    }

    fn fence(&mut self) {
        let buckets = (self.hashes.len() / IDS_PER_FENCE).max(1);
        let mut fences = Vec::with_capacity(buckets + 1);
        let mut i = 0;
        for b in 0..buckets {
            while i < self.hashes.len() && Self::bucket(self.hashes[i], buckets) < b {
                i += 1;
            }
            fences.push(i as u32);
        }
        fences.push(self.hashes.len() as u32);
        self.fences = fences;
    }

    fn find(&self, hash: u64, out: &mut Vec<Location>) {
        let buckets = self.fences.len().saturating_sub(1);
        if buckets == 0 {
            return;
        }
        let b = Self::bucket(hash, buckets);
        let (start, end) = (self.fences[b] as usize, self.fences[b + 1] as usize);
        for i in start..end {
            if self.hashes[i] == hash {
                out.push(unpack(self.at[i]));
            }
        }
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
            let start = Location { segment, offset: 0 };
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
        index.sealed.add(sealed);
        Ok(index)
    }

    /// Record a frame's delivery and event ids at `at`.
    pub fn insert(&mut self, at: Location, delivery: &str, ids: &[&str]) {
        let Ok(offset) = u32::try_from(at.offset) else {
            // Segments are far smaller than 4 GiB (`Store::open_with` checks the size).
            tracing::error!(?at, "event log offset out of range for the dedupe index");
            return;
        };
        let hashes =
            std::iter::once(delivery_hash(delivery)).chain(ids.iter().map(|id| event_hash(id)));
        if at.segment > self.open.segment {
            // The log moved on: the open segment is complete.
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
                self.sealed.add(vec![(segment, ids)]);
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
                    .add(vec![(at.segment, Sealed::from_pairs(missing))]);
            }
        }
    }

    /// Frames that may hold an id of this hash.
    pub fn candidates(&self, hash: u64) -> Vec<Location> {
        let mut out = Vec::new();
        let segment = self.open.segment;
        if let Some(o) = self.open.first.get(&hash) {
            out.push(Location {
                segment,
                offset: u64::from(*o),
            });
            for (h, o) in &self.open.more {
                if *h == hash {
                    out.push(Location {
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
        self.sealed.segments.iter().map(|(s, n)| (*s, *n)).collect()
    }

    /// Forget a sealed segment's ids (pruning). Its `.ids` file goes with the segment.
    pub fn forget(&mut self, segment: u64) -> usize {
        self.sealed.remove(segment)
    }

    /// Ids held (events and deliveries).
    pub fn ids(&self) -> usize {
        self.open.first.len() + self.open.more.len() + self.sealed.hashes.len()
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
    let written = std::fs::File::create(&tmp)
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
    use crate::store::eventlog::{Appender, FrameEvent, Frames};

    fn append(log: &mut Appender, delivery: &str, ids: &[&str]) -> Location {
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
        index.insert(a, "d1", &["e1", "e2"]);
        let b = append(&mut log, "d2", &["e3"]);
        index.insert(b, "d2", &["e3"]);
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

    proptest::proptest! {
        /// The merged array finds exactly what a plain list of (hash, where) finds, through
        /// additions and removals of segments; hashes are drawn from a small range so that
        /// equal hashes and crowded fences happen.
        #[test]
        fn merged_finds_what_a_plain_list_finds(
            segments in proptest::collection::vec(
                proptest::collection::vec((0u64..64, 0u32..1000), 0..60), 1..8),
            gone in proptest::collection::vec(0usize..8, 0..4),
            spread in proptest::bool::ANY,
        ) {
            // Spread the small hashes over the whole range (fences cut by top bits) or not.
            let h = |x: u64| if spread { x.wrapping_mul(0x9E37_79B9_7F4A_7C15) } else { x };
            let mut merged = Merged::default();
            let mut all_at_once = Vec::new();
            let mut plain: Vec<(u64, Location)> = Vec::new();
            for (i, ids) in segments.iter().enumerate() {
                let segment = i as u64 + 1;
                let pairs: Vec<(u64, u32)> = ids.iter().map(|(x, o)| (h(*x), *o)).collect();
                let sealed = Sealed::from_pairs(pairs.clone());
                for (hash, o) in sealed.hashes.iter().zip(&sealed.offsets) {
                    plain.push((*hash, Location { segment, offset: u64::from(*o) }));
                }
                merged.add(vec![(segment, sealed)]);
                all_at_once.push((segment, Sealed::from_pairs(pairs)));
            }
            // One segment at a time (sealing while running) and all at once (an open) agree.
            let mut loaded = Merged::default();
            loaded.add(all_at_once);
            proptest::prop_assert_eq!(&loaded.hashes, &merged.hashes);
            proptest::prop_assert_eq!(&loaded.at, &merged.at);
            for g in gone {
                let segment = g as u64 + 1;
                let removed = merged.remove(segment);
                let before = plain.len();
                plain.retain(|(_, at)| at.segment != segment);
                proptest::prop_assert_eq!(removed, before - plain.len());
            }
            for x in 0..64 {
                let mut found = Vec::new();
                merged.find(h(x), &mut found);
                found.sort();
                let mut want: Vec<Location> =
                    plain.iter().filter(|(hash, _)| *hash == h(x)).map(|(_, at)| *at).collect();
                want.sort();
                proptest::prop_assert_eq!(found, want);
            }
        }
    }

    #[test]
    fn the_same_hash_at_two_frames_keeps_both_candidates() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut index = DedupeIndex::load(dir.path(), 1).expect("load");
        let at = |offset| Location { segment: 1, offset };
        index.insert(at(0), "d1", &["e1"]);
        index.insert(at(50), "d2", &["e1"]);
        index.insert(at(50), "d2", &["e1"]);
        assert_eq!(index.candidates(event_hash("e1")), vec![at(0), at(50)]);
        index.insert(
            Location {
                segment: 2,
                offset: 0,
            },
            "d3",
            &[],
        );
        assert_eq!(index.candidates(event_hash("e1")), vec![at(0), at(50)]);
        assert_eq!(index.forget(1), 4, "d1, d2 and e1 twice");
        assert!(index.candidates(event_hash("e1")).is_empty());
    }
}
