//! Which store the daemon runs on: PostgreSQL when `store.url` (or `store.url_file`) names one,
//! else sled in `store.data_dir`. The composition root and the CLI's offline commands open it
//! here; the rest of the daemon sees only the port.

use super::AppError;
use crate::config::Config;
use std::sync::Arc;
use storage::{SledStore, Store, StoreError};
use storage_pg::{PgOptions, PgStore};

/// An open store, by backend (each brings its own intake writer).
pub enum Backend {
    Sled(Box<SledStore>),
    Postgres(PgStore),
    /// One the caller opened (`Application::build_on`): several nodes in one process.
    Given(super::GivenStore),
}

impl Backend {
    /// The store as the daemon holds it.
    pub fn port(&self) -> Store {
        match self {
            Backend::Sled(sled) => Arc::new((**sled).clone()),
            Backend::Postgres(pg) => Arc::new(pg.clone()),
            Backend::Given(given) => given.store.clone(),
        }
    }
}

/// The PostgreSQL store's settings, `None` for sled: the URL (a secret), TLS trusting `trust`'s
/// roots and `store.ca_file`.
pub fn postgres_options(
    config: &Config,
    trust: &upstream::tls::Trust,
) -> Result<Option<PgOptions>, AppError> {
    let Some(url) = config.store.resolve_url().map_err(AppError::StoreConfig)? else {
        return Ok(None);
    };
    let roots = trust
        .roots(&config.store.ca_file)
        .map_err(|e| AppError::StoreConfig(format!("store.ca_file {e}")))?;
    Ok(Some(PgOptions {
        url,
        roots,
        schema: None,
    }))
}

/// The configured store, opened for a command run with no daemon (which would hold sled's).
pub fn open_offline(config: &Config) -> Result<Store, AppError> {
    if config
        .store
        .resolve_url()
        .map_err(AppError::StoreConfig)?
        .is_some()
    {
        let trust = upstream::tls::Trust::load();
        if let Some(options) = postgres_options(config, &trust)? {
            let store = PgStore::open(&options, model::clock::Clock::new())?;
            return Ok(Arc::new(store));
        }
    }
    let data = crate::datadir::DataDir::new(&config.store.data_dir);
    let store = SledStore::open(&data.store_path(), config.store.cache_capacity_bytes)?;
    Ok(Arc::new(store))
}

/// Open the PostgreSQL store (connect, migrate); errors name the masked URL.
pub(super) fn open_postgres(
    options: &PgOptions,
    clock: model::clock::Clock,
) -> Result<Backend, StoreError> {
    tracing::info!(url = %options.masked_url(), "opening the PostgreSQL store");
    Ok(Backend::Postgres(PgStore::open(options, clock)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Overrides;

    fn config(url: &str) -> Config {
        let env = vec![("HANDOFF_BRIDGE_STORE_URL".to_owned(), url.to_owned())];
        Config::load_from(None, env, &Overrides::default()).expect("config")
    }

    #[test]
    fn an_unreachable_database_stops_the_open_with_its_password_masked() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = closed.local_addr().expect("addr").port();
        drop(closed);
        let config = config(&format!(
            "postgres://bridge:s3cret@127.0.0.1:{port}/bridge?sslmode=disable"
        ));
        assert!(!config.to_masked_toml().contains("s3cret"));
        let Err(e) = open_offline(&config) else {
            panic!("nothing listens there");
        };
        let text = e.to_string();
        assert!(text.contains("bridge:****@127.0.0.1"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
    }

    #[test]
    fn a_url_that_is_not_postgres_is_refused_unshown() {
        let env = vec![(
            "HANDOFF_BRIDGE_STORE_URL".to_owned(),
            "mysql://bridge:s3cret@db/bridge".to_owned(),
        )];
        let e = Config::load_from(None, env, &Overrides::default()).expect_err("refused");
        let text = e.to_string();
        assert!(text.contains("store.url"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
    }
}
