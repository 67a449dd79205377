/// jemalloc instead of glibc malloc (whose per-thread arenas fragment and contend under the intake
/// path's many small, short-lived buffers) and instead of mimalloc (as fast here, but it returns
/// freed pages only when the thread that freed them allocates again, so a burst's memory stayed
/// with threads that went idle). jemalloc's background thread purges freed pages after a second
/// whatever the other threads do: half the RSS after a 1M-event burst (docs/benchmarks.md).
/// Its options are built in through `.cargo/config.toml`.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

mod cli;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    // Everything the daemon and the CLI create (the store, sled's own files, the event log,
    // backups, generated secrets) is owner-only, whatever umask it was started with.
    handoff_bridge::datadir::private_umask();
    let cli = cli::Cli::parse();
    match cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("handoff-bridge: {e}");
            e.exit_code()
        }
    }
}
