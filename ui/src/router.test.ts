import { describe, expect, it } from 'vitest'
import { href, parse } from './router'

describe('router', () => {
  it('gives every view a URL that parses back to it', () => {
    for (const r of [
      { view: 'overview' as const },
      { view: 'breakers' as const, route: null },
      { view: 'breakers' as const, route: 'openai/gpt-4o-mini' },
      { view: 'breakers' as const, route: 'gemini/models name?#%' },
      { view: 'ledger' as const, id: null },
      { view: 'ledger' as const, id: '0195f0a1-7c3e-7000-8000-000000000001' },
      { view: 'unknowns' as const, id: null },
      { view: 'unknowns' as const, id: '0195f0a1-7c3e-7000-8000-000000000002' },
      { view: 'costs' as const },
      { view: 'keys' as const },
    ]) {
      expect(parse(href(r))).toEqual(r)
    }
    expect(href({ view: 'breakers', route: 'openai/gpt-4o-mini' })).toBe('/breakers/openai/gpt-4o-mini')
    expect(parse('/nowhere')).toEqual({ view: 'overview' })
  })

  it('gives costs and keys their own URLs', () => {
    expect(href({ view: 'costs' })).toBe('/costs')
    expect(href({ view: 'keys' })).toBe('/keys')
    expect(parse('/costs')).toEqual({ view: 'costs' })
    expect(parse('/costs/')).toEqual({ view: 'costs' })
    expect(parse('/keys')).toEqual({ view: 'keys' })
  })
})
