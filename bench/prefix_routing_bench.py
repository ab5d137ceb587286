"""``actorserve bench prefix-routing``: prefix-cache hit rate with affinity routing vs random routing.

For each routing policy a fresh stack (tiny model unless ``--model-file``; 2 workers) serves the same
request list: ``--prefixes`` shared prefixes of ``--prefix-tokens`` token ids, each request one of them
plus a distinct 16-token suffix, sent ``--concurrency`` at a time (bounded count, loopback only). The
hit rate is prompt tokens served from the workers' prefix caches over prompt tokens looked up, from the
workers' own statistics (``as.int.stats.<worker_id>``). JSON keys: ``affinity_hit_rate``,
``random_hit_rate``, ``hit_rate_ratio``, ``requests``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path


def request_list(num_requests: int, num_prefixes: int, prefix_tokens: int, vocab: int, seed: int = 0) -> list:
    """Token-id prompts: a shared prefix (of ``num_prefixes``) + a distinct 16-token suffix each."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix_tokens)] for _ in range(num_prefixes)]
    return [rng.choice(prefixes) + [rng.randrange(3, vocab) for _ in range(16)] for _ in range(num_requests)]


async def latest_stats(nats_url: str, worker_ids: list[str], timeout: float = 5.0) -> dict:
    """One fresh WorkerStats per worker (they publish every second)."""
    from bus import subjects
    from bus.messages import WorkerStats
    from bus.nats_bus import NatsBus
    bus = await NatsBus.connect(nats_url, name="bench-stats")
    got: dict[str, WorkerStats] = {}

    async def on(msg):
        st = WorkerStats.decode(msg.data)
        got[st.worker_id] = st
    sub = await bus.subscribe(subjects.stats_all(), on)
    t_end = time.monotonic() + timeout
    while set(got) < set(worker_ids) and time.monotonic() < t_end:
        await asyncio.sleep(0.05)
    await sub.unsubscribe()
    await bus.close()
    return got


async def send_all(url: str, key: str, prompts: list, concurrency: int) -> int:
    """Send every prompt (completions, 1 token), ``concurrency`` at a time; returns how many got 200."""
    import httpx  # not imported at module level: `actorserve --help` imports this module

    sem, ok = asyncio.Semaphore(concurrency), 0

    async def one(client, p):
        nonlocal ok
        async with sem:
            r = await client.post(url, json={"model": "bench", "prompt": p, "max_tokens": 1},
                                  headers={"Authorization": f"Bearer {key}"}, timeout=120)
            ok += r.status_code == 200
    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(one(client, p) for p in prompts))
    return ok


def measure(args: argparse.Namespace, routing: str, prompts: list, state: Path) -> float:
    """Hit rate of one routing policy on a fresh stack."""
    from control.ops.supervisor import Supervisor
    from control.ops.stack_config import StackConfig

    sup = Supervisor(StackConfig(state / routing, port=0, workers=2, model_file=args.model_file, model_name="bench",
                                 supervise=False, actor_args={"scheduler": ["--routing", routing],
                                                  "worker": ["--no-progress", "--kv-cache-bytes", str(args.kv_bytes)]}))
    sup.start()
    try:
        sup.wait_ready(timeout=180)
        key = (Path(sup.state_dir) / "dev-api-key").read_text().strip()
        ok = asyncio.run(send_all(sup.http_url + "/v1/completions", key, prompts, args.concurrency))
        if ok != len(prompts):
            raise RuntimeError(f"{routing}: only {ok}/{len(prompts)} requests succeeded")
        time.sleep(1.5)  # one stats period
        stats = asyncio.run(latest_stats(sup.nats_url, ["worker-0", "worker-1"]))
    finally:
        sup.stop()
    hit = sum(s.prefix_cache_hit_tokens for s in stats.values())
    query = sum(s.prefix_cache_query_tokens for s in stats.values())
    return hit / max(1, query)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``actorserve bench prefix-routing``."""
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--state-dir", default=".actorserve-bench-prefix", help="state dir of the bench stacks")
    parser.add_argument("--model-file", default=None, help="GGUF to serve (default: a tiny random Llama written here)")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-bytes", type=int, default=2_000_000,
                        help="KV cache budget per worker (bytes; default: ~240 tiny-model blocks, room for about "
                             "half the prefixes, so routing decides what stays cached)")


def main(args: argparse.Namespace) -> int:
    """Run both policies, print and optionally write JSON."""
    state = Path(args.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    vocab = 49152
    if args.model_file is None:
        from bench.tiny_model import write_tiny_llama_gguf
        args.model_file = str(state / "tiny.gguf")
        write_tiny_llama_gguf(args.model_file)
        vocab = 269
    prompts = request_list(args.requests, args.prefixes, args.prefix_tokens, vocab)
    res = {"requests": len(prompts), "prefixes": args.prefixes, "prefix_tokens": args.prefix_tokens}
    for routing in ("affinity", "random"):
        res[f"{routing}_hit_rate"] = round(measure(args, routing, prompts, state), 4)
    res["hit_rate_ratio"] = round(res["affinity_hit_rate"] / max(1e-9, res["random_hit_rate"]), 3)
    print(f"prefix-cache hit rate over {len(prompts)} requests ({args.prefixes} prefixes x {args.prefix_tokens} "
          f"tokens, 2 workers): affinity {res['affinity_hit_rate']:.3f}, random {res['random_hit_rate']:.3f} "
          f"(x{res['hit_rate_ratio']})")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="actorserve bench prefix-routing")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
