//! The folds: the events still to fold (above their partitions' marks from the watermark), and
//! fold sessions. A session is one transaction on one connection, serialised (the store's fold
//! lock, then `pg_advisory_xact_lock(fold lock)`); the engine's reads are answered from what
//! `prefetch` read for the batch in one round trip where it can, and the write set is committed
//! in a few pipelined statements, wholly or (any failure) not at all.

use crate::prepared::{by_keys, Prepared};
use crate::rows::{big, cursor, json, num, parse, seq_of};
use crate::{PgError, PgStore};
use deadpool_postgres::Object;
use engine::batch::{FoldReads, WriteSet};
use engine::index::{QueueEntry, QueueSpot};
use engine::state::queue::AcceptHistory;
use engine::state::stats::HandoffStats;
use engine::state::{BotState, ConversationState, EndUserState};
use model::cursor::Cursor;
use model::ids::{ConversationId, EndUserId, PartitionKey};
use model::webhook::model::{Event, Millis, Payload};
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::MutexGuard;
use storage::port::{FoldSession, Folds, ReplayEvents};
use storage::{Applied, EventRecord, Pending, PendingEvent, StoreError};

/// An event row's columns, in this order, for [`record`].
pub(crate) const EVENT_COLUMNS: &str = "e.seq, e.id, e.delivery, e.received_at, e.partition, \
                                        e.kind, e.body";

/// An event row (selected as [`EVENT_COLUMNS`]) as the port's record.
pub(crate) fn record(row: &tokio_postgres::Row) -> Result<EventRecord, PgError> {
    let body: String = row.get(6);
    let event = serde_json::value::RawValue::from_string(body).map_err(|e| PgError::Corrupt {
        what: "stored event",
        detail: e.to_string(),
    })?;
    Ok(EventRecord {
        seq: num(row.get(0)),
        id: model::ids::EventId::new(row.get::<_, String>(1)),
        delivery: model::ids::DeliveryId::new(row.get::<_, String>(2)),
        received_at: row.get(3),
        partition: row.get(4),
        kind: row.get(5),
        event,
    })
}

/// How many waiting conversations, over all bots, the active's folds hold in memory (about 80
/// bytes each: 5 MiB at most), so that a standing is counted in memory, not by a statement that
/// counts the bot's whole queue (1.1 ms a call with 4,400 waiting, in the fold's serialised
/// path: at 4,096 a bot, the most before session 45, the benchmark's 20,000 queued
/// conversations capped the fold at 400 handoffs/s).
pub(crate) const QUEUE_HELD: usize = 65_536;

/// Whether an event is still to fold, as SQL over `e` (events) and `f` (folded) with the
/// watermark as `$1`.
const PENDING: &str = "(e.seq >= $1 AND (f.mark IS NULL OR e.seq > f.mark))";

impl PgStore {
    /// The events still to fold from the watermark, below `until` (all: `None`), and the log's
    /// end, read in one snapshot.
    fn pending_until(&self, until: Option<u64>) -> Result<Pending, StoreError> {
        let until = until.map(big).unwrap_or(i64::MAX);
        self.with_client(move |mut c| async move {
            let tx = snapshot(&mut c).await?;
            let from: i64 = tx
                .row("SELECT value FROM meta WHERE key = 'fold_from'", &[])
                .await?
                .get(0);
            let sql = format!(
                "SELECT e.seq, e.partition FROM events e LEFT JOIN folded f \
                 ON f.partition = e.partition WHERE {PENDING} AND e.seq < $2 ORDER BY e.seq"
            );
            let rows = tx.rows(&sql, &[&from, &until]).await?;
            let events = pending_events(&rows)?;
            let end = match until {
                i64::MAX => log_end(&tx).await?.max(from),
                until => until,
            };
            Ok(Pending {
                events,
                end: cursor(num(end)),
            })
        })
    }

    /// At most `limit` events still to fold at or past `from`, and where to read on (past the
    /// last one listed, or the log's end when none is left): events commit in number order, so
    /// nothing committed later comes below that end. One statement, so one snapshot: the
    /// watermark, the events and the log's end agree (the active polls this for every node's
    /// events).
    fn pending_on(&self, from: Cursor, limit: usize) -> Result<Pending, StoreError> {
        let (from, limit) = (big(seq_of(from)), big(limit as u64));
        self.with_client(move |c| async move {
            let rows = c
                .rows(
                    "SELECT m.last, p.seq, p.partition FROM (SELECT max(seq) AS last FROM events) m \
                     LEFT JOIN LATERAL (SELECT e.seq, e.partition FROM events e \
                     LEFT JOIN folded f ON f.partition = e.partition \
                     WHERE e.seq >= (SELECT value FROM meta WHERE key = 'fold_from') \
                     AND (f.mark IS NULL OR e.seq > f.mark) AND e.seq >= $1 \
                     ORDER BY e.seq LIMIT $2) p ON true ORDER BY p.seq",
                    &[&from, &limit],
                )
                .await?;
            let last: Option<i64> = rows.first().and_then(|r| r.get(0));
            let listed: Vec<&tokio_postgres::Row> = rows
                .iter()
                .filter(|r| r.get::<_, Option<i64>>(1).is_some())
                .collect();
            let events = listed
                .iter()
                .map(|row| pending_event(row.get(1), row.get(2)))
                .collect::<Result<Vec<_>, _>>()?;
            let end = match events.last() {
                Some(last) if events.len() as i64 >= limit => big(last.seq) + 1,
                _ => last.map_or(0, |m| m + 1).max(from),
            };
            Ok(Pending {
                events,
                end: cursor(num(end)),
            })
        })
    }
}

/// A read-only transaction of one snapshot (`REPEATABLE READ`): what it lists and the log's end
/// it reads agree.
async fn snapshot(
    c: &mut deadpool_postgres::Object,
) -> Result<deadpool_postgres::Transaction<'_>, PgError> {
    Ok(c.build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?)
}

/// The pending events of `rows` (`seq`, `partition`).
fn pending_events(rows: &[tokio_postgres::Row]) -> Result<Vec<PendingEvent>, PgError> {
    rows.iter()
        .map(|row| pending_event(row.get(0), row.get(1)))
        .collect()
}

/// An event still to fold: its number and its partition's encoded key.
fn pending_event(seq: i64, partition: String) -> Result<PendingEvent, PgError> {
    let seq = num(seq);
    let Some(partition) = PartitionKey::decode(&partition) else {
        return Err(PgError::Corrupt {
            what: "event partition",
            detail: partition,
        });
    };
    Ok(PendingEvent {
        seq,
        partition,
        at: cursor(seq),
    })
}

/// One past the highest event number committed (events commit in number order: no later commit
/// brings a lower one), 0 for an empty log.
async fn log_end(c: &impl deadpool_postgres::GenericClient) -> Result<i64, PgError> {
    let max: Option<i64> = c.row("SELECT max(seq) FROM events", &[]).await?.get(0);
    Ok(max.map_or(0, |m| m + 1))
}

impl Folds for PgStore {
    fn pending(&self) -> Result<Pending, StoreError> {
        self.pending_until(None)
    }

    /// Read on from `from`, at most `limit` (the active of several nodes, for what the others
    /// stored): one bounded query, not all that is pending.
    fn pending_from(&self, from: Cursor, limit: usize) -> Result<Pending, StoreError> {
        self.pending_on(from, limit)
    }

    fn pending_before_writer(&self) -> Result<Pending, StoreError> {
        let until = *self.0.writer_from.lock().unwrap_or_else(|p| p.into_inner());
        self.pending_until(until)
    }

    fn event_at(&self, seq: u64, at: Cursor) -> Result<Option<EventRecord>, StoreError> {
        if seq_of(at) != seq {
            return Err(StoreError::Corrupt(
                "an event's cursor is its number".into(),
            ));
        }
        self.with_client(move |client| async move {
            let sql = format!("SELECT {EVENT_COLUMNS} FROM events e WHERE e.seq = $1");
            let row = client.row_opt(&sql, &[&big(seq)]).await?;
            row.as_ref().map(record).transpose()
        })
    }

    /// One query for all of `wanted`.
    fn events_at(&self, wanted: &[(u64, Cursor)]) -> Result<Vec<Option<EventRecord>>, StoreError> {
        if wanted.iter().any(|&(seq, at)| seq_of(at) != seq) {
            return Err(StoreError::Corrupt(
                "an event's cursor is its number".into(),
            ));
        }
        let seqs: Vec<i64> = wanted.iter().map(|&(seq, _)| big(seq)).collect();
        self.with_client(move |client| async move {
            let sql = format!("SELECT {EVENT_COLUMNS} FROM events e WHERE e.seq = ANY($1)");
            let mut found: HashMap<u64, EventRecord> = HashMap::new();
            for row in client.rows(&sql, &[&seqs]).await? {
                let record = record(&row)?;
                found.insert(record.seq, record);
            }
            Ok(seqs.iter().map(|&seq| found.remove(&num(seq))).collect())
        })
    }

    fn begin_fold(&self) -> Result<Box<dyn FoldSession + '_>, StoreError> {
        let mut folding = self.fold_guard_keeping();
        let (pool, lock) = (self.0.pool.clone(), self.0.locks.fold);
        let (handle, active) = (self.handle().clone(), self.active());
        folding.for_epoch(active.epoch());
        let client = self.block(async move {
            let client = TxClient(Some(pool.get().await?), handle);
            // This node's epoch, the lease row key-share-locked to the commit: fenced otherwise.
            crate::lease::begin_fold(&client, lock, &active).await?;
            Ok(client)
        })?;
        Ok(Box::new(PgFold {
            store: self,
            folding,
            client: Some(client),
            cache: Cache::default(),
        }))
    }

    fn fold_from(&self) -> Result<Cursor, StoreError> {
        self.with_client(|client| async move {
            let row = client
                .row("SELECT value FROM meta WHERE key = 'fold_from'", &[])
                .await?;
            Ok(cursor(num(row.get(0))))
        })
    }

    fn advance_fold_from(&self, to: Cursor) -> Result<(), StoreError> {
        let _folding = self.fold_guard_keeping();
        let (to, active) = (big(seq_of(to)), self.active());
        self.with_client(move |mut client| async move {
            let tx = crate::begin_active(&mut client, &active).await?;
            tx.exec(
                "UPDATE meta SET value = GREATEST(value, $1) WHERE key = 'fold_from'",
                &[&to],
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
    }
}

/// A connection inside a fold's transaction. Dropped uncommitted (a failed read, a session
/// given up, a timeout): rolled back before it goes back to the pool, or closed when that fails,
/// so no other work ever runs inside it.
pub(crate) struct TxClient(Option<Object>, tokio::runtime::Handle);

impl std::ops::Deref for TxClient {
    type Target = Object;

    fn deref(&self) -> &Object {
        match &self.0 {
            Some(client) => client,
            // Taken only by `done` and `drop`, which consume it.
            None => unreachable!("a fold connection used after it was handed back"),
        }
    }
}

impl TxClient {
    /// Committed: back to the pool as it is.
    fn done(mut self) {
        self.0.take();
    }
}

impl Drop for TxClient {
    fn drop(&mut self) {
        let Some(client) = self.0.take() else { return };
        self.1.spawn(async move {
            let rollback = client.batch_execute("ROLLBACK");
            if !matches!(
                tokio::time::timeout(std::time::Duration::from_secs(5), rollback).await,
                Ok(Ok(()))
            ) {
                drop(Object::take(client));
            }
        });
    }
}

/// What a session read ahead for its batch, taken by the engine's reads (`None` inside: read,
/// not there).
#[derive(Default)]
struct Cache {
    conversations: HashMap<String, Option<String>>,
    end_users: HashMap<String, Option<String>>,
    bots: HashMap<String, Option<String>>,
    marks: HashMap<String, Option<u64>>,
    /// The events whose ledger rows were read, and those rows (action id -> state).
    ledger_events: HashSet<String>,
    ledger: HashMap<String, String>,
}

/// Each bot's committed waiting queue in order, as the folds of this node hold it from one
/// session to the next while it holds one epoch of the lease: only it folds then, and every
/// change is its folds' (applied after each commit) or a retention pass's (which forgets them,
/// `PgStore::fold_guard`). A new epoch, a handle that never claimed the lease and a commit
/// whose outcome is unknown start afresh. Read at a bot's first standing; a bot whose queue does
/// not fit in what the store holds over all bots (`None`: each standing asked of the database,
/// the queue not read again until it is all forgotten) is let go.
#[derive(Default)]
pub(crate) struct HeldQueues {
    epoch: Option<u64>,
    bots: HashMap<String, Option<Vec<(Millis, String)>>>,
}

impl HeldQueues {
    pub(crate) fn forget(&mut self) {
        self.bots.clear();
    }

    /// A session of `epoch` begins: what an earlier epoch (or no epoch) held is forgotten.
    fn for_epoch(&mut self, epoch: Option<u64>) {
        if epoch.is_none() || epoch != self.epoch {
            self.forget();
        }
        self.epoch = epoch;
    }

    /// How many waiting conversations are held, over all bots.
    fn held(&self) -> usize {
        self.bots.values().flatten().map(Vec::len).sum()
    }

    /// A commit's changes to the queues, as the database made them (a join already there and a
    /// leave not there change nothing); while more than `held` are held, the longest queue is
    /// let go.
    fn apply(&mut self, left: &[QueueEntry], joined: &[QueueEntry], held: usize) {
        let spot = |e: &QueueEntry| (e.since, e.conversation.clone());
        for (entries, joins) in [(left, false), (joined, true)] {
            for e in entries {
                let Some(Some(queue)) = self.bots.get_mut(&e.bot) else {
                    continue;
                };
                let at = queue.binary_search(&spot(e));
                match (at, joins) {
                    (Ok(i), false) => drop(queue.remove(i)),
                    (Err(i), true) => queue.insert(i, spot(e)),
                    _ => {}
                }
            }
        }
        let mut total = self.held();
        while total > held {
            let longest = self
                .bots
                .values_mut()
                .max_by_key(|q| q.as_ref().map_or(0, Vec::len));
            let Some(queue) = longest.and_then(Option::take) else {
                break;
            };
            total -= queue.len();
        }
    }
}

/// A fold under way.
struct PgFold<'s> {
    store: &'s PgStore,
    /// The fold lock, and the queues held across sessions.
    folding: MutexGuard<'s, HeldQueues>,
    client: Option<TxClient>,
    cache: Cache,
}

impl PgFold<'_> {
    /// `work` with the session's connection, on the store's runtime.
    fn call<T, F, Fut>(&mut self, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(TxClient) -> Fut + Send + 'static,
        Fut: Future<Output = (TxClient, Result<T, PgError>)> + Send,
    {
        let client = self.client.take().ok_or_else(|| {
            StoreError::Internal("the fold's connection was lost by an earlier failure".into())
        })?;
        let (client, out) = self.store.block(async move { Ok(work(client).await) })?;
        self.client = Some(client);
        out.map_err(StoreError::from)
    }

    /// One row's text column `sql` selects by `key`.
    fn text(&mut self, sql: &'static str, key: String) -> Result<Option<String>, StoreError> {
        self.call(move |c| async move {
            let row = c.row_opt(sql, &[&key]).await;
            (c, row.map(|r| r.map(|r| r.get(0))).map_err(PgError::from))
        })
    }

    fn state<T: serde::de::DeserializeOwned>(
        &mut self,
        cached: Option<Option<String>>,
        sql: &'static str,
        key: &str,
        what: &'static str,
    ) -> Result<Option<T>, StoreError> {
        let text = match cached {
            Some(text) => text,
            None => self.text(sql, key.to_owned())?,
        };
        Ok(text.map(|t| parse(&t, what)).transpose()?)
    }
}

impl PgFold<'_> {
    /// `bot`'s committed waiting queue in order, `None` when it does not fit beside the queues
    /// held already.
    fn read_queue(&mut self, bot: &str) -> Result<Option<Vec<(Millis, String)>>, StoreError> {
        let budget = self.store.0.queue_held.load(Ordering::Relaxed);
        let held = budget.saturating_sub(self.folding.held());
        let (bot, limit) = (bot.to_owned(), big(held as u64 + 1));
        let rows = self.call(move |c| async move {
            let rows = c
                .rows(
                    "SELECT since, conversation FROM waiting WHERE bot = $1 \
                     ORDER BY since, conversation LIMIT $2",
                    &[&bot, &limit],
                )
                .await;
            (c, rows.map_err(PgError::from))
        })?;
        if rows.len() > held {
            return Ok(None);
        }
        Ok(Some(rows.iter().map(|r| (r.get(0), r.get(1))).collect()))
    }
}

/// [`FoldReads::waiting_standing`] over a bot's whole committed queue (`queue`, in order;
/// `"C"` collation is byte order, as `str`'s): how many wait, and how many sort before `own`,
/// leaving out those of `found` that are there, each once.
fn standing_in(
    queue: &[(Millis, String)],
    own: Option<QueueSpot<'_>>,
    found: &mut dyn Iterator<Item = QueueSpot<'_>>,
) -> (usize, usize) {
    let rank = |spot: (Millis, &str)| queue.partition_point(|(s, c)| (*s, c.as_str()) < spot);
    let there = |spot: (Millis, &str)| {
        queue
            .get(rank(spot))
            .is_some_and(|(s, c)| (*s, c.as_str()) == spot)
    };
    let own = own.map(|o| (o.since, o.conversation));
    let mut found: Vec<(Millis, &str)> = found.map(|f| (f.since, f.conversation)).collect();
    found.sort_unstable();
    found.dedup();
    let (mut length, mut ahead) = (queue.len(), own.map_or(0, rank));
    for spot in found.into_iter().filter(|spot| there(*spot)) {
        length -= 1;
        if own.is_some_and(|own| spot < own) {
            ahead -= 1;
        }
    }
    (length, ahead)
}

impl FoldReads for PgFold<'_> {
    type Error = StoreError;

    fn conversation(
        &mut self,
        id: &ConversationId,
    ) -> Result<Option<ConversationState>, StoreError> {
        let cached = self.cache.conversations.remove(id.as_str());
        let sql = "SELECT state FROM conversations WHERE id = $1";
        self.state(cached, sql, id.as_str(), "conversation state")
    }

    /// Kept in the cache once read: the rules read a conversation's end user for each of its
    /// events, and no commit changes it while the session holds the fold lock.
    fn end_user(&mut self, id: &EndUserId) -> Result<Option<EndUserState>, StoreError> {
        let text = match self.cache.end_users.get(id.as_str()) {
            Some(text) => text.clone(),
            None => {
                let sql = "SELECT state FROM end_users WHERE id = $1";
                let text = self.text(sql, id.as_str().to_owned())?;
                let key = id.as_str().to_owned();
                self.cache.end_users.insert(key, text.clone());
                text
            }
        };
        Ok(text.map(|t| parse(&t, "end-user state")).transpose()?)
    }

    fn bot(&mut self, id: &str) -> Result<Option<BotState>, StoreError> {
        let cached = self.cache.bots.remove(id);
        self.state(
            cached,
            "SELECT state FROM bots WHERE id = $1",
            id,
            "bot state",
        )
    }

    fn folded_mark(&mut self, partition: &str) -> Result<Option<u64>, StoreError> {
        if let Some(mark) = self.cache.marks.remove(partition) {
            return Ok(mark);
        }
        let key = partition.to_owned();
        self.call(move |c| async move {
            let row = c
                .row_opt("SELECT mark FROM folded WHERE partition = $1", &[&key])
                .await;
            (
                c,
                row.map(|r| r.map(|r| num(r.get(0)))).map_err(PgError::from),
            )
        })
    }

    fn decided_before(&mut self, action_id: &str) -> Result<bool, StoreError> {
        Ok(self.ledger_state(action_id)?.is_some())
    }

    fn ledger_state(&mut self, action_id: &str) -> Result<Option<String>, StoreError> {
        let event = crate::rows::event_of_action(action_id);
        if self.cache.ledger_events.contains(event) {
            return Ok(self.cache.ledger.get(action_id).cloned());
        }
        self.text(
            "SELECT state FROM ledger WHERE id = $1",
            action_id.to_owned(),
        )
    }

    fn accept_history(&mut self, bot: &str) -> Result<Option<AcceptHistory>, StoreError> {
        let sql = "SELECT history FROM accept_history WHERE bot = $1";
        self.state(None, sql, bot, "accept history")
    }

    fn hour_stats(&mut self, hour: Millis) -> Result<Option<HandoffStats>, StoreError> {
        let text = self.call(move |c| async move {
            let row = c
                .row_opt("SELECT stats FROM hour_stats WHERE hour = $1", &[&hour])
                .await;
            (
                c,
                row.map(|r| r.map(|r| r.get::<_, String>(0)))
                    .map_err(PgError::from),
            )
        })?;
        // A record that cannot be read is counted afresh: the figures never hold the folds up.
        Ok(text.and_then(|t| serde_json::from_str(&t).ok()))
    }

    fn waiting_standing(
        &mut self,
        bot: &str,
        own: Option<QueueSpot<'_>>,
        found: &mut dyn Iterator<Item = QueueSpot<'_>>,
    ) -> Result<(usize, usize), StoreError> {
        if !self.folding.bots.contains_key(bot) {
            let held = self.read_queue(bot)?;
            self.folding.bots.insert(bot.to_owned(), held);
        }
        if let Some(Some(queue)) = self.folding.bots.get(bot) {
            return Ok(standing_in(queue, own, found));
        }
        let found: Vec<(Millis, String)> = found
            .map(|f| (f.since, f.conversation.to_owned()))
            .collect();
        let own = own.map(|o| (o.since, o.conversation.to_owned()));
        let bot = bot.to_owned();
        self.call(move |c| async move {
            let out = crate::reads::standing(&*c, &bot, own.as_ref(), &found).await;
            (c, out)
        })
    }
}

impl FoldSession for PgFold<'_> {
    fn now(&self) -> Millis {
        self.store.0.clock.now_millis()
    }

    /// The batch's states, marks and ledger rows, read in one pipelined round trip.
    fn prefetch(
        &mut self,
        events: &[(u64, Event)],
        partitions: &[PartitionKey],
    ) -> Result<(), StoreError> {
        let wanted = Wanted::of(events, partitions);
        let cache = self.call(move |c| async move {
            let read = wanted.read(&c).await;
            (c, read)
        })?;
        self.cache = cache;
        Ok(())
    }

    fn replay_events(&mut self, from: Millis, to: Millis) -> Result<ReplayEvents, StoreError> {
        self.call(move |c| async move {
            let out = crate::reads::replay_events(&*c, from, to).await;
            (c, out)
        })
    }

    fn commit(mut self: Box<Self>, writes: WriteSet) -> Result<Applied, StoreError> {
        let fail = self
            .store
            .0
            .fail_next_commit
            .swap(false, std::sync::atomic::Ordering::SeqCst);
        if fail {
            return Err(StoreError::Internal("a commit failed on purpose".into()));
        }
        let earliest = writes.timers.earliest;
        let client = self.client.take().ok_or_else(|| {
            StoreError::Internal("the fold's connection was lost by an earlier failure".into())
        })?;
        let (left, joined) = (writes.queue.left.clone(), writes.queue.joined.clone());
        let committed = self.store.block(async move {
            let applied = crate::outbox::commit_writes(&client, writes).await?;
            client.batch_execute("COMMIT").await?;
            client.done();
            Ok(applied)
        });
        let applied = match committed {
            Ok(applied) => applied,
            // Committed or not, it cannot tell: the queues are read again.
            Err(e) => {
                self.folding.forget();
                return Err(e);
            }
        };
        let held = self.store.0.queue_held.load(Ordering::Relaxed);
        self.folding.apply(&left, &joined, held);
        if let Some(due_at) = earliest {
            self.store.0.timer_wakeup.started(due_at);
        }
        Ok(applied)
    }
}

/// The keys a batch will read.
struct Wanted {
    conversations: Vec<String>,
    end_users: Vec<String>,
    bots: Vec<String>,
    partitions: Vec<String>,
    events: Vec<String>,
}

impl Wanted {
    fn of(events: &[(u64, Event)], partitions: &[PartitionKey]) -> Wanted {
        let mut out = Wanted {
            conversations: Vec::new(),
            end_users: Vec::new(),
            bots: Vec::new(),
            partitions: partitions.iter().map(PartitionKey::encode).collect(),
            events: events
                .iter()
                .map(|(_, e)| e.id.as_str().to_owned())
                .collect(),
        };
        for (_, event) in events {
            match &event.payload {
                Payload::EndUser(u) => out.end_users.push(u.id.as_str().to_owned()),
                Payload::Bot(b) => out.bots.push(b.id.as_str().to_owned()),
                payload => match payload.conversation_id() {
                    Some(id) => out.conversations.push(id.as_str().to_owned()),
                    None => out.bots.push(event.source_id.as_str().to_owned()),
                },
            }
            if let Payload::Conversation(c) = &event.payload {
                out.end_users
                    .extend(c.end_user_id.as_ref().map(|u| u.as_str().to_owned()));
            }
        }
        out
    }

    /// Read every wanted key (those not found cached as not there).
    async fn read(self, c: &Object) -> Result<Cache, PgError> {
        let c: &tokio_postgres::Client = c;
        let (convs, users, bots, marks, ledger) = tokio::try_join!(
            by_keys(
                c,
                "SELECT id, state FROM conversations WHERE id = ANY($1)",
                &self.conversations
            ),
            by_keys(
                c,
                "SELECT id, state FROM end_users WHERE id = ANY($1)",
                &self.end_users
            ),
            by_keys(
                c,
                "SELECT id, state FROM bots WHERE id = ANY($1)",
                &self.bots
            ),
            by_keys(
                c,
                "SELECT partition, mark FROM folded WHERE partition = ANY($1)",
                &self.partitions
            ),
            by_keys(
                c,
                "SELECT id, state FROM ledger WHERE event_id = ANY($1)",
                &self.events
            ),
        )?;
        let states = |keys: Vec<String>, rows: Vec<tokio_postgres::Row>| {
            let mut map: HashMap<String, Option<String>> =
                keys.into_iter().map(|k| (k, None)).collect();
            map.extend(rows.iter().map(|r| (r.get(0), Some(r.get(1)))));
            map
        };
        let conversations = states(self.conversations, convs);
        let mut end_users = states(self.end_users, users);
        let theirs = conversation_end_users(&conversations, &end_users);
        if !theirs.is_empty() {
            let sql = "SELECT id, state FROM end_users WHERE id = ANY($1)";
            let rows = by_keys(c, sql, &theirs).await?;
            end_users.extend(states(theirs, rows));
        }
        let mut cache = Cache {
            conversations,
            end_users,
            bots: states(self.bots, bots),
            ledger_events: self.events.into_iter().collect(),
            ledger: ledger.iter().map(|r| (r.get(0), r.get(1))).collect(),
            ..Cache::default()
        };
        cache.marks = self.partitions.into_iter().map(|p| (p, None)).collect();
        cache
            .marks
            .extend(marks.iter().map(|r| (r.get(0), Some(num(r.get(1))))));
        Ok(cache)
    }
}

/// The end users the stored `conversations` name that `end_users` does not hold yet (the rules
/// read a conversation's end user for each of its events).
fn conversation_end_users(
    conversations: &HashMap<String, Option<String>>,
    end_users: &HashMap<String, Option<String>>,
) -> Vec<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        end_user_id: Option<String>,
    }
    let mut wanted: Vec<String> = conversations
        .values()
        .flatten()
        .filter_map(|text| serde_json::from_str::<Named>(text).ok()?.end_user_id)
        .filter(|id| !end_users.contains_key(id))
        .collect();
    wanted.sort_unstable();
    wanted.dedup();
    wanted
}

/// A JSON document of a state to write.
pub(crate) fn state_json<T: serde::Serialize>(state: &T) -> Result<String, PgError> {
    json(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The standing as the SQL of `reads::standing` counts it, row by row.
    fn counted(
        queue: &[(Millis, String)],
        own: Option<(Millis, &str)>,
        found: &[(Millis, &str)],
    ) -> (usize, usize) {
        let left: Vec<&(Millis, String)> = queue
            .iter()
            .filter(|(s, c)| !found.contains(&(*s, c.as_str())))
            .collect();
        let ahead = own.map_or(0, |own| {
            left.iter().filter(|(s, c)| (*s, c.as_str()) < own).count()
        });
        (left.len(), ahead)
    }

    #[test]
    fn held_queues_keep_to_their_budget_and_let_the_longest_go() {
        let join = |bot: &str, since: Millis, c: &str| QueueEntry {
            bot: bot.into(),
            since,
            conversation: c.into(),
        };
        let mut held = HeldQueues::default();
        held.bots.insert("a".into(), Some(vec![(1, "x".into())]));
        held.bots.insert("b".into(), Some(vec![]));
        held.apply(&[], &[join("b", 1, "y"), join("b", 2, "z")], 3);
        assert_eq!(held.held(), 3, "within the budget");
        held.apply(&[], &[join("b", 3, "w")], 3);
        assert_eq!(held.bots.get("b"), Some(&None), "the longest let go");
        assert_eq!(held.held(), 1);
        held.apply(&[], &[join("b", 4, "v"), join("a", 2, "u")], 3);
        assert_eq!(held.bots.get("b"), Some(&None), "not taken back by a join");
        assert_eq!(held.held(), 2);
    }

    #[test]
    fn a_held_queue_answers_standings_as_the_database_counts_them() {
        let queue: Vec<(Millis, String)> = [(1, "c1"), (2, "c2"), (2, "c2b"), (5, "c5"), (9, "c9")]
            .iter()
            .map(|(s, c)| (*s, (*c).to_owned()))
            .collect();
        type Spot = (Millis, &'static str);
        let cases: [(Option<Spot>, Vec<Spot>); 7] = [
            (None, vec![]),
            (Some((2, "c2b")), vec![]),
            (Some((10, "new")), vec![]),
            (Some((0, "first")), vec![(5, "c5")]),
            // Found there, found with another `since` (not there), found twice.
            (Some((5, "c5")), vec![(1, "c1"), (2, "c2x"), (9, "c9")]),
            (Some((5, "c5")), vec![(1, "c1"), (1, "c1")]),
            (None, vec![(2, "c2"), (3, "gone")]),
        ];
        for (own, found) in cases {
            let spot = |(since, conversation): (Millis, &'static str)| QueueSpot {
                since,
                conversation,
            };
            let mut spots = found.iter().map(|f| spot(*f));
            let held = standing_in(&queue, own.map(spot), &mut spots);
            assert_eq!(
                held,
                counted(&queue, own, &found),
                "own {own:?}, found {found:?}"
            );
        }
    }
}
