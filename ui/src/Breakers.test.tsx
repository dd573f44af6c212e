// The breakers view as an operator needs it at 3 a.m.: an open breaker says why, with its
// figures and when probation starts; probation shows its progress; the manual form asks
// for who and why before it enables.
import { QueryClient, QueryClientProvider } from '@tanstack/react-query'
import { cleanup, render, screen, within } from '@testing-library/react'
import { afterEach, describe, expect, it, vi } from 'vitest'
import type { Overview } from './bindings/Overview'
import type { RouteControlView } from './bindings/RouteControlView'
import { BreakersView } from './Breakers'

const win = { requests: 100, attempts: 118, amplification: 1.18, retried: 18, post_retry_success: 0.5 }
function route(name: string, breaker: Partial<RouteControlView['breaker']>): RouteControlView {
  return {
    route: name,
    breaker: {
      state: 'closed', trigger: null, reason: null, in_state_ms: 65_000, probe_in_ms: null, probes_passed: 0, probes_sent: 0,
      probes_needed: 5, probe_in_flight: false, recent_failures: 3, recent_attempts: 50, failures_to_open: 25,
      rate_limited_for_ms: null, rate_limit_run_ms: 180_000, wait_p95_ms: null, wait_slo_ms: null, normal_latency_ms: 120,
      reopened: 0, ...breaker,
    },
    amplification: { last_1m: win, last_5m: win, last_1h: win, holding_low_priority: false },
    budget_requests: 40, budget_retries: 8, budget_allowed: 8, cost_trigger: 'dormant: no budget configured',
  }
}

const overview = {
  control: [
    route('openai/gpt-4o-mini', { state: 'open', trigger: 'server_errors', reason: '27 of the last 50 attempts failed (5xx, timeout or unreachable)', probe_in_ms: 12_000 }),
    route('anthropic/claude', { state: 'probation', probes_passed: 2, probes_sent: 3, probe_in_flight: true }),
    route('gemini/flash', {}),
  ],
} as unknown as Overview

vi.mock('./useLive', () => ({ useLive: () => ({ overview, error: null, connected: true, alerts: [], history: {} }) }))
vi.mock('./Chart', () => ({ Chart: () => null }))
vi.mock('./api', () => ({ getAudit: () => Promise.resolve([]), setBreaker: vi.fn() }))

function show(selected: string | null) {
  return render(
    <QueryClientProvider client={new QueryClient()}>
      <BreakersView conn={{ url: 'http://127.0.0.1:1', token: 't' }} selected={selected} />
    </QueryClientProvider>,
  )
}

afterEach(cleanup)

describe('BreakersView', () => {
  it('lists each route with its state, why, and its figures', () => {
    // spec: G4, F5
    show(null)
    const open = screen.getByTestId('breaker-openai/gpt-4o-mini')
    expect(within(open).getByTestId('breaker-state').textContent).toBe('open')
    expect(open.textContent).toContain('27 of the last 50 attempts failed')
    expect(open.textContent).toContain('probation in 12 s')
    expect(within(open).getByTestId('breaker-amplification').textContent).toBe('1.18 · 1.18 · 1.18')
    expect(screen.getByTestId('breaker-anthropic/claude').textContent).toContain('probation: 2 of 5 probes passed, one running')
  })

  it('shows a closed route’s triggers against their thresholds', () => {
    // spec: G1
    show('gemini/flash')
    const figures = screen.getByTestId('breaker-figures').textContent ?? ''
    expect(figures).toContain('3 of the last 50 attempts')
    expect(figures).toContain('opens at 25 of 50')
    expect(figures).toContain('no SLO configured')
    expect(figures).toContain('dormant: no budget configured')
    expect((screen.getByTestId('breaker-submit') as HTMLButtonElement).textContent).toBe('Open breaker')
  })

  it('asks who and why before closing an open breaker by hand', () => {
    // spec: G4
    show('openai/gpt-4o-mini')
    expect(screen.getByTestId('breaker-figures').textContent).toContain('watched again once the breaker closes')
    const submit = screen.getByTestId('breaker-submit') as HTMLButtonElement
    expect(submit.textContent).toBe('Close breaker')
    expect(submit.disabled).toBe(true)
  })
})
