-- Schema 2: changes to the counters of `meta` (conversations, end users, bots, quarantine,
-- timers, outbox) as rows of their own, added to `meta` when read and folded into it by the fold
-- transactions (`outbox::compact_counts`). Before, every transaction that changed a count updated
-- its row of `meta`: the executor's outcome of each outbox entry and every fold waited on one hot
-- row, each for the commit (and its WAL flush) of the one before (issue 38's benchmark: 90
-- handoffs/s at 100 asked, the time of that UPDATE mostly its lock wait).
CREATE TABLE meta_delta (id bigserial PRIMARY KEY, key text COLLATE "C" NOT NULL, delta bigint NOT NULL);
