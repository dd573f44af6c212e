-- PostgreSQL translation of ../20261202090000_idempotency.sql.
-- Idempotency (I2), the side-effect step (I3) and owner reconciliation (I4), and the
-- payload copies kept for replays (I6).
ALTER TABLE requests ADD COLUMN idempotency_key TEXT COLLATE "C";
ALTER TABLE requests ADD COLUMN replay_of TEXT COLLATE "C";
ALTER TABLE requests ADD COLUMN result_id TEXT COLLATE "C";
ALTER TABLE requests ADD COLUMN side_effect_at BIGINT;
ALTER TABLE requests ADD COLUMN reconciliation TEXT COLLATE "C";
ALTER TABLE requests ADD COLUMN reconciled_by TEXT COLLATE "C";
ALTER TABLE requests ADD COLUMN reconciled_reason TEXT COLLATE "C";
ALTER TABLE requests ADD COLUMN reconciled_at BIGINT;
CREATE INDEX requests_idempotency ON requests (key_name, idempotency_key) WHERE idempotency_key IS NOT NULL;

-- Copies of bodies, kept only as long as they are needed (large values are TOASTed out
-- of the row, as SQLite keeps them out of the key's pages).
CREATE TABLE payloads (
    request_id            TEXT COLLATE "C" NOT NULL UNIQUE,
    expires_at            BIGINT NOT NULL,  -- unix ms
    request_body          BYTEA,            -- only with `store_prompts: true` (I6)
    response_status       BIGINT,
    response_content_type TEXT COLLATE "C",
    response_body         BYTEA
);
CREATE INDEX payloads_expiry ON payloads (expires_at);
