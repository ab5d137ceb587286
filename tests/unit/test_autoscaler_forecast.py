"""The arrival-rate forecast (actors/autoscaler/forecast.py, issue [29] item 2): additive Holt-Winters fitted
online, checked against the FPP3 recursions by hand, on a daily shape (with the season switched off as the
negative control), on a 3x level shift, and its error measures and planning rule."""

from __future__ import annotations

import math

import pytest

from actors.autoscaler.forecast import ArrivalForecaster, ForecastConfig, HoltWinters

SMALL = dict(bucket_s=60.0, period_s=24 * 60.0)  # a 24-bucket "day" keeps the tests short


def shape(i: int, m: int = 24) -> float:
    return 100.0 + 60.0 * math.cos(2 * math.pi * i / m)


def test_one_update_follows_the_additive_recursions():
    cfg = ForecastConfig(alpha=0.3, beta=0.2, gamma=0.4, bucket_s=1.0, period_s=4.0)
    hw = HoltWinters(cfg)
    for y in (10.0, 20.0, 30.0, 20.0):  # one season: classical start
        hw.update(y)
    assert hw.level == pytest.approx(20.0) and hw.trend == 0.0
    assert hw.seasonal == pytest.approx([-10.0, 0.0, 10.0, 0.0])
    hw.update(14.0)  # bucket 4, season index 0
    l = 0.3 * (14.0 - -10.0) + 0.7 * (20.0 + 0.0)
    b = 0.2 * (l - 20.0) + 0.8 * 0.0
    s0 = 0.4 * (14.0 - 20.0 - 0.0) + 0.6 * -10.0
    assert (hw.level, hw.trend, hw.seasonal[0]) == pytest.approx((l, b, s0))
    assert hw.forecast(1) == pytest.approx(l + b + 0.0)  # bucket 5: season index 1
    assert hw.forecast(2) == pytest.approx(l + 2 * b + 10.0)
    with pytest.raises(ValueError, match="rate"):
        hw.update(-1.0)


def test_a_daily_shape_is_learned_and_the_season_is_what_does_it():
    def mape(cfg: ForecastConfig) -> float:
        f = ArrivalForecaster(cfg)
        for i in range(24 * 5 + 1):  # five days, observed every 60 s at the bucket's rate
            f.observe("m/1", i * 60.0, shape(i))
        return f.errors("m/1", last=24)["mape"]  # the last day: the first has no season yet

    seasonal = mape(ForecastConfig(**SMALL, lead_s=180.0))
    flat = mape(ForecastConfig(bucket_s=60.0, period_s=60.0, lead_s=180.0))  # season of one bucket: Holt only
    assert seasonal < 0.05
    assert flat > 3 * seasonal


def test_a_level_shift_is_followed_within_a_few_buckets():
    f = ArrivalForecaster(ForecastConfig(**SMALL, lead_s=60.0))
    t = 0.0
    for _ in range(30):
        f.observe("m/1", t, 100.0)
        t += 60.0
    for _ in range(4):
        f.observe("m/1", t, 300.0)
        t += 60.0
    assert f.forecast("m/1", t) >= 0.8 * 300.0


def test_planned_is_never_below_what_arrives_and_an_idle_key_stays_at_zero():
    f = ArrivalForecaster(ForecastConfig(bucket_s=60.0, period_s=60.0))  # Holt's trend, no season
    for i in range(100):
        f.observe("m/1", i * 60.0, 100.0 + i)  # a ramp: the forecast is ahead of it
    assert f.planned("m/1", 99 * 60.0, 199.0) > 199.0
    assert f.planned("m/1", 99 * 60.0, 500.0) == 500.0
    assert f.planned("m/1", 99 * 60.0, 0.0) == 0.0
    off = ArrivalForecaster(ForecastConfig(**SMALL, enabled=False))
    for i in range(100):
        off.observe("m/1", i * 60.0, 100.0 + i)
    assert off.planned("m/1", 99 * 60.0, 199.0) == 199.0
    assert f.forecast("unknown", 0.0) == 0.0


def test_errors_score_the_forecast_made_lead_s_ahead():
    f = ArrivalForecaster(ForecastConfig(**SMALL, lead_s=60.0))
    for i in range(50):
        f.observe("m/1", i * 60.0, 80.0)
    e = f.errors("m/1")
    assert e["buckets"] > 40 and e["mape"] == pytest.approx(0.0, abs=1e-9) and e["smape"] == pytest.approx(0.0)
    g = ArrivalForecaster(ForecastConfig(**SMALL, lead_s=60.0))
    for i in range(50):
        g.observe("m/1", i * 60.0, 80.0 if i < 40 else 160.0)
    assert g.errors("m/1")["mape"] > 0.01
    assert math.isnan(ArrivalForecaster().errors("none")["mape"])


@pytest.mark.parametrize("bad", [dict(alpha=1.5), dict(gamma=-0.1), dict(bucket_s=0.0), dict(period_s=10.0),
                                 dict(enabled=1), dict(lead_s=math.inf)])
def test_bad_config_is_refused_with_its_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad)) if "period" not in next(iter(bad)) else "period_s"):
        ForecastConfig(**bad)


def test_backlog_rate_sizes_the_drain_of_what_piles_up_during_a_cold_start():
    from actors.autoscaler.forecast import backlog_rate

    # 3x step: 3,000 tok/s arrive on 1,000 of capacity, 500 queued; new replicas serve in 60 s, drain in 30 s
    assert backlog_rate(500.0, 3000.0, 1000.0, 60.0, 30.0) == pytest.approx((500.0 + 2000.0 * 60.0) / 30.0)
    assert backlog_rate(0.0, 800.0, 1000.0, 60.0, 30.0) == 0.0  # no queue, no overload: nothing extra
    assert backlog_rate(300.0, 800.0, 1000.0, 60.0, 30.0) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="drain_s"):
        backlog_rate(0.0, 1.0, 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="queue_tokens"):
        backlog_rate(-1.0, 1.0, 1.0, 1.0, 1.0)
