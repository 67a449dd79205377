//! The lease loop: claims the store's lease for this node every third of `cluster.lease`, and
//! publishes the role that follows. Its timing is [`Plan`]'s, pure (unit-tested):
//!
//! - a claim that holds the lease makes the node active until the claim's sending time plus the
//!   lease, less a tenth of it: the store stamps the lease's end on its own clock when the claim
//!   arrives, so a node that goes by its own clock from before it sent the claim stops first;
//! - the next claim is a third of the lease after the last was sent; after a failure, a tenth;
//! - when that end passes before a claim succeeds (the store unreachable, slow, or the node
//!   paused), the node steps down by itself, not waiting for the store's answer;
//! - a standby claims every third of the lease too, so it takes over within the lease and one
//!   renewal after the active's last renewal.
//!
//! Times are the daemon's clock (the test clock moves it, and wakes the loop).

use super::{Cluster, Role, RoleSender};
use crate::ops::metrics::Metrics;
use model::webhook::model::Millis;
use std::time::Duration;
use storage::lease::LeaseState;
use storage::StoreError;
use tokio::sync::watch;

/// The loop's intervals, from the lease's length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timing {
    lease: Millis,
}

impl Timing {
    pub(crate) fn of(lease: Duration) -> Timing {
        Timing {
            lease: Millis::try_from(lease.as_millis()).unwrap_or(Millis::MAX),
        }
    }

    /// Between claims.
    fn every(self) -> Millis {
        (self.lease / 3).max(1)
    }

    /// Before its lease's end, a node stops acting as the active one.
    fn margin(self) -> Millis {
        self.lease / 10
    }

    /// After a failed claim, the next.
    fn retry(self) -> Millis {
        (self.lease / 10).max(1)
    }
}

/// What a claim found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Found {
    /// This node holds the lease.
    Held,
    /// Another node does.
    Other,
    /// The store did not answer, or failed.
    Failed,
}

/// What the loop does next: when it claims again, and until when this node acts as the active
/// one (`None`: it does not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub next_claim: Millis,
    pub active_until: Option<Millis>,
}

impl Plan {
    /// At the start: a standby that claims at once.
    pub(crate) fn start(now: Millis) -> Plan {
        Plan {
            next_claim: now,
            active_until: None,
        }
    }

    /// After a claim sent at `sent` found `found`.
    pub(crate) fn after(self, timing: Timing, sent: Millis, found: Found) -> Plan {
        match found {
            Found::Held => Plan {
                next_claim: sent.saturating_add(timing.every()),
                active_until: Some(
                    sent.saturating_add(timing.lease)
                        .saturating_sub(timing.margin()),
                ),
            },
            Found::Other => Plan {
                next_claim: sent.saturating_add(timing.every()),
                active_until: None,
            },
            Found::Failed => Plan {
                next_claim: sent.saturating_add(timing.retry()),
                active_until: self.active_until,
            },
        }
    }

    /// This node's role at `now`.
    pub(crate) fn role(self, now: Millis) -> Role {
        match self.active_until.is_some_and(|until| now < until) {
            true => Role::Active,
            false => Role::Standby,
        }
    }

    /// When the loop must look again after `now`: the next claim, or the step-down before it.
    pub(crate) fn wake_at(self, now: Millis) -> Millis {
        match self.active_until.filter(|until| *until > now) {
            Some(until) => until.min(self.next_claim),
            None => self.next_claim,
        }
    }
}

/// The loop's state: the cluster it serves, where it publishes the role, its metrics.
pub(crate) struct LeaseLoop {
    cluster: Cluster,
    role: RoleSender,
    metrics: Metrics,
    timing: Timing,
}

/// Longest sleep between looks (a clock that steps is noticed this late at most).
const MAX_SLEEP: Duration = Duration::from_secs(1);

/// How long to sleep from `now` until `at` (daemon time), at most [`MAX_SLEEP`].
fn until(now: Millis, at: Millis) -> Duration {
    let ms = u64::try_from(at.saturating_sub(now)).unwrap_or(0);
    Duration::from_millis(ms).min(MAX_SLEEP)
}

impl LeaseLoop {
    pub(crate) fn new(cluster: Cluster, role: RoleSender, metrics: Metrics) -> Self {
        let timing = Timing::of(cluster.inner.settings.lease);
        LeaseLoop {
            cluster,
            role,
            metrics,
            timing,
        }
    }

    fn now(&self) -> Millis {
        self.cluster.inner.store.clock().now_millis()
    }

    /// Claim, publish, wait, until `stop` turns true (the daemon stops; the root releases the
    /// lease once the active's work has stopped).
    pub(crate) async fn run(self, mut stop: watch::Receiver<bool>) {
        let mut plan = Plan::start(self.now());
        loop {
            if self.wait_for_claim(plan, &mut stop).await.is_none() {
                return;
            }
            let sent = self.now();
            let Some(claimed) = self.claim(plan, &mut stop).await else {
                return;
            };
            let found = self.found(claimed);
            plan = plan.after(self.timing, sent, found);
            self.publish(plan.role(self.now()));
        }
    }

    /// Until the next claim is due, stepping down meanwhile if the lease's end passes; `None`
    /// when the daemon stops.
    async fn wait_for_claim(&self, plan: Plan, stop: &mut watch::Receiver<bool>) -> Option<()> {
        loop {
            let now = self.now();
            self.publish(plan.role(now));
            if now >= plan.next_claim {
                return Some(());
            }
            tokio::select! {
                () = tokio::time::sleep(until(now, plan.wake_at(now))) => {}
                () = self.cluster.inner.wake.notified() => {}
                changed = stop.changed() => if changed.is_err() || *stop.borrow() { return None },
            }
        }
    }

    /// One claim (the claim and a heartbeat, off the runtime's threads), stepping down while it
    /// is under way if the lease's end passes first; `None` when the daemon stops.
    async fn claim(
        &self,
        plan: Plan,
        stop: &mut watch::Receiver<bool>,
    ) -> Option<Result<LeaseState, StoreError>> {
        let inner = &self.cluster.inner;
        let (store, node, ttl) = (
            inner.store.clone(),
            inner.settings.node_id.clone(),
            inner.settings.lease,
        );
        // Seen once the claim is answered: a node seen at a time has claimed by then.
        let mut claim = tokio::task::spawn_blocking(move || {
            let lease = store.claim(&node, ttl)?;
            store.note_seen(&node)?;
            Ok(lease)
        });
        loop {
            let now = self.now();
            self.publish(plan.role(now));
            let step_down = plan.active_until.filter(|until| *until > now);
            tokio::select! {
                joined = &mut claim => {
                    return Some(joined.unwrap_or_else(|e| Err(StoreError::Internal(e.to_string()))));
                }
                () = tokio::time::sleep(until(now, step_down.unwrap_or(now))), if step_down.is_some() => {}
                () = inner.wake.notified() => {}
                changed = stop.changed() => if changed.is_err() || *stop.borrow() { return None },
            }
        }
    }

    /// What a claim found, logged when it failed.
    fn found(&self, claimed: Result<LeaseState, StoreError>) -> Found {
        match claimed {
            Ok(lease) if lease.holder.as_deref() == Some(self.cluster.node_id()) => {
                self.metrics
                    .lease_epoch
                    .set(i64::try_from(lease.epoch).unwrap_or(i64::MAX));
                Found::Held
            }
            Ok(lease) => {
                self.metrics
                    .lease_epoch
                    .set(i64::try_from(lease.epoch).unwrap_or(i64::MAX));
                Found::Other
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot claim the lease; trying again");
                Found::Failed
            }
        }
    }

    /// Publish `role`, logged when it changes.
    fn publish(&self, role: Role) {
        if !self.role.publish(role) {
            return;
        }
        self.metrics
            .cluster_role
            .set(i64::from(role == Role::Active));
        let node_id = self.cluster.node_id();
        let epoch = self.cluster.inner.store.held_epoch();
        match role {
            Role::Active => tracing::info!(
                %node_id,
                epoch,
                "this node holds the lease: it is the active one (folds, timers, outbox, passes)"
            ),
            Role::Standby => tracing::warn!(
                %node_id,
                "this node does not hold the lease (another node took it, or it could not renew \
                 in time): it stands by, taking intake and serving reads"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Millis = 10_000;

    fn timing() -> Timing {
        Timing::of(Duration::from_millis(LEASE as u64))
    }

    #[test]
    fn a_held_claim_renews_every_third_and_acts_until_the_lease_less_a_tenth() {
        let plan = Plan::start(0).after(timing(), 1_000, Found::Held);
        assert_eq!(plan.next_claim, 1_000 + LEASE / 3);
        assert_eq!(plan.active_until, Some(1_000 + LEASE - LEASE / 10));
        assert_eq!(plan.role(1_000), Role::Active);
        assert_eq!(plan.role(1_000 + LEASE - LEASE / 10), Role::Standby);
        assert_eq!(
            plan.wake_at(2_000),
            plan.next_claim,
            "the renewal comes first"
        );
    }

    #[test]
    fn a_failed_renewal_tries_again_sooner_and_steps_down_at_the_leases_end() {
        let held = Plan::start(0).after(timing(), 0, Found::Held);
        let failed = held.after(timing(), held.next_claim, Found::Failed);
        assert_eq!(failed.next_claim, held.next_claim + LEASE / 10);
        assert_eq!(
            failed.active_until, held.active_until,
            "it keeps acting until then"
        );
        // Failing on, it steps down at its end, whatever the store says later.
        let mut plan = failed;
        while plan.next_claim < LEASE {
            plan = plan.after(timing(), plan.next_claim, Found::Failed);
        }
        let end = held.active_until.expect("held");
        assert_eq!(plan.role(end - 1), Role::Active);
        assert_eq!(plan.role(end), Role::Standby);
        assert_eq!(plan.wake_at(end - 500), end.min(plan.next_claim));
    }

    #[test]
    fn another_holder_makes_a_standby_that_claims_every_third() {
        let plan = Plan::start(0).after(timing(), 0, Found::Held);
        let lost = plan.after(timing(), plan.next_claim, Found::Other);
        assert_eq!(lost.role(plan.next_claim), Role::Standby, "at once");
        assert_eq!(lost.next_claim, plan.next_claim + LEASE / 3);
        assert_eq!(lost.wake_at(plan.next_claim), lost.next_claim);
    }

    /// The store's view: the active's last renewal at `renewed` holds the lease for `LEASE` on
    /// its clock; a standby claiming from `start` on, every third of the lease, takes over
    /// within the lease and one renewal of that renewal, and the old active has stood down
    /// before.
    #[test]
    fn a_standby_takes_over_within_the_lease_and_one_renewal_after_the_last_renewal() {
        for (renewed, start) in [(0, 0), (0, 3_000), (2_500, 100), (7_000, 9_999)] {
            let expires = renewed + LEASE;
            let store = |now: Millis| match now >= expires {
                true => Found::Held,
                false => Found::Other,
            };
            let mut plan = Plan::start(start);
            let mut now = start;
            while plan.role(now) == Role::Standby {
                now = plan.next_claim;
                plan = plan.after(timing(), now, store(now));
            }
            assert!(now >= expires, "never before the lease ran out");
            assert!(
                now <= expires + LEASE / 3,
                "{renewed} {start}: took over at {now}"
            );
            let old = Plan::start(0).after(timing(), renewed, Found::Held);
            assert_eq!(
                old.role(now),
                Role::Standby,
                "the old active stood down first"
            );
        }
    }
}
