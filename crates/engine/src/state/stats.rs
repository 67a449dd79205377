//! Handoff figures by the hour, pure: why a waiting conversation left the queue ([`QueueExit`]),
//! what one folded event did to its place in the queue ([`queue_move`]), and an hour's figures
//! ([`HandoffStats`]: conversations that joined the queue, those that left it by outcome, and the
//! time to accept as a histogram). The store keeps one record per hour, updated by the folds in
//! their journal (`storage::queue`), so the operator console reads a day's figures as about 25
//! small records, never a scan of conversations; the daemon also counts the same exits and waits
//! in Prometheus ([`TIME_TO_ACCEPT_BOUNDS`] are both histograms' bounds).

use super::queue::{handed_back, left_by_accept, waiting_since};
use super::{ConversationState, HandoffPhase};
use model::webhook::model::Millis;
use serde::{Deserialize, Serialize};

/// One hour (ms): the figures' granularity.
pub const HOUR_MS: Millis = 3_600_000;

/// How long the store keeps the hour records (48 hours: a 24-hour window, read at any time of
/// the day, with room to spare); the pruning pass removes older ones.
pub const KEPT_MS: Millis = 48 * HOUR_MS;

/// The time-to-accept histogram's upper bounds (seconds, each bucket `<=` its bound, as in
/// Prometheus), then +Inf. Used by the stored records and by the Prometheus histogram
/// `handoff_time_to_accept_seconds`, so the two agree. The stored records keep one count per
/// bucket: changing the list is a migration of `queue/v1`'s hour records.
pub const TIME_TO_ACCEPT_BOUNDS: [u64; 14] = [
    5, 10, 15, 30, 45, 60, 90, 120, 180, 300, 600, 900, 1800, 3600,
];

/// Buckets of the histogram: one per bound, and +Inf.
pub const BUCKETS: usize = TIME_TO_ACCEPT_BOUNDS.len() + 1;

/// The start of the hour `at` is in (ms since the epoch, UTC hours).
pub fn hour_of(at: Millis) -> Millis {
    at.saturating_sub(at.rem_euclid(HOUR_MS))
}

/// Why a waiting conversation left the queue, read from its state after the event that took it
/// out ([`QueueExit::of`]). Its names ([`QueueExit::as_str`], serde) and the list of all
/// ([`QueueExit::ALL`], the metric's labels) come from the enum itself.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    strum::IntoStaticStr,
    strum::VariantArray,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case", const_into_str)]
pub enum QueueExit {
    /// Someone took it: an agent accepted it through the agent API, or the service connected the
    /// call ([`left_by_accept`]).
    Accepted,
    /// The service cancelled the agent call (`agent_call_cancelled`).
    Cancelled,
    /// Handed back to the bot without an accept, cancel or end: the wait ran out, or the rules
    /// turned manual mode off (after hours) ([`handed_back`]).
    TimedOut,
    /// The agent call ended before anyone took it (`agent_call_disconnected`, or a drift that
    /// found manual mode off at the service).
    Ended,
}

impl QueueExit {
    /// Every outcome, in declaration order.
    pub const ALL: &'static [QueueExit] = <QueueExit as strum::VariantArray>::VARIANTS;

    /// The outcome's name (the metric's `outcome` label).
    pub const fn as_str(self) -> &'static str {
        self.into_str()
    }

    /// Why a conversation that waited before an event and does not wait after it left the
    /// queue, from `after` (its state with the event folded in). The rule, first match wins:
    /// - [`left_by_accept`] (an agent holds it, or the phase is `connected`): `accepted`;
    /// - phase `cancelled`: `cancelled`; phase `ended`: `ended`;
    /// - phase `bot`, or `requested` and [`handed_back`] (the rules handed the user back without
    ///   an accept): `timed_out`;
    /// - phase `requested` while not waiting and with no agent (an accept served this request:
    ///   [`waiting_since`]): `accepted`. One event cannot bring that about from a waiting
    ///   state (an accept leaves an agent holding it); it is listed so the rule is total.
    pub fn of(after: &ConversationState) -> QueueExit {
        if left_by_accept(after) {
            return QueueExit::Accepted;
        }
        match after.handoff.phase.value {
            HandoffPhase::Cancelled => QueueExit::Cancelled,
            HandoffPhase::Ended => QueueExit::Ended,
            HandoffPhase::Bot => QueueExit::TimedOut,
            HandoffPhase::Requested if handed_back(after) => QueueExit::TimedOut,
            HandoffPhase::Requested | HandoffPhase::Connected => QueueExit::Accepted,
        }
    }

    /// Whether the conversation left without anyone taking it (cancelled, timed out, ended).
    pub fn is_abandoned(self) -> bool {
        self != QueueExit::Accepted
    }
}

impl std::fmt::Display for QueueExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one folded event did to its conversation's place in the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueMove {
    /// It did not wait before the event and waits after it.
    Joined,
    /// It waited before the event and does not after it; `waited_ms` (event time minus since
    /// when it waited, at least 0) only for an accept.
    Left {
        exit: QueueExit,
        waited_ms: Option<Millis>,
    },
}

/// The move of one event: `waited_since` is [`waiting_since`] before the event, `after` the state
/// with it folded in, `at` the event's time. `None` when it neither joined nor left (a request
/// repeated while waiting moves its entry but is no new join).
pub fn queue_move(
    waited_since: Option<Millis>,
    after: &ConversationState,
    at: Millis,
) -> Option<QueueMove> {
    match (waited_since, waiting_since(after)) {
        (None, Some(_)) => Some(QueueMove::Joined),
        (Some(since), None) => {
            let exit = QueueExit::of(after);
            let waited_ms = (exit == QueueExit::Accepted).then(|| at.saturating_sub(since).max(0));
            Some(QueueMove::Left { exit, waited_ms })
        }
        _ => None,
    }
}

/// Conversations that left the queue, by [`QueueExit`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct QueueExits {
    pub accepted: u64,
    pub cancelled: u64,
    pub timed_out: u64,
    pub ended: u64,
}

impl QueueExits {
    /// The count of one outcome.
    pub fn get(&self, exit: QueueExit) -> u64 {
        match exit {
            QueueExit::Accepted => self.accepted,
            QueueExit::Cancelled => self.cancelled,
            QueueExit::TimedOut => self.timed_out,
            QueueExit::Ended => self.ended,
        }
    }

    fn slot(&mut self, exit: QueueExit) -> &mut u64 {
        match exit {
            QueueExit::Accepted => &mut self.accepted,
            QueueExit::Cancelled => &mut self.cancelled,
            QueueExit::TimedOut => &mut self.timed_out,
            QueueExit::Ended => &mut self.ended,
        }
    }

    /// Add `n` to one outcome (saturating).
    pub fn add(&mut self, exit: QueueExit, n: u64) {
        let slot = self.slot(exit);
        *slot = slot.saturating_add(n);
    }
}

/// Times to accept: a count per bucket of [`TIME_TO_ACCEPT_BOUNDS`] (then +Inf), and their sum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct WaitHistogram {
    /// Accepts whose wait was at most bound `i` and more than bound `i - 1` (the last: more than
    /// the last bound).
    pub counts: [u64; BUCKETS],
    /// The waits' sum (ms).
    pub sum_ms: u64,
}

/// Bucket `i`'s upper bound (ms); `None` for +Inf.
fn bound_ms(i: usize) -> Option<Millis> {
    TIME_TO_ACCEPT_BOUNDS.get(i).map(|s| {
        Millis::try_from(*s)
            .unwrap_or(Millis::MAX)
            .saturating_mul(1000)
    })
}

/// The last finite bound (ms): what a percentile in the +Inf bucket reports.
fn last_bound_ms() -> Millis {
    bound_ms(TIME_TO_ACCEPT_BOUNDS.len() - 1).unwrap_or(0)
}

impl WaitHistogram {
    /// Record a wait (ms; below 0 counts as 0).
    pub fn record(&mut self, waited_ms: Millis) {
        let waited = waited_ms.max(0);
        let bucket = (0..TIME_TO_ACCEPT_BOUNDS.len())
            .find(|i| bound_ms(*i).is_some_and(|b| waited <= b))
            .unwrap_or(BUCKETS - 1);
        self.counts[bucket] = self.counts[bucket].saturating_add(1);
        self.sum_ms = self
            .sum_ms
            .saturating_add(u64::try_from(waited).unwrap_or(0));
    }

    /// Waits recorded.
    pub fn count(&self) -> u64 {
        self.counts.iter().fold(0, |a, n| a.saturating_add(*n))
    }

    /// Add another histogram's buckets and sum.
    pub fn merge(&mut self, other: &WaitHistogram) {
        for (mine, theirs) in self.counts.iter_mut().zip(other.counts) {
            *mine = mine.saturating_add(theirs);
        }
        self.sum_ms = self.sum_ms.saturating_add(other.sum_ms);
    }

    /// The `q`-quantile of the waits (ms), `q` in [0, 1] (clamped; NaN is `None`): the rank
    /// `q * count` is found in the buckets' running total and interpolated linearly inside its
    /// bucket, between the bucket's lower bound (the previous bound, 0 for the first) and its
    /// upper bound, as Prometheus' `histogram_quantile` does. Empty buckets are passed over, so
    /// `q = 0` is the lower bound of the first bucket with a wait. A rank in the +Inf bucket is
    /// reported as the last finite bound (3600 s): the histogram cannot say how much longer.
    /// `None` when no wait was recorded. Monotone in `q`, always within [0, last bound].
    pub fn percentile(&self, q: f64) -> Option<Millis> {
        let total = self.count();
        if total == 0 || q.is_nan() {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total as f64;
        let mut before = 0u64;
        for (i, &n) in self.counts.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let through = before.saturating_add(n);
            if (through as f64) >= rank {
                let Some(upper) = bound_ms(i) else {
                    return Some(last_bound_ms());
                };
                let lower = i.checked_sub(1).and_then(bound_ms).unwrap_or(0);
                let share = ((rank - before as f64) / n as f64).clamp(0.0, 1.0);
                let inside = ((upper - lower) as f64 * share).round() as Millis;
                return Some((lower + inside).min(upper));
            }
            before = through;
        }
        Some(last_bound_ms())
    }
}

/// One hour's handoff figures (or several hours' merged): conversations that joined the queue,
/// those that left it by outcome, and how long the accepted ones had waited. Each is counted in
/// the hour of the event that moved it (a conversation may join in one hour and leave in
/// another).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HandoffStats {
    /// Conversations that started waiting for an agent.
    pub joined: u64,
    /// Conversations that stopped waiting, by why.
    pub exits: QueueExits,
    /// The waits of the accepted ones (ms), in the buckets of [`TIME_TO_ACCEPT_BOUNDS`].
    pub time_to_accept: WaitHistogram,
}

impl HandoffStats {
    /// Count one event's move.
    pub fn record(&mut self, change: QueueMove) {
        match change {
            QueueMove::Joined => self.joined = self.joined.saturating_add(1),
            QueueMove::Left { exit, waited_ms } => {
                self.exits.add(exit, 1);
                if let Some(waited) = waited_ms {
                    self.time_to_accept.record(waited);
                }
            }
        }
    }

    /// Add another record's figures (another hour's): counts and buckets summed.
    pub fn merge(&mut self, other: &HandoffStats) {
        self.joined = self.joined.saturating_add(other.joined);
        for exit in QueueExit::ALL {
            self.exits.add(*exit, other.exits.get(*exit));
        }
        self.time_to_accept.merge(&other.time_to_accept);
    }

    /// The time to accept's `q`-quantile (see [`WaitHistogram::percentile`]).
    pub fn percentile(&self, q: f64) -> Option<Millis> {
        self.time_to_accept.percentile(q)
    }

    /// Conversations that left without anyone taking them: cancelled, timed out or ended.
    pub fn abandoned(&self) -> u64 {
        QueueExit::ALL
            .iter()
            .filter(|e| e.is_abandoned())
            .fold(0, |a, e| a.saturating_add(self.exits.get(*e)))
    }

    /// [`abandoned`](Self::abandoned) over [`joined`](Self::joined), in the same hours; `None`
    /// when none joined. Both are counts of events in the window (not one cohort followed), so a
    /// window whose exits joined before it can exceed 1.
    pub fn abandonment_rate(&self) -> Option<f64> {
        (self.joined > 0).then(|| self.abandoned() as f64 / self.joined as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::webhook::agent::DeskAgent;
    use proptest::prelude::*;

    const S: Millis = 1000;

    fn waits(ms: &[Millis]) -> HandoffStats {
        let mut s = HandoffStats::default();
        for w in ms {
            s.record(QueueMove::Left {
                exit: QueueExit::Accepted,
                waited_ms: Some(*w),
            });
        }
        s
    }

    #[test]
    fn exit_names_are_snake_case_and_listed_once() {
        let names: Vec<&str> = QueueExit::ALL.iter().map(|e| e.as_str()).collect();
        assert_eq!(names, ["accepted", "cancelled", "timed_out", "ended"]);
        for exit in QueueExit::ALL {
            let json = serde_json::to_value(exit).expect("json");
            assert_eq!(json, exit.as_str());
            assert_eq!(exit.to_string(), exit.as_str());
        }
    }

    #[test]
    fn hours_start_on_the_hour() {
        assert_eq!(hour_of(0), 0);
        assert_eq!(hour_of(HOUR_MS - 1), 0);
        assert_eq!(hour_of(HOUR_MS), HOUR_MS);
        assert_eq!(hour_of(5 * HOUR_MS + 17), 5 * HOUR_MS);
        assert_eq!(hour_of(-1), -HOUR_MS);
        assert!(hour_of(Millis::MIN) <= Millis::MIN / 2);
        assert_eq!(hour_of(Millis::MAX) % HOUR_MS, 0);
    }

    fn waiting(requested_at: Millis) -> ConversationState {
        let mut s = ConversationState::new("c".into());
        s.handoff.phase.value = HandoffPhase::Requested;
        s.handoff.requested_at = Some(requested_at);
        s
    }

    #[test]
    fn an_exit_is_classified_from_the_state_after_the_event() {
        let mut s = waiting(100);
        assert_eq!(queue_move(None, &s, 100), Some(QueueMove::Joined));
        assert_eq!(queue_move(Some(50), &s, 100), None, "still waiting");
        s.desk.agent = Some(DeskAgent {
            id: "a".into(),
            name: None,
        });
        s.desk.accepted_at = Some(40_100);
        let accepted = QueueMove::Left {
            exit: QueueExit::Accepted,
            waited_ms: Some(40_000),
        };
        assert_eq!(queue_move(Some(100), &s, 40_100), Some(accepted));
        assert_eq!(queue_move(None, &s, 40_100), None, "never waited");
        let out = |phase| {
            let mut s = waiting(100);
            s.handoff.phase.value = phase;
            QueueExit::of(&s)
        };
        assert_eq!(out(HandoffPhase::Connected), QueueExit::Accepted);
        assert_eq!(out(HandoffPhase::Cancelled), QueueExit::Cancelled);
        assert_eq!(out(HandoffPhase::Ended), QueueExit::Ended);
        assert_eq!(out(HandoffPhase::Bot), QueueExit::TimedOut);
        let mut back = waiting(100);
        back.handoff.phase.value = HandoffPhase::Bot;
        assert_eq!(
            queue_move(Some(100), &back, 500),
            Some(QueueMove::Left {
                exit: QueueExit::TimedOut,
                waited_ms: None
            })
        );
        // An accept stamped before the request it served waited 0, not less.
        let mut early = waiting(100);
        early.handoff.phase.value = HandoffPhase::Connected;
        assert_eq!(
            queue_move(Some(100), &early, 40),
            Some(QueueMove::Left {
                exit: QueueExit::Accepted,
                waited_ms: Some(0)
            })
        );
    }

    #[test]
    fn a_wait_goes_in_the_first_bucket_whose_bound_holds_it() {
        let h = waits(&[0, 5 * S, 5 * S + 1, 3600 * S, 3600 * S + 1, -7]).time_to_accept;
        assert_eq!(h.counts[0], 3, "0, 5 s and a negative wait");
        assert_eq!(h.counts[1], 1, "just over 5 s");
        assert_eq!(h.counts[BUCKETS - 2], 1, "exactly an hour");
        assert_eq!(h.counts[BUCKETS - 1], 1, "over an hour");
        assert_eq!(h.count(), 6);
        assert_eq!(h.sum_ms, (5 + 5 + 3600 + 3600) as u64 * 1000 + 1 + 1);
    }

    #[test]
    fn percentiles_interpolate_inside_the_bucket() {
        assert_eq!(HandoffStats::default().percentile(0.5), None, "no accepts");
        // Four waits in (30 s, 45 s]: the median is halfway through the bucket.
        let s = waits(&[31 * S, 35 * S, 40 * S, 44 * S]);
        assert_eq!(s.percentile(0.5), Some(37_500));
        assert_eq!(s.percentile(0.0), Some(30_000));
        assert_eq!(s.percentile(1.0), Some(45_000));
        assert_eq!(s.percentile(f64::NAN), None);
        assert_eq!(s.percentile(7.0), s.percentile(1.0), "clamped");
        // 9 quick ones and one over an hour: p90 is the last quick one's bucket's top, p95
        // lands in +Inf and reports the last bound.
        let mut quick = vec![2 * S; 9];
        quick.push(5000 * S);
        let s = waits(&quick);
        assert_eq!(s.percentile(0.5), Some(2_778), "5 of 9 through (0, 5 s]");
        assert_eq!(s.percentile(0.9), Some(5_000));
        assert_eq!(s.percentile(0.95), Some(3_600_000));
    }

    #[test]
    fn merging_sums_every_figure() {
        let mut a = waits(&[2 * S, 50 * S]);
        a.record(QueueMove::Joined);
        a.record(QueueMove::Left {
            exit: QueueExit::Cancelled,
            waited_ms: None,
        });
        let mut b = waits(&[7000 * S]);
        b.record(QueueMove::Joined);
        b.record(QueueMove::Joined);
        b.record(QueueMove::Left {
            exit: QueueExit::TimedOut,
            waited_ms: None,
        });
        b.record(QueueMove::Left {
            exit: QueueExit::Ended,
            waited_ms: None,
        });
        let mut m = a.clone();
        m.merge(&b);
        assert_eq!(m.joined, 3);
        assert_eq!(
            m.exits,
            QueueExits {
                accepted: 3,
                cancelled: 1,
                timed_out: 1,
                ended: 1
            }
        );
        assert_eq!(m.time_to_accept.count(), 3);
        assert_eq!(m.time_to_accept.sum_ms, (2 + 50 + 7000) * 1000);
        assert_eq!(m.abandoned(), 3);
        assert_eq!(m.abandonment_rate(), Some(1.0));
        assert_eq!(HandoffStats::default().abandonment_rate(), None);
        // A record reads back as written, and an older one with fields missing reads as zeros.
        let json = serde_json::to_string(&m).expect("json");
        assert_eq!(
            serde_json::from_str::<HandoffStats>(&json).expect("back"),
            m
        );
        let old: HandoffStats = serde_json::from_str(r#"{"joined":2}"#).expect("old");
        assert_eq!((old.joined, old.time_to_accept.count()), (2, 0));
    }

    fn histogram() -> impl Strategy<Value = WaitHistogram> {
        (prop::collection::vec(0u64..1_000, BUCKETS), 0u64..10).prop_map(|(counts, zeros)| {
            let mut h = WaitHistogram::default();
            for (i, n) in counts.into_iter().enumerate() {
                // Many empty buckets too.
                h.counts[i] = if (i as u64).is_multiple_of(zeros + 1) {
                    n
                } else {
                    0
                };
            }
            h
        })
    }

    proptest! {
        #[test]
        fn percentiles_are_monotone_and_within_the_bounds(
            h in histogram(),
            mut qs in prop::collection::vec(0.0f64..=1.0, 2..20),
        ) {
            qs.sort_by(f64::total_cmp);
            let values: Vec<Option<Millis>> = qs.iter().map(|q| h.percentile(*q)).collect();
            if h.count() == 0 {
                prop_assert!(values.iter().all(Option::is_none));
            } else {
                let values: Vec<Millis> = values.into_iter().flatten().collect();
                prop_assert_eq!(values.len(), qs.len());
                prop_assert!(values.windows(2).all(|w| w[0] <= w[1]), "{:?} at {:?}", values, qs);
                prop_assert!(values.iter().all(|v| (0..=3_600_000).contains(v)));
            }
        }

        #[test]
        fn merging_adds_every_bucket_in_either_order(a in histogram(), b in histogram()) {
            let (mut ab, mut ba) = (a, b);
            ab.merge(&b);
            ba.merge(&a);
            prop_assert_eq!(ab, ba);
            prop_assert_eq!(ab.count(), a.count() + b.count());
            for i in 0..BUCKETS {
                prop_assert_eq!(ab.counts[i], a.counts[i] + b.counts[i]);
            }
            let mut same = a;
            same.merge(&WaitHistogram::default());
            prop_assert_eq!(same, a);
        }

        #[test]
        fn every_wait_lands_in_one_bucket_that_holds_it(w in -10_000i64..10_000_000) {
            let h = waits(&[w]).time_to_accept;
            prop_assert_eq!(h.count(), 1);
            let i = h.counts.iter().position(|n| *n == 1).unwrap_or(BUCKETS);
            let w = w.max(0);
            prop_assert!(bound_ms(i).is_none_or(|b| w <= b));
            prop_assert!(i.checked_sub(1).and_then(bound_ms).is_none_or(|b| w > b));
        }
    }
}
