//! The in-memory store's reads, outbox, timers, quarantine and operator log.

use super::fold::waiting_standing;
use super::{Data, MemStore};
use crate::desk::{DeskCursor, DeskPage};
use crate::operators::OperatorAction;
use crate::outbox::ActionStatus;
use crate::port::{OperatorLog, Outbox, Quarantine, Reads, Timers};
use crate::queue::{BotWaiting, QueueSummary};
use crate::timers::{DueTimer, TimerKey, TimerWakeup};
use crate::watch::Watched;
use crate::{EventRecord, QuarantineMeta, QuarantineRecord, Sizes, StoreError};
use engine::state::desk::DeskPhase;
use engine::state::queue::Standing;
use engine::state::stats::{self, HandoffStats};
use engine::state::{belief, BotState, ConversationState, EndUserState};
use model::action::{DeadLetter, DoneRecord, OutboxEntry, RetryState};
use model::ids::{ConversationId, EndUserId, EventId, PartitionKey};
use model::webhook::model::{Millis, TimerFiring};
use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::Arc;

/// At most `limit` values after key `after` (from the first when `None`).
fn page_after<K: Ord, V: Clone>(map: &BTreeMap<K, V>, after: Option<&K>, limit: usize) -> Vec<V> {
    let from = after.map_or(Bound::Unbounded, Bound::Excluded);
    map.range((from, Bound::Unbounded))
        .take(limit)
        .map(|(_, v)| v.clone())
        .collect()
}

impl Reads for MemStore {
    fn conversation(&self, id: &ConversationId) -> Result<Option<ConversationState>, StoreError> {
        Ok(self.data().conversations.get(id.as_str()).cloned())
    }

    fn end_user(&self, id: &EndUserId) -> Result<Option<EndUserState>, StoreError> {
        Ok(self.data().end_users.get(id.as_str()).cloned())
    }

    fn bot(&self, id: &str) -> Result<Option<BotState>, StoreError> {
        Ok(self.data().bots.get(id).cloned())
    }

    fn find_end_user(
        &self,
        platform: &str,
        user_key: &str,
    ) -> Result<Option<EndUserState>, StoreError> {
        let data = self.data();
        let key = (platform.to_owned(), user_key.to_owned());
        Ok(data
            .user_index
            .get(&key)
            .and_then(|id| data.end_users.get(id))
            .cloned())
    }

    fn conversations_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ConversationState>, StoreError> {
        let after = after.map(str::to_owned);
        Ok(page_after(
            &self.data().conversations,
            after.as_ref(),
            limit,
        ))
    }

    fn end_users_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<EndUserState>, StoreError> {
        let after = after.map(str::to_owned);
        Ok(page_after(&self.data().end_users, after.as_ref(), limit))
    }

    /// The listing's order by its cursor's own encoding (request time, missing first, then id).
    fn desk_page(
        &self,
        phase: Option<DeskPhase>,
        bot: Option<&str>,
        after: Option<&DeskCursor>,
        limit: usize,
    ) -> Result<DeskPage, StoreError> {
        let data = self.data();
        let listed = |s: &&ConversationState| {
            phase.is_none_or(|p| DeskPhase::of(s) == p)
                && bot.is_none_or(|b| s.bot_id.as_ref().is_some_and(|i| i.as_str() == b))
        };
        let mut all: Vec<(DeskCursor, &ConversationState)> = data
            .conversations
            .values()
            .filter(listed)
            .map(|s| (DeskCursor::of(s), s))
            .filter(|(position, _)| after.is_none_or(|a| position.0 > a.0))
            .collect();
        all.sort_by(|a, b| a.0 .0.cmp(&b.0 .0));
        let next = (all.len() > limit)
            .then(|| limit.checked_sub(1).and_then(|last| all.get(last)))
            .flatten()
            .map(|(position, _)| position.clone());
        let conversations = all
            .into_iter()
            .take(limit)
            .map(|(_, s)| s.clone())
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
        let data = self.data();
        let mut out = HashMap::new();
        for s in states {
            let (Some(entry), Some(bot)) = (engine::index::QueueEntry::of(s), &s.bot_id) else {
                continue;
            };
            let (_, ahead) = waiting_standing(
                &data,
                bot.as_str(),
                Some(entry.spot()),
                &mut std::iter::empty(),
            );
            out.insert(s.id.as_str().to_owned(), ahead + 1);
        }
        Ok(out)
    }

    fn watched(&self, released_since: Millis, limit: usize) -> Result<Watched, StoreError> {
        let data = self.data();
        let states = data.conversations.values();
        let active = states.clone().filter(|s| belief::is_active(s));
        let mut out = Watched {
            active: active
                .take(limit)
                .map(|s| s.id.as_str().to_owned())
                .collect(),
            released: Vec::new(),
        };
        let mut released: Vec<(Millis, &str)> = states
            .filter(|s| !belief::is_active(s))
            .filter_map(|s| Some((belief::released_at(s)?.max(0), s.id.as_str())))
            .filter(|(at, _)| *at >= released_since.max(0))
            .collect();
        released.sort_unstable();
        let room = limit.saturating_sub(out.active.len());
        out.released = released
            .into_iter()
            .take(room)
            .map(|(_, id)| id.to_owned())
            .collect();
        Ok(out)
    }

    fn queue_summary(&self) -> Result<QueueSummary, StoreError> {
        let data = self.data();
        Ok(QueueSummary {
            waiting: data.queue.len() as u64,
            oldest_since: data.queue.iter().map(|(_, since, _)| *since).min(),
        })
    }

    fn waiting_by_bot(&self) -> Result<Vec<BotWaiting>, StoreError> {
        let mut out: Vec<BotWaiting> = Vec::new();
        for (bot, since, _) in &self.data().queue {
            match out.last_mut() {
                Some(last) if last.bot == *bot => last.waiting += 1,
                _ => out.push(BotWaiting {
                    bot: bot.clone(),
                    waiting: 1,
                    oldest_since: Some(*since),
                }),
            }
        }
        Ok(out)
    }

    fn queue_standing(&self, id: &ConversationId) -> Result<Option<Standing>, StoreError> {
        let data = self.data();
        let Some(state) = data.conversations.get(id.as_str()) else {
            return Ok(None);
        };
        let Some(bot) = &state.bot_id else {
            return Ok(Some(Standing::default()));
        };
        let own = engine::index::QueueEntry::of(state);
        let own = own.as_ref().map(engine::index::QueueEntry::spot);
        let (length, ahead) = waiting_standing(&data, bot.as_str(), own, &mut std::iter::empty());
        let history = data.accepts.get(bot.as_str()).cloned().unwrap_or_default();
        let position = own.map(|_| u32::try_from(ahead).unwrap_or(u32::MAX).saturating_add(1));
        let length = u32::try_from(length).unwrap_or(u32::MAX);
        Ok(Some(Standing::new(position, length, &history)))
    }

    fn handoff_stats(&self, since: Millis, until: Millis) -> Result<HandoffStats, StoreError> {
        let mut out = HandoffStats::default();
        if until <= since {
            return Ok(out);
        }
        let (from, to) = (stats::hour_of(since), stats::hour_of(until - 1));
        for figures in self.data().hours.range(from..=to).map(|(_, f)| f) {
            out.merge(figures);
        }
        Ok(out)
    }

    fn partition_events(
        &self,
        partition: &PartitionKey,
    ) -> Result<Vec<(EventRecord, bool)>, StoreError> {
        let data = self.data();
        let key = partition.encode();
        let mine = data.events.iter().filter(|(_, e)| e.partition == key);
        Ok(mine
            .filter_map(|(seq, _)| Some((data.record(*seq)?, data.is_pending(*seq))))
            .collect())
    }

    fn event_status(&self, id: &EventId) -> Result<Option<(EventRecord, bool)>, StoreError> {
        let data = self.data();
        let found = data.event_ids.get(id.as_str()).map(|(seq, _)| *seq);
        Ok(found.and_then(|seq| Some((data.record(seq)?, data.is_pending(seq)))))
    }

    fn event_by_id(&self, id: &EventId) -> Result<Option<EventRecord>, StoreError> {
        Ok(self.event_status(id)?.map(|(record, _)| record))
    }

    fn sizes(&self) -> Result<Sizes, StoreError> {
        let data = self.data();
        Ok(Sizes {
            conversations: data.conversations.len() as u64,
            end_users: data.end_users.len() as u64,
            bots: data.bots.len() as u64,
            quarantine: data.quarantine.len() as u64,
        })
    }
}

impl Data {
    /// An entry leaves the outbox (with its retry state).
    fn settle(&mut self, seq: u64) {
        self.outbox.remove(&seq);
        self.retry.remove(&seq);
        self.started.remove(&seq);
    }
}

impl Outbox for MemStore {
    fn outbox_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<OutboxEntry>, StoreError> {
        Ok(page_after(&self.data().outbox, after.as_ref(), limit))
    }

    fn outbox_entry(&self, seq: u64) -> Result<Option<OutboxEntry>, StoreError> {
        Ok(self.data().outbox.get(&seq).cloned())
    }

    fn outbox_len(&self) -> Result<usize, StoreError> {
        Ok(self.data().outbox.len())
    }

    fn outbox_last_seq(&self) -> Result<Option<u64>, StoreError> {
        Ok(self.data().outbox.keys().next_back().copied())
    }

    fn outbox_retry_state(&self, seq: u64) -> Result<Option<RetryState>, StoreError> {
        Ok(self.data().retry.get(&seq).cloned())
    }

    fn set_outbox_retry_state(&self, seq: u64, state: &RetryState) -> Result<(), StoreError> {
        let mut data = self.data();
        self.fenced(&data)?;
        data.retry.insert(seq, state.clone());
        Ok(())
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

    fn outbox_done_many(&self, records: &[DoneRecord]) -> Result<(), StoreError> {
        let mut data = self.data();
        self.fenced(&data)?;
        for r in records {
            let status = ActionStatus::done(r);
            data.ledger.insert(r.entry.id.clone(), status);
            data.done.insert(r.entry.seq, r.clone());
            data.settle(r.entry.seq);
        }
        Ok(())
    }

    fn outbox_dead(&self, letter: &DeadLetter) -> Result<(), StoreError> {
        let mut data = self.data();
        self.fenced(&data)?;
        let seq = letter.entry.seq;
        let status = ActionStatus {
            state: "dead".into(),
            seq,
            at: letter.last_attempt_at,
            attempts: letter.attempts,
            note: Some(letter.reason.clone()),
        };
        data.settle(seq);
        data.dead.insert(seq, letter.clone());
        data.ledger.insert(letter.entry.id.clone(), status);
        Ok(())
    }

    fn dead_letter(&self, seq: u64) -> Result<Option<DeadLetter>, StoreError> {
        Ok(self.data().dead.get(&seq).cloned())
    }

    fn dead_letters(&self) -> Result<Vec<DeadLetter>, StoreError> {
        Ok(self.data().dead.values().cloned().collect())
    }

    fn dead_letters_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        Ok(page_after(&self.data().dead, after.as_ref(), limit))
    }

    fn retry_dead_letter(&self, seq: u64, now: Millis) -> Result<Option<OutboxEntry>, StoreError> {
        let mut data = self.data();
        let Some(letter) = data.dead.remove(&seq) else {
            return Ok(None);
        };
        let mut entry = letter.entry;
        if letter.answered {
            entry.idempotency_key = Some(format!("{}~retry-{now}", entry.id));
        }
        data.ledger
            .insert(entry.id.clone(), ActionStatus::pending(entry.seq, now));
        data.outbox.insert(seq, entry.clone());
        Ok(Some(entry))
    }

    fn drop_dead_letter(
        &self,
        seq: u64,
        reason: &str,
        now: Millis,
    ) -> Result<Option<DeadLetter>, StoreError> {
        let mut data = self.data();
        let Some(letter) = data.dead.remove(&seq) else {
            return Ok(None);
        };
        let note = Some(reason.to_owned());
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
        data.ledger.insert(letter.entry.id.clone(), status);
        data.done.insert(seq, record);
        Ok(Some(letter))
    }

    fn finished_page(
        &self,
        before: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DoneRecord>, StoreError> {
        let data = self.data();
        let to = before.map_or(Bound::Unbounded, Bound::Excluded);
        let newest_first = data.done.range((Bound::Unbounded, to)).rev();
        Ok(newest_first.take(limit).map(|(_, r)| r.clone()).collect())
    }

    fn finished_one(&self, seq: u64) -> Result<Option<DoneRecord>, StoreError> {
        Ok(self.data().done.get(&seq).cloned())
    }

    fn action_seqs_of_event(&self, event_id: &str) -> Result<Vec<u64>, StoreError> {
        let prefix = format!("{event_id}/");
        let data = self.data();
        let from = data.ledger.range(prefix.clone()..);
        let mine = from.take_while(|(id, _)| id.starts_with(&prefix));
        Ok(mine.map(|(_, status)| status.seq).collect())
    }
}

impl Timers for MemStore {
    fn due_timers(
        &self,
        now: Millis,
        limit: usize,
        skip: &dyn Fn(&TimerKey) -> bool,
    ) -> Result<(Vec<DueTimer>, Option<Millis>), StoreError> {
        let mut due = Vec::new();
        for (timer, (started_by, bot_id)) in &self.data().timers {
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
                started_by: started_by.clone(),
            };
            due.push(DueTimer {
                key,
                firing,
                bot_id: bot_id.clone(),
            });
        }
        Ok((due, None))
    }

    fn has_timer(&self, timer: &TimerKey) -> Result<bool, StoreError> {
        Ok(self.data().timers.contains_key(timer.timer()))
    }

    fn timers_pending(&self) -> Result<u64, StoreError> {
        Ok(self.data().timers.len() as u64)
    }

    fn timer_wakeup(&self) -> Arc<TimerWakeup> {
        self.1.timer_wakeup.clone()
    }
}

impl Quarantine for MemStore {
    fn quarantine(&self, record: QuarantineRecord) -> Result<u64, StoreError> {
        let mut data = self.data();
        let id = data.next_id();
        data.quarantine
            .insert(id, QuarantineRecord { id, ..record });
        Ok(id)
    }

    fn quarantined(&self) -> Result<Vec<QuarantineRecord>, StoreError> {
        Ok(self.data().quarantine.values().cloned().collect())
    }

    fn quarantined_one(&self, id: u64) -> Result<Option<QuarantineRecord>, StoreError> {
        Ok(self.data().quarantine.get(&id).cloned())
    }

    fn quarantine_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<(Vec<QuarantineMeta>, Option<u64>), StoreError> {
        let data = self.data();
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        let mut records = data.quarantine.range((from, Bound::Unbounded));
        let page: Vec<QuarantineMeta> = records
            .by_ref()
            .take(limit)
            .map(|(_, r)| r.meta())
            .collect();
        let next = records.next().and(page.last().map(|m| m.id));
        Ok((page, next))
    }

    fn release_quarantined(&self, id: u64) -> Result<bool, StoreError> {
        Ok(self.data().quarantine.remove(&id).is_some())
    }
}

impl OperatorLog for MemStore {
    fn record_operator_action(&self, action: &OperatorAction) -> Result<u64, StoreError> {
        let mut data = self.data();
        let id = data.next_id();
        data.operators.insert(id, action.clone());
        Ok(id)
    }

    fn operator_actions_page(
        &self,
        before: Option<u64>,
        limit: usize,
    ) -> Result<Vec<(u64, OperatorAction)>, StoreError> {
        let data = self.data();
        let to = before.map_or(Bound::Unbounded, Bound::Excluded);
        let newest_first = data.operators.range((Bound::Unbounded, to)).rev();
        Ok(newest_first
            .take(limit)
            .map(|(id, a)| (*id, a.clone()))
            .collect())
    }
}
