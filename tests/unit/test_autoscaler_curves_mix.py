"""Throughput curves (control/policy/curves.py), the pool mix (mix.py) and pool records
(control/state/pools.py): interpolation, capacity at the ITL SLO, JSON round trips, the cheapest mix per
SLO-met token, the spot cap and the preemption loss."""

from __future__ import annotations

import math

import pytest

from control.policy.curves import DecodePoint, PrefillPoint, ThroughputCurve
from actors.autoscaler.mix import PoolOffer, choose_mix, plan_mix
from actors.autoscaler.signals import Slo
from control.state.pools import PoolRecord

CURVE = ThroughputCurve("local", 1.0, "test cpu",
                        (DecodePoint(32, 640, 50.0), DecodePoint(1, 60, 16.0), DecodePoint(8, 320, 25.0)),
                        (PrefillPoint(128, 100.0), PrefillPoint(32, 40.0), PrefillPoint(512, 340.0)))
SLO = Slo(ttft_ms=2000, itl_ms=100)


def flat(pool: str, tok_s: float, itl_ms: float = 20.0) -> ThroughputCurve:
    """A curve whose capacity at any ITL SLO >= itl_ms is tok_s."""
    return ThroughputCurve(pool, 0.0, "", (DecodePoint(1, tok_s, itl_ms),))


def test_curve_points_are_sorted_and_interpolated():
    assert [p.batch for p in CURVE.decode] == [1, 8, 32] and [p.prompt_tokens for p in CURVE.prefill] == [32, 128, 512]
    assert CURVE.tokens_per_s_at(8) == 320
    assert CURVE.tokens_per_s_at(4) == pytest.approx(60 + 3 / 7 * 260)
    assert CURVE.tokens_per_s_at(0.5) == pytest.approx(30)  # proportional below the first point
    assert CURVE.tokens_per_s_at(128) == 640  # flat above the last: no extrapolated gains
    assert CURVE.tokens_per_s_at(0) == 0
    assert CURVE.itl_ms_at(20) == pytest.approx(25 + 12 / 24 * 25)
    assert CURVE.itl_ms_at(0.5) == 16.0
    assert CURVE.itl_ms_at(56) == pytest.approx(50 + 24 * 25 / 24)  # the last segment's slope continues
    assert CURVE.ttft_ms_at(80) == pytest.approx(70)
    assert CURVE.ttft_ms_at(1024) == pytest.approx(340 + 512 * 0.625)  # linear beyond the last point
    assert CURVE.ttft_ms_at(1) >= 0


def test_capacity_at_the_itl_slo():
    assert CURVE.max_batch_at(37.5) == pytest.approx(20)
    assert CURVE.capacity_tokens_per_s(37.5) == pytest.approx(CURVE.tokens_per_s_at(20)) == pytest.approx(480)
    assert CURVE.capacity_tokens_per_s(10) == 0.0  # even batch 1 misses it
    assert CURVE.capacity_tokens_per_s(500) == 640  # every measured batch meets it: the largest measured
    # measured scatter: batch 8 just over the SLO, batch 16 within it -> the largest batch within it counts
    noisy = ThroughputCurve("p", 0, "", (DecodePoint(4, 47, 85.0), DecodePoint(8, 80, 100.5),
                                         DecodePoint(16, 160, 99.9), DecodePoint(32, 200, 160.0)))
    assert noisy.max_batch_at(100) == pytest.approx(16 + 16 * 0.1 / 60.1)
    assert noisy.capacity_tokens_per_s(100) == pytest.approx(noisy.tokens_per_s_at(noisy.max_batch_at(100)))
    assert noisy.max_batch_at(90) == pytest.approx(4 + 4 * 5 / 15.5)  # only batch 4 meets 90 ms
    assert noisy.max_batch_at(80) == 0.0


def test_curve_json_round_trip_and_validation():
    data = CURVE.to_json()
    assert set(data) == {"pool", "measured_at", "cpu", "decode", "prefill"}
    assert data["decode"][0] == {"batch": 1, "tokens_per_s": 60, "itl_ms": 16.0}
    assert ThroughputCurve.from_json(data) == CURVE
    with_meta = ThroughputCurve("p", 1.0, "cpu", (DecodePoint(1, 1, 1),), (), {"threads": 2})
    assert ThroughputCurve.from_json(with_meta.to_json()).meta == {"threads": 2}
    with pytest.raises(ValueError, match="at least one"):
        ThroughputCurve("p", 0, "", ())
    with pytest.raises(ValueError, match="duplicate"):
        ThroughputCurve("p", 0, "", (DecodePoint(1, 1, 1), DecodePoint(1, 2, 2)))
    with pytest.raises(ValueError, match="itl_ms"):
        DecodePoint(1, 10, 0)
    with pytest.raises(ValueError, match="malformed"):
        ThroughputCurve.from_json({"pool": "p", "decode": [{"batch": 1}]})
    with pytest.raises(ValueError, match="prefill"):
        flat("p", 10).ttft_ms_at(10)


def test_mix_picks_the_cheaper_pool_per_slo_met_token():
    small = PoolOffer("small", flat("small", 100), price_per_h=1.0, max_workers=20)  # $2.78 / Mtok
    big = PoolOffer("big", flat("big", 400), price_per_h=3.0, max_workers=20)  # $2.08 / Mtok
    assert big.cost_per_mtok(SLO) < small.cost_per_mtok(SLO)
    assert choose_mix(800, [small, big], SLO) == {"small": 0, "big": 2}
    # a small demand: two small workers ($2/h) beat one big ($3/h) although big is cheaper per token
    plan = plan_mix(150, [small, big], SLO)
    assert dict(plan.workers) == {"small": 2, "big": 0} and plan.cost_per_h == 2.0 and plan.exact
    # exact on a mixed cover: 900 tok/s -> 2 big + 1 small ($7) beats 3 big ($9) and 9 small ($9)
    assert choose_mix(900, [small, big], SLO) == {"small": 1, "big": 2}
    assert choose_mix(0, [small, big], SLO) == {"small": 0, "big": 0}


def test_mix_ttft_and_itl_slos_exclude_a_pool():
    fast = PoolOffer("fast", flat("fast", 100, itl_ms=20), price_per_h=2.0, max_workers=10)
    slow = PoolOffer("slow", flat("slow", 100, itl_ms=150), price_per_h=0.5, max_workers=10)
    assert choose_mix(300, [fast, slow], SLO) == {"fast": 3, "slow": 0}  # slow misses the 100 ms ITL
    ttft_slow = ThroughputCurve("t", 0, "", (DecodePoint(1, 100, 20),), (PrefillPoint(512, 5000.0),))
    offer = PoolOffer("t", ttft_slow, price_per_h=0.1, max_workers=10)
    assert choose_mix(300, [fast, offer], SLO, prompt_tokens=512) == {"fast": 3, "t": 0}
    assert choose_mix(300, [fast, offer], SLO) == {"fast": 0, "t": 3}  # without a prompt length: no TTFT check


def test_spot_cap_and_preemption_loss():
    od = PoolOffer("od", flat("od", 100), price_per_h=1.0, max_workers=50)
    spot = PoolOffer("spot", flat("spot", 100), price_per_h=0.3, market="spot", preemption_rate_per_h=0.5,
                     max_workers=50)
    assert spot.expected_loss() == pytest.approx(0.5 * 120 / 3600)
    plan = plan_mix(1000, [od, spot], SLO, spot_max_fraction=0.7)
    assert plan.feasible and plan.spot_fraction <= 0.7 + 1e-9 and plan.capacity_tokens_per_s >= 1000
    assert plan.workers["spot"] > 0 and plan.workers["od"] >= math.ceil(0.3 * 1000 / 100)
    all_od = plan_mix(1000, [od], SLO)
    assert plan.cost_per_h < all_od.cost_per_h
    uncapped = plan_mix(1000, [od, spot], SLO, spot_max_fraction=1.0)
    assert uncapped.workers["od"] == 0
    assert uncapped.workers["spot"] == math.ceil(1000 / spot.effective_tokens_per_s(SLO))
    # a spot pool preempted so often that its effective capacity costs more than on demand is not used
    churny = PoolOffer("churn", flat("churn", 100), price_per_h=0.9, market="spot", preemption_rate_per_h=20,
                       max_workers=50)
    assert churny.cost_per_mtok(SLO) > od.cost_per_mtok(SLO)
    assert choose_mix(500, [od, churny], SLO, spot_max_fraction=1.0) == {"od": 5, "churn": 0}
    # spot only: the cap cannot hold and is not applied (said in the notes)
    only = plan_mix(250, [spot], SLO)
    assert only.workers["spot"] == 3 and only.feasible and only.notes


def test_greedy_path_is_feasible_and_within_its_bound():
    offers = [PoolOffer("a", flat("a", 100), 1.0, max_workers=40),
              PoolOffer("b", flat("b", 250), 2.0, max_workers=40),
              PoolOffer("s", flat("s", 100), 0.4, market="spot", preemption_rate_per_h=0.2, max_workers=40)]
    exact = plan_mix(2300, offers, SLO)
    greedy = plan_mix(2300, offers, SLO, exact_limit=0)
    assert exact.exact and not greedy.exact
    for p in (exact, greedy):
        assert p.feasible and p.capacity_tokens_per_s >= 2300 and p.spot_fraction <= 0.7 + 1e-9
    assert exact.cost_per_h <= greedy.cost_per_h <= exact.cost_per_h + sum(o.price_per_h for o in offers)


def test_infeasible_demand_uses_what_there_is():
    od = PoolOffer("od", flat("od", 100), 1.0, max_workers=3)
    plan = plan_mix(1000, [od], SLO)
    assert not plan.feasible and dict(plan.workers) == {"od": 3}


def test_pool_record_validation_json_and_offer():
    rec = PoolRecord("h100-spot", accelerator="h100", memory_bytes=80 * 2**30, price_on_demand_per_h=4.0,
                     price_spot_per_h=1.5, market="spot", preemption_rate_per_h=0.1, max_workers=8)
    assert set(rec.to_json()) == {"accelerator", "memory_bytes", "price_on_demand_per_h", "price_spot_per_h",
                                  "market", "preemption_rate_per_h", "max_workers"}
    assert PoolRecord.from_json("h100-spot", rec.to_json()) == rec and rec.price_per_h == 1.5
    assert rec.with_changes({"max_workers": 2, "market": None}).max_workers == 2
    offer = PoolOffer.from_record(rec, flat("h100-spot", 1000))
    assert (offer.price_per_h, offer.market, offer.max_workers) == (1.5, "spot", 8)
    with pytest.raises(ValueError, match="market"):
        PoolRecord("p", market="reserved")
    with pytest.raises(ValueError, match="max_workers"):
        PoolRecord("p", max_workers=-1)
    with pytest.raises(ValueError, match="price_spot_per_h"):
        PoolRecord("p", price_spot_per_h=float("nan"))
    with pytest.raises(ValueError, match="pool name"):
        PoolRecord("Bad.Name")
