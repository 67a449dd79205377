//! The PostgreSQL backend of the storage port ([`PgStore`]): every group of `storage::port`, a
//! fold session ([`fold`]) that reads and commits a batch's write set in one transaction, and a
//! group-commit intake writer ([`PgWriter`]). The schema is embedded and migrated at open, in one
//! transaction under an advisory lock ([`schema`]); a schema newer than this binary knows is
//! refused.
//!
//! Every statement is prepared once per connection and kept ([`prepared`]), but the reads by key
//! of tables that grow, planned for their keys on every call (`prepared::by_keys`); a batch of
//! anything (events, states, outcomes, begin marks) is one statement over arrays (`unnest`), not
//! one per row.
//!
//! The port is synchronous, the client async: the store runs tokio-postgres on a small runtime
//! of its own, and each port call spawns its work there and waits for the answer on a plain
//! channel, so it may be called from any thread (fold threads, blocking threads, async threads of
//! another runtime) and never runs `block_on` inside a runtime. No transaction outlives one
//! port call except a fold session's, which spans only the fold's own reads and its commit
//! (never an HTTP call).
//!
//! # Numbers commit in order
//!
//! Sequence numbers are handed out when drawn, not when their transaction commits, so a reader
//! that moved past number `n` because `n + 1` was visible could miss an `n` committed later.
//! Neither the events nor the outbox can have such a hole:
//!
//! - **Events.** Every transaction that inserts events (the writer's group, an offline `accept`)
//!   first takes `pg_advisory_xact_lock(events lock)`, then draws its numbers from `event_seq`,
//!   then commits, which releases the lock after the commit is visible. So transactions holding
//!   the lock draw in the order they commit, each number above every number committed before
//!   it: the committed events are always a prefix of the numbers drawn (less gaps of rolled-back
//!   groups, which no one waits for), in every snapshot. The writer hands committed events to the
//!   dispatcher in that order; a start reads what is above the marks from the watermark.
//! - **Outbox.** Entries are numbered from `outbox_seq` inside fold transactions, and folds are
//!   serialised: an in-process lock (sled's fold lock) and, for any other process on the same
//!   database, `pg_advisory_xact_lock(fold lock)` taken first thing in the transaction. So entries
//!   commit in their numbers' order too, and the executor's cursor never passes one that commits
//!   later.
//!
//! Both are tested (`tests/commit_order.rs`): concurrent writers while a reader follows the
//! numbers; it never sees a number above one it has not seen yet.
//!
//! Every transaction of the active's work (fold commits, outbox outcomes, retention, the
//! watermark, the backfill cursor, the desks' mappings) goes through `begin_active`, which
//! checks in the same transaction that this node still holds the lease's epoch (`lease`): a
//! node that lost the lease commits nothing.

mod asks;
mod connect;
mod desk_links;
mod fold;
mod intake;
mod lease;
pub mod load;
mod outbox;
mod prepared;
mod reads;
mod retention;
mod rows;
mod schema;
#[cfg(feature = "test-support")]
pub mod testing;

pub use connect::{mask, PgOptions, SslMode};
pub use intake::PgWriter;
pub use schema::SCHEMA_VERSION;

use crate::prepared::Prepared;
use deadpool_postgres::{Object, Pool};
use std::future::Future;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use storage::timers::TimerWakeup;
use storage::{BackendError, StoreError};

/// The longest a port call waits for the database before it fails (the database unreachable,
/// or a lock held by a stuck client).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Why the database failed a call.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    #[error("store.url: {0}")]
    Url(String),
    #[error("TLS to the database: {0}")]
    Tls(String),
    #[error("database: {}", connect::explain(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("no connection to the database: {}", connect::explain(.0))]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("the database did not answer within {}s", CALL_TIMEOUT.as_secs())]
    Timeout,
    #[error("the database schema is version {found}, newer than this binary knows ({known})")]
    TooNew { found: u32, known: u32 },
    /// `handoff-bridge store copy` into this database did not finish (`load`).
    #[error(
        "a copy into this database (handoff-bridge store copy) did not finish: it holds part of \
         a store; empty it and copy again"
    )]
    CopyIncomplete,
    #[error("{what} unreadable: {detail}")]
    Corrupt { what: &'static str, detail: String },
    #[error("{0}")]
    Internal(&'static str),
    /// A write of the active's work after this node's lease moved on (`lease`).
    #[error("this node no longer holds the lease")]
    Fenced,
}

impl PgError {
    /// Whether the connection failed (the database away, a timeout) rather than a statement.
    fn is_connection(&self) -> bool {
        match self {
            PgError::Pool(_) | PgError::Timeout => true,
            PgError::Db(e) => e.is_closed() || e.as_db_error().is_none(),
            _ => false,
        }
    }
}

impl From<PgError> for StoreError {
    fn from(e: PgError) -> StoreError {
        match e {
            PgError::TooNew { found, known } => StoreError::TooNew {
                found,
                supported: known,
            },
            PgError::Corrupt { what, detail } => StoreError::Corrupt(format!("{what}: {detail}")),
            PgError::Internal(what) => StoreError::Internal(what.into()),
            PgError::Fenced => StoreError::Fenced,
            e => {
                let connection = e.is_connection();
                StoreError::Backend(BackendError::new(e, connection))
            }
        }
    }
}

/// The PostgreSQL store. Clones share it (its pool, its runtime, its fold lock).
#[derive(Clone)]
pub struct PgStore(Arc<Inner>);

struct Inner {
    pool: Pool,
    runtime: OwnRuntime,
    clock: model::clock::Clock,
    locks: schema::Locks,
    /// Held by a fold session (and whatever writes what folds write), as sled's fold lock; what
    /// it guards: the bot queues the folds hold from one session to the next.
    fold_lock: Mutex<fold::HeldQueues>,
    timer_wakeup: Arc<TimerWakeup>,
    /// The first event number a running writer hands over itself (see `pending_before_writer`).
    writer_from: Mutex<Option<u64>>,
    fail_next_commit: AtomicBool,
    /// How many waiting conversations the folds hold in memory over all bots
    /// (`fold::QUEUE_HELD`; tests lower it).
    queue_held: std::sync::atomic::AtomicUsize,
    /// What this handle holds of the lease (`lease`).
    fence: Mutex<lease::Fence>,
    /// How long one port call may wait for the database, in ms ([`CALL_TIMEOUT`]; tests lower it).
    call_timeout_ms: std::sync::atomic::AtomicU64,
    /// Rows one chunk of a retention `DELETE` removes at most (`retention::DELETE_CHUNK`; tests
    /// lower it).
    delete_chunk: std::sync::atomic::AtomicI64,
}

/// The store's runtime, shut down without waiting when the store goes (which may be on another
/// runtime's thread, where waiting is not allowed).
struct OwnRuntime(Option<tokio::runtime::Runtime>);

impl OwnRuntime {
    fn start() -> Result<OwnRuntime, PgError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("pg-store")
            .enable_all()
            .build()
            .map_err(|e| PgError::Url(format!("cannot start the store's runtime: {e}")))?;
        Ok(OwnRuntime(Some(runtime)))
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        match &self.0 {
            Some(runtime) => runtime.handle(),
            // Only taken in Drop.
            None => unreachable!("the store's runtime is gone while the store is in use"),
        }
    }
}

/// Why a store is opened.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Opening {
    /// For the daemon or an offline command: a database a copy left incomplete is refused.
    Store,
    /// For a copy's loader, which marks the database incomplete until it is done.
    Copy,
}

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

impl PgStore {
    /// Connect, migrate the schema, and keep a pool. A database that cannot be reached, refuses
    /// the login or holds a newer schema is an error naming the masked URL, never its password.
    pub fn open(options: &PgOptions, clock: model::clock::Clock) -> Result<PgStore, StoreError> {
        Self::open_as(options, clock, Opening::Store)
    }

    /// [`open`](Self::open) for `purpose`: a copy's loader opens a database its copy left
    /// incomplete, which a store refuses.
    fn open_as(
        options: &PgOptions,
        clock: model::clock::Clock,
        purpose: Opening,
    ) -> Result<PgStore, StoreError> {
        let masked = options.masked_url();
        let failed = |e: PgError| match e {
            PgError::TooNew { .. } => StoreError::from(e),
            e => StoreError::Open {
                path: masked.clone(),
                source: BackendError::new(e, false),
            },
        };
        let runtime = OwnRuntime::start().map_err(failed)?;
        let pool = connect::pool(options).map_err(failed)?;
        let migrating = pool.clone();
        let locks = run_on(runtime.handle(), CALL_TIMEOUT, async move {
            let mut client = migrating.get().await?;
            let locks = schema::migrate(&mut client).await?;
            if purpose == Opening::Store {
                load::refuse_incomplete(&client).await?;
            }
            Ok(locks)
        })
        .map_err(failed)?;
        Ok(PgStore(Arc::new(Inner {
            pool,
            runtime,
            clock,
            locks,
            fold_lock: Mutex::new(fold::HeldQueues::default()),
            timer_wakeup: Arc::default(),
            writer_from: Mutex::new(None),
            fail_next_commit: AtomicBool::new(false),
            queue_held: std::sync::atomic::AtomicUsize::new(fold::QUEUE_HELD),
            fence: Mutex::default(),
            call_timeout_ms: std::sync::atomic::AtomicU64::new(CALL_TIMEOUT.as_millis() as u64),
            delete_chunk: std::sync::atomic::AtomicI64::new(retention::DELETE_CHUNK),
        })))
    }

    /// Fold sessions hold waiting queues in memory only up to `n` entries over all bots (tests:
    /// 0 asks the database for every standing, the path of longer queues).
    #[cfg(feature = "test-support")]
    pub fn hold_queues_up_to(&self, n: usize) {
        self.0
            .queue_held
            .store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Port calls wait at most `limit` for the database, not [`CALL_TIMEOUT`] (tests of work
    /// that must fit one call's time).
    #[cfg(feature = "test-support")]
    pub fn set_call_timeout(&self, limit: Duration) {
        let ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
        self.0
            .call_timeout_ms
            .store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// Retention's `DELETE`s (events, deliveries) remove at most `rows` per chunk, not
    /// `retention::DELETE_CHUNK` (tests of many chunks on a small store).
    #[cfg(feature = "test-support")]
    pub fn set_delete_chunk(&self, rows: i64) {
        self.0
            .delete_chunk
            .store(rows.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// The next fold commit fails before it commits, writing nothing (tests of a failing store).
    pub fn fail_next_commit(&self) {
        self.0
            .fail_next_commit
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Run `work` on the store's runtime and wait for it, within [`CALL_TIMEOUT`].
    fn block<T, F>(&self, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, PgError>> + Send + 'static,
    {
        let limit = self
            .0
            .call_timeout_ms
            .load(std::sync::atomic::Ordering::Relaxed);
        run_on(self.handle(), Duration::from_millis(limit), work).map_err(StoreError::from)
    }

    /// `work` with a pooled connection, on the store's runtime.
    fn with_client<T, F, Fut>(&self, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(Object) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, PgError>> + Send,
    {
        let pool = self.0.pool.clone();
        self.block(async move { work(pool.get().await?).await })
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        self.0.runtime.handle()
    }

    /// The fold lock for a write beside the folds of what they write (a retention pass): the
    /// queues they hold are forgotten, since the write may change them.
    fn fold_guard(&self) -> MutexGuard<'_, fold::HeldQueues> {
        let mut guard = self.fold_guard_keeping();
        guard.forget();
        guard
    }

    /// The fold lock for a fold session or the watermark, the queues held kept.
    fn fold_guard_keeping(&self) -> MutexGuard<'_, fold::HeldQueues> {
        // The queues are changed whole under the lock: a panic leaves them as they were.
        self.0
            .fold_lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Begin a transaction of the active's work (a fold's commit, an outbox outcome, retention, the
/// watermark...), refused unless this node still holds its epoch of the lease ([`lease::check`],
/// the row key-share-locked to the commit).
async fn begin_active<'c>(
    client: &'c mut Object,
    active: &lease::Active,
) -> Result<deadpool_postgres::Transaction<'c>, PgError> {
    let tx = client.transaction().await?;
    lease::check(&tx, active).await?;
    Ok(tx)
}

/// Spawn `work` on `handle` and wait for it on a plain channel, at most `limit` (safe on any
/// thread but one of this runtime's own, where no caller is: the store's runtime runs only the
/// store's futures).
fn run_on<T, F>(handle: &tokio::runtime::Handle, limit: Duration, work: F) -> Result<T, PgError>
where
    T: Send + 'static,
    F: Future<Output = Result<T, PgError>> + Send + 'static,
{
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    handle.spawn(async move {
        let out = tokio::time::timeout(limit, work)
            .await
            .unwrap_or(Err(PgError::Timeout));
        let _ = tx.send(out);
    });
    rx.recv()
        .map_err(|_| PgError::Internal("the store's runtime stopped"))?
}

impl storage::port::Lifecycle for PgStore {
    fn clock(&self) -> &model::clock::Clock {
        &self.0.clock
    }

    /// Every commit is durable already (`synchronous_commit = on`).
    fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// The size of this store's tables, indexes and TOAST.
    fn bytes_on_disk(&self) -> Result<u64, StoreError> {
        self.with_client(|client| async move {
            let row = client
                .row(
                    "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint \
                     FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                     WHERE n.nspname = current_schema() AND c.relkind = 'r'",
                    &[],
                )
                .await?;
            Ok(u64::try_from(row.get::<_, i64>(0)).unwrap_or(0))
        })
    }

    /// A probe write.
    fn takes_writes(&self) -> bool {
        self.with_client(|client| async move {
            client
                .exec("UPDATE meta SET value = value WHERE key = 'fold_from'", &[])
                .await?;
            Ok(())
        })
        .is_ok()
    }

    fn start_background(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
