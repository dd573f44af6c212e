"""Start and stop as an operator meets them: SIGTERM with a console open drains and exits
within the drain deadline with every request in the ledger; a second signal exits at
once; a second instance on the same ledger is refused before it touches a row; the
console ships inside the binary."""

import os
import shutil
import signal
import subprocess
import threading
import time

import httpx

from conftest import BIN, clean_env, read_line, read_log, start_gateway, stop, wait_for
from wire import BODIES, post


def rows_in(gw, state):
    with gw.db() as con:
        return con.execute("SELECT * FROM requests WHERE state = ?", (state,)).fetchall()


def background(fn):
    out = {}

    def run():
        try:
            out["result"] = fn()
        except Exception as e:  # noqa: BLE001 - the test reads what happened
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_sigterm_with_a_console_stream_open_drains_and_records_everything(gateway_factory):
    # spec: I3, I4
    gw = gateway_factory(extra_yaml="server: {drain_timeout_ms: 2500}")
    slow, stuck = gw.channel("anthropic"), gw.channel("gemini")
    gw.sim.set(slow, latency_ms=800)
    gw.sim.set(stuck, fault={"kind": "hang", "ms": 60_000})
    events = []

    def console():
        with httpx.stream("GET", gw.url + "/admin/v1/events", headers={"authorization": f"Bearer {gw.admin_token}"},
                          timeout=30) as r:
            for line in r.iter_lines():
                events.append(line)
        return "ended"

    tc, console_out = background(console)
    assert wait_for(lambda: "event: overview" in events, 5)
    ts, slow_out = background(lambda: post(gw, "anthropic", gw.key, json=BODIES["anthropic"], timeout=30))
    tk, stuck_out = background(lambda: post(gw, "gemini", gw.key, json=BODIES["gemini"], timeout=30))
    assert wait_for(lambda: len(rows_in(gw, "calling_api")) == 2, 5)
    t = time.monotonic()
    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(10) == 0
    took = time.monotonic() - t
    assert 2.4 <= took < 6.0, f"exits at the drain deadline, not before it nor long after ({took:.1f} s)"
    for th in (tc, ts, tk):
        th.join(5)
    assert console_out.get("result") == "ended", "the console's event stream was ended, not left hanging"
    # The slow request finished inside the drain; the stuck one was cut and answered 503.
    assert slow_out["result"].status_code == 200
    assert stuck_out.get("result") is not None and stuck_out["result"].status_code == 503
    assert rows_in(gw, "calling_api") == [], "every request is in the ledger in a final state"
    slow_row = gw.request_row(slow_out["result"].headers["x-request-id"])
    stuck_row = gw.request_row(stuck_out["result"].headers["x-request-id"])
    assert slow_row["state"] == "done"
    assert (stuck_row["state"], stuck_row["error_class"]) == ("unknown", "interrupted"), \
        "an upstream call cut mid-flight is unknown, never silently failed"
    gw.sim.set(slow)
    gw.sim.set(stuck)


def test_a_second_signal_exits_at_once(gateway_factory):
    gw = gateway_factory(extra_yaml="server: {drain_timeout_ms: 30000}")
    ch = gw.channel("openai")
    gw.sim.set(ch, fault={"kind": "hang", "ms": 60_000})
    t1, out = background(lambda: post(gw, "openai", gw.key, json=BODIES["openai"], timeout=30))
    assert wait_for(lambda: len(rows_in(gw, "calling_api")) == 1, 5)
    gw.proc.send_signal(signal.SIGINT)
    # The first signal drains (the request is still running)...
    read_log(gw.proc, "shutting down")
    assert gw.proc.poll() is None
    t = time.monotonic()
    gw.proc.send_signal(signal.SIGINT)
    assert gw.proc.wait(10) == 0
    assert time.monotonic() - t < 3.0, "the second signal does not wait for the drain"
    t1.join(5)
    row = rows_in(gw, "unknown")
    assert len(row) == 1 and row[0]["error_class"] == "interrupted"
    gw.sim.set(ch)


def test_a_second_instance_on_the_same_ledger_is_refused(tmp_path, sim):
    (tmp_path / "a").mkdir()
    first = start_gateway(tmp_path / "a", sim, extra_yaml="server: {drain_timeout_ms: 1000}")
    try:
        ch = first.channel("openai")
        # A call that stays in flight for as long as the test needs it to.
        sim.set(ch, fault={"kind": "hang", "ms": 60_000})
        t, out = background(lambda: post(first, "openai", first.key, json=BODIES["openai"], timeout=30))
        assert wait_for(lambda: len(rows_in(first, "calling_api")) == 1, 5)
        second = subprocess.run([str(BIN), "serve", "--listen", "127.0.0.1:0", "--ledger", str(first.ledger)],
                                capture_output=True, text=True, timeout=20,
                                env=clean_env(SPILLWAY_DATA_DIR=str(tmp_path / "b")))
        assert second.returncode != 0
        assert "in use by another Spillway instance" in second.stderr, second.stderr
        assert f"pid {first.proc.pid}" in second.stderr, second.stderr
        # It touched nothing: the running instance's in-flight row did not become unknown.
        assert len(rows_in(first, "calling_api")) == 1
        sim.set(ch)
    finally:
        stop(first.proc)
    # The first instance's own shutdown is what ended the call (cut after its drain).
    t.join(10)
    assert out["result"].status_code == 503
    row = first.request_row(out["result"].headers["x-request-id"])
    assert (row["state"], row["error_class"]) == ("unknown", "interrupted")


def test_the_console_ships_inside_the_binary(tmp_path):
    # spec: P5
    home = tmp_path / "elsewhere"
    home.mkdir()
    binary = home / "spillway"
    shutil.copy(BIN, binary)
    proc = subprocess.Popen([str(binary), "serve", "--listen", "127.0.0.1:0"], cwd=home,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=clean_env(SPILLWAY_DATA_DIR=str(home / "data")))
    try:
        url = read_line(proc, "spillway listening on ").split()[-1]
        assert read_line(proc, "console: ").startswith(f"console: {url}/")
        r = httpx.get(url + "/")
        assert r.status_code == 200 and '<div id="root">' in r.text
        assert "default-src 'self'" in r.headers["content-security-policy"]
        script = r.text.split('src="', 1)[1].split('"', 1)[0]
        js = httpx.get(url + script)
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert httpx.get(url + "/assets/missing-1234.js").status_code == 404
        assert httpx.get(url + "/ledger/some/route").text == r.text, "client-side routes are the page"
    finally:
        stop(proc)
    assert proc.returncode == 0
    assert not os.path.exists(home / "ui"), "nothing was read from a source tree"
