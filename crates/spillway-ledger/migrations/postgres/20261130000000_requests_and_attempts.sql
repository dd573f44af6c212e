-- PostgreSQL: the same schema as the SQLite ledger (../20261130000000_requests_and_attempts.sql),
-- translated. Times are unix milliseconds (BIGINT), flags BOOLEAN. Every text column is
-- COLLATE "C": SQLite compares text byte by byte, and the ledger relies on it (UUIDv7 ids
-- compared as strings are in time order; pages continue `before` an id; orderings must be
-- the same in both stores), whatever the database's own collation.
--
-- One row per logical request (I1), upserted as it moves through its states (I3),
-- and one row per upstream attempt.
CREATE TABLE requests (
    id                       TEXT COLLATE "C" PRIMARY KEY NOT NULL, -- gateway request id (x-request-id), UUIDv7: time-ordered
    trace_id                 TEXT COLLATE "C" NOT NULL,
    client_request_id        TEXT COLLATE "C",
    upstream_request_id      TEXT COLLATE "C",
    key_name                 TEXT COLLATE "C",
    owner                    TEXT COLLATE "C",
    workflow                 TEXT COLLATE "C",
    format                   TEXT COLLATE "C" NOT NULL,
    endpoint                 TEXT COLLATE "C" NOT NULL,
    route                    TEXT COLLATE "C",
    channel                  TEXT COLLATE "C",
    requested_model          TEXT COLLATE "C",
    served_model             TEXT COLLATE "C",
    stream                   BOOLEAN NOT NULL DEFAULT FALSE,
    state                    TEXT COLLATE "C" NOT NULL,
    http_status              BIGINT,
    error_class              TEXT COLLATE "C",
    error_message            TEXT COLLATE "C",
    input_tokens             BIGINT,
    output_tokens            BIGINT,
    cached_input_tokens      BIGINT,
    reasoning_tokens         BIGINT,
    cost_usd                 DOUBLE PRECISION, -- NULL: unknown, never zero by default (M1)
    received_at              BIGINT NOT NULL,
    admitted_at              BIGINT,
    first_token_at           BIGINT,
    finished_at              BIGINT,
    queued_ms                BIGINT,
    attempts                 BIGINT NOT NULL DEFAULT 0,
    body_sha256              TEXT COLLATE "C", -- prompts are stored only as hashes (I6)
    partial_output_committed BOOLEAN NOT NULL DEFAULT FALSE
);
-- The same indexes as SQLite's: the key gives time ranges (a UUIDv7 starts with its
-- millisecond), gateway-made trace ids are the request id in hex, unknown rows are rare.
CREATE INDEX requests_client_trace_id ON requests (trace_id) WHERE trace_id <> replace(id, '-', '');
CREATE INDEX requests_client_request_id ON requests (client_request_id) WHERE client_request_id IS NOT NULL;
CREATE INDEX requests_unknown ON requests (state) WHERE state = 'unknown';

CREATE TABLE attempts (
    request_id          TEXT COLLATE "C" NOT NULL,
    attempt_no          BIGINT NOT NULL,
    channel             TEXT COLLATE "C" NOT NULL,
    upstream_request_id TEXT COLLATE "C",
    http_status         BIGINT,
    error_class         TEXT COLLATE "C" NOT NULL,
    provider_error_type TEXT COLLATE "C",
    retry_after_ms      BIGINT,
    message             TEXT COLLATE "C",
    started_at          BIGINT NOT NULL,
    first_byte_at       BIGINT,
    finished_at         BIGINT,
    input_tokens        BIGINT,
    output_tokens       BIGINT,
    PRIMARY KEY (request_id, attempt_no)
);
