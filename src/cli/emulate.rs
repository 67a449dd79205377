//! `emulator`: the standalone emulator of the service's Open API.

use super::{shutdown_signal, CliError};
use std::path::PathBuf;

/// `handoff-bridge emulator`: a standalone emulator until SIGINT/SIGTERM.
pub(super) fn emulator(
    listen: String,
    seed: Option<PathBuf>,
    api_key: Option<String>,
    webhook_url: Option<String>,
) -> Result<(), CliError> {
    use emulator::{sender, EmulatorConfig, Seed};
    handoff_bridge::telemetry::init(&handoff_bridge::config::LogConfig {
        format: handoff_bridge::config::LogFormat::Human,
        level: "info".into(),
    });
    let seed = match seed {
        Some(path) => Seed::load(&path).map_err(|e| CliError::Usage(e.to_string()))?,
        None => Seed::default_seed().map_err(|e| CliError::Usage(e.to_string()))?,
    };
    let (key, generated) = match api_key {
        Some(k) if !k.is_empty() => (k, false),
        _ => {
            use rand::distr::{Alphanumeric, SampleString};
            (Alphanumeric.sample_string(&mut rand::rng(), 32), true)
        }
    };
    actix_web::rt::System::new().block_on(async move {
        let running = emulator::start_standalone(
            &listen,
            seed,
            EmulatorConfig::new(model::secret::Secret::new(key.clone())),
        )
        .map_err(|e| CliError::Usage(e.to_string()))?;
        if let Some(url) = webhook_url {
            // An https:// webhook URL is verified against the platform's roots.
            let tls = if url
                .get(..8)
                .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
            {
                upstream::tls::install_provider();
                Some(
                    upstream::tls::Trust::load()
                        .client_config("")
                        .map_err(CliError::Usage)?,
                )
            } else {
                None
            };
            sender::start(
                running.emulator.clone(),
                sender::SenderConfig {
                    url,
                    window: std::time::Duration::from_millis(50),
                    tls,
                },
            );
        }
        for addr in &running.addrs {
            say!("listening: http://{addr}");
        }
        if generated {
            // A throwaway key for a local emulator, shown once so callers can use it.
            say!("api key: {key}");
        }
        let handle = running.server.handle();
        let server = actix_web::rt::spawn(running.server);
        shutdown_signal().await;
        handle.stop(true).await;
        let _ = server.await;
        Ok(())
    })
}
