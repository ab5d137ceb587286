"""The simulator runs the live autoscaler's policy modules (imported, not copied) and the CLI's JSON."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math

import pytest

import actors.autoscaler.cpu_policy as live_cpu
import actors.autoscaler.mix as live_mix
import actors.autoscaler.pool_policy as live_pool
import actors.autoscaler.signals as live_signals
import control.sim.cpu_tier as sim_cpu
import control.sim.live_policy as lp
from control.sim import load_inputs, make_trace, simulate


def test_the_live_policy_modules_are_the_ones_imported():
    assert lp.PoolPolicy is live_pool.PoolPolicy
    assert lp.plan_mix is live_mix.plan_mix and lp.PoolOffer is live_mix.PoolOffer
    assert lp.PoolSignals is live_signals.PoolSignals and lp.Limits is live_signals.Limits
    assert sim_cpu.CpuTierPolicy is live_cpu.CpuTierPolicy
    pol = lp.ActorservePolicy(load_inputs())
    assert type(pol.pool_policy) is live_pool.PoolPolicy
    for mod in (lp, sim_cpu):  # no copy of a live class or function in the simulator
        src = inspect.getsource(mod)
        for name in ("class PoolPolicy", "def plan_mix", "class CpuTierPolicy", "def _decide_one"):
            assert name not in src


def test_actorserve_policy_scales_up_and_serves_a_small_load():
    base = load_inputs()
    inputs = dataclasses.replace(base, trace=dataclasses.replace(base.trace, base_rps=30.0, peak_rps=30.0,
                                                                 step_at_s=1e9, bursts_per_day=0.0),
                                 spot=dataclasses.replace(base.spot, correlated_at_s=1e9))
    r = simulate(inputs, make_trace(inputs, days=0.01, seed=0), lp.ActorservePolicy(inputs))
    assert r.slo_attainment > 0.9
    assert sum(r.per_minute["replicas"][k][-1] for k in inputs.pool_keys()) >= 2


def test_simulate_cli_writes_the_contract_json(tmp_path, capsys):
    from control.ops.simulate_cli import main

    out = tmp_path / "sim.json"
    args = argparse.Namespace(inputs=None, days=0.005, seed=0, policies="actorserve", json_path=str(out),
                              plots=None, jobs=1, pool_set=[])
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert set(data) >= {"wall_s", "inputs", "days", "policies", "targets"}
    pol = data["policies"]["actorserve"]
    for key in ("cost_per_1m_slo_tokens", "slo_attainment", "dropped_by_preemption", "recovery_s_after_step"):
        assert key in pol
    assert "per_minute" not in pol
    assert "slo_attainment" in data["targets"]
    assert "actorserve" in capsys.readouterr().out
    bad = argparse.Namespace(**{**vars(args), "policies": "nope"})
    assert main(bad) == 2
    assert main(argparse.Namespace(**{**vars(args), "pool_set": ["no_such_field=1"]})) == 2


def test_cpu_tiers_scale_with_the_live_cpu_policy():
    tiers = sim_cpu.CpuTiers(load_inputs().cpu_tier)
    start = dict(tiers.ready)
    cpu = load_inputs().cpu_tier.cpu_s_per_request
    rps = 2.0 / min(cpu.values())  # the lighter kind's floor of 2 at rho 1 (above the 0.8 CPU high mark) ...
    for i in range(40):  # ... and the heavier kind saturated: both must scale up
        tiers.step(i * 5.0, 5.0, rps)
        tiers.decide(i * 5.0)
    assert all(tiers.ready[k] > start[k] for k in tiers.kinds) and tiers.decisions > 0
    mean_ms, p99_ms = tiers.step(200.0, 5.0, rps)
    assert 0 < mean_ms < p99_ms < 1000  # back below saturation: finite sojourn
    assert tiers.cost_usd > 0


def test_cpu_tier_delay_is_processor_sharing_on_the_critical_path():
    """M/G/1-PS per replica (Kleinrock 1976, Sec. 4.4): the TTFT-path work x takes x / (1 - rho) on average,
    rho from the kind's whole CPU per request; p99 = x (1 + N99), N geometric in rho."""
    from control.sim.api import CpuTier
    tier = CpuTier({"validator": 0.004, "gateway": 0.002}, 0.04, 3.0, floor=2, source="test",
                   ttft_cpu_s_per_request={"validator": 0.001})
    tiers = sim_cpu.CpuTiers(tier)
    mean_ms, p99_ms = tiers.step(0.0, 5.0, 250.0)  # validator rho = 250 x 4 ms / 2 = 0.5, gateway 0.25
    assert mean_ms == pytest.approx(1.0 / 0.5 + 2.0 / 0.75)
    n99 = {r: math.log(100) / math.log(1 / r) - 1 for r in (0.5, 0.25)}
    assert p99_ms == pytest.approx(1.0 * (1 + n99[0.5]) + 2.0 * (1 + n99[0.25]))
    with pytest.raises(ValueError, match="ttft_cpu_s_per_request"):
        CpuTier({"gateway": 0.002}, 0.04, 3.0, source="test", ttft_cpu_s_per_request={"gateway": 0.003})
