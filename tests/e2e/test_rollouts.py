"""Registry-driven routing end to end (issue #6 items 2, 4, 6): a 90/10 canary split over 2,000 requests,
every response naming its version, rollback within 1 s of the command, no failed request while an
operator starts, promotes and rolls back rollouts under steady load (items 2, 4, 6), and the rollout
controller rolling back a faulty canary and promoting a healthy one (item 5).

Two versions of the tiny model: ``tiny@1`` is started by the Supervisor, ``tiny@2`` is registered through
the CLI, which makes the Supervisor start its scheduler and worker (item 3).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from control.state.registry import Registry
from control.state.routing import RoutingTable
from tests.e2e.helpers import tiny_deployment

REPO = Path(__file__).resolve().parents[2]
NO_AUTO_STEP = ["--manual"]  # the rollout controller must not move the weight here


def cli(sup, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``actorserve <argv> --state-dir <stack>``; bounded to 60 s."""
    p = subprocess.run([sys.executable, "-m", "control.ops.cli", *argv, "--state-dir", str(sup.state_dir)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    if check:
        assert p.returncode == 0, f"{argv}: rc={p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


async def routing(sup) -> RoutingTable:
    async with Registry.connect(sup.etcd_url) as reg:
        return RoutingTable.from_dict(await reg.get_routing("tiny"))


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory, tiny_gguf):
    with tiny_deployment(tmp_path_factory.mktemp("rollouts"), tiny_gguf, {
            "worker": ["--kv-cache-bytes", "8000000", "--max-num-seqs", "16", "--no-progress"]},
            env={"ACTORSERVE_TEST_FAULTS": "1"}) as sup:
        cli(sup, "models", "register", "tiny", "2", "--artifact", tiny_gguf)
        # tiny@3 fails half its requests (test-only fault injection, honoured with ACTORSERVE_TEST_FAULTS=1)
        cli(sup, "models", "register", "tiny", "3", "--artifact", tiny_gguf,
            "--option", 'test_faults={"error_rate": 0.5, "seed": 7}')
        wait_served(sup, "tiny@2")
        wait_served(sup, "tiny@3")
        yield sup


def wait_served(sup, ref: str, timeout_s: float = 120) -> None:
    """Until a pinned request to ``ref`` reaches its worker (an injected fault counts: it came from there)."""
    headers = {"Authorization": f"Bearer {sup.dev_api_key}"}
    body = {"model": ref, "prompt": "up?", "max_tokens": 1}
    t_end = time.monotonic() + timeout_s
    while True:  # the supervisor starts the version's scheduler and worker
        r = httpx.post(sup.http_url + "/v1/completions", json=body, headers=headers, timeout=30)
        if r.status_code == 200 or "injected_fault" in r.text:
            return
        assert time.monotonic() < t_end, f"{ref} not served within {timeout_s} s: {r.status_code} {r.text}"
        time.sleep(0.5)


async def served_by(client, url, headers, i: int, stream: bool = False) -> tuple[int, str, float]:
    """(status, version that served it, start time) of one 1-token completion."""
    body = {"model": "tiny", "prompt": f"split {i}", "max_tokens": 1, "stream": stream}
    t0 = time.time()
    r = await client.post(url, json=body, headers=headers, timeout=60)
    if r.status_code != 200:
        return r.status_code, "", t0
    header = r.headers.get("x-actorserve-model-version", "")
    if stream:
        return 200 if r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text else 599, header, t0
    model = r.json()["model"]
    assert model == header, (model, header)
    return 200, model, t0


async def burst(sup, n: int, concurrency: int = 16) -> list[tuple[int, str, float]]:
    headers = {"Authorization": f"Bearer {sup.dev_api_key}"}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency)) as client:
        async def one(i):
            async with sem:
                return await served_by(client, sup.http_url + "/v1/completions", headers, i, stream=i % 5 == 0)
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_90_10_split_over_2000_requests_names_the_version(two_versions):
    sup = two_versions
    cli(sup, "rollout", "start", "tiny", "--canary", "2", "--weight", "10", *NO_AUTO_STEP)
    try:
        results = asyncio.run(burst(sup, 2000))
        assert [s for s, _, _ in results if s != 200] == []
        versions = [v for _, v, _ in results]
        assert set(versions) == {"tiny@1", "tiny@2"}
        share = versions.count("tiny@2") / len(versions)
        print(f"canary share {share:.4f} over {len(versions)} requests (target 0.10 +- 0.02)")
        assert abs(share - 0.10) <= 0.02
    finally:
        cli(sup, "rollout", "rollback", "tiny")


async def steady_load(sup, stop: asyncio.Event, concurrency: int = 6) -> list[tuple[int, str, float]]:
    headers = {"Authorization": f"Bearer {sup.dev_api_key}"}
    out: list[tuple[int, str, float]] = []
    async with httpx.AsyncClient() as client:
        async def loop(k):
            i = 0
            while not stop.is_set():
                out.append(await served_by(client, sup.http_url + "/v1/completions", headers, k * 100000 + i,
                                           stream=k % 2 == 0))
                i += 1
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
    return out


async def cli_async(sup, *argv: str) -> tuple[float, float]:
    """Run the CLI without blocking the load; return the times it started and finished."""
    t0 = time.time()
    await asyncio.to_thread(cli, sup, *argv)
    return t0, time.time()


def test_promote_and_rollback_under_load_fail_nothing_and_rollback_is_immediate(two_versions):
    sup = two_versions

    async def scenario():
        stop = asyncio.Event()
        load = asyncio.create_task(steady_load(sup, stop))
        marks = {}
        await asyncio.sleep(1.5)
        await cli_async(sup, "rollout", "start", "tiny", "--canary", "2", "--weight", "50", *NO_AUTO_STEP)
        await asyncio.sleep(2.0)
        marks["rollback_1"] = await cli_async(sup, "rollout", "rollback", "tiny")
        await asyncio.sleep(2.0)
        await cli_async(sup, "rollout", "start", "tiny", "--canary", "2", "--weight", "25", *NO_AUTO_STEP)
        await asyncio.sleep(2.0)
        marks["promote"] = await cli_async(sup, "rollout", "promote", "tiny")
        await asyncio.sleep(2.0)
        marks["rollback_2"] = await cli_async(sup, "rollout", "rollback", "tiny")  # back to tiny@1
        await asyncio.sleep(2.0)
        stop.set()
        return await load, marks

    results, marks = asyncio.run(scenario())
    failed = [r for r in results if r[0] != 200]
    print(f"{len(results)} requests under promote/rollback, {len(failed)} failed")
    assert len(results) > 100 and failed == []
    for mark in ("rollback_1", "rollback_2"):
        done = marks[mark][1]
        late = [t0 - done for _, v, t0 in results if v == "tiny@2" and done <= t0 < done + 2]
        print(f"{mark}: last request sent to tiny@2 started {max(late, default=0) * 1000:.0f} ms after the command")
        assert all(d < 1.0 for d in late), late
    promoted = [v for _, v, t0 in results if marks["promote"][1] + 1 <= t0 < marks["rollback_2"][0]]
    assert promoted and set(promoted) == {"tiny@2"}
    t = asyncio.run(routing(sup))
    assert (t.stable, t.canary, t.state) == ("1", None, "rolled_back")
    assert [d["action"] for d in t.decisions][-5:] == ["start", "rollback", "start", "promote", "rollback"]


async def load_until(sup, done, concurrency: int = 6, timeout_s: float = 90.0) -> list[tuple[int, str, float]]:
    """Steady load until ``await done()`` is true (checked every 0.2 s); bounded by ``timeout_s``."""
    stop = asyncio.Event()
    load = asyncio.create_task(steady_load(sup, stop, concurrency))
    t_end = time.monotonic() + timeout_s
    try:
        while not await done():
            assert time.monotonic() < t_end, f"not done within {timeout_s} s: {await routing(sup)}"
            await asyncio.sleep(0.2)
    finally:
        stop.set()
    return await load


def test_faulty_canary_is_rolled_back_and_gets_no_traffic_after(two_versions):
    sup = two_versions
    t0 = time.time()
    cli(sup, "rollout", "start", "tiny", "--canary", "3", "--stable", "1", "--weight", "25", "--window-s", "60",
        "--min-samples", "10")

    async def rolled_back():
        return (await routing(sup)).state == "rolled_back"

    results = asyncio.run(load_until(sup, rolled_back))
    t = asyncio.run(routing(sup))
    decision = t.decisions[-1]
    print(f"rolled back {decision['ts'] - t0:.1f} s after start; reasons: {decision['reasons']}")
    assert decision["action"] == "rollback" and decision["by"] == "controller"
    assert any("error rate" in r for r in decision["reasons"])
    assert decision["ts"] - t0 < 60  # within the analysis window
    assert any(v == "tiny@3" for _, v, _ in results) or any(s != 200 for s, _, _ in results)
    after = asyncio.run(burst(sup, 200))
    assert [s for s, _, _ in after] == [200] * 200 and {v for _, v, _ in after} == {"tiny@1"}
    out = cli(sup, "rollout", "status", "tiny").stdout
    assert "rollback" in out and "error rate" in out


def test_healthy_canary_is_promoted(two_versions):
    sup = two_versions
    cli(sup, "rollout", "start", "tiny", "--canary", "2", "--stable", "1", "--steps", "10,50,100",
        "--window-s", "60", "--min-samples", "10", "--step-interval-s", "1")

    async def promoted():
        t = await routing(sup)
        assert t.state != "rolled_back", t.decisions[-1]
        return t.state == "promoted"

    results = asyncio.run(load_until(sup, promoted, timeout_s=120))
    t = asyncio.run(routing(sup))
    actions = [(d["action"], d["by"], d["weight"]) for d in t.decisions]
    print(f"{len(results)} requests; decisions {actions[-4:]}")
    assert t.stable == "2" and t.canary is None
    assert actions[-3:] == [("start", "cli", 10.0), ("step", "controller", 50.0), ("promote", "controller", 0.0)]
    assert [s for s, _, _ in results if s != 200] == []
    after = asyncio.run(burst(sup, 50))
    assert {v for _, v, _ in after} == {"tiny@2"}
