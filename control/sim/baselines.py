"""The simulator's baseline fleet policies (pure: no I/O, no clock; time is the view's simulated seconds).

Every baseline reads the same inputs file as the live policy (``control/sim/inputs/fleet.toml``: types,
prices, curves, SLO, the trace's stated prompt-length distribution — as the simulated live policy does,
control/sim/live_policy.py) and, each ``decide``, only the FleetView it is handed — except ``static-peak``,
which by its definition is provisioned once for the trace's peak and so reads the trace's peak demand (that
one figure) when it is built.

* ``reactive-on-demand`` — all on demand, one type: the type with the least on-demand cost per SLO-met
  output token (price / (one replica's tokens/s at the ITL SLO x the share of requests whose prompt it
  prefills within the TTFT budget, :func:`type_shares`)), scaled on current load the way a Kubernetes HPA
  scales (kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/: scale up at once, scale down
  to the largest recommendation of the last 300 s, the default ``downscale-stabilization`` window): needed =
  ceil((arrival tokens/s + queue tokens / 2 s) / (capacity x 0.8)), at least 1. 0.8 is the live pool
  policy's ``target_util`` (PoolConfig), 2 s its ``queue_drain_high_s``. No spot. A single type whose
  prefill is too slow for the longest prompts misses those requests: that is part of the baseline.
* ``static-peak`` — the cheapest single on-demand type (same rule), ceil(trace peak output tokens/s /
  (capacity x 0.8)) replicas from the first decision on, never changed.
* ``melange`` — a Mélange-style (Griggs et al., 2024) cost-optimal type mix, on demand only, re-solved
  every 15 simulated minutes by the bucketed MILP of control/sim/milp.py (HiGHS via scipy.optimize.milp):
  the trace's prompt-length bins are Mélange's request-size buckets; integer replicas per type, each
  bucket's demand shared among the types that prefill it within the TTFT budget (latency.eligible),
  capacity at the ITL SLO >= the largest arrival tokens/s seen in the last window (the first decision: the
  current one) / 0.8 (the same 20 % headroom), at the least cost per hour, within ``max_accelerators``
  (beyond it: the largest fraction of the demand it holds). A new mix is applied make-before-break: for the
  longest cold start of the types it adds, each type keeps max(old, new) replicas, then the new count.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Iterable

from control.sim.api import MARKETS, pool_key
from control.sim.latency import eligible, prompt_bins
from control.sim.milp import BucketItem, solve_buckets

TARGET_UTIL = 0.8  # actors.autoscaler.pool_policy.PoolConfig.target_util: plan on 80 % of SLO capacity
QUEUE_DRAIN_S = 2.0  # PoolConfig.queue_drain_high_s: a backlog should drain within 2 s
HPA_DOWN_WINDOW_S = 300.0  # Kubernetes HPA default scale-down stabilization window
MELANGE_RESOLVE_S = 900.0  # re-solve the Mélange mix every 15 simulated minutes


def accel_types(inputs: Any) -> list[Any]:
    """The AccelType entries of ``inputs.types`` (name -> AccelType), in file order."""
    return list(inputs.types.values())


def type_shares(inputs: Any) -> dict[str, float]:
    """Per type, the share of requests it serves within the TTFT SLO: the trace's prompt bins
    (control.sim.latency.prompt_bins of ``inputs.trace``, the length distribution the inputs file states)
    whose prefill on that type fits the engine's budget (latency.eligible: 80 % of the TTFT SLO at the bin's
    upper edge), weighted by their mass."""
    bins = prompt_bins(inputs.trace)
    return {name: float((bins.mass * el).sum()) for name, el in eligible(inputs, bins).items()}


def replica_capacity(accel: Any, slo: Any) -> float:
    """Output tokens/s of one replica at the ITL SLO (ThroughputCurve.capacity_tokens_per_s)."""
    return accel.curve.capacity_tokens_per_s(slo.itl_ms)


def cheapest_on_demand_type(inputs: Any) -> tuple[Any, float]:
    """(AccelType, capacity) with the least on-demand price per SLO-met token: price / (capacity at the ITL
    SLO x the share of requests it serves within the TTFT SLO, :func:`type_shares`). ValueError if none
    serves any."""
    shares, best = type_shares(inputs), None
    for t in accel_types(inputs):
        cap = replica_capacity(t, inputs.slo) * shares[t.name]
        if cap > 0 and (best is None or t.on_demand_per_h / cap < best[0]):
            best = (t.on_demand_per_h / cap, t, replica_capacity(t, inputs.slo))
    if best is None:
        raise ValueError("no accelerator type meets the SLO for any request of the trace")
    return best[1], best[2]


def _all_keys(inputs: Any) -> list[str]:
    return [pool_key(t.name, m) for t in accel_types(inputs) for m in MARKETS]


class ReactiveOnDemand:
    """All on demand, one type, HPA-like reactive scaling on current load (module docstring)."""

    name = "reactive-on-demand"

    def __init__(self, inputs: Any) -> None:
        self.inputs = inputs
        self.key: str | None = None
        self.capacity = 0.0
        self._recent: deque[tuple[float, int]] = deque()

    def needed(self, view: Any) -> int:
        """Replicas for the current arrivals plus draining the backlog in QUEUE_DRAIN_S, at TARGET_UTIL."""
        demand = view.arrival_tokens_per_s + view.queue_tokens / QUEUE_DRAIN_S
        return max(1, math.ceil(demand / (self.capacity * TARGET_UTIL) - 1e-9))

    def decide(self, view: Any) -> dict[str, int]:
        if self.key is None:
            accel, self.capacity = cheapest_on_demand_type(self.inputs)
            self.key = pool_key(accel.name, "on_demand")
        self._recent.append((view.now_s, self.needed(view)))
        while self._recent and self._recent[0][0] < view.now_s - HPA_DOWN_WINDOW_S:
            self._recent.popleft()
        out = {k: 0 for k in _all_keys(self.inputs)}
        out[self.key] = max(n for _, n in self._recent)
        return out


class StaticPeak:
    """Provisioned once for the trace's peak on the cheapest on-demand type; never changes."""

    name = "static-peak"

    def __init__(self, inputs: Any, peak_tokens_per_s: float) -> None:
        if not peak_tokens_per_s >= 0:
            raise ValueError(f"StaticPeak.peak_tokens_per_s must be >= 0, got {peak_tokens_per_s!r}")
        self.inputs = inputs
        self.peak_tokens_per_s = float(peak_tokens_per_s)
        self.counts: dict[str, int] | None = None

    def decide(self, view: Any) -> dict[str, int]:
        if self.counts is None:
            accel, cap = cheapest_on_demand_type(self.inputs)
            self.counts = {k: 0 for k in _all_keys(self.inputs)}
            self.counts[pool_key(accel.name, "on_demand")] = max(
                1, math.ceil(self.peak_tokens_per_s / (cap * TARGET_UTIL) - 1e-9))
        return dict(self.counts)


class Melange:
    """Mélange-style MILP type mix over prompt-length buckets, on demand only, re-solved every
    ``resolve_s`` (module docstring)."""

    name = "melange"

    def __init__(self, inputs: Any, resolve_s: float = MELANGE_RESOLVE_S) -> None:
        if not resolve_s > 0:
            raise ValueError(f"Melange.resolve_s must be > 0, got {resolve_s!r}")
        self.inputs, self.resolve_s = inputs, float(resolve_s)
        bins = prompt_bins(inputs.trace)
        self.mass = [float(m) for m in bins.mass]
        el = eligible(inputs, bins)
        self.items = [BucketItem(pool_key(t.name, "on_demand"),
                                 tuple(replica_capacity(t, inputs.slo) if ok else 0.0 for ok in el[t.name]),
                                 t.on_demand_per_h, int(t.gpus_per_replica), inputs.max_replicas_per_pool)
                      for t in accel_types(inputs)]
        self.next_solve_s = -math.inf
        self.window_peak = 0.0
        self.counts: dict[str, int] = {k: 0 for k in _all_keys(inputs)}
        self.previous: dict[str, int] = dict(self.counts)
        self.transition_until_s = -math.inf
        self.solutions: list[tuple[float, dict[str, int], float]] = []  # (t, counts, cost/h): the log

    def mix_for(self, demand: float) -> Any:
        """The bucketed MILP's solution for ``demand`` output tokens/s (split over the buckets by mass);
        when the fleet's accelerators cannot cover it, the largest fraction of it they can (bisection)."""
        budget = self.inputs.max_accelerators
        sol = solve_buckets([demand * m for m in self.mass], self.items, max_accelerators=budget)
        if sol.feasible:
            return sol
        lo, hi, best = 0.0, 1.0, None
        for _ in range(20):
            mid = (lo + hi) / 2
            trial = solve_buckets([demand * mid * m for m in self.mass], self.items, max_accelerators=budget)
            lo, hi, best = (mid, hi, trial) if trial.feasible else (lo, mid, best)
        return best if best is not None else sol

    def solve(self, now_s: float, demand: float) -> None:
        """Solve for ``demand`` / TARGET_UTIL and start the make-before-break transition."""
        sol = self.mix_for(demand / TARGET_UTIL)
        new = {**{k: 0 for k in self.counts}, **sol.counts}
        added = [k for k in new if new[k] > self.counts.get(k, 0)]
        cold = max((t.cold_start_s for t in accel_types(self.inputs) if pool_key(t.name, "on_demand") in added),
                   default=0.0)
        self.previous, self.counts = self.counts, new
        self.transition_until_s = now_s + cold
        self.solutions.append((now_s, dict(new), sol.cost_per_h))

    def decide(self, view: Any) -> dict[str, int]:
        self.window_peak = max(self.window_peak, view.arrival_tokens_per_s)
        if view.now_s >= self.next_solve_s:
            self.solve(view.now_s, self.window_peak)
            self.window_peak = view.arrival_tokens_per_s
            self.next_solve_s = view.now_s + self.resolve_s
        if view.now_s < self.transition_until_s:
            return {k: max(self.counts[k], self.previous.get(k, 0)) for k in self.counts}
        return dict(self.counts)


def trace_peak_tokens_per_s(trace: Any) -> float:
    """The trace's peak demanded output tokens/s (what static-peak provisions for): its largest per-tick
    mean rate (req/s) x its mean output length (``Trace.output_mean``; when 0, the lognormal mean
    median x exp(sigma^2 / 2), at most ``output_max``)."""
    mean = trace.output_mean or min(trace.output_max, trace.output_median * math.exp(trace.output_sigma ** 2 / 2))
    return float(max(trace.rps, default=0.0)) * float(mean)


def baseline_policies(inputs: Any, trace: Any = None) -> list[Any]:
    """The three baselines of issue [14], in order: reactive-on-demand, static-peak, melange. ``trace``: the
    run's trace (static-peak reads its peak); None builds the default one (make_trace(inputs))."""
    if trace is None:
        from control.sim.trace import make_trace

        trace = make_trace(inputs)
    return [ReactiveOnDemand(inputs), StaticPeak(inputs, trace_peak_tokens_per_s(trace)), Melange(inputs)]


def names(policies: Iterable[Any]) -> list[str]:
    """The ``name`` of each policy."""
    return [p.name for p in policies]
