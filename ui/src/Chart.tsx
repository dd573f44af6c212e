import { useEffect, useRef } from 'react'
import uPlot from 'uplot'
import 'uplot/dist/uPlot.min.css'

export type Series = { label: string; color: string; unit: string }

/** A small live time-series chart (uPlot). `data[0]` is unix seconds. */
export function Chart({ title, series, data }: { title: string; series: Series[]; data: (number | null)[][] }) {
  const el = useRef<HTMLDivElement>(null)
  const plot = useRef<uPlot | null>(null)

  useEffect(() => {
    if (!el.current) return
    const opts: uPlot.Options = {
      width: el.current.clientWidth || 480,
      height: 160,
      legend: { show: true },
      cursor: { drag: { x: false, y: false } },
      scales: { x: { time: true } },
      axes: [
        { stroke: 'currentColor', grid: { stroke: 'rgba(128,128,128,0.15)' } },
        {
          stroke: 'currentColor',
          grid: { stroke: 'rgba(128,128,128,0.15)' },
          values: (_u, v) => v.map((x) => `${x} ${series[0]?.unit ?? ''}`),
          size: 70,
        },
      ],
      series: [
        {},
        ...series.map((s) => ({ label: `${s.label} (${s.unit})`, stroke: s.color, width: 1.5, spanGaps: false })),
      ],
    }
    plot.current = new uPlot(opts, data as uPlot.AlignedData, el.current)
    const onResize = () => plot.current?.setSize({ width: el.current?.clientWidth || 480, height: 160 })
    window.addEventListener('resize', onResize)
    return () => {
      window.removeEventListener('resize', onResize)
      plot.current?.destroy()
      plot.current = null
    }
    // The chart is built once per series shape; data updates go through setData below.
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, [series.map((s) => s.label).join()])

  useEffect(() => {
    plot.current?.setData(data as uPlot.AlignedData)
  }, [data])

  return (
    <figure className="chart">
      <figcaption>{title}</figcaption>
      <div ref={el} />
    </figure>
  )
}
