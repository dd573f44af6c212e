-- J8: the workflow policy version each request ran under; J2: the job a request is a run of.
ALTER TABLE requests ADD COLUMN policy_version TEXT;
ALTER TABLE requests ADD COLUMN job_id TEXT;
CREATE INDEX requests_job ON requests (job_id) WHERE job_id IS NOT NULL;

-- J2-J7, K3, L1-L3: background jobs, durable from their 202 to their end. A job keeps its
-- body (I6: background work keeps it for replay) until it is done; `lane` says where it
-- waits (background_retry, owner_review, dead_letter), `state` what it is doing.
CREATE TABLE jobs (
    id                       TEXT PRIMARY KEY NOT NULL,
    key_name                 TEXT NOT NULL,
    owner                    TEXT NOT NULL,
    idempotency_key          TEXT NOT NULL,
    workflow                 TEXT NOT NULL,
    policy_version           TEXT NOT NULL,
    format                   TEXT NOT NULL,
    api                      TEXT NOT NULL,
    path                     TEXT NOT NULL,
    endpoint                 TEXT NOT NULL,
    headers                  TEXT NOT NULL,   -- JSON object of the forwarded headers (never credentials)
    body                     BLOB,
    body_sha256              TEXT NOT NULL,
    route                    TEXT NOT NULL,
    requested_model          TEXT NOT NULL,
    served_model             TEXT,
    route_override           TEXT,
    priority                 TEXT NOT NULL,
    lane                     TEXT,
    state                    TEXT NOT NULL,
    attempt                  INTEGER NOT NULL,
    max_attempts             INTEGER NOT NULL,
    created_at               INTEGER NOT NULL,
    ready_at                 INTEGER NOT NULL,
    expires_at               INTEGER NOT NULL,
    updated_at               INTEGER NOT NULL,
    retry_after_ms           INTEGER,
    partial_output_committed INTEGER NOT NULL DEFAULT 0,
    last_error_type          TEXT,
    last_error               TEXT,
    last_status              INTEGER,
    estimated_cost_usd       REAL,
    estimated_input_tokens   INTEGER,
    estimated_output_tokens  INTEGER,
    cost_usd                 REAL,
    usage_units              INTEGER,
    fallback_policy          TEXT,
    request_ids              TEXT NOT NULL,   -- JSON array, oldest first
    reason                   TEXT,            -- why it is in its lane (a trigger name)
    result_status            INTEGER,
    result_content_type      TEXT,
    result                   BLOB,
    review                   TEXT,            -- JSON: the owner's decision
    replay_of                TEXT,
    replayed_by              TEXT,
    replay                   TEXT,            -- JSON: the reviewed replay form
    batch_id                 TEXT
);
CREATE INDEX jobs_key ON jobs (key_name, idempotency_key, created_at);
-- One submitted job per key and Idempotency-Key (replays share the key and are exempt):
-- two submissions racing each other cannot both become jobs.
CREATE UNIQUE INDEX jobs_submitted_once ON jobs (key_name, idempotency_key) WHERE replay_of IS NULL;
CREATE INDEX jobs_open ON jobs (state) WHERE state IN ('queued', 'running', 'owner_review', 'dead_letter');
CREATE INDEX jobs_created ON jobs (created_at);

-- J8: every version of every workflow policy the gateway has run, so a diff or a roll
-- back can name any of them.
CREATE TABLE policy_versions (
    workflow   TEXT NOT NULL,
    version    TEXT NOT NULL,
    source     TEXT NOT NULL,
    text       TEXT NOT NULL,
    loaded_at  INTEGER NOT NULL,
    PRIMARY KEY (workflow, version)
);
