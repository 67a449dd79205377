//! Numbers drawn from a sequence commit out of order unless something orders them: the crate's
//! docs say what does (the events lock, the serialised folds). Two stores on one schema (two
//! processes, as far as the database knows: their in-process locks are not shared) write at once
//! while a reader keeps reading; every number below the highest a read saw that ever commits
//! must have been in that read.

use model::webhook::parse_delivery;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use storage::port::*;
use storage::test_support::{delivery, one_message_rule};
use storage::Position;
use storage_pg::testing::TestDb;
use storage_pg::PgStore;

const ROUNDS: usize = 40;

/// Accept one event of a conversation of its own, then fold everything pending.
fn write_and_fold(store: &PgStore, writer: usize, round: usize) {
    let (d, e, c) = (
        format!("d{writer}-{round}"),
        format!("e{writer}-{round}"),
        format!("c{writer}-{round}"),
    );
    let parsed = parse_delivery(&delivery(&d, &[(&e, &c, 1)])).expect("delivery");
    store
        .accept(&parsed.id, &parsed.events, 1_000)
        .expect("accept");
    let pending = store.pending().expect("pending");
    let mut events = Vec::new();
    let mut partitions = Vec::new();
    for p in &pending.events {
        let record = store.event_at(p.seq, p.at).expect("read").expect("event");
        let event = model::webhook::parse_event(record.event.get()).expect("parse");
        events.push((p.seq, event));
        partitions.push(p.partition.clone());
    }
    let rules = one_message_rule("greet");
    store
        .fold(&events, &partitions, &rules, &[], &Position::default())
        .expect("fold");
}

fn numbers(db: &storage_pg::testing::Reader, query: &str) -> BTreeSet<u64> {
    db.numbers(query).into_iter().map(|n| n as u64).collect()
}

/// Every number of `all` at or below the highest of `seen` is in `seen`.
fn no_hole(seen: &BTreeSet<u64>, all: &BTreeSet<u64>, what: &str) {
    let Some(high) = seen.last() else { return };
    let missed: Vec<&u64> = all.range(..=high).filter(|n| !seen.contains(n)).collect();
    assert!(
        missed.is_empty(),
        "{what}: a read saw {high} but not {missed:?}, committed later"
    );
}

#[test]
fn readers_never_pass_a_number_that_commits_later() {
    let Some(db) = TestDb::fresh("commit order") else {
        return;
    };
    let open = || PgStore::open(&db.options(), model::clock::Clock::new()).expect("open");
    let stores = [open(), open()];
    let reader = db.reader();
    let stop = Arc::new(AtomicBool::new(false));
    let mut reads: Vec<(BTreeSet<u64>, BTreeSet<u64>)> = Vec::new();
    std::thread::scope(|scope| {
        let writers: Vec<_> = stores
            .iter()
            .enumerate()
            .map(|(i, store)| {
                scope.spawn(move || (0..ROUNDS).for_each(|r| write_and_fold(store, i, r)))
            })
            .collect();
        let stopping = stop.clone();
        scope.spawn(move || {
            for w in writers {
                w.join().expect("writer");
            }
            stopping.store(true, Ordering::SeqCst);
        });
        while !stop.load(Ordering::SeqCst) {
            // Each read one snapshot.
            let events = numbers(&reader, "SELECT seq FROM events");
            let outbox = numbers(&reader, "SELECT seq FROM outbox");
            reads.push((events, outbox));
        }
    });
    let events = numbers(&reader, "SELECT seq FROM events");
    let outbox = numbers(&reader, "SELECT seq FROM outbox");
    assert_eq!(
        (events.len(), outbox.len()),
        (2 * ROUNDS, 2 * ROUNDS),
        "every event stored, every action decided once"
    );
    assert!(reads.len() > 2, "the reader read while they wrote");
    for (seen_events, seen_outbox) in &reads {
        no_hole(seen_events, &events, "events");
        no_hole(seen_outbox, &outbox, "outbox");
    }
}
