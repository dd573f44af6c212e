import { keepPreviousData, useQuery } from '@tanstack/react-query'
import { useEffect, useMemo, useRef, useState } from 'react'
import { getRequest, searchRequests, type Connection } from './api'
import type { RequestState } from './bindings/RequestState'
import type { Search } from './bindings/Search'
import { navigate } from './router'
import type { Api } from './bindings/Api'
import { APIS, apiLabel, count, decision, failureClass, money, ms, since, statePill, time } from './format'

const STATES: RequestState[] = ['received', 'calling_api', 'api_completed', 'side_effect_pending', 'done', 'failed', 'unknown']

/** Opens a request's detail (or closes it); moving through the list replaces the entry. */
function select(id: string | null, replace = false) {
  navigate({ view: 'ledger', id }, replace)
}

export function LedgerView({ conn, selected: linked }: { conn: Connection; selected: string | null }) {
  const [draft, setDraft] = useState({ q: '', route: '', state: '', api: '', window: '' })
  const [search, setSearch] = useState<Search>({ q: null, route: null, state: null, api: null, from_ms: null, to_ms: null, before: null, limit: 50 })
  const [cursors, setCursors] = useState<(string | null)[]>([])
  // The selected request is in the URL (`/ledger/<id>`): it can be linked to, and the back
  // button closes it.
  const selected = linked
  const box = useRef<HTMLInputElement>(null)

  const page = useQuery({
    queryKey: ['requests', conn.url, search],
    queryFn: () => searchRequests(conn, search),
    placeholderData: keepPreviousData,
  })
  const items = useMemo(() => page.data?.items ?? [], [page.data])

  useEffect(() => {
    const onKey = (e: KeyboardEvent) => {
      const typing = e.target instanceof HTMLInputElement || e.target instanceof HTMLSelectElement
      if (e.key === '/' && !typing) {
        e.preventDefault()
        box.current?.focus()
      } else if (!typing && (e.key === 'j' || e.key === 'ArrowDown' || e.key === 'k' || e.key === 'ArrowUp') && items.length) {
        e.preventDefault()
        const i = items.findIndex((r) => r.id === selected)
        const next = e.key === 'j' || e.key === 'ArrowDown' ? Math.min(items.length - 1, i + 1) : Math.max(0, i - 1)
        select(items[next].id, true)
      }
    }
    window.addEventListener('keydown', onKey)
    return () => window.removeEventListener('keydown', onKey)
  }, [items, selected])

  const submit = (e: React.FormEvent) => {
    e.preventDefault()
    setCursors([])
    // A time window is a key range on the server: cheap at any ledger size.
    const from_ms = draft.window ? Date.now() - Number(draft.window) * 60_000 : null
    setSearch({ ...search, q: draft.q.trim() || null, route: draft.route.trim() || null, state: (draft.state || null) as RequestState | null, api: (draft.api || null) as Api | null, from_ms, before: null })
  }

  return (
    <section className="ledger">
      <form className="search" onSubmit={submit} role="search">
        <input ref={box} aria-label="Search by request id, client request id or trace id" placeholder="Request id, client request id or trace id  ( / )"
          value={draft.q} onChange={(e) => setDraft({ ...draft, q: e.target.value })} data-testid="search" />
        <input aria-label="Route" placeholder="Route, e.g. openai/gpt-4o-mini" value={draft.route} onChange={(e) => setDraft({ ...draft, route: e.target.value })} />
        <select aria-label="State" value={draft.state} onChange={(e) => setDraft({ ...draft, state: e.target.value })}>
          <option value="">Any state</option>
          {STATES.map((s) => <option key={s} value={s}>{s}</option>)}
        </select>
        <select aria-label="Endpoint type" value={draft.api} onChange={(e) => setDraft({ ...draft, api: e.target.value })}>
          <option value="">Any endpoint</option>
          {APIS.map((a) => <option key={a} value={a}>{apiLabel(a)}</option>)}
        </select>
        <select aria-label="Time window" value={draft.window} onChange={(e) => setDraft({ ...draft, window: e.target.value })}>
          <option value="">Any time</option>
          <option value="15">Last 15 min</option>
          <option value="60">Last hour</option>
          <option value="1440">Last 24 h</option>
        </select>
        <button type="submit">Search</button>
      </form>
      {page.error && <p role="alert" className="error">{(page.error as Error).message}</p>}
      <div className="split">
        <div className="results">
          {page.isPending ? (
            <p className="muted">Loading…</p>
          ) : items.length === 0 ? (
            <p className="muted" data-testid="no-results">{search.q || search.route || search.state || search.api || search.from_ms ? 'Nothing matches this search.' : 'The ledger is empty: no request has reached the gateway yet.'}</p>
          ) : (
            <table className="grid selectable" data-testid="results">
              <thead>
                <tr><th>Received</th><th>Request id</th><th>Route</th><th>Endpoint</th><th>State</th><th className="num">Status</th><th className="num">Attempts</th><th className="num">Duration</th></tr>
              </thead>
              <tbody>
                {items.map((r) => (
                  <tr key={r.id} aria-selected={r.id === selected} onClick={() => select(r.id)} tabIndex={0}
                    onKeyDown={(e) => e.key === 'Enter' && select(r.id)}>
                    <td>{time(r.received_at)}</td><td className="mono">{r.id}</td><td>{r.route ?? '—'}</td>
                    <td className="mono" data-testid="endpoint">{r.endpoint}</td>
                    <td><span className={statePill(r.state)}>{r.state}</span></td>
                    <td className="num">{r.http_status ?? '—'}</td><td className="num">{r.attempts}</td>
                    <td className="num">{since(r.received_at, r.finished_at)}</td>
                  </tr>
                ))}
              </tbody>
            </table>
          )}
          <div className="pager">
            <button disabled={cursors.length === 0} onClick={() => {
              const prev = cursors.slice(0, -1)
              setCursors(prev)
              setSearch({ ...search, before: prev[prev.length - 1] ?? null })
            }}>← Newer</button>
            <span className="muted">{count(items.length)} shown</span>
            <button disabled={!page.data?.next} onClick={() => {
              setCursors([...cursors, page.data?.next ?? null])
              setSearch({ ...search, before: page.data?.next ?? null })
            }}>Older →</button>
          </div>
        </div>
        {selected && <Detail conn={conn} id={selected} onClose={() => select(null)} />}
      </div>
    </section>
  )
}

function Detail({ conn, id, onClose }: { conn: Connection; id: string; onClose: () => void }) {
  const q = useQuery({ queryKey: ['request', conn.url, id], queryFn: () => getRequest(conn, id) })
  if (q.isPending) return <aside className="detail"><p className="muted">Loading {id}…</p></aside>
  if (q.error) return <aside className="detail"><p role="alert" className="error">{(q.error as Error).message}</p></aside>
  const { request: r, attempts, cost_breakdown } = q.data
  const cached = [
    r.cached_input_tokens ? `${r.cached_input_tokens} cached` : null,
    r.cache_write_tokens ? `${r.cache_write_tokens} written to the cache` : null,
  ].filter(Boolean).join(', ')
  const rows: [string, string][] = [
    ['Request id', r.id], ['Trace id', r.trace_id], ['Client request id', r.client_request_id ?? '—'],
    ['Provider request id', r.upstream_request_id ?? '—'], ['Key / owner', `${r.key_name ?? '—'} / ${r.owner ?? '—'}`],
    ['Route', r.route ?? '—'], ['Endpoint', r.endpoint], ['Channel', r.channel ?? '—'],
    ...(r.response_id ? [['Stored response', `${r.response_id} (follow-ups go to this channel)`] as [string, string]] : []),
    ['Model', r.requested_model === r.served_model || !r.served_model ? (r.requested_model ?? '—') : `${r.requested_model} → served by ${r.served_model}`],
    ['State', r.state + (r.partial_output_committed ? ' (partial output committed)' : '')],
    ['Status', r.http_status ? String(r.http_status) : '—'], ['Error', r.error_class ? `${failureClass(r.error_class)}: ${r.error_message ?? ''}` : '—'],
    ['Tokens in / out', `${r.input_tokens ?? '—'} / ${r.output_tokens ?? '—'}${cached ? ` (${cached})` : ''}`],
    ['Cost', r.cost_usd === null ? 'unknown (an unpriced model, or no usage reported): never counted as zero' : `$${r.cost_usd.toFixed(4)}`],
    ['Of which failed attempts', r.failed_cost_usd === null ? '—' : money(r.failed_cost_usd)],
    ['Cost breakdown', cost_breakdown ?? '—'],
    ['Estimate before the call', r.estimated_cost_usd === null
      ? '—'
      : `${money(r.estimated_cost_usd)} for ${r.estimated_input_tokens === null ? 'unknown' : count(r.estimated_input_tokens)} input tokens counted before the call (output at its cap)`],
    ['Pricing version', r.pricing_version ?? '—'],
    ['Received', time(r.received_at)], ['Queued', r.queued_ms === null ? 'no wait' : ms(r.queued_ms)],
    ...(r.next_ready_at ? [['Next attempt at', time(r.next_ready_at)] as [string, string]] : []),
    ['First token', since(r.received_at, r.first_token_at)], ['Finished', since(r.received_at, r.finished_at)],
    ...(r.idempotency_key ? [['Idempotency-Key', r.idempotency_key] as [string, string]] : []),
    ...(r.replay_of ? [['Replay of', `${r.replay_of} (answered from the ledger; nothing sent upstream)`] as [string, string]] : []),
    ...(r.resolution?.result_id ? [['Result id', r.resolution.result_id] as [string, string]] : []),
    ...(r.resolution?.reconciliation ? [['Reconciled', `${r.resolution.reconciliation.replace(/_/g, ' ')} by ${r.resolution.reconciled_by ?? '?'} at ${time(r.resolution.reconciled_at)}: ${r.resolution.reconciled_reason ?? ''}`] as [string, string]] : []),
  ]
  return (
    <aside className="detail" data-testid="detail">
      <header>
        <h2>{r.attempts > 1 ? (r.state === 'done' ? `Succeeded on attempt ${r.attempts}` : `Failed after ${r.attempts} attempts`) : 'Request'}</h2>
        <button onClick={onClose} aria-label="Close detail">✕</button>
      </header>
      <dl>{rows.map(([k, v]) => <div key={k}><dt>{k}</dt><dd className={k.endsWith('id') || k === 'Pricing version' ? 'mono' : k === 'Cost breakdown' ? 'prose' : ''}>{v}</dd></div>)}</dl>
      <h3>Attempts</h3>
      {attempts.length === 0 ? <p className="muted">None: the gateway answered without calling a provider.</p> : (
        <ol className="attempts">
          {attempts.map((a) => (
            <li key={a.attempt_no}>
              <strong>#{a.attempt_no}</strong> on <code>{a.channel}</code>: {failureClass(a.error_class)}
              {a.http_status ? ` (HTTP ${a.http_status})` : ''}{a.provider_error_type ? `, ${a.provider_error_type}` : ''}
              <span data-testid="attempt-cost">, cost {a.cost_usd === null ? 'unknown' : money(a.cost_usd)}</span>
              {a.retry_after_ms !== null ? `, wait hint ${ms(a.retry_after_ms)}` : ''}
              {a.visibility === 'after_partial_output' ? ', after output reached the client' : ''}
              {a.decision && <div data-testid="decision">→ {decision(a.decision, a.decision_reason, a.delay_ms)}</div>}
              <div className="muted">first byte {since(a.started_at, a.first_byte_at)}, total {since(a.started_at, a.finished_at)}
                {a.message ? ` — ${a.message}` : ''}</div>
            </li>
          ))}
        </ol>
      )}
    </aside>
  )
}
