// Workflow policies as an operator needs them (J8): invalid edits first, each workflow's
// version in force and its versions on record newest first, a line diff against the one
// in force, and a roll back with who and why (refused, and said why, for built-in ones).
import { QueryClient, QueryClientProvider } from '@tanstack/react-query'
import { cleanup, fireEvent, render, screen, waitFor, within } from '@testing-library/react'
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest'
import type { PoliciesView } from './bindings/PoliciesView'
import { PoliciesView as PoliciesPage } from './Policies'
import { useRoute } from './router'

const t0 = 1_780_000_000_000
const view: PoliciesView = {
  dir: '/etc/spillway/workflows',
  workflows: [
    {
      workflow: 'nightly', description: 'Nightly evaluation batch', version: 'c3', source: '/etc/spillway/workflows/nightly.yaml', editable: true,
      versions: [
        { version: 'a1', source: '/etc/spillway/workflows/nightly.yaml', loaded_at: t0 },
        { version: 'c3', source: '/etc/spillway/workflows/nightly.yaml', loaded_at: t0 + 2000 },
        { version: 'b2', source: '/etc/spillway/workflows/nightly.yaml', loaded_at: t0 + 1000 },
      ],
    },
    {
      workflow: 'default', description: 'Built-in: interactive requests and background jobs without a workflow of their own',
      version: 'd0', source: 'built-in', editable: false, versions: [
        { version: 'd0', source: 'built-in', loaded_at: t0 },
        { version: 'dz', source: 'built-in', loaded_at: t0 - 1000 },
      ],
    },
  ],
  problems: [{ file: '/etc/spillway/workflows/broken.yaml', error: '3:5: unknown field `max_attemps`' }],
}

const texts: Record<string, string> = {
  a1: 'workflow: nightly\nmax_attempts: 3\nmax_length: 100\n',
  c3: 'workflow: nightly\nmax_attempts: 5\nmax_length: 100\npriority: low\n',
}

function json(body: unknown, status = 200): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json' } })
}

const fetchMock = vi.fn(async (input: RequestInfo | URL, init?: RequestInit): Promise<Response> => {
  const url = String(input)
  const post = init?.method === 'POST'
  if (url.endsWith('/admin/v1/policies') && !post) return json(view)
  const text = url.match(/\/admin\/v1\/policies\/nightly\/versions\/(\w+)$/)
  if (text && !post && texts[text[1]] !== undefined) {
    return json({ workflow: 'nightly', version: text[1], source: 'nightly.yaml', loaded_at: t0, text: texts[text[1]] })
  }
  if (url.endsWith('/admin/v1/policies/nightly/rollback') && post) return json({ workflow: 'nightly', version: 'a1' })
  return json({ error: `nothing at ${url}` }, 404)
})

function posted(suffix: string): unknown {
  const call = fetchMock.mock.calls.find(([u, i]) => String(u).endsWith(suffix) && i?.method === 'POST')
  return call ? JSON.parse(String(call[1]?.body)) : null
}

function Routed() {
  const r = useRoute()
  return r.view === 'policies' ? <PoliciesPage conn={{ url: 'http://127.0.0.1:1', token: 't' }} selected={r.workflow} /> : null
}

function show(path: string) {
  history.pushState(null, '', path)
  return render(
    <QueryClientProvider client={new QueryClient({ defaultOptions: { queries: { retry: false } } })}>
      <Routed />
    </QueryClientProvider>,
  )
}

beforeEach(() => vi.stubGlobal('fetch', fetchMock))

afterEach(() => {
  cleanup()
  vi.unstubAllGlobals()
  fetchMock.mockClear()
  localStorage.clear()
  history.pushState(null, '', '/')
})

describe('PoliciesView', () => {
  it('puts invalid edits first, and lists each workflow with its version, source and whether it can change', async () => {
    // spec: J8
    show('/policies')
    const problems = await screen.findByTestId('policy-problems')
    expect(problems.getAttribute('role')).toBe('alert')
    expect(problems.textContent).toMatch(/broken\.yaml: 3:5: unknown field `max_attemps`/)
    expect(problems.textContent).toMatch(/previous version of each stays in force/)
    expect(screen.getByTestId('policy-nightly').textContent).toMatch(/nightlyc3\/etc\/spillway\/workflows\/nightly\.yamleditableNightly evaluation batch3/)
    expect(screen.getByTestId('policy-default').textContent).toMatch(/built-in, read-only/)
    expect(screen.getByTestId('policies-source').textContent).toMatch(/\/etc\/spillway\/workflows/)
  })

  it('lists the versions newest first and diffs one against the version in force', async () => {
    // spec: J8
    show('/policies/nightly')
    const versions = await screen.findByTestId('policy-versions')
    const rows = within(versions).getAllByRole('row').slice(1)
    expect(rows.map((r) => r.getAttribute('data-testid'))).toEqual(['policy-version-c3', 'policy-version-b2', 'policy-version-a1'])
    expect(rows[0].textContent).toMatch(/in force/)
    expect(within(rows[0]).queryByRole('button')).toBeNull()
    fireEvent.click(screen.getByTestId('policy-diff-a1'))
    const diff = await screen.findByTestId('policy-diff')
    expect(diff.textContent?.split('\n').filter(Boolean)).toEqual([
      ' workflow: nightly',
      '-max_attempts: 3',
      '+max_attempts: 5',
      ' max_length: 100',
      '+priority: low',
    ])
    expect(screen.getByTestId('policy-diff-summary').textContent).toMatch(/2 line\(s\) added \(\+\), 1 removed/)
  })

  it('rolls back with a name and a reason, and says what it did', async () => {
    // spec: J8
    show('/policies/nightly')
    fireEvent.click(await screen.findByTestId('policy-rollback-a1'))
    const submit = screen.getByTestId('rollback-submit') as HTMLButtonElement
    expect(submit.disabled).toBe(true)
    fireEvent.change(screen.getByTestId('rollback-actor'), { target: { value: 'ana' } })
    expect(submit.disabled).toBe(true)
    fireEvent.change(screen.getByTestId('rollback-reason'), { target: { value: 'c3 doubled the retries' } })
    expect(submit.disabled).toBe(false)
    fireEvent.click(submit)
    await waitFor(() => expect(posted('/rollback')).not.toBeNull())
    expect(posted('/rollback')).toEqual({ version: 'a1', actor: 'ana', reason: 'c3 doubled the retries' })
    expect((await screen.findByTestId('rollback-result')).textContent).toMatch(/nightly is at version a1 now.*audit log/)
  })

  it('refuses a roll back of a built-in workflow, and says why', async () => {
    // spec: J8
    show('/policies/default')
    fireEvent.click(await screen.findByTestId('policy-rollback-dz'))
    expect(screen.getByTestId('rollback-readonly').textContent).toMatch(/Read-only: default is built in, not read from a file in \/etc\/spillway\/workflows/)
    expect((screen.getByTestId('rollback-submit') as HTMLButtonElement).disabled).toBe(true)
    expect((screen.getByTestId('rollback-actor') as HTMLInputElement).disabled).toBe(true)
  })
})
