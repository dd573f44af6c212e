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
