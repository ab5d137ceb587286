"""Measured throughput curves of one model version on one pool (pure: no I/O, no clock).

``actorserve profile`` (control/ops/profile_cli.py) measures, on the machine it runs on: decode tokens/s and
inter-token latency (ITL) against batch size, and time to first token (TTFT) against prompt length, and stores
``ThroughputCurve.to_json()`` at ``profile_key(name, version, pool)``::

    {"pool", "measured_at", "cpu", "decode": [{"batch", "tokens_per_s", "itl_ms"}, ...],
     "prefill": [{"prompt_tokens", "ttft_ms"}, ...], "meta": {...}}

Between measured points every query interpolates linearly. Outside them: tokens/s grows in proportion to
the batch below the smallest measured batch and stays flat above the largest (no extrapolated gains); ITL
stays at the smallest batch's below it and extends the last segment's slope above it (no extrapolated
improvement); TTFT extends the nearest segment linearly (prefill is ~linear in prompt length), never below 0.
``capacity_tokens_per_s(itl_slo_ms)`` is the decode tokens/s of one replica at the largest batch whose ITL
meets the SLO (``max_batch_at``) — the unit the pool policy plans with (Dynamo's Planner plans from profiled
ITL the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from control.policy.numbers import is_number


def _positive(owner: str, name: str, v: Any, allow_zero: bool = False) -> float:
    if not is_number(v, minimum=0) or (v == 0 and not allow_zero):
        raise ValueError(f"{owner}.{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class DecodePoint:
    """Decode at ``batch`` concurrent sequences: aggregate tokens/s and inter-token latency (ms)."""

    batch: int
    tokens_per_s: float
    itl_ms: float

    def __post_init__(self) -> None:
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"DecodePoint.batch must be an integer >= 1, got {self.batch!r}")
        _positive("DecodePoint", "tokens_per_s", self.tokens_per_s)
        _positive("DecodePoint", "itl_ms", self.itl_ms)


@dataclass(frozen=True)
class PrefillPoint:
    """Time to first token (ms) of one request of ``prompt_tokens`` run alone."""

    prompt_tokens: int
    ttft_ms: float

    def __post_init__(self) -> None:
        if isinstance(self.prompt_tokens, bool) or not isinstance(self.prompt_tokens, int) or self.prompt_tokens < 1:
            raise ValueError(f"PrefillPoint.prompt_tokens must be an integer >= 1, got {self.prompt_tokens!r}")
        _positive("PrefillPoint", "ttft_ms", self.ttft_ms)


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) inside [xs[0], xs[-1]] (xs strictly increasing, len >= 1)."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    return ys[-1]


def _extend(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """y(x) continuing the first / last segment's slope outside the range (constant with one point)."""
    if len(xs) == 1 or xs[0] <= x <= xs[-1]:
        return _interp(xs, ys, x)
    i = 1 if x < xs[0] else len(xs) - 1
    slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i] + slope * (x - xs[i])


@dataclass(frozen=True)
class ThroughputCurve:
    """Decode and prefill points of one version on one pool (see module docstring). Points are sorted by
    batch / prompt length; duplicates, an empty decode list and bad values raise ValueError."""

    pool: str
    measured_at: float
    cpu: str
    decode: tuple[DecodePoint, ...]
    prefill: tuple[PrefillPoint, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.pool, str) or not self.pool:
            raise ValueError("ThroughputCurve.pool must be a non-empty string")
        _positive("ThroughputCurve", "measured_at", self.measured_at, allow_zero=True)
        if not isinstance(self.cpu, str):
            raise ValueError("ThroughputCurve.cpu must be a string")
        decode = tuple(sorted(self.decode, key=lambda p: p.batch))
        prefill = tuple(sorted(self.prefill, key=lambda p: p.prompt_tokens))
        if not decode:
            raise ValueError("ThroughputCurve.decode must have at least one point")
        for name, pts, attr in (("decode", decode, "batch"), ("prefill", prefill, "prompt_tokens")):
            xs = [getattr(p, attr) for p in pts]
            if len(set(xs)) != len(xs):
                raise ValueError(f"ThroughputCurve.{name} has duplicate {attr} values: {xs}")
        object.__setattr__(self, "decode", decode)
        object.__setattr__(self, "prefill", prefill)
        object.__setattr__(self, "meta", dict(self.meta))

    def _decode_xy(self, attr: str) -> tuple[list[float], list[float]]:
        return [float(p.batch) for p in self.decode], [getattr(p, attr) for p in self.decode]

    def tokens_per_s_at(self, batch: float) -> float:
        """Aggregate decode tokens/s at ``batch`` sequences (proportional below the first point, flat above
        the last)."""
        xs, ys = self._decode_xy("tokens_per_s")
        if batch <= 0:
            return 0.0
        if batch < xs[0]:
            return ys[0] * batch / xs[0]
        return _interp(xs, ys, batch)

    def itl_ms_at(self, batch: float) -> float:
        """Inter-token latency (ms) at ``batch`` sequences (the first point's below it, the last segment's
        slope above the last)."""
        xs, ys = self._decode_xy("itl_ms")
        return max(ys[-1], _extend(xs, ys, batch)) if batch > xs[-1] else _interp(xs, ys, batch)

    def ttft_ms_at(self, prompt_tokens: float) -> float:
        """Time to first token (ms) of a prompt of ``prompt_tokens`` run alone; ValueError without prefill
        points."""
        if not self.prefill:
            raise ValueError(f"curve of pool {self.pool!r} has no prefill points")
        xs = [float(p.prompt_tokens) for p in self.prefill]
        return max(0.0, _extend(xs, [p.ttft_ms for p in self.prefill], prompt_tokens))

    def step_ms_at(self, decode_rows: int, prefill_tokens: int) -> float:
        """Modelled wall time (ms) of one engine step that decodes ``decode_rows`` sequences and prefills
        ``prefill_tokens`` prompt tokens: the ITL at that batch plus a lone prefill of that many tokens (the
        profile measures the two apart; a mixed step is taken as their sum). 0.0 for an empty step; ValueError
        when prefill tokens are asked of a curve without prefill points."""
        ms = self.itl_ms_at(decode_rows) if decode_rows > 0 else 0.0
        return ms + (self.ttft_ms_at(prefill_tokens) if prefill_tokens > 0 else 0.0)

    def max_batch_at(self, itl_slo_ms: float) -> float:
        """The largest (fractional) batch within the measured range whose ITL meets ``itl_slo_ms``: the largest
        measured batch that meets it, continued along the segment to the next point up to the SLO (0.0 when no
        measured batch meets it). A noisy dip below it does not veto a larger batch measured within it (on
        this CPU ITL is nearly flat over batch 4-16 and scatters ~1 %: the first crossing halved capacity)."""
        xs, ys = self._decode_xy("itl_ms")
        meets = [i for i, y in enumerate(ys) if y <= itl_slo_ms]
        if not meets:
            return 0.0
        i = meets[-1]
        if i == len(xs) - 1:
            return xs[-1]
        t = (itl_slo_ms - ys[i]) / (ys[i + 1] - ys[i])
        return xs[i] + t * (xs[i + 1] - xs[i])

    def capacity_tokens_per_s(self, itl_slo_ms: float) -> float:
        """Decode tokens/s of one replica at the largest batch meeting the ITL SLO (0.0 if none does)."""
        b = self.max_batch_at(itl_slo_ms)
        return self.tokens_per_s_at(b) if b > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """The stored form (module docstring)."""
        out = {"pool": self.pool, "measured_at": self.measured_at, "cpu": self.cpu,
               "decode": [{"batch": p.batch, "tokens_per_s": p.tokens_per_s, "itl_ms": p.itl_ms}
                          for p in self.decode],
               "prefill": [{"prompt_tokens": p.prompt_tokens, "ttft_ms": p.ttft_ms} for p in self.prefill]}
        if self.meta:
            out["meta"] = dict(self.meta)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ThroughputCurve":
        """Inverse of to_json (unknown keys ignored); ValueError naming what is missing or invalid."""
        if not isinstance(data, Mapping):
            raise ValueError("throughput curve must be an object")
        try:
            decode = tuple(DecodePoint(p["batch"], p["tokens_per_s"], p["itl_ms"]) for p in data["decode"])
            prefill = tuple(PrefillPoint(p["prompt_tokens"], p["ttft_ms"]) for p in data.get("prefill") or ())
            return cls(data["pool"], data.get("measured_at", 0.0), data.get("cpu", ""), decode, prefill,
                       data.get("meta") or {})
        except (KeyError, TypeError) as e:
            raise ValueError(f"throughput curve is malformed: missing or bad {e}") from None
