import { useEffect, useState } from 'react'
import type { Connection } from './api'
import { BreakersView } from './Breakers'
import { AuditView } from './Audit'
import { ConnectView } from './Connect'
import { CostsView } from './Costs'
import { DeadLettersView } from './DeadLetters'
import { FleetView } from './Fleet'
import { KeysView } from './Keys'
import { LedgerView } from './Ledger'
import { OverviewView } from './Overview'
import { PoliciesView } from './Policies'
import { RecoveriesView } from './Recovery'
import { ReviewsView } from './Reviews'
import { ScorecardView } from './Scorecard'
import { UnknownsView } from './Unknowns'
import { linkProps, navigate, useRoute } from './router'

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
  const route = useRoute()

  useEffect(() => {
    const onKey = (e: KeyboardEvent) => {
      const typing = e.target instanceof HTMLInputElement || e.target instanceof HTMLSelectElement || e.target instanceof HTMLTextAreaElement
      if (typing || e.altKey || e.ctrlKey || e.metaKey) return
      if (e.key === '1') navigate({ view: 'overview' })
      if (e.key === '2') navigate({ view: 'breakers', route: null })
      if (e.key === '3') navigate({ view: 'ledger', id: null })
      if (e.key === '4') navigate({ view: 'unknowns', id: null })
      if (e.key === '5') navigate({ view: 'costs' })
      if (e.key === '6') navigate({ view: 'keys' })
      if (e.key === '7') navigate({ view: 'reviews', id: null })
      if (e.key === '8') navigate({ view: 'deadletters', id: null })
      if (e.key === '9') navigate({ view: 'policies', workflow: null })
      if (e.key === '0') navigate({ view: 'audit' })
      // Letters past the ten digits: r, s and f are used by no view (the ledger's are /, j and k).
      if (e.key === 'r') navigate({ view: 'recovery', id: null })
      if (e.key === 's') navigate({ view: 'scorecard', run: null, route: null })
      if (e.key === 'f') navigate({ view: 'fleet' })
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
          <a {...linkProps({ view: 'overview' })} aria-current={route.view === 'overview' ? 'page' : undefined} title="Overview (1)">Overview</a>
          <a {...linkProps({ view: 'breakers', route: null })} aria-current={route.view === 'breakers' ? 'page' : undefined} title="Breakers (2)">Breakers</a>
          <a {...linkProps({ view: 'ledger', id: null })} aria-current={route.view === 'ledger' ? 'page' : undefined} title="Ledger (3)">Ledger</a>
          <a {...linkProps({ view: 'unknowns', id: null })} aria-current={route.view === 'unknowns' ? 'page' : undefined} title="Unknown outcomes (4)">Unknowns</a>
          <a {...linkProps({ view: 'costs' })} aria-current={route.view === 'costs' ? 'page' : undefined} title="Costs, budgets and balances (5)">Costs</a>
          <a {...linkProps({ view: 'keys' })} aria-current={route.view === 'keys' ? 'page' : undefined} title="Keys (6)">Keys</a>
          <a {...linkProps({ view: 'reviews', id: null })} aria-current={route.view === 'reviews' ? 'page' : undefined} title="Owner review: background jobs held for a person (7)">Reviews</a>
          <a {...linkProps({ view: 'deadletters', id: null })} aria-current={route.view === 'deadletters' ? 'page' : undefined} title="Dead letters: background jobs that gave up, and their reviewed replays (8)">Dead letters</a>
          <a {...linkProps({ view: 'policies', workflow: null })} aria-current={route.view === 'policies' ? 'page' : undefined} title="Workflow policies and their versions (9)">Policies</a>
          <a {...linkProps({ view: 'audit' })} aria-current={route.view === 'audit' ? 'page' : undefined} title="Audit log: every change, with who and why (0)">Audit</a>
          <a {...linkProps({ view: 'recovery', id: null })} aria-current={route.view === 'recovery' ? 'page' : undefined} title="Guided recovery: a route's checklist from isolation to close, and drills (r)">Recovery</a>
          <a {...linkProps({ view: 'scorecard', run: null, route: null })} aria-current={route.view === 'scorecard' ? 'page' : undefined} title="Scorecard: before, during and after an incident (s)">Scorecard</a>
          <a {...linkProps({ view: 'fleet' })} aria-current={route.view === 'fleet' ? 'page' : undefined} title="Fleet: the gateway instances sharing the ledger and Redis, their heartbeats and load (f)">Fleet</a>
        </nav>
        <span className="muted gateway">{conn.url}</span>
        <button className="link" onClick={() => { sessionStorage.removeItem(KEY); setConn(null) }}>Disconnect</button>
      </header>
      <main>
        {route.view === 'overview' && <OverviewView conn={conn} />}
        {route.view === 'breakers' && <BreakersView conn={conn} selected={route.route} />}
        {route.view === 'ledger' && <LedgerView conn={conn} selected={route.id} />}
        {route.view === 'unknowns' && <UnknownsView conn={conn} selected={route.id} />}
        {route.view === 'costs' && <CostsView conn={conn} />}
        {route.view === 'keys' && <KeysView conn={conn} />}
        {route.view === 'reviews' && <ReviewsView conn={conn} selected={route.id} />}
        {route.view === 'deadletters' && <DeadLettersView conn={conn} selected={route.id} />}
        {route.view === 'policies' && <PoliciesView conn={conn} selected={route.workflow} />}
        {route.view === 'audit' && <AuditView conn={conn} />}
        {route.view === 'recovery' && <RecoveriesView conn={conn} selected={route.id} />}
        {route.view === 'scorecard' && <ScorecardView conn={conn} run={route.run} route={route.route} />}
        {route.view === 'fleet' && <FleetView conn={conn} />}
      </main>
    </>
  )
}
