"""The fleet simulator's engine (control/sim/engine.py), on short traces and small fleets (pure, < 1 s each)."""

from __future__ import annotations

import dataclasses

import pytest

from control.sim import load_inputs, make_trace, simulate
from control.sim.api import PolicyResult


class Fixed:
    """A policy that asks for the same counts every time."""

    def __init__(self, counts: dict[str, int], name: str = "fixed") -> None:
        self.counts, self.name = counts, name

    def decide(self, view):
        return self.counts


class Once(Fixed):
    """Asks for its counts at the first decision only (never replaces a lost replica)."""

    def decide(self, view):
        return self.counts if view.now_s == 0 else {}


def small_inputs(rps: float = 8.0, **spot):
    base = load_inputs()
    trace = dataclasses.replace(base.trace, base_rps=rps, peak_rps=rps, bursts_per_day=0.0, step_at_s=1e9)
    sp = dataclasses.replace(base.spot, correlated_at_s=1e9, **spot)
    return dataclasses.replace(base, trace=trace, spot=sp, max_accelerators=100)


def _balance(r: PolicyResult) -> float:
    q = r.requests
    return q["completed"] + q["in_flight"] + q["queued"] + q["migrating"] + q["dropped_by_preemption"] \
        + q["dropped_by_drain"] - q["arrived"]


def test_engine_conserves_requests():
    inputs = small_inputs()
    trace = make_trace(inputs, days=0.01, seed=3)
    r = simulate(inputs, trace, Fixed({"L40S/on_demand": 4, "H100/spot": 1}), seed=3)
    assert r.requests["arrived"] == pytest.approx(float(trace.rps.sum() * trace.tick_s))
    assert r.requests["completed"] > 0.9 * r.requests["arrived"]
    assert abs(_balance(r)) < 1e-6 * r.requests["arrived"]
    assert 0.0 < r.slo_attainment <= 1.0 and r.cost_usd > 0


def test_engine_conserves_under_overload_and_scale_down():
    inputs = small_inputs(rps=200.0)

    class Shrinking:
        name = "shrinking"

        def decide(self, view):
            return {"A10G/on_demand": 2 if view.now_s > 300 else 6}

    r = simulate(inputs, make_trace(inputs, days=0.01, seed=1), Shrinking(), seed=1)
    assert r.requests["queued"] > 0  # overloaded: a queue is left
    assert abs(_balance(r)) < 1e-6 * r.requests["arrived"]
    assert r.slo_attainment < 0.5


def test_preemption_with_notice_drops_nothing_when_capacity_exists():
    inputs = small_inputs(preemption_rate_per_h={t: 60.0 for t in load_inputs().types})
    r = simulate(inputs, make_trace(inputs, days=0.01, seed=2),
                 Fixed({"L40S/spot": 3, "L40S/on_demand": 6}), seed=2)
    assert r.requests["preemption_notices"] > 0
    assert r.dropped_by_preemption == 0.0
    assert abs(_balance(r)) < 1e-6 * r.requests["arrived"]


def test_preemption_without_capacity_drops_the_migrating_requests():
    base = small_inputs(rps=10.0)
    inputs = dataclasses.replace(base, spot=dataclasses.replace(base.spot, correlated_at_s=300.0,
                                                                correlated_fraction=1.0, correlated_over_s=5.0))
    r = simulate(inputs, make_trace(inputs, days=0.01, seed=4), Once({"L40S/spot": 4}), seed=4)
    assert r.requests["preemption_notices"] == 4
    assert r.dropped_by_preemption > 0  # nothing takes them before the 120-s deadline
    assert abs(_balance(r)) < 1e-6 * r.requests["arrived"]


def test_result_json_has_the_contract_keys():
    inputs = small_inputs()
    r = simulate(inputs, make_trace(inputs, days=0.01), Fixed({"A10G/on_demand": 2, "H100/on_demand": 1}))
    j = r.to_json()
    for key in ("name", "cost_usd", "slo_met_output_tokens", "cost_per_1m_slo_tokens", "slo_attainment",
                "dropped_by_preemption", "recovery_s_after_step", "cpu_tier", "per_minute"):
        assert key in j
    pm = j["per_minute"]
    assert set(pm) >= {"t_min", "load_rps", "attainment", "cost_usd_cum", "replicas"}
    assert set(pm["replicas"]) == set(inputs.pool_keys())
    assert len(pm["t_min"]) == len(pm["attainment"]) == 14
    assert "per_minute" not in r.to_json(per_minute=False)


def test_tick_must_match_the_trace():
    inputs = small_inputs()
    with pytest.raises(ValueError, match="tick_s"):
        simulate(inputs, make_trace(inputs, days=0.01), Fixed({}), tick_s=1.0)


def test_simulate_json_carries_no_infinity():
    """A policy that never recovers has recovery_s_after_step = inf: the JSON file writes null (RFC 8259 has no
    Infinity), and the rest of the value is kept."""
    import json
    import math

    from control.ops.simulate_cli import finite_json

    out = finite_json({"p": {"recovery_s_after_step": math.inf, "cost": 1.5, "x": [math.nan, 2]}, "n": 3})
    assert out == {"p": {"recovery_s_after_step": None, "cost": 1.5, "x": [None, 2]}, "n": 3}
    json.dumps(out, allow_nan=False)


def test_simulate_refuses_an_unwritable_output_before_running(tmp_path):
    """An output path that cannot be written is found before a run of minutes (one line, exit 2 in the CLI)."""
    from control.ops.simulate_cli import check_outputs

    assert check_outputs(str(tmp_path / "out.json"), str(tmp_path / "plots")) is None
    assert (tmp_path / "plots").is_dir()
    assert "cannot write" in check_outputs(str(tmp_path / "missing" / "out.json"), None)
    (tmp_path / "file").write_text("x")
    assert "cannot write" in check_outputs(None, str(tmp_path / "file" / "plots"))
