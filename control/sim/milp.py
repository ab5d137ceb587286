"""Mélange-style cost-optimal accelerator mix as a mixed-integer linear program (pure: no I/O, no clock).

Mélange (Griggs et al., 2024, "Mélange: Cost Efficient Large Language Model Serving by Exploiting GPU
Heterogeneity", arXiv:2404.14527) profiles each GPU type's throughput at the SLO for each request-size
bucket and picks the cheapest *integer* count of each type, with a fractional assignment of each bucket's
load to types, by integer linear programming. Here the buckets are the simulator's prompt-length bins
(control/sim/latency.py: equal-mass bins of the trace's stated distribution), a type serves a bucket when
its prefill of the bucket's longest prompt fits the TTFT budget, and its capacity is one replica's decode
tokens/s at the ITL SLO (ThroughputCurve.capacity_tokens_per_s). The program (:func:`solve_buckets`)::

    minimise    sum_g price_g N_g                                (USD per hour)
    subject to  sum_g x_bg = 1                                   every bucket b some type serves
                sum_b x_bg D_b / cap_gb <= N_g                   every type g: its replicas carry their load
                sum_g gpus_g N_g <= max_accelerators             (when given)
                x_bg = 0 where cap_gb = 0;  x_bg in [0, 1];  N_g in {0, .., max_g}

D_b: bucket b's demand (output tokens/s). Solved by HiGHS (branch and bound) through ``scipy.optimize.milp``;
exact up to HiGHS's default relative MIP gap (1e-4); among equal-cost mixes the one with fewer replicas
(a 1e-7 USD/h penalty per replica).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from control.policy.numbers import is_number

TIE_PENALTY_PER_REPLICA = 1e-7  # USD/h: among equal-cost mixes prefer the one with fewer replicas


@dataclass(frozen=True)
class BucketItem:
    """One offer for the bucketed program: ``capacity_tokens_per_s[b]`` is one replica's SLO capacity when it
    serves only bucket ``b``'s requests (0: the type cannot serve that bucket within the SLO)."""

    key: str
    capacity_tokens_per_s: tuple[float, ...]
    price_per_h: float
    gpus_per_replica: int = 1
    max_count: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError("BucketItem.key must be a non-empty string")
        v = self.price_per_h
        if not is_number(v, minimum=0):
            raise ValueError(f"BucketItem.price_per_h must be a finite number >= 0, got {v!r}")
        if isinstance(self.gpus_per_replica, bool) or not isinstance(self.gpus_per_replica, int) \
                or self.gpus_per_replica < 1:
            raise ValueError(f"BucketItem.gpus_per_replica must be an integer >= 1, got {self.gpus_per_replica!r}")
        if self.max_count is not None and (isinstance(self.max_count, bool) or not isinstance(self.max_count, int)
                                           or self.max_count < 0):
            raise ValueError(f"BucketItem.max_count must be None or an integer >= 0, got {self.max_count!r}")
        if any(not is_number(c, minimum=0)
               for c in self.capacity_tokens_per_s):
            raise ValueError(f"BucketItem.capacity_tokens_per_s must be finite numbers >= 0, got "
                             f"{self.capacity_tokens_per_s!r}")


@dataclass(frozen=True)
class BucketSolution:
    """Replicas per key, cost (USD/h), the share of each bucket each key serves (``assign[key][b]``), the
    buckets no offer serves (left out of the program) and HiGHS's status."""

    counts: Mapping[str, int]
    cost_per_h: float
    assign: Mapping[str, tuple[float, ...]]
    unserved_buckets: tuple[int, ...]
    feasible: bool
    status: str


def solve_buckets(demand_tokens_per_s: Sequence[float], items: Sequence[BucketItem], *,
                  max_accelerators: int | None = None) -> BucketSolution:
    """Mélange's program with request-size buckets (Griggs et al., 2024, section 5): integer replicas N_g per
    type, continuous shares x_bg of bucket b's demand D_b served by type g::

        minimise    sum_g price_g N_g
        subject to  sum_g x_bg = 1                               for every bucket b some offer serves
                    sum_b x_bg D_b / cap_gb <= N_g               for every offer g (its replicas' load)
                    sum_g gpus_g N_g <= max_accelerators          (when given)
                    x_bg = 0 where cap_gb = 0;  0 <= N_g <= max_g integer

    Buckets that no offer serves are left out (``unserved_buckets``). ValueError on mismatched lengths."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    d = [float(v) for v in demand_tokens_per_s]
    nb, ng = len(d), len(items)
    if any(len(it.capacity_tokens_per_s) != nb for it in items) or len({it.key for it in items}) != ng:
        raise ValueError("solve_buckets: every item needs one capacity per bucket, and unique keys")
    zero = {it.key: 0 for it in items}
    live = [b for b in range(nb) if d[b] > 0 and any(it.capacity_tokens_per_s[b] > 0 for it in items)]
    unserved = tuple(b for b in range(nb) if d[b] > 0 and b not in live)
    if not live:
        return BucketSolution(zero, 0.0, {it.key: (0.0,) * nb for it in items}, unserved, not unserved, "no demand")
    nx = len(live) * ng  # x[j, g] at j * ng + g, then N_g at nx + g
    cost = np.concatenate([np.zeros(nx), [it.price_per_h + TIE_PENALTY_PER_REPLICA for it in items]])
    a_eq = np.zeros((len(live), nx + ng))
    a_load = np.zeros((ng, nx + ng))
    for j, b in enumerate(live):
        for g, it in enumerate(items):
            if it.capacity_tokens_per_s[b] > 0:
                a_eq[j, j * ng + g] = 1.0
                a_load[g, j * ng + g] = d[b] / it.capacity_tokens_per_s[b]
    a_load[np.arange(ng), nx + np.arange(ng)] = -1.0
    cons = [LinearConstraint(a_eq, 1.0, 1.0), LinearConstraint(a_load, -np.inf, 0.0)]
    if max_accelerators is not None:
        cons.append(LinearConstraint(np.concatenate([np.zeros(nx), [float(it.gpus_per_replica) for it in items]])
                                     [None, :], -np.inf, float(max_accelerators)))
    x_hi = [1.0 if items[g].capacity_tokens_per_s[b] > 0 else 0.0 for b in live for g in range(ng)]
    n_hi = [float(_bucket_bound(it, d)) for it in items]
    res = milp(cost, constraints=cons, integrality=np.concatenate([np.zeros(nx), np.ones(ng)]),
               bounds=Bounds(np.zeros(nx + ng), np.array(x_hi + n_hi)))
    if res.x is None:
        return BucketSolution(zero, 0.0, {it.key: (0.0,) * nb for it in items}, unserved, False, str(res.message))
    counts = {it.key: int(round(res.x[nx + g])) for g, it in enumerate(items)}
    assign = {it.key: tuple(float(res.x[live.index(b) * ng + g]) if b in live else 0.0 for b in range(nb))
              for g, it in enumerate(items)}
    price = sum(counts[it.key] * it.price_per_h for it in items)
    return BucketSolution(counts, price, assign, unserved, True, str(res.message))


def _bucket_bound(item: BucketItem, demand: Sequence[float]) -> int:
    """Most replicas of ``item`` worth having: all the demand it can serve, on it alone (or its max)."""
    need = math.ceil(sum(d / c for d, c in zip(demand, item.capacity_tokens_per_s) if c > 0) - 1e-9)
    return need if item.max_count is None else min(item.max_count, need)
