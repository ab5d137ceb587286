"""Many models on shared hosts (issue [29] item 1): the lending rule (actors/autoscaler/lending.py), the
sourced models.toml, the Zipf / phase trace, and the many-model simulation with lending on and off
(control/sim/many.py) on small hand-made traces."""

from __future__ import annotations

import dataclasses
import tomllib

import numpy as np
import pytest

from actors.autoscaler.lending import LendingConfig, SpareHost, expire, plan_starts
from control.sim import load_inputs
from control.sim.inputs import check_sources
from control.sim.many import MODELS_INPUTS, load_many_inputs, make_many_trace, simulate_many

CFG = LendingConfig(wake_s=2.0, load_other_s=12.0, cold_start_s=52.0, horizon_s=600.0)


def test_a_scale_up_wakes_its_own_then_borrows_then_cold_starts():
    spares = [SpareHost(1, "a", 0.0), SpareHost(2, "b", 10.0), SpareHost(3, "c", 5.0)]
    starts, left = plan_starts({"a": 3}, spares, CFG)
    assert [(s.how, s.host) for s in starts] == [("wake", 1), ("lend", 3), ("lend", 2)]
    assert left == []
    starts, left = plan_starts({"a": 3}, spares, dataclasses.replace(CFG, lend=False))  # each model its own
    assert [s.how for s in starts] == ["wake", "cold", "cold"] and [s.host for s in left] == [3, 2]
    starts, left = plan_starts({"a": 2}, spares, CFG, protected={"c"})  # c's forecast wants its sleeper back
    assert [(s.how, s.host) for s in starts] == [("wake", 1), ("lend", 2)] and [s.host for s in left] == [3]
    assert [s.ready_in_s for s in starts] == [2.0, 12.0]
    kept, gone = expire(spares, 602.0, CFG)
    assert [s.host for s in gone] == [1] and len(kept) == 2
    with pytest.raises(ValueError, match="want"):
        plan_starts({"a": -1}, spares, CFG)
    with pytest.raises(ValueError, match="wake_s"):
        LendingConfig(wake_s=-1.0)


def test_models_inputs_are_sourced_and_read():
    data = tomllib.loads(MODELS_INPUTS.read_text())
    assert check_sources(data, "models") == []
    mi = load_many_inputs()
    assert mi.count >= 20
    sh = mi.shares()
    assert sh.sum() == pytest.approx(1.0) and sh[0] / sh[1] == pytest.approx(2 ** mi.zipf_exponent)
    ph = mi.peak_hours()
    assert len(set(np.round(ph, 6))) == mi.count and ph.min() >= mi.peak_hour_first and ph.max() <= mi.peak_hour_last
    assert mi.lending.wake_s < mi.lending.load_other_s < mi.lending.cold_start_s


def test_models_inputs_refuse_a_number_without_its_source(tmp_path):
    text = MODELS_INPUTS.read_text().replace('zipf_exponent_source = ', 'zipf_exponent_sauce = ')
    bad = tmp_path / "m.toml"
    bad.write_text(text)
    with pytest.raises(ValueError, match="zipf_exponent"):
        load_many_inputs(bad)


def test_the_trace_has_each_models_peak_at_its_own_hour():
    mi = dataclasses.replace(load_many_inputs(), bursts_per_day=0.0, count=4, total_peak_rps=4000.0)
    rps = make_many_trace(mi, 1.0, 0, 300.0)
    peaks = np.argmax(rps, axis=1) * 300.0 / 3600.0
    assert np.allclose(peaks, mi.peak_hours(), atol=0.6)
    assert rps[0].mean() > rps[-1].mean()  # Zipf: rank 1 above rank 4


def test_lending_serves_one_models_rise_from_anothers_fall_cheaper():
    """Model a falls from 200 to 20 req/s when model b rises from 20 to 200: with lending b's new replicas are
    a's sleepers (12 s loads), without it cold starts on new hosts while a's sleepers idle out."""
    inputs = load_inputs()
    mi = dataclasses.replace(load_many_inputs(), count=2)
    n = int(3600 / inputs.tick_s)
    t = np.arange(n) * inputs.tick_s
    ramp = np.clip((t - 1200.0) / 600.0, 0.0, 1.0)
    rps = np.stack([200.0 - 180.0 * ramp, 20.0 + 180.0 * ramp])
    on = simulate_many(inputs, mi, rps, lend=True)
    off = simulate_many(inputs, mi, rps, lend=False)
    assert on["starts"]["lend"] > 10 and off["starts"]["lend"] == 0
    assert on["starts"]["cold"] < off["starts"]["cold"]
    assert on["cost_usd"] < 0.95 * off["cost_usd"]
    assert on["slo_attainment"] >= off["slo_attainment"] - 0.002
    for r in (on, off):
        assert 0.9 < r["slo_attainment"] <= 1.0
        assert r["host_hours"]["serving"] > 0


def test_the_cli_runs_both_variants_and_writes_the_saving(tmp_path, capsys):
    import argparse
    import json

    from control.ops.simulate_cli import main

    out = tmp_path / "many.json"
    args = argparse.Namespace(inputs=None, days=0.01, seed=0, policies="actorserve", json_path=str(out), plots=None,
                              jobs=1, pool_set=[], many_models=True)
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert set(data) >= {"lend", "no_lend", "cost_saving", "slo_attainment_delta", "wall_s"}
    assert data["cost_saving"] == pytest.approx(1 - data["lend"]["cost_usd"] / data["no_lend"]["cost_usd"])
    assert "lending saves" in capsys.readouterr().out
    assert main(argparse.Namespace(**{**vars(args), "pool_set": ["nope=1"]})) == 2
