"""Background jobs, lanes and workflow policies, owner review, fallback contracts and the
dead-letter inbox (J1-J8, K1-K3, L1-L3, E2): the real binary, the real simulator, a real
SQLite ledger."""

import json
import signal
import sqlite3
import time
import urllib.error
import urllib.request

import pytest

from conftest import MODELS, start_gateway, stop, wait_for


def status(code, **kw):
    return {"kind": "status", "status": code, **kw}


def call(method, url, body=None, headers=None, raw=False):
    """(status, headers, JSON body or bytes) of one HTTP call; never raises for a status."""
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            code, h, b = r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        code, h, b = e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()
    if raw:
        return code, h, b
    try:
        return code, h, json.loads(b) if b else None
    except ValueError:
        return code, h, b


def admin(gw, method, path, body=None):
    return call(method, gw.url + path, body, {"authorization": f"Bearer {gw.admin_token}"})


CHAT = {"model": MODELS["openai"], "messages": [{"role": "user", "content": "Summarise ticket 42."}]}


def submit(gw, body=None, workflow=None, key=None, **headers):
    h = {"authorization": f"Bearer {key or gw.key}", "prefer": "respond-async"}
    if workflow:
        h["x-spillway-workflow"] = workflow
    h.update({k.replace("_", "-"): v for k, v in headers.items()})
    return call("POST", gw.url + "/v1/chat/completions", body or CHAT, h)


def job(gw, job_id, key=None):
    return call("GET", f"{gw.url}/spillway/v1/jobs/{job_id}", headers={"authorization": f"Bearer {key or gw.key}"})


def until_job(gw, job_id, pred, timeout=30.0):
    seen = {}

    def check():
        code, _, body = job(gw, job_id)
        seen["last"] = body
        return code == 200 and pred(body)

    assert wait_for(check, timeout=timeout), seen.get("last")
    return seen["last"]


def workflow_dir(tmp_path, **files):
    d = tmp_path / "workflows"
    d.mkdir(exist_ok=True)
    for name, text in files.items():
        (d / f"{name}.yaml").write_text(text)
    return d


def policy(name, lanes="", rest=""):
    return f"workflow: {name}\nai_api_queueing_strategy:\n  lanes:\n{lanes}{rest}"


def test_j2_a_background_job_answers_202_and_its_result_is_the_interactive_body(gateway):
    # spec: J2, J3, J8
    code, h, body = submit(gateway)
    assert code == 202, body
    assert h["location"] == body["status_url"] == f"/spillway/v1/jobs/{body['job_id']}"
    assert body["workflow"] == "default" and len(body["policy_version"]) == 16
    done = until_job(gateway, body["job_id"], lambda j: j["state"] == "succeeded")
    # J3: every field of the job is there.
    for f in ("job_id", "idempotency_key", "workflow", "owner_key", "route_key", "requested_model", "served_model",
              "attempt", "max_attempts", "created_at", "ready_at", "expires_at", "retry_after_ms", "fallback_policy",
              "partial_output_committed", "last_error_type", "estimated_cost_usd", "usage_units", "lane",
              "policy_version"):
        assert f in done, f
    assert done["route_key"] == "openai/gpt-4o-mini" and done["attempt"] == 1 and done["lane"] is None
    assert done["result"]["object"] == "chat.completion" and done["result"]["choices"]
    # The result as the provider sent it, byte for byte, with its status and type.
    code, h, raw = call("GET", f"{gateway.url}{done['result_url']}", headers={"authorization": f"Bearer {gateway.key}"},
                        raw=True)
    assert code == 200 and h["content-type"].startswith("application/json")
    assert json.loads(raw) == done["result"]
    # The run is an ordinary ledger request of the job, under the workflow's version.
    row = gateway.request_row(done["request_ids"][0])
    assert row["job_id"] == done["job_id"] and row["workflow"] == "default"
    assert row["policy_version"] == done["policy_version"] and row["state"] == "done"
    # Another key learns nothing about the job.
    code, _, err = job(gateway, done["job_id"], key="sk-someone-else-0123456789")
    assert code == 401, err


@pytest.mark.parametrize("fmt", ["anthropic", "gemini"])
def test_j2_every_format_takes_background_work(gateway, fmt):
    # spec: J2
    if fmt == "anthropic":
        url, body = "/v1/messages", {"model": MODELS[fmt], "max_tokens": 64,
                                     "messages": [{"role": "user", "content": "hi"}]}
        h = {"x-api-key": gateway.key, "anthropic-version": "2023-06-01"}
    else:
        url, body = f"/v1beta/models/{MODELS[fmt]}:generateContent", {"contents": [{"parts": [{"text": "hi"}]}]}
        h = {"x-goog-api-key": gateway.key}
    code, _, acc = call("POST", gateway.url + url, body, {**h, "prefer": "respond-async"})
    assert code == 202, acc
    code, _, done = call("GET", gateway.url + acc["status_url"], headers=h)
    done = until_job(gateway, acc["job_id"], lambda j: j["state"] == "succeeded")
    assert ("content" in done["result"]) if fmt == "anthropic" else ("candidates" in done["result"])
    with gateway.db() as con:
        # The anthropic-version header rode along; no credential was stored.
        stored = con.execute("SELECT headers, path FROM jobs WHERE id = ?", (acc["job_id"],)).fetchone()
    assert gateway.key not in stored[0] and gateway.key not in stored[1]


def test_j6_a_failing_job_reaches_the_dead_letter_out_of_attempts(gateway):
    # spec: J6, F2, J3
    ch = gateway.channel("openai")
    gateway.sim.set(ch, fault=status(503))
    try:
        _, _, acc = submit(gateway)
        started = time.monotonic()
        dead = until_job(gateway, acc["job_id"], lambda j: j["state"] == "dead_letter", timeout=30)
        assert time.monotonic() - started < 20, "full jitter capped: a failing job dead-letters fast"
        assert dead["lane"] == "dead_letter" and dead["reason"] == "max_attempts_exhausted"
        assert dead["attempt"] == dead["max_attempts"] == 3
        assert dead["last_error_type"] == "overload" and len(dead["request_ids"]) == 3
        assert gateway.calls("openai") == 3, "one upstream attempt per job attempt"
        code, _, listed = admin(gateway, "GET", "/admin/v1/dead-letters?route=openai/gpt-4o-mini")
        assert code == 200 and [d["job_id"] for d in listed] == [acc["job_id"]]
        code, _, listed = admin(gateway, "GET", "/admin/v1/dead-letters?error_class=quota")
        assert listed == []
    finally:
        gateway.sim.set(ch)


def test_j6_a_job_outliving_max_queue_age_is_dead_lettered(gateway_factory, tmp_path):
    # spec: J6, F1
    wf = policy("short", "    background_retry: {max_queue_age_ms: 1500, max_attempts: 20}\n",
                "  fail_closed_when: [partial_output_committed]\n")
    gw = gateway_factory(extra_yaml=f"workflows: {workflow_dir(tmp_path, short=wf)}")
    ch = gw.channel("openai")
    # Each failure asks for a 1 s pause: the wait is kept as ready_at, not slept in a handler.
    gw.sim.set(ch, fault=status(429, retry_after_s=1))
    try:
        _, _, acc = submit(gw, workflow="short")
        waiting = until_job(gw, acc["job_id"], lambda j: j["attempt"] >= 1 and j["state"] == "queued")
        assert waiting["ready_at"] >= waiting["updated_at"] + 900
        dead = until_job(gw, acc["job_id"], lambda j: j["state"] == "dead_letter", timeout=10)
        assert dead["reason"] == "max_queue_age_exceeded"
        assert dead["attempt"] < 20
    finally:
        gw.sim.set(ch)


def test_e2_j6_k3_a_quota_signal_sends_the_job_to_owner_review_and_an_owner_approves(gateway):
    # spec: E2, J6, K3
    ch = gateway.channel("openai")
    gateway.sim.set(ch, script=[{"fault": status(429, error="quota"), "times": 1}])
    _, _, acc = submit(gateway)
    held = until_job(gateway, acc["job_id"], lambda j: j["state"] == "owner_review")
    assert held["reason"] == "quota_or_spend_exhausted" and held["last_error_type"] == "quota"
    assert gateway.calls("openai") == 1, "quota is never retried as transient"
    code, _, items = admin(gateway, "GET", "/admin/v1/reviews")
    assert [i["job_id"] for i in items] == [acc["job_id"]]
    # Reviewer and reason are required, each named.
    code, _, err = admin(gateway, "POST", f"/admin/v1/reviews/{acc['job_id']}/approve", {})
    assert code == 422 and err["missing_fields"] == ["reviewer", "reason"], err
    code, _, err = admin(gateway, "POST", f"/admin/v1/reviews/{acc['job_id']}/approve", {"reviewer": "ana"})
    assert code == 422 and err["missing_fields"] == ["reason"]
    code, _, err = admin(gateway, "POST", f"/admin/v1/reviews/{acc['job_id']}/approve",
                         {"reviewer": "ana", "reason": "x", "route": "openai/gpt-4.1"})
    assert code == 422 and "route" in err["error"], err
    # The channel left rotation for the quota (E2): the owner restores it, then approves.
    admin(gateway, "POST", f"/admin/v1/channels/{ch}/restore", {"actor": "ana", "reason": "quota raised"})
    code, _, approved = admin(gateway, "POST", f"/admin/v1/reviews/{acc['job_id']}/approve",
                              {"reviewer": "ana", "reason": "finance raised the quota"})
    assert code == 200 and approved["state"] == "queued", approved
    done = until_job(gateway, acc["job_id"], lambda j: j["state"] == "succeeded")
    assert json.loads(done["review"])["reviewer"] == "ana"
    _, _, audit = admin(gateway, "GET", "/admin/v1/audit?kind=job")
    assert any(a["action"] == "review_approved" and a["actor"] == "ana" and a["subject"] == acc["job_id"] for a in audit)
    # Rejecting: the job ends, on the record.
    gateway.sim.set(ch, script=[{"fault": status(429, error="quota"), "times": 1}])
    _, _, acc2 = submit(gateway, body={**CHAT, "messages": [{"role": "user", "content": "another"}]})
    until_job(gateway, acc2["job_id"], lambda j: j["state"] == "owner_review")
    code, _, rejected = admin(gateway, "POST", f"/admin/v1/reviews/{acc2['job_id']}/reject",
                              {"reviewer": "ana", "reason": "not worth the spend"})
    assert code == 200 and rejected["state"] == "rejected"
    code, _, err = admin(gateway, "POST", f"/admin/v1/reviews/{acc2['job_id']}/approve", {"reviewer": "a", "reason": "b"})
    assert code == 409


def dead_letter(gw, **submit_kw):
    ch = gw.channel("openai")
    gw.sim.set(ch, fault=status(503))
    _, _, acc = submit(gw, **submit_kw)
    until_job(gw, acc["job_id"], lambda j: j["state"] == "dead_letter")
    gw.sim.set(ch)
    return acc["job_id"]


def test_l1_l2_a_replay_needs_every_field_and_the_estimate_as_shown(gateway):
    # spec: L1, L2, K2
    dl = dead_letter(gateway)
    code, _, d = admin(gateway, "GET", f"/admin/v1/dead-letters/{dl}")
    assert code == 200 and d["replayable"], d
    assert d["idempotency_result"] == "no_side_effect_recorded"
    assert d["estimated_cost_usd"] > 0 and d["routes"][0] == {
        "route": "openai/gpt-4o-mini", "kind": "same_route", "estimated_cost_usd": d["estimated_cost_usd"], "refused": None}
    assert len(d["evidence"]) == 3 and all(e["attempts"] for e in d["evidence"])
    url = f"/admin/v1/dead-letters/{dl}/replay"
    code, _, err = admin(gateway, "POST", url, {})
    assert code == 422 and err["missing_fields"] == [
        "replay_owner", "replay_reason", "route_override", "idempotency_result", "cost_reviewed"], err
    form = {"replay_owner": "ana", "replay_reason": {"kind": "provider_recovered", "text": "503s stopped at 10:42"},
            "route_override": "openai/gpt-4o-mini", "idempotency_result": "no_side_effect_recorded",
            "cost_reviewed": {"estimated_cost_usd": d["estimated_cost_usd"]}}
    code, _, err = admin(gateway, "POST", url, {k: v for k, v in form.items() if k != "cost_reviewed"})
    assert code == 422 and err["missing_fields"] == ["cost_reviewed"]
    code, _, err = admin(gateway, "POST", url, {**form, "replay_reason": {"kind": "because"}})
    assert code == 422 and err["missing_fields"] == ["replay_reason.text"]
    code, _, err = admin(gateway, "POST", url, {**form, "replay_reason": {"kind": "because", "text": "t"}})
    assert code == 422 and "provider_recovered" in err["error"]
    code, _, err = admin(gateway, "POST", url, {**form, "cost_reviewed": {"estimated_cost_usd": d["estimated_cost_usd"] / 2}})
    assert code == 409 and "estimate changed" in err["error"], err
    code, _, err = admin(gateway, "POST", url, {**form, "idempotency_result": "side_effect_completed"})
    assert code == 409 and "no_side_effect_recorded" in err["error"]
    code, _, err = admin(gateway, "POST", url, {**form, "route_override": "openai/gpt-4.1"})
    assert code == 422 and "route_override" in err["error"]
    # Complete and current: a new job, linked both ways, on the audit log.
    code, _, acc = admin(gateway, "POST", url, form)
    assert code == 202, acc
    done = until_job(gateway, acc["job_id"], lambda j: j["state"] == "succeeded")
    assert done["replay_of"] == dl and json.loads(done["replay"])["replay_owner"] == "ana"
    _, _, old = admin(gateway, "GET", f"/admin/v1/jobs/{dl}")
    assert old["job"]["state"] == "replayed" and old["job"]["replayed_by"] == acc["job_id"]
    _, _, audit = admin(gateway, "GET", "/admin/v1/audit?kind=replay")
    assert audit[0]["subject"] == dl and audit[0]["actor"] == "ana" and acc["job_id"] in audit[0]["figures"]
    code, _, err = admin(gateway, "POST", url, form)
    assert code == 409, "a dead letter is replayed once"


def test_l1_a_replay_is_refused_when_a_side_effect_was_completed_under_the_key(gateway):
    # spec: L1, I2, I3
    dl = dead_letter(gateway, idempotency_key="invoice-7")
    # The client's own request under the same key completes and records its side effect.
    h = {"authorization": f"Bearer {gateway.key}", "idempotency-key": "invoice-7"}
    code, rh, _ = call("POST", gateway.url + "/v1/chat/completions", CHAT, h)
    assert code == 200
    rid = rh["x-request-id"]
    code, _, _ = call("POST", f"{gateway.url}/spillway/v1/requests/{rid}/side-effect", {"state": "done", "result_id": "inv-7"},
                      {"authorization": f"Bearer {gateway.key}"})
    assert code == 200
    _, _, d = admin(gateway, "GET", f"/admin/v1/dead-letters/{dl}")
    assert d["idempotency_result"] == "side_effect_completed" and not d["replayable"]
    form = {"replay_owner": "ana", "replay_reason": {"kind": "owner_override", "text": "try anyway"},
            "route_override": "openai/gpt-4o-mini", "idempotency_result": "side_effect_completed",
            "cost_reviewed": {"estimated_cost_usd": d["estimated_cost_usd"]}}
    code, _, err = admin(gateway, "POST", f"/admin/v1/dead-letters/{dl}/replay", form)
    assert code == 409 and "completed side effect" in err["error"], err


def test_l3_i4_a_job_cut_by_a_crash_is_not_run_again_before_reconciliation(tmp_path, sim):
    # spec: L3, I4, J6
    gw = start_gateway(tmp_path, sim)
    sim.set(gw.channel("openai"), latency_ms=30_000)
    _, _, acc = submit(gw)
    assert wait_for(lambda: sim.stats(gw.channel("openai"))["in_flight"] == 1, timeout=10)
    gw.proc.send_signal(signal.SIGKILL)
    gw.proc.wait(10)
    sim.set(gw.channel("openai"))
    (tmp_path / "gateway.yaml").rename(tmp_path / "before-crash.yaml")
    gw2 = start_gateway(tmp_path, sim)
    try:
        dead = until_job(gw2, acc["job_id"], lambda j: j["state"] == "dead_letter")
        assert dead["reason"] == "outcome_unknown"
        _, _, d = admin(gw2, "GET", f"/admin/v1/dead-letters/{acc['job_id']}")
        assert d["idempotency_result"] == "outcome_unknown" and not d["replayable"]
        form = {"replay_owner": "ana", "replay_reason": {"kind": "provider_recovered", "text": "back"},
                "route_override": "openai/gpt-4o-mini", "idempotency_result": "outcome_unknown",
                "cost_reviewed": {"estimated_cost_usd": d["estimated_cost_usd"]}}
        code, _, err = admin(gw2, "POST", f"/admin/v1/dead-letters/{acc['job_id']}/replay", form)
        assert code == 409 and "reconcile" in err["error"], err
        assert gw2.calls("openai") == 0, "nothing was sent again on its own"
        # An owner confirms it never ran: now it may be replayed, once.
        assert [e["request"]["state"] for e in d["evidence"]] == ["unknown"]
        run = d["evidence"][0]["request"]["id"]
        admin(gw2, "POST", f"/admin/v1/requests/{run}/reconcile",
              {"outcome": "confirmed_not_executed", "actor": "ana", "reason": "not in the provider's logs"})
        _, _, d = admin(gw2, "GET", f"/admin/v1/dead-letters/{acc['job_id']}")
        assert d["idempotency_result"] == "no_side_effect_recorded"
        code, _, new = admin(gw2, "POST", f"/admin/v1/dead-letters/{acc['job_id']}/replay",
                             {**form, "idempotency_result": "no_side_effect_recorded"})
        assert code == 202, new
        until_job(gw2, new["job_id"], lambda j: j["state"] == "succeeded")
        assert gw2.calls("openai") == 1
    finally:
        stop(gw2.proc)


def test_j4_j5_a_restart_with_queued_jobs_loses_none_and_runs_none_twice(tmp_path, sim):
    # spec: J4, J5, I5, I2
    wf = policy("one", "    background_retry: {max_attempts: 3}\n",
                "  backpressure: {max_concurrency: 1}\n")
    extra = f"workflows: {workflow_dir(tmp_path, one=wf)}"
    gw = start_gateway(tmp_path, sim, extra_yaml=extra)
    sim.set(gw.channel("openai"), latency_ms=400)
    ids = [submit(gw, body={**CHAT, "messages": [{"role": "user", "content": f"ticket {i}"}]}, workflow="one")[2]["job_id"]
           for i in range(5)]
    assert wait_for(lambda: job(gw, ids[0])[2]["state"] == "succeeded", timeout=10)
    stop(gw.proc)
    calls_before = sim.stats(gw.channel("openai"))["calls"]
    with sqlite3.connect(str(gw.ledger)) as con:
        states = dict(con.execute("SELECT id, state FROM jobs").fetchall())
    assert len(states) == 5 and "queued" in states.values(), states
    (tmp_path / "gateway.yaml").rename(tmp_path / "before-restart.yaml")
    gw2 = start_gateway(tmp_path, sim, extra_yaml=extra)
    sim.set(gw2.channel("openai"), latency_ms=50)
    try:
        for i in ids:
            until_job(gw2, i, lambda j: j["state"] == "succeeded", timeout=20)
        total = calls_before + sim.stats(gw2.channel("openai"))["calls"]
        assert total == 5, "each job ran exactly once across the restart"
        # One run per job in the ledger, each done (its final record is group-committed).
        for i in ids:
            runs = job(gw2, i)[2]["request_ids"]
            assert len(runs) == 1 and gw2.request_row(runs[0])["state"] == "done"
    finally:
        stop(gw2.proc)


def test_j4_release_order_under_mixed_priorities(gateway_factory, tmp_path):
    # spec: J4, J5
    wf = policy("serial", "    background_retry: {max_attempts: 3}\n", "  backpressure: {max_concurrency: 1}\n")
    gw = gateway_factory(extra_yaml=f"workflows: {workflow_dir(tmp_path, serial=wf)}")
    gw.sim.set(gw.channel("openai"), latency_ms=300)
    def sub(name, prio):
        return submit(gw, body={**CHAT, "messages": [{"role": "user", "content": name}]}, workflow="serial",
                      x_spillway_priority=prio)[2]["job_id"]
    blocker = sub("blocker", "normal")
    assert wait_for(lambda: gw.sim.stats(gw.channel("openai"))["in_flight"] == 1, timeout=5)
    order = {sub("low", "low"): "low", sub("normal", "normal"): "normal", sub("high", "high"): "high",
             sub("urgent", "urgent"): "urgent"}
    started = {}
    for j in [blocker, *order]:
        done = until_job(gw, j, lambda x: x["state"] == "succeeded", timeout=20)
        started[j] = gw.request_row(done["request_ids"][0])["admitted_at"]
    ran = sorted(order, key=lambda j: started[j])
    assert [order[j] for j in ran] == ["urgent", "high", "normal", "low"]
    code, _, err = submit(gw, workflow="serial", x_spillway_priority="asap")
    assert code == 400 and "x-spillway-priority" in json.dumps(err)


def test_j7_a_full_lane_answers_429_with_a_restart_estimate(gateway_factory, tmp_path):
    # spec: J7, J1
    wf = policy("tiny", "    background_retry: {max_length: 2}\n", "  backpressure: {max_concurrency: 1}\n")
    gw = gateway_factory(extra_yaml=f"workflows: {workflow_dir(tmp_path, tiny=wf)}")
    gw.sim.set(gw.channel("openai"), latency_ms=3_000)
    try:
        assert submit(gw, workflow="tiny")[0] == 202
        assert submit(gw, workflow="tiny", body={**CHAT, "model": MODELS["openai"], "n": 1})[0] == 202
        code, h, err = submit(gw, workflow="tiny", body={**CHAT, "temperature": 0})
        assert code == 429, err
        assert int(h["retry-after"]) >= 1
        assert "`background_retry` lane of workflow `tiny` is full (2 of 2)" in err["error"]["message"]
        _, _, lanes = admin(gw, "GET", "/admin/v1/lanes")
        row = next(r for r in lanes["routes"] if r["route"] == "openai/gpt-4o-mini")
        assert row["background_retry"] == 2 and row["running"] == 1
        tiny = next(w for w in lanes["workflows"] if w["workflow"] == "tiny")
        assert tiny["background_retry"] == 2 and tiny["background_retry_max"] == 2
    finally:
        gw.sim.set(gw.channel("openai"))


FALLBACK = """workflow: summaries
ai_api_queueing_strategy:
  lanes:
    background_retry: {{max_attempts: 2}}
  fallback:
    approved_quality_classes: [standard]
{boundary}    routes:
      - {{from: openai/gpt-4o-mini, to: openai/gpt-4.1, quality_class: standard, equivalent_tools: true,
         schema_match: true, max_cost_usd: 1.0}}
"""


def test_k1_a_fallback_across_the_data_boundary_is_refused(gateway_factory, tmp_path):
    # spec: K1, J6, E2
    wf = FALLBACK.format(boundary="    data_boundary: {providers: [openai], regions: [eu]}\n")
    gw = gateway_factory(extra_yaml=f"workflows: {workflow_dir(tmp_path, summaries=wf)}", channel_yaml="    region: us",
                         extra_models=("gpt-4.1",))
    gw.sim.set(gw.channel("openai"), fault=status(503))
    try:
        _, _, acc = submit(gw, workflow="summaries")
        held = until_job(gw, acc["job_id"], lambda j: j["state"] == "owner_review")
        assert held["reason"] == "data_boundary_mismatch" and "region `us`" in held["last_error"]
        assert held["route_override"] is None and gw.calls("openai") == 2, "nothing went to the fallback"
    finally:
        gw.sim.set(gw.channel("openai"))


def test_k1_k2_a_fallback_whose_contract_holds_serves_another_model_and_says_so(gateway_factory, tmp_path):
    # spec: K1, K2
    wf = FALLBACK.format(boundary="    data_boundary: {providers: [openai], regions: [eu]}\n")
    gw = gateway_factory(extra_yaml=f"workflows: {workflow_dir(tmp_path, summaries=wf)}", channel_yaml="    region: eu",
                         extra_models=("gpt-4.1",))
    gw.sim.set(gw.channel("openai"), script=[{"fault": status(503), "times": 2}])
    _, _, acc = submit(gw, workflow="summaries")
    done = until_job(gw, acc["job_id"], lambda j: j["state"] == "succeeded")
    assert done["requested_model"] == "gpt-4o-mini" and done["served_model"] == "gpt-4.1"
    assert done["route_override"] == "openai/gpt-4.1" and "gpt-4.1" in done["fallback_policy"]
    last = gw.request_row(done["request_ids"][-1])
    assert last["requested_model"] == "gpt-4.1" and last["route"] == "openai/gpt-4.1"
    _, _, audit = admin(gw, "GET", "/admin/v1/audit?kind=job")
    assert any(a["action"] == "fallback" and a["subject"] == acc["job_id"] for a in audit)
    # Tools the route is not approved for break the contract: no fallback, a person decides.
    strict = FALLBACK.replace("equivalent_tools: true", "equivalent_tools: false").format(boundary="").replace(
        "summaries", "strict")
    (tmp_path / "workflows" / "strict.yaml").write_text(strict)
    assert wait_for(lambda: any(w["workflow"] == "strict" for w in admin(gw, "GET", "/admin/v1/policies")[2]["workflows"]),
                    timeout=10)
    gw.sim.set(gw.channel("openai"), fault=status(503))
    try:
        tools = {**CHAT, "tools": [{"type": "function", "function": {"name": "refund", "parameters": {"type": "object"}}}]}
        _, _, acc = submit(gw, body=tools, workflow="strict")
        dead = until_job(gw, acc["job_id"], lambda j: j["state"] == "dead_letter")
        assert dead["reason"] == "fallback_contract_mismatch" and "tools" in dead["last_error"]
    finally:
        gw.sim.set(gw.channel("openai"))


def test_j8_policies_are_chosen_versioned_hot_reloaded_and_rolled_back(gateway_factory, tmp_path):
    # spec: J8
    d = workflow_dir(tmp_path, batch=policy("batch", "    background_retry: {max_attempts: 4}\n"))
    gw = gateway_factory(extra_yaml=f"workflows: {d}", key_yaml="    workflow: batch")
    _, _, pol = admin(gw, "GET", "/admin/v1/policies")
    names = {w["workflow"]: w for w in pol["workflows"]}
    assert set(names) == {"batch", "default"} and names["batch"]["editable"] and not names["default"]["editable"]
    v1 = names["batch"]["version"]
    # The key's default workflow applies; a header names another; an unknown one is refused.
    code, h, _ = call("POST", gw.url + "/v1/chat/completions", CHAT, {"authorization": f"Bearer {gw.key}"})
    assert code == 200 and gw.request_row(h["x-request-id"])["policy_version"] == v1
    code, _, err = call("POST", gw.url + "/v1/chat/completions", CHAT,
                        {"authorization": f"Bearer {gw.key}", "x-spillway-workflow": "nope"})
    assert code == 400 and "`batch`" in err["error"]["message"] and err["error"]["param"] == "x-spillway-workflow"
    # A valid edit is applied once the file settles; the old version stays on record.
    (d / "batch.yaml").write_text(policy("batch", "    background_retry: {max_attempts: 6}\n"))
    assert wait_for(lambda: admin(gw, "GET", "/admin/v1/policies")[2]["workflows"][0]["version"] != v1, timeout=10)
    _, _, acc = submit(gw)
    assert until_job(gw, acc["job_id"], lambda j: j["state"] == "succeeded")["max_attempts"] == 6
    v2 = admin(gw, "GET", "/admin/v1/policies")[2]["workflows"][0]["version"]
    # A bad edit keeps the last good version and says why, with file, line and field.
    (d / "batch.yaml").write_text(policy("batch", "    background_retry: {max_attempts: 0}\n"))
    assert wait_for(lambda: admin(gw, "GET", "/admin/v1/policies")[2]["problems"], timeout=10)
    pol = admin(gw, "GET", "/admin/v1/policies")[2]
    assert pol["workflows"][0]["version"] == v2
    assert "batch.yaml:4:" in pol["problems"][0]["error"] and "max_attempts" in pol["problems"][0]["error"]
    assert {v["version"] for v in pol["workflows"][0]["versions"]} == {v1, v2}
    # Roll back to the first version: who and why required; the file is rewritten.
    code, _, err = admin(gw, "POST", "/admin/v1/policies/batch/rollback", {"version": v1})
    assert code == 422 and err["missing_fields"] == ["actor", "reason"]
    code, _, rb = admin(gw, "POST", "/admin/v1/policies/batch/rollback", {"version": v1, "actor": "ana", "reason": "6 was too many"})
    assert code == 200 and rb["version"] == v1
    assert "max_attempts: 4" in (d / "batch.yaml").read_text()
    code, _, text = admin(gw, "GET", f"/admin/v1/policies/batch/versions/{v2}")
    assert "max_attempts: 6" in text["text"]
    _, _, audit = admin(gw, "GET", "/admin/v1/audit?kind=policy")
    assert any(a["actor"] == "ana" and "rolled back" in a["reason"] for a in audit)
    code, _, err = admin(gw, "POST", "/admin/v1/policies/default/rollback", {"version": "x", "actor": "a", "reason": "b"})
    assert code == 404


def test_j8_a_job_without_an_idempotency_key_is_refused_where_the_policy_requires_one(gateway_factory, tmp_path):
    # spec: J8, J2, I2
    wf = policy("images", "    background_retry: {require_idempotency_key: true}\n")
    gw = gateway_factory(extra_yaml=f"workflows: {workflow_dir(tmp_path, images=wf)}")
    code, _, err = submit(gw, workflow="images")
    assert code == 400 and err["error"]["param"] == "Idempotency-Key"
    code, _, first = submit(gw, workflow="images", idempotency_key="img-1")
    assert code == 202
    # The same key and body is the same job; another body under the key is refused.
    code, h, again = submit(gw, workflow="images", idempotency_key="img-1")
    assert code == 202 and again["job_id"] == first["job_id"] and h.get("x-spillway-idempotent-replay") == "true"
    code, _, err = submit(gw, workflow="images", idempotency_key="img-1", body={**CHAT, "temperature": 1})
    assert code == 422
    until_job(gw, first["job_id"], lambda j: j["state"] == "succeeded")
    assert gw.calls("openai") == 1


def test_l2_bulk_replay_shows_the_total_first_and_stops_after_its_failure_limit(gateway_factory, tmp_path):
    # spec: L2, L1
    wf = policy("bulk", "    background_retry: {max_attempts: 1}\n", "  backpressure: {max_concurrency: 1}\n")
    gw = gateway_factory(extra_yaml=f"workflows: {workflow_dir(tmp_path, bulk=wf)}")
    ch = gw.channel("openai")
    gw.sim.set(ch, fault=status(503))
    ids = [submit(gw, workflow="bulk", body={**CHAT, "messages": [{"role": "user", "content": f"t{i}"}]})[2]["job_id"]
           for i in range(3)]
    for i in ids:
        until_job(gw, i, lambda j: j["state"] == "dead_letter")
    code, _, p = admin(gw, "POST", "/admin/v1/dead-letters/replay-preview", {"filter": {"workflow": "bulk"}})
    assert code == 200 and p["count"] == 3 and p["total_estimated_cost_usd"] > 0 and p["refused"] == []
    form = {"filter": {"workflow": "bulk"}, "replay_owner": "ana",
            "replay_reason": {"kind": "provider_recovered", "text": "status page green"}}
    code, _, err = admin(gw, "POST", "/admin/v1/dead-letters/replay", form)
    assert code == 422 and err["missing_fields"] == ["cost_reviewed", "stop_after_failures"]
    code, _, err = admin(gw, "POST", "/admin/v1/dead-letters/replay",
                         {**form, "stop_after_failures": 1, "cost_reviewed": {"total_estimated_cost_usd": 0.5, "count": 3}})
    assert code == 409 and "total estimate changed" in err["error"]
    code, _, err = admin(gw, "POST", "/admin/v1/dead-letters/replay",
                         {**form, "stop_after_failures": 1,
                          "cost_reviewed": {"total_estimated_cost_usd": p["total_estimated_cost_usd"], "count": 2}})
    assert code == 409 and "count" in err["error"], "the total is tied to the set it was shown for"
    # Still failing: the first replayed job fails and the batch stops; the rest are not run.
    code, _, b = admin(gw, "POST", "/admin/v1/dead-letters/replay",
                       {**form, "stop_after_failures": 1,
                        "cost_reviewed": {"total_estimated_cost_usd": p["total_estimated_cost_usd"], "count": 3}})
    assert code == 202 and len(b["replayed"]) == 3, b
    new = [r["job_id"] for r in b["replayed"]]
    assert wait_for(lambda: all(job(gw, n)[2]["state"] == "dead_letter" for n in new), timeout=20), [job(gw, n)[2] for n in new]
    reasons = sorted(job(gw, n)[2]["reason"] for n in new)
    assert reasons == ["bulk_replay_stopped", "bulk_replay_stopped", "max_attempts_exhausted"]
    assert gw.calls("openai") == 4, "three first runs and one replay run; the rest held back"
    _, _, audit = admin(gw, "GET", "/admin/v1/audit?kind=replay")
    assert {a["action"] for a in audit} >= {"bulk_replayed", "bulk_replay_stopped"}
    gw.sim.set(ch)


def test_j2_the_embedded_demo_fills_both_inboxes_within_two_minutes(tmp_path):
    # spec: J2, J6, K3, L1
    import subprocess
    from conftest import BIN, clean_env, read_line
    data = tmp_path / "data"
    # What `make run` starts: the embedded default with demo traffic at its default rate.
    proc = subprocess.Popen([str(BIN), "serve", "--listen", "127.0.0.1:0", "--demo-traffic"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=clean_env(SPILLWAY_DATA_DIR=str(data)))
    try:
        url = read_line(proc, "spillway listening on ").split()[-1]
        token = (data / "admin-token").read_text().strip()
        h = {"authorization": f"Bearer {token}"}
        seen = {}

        def both():
            seen["dead"] = call("GET", url + "/admin/v1/dead-letters", headers=h)[2]
            seen["review"] = call("GET", url + "/admin/v1/reviews", headers=h)[2]
            return seen["dead"] and seen["review"]

        assert wait_for(both, timeout=120), {k: len(v or []) for k, v in seen.items()}
        assert {d["reason"] for d in seen["dead"]} <= {"max_attempts_exhausted", "max_queue_age_exceeded"}
        assert {r["reason"] for r in seen["review"]} == {"quota_or_spend_exhausted"}
        # The operator has real evidence and a real form to practise on.
        code, _, d = call("GET", f"{url}/admin/v1/dead-letters/{seen['dead'][0]['job_id']}", headers=h)
        assert code == 200 and d["replayable"] and d["evidence"]
    finally:
        stop(proc)


CHAT_FALLBACK = """workflow: chat
ai_api_queueing_strategy:
  lanes:
    interactive_admission: {{max_attempts: 2}}
  fallback:
    approved_quality_classes: [standard]
{boundary}    routes:
      - {{from: openai/gpt-4o-mini, to: openai/gpt-4.1, quality_class: standard, equivalent_tools: true,
         schema_match: true, max_cost_usd: 1.0}}
"""


def test_k1_k2_f2_an_interactive_request_falls_back_only_under_its_workflows_contract(gateway_factory, tmp_path):
    # spec: K1, K2, F2, F3
    d = workflow_dir(tmp_path, chat=CHAT_FALLBACK.format(boundary=""),
                     eu=CHAT_FALLBACK.format(boundary="    data_boundary: {providers: [openai], regions: [eu]}\n")
                     .replace("workflow: chat", "workflow: eu"))
    gw = gateway_factory(extra_yaml=f"workflows: {d}", channel_yaml="    region: us", extra_models=("gpt-4.1",))
    ch = gw.channel("openai")
    h = {"authorization": f"Bearer {gw.key}", "x-spillway-workflow": "chat"}
    # The workflow's two attempts fail; the approved fallback answers, and says so.
    gw.sim.set(ch, script=[{"fault": status(503), "times": 2}])
    code, rh, body = call("POST", gw.url + "/v1/chat/completions", CHAT, h)
    assert code == 200, body
    assert rh["x-spillway-served-model"] == "gpt-4.1" and body["model"] == "gpt-4.1"
    row = gw.request_row(rh["x-request-id"])
    assert (row["requested_model"], row["served_model"], row["route"]) == ("gpt-4o-mini", "gpt-4.1", "openai/gpt-4.1")
    assert row["attempts"] == 3 and gw.calls("openai") == 3
    assert [a["decision"] for a in gw.attempts(rh["x-request-id"])] == ["retry", "failover", "done"]
    # Across the data boundary (the channel is in `us`, the workflow allows `eu`): no
    # fallback, the request fails closed after its own attempts.
    gw.sim.set(ch, script=[{"fault": status(503), "times": 2}])
    code, rh, body = call("POST", gw.url + "/v1/chat/completions", CHAT, {**h, "x-spillway-workflow": "eu"})
    assert code == 502, body
    assert gw.request_row(rh["x-request-id"])["served_model"] == "gpt-4o-mini"
    assert gw.calls("openai") == 5
    # Without a workflow that approves one there is no fallback at all.
    gw.sim.set(ch, script=[{"fault": status(503), "times": 3}])
    code, rh, _ = call("POST", gw.url + "/v1/chat/completions", CHAT, {"authorization": f"Bearer {gw.key}"})
    assert code == 502 and gw.request_row(rh["x-request-id"])["served_model"] == "gpt-4o-mini"
    gw.sim.set(ch)
