// The owner-review inbox (K3): background jobs the gateway will not run again on its own
// (a quota or spend limit, a refused permission, a data boundary, a fallback contract it
// cannot check, an answer it cannot classify). An owner looks at the job and its runs and
// approves it (it runs again now, on its route or an approved fallback) or rejects it,
// with a name and a reason that go on the audit log.
import { keepPreviousData, useQuery, useQueryClient } from '@tanstack/react-query'
import { useState } from 'react'
import { ApiError, approveReview, getJob, getReviews, rejectReview, type Connection } from './api'
import type { JobView } from './bindings/JobView'
import { age, jobReason, lastError, money } from './format'
import { FilterBar, JobFacts, NO_FILTER, Runs, parseFallbacks, routeOf, toQuery, type InboxFilter } from './JobParts'
import { linkProps, navigate } from './router'
import { useOperatorAction } from './actor'

/** The newest this many are listed. */
const PAGE = 200

export function ReviewsView({ conn, selected }: { conn: Connection; selected: string | null }) {
  const [filter, setFilter] = useState<InboxFilter>(NO_FILTER)
  // Decided here (id → when): hidden at once, until the list is read again after it.
  const [decided, setDecided] = useState<Record<string, number>>({})
  const [done, setDone] = useState<string | null>(null)
  const list = useQuery({
    queryKey: ['reviews', conn.url, filter],
    queryFn: () => getReviews(conn, toQuery(filter, PAGE)),
    refetchInterval: 5_000,
    placeholderData: keepPreviousData,
  })
  const now = Date.now()
  const items = (list.data ?? []).filter((j) => !(j.job_id in decided && list.dataUpdatedAt <= decided[j.job_id]))
  const oldest = items.length ? Math.min(...items.map((j) => j.created_at)) : null
  const filtered = filter.route.trim() !== '' || filter.owner.trim() !== '' || filter.error_class.trim() !== ''
  return (
    <section>
      <h2>Owner review</h2>
      <p className="muted">
        Background jobs held for a person: the gateway stopped retrying them because a quota or spend limit ran out, a
        permission was refused, a data boundary or a fallback contract could not be confirmed, or the provider answered in a
        way it cannot classify. Approve one to run it again now (on its route or an approved fallback), or reject it.
      </p>
      <FilterBar value={filter} onApply={setFilter} withAge={false} label="Filter the owner-review inbox" />
      {done && (
        <p role="status" className="ok-text" data-testid="review-result">
          {done} <a {...linkProps({ view: 'audit' })}>See it on the audit log.</a>
        </p>
      )}
      {list.error && <p role="alert" className="error">{(list.error as Error).message}</p>}
      {!list.data ? (
        !list.error && <p className="muted" aria-busy>Loading the inbox…</p>
      ) : items.length === 0 ? (
        <p className="ok-text" data-testid="reviews-empty">
          {filtered ? 'No job matching the filter is awaiting review.' : 'None: no background job is waiting for an owner.'}
        </p>
      ) : (
        <>
          <p data-testid="reviews-summary">
            <strong>{items.length}{list.data.length >= PAGE ? '+' : ''}</strong> awaiting a decision{filtered ? ' (filtered)' : ''};
            the oldest {list.data.length >= PAGE ? 'listed ' : ''}has waited {age(oldest, now)}.
          </p>
          <table className="grid selectable" data-testid="reviews-table">
            <thead>
              <tr>
                <th>Job</th><th>Workflow</th><th>Route</th><th>Why it is here</th><th>Last error</th>
                <th className="num">Attempt</th><th>Age</th><th className="num">Estimate</th>
              </tr>
            </thead>
            <tbody>
              {items.map((j) => (
                <tr key={j.job_id} aria-selected={j.job_id === selected} data-testid={`review-${j.job_id}`}
                  onClick={() => { setDone(null); navigate({ view: 'reviews', id: j.job_id }) }}>
                  <td className="mono small"><a {...linkProps({ view: 'reviews', id: j.job_id })}>{j.job_id}</a></td>
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
        </>
      )}
      {selected && (
        <ReviewDetail key={selected} conn={conn} id={selected} onDecided={(id, text) => {
          setDecided((prev) => ({ ...prev, [id]: Date.now() }))
          setDone(text)
          navigate({ view: 'reviews', id: null })
        }} />
      )}
    </section>
  )
}

/** The selected job, read by its id (a link from an alert lands here too). */
function ReviewDetail({ conn, id, onDecided }: { conn: Connection; id: string; onDecided: (id: string, text: string) => void }) {
  const one = useQuery({ queryKey: ['job', conn.url, id], queryFn: () => getJob(conn, id), retry: false })
  if (one.error) {
    const gone = one.error instanceof ApiError && one.error.status === 404
    return <p role={gone ? undefined : 'alert'} className={gone ? 'muted' : 'error'} data-testid="review-gone">{(one.error as Error).message}</p>
  }
  if (!one.data) return <p className="muted" aria-busy>Loading {id}…</p>
  const { job, evidence } = one.data
  const waiting = job.lane === 'owner_review'
  return (
    <article className="route-detail" data-testid="review-detail">
      <header>
        <h3>Job {job.job_id}</h3>
        <span className="pill warn">{jobReason(job.reason)}</span>
        <a {...linkProps({ view: 'reviews', id: null })}>Close</a>
      </header>
      <div className="split-2">
        <JobFacts job={job} testid="review-facts" />
        {waiting ? (
          <ReviewForm conn={conn} job={job} onDecided={onDecided} />
        ) : (
          <p className="muted" data-testid="review-gone">
            Job {job.job_id} is not awaiting review: it is {job.state}{job.lane ? ` (lane ${job.lane})` : ''}.
          </p>
        )}
      </div>
      <h4>Runs</h4>
      <Runs evidence={evidence} testid="review-runs" />
    </article>
  )
}

function ReviewForm({ conn, job, onDecided }: { conn: Connection; job: JobView; onDecided: (id: string, text: string) => void }) {
  const qc = useQueryClient()
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  // '' keeps the job's route.
  const [route, setRoute] = useState('')
  const [invalid, setInvalid] = useState<string[]>([])
  const current = routeOf(job)
  const fallbacks = parseFallbacks(job.fallback_policy).filter((r) => r !== current)
  const need: string[] = []
  if (!actor.trim()) need.push('reviewer')
  if (!reason.trim()) need.push('reason')
  const decide = (approve: boolean) =>
    act(async () => {
      setInvalid([])
      try {
        const f = { reviewer: actor.trim(), reason: reason.trim() }
        const v = approve
          ? await approveReview(conn, job.job_id, { ...f, route: route || null })
          : await rejectReview(conn, job.job_id, f)
        qc.invalidateQueries({ queryKey: ['reviews'] })
        qc.invalidateQueries({ queryKey: ['job', conn.url, job.job_id] })
        onDecided(
          job.job_id,
          approve
            ? `Approved ${job.job_id}: it runs again now on ${routeOf(v)}, with a fresh attempt budget. Recorded on the audit log.`
            : `Rejected ${job.job_id}: it will not run again; its client sees it as ${v.state}. Recorded on the audit log.`,
        )
        return null
      } catch (err) {
        if (err instanceof ApiError) {
          setInvalid(err.missingFields)
          // No longer awaiting review (someone else decided): the list is read again.
          if (err.status === 409) qc.invalidateQueries({ queryKey: ['reviews'] })
        }
        throw err
      }
    })
  return (
    <form className="manual" onSubmit={(e) => e.preventDefault()} data-testid="review-form" aria-labelledby="review-form-title">
      <h4 id="review-form-title">Decide</h4>
      <p className="muted small">
        <strong>Approve</strong>: the job runs again now, on the route below, with a fresh attempt budget and queue age.
        {' '}<strong>Reject</strong>: it ends here and never runs; its client sees it as rejected.
      </p>
      <label>Reviewer
        <input value={actor} onChange={(e) => setActor(e.target.value)} required maxLength={64} aria-invalid={invalid.includes('reviewer') || undefined} data-testid="review-reviewer" />
      </label>
      <label>Reason
        <input value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500} placeholder="e.g. quota raised to 2M tokens/day"
          aria-invalid={invalid.includes('reason') || undefined} data-testid="review-reason" />
      </label>
      <label>Run it on (approve only)
        <select value={route} onChange={(e) => setRoute(e.target.value)} data-testid="review-route">
          <option value="">Its own route ({current})</option>
          {fallbacks.map((r) => <option key={r} value={r}>{r} (approved fallback)</option>)}
        </select>
      </label>
      {need.length > 0 && <p className="muted small" data-testid="review-missing">Still needed: {need.join(', ')}.</p>}
      <div className="row-actions">
        <button type="button" disabled={busy || need.length > 0} onClick={decide(true)} data-testid="review-approve">
          Approve and run{route ? ` on ${route}` : ''}
        </button>
        <button type="button" className="danger" disabled={busy || need.length > 0} onClick={decide(false)} data-testid="review-reject">
          Reject
        </button>
      </div>
      {msg && <p role={msg.ok ? 'status' : 'alert'} className={msg.ok ? 'ok-text small' : 'error small'} data-testid="review-error">{msg.text}</p>}
    </form>
  )
}
