//! Conversations rebuilt from their stored events ([`Rebuilt`], the step a replay and the audit
//! share with the live fold: [`crate::fold::fold_and_decide`]), and replay: stored events re-run
//! through the current rules ([`replay`]).
//!
//! The state an event is decided against is rebuilt by folding its conversation's stored events
//! from the start, in acceptance order (the order the folds folded them in), applying the rules'
//! own state changes (labels, variables, timers) on the way. Those shape only the rebuilt states:
//! a replay never writes state, nor schedules or cancels a real timer. Stored timer events are
//! decided again when the rebuilt state still has the run that fired. Events older than the event
//! retention are gone, so a conversation's earliest state may be thinner than it was.
//!
//! Rules' firing caps count by the events' receive times, so the rebuilt firing history holds back
//! the same rules for the same events as the fold did (with the same rules).
//!
//! An action that was decided before (its id is in the ledger) is reported and not queued again,
//! unless forced: a forced action gets a new id, and with it a new idempotency key, because the
//! upstream would otherwise answer the old call's result without acting.

use crate::batch::FoldReads;
use crate::decide::{apply_to_state, Decide, Decided, DecisionTime};
use crate::state::{ConversationState, EndUserState};
use model::action::{action_id, Action, Decision, OutboxEntry};
use model::ids::{ConversationId, EndUserId};
use model::webhook::model::{Event, Millis};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};

/// A conversation's state rebuilt from its stored events, as the fold built it.
pub struct Rebuilt {
    pub state: ConversationState,
}

impl Rebuilt {
    pub fn new(id: ConversationId) -> Self {
        Rebuilt {
            state: ConversationState::new(id),
        }
    }

    /// Fold a stored event and decide for it with `rules` at `time`, as the fold did, with
    /// `end_user` (the one [`crate::fold::end_user_named`] names) and no waiting queue (it is not
    /// rebuilt: rules that read `queue` see none). The internal actions decided (labels,
    /// variables, timers) shape the state for the next events, at `time.now`; every decision is
    /// returned. `folded` sees the state right after the event is folded in, before the rules
    /// decide. `None`: the event decides nothing (a stale timer firing, a message already
    /// folded).
    pub fn step(
        &mut self,
        event: &Event,
        rules: &dyn Decide,
        end_user: Option<&EndUserState>,
        time: DecisionTime,
        folded: &mut dyn FnMut(&ConversationState),
    ) -> Option<Decided> {
        let mut after_fold = |state: &ConversationState| {
            folded(state);
            Ok::<_, std::convert::Infallible>(None)
        };
        let state = &mut self.state;
        let decided = match crate::fold::fold_and_decide(
            state,
            event,
            rules,
            end_user,
            time,
            &mut after_fold,
        ) {
            Ok(decided) => decided?,
            Err(never) => match never {},
        };
        for decision in &decided.decisions {
            let id = action_id(&event.id, &decision.rule, decision.index);
            apply_to_state(&decision.action, state, time.now, &id);
        }
        Some(decided)
    }
}

/// End users as stored now, each read once (a rebuild does not replay their events).
#[derive(Default)]
pub struct EndUsers(HashMap<String, Option<EndUserState>>);

impl EndUsers {
    /// The end user the rules see for `event` of the conversation in `state`.
    pub fn of<E>(
        &mut self,
        state: &ConversationState,
        event: &Event,
        read: impl FnOnce(&EndUserId) -> Result<Option<EndUserState>, E>,
    ) -> Result<Option<&EndUserState>, E> {
        let Some(id) = crate::fold::end_user_named(state, event) else {
            return Ok(None);
        };
        if !self.0.contains_key(id.as_str()) {
            let user = read(id)?;
            self.0.insert(id.as_str().to_owned(), user);
        }
        Ok(self.0.get(id.as_str()).and_then(Option::as_ref))
    }
}

/// Which events, and what to do with their actions.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
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

impl ReplayRequest {
    /// Whether an event received at `received_at` is inside the window.
    pub fn in_window(&self, received_at: Millis) -> bool {
        received_at >= self.from && received_at < self.to
    }
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
    /// Queued entries, for the executor (not part of the printed report); numbered by the store
    /// as it commits them.
    #[serde(skip)]
    pub entries: Vec<OutboxEntry>,
}

/// A stored event to replay: its partition (the rebuilt state's key), when it was received, the
/// event.
pub struct Replayed {
    pub partition: String,
    pub received_at: Millis,
    pub event: Event,
}

/// Re-run `events` (the folded events of the conversations with an event in the request's window,
/// from each one's first stored event up to the window's end, in acceptance order) through
/// `rules`, deciding at `now`; report what the window's events decide and, unless `dry_run`,
/// queue what is new (or forced) in [`ReplayReport::entries`] for the store to commit.
pub fn replay<R: FoldReads + ?Sized>(
    reads: &mut R,
    (request, rules, now): (&ReplayRequest, &dyn Decide, Millis),
    events: impl IntoIterator<Item = Replayed>,
) -> Result<ReplayReport, R::Error> {
    let mut replay = Replay {
        request,
        rules,
        now,
        taken: HashSet::new(),
        report: ReplayReport {
            rules_version: rules.version().to_owned(),
            ..ReplayReport::default()
        },
    };
    let mut states: HashMap<String, Rebuilt> = HashMap::new();
    let mut users = EndUsers::default();
    for stored in events {
        let Some(conversation) = stored.event.payload.conversation_id() else {
            continue;
        };
        let rebuilt = states
            .entry(stored.partition.clone())
            .or_insert_with(|| Rebuilt::new(conversation.clone()));
        replay.event(reads, rebuilt, &mut users, &stored)?;
    }
    Ok(replay.report)
}

/// A replay under way: what it decides with, the ids it has queued, and its report so far.
struct Replay<'a> {
    request: &'a ReplayRequest,
    rules: &'a dyn Decide,
    now: Millis,
    /// Ids queued so far (each is queued once).
    taken: HashSet<String>,
    report: ReplayReport,
}

impl Replay<'_> {
    /// Fold one stored event into its conversation's rebuilt state, and report (and queue) what
    /// the rules decide for it if it is in the window.
    fn event<R: FoldReads + ?Sized>(
        &mut self,
        reads: &mut R,
        rebuilt: &mut Rebuilt,
        users: &mut EndUsers,
        stored: &Replayed,
    ) -> Result<(), R::Error> {
        let event = &stored.event;
        // Caps count by receive time, so the rebuilt history caps what the fold capped.
        let time = DecisionTime {
            now: self.now,
            received_at: stored.received_at,
        };
        let user = users.of(&rebuilt.state, event, |id| reads.end_user(id))?;
        let decided = rebuilt
            .step(event, self.rules, user, time, &mut |_| {})
            .unwrap_or_default();
        let replayed = self.request.in_window(stored.received_at);
        if !replayed {
            return Ok(());
        }
        self.report.events += 1;
        let conversation = &rebuilt.state.id;
        self.report
            .capped
            .extend(decided.capped.into_iter().map(|hit| ReplayCapped {
                event_id: event.id.as_str().to_owned(),
                conversation_id: conversation.clone(),
                rule: hit.rule,
                fired: hit.fired,
            }));
        for decision in decided.decisions {
            if !crate::decide::is_internal(&decision.action) {
                self.decision(reads, conversation, (event, stored.received_at), decision)?;
            }
        }
        Ok(())
    }

    /// Report one decision of an event in the window and (unless decided before, or a dry run)
    /// queue it.
    fn decision<R: FoldReads + ?Sized>(
        &mut self,
        reads: &mut R,
        conversation: &ConversationId,
        (event, received_at): (&Event, Millis),
        decision: Decision,
    ) -> Result<(), R::Error> {
        let now = self.now;
        let original = action_id(&event.id, &decision.rule, decision.index);
        let previous = reads.ledger_state(&original)?;
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
            let decided_by = (self.rules.version(), received_at, now);
            report.entries.push(OutboxEntry::decided(
                0,
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
            conversation_id: conversation.clone(),
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
