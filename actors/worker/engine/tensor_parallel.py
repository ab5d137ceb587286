"""Tensor parallelism inside one worker: which heads and MLP columns each rank holds, and the sharded weights.

Sharding as in Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053, section 3): attention is split by heads
(each rank computes Q/K/V of its heads, attends over its own K/V cache, and applies the columns of the output
projection that read its heads), the MLP by inner columns (gate/up rows, down columns); the output projection
and the MLP's down projection give partial sums that one all-reduce per block adds up. Embedding, norms and
the LM head stay whole on every rank (the logits need no gather).

Uneven shards: ranks may hold different numbers of KV heads (the default model's 3 KV heads over 2 ranks are
2 + 1, with their 6 + 3 query heads); a rank never holds part of a KV head's query group, so grouped-query
attention stays local. MLP columns go in units of ``FFN_UNIT`` (a multiple of the 32-wide quantization blocks,
so quantized shards keep whole blocks). ``shard_plan`` is pure; ``shard_weights`` slices torch tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

FFN_UNIT = 64  # MLP columns per unit of the split (whole Q8_0 / Q4 blocks of 32 on every rank)


@dataclass(frozen=True)
class Shard:
    """What one rank of a tensor-parallel group holds: half-open ranges of heads and MLP columns."""

    rank: int  # 0 .. world - 1 (rank 0 runs the engine's scheduler, sampling and the worker service)
    world: int  # ranks in the group
    q_heads: tuple[int, int]  # query heads [start, end)
    kv_heads: tuple[int, int]  # KV heads [start, end); q_heads = kv_heads x the query group size
    ffn: tuple[int, int]  # MLP inner columns [start, end)

    @property
    def num_kv_heads(self) -> int:
        """KV heads of this rank."""
        return self.kv_heads[1] - self.kv_heads[0]


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``n`` items in ``parts`` contiguous ranges as even as possible, the larger ones first
    (split(3, 2) == [(0, 2), (2, 3)])."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        out.append((start, start + size))
        start += size
    return out


def shard_plan(num_heads: int, num_kv_heads: int, ffn_size: int, world: int) -> list[Shard]:
    """The shard of every rank of a ``world``-rank group. ValueError when ``world`` < 1, when a rank would
    get no KV head (``world`` > ``num_kv_heads``), or when the heads do not form whole query groups."""
    if world < 1:
        raise ValueError("tensor_parallel must be >= 1")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not form groups over {num_kv_heads} KV heads")
    if world > num_kv_heads:
        raise ValueError(f"tensor_parallel {world} exceeds the model's {num_kv_heads} KV heads (each rank needs one)")
    group = num_heads // num_kv_heads
    unit = FFN_UNIT if ffn_size % FFN_UNIT == 0 and ffn_size // FFN_UNIT >= world else 1
    ffn = [(a * unit, b * unit) for a, b in split(ffn_size // unit, world)]
    return [Shard(r, world, (k0 * group, k1 * group), (k0, k1), ffn[r])
            for r, (k0, k1) in enumerate(split(num_kv_heads, world))]


def shard_config(config, shard: Shard):
    """The ``ModelConfig`` a rank's model is built with: its heads and MLP columns (head_dim unchanged)."""
    return dataclasses.replace(config, num_heads=shard.q_heads[1] - shard.q_heads[0],
                               num_kv_heads=shard.num_kv_heads, ffn_size=shard.ffn[1] - shard.ffn[0])


def shard_weights(weights: dict, config, shard: Shard) -> dict:
    """The rank's slice of a model's weights (``gguf_loader`` names, [out, in] tensors), in place of the full
    ones in ``weights`` (which is returned). Slices are copied so the full tensors can be freed."""
    hd = config.head_dim
    (q0, q1), (k0, k1), (f0, f1) = shard.q_heads, shard.kv_heads, shard.ffn
    rows = {"wq": (q0 * hd, q1 * hd), "wk": (k0 * hd, k1 * hd), "wv": (k0 * hd, k1 * hd),
            "w_gate": (f0, f1), "w_up": (f0, f1)}
    cols = {"wo": (q0 * hd, q1 * hd), "w_down": (f0, f1)}
    if getattr(config, "qkv_bias", False):  # Qwen2: the biases split as their projections' rows
        rows.update({"bq": rows["wq"], "bk": rows["wk"], "bv": rows["wv"]})
    for i in range(config.num_layers):  # q_norm / k_norm ([hd], per head) are whole on every rank
        for name, (a, b) in rows.items():
            key = f"layers.{i}.{name}"
            weights[key] = weights[key][a:b].clone()
        for name, (a, b) in cols.items():
            key = f"layers.{i}.{name}"
            weights[key] = weights[key][:, a:b].contiguous().clone()
    return weights


class AllReduced:
    """A row-parallel projection: the rank's partial product, summed over the group (``all_reduce``).

    Wraps any projection of model.py / quant.py (``__call__(x [T, in_shard]) -> [T, out]``). gloo reduces
    float32; other dtypes are widened for the reduce and narrowed back (bf16 sums of 2 partials: exact to
    bf16 rounding)."""

    fused_swiglu = False

    def __init__(self, inner, group) -> None:
        self.inner, self.group = inner, group
        self.out_features = inner.out_features

    def __call__(self, x):
        import torch
        import torch.distributed as dist

        y = self.inner(x)
        if y.dtype == torch.float32:
            dist.all_reduce(y, group=self.group)
            return y
        wide = y.float()
        dist.all_reduce(wide, group=self.group)
        return wide.to(y.dtype)


def wrap_row_parallel(model, group) -> None:
    """Make every layer's output and down projections of a sharded ``LlamaModel`` sum over ``group``."""
    for lw in model.layers:
        lw.o, lw.down = AllReduced(lw.o, group), AllReduced(lw.down, group)
