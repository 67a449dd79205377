//! Folding one event and deciding for it: the one step the live fold ([`crate::batch`]), a
//! replay and the audit ([`crate::replay`]) share. The caller reads what it needs (the end user,
//! the waiting queue) and writes what comes out; this only changes the state it is handed and
//! returns what was decided.

use crate::decide::{Decided, Inputs};
use crate::state::queue::Standing;
use crate::state::{ConversationState, EndUserState};
use model::ids::EndUserId;
use model::webhook::model::{Event, Payload};

/// The end user whom the rules see for `event` of the conversation in `state`: the one a
/// conversation event names, else the conversation's own.
pub fn end_user_named<'a>(state: &'a ConversationState, event: &'a Event) -> Option<&'a EndUserId> {
    let named = match &event.payload {
        Payload::Conversation(c) => c.end_user_id.as_ref(),
        _ => None,
    };
    named.or(state.end_user_id.as_ref())
}

/// Fold `event` into its conversation's state, decide for it with the state after (and the state
/// before, which `changed` conditions compare: the fold keeps a copy, so deciding stays pure), and
/// record in the state which rules fired and which their caps held back (so the fold and a replay
/// keep the same firing history). A stale timer firing (its timer was cancelled or restarted
/// since) is folded but decides nothing. An agent command decides its own actions first (rule
/// [`BUILTIN_RULE`](crate::state::desk::BUILTIN_RULE)), then the rules see it; one the state
/// refused decides nothing. `after_fold` sees the state right after the event is folded, before
/// rules decide (the fold keeps the waiting queue there), and returns the conversation's standing
/// in it when the rules read it; it sees the state once more when what the rules decided handed
/// the waiting user back to the bot (manual mode turned off for the request, after hours), so
/// the conversation leaves the queue at the deciding event (`queue::hand_back`). The live fold, a replay and the audit all call it, so they fold
/// and decide alike. `None`: the event decides nothing (a stale timer firing, a message the other
/// path brought first).
pub fn fold_and_decide<E>(
    state: &mut ConversationState,
    event: &Event,
    rules: &dyn crate::decide::Decide,
    end_user: Option<&EndUserState>,
    time: crate::decide::DecisionTime,
    after_fold: &mut dyn FnMut(&ConversationState) -> Result<Option<Standing>, E>,
) -> Result<Option<Decided>, E> {
    let before = rules.needs().before.then(|| state.clone());
    let decides = state.apply(event);
    let queue = after_fold(state)?;
    if decides {
        let inputs = Inputs {
            before: before.as_ref(),
            end_user,
            queue: queue.as_ref(),
        };
        let mut decided = rules.evaluate(event, state, inputs, time);
        decided.record(state, &event.id, time.received_at);
        if let Payload::Agent(cmd) = &event.payload {
            let builtin = crate::state::desk::builtin_actions(event, cmd, state);
            let own =
                builtin
                    .into_iter()
                    .enumerate()
                    .map(|(index, action)| model::action::Decision {
                        rule: crate::state::desk::BUILTIN_RULE.to_owned(),
                        index,
                        action,
                    });
            decided.decisions.splice(0..0, own);
        }
        // What the bridge asked of manual mode is what it believes of it (until the service says
        // otherwise): the reconciliation sweeper compares that with the service.
        state.note_decided(event, decided.decisions.iter().map(|d| &d.action));
        let waited = crate::state::queue::waiting_since(state).is_some();
        crate::state::queue::hand_back(state, event, true);
        if waited && crate::state::queue::waiting_since(state).is_none() {
            after_fold(state)?;
        }
        Ok(Some(decided))
    } else {
        // A stale timer firing, or a message already folded: no rules.
        Ok(None)
    }
}
