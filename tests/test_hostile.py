"""The gateway as a hostile or broken client meets it: slow headers, a stream nobody reads,
a connection flood, bodies that are too big, too slow, not JSON or not one value, foreign
Host names and cross-origin pages; and as a misbehaving provider meets it: redirects,
absurd wait hints, endless answers. Every test is bounded in time and uses loopback only."""

import json
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from conftest import wait_for
from wire import BODIES, error_of, post


def addr(gw):
    u = urlparse(gw.url)
    return u.hostname, u.port


def connect(gw, rcvbuf=None):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(addr(gw))
    return s


def closed_within(s, seconds):
    """How long until the peer closes `s` (reading and discarding), or None."""
    t = time.monotonic()
    s.settimeout(0.1)
    while time.monotonic() - t < seconds:
        try:
            if s.recv(65536) == b"":
                return time.monotonic() - t
        except socket.timeout:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - t
    return None


def read_response(s, timeout=5.0):
    """A whole HTTP/1.1 response with a Content-Length body: (status, headers, body)."""
    s.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, f"connection closed after {buf!r}"
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(body) < n:
        chunk = s.recv(65536)
        assert chunk
        body += chunk
    return status, headers, body


# --- connection limits -------------------------------------------------------------------

def test_slowloris_is_closed_at_the_header_deadline_and_idle_keepalive_at_its_own(gateway_factory):
    gw = gateway_factory(extra_yaml="server: {header_read_timeout_ms: 500, keep_alive_idle_ms: 2000}")
    s = connect(gw)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    t = time.monotonic()
    closed = None
    # A header line every 100 ms: the client is alive, but its headers never end.
    s.settimeout(0.1)
    while time.monotonic() - t < 5:
        try:
            s.sendall(b"X-Slow: 1\r\n")
            if s.recv(1) == b"":
                closed = time.monotonic() - t
                break
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            closed = time.monotonic() - t
            break
    assert closed is not None and 0.4 <= closed < 2.0, closed
    # An idle keep-alive connection lives past the header deadline, until its own.
    s = connect(gw)
    body = json.dumps(BODIES["openai"]).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {gw.key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    status, _, _ = read_response(s)
    assert status == 200
    took = closed_within(s, 6)
    assert took is not None and 1.5 <= took < 4.0, took


def test_a_stream_whose_client_stops_reading_frees_its_slots(gateway_factory):
    # spec: B1, C1
    gw = gateway_factory(extra_yaml="server: {write_timeout_ms: 1000}", max_concurrency=1,
                         key_yaml="    max_concurrency: 1")
    ch = gw.channel("openai")
    # An answer far larger than every socket buffer between the two, as fast as it can go.
    gw.sim.set(ch, output_tokens=150_000)
    s = connect(gw, rcvbuf=4096)
    body = json.dumps({**BODIES["openai"], "stream": True}).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {gw.key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    s.settimeout(5)
    head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    rid = [line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n") if line.lower().startswith(b"x-request-id")][0]
    # ...and the client reads no more.
    t = time.monotonic()

    def channel():
        return next(c for c in gw.admin("GET", "/admin/v1/overview")["channels"] if c["name"] == ch)

    assert wait_for(lambda: channel()["in_flight"] == 0, 12), "the channel slot was never given back"
    freed = time.monotonic() - t
    assert freed >= 0.9, freed
    row = gw.request_row(rid)
    assert (row["state"], row["error_class"], row["partial_output_committed"]) == ("failed", "client_stalled", 1)
    # The key's only concurrency slot is free too: the next request runs at once.
    gw.sim.set(ch)
    r = post(gw, "openai", gw.key, json=BODIES["openai"], timeout=5)
    assert r.status_code == 200, r.text
    s.close()


def test_a_connection_flood_past_the_cap_is_refused_and_the_gateway_recovers(gateway_factory):
    gw = gateway_factory(extra_yaml="server: {max_connections: 8}")
    held = [connect(gw) for _ in range(8)]
    # Let the gateway accept all eight before the flood.
    time.sleep(0.2)
    refused = 0
    for i in range(12):
        s = connect(gw)
        try:
            if i % 2:
                # A client that sends its request at once still gets the 503, not a reset.
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            status, headers, body = read_response(s, timeout=3)
            assert status == 503 and headers["retry-after"] == "1"
            assert "too many open connections" in json.loads(body)["error"]["message"]
            refused += 1
        finally:
            s.close()
    assert refused == 12
    for s in held:
        s.close()
    assert wait_for(lambda: post(gw, "openai", gw.key, json=BODIES["openai"], timeout=5).status_code == 200, 5)


# --- cheap, strict rejection --------------------------------------------------------------

def test_a_request_over_its_keys_limit_is_refused_before_its_body_is_read(gateway_factory):
    # spec: B2, A5
    gw = gateway_factory(key_yaml="    rpm: 1", extra_yaml="max_body_bytes: 100000000")
    assert post(gw, "openai", gw.key, json=BODIES["openai"]).status_code == 200
    before = gw.calls("openai")
    s = connect(gw)
    # Headers for a 50 MB body, and not one byte of it.
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {gw.key}\r\nContent-Length: 50000000\r\n\r\n".encode())
    t = time.monotonic()
    status, headers, body = read_response(s, timeout=5)
    assert time.monotonic() - t < 1.0, "no waiting for a body that is refused anyway"
    assert status == 429 and int(headers["retry-after"]) >= 30
    assert json.loads(body)["error"]["message"] == "This API key has reached its rate or concurrency limit."
    assert gw.calls("openai") == before
    # A body over the gateway's size limit is refused from its Content-Length alone.
    gw2 = gateway_factory(extra_yaml="max_body_bytes: 1000")
    s = connect(gw2)
    s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"x-api-key: {gw2.key}\r\nContent-Length: 50000000\r\n\r\n".encode())
    status, _, body = read_response(s, timeout=5)
    assert status == 413 and json.loads(body)["error"]["type"] == "request_too_large"


@pytest.mark.parametrize("fmt", ["openai", "anthropic", "gemini"])
def test_a_body_must_be_one_utf8_json_value_of_application_json(gateway, fmt):
    # spec: A5, A3, P3
    before = gateway.calls(fmt)
    good = json.dumps(BODIES[fmt]).encode()
    secret = "sk-live-do-not-echo-4f9a"
    cases = [
        (good + b'{"model": "x"}', 400, "exactly one JSON value"),
        (good + b"garbage", 400, "exactly one JSON value"),
        (good[:-1] + b', "x": "\xff\xfe"}', 400, "not valid UTF-8"),
    ]
    bad_type = dict(BODIES[fmt])
    field = {"openai": "messages", "anthropic": "max_tokens", "gemini": "contents"}[fmt]
    bad_type[field] = secret
    cases.append((json.dumps(bad_type).encode(), 400, f"`{field}`"))
    for body, code, says in cases:
        r = post(gateway, fmt, gateway.key, content=body, headers={"content-type": "application/json"})
        assert r.status_code == code, (body, r.text)
        _, message = error_of(fmt, r.json())
        assert says in message, message
        assert secret not in r.text, "the client's own text is never echoed"
        row = gateway.request_row(r.headers["x-request-id"])
        assert row["error_class"] == "invalid_body"
        assert secret not in (row["error_message"] or "")
    r = post(gateway, fmt, gateway.key, content=good, headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.headers["x-should-retry"] == "false"
    assert "application/json" in error_of(fmt, r.json())[1]
    assert gateway.calls(fmt) == before, "nothing malformed is forwarded"


def test_fields_stored_from_a_request_are_bounded(gateway):
    # spec: I1, A6
    r = post(gateway, "openai", gateway.key, json=BODIES["openai"],
             headers={"x-client-request-id": "c" * 5000, "traceparent": "00-" + "f" * 500})
    assert r.status_code == 200
    row = gateway.request_row(r.headers["x-request-id"])
    assert row["client_request_id"] is None, "an oversized client id is not kept"
    assert len(row["trace_id"]) == 32
    long_model = "m" * 300
    r = httpx.post(f"{gateway.url}/v1beta/models/{long_model}:generateContent",
                   headers={"x-goog-api-key": gateway.key}, json=BODIES["gemini"])
    assert r.status_code == 400 and long_model not in r.text
    row = gateway.request_row(r.headers["x-request-id"])
    assert row["requested_model"] is None and len(row["endpoint"]) < 64
    assert row["endpoint"] == "/v1beta/models/{model}:generateContent"


# --- upstream containment -----------------------------------------------------------------

def test_an_upstream_redirect_is_not_followed_and_nothing_leaks(gateway_factory):
    gw = gateway_factory(group=2)
    a, b = gw.groups["openai"]
    port = urlparse(gw.sim.url).port
    elsewhere = f"{gw.sim.url.replace('127.0.0.1', 'localhost')}/{a}-elsewhere"
    gw.sim.set(a, fault={"kind": "redirect", "location": f"{elsewhere}/v1/chat/completions"})
    r = post(gw, "openai", gw.key, json=BODIES["openai"])
    assert r.status_code == 502
    assert "redirect" in error_of("openai", r.json())[1]
    assert r.headers["x-should-retry"] == "false", "held for a person, not retried blindly"
    # The other host received nothing: not the channel's key, not the prompt.
    other = gw.sim.stats(f"{a}-elsewhere")
    assert other["calls"] == 0 and other["last_headers"] == {}
    assert gw.group_calls("openai") == [1, 0]
    assert port


def test_an_absurd_retry_after_is_clamped(gateway_factory):
    # spec: D6, F2
    gw = gateway_factory(extra_yaml="upstream: {max_wait_hint_ms: 30000}")
    ch = gw.channel("anthropic")
    gw.sim.set(ch, fault={"kind": "status", "status": 429, "retry_after_s": 999999999})
    r = post(gw, "anthropic", gw.key, json=BODIES["anthropic"])
    assert r.status_code == 429
    assert 1 <= int(r.headers["retry-after"]) <= 30
    c = next(c for c in gw.admin("GET", "/admin/v1/overview")["channels"] if c["name"] == ch)
    assert c["health"]["state"] == "paced" and c["health"]["back_in_ms"] <= 30000
    gw.request_row(r.headers["x-request-id"])
    att = gw.attempts(r.headers["x-request-id"])
    assert att[0]["retry_after_ms"] == 30000


def test_an_answer_larger_than_the_cap_is_refused(gateway_factory):
    gw = gateway_factory(extra_yaml="upstream: {max_response_bytes: 2048}")
    ch = gw.channel("gemini")
    gw.sim.set(ch, output_tokens=2000)
    r = post(gw, "gemini", gw.key, json=BODIES["gemini"])
    assert r.status_code == 502
    assert "max_response_bytes" in error_of("gemini", r.json())[1]
    gw.request_row(r.headers["x-request-id"])
    att = gw.attempts(r.headers["x-request-id"])
    assert att[0]["error_class"] == "malformed_response"


# --- Host and origin ----------------------------------------------------------------------

def test_a_foreign_host_is_refused_here_and_at_the_simulator(gateway_factory):
    # spec: P1
    gw = gateway_factory(extra_yaml="allowed_hosts: [gateway.test]")
    port = urlparse(gw.url).port
    for fmt, name in [("openai", "permission_denied"), ("anthropic", "permission_error"), ("gemini", "PERMISSION_DENIED")]:
        r = post(gw, fmt, gw.key, json=BODIES[fmt], headers={"host": "rebound.example"})
        assert r.status_code == 403 and r.headers["x-request-id"]
        assert error_of(fmt, r.json())[0] == name
    for p in ("/admin/v1/overview", "/", "/healthz"):
        r = httpx.get(gw.url + p, headers={"host": f"rebound.example:{port}",
                                           "authorization": f"Bearer {gw.admin_token}"})
        assert r.status_code == 403, p
    for ok in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", "gateway.test"):
        assert post(gw, "openai", gw.key, json=BODIES["openai"], headers={"host": ok}).status_code == 200, ok
    o = gw.admin("GET", "/admin/v1/overview")
    assert any(x["reason"] == "forbidden_host" for x in o["rejections"])
    # The simulator's unauthenticated control API answers loopback names only.
    r = httpx.get(gw.sim.url + "/_control/channels", headers={"host": "rebound.example"})
    assert r.status_code == 403


def test_the_admin_api_answers_no_other_origin(gateway):
    # spec: P2, P5
    h = {"authorization": f"Bearer {gateway.admin_token}"}
    r = httpx.options(gateway.url + "/admin/v1/overview",
                      headers={"origin": "http://evil.example", "access-control-request-method": "GET"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(gateway.url + "/admin/v1/overview", headers={**h, "origin": "http://evil.example"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    r = httpx.get(gateway.url + "/admin/v1/overview", headers={**h, "origin": gateway.url})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_a_full_capacity_queue_refuses_at_once(gateway_factory):
    # spec: C2
    gw = gateway_factory(extra_yaml="capacity_queue_max: 1", max_concurrency=1)
    ch = gw.channel("openai")
    gw.sim.set(ch, latency_ms=3000)
    results = []
    first = threading.Thread(target=lambda: results.append(post(gw, "openai", gw.key, json=BODIES["openai"], timeout=30)))
    first.start()
    assert wait_for(lambda: gw.sim.stats(ch)["in_flight"] == 1, 5)
    # One may wait (the queue holds one)...
    second = threading.Thread(target=lambda: results.append(post(gw, "openai", gw.key, json=BODIES["openai"], timeout=30)))
    second.start()
    assert wait_for(lambda: gw.admin("GET", "/admin/v1/overview")["routes"][0]["queued"] == 1, 5)
    # ...the next finds the queue full: C2's 429 at once, not after the 10 s wait.
    t = time.monotonic()
    r = post(gw, "openai", gw.key, json=BODIES["openai"], timeout=30)
    assert time.monotonic() - t < 1.0
    assert r.status_code == 429 and "retry-after" in r.headers
    assert error_of("openai", r.json())[1] == "All upstream capacity for this model is busy. Retry shortly."
    assert gw.request_row(r.headers["x-request-id"])["error_class"] == "capacity_queue_full"
    first.join(10)
    second.join(10)
    assert sorted(x.status_code for x in results) == [200, 200]
    gw.sim.set(ch)
