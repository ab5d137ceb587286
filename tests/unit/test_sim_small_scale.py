"""The fleet simulator's fluid latency model at small scale (pure, < 1 s): one replica of one type at low,
constant Poisson load, as ``actorserve bench sim-check`` runs it (bench/sim_check.py, tick 0.5 s).

Reference figures come from queueing theory, not from the engine: with Poisson arrivals at ``rate`` and each
request decoding ``out`` tokens at ITL(1) ms, Little's law gives the mean number decoding
N = rate x out x ITL(1) / 1000, and (PASTA, M/G/inf) a request shares the replica on average with N others,
so its TPOT is ITL(1 + N); its TTFT is the curve's prefill plus the CPU tiers' small mean sojourn (no queue:
KV slots are free). A disturbed profile (tokens/s falling with batch) is flagged by bench.sim_check.
"""

from __future__ import annotations

import pytest

from control.policy.curves import DecodePoint, PrefillPoint, ThroughputCurve
from bench.sim_check import curve_warnings, machine_inputs, simulated_latency

ITL1_MS, ITL_SLOPE_MS = 80.0, 5.0  # a memory-bound decode: ITL(b) = 80 + 5 (b - 1) ms
PROMPT, OUT = 60, 32


def _curve(itl=lambda b: ITL1_MS + ITL_SLOPE_MS * (b - 1)) -> ThroughputCurve:
    decode = tuple(DecodePoint(b, b * 1000.0 / itl(b), itl(b)) for b in (1, 2, 4, 8))
    prefill = (PrefillPoint(32, 150.0), PrefillPoint(64, 290.0), PrefillPoint(128, 570.0))
    return ThroughputCurve("local", 0.0, "test", decode, prefill)


@pytest.mark.parametrize("rate", [0.12, 0.37])
def test_one_replica_tpot_is_itl_at_littles_law_batch(rate):
    curve = _curve()
    sim = simulated_latency(machine_inputs(curve, 8), rate, PROMPT, OUT, duration_s=600.0, seed=1)
    n_others = rate * OUT * ITL1_MS / 1000.0  # Little's law
    expected = curve.itl_ms_at(1.0 + n_others)
    assert sim["tpot_mean_ms"] == pytest.approx(expected, rel=0.10)
    assert sim["ticks"] > 0.5 * rate * 540  # arrival ticks after the 60 s warm-up were sampled


def test_one_replica_ttft_is_prefill_plus_small_wait():
    curve = _curve()
    sim = simulated_latency(machine_inputs(curve, 8), 0.12, PROMPT, OUT, duration_s=600.0, seed=1)
    prefill = curve.ttft_ms_at(PROMPT)
    for key in ("ttft_p50_ms", "ttft_p99_ms"):
        assert prefill <= sim[key] <= prefill + 50.0, (key, sim[key], prefill)


def test_tpot_follows_a_steep_curve_not_a_tick_artefact():
    """A curve whose ITL doubles from batch 1 to 2 gives a larger TPOT at the same load, by the curve's
    ITL(1 + N) (N solved with the ITL it implies), not by a whole tick's arrivals counted at once."""
    steep = _curve(lambda b: ITL1_MS * b)  # tokens/s flat: every sequence slows as the batch grows
    sim = simulated_latency(machine_inputs(steep, 8), 0.12, PROMPT, OUT, duration_s=600.0, seed=1)
    # processor sharing at a flat 12.5 tok/s is M/G/1-PS (its mean sojourn is insensitive to the service
    # distribution, Kleinrock 1976 Vol. 2 Sec. 4.4): utilisation u = rate x OUT / 12.5, an arrival finds
    # u / (1 - u) others on average and its sojourn is ITL(1) x OUT / (1 - u)
    u = 0.12 * OUT / 12.5
    expected = steep.itl_ms_at(1.0 + u / (1 - u))
    assert sim["tpot_mean_ms"] == pytest.approx(expected, rel=0.10)
    assert not steep.itl_ms_at(1.0) == pytest.approx(expected, rel=0.10)  # the load shows: not ITL(1)


def test_curve_warnings_flag_a_disturbed_profile():
    assert curve_warnings(_curve()) == []
    bad = ThroughputCurve("local", 0.0, "test", (DecodePoint(1, 5.33, 187.5), DecodePoint(2, 4.01, 498.5),
                                                 DecodePoint(4, 5.13, 779.1), DecodePoint(8, 15.8, 506.6)))
    warns = curve_warnings(bad)
    assert warns and "batch 2" in warns[0]
