// The cost view as an operator reads it: spend with what retries cost, unknown cost never
// shown as zero, estimate against actual, who spent it, stale and missing prices said
// plainly, and a top-up that enables only with an amount, a name and a reason.
import { QueryClient, QueryClientProvider } from '@tanstack/react-query'
import { cleanup, fireEvent, render, screen, waitFor, within } from '@testing-library/react'
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest'
import type { CostCell } from './bindings/CostCell'
import type { CostView } from './bindings/CostView'
import type { OwnerView } from './bindings/OwnerView'
import { CostsView } from './Costs'

vi.mock('./Chart', () => ({ Chart: () => null }))

const now = 1_780_000_000_000
const hour = 3_600_000

function cell(c: Partial<CostCell>): CostCell {
  return {
    at: now - 2 * hour, owner: 'demo', key_name: 'ci-bot', route: 'openai/gpt-4o-mini', model: 'gpt-4o-mini', requests: 0,
    unknown_cost: 0, cost_usd: 0, failed_cost_usd: 0, retries: 0, estimated_usd: 0, estimated_actual_usd: 0,
    estimated_input_tokens: 0, actual_input_tokens: 0, ...c,
  }
}

const demo: OwnerView = { name: 'demo', balance_usd: -2.5, prepaid: true, daily_budget_usd: 10, spent_today_usd: 1.5 }
const teamPay: OwnerView = { name: 'team-pay', balance_usd: 0, prepaid: false, daily_budget_usd: null, spent_today_usd: 0.5 }

const view: CostView = {
  now,
  time_zone: 'Europe/Madrid',
  since: now - 24 * hour,
  bucket_ms: hour,
  cells: [
    cell({ requests: 10, cost_usd: 1.25, failed_cost_usd: 0.25, retries: 3, estimated_usd: 2, estimated_actual_usd: 1, estimated_input_tokens: 1300, actual_input_tokens: 1000 }),
    cell({ at: now - hour, owner: 'team-pay', key_name: 'billing', route: 'anthropic/claude-sonnet-4', model: 'claude-sonnet-4', requests: 4, unknown_cost: 1, cost_usd: 0.5, estimated_usd: 0.5, estimated_actual_usd: 0.5, estimated_input_tokens: 500, actual_input_tokens: 500 }),
    cell({ at: now - hour, requests: 2, cost_usd: 0.25 }),
  ],
  owners: [demo, teamPay],
  keys: [],
  routes: [
    { route: 'openai/gpt-4o-mini', daily_budget_usd: 4, spent_today_usd: 1.5, last_hour_usd: 0.25 },
    { route: 'anthropic/claude-sonnet-4', daily_budget_usd: null, spent_today_usd: 0.5, last_hour_usd: 0.5 },
  ],
  pricing: {
    version: '3f9a1c2b7d4e5f60',
    origin: 'built-in pricing.yaml',
    stale_after_days: 30,
    models: [
      {
        model: 'gpt-4o-mini', provider: 'openai', aliases: ['gpt-4o-mini-2024-07-18'], input: 0.15, cached_input: 0.075, cache_write: null, output: 0.6,
        long_context_above: null, long_input: null, long_output: null, checked: '2025-01-01', source: 'https://openai.com/api/pricing/', stale: true,
      },
      {
        model: 'claude-sonnet-4', provider: 'anthropic', aliases: [], input: 3, cached_input: 0.3, cache_write: 3.75, output: 15,
        long_context_above: 200_000, long_input: 6, long_output: 22.5, checked: '2026-05-20', source: 'https://www.anthropic.com/pricing', stale: false,
      },
    ],
  },
  unpriced_models: ['mystery-model'],
}

let current: CostView = view

function json(body: unknown, status = 200): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json' } })
}

const fetchMock = vi.fn(async (input: RequestInfo | URL, init?: RequestInit): Promise<Response> => {
  const url = String(input)
  if (url.endsWith('/admin/v1/costs?hours=24') && !init?.method) return json(current)
  if (url.endsWith('/admin/v1/owners/demo/top-up') && init?.method === 'POST') return json({ ...demo, balance_usd: 17.5 })
  return json({ error: `nothing at ${url}` }, 404)
})

function show() {
  return render(
    <QueryClientProvider client={new QueryClient({ defaultOptions: { queries: { retry: false } } })}>
      <CostsView conn={{ url: 'http://127.0.0.1:1', token: 't' }} />
    </QueryClientProvider>,
  )
}

beforeEach(() => {
  current = view
  vi.stubGlobal('fetch', fetchMock)
})

afterEach(() => {
  cleanup()
  vi.unstubAllGlobals()
  fetchMock.mockClear()
  localStorage.clear()
})

describe('CostsView', () => {
  it('shows spend, what retries cost, unknown cost and the estimate against the actual', async () => {
    // spec: M1, M3
    show()
    expect((await screen.findByTestId('tile-spend')).textContent).toBe('$2.00')
    expect(screen.getByTestId('tile-spend-sub').textContent).toBe('16 requests; 1 of unknown cost not in it')
    expect(screen.getByTestId('tile-failed').textContent).toBe('$0.2500')
    expect(screen.getByTestId('tile-failed-sub').textContent).toBe('13 % of spend · 3 retries')
    expect(screen.getByTestId('tile-unknown-cost').textContent).toBe('1')
    expect(screen.getByTestId('tile-estimate').textContent).toBe('60 %')
    expect(screen.getByTestId('tile-estimate-sub').textContent).toBe('input tokens estimated +20 % off')
    expect(screen.getByTestId('tile-pricing').textContent).toBe('3f9a1c2b7d')
    expect(screen.getByTestId('tile-pricing-sub').textContent).toBe('built-in pricing.yaml')
    expect(fetchMock.mock.calls[0][0]).toBe('http://127.0.0.1:1/admin/v1/costs?hours=24')
  })

  it('sums the cells by owner, key, route and model, biggest spend first', async () => {
    show()
    const owners = within(await screen.findByTestId('spend-by-owner')).getAllByRole('row')
    expect(owners).toHaveLength(3)
    expect(owners[1].textContent).toMatch(/^demo12\$1\.5075 %\$0\.25003/)
    expect(owners[2].textContent).toMatch(/^team-pay4\$0\.500025 %\$0\.00.*1$/)
    const routes = within(screen.getByTestId('spend-by-route')).getAllByRole('row')
    expect(routes[1].textContent).toMatch(/^openai\/gpt-4o-mini12\$1\.5075 %\$0\.25003/)
    expect(within(screen.getByTestId('spend-by-key')).getAllByRole('row')[1].textContent).toMatch(/^ci-bot/)
    expect(within(screen.getByTestId('spend-by-model')).getAllByRole('row')[2].textContent).toMatch(/^claude-sonnet-4/)
    // The charts' text alternative lists the buckets with traffic.
    expect(within(screen.getByTestId('spend-figures')).getAllByRole('row', { hidden: true })).toHaveLength(3)
  })

  it('says which prices are stale and which models have none', async () => {
    // spec: M1
    show()
    const stale = await screen.findByTestId('stale-prices')
    expect(stale.getAttribute('role')).toBe('status')
    expect(stale.textContent).toMatch(/1 price was checked more than 30 days ago: gpt-4o-mini \(2025-01-01\)/)
    expect(screen.getByTestId('unpriced-models').textContent).toMatch(/mystery-model.*never counted as zero; add them to the\s+pricing catalog/)
    expect(screen.getByTestId('price-gpt-4o-mini').textContent).toMatch(/stale/)
    expect(screen.getByTestId('price-claude-sonnet-4').textContent).not.toMatch(/stale/)
    const link = within(screen.getByTestId('price-claude-sonnet-4')).getByRole('link', { hidden: true })
    expect(link.getAttribute('rel')).toBe('noreferrer')
    expect(link.getAttribute('target')).toBe('_blank')
  })

  it('shows balances, 402 for a spent prepaid owner, and route budgets with the breaker threshold', async () => {
    // spec: B4
    show()
    const d = await screen.findByTestId('owner-demo')
    expect(within(d).getByTestId('owner-status').textContent).toBe('402: requests refused')
    expect(within(d).getByTestId('owner-balance').textContent).toBe('-$2.50')
    expect(within(screen.getByTestId('owner-team-pay')).getByTestId('owner-status').textContent).toBe('not prepaid (metered only)')
    const budgets = within(screen.getByTestId('route-budgets')).getAllByRole('row')
    expect(budgets[1].textContent).toMatch(/openai\/gpt-4o-mini\$4\.00\$1\.50\$0\.2500breaker opens above 25 % of the daily budget in an hour: \$1\.00/)
    expect(budgets[2].textContent).toMatch(/none.*dormant: no daily budget/)
  })

  it('says no traffic yet, not an error, when the window is empty', async () => {
    current = { ...view, cells: [], unpriced_models: [] }
    show()
    expect((await screen.findByTestId('costs-empty')).textContent).toMatch(/No traffic yet/)
    expect(screen.queryByRole('alert')).toBeNull()
    expect(screen.getByTestId('tile-spend').textContent).toBe('$0.00')
    expect(screen.queryByTestId('spend-by-owner')).toBeNull()
  })

  it('tops up only with an amount, a name and a reason, and shows the new balance', async () => {
    // spec: B4
    show()
    fireEvent.click(await screen.findByTestId('top-up-demo'))
    const form = screen.getByTestId('top-up-form')
    expect(form.textContent).toMatch(/A deficit is taken from the top-up first/)
    const submit = screen.getByTestId('top-up-submit') as HTMLButtonElement
    expect(submit.disabled).toBe(true)
    fireEvent.change(screen.getByTestId('top-up-amount'), { target: { value: '0' } })
    fireEvent.change(screen.getByTestId('top-up-actor'), { target: { value: 'ana' } })
    fireEvent.change(screen.getByTestId('top-up-reason'), { target: { value: 'invoice 7 paid' } })
    expect(submit.disabled).toBe(true)
    fireEvent.change(screen.getByTestId('top-up-amount'), { target: { value: '20' } })
    expect(screen.getByTestId('top-up-preview').textContent).toMatch(/Balance after: \$17\.50 \(\$2\.50 of it pays off the deficit\)/)
    expect(submit.disabled).toBe(false)
    expect(submit.textContent).toBe('Add $20.00')
    fireEvent.click(submit)
    await waitFor(() => expect(fetchMock.mock.calls.some(([u]) => String(u).endsWith('/top-up'))).toBe(true))
    const [url, init] = fetchMock.mock.calls.find(([u]) => String(u).endsWith('/top-up')) ?? []
    expect(url).toBe('http://127.0.0.1:1/admin/v1/owners/demo/top-up')
    expect(init?.method).toBe('POST')
    expect((init?.headers as Record<string, string>)['Content-Type']).toBe('application/json')
    expect(JSON.parse(String(init?.body))).toEqual({ amount_usd: 20, actor: 'ana', reason: 'invoice 7 paid' })
    expect((await screen.findByTestId('top-up-result')).textContent).toMatch(/demo's balance is now \$17\.50\./)
  })
})
