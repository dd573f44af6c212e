// The unknown-outcomes inbox (I4, L3): requests the gateway was calling a provider for when
// it stopped, so nobody knows whether the provider did the work. They are never sent again
// on their own; an owner looks at the evidence and reconciles each one, with a name and a
// reason that go on the audit log.
import { useQuery, useQueryClient } from '@tanstack/react-query'
import { useState } from 'react'
import { getRequest, getUnknowns, reconcile, reconcileBulk, type Connection } from './api'
import type { RequestDetail } from './bindings/RequestDetail'
import type { Reconciliation } from './bindings/Reconciliation'
import { age, decision, failureClass, money, time } from './format'
import { linkProps, navigate } from './router'
import { useOperatorAction } from './actor'

/** The newest this many are listed; the count beside them is the whole inbox's. */
const PAGE = 100

export function UnknownsView({ conn, selected }: { conn: Connection; selected: string | null }) {
  const [checked, setChecked] = useState<Set<string>>(new Set())
  const [bulkMsg, setBulkMsg] = useState<{ ok: boolean; text: string } | null>(null)
  const list = useQuery({
    queryKey: ['unknowns', conn.url],
    queryFn: () => getUnknowns(conn, PAGE),
    refetchInterval: 5_000,
  })
  if (list.error) return <p role="alert" className="error">{(list.error as Error).message}</p>
  if (!list.data) return <section aria-busy className="empty"><p>Loading the inbox…</p></section>
  const items = list.data
  const now = Date.now()
  const oldest = items.length ? items[items.length - 1].request.received_at : null
  const listed = selected ? items.find((i) => i.request.id === selected) : undefined
  // Only what is still listed stays checked.
  const picked = items.map((i) => i.request.id).filter((id) => checked.has(id))
  const toggle = (id: string) => {
    const next = new Set(checked)
    if (next.has(id)) next.delete(id)
    else next.add(id)
    setChecked(next)
  }
  const all = picked.length === items.length && items.length > 0
  return (
    <section>
      <h2>Unknown outcomes</h2>
      <p className="muted">
        The gateway stopped (a crash, a kill, a cut shutdown) while these requests were calling a provider, so whether the
        provider did the work is not known. They are never sent again automatically, and a client repeating one with its
        <code> Idempotency-Key</code> gets 409 until an owner reconciles it here.
      </p>
      {items.length === 0 ? (
        <p className="ok-text" data-testid="unknowns-empty">None: every request the gateway sent has a known outcome.</p>
      ) : (
        <>
          <p data-testid="unknowns-summary">
            <strong>{items.length}{items.length === PAGE ? '+' : ''}</strong> waiting; the oldest for {age(oldest, now)}.
          </p>
          <table className="grid selectable" data-testid="unknowns">
            <thead>
              <tr>
                <th><input type="checkbox" aria-label="Select every request on this page" checked={all}
                  onChange={() => setChecked(all ? new Set() : new Set(items.map((i) => i.request.id)))} data-testid="unknowns-all" /></th>
                <th>Received</th><th>Route</th><th>Key · owner</th><th>Idempotency-Key</th><th>Channel</th><th className="num">Attempts</th><th>Waiting for</th>
              </tr>
            </thead>
            <tbody>
              {items.map(({ request: r }) => (
                <tr key={r.id} aria-selected={r.id === selected} data-testid={`unknown-${r.id}`}
                  onClick={() => navigate({ view: 'unknowns', id: r.id })}>
                  <td onClick={(e) => e.stopPropagation()}>
                    <input type="checkbox" aria-label={`Select ${r.id}`} checked={checked.has(r.id)} onChange={() => toggle(r.id)} />
                  </td>
                  <td><a {...linkProps({ view: 'unknowns', id: r.id })}>{time(r.received_at)}</a></td>
                  <td>{r.route ?? '—'}</td>
                  <td>{r.key_name ?? '—'} · {r.owner ?? '—'}</td>
                  <td className="mono small">{r.idempotency_key ?? <span className="muted">none</span>}</td>
                  <td>{r.channel ?? '—'}</td>
                  <td className="num">{r.attempts}</td>
                  <td>{age(r.received_at, now)}</td>
                </tr>
              ))}
            </tbody>
          </table>
          {picked.length > 0 && <BulkForm conn={conn} ids={picked} onDone={(m) => { setChecked(new Set()); setBulkMsg(m) }} />}
        </>
      )}
      {bulkMsg && <p role={bulkMsg.ok ? 'status' : 'alert'} className={bulkMsg.ok ? 'ok-text small' : 'error small'} data-testid="bulk-result">{bulkMsg.text}</p>}
      {selected && <Selected conn={conn} id={selected} listed={listed} />}
    </section>
  )
}

/** The selected request: from the page when it is there, else read by its id (an inbox
 * longer than a page, or a link from an alert). */
function Selected({ conn, id, listed }: { conn: Connection; id: string; listed: RequestDetail | undefined }) {
  const one = useQuery({
    queryKey: ['request', conn.url, id],
    queryFn: () => getRequest(conn, id),
    enabled: !listed,
  })
  const item = listed ?? one.data
  if (!item && one.isLoading) return <p className="muted">Loading {id}…</p>
  if (!item || item.request.state !== 'unknown') {
    return (
      <p className="muted" data-testid="unknown-gone">
        Request {id} is not waiting for reconciliation{item ? ` (it is ${item.request.state}${item.request.resolution?.reconciled_by ? `, reconciled by ${item.request.resolution.reconciled_by}` : ''})` : ''}. <a {...linkProps({ view: 'ledger', id })}>See it in the ledger.</a>
      </p>
    )
  }
  // Keyed by request: a form never carries one request's verdict over to the next.
  return <Evidence key={id} conn={conn} item={item} />
}

function Evidence({ conn, item }: { conn: Connection; item: RequestDetail }) {
  const r = item.request
  const facts: [string, string][] = [
    ['Request id', r.id],
    ['Client request id', r.client_request_id ?? '—'],
    ['Trace id', r.trace_id],
    ['Route', r.route ?? '—'],
    ['Channel it was calling', r.channel ?? '—'],
    ['First attempt', time(r.admitted_at)],
    ['Attempts made', String(r.attempts)],
    ['Upstream request id', r.upstream_request_id ?? 'none received'],
    ['Idempotency-Key', r.idempotency_key ?? 'none (the client cannot repeat it safely)'],
    ['Waiting to retry at', r.next_ready_at === null ? '—' : `${time(r.next_ready_at)} (no call was in flight)`],
    ['Why unknown', r.error_message ?? '—'],
  ]
  return (
    <article className="route-detail" data-testid="unknown-detail">
      <header>
        <h3>Evidence</h3>
        <a {...linkProps({ view: 'ledger', id: r.id })}>Open in the ledger</a>
      </header>
      <div className="split-2">
        <table className="grid" data-testid="unknown-facts">
          <tbody>{facts.map(([k, v]) => <tr key={k}><th>{k}</th><td className="small">{v}</td></tr>)}</tbody>
        </table>
        <ReconcileForm conn={conn} item={item} />
      </div>
      <h4>Attempts that ended before the stop</h4>
      {item.attempts.length === 0 ? (
        <p className="muted small">None: the attempt that was in flight (on {r.channel ?? 'its channel'}, from {time(r.admitted_at)}) never ended, so it has no row of its own.</p>
      ) : (
        <table className="grid" data-testid="unknown-attempts">
          <thead><tr><th>#</th><th>Channel</th><th>Started</th><th>Status</th><th>Class</th><th>Upstream id</th><th>Then</th><th>Message</th><th className="num">Cost</th></tr></thead>
          <tbody>
            {item.attempts.map((a) => (
              <tr key={a.attempt_no}>
                <td>{a.attempt_no}</td><td>{a.channel}</td><td>{time(a.started_at)}</td><td>{a.http_status ?? '—'}</td>
                <td>{failureClass(a.error_class)}</td><td className="mono small">{a.upstream_request_id ?? '—'}</td>
                <td>{decision(a.decision, a.decision_reason, a.delay_ms)}</td><td className="small">{a.message ?? ''}</td>
                <td className="num">{money(a.cost_usd)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </article>
  )
}

function ReconcileForm({ conn, item }: { conn: Connection; item: RequestDetail }) {
  const qc = useQueryClient()
  const [outcome, setOutcome] = useState<Reconciliation | null>(null)
  const [resultId, setResultId] = useState('')
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const ready = outcome !== null && actor.trim() !== '' && reason.trim() !== '' && (outcome !== 'confirmed_done' || resultId.trim() !== '')
  const submit = act(async () => {
    if (!outcome) return null
    const rec = await reconcile(conn, item.request.id, {
      outcome,
      result_id: outcome === 'confirmed_done' ? resultId.trim() : null,
      actor: actor.trim(),
      reason: reason.trim(),
    })
    qc.invalidateQueries({ queryKey: ['unknowns'] })
    return { ok: true, text: `Reconciled: the request is now ${rec.state}. Recorded on the audit log.` }
  })
  return (
    <form className="manual" onSubmit={submit} data-testid="reconcile-form">
      <h4>Reconcile</h4>
      <fieldset>
        <legend className="small">What did the provider do? Check its dashboard or logs for the request above.</legend>
        <label className="radio">
          <input type="radio" name="outcome" checked={outcome === 'confirmed_done'} onChange={() => setOutcome('confirmed_done')} data-testid="outcome-done" />
          <span>Confirmed done — the request becomes <em>done</em>; its key is never sent again (repeats get 409 naming the result).</span>
        </label>
        <label className="radio">
          <input type="radio" name="outcome" checked={outcome === 'confirmed_not_executed'} onChange={() => setOutcome('confirmed_not_executed')} data-testid="outcome-not-executed" />
          <span>Confirmed not executed — the request becomes <em>failed</em>; its key may be sent again, once.</span>
        </label>
      </fieldset>
      {outcome === 'confirmed_done' && (
        <label>Result id <input value={resultId} onChange={(e) => setResultId(e.target.value)} required maxLength={256} placeholder="e.g. the provider's response id" data-testid="reconcile-result" /></label>
      )}
      <label>Your name <input value={actor} onChange={(e) => setActor(e.target.value)} required maxLength={64} data-testid="reconcile-actor" /></label>
      <label>Reason <input value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500} placeholder="e.g. found in the provider's usage log" data-testid="reconcile-reason" /></label>
      <button type="submit" disabled={busy || !ready} data-testid="reconcile-submit">Reconcile</button>
      {msg && <p role={msg.ok ? 'status' : 'alert'} className={msg.ok ? 'ok-text small' : 'error small'}>{msg.text}</p>}
    </form>
  )
}

/** Many unknown requests after one incident: the checked ones confirmed as not executed
 * at once, with one reason, each on the audit log. */
function BulkForm({ conn, ids, onDone }: { conn: Connection; ids: string[]; onDone: (m: { ok: boolean; text: string }) => void }) {
  const qc = useQueryClient()
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const submit = act(async () => {
    const r = await reconcileBulk(conn, { ids, actor: actor.trim(), reason: reason.trim() })
    const left = r.refused.length ? ` ${r.refused.length} left as they were: ${r.refused.map((x) => x.error).join('; ')}` : ''
    // The outcome is the inbox's to show: this form closes with it.
    onDone({ ok: r.refused.length === 0, text: `${r.reconciled} confirmed not executed; their keys may run once more.${left}` })
    qc.invalidateQueries({ queryKey: ['unknowns'] })
    return null
  })
  return (
    <form className="inline-form" onSubmit={submit} data-testid="bulk-form">
      <span className="small">
        Confirm the <strong>{ids.length}</strong> checked request(s) as <em>not executed</em> — only when the provider’s own logs show none of them ran. Each becomes failed, and its key may be sent again once.
      </span>
      <input aria-label="Your name" placeholder="Your name" value={actor} onChange={(e) => setActor(e.target.value)} required maxLength={64} />
      <input aria-label="Reason" placeholder="Reason (goes on the audit log)" value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500} data-testid="bulk-reason" />
      <button type="submit" className="danger" disabled={busy || !actor.trim() || !reason.trim()} data-testid="bulk-submit">
        Confirm {ids.length} not executed
      </button>
      {msg && <p role={msg.ok ? 'status' : 'alert'} className={msg.ok ? 'ok-text small' : 'error small'}>{msg.text}</p>}
    </form>
  )
}
