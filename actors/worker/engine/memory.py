"""Bytes an engine holds (issue [11] item 1): the weights of a loaded model, and the KV cache a memory budget
leaves beside them. No engine state; torch only to read tensor sizes."""

from __future__ import annotations

from typing import Any

import torch

#: the least KV cache (bytes) a memory budget must leave beside the weights (a few blocks of the default model)
MIN_KV_BYTES = 4 * 2**20


def tensor_bytes(root: Any, max_depth: int = 8) -> int:
    """Bytes of every tensor reachable from ``root`` through attributes, lists, tuples and dicts (at most
    ``max_depth`` levels: a mixture-of-experts model's quantized expert sits at model -> moe list -> block ->
    expert list -> SplitLinear -> QuantLinear -> tensor), each storage counted once (a tied embedding / LM head
    counts once)."""
    seen: dict[int, int] = {}
    _walk(root, max_depth, seen, set())
    return sum(seen.values())


def _walk(obj: Any, depth: int, seen: dict[int, int], visited: set[int]) -> None:
    if isinstance(obj, torch.Tensor):
        key, nbytes = _storage(obj)
        seen[key] = max(seen.get(key, 0), nbytes)
        return
    if depth <= 0 or id(obj) in visited or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    visited.add(id(obj))
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    else:
        items = getattr(obj, "__dict__", {}).values()
    for x in items:
        _walk(x, depth - 1, seen, visited)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of a tensor's storage: its data pointer and size, or for an opaque tensor without a storage
    (a oneDNN-packed weight, ``is_mkldnn``: seen on an AVX-512 BF16 CPU) its id and numel * element size."""
    try:
        st = t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return -id(t), t.numel() * t.element_size()
    return st.data_ptr(), st.nbytes()


def kv_bytes_for_budget(budget_bytes: int, weights_bytes: int, floor_bytes: int = MIN_KV_BYTES) -> int:
    """KV cache bytes a memory budget leaves beside the weights (bytes). ValueError, naming both figures, when
    that is less than ``floor_bytes``."""
    left = int(budget_bytes) - int(weights_bytes)
    if left < floor_bytes:
        raise ValueError(f"memory_budget_bytes {budget_bytes} is too small: the loaded weights take {weights_bytes} "
                         f"bytes and the KV cache needs at least {floor_bytes} more (at least "
                         f"{int(weights_bytes) + floor_bytes} in all)")
    return left
