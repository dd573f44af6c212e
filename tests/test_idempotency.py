"""The idempotency ledger from the outside: a repeated `Idempotency-Key` is answered from
the ledger byte for byte (streams too) with no new upstream call, in every format; a crash
with hundreds of calls in flight leaves every one of them `unknown`, the ledger intact, and
nothing executed twice after the restart; owners reconcile; prompts stay hashes unless the
config keeps them; `spillway ledger prune`."""

import json
import signal
import sqlite3
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import BIN, MODELS, clean_env, start_gateway, stop, wait_for
from wire import BODIES, auth, error_of, path


def body_for(fmt, stream, text="hi"):
    b = json.loads(json.dumps(BODIES[fmt]))
    if fmt == "gemini":
        b["contents"][0]["parts"][0]["text"] = text
    else:
        b["messages"][0]["content"] = text
        if stream:
            b["stream"] = True
    return b


def path_for(fmt, stream):
    if fmt == "gemini" and stream:
        return f"/v1beta/models/{MODELS['gemini']}:streamGenerateContent?alt=sse"
    return path(fmt)


def send(gw, fmt, idem, stream=False, text="hi", timeout=15):
    headers = {**auth(fmt, gw.key), "idempotency-key": idem}
    return httpx.post(gw.url + path_for(fmt, stream), headers=headers, json=body_for(fmt, stream, text),
                      timeout=timeout)


@pytest.mark.parametrize("fmt", ["openai", "anthropic", "gemini"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_repeated_key_is_replayed_byte_for_byte_with_one_upstream_call(gateway, fmt, stream):
    # spec: I2
    before = gateway.calls(fmt)
    first = send(gateway, fmt, f"k-{fmt}-{stream}", stream)
    assert first.status_code == 200, first.text
    if stream:
        assert first.headers["content-type"].startswith("text/event-stream")
        assert b"data:" in first.content
    replays = [send(gateway, fmt, f"k-{fmt}-{stream}", stream) for _ in range(2)]
    for r in replays:
        assert r.status_code == 200
        assert r.content == first.content, "the stored copy, byte for byte"
        assert r.headers["content-type"] == first.headers["content-type"]
        assert r.headers["x-spillway-idempotent-replay"] == "true"
        assert r.headers["x-spillway-replay-of"] == first.headers["x-request-id"]
    assert gateway.calls(fmt) == before + 1, "one upstream call for three requests"
    # On the record: the original with its key, each replay naming it, none billed.
    row = gateway.request_row(first.headers["x-request-id"])
    assert row["idempotency_key"] == f"k-{fmt}-{stream}"
    for r in replays:
        rep = gateway.request_row(r.headers["x-request-id"])
        assert (rep["state"], rep["replay_of"], rep["attempts"], rep["cost_usd"]) == (
            "done", first.headers["x-request-id"], 0, 0.0)
        assert rep["idempotency_key"] is None


@pytest.mark.parametrize("fmt", ["openai", "anthropic", "gemini"])
def test_the_same_key_with_another_body_is_422_in_the_callers_format(gateway, fmt):
    # spec: I2, A3
    assert send(gateway, fmt, "order-9").status_code == 200
    r = send(gateway, fmt, "order-9", text="a different prompt")
    assert r.status_code == 422
    assert r.headers["x-should-retry"] == "false"
    _, message = error_of(fmt, r.json())
    assert "Idempotency-Key" in message and "conflict" in message
    assert "a different prompt" not in message


def test_the_openai_sdk_gets_the_same_completion_back(gateway):
    # spec: I2
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=gateway.key, max_retries=0)
    before = gateway.calls("openai")
    made = [client.chat.completions.create(model=MODELS["openai"], messages=[{"role": "user", "content": "hi"}],
                                           extra_headers={"Idempotency-Key": "sdk-1"}) for _ in range(3)]
    assert len({m.id for m in made}) == 1
    assert gateway.calls("openai") == before + 1
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=MODELS["openai"], messages=[{"role": "user", "content": "other"}],
                                       extra_headers={"Idempotency-Key": "sdk-1"})


def test_concurrent_requests_with_one_key_make_exactly_one_upstream_call(gateway):
    # spec: I2
    ch = gateway.channel("openai")
    gateway.sim.set(ch, latency_ms=600)
    try:
        before = gateway.calls("openai")
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda _: send(gateway, "openai", "pay-1"), range(16)))
        codes = sorted(r.status_code for r in answers)
        assert set(codes) <= {200, 409} and 409 in codes, codes
        assert gateway.calls("openai") == before + 1, codes
        assert len({r.content for r in answers if r.status_code == 200}) == 1
        busy = next(r for r in answers if r.status_code == 409)
        assert "still in progress" in busy.json()["error"]["message"]
    finally:
        gateway.sim.set(ch)
    assert send(gateway, "openai", "pay-1").status_code == 200


def _post_raw(url, fmt, key, idem, client_id, timeout):
    req = urllib.request.Request(url + path(fmt), data=json.dumps(body_for(fmt, False, f"task {idem}")).encode(),
                                 method="POST", headers={"content-type": "application/json", **auth(fmt, key),
                                                         "idempotency-key": idem, "x-client-request-id": client_id})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()
    except Exception as e:  # the gateway was killed under it
        return None, {}, str(e).encode()


def test_kill_9_with_hundreds_in_flight_leaves_them_unknown_and_nothing_runs_twice(tmp_path, sim):
    # spec: I4, I2, L3, I3, N1
    n = 200
    gw = start_gateway(tmp_path, sim, max_concurrency=256)
    ch = gw.channel("openai")
    sim.set(ch, latency_ms=30_000)
    pool = ThreadPoolExecutor(n)
    try:
        futures = [pool.submit(_post_raw, gw.url, "openai", gw.key, f"job-{i}", f"client-{i}", 40)
                   for i in range(n)]
        assert wait_for(lambda: sim.stats(ch)["in_flight"] == n, timeout=30), sim.stats(ch)
        gw.proc.send_signal(signal.SIGKILL)
        gw.proc.wait(10)
        for f in futures:
            assert f.result(timeout=30)[0] is None, "no answer came from a killed gateway"
    finally:
        sim.set(ch)
        pool.shutdown(wait=False)

    con = sqlite3.connect(str(gw.ledger), timeout=5)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    rows = con.execute("SELECT state, idempotency_key FROM requests WHERE client_request_id LIKE 'client-%'").fetchall()
    con.close()
    assert len(rows) == n, "none lost: every call that went out is on record"
    assert {r[0] for r in rows} == {"calling_api"}

    (tmp_path / "gateway.yaml").rename(tmp_path / "before-crash.yaml")
    gw2 = start_gateway(tmp_path, sim, max_concurrency=256)
    try:
        with gw2.db() as con:
            states = con.execute(
                "SELECT state, error_class, COUNT(*) FROM requests WHERE client_request_id LIKE 'client-%' "
                "GROUP BY 1, 2").fetchall()
        assert [tuple(s) for s in states] == [("unknown", "interrupted", n)], "none silently failed"
        inbox = gw2.admin("GET", "/admin/v1/unknowns?limit=500")
        assert len(inbox) == n
        # Each with its evidence: the channel it was calling and since when (the attempt in
        # flight has no row of its own until it ends; earlier attempts would be listed).
        assert all(i["request"]["channel"] == ch and i["request"]["admitted_at"] and i["request"]["attempts"] == 1
                   for i in inbox)
        figures = gw2.admin("GET", "/admin/v1/ledger")
        assert figures["unknown"] == n and figures["duplicates"] == 0

        # The clients retry with their keys: nothing is sent again.
        with ThreadPoolExecutor(32) as p:
            again = list(p.map(lambda i: _post_raw(gw2.url, "openai", gw2.key, f"job-{i}", f"retry-{i}", 10),
                               range(n)))
        assert {a[0] for a in again} == {409}
        assert all(a[1].get("x-should-retry") == "false" and b"`unknown`" in a[2] for a in again)
        assert gw2.calls("openai") == 0

        # An owner reconciles two: one never ran (its key may run once more), one did.
        first = {i["request"]["idempotency_key"]: i["request"]["id"] for i in inbox}
        gw2.admin("POST", f"/admin/v1/requests/{first['job-0']}/reconcile",
                  {"outcome": "confirmed_not_executed", "actor": "ops-ana", "reason": "not in the provider's logs"})
        gw2.admin("POST", f"/admin/v1/requests/{first['job-1']}/reconcile",
                  {"outcome": "confirmed_done", "result_id": "chatcmpl-77", "actor": "ops-ana",
                   "reason": "the provider's dashboard shows it"})
        ran = _post_raw(gw2.url, "openai", gw2.key, "job-0", "after-0", 10)
        assert ran[0] == 200 and gw2.calls("openai") == 1
        assert _post_raw(gw2.url, "openai", gw2.key, "job-0", "after-0b", 10)[0] == 200
        done = _post_raw(gw2.url, "openai", gw2.key, "job-1", "after-1", 10)
        assert done[0] == 409 and b"chatcmpl-77" in done[2]
        assert gw2.calls("openai") == 1, "nothing executed twice"
        audit = gw2.admin("GET", "/admin/v1/audit?kind=request")
        assert {(a["actor"], a["action"]) for a in audit} == {
            ("ops-ana", "unknown->confirmed_not_executed"), ("ops-ana", "unknown->confirmed_done")}
        assert gw2.admin("GET", "/admin/v1/ledger")["unknown"] == n - 2
        # The rest at once, as an owner would after an outage the provider's logs explain,
        # with a stale id in the selection refused by name.
        rest = [i["request"]["id"] for i in inbox if i["request"]["id"] not in (first["job-0"], first["job-1"])]
        bulk = gw2.admin("POST", "/admin/v1/unknowns/reconcile",
                         {"ids": rest + [first["job-1"]], "actor": "ops-ana", "reason": "provider logs show none"})
        assert bulk["reconciled"] == n - 2
        assert [r["id"] for r in bulk["refused"]] == [first["job-1"]] and "not unknown" in bulk["refused"][0]["error"]
        assert gw2.admin("GET", "/admin/v1/unknowns") == []
        assert len(gw2.admin("GET", "/admin/v1/audit?kind=request&limit=1000")) == n
    finally:
        stop(gw2.proc)
    con = sqlite3.connect(str(gw.ledger), timeout=5)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()


def test_prompts_are_hashes_unless_the_config_keeps_them(gateway_factory):
    # spec: I6
    plain = gateway_factory()
    r = httpx.post(plain.url + path("openai"), headers=auth("openai", plain.key), json=body_for("openai", False))
    row = plain.request_row(r.headers["x-request-id"])
    assert len(row["body_sha256"]) == 64
    with plain.db() as con:
        assert con.execute("SELECT COUNT(*) FROM payloads").fetchone()[0] == 0
        assert b"hi" not in b"".join(str(v).encode() for v in dict(row).values())
    kept = gateway_factory(extra_yaml="store_prompts: true")
    sent = json.dumps(body_for("openai", False, "keep me")).encode()
    r = httpx.post(kept.url + path("openai"), content=sent,
                   headers={**auth("openai", kept.key), "content-type": "application/json"})
    rid = r.headers["x-request-id"]
    kept.request_row(rid)
    assert wait_for(lambda: kept.db().execute("SELECT request_body FROM payloads WHERE request_id = ?",
                                              (rid,)).fetchone() is not None)
    with kept.db() as con:
        assert con.execute("SELECT request_body FROM payloads WHERE request_id = ?", (rid,)).fetchone()[0] == sent


def test_ledger_prune_refuses_a_running_gateways_ledger_and_prunes_a_stopped_one(tmp_path, sim):
    # spec: I6
    gw = start_gateway(tmp_path, sim, extra_yaml="idempotency:\n  window_hours: 1")
    assert send(gw, "openai", "keep-1").status_code == 200
    gw.request_row(send(gw, "openai", "keep-1").headers["x-request-id"])
    busy = subprocess.run([str(BIN), "ledger", "prune", "--ledger", str(gw.ledger)], capture_output=True, text=True,
                          env=clean_env(), timeout=30)
    assert busy.returncode != 0
    assert "in use by another Spillway instance" in busy.stderr and "/admin/v1/ledger/prune" in busy.stderr
    # While it runs, the console's prune is the way (audited).
    report = gw.admin("POST", "/admin/v1/ledger/prune", {"actor": "ops", "reason": "weekly", "older_than_days": 30})
    assert report["requests"] == 0 and report["bytes_before"] > 0
    assert gw.admin("GET", "/admin/v1/audit?kind=ledger")[0]["actor"] == "ops"
    stop(gw.proc)
    # Stopped: the CLI prunes it. The copy is made to have expired; the requests are from today.
    with sqlite3.connect(str(gw.ledger)) as con:
        con.execute("UPDATE payloads SET expires_at = 0")
    done = subprocess.run([str(BIN), "ledger", "prune", "--ledger", str(gw.ledger), "--older-than-days", "1"],
                          capture_output=True, text=True, env=clean_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    assert "removed 1 expired response copies, 0 finished requests" in done.stdout, done.stdout
    with sqlite3.connect(str(gw.ledger)) as con:
        assert con.execute("SELECT COUNT(*) FROM payloads").fetchone()[0] == 0
        assert con.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 2, "today's requests stay"


def test_a_stream_its_client_left_is_read_to_the_end_and_replayed_whole(gateway):
    # spec: I2, H2
    ch = gateway.channel("openai")
    gateway.sim.set(ch, tokens_per_second=40, output_tokens=24)  # about 0.6 s of stream
    try:
        before = gateway.calls("openai")
        headers = {**auth("openai", gateway.key), "idempotency-key": "left-1"}
        with httpx.stream("POST", gateway.url + path("openai"), headers=headers, json=body_for("openai", True),
                          timeout=10) as r:
            assert r.status_code == 200
            first = next(r.iter_raw())
            rid = r.headers["x-request-id"]
        # The client left after its first bytes. Its repeat waits while the rest is read,
        # then gets the whole stream, and the provider was called once.
        assert wait_for(lambda: send(gateway, "openai", "left-1", True).status_code == 200, timeout=10)
        full = send(gateway, "openai", "left-1", True)
        assert full.content.startswith(first) and b"data: [DONE]" in full.content
        assert gateway.calls("openai") == before + 1
        assert gateway.request_row(rid)["state"] == "done"
    finally:
        gateway.sim.set(ch)
