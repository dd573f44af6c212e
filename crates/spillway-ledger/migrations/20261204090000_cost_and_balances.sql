-- M1-M3: what each request was expected to cost before its call, what it cost (failed
-- attempts included) and at which catalog version; what each attempt cost.
ALTER TABLE requests ADD COLUMN cache_write_tokens INTEGER;
ALTER TABLE requests ADD COLUMN estimated_input_tokens INTEGER;
ALTER TABLE requests ADD COLUMN estimated_cost_usd REAL;
-- The part of cost_usd spent on attempts that did not give the answer (retries, failures).
ALTER TABLE requests ADD COLUMN failed_cost_usd REAL;
ALTER TABLE requests ADD COLUMN pricing_version TEXT;
ALTER TABLE attempts ADD COLUMN cost_usd REAL;

-- B3, B4: credits to an owner's balance: the config's seed (written once, the first time
-- the ledger meets the owner), top-ups, and the charges of pruned requests folded in.
-- Charges are the requests' own cost_usd, so a balance is its credits minus its requests'
-- costs and can always be recomputed from the ledger.
CREATE TABLE balance_entries (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    owner      TEXT NOT NULL,
    at         INTEGER NOT NULL,
    kind       TEXT NOT NULL,  -- seed | top_up | pruned_charges
    amount_usd REAL NOT NULL,
    actor      TEXT,
    reason     TEXT
);
CREATE INDEX balance_entries_owner ON balance_entries (owner);

-- B5: keys made from the console or the CLI: only the SHA-256 of the secret is kept.
CREATE TABLE api_keys (
    name            TEXT PRIMARY KEY NOT NULL,
    owner           TEXT NOT NULL,
    secret_sha256   TEXT NOT NULL UNIQUE,
    hint            TEXT NOT NULL,  -- the secret's first characters, to recognise it
    rpm             INTEGER,
    max_concurrency INTEGER,
    created_at      INTEGER NOT NULL,
    created_by      TEXT NOT NULL,
    revoked_at      INTEGER,
    revoked_by      TEXT
);

-- B3: spend limits an operator set (for config keys and made keys alike); NULL lifts it.
-- `folded_usd` keeps the spend of pruned requests, so pruning never resets a key's spend.
CREATE TABLE key_spend (
    key_name        TEXT PRIMARY KEY NOT NULL,
    spend_limit_usd REAL,
    limit_set       INTEGER NOT NULL DEFAULT 0,
    folded_usd      REAL NOT NULL DEFAULT 0,
    set_at          INTEGER,
    set_by          TEXT
);
