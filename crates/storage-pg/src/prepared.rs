//! Statements prepared once per connection ([`Prepared`]). A statement sent as text is parsed,
//! described and planned by the server on every call, a round trip of its own before the one
//! that runs it; prepared through the connection's statement cache (deadpool's), it is parsed
//! once per connection and each later call binds and runs it in one round trip. Every SQL text
//! of this crate is a constant shape (table and column names from the code, never values), so
//! the cache holds a bounded set of statements.

use deadpool_postgres::GenericClient;
use std::future::Future;
use tokio_postgres::types::ToSql;
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
