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

export function parse(path: string): Route {
  const parts = path.split('/').filter(Boolean).map(decodeURIComponent)
  if (parts[0] === 'breakers') return { view: 'breakers', route: parts.length > 1 ? parts.slice(1).join('/') : null }
  if (parts[0] === 'ledger') return { view: 'ledger', id: parts[1] ?? null }
  if (parts[0] === 'unknowns') return { view: 'unknowns', id: parts[1] ?? null }
  if (parts[0] === 'costs') return { view: 'costs' }
  if (parts[0] === 'keys') return { view: 'keys' }
  if (parts[0] === 'reviews') return { view: 'reviews', id: parts[1] ?? null }
  if (parts[0] === 'dead-letters') return { view: 'deadletters', id: parts[1] ?? null }
  if (parts[0] === 'policies') return { view: 'policies', workflow: parts[1] ?? null }
  if (parts[0] === 'audit') return { view: 'audit' }
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
  }
}

const EVENT = 'spillway:navigate'

/** Goes to `r`; `replace` keeps the back button for real moves only. */
export function navigate(r: Route, replace = false) {
  const url = href(r) + window.location.search
  if (url === window.location.pathname + window.location.search) return
  if (replace) history.replaceState(null, '', url)
  else history.pushState(null, '', url)
  window.dispatchEvent(new Event(EVENT))
}

export function useRoute(): Route {
  const [route, setRoute] = useState<Route>(() => parse(window.location.pathname))
  useEffect(() => {
    const update = () => setRoute(parse(window.location.pathname))
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
