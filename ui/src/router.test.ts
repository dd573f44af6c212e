import { afterEach, describe, expect, it } from 'vitest'
import { href, navigate, parse } from './router'

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
      { view: 'recovery' as const, id: null },
      { view: 'recovery' as const, id: 'rc_0195f0a1 7c3e?#%' },
      { view: 'scorecard' as const, run: null, route: null },
      { view: 'scorecard' as const, run: 'rc_1', route: null },
      { view: 'scorecard' as const, run: null, route: 'openai/gpt-4o-mini' },
      { view: 'scorecard' as const, run: 'rc_1&x=2#y', route: 'gemini/models name?#%' },
      { view: 'fleet' as const },
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

describe('recovery and scorecard URLs', () => {
  afterEach(() => history.pushState(null, '', '/'))

  it('gives the recovery runs and one run their own URLs', () => {
    expect(href({ view: 'recovery', id: null })).toBe('/recovery')
    expect(href({ view: 'recovery', id: 'rc_1' })).toBe('/recovery/rc_1')
    expect(parse('/recovery')).toEqual({ view: 'recovery', id: null })
    expect(parse('/recovery/')).toEqual({ view: 'recovery', id: null })
    expect(parse('/recovery/rc_1')).toEqual({ view: 'recovery', id: 'rc_1' })
  })

  it('carries the scorecard\'s run or route in the query', () => {
    expect(href({ view: 'scorecard', run: null, route: null })).toBe('/scorecard')
    expect(href({ view: 'scorecard', run: 'rc_1', route: null })).toBe('/scorecard?run=rc_1')
    expect(href({ view: 'scorecard', run: null, route: 'openai/gpt-4o-mini' })).toBe('/scorecard?route=openai%2Fgpt-4o-mini')
    expect(parse('/scorecard?run=rc_1')).toEqual({ view: 'scorecard', run: 'rc_1', route: null })
    expect(parse('/scorecard/?route=openai%2Fgpt-4o-mini')).toEqual({ view: 'scorecard', run: null, route: 'openai/gpt-4o-mini' })
    expect(parse('/scorecard?run=')).toEqual({ view: 'scorecard', run: null, route: null })
    // Another view's path never reads the query.
    expect(parse('/recovery/rc_1?run=rc_2')).toEqual({ view: 'recovery', id: 'rc_1' })
    expect(parse('/breakers/openai/gpt-4o-mini?x=1')).toEqual({ view: 'breakers', route: 'openai/gpt-4o-mini' })
  })

  it('takes the scorecard\'s query along to it and not on to the next view', () => {
    history.pushState(null, '', '/recovery/rc_1')
    navigate({ view: 'scorecard', run: 'rc_1', route: null })
    expect(window.location.pathname + window.location.search).toBe('/scorecard?run=rc_1')
    navigate({ view: 'scorecard', run: null, route: 'openai/gpt-4o-mini' })
    expect(window.location.search).toBe('?route=openai%2Fgpt-4o-mini')
    navigate({ view: 'recovery', id: null })
    expect(window.location.pathname + window.location.search).toBe('/recovery')
  })

  it('keeps any other query parameter across moves, as before', () => {
    history.pushState(null, '', '/audit?debug=1')
    navigate({ view: 'scorecard', run: 'rc_1', route: null })
    expect(window.location.search).toBe('?run=rc_1&debug=1')
    navigate({ view: 'keys' })
    expect(window.location.pathname + window.location.search).toBe('/keys?debug=1')
  })
})
