"""Registry edit -> first token of a new version (issue [11] target; docs/model-loading.md).

On its own ``actorserve up`` stack (default model, one worker, the registry watched): register version N of
the default model (same artifact) with ``actorserve models register`` and stream 1-token chat requests naming
``NAME@N`` every 50 ms until one answers with a token. The time from the register command's return (the edit
is in etcd) to that token covers the supervisor seeing the edit, the new scheduler's start and election, the
worker's load (registry read, artifact or converted-weights cache read, quantization, warm-up), credits,
routing and the first token. With ``--multi-model`` the worker is a multi-version host (actors/worker/host.py):
the new scheduler asks it to load the version, and the load shares the running version's weights (same
artifact), so it costs a KV cache allocation, not a process start or a weights read.

Two runs in the same stack: *cold* (the converted-weights cache emptied first; the CPU-kernel build and
path-choice caches kept, they are per machine) and *warm* (the next version, the cache written by the cold
load). Targets: warm <= 2 s, cold <= 5 s. The stack uses its own ``$ACTORSERVE_CACHE_DIR`` (a copy of the
machine's kernel caches), so the user's weights cache is never touched.

    python -m bench.cold_start_bench [--json PATH] [--worker-arg ARG ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGETS_S = {"warm": 2.0, "cold": 5.0}


def kernel_caches(dest: Path) -> None:
    """Copy the machine's CPU-kernel caches (build folder, path-choice JSON) into ``dest``."""
    src = Path(os.environ.get("ACTORSERVE_CACHE_DIR") or Path.home() / ".cache" / "actorserve")
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("kernel_choice.json", "kernels"):
        if (src / name).is_dir():
            shutil.copytree(src / name, dest / name, dirs_exist_ok=True)
        elif (src / name).is_file():
            shutil.copy2(src / name, dest / name)


def first_token_s(url: str, key: str, model: str, timeout_s: float = 180.0) -> float:
    """Monotonic s at which a streamed 1-token chat request naming ``model`` first returned a token (polled
    every 50 ms; RuntimeError after ``timeout_s``)."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": True}
    t_end = time.monotonic() + timeout_s
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < t_end:
            with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                if r.status_code == 200:
                    for line in r.iter_lines():
                        if line.startswith("data:") and '"content"' in line:
                            return time.monotonic()
            time.sleep(0.05)
    raise RuntimeError(f"{model}: no token within {timeout_s:.0f} s")


def register(sup, version: str) -> float:
    """``actorserve models register`` version ``version`` of the stack's model; monotonic s of its return."""
    cmd = [sys.executable, "-m", "control.ops.cli", "models", "register", sup.cfg.model_name, version,
           "--artifact", str(sup.manifest["artifact"]), "--state-dir", str(sup.state_dir)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"models register failed: {p.stderr.strip()}")
    return time.monotonic()


def worker_load(sup, version: str) -> dict[str, Any]:
    """The new version's worker record: load phases and residency (None fields when not there)."""
    import asyncio

    from control.state.registry import Registry

    async def read() -> dict:
        async with Registry.connect(sup.etcd_url, timeout=5) as reg:
            return next(iter((await reg.list_workers(sup.cfg.model_name, version)).values()), {})
    rec = asyncio.run(read())
    return {"load_phases": rec.get("load_phases"), "load_s": rec.get("load_s"), "memory": rec.get("memory")}


def host_record(etcd_url: str) -> dict:
    """The stack's one multi-version host record (empty when there is none)."""
    import asyncio

    from control.state.registry import Registry

    async def read() -> dict:
        async with Registry.connect(etcd_url, timeout=5) as reg:
            return next(iter((await reg.list_hosts()).values()), {})
    return asyncio.run(read())


def host_rows(sup) -> list[dict]:
    """The multi-version host's resident rows (model, weights / KV bytes, shared) from its etcd record."""
    rec = host_record(sup.etcd_url)
    return [{k: r.get(k) for k in ("model", "weights_bytes", "kv_bytes", "shared")} for r in rec.get("resident", [])] \
        + [{"held_bytes": rec.get("held_bytes"), "budget_bytes": rec.get("budget_bytes")}]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the stack, time the cold then the warm version; the report."""
    from control.ops.supervisor import Supervisor
    from control.ops.stack_config import StackConfig

    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        kernel_caches(cache)
        sup = Supervisor(StackConfig(Path(tmp) / "state", port=0, supervise=True,
                                     env={"ACTORSERVE_CACHE_DIR": str(cache)},
                                     actor_args={"worker": ["--no-progress", *args.worker_arg]},
                                     multi_model=args.multi_model))
        sup.start()
        try:
            sup.wait_ready(timeout=300)
            url, key = sup.http_url + "/v1/chat/completions", sup.dev_api_key
            first_token_s(url, key, sup.model_ref)  # the stack serves (and wrote the weights cache of v1)
            out: dict[str, Any] = {}
            for kind, version in (("cold", "2"), ("warm", "3")):
                if kind == "cold":
                    shutil.rmtree(cache / "weights", ignore_errors=True)
                t0 = register(sup, version)
                took = first_token_s(url, key, f"{sup.cfg.model_name}@{version}") - t0
                out[kind] = {"version": version, "edit_to_first_token_s": round(took, 3),
                             "target_s": TARGETS_S[kind], "met": took <= TARGETS_S[kind], **worker_load(sup, version)}
            hosts = host_rows(sup) if args.multi_model else []
        finally:
            sup.stop()
    return {"cpu": cpu_name(), "multi_model": args.multi_model, "runs": out, "host_resident": hosts, "warm_over_cold": round(out["warm"]["edit_to_first_token_s"]
                                                                   / out["cold"]["edit_to_first_token_s"], 3)}


def cpu_name() -> str:
    """The CPU model name (``/proc/cpuinfo``), "" where unknown."""
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cold_start_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker argument (repeatable)")
    p.add_argument("--multi-model", action="store_true", help="the stack's worker is a multi-version host "
                   "(``up --multi-model``): the new version is loaded into the running worker process, sharing the "
                   "weights of the same artifact")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    rep = run(args)
    print(f"CPU: {rep['cpu']}")
    for kind, r in rep["runs"].items():
        print(f"{kind}: registry edit -> first token {r['edit_to_first_token_s']:.2f} s (target <= {r['target_s']} s: "
              f"{'met' if r['met'] else 'MISSED'}); worker load {r['load_s']} s {r['load_phases']}")
    print(f"warm / cold: {rep['warm_over_cold']}")
    for row in rep["host_resident"]:
        print(f"host: {row}")
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2))
    return 0 if all(r["met"] for r in rep["runs"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
