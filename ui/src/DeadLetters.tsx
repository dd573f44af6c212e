// The dead-letter inbox (L1-L3): background jobs that gave up (out of attempts, too old,
// partial output already sent, outcome unknown). Nothing here runs again on its own. An
// owner reads the evidence, what the ledger says about the job's idempotency key and what a
// replay would cost, and replays it through a reviewed form where every field is required;
// many at once only over an explicit filter or checked selection, previewed first.
import { keepPreviousData, useQuery, useQueryClient } from '@tanstack/react-query'
import { useState } from 'react'
import {
  ApiError, REPLAY_REASONS, bulkReplay, getDeadLetter, getDeadLetters, getJob, previewBulkReplay, replayDeadLetter,
  type BulkReplayed, type Connection, type Replayed, type ReplayReasonKind,
} from './api'
import type { BulkPreview } from './bindings/BulkPreview'
import type { DeadLetterDetail } from './bindings/DeadLetterDetail'
import type { IdempotencyResult } from './bindings/IdempotencyResult'
import type { JobFilter } from './bindings/JobFilter'
import type { RouteChoice } from './bindings/RouteChoice'
import { age, count, jobReason, lastError, money } from './format'
import { FilterBar, JobFacts, NO_FILTER, Runs, filterWords, routeOf, toJobFilter, toQuery, type InboxFilter } from './JobParts'
import { linkProps, navigate } from './router'
import { useOperatorAction } from './actor'

/** The newest this many are listed. */
const PAGE = 200

const REASON_WORDS: Record<ReplayReasonKind, string> = {
  provider_recovered: 'The provider recovered',
  product_bug_fixed: 'A product bug was fixed',
  quota_changed: 'The quota or limit changed',
  owner_override: 'Owner override',
}

const IDEMPOTENCY: Record<IdempotencyResult, { words: string; tone: string }> = {
  no_side_effect_recorded: { words: 'No side effect recorded under its idempotency key: a replay cannot repeat one.', tone: 'ok' },
  side_effect_completed: { words: 'A side effect completed under its idempotency key: a replay is refused.', tone: 'bad' },
  outcome_unknown: { words: 'A run under its idempotency key has an unknown outcome: reconcile it before any replay (L3).', tone: 'bad' },
}

export function DeadLettersView({ conn, selected }: { conn: Connection; selected: string | null }) {
  const [filter, setFilter] = useState<InboxFilter>(NO_FILTER)
  const [checked, setChecked] = useState<Set<string>>(new Set())
  // Replayed here (id → when): hidden at once, until the list is read again after it.
  const [gone, setGone] = useState<Record<string, number>>({})
  const [replayed, setReplayed] = useState<Replayed | null>(null)
  const [bulkDone, setBulkDone] = useState<BulkReplayed | null>(null)
  const list = useQuery({
    queryKey: ['dead-letters', conn.url, filter],
    queryFn: () => getDeadLetters(conn, toQuery(filter, PAGE)),
    refetchInterval: 5_000,
    placeholderData: keepPreviousData,
  })
  const now = Date.now()
  const items = (list.data ?? []).filter((j) => !(j.job_id in gone && list.dataUpdatedAt <= gone[j.job_id]))
  const oldest = items.length ? Math.min(...items.map((j) => j.created_at)) : null
  const filtered = filterWords(filter) !== 'no filter'
  // Only what is still listed stays checked.
  const picked = items.map((j) => j.job_id).filter((id) => checked.has(id))
  const all = picked.length === items.length && items.length > 0
  const toggle = (id: string) => {
    const next = new Set(checked)
    if (next.has(id)) next.delete(id)
    else next.add(id)
    setChecked(next)
  }
  const bulkFilter = toJobFilter(filter, picked.length ? picked : null)
  const scope = picked.length
    ? `the ${picked.length} checked dead letter(s)`
    : filtered
      ? `every dead letter matching the filter (${filterWords(filter)}), listed or not, at most 500 at a time`
      : 'every dead letter in the inbox, listed or not, at most 500 at a time'
  return (
    <section>
      <h2>Dead letters</h2>
      <p className="muted">
        Background jobs that gave up: out of attempts, past their queue age, partial output already sent, or an outcome
        nobody knows. They never run again on their own. A replay makes a new job from the same request, after an owner
        has reviewed its evidence, its idempotency result and its cost.
      </p>
      <FilterBar value={filter} onApply={(f) => { setFilter(f); setChecked(new Set()) }} withAge label="Filter the dead-letter inbox" />
      {replayed && (
        <div role="status" className="banner ok" data-testid="replay-result">
          Replayed {replayed.replay_of} as job <strong className="mono">{replayed.job_id}</strong>.{' '}
          <JobProgress conn={conn} id={replayed.job_id} />{' '}
          <a {...linkProps({ view: 'audit' })}>See it on the audit log.</a>
        </div>
      )}
      {bulkDone && (
        <p role="status" className="ok-text" data-testid="bulk-replay-result">
          Bulk replay {bulkDone.batch_id}: {count(bulkDone.replayed.length)} dead letter(s) replayed, each on its own route;
          it stops after {count(bulkDone.stop_after_failures)} failure(s).
          {bulkDone.refused.length > 0 && ` ${count(bulkDone.refused.length)} refused: ${bulkDone.refused.map((r) => `${r.id} (${r.why})`).join('; ')}.`}
          {' '}<a {...linkProps({ view: 'audit' })}>See it on the audit log.</a>
        </p>
      )}
      {list.error && <p role="alert" className="error">{(list.error as Error).message}</p>}
      {!list.data ? (
        !list.error && <p className="muted" aria-busy>Loading the inbox…</p>
      ) : items.length === 0 ? (
        <p className="ok-text" data-testid="deadletters-empty">
          {filtered ? 'No dead letter matches the filter.' : 'None: no background job has given up.'}
        </p>
      ) : (
        <>
          <p data-testid="deadletters-summary">
            <strong>{items.length}{list.data.length >= PAGE ? '+' : ''}</strong> dead letter(s){filtered ? ' matching the filter' : ''};
            the oldest {list.data.length >= PAGE ? 'listed ' : ''}is {age(oldest, now)} old.
          </p>
          <table className="grid selectable" data-testid="deadletters-table">
            <thead>
              <tr>
                <th>
                  <input type="checkbox" aria-label="Select every dead letter listed" checked={all}
                    onChange={() => setChecked(all ? new Set() : new Set(items.map((j) => j.job_id)))} data-testid="deadletters-all" />
                </th>
                <th>Job</th><th>Workflow</th><th>Route</th><th>Why it is here</th><th>Last error</th>
                <th className="num">Attempt</th><th>Age</th><th className="num">Estimate</th>
              </tr>
            </thead>
            <tbody>
              {items.map((j) => (
                <tr key={j.job_id} aria-selected={j.job_id === selected} data-testid={`deadletter-${j.job_id}`}
                  onClick={() => navigate({ view: 'deadletters', id: j.job_id })}>
                  <td onClick={(e) => e.stopPropagation()}>
                    <input type="checkbox" aria-label={`Select ${j.job_id}`} checked={checked.has(j.job_id)} onChange={() => toggle(j.job_id)} />
                  </td>
                  <td className="mono small"><a {...linkProps({ view: 'deadletters', id: j.job_id })}>{j.job_id}</a></td>
                  <td>{j.workflow}</td>
                  <td>{routeOf(j)}</td>
                  <td title={j.reason ?? undefined}>{jobReason(j.reason)}</td>
                  <td className="small" title={j.last_error ?? undefined}>{lastError(j.last_error_type, j.last_error)}</td>
                  <td className="num">{j.attempt}/{j.max_attempts}</td>
                  <td>{age(j.created_at, now)}</td>
                  <td className="num">{money(j.estimated_cost_usd)}</td>
                </tr>
              ))}
            </tbody>
          </table>
          <BulkReplay key={JSON.stringify(bulkFilter)} conn={conn} filter={bulkFilter} scope={scope}
            onDone={(r) => {
              setGone((prev) => {
                const next = { ...prev }
                for (const x of r.replayed) next[x.dead_letter] = Date.now()
                return next
              })
              setChecked(new Set())
              setBulkDone(r)
            }} />
        </>
      )}
      {selected && (
        <DeadLetterPanel key={selected} conn={conn} id={selected} onReplayed={(r) => {
          setGone((prev) => ({ ...prev, [r.replay_of]: Date.now() }))
          setReplayed(r)
          navigate({ view: 'deadletters', id: null })
        }} />
      )}
    </section>
  )
}

/** A replay's new job, followed until it ends (every 2 s). */
function JobProgress({ conn, id }: { conn: Connection; id: string }) {
  const job = useQuery({
    queryKey: ['job', conn.url, id],
    queryFn: () => getJob(conn, id),
    refetchInterval: (q) => (q.state.data && q.state.data.job.lane === null ? false : 2_000),
  })
  if (!job.data) return <span className="muted" data-testid="replay-state">Queued.</span>
  const j = job.data.job
  return (
    <span data-testid="replay-state">
      It is <strong>{j.state}</strong>{j.lane ? ` (lane ${j.lane})` : ''}.
      {j.lane === 'dead_letter' && <> <a {...linkProps({ view: 'deadletters', id: j.job_id })}>It is a dead letter again.</a></>}
      {j.lane === 'owner_review' && <> <a {...linkProps({ view: 'reviews', id: j.job_id })}>It awaits an owner.</a></>}
    </span>
  )
}

/** The selected dead letter, read by its id (a link from an alert lands here too). */
function DeadLetterPanel({ conn, id, onReplayed }: { conn: Connection; id: string; onReplayed: (r: Replayed) => void }) {
  const one = useQuery({ queryKey: ['dead-letter', conn.url, id], queryFn: () => getDeadLetter(conn, id), retry: false })
  if (one.error) {
    const gone = one.error instanceof ApiError && one.error.status === 404
    return <p role={gone ? undefined : 'alert'} className={gone ? 'muted' : 'error'} data-testid="deadletter-gone">{(one.error as Error).message}</p>
  }
  if (!one.data) return <p className="muted" aria-busy>Loading {id}…</p>
  const d = one.data
  const job = d.job
  const idem = IDEMPOTENCY[d.idempotency_result]
  return (
    <article className="route-detail" data-testid="deadletter-detail">
      <header>
        <h3>Dead letter {job.job_id}</h3>
        <span className="pill bad">{jobReason(job.reason)}</span>
        <a {...linkProps({ view: 'deadletters', id: null })}>Close</a>
      </header>
      <div className={`banner ${idem.tone}`} data-testid="idempotency-result">
        <strong>Idempotency result: <code>{d.idempotency_result}</code></strong>. {idem.words}
        <div className="small">{d.idempotency_detail}</div>
      </div>
      <p data-testid="cost-estimate">
        A replay on its route {job.route_key} is estimated at <strong>{money(d.estimated_cost_usd)}</strong>
        {d.estimated_cost_usd === null && ' (the pricing catalog has no price for its model)'}, at pricing version <code>{d.pricing_version}</code>.
      </p>
      <div className="split-2">
        <JobFacts job={job} testid="deadletter-facts" />
        {d.replayable ? <ReplayForm key={d.idempotency_result} conn={conn} d={d} onReplayed={onReplayed} /> : <NotReplayable d={d} />}
      </div>
      <h4>Evidence: its runs</h4>
      <Runs evidence={d.evidence} testid="deadletter-runs" />
    </article>
  )
}

function NotReplayable({ d }: { d: DeadLetterDetail }) {
  return (
    <div className="manual" data-testid="replay-refused">
      <h4>Replay</h4>
      <p className="error">
        <strong>This dead letter cannot be replayed</strong>: {d.not_replayable_because ?? IDEMPOTENCY[d.idempotency_result].words}
      </p>
      {d.idempotency_result === 'outcome_unknown' && (
        <p className="small">
          Reconcile the request with the unknown outcome in <a {...linkProps({ view: 'unknowns', id: null })}>Unknown outcomes</a> first;
          once it is confirmed not executed, a replay can be reviewed here.
        </p>
      )}
      {d.idempotency_result === 'side_effect_completed' && (
        <p className="small">Replaying would do its side effect a second time. Check the result the earlier run produced instead.</p>
      )}
    </div>
  )
}

/** What the estimate checkbox says for a route. */
function estimateWords(r: RouteChoice): string {
  return r.estimated_cost_usd === null
    ? `I reviewed that the cost on ${r.route} is unknown (the catalog has no price for its model)`
    : `I reviewed the estimate of ${money(r.estimated_cost_usd)} for ${r.route}`
}

/** L1: the reviewed replay form. Every field is required; the estimate acknowledged is the
 * chosen route's, as shown, and a changed estimate has to be reviewed again. */
function ReplayForm({ conn, d, onReplayed }: { conn: Connection; d: DeadLetterDetail; onReplayed: (r: Replayed) => void }) {
  const qc = useQueryClient()
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const [kind, setKind] = useState<ReplayReasonKind | ''>('')
  const [route, setRoute] = useState('')
  const [reviewed, setReviewed] = useState<{ route: string; estimate: number | null } | null>(null)
  const [invalid, setInvalid] = useState<string[]>([])
  const id = d.job.job_id
  const choice = d.routes.find((r) => r.route === route && r.refused === null) ?? null
  const costOk = choice !== null && reviewed !== null && reviewed.route === choice.route && reviewed.estimate === choice.estimated_cost_usd
  const missing: string[] = []
  if (!actor.trim()) missing.push('replay owner')
  if (!kind) missing.push('reason kind')
  if (!reason.trim()) missing.push('reason text')
  if (!choice) missing.push('route')
  if (!costOk) missing.push('cost review')
  const submit = act(async () => {
    if (!kind || !choice || !costOk) return null
    setInvalid([])
    try {
      const r = await replayDeadLetter(conn, id, {
        replay_owner: actor.trim(),
        replay_reason: { kind, text: reason.trim() },
        route_override: choice.route,
        idempotency_result: d.idempotency_result,
        cost_reviewed: { estimated_cost_usd: choice.estimated_cost_usd },
      })
      qc.invalidateQueries({ queryKey: ['dead-letters'] })
      qc.removeQueries({ queryKey: ['dead-letter', conn.url, id] })
      onReplayed(r)
      return null
    } catch (err) {
      if (err instanceof ApiError) {
        setInvalid(err.missingFields)
        // The idempotency result or the estimate changed: show them as they are now (a
        // changed estimate unticks its review).
        if (err.status === 409) qc.invalidateQueries({ queryKey: ['dead-letter', conn.url, id] })
      }
      throw err
    }
  })
  const bad = (field: string) => invalid.includes(field) || undefined
  return (
    <form className="manual" onSubmit={submit} data-testid="replay-form" aria-labelledby="replay-form-title">
      <h4 id="replay-form-title">Replay</h4>
      <p className="muted small">
        A replay makes a new job from this one’s request, with a fresh attempt budget. It cannot undo what this job did, and
        the gateway refuses it if the ledger shows a side effect under the job’s idempotency key.
      </p>
      <label>Replay owner (your name)
        <input value={actor} onChange={(e) => setActor(e.target.value)} required maxLength={64} aria-invalid={bad('replay_owner')} data-testid="replay-owner" />
      </label>
      <label>Why replay
        <select value={kind} onChange={(e) => setKind(e.target.value as ReplayReasonKind | '')} required aria-invalid={bad('replay_reason.kind') ?? bad('replay_reason')} data-testid="replay-kind">
          <option value="">Choose a reason</option>
          {REPLAY_REASONS.map((k) => <option key={k} value={k}>{REASON_WORDS[k]}</option>)}
        </select>
      </label>
      <label>Reason, in words
        <input value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500} placeholder="e.g. provider incident INC-42 resolved"
          aria-invalid={bad('replay_reason.text') ?? bad('replay_reason')} data-testid="replay-reason" />
      </label>
      <fieldset data-testid="replay-routes" className={bad('route_override') ? 'invalid' : undefined}>
        <legend className="small">Route to replay on</legend>
        {d.routes.map((r) => (
          <label key={r.route} className="radio">
            <input type="radio" name={`replay-route-${id}`} value={r.route} checked={route === r.route} disabled={r.refused !== null}
              onChange={() => setRoute(r.route)} data-testid={`replay-route-${r.route}`} />
            <span>
              {r.route} — {r.kind === 'same_route' ? 'its own route' : 'approved fallback'} · estimate {money(r.estimated_cost_usd)}
              {r.refused !== null && <span className="muted small"> · not offered: {r.refused}</span>}
            </span>
          </label>
        ))}
      </fieldset>
      <label>Idempotency result (computed by the gateway, sent back as shown)
        <input value={d.idempotency_result} readOnly aria-invalid={bad('idempotency_result')} data-testid="replay-idempotency" />
      </label>
      <label className="radio">
        <input type="checkbox" checked={costOk} disabled={!choice}
          onChange={(e) => setReviewed(e.target.checked && choice ? { route: choice.route, estimate: choice.estimated_cost_usd } : null)}
          aria-invalid={bad('cost_reviewed')} data-testid="replay-cost-reviewed" />
        <span>{choice ? estimateWords(choice) : 'Choose a route to review its estimate'}</span>
      </label>
      {missing.length > 0 && <p className="muted small" data-testid="replay-missing">To replay, fill in: {missing.join(', ')}.</p>}
      <button type="submit" disabled={busy || missing.length > 0} data-testid="replay-submit">
        {choice ? `Replay on ${choice.route}` : 'Replay'}
      </button>
      {msg && <p role={msg.ok ? 'status' : 'alert'} className={msg.ok ? 'ok-text small' : 'error small'} data-testid="replay-error">{msg.text}</p>}
    </form>
  )
}

/** L2: a bulk replay over an explicit filter or the checked rows: previewed first (count,
 * total estimate, what is refused and why), then the same reviewed fields and a stop
 * condition. Each job runs on its own route. */
function BulkReplay({ conn, filter, scope, onDone }: { conn: Connection; filter: JobFilter; scope: string; onDone: (r: BulkReplayed) => void }) {
  const qc = useQueryClient()
  const [preview, setPreview] = useState<BulkPreview | null>(null)
  const [previewing, setPreviewing] = useState(false)
  const [previewError, setPreviewError] = useState<string | null>(null)
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const [kind, setKind] = useState<ReplayReasonKind | ''>('')
  const [stop, setStop] = useState('')
  const [reviewed, setReviewed] = useState(false)
  const runPreview = async () => {
    setPreviewing(true)
    setPreviewError(null)
    setReviewed(false)
    try {
      setPreview(await previewBulkReplay(conn, filter))
    } catch (err) {
      setPreview(null)
      setPreviewError((err as Error).message)
    } finally {
      setPreviewing(false)
    }
  }
  const stopN = Number(stop)
  const stopOk = stop.trim() !== '' && Number.isInteger(stopN) && stopN >= 1
  const missing: string[] = []
  if (!actor.trim()) missing.push('replay owner')
  if (!kind) missing.push('reason kind')
  if (!reason.trim()) missing.push('reason text')
  if (!stopOk) missing.push('stop after failures (a whole number, at least 1)')
  if (!reviewed) missing.push('cost review')
  const total = preview?.total_estimated_cost_usd ?? null
  const submit = act(async () => {
    if (!preview || !kind || !stopOk || !reviewed) return null
    try {
      const r = await bulkReplay(conn, {
        filter,
        replay_owner: actor.trim(),
        replay_reason: { kind, text: reason.trim() },
        cost_reviewed: { total_estimated_cost_usd: preview.total_estimated_cost_usd, count: preview.count },
        stop_after_failures: stopN,
      })
      qc.invalidateQueries({ queryKey: ['dead-letters'] })
      onDone(r)
      return null
    } catch (err) {
      // The total changed since the preview: it has to be previewed and reviewed again.
      if (err instanceof ApiError && err.status === 409) {
        setPreview(null)
        setReviewed(false)
      }
      throw err
    }
  })
  return (
    <section className="bulk" aria-labelledby="bulk-title" data-testid="bulk-replay">
      <h3 id="bulk-title">Bulk replay</h3>
      <p className="small">
        Covers {scope}. Each job is replayed on its own route; one with a side effect or an unknown outcome under its key is
        refused. Preview first: nothing is replayed until you confirm below.
      </p>
      <button type="button" onClick={runPreview} disabled={previewing} data-testid="bulk-preview-button">
        {previewing ? 'Previewing…' : 'Preview bulk replay'}
      </button>
      {previewError && <p role="alert" className="error small">{previewError}</p>}
      {preview && (
        <div data-testid="bulk-preview">
          <p>
            <strong>{count(preview.count)}</strong> dead letter(s) would be replayed, for a total estimate of{' '}
            <strong>{total === null ? 'unknown' : money(total)}</strong>
            {preview.unknown_estimates > 0 && ` (${count(preview.unknown_estimates)} of them have no price, so the total is unknown)`}.
            {preview.refused.length > 0 && ` ${count(preview.refused.length)} would be refused:`}
          </p>
          {preview.refused.length > 0 && (
            <ul className="small" data-testid="bulk-refused">
              {preview.refused.map((r) => <li key={r.id}><span className="mono">{r.id}</span>: {r.why}</li>)}
            </ul>
          )}
        </div>
      )}
      {preview && preview.count > 0 && (
        <form className="manual bulk-form" onSubmit={submit} data-testid="bulk-form" aria-label="Bulk replay">
          <label>Replay owner (your name)
            <input value={actor} onChange={(e) => setActor(e.target.value)} required maxLength={64} data-testid="bulk-owner" />
          </label>
          <label>Why replay
            <select value={kind} onChange={(e) => setKind(e.target.value as ReplayReasonKind | '')} required data-testid="bulk-kind">
              <option value="">Choose a reason</option>
              {REPLAY_REASONS.map((k) => <option key={k} value={k}>{REASON_WORDS[k]}</option>)}
            </select>
          </label>
          <label>Reason, in words
            <input value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500} data-testid="bulk-reason" />
          </label>
          <label>Stop after this many of them fail again
            <input type="number" min={1} step={1} value={stop} onChange={(e) => setStop(e.target.value)} required data-testid="bulk-stop" />
          </label>
          <label className="radio">
            <input type="checkbox" checked={reviewed} onChange={(e) => setReviewed(e.target.checked)} data-testid="bulk-cost-reviewed" />
            <span>
              {total === null
                ? `I reviewed that the total cost of these ${count(preview.count)} jobs is unknown`
                : `I reviewed the total estimate of ${money(total)} for ${count(preview.count)} job(s)`}
            </span>
          </label>
          {missing.length > 0 && <p className="muted small" data-testid="bulk-missing">To replay, fill in: {missing.join(', ')}.</p>}
          <button type="submit" className="danger" disabled={busy || missing.length > 0} data-testid="bulk-replay-submit">
            Replay {count(preview.count)} dead letter(s)
          </button>
        </form>
      )}
      {msg && <p role={msg.ok ? 'status' : 'alert'} className={msg.ok ? 'ok-text small' : 'error small'} data-testid="bulk-error">{msg.text}</p>}
    </section>
  )
}
