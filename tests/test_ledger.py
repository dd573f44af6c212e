"""The ledger as an operator relies on it: durable before the provider is called (I3),
honest after a crash (I4), complete after a graceful stop, and truthful about streams
that broke (H2)."""

import signal
import threading
import time

import anthropic
import httpx
import openai
import pytest

from conftest import MODELS, start_gateway, stop, wait_for


def chat(gw, **kw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.key, max_retries=0).chat.completions.create(
        model=MODELS["openai"], messages=[{"role": "user", "content": "hi"}], **kw)


def calling_api_rows(gw):
    with gw.db() as con:
        return con.execute("SELECT * FROM requests WHERE state = 'calling_api'").fetchall()


def test_calling_api_is_durable_before_the_upstream_answers(gateway):
    # spec: I3
    ch = gateway.channel("openai")
    gateway.sim.set(ch, latency_ms=1500)
    try:
        t = threading.Thread(target=chat, args=(gateway,))
        t.start()
        assert wait_for(lambda: gateway.sim.stats(ch)["in_flight"] == 1), "the provider call started"
        rows = calling_api_rows(gateway)
        assert len(rows) == 1, "the row is committed as calling_api while the provider is working"
        assert rows[0]["admitted_at"] is not None and rows[0]["finished_at"] is None
        t.join(10)
        assert gateway.request_row(rows[0]["id"])["state"] == "done"
    finally:
        gateway.sim.set(ch)


def test_crash_during_a_call_leaves_unknown_after_restart(tmp_path, sim):
    # spec: I4
    gw = start_gateway(tmp_path, sim)
    ch = gw.channel("openai")
    sim.set(ch, fault={"kind": "hang", "ms": 3000})
    t = threading.Thread(target=lambda: pytest.raises(Exception, chat, gw), daemon=True)
    t.start()
    assert wait_for(lambda: len(calling_api_rows(gw)) == 1)
    gw.proc.send_signal(signal.SIGKILL)
    gw.proc.wait(10)
    stale = calling_api_rows(gw)[0]["id"]
    sim.set(ch)
    # Same config dir, same ledger file.
    (tmp_path / "gateway.yaml").rename(tmp_path / "old.yaml")
    gw2 = start_gateway(tmp_path, sim)
    try:
        row = gw2.request_row(stale, until=lambda r: True)
        assert row["state"] == "unknown"
        assert row["error_class"] == "interrupted"
    finally:
        stop(gw2.proc)


def test_graceful_stop_finishes_streams_and_flushes(gateway):
    # spec: H1, I3
    ch = gateway.channel("anthropic")
    gateway.sim.set(ch, tokens_per_second=15)  # 12 tokens: ~0.8 s of stream
    got = {}

    def run():
        with anthropic.Anthropic(base_url=gateway.url, api_key=gateway.key, max_retries=0).messages.stream(
                model=MODELS["anthropic"], max_tokens=64, messages=[{"role": "user", "content": "hi"}]) as s:
            got["id"] = s.response.headers["x-request-id"]
            first = True
            text = ""
            for piece in s.text_stream:
                if first:
                    got["first"] = time.monotonic()
                    first = False
                text += piece
            got["text"] = text

    t = threading.Thread(target=run)
    t.start()
    assert wait_for(lambda: "first" in got)
    gateway.proc.send_signal(signal.SIGTERM)
    t.join(10)
    assert got["text"].startswith("Queues absorb bursts") and len(got["text"].split()) == 12
    assert gateway.proc.wait(10) == 0
    row = gateway.request_row(got["id"])
    assert row["state"] == "done" and row["output_tokens"] == 12
    gateway.sim.set(ch)


def test_stream_cut_after_first_token_ends_with_error_event(gateway):
    # spec: H2
    ch = gateway.channel("openai")
    gateway.sim.set(ch, fault={"kind": "cut_after_first_token", "after_tokens": 2})
    try:
        raw = openai.OpenAI(base_url=gateway.url + "/v1", api_key=gateway.key, max_retries=0).chat.completions.with_raw_response.create(
            model=MODELS["openai"], messages=[{"role": "user", "content": "hi"}], stream=True)
        request_id = raw.headers["x-request-id"]
        text = ""
        with pytest.raises(openai.APIError) as e:
            for chunk in raw.parse():
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
        assert text == "Queues absorb", "what was streamed stays streamed"
        assert request_id in str(e.value.message)
        row = gateway.request_row(request_id)
        assert row["state"] == "failed"
        assert row["partial_output_committed"] == 1
        assert row["error_class"] == "stream_interrupted"
        assert gateway.calls("openai") >= 1
    finally:
        gateway.sim.set(ch)


def test_anthropic_stream_cut_raises_in_sdk(gateway):
    # spec: H2
    ch = gateway.channel("anthropic")
    gateway.sim.set(ch, fault={"kind": "cut_after_first_token"})
    try:
        with pytest.raises(anthropic.APIError) as e:
            with anthropic.Anthropic(base_url=gateway.url, api_key=gateway.key, max_retries=0).messages.stream(
                    model=MODELS["anthropic"], max_tokens=64, messages=[{"role": "user", "content": "hi"}]) as s:
                request_id = s.response.headers["x-request-id"]
                for _ in s.text_stream:
                    pass
        assert request_id in str(e.value)
        assert gateway.request_row(request_id)["partial_output_committed"] == 1
    finally:
        gateway.sim.set(ch)


def test_no_secret_reaches_the_ledger(gateway):
    # spec: P3, I6
    r = httpx.post(gateway.url + "/v1/chat/completions", headers={"authorization": f"Bearer {gateway.key}"},
                   json={"model": MODELS["openai"], "messages": [{"role": "user", "content": "the secret prompt"}]})
    assert r.status_code == 200
    gateway.request_row(r.headers["x-request-id"])
    httpx.post(gateway.url + "/v1/chat/completions", headers={"authorization": "Bearer sk-wrong-key-123456"}, json={})
    time.sleep(0.2)
    gateway.proc.send_signal(signal.SIGTERM)
    gateway.proc.wait(10)
    data = b"".join(p.read_bytes() for p in gateway.ledger.parent.glob("ledger.db*"))
    assert gateway.key.encode() not in data
    assert b"sk-wrong-key" not in data
    assert b"sk-upstream" not in data
    assert b"the secret prompt" not in data, "interactive prompts are stored only as hashes"


def test_client_hanging_up_mid_call_still_gets_a_complete_record(gateway):
    # spec: I1, I3
    ch = gateway.channel("openai")
    gateway.sim.set(ch, latency_ms=600)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(gateway.url + "/v1/chat/completions", headers={"authorization": f"Bearer {gateway.key}"},
                       json={"model": MODELS["openai"], "messages": [{"role": "user", "content": "hi"}]}, timeout=0.2)
        assert wait_for(lambda: len(calling_api_rows(gateway)) == 0, timeout=5), "the call is not left in calling_api"
        with gateway.db() as con:
            row = con.execute("SELECT * FROM requests ORDER BY id DESC LIMIT 1").fetchone()
        assert row["state"] == "done" and row["output_tokens"] == 12, "the provider's answer is still metered"
    finally:
        gateway.sim.set(ch)
