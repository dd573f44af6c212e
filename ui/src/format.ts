import type { BreakerState } from './bindings/BreakerState'
import type { Decision } from './bindings/Decision'
import type { ErrorClass } from './bindings/ErrorClass'
import type { FailureClass } from './bindings/FailureClass'
import type { GatewayClass } from './bindings/GatewayClass'
import type { RejectReason } from './bindings/RejectReason'
import type { RequestState } from './bindings/RequestState'
import type { RotationState } from './bindings/RotationState'
import type { Severity } from './bindings/Severity'
import type { StopReason } from './bindings/StopReason'
import type { Trigger } from './bindings/Trigger'
import type { Api } from './bindings/Api'

// Numbers with units, the way an operator reads them at 3 a.m.

export function ms(v: number | null | undefined): string {
  if (v === null || v === undefined || Number.isNaN(v)) return '—'
  if (v < 1) return '<1 ms'
  if (v < 1000) return `${Math.round(v)} ms`
  if (v < 60_000) return `${(v / 1000).toFixed(v < 10_000 ? 2 : 1)} s`
  return `${Math.floor(v / 60_000)} min ${Math.round((v % 60_000) / 1000)} s`
}

/** A span of time for states that last: `45 s`, `3 min 20 s`, `2 h 5 min`. */
export function duration(v: number | null | undefined): string {
  if (v === null || v === undefined || Number.isNaN(v)) return '—'
  const s = Math.floor(v / 1000)
  if (s < 60) return `${s} s`
  if (s < 3600) return `${Math.floor(s / 60)} min${s % 60 ? ` ${s % 60} s` : ''}`
  return `${Math.floor(s / 3600)} h${Math.floor((s % 3600) / 60) ? ` ${Math.floor((s % 3600) / 60)} min` : ''}`
}

export function rate(v: number | null | undefined): string {
  if (v === null || v === undefined) return '—'
  if (v < 10) return `${v.toFixed(1)} req/s`
  return `${Math.round(v)} req/s`
}

/** A ratio 0–1 as a percentage, clamped: a figure can never exceed its bounds. */
export function pct(v: number | null | undefined): string {
  if (v === null || v === undefined || Number.isNaN(v)) return '—'
  const p = Math.min(1, Math.max(0, v)) * 100
  if (p === 0) return '0 %'
  if (p < 0.1) return '<0.1 %'
  return `${p < 10 ? p.toFixed(1) : Math.round(p)} %`
}

export function usd(v: number | null | undefined, unknown = 0): string {
  if (v === null || v === undefined) return 'unknown'
  // A request costs fractions of a cent: the route's figure keeps that precision.
  const s = money(v)
  return unknown > 0 ? `${s} + ${unknown} unpriced` : s
}

/** Money to the precision it matters at: 4 decimals under $1 (a request costs fractions of
 * a cent), 2 above; a deficit keeps its sign; unknown is never shown as zero. */
export function money(v: number | null | undefined): string {
  if (v === null || v === undefined || Number.isNaN(v)) return 'unknown'
  const a = Math.abs(v)
  const sign = v < 0 ? '-' : ''
  if (a === 0) return '$0.00'
  if (a < 0.0001) return `${sign === '-' ? '>-' : '<'}$0.0001`
  if (a < 1) return `${sign}$${a.toFixed(4)}`
  return `${sign}$${a.toLocaleString('en-US', { minimumFractionDigits: 2, maximumFractionDigits: 2 })}`
}

export function count(v: number | null | undefined): string {
  if (v === null || v === undefined) return '—'
  return v.toLocaleString('en-US')
}

export function time(msSinceEpoch: number | null | undefined): string {
  if (!msSinceEpoch) return '—'
  const d = new Date(msSinceEpoch)
  return d.toISOString().replace('T', ' ').replace('Z', ' UTC')
}

export function since(from: number | null | undefined, to: number | null | undefined): string {
  if (!from || !to) return '—'
  return ms(to - from)
}

/** Every class a request or an attempt can end with, in words (exhaustive: a new class
 * in the Rust enum fails the type check here until it has its words). */
const ERROR_CLASS: Record<ErrorClass, string> = {
  success: 'success',
  rate_limit: 'rate limit',
  quota: 'quota',
  overload: 'overload',
  server_error: 'server error',
  transient: 'transient',
  timeout: 'timeout',
  unreachable: 'unreachable',
  auth: 'credential refused',
  invalid_request: 'invalid request',
  stream_interrupted: 'stream interrupted',
  malformed_response: 'malformed response',
  unknown: 'unknown outcome',
}

const GATEWAY_CLASS: Record<GatewayClass, string> = {
  client_auth: 'no valid key',
  invalid_body: 'invalid body',
  unsupported_media_type: 'not JSON',
  payload_too_large: 'body too large',
  body_timeout: 'body too slow',
  no_channel: 'no channel for the model',
  capacity_busy: 'capacity busy',
  capacity_queue_full: 'capacity queue full',
  key_limited: 'key limit',
  no_channel_in_rotation: 'no channel in rotation',
  breaker_open: 'breaker open',
  channels_cooling_down: 'channels cooling down',
  ledger_unavailable: 'ledger unavailable',
  client_disconnected: 'client disconnected',
  client_stalled: 'client stopped reading',
  shutdown: 'gateway shutting down',
  interrupted: 'cut by a stop (outcome unknown)',
  internal_error: 'gateway bug (panic)',
  idempotency_key_reused: 'Idempotency-Key reused with another body',
  idempotency_in_progress: 'Idempotency-Key still in progress',
  idempotency_unknown: 'Idempotency-Key outcome unknown',
  idempotency_completed: 'Idempotency-Key completed, response not kept',
  insufficient_balance: 'owner balance spent',
  spend_limit: 'key spend limit reached',
  daily_budget: 'owner daily budget spent',
  lane_full: 'job lane full',
  recovery_hold: 'held by a recovery run',
}

export function failureClass(c: FailureClass | null): string {
  if (c === null) return '—'
  return c in ERROR_CLASS ? ERROR_CLASS[c as ErrorClass] : GATEWAY_CLASS[c as GatewayClass]
}

/** Failed attempts by class, biggest first, as `server error 3 · rate limit 1`. */
export function errorMix(byClass: { [key in ErrorClass]?: number }): string {
  const parts = (Object.entries(byClass) as [ErrorClass, number | undefined][])
    .filter((e): e is [ErrorClass, number] => typeof e[1] === 'number' && e[1] > 0)
    .sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]))
  if (parts.length === 0) return 'none'
  return parts.map(([k, v]) => `${ERROR_CLASS[k]} ${count(v)}`).join(' · ')
}

const STOP: Record<StopReason, string> = {
  partial_output_committed: 'output already reached the client',
  attempt_budget_exhausted: 'attempt budget exhausted',
  retry_after_exceeds_deadline: "the provider's wait is past the deadline",
  not_retryable: 'not retryable',
  no_channel_left: 'no channel left',
  client_gone: 'the client went away',
  interrupted: 'the gateway stopped during the call',
  retry_budget_exhausted: "the route's retry budget was spent",
  breaker_open: "the route's breaker opened",
  provider_may_have_acted: 'the provider may already have acted (a hosted tool or background run)',
  lane_full: 'the stream-recovery lane was full',
  recovery_hold: 'a recovery run holds the route: retries off',
}

/** What happened after an attempt, in words (F2 decisions). */
export function decision(d: Decision | null, reason: StopReason | null, delayMs: number | null): string {
  const why = reason ? ` (${STOP[reason]})` : ''
  if (d === null) return ''
  switch (d) {
    case 'done':
      return 'answered'
    case 'failover':
      return 'failed over to another channel'
    case 'retry':
      return delayMs ? `retried after ${ms(delayMs)}` : 'retried at once'
    case 'wait':
      return `queued for ${ms(delayMs)} (wait hint over 2 s), then retried`
    case 'fail_closed':
      return `stopped${why}`
    case 'passed_through':
      return `provider's answer returned as sent${why}`
  }
}

/** The pill colour of a channel's rotation. */
export function rotationPill(s: RotationState): string {
  switch (s) {
    case 'ready':
      return 'pill ok'
    case 'paced':
    case 'recovering':
      return 'pill warn'
    case 'ejected':
    case 'cooling':
      return 'pill bad'
  }
}

/** The pill colour of a request's state. */
export function statePill(s: RequestState): string {
  switch (s) {
    case 'done':
      return 'pill ok'
    case 'failed':
    case 'unknown':
      return 'pill bad'
    case 'received':
    case 'calling_api':
    case 'api_completed':
    case 'side_effect_pending':
      return 'pill warn'
  }
}

export function severityClass(s: Severity): string {
  switch (s) {
    case 'critical':
      return 'error'
    case 'warning':
      return 'warn-text'
    case 'resolved':
      return 'ok-text'
  }
}

const API: Record<Api, string> = {
  generate: 'chat',
  responses: 'responses',
  embeddings: 'embeddings',
  count_tokens: 'token count',
}

/** What a request asks of the provider, as the console labels it. */
export function apiLabel(a: Api): string {
  return API[a]
}

/** Every API, in the order the console lists them. */
export const APIS = Object.keys(API) as Api[]

const REJECT: Record<RejectReason, string> = {
  missing_key: 'no key',
  invalid_key: 'unknown key',
  forbidden_host: 'foreign Host name',
  ledger_unavailable: 'ledger refusing writes',
}

export function rejectReason(r: RejectReason): string {
  return REJECT[r]
}

/** The pill colour of a breaker. */
export function breakerPill(s: BreakerState): string {
  switch (s) {
    case 'closed':
      return 'pill ok'
    case 'probation':
      return 'pill warn'
    case 'open':
      return 'pill bad'
  }
}

const TRIGGER: Record<Trigger, string> = {
  server_errors: '5xx from the provider',
  rate_limited: '429s for 3 min',
  slow_wait: 'capacity wait over SLO',
  cost: 'cost over budget',
  cool_down_over: 'cool-down over',
  probe_failed: 'probe failed',
  probe_slow: 'probes too slow',
  probe_duplicate: 'probe ran twice',
  probation_passed: 'probation passed',
  operator: 'operator',
}

/** A breaker transition's trigger (as the audit log stores it), in words. */
export function trigger(t: string | null): string {
  if (!t) return '—'
  return t in TRIGGER ? TRIGGER[t as Trigger] : t
}

/** Bytes as an operator reads them. */
export function bytes(v: number | null | undefined): string {
  if (v === null || v === undefined) return '—'
  if (v < 1024) return `${v} B`
  if (v < 1024 * 1024) return `${(v / 1024).toFixed(1)} KiB`
  if (v < 1024 * 1024 * 1024) return `${(v / (1024 * 1024)).toFixed(1)} MiB`
  return `${(v / (1024 * 1024 * 1024)).toFixed(2)} GiB`
}

/** How long ago `at` was, from `now`, coarsely (an inbox's oldest item). */
export function age(at: number | null | undefined, now: number): string {
  if (at === null || at === undefined) return '—'
  const s = Math.max(0, Math.round((now - at) / 1000))
  if (s < 90) return `${s} s`
  if (s < 90 * 60) return `${Math.round(s / 60)} min`
  if (s < 48 * 3600) return `${Math.round(s / 3600)} h`
  return `${Math.round(s / 86400)} d`
}

/** Why a background job is in its lane (J6's triggers, as the gateway records them), in words. */
const JOB_REASON: Record<string, string> = {
  quota_or_spend_exhausted: 'quota or spend exhausted',
  permission_denied: 'permission denied',
  data_boundary_mismatch: 'data boundary mismatch',
  fallback_contract_unknown: 'fallback contract unknown',
  fallback_contract_mismatch: 'fallback contract does not hold',
  unknown_signal: 'an answer the gateway cannot classify',
  max_attempts_exhausted: 'attempts exhausted',
  max_queue_age_exceeded: 'too old: queue age exceeded',
  partial_output_committed: 'partial output already sent',
  outcome_unknown: 'outcome unknown',
  retry_after_exceeds_deadline: "the provider's wait is past the job's deadline",
  bulk_replay_stopped: 'its bulk replay stopped before running it',
  provider_may_have_acted: 'the provider may have acted before the run failed (replay by owner override only)',
  invalid_request: 'invalid request',
}

/** The reasons and classes a job list can be filtered by, for the filter's suggestions. */
export const JOB_FILTER_CODES: string[] = [...new Set([
  ...Object.keys(JOB_REASON),
  ...Object.keys(ERROR_CLASS).filter((c) => c !== 'success'),
])]

export function jobReason(r: string | null | undefined): string {
  if (!r) return '—'
  return JOB_REASON[r] ?? r
}

/** `text` cut to `max` characters, with an ellipsis when cut. */
export function trimmed(text: string, max: number): string {
  return text.length > max ? `${text.slice(0, Math.max(0, max - 1))}…` : text
}

/** A job's last error as `class: message`, trimmed (Sidekiq's dead set shows it so). */
export function lastError(type: string | null, message: string | null, max = 90): string {
  if (!type && !message) return '—'
  if (!type) return trimmed(message ?? '', max)
  if (!message) return type
  return trimmed(`${type}: ${message.replace(/\s+/g, ' ')}`, max)
}
