"""Process hardening of ``actorserve up`` on real stacks (issue 21 item 4), the heavy parts; run by ``make
cluster-test`` (collected only with ``ACTORSERVE_CLUSTER=1``). No root needed. Each test prints its figures.

* SIGKILL of ``up``: every process it started (actors, nats-server, etcd) is gone within the drain
  timeout + 5 s (``PR_SET_PDEATHSIG`` + the actors' parent watch); before that, an actor the operator
  SIGTERMs stays stopped and SIGHUP starts it again. About 25 s.
* Stopping a stack with two model versions (3 workers, 2 schedulers) and streams in flight that cannot
  finish (a 25 s first-token delay): at most ``stop_timeout_s`` (15 s) + 5 s (the waves of
  control/ops/supervisor_processes.py STOP_WAVES; one after another this took ~25 s). About 60 s.
* nats-server SIGKILLed and restarted (1 s down) under jobs and streams, three times: jobs in flight
  complete, streams in flight end and a new stream gets its first token within a few seconds of the
  restart (the ~50 s stall of decision 0008). About 45 s.

Only processes these tests started are signalled (recorded pids).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from control.ops.ports import free_port
from tests.engine_fixtures import write_tiny_llama_gguf

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    write_tiny_llama_gguf(path)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _procs_mentioning(marker: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker in d.joinpath("cmdline").read_bytes().decode(errors="replace") and _alive(int(d.name)):
                    found.append(int(d.name))
            except OSError:
                continue
    return found


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _pids(state: Path) -> dict:
    try:
        return json.loads((state / "pids.json").read_text())
    except (OSError, ValueError):
        return {}


def test_sigkill_of_up_leaves_no_process(tmp_path, tiny):
    state, port = tmp_path / "state", free_port()
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen([sys.executable, "-m", "control.ops.cli", "up", "--state-dir", str(state), "--port", str(port),
                           "--model-file", tiny, "--model-name", "tiny", "--worker-args=--no-progress"],
                          cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    recorded: dict = {}
    try:
        t_end = time.time() + 120
        while not _ready(port):
            assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            assert time.time() < t_end, "not ready in 120 s"
            time.sleep(0.5)
        recorded = {k: v for k, v in _pids(state).items() if isinstance(v, int)}
        # the operator stops the worker: it stays stopped; SIGHUP to `up` starts it again
        os.kill(recorded["worker-0"], signal.SIGTERM)
        t_end = time.time() + 20
        while "worker-0" not in (_pids(state).get("stopped") or {}):
            assert time.time() < t_end, "worker-0 not recorded as stopped by the operator"
            time.sleep(0.2)
        time.sleep(1.5)  # a negative check: several supervisor monitor rounds pass and none restarts it
        assert "worker-0" not in _pids(state)
        up.send_signal(signal.SIGHUP)
        t_end = time.time() + 20
        while not isinstance(_pids(state).get("worker-0"), int):
            assert time.time() < t_end, "SIGHUP did not start worker-0 again"
            time.sleep(0.2)
        recorded = {k: v for k, v in _pids(state).items() if isinstance(v, int)}
        assert {"nats", "etcd", "worker-0", "gateway-0"} <= set(recorded)
        up.kill()  # SIGKILL: the supervisor runs no cleanup at all
        up.wait(10)
        t0 = time.monotonic()
        left = [n for n, pid in recorded.items() if n != "supervisor" and _alive(pid)]
        while left and time.monotonic() - t0 < 30:
            time.sleep(0.2)
            left = [n for n, pid in recorded.items() if n != "supervisor" and _alive(pid)]
        took = time.monotonic() - t0
        print(f"after SIGKILL of up: every child gone in {took:.1f} s")
        assert left == [], f"still running {took:.0f} s after SIGKILL of up: {left}"
        assert took <= 10 + 5  # the workers' drain timeout + 5 s
        assert _procs_mentioning(str(state)) == []
    finally:
        if up.poll() is None:
            up.kill()
        for name, pid in recorded.items():  # never leave a stack behind, whatever failed above
            if name != "supervisor" and _alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def test_stop_with_two_versions_and_streams_in_flight_is_bounded(tmp_path, tiny):
    from tests.e2e.helpers import tiny_deployment
    from tests.e2e.test_rollouts import cli

    with tiny_deployment(tmp_path / "state", tiny, {"worker": ["--kv-cache-bytes", "8000000", "--no-progress"]},
                         env={"ACTORSERVE_TEST_FAULTS": "1"}) as sup:
        cli(sup, "models", "register", "tiny", "2", "--artifact", tiny, "--option", "workers=2",
            "--option", 'test_faults={"ttft_delay_ms": 25000}')
        asyncio.run(_wait_workers(sup.etcd_url, "tiny", "2", 2, 150))
        assert sum(n.startswith("worker") for n in sup.pids) == 3 and "scheduler-tiny-2" in sup.pids
        headers = {"Authorization": f"Bearer {sup.dev_api_key}"}

        def stream(model: str) -> None:
            body = {"model": model, "prompt": "drain", "max_tokens": 400, "ignore_eos": True, "stream": True,
                    "deadline_ms": 60_000}
            try:
                with httpx.stream("POST", sup.http_url + "/v1/completions", json=body, headers=headers,
                                  timeout=60) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                pass

        import threading

        clients = [threading.Thread(target=stream, args=("tiny@2" if i % 2 else "tiny",), daemon=True)
                   for i in range(8)]
        for t in clients:
            t.start()
        time.sleep(1.5)  # every stream admitted; the tiny@2 ones wait 25 s for their first token
        pids = dict(sup.pids)
        t0 = time.monotonic()
        sup.stop()  # idempotent: leaving the with block stops nothing more
        took = time.monotonic() - t0
        print(f"stop with 2 versions ({len(pids)} processes) and 4 stuck streams: {took:.1f} s "
              f"(stop_timeout_s {sup.cfg.stop_timeout_s:.0f} s)")
        assert took <= sup.cfg.stop_timeout_s + 5, f"stopping took {took:.1f} s"
        assert [n for n, pid in pids.items() if _alive(pid)] == []


async def _wait_workers(etcd_url: str, name: str, version: str, n: int, timeout_s: float) -> None:
    from control.state.registry import Registry

    t_end = time.monotonic() + timeout_s
    async with Registry.connect(etcd_url) as reg:
        while len(await reg.list_workers(name, version)) < n:
            assert time.monotonic() < t_end, f"{name}@{version}: fewer than {n} workers after {timeout_s} s"
            await asyncio.sleep(0.5)
    await asyncio.sleep(2.0)  # the gateway's routing snapshot and the scheduler's worker table follow


def test_no_stall_after_a_nats_server_restart(tmp_path, tiny):
    from tests.e2e.helpers import tiny_deployment

    with tiny_deployment(tmp_path / "state", tiny, {"worker": ["--kv-cache-bytes", "8000000", "--no-progress"],
                                                     "scheduler": ["--max-queue-per-tenant", "1024"]},
                         watch_registry=False) as sup:
        figures = asyncio.run(_restart_rounds(sup, 3))
    for f in figures:
        print(f"nats-server restart: jobs done {f['jobs']} s after it, streams in flight ended "
              f"{f['streams']} s after the kill, a new stream's first token {f['ttft']} s after the restart")
    for f in figures:
        assert f["missing"] == 0 and max(f["jobs"]) <= 8.0, f
        assert max(f["streams"]) <= 3.0 and f["ttft"] is not None and f["ttft"] <= 4.0, f


async def _restart_rounds(sup, rounds: int) -> list[dict]:
    headers = {"Authorization": f"Bearer {sup.dev_api_key}"}
    base = sup.http_url
    out = []
    async with httpx.AsyncClient(timeout=60) as c:
        async def status(job_id: str) -> str:
            try:
                return (await c.get(f"{base}/v1/jobs/{job_id}", headers=headers, timeout=5)).json().get("status", "")
            except (httpx.HTTPError, ValueError):
                return ""

        async def stream(max_tokens: int) -> tuple[float | None, float]:
            body = {"model": "tiny", "prompt": "go", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            first = None
            try:
                async with c.stream("POST", base + "/v1/completions", json=body, headers=headers) as r:
                    async for line in r.aiter_lines():
                        if first is None and line.startswith("data: {") and '"text"' in line:
                            event = json.loads(line[6:])
                            if any(ch.get("text") for ch in event.get("choices", [])):
                                first = time.monotonic()  # a token, not an error event
            except httpx.HTTPError:
                pass
            return first, time.monotonic()

        for _ in range(rounds):
            job = {"endpoint": "/v1/completions",
                   "body": {"model": "tiny", "prompt": "survive", "max_tokens": 300, "ignore_eos": True}}
            ids = [(await c.post(base + "/v1/jobs", json=job, headers=headers)).json()["id"] for _ in range(6)]
            t_end = time.monotonic() + 30
            while await status(ids[0]) != "in_progress" and time.monotonic() < t_end:
                await asyncio.sleep(0.05)
            streams = [asyncio.create_task(stream(450)) for _ in range(3)]
            await asyncio.sleep(0.2)
            t_kill = time.monotonic()
            await asyncio.to_thread(sup.stack.nats.kill)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(sup.stack.nats.start)
            t0 = time.monotonic()
            async def first_token() -> float | None:  # a new request, retried until it streams
                while time.monotonic() - t0 < 30:
                    first, _ = await stream(8)
                    if first is not None:
                        return first
                    await asyncio.sleep(0.1)
                return None

            fresh = asyncio.create_task(first_token())
            done: dict[str, float] = {}
            while len(done) < len(ids) and time.monotonic() - t0 < 90:
                for j in ids:
                    if j not in done and await status(j) in ("completed", "failed", "expired"):
                        done[j] = round(time.monotonic() - t0, 1)
                await asyncio.sleep(0.2)
            ended = [round(e - t_kill, 1) for _, e in await asyncio.gather(*streams)]
            first = await fresh
            out.append({"jobs": sorted(done.values()), "missing": len(ids) - len(done), "streams": ended,
                        "ttft": round(first - t0, 1) if first else None})
    return out
