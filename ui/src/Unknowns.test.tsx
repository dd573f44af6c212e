// The unknown-outcomes inbox as an owner needs it: each item with its evidence, and a
// reconcile form that enables only once the verdict, its result (for "done"), a name and a
// reason are there, and that says what it did.
import { QueryClient, QueryClientProvider } from '@tanstack/react-query'
import { cleanup, fireEvent, render, screen, waitFor } from '@testing-library/react'
import { afterEach, describe, expect, it, vi } from 'vitest'
import type { RequestDetail } from './bindings/RequestDetail'
import type { RequestRecord } from './bindings/RequestRecord'
import { UnknownsView } from './Unknowns'

const now = Date.now()
const request: RequestRecord = {
  id: '0195f0a1-7c3e-7000-8000-0000000000aa', trace_id: '0195f0a17c3e700080000000000000aa', client_request_id: 'client-7',
  upstream_request_id: null, key_name: 'billing', owner: 'team-pay', workflow: null, format: 'openai',
  endpoint: '/v1/chat/completions', route: 'openai/gpt-4o-mini', channel: 'openai-a', requested_model: 'gpt-4o-mini',
  served_model: 'gpt-4o-mini', stream: false, state: 'unknown', http_status: null, error_class: 'interrupted',
  error_message: 'the gateway stopped while this request was calling the provider', input_tokens: null,
  output_tokens: null, cached_input_tokens: null, reasoning_tokens: null, cache_write_tokens: null, cost_usd: null,
  estimated_input_tokens: 812, estimated_cost_usd: 0.0021, failed_cost_usd: null, pricing_version: null, policy_version: null, job_id: null, received_at: now - 3 * 3600_000,
  admitted_at: now - 3 * 3600_000 + 5, first_token_at: null, finished_at: null, queued_ms: null, attempts: 2,
  body_sha256: 'ab', partial_output_committed: false, next_ready_at: null, idempotency_key: 'invoice-42', replay_of: null, response_id: null,
  resolution: null,
}
const items: RequestDetail[] = [{
  request,
  attempts: [{
    request_id: request.id, attempt_no: 1, channel: 'openai-b', upstream_request_id: 'req_up_1', http_status: 503,
    error_class: 'overload', provider_error_type: null, retry_after_ms: null, message: 'HTTP 503', started_at: now - 3 * 3600_000,
    first_byte_at: null, finished_at: now - 3 * 3600_000 + 2, input_tokens: null, output_tokens: null, cost_usd: null, decision: 'failover',
    decision_reason: null, delay_ms: null, ready_at: null, visibility: 'before_first_token',
  }],
  cost_breakdown: null,
}]

const reconcile = vi.fn()
const reconcileBulk = vi.fn()
vi.mock('./api', () => ({
  getUnknowns: () => Promise.resolve(items),
  reconcile: (...a: unknown[]) => reconcile(...a),
  reconcileBulk: (...a: unknown[]) => reconcileBulk(...a),
}))

function show(selected: string | null) {
  return render(
    <QueryClientProvider client={new QueryClient()}>
      <UnknownsView conn={{ url: 'http://127.0.0.1:1', token: 't' }} selected={selected} />
    </QueryClientProvider>,
  )
}

afterEach(() => {
  cleanup()
  reconcile.mockReset()
  reconcileBulk.mockReset()
})

describe('UnknownsView', () => {
  it('lists each unknown request with its key, channel and age', async () => {
    // spec: I4
    show(null)
    const row = await screen.findByTestId(`unknown-${request.id}`)
    expect(row.textContent).toMatch(/openai\/gpt-4o-mini/)
    expect(row.textContent).toMatch(/invoice-42/)
    expect(row.textContent).toMatch(/billing · team-pay/)
    expect(screen.getByTestId('unknowns-summary').textContent).toMatch(/1 waiting; the oldest for 3 h/)
  })

  it('shows the evidence and reconciles only with a verdict, a result for done, a name and a reason', async () => {
    // spec: I4, L3
    reconcile.mockResolvedValue({ ...request, state: 'done' })
    show(request.id)
    const facts = await screen.findByTestId('unknown-facts')
    expect(facts.textContent).toMatch(/openai-a/)
    expect(facts.textContent).toMatch(/client-7/)
    expect(screen.getByTestId('unknown-attempts').textContent).toMatch(/openai-b.*503.*req_up_1/)
    const submit = screen.getByTestId('reconcile-submit') as HTMLButtonElement
    expect(submit.disabled).toBe(true)
    fireEvent.click(screen.getByTestId('outcome-done'))
    fireEvent.change(screen.getByTestId('reconcile-actor'), { target: { value: 'ana' } })
    fireEvent.change(screen.getByTestId('reconcile-reason'), { target: { value: 'in the provider log' } })
    expect(submit.disabled).toBe(true)
    fireEvent.change(screen.getByTestId('reconcile-result'), { target: { value: 'chatcmpl-9' } })
    expect(submit.disabled).toBe(false)
    fireEvent.click(submit)
    await waitFor(() => expect(reconcile).toHaveBeenCalledTimes(1))
    expect(reconcile.mock.calls[0][1]).toBe(request.id)
    expect(reconcile.mock.calls[0][2]).toEqual({ outcome: 'confirmed_done', result_id: 'chatcmpl-9', actor: 'ana', reason: 'in the provider log' })
    expect((await screen.findByRole('status')).textContent).toMatch(/now done.*audit log/)
  })

  it('confirms a checked selection as not executed at once, and says what it left', async () => {
    // spec: I4
    reconcileBulk.mockResolvedValue({ reconciled: 1, refused: [] })
    show(null)
    await screen.findByTestId(`unknown-${request.id}`)
    expect(screen.queryByTestId('bulk-form')).toBeNull()
    fireEvent.click(screen.getByLabelText(`Select ${request.id}`))
    const submit = screen.getByTestId('bulk-submit') as HTMLButtonElement
    expect(submit.textContent).toBe('Confirm 1 not executed')
    fireEvent.change(screen.getByLabelText('Your name'), { target: { value: 'ana' } })
    expect(submit.disabled).toBe(true)
    fireEvent.change(screen.getByTestId('bulk-reason'), { target: { value: 'provider outage, nothing billed' } })
    fireEvent.click(submit)
    await waitFor(() => expect(reconcileBulk).toHaveBeenCalledTimes(1))
    expect(reconcileBulk.mock.calls[0][1]).toEqual({ ids: [request.id], actor: 'ana', reason: 'provider outage, nothing billed' })
    expect((await screen.findByTestId('bulk-result')).textContent).toMatch(/1 confirmed not executed/)
  })

  it('says what a refused reconciliation was refused for', async () => {
    reconcile.mockRejectedValue(new Error('request x is `done`, not unknown: there is nothing to reconcile (ken reconciled it already)'))
    show(request.id)
    await screen.findByTestId('reconcile-form')
    fireEvent.click(screen.getByTestId('outcome-not-executed'))
    fireEvent.change(screen.getByTestId('reconcile-actor'), { target: { value: 'ana' } })
    fireEvent.change(screen.getByTestId('reconcile-reason'), { target: { value: 'no trace' } })
    fireEvent.click(screen.getByTestId('reconcile-submit'))
    expect((await screen.findByRole('alert')).textContent).toMatch(/ken reconciled it already/)
  })
})
