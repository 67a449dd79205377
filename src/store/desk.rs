//! Reads for the agent API's queue.

use super::{decode, Store, StoreError};
use crate::state::ConversationState;

impl Store {
    /// The conversations `keep` selects, at most `limit`. Walks the whole conversations tree: the
    /// queue is read by agents now and then, not per event; an index by phase is future work if
    /// stores grow past what a scan answers quickly.
    pub fn conversations_where(
        &self,
        mut keep: impl FnMut(&ConversationState) -> bool,
        limit: usize,
    ) -> Result<Vec<ConversationState>, StoreError> {
        let mut out = Vec::new();
        for item in self.conversations.iter() {
            let (_, v) = item?;
            let state: ConversationState = decode(&v, "conversation state")?;
            if keep(&state) {
                out.push(state);
                if out.len() >= limit {
                    break;
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actions::Action;
    use crate::ids::DeliveryId;
    use crate::state::desk::{Outcome, Rejection};
    use crate::webhook::agent::{AgentCommand, Command, DeskAgent, Target};
    use crate::webhook::model::Event;

    fn command(store: &Store, id: &str, command: Command) -> crate::store::Applied {
        let cmd = AgentCommand {
            conversation_id: "c1".into(),
            command,
        };
        let event = crate::webhook::agent_event(&cmd, id, "B1", 10).expect("event");
        let accepted = store
            .accept(&DeliveryId::new(id), &[event], 10)
            .expect("accept");
        let batch: Vec<(u64, Event)> = accepted
            .new
            .iter()
            .map(|(seq, _)| {
                let rec = store.event(*seq).expect("read").expect("record");
                let event = crate::webhook::parse_event(rec.event.get()).expect("parse");
                (*seq, event)
            })
            .collect();
        store.apply(&batch).expect("apply")
    }

    fn agent(id: &str) -> Command {
        Command::Accept {
            agent: DeskAgent {
                id: id.into(),
                name: None,
            },
        }
    }

    #[test]
    fn the_fold_judges_agent_commands_in_order_and_decides_their_actions() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path(), 8 << 20).expect("open");

        let early = command(
            &store,
            "r0",
            Command::Release {
                target: Target::default(),
            },
        );
        assert_eq!(
            early.agent_verdicts[0].outcome,
            Outcome::Rejected {
                reason: Rejection::NotWithAgent
            }
        );
        assert!(early.outbox.is_empty(), "a refused command decides nothing");

        let first = command(&store, "a1", agent("alice"));
        assert_eq!(
            first.agent_verdicts[0].outcome,
            Outcome::Applied { changed: true }
        );
        assert_eq!(first.outbox.len(), 1);
        assert_eq!(first.outbox[0].id, "a1/@agent-api/0");
        assert!(matches!(
            first.outbox[0].action,
            Action::SetManual { enabled: true, .. }
        ));

        let again = command(&store, "a2", agent("alice"));
        assert_eq!(
            again.agent_verdicts[0].outcome,
            Outcome::Applied { changed: false }
        );
        assert!(again.outbox.is_empty());
        let other = command(&store, "a3", agent("bob"));
        assert_eq!(
            other.agent_verdicts[0].outcome,
            Outcome::Rejected {
                reason: Rejection::AlreadyAccepted
            }
        );

        let release = command(
            &store,
            "r1",
            Command::Release {
                target: Target {
                    flow_id: Some(9),
                    ..Target::default()
                },
            },
        );
        let actions: Vec<&Action> = release.outbox.iter().map(|e| &e.action).collect();
        assert!(matches!(
            actions.as_slice(),
            [
                Action::SetManual { enabled: false, .. },
                Action::Navigate {
                    flow_id: Some(9),
                    ..
                }
            ]
        ));
        let state = store
            .conversation(&"c1".into())
            .expect("read")
            .expect("state");
        assert!(state.desk.agent.is_none());
        assert_eq!(state.desk.verdicts.len(), 5);
        assert_eq!(state.desk.accepted_by.as_deref(), Some("a1"));
        // The queue read sees it.
        let found = store
            .conversations_where(|s| s.desk.released_at.is_some(), 10)
            .expect("scan");
        assert_eq!(found.len(), 1);
    }
}
