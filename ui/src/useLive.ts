import { useEffect, useState } from 'react'
import { ApiError, streamEvents, type Connection } from './api'
import type { Overview } from './bindings/Overview'
import type { BreakerState } from './bindings/BreakerState'
import type { OperatorAlert } from './bindings/OperatorAlert'
import type { RouteControlView } from './bindings/RouteControlView'

/** One second of a route's control figures, kept in the browser for the route charts. */
export type ControlPoint = { at: number; rps: number; amplification: number | null; postRetrySuccess: number | null; state: BreakerState }

export type LiveState = {
  overview: Overview | null
  error: string | null
  connected: boolean
  alerts: OperatorAlert[]
  /** Per route, the figures of each tick since the page opened (at most 15 min). */
  history: Record<string, ControlPoint[]>
}

function withPoints(prev: Record<string, ControlPoint[]>, at: number, control: RouteControlView[]) {
  const next: Record<string, ControlPoint[]> = {}
  for (const v of control) {
    const old = (prev[v.route] ?? []).filter((p) => p.at > at - 900_000 && p.at !== at)
    old.push({
      at,
      rps: v.budget_requests / 10,
      amplification: v.amplification.last_1m.amplification,
      postRetrySuccess: v.amplification.last_1m.post_retry_success,
      state: v.breaker.state,
    })
    next[v.route] = old
  }
  return next
}

/** The overview, kept current by the admin event stream; reconnects with backoff. */
export function useLive(conn: Connection): LiveState {
  const [state, setState] = useState<LiveState>({ overview: null, error: null, connected: false, alerts: [], history: {} })

  useEffect(() => {
    const abort = new AbortController()
    let delay = 500
    const run = async () => {
      while (!abort.signal.aborted) {
        try {
          await streamEvents(
            conn,
            (e) => {
              delay = 500
              setState((prev) => {
                if (e.kind === 'alert') return { ...prev, alerts: [e.data, ...prev.alerts].slice(0, 5) }
                if (e.kind === 'overview') {
                  return { ...prev, overview: e.data, error: null, connected: true, history: withPoints(prev.history, e.data.now, e.data.control) }
                }
                if (!prev.overview) return prev
                const t = e.data
                const series = prev.overview.series.filter((p) => p.at !== t.point.at && p.at > t.point.at - 900_000)
                series.push(t.point)
                return {
                  ...prev,
                  connected: true,
                  error: null,
                  history: withPoints(prev.history, t.now, t.control),
                  overview: {
                    ...prev.overview,
                    now: t.now,
                    headline: t.headline,
                    routes: t.routes,
                    channels: t.channels,
                    control: t.control,
                    rejections: t.rejections,
                    ledger: t.ledger,
                    // Read every 10 s on the gateway: a tick before the first reading keeps the last one.
                    ledger_figures: t.ledger_figures ?? prev.overview.ledger_figures,
                    lanes: t.lanes,
                    series,
                  },
                }
              })
            },
            abort.signal,
          )
        } catch (err) {
          if (abort.signal.aborted) return
          const msg = err instanceof ApiError ? err.message : String(err)
          setState((prev) => ({ ...prev, error: msg, connected: false }))
          if (err instanceof ApiError && err.status === 401) return
        }
        await new Promise((r) => setTimeout(r, delay))
        delay = Math.min(delay * 2, 10_000)
      }
    }
    run()
    return () => abort.abort()
  }, [conn])

  return state
}
