//! `store copy`: a stopped sled store into PostgreSQL ([`handoff_bridge::store_copy`]), its
//! progress per kind and its check, a table of counts, printed.

use super::{CliError, StoreCommand};
use handoff_bridge::datadir::DataDir;
use handoff_bridge::store_copy::{self, CopyError, Progress, Report, Request};
use model::secret::Secret;
use std::path::Path;
use storage_pg::PgOptions;

/// sled's cache while the copy reads (`store.cache_capacity_bytes`' default).
const SLED_CACHE_BYTES: u64 = 8 << 20;
/// A kind with many records says how far it got every this many.
const PROGRESS_EVERY: u64 = 100_000;

pub(super) fn store_command(action: StoreCommand) -> Result<(), CliError> {
    match action {
        StoreCommand::Copy {
            from,
            to,
            ca_file,
            discard_incomplete,
        } => copy(&from, to, ca_file.as_deref(), discard_incomplete),
    }
}

/// `handoff-bridge store copy`: copy, print the table, fail when a count differs.
fn copy(
    from: &Path,
    to: Secret,
    ca_file: Option<&Path>,
    discard_incomplete: bool,
) -> Result<(), CliError> {
    let ca_file = ca_file.map(|p| p.display().to_string()).unwrap_or_default();
    let roots = upstream::tls::Trust::load()
        .roots(&ca_file)
        .map_err(|e| CliError::Usage(format!("--ca-file {e}")))?;
    let options = PgOptions {
        url: to,
        roots,
        schema: None,
    };
    let data = DataDir::new(from);
    out!(
        "copying {} into {}",
        data.store_path().display(),
        options.masked_url()
    );
    let request = Request {
        from: &data,
        to: &options,
        discard_incomplete,
        cache_capacity: SLED_CACHE_BYTES,
    };
    let report = store_copy::copy(&request, &mut say_progress)?;
    print_table(&report);
    if !report.agrees() {
        return Err(CopyError::Differ(report.differences().join(", ")).into());
    }
    out!(
        "copied {} records in {:.1}s; start the daemon with store.url set to this database",
        report.records,
        report.took.as_secs_f64()
    );
    Ok(())
}

fn say_progress(p: Progress) {
    let name = p.kind.name();
    if p.done {
        out!("  {name}: {}", p.records);
    } else if p.records % PROGRESS_EVERY < store_copy::BATCH_RECORDS as u64 {
        out!("  {name}: {}...", p.records);
    }
}

/// The check as a table: what, sled, PostgreSQL, and whether they agree.
fn print_table(report: &Report) {
    out!("{:<26} {:>12} {:>12}", "", "sled", "postgresql");
    for line in &report.lines {
        let verdict = match (line.agrees(), line.merged) {
            (false, _) => "DIFFERS".to_owned(),
            (true, 0) => String::new(),
            (true, n) => format!("({n} held twice on sled, one row here)"),
        };
        let row = format!(
            "{:<26} {:>12} {:>12} {verdict}",
            line.what, line.sled, line.postgres
        );
        out!("{}", row.trim_end());
    }
}
