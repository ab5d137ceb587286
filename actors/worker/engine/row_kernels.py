"""The kernel each quantized projection runs for a step of a given row count, chosen by measurement
(issue [24] item 1; docs/decisions/0053-kernel-per-row-count.md).

A quantized projection can be multiplied by several kernels over the same quantized values:

* ``"amx"``: ``quant.AmxInt4Linear`` (int4 on the AMX tile unit, CPUs with AMX-BF16);
* ``"avx512"`` / ``"avx2"``: ``quant_blocks.QuantLinear``, GGUF-like blocks and int8 activations, integer
  dot products by AVX-512 VNNI (``VPDPBUSD``) or AVX2 (``VPMADDUBSW``): the two builds of csrc/qgemm.cpp
  (``cpu_kernels.load_isa``) read one pack, so the second costs no memory;
* ``"torch"``: torch's packed ``Int4Linear`` / ``Int8Linear``;
* ``"dense"``: the dense copy of the quantized values that ``quant.SplitLinear`` already keeps for many rows.

``alternatives(lin)`` lists what can be built from what the engine built, without adding memory except
for one case: a block pack (``QuantLinear``) next to an ``AmxInt4Linear`` or a torch-packed one (0.625 /
1.0625 bytes a weight), kept only where it wins a row count.  A dense copy is offered only where the
engine keeps one already (its memory is today's).  At start ``kernel_choice`` times every alternative on
one layer of the model's projection shapes at ``LEVELS`` rows (``measure_rows``) and ``table_of`` keeps, within
the fastest numeric family (the two block builds give the same bits; other kernels round differently), the
fastest build per level; ``wrap_factory`` then builds each projection as a ``RowKernelLinear`` holding only the
winners.  A step of ``n`` rows runs the winner of the smallest level ``>= n``; beyond the last level the
projection as the engine built it (its recorded crossovers, decision 0027) runs.

Different kernels round differently (int8 activations in the block products, bf16 products in the
others), as ``SplitLinear`` already mixes them: each stays within its quantization's tolerance against
transformers (tests/unit/test_row_kernels.py).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

LEVELS = (1, 4, 8, 32)  # decode rows at which the kernels are timed (the step sizes)
IMPLS = ("amx", "avx512", "avx2", "torch", "dense")  # kernel names, in the order listed above
BLOCK_IMPLS = ("avx512", "avx2")  # the block products (QuantLinear)
# kernels that give the same bits for the same inputs (the two block builds: the same integer sums, in the same
# order) share a family; a measured table keeps to one family (``table_of``)
FAMILY = {"amx": "amx", "avx512": "block", "avx2": "block", "torch": "torch", "dense": "dense"}


@dataclass(frozen=True)
class RowTable:
    """The kernel per row count: ``picks[i]`` serves steps of ``levels[i-1] < rows <= levels[i]``
    (``levels`` ascending, ``picks`` names of IMPLS); rows beyond ``levels[-1]`` run the projection as built.
    ``ms``: {impl: [ms of one layer's projections at each level]} as measured (for ``status``).
    ValueError on mismatched lengths, unordered levels or an unknown name."""

    levels: tuple[int, ...]
    picks: tuple[str, ...]
    ms: dict
    head: "RowTable | None" = None  # the LM head's own table (``compose_head``), where its file holds Q8_0 blocks

    def __post_init__(self) -> None:
        if len(self.levels) != len(self.picks) or not self.levels or list(self.levels) != sorted(set(self.levels)):
            raise ValueError(f"row table: levels {self.levels} and picks {self.picks} must be ascending and match")
        bad = [p for p in self.picks if p not in IMPLS]
        if bad:
            raise ValueError(f"row table: unknown kernel {bad[0]!r} (known: {list(IMPLS)})")

    def pick(self, rows: int) -> str | None:
        """The kernel for a step of ``rows`` rows, or None beyond the last level."""
        for level, name in zip(self.levels, self.picks):
            if rows <= level:
                return name
        return None

    def prefers_blocks(self) -> bool:
        """True when a block product wins some level and no torch-packed kernel wins any: the engine then builds
        the projections as block packs (``quant.block_quant_enabled``'s ``prefer``; a Q4_1 / Q8_0 file's own
        blocks, exactly) instead of cross-building a pack beside torch's."""
        return any(p in BLOCK_IMPLS for p in self.picks) and "torch" not in self.picks

    def to_json(self) -> dict:
        """{"levels": [...], "picks": [...], "ms": {...}, "head": {...} or None} (the cache entry, EngineConfig)."""
        return {"levels": list(self.levels), "picks": list(self.picks), "ms": self.ms,
                "head": self.head.to_json() if self.head else None}

    @classmethod
    def from_json(cls, data) -> "RowTable | None":
        """Inverse of ``to_json``; None for None. ValueError (naming the field) on a malformed entry."""
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ValueError(f"row table: expected an object, got {type(data).__name__}")
        try:
            return cls(tuple(int(x) for x in data["levels"]), tuple(str(x) for x in data["picks"]),
                       dict(data.get("ms") or {}), cls.from_json(data.get("head")))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"row table: field {exc} missing or malformed") from None

    def line(self) -> str:
        """``1 row avx512, 2-4 avx512, 5-8 torch, 9-32 dense`` (what ``status`` prints)."""
        parts, lo = [], 1
        for level, name in zip(self.levels, self.picks):
            parts.append(f"{lo}-{level} {name}" if level > lo else f"{level} row{'s' if level > 1 else ''} {name}")
            lo = level + 1
        return ", ".join(parts) + (f"; LM head {self.head.line()}" if self.head else "")


class RowKernelLinear:
    """``y = x @ W^T`` by the kernel ``table`` picks for x's row count (x [rows, in] -> [rows, out]).

    ``impls``: {name: callable} over the same quantized values (``alternatives``), only the winners;
    ``built``: the projection as the engine built it, for rows beyond the table (and ``dequantize``)."""

    def __init__(self, impls: dict, table: RowTable, built) -> None:
        missing = [p for p in set(table.picks) if p not in impls]
        if missing:
            raise ValueError(f"RowKernelLinear: no kernel {missing[0]!r} among {sorted(impls)}")
        self.impls, self.table, self.built = impls, table, built
        self.out_features = built.out_features
        self._by_rows = [impls[p] for p in table.picks]
        self._levels = table.levels

    def dequantize(self) -> torch.Tensor:
        """The float weight of the projection as built (every kernel multiplies by these values up to rounding)."""
        return self.built.dequantize()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        for level, fn in zip(self._levels, self._by_rows):
            if rows <= level:
                return fn(x)
        return self.built(x)


def _isa_kernels(isa: str):
    from . import cpu_kernels  # noqa: PLC0415 (builds at first use)

    return cpu_kernels.load_isa(isa)


def usable_isas() -> list[str]:
    """The block-product builds this CPU runs: "avx512" (needs AVX-512 F/BW/VNNI) and "avx2" (AVX2, FMA, F16C)."""
    from .hardware import cpu_flags

    flags = cpu_flags()
    out = ["avx512"] if {"avx512f", "avx512bw", "avx512_vnni"} <= flags else []
    return out + (["avx2"] if {"avx2", "fma", "f16c"} <= flags else [])


def alternatives(lin, dtype: torch.dtype, cross_build: bool = True) -> dict:
    """{kernel name: callable} for the projection ``lin`` as built by the engine (``quant.make_linear_factory``,
    ``kquant``, the pack cache): its own kernel, the other block-product builds over its pack, a block pack of
    its values (``cross_build``; only beside AMX / torch-packed kernels of a CPU projection) and the dense copy a
    ``SplitLinear`` holds.  {} for a projection that is not quantized (nothing to choose)."""
    from .quant import AmxInt4Linear, Int4Linear, Int8Linear, SplitLinear
    from .quant_blocks import QuantLinear

    small, out = (lin.small, {"dense": lin.dense}) if isinstance(lin, SplitLinear) else (lin, {})
    if isinstance(small, QuantLinear):
        builds = block_builds(small)
        return {**out, **builds} if builds else {}  # a forced generic build: nothing to choose
    if isinstance(small, AmxInt4Linear):
        out["amx"] = small
        bits = 4
    elif isinstance(small, Int4Linear) and small.packed is not None:  # packed: a CPU weight
        out["torch"], bits = small, 4
    elif isinstance(small, Int8Linear) and small.qweight.device.type == "cpu":
        out["torch"], bits = small, 8
    else:
        return {}
    k = next((k for k in map(_isa_kernels, usable_isas()) if k is not None), None)
    if cross_build and dtype in (torch.float32, torch.bfloat16) and QuantLinear.supports(_probe(small, lin), k):
        out.update(block_builds(QuantLinear(small.dequantize(), bits, k)))  # one pack for every build
    return out


def block_builds(q) -> dict:
    """{"avx512" / "avx2": a ``QuantLinear``} over ``q``'s one pack: ``q`` itself under its build's name, the
    other builds this CPU runs (``usable_isas``) beside it; {} when ``q`` runs the portable "generic" build
    (``ACTORSERVE_ISA=generic``: the operator chose it, nothing is measured against it)."""
    from .quant_blocks import QuantLinear

    own = getattr(q.kernels, "qgemm_isa", "")
    if own not in BLOCK_IMPLS:
        return {}
    out = {own: q}
    for isa in usable_isas():
        k = _isa_kernels(isa) if isa not in out else None
        if k is not None and k.qgemm_isa == isa:
            out[isa] = QuantLinear.from_packed(q.packed, q.bits, q.out_features, k)
    return out


def _probe(small, lin):
    """A stand-in weight for ``QuantLinear.supports`` (shape and device of the projection)."""
    from types import SimpleNamespace

    n = lin.out_features
    k = _in_features(small)
    return SimpleNamespace(shape=(n, k), device=torch.device("cpu"), dim=lambda: 2)


def _in_features(small) -> int:
    """Input width of a torch-packed / AMX int4 or int8 projection."""
    if hasattr(small, "qweight") and small.qweight.dim() == 2:  # Int8Linear [out, in]
        return int(small.qweight.shape[1])
    if hasattr(small, "qweight"):  # AmxInt4Linear [N/16, K/32, 16, 16]
        return int(small.qweight.shape[1]) * 32
    return int(small.scale_zeros.shape[0]) * small.group  # Int4Linear [in / group, out, 2]


def compose(lin, table: RowTable | None, dtype: torch.dtype):
    """``lin`` as a ``RowKernelLinear`` keeping only ``table``'s winners among ``alternatives(lin)``; ``lin``
    unchanged when there is no table, nothing to choose, a winner this projection lacks (logged), or when the
    table picks ``lin``'s own kernel at every level (no indirection)."""
    if table is None:
        return lin
    alts = alternatives(lin, dtype, cross_build=any(p in BLOCK_IMPLS for p in table.picks))
    if not alts:
        return lin
    missing = sorted({p for p in table.picks if p not in alts})
    if missing:
        log.warning("row kernels: %s not built for a %s projection; it runs as built", missing, type(lin).__name__)
        return lin
    own = getattr(lin, "small", lin)
    if all(alts[p] is own for p in table.picks) and getattr(lin, "max_small_rows", table.levels[-1]) >= table.levels[-1]:
        return lin  # the table picks what the projection runs already up to its last level: no indirection
    return RowKernelLinear({p: alts[p] for p in set(table.picks)}, table, lin)


def wrap_factory(make, table: RowTable | None, dtype: torch.dtype):
    """``make_linear(weight, name)`` whose projections are ``compose``d with ``table`` (``make`` when there is
    none); attributes the engine reads from ``make`` (``held``) are kept."""
    if make is None or table is None:
        return make

    def made(weight: torch.Tensor, name: str):
        return compose(make(weight, name), table, dtype)

    if hasattr(make, "held"):
        made.held = make.held
    return made


def compose_head(dense, file_head, table: RowTable | None):
    """The LM head for ``LlamaModel.lm_head_1``: ``dense`` (its bf16 ``PackedLinear``) unless ``table`` picks a
    block product at some level and ``file_head`` (``kquant.file_q8_0``: the file's own Q8_0 blocks) is given;
    then a ``RowKernelLinear`` over the winners (the other block build shares the pack) with ``dense`` beyond
    the table.  Logits of the block product carry int8-activation rounding, as llama.cpp's of the same file."""
    if table is None or file_head is None or not any(p in BLOCK_IMPLS for p in table.picks):
        return dense
    impls = {"dense": dense, **block_builds(file_head)}
    if any(p not in impls for p in table.picks):
        log.warning("row kernels: LM head kernels %s not built; the head runs dense", sorted(set(table.picks)))
        return dense
    return RowKernelLinear({p: impls[p] for p in set(table.picks)}, table, dense)


# ------------------------------------------------------------------------------------ measurement


def measure_rows(layer: list, dtype: torch.dtype, flush, reps: int = 5) -> dict[str, list[float]]:
    """ms of one layer's projections per kernel at each of LEVELS rows: ``layer`` [(projection as built, in
    features)]; every kernel of ``alternatives`` common to all four is timed, the best of ``reps`` passes,
    kernels interleaved, ``flush()`` (a read of twice the last-level cache) before each pass so that weights
    stream from memory as in decode.  Returns {kernel: [ms at each level]}."""
    alts = [alternatives(op, dtype) for op, _ in layer]
    names = [n for n in IMPLS if all(n in a for a in alts)]
    per_kernel = {n: [a[n] for a in alts] for n in names}
    return _time(per_kernel, [k for _, k in layer], dtype, flush, reps,
                 lambda fns, xs: [f(x) for f, x in zip(fns, xs)])


def measure_head_rows(vocab: int, hidden: int, kernels, flush, reps: int = 5) -> dict[str, list[float]]:
    """ms of a bf16 LM head [vocab, hidden] per kernel at each of LEVELS rows: ``dense`` (oneDNN pre-packed, as
    ``LlamaModel`` runs it) and the Q8_0 block product's builds (``usable_isas``); constant weights (a product's
    speed does not depend on the values).  {} where the dense head is not pre-packed (no bf16 oneDNN) or without
    ``kernels``."""
    from .model import packed_linear_factory
    from .quant_blocks import QuantLinear

    make = packed_linear_factory(torch.bfloat16, "cpu")
    if make is None or kernels is None or vocab % 16 or hidden % 32:
        return {}
    w = torch.full((vocab, hidden), 0.01, dtype=torch.bfloat16)
    heads = {"dense": make(w, "lm_head"), **block_builds(QuantLinear(w, 8, kernels))}
    return _time(heads, [hidden], torch.bfloat16, flush, reps, lambda f, xs: f(xs[0]))


def _time(fns: dict, widths: list[int], dtype: torch.dtype, flush, reps: int, call) -> dict[str, list[float]]:
    """Best-of-``reps`` ms of ``call(fn, xs)`` per named ``fn`` at each of LEVELS rows (xs: one input per width)."""
    names = [n for n in IMPLS if n in fns]
    best = {n: [float("inf")] * len(LEVELS) for n in names}
    with torch.inference_mode():
        for i, rows in enumerate(LEVELS):
            xs = [torch.empty(rows, k, dtype=dtype).uniform_(-1, 1) for k in widths]
            for n in names:
                call(fns[n], xs)  # warm-up (oneDNN builds a primitive per shape)
            for _ in range(reps):
                for n in names:
                    flush()
                    t = time.perf_counter()
                    call(fns[n], xs)
                    best[n][i] = min(best[n][i], (time.perf_counter() - t) * 1e3)
    return {n: [round(v, 4) for v in ms] for n, ms in best.items()}


def table_of(ms: dict[str, list[float]]) -> RowTable | None:
    """The kernel per level of ``measure_rows``' result: one numeric family (``FAMILY``) for every level, the one
    whose per-level best is nearest the fastest of all (geometric mean of the ratios), then its fastest build per
    level (ties: IMPLS order).  One family, because families round differently (int8 activations or not, bf16
    products or AMX tiles): with a kernel per level from any family, a token's logits would depend on how many
    other rows shared its step (other requests' decodes, a prefill chunk's length), while the builds of one family
    give the same bits (tests/unit/test_row_kernels.py).  None with fewer than two kernels (nothing was chosen)."""
    if len(ms) < 2:
        return None
    names = [n for n in IMPLS if n in ms]
    best = [min(ms[n][i] for n in names) for i in range(len(LEVELS))]

    def cost(family: str) -> float:
        members = [n for n in names if FAMILY[n] == family]
        return math.prod(min(ms[n][i] for n in members) / max(best[i], 1e-9) for i in range(len(LEVELS)))

    family = min(dict.fromkeys(FAMILY[n] for n in names), key=cost)
    members = [n for n in names if FAMILY[n] == family]
    picks = tuple(min(members, key=lambda n: ms[n][i]) for i in range(len(LEVELS)))
    return RowTable(LEVELS, picks, ms)
