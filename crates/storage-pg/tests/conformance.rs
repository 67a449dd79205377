//! The storage port's conformance suite on PostgreSQL: a fresh schema per test, reopened by
//! dropping every handle and connecting again, a commit failed on purpose. Without
//! `HANDOFF_BRIDGE_TEST_PG_URL` each test says it was skipped and passes.

use std::sync::Arc;
use storage::conformance::Subject;
use storage::port::Writer;
use storage::writer::WriterHooks;
use storage::Store;
use storage_pg::testing::TestDb;
use storage_pg::{PgStore, PgWriter};

struct PgSubject {
    db: TestDb,
    store: Option<PgStore>,
    /// Every node's clock (the test moves it: the lease's times follow its offset).
    clock: model::clock::Clock,
    /// Fold sessions ask the database for every queue standing (the path of long queues).
    unheld: bool,
}

impl PgSubject {
    fn made() -> Option<Box<dyn Subject>> {
        Self::with("the PostgreSQL conformance suite", false)
    }

    /// The suite again with no bot queue held in a fold session's memory.
    fn unheld() -> Option<Box<dyn Subject>> {
        Self::with("the PostgreSQL conformance suite, queues unheld", true)
    }

    fn with(what: &str, unheld: bool) -> Option<Box<dyn Subject>> {
        let db = TestDb::fresh(what)?;
        let clock = model::clock::Clock::new();
        let mut subject = PgSubject {
            db,
            store: None,
            clock,
            unheld,
        };
        subject.store = Some(subject.open());
        Some(Box::new(subject))
    }

    fn open(&self) -> PgStore {
        let store = PgStore::open(&self.db.options(), self.clock.clone()).expect("open");
        if self.unheld {
            store.hold_queues_up_to(0);
        }
        store
    }

    fn pg(&self) -> PgStore {
        self.store.clone().expect("open")
    }
}

impl Subject for PgSubject {
    fn store(&self) -> Store {
        Arc::new(self.pg())
    }

    fn writer(&self) -> Writer {
        let hooks = WriterHooks {
            observe: Box::new(|_, _| {}),
            durable: Box::new(|_, _| {}),
        };
        PgWriter::start(self.pg(), hooks).expect("writer")
    }

    fn reopen(&mut self) -> bool {
        self.store = None;
        self.store = Some(self.open());
        true
    }

    /// Another process on the same schema, on the same clock.
    fn another_node(&self) -> Option<Store> {
        Some(Arc::new(self.open()))
    }

    fn fail_next_commit(&mut self) -> bool {
        self.pg().fail_next_commit();
        true
    }
}

storage::conformance_tests!(postgres, optional crate::PgSubject::made());
storage::conformance_tests!(postgres_unheld, optional crate::PgSubject::unheld());
