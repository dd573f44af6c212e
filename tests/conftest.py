"""Black-box harness: the real `spillway` binary, the real simulator process, a real
SQLite ledger file, HTTP on 127.0.0.1 with OS-chosen ports.

Each test gets its own gateway (own config, own ledger) in front of one simulator shared
by the session; channel names carry a per-gateway prefix so tests never see each other's
simulated faults or call counts.
"""

import json
import os
import secrets
import select
import signal
import sqlite3
import subprocess
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.environ.get("SPILLWAY_BIN", ROOT / "target" / "debug" / "spillway"))
PROVIDER_ENV = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY")

MODELS = {"openai": "gpt-4o-mini", "anthropic": "claude-haiku-4-5", "gemini": "gemini-2.5-flash"}
# Served beside the chat model on the same channels (the simulator embeds any text).
EMBED_MODELS = {"openai": "text-embedding-3-small", "gemini": "gemini-embedding-001"}


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in PROVIDER_ENV and not k.startswith("SPILLWAY_")}
    env["SPILLWAY_LOG"] = "warn,spillway=info"
    env.update(extra)
    return env


def _line_from(proc, stream, match, timeout):
    """Reads `stream` (one of proc's pipes) a byte at a time until a whole line satisfies
    `match`; None after `timeout` seconds or at the end of the stream."""
    deadline = time.monotonic() + timeout
    buf = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], 0.2)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        ch = os.read(stream.fileno(), 1)
        if not ch:
            break
        if ch == b"\n":
            line = buf.decode(errors="replace")
            buf = b""
            if match(line):
                return line
        else:
            buf += ch
    return None


def read_line(proc, prefix, timeout=20.0):
    """Reads stdout lines until one starts with `prefix`; fails after `timeout` seconds."""
    line = _line_from(proc, proc.stdout, lambda l: l.startswith(prefix), timeout)
    if line is None:
        err = proc.stderr.read().decode() if proc.poll() is not None else ""
        raise AssertionError(f"no line starting {prefix!r} within {timeout}s; stderr: {err}")
    return line


def read_log(proc, needle, timeout=10.0):
    """Reads stderr (the log) until a line contains `needle`; fails after `timeout` seconds."""
    line = _line_from(proc, proc.stderr, lambda l: needle in l, timeout)
    assert line is not None, f"no log line with {needle!r} within {timeout}s"
    return line


def no_log_line(proc, needle, seconds):
    """Reads stderr (the log) for `seconds`; fails if a line contains `needle`, or if the
    process ended meanwhile (its log would then say nothing because it stopped)."""
    line = _line_from(proc, proc.stderr, lambda l: needle in l, seconds)
    assert line is None, f"log line with {needle!r}: {line}"
    assert proc.poll() is None, f"the process ended (exit {proc.returncode}) while its log was read"


def wait_for(pred, timeout=5.0):
    """Polls `pred` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def http_json(method, url, body=None, headers=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


class Sim:
    def __init__(self, url):
        self.url = url

    def set(self, channel, **behavior):
        return http_json("PUT", f"{self.url}/_control/channels/{channel}", behavior)

    def stats(self, channel):
        return http_json("GET", f"{self.url}/_control/channels/{channel}")["stats"]


@pytest.fixture(scope="session")
def sim():
    assert BIN.exists(), f"{BIN} is missing: run `make test` (it builds the binary first)"
    proc = subprocess.Popen([str(BIN), "sim", "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=clean_env())
    try:
        line = read_line(proc, "spillway-sim listening on ")
        yield Sim(line.split()[-1])
    finally:
        proc.terminate()
        proc.wait(timeout=10)


class Gateway:
    def __init__(self, proc, url, key, ledger, channels, sim, groups):
        self.proc = proc
        self.url = url
        self.key = key
        self.ledger = ledger
        self.channels = channels  # format -> first channel name on the simulator
        self.groups = groups  # format -> every channel name of the format's group
        self.sim = sim

    def channel(self, fmt):
        return self.channels[fmt]

    def db(self):
        con = sqlite3.connect(f"file:{self.ledger}?mode=ro", uri=True, timeout=5)
        con.row_factory = sqlite3.Row
        return con

    def request_row(self, request_id, until=lambda r: r["state"] not in ("received", "calling_api"), timeout=5.0):
        """The ledger row for `request_id` once `until` holds (writes are group-committed)."""
        deadline = time.monotonic() + timeout
        row = None
        while time.monotonic() < deadline:
            with self.db() as con:
                row = con.execute("SELECT * FROM requests WHERE id = ?", (request_id,)).fetchone()
            if row is not None and until(row):
                return row
            time.sleep(0.02)
        raise AssertionError(f"ledger row for {request_id}: {dict(row) if row else None}")

    def attempts(self, request_id):
        with self.db() as con:
            return con.execute("SELECT * FROM attempts WHERE request_id = ? ORDER BY attempt_no", (request_id,)).fetchall()

    def calls(self, fmt):
        return self.sim.stats(self.channel(fmt))["calls"]

    def group_calls(self, fmt):
        """Upstream calls per channel of the format's group, in config order."""
        return [self.sim.stats(c)["calls"] for c in self.groups[fmt]]

    def admin(self, method, path, body=None):
        return http_json(method, self.url + path, body, {"authorization": f"Bearer {self.admin_token}"})


def start_gateway(tmp_path, sim, extra_yaml="", channel_yaml="", args=(), group=1, max_concurrency=8, key_yaml="",
                  env=None, owner_yaml="    balance_usd: 100", extra_models=()):
    """A gateway with `group` channels per format (named `{prefix}-{fmt}`, `-2`, `-3`, …).
    Earlier channels of a group get a higher priority, so they are always tried first."""
    prefix = "t" + secrets.token_hex(4)
    key = "sk-test-" + secrets.token_hex(16)
    groups = {fmt: [f"{prefix}-{fmt}"] + [f"{prefix}-{fmt}-{i}" for i in range(2, group + 1)] for fmt in MODELS}
    channels = {fmt: names[0] for fmt, names in groups.items()}
    lines = ["listen: 127.0.0.1:0", f"ledger: sqlite://{tmp_path / 'ledger.db'}", extra_yaml, "channels:"]
    for fmt, names in groups.items():
        for i, name in enumerate(names):
            lines += [f"  - name: {name}", f"    format: {fmt}", f"    base_url: {sim.url}/{name}",
                      "    api_key_env: UPSTREAM_KEY", f"    models: [{', '.join([MODELS[fmt]] + ([EMBED_MODELS[fmt]] if fmt in EMBED_MODELS else []) + list(extra_models))}]",
                      f"    max_concurrency: {max_concurrency}", f"    priority: {len(names) - i}", channel_yaml]
    lines += ["keys:", "  - name: app", "    owner: team-a", "    secret_env: SPILLWAY_TEST_KEY", key_yaml,
              "owners:", "  - name: team-a", owner_yaml]
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text("\n".join(l for l in lines if l) + "\n")
    proc = subprocess.Popen([str(BIN), "serve", "--config", str(cfg), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=clean_env(SPILLWAY_TEST_KEY=key, UPSTREAM_KEY="sk-upstream-" + prefix,
                                          SPILLWAY_DATA_DIR=str(tmp_path / "data"), **(env or {})))
    line = read_line(proc, "spillway listening on ")
    gw = Gateway(proc, line.split()[-1], key, tmp_path / "ledger.db", channels, sim, groups)
    gw.admin_token = (tmp_path / "data" / "admin-token").read_text().strip()
    return gw


def stop(proc, timeout=15):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def gateway(tmp_path, sim):
    gw = start_gateway(tmp_path, sim)
    yield gw
    stop(gw.proc)


@pytest.fixture
def gateway_factory(tmp_path, sim):
    started = []

    def make(**kw):
        d = tmp_path / f"gw{len(started)}"
        d.mkdir()
        gw = start_gateway(d, sim, **kw)
        started.append(gw)
        return gw

    yield make
    for gw in started:
        stop(gw.proc)


def cores():
    """The cores the gateway's binary sees, as Rust's `available_parallelism` counts them:
    the CPUs this process may run on, capped by a cgroup v2 CPU quota."""
    n = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return n


def runtime_workers(url):
    """The gateway's request threads, as its /metrics reports them."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("spillway_runtime_workers "):
            return int(float(line.split()[1]))
    raise AssertionError("no spillway_runtime_workers in /metrics")
