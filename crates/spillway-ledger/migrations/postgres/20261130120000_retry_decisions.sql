-- PostgreSQL translation of ../20261130120000_retry_decisions.sql.
-- Retry decisions (F2) and the wait hints they keep (F1, I5).
ALTER TABLE attempts ADD COLUMN decision TEXT COLLATE "C";        -- done | retry | failover | wait | fail_closed | passed_through
ALTER TABLE attempts ADD COLUMN decision_reason TEXT COLLATE "C"; -- e.g. attempt_budget_exhausted, retry_after_exceeds_deadline
ALTER TABLE attempts ADD COLUMN delay_ms BIGINT;                  -- pause before the next attempt
ALTER TABLE attempts ADD COLUMN ready_at BIGINT;                  -- unix ms: the next attempt starts no earlier
ALTER TABLE attempts ADD COLUMN visibility TEXT COLLATE "C";      -- E1, for failures: before_first_token | after_partial_output
ALTER TABLE requests ADD COLUMN next_ready_at BIGINT;             -- unix ms, while the request waits for a retry
