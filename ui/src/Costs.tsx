// What the traffic cost (M1–M3, B3, B4): spend over a window with the part retries and
// failed attempts cost us, requests whose cost is unknown (never counted as zero), how
// close the estimates made before each call came, who spent it, the owners' balances and
// budgets with a top-up on the record, the routes' budgets, and the pricing catalog with
// its stale prices.
import { keepPreviousData, useQuery, useQueryClient } from '@tanstack/react-query'
import { useMemo, useState } from 'react'
import { getCosts, topUp, type Connection } from './api'
import type { CostCell } from './bindings/CostCell'
import type { CostView } from './bindings/CostView'
import type { OwnerView } from './bindings/OwnerView'
import type { PriceView } from './bindings/PriceView'
import type { PricingView } from './bindings/PricingView'
import type { RouteBudgetView } from './bindings/RouteBudgetView'
import { Chart } from './Chart'
import { count, money, pct } from './format'
import { useOperatorAction } from './actor'

const WINDOWS: { hours: number; label: string; words: string }[] = [
  { hours: 1, label: '1 h', words: 'the last hour' },
  { hours: 24, label: '24 h', words: 'the last 24 h' },
  { hours: 168, label: '7 d', words: 'the last 7 days' },
]

/** A route's cost breaker opens when its last hour spends more than this share of its daily budget. */
const HOURLY_SHARE = 0.25

/** The figures of a set of cells, summed. */
type Totals = {
  requests: number
  unknown: number
  cost: number
  failed: number
  retries: number
  estimated: number
  estimatedActual: number
  estimatedTokens: number
  actualTokens: number
}

const zero = (): Totals => ({ requests: 0, unknown: 0, cost: 0, failed: 0, retries: 0, estimated: 0, estimatedActual: 0, estimatedTokens: 0, actualTokens: 0 })

function addInto(t: Totals, c: CostCell) {
  t.requests += c.requests
  t.unknown += c.unknown_cost
  t.cost += c.cost_usd
  t.failed += c.failed_cost_usd
  t.retries += c.retries
  t.estimated += c.estimated_usd
  t.estimatedActual += c.estimated_actual_usd
  t.estimatedTokens += c.estimated_input_tokens
  t.actualTokens += c.actual_input_tokens
}

type Row = Totals & { name: string }

/** The cells summed by one of their dimensions, biggest spend first. */
function groupBy(cells: CostCell[], key: (c: CostCell) => string | null): Row[] {
  const rows = new Map<string, Row>()
  for (const c of cells) {
    const name = key(c) ?? '(none)'
    let r = rows.get(name)
    if (!r) {
      r = { name, ...zero() }
      rows.set(name, r)
    }
    addInto(r, c)
  }
  return [...rows.values()].sort((a, b) => b.cost - a.cost || b.requests - a.requests || a.name.localeCompare(b.name))
}

type Bucket = { at: number; t: Totals }

/** The cells summed per bucket, every bucket of the window from the first to now (empty
 * ones as zero, so a quiet hour draws as zero, not as a line across it). */
function buckets(v: CostView): Bucket[] {
  const byAt = new Map<number, Totals>()
  for (const c of v.cells) {
    let t = byAt.get(c.at)
    if (!t) {
      t = zero()
      byAt.set(c.at, t)
    }
    addInto(t, c)
  }
  const ats = [...byAt.keys()].sort((a, b) => a - b)
  if (ats.length === 0) return []
  const step = v.bucket_ms
  const first = ats[0]
  const last = Math.max(ats[ats.length - 1], v.now)
  if (step > 0 && (last - first) / step <= 2_000 && ats.every((at) => (at - first) % step === 0)) {
    const start = first - Math.max(0, Math.floor((first - v.since) / step)) * step
    const out: Bucket[] = []
    for (let at = start; at <= last; at += step) out.push({ at, t: byAt.get(at) ?? zero() })
    return out
  }
  return ats.map((at) => ({ at, t: byAt.get(at) ?? zero() }))
}

/** A bucket's start, to the minute, in UTC. */
function bucketLabel(at: number): string {
  return `${new Date(at).toISOString().slice(0, 16).replace('T', ' ')} UTC`
}

/** A part of a whole as a share (bounded), or a dash when there is no whole. */
function share(part: number, whole: number): string {
  return whole > 0 ? pct(part / whole) : '—'
}

/** A ratio as a percentage that may pass 100 (actual over estimate). */
function ratio(v: number | null): string {
  if (v === null || !Number.isFinite(v)) return '—'
  return `${Math.round(v * 100)} %`
}

/** A signed error as a percentage: `+20 %` means the estimate was 20 % above. */
function signedPct(v: number | null): string {
  if (v === null || !Number.isFinite(v)) return '—'
  const p = v * 100
  const a = Math.abs(p)
  const s = a < 10 ? a.toFixed(1) : String(Math.round(a))
  return `${p > 0 ? '+' : p < 0 ? '−' : ''}${s} %`
}

export function CostsView({ conn }: { conn: Connection }) {
  const [hours, setHours] = useState(24)
  const q = useQuery({
    queryKey: ['costs', conn.url, hours],
    queryFn: () => getCosts(conn, hours),
    // Every 10 s and no faster: the report is computed from the ledger on each call.
    refetchInterval: 10_000,
    placeholderData: keepPreviousData,
  })
  const view = q.data
  const words = WINDOWS.find((w) => w.hours === hours)?.words ?? `the last ${hours} h`

  const figures = useMemo(() => {
    const cells = view?.cells ?? []
    const total = zero()
    for (const c of cells) addInto(total, c)
    const b = view ? buckets(view) : []
    const t = b.map((x) => x.at / 1000)
    return {
      total,
      buckets: b,
      spend: [t, b.map((x) => x.t.cost), b.map((x) => x.t.failed)],
      estimate: [t, b.map((x) => x.t.estimated), b.map((x) => x.t.estimatedActual)],
      owners: groupBy(cells, (c) => c.owner),
      keys: groupBy(cells, (c) => c.key_name),
      routes: groupBy(cells, (c) => c.route),
      models: groupBy(cells, (c) => c.model),
    }
  }, [view])

  if (!view) {
    return (
      <section aria-busy={!q.error} className="empty">
        {q.error ? <p role="alert" className="error">{(q.error as Error).message}</p> : <p>Loading costs…</p>}
      </section>
    )
  }
  const t = figures.total
  const idle = view.cells.length === 0
  const stale = view.pricing.models.filter((m) => m.stale)
  return (
    <section className="costs">
      <div className="status-line">
        <div role="group" aria-label="Window" className="segmented">
          {WINDOWS.map((w) => (
            <button key={w.hours} type="button" aria-pressed={w.hours === hours} onClick={() => setHours(w.hours)} data-testid={`window-${w.hours}`}>
              {w.label}
            </button>
          ))}
        </div>
        <span className="muted small">
          Since {bucketLabel(view.since)} · refreshed every 10 s · budget days are counted in {view.time_zone}
        </span>
        {q.isPlaceholderData && <span className="muted small" aria-live="polite">Loading {words}…</span>}
        {q.error && <span role="alert" className="error small">Could not refresh: {(q.error as Error).message}</span>}
      </div>

      {stale.length > 0 && (
        <p role="status" className="banner warn" data-testid="stale-prices">
          <strong>
            {stale.length === 1 ? '1 price was' : `${stale.length} prices were`} checked more than {view.pricing.stale_after_days} days ago:
          </strong>{' '}
          {stale.map((m) => `${m.model} (${m.checked})`).join(', ')}. Costs use them as they are; check them against their source and update the catalog.
        </p>
      )}
      {view.unpriced_models.length > 0 && (
        <p role="status" className="banner warn" data-testid="unpriced-models">
          <strong>Unpriced models:</strong> {view.unpriced_models.join(', ')}. Their cost is unknown, never counted as zero; add them to the
          pricing catalog.
        </p>
      )}

      <h2>Spend in {words}</h2>
      {idle && (
        <p className="muted" data-testid="costs-empty">
          No traffic yet in {words}: requests and their cost show up here once an SDK calls this gateway.
        </p>
      )}
      <div className="tiles">
        <Tile label="Spend" value={money(t.cost)} testid="tile-spend"
          sub={`${count(t.requests)} requests${t.unknown ? `; ${count(t.unknown)} of unknown cost not in it` : ''}`}
          hint="What the requests received in the window cost, failed attempts included" />
        <Tile label="What retries cost us" value={money(t.failed)} testid="tile-failed"
          sub={`${share(t.failed, t.cost)} of spend · ${count(t.retries)} retries`}
          hint="The part of the spend used by attempts that did not give the answer (retried, failed over or failed)" />
        <Tile label="Unknown cost" value={count(t.unknown)} testid="tile-unknown-cost" warn={t.unknown > 0}
          sub="requests: an unpriced model, or no usage reported; never counted as zero"
          hint="Requests whose cost is unknown are not in the spend" />
        <Tile label="Actual ÷ estimate" value={t.estimated > 0 ? ratio(t.estimatedActual / t.estimated) : '—'} testid="tile-estimate"
          sub={t.actualTokens > 0
            ? `input tokens estimated ${signedPct((t.estimatedTokens - t.actualTokens) / t.actualTokens)} off`
            : 'no request with an estimate and an actual yet'}
          hint="Over the requests with both: actual cost ÷ the cost expected before the call (input estimate and output cap); input-token error = (estimated − actual) ÷ actual" />
        <Tile label="Pricing catalog" value={view.pricing.version.slice(0, 10)} testid="tile-pricing" mono
          sub={view.pricing.origin} hint={`Version ${view.pricing.version}: each request records the version its cost was computed with`} />
      </div>

      {!idle && (
        <>
          <h2>Over time</h2>
          <div className="charts">
            <div>
              <Chart title={`Spend per ${bucketWords(view.bucket_ms)}, USD`} data={figures.spend}
                series={[{ label: 'spend', color: '#3b82f6', unit: 'USD' }, { label: 'failed attempts', color: '#ef4444', unit: 'USD' }]} />
              <Figures caption="Spend per bucket (buckets not listed had no requests)" testid="spend-figures"
                heads={['Bucket', 'Requests', 'Spend', 'Failed attempts']}
                rows={figures.buckets.filter((b) => b.t.requests > 0).map((b) => [bucketLabel(b.at), count(b.t.requests), money(b.t.cost), money(b.t.failed)])} />
            </div>
            <div>
              <Chart title="Estimate before the call vs actual, USD" data={figures.estimate}
                series={[{ label: 'estimated', color: '#f59e0b', unit: 'USD' }, { label: 'actual', color: '#10b981', unit: 'USD' }]} />
              <Figures caption="Estimate vs actual per bucket, over the requests with both (others not listed)" testid="estimate-figures"
                heads={['Bucket', 'Estimated', 'Actual', 'Actual ÷ estimate']}
                rows={figures.buckets.filter((b) => b.t.estimated > 0).map((b) => [bucketLabel(b.at), money(b.t.estimated), money(b.t.estimatedActual), ratio(b.t.estimatedActual / b.t.estimated)])} />
            </div>
          </div>
          <SpendTable title="Spend by owner" what="Owner" rows={figures.owners} total={t.cost} testid="spend-by-owner" />
          <SpendTable title="Spend by key" what="Key" rows={figures.keys} total={t.cost} testid="spend-by-key" />
          <SpendTable title="Spend by route" what="Route" rows={figures.routes} total={t.cost} testid="spend-by-route" />
          <SpendTable title="Spend by model" what="Model" rows={figures.models} total={t.cost} testid="spend-by-model" />
        </>
      )}

      <h2>Budgets and balances</h2>
      <Owners conn={conn} owners={view.owners} />
      <RouteBudgets routes={view.routes} />

      <h2>Pricing catalog</h2>
      <Pricing pricing={view.pricing} />
    </section>
  )
}

function bucketWords(bucketMs: number): string {
  if (bucketMs >= 3_600_000 && bucketMs % 3_600_000 === 0) return bucketMs === 3_600_000 ? 'hour' : `${bucketMs / 3_600_000} h`
  if (bucketMs >= 60_000 && bucketMs % 60_000 === 0) return bucketMs === 60_000 ? 'minute' : `${bucketMs / 60_000} min`
  return `${Math.round(bucketMs / 1000)} s`
}

function Tile({ label, value, sub, hint, testid, warn = false, mono = false }: {
  label: string; value: string; sub: string; hint: string; testid: string; warn?: boolean; mono?: boolean
}) {
  return (
    <div className={warn ? 'tile warn' : 'tile'} title={hint}>
      <div className="tile-label">{label}</div>
      <div className={mono ? 'tile-value mono' : 'tile-value'} data-testid={testid}>{value}</div>
      <div className="muted small" data-testid={`${testid}-sub`}>{sub}</div>
    </div>
  )
}

/** A chart's text alternative: the figures it draws, folded under it. */
function Figures({ caption, heads, rows, testid }: { caption: string; heads: string[]; rows: string[][]; testid: string }) {
  return (
    <details className="figures" data-testid={testid}>
      <summary className="small">The figures in this chart ({rows.length} {rows.length === 1 ? 'bucket' : 'buckets'})</summary>
      <table className="grid">
        <caption className="muted small">{caption}</caption>
        <thead><tr>{heads.map((h, i) => <th key={h} className={i ? 'num' : undefined}>{h}</th>)}</tr></thead>
        <tbody>
          {rows.map((r, n) => <tr key={n}>{r.map((v, i) => <td key={i} className={i ? 'num' : undefined}>{v}</td>)}</tr>)}
        </tbody>
      </table>
    </details>
  )
}

function SpendTable({ title, what, rows, total, testid }: { title: string; what: string; rows: Row[]; total: number; testid: string }) {
  return (
    <>
      <h2>{title}</h2>
      <table className="grid" data-testid={testid}>
        <thead>
          <tr>
            <th>{what}</th><th className="num">Requests</th><th className="num">Spend</th>
            <th className="num" title="This row's spend ÷ all spend in the window">Share</th>
            <th className="num" title="Spent on attempts that did not give the answer">Retries cost</th>
            <th className="num" title="Upstream attempts beyond the first">Retries</th>
            <th className="num" title="Requests whose cost is unknown: not in the spend">Unknown cost</th>
          </tr>
        </thead>
        <tbody>
          {rows.map((r) => (
            <tr key={r.name}>
              <td>{r.name}</td><td className="num">{count(r.requests)}</td><td className="num">{money(r.cost)}</td>
              <td className="num">{share(r.cost, total)}</td><td className="num">{money(r.failed)}</td>
              <td className="num">{count(r.retries)}</td>
              <td className={r.unknown ? 'num warn-text' : 'num'}>{r.unknown ? count(r.unknown) : '—'}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </>
  )
}

/** Why an owner's requests are (or would be) refused, as pills. */
function ownerStatus(o: OwnerView): { pill: string; text: string }[] {
  const out: { pill: string; text: string }[] = []
  if (!o.prepaid) out.push({ pill: 'pill ok', text: 'not prepaid (metered only)' })
  else if (o.balance_usd <= 0) out.push({ pill: 'pill bad', text: '402: requests refused' })
  else out.push({ pill: 'pill ok', text: 'funded' })
  if (o.daily_budget_usd !== null) {
    if (o.spent_today_usd >= o.daily_budget_usd) out.push({ pill: 'pill bad', text: 'daily budget spent: requests refused' })
    else if (o.spent_today_usd >= 0.8 * o.daily_budget_usd) out.push({ pill: 'pill warn', text: `${pct(o.spent_today_usd / o.daily_budget_usd)} of the daily budget` })
  }
  return out
}

function Owners({ conn, owners }: { conn: Connection; owners: OwnerView[] }) {
  if (owners.length === 0) return <p className="muted" data-testid="owners-empty">No owners: keys name their owner in the config or when they are made.</p>
  return (
    <table className="grid" data-testid="owners">
      <caption className="muted small">
        Owners. A prepaid owner whose balance is at or below zero has its requests refused with 402 until it is topped up.
      </caption>
      <thead>
        <tr>
          <th>Owner</th><th className="num" title="Credits minus costs">Balance</th><th>Prepaid</th>
          <th className="num">Daily budget</th><th className="num">Spent today</th><th>Status</th><th>Top up</th>
        </tr>
      </thead>
      <tbody>
        {owners.map((o) => <OwnerRow key={o.name} conn={conn} o={o} />)}
      </tbody>
    </table>
  )
}

/** B4: an owner's balance and budget, with a top-up that asks who and why and says the
 * balance it will leave before it is sent. */
function OwnerRow({ conn, o }: { conn: Connection; o: OwnerView }) {
  const qc = useQueryClient()
  const [asking, setAsking] = useState(false)
  const [amount, setAmount] = useState('')
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const value = Number(amount)
  const valid = amount.trim() !== '' && Number.isFinite(value) && value > 0
  const submit = act(async () => {
    if (!valid) return null
    const after = await topUp(conn, o.name, { amount_usd: value, actor: actor.trim(), reason: reason.trim() })
    setAsking(false)
    setAmount('')
    setReason('')
    qc.invalidateQueries({ queryKey: ['costs'] })
    const still = after.prepaid && after.balance_usd <= 0 ? ' It is still at or below zero: requests stay refused (402).' : ''
    return { ok: true, text: `Added ${money(value)}: ${after.name}'s balance is now ${money(after.balance_usd)}.${still}` }
  })
  return (
    <tr data-testid={`owner-${o.name}`}>
      <td>{o.name}</td>
      <td className={o.prepaid ? (o.balance_usd <= 0 ? 'num error' : 'num') : 'num muted'}
        title={o.prepaid ? undefined : 'Not prepaid: the owner is not held to its balance'} data-testid="owner-balance">
        {money(o.balance_usd)}
      </td>
      <td>{o.prepaid ? 'yes' : 'no'}</td>
      <td className="num">{o.daily_budget_usd === null ? 'none' : money(o.daily_budget_usd)}</td>
      <td className="num">{money(o.spent_today_usd)}</td>
      <td data-testid="owner-status">
        {ownerStatus(o).map((s) => <span key={s.text} className={`${s.pill} gap`}>{s.text}</span>)}
      </td>
      <td>
        {!asking && <button type="button" onClick={() => setAsking(true)} data-testid={`top-up-${o.name}`}>Top up…</button>}
        {asking && (
          <form onSubmit={submit} className="inline-form" data-testid="top-up-form">
            <span className="small">
              Adds money to {o.name}’s balance{o.prepaid ? '' : ' and makes it prepaid: from then on its requests are refused (402) once the balance is spent'}.
              A deficit is taken from the top-up first.
            </span>
            <label>Amount (USD)
              <input type="number" min={0.01} step={0.01} inputMode="decimal" value={amount} onChange={(e) => setAmount(e.target.value)} required data-testid="top-up-amount" />
            </label>
            {valid && (
              <span className="small" data-testid="top-up-preview">
                Balance after: {money(o.balance_usd + value)}{o.balance_usd < 0 ? ` (${money(-o.balance_usd)} of it pays off the deficit)` : ''}.
              </span>
            )}
            <label>Your name
              <input value={actor} onChange={(e) => setActor(e.target.value)} required maxLength={64} data-testid="top-up-actor" />
            </label>
            <label>Reason
              <input value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500} placeholder="e.g. invoice 2024-117 paid" data-testid="top-up-reason" />
            </label>
            <button type="submit" disabled={busy || !valid || !actor.trim() || !reason.trim()} data-testid="top-up-submit">
              {valid ? `Add ${money(value)}` : 'Add'}
            </button>
            <button type="button" onClick={() => setAsking(false)}>Cancel</button>
          </form>
        )}
        {msg && <div role={msg.ok ? 'status' : 'alert'} className={msg.ok ? 'ok-text small' : 'error small'} data-testid="top-up-result">{msg.text}</div>}
      </td>
    </tr>
  )
}

function RouteBudgets({ routes }: { routes: RouteBudgetView[] }) {
  return (
    <>
      <h3>Route budgets</h3>
      {routes.length === 0 ? (
        <p className="muted" data-testid="route-budgets-empty">No route has a budget or any spend today.</p>
      ) : (
        <table className="grid" data-testid="route-budgets">
          <caption className="muted small">A route’s cost breaker opens above {pct(HOURLY_SHARE)} of its daily budget spent in an hour.</caption>
          <thead>
            <tr>
              <th>Route</th><th className="num">Daily budget</th><th className="num">Spent today</th><th className="num">Last hour</th><th>Cost breaker</th>
            </tr>
          </thead>
          <tbody>
            {routes.map((r) => {
              const limit = r.daily_budget_usd === null ? null : r.daily_budget_usd * HOURLY_SHARE
              return (
                <tr key={r.route}>
                  <td>{r.route}</td>
                  <td className="num">{r.daily_budget_usd === null ? 'none' : money(r.daily_budget_usd)}</td>
                  <td className="num">{money(r.spent_today_usd)}</td>
                  <td className={limit !== null && r.last_hour_usd > limit ? 'num error' : 'num'}>{money(r.last_hour_usd)}</td>
                  <td className="small">
                    {limit === null
                      ? <span className="muted">dormant: no daily budget</span>
                      : <>breaker opens above 25 % of the daily budget in an hour: {money(limit)}{r.last_hour_usd > limit && <> <span className="pill bad">over</span></>}</>}
                  </td>
                </tr>
              )
            })}
          </tbody>
        </table>
      )}
    </>
  )
}

/** Prices per million tokens. */
function perM(v: number | null): string {
  return v === null ? '—' : money(v)
}

function host(url: string): string {
  try {
    return new URL(url).hostname || url
  } catch {
    return url
  }
}

function longContext(p: PriceView): string {
  if (p.long_context_above === null) return '—'
  return `above ${count(p.long_context_above)} tokens: ${perM(p.long_input)} in, ${perM(p.long_output)} out`
}

function Pricing({ pricing }: { pricing: PricingView }) {
  return (
    <details className="figures" data-testid="pricing">
      <summary>
        {pricing.models.length} models · version <code>{pricing.version}</code> · from {pricing.origin} · a price checked more than{' '}
        {pricing.stale_after_days} days ago is stale
      </summary>
      <table className="grid">
        <caption className="muted small">USD per million tokens</caption>
        <thead>
          <tr>
            <th>Model</th><th>Provider</th><th className="num">Input</th><th className="num">Cached input</th><th className="num">Cache write</th>
            <th className="num">Output</th><th>Long context</th><th>Checked</th><th>Source</th>
          </tr>
        </thead>
        <tbody>
          {pricing.models.map((p) => (
            <tr key={`${p.provider}/${p.model}`} data-testid={`price-${p.model}`}>
              <td>{p.model}{p.aliases.length > 0 && <div className="muted small">also {p.aliases.join(', ')}</div>}</td>
              <td>{p.provider}</td>
              <td className="num">{perM(p.input)}</td><td className="num">{perM(p.cached_input)}</td><td className="num">{perM(p.cache_write)}</td>
              <td className="num">{perM(p.output)}</td><td className="small">{longContext(p)}</td>
              <td>{p.checked}{p.stale && <> <span className="pill warn">stale</span></>}</td>
              <td><a href={p.source} target="_blank" rel="noreferrer">{host(p.source)}</a></td>
            </tr>
          ))}
        </tbody>
      </table>
    </details>
  )
}
