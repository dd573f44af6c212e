"""The control plane against the real simulator (D4, D5, F4, F5, G1-G4, N4): a dead
upstream stops receiving traffic, a flaky one is retried within budget, breakers open,
fail fast, close after probation and survive a restart, and /metrics is Prometheus text.
Every figure is counted on the simulator's side as well as the gateway's."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import MODELS, start_gateway, stop, wait_for
from wire import BODIES, error_of, post


def status(code, **kw):
    return {"kind": "status", "status": code, **kw}


def control(gw, route):
    for v in gw.admin("GET", "/admin/v1/overview")["control"]:
        if v["route"] == route:
            return v
    return None


def channel_view(gw, name):
    return next(c for c in gw.admin("GET", "/admin/v1/overview")["channels"] if c["name"] == name)


def test_d5_a_dead_upstream_stops_receiving_traffic_and_clients_get_fast_5xx(gateway_factory):
    # spec: D5, D7, A8
    gw = gateway_factory()
    ch = gw.channel("openai")
    gw.sim.set(ch, fault=status(500))
    codes = [post(gw, "openai", gw.key, json=BODIES["openai"]).status_code for _ in range(2)]
    assert codes == [502, 502]
    # Five failures in a row (three attempts, then two) took the channel out of rotation.
    assert gw.calls("openai") == 5
    v = channel_view(gw, ch)
    assert v["health"]["state"] == "cooling" and v["health"]["ejections"] == 1, v
    # From now on nothing reaches it: fast 503s, each saying when to come back.
    for _ in range(20):
        t = time.monotonic()
        r = post(gw, "openai", gw.key, json=BODIES["openai"])
        took = time.monotonic() - t
        assert r.status_code == 503, r.text
        assert 1 <= int(r.headers["retry-after"]) <= 30
        assert took < 0.5, f"a refusal took {took:.3f} s"
        assert "cooling down" in error_of("openai", r.json())[1]
    assert gw.calls("openai") == 5, "traffic reached a dead channel after its ejection"
    rid = r.headers["x-request-id"]
    row = gw.request_row(rid)
    assert (row["attempts"], row["error_class"]) == (0, "channels_cooling_down")
    # The ejection is on the audit log.
    audit = gw.admin("GET", f"/admin/v1/audit?kind=channel&subject={ch}")
    assert audit[0]["action"] == "ejected" and "5 provider failures in a row" in audit[0]["reason"]


def test_f4_f5_with_30_percent_failing_attempts_amplification_stays_under_1_2(gateway_factory):
    # spec: F4, F5, N1, D1
    # No floor under the budget: the 20 % alone bounds the retries (the default floor of 3
    # per 10 s lets a quiet route retry its rare failure).
    gw = gateway_factory(group=2, extra_yaml="control: {retry_budget_min: 0}")
    # Exactly 3 calls in 10 fail on each channel, spread out. Failing at random instead, a
    # 50-attempt window reaches G1's 25 failures in about one run of 480 attempts in eight,
    # and the breaker rightly opens (the breaker tests cover that); here the budget is
    # what is measured.
    pattern = [{"fault": status(500), "times": 1}, {"fault": {"kind": "ok"}, "times": 2},
               {"fault": status(500), "times": 1}, {"fault": {"kind": "ok"}, "times": 3},
               {"fault": status(500), "times": 1}, {"fault": {"kind": "ok"}, "times": 2}]
    for ch in gw.groups["openai"]:
        gw.sim.set(ch, script=pattern * 80)
    n = 400
    with httpx.Client(timeout=30) as c:
        codes = [c.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {gw.key}"},
                        json=dict(BODIES["openai"], messages=[{"role": "user", "content": f"q{i}"}])).status_code
                 for i in range(n)]
    calls = sum(gw.group_calls("openai"))
    ok = codes.count(200) / n
    amplification = calls / n
    view = control(gw, f"openai/{MODELS['openai']}")
    v = view["amplification"]["last_5m"]
    print("\nbreaker:", view["breaker"]["state"], view["breaker"]["reason"],
          [(c["name"], c["health"]["state"], c["health"]["ejections"]) for c in gw.admin("GET", "/admin/v1/overview")["channels"]
           if c["name"] in gw.groups["openai"]])
    print(f"\n30 % failing attempts: {n} requests, {calls} attempts, amplification {amplification:.3f}, "
          f"success {ok:.1%}, post-retry success {v['post_retry_success']:.1%} ({v['retried']} retried)")
    assert amplification <= 1.2, amplification
    assert ok >= 0.70, ok
    assert set(codes) <= {200, 502, 503}
    # The gateway's own figures agree with the simulator's count.
    assert (v["requests"], v["attempts"]) == (n, calls)
    assert v["post_retry_success"] is not None and v["post_retry_success"] > 0.5


def test_g1_g2_g3_a_failing_route_opens_fails_fast_and_closes_after_probation(gateway_factory):
    # spec: G1, G2, G3, G4
    gw = gateway_factory(group=2, extra_yaml="control: {breaker_cool_down_ms: 1500, ejection_cool_down_ms: 500}")
    route = f"anthropic/{MODELS['anthropic']}"
    for ch in gw.groups["anthropic"]:
        gw.sim.set(ch, fault=status(503))
    sent = 0
    while control(gw, route) is None or control(gw, route)["breaker"]["state"] == "closed":
        r = post(gw, "anthropic", gw.key, json=BODIES["anthropic"])
        assert r.status_code in (502, 503)
        sent += 1
        assert sent < 200, "the breaker never opened"
        time.sleep(0.02)
    b = control(gw, route)["breaker"]
    assert b["trigger"] == "server_errors" and "of the last" in b["reason"]
    calls = sum(gw.group_calls("anthropic"))
    # Open: fast refusals in Anthropic's format, nothing upstream.
    r = post(gw, "anthropic", gw.key, json=BODIES["anthropic"])
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    kind, msg = error_of("anthropic", r.json())
    assert kind == "overloaded_error" and "circuit breaker" in msg
    assert sum(gw.group_calls("anthropic")) == calls
    # The provider recovers; after the cool-down, five probes one at a time close it.
    for ch in gw.groups["anthropic"]:
        gw.sim.set(ch, fault=None)
    def closed():
        post(gw, "anthropic", gw.key, json=BODIES["anthropic"])
        return control(gw, route)["breaker"]["state"] == "closed"
    assert wait_for(closed, timeout=20), control(gw, route)
    assert post(gw, "anthropic", gw.key, json=BODIES["anthropic"]).status_code == 200
    actions = [e["action"] for e in gw.admin("GET", f"/admin/v1/audit?kind=breaker&subject={route}")]
    assert actions[0] == "probation->closed" and "closed->open" in actions


def test_g4_an_operators_breaker_survives_a_restart(tmp_path, sim):
    # spec: G4, G2
    gw = start_gateway(tmp_path, sim)
    route = f"gemini/{MODELS['gemini']}"
    try:
        bad = httpx.post(gw.url + "/admin/v1/breakers/open", headers={"authorization": f"Bearer {gw.admin_token}"},
                         json={"route": route, "actor": "", "reason": "x"})
        assert bad.status_code == 422 and "actor" in bad.json()["error"]
        v = gw.admin("POST", "/admin/v1/breakers/open", {"route": route, "actor": "kim", "reason": "provider incident INC-7"})
        assert v["breaker"]["state"] == "open"
    finally:
        stop(gw.proc)
    gw = start_gateway(tmp_path, sim)
    try:
        r = post(gw, "gemini", gw.key, json=BODIES["gemini"])
        assert r.status_code == 503
        msg = error_of("gemini", r.json())[1]
        # Clients hear that an operator opened it, not the operator's own words.
        assert "opened by an operator" in msg and "INC-7" not in msg
        assert "INC-7" in control(gw, route)["breaker"]["reason"]
        assert gw.calls("gemini") == 0
        e = gw.admin("GET", f"/admin/v1/audit?kind=breaker&subject={route}")[0]
        assert (e["actor"], e["action"], e["trigger"]) == ("kim", "closed->open", "operator")
        gw.admin("POST", "/admin/v1/breakers/close", {"route": route, "actor": "kim", "reason": "resolved"})
        assert post(gw, "gemini", gw.key, json=BODIES["gemini"]).status_code == 200
    finally:
        stop(gw.proc)


def test_n4_metrics_parse_as_prometheus_text(gateway):
    # spec: N4, N1
    gw = gateway
    gw.sim.set(gw.channel("openai"), script=[{"fault": status(503), "times": 1}])
    for fmt in MODELS:
        assert post(gw, fmt, gw.key, json=BODIES[fmt]).status_code in (200, 502)
    text = httpx.get(gw.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    route = f"openai/{MODELS['openai']}"
    by_route = (("api", "generate"), ("owner", "team-a"), ("route", route))
    assert samples[("spillway_requests_total", by_route)] == 1
    assert samples[("spillway_attempts_total", by_route)] == 2
    assert samples[("spillway_breaker_state", (("route", route), ("state", "closed")))] == 1
    assert families["spillway_request_duration_seconds"].type == "histogram"
    assert samples[("spillway_request_duration_seconds_count", (("route", route),))] == 1
    assert ("spillway_channel_share", (("channel", gw.channel("openai")),)) in samples
    # Bounded labels: only config and enum values, whatever clients send.
    for (name, labels), _ in samples.items():
        for k, _v in labels:
            assert k in {"route", "owner", "api", "channel", "class", "state", "window", "le"}, (name, k)


def test_n1_otel_each_request_is_a_span_with_a_child_per_attempt(tmp_path, sim):
    # spec: N1, A6
    received = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            received.append((self.path, json.loads(body or b"{}")))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        gw = start_gateway(tmp_path, sim, group=2, env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
        a, _b = gw.groups["openai"]
        gw.sim.set(a, script=[{"fault": status(500), "times": 1}])
        r = post(gw, "openai", gw.key, json=BODIES["openai"],
                 headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
        assert r.status_code == 200
        stop(gw.proc)  # the exporter sends what is left on the way out
        spans = [s for path, body in received if path == "/v1/traces"
                 for rs in body.get("resourceSpans", []) for ss in rs.get("scopeSpans", []) for s in ss.get("spans", [])]
        req = next(s for s in spans if s.get("parentSpanId") == "b7ad6b7169203331")
        assert req["traceId"] == "0af7651916cd43dd8448eb211c80319c"
        kids = sorted(s["name"] for s in spans if s.get("parentSpanId") == req["spanId"])
        assert kids == [f"attempt 1 on {a}", f"attempt 2 on {_b}"]
        # The span the upstream saw as its parent is the request's span.
        assert req["spanId"] in gw.sim.stats(_b)["last_headers"].get("traceparent", "")
    finally:
        server.shutdown()
