"""How a worker builds its engine from a model manifest and its flags: the engine path (dtype, quantization)
chosen for this CPU and model, tensor parallelism, the zero-compute engine. Shared by the one-version worker
(actors/worker/actor.py), the multi-version host (host_slot.py), ``actorserve profile`` and benches."""

from __future__ import annotations

import argparse
import logging
import time

log = logging.getLogger("actorserve.worker")


def choose_path(manifest: dict, args: argparse.Namespace):
    """``kernel_choice.Choice`` for the worker's ``--dtype`` / ``--quantization`` (auto or pins) on
    ``manifest``'s GGUF; logged and printed on stderr as one line (the choice and why)."""
    import sys

    from actors.worker.engine.kernel_choice import choose

    model = getattr(args, "model", None)  # a list (--model repeatable); the label of a record of the choice
    model = model[0] if isinstance(model, list) and len(model) == 1 and not getattr(args, "host", False) else model
    version = model if isinstance(model, str) else f"{manifest.get('name', '')}@{manifest.get('version', '')}"
    choice = choose(manifest["artifact"], version, device=args.device, dtype=getattr(args, "dtype", "auto"),
                    quantization=getattr(args, "quantization", "auto"),
                    manifest_quantization=manifest.get("quantization"))
    log.info("%s", choice.line())
    print(f"worker: {choice.line()}", file=sys.stderr, flush=True)
    return choice


def build_engine(manifest: dict, args: argparse.Namespace):
    """Load the engine for ``manifest`` (blocking; run in a thread) on the path ``choose_path`` resolves.
    ValueError on unsupported formats."""
    from actors.worker.engine.engine import EngineConfig, LLMEngine
    import os

    fmt = manifest.get("format") or ("hf" if os.path.isdir(manifest.get("artifact", "")) else "gguf")
    if fmt not in ("gguf", "hf"):  # hf: a Hugging Face directory (engine/hf_loader.py)
        raise ValueError(f"format {fmt!r} is not supported (supported: gguf, hf)")
    if getattr(args, "engine", "torch") == "zero-compute":  # only when asked for: no model compute
        from actors.worker.zero_compute import ZeroComputeConfig, ZeroComputeEngine
        return ZeroComputeEngine(ZeroComputeConfig(
            manifest["artifact"], kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=manifest.get("context_length") or None,
            step_ms=getattr(args, "zero_compute_step_ms", 0.0), curve=_zero_compute_curve(args)))
    t0 = time.monotonic()
    choice = choose_path(manifest, args)
    choose_s = time.monotonic() - t0
    cfg = EngineConfig(model_path=manifest["artifact"], dtype=choice.dtype, device=args.device,
                       quantization=choice.quantization, quantization_pinned=quantization_pinned(manifest, args),
                       kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=manifest.get("context_length") or None, progress=not args.no_progress,
                       weights_cache=getattr(args, "weights_cache", True),
                       memory_budget_bytes=getattr(args, "memory_budget_bytes", 0) or 0,
                       max_loras=getattr(args, "max_loras", 4), max_cpu_loras=getattr(args, "max_cpu_loras", 16),
                       max_lora_rank=getattr(args, "max_lora_rank", 16),
                       tensor_parallel=tensor_parallel_of(manifest, args),
                       small_step_tokens=small_step_tokens(args), row_kernels=choice.row_table)
    engine = LLMEngine(cfg)
    engine.path_choice = choice  # the worker's etcd record shows it (run_worker)
    engine.load_phases["kernels"] = engine.load_phases.get("kernels", 0.0) + choose_s  # path choice included
    return engine


def quantization_pinned(manifest: dict, args: argparse.Namespace) -> bool:
    """Whether the operator asked for the quantization (``--quantization`` other than auto, or a manifest
    pin): then the engine re-quantizes what the file does not hold exactly (engine/kquant.py)."""
    from actors.worker.engine.kernel_policy import manifest_pin

    flag = getattr(args, "quantization", "auto")
    return flag != "auto" or (manifest_pin(manifest.get("quantization")) is not None)


def tensor_parallel_of(manifest: dict, args: argparse.Namespace) -> int:
    """Ranks of this worker: ``--tensor-parallel``, else the manifest's ``tensor_parallel``, else 1.
    ValueError for a value that is not an integer >= 1."""
    n = getattr(args, "tensor_parallel", 0) or manifest.get("tensor_parallel", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel must be an integer >= 1, got {n!r}")
    return n


def _zero_compute_curve(args):
    """The ThroughputCurve of ``--zero-compute-curve PATH`` (JSON as ``actorserve profile --json`` writes), or
    None. ValueError naming the file when it is not a curve."""
    path = getattr(args, "zero_compute_curve", None)
    if not path:
        return None
    import json

    from control.policy.curves import ThroughputCurve

    try:
        with open(path) as f:
            return ThroughputCurve.from_json(json.load(f))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--zero-compute-curve {path}: {exc}") from None


def small_step_tokens(args: argparse.Namespace) -> int:
    """``--small-step-tokens`` of a one-version worker (default 1, decision 0051); 0 in a multi-version host (``--host``):
    its versions step on threads of their own in one process and ``torch.set_num_threads`` is process-wide, so
    one version's one-thread step would change the thread count under another's (one host test timed out with
    the switch on and never without it)."""
    return 0 if getattr(args, "host", False) else int(getattr(args, "small_step_tokens", 1))

