"""Guided recovery, drills and the scorecard (O1-O5, N1-N3) against the real binary, the
real simulator and a real SQLite ledger: a route whose provider fails is isolated, its
evidence kept, its probes run one at a time, its traffic brought back in stages that step
back on a relapse, a twice-stopped run waits for two people, the run closes only when O4
holds, and its report and audit say what happened without a secret. A drill does the same
on the gateway's own simulator, and is refused on any route with a real upstream. The
scorecard's figures are checked against the ledger itself."""

import hashlib
import json
import secrets
import signal
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import BIN, MODELS, Gateway, Sim, clean_env, http_json, read_line, start_gateway, stop, wait_for
from wire import BODIES, error_of, post

ROUTE = f"openai/{MODELS['openai']}"
STEPS = ["isolate", "preserve", "roll_back", "confirm", "resume", "drain", "close"]
SCENARIOS = {"rate_limit_storm", "server_errors", "slow_provider", "quota_exhausted", "drops_after_completion"}
SUCCEEDED = ("api_completed", "side_effect_pending", "done")
PERIODS = ["before", "incident", "after"]
# The breaker opens on 25 provider failures in its last 50 attempts (G1) and then waits a
# minute before its own probation, so only the run's probes decide here; a channel taken
# out after 5 failures in a row comes back within half a second (D5). With two channels per
# format the second is the last in rotation and never ejected, so every failure counts.
CONTROL = "control: {breaker_cool_down_ms: 60000, ejection_cool_down_ms: 500}"
# The simulated provider's healthy latency: the route's normal, against which a probe
# round's P95 is judged (1.5 x), large enough that scheduling jitter does not matter.
HEALTHY = {"latency_ms": 100}
# Drill timings (the config's `recovery:` section): short, so a drill takes seconds.
DRILL_STAGE_MS = 2500
DRILL_INCIDENT_MS = 8000
RELAPSE_MS = 2000


def status(code, **kw):
    return {"kind": "status", "status": code, **kw}


# ---------------------------------------------------------------------------------------
# Admin calls.

def api(gw, method, path, body=None):
    """(status, headers, JSON body or text) of one admin call; never raises for a status."""
    r = httpx.request(method, gw.url + path, json=body, timeout=15,
                      headers={"authorization": f"Bearer {gw.admin_token}"})
    try:
        return r.status_code, r.headers, r.json()
    except ValueError:
        return r.status_code, r.headers, r.text


def ok(gw, method, path, body=None, expect=200):
    code, _, b = api(gw, method, path, body)
    assert code == expect, f"{method} {path} answered {code}: {b}"
    return b


def download(gw, path):
    """A file the admin API serves as an attachment: (response, its bytes)."""
    r = httpx.get(gw.url + path, headers={"authorization": f"Bearer {gw.admin_token}"}, timeout=15)
    assert r.status_code == 200, f"GET {path} answered {r.status_code}: {r.text[:500]}"
    assert "attachment" in r.headers.get("content-disposition", ""), r.headers
    return r, r.content


def start_run(gw, actor="ops-kim", reason="INC-1: the provider answers 503", **extra):
    return ok(gw, "POST", "/admin/v1/recoveries", {"route": ROUTE, "actor": actor, "reason": reason, **extra}, expect=201)


def act(gw, run, action, **body):
    return ok(gw, "POST", f"/admin/v1/recoveries/{run}/{action}", body)


def view(gw, run):
    return ok(gw, "GET", f"/admin/v1/recoveries/{run}")


def listing(gw):
    return ok(gw, "GET", "/admin/v1/recoveries")


def pct(v):
    """The resume stage's share of the route's concurrency, or None outside resume."""
    return v["stages"][v["stage"]] if v["stage"] is not None else None


def step_view(v, step):
    return next(s for s in v["steps"] if s["step"] == step)


def summary(v):
    """What a failure message shows of a run."""
    if v is None:
        return None
    return json.dumps({
        "step": v["step"], "stage_pct": pct(v), "held": v["held"], "stops": v["stops"],
        "approvals": v["approvals"], "probes": v["probes"], "recent": v["recent"],
        "close_missing": v["close_missing"], "backlog": v["backlog"], "unknowns": v["unknowns"],
        "events": [(e["actor"], e["action"], e["from"], e["to"], e["reason"]) for e in v["events"][-8:]],
    }, indent=1)


def until(gw, run, pred, timeout, what):
    """The run's view once `pred` holds; fails after `timeout` seconds showing the last view."""
    deadline = time.monotonic() + timeout
    while True:
        v = view(gw, run)
        if pred(v):
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s; last view: {summary(v)}")
        time.sleep(0.1)


def poll(fetch, pred, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        x = fetch()
        if pred(x):
            return x
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s; last: {x}")
        time.sleep(0.1)


def round_over(v):
    """A probe round has its verdict: five passed, one failed, or the run moved on."""
    return v["step"] != "confirm" or len(v["probes"]) >= 5 or any(not p["ok"] or p["duplicate"] for p in v["probes"])


def probe_round(gw, run, actor="ops-kim"):
    """One round of probes as the key `app`; the view once the round has its verdict (the
    answer may come before the round ends). A round still running answers 409: wait."""
    deadline = time.monotonic() + 15
    while True:
        code, _, v = api(gw, "POST", f"/admin/v1/recoveries/{run}/probes", {"actor": actor, "key": "app"})
        if code != 409 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert code == 200, f"probes answered {code}: {v}"
    return until(gw, run, round_over, 15, "the probe round's verdict")


def probes_until(gw, run, pred, timeout, what, before_round=None):
    """Probe rounds, a moment apart, until a round's view satisfies `pred`."""
    deadline = time.monotonic() + timeout
    while True:
        if before_round:
            before_round()
        v = probe_round(gw, run)
        if pred(v):
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s; last view: {summary(v)}")
        time.sleep(0.3)


def passed(v):
    return len(v["probes"]) == 5 and all(p["ok"] and not p["duplicate"] for p in v["probes"])


def audit_of(gw, run):
    """The run's entries on the audit log (kind `recovery`), oldest first."""
    entries = ok(gw, "GET", "/admin/v1/audit?kind=recovery&limit=1000")
    return [a for a in reversed(entries) if a["subject"] in (run, ROUTE) or run in a["reason"]]


def audited(gw, run, events):
    """O5: every event of the run is on the audit log, with its actor."""
    entries = audit_of(gw, run)
    assert entries, "no audit entry of kind `recovery`"
    assert all(a["actor"] and a["reason"] for a in entries)
    for e in events:
        forms = (e["action"], f"{e['from']}->{e['to']}", f"{e['from']}->{e['to']}:{e['action']}")
        assert any(a["actor"] == e["actor"] and a["action"] in forms for a in entries), \
            f"event {e} is not on the audit log: {entries}"
    return entries


def figures_of(entry):
    return {f["name"]: f["value"] for f in json.loads(entry["figures"] or "[]")}


_ABSENT = object()


def field(doc, name, default=_ABSENT):
    """The shallowest value of `name` anywhere in a JSON document."""
    queue = [doc]
    while queue:
        x = queue.pop(0)
        if isinstance(x, dict):
            if name in x:
                return x[name]
            queue.extend(x.values())
        elif isinstance(x, list):
            queue.extend(x)
    if default is not _ABSENT:
        return default
    raise AssertionError(f"no field {name!r} in {json.dumps(doc)[:2000]}")


# ---------------------------------------------------------------------------------------
# Traffic and the simulator.

def chat(gw, text="hi", timeout=15):
    body = {**BODIES["openai"], "messages": [{"role": "user", "content": text}]}
    return post(gw, "openai", gw.key, json=body, timeout=timeout)


def set_all(gw, **behavior):
    for ch in gw.groups["openai"]:
        gw.sim.set(ch, **behavior)


def calls(gw):
    return sum(gw.group_calls("openai"))


def reset_stats(gw):
    for ch in gw.groups["openai"]:
        http_json("POST", f"{gw.sim.url}/_control/channels/{ch}/reset-stats")


def breaker(gw, route=ROUTE):
    for v in gw.admin("GET", "/admin/v1/overview")["control"]:
        if v["route"] == route:
            return v["breaker"]
    return None


def fail_until_open(gw, prompt="hi", allow_ok=False):
    """Sends requests while the route's channels fail until its breaker opens (G1); the ids of
    the requests that failed, in order."""
    failed = []
    sent = 0
    deadline = time.monotonic() + 30
    while (b := breaker(gw)) is None or b["state"] != "open":
        assert time.monotonic() < deadline and sent < 400, f"the breaker never opened after {sent} requests: {b}"
        r = chat(gw, f"{prompt}-{sent}")
        sent += 1
        if r.status_code == 200 and allow_ok:
            continue
        assert r.status_code in (502, 503), r.text
        failed.append(r.headers["x-request-id"])
    assert failed
    return failed


def send_until(gw, run, pred, what, most=60):
    """Requests one at a time, each followed by a look at the run, until `pred` holds."""
    v = None
    for n in range(1, most + 1):
        chat(gw)
        v = view(gw, run)
        if pred(v):
            return v, n
    raise AssertionError(f"{what}: not after {most} requests; last view: {summary(v)}")


def assert_held_off(gw, run, r):
    """O1: a request on an isolated route: 503 at once, naming the run, nothing sent, and on
    the ledger as `recovery_hold`."""
    assert r.status_code == 503, r.text
    msg = error_of("openai", r.json())[1]
    assert run in msg and "recovery" in msg.lower(), msg
    assert int(r.headers["retry-after"]) >= 1
    row = gw.request_row(r.headers["x-request-id"])
    assert (row["error_class"], row["attempts"]) == ("recovery_hold", 0), dict(row)


def upstream_key(gw):
    # start_gateway gives UPSTREAM_KEY "sk-upstream-<prefix>", the prefix its channels carry.
    return "sk-upstream-" + gw.channel("openai").split("-")[0]


def assert_no_secret(gw, text, what, upstream=True):
    shown = (gw.key, gw.admin_token) + ((upstream_key(gw),) if upstream else ())
    for s in shown:
        assert s not in text, f"a secret ({s[:10]}...) in {what}"
    assert "sk-upstream" not in text and "sk-test-" not in text, f"a key in {what}"


def background(fn):
    def run():
        try:
            fn()
        except Exception:  # noqa: BLE001 - the gateway is killed under it on purpose
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def to_resume(gw, actor="ops-kim"):
    """An incident on ROUTE walked to the 25 % stage: normal traffic, 503s until the breaker
    opens, a run isolated, its evidence kept, nothing to roll back, the provider healthy
    again and a passing probe round."""
    set_all(gw, **HEALTHY)
    for _ in range(3):
        assert chat(gw).status_code == 200
    set_all(gw, fault=status(503))
    fail_until_open(gw)
    run = start_run(gw, actor)["id"]
    act(gw, run, "isolate", actor=actor)
    act(gw, run, "preserve", actor=actor)
    act(gw, run, "rollback", actor=actor, reason="no policy changed on our side")
    set_all(gw, **HEALTHY)
    v = probes_until(gw, run, lambda v: v["step"] == "resume", 20, "a passing probe round")
    assert pct(v) == 25, summary(v)
    return run


def hold_then_two_approvals(gw, run, v, stage_ms):
    """O3: a run stopped twice stays where it stopped (its stage timer stopped, passing probes
    do not resume it) until one person from platform operations and another, the business
    owner, approve. Returns the view once it resumes."""
    assert v["held"] and v["stops"] == 2, summary(v)
    last = [e for e in v["events"] if e["action"] == "stepped_back"][-1]
    assert "approv" in last["reason"].lower(), last
    where = (v["step"], pct(v), v["stage_started_at"])
    time.sleep(stage_ms / 1000 + 0.7)
    v = view(gw, run)
    assert v["held"] and (v["step"], pct(v), v["stage_started_at"]) == where, \
        f"a held run moved by itself: {where} -> {summary(v)}"
    if v["step"] == "confirm":
        v = probes_until(gw, run, passed, 20, "a passing round while held")
        assert (v["step"], v["held"]) == ("confirm", True), "passing probes resumed a held run"

    # One person cannot end the hold by cancelling the run either.
    code, _, err = api(gw, "POST", f"/admin/v1/recoveries/{run}/cancel", {"actor": "pat", "reason": "tired of waiting"})
    assert code == 409 and "approv" in err["error"].lower(), err
    url = f"/admin/v1/recoveries/{run}/approve"
    code, _, err = api(gw, "POST", url, {"actor": "pat", "role": "platform_operations"})
    assert code == 422 and "reason" in err["missing_fields"], err
    code, _, err = api(gw, "POST", url, {"actor": "pat", "role": "cto", "reason": "x"})
    assert code == 422, err
    v = act(gw, run, "approve", actor="pat", role="platform_operations", reason="the provider confirms the fix")
    assert v["held"] and [(a["actor"], a["role"]) for a in v["approvals"]] == [("pat", "platform_operations")]
    # One approval is not enough.
    time.sleep(0.5)
    v = view(gw, run)
    assert v["held"] and v["step"] == where[0] and (v["step"] == "confirm" or pct(v) == where[1]), summary(v)
    # Two approvals by one person are refused, however the name is spelled; so is a role given twice.
    for actor in ("pat", " Pat "):
        code, _, err = api(gw, "POST", url, {"actor": actor, "role": "business_owner", "reason": "me again"})
        assert code == 409 and "pat" in err["error"].lower(), err
    code, _, err = api(gw, "POST", url, {"actor": "bo-lee", "role": "platform_operations", "reason": "also ops"})
    assert code == 409, err
    assert view(gw, run)["held"]
    v = act(gw, run, "approve", actor="bo-lee", role="business_owner", reason="customers told; go ahead")
    assert not v["held"], summary(v)
    # The release names both people (the run's events and its report keep every approval).
    released = [e for e in v["events"] if "pat" in e["reason"] and "bo-lee" in e["reason"]]
    assert released and released[-1]["actor"] == "bo-lee", v["events"][-4:]
    # Nothing is waiting for an approval any more.
    code, _, err = api(gw, "POST", url, {"actor": "cy", "role": "business_owner", "reason": "late"})
    assert code == 409, err
    # A round that passed while held may resume it at once; otherwise a new round does.
    if v["step"] == "confirm":
        time.sleep(0.5)
        v = view(gw, run)
    if v["step"] == "confirm":
        v = probes_until(gw, run, lambda v: v["step"] == "resume", 20, "resuming after the approvals")
    v = until(gw, run, lambda v: v["step"] == "resume", 5, "resuming after the approvals")
    entries = audit_of(gw, run)
    assert {"pat", "bo-lee"} <= {a["actor"] for a in entries}, entries
    return v


def close_form(**kw):
    return {"actor": "ops-kim", "customer_contacted": True, "customer_impact": "chat answers failed for 4 minutes",
            "workarounds": "customers were asked to retry later", **kw}


# ---------------------------------------------------------------------------------------
# A real recovery, step by step.

def test_o1_o4_o5_a_failing_route_is_recovered_step_by_step_and_closes_with_its_report(tmp_path, sim):
    # spec: O1, O4, O5, P3
    gw = start_gateway(tmp_path, sim, group=2, extra_yaml=f"{CONTROL}\nrecovery: {{stage_ms: 3000}}")
    try:
        set_all(gw, **HEALTHY)
        for _ in range(3):
            assert chat(gw).status_code == 200  # the route's normal latency
        listed = listing(gw)
        assert listed["runs"] == [] and ROUTE not in {s["route"] for s in listed["suggestions"]}
        assert "app" in listed["probe_keys"] and set(listed["scenarios"]) == SCENARIOS
        assert listed["drill_routes"] == [], "the harness's channels are a real upstream, not sim://"

        # The provider fails: the breaker opens and a recovery is suggested for the route.
        set_all(gw, fault=status(503))
        failed_ids = fail_until_open(gw, prompt="prompt-canary")
        listed = poll(lambda: listing(gw), lambda l: ROUTE in {s["route"] for s in l["suggestions"]}, 5,
                      "a suggestion for the route")
        sug = next(s for s in listed["suggestions"] if s["route"] == ROUTE)
        assert sug["breaker_opened_at"] and sug["reason"], sug

        # Who starts it is required; then one open run per route.
        code, _, err = api(gw, "POST", "/admin/v1/recoveries", {"route": ROUTE, "reason": "INC-1"})
        assert code == 422 and "actor" in err["missing_fields"], err
        v = start_run(gw)
        run = v["id"]
        assert (v["route"], v["step"], v["drill"], v["stages"], v["held"], v["stops"]) == \
            (ROUTE, "isolate", None, [25, 50, 100], False, 0)
        assert v["opened_by"] == "ops-kim" and v["stage_ms"] == 3000
        assert [s["step"] for s in v["steps"]] == STEPS
        assert [s["status"] for s in v["steps"]] == ["current"] + ["pending"] * 6
        code, _, err = api(gw, "POST", "/admin/v1/recoveries", {"route": ROUTE, "actor": "ops-lee", "reason": "again"})
        assert code == 409, err
        # The checklist keeps its order.
        code, _, err = api(gw, "POST", f"/admin/v1/recoveries/{run}/preserve", {"actor": "ops-kim"})
        assert code == 409 and "isolate" in err["error"], err

        # Isolate: retries off, the route paused, the ledger split.
        v = act(gw, run, "isolate", actor="ops-kim")
        assert (v["step"], v["retries_on"], v["concurrency_pct"]) == ("preserve", False, 0), summary(v)
        iso = step_view(v, "isolate")
        assert (iso["status"], iso["done_by"]) == ("done", "ops-kim") and iso["done_at"]
        split = v["split"]
        assert split["failed"] > 0 and split["unknown"] == 0, split

        def ledger_split():
            with gw.db() as con:
                rows = con.execute("SELECT state, COUNT(*) AS n FROM requests WHERE route = ? AND received_at >= ? "
                                   "GROUP BY state", (ROUTE, split["since"])).fetchall()
            by = {r["state"]: r["n"] for r in rows}
            return {"succeeded": sum(by.get(s, 0) for s in SUCCEEDED), "failed": by.get("failed", 0),
                    "unknown": by.get("unknown", 0), "other": sum(by.values()) - sum(by.get(s, 0) for s in SUCCEEDED + ("failed", "unknown"))}
        want = {"succeeded": split["succeeded"], "failed": split["failed"], "unknown": split["unknown"], "other": 0}
        poll(ledger_split, lambda s: s == want, 5, f"the ledger's split since {split['since']} to be {want}")

        # Isolated: a new request is refused at once, naming the recovery, and nothing goes upstream.
        before = calls(gw)
        r = chat(gw)
        assert r.status_code == 503, r.text
        assert_held_off(gw, run, r)
        assert calls(gw) == before

        # Preserve: the evidence bundle, as a file: every failed request with the provider's id,
        # no secret, no prompt.
        v = act(gw, run, "preserve", actor="ops-kim")
        assert v["step"] == "roll_back", summary(v)
        ev = v["evidence"]
        assert ev["built_by"] == "ops-kim" and ev["requests"] >= split["failed"], ev
        r, body = download(gw, f"/admin/v1/recoveries/{run}/evidence")
        assert r.headers["content-type"].startswith("application/json")
        assert hashlib.sha256(body).hexdigest() == ev["sha256"] and len(body) == ev["bytes"]
        bundle = json.loads(body)
        text = json.dumps(bundle)
        with gw.db() as con:
            failed_rows = con.execute("SELECT id FROM requests WHERE route = ? AND state = 'failed' AND received_at >= ?",
                                      (ROUTE, split["since"])).fetchall()
        with_provider_id = 0
        for row in failed_rows:
            assert row["id"] in text, f"failed request {row['id']} is not in the evidence"
            ups = [a["upstream_request_id"] for a in gw.attempts(row["id"]) if a["upstream_request_id"]]
            if ups:
                with_provider_id += 1
                assert any(u in text for u in ups), f"the provider's ids of {row['id']} ({ups}) are not in the evidence"
        assert with_provider_id > 0
        assert_no_secret(gw, text, "the evidence bundle")
        assert "prompt-canary" not in text, "a prompt in the evidence bundle"

        # Roll back: with nothing to roll back, the reason is required.
        code, _, err = api(gw, "POST", f"/admin/v1/recoveries/{run}/rollback", {"actor": "ops-kim"})
        assert code == 422 and "reason" in err["missing_fields"], err
        v = act(gw, run, "rollback", actor="ops-kim", reason="no policy changed: the provider failed")
        assert v["step"] == "confirm" and v["rollback_candidates"] == [], summary(v)
        assert v["rollback"]["actor"] == "ops-kim" and v["rollback"]["workflow"] is None
        assert "provider failed" in v["rollback"]["reason"]

        # Confirm: while the provider still fails, a round fails and the run stays.
        v = probe_round(gw, run)
        assert v["step"] == "confirm" and any(not p["ok"] for p in v["probes"]), summary(v)
        assert v["probe_rounds"] == 1
        # Healthy again: five probes, one at a time, each reaching the simulator once.
        set_all(gw, **HEALTHY)
        v = probes_until(gw, run, lambda v: v["step"] != "confirm", 20, "a passing probe round",
                         before_round=lambda: reset_stats(gw))
        assert (v["step"], pct(v), v["concurrency_pct"]) == ("resume", 25, 25), summary(v)
        assert passed(v) and v["probe_rounds"] >= 2
        stats = [gw.sim.stats(c) for c in gw.groups["openai"]]
        assert sum(s["calls"] for s in stats) == 5 and all(s["max_in_flight"] <= 1 for s in stats), stats
        assert v["retries_on"] is False, "retries stay off until the drain"
        assert v["route_concurrency"] == 16  # two channels of 8
        assert v["concurrency_cap"] == 4, v["concurrency_cap"]  # 25 % of 16
        # The share holds: of 8 requests at once, at most 4 are sent, the others refused at once.
        set_all(gw, latency_ms=600)
        with ThreadPoolExecutor(8) as pool:
            burst = list(pool.map(lambda i: chat(gw, f"burst-{i}"), range(8)))
        set_all(gw, **HEALTHY)
        codes = [r.status_code for r in burst]
        assert set(codes) <= {200, 503} and 1 <= codes.count(200) <= 4 and codes.count(503) >= 1, codes
        for r in burst:
            if r.status_code == 503:
                assert_held_off(gw, run, r)
        assert pct(view(gw, run)) == 25, "the burst outlived the 25 % stage"
        # The route takes traffic again, within its 25 %.
        assert chat(gw).status_code == 200
        probes = sorted((gw.request_row(p["request_id"]) for p in v["probes"]), key=lambda r: r["received_at"])
        for row in probes:
            assert (row["route"], row["key_name"], row["attempts"]) == (ROUTE, "app", 1), dict(row)
            assert row["idempotency_key"], "a probe carries an Idempotency-Key"
        assert all(a["finished_at"] <= b["received_at"] for a, b in zip(probes, probes[1:])), "probes overlapped"

        # Resume: 25 -> 50 -> 100 %, each stage scored, then the drain, retries back on.
        v = until(gw, run, lambda v: pct(v) == 50, 6, "the 50 % stage")
        assert v["concurrency_pct"] == 50 and v["concurrency_cap"] == 8
        v = until(gw, run, lambda v: pct(v) == 100, 6, "the 100 % stage")
        assert v["concurrency_pct"] == 100
        v = until(gw, run, lambda v: v["step"] in ("drain", "close"), 6, "the drain")
        v = until(gw, run, lambda v: v["step"] == "close", 5, "the drain to finish")
        assert (v["retries_on"], v["backlog"], v["unknowns"]) == (True, 0, 0), summary(v)
        assert [s["stage_pct"] for s in v["stage_scores"]] == [25, 50, 100], v["stage_scores"]
        assert all(s["from"] <= s["to"] for s in v["stage_scores"])
        assert any("customer" in m for m in v["close_missing"]), v["close_missing"]

        # Close: refused, naming each unmet O4 condition, until the customer contact is ticked.
        code, _, err = api(gw, "POST", f"/admin/v1/recoveries/{run}/close", close_form(customer_contacted=False))
        assert code == 409 and any("customer" in m for m in err["missing"]), err
        assert view(gw, run)["step"] == "close"
        v = act(gw, run, "close", **close_form())
        assert (v["step"], v["close_missing"]) == ("closed", []), summary(v)
        inc = v["incident"]
        assert inc["closed_by"] == "ops-kim" and inc["closed_at"] and inc["customer_contacted"] is True
        assert all(s["status"] == "done" for s in v["steps"])
        summ = next(s for s in listing(gw)["runs"] if s["id"] == run)
        assert (summ["step"], summ["drill"], summ["route"]) == ("closed", None, ROUTE) and summ["closed_at"]
        # The gate is lifted.
        assert chat(gw).status_code == 200
        code, _, err = api(gw, "POST", f"/admin/v1/recoveries/{run}/isolate", {"actor": "ops-kim"})
        assert code == 409, err

        # The report, in Markdown and as JSON: every O5 field, no secret.
        _, md = download(gw, f"/admin/v1/recoveries/{run}/report.md")
        md = md.decode()
        assert_no_secret(gw, md, "the Markdown report")
        assert ROUTE in md and "ops-kim" in md and "chat answers failed for 4 minutes" in md
        assert "DRILL" not in md
        _, raw = download(gw, f"/admin/v1/recoveries/{run}/report.json")
        assert_no_secret(gw, raw.decode(), "the JSON report")
        assert "prompt-canary" not in raw.decode() + md
        report = json.loads(raw)
        times = [field(report, k) for k in ("started_at", "detected_at", "stopped_at", "recovered_at")]
        assert all(isinstance(t, int) for t in times) and times == sorted(times), times
        assert times[-1] <= field(report, "closed_at")
        assert field(report, "affected_requests") >= split["failed"]
        first = field(report, "first_error")
        assert first["request_id"] == failed_ids[0] and first["at"] <= times[1], first
        assert first["request_id"] in md
        with gw.db() as con:
            retries = con.execute("SELECT COALESCE(SUM(attempts - 1), 0) FROM requests WHERE route = ? AND attempts > 1",
                                  (ROUTE,)).fetchone()[0]
        assert field(report, "retries") == retries and retries > 0
        assert field(report, "spend_usd") >= 0
        changes = field(report, "config_changes")
        assert isinstance(changes, list) and all(c["actor"] and c["what"] for c in changes), changes
        assert field(report, "customer_impact") == "chat answers failed for 4 minutes"
        assert field(report, "workarounds") == "customers were asked to retry later"
        assert not field(report, "drill", None)

        # O5: every transition is on the audit log with who did it.
        events = v["events"]
        actions = [(e["actor"], e["action"]) for e in events]
        for done in ("isolated", "evidence_preserved", "rolled_back", "closed"):
            assert ("ops-kim", done) in actions, actions
        assert [e["action"] for e in events].count("stage_advanced") == 2, actions
        entries = audited(gw, run, events)
        assert all(not figures_of(a).get("drill") for a in entries)

        # The run's scorecard: three periods, the incident's failures in the middle one.
        sc = ok(gw, "GET", f"/admin/v1/scorecard?run={run}")
        assert (sc["run"], sc["drill"], sc["route"]) == (run, False, ROUTE)
        assert [p["name"] for p in sc["periods"]] == PERIODS
        row = next(r for r in sc["periods"][1]["rows"] if r["route"] == ROUTE)
        assert row["requests"] > 0 and row["success_rate"] < 1, row
    finally:
        stop(gw.proc)


def test_o2_o3_a_relapse_steps_back_a_stage_and_a_second_stop_needs_two_people(tmp_path, sim):
    # spec: O2, O3, O5
    gw = start_gateway(tmp_path, sim, group=2, extra_yaml=f"{CONTROL}\nrecovery: {{stage_ms: 2500}}")
    try:
        run = to_resume(gw)
        until(gw, run, lambda v: pct(v) == 50, 5, "the 50 % stage")
        # The provider relapses during the 50 % stage: back to 25 % at once, saying why.
        set_all(gw, fault=status(503))
        v, n = send_until(gw, run, lambda v: v["stops"] >= 1, "a step-back")
        set_all(gw, **HEALTHY)
        assert n >= 5, f"stepped back after {n} requests: 5 of the last 20 must be 5xx"
        assert (v["step"], pct(v), v["stops"], v["held"]) == ("resume", 25, 1, False), summary(v)
        back = [e for e in v["events"] if e["action"] == "stepped_back"]
        assert len(back) == 1 and "5xx" in back[0]["reason"], back
        assert back[0]["actor"] and {f["name"] for f in back[0]["figures"]} >= {"stops"}
        # The same failures do not count twice: the stage goes on.
        time.sleep(0.5)
        v = view(gw, run)
        assert v["stops"] == 1 and v["step"] == "resume", summary(v)

        # A second relapse: the run stops again and is held for two approvals.
        set_all(gw, fault=status(503))
        v, _ = send_until(gw, run, lambda v: v["stops"] >= 2, "the second stop")
        set_all(gw, **HEALTHY)
        v = hold_then_two_approvals(gw, run, v, stage_ms=2500)
        # Resumed: the stages run again.
        start = pct(v)
        until(gw, run, lambda v: v["step"] != "resume" or pct(v) > start, 6, "the next stage after the approvals")
        audited(gw, run, view(gw, run)["events"])
    finally:
        stop(gw.proc)


# ---------------------------------------------------------------------------------------
# A drill on the gateway's own simulator.

# A second model on the drill's simulated channels: a route of its own, on the same channels.
SIBLING = "gpt-4.1"


def start_drill_gateway(tmp_path):
    """A gateway whose only route has simulated channels (`sim://`), so drills may run on it;
    `spillway serve` starts its simulator in-process and says where."""
    assert BIN.exists(), f"{BIN} is missing: run `make test` (it builds the binary first)"
    key = "sk-test-" + secrets.token_hex(16)
    model = MODELS["openai"]
    lines = [
        "listen: 127.0.0.1:0",
        f"ledger: sqlite://{tmp_path / 'ledger.db'}",
        CONTROL,
        f"recovery: {{drill_stage_ms: {DRILL_STAGE_MS}, drill_incident_ms: {DRILL_INCIDENT_MS}, relapse_ms: {RELAPSE_MS}}}",
        "simulator:",
        "  channels:",
        "    drill-a: {latency_ms: 60, output_tokens: 4}",
        "    drill-b: {latency_ms: 60, output_tokens: 4}",
        "channels:",
        f"  - {{name: drill-a, format: openai, base_url: 'sim://drill-a', models: [{model}, {SIBLING}], max_concurrency: 8, priority: 2}}",
        f"  - {{name: drill-b, format: openai, base_url: 'sim://drill-b', models: [{model}, {SIBLING}], max_concurrency: 8, priority: 1}}",
        "keys:",
        "  - name: app",
        "    owner: team-a",
        "    secret_env: SPILLWAY_TEST_KEY",
        "owners:",
        "  - name: team-a",
        "    balance_usd: 100",
    ]
    cfg = tmp_path / "drill.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen([str(BIN), "serve", "--config", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=clean_env(SPILLWAY_TEST_KEY=key, SPILLWAY_DATA_DIR=str(tmp_path / "data")))
    try:
        url = read_line(proc, "spillway listening on ").split()[-1]
        sim_url = read_line(proc, "simulated providers: ").split()[2]
    except BaseException:
        stop(proc)
        raise
    gw = Gateway(proc, url, key, tmp_path / "ledger.db", {"openai": "drill-a"}, Sim(sim_url),
                 {"openai": ["drill-a", "drill-b"]})
    gw.admin_token = (tmp_path / "data" / "admin-token").read_text().strip()
    return gw


def test_o1_o2_o3_n2_a_drill_walks_every_step_on_the_simulator_and_is_marked_a_drill(tmp_path):
    # spec: O1, O2, O3, O5, N2, P3
    gw = start_drill_gateway(tmp_path)
    try:
        for _ in range(3):
            assert chat(gw).status_code == 200  # the "before" period
        listed = listing(gw)
        assert listed["drill_routes"] == sorted([ROUTE, f"openai/{SIBLING}"]) and set(listed["scenarios"]) == SCENARIOS
        code, _, err = api(gw, "POST", "/admin/v1/recoveries",
                           {"route": ROUTE, "actor": "ops-kim", "reason": "practice", "drill": "meteor_strike"})
        assert code == 422, err

        v = start_run(gw, reason="practice: the provider answers 5xx", drill="server_errors")
        run = v["id"]
        assert (v["drill"], v["step"], v["stage_ms"]) == ("server_errors", "isolate", DRILL_STAGE_MS), summary(v)
        summ = next(s for s in listing(gw)["runs"] if s["id"] == run)
        assert summ["drill"] == "server_errors"
        # A second drill on the same simulated channels would put back the first one's
        # fault as their usual behaviour: refused.
        code, _, err = api(gw, "POST", "/admin/v1/recoveries",
                           {"route": f"openai/{SIBLING}", "actor": "ops-kim", "reason": "two at once", "drill": "slow_provider"})
        assert code == 409 and run in err["error"], err

        # The simulator stages the scenario: requests fail and the breaker opens.
        fail_until_open(gw, allow_ok=True)
        v = act(gw, run, "isolate", actor="ops-kim")
        assert v["split"]["failed"] > 0
        r = chat(gw)
        assert_held_off(gw, run, r)
        v = act(gw, run, "preserve", actor="ops-kim")
        _, body = download(gw, f"/admin/v1/recoveries/{run}/evidence")
        assert_no_secret(gw, body.decode(), "a drill's evidence", upstream=False)
        v = act(gw, run, "rollback", actor="ops-kim", reason="practice: nothing changed")
        assert v["step"] == "confirm"
        # The staged fault ends by itself after drill_incident_ms; until then probes fail.
        v = probes_until(gw, run, lambda v: v["step"] == "resume", DRILL_INCIDENT_MS / 1000 + 15, "the drill's recovery")
        assert pct(v) == 25 and v["probe_rounds"] >= 1

        # A relapse during the 50 % stage, with traffic: one stage back.
        until(gw, run, lambda v: pct(v) == 50, DRILL_STAGE_MS / 1000 + 3, "the 50 % stage")
        act(gw, run, "relapse", actor="ops-kim")
        v, _ = send_until(gw, run, lambda v: v["stops"] >= 1, "a step-back after the relapse")
        assert (v["step"], pct(v), v["held"]) == ("resume", 25, False), summary(v)
        time.sleep(RELAPSE_MS / 1000 + 0.2)  # the burst is over
        v = view(gw, run)
        assert v["step"] == "resume" and v["stops"] == 1, summary(v)

        # A second relapse: stopped again, held for two approvals.
        act(gw, run, "relapse", actor="ops-kim")
        v, _ = send_until(gw, run, lambda v: v["stops"] >= 2, "the second stop after a relapse")
        time.sleep(RELAPSE_MS / 1000 + 0.2)
        v = hold_then_two_approvals(gw, run, view(gw, run), DRILL_STAGE_MS)

        # The stages run out, the drain ends, and the drill closes like a real run.
        v = until(gw, run, lambda v: v["step"] == "close", 3 * DRILL_STAGE_MS / 1000 + 6, "the drill's drain")
        code, _, err = api(gw, "POST", f"/admin/v1/recoveries/{run}/close", close_form(customer_contacted=False))
        assert code == 409 and any("customer" in m for m in err["missing"]), err
        v = act(gw, run, "close", **close_form(customer_impact="none: a drill", workarounds="none"))
        assert v["step"] == "closed" and v["drill"] == "server_errors"

        _, md = download(gw, f"/admin/v1/recoveries/{run}/report.md")
        md = md.decode()
        assert "DRILL" in md
        assert_no_secret(gw, md, "a drill's report", upstream=False)
        _, raw = download(gw, f"/admin/v1/recoveries/{run}/report.json")
        assert_no_secret(gw, raw.decode(), "a drill's JSON report", upstream=False)
        assert field(json.loads(raw), "drill") in (True, "server_errors")

        # Every audit entry of the run says it was a drill.
        entries = audited(gw, run, v["events"])
        for a in entries:
            assert "[drill]" in a["reason"] and "drill" in figures_of(a), a
        assert "ops-kim" in {a["actor"] for a in entries}

        # The scorecard: a drill, three periods, the staged failures in the incident.
        sc = ok(gw, "GET", f"/admin/v1/scorecard?run={run}")
        assert (sc["run"], sc["drill"], sc["route"]) == (run, True, ROUTE)
        assert [p["name"] for p in sc["periods"]] == PERIODS
        rows = {p["name"]: {r["route"]: r for r in p["rows"]} for p in sc["periods"]}
        assert all(p["rows"][-1]["route"] == "overall" for p in sc["periods"])
        before, incident = rows["before"][ROUTE], rows["incident"][ROUTE]
        assert (before["requests"], before["success_rate"]) == (3, 1.0), before
        assert incident["requests"] > 0 and incident["success_rate"] < 1, incident
        assert sum(e["count"] for e in incident["error_mix"]) > 0, incident
    finally:
        stop(gw.proc)


def test_o1_a_drill_on_a_route_with_a_real_upstream_is_refused(gateway):
    # spec: O1
    gw = gateway
    listed = listing(gw)
    assert listed["drill_routes"] == []
    code, _, err = api(gw, "POST", "/admin/v1/recoveries",
                       {"route": ROUTE, "actor": "ops-kim", "reason": "practice", "drill": "server_errors"})
    assert code == 409 and err["error"], err
    assert listing(gw)["runs"] == []
    assert gw.calls("openai") == 0, "a refused drill touched the upstream"
    assert chat(gw).status_code == 200, "the route is left alone"


# ---------------------------------------------------------------------------------------
# The scorecard.

def expected(con, frm, to, route):
    """N1's figures for `route` (None: every route) over [frm, to), from the ledger itself."""
    where = "received_at >= ? AND received_at < ? AND " + ("route = ?" if route else "route IS NOT NULL")
    args = (frm, to if to is not None else 2**62) + ((route,) if route else ())
    rows = con.execute(f"SELECT id, state, attempts, cost_usd, error_class FROM requests WHERE {where}", args).fetchall()
    atts = con.execute(f"SELECT a.error_class FROM attempts a JOIN requests r ON r.id = a.request_id "
                       f"WHERE r.{where.replace(' AND ', ' AND r.')} AND a.error_class <> 'success'", args).fetchall()
    n = len(rows)
    attempts = sum(r["attempts"] for r in rows)
    good = sum(r["state"] in SUCCEEDED for r in rows)
    first_try = sum(r["state"] in SUCCEEDED and r["attempts"] == 1 for r in rows)
    retried = [r for r in rows if r["attempts"] > 1]
    return {
        "requests": n,
        "attempts": attempts,
        "amplification": attempts / n if n else None,
        # SPEC names a success rate beside F5's post-retry one without defining it: either
        # every request that ended well, or those that did on their first attempt.
        "success_rates": (good / n, first_try / n) if n else (None,),
        "post_retry_success_rate": (sum(r["state"] in SUCCEEDED for r in retried) / len(retried)) if retried else None,
        "unknowns": sum(r["state"] == "unknown" for r in rows),
        "cost_usd": sum(r["cost_usd"] or 0 for r in rows),
        # The failed requests by class (with or without the unknown ones), or the failed attempts.
        "mixes": (dict(Counter(r["error_class"] or "unclassified" for r in rows if r["state"] == "failed")),
                  dict(Counter(r["error_class"] or "unclassified" for r in rows if r["state"] in ("failed", "unknown"))),
                  dict(Counter(a["error_class"] for a in atts))),
    }


def near(a, b):
    return a is None and b is None or (a is not None and b is not None and a == pytest.approx(b, rel=1e-6, abs=1e-9))


def check_row(row, want):
    for k in ("requests", "attempts", "unknowns"):
        assert row[k] == want[k], (k, row, want)
    for k in ("amplification", "post_retry_success_rate", "cost_usd"):
        assert near(row[k], want[k]), (k, row, want)
    assert any(near(row["success_rate"], s) for s in want["success_rates"]), (row, want)
    mix = {e["class"]: e["count"] for e in row["error_mix"]}
    assert mix in want["mixes"], (row["error_mix"], want["mixes"])
    assert row["duplicates"] == 0
    if row["requests"]:
        assert row["p50_ms"] is not None and row["p95_ms"] is not None and row["p50_ms"] <= row["p95_ms"], row


def test_n1_n2_the_scorecard_of_a_route_matches_the_ledger_in_three_periods(gateway):
    # spec: N1, N2, F5
    gw = gateway
    ch = gw.channel("openai")
    ok_ids, retried_ids, failed_ids = [], [], []
    for _ in range(10):
        r = chat(gw)
        assert r.status_code == 200
        ok_ids.append(r.headers["x-request-id"])
    for _ in range(3):  # a 500, then a success on the retry
        gw.sim.set(ch, script=[{"fault": status(500), "times": 1}])
        r = chat(gw)
        assert r.status_code == 200, r.text
        retried_ids.append(r.headers["x-request-id"])
    for _ in range(2):  # the provider says the request is wrong: failed, never retried
        gw.sim.set(ch, script=[{"fault": status(400), "times": 1}])
        r = chat(gw)
        assert r.status_code == 400, r.text
        failed_ids.append(r.headers["x-request-id"])
    gw.sim.set(ch)
    other_ids = []
    for _ in range(4):
        r = post(gw, "anthropic", gw.key, json=BODIES["anthropic"])
        assert r.status_code == 200
        other_ids.append(r.headers["x-request-id"])
    assert gw.calls("openai") == 18
    for rid in retried_ids:
        assert (gw.request_row(rid)["state"], gw.request_row(rid)["attempts"]) == ("done", 2)
    for rid in failed_ids:
        assert (gw.request_row(rid)["state"], gw.request_row(rid)["attempts"]) == ("failed", 1)
    for rid in ok_ids + other_ids:
        gw.request_row(rid)  # every row final in the ledger before the scorecard reads it

    sc = ok(gw, "GET", f"/admin/v1/scorecard?route={ROUTE}")
    assert (sc["route"], sc["run"], sc["drill"]) == (ROUTE, None, False)
    assert [p["name"] for p in sc["periods"]] == PERIODS
    mine = []
    with gw.db() as con:
        for p in sc["periods"]:
            assert p["from"] <= p["to"], p
            assert p["rows"] and p["rows"][-1]["route"] == "overall", p
            routes = p["rows"][:-1]
            assert len({r["route"] for r in routes}) == len(routes)
            for row in routes:
                check_row(row, expected(con, p["from"], p["to"], row["route"]))
            overall = p["rows"][-1]
            assert overall["requests"] == sum(r["requests"] for r in routes)
            assert overall["attempts"] == sum(r["attempts"] for r in routes)
            if overall["requests"]:
                assert near(overall["amplification"], overall["attempts"] / overall["requests"])
            if any(r["route"] == ROUTE and r["requests"] for r in routes):
                mine.append(p)
    # The known mix sits in one period: 15 requests, 18 attempts.
    assert len(mine) == 1, [p["name"] for p in mine]
    row = next(r for r in mine[0]["rows"] if r["route"] == ROUTE)
    assert (row["requests"], row["attempts"], row["unknowns"], row["duplicates"]) == (15, 18, 0, 0), row
    assert row["amplification"] == pytest.approx(18 / 15)
    assert any(near(row["success_rate"], s) for s in (13 / 15, 10 / 15)), row
    # F5: the retried requests that ended well, of the retried requests: all 3 of 3.
    assert row["post_retry_success_rate"] == pytest.approx(1.0), row
    with gw.db() as con:
        cls = con.execute("SELECT error_class FROM requests WHERE id = ?", (failed_ids[0],)).fetchone()[0]
    mix = {e["class"]: e["count"] for e in row["error_mix"]}
    assert mix.get(cls) == 2 and mix.get("server_error", 0) in (0, 3), mix
    assert row["cost_usd"] > 0
    # Nothing unknown: no such review flag.
    assert not [f for f in sc["flags"] if "unknown" in f["rule"]], sc["flags"]


def hang_and_kill(gw, n):
    """`n` calls stuck upstream, then the gateway killed: at its next start they are unknown (I4)."""
    ch = gw.channel("openai")
    gw.sim.set(ch, fault={"kind": "hang", "ms": 30_000})
    try:
        for i in range(n):
            background(lambda i=i: chat(gw, f"stuck-{i}", timeout=40))
        assert wait_for(lambda: gw.sim.stats(ch)["in_flight"] == n, 10), gw.sim.stats(ch)
        gw.proc.send_signal(signal.SIGKILL)
        gw.proc.wait(10)
    finally:
        gw.sim.set(ch)
        stop(gw.proc)


def unknown_flags(gw):
    sc = ok(gw, "GET", f"/admin/v1/scorecard?route={ROUTE}")
    return [f for f in sc["flags"] if "unknown" in f["rule"]]


def test_n3_unknown_outcomes_raise_a_review_flag_naming_who_decides(tmp_path, sim):
    # spec: N3, I4
    gw = start_gateway(tmp_path, sim)
    try:
        assert chat(gw).status_code == 200
        hang_and_kill(gw, 1)
    finally:
        stop(gw.proc)
    gw = start_gateway(tmp_path, sim, max_concurrency=16)
    try:
        with gw.db() as con:
            assert con.execute("SELECT COUNT(*) FROM requests WHERE state = 'unknown' AND route = ?",
                               (ROUTE,)).fetchone()[0] == 1
        flags = unknown_flags(gw)
        assert len(flags) == 1, flags
        one = flags[0]
        assert one["route"] in (ROUTE, None) and one["detail"] and one["decide"], one
        assert one["escalation"] is False, "one unknown is the application owner's to decide"
        hang_and_kill(gw, 9)
    finally:
        stop(gw.proc)
    gw = start_gateway(tmp_path, sim)
    try:
        flags = unknown_flags(gw)
        # Still the application owner's to reconcile...
        assert any(not f["escalation"] and set(f["decide"]) == set(one["decide"]) for f in flags), flags
        # ...and, ten or more, escalated beyond them, with the count.
        up = [f for f in flags if f["escalation"]]
        assert len(up) == 1 and "10" in up[0]["detail"], flags
        assert set(up[0]["decide"]) - set(one["decide"]), f"an escalation names people beyond {one['decide']}: {up}"
    finally:
        stop(gw.proc)
