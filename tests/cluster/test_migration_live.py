"""Request migration on a live stack (issue [13] item 4, the live target); run by ``make cluster-test``
(collected only with ``ACTORSERVE_CLUSTER=1``). No root needed. About 60 s.

An ``up``-style stack (control.ops.supervisor.Supervisor: 2 workers, the tiny test model, float32) serves 6
streamed completions twice: once uninterrupted (the reference) and once with a preemption notice
(``actorserve workers preempt`` to the worker running more of them) sent while every stream is running. Its
sequences move to the other worker (recomputed there from prompt + tokens so far, same chunk seq, same RNG position) and
every stream completes with exactly the reference's text: 5 greedy (temperature 0) and 1 seeded sampled
(temperature 0.8). Printed: per stream the largest gap between two SSE events at the client, and the
hand-over gaps the receiving worker measured (ms)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.engine_fixtures import write_tiny_llama_gguf

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.cluster]
MAX_TOKENS = 1800  # long enough that the notice (stats look-up <= 1 s, a CLI process ~1-2 s) lands mid-stream


def bodies() -> list[dict]:
    out = [{"prompt": f"stream {i}: the cat sat", "temperature": 0.0} for i in range(5)]
    out.append({"prompt": "stream 5: a seeded draw", "temperature": 0.8, "top_p": 0.95, "seed": 7})
    return [{"model": "tiny", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
             "deadline_ms": 80_000, **b} for b in out]


async def one_stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict, log: list) -> str:
    """Text of one streamed completion; appends (arrival epoch s, text piece, response id) per SSE event
    to ``log``."""
    parts = []
    async with client.stream("POST", url, json=body, headers=headers, timeout=90) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = orjson.loads(line[6:])
            assert "error" not in ev, ev
            piece = "".join(c.get("text") or "" for c in ev.get("choices", ()))
            parts.append(piece)
            log.append((time.time(), piece, ev.get("id", "")))
    return "".join(parts)


async def busier_worker(sup) -> str:
    """The worker running more sequences now (from its statistics, published about once a second)."""
    from tests.e2e.helpers import latest_worker_stats

    stats = await asyncio.gather(*(latest_worker_stats(sup.nats_url, w) for w in ("worker-0", "worker-1")))
    return max(stats, key=lambda st: st.num_running).worker_id


async def run(sup, notice_after: int | None = None) -> tuple[list[str], list[list], str]:
    """The 6 streams at once; with ``notice_after``, ``workers preempt <the busier worker>`` once each stream
    has that many events. Returns (texts, per-stream event logs, the preempted worker or "")."""
    headers = {"Authorization": f"Bearer {sup.dev_api_key}"}
    logs: list[list] = [[] for _ in bodies()]
    victim = [""]

    async def preempt() -> None:
        while not all(len(x) >= notice_after for x in logs):
            await asyncio.sleep(0.01)
        victim[0] = await busier_worker(sup)
        cmd = [sys.executable, "-m", "control.ops.cli", "workers", "preempt", victim[0], "--in-s", "60",
               "--etcd", sup.etcd_url]
        done = await asyncio.to_thread(subprocess.run, cmd, cwd=REPO, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr

    async with httpx.AsyncClient() as client:
        tasks = [one_stream(client, sup.http_url + "/v1/completions", b, headers, lg) for b, lg in zip(bodies(), logs)]
        extra = [preempt()] if notice_after is not None else []
        texts = (await asyncio.gather(*tasks, *extra))[: len(tasks)]
    return texts, logs, victim[0]


def test_a_preemption_notice_during_six_streams_loses_and_repeats_nothing(tmp_path):
    from tests.e2e.helpers import tiny_deployment

    tiny = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"), context_length=2048)
    args = {"worker": ["--kv-cache-bytes", "8000000", "--no-progress", "--dtype", "float32",
                         "--quantization", "none"]}  # exact: int8 activation rounding depends on the batch
    with tiny_deployment(tmp_path / "state", tiny, args, workers=2, watch_registry=False,
                         context_length=2048) as sup:
        t0 = time.monotonic()
        reference, _, _ = run_sync(sup)
        t_ref = time.monotonic() - t0
        texts, logs, victim = run_sync(sup, notice_after=40)
        other = {"worker-0": "worker-1", "worker-1": "worker-0"}[victim]
        giver = (sup.logs_dir / f"{victim}.log").read_text(errors="replace")
        receiver = (sup.logs_dir / f"{other}.log").read_text(errors="replace")
    moved = re.findall(r"handed (\S+) over", giver)
    resumed = {rid: (int(n), float(ms)) for rid, n, ms in
               re.findall(r"resumed (\S+) at chunk (\d+): hand-over gap (\d+) ms", receiver)}
    print(f"reference run {t_ref:.1f} s; sequences moved off {victim}: {len(moved)}")
    at_client = []
    for i, lg in enumerate(logs):
        steps = sorted((b[0] - a[0]) * 1e3 for a, b in zip(lg, lg[1:]))
        rid = next((r for r in resumed if r in lg[0][2]), None)
        line = (f"stream {i}: {len(lg)} events, inter-event p50 {steps[len(steps) // 2]:.1f} ms, "
                f"p99 {steps[int(len(steps) * 0.99)]:.0f} ms, largest {steps[-1]:.0f} ms")
        if rid is not None:
            n, ms = resumed[rid]
            line += f"; moved at chunk {n}: {ms:.0f} ms at the receiver"
            if len(lg) == MAX_TOKENS:  # one event per chunk (none held back): the hand-over is between n-1 and n
                at_client.append((lg[n][0] - lg[n - 1][0]) * 1e3)
                line += f", {at_client[-1]:.0f} ms at the client"
        print(line)
    assert len(texts) == 6 and all(texts)
    for i, (got, want) in enumerate(zip(texts, reference)):
        assert got == want, f"stream {i} differs from its uninterrupted run at char " \
                            f"{next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))}"
    assert moved and sorted(moved) == sorted(resumed), (moved, resumed)  # each one resumed exactly once
    assert max(at_client, default=0) < 5000 and max(ms for _, ms in resumed.values()) < 5000


def run_sync(sup, notice_after: int | None = None):
    return asyncio.run(run(sup, notice_after))
