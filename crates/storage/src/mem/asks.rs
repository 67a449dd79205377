//! The in-memory store's asks of the active node (`Asks`): kept by number; answering and pruning
//! are fenced under the data lock, as the other writes of the active's work.

use super::MemStore;
use crate::asks::{Answer, Ask, AskRecord, Asks, WAITING_MAX};
use crate::StoreError;
use model::webhook::model::Millis;

impl Asks for MemStore {
    fn ask(&self, ask: &Ask, by: &str) -> Result<Option<u64>, StoreError> {
        let mut data = self.data();
        let waiting = data.asks.values().filter(|a| a.answer.is_none()).count();
        if waiting >= WAITING_MAX {
            return Ok(None);
        }
        let id = data.next_id();
        let record = AskRecord {
            id,
            ask: ask.clone(),
            by: by.to_owned(),
            asked_at: self.0.clock.now_millis(),
            answer: None,
        };
        data.asks.insert(id, record);
        Ok(Some(id))
    }

    fn unanswered(&self, limit: usize) -> Result<Vec<AskRecord>, StoreError> {
        let data = self.data();
        let waiting = data.asks.values().filter(|a| a.answer.is_none());
        Ok(waiting.take(limit).cloned().collect())
    }

    fn answer(&self, id: u64, answer: &Answer) -> Result<bool, StoreError> {
        let mut data = self.data();
        self.fenced(&data)?;
        match data.asks.get_mut(&id) {
            Some(record) if record.answer.is_none() => {
                record.answer = Some(answer.clone());
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    fn ask_record(&self, id: u64) -> Result<Option<AskRecord>, StoreError> {
        Ok(self.data().asks.get(&id).cloned())
    }

    fn prune_asks(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        let mut data = self.data();
        self.fenced(&data)?;
        let old: Vec<u64> = data
            .asks
            .values()
            .filter(|a| a.answer.as_ref().is_some_and(|ans| ans.at < before))
            .map(|a| a.id)
            .take(limit)
            .collect();
        for id in &old {
            data.asks.remove(id);
        }
        Ok(old.len() as u64)
    }
}
