"""The official SDKs work unchanged through the gateway: only base URL and key change (A1)."""

import threading
import time

import anthropic
import httpx
import openai
from google import genai
from google.genai import types

from conftest import EMBED_MODELS, MODELS


def oa(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.key, max_retries=0)


def an(gw, **kw):
    kw.setdefault("api_key", gw.key)
    return anthropic.Anthropic(base_url=gw.url, max_retries=0, **kw)


def gm(gw, key=None):
    return genai.Client(api_key=key or gw.key, http_options=types.HttpOptions(base_url=gw.url, api_version="v1beta"))


def check_a7_headers(gw, headers, fmt):
    # spec: A7
    assert headers["x-spillway-attempts"] == "1"
    assert headers["x-spillway-served-model"] == MODELS[fmt]
    assert headers["x-spillway-route"] == f"{fmt}/{MODELS[fmt]}"
    assert headers["x-spillway-channel"] == gw.channel(fmt)
    assert "x-spillway-queued-ms" not in headers, "only set when the request waited for capacity"


def check_ledger(gw, request_id, fmt, stream):
    # spec: I1
    row = gw.request_row(request_id)
    assert row["state"] == "done"
    assert row["http_status"] == 200
    assert row["format"] == fmt
    assert row["key_name"] == "app" and row["owner"] == "team-a"
    assert row["requested_model"] == MODELS[fmt] == row["served_model"]
    assert row["channel"] == gw.channel(fmt)
    assert row["stream"] == int(stream)
    assert row["input_tokens"] > 0 and row["output_tokens"] == 12
    assert row["received_at"] <= row["admitted_at"] <= row["first_token_at"] <= row["finished_at"]
    assert row["upstream_request_id"].startswith("req_")
    assert len(row["body_sha256"]) == 64
    attempts = gw.attempts(request_id)
    assert len(attempts) == 1
    assert attempts[0]["error_class"] == "success"
    assert attempts[0]["upstream_request_id"] == row["upstream_request_id"]
    return row


def test_openai_chat(gateway):
    # spec: A1
    raw = oa(gateway).chat.completions.with_raw_response.create(
        model=MODELS["openai"], messages=[{"role": "user", "content": "hello"}])
    comp = raw.parse()
    assert comp.choices[0].message.content.startswith("Queues absorb bursts")
    assert comp.usage.completion_tokens == 12
    check_a7_headers(gateway, raw.headers, "openai")
    check_ledger(gateway, raw.headers["x-request-id"], "openai", stream=False)


def test_openai_stream(gateway):
    # spec: A1, H1, M2
    raw = oa(gateway).chat.completions.with_raw_response.create(
        model=MODELS["openai"], messages=[{"role": "user", "content": "hello"}], stream=True,
        stream_options={"include_usage": True})
    check_a7_headers(gateway, raw.headers, "openai")
    text, usage = "", None
    for chunk in raw.parse():
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text.startswith("Queues absorb bursts")
    assert usage.completion_tokens == 12
    row = check_ledger(gateway, raw.headers["x-request-id"], "openai", stream=True)
    assert row["partial_output_committed"] == 0


def test_anthropic_messages(gateway):
    # spec: A1
    raw = an(gateway).messages.with_raw_response.create(
        model=MODELS["anthropic"], max_tokens=64, messages=[{"role": "user", "content": "hello"}])
    msg = raw.parse()
    assert msg.content[0].text.startswith("Queues absorb bursts")
    assert msg.usage.output_tokens == 12
    check_a7_headers(gateway, raw.headers, "anthropic")
    check_ledger(gateway, raw.headers["x-request-id"], "anthropic", stream=False)


def test_anthropic_stream(gateway):
    # spec: A1, H1, M2
    with an(gateway).messages.stream(model=MODELS["anthropic"], max_tokens=64,
                                     messages=[{"role": "user", "content": "hello"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
        request_id = s.response.headers["x-request-id"]
        check_a7_headers(gateway, s.response.headers, "anthropic")
    assert text.startswith("Queues absorb bursts")
    assert final.usage.output_tokens == 12
    check_ledger(gateway, request_id, "anthropic", stream=True)


def test_anthropic_sdk_bearer_auth(gateway):
    # spec: A2 (some Anthropic SDK versions send Authorization: Bearer)
    msg = an(gateway, api_key=None, auth_token=gateway.key).messages.create(
        model=MODELS["anthropic"], max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert msg.usage.output_tokens == 12


def test_gemini_generate(gateway):
    # spec: A1
    client = gm(gateway)  # google-genai closes its HTTP client when the Client is collected
    r = client.models.generate_content(model=MODELS["gemini"], contents="hello")
    assert r.text.startswith("Queues absorb bursts")
    assert r.usage_metadata.candidates_token_count == 12
    headers = r.sdk_http_response.headers
    check_a7_headers(gateway, headers, "gemini")
    check_ledger(gateway, headers["x-request-id"], "gemini", stream=False)


def test_gemini_stream(gateway):
    # spec: A1, H1, M2
    client = gm(gateway)
    chunks = list(client.models.generate_content_stream(model=MODELS["gemini"], contents="hello"))
    assert "".join(c.text or "" for c in chunks).startswith("Queues absorb bursts")
    assert chunks[-1].usage_metadata.candidates_token_count == 12
    request_id = chunks[0].sdk_http_response.headers["x-request-id"]
    check_ledger(gateway, request_id, "gemini", stream=True)
    # The SDK streams with alt=sse; the path and query reach the provider as sent.
    assert gateway.sim.stats(gateway.channel("gemini"))["last_path"] == f"/v1beta/models/{MODELS['gemini']}:streamGenerateContent?alt=sse"


def test_gemini_key_in_query_is_not_forwarded(gateway):
    # spec: A2, P3
    r = httpx.post(f"{gateway.url}/v1beta/models/{MODELS['gemini']}:generateContent?key={gateway.key}",
                   json={"contents": [{"parts": [{"text": "hi"}]}]})
    assert r.status_code == 200
    stats = gateway.sim.stats(gateway.channel("gemini"))
    assert stats["last_path"] == f"/v1beta/models/{MODELS['gemini']}:generateContent"
    assert gateway.key not in str(stats)


def test_upstream_gets_channel_key_and_trace_never_client_key(gateway):
    # spec: A6, P4
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = httpx.post(f"{gateway.url}/v1/chat/completions",
                   headers={"authorization": f"Bearer {gateway.key}", "traceparent": f"00-{trace}-00f067aa0ba902b7-01",
                            "x-client-request-id": "client-42"},
                   json={"model": MODELS["openai"], "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    seen = gateway.sim.stats(gateway.channel("openai"))["last_headers"]
    assert seen["authorization"] == "Bearer sk-upstream-" + gateway.channel("openai").split("-")[0]
    assert gateway.key not in str(seen)
    assert seen["traceparent"].startswith(f"00-{trace}-") and not seen["traceparent"].endswith("00f067aa0ba902b7-01")
    row = gateway.request_row(r.headers["x-request-id"])
    assert row["trace_id"] == trace
    assert row["client_request_id"] == "client-42"
    assert r.headers["x-spillway-upstream-request-id"] == row["upstream_request_id"]


def test_model_lists(gateway):
    # spec: A1
    assert [m.id for m in oa(gateway).models.list()] == [MODELS["openai"], EMBED_MODELS["openai"]]
    assert [m.id for m in an(gateway).models.list()] == [MODELS["anthropic"]]
    r = httpx.get(f"{gateway.url}/v1beta/models", headers={"x-goog-api-key": gateway.key})
    assert r.json()["models"][0]["name"] == f"models/{MODELS['gemini']}"


# --- How the SDKs meet the gateway's retry signals (A8, B2, C2, D7) ------------------------------

def requests_in_ledger(gw):
    with gw.db() as con:
        return con.execute("SELECT count(*) FROM requests").fetchone()[0]


def test_sdks_see_the_key_limit_as_their_rate_limit_error(gateway_factory):
    # spec: B2, A8
    gw = gateway_factory(key_yaml="    rpm: 1")
    oa(gw).chat.completions.create(model=MODELS["openai"], messages=[{"role": "user", "content": "hi"}])
    try:
        oa(gw).chat.completions.create(model=MODELS["openai"], messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("expected a rate-limit error")
    except openai.RateLimitError as e:
        assert e.status_code == 429
        assert "This API key has reached its rate or concurrency limit." in str(e)
        assert 50 <= int(e.response.headers["retry-after"]) <= 60
    try:
        an(gw).messages.create(model=MODELS["anthropic"], max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("expected a rate-limit error")
    except anthropic.RateLimitError as e:
        assert e.status_code == 429 and e.body["error"]["type"] == "rate_limit_error"


def test_sdks_honour_retry_after_from_a_busy_gateway(gateway_factory):
    # spec: C2, A8
    gw = gateway_factory(max_concurrency=1, extra_yaml="capacity_wait_ms: 200")
    ch = gw.channel("openai")
    gw.sim.set(ch, latency_ms=900)
    held = threading.Thread(target=lambda: oa(gw).chat.completions.create(
        model=MODELS["openai"], messages=[{"role": "user", "content": "hold"}]))
    held.start()
    deadline = time.monotonic() + 5
    while gw.sim.stats(ch)["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.key, max_retries=3)
    t = time.monotonic()
    comp = client.chat.completions.create(model=MODELS["openai"], messages=[{"role": "user", "content": "hi"}])
    took = time.monotonic() - t
    held.join(timeout=30)
    assert comp.choices[0].message.content
    # The first try met a full channel: 429 with `retry-after: 1`, which the SDK waited out.
    assert took >= 1.0, took
    with gw.db() as con:
        busy = con.execute("SELECT count(*) FROM requests WHERE error_class = 'capacity_busy'").fetchone()[0]
    assert busy >= 1
    assert gw.calls("openai") == 2, "the refused try never reached the provider"


def test_sdks_do_not_retry_when_the_gateway_says_it_is_futile(gateway):
    # spec: A8, E2
    for fmt in ("openai", "anthropic"):
        gateway.sim.set(gateway.channel(fmt), fault={"kind": "status", "status": 418})
    before = requests_in_ledger(gateway)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=gateway.key, max_retries=2)
    try:
        client.chat.completions.create(model=MODELS["openai"], messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("expected an error")
    except openai.APIStatusError as e:
        assert e.status_code == 502 and e.response.headers["x-should-retry"] == "false"
    aclient = anthropic.Anthropic(base_url=gateway.url, api_key=gateway.key, max_retries=2)
    try:
        aclient.messages.create(model=MODELS["anthropic"], max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("expected an error")
    except anthropic.APIStatusError as e:
        assert e.status_code == 502
    # One request each: without `x-should-retry: false` each SDK would have sent three.
    deadline = time.monotonic() + 3
    while requests_in_ledger(gateway) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert requests_in_ledger(gateway) == before + 2
    assert gateway.calls("openai") == 1 and gateway.calls("anthropic") == 1
