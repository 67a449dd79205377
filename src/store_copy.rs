//! `handoff-bridge store copy`: a stopped daemon's sled store moved into an empty PostgreSQL
//! database, then checked by counts.
//!
//! The sled side is read through its dump ([`storage::dump`]: one iterator per kind of record,
//! reading as it goes), the PostgreSQL side written by its loader ([`storage_pg::load`]) in
//! batches of at most [`BATCH_RECORDS`] records and about [`BATCH_BYTES`] bytes, each in one
//! transaction, so memory stays bounded whatever the store's size. Everything that could refuse
//! the copy is judged before anything is written to the target. A copy cut short leaves the
//! target marked incomplete (no daemon starts on it); run again with `discard_incomplete` to
//! empty it and copy afresh (it is not resumed).
//!
//! The check: per kind, the records read from sled against the rows in PostgreSQL; the events,
//! and the index the folds derive from the states; then through the port on both stores, the
//! events still to fold and the counts the folds keep (what `/metrics` and the admin API show).
//! An event or delivery id the sled log held twice (a re-send after its dedupe window) is one row
//! in PostgreSQL, the later copy; the report says how many.

use crate::datadir::DataDir;
use std::time::{Duration, Instant};
use storage::dump::{Dump, Kind, Record};
use storage::{SledStore, Storage, StoreError};
use storage_pg::load::{Loader, Rows, TargetError};
use storage_pg::{PgError, PgOptions, PgStore};

/// A batch holds at most this many records...
pub const BATCH_RECORDS: usize = 1_000;
/// ...and about this many bytes (event bodies, quarantined bodies).
pub const BATCH_BYTES: usize = 8 << 20;

/// Why a copy was refused (nothing written to the target) or failed.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("the target URL (--to): {0}")]
    Url(String),
    #[error("no sled store at {0}: nothing to copy")]
    NoStore(String),
    #[error("the daemon (pid {pid}) runs on {dir}: stop it first (a copy reads a stopped store)")]
    Running { pid: u32, dir: String },
    #[error(
        "the store at {0} is in use by another process (is the daemon running?): stop it first"
    )]
    InUse(String),
    #[error(
        "the store has layout {found}, older than this build's ({current}): start this build's \
         daemon on it once (it migrates the store), stop it, then copy"
    )]
    OlderLayout { found: u32, current: u32 },
    #[error(
        "an earlier copy into the target did not finish: run again with --discard-incomplete to \
         empty it and copy afresh"
    )]
    Incomplete,
    #[error(transparent)]
    Target(TargetError),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A failure once the target was written to: it is left marked incomplete.
    #[error(
        "{0}; the target is left incomplete (no daemon starts on it): run the copy again with \
         --discard-incomplete"
    )]
    CutShort(Box<CopyError>),
    #[error("the counts differ after the copy: {0}")]
    Differ(String),
}

/// What to copy where.
pub struct Request<'a> {
    /// The stopped daemon's data directory (its store is `store/` in it).
    pub from: &'a DataDir,
    pub to: &'a PgOptions,
    /// Empty a target an interrupted copy left incomplete, then copy afresh.
    pub discard_incomplete: bool,
    /// sled's cache while reading.
    pub cache_capacity: u64,
}

/// How far a copy got: `kind`'s records copied so far, and whether that is all of them.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    pub kind: Kind,
    pub records: u64,
    pub done: bool,
}

/// One line of the check: what, counted on sled and in PostgreSQL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Line {
    pub what: &'static str,
    pub sled: u64,
    pub postgres: u64,
    /// Of `sled`, those held twice there that are one row in PostgreSQL.
    pub merged: u64,
}

impl Line {
    fn new(what: &'static str, sled: u64, postgres: u64) -> Line {
        Line {
            what,
            sled,
            postgres,
            merged: 0,
        }
    }

    /// PostgreSQL holds what sled held.
    pub fn agrees(&self) -> bool {
        self.sled.checked_sub(self.merged) == Some(self.postgres)
    }
}

/// What a copy did.
#[derive(Debug)]
pub struct Report {
    pub lines: Vec<Line>,
    pub records: u64,
    pub took: Duration,
}

impl Report {
    /// Every line agrees.
    pub fn agrees(&self) -> bool {
        self.lines.iter().all(Line::agrees)
    }

    /// The lines that do not agree, named.
    pub fn differences(&self) -> Vec<&'static str> {
        self.lines
            .iter()
            .filter(|l| !l.agrees())
            .map(|l| l.what)
            .collect()
    }
}

/// Copy `request.from`'s store into `request.to`, telling `progress` as it goes, and check it.
pub fn copy(
    request: &Request<'_>,
    progress: &mut dyn FnMut(Progress),
) -> Result<Report, CopyError> {
    let started = Instant::now();
    request.to.check().map_err(|e| match e {
        PgError::Url(why) => CopyError::Url(why),
        e => CopyError::Url(e.to_string()),
    })?;
    let source = open_source(request.from, request.cache_capacity)?;
    let loader = Loader::start(request.to, request.discard_incomplete).map_err(|e| match e {
        TargetError::Incomplete => CopyError::Incomplete,
        e => CopyError::Target(e),
    })?;
    let (target, mut lines, records) =
        load_all(&source.dump(), loader, progress).map_err(|e| CopyError::CutShort(Box::new(e)))?;
    lines.extend(kept_counts(&source, &target)?);
    Ok(Report {
        lines,
        records,
        took: started.elapsed(),
    })
}

/// Every kind into the target, then its numbers set: the complete store, the lines of the
/// check so far, the records copied.
fn load_all(
    dump: &Dump<'_>,
    mut loader: Loader,
    progress: &mut dyn FnMut(Progress),
) -> Result<(PgStore, Vec<Line>, u64), CopyError> {
    let (mut lines, mut records) = (Vec::new(), 0);
    for &kind in Kind::ALL {
        let copied = copy_kind(dump, &mut loader, kind, progress)?;
        records += copied.records;
        lines.extend(copied.lines(&loader)?);
    }
    lines.push(Line::new(
        "derived_index",
        dump.derived_entries()?,
        loader.rows(Rows::Derived)?,
    ));
    let target = loader.finish(&dump.positions()?)?;
    Ok((target, lines, records))
}

/// The sled store, opened offline, after every reason to refuse it was looked for.
fn open_source(from: &DataDir, cache_capacity: u64) -> Result<SledStore, CopyError> {
    let path = from.store_path();
    if let Some(daemon) = from.running_daemon() {
        return Err(CopyError::Running {
            pid: daemon.pid,
            dir: from.root().display().to_string(),
        });
    }
    if !storage::sled_file(&path).exists() {
        return Err(CopyError::NoStore(path.display().to_string()));
    }
    // sled alone, not the store: opening the store would migrate an older layout in place.
    match storage::backup::stored_layout(&path) {
        Ok(Some(found)) if found < storage::LAYOUT_VERSION => {
            return Err(CopyError::OlderLayout {
                found,
                current: storage::LAYOUT_VERSION,
            })
        }
        Err(StoreError::Locked { path }) => return Err(CopyError::InUse(path)),
        Err(e) => return Err(e.into()),
        Ok(_) => {}
    }
    match SledStore::open(&path, cache_capacity) {
        Err(StoreError::Locked { path }) => Err(CopyError::InUse(path)),
        other => Ok(other?),
    }
}

/// What one kind's copy counted on the sled side.
struct Copied {
    kind: Kind,
    records: u64,
    events: u64,
}

impl Copied {
    /// Its lines of the check (a delivery's events have a line of their own).
    fn lines(&self, loader: &Loader) -> Result<Vec<Line>, StoreError> {
        let mut line = Line::new(
            self.kind.name(),
            self.records,
            loader.rows(Rows::Of(self.kind))?,
        );
        if self.kind != Kind::Delivery {
            return Ok(vec![line]);
        }
        line.merged = loader.merged().deliveries;
        let events = Line {
            merged: loader.merged().events,
            ..Line::new("events", self.events, loader.rows(Rows::Events)?)
        };
        Ok(vec![line, events])
    }
}

/// Every record of `kind`, in batches.
fn copy_kind(
    dump: &Dump<'_>,
    loader: &mut Loader,
    kind: Kind,
    progress: &mut dyn FnMut(Progress),
) -> Result<Copied, CopyError> {
    let mut copied = Copied {
        kind,
        records: 0,
        events: 0,
    };
    let (mut batch, mut bytes) = (Vec::new(), 0);
    let mut flush = |batch: &mut Vec<Record>, copied: &mut Copied, done: bool| {
        copied.records += batch.len() as u64;
        loader.load(kind, std::mem::take(batch))?;
        progress(Progress {
            kind,
            records: copied.records,
            done,
        });
        Ok::<(), StoreError>(())
    };
    for record in dump.records(kind)? {
        let record = record?;
        if let Record::Delivery { events, .. } = &record {
            copied.events += events.len() as u64;
        }
        bytes += record.weight();
        batch.push(record);
        if batch.len() >= BATCH_RECORDS || bytes >= BATCH_BYTES {
            flush(&mut batch, &mut copied, false)?;
            bytes = 0;
        }
    }
    flush(&mut batch, &mut copied, true)?;
    Ok(copied)
}

/// The lines read through the port on both stores: the events still to fold, and the counts the
/// folds keep.
fn kept_counts(sled: &SledStore, pg: &PgStore) -> Result<Vec<Line>, StoreError> {
    let counts = |s: &dyn Storage| -> Result<[u64; 8], StoreError> {
        let sizes = s.sizes()?;
        Ok([
            s.pending()?.len() as u64,
            sizes.conversations,
            sizes.end_users,
            sizes.bots,
            sizes.quarantine,
            s.outbox_len()? as u64,
            s.timers_pending()?,
            s.queue_summary()?.waiting,
        ])
    };
    let names = [
        "events_to_fold",
        "kept_count:conversations",
        "kept_count:end_users",
        "kept_count:bots",
        "kept_count:quarantine",
        "kept_count:outbox",
        "kept_count:timers",
        "kept_count:waiting",
    ];
    let (a, b) = (counts(sled)?, counts(pg)?);
    Ok(names
        .iter()
        .zip(a.iter().zip(b))
        .map(|(what, (s, p))| Line::new(what, *s, p))
        .collect())
}

#[cfg(test)]
mod tests;
