//! Logging: `RUST_LOG` wins over the configured level; human or JSON lines on stderr.

use crate::config::{LogConfig, LogFormat};
use tracing_subscriber::EnvFilter;

pub fn init(log: &LogConfig) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&log.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // A log line that cannot be written (stderr a pipe whose reader is gone) is dropped:
        // reporting it would write to stderr again, and that write panics.
        .log_internal_errors(false);
    let result = match log.format {
        LogFormat::Json => builder.json().with_current_span(true).try_init(),
        LogFormat::Human => builder.try_init(),
    };
    if let Err(e) = result {
        eprintln!("logging already initialised: {e}");
    }
}
