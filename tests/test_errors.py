"""Errors in the caller's wire format (A3): bad keys (A2), malformed and oversized bodies
(A5), unknown paths, and what the SDKs make of them. Nothing malformed reaches a provider."""

import threading
import time

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from conftest import MODELS, start_gateway, stop
from wire import BODIES, error_of, post

@pytest.mark.parametrize("fmt,name", [("openai", "invalid_api_key"), ("anthropic", "authentication_error"), ("gemini", "UNAUTHENTICATED")])
def test_401_in_callers_format(gateway, fmt, name):
    # spec: A2, A3, A8
    before = gateway.calls(fmt)
    ids = []
    for key in (None, "sk-wrong-key-0000000000"):
        r = post(gateway, fmt, key, json=BODIES[fmt])
        assert r.status_code == 401
        kind, message = error_of(fmt, r.json())
        assert kind == name
        assert ("Missing API key" in message) if key is None else (message == "Invalid API key.")
        assert "sk-wrong" not in r.text, "P3: a presented key is never echoed"
        assert r.headers["x-should-retry"] == "false"
        ids.append(r.headers["x-request-id"])
    assert gateway.calls(fmt) == before, "nothing reaches the provider"
    # Without a valid key there is no ledger row (a flood must not fill the disk), but the
    # console counts and lists the refusals.
    with gateway.db() as con:
        assert con.execute(f"SELECT count(*) FROM requests WHERE id IN ({','.join('?' * len(ids))})", ids).fetchone()[0] == 0
    o = gateway.admin("GET", "/admin/v1/overview")
    assert [x["reason"] for x in o["rejections"][:2]] == ["invalid_key", "missing_key"]
    assert o["rejections"][0]["format"] == fmt and o["rejections"][0]["peer"] == "127.0.0.1"
    assert o["headline"]["rejected_last_minute"] == 2


def test_sdks_see_401_as_authentication_errors(gateway):
    # spec: A3
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-nope", max_retries=0).chat.completions.create(
            model=MODELS["openai"], messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "invalid_api_key"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=gateway.url, api_key="sk-nope", max_retries=0).messages.create(
            model=MODELS["anthropic"], max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    client = genai.Client(api_key="sk-nope", http_options=types.HttpOptions(base_url=gateway.url, api_version="v1beta"))
    with pytest.raises(genai_errors.ClientError) as e:
        client.models.generate_content(model=MODELS["gemini"], contents="hi")
    assert e.value.code == 401 and e.value.status == "UNAUTHENTICATED"


BAD = {
    "openai": [(b'{"model": "gpt-4o-mini", "messages": "hi"}', "messages"),
               (b'{"messages": [{"role": "user"}]}', "model"),
               (b'{"model": "gpt-4o-mini", "messages": [{}], "stream": "yes"}', "stream"),
               (b'{"model": "gpt-4o-mini", "messages": [', None)],
    "anthropic": [(b'{"model": "claude-haiku-4-5", "messages": [{"role": "user", "content": "hi"}]}', "max_tokens"),
                  (b'{"model": "claude-haiku-4-5", "max_tokens": "ten", "messages": [{}]}', "max_tokens"),
                  (b'not json', None)],
    "gemini": [(b'{"contents": "hi"}', "contents"), (b'{}', "contents"), (b'[]', None)],
}


@pytest.mark.parametrize("fmt", ["openai", "anthropic", "gemini"])
def test_400_names_the_field_and_nothing_is_forwarded(gateway, fmt):
    # spec: A3, A5, A8
    before = gateway.calls(fmt)
    for body, field in BAD[fmt]:
        r = post(gateway, fmt, gateway.key, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        kind, message = error_of(fmt, r.json())
        assert kind in ("invalid_request_error", "INVALID_ARGUMENT")
        assert r.headers["x-should-retry"] == "false"
        if field:
            assert f"`{field}`" in message, message
            if fmt == "openai":
                assert r.json()["error"]["param"] == field
        else:
            assert "JSON" in message, message
    assert gateway.calls(fmt) == before


def test_sdk_sees_400_as_bad_request(gateway):
    # spec: A3
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic.Anthropic(base_url=gateway.url, api_key=gateway.key, max_retries=0).messages.create(
            model=MODELS["anthropic"], max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert "max_tokens" in e.value.body["error"]["message"]


@pytest.mark.parametrize("fmt,name", [("openai", "request_too_large"), ("anthropic", "request_too_large"), ("gemini", "INVALID_ARGUMENT")])
def test_413_over_the_configured_limit(gateway_factory, fmt, name):
    # spec: A3, A5
    gw = gateway_factory(extra_yaml="max_body_bytes: 2048")
    big = dict(BODIES[fmt])
    big["padding"] = "x" * 4096
    r = post(gw, fmt, gw.key, json=big)
    assert r.status_code == 413
    kind, message = error_of(fmt, r.json())
    assert kind == name and "2048 bytes" in message
    assert r.headers["x-should-retry"] == "false"
    # Without Content-Length (chunked upload) the limit holds while reading.
    import json as _json
    payload = _json.dumps(big).encode()
    r = post(gw, fmt, gw.key, content=iter([payload[:1000], payload[1000:]]), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert gw.calls(fmt) == 0
    # Just under the limit passes.
    assert post(gw, fmt, gw.key, json=BODIES[fmt]).status_code == 200


def test_unknown_model_and_path(gateway):
    # spec: A4
    r = post(gateway, "openai", gateway.key, json={"model": "gpt-unknown", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert "No channel serves the requested model" in r.json()["error"]["message"]
    assert "gpt-unknown" not in r.text, "the client's own text is never echoed"
    assert r.json()["error"]["param"] == "model"
    # A model served only by a channel of another format is not routed across formats.
    r = post(gateway, "openai", gateway.key, json={"model": MODELS["anthropic"], "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    r = httpx.get(gateway.url + "/v1/nothing")
    assert r.status_code == 404 and r.headers["x-request-id"]
    assert "No such endpoint" in r.json()["error"]["message"]
    r = httpx.post(gateway.url + "/v1beta/models/x:countTokens", headers={"x-goog-api-key": gateway.key}, json={})
    assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND"
    r = httpx.get(gateway.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.headers["x-request-id"]


def test_upstream_400_is_returned_as_sent_without_retry(gateway):
    # spec: D3
    ch = gateway.channel("openai")
    gateway.sim.set(ch, fault={"kind": "status", "status": 400, "message": "max_tokens is too large"})
    try:
        before = gateway.calls("openai")
        r = post(gateway, "openai", gateway.key, json=BODIES["openai"])
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "max_tokens is too large"
        assert r.headers["x-should-retry"] == "false"
        assert gateway.calls("openai") == before + 1
        row = gateway.request_row(r.headers["x-request-id"])
        assert (row["state"], row["http_status"], row["error_class"]) == ("failed", 400, "invalid_request")
    finally:
        gateway.sim.set(ch)


def test_refusals_before_the_body_is_read_close_the_connection_cleanly(tmp_path, sim):
    # spec: B2
    # A key over its rate is refused before its body is read; the connection then cannot
    # carry another request. Keep-alive clients hammering the limit (SDK retries do) must
    # never send into a connection the server is dropping: the refusal says `close`.
    gw = start_gateway(tmp_path, sim, key_yaml="    rpm: 1")
    try:
        errors, codes = [], []

        def hammer():
            with httpx.Client(timeout=20) as c:
                end = time.monotonic() + 3
                while time.monotonic() < end:
                    try:
                        r = c.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {gw.key}"},
                                   json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x" * 2000}]})
                        codes.append((r.status_code, r.headers.get("connection")))
                    except httpx.HTTPError as e:
                        errors.append(repr(e))

        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, (len(errors), errors[:3])
        assert len(codes) > 100
        assert {c for c, _ in codes} == {200, 429}
        assert all(conn == "close" for c, conn in codes if c == 429)
        # An answered request keeps its connection.
        assert all(conn is None for c, conn in codes if c == 200)
    finally:
        stop(gw.proc)
