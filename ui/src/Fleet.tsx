// The fleet (R1, R2): the gateway instances that share this PostgreSQL ledger, each with its
// heartbeat, its load and what became of it, and whether the Redis that makes key limits and
// breakers hold across instances is answering. Whichever instance the console is attached to
// answers: it keeps the list in memory from its own heartbeats, so a read costs no ledger
// query and the 2 s poll is cheap. On a SQLite ledger the gateway runs alone and says so.
import { useQuery } from '@tanstack/react-query'
import { getFleet, type Connection } from './api'
import type { FleetView as FleetData } from './bindings/FleetView'
import type { InstanceView } from './bindings/InstanceView'
import { count, duration, ms, pct, rate, time, trimmed } from './format'
import { linkProps } from './router'

/** As often as the instances write their heartbeats by default (`fleet.heartbeat_ms`). */
const POLL_MS = 2_000

/** Instances that ended (stopped or taken over) listed at most, the latest first; one whose
 * take-over left unknown outcomes is always listed. */
const ENDED_SHOWN = 50

/** An instance's load at its last heartbeat, as much of it as could be read. */
export type Load = { requests_per_s: number | null; in_flight: number | null; p95_ms: number | null; error_rate: number | null }

/** The `load` JSON an instance writes with its heartbeat; null when it is not a JSON object.
 * A figure missing or not a number reads as null: `{}` is a load with nothing reported. */
export function parseLoad(text: string): Load | null {
  let v: unknown
  try {
    v = JSON.parse(text)
  } catch {
    return null
  }
  if (typeof v !== 'object' || v === null || Array.isArray(v)) return null
  const o = v as Record<string, unknown>
  const num = (k: string): number | null => {
    const x = o[k]
    return typeof x === 'number' && Number.isFinite(x) ? x : null
  }
  return { requests_per_s: num('requests_per_s'), in_flight: num('in_flight'), p95_ms: num('p95_ms'), error_rate: num('error_rate') }
}

/** How long ago a heartbeat was: `0.8 s ago`, `42.0 s ago`, `3 min 20 s ago`. */
export function heartbeatAge(v: number): string {
  const a = Math.max(0, v)
  return a < 60_000 ? `${(a / 1000).toFixed(1)} s ago` : `${duration(a)} ago`
}

/** A configured interval: `2 s`, `500 ms`, `2.50 s`. */
function every(v: number): string {
  return v >= 1000 && v % 1000 === 0 ? duration(v) : ms(v)
}

function ended(v: InstanceView): boolean {
  return v.status === 'stopped' || v.status === 'taken_over'
}

type StatusShown = { words: string; pill: string; title: string; rank: number }

/** An instance's status as a badge; `rank` orders the table (a stale one first: it may be dead). */
function statusOf(v: InstanceView, staleAfterMs: number): StatusShown {
  switch (v.status) {
    case 'stale':
      return { words: 'stale', pill: 'pill warn', rank: 0, title: `No heartbeat for over ${every(staleAfterMs)}: if it is dead, a survivor takes its work over` }
    case 'live':
      return { words: 'live', pill: 'pill ok', rank: 1, title: 'Writing its heartbeat' }
    case 'taken_over':
      return {
        words: `taken over by ${v.taken_over_by ?? 'another instance'}`,
        pill: 'pill bad',
        rank: 2,
        title: 'It died: a survivor marked its in-flight requests unknown (never re-run) and released its job leases',
      }
    case 'stopped':
      return { words: 'stopped', pill: 'pill', rank: 3, title: 'Stopped cleanly' }
    default:
      return { words: v.status, pill: 'pill', rank: 4, title: '' }
  }
}

/** Stale ones first, then live (the answering one first), then the ended ones, the latest first. */
function ordered(list: InstanceView[], staleAfterMs: number): InstanceView[] {
  return [...list].sort(
    (a, b) =>
      statusOf(a, staleAfterMs).rank - statusOf(b, staleAfterMs).rank ||
      Number(b.this) - Number(a.this) ||
      (ended(a) ? a.heartbeat_age_ms - b.heartbeat_age_ms : 0) ||
      a.id.localeCompare(b.id),
  )
}

export function FleetView({ conn }: { conn: Connection }) {
  const q = useQuery({ queryKey: ['fleet', conn.url], queryFn: () => getFleet(conn), refetchInterval: POLL_MS })
  const f = q.data
  const err = q.error ? (q.error as Error).message : null
  return (
    <section>
      <h2>Fleet</h2>
      <p className="muted">
        The gateway instances behind your load balancer: they share one PostgreSQL ledger (requests, jobs, idempotency keys)
        and one Redis (key limits and breakers). Each writes a heartbeat with its load; when one dies, a survivor takes its
        work over and its in-flight requests wait in Unknown outcomes for an owner.
      </p>
      {err && (
        <p role="alert" className="error" data-testid="fleet-error">
          {f ? `Could not read the fleet again: ${err} The figures below are from ${time(q.dataUpdatedAt)}.` : err}
          {f && f.ledger === 'postgres' && ' Any other instance of the fleet can answer: connect the console to one of them.'}
        </p>
      )}
      {f ? <Fleet f={f} /> : !err && <p className="muted" aria-busy>Loading the fleet…</p>}
    </section>
  )
}

function Fleet({ f }: { f: FleetData }) {
  const shared = f.ledger === 'postgres'
  const live = f.instances.filter((i) => i.status === 'live').length
  return (
    <>
      <p className="status-line" data-testid="fleet-header">
        <span>Answered by <strong className="mono" data-testid="fleet-instance">{f.instance}</strong></span>
        <span data-testid="fleet-ledger">
          Ledger: {shared ? 'PostgreSQL, shared' : f.ledger === 'sqlite' ? 'SQLite, this instance only' : f.ledger}
        </span>
        <span data-testid="fleet-redis">
          Redis:{' '}
          {f.redis === null ? (
            <span className="muted">none</span>
          ) : (
            <>
              <code>{f.redis}</code>{' '}
              {f.redis_up === null ? (
                <span className="pill">not checked yet</span>
              ) : (
                <span className={f.redis_up ? 'pill ok' : 'pill bad'} data-testid="fleet-redis-state">{f.redis_up ? 'up' : 'unreachable'}</span>
              )}
            </>
          )}
        </span>
      </p>
      {f.redis !== null && f.redis_up === false && (
        <div className="banner" role="alert" data-testid="fleet-redis-down">
          <strong>{`Redis is unreachable: each instance keeps 1/${f.share_of} of every limit.`}</strong>
          <p className="small">
            Until Redis answers again, key limits (requests per minute, concurrency) are split between the instances instead
            of shared, and each instance keeps its own breakers: a route whose breaker opens on one instance stays open only
            there. Limits and breakers are shared again as soon as Redis answers.
          </p>
        </div>
      )}
      {shared && f.redis === null && (
        <p className="banner warn" data-testid="fleet-no-redis">
          <strong>No Redis configured</strong>: each instance applies key limits and breakers on its own, so a key gets its
          limit once per instance{live > 1 ? ` (up to ${count(live)} times its limit with ${count(live)} live instances)` : ''}.
          Give every instance the same <code>redis:</code> (or <code>--redis</code>) to share them.
        </p>
      )}
      {f.ledger === 'sqlite' && (
        <p className="muted" data-testid="fleet-alone">
          This gateway runs alone: its ledger is a SQLite file, which one instance keeps to itself. Fleet mode (several
          instances sharing requests, jobs, key limits and breakers) needs a PostgreSQL ledger and a Redis:{' '}
          <code>make fleet</code> starts them on this machine; the README’s “Fleet mode” says how to set one up.
        </p>
      )}
      <div className="tiles" data-testid="fleet-figures">
        <div className="tile" title="Summed over the live instances’ last heartbeats (each averages its last 10 s)">
          <div className="tile-label">Requests per second</div>
          <div className="tile-value" data-testid="fleet-rps">{rate(f.requests_per_s)}</div>
          <div className="muted small">across the live instances</div>
        </div>
        <div className="tile" title="Requests being answered now, summed over the live instances’ last heartbeats">
          <div className="tile-label">In flight</div>
          <div className="tile-value" data-testid="fleet-in-flight">{count(f.in_flight)}</div>
          <div className="muted small">across the live instances</div>
        </div>
        <div className="tile" title="Instances writing their heartbeat, of every instance the ledger knows">
          <div className="tile-label">Instances live</div>
          <div className="tile-value" data-testid="fleet-live">{count(live)} of {count(f.instances.length)}</div>
        </div>
      </div>
      <Instances f={f} />
    </>
  )
}

function Instances({ f }: { f: FleetData }) {
  if (f.instances.length === 0) {
    return <p className="muted" data-testid="fleet-empty">No instance has written a heartbeat yet.</p>
  }
  const all = ordered(f.instances, f.stale_after_ms)
  const endedAll = all.filter(ended)
  const endedShown = endedAll.filter((v, i) => i < ENDED_SHOWN || v.unknowns > 0)
  const rows = [...all.filter((v) => !ended(v)), ...endedShown]
  const hidden = endedAll.length - endedShown.length
  const mine = f.instances.find((v) => v.this)?.version ?? null
  return (
    // Focusable: at a narrow width the table scrolls sideways, and a keyboard must reach it.
    <div className="results" tabIndex={0} role="region" aria-label="Fleet instances">
      <table className="grid" data-testid="fleet-instances">
        <caption className="muted small">
          Each instance writes a heartbeat every {every(f.heartbeat_ms)}; one silent for over {every(f.stale_after_ms)} is
          stale, and a survivor takes its work over. Load as of each instance’s last heartbeat.
        </caption>
        <thead>
          <tr>
            <th scope="col">Instance</th>
            <th scope="col">Status</th>
            <th scope="col" className="num">Heartbeat</th>
            <th scope="col">Listens on</th>
            <th scope="col">Version</th>
            <th scope="col">Started</th>
            <th scope="col" className="num" title="Averaged over its last 10 s">Req/s</th>
            <th scope="col" className="num">In flight</th>
            <th scope="col" className="num" title="Latency over its last 60 s">P95</th>
            <th scope="col" className="num" title="Errors ÷ finished requests over its last 60 s">Error rate</th>
            <th scope="col">Unknown outcomes</th>
          </tr>
        </thead>
        <tbody>
          {rows.map((v) => {
            const s = statusOf(v, f.stale_after_ms)
            const otherVersion = mine !== null && !ended(v) && v.version !== mine
            return (
              <tr key={v.id} data-testid={`fleet-instance-${v.id}`} data-status={v.status} className={v.status === 'stale' ? 'stale' : undefined}>
                <th scope="row">
                  <span className="mono">{v.id}</span>
                  {v.this && <> <span className="pill" title="The instance that answered this page" data-testid="fleet-this">this</span></>}
                </th>
                <td><span className={s.pill} title={s.title || undefined} data-testid="fleet-status">{s.words}</span></td>
                <td className={v.status === 'stale' ? 'num warn-text' : ended(v) ? 'num muted' : 'num'} title={`Last heartbeat ${time(v.heartbeat_at)}`}
                  data-testid="fleet-heartbeat">
                  {heartbeatAge(v.heartbeat_age_ms)}
                </td>
                <td className="mono small">{v.listen || '—'}</td>
                <td className={otherVersion ? 'warn-text' : undefined} title={otherVersion ? `Not the version of the instance that answered (${mine})` : undefined}>
                  {v.version || '—'}
                </td>
                <td className="small">{time(v.started_at)}</td>
                <LoadCells v={v} />
                <td className="wrap" data-testid="fleet-unknowns"><Unknowns v={v} /></td>
              </tr>
            )
          })}
        </tbody>
      </table>
      {hidden > 0 && (
        <p className="muted small" data-testid="fleet-hidden">
          {count(hidden)} more instance(s) stopped earlier, with no unknown outcomes left by a take-over, are not listed.
        </p>
      )}
    </div>
  )
}

function LoadCells({ v }: { v: InstanceView }) {
  if (ended(v)) return <td colSpan={4} className="muted small">not running</td>
  const l = parseLoad(v.load)
  if (!l) {
    return (
      <td colSpan={4} className="muted small" title={`Its heartbeat carried: ${trimmed(v.load, 200)}`} data-testid="fleet-load-unreadable">
        load not readable
      </td>
    )
  }
  const asOf = v.status === 'stale' ? `As of its last heartbeat, ${heartbeatAge(v.heartbeat_age_ms)}` : undefined
  return (
    <>
      <td className="num" title={asOf} data-testid="fleet-load-rps">{rate(l.requests_per_s)}</td>
      <td className="num" title={asOf} data-testid="fleet-load-in-flight">{count(l.in_flight)}</td>
      <td className="num" title={asOf} data-testid="fleet-load-p95">{ms(l.p95_ms)}</td>
      <td className="num" title={asOf} data-testid="fleet-load-errors">{pct(l.error_rate)}</td>
    </>
  )
}

/** What a take-over left for an owner: the requests the dead instance was calling a provider
 * for, now unknown (never re-run), reconciled in the Unknown outcomes inbox. */
function Unknowns({ v }: { v: InstanceView }) {
  if (v.unknowns > 0) {
    return (
      <span className="error">
        {count(v.unknowns)} {v.unknowns === 1 ? 'request' : 'requests'} left unknown by the take-over:{' '}
        <a {...linkProps({ view: 'unknowns', id: null })} data-testid="fleet-link-unknowns">reconcile in Unknown outcomes</a>
      </span>
    )
  }
  if (v.status === 'taken_over') return <span className="ok-text small">none left unknown</span>
  return <span className="muted">—</span>
}
