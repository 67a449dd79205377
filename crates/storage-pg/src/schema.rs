//! The schema, embedded (`schema/N.sql`) and migrated at open: in one transaction, under an
//! advisory lock (two processes starting at once migrate once), recorded in `schema_version`. A
//! database whose version is newer than [`SCHEMA_VERSION`] is refused ([`PgError::TooNew`]).

use crate::PgError;
use deadpool_postgres::Object;

/// The migrations, in order: version, SQL.
const MIGRATIONS: &[(u32, &str)] = &[
    (1, include_str!("schema/1.sql")),
    (2, include_str!("schema/2.sql")),
];

/// The newest schema this binary knows.
pub const SCHEMA_VERSION: u32 = 2;

/// The tables and sequences the migrations create (read from their SQL: `CREATE TABLE name`,
/// `CREATE SEQUENCE name` at a line's start), `schema_version` aside.
pub(crate) fn objects() -> (Vec<&'static str>, Vec<&'static str>) {
    let (mut tables, mut sequences) = (Vec::new(), Vec::new());
    for line in MIGRATIONS.iter().flat_map(|(_, sql)| sql.lines()) {
        let name = |rest: &'static str| {
            rest.split(|c: char| c.is_whitespace() || c == '(' || c == ';')
                .next()
                .unwrap_or_default()
        };
        if let Some(rest) = line.strip_prefix("CREATE TABLE ") {
            tables.push(name(rest));
        } else if let Some(rest) = line.strip_prefix("CREATE SEQUENCE ") {
            sequences.push(name(rest));
        }
    }
    (tables, sequences)
}

/// The advisory locks of one store (one schema): keys derived from the schema's name, so stores
/// in other schemas of the same database never wait for each other.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Locks {
    /// Taken by every transaction that inserts events, before it draws their numbers.
    pub events: i64,
    /// Taken by every fold transaction (and what writes what folds write).
    pub fold: i64,
    migrate: i64,
}

impl Locks {
    fn of(schema: &str) -> Locks {
        // FNV-1a: stable across builds (the keys are shared by processes).
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for b in schema.bytes() {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        let base = (hash & !0xff) as i64;
        Locks {
            events: base | 1,
            fold: base | 2,
            migrate: base | 3,
        }
    }
}

/// Bring the schema up to [`SCHEMA_VERSION`]; the store's locks.
pub(crate) async fn migrate(client: &mut Object) -> Result<Locks, PgError> {
    let tx = client.transaction().await?;
    let schema: Option<String> = tx.query_one("SELECT current_schema()", &[]).await?.get(0);
    let schema = schema.ok_or(PgError::Url(
        "the connection has no schema to create tables in (search_path)".into(),
    ))?;
    let locks = Locks::of(&schema);
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&locks.migrate])
        .await?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS schema_version (version integer NOT NULL)")
        .await?;
    let found: Option<i32> = tx
        .query_one("SELECT max(version) FROM schema_version", &[])
        .await?
        .get(0);
    let found = found.map_or(0, |v| u32::try_from(v).unwrap_or(0));
    if found > SCHEMA_VERSION {
        return Err(PgError::TooNew {
            found,
            known: SCHEMA_VERSION,
        });
    }
    for (version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > found) {
        tx.batch_execute(sql).await?;
        tracing::info!(version, "database schema migrated");
    }
    if found < SCHEMA_VERSION {
        let version = SCHEMA_VERSION as i32;
        tx.execute("DELETE FROM schema_version", &[]).await?;
        tx.execute(
            "INSERT INTO schema_version (version) VALUES ($1)",
            &[&version],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(locks)
}
