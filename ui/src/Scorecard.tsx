// The N2 scorecard: a run's route (and the gateway overall) over three periods, the 28 days
// before the incident, the incident, and the 60 minutes after it, so an operator sees what
// the incident cost and whether the route is back to where it was. Below, what needs a
// decision and who must make it. A drill's scorecard says so before any figure.
import { skipToken, useQuery } from '@tanstack/react-query'
import { useState } from 'react'
import { getRecoveries, getScorecard, type Connection } from './api'
import type { ErrorCount } from './bindings/ErrorCount'
import type { RecoverySummary } from './bindings/RecoverySummary'
import type { ReviewFlag } from './bindings/ReviewFlag'
import type { ScorePeriod } from './bindings/ScorePeriod'
import type { ScoreRow } from './bindings/ScoreRow'
import { count, money, ms, pct, time } from './format'
import { navigate } from './router'

const PERIOD_WORDS: Record<ScorePeriod['name'], { label: string; span: string }> = {
  before: { label: 'Before', span: 'the 28 days before the incident' },
  incident: { label: 'Incident', span: 'from the incident’s start to the run’s close (or now, while it is open)' },
  after: { label: 'After', span: 'the 60 minutes after the run closed' },
}

/** The figures of a score row, in the order of `SCORE_HEADERS`. */
export const SCORE_HEADERS: { label: string; title?: string; num: boolean }[] = [
  { label: 'Requests', num: true },
  { label: 'Attempts', num: true },
  { label: 'Amplification', title: 'Attempts ÷ the requests that reached a provider', num: true },
  { label: 'Success', title: 'Requests that succeeded ÷ all requests', num: true },
  { label: 'Post-retry success', title: 'Retried requests that succeeded in the end ÷ retried requests', num: true },
  { label: 'P50 / P95', title: 'Latency, first byte of the request to the last of the answer', num: true },
  { label: 'Wait P50 / P95', title: 'Time spent waiting for capacity', num: true },
  { label: 'Cost incl. failures', title: 'What the providers charge, failed attempts included', num: true },
  { label: 'Unpriced', title: 'Requests the pricing catalog has no price for: not in the cost', num: true },
  { label: 'Duplicates', title: 'Idempotency keys that completed twice', num: true },
  { label: 'Unknowns', title: 'Requests whose outcome nobody knows', num: true },
  { label: 'Error mix', num: false },
]

/** Failures by class, biggest first: `server error 12 · rate limit 3`. */
export function errorMixText(mix: ErrorCount[]): string {
  const parts = mix.filter((e) => e.count > 0).sort((a, b) => b.count - a.count || a.class.localeCompare(b.class))
  return parts.length ? parts.map((e) => `${e.class.replace(/_/g, ' ')} ${count(e.count)}`).join(' · ') : 'none'
}

function amplification(v: number | null): string {
  return v === null ? '—' : `${v.toFixed(2)} ×`
}

/** A score row's cells; a period without a row had no traffic on the route. */
export function ScoreCells({ row }: { row: ScoreRow | null | undefined }) {
  if (!row) return <td colSpan={SCORE_HEADERS.length} className="muted small">no traffic in this period</td>
  return (
    <>
      <td className="num">{count(row.requests)}</td>
      <td className="num">{count(row.attempts)}</td>
      <td className="num">{amplification(row.amplification)}</td>
      <td className="num">{pct(row.success_rate)}</td>
      <td className="num">{pct(row.post_retry_success_rate)}</td>
      <td className="num">{ms(row.p50_ms)} / {ms(row.p95_ms)}</td>
      <td className="num">{ms(row.wait_p50_ms)} / {ms(row.wait_p95_ms)}</td>
      <td className="num">{money(row.cost_usd)}</td>
      <td className={row.unpriced > 0 ? 'num warn-text' : 'num'}>{count(row.unpriced)}</td>
      <td className={row.duplicates > 0 ? 'num error' : 'num'}>{count(row.duplicates)}</td>
      <td className={row.unknowns > 0 ? 'num error' : 'num'}>{count(row.unknowns)}</td>
      <td className="small wrap">{errorMixText(row.error_mix)}</td>
    </>
  )
}

/** Each route in the order the periods list them, `overall` last. */
function routesOf(periods: ScorePeriod[]): string[] {
  const seen: string[] = []
  for (const p of periods) for (const r of p.rows) if (!seen.includes(r.route)) seen.push(r.route)
  return [...seen.filter((r) => r !== 'overall'), ...seen.filter((r) => r === 'overall')]
}

/** A role or a rule as the gateway spells it (`business_owner`), in words. */
function words(code: string): string {
  return code.replace(/_/g, ' ')
}

export function ScorecardView({ conn, run, route }: { conn: Connection; run: string | null; route: string | null }) {
  const list = useQuery({ queryKey: ['recoveries', conn.url], queryFn: () => getRecoveries(conn), refetchInterval: 30_000 })
  const of = run ? { run } : route ? { route } : null
  // Twenty-eight days of figures are not cheap to compute: read again twice a minute, not
  // every tick, and only while the page is looked at.
  const card = useQuery({
    queryKey: ['scorecard', conn.url, run, route],
    queryFn: of ? () => getScorecard(conn, of) : skipToken,
    refetchInterval: 30_000,
    retry: false,
  })
  const runs = [...(list.data?.runs ?? [])].sort((a, b) => b.opened_at - a.opened_at)
  const known = [...new Set([
    ...runs.map((r) => r.route),
    ...(list.data?.drill_routes ?? []),
    ...(list.data?.suggestions.map((s) => s.route) ?? []),
  ])].sort()
  const s = card.data
  return (
    <section>
      <h2>Scorecard</h2>
      <p className="muted">
        A route’s figures over three periods side by side: the 28 days before an incident, the incident, and the 60
        minutes after it, then the gateway overall. Pick a recovery run, or a route.
      </p>
      <Picker key={`${run ?? ''}|${route ?? ''}`} run={run} route={route} runs={runs} routes={known} />
      {list.error && <p role="alert" className="error">{(list.error as Error).message}</p>}
      {!of && <p className="muted" data-testid="scorecard-none">Choose a run or a route to see its scorecard.</p>}
      {of && card.error && <p role="alert" className="error" data-testid="scorecard-error">{(card.error as Error).message}</p>}
      {of && !s && !card.error && <p className="muted" aria-busy>Computing the scorecard…</p>}
      {s && (
        <article className="route-detail scorecard" data-testid="scorecard" data-drill={s.drill ? 'true' : 'false'}>
          <header>
            <h3>
              {s.run ? <>Run <span className="mono">{s.run}</span>{s.route && <> on {s.route}</>}</> : <>Route {s.route ?? route}</>}
            </h3>
            {s.drill && <span className="pill drill" data-testid="scorecard-drill">DRILL</span>}
          </header>
          {s.drill && (
            <p className="banner warn" data-testid="scorecard-drill-banner">
              <strong>DRILL.</strong> The incident in these figures was staged on simulated channels to practise a recovery;
              no real provider or customer was affected. Do not read it as a real incident.
            </p>
          )}
          <ul className="periods" data-testid="scorecard-periods">
            {s.periods.map((p) => (
              <li key={p.name} data-testid={`scorecard-period-${p.name}`}>
                <strong>{PERIOD_WORDS[p.name].label}</strong>: {PERIOD_WORDS[p.name].span}, {time(p.from)} to {time(p.to)}
              </li>
            ))}
          </ul>
          <ScoreTable periods={s.periods} />
          <Flags flags={s.flags} />
        </article>
      )}
    </section>
  )
}

function Picker({ run, route, runs, routes }: { run: string | null; route: string | null; runs: RecoverySummary[]; routes: string[] }) {
  const [draft, setDraft] = useState(route ?? '')
  return (
    <div className="search" data-testid="scorecard-pick">
      <label>Run{' '}
        <select value={run ?? ''} onChange={(e) => navigate({ view: 'scorecard', run: e.target.value || null, route: null })} data-testid="scorecard-run">
          <option value="">Choose a recovery run</option>
          {runs.map((r) => (
            <option key={r.id} value={r.id}>{r.id} · {r.route}{r.drill ? ' · DRILL' : ''} · opened {time(r.opened_at)}</option>
          ))}
        </select>
      </label>
      <form role="search" aria-label="Scorecard of a route" className="row-actions"
        onSubmit={(e) => { e.preventDefault(); if (draft.trim()) navigate({ view: 'scorecard', run: null, route: draft.trim() }) }}>
        <input aria-label="Route" placeholder="or a route, e.g. openai/gpt-4o-mini" list="scorecard-routes" value={draft}
          onChange={(e) => setDraft(e.target.value)} data-testid="scorecard-route" />
        <datalist id="scorecard-routes">{routes.map((r) => <option key={r} value={r} />)}</datalist>
        <button type="submit" disabled={!draft.trim()} data-testid="scorecard-route-show">Show route</button>
      </form>
    </div>
  )
}

function ScoreTable({ periods }: { periods: ScorePeriod[] }) {
  const routes = routesOf(periods)
  if (routes.length === 0) return <p className="muted" data-testid="scorecard-table">No traffic in any of the three periods.</p>
  return (
    // Focusable: at a narrow width the table scrolls sideways, and a keyboard must reach it.
    <div className="results" tabIndex={0} role="region" aria-label="Scorecard figures">
      <table className="grid" data-testid="scorecard-table">
        <caption className="muted small">Each route, then the gateway overall; its three periods one under the other</caption>
        <thead>
          <tr>
            <th scope="col">Route · period</th>
            {SCORE_HEADERS.map((h) => <th key={h.label} scope="col" className={h.num ? 'num' : undefined} title={h.title}>{h.label}</th>)}
          </tr>
        </thead>
        {routes.map((r) => (
          <tbody key={r} data-testid={`scorecard-route-${r}`}>
            <tr className="group">
              <th scope="rowgroup" colSpan={SCORE_HEADERS.length + 1}>{r === 'overall' ? 'Overall (every route)' : r}</th>
            </tr>
            {periods.map((p) => (
              <tr key={p.name} data-testid={`scorecard-row-${r}-${p.name}`} className={p.name === 'incident' ? 'incident' : undefined}>
                <th scope="row">{PERIOD_WORDS[p.name].label}</th>
                <ScoreCells row={p.rows.find((x) => x.route === r)} />
              </tr>
            ))}
          </tbody>
        ))}
      </table>
    </div>
  )
}

function Flags({ flags }: { flags: ReviewFlag[] }) {
  // Escalations first: they are what someone has to act on today.
  const sorted = [...flags.filter((f) => f.escalation), ...flags.filter((f) => !f.escalation)]
  const escalations = flags.filter((f) => f.escalation).length
  return (
    <>
      <h4>Review flags</h4>
      {sorted.length === 0 ? (
        <p className="ok-text" data-testid="scorecard-flags">None: nothing in these figures needs a decision.</p>
      ) : (
        <>
          <p className="small" data-testid="scorecard-flags-summary">
            {count(sorted.length)} flag(s) need a decision{escalations > 0 ? `, ${count(escalations)} of them escalated` : ''}.
          </p>
          <table className="grid" data-testid="scorecard-flags">
            <thead><tr><th>Rule</th><th>Route</th><th>What</th><th>Who must decide</th><th>Escalation</th></tr></thead>
            <tbody>
              {sorted.map((f, i) => (
                <tr key={`${f.rule}-${f.route ?? ''}-${i}`} data-testid={`scorecard-flag-${i}`} data-escalation={f.escalation ? 'true' : 'false'}
                  className={f.escalation ? 'escalation' : undefined}>
                  <td><code>{f.rule}</code></td>
                  <td>{f.route ?? 'every route'}</td>
                  <td className="small wrap">{f.detail}</td>
                  <td data-testid="scorecard-flag-decide">{f.decide.length ? f.decide.map(words).join(' and ') : '—'}</td>
                  <td>{f.escalation ? <span className="pill bad">escalation</span> : <span className="muted small">no</span>}</td>
                </tr>
              ))}
            </tbody>
          </table>
        </>
      )}
    </>
  )
}
