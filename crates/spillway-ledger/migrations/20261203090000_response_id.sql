-- The provider's id of a response it stores (OpenAI's Responses API, `resp_...`): a
-- follow-up (`GET`/`DELETE /v1/responses/{id}`, `previous_response_id`) must reach the
-- channel that holds it, after a restart too. Indexed only where set.
ALTER TABLE requests ADD COLUMN response_id TEXT;
CREATE INDEX requests_response_id ON requests (response_id) WHERE response_id IS NOT NULL;
