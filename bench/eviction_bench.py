"""Eviction for real (issue [11] target; docs/model-loading.md "Multi-version hosts").

On its own ``up --multi-model`` stack (one worker host), two versions with distinct artifacts: the default
model and a random-weights Llama of similar size written with ``gguf`` (SmolLM2-135M's shapes: 30 layers,
d 576, 9 heads, 3 KV heads, MLP 1536; the tiny test vocabulary). Their converted weights are measured
in-process first (the path the worker takes: dtype and quantization auto), and the host's budget is set to
hold one of them with its KV floor, never both. Alternating requests (``--rounds`` each, one at a time, each
with a deadline of ``--deadline-ms``) make the host evict one and load the other for every request.

Reported: every request's status and latency (the first request after a switch waits for the eviction and
the load on demand), the host's loads, evictions and forced evictions (an eviction that had to end running
requests: 0 means every eviction happened between requests), and the baseline of the same run: the latency of
a request to the version already resident (no switch). Targets: no request fails; no forced eviction; each
request after a switch is served within its deadline.

    python -m bench.eviction_bench [--rounds 4] [--deadline-ms 60000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cold_start_bench import cpu_name, host_record, kernel_caches

FLOOR = 64 * 2**20  # --kv-floor-bytes and --kv-cache-bytes of each version


def write_other(path: Path) -> str:
    """The random-weights model (module docstring)."""
    from bench.tiny_model import write_tiny_llama_gguf

    return write_tiny_llama_gguf(str(path), n_layers=30, d=576, n_heads=9, n_kv_heads=3, ffn=1536,
                                 context_length=2048, seed=3)


def weights_bytes(artifact: str) -> int:
    """Converted weights of ``artifact`` on the worker's default path (bytes), measured by loading it."""
    import argparse as ap

    from actors.worker.actor import build_engine, add_arguments

    p = ap.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", "x@1", "--no-progress", "--kv-cache-bytes", str(FLOOR), "--max-loras", "0"])
    engine = build_engine({"artifact": artifact, "format": "gguf"}, args)
    return int(engine.weights_bytes)


def chat(url: str, key: str, model: str, deadline_ms: int) -> tuple[int, float, str]:
    """(status, seconds, error text) of one 8-token chat."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8,
            "deadline_ms": deadline_ms}
    t0 = time.monotonic()
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=deadline_ms / 1e3 + 10)
    return r.status_code, time.monotonic() - t0, "" if r.status_code == 200 else r.text[:300]


def register(sup, name: str, artifact: str, memory_bytes: int) -> None:
    import subprocess

    cmd = [sys.executable, "-m", "control.ops.cli", "models", "register", name, "1", "--artifact", artifact,
           "--memory-bytes", str(memory_bytes), "--state-dir", str(sup.state_dir)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"models register failed: {p.stderr.strip()}")


def served(url: str, key: str, model: str, timeout_s: float = 300) -> None:
    t_end = time.monotonic() + timeout_s
    while chat(url, key, model, 60000)[0] != 200:
        if time.monotonic() > t_end:
            raise RuntimeError(f"{model} not served within {timeout_s:.0f} s")
        time.sleep(0.5)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from control.ops.supervisor import DEFAULT_MODEL_NAME, Supervisor
    from control.ops.stack_config import StackConfig

    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        kernel_caches(cache)
        other = write_other(Path(tmp) / "other.gguf")
        import os
        os.environ["ACTORSERVE_CACHE_DIR"] = str(cache)  # the in-process loads write the stack's weights cache
        from control.ops.deploy import default_model_file
        w_default, w_other = weights_bytes(str(default_model_file())), weights_bytes(other)
        budget = max(w_default, w_other) + FLOOR + 32 * 2**20
        assert w_default + w_other + 2 * FLOOR > budget, "the budget would hold both"
        worker = ["--no-progress", "--memory-budget-bytes", str(budget), "--kv-floor-bytes", str(FLOOR),
                  "--kv-cache-bytes", str(FLOOR), "--max-loras", "0"]
        sup = Supervisor(StackConfig(Path(tmp) / "state", port=0, supervise=True,
                                     env={"ACTORSERVE_CACHE_DIR": str(cache)},
                                     actor_args={"worker": worker}, multi_model=True))
        sup.start()
        try:
            sup.wait_ready(timeout=300)
            url, key = sup.http_url + "/v1/chat/completions", sup.dev_api_key
            served(url, key, DEFAULT_MODEL_NAME)
            resident = [chat(url, key, DEFAULT_MODEL_NAME, args.deadline_ms)[1] for _ in range(3)]  # baseline
            register(sup, "other", other, w_other)
            served(url, key, "other")
            rows = []
            for i in range(2 * args.rounds):
                model = DEFAULT_MODEL_NAME if i % 2 == 0 else "other"
                status, took, err = chat(url, key, model, args.deadline_ms)
                rows.append({"model": model, "status": status, "s": round(took, 3), "error": err})
            host = host_record(sup.etcd_url)
        finally:
            sup.stop()
    switched = [r["s"] for r in rows]
    return {"cpu": cpu_name(), "budget_bytes": budget, "weights_bytes": {"default": w_default, "other": w_other},
            "kv_floor_bytes": FLOOR, "requests": rows, "host": {k: host.get(k) for k in
                                                               ("loads", "evictions", "forced_evictions",
                                                                "failed_loads", "held_bytes", "budget_bytes")},
            "resident_request_s": round(statistics.median(resident), 3),
            "switch_request_s": {"median": round(statistics.median(switched), 3), "max": round(max(switched), 3)},
            "switch_over_resident": round(statistics.median(switched) / statistics.median(resident), 2),
            "ok": all(r["status"] == 200 for r in rows) and not host.get("forced_evictions")
            and max(switched) * 1e3 <= args.deadline_ms}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.eviction_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="requests to each version, alternating (default 4)")
    p.add_argument("--deadline-ms", type=int, default=60000, help="each request's deadline (default 60000)")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    rep = run(args)
    print(f"CPU: {rep['cpu']}")
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    print(f"budget {mib(rep['budget_bytes'])}: weights default {mib(rep['weights_bytes']['default'])}, other "
          f"{mib(rep['weights_bytes']['other'])}, KV floor {mib(rep['kv_floor_bytes'])} each")
    for r in rep["requests"]:
        print(f"  {r['model']:<24} {r['status']} {r['s']:.2f} s {r['error']}")
    print(f"host: {rep['host']}")
    print(f"request to the resident version (baseline, same run): median {rep['resident_request_s']:.2f} s; after a "
          f"switch: median {rep['switch_request_s']['median']:.2f} s, max {rep['switch_request_s']['max']:.2f} s "
          f"({rep['switch_over_resident']}x)")
    print("targets: " + ("met" if rep["ok"] else "MISSED"))
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
