// The owner-review inbox as an owner needs it: each held job with why it is here, its
// last error and age; its detail with its runs; a decision only with a name and a reason,
// on the job's route or an approved fallback; refusals shown where the form is.
import { QueryClient, QueryClientProvider } from '@tanstack/react-query'
import { cleanup, fireEvent, render, screen, waitFor, within } from '@testing-library/react'
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest'
import { ID, jobOf, runOf } from './jobFixtures'
import { parseFallbacks } from './JobParts'
import { ReviewsView } from './Reviews'
import { useRoute } from './router'

let decided = false
let approveAnswer: { status: number; body: unknown } | null = null

function json(body: unknown, status = 200): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json' } })
}

const fetchMock = vi.fn(async (input: RequestInfo | URL, init?: RequestInit): Promise<Response> => {
  const url = String(input)
  const post = init?.method === 'POST'
  if (url.includes('/admin/v1/reviews?') && !post) return json(decided ? [] : [jobOf({})])
  if (url.endsWith(`/admin/v1/jobs/${ID}`) && !post) {
    return json({ job: jobOf(decided ? { lane: 'background_retry', state: 'queued' } : {}), evidence: [runOf('req-1')] })
  }
  if (url.endsWith(`/admin/v1/reviews/${ID}/approve`) && post) {
    if (approveAnswer) return json(approveAnswer.body, approveAnswer.status)
    decided = true
    return json(jobOf({ lane: 'background_retry', state: 'queued', route_override: 'openai/gpt-4o', reason: 'approved by an owner' }))
  }
  if (url.endsWith(`/admin/v1/reviews/${ID}/reject`) && post) {
    decided = true
    return json(jobOf({ lane: null, state: 'rejected' }))
  }
  return json({ error: `nothing at ${url}` }, 404)
})

function posted(suffix: string): unknown {
  const call = fetchMock.mock.calls.find(([u, i]) => String(u).endsWith(suffix) && i?.method === 'POST')
  return call ? JSON.parse(String(call[1]?.body)) : null
}

/** The view as the app mounts it: the selected job comes from the URL. */
function Routed() {
  const r = useRoute()
  return r.view === 'reviews' ? <ReviewsView conn={{ url: 'http://127.0.0.1:1', token: 't' }} selected={r.id} /> : null
}

function show(path: string) {
  history.pushState(null, '', path)
  return render(
    <QueryClientProvider client={new QueryClient({ defaultOptions: { queries: { retry: false } } })}>
      <Routed />
    </QueryClientProvider>,
  )
}

beforeEach(() => {
  decided = false
  approveAnswer = null
  vi.stubGlobal('fetch', fetchMock)
})

afterEach(() => {
  cleanup()
  vi.unstubAllGlobals()
  fetchMock.mockClear()
  localStorage.clear()
  history.pushState(null, '', '/')
})

describe('ReviewsView', () => {
  it('lists each held job with why it is here, its last error, attempts, age and estimate', async () => {
    // spec: K3
    show('/reviews')
    const row = await screen.findByTestId(`review-${ID}`)
    expect(row.textContent).toMatch(/default/)
    expect(row.textContent).toMatch(/openai\/gpt-4o-mini/)
    expect(row.textContent).toMatch(/quota or spend exhausted/)
    expect(row.textContent).toMatch(/quota: You exceeded your current quota/)
    expect(row.textContent).toMatch(/1\/3/)
    expect(row.textContent).toMatch(/2 h/)
    expect(row.textContent).toMatch(/\$0\.0042/)
    expect(screen.getByTestId('reviews-summary').textContent).toMatch(/1 awaiting a decision; the oldest has waited 2 h/)
    expect(String(fetchMock.mock.calls[0][0])).toBe('http://127.0.0.1:1/admin/v1/reviews?limit=200')
  })

  it('filters on the server', async () => {
    show('/reviews')
    await screen.findByTestId(`review-${ID}`)
    fireEvent.change(screen.getByTestId('filter-route'), { target: { value: 'openai/gpt-4o-mini' } })
    fireEvent.change(screen.getByTestId('filter-error-class'), { target: { value: 'quota' } })
    fireEvent.click(screen.getByTestId('filter-apply'))
    await waitFor(() => expect(fetchMock.mock.calls.some(([u]) => String(u).includes('route=openai%2Fgpt-4o-mini&error_class=quota&limit=200'))).toBe(true))
  })

  it('shows the job and its runs, and approves only with a reviewer and a reason, on the chosen route', async () => {
    // spec: K3, K1
    show(`/reviews/${ID}`)
    const form = await screen.findByTestId('review-form')
    expect(screen.getByTestId('review-runs').textContent).toMatch(/req-1.*failed.*429.*quota.*#1 openai-sim: quota \(HTTP 429\)/)
    expect(within(screen.getByTestId('review-runs')).getByText('req-1').getAttribute('href')).toBe('/ledger/req-1')
    const approve = screen.getByTestId('review-approve') as HTMLButtonElement
    const reject = screen.getByTestId('review-reject') as HTMLButtonElement
    expect(approve.disabled).toBe(true)
    expect(reject.disabled).toBe(true)
    expect(screen.getByTestId('review-missing').textContent).toMatch(/reviewer, reason/)
    fireEvent.change(screen.getByTestId('review-reviewer'), { target: { value: 'ana' } })
    expect(approve.disabled).toBe(true)
    expect(screen.getByTestId('review-missing').textContent).toMatch(/Still needed: reason\./)
    fireEvent.change(screen.getByTestId('review-reason'), { target: { value: 'quota raised to 2M tokens a day' } })
    expect(approve.disabled).toBe(false)
    // Its own route, then the workflow's approved fallbacks.
    const options = within(form).getAllByRole('option').map((o) => o.getAttribute('value'))
    expect(options).toEqual(['', 'openai/gpt-4o', 'openai/gpt-4.1-mini'])
    fireEvent.change(screen.getByTestId('review-route'), { target: { value: 'openai/gpt-4o' } })
    fireEvent.click(approve)
    await waitFor(() => expect(posted('/approve')).not.toBeNull())
    expect(posted('/approve')).toEqual({ reviewer: 'ana', reason: 'quota raised to 2M tokens a day', route: 'openai/gpt-4o' })
    const result = await screen.findByTestId('review-result')
    expect(result.textContent).toMatch(/Approved job_0+a: it runs again now on openai\/gpt-4o/)
    expect(within(result).getByRole('link').getAttribute('href')).toBe('/audit')
    await waitFor(() => expect(screen.queryByTestId(`review-${ID}`)).toBeNull())
    expect(window.location.pathname).toBe('/reviews')
    expect(localStorage.getItem('spillway.actor')).toBe('ana')
  })

  it('rejects with a name and a reason, and sends no route', async () => {
    show(`/reviews/${ID}`)
    await screen.findByTestId('review-form')
    fireEvent.change(screen.getByTestId('review-reviewer'), { target: { value: 'ana' } })
    fireEvent.change(screen.getByTestId('review-reason'), { target: { value: 'not worth the spend' } })
    fireEvent.click(screen.getByTestId('review-reject'))
    await waitFor(() => expect(posted('/reject')).not.toBeNull())
    expect(posted('/reject')).toEqual({ reviewer: 'ana', reason: 'not worth the spend' })
    expect((await screen.findByTestId('review-result')).textContent).toMatch(/Rejected .*rejected/)
  })

  it('shows a refused decision next to the form, naming the missing fields', async () => {
    approveAnswer = { status: 422, body: { error: 'Missing required field(s): reason.', missing_fields: ['reason'] } }
    show(`/reviews/${ID}`)
    await screen.findByTestId('review-form')
    fireEvent.change(screen.getByTestId('review-reviewer'), { target: { value: 'ana' } })
    fireEvent.change(screen.getByTestId('review-reason'), { target: { value: ' ok ' } })
    fireEvent.click(screen.getByTestId('review-approve'))
    const err = await screen.findByTestId('review-error')
    expect(err.getAttribute('role')).toBe('alert')
    expect(err.textContent).toMatch(/Missing required field\(s\): reason/)
    expect(screen.getByTestId('review-reason').getAttribute('aria-invalid')).toBe('true')
    expect(screen.getByTestId('review-reviewer').getAttribute('aria-invalid')).toBeNull()
  })

  it('says when the job is no longer awaiting review', async () => {
    approveAnswer = { status: 409, body: { error: `Job ${ID} is not awaiting an owner (it is \`rejected\`).` } }
    show(`/reviews/${ID}`)
    await screen.findByTestId('review-form')
    fireEvent.change(screen.getByTestId('review-reviewer'), { target: { value: 'ana' } })
    fireEvent.change(screen.getByTestId('review-reason'), { target: { value: 'go' } })
    fireEvent.click(screen.getByTestId('review-approve'))
    expect((await screen.findByTestId('review-error')).textContent).toMatch(/not awaiting an owner/)
  })
})

describe('parseFallbacks', () => {
  it('reads the approved routes from a job\'s fallback policy', () => {
    expect(parseFallbacks('default@b7e1: openai/gpt-4o, openai/gpt-4.1-mini')).toEqual(['openai/gpt-4o', 'openai/gpt-4.1-mini'])
    expect(parseFallbacks('none')).toEqual([])
    expect(parseFallbacks(null)).toEqual([])
    expect(parseFallbacks('nightly@1: anthropic/claude-haiku-4-5')).toEqual(['anthropic/claude-haiku-4-5'])
  })
})
