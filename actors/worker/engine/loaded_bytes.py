"""The bytes a worker's engine will hold for a model artifact, estimated from its headers (issue [23] item 4):
the registry's default ``memory_bytes`` (``actorserve models register``), before any worker has measured the
loaded model (``weights_bytes`` of its record, memory.tensor_bytes).

The loaded form, not the file's: under the worker's default quantization ("auto", unpinned; kquant.py) a
projection whose parts all map exactly onto the engine's int4 (GGUF Q4_0 / Q4_1 / Q4_K, GPTQ / AWQ with 32
inputs per group) holds half a byte per weight plus a scale and a zero per 32 weights; a Q8_0 one the engine's
int8 blocks (one byte and a half scale per 32); every other tensor (embedding, norms, Q5_K / Q6_K / FP8
projections, ...) the dense dtype (``dtype_bytes``, default 2: bfloat16, the dtype on CPUs and GPUs with bf16
products; float32 doubles it).  Not counted: the dense copies some kernels keep beside quantized weights for
many-row steps (quant.SplitLinear) and the KV cache.  Headers only: nothing is dequantized.
"""

from __future__ import annotations

import os

import numpy as np

_INT8_TYPES = ("Q8_0",)


def int4_bytes(numel: int, dtype_bytes: int) -> int:
    """Half a byte per weight plus a scale and a zero (``dtype_bytes`` each) per 32."""
    return numel // 2 + numel // 32 * 2 * dtype_bytes


def loaded_bytes(path: str, dtype_bytes: int = 2) -> int:
    """Estimated bytes of the loaded weights of the GGUF file or Hugging Face directory at ``path`` (module
    docstring).  ValueError / OSError from an unreadable header propagate."""
    if os.path.isdir(path):
        return _hf_bytes(path, dtype_bytes)
    return _gguf_bytes(path, dtype_bytes)


def _gguf_bytes(path: str, dtype_bytes: int) -> int:
    from .kquant import EXACT_INT4, FUSED, tensor_table

    table = tensor_table(path)
    part_of = {p: proj for proj, parts in FUSED.items() for p in parts}
    fused: dict[tuple[str, str], list[tuple[int, str]]] = {}
    total = 0
    for name, (dims, tname, _, _) in table.items():
        numel = int(np.prod(dims))
        bits = name.split(".")
        if name == "rope_freqs.weight":
            continue
        if len(bits) == 4 and bits[0] == "blk" and bits[2] in part_of and bits[3] == "weight":
            fused.setdefault((bits[1], part_of[bits[2]]), []).append((numel, str(tname)))
            continue
        total += numel * dtype_bytes
    # a tied head (no output.weight) is the embedding itself: counted once, as above
    for parts in fused.values():
        numel = sum(n for n, _ in parts)
        types = {t for _, t in parts}
        if types <= set(EXACT_INT4):
            total += int4_bytes(numel, dtype_bytes)
        elif types <= set(_INT8_TYPES):
            total += numel + numel // 32 * 2
        else:
            total += numel * dtype_bytes
    return total


def _hf_bytes(path: str, dtype_bytes: int) -> int:
    from safetensors import safe_open

    from . import hf_loader
    from .hf_loader import read_config, shard_files
    from .hf_quant import _FUSED, _in_features, account, spec_of_dir

    spec = spec_of_dir(path)
    total = 0
    if spec is None:
        for file in shard_files(path):
            with safe_open(str(file), framework="pt") as f:
                total += sum(int(np.prod(f.get_slice(n).get_shape())) * dtype_bytes for n in f.keys())
        return total
    config = read_config(path)
    where, quantized = account(path, config, spec, hf_loader)
    for ours, (file, name) in where.items():
        with safe_open(str(file), framework="pt") as f:
            total += int(np.prod(f.get_slice(name).get_shape())) * dtype_bytes
    shapes = _in_features(config)
    outs = {"wq": config.num_heads * config.head_dim, "wk": config.num_kv_heads * config.head_dim,
            "wv": config.num_kv_heads * config.head_dim, "wo": config.hidden_size, "w_gate": config.ffn_size,
            "w_up": config.ffn_size, "w_down": config.hidden_size}
    for layer in range(config.num_layers):
        for proj, parts in _FUSED.items():
            numel = sum(shapes[p] * outs[p] for p in parts)
            exact = spec.method in ("gptq", "awq") and _aligned(spec, quantized, layer, parts)
            total += int4_bytes(numel, dtype_bytes) if exact else numel * dtype_bytes
    return total


def _aligned(spec, quantized, layer: int, parts) -> bool:
    """Whether 32 consecutive inputs share a group in every part (group size a multiple of 32 or one group per
    row; a ``desc_act`` checkpoint: its g_idx read)."""
    if spec.group_size > 0 and spec.group_size % 32:
        return False
    if not spec.desc_act:
        return True
    from .hf_quant import read_module

    for p in parts:
        files = quantized[f"layers.{layer}.{p}"]
        if "g_idx" not in files:
            continue
        g = read_module({"g_idx": files["g_idx"]})["g_idx"].reshape(-1, 32)
        if not bool((g == g[:, :1]).all()):
            return False
    return True
