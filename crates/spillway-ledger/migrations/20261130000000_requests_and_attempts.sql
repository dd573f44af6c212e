-- One row per logical request (I1), upserted as it moves through its states (I3),
-- and one row per upstream attempt. Times are unix milliseconds.
CREATE TABLE requests (
    id                       TEXT PRIMARY KEY NOT NULL, -- gateway request id (x-request-id), UUIDv7: time-ordered
    trace_id                 TEXT NOT NULL,
    client_request_id        TEXT,
    upstream_request_id      TEXT,
    key_name                 TEXT,
    owner                    TEXT,
    workflow                 TEXT,
    format                   TEXT NOT NULL,
    endpoint                 TEXT NOT NULL,
    route                    TEXT,
    channel                  TEXT,
    requested_model          TEXT,
    served_model             TEXT,
    stream                   INTEGER NOT NULL DEFAULT 0,
    state                    TEXT NOT NULL,
    http_status              INTEGER,
    error_class              TEXT,
    error_message            TEXT,
    input_tokens             INTEGER,
    output_tokens            INTEGER,
    cached_input_tokens      INTEGER,
    reasoning_tokens         INTEGER,
    cost_usd                 REAL,        -- NULL: unknown, never zero by default (M1)
    received_at              INTEGER NOT NULL,
    admitted_at              INTEGER,
    first_token_at           INTEGER,
    finished_at              INTEGER,
    queued_ms                INTEGER,
    attempts                 INTEGER NOT NULL DEFAULT 0,
    body_sha256              TEXT,        -- prompts are stored only as hashes (I6)
    partial_output_committed INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
-- Every index here is pages rewritten on the hot path (the WAL logs whole pages, several
-- commits a request), so the table carries only what search needs that the key cannot give:
-- * time ranges use the key itself: a UUIDv7 id starts with its millisecond timestamp;
-- * a trace id the gateway made is the request id in hex (no index needed); only trace
--   ids clients sent are indexed;
-- * `unknown` rows, rare by nature, for the owner's reconciliation inbox.
CREATE INDEX requests_client_trace_id ON requests (trace_id) WHERE trace_id <> replace(id, '-', '');
CREATE INDEX requests_client_request_id ON requests (client_request_id) WHERE client_request_id IS NOT NULL;
CREATE INDEX requests_unknown ON requests (state) WHERE state = 'unknown';

CREATE TABLE attempts (
    request_id          TEXT NOT NULL,
    attempt_no          INTEGER NOT NULL,
    channel             TEXT NOT NULL,
    upstream_request_id TEXT,
    http_status         INTEGER,
    error_class         TEXT NOT NULL,
    provider_error_type TEXT,
    retry_after_ms      INTEGER,
    message             TEXT,
    started_at          INTEGER NOT NULL,
    first_byte_at       INTEGER,
    finished_at         INTEGER,
    input_tokens        INTEGER,
    output_tokens       INTEGER,
    PRIMARY KEY (request_id, attempt_no)
) WITHOUT ROWID;
