"""Issue [12] item 5 on a live stack: a version registered with ``tensor_parallel=2`` runs workers of two ranks
each (a follower process per worker), registered as one logical worker with bytes per rank; SIGKILL of one
worker's follower takes that worker out (it exits: status 75) and its requests that had no token yet complete
on the other worker. Requests are held 4 s before reaching the engine (``ttft_delay_ms``, test-only faults) so
they are certainly on a worker and unstarted when the rank dies. Only processes this stack started are
signalled (the recorded worker pids and their own children)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from control.state.registry import Registry
from tests.e2e.helpers import tiny_deployment
from tests.e2e.test_rollouts import cli, wait_served
from tests.e2e.test_worker_retry import DEADLINE_MS, stream


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory, tiny_gguf):
    with tiny_deployment(tmp_path_factory.mktemp("tp"), tiny_gguf, {
            "worker": ["--kv-cache-bytes", "8000000", "--max-num-seqs", "4", "--no-progress"]},
            env={"ACTORSERVE_TEST_FAULTS": "1"}) as sup:
        cli(sup, "models", "register", "tiny", "2", "--artifact", tiny_gguf, "--option", "workers=2",
            "--option", "tensor_parallel=2", "--option", 'test_faults={"ttft_delay_ms": 4000}')
        wait_served(sup, "tiny@2")
        yield sup


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def follower_of(worker_pid: int) -> int:
    """The tensor-parallel follower rank started by a worker (its child running actors.worker.tp_rank)."""
    for pid in children(worker_pid):
        if b"tp_rank" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"worker {worker_pid} has no tensor-parallel follower")


def test_two_rank_workers_serve_and_a_lost_rank_takes_its_worker_out(tp_pair):
    sup = tp_pair

    async def records():
        async with Registry.connect(sup.etcd_url) as reg:
            return await reg.list_workers("tiny", "2")
    recs = asyncio.run(records())
    assert len(recs) == 2 and all(r["tensor_parallel"] == 2 and len(r["ranks"]) == 2 for r in recs.values()), recs
    workers = {n: p for n, p in sup.pids.items() if n.startswith("worker-tiny-2-")}
    victim = sorted(workers)[0]
    follower = follower_of(workers[victim])

    async def scenario():
        async with httpx.AsyncClient(timeout=DEADLINE_MS / 1e3 + 10) as client:
            tasks = [asyncio.create_task(stream(client, sup, i)) for i in range(6)]
            await asyncio.sleep(1.5)  # dispatched to both workers, held 4 s each
            os.kill(follower, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(scenario())
    assert [r[0] for r in results] == [200] * 6, results
    assert all(not errs and tokens >= 1 for _, tokens, errs in results), results
    t_end = time.monotonic() + 10
    while Path(f"/proc/{workers[victim]}").exists() and b"zombie" not in _state(workers[victim]):
        assert time.monotonic() < t_end, "the worker whose rank died is still running"
        time.sleep(0.2)
    log = (sup.state_dir / "logs" / f"{victim}.log").read_text()
    assert "worker leaving: tensor-parallel rank 1" in log, log[-2000:]
    sched = (sup.state_dir / "logs" / "scheduler-tiny-2.log").read_text()
    requeued = [int(m) for m in re.findall(rf"worker {victim} lost: (\d+) requests re-queued", sched)]
    assert sum(requeued) >= 1, f"no request of {victim} was re-dispatched:\n{sched[-2000:]}"


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes().lower()
    except OSError:
        return b"zombie"
