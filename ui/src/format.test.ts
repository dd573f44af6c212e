import { describe, expect, it } from 'vitest'
import { count, decision, errorMix, failureClass, jobReason, lastError, money, ms, pct, rate, rotationPill, usd } from './format'

describe('units', () => {
  it('formats latency with units', () => {
    expect(ms(null)).toBe('—')
    expect(ms(0.4)).toBe('<1 ms')
    expect(ms(42.4)).toBe('42 ms')
    expect(ms(1500)).toBe('1.50 s')
    expect(ms(125_000)).toBe('2 min 5 s')
  })
  it('never shows a percentage out of bounds', () => {
    expect(pct(1.7)).toBe('100 %')
    expect(pct(-0.2)).toBe('0 %')
    expect(pct(0.0004)).toBe('<0.1 %')
    expect(pct(0.123)).toBe('12 %')
    expect(pct(null)).toBe('—')
  })
  it('says unknown cost instead of zero', () => {
    expect(usd(null)).toBe('unknown')
    expect(usd(0, 3)).toBe('$0.00 + 3 unpriced')
    expect(usd(12.345)).toBe('$12.35')
    expect(usd(0.00123)).toBe('$0.0012')
  })
  it('shows money with 4 decimals under a dollar and 2 above, deficits signed', () => {
    expect(money(null)).toBe('unknown')
    expect(money(0)).toBe('$0.00')
    expect(money(0.12345)).toBe('$0.1235')
    expect(money(0.5)).toBe('$0.5000')
    expect(money(0.00001)).toBe('<$0.0001')
    expect(money(1)).toBe('$1.00')
    expect(money(12.345)).toBe('$12.35')
    expect(money(1234.5)).toBe('$1,234.50')
    expect(money(-2.5)).toBe('-$2.50')
    expect(money(-0.25)).toBe('-$0.2500')
  })
  it('formats rates and counts', () => {
    expect(rate(0.25)).toBe('0.3 req/s')
    expect(rate(1234.4)).toBe('1234 req/s')
    expect(count(1234567)).toBe('1,234,567')
  })
})

describe('failover words', () => {
  it('orders the error mix biggest first and says none when clean', () => {
    expect(errorMix({})).toBe('none')
    expect(errorMix({ rate_limit: 1, server_error: 3, overload: 0 })).toBe('server error 3 · rate limit 1')
  })
  it('says what happened after each attempt', () => {
    expect(decision('failover', null, 0)).toBe('failed over to another channel')
    expect(decision('retry', null, 0)).toBe('retried at once')
    expect(decision('retry', null, 850)).toBe('retried after 850 ms')
    expect(decision('wait', null, 3000)).toBe('queued for 3.00 s (wait hint over 2 s), then retried')
    expect(decision('fail_closed', 'retry_after_exceeds_deadline', null)).toBe("stopped (the provider's wait is past the deadline)")
    expect(decision('fail_closed', 'interrupted', null)).toBe('stopped (the gateway stopped during the call)')
    expect(decision('passed_through', 'not_retryable', null)).toBe("provider's answer returned as sent (not retryable)")
    expect(decision(null, null, null)).toBe('')
  })
  it('names every class, upstream or the gateway\'s own', () => {
    expect(failureClass('overload')).toBe('overload')
    expect(failureClass('client_stalled')).toBe('client stopped reading')
    expect(failureClass('interrupted')).toBe('cut by a stop (outcome unknown)')
    expect(failureClass(null)).toBe('—')
    expect(rotationPill('ejected')).toBe('pill bad')
  })
})

describe('background jobs', () => {
  it('shows a job\'s last error as class: message, trimmed', () => {
    expect(lastError('overload', 'HTTP 503\n  from openai-sim')).toBe('overload: HTTP 503 from openai-sim')
    expect(lastError('server_error', 'x'.repeat(200), 40)).toHaveLength(40)
    expect(lastError('server_error', 'x'.repeat(200), 40).endsWith('…')).toBe(true)
    expect(lastError(null, null)).toBe('—')
    expect(lastError('quota', null)).toBe('quota')
  })
  it('says why a job is in its lane in words, and passes unknown reasons through', () => {
    expect(jobReason('quota_or_spend_exhausted')).toBe('quota or spend exhausted')
    expect(jobReason('max_attempts_exhausted')).toBe('attempts exhausted')
    expect(jobReason('fallback to openai/gpt-4o')).toBe('fallback to openai/gpt-4o')
    expect(jobReason(null)).toBe('—')
  })
})
