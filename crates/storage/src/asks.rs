//! Work asked of the active node (`asks/v1`), a port group of its own ([`Asks`]): with several
//! nodes on one store, an operator's action that is the active's work (a dead letter's retry or
//! drop, a replay, a pass run now) may reach any node; a standby stores it here, the active
//! carries it out and stores its answer, which the asking node hands back.
//!
//! Storing an ask is intake (any node, not fenced); answering is the active's work (fenced, as
//! an outbox outcome is): a node that lost the lease answers nothing, and the ask waits for the
//! next active. An ask being carried out when its active died is carried out again by the next
//! one (a retried or dropped letter is found gone the second time; a pass runs once more).
//!
//! sled is one process's store: its node is always the active one and never asks; the group is
//! there for the port's sake (offline tools, the conformance suite). Keys: the ask's number
//! (u64 BE) -> [`AskRecord`]. Opened by name on use, not kept in [`SledStore`].

use super::{decode, encode, keys, SledStore, StoreError};
use engine::replay::ReplayRequest;
use model::webhook::model::Millis;
use serde::{Deserialize, Serialize};

const TREE: &str = "asks/v1";

/// Unanswered asks a store keeps at most: beyond it an ask is refused (the active is gone or
/// far behind; the operator learns it at once instead of piling work up).
pub const WAITING_MAX: usize = 100;

/// What is asked of the active node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Ask {
    /// Dead letters back into the outbox.
    Retry { ids: Vec<u64> },
    /// Every dead letter whose reason and queue contain these (empty: any) back into the outbox.
    RetryMatching { reason: String, queue: String },
    /// A dead letter dropped for good, for a reason.
    Drop { id: u64, reason: String },
    /// Stored events run through the rules in force again.
    Replay(ReplayRequest),
    /// A reconciliation pass now (not a dry run: any node makes those).
    Reconcile,
    /// A pruning pass now.
    Prune,
    /// A backfill pass now.
    Backfill,
}

/// How the active node answered: an HTTP status and its JSON body, as its admin API would have
/// answered the ask itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    pub status: u16,
    /// JSON text.
    pub body: String,
    /// The node that answered.
    pub by: String,
    pub at: Millis,
}

/// An ask as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AskRecord {
    pub id: u64,
    pub ask: Ask,
    /// The node that stored it.
    pub by: String,
    pub asked_at: Millis,
    /// `None` while it waits for the active.
    pub answer: Option<Answer>,
}

/// The asks of the active's work (see the module's docs).
pub trait Asks {
    /// Store `ask` for the active node, as asked by node `by` now (on the store's clock): its
    /// number (later asks have higher ones). Not fenced. `None`, nothing stored, when
    /// [`WAITING_MAX`] asks wait unanswered already.
    fn ask(&self, ask: &Ask, by: &str) -> Result<Option<u64>, StoreError>;
    /// Up to `limit` unanswered asks, oldest first.
    fn unanswered(&self, limit: usize) -> Result<Vec<AskRecord>, StoreError>;
    /// Record the answer to ask `id` (fenced: the active's work). `false`: no such ask, or it
    /// was answered already (the first answer stays).
    fn answer(&self, id: u64, answer: &Answer) -> Result<bool, StoreError>;
    /// Ask `id` as it stands.
    fn ask_record(&self, id: u64) -> Result<Option<AskRecord>, StoreError>;
    /// Remove up to `limit` asks answered before `before` (unanswered ones stay): how many.
    /// Fenced, as every retention pass.
    fn prune_asks(&self, before: Millis, limit: usize) -> Result<u64, StoreError>;
}

impl SledStore {
    fn asks_tree(&self) -> Result<sled::Tree, StoreError> {
        Ok(self.db.open_tree(TREE)?)
    }
}

/// The tree is a tool's (see the module's docs): its reads walk it.
impl Asks for SledStore {
    fn ask(&self, ask: &Ask, by: &str) -> Result<Option<u64>, StoreError> {
        if self.unanswered(WAITING_MAX)?.len() >= WAITING_MAX {
            return Ok(None);
        }
        let id = self.db.generate_id()?;
        let record = AskRecord {
            id,
            ask: ask.clone(),
            by: by.to_owned(),
            asked_at: self.clock.now_millis(),
            answer: None,
        };
        self.asks_tree()?.insert(keys::seq(id), encode(&record)?)?;
        Ok(Some(id))
    }

    fn unanswered(&self, limit: usize) -> Result<Vec<AskRecord>, StoreError> {
        let mut out = Vec::new();
        for item in self.asks_tree()?.iter() {
            let (_, v) = item?;
            let record: AskRecord = decode(&v, "ask")?;
            if record.answer.is_none() {
                out.push(record);
            }
            if out.len() >= limit {
                break;
            }
        }
        Ok(out)
    }

    fn answer(&self, id: u64, answer: &Answer) -> Result<bool, StoreError> {
        let Some(mut record) = self.ask_record(id)? else {
            return Ok(false);
        };
        if record.answer.is_some() {
            return Ok(false);
        }
        record.answer = Some(answer.clone());
        self.asks_tree()?.insert(keys::seq(id), encode(&record)?)?;
        Ok(true)
    }

    fn ask_record(&self, id: u64) -> Result<Option<AskRecord>, StoreError> {
        match self.asks_tree()?.get(keys::seq(id))? {
            Some(v) => Ok(Some(decode(&v, "ask")?)),
            None => Ok(None),
        }
    }

    fn prune_asks(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        let tree = self.asks_tree()?;
        let mut gone = 0;
        for item in tree.iter() {
            let (k, v) = item?;
            let record: AskRecord = decode(&v, "ask")?;
            if record.answer.is_some_and(|a| a.at < before) {
                tree.remove(k)?;
                gone += 1;
                if gone as usize >= limit {
                    break;
                }
            }
        }
        Ok(gone)
    }
}
