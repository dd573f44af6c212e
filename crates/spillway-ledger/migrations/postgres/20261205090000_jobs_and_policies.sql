-- PostgreSQL translation of ../20261205090000_jobs_and_policies.sql.
-- J8: the workflow policy version each request ran under; J2: the job a request is a run of.
ALTER TABLE requests ADD COLUMN policy_version TEXT COLLATE "C";
ALTER TABLE requests ADD COLUMN job_id TEXT COLLATE "C";
CREATE INDEX requests_job ON requests (job_id) WHERE job_id IS NOT NULL;

-- J2-J7, K3, L1-L3: background jobs, durable from their 202 to their end. `seq` is
-- PostgreSQL's only: it breaks ties in creation time the way SQLite's rowid does.
CREATE TABLE jobs (
    id                       TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    key_name                 TEXT COLLATE "C" NOT NULL,
    owner                    TEXT COLLATE "C" NOT NULL,
    idempotency_key          TEXT COLLATE "C" NOT NULL,
    workflow                 TEXT COLLATE "C" NOT NULL,
    policy_version           TEXT COLLATE "C" NOT NULL,
    format                   TEXT COLLATE "C" NOT NULL,
    api                      TEXT COLLATE "C" NOT NULL,
    path                     TEXT COLLATE "C" NOT NULL,
    endpoint                 TEXT COLLATE "C" NOT NULL,
    headers                  TEXT COLLATE "C" NOT NULL, -- JSON object of the forwarded headers (never credentials)
    body                     BYTEA,
    body_sha256              TEXT COLLATE "C" NOT NULL,
    route                    TEXT COLLATE "C" NOT NULL,
    requested_model          TEXT COLLATE "C" NOT NULL,
    served_model             TEXT COLLATE "C",
    route_override           TEXT COLLATE "C",
    priority                 TEXT COLLATE "C" NOT NULL,
    lane                     TEXT COLLATE "C",
    state                    TEXT COLLATE "C" NOT NULL,
    attempt                  BIGINT NOT NULL,
    max_attempts             BIGINT NOT NULL,
    created_at               BIGINT NOT NULL,
    ready_at                 BIGINT NOT NULL,
    expires_at               BIGINT NOT NULL,
    updated_at               BIGINT NOT NULL,
    retry_after_ms           BIGINT,
    partial_output_committed BOOLEAN NOT NULL DEFAULT FALSE,
    last_error_type          TEXT COLLATE "C",
    last_error               TEXT COLLATE "C",
    last_status              BIGINT,
    estimated_cost_usd       DOUBLE PRECISION,
    estimated_input_tokens   BIGINT,
    estimated_output_tokens  BIGINT,
    cost_usd                 DOUBLE PRECISION,
    usage_units              BIGINT,
    fallback_policy          TEXT COLLATE "C",
    request_ids              TEXT COLLATE "C" NOT NULL, -- JSON array, oldest first
    reason                   TEXT COLLATE "C",          -- why it is in its lane (a trigger name)
    result_status            BIGINT,
    result_content_type      TEXT COLLATE "C",
    result                   BYTEA,
    review                   TEXT COLLATE "C",          -- JSON: the owner's decision
    replay_of                TEXT COLLATE "C",
    replayed_by              TEXT COLLATE "C",
    replay                   TEXT COLLATE "C",          -- JSON: the reviewed replay form
    batch_id                 TEXT COLLATE "C",
    seq                      BIGINT GENERATED ALWAYS AS IDENTITY
);
CREATE INDEX jobs_key ON jobs (key_name, idempotency_key, created_at);
-- One submitted job per key and Idempotency-Key (replays share the key and are exempt):
-- two submissions racing each other, on any instance, cannot both become jobs.
CREATE UNIQUE INDEX jobs_submitted_once ON jobs (key_name, idempotency_key) WHERE replay_of IS NULL;
CREATE INDEX jobs_open ON jobs (state) WHERE state IN ('queued', 'running', 'owner_review', 'dead_letter');
CREATE INDEX jobs_created ON jobs (created_at);

-- J8: every version of every workflow policy the gateway has run.
CREATE TABLE policy_versions (
    workflow   TEXT COLLATE "C" NOT NULL,
    version    TEXT COLLATE "C" NOT NULL,
    source     TEXT COLLATE "C" NOT NULL,
    text       TEXT COLLATE "C" NOT NULL,
    loaded_at  BIGINT NOT NULL,
    PRIMARY KEY (workflow, version)
);
