//! The service's Open API: the contract types, and (coming) the client.

pub mod contract;
