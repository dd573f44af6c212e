// The overview as an operator at 3 a.m. needs it: a failing ledger is the first thing on
// the page, and refusals are listed with why and from where.
import { render, screen } from '@testing-library/react'
import { describe, expect, it, vi } from 'vitest'
import type { Overview } from './bindings/Overview'

const overview: Overview = {
  now: 1_780_000_000_000,
  headline: { requests_per_s: 0, error_rate: null, p50_ms: null, p95_ms: null, in_flight: 0, rejected_last_minute: 3 },
  series: [],
  routes: [],
  channels: [],
  control: [],
  rejections: [{ at: 1_780_000_000_000, reason: 'forbidden_host', format: 'openai', peer: '127.0.0.1' }],
  ledger: { ok: false, failing_since: 1_779_999_990_000, error: 'database or disk is full', waiting: 42 },
  ledger_figures: null,
}

vi.mock('./useLive', () => ({
  useLive: () => ({ overview, error: null, connected: true, alerts: [], history: {} }),
}))
vi.mock('./Chart', () => ({ Chart: () => null }))

describe('overview', () => {
  it('says when the ledger refuses writes, and what that means', async () => {
    const { OverviewView } = await import('./Overview')
    render(<OverviewView conn={{ url: 'http://127.0.0.1:9', token: 't' }} />)
    const banner = screen.getByTestId('ledger-failing')
    expect(banner.getAttribute('role')).toBe('alert')
    expect(banner.textContent).toMatch(/refusing writes since 2026-05-28 20:26:30/)
    expect(banner.textContent).toMatch(/database or disk is full/)
    expect(banner.textContent).toMatch(/answered 503/)
    expect(banner.textContent).toMatch(/42 finished records/)
    expect(screen.getByTestId('rejections').textContent).toMatch(/foreign Host name.*openai.*127\.0\.0\.1/)
    expect(screen.getByTestId('tile-rejected').textContent).toBe('3')
  })
})
