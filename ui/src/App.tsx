import { useEffect, useState } from 'react'
import type { Connection } from './api'
import { ConnectView } from './Connect'
import { LedgerView } from './Ledger'
import { OverviewView } from './Overview'

type View = 'overview' | 'ledger'
const KEY = 'spillway.connection'

/** The token arrives once in the URL fragment (never sent to a server), then lives in
 * this tab's session storage only. */
function initialConnection(): Connection | null {
  const frag = new URLSearchParams(window.location.hash.slice(1))
  const token = frag.get('token')
  if (token) {
    const conn = { url: window.location.origin, token }
    sessionStorage.setItem(KEY, JSON.stringify(conn))
    history.replaceState(null, '', window.location.pathname + window.location.search)
    return conn
  }
  const saved = sessionStorage.getItem(KEY)
  return saved ? (JSON.parse(saved) as Connection) : null
}

export function App() {
  const [conn, setConn] = useState<Connection | null>(initialConnection)
  const [view, setView] = useState<View>('overview')

  useEffect(() => {
    const onKey = (e: KeyboardEvent) => {
      if (e.target instanceof HTMLInputElement || e.target instanceof HTMLSelectElement || e.altKey || e.ctrlKey || e.metaKey) return
      if (e.key === '1') setView('overview')
      if (e.key === '2') setView('ledger')
    }
    window.addEventListener('keydown', onKey)
    return () => window.removeEventListener('keydown', onKey)
  }, [])

  if (!conn) {
    return (
      <main>
        <ConnectView
          initial={{ url: window.location.origin, token: '' }}
          onConnect={(c) => {
            sessionStorage.setItem(KEY, JSON.stringify(c))
            setConn(c)
          }}
        />
      </main>
    )
  }
  return (
    <>
      <header className="top">
        <strong className="brand">Spillway</strong>
        <nav aria-label="Views">
          <button aria-current={view === 'overview'} onClick={() => setView('overview')} title="Overview (1)">Overview</button>
          <button aria-current={view === 'ledger'} onClick={() => setView('ledger')} title="Ledger (2)">Ledger</button>
        </nav>
        <span className="muted gateway">{conn.url}</span>
        <button className="link" onClick={() => { sessionStorage.removeItem(KEY); setConn(null) }}>Disconnect</button>
      </header>
      <main>{view === 'overview' ? <OverviewView conn={conn} /> : <LedgerView conn={conn} />}</main>
    </>
  )
}
