//! Issue 38, part 3: several nodes on one store, in this process: two applications on one
//! in-memory store (`storage::mem::MemStore`, each its own node's handle) and one test clock,
//! the lease judged by that clock. The scenarios are `common::cluster`'s (written for any way of
//! running the nodes); what needs the in-memory store's door (a node's fold commit held in
//! flight while the lease moves on) is here.
//!
//! No real waiting on the lease: the test clock moves the nodes' time, and each move wakes
//! their lease loops; the tests wait on what the nodes answer.

use crate::common::cluster::{self, active, clock_now, view, Nodes};
use crate::common::relay::{
    daemon_env, journal, make_delivery, rules_dir, set_faults, user_message, Ids, ECHO_RULE,
};
use crate::common::{poll_until, Spawn, TestApp};
use std::time::Duration;
use storage::mem::{Held, MemStore};

/// Two nodes on one in-memory store: the first started (and so the active one at first), then
/// the second.
struct MemNodes {
    /// Each node's handle on the store (its door, its epoch).
    handles: Vec<MemStore>,
    apps: Vec<TestApp>,
    _rules: tempfile::TempDir,
}

impl MemNodes {
    fn start() -> MemNodes {
        let rules = tempfile::tempdir().expect("tempdir");
        let dir = rules_dir(rules.path(), ECHO_RULE);
        let shared = MemStore::new();
        let handles = vec![shared.clone(), shared.another_node()];
        let mut apps = Vec::new();
        for (i, handle) in handles.iter().enumerate() {
            let name = format!("node-{}", ["a", "b"][i]);
            let extra = [
                ("HANDOFF_BRIDGE__ADMIN__TEST_CLOCK", "true"),
                ("HANDOFF_BRIDGE__CLUSTER__NODE_ID", name.as_str()),
                (
                    "HANDOFF_BRIDGE_HELPDESK_TOKENS",
                    crate::common::agent_api::TOKEN_NEW,
                ),
            ];
            let opts = Spawn {
                env: daemon_env(&dir, &extra),
                ..Spawn::default()
            };
            apps.push(TestApp::spawn_on(handle.clone(), opts));
            if i == 0 {
                poll_until(
                    "the first node to be active",
                    Duration::from_secs(30),
                    || (view(&apps[0])["role"] == "active").then_some(()),
                );
            }
        }
        MemNodes {
            handles,
            apps,
            _rules: rules,
        }
    }
}

impl Nodes for MemNodes {
    fn count(&self) -> usize {
        self.apps.len()
    }

    fn node(&self, i: usize) -> &TestApp {
        &self.apps[i]
    }

    fn stop_renewing(&self, i: usize) {
        self.handles[i].hold(Held::Lease);
    }

    fn renew_again(&self, i: usize) {
        self.handles[i].let_through(Held::Lease);
    }

    /// One clock for both: moved through the first, the second's loops woken.
    fn advance(&self, by: &str) {
        self.apps[0].advance_clock_unsettled(by);
        for app in &self.apps[1..] {
            app.advance_clock_unsettled("0s");
        }
    }
}

impl Drop for MemNodes {
    /// Held calls go through first: a node stops in order only once its calls return.
    fn drop(&mut self) {
        for handle in &self.handles {
            handle.let_through(Held::Lease);
            handle.let_through(Held::Commits);
        }
    }
}

#[test]
fn every_node_shows_the_one_active_node() {
    cluster::every_node_shows_the_one_active_node(&MemNodes::start());
}

#[test]
fn deliveries_to_every_node_are_folded_once_in_order() {
    cluster::deliveries_to_every_node_are_folded_once_in_order(&MemNodes::start());
}

#[test]
fn an_agent_command_on_a_standby_gets_its_verdict() {
    cluster::an_agent_command_on_a_standby_gets_its_verdict(&MemNodes::start());
}

#[test]
fn a_standby_takes_over_within_the_lease_and_one_renewal() {
    cluster::a_standby_takes_over_within_the_lease_and_one_renewal(&MemNodes::start());
}

/// The active stops renewing, then its lease runs out and the standby takes over.
fn take_over(nodes: &MemNodes, old: usize) -> usize {
    nodes.stop_renewing(old);
    nodes.advance("0s");
    let expires = view(nodes.node(old))["expires_at"]
        .as_i64()
        .expect("expires");
    let now = clock_now(nodes.node(old));
    nodes.advance(&format!("{}ms", (expires - now).max(0) + 4_000));
    let new = active(nodes);
    assert_ne!(new, old, "taken over");
    new
}

/// A fold the old active began before its lease moved on, committed after (its node paused
/// between its reads and its write): the store refuses it and nothing of it lands; the new
/// active folds the event once; the old one comes back as a standby.
#[test]
fn the_old_active_resumed_after_its_lease_ran_out_commits_nothing() {
    let nodes = MemNodes::start();
    let old = active(&nodes);
    nodes.handles[old].hold(Held::Commits);
    let mut ids = Ids::new(0x01d_ac71e);
    let message = user_message(&mut ids, 0, "late", 1_763_690_500_000);
    let (status, answer) = nodes
        .node(old)
        .post(&make_delivery(&mut ids, vec![message]).body);
    assert_eq!(status, 200, "{answer}");
    assert!(
        nodes.handles[old].wait_held(Held::Commits, Duration::from_secs(30)),
        "the old active's fold waits at its commit"
    );
    let errors = nodes.node(old).metric("handoff_dispatch_errors_total");
    let new = take_over(&nodes, old);
    nodes.handles[old].let_through(Held::Commits);
    poll_until(
        "the old active's commit refused",
        Duration::from_secs(30),
        || (nodes.node(old).metric("handoff_dispatch_errors_total") > errors).then_some(()),
    );
    nodes.node(new).settle();
    let (_, state) = nodes.node(new).admin_get(&format!(
        "/admin/v1/conversations/{}",
        crate::common::relay::SEEDED[0].0
    ));
    let user_messages = &state["messages"]["user_messages"];
    assert_eq!(user_messages, 1, "folded once, by the new active: {state}");
    let echoes = journal(nodes.node(new).emulator())
        .into_iter()
        .filter(|e| e.fault.is_none() && e.body.to_string().contains("echo late"))
        .count();
    assert_eq!(echoes, 1, "its action carried out once, by the new active");
    assert!(journal(nodes.node(old).emulator())
        .iter()
        .all(|e| !e.body.to_string().contains("echo late")));
    nodes.renew_again(old);
    nodes.advance("0s");
    poll_until(
        "the old active back as a standby",
        Duration::from_secs(30),
        || {
            (view(nodes.node(old))["role"] == "standby"
                && nodes.node(old).metric("handoff_cluster_role") == 0.0)
                .then_some(())
        },
    );
    assert_eq!(active(&nodes), new);
}

/// An outbox entry whose call was in flight when its active lost the lease is carried out again
/// by the new active, once, with the same idempotency key, and counted as a replay.
#[test]
fn an_entry_in_flight_when_the_active_died_is_replayed_once_and_counted() {
    let nodes = MemNodes::start();
    let old = active(&nodes);
    set_faults(
        nodes.node(old).emulator(),
        serde_json::json!({"hang_next": 1}),
    );
    let mut ids = Ids::new(0x4e91_a7ed);
    let message = user_message(&mut ids, 1, "inflight", 1_763_690_500_000);
    let (status, answer) = nodes
        .node(old)
        .post(&make_delivery(&mut ids, vec![message]).body);
    assert_eq!(status, 200, "{answer}");
    let hung = poll_until("the call in flight", Duration::from_secs(30), || {
        journal(nodes.node(old).emulator())
            .into_iter()
            .find(|e| e.fault.as_deref() == Some("hang"))
    });
    let new = take_over(&nodes, old);
    nodes.node(new).settle();
    let replayed = "handoff_outbox_replayed_total";
    assert_eq!(nodes.node(new).metric(replayed), 1.0, "counted once");
    assert_eq!(nodes.node(old).metric(replayed), 0.0);
    let again: Vec<_> = journal(nodes.node(new).emulator())
        .into_iter()
        .filter(|e| e.fault.is_none() && e.body.to_string().contains("echo inflight"))
        .collect();
    assert_eq!(again.len(), 1, "carried out again once");
    assert_eq!(
        again[0].idempotency_key, hung.idempotency_key,
        "under the same key"
    );
    assert!((200..300).contains(&again[0].status));
    let (status, outbox) = nodes.node(old).admin_get("/admin/v1/outbox");
    assert_eq!(status, 200);
    assert_eq!(
        outbox["entries"].as_array().map(Vec::len),
        Some(0),
        "{outbox}"
    );
}

#[test]
fn the_actives_work_asked_of_a_standby_is_carried_out_by_the_active() {
    cluster::the_actives_work_asked_of_a_standby_is_carried_out_by_the_active(&MemNodes::start());
}
