-- Schema 2: work asked of the active node (storage::asks): an operator's action that reached a
-- standby (a dead letter's retry or drop, a replay, a pass run now), stored by any node, carried
-- out and answered by the active one. `ask` and `answer` are JSON documents.
CREATE SEQUENCE ask_seq;
CREATE TABLE asks (
  id bigint PRIMARY KEY,
  asked_at bigint NOT NULL,
  asked_by text COLLATE "C" NOT NULL,
  ask text COLLATE "C" NOT NULL,
  answered_at bigint,
  answer text COLLATE "C"
);
-- The unanswered ones, oldest first, without a scan of those answered.
CREATE INDEX asks_unanswered ON asks (id) WHERE answered_at IS NULL;
CREATE INDEX asks_by_answered ON asks (answered_at) WHERE answered_at IS NOT NULL;
