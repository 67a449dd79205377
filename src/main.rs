/// mimalloc instead of glibc malloc: the intake path allocates many small, short-lived buffers
/// on several threads, where glibc's arenas fragment and contend (see docs/benchmarks.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = handoff_bridge::cli::Cli::parse();
    match handoff_bridge::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("handoff-bridge: {e}");
            e.exit_code()
        }
    }
}
