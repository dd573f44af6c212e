// Workflow policies (J8): each workflow's version in force, where it comes from, whether
// it can be changed here, and every version on record, with a line diff against the one in
// force and a roll back (written to the workflow's file, applied at once, with who and why
// on the audit log). Invalid edits are listed first: the previous version stays in force.
import { useQuery, useQueryClient } from '@tanstack/react-query'
import { useState } from 'react'
import { getPolicies, getPolicyText, rollbackPolicy, type Connection } from './api'
import type { PolicyView } from './bindings/PolicyView'
import { diffLines, diffStat } from './diff'
import { count, time } from './format'
import { linkProps, navigate } from './router'
import { useOperatorAction } from './actor'

/** Why a workflow cannot be rolled back here, or null when it can. */
function readOnlyWhy(p: PolicyView, dir: string | null): string | null {
  if (p.editable) return null
  return dir === null
    ? 'Read-only: the built-in policies run (no policy directory). Set `workflows: DIR` in the gateway config to edit and roll back policies.'
    : `Read-only: ${p.workflow} is built in, not read from a file in ${dir}. Add a file for it there to edit it.`
}

export function PoliciesView({ conn, selected }: { conn: Connection; selected: string | null }) {
  const policies = useQuery({ queryKey: ['policies', conn.url], queryFn: () => getPolicies(conn), refetchInterval: 10_000 })
  if (policies.error) return <p role="alert" className="error">{(policies.error as Error).message}</p>
  if (!policies.data) return <section aria-busy className="empty"><p>Loading the policies…</p></section>
  const v = policies.data
  const open = selected ? v.workflows.find((w) => w.workflow === selected) : undefined
  return (
    <section>
      <h2>Workflow policies</h2>
      {v.problems.length > 0 && (
        <div role="alert" className="banner warn" data-testid="policy-problems">
          <strong>{count(v.problems.length)} policy file(s) hold an invalid edit; the previous version of each stays in force.</strong>
          <ul className="small">
            {v.problems.map((p) => <li key={p.file}><code>{p.file}</code>: {p.error}</li>)}
          </ul>
        </div>
      )}
      <p className="muted" data-testid="policies-source">
        {v.dir === null
          ? 'The built-in policies run; they are read-only. Set `workflows: DIR` in the gateway config to edit policies and roll them back.'
          : <>Read from <code>{v.dir}</code>: a valid edit to a file there applies within seconds; an invalid one is refused and listed above.</>}
      </p>
      <table className="grid selectable" data-testid="policies">
        <thead>
          <tr>
            <th>Workflow</th><th>Version in force</th><th>Source</th><th>Changes</th><th>Description</th>
            <th className="num">Versions on record</th>
          </tr>
        </thead>
        <tbody>
          {v.workflows.map((w) => (
            <tr key={w.workflow} aria-selected={w.workflow === selected} data-testid={`policy-${w.workflow}`}
              onClick={() => navigate({ view: 'policies', workflow: w.workflow })}>
              <td><a {...linkProps({ view: 'policies', workflow: w.workflow })}>{w.workflow}</a></td>
              <td className="mono small">{w.version}</td>
              <td className="small">{w.source}</td>
              <td>{w.editable ? <span className="pill ok">editable</span> : <span className="pill">built-in, read-only</span>}</td>
              <td className="small wrap">{w.description ?? '—'}</td>
              <td className="num">{count(w.versions.length)}</td>
            </tr>
          ))}
        </tbody>
      </table>
      {selected && (open
        ? <PolicyDetail key={selected} conn={conn} p={open} dir={v.dir} />
        : <p className="muted" data-testid="policy-gone">No workflow named {selected} is loaded.</p>)}
    </section>
  )
}

function PolicyDetail({ conn, p, dir }: { conn: Connection; p: PolicyView; dir: string | null }) {
  const [diffOf, setDiffOf] = useState<string | null>(null)
  const [rollbackTo, setRollbackTo] = useState<string | null>(null)
  const versions = [...p.versions].sort((a, b) => b.loaded_at - a.loaded_at)
  const why = readOnlyWhy(p, dir)
  return (
    <article className="route-detail" data-testid="policy-detail">
      <header>
        <h3>{p.workflow}</h3>
        <span className="mono small">version {p.version}</span>
        {p.editable ? <span className="pill ok">editable</span> : <span className="pill">built-in, read-only</span>}
        <a {...linkProps({ view: 'policies', workflow: null })}>Close</a>
      </header>
      {p.description && <p>{p.description}</p>}
      <p className="small muted">Source: {p.source}</p>
      <h4>Versions on record, newest first</h4>
      {versions.length === 0 ? (
        <p className="muted small">None recorded yet: versions are recorded when the gateway loads them.</p>
      ) : (
        <table className="grid" data-testid="policy-versions">
          <thead><tr><th>Version</th><th>Loaded</th><th>Source</th><th>Actions</th></tr></thead>
          <tbody>
            {versions.map((ver) => {
              const current = ver.version === p.version
              return (
                <tr key={`${ver.version}-${ver.loaded_at}`} data-testid={`policy-version-${ver.version}`}>
                  <td className="mono small">{ver.version}{current && <> <span className="pill ok">in force</span></>}</td>
                  <td>{time(ver.loaded_at)}</td>
                  <td className="small">{ver.source}</td>
                  <td>
                    {current ? (
                      <span className="muted small">—</span>
                    ) : (
                      <div className="row-actions">
                        <button type="button" aria-pressed={diffOf === ver.version} onClick={() => setDiffOf(diffOf === ver.version ? null : ver.version)}
                          data-testid={`policy-diff-${ver.version}`}>Diff with current</button>
                        <button type="button" onClick={() => setRollbackTo(ver.version)} data-testid={`policy-rollback-${ver.version}`}>
                          Roll back to this version…
                        </button>
                      </div>
                    )}
                  </td>
                </tr>
              )
            })}
          </tbody>
        </table>
      )}
      {diffOf && <PolicyDiff conn={conn} workflow={p.workflow} from={diffOf} to={p.version} />}
      {rollbackTo && <RollbackForm key={rollbackTo} conn={conn} p={p} version={rollbackTo} readOnly={why} onCancel={() => setRollbackTo(null)} />}
    </article>
  )
}

/** Version `from` against the version in force `to`, line by line. */
function PolicyDiff({ conn, workflow, from, to }: { conn: Connection; workflow: string; from: string; to: string }) {
  const older = useQuery({ queryKey: ['policy-text', conn.url, workflow, from], queryFn: () => getPolicyText(conn, workflow, from), staleTime: Infinity })
  const newer = useQuery({ queryKey: ['policy-text', conn.url, workflow, to], queryFn: () => getPolicyText(conn, workflow, to), staleTime: Infinity })
  const err = older.error ?? newer.error
  if (err) return <p role="alert" className="error">{(err as Error).message}</p>
  if (!older.data || !newer.data) return <p className="muted" aria-busy>Loading versions {from} and {to}…</p>
  const lines = diffLines(older.data.text, newer.data.text)
  const stat = diffStat(lines)
  return (
    <figure className="diff-box">
      <figcaption className="small" data-testid="policy-diff-summary">
        From version <code>{from}</code> to the version in force <code>{to}</code>:{' '}
        {stat.added === 0 && stat.removed === 0 ? 'the texts are the same.' : `${count(stat.added)} line(s) added (+), ${count(stat.removed)} removed (-).`}
      </figcaption>
      <pre className="diff" tabIndex={0} data-testid="policy-diff">
        {lines.map((l, i) => (
          <span key={i} className={l.op === '+' ? 'diff-add' : l.op === '-' ? 'diff-del' : undefined}>{l.op}{l.text}{'\n'}</span>
        ))}
      </pre>
    </figure>
  )
}

/** J8: a roll back, with who and why; refused (and said why) for a read-only workflow. */
function RollbackForm({ conn, p, version, readOnly, onCancel }: { conn: Connection; p: PolicyView; version: string; readOnly: string | null; onCancel: () => void }) {
  const qc = useQueryClient()
  const { actor, setActor, reason, setReason, busy, msg, act } = useOperatorAction()
  const submit = act(async () => {
    const r = await rollbackPolicy(conn, p.workflow, { version, actor: actor.trim(), reason: reason.trim() })
    setReason('')
    qc.invalidateQueries({ queryKey: ['policies'] })
    return { ok: true, text: `Workflow ${r.workflow} is at version ${r.version} now: written to its file and applied. Recorded on the audit log.` }
  })
  return (
    <form className="manual rollback-form" onSubmit={submit} data-testid="rollback-form" aria-labelledby="rollback-title">
      <h4 id="rollback-title">Roll {p.workflow} back to version {version}</h4>
      <p className="small">
        Writes version {version}’s text to the workflow’s policy file and applies it at once, to new and queued jobs alike. The
        version in force now, {p.version}, stays on record and can be put back the same way.
      </p>
      {readOnly && <p className="warn-text small" data-testid="rollback-readonly">{readOnly}</p>}
      <label>Your name
        <input value={actor} onChange={(e) => setActor(e.target.value)} required maxLength={64} disabled={readOnly !== null} data-testid="rollback-actor" />
      </label>
      <label>Reason
        <input value={reason} onChange={(e) => setReason(e.target.value)} required maxLength={500} disabled={readOnly !== null}
          placeholder="e.g. version b7 doubled the retries" data-testid="rollback-reason" />
      </label>
      <div className="row-actions">
        <button type="submit" className="danger" disabled={busy || readOnly !== null || !actor.trim() || !reason.trim()} data-testid="rollback-submit">
          Roll back to {version}
        </button>
        <button type="button" onClick={onCancel}>Cancel</button>
      </div>
      {msg && <p role={msg.ok ? 'status' : 'alert'} className={msg.ok ? 'ok-text small' : 'error small'} data-testid="rollback-result">{msg.text}</p>}
    </form>
  )
}
