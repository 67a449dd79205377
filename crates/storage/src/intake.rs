//! Accepting events: dedupe and the event log.
//!
//! A group of deliveries goes through three steps, which the writer and syncer threads run in a
//! pipeline (`writer`), and [`SledStore::accept_many`] runs in a row:
//! 1. [`SledStore::check`]: drop duplicates (against the event log, through the dedupe index, and
//!    against events still on their way, the in-flight set), give each new event its sequence
//!    number, frame it for the log;
//! 2. [`SledStore::log_queue`] + [`SledStore::log_commit`]: append and `fdatasync` (the delivery is now
//!    durable and may be acknowledged);
//! 3. [`SledStore::index`]: the frames' ids go into the dedupe index, the checkpoint advances (one
//!    sled write per group, not per event: the log is the inbox), and the events are handed to
//!    the dispatcher; then the in-flight entries are released.
//!
//! A crash between 2 and 3 loses nothing: the dedupe index is rebuilt from the log on open, the
//! checkpoint is advanced over the tail ([`SledStore::recover_log`]), and a start's scan finds the
//! tail's events still to fold. A crash before 2 completes leaves at most a torn tail, which
//! nobody was told about.

use super::eventlog::{self, FrameEvent, Frames, LogPosition};
use super::{
    corrupt, decode, dedupe, encode, keys, AcceptRequest, Accepted, IntakeLog, QuarantineRecord,
    SledStore, StoreError,
};
use crate::idempotency::{key, IdempotencyRecord};
use crate::port::{Ingest, Lifecycle, Quarantine};
use model::ids::{DeliveryId, EventId};
use model::webhook::model::Millis;
use model::webhook::IncomingEvent;
use sled::transaction::Transactional;
use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;

/// Ids checked as new but not yet indexed: a re-send arriving meanwhile is a duplicate.
#[derive(Default)]
pub(super) struct InFlight {
    events: HashSet<String>,
    deliveries: HashSet<String>,
    /// Counts failed log writes. A group judged a duplicate of an in-flight id may be answered
    /// only if no log write failed since: the original may have been the one that failed.
    failures: u64,
}

/// A checked group: its answers, and its new events framed for the log and listed for the index.
#[derive(Default)]
pub struct Checked {
    pub accepted: Vec<Accepted>,
    pub frames: Frames,
    pub unindexed: Unindexed,
    /// Quarantine records were written (to sled directly): answers need a sled flush.
    pub quarantined: bool,
    /// Some id was a duplicate only of an in-flight one: the failure count seen then.
    relies_on_in_flight: Option<u64>,
}

impl Checked {
    /// Whether this group's duplicates of in-flight ids still hold: no log write failed since it
    /// was checked. Otherwise it must not be answered 200 (a re-send will be judged again).
    pub fn duplicates_hold(&self, log: &IntakeLog) -> bool {
        match self.relies_on_in_flight {
            None => true,
            Some(seen) => log
                .in_flight
                .lock()
                .is_ok_and(|in_flight| in_flight.failures == seen),
        }
    }
}

/// A frame's events: (sequence number, id, partition).
type Rows = Vec<(u64, EventId, String)>;

/// What [`SledStore::index`] writes for a group, once its frames have locations.
#[derive(Default)]
pub struct Unindexed {
    /// Per frame, in frame order: its delivery and events (sequence number, id, partition).
    frames: Vec<(DeliveryId, Rows)>,
    /// Where each frame went (filled by [`Unindexed::located`]).
    at: Vec<LogPosition>,
}

impl Unindexed {
    pub fn located(&mut self, at: Vec<LogPosition>) {
        self.at = at;
    }

    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Each event's sequence number and frame location, in log order (once located).
    pub fn locations(&self) -> impl Iterator<Item = (u64, LogPosition)> + '_ {
        self.frames
            .iter()
            .zip(&self.at)
            .flat_map(|((_, rows), at)| rows.iter().map(move |(seq, _, _)| (*seq, *at)))
    }
}

impl SledStore {
    /// [`IntakeLog::check`] with this store.
    pub fn check(&self, requests: &[AcceptRequest<'_>]) -> Result<Checked, StoreError> {
        self.log.check(requests, Some(self))
    }

    /// Whether event `id` is in the event log (or in a legacy dedupe record).
    pub(crate) fn seen_event(&self, id: &str) -> Result<bool, StoreError> {
        Ok(self.log.seen_event(id)? || self.legacy_seen(id, false)?)
    }

    /// Whether delivery `id` is in the event log (or in a legacy dedupe record).
    pub(crate) fn seen_delivery(&self, id: &str) -> Result<bool, StoreError> {
        Ok(self.log.seen_delivery(id)? || self.legacy_seen(id, true)?)
    }

    /// Step 3: put committed groups' ids into the dedupe index and advance the checkpoint to `to`
    /// (every frame before it is in these groups or indexed earlier). The caller then releases
    /// their ids ([`IntakeLog::release`]) and hands the events on.
    pub fn index(&self, groups: &[Unindexed], to: LogPosition) -> Result<(), StoreError> {
        if groups.iter().any(|g| g.at.len() != g.frames.len()) {
            return Err(StoreError::Internal(
                "index: frames without locations".into(),
            ));
        }
        // The highest number in these groups (which come in log order): the floor a start numbers
        // new events above.
        let last_seq = groups
            .iter()
            .flat_map(|g| g.frames.iter())
            .flat_map(|(_, rows)| rows.iter().map(|(seq, _, _)| *seq))
            .max();
        // Two inserts, not a batch: a batch takes sled's global lock exclusively, and would wait
        // for any fold (an idle-priority thread, see `background`) reading the store. The floor
        // goes first: sled recovers a prefix of its writes, so a checkpoint that survives a crash
        // has its floor too (a floor without its checkpoint only numbers events higher).
        if let Some(last) = last_seq {
            self.meta.insert(keys::meta::SEQ_FLOOR, &keys::seq(last))?;
        }
        self.meta.insert(keys::meta::INDEXED_TO, &to.encode())?;
        // Into the dedupe index before the in-flight set lets go of them.
        self.remember(groups.iter().flat_map(|g| {
            g.frames.iter().zip(&g.at).map(|((delivery, rows), at)| {
                let ids = rows.iter().map(|(_, id, _)| id.as_str()).collect();
                (*at, delivery.as_str(), ids)
            })
        }))?;
        Ok(())
    }
}

impl IntakeLog {
    /// Step 1: dedupe a group of deliveries (in order; a delivery or event repeated within the
    /// group is a duplicate too) and frame its new events. Invalid events of a delivery seen first
    /// are quarantined here, in sled, directly: without the `store` (still opening) such a
    /// group is refused ([`StoreError::Opening`]). The `store` also holds an older layout's
    /// dedupe records, which an early open ruled out.
    pub fn check(
        &self,
        requests: &[AcceptRequest<'_>],
        store: Option<&SledStore>,
    ) -> Result<Checked, StoreError> {
        self.check_group(requests, true, store)
    }

    /// `delivery_dedupe = false` looks at every event even of a known delivery (log recovery of
    /// layout 1, where a delivery may be recorded and only some of its events stored).
    pub(super) fn check_group(
        &self,
        requests: &[AcceptRequest<'_>],
        delivery_dedupe: bool,
        store: Option<&SledStore>,
    ) -> Result<Checked, StoreError> {
        if store.is_none() && requests.iter().any(|r| !r.invalid.is_empty()) {
            return Err(StoreError::Opening);
        }
        let seen_delivery = |id: &str| match store {
            Some(store) => store.seen_delivery(id),
            None => self.seen_delivery(id),
        };
        let seen_event = |id: &str| match store {
            Some(store) => store.seen_event(id),
            None => self.seen_event(id),
        };
        let mut in_flight = self.in_flight.lock().map_err(|_| poisoned())?;
        let mut out = Checked::default();
        for request in requests {
            let delivery = request.delivery;
            let known_in_flight = in_flight.deliveries.contains(delivery.as_str());
            let known = known_in_flight || seen_delivery(delivery.as_str())?;
            if known_in_flight {
                out.relies_on_in_flight = Some(in_flight.failures);
            }
            if known && delivery_dedupe {
                out.accepted.push(Accepted {
                    duplicate_delivery: true,
                    duplicate_events: request.events.len(),
                    ..Accepted::default()
                });
                continue;
            }
            let mut accepted = Accepted::default();
            let mut rows = Vec::new();
            for (index, ev) in request.events.iter().enumerate() {
                let id = &ev.event.id;
                if in_flight.events.contains(id.as_str()) {
                    out.relies_on_in_flight = Some(in_flight.failures);
                    accepted.duplicate_events += 1;
                    continue;
                }
                if seen_event(id.as_str())? {
                    accepted.duplicate_events += 1;
                    continue;
                }
                let seq = self.next_seq();
                in_flight.events.insert(id.as_str().to_owned());
                rows.push((seq, id.clone(), ev.partition.encode()));
                accepted.new.push((seq, ev.partition.clone()));
                accepted.new_index.push(index);
            }
            // Invalid events of a delivery seen before were quarantined the first time.
            if !known {
                for bad in request.invalid {
                    let store = store.ok_or(StoreError::Opening)?;
                    accepted.quarantined.push(store.quarantine(bad.clone())?);
                    out.quarantined = true;
                }
            }
            // A delivery is recorded by its frame: one with only quarantined events gets an
            // empty frame, so a re-send is known.
            let first_seen =
                !known && (!accepted.new.is_empty() || !accepted.quarantined.is_empty());
            if first_seen {
                in_flight.deliveries.insert(delivery.as_str().to_owned());
            }
            if !rows.is_empty() || first_seen {
                let picked = accepted.new_index.iter().map(|i| &request.events[*i]);
                let events: Vec<FrameEvent<'_>> = rows
                    .iter()
                    .zip(picked)
                    .map(|((seq, id, partition), ev)| FrameEvent {
                        seq: *seq,
                        id: id.as_str(),
                        partition,
                        raw: &ev.raw,
                    })
                    .collect();
                out.frames
                    .push(delivery.as_str(), request.received_at, &events);
                out.unindexed.frames.push((delivery.clone(), rows));
            }
            out.accepted.push(accepted);
        }
        Ok(out)
    }

    /// Step 2a: queue frames for the next commit; returns where each will be.
    pub fn log_queue(&self, frames: Frames) -> Result<Vec<LogPosition>, StoreError> {
        Ok(self.appender.lock().map_err(|_| poisoned())?.queue(frames))
    }

    /// Step 2b: write and sync what is queued. Returns where the log ends: every frame before it
    /// is durable. On error nothing queued is in the log.
    pub fn log_commit(&self) -> Result<LogPosition, StoreError> {
        let mut log = self.appender.lock().map_err(|_| poisoned())?;
        log.commit().map_err(io)?;
        Ok(log.end())
    }

    /// Drop queued frames whose commit will not happen.
    pub fn log_discard(&self) {
        if let Ok(mut log) = self.appender.lock() {
            log.discard_pending();
        }
    }

    /// True when no accepted event is between its check and its hand-over to the dispatcher
    /// (counted by [`count_hand_over`](SledStore::count_hand_over) before its id is released).
    pub fn all_indexed(&self) -> bool {
        self.in_flight
            .lock()
            .is_ok_and(|in_flight| in_flight.events.is_empty())
    }

    /// Count a hand-over of events to the dispatcher (one message), before their ids are
    /// released: a drain waiter that sees no id in flight then sees the message counted.
    pub fn count_hand_over(&self) {
        self.handed_over
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// Hand-overs counted so far.
    pub fn handed_over(&self) -> u64 {
        self.handed_over.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Forget groups' in-flight ids once indexed.
    pub fn release(&self, groups: &[Unindexed]) {
        self.forget(groups, false);
    }

    /// Forget groups' in-flight ids after their log write failed, so a re-send is accepted; and
    /// void the duplicate verdicts that relied on them (see [`Checked::duplicates_hold`]).
    pub fn release_failed(&self, groups: &[Unindexed]) {
        self.forget(groups, true);
    }

    fn forget(&self, groups: &[Unindexed], failed: bool) {
        let Ok(mut in_flight) = self.in_flight.lock() else {
            return;
        };
        if failed {
            in_flight.failures += 1;
        }
        for (delivery, rows) in groups.iter().flat_map(|g| &g.frames) {
            for (_, id, _) in rows {
                in_flight.events.remove(id.as_str());
            }
            in_flight.deliveries.remove(delivery.as_str());
        }
    }

    /// Whether event `id` is in the log. Reads the frames the dedupe index names, to compare
    /// the id itself.
    pub(crate) fn seen_event(&self, id: &str) -> Result<bool, StoreError> {
        Ok(self.locate_event(id)?.is_some())
    }

    /// Whether delivery `id` is in the log.
    pub(crate) fn seen_delivery(&self, id: &str) -> Result<bool, StoreError> {
        for at in self.candidates(dedupe::delivery_hash(id))? {
            if let Some(record) = eventlog::read_indexed(&self.dir, at).map_err(io)? {
                if record.delivery == id {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// The frame holding event `id`, its position there, and where the frame is.
    pub(super) fn locate_event(
        &self,
        id: &str,
    ) -> Result<Option<(eventlog::LogRecord, usize, LogPosition)>, StoreError> {
        for at in self.candidates(dedupe::event_hash(id))? {
            if let Some(record) = eventlog::read_indexed(&self.dir, at).map_err(io)? {
                if let Some(i) = record.ids.iter().position(|x| x == id) {
                    return Ok(Some((record, i, at)));
                }
            }
        }
        Ok(None)
    }

    pub(super) fn candidates(&self, hash: u64) -> Result<Vec<LogPosition>, StoreError> {
        Ok(self.dedupe.lock().map_err(|_| poisoned())?.candidates(hash))
    }
}

impl SledStore {
    fn accept_in_a_row(
        &self,
        requests: &[AcceptRequest<'_>],
        delivery_dedupe: bool,
    ) -> Result<Vec<Accepted>, StoreError> {
        let mut checked = self
            .log
            .check_group(requests, delivery_dedupe, Some(self))?;
        let logged = self
            .log
            .log_queue(std::mem::take(&mut checked.frames))
            .and_then(|at| Ok((at, self.log.log_commit()?)));
        match logged {
            Ok((at, to)) => {
                checked.unindexed.located(at);
                let groups = std::slice::from_ref(&checked.unindexed);
                self.index(groups, to)?;
                // Offline: the next start's scan hands them to a dispatcher.
                self.log.release(groups);
            }
            Err(e) => {
                self.log.log_discard();
                self.log
                    .release_failed(std::slice::from_ref(&checked.unindexed));
                return Err(e);
            }
        }
        if checked.quarantined {
            self.flush()?;
        }
        Ok(checked.accepted)
    }

    /// Advance the checkpoint (and the sequence floor) over every frame past it: written and
    /// synced, maybe acknowledged, but the checkpoint write did not reach the disk before a
    /// crash. A start's scan ([`SledStore::pending`]) finds their events still to fold. Frames a
    /// writer appended since it started (an early start's, see `log`) are its indexer's.
    pub(super) fn recover_log(&self, torn_tail: bool) -> Result<(), StoreError> {
        let from = self.meta_location(keys::meta::INDEXED_TO)?;
        let until = self.log.writer_from();
        let mut group = Unindexed::default();
        let end = eventlog::scan_before(&self.log_dir, from, until, |at, record, _| {
            let rows = record
                .seqs
                .iter()
                .zip(record.ids)
                .zip(record.partitions)
                .map(|((seq, id), partition)| (*seq, EventId::new(id), partition))
                .collect();
            group.frames.push((DeliveryId::new(record.delivery), rows));
            group.at.push(at);
            ControlFlow::Continue(())
        })
        .map_err(io)?;
        let events: usize = group.frames.iter().map(|(_, rows)| rows.len()).sum();
        let frames = group.frames.len();
        if frames == 0 && !torn_tail {
            return Ok(());
        }
        self.index(std::slice::from_ref(&group), end.next)?;
        self.log.release(std::slice::from_ref(&group));
        self.flush()?;
        tracing::info!(
            frames,
            events,
            torn_tail,
            "indexed the event log's tail after an unclean stop"
        );
        Ok(())
    }

    /// Move a layout-1 store's event bodies (sled tree and intake log) into the event log.
    pub(super) fn migrate_layout_1(&self) -> Result<(), StoreError> {
        let legacy = self.db.open_tree(keys::tree::LEGACY_EVENTS)?;
        let mut moved = 0usize;
        let mut batch: Vec<super::EventRecord> = Vec::new();
        let mut iter = legacy.iter();
        loop {
            let next = iter.next().transpose()?;
            if let Some((_, value)) = &next {
                batch.push(super::decode(value, "event record")?);
            }
            if batch.len() >= 1_000 || (next.is_none() && !batch.is_empty()) {
                moved += batch.len();
                self.move_legacy(std::mem::take(&mut batch))?;
            }
            if next.is_none() {
                break;
            }
        }
        // Deliveries acknowledged through the old intake log, perhaps not yet in sled. They are
        // appended past the checkpoint, which stays before them: the move to layout 4 takes
        // frames past it, and not in the inbox, as still to fold.
        let wal_from = match self.meta.get(keys::meta::LEGACY_WAL_FROM)? {
            Some(b) => {
                LogPosition::decode(&b).ok_or_else(|| super::corrupt("legacy intake log start"))?
            }
            None => {
                let end = self.log.appender.lock().map_err(|_| poisoned())?.end();
                self.meta
                    .insert(keys::meta::LEGACY_WAL_FROM, &end.encode())?;
                self.flush()?;
                end
            }
        };
        let records = eventlog::read_legacy(&self.wal_path).map_err(io)?;
        for record in &records {
            let delivery = DeliveryId::new(record.delivery.clone());
            let mut events = Vec::with_capacity(record.events.len());
            let mut invalid = Vec::new();
            for raw in &record.events {
                match model::webhook::validate_event(raw) {
                    Ok(ev) => events.push(ev),
                    Err(e) => invalid.push(model::webhook::InvalidEvent {
                        raw: raw.get().to_owned(),
                        reason: e.to_string(),
                    }),
                }
            }
            // One record for the delivery's invalid events, as intake makes.
            let bad: Vec<QuarantineRecord> = QuarantineRecord::invalid_events(
                &invalid,
                &record.delivery,
                None,
                record.received_at,
            )
            .into_iter()
            .collect();
            let request = AcceptRequest {
                delivery: &delivery,
                events: &events,
                invalid: &bad,
                received_at: record.received_at,
            };
            self.accept_in_a_row(std::slice::from_ref(&request), false)?;
        }
        if !records.is_empty() {
            self.meta
                .insert(keys::meta::INDEXED_TO, &wal_from.encode())?;
        }
        self.meta.remove(keys::meta::LEGACY_WAL_FROM)?;
        self.db.drop_tree(keys::tree::LEGACY_EVENTS)?;
        self.meta.remove(keys::meta::LEGACY_DEDUPE_PRUNED_THROUGH)?;
        // Layout 3 (its inbox written): the move to layout 4 follows.
        self.meta
            .insert(keys::meta::LAYOUT_VERSION, &3u32.to_be_bytes())?;
        self.flush()?;
        match std::fs::remove_file(&self.wal_path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(e)),
            _ => {}
        }
        tracing::info!(
            events = moved,
            intake_log_records = records.len(),
            "moved event bodies out of sled (store layout 1 -> 2)"
        );
        Ok(())
    }

    fn move_legacy(&self, batch: Vec<super::EventRecord>) -> Result<(), StoreError> {
        let mut frames = Frames::default();
        for r in &batch {
            let event = FrameEvent {
                seq: r.seq,
                id: r.id.as_str(),
                partition: &r.partition,
                raw: r.event.get(),
            };
            frames.push(r.delivery.as_str(), r.received_at, &[event]);
        }
        let at = self.log.log_queue(frames)?;
        let to = self.log.log_commit()?;
        let legacy = self.legacy.read().map_err(|_| poisoned())?;
        let seen = legacy
            .as_ref()
            .map(|l| l.seen.clone())
            .ok_or_else(|| StoreError::Internal("layout 1 migration without its trees".into()))?;
        drop(legacy);
        let inbox = self.db.open_tree(keys::tree::INBOX)?;
        let trees = (&seen, &inbox, &self.meta);
        trees.transaction(|(seen, inbox, meta)| {
            for (r, at) in batch.iter().zip(&at) {
                let key = keys::seq(r.seq);
                let mine = seen
                    .get(r.id.as_str())?
                    .is_some_and(|v| keys::parse_seen(&v).map(|s| s.0) == Some(r.seq));
                if mine {
                    seen.insert(r.id.as_str(), &keys::seen_value(r.seq, *at))?;
                }
                if inbox.get(key)?.is_some() {
                    inbox.insert(&key, keys::inbox_value(*at, &r.partition))?;
                }
            }
            meta.insert(keys::meta::INDEXED_TO, &to.encode())?;
            Ok(())
        })?;
        self.remember(
            batch
                .iter()
                .zip(&at)
                .map(|(r, at)| (*at, r.delivery.as_str(), vec![r.id.as_str()])),
        )?;
        Ok(())
    }
}

impl SledStore {
    /// Layout 2 or 3 -> 4: the sled inbox becomes folded marks and a low watermark. The
    /// watermark is the inbox's oldest entry (or the checkpoint, if the inbox is empty); from
    /// there, an event of a frame before the checkpoint and not in the inbox was folded (its
    /// partition's mark is raised to it), and the others (in the inbox, or past the checkpoint:
    /// logged but not indexed before a crash) are still to fold. The marks are written first,
    /// then the watermark with the layout number, then the inbox is dropped: a crash before the
    /// layout number repeats the move from the untouched inbox.
    pub(super) fn migrate_to_layout_4(&self) -> Result<(), StoreError> {
        let has_inbox = self
            .db
            .tree_names()
            .iter()
            .any(|name| name.as_ref() == keys::tree::INBOX.as_bytes());
        let indexed_to = self.meta_location(keys::meta::INDEXED_TO)?;
        let mut waiting = HashSet::new();
        // Per partition, its lowest waiting event: a mark must stay below it.
        let mut first_waiting: HashMap<String, u64> = HashMap::new();
        let mut from = indexed_to;
        if has_inbox {
            for item in self.db.open_tree(keys::tree::INBOX)?.iter() {
                let (key, value) = item?;
                let seq = keys::parse_seq(&key).ok_or_else(|| super::corrupt("inbox key"))?;
                let (at, partition) =
                    keys::parse_inbox(&value).ok_or_else(|| super::corrupt("inbox entry"))?;
                waiting.insert(seq);
                let first = first_waiting.entry(partition.to_owned()).or_insert(seq);
                *first = (*first).min(seq);
                from = from.min(at);
            }
        }
        let mut marks: HashMap<String, u64> = HashMap::new();
        eventlog::scan(&self.log_dir, from, |at, record, _| {
            if at < indexed_to {
                for (seq, partition) in record.seqs.iter().zip(record.partitions) {
                    if !waiting.contains(seq) {
                        let mark = marks.entry(partition).or_insert(*seq);
                        *mark = (*mark).max(*seq);
                    }
                }
            }
            ControlFlow::Continue(())
        })
        .map_err(io)?;
        let mut folded = sled::Batch::default();
        let mut lowered = 0usize;
        for (partition, seq) in &marks {
            match first_waiting.get(partition) {
                // Layout 3 took an unreadable event out of the inbox when it quarantined it,
                // before the fold of its partition's earlier events committed: a crash between
                // left a later event out of the inbox and an earlier one in it. Keep the earlier
                // one to fold (the later one is read, and quarantined, again).
                Some(first) if *first <= *seq => {
                    lowered += 1;
                    match first.checked_sub(1) {
                        Some(below) => folded.insert(partition.as_bytes(), &keys::seq(below)),
                        None => folded.remove(partition.as_bytes()),
                    }
                }
                _ => folded.insert(partition.as_bytes(), &keys::seq(*seq)),
            }
        }
        if lowered > 0 {
            tracing::warn!(
                partitions = lowered,
                "events out of the old inbox ahead of waiting ones: kept from the first waiting one"
            );
        }
        self.folded.apply_batch(folded)?;
        let mut meta = sled::Batch::default();
        meta.insert(keys::meta::FOLD_FROM, &from.encode());
        meta.insert(
            keys::meta::LAYOUT_VERSION,
            &super::LAYOUT_VERSION.to_be_bytes(),
        );
        self.meta.apply_batch(meta)?;
        self.flush()?;
        if has_inbox {
            self.db.drop_tree(keys::tree::INBOX)?;
            self.flush()?;
        }
        tracing::info!(
            still_to_fold_in_inbox = waiting.len(),
            partitions_marked = marks.len(),
            "moved the inbox into the event log's folded marks (store layout 4)"
        );
        Ok(())
    }
}

fn io(e: std::io::Error) -> StoreError {
    StoreError::Log(e.to_string())
}

fn poisoned() -> StoreError {
    StoreError::Corrupt("intake lock poisoned (a writer panicked)".into())
}

impl Ingest for SledStore {
    /// Store the new events of a delivery, dedupe the rest; durable when it returns. Offline
    /// tools and tests; the daemon goes through the [`Writer`].
    fn accept(
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

    /// All three steps for one group, in a row: for offline tools, tests and recovery. Durable
    /// when it returns. Not to be run while a writer runs on the same store.
    fn accept_many(&self, requests: &[AcceptRequest<'_>]) -> Result<Vec<Accepted>, StoreError> {
        if self
            .log
            .writer_started
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return Err(StoreError::Internal(
                "accept_many called while a writer owns intake".into(),
            ));
        }
        self.accept_in_a_row(requests, true)
    }

    /// Backfill's cursor (see [`keys::meta::BACKFILL_CURSOR`]); `None` before its first pass.
    fn backfill_cursor(&self) -> Result<Option<Millis>, StoreError> {
        Ok(self
            .meta
            .get(keys::meta::BACKFILL_CURSOR)?
            .and_then(|v| keys::parse_seq(&v))
            .map(|ms| Millis::try_from(ms).unwrap_or(Millis::MAX)))
    }

    /// Moves backfill's cursor: a plain insert, made durable by the writer's next flush (which
    /// backfill asks for). An older cursor only makes a pass read more, which dedupe absorbs.
    fn set_backfill_cursor(&self, at: Millis) -> Result<(), StoreError> {
        self.meta
            .insert(keys::meta::BACKFILL_CURSOR, &keys::seq(at.max(0) as u64))?;
        Ok(())
    }

    /// The answer recorded under a route's key, if any.
    fn idempotent_answer(
        &self,
        route: &str,
        idempotency_key: &str,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        let tree = self.idempotency_tree()?;
        tree.get(key(route, idempotency_key))?
            .map(|b| decode(&b, "idempotency record"))
            .transpose()
    }

    /// Record the first answer under a route's key. Written without a flush of its own: the
    /// command it answers is durable in the event log under an id made from the same key, so
    /// after a crash that lost this record a retry is a duplicate event and gets the verdict
    /// the fold recorded.
    fn record_idempotent_answer(
        &self,
        route: &str,
        idempotency_key: &str,
        record: &IdempotencyRecord,
    ) -> Result<(), StoreError> {
        self.idempotency_tree()?
            .insert(key(route, idempotency_key), encode(record)?)?;
        Ok(())
    }
}
