// Numbers with units, the way an operator reads them at 3 a.m.

export function ms(v: number | null | undefined): string {
  if (v === null || v === undefined || Number.isNaN(v)) return '—'
  if (v < 1) return '<1 ms'
  if (v < 1000) return `${Math.round(v)} ms`
  if (v < 60_000) return `${(v / 1000).toFixed(v < 10_000 ? 2 : 1)} s`
  return `${Math.floor(v / 60_000)} min ${Math.round((v % 60_000) / 1000)} s`
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
  const s = v < 0.01 && v > 0 ? '<$0.01' : `$${v.toFixed(2)}`
  return unknown > 0 ? `${s} + ${unknown} unpriced` : s
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

/** Failed attempts by class, biggest first, as `server_error 3 · rate_limit 1`. */
export function errorMix(byClass: { [key in string]?: number }): string {
  const parts = Object.entries(byClass)
    .filter((e): e is [string, number] => typeof e[1] === 'number' && e[1] > 0)
    .sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]))
  if (parts.length === 0) return 'none'
  return parts.map(([k, v]) => `${k.replace(/_/g, ' ')} ${count(v)}`).join(' · ')
}

/** What happened after an attempt, in words (F2 decisions). */
export function decision(d: string | null, reason: string | null, delayMs: number | null): string {
  const why = reason ? ` (${reason.replace(/_/g, ' ')})` : ''
  switch (d) {
    case null:
      return ''
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
    default:
      return d + why
  }
}
