// Guided recovery (O1–O5) and drills (N3): one route taken through a checklist, from the
// moment an operator takes it over to its close. Each step says what makes it done, who did
// it and when; only the current step can be acted on, every action carries a name and goes
// on the record, and the run's incident record, stage scorecards and moves are shown as the
// report will have them. A drill runs the same checklist against the simulator, never a
// real provider, and says so wherever it shows.
import { useQuery, useQueryClient } from '@tanstack/react-query'
import { useEffect, useState, type ReactNode } from 'react'
import {
  ApiError, approveRecovery, cancelRecovery, closeRecovery, explainOverrun, getRecoveries, getRecovery, getRecoveryFile,
  isolateRecovery, preserveRecovery, relapseRecovery, rollbackRecovery, runRecoveryProbes, startRecovery,
  type Connection, type RecoveryFile,
} from './api'
import type { ApprovalRole } from './bindings/ApprovalRole'
import type { DrillScenario } from './bindings/DrillScenario'
import type { Overrun } from './bindings/Overrun'
import type { ProbeView } from './bindings/ProbeView'
import type { RecentWindow } from './bindings/RecentWindow'
import type { RecoveryList } from './bindings/RecoveryList'
import type { RecoveryStep } from './bindings/RecoveryStep'
import type { RecoverySummary } from './bindings/RecoverySummary'
import type { RecoveryView } from './bindings/RecoveryView'
import type { StageScore } from './bindings/StageScore'
import type { StepView } from './bindings/StepView'
import { age, bytes, count, duration, money, ms, time } from './format'
import { linkProps, navigate } from './router'
import { SCORE_HEADERS, ScoreCells } from './Scorecard'
import { useOperatorAction, type Outcome } from './actor'

/** An open run is read this often: its stage timer and the O2 figures move by the second. */
const POLL_MS = 2_000

export const STEP_WORDS: Record<RecoveryStep, string> = {
  isolate: 'Isolate',
  preserve: 'Preserve evidence',
  roll_back: 'Roll back',
  confirm: 'Confirm with probes',
  resume: 'Resume in stages',
  drain: 'Drain',
  close: 'Close',
  closed: 'Closed',
  cancelled: 'Cancelled',
}

/** The checklist's order, for telling a move back (a step-back) from a move on. */
const ORDER: RecoveryStep[] = ['isolate', 'preserve', 'roll_back', 'confirm', 'resume', 'drain', 'close', 'closed']

export const SCENARIO_WORDS: Record<DrillScenario, string> = {
  rate_limit_storm: 'rate-limit storm (429s)',
  server_errors: 'server errors (5xx)',
  slow_provider: 'slow provider',
  quota_exhausted: 'quota exhausted',
  drops_after_completion: 'connection drops after completion (the provider did the work, the answer is lost)',
}

const ROLE_WORDS: Record<ApprovalRole, string> = {
  platform_operations: 'platform operations',
  business_owner: 'business owner',
}
const ROLES: ApprovalRole[] = ['platform_operations', 'business_owner']

const STATUS_WORDS: Record<StepView['status'], { words: string; pill: string }> = {
  done: { words: 'done', pill: 'pill ok' },
  current: { words: 'now', pill: 'pill warn' },
  pending: { words: 'to do', pill: 'pill' },
}

/** A step's status in words; one the console does not know yet reads as to do. */
function statusOf(s: StepView): { words: string; pill: string } {
  return STATUS_WORDS[s.status] ?? STATUS_WORDS.pending
}

/** O2: what moves a resuming run back one stage, as the figures are shown against it. */
const STEP_BACK = { serverErrors: 5, window: 20, rateLimitedMs: 120_000, duplicates: 1 }

/** O5: the probes' latency limit, as a multiple of the route's normal P95. */
const PROBE_SLACK = 1.5

function ended(step: RecoveryStep): boolean {
  return step === 'closed' || step === 'cancelled'
}

function stepPill(step: RecoveryStep): string {
  if (step === 'closed') return 'pill ok'
  if (step === 'cancelled') return 'pill'
  return 'pill warn'
}

/** Open runs first, then the newest. */
function sortRuns(runs: RecoverySummary[]): RecoverySummary[] {
  return [...runs].sort((a, b) => Number(ended(a.step)) - Number(ended(b.step)) || b.opened_at - a.opened_at)
}

/** Nearest-rank P95 of a probe round (with 5 probes: the slowest). */
export function probeP95(probes: ProbeView[]): number | null {
  if (probes.length === 0) return null
  const sorted = probes.map((p) => p.latency_ms).sort((a, b) => a - b)
  return sorted[Math.max(0, Math.ceil(sorted.length * 0.95) - 1)]
}

/** The O4 condition the operator meets in the close form itself (the gateway lists it until then). */
function isContactItem(m: string): boolean {
  return /contact/i.test(m)
}

/** The clock, every `everyMs`: a stage's time left moves even when the run's figures do not. */
function useNow(everyMs: number): number {
  const [now, setNow] = useState(() => Date.now())
  useEffect(() => {
    const t = setInterval(() => setNow(Date.now()), everyMs)
    return () => clearInterval(t)
  }, [everyMs])
  return now
}

export function RecoveriesView({ conn, selected }: { conn: Connection; selected: string | null }) {
  const [startRoute, setStartRoute] = useState('')
  const list = useQuery({
    queryKey: ['recoveries', conn.url],
    queryFn: () => getRecoveries(conn),
    refetchInterval: 5_000,
  })
  const runs = sortRuns(list.data?.runs ?? [])
  return (
    <section>
      <h2>Guided recovery</h2>
      <p className="muted">
        Take a failing route through a checklist: isolate it, preserve the evidence, roll back what changed, confirm with
        probes, resume in stages (stepping back by itself if the failures return), drain what was held, and close with the
        customer told. Every step records who did it and when. A drill practises the same on simulated channels only.
      </p>
      {list.error && <p role="alert" className="error">{(list.error as Error).message}</p>}
      {list.data && (
        <Suggestions list={list.data} onStart={(route) => {
          setStartRoute(route)
          document.getElementById('recovery-start-reason')?.focus()
        }} />
      )}
      {!list.data ? (
        !list.error && <p className="muted" aria-busy>Loading the recovery runs…</p>
      ) : (
        <div className="split-2">
          <div className="results"><RunsTable runs={runs} selected={selected} /></div>
          <StartForm conn={conn} list={list.data} route={startRoute} setRoute={setStartRoute} />
        </div>
      )}
      {selected && <RunDetail key={selected} conn={conn} id={selected} probeKeys={list.data?.probe_keys ?? null} />}
    </section>
  )
}

function Suggestions({ list, onStart }: { list: RecoveryList; onStart: (route: string) => void }) {
  if (list.suggestions.length === 0) return null
  const now = Date.now()
  return (
    <div className="banner" data-testid="recovery-suggestions" aria-labelledby="recovery-suggestions-title">
      <strong id="recovery-suggestions-title">A recovery is suggested</strong>
      <ul className="small">
        {list.suggestions.map((s) => (
          <li key={s.route} data-testid={`recovery-suggestion-${s.route}`}>
            {s.breaker_opened_at !== null
              ? <>Breaker open on <strong>{s.route}</strong> since {time(s.breaker_opened_at)} ({age(s.breaker_opened_at, now)} ago)</>
              : <strong>{s.route}</strong>}
            {s.reason ? `: ${s.reason}` : ''}.{' '}
            <button type="button" className="link" onClick={() => onStart(s.route)} data-testid={`recovery-suggestion-start-${s.route}`}>
              Start a recovery
            </button>
          </li>
        ))}
      </ul>
    </div>
  )
}

function RunsTable({ runs, selected }: { runs: RecoverySummary[]; selected: string | null }) {
  if (runs.length === 0) {
    return (
      <p className="muted" data-testid="recovery-runs-empty">
        No recovery run yet. Start one when a route’s breaker opens, or practise with a drill on a simulated route.
      </p>
    )
  }
  return (
    <table className="grid selectable" data-testid="recovery-runs">
      <thead>
        <tr><th>Run</th><th>Route</th><th>Kind</th><th>Step</th><th className="num">Stage</th><th>Held</th><th>Opened</th><th>Closed</th></tr>
      </thead>
      <tbody>
        {runs.map((r) => (
          <tr key={r.id} aria-selected={r.id === selected} data-testid={`recovery-run-${r.id}`} data-step={r.step}
            onClick={() => navigate({ view: 'recovery', id: r.id })}>
            <td className="mono small"><a {...linkProps({ view: 'recovery', id: r.id })}>{r.id}</a></td>
            <td>{r.route}</td>
            <td>{r.drill ? <span className="pill drill" data-testid="recovery-run-drill" title={SCENARIO_WORDS[r.drill]}>DRILL</span> : 'incident'}</td>
            <td><span className={stepPill(r.step)}>{STEP_WORDS[r.step]}</span></td>
            <td className="num">{r.stage_pct === null ? '—' : `${r.stage_pct} %`}</td>
            <td>{r.held ? <span className="pill bad">held</span> : <span className="muted small">no</span>}</td>
            <td className="small">{time(r.opened_at)} by {r.opened_by}</td>
            <td className="small">{r.closed_at === null ? '—' : time(r.closed_at)}</td>
          </tr>
        ))}
      </tbody>
    </table>
  )
}

/** The operator's name, as every recovery form asks it. */
function ActorInput({ value, onChange, testid }: { value: string; onChange: (v: string) => void; testid: string }) {
  return (
    <label>Your name
      <input value={value} onChange={(e) => onChange(e.target.value)} required maxLength={64} data-testid={testid} />
    </label>
  )
}

function FormMsg({ msg, testid }: { msg: Outcome | null; testid: string }) {
  if (!msg) return null
  return <p role={msg.ok ? 'status' : 'alert'} className={msg.ok ? 'ok-text small' : 'error small'} data-testid={testid}>{msg.text}</p>
}

function Missing({ need, testid, lead = 'Still needed' }: { need: string[]; testid: string; lead?: string }) {
  if (need.length === 0) return null
  return <p className="muted small" data-testid={testid}>{lead}: {need.join(', ')}.</p>
}

function StartForm({ conn, list, route, setRoute }: { conn: Connection; list: RecoveryList; route: string; setRoute: (r: string) => void }) {
  const qc = useQueryClient()
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const [drill, setDrill] = useState<DrillScenario | ''>('')
  const [invalid, setInvalid] = useState<string[]>([])
  const broken = list.suggestions.map((s) => s.route)
  // Routes with an open breaker first: the usual reason to start; then every route a
  // channel serves, since a route can misbehave with its breaker closed.
  const routes = [...broken, ...list.routes.filter((r) => !broken.includes(r)).sort()]
  const [key, setKey] = useState('')
  // A drill's own traffic runs as a key: asked for when there is more than one.
  const drillKey = key || (list.probe_keys.length === 1 ? list.probe_keys[0] : '')
  const openOn = new Map(list.runs.filter((r) => !ended(r.step)).map((r) => [r.route, r.id] as const))
  const drillable = (r: string) => list.drill_routes.includes(r)
  const need: string[] = []
  if (!route) need.push('route')
  if (drill && route && !drillable(route)) need.push('a route that can be drilled (see below)')
  if (route && openOn.has(route)) need.push(`a route without an open run (${route} has ${openOn.get(route)})`)
  if (drill && !drillKey) need.push('the key the drill’s traffic runs as')
  if (!reason.trim()) need.push('reason')
  if (!actor.trim()) need.push('your name')
  const submit = act(async () => {
    setInvalid([])
    try {
      const v = await startRecovery(conn, { route, actor: actor.trim(), reason: reason.trim(), ...(drill ? { drill, key: drillKey } : {}) })
      qc.setQueryData(['recovery', conn.url, v.id], v)
      qc.invalidateQueries({ queryKey: ['recoveries'] })
      setReason('')
      setRoute('')
      setDrill('')
      navigate({ view: 'recovery', id: v.id })
      return { ok: true, text: `${v.drill ? 'Drill' : 'Recovery'} ${v.id} opened on ${v.route}; isolate it next.` }
    } catch (err) {
      if (err instanceof ApiError) {
        setInvalid(err.missingFields)
        if (err.status === 409) qc.invalidateQueries({ queryKey: ['recoveries'] })
      }
      throw err
    }
  })
  const bad = (field: string) => invalid.includes(field) || undefined
  return (
    <form className="manual" onSubmit={submit} data-testid="recovery-start-form" aria-labelledby="recovery-start-title">
      <h4 id="recovery-start-title">Start a recovery</h4>
      <p className="muted small">
        Opening a run changes nothing on the route yet: its first step, isolate, is the one that pauses it. At most one run
        is open per route.
      </p>
      <label>Route
        <select value={route} onChange={(e) => setRoute(e.target.value)} required aria-invalid={bad('route')} data-testid="recovery-start-route">
          <option value="">{routes.length ? 'Choose a route' : 'No route has an open breaker or can be drilled'}</option>
          {routes.map((r) => {
            const notes = [
              broken.includes(r) && 'breaker open',
              drillable(r) && 'simulated: can be drilled',
              openOn.has(r) && `run ${openOn.get(r)} open`,
            ].filter((n): n is string => typeof n === 'string')
            return (
              <option key={r} value={r} disabled={openOn.has(r) || (drill !== '' && !drillable(r))}>
                {r}{notes.length ? ` (${notes.join(', ')})` : ''}
              </option>
            )
          })}
        </select>
      </label>
      <label>Reason
        <input id="recovery-start-reason" value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500}
          placeholder="e.g. 5xx storm from the provider, INC-42" aria-invalid={bad('reason')} data-testid="recovery-start-reason" />
      </label>
      <label>Drill (optional)
        <select value={drill} onChange={(e) => setDrill(e.target.value as DrillScenario | '')} aria-invalid={bad('drill')} data-testid="recovery-start-drill">
          <option value="">No: a real recovery</option>
          {list.scenarios.map((s) => <option key={s} value={s}>Drill: {SCENARIO_WORDS[s]}</option>)}
        </select>
      </label>
      {drill && list.probe_keys.length > 1 && (
        <label>The drill’s traffic runs as (and is billed to)
          <select value={key} onChange={(e) => setKey(e.target.value)} data-testid="recovery-start-key">
            <option value="">Choose a key</option>
            {list.probe_keys.map((k) => <option key={k} value={k}>{k}</option>)}
          </select>
        </label>
      )}
      <p className="small" data-testid="recovery-drill-routes">
        Only a route whose every channel is simulated (<code>sim://</code>) can be drilled, so a drill never reaches a real
        provider:{' '}
        {list.drill_routes.length ? list.drill_routes.join(', ') : 'none here, every route has a real provider'}.
        {drill && ` The simulator stages ${SCENARIO_WORDS[drill]} on the route’s channels for a few minutes, then recovers by itself.`}
      </p>
      <ActorInput value={actor} onChange={setActor} testid="recovery-start-actor" />
      <Missing need={need} testid="recovery-start-missing" />
      <button type="submit" disabled={busy || need.length > 0} data-testid="recovery-start">
        {drill ? `Start a drill${route ? ` on ${route}` : ''}` : `Start a recovery${route ? ` on ${route}` : ''}`}
      </button>
      <FormMsg msg={msg} testid="recovery-start-error" />
    </form>
  )
}

/** Sends an action on run `id`, shows its answer at once, and on a refusal reads the run
 * again (another operator, or the gateway, may have moved it on). */
function useRunAction(conn: Connection, id: string, onDone: (text: string) => void) {
  const qc = useQueryClient()
  return async (send: () => Promise<RecoveryView>, said: (v: RecoveryView) => string): Promise<Outcome | null> => {
    try {
      const v = await send()
      qc.setQueryData(['recovery', conn.url, id], v)
      qc.invalidateQueries({ queryKey: ['recoveries'] })
      onDone(said(v))
      return null
    } catch (err) {
      if (err instanceof ApiError && err.status === 409) qc.invalidateQueries({ queryKey: ['recovery', conn.url, id] })
      throw err
    }
  }
}

type PanelProps = { conn: Connection; v: RecoveryView; onDone: (text: string) => void }

/** The selected run, read by its id every 2 s while it is open (a link from an alert lands here too). */
function RunDetail({ conn, id, probeKeys }: { conn: Connection; id: string; probeKeys: string[] | null }) {
  const [done, setDone] = useState<string | null>(null)
  const one = useQuery({
    queryKey: ['recovery', conn.url, id],
    queryFn: () => getRecovery(conn, id),
    retry: false,
    refetchInterval: (q) => (q.state.data && ended(q.state.data.step) ? false : POLL_MS),
  })
  if (!one.data) {
    if (one.error) {
      const gone = one.error instanceof ApiError && one.error.status === 404
      return <p role={gone ? undefined : 'alert'} className={gone ? 'muted' : 'error'} data-testid="recovery-gone">{(one.error as Error).message}</p>
    }
    return <p className="muted" aria-busy>Loading run {id}…</p>
  }
  const v = one.data
  const open = !ended(v.step)
  const props: PanelProps = { conn, v, onDone: setDone }
  return (
    <article className="route-detail" data-testid="recovery-detail" data-step={v.step} data-drill={v.drill ? 'true' : 'false'}>
      <header>
        <h3>Recovery <span className="mono">{v.id}</span> on {v.route}</h3>
        {v.drill && <span className="pill drill" data-testid="recovery-drill">DRILL · {SCENARIO_WORDS[v.drill]}</span>}
        <span className={stepPill(v.step)} data-testid="recovery-step">{STEP_WORDS[v.step]}</span>
        {v.held && <span className="pill bad" data-testid="recovery-held">held: two approvals needed</span>}
        <a {...linkProps({ view: 'scorecard', run: v.id, route: null })} data-testid="recovery-scorecard-link">Scorecard</a>
        <a {...linkProps({ view: 'recovery', id: null })}>Back to the list</a>
      </header>
      {v.drill && (
        <p className="banner warn" data-testid="recovery-drill-banner">
          <strong>DRILL</strong>: the simulator stages {SCENARIO_WORDS[v.drill]} on this route’s simulated channels. No real
          provider or customer is involved; the report, the audit entries and the scorecard are marked as a drill.
        </p>
      )}
      <p className="small">Opened {time(v.opened_at)} by {v.opened_by}: {v.reason}</p>
      <Gate v={v} />
      {done && (
        <p role="status" className="ok-text" data-testid="recovery-result">
          {done} <a {...linkProps({ view: 'audit' })}>See it on the audit log.</a>
        </p>
      )}
      {one.error && <p role="alert" className="error small">Could not read the run again: {(one.error as Error).message}</p>}
      <h4>Checklist</h4>
      <Checklist steps={v.steps} />
      {v.held && open && <Approvals {...props} />}
      {open && (
        <section className="current-step" data-testid="recovery-current" aria-label={`Current step: ${STEP_WORDS[v.step]}`}>
          <CurrentStep key={v.step} {...props} probeKeys={probeKeys} />
        </section>
      )}
      {!open && <Ended v={v} />}
      {v.overruns.length > 0 && <Overruns {...props} />}
      {v.probes.length > 0 && <ProbeRound v={v} />}
      <Files conn={conn} v={v} />
      {v.stage_scores.length > 0 && <StageScores scores={v.stage_scores} />}
      <Incident v={v} />
      <Events v={v} />
      {open && <CancelForm {...props} />}
    </article>
  )
}

/** What the gate lets through on the route now. */
function Gate({ v }: { v: RecoveryView }) {
  let words: string
  if (ended(v.step)) words = 'lifted: the route runs normally.'
  else if (v.step === 'isolate') words = 'not yet applied: traffic and retries flow as usual until the route is isolated.'
  else if (v.concurrency_pct === 0) words = 'the route is paused: interactive requests are refused with 503 recovery_hold and its jobs are held.'
  else {
    words = `${v.concurrency_pct} % of the route’s concurrency${v.concurrency_cap !== null ? ` (at most ${count(v.concurrency_cap)} of ${count(v.route_concurrency)} at once)` : ''}.`
  }
  return (
    <p data-testid="recovery-gate">
      <strong>Gate</strong>: {words} Automatic retries are <strong>{v.retries_on ? 'on' : 'off'}</strong>.
      {v.stops > 0 && ` Stopped ${v.stops} time(s) so far.`}
    </p>
  )
}

function who(s: StepView): string | null {
  if (s.status !== 'done') return null
  const by = s.done_by ?? 'the gateway'
  return s.done_at ? `by ${by} at ${time(s.done_at)}` : `by ${by}`
}

function Checklist({ steps }: { steps: StepView[] }) {
  return (
    <ol className="checklist" data-testid="recovery-checklist">
      {steps.map((s, i) => (
        <li key={s.step} data-testid={`recovery-step-${s.step}`} data-status={s.status} aria-current={s.status === 'current' ? 'step' : undefined}>
          <span className={`step-mark ${s.status}`} aria-hidden="true">{s.status === 'done' ? '✓' : i + 1}</span>
          <div>
            <strong>{STEP_WORDS[s.step]}</strong>{' '}
            <span className={statusOf(s).pill} data-testid="recovery-step-status">{statusOf(s).words}</span>
            <div className="small">{s.check}</div>
            {s.evidence && <div className="small muted" data-testid="recovery-step-evidence">{s.evidence}</div>}
            {who(s) && <div className="small" data-testid="recovery-step-who">{who(s)}</div>}
          </div>
        </li>
      ))}
    </ol>
  )
}

function CurrentStep(props: PanelProps & { probeKeys: string[] | null }) {
  switch (props.v.step) {
    case 'isolate':
      return <IsolateForm {...props} />
    case 'preserve':
      return <PreserveForm {...props} />
    case 'roll_back':
      return <RollbackForm {...props} />
    case 'confirm':
      return <ProbesForm {...props} />
    case 'resume':
      return <ResumePanel {...props} />
    case 'drain':
      return <DrainPanel v={props.v} />
    case 'close':
      return <CloseForm {...props} />
    case 'closed':
    case 'cancelled':
      return null
  }
}

function IsolateForm({ conn, v, onDone }: PanelProps) {
  const { actor, setActor, busy, msg, act } = useOperatorAction()
  const run = useRunAction(conn, v.id, onDone)
  const submit = act(() => run(
    () => isolateRecovery(conn, v.id, { actor: actor.trim() }),
    (r) => `Isolated ${r.route}: retries off, the route paused${r.split ? `; since ${time(r.split.since)}: ${count(r.split.succeeded)} succeeded, ${count(r.split.failed)} failed, ${count(r.split.unknown)} unknown` : ''}.`,
  ))
  return (
    <form className="manual recovery-form" onSubmit={submit} data-testid="recovery-isolate-form" aria-labelledby="recovery-isolate-title">
      <h4 id="recovery-isolate-title">Isolate {v.route}</h4>
      <p className="small">
        Turns automatic retries off for the route and pauses its queue: interactive requests are refused with 503{' '}
        <code>recovery_hold</code> and its background jobs are held. The route’s requests since the incident began are split
        into succeeded, failed and unknown, for the record.
      </p>
      <ActorInput value={actor} onChange={setActor} testid="recovery-isolate-actor" />
      <button type="submit" className="danger" disabled={busy || !actor.trim()} data-testid="recovery-isolate">Isolate {v.route}</button>
      <FormMsg msg={msg} testid="recovery-isolate-error" />
    </form>
  )
}

function Split({ v }: { v: RecoveryView }) {
  if (!v.split) return null
  const s = v.split
  return (
    <p className="small" data-testid="recovery-split">
      Since {time(s.since)}: <strong>{count(s.succeeded)}</strong> succeeded, <strong>{count(s.failed)}</strong> failed,{' '}
      <strong className={s.unknown > 0 ? 'error' : undefined}>{count(s.unknown)}</strong> with an unknown outcome.
    </p>
  )
}

function PreserveForm({ conn, v, onDone }: PanelProps) {
  const { actor, setActor, busy, msg, act } = useOperatorAction()
  const run = useRunAction(conn, v.id, onDone)
  const submit = act(() => run(
    () => preserveRecovery(conn, v.id, { actor: actor.trim() }),
    (r) => `Evidence preserved${r.evidence ? `: ${count(r.evidence.requests)} request(s), ${bytes(r.evidence.bytes)}` : ''}; download it below.`,
  ))
  return (
    <form className="manual recovery-form" onSubmit={submit} data-testid="recovery-preserve-form" aria-labelledby="recovery-preserve-title">
      <h4 id="recovery-preserve-title">Preserve the evidence</h4>
      <Split v={v} />
      <p className="small">
        Builds the evidence bundle: request ids, client and provider request ids, errors, times, tokens and result ids. No
        secret and no prompt goes in it. It can be downloaded once built.
      </p>
      <ActorInput value={actor} onChange={setActor} testid="recovery-preserve-actor" />
      <button type="submit" disabled={busy || !actor.trim()} data-testid="recovery-preserve">Build the evidence bundle</button>
      <FormMsg msg={msg} testid="recovery-preserve-error" />
    </form>
  )
}

function RollbackForm({ conn, v, onDone }: PanelProps) {
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const run = useRunAction(conn, v.id, onDone)
  const need: string[] = []
  if (!reason.trim()) need.push('reason')
  if (!actor.trim()) need.push('your name')
  const back = (workflow: string, version: string) => act(() => run(
    () => rollbackRecovery(conn, v.id, { actor: actor.trim(), reason: reason.trim(), workflow, version }),
    () => `Workflow ${workflow} rolled back to version ${version}, written to its file and applied.`,
  ))
  const nothing = act(() => run(
    () => rollbackRecovery(conn, v.id, { actor: actor.trim(), reason: reason.trim() }),
    () => 'Recorded that there was nothing to roll back, with your reason.',
  ))
  const candidates = v.rollback_candidates
  return (
    <form className="manual" onSubmit={(e) => e.preventDefault()} data-testid="recovery-rollback-form" aria-labelledby="recovery-rollback-title">
      <h4 id="recovery-rollback-title">Roll back</h4>
      <p className="small">
        Workflow policies used on {v.route} whose version changed since its last known good (the version in force at the
        route’s last success before the incident). Roll one back, or record why there is nothing to roll back.
      </p>
      {candidates.length === 0 ? (
        <p data-testid="recovery-rollback-nothing">
          Nothing to roll back: no workflow policy used on {v.route} changed since its last known good version. Say so
          below, with a reason.
        </p>
      ) : (
        <table className="grid" data-testid="recovery-rollback-candidates">
          <thead><tr><th>Workflow</th><th>Version now</th><th>Last known good</th><th>Action</th></tr></thead>
          <tbody>
            {candidates.map((c) => (
              <tr key={c.workflow} data-testid={`recovery-rollback-candidate-${c.workflow}`}>
                <td><a {...linkProps({ view: 'policies', workflow: c.workflow })}>{c.workflow}</a></td>
                <td className="mono small">{c.current_version}</td>
                <td className="mono small">{c.last_good_version}</td>
                <td>
                  <button type="button" className="danger" disabled={busy || need.length > 0}
                    onClick={back(c.workflow, c.last_good_version)} data-testid={`recovery-rollback-${c.workflow}`}>
                    Roll back to {c.last_good_version}
                  </button>
                </td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
      <div className="recovery-form manual-fields">
        <label>Reason
          <input value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500}
            placeholder={candidates.length ? 'e.g. version b7 doubled the retries' : 'e.g. no policy changed; the provider failed'}
            data-testid="recovery-rollback-reason" />
        </label>
        <ActorInput value={actor} onChange={setActor} testid="recovery-rollback-actor" />
        <Missing need={need} testid="recovery-rollback-missing" />
        <div className="row-actions">
          <button type="button" disabled={busy || need.length > 0} onClick={nothing} data-testid="recovery-rollback-none">
            Nothing to roll back
          </button>
        </div>
      </div>
      <FormMsg msg={msg} testid="recovery-rollback-error" />
    </form>
  )
}

function ProbesForm({ conn, v, onDone, probeKeys }: PanelProps & { probeKeys: string[] | null }) {
  const { actor, setActor, busy, msg, act } = useOperatorAction()
  const [key, setKey] = useState('')
  const run = useRunAction(conn, v.id, onDone)
  const keys = probeKeys ?? []
  const chosen = keys.includes(key) ? key : (keys[0] ?? '')
  const need: string[] = []
  if (!chosen) need.push('a probe key')
  if (!actor.trim()) need.push('your name')
  const submit = act(() => run(
    () => runRecoveryProbes(conn, v.id, { actor: actor.trim(), key: chosen }),
    (r) => {
      const ok = r.probes.filter((p) => p.ok).length
      return r.step === 'confirm'
        ? `Probe round ${r.probe_rounds}: ${ok} of ${r.probes.length} succeeded; the route is not confirmed yet (see the round below).`
        : `Probe round ${r.probe_rounds} passed: ${ok} of ${r.probes.length} succeeded.`
    },
  ))
  const limit = v.normal_p95_ms === null ? null : v.normal_p95_ms * PROBE_SLACK
  return (
    <form className="manual recovery-form" onSubmit={submit} data-testid="recovery-probes-form" aria-labelledby="recovery-probes-title">
      <h4 id="recovery-probes-title">Confirm with probes</h4>
      <p className="small">
        Sends 5 side-effect-free probes to {v.route}, one at a time: a one-token request with an <code>Idempotency-Key</code>,
        as the key chosen below. The route is confirmed when all 5 succeed, their P95 is at most {PROBE_SLACK} × its normal P95
        ({ms(v.normal_p95_ms)}{limit !== null ? `, so ${ms(limit)}` : ''}) and none ran twice. A failed round can be run again.
      </p>
      {v.held && <p className="warn-text small">Held: a passing round will not start resuming until both approvals are in.</p>}
      <label>Probe as key
        <select value={chosen} onChange={(e) => setKey(e.target.value)} disabled={keys.length === 0} data-testid="recovery-probe-key">
          {keys.length === 0 && <option value="">{probeKeys === null ? 'Loading the keys…' : 'No probe key is configured'}</option>}
          {keys.map((k) => <option key={k} value={k}>{k}</option>)}
        </select>
      </label>
      <ActorInput value={actor} onChange={setActor} testid="recovery-probes-actor" />
      <Missing need={need} testid="recovery-probes-missing" />
      <button type="submit" disabled={busy || need.length > 0} data-testid="recovery-probes">
        {busy ? 'Probing…' : v.probe_rounds > 0 ? 'Run another round of 5 probes' : 'Run 5 probes'}
      </button>
      <FormMsg msg={msg} testid="recovery-probes-error" />
    </form>
  )
}

/** The latest probe round, against the three conditions it must meet. */
function ProbeRound({ v }: { v: RecoveryView }) {
  const probes = v.probes
  const ok = probes.filter((p) => p.ok).length
  const dups = probes.filter((p) => p.duplicate).length
  const p95 = probeP95(probes)
  const limit = v.normal_p95_ms === null ? null : v.normal_p95_ms * PROBE_SLACK
  const fast = p95 !== null && (limit === null || p95 <= limit)
  return (
    <>
      <h4>Probe round {v.probe_rounds}</h4>
      <p className="small" data-testid="recovery-probe-summary">
        <span className={ok === probes.length ? 'ok-text' : 'error'}>{ok} of {probes.length} succeeded</span> ·{' '}
        <span className={fast ? 'ok-text' : 'error'}>P95 {ms(p95)}</span> against a normal P95 of {ms(v.normal_p95_ms)}
        {limit !== null ? ` (limit ${ms(limit)})` : ' (no normal figure yet)'} ·{' '}
        <span className={dups === 0 ? 'ok-text' : 'error'}>{dups} duplicate(s)</span>
      </p>
      <table className="grid" data-testid="recovery-probes-table">
        <thead><tr><th className="num">#</th><th>Result</th><th className="num">HTTP</th><th className="num">Latency</th><th>Request</th><th>Error</th><th>Ran twice</th></tr></thead>
        <tbody>
          {probes.map((p) => (
            <tr key={p.n} data-testid={`recovery-probe-${p.n}`}>
              <td className="num">{p.n}</td>
              <td><span className={p.ok ? 'pill ok' : 'pill bad'}>{p.ok ? 'ok' : 'failed'}</span></td>
              <td className="num">{p.status ?? '—'}</td>
              <td className={limit !== null && p.latency_ms > limit ? 'num error' : 'num'}>{ms(p.latency_ms)}</td>
              <td className="mono small">{p.request_id ? <a {...linkProps({ view: 'ledger', id: p.request_id })}>{p.request_id}</a> : '—'}</td>
              <td className="small wrap">{p.error ?? '—'}</td>
              <td>{p.duplicate ? <span className="pill bad">duplicate</span> : 'no'}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </>
  )
}

/** O2's figures now, each against the threshold that steps the run back. */
function RecentFigures({ r }: { r: RecentWindow }) {
  const rows: { id: string; name: string; now: string; limit: string; bad: boolean; warn: boolean }[] = [
    {
      id: '5xx', name: '5xx or connection failures',
      now: `${count(r.server_errors)} of the last ${count(r.outcomes)} outcome(s)`,
      limit: `${STEP_BACK.serverErrors} of the last ${STEP_BACK.window}`,
      bad: r.server_errors >= STEP_BACK.serverErrors, warn: r.server_errors > 0,
    },
    {
      id: '429', name: '429s without a success between',
      now: r.rate_limited_for_ms === null ? 'none' : `for ${duration(r.rate_limited_for_ms)}`,
      limit: `for ${duration(STEP_BACK.rateLimitedMs)}`,
      bad: r.rate_limited_for_ms !== null && r.rate_limited_for_ms >= STEP_BACK.rateLimitedMs, warn: r.rate_limited_for_ms !== null,
    },
    {
      id: 'duplicates', name: 'Duplicates this stage',
      now: count(r.duplicates),
      limit: `${STEP_BACK.duplicates} (an idempotency key completed twice)`,
      bad: r.duplicates >= STEP_BACK.duplicates, warn: false,
    },
    {
      id: 'cost', name: 'Projected cost today',
      now: money(r.projected_day_usd),
      limit: r.daily_budget_usd === null ? 'no daily budget: cost never steps back' : `above the daily budget of ${money(r.daily_budget_usd)}`,
      bad: r.projected_day_usd !== null && r.daily_budget_usd !== null && r.projected_day_usd > r.daily_budget_usd,
      warn: r.projected_day_usd !== null && r.daily_budget_usd !== null && r.projected_day_usd > r.daily_budget_usd * 0.8,
    },
  ]
  return (
    <table className="grid" data-testid="recovery-recent">
      <caption className="muted small">Automatic step-back (O2): any figure at its threshold moves the run back one stage at once</caption>
      <thead><tr><th>Figure</th><th className="num">Now</th><th>Steps back at</th></tr></thead>
      <tbody>
        {rows.map((x) => (
          <tr key={x.id} data-testid={`recovery-recent-${x.id}`} data-over={x.bad ? 'true' : 'false'}>
            <th scope="row">{x.name}</th>
            <td className={x.bad ? 'num error' : x.warn ? 'num warn-text' : 'num'}>{x.now}</td>
            <td className="small muted">{x.limit}</td>
          </tr>
        ))}
      </tbody>
    </table>
  )
}

function ResumePanel({ conn, v, onDone }: PanelProps) {
  const now = useNow(1_000)
  const i = v.stage
  const pct = i === null ? null : v.stages[i] ?? null
  const left = v.stage_started_at === null ? null : Math.max(0, v.stage_started_at + v.stage_ms - now)
  return (
    <div className="manual" data-testid="recovery-stage" data-stage-pct={pct ?? ''}>
      <h4>Resume in stages</h4>
      <ol className="stages" aria-label="Stages">
        {v.stages.map((p, k) => (
          <li key={k} data-testid={`recovery-stage-${p}`} aria-current={k === i ? 'step' : undefined}
            className={i !== null && k < i ? 'done' : undefined}>
            {p} %{i !== null && k < i ? ' ✓' : ''}
          </li>
        ))}
      </ol>
      <p data-testid="recovery-stage-now">
        {i === null || pct === null
          ? 'Starting the first stage…'
          : <>Stage {i + 1} of {v.stages.length}: <strong>{pct} %</strong> of the route’s concurrency
            {v.concurrency_cap !== null && <>, at most <strong>{count(v.concurrency_cap)}</strong> of {count(v.route_concurrency)} at once</>}.</>}
      </p>
      <p data-testid="recovery-stage-left">
        {v.held
          ? 'Held: the stage timer is stopped until both approvals are in.'
          : left === null
            ? `Each stage runs ${duration(v.stage_ms)}.`
            : <><strong>{duration(left)}</strong> left in this stage of {duration(v.stage_ms)}; the route’s scorecard is recomputed as it ends.</>}
      </p>
      <RecentFigures r={v.recent} />
      <p className="small muted">
        A stop moves the run back one stage (from 25 % back to confirm: the route paused again, new probes needed). The
        second stop in a run holds it until one person from platform operations and another as business owner approve.
        Stops so far: {v.stops}.
      </p>
      {v.drill && <RelapseForm conn={conn} v={v} onDone={onDone} />}
    </div>
  )
}

function RelapseForm({ conn, v, onDone }: PanelProps) {
  const { actor, setActor, busy, msg, act } = useOperatorAction()
  const run = useRunAction(conn, v.id, onDone)
  const submit = act(() => run(
    () => relapseRecovery(conn, v.id, { actor: actor.trim() }),
    () => 'Relapse staged: the simulated channels answer 5xx for a short burst; watch the run step back.',
  ))
  return (
    <form className="manual recovery-form" onSubmit={submit} data-testid="recovery-relapse-form" aria-labelledby="recovery-relapse-title">
      <h4 id="recovery-relapse-title">Drill: stage a relapse</h4>
      <p className="small">
        The simulator answers 5xx on this route’s simulated channels for a short burst, to practise the automatic
        step-back. Only drills can do this.
      </p>
      <ActorInput value={actor} onChange={setActor} testid="recovery-relapse-actor" />
      <button type="submit" className="danger" disabled={busy || !actor.trim()} data-testid="recovery-relapse">Stage a relapse</button>
      <FormMsg msg={msg} testid="recovery-relapse-error" />
    </form>
  )
}

function DrainPanel({ v }: { v: RecoveryView }) {
  return (
    <div className="manual recovery-form" data-testid="recovery-drain">
      <h4>Drain</h4>
      <p className="small">
        Retries are back on and the route’s held jobs are being released in deadline order. Requests with an unknown outcome
        must be reconciled by an owner; they are replayed only after (L3). This step ends by itself when both are 0.
      </p>
      <table className="grid">
        <tbody>
          <tr data-testid="recovery-backlog">
            <th scope="row">Held jobs still to release</th>
            <td className={v.backlog > 0 ? 'num warn-text' : 'num ok-text'}>{count(v.backlog)}</td>
            <td><a {...linkProps({ view: 'deadletters', id: null })} data-testid="recovery-link-deadletters">Dead letters</a></td>
          </tr>
          <tr data-testid="recovery-unknowns">
            <th scope="row">Unknown outcomes to reconcile</th>
            <td className={v.unknowns > 0 ? 'num error' : 'num ok-text'}>{count(v.unknowns)}</td>
            <td><a {...linkProps({ view: 'unknowns', id: null })} data-testid="recovery-link-unknowns">Reconcile them</a></td>
          </tr>
        </tbody>
      </table>
    </div>
  )
}

function Approvals({ conn, v, onDone }: PanelProps) {
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const [role, setRole] = useState<ApprovalRole | ''>('')
  const run = useRunAction(conn, v.id, onDone)
  const given = new Map(v.approvals.map((a) => [a.role, a] as const))
  const missing = ROLES.filter((r) => !given.has(r))
  const chosen: ApprovalRole | '' = role !== '' && !given.has(role) ? role : (missing[0] ?? '')
  const already = v.approvals.find((a) => a.actor.trim().toLowerCase() === actor.trim().toLowerCase())
  const need: string[] = []
  if (!chosen) need.push('a role still missing')
  if (!reason.trim()) need.push('reason')
  if (!actor.trim()) need.push('your name')
  else if (already) need.push(`a different person: ${already.actor} already approved as ${ROLE_WORDS[already.role]}`)
  const submit = act(() => {
    if (!chosen) return Promise.resolve(null)
    return run(
      () => approveRecovery(conn, v.id, { actor: actor.trim(), role: chosen, reason: reason.trim() }),
      (r) => r.held
        ? `Approved as ${ROLE_WORDS[chosen]}; the run stays held until the other role approves.`
        : `Approved as ${ROLE_WORDS[chosen]}: the run is released and continues by itself.`,
    )
  })
  return (
    <form className="manual recovery-form held" onSubmit={submit} data-testid="recovery-approve-form" aria-labelledby="recovery-approve-title">
      <h4 id="recovery-approve-title">Held: two approvals needed</h4>
      <p className="small">
        The run stopped twice, so nothing advances by itself: stage timers are stopped and passing probes do not start
        resuming. Two different people must approve, one for platform operations and one as the business owner.
      </p>
      {v.approvals.length > 0 ? (
        <ul className="small" data-testid="recovery-approvals">
          {v.approvals.map((a) => (
            <li key={`${a.role}-${a.at}`} data-testid={`recovery-approval-${a.role}`}>
              <strong>{ROLE_WORDS[a.role]}</strong>: {a.actor}, {time(a.at)}: {a.reason}
            </li>
          ))}
        </ul>
      ) : (
        <p className="small" data-testid="recovery-approvals">No approval yet.</p>
      )}
      <p data-testid="recovery-approvals-missing" className={missing.length ? 'warn-text' : 'ok-text'}>
        {missing.length
          ? <>Still missing: <strong>{missing.map((r) => ROLE_WORDS[r]).join(' and ')}</strong>.</>
          : 'Both roles have approved; the run is released at its next check.'}
      </p>
      <label>Approve as
        <select value={chosen} onChange={(e) => setRole(e.target.value as ApprovalRole | '')} disabled={missing.length === 0} data-testid="recovery-approve-role">
          {missing.length === 0 && <option value="">Both roles have approved</option>}
          {ROLES.map((r) => (
            <option key={r} value={r} disabled={given.has(r)}>
              {ROLE_WORDS[r]}{given.has(r) ? ` (given by ${given.get(r)?.actor ?? ''})` : ''}
            </option>
          ))}
        </select>
      </label>
      <label>Reason
        <input value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500}
          placeholder="e.g. the provider confirmed the fix; the cost is accepted" data-testid="recovery-approve-reason" />
      </label>
      <ActorInput value={actor} onChange={setActor} testid="recovery-approve-actor" />
      <Missing need={need} testid="recovery-approve-missing" />
      <button type="submit" disabled={busy || need.length > 0} data-testid="recovery-approve">
        {chosen ? `Approve as ${ROLE_WORDS[chosen]}` : 'Approve'}
      </button>
      <FormMsg msg={msg} testid="recovery-approve-error" />
    </form>
  )
}

function Overruns({ conn, v, onDone }: PanelProps) {
  const open = !ended(v.step)
  const unexplained = v.overruns.filter((o) => o.explanation === null).length
  return (
    <>
      <h4>Deadline overruns</h4>
      <p className="small" data-testid="recovery-overruns-summary">
        {unexplained > 0
          ? `${count(unexplained)} of ${count(v.overruns.length)} still to explain: the run cannot close until each is.`
          : `All ${count(v.overruns.length)} explained.`}
      </p>
      <table className="grid" data-testid="recovery-overruns">
        <thead><tr><th>Job</th><th>Deadline</th><th>What happened</th><th>Explanation</th></tr></thead>
        <tbody>
          {v.overruns.map((o) => (
            <tr key={String(o.id)} data-testid={`recovery-overrun-${o.id}`} data-explained={o.explanation !== null ? 'true' : 'false'}>
              <td className="mono small"><a {...linkProps({ view: 'deadletters', id: o.job_id })}>{o.job_id}</a></td>
              <td>{time(o.deadline_at)}</td>
              <td className="small wrap">{o.detail}</td>
              <td className="small wrap">
                {o.explanation !== null
                  ? <>{o.explanation}{o.explained_by ? <span className="muted"> ({o.explained_by})</span> : null}</>
                  : open ? <ExplainForm conn={conn} v={v} o={o} onDone={onDone} /> : <span className="error">not explained</span>}
              </td>
            </tr>
          ))}
        </tbody>
      </table>
    </>
  )
}

function ExplainForm({ conn, v, o, onDone }: PanelProps & { o: Overrun }) {
  const { actor, setActor, busy, msg, act } = useOperatorAction()
  const [text, setText] = useState('')
  const run = useRunAction(conn, v.id, onDone)
  const submit = act(() => run(
    () => explainOverrun(conn, v.id, { actor: actor.trim(), overrun: o.id, explanation: text.trim() }),
    () => `Overrun of job ${o.job_id} explained.`,
  ))
  const tid = `recovery-explain-${o.id}`
  return (
    <form className="inline-form" onSubmit={submit} data-testid={`${tid}-form`} aria-label={`Explain the overrun of job ${o.job_id}`}>
      <label>Why the deadline was missed
        <input value={text} onChange={(e) => setText(e.target.value)} required maxLength={500} data-testid={`${tid}-text`} />
      </label>
      <ActorInput value={actor} onChange={setActor} testid={`${tid}-actor`} />
      <button type="submit" disabled={busy || !text.trim() || !actor.trim()} data-testid={tid}>Explain</button>
      <FormMsg msg={msg} testid={`${tid}-error`} />
    </form>
  )
}

function CloseForm({ conn, v, onDone }: PanelProps) {
  const { actor, setActor, busy, msg, act } = useOperatorAction()
  const [contacted, setContacted] = useState(false)
  const [impact, setImpact] = useState(v.incident.customer_impact ?? '')
  const [workarounds, setWorkarounds] = useState(v.incident.workarounds ?? '')
  const run = useRunAction(conn, v.id, onDone)
  const unmet = v.close_missing.filter((m) => !isContactItem(m))
  const need = [...unmet]
  if (!contacted) need.push('tick that the customer was contacted')
  if (!actor.trim()) need.push('your name')
  const submit = act(async () => {
    try {
      return await run(
        () => closeRecovery(conn, v.id, { actor: actor.trim(), customer_contacted: contacted, customer_impact: impact.trim(), workarounds: workarounds.trim() }),
        (r) => `Run closed${r.incident.closed_at ? ` at ${time(r.incident.closed_at)}` : ''}. Download the report below.`,
      )
    } catch (err) {
      // O4's refusal names each unmet condition: say them all where the button is.
      if (err instanceof ApiError) {
        const said = err.message
        const unsaid = err.missing.filter((m) => !said.includes(m))
        if (unsaid.length) throw new Error(`${said.replace(/\.?$/, '.')} Still unmet: ${unsaid.join('; ')}.`)
      }
      throw err
    }
  })
  return (
    <form className="manual recovery-form" onSubmit={submit} data-testid="recovery-close-form" aria-labelledby="recovery-close-title">
      <h4 id="recovery-close-title">Close the run</h4>
      <p className="small">
        O4: the route’s backlog is 0, no outcome is unknown, every deadline overrun is explained, and the customer has
        been contacted. Closing ends the run; its report can be downloaded afterwards.
      </p>
      {unmet.length > 0 ? (
        <div className="small" data-testid="recovery-close-unmet">
          <strong className="error">Not closable yet:</strong>
          <ul>{unmet.map((m) => <li key={m}>{m}</li>)}</ul>
        </div>
      ) : (
        <p className="small ok-text" data-testid="recovery-close-unmet">Backlog, unknown outcomes and overruns are all clear.</p>
      )}
      <label className="radio">
        <input type="checkbox" checked={contacted} onChange={(e) => setContacted(e.target.checked)} data-testid="recovery-close-contacted" />
        <span>The customer has been contacted about this incident</span>
      </label>
      <label>Customer impact
        <textarea value={impact} onChange={(e) => setImpact(e.target.value)} rows={2} maxLength={2000}
          placeholder="e.g. 12 % of chat requests failed for 14 min" data-testid="recovery-close-impact" />
      </label>
      <label>Workarounds offered
        <textarea value={workarounds} onChange={(e) => setWorkarounds(e.target.value)} rows={2} maxLength={2000}
          placeholder="e.g. retry after 5 min; batch jobs re-run overnight" data-testid="recovery-close-workarounds" />
      </label>
      <ActorInput value={actor} onChange={setActor} testid="recovery-close-actor" />
      <Missing need={need} testid="recovery-close-missing" lead="To close" />
      <button type="submit" disabled={busy || need.length > 0} data-testid="recovery-close">Close the run</button>
      <FormMsg msg={msg} testid="recovery-close-error" />
    </form>
  )
}

function CancelForm({ conn, v, onDone }: PanelProps) {
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const run = useRunAction(conn, v.id, onDone)
  const submit = act(() => run(
    () => cancelRecovery(conn, v.id, { actor: actor.trim(), reason: reason.trim() }),
    () => `Run cancelled: the gate on ${v.route} is lifted; the record is kept.`,
  ))
  return (
    <form className="manual recovery-form" onSubmit={submit} data-testid="recovery-cancel-form" aria-labelledby="recovery-cancel-title">
      <h4 id="recovery-cancel-title">Cancel this run</h4>
      <p className="small">
        Stops the run here: the gate is lifted at once (retries back on, the route’s queue at full concurrency) without the
        remaining checks. The record and its report are kept.
      </p>
      <label>Reason
        <input value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500}
          placeholder="e.g. opened on the wrong route" data-testid="recovery-cancel-reason" />
      </label>
      <ActorInput value={actor} onChange={setActor} testid="recovery-cancel-actor" />
      <button type="submit" className="danger" disabled={busy || !actor.trim() || !reason.trim()} data-testid="recovery-cancel">Cancel the run</button>
      <FormMsg msg={msg} testid="recovery-cancel-error" />
    </form>
  )
}

function Ended({ v }: { v: RecoveryView }) {
  const i = v.incident
  return (
    <p className={v.step === 'closed' ? 'banner ok' : 'banner warn'} data-testid={v.step === 'closed' ? 'recovery-closed' : 'recovery-cancelled'}>
      {v.step === 'closed'
        ? <>Closed{i.closed_at ? ` at ${time(i.closed_at)}` : ''}{i.closed_by ? ` by ${i.closed_by}` : ''}.</>
        : <>Cancelled{i.closed_at ? ` at ${time(i.closed_at)}` : ''}{i.closed_by ? ` by ${i.closed_by}` : ''}: the gate was lifted and the record kept.</>}
    </p>
  )
}

/** Hands the browser `blob` as a file named `filename`. */
function save(blob: Blob, filename: string) {
  const url = URL.createObjectURL(blob)
  const a = document.createElement('a')
  a.href = url
  a.download = filename
  document.body.appendChild(a)
  a.click()
  a.remove()
  // Once the click is handled the browser has its own copy; the URL would only pin the bytes.
  setTimeout(() => URL.revokeObjectURL?.(url), 10_000)
}

function Files({ conn, v }: { conn: Connection; v: RecoveryView }) {
  const [busy, setBusy] = useState<RecoveryFile | null>(null)
  const [error, setError] = useState<string | null>(null)
  const download = async (file: RecoveryFile) => {
    setBusy(file)
    setError(null)
    try {
      const f = await getRecoveryFile(conn, v.id, file)
      save(f.blob, f.filename)
    } catch (err) {
      setError((err as Error).message)
    } finally {
      setBusy(null)
    }
  }
  const e = v.evidence
  return (
    <>
      <h4>Files</h4>
      {e ? (
        <p className="small" data-testid="recovery-evidence">
          Evidence bundle: {count(e.requests)} request(s), {bytes(e.bytes)}, SHA-256 <code className="small">{e.sha256}</code>, built by {e.built_by} at{' '}
          {time(e.built_at)}.
        </p>
      ) : (
        <p className="small muted" data-testid="recovery-evidence">No evidence bundle yet: the preserve step builds it.</p>
      )}
      <div className="row-actions">
        {e && (
          <button type="button" onClick={() => download('evidence')} disabled={busy !== null} data-testid="recovery-evidence-download">
            Download the evidence bundle (JSON)
          </button>
        )}
        <button type="button" onClick={() => download('markdown')} disabled={busy !== null} data-testid="recovery-report-md">
          Download the report (Markdown)
        </button>
        <button type="button" onClick={() => download('json')} disabled={busy !== null} data-testid="recovery-report-json">
          Download the record (JSON)
        </button>
        {!ended(v.step) && <span className="muted small">The report is a draft until the run closes.</span>}
      </div>
      {error && <p role="alert" className="error small" data-testid="recovery-download-error">{error}</p>}
    </>
  )
}

function StageScores({ scores }: { scores: StageScore[] }) {
  return (
    <>
      <h4>Scorecard of each resume stage</h4>
      <div className="results" tabIndex={0} role="region" aria-label="Scorecard of each resume stage">
        <table className="grid" data-testid="recovery-stage-scores">
          <thead>
            <tr>
              <th scope="col">Stage</th><th scope="col">From – to</th>
              {SCORE_HEADERS.map((h) => <th key={h.label} scope="col" className={h.num ? 'num' : undefined} title={h.title}>{h.label}</th>)}
            </tr>
          </thead>
          <tbody>
            {scores.map((s) => (
              <tr key={`${s.stage_pct}-${s.from}`} data-testid={`recovery-stage-score-${s.stage_pct}`}>
                <th scope="row">{s.stage_pct} %</th>
                <td className="small">{time(s.from)} – {time(s.to)}</td>
                <ScoreCells row={s.row} />
              </tr>
            ))}
          </tbody>
        </table>
      </div>
    </>
  )
}

/** A time on the record, with how long after the incident's start it was. */
function at(t: number | null, start: number): string {
  if (t === null) return '—'
  return `${time(t)} (${t >= start ? '+' : '-'}${duration(Math.abs(t - start))})`
}

function Incident({ v }: { v: RecoveryView }) {
  const i = v.incident
  const f = i.first_error
  const facts: [string, ReactNode][] = [
    ['Started', time(i.started_at)],
    ['Detected', at(i.detected_at, i.started_at)],
    ['Stopped (isolated)', at(i.stopped_at, i.started_at)],
    ['Recovered', at(i.recovered_at, i.started_at)],
    ['Resumed (each stage)', i.resume_times.length ? i.resume_times.map((t) => time(t)).join(', ') : '—'],
    ['Closed', i.closed_at === null ? '—' : `${at(i.closed_at, i.started_at)}${i.closed_by ? ` by ${i.closed_by}` : ''}`],
    ['Affected requests', count(i.affected_requests)],
    ['First error', f === null ? '—' : (
      <>
        {time(f.at)}, <a {...linkProps({ view: 'ledger', id: f.request_id })} className="mono">{f.request_id}</a>
        {f.error_class || f.message ? `: ${[f.error_class, f.message].filter(Boolean).join(': ')}` : ''}
      </>
    )],
    ['Retries', count(i.retries)],
    ['Spend, failures included', money(i.spend_usd)],
    ['Customer contacted', i.customer_contacted ? 'yes' : 'no'],
    ['Customer impact', i.customer_impact ?? '—'],
    ['Workarounds', i.workarounds ?? '—'],
  ]
  return (
    <>
      <h4>Incident record{v.drill ? ' (DRILL)' : ''}</h4>
      <table className="grid facts" data-testid="recovery-incident">
        <tbody>{facts.map(([k, val]) => <tr key={k}><th scope="row">{k}</th><td className="small wrap">{val}</td></tr>)}</tbody>
      </table>
      <h4>Config changes during the incident</h4>
      {i.config_changes.length === 0 ? (
        <p className="muted small" data-testid="recovery-config-changes">None.</p>
      ) : (
        <table className="grid" data-testid="recovery-config-changes">
          <thead><tr><th>When</th><th>What</th><th>Who</th><th>Approved by</th><th>Before</th><th>After</th></tr></thead>
          <tbody>
            {i.config_changes.map((c, k) => (
              <tr key={`${c.at}-${k}`}>
                <td>{time(c.at)}</td><td className="small wrap">{c.what}</td><td>{c.actor}</td><td>{c.approver ?? '—'}</td>
                <td className="mono small wrap">{c.before ?? '—'}</td><td className="mono small wrap">{c.after ?? '—'}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </>
  )
}

function Events({ v }: { v: RecoveryView }) {
  const events = [...v.events].sort((a, b) => a.at - b.at)
  return (
    <>
      <h4>Timeline</h4>
      {events.length === 0 ? (
        <p className="muted small" data-testid="recovery-events">No move yet.</p>
      ) : (
        <table className="grid" data-testid="recovery-events">
          <caption className="muted small">Every move of the run, oldest first; each is on the <a {...linkProps({ view: 'audit' })}>audit log</a> too</caption>
          <thead><tr><th>When</th><th>Who</th><th>Move</th><th>Action</th><th>Why</th><th>Figures</th></tr></thead>
          <tbody>
            {events.map((e, k) => {
              const back = ORDER.indexOf(e.to) >= 0 && ORDER.indexOf(e.to) < ORDER.indexOf(e.from)
              return (
                <tr key={`${e.at}-${k}`} data-testid="recovery-event" data-action={e.action} className={back ? 'step-back' : undefined}>
                  <td>{time(e.at)}</td>
                  <td>{e.actor}</td>
                  <td className={back ? 'warn-text' : undefined}>{STEP_WORDS[e.from]} → {STEP_WORDS[e.to]}{back ? ' (back)' : ''}</td>
                  <td><code>{e.action}</code></td>
                  <td className="small wrap">{e.reason}</td>
                  <td className="small wrap">{e.figures.length ? e.figures.map((x) => `${x.name.replace(/_/g, ' ')} ${count(x.value)}`).join(', ') : '—'}</td>
                </tr>
              )
            })}
          </tbody>
        </table>
      )}
    </>
  )
}
