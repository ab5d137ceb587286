"""Per-minute series, the end-of-run result and the issue's targets (pure).

``MinuteLog`` sums arrivals, SLO-met requests and cost per simulated minute and keeps the replicas (billed:
ready + starting + leaving) per pool at each minute's last tick. ``recovery_s_after_step``: seconds from the
step's start to the end of the first minute from which every minute of the next ten keeps per-minute
attainment >= 99 % (0 when no minute after the step dips below; None without a step in the trace).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from control.sim.api import FleetInputs, PolicyResult, Trace


class MinuteLog:
    def __init__(self, keys: list[str], tick_s: float) -> None:
        self.keys = keys
        self.per_min = max(1, int(round(60.0 / tick_s)))
        self.t_min: list[int] = []
        self.arr: list[float] = []
        self.met: list[float] = []
        self.cost: list[float] = []
        self.replicas: dict[str, list[int]] = {k: [] for k in keys}
        self._a = self._m = self._c = 0.0
        self._n = 0

    def add(self, now_s: float, arrived: float, met: float, cost: float, billed: np.ndarray) -> None:
        self._a += arrived
        self._m += met
        self._c += cost
        self._n += 1
        if self._n == self.per_min:
            self.t_min.append(int(now_s // 60))
            self.arr.append(self._a)
            self.met.append(self._m)
            self.cost.append(self._c)
            for k, v in zip(self.keys, billed):
                self.replicas[k].append(int(v))
            self._a = self._m = self._c = 0.0
            self._n = 0

    def series(self) -> dict[str, Any]:
        att = [m / a if a > 0 else 1.0 for m, a in zip(self.met, self.arr)]
        return {"t_min": self.t_min, "load_rps": [a / 60.0 for a in self.arr], "attainment": att,
                "cost_usd_cum": list(np.cumsum(self.cost)), "replicas": self.replicas}


def recovery_s(t_min: list[int], attainment: list[float], step_at_s: float, hold_min: int = 10,
               level: float = 0.99) -> float | None:
    """Module docstring; None when the step is outside the series."""
    start = int(step_at_s // 60)
    if not t_min or start > t_min[-1]:
        return None
    idx = [i for i, t in enumerate(t_min) if t >= start]
    att = [attainment[i] for i in idx]
    if all(a >= level for a in att[: hold_min * 6]):
        return 0.0
    for j in range(len(att)):
        if all(a >= level for a in att[j: j + hold_min]):
            return float((t_min[idx[j]] + 1) * 60 - step_at_s) if j > 0 else float(60 - step_at_s % 60)
    return math.inf


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    if weights.sum() <= 0:
        return 0.0
    idx = np.argsort(values)
    cw = np.cumsum(weights[idx]) / weights.sum()
    return float(values[idx][min(int(np.searchsorted(cw, q)), len(idx) - 1)])


def finish_result(name: str, inputs: FleetInputs, trace: Trace, tot: Mapping[str, float], requests: dict,
                  cpu, cpu_p99: np.ndarray, log: MinuteLog, keys: list[str]) -> PolicyResult:
    """The PolicyResult of one run (cost includes the CPU tiers; ``extra`` has the accelerator-only cost)."""
    series = log.series()
    met_tokens = tot["met"] * trace.output_mean
    cost = tot["cost"] + cpu.cost_usd
    per_m = cost / met_tokens * 1e6 if met_tokens > 0 else math.inf
    p99 = weighted_quantile(cpu_p99, trace.rps, 0.99)
    cpu_info = {"cost_usd": cpu.cost_usd, "share_of_cost": cpu.cost_usd / cost if cost > 0 else 0.0,
                "p99_ttft_ms": p99, "replicas_end": dict(cpu.ready), "decisions": cpu.decisions}
    rec = recovery_s(series["t_min"], series["attainment"], trace.step_at_s)
    hours = {k: float(np.sum(v)) / 60.0 for k, v in series["replicas"].items()}
    peak_acc = int(max((sum(series["replicas"][k][i] for k in keys) for i in range(len(series["t_min"]))),
                       default=0))
    extra = {"accelerator_cost_usd": tot["cost"], "replica_hours": hours, "peak_replicas": peak_acc,
             "min_attainment_per_minute": min(series["attainment"], default=1.0)}
    return PolicyResult(name, cost, met_tokens, per_m, tot["met"] / tot["arrived"] if tot["arrived"] else 1.0,
                        requests["dropped_by_preemption"], rec, cpu_info, series, requests, extra)
