-- Idempotency (I2), the side-effect step (I3) and owner reconciliation (I4), and the
-- payload copies kept for replays (I6).
--
-- A request that runs under an `Idempotency-Key` carries it (scoped by the gateway key's
-- name); the newest request with a key is what a repeat is compared with. The key is
-- written with the request's durable `calling_api` row, in the same commit, so no
-- upstream call is ever made under a key the ledger does not hold.
ALTER TABLE requests ADD COLUMN idempotency_key TEXT;
-- A request answered from the ledger (a repeat of a completed one) names the original.
ALTER TABLE requests ADD COLUMN replay_of TEXT;
-- The downstream result (a side effect's id, or the one an owner attached when confirming
-- an unknown request as done), and when the side-effect step was last marked.
ALTER TABLE requests ADD COLUMN result_id TEXT;
ALTER TABLE requests ADD COLUMN side_effect_at INTEGER;
-- An owner's reconciliation of an unknown request: confirmed_done | confirmed_not_executed.
ALTER TABLE requests ADD COLUMN reconciliation TEXT;
ALTER TABLE requests ADD COLUMN reconciled_by TEXT;
ALTER TABLE requests ADD COLUMN reconciled_reason TEXT;
ALTER TABLE requests ADD COLUMN reconciled_at INTEGER;
CREATE INDEX requests_idempotency ON requests (key_name, idempotency_key) WHERE idempotency_key IS NOT NULL;

-- Copies of bodies, kept only as long as they are needed: a completed idempotent
-- request's response (replayed byte for byte, streams included) and, when the config
-- asks for it, the request body. Both expire with the idempotency window and are pruned.
-- A rowid table: large values stay out of the key's b-tree pages.
CREATE TABLE payloads (
    request_id            TEXT NOT NULL UNIQUE,
    expires_at            INTEGER NOT NULL,  -- unix ms
    request_body          BLOB,              -- only with `store_prompts: true` (I6)
    response_status       INTEGER,
    response_content_type TEXT,
    response_body         BLOB
);
CREATE INDEX payloads_expiry ON payloads (expires_at);
