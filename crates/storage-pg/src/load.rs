//! The PostgreSQL side of `handoff-bridge store copy`: a dumped store (`storage::dump`) written
//! into an empty database.
//!
//! - **Only into an empty target.** [`Loader::start`] reads the target first and writes nothing
//!   when its schema is newer than this binary knows, or a table of its schema holds a row
//!   ([`TargetError`]).
//! - **Bounded batches, each one transaction.** [`Loader::load`] writes a batch of records of one
//!   kind in one transaction; the copy holds one batch in memory at a time.
//! - **Not resumable: run again after emptying.** From its first write until
//!   [`Loader::finish`] the target is marked incomplete (a row in `meta`), and a store refuses to
//!   open it ([`PgError::CopyIncomplete`]), so a daemon never starts on half a store. A copy run
//!   again refuses such a target unless told to discard what the interrupted one left: then it
//!   drops the schema's tables and sequences (those this binary's schema creates, read from its
//!   SQL) and starts afresh.
//! - **Numbers continue.** Events, outbox entries, quarantine records and console actions keep
//!   their numbers; `finish` sets each sequence past the highest number copied (and the events'
//!   past every number the source ever gave out, so folded marks stay below new events), sets the
//!   folds' watermark (an event number) and the backfill cursor, and counts the rows into `meta`.
//!
//! What the folds derive from the states (the agent API's and the sweeper's index, the retention
//! index, each bot's waiting count, the end users' messenger identities) is written from the
//! states as the folds write it (the same functions). An event id stored twice by the source (a
//! re-send after its dedupe window, while the older copy's segment was kept) is one row here, the
//! later copy: [`Loader::merged`] counts them.

mod insert;

use crate::prepared::Prepared;
use crate::rows::big;
use crate::{run_on, Opening, OwnRuntime, PgError, PgOptions, PgStore};
use deadpool_postgres::Object;
use storage::dump::{Kind, Positions, Record};
use storage::{BackendError, StoreError};

/// The `meta` key that marks a target a copy is loading.
const INCOMPLETE: &str = "copy_incomplete";

/// Why a target is refused (nothing was written to it).
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error(
        "the target's schema is version {found}, newer than this binary knows ({known}): copy with \
         a binary at least as new"
    )]
    TooNew { found: u32, known: u32 },
    #[error(
        "the target is not empty (table {table} holds rows): copy into an empty database or schema"
    )]
    NotEmpty { table: String },
    #[error("an earlier copy into the target did not finish: it must be emptied before a copy")]
    Incomplete,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Rows of the target, counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// Those of a dumped kind's table (deliveries: the delivery ids).
    Of(Kind),
    Events,
    /// The agent API's phase index and the sweeper's, as rebuilt from the states.
    Derived,
}

/// Records the source held twice that are one row here (the later copy).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Merged {
    pub deliveries: u64,
    pub events: u64,
}

/// The highest numbers copied, which the sequences continue past.
#[derive(Clone, Copy, Debug, Default)]
struct Highest {
    event: u64,
    outbox: u64,
    quarantine: u64,
    operator: u64,
}

impl Highest {
    fn note(&mut self, record: &Record) {
        let (slot, n) = match record {
            Record::Delivery { events, .. } => (
                &mut self.event,
                events.iter().map(|e| e.seq).max().unwrap_or(0),
            ),
            Record::FoldedMark { mark, .. } => (&mut self.event, *mark),
            Record::Outbox(e) => (&mut self.outbox, e.seq),
            Record::RetryState { seq, .. } => (&mut self.outbox, *seq),
            Record::DeadLetter(l) => (&mut self.outbox, l.entry.seq),
            Record::Done(d) => (&mut self.outbox, d.entry.seq),
            Record::Ledger { status, .. } => (&mut self.outbox, status.seq),
            Record::Quarantine(q) => (&mut self.quarantine, q.id),
            Record::OperatorAction { id, .. } => (&mut self.operator, *id),
            _ => return,
        };
        *slot = (*slot).max(n);
    }
}

/// A copy under way into one target (see the module's docs).
pub struct Loader {
    store: PgStore,
    highest: Highest,
    merged: Merged,
}

impl Loader {
    /// Check the target (read only), empty it when `discard_incomplete` and an earlier copy left
    /// it incomplete, open it (its schema migrated) and mark it incomplete.
    pub fn start(options: &PgOptions, discard_incomplete: bool) -> Result<Loader, TargetError> {
        match on_own_connection(options, |c| async move { inspect(&c).await })? {
            Found::Empty => {}
            Found::Incomplete if discard_incomplete => {
                on_own_connection(options, |mut c| async move { discard(&mut c).await })
                    .map_err(TargetError::Store)?;
                tracing::info!("emptied what an interrupted copy left in the target");
            }
            Found::Incomplete => return Err(TargetError::Incomplete),
            Found::NotEmpty(table) => return Err(TargetError::NotEmpty { table }),
            Found::TooNew(found) => {
                return Err(TargetError::TooNew {
                    found,
                    known: crate::SCHEMA_VERSION,
                })
            }
        }
        let store = PgStore::open_as(options, model::clock::Clock::new(), Opening::Copy)?;
        store.with_client(|c| async move {
            c.exec(
                "INSERT INTO meta (key, value) VALUES ($1, 1) ON CONFLICT (key) DO NOTHING",
                &[&INCOMPLETE],
            )
            .await?;
            Ok(())
        })?;
        Ok(Loader {
            store,
            highest: Highest::default(),
            merged: Merged::default(),
        })
    }

    /// Write `batch`, records of `kind`, in one transaction.
    pub fn load(&mut self, kind: Kind, batch: Vec<Record>) -> Result<(), StoreError> {
        if batch.iter().any(|r| r.kind() != kind) {
            return Err(StoreError::Internal(format!(
                "a batch of {} holds another kind",
                kind.name()
            )));
        }
        let mut highest = self.highest;
        batch.iter().for_each(|r| highest.note(r));
        let merged = self.store.with_client(move |mut c| async move {
            let tx = c.transaction().await?;
            let merged = insert::batch(&tx, kind, batch).await?;
            tx.commit().await?;
            Ok(merged)
        })?;
        self.highest = highest;
        self.merged.deliveries += merged.deliveries;
        self.merged.events += merged.events;
        Ok(())
    }

    /// What the source held twice that is one row here.
    pub fn merged(&self) -> Merged {
        self.merged
    }

    /// Rows of the target now.
    pub fn rows(&self, rows: Rows) -> Result<u64, StoreError> {
        let table = match rows {
            Rows::Of(kind) => insert::table(kind),
            Rows::Events => "events",
            Rows::Derived => "derived",
        };
        let sql = format!("SELECT count(*) FROM {table}");
        self.store.with_client(move |c| async move {
            Ok(crate::rows::num(c.row(&sql, &[]).await?.get(0)))
        })
    }

    /// Set the sequences past the numbers copied, the watermark, the backfill cursor and the
    /// counts, and take the incomplete mark away, in one transaction: the store, complete.
    pub fn finish(self, at: &Positions) -> Result<PgStore, StoreError> {
        let h = self.highest;
        let last_event = h.event.max(at.next_event.saturating_sub(1));
        let numbers = [
            ("event_seq", last_event),
            ("outbox_seq", h.outbox),
            ("quarantine_seq", h.quarantine),
            ("operator_seq", h.operator),
        ];
        let (fold_from, backfill) = (big(at.fold_from), at.backfill_cursor);
        self.store.with_client(move |mut c| async move {
            let tx = c.transaction().await?;
            for (sequence, last) in numbers.iter().filter(|(_, n)| *n > 0) {
                let sql = format!("SELECT setval('{sequence}', $1)");
                tx.exec(&sql, &[&big(*last)]).await?;
            }
            tx.exec(
                "UPDATE meta SET value = $1 WHERE key = 'fold_from'",
                &[&fold_from],
            )
            .await?;
            if let Some(at) = backfill {
                tx.exec(
                    "INSERT INTO meta (key, value) VALUES ('backfill_cursor', $1) \
                     ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    &[&at],
                )
                .await?;
            }
            for (key, table) in insert::COUNTED {
                let sql = format!(
                    "UPDATE meta SET value = (SELECT count(*) FROM {table}) WHERE key = '{key}'"
                );
                tx.exec(&sql, &[]).await?;
            }
            tx.exec("DELETE FROM meta WHERE key = $1", &[&INCOMPLETE])
                .await?;
            tx.commit().await?;
            Ok(())
        })?;
        Ok(self.store)
    }
}

/// A database a store opens: refused while a copy's mark says it is incomplete.
pub(crate) async fn refuse_incomplete(c: &Object) -> Result<(), PgError> {
    match is_incomplete(c).await? {
        true => Err(PgError::CopyIncomplete),
        false => Ok(()),
    }
}

async fn is_incomplete(c: &Object) -> Result<bool, PgError> {
    let row = c
        .row_opt("SELECT 1 FROM meta WHERE key = $1", &[&INCOMPLETE])
        .await?;
    Ok(row.is_some())
}

/// What a target holds, as [`inspect`] found it.
enum Found {
    Empty,
    Incomplete,
    NotEmpty(String),
    TooNew(u32),
}

/// Read (only) what the target's schema holds: its version, the incomplete mark, a row in any
/// table but the version's, the counters' and the lease's (whose one row the schema makes; a
/// daemon that ran on the target shows in the others).
async fn inspect(c: &Object) -> Result<Found, PgError> {
    let tables: Vec<String> = c
        .rows(
            "SELECT tablename::text FROM pg_tables WHERE schemaname = current_schema() \
             ORDER BY tablename",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let has = |name: &str| tables.iter().any(|t| t == name);
    if has("schema_version") {
        let found: Option<i32> = c
            .row("SELECT max(version) FROM schema_version", &[])
            .await?
            .get(0);
        let found = found.map_or(0, |v| u32::try_from(v).unwrap_or(0));
        if found > crate::SCHEMA_VERSION {
            return Ok(Found::TooNew(found));
        }
    }
    if has("meta") && is_incomplete(c).await? {
        return Ok(Found::Incomplete);
    }
    for table in tables
        .iter()
        .filter(|t| !["schema_version", "meta", "lease"].contains(&t.as_str()))
    {
        let quoted: String = c.row("SELECT quote_ident($1)", &[table]).await?.get(0);
        let rows: bool = c
            .row(&format!("SELECT EXISTS (SELECT 1 FROM {quoted})"), &[])
            .await?
            .get(0);
        if rows {
            return Ok(Found::NotEmpty(table.clone()));
        }
    }
    Ok(Found::Empty)
}

/// Drop the tables and sequences this binary's schema creates (what an interrupted copy left),
/// in one transaction.
async fn discard(c: &mut Object) -> Result<(), PgError> {
    let (tables, sequences) = crate::schema::objects();
    let tx = c.transaction().await?;
    tx.batch_execute(&format!(
        "DROP TABLE IF EXISTS {} CASCADE; DROP SEQUENCE IF EXISTS {}; \
         DROP TABLE IF EXISTS schema_version",
        tables.join(", "),
        sequences.join(", ")
    ))
    .await?;
    tx.commit().await?;
    Ok(())
}

/// `work` on a connection of its own, on a runtime of its own (before the store is opened);
/// failures name the masked URL.
fn on_own_connection<T, F, Fut>(options: &PgOptions, work: F) -> Result<T, StoreError>
where
    T: Send + 'static,
    F: FnOnce(Object) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<T, PgError>> + Send,
{
    let failed = |e: PgError| StoreError::Open {
        path: options.masked_url(),
        source: BackendError::new(e, false),
    };
    let runtime = OwnRuntime::start().map_err(failed)?;
    let pool = crate::connect::pool(options).map_err(failed)?;
    run_on(runtime.handle(), crate::CALL_TIMEOUT, async move {
        work(pool.get().await?).await
    })
    .map_err(failed)
}
