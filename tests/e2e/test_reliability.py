"""Reliability under churn (issue 8 items 5 and 7), on one supervised tiny-model stack with 2 workers.

* kill -9 a worker under streaming load: nothing hangs; requests it had not started complete on the
  other worker; those it was streaming end with an in-band, retryable ``worker_lost`` error event.
* SIGTERM a worker under load: no client sees an error; it gets no new dispatches, finishes what it
  runs, its key leaves etcd and it exits within its drain timeout.
* etcd frozen for 10 s under load: requests keep completing, no actor exits or restarts, and every
  worker's and the scheduler's lease key is back within seconds of etcd's return.

Every wait has a deadline; the only processes signalled are the ones this stack started (recorded pids).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from control.state.names import scheduler_key
from control.state.registry import Registry

DEADLINE_MS = 20_000
WORKER_ARGS = ["--kv-cache-bytes", "8000000", "--max-num-seqs", "2", "--no-progress", "--drain-timeout", "8"]


@pytest.fixture(scope="module")
def rel_stack(tmp_path_factory, tiny_gguf):
    """tiny@1 with 2 workers (2 slots each), supervised: an actor that dies is restarted (and recorded)."""
    from control.ops.supervisor import Supervisor
    from control.ops.stack_config import StackConfig

    sup = Supervisor(StackConfig(tmp_path_factory.mktemp("rel"), port=0, supervise=True, model_file=tiny_gguf,
                                 model_name="tiny", workers=2, actor_args={"worker": WORKER_ARGS},
                                 watch_registry=False))
    sup.start()
    try:
        sup.wait_ready(timeout=120)
        yield sup
    finally:
        sup.stop()


@dataclass
class Outcome:
    """How one streamed request ended."""

    status: int  # HTTP status; 0: no final event before deadline + 5 s (hung)
    kind: str  # "ok" | "error" (in-band) | "http" | "hung" | "truncated"
    code: str | None  # error code of an in-band error / HTTP error
    retryable: bool
    t_start: float
    t_end: float


async def one(client: httpx.AsyncClient, url: str, headers: dict, i: int, max_tokens: int) -> Outcome:
    """Stream one completion; classify its end (deadline + 5 s at most)."""
    body = {"model": "tiny", "prompt": f"reliability {i}", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "deadline_ms": DEADLINE_MS}
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(DEADLINE_MS / 1e3 + 5):
            async with client.stream("POST", url, json=body, headers=headers) as r:
                text = (await r.aread()).decode()
    except (TimeoutError, httpx.TimeoutException):
        return Outcome(0, "hung", None, False, t0, time.monotonic())
    t1 = time.monotonic()
    if r.status_code != 200:
        err = (orjson.loads(text).get("error") or {}) if text.startswith("{") else {}
        return Outcome(r.status_code, "http", err.get("code"), r.status_code in (429, 503) and
                       "Retry-After" in r.headers, t0, t1)
    events = [orjson.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    done = text.rstrip().endswith("data: [DONE]")
    errors = [e["error"] for e in events if "error" in e]
    if errors:
        return Outcome(200, "error", errors[-1].get("code"), bool(errors[-1].get("retryable")) and done, t0, t1)
    finished = any(c.get("finish_reason") == "length" for e in events for c in e.get("choices", []))
    return Outcome(200, "ok" if done and finished else "truncated", None, False, t0, t1)


async def steady_load(url: str, headers: dict, n: int, spacing_s: float, max_tokens: int) -> list[Outcome]:
    """``n`` streamed requests, one every ``spacing_s`` s, all awaited (each bounded by its deadline + 5 s)."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=200), timeout=DEADLINE_MS / 1e3 + 10) as c:
        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(one(c, url, headers, i, max_tokens)))
            await asyncio.sleep(spacing_s)
        return await asyncio.gather(*tasks)


async def leased(etcd_url: str) -> dict[str, dict]:
    """Worker id -> registration of tiny@1's leased workers, plus the scheduler's election key as "<sched>"."""
    async with Registry.connect(etcd_url, timeout=2) as reg:
        out = await reg.list_workers("tiny", "1")
        sched = await reg.get_json(scheduler_key("tiny", "1"))
        if sched is not None:
            out["<sched>"] = sched
        return out


async def wait_workers(etcd_url: str, n: int = 2, timeout: float = 60.0) -> dict[str, dict]:
    """Wait (bounded) until ``n`` workers of tiny@1 are registered; returns them."""
    t_end = time.monotonic() + timeout
    while True:
        try:
            got = {k: v for k, v in (await leased(etcd_url)).items() if k != "<sched>"}
            if len(got) >= n:
                return got
        except Exception:
            pass
        assert time.monotonic() < t_end, f"fewer than {n} workers registered after {timeout} s"
        await asyncio.sleep(0.2)


def headers_of(sup) -> dict:
    return {"Authorization": f"Bearer {(Path(sup.state_dir) / 'dev-api-key').read_text().strip()}"}


def summary(results: list[Outcome]) -> str:
    kinds: dict[str, int] = {}
    for r in results:
        key = r.kind if r.kind == "ok" else f"{r.kind}:{r.status}:{r.code}"
        kinds[key] = kinds.get(key, 0) + 1
    lat = sorted(r.t_end - r.t_start for r in results)
    return f"{len(results)} requests: {kinds}; latency p50 {lat[len(lat) // 2]:.1f} s, max {lat[-1]:.1f} s"


def test_kill9_worker_under_load(rel_stack):
    """Requests not yet streaming on the killed worker complete elsewhere; the ones it was streaming end
    with an in-band retryable ``worker_lost`` event; none hangs (each ends before its deadline + 5 s)."""
    sup = rel_stack
    url = sup.http_url + "/v1/completions"

    async def scenario():
        await wait_workers(sup.etcd_url)
        victim = sup.pids["worker-0"]
        loader = asyncio.create_task(steady_load(url, headers_of(sup), 16, 0.3, 120))
        await asyncio.sleep(2.0)  # both workers streaming
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        noticed = None  # the victim's lease key gone, or taken by its restarted successor
        while noticed is None and time.monotonic() - t_kill < 15:
            try:
                info = (await leased(sup.etcd_url)).get("worker-0")
                if info is None or info.get("pid") != victim:
                    noticed = time.monotonic() - t_kill
            except Exception:
                pass
            await asyncio.sleep(0.1)
        return noticed, t_kill, await loader

    noticed, t_kill, results = asyncio.run(scenario())
    print(f"kill -9 worker-0: lease gone after {noticed} s; {summary(results)}")
    assert noticed is not None and noticed <= 5.0, "the dead worker's lease outlived TTL + 2 s"
    assert not [r for r in results if r.kind in ("hung", "truncated")], summary(results)
    for r in results:
        assert r.t_end - r.t_start <= DEADLINE_MS / 1e3 + 5
    # Admission control may refuse a request up front (HTTP 503 deadline_unmeetable + Retry-After: its
    # throughput estimate lags right after a capacity drop or an idle period); that is a clear retryable answer.
    shed = [r for r in results if r.kind == "http" and r.retryable]
    bad = [r for r in results if r.kind != "ok" and r not in shed
           and not (r.kind == "error" and r.code == "worker_lost" and r.retryable)]
    assert not bad, summary(results)
    assert sum(r.kind == "error" for r in results) <= 2  # at most the dead worker's 2 streaming slots
    assert len(shed) <= 2 and sum(r.kind == "ok" for r in results) >= 12, summary(results)


def test_sigterm_worker_drains_without_errors(rel_stack):
    """SIGTERM: the worker's key leaves etcd at once, it finishes what it runs, exits within its drain
    timeout (8 s), and no client sees an error."""
    sup = rel_stack

    async def scenario():
        await wait_workers(sup.etcd_url)
        victim = sup.actor("worker-1")
        pid = victim.pid
        loader = asyncio.create_task(steady_load(sup.http_url + "/v1/completions", headers_of(sup), 30, 0.1, 96))
        await asyncio.sleep(1.5)
        os.kill(pid, signal.SIGTERM)
        t_term = time.monotonic()
        key_gone = exited = None
        while (key_gone is None or exited is None) and time.monotonic() - t_term < 15:
            if key_gone is None:
                try:
                    info = (await leased(sup.etcd_url)).get("worker-1")
                    if info is None or info.get("pid") != pid:
                        key_gone = time.monotonic() - t_term
                except Exception:
                    pass
            if exited is None and victim.proc is not None and (victim.pid != pid or victim.proc.poll() is not None):
                exited = time.monotonic() - t_term
            await asyncio.sleep(0.05)
        return key_gone, exited, await loader

    key_gone, exited, results = asyncio.run(scenario())
    print(f"SIGTERM worker-1: key gone after {key_gone} s, exited after {exited} s; {summary(results)}")
    assert key_gone is not None and key_gone <= 1.0
    assert exited is not None and exited <= 8 + 3  # drain timeout + lease revoke and bus close
    assert all(r.kind == "ok" for r in results), summary(results)
    # An actor the operator SIGTERMed stays stopped (issue 21); start it again for the tests after this one.
    time.sleep(1.5)  # a negative check: several supervisor monitor rounds pass and none restarts it
    assert not sup.actor("worker-1").running and sup.stopped_by_operator == ["worker-1"]
    assert sup.start_stopped() == ["worker-1"]


@pytest.mark.slow  # 20-50 s: in `make test-slow` (CI runs it after `make test`) to keep `make test` under 20 min
def test_etcd_outage_under_load(rel_stack):
    """etcd frozen (SIGSTOP) for 10 s under steady load, then resumed.

    Expected: every request completes (200, [DONE]). Why no failures at all: nothing on the request path
    reads etcd per request (the gateway resolves from its snapshot, the validator from its cached
    assets, the scheduler dispatches from its worker table, credits travel on NATS), and every actor
    keeps its role while etcd does not answer. After the resume leases that expired meanwhile are
    reported lost and taken again at once; a worker whose lease expired but still heartbeats keeps its
    requests (docs/decisions/0017-drain-and-control-plane-loss.md). No actor exits or is restarted."""
    sup = rel_stack
    etcd_pid = sup.stack.etcd.pid

    async def scenario():
        await wait_workers(sup.etcd_url)
        await asyncio.sleep(1.0)
        pids = dict(sup.pids)
        events = len(sup.events)
        before = await leased(sup.etcd_url)
        loader = asyncio.create_task(steady_load(sup.http_url + "/v1/completions", headers_of(sup), 60, 0.33, 32))
        await asyncio.sleep(3.0)
        os.kill(etcd_pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(10.0)
        finally:
            os.kill(etcd_pid, signal.SIGCONT)
        t_back = time.monotonic()
        back = None
        while time.monotonic() - t_back < 20:
            try:
                now = await leased(sup.etcd_url)
                if set(before) <= set(now):
                    back = time.monotonic() - t_back
                    break
            except Exception:
                pass
            await asyncio.sleep(0.1)
        results = await loader
        return pids, events, before, back, results

    pids, events, before, back, results = asyncio.run(scenario())
    print(f"etcd frozen 10 s: keys {sorted(before)} back after {back} s; {summary(results)}; "
          f"pids unchanged: {dict(sup.pids) == pids}; events {sup.events[events:]}")
    assert back is not None and back <= 5.0, "a lease key did not come back within 5 s of etcd's return"
    assert dict(sup.pids) == pids, "an actor exited or was restarted"
    assert sup.events[events:] == []
    assert all(sup.actor(name).running for name in pids if name not in ("nats", "etcd"))
    assert all(r.kind == "ok" for r in results), summary(results)
