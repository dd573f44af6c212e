import { afterEach, describe, expect, it, vi } from 'vitest'
import { ApiError, searchRequests, streamEvents, type LiveEvent } from './api'

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
