"""Wake -> first token of a sleeping worker of the default model (issue [28] target: <= 2 s, median of 10).

On its own stack (the supervisor as ``actorserve up`` runs it, the default model, one worker, the sleeping tier
on): a desired worker count of 0 puts the worker to sleep (its KV cache freed: the resident-memory drop is read
from its etcd record); then a streamed 1-token chat request is sent and timed to its first token. With every
worker asleep the request waits, its scheduler writes the wake command, the worker re-makes its KV cache and
publishes credits, and the request is dispatched. Once it is answered the count (still 0) puts the worker back
to sleep, and the next round starts. Also printed: the worker's own wake time (command -> serving) per round.

    python -m bench.sleep_wake_bench [--rounds 10] [--json PATH]

Run it with nothing else on the machine; the CPU is named in the output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

TARGET_S = 2.0


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


async def _desired(etcd: str, name: str, version: str, count: int) -> None:
    from control.state.names import desired_key
    from control.state.registry import Registry

    async with Registry.connect(etcd) as reg:
        await reg.put_json(desired_key("worker", name, version, "local"),
                           {"count": count, "ts": time.time(), "reason": "bench", "by": "bench"})


async def _sleep_record(etcd: str, name: str, version: str) -> dict:
    from control.state.names import workers_prefix
    from control.state.registry import Registry

    async with Registry.connect(etcd) as reg:
        recs = await reg.get_prefix_json(workers_prefix(name, version))
    return next(iter(recs.values()), {}).get("sleep", {})


def _wait_asleep(etcd: str, name: str, version: str, timeout_s: float = 60.0) -> dict:
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        rec = asyncio.run(_sleep_record(etcd, name, version))
        if rec.get("state") == "sleeping":
            return rec
        time.sleep(0.1)
    raise RuntimeError("the worker did not fall asleep")


def _first_token_s(url: str, key: str, model: str) -> float:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": True}
    t0 = time.monotonic()
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request answered {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if line.startswith("data:") and '"content"' in line:
                return time.monotonic() - t0
    raise RuntimeError("no token")


def run(rounds: int) -> dict:
    """The bench (module docstring); returns its figures."""
    from control.ops.stack_config import StackConfig
    from control.ops.supervisor import Supervisor

    with tempfile.TemporaryDirectory(prefix="sleep-bench-") as tmp:
        sup = Supervisor(StackConfig(Path(tmp) / "state", port=0, workers=1, sleep_horizon_s=3600.0,
                                     stop_timeout_s=10.0))
        sup.start()
        try:
            sup.wait_ready(timeout=300)
            name, version = sup.cfg.model_name, sup.cfg.model_version
            key = (sup.state_dir / "dev-api-key").read_text().strip()
            url = sup.gateway_url(0) + "/v1/chat/completions"
            _first_token_s(url, key, name)  # warm path
            asyncio.run(_desired(sup.etcd_url, name, version, 0))
            rows = []
            for _ in range(rounds):
                asleep = _wait_asleep(sup.etcd_url, name, version)
                ttft = _first_token_s(url, key, name)
                woke = asyncio.run(_sleep_record(sup.etcd_url, name, version))
                rows.append({"first_token_s": round(ttft, 3), "worker_wake_s": woke.get("wake_s"),
                             "freed_bytes": asleep.get("freed_bytes"), "kv_bytes": asleep.get("kv_bytes")})
                time.sleep(0.5)
        finally:
            sup.stop()
    med = statistics.median(r["first_token_s"] for r in rows)
    return {"cpu": _cpu(), "rounds": rows, "median_first_token_s": round(med, 3), "target_s": TARGET_S,
            "met": med <= TARGET_S, "median_worker_wake_s": statistics.median(r["worker_wake_s"] or 0 for r in rows)}


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print the table and the median against the target; exit 1 when missed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    out = run(args.rounds)
    print(f"CPU: {out['cpu']}")
    print("round  first token s  worker wake s  freed MB  KV MB")
    for i, r in enumerate(out["rounds"]):
        print(f"{i:5d}  {r['first_token_s']:13.3f}  {r['worker_wake_s'] or 0:13.3f}  "
              f"{(r['freed_bytes'] or 0) / 2**20:8.1f}  {(r['kv_bytes'] or 0) / 2**20:5.1f}")
    print(f"median wake -> first token {out['median_first_token_s']:.3f} s (target <= {TARGET_S} s): "
          f"{'met' if out['met'] else 'MISSED'}; median worker wake {out['median_worker_wake_s']:.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if out["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
