//! Work asked of the active node (`Asks`, `storage::asks`): a row an ask, stored by any node;
//! the answer written by the active in a transaction that checks its lease.

use crate::prepared::Prepared;
use crate::rows::{big, json, num, parse};
use crate::PgStore;
use model::webhook::model::Millis;
use storage::asks::{Answer, Ask, AskRecord, Asks, WAITING_MAX};
use storage::StoreError;
use tokio_postgres::Row;

const COLUMNS: &str = "id, asked_at, asked_by, ask, answer";

fn record(row: &Row) -> Result<AskRecord, crate::PgError> {
    let answer: Option<&str> = row.get(4);
    Ok(AskRecord {
        id: num(row.get(0)),
        asked_at: row.get(1),
        by: row.get(2),
        ask: parse(row.get(3), "ask")?,
        answer: answer.map(|a| parse(a, "ask's answer")).transpose()?,
    })
}

impl Asks for PgStore {
    /// One statement: stored unless [`WAITING_MAX`] wait (concurrent asks may pass the bound by
    /// as many as they are).
    fn ask(&self, ask: &Ask, by: &str) -> Result<Option<u64>, StoreError> {
        let (text, by, at) = (json(ask)?, by.to_owned(), self.0.clock.now_millis());
        let max = big(WAITING_MAX as u64);
        self.with_client(move |c| async move {
            let row = c
                .row_opt(
                    "INSERT INTO asks (id, asked_at, asked_by, ask) \
                     SELECT nextval('ask_seq'), $1, $2, $3 \
                     WHERE (SELECT count(*) FROM (SELECT 1 FROM asks WHERE answered_at IS NULL \
                     LIMIT $4) AS w) < $4 RETURNING id",
                    &[&at, &by, &text, &max],
                )
                .await?;
            Ok(row.map(|r| num(r.get(0))))
        })
    }

    fn unanswered(&self, limit: usize) -> Result<Vec<AskRecord>, StoreError> {
        self.with_client(move |c| async move {
            let rows = c
                .rows(
                    &format!(
                        "SELECT {COLUMNS} FROM asks WHERE answered_at IS NULL ORDER BY id LIMIT $1"
                    ),
                    &[&big(limit as u64)],
                )
                .await?;
            rows.iter().map(record).collect()
        })
    }

    fn answer(&self, id: u64, answer: &Answer) -> Result<bool, StoreError> {
        let (text, at, active) = (json(answer)?, answer.at, self.active());
        self.with_client(move |mut c| async move {
            let tx = crate::begin_active(&mut c, &active).await?;
            let changed = tx
                .exec(
                    "UPDATE asks SET answered_at = $2, answer = $3 \
                     WHERE id = $1 AND answered_at IS NULL",
                    &[&big(id), &at, &text],
                )
                .await?;
            tx.commit().await?;
            Ok(changed > 0)
        })
    }

    fn ask_record(&self, id: u64) -> Result<Option<AskRecord>, StoreError> {
        self.with_client(move |c| async move {
            let row = c
                .row_opt(
                    &format!("SELECT {COLUMNS} FROM asks WHERE id = $1"),
                    &[&big(id)],
                )
                .await?;
            row.as_ref().map(record).transpose()
        })
    }

    fn prune_asks(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        let active = self.active();
        self.with_client(move |mut c| async move {
            let tx = crate::begin_active(&mut c, &active).await?;
            let gone = tx
                .exec(
                    "DELETE FROM asks WHERE id IN (SELECT id FROM asks \
                     WHERE answered_at < $1 ORDER BY answered_at LIMIT $2)",
                    &[&before, &big(limit as u64)],
                )
                .await?;
            tx.commit().await?;
            Ok(gone)
        })
    }
}
