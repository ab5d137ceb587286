"""The simulator's baselines (control/sim/baselines.py), its Mélange MILP (control/sim/milp.py) and plots
(control/sim/plots.py): pure and cheap (hand-made inputs; no simulation run)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from control.policy.curves import DecodePoint, PrefillPoint, ThroughputCurve
from actors.autoscaler.signals import Slo
from control.sim.api import (AccelType, CpuTier, FleetInputs, FleetView, PolicyResult, SpotModel, Trace,
                             TraceSpec)
from control.sim.baselines import (HPA_DOWN_WINDOW_S, MELANGE_RESOLVE_S, TARGET_UTIL, Melange, ReactiveOnDemand,
                                   StaticPeak, baseline_policies, cheapest_on_demand_type, replica_capacity,
                                   type_shares,
                                   trace_peak_tokens_per_s)
from control.sim.milp import BucketItem, solve_buckets


def curve(name: str, scale: float, ttft_ms_at_128: float = 40.0) -> ThroughputCurve:
    """A made-up curve: ITL 20 ms at batch 1 rising to 64 ms at 64; tokens/s x ``scale``."""
    dec = [DecodePoint(1, 50.0 * scale, 20.0), DecodePoint(8, 320.0 * scale, 25.0),
           DecodePoint(32, 800.0 * scale, 40.0), DecodePoint(64, 1000.0 * scale, 64.0)]
    pre = [PrefillPoint(128, ttft_ms_at_128), PrefillPoint(2048, ttft_ms_at_128 * 10)]
    return ThroughputCurve(name, 0.0, "test", tuple(dec), tuple(pre))


def make_inputs(max_accelerators: int = 1000, slo: Slo = Slo(500.0, 50.0)) -> FleetInputs:
    """Three types: ``a`` cheap and slow, ``b`` 2.5x faster at 2x the price (the cheapest per token), ``c``
    4x faster at 5x the price on 2 accelerators per replica, with an 8x faster prefill (40 ms at 128 prompt
    tokens on a and b, 5 ms on c; linear to 10x at 2048)."""
    types = {
        "a": AccelType("a", 1.0, 0.4, 1, 60.0, curve("a", 1.0), "test"),
        "b": AccelType("b", 2.0, 0.7, 1, 90.0, curve("b", 2.5), "test"),
        "c": AccelType("c", 5.0, 2.0, 2, 120.0, curve("c", 4.0, ttft_ms_at_128=5.0), "test"),
    }
    spot = SpotModel({"a": 0.1, "b": 0.1, "c": 0.1}, 120.0, 1e9, source="test")
    cpu = CpuTier({"validator": 0.001, "gateway": 0.001}, 0.05, 5.0, source="test")
    spec = TraceSpec(10.0, 100.0, 15.0, 0.7, 2.0, 2.0, 300.0, 128.0, 0.5, 2048, 200.0, 0.5, 1024, 1e9, 3.0, 600.0,
                     "test")
    return FleetInputs(types, spot, slo, cpu, spec, max_accelerators)


def view(t: float, tokens_per_s: float, queue: float = 0.0, prompt: float = 128.0, inputs=None) -> FleetView:
    return FleetView(t, tokens_per_s / 200.0, tokens_per_s, prompt, 200.0, queue, {}, inputs or make_inputs())


# -- milp --------------------------------------------------------------------------------------------

def lp_feasible(counts, demand, items) -> bool:
    """Whether integer ``counts`` can carry every bucket's demand by some fractional assignment (an LP)."""
    import numpy as np
    from scipy.optimize import linprog

    nb, ng = len(demand), len(items)
    a_eq, a_ub = np.zeros((nb, nb * ng)), np.zeros((ng, nb * ng))
    bounds = []
    for bk in range(nb):
        for g, it in enumerate(items):
            cap = it.capacity_tokens_per_s[bk]
            a_eq[bk, bk * ng + g] = 1.0 if cap > 0 else 0.0
            a_ub[g, bk * ng + g] = demand[bk] / cap if cap > 0 else 0.0
            bounds.append((0.0, 1.0 if cap > 0 else 0.0))
    res = linprog(np.zeros(nb * ng), A_ub=a_ub, b_ub=np.array(counts, float), A_eq=a_eq, b_eq=np.ones(nb),
                  bounds=bounds, method="highs")
    return res.status == 0


def brute_force(demand, items, max_acc) -> float:
    """Least cost over every integer count vector (each up to all the demand on that type alone)."""
    bounds = [range(0, math.ceil(sum(d / c for d, c in zip(demand, it.capacity_tokens_per_s) if c > 0)) + 1)
              for it in items]
    best = math.inf
    for counts in itertools.product(*bounds):
        cost = sum(n * it.price_per_h for n, it in zip(counts, items))
        if cost >= best or (max_acc is not None and sum(n * it.gpus_per_replica for n, it in zip(counts, items))
                            > max_acc):
            continue
        if lp_feasible(counts, demand, items):
            best = cost
    return best


def test_milp_matches_brute_force_on_random_small_cases():
    rng = random.Random(7)
    for case in range(8):
        items = [BucketItem(f"t{g}/on_demand", tuple(0.0 if rng.random() < 0.3 and g < 2 else rng.uniform(80, 300)
                                                     for _ in range(2)),
                            round(rng.uniform(0.5, 6.0), 2), rng.choice((1, 2))) for g in range(3)]
        demand = [rng.uniform(50, 400), rng.uniform(50, 300)]
        max_acc = rng.choice((None, 6))
        want = brute_force(demand, items, max_acc)
        sol = solve_buckets(demand, items, max_accelerators=max_acc)
        if math.isinf(want):
            assert not sol.feasible, case
            continue
        assert sol.feasible, case
        assert sol.cost_per_h == pytest.approx(want, rel=1e-4, abs=1e-6), case
        assert lp_feasible([sol.counts[it.key] for it in items], demand, items), case
        for bk in range(2):  # every bucket fully assigned, only to types that serve it
            assert sum(sol.assign[it.key][bk] for it in items) == pytest.approx(1.0, abs=1e-6)
            assert all(sol.assign[it.key][bk] <= 1e-9 for it in items if it.capacity_tokens_per_s[bk] == 0)


def test_milp_known_cases():
    # one bucket, 250 tok/s: b (200, $2) + a (100, $1) = $3; three a are $3 too but more replicas (tie-break)
    sol = solve_buckets([250.0], [BucketItem("a", (100.0,), 1.0), BucketItem("b", (200.0,), 2.0)])
    assert sol.counts == {"a": 1, "b": 1} and sol.cost_per_h == pytest.approx(3.0)
    # long prompts only on h: cheap a for the short bucket, one h for the long one
    items = [BucketItem("a", (100.0, 0.0), 1.0), BucketItem("h", (300.0, 300.0), 4.0)]
    sol = solve_buckets([200.0, 250.0], items)
    assert sol.counts == {"a": 2, "h": 1} and sol.assign["h"] == pytest.approx((0.0, 1.0), abs=1e-6)
    # nobody serves bucket 1: left out and reported
    sol = solve_buckets([100.0, 50.0], [BucketItem("a", (100.0, 0.0), 1.0)])
    assert sol.counts == {"a": 1} and sol.unserved_buckets == (1,)


def test_milp_edge_cases():
    items = [BucketItem("a", (100.0,), 1.0, max_count=2)]
    assert solve_buckets([0.0], items).counts == {"a": 0} and solve_buckets([0.0], items).feasible
    assert not solve_buckets([250.0], items).feasible  # 2 x 100 < 250
    assert not solve_buckets([250.0], [BucketItem("a", (100.0,), 1.0)], max_accelerators=2).feasible
    with pytest.raises(ValueError, match="BucketItem.price_per_h"):
        BucketItem("a", (1.0,), -1.0)
    with pytest.raises(ValueError, match="one capacity per bucket"):
        solve_buckets([1.0, 2.0], [BucketItem("a", (1.0,), 1.0)])


# -- baselines ---------------------------------------------------------------------------------------

def test_cheapest_type_is_least_price_per_slo_token():
    inp = make_inputs()
    assert type_shares(inp) == pytest.approx({"a": 1.0, "b": 1.0, "c": 1.0})  # every prompt fits 400 ms
    accel, cap = cheapest_on_demand_type(inp)
    assert accel.name == "b" and cap == pytest.approx(inp.types["b"].curve.capacity_tokens_per_s(50.0))
    # a tight TTFT SLO (budget 80 ms): a and b prefill only the shorter prompts, c all of them
    tight = make_inputs(slo=Slo(100.0, 50.0))
    shares = type_shares(tight)
    assert 0.5 < shares["a"] == shares["b"] < 1.0 and shares["c"] == pytest.approx(1.0)
    per_token = {t.name: t.on_demand_per_h / (replica_capacity(t, tight.slo) * shares[t.name])
                 for t in tight.types.values()}
    assert cheapest_on_demand_type(tight)[0].name == min(per_token, key=per_token.get)
    with pytest.raises(ValueError, match="no accelerator type"):
        cheapest_on_demand_type(make_inputs(slo=Slo(1.0, 50.0)))


def test_reactive_scales_up_at_once_and_down_after_the_hpa_window():
    inp = make_inputs()
    pol = ReactiveOnDemand(inp)
    cap = inp.types["b"].curve.capacity_tokens_per_s(50.0)
    hi, lo = 10 * cap * TARGET_UTIL, 2 * cap * TARGET_UTIL
    assert pol.decide(view(0.0, lo, inputs=inp))["b/on_demand"] == 2
    out = pol.decide(view(10.0, hi, inputs=inp))
    assert out["b/on_demand"] == 10 and all(v == 0 for k, v in out.items() if k != "b/on_demand")
    assert pol.decide(view(20.0, lo, inputs=inp))["b/on_demand"] == 10  # held: the 300 s window
    assert pol.decide(view(10.0 + HPA_DOWN_WINDOW_S - 1, lo, inputs=inp))["b/on_demand"] == 10
    assert pol.decide(view(10.0 + HPA_DOWN_WINDOW_S + 1, lo, inputs=inp))["b/on_demand"] == 2
    # a backlog counts as demand to drain in 2 s
    assert pol.decide(view(1000.0, lo, queue=2 * 2 * cap * TARGET_UTIL, inputs=inp))["b/on_demand"] == 4
    assert pol.decide(view(2000.0, 0.0, inputs=inp))["b/on_demand"] >= 1  # never below one


def test_static_peak_never_changes():
    inp = make_inputs()
    rps = [1.0, 5.0, 3.0]
    trace = Trace(5.0, rps, 128.0, 0.5, 2048, 200.0, 0.5, 1024, 1e9, 1e9, output_mean=210.0)
    assert trace_peak_tokens_per_s(trace) == pytest.approx(5.0 * 210.0)
    pol = StaticPeak(inp, trace_peak_tokens_per_s(trace))
    cap = inp.types["b"].curve.capacity_tokens_per_s(50.0)
    want = math.ceil(5.0 * 210.0 / (cap * TARGET_UTIL))
    seen = {pol.decide(view(t, load, inputs=inp))["b/on_demand"] for t, load in ((0, 0.0), (10, 1e5), (20, 1.0))}
    assert seen == {want}
    assert sum(pol.decide(view(30.0, 1.0, inputs=inp)).values()) == want


def melange_optimum(pol: Melange, demand: float):
    return solve_buckets([demand / TARGET_UTIL * m for m in pol.mass], pol.items,
                         max_accelerators=pol.inputs.max_accelerators)


def test_melange_resolves_every_15_minutes_on_demand_only():
    inp = make_inputs()
    pol = Melange(inp)
    first = pol.decide(view(0.0, 3000.0, inputs=inp))
    assert all(v == 0 for k, v in first.items() if k.endswith("/spot"))
    want = melange_optimum(pol, 3000.0)
    assert want.feasible and {k: first[k] for k in want.counts} == dict(want.counts)
    assert pol.decide(view(300.0, 30000.0, inputs=inp)) == first  # no re-solve inside the window
    later = pol.decide(view(MELANGE_RESOLVE_S, 500.0, inputs=inp))  # the window's peak (30000) is solved for
    big = melange_optimum(pol, 30000.0)
    grew = [k for k in big.counts if big.counts[k] > want.counts[k]]
    assert grew and all(later[k] == max(big.counts[k], want.counts[k]) for k in big.counts)  # make before break
    settled = pol.decide(view(MELANGE_RESOLVE_S + 200.0, 500.0, inputs=inp))
    assert {k: settled[k] for k in big.counts} == dict(big.counts)
    assert len(pol.solutions) == 2


def test_melange_puts_long_prompts_on_the_type_that_prefills_them():
    inp = make_inputs(slo=Slo(100.0, 50.0))  # a and b cannot prefill the longest bin within 80 ms; c can
    pol = Melange(inp)
    out = pol.decide(view(0.0, 20000.0, inputs=inp))
    assert out["c/on_demand"] >= 1 and out["b/on_demand"] + out["a/on_demand"] >= 1
    sol = melange_optimum(pol, 20000.0)
    assert sol.assign["c/on_demand"][-1] == pytest.approx(1.0, abs=1e-6)  # the long bin: all on c
    # a single type cannot do better than the mix
    single = min(math.ceil(20000.0 / TARGET_UTIL / it.capacity_tokens_per_s[0]) * it.price_per_h
                 for it in pol.items if all(c > 0 for c in it.capacity_tokens_per_s))
    assert sol.cost_per_h <= single + 1e-9


def test_melange_caps_at_the_fleet_budget():
    inp = make_inputs(max_accelerators=10)
    pol = Melange(inp)
    out = pol.decide(view(0.0, 1e7, inputs=inp))
    gpus = sum(n * inp.types[k.split("/")[0]].gpus_per_replica for k, n in out.items())
    assert 8 <= gpus <= 10  # the largest mix within the budget (bisection on the demand)


def test_baseline_policies_names_and_trace_peak():
    inp = make_inputs()
    trace = Trace(5.0, [2.0, 4.0], 128.0, 0.5, 2048, 200.0, 0.5, 1024, 1e9, 1e9, output_mean=200.0)
    pols = baseline_policies(inp, trace)
    assert [p.name for p in pols] == ["reactive-on-demand", "static-peak", "melange"]
    assert pols[1].peak_tokens_per_s == pytest.approx(800.0)


# -- plots -------------------------------------------------------------------------------------------

def fake_result(name: str, n: int = 300) -> PolicyResult:
    pm = {"t_min": list(range(n)), "load_rps": [10 + (i % 60) for i in range(n)],
          "attainment": [1.0 if i % 50 else 0.97 for i in range(n - 1)] + [None],
          "cost_usd_cum": [0.5 * i for i in range(n)],
          "replicas": {"b/on_demand": [3] * n, "a/spot": [i % 4 for i in range(n)]}}
    return PolicyResult(name, 1.0, 1.0, 1.0, 0.99, 0.0, None, {}, pm)


def test_write_plots_writes_one_png_per_quantity(tmp_path):
    from control.sim.plots import FIGURES, write_plots

    paths = write_plots([fake_result("x"), fake_result("y")], tmp_path / "plots", max_points=100)
    assert [p.rsplit("/", 1)[1] for p in paths] == [f"{f}.png" for f in FIGURES]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="lacks per_minute"):
        write_plots([PolicyResult("z", 0, 0, 0, 0, 0, None, {}, {})], tmp_path)
