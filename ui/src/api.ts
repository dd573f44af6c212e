// The admin API client: every call carries the admin token; live updates come over a
// fetch-read event stream (EventSource cannot send an Authorization header).
import type { AuditEntry } from './bindings/AuditEntry'
import type { BreakerAction } from './bindings/BreakerAction'
import type { ChannelView } from './bindings/ChannelView'
import type { OperatorAction } from './bindings/OperatorAction'
import type { RouteControlView } from './bindings/RouteControlView'
import type { Overview } from './bindings/Overview'
import type { Page } from './bindings/Page'
import type { RequestDetail } from './bindings/RequestDetail'
import type { Search } from './bindings/Search'
import type { Tick } from './bindings/Tick'
import type { OperatorAlert } from './bindings/OperatorAlert'
import type { LedgerFigures } from './bindings/LedgerFigures'
import type { PruneAction } from './bindings/PruneAction'
import type { PruneReport } from './bindings/PruneReport'
import type { Reconcile } from './bindings/Reconcile'
import type { BulkReconcile } from './bindings/BulkReconcile'
import type { BulkReconciled } from './bindings/BulkReconciled'
import type { RequestRecord } from './bindings/RequestRecord'
import type { CostView } from './bindings/CostView'
import type { PricingView } from './bindings/PricingView'
import type { KeyView } from './bindings/KeyView'
import type { NewKey } from './bindings/NewKey'
import type { MadeKey } from './bindings/MadeKey'
import type { SpendLimitAction } from './bindings/SpendLimitAction'
import type { TopUp } from './bindings/TopUp'
import type { OwnerView } from './bindings/OwnerView'
import type { LanesView } from './bindings/LanesView'
import type { JobView } from './bindings/JobView'
import type { JobDetail } from './bindings/JobDetail'
import type { JobFilter } from './bindings/JobFilter'
import type { DeadLetterDetail } from './bindings/DeadLetterDetail'
import type { IdempotencyResult } from './bindings/IdempotencyResult'
import type { BulkPreview } from './bindings/BulkPreview'
import type { BulkRefused } from './bindings/BulkRefused'
import type { PoliciesView } from './bindings/PoliciesView'
import type { ApprovalRole } from './bindings/ApprovalRole'
import type { DrillScenario } from './bindings/DrillScenario'
import type { Overrun } from './bindings/Overrun'
import type { RecoveryList } from './bindings/RecoveryList'
import type { RecoveryView } from './bindings/RecoveryView'
import type { Scorecard } from './bindings/Scorecard'
import type { FleetView } from './bindings/FleetView'

export type Connection = { url: string; token: string }

export class ApiError extends Error {
  status: number
  /** The fields a refused form is missing, when the gateway names them (a 422 FormError). */
  missingFields: string[]
  /** The unmet conditions a refused action names (a recovery's close, O4: `missing`). */
  missing: string[]
  constructor(status: number, message: string, missingFields: string[] = [], missing: string[] = []) {
    super(message)
    this.status = status
    this.missingFields = missingFields
    this.missing = missing
  }
}

async function call<T>(conn: Connection, path: string, init?: RequestInit): Promise<T> {
  let resp: Response
  try {
    resp = await fetch(conn.url.replace(/\/$/, '') + path, {
      ...init,
      headers: { Authorization: `Bearer ${conn.token}`, ...(init?.headers ?? {}) },
    })
  } catch {
    throw new ApiError(0, `Cannot reach the gateway at ${conn.url}. Is spillway running?`)
  }
  if (!resp.ok) {
    let msg = `HTTP ${resp.status}`
    let missing: string[] = []
    let unmet: string[] = []
    try {
      const body = await resp.json()
      if (body && typeof body.error === 'string') msg = body.error
      if (body && Array.isArray(body.missing_fields)) missing = body.missing_fields.filter((f: unknown): f is string => typeof f === 'string')
      if (body && Array.isArray(body.missing)) unmet = body.missing.filter((f: unknown): f is string => typeof f === 'string')
    } catch {
      /* not JSON */
    }
    throw new ApiError(resp.status, msg, missing, unmet)
  }
  return (await resp.json()) as T
}

export const getOverview = (c: Connection) => call<Overview>(c, '/admin/v1/overview')

export function searchRequests(c: Connection, s: Search): Promise<Page> {
  const params = new URLSearchParams()
  for (const [k, v] of Object.entries(s)) {
    if (v !== null && v !== undefined && v !== '') params.set(k, String(v))
  }
  return call<Page>(c, `/admin/v1/requests?${params}`)
}

export const getRequest = (c: Connection, id: string) =>
  call<RequestDetail>(c, `/admin/v1/requests/${encodeURIComponent(id)}`)

const post = (body: unknown): RequestInit => ({
  method: 'POST',
  headers: { 'Content-Type': 'application/json' },
  body: JSON.stringify(body),
})

/** E2, D5: put an ejected, paced or cooling channel back into rotation, on the record. */
export const restoreChannel = (c: Connection, name: string, action: OperatorAction) =>
  call<ChannelView>(c, `/admin/v1/channels/${encodeURIComponent(name)}/restore`, post(action))

/** G4: open or close a route's breaker by hand, with who and why. */
export const setBreaker = (c: Connection, open: boolean, action: BreakerAction) =>
  call<RouteControlView>(c, `/admin/v1/breakers/${open ? 'open' : 'close'}`, post(action))

/** G4: the audit log, newest first. */
export function getAudit(c: Connection, kind: string | null, subject: string | null, limit = 50): Promise<AuditEntry[]> {
  const p = new URLSearchParams({ limit: String(limit) })
  if (kind) p.set('kind', kind)
  if (subject) p.set('subject', subject)
  return call<AuditEntry[]>(c, `/admin/v1/audit?${p}`)
}

/** I4: requests whose outcome is unknown, newest first, each with its attempts. */
export const getUnknowns = (c: Connection, limit = 100) =>
  call<RequestDetail[]>(c, `/admin/v1/unknowns?limit=${limit}`)

/** I4: an owner's verdict on one unknown request, on the audit log. */
export const reconcile = (c: Connection, id: string, r: Reconcile) =>
  call<RequestRecord>(c, `/admin/v1/requests/${encodeURIComponent(id)}/reconcile`, post(r))

/** I4 in bulk: a checked selection confirmed as not executed, one reason for all. */
export const reconcileBulk = (c: Connection, b: BulkReconcile) =>
  call<BulkReconciled>(c, '/admin/v1/unknowns/reconcile', post(b))

/** N1, I6: unknowns and duplicates per route, the ledger's size, computed now. */
export const getLedgerFigures = (c: Connection) => call<LedgerFigures>(c, '/admin/v1/ledger')

/** I6: prunes expired response copies (and old finished requests when asked), audited. */
export const pruneLedger = (c: Connection, a: PruneAction) => call<PruneReport>(c, '/admin/v1/ledger/prune', post(a))

/** M1–M3, B3–B5: spend by bucket, owner, key, route and model over the last `hours`, with
 * the owners' balances, the keys, the route budgets and the pricing catalog. */
export const getCosts = (c: Connection, hours: number) => call<CostView>(c, `/admin/v1/costs?hours=${hours}`)

/** M1: the pricing catalog in force. */
export const getPricing = (c: Connection) => call<PricingView>(c, '/admin/v1/pricing')

/** B5: every key, from the config and made here, revoked ones included. */
export const getKeys = (c: Connection) => call<KeyView[]>(c, '/admin/v1/keys')

/** B5: makes a key; its secret is in the answer this once. */
export const createKey = (c: Connection, k: NewKey) => call<MadeKey>(c, '/admin/v1/keys', post(k))

/** B5: revokes a key made here (config keys are removed from the config). */
export const revokeKey = (c: Connection, name: string, a: OperatorAction) =>
  call<KeyView>(c, `/admin/v1/keys/${encodeURIComponent(name)}/revoke`, post(a))

/** B3: sets or lifts (null) a key's spend limit. */
export const setSpendLimit = (c: Connection, name: string, a: SpendLimitAction) =>
  call<KeyView>(c, `/admin/v1/keys/${encodeURIComponent(name)}/spend-limit`, post(a))

/** B4: adds money to an owner's balance (a deficit is taken from it first). */
export const topUp = (c: Connection, owner: string, t: TopUp) =>
  call<OwnerView>(c, `/admin/v1/owners/${encodeURIComponent(owner)}/top-up`, post(t))

/** J1, J7: lane depths per route and per workflow. */
export const getLanes = (c: Connection) => call<LanesView>(c, '/admin/v1/lanes')

/** The job lists' server-side filters; empty ones are left out of the query. */
export type JobQuery = {
  state?: string | null
  lane?: string | null
  route?: string | null
  owner?: string | null
  workflow?: string | null
  /** The last error's class, or the reason the job is in its lane. */
  error_class?: string | null
  min_age_ms?: number | null
  max_age_ms?: number | null
  limit?: number | null
}

function jobQuery(q: JobQuery): string {
  const p = new URLSearchParams()
  for (const [k, v] of Object.entries(q)) {
    if (v !== null && v !== undefined && v !== '') p.set(k, String(v))
  }
  const s = p.toString()
  return s ? `?${s}` : ''
}

/** J1: jobs, open ones and recently ended ones, newest first. */
export const getJobs = (c: Connection, q: JobQuery) => call<JobView[]>(c, `/admin/v1/jobs${jobQuery(q)}`)

/** A job with its runs (requests and their attempts). */
export const getJob = (c: Connection, id: string) => call<JobDetail>(c, `/admin/v1/jobs/${encodeURIComponent(id)}`)

/** K3: the owner-review inbox, newest first. */
export const getReviews = (c: Connection, q: JobQuery) => call<JobView[]>(c, `/admin/v1/reviews${jobQuery(q)}`)

/** K3: an owner's approval; `route` null keeps the job's route. */
export type ApproveForm = { reviewer: string; reason: string; route: string | null }
export type RejectForm = { reviewer: string; reason: string }

export const approveReview = (c: Connection, id: string, f: ApproveForm) =>
  call<JobView>(c, `/admin/v1/reviews/${encodeURIComponent(id)}/approve`, post(f))

export const rejectReview = (c: Connection, id: string, f: RejectForm) =>
  call<JobView>(c, `/admin/v1/reviews/${encodeURIComponent(id)}/reject`, post(f))

/** L1: the dead-letter inbox, newest first. */
export const getDeadLetters = (c: Connection, q: JobQuery) => call<JobView[]>(c, `/admin/v1/dead-letters${jobQuery(q)}`)

/** L1: a dead letter with its evidence, idempotency result, estimates and route choices. */
export const getDeadLetter = (c: Connection, id: string) =>
  call<DeadLetterDetail>(c, `/admin/v1/dead-letters/${encodeURIComponent(id)}`)

/** Why an owner replays dead letters (L1). */
export const REPLAY_REASONS = ['provider_recovered', 'product_bug_fixed', 'quota_changed', 'owner_override'] as const
export type ReplayReasonKind = (typeof REPLAY_REASONS)[number]
export type ReplayReason = { kind: ReplayReasonKind; text: string }

/** L1: the reviewed replay form; every field is required. */
export type ReplayForm = {
  replay_owner: string
  replay_reason: ReplayReason
  route_override: string
  /** As the form showed it: the gateway refuses the replay if the ledger now says otherwise. */
  idempotency_result: IdempotencyResult
  /** The chosen route's estimate as shown; null when it was shown as unknown. */
  cost_reviewed: { estimated_cost_usd: number | null }
}
export type Replayed = { job_id: string; replay_of: string; status_url: string }

export const replayDeadLetter = (c: Connection, id: string, f: ReplayForm) =>
  call<Replayed>(c, `/admin/v1/dead-letters/${encodeURIComponent(id)}/replay`, post(f))

/** L2: what a bulk replay over `filter` would do. */
export const previewBulkReplay = (c: Connection, filter: JobFilter) =>
  call<BulkPreview>(c, '/admin/v1/dead-letters/replay-preview', post({ filter }))

/** L2: a bulk replay, each job on its own route, with the previewed total and a stop condition. */
export type BulkReplayForm = {
  filter: JobFilter
  replay_owner: string
  replay_reason: ReplayReason
  cost_reviewed: { total_estimated_cost_usd: number | null; count: number }
  stop_after_failures: number
}
export type BulkReplayed = {
  batch_id: string
  replayed: { dead_letter: string; job_id: string }[]
  refused: BulkRefused[]
  stop_after_failures: number
  total_estimated_cost_usd: number | null
}

export const bulkReplay = (c: Connection, f: BulkReplayForm) => call<BulkReplayed>(c, '/admin/v1/dead-letters/replay', post(f))

/** J8: the workflow policies in force, their recorded versions and invalid edits. */
export const getPolicies = (c: Connection) => call<PoliciesView>(c, '/admin/v1/policies')

export type PolicyText = { workflow: string; version: string; source: string; loaded_at: number; text: string }

/** J8: one recorded version's text. */
export const getPolicyText = (c: Connection, workflow: string, version: string) =>
  call<PolicyText>(c, `/admin/v1/policies/${encodeURIComponent(workflow)}/versions/${encodeURIComponent(version)}`)

export type RollbackForm = { version: string; actor: string; reason: string }

/** J8: puts a recorded version back (written to the workflow's file and applied). */
export const rollbackPolicy = (c: Connection, workflow: string, f: RollbackForm) =>
  call<{ workflow: string; version: string }>(c, `/admin/v1/policies/${encodeURIComponent(workflow)}/rollback`, post(f))

/** O1: the recovery runs (open ones and ended ones), the routes a run is suggested for, the
 * routes a drill may run on, the scenarios and the probe keys. */
export const getRecoveries = (c: Connection) => call<RecoveryList>(c, '/admin/v1/recoveries')

/** O1, N3: `drill` set makes it a drill (refused on a route with a real provider). */
export type StartRecoveryForm = { route: string; actor: string; reason: string; drill?: DrillScenario; key?: string }

export const startRecovery = (c: Connection, f: StartRecoveryForm) => call<RecoveryView>(c, '/admin/v1/recoveries', post(f))

export const getRecovery = (c: Connection, id: string) => call<RecoveryView>(c, `/admin/v1/recoveries/${encodeURIComponent(id)}`)

const recovery = (id: string, action: string) => `/admin/v1/recoveries/${encodeURIComponent(id)}/${action}`

/** O1 isolate: retries off, the route paused, the ledger split since the incident began. */
export const isolateRecovery = (c: Connection, id: string, f: { actor: string }) =>
  call<RecoveryView>(c, recovery(id, 'isolate'), post(f))

/** O1 preserve: builds the evidence bundle (no secret, no prompt). */
export const preserveRecovery = (c: Connection, id: string, f: { actor: string }) =>
  call<RecoveryView>(c, recovery(id, 'preserve'), post(f))

/** O1 roll back: one workflow to its last known good version; without `workflow`, the
 * reason why there is nothing to roll back. */
export type RecoveryRollbackForm = { actor: string; reason: string; workflow?: string; version?: string }

export const rollbackRecovery = (c: Connection, id: string, f: RecoveryRollbackForm) =>
  call<RecoveryView>(c, recovery(id, 'rollback'), post(f))

/** O1 confirm: a round of 5 probes, one at a time, as the named key. */
export const runRecoveryProbes = (c: Connection, id: string, f: { actor: string; key: string }) =>
  call<RecoveryView>(c, recovery(id, 'probes'), post(f))

/** O3: one of the two approvals a held run needs. */
export const approveRecovery = (c: Connection, id: string, f: { actor: string; role: ApprovalRole; reason: string }) =>
  call<RecoveryView>(c, recovery(id, 'approve'), post(f))

/** O4: why a job's deadline was missed. */
export const explainOverrun = (c: Connection, id: string, f: { actor: string; overrun: Overrun['id']; explanation: string }) =>
  call<RecoveryView>(c, recovery(id, 'explain'), post(f))

export type CloseRecoveryForm = { actor: string; customer_contacted: boolean; customer_impact: string; workarounds: string }

/** O4: closes the run; refused (409, `ApiError.missing`) while a condition is unmet. */
export const closeRecovery = (c: Connection, id: string, f: CloseRecoveryForm) =>
  call<RecoveryView>(c, recovery(id, 'close'), post(f))

/** Stops a run before its end: the gate is lifted, the record kept. */
export const cancelRecovery = (c: Connection, id: string, f: { actor: string; reason: string }) =>
  call<RecoveryView>(c, recovery(id, 'cancel'), post(f))

/** N3, drills only: a 5xx burst on the drill's simulated channels, to practise a step-back. */
export const relapseRecovery = (c: Connection, id: string, f: { actor: string }) =>
  call<RecoveryView>(c, recovery(id, 'relapse'), post(f))

/** The run's files: the evidence bundle, the report in Markdown and as JSON. */
export const RECOVERY_FILES = { evidence: 'evidence', markdown: 'report.md', json: 'report.json' } as const
export type RecoveryFile = keyof typeof RECOVERY_FILES

/** A file the gateway serves as an attachment. A plain link cannot carry the admin token,
 * so the console fetches it and hands the browser the bytes. */
export type Download = { blob: Blob; filename: string }

export async function getRecoveryFile(c: Connection, id: string, file: RecoveryFile): Promise<Download> {
  let resp: Response
  try {
    resp = await fetch(c.url.replace(/\/$/, '') + recovery(id, RECOVERY_FILES[file]), { headers: { Authorization: `Bearer ${c.token}` } })
  } catch {
    throw new ApiError(0, `Cannot reach the gateway at ${c.url}. Is spillway running?`)
  }
  if (!resp.ok) {
    let msg = `HTTP ${resp.status}`
    try {
      const body = await resp.json()
      if (body && typeof body.error === 'string') msg = body.error
    } catch {
      /* not JSON */
    }
    throw new ApiError(resp.status, msg)
  }
  const fallback = `recovery-${id}-${file === 'evidence' ? 'evidence.json' : RECOVERY_FILES[file]}`
  return { blob: await resp.blob(), filename: attachmentName(resp.headers.get('Content-Disposition')) ?? fallback }
}

/** The file name a `Content-Disposition: attachment` header gives, if any. */
export function attachmentName(header: string | null): string | null {
  if (!header) return null
  const star = /filename\*\s*=\s*(?:UTF-8|utf-8)''([^;]+)/.exec(header)
  if (star) {
    try {
      return decodeURIComponent(star[1].trim())
    } catch {
      /* fall through to the plain name */
    }
  }
  const plain = /filename\s*=\s*"([^"]*)"|filename\s*=\s*([^;]+)/.exec(header)
  const name = plain ? (plain[1] ?? plain[2] ?? '').trim() : ''
  // Only a base name: a path in the header must not pick where the file lands.
  const base = name.split(/[\\/]/).pop() ?? ''
  return base === '' ? null : base
}

/** N2: the scorecard of a run, or of a route. */
export function getScorecard(c: Connection, of: { run: string } | { route: string }): Promise<Scorecard> {
  const p = new URLSearchParams('run' in of ? { run: of.run } : { route: of.route })
  return call<Scorecard>(c, `/admin/v1/scorecard?${p}`)
}

/** R1, R2: the fleet's instances with their heartbeats and load, and Redis's state, as the
 * instance answering knows them (from its memory: no ledger query per read). */
export const getFleet = (c: Connection) => call<FleetView>(c, '/admin/v1/fleet')

export type LiveEvent =
  | { kind: 'overview'; data: Overview }
  | { kind: 'tick'; data: Tick }
  | { kind: 'alert'; data: OperatorAlert }

/** Reads the admin event stream until `signal` aborts; reconnects are the caller's. */
export async function streamEvents(c: Connection, onEvent: (e: LiveEvent) => void, signal: AbortSignal) {
  const resp = await fetch(c.url.replace(/\/$/, '') + '/admin/v1/events', {
    headers: { Authorization: `Bearer ${c.token}`, Accept: 'text/event-stream' },
    signal,
  }).catch(() => {
    throw new ApiError(0, `Cannot reach the gateway at ${c.url}. Is spillway running?`)
  })
  if (!resp.ok || !resp.body) {
    let msg = `HTTP ${resp.status}`
    try {
      msg = (await resp.json()).error ?? msg
    } catch {
      /* not JSON */
    }
    throw new ApiError(resp.status, msg)
  }
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader()
  let buf = ''
  for (;;) {
    const { value, done } = await reader.read()
    if (done) return
    buf += value.replace(/\r\n?/g, '\n')
    let end
    while ((end = buf.indexOf('\n\n')) >= 0) {
      const frame = buf.slice(0, end)
      buf = buf.slice(end + 2)
      let event = 'message'
      const data: string[] = []
      for (const line of frame.split('\n')) {
        if (line.startsWith('event:')) event = line.slice(6).trim()
        else if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''))
      }
      if (!data.length) continue
      const parsed = JSON.parse(data.join('\n'))
      if (event === 'overview' || event === 'tick' || event === 'alert') onEvent({ kind: event, data: parsed } as LiveEvent)
    }
  }
}
