-- PostgreSQL translation of ../20261206090000_recovery_runs.sql.
-- O1-O5: guided recovery runs; the run's machine and incident record are one JSON
-- document (`body`).
CREATE TABLE recovery_runs (
    id         TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    route      TEXT COLLATE "C" NOT NULL,
    drill      TEXT COLLATE "C",          -- the drill's scenario; NULL for a real incident
    step       TEXT COLLATE "C" NOT NULL,
    opened_at  BIGINT NOT NULL,
    closed_at  BIGINT,
    body       TEXT COLLATE "C" NOT NULL
);
CREATE INDEX recovery_runs_opened ON recovery_runs (opened_at);
-- O1: each run's evidence bundle, the bytes its SHA-256 was taken of.
CREATE TABLE recovery_evidence (
    run_id  TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    bytes   BYTEA NOT NULL
);
