"""``ActorservePolicy``: the live autoscaler's policy modules, run inside the simulator (imported, never
copied: ``PoolPolicy`` from actors/autoscaler/pool_policy.py, ``plan_mix`` / ``PoolOffer`` from mix.py,
``ThroughputCurve`` from curves.py, ``PoolSignals`` / ``Limits`` / ``Slo`` from signals.py). The CPU tiers'
``CpuTierPolicy`` runs in the engine for every policy (control/sim/cpu_tier.py).

What this adapter does, as actors/autoscaler/service.py does live:

* a pool mix every ``mix_every_s`` (default 30 s; live: each 1-s tick): ``plan_mix`` over one ``PoolOffer``
  per pool key (the type's curve, its market's price, the spot preemption rate, ``max_workers`` =
  ``max_replicas_per_pool``, ``recovery_s`` = notice + cold start), for the demand of the last tick. One
  difference from the live service, for prompt lengths: the trace's prompt bins that a type serves within
  the TTFT budget (latency.eligible) form groups, and each group's share of the demand is planned on the
  offers that serve it (the live service plans one mix per version at its mean prompt);
* demand is divided by ``PoolConfig.target_util`` before the mix, so the mix's counts (the pools'
  ceilings, as live) leave the pool policy its headroom (request S1-1: the live service plans the mix at
  100 % of the curve's capacity, so the ceiling it sets cuts the 20 % headroom PoolPolicy aims for);
* ``PoolSignals`` per pool from the FleetView (replicas = ready + leaving, starting, leaving, queue tokens
  and length by the pool's share, KV use, TTFT / ITL p90, arrivals = demand x the pool's mix share, tokens
  served); limits as service._pool_limits: floor 1 on the default pool (the cheapest on-demand type per
  SLO-met token), 0 elsewhere and scale to zero, ceiling = the mix's count (at least 1);
* ``PoolPolicy.decide`` -> desired counts (Decision.desired) per pool key;
* issue [29]: the demand planned is ``ArrivalForecaster.planned`` (max of the observed arrivals and the
  Holt-Winters forecast ``lead_s`` ahead; forecast.py) plus, with ``drain_s`` > 0, ``backlog_rate`` (the
  backlog new replicas will find, drained within ``drain_s``); and the mix is re-planned at once when the
  demand rises ``REPLAN_RISE`` (10 %) above what it was planned for (the live service re-plans every tick; a
  30-s-old mix capped the step-up for up to 30 s).
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from actors.autoscaler.forecast import ArrivalForecaster, ForecastConfig, backlog_rate
from actors.autoscaler.mix import PoolOffer, plan_mix
from actors.autoscaler.pool_policy import PoolConfig, PoolPolicy
from actors.autoscaler.signals import Limits, PoolSignals
from control.sim.api import FleetInputs, FleetView, split_pool_key
from control.sim.latency import eligible, prompt_bins

MODEL, VERSION = "llm", "1"
REPLAN_RISE = 0.1  # demand 10 % above the mix's: re-plan at once instead of at the next mix_every_s


def offers_for(inputs: FleetInputs) -> dict[str, PoolOffer]:
    """One live PoolOffer per pool key (module docstring)."""
    out = {}
    for key in inputs.pool_keys():
        t, market = split_pool_key(key)
        a = inputs.types[t]
        rate = inputs.spot.preemption_rate_per_h.get(t, 0.0) if market == "spot" else 0.0
        out[key] = PoolOffer(key, a.curve, a.price_per_h(market), market, rate, inputs.max_replicas_per_pool,
                             inputs.spot.notice_s + a.cold_start_s)
    return out


def prompt_groups(inputs: FleetInputs) -> list[tuple[float, list[str]]]:
    """(share of requests, types serving them) per group of prompt bins with the same serving types."""
    bins = prompt_bins(inputs.trace)
    el = eligible(inputs, bins)
    groups: dict[tuple[str, ...], float] = {}
    for j in range(bins.k):
        types = tuple(t for t in inputs.types if el[t][j]) or (max(inputs.types, key=lambda t: 0),)
        groups[types] = groups.get(types, 0.0) + float(bins.mass[j])
    return [(share, list(types)) for types, share in groups.items()]


class ActorservePolicy:
    """The live pool policy + mix on the simulated fleet (module docstring)."""

    name = "actorserve"

    def __init__(self, inputs: FleetInputs, cfg: PoolConfig | None = None, mix_every_s: float = 30.0,
                 forecast: ForecastConfig | None = None) -> None:
        self.inputs = inputs
        self.forecaster = ArrivalForecaster(forecast or ForecastConfig(enabled=False))
        self.cfg = cfg or PoolConfig()
        self.pool_policy = PoolPolicy(self.cfg)
        self.offers = offers_for(inputs)
        self.groups = prompt_groups(inputs)
        self.eff = {k: o.effective_tokens_per_s(inputs.slo) for k, o in self.offers.items()}
        self.mix_every_s = mix_every_s
        self.slo = inputs.slo
        od = [k for k in self.offers if split_pool_key(k)[1] == "on_demand"]
        self.default_pool = min(od, key=lambda k: (self.offers[k].cost_per_mtok(self.slo), k))
        self.mix: dict[str, int] = {}
        self.group_mix: list[dict[str, int]] = []
        self._last_mix = -math.inf
        self._planned_for = 0.0
        self.eff_raw = {k: o.curve.capacity_tokens_per_s(inputs.slo.itl_ms) for k, o in self.offers.items()}
        self.desired: dict[str, int] = {}

    def _plan(self, demand: float) -> None:
        """The pool mix for ``demand`` output tokens/s (module docstring)."""
        total: dict[str, int] = {k: 0 for k in self.offers}
        self.group_mix = []
        for share, types in self.groups:
            offers = [o for k, o in self.offers.items() if split_pool_key(k)[0] in types]
            plan = plan_mix(demand * share / self.cfg.target_util, offers, self.slo,
                            spot_max_fraction=self.inputs.spot_max_fraction)
            self.group_mix.append(dict(plan.workers))
            for k, n in plan.workers.items():
                total[k] += n
        self.mix = total

    def _arrivals(self, demand: float) -> dict[str, float]:
        """Demand per pool: each group's share split by its mix's workers x effective capacity."""
        out = {k: 0.0 for k in self.offers}
        for (share, _), mix in zip(self.groups, self.group_mix):
            eff = {k: n * self.eff[k] for k, n in mix.items()}
            tot = sum(eff.values())
            for k, v in eff.items():
                out[k] += demand * share * v / tot if tot > 0 else 0.0
        return out

    def decide(self, view: FleetView) -> Mapping[str, int]:
        """Desired replicas per pool key for the changes PoolPolicy decided."""
        key = f"{MODEL}/{VERSION}"
        self.forecaster.observe(key, view.now_s, view.arrival_tokens_per_s)
        demand = self.forecaster.planned(key, view.now_s, view.arrival_tokens_per_s)
        fcfg = self.forecaster.cfg
        if fcfg.enabled and fcfg.drain_s > 0:
            cap = sum(pv.ready * self.eff_raw[k] for k, pv in view.pools.items())
            demand += backlog_rate(view.queue_tokens, view.arrival_tokens_per_s, cap, fcfg.lead_s, fcfg.drain_s)
        if demand > self._planned_for * (1 + REPLAN_RISE):  # the live service re-plans every tick; here on a rise
            self._last_mix = -math.inf
        if view.now_s - self._last_mix >= self.mix_every_s:
            self._plan(demand)
            self._last_mix = view.now_s
            self._planned_for = demand
        arrivals = self._arrivals(demand)
        signals, limits, slos, curves = {}, {}, {}, {}
        for key, pv in view.pools.items():
            s = PoolSignals(MODEL, VERSION, key, replicas=pv.ready + pv.leaving, starting=pv.starting,
                            leaving=pv.leaving, queue_tokens=pv.queue_tokens,
                            queue_len=int(round(pv.queue_tokens / max(view.output_tokens_mean, 1.0))),
                            kv_util=min(pv.kv_util, 1.0), ttft_ms_p90=pv.ttft_ms_p90, itl_ms_p90=pv.itl_ms_p90,
                            arrival_tokens_per_s=arrivals.get(key, 0.0),
                            served_tokens_per_s=pv.served_tokens_per_s)
            sk = s.key
            signals[sk] = s
            floor = 1 if key == self.default_pool else 0
            limits[sk] = Limits(floor, max(1, floor, self.mix.get(key, 0)), scale_to_zero=key != self.default_pool)
            slos[sk] = self.slo
            curves[sk] = pv.accel.curve
        by_target = {s.target: k for k, s in zip(view.pools, signals.values())}
        for d in self.pool_policy.decide(view.now_s, signals, limits, slos, curves):
            self.desired[by_target[d.target]] = d.desired
        return dict(self.desired)


    def report(self) -> dict[str, object]:
        """For the run's result (PolicyResult.extra["policy"]): the forecast's error per model version at its
        lead (ArrivalForecaster.errors) and its configuration."""
        f = self.forecaster
        return {"forecast": {"enabled": f.cfg.enabled, "lead_s": f.cfg.lead_s, "bucket_s": f.cfg.bucket_s,
                             "errors": {k: f.errors(k) for k in f.keys()}}}


def live_modules() -> dict[str, object]:
    """The live classes / functions this adapter runs (for the identity test)."""
    return {"PoolPolicy": PoolPolicy, "plan_mix": plan_mix, "PoolOffer": PoolOffer, "PoolSignals": PoolSignals,
            "ArrivalForecaster": ArrivalForecaster, "np": np}
