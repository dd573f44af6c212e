// The N2 scorecard as an operator reads it after an incident: each route, then the gateway
// overall, over the three periods one under the other; the review flags with who must
// decide, escalations first; a drill marked before any figure; a run or a route picked
// from the page, each with its own URL.
import { QueryClient, QueryClientProvider } from '@tanstack/react-query'
import { cleanup, fireEvent, render, screen, waitFor, within } from '@testing-library/react'
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest'
import type { Scorecard } from './bindings/Scorecard'
import { DRILL_RUN, ROUTE, RUN, listOf, scorecardOf, summaryOf } from './recoveryFixtures'
import { ScorecardView } from './Scorecard'
import { useRoute } from './router'

let card: Scorecard

function json(body: unknown, status = 200): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json' } })
}

const fetchMock = vi.fn(async (input: RequestInfo | URL): Promise<Response> => {
  const url = new URL(String(input))
  if (url.pathname === '/admin/v1/recoveries') {
    return json(listOf({ runs: [summaryOf(), summaryOf({ id: DRILL_RUN, drill: 'server_errors', step: 'closed', opened_at: Date.now() - 86_400_000 })] }))
  }
  if (url.pathname === '/admin/v1/scorecard') {
    const run = url.searchParams.get('run')
    if (run && run !== RUN && run !== DRILL_RUN) return json({ error: `No recovery run ${run}.` }, 404)
    return json(card)
  }
  return json({ error: `nothing at ${url}` }, 404)
})

const scorecardCalls = () => fetchMock.mock.calls.map(([u]) => String(u)).filter((u) => u.includes('/admin/v1/scorecard'))

function Routed() {
  const r = useRoute()
  return r.view === 'scorecard' ? <ScorecardView conn={{ url: 'http://127.0.0.1:1', token: 't' }} run={r.run} route={r.route} /> : null
}

function show(path: string) {
  history.pushState(null, '', path)
  return render(
    <QueryClientProvider client={new QueryClient({ defaultOptions: { queries: { retry: false } } })}>
      <Routed />
    </QueryClientProvider>,
  )
}

beforeEach(() => {
  card = scorecardOf()
  vi.stubGlobal('fetch', fetchMock)
})

afterEach(() => {
  cleanup()
  vi.unstubAllGlobals()
  fetchMock.mockClear()
  history.pushState(null, '', '/')
})

describe('ScorecardView', () => {
  it('shows the three periods for each route, then overall', async () => {
    // spec: N2
    show(`/scorecard?run=${RUN}`)
    const article = await screen.findByTestId('scorecard')
    expect(scorecardCalls()).toEqual([`http://127.0.0.1:1/admin/v1/scorecard?run=${RUN}`])
    expect(article.getAttribute('data-drill')).toBe('false')
    expect(screen.queryByTestId('scorecard-drill')).toBeNull()
    expect(within(article).getByRole('heading', { level: 3 }).textContent).toBe(`Run ${RUN} on ${ROUTE}`)
    expect(screen.getByTestId('scorecard-period-before').textContent).toMatch(/^Before: the 28 days before the incident, .* UTC to .* UTC$/)
    expect(screen.getByTestId('scorecard-period-incident').textContent).toMatch(/^Incident: /)
    expect(screen.getByTestId('scorecard-period-after').textContent).toMatch(/^After: the 60 minutes after the run closed/)
    const table = screen.getByTestId('scorecard-table')
    const headers = Array.from(table.querySelectorAll('thead th')).map((h) => h.textContent)
    expect(headers).toEqual([
      'Route · period', 'Requests', 'Attempts', 'Amplification', 'Success', 'Post-retry success', 'P50 / P95', 'Wait P50 / P95',
      'Cost incl. failures', 'Unpriced', 'Duplicates', 'Unknowns', 'Error mix',
    ])
    // Routes first, the gateway overall last; each with before, incident and after.
    expect(within(table).getAllByTestId(/^scorecard-route-/).map((g) => g.getAttribute('data-testid'))).toEqual([`scorecard-route-${ROUTE}`, 'scorecard-route-overall'])
    for (const r of [ROUTE, 'overall']) {
      const rows = within(screen.getByTestId(`scorecard-route-${r}`)).getAllByTestId(/^scorecard-row-/)
      expect(rows.map((x) => x.getAttribute('data-testid'))).toEqual(['before', 'incident', 'after'].map((p) => `scorecard-row-${r}-${p}`))
    }
    expect(screen.getByTestId(`scorecard-row-${ROUTE}-before`).textContent).toMatch(/^Before400,0001,2601\.05 ×.*none$/)
    expect(screen.getByTestId(`scorecard-row-${ROUTE}-incident`).textContent).toMatch(/^Incident1,2001,2602\.40 ×62 %.*420 ms \/ 1\.30 s2 ms \/ 40 ms\$1\.23002server error 30 · rate limit 6$/)
    expect(screen.getByTestId(`scorecard-row-${ROUTE}-after`).textContent).toMatch(/^After300.*\$1\.23010server error 30 · rate limit 6$/)
    expect(screen.getByTestId('scorecard-row-overall-before').textContent).toMatch(/^Before900,000/)
  })

  it('lists the review flags with who must decide, escalations first and marked', async () => {
    // spec: N2
    show(`/scorecard?run=${RUN}`)
    const flags = await screen.findByTestId('scorecard-flags')
    expect(screen.getByTestId('scorecard-flags-summary').textContent).toBe('2 flag(s) need a decision, 1 of them escalated.')
    const first = within(flags).getByTestId('scorecard-flag-0')
    expect(first.getAttribute('data-escalation')).toBe('true')
    expect(first.className).toBe('escalation')
    expect(first.textContent).toMatch(/duplicate_after_recovery.*openai\/gpt-4o-mini.*1 idempotency key completed twice after recovery/)
    expect(within(first).getByTestId('scorecard-flag-decide').textContent).toBe('platform operations and business owner')
    expect(within(first).getByText('escalation')).toBeTruthy()
    const second = within(flags).getByTestId('scorecard-flag-1')
    expect(second.getAttribute('data-escalation')).toBe('false')
    expect(within(second).getByTestId('scorecard-flag-decide').textContent).toBe('platform operations')
  })

  it('says when nothing needs a decision', async () => {
    card = scorecardOf({ flags: [] })
    show(`/scorecard?run=${RUN}`)
    expect((await screen.findByTestId('scorecard-flags')).textContent).toMatch(/None: nothing in these figures needs a decision/)
  })

  it('marks a drill before any figure', async () => {
    // spec: N3
    card = scorecardOf({ run: DRILL_RUN, drill: true })
    show(`/scorecard?run=${DRILL_RUN}`)
    const article = await screen.findByTestId('scorecard')
    expect(article.getAttribute('data-drill')).toBe('true')
    expect(screen.getByTestId('scorecard-drill').textContent).toBe('DRILL')
    expect(screen.getByTestId('scorecard-drill-banner').textContent).toMatch(/^DRILL\. .*simulated channels.*not read it as a real incident/)
  })

  it('picks a run from the list, or a route, each with its own URL', async () => {
    show('/scorecard')
    expect((await screen.findByTestId('scorecard-none')).textContent).toMatch(/Choose a run or a route/)
    const option = await screen.findByRole('option', { name: new RegExp(`^${DRILL_RUN} · ${ROUTE} · DRILL`) })
    expect(option).toBeTruthy()
    await screen.findByRole('option', { name: new RegExp(`^${RUN} · ${ROUTE} · opened`) })
    expect(scorecardCalls()).toEqual([])
    fireEvent.change(screen.getByTestId('scorecard-run'), { target: { value: RUN } })
    await waitFor(() => expect(window.location.pathname + window.location.search).toBe(`/scorecard?run=${RUN}`))
    await screen.findByTestId('scorecard')
    expect(scorecardCalls()).toEqual([`http://127.0.0.1:1/admin/v1/scorecard?run=${RUN}`])
    fireEvent.change(screen.getByTestId('scorecard-route'), { target: { value: ROUTE } })
    fireEvent.click(screen.getByTestId('scorecard-route-show'))
    await waitFor(() => expect(window.location.search).toBe('?route=openai%2Fgpt-4o-mini'))
    await waitFor(() => expect(scorecardCalls()).toContain('http://127.0.0.1:1/admin/v1/scorecard?route=openai%2Fgpt-4o-mini'))
    expect((screen.getByTestId('scorecard-run') as HTMLSelectElement).value).toBe('')
  })

  it('says why when the scorecard cannot be read', async () => {
    show('/scorecard?run=rc_nope')
    const err = await screen.findByTestId('scorecard-error')
    expect(err.getAttribute('role')).toBe('alert')
    expect(err.textContent).toBe('No recovery run rc_nope.')
  })
})
