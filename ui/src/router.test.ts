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
      { view: 'reviews' as const, id: null },
      { view: 'reviews' as const, id: 'job_0123456789abcdef0123456789abcdef' },
      { view: 'deadletters' as const, id: null },
      { view: 'deadletters' as const, id: 'job_fedcba9876543210fedcba9876543210' },
      { view: 'policies' as const, workflow: null },
      { view: 'policies' as const, workflow: 'nightly batch/v2?#%' },
      { view: 'audit' as const },
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

  it('gives the inboxes, the policies and the audit log their own URLs', () => {
    expect(href({ view: 'reviews', id: null })).toBe('/reviews')
    expect(href({ view: 'reviews', id: 'job_1' })).toBe('/reviews/job_1')
    expect(parse('/reviews/job_1')).toEqual({ view: 'reviews', id: 'job_1' })
    expect(href({ view: 'deadletters', id: 'job_2' })).toBe('/dead-letters/job_2')
    expect(parse('/dead-letters')).toEqual({ view: 'deadletters', id: null })
    expect(parse('/dead-letters/job_2')).toEqual({ view: 'deadletters', id: 'job_2' })
    expect(href({ view: 'policies', workflow: 'nightly' })).toBe('/policies/nightly')
    expect(parse('/policies/nightly')).toEqual({ view: 'policies', workflow: 'nightly' })
    expect(href({ view: 'audit' })).toBe('/audit')
    expect(parse('/audit/')).toEqual({ view: 'audit' })
  })
})
