"""The accelerator slots of LoRA adapters and the low-rank products of a step over them.

Every adapted (layer, fused projection) keeps all slots stacked (``SlotStack``): ``a`` [S, in, n_sub * r_max]
(the sub-projections' A, transposed, side by side) and ``b`` [S, n_sub * r_max, out] (each sub-projection's B,
transposed, in its own rank rows and output columns), in the model's dtype, zero where a slot's adapter has a
lower rank or does not adapt a sub-projection, so zeros add nothing. One block-diagonal B per fused projection
reads 2-3x the B bytes of qkv / gate_up that B per sub-projection would, but on the CPU each batched product
costs tens of microseconds whatever its size, and the per-sub-projection form (3 + 2 more products and
scatters per layer) measured slower in the engine (bench/lora_bench.py on 2 AMD EPYC cores: 0.55 against
0.63 of the base tok/s), and so did float32 slots (74 against 64 ms per 32-row step). A step's
``LoraBatch`` adds each packed row's own adapter's ``(x A^T) B^T`` to the base product in one of three ways,
chosen per step from the rows:

* ``whole``: one adapter for every row: plain products;
* ``bmm``: rows gathered into [G, m, in] by slot (short groups padded with row 0, whose results are dropped),
  batched products over the slots and ``index_add_`` back: a fixed number of ops per projection however
  many adapters the batch holds (Punica's BGMV / S-LoRA's gathered products, Chen et al. 2023, Sheng et al.
  2023, without custom kernels);
* ``groups``: per adapter ``index_select``, products, ``index_add_``; used when padding would more than
  double the rows computed (a long prefill beside short decodes), where the products dominate anyway;
* ``kernel``: on the CPU, steps of at most ``KERNEL_MAX_ROWS`` rows and several adapters call
  csrc/lora_sgmv.cpp once per projection (rows grouped by slot, only B's non-zero blocks read;
  cpu_kernels.lora_sgmv). 32 streams x 128 tokens over 8 adapters: 0.67 of the base tok/s against 0.56 for
  the batched torch products (one run each, 2 AMD EPYC cores).

Identity: ``SlotStack.names`` says which adapter each slot holds; actors/worker/engine/adapters.py checks a
sequence's adapter against its slot when the step is assembled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .lora import HostAdapter, in_features, sub_outputs


#: steps of at most this many rows (and more than one adapter) use the native kernel (one thread per slot; long
#: prefills, where the batched products' blocking pays, stay on the torch forms)
KERNEL_MAX_ROWS = 128


class SlotStack:
    """``num_slots`` adapter slots of every (layer, fused projection), allocated at the first load."""

    def __init__(self, model_config, num_slots: int, max_rank: int, dtype: torch.dtype, device) -> None:
        self.config, self.num_slots, self.max_rank = model_config, num_slots, max_rank
        self.dtype, self.device = dtype, device
        self.names: list[str | None] = [None] * num_slots  # adapter held per slot
        self.projs: list[frozenset[str]] = [frozenset()] * num_slots  # fused projections each slot adapts
        self.a: dict[tuple[int, str], torch.Tensor] = {}  # (layer, proj) -> [S, n_sub * r_max, in]
        self.b: dict[tuple[int, str], torch.Tensor] = {}  # (layer, proj) -> [S, n_sub * r_max, out]
        self.out_cols: dict[str, list[tuple[int, int]]] = {}  # proj -> output columns of each sub-projection
        self.col_bounds: dict[str, torch.Tensor] = {}  # proj -> int32 [n_sub + 1] (the kernel's ``cols``)
        self.kernels = None  # cpu_kernels.CpuKernels with ``lora_sgmv`` (AdapterManager sets it on the CPU), or None

    def _allocate(self) -> None:
        outs, ins = sub_outputs(self.config), in_features(self.config)
        kw, r = {"dtype": self.dtype, "device": self.device}, self.max_rank
        self.out_cols = {p: [(sum(o[:i]), sum(o[: i + 1])) for i in range(len(o))] for p, o in outs.items()}
        self.col_bounds = {p: torch.tensor([0, *(c1 for _, c1 in cols)], dtype=torch.int32)
                           for p, cols in self.out_cols.items()}
        for layer in range(self.config.num_layers):
            for proj, o in outs.items():
                self.a[(layer, proj)] = torch.zeros(self.num_slots, ins[proj], len(o) * r, **kw)
                self.b[(layer, proj)] = torch.zeros(self.num_slots, len(o) * r, sum(o), **kw)

    def load(self, slot: int, host: HostAdapter) -> None:
        """Copy ``host`` into ``slot`` (what the slot held is cleared first; its name is unset meanwhile)."""
        if not self.a:
            self._allocate()
        self.names[slot] = None
        for key, a in self.a.items():
            a[slot].zero_()
            self.b[key][slot].zero_()
        r_max = self.max_rank
        for key, subs in host.layers.items():
            for i, (a, b) in subs.items():
                r, (c0, c1) = a.shape[0], self.out_cols[key[1]][i]
                self.a[key][slot, :, i * r_max : i * r_max + r].copy_(a.t())
                self.b[key][slot, i * r_max : i * r_max + r, c0:c1].copy_(b.t())
        self.projs[slot] = frozenset(p for (_, p) in host.layers)
        self.names[slot] = host.name

    def clear(self, slot: int) -> None:
        """Forget what ``slot`` holds (retired adapter); its tensors are overwritten at the next load."""
        self.names[slot], self.projs[slot] = None, frozenset()

    @property
    def nbytes(self) -> int:
        """Bytes the slots hold (0 before the first load)."""
        return sum(t.numel() * t.element_size() for d in (self.a, self.b) for t in d.values())


@dataclass
class LoraBatch:
    """How one step adds its rows' adapter deltas (module docstring). Tensors int64 on the model device."""

    stack: SlotStack
    projs: frozenset[str]  # projections some adapter of the step adapts
    whole: int | None = None  # "whole": the one slot of every row
    slots: torch.Tensor | None = None  # "bmm": slots in gather order [G], None = all slots in order
    gather: torch.Tensor | None = None  # "bmm": packed rows, G x m of them (padding: row 0)
    valid: torch.Tensor | None = None  # "bmm": positions of real rows in ``gather`` (None: all real)
    rows: torch.Tensor | None = None  # "bmm": ``gather[valid]``, the rows the deltas go to
    m: int = 0  # "bmm": rows per slot after padding
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # "groups": (slot, rows [n])
    row_slots: torch.Tensor | None = None  # "kernel": int32 [T], each row's slot (-1: none; cpu_kernels.lora_sgmv)

    def adapts(self, proj: str) -> bool:
        """True when an adapter of the step adapts ``proj`` in some layer."""
        return proj in self.projs

    def add_delta(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` [T, out] += each row's adapter delta for ``proj`` of ``layer`` (x [T, in]); returns ``y``."""
        if proj not in self.projs:
            return y
        a, b = self.stack.a[(layer, proj)], self.stack.b[(layer, proj)]
        if self.row_slots is not None:
            from .cpu_kernels import lora_sgmv

            lora_sgmv(self.stack.kernels, x, a, b, y, self.row_slots, self.stack.max_rank, self.stack.col_bounds[proj])
            return y
        if self.whole is not None:
            return y.addmm_(torch.mm(x, a[self.whole]), b[self.whole])
        if self.gather is None:
            for slot, rows in self.groups:
                y.index_add_(0, rows, torch.mm(torch.mm(x.index_select(0, rows), a[slot]), b[slot]))
            return y
        if self.slots is not None:
            a, b = a.index_select(0, self.slots), b.index_select(0, self.slots)
        xg = x.index_select(0, self.gather).view(a.shape[0], self.m, x.shape[1])
        d = torch.bmm(torch.bmm(xg, a), b).view(-1, y.shape[1])
        return y.index_add_(0, self.rows, d if self.valid is None else d.index_select(0, self.valid))


def make_batch(stack: SlotStack, seq_slots: list[int | None], query_lens: list[int], device) -> LoraBatch | None:
    """The step's LoraBatch from each sequence's slot (None = base model) and its tokens in the step (packed
    order); None when no sequence has an adapter."""
    by_slot: dict[int, list[int]] = {}
    start = 0
    for slot, n in zip(seq_slots, query_lens):
        if slot is not None:
            by_slot.setdefault(slot, []).extend(range(start, start + n))
        start += n
    if not by_slot:
        return None
    projs = frozenset().union(*(stack.projs[s] for s in by_slot))
    if len(by_slot) == 1 and all(s is not None for s in seq_slots):
        return LoraBatch(stack, projs, whole=next(iter(by_slot)))
    if stack.kernels is not None and sum(query_lens) <= KERNEL_MAX_ROWS:  # decode-sized steps: one call per projection
        row_slots = [s if s is not None else -1 for s, n in zip(seq_slots, query_lens) for _ in range(n)]
        return LoraBatch(stack, projs, row_slots=torch.tensor(row_slots, dtype=torch.int32))
    order = list(range(stack.num_slots)) if 2 * len(by_slot) > stack.num_slots else sorted(by_slot)
    m, real = max(len(r) for r in by_slot.values()), sum(len(r) for r in by_slot.values())
    tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    if len(order) * m > 2 * real:  # padding would dominate: one group per adapter
        return LoraBatch(stack, projs, groups=[(s, tensor(r)) for s, r in sorted(by_slot.items())])
    gather, valid = [], []
    for g, slot in enumerate(order):
        rows = by_slot.get(slot, [])
        valid += range(g * m, g * m + len(rows))
        gather += rows + [0] * (m - len(rows))
    rows = [gather[i] for i in valid]
    return LoraBatch(stack, projs, slots=None if len(order) == stack.num_slots else tensor(order), gather=tensor(gather),
                     valid=None if len(valid) == len(gather) else tensor(valid), rows=tensor(rows), m=m)
