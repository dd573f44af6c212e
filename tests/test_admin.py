"""The admin API as the console uses it: token required (P2), live stream, alerts (E2)."""

import json
import time

import httpx

from conftest import MODELS


def admin(gw, path, token=None, **kw):
    return httpx.get(gw.url + path, headers={"authorization": f"Bearer {token or gw.admin_token}"}, **kw)


def test_admin_api_needs_the_token(gateway):
    # spec: P2
    assert httpx.get(gateway.url + "/admin/v1/overview").status_code == 401
    r = admin(gateway, "/admin/v1/overview", token="swa_wrong")
    assert r.status_code == 401 and r.json()["error"] == "Wrong admin token."
    assert gateway.admin_token not in r.text
    r = admin(gateway, "/admin/v1/overview")
    assert r.status_code == 200
    assert {c["name"] for c in r.json()["channels"]} == set(gateway.channels.values())
    assert all("sk-upstream" not in json.dumps(c) for c in r.json()["channels"]), "P3: no upstream key in the console"


def test_search_and_detail_find_a_request(gateway):
    r = httpx.post(gateway.url + "/v1/chat/completions", headers={"authorization": f"Bearer {gateway.key}", "x-client-request-id": "find-me"},
                   json={"model": MODELS["openai"], "messages": [{"role": "user", "content": "hi"}]})
    rid = r.headers["x-request-id"]
    gateway.request_row(rid)
    page = admin(gateway, "/admin/v1/requests", params={"q": "find-me"}).json()
    assert [i["id"] for i in page["items"]] == [rid]
    detail = admin(gateway, f"/admin/v1/requests/{rid}").json()
    assert detail["request"]["channel"] == gateway.channel("openai")
    assert detail["attempts"][0]["error_class"] == "success"
    assert admin(gateway, "/admin/v1/requests/nope").status_code == 404


def test_a_rejected_channel_credential_raises_an_alert(gateway):
    # spec: E2, P3
    ch = gateway.channel("anthropic")
    gateway.sim.set(ch, fault={"kind": "status", "status": 401, "message": "invalid x-api-key sk-upstream-leak"})
    try:
        with httpx.stream("GET", gateway.url + "/admin/v1/events", headers={"authorization": f"Bearer {gateway.admin_token}"},
                          timeout=10) as events:
            lines = events.iter_lines()
            assert next(lines) == "event: overview"
            r = httpx.post(gateway.url + "/v1/messages", headers={"x-api-key": gateway.key},
                           json={"model": MODELS["anthropic"], "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 502
            assert "sk-upstream" not in r.text, "the provider's message (which may quote the key) stays out"
            assert "rejected the gateway's provider credential" in r.json()["error"]["message"]
            deadline = time.monotonic() + 8
            alert = None
            for line in lines:
                if line == "event: alert":
                    alert = json.loads(next(lines).removeprefix("data:").strip())
                    break
                assert time.monotonic() < deadline, "no alert within 8 s"
            assert alert["severity"] == "critical" and alert["subject"] == ch
            assert "rejected its provider credential" in alert["title"]
    finally:
        gateway.sim.set(ch)
    row = gateway.request_row(r.headers["x-request-id"])
    attempt = gateway.attempts(row["id"])[0]
    assert attempt["error_class"] == "auth" and attempt["message"] is None, "P3: nothing of the provider's auth message is kept"


def test_console_is_served_under_a_strict_csp_and_the_desktop_grants_no_ipc(gateway_factory, tmp_path):
    # spec: P5
    ui = tmp_path / "ui"
    ui.mkdir()
    (ui / "index.html").write_text("<!doctype html><title>console</title>")
    gw = gateway_factory(args=("--ui-dir", str(ui)))
    for path in ("/", "/ledger/some/client/route"):
        r = httpx.get(gw.url + path)
        assert r.status_code == 200 and "<title>console</title>" in r.text
        csp = r.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert "unsafe-eval" not in csp and "*" not in csp.replace("http://127.0.0.1:*", "")
    # Raw request lines, so no client library normalises the dot segments away before the
    # gateway's guard sees them.
    import socket
    from urllib.parse import urlparse
    u = urlparse(gw.url)
    (tmp_path / "secret.txt").write_text("root:x:0:0")
    for target in ("/%2e%2e/secret.txt", "/%2E%2E/%2e%2e/etc/passwd", "/../secret.txt", "/assets/..%2f..%2fsecret.txt",
                   "/.%2e/secret.txt"):
        with socket.create_connection((u.hostname, u.port), timeout=5) as s:
            s.sendall(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            got = b""
            while chunk := s.recv(65536):
                got += chunk
        status = int(got.split(b" ", 2)[1])
        assert status in (400, 404), (target, got[:200])
        assert b"root:" not in got, target
    # The desktop window loads that same console and is granted no IPC permission at all.
    from conftest import ROOT
    caps = json.loads((ROOT / "src-tauri" / "capabilities" / "main.json").read_text())
    assert caps["permissions"] == []
    conf = json.loads((ROOT / "src-tauri" / "tauri.conf.json").read_text())
    assert conf["app"]["withGlobalTauri"] is False
    assert "unsafe-eval" not in conf["app"]["security"]["csp"]
