//! A fold's write set committed (outbox entries numbered inside the serialised fold
//! transaction, then every table written in pipelined statements), the outbox and its outcomes,
//! and the timers.

use crate::fold::state_json;
use crate::intake::draw;
use crate::prepared::Prepared;
use crate::rows::{big, json, num, parse};
use crate::{begin_active, PgError, PgStore};
use deadpool_postgres::{GenericClient, Object};
use engine::batch::{IndexChanges, PartitionWrite, QueueChanges, StateWrite, TimerChanges};
use engine::index::{conversation_activity, end_user_activity, Derived};
use engine::state::{BotState, ConversationState, EndUserState};
use model::action::{DeadLetter, DoneRecord, OutboxEntry, RetryState};
use model::cursor::Cursor;
use model::ids::ConversationId;
use model::webhook::model::{Millis, TimerFiring};
use std::collections::BTreeMap;
use std::sync::Arc;
use storage::outbox::ActionStatus;
use storage::port::{Outbox, Timers};
use storage::timers::{DueTimer, TimerKey, TimerWakeup};
use storage::{Applied, StoreError};

/// Commit a write set's writes in the session's transaction (not the COMMIT itself).
pub(crate) async fn commit_writes(
    c: &Object,
    writes: engine::batch::WriteSet,
) -> Result<Applied, PgError> {
    let engine::batch::WriteSet {
        conversations,
        end_users,
        bots,
        partitions,
        fold_from,
        derived,
        timers,
        queue,
        mut applied,
        ..
    } = writes;
    let seqs = draw(c, "outbox_seq", applied.outbox.len()).await?;
    for (entry, seq) in applied.outbox.iter_mut().zip(seqs) {
        entry.seq = seq;
    }
    let created = |n: usize| big(n as u64);
    let counts = [
        (
            "conversations",
            created(conversations.iter().filter(|w| w.created).count()),
        ),
        (
            "end_users",
            created(end_users.iter().filter(|w| w.created).count()),
        ),
        ("bots", created(bots.iter().filter(|w| w.created).count())),
        ("timers", applied.timers_change),
        ("outbox", created(applied.outbox.len())),
    ];
    tokio::try_join!(
        insert_decided(c, &applied.outbox),
        write_conversations(c, &conversations),
        write_end_users(c, &end_users),
        write_bots(c, &bots),
        write_marks(c, &partitions, fold_from),
        write_derived(c, &derived),
        write_timers(c, &timers),
        write_queue(c, &queue),
        add_counts(c, &counts),
    )?;
    Ok(applied)
}

/// Add to the counters in `meta`.
pub(crate) async fn add_counts(
    c: &impl GenericClient,
    counts: &[(&str, i64)],
) -> Result<(), PgError> {
    let (keys, deltas): (Vec<&str>, Vec<i64>) =
        counts.iter().filter(|(_, d)| *d != 0).copied().unzip();
    if keys.is_empty() {
        return Ok(());
    }
    c.exec(
        "UPDATE meta SET value = value + d.delta FROM unnest($1::text[], $2::bigint[]) \
         AS d(key, delta) WHERE meta.key = d.key",
        &[&keys, &deltas],
    )
    .await?;
    Ok(())
}

/// Decided entries into the outbox, each with its `pending` ledger row.
async fn insert_decided(c: &Object, entries: &[OutboxEntry]) -> Result<(), PgError> {
    if entries.is_empty() {
        return Ok(());
    }
    let (mut seqs, mut queues, mut texts) = (Vec::new(), Vec::new(), Vec::new());
    let (mut ids, mut events, mut ats, mut statuses) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for e in entries {
        seqs.push(big(e.seq));
        queues.push(e.queue.as_str());
        texts.push(json(e)?);
        ids.push(e.id.as_str());
        events.push(e.event_id.as_str());
        ats.push(e.decided_at);
        statuses.push(json(&ActionStatus::pending(e.seq, e.decided_at))?);
    }
    c.exec(
        "INSERT INTO outbox (seq, queue, entry) \
         SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[])",
        &[&seqs, &queues, &texts],
    )
    .await?;
    c.exec(
        "INSERT INTO ledger (id, event_id, state, seq, at, status) \
         SELECT id, ev, 'pending', seq, at, status \
         FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::text[]) \
         AS d(id, ev, seq, at, status) \
         ON CONFLICT (id) DO UPDATE SET state = 'pending', seq = excluded.seq, \
         at = excluded.at, status = excluded.status",
        &[&ids, &events, &seqs, &ats, &statuses],
    )
    .await?;
    Ok(())
}

pub(crate) async fn write_conversations(
    c: &impl GenericClient,
    states: &[StateWrite<ConversationState>],
) -> Result<(), PgError> {
    if states.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = states.iter().map(|w| w.state.id.as_str()).collect();
    let at: Vec<i64> = states
        .iter()
        .map(|w| conversation_activity(&w.state))
        .collect();
    let texts = states
        .iter()
        .map(|w| state_json(&w.state))
        .collect::<Result<Vec<_>, _>>()?;
    c.exec(
        "INSERT INTO conversations (id, activity_at, state) \
         SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[]) ON CONFLICT (id) DO UPDATE \
         SET activity_at = excluded.activity_at, state = excluded.state",
        &[&ids, &at, &texts],
    )
    .await?;
    Ok(())
}

pub(crate) async fn write_end_users(
    c: &impl GenericClient,
    states: &[StateWrite<EndUserState>],
) -> Result<(), PgError> {
    if states.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = states.iter().map(|w| w.state.id.as_str()).collect();
    let at: Vec<i64> = states.iter().map(|w| end_user_activity(&w.state)).collect();
    let platforms: Vec<Option<&str>> = states
        .iter()
        .map(|w| w.state.platform.as_ref().map(|p| p.as_str()))
        .collect();
    let keys: Vec<Option<&str>> = states
        .iter()
        .map(|w| w.state.user_key.as_ref().map(|k| k.as_str()))
        .collect();
    let texts = states
        .iter()
        .map(|w| state_json(&w.state))
        .collect::<Result<Vec<_>, _>>()?;
    c.exec(
        "INSERT INTO end_users (id, activity_at, platform, user_key, state) \
         SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::text[]) \
         ON CONFLICT (id) DO UPDATE SET activity_at = excluded.activity_at, \
         platform = excluded.platform, user_key = excluded.user_key, state = excluded.state",
        &[&ids, &at, &platforms, &keys, &texts],
    )
    .await?;
    Ok(())
}

pub(crate) async fn write_bots(
    c: &impl GenericClient,
    states: &[StateWrite<BotState>],
) -> Result<(), PgError> {
    if states.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = states.iter().map(|w| w.state.id.as_str()).collect();
    let texts = states
        .iter()
        .map(|w| state_json(&w.state))
        .collect::<Result<Vec<_>, _>>()?;
    c.exec(
        "INSERT INTO bots (id, state) SELECT * FROM unnest($1::text[], $2::text[]) \
         ON CONFLICT (id) DO UPDATE SET state = excluded.state",
        &[&ids, &texts],
    )
    .await?;
    Ok(())
}

/// The partitions' folded marks raised, and the watermark.
async fn write_marks(
    c: &Object,
    partitions: &[PartitionWrite],
    fold_from: Option<Cursor>,
) -> Result<(), PgError> {
    let (names, marks): (Vec<String>, Vec<i64>) = partitions
        .iter()
        .filter_map(|p| Some((p.partition.encode(), big(p.mark?))))
        .unzip();
    if !names.is_empty() {
        c.exec(
            "INSERT INTO folded (partition, mark) SELECT * FROM unnest($1::text[], $2::bigint[]) \
             ON CONFLICT (partition) DO UPDATE SET mark = GREATEST(folded.mark, excluded.mark)",
            &[&names, &marks],
        )
        .await?;
    }
    if let Some(at) = fold_from {
        let at = big(crate::rows::seq_of(at));
        c.exec("UPDATE meta SET value = $1 WHERE key = 'fold_from'", &[&at])
            .await?;
    }
    Ok(())
}

/// The agent API's listing and the sweeper's index: sled's keys as rows.
pub(crate) async fn write_derived(
    c: &impl GenericClient,
    changes: &IndexChanges<Derived>,
) -> Result<(), PgError> {
    let key = |d: &Derived| storage::derived_key(d);
    let conversation = |d: &Derived| match d {
        Derived::Phase { conversation, .. }
        | Derived::BotPhase { conversation, .. }
        | Derived::Active { conversation }
        | Derived::Released { conversation, .. } => conversation.clone(),
    };
    if !changes.removed.is_empty() {
        let gone: Vec<Vec<u8>> = changes.removed.iter().map(key).collect();
        c.exec("DELETE FROM derived WHERE key = ANY($1)", &[&gone])
            .await?;
    }
    if !changes.added.is_empty() {
        let keys: Vec<Vec<u8>> = changes.added.iter().map(key).collect();
        let ids: Vec<String> = changes.added.iter().map(conversation).collect();
        c.exec(
            "INSERT INTO derived (key, conversation) SELECT * FROM unnest($1::bytea[], $2::text[]) \
             ON CONFLICT DO NOTHING",
            &[&keys, &ids],
        )
        .await?;
    }
    Ok(())
}

pub(crate) async fn write_timers(
    c: &impl GenericClient,
    timers: &TimerChanges,
) -> Result<(), PgError> {
    if !timers.stopped.is_empty() {
        let due: Vec<i64> = timers.stopped.iter().map(|t| t.due_at).collect();
        let conv: Vec<&str> = timers
            .stopped
            .iter()
            .map(|t| t.conversation.as_str())
            .collect();
        let name: Vec<&str> = timers.stopped.iter().map(|t| t.name.as_str()).collect();
        c.exec(
            "DELETE FROM timers t USING unnest($1::bigint[], $2::text[], $3::text[]) \
             AS d(due_at, conversation, name) WHERE t.due_at = d.due_at \
             AND t.conversation = d.conversation AND t.name = d.name",
            &[&due, &conv, &name],
        )
        .await?;
    }
    if !timers.started.is_empty() {
        let s = &timers.started;
        let due: Vec<i64> = s.iter().map(|t| t.timer.due_at).collect();
        let conv: Vec<&str> = s.iter().map(|t| t.timer.conversation.as_str()).collect();
        let name: Vec<&str> = s.iter().map(|t| t.timer.name.as_str()).collect();
        let by: Vec<&str> = s.iter().map(|t| t.started_by.as_str()).collect();
        let bot: Vec<&str> = s.iter().map(|t| t.bot_id.as_str()).collect();
        c.exec(
            "INSERT INTO timers (due_at, conversation, name, started_by, bot_id) \
             SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[]) \
             ON CONFLICT (due_at, conversation, name) DO UPDATE \
             SET started_by = excluded.started_by, bot_id = excluded.bot_id",
            &[&due, &conv, &name, &by, &bot],
        )
        .await?;
    }
    Ok(())
}

/// The waiting queue's entries, each bot's count, accept histories and hour figures.
pub(crate) async fn write_queue(
    c: &impl GenericClient,
    queue: &QueueChanges,
) -> Result<(), PgError> {
    let mut per_bot: BTreeMap<&str, i64> = BTreeMap::new();
    for (entries, sign) in [(&queue.left, -1), (&queue.joined, 1)] {
        if entries.is_empty() {
            continue;
        }
        let bots: Vec<&str> = entries.iter().map(|e| e.bot.as_str()).collect();
        let since: Vec<i64> = entries.iter().map(|e| e.since).collect();
        let convs: Vec<&str> = entries.iter().map(|e| e.conversation.as_str()).collect();
        let sql = match sign {
            -1 => {
                "DELETE FROM waiting w USING unnest($1::text[], $2::bigint[], $3::text[]) \
                  AS d(bot, since, conversation) WHERE w.bot = d.bot AND w.since = d.since \
                  AND w.conversation = d.conversation"
            }
            _ => {
                "INSERT INTO waiting (bot, since, conversation) \
                  SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[]) ON CONFLICT DO NOTHING"
            }
        };
        c.exec(sql, &[&bots, &since, &convs]).await?;
        for bot in bots {
            *per_bot.entry(bot).or_default() += sign;
        }
    }
    let (bots, deltas): (Vec<&str>, Vec<i64>) = per_bot.into_iter().unzip();
    if !bots.is_empty() {
        c.exec(
            "INSERT INTO waiting_bots (bot, waiting) SELECT * FROM unnest($1::text[], $2::bigint[]) \
             ON CONFLICT (bot) DO UPDATE SET waiting = waiting_bots.waiting + excluded.waiting",
            &[&bots, &deltas],
        )
        .await?;
    }
    write_figures(c, queue).await
}

async fn write_figures(c: &impl GenericClient, queue: &QueueChanges) -> Result<(), PgError> {
    if !queue.accepts.is_empty() {
        let bots: Vec<&str> = queue.accepts.iter().map(|(b, _)| b.as_str()).collect();
        let texts = queue
            .accepts
            .iter()
            .map(|(_, h)| json(h))
            .collect::<Result<Vec<_>, _>>()?;
        c.exec(
            "INSERT INTO accept_history (bot, history) SELECT * FROM unnest($1::text[], $2::text[]) \
             ON CONFLICT (bot) DO UPDATE SET history = excluded.history",
            &[&bots, &texts],
        )
        .await?;
    }
    if !queue.hours.is_empty() {
        let hours: Vec<i64> = queue.hours.iter().map(|(h, _)| *h).collect();
        let texts = queue
            .hours
            .iter()
            .map(|(_, s)| json(s))
            .collect::<Result<Vec<_>, _>>()?;
        c.exec(
            "INSERT INTO hour_stats (hour, stats) SELECT * FROM unnest($1::bigint[], $2::text[]) \
             ON CONFLICT (hour) DO UPDATE SET stats = excluded.stats",
            &[&hours, &texts],
        )
        .await?;
    }
    Ok(())
}

/// A ledger row's upsert: an action's status now.
async fn set_status(
    c: &impl GenericClient,
    entry: &OutboxEntry,
    status: &ActionStatus,
) -> Result<(), PgError> {
    let text = json(status)?;
    c.exec(
        "INSERT INTO ledger (id, event_id, state, seq, at, status) VALUES ($1, $2, $3, $4, $5, $6) \
         ON CONFLICT (id) DO UPDATE SET state = excluded.state, seq = excluded.seq, \
         at = excluded.at, status = excluded.status",
        &[
            &entry.id,
            &entry.event_id.as_str(),
            &status.state,
            &big(status.seq),
            &status.at,
            &text,
        ],
    )
    .await?;
    Ok(())
}

/// An entry leaves the outbox (with its retry state), counted.
async fn settle(c: &impl GenericClient, seq: u64) -> Result<(), PgError> {
    let gone = c
        .exec("DELETE FROM outbox WHERE seq = $1", &[&big(seq)])
        .await?;
    c.exec("DELETE FROM outbox_retry WHERE seq = $1", &[&big(seq)])
        .await?;
    c.exec("DELETE FROM outbox_started WHERE seq = $1", &[&big(seq)])
        .await?;
    add_counts(c, &[("outbox", -(gone as i64))]).await
}

async fn record_done(c: &impl GenericClient, record: &DoneRecord) -> Result<(), PgError> {
    c.exec(
        "INSERT INTO outbox_done (seq, at, record) VALUES ($1, $2, $3) \
         ON CONFLICT (seq) DO UPDATE SET at = excluded.at, record = excluded.record",
        &[&big(record.entry.seq), &record.at, &json(record)?],
    )
    .await?;
    Ok(())
}

/// The last record of each entry in `records` (an entry recorded twice in one batch is
/// written once, as its last record says), in their order.
fn last_of_each(records: &[DoneRecord]) -> Vec<DoneRecord> {
    let mut last = BTreeMap::new();
    for (i, r) in records.iter().enumerate() {
        last.insert(r.entry.seq, i);
    }
    let mut keep: Vec<usize> = last.into_values().collect();
    keep.sort_unstable();
    keep.into_iter().map(|i| records[i].clone()).collect()
}

/// [`set_status`] of many entries (each once) in one statement.
async fn set_statuses(
    c: &impl GenericClient,
    statuses: &[(&OutboxEntry, ActionStatus)],
) -> Result<(), PgError> {
    let (mut ids, mut events, mut states) = (Vec::new(), Vec::new(), Vec::new());
    let (mut seqs, mut ats, mut texts) = (Vec::new(), Vec::new(), Vec::new());
    for (entry, status) in statuses {
        ids.push(entry.id.as_str());
        events.push(entry.event_id.as_str());
        states.push(status.state.as_str());
        seqs.push(big(status.seq));
        ats.push(status.at);
        texts.push(json(status)?);
    }
    c.exec(
        "INSERT INTO ledger (id, event_id, state, seq, at, status) \
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[], \
         $6::text[]) ON CONFLICT (id) DO UPDATE SET state = excluded.state, seq = excluded.seq, \
         at = excluded.at, status = excluded.status",
        &[&ids, &events, &states, &seqs, &ats, &texts],
    )
    .await?;
    Ok(())
}

/// [`record_done`] of many entries (each once) in one statement.
async fn records_done(c: &impl GenericClient, records: &[DoneRecord]) -> Result<(), PgError> {
    let seqs: Vec<i64> = records.iter().map(|r| big(r.entry.seq)).collect();
    let ats: Vec<i64> = records.iter().map(|r| r.at).collect();
    let texts = records.iter().map(json).collect::<Result<Vec<_>, _>>()?;
    c.exec(
        "INSERT INTO outbox_done (seq, at, record) \
         SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[]) \
         ON CONFLICT (seq) DO UPDATE SET at = excluded.at, record = excluded.record",
        &[&seqs, &ats, &texts],
    )
    .await?;
    Ok(())
}

/// [`settle`] of many entries in one statement: they leave the outbox with their retry states
/// and begin records, and the count goes down by those that were there.
async fn settle_many(c: &impl GenericClient, seqs: &[i64]) -> Result<(), PgError> {
    c.exec(
        "WITH gone AS (DELETE FROM outbox WHERE seq = ANY($1) RETURNING 1), \
         retry AS (DELETE FROM outbox_retry WHERE seq = ANY($1)), \
         started AS (DELETE FROM outbox_started WHERE seq = ANY($1)) \
         UPDATE meta SET value = value - (SELECT count(*) FROM gone) WHERE key = 'outbox'",
        &[&seqs],
    )
    .await?;
    Ok(())
}

fn one<T: serde::de::DeserializeOwned>(
    row: Option<tokio_postgres::Row>,
    what: &'static str,
) -> Result<Option<T>, PgError> {
    row.map(|r| parse(r.get(0), what)).transpose()
}

fn all<T: serde::de::DeserializeOwned>(
    rows: Vec<tokio_postgres::Row>,
    what: &'static str,
) -> Result<Vec<T>, PgError> {
    rows.iter().map(|r| parse(r.get(0), what)).collect()
}

impl PgStore {
    /// The JSON documents `sql` selects with `params`.
    fn documents<T: serde::de::DeserializeOwned + Send + 'static>(
        &self,
        sql: &'static str,
        params: (i64, i64),
        what: &'static str,
    ) -> Result<Vec<T>, StoreError> {
        self.with_client(
            move |c| async move { all(c.rows(sql, &[&params.0, &params.1]).await?, what) },
        )
    }

    fn document<T: serde::de::DeserializeOwned + Send + 'static>(
        &self,
        sql: &'static str,
        key: i64,
        what: &'static str,
    ) -> Result<Option<T>, StoreError> {
        self.with_client(move |c| async move { one(c.row_opt(sql, &[&key]).await?, what) })
    }

    fn meta_count(&self, key: &'static str) -> Result<u64, StoreError> {
        self.with_client(move |c| async move {
            let row = c
                .row_opt("SELECT value FROM meta WHERE key = $1", &[&key])
                .await?;
            Ok(row.map_or(0, |r| num(r.get(0))))
        })
    }
}

/// `after` as the lowest key a page starts above.
fn after_key(after: Option<u64>) -> i64 {
    after.map_or(-1, big)
}

impl Outbox for PgStore {
    fn outbox_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<OutboxEntry>, StoreError> {
        let sql = "SELECT entry FROM outbox WHERE seq > $1 ORDER BY seq LIMIT $2";
        self.documents(sql, (after_key(after), big(limit as u64)), "outbox entry")
    }

    fn outbox_entry(&self, seq: u64) -> Result<Option<OutboxEntry>, StoreError> {
        self.document(
            "SELECT entry FROM outbox WHERE seq = $1",
            big(seq),
            "outbox entry",
        )
    }

    fn outbox_len(&self) -> Result<usize, StoreError> {
        Ok(self.meta_count("outbox")? as usize)
    }

    fn outbox_last_seq(&self) -> Result<Option<u64>, StoreError> {
        self.with_client(|c| async move {
            let max: Option<i64> = c.row("SELECT max(seq) FROM outbox", &[]).await?.get(0);
            Ok(max.map(num))
        })
    }

    fn outbox_retry_state(&self, seq: u64) -> Result<Option<RetryState>, StoreError> {
        let sql = "SELECT state FROM outbox_retry WHERE seq = $1";
        self.document(sql, big(seq), "retry state")
    }

    fn set_outbox_retry_state(&self, seq: u64, state: &RetryState) -> Result<(), StoreError> {
        let (text, active) = (json(state)?, self.active());
        self.with_client(move |mut c| async move {
            let tx = begin_active(&mut c, &active).await?;
            tx.exec(
                "INSERT INTO outbox_retry (seq, state) VALUES ($1, $2) \
                 ON CONFLICT (seq) DO UPDATE SET state = excluded.state",
                &[&big(seq), &text],
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
    }

    fn outbox_done(
        &self,
        entry: &OutboxEntry,
        attempts: u32,
        now: Millis,
    ) -> Result<(), StoreError> {
        let record = DoneRecord {
            entry: entry.clone(),
            outcome: "done".into(),
            at: now,
            attempts,
            note: None,
        };
        self.outbox_done_many(&[record])
    }

    /// Each record, its ledger status and the entry's leaving, in one transaction of three
    /// statements however many records it holds.
    fn outbox_done_many(&self, records: &[DoneRecord]) -> Result<(), StoreError> {
        let (records, active) = (last_of_each(records), self.active());
        if records.is_empty() {
            return Ok(());
        }
        self.with_client(move |mut c| async move {
            let tx = begin_active(&mut c, &active).await?;
            let statuses = records
                .iter()
                .map(|r| (&r.entry, ActionStatus::done(r)))
                .collect::<Vec<_>>();
            let seqs: Vec<i64> = records.iter().map(|r| big(r.entry.seq)).collect();
            tokio::try_join!(
                set_statuses(&tx, &statuses),
                records_done(&tx, &records),
                settle_many(&tx, &seqs),
            )?;
            tx.commit().await?;
            Ok(())
        })
    }

    fn outbox_dead(&self, letter: &DeadLetter) -> Result<(), StoreError> {
        let (letter, active) = (letter.clone(), self.active());
        self.with_client(move |mut c| async move {
            let tx = begin_active(&mut c, &active).await?;
            let seq = letter.entry.seq;
            let status = ActionStatus {
                state: "dead".into(),
                seq,
                at: letter.last_attempt_at,
                attempts: letter.attempts,
                note: Some(letter.reason.clone()),
            };
            settle(&tx, seq).await?;
            tx.exec(
                "INSERT INTO dead_letters (seq, letter) VALUES ($1, $2) \
                 ON CONFLICT (seq) DO UPDATE SET letter = excluded.letter",
                &[&big(seq), &json(&letter)?],
            )
            .await?;
            set_status(&tx, &letter.entry, &status).await?;
            tx.commit().await?;
            Ok(())
        })
    }

    fn dead_letter(&self, seq: u64) -> Result<Option<DeadLetter>, StoreError> {
        self.document(
            "SELECT letter FROM dead_letters WHERE seq = $1",
            big(seq),
            "dead letter",
        )
    }

    fn dead_letters(&self) -> Result<Vec<DeadLetter>, StoreError> {
        self.dead_letters_page(None, usize::MAX >> 2)
    }

    fn dead_letters_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        let sql = "SELECT letter FROM dead_letters WHERE seq > $1 ORDER BY seq LIMIT $2";
        self.documents(sql, (after_key(after), big(limit as u64)), "dead letter")
    }

    /// An operator's: taken on every node, not fenced.
    fn retry_dead_letter(&self, seq: u64, now: Millis) -> Result<Option<OutboxEntry>, StoreError> {
        self.with_client(move |mut c| async move {
            let tx = c.transaction().await?;
            let row = tx
                .row_opt("DELETE FROM dead_letters WHERE seq = $1 RETURNING letter", &[&big(seq)])
                .await?;
            let Some(letter) = one::<DeadLetter>(row, "dead letter")? else {
                return Ok(None);
            };
            let mut entry = letter.entry;
            if letter.answered {
                entry.idempotency_key = Some(format!("{}~retry-{now}", entry.id));
            }
            set_status(&tx, &entry, &ActionStatus::pending(entry.seq, now)).await?;
            let added = tx
                .exec(
                    "INSERT INTO outbox (seq, queue, entry) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
                    &[&big(seq), &entry.queue, &json(&entry)?],
                )
                .await?;
            add_counts(&tx, &[("outbox", added as i64)]).await?;
            tx.commit().await?;
            Ok(Some(entry))
        })
    }

    fn drop_dead_letter(
        &self,
        seq: u64,
        reason: &str,
        now: Millis,
    ) -> Result<Option<DeadLetter>, StoreError> {
        // An operator's: taken on every node, not fenced.
        let note = Some(reason.to_owned());
        self.with_client(move |mut c| async move {
            let tx = c.transaction().await?;
            let row = tx
                .row_opt(
                    "DELETE FROM dead_letters WHERE seq = $1 RETURNING letter",
                    &[&big(seq)],
                )
                .await?;
            let Some(letter) = one::<DeadLetter>(row, "dead letter")? else {
                return Ok(None);
            };
            let status = ActionStatus {
                state: "dropped".into(),
                seq,
                at: now,
                attempts: letter.attempts,
                note: note.clone(),
            };
            let record = DoneRecord {
                entry: letter.entry.clone(),
                outcome: "dropped".into(),
                at: now,
                attempts: letter.attempts,
                note,
            };
            set_status(&tx, &letter.entry, &status).await?;
            record_done(&tx, &record).await?;
            tx.commit().await?;
            Ok(Some(letter))
        })
    }

    fn finished_page(
        &self,
        before: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DoneRecord>, StoreError> {
        let sql = "SELECT record FROM outbox_done WHERE seq < $1 ORDER BY seq DESC LIMIT $2";
        let before = before.map_or(i64::MAX, big);
        self.documents(sql, (before, big(limit as u64)), "done record")
    }

    fn finished_one(&self, seq: u64) -> Result<Option<DoneRecord>, StoreError> {
        self.document(
            "SELECT record FROM outbox_done WHERE seq = $1",
            big(seq),
            "done record",
        )
    }

    fn action_seqs_of_event(&self, event_id: &str) -> Result<Vec<u64>, StoreError> {
        let event = event_id.to_owned();
        self.with_client(move |c| async move {
            let rows = c
                .rows(
                    "SELECT seq FROM ledger WHERE event_id = $1 ORDER BY id",
                    &[&event],
                )
                .await?;
            Ok(rows.iter().map(|r| num(r.get(0))).collect())
        })
    }
}

/// Timers read a page at a time (the firer's skip is a closure of the caller's thread).
const TIMER_PAGE: i64 = 256;

impl Timers for PgStore {
    fn due_timers(
        &self,
        now: Millis,
        limit: usize,
        skip: &dyn Fn(&TimerKey) -> bool,
    ) -> Result<(Vec<DueTimer>, Option<Millis>), StoreError> {
        let mut due = Vec::new();
        let mut after: (i64, String, String) = (i64::MIN, String::new(), String::new());
        loop {
            let from = after.clone();
            let page = self.with_client(move |c| async move {
                let rows = c
                    .rows(
                        "SELECT due_at, conversation, name, started_by, bot_id FROM timers \
                         WHERE (due_at, conversation, name) > ($1, $2, $3) \
                         ORDER BY due_at, conversation, name LIMIT $4",
                        &[&from.0, &from.1, &from.2, &TIMER_PAGE],
                    )
                    .await?;
                Ok(rows)
            })?;
            let full = page.len() as i64 == TIMER_PAGE;
            for row in page {
                let timer = engine::index::TimerRef {
                    due_at: row.get(0),
                    conversation: row.get(1),
                    name: row.get(2),
                };
                after = (timer.due_at, timer.conversation.clone(), timer.name.clone());
                let key = TimerKey::of(timer.clone());
                if skip(&key) {
                    continue;
                }
                if timer.due_at > now {
                    return Ok((due, Some(timer.due_at)));
                }
                if due.len() >= limit {
                    return Ok((due, Some(now)));
                }
                let firing = TimerFiring {
                    conversation_id: ConversationId::new(timer.conversation.as_str()),
                    name: timer.name.clone(),
                    due_at: timer.due_at,
                    started_by: row.get(3),
                };
                due.push(DueTimer {
                    key,
                    firing,
                    bot_id: row.get(4),
                });
            }
            if !full {
                return Ok((due, None));
            }
        }
    }

    fn has_timer(&self, timer: &TimerKey) -> Result<bool, StoreError> {
        let t = timer.timer().clone();
        self.with_client(move |c| async move {
            let row = c
                .row_opt(
                    "SELECT 1 FROM timers WHERE due_at = $1 AND conversation = $2 AND name = $3",
                    &[&t.due_at, &t.conversation, &t.name],
                )
                .await?;
            Ok(row.is_some())
        })
    }

    fn timers_pending(&self) -> Result<u64, StoreError> {
        self.meta_count("timers")
    }

    fn timer_wakeup(&self) -> Arc<TimerWakeup> {
        self.0.timer_wakeup.clone()
    }
}
