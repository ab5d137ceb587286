"""Issue #6 item 3 end to end: a version registered through the CLI is served without restarting any other
actor, and retiring it drains its processes and makes it unknown (404); bad manifests are refused.

Runs the tiny random-weight model under ``tiny_deployment`` (Supervisor, registry watch on).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from control.state.registry import Registry
from control.state.routing import RoutingTable
from tests.e2e.helpers import tiny_deployment

REPO = Path(__file__).resolve().parents[2]
WORKER_ARGS = {"worker": ["--kv-cache-bytes", "8000000", "--no-progress"]}
EDGE_KINDS = ("gateway", "validator", "jobs", "rollout")


def cli(sup, *argv: str) -> subprocess.CompletedProcess:
    """``python -m control.ops.cli <argv> --state-dir <stack>``, bounded to 60 s."""
    return subprocess.run([sys.executable, "-m", "control.ops.cli", *argv, "--state-dir", str(sup.state_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def chat(sup, model: str) -> httpx.Response:
    return httpx.post(sup.http_url + "/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {sup.dev_api_key}"},
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def edge_pids(sup) -> dict[str, int]:
    return {k: v for k, v in sup.pids.items() if k.split("-")[0] in EDGE_KINDS}


def test_versions_come_and_go_live(tmp_path, tiny_gguf):
    with tiny_deployment(tmp_path / "state", tiny_gguf, WORKER_ARGS) as sup:
        edges = edge_pids(sup)
        assert {"gateway-0", "validator-0"} <= set(edges)

        # an unsupported format is refused (exit 2, the field named), nothing is stored
        p = cli(sup, "models", "register", "tiny", "3", "--artifact", tiny_gguf, "--format", "safetensors")
        assert p.returncode == 2 and "format" in p.stderr and "not supported" in p.stderr, p.stderr
        p = cli(sup, "models", "register", "tiny", "3", "--artifact", str(tmp_path / "missing.gguf"))
        assert p.returncode == 2 and "artifact" in p.stderr, p.stderr

        p = cli(sup, "models", "register", "tiny", "2", "--artifact", tiny_gguf)
        assert p.returncode == 0, p.stderr
        assert cli(sup, "models", "register", "tiny", "2", "--artifact", tiny_gguf).returncode == 0  # same: no-op
        p = cli(sup, "models", "register", "tiny", "2", "--artifact", tiny_gguf, "--context-length", "64")
        assert p.returncode == 2 and "--replace" in p.stderr and "context_length" in p.stderr, p.stderr

        t_end = time.monotonic() + 120
        while True:  # the supervisor sees the version, starts its scheduler and worker; the gateway routes
            r = chat(sup, "tiny@2")
            if r.status_code == 200:
                break
            assert time.monotonic() < t_end, f"tiny@2 not served within 120 s: {r.status_code} {r.text}"
            time.sleep(0.5)
        assert r.json()["model"] == "tiny@2"
        assert edge_pids(sup) == edges  # no gateway/validator restart for a registry edit
        recorded = json.loads((sup.state_dir / "pids.json").read_text())
        v2 = {k: recorded[k] for k in ("scheduler-tiny-2", "worker-tiny-2-0")}
        assert all(alive(pid) for pid in v2.values())

        show = cli(sup, "models", "show", "tiny", "--json")
        assert show.returncode == 0, show.stderr
        info = json.loads(show.stdout)
        assert info["versions"]["2"]["status"] == "active" and info["versions"]["2"]["live_workers"] == ["worker-tiny-2-0"]
        assert info["routing"]["state"] == "idle"

        # the routing table's stable version cannot be retired without --force
        async def pin_stable():
            async with Registry.connect(sup.etcd_url) as reg:
                await reg.put_routing("tiny", RoutingTable(stable="1").to_dict())
        asyncio.run(pin_stable())
        p = cli(sup, "models", "retire", "tiny", "1")
        assert p.returncode == 2 and "stable" in p.stderr, p.stderr

        p = cli(sup, "models", "retire", "tiny", "2")
        assert p.returncode == 0, p.stderr
        t_retired = time.monotonic()
        while any(alive(pid) for pid in v2.values()) or chat(sup, "tiny@2").status_code != 404:
            assert time.monotonic() - t_retired < 30, "tiny@2 not drained / still routed 30 s after retire"
            time.sleep(0.25)
        r = chat(sup, "tiny")
        assert r.status_code == 200 and r.json()["model"] == "tiny@1"
        assert edge_pids(sup) == edges
        recorded = json.loads((sup.state_dir / "pids.json").read_text())
        assert not set(v2) & set(recorded) and "worker-0" in recorded
        assert cli(sup, "models", "retire", "tiny", "2").returncode == 0  # already retired: fine
