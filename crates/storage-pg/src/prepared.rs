//! Statements prepared once per connection ([`Prepared`]). A statement sent as text is parsed,
//! described and planned by the server on every call, a round trip of its own before the one
//! that runs it; prepared through the connection's statement cache (deadpool's), it is parsed
//! once per connection and each later call binds and runs it in one round trip. Every SQL text
//! of this crate is a constant shape (table and column names from the code, never values), so
//! the cache holds a bounded set of statements.
//!
//! The exception is a read of rows by their keys ([`by_keys`]) in a table that grows: a cached
//! statement's plan becomes generic after five calls and stays until the table's statistics
//! change, so one made while the table was small (a fresh database's first minute, whose first
//! `ANALYZE` by autovacuum saw a few pages) scans the whole table on every call as it grows: 1.6
//! to 4.4 ms a call at 13,000 rows (session 45, `auto_explain`). [`by_keys`] sends an unnamed
//! statement with its parameter's type, still one round trip, planned for its keys each time (an
//! index scan).

use deadpool_postgres::GenericClient;
use std::future::Future;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Error, Row};

/// The parameters of a statement.
pub(crate) type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

/// `execute`, `query`, `query_one` and `query_opt` through the connection's statement cache.
pub(crate) trait Prepared: GenericClient {
    /// Run `sql`; the number of rows it touched.
    fn exec(
        &self,
        sql: &str,
        params: Params<'_>,
    ) -> impl Future<Output = Result<u64, Error>> + Send;
    /// Run `sql`; its rows.
    fn rows(
        &self,
        sql: &str,
        params: Params<'_>,
    ) -> impl Future<Output = Result<Vec<Row>, Error>> + Send;
    /// Run `sql`, which answers exactly one row.
    fn row(&self, sql: &str, params: Params<'_>)
        -> impl Future<Output = Result<Row, Error>> + Send;
    /// Run `sql`, which answers at most one row.
    fn row_opt(
        &self,
        sql: &str,
        params: Params<'_>,
    ) -> impl Future<Output = Result<Option<Row>, Error>> + Send;
}

impl<C: GenericClient> Prepared for C {
    async fn exec(&self, sql: &str, params: Params<'_>) -> Result<u64, Error> {
        let statement = self.prepare_cached(sql).await?;
        self.execute(&statement, params).await
    }

    async fn rows(&self, sql: &str, params: Params<'_>) -> Result<Vec<Row>, Error> {
        let statement = self.prepare_cached(sql).await?;
        self.query(&statement, params).await
    }

    async fn row(&self, sql: &str, params: Params<'_>) -> Result<Row, Error> {
        let statement = self.prepare_cached(sql).await?;
        self.query_one(&statement, params).await
    }

    async fn row_opt(&self, sql: &str, params: Params<'_>) -> Result<Option<Row>, Error> {
        let statement = self.prepare_cached(sql).await?;
        self.query_opt(&statement, params).await
    }
}

/// The rows of `sql`, whose one parameter `$1` is a `text[]` of keys, planned for these keys:
/// an unnamed statement (no statement cache, so no generic plan), sent with its parameter's type
/// in one round trip. For reads by key of a table that grows (see the module's docs).
pub(crate) async fn by_keys<C, K>(client: &C, sql: &str, keys: &[K]) -> Result<Vec<Row>, Error>
where
    C: tokio_postgres::GenericClient + Sync,
    K: ToSql + Sync,
{
    client.query_typed(sql, &[(&keys, Type::TEXT_ARRAY)]).await
}

#[cfg(all(test, feature = "test-support"))]
mod tests {
    use super::by_keys;
    use crate::testing::TestDb;
    use tokio_postgres::{Client, NoTls};

    /// Sequential and index scans of the table `grows` by this connection's open transaction.
    async fn scans(client: &Client) -> (i64, i64) {
        let sql = "SELECT seq_scan, idx_scan FROM pg_stat_xact_user_tables WHERE relname = 'grows'";
        let row = client.query_one(sql, &[]).await.expect("scans");
        (row.get(0), row.get(1))
    }

    /// A read by keys finds its rows by index in a table grown after its first calls, where the
    /// statement cached while the table was a few pages and analyzed (autovacuum's first
    /// `ANALYZE` of a fresh table) reads it whole (the control: the test can fail).
    #[test]
    fn a_read_by_keys_is_planned_for_the_table_as_it_is_now() {
        let Some(db) = TestDb::fresh("a read by keys planned for its keys") else {
            return;
        };
        db.execute("CREATE TABLE grows (id text COLLATE \"C\" PRIMARY KEY, body text NOT NULL)");
        let config = crate::connect::parse(&db.url_with_schema())
            .expect("URL")
            .config;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let (client, connection) = config.connect(NoTls).await.expect("connect");
            tokio::spawn(connection);
            let sql = "SELECT id FROM grows WHERE id = ANY($1)";
            let keys: Vec<String> = (1..40).step_by(2).map(|i| format!("k{i}")).collect();
            let grow = |to: u32| {
                format!(
                    "INSERT INTO grows SELECT 'k' || i, repeat('x', 100) \
                     FROM generate_series((SELECT count(*) FROM grows) + 1, {to}) i"
                )
            };
            let small = format!("{}; ANALYZE grows", grow(200));
            client
                .batch_execute(&small)
                .await
                .expect("a few pages, analyzed");
            let cached = client.prepare(sql).await.expect("prepare");
            for _ in 0..8 {
                client.query(&cached, &[&keys]).await.expect("cached read");
                by_keys(&client, sql, &keys).await.expect("read by keys");
            }
            client.batch_execute(&grow(20_000)).await.expect("grow");
            client.batch_execute("BEGIN").await.expect("begin");
            let before = scans(&client).await;
            let rows = by_keys(&client, sql, &keys).await.expect("read by keys");
            let keyed = scans(&client).await;
            assert_eq!(rows.len(), keys.len());
            assert_eq!(keyed.0 - before.0, 0, "no sequential scan");
            assert!(keyed.1 > before.1, "an index scan");
            let rows = client.query(&cached, &[&keys]).await.expect("cached read");
            let control = scans(&client).await;
            assert_eq!(rows.len(), keys.len());
            assert_eq!(
                control.0 - keyed.0,
                1,
                "the cached plan scans the whole table"
            );
        });
    }
}
