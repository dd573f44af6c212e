// Views have URLs, so a breaker, a route or a request can be linked to and the back button
// works. Paths, not fragments: the fragment carries the admin token once, at first load.
import { useEffect, useState } from 'react'

export type Route =
  | { view: 'overview' }
  | { view: 'breakers'; route: string | null }
  | { view: 'ledger'; id: string | null }
  | { view: 'unknowns'; id: string | null }
  | { view: 'costs' }
  | { view: 'keys' }
  | { view: 'reviews'; id: string | null }
  | { view: 'deadletters'; id: string | null }
  | { view: 'policies'; workflow: string | null }
  | { view: 'audit' }
  | { view: 'recovery'; id: string | null }
  | { view: 'scorecard'; run: string | null; route: string | null }
  | { view: 'fleet' }

/** `path` may carry a query: the scorecard's run or route is there (`/scorecard?run=ID`). */
export function parse(path: string): Route {
  const q = path.indexOf('?')
  const search = new URLSearchParams(q >= 0 ? path.slice(q + 1) : '')
  const parts = (q >= 0 ? path.slice(0, q) : path).split('/').filter(Boolean).map(decodeURIComponent)
  if (parts[0] === 'breakers') return { view: 'breakers', route: parts.length > 1 ? parts.slice(1).join('/') : null }
  if (parts[0] === 'ledger') return { view: 'ledger', id: parts[1] ?? null }
  if (parts[0] === 'unknowns') return { view: 'unknowns', id: parts[1] ?? null }
  if (parts[0] === 'costs') return { view: 'costs' }
  if (parts[0] === 'keys') return { view: 'keys' }
  if (parts[0] === 'reviews') return { view: 'reviews', id: parts[1] ?? null }
  if (parts[0] === 'dead-letters') return { view: 'deadletters', id: parts[1] ?? null }
  if (parts[0] === 'policies') return { view: 'policies', workflow: parts[1] ?? null }
  if (parts[0] === 'audit') return { view: 'audit' }
  if (parts[0] === 'recovery') return { view: 'recovery', id: parts[1] ?? null }
  if (parts[0] === 'scorecard') return { view: 'scorecard', run: search.get('run') || null, route: search.get('route') || null }
  if (parts[0] === 'fleet') return { view: 'fleet' }
  return { view: 'overview' }
}

export function href(r: Route): string {
  switch (r.view) {
    case 'overview':
      return '/'
    case 'breakers':
      // A route is `format/model`; the model may hold any character but a slash.
      return r.route ? `/breakers/${r.route.split('/').map(encodeURIComponent).join('/')}` : '/breakers'
    case 'ledger':
      return r.id ? `/ledger/${encodeURIComponent(r.id)}` : '/ledger'
    case 'unknowns':
      return r.id ? `/unknowns/${encodeURIComponent(r.id)}` : '/unknowns'
    case 'costs':
      return '/costs'
    case 'keys':
      return '/keys'
    case 'reviews':
      return r.id ? `/reviews/${encodeURIComponent(r.id)}` : '/reviews'
    case 'deadletters':
      return r.id ? `/dead-letters/${encodeURIComponent(r.id)}` : '/dead-letters'
    case 'policies':
      return r.workflow ? `/policies/${encodeURIComponent(r.workflow)}` : '/policies'
    case 'audit':
      return '/audit'
    case 'recovery':
      return r.id ? `/recovery/${encodeURIComponent(r.id)}` : '/recovery'
    case 'scorecard': {
      const p = new URLSearchParams()
      if (r.run) p.set('run', r.run)
      if (r.route) p.set('route', r.route)
      const s = p.toString()
      return s ? `/scorecard?${s}` : '/scorecard'
    }
    case 'fleet':
      return '/fleet'
  }
}

/** Query parameters that belong to a view: they go with it, never on to the next one. */
const VIEW_PARAMS = ['run', 'route']

/** `r`'s URL with the page's other query parameters kept, as moves always kept them. */
function withKeptQuery(r: Route): string {
  const [path, own = ''] = href(r).split('?')
  const q = new URLSearchParams(own)
  for (const [k, v] of new URLSearchParams(window.location.search)) {
    if (!VIEW_PARAMS.includes(k) && !q.has(k)) q.append(k, v)
  }
  const s = q.toString()
  return s ? `${path}?${s}` : path
}

const EVENT = 'spillway:navigate'

/** Goes to `r`; `replace` keeps the back button for real moves only. */
export function navigate(r: Route, replace = false) {
  const url = withKeptQuery(r)
  if (url === window.location.pathname + window.location.search) return
  if (replace) history.replaceState(null, '', url)
  else history.pushState(null, '', url)
  window.dispatchEvent(new Event(EVENT))
}

export function useRoute(): Route {
  const [route, setRoute] = useState<Route>(() => parse(window.location.pathname + window.location.search))
  useEffect(() => {
    const update = () => setRoute(parse(window.location.pathname + window.location.search))
    window.addEventListener('popstate', update)
    window.addEventListener(EVENT, update)
    return () => {
      window.removeEventListener('popstate', update)
      window.removeEventListener(EVENT, update)
    }
  }, [])
  return route
}

/** A link that navigates in place (and still opens in a new tab with a middle click). */
export function linkProps(r: Route) {
  return {
    href: href(r),
    onClick: (e: { button: number; metaKey: boolean; ctrlKey: boolean; shiftKey: boolean; preventDefault: () => void }) => {
      if (e.button !== 0 || e.metaKey || e.ctrlKey || e.shiftKey) return
      e.preventDefault()
      navigate(r)
    },
  }
}
