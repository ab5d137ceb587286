"""Which (dtype, quantization) path the engine runs on a machine: a pure ranking by CPU ISA (no torch).

``rank`` orders the candidate paths for an ISA class and the model file's own precision; ``close``
says whether the top two are near enough (or unknown) to be measured at start
(``kernel_choice.py``); ``decide`` picks among measured ones.  Decision 0028
(docs/decisions/0028-default-kernel-choice.md) records the figures behind ``PRIORS``.

ISA classes (from ``/proc/cpuinfo`` flags, ``hardware.isa_flags``):

* ``amx``: ``amx_bf16`` — bf16 on the tile unit; int4 by the AMX kernel (csrc/int4_gemm.cpp).
* ``avx512_bf16``: bf16 dot products (``VDPBF16PS``) through oneDNN, no AMX.
* ``vnni``: ``avx512_vnni`` or ``avx_vnni`` without native bf16: float32 activations, integer dot
  products for quantized weights.
* ``avx2``: 8-bit products by ``VPMADDUBSW`` at best.
* ``base``: none of these: float32 only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ISA_FLAGS = ("amx_bf16", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx2")
LEVELS = (1, 32)  # decode rows at which paths are compared (single stream, a busy batch)
CLOSE_RATIO = 1.25  # top two priors within this factor at any level -> measure them (0028)
DTYPES = ("float32", "bfloat16")
QUANTIZATIONS = ("int8", "int4")


@dataclass(frozen=True)
class Candidate:
    """One engine path: ``dtype`` in DTYPES, ``quantization`` None or one of QUANTIZATIONS."""

    dtype: str
    quantization: str | None

    @property
    def label(self) -> str:
        """``"bfloat16+int4"`` / ``"float32"``."""
        return self.dtype + (f"+{self.quantization}" if self.quantization else "")

    @classmethod
    def parse(cls, label: str) -> "Candidate":
        """Inverse of ``label``; ValueError naming the label when it is not one."""
        dtype, _, quant = label.partition("+")
        if dtype not in DTYPES or (quant and quant not in QUANTIZATIONS):
            raise ValueError(f"kernel choice: {label!r} is not a path (dtype[+int8|+int4])")
        return cls(dtype, quant or None)


# Decode tok/s (1 row, 32 rows) per ISA class and path, where measured (None: not measured / unknown).
# avx512_bf16: `actorserve bench engine --no-baseline` on AMD EPYC (2 cores, AVX-512 VNNI/BF16, no AMX),
#   2026-12-02, SmolLM2-135M Q4_1: float32 28/335, bfloat16 87/1120, bfloat16+int4 150/1210.
# amx: projection products only (30 layers, 2 threads, ms per pass -> tokens/s), Sapphire Rapids,
#   docs/decisions/0006-engine-speed.md: AMX int4 7.6 / 14.0 ms, pre-packed bf16 21.7 / 27.0 ms;
#   int8 SplitLinear 13.9 ms at 1 row, the same dense copy as bf16 above 4 rows.
PRIORS: dict[str, dict[str, tuple[float, float]]] = {
    "avx512_bf16": {"float32": (28.0, 335.0), "bfloat16": (87.0, 1120.0), "bfloat16+int4": (150.0, 1210.0)},
    "amx": {"bfloat16": (1000 / 21.7, 32000 / 27.0), "bfloat16+int4": (1000 / 7.6, 32000 / 14.0),
            "bfloat16+int8": (1000 / 13.9, 32000 / 27.0)},
}


def isa_class(flags) -> str:
    """The ISA class (module docstring) of a set of CPU flags."""
    flags = set(flags)
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    if flags & {"avx512_vnni", "avx_vnni"}:
        return "vnni"
    return "avx2" if "avx2" in flags else "base"


def _order(cls: str, quant: str | None) -> list[Candidate]:
    """Candidates of an ISA class, most promising first; ``quant``: the file's own precision."""
    bf16 = cls in ("amx", "avx512_bf16")
    out = []
    if bf16:
        out += [Candidate("bfloat16", quant), Candidate("bfloat16", None)]
    if cls != "base":
        out += [Candidate("float32", quant)]
    out.append(Candidate("float32", None))
    seen: list[Candidate] = []
    for c in out:  # quant None makes "+q" and plain equal
        if c not in seen:
            seen.append(c)
    return seen


def rank(flags, device: str = "cpu", file_quant: str | None = None, dtype: str = "auto",
         quantization: str | None = "auto", cuda_bf16: bool = False) -> list[Candidate]:
    """Candidates in order for CPU ``flags`` (or a CUDA ``device``), the file's own precision
    ``file_quant`` (None, "int8", "int4") and the operator's pins: ``dtype`` "auto" or one of DTYPES,
    ``quantization`` "auto", None/"none" or one of QUANTIZATIONS.  A pin filters the list; a pinned
    pair is the only candidate.  CUDA: bf16 where ``cuda_bf16``, quantization only when pinned
    (the non-CPU quantized path dequantizes per call).  ValueError names a bad ``dtype`` /
    ``quantization``."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {list(DTYPES)}, got {dtype!r}")
    quant = None if quantization == "none" else quantization
    if quant not in ("auto", None, *QUANTIZATIONS):
        raise ValueError(f"quantization must be auto, none or one of {list(QUANTIZATIONS)}, got {quantization!r}")
    if not device.startswith("cpu"):
        d = dtype if dtype != "auto" else ("bfloat16" if cuda_bf16 else "float32")
        return [Candidate(d, None if quant == "auto" else quant)]
    cands = _order(isa_class(flags), file_quant)
    if dtype != "auto":
        cands = [c for c in cands if c.dtype == dtype] or [Candidate(dtype, None)]
    if quant != "auto":
        cands = [c for c in cands if c.quantization == quant] or [Candidate(cands[0].dtype, quant)]
    return cands


def prior(flags, cand: Candidate) -> tuple[float, float] | None:
    """Measured decode tok/s at LEVELS for ``cand`` on this ISA class (PRIORS), or None."""
    return PRIORS.get(isa_class(flags), {}).get(cand.label)


def close(flags, cands: list[Candidate]) -> bool:
    """True when the first two candidates must be measured: a prior is unknown, or the second is
    within CLOSE_RATIO of the first at some level (or ahead of it)."""
    if len(cands) < 2:
        return False
    a, b = prior(flags, cands[0]), prior(flags, cands[1])
    if a is None or b is None:
        return True
    return any(x < y * CLOSE_RATIO for x, y in zip(a, b))


def score(rates: dict) -> float:
    """Geometric mean of tok/s over LEVELS (keys int or str); 0 when one is missing or not positive."""
    vals = [float(rates.get(n, rates.get(str(n), 0.0))) for n in LEVELS]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if all(v > 0 for v in vals) else 0.0


def decide(measured: dict[Candidate, dict]) -> Candidate:
    """The measured candidate with the best ``score`` (earlier insertion wins ties).  ValueError if empty."""
    if not measured:
        raise ValueError("kernel choice: nothing measured")
    return max(measured, key=lambda c: score(measured[c]))


def explain(flags, chosen: Candidate, cands: list[Candidate], measured: dict | None, pinned: str = "") -> str:
    """One line: the choice and why, e.g. ``bfloat16+int4: avx512_bf16, measured 150 vs 87 tok/s at 1 row,
    1210 vs 1120 at 32 rows (projection products + LM head)``."""
    head = f"{chosen.label}: {pinned or isa_class(flags)}"
    if measured:
        other = [c for c in measured if c != chosen]
        if other:
            a, b = measured[chosen], measured[other[0]]
            parts = [f"{_r(a, n):.0f} vs {_r(b, n):.0f} tok/s at {n} row{'s' if n > 1 else ''}" for n in LEVELS]
            return f"{head}, measured {', '.join(parts)} against {other[0].label} (projection products + LM head)"
        return f"{head}, measured {_r(measured[chosen], LEVELS[0]):.0f} tok/s at 1 row"
    if len(cands) == 1:
        return f"{head}, the only candidate"
    p = prior(flags, chosen)
    if p is not None and prior(flags, cands[1]) is not None:
        q = prior(flags, cands[1])
        return f"{head}, ahead of {cands[1].label} by record ({p[0]:.0f} vs {q[0]:.0f} tok/s at 1 row, decision 0028)"
    return f"{head}, first by ISA rank"


def _r(rates: dict, n: int) -> float:
    return float(rates.get(n, rates.get(str(n), 0.0)))


def manifest_pin(label: str | None) -> str | None:
    """A manifest's ``quantization`` label -> the engine quantization it pins, or None for no pin.

    Engine names pin the path ("int8", "int4"; "none" -> "none").  Other labels (``models register``
    defaults to the GGUF file type, e.g. "Q4_1", "F16") describe the file, whose own precision
    "auto" follows from its tensor types (``quant.quantization_for_types``)."""
    low = (label or "").strip().lower()
    return low if low in ("int8", "int4", "none") else None
