//! For tests (`test-support`): a fresh schema per test in the database
//! `HANDOFF_BRIDGE_TEST_PG_URL` names (`tests/lib/postgres.sh` starts one), dropped at the end;
//! without the variable, `None` and a line saying the test was skipped.

use crate::PgOptions;
use model::secret::Secret;

/// The variable naming the test database.
pub const URL_VAR: &str = "HANDOFF_BRIDGE_TEST_PG_URL";

/// A schema of its own in the test database, dropped with it.
pub struct TestDb {
    url: String,
    pub schema: String,
}

impl TestDb {
    /// A new empty schema for `test`, or `None` (said on stderr) without [`URL_VAR`].
    pub fn fresh(test: &str) -> Option<TestDb> {
        let Ok(url) = std::env::var(URL_VAR) else {
            eprintln!(
                "skipped: {test} needs PostgreSQL ({URL_VAR} unset; see tests/lib/postgres.sh)"
            );
            return None;
        };
        let schema = format!("t_{:016x}", rand_u64());
        sql(&url, &format!("CREATE SCHEMA {schema}"));
        Some(TestDb { url, schema })
    }

    /// How a store reaches this schema.
    pub fn options(&self) -> PgOptions {
        PgOptions {
            url: Secret::new(self.url.clone()),
            roots: rustls::RootCertStore::empty(),
            schema: Some(self.schema.clone()),
        }
    }

    /// The database's URL (its schema then given by `options` in the URL).
    pub fn url_with_schema(&self) -> String {
        let sep = if self.url.contains('?') { '&' } else { '?' };
        format!("{}{sep}options=-csearch_path%3D{}", self.url, self.schema)
    }

    /// Run `statement` in the schema (outside the store).
    pub fn execute(&self, statement: &str) {
        sql(
            &self.url,
            &format!("SET search_path = {}; {statement}", self.schema),
        );
    }

    /// A connection of its own to the schema, for reads outside the store.
    pub fn reader(&self) -> Reader {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let config = crate::connect::parse(&self.url)
            .expect("test database URL")
            .config;
        let schema = self.schema.clone();
        let client = runtime.block_on(async move {
            let (client, connection) = config
                .connect(tokio_postgres::NoTls)
                .await
                .expect("connect to the test database");
            tokio::spawn(connection);
            let path = format!("SET search_path = {schema}");
            client.batch_execute(&path).await.expect("schema");
            client
        });
        Reader { runtime, client }
    }
}

/// A connection to a test schema (not for use inside a runtime).
pub struct Reader {
    runtime: tokio::runtime::Runtime,
    client: tokio_postgres::Client,
}

impl Reader {
    /// The first column of what `query` selects, as numbers: one snapshot.
    pub fn numbers(&self, query: &str) -> Vec<i64> {
        let rows = self
            .runtime
            .block_on(self.client.query(query, &[]))
            .expect("query");
        rows.iter().map(|r| r.get(0)).collect()
    }

    /// Run `statements` on this connection (a transaction it begins stays open, with its locks,
    /// until a later call ends it).
    pub fn execute(&self, statements: &str) {
        self.runtime
            .block_on(self.client.batch_execute(statements))
            .expect("statement");
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        sql(
            &self.url,
            &format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema),
        );
    }
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// Run `statements` on a connection of its own.
fn sql(url: &str, statements: &str) {
    let statements = statements.to_owned();
    on_own_thread(
        move |client| async move {
            client
                .batch_execute(&statements)
                .await
                .expect("test database statement");
        },
        url.to_owned(),
    )
}

/// `work` with a connection of its own, on a thread of its own (callers may be inside a
/// runtime).
fn on_own_thread<T, F, Fut>(work: F, url: String) -> T
where
    T: Send + 'static,
    F: FnOnce(tokio_postgres::Client) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
{
    let run = move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let config = crate::connect::parse(&url)
                .expect("test database URL")
                .config;
            let (client, connection) = config
                .connect(tokio_postgres::NoTls)
                .await
                .expect("connect to the test database");
            tokio::spawn(connection);
            work(client).await
        })
    };
    std::thread::spawn(run)
        .join()
        .expect("test database thread")
}
