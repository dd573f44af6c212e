// A line diff for policy versions (J8): the longest common subsequence of lines, shown as
// `+` (only in the newer text), `-` (only in the older one) and ` ` (in both). Policies
// are short; the common head and tail are set aside first, so the table stays small.

export type DiffOp = '+' | '-' | ' '
export type DiffLine = { op: DiffOp; text: string }

/** The cells above which the LCS table is not built: the middle is shown as removed, then added. */
const MAX_CELLS = 4_000_000

/** A text's lines: `\r\n` read as `\n`, and a final newline ends the last line (no empty line after it). */
export function splitLines(text: string): string[] {
  if (text === '') return []
  const t = text.replace(/\r\n?/g, '\n')
  return (t.endsWith('\n') ? t.slice(0, -1) : t).split('\n')
}

/** The lines of `older` and `newer`, each marked as kept, removed or added, in order;
 * within a change, removals come before additions. */
export function diffLines(older: string, newer: string): DiffLine[] {
  const a = splitLines(older)
  const b = splitLines(newer)
  let head = 0
  while (head < a.length && head < b.length && a[head] === b[head]) head++
  let tail = 0
  while (tail < a.length - head && tail < b.length - head && a[a.length - 1 - tail] === b[b.length - 1 - tail]) tail++
  const out: DiffLine[] = a.slice(0, head).map((text): DiffLine => ({ op: ' ', text }))
  const x = a.slice(head, a.length - tail)
  const y = b.slice(head, b.length - tail)
  const n = x.length
  const m = y.length
  if ((n + 1) * (m + 1) > MAX_CELLS) {
    for (const text of x) out.push({ op: '-', text })
    for (const text of y) out.push({ op: '+', text })
  } else {
    // lcs[i * (m + 1) + j]: the longest common subsequence of x[i..] and y[j..].
    const w = m + 1
    const lcs = new Uint32Array((n + 1) * w)
    for (let i = n - 1; i >= 0; i--) {
      for (let j = m - 1; j >= 0; j--) {
        lcs[i * w + j] = x[i] === y[j] ? lcs[(i + 1) * w + j + 1] + 1 : Math.max(lcs[(i + 1) * w + j], lcs[i * w + j + 1])
      }
    }
    let i = 0
    let j = 0
    while (i < n && j < m) {
      if (x[i] === y[j]) {
        out.push({ op: ' ', text: x[i] })
        i++
        j++
      } else if (lcs[(i + 1) * w + j] >= lcs[i * w + j + 1]) {
        out.push({ op: '-', text: x[i] })
        i++
      } else {
        out.push({ op: '+', text: y[j] })
        j++
      }
    }
    for (; i < n; i++) out.push({ op: '-', text: x[i] })
    for (; j < m; j++) out.push({ op: '+', text: y[j] })
  }
  for (const text of a.slice(a.length - tail)) out.push({ op: ' ', text })
  return out
}

/** The diff as text lines, each prefixed with `+`, `-` or ` `. */
export function lineDiff(older: string, newer: string): string[] {
  return diffLines(older, newer).map((l) => l.op + l.text)
}

/** How many lines were added and removed. */
export function diffStat(lines: DiffLine[]): { added: number; removed: number } {
  let added = 0
  let removed = 0
  for (const l of lines) {
    if (l.op === '+') added++
    else if (l.op === '-') removed++
  }
  return { added, removed }
}
