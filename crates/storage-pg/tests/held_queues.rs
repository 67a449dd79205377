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
    entry_of("b1", conversation, since)
}

fn entry_of(bot: &str, conversation: &str, since: i64) -> QueueEntry {
    QueueEntry {
        bot: bot.into(),
        since,
        conversation: conversation.into(),
    }
}

/// A fold session of `store` that reads the standing of the first entry's bot (b1 without
/// entries), then commits these joins and leaves.
fn fold(store: &PgStore, joined: Vec<QueueEntry>, left: Vec<QueueEntry>) {
    let mut session = store.begin_fold().expect("begin");
    let bot = joined
        .iter()
        .chain(&left)
        .next()
        .map_or("b1", |e| e.bot.as_str());
    session
        .waiting_standing(bot, None, &mut std::iter::empty())
        .expect("standing");
    let mut writes = WriteSet::default();
    writes.queue.joined = joined;
    writes.queue.left = left;
    session.commit(writes).expect("commit");
}

/// The queue's length and how many wait before `own` (at `since`), as a session of `store` sees
/// them.
fn standing(store: &PgStore, own: &str, since: i64) -> (usize, usize) {
    standing_of(store, "b1", own, since)
}

fn standing_of(store: &PgStore, bot: &str, own: &str, since: i64) -> (usize, usize) {
    let session = store.begin_fold().expect("begin");
    let mut session = session;
    let own = QueueSpot {
        since,
        conversation: own,
    };
    session
        .waiting_standing(bot, Some(own), &mut std::iter::empty())
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

#[test]
fn queues_beyond_what_the_folds_hold_answer_as_the_database_too() {
    let Some(db) = TestDb::fresh("queues beyond the held budget") else {
        return;
    };
    let clock = model::clock::Clock::new();
    let a = PgStore::open(&db.options(), clock.clone()).expect("open");
    a.claim("a", TTL).expect("claim");
    a.hold_queues_up_to(3);
    let join = |bot: &str, conversations: &[(&str, i64)]| {
        let joined = conversations
            .iter()
            .map(|(c, since)| entry_of(bot, c, *since))
            .collect();
        fold(&a, joined, vec![]);
    };
    join("b1", &[("c1", 10), ("c2", 20)]);
    assert_eq!(standing_of(&a, "b1", "c2", 20), (2, 1), "held");
    join("b2", &[("d1", 10), ("d2", 20)]);
    assert_eq!(
        standing_of(&a, "b2", "d3", 30),
        (2, 2),
        "no room: counted by the database"
    );
    join("b1", &[("c3", 30), ("c4", 40)]);
    assert_eq!(
        standing_of(&a, "b1", "c4", 40),
        (4, 3),
        "grown past the budget, let go"
    );
    fold(&a, vec![], vec![entry_of("b2", "d1", 10)]);
    assert_eq!(standing_of(&a, "b2", "d2", 20), (1, 0));
    assert_eq!(standing_of(&a, "b1", "c1", 10), (4, 0));
}
