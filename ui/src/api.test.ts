import { afterEach, describe, expect, it, vi } from 'vitest'
import { ApiError, attachmentName, closeRecovery, searchRequests, streamEvents, type LiveEvent } from './api'

const conn = { url: 'http://127.0.0.1:9', token: 'swa_test' }

function streamOf(chunks: string[]): ReadableStream<Uint8Array> {
  const enc = new TextEncoder()
  return new ReadableStream({
    start(c) {
      for (const ch of chunks) c.enqueue(enc.encode(ch))
      c.close()
    },
  })
}

afterEach(() => vi.unstubAllGlobals())

describe('admin event stream', () => {
  it('parses frames split anywhere, with CRLF, and sends the token', async () => {
    const fetchMock = vi.fn(async () => new Response(streamOf([
      'event: overview\r\ndata: {"now":1,',
      '"series":[]}\r\n\r\n: keep-alive\n\nevent: tick\ndata: {"now":2}\n',
      '\nevent: alert\ndata: {"title":"Channel x rejected its provider credential"}\n\n',
    ]), { status: 200 }))
    vi.stubGlobal('fetch', fetchMock)
    const got: LiveEvent[] = []
    await streamEvents(conn, (e) => got.push(e), new AbortController().signal)
    expect(got.map((e) => e.kind)).toEqual(['overview', 'tick', 'alert'])
    expect((got[1].data as { now: number }).now).toBe(2)
    const init = fetchMock.mock.calls[0] as unknown as [string, RequestInit]
    expect((init[1].headers as Record<string, string>).Authorization).toBe('Bearer swa_test')
  })

  it('turns a refused token into an ApiError with the server message', async () => {
    vi.stubGlobal('fetch', vi.fn(async () => new Response(JSON.stringify({ error: 'Wrong admin token.' }), { status: 401 })))
    await expect(streamEvents(conn, () => {}, new AbortController().signal)).rejects.toMatchObject({ status: 401, message: 'Wrong admin token.' })
  })
})

describe('ledger search', () => {
  it('sends only the filters that are set', async () => {
    const fetchMock = vi.fn(async () => new Response(JSON.stringify({ items: [], next: null }), { status: 200 }))
    vi.stubGlobal('fetch', fetchMock)
    await searchRequests(conn, { q: 'abc', route: null, state: 'failed', api: 'embeddings', from_ms: null, to_ms: null, before: null, limit: 50 })
    const url = (fetchMock.mock.calls[0] as unknown as [string])[0]
    expect(url).toBe('http://127.0.0.1:9/admin/v1/requests?q=abc&state=failed&api=embeddings&limit=50')
  })

  it('says the gateway is unreachable instead of a raw network error', async () => {
    vi.stubGlobal('fetch', vi.fn(async () => { throw new TypeError('fetch failed') }))
    const err = await searchRequests(conn, { q: null, route: null, state: null, api: null, from_ms: null, to_ms: null, before: null, limit: null }).catch((e) => e)
    expect(err).toBeInstanceOf(ApiError)
    expect(err.message).toMatch(/Cannot reach the gateway/)
  })
})

describe('recovery files and refusals', () => {
  it('saves a download under the name the gateway gives, never a path', () => {
    expect(attachmentName('attachment; filename="rc_1-incident.md"')).toBe('rc_1-incident.md')
    expect(attachmentName("attachment; filename*=UTF-8''r%C3%A9sum%C3%A9.md; filename=\"resume.md\"")).toBe('résumé.md')
    expect(attachmentName('attachment; filename="../../etc/passwd"')).toBe('passwd')
    expect(attachmentName('attachment')).toBeNull()
    expect(attachmentName(null)).toBeNull()
  })

  it('keeps the unmet conditions a refused close names', async () => {
    vi.stubGlobal('fetch', vi.fn(async () => new Response(JSON.stringify({ error: 'the run cannot close yet', missing: ['backlog is 2 (must be 0)', 3] }), { status: 409 })))
    const err = await closeRecovery(conn, 'rc_1', { actor: 'ana', customer_contacted: true, customer_impact: '', workarounds: '' }).catch((e) => e)
    expect(err).toBeInstanceOf(ApiError)
    expect(err.status).toBe(409)
    expect(err.missing).toEqual(['backlog is 2 (must be 0)'])
    expect(err.missingFields).toEqual([])
  })
})
