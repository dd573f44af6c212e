// Breakers per route (G1–G4), retry budgets and amplification (F4, F5): what an operator
// looks at when a provider fails. Each route shows its state, why, for how long, its
// probation progress and the G1 figures against their thresholds; a route's own page adds
// its charts, its transition history and the form to open or close it by hand.
import { useQuery, useQueryClient } from '@tanstack/react-query'
import { useMemo } from 'react'
import { getAudit, setBreaker, type Connection } from './api'
import type { RouteControlView } from './bindings/RouteControlView'
import { Chart } from './Chart'
import { breakerPill, count, duration, ms, pct, time, trigger } from './format'
import { linkProps, navigate } from './router'
import { useLive, type ControlPoint } from './useLive'
import { useOperatorAction } from './actor'

export function BreakersView({ conn, selected }: { conn: Connection; selected: string | null }) {
  const { overview, error, history } = useLive(conn)
  if (!overview) {
    return (
      <section aria-busy={!error} className="empty">
        {error ? <p role="alert" className="error">{error}</p> : <p>Connecting to the gateway…</p>}
      </section>
    )
  }
  const routes = overview.control
  const current = selected ? routes.find((r) => r.route === selected) : undefined
  return (
    <section>
      <h2>Breakers</h2>
      {routes.length === 0 ? (
        <p className="muted" data-testid="breakers-empty">
          No route has seen traffic yet. A breaker opens on its own when 25 of a route’s last 50 attempts fail, when it is
          answered 429 for 3 minutes, or when its capacity wait passes 80 % of its SLO.
        </p>
      ) : (
        <table className="grid selectable" data-testid="breakers">
          <thead>
            <tr>
              <th>Route</th><th>State</th><th>Why</th><th className="num">For</th>
              <th className="num" title="Provider failures (5xx, timeouts, unreachable) among the last attempts; 25 of 50 open the breaker">Failures</th>
              <th className="num" title="Attempts ÷ requests over 1 min / 5 min / 1 h">Amplification</th>
              <th className="num" title="Retried requests that ended well, last 5 min">Post-retry success</th>
              <th className="num" title="Retries used ÷ allowed in the last 10 s (20 % of new requests)">Retry budget</th>
            </tr>
          </thead>
          <tbody>
            {routes.map((r) => (
              <tr key={r.route} data-testid={`breaker-${r.route}`} aria-selected={r.route === selected}
                onClick={() => navigate({ view: 'breakers', route: r.route })}>
                <td><a {...linkProps({ view: 'breakers', route: r.route })}>{r.route}</a></td>
                <td><span className={breakerPill(r.breaker.state)} data-testid="breaker-state">{r.breaker.state}</span></td>
                <td className="small">{why(r)}</td>
                <td className="num">{duration(r.breaker.in_state_ms)}</td>
                <td className="num">{r.breaker.state === 'closed' ? `${r.breaker.recent_failures} / ${r.breaker.recent_attempts}` : '—'}</td>
                <td className="num" data-testid="breaker-amplification">{amp(r)}</td>
                <td className="num">{pct(r.amplification.last_5m.post_retry_success)}</td>
                <td className="num">{r.budget_retries} / {r.budget_allowed}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
      {selected && !current && <p className="muted">No traffic has reached {selected} since the gateway started; its breaker is closed.</p>}
      {current && <RouteDetail conn={conn} r={current} points={history[current.route] ?? []} />}
    </section>
  )
}

function amp(r: RouteControlView): string {
  const a = r.amplification
  const f = (v: number | null) => (v === null ? '—' : v.toFixed(2))
  return `${f(a.last_1m.amplification)} · ${f(a.last_5m.amplification)} · ${f(a.last_1h.amplification)}`
}

/** The breaker's state in words, with its figures. */
function why(r: RouteControlView): string {
  const b = r.breaker
  switch (b.state) {
    case 'open':
      return `${b.reason ?? ''}${b.probe_in_ms === null ? ' · only an operator can close it' : ` · probation in ${duration(b.probe_in_ms)}`}`
    case 'probation':
      return `probation: ${b.probes_passed} of ${b.probes_needed} probes passed${b.probe_in_flight ? ', one running' : ''}`
    case 'closed':
      // No low-priority work exists until background jobs do; the flag says what would be held.
      return r.amplification.holding_low_priority ? 'closed; amplification above 1.2 over 5 min (low-priority work would be held)' : 'closed'
  }
}

function RouteDetail({ conn, r, points }: { conn: Connection; r: RouteControlView; points: ControlPoint[] }) {
  const b = r.breaker
  const audit = useQuery({
    queryKey: ['audit', conn.url, 'breaker', r.route],
    queryFn: () => getAudit(conn, 'breaker', r.route),
    refetchInterval: 5_000,
  })
  const charts = useMemo(() => {
    const t = points.map((p) => p.at / 1000)
    return {
      rate: [t, points.map((p) => p.rps)],
      amp: [t, points.map((p) => p.amplification), points.map((p) => (p.postRetrySuccess === null ? null : p.postRetrySuccess * 100))],
    }
  }, [points])
  // The windows start again when the breaker opens; while it is not closed they say nothing.
  const watching = b.state === 'closed'
  const figures: [string, string, string][] = !watching ? [
    ['Triggers', '—', 'watched again once the breaker closes'],
    ['Normal latency', ms(b.normal_latency_ms), 'probes must stay within 1.5 ×'],
    ['Cost, last hour', '—', r.cost_trigger],
  ] : [
    ['5xx, timeouts, unreachable', `${b.recent_failures} of the last ${b.recent_attempts} attempts`, `opens at ${b.failures_to_open} of 50`],
    ['429 run', b.rate_limited_for_ms === null ? 'none' : duration(b.rate_limited_for_ms), `opens at ${duration(b.rate_limit_run_ms)}`],
    ['P95 capacity wait', ms(b.wait_p95_ms), b.wait_slo_ms === null ? 'no SLO configured (control.wait_slo_ms)' : `opens above 80 % of ${ms(b.wait_slo_ms)}`],
    ['Cost, last hour', '—', r.cost_trigger],
    ['Normal latency', ms(b.normal_latency_ms), 'probes must stay within 1.5 ×'],
  ]
  return (
    <article className="route-detail" data-testid="breaker-detail">
      <header>
        <h3>{r.route} <span className={breakerPill(b.state)}>{b.state}</span></h3>
        <span className="muted">for {duration(b.in_state_ms)}{b.reopened ? ` · failed probation ${b.reopened} time(s) in a row` : ''}</span>
      </header>
      {b.reason && <p data-testid="breaker-reason">{b.reason}</p>}
      {b.state === 'probation' && (
        <p data-testid="probation">
          Probation: <strong>{b.probes_passed} of {b.probes_needed}</strong> probes passed{b.probe_in_flight ? '; one is running' : ''}. Probes go out one at a time; all must succeed within 1.5 × the normal latency.
        </p>
      )}
      <div className="split-2">
        <table className="grid" data-testid="breaker-figures">
          <caption className="muted small">G1 triggers, each against its threshold</caption>
          <tbody>{figures.map(([k, v, limit]) => <tr key={k}><th>{k}</th><td className="num">{v}</td><td className="muted small">{limit}</td></tr>)}</tbody>
        </table>
        <ManualForm conn={conn} r={r} onDone={() => audit.refetch()} />
      </div>
      <div className="charts">
        <Chart title={`Requests, ${r.route}`} data={charts.rate} series={[{ label: 'requests', color: '#3b82f6', unit: '/s' }]} />
        <Chart title="Amplification (1 min) and post-retry success" data={charts.amp}
          series={[{ label: 'attempts ÷ requests', color: '#f59e0b', unit: '×' }, { label: 'post-retry success', color: '#10b981', unit: '%' }]} />
      </div>
      <h3>Transitions</h3>
      {audit.error && <p role="alert" className="error">{(audit.error as Error).message}</p>}
      {audit.data && audit.data.length === 0 && <p className="muted">None yet: this breaker has been closed since it was made.</p>}
      {audit.data && audit.data.length > 0 && (
        <table className="grid" data-testid="breaker-history">
          <thead><tr><th>When</th><th>Move</th><th>Trigger</th><th>Who</th><th>Why</th></tr></thead>
          <tbody>
            {audit.data.map((e) => (
              <tr key={e.id}>
                <td>{time(e.at)}</td><td>{e.action.replace('->', ' → ')}</td><td>{trigger(e.trigger)}</td><td>{e.actor}</td>
                <td className="small">{e.reason}{figuresText(e.figures)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </article>
  )
}

function figuresText(json: string | null): string {
  if (!json) return ''
  try {
    const f = JSON.parse(json) as { name: string; value: number }[]
    return f.length ? ` (${f.map((x) => `${x.name.replace(/_/g, ' ')} ${count(x.value)}`).join(', ')})` : ''
  } catch {
    return ''
  }
}

/** G4: open or close by hand, with a name and a reason that go on the audit log. */
function ManualForm({ conn, r, onDone }: { conn: Connection; r: RouteControlView; onDone: () => void }) {
  const qc = useQueryClient()
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const open = r.breaker.state === 'closed'
  const submit = act(async () => {
    const v = await setBreaker(conn, open, { route: r.route, actor, reason })
    setReason('')
    onDone()
    qc.invalidateQueries({ queryKey: ['audit'] })
    return { ok: true, text: `Breaker ${v.breaker.state}. Recorded on the audit log.` }
  })
  return (
    <form className="manual" onSubmit={submit} data-testid="breaker-form">
      <h4>{open ? 'Open this breaker by hand' : 'Close this breaker by hand'}</h4>
      <p className="muted small">
        {open
          ? 'Interactive requests on this route will fail fast with retry-after and nothing is sent upstream until an operator closes it.'
          : 'Closing skips probation: traffic flows at once. Use it when you know the provider has recovered.'}
      </p>
      <label>Your name <input value={actor} onChange={(e) => setActor(e.target.value)} required maxLength={64} data-testid="breaker-actor" /></label>
      <label>Reason <input value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500} placeholder="e.g. provider incident INC-42" data-testid="breaker-reason-input" /></label>
      <button type="submit" disabled={busy || !actor.trim() || !reason.trim()} className={open ? 'danger' : undefined} data-testid="breaker-submit">
        {open ? 'Open breaker' : 'Close breaker'}
      </button>
      {msg && <p role={msg.ok ? 'status' : 'alert'} className={msg.ok ? 'ok-text small' : 'error small'}>{msg.text}</p>}
    </form>
  )
}
