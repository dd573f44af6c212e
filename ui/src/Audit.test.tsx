// The audit log as an operator reads it: newest first, who, what and why, the figures
// readable, and filtered on the server by kind and subject.
import { QueryClient, QueryClientProvider } from '@tanstack/react-query'
import { cleanup, fireEvent, render, screen, waitFor } from '@testing-library/react'
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest'
import type { AuditEntry } from './bindings/AuditEntry'
import { AuditView, prettyFigures } from './Audit'

const entries: AuditEntry[] = [
  {
    id: 42, at: 1_780_000_002_000, kind: 'replay', subject: 'job_a', actor: 'ana', action: 'replayed', trigger: null,
    reason: 'provider_recovered: INC-42 resolved',
    figures: '[{"name":"new_job","value":"job_c"},{"name":"estimated_cost_usd","value":0.0123}]',
  },
  {
    id: 41, at: 1_780_000_001_000, kind: 'breaker', subject: 'openai/gpt-4o-mini', actor: 'gateway', action: 'closed->open',
    trigger: 'server_errors', reason: '27 of the last 50 attempts failed', figures: null,
  },
]

function json(body: unknown, status = 200): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json' } })
}

const fetchMock = vi.fn(async (input: RequestInfo | URL): Promise<Response> => {
  const url = new URL(String(input))
  if (url.pathname === '/admin/v1/audit') {
    const kind = url.searchParams.get('kind')
    return json(entries.filter((e) => !kind || e.kind === kind))
  }
  return json({ error: 'nothing here' }, 404)
})

function show() {
  return render(
    <QueryClientProvider client={new QueryClient({ defaultOptions: { queries: { retry: false } } })}>
      <AuditView conn={{ url: 'http://127.0.0.1:1', token: 't' }} />
    </QueryClientProvider>,
  )
}

beforeEach(() => vi.stubGlobal('fetch', fetchMock))

afterEach(() => {
  cleanup()
  vi.unstubAllGlobals()
  fetchMock.mockClear()
})

describe('AuditView', () => {
  it('lists entries newest first with time, kind, subject, actor, action, reason and figures', async () => {
    // spec: G4, L1
    show()
    const replay = await screen.findByTestId('audit-42')
    expect(replay.textContent).toMatch(/2026-05-28 20:26:42.*replay.*job_a.*ana.*replayed.*provider_recovered: INC-42 resolved/)
    expect(replay.querySelector('pre')?.textContent).toContain('"name": "new_job"')
    const breaker = screen.getByTestId('audit-41')
    expect(breaker.textContent).toMatch(/closed → open/)
    expect(breaker.textContent).toMatch(/trigger: 5xx from the provider/)
    expect(screen.getByRole('link', { name: 'openai/gpt-4o-mini' }).getAttribute('href')).toBe('/breakers/openai/gpt-4o-mini')
    const rows = screen.getByTestId('audit-table').querySelectorAll('tbody tr')
    expect([...rows].map((r) => r.getAttribute('data-testid'))).toEqual(['audit-42', 'audit-41'])
    expect(String(fetchMock.mock.calls[0][0])).toBe('http://127.0.0.1:1/admin/v1/audit?limit=50')
  })

  it('filters by kind and subject on the server', async () => {
    show()
    await screen.findByTestId('audit-42')
    fireEvent.change(screen.getByTestId('audit-kind'), { target: { value: 'breaker' } })
    await waitFor(() => expect(screen.queryByTestId('audit-42')).toBeNull())
    expect(screen.getByTestId('audit-41')).toBeTruthy()
    fireEvent.change(screen.getByTestId('audit-subject'), { target: { value: 'openai/gpt-4o-mini' } })
    fireEvent.click(screen.getByRole('button', { name: 'Filter' }))
    await waitFor(() => expect(fetchMock.mock.calls.some(([u]) => String(u) === 'http://127.0.0.1:1/admin/v1/audit?limit=50&kind=breaker&subject=openai%2Fgpt-4o-mini')).toBe(true))
  })

  it('prettifies figures, and leaves text that is not JSON as it is', () => {
    expect(prettyFigures('[{"name":"jobs","value":3}]')).toBe('[\n  {\n    "name": "jobs",\n    "value": 3\n  }\n]')
    expect(prettyFigures('not json')).toBe('not json')
    expect(prettyFigures(null)).toBeNull()
    expect(prettyFigures('[]')).toBeNull()
  })
})
