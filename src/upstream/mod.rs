//! The service's Open API: the contract types, and the client that calls it under rate limits,
//! one attempt per call. The client is generic over its transport (awc in production) and its executor
//! (the client itself, or [`handle::UpstreamHandle`] from any thread).

pub mod api;
pub mod client;
pub mod error;
pub mod execute;
pub mod handle;
pub mod limits;
pub mod retry;
pub mod transport;

pub use api::OpenApi;
pub use client::{ApiCall, Client, ClientSettings, Execute};
pub use error::UpstreamError;

#[cfg(test)]
mod tests;

/// Client settings from the `[upstream]` configuration (the key resolved from env or file).
pub fn settings(config: &crate::config::UpstreamConfig) -> Result<ClientSettings, String> {
    Ok(ClientSettings {
        auth_header: config.auth_header.clone(),
        auth_scheme: config.auth_scheme.clone(),
        api_key: config.resolve_api_key()?,
        idempotency_header: config.idempotency_header.clone(),
    })
}
