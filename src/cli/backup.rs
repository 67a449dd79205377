//! `backup` and `restore` of a stopped daemon's data directory.

use super::{load, CliError, ConfigArgs};
use handoff_bridge::datadir::DataDir;
use std::path::Path;

/// `handoff-bridge backup`: copy the data directory into the backup directory `out`.
pub(super) fn backup(args: &ConfigArgs, out: &Path) -> Result<(), CliError> {
    let config = load(args, None)?;
    let data = DataDir::new(&config.store.data_dir);
    let m = handoff_bridge::backup::backup(&data, out, config.store.cache_capacity_bytes)?;
    out!(
        "backed up {} to {}: {} sled trees, {} records, {} files ({} bytes)",
        data.root().display(),
        out.display(),
        m.sled.trees,
        m.sled.records,
        m.files.len(),
        m.files.iter().map(|f| f.bytes).sum::<u64>()
    );
    Ok(())
}

/// `handoff-bridge restore`: restore the backup `from` into the data directory.
pub(super) fn restore(args: &ConfigArgs, from: &Path, force: bool) -> Result<(), CliError> {
    let config = load(args, None)?;
    let data = DataDir::new(&config.store.data_dir);
    let m = handoff_bridge::backup::restore(from, &data, force, config.store.cache_capacity_bytes)?;
    out!(
        "restored {} (taken {}, bridge {}) into {}: {} sled trees, {} records, {} files",
        from.display(),
        m.created_at,
        m.bridge_version,
        data.root().display(),
        m.sled.trees,
        m.sled.records,
        m.files.len()
    );
    Ok(())
}
