use super::*;
use model::webhook::parse_event;
use proptest::prelude::*;

fn conv_event(
    id: &str,
    kind: &str,
    at: i64,
    params: &str,
    flow: i64,
    manual: Option<&str>,
) -> Event {
    let manual = manual.map_or(String::new(), |m| {
        format!(r#","manual":{{"status":"{m}"}}"#)
    });
    let raw = format!(
        r#"{{"id":"{id}","event":"{kind}","sourceType":"bot","sourceId":"B1","timestamp":{at},
        "data":{{"conversation":{{"id":"c1","botId":"B1","endUserId":"u1","platform":"web","userKey":"k1",
        "params":{params},"context":{{"platform":"web"{manual}}},"navigation":{{"current":{{"flowId":{flow},"nodeId":1}}}}}}}}}}"#
    );
    parse_event(&raw).expect("conversation event")
}

fn msg_event(id: &str, kind: &str, at: i64, is_user: bool, meta: &str) -> Event {
    let raw = format!(
        r#"{{"id":"{id}","event":"{kind}","sourceType":"bot","sourceId":"B1","timestamp":{at},
        "data":{{"message":{{"id":"m-{id}","endUserId":"u1","conversationId":"c1","isUser":{is_user},"meta":{meta},
        "data":{{"type":"text","text":"hi"}}}}}}}}"#
    );
    parse_event(&raw).expect("message event")
}

fn fold(events: &[Event]) -> ConversationState {
    let mut state = ConversationState::new("c1".into());
    for e in events {
        state.apply(e);
    }
    state
}

fn lifecycle() -> Vec<Event> {
    vec![
        conv_event("e1", "bot.conversation.created", 100, "{}", 1, None),
        conv_event("e2", "bot.conversation.updated", 110, r#"{"a":1}"#, 3, None),
        msg_event("e3", "bot.message.received", 120, true, "null"),
        conv_event(
            "e4",
            "bot.conversation.agent_call_requested",
            130,
            r#"{"a":2}"#,
            5,
            None,
        ),
        msg_event("e5", "bot.message.sent", 131, false, "null"),
        conv_event(
            "e6",
            "bot.conversation.agent_call_connected",
            140,
            r#"{"a":2}"#,
            5,
            Some("HANDOVER"),
        ),
        msg_event(
            "e7",
            "bot.message.sent",
            150,
            false,
            r#"{"sender":{"userKey":"agent-1","platform":"closer-chat"}}"#,
        ),
        msg_event(
            "e8",
            "bot.message.sent",
            151,
            false,
            r#"{"persona":{"name":"x"}}"#,
        ),
        conv_event(
            "e9",
            "bot.conversation.agent_call_disconnected",
            160,
            r#"{"a":3}"#,
            5,
            None,
        ),
    ]
}

#[test]
fn the_lifecycle_folds_into_the_expected_state() {
    let s = fold(&lifecycle());
    assert_eq!(s.events_applied, 9);
    assert_eq!(s.handoff.phase.value, HandoffPhase::Ended);
    assert_eq!(s.handoff.phase.stamp.at, 160);
    assert_eq!(s.handoff.requested_at, Some(130));
    assert_eq!(s.handoff.connected_at, Some(140));
    assert_eq!(s.handoff.ended_at, Some(160));
    assert_eq!(
        s.handoff
            .agent
            .value
            .as_ref()
            .and_then(|a| a.user_key.as_deref()),
        Some("agent-1")
    );
    assert_eq!(s.manual_status.value.as_deref(), Some("HANDOVER"));
    assert_eq!(
        (
            s.messages.user_messages,
            s.messages.bot_messages,
            s.messages.agent_messages
        ),
        (1, 1, 2)
    );
    assert_eq!(s.messages.last_agent_message_at, Some(151));
    assert_eq!(s.params.value.get("a"), Some(&serde_json::json!(3)));
    assert_eq!(s.navigation.value.current.map(|n| n.flow_id), Some(5));
    assert_eq!(s.created_at, Some(100));
    assert_eq!((s.first_event_at, s.last_event_at), (100, 160));
    assert_eq!(s.end_user_id.as_ref().map(|u| u.as_str()), Some("u1"));
}

#[test]
fn an_older_event_arriving_late_does_not_roll_state_back() {
    let mut events = lifecycle();
    events.push(conv_event(
        "e0",
        "bot.conversation.updated",
        50,
        r#"{"a":"old"}"#,
        1,
        Some("OLD"),
    ));
    let s = fold(&events);
    assert_eq!(s.params.value.get("a"), Some(&serde_json::json!(3)));
    assert_eq!(s.navigation.value.current.map(|n| n.flow_id), Some(5));
    assert_eq!(s.manual_status.value.as_deref(), Some("HANDOVER"));
    assert_eq!(s.handoff.phase.value, HandoffPhase::Ended);
    assert_eq!(s.first_event_at, 50);
}

#[test]
fn equal_timestamps_are_ordered_by_event_id() {
    let a = conv_event("a", "bot.conversation.updated", 10, r#"{"v":"a"}"#, 1, None);
    let b = conv_event("b", "bot.conversation.updated", 10, r#"{"v":"b"}"#, 2, None);
    let ab = fold(&[a.clone(), b.clone()]);
    let ba = fold(&[b, a]);
    assert_eq!(ab, ba);
    assert_eq!(ab.params.value.get("v"), Some(&serde_json::json!("b")));
}

#[test]
fn end_user_state_tracks_the_newest_conversation() {
    let mut u = EndUserState::new("u1".into());
    let newer = conv_event("n", "bot.conversation.created", 200, "{}", 1, None);
    let older = conv_event("o", "bot.conversation.updated", 100, "{}", 1, None);
    let (Payload::Conversation(cn), Payload::Conversation(co)) = (&newer.payload, &older.payload)
    else {
        panic!("conversation payloads")
    };
    let mut co = co.clone();
    co.id = "c0".into();
    u.observe_conversation(&newer, cn);
    u.observe_conversation(&older, &co);
    assert_eq!(
        u.last_conversation_id.value.as_ref().map(|c| c.as_str()),
        Some("c1")
    );
    assert_eq!(u.platform, Some(Platform::Web));
    assert_eq!(
        u.events_applied, 0,
        "observing a conversation is not an end-user event"
    );
}

#[test]
fn bot_state_counts_unknown_events_and_records_deletion() {
    let mut b = BotState::new("B1".into());
    let deleted = parse_event(r#"{"id":"d","event":"bot.deleted","sourceType":"bot","sourceId":"B1","timestamp":5,"data":{"bot":{"id":"B1","title":"t"}}}"#).expect("bot event");
    let unknown = parse_event(r#"{"id":"x","event":"bot.brand_new","sourceType":"bot","sourceId":"B1","timestamp":6,"data":{}}"#).expect("unknown event");
    b.apply(&deleted);
    b.apply(&unknown);
    assert_eq!(b.deleted_at, Some(5));
    assert_eq!(b.unknown_events, 1);
    assert_eq!(b.events_applied, 2);
    assert_eq!(
        b.info.value.as_ref().and_then(|i| i.title.as_deref()),
        Some("t")
    );
}

fn timer_event(name: &str, due_at: i64, started_by: &str) -> Event {
    let firing = TimerFiring {
        conversation_id: "c1".into(),
        name: name.into(),
        due_at,
        started_by: started_by.into(),
    };
    let made = model::webhook::timer_event(&firing, "B1").expect("timer event");
    made.event
}

fn run(due_at: i64, started_by: &str) -> Timer {
    Timer {
        due_at,
        started_at: due_at - 10,
        started_by: started_by.into(),
    }
}

#[test]
fn a_timer_firing_stops_its_own_run_and_a_stale_one_changes_nothing() {
    let mut state = fold(&lifecycle());
    let applied = state.events_applied;
    state.start_timer("wait", run(500, "e3/ask/0"));
    state.start_timer("other", run(900, "e3/ask/1"));
    assert!(state.apply(&timer_event("wait", 500, "e3/ask/0")), "live");
    assert!(
        !state.timers.contains_key("wait"),
        "fired: no longer running"
    );
    assert!(state.timers.contains_key("other"), "other timers run on");
    assert_eq!(state.events_applied, applied + 1, "a firing is an event");

    // Restarted after this run fired: the old run's firing is stale, the new run stays.
    state.start_timer("wait", run(600, "e7/ask/0"));
    state.start_timer("wait", run(700, "e8/ask/0"));
    assert!(!state.apply(&timer_event("wait", 600, "e7/ask/0")), "stale");
    assert_eq!(state.timers.get("wait"), Some(&run(700, "e8/ask/0")));

    // Cancelled: its firing is stale too.
    state.cancel_timer("wait");
    assert!(
        !state.apply(&timer_event("wait", 700, "e8/ask/0")),
        "cancelled"
    );
    assert!(!state.timers.contains_key("wait"));
    // A replay rebuilds due times with its own clock: the run is known by what started it.
    assert!(state.apply(&timer_event("other", 1_234, "e3/ask/1")));
    assert!(state.timers.is_empty());
}

#[test]
fn a_state_stored_before_timers_existed_still_decodes() {
    let mut value = serde_json::to_value(fold(&lifecycle())).expect("json");
    let removed = value.as_object_mut().and_then(|m| m.remove("timers"));
    assert!(removed.is_some(), "the field is stored today");
    let old: ConversationState = serde_json::from_value(value).expect("decodes");
    assert!(old.timers.is_empty());
}

#[test]
fn a_state_stored_before_firing_caps_existed_still_decodes() {
    let mut state = fold(&lifecycle());
    let cap = FiringCap {
        count: 2,
        per: std::time::Duration::from_secs(60),
    };
    state.record_firing("greet", cap, 1_000);
    state.record_cap_hit("greet", cap, "e9", 2, 1_500);
    let mut value = serde_json::to_value(&state).expect("json");
    assert_eq!(
        value["firings"]["greet"]["per"], "1m",
        "readable in `state show`"
    );
    assert_eq!(value["capped"]["greet"]["cap"]["count"], 2);
    for field in ["firings", "capped"] {
        let removed = value.as_object_mut().and_then(|m| m.remove(field));
        assert!(removed.is_some(), "{field} is stored today");
    }
    let old: ConversationState = serde_json::from_value(value).expect("decodes");
    assert!(old.firings.is_empty() && old.capped.is_empty());
}

#[test]
fn the_firing_history_keeps_only_the_window_and_at_most_count_per_rule() {
    let mut state = ConversationState::new("c1".into());
    let cap = |count, secs| FiringCap {
        count,
        per: std::time::Duration::from_secs(secs),
    };
    // `short` fires once; `long` more often than its count.
    state.record_firing("short", cap(5, 10), 1_000);
    for at in [2_000, 3_000, 4_000, 5_000] {
        state.record_firing("long", cap(3, 3_600), at);
    }
    assert_eq!(
        state.firings["long"].at,
        [3_000, 4_000, 5_000],
        "newest `count`"
    );
    assert_eq!(state.firings_within("long", cap(3, 3_600).per, 5_000), 3);
    assert_eq!(
        state.firings_within("long", std::time::Duration::from_millis(1_500), 5_000),
        2,
        "within the window that ends at the clock: (3.5 s, 5 s]"
    );
    assert_eq!(state.firings_within("short", cap(5, 10).per, 5_000), 1);
    // 10 s after its firing, `short` leaves the state when any rule fires next.
    assert_eq!(state.firings_within("short", cap(5, 10).per, 11_000), 0);
    state.record_firing("long", cap(3, 3_600), 11_000);
    assert!(!state.firings.contains_key("short"), "{:?}", state.firings);
    // A firing stamped after the clock (a clock set back) still counts.
    assert_eq!(state.firings_within("long", cap(3, 3_600).per, 10_000), 3);
    // Out-of-order stamps stay sorted, so the oldest go first.
    state.record_firing("long", cap(3, 3_600), 4_500);
    assert_eq!(state.firings["long"].at, [4_500, 5_000, 11_000]);
}

/// The backfilled copy of a lifecycle message event: same message, same time, another event id.
fn backfilled(event: &Event) -> Option<Event> {
    let Payload::Message(m) = &event.payload else {
        return None;
    };
    let made = model::webhook::backfill_message_event(m, "B1", event.timestamp).expect("backfill");
    let mut copy = made.event;
    copy.timestamp = event.timestamp;
    Some(copy)
}

/// The lifecycle with a backfilled copy of each message after it.
fn lifecycle_with_copies() -> Vec<Event> {
    lifecycle()
        .into_iter()
        .flat_map(|e| {
            let copy = backfilled(&e);
            std::iter::once(e).chain(copy)
        })
        .collect()
}

#[test]
fn a_message_is_folded_once_whether_the_webhook_or_backfill_brings_it_first() {
    let webhook = msg_event("e3", "bot.message.received", 120, true, "null");
    let copy = backfilled(&webhook).expect("a message");
    assert!(model::webhook::is_backfilled(&copy));
    assert_ne!(copy.id, webhook.id, "another event id");
    for (first, second) in [(&webhook, &copy), (&copy, &webhook)] {
        let mut state = ConversationState::new("c1".into());
        assert!(state.apply(first), "the first copy reaches rules");
        assert!(state.knows_message("m-e3"));
        let before = state.clone();
        assert!(!state.apply(second), "the second copy reaches no rule");
        assert_eq!(state.events_applied, 1);
        assert_eq!(state.messages.user_messages, 1);
        assert_eq!(state.messages.recent_user_at, vec![120]);
        assert_eq!(state.messages.recent_ids, before.messages.recent_ids);
    }
    let one = fold(&[webhook.clone(), copy.clone()]);
    let other = fold(&[copy, webhook]);
    assert_eq!(one, other, "the same state in both orders");
}

#[test]
fn message_ids_are_kept_newest_first_and_bounded() {
    let mut state = ConversationState::new("c1".into());
    let total = crate::state::RECENT_MESSAGE_IDS as i64 + 5;
    for i in (0..total).rev() {
        state.apply(&msg_event(
            &format!("x{i}"),
            "bot.message.received",
            i,
            true,
            "null",
        ));
    }
    let ids = &state.messages.recent_ids;
    assert_eq!(ids.len(), crate::state::RECENT_MESSAGE_IDS);
    assert_eq!(ids[0].id, format!("m-x{}", total - 1), "the newest first");
    assert!(ids.windows(2).all(|w| w[0] > w[1]));
    assert!(!state.knows_message("m-x0"), "the oldest dropped out");
    assert!(state.knows_message(&format!("m-x{}", total - 1)));
    // A message two days newer: the ids beyond the horizon go too.
    let later = total + crate::state::RECENT_MESSAGE_HORIZON_MS;
    state.apply(&msg_event(
        "late",
        "bot.message.received",
        later,
        true,
        "null",
    ));
    assert_eq!(
        state.messages.recent_ids.len(),
        1,
        "{:?}",
        state.messages.recent_ids
    );
    assert!(state.knows_message("m-late"));
}

proptest! {
    /// Webhook and backfilled copies of the same messages, in any order, fold into one state, and
    /// each message counts once.
    #[test]
    fn copies_from_both_paths_fold_once_in_any_order(
        order in Just((0..lifecycle_with_copies().len()).collect::<Vec<_>>()).prop_shuffle(),
    ) {
        let events = lifecycle_with_copies();
        let shuffled: Vec<Event> = order.iter().map(|&i| events[i].clone()).collect();
        let state = fold(&shuffled);
        prop_assert_eq!(&state, &fold(&events));
        let plain = fold(&lifecycle());
        prop_assert_eq!(state.events_applied, plain.events_applied);
        prop_assert_eq!(&state.messages.recent_ids, &plain.messages.recent_ids);
        prop_assert_eq!(
            (state.messages.user_messages, state.messages.bot_messages, state.messages.agent_messages),
            (plain.messages.user_messages, plain.messages.bot_messages, plain.messages.agent_messages)
        );
    }

    /// The backfilled copy carries the message's own time, which may differ from the webhook
    /// event's: still one state whichever copy comes first.
    #[test]
    fn copies_with_other_times_fold_once_in_any_order(
        shifts in proptest::collection::vec(-30i64..30, 9),
        order in Just((0..lifecycle_with_copies().len()).collect::<Vec<_>>()).prop_shuffle(),
    ) {
        let mut shifts = shifts.into_iter().cycle();
        let events: Vec<Event> = lifecycle()
            .into_iter()
            .flat_map(|e| {
                let copy = backfilled(&e).map(|mut c| {
                    c.timestamp += shifts.next().unwrap_or(0);
                    c
                });
                std::iter::once(e).chain(copy)
            })
            .collect();
        let shuffled: Vec<Event> = order.iter().map(|&i| events[i].clone()).collect();
        prop_assert_eq!(fold(&shuffled), fold(&events));
    }

    /// Any arrival order of the same events gives the same state.
    #[test]
    fn fold_is_independent_of_arrival_order(order in Just((0..9usize).collect::<Vec<_>>()).prop_shuffle()) {
        let events = lifecycle();
        let shuffled: Vec<Event> = order.iter().map(|&i| events[i].clone()).collect();
        prop_assert_eq!(fold(&shuffled), fold(&events));
    }

    /// Random timestamps and shuffles: still order-independent.
    #[test]
    fn fold_commutes_for_random_timestamps(
        stamps in proptest::collection::vec(0i64..50, 9),
        order in Just((0..9usize).collect::<Vec<_>>()).prop_shuffle(),
    ) {
        let events: Vec<Event> = lifecycle().into_iter().zip(stamps).map(|(mut e, t)| { e.timestamp = t; e }).collect();
        let shuffled: Vec<Event> = order.iter().map(|&i| events[i].clone()).collect();
        prop_assert_eq!(fold(&shuffled), fold(&events));
    }
}

#[test]
fn recent_user_message_times_are_kept_newest_first_whatever_the_arrival_order() {
    let mut state = ConversationState::new("c1".into());
    let message = |id: &str, at: i64| {
        let raw = format!(
            r#"{{"id":"e-{id}","event":"bot.message.received","sourceType":"bot","sourceId":"B1","timestamp":{at},
            "data":{{"message":{{"id":"{id}","conversationId":"c1","isUser":true,"meta":null,"timestamp":{at},"data":{{"type":"text","text":"x"}}}}}}}}"#
        );
        model::webhook::parse_event(&raw).expect("event")
    };
    for (i, at) in [5, 3, 9, 1].into_iter().enumerate() {
        state.apply(&message(&format!("m{i}"), at));
    }
    assert_eq!(state.messages.recent_user_at, vec![9, 5, 3, 1]);
    for i in 0..30 {
        state.apply(&message(&format!("n{i}"), 100 + i));
    }
    assert_eq!(
        state.messages.recent_user_at.len(),
        crate::state::RECENT_USER_MESSAGES
    );
    assert_eq!(state.messages.recent_user_at[0], 129, "the newest first");
}

/// A `reconcile.drift` event of c1, as the sweeper makes it.
fn drift_event(kind: model::webhook::drift::DriftKind, manual: bool, at: i64) -> Event {
    use model::webhook::drift::{Believed, Drift, Observed};
    let drift = Drift {
        conversation_id: "c1".into(),
        kind,
        believed: Believed::default(),
        service: Observed {
            manual,
            status: manual.then(|| "HANDOVER".to_owned()),
            updated_at: None,
        },
        found_at: at,
    };
    model::webhook::drift_event(&drift, "B1")
        .expect("drift event")
        .event
}

/// The lifecycle with a drift of each kind.
fn lifecycle_with_drifts() -> Vec<Event> {
    use model::webhook::drift::DriftKind;
    let mut events = lifecycle();
    events.push(drift_event(DriftKind::ManualOffUnknown, false, 135));
    events.push(drift_event(DriftKind::ManualOnUnknown, true, 200));
    events
}

proptest! {
    /// Drifts fold as last-writer-wins writes too: any order, any times, the same state.
    #[test]
    fn drift_fold_is_independent_of_arrival_order(
        stamps in proptest::collection::vec(0i64..50, 11),
        order in Just((0..11usize).collect::<Vec<_>>()).prop_shuffle(),
    ) {
        let events: Vec<Event> = lifecycle_with_drifts().into_iter().zip(stamps).map(|(mut e, t)| { e.timestamp = t; e }).collect();
        let shuffled: Vec<Event> = order.iter().map(|&i| events[i].clone()).collect();
        prop_assert_eq!(fold(&shuffled), fold(&events));
    }
}

#[test]
fn a_manual_off_drift_ends_the_wait_and_brings_manual_in_line() {
    use model::webhook::drift::DriftKind;
    let mut state = fold(&[conv_event(
        "e1",
        "bot.conversation.agent_call_requested",
        100,
        "{}",
        1,
        None,
    )]);
    // The shipped rule turned manual mode on for the request.
    let request = conv_event(
        "e1",
        "bot.conversation.agent_call_requested",
        100,
        "{}",
        1,
        None,
    );
    state.note_manual_decided(true, &request);
    assert!(belief::believes_manual(&state));
    assert_eq!(queue::waiting_since(&state), Some(100));
    assert!(belief::is_active(&state));

    assert!(state.apply(&drift_event(DriftKind::ManualOffUnknown, false, 500)));
    assert!(
        !belief::believes_manual(&state),
        "the service's word is newer"
    );
    assert_eq!(state.manual_status.value, None);
    assert_eq!(state.handoff.phase.value, HandoffPhase::Ended);
    assert_eq!(queue::waiting_since(&state), None, "it left the queue");
    assert!(!belief::is_active(&state));
    assert_eq!(belief::released_at(&state), Some(500));

    // Manual on found later: believed on, stamped with the drift.
    state.apply(&drift_event(DriftKind::ManualOnUnknown, true, 900));
    assert_eq!(state.manual_status.value.as_deref(), Some("HANDOVER"));
    assert!(belief::believes_manual(&state));
    assert_eq!(
        state.handoff.phase.value,
        HandoffPhase::Ended,
        "no agent for it"
    );
    // A rule handing back to the bot for that drift: the bridge's decision wins the tie.
    let drift = drift_event(DriftKind::ManualOnUnknown, true, 900);
    state.note_manual_decided(false, &drift);
    assert!(!belief::believes_manual(&state));
}

/// Issue 37's queue definition: when the rules hand a waiting user back to the bot (the wait ran
/// out, after hours), the conversation leaves the queue with the exit `timed_out`, and the agent
/// API's phase is `bot`; a new request waits again.
#[test]
fn a_wait_that_runs_out_or_is_turned_off_by_the_rules_leaves_the_queue_timed_out() {
    use super::desk::DeskPhase;
    use super::stats::{queue_move, QueueExit, QueueMove};
    let request = conv_event(
        "e1",
        "bot.conversation.agent_call_requested",
        100,
        "{}",
        1,
        None,
    );
    let mut state = fold(std::slice::from_ref(&request));
    state.note_manual_decided(true, &request);
    state.start_timer(queue::WAIT_TIMER, run(400, "e1/agent-requested/3"));
    // A stale firing (another run) changes nothing.
    assert!(!state.apply(&timer_event(queue::WAIT_TIMER, 400, "e0/old/3")));
    assert_eq!(queue::waiting_since(&state), Some(100));
    // The wait runs out: out of the queue at the firing, with the exit timed_out.
    let before = queue::waiting_since(&state);
    assert!(state.apply(&timer_event(queue::WAIT_TIMER, 400, "e1/agent-requested/3")));
    assert_eq!(queue::waiting_since(&state), None);
    assert_eq!(DeskPhase::of(&state), DeskPhase::Bot);
    assert_eq!(
        state.handoff.phase.value,
        HandoffPhase::Requested,
        "rules still read it"
    );
    assert_eq!(
        queue_move(before, &state, 400),
        Some(QueueMove::Left {
            exit: QueueExit::TimedOut,
            waited_ms: None
        })
    );
    // Asked again: waits again.
    let again = conv_event(
        "e2",
        "bot.conversation.agent_call_requested",
        600,
        "{}",
        1,
        None,
    );
    state.apply(&again);
    assert_eq!(queue::waiting_since(&state), Some(600));
    assert_eq!(DeskPhase::of(&state), DeskPhase::Requested);

    // After hours: the rules turned manual mode off at the request; judged again after they
    // decided (as `fold::fold_and_decide` does), it leaves the queue at that same event.
    state.note_manual_decided(false, &again);
    queue::hand_back(&mut state, &again, true);
    assert_eq!(queue::waiting_since(&state), None);
    assert_eq!(state.handoff.handed_back_at, Some(600));
    assert_eq!(QueueExit::of(&state), QueueExit::TimedOut);
}
