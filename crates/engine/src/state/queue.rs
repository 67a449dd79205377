//! The waiting queue's pure rules: which conversation waits for an agent (and since when), what
//! leaving the queue by an accept is, the recent accept history of a bot, and the expected wait
//! computed from it. The store keeps the index (`queue/v1`) by these rules, in the fold's
//! journal; keeping them here, without I/O, lets the index, the agent API and the tests agree.

use super::{ConversationState, HandoffPhase};
use model::webhook::model::{Event, Millis, Payload};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Accepts kept per bot: enough for a rate that follows the desk's pace, small enough that one
/// slow afternoon does not weigh on the next morning.
pub const KEPT_ACCEPTS: usize = 20;

/// The timer a wait for an agent is timed with (the shipped rules' `agent-wait`,
/// `settings.agent_wait`): when it fires while the conversation waits, the wait ran out.
pub const WAIT_TIMER: &str = "agent-wait";

/// Since when a conversation waits for an agent, if it does: its handoff phase is `requested`
/// (the service's agent call), no agent accepted it through the agent API, no accept served this
/// request (a release after an accept does not put it back in line), and the rules did not hand
/// the user back to the bot since ([`handed_back`]). The same rule as the agent API's `requested`
/// phase.
pub fn waiting_since(s: &ConversationState) -> Option<Millis> {
    if s.desk.agent.is_some() || s.handoff.phase.value != HandoffPhase::Requested {
        return None;
    }
    let requested = requested_at(s);
    match s.desk.accepted_at {
        Some(accepted) if accepted >= requested => None,
        _ if handed_back(s) => None,
        _ => Some(requested),
    }
}

fn requested_at(s: &ConversationState) -> Millis {
    s.handoff.requested_at.unwrap_or(s.handoff.phase.stamp.at)
}

/// Whether the rules handed the user back to the bot after their request, nobody having taken
/// the conversation: it left the queue with the exit `timed_out`.
pub fn handed_back(s: &ConversationState) -> bool {
    s.handoff
        .handed_back_at
        .is_some_and(|at| at >= requested_at(s))
}

/// The fold's part of the queue's definition, after `event` is folded into `s` (`live`: it
/// reaches the rules): a waiting conversation is handed back to the bot, and leaves the queue,
/// when its wait runs out (a live firing of [`WAIT_TIMER`]), or once the rules turned manual mode
/// off for this request without anyone taking it (the after-hours answer: the fold judges again
/// right after the rules decided, `fold::fold_and_decide`, so it leaves at the deciding event).
/// Pure and stamped with the event's time, so a replay leaves the queue at the same event.
pub(crate) fn hand_back(s: &mut ConversationState, event: &Event, live: bool) {
    let Some(since) = waiting_since(s) else {
        return;
    };
    let ran_out = live && matches!(&event.payload, Payload::Timer(t) if t.name == WAIT_TIMER);
    let turned_off = s.manual_set.value == Some(false) && s.manual_set.stamp.at >= since;
    if ran_out || turned_off {
        let at = event.timestamp.max(since);
        let h = &mut s.handoff;
        h.handed_back_at = Some(h.handed_back_at.map_or(at, |old| old.max(at)));
    }
}

/// Whether a conversation that waited left the queue because someone took it (an agent accepted
/// it through the agent API, or the service connected the call), rather than because the request
/// was cancelled or ended: only those count for the accept rate.
pub fn left_by_accept(after: &ConversationState) -> bool {
    after.desk.agent.is_some() || after.handoff.phase.value == HandoffPhase::Connected
}

/// One waiting conversation taken by an agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accept {
    /// When it was taken (the accepting event's time).
    pub at: Millis,
    /// How long it had waited (ms).
    pub waited_ms: Millis,
}

/// A bot's recent accepts, oldest first, at most [`KEPT_ACCEPTS`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcceptHistory {
    pub accepts: VecDeque<Accept>,
}

impl AcceptHistory {
    /// Record an accept, keeping the history ordered by time (events may arrive out of order)
    /// and dropping the oldest beyond [`KEPT_ACCEPTS`].
    pub fn record(&mut self, accept: Accept) {
        let at = self.accepts.partition_point(|a| a.at <= accept.at);
        self.accepts.insert(at, accept);
        while self.accepts.len() > KEPT_ACCEPTS {
            self.accepts.pop_front();
        }
    }
}

/// Expected wait (seconds) of the conversation at `position` (1 is next), from the bot's recent
/// accept rate: with n accepts from t_first to t_last, the desk takes (n - 1) conversations per
/// (t_last - t_first), so position p is served after about p * (t_last - t_first) / (n - 1), p
/// times the mean gap between accepts. `None` with fewer than 2 accepts (no rate yet) or position
/// 0. The gap counts at least one second, so accepts in the same instant do not promise "now".
/// Rounded up to whole seconds (saturating).
pub fn expected_wait_seconds(position: u32, history: &AcceptHistory) -> Option<u64> {
    let n = history.accepts.len();
    if n < 2 || position == 0 {
        return None;
    }
    let first = history.accepts.front()?.at;
    let last = history.accepts.back()?.at;
    let span = u128::try_from(last.saturating_sub(first)).unwrap_or(0);
    let gaps = u128::try_from(n - 1).ok()?;
    let gap_ms = (span / gaps).max(1000);
    let ms = u128::from(position) * gap_ms;
    Some(u64::try_from(ms.div_ceil(1000)).unwrap_or(u64::MAX))
}

/// An expected wait as a user reads it: "less than a minute", "about 1 minute", "about 4
/// minutes", "about 2 hours" (rounded to the nearest minute, or hour from 90 minutes).
pub fn wait_text(seconds: u64) -> String {
    if seconds < 60 {
        return "less than a minute".to_owned();
    }
    let minutes = (seconds + 30) / 60;
    if minutes < 90 {
        return match minutes {
            1 => "about 1 minute".to_owned(),
            m => format!("about {m} minutes"),
        };
    }
    format!("about {} hours", (minutes + 30) / 60)
}

/// A conversation's standing in its bot's queue, as rules read it (`queue.*`) and the help desk
/// receives it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Standing {
    /// Whether the conversation waits for an agent.
    pub waiting: bool,
    /// 1 is next; `None` when it does not wait.
    pub position: Option<u32>,
    /// Conversations waiting for the same bot (this one included when it waits).
    pub length: u32,
    pub expected_wait_seconds: Option<u64>,
    /// [`wait_text`] of the expected wait.
    pub expected_wait: Option<String>,
}

impl Standing {
    /// The standing at `position` (`None`: not waiting) among `length`, with the bot's history.
    pub fn new(position: Option<u32>, length: u32, history: &AcceptHistory) -> Self {
        let seconds = position.and_then(|p| expected_wait_seconds(p, history));
        Standing {
            waiting: position.is_some(),
            position,
            length,
            expected_wait_seconds: seconds,
            expected_wait: seconds.map(wait_text),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::webhook::agent::DeskAgent;

    fn history(times: &[Millis]) -> AcceptHistory {
        let mut h = AcceptHistory::default();
        for &at in times {
            h.record(Accept { at, waited_ms: 0 });
        }
        h
    }

    #[test]
    fn no_rate_without_two_accepts() {
        assert_eq!(expected_wait_seconds(1, &history(&[])), None);
        assert_eq!(expected_wait_seconds(1, &history(&[1_000])), None);
        assert_eq!(expected_wait_seconds(0, &history(&[0, 60_000])), None);
    }

    #[test]
    fn the_wait_is_the_position_times_the_mean_gap_between_accepts() {
        // 3 accepts over 4 minutes: one every 2 minutes.
        let h = history(&[0, 60_000, 240_000]);
        assert_eq!(expected_wait_seconds(1, &h), Some(120));
        assert_eq!(expected_wait_seconds(2, &h), Some(240));
        assert_eq!(expected_wait_seconds(5, &h), Some(600));
        // Rounded up to whole seconds.
        assert_eq!(
            expected_wait_seconds(1, &history(&[0, 1_500, 3_001])),
            Some(2)
        );
    }

    #[test]
    fn accepts_in_one_instant_count_a_second_apart() {
        assert_eq!(expected_wait_seconds(3, &history(&[5, 5, 5])), Some(3));
    }

    #[test]
    fn the_history_keeps_the_newest_accepts_in_time_order() {
        let mut h = history(&(0..30).map(|i| i * 1000).collect::<Vec<_>>());
        assert_eq!(h.accepts.len(), KEPT_ACCEPTS);
        assert_eq!(h.accepts.front().map(|a| a.at), Some(10_000));
        h.record(Accept {
            at: 15_500,
            waited_ms: 1,
        });
        let times: Vec<Millis> = h.accepts.iter().map(|a| a.at).collect();
        let mut sorted = times.clone();
        sorted.sort();
        assert_eq!(times, sorted);
        assert_eq!(h.accepts.len(), KEPT_ACCEPTS);
        // A huge span does not overflow.
        let wide = history(&[Millis::MIN, Millis::MAX]);
        assert!(expected_wait_seconds(u32::MAX, &wide).is_some());
    }

    #[test]
    fn wait_texts_round_to_minutes_then_hours() {
        assert_eq!(wait_text(0), "less than a minute");
        assert_eq!(wait_text(59), "less than a minute");
        assert_eq!(wait_text(60), "about 1 minute");
        assert_eq!(wait_text(89), "about 1 minute");
        assert_eq!(wait_text(90), "about 2 minutes");
        assert_eq!(wait_text(240), "about 4 minutes");
        assert_eq!(wait_text(89 * 60), "about 89 minutes");
        assert_eq!(wait_text(90 * 60), "about 2 hours");
        assert_eq!(wait_text(5 * 3600), "about 5 hours");
    }

    #[test]
    fn a_standing_has_a_wait_only_when_waiting_with_a_rate() {
        let h = history(&[0, 60_000]);
        let s = Standing::new(Some(4), 6, &h);
        assert!(s.waiting);
        assert_eq!(s.expected_wait_seconds, Some(240));
        assert_eq!(s.expected_wait.as_deref(), Some("about 4 minutes"));
        let out = Standing::new(None, 6, &h);
        assert!(!out.waiting);
        assert_eq!(out.expected_wait_seconds, None);
    }

    #[test]
    fn waiting_means_requested_and_not_taken_for_this_request() {
        let mut s = ConversationState::new("c".into());
        assert_eq!(waiting_since(&s), None);
        s.handoff.phase.value = HandoffPhase::Requested;
        s.handoff.requested_at = Some(100);
        assert_eq!(waiting_since(&s), Some(100));
        s.desk.agent = Some(DeskAgent {
            id: "a".into(),
            name: None,
        });
        s.desk.accepted_at = Some(150);
        assert_eq!(waiting_since(&s), None);
        assert!(left_by_accept(&s));
        // Released: this request was served.
        s.desk.agent = None;
        assert_eq!(waiting_since(&s), None);
        assert!(!left_by_accept(&s));
        // A new request after it waits again.
        s.handoff.requested_at = Some(200);
        assert_eq!(waiting_since(&s), Some(200));
        s.handoff.phase.value = HandoffPhase::Cancelled;
        assert_eq!(waiting_since(&s), None);
        assert!(!left_by_accept(&s));
        s.handoff.phase.value = HandoffPhase::Connected;
        assert!(left_by_accept(&s));
    }
}
