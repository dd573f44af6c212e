// Keys as an operator handles them: a key is made only with a name, an owner, who and why;
// its secret is shown this once and is gone when dismissed (never in storage); a key made
// here is revoked after a step that says what revoking does; config keys say where they live.
import { QueryClient, QueryClientProvider } from '@tanstack/react-query'
import { cleanup, fireEvent, render, screen, waitFor, within } from '@testing-library/react'
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest'
import type { CostView } from './bindings/CostView'
import type { KeyView } from './bindings/KeyView'
import type { MadeKey } from './bindings/MadeKey'
import { KeysView } from './Keys'

const now = 1_780_000_000_000
const SECRET = 'swk_live_7Qm2xZp9Lr4Tb8Vn'

const configKey: KeyView = {
  name: 'billing', owner: 'team-pay', origin: 'config', hint: null, rpm: 600, max_concurrency: 8, spend_limit_usd: null,
  spent_usd: 3.25, created_at: null, created_by: null, revoked_at: null, revoked_by: null,
}
const consoleKey: KeyView = {
  name: 'ci-bot', owner: 'demo', origin: 'console', hint: 'swk_live_3f', rpm: null, max_concurrency: null, spend_limit_usd: 50,
  spent_usd: 0.42, created_at: now - 86_400_000, created_by: 'ana', revoked_at: null, revoked_by: null,
}
const costs: CostView = {
  now, time_zone: 'UTC', since: now - 3_600_000, bucket_ms: 60_000, cells: [],
  owners: [
    { name: 'demo', balance_usd: 12, prepaid: true, daily_budget_usd: null, spent_today_usd: 0 },
    { name: 'team-pay', balance_usd: 0, prepaid: false, daily_budget_usd: 20, spent_today_usd: 3 },
  ],
  keys: [], routes: [], pricing: { version: 'abc', origin: 'built-in pricing.yaml', stale_after_days: 30, models: [] }, unpriced_models: [],
}
const made: MadeKey = {
  secret: SECRET,
  key: { ...consoleKey, name: 'new-bot', hint: 'swk_live_7Q', spend_limit_usd: 25, spent_usd: 0, created_at: now, created_by: 'ana' },
}

let revoked = false

function json(body: unknown, status = 200): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json' } })
}

const fetchMock = vi.fn(async (input: RequestInfo | URL, init?: RequestInit): Promise<Response> => {
  const url = String(input)
  const post = init?.method === 'POST'
  if (url.endsWith('/admin/v1/keys') && !post) {
    return json([configKey, revoked ? { ...consoleKey, revoked_at: now, revoked_by: 'ana' } : consoleKey])
  }
  if (url.endsWith('/admin/v1/costs?hours=1') && !post) return json(costs)
  if (url.endsWith('/admin/v1/keys') && post) return json(made, 201)
  if (url.endsWith('/admin/v1/keys/ci-bot/revoke') && post) {
    revoked = true
    return json({ ...consoleKey, revoked_at: now, revoked_by: 'ana' })
  }
  if (url.endsWith('/admin/v1/keys/ci-bot/spend-limit') && post) return json({ ...consoleKey, spend_limit_usd: null })
  return json({ error: `nothing at ${url}` }, 404)
})

function posted(suffix: string): { url: string; body: unknown } | null {
  const call = fetchMock.mock.calls.find(([u, i]) => String(u).endsWith(suffix) && i?.method === 'POST')
  return call ? { url: String(call[0]), body: JSON.parse(String(call[1]?.body)) } : null
}

function stored(): string {
  const all: string[] = []
  for (const s of [localStorage, sessionStorage]) {
    for (let i = 0; i < s.length; i++) {
      const k = s.key(i)
      if (k !== null) all.push(`${k}=${s.getItem(k) ?? ''}`)
    }
  }
  return all.join('\n')
}

function show() {
  return render(
    <QueryClientProvider client={new QueryClient({ defaultOptions: { queries: { retry: false } } })}>
      <KeysView conn={{ url: 'http://127.0.0.1:1', token: 't' }} />
    </QueryClientProvider>,
  )
}

beforeEach(() => {
  revoked = false
  vi.stubGlobal('fetch', fetchMock)
})

afterEach(() => {
  cleanup()
  vi.unstubAllGlobals()
  fetchMock.mockClear()
  localStorage.clear()
  sessionStorage.clear()
})

describe('KeysView', () => {
  it('lists every key with its owner, origin, limits and spend', async () => {
    // spec: B5
    show()
    const bot = await screen.findByTestId('key-ci-bot')
    expect(bot.textContent).toMatch(/ci-botdemoconsoleswk_live_3f…/)
    expect(bot.textContent).toMatch(/\$50\.00\$0\.4200/)
    expect(within(bot).getByTestId('key-status').textContent).toBe('active')
    const billing = screen.getByTestId('key-billing')
    expect(billing.textContent).toMatch(/billingteam-payconfig—600/)
    expect(billing.textContent).toMatch(/from the config; remove it there/)
    expect(within(billing).queryByTestId('revoke-billing')).toBeNull()
  })

  it('makes a key only when complete, shows its secret once, and forgets it when dismissed', async () => {
    // spec: B5
    show()
    await screen.findByRole('option', { name: 'demo' })
    const submit = screen.getByTestId('new-key-submit') as HTMLButtonElement
    expect(submit.disabled).toBe(true)
    fireEvent.change(screen.getByTestId('new-key-name'), { target: { value: 'new-bot' } })
    fireEvent.change(screen.getByTestId('new-key-owner'), { target: { value: 'demo' } })
    fireEvent.change(screen.getByTestId('new-key-limit'), { target: { value: '25' } })
    fireEvent.change(screen.getByTestId('new-key-actor'), { target: { value: 'ana' } })
    expect(submit.disabled).toBe(true)
    fireEvent.change(screen.getByTestId('new-key-reason'), { target: { value: 'nightly evaluation job' } })
    expect(submit.disabled).toBe(false)
    expect(screen.getByTestId('new-key-effect').textContent).toMatch(/Makes new-bot for demo, with a spend limit of \$25\.00/)
    fireEvent.click(submit)

    const secret = await screen.findByTestId('new-key-secret')
    expect(secret.textContent).toBe(SECRET)
    expect(posted('/admin/v1/keys')).toEqual({
      url: 'http://127.0.0.1:1/admin/v1/keys',
      body: { name: 'new-bot', owner: 'demo', rpm: null, max_concurrency: null, spend_limit_usd: 25, actor: 'ana', reason: 'nightly evaluation job' },
    })
    const panel = screen.getByTestId('new-key')
    expect(panel.textContent).toMatch(/Shown once: store it now/)
    expect(panel.textContent).toMatch(/keeps only its hash/)
    expect(screen.getAllByText(SECRET)).toHaveLength(1)
    expect(stored()).not.toContain(SECRET)

    fireEvent.click(screen.getByTestId('new-key-dismiss'))
    expect(screen.queryByTestId('new-key-secret')).toBeNull()
    expect(screen.queryByText(SECRET)).toBeNull()
    expect(screen.getByTestId('make-key-form')).toBeTruthy()
    expect(stored()).not.toContain(SECRET)
  })

  it('revokes a key made here after saying what revoking does', async () => {
    // spec: B5
    show()
    const bot = await screen.findByTestId('key-ci-bot')
    fireEvent.click(within(bot).getByTestId('revoke-ci-bot'))
    expect(screen.getByTestId('revoke-effect').textContent).toMatch(/requests with this key get 401 from now on; this cannot be undone/)
    const confirm = screen.getByTestId('revoke-confirm') as HTMLButtonElement
    expect(confirm.disabled).toBe(true)
    fireEvent.change(screen.getByTestId('revoke-actor'), { target: { value: 'ana' } })
    expect(confirm.disabled).toBe(true)
    fireEvent.change(screen.getByTestId('revoke-reason'), { target: { value: 'leaked in a CI log' } })
    expect(confirm.disabled).toBe(false)
    fireEvent.click(confirm)
    await waitFor(() => expect(posted('/revoke')).not.toBeNull())
    expect(posted('/revoke')).toEqual({
      url: 'http://127.0.0.1:1/admin/v1/keys/ci-bot/revoke',
      body: { actor: 'ana', reason: 'leaked in a CI log' },
    })
    expect((await screen.findByTestId('key-result')).textContent).toMatch(/ci-bot is revoked/)
    await waitFor(() => expect(within(screen.getByTestId('key-ci-bot')).getByTestId('key-status').textContent).toMatch(/^revoked/))
    expect(within(screen.getByTestId('key-ci-bot')).queryByTestId('revoke-ci-bot')).toBeNull()
  })

  it('lifts a spend limit when the amount is left empty', async () => {
    // spec: B3
    show()
    const bot = await screen.findByTestId('key-ci-bot')
    fireEvent.click(within(bot).getByTestId('limit-ci-bot'))
    const value = screen.getByTestId('limit-value') as HTMLInputElement
    expect(value.value).toBe('50')
    fireEvent.change(value, { target: { value: '' } })
    expect(screen.getByTestId('limit-effect').textContent).toMatch(/No limit/)
    const submit = screen.getByTestId('limit-submit') as HTMLButtonElement
    expect(submit.textContent).toBe('Remove the limit')
    expect(submit.disabled).toBe(true)
    fireEvent.change(screen.getByTestId('limit-actor'), { target: { value: 'ana' } })
    fireEvent.change(screen.getByTestId('limit-reason'), { target: { value: 'budget moved to the owner' } })
    fireEvent.click(submit)
    await waitFor(() => expect(posted('/spend-limit')).not.toBeNull())
    expect(posted('/spend-limit')).toEqual({
      url: 'http://127.0.0.1:1/admin/v1/keys/ci-bot/spend-limit',
      body: { spend_limit_usd: null, actor: 'ana', reason: 'budget moved to the owner' },
    })
    expect((await screen.findByTestId('key-result')).textContent).toMatch(/ci-bot has no spend limit now/)
  })
})
