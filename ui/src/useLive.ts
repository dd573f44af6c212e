import { useEffect, useState } from 'react'
import { ApiError, streamEvents, type Connection } from './api'
import type { Overview } from './bindings/Overview'
import type { OperatorAlert } from './bindings/OperatorAlert'

export type LiveState = { overview: Overview | null; error: string | null; connected: boolean; alerts: OperatorAlert[] }

/** The overview, kept current by the admin event stream; reconnects with backoff. */
export function useLive(conn: Connection): LiveState {
  const [state, setState] = useState<LiveState>({ overview: null, error: null, connected: false, alerts: [] })

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
                if (e.kind === 'overview') return { ...prev, overview: e.data, error: null, connected: true }
                if (!prev.overview) return prev
                const t = e.data
                const series = prev.overview.series.filter((p) => p.at !== t.point.at && p.at > t.point.at - 900_000)
                series.push(t.point)
                return {
                  ...prev,
                  connected: true,
                  error: null,
                  overview: {
                    ...prev.overview,
                    now: t.now,
                    headline: t.headline,
                    routes: t.routes,
                    channels: t.channels,
                    rejections: t.rejections,
                    ledger: t.ledger,
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
