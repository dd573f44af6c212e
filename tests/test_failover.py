"""Failover, retry decisions and channel health against injected provider faults (D1-D3,
D6-D7, E2-E3, F1-F3, H2-H4). Every test counts the exact upstream calls the simulator saw.

Groups are built so the first channel (`-{fmt}`) is always tried first (higher priority);
the fault goes there, and the second channel shows where the request went next."""

import json
import threading
import time

import httpx
import pytest

from conftest import MODELS, wait_for
from wire import BODIES, error_of, post


def status(code, **kw):
    return {"kind": "status", "status": code, **kw}


def stream_post(gw, fmt, body=None, timeout=30):
    """A streaming request; returns (response, full text)."""
    body = dict(body or BODIES[fmt])
    if fmt == "gemini":
        url = gw.url + f"/v1beta/models/{MODELS['gemini']}:streamGenerateContent?alt=sse"
        headers = {"x-goog-api-key": gw.key}
    else:
        body["stream"] = True
        url = gw.url + ("/v1/chat/completions" if fmt == "openai" else "/v1/messages")
        headers = {"authorization": f"Bearer {gw.key}"} if fmt == "openai" else {"x-api-key": gw.key}
    with httpx.stream("POST", url, headers=headers, json=body, timeout=timeout) as r:
        text = "".join(r.iter_text())
    return r, text


def attempts_of(gw, r):
    rid = r.headers["x-request-id"]
    gw.request_row(rid)
    return [dict(a) for a in gw.attempts(rid)]


# --- D2: every failover condition moves the request to the next channel -------------------

D2_CASES = [
    ("500", status(500), "server_error"),
    ("502", status(502), "server_error"),
    ("503", status(503), "overload"),
    ("504", status(504), "server_error"),
    ("408", status(408), "timeout"),
    ("409", status(409), "transient"),
    ("425", status(425), "transient"),
    ("429", status(429), "rate_limit"),
    ("401 channel credential", status(401), "auth"),
    ("403 channel credential", status(403), "auth"),
    ("channel quota", status(429, error="quota"), "quota"),
    ("timeout", {"kind": "hang", "ms": 3000}, "timeout"),
    ("unreachable", {"kind": "refuse"}, "unreachable"),
]


@pytest.mark.parametrize("name,fault,cls", D2_CASES, ids=[c[0] for c in D2_CASES])
def test_d2_fails_over_to_the_next_channel(gateway_factory, name, fault, cls):
    # spec: D1, D2, E2
    gw = gateway_factory(group=2, extra_yaml="attempt_timeout_ms: 500")
    a, b = gw.groups["openai"]
    gw.sim.set(a, fault=fault)
    r = post(gw, "openai", gw.key, json=BODIES["openai"])
    assert r.status_code == 200, r.text
    assert gw.group_calls("openai") == [1, 1]
    assert r.headers["x-spillway-attempts"] == "2"
    assert r.headers["x-spillway-channel"] == b
    att = attempts_of(gw, r)
    assert [(x["channel"], x["error_class"], x["decision"]) for x in att] == [
        (a, cls, "failover"), (b, "success", "done")]
    assert att[0]["delay_ms"] == 0, "a ready, untried channel needs no back-off"
    assert (att[0]["visibility"], att[1]["visibility"]) == ("before_first_token", None)  # spec: E1


@pytest.mark.parametrize("fmt", ["openai", "anthropic", "gemini"])
def test_d2_h2_stream_cut_before_first_token_fails_over_unseen(gateway_factory, fmt):
    # spec: D2, H2
    gw = gateway_factory(group=2)
    a, b = gw.groups[fmt]
    gw.sim.set(a, fault={"kind": "cut_before_first_token"})
    r, text = stream_post(gw, fmt)
    assert r.status_code == 200
    assert gw.group_calls(fmt) == [1, 1]
    assert r.headers["x-spillway-channel"] == b
    assert "error" not in text.lower(), "the client never sees the failed attempt"
    assert "Queues" in text
    row = gw.request_row(r.headers["x-request-id"])
    assert (row["state"], row["attempts"], row["partial_output_committed"]) == ("done", 2, 0)


def test_h4_idle_before_visible_output_is_retried(gateway_factory):
    # spec: H4, D2
    gw = gateway_factory(group=2, extra_yaml="attempt_timeout_ms: 400")
    a, b = gw.groups["anthropic"]
    # Headers and message_start come at once, the first token only after a second.
    gw.sim.set(a, tokens_per_second=1)
    r, text = stream_post(gw, "anthropic")
    assert r.status_code == 200 and "message_stop" in text
    assert gw.group_calls("anthropic") == [1, 1]
    att = attempts_of(gw, r)
    assert att[0]["error_class"] == "timeout" and "no visible output" in att[0]["message"]


# --- D3: never retried -----------------------------------------------------------------------

@pytest.mark.parametrize("code", [400, 404, 413, 422])
def test_d3_client_errors_are_returned_as_sent(gateway_factory, code):
    # spec: D3, A8
    gw = gateway_factory(group=2)
    a, _ = gw.groups["anthropic"]
    gw.sim.set(a, fault=status(code, message=f"provider says {code}"))
    r = post(gw, "anthropic", gw.key, json=BODIES["anthropic"])
    assert r.status_code == code
    assert error_of("anthropic", r.json())[1] == f"provider says {code}"
    assert r.headers["x-should-retry"] == "false"
    assert gw.group_calls("anthropic") == [1, 0]
    att = attempts_of(gw, r)
    assert [(x["decision"], x["decision_reason"]) for x in att] == [("passed_through", "not_retryable")]


@pytest.mark.parametrize("fmt", ["openai", "anthropic", "gemini"])
def test_d3_h2_a_started_stream_is_never_replayed(gateway_factory, fmt):
    # spec: D3, H2, F2
    gw = gateway_factory(group=2)
    a, _ = gw.groups[fmt]
    gw.sim.set(a, fault={"kind": "cut_after_first_token", "after_tokens": 2})
    r, text = stream_post(gw, fmt)
    rid = r.headers["x-request-id"]
    assert r.status_code == 200
    assert gw.group_calls(fmt) == [1, 0]
    # The stream ends with an error event in the caller's format, carrying the request id.
    assert rid in text
    if fmt == "anthropic":
        assert "event: error" in text
    last = [line for line in text.splitlines() if line.startswith("data:")][-1]
    assert "error" in json.loads(last[5:])
    row = gw.request_row(rid)
    assert (row["state"], row["partial_output_committed"]) == ("failed", 1)
    att = attempts_of(gw, r)
    assert [(x["decision"], x["decision_reason"]) for x in att] == [("fail_closed", "partial_output_committed")]
    assert att[0]["visibility"] == "after_partial_output"  # spec: E1


# --- D1, D7: the attempt budget and the final status ----------------------------------------

def test_d1_at_most_three_attempts_across_the_group(gateway_factory):
    # spec: D1, D7, F2
    gw = gateway_factory(group=3)
    for ch in gw.groups["openai"]:
        gw.sim.set(ch, fault=status(500))
    r = post(gw, "openai", gw.key, json=BODIES["openai"])
    assert r.status_code == 502
    assert gw.group_calls("openai") == [1, 1, 1]
    assert r.headers["x-spillway-attempts"] == "3"
    assert "retry-after" in r.headers
    assert "Gave up after 3 attempts" in error_of("openai", r.json())[1]
    att = attempts_of(gw, r)
    assert [x["decision"] for x in att] == ["failover", "failover", "fail_closed"]
    assert att[-1]["decision_reason"] == "attempt_budget_exhausted"


def test_d1_attempts_are_configurable(gateway_factory):
    # spec: D1
    gw = gateway_factory(group=3, extra_yaml="max_attempts: 2")
    for ch in gw.groups["gemini"]:
        gw.sim.set(ch, fault=status(503))
    r = post(gw, "gemini", gw.key, json=BODIES["gemini"])
    assert gw.group_calls("gemini") == [1, 1, 0]
    assert r.headers["x-spillway-attempts"] == "2"


@pytest.mark.parametrize("faults,code", [
    ([status(429), status(429)], 429),
    ([status(529), status(429)], 502),
    ([status(503), status(503)], 502),
    ([status(500), status(500)], 502),
    ([status(429), status(500)], 502),
], ids=["rate", "overload+rate", "overload", "server", "mixed"])
def test_d7_exhausted_attempts_end_in_429_or_502(gateway_factory, faults, code):
    # spec: D7, A8
    # 429 only when every attempt was paced; a 5xx (503 and 529 overload included) means
    # the provider failed, so the answer is 502.
    gw = gateway_factory(group=2)
    for ch, f in zip(gw.groups["anthropic"], faults):
        gw.sim.set(ch, fault=f)
    r = post(gw, "anthropic", gw.key, json=BODIES["anthropic"])
    assert r.status_code == code
    assert int(r.headers["retry-after"]) >= 1
    assert "x-should-retry" not in r.headers
    assert sum(gw.group_calls("anthropic")) == 3
    kind, _ = error_of("anthropic", r.json())
    assert kind == ("rate_limit_error" if code == 429 else "api_error")


# --- D6, F1, F2: wait hints --------------------------------------------------------------------

def test_d6_a_wait_hint_keeps_the_channel_out_of_new_work(gateway_factory):
    # spec: D6, E1
    gw = gateway_factory(group=2)
    a, b = gw.groups["openai"]
    gw.sim.set(a, fault=status(429, retry_after_s=30))
    for _ in range(5):
        r = post(gw, "openai", gw.key, json=BODIES["openai"])
        assert r.status_code == 200 and r.headers["x-spillway-channel"] == b
    assert gw.group_calls("openai") == [1, 5], "one 429, then nothing until the hint passes"
    view = {c["name"]: c for c in gw.admin("GET", "/admin/v1/overview")["channels"]}
    assert view[a]["health"]["state"] == "paced"
    assert 25_000 <= view[a]["health"]["back_in_ms"] <= 30_000
    assert view[b]["health"]["state"] == "ready"


def test_f2_short_hint_retries_the_same_channel_after_it(gateway):
    # spec: F2, F1, D6
    ch = gateway.channel("openai")
    gateway.sim.set(ch, script=[{"fault": status(429, retry_after_s=1)}])
    t = time.monotonic()
    r = post(gateway, "openai", gateway.key, json=BODIES["openai"])
    assert r.status_code == 200
    assert time.monotonic() - t >= 1.0
    assert gateway.calls("openai") == 2
    att = attempts_of(gateway, r)
    assert (att[0]["decision"], att[0]["retry_after_ms"], att[0]["delay_ms"]) == ("retry", 1000, 1000)
    assert att[0]["ready_at"] <= att[1]["started_at"]


def test_f2_full_jitter_without_a_hint(gateway):
    # spec: F2
    ch = gateway.channel("openai")
    gateway.sim.set(ch, script=[{"fault": status(500)}])
    r = post(gateway, "openai", gateway.key, json=BODIES["openai"])
    assert r.status_code == 200 and gateway.calls("openai") == 2
    att = attempts_of(gateway, r)
    assert att[0]["decision"] == "retry"
    assert 0 <= att[0]["delay_ms"] <= 1000, "random(0, min(30 s, 500 ms * 2^1))"


def test_f2_f1_a_hint_over_two_seconds_queues_with_ready_at(gateway):
    # spec: F2, F1, I5
    ch = gateway.channel("anthropic")
    gateway.sim.set(ch, script=[{"fault": status(529, retry_after_s=3)}])
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("r", post(gateway, "anthropic", gateway.key,
                                                                      json=BODIES["anthropic"], timeout=30)))
    t = time.monotonic()
    th.start()
    # While it waits, the request's next ready_at is on record.
    deadline = time.monotonic() + 2.5
    seen = None
    while time.monotonic() < deadline and seen is None:
        with gateway.db() as con:
            seen = con.execute("SELECT next_ready_at, attempts FROM requests WHERE next_ready_at IS NOT NULL").fetchone()
        time.sleep(0.05)
    th.join(timeout=30)
    r = result["r"]
    assert seen is not None and seen["attempts"] == 1
    assert r.status_code == 200 and time.monotonic() - t >= 3.0
    assert gateway.calls("anthropic") == 2
    att = attempts_of(gateway, r)
    assert (att[0]["error_class"], att[0]["decision"], att[0]["delay_ms"]) == ("overload", "wait", 3000)
    assert att[0]["ready_at"] == seen["next_ready_at"]
    assert gateway.request_row(r.headers["x-request-id"])["next_ready_at"] is None


@pytest.mark.parametrize("fault", [status(429, retry_after_s=30), status(429, retry_after_date_s=60)],
                         ids=["seconds", "http-date"])
def test_f2_a_hint_past_the_deadline_fails_closed_at_once(gateway, fault):
    # spec: F2, F3, E1, D7
    ch = gateway.channel("openai")
    gateway.sim.set(ch, fault=fault)
    t = time.monotonic()
    r = post(gateway, "openai", gateway.key, json=BODIES["openai"])
    assert time.monotonic() - t < 2, "no sleeping past the deadline"
    assert r.status_code == 429
    expected = fault.get("retry_after_s") or fault["retry_after_date_s"]
    assert expected - 2 <= int(r.headers["retry-after"]) <= expected
    assert "past this request's deadline" in error_of("openai", r.json())[1]
    assert gateway.calls("openai") == 1
    att = attempts_of(gateway, r)
    assert (att[0]["decision"], att[0]["decision_reason"]) == ("fail_closed", "retry_after_exceeds_deadline")


def test_f2_attempt_budget_on_one_channel(gateway):
    # spec: F2, F3
    ch = gateway.channel("gemini")
    gateway.sim.set(ch, fault=status(500))
    r = post(gateway, "gemini", gateway.key, json=BODIES["gemini"])
    assert r.status_code == 502 and gateway.calls("gemini") == 3
    kind, _ = error_of("gemini", r.json())
    assert kind == "UNAVAILABLE"
    att = attempts_of(gateway, r)
    assert [x["decision"] for x in att] == ["retry", "retry", "fail_closed"]
    assert att[1]["delay_ms"] <= 2000


def test_f3_the_total_deadline_bounds_every_attempt(gateway_factory):
    # spec: F3
    gw = gateway_factory(extra_yaml="attempt_timeout_ms: 5000\ntotal_deadline_ms: 1200")
    gw.sim.set(gw.channel("openai"), fault={"kind": "hang", "ms": 10_000})
    t = time.monotonic()
    r = post(gw, "openai", gw.key, json=BODIES["openai"], timeout=30)
    took = time.monotonic() - t
    # spec: D7 (a timeout is the provider failing, never pacing: 502)
    assert r.status_code == 502
    assert error_of("openai", r.json())[0] == "api_error"
    assert 1.0 <= took < 3.0, took
    assert gw.calls("openai") == 1


# --- E2: classes and actions, per provider -----------------------------------------------------

def test_e2_anthropic_529_overloaded_is_retried(gateway):
    # spec: E2, E1
    ch = gateway.channel("anthropic")
    gateway.sim.set(ch, script=[{"fault": status(529)}])
    r = post(gateway, "anthropic", gateway.key, json=BODIES["anthropic"])
    assert r.status_code == 200 and gateway.calls("anthropic") == 2
    att = attempts_of(gateway, r)
    assert (att[0]["http_status"], att[0]["error_class"], att[0]["provider_error_type"]) == (529, "overload", "overloaded_error")


def test_e2_gemini_per_minute_resource_exhausted_is_pacing(gateway):
    # spec: E2, E1
    ch = gateway.channel("gemini")
    gateway.sim.set(ch, script=[{"fault": status(429, error="rate_limit", retry_delay="1s")}])
    r = post(gateway, "gemini", gateway.key, json=BODIES["gemini"])
    assert r.status_code == 200 and gateway.calls("gemini") == 2
    att = attempts_of(gateway, r)
    assert (att[0]["error_class"], att[0]["provider_error_type"], att[0]["retry_after_ms"]) == (
        "rate_limit", "RESOURCE_EXHAUSTED", 1000)


@pytest.mark.parametrize("fmt,fault,ptype", [
    ("openai", status(429, error="quota"), "insufficient_quota"),
    ("anthropic", status(400, error="quota"), "billing_error"),
    ("gemini", status(429, error="quota"), "RESOURCE_EXHAUSTED"),
])
def test_e2_quota_is_never_retried_on_the_same_channel(gateway, fmt, fault, ptype):
    # spec: E2, D7
    ch = gateway.channel(fmt)
    gateway.sim.set(ch, fault=fault)
    r = post(gateway, fmt, gateway.key, json=BODIES[fmt])
    assert r.status_code == 502
    assert gateway.calls(fmt) == 1
    message = error_of(fmt, r.json())[1]
    assert "out of provider quota" in message and "operator must restore" in message
    assert r.headers["x-should-retry"] == "false"
    att = attempts_of(gateway, r)
    assert (att[0]["error_class"], att[0]["provider_error_type"]) == ("quota", ptype)
    assert (att[0]["decision"], att[0]["decision_reason"]) == ("fail_closed", "no_channel_left")
    # The channel is out of rotation: the next request is not sent there at all.
    r2 = post(gateway, fmt, gateway.key, json=BODIES[fmt])
    assert r2.status_code == 502 and gateway.calls(fmt) == 1
    assert "is in rotation" in error_of(fmt, r2.json())[1]
    # Until an operator restores it.
    gateway.sim.set(ch)
    view = gateway.admin("POST", f"/admin/v1/channels/{ch}/restore")
    assert view["health"]["state"] == "ready"
    assert post(gateway, fmt, gateway.key, json=BODIES[fmt]).status_code == 200
    assert gateway.calls(fmt) == 2


def test_e2_auth_on_a_channel_fails_over_visibly(gateway_factory):
    # spec: E2, D2
    gw = gateway_factory(group=2)
    a, b = gw.groups["openai"]
    gw.sim.set(a, fault=status(401))
    for _ in range(3):
        assert post(gw, "openai", gw.key, json=BODIES["openai"]).status_code == 200
    assert gw.group_calls("openai") == [1, 3], "the refused channel is ejected, not cycled"
    view = {c["name"]: c for c in gw.admin("GET", "/admin/v1/overview")["channels"]}
    assert view[a]["health"]["state"] == "ejected"
    assert "credential" in view[a]["health"]["reason"]
    assert view[a]["health"]["back_in_ms"] is None, "only an operator brings it back"


@pytest.mark.parametrize("fault,cls", [(status(418), "unknown"), ({"kind": "malformed_body"}, "malformed_response")])
def test_e2_unknown_outcomes_are_held_not_retried(gateway_factory, fault, cls):
    # spec: E2, A8
    gw = gateway_factory(group=2)
    a, _ = gw.groups["openai"]
    gw.sim.set(a, fault=fault)
    r = post(gw, "openai", gw.key, json=BODIES["openai"])
    assert r.status_code == 502
    assert r.headers["x-should-retry"] == "false"
    assert gw.group_calls("openai") == [1, 0]
    att = attempts_of(gw, r)
    assert (att[0]["error_class"], att[0]["decision_reason"]) == (cls, "not_retryable")


# --- E3: remaining room ------------------------------------------------------------------------

def test_e3_no_request_goes_where_the_reported_tokens_cannot_cover_it(gateway_factory):
    # spec: E3
    gw = gateway_factory(group=2)
    a, b = gw.groups["openai"]
    gw.sim.set(a, ratelimit={"limit_requests": 100, "remaining_requests": 99, "reset_requests_s": 60,
                             "limit_tokens": 10_000, "remaining_tokens": 300, "reset_tokens_s": 60})
    body = dict(BODIES["openai"], max_tokens=1000)
    small = dict(BODIES["openai"], max_tokens=10)
    # Three separate conversations: a conversation stays where it was answered (D4).
    conv = lambda n: {"x-spillway-conversation-id": f"e3-{n}"}
    assert post(gw, "openai", gw.key, json=body, headers=conv(1)).headers["x-spillway-channel"] == a
    # A has 300 tokens left by its own account: a request that may need 1000 goes to B,
    # one that needs ~20 still fits A.
    assert post(gw, "openai", gw.key, json=body, headers=conv(2)).headers["x-spillway-channel"] == b
    assert post(gw, "openai", gw.key, json=small, headers=conv(3)).headers["x-spillway-channel"] == a
    assert gw.group_calls("openai") == [2, 1]
    view = {c["name"]: c for c in gw.admin("GET", "/admin/v1/overview")["channels"]}
    assert view[a]["health"]["remaining_tokens"] is not None and view[a]["health"]["remaining_tokens"] <= 300


# --- B1, B2: per-key limits -----------------------------------------------------------------------

KEY_LIMITED = "This API key has reached its rate or concurrency limit."


def test_b2_rate_limit_per_key_in_every_format(gateway_factory):
    # spec: B1, B2, A3, A8
    gw = gateway_factory(key_yaml="    rpm: 2")
    assert post(gw, "openai", gw.key, json=BODIES["openai"]).status_code == 200
    assert post(gw, "openai", gw.key, json=BODIES["openai"]).status_code == 200
    calls = gw.calls("openai")
    for fmt, kind in [("openai", "rate_limit_exceeded"), ("anthropic", "rate_limit_error"), ("gemini", "RESOURCE_EXHAUSTED")]:
        t = time.monotonic()
        r = post(gw, fmt, gw.key, json=BODIES[fmt])
        assert time.monotonic() - t < 1.5, "no waiting when no room can free within 2 s"
        assert r.status_code == 429
        assert error_of(fmt, r.json()) == (kind, KEY_LIMITED)
        assert 28 <= int(r.headers["retry-after"]) <= 30
        assert "x-should-retry" not in r.headers
    assert gw.calls("openai") == calls and gw.calls("anthropic") == 0 and gw.calls("gemini") == 0
    row = gw.request_row(r.headers["x-request-id"])
    assert (row["error_class"], row["attempts"]) == ("key_limited", 0)


def test_b2_concurrency_per_key_waits_two_seconds_then_refuses(gateway_factory):
    # spec: B1, B2
    gw = gateway_factory(key_yaml="    max_concurrency: 1")
    ch = gw.channel("openai")
    held = occupy(gw, "openai", ch, 3500)
    t = time.monotonic()
    r = post(gw, "openai", gw.key, json=BODIES["openai"], timeout=30)
    took = time.monotonic() - t
    assert r.status_code == 429 and 1.9 <= took < 3.0, took
    assert error_of("openai", r.json())[1] == KEY_LIMITED
    assert r.headers["retry-after"] == "1"
    held.join(timeout=30)
    # Room that frees within the 2 s is taken.
    held = occupy(gw, "openai", ch, 800)
    assert post(gw, "openai", gw.key, json=BODIES["openai"], timeout=30).status_code == 200
    held.join(timeout=30)
    assert gw.sim.stats(ch)["max_in_flight"] == 1


# --- C1-C4: the capacity queue ---------------------------------------------------------------------

CAPACITY_BUSY = "All upstream capacity for this model is busy. Retry shortly."


def occupy(gw, fmt, channel, latency_ms):
    """Makes `channel` slow, starts one request that takes its slot, and returns its thread
    once the simulator holds it."""
    gw.sim.set(channel, latency_ms=latency_ms)
    th = threading.Thread(target=lambda: post(gw, fmt, gw.key, json=BODIES[fmt], timeout=30))
    th.start()
    assert wait_for(lambda: gw.sim.stats(channel)["in_flight"] == 1)
    return th


def row_by_client_id(gw, client_id):
    """The finished ledger row of the request sent with `x-client-request-id: client_id`."""
    def find():
        with gw.db() as con:
            return con.execute("SELECT * FROM requests WHERE client_request_id = ? AND state = 'failed'",
                               (client_id,)).fetchone()
    assert wait_for(find)
    return find()


def test_c1_a_full_channel_sends_the_request_to_another(gateway_factory):
    # spec: C1
    gw = gateway_factory(group=2, max_concurrency=1)
    a, b = gw.groups["openai"]
    th = occupy(gw, "openai", a, 1500)
    r = post(gw, "openai", gw.key, json=BODIES["openai"])
    assert r.status_code == 200 and r.headers["x-spillway-channel"] == b
    assert "x-spillway-queued-ms" not in r.headers
    th.join(timeout=30)
    assert gw.group_calls("openai") == [1, 1]


def test_c2_waits_for_the_first_free_slot_and_says_how_long(gateway_factory):
    # spec: C1, C2, A7
    gw = gateway_factory(max_concurrency=1)
    ch = gw.channel("anthropic")
    th = occupy(gw, "anthropic", ch, 1000)
    r = post(gw, "anthropic", gw.key, json=BODIES["anthropic"], timeout=30)
    th.join(timeout=30)
    assert r.status_code == 200
    assert 500 <= int(r.headers["x-spillway-queued-ms"]) <= 2000
    assert gw.sim.stats(ch)["max_in_flight"] == 1
    row = gw.request_row(r.headers["x-request-id"])
    assert row["queued_ms"] == int(r.headers["x-spillway-queued-ms"])


def test_c2_c3_busy_capacity_refuses_with_retry_after_and_bills_nothing(gateway_factory):
    # spec: C2, C3, A8
    gw = gateway_factory(max_concurrency=1, extra_yaml="capacity_wait_ms: 300")
    ch = gw.channel("gemini")
    th = occupy(gw, "gemini", ch, 2000)
    t = time.monotonic()
    r = post(gw, "gemini", gw.key, json=BODIES["gemini"], timeout=30)
    assert 0.25 <= time.monotonic() - t < 1.5
    assert r.status_code == 429
    assert error_of("gemini", r.json()) == ("RESOURCE_EXHAUSTED", CAPACITY_BUSY)
    assert r.headers["retry-after"] == "1"
    th.join(timeout=30)
    assert gw.calls("gemini") == 1
    row = gw.request_row(r.headers["x-request-id"])
    assert (row["error_class"], row["attempts"], row["cost_usd"]) == ("capacity_busy", 0, 0.0)


def test_c4_a_client_that_leaves_the_queue_sends_nothing_upstream(gateway_factory):
    # spec: C4, C3
    gw = gateway_factory(max_concurrency=1)
    ch = gw.channel("openai")
    th = occupy(gw, "openai", ch, 1500)
    with pytest.raises(httpx.TimeoutException):
        post(gw, "openai", gw.key, json=BODIES["openai"], timeout=0.4, headers={"x-client-request-id": "gone-1"})
    th.join(timeout=30)
    time.sleep(0.5)
    assert gw.calls("openai") == 1, "the abandoned request never reached the provider"
    row = row_by_client_id(gw, "gone-1")
    assert (row["state"], row["error_class"], row["attempts"], row["cost_usd"]) == (
        "failed", "client_disconnected", 0, 0.0)


def test_c4_a_client_that_leaves_while_a_retry_waits_stops_the_retry(gateway):
    # spec: C4, F1
    ch = gateway.channel("openai")
    gateway.sim.set(ch, script=[{"fault": status(503, retry_after_s=3)}])
    with pytest.raises(httpx.TimeoutException):
        post(gateway, "openai", gateway.key, json=BODIES["openai"], timeout=1.0, headers={"x-client-request-id": "gone-2"})
    time.sleep(3.0)
    assert gateway.calls("openai") == 1, "the retry after the wait was never sent"
    row = row_by_client_id(gateway, "gone-2")
    assert (row["error_class"], row["attempts"], row["http_status"]) == ("client_disconnected", 1, None)


def test_e2_gemini_refusing_the_channel_key_with_400_is_an_auth_failure(gateway_factory):
    # spec: E2, D3, P3
    gw = gateway_factory(group=2)
    a, b = gw.groups["gemini"]
    gw.sim.set(a, fault=status(400, error="auth", message="API key not valid. Please pass a valid API key."))
    r = post(gw, "gemini", gw.key, json=BODIES["gemini"])
    # Not passed through as the client's own 400: the channel's key is at fault.
    assert r.status_code == 200 and r.headers["x-spillway-channel"] == b
    assert gw.group_calls("gemini") == [1, 1]
    att = attempts_of(gw, r)
    assert (att[0]["error_class"], att[0]["message"]) == ("auth", None)


def test_b1_a_stream_holds_its_key_slot_until_it_ends(gateway_factory):
    # spec: B1, B2
    gw = gateway_factory(key_yaml="    max_concurrency: 1")
    ch = gw.channel("anthropic")
    gw.sim.set(ch, tokens_per_second=4)  # 12 tokens: a 3 s stream
    done = []
    th = threading.Thread(target=lambda: done.append(stream_post(gw, "anthropic")))
    th.start()
    assert wait_for(lambda: gw.sim.stats(ch)["in_flight"] == 1)
    r = post(gw, "openai", gw.key, json=BODIES["openai"], timeout=30)
    assert r.status_code == 429 and error_of("openai", r.json())[1] == KEY_LIMITED
    th.join(timeout=30)
    assert "message_stop" in done[0][1]
    assert post(gw, "openai", gw.key, json=BODIES["openai"]).status_code == 200, "the slot came back with the stream's end"
