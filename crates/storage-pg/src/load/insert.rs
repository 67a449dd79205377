//! One batch of dumped records written in the loader's transaction: each kind into its table
//! (`unnest` of arrays, one statement or a few per batch), the states and the waiting queue
//! through the folds' own writers, so the rows and what they derive are what a fold writes.

use super::Merged;
use crate::outbox::{
    write_bots, write_conversations, write_derived, write_end_users, write_queue, write_timers,
};
use crate::prepared::Prepared;
use crate::rows::{big, event_of_action, json};
use crate::PgError;
use deadpool_postgres::Transaction;
use engine::batch::{IndexChanges, QueueChanges, StateWrite, TimerChanges};
use std::collections::BTreeMap;
use storage::dump::{Kind, Record};

/// The counters `meta` keeps, and the table each counts.
pub(super) const COUNTED: [(&str, &str); 6] = [
    ("conversations", "conversations"),
    ("end_users", "end_users"),
    ("bots", "bots"),
    ("quarantine", "quarantine"),
    ("timers", "timers"),
    ("outbox", "outbox"),
];

/// The table a kind's records go into.
pub(super) fn table(kind: Kind) -> &'static str {
    match kind {
        Kind::Delivery => "deliveries",
        Kind::FoldedMark => "folded",
        Kind::Conversation => "conversations",
        Kind::EndUser => "end_users",
        Kind::Bot => "bots",
        Kind::Timer => "timers",
        Kind::Waiting => "waiting",
        Kind::AcceptHistory => "accept_history",
        Kind::HourFigures => "hour_stats",
        Kind::Outbox => "outbox",
        Kind::RetryState => "outbox_retry",
        Kind::DeadLetter => "dead_letters",
        Kind::Done => "outbox_done",
        Kind::Ledger => "ledger",
        Kind::Quarantine => "quarantine",
        Kind::OperatorAction => "operator_actions",
        Kind::Idempotency => "idempotency",
        Kind::DeskLink => "desk_links",
        Kind::DeskContact => "desk_contacts",
    }
}

/// The records of a batch (all of the kind its caller checked), each as `pick` takes it.
fn take<T>(batch: Vec<Record>, pick: impl Fn(Record) -> Option<T>) -> Result<Vec<T>, PgError> {
    batch
        .into_iter()
        .map(|r| pick(r).ok_or(PgError::Internal("a batch holds another kind")))
        .collect()
}

/// Write `batch` (records of `kind`) in `tx`.
pub(super) async fn batch(
    tx: &Transaction<'_>,
    kind: Kind,
    batch: Vec<Record>,
) -> Result<Merged, PgError> {
    match kind {
        Kind::Delivery => return deliveries(tx, batch).await,
        Kind::FoldedMark => folded_marks(tx, batch).await?,
        Kind::Conversation => conversations(tx, batch).await?,
        Kind::EndUser | Kind::Bot => users_and_bots(tx, batch).await?,
        Kind::Timer => {
            let started = take(batch, |r| match r {
                Record::Timer(t) => Some(t),
                _ => None,
            })?;
            let timers = TimerChanges {
                started,
                ..TimerChanges::default()
            };
            write_timers(tx, &timers).await?
        }
        Kind::Waiting | Kind::AcceptHistory | Kind::HourFigures => queue(tx, batch).await?,
        Kind::Outbox | Kind::RetryState | Kind::DeadLetter | Kind::Done => {
            outbox(tx, kind, batch).await?
        }
        Kind::Ledger => ledger(tx, batch).await?,
        Kind::Quarantine => {
            for record in take(batch, |r| match r {
                Record::Quarantine(q) => Some(q),
                _ => None,
            })? {
                crate::reads::insert_quarantine_as(tx, record.id, &record).await?;
            }
        }
        Kind::OperatorAction | Kind::Idempotency => operators(tx, batch).await?,
        Kind::DeskLink => desk_links(tx, batch).await?,
        Kind::DeskContact => desk_contacts(tx, batch).await?,
    }
    Ok(Merged::default())
}

/// An event's columns.
struct EventRow {
    seq: i64,
    delivery: String,
    received_at: i64,
    partition: String,
    kind: String,
    body: String,
}

/// Deliveries and their events. An id met again (in the batch, or stored by an earlier one) is
/// one row, the later copy's, and counted as merged.
async fn deliveries(c: &Transaction<'_>, batch: Vec<Record>) -> Result<Merged, PgError> {
    let (mut deliveries, mut events) = (BTreeMap::new(), BTreeMap::new());
    let mut merged = Merged::default();
    for record in batch {
        let Record::Delivery {
            id,
            received_at,
            events: stored,
        } = record
        else {
            return Err(PgError::Internal("a batch holds another kind"));
        };
        if let Some(earlier) = deliveries.insert(id.as_str().to_owned(), received_at) {
            merged.deliveries += 1;
            deliveries.insert(id.as_str().to_owned(), received_at.max(earlier));
        }
        for e in stored {
            let row = EventRow {
                seq: big(e.seq),
                delivery: e.delivery.as_str().to_owned(),
                received_at: e.received_at,
                partition: e.partition,
                kind: e.kind,
                body: e.event.get().to_owned(),
            };
            if events.insert(e.id.as_str().to_owned(), row).is_some() {
                merged.events += 1;
            }
        }
    }
    let (ids, times): (Vec<String>, Vec<i64>) = deliveries.into_iter().unzip();
    merged.deliveries += known(c, "deliveries", &ids).await?;
    c.exec(
        "INSERT INTO deliveries (id, received_at) SELECT * FROM unnest($1::text[], $2::bigint[]) \
         ON CONFLICT (id) DO UPDATE SET received_at = \
         GREATEST(deliveries.received_at, excluded.received_at)",
        &[&ids, &times],
    )
    .await?;
    insert_events(c, events, &mut merged).await?;
    Ok(merged)
}

/// How many of `ids` `table` holds already.
async fn known(c: &Transaction<'_>, table: &str, ids: &[String]) -> Result<u64, PgError> {
    let sql = format!("SELECT count(*) FROM {table} WHERE id = ANY($1)");
    Ok(crate::rows::num(c.row(&sql, &[&ids]).await?.get(0)))
}

async fn insert_events(
    c: &Transaction<'_>,
    events: BTreeMap<String, EventRow>,
    merged: &mut Merged,
) -> Result<(), PgError> {
    let ids: Vec<String> = events.keys().cloned().collect();
    merged.events += known(c, "events", &ids).await?;
    let rows: Vec<EventRow> = events.into_values().collect();
    let column = |f: fn(&EventRow) -> String| rows.iter().map(f).collect::<Vec<_>>();
    let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
    let received: Vec<i64> = rows.iter().map(|r| r.received_at).collect();
    c.exec(
        "INSERT INTO events (seq, id, delivery, received_at, partition, kind, body) \
         SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::bigint[], $5::text[], \
         $6::text[], $7::text[]) \
         ON CONFLICT (id) DO UPDATE SET seq = excluded.seq, delivery = excluded.delivery, \
         received_at = excluded.received_at, partition = excluded.partition, \
         kind = excluded.kind, body = excluded.body",
        &[
            &seqs,
            &ids,
            &column(|r| r.delivery.clone()),
            &received,
            &column(|r| r.partition.clone()),
            &column(|r| r.kind.clone()),
            &column(|r| r.body.clone()),
        ],
    )
    .await?;
    Ok(())
}

async fn folded_marks(c: &Transaction<'_>, batch: Vec<Record>) -> Result<(), PgError> {
    let (partitions, marks): (Vec<String>, Vec<i64>) = take(batch, |r| match r {
        Record::FoldedMark { partition, mark } => Some((partition, big(mark))),
        _ => None,
    })?
    .into_iter()
    .unzip();
    c.exec(
        "INSERT INTO folded (partition, mark) SELECT * FROM unnest($1::text[], $2::bigint[])",
        &[&partitions, &marks],
    )
    .await?;
    Ok(())
}

/// Conversations with the index entries they derive, as a fold writes them.
async fn conversations(c: &Transaction<'_>, batch: Vec<Record>) -> Result<(), PgError> {
    let states = take(batch, |r| match r {
        Record::Conversation(s) => Some(StateWrite {
            state: *s,
            created: true,
        }),
        _ => None,
    })?;
    let derived = IndexChanges {
        removed: Vec::new(),
        added: states
            .iter()
            .flat_map(|w| engine::index::derived(&w.state))
            .collect(),
    };
    write_conversations(c, &states).await?;
    write_derived(c, &derived).await
}

/// End users (with their messenger identity and activity) or bots, as a fold writes them.
async fn users_and_bots(c: &Transaction<'_>, batch: Vec<Record>) -> Result<(), PgError> {
    let (mut users, mut bots) = (Vec::new(), Vec::new());
    for record in batch {
        match record {
            Record::EndUser(s) => users.push(StateWrite {
                state: *s,
                created: true,
            }),
            Record::Bot(s) => bots.push(StateWrite {
                state: *s,
                created: true,
            }),
            _ => return Err(PgError::Internal("a batch holds another kind")),
        }
    }
    write_end_users(c, &users).await?;
    write_bots(c, &bots).await
}

/// The waiting queue (each bot's count with it), accept histories, hour figures: as a fold
/// writes them.
async fn queue(c: &Transaction<'_>, batch: Vec<Record>) -> Result<(), PgError> {
    let mut changes = QueueChanges::default();
    for record in batch {
        match record {
            Record::Waiting(entry) => changes.joined.push(entry),
            Record::AcceptHistory { bot, history } => changes.accepts.push((bot, history)),
            Record::HourFigures { hour, stats } => changes.hours.push((hour, stats)),
            _ => return Err(PgError::Internal("a batch holds another kind")),
        }
    }
    write_queue(c, &changes).await
}

/// Outbox entries, retry states, dead letters or done records: each by its seq, as a JSON
/// document (and the entry's queue, the record's time).
async fn outbox(c: &Transaction<'_>, kind: Kind, batch: Vec<Record>) -> Result<(), PgError> {
    let sql = match kind {
        Kind::Outbox => "INSERT INTO outbox (seq, queue, entry) SELECT s, q, d",
        Kind::RetryState => "INSERT INTO outbox_retry (seq, state) SELECT s, d",
        Kind::DeadLetter => "INSERT INTO dead_letters (seq, letter) SELECT s, d",
        _ => "INSERT INTO outbox_done (seq, at, record) SELECT s, a, d",
    };
    let (mut seqs, mut queues, mut ats, mut docs) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for record in batch {
        let (seq, queue, at, doc) = match record {
            Record::Outbox(e) => (e.seq, e.queue.clone(), 0, json(&e)?),
            Record::RetryState { seq, state } => (seq, String::new(), 0, json(&state)?),
            Record::DeadLetter(l) => (l.entry.seq, String::new(), 0, json(&l)?),
            Record::Done(d) => (d.entry.seq, String::new(), d.at, json(&d)?),
            _ => return Err(PgError::Internal("a batch holds another kind")),
        };
        seqs.push(big(seq));
        queues.push(queue);
        ats.push(at);
        docs.push(doc);
    }
    let sql = format!(
        "{sql} FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[]) AS x(s, q, a, d)"
    );
    c.exec(&sql, &[&seqs, &queues, &ats, &docs]).await?;
    Ok(())
}

/// The ledger: each action's status, found by its event (the action id's first part).
async fn ledger(c: &Transaction<'_>, batch: Vec<Record>) -> Result<(), PgError> {
    let rows = take(batch, |r| match r {
        Record::Ledger { action_id, status } => Some((action_id, status)),
        _ => None,
    })?;
    let ids: Vec<&str> = rows.iter().map(|(id, _)| id.as_str()).collect();
    let events: Vec<&str> = ids.iter().map(|id| event_of_action(id)).collect();
    let states: Vec<&str> = rows.iter().map(|(_, s)| s.state.as_str()).collect();
    let seqs: Vec<i64> = rows.iter().map(|(_, s)| big(s.seq)).collect();
    let ats: Vec<i64> = rows.iter().map(|(_, s)| s.at).collect();
    let docs = rows
        .iter()
        .map(|(_, s)| json(s))
        .collect::<Result<Vec<_>, _>>()?;
    c.exec(
        "INSERT INTO ledger (id, event_id, state, seq, at, status) \
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[], \
         $6::text[])",
        &[&ids, &events, &states, &seqs, &ats, &docs],
    )
    .await?;
    Ok(())
}

/// The console's audit list or the agent API's idempotency records.
async fn operators(c: &Transaction<'_>, batch: Vec<Record>) -> Result<(), PgError> {
    let (mut ids, mut ats, mut docs) = (Vec::new(), Vec::new(), Vec::new());
    let (mut routes, mut keys, mut times, mut records) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for record in batch {
        match record {
            Record::OperatorAction { id, action } => {
                ids.push(big(id));
                ats.push(action.at);
                docs.push(json(&action)?);
            }
            Record::Idempotency { route, key, record } => {
                times.push(record.at);
                records.push(json(&record)?);
                routes.push(route);
                keys.push(key);
            }
            _ => return Err(PgError::Internal("a batch holds another kind")),
        }
    }
    c.exec(
        "INSERT INTO operator_actions (id, at, action) \
         SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[])",
        &[&ids, &ats, &docs],
    )
    .await?;
    c.exec(
        "INSERT INTO idempotency (route, key, at, record) \
         SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[])",
        &[&routes, &keys, &times, &records],
    )
    .await?;
    Ok(())
}

/// Desk links, and their desk conversations (current and earlier) back to them.
async fn desk_links(c: &Transaction<'_>, batch: Vec<Record>) -> Result<(), PgError> {
    let links = take(batch, |r| match r {
        Record::DeskLink(l) => Some(l),
        _ => None,
    })?;
    let mut remotes = BTreeMap::new();
    for link in &links {
        for remote in link.remote.iter().chain(&link.earlier) {
            let key = (link.connector.clone(), remote.clone());
            remotes.insert(key, link.conversation_id.clone());
        }
    }
    let connectors: Vec<&str> = links.iter().map(|l| l.connector.as_str()).collect();
    let conversations: Vec<&str> = links.iter().map(|l| l.conversation_id.as_str()).collect();
    let closed: Vec<Option<i64>> = links.iter().map(|l| l.closed_at).collect();
    let updated: Vec<i64> = links.iter().map(|l| l.updated_at).collect();
    let docs = links.iter().map(json).collect::<Result<Vec<_>, _>>()?;
    c.exec(
        "INSERT INTO desk_links (connector, conversation, closed_at, updated_at, link) \
         SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::text[])",
        &[&connectors, &conversations, &closed, &updated, &docs],
    )
    .await?;
    let (keys, conversations): (Vec<(String, String)>, Vec<String>) = remotes.into_iter().unzip();
    let (connectors, remotes): (Vec<String>, Vec<String>) = keys.into_iter().unzip();
    c.exec(
        "INSERT INTO desk_remotes (connector, remote, conversation) \
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[])",
        &[&connectors, &remotes, &conversations],
    )
    .await?;
    Ok(())
}

async fn desk_contacts(c: &Transaction<'_>, batch: Vec<Record>) -> Result<(), PgError> {
    let contacts = take(batch, |r| match r {
        Record::DeskContact(d) => Some(d),
        _ => None,
    })?;
    let connectors: Vec<&str> = contacts.iter().map(|d| d.connector.as_str()).collect();
    let users: Vec<&str> = contacts.iter().map(|d| d.user.as_str()).collect();
    let docs = contacts.iter().map(json).collect::<Result<Vec<_>, _>>()?;
    c.exec(
        "INSERT INTO desk_contacts (connector, user_id, contact) \
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[])",
        &[&connectors, &users, &docs],
    )
    .await?;
    Ok(())
}
