-- Retry decisions (F2) and the wait hints they keep (F1, I5).
-- Each attempt records what the gateway decided after it, why, and when the next attempt
-- may start; the request keeps its next `ready_at`, so a restart knows when work may resume.
ALTER TABLE attempts ADD COLUMN decision TEXT;          -- done | retry | failover | wait | fail_closed | passed_through
ALTER TABLE attempts ADD COLUMN decision_reason TEXT;   -- e.g. attempt_budget_exhausted, retry_after_exceeds_deadline
ALTER TABLE attempts ADD COLUMN delay_ms INTEGER;       -- pause before the next attempt
ALTER TABLE attempts ADD COLUMN ready_at INTEGER;       -- unix ms: the next attempt starts no earlier
ALTER TABLE attempts ADD COLUMN visibility TEXT;        -- E1, for failures: before_first_token | after_partial_output
ALTER TABLE requests ADD COLUMN next_ready_at INTEGER;  -- unix ms, while the request waits for a retry
