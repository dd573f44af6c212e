// The overview as an operator at 3 a.m. needs it: a failing ledger is the first thing on
// the page, and refusals are listed with why and from where.
import { render, screen, within } from '@testing-library/react'
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
  ledger_figures: {
    unknown: 2, unknown_by_route: [{ route: 'openai/gpt-4o-mini', count: 2 }], duplicates: 0, duplicates_by_route: [],
    bytes: 5 * 1024 * 1024, payload_bytes: 1000, payloads: 3,
  },
  lanes: {
    routes: [{
      route: 'openai/gpt-4o-mini', interactive_admission: 2, stream_recovery: 1, background_retry: 7, running: 3,
      owner_review: 4, dead_letter: 9,
    }],
    workflows: [{
      workflow: 'nightly', version: 'a1b2c3', background_retry: 7, background_retry_max: 8, owner_review: 4,
      owner_review_max: 1000, dead_letter: 9, dead_letter_max: 10_000, max_concurrency: 4, max_queue_age_ms: 600_000,
    }],
    interactive_admission: 2,
    interactive_admission_max: 1024,
  },
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

  it('shows unknown outcomes, duplicates and the ledger size', async () => {
    // spec: N1, I6
    const { OverviewView } = await import('./Overview')
    render(<OverviewView conn={{ url: 'http://127.0.0.1:9', token: 't' }} />)
    expect(screen.getAllByTestId('tile-unknown').at(-1)?.textContent).toBe('2')
    expect(screen.getAllByTestId('tile-duplicates').at(-1)?.textContent).toBe('0')
    expect(screen.getAllByTestId('tile-ledger-size').at(-1)?.textContent).toBe('5.0 MiB')
    expect(screen.getAllByTestId('ledger-per-route').at(-1)?.textContent).toMatch(/openai\/gpt-4o-mini.*unknown.*2/)
  })

  it('shows each route\'s lanes, links the ones that wait for a person, and each workflow\'s fill', async () => {
    // spec: J1, J7
    const { OverviewView } = await import('./Overview')
    render(<OverviewView conn={{ url: 'http://127.0.0.1:9', token: 't' }} />)
    const lanes = screen.getAllByTestId('lanes').at(-1) as HTMLElement
    const row = within(lanes).getByTestId('lanes-openai/gpt-4o-mini')
    expect(row.textContent).toMatch(/openai\/gpt-4o-mini.*2.*1.*7 \(3\).*4.*9/)
    expect(within(row).getByTestId('lane-owner-review').getAttribute('href')).toBe('/reviews')
    expect(within(row).getByTestId('lane-dead-letter').getAttribute('href')).toBe('/dead-letters')
    const wf = within(lanes).getByTestId('lanes-workflow-nightly')
    expect(wf.textContent).toMatch(/7 \/ 8/)
    expect(wf.textContent).toMatch(/10 min/)
    expect(within(lanes).getByTestId('lanes-summary').textContent).toMatch(/2 of at most 1,024/)
  })
})
