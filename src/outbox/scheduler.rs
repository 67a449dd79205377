//! What runs next, as a data structure without I/O: per-queue order (one entry of a queue at a
//! time, in decision order), due times (daemon time) of entries waiting after a failure, the
//! circuit breakers that gate each destination, and the in-memory window over the outbox.
//!
//! **The window.** At most `window / 2` entries per sink (the Open API, the help desks) are in
//! memory; the rest stay in the store and are read in seq order through a cursor per sink as
//! room frees ([`Scheduler::refill`], [`Scheduler::refilled`]). An entry with a seq past its
//! sink's cursor is never loaded before the cursor reaches it, so a queue's order holds across
//! refills; a sink's backlog (200k Open API entries behind an open circuit) never holds back the
//! other's. Only entries known durable are loaded (at most the highest seq in the store at start
//! or handed over after a flush): an entry runs only after the fold that decided it is on disk.
//!
//! **Queues.** A queue is in one state: ready (in line), busy (its head is running), delayed
//! (its head waits for its next attempt time), held (its head needs a destination whose circuit
//! is open), blocked (a blocking dead letter) or empty. Lists (`ready`, `delayed`, `held`) may
//! keep stale names: each is checked against the queue's state when taken.

use super::breaker::{Admit, Breakers, CircuitView, Transition};
use super::sink::{Job, Reach, SinkKind};
use model::action::{OutboxEntry, RetryState};
use model::webhook::model::Millis;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

/// Entries read from the store per page.
pub const PAGE: usize = 1000;

#[derive(Clone, Debug, PartialEq, Eq)]
enum QState {
    Ready,
    Busy {
        probes: Vec<String>,
        all: Vec<String>,
    },
    Delayed(Millis),
    Held,
    Blocked,
    Idle,
}

struct Slot {
    entry: OutboxEntry,
    state: RetryState,
    /// The destinations of its last attempt (a circuit closing makes it due at once).
    last_dests: Vec<String>,
}

struct Queue {
    entries: BTreeMap<u64, Slot>,
    state: QState,
}

#[derive(Default, Clone, Copy)]
struct Cursor {
    /// Every entry of the sink up to this seq was loaded (or finished); `None`: none yet.
    at: Option<u64>,
    /// The store holds nothing of the sink past `at` that is known durable: new entries are
    /// loaded as they arrive (while there is room).
    caught_up: bool,
    loaded: usize,
}

/// How a finished attempt ended, for the scheduler.
#[derive(Debug)]
pub enum Finish {
    Done,
    Dead {
        blocking: bool,
    },
    /// Try again at `state.next_attempt_at`, or (when the failure opened or kept open the
    /// circuit) at the circuit's next probe, not before `not_before` (a `Retry-After`).
    Retry {
        state: RetryState,
        not_before: Option<Millis>,
    },
    /// Wait for the destinations whose circuits are open.
    Held(RetryState),
    /// Not finished (the outcome could not be recorded, or the client stopped): again, first.
    Again(RetryState),
}

pub struct Scheduler {
    queues: HashMap<String, Queue>,
    ready: VecDeque<String>,
    delayed: BTreeSet<(Millis, String)>,
    /// Destination -> queues whose head waits for its circuit.
    held: HashMap<String, VecDeque<String>>,
    blocked: HashSet<String>,
    pub breakers: Breakers,
    cursors: [Cursor; 2],
    per_sink: usize,
    /// The highest seq known durable (in the store at start, or handed over after a flush).
    durable: Option<u64>,
    /// The highest seq in the store at start: entries up to it are counted in `depth` and read
    /// from the store, so a hand-over of one (a fold of an earlier term) is not counted again.
    counted_through: Option<u64>,
    /// Pending entries, loaded or not (signed: an entry may finish before its hand-over).
    depth: i64,
    /// seq -> decided_at of loaded entries (the oldest pending one).
    loaded: BTreeMap<u64, Millis>,
    /// The last entries finished (bounded): a hand-over that comes after its entry was read from
    /// the store and finished is not run again.
    finished: VecDeque<u64>,
}

/// Finished seqs remembered.
const FINISHED_KEPT: usize = 4096;

impl Scheduler {
    /// `pending`: the entries in the store at start, the highest of them `durable`.
    pub fn new(window: usize, breakers: Breakers, pending: usize, durable: Option<u64>) -> Self {
        Scheduler {
            queues: HashMap::new(),
            ready: VecDeque::new(),
            delayed: BTreeSet::new(),
            held: HashMap::new(),
            blocked: HashSet::new(),
            breakers,
            cursors: [Cursor::default(); 2],
            per_sink: (window / 2).max(1),
            durable,
            counted_through: durable,
            depth: i64::try_from(pending).unwrap_or(i64::MAX),
            loaded: BTreeMap::new(),
            finished: VecDeque::new(),
        }
    }

    pub fn depth(&self) -> usize {
        usize::try_from(self.depth.max(0)).unwrap_or(0)
    }

    /// Entries in memory.
    pub fn loaded(&self) -> usize {
        self.loaded.len()
    }

    /// Decision time of the oldest entry in memory.
    pub fn oldest_decided_at(&self) -> Option<Millis> {
        self.loaded.values().next().copied()
    }

    /// A blocking dead letter of `queue` exists (read at start): its queue waits.
    pub fn block(&mut self, queue: &str) {
        self.blocked.insert(queue.to_owned());
        if let Some(q) = self.queues.get_mut(queue) {
            if !matches!(q.state, QState::Busy { .. }) {
                q.state = QState::Blocked;
            }
        }
    }

    /// The blocking dead letter of `queue` was retried or dropped: it goes on.
    pub fn unblock(&mut self, queue: &str, now: Millis) {
        if self.blocked.remove(queue) {
            self.settle(queue, now);
        }
    }

    /// Newly decided entries, durable now (in seq order). Counted; loaded when their sink's
    /// cursor is caught up and has room, else read from the store when the cursor gets there.
    pub fn decided(&mut self, entries: Vec<OutboxEntry>, now: Millis) {
        for entry in entries {
            if self.counted_through.is_some_and(|c| entry.seq <= c) {
                continue;
            }
            self.depth += 1;
            self.durable = self.durable.max(Some(entry.seq));
            let kind = SinkKind::of(&entry) as usize;
            let c = self.cursors[kind];
            if c.at.is_some_and(|at| entry.seq <= at) {
                // Behind the cursor: read from the store already (another hand-over with a
                // higher seq came first), unless it never was (then it is loaded now).
                if !self.loaded.contains_key(&entry.seq) && !self.finished.contains(&entry.seq) {
                    self.load(entry, RetryState::default(), now);
                }
                continue;
            }
            if c.caught_up && c.loaded < self.per_sink {
                self.cursors[kind].at = Some(entry.seq);
                self.load(entry, RetryState::default(), now);
            } else {
                self.cursors[kind].caught_up = false;
            }
        }
    }

    /// A dead letter back in the outbox: loaded whatever the window (an operator's few).
    pub fn retried(&mut self, entry: OutboxEntry, now: Millis) {
        self.depth += 1;
        let queue = entry.queue.clone();
        self.load(entry, RetryState::default(), now);
        self.unblock(&queue, now);
    }

    /// The next page to read for a sink: (sink, after, limit), if its cursor is behind and its
    /// window has room (a quarter of it at least, so pages are not read one entry at a time).
    pub fn refill(&self) -> Option<(SinkKind, Option<u64>, usize)> {
        SinkKind::ALL.into_iter().find_map(|kind| {
            let c = &self.cursors[kind as usize];
            let room = self.per_sink.saturating_sub(c.loaded);
            let worth = room > 0 && (room * 4 >= self.per_sink || c.loaded == 0);
            (!c.caught_up && worth && self.durable.is_some()).then_some((kind, c.at, PAGE))
        })
    }

    /// A page read for `kind` from `after` (what [`refill`](Self::refill) asked), with each
    /// entry's retry state. Takes the sink's entries up to its room.
    pub fn refilled(
        &mut self,
        kind: SinkKind,
        page: Vec<(OutboxEntry, Option<RetryState>)>,
        limit: usize,
        now: Millis,
    ) {
        let k = kind as usize;
        let whole = page.len() >= limit;
        let Some(durable) = self.durable else {
            self.cursors[k].caught_up = true;
            return;
        };
        for (entry, state) in page {
            if entry.seq > durable {
                // Not flushed yet: it comes with its hand-over.
                self.cursors[k].caught_up = true;
                return;
            }
            if self.cursors[k].at.is_some_and(|at| entry.seq <= at) {
                continue;
            }
            if SinkKind::of(&entry) == kind {
                if self.cursors[k].loaded >= self.per_sink {
                    return;
                }
                self.cursors[k].at = Some(entry.seq);
                self.load(entry, state.unwrap_or_default(), now);
            } else {
                self.cursors[k].at = Some(entry.seq);
            }
        }
        if !whole {
            self.cursors[k].caught_up = true;
        }
    }

    fn load(&mut self, entry: OutboxEntry, state: RetryState, now: Millis) {
        let queue = entry.queue.clone();
        let kind = SinkKind::of(&entry) as usize;
        let seq = entry.seq;
        let decided_at = entry.decided_at;
        let q = self.queues.entry(queue.clone()).or_insert_with(|| Queue {
            entries: BTreeMap::new(),
            state: QState::Idle,
        });
        if q.entries.contains_key(&seq) {
            return;
        }
        q.entries.insert(
            seq,
            Slot {
                entry,
                state,
                last_dests: Vec::new(),
            },
        );
        self.cursors[kind].loaded += 1;
        self.loaded.insert(seq, decided_at);
        if q.state == QState::Idle {
            self.settle(&queue, now);
        }
    }

    /// Put a queue that is not running in the state its head calls for.
    fn settle(&mut self, name: &str, now: Millis) {
        let Some(q) = self.queues.get_mut(name) else {
            return;
        };
        if matches!(q.state, QState::Busy { .. }) {
            return;
        }
        let Some(head) = q.entries.values().next() else {
            self.queues.remove(name);
            return;
        };
        if self.blocked.contains(name) {
            q.state = QState::Blocked;
            return;
        }
        match head.state.next_attempt_at {
            Some(at) if at > now => {
                if q.state != QState::Delayed(at) {
                    q.state = QState::Delayed(at);
                    self.delayed.insert((at, name.to_owned()));
                }
            }
            _ => {
                if q.state != QState::Ready {
                    q.state = QState::Ready;
                    self.ready.push_back(name.to_owned());
                }
            }
        }
    }

    /// Delayed queues due at `now` go in line; for each open circuit whose probe is due, one
    /// queue held for it goes first in line (its head is the probe).
    fn wake(&mut self, now: Millis) {
        while let Some((at, name)) = self.delayed.first().cloned() {
            if at > now {
                break;
            }
            self.delayed.pop_first();
            if self
                .queues
                .get(&name)
                .is_some_and(|q| q.state == QState::Delayed(at))
            {
                if let Some(q) = self.queues.get_mut(&name) {
                    q.state = QState::Idle;
                }
                self.settle(&name, now);
            }
        }
        let due: Vec<String> = self
            .held
            .keys()
            .filter(|d| self.breakers.probe_at(d).is_some_and(|at| at <= now))
            .cloned()
            .collect();
        for dest in due {
            while let Some(name) = self.held.get_mut(&dest).and_then(VecDeque::pop_front) {
                if let Some(q) = self.queues.get_mut(&name) {
                    if q.state == QState::Held {
                        q.state = QState::Ready;
                        self.ready.push_front(name);
                        break;
                    }
                }
            }
            if self.held.get(&dest).is_some_and(VecDeque::is_empty) {
                self.held.remove(&dest);
            }
        }
    }

    /// The next entry to run at `now`: the head of the next ready queue whose destinations (from
    /// `dests`) let at least one call through. A head none of whose destinations does waits
    /// (held) for them, without an attempt.
    pub fn next(
        &mut self,
        now: Millis,
        dests: &dyn Fn(&OutboxEntry) -> Vec<String>,
    ) -> Option<Job> {
        self.wake(now);
        while let Some(name) = self.ready.pop_front() {
            let Some(q) = self.queues.get(&name) else {
                continue;
            };
            if q.state != QState::Ready {
                continue;
            }
            let Some(head) = q.entries.values().next() else {
                continue;
            };
            let all = dests(&head.entry);
            let mut allowed = Vec::new();
            let mut probes = Vec::new();
            for d in &all {
                match self.breakers.admit(d, now) {
                    Admit::Go => allowed.push(d.clone()),
                    Admit::Probe => {
                        allowed.push(d.clone());
                        probes.push(d.clone());
                    }
                    Admit::Wait => {}
                }
            }
            if !all.is_empty() && allowed.is_empty() {
                self.hold(&name, &all);
                continue;
            }
            let job = Job {
                entry: head.entry.clone(),
                state: head.state.clone(),
                allowed,
            };
            if let Some(q) = self.queues.get_mut(&name) {
                q.state = QState::Busy { probes, all };
            }
            return Some(job);
        }
        None
    }

    fn hold(&mut self, name: &str, dests: &[String]) {
        if let Some(q) = self.queues.get_mut(name) {
            q.state = QState::Held;
        }
        for d in dests {
            if self.breakers.is_open(d) {
                self.held
                    .entry(d.clone())
                    .or_default()
                    .push_back(name.to_owned());
            }
        }
    }

    /// When the loop should look again: the next delayed queue, or the next probe of a circuit
    /// that queues wait for.
    pub fn next_wake(&self) -> Option<Millis> {
        let delayed = self.delayed.first().map(|(at, _)| *at);
        let probe = self
            .held
            .keys()
            .filter_map(|d| self.breakers.probe_at(d))
            .min();
        match (delayed, probe) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The running head of `queue` (entry `seq`) finished at `now`, having `reached` these
    /// destinations. Returns the circuits that changed.
    pub fn finish(
        &mut self,
        queue: &str,
        seq: u64,
        outcome: Finish,
        reached: &[(String, Reach)],
        now: Millis,
    ) -> Vec<Transition> {
        let (probes, all) = match self.queues.get(queue).map(|q| &q.state) {
            Some(QState::Busy { probes, all }) => (probes.clone(), all.clone()),
            _ => (Vec::new(), Vec::new()),
        };
        let mut changes = Vec::new();
        for (d, reach) in reached {
            let change = match reach {
                Reach::Answered => self.breakers.success(d, now),
                Reach::Failed => self.breakers.failure(d, now),
            };
            changes.extend(change);
        }
        for p in &probes {
            if !reached.iter().any(|(d, _)| d == p) {
                self.breakers.release(p);
            }
        }
        if let Some(q) = self.queues.get_mut(queue) {
            q.state = QState::Idle;
        }
        let mut held_on = Vec::new();
        match outcome {
            Finish::Done | Finish::Dead { .. } => {
                self.depth -= 1;
                if let Some(slot) = self
                    .queues
                    .get_mut(queue)
                    .and_then(|q| q.entries.remove(&seq))
                {
                    let c = &mut self.cursors[SinkKind::of(&slot.entry) as usize];
                    c.loaded = c.loaded.saturating_sub(1);
                    self.loaded.remove(&seq);
                    if self.finished.len() >= FINISHED_KEPT {
                        self.finished.pop_front();
                    }
                    self.finished.push_back(seq);
                }
                if matches!(outcome, Finish::Dead { blocking: true }) {
                    self.blocked.insert(queue.to_owned());
                }
            }
            Finish::Retry { state, not_before } => {
                if let Some(slot) = self.slot(queue, seq) {
                    slot.state = state;
                    slot.last_dests = all.clone();
                }
                // A destination whose circuit is open paces its entries by its probes (so its
                // recovery is seen within a probe interval), not by their own backoff; a
                // Retry-After it sent defers the next probe.
                held_on = all
                    .into_iter()
                    .filter(|d| self.breakers.is_open(d))
                    .collect();
                if let Some(at) = not_before {
                    for d in &held_on {
                        self.breakers.defer(d, at);
                    }
                }
            }
            Finish::Again(state) => {
                if let Some(slot) = self.slot(queue, seq) {
                    slot.state = state;
                    slot.last_dests = all;
                }
            }
            Finish::Held(state) => {
                if let Some(slot) = self.slot(queue, seq) {
                    slot.state = state;
                    slot.last_dests = all.clone();
                }
                held_on = all
                    .into_iter()
                    .filter(|d| self.breakers.is_open(d))
                    .collect();
            }
        }
        if held_on.is_empty() {
            self.settle(queue, now);
        } else {
            self.hold(queue, &held_on);
        }
        for change in &changes {
            if let Transition::Closed { destination, .. } = change {
                self.closed(destination, now);
            }
        }
        changes
    }

    fn slot(&mut self, queue: &str, seq: u64) -> Option<&mut Slot> {
        self.queues.get_mut(queue)?.entries.get_mut(&seq)
    }

    /// A circuit closed: every queue held for it goes in line, and every queue delayed after a
    /// failure there is due at once, its backoff reset.
    fn closed(&mut self, destination: &str, now: Millis) {
        let held = self.held.remove(destination).unwrap_or_default();
        for name in held {
            if let Some(q) = self.queues.get_mut(&name) {
                if q.state == QState::Held {
                    if let Some(head) = q.entries.values_mut().next() {
                        head.state.next_attempt_at = None;
                        head.state.failures = 0;
                    }
                    q.state = QState::Idle;
                    self.settle(&name, now);
                }
            }
        }
        let waiting: Vec<String> = self
            .queues
            .iter()
            .filter(|(_, q)| matches!(q.state, QState::Delayed(_)))
            .filter(|(_, q)| {
                q.entries
                    .values()
                    .next()
                    .is_some_and(|s| s.last_dests.iter().any(|d| d == destination))
            })
            .map(|(n, _)| n.clone())
            .collect();
        for name in waiting {
            if let Some(q) = self.queues.get_mut(&name) {
                if let Some(head) = q.entries.values_mut().next() {
                    head.state.next_attempt_at = None;
                    head.state.failures = 0;
                }
                q.state = QState::Idle;
            }
            self.settle(&name, now);
        }
    }

    /// Why the loaded entry `seq` waits, if it failed before.
    pub fn retry_state(&self, queue: &str, seq: u64) -> Option<&RetryState> {
        self.queues.get(queue)?.entries.get(&seq).map(|s| &s.state)
    }

    pub fn circuits(&self) -> BTreeMap<String, CircuitView> {
        self.breakers.views()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::action::Action;
    use model::ids::ConversationId;
    use std::time::Duration;

    fn entry(seq: u64, queue: &str) -> OutboxEntry {
        crate::test_support::outbox_entry(seq, queue)
    }

    fn openapi(_: &OutboxEntry) -> Vec<String> {
        vec!["openapi".into()]
    }

    fn sched(window: usize) -> Scheduler {
        let mut s = Scheduler::new(window, Breakers::new(2, Duration::from_secs(15)), 0, None);
        s.refilled(SinkKind::OpenApi, Vec::new(), PAGE, 0);
        s.refilled(SinkKind::Helpdesk, Vec::new(), PAGE, 0);
        s
    }

    fn seq(j: Option<Job>) -> Option<u64> {
        j.map(|j| j.entry.seq)
    }

    fn failed(at: Millis) -> RetryState {
        RetryState {
            attempts: 1,
            failures: 1,
            next_attempt_at: Some(at),
            ..RetryState::default()
        }
    }

    #[test]
    fn one_entry_per_queue_runs_at_a_time_in_order() {
        let mut s = sched(100);
        s.decided(vec![entry(1, "a"), entry(2, "a"), entry(3, "b")], 0);
        assert_eq!(s.depth(), 3);
        assert_eq!(seq(s.next(0, &openapi)), Some(1));
        assert_eq!(seq(s.next(0, &openapi)), Some(3));
        assert!(
            s.next(0, &openapi).is_none(),
            "a's next waits for a's first"
        );
        s.finish("a", 1, Finish::Done, &[], 0);
        assert_eq!(seq(s.next(0, &openapi)), Some(2));
        assert_eq!(s.depth(), 2);
    }

    #[test]
    fn a_failing_head_holds_its_queue_until_due_while_others_go_on() {
        let mut s = sched(100);
        s.decided(vec![entry(1, "a"), entry(2, "a"), entry(3, "b")], 0);
        let a1 = s.next(0, &openapi).expect("a1");
        s.finish(
            "a",
            a1.entry.seq,
            Finish::Retry {
                state: failed(5_000),
                not_before: None,
            },
            &[],
            0,
        );
        assert_eq!(seq(s.next(0, &openapi)), Some(3), "b goes on");
        assert!(
            s.next(4_999, &openapi).is_none(),
            "a waits, and a2 behind it"
        );
        assert_eq!(s.next_wake(), Some(5_000));
        let again = s.next(5_000, &openapi).expect("due");
        assert_eq!(again.entry.seq, 1, "the same entry first");
        assert_eq!(again.state.attempts, 1, "its attempts so far go with it");
    }

    #[test]
    fn a_blocking_dead_letter_halts_its_queue_until_unblocked() {
        let mut s = sched(100);
        s.decided(vec![entry(1, "a"), entry(2, "a"), entry(3, "b")], 0);
        s.next(0, &openapi).expect("a1");
        s.finish("a", 1, Finish::Dead { blocking: true }, &[], 0);
        assert_eq!(seq(s.next(0, &openapi)), Some(3));
        assert!(s.next(0, &openapi).is_none(), "a is blocked");
        s.unblock("a", 0);
        assert_eq!(seq(s.next(0, &openapi)), Some(2));
    }

    #[test]
    fn an_open_circuit_holds_queues_without_attempts_probes_then_releases_all() {
        let mut s = sched(100);
        let failed_at = |s: &mut Scheduler, q: &str, n: u64, now| {
            let reached = [("openapi".to_owned(), Reach::Failed)];
            s.finish(
                q,
                n,
                Finish::Retry {
                    state: failed(now + 60_000),
                    not_before: None,
                },
                &reached,
                now,
            )
        };
        s.decided((1..=5).map(|n| entry(n, &format!("q{n}"))).collect(), 0);
        s.next(0, &openapi).expect("q1");
        s.next(0, &openapi).expect("q2");
        assert!(failed_at(&mut s, "q1", 1, 0).is_empty());
        let opened = failed_at(&mut s, "q2", 2, 1);
        assert!(matches!(
            &opened[..],
            [Transition::Opened { failures: 2, .. }]
        ));
        // q3..q5 are due, but the circuit is open: held, not attempted.
        assert!(s.next(2, &openapi).is_none());
        assert_eq!(s.next_wake(), Some(15_001), "the probe's time");
        let probe = s.next(15_001, &openapi).expect("one probe");
        assert!(s.next(15_001, &openapi).is_none(), "only one");
        let reached = [("openapi".to_owned(), Reach::Failed)];
        s.finish(
            &probe.entry.queue,
            probe.entry.seq,
            Finish::Retry {
                state: failed(80_000),
                not_before: None,
            },
            &reached,
            15_002,
        );
        assert!(s.next(20_000, &openapi).is_none());
        let probe = s.next(30_002, &openapi).expect("the next probe");
        let reached = [("openapi".to_owned(), Reach::Answered)];
        let closed = s.finish(
            &probe.entry.queue,
            probe.entry.seq,
            Finish::Done,
            &reached,
            30_003,
        );
        assert!(matches!(&closed[..], [Transition::Closed { .. }]));
        // Every held queue and both delayed ones (q1, q2: backoff reset) are due at once.
        let mut next = Vec::new();
        while let Some(j) = s.next(30_003, &openapi) {
            next.push(j.entry.seq);
        }
        next.sort_unstable();
        assert_eq!(next.len(), 4, "{next:?}");
        assert!(next.contains(&1) && next.contains(&2));
        assert!(!s.breakers.is_open("openapi"));
    }

    #[test]
    fn the_window_holds_its_bound_and_order_holds_across_refills() {
        // A window of 4: 2 per sink. Ten entries of one queue wait in the store.
        let stored: Vec<OutboxEntry> = (1..=10).map(|n| entry(n, "a")).collect();
        let mut s = Scheduler::new(4, Breakers::new(5, Duration::from_secs(15)), 10, Some(10));
        let mut ran = Vec::new();
        let page = |after: Option<u64>, limit: usize| -> Vec<(OutboxEntry, Option<RetryState>)> {
            stored
                .iter()
                .filter(|e| after.is_none_or(|a| e.seq > a))
                .take(limit)
                .map(|e| (e.clone(), None))
                .collect()
        };
        // New decisions arrive while the backlog is in the store: they wait their turn there.
        let mut late = vec![entry(11, "a")];
        loop {
            while let Some((kind, after, limit)) = s.refill() {
                s.refilled(kind, page(after, limit), limit, 0);
            }
            assert!(s.loaded() <= 2, "never more than the sink's window");
            if let Some(e) = late.pop() {
                s.decided(vec![e], 0);
            }
            let Some(job) = s.next(0, &openapi) else {
                break;
            };
            ran.push(job.entry.seq);
            s.finish("a", job.entry.seq, Finish::Done, &[], 0);
            if job.entry.seq == 10 {
                // 11 is durable in the store now, where the cursor reads it.
                s.refilled(SinkKind::OpenApi, vec![(entry(11, "a"), None)], PAGE, 0);
            }
        }
        assert_eq!(ran, (1..=11).collect::<Vec<_>>());
        assert_eq!(s.depth(), 0);
    }

    #[test]
    fn a_sink_s_backlog_does_not_starve_the_other() {
        let mut stored: Vec<OutboxEntry> = (1..=20).map(|n| entry(n, &format!("c{n}"))).collect();
        let mut hd = entry(21, "helpdesk:c1");
        hd.action = Action::NotifyHelpdesk {
            conversation_id: ConversationId::new("c1"),
            kind: "handoff.requested".into(),
            reason: None,
            payload: serde_json::Value::Null,
        };
        stored.push(hd);
        let mut s = Scheduler::new(4, Breakers::new(1, Duration::from_secs(15)), 21, Some(21));
        let page = |after: Option<u64>, limit: usize| -> Vec<(OutboxEntry, Option<RetryState>)> {
            stored
                .iter()
                .filter(|e| after.is_none_or(|a| e.seq > a))
                .take(limit)
                .map(|e| (e.clone(), None))
                .collect()
        };
        while let Some((kind, after, limit)) = s.refill() {
            s.refilled(kind, page(after, limit), limit, 0);
        }
        let dests = |e: &OutboxEntry| match SinkKind::of(e) {
            SinkKind::OpenApi => vec!["openapi".to_owned()],
            SinkKind::Helpdesk => vec!["helpdesk:desk".to_owned()],
        };
        // The Open API is down: its circuit opens on the first failure.
        let first = s.next(0, &dests).expect("first");
        let reached = [("openapi".to_owned(), Reach::Failed)];
        s.finish(
            &first.entry.queue,
            first.entry.seq,
            Finish::Retry {
                state: failed(60_000),
                not_before: None,
            },
            &reached,
            0,
        );
        let next = s.next(1, &dests).expect("the help-desk event goes");
        assert_eq!(next.entry.seq, 21);
        assert!(s.loaded() <= 4);
    }

    #[test]
    fn an_open_help_desk_endpoint_does_not_hold_back_the_others() {
        let mut s = sched(100);
        let mut e = entry(1, "helpdesk:c1");
        e.action = Action::NotifyHelpdesk {
            conversation_id: ConversationId::new("c1"),
            kind: "handoff.requested".into(),
            reason: None,
            payload: serde_json::Value::Null,
        };
        s.decided(vec![e], 0);
        let both = |_: &OutboxEntry| vec!["helpdesk:a".to_owned(), "helpdesk:b".to_owned()];
        // Endpoint a failed twice (the threshold) for other events: its circuit is open.
        s.breakers.failure("helpdesk:a", 0);
        s.breakers.failure("helpdesk:a", 0);
        assert!(s.breakers.is_open("helpdesk:a") && !s.breakers.is_open("helpdesk:b"));
        // Still due for b: it goes, to b alone (a waits for its probe).
        let job = s.next(20, &both).expect("b is allowed");
        assert_eq!(job.allowed, ["helpdesk:b"]);
        // b took it; a still needs it: held for a's circuit, no failure counted.
        let only_a = |_: &OutboxEntry| vec!["helpdesk:a".to_owned()];
        let reached = [("helpdesk:b".to_owned(), Reach::Answered)];
        s.finish("helpdesk:c1", 1, Finish::Held(failed(20)), &reached, 20);
        assert!(s.next(21, &only_a).is_none(), "held until a's probe");
        let probe = s.next(15_010, &only_a).expect("a's probe");
        assert_eq!(probe.allowed, ["helpdesk:a"]);
    }

    #[test]
    fn a_hand_over_behind_the_cursor_that_was_never_read_is_loaded_and_a_finished_one_is_not() {
        let mut s = sched(100);
        s.decided(vec![entry(5, "a")], 0);
        let five = s.next(0, &openapi).expect("5");
        s.finish("a", five.entry.seq, Finish::Done, &[], 0);
        // 3 was decided elsewhere (a replay) and handed over after 5.
        s.decided(vec![entry(3, "b")], 0);
        assert_eq!(seq(s.next(0, &openapi)), Some(3));
        // 5's hand-over again (read from the store before it came): not run twice.
        s.decided(vec![entry(5, "a")], 0);
        assert!(s.next(0, &openapi).is_none());
    }
}
