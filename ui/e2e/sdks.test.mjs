// The official Node SDKs (openai, @anthropic-ai/sdk, @google/genai from npm) against the
// real `spillway serve` on its embedded default (simulated providers, real SQLite ledger):
// every endpoint, streamed and not, failover before a stream's first event, the boundary
// after it, and a stored response's follow-up reaching the channel that stored it.
import { after, before, beforeEach, test } from 'node:test'
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import { mkdtempSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import OpenAI from 'openai'
import Anthropic from '@anthropic-ai/sdk'
import { GoogleGenAI } from '@google/genai'
import { readLine, setSim as setSimAt } from './gateway.mjs'

const here = dirname(fileURLToPath(import.meta.url))
const root = resolve(here, '..', '..')
const BIN = process.env.SPILLWAY_BIN ?? join(root, 'target', 'debug', 'spillway')
const SIM_CHANNELS = ['openai-sim', 'openai-sim-b', 'anthropic-sim', 'anthropic-sim-b', 'gemini-sim', 'gemini-sim-b']

let gateway, url, key, simUrl

const setSim = (channel, behavior) => setSimAt(simUrl, channel, behavior)

async function calls(channel) {
  const r = await fetch(`${simUrl}/_control/channels/${channel}`)
  return (await r.json()).stats.calls
}

before(async () => {
  const data = mkdtempSync(join(tmpdir(), 'spillway-sdks-'))
  const env = { ...process.env, SPILLWAY_DATA_DIR: data, SPILLWAY_LOG: 'warn' }
  for (const k of ['OPENAI_API_KEY', 'ANTHROPIC_API_KEY', 'GEMINI_API_KEY', 'GOOGLE_API_KEY']) delete env[k]
  gateway = spawn(BIN, ['serve', '--listen', '127.0.0.1:0'], { env })
  gateway.stderr.on('data', () => {})
  const listening = readLine(gateway, 'spillway listening on ')
  const demoKey = readLine(gateway, 'demo key (shown once): ')
  const simLine = readLine(gateway, 'simulated providers: ')
  url = await listening
  key = await demoKey
  simUrl = (await simLine).split(' ')[0]
})

after(() => gateway?.kill('SIGTERM'))

beforeEach(async () => {
  for (const c of SIM_CHANNELS) await setSim(c, {})
})

const openai = () => new OpenAI({ baseURL: `${url}/v1`, apiKey: key, maxRetries: 0 })
const anthropic = () => new Anthropic({ baseURL: url, apiKey: key, maxRetries: 0 })
const gemini = () => new GoogleGenAI({ apiKey: key, httpOptions: { baseUrl: url, apiVersion: 'v1beta' } })

test('openai: chat, Responses and embeddings, whole and streamed', async () => {
  // spec: A1, H1, M2
  const c = openai()
  const chat = await c.chat.completions.create({ model: 'gpt-4o-mini', messages: [{ role: 'user', content: 'hi' }] })
  assert.match(chat.choices[0].message.content, /^Queues absorb bursts/)
  let text = ''
  for await (const chunk of await c.chat.completions.create({
    model: 'gpt-4o-mini', messages: [{ role: 'user', content: 'hi' }], stream: true, stream_options: { include_usage: true },
  })) text += chunk.choices[0]?.delta?.content ?? ''
  assert.match(text, /^Queues absorb bursts/)

  const { data: resp, response } = await c.responses.create({ model: 'gpt-4o-mini', input: 'hello' }).withResponse()
  assert.match(resp.output_text, /^Queues absorb bursts/)
  assert.equal(resp.usage.output_tokens, 12)
  assert.ok(response.headers.get('x-request-id'))
  const types = []
  let streamed = ''
  for await (const ev of await c.responses.create({ model: 'gpt-4o-mini', input: 'hello', stream: true })) {
    types.push(ev.type)
    if (ev.type === 'response.output_text.delta') streamed += ev.delta
  }
  assert.equal(types[0], 'response.created')
  assert.equal(types.at(-1), 'response.completed')
  assert.match(streamed, /^Queues absorb bursts/)

  const emb = await c.embeddings.create({ model: 'text-embedding-3-small', input: ['one', 'two'] })
  assert.equal(emb.data.length, 2)
  assert.ok(emb.usage.prompt_tokens > 0)
  assert.equal((await c.models.retrieve('text-embedding-3-small')).id, 'text-embedding-3-small')
  await assert.rejects(c.models.retrieve('no-such-model'), OpenAI.NotFoundError)
})

test('anthropic: messages whole and streamed, token counting, one model', async () => {
  // spec: A1, H1
  const c = anthropic()
  const msg = await c.messages.create({ model: 'claude-haiku-4-5', max_tokens: 64, messages: [{ role: 'user', content: 'hi' }] })
  assert.match(msg.content[0].text, /^Queues absorb bursts/)
  const stream = c.messages.stream({ model: 'claude-haiku-4-5', max_tokens: 64, messages: [{ role: 'user', content: 'hi' }] })
  const final = await stream.finalMessage()
  assert.equal(final.usage.output_tokens, 12)
  const counted = await c.messages.countTokens({ model: 'claude-haiku-4-5', messages: [{ role: 'user', content: 'how many?' }] })
  assert.ok(counted.input_tokens > 0)
  assert.equal((await c.models.retrieve('claude-haiku-4-5')).id, 'claude-haiku-4-5')
  // A path the gateway does not serve answers in Anthropic's shape, naming it.
  await assert.rejects(c.messages.batches.list(), (e) => e instanceof Anthropic.NotFoundError && /GET \/v1\/messages\/batches/.test(e.message))
})

test('gemini: generate whole and streamed, count tokens, embeddings, one model', async () => {
  // spec: A1, H1
  const ai = gemini()
  const g = await ai.models.generateContent({ model: 'gemini-2.5-flash', contents: 'hi' })
  assert.match(g.text, /^Queues absorb bursts/)
  let text = ''
  for await (const chunk of await ai.models.generateContentStream({ model: 'gemini-2.5-flash', contents: 'hi' })) text += chunk.text ?? ''
  assert.match(text, /^Queues absorb bursts/)
  const counted = await ai.models.countTokens({ model: 'gemini-2.5-flash', contents: 'how many tokens?' })
  assert.ok(counted.totalTokens > 0)
  const emb = await ai.models.embedContent({ model: 'gemini-embedding-001', contents: ['one', 'two'] })
  assert.equal(emb.embeddings.length, 2)
  assert.equal((await ai.models.get({ model: 'gemini-2.5-flash' })).name, 'models/gemini-2.5-flash')
})

test('a Responses stream fails over before its first event, unseen', async () => {
  // spec: D2, H2
  await setSim('openai-sim', { fault: { kind: 'cut_before_first_token' } })
  const c = openai()
  let failedOver = false
  // The channels share one tier by weight: until a stream is sent to the failing one first.
  for (let i = 0; i < 20 && !failedOver; i++) {
    const { data: stream, response } = await c.responses.create({ model: 'gpt-4o-mini', input: 'hi', stream: true }).withResponse()
    const types = []
    for await (const ev of stream) types.push(ev.type)
    assert.equal(types.at(-1), 'response.completed', 'the client never sees the failed attempt')
    assert.ok(!types.includes('error'))
    assert.equal(response.headers.get('x-spillway-channel'), 'openai-sim-b')
    failedOver = response.headers.get('x-spillway-attempts') === '2'
  }
  assert.ok(failedOver, 'no stream was sent to the failing channel first in 20 tries')
})

test('after the first output a cut is an error event, never a failover', async () => {
  // spec: H2, H3
  for (const ch of ['openai-sim', 'openai-sim-b']) await setSim(ch, { fault: { kind: 'cut_after_first_token', after_tokens: 2 } })
  const before = (await calls('openai-sim')) + (await calls('openai-sim-b'))
  const c = openai()
  const { data: stream, response } = await c.responses.create({ model: 'gpt-4o-mini', input: 'hi', stream: true }).withResponse()
  const events = []
  // The Node SDK raises the Responses API's `error` event as an API error (the Python SDK
  // hands it over as a typed event): the text shown so far, then the error.
  await assert.rejects(async () => {
    for await (const ev of stream) events.push(ev)
  }, (e) => e instanceof OpenAI.APIError && e.message.includes(response.headers.get('x-request-id')))
  assert.equal(events.filter((e) => e.type === 'response.output_text.delta').length, 2)
  assert.equal((await calls('openai-sim')) + (await calls('openai-sim-b')), before + 1, 'one upstream call, no failover')
  // The Anthropic SDK raises its error event as an API error.
  for (const ch of ['anthropic-sim', 'anthropic-sim-b']) await setSim(ch, { fault: { kind: 'cut_after_first_token', after_tokens: 2 } })
  const s = anthropic().messages.stream({ model: 'claude-haiku-4-5', max_tokens: 64, messages: [{ role: 'user', content: 'hi' }] })
  await assert.rejects(s.finalMessage(), Anthropic.APIError)
})

test('a stored response is followed up on the channel that stored it', async () => {
  // spec: D4
  const c = openai()
  const { data: first, response } = await c.responses.create({ model: 'gpt-4o-mini', input: 'remember this' }).withResponse()
  const holder = response.headers.get('x-spillway-channel')
  // Each channel stores only its own responses (as each provider account does): a GET
  // sent to the other one would be a 404.
  for (let i = 0; i < 5; i++) assert.equal((await c.responses.retrieve(first.id)).id, first.id)
  const { response: next } = await c.responses.create({ model: 'gpt-4o-mini', input: 'and then?', previous_response_id: first.id }).withResponse()
  assert.equal(next.headers.get('x-spillway-channel'), holder)
  await c.responses.delete(first.id)
  await assert.rejects(c.responses.retrieve(first.id), OpenAI.NotFoundError)
})
