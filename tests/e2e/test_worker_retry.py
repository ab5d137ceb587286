"""Issue 8 item 5: a request whose worker dies before its first token is retried on another worker.

tiny@2 runs two workers whose test-only fault injection (``ttft_delay_ms``, honoured only with
``ACTORSERVE_TEST_FAULTS=1``) holds every accepted request 4 s before it reaches the engine, so requests
are certainly on a worker and have streamed nothing when one worker is SIGKILLed. Those requests must
complete on the surviving worker with all their tokens and no error (the scheduler re-dispatches a lost
worker's not-yet-started requests; at most ``max_attempts`` = 3 dispatches, within the deadline).
Only processes this stack started are signalled (its recorded pids).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import orjson
import pytest

from tests.e2e.helpers import tiny_deployment
from tests.e2e.test_rollouts import cli, wait_served

DEADLINE_MS = 40_000


@pytest.fixture(scope="module")
def delayed_pair(tmp_path_factory, tiny_gguf):
    with tiny_deployment(tmp_path_factory.mktemp("retry"), tiny_gguf, {
            "worker": ["--kv-cache-bytes", "8000000", "--max-num-seqs", "4", "--no-progress"]},
            env={"ACTORSERVE_TEST_FAULTS": "1"}) as sup:
        cli(sup, "models", "register", "tiny", "2", "--artifact", tiny_gguf, "--option", "workers=2",
            "--option", 'test_faults={"ttft_delay_ms": 4000}')
        wait_served(sup, "tiny@2")
        yield sup


async def stream(client: httpx.AsyncClient, sup, i: int) -> tuple[int, int, list]:
    """(HTTP status, completion tokens streamed, in-band errors) of one pinned streaming completion."""
    body = {"model": "tiny@2", "prompt": f"retry {i}", "max_tokens": 6, "ignore_eos": True, "stream": True,
            "deadline_ms": DEADLINE_MS}
    headers = {"Authorization": f"Bearer {sup.dev_api_key}"}
    async with asyncio.timeout(DEADLINE_MS / 1e3 + 5):
        async with client.stream("POST", sup.http_url + "/v1/completions", json=body, headers=headers) as r:
            text = (await r.aread()).decode()
    events = [orjson.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")]
    tokens = sum(1 for e in events for c in e.get("choices", []) if c.get("text"))
    return r.status_code, tokens, [e["error"] for e in events if "error" in e]


def test_requests_of_a_worker_killed_before_their_first_token_complete_elsewhere(delayed_pair):
    sup = delayed_pair
    workers = {n: p for n, p in sup.pids.items() if n.startswith("worker-tiny-2-")}
    assert len(workers) == 2, sup.pids
    victim = sorted(workers)[0]

    async def scenario():
        async with httpx.AsyncClient(timeout=DEADLINE_MS / 1e3 + 10) as client:
            tasks = [asyncio.create_task(stream(client, sup, i)) for i in range(6)]
            await asyncio.sleep(1.5)  # dispatched (least loaded: both workers get some), held 4 s each
            os.kill(workers[victim], signal.SIGKILL)
            t_kill = time.monotonic()
            results = await asyncio.gather(*tasks)
            return results, time.monotonic() - t_kill

    results, took = asyncio.run(scenario())
    assert [r[0] for r in results] == [200] * 6, results
    assert all(not errs for _, _, errs in results), results  # none ended with worker_lost: none had started
    assert all(tokens >= 1 for _, tokens, _ in results), results
    log = (sup.state_dir / "logs" / "scheduler-tiny-2.log").read_text()
    requeued = [int(m) for m in re.findall(rf"worker {victim} lost: (\d+) requests re-queued", log)]
    assert sum(requeued) >= 1, f"no request of {victim} was re-dispatched:\n{log[-2000:]}"
    assert took < DEADLINE_MS / 1e3, took
