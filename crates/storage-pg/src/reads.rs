//! Reads of committed folds (records by key, keyed pages, the indexes and counts the folds
//! keep), quarantine records and the console's audit list.

use crate::fold::{record, EVENT_COLUMNS};
use crate::intake::draw;
use crate::outbox::add_counts;
use crate::prepared::Prepared;
use crate::rows::{big, json, num, parse};
use crate::{PgError, PgStore};
use base64::Engine as _;
use deadpool_postgres::GenericClient;
use engine::state::desk::DeskPhase;
use engine::state::queue::Standing;
use engine::state::stats::{self, HandoffStats};
use engine::state::{BotState, ConversationState, EndUserState};
use model::ids::{ConversationId, EndUserId, EventId, PartitionKey};
use model::webhook::model::Millis;
use std::collections::HashMap;
use storage::desk::{DeskCursor, DeskPage};
use storage::keys;
use storage::operators::OperatorAction;
use storage::port::{OperatorLog, Quarantine, Reads, ReplayEvents};
use storage::queue::{BotWaiting, QueueSummary};
use storage::watch::Watched;
use storage::{EventRecord, QuarantineMeta, QuarantineRecord, Sizes, StoreError};

/// Whether an event (`e`, joined with its partition's `f`) is still to fold.
const PENDING: &str = "(e.seq >= (SELECT value FROM meta WHERE key = 'fold_from') \
                       AND (f.mark IS NULL OR e.seq > f.mark))";

/// How many wait for `bot`, and how many of them sort before `own`, leaving out those of `found`
/// that are there (`FoldReads::waiting_standing`).
pub(crate) async fn standing(
    c: &impl GenericClient,
    bot: &str,
    own: Option<&(Millis, String)>,
    found: &[(Millis, String)],
) -> Result<(usize, usize), PgError> {
    let (since, conversation) = own.map_or((i64::MIN, ""), |(s, c)| (*s, c.as_str()));
    let (sinces, ids): (Vec<Millis>, Vec<&str>) =
        found.iter().map(|(s, c)| (*s, c.as_str())).unzip();
    let row = c
        .row(
            "SELECT count(*), count(*) FILTER (WHERE (w.since, w.conversation) < ($2, $3)) \
             FROM waiting w WHERE w.bot = $1 AND NOT EXISTS (SELECT 1 FROM \
             unnest($4::bigint[], $5::text[]) AS f(since, conversation) \
             WHERE f.since = w.since AND f.conversation = w.conversation)",
            &[&bot, &since, &conversation, &sinces, &ids],
        )
        .await?;
    Ok((num(row.get(0)) as usize, num(row.get(1)) as usize))
}

/// The queue positions of `wanted` (conversation, bot, since): one plus how many of the bot's
/// waiting sort before each, all in one statement (each count a range of `waiting`'s primary
/// key), not a statement per conversation: a page of 100 made 100 round trips, each counting
/// every waiting conversation of the bot (issue 38's scale-pg: p99 210 ms at 1,000 a bot).
async fn positions(
    c: &impl GenericClient,
    wanted: Vec<(String, String, Millis)>,
) -> Result<HashMap<String, usize>, PgError> {
    if wanted.is_empty() {
        return Ok(HashMap::new());
    }
    let mut ids = Vec::with_capacity(wanted.len());
    let mut bots = Vec::with_capacity(wanted.len());
    let mut sinces = Vec::with_capacity(wanted.len());
    for (id, bot, since) in wanted {
        ids.push(id);
        bots.push(bot);
        sinces.push(since);
    }
    let rows = c
        .rows(
            "SELECT w.id, (SELECT count(*) FROM waiting q WHERE q.bot = w.bot \
             AND (q.since, q.conversation) < (w.since, w.id)) \
             FROM unnest($1::text[], $2::text[], $3::bigint[]) AS w(id, bot, since)",
            &[&ids, &bots, &sinces],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), num(r.get(1)) as usize + 1))
        .collect())
}

/// What a replay of `[from, to)` re-runs (`FoldSession::replay_events`).
pub(crate) async fn replay_events(
    c: &impl GenericClient,
    from: Millis,
    to: Millis,
) -> Result<ReplayEvents, PgError> {
    let sql = format!(
        "SELECT e.seq, e.partition, {PENDING} FROM events e LEFT JOIN folded f \
         ON f.partition = e.partition WHERE e.received_at >= $1 AND e.received_at < $2 \
         AND e.partition LIKE 'c:%' ORDER BY e.seq"
    );
    let mut out = ReplayEvents::default();
    let (mut wanted, mut last) = (Vec::<String>::new(), None);
    for row in c.rows(&sql, &[&from, &to]).await? {
        match row.get::<_, bool>(2) {
            true => out.pending += 1,
            false => {
                wanted.push(row.get(1));
                last = Some(row.get::<_, i64>(0));
            }
        }
    }
    let Some(last) = last else { return Ok(out) };
    wanted.sort();
    wanted.dedup();
    let sql = format!(
        "SELECT {EVENT_COLUMNS} FROM events e LEFT JOIN folded f ON f.partition = e.partition \
         WHERE e.partition = ANY($1) AND e.seq <= $2 AND NOT {PENDING} ORDER BY e.seq"
    );
    for row in c.rows(&sql, &[&wanted, &last]).await? {
        out.events.extend(storage::replayed(record(&row)?));
    }
    Ok(out)
}

/// Store a quarantine record (its body as bytes); its new id.
pub(crate) async fn insert_quarantine(
    c: &impl GenericClient,
    record: &QuarantineRecord,
) -> Result<u64, PgError> {
    let id = draw(c, "quarantine_seq", 1)
        .await?
        .pop()
        .ok_or(PgError::Internal("no quarantine number"))?;
    insert_quarantine_as(c, id, record).await?;
    add_counts(c, &[("quarantine", 1)]).await?;
    Ok(id)
}

/// Store a quarantine record under `id` (its body as bytes), not counted.
pub(crate) async fn insert_quarantine_as(
    c: &impl GenericClient,
    id: u64,
    record: &QuarantineRecord,
) -> Result<(), PgError> {
    let body = base64::engine::general_purpose::STANDARD
        .decode(&record.body_base64)
        .map_err(|e| PgError::Corrupt {
            what: "quarantine body",
            detail: e.to_string(),
        })?;
    let meta = QuarantineRecord {
        id,
        body_base64: String::new(),
        ..record.clone()
    };
    c.exec(
        "INSERT INTO quarantine (id, received_at, meta, body_gzip, body_bytes, body) \
         VALUES ($1, $2, $3, $4, $5, $6)",
        &[
            &big(id),
            &record.received_at,
            &json(&meta)?,
            &record.body_gzip,
            &big(record.body_len()),
            &body,
        ],
    )
    .await?;
    Ok(())
}

/// A quarantine row (`meta`, `body`) as its record.
fn quarantine_record(row: &tokio_postgres::Row) -> Result<QuarantineRecord, PgError> {
    let mut record: QuarantineRecord = parse(row.get(0), "quarantine record")?;
    record.body_base64 = base64::engine::general_purpose::STANDARD.encode(row.get::<_, &[u8]>(1));
    Ok(record)
}

impl PgStore {
    fn state_of<T: serde::de::DeserializeOwned + Send + 'static>(
        &self,
        sql: &'static str,
        key: String,
        what: &'static str,
    ) -> Result<Option<T>, StoreError> {
        self.with_client(move |c| async move {
            let row = c.row_opt(sql, &[&key]).await?;
            row.map(|r| parse(r.get(0), what)).transpose()
        })
    }

    fn states_page<T: serde::de::DeserializeOwned + Send + 'static>(
        &self,
        sql: &'static str,
        after: Option<&str>,
        limit: usize,
        what: &'static str,
    ) -> Result<Vec<T>, StoreError> {
        let after = after.map(str::to_owned);
        self.with_client(move |c| async move {
            let rows = c.rows(sql, &[&after, &big(limit as u64)]).await?;
            rows.iter().map(|r| parse(r.get(0), what)).collect()
        })
    }

    /// The keys of `derived` in `[from, to)`, at most `limit`, in order.
    fn derived_range(
        &self,
        ranges: Vec<(Vec<u8>, Vec<u8>)>,
        limit: usize,
    ) -> Result<Vec<Vec<Vec<u8>>>, StoreError> {
        self.with_client(move |c| async move {
            let mut out = Vec::with_capacity(ranges.len());
            for (from, to) in &ranges {
                let rows = c
                    .rows(
                        "SELECT key FROM derived WHERE key >= $1 AND key < $2 ORDER BY key LIMIT $3",
                        &[from, to, &big(limit as u64)],
                    )
                    .await?;
                out.push(rows.iter().map(|r| r.get(0)).collect());
            }
            Ok(out)
        })
    }

    fn conversations_by_id(
        &self,
        ids: Vec<String>,
    ) -> Result<HashMap<String, ConversationState>, StoreError> {
        self.with_client(move |c| async move {
            let rows = c
                .rows(
                    "SELECT id, state FROM conversations WHERE id = ANY($1)",
                    &[&ids],
                )
                .await?;
            rows.iter()
                .map(|r| Ok((r.get(0), parse(r.get(1), "conversation state")?)))
                .collect()
        })
    }

    fn events_where(
        &self,
        sql: String,
        key: String,
    ) -> Result<Vec<(EventRecord, bool)>, StoreError> {
        self.with_client(move |c| async move {
            let rows = c.rows(&sql, &[&key]).await?;
            rows.iter().map(|r| Ok((record(r)?, r.get(7)))).collect()
        })
    }
}

impl Reads for PgStore {
    fn conversation(&self, id: &ConversationId) -> Result<Option<ConversationState>, StoreError> {
        let sql = "SELECT state FROM conversations WHERE id = $1";
        self.state_of(sql, id.as_str().to_owned(), "conversation state")
    }

    fn end_user(&self, id: &EndUserId) -> Result<Option<EndUserState>, StoreError> {
        let sql = "SELECT state FROM end_users WHERE id = $1";
        self.state_of(sql, id.as_str().to_owned(), "end-user state")
    }

    fn bot(&self, id: &str) -> Result<Option<BotState>, StoreError> {
        self.state_of(
            "SELECT state FROM bots WHERE id = $1",
            id.to_owned(),
            "bot state",
        )
    }

    fn find_end_user(
        &self,
        platform: &str,
        user_key: &str,
    ) -> Result<Option<EndUserState>, StoreError> {
        let (platform, key) = (platform.to_owned(), user_key.to_owned());
        self.with_client(move |c| async move {
            let row = c
                .row_opt(
                    "SELECT state FROM end_users WHERE platform = $1 AND user_key = $2 \
                     ORDER BY id LIMIT 1",
                    &[&platform, &key],
                )
                .await?;
            row.map(|r| parse(r.get(0), "end-user state")).transpose()
        })
    }

    fn conversations_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ConversationState>, StoreError> {
        let sql = "SELECT state FROM conversations WHERE $1::text IS NULL OR id > $1 \
                   ORDER BY id LIMIT $2";
        self.states_page(sql, after, limit, "conversation state")
    }

    fn end_users_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<EndUserState>, StoreError> {
        let sql = "SELECT state FROM end_users WHERE $1::text IS NULL OR id > $1 \
                   ORDER BY id LIMIT $2";
        self.states_page(sql, after, limit, "end-user state")
    }

    /// sled's listing over the same keys: a range per phase, merged by position, then the
    /// listed conversations' states (one that moved meanwhile is left out).
    fn desk_page(
        &self,
        phase: Option<DeskPhase>,
        bot: Option<&str>,
        after: Option<&DeskCursor>,
        limit: usize,
    ) -> Result<DeskPage, StoreError> {
        let phases = phase.map_or_else(|| DeskPhase::ALL.to_vec(), |p| vec![p]);
        let prefix_of = |p: DeskPhase| match bot {
            Some(b) => keys::desk_bot_prefix(b, p.byte()),
            None => keys::desk_phase_prefix(p.byte()),
        };
        let ranges: Vec<(Vec<u8>, Vec<u8>)> = phases
            .iter()
            .map(|p| {
                let prefix = prefix_of(*p);
                let mut start = prefix.clone();
                if let Some(cursor) = after {
                    start.extend_from_slice(cursor.position());
                    start.push(0); // the first key after the cursor's
                }
                let end = keys::prefix_end(&prefix);
                (start, end)
            })
            .collect();
        let lens: Vec<usize> = phases.iter().map(|p| prefix_of(*p).len()).collect();
        let found = self.derived_range(ranges, limit.saturating_add(1))?;
        let mut listed: Vec<Vec<u8>> = found
            .into_iter()
            .zip(lens)
            .flat_map(|(keys, len)| {
                keys.into_iter()
                    .map(move |k| k.get(len..).unwrap_or_default().to_vec())
            })
            .collect();
        listed.sort();
        listed.truncate(limit.saturating_add(1));
        let next = (listed.len() > limit)
            .then(|| limit.checked_sub(1).and_then(|last| listed.get(last)))
            .flatten()
            .map(|p| DeskCursor::at(p.clone()));
        listed.truncate(limit);
        let positions: Vec<(Option<Millis>, String)> = listed
            .iter()
            .filter_map(|p| keys::parse_desk_position(p).map(|(at, id)| (at, id.to_owned())))
            .collect();
        let mut states =
            self.conversations_by_id(positions.iter().map(|(_, id)| id.clone()).collect())?;
        let conversations = positions
            .into_iter()
            .filter_map(|(at, id)| states.remove(&id).filter(|s| s.handoff.requested_at == at))
            .filter(|s| phase.is_none_or(|p| DeskPhase::of(s) == p))
            .filter(|s| bot.is_none_or(|b| s.bot_id.as_ref().map(|i| i.as_str()) == Some(b)))
            .collect();
        Ok(DeskPage {
            conversations,
            next,
        })
    }

    fn waiting_positions(
        &self,
        states: &[ConversationState],
    ) -> Result<HashMap<String, usize>, StoreError> {
        let wanted: Vec<(String, String, Millis)> = states
            .iter()
            .filter_map(|s| {
                let entry = engine::index::QueueEntry::of(s)?;
                Some((s.id.as_str().to_owned(), entry.bot, entry.since))
            })
            .collect();
        self.with_client(move |c| async move { positions(&c, wanted).await })
    }

    fn watched(&self, released_since: Millis, limit: usize) -> Result<Watched, StoreError> {
        let active = (vec![keys::WATCH_ACTIVE], vec![keys::WATCH_ACTIVE + 1]);
        let released = (
            keys::watch_released(released_since, ""),
            vec![keys::WATCH_RELEASED + 1],
        );
        let mut found = self
            .derived_range(vec![active, released], limit)?
            .into_iter();
        let mut out = Watched::default();
        for key in found.next().unwrap_or_default() {
            out.active
                .extend(keys::parse_watch_active(&key).map(str::to_owned));
        }
        let room = limit.saturating_sub(out.active.len());
        for key in found.next().unwrap_or_default().into_iter().take(room) {
            out.released
                .extend(keys::parse_watch_released(&key).map(|(_, id)| id.to_owned()));
        }
        Ok(out)
    }

    fn queue_summary(&self) -> Result<QueueSummary, StoreError> {
        self.with_client(|c| async move {
            let (count, oldest) = tokio::try_join!(
                c.row(
                    "SELECT coalesce(sum(waiting), 0)::bigint FROM waiting_bots",
                    &[]
                ),
                c.row("SELECT min(since) FROM waiting", &[]),
            )?;
            Ok(QueueSummary {
                waiting: num(count.get(0)),
                oldest_since: oldest.get(0),
            })
        })
    }

    fn waiting_by_bot(&self) -> Result<Vec<BotWaiting>, StoreError> {
        self.with_client(|c| async move {
            let rows = c
                .rows(
                    "SELECT b.bot, b.waiting, (SELECT min(since) FROM waiting w WHERE w.bot = b.bot) \
                     FROM waiting_bots b WHERE b.waiting > 0 ORDER BY b.bot",
                    &[],
                )
                .await?;
            Ok(rows
                .iter()
                .map(|r| BotWaiting {
                    bot: r.get(0),
                    waiting: num(r.get(1)),
                    oldest_since: r.get(2),
                })
                .collect())
        })
    }

    fn queue_standing(&self, id: &ConversationId) -> Result<Option<Standing>, StoreError> {
        let Some(state) = self.conversation(id)? else {
            return Ok(None);
        };
        let Some(bot) = state.bot_id.as_ref().map(|b| b.as_str().to_owned()) else {
            return Ok(Some(Standing::default()));
        };
        let own = engine::index::QueueEntry::of(&state).map(|e| (e.since, e.conversation));
        self.with_client(move |c| async move {
            let (length, ahead) = standing(&c, &bot, own.as_ref(), &[]).await?;
            let row = c
                .row_opt("SELECT history FROM accept_history WHERE bot = $1", &[&bot])
                .await?;
            let history = row
                .map(|r| parse(r.get(0), "accept history"))
                .transpose()?
                .unwrap_or_default();
            let position = own.map(|_| u32::try_from(ahead).unwrap_or(u32::MAX).saturating_add(1));
            let length = u32::try_from(length).unwrap_or(u32::MAX);
            Ok(Some(Standing::new(position, length, &history)))
        })
    }

    fn handoff_stats(&self, since: Millis, until: Millis) -> Result<HandoffStats, StoreError> {
        if until <= since {
            return Ok(HandoffStats::default());
        }
        let (from, to) = (stats::hour_of(since), stats::hour_of(until - 1));
        self.with_client(move |c| async move {
            let rows = c
                .rows(
                    "SELECT stats FROM hour_stats WHERE hour >= $1 AND hour <= $2 ORDER BY hour",
                    &[&from, &to],
                )
                .await?;
            let mut out = HandoffStats::default();
            for row in &rows {
                out.merge(&parse(row.get(0), "handoff stats")?);
            }
            Ok(out)
        })
    }

    fn partition_events(
        &self,
        partition: &PartitionKey,
    ) -> Result<Vec<(EventRecord, bool)>, StoreError> {
        let sql = format!(
            "SELECT {EVENT_COLUMNS}, {PENDING} FROM events e LEFT JOIN folded f \
             ON f.partition = e.partition WHERE e.partition = $1 ORDER BY e.seq"
        );
        self.events_where(sql, partition.encode())
    }

    fn event_status(&self, id: &EventId) -> Result<Option<(EventRecord, bool)>, StoreError> {
        let sql = format!(
            "SELECT {EVENT_COLUMNS}, {PENDING} FROM events e LEFT JOIN folded f \
             ON f.partition = e.partition WHERE e.id = $1"
        );
        Ok(self.events_where(sql, id.as_str().to_owned())?.pop())
    }

    fn event_by_id(&self, id: &EventId) -> Result<Option<EventRecord>, StoreError> {
        Ok(self.event_status(id)?.map(|(record, _)| record))
    }

    fn sizes(&self) -> Result<Sizes, StoreError> {
        self.with_client(|c| async move {
            let rows = c.rows("SELECT key, value FROM meta", &[]).await?;
            let counts: HashMap<String, i64> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
            let count = |key: &str| counts.get(key).copied().map_or(0, num);
            Ok(Sizes {
                conversations: count("conversations"),
                end_users: count("end_users"),
                bots: count("bots"),
                quarantine: count("quarantine"),
            })
        })
    }
}

impl Quarantine for PgStore {
    fn quarantine(&self, record: QuarantineRecord) -> Result<u64, StoreError> {
        self.with_client(move |c| async move { insert_quarantine(&c, &record).await })
    }

    fn quarantined(&self) -> Result<Vec<QuarantineRecord>, StoreError> {
        self.with_client(|c| async move {
            let rows = c
                .rows("SELECT meta, body FROM quarantine ORDER BY id", &[])
                .await?;
            rows.iter().map(quarantine_record).collect()
        })
    }

    fn quarantined_one(&self, id: u64) -> Result<Option<QuarantineRecord>, StoreError> {
        self.with_client(move |c| async move {
            let row = c
                .row_opt(
                    "SELECT meta, body FROM quarantine WHERE id = $1",
                    &[&big(id)],
                )
                .await?;
            row.as_ref().map(quarantine_record).transpose()
        })
    }

    fn quarantine_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<(Vec<QuarantineMeta>, Option<u64>), StoreError> {
        let after = after.map_or(-1, big);
        self.with_client(move |c| async move {
            let rows = c
                .rows(
                    "SELECT meta, body_bytes FROM quarantine WHERE id > $1 ORDER BY id LIMIT $2",
                    &[&after, &big(limit as u64 + 1)],
                )
                .await?;
            let more = rows.len() > limit;
            let mut page = Vec::with_capacity(rows.len().min(limit));
            for row in rows.iter().take(limit) {
                let record: QuarantineRecord = parse(row.get(0), "quarantine record")?;
                let mut meta = record.meta();
                meta.body_bytes = num(row.get(1));
                page.push(meta);
            }
            let next = more.then(|| page.last().map(|m| m.id)).flatten();
            Ok((page, next))
        })
    }

    fn release_quarantined(&self, id: u64) -> Result<bool, StoreError> {
        self.with_client(move |c| async move {
            let gone = c
                .exec("DELETE FROM quarantine WHERE id = $1", &[&big(id)])
                .await?;
            add_counts(&c, &[("quarantine", -(gone as i64))]).await?;
            Ok(gone > 0)
        })
    }
}

impl OperatorLog for PgStore {
    fn record_operator_action(&self, action: &OperatorAction) -> Result<u64, StoreError> {
        let (at, text) = (action.at, json(action)?);
        self.with_client(move |c| async move {
            let row = c
                .row(
                    "INSERT INTO operator_actions (id, at, action) \
                     VALUES (nextval('operator_seq'), $1, $2) RETURNING id",
                    &[&at, &text],
                )
                .await?;
            Ok(num(row.get(0)))
        })
    }

    fn operator_actions_page(
        &self,
        before: Option<u64>,
        limit: usize,
    ) -> Result<Vec<(u64, OperatorAction)>, StoreError> {
        let before = before.map_or(i64::MAX, big);
        self.with_client(move |c| async move {
            let rows = c
                .rows(
                    "SELECT id, action FROM operator_actions WHERE id < $1 ORDER BY id DESC LIMIT $2",
                    &[&before, &big(limit as u64)],
                )
                .await?;
            rows.iter()
                .map(|r| Ok((num(r.get(0)), parse(r.get(1), "operator action")?)))
                .collect()
        })
    }
}
