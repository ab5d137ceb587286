"""The hindsight lower bound (control/sim/bound.py, issue [29] item 3): an LP on HiGHS that every policy the
simulator runs must cost at least, at its own SLO-met tokens; checked against the four policies on small
traces, by hand on a constant load, and against the trivial unit-cost bound (so it can fail both ways)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from control.sim import load_inputs, make_trace, simulate
from control.sim.baselines import baseline_policies
from control.sim.bound import BoundProgram, bound_for, slo_capacity
from control.sim.latency import CurveTable
from control.sim.live_policy import ActorservePolicy


def small_inputs(base_rps: float, peak_rps: float, step_at_s: float = 1e9, bursts: float = 0.0):
    base = load_inputs()
    return dataclasses.replace(base, trace=dataclasses.replace(base.trace, base_rps=base_rps, peak_rps=peak_rps,
                                                               step_at_s=step_at_s, bursts_per_day=bursts),
                               spot=dataclasses.replace(base.spot, correlated_at_s=step_at_s + 600.0))


def test_slo_capacity_is_the_best_tokens_per_s_within_the_itl_slo():
    inputs = load_inputs()
    for name, a in inputs.types.items():
        tab = CurveTable(a.curve)
        grid = np.linspace(1e-3, a.max_batch, 200_001)
        ok = np.array([tab.itl_ms(b) <= 50.0 for b in grid[::100]])
        brute = max(tab.tokens_per_s(b) for b, o in zip(grid[::100], ok) if o)
        got = slo_capacity(tab, 50.0, a.max_batch)
        assert brute <= got * (1 + 1e-9) and got <= brute * 1.01, name
    # the H100 curve's tokens/s peak at batch 16 (1,384.2) inside the SLO, above capacity at the SLO batch (64)
    h = inputs.types["H100"]
    assert slo_capacity(CurveTable(h.curve), 50.0, h.max_batch) == pytest.approx(1384.2)
    assert h.curve.capacity_tokens_per_s(50.0) < 1384.2
    assert slo_capacity(CurveTable(h.curve), 1.0, h.max_batch) == 0.0  # no batch meets a 1-ms ITL


@pytest.mark.parametrize("case", [(40.0, 120.0, 1800.0, 40.0), (20.0, 20.0, 1e9, 0.0)])
def test_the_bound_is_at_or_below_every_policy_on_small_traces(case):
    base_rps, peak_rps, step_at, bursts = case
    inputs = small_inputs(base_rps, peak_rps, step_at, bursts)
    trace = make_trace(inputs, days=0.05, seed=1)
    prog = BoundProgram(inputs, trace)
    pols = [ActorservePolicy(inputs), *baseline_policies(inputs, trace)]
    for pol in pols:
        r = simulate(inputs, trace, pol, seed=1).to_json(per_minute=False)
        b = bound_for(prog, r)
        assert b.feasible, pol.name
        assert r["extra"]["accelerator_cost_usd"] >= b.cost_usd * (1 - 1e-6), pol.name
        assert r["cost_per_1m_slo_tokens"] >= b.cost_per_1m_slo_tokens, pol.name
        assert b.attainment == pytest.approx(r["slo_attainment"], rel=1e-6)


def test_a_constant_load_on_one_type_and_market_costs_demand_over_capacity():
    base = load_inputs()
    l40s = base.types["L40S"]
    inputs = dataclasses.replace(small_inputs(50.0, 50.0), types={"L40S": l40s},
                                 spot=dataclasses.replace(base.spot, preemption_rate_per_h={"L40S": 0.0},
                                                          correlated_at_s=1e9))
    trace = make_trace(inputs, days=0.02, seed=0)
    prog = BoundProgram(inputs, trace)
    b = prog.at_attainment(0.9)
    # the spot cap (0.7 of the capacity) holds, and both markets cost their price per capacity token
    cap = slo_capacity(CurveTable(l40s.curve), 50.0, l40s.max_batch)
    tok = 0.9 * prog.demand_tokens
    # the last slot's next-slot share is not charged (module docstring): its servable demand comes free
    paid = tok - float((prog.demand[-1] * prog.f["L40S"]).sum())
    want = paid / cap / 3600.0 * (0.3 * l40s.on_demand_per_h + 0.7 * l40s.spot_per_h)
    assert b.cost_usd == pytest.approx(want, rel=1e-6)
    assert b.spot_share == pytest.approx(0.7, abs=1e-6)
    nocap = BoundProgram(inputs, trace, spot_cap=False).at_attainment(0.9)
    assert nocap.cost_usd < b.cost_usd and nocap.spot_share == pytest.approx(1.0)


def test_the_bound_is_per_slot_and_scales_with_demand():
    """Per slot, not pooled: with an accelerator cap below the peak's need the peak slots cannot be served,
    so high attainment is infeasible though the whole trace's tokens would fit the cap on average; twice the
    demand costs twice (the LP has no integrality); half the tokens cost less, not more per token."""
    inputs = small_inputs(20.0, 200.0)
    trace = make_trace(inputs, days=1.0, seed=0, tick_s=60.0)
    prog = BoundProgram(inputs, trace)
    b = prog.at_attainment(0.99)
    assert b.feasible
    doubled = dataclasses.replace(trace, rps=trace.rps * 2)
    b2 = BoundProgram(inputs, doubled).at_attainment(0.99)
    assert b2.cost_usd == pytest.approx(2 * b.cost_usd, rel=1e-3)
    half = prog.at_attainment(0.5)
    assert half.cost_usd < b.cost_usd and half.cost_per_1m_slo_tokens <= b.cost_per_1m_slo_tokens * (1 + 1e-6)
    per_slot = prog.demand.sum(axis=1) / prog.slot_s  # tokens/s
    cap = int(np.ceil(per_slot.mean() / 1384.2 * 1.2))  # 20 % above the average on the fastest type...
    assert cap < per_slot.max() / 1384.2  # ...and below the peak's need
    capped = BoundProgram(dataclasses.replace(inputs, max_accelerators=cap), trace)
    assert not capped.at_attainment(0.99).feasible
    assert capped.at_attainment(0.5).feasible
    assert prog.at_attainment(1.0).feasible  # a policy at 100.0 %: solved just below the servable maximum
    with pytest.raises(ValueError, match="attainment"):
        prog.at_attainment(1.5)
