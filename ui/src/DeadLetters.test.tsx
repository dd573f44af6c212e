// The dead-letter inbox as an owner needs it (L1-L3): the evidence, the idempotency result
// and the estimate shown before anything is replayed; a replay form that enables only once
// every field is filled and sends what it showed; refusals named where the form is; a
// dead letter that cannot be replayed says why and offers no button; bulk replay only after
// a preview of what it covers and costs.
import { QueryClient, QueryClientProvider } from '@tanstack/react-query'
import { cleanup, fireEvent, render, screen, waitFor, within } from '@testing-library/react'
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest'
import type { BulkPreview } from './bindings/BulkPreview'
import type { DeadLetterDetail } from './bindings/DeadLetterDetail'
import { DeadLettersView } from './DeadLetters'
import { ID, jobOf, runOf } from './jobFixtures'
import { useRoute } from './router'

const STUCK = 'job_0000000000000000000000000000000b'
const NEW = 'job_0000000000000000000000000000000c'

const dead = jobOf({
  lane: 'dead_letter', state: 'dead_letter', reason: 'max_attempts_exhausted', attempt: 3, max_attempts: 3,
  last_error_type: 'overload', last_error: 'HTTP 503 from openai-sim', last_status: 503, estimated_cost_usd: 0.0123,
})
const stuck = jobOf({ ...dead, job_id: STUCK, reason: 'outcome_unknown', last_error_type: 'interrupted', last_error: 'the gateway stopped' })

const detail: DeadLetterDetail = {
  job: dead,
  evidence: [runOf('req-1', { state: 'failed', http_status: 503, error_class: 'overload', error_message: 'HTTP 503', attempts: 2 })],
  idempotency_result: 'no_side_effect_recorded',
  idempotency_detail: '3 run(s) under the key, none with a side effect on record',
  estimated_cost_usd: 0.0123,
  pricing_version: 'p-2026-05',
  routes: [
    { route: 'openai/gpt-4o-mini', kind: 'same_route', estimated_cost_usd: 0.0123, refused: null },
    { route: 'openai/gpt-4o', kind: 'approved_fallback', estimated_cost_usd: 0.2051, refused: null },
    { route: 'openai/gpt-4.1-mini', kind: 'approved_fallback', estimated_cost_usd: null, refused: 'the fallback contract does not hold: no price for the model' },
  ],
  replayable: true,
  not_replayable_because: null,
}
const stuckDetail: DeadLetterDetail = {
  ...detail,
  job: stuck,
  idempotency_result: 'outcome_unknown',
  idempotency_detail: 'request req-9 under the key has an unknown outcome; reconcile it in the Unknown outcomes inbox first',
  replayable: false,
  not_replayable_because: 'L3: request req-9 under the key has an unknown outcome; reconcile it in the Unknown outcomes inbox first',
}
const preview: BulkPreview = {
  count: 1, total_estimated_cost_usd: 0.0123, unknown_estimates: 0, replayable: [ID],
  refused: [{ id: STUCK, why: 'outcome_unknown: request req-9 under the key has an unknown outcome' }],
}

let replayAnswer: { status: number; body: unknown } | null = null
// Dead letters replayed so far: they leave the list, as on the gateway.
let replayed = new Set<string>()

function json(body: unknown, status = 200): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json' } })
}

const fetchMock = vi.fn(async (input: RequestInfo | URL, init?: RequestInit): Promise<Response> => {
  const url = String(input)
  const post = init?.method === 'POST'
  if (url.includes('/admin/v1/dead-letters?') && !post) return json([dead, stuck].filter((j) => !replayed.has(j.job_id)))
  if (url.endsWith('/admin/v1/dead-letters/replay-preview') && post) return json(preview)
  if (url.endsWith('/admin/v1/dead-letters/replay') && post) {
    replayed.add(ID)
    return json({ batch_id: 'batch_1', replayed: [{ dead_letter: ID, job_id: NEW }], refused: preview.refused, stop_after_failures: 2, total_estimated_cost_usd: 0.0123 }, 202)
  }
  if (url.endsWith(`/admin/v1/dead-letters/${ID}/replay`) && post) {
    if (replayAnswer) return json(replayAnswer.body, replayAnswer.status)
    replayed.add(ID)
    return json({ job_id: NEW, replay_of: ID, status_url: `/spillway/v1/jobs/${NEW}` }, 202)
  }
  if (url.endsWith(`/admin/v1/dead-letters/${ID}`) && !post) return json(detail)
  if (url.endsWith(`/admin/v1/dead-letters/${STUCK}`) && !post) return json(stuckDetail)
  if (url.endsWith(`/admin/v1/jobs/${NEW}`) && !post) {
    return json({ job: jobOf({ job_id: NEW, lane: null, state: 'succeeded', replay_of: ID, reason: `replay of ${ID}` }), evidence: [] })
  }
  return json({ error: `nothing at ${url}` }, 404)
})

function posted(suffix: string): unknown {
  const call = fetchMock.mock.calls.find(([u, i]) => String(u).endsWith(suffix) && i?.method === 'POST')
  return call ? JSON.parse(String(call[1]?.body)) : null
}

/** The view as the app mounts it: the selected dead letter comes from the URL. */
function Routed() {
  const r = useRoute()
  return r.view === 'deadletters' ? <DeadLettersView conn={{ url: 'http://127.0.0.1:1', token: 't' }} selected={r.id} /> : null
}

function show(path: string) {
  history.pushState(null, '', path)
  return render(
    <QueryClientProvider client={new QueryClient({ defaultOptions: { queries: { retry: false } } })}>
      <Routed />
    </QueryClientProvider>,
  )
}

/** Fills every field of the replay form but the cost review, on `route`. */
function fillAllButCost(route: string) {
  fireEvent.change(screen.getByTestId('replay-owner'), { target: { value: 'ana' } })
  fireEvent.change(screen.getByTestId('replay-kind'), { target: { value: 'provider_recovered' } })
  fireEvent.change(screen.getByTestId('replay-reason'), { target: { value: 'INC-42 resolved' } })
  fireEvent.click(screen.getByTestId(`replay-route-${route}`))
}

beforeEach(() => {
  replayAnswer = null
  replayed = new Set()
  vi.stubGlobal('fetch', fetchMock)
})

afterEach(() => {
  cleanup()
  vi.unstubAllGlobals()
  fetchMock.mockClear()
  localStorage.clear()
  history.pushState(null, '', '/')
})

describe('DeadLettersView', () => {
  it('lists each dead letter with why it gave up, its last error, attempts and estimate', async () => {
    // spec: L1
    show('/dead-letters')
    const row = await screen.findByTestId(`deadletter-${ID}`)
    expect(row.textContent).toMatch(/attempts exhausted/)
    expect(row.textContent).toMatch(/overload: HTTP 503 from openai-sim/)
    expect(row.textContent).toMatch(/3\/3/)
    expect(row.textContent).toMatch(/\$0\.0123/)
    expect(screen.getByTestId(`deadletter-${STUCK}`).textContent).toMatch(/outcome unknown/)
    expect(screen.getByTestId('deadletters-summary').textContent).toMatch(/2 dead letter\(s\); the oldest is 2 h old/)
  })

  it('filters on the server, minimum age included', async () => {
    show('/dead-letters')
    await screen.findByTestId(`deadletter-${ID}`)
    fireEvent.change(screen.getByTestId('filter-owner'), { target: { value: 'team-pay' } })
    fireEvent.change(screen.getByTestId('filter-min-age'), { target: { value: '30' } })
    fireEvent.click(screen.getByTestId('filter-apply'))
    await waitFor(() => expect(fetchMock.mock.calls.some(([u]) => String(u).endsWith('/admin/v1/dead-letters?owner=team-pay&min_age_ms=1800000&limit=200'))).toBe(true))
  })

  it('shows the evidence, the idempotency result and the estimate before any replay', async () => {
    // spec: L1, M3
    show(`/dead-letters/${ID}`)
    const panel = await screen.findByTestId('deadletter-detail')
    expect(within(panel).getByTestId('idempotency-result').textContent).toMatch(/no_side_effect_recorded.*3 run\(s\) under the key, none with a side effect/)
    expect(within(panel).getByTestId('cost-estimate').textContent).toMatch(/openai\/gpt-4o-mini is estimated at \$0\.0123.*pricing version p-2026-05/)
    const runs = within(panel).getByTestId('deadletter-runs')
    expect(runs.textContent).toMatch(/req-1.*failed.*503.*overload.*2/)
    expect(within(runs).getByText('req-1').getAttribute('href')).toBe('/ledger/req-1')
  })

  it('enables the replay only once every field is filled, and sends every L1 field with the shown estimate', async () => {
    // spec: L1
    show(`/dead-letters/${ID}`)
    await screen.findByTestId('replay-form')
    const submit = screen.getByTestId('replay-submit') as HTMLButtonElement
    const cost = screen.getByTestId('replay-cost-reviewed') as HTMLInputElement
    expect(submit.disabled).toBe(true)
    expect(cost.disabled).toBe(true)
    expect(screen.getByTestId('replay-missing').textContent).toMatch(/replay owner, reason kind, reason text, route, cost review/)
    // A route whose contract does not hold is not offered, and says why.
    expect((screen.getByTestId('replay-route-openai/gpt-4.1-mini') as HTMLInputElement).disabled).toBe(true)
    expect(screen.getByTestId('replay-routes').textContent).toMatch(/not offered: the fallback contract does not hold/)
    fillAllButCost('openai/gpt-4o')
    expect(submit.disabled).toBe(true)
    expect(screen.getByTestId('replay-missing').textContent).toBe('To replay, fill in: cost review.')
    expect(cost.parentElement?.textContent).toMatch(/I reviewed the estimate of \$0\.2051 for openai\/gpt-4o/)
    fireEvent.click(cost)
    expect(submit.disabled).toBe(false)
    // Another route has another estimate: it has to be reviewed again.
    fireEvent.click(screen.getByTestId('replay-route-openai/gpt-4o-mini'))
    expect(cost.checked).toBe(false)
    expect(submit.disabled).toBe(true)
    expect(cost.parentElement?.textContent).toMatch(/I reviewed the estimate of \$0\.0123 for openai\/gpt-4o-mini/)
    fireEvent.click(cost)
    expect(submit.disabled).toBe(false)
    expect((screen.getByTestId('replay-idempotency') as HTMLInputElement).readOnly).toBe(true)
    fireEvent.click(submit)
    await waitFor(() => expect(posted(`/dead-letters/${ID}/replay`)).not.toBeNull())
    expect(posted(`/dead-letters/${ID}/replay`)).toEqual({
      replay_owner: 'ana',
      replay_reason: { kind: 'provider_recovered', text: 'INC-42 resolved' },
      route_override: 'openai/gpt-4o-mini',
      idempotency_result: 'no_side_effect_recorded',
      cost_reviewed: { estimated_cost_usd: 0.0123 },
    })
    const result = await screen.findByTestId('replay-result')
    expect(result.textContent).toMatch(new RegExp(`Replayed ${ID} as job ${NEW}`))
    await waitFor(() => expect(screen.getByTestId('replay-state').textContent).toMatch(/succeeded/))
    expect(within(result).getByText('See it on the audit log.').getAttribute('href')).toBe('/audit')
    await waitFor(() => expect(screen.queryByTestId(`deadletter-${ID}`)).toBeNull())
    expect(window.location.pathname).toBe('/dead-letters')
  })

  it('shows a refused replay next to the form, naming the missing fields', async () => {
    // spec: L1
    replayAnswer = {
      status: 422,
      body: { error: 'Missing required field(s): replay_reason.text, cost_reviewed.', missing_fields: ['replay_reason.text', 'cost_reviewed'] },
    }
    show(`/dead-letters/${ID}`)
    await screen.findByTestId('replay-form')
    fillAllButCost('openai/gpt-4o-mini')
    fireEvent.click(screen.getByTestId('replay-cost-reviewed'))
    fireEvent.click(screen.getByTestId('replay-submit'))
    const err = await screen.findByTestId('replay-error')
    expect(err.getAttribute('role')).toBe('alert')
    expect(err.textContent).toMatch(/replay_reason\.text, cost_reviewed/)
    expect(screen.getByTestId('replay-reason').getAttribute('aria-invalid')).toBe('true')
    expect(screen.getByTestId('replay-cost-reviewed').getAttribute('aria-invalid')).toBe('true')
    expect(screen.getByTestId('replay-owner').getAttribute('aria-invalid')).toBeNull()
    expect(screen.queryByTestId('replay-result')).toBeNull()
  })

  it('says why a dead letter cannot be replayed, and offers no replay', async () => {
    // spec: L1, L3
    show(`/dead-letters/${STUCK}`)
    const refused = await screen.findByTestId('replay-refused')
    expect(refused.textContent).toMatch(/cannot be replayed.*request req-9 under the key has an unknown outcome/)
    expect(within(refused).getByText('Unknown outcomes').getAttribute('href')).toBe('/unknowns')
    expect(screen.getByTestId('idempotency-result').textContent).toMatch(/outcome_unknown/)
    expect(screen.queryByTestId('replay-form')).toBeNull()
    expect(screen.queryByTestId('replay-submit')).toBeNull()
  })

  it('replays checked rows in bulk only after a preview, with the previewed total and a stop condition', async () => {
    // spec: L2
    show('/dead-letters')
    await screen.findByTestId(`deadletter-${ID}`)
    fireEvent.click(screen.getByLabelText(`Select ${ID}`))
    expect(screen.getByTestId('bulk-replay').textContent).toMatch(/the 1 checked dead letter/)
    expect(screen.queryByTestId('bulk-form')).toBeNull()
    fireEvent.click(screen.getByTestId('bulk-preview-button'))
    const shown = await screen.findByTestId('bulk-preview')
    expect(posted('/replay-preview')).toEqual({
      filter: { state: null, lane: null, route: null, owner: null, workflow: null, error_class: null, min_age_ms: null, max_age_ms: null, ids: [ID], limit: null },
    })
    expect(shown.textContent).toMatch(/1 dead letter\(s\) would be replayed, for a total estimate of \$0\.0123/)
    expect(shown.textContent).toMatch(/1 would be refused/)
    expect(shown.textContent).toMatch(new RegExp(`${STUCK}: outcome_unknown`))
    const confirm = screen.getByTestId('bulk-replay-submit') as HTMLButtonElement
    expect(confirm.disabled).toBe(true)
    fireEvent.change(screen.getByTestId('bulk-owner'), { target: { value: 'ana' } })
    fireEvent.change(screen.getByTestId('bulk-kind'), { target: { value: 'quota_changed' } })
    fireEvent.change(screen.getByTestId('bulk-reason'), { target: { value: 'quota raised' } })
    fireEvent.change(screen.getByTestId('bulk-stop'), { target: { value: '2' } })
    expect(confirm.disabled).toBe(true)
    expect(screen.getByTestId('bulk-missing').textContent).toMatch(/cost review/)
    fireEvent.click(screen.getByTestId('bulk-cost-reviewed'))
    expect(confirm.disabled).toBe(false)
    fireEvent.click(confirm)
    await waitFor(() => expect(posted('/dead-letters/replay')).not.toBeNull())
    expect(posted('/dead-letters/replay')).toEqual({
      filter: { state: null, lane: null, route: null, owner: null, workflow: null, error_class: null, min_age_ms: null, max_age_ms: null, ids: [ID], limit: null },
      replay_owner: 'ana',
      replay_reason: { kind: 'quota_changed', text: 'quota raised' },
      cost_reviewed: { total_estimated_cost_usd: 0.0123, count: 1 },
      stop_after_failures: 2,
    })
    expect((await screen.findByTestId('bulk-replay-result')).textContent).toMatch(/1 dead letter\(s\) replayed.*stops after 2 failure/)
  })
})
