-- O1-O5: guided recovery runs. The run's machine and its incident record are one JSON
-- document (`body`), rewritten at each transition with its audit entry in the same
-- transaction; the columns beside it are what lists and the one-open-run rule need.
CREATE TABLE recovery_runs (
    id         TEXT PRIMARY KEY NOT NULL,
    route      TEXT NOT NULL,
    drill      TEXT,                 -- the drill's scenario; NULL for a real incident
    step       TEXT NOT NULL,
    opened_at  INTEGER NOT NULL,
    closed_at  INTEGER,
    body       TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX recovery_runs_opened ON recovery_runs (opened_at);
-- O1: each run's evidence bundle, the bytes its SHA-256 was taken of, kept apart from the
-- run's row (rewritten at every transition) and from the request rows (pruned).
CREATE TABLE recovery_evidence (
    run_id  TEXT PRIMARY KEY NOT NULL,
    bytes   BLOB NOT NULL
) WITHOUT ROWID;
