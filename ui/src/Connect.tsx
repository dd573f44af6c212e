import { useState } from 'react'
import { ApiError, getOverview, type Connection } from './api'

/** Gateway URL and admin token, for the browser build. */
export function ConnectView({ initial, onConnect }: { initial: Connection; onConnect: (c: Connection) => void }) {
  const [url, setUrl] = useState(initial.url)
  const [token, setToken] = useState(initial.token)
  const [error, setError] = useState<string | null>(null)
  const [busy, setBusy] = useState(false)

  const submit = async (e: React.FormEvent) => {
    e.preventDefault()
    setBusy(true)
    setError(null)
    const conn = { url: url.trim(), token: token.trim() }
    try {
      await getOverview(conn)
      onConnect(conn)
    } catch (err) {
      setError(err instanceof ApiError && err.status === 401 ? `The gateway refused this admin token: ${err.message}` : String((err as Error).message))
    } finally {
      setBusy(false)
    }
  }

  return (
    <section className="connect">
      <h1>Connect to a gateway</h1>
      <p className="muted">Run <code>spillway admin-token</code> on the gateway’s machine to see its token.</p>
      <form onSubmit={submit}>
        <label>Gateway URL<input value={url} onChange={(e) => setUrl(e.target.value)} required data-testid="connect-url" /></label>
        <label>Admin token<input value={token} onChange={(e) => setToken(e.target.value)} required type="password" autoComplete="off" data-testid="connect-token" /></label>
        <button type="submit" disabled={busy || !url.trim() || !token.trim()}>{busy ? 'Connecting…' : 'Connect'}</button>
      </form>
      {error && <p role="alert" className="error" data-testid="connect-error">{error}</p>}
    </section>
  )
}
