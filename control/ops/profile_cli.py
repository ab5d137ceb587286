"""``actorserve profile MODEL@VERSION``: measure a version's throughput curve on this machine and store it.

    actorserve profile NAME@VERSION [--pool local] [--batches 1,2,4,8,16] [--prompts 32,128,512]
                       [--decode-prompt-tokens 64] [--decode-tokens 32] [--dtype auto] [--quantization auto]
                       [--device cpu] [--kv-cache-bytes N]
                       [--threads N] [--repeats 2] [--json PATH] [--no-store]

Loads the version's manifest from the registry and runs our engine in this process, built exactly as a
worker builds it (actors.worker.actor.build_engine, with the worker's defaults), then measures with the
offline engine bench's drivers (bench/engine_bench.py):

* decode: for each batch size ``b``, ``b`` sequences of ``--decode-prompt-tokens`` random tokens generate
  ``--decode-tokens`` tokens each (EOS ignored), after a warm-up at that size; tokens/s is counted from the
  step at which every sequence has its first token to the end (engine_decode), and ITL = ``1000 x b /
  tokens_per_s`` ms (every step of that window makes one token per sequence);
* prefill: TTFT of one request of each prompt length run alone (engine_ttft), prefix cache cleared before
  each; every point is the best of ``--repeats`` runs (default 2).

Prints a table naming the CPU, stores ``ThroughputCurve.to_json()`` at ``profile_key(name, version, pool)``
(unless ``--no-store``) and writes it to ``--json PATH``. The curve is of one worker alone on the machine;
workers sharing its cores each get less. Exit 0 done, 1 unknown version or bad sizes, 3 etcd unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

from actors.runtime import common_arguments, resolve_endpoints
from control.ops.cli_errors import is_unreachable, report_unreachable


def _sizes(value: str) -> tuple[int, ...]:
    """argparse type: comma-separated positive integers, e.g. ``1,2,4``."""
    try:
        out = tuple(sorted({int(v) for v in value.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of integers") from None
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: give integers >= 1")
    return out


def add_profile_command(sub: Any) -> None:
    """Add the ``profile`` verb to the CLI's subparsers ``sub``."""
    from control.ops.argtypes import positive_int

    p = sub.add_parser("profile", help="measure a model version's throughput curve on this machine (etcd)",
                       description="Run our engine in this process on the version's weights; measure decode "
                                   "tokens/s and ITL against batch and TTFT against prompt length; store the "
                                   "curve for the pool.")
    common_arguments(p)
    p.add_argument("model", metavar="NAME@VERSION", help="model version, e.g. smollm2-135m-instruct@1")
    p.add_argument("--pool", default="local", help="pool the curve is stored for (default: local)")
    p.add_argument("--batches", type=_sizes, default=(1, 2, 4, 8, 16), metavar="B1,B2,...",
                   help="decode batch sizes (default: 1,2,4,8,16)")
    p.add_argument("--prompts", type=_sizes, default=(32, 128, 512), metavar="P1,P2,...",
                   help="prompt lengths for TTFT (default: 32,128,512)")
    p.add_argument("--decode-prompt-tokens", type=positive_int, default=64, metavar="N",
                   help="prompt length of the decode runs (default: 64)")
    p.add_argument("--decode-tokens", type=positive_int, default=32, metavar="N",
                   help="tokens generated per sequence in the decode runs (>= 4; default: 32)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="compute dtype (default: auto, the worker's default: the path it chooses here, "
                        "docs/engine.md)")
    p.add_argument("--quantization", default="auto", choices=("auto", "none", "int8", "int4"),
                   help="weight-only quantization (default: auto, the worker's default)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default: cpu, as the worker)")
    p.add_argument("--kv-cache-bytes", type=positive_int, default=256 * 1024 * 1024, metavar="N",
                   help="KV cache budget (default: 256 MiB, the worker's default)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--repeats", type=positive_int, default=2, metavar="N",
                   help="runs per point, the best kept (default: 2)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the curve as JSON to PATH")
    p.add_argument("--no-store", action="store_true", help="measure and print only; store nothing in etcd")
    p.set_defaults(func=main_profile)


def check_sizes(max_len: int, batches, prompts, decode_prompt: int, decode_tokens: int) -> None:
    """ValueError naming the option when a size does not fit the model's context ``max_len``."""
    if decode_tokens < 4:
        raise ValueError("--decode-tokens must be >= 4 (the decode window starts after the first token)")
    if decode_prompt + decode_tokens >= max_len:
        raise ValueError(f"--decode-prompt-tokens + --decode-tokens must be < the context length {max_len}")
    if max(prompts) + 1 >= max_len:
        raise ValueError(f"--prompts: {max(prompts)} tokens do not fit the context length {max_len}")


def measure_curve(engine, pool: str, batches, prompts, decode_prompt: int, decode_tokens: int,
                  log=print, seed: int = 0, meta: dict | None = None, repeats: int = 2):
    """Measure ``engine`` (an idle LLMEngine) into a ThroughputCurve for ``pool`` (module docstring);
    ``meta`` is added to the curve's meta (threads, dtype, CPU flags, ...); every point is the best of
    ``repeats`` runs (the least disturbed one on a shared machine)."""
    from control.policy.curves import DecodePoint, PrefillPoint, ThroughputCurve
    from bench.engine_bench import cpu_model, engine_decode, engine_ttft

    rng = random.Random(seed)
    decode = []
    for b in batches:
        engine_decode(engine, b, decode_prompt, 3, rng)  # warm-up at this batch size
        tok_s = 0.0
        for _ in range(repeats):
            engine.reset_prefix_cache()
            tok_s = max(tok_s, engine_decode(engine, b, decode_prompt, decode_tokens, rng))
        if not tok_s > 0:
            raise ValueError(f"decode at batch {b} was too short to time: raise --decode-tokens")
        decode.append(DecodePoint(b, tok_s, 1000.0 * b / tok_s))
        log(f"  decode batch {b}: {tok_s:.1f} tok/s, ITL {1000.0 * b / tok_s:.1f} ms")
    prefill = []
    for n in prompts:
        best = float("inf")
        for k in range(repeats):
            engine.reset_prefix_cache()
            prompt = tuple(rng.randrange(3, engine.vocab_size) for _ in range(n))
            best = min(best, engine_ttft(engine, prompt, f"ttft{n}-{k}"))
        prefill.append(PrefillPoint(n, best * 1000.0))
        log(f"  prefill {n} tokens: TTFT {best * 1000.0:.1f} ms")
    return ThroughputCurve(pool, time.time(), cpu_model(), tuple(decode), tuple(prefill),
                           {**_meta(engine), **(meta or {})})


def _meta(engine) -> dict[str, Any]:
    import os

    import torch

    from actors.worker.engine.hardware import cpu_flags

    device = str(engine.config.device)
    if device.startswith("cuda"):
        device = f"{device} ({torch.cuda.get_device_name(device)})"
    return {"device": device, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "cpu_flags": sorted(cpu_flags() & {"amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx512_vnni",
                                              "avx2"}),
            "dtype": engine.dtype_name, "quantization": engine.quantization or "none",
            "max_num_seqs": engine.config.max_num_seqs, "loadavg_1m": round(os.getloadavg()[0], 2)}


def print_curve(ref: str, curve, log=print) -> None:
    """The curve as a table, with the CPU it was measured on."""
    m = curve.meta
    log(f"{ref} on pool {curve.pool}: {curve.cpu}, {m.get('threads', '?')} threads, device {m.get('device', '?')}, "
        f"dtype {m.get('dtype', '?')}, quantization {m.get('quantization', '?')}")
    rows = [("batch", "decode tok/s", "ITL ms")]
    rows += [(str(p.batch), f"{p.tokens_per_s:.1f}", f"{p.itl_ms:.1f}") for p in curve.decode]
    rows += [("prompt tokens", "TTFT ms", "")]
    rows += [(str(p.prompt_tokens), f"{p.ttft_ms:.1f}", "") for p in curve.prefill]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        log("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _engine(manifest: dict, args: argparse.Namespace):
    from actors.worker.actor import build_engine

    ns = argparse.Namespace(dtype=args.dtype, device=args.device, quantization=args.quantization,
                            kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=max(args.batches),
                            max_num_batched_tokens=max(2048, max(args.prompts) + 1), no_progress=True)
    return build_engine(manifest, ns)


def _load(args: argparse.Namespace, etcd_url: str, ref) -> dict:
    """The version's manifest dict (ValueError if absent); notes a pool without a record."""
    from control.state.names import pool_key
    from control.state.pools import get_pool
    from control.state.registry import Registry

    async def read():
        async with Registry.connect(etcd_url) as reg:
            return await reg.get_manifest(ref.name, ref.version), await get_pool(reg, args.pool)
    manifest, pool = asyncio.run(read())
    if manifest is None:
        raise ValueError(f"no model version {ref.name}@{ref.version} in the registry")
    if pool is None:
        print(f"note: pool {args.pool} has no record at {pool_key(args.pool)} (actorserve pools set {args.pool})",
              file=sys.stderr)
    return manifest.to_dict()


def _store(etcd_url: str, ref, curve) -> None:
    from control.state.names import profile_key
    from control.state.pools import put_curve
    from control.state.registry import Registry

    async def store():
        async with Registry.connect(etcd_url) as reg:
            await put_curve(reg, ref.name, ref.version, curve)
    asyncio.run(store())
    print(f"stored at {profile_key(ref.name, ref.version, curve.pool)}")


def _profile(args: argparse.Namespace, etcd_url: str) -> int:
    from bench.cli_common import write_json
    from control.state.names import parse_model_ref, validate_name

    ref = parse_model_ref(args.model)
    if ref.version is None or ref.adapter is not None:
        raise ValueError(f"{args.model!r}: give NAME@VERSION")
    validate_name("pool name", args.pool)
    manifest = _load(args, etcd_url, ref)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    engine = _engine(manifest, args)
    check_sizes(engine.max_model_len, args.batches, args.prompts, args.decode_prompt_tokens, args.decode_tokens)
    curve = measure_curve(engine, args.pool, args.batches, args.prompts, args.decode_prompt_tokens,
                          args.decode_tokens, meta={"model": str(ref), "repeats": args.repeats},
                          repeats=args.repeats)
    print_curve(str(ref), curve)
    if not args.no_store:
        _store(etcd_url, ref, curve)
    write_json(curve.to_json(), args.json)
    return 0


def main_profile(args: argparse.Namespace) -> int:
    """Entry of ``actorserve profile``: exit status (module docstring)."""
    _, etcd_url = resolve_endpoints(args, need_nats=False)
    try:
        return _profile(args, etcd_url)
    except ValueError as e:
        print(f"actorserve: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # etcd unreachable: one line, exit 3
        if not is_unreachable(e):
            raise
        return report_unreachable("etcd", etcd_url, e)
