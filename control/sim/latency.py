"""The simulator's latency model (pure, numpy): prompt-length bins, per-type curve lookups, the prefill
budget each type meets, and the per-bin share of requests within the TTFT SLO.

Prompt lengths follow the trace's lognormal (median, sigma of ln), clipped at ``prompt_max`` (the clipped
mass sits at ``prompt_max``). They are cut into ``K`` equal-mass bins (quantile edges); a bin's requests are
routed and queued together. Within a bin, the share of requests whose TTFT = queue wait + CPU tiers +
prefill(P) meets the SLO is the lognormal mass of ``P <= P*`` where ``prefill(P*) = SLO - wait``, divided by
the bin's mass: exact for the distribution, no sampling (the "per-tick estimate from the distribution").

Curves: :class:`CurveTable` evaluates ``ThroughputCurve`` (control/policy/curves.py) rules with numpy —
tokens/s proportional below the first measured batch and flat above the last; ITL the first point's below
and the last segment's slope above; prefill TTFT linear, extended — and is tested equal to the live class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from control.policy.curves import ThroughputCurve
from control.sim.api import FleetInputs, TraceSpec

DEFAULT_BINS = 10
PREFILL_BUDGET = 0.8  # a type serves a bin when prefill at the bin's upper edge <= 80 % of the TTFT SLO


def _ndtr(x: np.ndarray | float) -> np.ndarray:
    from scipy.special import ndtr

    return ndtr(x)


def _ndtri(q: np.ndarray | float) -> np.ndarray:
    from scipy.special import ndtri

    return ndtri(q)


@dataclass(frozen=True)
class PromptBins:
    """``K`` equal-mass prompt bins: edges (K+1, tokens), masses (K), conditional means (K)."""

    median: float
    sigma: float
    max_tokens: float
    edges: np.ndarray
    mass: np.ndarray
    mean: np.ndarray

    @property
    def k(self) -> int:
        return len(self.mass)

    def cdf(self, x: np.ndarray) -> np.ndarray:
        """P(prompt <= x) of the clipped lognormal (1 at or above ``max_tokens``)."""
        x = np.asarray(x, dtype=float)
        z = (np.log(np.maximum(x, 1e-9)) - math.log(self.median)) / max(self.sigma, 1e-9)
        out = _ndtr(z)
        out[x >= self.max_tokens] = 1.0
        out[x <= 0] = 0.0
        return out

    def frac_within(self, pstar: np.ndarray) -> np.ndarray:
        """Share of each bin's requests with prompt <= ``pstar`` (shape (..., K), broadcast)."""
        lo, hi = self.edges[:-1], self.edges[1:]
        x = np.clip(pstar, lo, hi)
        f = (self.cdf(x) - self._cdf_lo()) / self.mass
        return np.clip(f, 0.0, 1.0)

    def _cdf_lo(self) -> np.ndarray:
        lo = self.__dict__.get("_lo")
        if lo is None:
            lo = self.cdf(self.edges[:-1])
            object.__setattr__(self, "_lo", lo)
        return lo


def prompt_bins(spec: TraceSpec, k: int = DEFAULT_BINS) -> PromptBins:
    """Equal-mass bins of the trace's clipped lognormal prompt length (conditional means by 64-point
    quadrature per bin)."""
    q = np.linspace(0.0, 1.0, k + 1)
    mu, s, pmax = math.log(spec.prompt_median), spec.prompt_sigma, float(spec.prompt_max)
    with np.errstate(divide="ignore", invalid="ignore"):
        edges = np.exp(mu + s * _ndtri(q))
    edges[0], edges[-1] = 0.0, pmax
    edges = np.minimum(edges, pmax)
    bins = PromptBins(spec.prompt_median, s, pmax, edges, np.full(k, 1.0 / k), np.zeros(k))
    mass = np.maximum(np.diff(bins.cdf(edges)), 1e-12)
    mass[-1] = max(mass[-1], 1.0 - float(bins.cdf(np.array([edges[-2]]))[0]))
    means = np.zeros(k)
    for i in range(k):
        u = np.linspace(0, 1, 66)[1:-1]
        lo_q, hi_q = float(bins.cdf(np.array([edges[i]]))[0]), float(bins.cdf(np.array([edges[i + 1] - 1e-6]))[0])
        xs = np.exp(mu + s * _ndtri(lo_q + u * max(hi_q - lo_q, 1e-12)))
        clip_mass = max(0.0, mass[i] - (hi_q - lo_q)) if i == k - 1 else 0.0
        means[i] = (np.minimum(xs, pmax).mean() * (hi_q - lo_q) + pmax * clip_mass) / max(mass[i], 1e-12)
    return PromptBins(spec.prompt_median, s, pmax, edges, mass / mass.sum(), means)


def lognormal_clipped_mean(median: float, sigma: float, maximum: float) -> float:
    """Mean of min(X, maximum) for X lognormal(ln median, sigma)."""
    mu = math.log(median)
    z = (math.log(maximum) - mu) / sigma
    below = math.exp(mu + sigma * sigma / 2) * float(_ndtr(z - sigma))
    return below + maximum * (1.0 - float(_ndtr(z)))


class CurveTable:
    """One type's curve as numpy arrays (module docstring)."""

    def __init__(self, curve: ThroughputCurve) -> None:
        self.b = np.array([p.batch for p in curve.decode], dtype=float)
        self.tps = np.array([p.tokens_per_s for p in curve.decode], dtype=float)
        self.itl = np.array([p.itl_ms for p in curve.decode], dtype=float)
        self.pp = np.array([p.prompt_tokens for p in curve.prefill], dtype=float)
        self.pt = np.array([p.ttft_ms for p in curve.prefill], dtype=float)
        self.itl_slope = (self.itl[-1] - self.itl[-2]) / (self.b[-1] - self.b[-2]) if len(self.b) > 1 else 0.0
        n = len(self.pp)
        self.p_lo_slope = (self.pt[1] - self.pt[0]) / (self.pp[1] - self.pp[0]) if n > 1 else 0.0
        self.p_hi_slope = (self.pt[-1] - self.pt[-2]) / (self.pp[-1] - self.pp[-2]) if n > 1 else 0.0

    def tokens_per_s(self, batch: float) -> float:
        """Aggregate decode tokens/s of one replica at ``batch`` sequences."""
        if batch <= 0:
            return 0.0
        if batch < self.b[0]:
            return float(self.tps[0] * batch / self.b[0])
        return float(np.interp(batch, self.b, self.tps))

    def itl_ms(self, batch: float) -> float:
        """Inter-token latency (ms) at ``batch``."""
        if batch > self.b[-1]:
            return float(max(self.itl[-1], self.itl[-1] + self.itl_slope * (batch - self.b[-1])))
        return float(np.interp(batch, self.b, self.itl))

    def ttft_ms(self, prompt: np.ndarray) -> np.ndarray:
        """Prefill TTFT (ms) of prompts run alone."""
        p = np.asarray(prompt, dtype=float)
        y = np.interp(p, self.pp, self.pt)
        y = np.where(p < self.pp[0], self.pt[0] + self.p_lo_slope * (p - self.pp[0]), y)
        y = np.where(p > self.pp[-1], self.pt[-1] + self.p_hi_slope * (p - self.pp[-1]), y)
        return np.maximum(y, 0.0)

    def prompt_within(self, budget_ms: np.ndarray) -> np.ndarray:
        """The longest prompt whose prefill fits ``budget_ms`` (inverse of ttft_ms; 0 for no budget)."""
        b = np.asarray(budget_ms, dtype=float)
        p = np.interp(b, self.pt, self.pp)
        lo = self.pp[0] + (b - self.pt[0]) / self.p_lo_slope if self.p_lo_slope > 0 else self.pp[0]
        hi = self.pp[-1] + (b - self.pt[-1]) / self.p_hi_slope if self.p_hi_slope > 0 else np.inf
        p = np.where(b < self.pt[0], lo, np.where(b > self.pt[-1], hi, p))
        return np.where(b <= 0, 0.0, np.maximum(p, 0.0))


def eligible(inputs: FleetInputs, bins: PromptBins) -> dict[str, np.ndarray]:
    """Per type: boolean (K,) — the type's prefill at the bin's upper edge fits PREFILL_BUDGET x the TTFT SLO
    (the last bin's upper edge is ``prompt_max``). The engine routes a bin to these types first; the live
    policy's adapter plans each group of bins on the types that serve it."""
    budget = PREFILL_BUDGET * inputs.slo.ttft_ms
    return {n: CurveTable(t.curve).ttft_ms(bins.edges[1:]) <= budget for n, t in inputs.types.items()}
