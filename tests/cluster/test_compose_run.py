"""docker-compose.yml run as local processes (issue 21 item 3): every service's own command and environment,
service names resolved to 127.0.0.1 and container ports moved to free loopback ports
(deploy/compose/local_stack.py), then one chat request through the gateway with the key the init printed.

Costs one stack start (~30 s; 75 s on a 2-core machine loaded by other tests: nats-server, etcd, the init's three CLI calls,
six actors, the worker loading SmolLM2-135M). Collected only with ACTORSERVE_CLUSTER=1 (`make cluster-test`).
Stops only the processes it started (their recorded process groups).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

if os.environ.get("ACTORSERVE_CLUSTER") != "1":
    pytest.skip("stack start (~30 s): runs with ACTORSERVE_CLUSTER=1 (make cluster-test)", allow_module_level=True)

pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("actorserve_local_stack", ROOT / "deploy" / "compose" / "local_stack.py")
local_stack = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(local_stack)

ROLE_USERS = {"actorserve-gateway", "actorserve-validator", "actorserve-scheduler", "actorserve-worker",
              "actorserve-jobs", "actorserve-control"}
MODEL = "smollm2-135m-instruct"


def _env_file() -> dict[str, str]:
    out = subprocess.run(["sh", str(ROOT / "deploy" / "compose" / "make-env.sh")], capture_output=True, text=True,
                         check=True, timeout=10).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _http(url: str, body: dict | None = None, key: str | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (loopback)
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode(errors="replace")}


def _http_status(url: str, token: str | None = None) -> int:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 (loopback)
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def _wait_ready(stack, url: str, deadline: float) -> None:
    last = None
    while time.monotonic() < deadline:
        dead = {n: p.returncode for n, p in stack.procs.items() if n != "init" and p.poll() is not None}
        assert not dead, f"services exited: {dead}\n" + "\n".join(
            f"--- {n}\n{stack.output(n)[-3000:]}" for n in dead)
        try:
            last = _http(f"{url}/readyz", timeout=3)
            if last[0] == 200:
                return
        except OSError as e:
            last = e
        time.sleep(0.5)
    pytest.fail(f"gateway not ready: {last}\n--- gateway\n{stack.output('gateway')[-3000:]}"
                f"\n--- worker\n{stack.output('worker')[-3000:]}")


def test_compose_services_as_local_processes_serve_a_chat_request(tmp_path):
    variables = _env_file()
    stack = local_stack.LocalCompose(tmp_path, variables)
    t0 = time.monotonic()
    try:
        stack.up(timeout_s=120)
        deadline = time.monotonic() + 180
        stack.wait_for("init", "service_completed_successfully", deadline)
        m = re.search(r"^ACTORSERVE_API_KEY=(\S+)$", stack.output("init"), re.M)
        assert m, f"init printed no key:\n{stack.output('init')}"
        key = m.group(1)
        url = f"http://127.0.0.1:{stack.port('gateway', 8000)}"
        _wait_ready(stack, url, deadline)
        ready_s = time.monotonic() - t0

        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
        status, reply = _http(f"{url}/v1/chat/completions", body, key)
        assert status == 200, reply
        assert reply["choices"][0]["message"]["role"] == "assistant"
        assert 1 <= reply["usage"]["completion_tokens"] <= 4
        assert _http(f"{url}/v1/chat/completions", body, None)[0] == 401

        # The operator token from .env reaches the gateway: /metrics needs it.
        assert _http_status(f"{url}/metrics") == 401
        assert _http_status(f"{url}/metrics", variables["ACTORSERVE_OPERATOR_TOKEN"]) == 200

        # Every actor connected as its own role user (nats.conf from nats_roles.py), none as the operator.
        _, connz = _http(f"http://127.0.0.1:{stack.port('nats', 8222)}/connz?auth=true&limit=1024", timeout=5)
        users = {c.get("authorized_user") for c in connz.get("connections", [])}
        assert ROLE_USERS <= users, users
        assert "actorserve" not in users, users
        # No secret in any process's argv (passwords travel in the environment only).
        for name, pid in stack.pids.items():
            if stack.procs[name].poll() is None:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                leaked = [k for k, v in variables.items() if "PASSWORD" in k and v in argv]
                assert not leaked, f"{name}'s argv carries {leaked}"

        # Every actor's own healthcheck passes (the worker's requires its engine gauges on /metrics).
        unhealthy = [n for n in stack.services if n not in ("init",) and not stack.healthy(n)]
        assert not unhealthy, unhealthy

        # `docker compose up` again re-runs init: idempotent, no second key.
        stack.start("init")
        stack.wait_for("init", "service_completed_successfully", time.monotonic() + 60)
        assert "exists" in stack.output("init") and "ACTORSERVE_API_KEY=" not in stack.output("init")
        print(f"compose stack ready in {ready_s:.1f} s")
    finally:
        codes = stack.down()
    assert all(rc is not None for rc in codes.values()), codes
