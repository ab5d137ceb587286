"""Capacity planning (issue [14] item 2): the fleet that serves a constant load within the SLO, at what cost
(pure: no I/O, no clock), and its check in the simulator.

``plan_fleet(inputs, PlanRequest(rate_rps, prompt_tokens, output_tokens, slo))`` answers from the same
inputs file as ``actorserve simulate`` (curves, prices, spot preemption rates, the spot cap) and the same
planner as the live autoscaler (actors.autoscaler.mix.plan_mix, cheapest per SLO-met token):

* demand = ``rate_rps x output_tokens`` output tokens/s, planned at ``demand / target_util`` (0.8: the live
  pool policy's PoolConfig.target_util, the headroom it keeps over a curve's SLO capacity);
* one offer per type and market, built as the simulated live policy builds them
  (control.sim.live_policy.offers_for): the type's curve, its price on that market, at most
  ``inputs.max_replicas_per_pool`` replicas; a spot offer loses the expected fraction ``rate x recovery_s /
  3600`` of its capacity (mix.PoolOffer.expected_loss), ``recovery_s`` = notice + cold start — the
  preemption loss the live mix uses; the spot cap is ``inputs.spot_max_fraction`` of the effective capacity;
* a fixed fleet cannot react to a preemption as the live policy does, so the plan must also carry the
  demand (at 100 % of the curves) after every spot pool loses ``correlated_fraction`` (30 %) of its replicas,
  at least one each (the issue's correlated loss; at small scale one preemption): while it does not, the
  planned demand is raised 5 % and the mix planned again (``notes`` say by how much);
* a type whose TTFT for ``prompt_tokens`` alone (the curve's prefill) misses the TTFT SLO is not offered;
* cost per hour = sum of count x price; cost per 1M output tokens = cost per hour / (demand x 3600) x 1e6.

``verify_plan`` runs the simulator (control.sim.engine) on a constant load — Poisson arrivals per tick at the
rate, every prompt ``prompt_tokens`` (ln spread 0.02) and every output ``output_tokens`` long — with the
planned fleet fixed (:class:`FixedFleet`; the correlated spot loss moved past the run's end, independent
preemptions kept, their replacements asked for by holding the count) and compares, after the first minute
(the engine's first tick runs before its first decision, with no replica yet: a start-up artefact, not
steady state): SLO attainment >= ``min_attainment`` (0.995, the issue's target) and the simulated
accelerator cost per hour within ``cost_tolerance`` (+-10 %) of the prediction.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from actors.autoscaler.mix import PoolOffer, plan_mix
from actors.autoscaler.pool_policy import PoolConfig
from actors.autoscaler.signals import Slo
from control.sim.api import MARKETS, FleetInputs, pool_key, split_pool_key
from control.policy.numbers import is_int, is_number

MIN_ATTAINMENT = 0.995
COST_TOLERANCE = 0.10
RAISE_STEP = 1.05  # planned demand x this per step until the fleet survives the spot loss
WARMUP_MIN = 1  # the engine's first tick runs before its first decision (no replica yet): not steady state


def _pos(owner: str, name: str, v: Any, integer: bool = False) -> None:
    ok = is_int(v) if integer else is_number(v, finite=False)
    if not ok or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{owner}.{name} must be {'an integer' if integer else 'a finite number'} > 0, got {v!r}")


@dataclass(frozen=True)
class PlanRequest:
    """A constant load: requests per second, prompt and output tokens per request, and the SLO (ms)."""

    rate_rps: float
    prompt_tokens: int
    output_tokens: int
    slo: Slo

    def __post_init__(self) -> None:
        _pos("PlanRequest", "rate_rps", self.rate_rps)
        _pos("PlanRequest", "prompt_tokens", self.prompt_tokens, integer=True)
        _pos("PlanRequest", "output_tokens", self.output_tokens, integer=True)
        if not isinstance(self.slo, Slo):
            raise ValueError("PlanRequest.slo must be a Slo")

    @property
    def demand_tokens_per_s(self) -> float:
        """Output tokens/s demanded."""
        return self.rate_rps * self.output_tokens


@dataclass(frozen=True)
class FleetPlan:
    """The planned fleet: replicas per pool key (only those > 0), cost, effective SLO capacity (tokens/s,
    after the expected spot loss), its spot share, accelerators used; ``feasible`` False when the offers
    (or ``max_accelerators``) cannot cover the load (``notes`` say why)."""

    request: PlanRequest
    pools: Mapping[str, int]
    cost_per_h: float
    cost_per_1m_output_tokens: float
    demand_tokens_per_s: float
    planned_tokens_per_s: float
    capacity_tokens_per_s: float
    spot_fraction: float
    accelerators: int
    feasible: bool
    exact: bool
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (``pools``: ``{key: {"type", "market", "count"}}``)."""
        r = self.request
        return {"request": {"rate_rps": r.rate_rps, "prompt_tokens": r.prompt_tokens,
                            "output_tokens": r.output_tokens, "slo": {"ttft_ms": r.slo.ttft_ms, "itl_ms": r.slo.itl_ms}},
                "pools": {k: {"type": split_pool_key(k)[0], "market": split_pool_key(k)[1], "count": n}
                          for k, n in sorted(self.pools.items())},
                "cost_per_h": round(self.cost_per_h, 4),
                "cost_per_1m_output_tokens": round(self.cost_per_1m_output_tokens, 4),
                "demand_tokens_per_s": round(self.demand_tokens_per_s, 3),
                "planned_tokens_per_s": round(self.planned_tokens_per_s, 3),
                "capacity_tokens_per_s": round(self.capacity_tokens_per_s, 3),
                "spot_fraction": round(self.spot_fraction, 4), "accelerators": self.accelerators,
                "feasible": self.feasible, "exact": self.exact, "notes": list(self.notes)}


def fleet_offers(inputs: FleetInputs) -> list[PoolOffer]:
    """One live-mix PoolOffer per type and market, exactly as the simulated live policy builds them
    (control.sim.live_policy.offers_for: the market's price, the spot preemption rate, ``recovery_s`` =
    notice + cold start, at most ``max_replicas_per_pool``)."""
    from control.sim.live_policy import offers_for

    return list(offers_for(inputs).values())


def capacity_after_spot_loss(workers: Mapping[str, int], offers: Mapping[str, PoolOffer], request: PlanRequest,
                             fraction: float) -> float:
    """SLO capacity (tokens/s, at 100 % of the curves, no expected-loss discount) left after every spot pool
    loses ``ceil(fraction x its replicas)`` (at least one replica of each spot pool used)."""
    left = 0.0
    for key, n in workers.items():
        o = offers[key]
        cap = dataclasses.replace(o, market="on_demand", preemption_rate_per_h=0.0).effective_tokens_per_s(
            request.slo, request.prompt_tokens)
        lose = math.ceil(fraction * n - 1e-9) if o.market == "spot" else 0
        left += max(0, n - lose) * cap
    return left


def _mix(inputs: FleetInputs, request: PlanRequest, planned: float) -> Any:
    return plan_mix(planned, fleet_offers(inputs), request.slo, spot_max_fraction=inputs.spot_max_fraction,
                    prompt_tokens=request.prompt_tokens)


def plan_fleet(inputs: FleetInputs, request: PlanRequest, *, target_util: float | None = None,
               max_raise_steps: int = 60, demand_factor: float = 1.0) -> FleetPlan:
    """The cheapest fleet for ``request`` (module docstring), raised until it survives the spot loss.
    ``demand_factor`` (>= 1) multiplies the planned demand (``plan_checked`` raises it)."""
    util = PoolConfig().target_util if target_util is None else target_util
    if not 0 < util <= 1:
        raise ValueError(f"target_util must be in (0, 1], got {util!r}")
    offers = {o.pool: o for o in fleet_offers(inputs)}
    demand = request.demand_tokens_per_s
    planned = demand / util * demand_factor
    mix, notes = _mix(inputs, request, planned), []
    frac = inputs.spot.correlated_fraction
    for _ in range(max_raise_steps):
        if not mix.feasible or capacity_after_spot_loss(mix.workers, offers, request, frac) >= demand - 1e-9:
            break
        planned *= RAISE_STEP
        mix = _mix(inputs, request, planned)
    if planned > demand / util * demand_factor * (1 + 1e-9):
        notes.append(f"planned demand raised {100 * (planned * util / demand - 1):.0f} % so the fleet still carries "
                     f"the load after losing {100 * frac:.0f} % of its spot replicas (at least one per spot pool)")
    pools = {k: n for k, n in mix.workers.items() if n > 0}
    accelerators = sum(n * inputs.types[split_pool_key(k)[0]].gpus_per_replica for k, n in pools.items())
    notes += list(mix.notes)
    feasible = mix.feasible and bool(pools)
    if not mix.feasible:
        notes.append(f"no mix of the offers covers {planned:.0f} tokens/s at the SLO (TTFT of "
                     f"{request.prompt_tokens} prompt tokens, ITL {request.slo.itl_ms:g} ms; at most "
                     f"{inputs.max_replicas_per_pool} replicas per pool)")
    if accelerators > inputs.max_accelerators:
        feasible = False
        notes.append(f"needs {accelerators} accelerators > max_accelerators {inputs.max_accelerators}")
    per_1m = mix.cost_per_h / (demand * 3600.0) * 1e6
    return FleetPlan(request, pools, mix.cost_per_h, per_1m, demand, planned, mix.capacity_tokens_per_s,
                     mix.spot_fraction, accelerators, feasible, mix.exact, tuple(notes))


class FixedFleet:
    """A static fleet policy: always the same replicas per pool key (a preempted replica is replaced)."""

    def __init__(self, counts: Mapping[str, int], name: str = "plan") -> None:
        self.name = name
        self.counts = dict(counts)

    def decide(self, view: Any) -> dict[str, int]:
        return {**{k: 0 for k in view.inputs.pool_keys()}, **self.counts}


PROMPT_SIGMA = 0.02  # the verify trace's prompt spread (ln): "every prompt P tokens", kept > 0 for the bins


def constant_trace(request: PlanRequest, duration_s: float, tick_s: float, correlated_at_s: float,
                   seed: int = 0) -> Any:
    """A Trace of ``request``'s load for ``duration_s``: Poisson arrivals at the constant rate (per tick, as
    control/sim/trace.py draws them; seeded), every output exactly ``output_tokens`` long, no step."""
    import numpy as np

    from control.sim.api import Trace

    n = max(1, math.ceil(duration_s / tick_s))
    rps = np.random.default_rng(seed).poisson(float(request.rate_rps) * tick_s, n) / tick_s
    return Trace(tick_s, rps.astype(float), float(request.prompt_tokens), PROMPT_SIGMA, _prompt_max(request),
                 float(request.output_tokens), 0.0, request.output_tokens, step_at_s=n * tick_s * 10 + 1e6,
                 correlated_at_s=correlated_at_s, seed=seed, prompt_mean=float(request.prompt_tokens),
                 output_mean=float(request.output_tokens))


def _prompt_max(request: PlanRequest) -> int:
    return math.ceil(request.prompt_tokens * math.exp(3 * PROMPT_SIGMA))


def verify_inputs(inputs: FleetInputs, request: PlanRequest, duration_s: float) -> FleetInputs:
    """``inputs`` for the check: the request's SLO, its prompt length (the engine bins prompts from
    ``inputs.trace``: median P, spread PROMPT_SIGMA) and the correlated spot loss moved past the run."""
    spot = dataclasses.replace(inputs.spot, correlated_at_s=duration_s * 10 + 1e6)
    trace = dataclasses.replace(inputs.trace, prompt_median=float(request.prompt_tokens), prompt_sigma=PROMPT_SIGMA,
                                prompt_max=_prompt_max(request), output_median=float(request.output_tokens))
    return dataclasses.replace(inputs, spot=spot, slo=request.slo, trace=trace)


def steady_state(per_minute: Mapping[str, Any], skip_min: int) -> tuple[float, float]:
    """(SLO attainment weighted by arrivals, accelerator cost per hour) over the minutes after the first
    ``skip_min`` of a PolicyResult's per-minute series."""
    load, att, cum = per_minute["load_rps"], per_minute["attainment"], per_minute["cost_usd_cum"]
    if len(cum) <= skip_min:
        raise ValueError(f"the run is shorter than its {skip_min}-minute warm-up")
    arrived = sum(load[skip_min:])
    met = sum(a * x for a, x in zip(load[skip_min:], att[skip_min:]))
    start = cum[skip_min - 1] if skip_min > 0 else 0.0
    return (met / arrived if arrived > 0 else 1.0), (cum[-1] - start) / ((len(cum) - skip_min) / 60.0)


def verify_plan(inputs: FleetInputs, plan: FleetPlan, *, duration_s: float = 3600.0, seed: int = 0,
                min_attainment: float = MIN_ATTAINMENT, cost_tolerance: float = COST_TOLERANCE) -> dict[str, Any]:
    """Simulate ``plan``'s fleet, fixed, on its constant load (module docstring); the figures and verdicts:
    ``slo_attainment``, ``simulated_cost_per_h`` (accelerators only, as predicted), ``predicted_cost_per_h``,
    ``cost_error`` (simulated / predicted - 1), ``attainment_met``, ``cost_met``, ``dropped_by_preemption``,
    ``preemption_notices``."""
    from control.sim.engine import simulate

    inp = verify_inputs(inputs, plan.request, duration_s)
    trace = constant_trace(plan.request, duration_s, inp.tick_s, inp.spot.correlated_at_s, seed)
    res = simulate(inp, trace, FixedFleet(plan.pools), tick_s=inp.tick_s, seed=seed)
    att, sim_per_h = steady_state(res.per_minute, WARMUP_MIN)
    err = sim_per_h / plan.cost_per_h - 1.0 if plan.cost_per_h > 0 else math.inf
    return {"duration_s": float(trace.duration_s), "warmup_min": WARMUP_MIN, "slo_attainment": float(att),
            "slo_attainment_with_warmup": float(res.slo_attainment),
            "min_attainment_per_minute": float(min(res.per_minute["attainment"][WARMUP_MIN:], default=math.nan)),
            "simulated_cost_per_h": float(sim_per_h), "predicted_cost_per_h": float(plan.cost_per_h),
            "cost_error": float(err), "simulated_cost_per_1m_slo_tokens": float(res.cost_per_1m_slo_tokens),
            "dropped_by_preemption": float(res.dropped_by_preemption),
            "preemption_notices": int(res.requests.get("preemption_notices", 0)),
            "min_attainment": min_attainment, "cost_tolerance": cost_tolerance,
            "attainment_met": bool(att >= min_attainment), "cost_met": bool(abs(err) <= cost_tolerance)}


CHECK_S = 3600.0  # simulated seconds of plan_checked's check, as --verify's default (one check: ~0.4 s of wall time here)
CHECK_STEPS = 16  # at most this many raises


def plan_checked(inputs: FleetInputs, request: PlanRequest, *, seed: int = 0,
                 duration_s: float = CHECK_S, max_steps: int = CHECK_STEPS) -> FleetPlan:
    """``plan_fleet``, then checked in the simulator and raised until it meets the SLO there.

    The mix sizes decode tokens/s at the ITL SLO; prefill of long prompts also takes the replicas' time (a
    100 req/s x 1000-token load needs ~26 s of A10G prefill per second), which only the simulator's latency
    model counts. So the fixed fleet is simulated on its constant load (``verify_plan``, ``duration_s``) and,
    while attainment misses ``MIN_ATTAINMENT``, the planned demand is raised (x1.25, or x1/attainment when
    that is more, at most x4 a step) and planned again, at most ``max_steps`` times; a note says by how much.
    Returns the last plan (infeasible plans as they come)."""
    factor, plan = 1.0, plan_fleet(inputs, request)
    for _ in range(max_steps):
        if not plan.feasible:
            return plan
        att = verify_plan(inputs, plan, duration_s=duration_s, seed=seed)["slo_attainment"]
        if att >= MIN_ATTAINMENT:
            break
        factor *= min(4.0, max(1.25, 1.0 / max(att, 0.25)))
        plan = plan_fleet(inputs, request, demand_factor=factor)
    if factor > 1.0:
        note = (f"planned demand raised x{factor:.2f} more after the simulator found the fleet missing the SLO "
                f"(prefill load of {request.prompt_tokens}-token prompts: the mix sizes decode tokens/s only)")
        plan = dataclasses.replace(plan, notes=(*plan.notes, note))
    return plan
