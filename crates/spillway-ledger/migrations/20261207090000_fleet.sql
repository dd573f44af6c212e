-- R1: fleet mode. Which instance wrote a request (a dead instance's `calling_api` rows
-- become `unknown` when a survivor takes it over), job leases (no two instances run one
-- job), and the instances with their heartbeats. An embedded SQLite ledger has one
-- instance; the columns stay empty there.
ALTER TABLE requests ADD COLUMN instance TEXT;
ALTER TABLE jobs ADD COLUMN lease_owner TEXT;
ALTER TABLE jobs ADD COLUMN lease_until INTEGER;
CREATE INDEX jobs_updated ON jobs (updated_at);

CREATE TABLE instances (
    id            TEXT PRIMARY KEY NOT NULL,
    boot          TEXT NOT NULL,
    listen        TEXT NOT NULL,
    version       TEXT NOT NULL,
    started_at    INTEGER NOT NULL,
    heartbeat_at  INTEGER NOT NULL,
    stopped_at    INTEGER,
    taken_over_by TEXT,
    unknowns      INTEGER NOT NULL DEFAULT 0,
    load          TEXT NOT NULL DEFAULT '{}'
);

-- I2 across a fleet: which request holds an `Idempotency-Key` while it runs, so a repeat
-- that reaches another instance is refused too. One process keeps its claims in memory;
-- a shared ledger keeps them here.
CREATE TABLE idempotency_claims (
    key_name        TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    request_id      TEXT NOT NULL,
    instance        TEXT NOT NULL,
    claimed_at      INTEGER NOT NULL,
    PRIMARY KEY (key_name, idempotency_key)
);

-- Each heartbeat extends its instance's leases; a take-over releases them.
CREATE INDEX jobs_leased ON jobs (lease_owner) WHERE lease_owner IS NOT NULL;
