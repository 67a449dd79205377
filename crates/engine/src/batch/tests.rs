//! The batch fold against reads kept in maps: what it reads, and the write set it hands back.

use super::*;
use crate::index::{Derived, StateKind};
use crate::state::queue::AcceptHistory;
use model::webhook::parse_event;

/// Reads from maps, counting each read of a record.
#[derive(Default)]
struct Maps {
    conversations: HashMap<String, ConversationState>,
    marks: HashMap<String, u64>,
    ledger: HashSet<String>,
    reads: usize,
}

impl FoldReads for Maps {
    type Error = FoldError;

    fn conversation(
        &mut self,
        id: &ConversationId,
    ) -> Result<Option<ConversationState>, FoldError> {
        self.reads += 1;
        Ok(self.conversations.get(id.as_str()).cloned())
    }

    fn end_user(&mut self, _: &EndUserId) -> Result<Option<EndUserState>, FoldError> {
        Ok(None)
    }

    fn bot(&mut self, _: &str) -> Result<Option<BotState>, FoldError> {
        Ok(None)
    }

    fn folded_mark(&mut self, partition: &str) -> Result<Option<u64>, FoldError> {
        self.reads += 1;
        Ok(self.marks.get(partition).copied())
    }

    fn decided_before(&mut self, action_id: &str) -> Result<bool, FoldError> {
        Ok(self.ledger.contains(action_id))
    }

    fn ledger_state(&mut self, _: &str) -> Result<Option<String>, FoldError> {
        Ok(None)
    }

    fn accept_history(&mut self, _: &str) -> Result<Option<AcceptHistory>, FoldError> {
        Ok(None)
    }

    fn hour_stats(&mut self, _: Millis) -> Result<Option<HandoffStats>, FoldError> {
        Ok(None)
    }

    fn waiting_standing(
        &mut self,
        _: &str,
        _: Option<QueueSpot<'_>>,
        _: &mut dyn Iterator<Item = QueueSpot<'_>>,
    ) -> Result<(usize, usize), FoldError> {
        Ok((0, 0))
    }
}

fn message(id: &str, conversation: &str) -> Event {
    let raw = format!(
        r#"{{"id":"{id}","event":"bot.message.received","sourceType":"bot","sourceId":"B1","timestamp":5,
        "data":{{"message":{{"id":"m{id}","conversationId":"{conversation}","isUser":true,"meta":null,"data":{{"type":"text","text":"x"}}}}}}}}"#
    );
    parse_event(&raw).expect("message event")
}

fn greet() -> crate::rules::RuleSet {
    let text = "[[rule]]\nname = \"greet\"\non = [\"bot.message.received\"]\n\
                actions = [{ type = \"send_message\", text = \"hi\" }]\n";
    crate::rules::RuleSet::from_sources(&[("r.toml".into(), text.into())]).expect("rules")
}

fn fold(reads: &mut Maps, events: &[(u64, Event)], position: &Position) -> WriteSet {
    let partitions: Vec<PartitionKey> = events
        .iter()
        .map(|(_, e)| model::webhook::partition_of(e))
        .collect();
    let batch = Batch {
        events,
        partitions: &partitions,
        received: &[],
        position,
        now: 1_000,
    };
    fold_batch(reads, batch, &greet()).expect("fold")
}

#[test]
fn a_batch_reads_each_record_once_and_writes_each_state_with_its_mark_and_index_entries() {
    let mut reads = Maps::default();
    let events = [(1, message("e1", "c1")), (2, message("e2", "c1"))];
    let position = Position {
        frames: vec![Cursor::from_raw(10), Cursor::from_raw(20)],
        fold_from: Some(Cursor::from_raw(30)),
        ..Position::default()
    };
    let writes = fold(&mut reads, &events, &position);
    assert_eq!(reads.reads, 2, "one state and one mark, read once each");
    assert_eq!((writes.applied.applied, writes.applied.skipped), (2, 0));
    assert_eq!(writes.conversations.len(), 1);
    assert!(writes.conversations[0].created);
    assert_eq!(writes.conversations[0].state.events_applied, 2);
    assert_eq!(writes.partitions.len(), 1);
    let partition = &writes.partitions[0];
    assert_eq!(partition.mark, Some(2));
    assert_eq!(
        partition.events,
        [(1, Cursor::from_raw(10)), (2, Cursor::from_raw(20))]
    );
    assert_eq!(writes.fold_from, Some(Cursor::from_raw(30)));
    // A new conversation: its entries are all new, none removed.
    assert!(writes.derived.removed.is_empty() && writes.activity.removed.is_empty());
    assert!(writes.derived.added.contains(&Derived::Phase {
        phase: crate::state::desk::DeskPhase::Bot,
        requested_at: None,
        conversation: "c1".into(),
    }));
    assert_eq!(writes.activity.added.len(), 1);
    assert_eq!(writes.activity.added[0].kind, StateKind::Conversation);
    // One action per event, not numbered yet (the store numbers them as it commits).
    let ids: Vec<&str> = writes
        .applied
        .outbox
        .iter()
        .map(|e| e.id.as_str())
        .collect();
    assert_eq!(ids, ["e1/greet/0", "e2/greet/0"]);
    assert!(writes.applied.outbox.iter().all(|e| e.seq == 0));
    assert_eq!(writes.applied.new_conversations, 1);
}

#[test]
fn events_at_or_below_their_mark_and_actions_decided_before_are_skipped() {
    let mut reads = Maps::default();
    reads.marks.insert("c:c1".into(), 2);
    reads.ledger.insert("e3/greet/0".into());
    let mut state = ConversationState::new("c1".into());
    state.apply(&message("e1", "c1"));
    let activity = crate::index::conversation_activity(&state);
    reads.conversations.insert("c1".into(), state);
    let events = [
        (2, message("e2", "c1")),
        (3, message("e3", "c1")),
        (4, message("e4", "c1")),
    ];
    let writes = fold(&mut reads, &events, &Position::default());
    assert_eq!((writes.applied.applied, writes.applied.skipped), (2, 1));
    assert_eq!(
        writes.applied.repeated_actions, 1,
        "e3's was decided before"
    );
    let ids: Vec<&str> = writes
        .applied
        .outbox
        .iter()
        .map(|e| e.id.as_str())
        .collect();
    assert_eq!(ids, ["e4/greet/0"]);
    assert!(!writes.conversations[0].created);
    assert_eq!(writes.partitions[0].mark, Some(4));
    assert!(
        writes.partitions[0].events.is_empty(),
        "no frames: not indexed"
    );
    // Read, not created: its facts unchanged, its derived entries stay; its activity moved on
    // only if its newest event did (the messages share a timestamp).
    assert!(writes.derived.added.is_empty() && writes.derived.removed.is_empty());
    assert_eq!(
        activity,
        crate::index::conversation_activity(&writes.conversations[0].state)
    );
    assert!(writes.activity.added.is_empty());
    // A second batch of the same events: all at or below the new mark.
    reads.marks.insert("c:c1".into(), 4);
    let again = fold(&mut reads, &events, &Position::default());
    assert_eq!((again.applied.applied, again.applied.skipped), (0, 3));
    assert!(again.partitions.is_empty() && again.conversations.is_empty());
}

#[test]
fn a_batch_whose_partitions_do_not_match_its_events_is_refused() {
    let mut reads = Maps::default();
    let events = [(1, message("e1", "c1"))];
    let batch = Batch {
        events: &events,
        partitions: &[],
        received: &[],
        position: &Position::default(),
        now: 1,
    };
    assert!(fold_batch(&mut reads, batch, &greet()).is_err());
}

/// The queue's definition (issue 37): a rule that turns manual mode off for the request (after
/// hours) hands the user back at the deciding event itself: the conversation never stays in
/// the queue, and the figures count it joined and left `timed_out` in that one fold.
#[test]
fn a_request_the_rules_hand_back_leaves_the_queue_at_its_own_event_timed_out() {
    let raw = r#"{"id":"e1","event":"bot.conversation.agent_call_requested","sourceType":"bot",
        "sourceId":"B1","timestamp":5,"data":{"conversation":{"id":"c1","botId":"B1",
        "platform":"web","userKey":"k1","params":{},"context":{"platform":"web"}}}}"#;
    let events = [(1, parse_event(raw).expect("agent call"))];
    let text = "[[rule]]\nname = \"closed\"\non = [\"bot.conversation.agent_call_requested\"]\n\
                actions = [{ type = \"set_manual\", enabled = false }]\n";
    let rules =
        crate::rules::RuleSet::from_sources(&[("r.toml".into(), text.into())]).expect("rules");
    let partitions = [model::webhook::partition_of(&events[0].1)];
    let batch = Batch {
        events: &events,
        partitions: &partitions,
        received: &[],
        position: &Position::default(),
        now: 1_000,
    };
    let writes = fold_batch(&mut Maps::default(), batch, &rules).expect("fold");
    let state = &writes.conversations[0].state;
    assert_eq!(crate::state::queue::waiting_since(state), None);
    assert_eq!(state.handoff.handed_back_at, Some(5));
    assert!(writes.queue.joined.is_empty(), "{:?}", writes.queue.joined);
    assert_eq!(
        writes.applied.queue_exits,
        [(QueueExit::TimedOut, None)],
        "one exit, timed out"
    );
    let (_, hour) = &writes.queue.hours[0];
    assert_eq!(hour.joined, 1);
    assert_eq!(hour.exits.timed_out, 1, "{hour:?}");
}

/// A fold lost in a crash (its actions may have run) is done again later, from the log: it must
/// decide the same actions with the same texts and start the same timers, whenever it runs.
#[test]
fn a_fold_done_again_later_decides_as_the_first_did() {
    let text = "[[rule]]\nname = \"stamp\"\non = [\"bot.message.received\"]\n\
                actions = [{ type = \"send_message\", text = \"at {{ now }}\" },\n\
                { type = \"start_timer\", name = \"wait\", after = \"60s\" }]\n";
    let rules =
        crate::rules::RuleSet::from_sources(&[("r.toml".into(), text.into())]).expect("rules");
    let events = [(1, message("e1", "c1")), (2, message("e2", "c2"))];
    let partitions: Vec<PartitionKey> = events
        .iter()
        .map(|(_, e)| model::webhook::partition_of(e))
        .collect();
    let fold_at = |now: Millis| {
        let batch = Batch {
            events: &events,
            partitions: &partitions,
            received: &[7_000, 8_000],
            position: &Position::default(),
            now,
        };
        fold_batch(&mut Maps::default(), batch, &rules).expect("fold")
    };
    let (first, again) = (fold_at(10_000), fold_at(3_600_000));
    let decided = |w: &WriteSet| -> Vec<(String, model::action::Action)> {
        let outbox = w.applied.outbox.iter();
        outbox.map(|e| (e.id.clone(), e.action.clone())).collect()
    };
    assert_eq!(decided(&first), decided(&again));
    let sent: Vec<String> = first
        .applied
        .outbox
        .iter()
        .map(|e| serde_json::to_string(&e.action).expect("json"))
        .collect();
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert!(
        sent[0].contains("at 7000"),
        "the first event's receive time: {sent:?}"
    );
    let due = |w: &WriteSet| -> Vec<Millis> {
        // In no particular order (the batch keeps its states in a map).
        let mut due: Vec<Millis> = w.timers.started.iter().map(|t| t.timer.due_at).collect();
        due.sort_unstable();
        due
    };
    assert_eq!(
        due(&first),
        [67_000, 68_000],
        "from each event's receive time"
    );
    assert_eq!(due(&first), due(&again));
}
