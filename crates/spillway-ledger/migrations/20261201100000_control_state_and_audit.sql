-- The control plane's durable state (G4, D5) and the audit log of its transitions.
-- `control_state` keeps the latest state of each breaker (kind 'breaker', subject the
-- route `format/model`) and each channel's ejection (kind 'channel', subject its name), as
-- JSON the engine reads back at start-up: a restart keeps every open breaker and ejection.
CREATE TABLE control_state (
    kind       TEXT NOT NULL,
    subject    TEXT NOT NULL,
    state      TEXT NOT NULL,      -- JSON snapshot
    updated_at INTEGER NOT NULL,   -- unix ms
    PRIMARY KEY (kind, subject)
);

-- Every transition with who or what caused it and its figures; append-only.
CREATE TABLE audit (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    at         INTEGER NOT NULL,   -- unix ms
    kind       TEXT NOT NULL,      -- breaker | channel
    subject    TEXT NOT NULL,
    actor      TEXT NOT NULL,      -- 'gateway', or the operator's name
    action     TEXT NOT NULL,      -- e.g. closed->open, ejected, restored
    trigger    TEXT,
    reason     TEXT NOT NULL,
    figures    TEXT                -- JSON [{name, value}]
);
CREATE INDEX audit_subject ON audit (kind, subject, id);
