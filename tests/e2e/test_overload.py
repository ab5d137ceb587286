"""Overload: offer 10x measured capacity for 30 s to a real stack (tiny model, small queues).

Requests generate ``tokens`` tokens each so that capacity is a few requests per second and 10x of it stays
within what the load generator and gateway can offer on 2 shared cores (at 150 req/s the client's own lag
passed deadline + 5 s). ``tokens`` starts at MAX_TOKENS and grows (up to MAX_TOKENS_CAP, within the model's
context) when this CPU decodes so fast that 10x capacity would pass MAX_RATE (CI once measured 6.3 req/s at
384 tokens); the test fails only if even the longest requests leave 10x capacity beyond MAX_RATE.

Checks: every request gets a response (200) or a clear error (429/503 with Retry-After) before its
deadline + 5 s; none hangs; the resident memory of every actor stays bounded. Loopback only; the
load loop is bounded in count and time.

30 s (it was 60 s: the slowest test of ``make test``) with the RSS bound tightened with it (150 -> 50 MiB per actor,
the issue [17] target): a leak is caught from the same bytes per request (~1,000 requests, 50 KiB each) as
before (~2,000 requests, 75 KiB each).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.helpers import tiny_deployment
from tests.engine_fixtures import write_tiny_llama_gguf

DEADLINE_MS = 5000
DURATION_S = 30.0
RSS_GROWTH_MIB = 50.0  # per actor over the overload phase
MAX_RATE = 60.0  # req/s the load generator can offer on 2 shared cores without its own lag
MAX_TOKENS = 384  # per request: capacity ~3.5-6.5 req/s on the tiny model (4 slots), so 10x capacity is ~35-65 req/s
MAX_TOKENS_CAP = 1536  # longest requests (the module's model has a 2048-token context)
TARGET_RATE = 0.6 * MAX_RATE  # aim for 10x capacity here when the first measurement is too fast


def rss_mb(pid: int) -> float:
    """Resident set size of a process (MiB) from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def auth_headers(sup) -> dict:
    key_file = Path(sup.state_dir) / "dev-api-key"
    return {"Authorization": f"Bearer {key_file.read_text().strip()}"} if key_file.exists() else {}


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory):
    model = str(tmp_path_factory.mktemp("overload-model") / "tiny.gguf")
    write_tiny_llama_gguf(model, context_length=2048)
    with tiny_deployment(tmp_path_factory.mktemp("overload"), model, {
            # float32, no quantization: the default auto path (bf16 + int4 on AVX-512 BF16) doubles capacity,
            # and 10x of it then exceeds MAX_RATE (CI: 7.8 req/s); this test is about shedding, not kernels
            "worker": ["--kv-cache-bytes", "8000000", "--max-num-seqs", "4", "--no-progress",
                       "--dtype", "float32", "--quantization", "none"],
            "scheduler": ["--max-queue-len", "32", "--max-queue-per-tenant", "32"]}) as sup:
        yield sup


async def one(client: httpx.AsyncClient, url: str, headers: dict, i: int, tokens: int) -> tuple[int, float, bool]:
    """(status, seconds, clear_error) of one request of ``tokens`` generated tokens; status 0 = no answer
    within deadline + 5 s."""
    body = {"model": "tiny", "prompt": f"load {i}", "max_tokens": tokens, "ignore_eos": True, "deadline_ms": DEADLINE_MS}
    t0 = time.monotonic()
    try:
        r = await client.post(url, json=body, headers=headers, timeout=DEADLINE_MS / 1e3 + 5)
    except httpx.TimeoutException:
        return 0, time.monotonic() - t0, False
    clear = r.status_code == 200 or (r.status_code in (429, 503) and "Retry-After" in r.headers
                                     and "error" in r.json())
    return r.status_code, time.monotonic() - t0, clear


async def capacity(url: str, headers: dict, tokens: int) -> float:
    """Completed requests/s of ``tokens`` tokens each with 8 concurrent closed-loop clients for 6 s."""
    done, t_end = 0, time.monotonic() + 6

    async def loop(client):
        nonlocal done
        while time.monotonic() < t_end:
            status, _, _ = await one(client, url, headers, done, tokens)
            done += status == 200
    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(loop(client) for _ in range(8)))
    return done / 6


async def offer(url: str, headers: dict, rate: float, tokens: int) -> list[tuple[int, float, bool]]:
    """Open-loop arrivals at ``rate`` req/s for DURATION_S (bounded: at most rate * DURATION_S requests)."""
    tasks = []
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.monotonic()
        for i in range(int(rate * DURATION_S)):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(client, url, headers, i, tokens)))
        return await asyncio.gather(*tasks)


@pytest.mark.slow  # 20-50 s: in `make test-slow` (CI runs it after `make test`) to keep `make test` under 20 min
def test_overload_sheds_clearly_and_stays_bounded(small_stack):
    url, headers = small_stack.http_url + "/v1/completions", auth_headers(small_stack)
    tokens = MAX_TOKENS
    cap = asyncio.run(capacity(url, headers, tokens))
    assert cap > 0
    if 10 * cap > TARGET_RATE:  # a fast CPU: longer requests bring 10x capacity within the generator's reach
        tokens = min(MAX_TOKENS_CAP, int(tokens * 10 * cap / TARGET_RATE))
        cap = asyncio.run(capacity(url, headers, tokens))
        assert cap > 0
    actors = {n: p for n, p in small_stack.pids.items() if n not in ("nats", "etcd")}
    rss_before = {n: rss_mb(p) for n, p in actors.items()}
    rate = 10 * cap
    assert rate <= MAX_RATE, f"capacity {cap:.1f} req/s: 10x is beyond what the load generator can offer"
    results = asyncio.run(offer(url, headers, rate, tokens))
    rss_after = {n: rss_mb(p) for n, p in actors.items()}
    statuses = [s for s, _, _ in results]
    hung = statuses.count(0)
    unclear = [s for s, _, c in results if not c]
    print(f"{tokens} tokens per request: capacity {cap:.1f} req/s, offered {rate:.1f} req/s x {DURATION_S:.0f} s = {len(results)}; "
          f"200: {statuses.count(200)}, 429: {statuses.count(429)}, 503: {statuses.count(503)}, hung: {hung}; "
          f"goodput {statuses.count(200) / DURATION_S / cap:.0%} of capacity; "
          f"max latency {max(t for _, t, _ in results):.1f} s; RSS MiB before {rss_before} after {rss_after}")
    assert hung == 0 and not unclear
    assert max(t for _, t, _ in results) <= DEADLINE_MS / 1e3 + 5
    assert statuses.count(200) > 0 and statuses.count(200) < len(results)  # served some, shed the excess
    for n in actors:
        assert rss_after[n] - rss_before[n] < RSS_GROWTH_MIB, f"{n} grew {rss_after[n] - rss_before[n]:.0f} MiB"
