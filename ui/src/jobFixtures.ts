// Fixtures of background jobs for the inbox tests: a job and a run, as the admin API
// returns them, with the fields a test cares about overridden.
import type { JobView } from './bindings/JobView'
import type { RequestDetail } from './bindings/RequestDetail'
import type { RequestRecord } from './bindings/RequestRecord'

export const now = Date.now()
export const ID = 'job_0000000000000000000000000000000a'

export function jobOf(over: Partial<JobView>): JobView {
  return {
    job_id: ID, state: 'owner_review', lane: 'owner_review', workflow: 'default', policy_version: 'b7e1',
    owner_key: 'team-pay', key_name: 'billing', route_key: 'openai/gpt-4o-mini', route_override: null,
    requested_model: 'gpt-4o-mini', served_model: null, priority: 'normal', attempt: 1, max_attempts: 3,
    created_at: now - 2 * 3600_000, ready_at: now - 2 * 3600_000, expires_at: now + 3600_000, updated_at: now - 3600_000,
    retry_after_ms: null, fallback_policy: 'default@b7e1: openai/gpt-4o, openai/gpt-4.1-mini', partial_output_committed: false,
    last_error_type: 'quota', last_error: 'You exceeded your current quota, please check your plan and billing details.',
    last_status: 429, reason: 'quota_or_spend_exhausted', estimated_cost_usd: 0.0042, cost_usd: null, usage_units: null,
    idempotency_key: 'job:job_a', request_ids: ['req-1'], replay_of: null, replayed_by: null, batch_id: null, review: null,
    replay: null, result_status: null,
    ...over,
  }
}

export function runOf(id: string, over: Partial<RequestRecord> = {}): RequestDetail {
  const request: RequestRecord = {
    id, trace_id: 't', client_request_id: null, upstream_request_id: null, key_name: 'billing', owner: 'team-pay',
    workflow: 'default', format: 'openai', endpoint: '/v1/chat/completions', route: 'openai/gpt-4o-mini', channel: 'openai-sim',
    requested_model: 'gpt-4o-mini', served_model: null, stream: false, state: 'failed', http_status: 429, error_class: 'quota',
    error_message: 'You exceeded your current quota', input_tokens: null, output_tokens: null, cached_input_tokens: null,
    reasoning_tokens: null, cache_write_tokens: null, cost_usd: null, estimated_input_tokens: 12, estimated_cost_usd: 0.0042,
    failed_cost_usd: null, pricing_version: null, policy_version: 'b7e1', job_id: ID, received_at: now - 2 * 3600_000, admitted_at: null, first_token_at: null,
    finished_at: null, queued_ms: null, attempts: 1, body_sha256: null, partial_output_committed: false, next_ready_at: null,
    idempotency_key: 'job:job_a', replay_of: null, response_id: null, resolution: null,
    ...over,
  }
  return {
    request,
    attempts: [{
      request_id: id, attempt_no: 1, channel: 'openai-sim', upstream_request_id: null, http_status: 429, error_class: 'quota',
      provider_error_type: 'insufficient_quota', retry_after_ms: null, message: 'quota', started_at: now - 2 * 3600_000,
      first_byte_at: null, finished_at: null, input_tokens: null, output_tokens: null, cost_usd: null, decision: 'fail_closed',
      decision_reason: null, delay_ms: null, ready_at: null, visibility: 'before_first_token',
    }],
    cost_breakdown: null,
  }
}
