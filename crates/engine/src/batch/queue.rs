//! The waiting queue in a batch fold: each conversation's entry as the batch found it and now,
//! the accept histories and the hours' handoff figures it read and added to, and the standing
//! the rules read (the store's queue with the batch's own changes over it, so it is exact: folds
//! run one at a time).
//!
//! The handoff figures: a conversation that starts waiting adds to the event's hour's `joined`,
//! one that stops adds an exit with its outcome and, when accepted, its wait. An hour's figures are
//! read once, added to and written whole with the batch, so batches add up and nothing is counted
//! twice (the write set commits with the folded marks, or not at all).

use super::{FoldError, FoldReads};
use crate::index::{QueueEntry, QueueSpot};
use crate::state::queue::{self, Accept, AcceptHistory, Standing};
use crate::state::stats::{self, HandoffStats, QueueExit, QueueMove};
use crate::state::ConversationState;
use model::ids::BotId;
use model::webhook::model::Millis;
use std::collections::{BTreeMap, HashMap};

/// A conversation's place in its bot's queue, when it waits.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Waiting {
    bot: BotId,
    /// Since when (times before 1970 as 1970: the queue's order).
    since: Millis,
}

impl Waiting {
    fn of(s: &ConversationState) -> Option<Waiting> {
        let since = queue::waiting_since(s)?;
        let bot = s.bot_id.clone()?;
        Some(Waiting {
            bot,
            since: since.max(0),
        })
    }

    fn spot<'a>(&self, conversation: &'a str) -> QueueSpot<'a> {
        QueueSpot {
            since: self.since,
            conversation,
        }
    }

    fn entry(self, conversation: &str) -> QueueEntry {
        QueueEntry {
            bot: self.bot.as_str().to_owned(),
            since: self.since,
            conversation: conversation.to_owned(),
        }
    }
}

/// `w` when it is a place in `bot`'s queue.
fn of_bot<'w>(w: &'w Option<Waiting>, bot: &BotId) -> Option<&'w Waiting> {
    w.as_ref().filter(|w| w.bot == *bot)
}

/// What a batch has done to the queue so far.
#[derive(Debug, Default)]
pub(super) struct QueueFold {
    /// Conversation id -> its entry as the batch found it (what the store holds) and now.
    entries: HashMap<String, (Option<Waiting>, Option<Waiting>)>,
    /// Bot -> its accept history (read on first use) and whether the batch changed it.
    history: HashMap<String, (AcceptHistory, bool)>,
    /// Hour (its start, at least 0) -> its figures (read on first use, then added to; every one
    /// is written).
    stats: BTreeMap<Millis, HandoffStats>,
    /// Why each conversation that left the queue in this batch left, and its wait when accepted
    /// (ms), in fold order.
    exits: Vec<(QueueExit, Option<Millis>)>,
}

impl QueueFold {
    /// Before an event of this conversation is folded: remember its entry as the store holds it
    /// (on the conversation's first event of the batch). Returns since when it waits now.
    pub fn before(&mut self, s: &ConversationState) -> Option<Millis> {
        if !self.entries.contains_key(s.id.as_str()) {
            let found = Waiting::of(s);
            self.entries
                .insert(s.id.as_str().to_owned(), (found.clone(), found));
        }
        queue::waiting_since(s)
    }

    /// After an event was folded into `after`: the conversation's entry now, and an accept
    /// recorded in its bot's history when it left the queue because someone took it
    /// (`waited_since`: since when it waited before the event; `at`: the event's time).
    pub fn after<R: FoldReads + ?Sized>(
        &mut self,
        reads: &mut R,
        after: &ConversationState,
        waited_since: Option<Millis>,
        at: Millis,
    ) -> Result<(), R::Error> {
        let now = Waiting::of(after);
        let waits = now.is_some();
        if let Some(slot) = self.entries.get_mut(after.id.as_str()) {
            slot.1 = now;
        }
        if let (Some(since), false, Some(bot)) = (waited_since, waits, &after.bot_id) {
            if queue::left_by_accept(after) {
                let history = self.history(reads, bot)?;
                history.0.record(Accept {
                    at,
                    waited_ms: at.saturating_sub(since).max(0),
                });
                history.1 = true;
            }
        }
        if let Some(change) = stats::queue_move(waited_since, after, at) {
            self.hour_stats(reads, at)?.record(change);
            if let QueueMove::Left { exit, waited_ms } = change {
                self.exits.push((exit, waited_ms));
            }
        }
        Ok(())
    }

    /// The figures of the hour `at` is in, as the batch knows them: the store's the first time,
    /// then its own.
    fn hour_stats<R: FoldReads + ?Sized>(
        &mut self,
        reads: &mut R,
        at: Millis,
    ) -> Result<&mut HandoffStats, R::Error> {
        use std::collections::btree_map::Entry;
        let hour = stats::hour_of(at).max(0);
        match self.stats.entry(hour) {
            Entry::Occupied(known) => Ok(known.into_mut()),
            Entry::Vacant(slot) => Ok(slot.insert(reads.hour_stats(hour)?.unwrap_or_default())),
        }
    }

    /// A bot's accept history as the batch knows it.
    fn history<R: FoldReads + ?Sized>(
        &mut self,
        reads: &mut R,
        bot: &BotId,
    ) -> Result<&mut (AcceptHistory, bool), R::Error> {
        if !self.history.contains_key(bot.as_str()) {
            let stored = reads.accept_history(bot.as_str())?.unwrap_or_default();
            self.history
                .insert(bot.as_str().to_owned(), (stored, false));
        }
        let history = self.history.get_mut(bot.as_str());
        Ok(history.ok_or(FoldError("an accept history the batch read went missing"))?)
    }

    /// A conversation's standing in its bot's queue: the store's queue with the batch's changes
    /// over it (its conversations' entries as found taken out, their entries now put in).
    pub fn standing<R: FoldReads + ?Sized>(
        &mut self,
        reads: &mut R,
        s: &ConversationState,
    ) -> Result<Standing, R::Error> {
        let Some(bot) = &s.bot_id else {
            return Ok(Standing::default());
        };
        let own = Waiting::of(s);
        let own = own.as_ref().map(|w| w.spot(s.id.as_str()));
        let mut found = self
            .entries
            .iter()
            .filter_map(|(id, (first, _))| of_bot(first, bot).map(|w| w.spot(id)));
        let (length, ahead) = reads.waiting_standing(bot.as_str(), own, &mut found)?;
        let mut length = u32::try_from(length).unwrap_or(u32::MAX);
        let mut ahead = u32::try_from(ahead).unwrap_or(u32::MAX);
        for (id, (_, now)) in &self.entries {
            if let Some(spot) = of_bot(now, bot).map(|w| w.spot(id)) {
                length = length.saturating_add(1);
                ahead = ahead.saturating_add(u32::from(own.is_some_and(|o| spot < o)));
            }
        }
        let position = own.map(|_| ahead.saturating_add(1));
        let history = &self.history(reads, bot)?.0;
        Ok(Standing::new(position, length, history))
    }

    /// The queue's changes (entries that changed, histories that grew, every hour touched) and
    /// the batch's exits.
    pub fn finish(self) -> (super::QueueChanges, Vec<(QueueExit, Option<Millis>)>) {
        let mut out = super::QueueChanges::default();
        for (id, (first, now)) in self.entries {
            if first == now {
                continue;
            }
            out.left.extend(first.map(|w| w.entry(&id)));
            out.joined.extend(now.map(|w| w.entry(&id)));
        }
        out.accepts = self
            .history
            .into_iter()
            .filter(|(_, (_, changed))| *changed)
            .map(|(bot, (history, _))| (bot, history))
            .collect();
        out.hours = self.stats.into_iter().collect();
        (out, self.exits)
    }
}
