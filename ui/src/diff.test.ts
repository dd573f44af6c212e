// The policy diff (J8): what a roll back would change, line by line.
import { describe, expect, it } from 'vitest'
import { diffLines, diffStat, lineDiff, splitLines } from './diff'

describe('line diff', () => {
  it('marks added and removed lines, and keeps the rest', () => {
    const older = 'workflow: nightly\nmax_attempts: 3\nmax_length: 100\npriority: low\n'
    const newer = 'workflow: nightly\nmax_attempts: 5\nmax_length: 100\npriority: low\nshed: true\n'
    expect(lineDiff(older, newer)).toEqual([
      ' workflow: nightly',
      '-max_attempts: 3',
      '+max_attempts: 5',
      ' max_length: 100',
      ' priority: low',
      '+shed: true',
    ])
    expect(diffStat(diffLines(older, newer))).toEqual({ added: 2, removed: 1 })
  })

  it('finds the longest common run when lines move', () => {
    expect(lineDiff('a\nb\nc\nd', 'b\nc\na\nd')).toEqual(['-a', ' b', ' c', '+a', ' d'])
    expect(lineDiff('x\ny', 'y\nz')).toEqual(['-x', ' y', '+z'])
  })

  it('handles empty texts, identical texts and line endings', () => {
    expect(lineDiff('', '')).toEqual([])
    expect(lineDiff('', 'a\nb\n')).toEqual(['+a', '+b'])
    expect(lineDiff('a\nb', '')).toEqual(['-a', '-b'])
    expect(lineDiff('a\r\nb\r\n', 'a\nb')).toEqual([' a', ' b'])
    expect(splitLines('a\n\nb\n')).toEqual(['a', '', 'b'])
    expect(diffStat(diffLines('same\n', 'same\n'))).toEqual({ added: 0, removed: 0 })
  })
})
