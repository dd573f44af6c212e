// The audit log (G4, K3, L1, J8, B4, B5, I4): every change on the record, newest first,
// with who made it, why, and the figures it was made on. Filtered on the server by kind
// and subject.
import { keepPreviousData, useQuery } from '@tanstack/react-query'
import { useState } from 'react'
import { getAudit, type Connection } from './api'
import type { AuditEntry } from './bindings/AuditEntry'
import { time, trigger } from './format'
import { linkProps, type Route } from './router'

/** The kinds the gateway records. */
export const AUDIT_KINDS = ['breaker', 'channel', 'key', 'owner', 'job', 'replay', 'policy', 'request', 'ledger'] as const

const LIMITS = [50, 200, 1000]

/** The figures an entry was made on, as indented JSON; the text as stored when it is not JSON. */
export function prettyFigures(figures: string | null): string | null {
  if (figures === null || figures.trim() === '' || figures.trim() === '[]') return null
  try {
    return JSON.stringify(JSON.parse(figures), null, 2)
  } catch {
    return figures
  }
}

/** Where an entry's subject lives in the console, when it has a view. */
function subjectRoute(e: AuditEntry): Route | null {
  switch (e.kind) {
    case 'breaker':
      return { view: 'breakers', route: e.subject }
    case 'request':
      return { view: 'ledger', id: e.subject }
    case 'policy':
      return { view: 'policies', workflow: e.subject }
    default:
      return null
  }
}

export function AuditView({ conn }: { conn: Connection }) {
  const [draft, setDraft] = useState({ kind: '', subject: '', limit: LIMITS[0] })
  const [q, setQ] = useState(draft)
  const log = useQuery({
    queryKey: ['audit', conn.url, q.kind, q.subject, q.limit],
    queryFn: () => getAudit(conn, q.kind || null, q.subject.trim() || null, q.limit),
    refetchInterval: 10_000,
    placeholderData: keepPreviousData,
  })
  return (
    <section>
      <h2>Audit log</h2>
      <p className="muted">
        Every change with who made it and why: breakers, channels, keys, balances, owner-review decisions, replays, policy
        versions, reconciliations and prunes. Newest first.
      </p>
      <form className="search" role="search" aria-label="Filter the audit log" onSubmit={(e) => { e.preventDefault(); setQ(draft) }}>
        <select aria-label="Kind" value={draft.kind} onChange={(e) => { const next = { ...draft, kind: e.target.value }; setDraft(next); setQ(next) }} data-testid="audit-kind">
          <option value="">All kinds</option>
          {AUDIT_KINDS.map((k) => <option key={k} value={k}>{k}</option>)}
        </select>
        <input aria-label="Subject" placeholder="Subject: a route, channel, key, owner, job, batch, workflow or request id" value={draft.subject}
          onChange={(e) => setDraft({ ...draft, subject: e.target.value })} data-testid="audit-subject" />
        <select aria-label="How many" value={draft.limit} onChange={(e) => { const next = { ...draft, limit: Number(e.target.value) }; setDraft(next); setQ(next) }}>
          {LIMITS.map((n) => <option key={n} value={n}>Newest {n}</option>)}
        </select>
        <button type="submit">Filter</button>
      </form>
      {log.error && <p role="alert" className="error">{(log.error as Error).message}</p>}
      {!log.data ? (
        !log.error && <p className="muted" aria-busy>Loading the audit log…</p>
      ) : log.data.length === 0 ? (
        <p className="muted" data-testid="audit-empty">Nothing on the record{q.kind || q.subject.trim() ? ' for this filter' : ' yet'}.</p>
      ) : (
        <table className="grid" data-testid="audit-table">
          <caption className="muted small">
            The newest {log.data.length}{log.data.length >= q.limit ? ` (ask for more above)` : ''}{q.kind ? ` of kind ${q.kind}` : ''}
            {q.subject.trim() ? ` about ${q.subject.trim()}` : ''}.
          </caption>
          <thead>
            <tr><th>Time</th><th>Kind</th><th>Subject</th><th>Actor</th><th>Action</th><th>Reason</th><th>Figures</th></tr>
          </thead>
          <tbody>
            {log.data.map((e) => {
              const to = subjectRoute(e)
              const figures = prettyFigures(e.figures)
              return (
                <tr key={e.id} data-testid={`audit-${e.id}`}>
                  <td className="small">{time(e.at)}</td>
                  <td>{e.kind}</td>
                  <td className="mono small">{to ? <a {...linkProps(to)}>{e.subject}</a> : e.subject}</td>
                  <td>{e.actor}</td>
                  <td>{e.action.replace('->', ' → ')}</td>
                  <td className="small wrap">
                    {e.reason}
                    {e.trigger && <div className="muted">trigger: {trigger(e.trigger)}</div>}
                  </td>
                  <td>{figures ? <pre className="figures-json">{figures}</pre> : <span className="muted">—</span>}</td>
                </tr>
              )
            })}
          </tbody>
        </table>
      )}
    </section>
  )
}
