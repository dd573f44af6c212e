-- PostgreSQL translation of ../20261203090000_response_id.sql.
-- The provider's id of a response it stores (OpenAI's Responses API, `resp_...`).
ALTER TABLE requests ADD COLUMN response_id TEXT COLLATE "C";
CREATE INDEX requests_response_id ON requests (response_id) WHERE response_id IS NOT NULL;
