//! A fold's transaction begins in one round trip with the lease check written into its text, or,
//! for a node whose name would need quoting, in two with the check's values bound: either way
//! the holder folds and a node whose lease moved on is refused. Without
//! `HANDOFF_BRIDGE_TEST_PG_URL` the test says it was skipped and passes.

use engine::batch::WriteSet;
use std::time::Duration;
use storage::lease::Lease;
use storage::port::Folds;
use storage::StoreError;
use storage_pg::testing::TestDb;
use storage_pg::PgStore;

const TTL: Duration = Duration::from_secs(10);

fn folds(store: &PgStore) -> Result<(), StoreError> {
    let session = store.begin_fold()?;
    session.commit(WriteSet::default()).map(|_| ())
}

#[test]
fn a_fold_begins_for_the_holder_only_whatever_its_nodes_name() {
    let Some(db) = TestDb::fresh("a fold's first round trip") else {
        return;
    };
    let clock = model::clock::Clock::new();
    for (first, second) in [("node-a.eu_1", "node-b"), ("it's a/b", "b c")] {
        let one = PgStore::open(&db.options(), clock.clone()).expect("open");
        let two = PgStore::open(&db.options(), clock.clone()).expect("open");
        one.claim(first, TTL).expect("claim");
        two.claim(second, TTL).expect("standby");
        folds(&one).unwrap_or_else(|e| panic!("{first} holds the lease: {e}"));
        assert!(matches!(folds(&two), Err(StoreError::Fenced)), "{second}");
        clock.advance(Duration::from_secs(11));
        two.claim(second, TTL).expect("take over");
        assert!(matches!(folds(&one), Err(StoreError::Fenced)), "{first}");
        folds(&two).unwrap_or_else(|e| panic!("{second} holds the lease now: {e}"));
        clock.advance(Duration::from_secs(11));
    }
}
