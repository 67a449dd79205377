//! Replay: stored events re-run through the current rules.
//!
//! The state an event is decided against is rebuilt by folding its conversation's stored events
//! from the start, in acceptance order (the order the dispatcher folded them in), applying the
//! current rules' own state changes (labels, variables, timers) on the way. Those shape only the
//! rebuilt states: a replay never writes state, nor schedules or cancels a real timer. Stored
//! timer events are decided again when the rebuilt state still has the run that fired. Events older than the event
//! retention are gone, so a conversation's earliest state may be thinner than it was.
//!
//! Rules' firing caps count by the events' receive times, so the rebuilt firing history holds back
//! the same rules for the same events as the fold did (with the same rules).
//!
//! An action that was decided before (its id is in the ledger) is reported and not queued again,
//! unless forced: a forced action gets a new id, and with it a new idempotency key, because the
//! upstream would otherwise answer the old call's result without acting.

use super::{decode, outbox::ActionStatus, EventRecord, SledStore, StoreError};
use engine::decide::Decide;
use engine::state::{ConversationState, EndUserState};
use model::action::{action_id, Action, Decision, OutboxEntry};
use model::ids::{ConversationId, EndUserId, PartitionKey};
use model::webhook::model::{Event, Millis};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;

/// Which events, and what to do with their actions.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct ReplayRequest {
    /// Events received at or after this time (Unix ms)...
    pub from: Millis,
    /// ...and before this one.
    pub to: Millis,
    /// Only report; queue nothing.
    #[serde(default)]
    pub dry_run: bool,
    /// Queue actions that ran before, under new ids.
    #[serde(default)]
    pub force: bool,
}

/// One action the current rules decide for a replayed event.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplayItem {
    pub event_id: String,
    pub conversation_id: ConversationId,
    pub rule: String,
    /// The id it is (or would be) queued under.
    pub id: String,
    /// `new` (never decided), `already_decided` (skipped), `forced` (decided before, queued
    /// again under a new id).
    pub status: &'static str,
    /// What the ledger says about the original id, if it was decided before.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub previous: Option<String>,
    pub queued: bool,
    pub action: Action,
}

/// A rule its firing cap held back for a replayed event (as it would the fold, which counts
/// firings by receive time too).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplayCapped {
    pub event_id: String,
    pub conversation_id: ConversationId,
    pub rule: String,
    /// Its firings inside the cap's window then.
    pub fired: usize,
}

#[derive(Debug, Default, Serialize)]
pub struct ReplayReport {
    /// The version of the rules that decided ([`Decide::version`]).
    pub rules_version: String,
    /// Events in the window that belong to a conversation (others have no rules).
    pub events: u64,
    /// Events in the window still waiting in the inbox: they will be decided normally.
    pub pending_events: u64,
    pub queued: u64,
    pub skipped: u64,
    pub items: Vec<ReplayItem>,
    /// Rules held back by their firing caps, for the window's events.
    pub capped: Vec<ReplayCapped>,
    /// Queued entries, for the executor (not part of the printed report).
    #[serde(skip)]
    pub entries: Vec<OutboxEntry>,
}

impl ReplayRequest {
    /// Whether a stored event was received inside the window.
    fn in_window(&self, r: &EventRecord) -> bool {
        r.received_at >= self.from && r.received_at < self.to
    }
}

impl SledStore {
    /// Re-run the window's events through `rules`; unless `dry_run`, queue what is new (or forced)
    /// in one journal, as a fold would. The caller makes it durable (flush) before telling the executor.
    pub(crate) fn replay(
        &self,
        request: &ReplayRequest,
        rules: &dyn Decide,
    ) -> Result<ReplayReport, StoreError> {
        // Serialised with folds: an event cannot be decided by a fold and by the replay at once.
        let _folding = self.fold_guard()?;
        let mut report = ReplayReport {
            rules_version: rules.version().to_owned(),
            ..ReplayReport::default()
        };
        let Some((wanted, last_seq)) = self.replay_scope(request, &mut report)? else {
            return Ok(report);
        };
        let records = self.replay_records(&wanted, last_seq)?;
        let mut replay = Replay {
            store: self,
            request,
            rules,
            now: self.clock.now_millis(),
            taken: HashSet::new(),
            report,
        };
        replay.fold(records)?;
        let report = replay.report;
        if report.entries.is_empty() {
            return Ok(report);
        }
        let mut journal = super::Journal::default();
        super::outbox::journal_pending(&mut journal, &report.entries)?;
        self.commit_journal(&journal)?;
        Ok(report)
    }

    /// Pass 1: the conversations with events in the window, and where the window ends (none if
    /// it has no folded conversation event); counts the window's pending events.
    fn replay_scope(
        &self,
        request: &ReplayRequest,
        report: &mut ReplayReport,
    ) -> Result<Option<(HashSet<String>, u64)>, StoreError> {
        let mut wanted = HashSet::new();
        let mut last_seq = None;
        self.scan_events(|record, pending| {
            let conversation = matches!(
                PartitionKey::decode(&record.partition),
                Some(PartitionKey::Conversation(_))
            );
            if request.in_window(&record) && conversation {
                if pending {
                    report.pending_events += 1;
                } else {
                    wanted.insert(record.partition.clone());
                    last_seq = Some(record.seq);
                }
            }
            ControlFlow::Continue(())
        })?;
        Ok(last_seq.map(|last_seq| (wanted, last_seq)))
    }

    /// Pass 2's input: the wanted conversations' folded events, from their first stored one up
    /// to the window's end.
    fn replay_records(
        &self,
        wanted: &HashSet<String>,
        last_seq: u64,
    ) -> Result<Vec<EventRecord>, StoreError> {
        let mut records = Vec::new();
        self.scan_events(|record, pending| {
            if record.seq > last_seq {
                return ControlFlow::Break(());
            }
            if wanted.contains(&record.partition) && !pending {
                records.push(record);
            }
            ControlFlow::Continue(())
        })?;
        Ok(records)
    }
}

/// A replay under way: what it decides with, the ids it has queued, and its report so far.
struct Replay<'a> {
    store: &'a SledStore,
    request: &'a ReplayRequest,
    rules: &'a dyn Decide,
    now: Millis,
    /// Ids queued so far (each is queued once).
    taken: HashSet<String>,
    report: ReplayReport,
}

impl Replay<'_> {
    /// Pass 2: fold the records' conversations from their first stored event; decide in the window.
    fn fold(&mut self, records: Vec<EventRecord>) -> Result<(), StoreError> {
        let mut states: HashMap<String, ConversationState> = HashMap::new();
        let mut users: HashMap<String, Option<EndUserState>> = HashMap::new();
        for record in records {
            self.event(record, &mut states, &mut users)?;
        }
        Ok(())
    }

    /// Fold one stored event into its conversation's rebuilt state, and report (and queue) what
    /// the rules decide for it if it is in the window.
    fn event(
        &mut self,
        record: EventRecord,
        states: &mut HashMap<String, ConversationState>,
        users: &mut HashMap<String, Option<EndUserState>>,
    ) -> Result<(), StoreError> {
        let Ok(event) = model::webhook::parse_event(record.event.get()) else {
            return Ok(());
        };
        let Some(conversation) = event.payload.conversation_id() else {
            return Ok(());
        };
        let state = states
            .entry(record.partition.clone())
            .or_insert_with(|| ConversationState::new(conversation.clone()));
        // Caps count by receive time, so the rebuilt history caps what the fold capped.
        let time = engine::decide::DecisionTime {
            now: self.now,
            received_at: record.received_at,
        };
        // The end user as stored now: their events are not replayed.
        let named = match &event.payload {
            model::webhook::model::Payload::Conversation(c) => c.end_user_id.clone(),
            _ => None,
        };
        let user = match named.or_else(|| state.end_user_id.clone()) {
            Some(id) => end_user(self.store, users, &id)?,
            None => None,
        };
        // The waiting queue is not rebuilt: rules that read `queue` see none in a replay.
        let decided =
            engine::fold::fold_and_decide(state, &event, self.rules, user, time, &mut |_| {
                Ok::<_, StoreError>(None)
            })?;
        let replayed = self.request.in_window(&record);
        self.report.events += u64::from(replayed);
        if replayed {
            self.report
                .capped
                .extend(decided.capped.into_iter().map(|hit| ReplayCapped {
                    event_id: event.id.as_str().to_owned(),
                    conversation_id: state.id.clone(),
                    rule: hit.rule,
                    fired: hit.fired,
                }));
        }
        for decision in decided.decisions {
            self.decision(state, &event, &record, replayed, decision)?;
        }
        Ok(())
    }

    /// Apply one decision to the rebuilt state; if its event is in the window, report it and
    /// (unless decided before, or a dry run) queue it.
    fn decision(
        &mut self,
        state: &mut ConversationState,
        event: &Event,
        record: &EventRecord,
        replayed: bool,
        decision: Decision,
    ) -> Result<(), StoreError> {
        let now = self.now;
        let original = action_id(&event.id, &decision.rule, decision.index);
        // Timers here only shape the rebuilt state: the timers tree is the fold's alone.
        if engine::decide::apply_to_state(&decision.action, state, now, &original) || !replayed {
            return Ok(());
        }
        let previous = self
            .store
            .actions
            .get(original.as_bytes())?
            .map(|b| decode::<ActionStatus>(&b, "action status"))
            .transpose()?
            .map(|s| s.state);
        let (status, id) = match (&previous, self.request.force) {
            (None, _) => ("new", original),
            (Some(_), false) => ("already_decided", original),
            (Some(_), true) => ("forced", format!("{original}~replay-{now}")),
        };
        // As queued: a message marked with the id it goes under.
        let decision = Decision {
            action: model::action::echo::marked(decision.action, &id),
            ..decision
        };
        let queued =
            status != "already_decided" && !self.request.dry_run && self.taken.insert(id.clone());
        let report = &mut self.report;
        if queued {
            report.queued += 1;
            let seq = self.store.db.generate_id()?;
            let decided_by = (self.rules.version(), record.received_at, now);
            report.entries.push(OutboxEntry::decided(
                seq,
                id.clone(),
                &event.id,
                decision.clone(),
                decided_by,
            ));
        } else if status == "already_decided" {
            report.skipped += 1;
        }
        report.items.push(ReplayItem {
            event_id: event.id.as_str().to_owned(),
            conversation_id: state.id.clone(),
            rule: decision.rule,
            id,
            status,
            previous,
            queued,
            action: decision.action,
        });
        Ok(())
    }
}

/// The end user `id` as stored now, looked up once per replay.
fn end_user<'u>(
    store: &SledStore,
    users: &'u mut HashMap<String, Option<EndUserState>>,
    id: &EndUserId,
) -> Result<Option<&'u EndUserState>, StoreError> {
    if !users.contains_key(id.as_str()) {
        users.insert(id.as_str().to_owned(), store.end_user(id)?);
    }
    Ok(users.get(id.as_str()).and_then(Option::as_ref))
}
