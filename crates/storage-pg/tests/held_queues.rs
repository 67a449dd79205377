//! The bot queues an active node's folds hold from one fold session to the next: every standing
//! a session answers from them is the database's, after its own commits, after a retention pass,
//! and after another node folded while this one did not hold the lease. Without
//! `HANDOFF_BRIDGE_TEST_PG_URL` the test says it was skipped and passes.

use engine::batch::WriteSet;
use engine::index::{QueueEntry, QueueSpot};
use std::time::Duration;
use storage::lease::Lease;
use storage::port::{Folds, Retention};
use storage_pg::testing::TestDb;
use storage_pg::PgStore;

const TTL: Duration = Duration::from_secs(10);

fn entry(conversation: &str, since: i64) -> QueueEntry {
    QueueEntry {
        bot: "b1".into(),
        since,
        conversation: conversation.into(),
    }
}

/// A fold session of `store` that commits these joins and leaves.
fn fold(store: &PgStore, joined: Vec<QueueEntry>, left: Vec<QueueEntry>) {
    let mut session = store.begin_fold().expect("begin");
    session
        .waiting_standing("b1", None, &mut std::iter::empty())
        .expect("standing");
    let mut writes = WriteSet::default();
    writes.queue.joined = joined;
    writes.queue.left = left;
    session.commit(writes).expect("commit");
}

/// The queue's length and how many wait before `own` (at `since`), as a session of `store` sees
/// them.
fn standing(store: &PgStore, own: &str, since: i64) -> (usize, usize) {
    let session = store.begin_fold().expect("begin");
    let mut session = session;
    let own = QueueSpot {
        since,
        conversation: own,
    };
    session
        .waiting_standing("b1", Some(own), &mut std::iter::empty())
        .expect("standing")
}

#[test]
fn an_active_nodes_held_queues_answer_as_the_database_after_every_kind_of_change() {
    let Some(db) = TestDb::fresh("queues held across fold sessions") else {
        return;
    };
    let clock = model::clock::Clock::new();
    let a = PgStore::open(&db.options(), clock.clone()).expect("open");
    let b = PgStore::open(&db.options(), clock.clone()).expect("open");
    a.claim("a", TTL).expect("claim");
    b.claim("b", TTL).expect("standby");
    fold(&a, vec![entry("c2", 20), entry("c1", 10)], vec![]);
    assert_eq!(standing(&a, "c3", 30), (2, 2), "its own joins");
    fold(&a, vec![entry("c3", 30)], vec![entry("c1", 10)]);
    assert_eq!(standing(&a, "c3", 30), (2, 1), "its own join and leave");
    // Another node folds while it holds the lease; this one takes it back (a new epoch).
    clock.advance(Duration::from_secs(11));
    b.claim("b", TTL).expect("take over");
    fold(&b, vec![entry("c0", 5)], vec![]);
    clock.advance(Duration::from_secs(11));
    a.claim("a", TTL).expect("take back");
    assert_eq!(standing(&a, "c3", 30), (3, 2), "the other node's join seen");
    // A retention pass forgets them: the states it prunes take their queue entries along.
    db.execute("DELETE FROM waiting WHERE conversation = 'c2'");
    let pass = a.prune_states(0, 10);
    assert!(pass.failed.is_none(), "{:?}", pass.failed);
    assert_eq!(standing(&a, "c3", 30), (2, 1), "read again after the pass");
}
