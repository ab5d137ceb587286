"""``actorserve up --tls`` end to end (issue 21 item 2; docs/security.md), ONE stack start (tiny model):

* a chat request over HTTPS to the gateway, verified against the stack's CA (plain HTTP on that port
  gets no answer), the gateway's /metrics too (operator token);
* every NATS client connection of the stack is TLS (nats-server's /connz says its TLS version) and each
  actor logged in as its role; etcd answers only TLS clients with a certificate of the CA, and a role's
  certificate reaches only its prefixes (the worker cannot read tenants);
* secrets never appear in clear: the NATS passwords (internal and per role), the API key, the operator
  token and the private keys (PEM text) are looked for in ``/proc/<pid>/cmdline`` of every process of the
  stack, every log file, ``up``'s stderr, ``actorserve status --json`` (and its text form) and a dump of
  every etcd key and value. ``up``'s stdout prints the dev API key once, on purpose (the terminal of the
  operator who started it), so it is not scanned.

Cost: about 20-30 s on 2 cores (stack start with the tiny model), hence tests/cluster/ (ACTORSERVE_CLUSTER=1).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.engine_fixtures import write_tiny_llama_gguf

ROOT = Path(__file__).resolve().parents[2]


def _start_up(state: Path, gguf: str) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    cmd = [sys.executable, "-m", "control.ops.cli", "up", "--tls", "--state-dir", str(state), "--port", "0",
           "--model-file", gguf, "--model-name", "tiny", "--worker-args", "--kv-cache-bytes 8000000"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTORSERVE_")}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(state.parent / "up.stderr", "wb"), cwd=str(ROOT),
                         env=env, start_new_session=True, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in p.stdout:
            lines.append(line)
    t = threading.Thread(target=read, daemon=True)
    t.start()
    return p, lines, t


def _wait_ready(p: subprocess.Popen, lines: list[str], state: Path, timeout: float = 150.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in lines:
            if "actorserve is ready:" in line:
                return line.split("actorserve is ready:", 1)[1].split()[0].removesuffix("/v1")
        if p.poll() is not None:
            break
        time.sleep(0.2)
    err = (state.parent / "up.stderr").read_text(errors="replace")[-3000:]
    raise AssertionError(f"`up --tls` not ready (rc {p.poll()}):\n{err}")


def _secrets(state: Path) -> dict[str, str]:
    """name -> secret text that must appear nowhere we look."""
    out = {"dev api key": (state / "dev-api-key").read_text().strip(),
           "nats internal password": (state / "nats-internal-password").read_text().strip(),
           "operator token": (state / "operator-token").read_text().strip()}
    for role, pw in json.loads((state / "nats-role-passwords.json").read_text()).items():
        out[f"nats password of {role}"] = pw
    for key in sorted((state / "tls").glob("*-key.pem")):
        body = [ln for ln in key.read_text().splitlines() if ln and not ln.startswith("-----")]
        out[f"private key {key.name}"] = max(body, key=len)  # a base64 line of the key itself
    assert all(len(v) >= 16 for v in out.values()), "a secret is too short to search for"
    return out


async def _etcd_dump(etcd_url: str, tls_dir: Path) -> tuple[str, str | None]:
    """(every key and value as text, error of the worker certificate reading tenants or None)."""
    from bus.tls import TlsFiles
    from control.state.registry import Registry

    async with Registry.connect(etcd_url, tls=TlsFiles.in_dir(tls_dir, "root")) as reg:
        resp = await reg.client.get_prefix(b"/")
        dump = "\n".join(f"{kv.key.decode()} = {kv.value.decode(errors='replace')}" for kv in resp)
    denied = None
    async with Registry.connect(etcd_url, tls=TlsFiles.in_dir(tls_dir, "worker")) as reg:
        try:
            await reg.list_tenants()
        except Exception as e:  # permission denied
            denied = str(e)
    return dump, denied


def test_up_tls_end_to_end_and_no_secret_in_clear(tmp_path):
    gguf = str(tmp_path / "tiny.gguf")
    write_tiny_llama_gguf(gguf)
    state = tmp_path / "state"
    state.mkdir()
    p, lines, reader = _start_up(state, gguf)
    try:
        url = _wait_ready(p, lines, state)
        assert url.startswith("https://")
        tls_dir = state / "tls"
        ca = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
        key = (state / "dev-api-key").read_text().strip()
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        with httpx.Client(verify=ca, timeout=30) as c:
            r = c.post(f"{url}/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
            token = (state / "operator-token").read_text().strip()
            m = c.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"})
            assert m.status_code == 200
        with pytest.raises(httpx.HTTPError):  # the port speaks TLS only
            httpx.get(url.replace("https://", "http://") + "/readyz", timeout=3)
        with pytest.raises(httpx.HTTPError):  # and its certificate is not trusted without the CA
            httpx.get(url + "/readyz", timeout=3)

        endpoints = json.loads((state / "endpoints.json").read_text())
        assert endpoints["etcd_url"].startswith("https://") and endpoints["nats_url"].startswith("tls://")
        assert endpoints["tls"]["ca"] == str((tls_dir / "ca.pem").resolve())
        pids = json.loads((state / "pids.json").read_text())
        monitor = json.loads((state / "nats.conf").read_text().split("http: ", 1)[1].split("\n", 1)[0])
        connz = httpx.get(f"http://{monitor}/connz?auth=1", timeout=5).json()["connections"]
        assert connz and all(c.get("tls_version") for c in connz), [(c.get("name"), c.get("tls_version"))
                                                                    for c in connz]
        users = {c.get("authorized_user") for c in connz}
        assert {"actorserve-gateway", "actorserve-worker", "actorserve-scheduler"} <= users

        dump, denied = asyncio.run(_etcd_dump(endpoints["etcd_url"], tls_dir))
        assert "/actorserve/tenants/dev" in dump and "/actorserve/models/tiny/versions/1" in dump
        assert denied is not None and "permission denied" in denied
        plain = subprocess.run([sys.executable, "-c", "import urllib.request,sys; urllib.request.urlopen("
                                f"'{endpoints['etcd_url'].replace('https', 'http')}/health', timeout=3)"],
                               capture_output=True, timeout=30)
        assert plain.returncode != 0  # no plain-HTTP client port

        env = {k: v for k, v in os.environ.items() if not k.startswith("ACTORSERVE_")}
        status = {}
        for form in ("--json", None):
            argv = [sys.executable, "-m", "control.ops.cli", "status", "--state-dir", str(state)]
            out = subprocess.run(argv + ([form] if form else []), capture_output=True, text=True, timeout=60,
                                 cwd=str(ROOT), env=env)
            assert out.returncode == 0, out.stderr
            status[f"status {form or 'text'}"] = out.stdout + out.stderr
        assert json.loads(out_json(status))["endpoints"]["etcd_url"].startswith("https://")

        texts: dict[str, str] = {**status, "etcd dump": dump,
                                 "up stderr": (tmp_path / "up.stderr").read_text(errors="replace")}
        for log in sorted((state / "logs").glob("*.log")):
            texts[f"log {log.name}"] = log.read_text(errors="replace")
        alive = 0
        for name, pid in pids.items():
            if not isinstance(pid, int):
                continue  # "stopped": {...}
            try:
                texts[f"argv of {name}"] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                alive += 1
            except OSError:
                pass
        assert alive >= 8  # supervisor, nats, etcd and the actors
        secrets = _secrets(state)
        # the search strings are right: each is found where it is meant to be (0600 files of the state dir)
        sources = (state / "nats.conf").read_text() + (state / "dev-api-key").read_text() + \
            (state / "operator-token").read_text() + "".join(k.read_text() for k in tls_dir.glob("*-key.pem"))
        assert [w for w, sec in secrets.items() if sec not in sources] == []
        leaks = [(what, where) for what, secret in secrets.items() for where, text in texts.items()
                 if secret in text]
        assert not leaks, f"secrets in clear: {leaks}"
        assert not any("PRIVATE KEY" in t for t in texts.values())
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        reader.join(5)


def out_json(status: dict[str, str]) -> str:
    """The JSON document of ``status --json`` (stdout before any stderr line)."""
    text = status["status --json"]
    return text[: text.rindex("}") + 1]
