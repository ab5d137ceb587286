"""The hindsight lower bound (issue [29] item 3): the least accelerator cost any fleet policy could pay on the
simulator for a given number of SLO-met output tokens, with perfect knowledge of the whole trace (pure: an LP).

The program (HiGHS's interior point with crossover, ``scipy.optimize.linprog(method="highs-ipm")``: 7 days
are ~124,000 variables; its dual simplex took 4x longer on one day) over slots of ``SLOT_S`` = 300 s::

    minimise    sum_{s,p} price_p N_ps T / 3600                                  (USD)
    subject to  sum_b u_gbs + sum_b v_gb(s-1) <= cap_g T sum_{p of type g} N_ps    every slot s, type g
                sum_g (u_gbs + v_gbs) / f_gb <= D_bs                               every slot s, prompt bin b
                sum_{p spot} e_p N_ps <= phi sum_p e_p N_ps                         every slot s (spot cap)
                sum_p gpus_p N_ps <= max_accelerators;  0 <= N_ps <= max_replicas_per_pool
                sum_{g,b,s} (u_gbs + v_gbs) >= M                                   (SLO-met tokens)
                u, v >= 0

N_ps: replicas of pool p (type x market) in slot s, continuous (the LP relaxation of integer replicas);
u_gbs / v_gbs: SLO-met output tokens of bin b's requests that arrived in slot s, decoded by type g in slot s /
in slot s + 1; D_bs: the trace's output tokens demanded by bin b in slot s (arrivals x bin mass x mean
output); f_gb: the share of bin b's prompts whose prefill on type g alone fits the TTFT SLO (no queue wait,
no CPU tiers: the engine's own share with wait = 0, latency.PromptBins.frac_within); cap_g: the most output
tokens/s one replica of type g generates at any batch whose ITL meets the SLO (:func:`slo_capacity`; for the
inputs' H100 that is batch 16, 1,384 tok/s, above ``capacity_tokens_per_s`` at batch 64); e_p and phi: the
live mix's spot cap (``spot_max_fraction`` of the effective capacity, PoolOffer.effective_tokens_per_s, as
actors/autoscaler/mix.py applies it); M: the SLO-met tokens the bound is asked for.

Why it is a lower bound on every policy the simulator runs, for the same SLO-met tokens M (a relaxation of
the engine, control/sim/engine.py): (1) the engine bills every replica that exists — ready, starting,
leaving — and the LP bills only replicas that serve, at their slot average, with no cold start (the issue:
cold starts ignored) and continuous counts; (2) an output token the engine counts as SLO-met is decoded by a
ready replica at a batch whose ITL meets the SLO (the engine counts a bin's arrivals met only where the pool
it was admitted to has ITL <= SLO), so at most cap_g tokens/s per replica-second; (3) a met request's prompt
has prefill(P) <= TTFT SLO - wait - CPU <= TTFT SLO on its type, so at most f_gb of bin b on type g; (4)
capacity is pooled over the slot (the policy must match each 5-s tick, the LP only the slot's sum) and a
slot's met requests may still be decoded in the next slot (a met request meets the 50-ms ITL at admission;
2,048 output tokens, the trace's clip, take 102 s at that ITL, less than a slot); (5) spot replicas are never
lost (preemptions and the correlated event only remove capacity from a policy), prefill takes no replica
time, the CPU tiers cost nothing; (6) the fleet caps (accelerators, replicas per pool) and the spot cap are
the ones the simulated fleet and the live mix obey. The last slot's ``v`` is not charged (the engine counts
arrivals met at arrival, so a run's last requests may be decoded after it ends). The minimum cost C(M) is
convex in M with C(0) = 0, so C(M) / M does not decrease: the bound at attainment a holds for every policy
with attainment >= a, and :func:`bound_for` at a policy's own met tokens bounds that policy.
What it is not: a bound for a policy that puts more than ``spot_max_fraction`` of the capacity on spot
(``spot_cap=False`` drops that row: the all-spot bound, reported beside it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from control.sim.api import FleetInputs, Trace, split_pool_key
from control.sim.latency import CurveTable, prompt_bins

SLOT_S = 300.0
TIME_LIMIT_S = 120.0  # per solve; 7 days solve in seconds, a solve past this is reported infeasible with its status


def slo_capacity(table: CurveTable, itl_slo_ms: float, max_batch: float) -> float:
    """The most output tokens/s one replica generates at a batch in (0, ``max_batch``] whose ITL (the curve's,
    CurveTable.itl_ms) is <= ``itl_slo_ms``: the piecewise-linear tokens/s peaks at a measured batch or at the
    largest feasible batch, found by bisection on ITL (non-decreasing in batch, as the inputs' curves are);
    0 when no batch meets the SLO."""
    if table.itl_ms(min(1e-9, max_batch)) > itl_slo_ms * (1 + 1e-9):
        return 0.0
    lo, hi = 0.0, float(max_batch)
    if table.itl_ms(hi) > itl_slo_ms * (1 + 1e-9):
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if table.itl_ms(mid) <= itl_slo_ms * (1 + 1e-9) else (lo, mid)
        top = lo
    else:
        top = hi
    cands = [top] + [float(b) for b in table.b if b <= top]
    return max(table.tokens_per_s(b) for b in cands)


@dataclass(frozen=True)
class HindsightBound:
    """The LP's answer for ``met_tokens`` (SLO-met output tokens asked for, = attainment x demanded tokens):
    cost (USD, accelerators), cost per 1M SLO-met tokens, replica-hours per pool, spot share of replica-hours,
    HiGHS's status, the slots, the program's size and the wall time of the solve."""

    attainment: float
    met_tokens: float
    demand_tokens: float
    cost_usd: float
    cost_per_1m_slo_tokens: float
    replica_hours: Mapping[str, float]
    spot_share: float
    feasible: bool
    status: str
    slots: int
    variables: int
    wall_s: float
    spot_cap: bool = True
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        return {"attainment": self.attainment, "met_tokens": self.met_tokens, "demand_tokens": self.demand_tokens,
                "cost_usd": self.cost_usd, "cost_per_1m_slo_tokens": self.cost_per_1m_slo_tokens,
                "replica_hours": dict(self.replica_hours), "spot_share": self.spot_share,
                "feasible": self.feasible, "status": self.status, "slots": self.slots,
                "variables": self.variables, "wall_s": self.wall_s, "spot_cap": self.spot_cap, **self.extra}


class BoundProgram:
    """The LP of the module docstring for one trace, built once; :meth:`solve` for any met tokens."""

    def __init__(self, inputs: FleetInputs, trace: Trace, *, slot_s: float = SLOT_S, spot_cap: bool = True) -> None:
        from scipy import sparse

        from control.sim.live_policy import offers_for  # the live mix's offers: its spot cap's capacities

        if not slot_s >= trace.tick_s:
            raise ValueError(f"slot_s must be >= the trace's tick ({trace.tick_s} s), got {slot_s!r}")
        self.inputs, self.spot_cap = inputs, spot_cap
        per = max(1, int(round(slot_s / trace.tick_s)))
        self.slot_s = per * trace.tick_s
        arr = np.asarray(trace.rps, dtype=float) * trace.tick_s
        n = math.ceil(len(arr) / per)
        arrivals = np.add.reduceat(arr, np.arange(0, len(arr), per)) if len(arr) else np.zeros(0)
        bins = prompt_bins(inputs.trace)
        self.demand = arrivals[:, None] * bins.mass[None, :] * trace.output_mean  # (S, K) tokens
        self.demand_tokens = float(self.demand.sum())
        self.keys = inputs.pool_keys()
        types = list(inputs.types)
        slo = inputs.slo
        f, cap = {}, {}
        for g in types:
            a = inputs.types[g]
            tab = CurveTable(a.curve)
            cap[g] = slo_capacity(tab, slo.itl_ms, float(a.max_batch))
            f[g] = bins.frac_within(tab.prompt_within(np.full(bins.k, slo.ttft_ms)))
        pairs = [(g, b) for g in types for b in range(bins.k) if f[g][b] > 1e-12 and cap[g] > 0]
        self.cap, self.f, self.pairs = cap, f, pairs
        best_f = np.max([f[g] for g in types if cap[g] > 0], axis=0) if any(cap[g] > 0 for g in types) \
            else np.zeros(bins.k)
        self.max_met_tokens = float((self.demand * best_f[None, :]).sum())  # every servable token met
        P, E, K = len(self.keys), len(pairs), bins.k
        W = P + 2 * E
        self.n_slots, self.width = n, W
        nv = n * W
        T = self.slot_s
        ptype = [split_pool_key(k)[0] for k in self.keys]
        spot = [split_pool_key(k)[1] == "spot" for k in self.keys]
        price = np.array([inputs.types[t].price_per_h(split_pool_key(k)[1]) for k, t in zip(self.keys, ptype)])
        c = np.zeros(nv)
        for s in range(n):
            c[s * W: s * W + P] = price * T / 3600.0
        self.c = c
        rows, cols, vals, ub = [], [], [], []
        r = 0

        def add(row_entries, bound):
            nonlocal r
            for col, val in row_entries:
                rows.append(r)
                cols.append(col)
                vals.append(val)
            ub.append(bound)
            r += 1

        offers = offers_for(inputs)
        eff = np.array([offers[k].effective_tokens_per_s(slo) for k in self.keys])
        has_od = any(not sp and eff[p] > 0 for p, sp in enumerate(spot))
        phi = inputs.spot_max_fraction
        gpus = np.array([inputs.types[t].gpus_per_replica for t in ptype], dtype=float)
        for s in range(n):
            base = s * W
            for g in types:  # type capacity
                ent = [(base + P + e, 1.0) for e, (gg, _) in enumerate(pairs) if gg == g]
                if s > 0:
                    ent += [((s - 1) * W + P + E + e, 1.0) for e, (gg, _) in enumerate(pairs) if gg == g]
                ent += [(base + p, -cap[g] * T) for p in range(P) if ptype[p] == g]
                if any(v > 0 for _, v in ent):
                    add(ent, 0.0)
            for b in range(K):  # bin demand
                ent = [(base + P + e, 1.0 / f[g][bb]) for e, (g, bb) in enumerate(pairs) if bb == b]
                ent += [(base + P + E + e, 1.0 / f[g][bb]) for e, (g, bb) in enumerate(pairs) if bb == b]
                if ent:
                    add(ent, float(self.demand[s, b]))
            if spot_cap and has_od:  # sum_spot e N <= phi sum_all e N
                add([(base + p, (1.0 if spot[p] else 0.0) * eff[p] - phi * eff[p]) for p in range(P)], 0.0)
            add([(base + p, gpus[p]) for p in range(P)], float(inputs.max_accelerators))
        self.met_row = r
        add([(s * W + P + e, -1.0) for s in range(n) for e in range(2 * E)], 0.0)
        self.a_ub = sparse.csr_matrix((vals, (rows, cols)), shape=(r, nv))
        self.b_ub = np.array(ub)
        hi = np.full(nv, np.inf)
        for s in range(n):
            hi[s * W: s * W + P] = float(inputs.max_replicas_per_pool)
        self.bounds = np.stack([np.zeros(nv), hi], axis=1)

    def solve(self, met_tokens: float) -> HindsightBound:
        """The least cost for ``met_tokens`` SLO-met output tokens (ValueError if negative)."""
        from scipy.optimize import linprog

        if not met_tokens >= 0:
            raise ValueError(f"met_tokens must be >= 0, got {met_tokens!r}")
        b = self.b_ub.copy()
        # at most the servable tokens, less 1e-9 of them: at exactly the maximum the program has a single
        # feasible point, where HiGHS's interior point did not finish (a policy at 100.0 % attainment)
        b[self.met_row] = -min(float(met_tokens), self.max_met_tokens * (1 - 1e-9))
        t0 = time.perf_counter()
        res = linprog(self.c, A_ub=self.a_ub, b_ub=b, bounds=self.bounds, method="highs-ipm",
                      options={"time_limit": TIME_LIMIT_S})
        wall = time.perf_counter() - t0
        att = met_tokens / self.demand_tokens if self.demand_tokens > 0 else 1.0
        P, W, n = len(self.keys), self.width, self.n_slots
        if res.status != 0 or res.x is None:
            return HindsightBound(att, met_tokens, self.demand_tokens, math.nan, math.nan, {}, math.nan, False,
                                  str(res.message), n, len(self.c), wall, self.spot_cap)
        x = res.x.reshape(n, W)[:, :P]
        hours = {k: float(x[:, p].sum() * self.slot_s / 3600.0) for p, k in enumerate(self.keys)}
        tot = sum(hours.values())
        spot_h = sum(h for k, h in hours.items() if split_pool_key(k)[1] == "spot")
        cost = float(res.fun)
        per_m = cost / met_tokens * 1e6 if met_tokens > 0 else 0.0
        return HindsightBound(att, float(met_tokens), self.demand_tokens, cost, per_m, hours,
                              spot_h / tot if tot > 0 else 0.0, True, str(res.message), n, len(self.c), wall,
                              self.spot_cap, {"slo_capacity_tokens_per_s": dict(self.cap)})

    def at_attainment(self, attainment: float) -> HindsightBound:
        """:meth:`solve` for ``attainment`` x the trace's demanded output tokens."""
        if not 0 <= attainment <= 1:
            raise ValueError(f"attainment must be in [0, 1], got {attainment!r}")
        return self.solve(attainment * self.demand_tokens)


def bound_for(program: BoundProgram, result: Mapping[str, Any]) -> HindsightBound:
    """The bound at a policy's own SLO-met tokens (``PolicyResult.to_json()``'s ``slo_met_output_tokens``)."""
    return program.solve(min(float(result["slo_met_output_tokens"]), program.demand_tokens))
