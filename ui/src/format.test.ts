import { describe, expect, it } from 'vitest'
import { count, ms, pct, rate, usd } from './format'

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
  })
  it('formats rates and counts', () => {
    expect(rate(0.25)).toBe('0.3 req/s')
    expect(rate(1234.4)).toBe('1234 req/s')
    expect(count(1234567)).toBe('1,234,567')
  })
})
