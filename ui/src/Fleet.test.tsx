// The fleet as an on-call engineer reads it (R1, R2): which instance answered, the ledger
// and Redis behind it; the merged traffic; each instance with its status, the age of its
// heartbeat (a stale one first and marked), its load (whatever its heartbeat carried), and
// for one taken over the requests it left unknown, a link away from the inbox. A Redis
// outage says what it does to the limits; a SQLite gateway says calmly that it runs alone.
import { QueryClient, QueryClientProvider } from '@tanstack/react-query'
import { cleanup, fireEvent, render, screen, waitFor, within } from '@testing-library/react'
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest'
import type { FleetView as FleetData } from './bindings/FleetView'
import type { InstanceView } from './bindings/InstanceView'
import { FleetView, heartbeatAge, parseLoad } from './Fleet'

const T0 = Date.UTC(2026, 11, 7, 9, 0, 0)

function instanceOf(over: Partial<InstanceView> = {}): InstanceView {
  return {
    status: 'live',
    heartbeat_age_ms: 800,
    this: false,
    id: 'a',
    boot: 'boot-1',
    listen: '127.0.0.1:8081',
    version: '0.1.0',
    started_at: T0,
    heartbeat_at: T0 + 600_000,
    stopped_at: null,
    taken_over_by: null,
    unknowns: 0,
    load: JSON.stringify({ requests_per_s: 4.5, error_rate: 0.02, p50_ms: 120, p95_ms: 480, in_flight: 3, rejected_last_minute: 0 }),
    ...over,
  }
}

function fleetOf(over: Partial<FleetData> = {}): FleetData {
  return {
    instance: 'a',
    ledger: 'postgres',
    redis: 'redis://cache:6379/0',
    redis_up: true,
    share_of: 2,
    heartbeat_ms: 2_000,
    stale_after_ms: 10_000,
    instances: [
      instanceOf({ id: 'e', status: 'stopped', heartbeat_age_ms: 7_200_000, stopped_at: T0, listen: '127.0.0.1:8085' }),
      instanceOf({ id: 'b', listen: '127.0.0.1:8082', heartbeat_age_ms: 1_300, load: JSON.stringify({ requests_per_s: 3, in_flight: 1, p95_ms: 1_300, error_rate: 0.5 }) }),
      instanceOf({ id: 'd', status: 'taken_over', heartbeat_age_ms: 95_000, stopped_at: T0 + 500_000, taken_over_by: 'a', unknowns: 3, listen: '127.0.0.1:8084' }),
      instanceOf({ id: 'a', this: true }),
      instanceOf({ id: 'c', status: 'stale', heartbeat_age_ms: 12_400, listen: '127.0.0.1:8083' }),
    ],
    requests_per_s: 7.5,
    in_flight: 4,
    ...over,
  }
}

let fleet: FleetData
let refusal: { status: number; body: unknown } | null
let auth: string | null

function json(body: unknown, status = 200): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json' } })
}

const fetchMock = vi.fn(async (input: RequestInfo | URL, init?: RequestInit): Promise<Response> => {
  const url = new URL(String(input))
  auth = new Headers(init?.headers).get('Authorization')
  if (url.pathname === '/admin/v1/fleet') return refusal ? json(refusal.body, refusal.status) : json(fleet)
  return json({ error: `nothing at ${url}` }, 404)
})

function show() {
  history.pushState(null, '', '/fleet')
  return render(
    <QueryClientProvider client={new QueryClient({ defaultOptions: { queries: { retry: false } } })}>
      <FleetView conn={{ url: 'http://127.0.0.1:1', token: 't' }} />
    </QueryClientProvider>,
  )
}

const row = (id: string) => screen.getByTestId(`fleet-instance-${id}`)
const cell = (id: string, testid: string) => within(row(id)).getByTestId(testid).textContent

beforeEach(() => {
  fleet = fleetOf()
  refusal = null
  auth = null
  vi.stubGlobal('fetch', fetchMock)
})

afterEach(() => {
  cleanup()
  vi.unstubAllGlobals()
  fetchMock.mockClear()
  history.pushState(null, '', '/')
})

describe('FleetView', () => {
  it('lists every instance with its status and heartbeat, stale ones first and marked', async () => {
    // spec: R1
    show()
    const table = await screen.findByTestId('fleet-instances')
    expect(fetchMock.mock.calls.map(([u]) => String(u))).toEqual(['http://127.0.0.1:1/admin/v1/fleet'])
    expect(auth).toBe('Bearer t')
    expect(screen.getByTestId('fleet-instance').textContent).toBe('a')
    expect(screen.getByTestId('fleet-ledger').textContent).toBe('Ledger: PostgreSQL, shared')
    expect(screen.getByTestId('fleet-redis').textContent).toBe('Redis: redis://cache:6379/0 up')
    expect(screen.queryByTestId('fleet-redis-down')).toBeNull()
    expect(screen.queryByTestId('fleet-no-redis')).toBeNull()
    expect(screen.queryByTestId('fleet-alone')).toBeNull()
    // Merged over the live instances (the gateway sums them; the console shows its sums).
    expect(screen.getByTestId('fleet-rps').textContent).toBe('7.5 req/s')
    expect(screen.getByTestId('fleet-in-flight').textContent).toBe('4')
    expect(screen.getByTestId('fleet-live').textContent).toBe('2 of 5')
    // The stale one first (it may be dead), then the live ones with the answering one first,
    // then those that ended.
    expect(within(table).getAllByTestId(/^fleet-instance-/).map((r) => r.getAttribute('data-testid'))).toEqual(
      ['c', 'a', 'b', 'd', 'e'].map((id) => `fleet-instance-${id}`),
    )
    expect(['c', 'a', 'b', 'd', 'e'].map((id) => cell(id, 'fleet-status'))).toEqual(['stale', 'live', 'live', 'taken over by a', 'stopped'])
    expect(row('d').getAttribute('data-status')).toBe('taken_over')
    expect(within(row('a')).getByTestId('fleet-this').textContent).toBe('this')
    expect(within(row('b')).queryByTestId('fleet-this')).toBeNull()
    expect(cell('a', 'fleet-heartbeat')).toBe('0.8 s ago')
    expect(cell('b', 'fleet-heartbeat')).toBe('1.3 s ago')
    expect(cell('c', 'fleet-heartbeat')).toBe('12.4 s ago')
    expect(cell('d', 'fleet-heartbeat')).toBe('1 min 35 s ago')
    expect(cell('e', 'fleet-heartbeat')).toBe('2 h ago')
    // A stale heartbeat is highlighted; a live one is not.
    expect(row('c').className).toBe('stale')
    expect(within(row('c')).getByTestId('fleet-heartbeat').className).toContain('warn-text')
    expect(row('a').className).toBe('')
    expect(within(row('a')).getByTestId('fleet-heartbeat').className).not.toContain('warn-text')
    // Each live instance's load, from its last heartbeat.
    expect(['fleet-load-rps', 'fleet-load-in-flight', 'fleet-load-p95', 'fleet-load-errors'].map((t) => cell('a', t))).toEqual(['4.5 req/s', '3', '480 ms', '2.0 %'])
    expect(['fleet-load-rps', 'fleet-load-in-flight', 'fleet-load-p95', 'fleet-load-errors'].map((t) => cell('b', t))).toEqual(['3.0 req/s', '1', '1.30 s', '50 %'])
    expect(row('e').textContent).toContain('not running')
    expect(row('b').textContent).toContain('127.0.0.1:8082')
    expect(row('b').textContent).toContain('0.1.0')
    expect(row('b').textContent).toContain('2026-12-07 09:00:00.000 UTC')
    expect(screen.getByText(/heartbeat every 2 s; one silent for over 10 s is\s+stale/)).toBeTruthy()
  })

  it('warns that each instance keeps 1/N of every limit while Redis is unreachable', async () => {
    // spec: R2
    fleet = fleetOf({ redis_up: false, share_of: 3 })
    show()
    const banner = await screen.findByTestId('fleet-redis-down')
    expect(banner.getAttribute('role')).toBe('alert')
    expect(banner.textContent).toMatch(/^Redis is unreachable: each instance keeps 1\/3 of every limit\./)
    expect(banner.textContent).toMatch(/shared again as soon as Redis answers/)
    expect(screen.getByTestId('fleet-redis-state').textContent).toBe('unreachable')
    expect(screen.getByTestId('fleet-redis-state').className).toBe('pill bad')
  })

  it('warns that limits are per instance when a shared ledger has no Redis', async () => {
    // spec: R2
    fleet = fleetOf({ redis: null, redis_up: null, share_of: 1 })
    show()
    const banner = await screen.findByTestId('fleet-no-redis')
    expect(banner.textContent).toMatch(/^No Redis configured: each instance applies key limits and breakers on its own/)
    expect(banner.textContent).toMatch(/up to 2 times its limit with 2 live instances/)
    expect(screen.getByTestId('fleet-redis').textContent).toBe('Redis: none')
    expect(screen.queryByTestId('fleet-redis-down')).toBeNull()
  })

  it('says calmly that a gateway on a SQLite ledger runs alone, and how to start a fleet', async () => {
    // spec: R1
    fleet = fleetOf({
      instance: 'gw',
      ledger: 'sqlite',
      redis: null,
      redis_up: null,
      share_of: 1,
      instances: [instanceOf({ id: 'gw', this: true })],
      requests_per_s: 4.5,
      in_flight: 3,
    })
    show()
    const note = await screen.findByTestId('fleet-alone')
    expect(note.getAttribute('role')).toBeNull()
    expect(note.className).toBe('muted')
    expect(note.textContent).toMatch(/^This gateway runs alone: .*needs a PostgreSQL ledger/)
    expect(within(note).getByText('make fleet').tagName).toBe('CODE')
    expect(note.textContent).toContain('“Fleet mode”')
    expect(screen.getByTestId('fleet-ledger').textContent).toBe('Ledger: SQLite, this instance only')
    expect(screen.getByTestId('fleet-redis').textContent).toBe('Redis: none')
    expect(screen.queryByTestId('fleet-redis-down')).toBeNull()
    expect(screen.queryByTestId('fleet-no-redis')).toBeNull()
    expect(screen.queryByRole('alert')).toBeNull()
    expect(cell('gw', 'fleet-status')).toBe('live')
    expect(screen.getByTestId('fleet-live').textContent).toBe('1 of 1')
  })

  it('says how many requests a take-over left unknown, a link away from the inbox', async () => {
    // spec: R1
    fleet = fleetOf({
      instances: [
        instanceOf({ id: 'a', this: true }),
        instanceOf({ id: 'd', status: 'taken_over', taken_over_by: 'a', stopped_at: T0, heartbeat_age_ms: 30_000, unknowns: 3 }),
        instanceOf({ id: 'g', status: 'taken_over', taken_over_by: 'a', stopped_at: T0, heartbeat_age_ms: 40_000, unknowns: 1 }),
        instanceOf({ id: 'h', status: 'taken_over', taken_over_by: 'b', stopped_at: T0, heartbeat_age_ms: 50_000, unknowns: 0 }),
      ],
    })
    show()
    await screen.findByTestId('fleet-instances')
    expect(cell('d', 'fleet-unknowns')).toBe('3 requests left unknown by the take-over: reconcile in Unknown outcomes')
    expect(cell('g', 'fleet-unknowns')).toBe('1 request left unknown by the take-over: reconcile in Unknown outcomes')
    expect(cell('h', 'fleet-unknowns')).toBe('none left unknown')
    expect(cell('h', 'fleet-status')).toBe('taken over by b')
    expect(cell('a', 'fleet-unknowns')).toBe('—')
    const link = within(row('d')).getByTestId('fleet-link-unknowns')
    expect(link.getAttribute('href')).toBe('/unknowns')
    fireEvent.click(link)
    expect(window.location.pathname).toBe('/unknowns')
  })

  it('tolerates a load that is empty or not JSON', async () => {
    // spec: R1
    fleet = fleetOf({
      instances: [
        instanceOf({ id: 'a', this: true, load: 'not json' }),
        instanceOf({ id: 'b', load: '{}' }),
        instanceOf({ id: 'c', load: '[1, 2]' }),
        instanceOf({ id: 'd', load: JSON.stringify({ requests_per_s: 'fast', in_flight: 2, p95_ms: null }) }),
      ],
    })
    show()
    await screen.findByTestId('fleet-instances')
    expect(within(row('a')).getByTestId('fleet-load-unreadable').textContent).toBe('load not readable')
    expect(within(row('c')).getByTestId('fleet-load-unreadable').textContent).toBe('load not readable')
    expect(['fleet-load-rps', 'fleet-load-in-flight', 'fleet-load-p95', 'fleet-load-errors'].map((t) => cell('b', t))).toEqual(['—', '—', '—', '—'])
    expect(['fleet-load-rps', 'fleet-load-in-flight', 'fleet-load-p95', 'fleet-load-errors'].map((t) => cell('d', t))).toEqual(['—', '2', '—', '—'])
    // The rest of the row, and the page, still show.
    expect(cell('a', 'fleet-status')).toBe('live')
    expect(cell('a', 'fleet-heartbeat')).toBe('0.8 s ago')
    expect(screen.queryByRole('alert')).toBeNull()
  })

  it('says why when the fleet cannot be read', async () => {
    refusal = { status: 401, body: { error: 'Wrong admin token.' } }
    show()
    const err = await screen.findByTestId('fleet-error')
    expect(err.getAttribute('role')).toBe('alert')
    expect(err.textContent).toBe('Wrong admin token.')
    expect(screen.queryByTestId('fleet-instances')).toBeNull()
  })

  it('reads the fleet again every 2 s', async () => {
    // spec: R1
    show()
    await screen.findByTestId('fleet-instances')
    expect(cell('b', 'fleet-status')).toBe('live')
    fleet = fleetOf({
      instances: fleet.instances.map((v) => (v.id === 'b' ? { ...v, status: 'stale', heartbeat_age_ms: 11_000 } : v)),
    })
    await waitFor(() => expect(cell('b', 'fleet-status')).toBe('stale'), { timeout: 4_000 })
    expect(cell('b', 'fleet-heartbeat')).toBe('11.0 s ago')
    expect(fetchMock.mock.calls.length).toBeGreaterThanOrEqual(2)
  }, 10_000)
})

describe('fleet figures', () => {
  it('reads a heartbeat load, whatever it carries', () => {
    expect(parseLoad('{"requests_per_s":1.5,"in_flight":2,"p95_ms":30,"error_rate":0.1,"p50_ms":10}')).toEqual({
      requests_per_s: 1.5, in_flight: 2, p95_ms: 30, error_rate: 0.1,
    })
    expect(parseLoad('{}')).toEqual({ requests_per_s: null, in_flight: null, p95_ms: null, error_rate: null })
    expect(parseLoad('')).toBeNull()
    expect(parseLoad('null')).toBeNull()
    expect(parseLoad('"x"')).toBeNull()
    expect(parseLoad('[]')).toBeNull()
  })

  it('says how long ago a heartbeat was', () => {
    expect(heartbeatAge(800)).toBe('0.8 s ago')
    expect(heartbeatAge(0)).toBe('0.0 s ago')
    expect(heartbeatAge(-5)).toBe('0.0 s ago')
    expect(heartbeatAge(95_000)).toBe('1 min 35 s ago')
  })
})
