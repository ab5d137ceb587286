"""Pure tests of the autoscaler's sleeping tier (actors/autoscaler/sleep_tier.py, issue [28] item 2): sleepers kept
while recent history or the forecast wants the capacity back, weighed by their wake time and cost."""

from __future__ import annotations

import pytest

from actors.autoscaler.sleep_tier import SleeperInfo, SleepTierConfig, SleepTierPolicy

K = "m/1/default"


def test_a_scale_down_sleeps_while_recent_history_wants_the_capacity_and_not_after():
    pol = SleepTierPolicy(SleepTierConfig(history_s=600, cold_start_s=100, idle_horizon_s=1800))
    pol.observe(K, 0.0, 3)
    plan = pol.plan(K, 100.0, 2, [])  # the scale-down 3 -> 2: one replica wanted again
    assert (plan.keep, plan.wanted_again, plan.exit) == (1, 1, ())
    assert plan.horizon_s == pytest.approx(10 * (100 - 2))  # full price: the break-even, not the idle horizon
    plan = pol.plan(K, 650.0, 2, [SleeperInfo("w1", asleep_s=550, wake_s=1.0)])  # the peak is still in the window
    assert plan.keep == 1 and plan.exit == ()
    plan = pol.plan(K, 720.0, 2, [SleeperInfo("w1", asleep_s=620, wake_s=1.0)])  # the peak of 3 left the window
    assert (plan.keep, plan.wanted_again, plan.exit) == (0, 0, ("w1",))
    assert "0 replica(s) wanted again" in plan.reason


def test_a_full_price_sleeper_exits_at_its_break_even_a_shared_one_stays_the_idle_horizon():
    pol = SleepTierPolicy(SleepTierConfig(history_s=10**6, cold_start_s=52, idle_horizon_s=1800,
                                          cold_start_penalty=10))
    pol.observe(K, 0.0, 4)
    alone, shared = SleeperInfo("a", asleep_s=480, wake_s=2.0), SleeperInfo("b", asleep_s=480, wake_s=2.0, shared=True)
    assert pol.plan(K, 1.0, 2, [alone, shared]).exit == ()  # 480 s < 10 x 50 s
    later = [SleeperInfo("a", 510, 2.0), SleeperInfo("b", 510, 2.0, shared=True)]
    assert pol.plan(K, 2.0, 2, later).exit == ("a",)  # the one paying its instance went at 500 s
    last = [SleeperInfo("b", 1800, 2.0, shared=True)]
    assert pol.plan(K, 3.0, 2, last).exit == ("b",)  # free, but not past the idle horizon
    # cost-only weighing (penalty 1): a lone sleeper is worth the cold start it saves, no more
    cheap = SleepTierPolicy(SleepTierConfig(history_s=10**6, cold_start_s=52, cold_start_penalty=1))
    cheap.observe(K, 0.0, 3)
    assert cheap.plan(K, 1.0, 2, [SleeperInfo("a", 51, 2.0)]).exit == ("a",)
    assert cheap.plan(K, 1.0, 2, [SleeperInfo("a", 49, 2.0)]).exit == ()


def test_a_wake_that_saves_nothing_is_not_a_tier():
    pol = SleepTierPolicy(SleepTierConfig(cold_start_s=5))
    pol.observe(K, 0.0, 3)
    plan = pol.plan(K, 1.0, 2, [SleeperInfo("a", 1, wake_s=6.0)])  # waking is slower than starting cold
    assert (plan.keep, plan.horizon_s, plan.exit) == (0, 0.0, ("a",))
    plan = pol.plan(K, 1.0, 2, [SleeperInfo("a", 1, wake_s=1.0)])  # the same pool with a fast wake
    assert plan.keep == 1 and plan.exit == ()


def test_the_forecast_keeps_sleepers_that_history_alone_would_not_and_extras_exit_dearest_first():
    pol = SleepTierPolicy(SleepTierConfig(history_s=60, cold_start_s=52))
    pol.observe(K, 0.0, 2)
    sleepers = [SleeperInfo("slow", 10, wake_s=1.9), SleeperInfo("alone", 10, wake_s=0.5),
                SleeperInfo("shared", 10, wake_s=1.0, shared=True)]
    assert pol.plan(K, 10.0, 2, sleepers).exit == ("shared", "alone", "slow")  # nothing wanted again
    plan = pol.plan(K, 10.0, 2, sleepers, forecast_replicas=4)  # the forecast wants two more: the best two stay
    assert (plan.keep, plan.exit) == (2, ("slow",))
    plan = pol.plan(K, 10.0, 2, sleepers, forecast_replicas=3)
    assert (plan.keep, plan.exit) == (1, ("alone", "slow"))


def test_the_sleepers_a_scale_up_wakes_are_wanted_not_exited():
    """Found by bench/autoscaler_step_bench.py --sleeping: at the scale-up 1 -> 2 the peak is the new target, so
    nothing is "wanted again" beyond it; the sleeper the scale-up wakes must not be told to exit in that round."""
    pol = SleepTierPolicy(SleepTierConfig(cold_start_s=52))
    pol.observe(K, 0.0, 2)
    pol.observe(K, 50.0, 1)
    sleeper = [SleeperInfo("w1", asleep_s=16, wake_s=0.3)]
    plan = pol.plan(K, 66.0, 2, sleeper, awake=1)  # the step: active target 2, one awake, one to wake
    assert (plan.keep, plan.wanted_again, plan.exit) == (1, 1, ())
    assert pol.plan(K, 66.0, 2, sleeper, awake=2).exit == ("w1",)  # negative control: both awake, nothing wants it


def test_config_is_checked():
    with pytest.raises(ValueError, match="history_s"):
        SleepTierConfig(history_s=-1)
    assert SleepTierPolicy().plan(K, 0.0, 0, []).to_json()["keep"] == 0
