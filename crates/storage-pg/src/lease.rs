//! The lease of several nodes on one database (`storage::lease::Lease`): one `lease` row (holder,
//! epoch, expiry), a `nodes` row per node seen, an `outbox_started` row per outbox entry begun.
//!
//! **Time.** Expiry is judged by the database's clock, never a node's: every time here is
//! `clock_timestamp()` in milliseconds, plus the application's test-clock offset (0 unless an
//! operator rehearsing a handoff moved it; `model::clock::Clock`), so nodes whose clocks drift
//! agree on who holds the lease.
//!
//! **Fencing.** Each handle keeps the epoch its node holds ([`Fence`]). Every transaction of the
//! active's work begins with [`check`]: it reads the lease row `FOR KEY SHARE` and refuses
//! ([`PgError::Fenced`]) unless this node holds that epoch and it has not run out. The lock is
//! held to the commit, and a takeover locks the row `FOR UPDATE` before it writes a new epoch,
//! which waits for every transaction that passed the check: no write of an old epoch commits
//! after a new epoch began (one that passed its check before the lease ran out may still commit
//! after, but before any new epoch). A renewal locks the row only `FOR NO KEY UPDATE`, which a
//! check's lock does not conflict with: renewing waits for none of the active's transactions,
//! nor they for it. A node paused in the middle of such a transaction holds the row until the
//! database ends its session: the check sets the transaction's
//! `idle_in_transaction_session_timeout` to a third of the lease ([`idle_limit`]; every
//! connection has 5 s besides), and a claim waits for the row at most [`CLAIM_LOCK_TIMEOUT`], so
//! a paused node's session is gone before its lease runs out and it delays no takeover. A
//! fold's transaction begins with the same check in the text of its first round trip
//! ([`begin_fold`]); the begin marks ([`Lease::outbox_started`], one batch before each round of
//! calls) are one statement, the same check a CTE of it: no transaction left open.

use crate::prepared::{Params, Prepared};
use crate::rows::{big, num};
use crate::{PgError, PgStore};
use deadpool_postgres::GenericClient;
use model::webhook::model::Millis;
use std::time::Duration;
use storage::lease::{Lease, LeaseState, NodeSeen, Start};
use storage::StoreError;

/// How long a claim waits for the lease row (held `FOR KEY SHARE` by the active's transactions).
pub(crate) const CLAIM_LOCK_TIMEOUT: &str = "2s";

/// The database's time in milliseconds plus the test clock's offset (`$1`).
const DB_NOW: &str = "((extract(epoch from clock_timestamp()) * 1000)::bigint + $1)";

/// What a handle holds of the lease.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum Fence {
    /// It never claimed the lease: one process alone (offline tools, tests), not fenced.
    #[default]
    Unclaimed,
    /// It claimed and holds none (a standby), or gave it up.
    Standby,
    /// `node` holds `epoch`, claimed for `ttl` milliseconds at a time.
    Holds {
        node: String,
        epoch: u64,
        ttl: Millis,
    },
}

/// What a transaction of the active's work checks, taken from the handle when it begins.
#[derive(Clone, Debug)]
pub(crate) struct Active {
    fence: Fence,
    offset: Millis,
}

impl Active {
    /// The epoch this node holds (`None`: never claimed, or a standby).
    pub(crate) fn epoch(&self) -> Option<u64> {
        match self.fence {
            Fence::Holds { epoch, .. } => Some(epoch),
            _ => None,
        }
    }
}

impl PgStore {
    /// The check the next transaction of the active's work makes.
    pub(crate) fn active(&self) -> Active {
        Active {
            fence: self.fence().clone(),
            offset: self.0.clock.offset_millis(),
        }
    }

    fn fence(&self) -> std::sync::MutexGuard<'_, Fence> {
        self.0.fence.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Refuse the transaction `tx` unless its node still holds the epoch it claimed (see the
/// module's docs); the lease row stays key-share-locked until `tx` ends.
pub(crate) async fn check(tx: &impl GenericClient, active: &Active) -> Result<(), PgError> {
    let (node, epoch, ttl) = match &active.fence {
        Fence::Unclaimed => return Ok(()),
        Fence::Standby => return Err(PgError::Fenced),
        Fence::Holds { node, epoch, ttl } => (node, *epoch, *ttl),
    };
    let sql = format!(
        "SELECT holder = $2 AND epoch = $3 AND expires_at > {DB_NOW}, \
         set_config('idle_in_transaction_session_timeout', $4, true) FROM lease WHERE id = 1 \
         FOR KEY SHARE"
    );
    let limit = format!("{}ms", idle_limit(ttl));
    let row = tx
        .row(&sql, &[&active.offset, node, &big(epoch), &limit])
        .await?;
    match row.get::<_, Option<bool>>(0) {
        Some(true) => Ok(()),
        _ => Err(PgError::Fenced),
    }
}

/// Begin a fold's transaction: `BEGIN`, the fold lock (`lock`) and [`check`] in one round trip
/// (a simple query of three statements, the values written into its text), since the folds are
/// serialised and each round trip of theirs caps the rate. A node whose name is not plain
/// (`A-Z a-z 0-9 - _ . :`, which needs no quoting) takes two round trips instead.
pub(crate) async fn begin_fold(
    c: &deadpool_postgres::Object,
    lock: i64,
    active: &Active,
) -> Result<(), PgError> {
    let begin =
        format!("BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_advisory_xact_lock({lock})");
    let (node, epoch, ttl) = match &active.fence {
        Fence::Holds { node, epoch, ttl } if plain(node) => (node, *epoch, *ttl),
        _ => {
            c.batch_execute(&begin).await?;
            return check(c, active).await;
        }
    };
    let now = DB_NOW.replace("$1", &active.offset.to_string());
    let sql = format!(
        "{begin}; SELECT holder = '{node}' AND epoch = {epoch} AND expires_at > {now}, \
         set_config('idle_in_transaction_session_timeout', '{limit}ms', true) FROM lease \
         WHERE id = 1 FOR KEY SHARE",
        limit = idle_limit(ttl)
    );
    // The last row is the check's (the lock's row comes before it).
    let held = c
        .simple_query(&sql)
        .await?
        .iter()
        .rev()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => Some(row.get(0) == Some("t")),
            _ => None,
        });
    match held {
        Some(true) => Ok(()),
        _ => Err(PgError::Fenced),
    }
}

/// Whether `text` can stand in a SQL string literal as it is.
fn plain(text: &str) -> bool {
    text.bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

/// [`Lease::outbox_started`]'s one statement (no transaction held open, one round trip): the
/// lease check of [`check`] as a CTE whose row the insert needs, so nothing is marked unless
/// this node holds epoch `$3` (`$2` its node, `$1` the test clock's offset). Its rows: whether
/// the lease was held, then each marked entry (`$4`) with the epoch that had begun it before
/// (the subquery in RETURNING reads the rows as they were before the statement); one row of
/// nulls after the flag when none was marked.
fn started_sql() -> String {
    format!(
        "WITH ok AS (SELECT 1 FROM lease WHERE id = 1 AND holder = $2 AND epoch = $3 \
         AND expires_at > {DB_NOW} FOR KEY SHARE), \
         marked AS (INSERT INTO outbox_started (seq, epoch) \
         SELECT seq, $3 FROM outbox WHERE seq = ANY($4) AND EXISTS (SELECT 1 FROM ok) \
         ON CONFLICT (seq) DO UPDATE SET epoch = excluded.epoch \
         RETURNING seq, \
         (SELECT s.epoch FROM outbox_started s WHERE s.seq = outbox_started.seq) AS before) \
         SELECT EXISTS (SELECT 1 FROM ok), m.seq, m.before \
         FROM (SELECT 1) AS one LEFT JOIN marked AS m ON true"
    )
}

/// How long a transaction of the active's work may sit idle before the database ends its session:
/// a third of the lease (at least 100 ms, at most the connections' 5 s). A node paused in the
/// middle of one thus lets go of the lease row before its lease runs out, and a takeover waits
/// for nothing but the lease. The active's transactions make no call outside the database, so
/// they are never idle that long unless their node stopped.
fn idle_limit(ttl: Millis) -> Millis {
    (ttl / 3).clamp(100, 5_000)
}

fn state(row: &tokio_postgres::Row) -> LeaseState {
    LeaseState {
        holder: row.get(0),
        epoch: num(row.get(1)),
        expires_at: row.get(2),
    }
}

/// Claim or renew for `node` in one transaction: acquired (a new epoch) when free or run out,
/// renewed when `node` holds it; the lease as it then stands. The row is locked `FOR NO KEY
/// UPDATE` (claims wait for each other, not for the active's checks); a new epoch locks it
/// `FOR UPDATE` too, waiting for the transactions that passed a check of the old one.
async fn claim(
    client: &mut deadpool_postgres::Object,
    (node, ttl, offset): (&str, Millis, Millis),
) -> Result<LeaseState, PgError> {
    let tx = client.transaction().await?;
    tx.batch_execute(&format!("SET LOCAL lock_timeout = '{CLAIM_LOCK_TIMEOUT}'"))
        .await?;
    let sql = format!(
        "SELECT holder, epoch, expires_at, {DB_NOW} FROM lease WHERE id = 1 FOR NO KEY UPDATE"
    );
    let row = tx.row(&sql, &[&offset]).await?;
    let (found, now): (LeaseState, Millis) = (state(&row), row.get(3));
    let new_epoch = found.holder.is_none() || now >= found.expires_at;
    let holds = new_epoch || found.holder.as_deref() == Some(node);
    if !holds {
        return Ok(found);
    }
    let epoch = match new_epoch {
        true => {
            // Wait for the old epoch's transactions (their checks hold the row FOR KEY SHARE).
            tx.exec("SELECT 1 FROM lease WHERE id = 1 FOR UPDATE", &[])
                .await?;
            found.epoch + 1
        }
        false => found.epoch,
    };
    let row = tx
        .row(
            "UPDATE lease SET holder = $1, epoch = $2, expires_at = $3 WHERE id = 1 \
             RETURNING holder, epoch, expires_at",
            &[&node, &big(epoch), &now.saturating_add(ttl)],
        )
        .await?;
    tx.commit().await?;
    Ok(state(&row))
}

impl Lease for PgStore {
    fn shared(&self) -> bool {
        true
    }

    fn claim(&self, node: &str, ttl: Duration) -> Result<LeaseState, StoreError> {
        let ttl = Millis::try_from(ttl.as_millis()).unwrap_or(Millis::MAX);
        let (owned, offset) = (node.to_owned(), self.0.clock.offset_millis());
        let found = self
            .with_client(move |mut c| async move { claim(&mut c, (&owned, ttl, offset)).await });
        // A failed claim holds nothing for sure: fenced until a claim succeeds.
        *self.fence() = match &found {
            Ok(s) if s.holder.as_deref() == Some(node) => Fence::Holds {
                node: node.to_owned(),
                epoch: s.epoch,
                ttl,
            },
            _ => Fence::Standby,
        };
        found
    }

    fn release(&self, node: &str) -> Result<(), StoreError> {
        *self.fence() = Fence::Standby;
        let node = node.to_owned();
        self.with_client(move |c| async move {
            c.exec(
                "UPDATE lease SET holder = NULL, expires_at = 0 WHERE id = 1 AND holder = $1",
                &[&node],
            )
            .await?;
            Ok(())
        })
    }

    fn lease(&self) -> Result<LeaseState, StoreError> {
        self.with_client(|c| async move {
            let row = c
                .row(
                    "SELECT holder, epoch, expires_at FROM lease WHERE id = 1",
                    &[],
                )
                .await?;
            Ok(state(&row))
        })
    }

    fn held_epoch(&self) -> Option<u64> {
        match &*self.fence() {
            Fence::Holds { epoch, .. } => Some(*epoch),
            Fence::Unclaimed | Fence::Standby => None,
        }
    }

    fn note_seen(&self, node: &str) -> Result<(), StoreError> {
        let (node, offset) = (node.to_owned(), self.0.clock.offset_millis());
        self.with_client(move |c| async move {
            let sql = format!(
                "INSERT INTO nodes (node, seen_at) VALUES ($2, {DB_NOW}) \
                 ON CONFLICT (node) DO UPDATE SET seen_at = excluded.seen_at"
            );
            c.exec(&sql, &[&offset, &node]).await?;
            Ok(())
        })
    }

    fn nodes_seen(&self, since: Millis) -> Result<Vec<NodeSeen>, StoreError> {
        self.with_client(move |c| async move {
            let rows = c
                .rows(
                    "SELECT node, seen_at FROM nodes WHERE seen_at >= $1 ORDER BY node",
                    &[&since],
                )
                .await?;
            Ok(rows
                .iter()
                .map(|r| NodeSeen {
                    node: r.get(0),
                    seen_at: r.get(1),
                })
                .collect())
        })
    }

    /// One transaction, one statement, for the whole batch.
    fn outbox_started(&self, seqs: &[u64]) -> Result<Vec<Start>, StoreError> {
        let Active { fence, offset } = self.active();
        let (node, epoch) = match fence {
            Fence::Holds { node, epoch, .. } => (node, epoch),
            // Never claimed: one process alone, nothing to tell apart.
            Fence::Unclaimed => return Ok(vec![Start::First; seqs.len()]),
            Fence::Standby => return Err(StoreError::Fenced),
        };
        let wanted: Vec<i64> = seqs.iter().map(|&seq| big(seq)).collect();
        let before = self.with_client(move |c| async move {
            let params: Params<'_> = &[&offset, &node, &big(epoch), &wanted];
            let rows = c.rows(&started_sql(), params).await?;
            if !rows.first().is_some_and(|r| r.get::<_, bool>(0)) {
                return Err(PgError::Fenced);
            }
            let before: std::collections::HashMap<u64, u64> = rows
                .iter()
                .filter_map(|r| {
                    let seq = r.get::<_, Option<i64>>(1)?;
                    Some((num(seq), num(r.get::<_, Option<i64>>(2)?)))
                })
                .collect();
            Ok(before)
        })?;
        Ok(seqs
            .iter()
            .map(|seq| match before.get(seq) {
                Some(&earlier) if earlier < epoch => Start::Replay { epoch: earlier },
                _ => Start::First,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_plain_name_needs_no_quoting_and_nothing_else_is_plain() {
        assert!(super::plain("node-a.eu_1:2"));
        for name in ["a'b", "a b", "a\\b", "é", "a;b", "a$b"] {
            assert!(!super::plain(name), "{name:?}");
        }
    }
}
