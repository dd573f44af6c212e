// Guided recovery as an operator needs it (O1–O5, N3): the runs with open ones first and
// drills marked; a suggested run where a breaker is open; a start form that drills only
// simulated routes; a checklist that says for each step whether it is done and by whom;
// only the current step's form, each asking who acts; a held run that says which role
// must still approve; a close that stays shut, and says why, while O4 is unmet; files
// fetched with the admin token.
import { QueryClient, QueryClientProvider } from '@tanstack/react-query'
import { cleanup, fireEvent, render, screen, waitFor, within } from '@testing-library/react'
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest'
import type { RecoveryList } from './bindings/RecoveryList'
import type { RecoveryView } from './bindings/RecoveryView'
import { DRILL_RUN, ROUTE, RUN, STARTED, listOf, now, runOf, stepsAt, summaryOf } from './recoveryFixtures'
import { RecoveriesView, probeP95 } from './Recovery'
import { useRoute } from './router'

const BROKEN = 'gemini/gemini-2.5-flash'

let list: RecoveryList
let runs: Record<string, RecoveryView>
/** What each action does to the run, by its path suffix (`isolate`, `probes`, ...). */
let moves: Record<string, (v: RecoveryView) => RecoveryView>
/** A refusal to answer instead, by path suffix. */
let refusals: Record<string, { status: number; body: unknown }>

function json(body: unknown, status = 200): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json' } })
}

const fetchMock = vi.fn(async (input: RequestInfo | URL, init?: RequestInit): Promise<Response> => {
  const url = String(input)
  const post = init?.method === 'POST'
  const path = new URL(url).pathname
  if (path === '/admin/v1/recoveries' && !post) return json(list)
  if (path === '/admin/v1/recoveries' && post) {
    const body = JSON.parse(String(init?.body)) as { route: string; drill?: RecoveryView['drill'] }
    const v = runOf({ id: DRILL_RUN, route: body.route, drill: body.drill ?? null })
    runs[v.id] = v
    return json(v, 201)
  }
  const m = /^\/admin\/v1\/recoveries\/([^/]+)(?:\/(.+))?$/.exec(path)
  if (m) {
    const id = decodeURIComponent(m[1])
    const action = m[2]
    if (!action && !post) return runs[id] ? json(runs[id]) : json({ error: `No recovery run ${id}.` }, 404)
    if (action && post) {
      if (refusals[action]) return json(refusals[action].body, refusals[action].status)
      if (moves[action] && runs[id]) {
        runs[id] = moves[action](runs[id])
        return json(runs[id])
      }
    }
    if (action === 'report.md' && !post) {
      return new Response(`# Recovery ${id} (DRILL)\n`, {
        status: 200, headers: { 'Content-Type': 'text/markdown', 'Content-Disposition': `attachment; filename="recovery-${id}.md"` },
      })
    }
  }
  return json({ error: `nothing at ${url}` }, 404)
})

function posted(suffix: string): unknown {
  const call = fetchMock.mock.calls.find(([u, i]) => String(u).endsWith(suffix) && i?.method === 'POST')
  return call ? JSON.parse(String(call[1]?.body)) : null
}

/** The view as the app mounts it: the selected run comes from the URL. */
function Routed() {
  const r = useRoute()
  return r.view === 'recovery' ? <RecoveriesView conn={{ url: 'http://127.0.0.1:1', token: 't' }} selected={r.id} /> : null
}

function show(path: string) {
  history.pushState(null, '', path)
  return render(
    <QueryClientProvider client={new QueryClient({ defaultOptions: { queries: { retry: false } } })}>
      <Routed />
    </QueryClientProvider>,
  )
}

/** `v` on the gateway, and in its list of runs. */
function withRun(v: RecoveryView) {
  runs[v.id] = v
  list = listOf({ runs: [summaryOf({ id: v.id, drill: v.drill, step: v.step, held: v.held })] })
}

beforeEach(() => {
  list = listOf()
  runs = {}
  moves = {}
  refusals = {}
  vi.stubGlobal('fetch', fetchMock)
})

afterEach(() => {
  cleanup()
  vi.unstubAllGlobals()
  vi.restoreAllMocks()
  fetchMock.mockClear()
  localStorage.clear()
  history.pushState(null, '', '/')
})

describe('RecoveriesView: the list and the start form', () => {
  it('lists open runs first, marks drills, and suggests a run where a breaker is open', async () => {
    // spec: O1, N3
    list = listOf({
      runs: [
        summaryOf({ id: 'rc_old', step: 'closed', opened_at: STARTED - 86_400_000, closed_at: STARTED - 80_000_000 }),
        summaryOf({ id: DRILL_RUN, drill: 'server_errors', step: 'resume', stage_pct: 50, held: true }),
      ],
      suggestions: [{ route: BROKEN, breaker_opened_at: now - 5 * 60_000, reason: '25 of the last 50 attempts failed' }],
    })
    show('/recovery')
    const rows = await screen.findAllByTestId(/^recovery-run-rc_/)
    expect(rows.map((r) => r.getAttribute('data-testid'))).toEqual([`recovery-run-${DRILL_RUN}`, 'recovery-run-rc_old'])
    expect(within(rows[0]).getByTestId('recovery-run-drill').textContent).toBe('DRILL')
    expect(rows[0].textContent).toMatch(/Resume in stages.*50 %.*held/)
    expect(within(rows[1]).queryByTestId('recovery-run-drill')).toBeNull()
    expect(rows[1].textContent).toMatch(/incident.*Closed/)
    const suggestion = screen.getByTestId(`recovery-suggestion-${BROKEN}`)
    expect(suggestion.textContent).toMatch(/Breaker open on gemini\/gemini-2\.5-flash since .*UTC \(5 min ago\): 25 of the last 50 attempts failed/)
    fireEvent.click(within(suggestion).getByTestId(`recovery-suggestion-start-${BROKEN}`))
    expect((screen.getByTestId('recovery-start-route') as HTMLSelectElement).value).toBe(BROKEN)
  })

  it('drills only a simulated route, and opens the run with who and why', async () => {
    // spec: N3, O1
    list = listOf({ suggestions: [{ route: BROKEN, breaker_opened_at: now - 60_000, reason: '429s for 3 min' }] })
    show('/recovery')
    const start = (await screen.findByTestId('recovery-start')) as HTMLButtonElement
    expect(start.disabled).toBe(true)
    expect(screen.getByTestId('recovery-start-missing').textContent).toMatch(/route, reason, your name/)
    expect(screen.getByTestId('recovery-drill-routes').textContent).toMatch(/openai\/gpt-4o-mini, anthropic\/claude-haiku-4-5/)
    const broken = () => screen.getByRole('option', { name: /^gemini\/gemini-2\.5-flash/ }) as HTMLOptionElement
    expect(broken().disabled).toBe(false)
    fireEvent.change(screen.getByTestId('recovery-start-drill'), { target: { value: 'server_errors' } })
    // A route with a real provider is not offered for a drill.
    expect(broken().disabled).toBe(true)
    fireEvent.change(screen.getByTestId('recovery-start-route'), { target: { value: ROUTE } })
    fireEvent.change(screen.getByTestId('recovery-start-reason'), { target: { value: 'quarterly drill' } })
    fireEvent.change(screen.getByTestId('recovery-start-actor'), { target: { value: 'ana' } })
    // Two keys: the drill's own traffic needs one named.
    expect(start.disabled).toBe(true)
    expect(screen.getByTestId('recovery-start-missing').textContent).toMatch(/the key the drill’s traffic runs as/)
    fireEvent.change(screen.getByTestId('recovery-start-key'), { target: { value: 'demo' } })
    expect(start.disabled).toBe(false)
    expect(start.textContent).toBe(`Start a drill on ${ROUTE}`)
    fireEvent.click(start)
    await waitFor(() => expect(posted('/admin/v1/recoveries')).not.toBeNull())
    expect(posted('/admin/v1/recoveries')).toEqual({ route: ROUTE, actor: 'ana', reason: 'quarterly drill', drill: 'server_errors', key: 'demo' })
    await waitFor(() => expect(window.location.pathname).toBe(`/recovery/${DRILL_RUN}`))
    const detail = await screen.findByTestId('recovery-detail')
    expect(detail.getAttribute('data-drill')).toBe('true')
    expect(screen.getByTestId('recovery-drill').textContent).toMatch(/^DRILL · server errors/)
    expect(screen.getByTestId('recovery-drill-banner').textContent).toMatch(/No real\s+provider or customer is involved/)
  })

  it('sends no drill for a real recovery', async () => {
    list = listOf({ suggestions: [{ route: BROKEN, breaker_opened_at: null, reason: 'opened by hand' }] })
    show('/recovery')
    await screen.findByTestId('recovery-start-form')
    fireEvent.change(screen.getByTestId('recovery-start-route'), { target: { value: BROKEN } })
    fireEvent.change(screen.getByTestId('recovery-start-reason'), { target: { value: 'INC-7' } })
    fireEvent.change(screen.getByTestId('recovery-start-actor'), { target: { value: 'ana' } })
    fireEvent.click(screen.getByTestId('recovery-start'))
    await waitFor(() => expect(posted('/admin/v1/recoveries')).toEqual({ route: BROKEN, actor: 'ana', reason: 'INC-7' }))
  })
})

describe('RecoveriesView: a run', () => {
  it('shows each step of the checklist with its status and who did it', async () => {
    // spec: O1
    withRun(runOf({ step: 'confirm' }))
    show(`/recovery/${RUN}`)
    await screen.findByTestId('recovery-checklist')
    const step = (s: string) => screen.getByTestId(`recovery-step-${s}`)
    for (const s of ['isolate', 'preserve', 'roll_back']) {
      expect(step(s).getAttribute('data-status')).toBe('done')
      expect(within(step(s)).getByTestId('recovery-step-status').textContent).toBe('done')
      expect(within(step(s)).getByTestId('recovery-step-who').textContent).toMatch(/^by ana at \d{4}-\d\d-\d\d /)
    }
    expect(within(step('isolate')).getByTestId('recovery-step-evidence').textContent).toMatch(/40 succeeded, 25 failed/)
    expect(step('confirm').getAttribute('data-status')).toBe('current')
    expect(step('confirm').getAttribute('aria-current')).toBe('step')
    expect(step('confirm').textContent).toMatch(/5 probes: 100 % success/)
    for (const s of ['resume', 'drain', 'close']) {
      expect(step(s).getAttribute('data-status')).toBe('pending')
      expect(within(step(s)).queryByTestId('recovery-step-who')).toBeNull()
    }
    // Only the current step's form.
    expect(screen.getByTestId('recovery-probes-form')).toBeTruthy()
    expect(screen.queryByTestId('recovery-isolate')).toBeNull()
    expect(screen.queryByTestId('recovery-close')).toBeNull()
    expect(screen.getByTestId('recovery-gate').textContent).toMatch(/paused.*retries are off/i)
  })

  it('names the gateway for a step it ended by itself', async () => {
    withRun(runOf({ step: 'close' }))
    show(`/recovery/${RUN}`)
    const drain = await screen.findByTestId('recovery-step-drain')
    expect(within(drain).getByTestId('recovery-step-who').textContent).toMatch(/^by the gateway at /)
  })

  it('isolates with a name, and the checklist moves on', async () => {
    // spec: O1
    withRun(runOf({ step: 'isolate' }))
    moves.isolate = (v) => ({
      ...v, step: 'preserve', steps: stepsAt('preserve'), concurrency_pct: 0, retries_on: false,
      split: { since: STARTED, succeeded: 40, failed: 25, unknown: 0 },
    })
    show(`/recovery/${RUN}`)
    const isolate = (await screen.findByTestId('recovery-isolate')) as HTMLButtonElement
    expect(isolate.disabled).toBe(true)
    expect(screen.getByTestId('recovery-isolate-form').textContent).toMatch(/503\s+recovery_hold/)
    fireEvent.change(screen.getByTestId('recovery-isolate-actor'), { target: { value: 'ana' } })
    fireEvent.click(isolate)
    await waitFor(() => expect(posted('/isolate')).toEqual({ actor: 'ana' }))
    await waitFor(() => expect(screen.getByTestId('recovery-step-isolate').getAttribute('data-status')).toBe('done'))
    expect(screen.getByTestId('recovery-result').textContent).toMatch(/Isolated openai\/gpt-4o-mini: retries off, the route paused; since .*: 40 succeeded, 25 failed, 0 unknown/)
    expect(screen.getByTestId('recovery-preserve-form')).toBeTruthy()
    expect(screen.getByTestId('recovery-split').textContent).toMatch(/40.*succeeded.*25.*failed.*0.*unknown outcome/)
    expect(localStorage.getItem('spillway.actor')).toBe('ana')
  })

  it('records that there is nothing to roll back only with a reason', async () => {
    // spec: O1
    withRun(runOf({ step: 'roll_back' }))
    moves.rollback = (v) => runOf({ ...v, step: 'confirm', steps: stepsAt('confirm') })
    show(`/recovery/${RUN}`)
    expect((await screen.findByTestId('recovery-rollback-nothing')).textContent).toMatch(/Nothing to roll back/)
    const none = screen.getByTestId('recovery-rollback-none') as HTMLButtonElement
    fireEvent.change(screen.getByTestId('recovery-rollback-actor'), { target: { value: 'ana' } })
    expect(none.disabled).toBe(true)
    expect(screen.getByTestId('recovery-rollback-missing').textContent).toMatch(/reason/)
    fireEvent.change(screen.getByTestId('recovery-rollback-reason'), { target: { value: 'no policy changed; the provider failed' } })
    fireEvent.click(none)
    await waitFor(() => expect(posted('/rollback')).toEqual({ actor: 'ana', reason: 'no policy changed; the provider failed' }))
  })

  it('rolls a changed workflow back to its last known good version', async () => {
    withRun(runOf({ step: 'roll_back', rollback_candidates: [{ workflow: 'default', current_version: 'b7e1', last_good_version: 'a1c2' }] }))
    moves.rollback = (v) => runOf({ ...v, step: 'confirm', steps: stepsAt('confirm') })
    show(`/recovery/${RUN}`)
    const row = await screen.findByTestId('recovery-rollback-candidate-default')
    expect(row.textContent).toMatch(/default.*b7e1.*a1c2/)
    fireEvent.change(screen.getByTestId('recovery-rollback-actor'), { target: { value: 'ana' } })
    fireEvent.change(screen.getByTestId('recovery-rollback-reason'), { target: { value: 'b7e1 doubled the retries' } })
    fireEvent.click(within(row).getByTestId('recovery-rollback-default'))
    await waitFor(() => expect(posted('/rollback')).toEqual({ actor: 'ana', reason: 'b7e1 doubled the retries', workflow: 'default', version: 'a1c2' }))
  })

  it('runs probes as the chosen key and shows the round against its three conditions', async () => {
    // spec: O1, O5
    withRun(runOf({ step: 'confirm' }))
    moves.probes = (v) => ({
      ...v, probe_rounds: 1,
      probes: [1, 2, 3, 4, 5].map((n) => ({
        n, ok: n !== 3, status: n === 3 ? 503 : 200, latency_ms: n === 5 ? 420 : 150, request_id: `req-p${n}`,
        error: n === 3 ? 'HTTP 503 from openai-sim' : null, duplicate: false,
      })),
    })
    show(`/recovery/${RUN}`)
    const key = (await screen.findByTestId('recovery-probe-key')) as HTMLSelectElement
    await waitFor(() => expect(key.value).toBe('demo'))
    fireEvent.change(key, { target: { value: 'probe' } })
    fireEvent.change(screen.getByTestId('recovery-probes-actor'), { target: { value: 'ana' } })
    expect(screen.getByTestId('recovery-probes-form').textContent).toMatch(/1\.5 × its normal P95 \(200 ms, so 300 ms\)/)
    fireEvent.click(screen.getByTestId('recovery-probes'))
    await waitFor(() => expect(posted('/probes')).toEqual({ actor: 'ana', key: 'probe' }))
    const table = await screen.findByTestId('recovery-probes-table')
    expect(within(table).getAllByRole('row')).toHaveLength(6)
    expect(screen.getByTestId('recovery-probe-3').textContent).toMatch(/failed.*503.*HTTP 503 from openai-sim/)
    expect(within(screen.getByTestId('recovery-probe-1')).getByText('req-p1').getAttribute('href')).toBe('/ledger/req-p1')
    expect(screen.getByTestId('recovery-probe-summary').textContent).toMatch(/4 of 5 succeeded · P95 420 ms against a normal P95 of 200 ms \(limit 300 ms\) · 0 duplicate/)
    await waitFor(() => expect(screen.getByTestId('recovery-probes').textContent).toBe('Run another round of 5 probes'))
  })

  it('shows the stages with the current one, its time left and the step-back figures against their thresholds', async () => {
    // spec: O1, O2
    withRun(runOf({
      step: 'resume', stage: 1, stage_ms: 900_000, stage_started_at: Date.now() - 300_000, concurrency_pct: 50, concurrency_cap: 64,
      recent: { outcomes: 20, server_errors: 2, rate_limited_for_ms: 30_000, duplicates: 0, projected_day_usd: 41.5, daily_budget_usd: 50 },
    }))
    show(`/recovery/${RUN}`)
    const stage = await screen.findByTestId('recovery-stage')
    expect(stage.getAttribute('data-stage-pct')).toBe('50')
    expect(screen.getByTestId('recovery-stage-50').getAttribute('aria-current')).toBe('step')
    expect(screen.getByTestId('recovery-stage-25').className).toBe('done')
    expect(screen.getByTestId('recovery-stage-100').getAttribute('aria-current')).toBeNull()
    expect(screen.getByTestId('recovery-stage-now').textContent).toMatch(/Stage 2 of 3: 50 % of the route’s concurrency, at most 64 of 128 at once/)
    expect(screen.getByTestId('recovery-stage-left').textContent).toMatch(/^(10 min|9 min 59 s|9 min 58 s) left in this stage of 15 min/)
    expect(screen.getByTestId('recovery-recent-5xx').textContent).toMatch(/2 of the last 20 outcome\(s\).*5 of the last 20/)
    expect(screen.getByTestId('recovery-recent-429').textContent).toMatch(/for 30 s.*for 2 min/)
    expect(screen.getByTestId('recovery-recent-duplicates').textContent).toMatch(/0.*1 \(an idempotency key completed twice\)/)
    expect(screen.getByTestId('recovery-recent-cost').textContent).toMatch(/\$41\.50.*above the daily budget of \$50\.00/)
    expect(screen.getByTestId('recovery-recent-5xx').getAttribute('data-over')).toBe('false')
    // Not a drill: no relapse to stage.
    expect(screen.queryByTestId('recovery-relapse')).toBeNull()
    expect(screen.queryByTestId('recovery-drill')).toBeNull()
  })

  it('marks a drill everywhere and offers a relapse while resuming', async () => {
    // spec: N3
    withRun(runOf({ id: DRILL_RUN, drill: 'server_errors', step: 'resume', stage: 0, stage_ms: 20_000, stage_started_at: Date.now(), concurrency_pct: 25 }))
    moves.relapse = (v) => v
    show(`/recovery/${DRILL_RUN}`)
    expect((await screen.findByTestId('recovery-drill')).textContent).toMatch(/^DRILL/)
    expect(screen.getByTestId('recovery-detail').getAttribute('data-drill')).toBe('true')
    expect(screen.getByText(/Incident record \(DRILL\)/)).toBeTruthy()
    const row = await screen.findByTestId(`recovery-run-${DRILL_RUN}`)
    expect(within(row).getByTestId('recovery-run-drill').textContent).toBe('DRILL')
    fireEvent.change(screen.getByTestId('recovery-relapse-actor'), { target: { value: 'ana' } })
    fireEvent.click(screen.getByTestId('recovery-relapse'))
    await waitFor(() => expect(posted('/relapse')).toEqual({ actor: 'ana' }))
  })

  it('when held, shows the approvals given, the role still missing, and approves as a different person', async () => {
    // spec: O3
    withRun(runOf({
      step: 'resume', held: true, stops: 2, stage: 0, stage_started_at: Date.now() - 60_000, concurrency_pct: 25,
      approvals: [{ actor: 'ana', role: 'platform_operations', reason: 'provider confirmed the fix', at: now - 30_000 }],
      events: [
        { at: STARTED + 600_000, actor: 'gateway', from: 'resume', to: 'confirm', action: 'step_back', reason: '5xx in 6 of the last 20 outcomes', figures: [{ name: 'server_errors', value: 6 }] },
      ],
    }))
    moves.approve = (v) => ({ ...v, held: false, approvals: [...v.approvals, { actor: 'bo', role: 'business_owner', reason: 'cost accepted', at: Date.now() }] })
    show(`/recovery/${RUN}`)
    expect((await screen.findByTestId('recovery-held')).textContent).toMatch(/held/)
    expect(screen.getByTestId('recovery-approval-platform_operations').textContent).toMatch(/platform operations: ana, .*: provider confirmed the fix/)
    expect(screen.queryByTestId('recovery-approval-business_owner')).toBeNull()
    expect(screen.getByTestId('recovery-approvals-missing').textContent).toBe('Still missing: business owner.')
    const role = screen.getByTestId('recovery-approve-role') as HTMLSelectElement
    expect(role.value).toBe('business_owner')
    expect((screen.getByRole('option', { name: /platform operations \(given by ana\)/ }) as HTMLOptionElement).disabled).toBe(true)
    expect(screen.getByTestId('recovery-stage-left').textContent).toMatch(/Held: the stage timer is stopped/)
    // The same person cannot give both approvals.
    const approve = screen.getByTestId('recovery-approve') as HTMLButtonElement
    fireEvent.change(screen.getByTestId('recovery-approve-actor'), { target: { value: 'Ana' } })
    fireEvent.change(screen.getByTestId('recovery-approve-reason'), { target: { value: 'cost accepted' } })
    expect(approve.disabled).toBe(true)
    expect(screen.getByTestId('recovery-approve-missing').textContent).toMatch(/a different person: ana already approved as platform operations/)
    fireEvent.change(screen.getByTestId('recovery-approve-actor'), { target: { value: 'bo' } })
    expect(approve.disabled).toBe(false)
    expect(approve.textContent).toBe('Approve as business owner')
    // The step-back is on the timeline, as a move back, with its figures.
    expect(screen.getByTestId('recovery-events').textContent).toMatch(/gateway.*Resume in stages → Confirm with probes \(back\).*step_back.*5xx in 6 of the last 20 outcomes.*server errors 6/)
    fireEvent.click(approve)
    await waitFor(() => expect(posted('/approve')).toEqual({ actor: 'bo', role: 'business_owner', reason: 'cost accepted' }))
    await waitFor(() => expect(screen.queryByTestId('recovery-approve-form')).toBeNull())
    expect(screen.getByTestId('recovery-result').textContent).toMatch(/Approved as business owner: the run is released/)
  })

  it('keeps close disabled while O4 is unmet, and says each unmet condition', async () => {
    // spec: O4
    withRun(runOf({
      step: 'close', backlog: 3,
      close_missing: ['backlog is 3 (must be 0)', '1 deadline overrun(s) without an explanation', 'customer contact not ticked'],
      overruns: [{ id: 'ov1', job_id: 'job_0000000000000000000000000000000a', deadline_at: STARTED + 900_000, detail: 'held 25 min past its deadline', explanation: null, explained_by: null }],
    }))
    moves.explain = (v) => ({
      ...v, overruns: v.overruns.map((o) => ({ ...o, explanation: 'held by the isolate step', explained_by: 'ana' })),
      close_missing: v.close_missing.filter((m) => !/overrun/.test(m)),
    })
    show(`/recovery/${RUN}`)
    const close = (await screen.findByTestId('recovery-close')) as HTMLButtonElement
    expect(close.disabled).toBe(true)
    const unmet = screen.getByTestId('recovery-close-unmet').textContent ?? ''
    expect(unmet).toMatch(/backlog is 3 \(must be 0\)/)
    expect(unmet).toMatch(/1 deadline overrun\(s\) without an explanation/)
    // The contact condition is met in the form itself, not listed as blocking.
    expect(unmet).not.toMatch(/customer contact/)
    fireEvent.click(screen.getByTestId('recovery-close-contacted'))
    fireEvent.change(screen.getByTestId('recovery-close-actor'), { target: { value: 'ana' } })
    expect(close.disabled).toBe(true)
    expect(screen.getByTestId('recovery-close-missing').textContent).toBe('To close: backlog is 3 (must be 0), 1 deadline overrun(s) without an explanation.')
    // An overrun explained: one condition fewer.
    expect(screen.getByTestId('recovery-overruns-summary').textContent).toMatch(/1 of 1 still to explain/)
    fireEvent.change(screen.getByTestId('recovery-explain-ov1-text'), { target: { value: 'held by the isolate step' } })
    fireEvent.change(screen.getByTestId('recovery-explain-ov1-actor'), { target: { value: 'ana' } })
    fireEvent.click(screen.getByTestId('recovery-explain-ov1'))
    await waitFor(() => expect(posted('/explain')).toEqual({ actor: 'ana', overrun: 'ov1', explanation: 'held by the isolate step' }))
    await waitFor(() => expect(screen.getByTestId('recovery-overrun-ov1').getAttribute('data-explained')).toBe('true'))
    expect(screen.getByTestId('recovery-close-missing').textContent).toBe('To close: backlog is 3 (must be 0).')
    expect(close.disabled).toBe(true)
  })

  it('closes once only the customer contact is left and it is ticked', async () => {
    // spec: O4
    withRun(runOf({ step: 'close', close_missing: ['customer contact not ticked'] }))
    moves.close = (v) => runOf({
      ...v, step: 'closed', steps: stepsAt('closed'), close_missing: [],
      incident: { ...v.incident, closed_at: Date.now(), closed_by: 'ana', customer_contacted: true, customer_impact: 'chat failed for 14 min' },
    })
    show(`/recovery/${RUN}`)
    const close = (await screen.findByTestId('recovery-close')) as HTMLButtonElement
    fireEvent.change(screen.getByTestId('recovery-close-actor'), { target: { value: 'ana' } })
    expect(close.disabled).toBe(true)
    expect(screen.getByTestId('recovery-close-missing').textContent).toBe('To close: tick that the customer was contacted.')
    fireEvent.click(screen.getByTestId('recovery-close-contacted'))
    fireEvent.change(screen.getByTestId('recovery-close-impact'), { target: { value: 'chat failed for 14 min' } })
    expect(close.disabled).toBe(false)
    expect(screen.queryByTestId('recovery-close-missing')).toBeNull()
    fireEvent.click(close)
    await waitFor(() => expect(posted('/close')).toEqual({ actor: 'ana', customer_contacted: true, customer_impact: 'chat failed for 14 min', workarounds: '' }))
    expect((await screen.findByTestId('recovery-closed')).textContent).toMatch(/Closed at .* by ana/)
    expect(screen.queryByTestId('recovery-cancel-form')).toBeNull()
    expect(screen.getByTestId('recovery-incident').textContent).toMatch(/Customer contactedyes/)
  })

  it('says each condition the gateway names when it refuses the close, once', async () => {
    withRun(runOf({ step: 'close', close_missing: ['customer contact not ticked'] }))
    // The gateway found an unknown outcome since the run was read.
    refusals.close = { status: 409, body: { error: 'the run cannot close yet', missing: ['1 unknown outcome(s) not reconciled'] } }
    show(`/recovery/${RUN}`)
    await screen.findByTestId('recovery-close')
    fireEvent.click(screen.getByTestId('recovery-close-contacted'))
    fireEvent.change(screen.getByTestId('recovery-close-actor'), { target: { value: 'ana' } })
    fireEvent.click(screen.getByTestId('recovery-close'))
    const err = await screen.findByTestId('recovery-close-error')
    expect(err.getAttribute('role')).toBe('alert')
    expect(err.textContent).toBe('the run cannot close yet. Still unmet: 1 unknown outcome(s) not reconciled.')
    // Named in the message already: not said twice.
    refusals.close = { status: 409, body: { error: 'the run cannot close yet: 1 unknown outcome(s) not reconciled', missing: ['1 unknown outcome(s) not reconciled'] } }
    fireEvent.click(screen.getByTestId('recovery-close'))
    await waitFor(() => expect(screen.getByTestId('recovery-close-error').textContent).toBe('the run cannot close yet: 1 unknown outcome(s) not reconciled'))
  })

  it('cancels with a name and a reason while the run is open', async () => {
    withRun(runOf({ step: 'preserve', steps: stepsAt('preserve') }))
    moves.cancel = (v) => runOf({ ...v, step: 'cancelled', steps: stepsAt('cancelled') })
    show(`/recovery/${RUN}`)
    const cancel = (await screen.findByTestId('recovery-cancel')) as HTMLButtonElement
    fireEvent.change(screen.getByTestId('recovery-cancel-actor'), { target: { value: 'ana' } })
    expect(cancel.disabled).toBe(true)
    fireEvent.change(screen.getByTestId('recovery-cancel-reason'), { target: { value: 'opened on the wrong route' } })
    fireEvent.click(cancel)
    await waitFor(() => expect(posted('/cancel')).toEqual({ actor: 'ana', reason: 'opened on the wrong route' }))
    await screen.findByTestId('recovery-cancelled')
    expect(screen.queryByTestId('recovery-current')).toBeNull()
  })

  it('downloads the report with the admin token and the name the gateway gives it', async () => {
    // spec: O1 (report)
    withRun(runOf({ id: DRILL_RUN, drill: 'server_errors', step: 'closed', steps: stepsAt('closed'), close_missing: [] }))
    const blobs: Blob[] = []
    const saved: string[] = []
    const create = URL.createObjectURL
    const revoke = URL.revokeObjectURL
    URL.createObjectURL = (obj: Blob | MediaSource) => {
      blobs.push(obj as Blob)
      return 'blob:report'
    }
    URL.revokeObjectURL = () => {}
    // The browser would save the file; jsdom would try to navigate to it.
    const onClick = (e: MouseEvent) => {
      if (!(e.target instanceof HTMLAnchorElement) || !e.target.download) return
      saved.push(`${e.target.download} ${e.target.getAttribute('href')}`)
      e.preventDefault()
    }
    document.addEventListener('click', onClick, true)
    try {
      show(`/recovery/${DRILL_RUN}`)
      fireEvent.click(await screen.findByTestId('recovery-report-md'))
      await waitFor(() => expect(saved).toEqual([`recovery-${DRILL_RUN}.md blob:report`]))
      const call = fetchMock.mock.calls.find(([u]) => String(u).endsWith(`/admin/v1/recoveries/${DRILL_RUN}/report.md`))
      expect((call?.[1]?.headers as Record<string, string>).Authorization).toBe('Bearer t')
      expect(await blobs[0].text()).toMatch(/DRILL/)
      expect(screen.queryByTestId('recovery-download-error')).toBeNull()
    } finally {
      document.removeEventListener('click', onClick, true)
      URL.createObjectURL = create
      URL.revokeObjectURL = revoke
    }
  })

  it('says so when the run does not exist', async () => {
    show('/recovery/rc_nope')
    expect((await screen.findByTestId('recovery-gone')).textContent).toMatch(/No recovery run rc_nope/)
  })
})

describe('probeP95', () => {
  it('takes the nearest rank: with 5 probes, the slowest', () => {
    const p = (latency_ms: number) => ({ n: 1, ok: true, status: 200, latency_ms, request_id: null, error: null, duplicate: false })
    expect(probeP95([p(120), p(400), p(150), p(130), p(110)])).toBe(400)
    expect(probeP95([])).toBeNull()
  })
})
