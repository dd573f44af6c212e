"""Request bodies, paths, auth headers and error envelopes per wire format, shared by the
black-box tests."""

import httpx

from conftest import MODELS

BODIES = {
    "openai": {"model": MODELS["openai"], "messages": [{"role": "user", "content": "hi"}]},
    "anthropic": {"model": MODELS["anthropic"], "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    "gemini": {"contents": [{"parts": [{"text": "hi"}]}]},
}


def path(fmt):
    return {"openai": "/v1/chat/completions", "anthropic": "/v1/messages",
            "gemini": f"/v1beta/models/{MODELS['gemini']}:generateContent"}[fmt]


def auth(fmt, key):
    return {"openai": {"authorization": f"Bearer {key}"}, "anthropic": {"x-api-key": key},
            "gemini": {"x-goog-api-key": key}}[fmt]


def error_of(fmt, body):
    """(type-ish name, message) from an error body, checking the format's envelope (A3)."""
    if fmt == "openai":
        e = body["error"]
        assert set(e) == {"message", "type", "param", "code"}
        return e["code"] or e["type"], e["message"]
    if fmt == "anthropic":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]["type"], body["error"]["message"]
    e = body["error"]
    assert set(e) == {"code", "message", "status"}
    return e["status"], e["message"]


def post(gw, fmt, key=None, **kw):
    headers = auth(fmt, key) if key else {}
    headers.update(kw.pop("headers", {}))
    return httpx.post(gw.url + path(fmt), headers=headers, **kw)
