"""``actorserve diagnose`` end to end (issue #8 item 4): induce each bottleneck, check the verdict.

1. Accelerator-bound: a worker with 2 batch slots and a small KV cache, a closed loop of 12 concurrent long
   generations -> the worker tier saturates, queue wait dominates, the first action sheds load / adds
   worker capacity.
2. Validator-bound: the validator burns 150 ms of CPU per request (test-only ``--test-delay-ms``, honoured
   with ``ACTORSERVE_TEST_FAULTS=1``) under 8 concurrent short requests -> add validators.

Each runs ``actorserve diagnose --state-dir DIR --json --window-s 3`` as a subprocess while the load runs
(bounded: the load stops when diagnose returns, at most ~40 s).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from tests.e2e.helpers import tiny_deployment

REPO = Path(__file__).resolve().parents[2]
WARMUP_S = 4.0
LOAD_LIMIT_S = 60.0


async def _client_loop(client: httpx.AsyncClient, url: str, headers: dict, body: dict, stop: asyncio.Event,
                       counts: dict) -> None:
    while not stop.is_set():
        try:
            r = await client.post(url, json=body, headers=headers, timeout=30)
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
        except httpx.HTTPError as e:
            counts[type(e).__name__] = counts.get(type(e).__name__, 0) + 1


async def _diagnose_under_load(sup, concurrency: int, body: dict, window_s: float = 3.0) -> dict:
    """Run ``concurrency`` closed-loop clients; after a warm-up run diagnose; stop the load; return its JSON."""
    headers = {"Authorization": f"Bearer {sup.dev_api_key}"}
    stop, counts = asyncio.Event(), {}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        loops = [asyncio.create_task(_client_loop(client, sup.http_url + "/v1/chat/completions", headers, body,
                                                  stop, counts)) for _ in range(concurrency)]
        try:
            await asyncio.sleep(WARMUP_S)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "control.ops.cli", "diagnose", "--state-dir", str(sup.state_dir), "--json",
                "--window-s", str(window_s), cwd=str(REPO),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), LOAD_LIMIT_S)
        finally:
            stop.set()
            await asyncio.wait(loops, timeout=35)
            for t in loops:
                t.cancel()
    assert proc.returncode == 0, err.decode()
    report = json.loads(out)
    v = report["verdict"]
    print(f"\nload responses {counts}; verdict {v['bottleneck']} (saturated {v['saturated']}): {v['summary']}")
    print("breakdown: " + ", ".join(f"{k} {b['mean_s'] * 1e3:.0f} ms ({b['share'] * 100:.0f}%)"
                                    for k, b in report["breakdown"].items()))
    for a in report["snapshot"]["actors"]:
        cpu = a["cpu_cores"]
        print(f"  {a['kind']:<10} cpu {'-' if cpu is None else f'{cpu * 100:.0f}%'} lag "
              f"{(a['loop_lag_s'] or 0) * 1e3:.0f} ms")
    for w in report["snapshot"]["workers"]:
        print(f"  worker {w['id']}: running {w['running']}/{w['max_batch_size']} batch {w['batch_size']:.2f} "
              f"waiting {w['waiting']} "
              f"kv {w['kv_usage'] * 100:.0f}%")
    print(f"  scheduler queue {report['snapshot']['scheduler_queue']}; evidence {v['evidence']}")
    for i, a in enumerate(report["actions"], 1):
        print(f"  {i}. {a['action']}")
    return report


def test_diagnose_accelerator_bound(tmp_path, tiny_gguf):
    with tiny_deployment(tmp_path / "state", tiny_gguf, {
            "worker": ["--max-num-seqs", "2", "--kv-cache-bytes", "2000000", "--no-progress"]}) as sup:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me a long story " * 8}],
                "max_tokens": 96, "ignore_eos": True}
        report = asyncio.run(_diagnose_under_load(sup, 12, body))
    v = report["verdict"]
    assert v["bottleneck"] == "worker", v
    assert v["dominant_stage"] == "queue", report["breakdown"]
    assert "validator" not in v["saturated"], v
    first = report["actions"][0]
    assert first["tier"] == "worker" and "shed" in first["action"], first


def test_diagnose_validator_bound(tmp_path, tiny_gguf):
    with tiny_deployment(tmp_path / "state", tiny_gguf, {
            "validator": ["--test-delay-ms", "150"], "worker": ["--no-progress"]},
            env={"ACTORSERVE_TEST_FAULTS": "1"}) as sup:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        report = asyncio.run(_diagnose_under_load(sup, 8, body))
    v = report["verdict"]
    assert v["bottleneck"] == "validator", v
    assert "worker" not in v["saturated"], v
    first = report["actions"][0]
    assert first["tier"] == "validator" and "add validators" in first["action"], first
