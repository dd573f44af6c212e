-- PostgreSQL translation of ../20261201100000_control_state_and_audit.sql.
-- The control plane's durable state (G4, D5) and the audit log of its transitions.
CREATE TABLE control_state (
    kind       TEXT COLLATE "C" NOT NULL,
    subject    TEXT COLLATE "C" NOT NULL,
    state      TEXT COLLATE "C" NOT NULL, -- JSON snapshot
    updated_at BIGINT NOT NULL,           -- unix ms
    PRIMARY KEY (kind, subject)
);

-- Every transition with who or what caused it and its figures; append-only.
CREATE TABLE audit (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at         BIGINT NOT NULL,           -- unix ms
    kind       TEXT COLLATE "C" NOT NULL, -- breaker | channel
    subject    TEXT COLLATE "C" NOT NULL,
    actor      TEXT COLLATE "C" NOT NULL, -- 'gateway', or the operator's name
    action     TEXT COLLATE "C" NOT NULL, -- e.g. closed->open, ejected, restored
    trigger    TEXT COLLATE "C",
    reason     TEXT COLLATE "C" NOT NULL,
    figures    TEXT COLLATE "C"           -- JSON [{name, value}]
);
CREATE INDEX audit_subject ON audit (kind, subject, id);
