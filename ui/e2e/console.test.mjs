// Browser end-to-end: the real `spillway serve` (embedded simulator, demo traffic, real
// SQLite ledger) and the built console, driven in Debian's Chromium.
import { after, before, test } from 'node:test'
import assert from 'node:assert/strict'
import { spawn, spawnSync } from 'node:child_process'
import { mkdtempSync, readFileSync, mkdirSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { chromium } from 'playwright-core'
import { createRequire } from 'node:module'
import { demoConfigWith, readLine, setSim as setSimAt } from './gateway.mjs'

const axeSource = readFileSync(createRequire(import.meta.url).resolve('axe-core/axe.min.js'), 'utf8')

/** axe-core on the page as it stands: no serious or critical violation. */
async function accessible(p, what) {
  // Through the debugging protocol: the console's CSP (rightly) refuses injected scripts.
  await p.evaluate(`${axeSource};0`)
  const result = await p.evaluate(async () => await globalThis.axe.run(globalThis.document, { resultTypes: ['violations'] }))
  const bad = result.violations.filter((v) => v.impact === 'serious' || v.impact === 'critical')
  assert.deepEqual(bad.map((v) => `${v.id}: ${v.nodes.map((n) => n.target.join(' ')).join(', ')}`), [], `${what} has accessibility violations`)
}

const here = dirname(fileURLToPath(import.meta.url))
const root = resolve(here, '..', '..')
const BIN = process.env.SPILLWAY_BIN ?? join(root, 'target', 'debug', 'spillway')
const SHOTS = join(root, 'docs', 'screenshots')

let gateway, browser, url, demoKey, adminToken, simUrl

// Deadlines on the monotonic clock: a wall clock stepped by the host (NTP, a paused
// virtual machine) once failed a 20 s wait after 10 s.
async function until(what, fn, timeoutMs = 15_000) {
  const end = performance.now() + timeoutMs
  let last
  while (performance.now() < end) {
    last = await fn()
    if (last) return last
    await new Promise((r) => setTimeout(r, 200))
  }
  throw new Error(`timed out waiting for ${what}`)
}

before(async () => {
  const data = mkdtempSync(join(tmpdir(), 'spillway-e2e-'))
  const env = { ...process.env, SPILLWAY_DATA_DIR: data, SPILLWAY_LOG: 'warn' }
  for (const k of ['OPENAI_API_KEY', 'ANTHROPIC_API_KEY', 'GEMINI_API_KEY']) delete env[k]
  gateway = spawn(BIN, ['serve', '--listen', '127.0.0.1:0', '--demo-traffic', '15', '--ui-dir', join(root, 'ui', 'dist')], { env })
  gateway.stderr.on('data', () => {})
  const listening = readLine(gateway, 'spillway listening on ')
  const key = readLine(gateway, 'demo key (shown once): ')
  const simLine = readLine(gateway, 'simulated providers: ')
  url = await listening
  demoKey = await key
  simUrl = (await simLine).split(' ')[0]
  adminToken = readFileSync(join(data, 'admin-token'), 'utf8').trim()
  browser = await chromium.launch({
    executablePath: '/usr/bin/chromium',
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
      '--disable-component-update', '--disable-sync'],
  })
  mkdirSync(SHOTS, { recursive: true })
})

after(async () => {
  await browser?.close()
  gateway?.kill('SIGTERM')
})

async function page(colorScheme = 'dark') {
  const ctx = await browser.newContext({ viewport: { width: 1400, height: 900 }, colorScheme })
  return ctx.newPage()
}

test('a wrong admin token is refused, the right one connects', async () => {
  // spec: P2
  const p = await page('light')
  await p.goto(url)
  await p.getByTestId('connect-token').fill('swa_not_the_token')
  await p.getByRole('button', { name: 'Connect' }).click()
  const err = await p.getByTestId('connect-error').textContent()
  assert.match(err, /refused this admin token/)
  await p.screenshot({ path: join(SHOTS, 'connect-browser.png') })
  // And the API itself refuses it, whatever the page does.
  const r = await fetch(`${url}/admin/v1/overview`, { headers: { Authorization: 'Bearer swa_not_the_token' } })
  assert.equal(r.status, 401)
  await p.getByTestId('connect-token').fill(adminToken)
  await p.getByRole('button', { name: 'Connect' }).click()
  await p.getByTestId('tile-rps').waitFor()
  await p.context().close()
})

test('the overview shows live numbers that change', async () => {
  const p = await page()
  await p.goto(`${url}/#token=${adminToken}`)
  const tile = p.getByTestId('tile-rps')
  await tile.waitFor()
  assert.ok(!(await p.url()).includes(adminToken), 'the token leaves the address bar at once')
  const first = await until('traffic to show', async () => {
    const t = await tile.textContent()
    return t && t !== '0.0 req/s' && t !== '—' ? t : null
  })
  await until('the figure to move', async () => (await tile.textContent()) !== first)
  const routes = await p.getByTestId('routes').locator('tbody tr').count()
  assert.ok(routes >= 3, `routes for every simulated format, got ${routes}`)
  const channels = await p.getByTestId('channels').textContent()
  assert.match(channels, /openai-sim/)
  await p.waitForTimeout(1500)
  await p.screenshot({ path: join(SHOTS, 'overview-browser.png') })
  await accessible(p, 'the overview')
  await p.context().close()
})

test('requests without a valid key are listed as refusals, not ledger rows', async () => {
  // A wrong key and a foreign Host name: counted and shown, never written row by row.
  const r = await fetch(`${url}/v1/messages`, {
    method: 'POST',
    headers: { 'x-api-key': 'sk-not-a-key-0000000000', 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'claude-haiku-4-5', max_tokens: 8, messages: [{ role: 'user', content: 'hi' }] }),
  })
  assert.equal(r.status, 401)
  const p = await page()
  await p.goto(`${url}/#token=${adminToken}`)
  await p.getByTestId('tile-rps').waitFor()
  const table = p.getByTestId('rejections')
  await until('the refusal in the list', async () => /unknown key/.test((await table.textContent().catch(() => '')) ?? ''))
  assert.match(await table.textContent(), /anthropic/)
  assert.notEqual(await p.getByTestId('tile-rejected').textContent(), '0')
  await p.context().close()
})

test('the ledger search finds a request this test made', async () => {
  const clientId = `e2e-${Date.now()}`
  const r = await fetch(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: { Authorization: `Bearer ${demoKey}`, 'content-type': 'application/json', 'x-client-request-id': clientId },
    body: JSON.stringify({ model: 'gpt-4o-mini', messages: [{ role: 'user', content: 'hello from the e2e test' }] }),
  })
  assert.equal(r.status, 200)
  const id = r.headers.get('x-request-id')
  const p = await page()
  await p.goto(`${url}/#token=${adminToken}`)
  await p.getByTestId('tile-rps').waitFor()
  await p.keyboard.press('3')
  for (const needle of [id, clientId]) {
    await p.getByTestId('search').fill(needle)
    await p.getByTestId('search').press('Enter')
    await until(`a result for ${needle}`, async () => (await p.getByTestId('results').locator('tbody tr').count()) === 1)
    assert.match(await p.getByTestId('results').textContent(), new RegExp(id))
  }
  await p.getByTestId('results').locator('tbody tr').first().click()
  const detail = await p.getByTestId('detail').textContent()
  assert.match(detail, new RegExp(id))
  assert.match(detail, /openai-sim/)
  assert.match(detail, new RegExp(clientId))
  // The open request has a URL of its own: a reload (or a shared link) lands on it, and
  // the back button closes it.
  assert.equal(new URL(p.url()).pathname, `/ledger/${id}`)
  await p.reload()
  await until('the linked request', async () => new RegExp(id).test((await p.getByTestId('detail').textContent().catch(() => '')) ?? ''))
  await p.goBack()
  await until('the detail to close', async () => (await p.getByTestId('detail').count()) === 0)
  await p.getByTestId('search').fill('')
  await p.getByTestId('search').press('Enter')
  // An embedding request, found by its endpoint type (issue 12).
  const e = await fetch(`${url}/v1/embeddings`, {
    method: 'POST',
    headers: { Authorization: `Bearer ${demoKey}`, 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'text-embedding-3-small', input: 'embed me' }),
  })
  assert.equal(e.status, 200)
  const embedId = e.headers.get('x-request-id')
  await p.getByLabel('Endpoint type').selectOption('embeddings')
  await p.getByTestId('search').press('Enter')
  await until('only embedding requests', async () => {
    const cells = await p.getByTestId('endpoint').allTextContents()
    return cells.length > 0 && cells.every((c) => /embeddings$|[eE]mbedContents?$/.test(c)) && new RegExp(embedId).test(await p.getByTestId('results').textContent())
  })
  await p.getByLabel('Endpoint type').selectOption('')
  await p.getByTestId('search').press('Enter')
  await p.waitForTimeout(500)
  await p.screenshot({ path: join(SHOTS, 'ledger-browser.png') })
  await accessible(p, 'the ledger')
  await p.context().close()
})

const setSim = (channel, behavior) => setSimAt(simUrl, channel, behavior)

test('failover shows in the route table, the channel table and the request detail', async () => {
  // spec: D2, D6, E2, F2
  // Every call to the primary fails with a 503: requests that try it first fail over.
  await setSim('openai-sim', { latency_ms: 50, fault: { kind: 'status', status: 503 } })
  let failedOver = null
  for (let i = 0; i < 40 && !failedOver; i++) {
    const clientId = `e2e-failover-${Date.now()}-${i}`
    const r = await fetch(`${url}/v1/chat/completions`, {
      method: 'POST',
      headers: { Authorization: `Bearer ${demoKey}`, 'content-type': 'application/json', 'x-client-request-id': clientId },
      body: JSON.stringify({ model: 'gpt-4o-mini', messages: [{ role: 'user', content: 'fail over please' }] }),
    })
    assert.equal(r.status, 200)
    if (r.headers.get('x-spillway-attempts') === '2') failedOver = clientId
  }
  assert.ok(failedOver, 'some request tried the primary first')
  // A 429 with a long wait hint paces the Gemini primary.
  await setSim('gemini-sim', { latency_ms: 50, fault: { kind: 'status', status: 429, retry_after_s: 60 } })
  await setSim('openai-sim', { latency_ms: 50 })

  const p = await page()
  await p.goto(`${url}/#token=${adminToken}`)
  await p.getByTestId('tile-rps').waitFor()
  await until('the error mix to show overloads', async () => /overload/.test(await p.getByTestId('routes').textContent()))
  const gemini = p.getByTestId('channel-gemini-sim')
  await until('the paced channel', async () => /paced/.test(await gemini.textContent()))
  assert.match(await gemini.textContent(), /back in \d/)
  await p.waitForTimeout(1200)
  await p.screenshot({ path: join(SHOTS, 'overview-failover-browser.png'), fullPage: true })
  // The operator puts it back once the provider recovered.
  await setSim('gemini-sim', { latency_ms: 50 })
  await gemini.getByTestId('restore').click()
  // Who and why are asked before anything changes.
  const form = gemini.getByTestId('restore-form')
  assert.equal(await form.getByTestId('restore-confirm').isDisabled(), true)
  await form.getByPlaceholder('Your name').fill('e2e operator')
  await form.getByPlaceholder('Reason (goes on the audit log)').fill('provider recovered')
  await form.getByTestId('restore-confirm').click()
  await until('the channel to be ready', async () => /ready/.test(await gemini.getByTestId('channel-rotation').textContent()))
  const audit = await (await fetch(`${url}/admin/v1/audit?kind=channel&subject=gemini-sim`, { headers: { Authorization: `Bearer ${adminToken}` } })).json()
  assert.equal(audit[0].actor, 'e2e operator')
  assert.match(audit[0].reason, /provider recovered/)

  await p.keyboard.press('3')
  await p.getByTestId('search').fill(failedOver)
  await p.getByTestId('search').press('Enter')
  await until('the failed-over request', async () => (await p.getByTestId('results').locator('tbody tr').count()) === 1)
  await p.getByTestId('results').locator('tbody tr').first().click()
  const detail = await p.getByTestId('detail').textContent()
  assert.match(detail, /Succeeded on attempt 2/)
  assert.match(detail, /#1 on openai-sim: overload \(HTTP 503\)/)
  assert.match(detail, /failed over to another channel/)
  assert.match(detail, /#2 on openai-sim-b: success/)
  await p.screenshot({ path: join(SHOTS, 'ledger-failover-browser.png') })
  await p.context().close()
})

test('a breaker opens when the provider fails and closes after probation when it recovers', async () => {
  // spec: G1, G2, G3, G4, D5
  const route = 'anthropic/claude-haiku-4-5'
  const ask = () => fetch(`${url}/v1/messages`, {
    method: 'POST',
    headers: { 'x-api-key': demoKey, 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'claude-haiku-4-5', max_tokens: 8, messages: [{ role: 'user', content: 'breaker test' }] }),
  })
  await setSim('anthropic-sim', { latency_ms: 50, fault: { kind: 'status', status: 503 } })
  await setSim('anthropic-sim-b', { latency_ms: 50, fault: { kind: 'status', status: 503 } })
  const p = await page()
  await p.goto(`${url}/breakers/${route}#token=${adminToken}`)
  const row = p.getByTestId(`breaker-${route}`)
  // Demo traffic and these requests fail until the breaker opens.
  await until('the breaker to open', async () => {
    await ask()
    return /open/.test((await row.getByTestId('breaker-state').textContent().catch(() => '')) ?? '')
  }, 30_000)
  const r = await ask()
  assert.equal(r.status, 503)
  assert.ok(Number(r.headers.get('retry-after')) >= 1)
  assert.match((await r.json()).error.message, /circuit breaker/)
  assert.match(await p.getByTestId('breaker-reason').textContent(), /of the last/)
  await p.waitForTimeout(1200)
  await p.screenshot({ path: join(SHOTS, 'breaker-open-browser.png'), fullPage: true })
  await accessible(p, 'the breakers view')
  // The provider recovers: after the cool-down, probes one at a time close it.
  await setSim('anthropic-sim', { latency_ms: 50 })
  await setSim('anthropic-sim-b', { latency_ms: 50 })
  await until('the breaker to close', async () => {
    await ask()
    return /closed/.test((await row.getByTestId('breaker-state').textContent().catch(() => '')) ?? '')
  }, 90_000)
  await until('the history to list probation', async () => /probation → closed/.test((await p.getByTestId('breaker-history').textContent().catch(() => '')) ?? ''))
  const history = await p.getByTestId('breaker-history').textContent()
  assert.match(history, /closed → open/)
  assert.match(history, /open → probation/)
  assert.equal((await ask()).status, 200)

  // An operator opens the Gemini route's breaker by hand, then closes it.
  await p.goto(`${url}/breakers/gemini/gemini-2.5-flash`)
  const form = p.getByTestId('breaker-form')
  await form.waitFor()
  await form.getByTestId('breaker-actor').fill('e2e operator')
  assert.equal(await form.getByTestId('breaker-submit').isDisabled(), true, 'no reason, no action')
  await form.getByTestId('breaker-reason-input').fill('drill: provider incident')
  await form.getByTestId('breaker-submit').click()
  await until('the manual open', async () => /open/.test((await p.getByTestId('breaker-gemini/gemini-2.5-flash').getByTestId('breaker-state').textContent()) ?? ''))
  await until('the manual open on the record', async () => /e2e operator/.test((await p.getByTestId('breaker-history').textContent().catch(() => '')) ?? ''))
  await p.screenshot({ path: join(SHOTS, 'breaker-manual-browser.png'), fullPage: true })
  await form.getByTestId('breaker-reason-input').fill('drill over')
  await form.getByTestId('breaker-submit').click()
  await until('the manual close', async () => /closed/.test((await p.getByTestId('breaker-gemini/gemini-2.5-flash').getByTestId('breaker-state').textContent()) ?? ''))
  // Back goes back to where the operator came from.
  await p.goBack()
  assert.match(new URL(p.url()).pathname, /\/breakers\/anthropic\//)
  await p.context().close()
})

/** A gateway of this test's own on `data`: its URL, demo key, simulator URL and process.
 * `args` go to `spillway serve` after the usual ones (`--config FILE`). */
async function ownGateway(data, args = []) {
  const env = { ...process.env, SPILLWAY_DATA_DIR: data, SPILLWAY_LOG: 'warn' }
  for (const k of ['OPENAI_API_KEY', 'ANTHROPIC_API_KEY', 'GEMINI_API_KEY']) delete env[k]
  const proc = spawn(BIN, ['serve', '--listen', '127.0.0.1:0', '--ui-dir', join(root, 'ui', 'dist'), ...args], { env })
  proc.stderr.on('data', () => {})
  const listening = readLine(proc, 'spillway listening on ')
  const key = readLine(proc, 'demo key (shown once): ')
  const sim = readLine(proc, 'simulated providers: ')
  return { proc, url: await listening, key: await key, sim: (await sim).split(' ')[0] }
}

test('a crash leaves an unknown outcome; an owner reconciles it in the inbox', async () => {
  // spec: I4, L3, I2
  const data = mkdtempSync(join(tmpdir(), 'spillway-e2e-unknown-'))
  const token = () => readFileSync(join(data, 'admin-token'), 'utf8').trim()
  const first = await ownGateway(data)
  // Whatever fails below, no gateway of this test outlives it (the runner would wait).
  after(() => first.proc.kill('SIGKILL'))
  const ov = await (await fetch(`${first.url}/admin/v1/overview`, { headers: { Authorization: `Bearer ${token()}` } })).json()
  // Every OpenAI channel is slow: a first turn may go to either (D4).
  const chs = ov.channels.filter((c) => c.format === 'openai').map((c) => c.name)
  for (const ch of chs) {
    await fetch(`${first.sim}/_control/channels/${ch}`, { method: 'PUT', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ latency_ms: 60_000 }) })
  }
  const inFlight = async () => {
    let n = 0
    for (const ch of chs) n += (await (await fetch(`${first.sim}/_control/channels/${ch}`)).json()).stats.in_flight
    return n
  }
  const body = JSON.stringify({ model: 'gpt-4o-mini', messages: [{ role: 'user', content: 'send the invoice' }] })
  const ask = (g) => fetch(`${g.url}/v1/chat/completions`, {
    method: 'POST', body,
    headers: { 'content-type': 'application/json', authorization: `Bearer ${g.key}`, 'idempotency-key': 'invoice-42' },
  })
  ask(first).catch(() => {})
  await until('the call to be in flight', async () => (await inFlight()) === 1)
  first.proc.kill('SIGKILL')
  await new Promise((r) => first.proc.on('exit', r))

  const g = await ownGateway(data)
  try {
    // The client's retry is refused: nothing is sent twice.
    const again = await ask(g)
    assert.equal(again.status, 409)
    assert.match((await again.json()).error.message, /`unknown`/)

    const p = await page()
    await p.goto(`${g.url}/#token=${token()}`)
    await until('the unknown tile', async () => (await p.getByTestId('tile-unknown').textContent().catch(() => '')) === '1')
    await p.getByRole('link', { name: 'Unknowns' }).click()
    const row = p.getByTestId('unknowns').locator('tbody tr')
    await until('the inbox row', async () => (await row.count()) === 1)
    assert.match(await row.textContent(), /invoice-42/)
    await row.click()
    const form = p.getByTestId('reconcile-form')
    await form.waitFor()
    assert.match(await p.getByTestId('unknown-facts').textContent(), /openai-sim/)
    await accessible(p, 'the unknown outcomes inbox')
    await p.screenshot({ path: join(SHOTS, 'unknowns-browser.png'), fullPage: true })
    await form.getByTestId('outcome-done').check()
    await form.getByTestId('reconcile-actor').fill('e2e owner')
    await form.getByTestId('reconcile-reason').fill('found in the provider usage log')
    assert.equal(await form.getByTestId('reconcile-submit').isDisabled(), true, 'confirmed done needs its result id')
    await form.getByTestId('outcome-not-executed').check()
    await form.getByTestId('reconcile-submit').click()
    await until('the inbox to empty', async () => (await p.getByTestId('unknowns-empty').count()) === 1)
    const audit = await (await fetch(`${g.url}/admin/v1/audit?kind=request`, { headers: { Authorization: `Bearer ${token()}` } })).json()
    assert.equal(audit[0].actor, 'e2e owner')
    assert.equal(audit[0].action, 'unknown->confirmed_not_executed')
    // Confirmed not executed: the key runs once more, then replays.
    assert.equal((await ask(g)).status, 200)
    const replay = await ask(g)
    assert.equal(replay.headers.get('x-spillway-idempotent-replay'), 'true')
    await p.context().close()
  } finally {
    g.proc.kill('SIGTERM')
  }
})

test('the cost view shows real spend; an operator tops up a balance and makes a key shown once', async () => {
  // spec: M1, M3, B4, B5
  const p = await page()
  await p.goto(`${url}/costs#token=${adminToken}`)
  // Demo traffic is priced from the built-in catalog: real figures, not "unknown".
  const spend = p.getByTestId('tile-spend')
  await until('priced demo traffic', async () => {
    const t = await spend.textContent()
    return t && t !== '$0.00' && t !== 'unknown' ? t : null
  }, 30_000)
  await p.getByTestId('owners').waitFor()
  await p.waitForTimeout(1000)
  await p.screenshot({ path: join(SHOTS, 'costs-browser.png'), fullPage: true })
  await accessible(p, 'the cost view')

  // A top-up asks who and why, says what it does, and the balance moves by its amount.
  const before = await (await fetch(`${url}/admin/v1/costs?hours=1`, { headers: { Authorization: `Bearer ${adminToken}` } })).json()
  const demoBefore = before.owners.find((o) => o.name === 'demo').balance_usd
  await p.getByTestId('top-up-demo').click()
  const submit = p.getByTestId('top-up-submit')
  await p.getByTestId('top-up-amount').fill('25')
  assert.ok(await submit.isDisabled(), 'no top-up without a name and a reason')
  await p.getByTestId('top-up-actor').fill('e2e-operator')
  await p.getByTestId('top-up-reason').fill('invoice 7 paid')
  await submit.click()
  await p.getByTestId('top-up-result').waitFor()
  const afterView = await (await fetch(`${url}/admin/v1/costs?hours=1`, { headers: { Authorization: `Bearer ${adminToken}` } })).json()
  const demoAfter = afterView.owners.find((o) => o.name === 'demo').balance_usd
  // Demo traffic keeps spending meanwhile: the balance rose by the top-up less that.
  assert.ok(demoAfter > demoBefore + 24 && demoAfter <= demoBefore + 25, `${demoBefore} -> ${demoAfter}`)
  const audit = await (await fetch(`${url}/admin/v1/audit?kind=owner&subject=demo`, { headers: { Authorization: `Bearer ${adminToken}` } })).json()
  assert.equal(audit[0].action, 'top_up')
  assert.equal(audit[0].actor, 'e2e-operator')

  // A key made in the console: its secret shown once, usable at once, gone when hidden.
  await p.goto(`${url}/keys`)
  await p.getByTestId('new-key-name').fill('e2e-batch')
  await until('owners to load', async () => (await p.getByTestId('new-key-owner').isEnabled()) || null)
  await p.getByTestId('new-key-owner').selectOption('demo')
  await p.getByTestId('new-key-limit').fill('1')
  await p.getByTestId('new-key-actor').fill('e2e-operator')
  await p.getByTestId('new-key-reason').fill('nightly evaluation job')
  await p.getByTestId('new-key-submit').click()
  const secret = (await p.getByTestId('new-key-secret').textContent()).trim()
  assert.match(secret, /^sk-sw-[0-9a-f]{40}$/)
  await p.screenshot({ path: join(SHOTS, 'keys-browser.png'), fullPage: true })
  await accessible(p, 'the keys view')
  const r = await fetch(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: { Authorization: `Bearer ${secret}`, 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'gpt-4o-mini', messages: [{ role: 'user', content: 'hi' }] }),
  })
  assert.equal(r.status, 200)
  await p.getByTestId('new-key-dismiss').click()
  assert.equal(await p.getByTestId('new-key-secret').count(), 0)
  assert.ok(!(await p.content()).includes(secret), 'the secret is not on the page any more')
  const storage = await p.evaluate(() => JSON.stringify({ ...localStorage }) + JSON.stringify({ ...sessionStorage }))
  assert.ok(!storage.includes(secret), 'the secret is never kept in the browser')
  await p.getByTestId('key-e2e-batch').waitFor()
  assert.ok(!(await p.getByTestId('keys').textContent()).includes(secret))
  await p.context().close()
})

test('an operator approves an owner-review job and replays a dead letter through the reviewed form', async () => {
  // spec: J6, K3, L1, L3
  // A gateway of its own, without demo traffic: the scripted faults below go to this test's jobs only.
  const data = mkdtempSync(join(tmpdir(), 'spillway-e2e-jobs-'))
  const g = await ownGateway(data)
  after(() => g.proc.kill('SIGKILL'))
  const token = readFileSync(join(data, 'admin-token'), 'utf8').trim()
  const admin = async (path, body) => {
    const r = await fetch(`${g.url}${path}`, {
      method: body === undefined ? 'GET' : 'POST',
      headers: { Authorization: `Bearer ${token}`, 'content-type': 'application/json' },
      body: body === undefined ? undefined : JSON.stringify(body),
    })
    return { status: r.status, body: await r.json().catch(() => null) }
  }
  // Both OpenAI channels serve gpt-4o-mini: a run fails over from one to the other, so both are scripted.
  const OPENAI = ['openai-sim', 'openai-sim-b']
  const script = async (fault, times) => {
    for (const ch of OPENAI) await setSimAt(g.sim, ch, { latency_ms: 20, script: [{ fault, times }] })
  }
  const healthy = async () => {
    for (const ch of OPENAI) await setSimAt(g.sim, ch, { latency_ms: 20 })
  }
  const channelStates = async () => {
    const ov = (await admin('/admin/v1/overview')).body
    return Object.fromEntries(OPENAI.map((n) => [n, ov.channels.find((c) => c.name === n)?.health.state]))
  }
  const submit = async (content) => {
    const r = await fetch(`${g.url}/v1/chat/completions`, {
      method: 'POST',
      headers: {
        Authorization: `Bearer ${g.key}`, 'content-type': 'application/json',
        prefer: 'respond-async', 'x-spillway-workflow': 'default',
      },
      body: JSON.stringify({ model: 'gpt-4o-mini', messages: [{ role: 'user', content }] }),
    })
    assert.equal(r.status, 202)
    return (await r.json()).job_id
  }
  try {
    // A dead letter: 503s until the default workflow's 3 attempts are spent.
    await script({ kind: 'status', status: 503 }, 20)
    const deadId = await submit('nightly report, part 1')
    await until('the job in the dead letter', async () =>
      (await admin('/admin/v1/dead-letters')).body?.some((j) => j.job_id === deadId), 60_000)
    // Channels cooled down by the 503s come back by themselves.
    await healthy()
    await until('the OpenAI channels back in rotation', async () =>
      Object.values(await channelStates()).every((s) => s === 'ready' || s === 'recovering'), 60_000)

    // An owner review: the provider says the quota is spent (`insufficient_quota`) wherever the run goes.
    await script({ kind: 'status', status: 429, error: 'quota' }, 1)
    const reviewId = await submit('nightly report, part 2')
    await until('the job in owner review', async () =>
      (await admin('/admin/v1/reviews')).body?.some((j) => j.job_id === reviewId), 60_000)
    // The quota is raised: the channels it ejected go back into rotation before the owner approves.
    await healthy()
    for (const [name, state] of Object.entries(await channelStates())) {
      if (state !== 'ready') {
        const r = await admin(`/admin/v1/channels/${name}/restore`, { actor: 'e2e owner', reason: 'quota raised' })
        assert.equal(r.status, 200, JSON.stringify(r.body))
      }
    }

    const p = await page()
    await p.goto(`${g.url}/reviews#token=${token}`)
    const row = p.getByTestId(`review-${reviewId}`)
    await row.waitFor()
    assert.match(await row.textContent(), /quota/)
    await row.getByRole('link', { name: reviewId }).click()
    const form = p.getByTestId('review-form')
    await form.waitFor()
    assert.equal(new URL(p.url()).pathname, `/reviews/${reviewId}`)
    await form.getByTestId('review-reviewer').fill('e2e owner')
    await form.getByTestId('review-reason').fill('')
    assert.equal(await p.getByTestId('review-approve').isDisabled(), true, 'no reason, no approval')
    assert.equal(await p.getByTestId('review-reject').isDisabled(), true, 'no reason, no rejection')
    assert.match(await p.getByTestId('review-missing').textContent(), /reason/)
    await accessible(p, 'the owner-review inbox')
    await p.screenshot({ path: join(SHOTS, 'reviews-browser.png'), fullPage: true })
    await form.getByTestId('review-reason').fill('quota raised for the nightly run')
    await p.getByTestId('review-approve').click()
    assert.match(await p.getByTestId('review-result').textContent(), /Approved .*audit log/)
    await until('the job to leave the inbox', async () => (await p.getByTestId(`review-${reviewId}`).count()) === 0)
    const approved = (await admin(`/admin/v1/audit?kind=job&subject=${reviewId}`)).body
    assert.equal(approved[0].action, 'review_approved')
    assert.equal(approved[0].actor, 'e2e owner')

    // The provider is healthy: the dead letter is replayed through the reviewed form.
    await healthy()
    await p.goto(`${g.url}/dead-letters`)
    const dl = p.getByTestId(`deadletter-${deadId}`)
    await dl.waitFor()
    await dl.getByRole('link', { name: deadId }).click()
    await p.getByTestId('deadletter-detail').waitFor()
    assert.match(await p.getByTestId('idempotency-result').textContent(), /no_side_effect_recorded/)
    assert.match(await p.getByTestId('cost-estimate').textContent(), /estimated at (\$[\d.,]+|unknown).*pricing version/)
    assert.ok((await p.getByTestId('deadletter-runs').locator('tbody tr').count()) >= 1, 'its runs are the evidence')
    const replay = p.getByTestId('replay-submit')
    assert.equal(await replay.isDisabled(), true, 'nothing filled, no replay')
    await p.getByTestId('replay-owner').fill('e2e owner')
    await p.getByTestId('replay-kind').selectOption('provider_recovered')
    await p.getByTestId('replay-reason').fill('the provider recovered from its 503s')
    await p.getByTestId('replay-route-openai/gpt-4o-mini').check()
    assert.equal(await replay.isDisabled(), true, 'the estimate is not reviewed yet')
    assert.match(await p.getByTestId('replay-missing').textContent(), /cost review/)
    await p.getByTestId('replay-cost-reviewed').check()
    assert.equal(await replay.isDisabled(), false)
    await accessible(p, 'the dead-letter inbox')
    await p.screenshot({ path: join(SHOTS, 'dead-letters-browser.png'), fullPage: true })
    await replay.click()
    const result = p.getByTestId('replay-result')
    await result.waitFor()
    const said = await result.textContent()
    const made = said.match(/as job (job_[0-9a-f]+)/)
    assert.ok(made, said)
    const newId = made[1]
    const done = await until('the replay to succeed', async () => {
      const r = await fetch(`${g.url}/spillway/v1/jobs/${newId}`, { headers: { Authorization: `Bearer ${g.key}` } })
      const j = await r.json()
      return j.state === 'succeeded' ? j : null
    }, 60_000)
    assert.ok(Array.isArray(done.result?.choices), JSON.stringify(done.result))
    assert.equal(done.replay_of, deadId)
    await until('the console to follow it to the end', async () => /succeeded/.test((await p.getByTestId('replay-state').textContent()) ?? ''))
    const audit = (await admin(`/admin/v1/audit?kind=replay&subject=${deadId}`)).body
    assert.equal(audit[0].action, 'replayed')
    assert.equal(audit[0].actor, 'e2e owner')
    assert.match(audit[0].reason, /provider_recovered: the provider recovered/)
    await p.context().close()
  } finally {
    g.proc.kill('SIGTERM')
  }
})

/** The text of the file the console saves when `testid` is clicked. */
async function downloaded(p, testid) {
  const [file] = await Promise.all([p.waitForEvent('download', { timeout: 15_000 }), p.getByTestId(testid).click()])
  return readFileSync(await file.path(), 'utf8')
}

test('an operator runs a drill from the breaker to a closed recovery with an exported report', async () => {
  // spec: O1, O2, O4, O5, N2, N3
  // A gateway of its own, without demo traffic (the drill's figures are this test's
  // requests only) and with drill timings short enough to wait through.
  const data = mkdtempSync(join(tmpdir(), 'spillway-e2e-recovery-'))
  const timing = { stage_ms: 900_000, drill_stage_ms: 3_000, drill_incident_ms: 15_000, relapse_ms: 3_000 }
  const config = demoConfigWith(root, data, `recovery:\n${Object.entries(timing).map(([k, v]) => `  ${k}: ${v}`).join('\n')}`)
  const g = await ownGateway(data, ['--config', config])
  after(() => g.proc.kill('SIGKILL'))
  const token = readFileSync(join(data, 'admin-token'), 'utf8').trim()
  const admin = async (path) => (await fetch(`${g.url}${path}`, { headers: { Authorization: `Bearer ${token}` } })).json()
  const route = 'openai/gpt-4o-mini'
  // A marker no evidence bundle may carry: prompts stay out of it.
  const prompt = `e2e drill prompt ${Date.now()}`
  const ask = () => fetch(`${g.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { Authorization: `Bearer ${g.key}`, 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'gpt-4o-mini', messages: [{ role: 'user', content: prompt }] }),
  })
  let p
  const status = async (step) => p.getByTestId(`recovery-step-${step}`).getAttribute('data-status', { timeout: 2_000 }).catch(() => null)
  try {
    // A success before the incident: the route's last known good.
    assert.equal((await ask()).status, 200)

    p = await page()
    await p.goto(`${g.url}/recovery#token=${token}`)
    await p.getByTestId('recovery-start-form').waitFor()
    await until('the route among those a drill may run on', async () => (await p.getByTestId('recovery-drill-routes').textContent()).includes(route))
    await p.getByTestId('recovery-start-drill').selectOption('server_errors')
    await p.getByTestId('recovery-start-route').selectOption(route)
    await p.getByTestId('recovery-start-reason').fill('quarterly recovery drill')
    await p.getByTestId('recovery-start-actor').fill('e2e operator')
    await p.getByTestId('recovery-start').click()
    const drillStarted = performance.now()
    await until('the run page', async () => /^\/recovery\/[^/]+$/.test(new URL(p.url()).pathname))
    const id = decodeURIComponent(new URL(p.url()).pathname.split('/')[2])
    const detail = p.getByTestId('recovery-detail')
    await detail.waitFor()
    assert.equal(await detail.getAttribute('data-drill'), 'true')
    assert.match(await p.getByTestId('recovery-drill').textContent(), /^DRILL/)
    assert.equal(await status('isolate'), 'current')

    // The staged 5xx fail every call until the route's breaker opens.
    await until('the breaker to open under the staged 5xx', async () => {
      await ask()
      const ov = await admin('/admin/v1/overview')
      return ov.control?.find((c) => c.route === route)?.breaker.state === 'open'
    }, 30_000)

    // Isolate: retries off, the route paused.
    await p.getByTestId('recovery-isolate-actor').fill('e2e operator')
    await p.getByTestId('recovery-isolate').click()
    await until('the route isolated', async () => (await status('isolate')) === 'done')
    assert.match(await p.getByTestId('recovery-step-isolate').textContent(), /by e2e operator at /)
    assert.match(await p.getByTestId('recovery-gate').textContent(), /paused.*retries are off/i)
    assert.equal((await ask()).status, 503, 'the isolated route refuses interactive requests')

    // Preserve: the evidence bundle, downloaded with the admin token, carries none.
    await p.getByTestId('recovery-preserve-actor').fill('e2e operator')
    await p.getByTestId('recovery-preserve').click()
    await p.getByTestId('recovery-evidence-download').waitFor()
    const evidence = await downloaded(p, 'recovery-evidence-download')
    JSON.parse(evidence)
    assert.ok(!evidence.includes(token), 'no admin token in the evidence')
    assert.ok(!evidence.includes(g.key), 'no key secret in the evidence')
    assert.ok(!evidence.includes(prompt), 'no prompt in the evidence')

    // Roll back: nothing changed, said with a reason.
    await p.getByTestId('recovery-rollback-form').waitFor()
    assert.match(await p.getByTestId('recovery-rollback-nothing').textContent(), /Nothing to roll back/)
    await p.getByTestId('recovery-rollback-reason').fill('no workflow policy changed: the provider failed')
    await p.getByTestId('recovery-rollback-actor').fill('e2e operator')
    await p.getByTestId('recovery-rollback-none').click()
    await until('the roll back on record', async () => (await status('roll_back')) === 'done')

    // Confirm: the staged incident ends by itself; probe rounds until one passes.
    await p.getByTestId('recovery-probes-form').waitFor()
    await p.waitForTimeout(Math.max(0, drillStarted + timing.drill_incident_ms - performance.now()))
    await p.getByTestId('recovery-probes-actor').fill('e2e operator')
    await until('a passing probe round', async () => {
      if ((await status('confirm')) === 'done') return true
      const probes = p.getByTestId('recovery-probes')
      if ((await probes.count()) === 0 || (await probes.isDisabled())) return false
      const result = () => p.getByTestId('recovery-result').textContent({ timeout: 1_000 }).catch(() => '')
      const before = await result()
      await probes.click()
      await until('the probe round to end', async () => {
        const said = await result()
        return (said !== before && /Probe round/.test(said)) || (await p.getByTestId('recovery-probes-error').count()) > 0
      }, 30_000)
      return (await status('confirm')) === 'done'
    }, 90_000)
    assert.ok((await p.getByTestId('recovery-probes-table').locator('tbody tr').count()) === 5, 'the passing round lists its 5 probes')

    // Resume: 25, 50 and 100 %, a few seconds each in a drill, then the drain.
    await until('the stages to run their time', async () => (await status('resume')) === 'done', 60_000)
    await until('the drain to end', async () => (await status('drain')) === 'done', 30_000)
    const scores = await p.getByTestId('recovery-stage-scores').textContent()
    for (const pct of ['25 %', '50 %', '100 %']) assert.ok(scores.includes(pct), `a scorecard for the ${pct} stage`)

    // Close (O4): not before the customer contact is ticked.
    const close = p.getByTestId('recovery-close')
    await close.waitFor()
    await p.getByTestId('recovery-close-actor').fill('e2e operator')
    assert.equal(await close.isDisabled(), true, 'no close before the customer contact is ticked')
    assert.match(await p.getByTestId('recovery-close-missing').textContent(), /customer was contacted/)
    await p.getByTestId('recovery-close-contacted').check()
    await p.getByTestId('recovery-close-impact').fill('none: a drill on simulated channels')
    await p.getByTestId('recovery-close-workarounds').fill('none needed')
    assert.equal(await close.isDisabled(), false)
    await accessible(p, 'the recovery view')
    await p.screenshot({ path: join(SHOTS, 'recovery-browser.png'), fullPage: true })
    await close.click()
    await p.getByTestId('recovery-closed').waitFor()
    assert.equal(await p.getByTestId('recovery-detail').getAttribute('data-step'), 'closed')
    assert.match(await p.getByTestId('recovery-events').textContent(), /e2e operator/)

    // The report, fetched with the admin token: marked as a drill, and never carrying it.
    const md = await downloaded(p, 'recovery-report-md')
    assert.match(md, /DRILL/)
    assert.ok(!md.includes(token), 'the report never carries the admin token')
    assert.ok(!md.includes(g.key), 'nor a key secret')
    const record = await downloaded(p, 'recovery-report-json')
    JSON.parse(record)
    assert.ok(!record.includes(token), 'the record never carries the admin token')
    const audit = await admin('/admin/v1/audit?limit=200')
    assert.ok(audit.some((e) => e.actor === 'e2e operator' && e.reason.includes('[drill]')), 'the drill is marked on the audit log')

    // Its scorecard, a link away: a drill, three periods.
    await p.getByTestId('recovery-scorecard-link').click()
    await p.getByTestId('scorecard').waitFor({ timeout: 30_000 })
    assert.equal(new URL(p.url()).searchParams.get('run'), id)
    assert.equal(await p.getByTestId('scorecard-drill').textContent(), 'DRILL')
    assert.equal(await p.getByTestId('scorecard-periods').locator('li').count(), 3)
    await accessible(p, 'the scorecard')
    await p.screenshot({ path: join(SHOTS, 'scorecard-browser.png'), fullPage: true })
    // And back to the runs with the keyboard: the run is closed, and a drill.
    await p.keyboard.press('r')
    const row = p.getByTestId(`recovery-run-${id}`)
    await row.waitFor()
    assert.equal(await row.getAttribute('data-step'), 'closed')
    assert.equal(await row.getByTestId('recovery-run-drill').textContent(), 'DRILL')
  } finally {
    await p?.context().close()
    g.proc.kill('SIGTERM')
  }
})

test('the fleet view shows the instances sharing a PostgreSQL ledger, and a killed one taken over', async (t) => {
  // spec: R1, R2
  const pg = process.env.SPILLWAY_TEST_POSTGRES
  const redis = process.env.SPILLWAY_TEST_REDIS
  if (!pg || !redis) {
    assert.notEqual(process.env.SPILLWAY_REQUIRE_SERVICES, '1', 'SPILLWAY_TEST_POSTGRES and SPILLWAY_TEST_REDIS are not set (make test sets them)')
    t.skip('no PostgreSQL and Redis: run through make test')
    return
  }
  const db = `e2e_fleet_${process.pid}_${Date.now()}`
  const made = spawnSync('psql', ['-X', '-q', '-v', 'ON_ERROR_STOP=1', '-d', pg, '-c', `CREATE DATABASE ${db}`], { encoding: 'utf8' })
  assert.equal(made.status, 0, made.stderr)
  const ledger = `${pg.slice(0, pg.lastIndexOf('/'))}/${db}`
  const data = mkdtempSync(join(tmpdir(), 'spillway-e2e-fleet-'))
  const config = demoConfigWith(root, data, 'fleet: {heartbeat_ms: 300, stale_after_ms: 1500}')
  const token = () => readFileSync(join(data, 'admin-token'), 'utf8').trim()
  const start = (name) => ownGateway(data, ['--config', config, '--ledger', ledger, '--redis', redis, '--instance', name])
  const a = await start('east-1')
  after(() => a.proc.kill('SIGKILL'))
  const b = await start('east-2')
  after(() => b.proc.kill('SIGKILL'))
  const p = await page()
  await p.goto(`${a.url}/#token=${token()}`)
  await p.getByRole('link', { name: 'Fleet' }).click()
  const row = (name) => p.getByTestId(`fleet-instance-${name}`)
  await until('both instances live', async () =>
    (await row('east-1').getAttribute('data-status').catch(() => null)) === 'live'
    && (await row('east-2').getAttribute('data-status').catch(() => null)) === 'live')
  assert.equal(await p.getByTestId('fleet-ledger').textContent().then((s) => /postgres/i.test(s)), true)
  assert.equal(await p.getByTestId('fleet-redis-state').textContent(), 'up')
  // One of them dies: a survivor takes it over after its heartbeat goes stale.
  b.proc.kill('SIGKILL')
  await until('the dead one taken over', async () =>
    (await row('east-2').getAttribute('data-status').catch(() => null)) === 'taken_over', 20_000)
  assert.match(await row('east-2').textContent(), /east-1/)
  await accessible(p, 'the fleet view')
  await p.screenshot({ path: join(SHOTS, 'fleet-browser.png'), fullPage: true })
  await p.context().close()
})
