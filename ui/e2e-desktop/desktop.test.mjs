// Desktop end-to-end: the real Tauri binary under Xvfb, driven through tauri-driver and
// Debian's WebKitWebDriver (raw W3C WebDriver over loopback; ports chosen by the OS).
import { after, before, test } from 'node:test'
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import { mkdtempSync, writeFileSync, mkdirSync } from 'node:fs'
import { createServer } from 'node:net'
import { tmpdir } from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'

const here = dirname(fileURLToPath(import.meta.url))
const root = resolve(here, '..', '..')
const APP = process.env.SPILLWAY_DESKTOP ?? join(root, 'target', 'debug', 'spillway-desktop')
const DRIVER = process.env.TAURI_DRIVER ?? join(process.env.HOME ?? '/root', '.cargo', 'bin', 'tauri-driver')
const SHOTS = join(root, 'docs', 'screenshots')
const ELEMENT = 'element-6066-11e4-a52e-4f735466cecf'

let driver, base, session

function freePort() {
  return new Promise((ok, fail) => {
    const s = createServer()
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address()
      s.close(() => ok(port))
    })
    s.on('error', fail)
  })
}

async function wd(method, path, body) {
  const r = await fetch(base + path, {
    method,
    // A driver that never answers fails the step instead of hanging the run.
    signal: AbortSignal.timeout(60_000),
    headers: { 'content-type': 'application/json' },
    body: body ? JSON.stringify(body) : undefined,
  })
  const json = await r.json()
  if (!r.ok) throw new Error(`${method} ${path}: ${JSON.stringify(json.value ?? json)}`)
  return json.value
}

async function until(what, fn, timeoutMs = 30_000) {
  const end = Date.now() + timeoutMs
  let lastErr
  while (Date.now() < end) {
    try {
      const v = await fn()
      if (v) return v
    } catch (e) {
      lastErr = e
    }
    await new Promise((r) => setTimeout(r, 300))
  }
  throw new Error(`timed out waiting for ${what}${lastErr ? `: ${lastErr.message}` : ''}`)
}

async function text(css) {
  const el = await wd('POST', `/session/${session}/element`, { using: 'css selector', value: css })
  return wd('GET', `/session/${session}/element/${el[ELEMENT]}/text`)
}

before(async () => {
  const port = await freePort()
  const nativePort = await freePort()
  const data = mkdtempSync(join(tmpdir(), 'spillway-desktop-'))
  const env = { ...process.env, SPILLWAY_DATA_DIR: data, SPILLWAY_UI_DIR: join(root, 'ui', 'dist'), LANG: 'en_US.UTF-8' }
  for (const k of ['OPENAI_API_KEY', 'ANTHROPIC_API_KEY', 'GEMINI_API_KEY']) delete env[k]
  // A process group of its own, so that `after` can stop the app with it (see there).
  driver = spawn(DRIVER, ['--port', String(port), '--native-port', String(nativePort), '--native-driver', '/usr/bin/WebKitWebDriver'], { env, detached: true })
  driver.stderr.on('data', () => {})
  base = `http://127.0.0.1:${port}`
  await until('tauri-driver to listen', async () => (await fetch(`${base}/status`).catch(() => null))?.ok, 20_000)
  const s = await wd('POST', '/session', {
    capabilities: { alwaysMatch: { browserName: 'wry', 'tauri:options': { application: APP } } },
  })
  session = s.sessionId
})

after(async () => {
  if (session) await wd('DELETE', `/session/${session}`).catch(() => {})
  // The app is tauri-driver's grandchild. A session whose end did not close it (once, a
  // DELETE that came back while the app stayed up) left it running after the driver was
  // killed, holding the driver's output pipes open, and this process waiting on them for
  // good. The whole group goes: politely first, then for sure.
  const group = (signal) => {
    try {
      process.kill(-driver.pid, signal)
    } catch {
      // Already gone.
    }
  }
  if (driver?.pid) {
    group('SIGTERM')
    await new Promise((r) => setTimeout(r, 2000))
    group('SIGKILL')
  }
})

test('the desktop window opens connected and shows live numbers', async () => {
  const rps = await until('live traffic in the window', async () => {
    const t = await text('[data-testid="tile-rps"]')
    return t && t !== '0.0 req/s' && t !== '—' ? t : null
  })
  assert.match(rps, /req\/s$/)
  const channels = await text('[data-testid="channels"]')
  assert.match(channels, /openai-sim/)
  await new Promise((r) => setTimeout(r, 1500))
  await shot('overview-desktop.png')
})

test('the desktop window shows the breakers, the ledger, the unknown outcomes and the connection screen', async () => {
  // spec: G4
  await click('//nav//a[normalize-space()="Breakers"]')
  await until('the breakers table', async () => (await text('[data-testid="breakers"]')).includes('closed'))
  await shot('breakers-desktop.png')
  await click('//nav//a[normalize-space()="Ledger"]')
  await until('ledger rows', async () => (await text('[data-testid="results"]')).includes('done'))
  await shot('ledger-desktop.png')
  // spec: I4
  await click('//nav//a[normalize-space()="Unknowns"]')
  const inbox = await until('the unknown outcomes inbox', async () => text('[data-testid="unknowns-empty"]'))
  assert.match(inbox, /every request the gateway sent has a known outcome/)
  await click('//button[normalize-space()="Disconnect"]')
  const form = await until('the connection screen', async () => text('.connect'))
  assert.match(form, /Connect to a gateway/)
  await shot('connect-desktop.png')
})

async function click(xpath) {
  const el = await wd('POST', `/session/${session}/element`, { using: 'xpath', value: xpath })
  await wd('POST', `/session/${session}/element/${el[ELEMENT]}/click`, {})
}

async function shot(name) {
  mkdirSync(SHOTS, { recursive: true })
  // WebKit's screenshot is the last frame it painted, which can be older than the DOM the
  // test just read: a ledger screenshot once showed "Loading…" under rows already found.
  // Two animation frames later, a frame with the current DOM has been painted.
  await wd('POST', `/session/${session}/execute/async`, {
    script: 'const done = arguments[arguments.length - 1]; requestAnimationFrame(() => requestAnimationFrame(() => done(true)))',
    args: [],
  })
  const png = await wd('GET', `/session/${session}/screenshot`)
  writeFileSync(join(SHOTS, name), Buffer.from(png, 'base64'))
}
