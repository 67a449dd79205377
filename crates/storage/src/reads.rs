//! The sled backend's [`Reads`]: records by key, keyed pages (one sled `range` from a cursor,
//! never a whole tree), the indexes the folds keep (the agent API's phase listing, the sweeper's
//! index, the waiting queue and its figures, the event log by partition) and the record counts.

use super::{
    corrupt, decode, eventlog, get_decoded, keys, log_error, queue, EventRecord, Marks, Sizes,
    SledStore, StoreError,
};
use crate::desk::{DeskCursor, DeskPage};
use crate::pages::id_page;
use crate::port::{Folds, Reads};
use crate::queue::{BotWaiting, QueueSummary};
use crate::watch::Watched;
use engine::index::QueueEntry;
use engine::state::desk::DeskPhase;
use engine::state::queue::Standing;
use engine::state::stats::{self, HandoffStats};
use engine::state::{BotState, ConversationState, EndUserState};
use model::ids::{ConversationId, EndUserId, EventId, PartitionKey};
use model::webhook::model::Millis;
use std::collections::{BTreeMap, HashMap};

impl Reads for SledStore {
    fn conversation(&self, id: &ConversationId) -> Result<Option<ConversationState>, StoreError> {
        get_decoded(&self.conversations, id.as_str(), "conversation state")
    }

    fn end_user(&self, id: &EndUserId) -> Result<Option<EndUserState>, StoreError> {
        get_decoded(&self.end_users, id.as_str(), "end-user state")
    }

    fn bot(&self, id: &str) -> Result<Option<BotState>, StoreError> {
        get_decoded(&self.bots, id.as_bytes(), "bot state")
    }

    /// Look an end user up by their messenger identity.
    fn find_end_user(
        &self,
        platform: &str,
        user_key: &str,
    ) -> Result<Option<EndUserState>, StoreError> {
        match self.user_index.get(keys::user_index(platform, user_key))? {
            None => Ok(None),
            Some(id) => {
                let id = std::str::from_utf8(&id).map_err(|_| corrupt("user index"))?;
                self.end_user(&EndUserId::new(id))
            }
        }
    }

    /// Up to `limit` conversation states after id `after` (from the first when `None`), in id
    /// order: the sweeper's rotating sample of the conversations it does not watch.
    fn conversations_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ConversationState>, StoreError> {
        super::pages::id_page(&self.conversations, after, limit, "conversation state")
    }

    /// At most `limit` end users with ids after `after` (from the first when `None`), in id
    /// order.
    fn end_users_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<EndUserState>, StoreError> {
        id_page(&self.end_users, after, limit, "end-user state")
    }

    /// Up to `limit` conversations in `phase` (every phase when `None`), of `bot` when given,
    /// after `after`, in listing order. Reads one range per phase (merged by position for all
    /// phases), then each listed conversation's state.
    fn desk_page(
        &self,
        phase: Option<DeskPhase>,
        bot: Option<&str>,
        after: Option<&DeskCursor>,
        limit: usize,
    ) -> Result<DeskPage, StoreError> {
        if bot.is_some_and(|b| b.len() > usize::from(u16::MAX)) {
            return Ok(DeskPage::default()); // no bot id is that long
        }
        let phases = match phase {
            Some(p) => vec![p],
            None => DeskPhase::ALL.to_vec(),
        };
        let prefix_of = |p: DeskPhase| match bot {
            Some(b) => keys::desk_bot_prefix(b, p.byte()),
            None => keys::desk_phase_prefix(p.byte()),
        };
        // One range per phase, and its head: the merge takes the least position each time.
        let mut ranges = Vec::with_capacity(phases.len());
        for p in phases {
            let prefix = prefix_of(p);
            let mut start = prefix.clone();
            if let Some(cursor) = after {
                start.extend_from_slice(&cursor.0);
                start.push(0); // the first key after the cursor's
            }
            let mut range = self.queue.range(start..keys::prefix_end(&prefix));
            let head = range.next().transpose()?;
            ranges.push((prefix.len(), range, head));
        }
        let mut listed: Vec<sled::IVec> = Vec::with_capacity(limit.min(1024) + 1);
        while listed.len() <= limit {
            let least = ranges
                .iter()
                .enumerate()
                .filter_map(|(i, (len, _, head))| Some((i, head.as_ref()?.0.get(*len..)?)))
                .min_by(|a, b| a.1.cmp(b.1))
                .map(|(i, _)| i);
            let Some(i) = least else { break };
            let (len, range, head) = &mut ranges[i];
            if let Some((key, _)) = head.take() {
                listed.push(sled::IVec::from(key.get(*len..).unwrap_or_default()));
            }
            *head = range.next().transpose()?;
        }
        let next = match listed.len() > limit {
            true => limit
                .checked_sub(1)
                .and_then(|last| listed.get(last))
                .map(|p| DeskCursor(p.to_vec())),
            false => None,
        };
        listed.truncate(limit);
        let mut out = Vec::with_capacity(listed.len());
        for position in &listed {
            let Some((at, id)) = keys::parse_desk_position(position) else {
                tracing::error!(key = ?position, "unreadable phase index key; left out");
                continue;
            };
            let Some(bytes) = self.conversations.get(id.as_bytes())? else {
                continue;
            };
            let state: ConversationState = decode(&bytes, "conversation state")?;
            let moved = state.handoff.requested_at != at
                || phase.is_some_and(|p| DeskPhase::of(&state) != p)
                || bot.is_some_and(|b| state.bot_id.as_ref().map(|i| i.as_str()) != Some(b));
            if !moved {
                out.push(state);
            }
        }
        Ok(DeskPage {
            conversations: out,
            next,
        })
    }

    /// The 1-based positions, in their bot's waiting queue (`store::queue`), of those of
    /// `states` that wait. Counted once per bot, up to its first waiting conversation in
    /// `states`, then on from there to each next one (`states` in listing order, so each count
    /// is short); never a read of a whole queue per conversation.
    fn waiting_positions(
        &self,
        states: &[ConversationState],
    ) -> Result<HashMap<String, usize>, StoreError> {
        // Bot -> the last entry counted and its position.
        let mut counted: HashMap<&str, (Vec<u8>, usize)> = HashMap::new();
        let mut out = HashMap::new();
        for s in states {
            let (Some(key), Some(bot)) = (queue::entry_of(s), s.bot_id.as_ref()) else {
                continue;
            };
            let (from, base) = match counted.get(bot.as_str()) {
                // position(key) = position(prev) + entries in [prev, key)
                Some((prev, at)) if prev.as_slice() <= key.as_slice() => (prev.clone(), *at),
                // position(key) = 1 + entries in [bot's first, key)
                _ => (keys::queue_bot(bot.as_str()), 1),
            };
            let mut ahead = 0;
            for item in self.queue.range(from..key.clone()).keys() {
                item?;
                ahead += 1;
            }
            let position = base + ahead;
            out.insert(s.id.as_str().to_owned(), position);
            counted.insert(bot.as_str(), (key, position));
        }
        Ok(out)
    }

    /// The sweeper's candidates: every active conversation and those released at or after
    /// `released_since`, at most `limit` in all (active first). Reads the index only.
    fn watched(&self, released_since: Millis, limit: usize) -> Result<Watched, StoreError> {
        let mut out = Watched::default();
        for item in self.queue.scan_prefix([keys::WATCH_ACTIVE]) {
            if out.active.len() >= limit {
                return Ok(out);
            }
            let (key, _) = item?;
            match keys::parse_watch_active(&key) {
                Some(id) => out.active.push(id.to_owned()),
                None => tracing::error!(key = ?key, "unreadable watch key; left out"),
            }
        }
        let from = keys::watch_released(released_since, "");
        let end = [keys::WATCH_RELEASED + 1];
        for item in self.queue.range(from..end.to_vec()) {
            if out.active.len() + out.released.len() >= limit {
                break;
            }
            let (key, _) = item?;
            match keys::parse_watch_released(&key) {
                Some((_, id)) => out.released.push(id.to_owned()),
                None => tracing::error!(key = ?key, "unreadable watch key; left out"),
            }
        }
        Ok(out)
    }

    /// Every bot's queue at once: how many conversations wait for an agent and since when the
    /// longest-waiting one does (for the stuck-handoff gauges). Kept in memory: counted from the
    /// tree on open and changed by each committed fold, so a scrape costs no scan and is right
    /// from the first one after a restart.
    fn queue_summary(&self) -> Result<QueueSummary, StoreError> {
        Ok(self.waiting_counts().summary())
    }

    /// The waiting queue per bot, from the same counts in memory as [`Self::queue_summary`].
    fn waiting_by_bot(&self) -> Result<Vec<BotWaiting>, StoreError> {
        Ok(self.waiting_counts().by_bot())
    }

    /// A conversation's standing now (outside folds: the help-desk events, the agent API);
    /// `None` for a conversation the bridge does not know.
    fn queue_standing(
        &self,
        conversation: &ConversationId,
    ) -> Result<Option<Standing>, StoreError> {
        let Some(state) = self.conversation(conversation)? else {
            return Ok(None);
        };
        let Some(bot) = &state.bot_id else {
            return Ok(Some(Standing::default()));
        };
        let own = QueueEntry::of(&state);
        let own = own.as_ref().map(QueueEntry::spot);
        let (length, ahead) = self.waiting_standing(bot.as_str(), own, &mut std::iter::empty());
        let history = self.accept_history(bot.as_str())?;
        let position = own.map(|_| u32::try_from(ahead).unwrap_or(u32::MAX).saturating_add(1));
        let length = u32::try_from(length).unwrap_or(u32::MAX);
        Ok(Some(Standing::new(position, length, &history)))
    }

    /// The handoff figures of the hours that overlap `[since, until)`, merged: every hour record
    /// from `since`'s hour to the hour before `until` (the first and last hours count whole), a
    /// range of at most 25 keys for a day; no conversation is read. Empty when `until <= since`.
    fn handoff_stats(&self, since: Millis, until: Millis) -> Result<HandoffStats, StoreError> {
        let mut out = HandoffStats::default();
        if until <= since {
            return Ok(out);
        }
        let from = keys::queue_stats(stats::hour_of(since));
        let to = keys::queue_stats(stats::hour_of(until - 1));
        for item in self.queue.range(from..=to) {
            let (_, bytes) = item?;
            out.merge(&super::decode(&bytes, "handoff stats")?);
        }
        Ok(out)
    }

    /// A partition's stored events, oldest first, with whether each is still to fold: the index's
    /// entries in the live segments, then the log's tail from the folds' watermark (events not
    /// folded yet, and those folded since). Reads the partition's own frames and the tail, never
    /// the whole log.
    fn partition_events(
        &self,
        partition: &PartitionKey,
    ) -> Result<Vec<(EventRecord, bool)>, StoreError> {
        let key = partition.encode();
        let mut frames = BTreeMap::new();
        for segment in eventlog::segments(&self.log_dir).map_err(log_error)? {
            for item in self
                .partition_events
                .scan_prefix(keys::partition_events(segment, &key))
            {
                let (k, v) = item?;
                let seq = keys::parse_partition_event(&k);
                let offset = keys::parse_seq(&v);
                match seq.zip(offset) {
                    Some((seq, offset)) => {
                        frames.insert(seq, eventlog::LogPosition { segment, offset })
                    }
                    None => return Err(super::corrupt("partition index entry")),
                };
            }
        }
        let fold_from = self.watermark()?;
        self.tail_of(&key, fold_from, &mut frames)?;
        let mark = self.mark(&key)?;
        let mut out = Vec::with_capacity(frames.len());
        for (seq, at) in frames {
            // Its segment pruned since the listing: gone with it.
            if let Some(record) = self.event_at(seq, at.into())? {
                let pending = at >= fold_from && mark.is_none_or(|m| seq > m);
                out.push((record, pending));
            }
        }
        Ok(out)
    }

    /// The stored event of an id (as [`event_by_id`](SledStore::event_by_id)), and whether it is
    /// still to fold.
    fn event_status(&self, id: &EventId) -> Result<Option<(EventRecord, bool)>, StoreError> {
        let Some((frame, i, at)) = self.log.locate_event(id.as_str())? else {
            return Ok(None);
        };
        let record = EventRecord::from_log(&frame, i)?;
        let mut marks = Marks::default();
        let pending =
            marks.is_pending(self, self.watermark()?, at, &record.partition, record.seq)?;
        Ok(Some((record, pending)))
    }

    /// The stored event of an id, while its segment is in the dedupe window.
    fn event_by_id(&self, id: &EventId) -> Result<Option<EventRecord>, StoreError> {
        match self
            .log
            .locate_event(id.as_str())?
            .map(|(record, i, _)| (record, i))
        {
            Some((record, i)) => Ok(Some(EventRecord::from_log(&record, i)?)),
            None => Ok(None),
        }
    }

    /// Record counts. Linear in the store size: call on start, then track changes.
    fn sizes(&self) -> Result<Sizes, StoreError> {
        Ok(Sizes {
            conversations: self.count(keys::meta::COUNT_CONVERSATIONS, &self.conversations)?,
            end_users: self.count(keys::meta::COUNT_END_USERS, &self.end_users)?,
            bots: self.count(keys::meta::COUNT_BOTS, &self.bots)?,
            quarantine: self.quarantine.len() as u64,
        })
    }
}

impl SledStore {
    /// A state tree's record count, as the folds keep it in `meta`. A store from before the counts
    /// is counted once (walking the tree) and the count kept from then on. Folds run after this
    /// (the dispatcher starts after the count), so the two cannot race.
    fn count(&self, key: &[u8], tree: &sled::Tree) -> Result<u64, StoreError> {
        if let Some(count) = self
            .meta
            .get(key)?
            .and_then(|bytes| keys::parse_seq(&bytes))
        {
            return Ok(count);
        }
        let count = tree.len() as u64;
        if let Err(e) = self.meta.insert(key, &keys::seq(count)) {
            tracing::warn!(error = %e, "cannot keep a record count; it will be counted again");
        }
        Ok(count)
    }
}
