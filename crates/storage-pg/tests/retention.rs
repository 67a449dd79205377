//! Retention on a store whose pass is longer than one port call may wait (issue 38: a pruning
//! pass answered 500 on 1,000,000 conversations): every chunk is a call of its own, so the pass
//! finishes, and it still keeps what the folds and the dedupe window need. The store's call
//! timeout and chunk are lowered to make a small store that large. Without
//! `HANDOFF_BRIDGE_TEST_PG_URL` the test says it was skipped and passes.

use model::cursor::Cursor;
use std::time::Duration;
use storage::port::Retention;
use storage_pg::testing::TestDb;
use storage_pg::PgStore;

/// Events (and deliveries, one per ten events) written straight into the tables.
const EVENTS: i64 = 20_000;
/// The folds' watermark: events from it on are still to fold, kept whatever their age.
const FOLD_FROM: i64 = 15_001;
/// Rows a chunk removes: 1,500 chunks of events, 200 of deliveries.
const CHUNK: i64 = 10;
/// Far longer than one chunk's transaction (a few ms, even on a busy CI machine), shorter than
/// 1,700 of them.
const CALL_TIMEOUT: Duration = Duration::from_secs(1);

fn count(reader: &storage_pg::testing::Reader, query: &str) -> i64 {
    reader.numbers(query).first().copied().unwrap_or(-1)
}

#[test]
fn a_pass_longer_than_a_call_finishes_and_keeps_what_is_needed() {
    let Some(db) = TestDb::fresh("retention in chunks") else {
        return;
    };
    let store = PgStore::open(&db.options(), model::clock::Clock::new()).expect("open");
    db.execute(&format!(
        "INSERT INTO events (seq, id, delivery, received_at, partition, kind, body) \
         SELECT g, 'e' || g, 'd' || (g / 10), 1000 + g, 'c:c' || (g % 997), 'message', '{{}}' \
         FROM generate_series(1, {EVENTS}) g; \
         INSERT INTO deliveries (id, received_at) \
         SELECT 'd' || g, 1000 + 10 * g FROM generate_series(0, {EVENTS} / 10) g"
    ));
    store.set_delete_chunk(CHUNK);
    store.set_call_timeout(CALL_TIMEOUT);
    // Everything is past both retentions (received at 1,001 to 21,000, the bounds 1,000,000).
    let pruned = store
        .prune_events(1_000_000, 1_000_000, Cursor::from_raw(FOLD_FROM as u128))
        .expect("a pass of many chunks, each within the call's time");
    let reader = db.reader();
    let deliveries = EVENTS / 10 + 1;
    assert_eq!(count(&reader, "SELECT count(*) FROM deliveries"), 0);
    assert_eq!(
        count(&reader, "SELECT min(seq) FROM events"),
        FOLD_FROM,
        "every event still to fold is kept, every folded one removed"
    );
    assert_eq!(
        count(&reader, "SELECT count(*) FROM events"),
        EVENTS - FOLD_FROM + 1
    );
    assert_eq!(pruned.event_chunks, (FOLD_FROM - 1) as u64);
    assert_eq!(pruned.ids_forgotten, (FOLD_FROM - 1 + deliveries) as u64);
}

#[test]
fn the_dedupe_window_holds_back_events_and_deliveries() {
    let Some(db) = TestDb::fresh("retention in chunks, dedupe window") else {
        return;
    };
    let store = PgStore::open(&db.options(), model::clock::Clock::new()).expect("open");
    db.execute(
        "INSERT INTO events (seq, id, delivery, received_at, partition, kind, body) \
         SELECT g, 'e' || g, 'd' || g, 1000 + g, 'c:c' || (g % 7), 'message', '{}' \
         FROM generate_series(1, 100) g; \
         INSERT INTO deliveries (id, received_at) SELECT 'd' || g, 1000 + g \
         FROM generate_series(1, 100) g",
    );
    store.set_delete_chunk(7);
    // Events past their retention, all folded, but the dedupe window starts at 1,041.
    let pruned = store
        .prune_events(1_041, 1_000_000, Cursor::from_raw(1_000))
        .expect("pass");
    let reader = db.reader();
    assert_eq!(count(&reader, "SELECT min(seq) FROM events"), 41);
    assert_eq!(
        count(&reader, "SELECT min(received_at) FROM deliveries"),
        1_041
    );
    assert_eq!(pruned.ids_forgotten, 80);
}
