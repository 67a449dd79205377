//! The daemon's admin API, or the store when no daemon runs: what every online command reads
//! through, and how it prints what it found.

use super::CliError;
use handoff_bridge::config::Config;
use handoff_bridge::datadir::{DataDir, ADMIN_TOKEN_FILE};
use serde_json::Value;
use storage::Storage;

/// `text` percent-encoded for a path segment or a query value.
pub(super) fn enc(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// Ask the running daemon; if none runs, open the store and ask it directly.
pub(super) fn read(
    config: &Config,
    method: &str,
    path: &str,
    offline: impl FnOnce(&dyn Storage) -> Result<Option<Value>, storage::StoreError>,
) -> Result<Option<Value>, CliError> {
    if let Some(found) = online(config, method, path)? {
        return Ok(found);
    }
    let store = super::open_store(config)?;
    Ok(offline(&*store)?)
}

/// Through the running daemon's admin API; `None` when no daemon runs on this data directory.
/// A `daemon.json` whose process is gone or does not hold the store is stale: its addresses are
/// never called (whoever listens there now must not get the admin token).
pub(super) fn online(
    config: &Config,
    method: &str,
    path: &str,
) -> Result<Option<Option<Value>>, CliError> {
    let data = DataDir::new(&config.store.data_dir);
    if let Some(info) = data.running_daemon() {
        let token = if config.admin.token.is_empty() {
            data.read_secret(ADMIN_TOKEN_FILE)
                .map(|s| s.expose().to_owned())
                .unwrap_or_default()
        } else {
            config.admin.token.expose().to_owned()
        };
        match admin_call(info.admin_addr(), &token, method, path) {
            Ok(found) => return Ok(Some(found)),
            Err(AdminCallError::Unreachable) => {} // stale daemon.json: the daemon is gone
            Err(AdminCallError::Failed(msg)) => return Err(CliError::Admin(msg)),
        }
    }
    Ok(None)
}

enum AdminCallError {
    Unreachable,
    Failed(String),
}

/// One call of the admin API at `listen`; `None` when it answers 404.
fn admin_call(
    listen: &str,
    token: &str,
    method: &str,
    path: &str,
) -> Result<Option<Value>, AdminCallError> {
    let mut addr: std::net::SocketAddr = listen.parse().map_err(|_| AdminCallError::Unreachable)?;
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let url = format!("http://{addr}{path}");
    let method = actix_web::http::Method::from_bytes(method.as_bytes())
        .map_err(|e| AdminCallError::Failed(e.to_string()))?;
    let token = token.to_owned();
    let result = actix_web::rt::System::new().block_on(async move {
        let client = awc::Client::builder()
            .timeout(std::time::Duration::from_secs(30))
            .finish();
        let mut resp = match client.request(method, &url).bearer_auth(token).send().await {
            Ok(r) => r,
            Err(awc::error::SendRequestError::Connect(_)) => {
                return Err(AdminCallError::Unreachable)
            }
            Err(e) => return Err(AdminCallError::Failed(e.to_string())),
        };
        let status = resp.status();
        let body = resp
            .body()
            .limit(64 * 1024 * 1024)
            .await
            .map_err(|e| AdminCallError::Failed(e.to_string()))?;
        Ok((status, body))
    })?;
    let (status, body) = result;
    let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if status.is_success() || status == actix_web::http::StatusCode::CONFLICT {
        Ok(Some(value))
    } else if status == actix_web::http::StatusCode::NOT_FOUND {
        Ok(None)
    } else {
        let msg = value
            .pointer("/error/message")
            .and_then(Value::as_str)
            .unwrap_or("unexpected answer");
        Err(AdminCallError::Failed(format!("{status}: {msg}")))
    }
}

/// Print a found value as pretty JSON; `None` is a not-found error saying `missing()`.
pub(super) fn print_found(
    value: Option<Value>,
    missing: impl FnOnce() -> String,
) -> Result<(), CliError> {
    match value {
        Some(v) => {
            out!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            Ok(())
        }
        None => Err(CliError::NotFound(missing())),
    }
}
