"""Gemma 2 soft-capping cost: decode steps of a Gemma 2 model of realistic width (random weights) with its attention and
final-logit soft-caps, against the same model with the caps removed, in one run (issue [22] item 1).

Decode attention runs in the C++ paged decode kernel, which applies the scale, the window and the soft-cap
(csrc/cpu_kernels.cpp; cap 0 = none), as the worker runs it; ``--torch``: the torch path, where capped attention
computes the scores explicitly (scale, ``cap * tanh(s / cap)``, mask, float32 softmax) and uncapped attention runs
SDPA with the same mask and scale (actors/worker/engine/gemma.py). The figure is the
ratio of decode tokens per second, capped / uncapped, at 1 and 32 rows over a cached context; the same weights,
the same cache, steps interleaved so that machine noise hits both alike. Prints the CPU.

    python -m bench.softcap_bench [--hidden 1024] [--layers 4] [--context 512] [--steps 20] [--dtype float32] [--torch]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

_KV: dict = {}  # id(model) -> its KV cache [layers, 2, blocks, block, kv_heads, head_dim]


def _model(args, capped: bool, weights):
    from actors.worker.engine.arch_spec import ModelConfig
    from actors.worker.engine.model_families import build_model

    heads, kv_heads, hd = args.hidden // 128, max(1, args.hidden // 256), 128
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_heads=heads, num_kv_heads=kv_heads,
                      head_dim=hd, ffn_size=4 * args.hidden, vocab_size=args.vocab, context_length=args.context + 8,
                      rope_theta=10000.0, rms_eps=1e-6, architecture="gemma2", tie_word_embeddings=True,
                      sliding_window=args.window,
                      layer_windows=tuple(args.window if i % 2 == 0 else 0 for i in range(args.layers)),
                      query_pre_attn_scalar=float(hd), attn_softcap=50.0, final_softcap=30.0)
    if not capped:
        cfg = dataclasses.replace(cfg, attn_softcap=None, final_softcap=None)
    return cfg, build_model(cfg, dict(weights), args.context + 8, native_kernels=not args.torch)


def _weights(args, dtype):
    import torch

    g = torch.Generator().manual_seed(0)
    d, f, hd = args.hidden, 4 * args.hidden, 128
    q, kv = (d // 128) * hd, max(1, d // 256) * hd
    r = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(dtype)  # noqa: E731
    w = {"embed": r(args.vocab, d), "norm": torch.ones(d, dtype=dtype)}
    for i in range(args.layers):
        p = f"layers.{i}."
        w.update({p + "wq": r(q, d), p + "wk": r(kv, d), p + "wv": r(kv, d), p + "wo": r(d, q),
                  p + "w_gate": r(f, d), p + "w_up": r(f, d), p + "w_down": r(d, f)})
        for n in ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm"):
            w[p + n] = torch.ones(d, dtype=dtype)
    return w


def _step_time(model, cfg, rows: int, args, dtype) -> float:
    """Seconds of one decode step of ``rows`` sequences, each with ``args.context`` tokens cached."""
    import torch

    from actors.worker.engine.model import BatchMetadata

    bs = 16
    nblk = -(-(args.context + 1) // bs)
    if id(model) not in _KV:  # one random cache per model, made on its first step
        _KV[id(model)] = torch.randn(cfg.num_layers, 2, rows * nblk, bs, cfg.num_kv_heads, cfg.head_dim).to(dtype)
    kv = _KV[id(model)]
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    tables = [list(range(r * nblk, (r + 1) * nblk)) for r in range(rows)]
    pos = args.context
    meta = BatchMetadata(t([pos] * rows), t([tb[pos // bs] * bs + pos % bs for tb in tables]), None, [1] * rows,
                         [pos + 1] * rows, t(list(range(rows))), block_tables=tables)
    ids = t([5] * rows)
    t0 = time.perf_counter()
    model.forward(ids, meta, kv)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    import torch

    from bench.cold_start_bench import cpu_name

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--context", type=int, default=512, help="tokens cached per sequence")
    ap.add_argument("--window", type=int, default=256, help="sliding window of the even layers (tokens)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--torch", action="store_true", help="decode attention on the torch path (no C++ kernel)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"CPU: {cpu_name() or '?'}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; "
          f"hidden {args.hidden}, {args.layers} layers, context {args.context}, {args.dtype}, "
          f"decode attention: {'torch' if args.torch else 'C++ kernel'}")
    weights = _weights(args, dtype)
    for rows in (1, 32):
        models = {capped: _model(args, capped, weights) for capped in (True, False)}
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(2):  # warm-up
            for capped, (cfg, m) in models.items():
                _step_time(m, cfg, rows, args, dtype)
        for _ in range(args.steps):
            for capped, (cfg, m) in models.items():
                times[capped].append(_step_time(m, cfg, rows, args, dtype))
        cap, nocap = statistics.median(times[True]), statistics.median(times[False])
        print(f"{rows:>2} rows: capped {rows / cap:8.1f} tok/s, uncapped {rows / nocap:8.1f} tok/s, "
              f"ratio {nocap / cap:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
