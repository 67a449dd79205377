//! The agent API's queue, from an index the folds keep (in `queue/v1`, beside the waiting queue
//! and the sweeper's index): every conversation by its phase ([`DeskPhase::of`]) under `p` +
//! the phase's byte, and again by bot and phase under `b` + bot + the phase's byte, each in the
//! order the API lists (request time, missing first, then id: [`keys::desk_position`]). A page is
//! a range read (for `all`, a merge of the phases' ranges by position), never a scan of the
//! states; a cursor is the last listed position.
//!
//! Only folds write these keys (`store::derived`: the difference between a conversation's keys
//! before and after the fold, in the fold's journal), so the index always equals the states;
//! a store from before it is indexed once, on open.

use super::{keys, SledStore, StoreError};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use engine::index::Derived;
use engine::state::ConversationState;

/// Longest cursor accepted, in characters (a position of a conversation id far longer than any
/// real one).
pub const MAX_CURSOR_LEN: usize = 4096;

/// A conversation's keys in the phase index: by phase, and by bot and phase when it has a bot.
pub(super) fn desk_keys(s: &ConversationState) -> Vec<Vec<u8>> {
    let entries = engine::index::derived(s).into_iter();
    let desk = entries.filter(|e| matches!(e, Derived::Phase { .. } | Derived::BotPhase { .. }));
    desk.map(|e| crate::derived::key(&e)).collect()
}

/// Where a page of the listing ends: the last listed conversation's position (request time,
/// id). Opaque to callers: base64url of [`keys::desk_position`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeskCursor(pub(crate) Vec<u8>);

/// A cursor that is not one this API gave out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("not a cursor from this listing's `next`")]
pub struct BadCursor;

impl DeskCursor {
    /// The position of `s` in the listing.
    pub fn of(s: &ConversationState) -> Self {
        DeskCursor(keys::desk_position(s.handoff.requested_at, s.id.as_str()))
    }

    /// A cursor at a position in the listing's order (for backends: [`keys::desk_position`]).
    pub fn at(position: Vec<u8>) -> Self {
        DeskCursor(position)
    }

    /// The position this cursor names (for backends).
    pub fn position(&self) -> &[u8] {
        &self.0
    }

    /// The cursor's text (base64url, no padding).
    pub fn encode(&self) -> String {
        URL_SAFE_NO_PAD.encode(&self.0)
    }

    /// A cursor from its text: 1 to [`MAX_CURSOR_LEN`] characters of canonical base64url
    /// without padding (what [`DeskCursor::encode`] makes), else [`BadCursor`]. Whatever bytes
    /// it holds name a point in the listing's order (the listing goes on after it), so every
    /// text of that form is one, as the API's document says.
    pub fn decode(text: &str) -> Result<Self, BadCursor> {
        if text.is_empty() || text.len() > MAX_CURSOR_LEN {
            return Err(BadCursor);
        }
        let bytes = URL_SAFE_NO_PAD.decode(text).map_err(|_| BadCursor)?;
        Ok(DeskCursor(bytes))
    }
}

/// One page of the listing.
#[derive(Debug, Default)]
pub struct DeskPage {
    /// In listing order. A conversation whose phase changed between the index read and its
    /// state read is left out (it is listed where it is now), so a page may be shorter than its
    /// limit without being the last.
    pub conversations: Vec<ConversationState>,
    /// Where the next page starts; `None` on the last page.
    pub next: Option<DeskCursor>,
}

impl SledStore {
    /// A store from before the phase index: index its conversations once, on open.
    pub(super) fn index_desk_once(&self) -> Result<(), StoreError> {
        self.index_once(keys::meta::DESK_INDEXED, "agent API phases", desk_keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode;
    use crate::port::*;
    use crate::queue::tests::{fold, queue_keys};
    use engine::state::desk::DeskPhase;
    use engine::state::desk::{Outcome, Rejection};
    use model::action::Action;
    use model::ids::DeliveryId;
    use model::webhook::agent::{AgentCommand, Command, DeskAgent, Target};
    use model::webhook::model::Event;
    use model::webhook::IncomingEvent;
    use std::collections::HashMap;

    fn command(store: &SledStore, id: &str, command: Command) -> crate::Applied {
        let cmd = AgentCommand {
            conversation_id: "c1".into(),
            command,
        };
        let event = model::webhook::agent_event(&cmd, id, "B1", 10).expect("event");
        let accepted = store
            .accept(&DeliveryId::new(id), &[event], 10)
            .expect("accept");
        let batch: Vec<(u64, Event)> = accepted
            .new
            .iter()
            .map(|(seq, _)| {
                let rec = store.event(*seq).expect("read").expect("record");
                let event = model::webhook::parse_event(rec.event.get()).expect("parse");
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

    /// A conversation event of `bot` (`at` also its time).
    fn event_of(id: &str, kind: &str, conversation: &str, bot: &str, at: i64) -> IncomingEvent {
        let raw = serde_json::json!({
            "id": id, "event": kind, "sourceType": "bot", "sourceId": bot, "timestamp": at,
            "data": { "conversation": { "id": conversation, "botId": bot, "platform": "web" } },
        });
        let raw = serde_json::value::RawValue::from_string(raw.to_string()).expect("raw");
        model::webhook::validate_event(&raw).expect("event")
    }

    fn agent_command(
        id: &str,
        conversation: &str,
        bot: &str,
        at: i64,
        accept: bool,
    ) -> IncomingEvent {
        let command = match accept {
            true => agent("alice"),
            false => Command::Release {
                target: Target::default(),
            },
        };
        let cmd = AgentCommand {
            conversation_id: conversation.into(),
            command,
        };
        model::webhook::agent_event(&cmd, id, bot, at).expect("event")
    }

    /// Every phase index key, scanned (sorted).
    fn index(store: &SledStore) -> Vec<Vec<u8>> {
        queue_keys(store, &[keys::DESK_PHASE, keys::DESK_BOT])
    }

    /// Every state, scanned.
    fn states(store: &SledStore) -> Vec<ConversationState> {
        store
            .conversations
            .iter()
            .map(|item| decode(&item.expect("read").1, "state").expect("decode"))
            .collect()
    }

    /// What a scan of the states says the index holds.
    fn scanned(store: &SledStore) -> Vec<Vec<u8>> {
        let mut keys: Vec<Vec<u8>> = states(store).iter().flat_map(desk_keys).collect();
        keys.sort();
        keys
    }

    /// Random conversation events and agent commands over `conversations` conversations of two
    /// bots, with times that go back and forth, folded in batches of 1 to 20.
    fn random_history(store: &SledStore, seed: u64, events: usize, conversations: usize) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let kinds = [
            "bot.conversation.agent_call_requested",
            "bot.conversation.agent_call_connected",
            "bot.conversation.agent_call_cancelled",
            "bot.conversation.agent_call_disconnected",
            "bot.conversation.updated",
        ];
        let mut n = 0;
        let mut batch = 0;
        while n < events {
            let size = rng.random_range(1..=20).min(events - n);
            let batch_events = (0..size)
                .map(|_| {
                    n += 1;
                    let c = rng.random_range(0..conversations);
                    let (conversation, bot) = (format!("c{c}"), format!("B{}", c % 2));
                    let at = rng.random_range(-50..2_000);
                    let id = format!("e{seed}-{n}");
                    // Requests most often, so some conversations wait at the end.
                    match rng.random_range(0..12) {
                        k @ 0..=4 => event_of(&id, kinds[k], &conversation, &bot, at),
                        5..=8 => event_of(&id, kinds[0], &conversation, &bot, at),
                        k => agent_command(&id, &conversation, &bot, at, k < 11),
                    }
                })
                .collect();
            fold(store, &format!("d{seed}-{batch}"), batch_events);
            batch += 1;
        }
    }

    /// The listing a scan of the states gives: `phase` (all when `None`) and `bot`, in order.
    fn listing(store: &SledStore, phase: Option<DeskPhase>, bot: Option<&str>) -> Vec<String> {
        let mut found: Vec<ConversationState> = states(store)
            .into_iter()
            .filter(|s| phase.is_none_or(|p| DeskPhase::of(s) == p))
            .filter(|s| bot.is_none_or(|b| s.bot_id.as_ref().map(|i| i.as_str()) == Some(b)))
            .collect();
        found.sort_by(|a, b| {
            (a.handoff.requested_at, a.id.as_str()).cmp(&(b.handoff.requested_at, b.id.as_str()))
        });
        found.iter().map(|s| s.id.as_str().to_owned()).collect()
    }

    /// Every page of a listing, `limit` at a time, through the cursors' text.
    fn paged(
        store: &SledStore,
        phase: Option<DeskPhase>,
        bot: Option<&str>,
        limit: usize,
    ) -> Vec<String> {
        let mut out = Vec::new();
        let mut after: Option<DeskCursor> = None;
        for _ in 0..1_000 {
            let page = store
                .desk_page(phase, bot, after.as_ref(), limit)
                .expect("page");
            assert!(page.conversations.len() <= limit);
            out.extend(page.conversations.iter().map(|s| s.id.as_str().to_owned()));
            match page.next {
                Some(next) => {
                    assert_eq!(
                        page.conversations.len(),
                        limit,
                        "only the last page is short"
                    );
                    after = Some(DeskCursor::decode(&next.encode()).expect("round trip"));
                }
                None => return out,
            }
        }
        panic!("paging did not end");
    }

    #[test]
    fn the_index_equals_a_scan_of_the_states_after_random_folds() {
        for seed in 0..6 {
            let dir = tempfile::tempdir().expect("tempdir");
            let store = SledStore::open(dir.path(), 8 << 20).expect("open");
            for round in 0..4 {
                random_history(&store, seed * 10 + round, 60, 12);
                assert_eq!(index(&store), scanned(&store), "seed {seed} round {round}");
            }
            // The sweeper's keys, kept by the same mechanism, still equal the states too.
            let watched = queue_keys(&store, &[keys::WATCH_ACTIVE, keys::WATCH_RELEASED]);
            let mut expected: Vec<Vec<u8>> = states(&store)
                .iter()
                .filter_map(crate::watch::watch_key)
                .collect();
            expected.sort();
            assert_eq!(watched, expected, "seed {seed}");
        }
    }

    #[test]
    fn pages_walk_every_entry_once_in_order_and_positions_are_the_queue_ranks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(dir.path(), 8 << 20).expect("open");
        random_history(&store, 99, 400, 40);
        let mut phases: Vec<Option<DeskPhase>> = DeskPhase::ALL.iter().copied().map(Some).collect();
        phases.push(None);
        let mut seen_phases = std::collections::HashSet::new();
        for phase in phases {
            for bot in [None, Some("B0"), Some("B1"), Some("B9")] {
                let expected = listing(&store, phase, bot);
                if !expected.is_empty() {
                    seen_phases.insert(phase);
                }
                for limit in [1, 3, 7, 1000] {
                    assert_eq!(
                        paged(&store, phase, bot, limit),
                        expected,
                        "{phase:?} {bot:?} limit {limit}"
                    );
                }
            }
        }
        assert!(
            seen_phases.len() >= 4,
            "the history reaches several phases: {seen_phases:?}"
        );
        assert_eq!(listing(&store, None, None).len(), 40);
        // Positions: each waiting conversation's rank in its bot's queue, whatever the page.
        let waiting = store
            .desk_page(Some(DeskPhase::Requested), None, None, 1000)
            .expect("page")
            .conversations;
        assert!(!waiting.is_empty(), "some conversations wait");
        let mut ranks = HashMap::new();
        for bot in ["B0", "B1"] {
            for (i, id) in store.waiting_for(bot).expect("queue").iter().enumerate() {
                ranks.insert(id.as_str().to_owned(), i + 1);
            }
        }
        assert_eq!(
            ranks.len(),
            waiting.len(),
            "the requested phase is the waiting queue"
        );
        assert_eq!(store.waiting_positions(&waiting).expect("positions"), ranks);
        for chunk in waiting.chunks(3) {
            for (id, at) in store.waiting_positions(chunk).expect("positions") {
                assert_eq!(ranks.get(&id), Some(&at), "{id}");
            }
        }
        let mut reversed = waiting.clone();
        reversed.reverse();
        assert_eq!(
            store.waiting_positions(&reversed).expect("positions"),
            ranks
        );
        // A cursor past the end gives an empty last page.
        let last = waiting.last().expect("one");
        let page = store
            .desk_page(
                Some(DeskPhase::Requested),
                None,
                Some(&DeskCursor::of(last)),
                5,
            )
            .expect("page");
        assert!(page.conversations.is_empty() && page.next.is_none());
    }

    #[test]
    fn a_store_from_before_the_index_gets_it_on_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let expected = {
            let store = SledStore::open(dir.path(), 8 << 20).expect("open");
            random_history(&store, 7, 80, 15);
            let expected = scanned(&store);
            assert!(!expected.is_empty());
            for key in index(&store) {
                store.queue.remove(key).expect("remove");
            }
            store.meta.remove(keys::meta::DESK_INDEXED).expect("unmark");
            store.db.flush().expect("flush");
            assert!(store
                .desk_page(None, None, None, 100)
                .expect("page")
                .conversations
                .is_empty());
            expected
        };
        let store = SledStore::open(dir.path(), 8 << 20).expect("reopen");
        assert_eq!(index(&store), expected);
        assert_eq!(paged(&store, None, None, 4), listing(&store, None, None));
    }

    #[test]
    fn cursors_are_canonical_base64url_and_round_trip() {
        let mut s = ConversationState::new("c:1".into());
        s.handoff.requested_at = Some(-3);
        let cursor = DeskCursor::of(&s);
        assert_eq!(DeskCursor::decode(&cursor.encode()), Ok(cursor));
        for bad in [
            "",
            "!!",
            "AAAA=",
            "A",
            "AB",
            "ABC",
            "a+b/",
            &"A".repeat(MAX_CURSOR_LEN + 4),
        ] {
            assert_eq!(DeskCursor::decode(bad), Err(BadCursor), "{bad:?}");
        }
        // Any other canonical base64url is a point in the order: the listing goes on after it.
        for good in ["AA", "AAA", "AAAA", "_-8", &"A".repeat(MAX_CURSOR_LEN)] {
            assert!(DeskCursor::decode(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn the_fold_judges_agent_commands_in_order_and_decides_their_actions() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(dir.path(), 8 << 20).expect("open");

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
        // The phase index sees it released.
        let page = store
            .desk_page(Some(DeskPhase::Released), None, None, 10)
            .expect("page");
        assert_eq!(page.conversations.len(), 1);
        assert_eq!(page.conversations[0].id.as_str(), "c1");
    }
}
