// Fixtures of recovery runs and scorecards for the recovery and scorecard tests: what the
// admin API returns, at a given step, with the fields a test cares about overridden.
import type { RecoveryList } from './bindings/RecoveryList'
import type { RecoveryStep } from './bindings/RecoveryStep'
import type { RecoverySummary } from './bindings/RecoverySummary'
import type { RecoveryView } from './bindings/RecoveryView'
import type { Scorecard } from './bindings/Scorecard'
import type { ScoreRow } from './bindings/ScoreRow'
import type { StepView } from './bindings/StepView'

export const now = Date.now()
export const RUN = 'rc_0000000000000001'
export const DRILL_RUN = 'rc_0000000000000002'
export const ROUTE = 'openai/gpt-4o-mini'
/** The incident began an hour ago. */
export const STARTED = now - 3600_000

const CHECKLIST: RecoveryStep[] = ['isolate', 'preserve', 'roll_back', 'confirm', 'resume', 'drain', 'close']

const CHECKS: Record<string, string> = {
  isolate: 'an operator isolates the route',
  preserve: 'an operator builds the evidence bundle',
  roll_back: 'an operator rolls back or says why not',
  confirm: '5 probes: 100 % success, P95 ≤ 1.5 × normal, 0 duplicates',
  resume: 'the 100 % stage has run its time',
  drain: 'backlog 0 and unknowns 0',
  close: 'an operator closes',
}

const EVIDENCE: Record<string, string> = {
  isolate: 'since the incident: 40 succeeded, 25 failed, 0 unknown',
  preserve: 'evidence: 65 requests, 18.2 KiB',
  roll_back: 'nothing to roll back: no policy changed',
  confirm: 'round 1: 5 of 5, P95 180 ms',
  resume: '25 % → 50 % → 100 %',
  drain: 'backlog 0, unknowns 0',
  close: 'closed',
}

/** Steps an operator does; the others the gateway ends by itself. */
const BY_HAND = new Set<RecoveryStep>(['isolate', 'preserve', 'roll_back', 'confirm', 'close'])

/** The checklist of a run at `step`: the earlier steps done by `who`, a minute apart. */
export function stepsAt(step: RecoveryStep, who = 'ana'): StepView[] {
  const current = step === 'closed' ? CHECKLIST.length : step === 'cancelled' ? -1 : CHECKLIST.indexOf(step)
  return CHECKLIST.map((s, i): StepView => {
    const done = current < 0 ? false : i < current
    return {
      step: s,
      status: done ? 'done' : i === current ? 'current' : 'pending',
      check: CHECKS[s],
      evidence: done ? EVIDENCE[s] : null,
      done_by: done && BY_HAND.has(s) ? who : null,
      done_at: done ? STARTED + (i + 1) * 60_000 : null,
    }
  })
}

export function scoreRow(over: Partial<ScoreRow> = {}): ScoreRow {
  return {
    route: ROUTE, requests: 1200, attempts: 1260, amplification: 1.05, success_rate: 0.97, post_retry_success_rate: 0.995,
    retries: 60, succeeded: 1194, failed: 6,
    p50_ms: 420, p95_ms: 1300, wait_p50_ms: 2, wait_p95_ms: 40, error_mix: [{ class: 'server_error', count: 30 }, { class: 'rate_limit', count: 6 }],
    cost_usd: 1.234, unpriced: 0, duplicates: 0, unknowns: 0,
    ...over,
  }
}

/** A run on ROUTE at `step` (isolate unless overridden), with the checklist to match. */
export function runOf(over: Partial<RecoveryView> = {}): RecoveryView {
  const step = over.step ?? 'isolate'
  return {
    id: RUN, route: ROUTE, drill: null, step, reason: 'provider 5xx storm, INC-42', opened_by: 'ana', opened_at: STARTED + 30_000,
    stages: [25, 50, 100], stage: null, stage_ms: 900_000, stage_started_at: null,
    concurrency_pct: step === 'isolate' ? 100 : 0, concurrency_cap: null, route_concurrency: 128, retries_on: step === 'isolate',
    stops: 0, held: false, approvals: [],
    steps: stepsAt(step),
    split: step === 'isolate' ? null : { since: STARTED, succeeded: 40, failed: 25, unknown: 0 },
    evidence: null, rollback_candidates: [], rollback: null,
    probes: [], probe_rounds: 0, normal_p95_ms: 200,
    recent: { outcomes: 0, server_errors: 0, rate_limited_for_ms: null, duplicates: 0, projected_day_usd: null, daily_budget_usd: null },
    stage_scores: [], overruns: [], backlog: 0, unknowns: 0,
    close_missing: ['customer contact not ticked'],
    incident: {
      started_at: STARTED, detected_at: STARTED + 20_000, stopped_at: step === 'isolate' ? null : STARTED + 90_000, recovered_at: null,
      resume_times: [], closed_at: null, closed_by: null, affected_requests: 25,
      first_error: { at: STARTED, request_id: 'req-first', error_class: 'server_error', message: 'HTTP 503 from openai-sim' },
      retries: 31, spend_usd: 0.0421, customer_impact: null, workarounds: null, customer_contacted: false, config_changes: [],
    },
    events: [
      { at: STARTED + 30_000, actor: 'ana', from: 'isolate', to: 'isolate', action: 'opened', reason: 'provider 5xx storm, INC-42', figures: [] },
    ],
    ...over,
  }
}

export function summaryOf(over: Partial<RecoverySummary> = {}): RecoverySummary {
  return {
    id: RUN, route: ROUTE, drill: null, step: 'isolate', stage_pct: null, held: false, opened_at: STARTED + 30_000, opened_by: 'ana',
    closed_at: null,
    ...over,
  }
}

export function listOf(over: Partial<RecoveryList> = {}): RecoveryList {
  return {
    runs: [],
    suggestions: [],
    drill_routes: [ROUTE, 'anthropic/claude-haiku-4-5'],
    scenarios: ['rate_limit_storm', 'server_errors', 'slow_provider', 'quota_exhausted', 'drops_after_completion'],
    probe_keys: ['demo', 'probe'],
    routes: [ROUTE, 'anthropic/claude-haiku-4-5'],
    ...over,
  }
}

export function scorecardOf(over: Partial<Scorecard> = {}): Scorecard {
  const incidentEnd = STARTED + 40 * 60_000
  return {
    run: RUN, drill: false, route: ROUTE,
    periods: [
      { name: 'before', from: STARTED - 28 * 86_400_000, to: STARTED, rows: [scoreRow({ requests: 400_000, success_rate: 0.999, error_mix: [] }), scoreRow({ route: 'overall', requests: 900_000 })] },
      { name: 'incident', from: STARTED, to: incidentEnd, rows: [scoreRow({ success_rate: 0.62, amplification: 2.4, unknowns: 2 }), scoreRow({ route: 'overall', requests: 5000 })] },
      { name: 'after', from: incidentEnd, to: incidentEnd + 3600_000, rows: [scoreRow({ requests: 300, duplicates: 1 }), scoreRow({ route: 'overall', requests: 2100 })] },
    ],
    flags: [
      { rule: 'amplification_over_2', route: ROUTE, detail: 'attempts ÷ requests reached 2.4 during the incident', decide: ['platform_operations'], escalation: false },
      { rule: 'duplicate_after_recovery', route: ROUTE, detail: '1 idempotency key completed twice after recovery', decide: ['platform_operations', 'business_owner'], escalation: true },
    ],
    ...over,
  }
}
