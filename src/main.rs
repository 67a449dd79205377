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
