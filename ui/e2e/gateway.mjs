// What the Node end-to-end suites share: reading the gateway's announcements and
// steering the simulator it embeds.
import assert from 'node:assert/strict'
import { cpSync, readFileSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'

/** The rest of the first stdout line of `proc` that starts with `prefix`. */
export function readLine(proc, prefix, timeoutMs = 20_000) {
  return new Promise((ok, fail) => {
    let buf = ''
    const timer = setTimeout(() => fail(new Error(`no "${prefix}" line within ${timeoutMs} ms`)), timeoutMs)
    const onData = (d) => {
      buf += d.toString()
      for (const line of buf.split('\n')) {
        if (line.startsWith(prefix)) {
          clearTimeout(timer)
          proc.stdout.off('data', onData)
          ok(line.slice(prefix.length).trim())
          return
        }
      }
    }
    proc.stdout.on('data', onData)
    proc.on('exit', (code) => fail(new Error(`spillway exited with ${code}`)))
  })
}

/** Sets a simulated channel's behaviour (`{}` for a healthy one). */
export async function setSim(simUrl, channel, behavior) {
  const r = await fetch(`${simUrl}/_control/channels/${channel}`, {
    method: 'PUT', headers: { 'content-type': 'application/json' }, body: JSON.stringify(behavior),
  })
  assert.equal(r.status, 200)
}

/** A config file in `dir` for `spillway serve --config`: the embedded default
 * (policies/demo.yaml) with `extraYaml` appended (top-level sections the default does not
 * have, such as `recovery:`). Its workflow policies are copied beside it, where the
 * default's `workflows: workflows` looks for them, so a test never writes to the source tree. */
export function demoConfigWith(root, dir, extraYaml) {
  cpSync(join(root, 'policies', 'workflows'), join(dir, 'workflows'), { recursive: true })
  const path = join(dir, 'spillway.yaml')
  writeFileSync(path, `${readFileSync(join(root, 'policies', 'demo.yaml'), 'utf8')}\n${extraYaml}\n`)
  return path
}
