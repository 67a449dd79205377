-- Schema 1 of handoff-bridge's PostgreSQL store (crates/storage-pg). JSON documents are `text`,
-- not `jsonb`: jsonb refuses the escape \u0000 that a user's message may hold, and the store never
-- queries inside them.
-- Text keys sort in byte order (COLLATE "C"), as sled's keys and the port's pages do, whatever the
-- database's locale.

-- Counters the folds (and the groups that change them) keep, so a scrape reads a row: counts,
-- the folds' watermark, the backfill cursor.
CREATE TABLE meta (key text COLLATE "C" PRIMARY KEY, value bigint NOT NULL);
INSERT INTO meta (key, value) VALUES
  ('fold_from', 0), ('conversations', 0), ('end_users', 0), ('bots', 0), ('quarantine', 0),
  ('timers', 0), ('outbox', 0);

-- The event log. Numbers are drawn under the events lock (see the crate's docs), so they
-- commit in order.
CREATE SEQUENCE event_seq;
CREATE TABLE events (
  seq bigint PRIMARY KEY,
  id text COLLATE "C" NOT NULL UNIQUE,
  delivery text COLLATE "C" NOT NULL,
  received_at bigint NOT NULL,
  partition text COLLATE "C" NOT NULL,
  kind text COLLATE "C" NOT NULL,
  body text COLLATE "C" NOT NULL
);
CREATE INDEX events_by_partition ON events (partition, seq);
CREATE INDEX events_by_received ON events (received_at);
CREATE TABLE deliveries (id text COLLATE "C" PRIMARY KEY, received_at bigint NOT NULL);
CREATE INDEX deliveries_by_received ON deliveries (received_at);

-- Each partition's last folded event.
CREATE TABLE folded (partition text COLLATE "C" PRIMARY KEY, mark bigint NOT NULL);

-- States, each with its newest activity (the retention index).
CREATE TABLE conversations (id text COLLATE "C" PRIMARY KEY, activity_at bigint NOT NULL, state text COLLATE "C" NOT NULL);
CREATE INDEX conversations_by_activity ON conversations (activity_at);
CREATE TABLE end_users (
  id text COLLATE "C" PRIMARY KEY,
  activity_at bigint NOT NULL,
  platform text COLLATE "C",
  user_key text COLLATE "C",
  state text COLLATE "C" NOT NULL
);
CREATE INDEX end_users_by_activity ON end_users (activity_at);
CREATE INDEX end_users_by_key ON end_users (platform, user_key);
CREATE TABLE bots (id text COLLATE "C" PRIMARY KEY, state text COLLATE "C" NOT NULL);

-- The agent API's phase listing and the sweeper's index: sled's keys (storage::keys), in the
-- same byte order.
CREATE TABLE derived (key bytea PRIMARY KEY, conversation text COLLATE "C" NOT NULL);
CREATE INDEX derived_by_conversation ON derived (conversation);

-- The waiting queue, each bot's count, accept histories, hour figures.
CREATE TABLE waiting (bot text COLLATE "C" NOT NULL, since bigint NOT NULL, conversation text COLLATE "C" NOT NULL,
  PRIMARY KEY (bot, since, conversation));
CREATE INDEX waiting_by_since ON waiting (since);
CREATE INDEX waiting_by_conversation ON waiting (conversation);
CREATE TABLE waiting_bots (bot text COLLATE "C" PRIMARY KEY, waiting bigint NOT NULL);
CREATE TABLE accept_history (bot text COLLATE "C" PRIMARY KEY, history text COLLATE "C" NOT NULL);
CREATE TABLE hour_stats (hour bigint PRIMARY KEY, stats text COLLATE "C" NOT NULL);

-- Running timers, by due time.
CREATE TABLE timers (
  due_at bigint NOT NULL,
  conversation text COLLATE "C" NOT NULL,
  name text COLLATE "C" NOT NULL,
  started_by text COLLATE "C" NOT NULL,
  bot_id text COLLATE "C" NOT NULL,
  PRIMARY KEY (due_at, conversation, name)
);
CREATE INDEX timers_by_conversation ON timers (conversation);

-- The outbox (numbered inside the serialised fold transactions), retry states, outcomes, the
-- ledger of every action decided.
CREATE SEQUENCE outbox_seq;
CREATE TABLE outbox (seq bigint PRIMARY KEY, queue text COLLATE "C" NOT NULL, entry text COLLATE "C" NOT NULL);
CREATE INDEX outbox_by_queue ON outbox (queue, seq);
CREATE TABLE outbox_retry (seq bigint PRIMARY KEY, state text COLLATE "C" NOT NULL);
CREATE TABLE outbox_done (seq bigint PRIMARY KEY, at bigint NOT NULL, record text COLLATE "C" NOT NULL);
CREATE INDEX outbox_done_by_at ON outbox_done (at);
CREATE TABLE dead_letters (seq bigint PRIMARY KEY, letter text COLLATE "C" NOT NULL);
CREATE TABLE ledger (
  id text COLLATE "C" PRIMARY KEY,
  event_id text COLLATE "C" NOT NULL,
  state text COLLATE "C" NOT NULL,
  seq bigint NOT NULL,
  at bigint NOT NULL,
  status text COLLATE "C" NOT NULL
);
CREATE INDEX ledger_by_event ON ledger (event_id);
CREATE INDEX ledger_finished ON ledger (at) WHERE state IN ('done', 'dropped');

-- Quarantined bodies, whole (as received, or gzip when large).
CREATE SEQUENCE quarantine_seq;
CREATE TABLE quarantine (
  id bigint PRIMARY KEY,
  received_at bigint NOT NULL,
  meta text COLLATE "C" NOT NULL,
  body_gzip boolean NOT NULL,
  body_bytes bigint NOT NULL,
  body bytea NOT NULL
);
CREATE INDEX quarantine_by_received ON quarantine (received_at);

-- The console's audit list, the agent API's idempotency records.
CREATE SEQUENCE operator_seq;
CREATE TABLE operator_actions (id bigint PRIMARY KEY, at bigint NOT NULL, action text COLLATE "C" NOT NULL);
CREATE TABLE idempotency (
  route text COLLATE "C" NOT NULL,
  key text COLLATE "C" NOT NULL,
  at bigint NOT NULL,
  record text COLLATE "C" NOT NULL,
  PRIMARY KEY (route, key)
);
CREATE INDEX idempotency_by_at ON idempotency (at);

-- The desks' mappings.
CREATE TABLE desk_links (
  connector text COLLATE "C" NOT NULL,
  conversation text COLLATE "C" NOT NULL,
  closed_at bigint,
  updated_at bigint NOT NULL,
  link text COLLATE "C" NOT NULL,
  PRIMARY KEY (connector, conversation)
);
CREATE INDEX desk_links_closed ON desk_links (closed_at) WHERE closed_at IS NOT NULL;
CREATE TABLE desk_remotes (
  connector text COLLATE "C" NOT NULL,
  remote text COLLATE "C" NOT NULL,
  conversation text COLLATE "C" NOT NULL,
  PRIMARY KEY (connector, remote)
);
CREATE INDEX desk_remotes_by_conversation ON desk_remotes (connector, conversation);
CREATE TABLE desk_contacts (
  connector text COLLATE "C" NOT NULL,
  user_id text COLLATE "C" NOT NULL,
  contact text COLLATE "C" NOT NULL,
  PRIMARY KEY (connector, user_id)
);

-- Several nodes on one database (storage-pg's `lease`): the lease on the active's work (one row;
-- times are the database's clock in ms), the nodes seen, and each outbox entry begun (by which
-- epoch: one begun by an earlier epoch is carried out again once, a replay).
CREATE TABLE lease (
  id integer PRIMARY KEY CHECK (id = 1),
  holder text COLLATE "C",
  epoch bigint NOT NULL,
  expires_at bigint NOT NULL
);
INSERT INTO lease (id, holder, epoch, expires_at) VALUES (1, NULL, 0, 0);
CREATE TABLE nodes (node text COLLATE "C" PRIMARY KEY, seen_at bigint NOT NULL);
CREATE TABLE outbox_started (seq bigint PRIMARY KEY, epoch bigint NOT NULL);
