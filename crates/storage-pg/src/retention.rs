//! Retention: bounded `DELETE` passes that never remove what a fold, the dedupe window or an open
//! outbox entry still needs. Every pass goes a chunk at a time, each chunk one transaction and
//! one port call (so a call's timeout bounds a chunk, whatever the store's size); states are
//! judged and removed under the fold lock (the in-process one and the advisory one).

use crate::lease::Active;
use crate::outbox::add_counts;
use crate::prepared::Prepared;
use crate::rows::{big, parse, seq_of};
use crate::{begin_active, PgError, PgStore};
use engine::state::EndUserState;
use model::cursor::Cursor;
use model::webhook::model::Millis;
use std::collections::{BTreeMap, HashSet};
use storage::port::{Removed, Retention};
use storage::retention::StatesPruned;
use storage::{Pruned, StoreError};

/// Rows one chunk of the events' and deliveries' `DELETE`s removes at most (the store's
/// `delete_chunk`, which tests lower).
pub(crate) const DELETE_CHUNK: i64 = 10_000;

/// Whether a state of partition `p` (an SQL expression) is still needed: its mark at or past the
/// watermark (`$1`), an event of it there, or an outbox entry pending in one of its queues.
fn busy(partition: &str, queues: &str) -> String {
    format!(
        "(EXISTS (SELECT 1 FROM folded f WHERE f.partition = {partition} AND f.mark >= $1) \
         OR EXISTS (SELECT 1 FROM events e WHERE e.partition = {partition} AND e.seq >= $1) \
         OR EXISTS (SELECT 1 FROM outbox o WHERE o.queue IN ({queues})))"
    )
}

/// One chunk of `sql` (a `DELETE` taking `$1` = the chunk, `$2` = the bound, and `$3` = `more`):
/// a transaction of the active's work (fenced), adding `-removed` to the count `count` names in
/// it; how many it removed.
async fn delete_chunk(
    c: &mut deadpool_postgres::Object,
    active: &Active,
    (sql, count): (&str, Option<&'static str>),
    (chunk, bound, more): (i64, i64, Option<i64>),
) -> Result<u64, PgError> {
    let tx = begin_active(c, active).await?;
    let n = match more {
        Some(more) => tx.exec(sql, &[&chunk, &bound, &more]).await?,
        None => tx.exec(sql, &[&chunk, &bound]).await?,
    };
    if let Some(count) = count {
        add_counts(&tx, &[(count, -(n as i64))]).await?;
    }
    tx.commit().await?;
    Ok(n)
}

/// One chunk of conversations past `before` after `after`: removed when idle; the last one
/// judged (`None`: none left).
async fn conversations_chunk(
    c: &mut deadpool_postgres::Object,
    (active, fold_lock, before, chunk): (&Active, i64, Millis, i64),
    after: &(Millis, String),
    out: &mut StatesPruned,
) -> Result<Option<(Millis, String)>, PgError> {
    let tx = begin_active(c, active).await?;
    tx.exec("SELECT pg_advisory_xact_lock($1)", &[&fold_lock])
        .await?;
    let sql = format!(
        "SELECT c.id, c.activity_at, {} FROM conversations c \
         WHERE c.activity_at < $2 AND (c.activity_at, c.id) > ($3, $4) \
         ORDER BY c.activity_at, c.id LIMIT $5",
        busy("'c:' || c.id", "'c:' || c.id, 'helpdesk:' || c.id")
    );
    let fold_from: i64 = tx
        .row("SELECT value FROM meta WHERE key = 'fold_from'", &[])
        .await?
        .get(0);
    let rows = tx
        .rows(&sql, &[&fold_from, &before, &after.0, &after.1, &chunk])
        .await?;
    let last = rows.last().map(|r| (r.get(1), r.get(0)));
    let idle: Vec<String> = rows
        .iter()
        .filter(|r| !r.get::<_, bool>(2))
        .map(|r| r.get(0))
        .collect();
    out.skipped += (rows.len() - idle.len()) as u64;
    if !idle.is_empty() {
        out.chunks += 1;
        let marks: Vec<String> = idle.iter().map(|id| format!("c:{id}")).collect();
        tx.exec("DELETE FROM conversations WHERE id = ANY($1)", &[&idle])
            .await?;
        tx.exec("DELETE FROM folded WHERE partition = ANY($1)", &[&marks])
            .await?;
        tx.exec("DELETE FROM derived WHERE conversation = ANY($1)", &[&idle])
            .await?;
        let timers = tx
            .exec("DELETE FROM timers WHERE conversation = ANY($1)", &[&idle])
            .await?;
        let left = tx
            .rows(
                "DELETE FROM waiting WHERE conversation = ANY($1) RETURNING bot",
                &[&idle],
            )
            .await?;
        let mut per_bot: BTreeMap<String, i64> = BTreeMap::new();
        for row in &left {
            *per_bot.entry(row.get(0)).or_default() -= 1;
        }
        let (bots, deltas): (Vec<String>, Vec<i64>) = per_bot.into_iter().unzip();
        tx.exec(
            "UPDATE waiting_bots b SET waiting = b.waiting + d.delta \
             FROM unnest($1::text[], $2::bigint[]) AS d(bot, delta) WHERE b.bot = d.bot",
            &[&bots, &deltas],
        )
        .await?;
        let counts = [
            ("conversations", -(idle.len() as i64)),
            ("timers", -(timers as i64)),
        ];
        add_counts(&tx, &counts).await?;
        out.conversations += idle.len() as u64;
        out.timers += timers;
    }
    tx.commit().await?;
    Ok(last)
}

/// One chunk of end users past `before` after `after` (see [`conversations_chunk`]); a user whose
/// last conversation is kept stays too.
async fn end_users_chunk(
    c: &mut deadpool_postgres::Object,
    (active, fold_lock, before, chunk): (&Active, i64, Millis, i64),
    after: &(Millis, String),
    out: &mut StatesPruned,
) -> Result<Option<(Millis, String)>, PgError> {
    let tx = begin_active(c, active).await?;
    tx.exec("SELECT pg_advisory_xact_lock($1)", &[&fold_lock])
        .await?;
    let sql = format!(
        "SELECT u.id, u.activity_at, {}, u.state FROM end_users u \
         WHERE u.activity_at < $2 AND (u.activity_at, u.id) > ($3, $4) \
         ORDER BY u.activity_at, u.id LIMIT $5",
        busy("'u:' || u.id", "'u:' || u.id")
    );
    let fold_from: i64 = tx
        .row("SELECT value FROM meta WHERE key = 'fold_from'", &[])
        .await?
        .get(0);
    let rows = tx
        .rows(&sql, &[&fold_from, &before, &after.0, &after.1, &chunk])
        .await?;
    let last = rows.last().map(|r| (r.get(1), r.get(0)));
    let mut candidates = Vec::new();
    for row in rows.iter().filter(|r| !r.get::<_, bool>(2)) {
        let user: EndUserState = parse(row.get(3), "end-user state")?;
        let last = user
            .last_conversation_id
            .value
            .map(|c| c.as_str().to_owned());
        candidates.push((row.get::<_, String>(0), last));
    }
    let lasts: Vec<&str> = candidates
        .iter()
        .filter_map(|(_, l)| l.as_deref())
        .collect();
    let kept: HashSet<String> = tx
        .rows("SELECT id FROM conversations WHERE id = ANY($1)", &[&lasts])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let idle: Vec<String> = candidates
        .into_iter()
        .filter(|(_, l)| l.as_ref().is_none_or(|l| !kept.contains(l)))
        .map(|(id, _)| id)
        .collect();
    out.skipped += (rows.len() - idle.len()) as u64;
    if !idle.is_empty() {
        out.chunks += 1;
        let marks: Vec<String> = idle.iter().map(|id| format!("u:{id}")).collect();
        tx.exec("DELETE FROM end_users WHERE id = ANY($1)", &[&idle])
            .await?;
        tx.exec("DELETE FROM folded WHERE partition = ANY($1)", &[&marks])
            .await?;
        add_counts(&tx, &[("end_users", -(idle.len() as i64))]).await?;
        out.end_users += idle.len() as u64;
    }
    tx.commit().await?;
    Ok(last)
}

impl PgStore {
    /// Chunks of `judge` until none is left, each under the fold lock.
    fn prune_chunks(
        &self,
        before: Millis,
        chunk: usize,
        conversations: bool,
        out: &mut StatesPruned,
    ) -> Result<(), StoreError> {
        let mut after = (i64::MIN, String::new());
        loop {
            let _folding = self.fold_guard();
            let (fold, active) = (self.0.locks.fold, self.active());
            let (from, mut pruned) = (after.clone(), *out);
            let (last, pruned) = self.with_client(move |mut c| async move {
                let args = (&active, fold, before, big(chunk.max(1) as u64));
                let last = match conversations {
                    true => conversations_chunk(&mut c, args, &from, &mut pruned).await?,
                    false => end_users_chunk(&mut c, args, &from, &mut pruned).await?,
                };
                Ok((last, pruned))
            })?;
            *out = pruned;
            match last {
                Some(last) => after = last,
                None => return Ok(()),
            }
        }
    }

    /// A bounded delete of `sql` (`$1` the chunk, `$2` the bound, `$3` `more`): chunks until one
    /// removes fewer than `chunk`, each a fenced transaction and a port call of its own (so
    /// [`CALL_TIMEOUT`](crate::CALL_TIMEOUT) bounds a chunk, never the pass: the 2,110,000
    /// events of 1,000,000 conversations take 17 s of its 30 on a quiet machine, issue 38),
    /// `count` (a count in `meta`) lowered with each; what the committed chunks removed, and how
    /// it ended.
    fn delete_passes(
        &self,
        (sql, count): (&'static str, Option<&'static str>),
        (chunk, bound, more): (i64, i64, Option<i64>),
    ) -> Removed<u64> {
        let mut removed = 0;
        loop {
            let active = self.active();
            let n = self.with_client(move |mut c| async move {
                delete_chunk(&mut c, &active, (sql, count), (chunk, bound, more)).await
            });
            match n {
                Ok(n) if n < chunk as u64 => {
                    return Removed {
                        removed: removed + n,
                        failed: None,
                    }
                }
                Ok(n) => removed += n,
                Err(e) => {
                    return Removed {
                        removed,
                        failed: Some(e),
                    }
                }
            }
        }
    }

    /// Rows one chunk of the events' and deliveries' `DELETE`s removes at most.
    fn delete_chunk_rows(&self) -> i64 {
        self.0
            .delete_chunk
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Retention for PgStore {
    fn prune_events(
        &self,
        dedupe_before: Millis,
        events_before: Millis,
        fold_from: Cursor,
    ) -> Result<Pruned, StoreError> {
        let deliveries = self
            .delete_passes(
                (
                    "DELETE FROM deliveries WHERE id IN \
                 (SELECT id FROM deliveries WHERE received_at < $2 LIMIT $1)",
                    None,
                ),
                (self.delete_chunk_rows(), dedupe_before, None),
            )
            .into_result()?;
        let below = big(seq_of(fold_from));
        let until = events_before.min(dedupe_before);
        let events = self
            .delete_passes(
                (
                    "DELETE FROM events WHERE seq IN (SELECT seq FROM events \
                 WHERE seq < $2 AND received_at < $3 ORDER BY seq LIMIT $1)",
                    None,
                ),
                (self.delete_chunk_rows(), below, Some(until)),
            )
            .into_result()?;
        Ok(Pruned {
            ids_forgotten: deliveries + events,
            event_chunks: events,
        })
    }

    fn prune_states(&self, before: Millis, chunk: usize) -> Removed<StatesPruned> {
        let mut removed = StatesPruned::default();
        let failed = self
            .prune_chunks(before, chunk, true, &mut removed)
            .and_then(|()| self.prune_chunks(before, chunk, false, &mut removed))
            .err();
        Removed { removed, failed }
    }

    fn prune_quarantine(&self, before: Millis, chunk: usize) -> Removed<u64> {
        let chunk = big(chunk.max(1) as u64);
        self.delete_passes(
            (
                "DELETE FROM quarantine WHERE id IN (SELECT id FROM quarantine \
                 WHERE received_at < $2 ORDER BY id LIMIT $1)",
                Some("quarantine"),
            ),
            (chunk, before, None),
        )
    }

    fn prune_ledger(&self, before: Millis, limit: usize) -> Result<(u64, u64), StoreError> {
        let (limit, active) = (big(limit as u64), self.active());
        self.with_client(move |mut c| async move {
            let tx = begin_active(&mut c, &active).await?;
            let ledger = tx
                .exec(
                    "DELETE FROM ledger WHERE id IN (SELECT id FROM ledger \
                     WHERE state IN ('done', 'dropped') AND at < $1 LIMIT $2)",
                    &[&before, &limit],
                )
                .await?;
            let done = tx
                .exec(
                    "DELETE FROM outbox_done WHERE seq IN (SELECT seq FROM outbox_done \
                     WHERE at < $1 ORDER BY seq LIMIT $2)",
                    &[&before, &limit],
                )
                .await?;
            tx.commit().await?;
            Ok((ledger, done))
        })
    }

    fn prune_idempotency(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        self.delete_passes(
            (
                "DELETE FROM idempotency WHERE (route, key) IN (SELECT route, key FROM idempotency \
                 WHERE at < $2 LIMIT $1)",
                None,
            ),
            (big(limit.max(1) as u64), before, None),
        )
        .into_result()
    }

    fn prune_operator_actions(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        self.delete_passes(
            (
                "DELETE FROM operator_actions WHERE id IN (SELECT id FROM operator_actions \
                 WHERE at < $2 ORDER BY id LIMIT $1)",
                None,
            ),
            (big(limit.max(1) as u64), before, None),
        )
        .into_result()
    }

    fn prune_handoff_stats(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        let _folding = self.fold_guard();
        let (hour, limit, lock) = (
            engine::state::stats::hour_of(before),
            big(limit as u64),
            self.0.locks.fold,
        );
        let active = self.active();
        self.with_client(move |mut c| async move {
            let tx = begin_active(&mut c, &active).await?;
            tx.exec("SELECT pg_advisory_xact_lock($1)", &[&lock])
                .await?;
            let n = tx
                .exec(
                    "DELETE FROM hour_stats WHERE hour IN (SELECT hour FROM hour_stats \
                     WHERE hour < $1 ORDER BY hour LIMIT $2)",
                    &[&hour, &limit],
                )
                .await?;
            tx.commit().await?;
            Ok(n)
        })
    }

    fn oldest_event_received_at(&self) -> Result<Option<Millis>, StoreError> {
        self.with_client(|c| async move {
            Ok(c.row("SELECT min(received_at) FROM events", &[])
                .await?
                .get(0))
        })
    }
}
