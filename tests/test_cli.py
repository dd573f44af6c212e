"""The `spillway` command as a user meets it: `check`, and `serve` with no config at all."""

import concurrent.futures
import json
import sqlite3
import subprocess
import time

import openai

import httpx

from conftest import BIN, clean_env, cores, read_line, runtime_workers, start_gateway, stop


def test_check_reports_file_line_and_field(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(
        "channels:\n"
        "  - name: a\n"
        "    format: openia\n"
        "    base_url: http://127.0.0.1:1\n"
        "    models: [m]\n"
        "    max_concurency: 3\n")
    r = subprocess.run([str(BIN), "check", "--config", str(cfg)], capture_output=True, text=True, env=clean_env())
    assert r.returncode != 0
    assert f"{cfg}:6:5: " in r.stderr and "max_concurency" in r.stderr, r.stderr
    cfg.write_text(cfg.read_text().replace("    max_concurency: 3\n", ""))
    r = subprocess.run([str(BIN), "check", "--config", str(cfg)], capture_output=True, text=True, env=clean_env())
    assert r.returncode != 0
    assert f"{cfg}:3:13: channels[0].format: unknown format `openia`" in r.stderr, r.stderr
    cfg.write_text(cfg.read_text().replace("openia", "openai"))
    r = subprocess.run([str(BIN), "check", "--config", str(cfg)], capture_output=True, text=True, env=clean_env())
    assert r.returncode == 0, r.stderr
    assert "ok (1 channels" in r.stdout


def test_missing_env_secret_is_an_error_not_a_default(tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        "channels:\n  - {name: a, format: openai, base_url: 'http://127.0.0.1:1', models: [m], api_key_env: NOT_SET_ANYWHERE}\n")
    r = subprocess.run([str(BIN), "serve", "--config", str(cfg)], capture_output=True, text=True, env=clean_env(), timeout=20)
    assert r.returncode != 0
    assert "NOT_SET_ANYWHERE is not set" in r.stderr


def test_a_failed_command_says_what_is_wrong_once_and_without_a_backtrace(tmp_path):
    # A developer's shell often has RUST_BACKTRACE set; an operator must still see one
    # clear message (file, line, field), not a "Caused by" echo and a symbolised stack.
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        "channels:\n  - {name: a, format: openai, base_url: 'http://127.0.0.1:1', models: [m], api_key_env: NOT_SET_ANYWHERE}\n")
    for command in (["check", "--config", str(cfg)], ["serve", "--config", str(cfg)]):
        r = subprocess.run([str(BIN), *command], capture_output=True, text=True,
                           env=clean_env(RUST_BACKTRACE="1", RUST_LIB_BACKTRACE="1"), timeout=20)
        assert r.returncode == 1, r.stderr
        errors = [line for line in r.stderr.splitlines() if "NOT_SET_ANYWHERE is not set" in line]
        assert len(errors) == 1, r.stderr
        assert f"{cfg}:2:" in errors[0] and "channels[0].api_key_env" in errors[0], r.stderr
        assert "backtrace" not in r.stderr.lower() and "Caused by" not in r.stderr, r.stderr
        assert "\nerror: " in "\n" + r.stderr, r.stderr
    r = subprocess.run([str(BIN), "check", "--config", str(tmp_path / "missing.yaml")], capture_output=True, text=True,
                       env=clean_env(RUST_BACKTRACE="1"), timeout=20)
    assert r.returncode == 1
    assert r.stderr.count("missing.yaml") == 1 and "No such file" in r.stderr, r.stderr


def test_embedded_default_with_demo_traffic(tmp_path):
    # spec: P1
    data = tmp_path / "data"
    proc = subprocess.Popen([str(BIN), "serve", "--listen", "127.0.0.1:0", "--demo-traffic", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env(SPILLWAY_DATA_DIR=str(data)))
    try:
        url = read_line(proc, "spillway listening on ").split()[-1]
        assert url.startswith("http://127.0.0.1:")
        key = read_line(proc, "demo key (shown once): ").split()[-1]
        c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        assert c.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]).choices
        ledger = data / "ledger.db"
        deadline = time.monotonic() + 10
        formats = set()
        while time.monotonic() < deadline and len(formats) < 3:
            with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as con:
                formats = {r[0] for r in con.execute("SELECT DISTINCT format FROM requests WHERE state = 'done'")}
            time.sleep(0.2)
        assert formats == {"openai", "anthropic", "gemini"}, "demo traffic covers every format"
    finally:
        stop(proc)
    assert proc.returncode == 0
    assert key.encode() not in proc.stderr.read(), "P3: the demo key is printed once on stdout, never logged"




def _answers(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.key, max_retries=0)
    return client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]).choices


def _thp_enabled(pid):
    """`THP_enabled` of a process's status: "1", "0", or None where the kernel has no THP."""
    with open(f"/proc/{pid}/status") as f:
        return next((line.split()[1] for line in f if line.startswith("THP_enabled:")), None)


def test_serve_leaves_a_core_to_the_ledger_and_takes_workers_from_the_command_line(tmp_path, sim):
    # Default with a SQLite ledger: one request thread per core but one (the ledger's
    # writer thread has its own), never none.
    (tmp_path / "a").mkdir()
    gw = start_gateway(tmp_path / "a", sim)
    try:
        assert runtime_workers(gw.url) == max(1, cores() - 1)
        assert _answers(gw)
        # The gateway turned transparent huge pages off for itself: where the kernel has
        # them `always` on, its allocator's 2 MiB-aligned arenas would be backed by them
        # (idle RSS 19 -> 34 MiB). The flag is inherited, so it proves something only
        # when this test's own process still has them on.
        if _thp_enabled("self") == "1":
            assert _thp_enabled(gw.proc.pid) == "0"
    finally:
        stop(gw.proc)
    # Asked for: three, whatever the cores.
    (tmp_path / "b").mkdir()
    gw = start_gateway(tmp_path / "b", sim, args=("--workers", "3"))
    try:
        assert runtime_workers(gw.url) == 3
        assert _answers(gw)
    finally:
        stop(gw.proc)
    # None is refused before anything starts, naming the option.
    r = subprocess.run([str(BIN), "serve", "--workers", "0"], capture_output=True, text=True,
                       env=clean_env(SPILLWAY_DATA_DIR=str(tmp_path / "c")), timeout=20)
    assert r.returncode == 2, r.stderr
    assert "--workers" in r.stderr and "'0'" in r.stderr, r.stderr


def test_a_large_body_is_parsed_off_the_request_threads_and_others_are_answered_meanwhile(tmp_path, sim):
    # With one request thread, a 14 MiB prompt's hash and parse (tens of milliseconds in a
    # release build, about a second in this debug one) must not hold up a small request
    # that arrives while they run.
    gw = start_gateway(tmp_path, sim, args=("--workers", "1"), extra_yaml="max_body_bytes: 16777216")
    try:
        assert runtime_workers(gw.url) == 1
        # Many small messages: a parse that builds hundreds of thousands of values.
        big = json.dumps({"model": "gpt-4o-mini", "messages": [
            {"role": "user", "content": "w"}] * (14 * 1024 * 1024 // 32)}, separators=(",", ":")).encode()
        small = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}).encode()
        headers = {"authorization": f"Bearer {gw.key}", "content-type": "application/json"}
        with httpx.Client(timeout=60) as c:
            assert c.post(gw.url + "/v1/chat/completions", content=small, headers=headers).status_code == 200
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                large = pool.submit(c.post, gw.url + "/v1/chat/completions", content=big, headers=headers)
                answered = []
                deadline = time.monotonic() + 120
                while not large.done() and time.monotonic() < deadline:
                    t = time.monotonic()
                    assert c.post(gw.url + "/v1/chat/completions", content=small, headers=headers).status_code == 200
                    answered.append(time.monotonic() - t)
                assert large.result(timeout=5).status_code == 200
        # Small requests were answered all along: none waited for the large one's parse,
        # which held one for about two seconds here when it ran on the request thread.
        assert len(answered) >= 3, answered
        assert max(answered) < 0.75, sorted(answered)[-5:]
    finally:
        stop(gw.proc)
