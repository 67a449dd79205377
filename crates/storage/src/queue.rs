//! The waiting queue in sled: the `queue/v1` tree, every conversation waiting for an agent per bot
//! in request order, and each bot's recent accepts, so a position and an expected wait are a
//! short range read, not a scan of every conversation.
//!
//! Like the timers tree, the fold is the only writer: the engine's batch fold compares each
//! conversation's entry as the batch found it with its entry after the batch
//! (`engine::batch`'s queue, `QueueChanges` in its write set), and the fold's journal writes the
//! difference, so the tree equals the states under the fold lock (by
//! `state::queue::waiting_since`). Folds run one at a time, so inside a fold the tree (its copy in
//! memory, [`WaitingCounts`]) plus the batch's own changes is exact.
//!
//! The same folds keep the handoff figures there: one record per hour (`keys::queue_stats`,
//! [`HandoffStats`]) of the conversations that joined the queue, those that left it by outcome
//! and the accepted ones' waits, each counted in the hour of the event that moved it
//! (`state::stats::queue_move`). A fold reads an hour's record on first use, adds its events to it
//! and writes it whole in its journal, so events of one hour folded in several batches add up.
//! Nothing is counted twice: the record is written in the same journal as the folded marks, and
//! that journal is applied wholly or not at all (an open completes one a crash cut after its
//! chunks, and its values are absolute, so applying it again writes the same record); a fold done
//! again after a crash is one whose journal was dropped, its events still above their marks.

use super::{get_decoded, keys, SledStore, StoreError};
use engine::batch::QueueChanges;
use engine::index::{QueueEntry, QueueSpot};
use engine::state::queue::AcceptHistory;
use engine::state::ConversationState;
use model::ids::ConversationId;
use model::webhook::model::Millis;
use std::collections::{BTreeSet, HashMap};
use std::ops::Bound;

/// A conversation's key in the queue, when it waits.
pub(super) fn entry_of(s: &ConversationState) -> Option<Vec<u8>> {
    QueueEntry::of(s).as_ref().map(key)
}

/// A waiting entry's key: its bot's prefix, request time, conversation.
pub(crate) fn key(entry: &QueueEntry) -> Vec<u8> {
    keys::queue_entry(&entry.bot, entry.since, &entry.conversation)
}

/// The waiting queue over all bots (`SledStore::queue_summary`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct QueueSummary {
    /// Conversations waiting for an agent.
    pub waiting: u64,
    /// The earliest request time among them.
    pub oldest_since: Option<Millis>,
}

/// One bot's waiting queue (`SledStore::waiting_by_bot`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BotWaiting {
    pub bot: String,
    /// Conversations of the bot waiting for an agent.
    pub waiting: u64,
    /// The earliest request time among them.
    pub oldest_since: Option<Millis>,
}

/// A fold's changes to the waiting entries (their keys).
#[derive(Debug, Default)]
pub(super) struct WaitingChanges {
    pub removed: Vec<Vec<u8>>,
    pub added: Vec<Vec<u8>>,
}

impl WaitingChanges {
    /// The waiting entries among `removed` (keys of the queue tree), removed.
    pub fn removing(mut removed: Vec<Vec<u8>>) -> Self {
        removed.retain(|key| key.first() == Some(&keys::QUEUE_WAITING));
        WaitingChanges {
            removed,
            added: Vec::new(),
        }
    }

    pub fn of(changes: &QueueChanges) -> Self {
        WaitingChanges {
            removed: changes.left.iter().map(key).collect(),
            added: changes.joined.iter().map(key).collect(),
        }
    }
}

/// The queue tree's waiting entries in memory: how many conversations wait since each request
/// time (for the gauges) and each bot's entries in queue order (for a fold's standings), read
/// once on open and then kept by each committed fold's changes, under the fold lock. Folds run
/// one at a time and the tree equals their changes, so a fold reads it exact: a conversation's
/// position is a count in memory, not a scan of the bot's queue in sled per agent call.
#[derive(Debug, Default)]
pub(super) struct WaitingCounts {
    by_time: std::collections::BTreeMap<Millis, u64>,
    total: u64,
    /// Bot prefix (`keys::queue_bot`) -> its waiting entries' keys.
    by_bot: HashMap<Vec<u8>, BTreeSet<Vec<u8>>>,
}

impl WaitingCounts {
    fn add(&mut self, key: &[u8]) {
        let (Some(at), Some(bot)) = (keys::parse_queue_requested_at(key), keys::queue_bot_of(key))
        else {
            tracing::error!(key = ?key, "unreadable queue key; left out");
            return;
        };
        if !self
            .by_bot
            .entry(bot.to_vec())
            .or_default()
            .insert(key.to_vec())
        {
            return; // counted already
        }
        *self.by_time.entry(at).or_default() += 1;
        self.total += 1;
    }

    fn remove(&mut self, key: &[u8]) {
        let (Some(at), Some(bot)) = (keys::parse_queue_requested_at(key), keys::queue_bot_of(key))
        else {
            return;
        };
        let Some(entries) = self.by_bot.get_mut(bot) else {
            return;
        };
        if !entries.remove(key) {
            return;
        }
        if entries.is_empty() {
            self.by_bot.remove(bot);
        }
        if let std::collections::btree_map::Entry::Occupied(mut slot) = self.by_time.entry(at) {
            *slot.get_mut() -= 1;
            if *slot.get() == 0 {
                slot.remove();
            }
            self.total -= 1;
        }
    }

    /// The bot's waiting entries (by its prefix): how many, and how many sort before `own`.
    /// Counted from both ends of `own` at once, so it costs the shorter side: a new request (at
    /// the queue's end) or a conversation near its head is a few steps, whatever the length.
    fn bot_standing(&self, prefix: &[u8], own: Option<&[u8]>) -> (usize, usize) {
        let Some(entries) = self.by_bot.get(prefix) else {
            return (0, 0);
        };
        let len = entries.len();
        let Some(own) = own else {
            return (len, 0);
        };
        let mut before = entries.range::<[u8], _>((Bound::Unbounded, Bound::Excluded(own)));
        let mut from = entries.range::<[u8], _>((Bound::Included(own), Bound::Unbounded));
        let mut steps = 0;
        let ahead = loop {
            if before.next().is_none() {
                break steps; // `steps` entries before own
            }
            if from.next().is_none() {
                break len - steps; // `steps` entries from own on
            }
            steps += 1;
        };
        (len, ahead)
    }

    fn contains(&self, prefix: &[u8], key: &[u8]) -> bool {
        self.by_bot
            .get(prefix)
            .is_some_and(|entries| entries.contains(key))
    }

    pub(super) fn summary(&self) -> QueueSummary {
        QueueSummary {
            waiting: self.total,
            oldest_since: self.by_time.keys().next().copied(),
        }
    }

    /// Each bot's count and oldest request (its first entry: they sort by request time), in bot
    /// order: one step per bot, no entry walked.
    pub(super) fn by_bot(&self) -> Vec<BotWaiting> {
        let mut out: Vec<BotWaiting> = self
            .by_bot
            .iter()
            .map(|(prefix, entries)| BotWaiting {
                bot: String::from_utf8_lossy(prefix.get(3..).unwrap_or_default()).into_owned(),
                waiting: entries.len() as u64,
                oldest_since: entries
                    .iter()
                    .next()
                    .and_then(|k| keys::parse_queue_requested_at(k)),
            })
            .collect();
        out.sort_by(|a, b| a.bot.cmp(&b.bot));
        out
    }
}

impl SledStore {
    /// The committed queue of `bot` (its copy in memory, [`WaitingCounts`]): how many wait and
    /// how many sort before `own`, leaving out those of `found` that are in it (see
    /// `engine::batch::FoldReads::waiting_standing`). Counts in memory, never a scan of sled.
    pub(super) fn waiting_standing(
        &self,
        bot: &str,
        own: Option<QueueSpot<'_>>,
        found: &mut dyn Iterator<Item = QueueSpot<'_>>,
    ) -> (usize, usize) {
        let prefix = keys::queue_bot(bot);
        let own_key = own.map(|o| keys::queue_entry(bot, o.since, o.conversation));
        let counts = match self.waiting.lock() {
            Ok(counts) => counts,
            Err(poisoned) => poisoned.into_inner(),
        };
        let (mut length, mut ahead) = counts.bot_standing(&prefix, own_key.as_deref());
        let mut key = Vec::new();
        for spot in found {
            keys::queue_entry_into(&mut key, &prefix, spot.since, spot.conversation);
            if counts.contains(&prefix, &key) {
                length = length.saturating_sub(1);
                ahead = ahead.saturating_sub(usize::from(own.is_some_and(|o| spot < o)));
            }
        }
        (length, ahead)
    }

    /// The conversations waiting for `bot`, in queue order (1 is next).
    pub fn waiting_for(&self, bot: &str) -> Result<Vec<ConversationId>, StoreError> {
        let prefix = keys::queue_bot(bot);
        let mut out = Vec::new();
        for item in self.queue.scan_prefix(&prefix) {
            let (key, _) = item?;
            if let Some(conversation) = keys::parse_queue_entry(&prefix, &key) {
                out.push(ConversationId::new(conversation));
            }
        }
        Ok(out)
    }

    /// The summary counted from the tree (on open; and tests compare with it).
    pub(super) fn queue_summary_scanned(&self) -> Result<WaitingCounts, StoreError> {
        let mut out = WaitingCounts::default();
        for item in self.queue.scan_prefix([keys::QUEUE_WAITING]) {
            let (key, _) = item?;
            out.add(&key);
        }
        Ok(out)
    }

    /// The waiting entries in memory (a poisoned lock's counts are still whole: every change
    /// is made before the guard drops).
    pub(super) fn waiting_counts(&self) -> std::sync::MutexGuard<'_, WaitingCounts> {
        match self.waiting.lock() {
            Ok(counts) => counts,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Count the waiting entries once, on open.
    pub(super) fn count_waiting(&self) -> Result<(), StoreError> {
        let counted = self.queue_summary_scanned()?;
        match self.waiting.lock() {
            Ok(mut counts) => *counts = counted,
            Err(poisoned) => *poisoned.into_inner() = counted,
        }
        Ok(())
    }

    /// After a fold committed: its changes to the waiting entries.
    pub(super) fn note_waiting(&self, changes: &WaitingChanges) {
        let mut counts = match self.waiting.lock() {
            Ok(counts) => counts,
            Err(poisoned) => poisoned.into_inner(),
        };
        for key in &changes.removed {
            counts.remove(key);
        }
        for key in &changes.added {
            counts.add(key);
        }
    }

    /// A bot's recent accepts, oldest first.
    pub fn accept_history(&self, bot: &str) -> Result<AcceptHistory, StoreError> {
        Ok(
            get_decoded(&self.queue, keys::queue_history(bot), "accept history")?
                .unwrap_or_default(),
        )
    }
}

impl SledStore {
    /// A store from before the waiting queue: index its waiting conversations once, on open
    /// (before any fold, so nothing races with it). A new store has none and only marks it.
    pub(super) fn index_queue_once(&self) -> Result<(), StoreError> {
        self.index_once(keys::meta::QUEUE_INDEXED, "waiting queue", |s| {
            entry_of(s).into_iter().collect()
        })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::port::*;
    use engine::state::stats::{self, HandoffStats, QueueExit};
    use model::ids::DeliveryId;
    use model::webhook::agent::{AgentCommand, Command, DeskAgent};
    use model::webhook::model::Event;

    pub(crate) fn conversation_event(
        id: &str,
        kind: &str,
        conversation: &str,
        at: Millis,
    ) -> model::webhook::IncomingEvent {
        let raw = serde_json::json!({
            "id": id, "event": kind, "sourceType": "bot", "sourceId": "B1", "timestamp": at,
            "data": { "conversation": { "id": conversation, "botId": "B1", "platform": "web" } },
        });
        let raw = serde_json::value::RawValue::from_string(raw.to_string()).expect("raw");
        model::webhook::validate_event(&raw).expect("event")
    }

    fn accept(conversation: &str, id: &str, at: Millis) -> model::webhook::IncomingEvent {
        let cmd = AgentCommand {
            conversation_id: conversation.into(),
            command: Command::Accept {
                agent: DeskAgent {
                    id: "alice".into(),
                    name: None,
                },
            },
        };
        model::webhook::agent_event(&cmd, id, "B1", at).expect("event")
    }

    /// Accept `events` as delivery `delivery` and return the new ones as the dispatcher hands
    /// them to a fold: (sequence number, event), in order.
    pub(crate) fn accepted_batch(
        store: &SledStore,
        delivery: &str,
        events: &[model::webhook::IncomingEvent],
    ) -> Vec<(u64, Event)> {
        accepted_batch_at(store, delivery, events, 10)
    }

    /// [`accepted_batch`], received at `received_at` (the folds' decisions read it as now).
    pub(crate) fn accepted_batch_at(
        store: &SledStore,
        delivery: &str,
        events: &[model::webhook::IncomingEvent],
        received_at: model::webhook::model::Millis,
    ) -> Vec<(u64, Event)> {
        let accepted = store
            .accept(&DeliveryId::new(delivery), events, received_at)
            .expect("accept");
        accepted
            .new
            .iter()
            .zip(&accepted.new_index)
            .map(|((seq, _), i)| (*seq, events[*i].event.clone()))
            .collect()
    }

    /// Every key in `queue/v1` that starts with one of `prefixes` (first bytes), sorted.
    pub(crate) fn queue_keys(store: &SledStore, prefixes: &[u8]) -> Vec<Vec<u8>> {
        let mut keys: Vec<Vec<u8>> = prefixes
            .iter()
            .flat_map(|p| store.queue.scan_prefix([*p]).keys())
            .map(|k| k.expect("key").to_vec())
            .collect();
        keys.sort();
        keys
    }

    /// Accept and fold `events` as one batch (like the dispatcher).
    pub(crate) fn fold(
        store: &SledStore,
        delivery: &str,
        events: Vec<model::webhook::IncomingEvent>,
    ) {
        let batch = accepted_batch(store, delivery, &events);
        assert_eq!(batch.len(), events.len());
        store.apply(&batch).expect("apply");
    }

    /// Accept and fold `events` as one batch with `rules` deciding; the texts of the messages they
    /// decided, in order.
    fn fold_with(
        store: &SledStore,
        delivery: &str,
        events: Vec<model::webhook::IncomingEvent>,
        rules: &engine::rules::RuleSet,
    ) -> Vec<String> {
        let batch = accepted_batch(store, delivery, &events);
        let applied = store.apply_with(&batch, rules, &[]).expect("apply");
        applied
            .outbox
            .iter()
            .filter_map(|e| match &e.action {
                model::action::Action::SendMessage { message, .. } => message.text.clone(),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_standing_counts_the_entries_ahead_from_either_end() {
        let mut counts = WaitingCounts::default();
        let key = |at: i64, c: &str| keys::queue_entry("b1", at, c);
        for (i, at) in [10, 20, 30, 40, 50].into_iter().enumerate() {
            counts.add(&key(at, &format!("c{i}")));
        }
        counts.add(&keys::queue_entry("b2", 5, "other"));
        let prefix = keys::queue_bot("b1");
        for (own, ahead) in [
            (key(10, "c0"), 0),
            (key(30, "c2"), 2),
            (key(40, "c3"), 3),
            (key(50, "c4"), 4),
            // Not in the tree (a fold's entry now): where it would sort.
            (key(1, "new"), 0),
            (key(35, "new"), 3),
            (key(99, "new"), 5),
        ] {
            assert_eq!(
                counts.bot_standing(&prefix, Some(&own)),
                (5, ahead),
                "{own:?}"
            );
        }
        assert_eq!(counts.bot_standing(&prefix, None), (5, 0));
        assert_eq!(counts.bot_standing(&keys::queue_bot("b3"), None), (0, 0));
    }

    /// The kept summary, checked against a count of the tree; and each bot's kept entries (what
    /// a fold's standings count) against the tree's.
    fn summary(store: &SledStore) -> QueueSummary {
        let kept = store.queue_summary().expect("queue summary");
        let scanned = store.queue_summary_scanned().expect("scan");
        assert_eq!(kept, scanned.summary(), "the kept counts equal the tree");
        let by_bot = store.waiting.lock().expect("counts").by_bot.clone();
        assert_eq!(by_bot, scanned.by_bot, "the kept entries equal the tree");
        kept
    }

    fn position(store: &SledStore, conversation: &str) -> Option<u32> {
        store
            .queue_standing(&conversation.into())
            .expect("read")
            .expect("known")
            .position
    }

    #[test]
    fn rules_see_the_standing_after_each_event_within_one_batch() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(dir.path(), 8 << 20).expect("open");
        let rules = engine::rules::RuleSet::from_sources(&[(
            "q.toml".into(),
            r#"
[[rule]]
name = "tell"
on = ["bot.conversation.agent_call_requested", "bot.conversation.agent_call_cancelled"]
actions = [{ type = "send_message", text = "{{ conversation_id }} {{ queue.waiting }} {{ queue.position }}/{{ queue.length }}" }]
"#
            .into(),
        )])
        .expect("rules");
        let requested = "bot.conversation.agent_call_requested";
        let texts = fold_with(
            &store,
            "d1",
            vec![
                conversation_event("e1", requested, "c1", 1_000),
                conversation_event("e2", requested, "c2", 2_000),
                conversation_event("e3", "bot.conversation.agent_call_cancelled", "c1", 3_000),
            ],
            &rules,
        );
        // Each event's rules see the queue with that event folded in, the batch's earlier events
        // included (none of it is in the tree yet).
        assert_eq!(
            texts,
            ["c1 True 1/1", "c2 True 2/2", "c1 False None/1"],
            "{texts:?}"
        );
        let texts = fold_with(
            &store,
            "d2",
            vec![conversation_event("e4", requested, "c3", 4_000)],
            &rules,
        );
        assert_eq!(texts, ["c3 True 2/2"], "the committed tree counts c2");
    }

    #[test]
    fn the_kept_queue_counts_are_right_after_a_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let requested = "bot.conversation.agent_call_requested";
        {
            let store = SledStore::open(dir.path(), 8 << 20).expect("open");
            fold(
                &store,
                "d1",
                vec![
                    conversation_event("e1", requested, "c1", 5_000),
                    conversation_event("e2", requested, "c2", 3_000),
                    // Asked again later in the same batch: one entry, moved to the new request.
                    conversation_event("e3", requested, "c1", 9_000),
                ],
            );
            fold(&store, "d2", vec![accept("c2", "a2", 10_000)]);
            assert_eq!(
                summary(&store),
                QueueSummary {
                    waiting: 1,
                    oldest_since: Some(9_000)
                }
            );
            store.flush().expect("flush");
        }
        let store = SledStore::open(dir.path(), 8 << 20).expect("reopen");
        assert_eq!(
            store.queue_summary().expect("queue summary"),
            QueueSummary {
                waiting: 1,
                oldest_since: Some(9_000)
            },
            "counted on open"
        );
        fold(
            &store,
            "d3",
            vec![conversation_event("e4", requested, "c3", 4_000)],
        );
        assert_eq!(
            summary(&store),
            QueueSummary {
                waiting: 2,
                oldest_since: Some(4_000)
            }
        );
    }

    #[test]
    fn a_store_from_before_the_queue_indexes_its_waiting_conversations_on_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let store = SledStore::open(dir.path(), 8 << 20).expect("open");
            let requested = "bot.conversation.agent_call_requested";
            fold(
                &store,
                "d1",
                vec![conversation_event("e1", requested, "c1", 1_000)],
            );
            // As a store of the previous version: no queue tree contents, no mark.
            store.queue.clear().expect("clear");
            store
                .meta
                .remove(keys::meta::QUEUE_INDEXED)
                .expect("unmark");
            store.db.flush().expect("flush");
            assert!(store.waiting_for("B1").expect("queue").is_empty());
        }
        let store = SledStore::open(dir.path(), 8 << 20).expect("reopen");
        let waiting = store.waiting_for("B1").expect("queue");
        assert_eq!(waiting, [ConversationId::new("c1")]);
    }

    #[test]
    fn the_fold_keeps_the_queue_in_request_order_and_learns_the_accept_rate() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(dir.path(), 8 << 20).expect("open");
        let requested = "bot.conversation.agent_call_requested";
        // c2 asks first; c1 and c3 in the same batch (c3 at the same time as c1).
        fold(
            &store,
            "d1",
            vec![conversation_event("e2", requested, "c2", 1_000)],
        );
        fold(
            &store,
            "d2",
            vec![
                conversation_event("e1", requested, "c1", 2_000),
                conversation_event("e3", requested, "c3", 2_000),
            ],
        );
        let order = |store: &SledStore| {
            store
                .waiting_for("B1")
                .expect("queue")
                .iter()
                .map(|c| c.as_str().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(order(&store), ["c2", "c1", "c3"]);
        assert_eq!(
            summary(&store),
            QueueSummary {
                waiting: 3,
                oldest_since: Some(1_000)
            }
        );
        assert_eq!(position(&store, "c1"), Some(2));
        let standing = store
            .queue_standing(&"c3".into())
            .expect("read")
            .expect("known");
        assert_eq!((standing.position, standing.length), (Some(3), 3));
        assert_eq!(standing.expected_wait_seconds, None, "no accepts yet");

        // An agent accepts c2 through the agent API; the service connects c1 a minute later.
        fold(&store, "d3", vec![accept("c2", "a2", 61_000)]);
        assert_eq!(
            summary(&store),
            QueueSummary {
                waiting: 2,
                oldest_since: Some(2_000)
            },
            "an accept leaves the queue"
        );
        assert_eq!(position(&store, "c2"), None);
        assert_eq!(position(&store, "c1"), Some(1));
        fold(
            &store,
            "d4",
            vec![conversation_event(
                "e4",
                "bot.conversation.agent_call_connected",
                "c1",
                121_000,
            )],
        );
        assert_eq!(order(&store), ["c3"]);
        assert_eq!(
            summary(&store),
            QueueSummary {
                waiting: 1,
                oldest_since: Some(2_000)
            }
        );
        let history = store.accept_history("B1").expect("history");
        let seen: Vec<(Millis, Millis)> = history
            .accepts
            .iter()
            .map(|a| (a.at, a.waited_ms))
            .collect();
        assert_eq!(seen, [(61_000, 60_000), (121_000, 119_000)]);
        // One accept a minute: c3, next in line, waits about a minute.
        let standing = store
            .queue_standing(&"c3".into())
            .expect("read")
            .expect("known");
        assert_eq!(standing.position, Some(1));
        assert_eq!(standing.expected_wait_seconds, Some(60));

        // A cancel leaves the queue without counting as an accept.
        fold(
            &store,
            "d5",
            vec![conversation_event(
                "e5",
                "bot.conversation.agent_call_cancelled",
                "c3",
                130_000,
            )],
        );
        assert!(order(&store).is_empty());
        assert_eq!(summary(&store), QueueSummary::default(), "a cancel leaves");
        assert_eq!(
            store.accept_history("B1").expect("history").accepts.len(),
            2
        );
        assert_eq!(
            store.queue_standing(&"nobody".into()).expect("read"),
            None,
            "no standing: the help desk is told nothing (position and wait null)"
        );
    }

    /// Handoff figures: an hour on the hour (2025-11-21 02:00 UTC), and the kinds of the events.
    const H0: Millis = 1_763_690_400_000;
    const HOUR: Millis = stats::HOUR_MS;
    const MIN: Millis = 60_000;
    const REQUESTED: &str = "bot.conversation.agent_call_requested";
    const CANCELLED: &str = "bot.conversation.agent_call_cancelled";
    const CONNECTED: &str = "bot.conversation.agent_call_connected";

    fn figures(store: &SledStore, since: Millis, until: Millis) -> HandoffStats {
        store.handoff_stats(since, until).expect("figures")
    }

    /// Accept and fold `events` as one batch; the queue exits the fold reports.
    fn fold_exits(
        store: &SledStore,
        delivery: &str,
        events: Vec<model::webhook::IncomingEvent>,
    ) -> Vec<(QueueExit, Option<Millis>)> {
        let batch = accepted_batch(store, delivery, &events);
        store.apply(&batch).expect("apply").queue_exits
    }

    #[test]
    fn a_join_then_an_accept_records_the_wait_in_its_bucket() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(dir.path(), 8 << 20).expect("open");
        let joined = fold_exits(
            &store,
            "d1",
            vec![conversation_event("e1", REQUESTED, "c1", H0 + MIN)],
        );
        assert!(joined.is_empty());
        let hour = figures(&store, H0, H0 + HOUR);
        assert_eq!((hour.joined, hour.exits.accepted), (1, 0));
        assert_eq!(hour.percentile(0.5), None, "no accepts yet");
        // An agent takes it 40 s later: in the (30 s, 45 s] bucket.
        let exits = fold_exits(&store, "d2", vec![accept("c1", "a1", H0 + MIN + 40_000)]);
        assert_eq!(exits, [(QueueExit::Accepted, Some(40_000))]);
        let hour = figures(&store, H0, H0 + HOUR);
        assert_eq!(hour.joined, 1);
        assert_eq!(hour.exits.accepted, 1);
        assert_eq!((hour.abandoned(), hour.abandonment_rate()), (0, Some(0.0)));
        let bucket = stats::TIME_TO_ACCEPT_BOUNDS
            .iter()
            .position(|b| *b == 45)
            .expect("45 s");
        assert_eq!(hour.time_to_accept.counts[bucket], 1);
        assert_eq!(hour.time_to_accept.count(), 1);
        assert_eq!(hour.time_to_accept.sum_ms, 40_000);
        assert_eq!(
            hour.percentile(0.5),
            Some(37_500),
            "halfway through the bucket"
        );
        // The service connecting it afterwards is no second exit.
        let again = fold_exits(
            &store,
            "d3",
            vec![conversation_event("e2", CONNECTED, "c1", H0 + 2 * MIN)],
        );
        assert!(again.is_empty());
        assert_eq!(figures(&store, H0, H0 + HOUR), hour);
    }

    #[test]
    fn a_join_then_a_cancel_is_an_abandonment() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(dir.path(), 8 << 20).expect("open");
        let exits = fold_exits(
            &store,
            "d1",
            vec![
                conversation_event("e1", REQUESTED, "c1", H0 + MIN),
                conversation_event("e2", REQUESTED, "c2", H0 + MIN),
                conversation_event("e3", CANCELLED, "c1", H0 + 5 * MIN),
            ],
        );
        assert_eq!(exits, [(QueueExit::Cancelled, None)]);
        let hour = figures(&store, H0, H0 + HOUR);
        assert_eq!(hour.joined, 2);
        assert_eq!(hour.exits.cancelled, 1);
        assert_eq!(hour.abandoned(), 1);
        assert_eq!(hour.abandonment_rate(), Some(0.5));
        assert_eq!(hour.percentile(0.9), None, "no accepts: no time to accept");
        // The service ends the other one's call before anyone took it.
        let exits = fold_exits(
            &store,
            "d2",
            vec![conversation_event(
                "e4",
                "bot.conversation.agent_call_disconnected",
                "c2",
                H0 + 6 * MIN,
            )],
        );
        assert_eq!(exits, [(QueueExit::Ended, None)]);
        let hour = figures(&store, H0, H0 + HOUR);
        assert_eq!((hour.exits.ended, hour.abandoned()), (1, 2));
        assert_eq!(hour.abandonment_rate(), Some(1.0));
    }

    /// The shipped rules' answer to a wait that runs out (`timer.agent-wait`, rule `no-agent`)
    /// hands the user back to the bot: the conversation leaves the queue at the firing, counted
    /// as `timed_out` (issue 37: `state::queue::hand_back`); the service's cancel that follows
    /// moves nothing more.
    #[test]
    fn a_wait_run_out_under_the_shipped_rules_leaves_the_queue_timed_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(dir.path(), 8 << 20).expect("open");
        let mut overrides = serde_json::Map::new();
        overrides.insert("check_business_hours".into(), false.into());
        let sources = engine::rules::shipped::sources();
        let rules =
            engine::rules::RuleSet::from_sources_with(&sources, &overrides).expect("shipped");
        let t0 = stats::hour_of(model::clock::system_millis());
        let events = [conversation_event("e1", REQUESTED, "c1", t0)];
        accepted_batch_at(&store, "d1", &events, t0);
        crate::test_support::drain_with(&store, &rules);
        let timers = crate::test_support::all_timers(&store);
        let wait = timers
            .iter()
            .find(|t| t.firing.name == "agent-wait")
            .expect("the wait is timed");
        crate::test_support::fire_at(&store, wait, wait.firing.due_at);
        let fired = crate::test_support::drain_with(&store, &rules);
        assert_eq!(fired.applied, 1);
        assert!(
            fired.outbox.iter().any(|e| matches!(
                e.action,
                model::action::Action::SetManual { enabled: false, .. }
            )),
            "no-agent ran: {:?}",
            fired.outbox
        );
        assert_eq!(fired.queue_exits, [(QueueExit::TimedOut, None)]);
        assert!(store.waiting_for("B1").expect("queue").is_empty());
        let window = (t0 - HOUR, t0 + 2 * HOUR);
        let day = figures(&store, window.0, window.1);
        assert_eq!((day.joined, day.abandoned()), (1, 1));
        let events = [conversation_event("e2", CANCELLED, "c1", t0 + 6 * MIN)];
        accepted_batch(&store, "d2", &events);
        let cancelled = crate::test_support::drain_with(&store, &rules);
        assert!(cancelled.queue_exits.is_empty(), "it had left already");
        let day = figures(&store, window.0, window.1);
        assert_eq!((day.exits.timed_out, day.exits.cancelled), (1, 0));
        assert_eq!(day.abandonment_rate(), Some(1.0));
    }

    #[test]
    fn each_hour_has_its_record_and_batches_of_one_hour_add_up() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(dir.path(), 8 << 20).expect("open");
        let h1 = H0 + HOUR;
        // c1 joins in H0 and is accepted in H1 after 55 minutes; c2 and c3 join in H0 in two
        // batches; c3 is taken 10 s later, c2 cancels in H1.
        fold(
            &store,
            "d1",
            vec![
                conversation_event("e1", REQUESTED, "c1", H0 + 10 * MIN),
                conversation_event("e2", REQUESTED, "c2", H0 + 20 * MIN),
            ],
        );
        fold(
            &store,
            "d2",
            vec![
                conversation_event("e3", REQUESTED, "c3", H0 + 30 * MIN),
                accept("c3", "a3", H0 + 30 * MIN + 10_000),
            ],
        );
        let exits = fold_exits(
            &store,
            "d3",
            vec![
                conversation_event("e4", CONNECTED, "c1", h1 + 5 * MIN),
                conversation_event("e5", CANCELLED, "c2", h1 + 6 * MIN),
            ],
        );
        assert_eq!(
            exits,
            [
                (QueueExit::Accepted, Some(55 * MIN)),
                (QueueExit::Cancelled, None)
            ]
        );
        let first = figures(&store, H0, h1);
        assert_eq!(first.joined, 3, "the batches of one hour add up");
        assert_eq!(first.exits.accepted, 1);
        assert_eq!(first.percentile(0.5), Some(7_500), "c3's 10 s");
        let second = figures(&store, h1, h1 + HOUR);
        assert_eq!(second.joined, 0);
        assert_eq!((second.exits.accepted, second.exits.cancelled), (1, 1));
        assert_eq!(
            second.percentile(0.5),
            Some(2_700_000),
            "c1's 55 min: halfway through (30 min, 60 min]"
        );
        // Both hours: merged.
        let both = figures(&store, H0, h1 + HOUR);
        let mut merged = first.clone();
        merged.merge(&second);
        assert_eq!(both, merged);
        assert_eq!((both.joined, both.abandoned()), (3, 1));
        assert_eq!(both.time_to_accept.count(), 2);
        // Stored as two records, apart from the queue's other keys.
        assert_eq!(
            queue_keys(&store, &[keys::QUEUE_STATS]),
            [
                keys::queue_stats(H0).to_vec(),
                keys::queue_stats(h1).to_vec()
            ]
        );
    }

    #[test]
    fn a_window_reads_only_the_hours_it_overlaps() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(dir.path(), 8 << 20).expect("open");
        let day = 24 * HOUR;
        let now = H0 + 30 * HOUR + 17 * MIN;
        fold(
            &store,
            "d1",
            vec![
                // Older than the day before `now`: outside the window.
                conversation_event("e1", REQUESTED, "old", now - day - 2 * HOUR),
                // In the hour `now - day` is in: counted whole.
                conversation_event("e2", REQUESTED, "edge", now - day - 10 * MIN),
                conversation_event("e3", REQUESTED, "new", now - MIN),
            ],
        );
        assert_eq!(figures(&store, now - day, now).joined, 2);
        assert_eq!(figures(&store, now - day + HOUR, now).joined, 1);
        assert_eq!(figures(&store, now - 3 * day, now).joined, 3);
        assert_eq!(figures(&store, now, now), HandoffStats::default(), "empty");
        assert_eq!(figures(&store, now, now - day), HandoffStats::default());
        // `until` on the hour leaves that hour out.
        let hour_of_new = stats::hour_of(now - MIN);
        assert_eq!(figures(&store, hour_of_new - HOUR, hour_of_new).joined, 0);
        assert_eq!(figures(&store, hour_of_new, hour_of_new + 1).joined, 1);
    }

    #[test]
    fn hour_records_before_the_kept_window_are_pruned_a_bounded_number_at_a_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(dir.path(), 8 << 20).expect("open");
        let events: Vec<_> = (0..5)
            .map(|i| {
                conversation_event(&format!("e{i}"), REQUESTED, &format!("c{i}"), H0 + i * HOUR)
            })
            .collect();
        fold(&store, "d1", events);
        let now = H0 + 4 * HOUR + stats::KEPT_MS + MIN;
        let before = now - stats::KEPT_MS;
        assert_eq!(store.prune_handoff_stats(before, 2).expect("prune"), 2);
        assert_eq!(store.prune_handoff_stats(before, 2).expect("prune"), 2);
        assert_eq!(store.prune_handoff_stats(before, 2).expect("prune"), 0);
        assert_eq!(
            queue_keys(&store, &[keys::QUEUE_STATS]),
            [keys::queue_stats(H0 + 4 * HOUR).to_vec()],
            "the hour `before` is in stays"
        );
        assert_eq!(figures(&store, H0, now).joined, 1);
        assert_eq!(summary(&store).waiting, 5, "the queue itself is untouched");
    }
}
