//! `serve`: the daemon, its start banner and the shutdown signals.

use super::{load_with, CliError, ConfigArgs};
use handoff_bridge::config::{Config, Overrides};

/// `handoff-bridge serve`: load the config (files checked), start the logs, run the daemon.
pub(super) fn serve_command(
    args: &ConfigArgs,
    listen: Option<String>,
    admin_listen: Option<String>,
    upstream: Option<String>,
) -> Result<(), CliError> {
    let overrides = Overrides {
        listen,
        admin_listen,
        upstream,
        data_dir: None,
        check_files: true,
    };
    let config = load_with(args, overrides)?;
    handoff_bridge::telemetry::init(&config.log);
    serve(config)
}

/// `serve`: build the application on the configured listeners, say where it accepts webhooks
/// while the store opens, run it until SIGTERM or SIGINT, and print the banner once it serves.
fn serve(config: Config) -> Result<(), CliError> {
    use handoff_bridge::app::{Application, Listeners, Stopped};
    actix_web::rt::System::new().block_on(async move {
        // SIGTERM and SIGINT from here on stop the daemon in order, an early listener too.
        let signal = shutdown_signal();
        let listeners = Listeners::bind(&config)?;
        let app = Application::build(config, listeners).await?;
        if app.takes_early_deliveries() {
            // Machine-readable, like the `listening:` line that follows once started.
            let addrs = app.addrs();
            say!("accepting webhooks: {}://{}", addrs.scheme, addrs.public);
        }
        match app.run(signal, banner).await {
            Ok(Stopped::InOrder) => Ok(()),
            // Only a restart mends the store: end at once, as a crash would (everything
            // acknowledged is in the event log, found again on open).
            Err(handoff_bridge::app::AppError::Stuck { exit_code }) => {
                std::process::exit(exit_code)
            }
            Err(e) => Err(e.into()),
            // sled's open still runs on its thread and cannot be cut short: end here, as a
            // crash would (what the early listener answered is in the log).
            Ok(Stopped::WhileOpening) => std::process::exit(0),
        }
    })
}

/// The start lines on stdout, the public listener's last: tests and scripts wait for it.
fn banner(started: &handoff_bridge::app::Started) {
    use std::io::IsTerminal as _;
    let addrs = &started.addrs;
    let (scheme, bound) = (addrs.scheme, addrs.public);
    let token_file = started.token_file.display();
    let token_shown = match &started.generated_token {
        // First start with a generated token, by hand: show it once so it can be registered.
        // Under systemd or Kubernetes stdout is a log, and the token stays in its file.
        Some(token) if std::io::stdout().is_terminal() => token.expose().to_owned(),
        Some(_) => format!("<generated token, saved in {token_file}>"),
        None => format!("<token in {token_file} or config>"),
    };
    say!(
        "webhook url: {scheme}://{bound}{}/{token_shown}",
        started.webhook_path
    );
    if let Some(emulator) = addrs.emulator {
        // Loud: a bridge that talks to the fake reaches no real user.
        say!(
            "WARNING: the upstream is the embedded emulator, not the real service: no message \
             reaches a real user (set upstream.url to the service's Open API for production)"
        );
        say!("upstream: embedded emulator at http://{emulator}");
    }
    if let Some(url) = &started.remote_upstream {
        say!("upstream: remote {url}");
    }
    if let Some(at) = addrs.admin {
        say!("admin listening: http://{at}");
        say!("console: http://{at}/console/ (sign in with the admin token)");
    }
    say!("listening: {scheme}://{bound}");
}

/// Wait for SIGTERM or SIGINT; returns which. The handlers are installed when this is called
/// (not when first awaited), so a signal right after the start line is not the default action's.
pub fn shutdown_signal() -> impl std::future::Future<Output = &'static str> {
    use tokio::signal::unix::{signal, SignalKind};
    let handlers = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    );
    async move {
        let (Ok(mut term), Ok(mut int)) = handlers else {
            tracing::error!("cannot install signal handlers; stop with SIGKILL");
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    }
}
