import { useMemo, useState } from 'react'
import { pruneLedger, restoreChannel, type Connection } from './api'
import type { LedgerFigures } from './bindings/LedgerFigures'
import type { PruneReport } from './bindings/PruneReport'
import type { ChannelView } from './bindings/ChannelView'
import type { RouteControlView } from './bindings/RouteControlView'
import type { LanesView } from './bindings/LanesView'
import { linkProps } from './router'
import { Chart } from './Chart'
import { apiLabel, breakerPill, bytes, count, duration, errorMix, ms, pct, rate, rejectReason, rotationPill, severityClass, time, usd } from './format'
import { useLive } from './useLive'
import { useOperatorAction } from './actor'

export function OverviewView({ conn }: { conn: Connection }) {
  const { overview, error, connected, alerts } = useLive(conn)

  const charts = useMemo(() => {
    const s = overview?.series ?? []
    const t = s.map((p) => p.at / 1000)
    return {
      traffic: [t, s.map((p) => p.requests), s.map((p) => p.errors)],
      latency: [t, s.map((p) => p.p50_ms), s.map((p) => p.p95_ms)],
      inflight: [t, s.map((p) => p.in_flight)],
    }
  }, [overview?.series])

  if (!overview) {
    return (
      <section aria-busy={!error} className="empty">
        {error ? <p role="alert" className="error">{error}</p> : <p>Connecting to the gateway…</p>}
      </section>
    )
  }
  const h = overview.headline
  const idle = overview.series.every((p) => p.requests === 0) && h.in_flight === 0
  return (
    <section>
      <div className="status-line">
        <span className={connected ? 'pill ok' : 'pill warn'}>{connected ? 'live' : 'reconnecting'}</span>
        {error && !connected && <span className="error">{error}</span>}
        {idle && <span className="muted">No traffic yet: point an SDK at this gateway and requests show up here.</span>}
      </div>
      {!overview.ledger.ok && (
        <p role="alert" className="banner error" data-testid="ledger-failing">
          <strong>The ledger is refusing writes</strong>
          {overview.ledger.failing_since !== null && <> since {time(overview.ledger.failing_since)}</>}
          {overview.ledger.error && <>: {overview.ledger.error}</>}. New requests are answered 503 until it takes
          writes again; {count(overview.ledger.waiting)} finished records are waiting to be written.
        </p>
      )}
      {alerts.length > 0 && (
        <ul className="alerts" data-testid="alerts" aria-live="polite">
          {alerts.map((a) => (
            <li key={`${a.at}-${a.title}`} className={severityClass(a.severity)}>
              <strong>{a.title}</strong> — {a.body} <span className="muted">{new Date(a.at).toLocaleTimeString()}</span>
            </li>
          ))}
        </ul>
      )}
      <div className="tiles">
        <Tile label="Requests" value={rate(h.requests_per_s)} hint="Finished requests per second, averaged over the last 10 s" testid="tile-rps" />
        <Tile label="Error rate" value={pct(h.error_rate)} hint="Failed ÷ finished requests over the last 60 s" testid="tile-errors" />
        <Tile label="Latency p50" value={ms(h.p50_ms)} hint="Median time from receipt to the end of the answer, last 10 s" testid="tile-p50" />
        <Tile label="Latency p95" value={ms(h.p95_ms)} hint="95th percentile, last 10 s" testid="tile-p95" />
        <Tile label="In flight" value={count(h.in_flight)} hint="Requests admitted to a channel and not finished" testid="tile-inflight" />
        <Tile label="Refused, no row" value={count(h.rejected_last_minute)} hint="Requests refused without a ledger row, last 60 s: no valid key, a foreign Host name, or a ledger refusing writes; counted, not written one by one" testid="tile-rejected" />
      </div>
      <LedgerPanel conn={conn} f={overview.ledger_figures} />
      <div className="charts">
        <Chart title="Traffic, last 15 min" data={charts.traffic} series={[{ label: 'requests', color: '#3b82f6', unit: '/s' }, { label: 'errors', color: '#ef4444', unit: '/s' }]} />
        <Chart title="Latency" data={charts.latency} series={[{ label: 'p50', color: '#10b981', unit: 'ms' }, { label: 'p95', color: '#f59e0b', unit: 'ms' }]} />
        <Chart title="In flight" data={charts.inflight} series={[{ label: 'in flight', color: '#8b5cf6', unit: 'req' }]} />
      </div>
      <h2>Routes</h2>
      {overview.routes.length === 0 ? (
        <p className="muted">No routes have seen traffic yet.</p>
      ) : (
        <table className="grid" data-testid="routes">
          <thead>
            <tr>
              <th>Provider</th><th>Model</th><th>Endpoint</th><th>Owner</th><th className="num">In flight</th>
              <th className="num" title="Waiting for channel capacity (or a paced channel) right now">Queued</th>
              <th className="num" title="Requests that had to wait for capacity since start: count, mean and longest wait">Waited</th>
              <th className="num">Requests</th><th className="num" title="Succeeded ÷ finished">Success</th>
              <th className="num" title="Upstream attempts ÷ requests (retry amplification)">Attempts/req</th>
              <th title="Failed upstream attempts by class since start, retried or not">Errors by class</th><th className="num">Cost</th>
              <th>Breaker</th>
            </tr>
          </thead>
          <tbody>
            {overview.routes.map((r) => (
              <tr key={`${r.provider}/${r.model}/${r.owner}/${r.api}`}>
                <td>{r.provider}</td><td>{r.model}</td><td data-testid="route-api">{apiLabel(r.api)}</td><td>{r.owner || '—'}</td>
                <td className="num">{count(r.in_flight)}</td><td className="num" data-testid="route-queued">{count(r.queued)}</td>
                <td className="num" data-testid="route-waited">{r.waited ? `${count(r.waited)} · ${ms(r.wait_ms_total / r.waited)} avg · ${ms(r.wait_ms_max)} max` : '—'}</td>
                <td className="num">{count(r.requests)}</td>
                <td className="num">{pct(r.requests ? r.succeeded / r.requests : null)}</td>
                <td className="num">{r.requests ? (r.attempts / r.requests).toFixed(2) : '—'}</td>
                <td data-testid="route-errors">{errorMix(r.errors_by_class)}</td>
                <td className="num">{r.cost_unknown === r.requests ? 'unknown' : usd(r.cost_usd, r.cost_unknown)}</td>
                <td><BreakerLink route={`${r.provider}/${r.model}`} control={overview.control} /></td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
      <Lanes lanes={overview.lanes} />
      <h2>Channels</h2>
      <table className="grid" data-testid="channels">
        <thead>
          <tr>
            <th>Channel</th><th>Format</th><th>Upstream</th><th>Models</th><th className="num">In flight / cap</th>
            <th title="ready: takes new work · paced: the provider asked for a pause (Retry-After or reset) · ejected: credential or quota refused · cooling: out after repeated failures, back by itself · recovering: back, its share rising">Rotation</th>
            <th className="num">Share</th><th className="num">Latency</th><th className="num">Errors · ejections</th>
            <th title="The provider's own rate-limit headers: what is left in the current window">Provider room</th><th />
          </tr>
        </thead>
        <tbody>
          {overview.channels.map((c) => <ChannelRow key={c.name} c={c} conn={conn} />)}
        </tbody>
      </table>
      <h2>Refused without a ledger row</h2>
      {overview.rejections.length === 0 ? (
        <p className="muted" data-testid="rejections-empty">None: every request so far came with a valid key, to a Host this gateway answers, while its ledger took writes.</p>
      ) : (
        <table className="grid" data-testid="rejections">
          <caption className="muted small">The latest {overview.rejections.length}, newest first. These are counted, not written to the ledger one by one.</caption>
          <thead><tr><th>When</th><th>Why</th><th>Format</th><th>From</th></tr></thead>
          <tbody>
            {overview.rejections.map((r, i) => (
              <tr key={`${r.at}-${i}`}><td>{time(r.at)}</td><td>{rejectReason(r.reason)}</td><td>{r.format}</td><td>{r.peer ?? '—'}</td></tr>
            ))}
          </tbody>
        </table>
      )}
    </section>
  )
}

function ChannelRow({ c, conn }: { c: ChannelView; conn: Connection }) {
  const [asking, setAsking] = useState(false)
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const h = c.health
  const pill = rotationPill(h.state)
  const full = c.in_flight >= c.max_concurrency
  const room = [
    h.remaining_requests !== null ? `${count(h.remaining_requests)} req` : null,
    h.remaining_tokens !== null ? `${count(h.remaining_tokens)} tok` : null,
  ].filter(Boolean)
  const restore = act(async () => {
    await restoreChannel(conn, c.name, { actor, reason })
    setAsking(false)
    setReason('')
    return null
  })
  const latency = h.latency_ms === null ? '—' : `${ms(h.latency_ms)} (normal ${ms(h.normal_latency_ms)})`
  return (
    <tr data-testid={`channel-${c.name}`}>
      <td>{c.name}</td><td>{c.format}</td>
      <td title={c.has_credential ? 'calls carry this channel’s provider key' : 'no provider key'}>{c.base_url}</td>
      <td>{c.models.join(', ')}</td>
      <td className={full ? 'num warn-text' : 'num'} title={full ? 'At its cap: new requests go to another channel or wait' : undefined}>{c.in_flight} / {c.max_concurrency}</td>
      <td data-testid="channel-rotation">
        <span className={pill}>{h.state}</span>
        {h.back_in_ms !== null && <span className="muted"> back in {ms(h.back_in_ms)}</span>}
        {h.state === 'ejected' && h.back_in_ms === null && <span className="muted"> until restored</span>}
        {h.reason && <div className="muted small">{h.reason}</div>}
      </td>
      <td className="num" data-testid="channel-share" title="Its weight’s factor for new conversations: lowered by latency above its normal and by recent errors; ramps up after a cool-down">{pct(h.share)}</td>
      <td className="num" title="Latency estimate (peak-weighted, recent) against the channel’s own normal">{latency}</td>
      <td className="num" title="Provider failures per answer, recent average · ejections in a row">{pct(h.error_rate)} · {h.ejections}</td>
      <td className="num">{room.length ? room.join(' · ') : '—'}</td>
      <td>
        {h.state !== 'ready' && !asking && <button onClick={() => setAsking(true)} data-testid="restore">Restore…</button>}
        {asking && (
          <form onSubmit={restore} className="inline-form" data-testid="restore-form">
            <span className="small">Send new requests to {c.name} again now. If it still fails it leaves rotation again.</span>
            <input aria-label="Your name" placeholder="Your name" value={actor} onChange={(e) => setActor(e.target.value)} required maxLength={64} />
            <input aria-label="Reason" placeholder="Reason (goes on the audit log)" value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500} />
            <button type="submit" disabled={busy || !actor.trim() || !reason.trim()} data-testid="restore-confirm">Restore</button>
            <button type="button" onClick={() => setAsking(false)}>Cancel</button>
          </form>
        )}
        {msg && <div role="alert" className="error small">{msg.text}</div>}
      </td>
    </tr>
  )
}

/** J1, J7: what waits where, per route, and how full each workflow's lanes are. The
 * lanes that wait for a person link to their inbox. */
function Lanes({ lanes }: { lanes: LanesView }) {
  const streams = lanes.routes.reduce((n, r) => n + r.stream_recovery, 0)
  const fill = (n: number, max: number) => {
    const share = max > 0 ? n / max : 0
    return (
      <span className={share >= 0.8 ? 'warn-text' : undefined} title={`${pct(share)} full`}>
        {count(n)} / {count(max)}
      </span>
    )
  }
  return (
    <section data-testid="lanes" aria-labelledby="lanes-title">
      <h2 id="lanes-title">Lanes</h2>
      <p className="small" data-testid="lanes-summary">
        Interactive requests waiting for capacity: <strong>{count(lanes.interactive_admission)}</strong> of at most {count(lanes.interactive_admission_max)}.
        Streams waiting to retry before their first token: <strong>{count(streams)}</strong>.
      </p>
      {lanes.routes.length === 0 ? (
        <p className="muted" data-testid="lanes-empty">Nothing is queued or held on any route.</p>
      ) : (
        <table className="grid" data-testid="lanes-routes">
          <caption className="muted small">Per route, now. Owner review and dead letter wait for a person: follow the count to the inbox.</caption>
          <thead>
            <tr>
              <th>Route</th>
              <th className="num" title="Interactive requests waiting for channel capacity">Interactive admission</th>
              <th className="num" title="Streams waiting to retry before their first token (gateway-wide; shown on the first route)">Stream recovery</th>
              <th className="num" title="Background jobs queued or running; in brackets, running now">Background retry (running)</th>
              <th className="num" title="Jobs held for an owner's decision (quota, spend, permission, data boundary, unknown contract or signal)">Owner review</th>
              <th className="num" title="Jobs that gave up: out of attempts, too old, partial output sent, outcome unknown">Dead letter</th>
            </tr>
          </thead>
          <tbody>
            {lanes.routes.map((r) => (
              <tr key={r.route} data-testid={`lanes-${r.route}`}>
                <td>{r.route}</td>
                <td className="num">{count(r.interactive_admission)}</td>
                <td className="num">{count(r.stream_recovery)}</td>
                <td className="num">{count(r.background_retry)} ({count(r.running)})</td>
                <td className="num">
                  <a {...linkProps({ view: 'reviews', id: null })} className={r.owner_review > 0 ? 'warn-text' : undefined}
                    aria-label={`${count(r.owner_review)} awaiting owner review on ${r.route}: open the inbox`} data-testid="lane-owner-review">{count(r.owner_review)}</a>
                </td>
                <td className="num">
                  <a {...linkProps({ view: 'deadletters', id: null })} className={r.dead_letter > 0 ? 'error' : undefined}
                    aria-label={`${count(r.dead_letter)} dead letters on ${r.route}: open the inbox`} data-testid="lane-dead-letter">{count(r.dead_letter)}</a>
                </td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
      {lanes.workflows.length > 0 && (
        <table className="grid lanes-workflows" data-testid="lanes-workflows">
          <caption className="muted small">Per workflow: each lane's length against its maximum (a full lane refuses new jobs with 429)</caption>
          <thead>
            <tr>
              <th>Workflow</th><th>Version</th><th className="num">Background retry</th><th className="num">Owner review</th>
              <th className="num">Dead letter</th><th className="num" title="Runs at once per concurrency key">Max concurrency</th>
              <th className="num" title="A job older than this goes to the dead letter">Max queue age</th>
            </tr>
          </thead>
          <tbody>
            {lanes.workflows.map((w) => (
              <tr key={w.workflow} data-testid={`lanes-workflow-${w.workflow}`}>
                <td><a {...linkProps({ view: 'policies', workflow: w.workflow })}>{w.workflow}</a></td>
                <td className="mono small">{w.version}</td>
                <td className="num">{fill(w.background_retry, w.background_retry_max)}</td>
                <td className="num">{fill(w.owner_review, w.owner_review_max)}</td>
                <td className="num">{fill(w.dead_letter, w.dead_letter_max)}</td>
                <td className="num">{count(w.max_concurrency)}</td>
                <td className="num">{duration(w.max_queue_age_ms)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </section>
  )
}

function BreakerLink({ route, control }: { route: string; control: RouteControlView[] }) {
  const v = control.find((c) => c.route === route)
  if (!v) return <span className="muted">—</span>
  return (
    <a {...linkProps({ view: 'breakers', route })} data-testid="route-breaker">
      <span className={breakerPill(v.breaker.state)}>{v.breaker.state}</span>
    </a>
  )
}

function Tile({ label, value, hint, testid }: { label: string; value: string; hint: string; testid: string }) {
  return (
    <div className="tile" title={hint}>
      <div className="tile-label">{label}</div>
      <div className="tile-value" data-testid={testid}>{value}</div>
    </div>
  )
}

/** N1, I6: what the ledger itself says: outcomes nobody knows, keys that ran twice (must
 * be 0), and its size, with a prune that goes on the audit log. */
function LedgerPanel({ conn, f }: { conn: Connection; f: LedgerFigures | null }) {
  const [asking, setAsking] = useState(false)
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const [days, setDays] = useState('')
  if (!f) {
    return <p className="muted small" data-testid="ledger-figures-missing">The ledger’s figures (unknown outcomes, duplicates, size) are not available yet; they are read every 10 s.</p>
  }
  const prune = act(async () => {
    const r: PruneReport = await pruneLedger(conn, { actor, reason, older_than_days: days ? Number(days) : null })
    setAsking(false)
    setReason('')
    return { ok: true, text: `Removed ${count(r.payloads)} expired response copies, ${count(r.requests)} requests and ${count(r.attempts)} attempts. The file keeps its size and reuses the space; \`spillway ledger prune\` on a stopped gateway gives it back.` }
  })
  const perRoute = [...f.unknown_by_route.map((c) => ({ ...c, kind: 'unknown' })), ...f.duplicates_by_route.map((c) => ({ ...c, kind: 'duplicate' }))]
  return (
    <div className="ledger-panel" data-testid="ledger-panel">
      <div className="tiles">
        <a className={f.unknown ? 'tile warn' : 'tile'} {...linkProps({ view: 'unknowns', id: null })} title="Requests whose provider call was cut by a stop: never resent until an owner reconciles them">
          <div className="tile-label">Unknown outcomes</div>
          <div className="tile-value" data-testid="tile-unknown">{count(f.unknown)}</div>
        </a>
        <div className={f.duplicates ? 'tile bad' : 'tile'} title="Idempotency-Keys that reached the provider and completed more than once, within the key window. Must be 0.">
          <div className="tile-label">Duplicates</div>
          <div className="tile-value" data-testid="tile-duplicates">{count(f.duplicates)}</div>
        </div>
        <div className="tile" title={`Database and write-ahead log on disk; of which ${bytes(f.payload_bytes)} in ${count(f.payloads)} kept body copies (replays, prompts when configured)`}>
          <div className="tile-label">Ledger size</div>
          <div className="tile-value" data-testid="tile-ledger-size">{bytes(f.bytes)}</div>
          {!asking && <button className="link small" onClick={() => setAsking(true)} data-testid="prune">Prune…</button>}
        </div>
      </div>
      {perRoute.length > 0 && (
        <table className="grid" data-testid="ledger-per-route">
          <caption className="muted small">Unknown outcomes and duplicates per route</caption>
          <thead><tr><th>Route</th><th>What</th><th className="num">Count</th></tr></thead>
          <tbody>{perRoute.map((c) => <tr key={`${c.kind}-${c.route}`}><td>{c.route}</td><td>{c.kind}</td><td className="num">{count(c.count)}</td></tr>)}</tbody>
        </table>
      )}
      {asking && (
        <form onSubmit={prune} className="inline-form" data-testid="prune-form">
          <span className="small">Removes expired response copies and, if you give a number of days, finished requests older than that. Unknown and running requests are always kept.</span>
          <input aria-label="Finished requests older than (days, optional)" placeholder="older than (days, optional)" type="number" min={1} value={days} onChange={(e) => setDays(e.target.value)} />
          <input aria-label="Your name" placeholder="Your name" value={actor} onChange={(e) => setActor(e.target.value)} required maxLength={64} />
          <input aria-label="Reason" placeholder="Reason (goes on the audit log)" value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500} />
          <button type="submit" disabled={busy || !actor.trim() || !reason.trim()} className="danger">Prune</button>
          <button type="button" onClick={() => setAsking(false)}>Cancel</button>
        </form>
      )}
      {msg && <p role={msg.ok ? 'status' : 'alert'} className={msg.ok ? 'ok-text small' : 'error small'}>{msg.text}</p>}
    </div>
  )
}
