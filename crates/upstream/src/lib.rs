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
#[cfg(any(test, feature = "test-support"))]
pub mod test_support;
pub mod tls;
pub mod transport;

pub use api::OpenApi;
pub use client::{ApiCall, Client, ClientSettings, Execute};
pub use error::UpstreamError;

#[cfg(test)]
mod tests;
