"""The simulator's inputs file, trace and latency model (control/sim/inputs.py, trace.py, latency.py)."""

from __future__ import annotations

import tomllib

import numpy as np
import pytest

from control.sim.inputs import DEFAULT_INPUTS, check_sources, inputs_from_dict, load_inputs
from control.sim.latency import CurveTable, eligible, prompt_bins
from control.sim.trace import make_trace


def test_checked_in_inputs_load_with_a_source_on_every_number():
    data = tomllib.loads(DEFAULT_INPUTS.read_text())
    assert check_sources(data, "inputs") == []
    inputs = load_inputs()
    assert len(inputs.types) == 3 and set(inputs.types) == {"A10G", "L40S", "H100"}
    for t in inputs.types.values():
        assert 0 < t.spot_per_h < t.on_demand_per_h and t.source
    assert inputs.slo.ttft_ms == 500.0 and inputs.slo.itl_ms == 50.0
    assert inputs.spot.correlated_fraction == 0.3 and inputs.spot.correlated_over_s == 120.0


def test_a_number_without_a_source_is_refused():
    data = tomllib.loads(DEFAULT_INPUTS.read_text())
    del data["types"][1]["spot_per_h_source"]
    with pytest.raises(ValueError, match=r"inputs\.types\[1\]\.spot_per_h"):
        inputs_from_dict(data)


def test_curve_table_follows_the_live_curve_rules():
    for t in load_inputs().types.values():
        c, table = t.curve, CurveTable(t.curve)
        for b in (0.5, 1, 3, 10, 64, 100, 300):
            assert table.tokens_per_s(b) == pytest.approx(c.tokens_per_s_at(b))
            assert table.itl_ms(b) == pytest.approx(c.itl_ms_at(b))
        for p in (10, 128, 900, 4096, 10000):
            assert float(table.ttft_ms(np.array([p]))[0]) == pytest.approx(c.ttft_ms_at(p))
            assert float(table.prompt_within(np.array([c.ttft_ms_at(p)]))[0]) == pytest.approx(p, rel=1e-6)


def test_prompt_bins_and_eligibility():
    inputs = load_inputs()
    bins = prompt_bins(inputs.trace)
    assert bins.mass.sum() == pytest.approx(1.0) and np.all(np.diff(bins.edges) > 0)
    assert np.all((bins.mean > bins.edges[:-1]) & (bins.mean <= bins.edges[1:]))
    full = bins.frac_within(np.full(bins.k, 1e9))
    none = bins.frac_within(np.zeros(bins.k))
    assert np.allclose(full, 1.0) and np.allclose(none, 0.0)
    el = eligible(inputs, bins)
    assert el["H100"].all() and not el["A10G"].all()  # long prompts miss the TTFT budget on A10G


def test_trace_is_seeded_and_has_the_step():
    inputs = load_inputs()
    a, b, c = make_trace(inputs, 2, seed=1), make_trace(inputs, 2, seed=1), make_trace(inputs, 2, seed=2)
    assert np.array_equal(a.rps, b.rps) and not np.array_equal(a.rps, c.rps)
    s = inputs.trace
    i = int(s.step_at_s / a.tick_s)
    before, during = a.rps[i - 120:i].mean(), a.rps[i + 10:i + 130].mean()
    assert during / before == pytest.approx(s.step_factor, rel=0.1)
    with pytest.raises(ValueError, match="days"):
        make_trace(inputs, 0)
