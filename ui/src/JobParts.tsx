// What the background-job inboxes (owner review, dead letter) share: their server-side
// filter, a job's facts, and its runs as evidence, each run linking to its ledger record.
import { useState } from 'react'
import type { JobQuery } from './api'
import type { JobFilter } from './bindings/JobFilter'
import type { JobView } from './bindings/JobView'
import type { RequestDetail } from './bindings/RequestDetail'
import { JOB_FILTER_CODES, failureClass, jobReason, money, statePill, time, trimmed } from './format'
import { linkProps } from './router'

/** The inbox filter as typed; `min_age_min` is in minutes. */
export type InboxFilter = { route: string; owner: string; error_class: string; min_age_min: string }
export const NO_FILTER: InboxFilter = { route: '', owner: '', error_class: '', min_age_min: '' }

function minAgeMs(f: InboxFilter): number | null {
  const t = f.min_age_min.trim()
  if (t === '') return null
  const v = Number(t)
  return Number.isFinite(v) && v > 0 ? Math.round(v * 60_000) : null
}

/** The list query of a filter, at most `limit` items (newest first). */
export function toQuery(f: InboxFilter, limit: number): JobQuery {
  return {
    route: f.route.trim() || null,
    owner: f.owner.trim() || null,
    error_class: f.error_class.trim() || null,
    min_age_ms: minAgeMs(f),
    limit,
  }
}

/** The filter a bulk action sends: the checked jobs when there are any, else the list's filter. */
export function toJobFilter(f: InboxFilter, ids: string[] | null): JobFilter {
  const only = ids !== null && ids.length > 0
  return {
    state: null,
    lane: null,
    route: only ? null : f.route.trim() || null,
    owner: only ? null : f.owner.trim() || null,
    workflow: null,
    error_class: only ? null : f.error_class.trim() || null,
    min_age_ms: only ? null : minAgeMs(f),
    max_age_ms: null,
    ids: only ? ids : null,
    limit: null,
  }
}

/** A filter in words, for what a bulk action covers. */
export function filterWords(f: InboxFilter): string {
  const parts = [
    f.route.trim() && `route ${f.route.trim()}`,
    f.owner.trim() && `owner ${f.owner.trim()}`,
    f.error_class.trim() && `error class or reason ${f.error_class.trim()}`,
    minAgeMs(f) !== null && `older than ${f.min_age_min.trim()} min`,
  ].filter((p): p is string => typeof p === 'string' && p !== '')
  return parts.length ? parts.join(', ') : 'no filter'
}

/** The routes a job's `fallback_policy` approves (`workflow@version: a, b`, or `none`). */
export function parseFallbacks(policy: string | null): string[] {
  if (!policy) return []
  const at = policy.lastIndexOf(': ')
  if (at < 0) return []
  return policy
    .slice(at + 2)
    .split(',')
    .map((r) => r.trim())
    .filter((r) => r !== '' && r !== 'none')
}

/** The route a job runs on next: its fallback when it has one, else its own. */
export function routeOf(j: JobView): string {
  return j.route_override ?? j.route_key
}

/** The inbox's filter bar; filters apply on the server when submitted. */
export function FilterBar({ value, onApply, withAge, label }: { value: InboxFilter; onApply: (f: InboxFilter) => void; withAge: boolean; label: string }) {
  const [draft, setDraft] = useState(value)
  return (
    <form className="search" role="search" aria-label={label} onSubmit={(e) => { e.preventDefault(); onApply(draft) }} data-testid="inbox-filter">
      <input aria-label="Route" placeholder="Route, e.g. openai/gpt-4o-mini" value={draft.route} onChange={(e) => setDraft({ ...draft, route: e.target.value })} data-testid="filter-route" />
      <input aria-label="Owner" placeholder="Owner" value={draft.owner} onChange={(e) => setDraft({ ...draft, owner: e.target.value })} data-testid="filter-owner" />
      <input aria-label="Error class or reason" placeholder="Error class or reason" list="job-filter-codes" value={draft.error_class}
        onChange={(e) => setDraft({ ...draft, error_class: e.target.value })} data-testid="filter-error-class" />
      <datalist id="job-filter-codes">{JOB_FILTER_CODES.map((c) => <option key={c} value={c} />)}</datalist>
      {withAge && (
        <input aria-label="Older than (minutes)" placeholder="Older than (min)" type="number" min={0} step="any" value={draft.min_age_min}
          onChange={(e) => setDraft({ ...draft, min_age_min: e.target.value })} data-testid="filter-min-age" />
      )}
      <button type="submit" data-testid="filter-apply">Filter</button>
      <button type="button" onClick={() => { setDraft(NO_FILTER); onApply(NO_FILTER) }}>Clear</button>
    </form>
  )
}

/** A job's facts, as a two-column table. */
export function JobFacts({ job: j, testid }: { job: JobView; testid: string }) {
  const facts: [string, string][] = [
    ['Job id', j.job_id],
    ['State', j.lane && j.lane !== j.state ? `${j.state} (lane ${j.lane})` : j.state],
    ['Why here', j.reason ? `${jobReason(j.reason)}${jobReason(j.reason) !== j.reason ? ` (${j.reason})` : ''}` : '—'],
    ['Workflow', `${j.workflow} (policy ${j.policy_version})`],
    ['Owner · key', `${j.owner_key} · ${j.key_name}`],
    ['Route', j.route_override ? `${j.route_override} (fallback from ${j.route_key})` : j.route_key],
    ['Model', j.served_model && j.served_model !== j.requested_model ? `${j.requested_model} (served ${j.served_model})` : j.requested_model],
    ['Fallbacks', j.fallback_policy ?? '—'],
    ['Priority', j.priority],
    ['Attempt', `${j.attempt} of ${j.max_attempts}`],
    ['Created', time(j.created_at)],
    ['Expires', time(j.expires_at)],
    ['Last status', j.last_status === null ? '—' : `HTTP ${j.last_status}`],
    ['Last error', j.last_error_type || j.last_error ? `${j.last_error_type ?? '—'}: ${j.last_error ?? ''}` : '—'],
    ['Idempotency-Key', j.idempotency_key],
    ['Estimated cost', money(j.estimated_cost_usd)],
    ['Spent so far', j.cost_usd === null ? '—' : money(j.cost_usd)],
    ['Partial output sent', j.partial_output_committed ? 'yes: the client saw part of an answer' : 'no'],
  ]
  if (j.replay_of) facts.push(['Replay of', j.replay_of])
  if (j.batch_id) facts.push(['Bulk replay', j.batch_id])
  return (
    <table className="grid facts" data-testid={testid}>
      <tbody>{facts.map(([k, v]) => <tr key={k}><th scope="row">{k}</th><td className="small wrap">{v}</td></tr>)}</tbody>
    </table>
  )
}

/** A job's runs: each a request through the gateway, with its attempts; its id opens its
 * ledger record. */
export function Runs({ evidence, testid }: { evidence: RequestDetail[]; testid: string }) {
  if (evidence.length === 0) {
    return <p className="muted small" data-testid={testid}>No run on record: the job never reached a provider.</p>
  }
  return (
    <table className="grid" data-testid={testid}>
      <thead>
        <tr>
          <th>#</th><th>Request</th><th>Started</th><th>State</th><th className="num">HTTP</th><th>Error class</th>
          <th className="num">Attempts</th><th>Each attempt</th><th>Message</th><th className="num">Cost</th>
        </tr>
      </thead>
      <tbody>
        {evidence.map(({ request: r, attempts }, i) => (
          <tr key={r.id} data-testid="run">
            <td>{i + 1}</td>
            <td className="mono small"><a {...linkProps({ view: 'ledger', id: r.id })} title="Open in the ledger">{r.id}</a></td>
            <td>{time(r.received_at)}</td>
            <td><span className={statePill(r.state)}>{r.state}</span></td>
            <td className="num">{r.http_status ?? '—'}</td>
            <td>{failureClass(r.error_class)}</td>
            <td className="num">{r.attempts}</td>
            <td className="small wrap">
              {attempts.length === 0
                ? '—'
                : attempts.map((a) => `#${a.attempt_no} ${a.channel}: ${failureClass(a.error_class)}${a.http_status !== null ? ` (HTTP ${a.http_status})` : ''}`).join(' · ')}
            </td>
            <td className="small wrap">{r.error_message ? trimmed(r.error_message, 160) : '—'}</td>
            <td className="num">{money(r.cost_usd)}</td>
          </tr>
        ))}
      </tbody>
    </table>
  )
}
