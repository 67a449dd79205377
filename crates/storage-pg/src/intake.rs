//! Intake: deliveries stored in groups, one transaction each (under the events lock, numbers
//! drawn in order, duplicates dropped by the unique ids), committed before any is answered
//! ([`PgWriter`], the daemon's; [`Ingest`] for offline use); the backfill cursor and the agent
//! API's idempotency records.

use crate::prepared::{by_keys, Prepared};
use crate::rows::{big, cursor, json, num, parse};
use crate::{PgError, PgStore, CALL_TIMEOUT};
use deadpool_postgres::GenericClient;
use model::ids::{DeliveryId, PartitionKey};
use model::webhook::model::Millis;
use model::webhook::IncomingEvent;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use storage::idempotency::IdempotencyRecord;
use storage::port::{Ingest, IntakeReply, IntakeWriter, Writer};
use storage::writer::{AcceptJob, WriterError, WriterHooks};
use storage::{AcceptRequest, Accepted, NewEvent, QuarantineRecord, Store, StoreError};
use tokio::sync::mpsc;

/// At most this many deliveries share a group (one transaction).
const MAX_GROUP: usize = 512;
/// How often an idle writer checks that the database takes a query (`/readyz`).
const PROBE_EVERY: Duration = Duration::from_secs(2);

/// An event to store, owned (the work runs on the store's runtime).
struct EventRow {
    id: String,
    partition: PartitionKey,
    kind: String,
    body: String,
}

/// A delivery to store, owned.
struct Request {
    delivery: String,
    received_at: Millis,
    events: Vec<EventRow>,
    invalid: Vec<QuarantineRecord>,
}

impl Request {
    fn of(r: &AcceptRequest<'_>) -> Request {
        Request {
            delivery: r.delivery.as_str().to_owned(),
            received_at: r.received_at,
            events: r.events.iter().map(event_row).collect(),
            invalid: r.invalid.to_vec(),
        }
    }
}

fn event_row(ev: &IncomingEvent) -> EventRow {
    #[derive(serde::Deserialize)]
    struct Kind {
        event: String,
    }
    let kind = serde_json::from_str::<Kind>(&ev.raw).map_or_else(|_| String::new(), |k| k.event);
    EventRow {
        id: ev.event.id.as_str().to_owned(),
        partition: ev.partition.clone(),
        kind,
        body: ev.raw.clone(),
    }
}

/// The new rows of a group, in acceptance order (numbered once drawn).
#[derive(Default)]
struct NewRows {
    ids: Vec<String>,
    deliveries: Vec<String>,
    received: Vec<i64>,
    partitions: Vec<String>,
    kinds: Vec<String>,
    bodies: Vec<String>,
}

/// Store `requests` in one transaction under the events lock: each delivery's new events
/// numbered in acceptance order, known delivery and event ids dropped (against the table and
/// against the group itself), invalid events quarantined for a delivery seen first.
async fn store_group(
    client: &mut deadpool_postgres::Object,
    events_lock: i64,
    requests: &[Request],
) -> Result<Vec<Accepted>, PgError> {
    let tx = client.transaction().await?;
    tx.exec("SELECT pg_advisory_xact_lock($1)", &[&events_lock])
        .await?;
    let (mut deliveries, mut ids) = known_ids(&tx, requests).await?;
    let mut rows = NewRows::default();
    let mut out = Vec::with_capacity(requests.len());
    let mut new_deliveries: Vec<(String, i64)> = Vec::new();
    for r in requests {
        let accepted = judge(r, (&mut deliveries, &mut ids), &mut rows);
        if !accepted.duplicate_delivery && (!accepted.new.is_empty() || !r.invalid.is_empty()) {
            new_deliveries.push((r.delivery.clone(), r.received_at));
        }
        out.push(accepted);
    }
    let seqs = draw(&tx, "event_seq", rows.ids.len()).await?;
    let mut next = seqs.iter();
    for accepted in &mut out {
        for (seq, _) in &mut accepted.new {
            *seq = next
                .next()
                .copied()
                .ok_or(PgError::Internal("too few numbers"))?;
        }
    }
    insert_events(&tx, &seqs, &rows).await?;
    let (names, times): (Vec<String>, Vec<i64>) = new_deliveries.into_iter().unzip();
    tx.exec(
        "INSERT INTO deliveries (id, received_at) SELECT * FROM unnest($1::text[], $2::bigint[]) \
         ON CONFLICT DO NOTHING",
        &[&names, &times],
    )
    .await?;
    for (r, accepted) in requests.iter().zip(&mut out) {
        if accepted.duplicate_delivery {
            continue;
        }
        for bad in &r.invalid {
            accepted
                .quarantined
                .push(crate::reads::insert_quarantine(&tx, bad).await?);
        }
    }
    tx.commit().await?;
    Ok(out)
}

/// The group's delivery ids and event ids the store already holds.
async fn known_ids(
    tx: &deadpool_postgres::Transaction<'_>,
    requests: &[Request],
) -> Result<(HashSet<String>, HashSet<String>), PgError> {
    let deliveries: Vec<&str> = requests.iter().map(|r| r.delivery.as_str()).collect();
    let ids: Vec<&str> = requests
        .iter()
        .flat_map(|r| r.events.iter().map(|e| e.id.as_str()))
        .collect();
    let tx: &tokio_postgres::Transaction<'_> = tx;
    let (known_deliveries, known_ids) = tokio::try_join!(
        by_keys(
            tx,
            "SELECT id FROM deliveries WHERE id = ANY($1)",
            &deliveries
        ),
        by_keys(tx, "SELECT id FROM events WHERE id = ANY($1)", &ids),
    )?;
    let set = |rows: Vec<tokio_postgres::Row>| rows.iter().map(|r| r.get(0)).collect();
    Ok((set(known_deliveries), set(known_ids)))
}

/// One delivery judged against the ids known so far (which it adds to): a known delivery id
/// makes all its events duplicates; each new event becomes a row (numbered later).
fn judge(
    r: &Request,
    (deliveries, ids): (&mut HashSet<String>, &mut HashSet<String>),
    rows: &mut NewRows,
) -> Accepted {
    if deliveries.contains(&r.delivery) {
        return Accepted {
            duplicate_delivery: true,
            duplicate_events: r.events.len(),
            ..Accepted::default()
        };
    }
    let mut accepted = Accepted::default();
    for (index, e) in r.events.iter().enumerate() {
        if !ids.insert(e.id.clone()) {
            accepted.duplicate_events += 1;
            continue;
        }
        accepted.new.push((0, e.partition.clone()));
        accepted.new_index.push(index);
        rows.ids.push(e.id.clone());
        rows.deliveries.push(r.delivery.clone());
        rows.received.push(r.received_at);
        rows.partitions.push(e.partition.encode());
        rows.kinds.push(e.kind.clone());
        rows.bodies.push(e.body.clone());
    }
    if !accepted.new.is_empty() || !r.invalid.is_empty() {
        deliveries.insert(r.delivery.clone());
    }
    accepted
}

/// `n` numbers from `sequence`, ascending.
pub(crate) async fn draw(
    tx: &impl GenericClient,
    sequence: &str,
    n: usize,
) -> Result<Vec<u64>, PgError> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let sql =
        format!("SELECT nextval('{sequence}') AS n FROM generate_series(1, $1::bigint) ORDER BY n");
    let rows = tx.rows(&sql, &[&big(n as u64)]).await?;
    Ok(rows.iter().map(|r| num(r.get(0))).collect())
}

async fn insert_events(
    tx: &deadpool_postgres::Transaction<'_>,
    seqs: &[u64],
    rows: &NewRows,
) -> Result<(), PgError> {
    if seqs.is_empty() {
        return Ok(());
    }
    let seqs: Vec<i64> = seqs.iter().map(|s| big(*s)).collect();
    tx.exec(
        "INSERT INTO events (seq, id, delivery, received_at, partition, kind, body) \
         SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::bigint[], $5::text[], \
         $6::text[], $7::text[])",
        &[
            &seqs,
            &rows.ids,
            &rows.deliveries,
            &rows.received,
            &rows.partitions,
            &rows.kinds,
            &rows.bodies,
        ],
    )
    .await?;
    Ok(())
}

impl PgStore {
    fn store(&self, requests: Vec<Request>) -> Result<Vec<Accepted>, StoreError> {
        let lock = self.0.locks.events;
        self.with_client(move |mut client| async move {
            store_group(&mut client, lock, &requests).await
        })
    }

    /// The next event number the sequence will give (where a writer starting now begins).
    fn next_event_seq(&self) -> Result<u64, StoreError> {
        self.with_client(|client| async move {
            let row = client
                .row(
                    "SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END \
                     FROM event_seq",
                    &[],
                )
                .await?;
            Ok(num(row.get(0)))
        })
    }
}

impl Ingest for PgStore {
    fn accept(
        &self,
        delivery: &DeliveryId,
        events: &[IncomingEvent],
        now: Millis,
    ) -> Result<Accepted, StoreError> {
        let request = AcceptRequest {
            delivery,
            events,
            invalid: &[],
            received_at: now,
        };
        let mut out = self.accept_many(&[request])?;
        out.pop()
            .ok_or_else(|| StoreError::Internal("accept: no answer".into()))
    }

    fn accept_many(&self, requests: &[AcceptRequest<'_>]) -> Result<Vec<Accepted>, StoreError> {
        self.store(requests.iter().map(Request::of).collect())
    }

    fn backfill_cursor(&self) -> Result<Option<Millis>, StoreError> {
        self.with_client(|client| async move {
            let row = client
                .row_opt("SELECT value FROM meta WHERE key = 'backfill_cursor'", &[])
                .await?;
            Ok(row.map(|r| r.get(0)))
        })
    }

    fn set_backfill_cursor(&self, at: Millis) -> Result<(), StoreError> {
        let active = self.active();
        self.with_client(move |mut client| async move {
            let tx = crate::begin_active(&mut client, &active).await?;
            tx.exec(
                "INSERT INTO meta (key, value) VALUES ('backfill_cursor', $1) \
                 ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                &[&at],
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
    }

    fn idempotent_answer(
        &self,
        route: &str,
        idempotency_key: &str,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        let (route, key) = (route.to_owned(), idempotency_key.to_owned());
        self.with_client(move |client| async move {
            let row = client
                .row_opt(
                    "SELECT record FROM idempotency WHERE route = $1 AND key = $2",
                    &[&route, &key],
                )
                .await?;
            row.map(|r| parse(r.get(0), "idempotency record"))
                .transpose()
        })
    }

    fn record_idempotent_answer(
        &self,
        route: &str,
        idempotency_key: &str,
        record: &IdempotencyRecord,
    ) -> Result<(), StoreError> {
        let (route, key, at) = (route.to_owned(), idempotency_key.to_owned(), record.at);
        let text = json(record)?;
        self.with_client(move |client| async move {
            client
                .exec(
                    "INSERT INTO idempotency (route, key, at, record) VALUES ($1, $2, $3, $4) \
                     ON CONFLICT (route, key) DO UPDATE SET at = excluded.at, \
                     record = excluded.record",
                    &[&route, &key, &at, &text],
                )
                .await?;
            Ok(())
        })
    }
}

/// What the writer's callers send it.
enum Job {
    Accept(AcceptJob, IntakeReply<Accepted>),
    /// Answered after the groups taken before it (each of them committed, or failed).
    Flush(IntakeReply<()>),
}

/// The PostgreSQL store's intake: one task on the store's runtime takes every delivery queued
/// at that moment (up to [`MAX_GROUP`]) and stores them in one transaction, committed before any
/// is answered; then hands their new events to the dispatcher, in number order (which is commit
/// order: the crate's docs), and answers. While the database is away each group fails (503),
/// nothing is answered that did not commit, and the task goes on with the next.
pub struct PgWriter {
    jobs: mpsc::UnboundedSender<Job>,
    shared: Arc<Shared>,
    port: tokio::sync::watch::Sender<Option<Store>>,
}

/// What the writer's task and its handle share.
struct Shared {
    healthy: AtomicBool,
    handed_over: AtomicU64,
}

impl PgWriter {
    /// Start the writer on `store`'s runtime.
    pub fn start(store: PgStore, hooks: WriterHooks) -> Result<Writer, StoreError> {
        let from = store.next_event_seq()?;
        *store
            .0
            .writer_from
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(from);
        let (jobs, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            healthy: AtomicBool::new(true),
            handed_over: AtomicU64::new(0),
        });
        let (port, _) = tokio::sync::watch::channel(Some(Arc::new(store.clone()) as Store));
        store.handle().spawn(run(
            store.clone(),
            rx,
            std::sync::Mutex::new(hooks),
            shared.clone(),
        ));
        Ok(Writer::new(Arc::new(PgWriter { jobs, shared, port })))
    }
}

impl IntakeWriter for PgWriter {
    fn accept(&self, job: AcceptJob, reply: IntakeReply<Accepted>) {
        // A stopped writer drops the job and its reply: the caller hears it stopped.
        let _ = self.jobs.send(Job::Accept(job, reply));
    }

    fn flush(&self, reply: IntakeReply<()>) {
        let _ = self.jobs.send(Job::Flush(reply));
    }

    /// Every commit is durable when it returns: nothing to wait for.
    fn flush_own(&self, reply: IntakeReply<()>) {
        let _ = reply.send(Ok(()));
    }

    fn is_healthy(&self) -> bool {
        self.shared.healthy.load(Ordering::Relaxed)
    }

    fn store(&self) -> tokio::sync::watch::Receiver<Option<Store>> {
        self.port.subscribe()
    }

    fn handed_over(&self) -> Option<u64> {
        Some(self.shared.handed_over.load(Ordering::SeqCst))
    }
}

/// The writer's task: a group at a time; an idle writer probes the database now and then.
async fn run(
    store: PgStore,
    mut rx: mpsc::UnboundedReceiver<Job>,
    hooks: std::sync::Mutex<WriterHooks>,
    shared: Arc<Shared>,
) {
    let mut probe = tokio::time::interval(PROBE_EVERY);
    probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let first = tokio::select! {
            job = rx.recv() => match job {
                Some(job) => job,
                None => return,
            },
            _ = probe.tick() => {
                let ok = probe_database(&store).await;
                shared.healthy.store(ok, Ordering::Relaxed);
                continue;
            }
        };
        let mut accepts = Vec::new();
        let mut flushes = Vec::new();
        let mut next = Some(first);
        while let Some(job) = next.take() {
            match job {
                Job::Accept(job, reply) => accepts.push((job, reply)),
                Job::Flush(reply) => flushes.push(reply),
            }
            if accepts.len() + flushes.len() < MAX_GROUP {
                next = rx.try_recv().ok();
            }
        }
        if !accepts.is_empty() {
            group(&store, accepts, &hooks, &shared).await;
            probe.reset();
        }
        for reply in flushes {
            let _ = reply.send(Ok(()));
        }
    }
}

/// Whether the database answers a query now.
async fn probe_database(store: &PgStore) -> bool {
    let pool = store.0.pool.clone();
    let probe = async move {
        let client = pool.get().await?;
        client.row("SELECT 1", &[]).await?;
        Ok::<(), PgError>(())
    };
    matches!(tokio::time::timeout(PROBE_EVERY, probe).await, Ok(Ok(())))
}

/// Store one group, then (committed) hand its new events on and answer each delivery; or
/// answer each that it failed.
async fn group(
    store: &PgStore,
    accepts: Vec<(AcceptJob, IntakeReply<Accepted>)>,
    hooks: &std::sync::Mutex<WriterHooks>,
    shared: &Shared,
) {
    let started = Instant::now();
    let requests: Vec<Request> = accepts
        .iter()
        .map(|(job, _)| Request::of(&job.request()))
        .collect();
    let (pool, lock) = (store.0.pool.clone(), store.0.locks.events);
    let stored = tokio::time::timeout(CALL_TIMEOUT, async move {
        let mut client = pool.get().await?;
        store_group(&mut client, lock, &requests).await
    })
    .await
    .unwrap_or(Err(PgError::Timeout));
    let accepted = match stored {
        Ok(accepted) => accepted,
        Err(e) => {
            tracing::error!(error = %e, deliveries = accepts.len(), "cannot store deliveries");
            shared.healthy.store(false, Ordering::Relaxed);
            for (_, reply) in accepts {
                let _ = reply.send(Err(WriterError::Store(e.to_string())));
            }
            return;
        }
    };
    shared.healthy.store(true, Ordering::Relaxed);
    // Only this task takes it.
    let hooks = hooks.lock().unwrap_or_else(|p| p.into_inner());
    (hooks.observe)(started.elapsed(), accepts.len());
    let mut new = Vec::new();
    let mut replies = Vec::with_capacity(accepts.len());
    for ((job, reply), accepted) in accepts.into_iter().zip(accepted) {
        let received_at = job.received_at;
        let events = accepted.pick_new(job.events);
        new.extend(
            accepted
                .new
                .iter()
                .zip(events)
                .map(|((seq, partition), ev)| NewEvent {
                    seq: *seq,
                    partition: partition.clone(),
                    at: cursor(*seq),
                    received_at,
                    event: ev.event,
                }),
        );
        replies.push((reply, accepted));
    }
    // Handed over (counted first) before any delivery is answered.
    if let Some(last) = new.last().map(|e| e.seq) {
        shared.handed_over.fetch_add(1, Ordering::SeqCst);
        (hooks.durable)(new, cursor(last + 1));
    }
    for (reply, accepted) in replies {
        let _ = reply.send(Ok(accepted));
    }
}
