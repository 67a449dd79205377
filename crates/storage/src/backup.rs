//! The store's half of `handoff-bridge backup` / `restore`: sled's trees as a dump made with
//! [`sled::Db::export`] and loaded with [`sled::Db::import`], and the event log's segments.
//!
//! Why export/import rather than copying sled's files: the dump is sled's own migration format,
//! independent of its on-disk layout, so a backup can be loaded by a build with a newer sled
//! (which reads the same (type, name, [key, value]) collections). The event log is plain files
//! and is copied as is; the `.ids` beside each segment are a cache, rebuilt on open, and left out.
//!
//! Dump file: `MAGIC`, then per collection `1u8`, type, name, per record `2u8`, key, value, and
//! `0u8`; then a final `0u8`. Each byte string is a `u64` little-endian length and the bytes.

use super::{eventlog, SledStore, StoreError, EVENT_LOG_DIR};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"HBSLED01";
const COLLECTION: u8 = 1;
const RECORD: u8 = 2;
const END: u8 = 0;
/// Larger keys or values are taken as a damaged dump (sled values are far smaller).
const MAX_ITEM: u64 = 1 << 30;

/// What a dump holds.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DumpStats {
    pub trees: u64,
    pub records: u64,
}

impl SledStore {
    /// Write every sled tree to `out` (see the module doc). The store must not change meanwhile:
    /// backups open it offline.
    pub fn export_sled(&self, out: &mut impl Write) -> Result<DumpStats, StoreError> {
        let io = |e: std::io::Error| StoreError::Log(format!("writing the dump: {e}"));
        let mut stats = DumpStats::default();
        out.write_all(MAGIC).map_err(io)?;
        for (kind, name, records) in self.db.export() {
            out.write_all(&[COLLECTION]).map_err(io)?;
            write_bytes(out, &kind).map_err(io)?;
            write_bytes(out, &name).map_err(io)?;
            stats.trees += 1;
            for mut pair in records {
                let (Some(value), Some(key)) = (pair.pop(), pair.pop()) else {
                    return Err(StoreError::Internal("sled export without key/value".into()));
                };
                out.write_all(&[RECORD]).map_err(io)?;
                write_bytes(out, &key).map_err(io)?;
                write_bytes(out, &value).map_err(io)?;
                stats.records += 1;
            }
            out.write_all(&[END]).map_err(io)?;
        }
        out.write_all(&[END]).map_err(io)?;
        Ok(stats)
    }

    /// The event log's segment files, oldest first.
    pub fn log_segments(&self) -> Result<Vec<PathBuf>, StoreError> {
        let segments = eventlog::segments(&self.log_dir).map_err(super::log_error)?;
        Ok(segments
            .into_iter()
            .map(|s| eventlog::segment_path(&self.log_dir, s))
            .collect())
    }
}

/// The layout version of the store at `store_dir` without opening it as a [`SledStore`] (which would
/// migrate an older one); `None` for a store that never recorded one (a new, empty store).
pub fn stored_layout(store_dir: &Path) -> Result<Option<u32>, StoreError> {
    // The event log's lock first: a daemon taking deliveries before its sled opens holds only
    // that one. (A store without an event log, of an older layout, is left untouched.)
    let log_dir = store_dir.join(super::EVENT_LOG_DIR);
    let _log = match log_dir.is_dir() {
        true => Some(super::log::lock(store_dir, &log_dir)?),
        false => None,
    };
    // As the store opens it: a lock this process just let go of is waited for a moment.
    let db = super::open_sled(store_dir, 1 << 20)?;
    let meta = db.open_tree(super::keys::tree::META)?;
    let found = meta.get(super::keys::meta::LAYOUT_VERSION)?;
    found
        .map(|v| {
            v.as_ref()
                .try_into()
                .map(u32::from_be_bytes)
                .map_err(|_| StoreError::Corrupt("layout version unreadable".into()))
        })
        .transpose()
}

/// The event log's directory inside a store directory (where restored segments go).
pub fn log_dir(store_dir: &Path) -> PathBuf {
    store_dir.join(EVENT_LOG_DIR)
}

/// Create a new sled database at `store_dir` (which must not exist) and load a dump into it.
pub fn import_sled(store_dir: &Path, input: &mut impl Read) -> Result<DumpStats, StoreError> {
    if store_dir.exists() {
        return Err(StoreError::Internal(format!(
            "{} exists; a dump is loaded only into a new store",
            store_dir.display()
        )));
    }
    let mut magic = [0u8; 8];
    input
        .read_exact(&mut magic)
        .map_err(|_| damaged("no header"))?;
    if &magic != MAGIC {
        return Err(damaged("not a handoff-bridge sled dump"));
    }
    let db = sled::Config::new().path(store_dir).open()?;
    let mut stats = DumpStats::default();
    loop {
        match read_tag(input)? {
            END => break,
            COLLECTION => {}
            _ => return Err(damaged("unexpected record")),
        }
        let kind = read_bytes(input)?;
        let name = read_bytes(input)?;
        if kind != b"tree" {
            return Err(damaged("unknown collection type"));
        }
        // The records are read lazily as sled imports them; a read error ends the collection
        // early and is reported once import returns.
        let mut failure: Option<StoreError> = None;
        let mut records = 0u64;
        let done = {
            let failure = &mut failure;
            let records = &mut records;
            let input = &mut *input;
            let mut ended = false;
            let pairs = std::iter::from_fn(move || {
                if ended || failure.is_some() {
                    return None;
                }
                let next = match read_tag(input) {
                    Ok(RECORD) => read_bytes(input).and_then(|k| Ok(vec![k, read_bytes(input)?])),
                    Ok(END) => {
                        ended = true;
                        return None;
                    }
                    Ok(_) => Err(damaged("unexpected record")),
                    Err(e) => Err(e),
                };
                match next {
                    Ok(pair) => {
                        *records += 1;
                        Some(pair)
                    }
                    Err(e) => {
                        *failure = Some(e);
                        None
                    }
                }
            });
            // sled's import panics on I/O errors (and on overwriting, which a new store rules
            // out): turn that into an error instead of aborting the restore halfway unexplained.
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                db.import(vec![(b"tree".to_vec(), name, pairs)])
            }))
        };
        if done.is_err() {
            return Err(StoreError::Internal(
                "sled failed while importing the dump".into(),
            ));
        }
        if let Some(e) = failure {
            return Err(e);
        }
        stats.trees += 1;
        stats.records += records;
    }
    db.flush()?;
    // sled's flush alone may not reach the disk (see `durable`).
    super::durable::SledFile::open(store_dir)
        .and_then(|file| file.sync())
        .map_err(StoreError::Sync)?;
    Ok(stats)
}

fn write_bytes(out: &mut impl Write, bytes: &[u8]) -> std::io::Result<()> {
    out.write_all(&(bytes.len() as u64).to_le_bytes())?;
    out.write_all(bytes)
}

fn read_tag(input: &mut impl Read) -> Result<u8, StoreError> {
    let mut tag = [0u8; 1];
    input
        .read_exact(&mut tag)
        .map_err(|_| damaged("cut short"))?;
    Ok(tag[0])
}

fn read_bytes(input: &mut impl Read) -> Result<Vec<u8>, StoreError> {
    let mut len = [0u8; 8];
    input
        .read_exact(&mut len)
        .map_err(|_| damaged("cut short"))?;
    let len = u64::from_le_bytes(len);
    if len > MAX_ITEM {
        return Err(damaged("item too large"));
    }
    let mut bytes = Vec::new();
    input
        .take(len)
        .read_to_end(&mut bytes)
        .map_err(|e| StoreError::Log(format!("reading the dump: {e}")))?;
    if bytes.len() as u64 != len {
        return Err(damaged("cut short"));
    }
    Ok(bytes)
}

fn damaged(why: &str) -> StoreError {
    StoreError::Corrupt(format!("sled dump: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dump_loads_into_a_new_store_with_every_tree_and_record() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(&dir.path().join("a"), 1 << 20).expect("open");
        let tree = store.db.open_tree("extra").expect("tree");
        tree.insert(b"k1", b"v1".to_vec()).expect("insert");
        tree.insert(b"k2", vec![0u8; 70_000]).expect("insert");
        let mut dump = Vec::new();
        let exported = store.export_sled(&mut dump).expect("export");
        assert!(exported.records >= 2, "{exported:?}");
        let before = contents(&store.db);
        drop(store);

        let target = dir.path().join("b");
        let imported = import_sled(&target, &mut dump.as_slice()).expect("import");
        assert_eq!(imported, exported);
        // Through the store's open, which waits for the lock the import's sled still holds until
        // its background thread lets go of the file.
        let db = super::super::open_sled(&target, 1 << 20).expect("reopen");
        let after = contents(&db);
        assert!(after.contains_key(b"extra".as_slice()));
        assert!(
            before == after,
            "the restored trees differ from the exported ones"
        );
    }

    #[test]
    fn a_cut_dump_is_refused_as_damaged() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(&dir.path().join("a"), 1 << 20).expect("open");
        let mut dump = Vec::new();
        store.export_sled(&mut dump).expect("export");
        dump.truncate(dump.len() - 3);
        let err = import_sled(&dir.path().join("b"), &mut dump.as_slice()).expect_err("refused");
        assert!(err.to_string().contains("sled dump"), "{err}");
        let err = import_sled(&dir.path().join("c"), &mut &b"nonsense"[..]).expect_err("refused");
        assert!(err.to_string().contains("not a handoff-bridge"), "{err}");
    }

    /// Every tree by name (sled lists them in no fixed order), with its records.
    fn contents(db: &sled::Db) -> std::collections::BTreeMap<Vec<u8>, Vec<Vec<Vec<u8>>>> {
        db.export()
            .into_iter()
            .map(|(_, name, records)| (name, records.collect()))
            .collect()
    }
}
