-- PostgreSQL translation of ../20261207090000_fleet.sql.
-- R1: fleet mode. Which instance wrote a request (a dead instance's `calling_api` rows
-- become `unknown` when a survivor takes it over), job leases (no two instances run one
-- job), and the instances with their heartbeats.
ALTER TABLE requests ADD COLUMN instance TEXT COLLATE "C";
ALTER TABLE jobs ADD COLUMN lease_owner TEXT COLLATE "C";
ALTER TABLE jobs ADD COLUMN lease_until BIGINT;
CREATE INDEX jobs_updated ON jobs (updated_at);
-- PostgreSQL's only: a take-over (and a restart) finds an instance's in-flight requests
-- without reading the table; rows leave the index as they leave `calling_api`.
CREATE INDEX requests_calling_by_instance ON requests (instance) WHERE state = 'calling_api';

CREATE TABLE instances (
    id            TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    boot          TEXT COLLATE "C" NOT NULL,
    listen        TEXT COLLATE "C" NOT NULL,
    version       TEXT COLLATE "C" NOT NULL,
    started_at    BIGINT NOT NULL,
    heartbeat_at  BIGINT NOT NULL,
    stopped_at    BIGINT,
    taken_over_by TEXT COLLATE "C",
    unknowns      BIGINT NOT NULL DEFAULT 0,
    load          TEXT COLLATE "C" NOT NULL DEFAULT '{}'
);

-- I2 across a fleet: which request holds an `Idempotency-Key` while it runs, so a repeat
-- that reaches another instance is refused too.
CREATE TABLE idempotency_claims (
    key_name        TEXT COLLATE "C" NOT NULL,
    idempotency_key TEXT COLLATE "C" NOT NULL,
    request_id      TEXT COLLATE "C" NOT NULL,
    instance        TEXT COLLATE "C" NOT NULL,
    claimed_at      BIGINT NOT NULL,
    PRIMARY KEY (key_name, idempotency_key)
);

-- Each heartbeat extends its instance's leases; a take-over releases them.
CREATE INDEX jobs_leased ON jobs (lease_owner) WHERE lease_owner IS NOT NULL;
