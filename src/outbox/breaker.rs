//! A circuit breaker per destination (`openapi`, `helpdesk:<endpoint>`), as data: after
//! `outbox.breaker.failures` consecutive transient failures it opens; while open no call goes to
//! the destination but one probe at most every `probe_interval`; an answer to the probe (any
//! answer that shows the destination works: a success or a permanent refusal) closes it. Pure:
//! the scheduler asks it and tells it what happened, at the daemon times it passes.

use model::webhook::model::Millis;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// What the breaker lets a call do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Closed: go.
    Go,
    /// Open, and this call is the probe.
    Probe,
    /// Open: wait (nothing is called, nothing counted).
    Wait,
}

/// A change of a circuit, for the log and the gauge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transition {
    Opened {
        destination: String,
        failures: u32,
    },
    Closed {
        destination: String,
        open_for: Duration,
    },
}

/// One destination's circuit as `/readyz` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CircuitView {
    pub open: bool,
    /// Daemon time it opened.
    pub since: Option<Millis>,
    pub consecutive_failures: u32,
}

#[derive(Clone, Debug, Default)]
struct Circuit {
    failures: u32,
    open_since: Option<Millis>,
    /// When the last probe went (or the circuit opened).
    last_probe_at: Millis,
    probing: bool,
}

pub struct Breakers {
    threshold: u32,
    probe_interval: Millis,
    circuits: BTreeMap<String, Circuit>,
}

impl Breakers {
    pub fn new(threshold: u32, probe_interval: Duration) -> Self {
        Breakers {
            threshold: threshold.max(1),
            probe_interval: super::backoff::millis(probe_interval),
            circuits: BTreeMap::new(),
        }
    }

    /// Show `destination` (closed) before anything was sent to it.
    pub fn known(&mut self, destination: &str) {
        self.circuits.entry(destination.to_owned()).or_default();
    }

    pub fn is_open(&self, destination: &str) -> bool {
        self.circuits
            .get(destination)
            .is_some_and(|c| c.open_since.is_some())
    }

    /// May a call go to `destination` at `now`? A `Probe` is taken: no other probe goes until
    /// it is reported ([`success`](Self::success), [`failure`](Self::failure) or
    /// [`release`](Self::release)) and `probe_interval` has passed.
    pub fn admit(&mut self, destination: &str, now: Millis) -> Admit {
        let interval = self.probe_interval;
        let c = self.circuits.entry(destination.to_owned()).or_default();
        if c.open_since.is_none() {
            return Admit::Go;
        }
        if c.probing || now < c.last_probe_at.saturating_add(interval) {
            return Admit::Wait;
        }
        c.probing = true;
        c.last_probe_at = now;
        Admit::Probe
    }

    /// When the next probe of an open `destination` may go (`None`: closed, or probing now).
    pub fn probe_at(&self, destination: &str) -> Option<Millis> {
        let c = self.circuits.get(destination)?;
        c.open_since?;
        (!c.probing).then(|| c.last_probe_at.saturating_add(self.probe_interval))
    }

    /// The destination answered (a success, or a refusal that shows it works).
    pub fn success(&mut self, destination: &str, now: Millis) -> Option<Transition> {
        let c = self.circuits.entry(destination.to_owned()).or_default();
        c.failures = 0;
        c.probing = false;
        let since = c.open_since.take()?;
        Some(Transition::Closed {
            destination: destination.to_owned(),
            open_for: Duration::from_millis(u64::try_from(now - since).unwrap_or(0)),
        })
    }

    /// A transient failure (connect, TLS, timeout, 408, 425, 429, 5xx).
    pub fn failure(&mut self, destination: &str, now: Millis) -> Option<Transition> {
        let threshold = self.threshold;
        let c = self.circuits.entry(destination.to_owned()).or_default();
        c.failures = c.failures.saturating_add(1);
        if c.open_since.is_some() {
            if c.probing {
                // The probe failed: the next one after a whole interval.
                c.probing = false;
                c.last_probe_at = now;
            }
            return None;
        }
        if c.failures < threshold {
            return None;
        }
        c.open_since = Some(now);
        c.last_probe_at = now;
        c.probing = false;
        Some(Transition::Opened {
            destination: destination.to_owned(),
            failures: c.failures,
        })
    }

    /// No probe of an open `destination` before `at` (it asked for a wait: `Retry-After`).
    pub fn defer(&mut self, destination: &str, at: Millis) {
        let interval = self.probe_interval;
        if let Some(c) = self.circuits.get_mut(destination) {
            if c.open_since.is_some() {
                c.last_probe_at = c.last_probe_at.max(at.saturating_sub(interval));
            }
        }
    }

    /// A probe that reached nothing (the sink stopped before calling): another may go.
    pub fn release(&mut self, destination: &str) {
        if let Some(c) = self.circuits.get_mut(destination) {
            if c.probing {
                c.probing = false;
                c.last_probe_at = c.last_probe_at.saturating_sub(self.probe_interval);
            }
        }
    }

    pub fn views(&self) -> BTreeMap<String, CircuitView> {
        self.circuits
            .iter()
            .map(|(d, c)| {
                let view = CircuitView {
                    open: c.open_since.is_some(),
                    since: c.open_since,
                    consecutive_failures: c.failures,
                };
                (d.clone(), view)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_n_failures_in_a_row_probes_every_interval_and_closes_on_success() {
        let mut b = Breakers::new(3, Duration::from_secs(15));
        let d = "openapi";
        assert_eq!(b.admit(d, 0), Admit::Go);
        assert_eq!(b.failure(d, 0), None);
        assert_eq!(b.failure(d, 1), None);
        assert_eq!(b.success(d, 2), None, "a success resets the count");
        assert_eq!(b.failure(d, 3), None);
        assert_eq!(b.failure(d, 4), None);
        assert_eq!(
            b.failure(d, 5),
            Some(Transition::Opened {
                destination: d.into(),
                failures: 3
            })
        );
        assert!(b.is_open(d));
        assert_eq!(b.admit(d, 6), Admit::Wait, "no calls while open");
        assert_eq!(b.probe_at(d), Some(15_005));
        assert_eq!(b.admit(d, 15_004), Admit::Wait);
        assert_eq!(b.admit(d, 15_005), Admit::Probe);
        assert_eq!(b.admit(d, 15_006), Admit::Wait, "one probe at a time");
        assert_eq!(b.probe_at(d), None, "probing");
        assert_eq!(b.failure(d, 15_100), None, "a failed probe keeps it open");
        assert_eq!(b.admit(d, 20_000), Admit::Wait);
        assert_eq!(
            b.probe_at(d),
            Some(30_100),
            "a whole interval after the failed probe"
        );
        assert_eq!(b.admit(d, 30_100), Admit::Probe);
        b.release(d);
        assert_eq!(
            b.admit(d, 30_101),
            Admit::Probe,
            "a probe that reached nothing"
        );
        assert_eq!(b.failure(d, 30_102), None);
        b.defer(d, 90_000);
        assert_eq!(
            b.probe_at(d),
            Some(90_000),
            "a Retry-After defers the probe"
        );
        assert_eq!(b.admit(d, 89_999), Admit::Wait);
        b.defer(d, 1);
        assert_eq!(b.probe_at(d), Some(90_000), "never earlier");
        assert_eq!(b.admit(d, 90_000), Admit::Probe);
        assert_eq!(
            b.success(d, 95_005),
            Some(Transition::Closed {
                destination: d.into(),
                open_for: Duration::from_secs(95)
            })
        );
        assert_eq!(b.admit(d, 95_006), Admit::Go);
        let views = b.views();
        assert_eq!(views[d], CircuitView::default());
    }

    #[test]
    fn destinations_are_independent() {
        let mut b = Breakers::new(1, Duration::from_secs(15));
        b.known("helpdesk:b");
        assert!(b.failure("helpdesk:a", 0).is_some());
        assert_eq!(b.admit("helpdesk:a", 1), Admit::Wait);
        assert_eq!(b.admit("helpdesk:b", 1), Admit::Go);
        let views = b.views();
        assert!(views["helpdesk:a"].open && views["helpdesk:a"].since == Some(0));
        assert!(!views["helpdesk:b"].open);
    }
}
