"""Cross-tenant prefix-cache timing test (issue [11] target; docs/decisions/0031-kv-isolation-and-cache-salt.md).

On its own stack (default model, one worker), per trial i: tenant A sends a long prompt P_i (caching its
blocks); then, in random order, tenant B sends P_i (the *probe*: A's cached prompt), B sends a fresh prompt
F_i of the same length (the *fresh* baseline), and A sends P_i again (the *hit*: the positive control, a
prefix hit within one tenant). TTFT is measured on the client (streamed chat, 1 token). The probe and
the fresh distributions must be the same (two-sided Mann-Whitney U, p >= 0.01: B cannot tell whether A sent
P_i), and the hit must differ from fresh (p < 0.001: the test can tell a hit from a miss).

    python -m bench.cache_isolation_bench [--trials 50] [--prompt-words 400] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

WORDS = ("amber basalt cobalt dune ember fjord glacier harbor island jungle karst lagoon mesa nebula oasis "
         "prairie quarry reef savanna tundra upland valley wetland xeric yardang zenith").split()


def make_prompt(rng: random.Random, words: int) -> str:
    """A random prompt of ``words`` words (distinct per call: a fresh prefix)."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def ttft_ms(client, url: str, key: str, text: str) -> float:
    """Client TTFT (ms) of a streamed 1-token chat request."""
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": text}], "max_tokens": 1,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    async with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"},
                             timeout=120) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data:") and '"content"' in line:
                return (time.perf_counter() - t0) * 1e3
    raise RuntimeError("stream ended without a token")


async def trials(url: str, keys: dict[str, str], n: int, words: int, seed: int) -> dict[str, list[float]]:
    """``n`` trials; TTFT lists (ms) of ``probe``, ``fresh`` and ``hit``."""
    import httpx

    rng, out = random.Random(seed), {"probe": [], "fresh": [], "hit": []}
    async with httpx.AsyncClient() as client:
        for _ in range(n):
            secret, fresh = make_prompt(rng, words), make_prompt(rng, words)
            await ttft_ms(client, url, keys["a"], secret)
            runs = [("probe", keys["b"], secret), ("fresh", keys["b"], fresh), ("hit", keys["a"], secret)]
            rng.shuffle(runs)
            for kind, key, text in runs:
                out[kind].append(await ttft_ms(client, url, key, text))
    return out


def compare(samples: dict[str, list[float]]) -> dict[str, Any]:
    """Medians and Mann-Whitney U p-values (scipy.stats.mannwhitneyu, two-sided) of probe vs fresh, hit vs
    fresh, and whether the issue's target holds."""
    from scipy.stats import mannwhitneyu

    p_probe = float(mannwhitneyu(samples["probe"], samples["fresh"], alternative="two-sided").pvalue)
    p_hit = float(mannwhitneyu(samples["hit"], samples["fresh"], alternative="two-sided").pvalue)
    med = {k: round(statistics.median(v), 2) for k, v in samples.items()}
    return {"median_ttft_ms": med, "p_probe_vs_fresh": p_probe, "p_hit_vs_fresh": p_hit,
            "isolated": p_probe >= 0.01, "control_detects_hit": p_hit < 0.001,
            "met": p_probe >= 0.01 and p_hit < 0.001}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the stack, make tenants a and b, run the trials; the report."""
    from bench.fairness_stack import setup_tenants
    from control.ops.supervisor import Supervisor
    from control.ops.stack_config import StackConfig

    with tempfile.TemporaryDirectory() as state:
        sup = Supervisor(StackConfig(Path(state), port=0, supervise=False,
                                     actor_args={"worker": list(args.worker_arg)}))
        sup.start()
        try:
            sup.wait_ready(timeout=240)
            tag = uuid.uuid4().hex[:6]
            made = asyncio.run(setup_tenants(sup.etcd_url, (f"iso-a-{tag}", f"iso-b-{tag}")))
            keys = {"a": made[f"iso-a-{tag}"], "b": made[f"iso-b-{tag}"]}
            time.sleep(2.5)  # gateways and the scheduler pick the tenants up
            url = sup.http_url + "/v1/chat/completions"
            asyncio.run(trials(url, keys, 3, args.prompt_words, args.seed + 1))  # warm-up (kernels, first shapes)
            samples = asyncio.run(trials(url, keys, args.trials, args.prompt_words, args.seed))
        finally:
            sup.stop()
    return {"trials": args.trials, "prompt_words": args.prompt_words, **compare(samples), "samples_ms": samples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cache_isolation_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--prompt-words", type=int, default=400, help="words per prompt (~1.3 tokens each)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker argument (repeatable)")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    if args.trials < 5:
        p.error("--trials must be >= 5")
    rep = run(args)
    med = rep["median_ttft_ms"]
    print(f"median TTFT ms: fresh {med['fresh']}  cross-tenant probe {med['probe']}  same-tenant hit {med['hit']}")
    print(f"probe vs fresh p={rep['p_probe_vs_fresh']:.3g} ({'same' if rep['isolated'] else 'DIFFERENT'}); "
          f"hit vs fresh p={rep['p_hit_vs_fresh']:.3g} ({'detected' if rep['control_detects_hit'] else 'NOT detected'})")
    print("target met" if rep["met"] else "target MISSED")
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2))
    return 0 if rep["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
