//! The schema's migrations: a database made by an earlier binary (schema 1) is brought up to
//! this one's at open, its data kept. Without `HANDOFF_BRIDGE_TEST_PG_URL` the test says it was
//! skipped and passes.

use storage::asks::{Ask, Asks};
use storage::port::OperatorLog;
use storage_pg::testing::TestDb;
use storage_pg::PgStore;

#[test]
fn a_schema_1_database_is_migrated_at_open_and_keeps_its_data() {
    let Some(db) = TestDb::fresh("the schema 1 -> 2 migration") else {
        return;
    };
    db.execute(include_str!("../src/schema/1.sql"));
    db.execute(
        "CREATE TABLE schema_version (version integer NOT NULL); \
         INSERT INTO schema_version VALUES (1); \
         INSERT INTO operator_actions (id, at, action) VALUES (nextval('operator_seq'), 5, \
         '{\"at\":5,\"who\":\"Kim\",\"role\":\"operator\",\"what\":\"prune\",\"result\":\"applied\"}')",
    );
    let store = PgStore::open(&db.options(), model::clock::Clock::new()).expect("open");
    let reader = db.reader();
    assert_eq!(
        reader.numbers("SELECT version::bigint FROM schema_version"),
        [i64::from(storage_pg::SCHEMA_VERSION)]
    );
    let kept = store.operator_actions_page(None, 10).expect("read");
    assert_eq!(kept.len(), 1, "schema 1's rows kept");
    assert_eq!(kept[0].1.who, "Kim");
    let id = store.ask(&Ask::Prune, "n1").expect("ask").expect("stored");
    let waiting = store.unanswered(10).expect("unanswered");
    assert_eq!(waiting.iter().map(|a| a.id).collect::<Vec<_>>(), [id]);
}
