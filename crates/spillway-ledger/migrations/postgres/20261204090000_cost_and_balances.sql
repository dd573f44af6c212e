-- PostgreSQL translation of ../20261204090000_cost_and_balances.sql.
-- M1-M3: expected and actual costs of requests and attempts.
ALTER TABLE requests ADD COLUMN cache_write_tokens BIGINT;
ALTER TABLE requests ADD COLUMN estimated_input_tokens BIGINT;
ALTER TABLE requests ADD COLUMN estimated_cost_usd DOUBLE PRECISION;
ALTER TABLE requests ADD COLUMN failed_cost_usd DOUBLE PRECISION;
ALTER TABLE requests ADD COLUMN pricing_version TEXT COLLATE "C";
ALTER TABLE attempts ADD COLUMN cost_usd DOUBLE PRECISION;

-- B3, B4: credits to an owner's balance.
CREATE TABLE balance_entries (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    owner      TEXT COLLATE "C" NOT NULL,
    at         BIGINT NOT NULL,
    kind       TEXT COLLATE "C" NOT NULL,  -- seed | top_up | opening | pruned_charges
    amount_usd DOUBLE PRECISION NOT NULL,
    actor      TEXT COLLATE "C",
    reason     TEXT COLLATE "C"
);
CREATE INDEX balance_entries_owner ON balance_entries (owner);

-- B5: keys made from the console or the CLI: only the SHA-256 of the secret is kept.
CREATE TABLE api_keys (
    name            TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    owner           TEXT COLLATE "C" NOT NULL,
    secret_sha256   TEXT COLLATE "C" NOT NULL UNIQUE,
    hint            TEXT COLLATE "C" NOT NULL,
    rpm             BIGINT,
    max_concurrency BIGINT,
    created_at      BIGINT NOT NULL,
    created_by      TEXT COLLATE "C" NOT NULL,
    revoked_at      BIGINT,
    revoked_by      TEXT COLLATE "C"
);

-- B3: spend limits an operator set; `folded_usd` keeps the spend of pruned requests.
-- `seq` is PostgreSQL's only: the rows are listed in the order they were first written,
-- as SQLite lists them (by rowid).
CREATE TABLE key_spend (
    key_name        TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    spend_limit_usd DOUBLE PRECISION,
    limit_set       BOOLEAN NOT NULL DEFAULT FALSE,
    folded_usd      DOUBLE PRECISION NOT NULL DEFAULT 0,
    set_at          BIGINT,
    set_by          TEXT COLLATE "C",
    seq             BIGINT GENERATED ALWAYS AS IDENTITY
);
