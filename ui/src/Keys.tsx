// Keys (B3, B5): every key with its owner, limits and spend; making a key (its secret is
// shown once, here, and never stored by the console), a key's spend limit, and revoking a
// key made here. Each asks who and why and says what it will do before it does it.
import { useQuery, useQueryClient } from '@tanstack/react-query'
import { useEffect, useRef, useState } from 'react'
import { createKey, getCosts, getKeys, revokeKey, setSpendLimit, type Connection } from './api'
import type { KeyView } from './bindings/KeyView'
import type { MadeKey } from './bindings/MadeKey'
import { count, money, time } from './format'
import { useOperatorAction } from './actor'

/** An optional number field: empty is null; otherwise a number ≥ 0 (a whole one ≥ 1 when
 * `whole`), or undefined when it is neither. */
function optionalNumber(text: string, whole: boolean): number | null | undefined {
  const t = text.trim()
  if (t === '') return null
  const v = Number(t)
  if (!Number.isFinite(v) || v < 0) return undefined
  if (whole && (!Number.isInteger(v) || v < 1)) return undefined
  return v
}

export function KeysView({ conn }: { conn: Connection }) {
  const qc = useQueryClient()
  const keys = useQuery({ queryKey: ['keys', conn.url], queryFn: () => getKeys(conn), refetchInterval: 10_000 })
  // The owners to choose from, from the cost report's shortest window.
  const costs = useQuery({ queryKey: ['costs', conn.url, 1], queryFn: () => getCosts(conn, 1) })
  // The secret lives in this view's state only: never in storage, gone when it is
  // dismissed or the view is left.
  const [made, setMade] = useState<MadeKey | null>(null)
  const owners: string[] | 'loading' | null = costs.data ? costs.data.owners.map((o) => o.name) : costs.isPending ? 'loading' : null
  return (
    <section>
      <h2>Keys</h2>
      <p className="muted">
        Clients call the gateway with one of these keys. Keys from the config are changed in the config; keys made here can be
        revoked here. Every change goes on the audit log with who made it and why.
      </p>
      {keys.error && <p role="alert" className="error">{(keys.error as Error).message}</p>}
      {!keys.data ? (
        !keys.error && <p className="muted" aria-busy>Loading keys…</p>
      ) : keys.data.length === 0 ? (
        <p className="muted" data-testid="keys-empty">No keys yet: make one below, or add one to the config.</p>
      ) : (
        <table className="grid" data-testid="keys">
          <thead>
            <tr>
              <th>Name</th><th>Owner</th><th>Origin</th><th title="The secret's first characters">Hint</th>
              <th className="num" title="Requests per minute">RPM</th><th className="num" title="Requests at once">Concurrency</th>
              <th className="num">Spend limit</th><th className="num">Spent</th><th>Created</th><th>Status</th><th>Change</th>
            </tr>
          </thead>
          <tbody>
            {keys.data.map((k) => <KeyRow key={k.name} conn={conn} k={k} />)}
          </tbody>
        </table>
      )}
      <h2>Make a key</h2>
      {made ? (
        <NewSecret made={made} onDismiss={() => setMade(null)} />
      ) : (
        <MakeKeyForm conn={conn} owners={owners} onMade={(m) => {
          setMade(m)
          qc.invalidateQueries({ queryKey: ['keys'] })
        }} />
      )}
    </section>
  )
}

function KeyRow({ conn, k }: { conn: Connection; k: KeyView }) {
  const [open, setOpen] = useState<'limit' | 'revoke' | null>(null)
  const [note, setNote] = useState<string | null>(null)
  const done = (text: string) => {
    setOpen(null)
    setNote(text)
  }
  const revoked = k.revoked_at !== null
  const atLimit = k.spend_limit_usd !== null && k.spent_usd >= k.spend_limit_usd
  return (
    <tr data-testid={`key-${k.name}`}>
      <td>{k.name}</td>
      <td>{k.owner}</td>
      <td>{k.origin}</td>
      <td className="mono">{k.hint ? `${k.hint}…` : '—'}</td>
      <td className="num">{k.rpm === null ? '—' : count(k.rpm)}</td>
      <td className="num">{k.max_concurrency === null ? '—' : count(k.max_concurrency)}</td>
      <td className="num">{k.spend_limit_usd === null ? 'none' : money(k.spend_limit_usd)}</td>
      <td className="num">{money(k.spent_usd)}</td>
      <td className="small">
        {k.created_by ?? (k.origin === 'config' ? 'config' : '—')}
        {k.created_at !== null && <div className="muted">{time(k.created_at)}</div>}
      </td>
      <td data-testid="key-status">
        {revoked ? (
          <>
            <span className="pill bad">revoked</span>
            <div className="muted small">{k.revoked_by ? `by ${k.revoked_by} ` : ''}at {time(k.revoked_at)}</div>
          </>
        ) : (
          <>
            <span className="pill ok">active</span>
            {atLimit && <> <span className="pill warn">spend limit reached</span></>}
          </>
        )}
      </td>
      <td>
        {revoked ? (
          <span className="muted">—</span>
        ) : (
          <>
            {open === null && (
              <div className="row-actions">
                <button type="button" onClick={() => { setNote(null); setOpen('limit') }} data-testid={`limit-${k.name}`}>Spend limit…</button>
                {k.origin === 'console'
                  ? <button type="button" className="danger" onClick={() => { setNote(null); setOpen('revoke') }} data-testid={`revoke-${k.name}`}>Revoke…</button>
                  : <span className="muted small">from the config; remove it there</span>}
              </div>
            )}
            {open === 'limit' && <SpendLimitForm conn={conn} k={k} onDone={done} onCancel={() => setOpen(null)} />}
            {open === 'revoke' && <RevokeForm conn={conn} k={k} onDone={done} onCancel={() => setOpen(null)} />}
          </>
        )}
        {note && <div role="status" className="ok-text small" data-testid="key-result">{note}</div>}
      </td>
    </tr>
  )
}

/** B3: a key's spend limit, or none. */
function SpendLimitForm({ conn, k, onDone, onCancel }: { conn: Connection; k: KeyView; onDone: (text: string) => void; onCancel: () => void }) {
  const qc = useQueryClient()
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const [limit, setLimit] = useState(k.spend_limit_usd === null ? '' : String(k.spend_limit_usd))
  const value = optionalNumber(limit, false)
  const submit = act(async () => {
    if (value === undefined) return null
    const v = await setSpendLimit(conn, k.name, { spend_limit_usd: value, actor: actor.trim(), reason: reason.trim() })
    qc.invalidateQueries({ queryKey: ['keys'] })
    onDone(v.spend_limit_usd === null ? `${v.name} has no spend limit now.` : `${v.name}’s spend limit is ${money(v.spend_limit_usd)} now.`)
    return null
  })
  return (
    <form onSubmit={submit} className="inline-form" data-testid="limit-form">
      <label>Spend limit (USD; empty for none)
        <input type="number" min={0} step={0.01} inputMode="decimal" value={limit} onChange={(e) => setLimit(e.target.value)} data-testid="limit-value" />
      </label>
      <span className="small" data-testid="limit-effect">
        {value === undefined
          ? 'Give an amount in USD, or leave it empty for no limit.'
          : value === null
            ? `No limit: ${k.name} is held only to ${k.owner}’s balance and budget.`
            : `Requests with ${k.name} are refused once it has spent ${money(value)} (it has spent ${money(k.spent_usd)}${k.spent_usd >= value ? ', so they are refused from now on' : ''}).`}
      </span>
      <label>Your name
        <input value={actor} onChange={(e) => setActor(e.target.value)} required maxLength={64} data-testid="limit-actor" />
      </label>
      <label>Reason
        <input value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500} data-testid="limit-reason" />
      </label>
      <button type="submit" disabled={busy || value === undefined || !actor.trim() || !reason.trim()} data-testid="limit-submit">
        {value === null ? 'Remove the limit' : 'Set the limit'}
      </button>
      <button type="button" onClick={onCancel}>Cancel</button>
      {msg && <p role={msg.ok ? 'status' : 'alert'} className={msg.ok ? 'ok-text small' : 'error small'}>{msg.text}</p>}
    </form>
  )
}

/** B5: revoking a key made here, after saying what it does. */
function RevokeForm({ conn, k, onDone, onCancel }: { conn: Connection; k: KeyView; onDone: (text: string) => void; onCancel: () => void }) {
  const qc = useQueryClient()
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const submit = act(async () => {
    const v = await revokeKey(conn, k.name, { actor: actor.trim(), reason: reason.trim() })
    qc.invalidateQueries({ queryKey: ['keys'] })
    onDone(`${v.name} is revoked. Recorded on the audit log.`)
    return null
  })
  return (
    <form onSubmit={submit} className="inline-form" data-testid="revoke-form">
      <span className="small" data-testid="revoke-effect">
        Revoke <strong>{k.name}</strong> ({k.owner}): requests with this key get 401 from now on; this cannot be undone.
      </span>
      <label>Your name
        <input value={actor} onChange={(e) => setActor(e.target.value)} required maxLength={64} data-testid="revoke-actor" />
      </label>
      <label>Reason
        <input value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500} placeholder="e.g. leaked in a CI log" data-testid="revoke-reason" />
      </label>
      <button type="submit" className="danger" disabled={busy || !actor.trim() || !reason.trim()} data-testid="revoke-confirm">
        Revoke {k.name}
      </button>
      <button type="button" onClick={onCancel}>Cancel</button>
      {msg && <p role={msg.ok ? 'status' : 'alert'} className={msg.ok ? 'ok-text small' : 'error small'}>{msg.text}</p>}
    </form>
  )
}

/** B5: a new key, with who asks for it and why. `owners` is the list to choose from, or
 * 'loading', or null when it could not be read (then the owner is typed). */
function MakeKeyForm({ conn, owners, onMade }: { conn: Connection; owners: string[] | 'loading' | null; onMade: (m: MadeKey) => void }) {
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const [f, setF] = useState({ name: '', owner: '', rpm: '', concurrency: '', limit: '' })
  const rpm = optionalNumber(f.rpm, true)
  const concurrency = optionalNumber(f.concurrency, true)
  const limit = optionalNumber(f.limit, false)
  const name = f.name.trim()
  const owner = f.owner.trim()
  const ready = name !== '' && owner !== '' && actor.trim() !== '' && reason.trim() !== '' && rpm !== undefined && concurrency !== undefined && limit !== undefined
  const submit = act(async () => {
    if (rpm === undefined || concurrency === undefined || limit === undefined) return null
    const m = await createKey(conn, { name, owner, rpm, max_concurrency: concurrency, spend_limit_usd: limit, actor: actor.trim(), reason: reason.trim() })
    setF({ name: '', owner: '', rpm: '', concurrency: '', limit: '' })
    setReason('')
    onMade(m)
    return null
  })
  const limits = [
    rpm ? `${count(rpm)} requests a minute` : null,
    concurrency ? `${count(concurrency)} at once` : null,
    limit !== null && limit !== undefined ? `a spend limit of ${money(limit)}` : null,
  ].filter(Boolean)
  return (
    <form onSubmit={submit} className="manual key-form" data-testid="make-key-form">
      <label>Name
        <input value={f.name} onChange={(e) => setF({ ...f, name: e.target.value })} required maxLength={64} placeholder="e.g. ci-bot" data-testid="new-key-name" />
      </label>
      {Array.isArray(owners) && owners.length > 0 ? (
        <label>Owner
          <select value={f.owner} onChange={(e) => setF({ ...f, owner: e.target.value })} required data-testid="new-key-owner">
            <option value="">Choose an owner</option>
            {owners.map((o) => <option key={o} value={o}>{o}</option>)}
          </select>
        </label>
      ) : owners === 'loading' ? (
        <label>Owner
          <select value="" disabled data-testid="new-key-owner"><option value="">Loading owners…</option></select>
        </label>
      ) : (
        <label>Owner
          <input value={f.owner} onChange={(e) => setF({ ...f, owner: e.target.value })} required maxLength={64} data-testid="new-key-owner" />
        </label>
      )}
      <label>Requests per minute (optional)
        <input type="number" min={1} step={1} value={f.rpm} onChange={(e) => setF({ ...f, rpm: e.target.value })} data-testid="new-key-rpm" />
      </label>
      <label>Max concurrency (optional)
        <input type="number" min={1} step={1} value={f.concurrency} onChange={(e) => setF({ ...f, concurrency: e.target.value })} data-testid="new-key-concurrency" />
      </label>
      <label>Spend limit, USD (optional)
        <input type="number" min={0} step={0.01} inputMode="decimal" value={f.limit} onChange={(e) => setF({ ...f, limit: e.target.value })} data-testid="new-key-limit" />
      </label>
      <label>Your name
        <input value={actor} onChange={(e) => setActor(e.target.value)} required maxLength={64} data-testid="new-key-actor" />
      </label>
      <label>Reason
        <input value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500} placeholder="e.g. nightly evaluation job" data-testid="new-key-reason" />
      </label>
      <p className="small" data-testid="new-key-effect">
        {name && owner
          ? <>Makes <strong>{name}</strong> for {owner}{limits.length ? `, with ${limits.join(', ')}` : ', with no limits of its own'}; its spend counts to {owner}.</>
          : 'Give the key a name and an owner.'}{' '}
        The secret is shown once, here; the gateway keeps only its hash.
      </p>
      <button type="submit" disabled={busy || !ready} data-testid="new-key-submit">Make the key</button>
      {msg && <p role={msg.ok ? 'status' : 'alert'} className={msg.ok ? 'ok-text small' : 'error small'}>{msg.text}</p>}
    </form>
  )
}

/** The new key's secret, this once: copy it, then dismiss it. */
function NewSecret({ made, onDismiss }: { made: MadeKey; onDismiss: () => void }) {
  const [copied, setCopied] = useState<{ ok: boolean; text: string } | null>(null)
  const box = useRef<HTMLElement>(null)
  useEffect(() => {
    box.current?.focus()
  }, [])
  const copy = async () => {
    try {
      await navigator.clipboard.writeText(made.secret)
      setCopied({ ok: true, text: 'Copied.' })
    } catch {
      setCopied({ ok: false, text: 'The browser refused to copy: select the secret and copy it by hand.' })
    }
  }
  return (
    <section className="secret-panel" ref={box} tabIndex={-1} aria-labelledby="new-key-title" data-testid="new-key">
      <h3 id="new-key-title">Key {made.key.name} made for {made.key.owner}</h3>
      <p>
        <strong>Shown once: store it now.</strong> The gateway keeps only its hash, so nobody can show this secret again; if it
        is lost, revoke the key and make another.
      </p>
      <code className="secret" data-testid="new-key-secret">{made.secret}</code>
      <div className="row-actions">
        <button type="button" onClick={copy} data-testid="new-key-copy">Copy the secret</button>
        <button type="button" onClick={onDismiss} data-testid="new-key-dismiss">I have stored it: hide it</button>
      </div>
      {copied && <p role={copied.ok ? 'status' : 'alert'} className={copied.ok ? 'ok-text small' : 'error small'}>{copied.text}</p>}
    </section>
  )
}
