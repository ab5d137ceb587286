"""Pool mix: how many workers on each pool cover a version's demand at the least cost per SLO-met token
(pure: no I/O, no clock).

Mélange (Griggs et al., 2024) picks the cost-optimal mix of GPU types from each type's profiled throughput
at the SLO (by ILP; -33 to -77 % against the best single type); SkyServe (Mao et al., 2024) and SpotServe
(Miao et al., 2024) mix spot and on-demand replicas, keep part of the capacity on demand so a correlated
spot loss keeps service, and count preemptions in the spot capacity. Here:

* one worker of an offer serves ``capacity = curve.capacity_tokens_per_s(slo.itl_ms)`` tokens/s (0 when the
  curve's TTFT at ``prompt_tokens`` misses ``slo.ttft_ms``), of which a spot worker loses the expected
  fraction ``min(1, preemption_rate_per_h x recovery_s / 3600)`` (time between a preemption and its
  replacement serving): ``effective = capacity x (1 - loss)``;
* cost per SLO-met token = ``price_per_h / (3600 x effective)``;
* constraints: total effective capacity >= demand; workers <= max_workers per pool; effective spot capacity
  <= ``spot_max_fraction`` (default 0.7) of the total, unless no on-demand offer exists (then spot only).

Search: exact when the candidate counts of every pool but one number at most ``exact_limit`` combinations
(the last pool's least count is solved in closed form); else greedy (offers by cost per effective token,
spot within its budget, each count rounded up, a trim pass, then local moves: add one worker, trim, kept
while the cost falls). The greedy result costs at most the fractional (LP) optimum plus one worker's price per
pool used. Issue [14]'s simulator holds the MILP baseline.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from control.policy.curves import ThroughputCurve
from actors.autoscaler.signals import Slo
from control.policy.numbers import is_number

MARKETS = ("on_demand", "spot")
EXACT_LIMIT = 4096
_EPS = 1e-9


@dataclass(frozen=True)
class PoolOffer:
    """Workers one pool can give: its curve, price per worker-hour (of its market), the market, the spot
    preemption rate (per hour), the most workers, and ``recovery_s`` (preemption to replacement serving)."""

    pool: str
    curve: ThroughputCurve
    price_per_h: float
    market: str = "on_demand"
    preemption_rate_per_h: float = 0.0
    max_workers: int = 1
    recovery_s: float = 120.0

    def __post_init__(self) -> None:
        if not isinstance(self.pool, str) or not self.pool:
            raise ValueError("PoolOffer.pool must be a non-empty string")
        if self.market not in MARKETS:
            raise ValueError(f"PoolOffer.market must be one of {', '.join(MARKETS)}, got {self.market!r}")
        for name in ("price_per_h", "preemption_rate_per_h", "recovery_s"):
            v = getattr(self, name)
            if not is_number(v, minimum=0, finite=False):
                raise ValueError(f"PoolOffer.{name} must be a number >= 0, got {v!r}")
        if isinstance(self.max_workers, bool) or not isinstance(self.max_workers, int) or self.max_workers < 0:
            raise ValueError(f"PoolOffer.max_workers must be an integer >= 0, got {self.max_workers!r}")

    @classmethod
    def from_record(cls, record: Any, curve: ThroughputCurve, recovery_s: float = 120.0) -> "PoolOffer":
        """From a pool record (control.state.pools.PoolRecord: name, market, prices, preemption rate,
        max_workers) and the version's curve on it."""
        spot = record.market == "spot"
        return cls(record.name, curve, record.price_spot_per_h if spot else record.price_on_demand_per_h,
                   record.market, record.preemption_rate_per_h if spot else 0.0, record.max_workers, recovery_s)

    def expected_loss(self) -> float:
        """Expected fraction of a worker's capacity lost to preemption (0 on demand)."""
        if self.market != "spot":
            return 0.0
        return min(1.0, self.preemption_rate_per_h * self.recovery_s / 3600.0)

    def effective_tokens_per_s(self, slo: Slo, prompt_tokens: int | None = None) -> float:
        """SLO-met tokens/s of one worker after the expected preemption loss (module docstring)."""
        if prompt_tokens and self.curve.prefill and self.curve.ttft_ms_at(prompt_tokens) > slo.ttft_ms:
            return 0.0
        return self.curve.capacity_tokens_per_s(slo.itl_ms) * (1.0 - self.expected_loss())

    def cost_per_mtok(self, slo: Slo, prompt_tokens: int | None = None) -> float:
        """Price per million SLO-met tokens (inf when a worker meets no SLO)."""
        eff = self.effective_tokens_per_s(slo, prompt_tokens)
        return self.price_per_h / (3600.0 * eff) * 1e6 if eff > 0 else math.inf


@dataclass(frozen=True)
class MixPlan:
    """The chosen workers per pool (every offer named, 0 included) and what they give."""

    workers: Mapping[str, int]
    cost_per_h: float
    capacity_tokens_per_s: float
    spot_fraction: float
    feasible: bool
    exact: bool
    notes: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class _Opt:
    pool: str
    eff: float
    price: float
    spot: bool
    bound: int


def _options(demand: float, offers: Sequence[PoolOffer], slo: Slo, prompt_tokens: int | None) -> list[_Opt]:
    out = []
    for o in sorted(offers, key=lambda o: o.pool):
        eff = o.effective_tokens_per_s(slo, prompt_tokens)
        if eff > 0 and o.max_workers > 0:
            out.append(_Opt(o.pool, eff, o.price_per_h, o.market == "spot",
                            min(o.max_workers, math.ceil(demand / eff - _EPS))))
    return out


def _last_count(last: _Opt, demand: float, cap: float, spot: float, s: float) -> int | None:
    """The least count of ``last`` that covers ``demand`` with the spot cap ``s``, or None if none can."""
    n = max(0, math.ceil((demand - cap) / last.eff - _EPS))
    if last.spot:
        if s < 1 and n * last.eff * (1 - s) > s * cap - spot + _EPS:
            return None
    elif spot > s * cap + _EPS:
        if s <= 0:
            return None
        n = max(n, math.ceil((spot / s - cap) / last.eff - _EPS))
    return n if n <= last.bound else None


def _exact(opts: list[_Opt], demand: float, s: float, limit: int) -> dict[str, int] | None:
    """Exhaustive search (module docstring); None when too large or nothing is feasible."""
    last = max(opts, key=lambda o: (not o.spot, o.bound))
    rest = [o for o in opts if o is not last]
    if math.prod(o.bound + 1 for o in rest) > limit:
        return None
    best, best_key = None, None
    for counts in itertools.product(*(range(o.bound + 1) for o in rest)):
        cap = sum(n * o.eff for n, o in zip(counts, rest))
        spot = sum(n * o.eff for n, o in zip(counts, rest) if o.spot)
        n_last = _last_count(last, demand, cap, spot, s)
        if n_last is None:
            continue
        cost = sum(n * o.price for n, o in zip(counts, rest)) + n_last * last.price
        key = (round(cost, 9), sum(counts) + n_last, counts)
        if best_key is None or key < best_key:
            best_key, best = key, {**{o.pool: n for n, o in zip(counts, rest)}, last.pool: n_last}
    return best


def _feasible(plan: dict[str, int], opts: list[_Opt], demand: float, s: float) -> bool:
    cap = sum(plan[o.pool] * o.eff for o in opts)
    spot = sum(plan[o.pool] * o.eff for o in opts if o.spot)
    return cap >= demand - _EPS and spot <= s * cap + _EPS


def _cost(plan: dict[str, int], opts: list[_Opt]) -> float:
    return sum(plan[o.pool] * o.price for o in opts)


def _greedy(opts: list[_Opt], demand: float, s: float, rounds: int = 20) -> dict[str, int]:
    """Cheapest per effective token first, spot within ``s x demand``; drop what is not needed; then up to
    ``rounds`` local moves (add one worker anywhere, trim) while each lowers the cost."""
    plan = {o.pool: 0 for o in opts}
    need, spot_budget = demand, s * demand
    for o in sorted(opts, key=lambda o: (o.price / o.eff, o.pool)):
        if need <= _EPS:
            break
        n = min(o.bound, math.ceil(need / o.eff - _EPS))
        if o.spot:
            n = min(n, math.floor(spot_budget / o.eff + _EPS))
            spot_budget -= n * o.eff
        plan[o.pool], need = n, need - n * o.eff
    _trim(plan, opts, demand, s)
    for _ in range(rounds):
        best, best_cost = None, _cost(plan, opts) - _EPS
        for o in (o for o in opts if plan[o.pool] < o.bound):
            trial = {**plan, o.pool: plan[o.pool] + 1}
            _trim(trial, opts, demand, s)
            if _cost(trial, opts) < best_cost and _feasible(trial, opts, demand, s):
                best, best_cost = trial, _cost(trial, opts)
        if best is None:
            break
        plan = best
    return plan


def _trim(plan: dict[str, int], opts: list[_Opt], demand: float, s: float) -> None:
    """Remove workers, the most expensive first, while the plan stays feasible (in place)."""
    for o in sorted(opts, key=lambda o: (-o.price, o.pool)):
        while plan[o.pool] > 0:
            plan[o.pool] -= 1
            if not _feasible(plan, opts, demand, s):
                plan[o.pool] += 1
                break


def plan_mix(demand_tokens_per_s: float, offers: Sequence[PoolOffer], slo: Slo, *, spot_max_fraction: float = 0.7,
             prompt_tokens: int | None = None, exact_limit: int = EXACT_LIMIT) -> MixPlan:
    """The cheapest mix covering ``demand_tokens_per_s`` SLO-met tokens/s (module docstring). When no mix
    covers it, the greedy plan (as much as the pools give) with ``feasible=False``."""
    if not 0 <= spot_max_fraction <= 1:
        raise ValueError(f"spot_max_fraction must be in [0, 1], got {spot_max_fraction!r}")
    demand = max(0.0, float(demand_tokens_per_s))
    opts = _options(demand, offers, slo, prompt_tokens)
    notes = []
    s = spot_max_fraction
    if opts and all(o.spot for o in opts):
        s, notes = 1.0, ["no on-demand offer: spot cap not applied"]
    workers = {o.pool: 0 for o in offers}
    chosen = _exact(opts, demand, s, exact_limit) if opts and demand > 0 else ({} if demand <= 0 else None)
    exact = chosen is not None
    if chosen is None:
        chosen = _greedy(opts, demand, s) if opts else {}
    workers.update(chosen)
    by_pool = {o.pool: o for o in opts}
    cap = sum(n * by_pool[p].eff for p, n in chosen.items())
    spot = sum(n * by_pool[p].eff for p, n in chosen.items() if by_pool[p].spot)
    cost = sum(n * by_pool[p].price for p, n in chosen.items())
    feasible = cap >= demand - _EPS and spot <= s * cap + _EPS
    return MixPlan(workers, cost, cap, spot / cap if cap > 0 else 0.0, feasible, exact, tuple(notes))


def choose_mix(demand_tokens_per_s: float, offers: Sequence[PoolOffer], slo: Slo, **kwargs: Any) -> dict[str, int]:
    """Workers per pool of :func:`plan_mix` (pool -> count, every offer named)."""
    return dict(plan_mix(demand_tokens_per_s, offers, slo, **kwargs).workers)
