"""The autoscaler's sleep and wake records where no supervisor runs (actors/autoscaler/sleep_carry.py, issue [28]
with [27]'s Kubernetes export)."""

from __future__ import annotations

from actors.autoscaler.collect import WorkerRecord
from actors.autoscaler.sleep_carry import SleepCarrier
from actors.autoscaler.sleep_tier import SleepPlan

K = "m/1/local"


def w(wid, asleep=False, since=0.0, pool="local"):
    return WorkerRecord(wid, "m", "1", pool, asleep, "", since, 0.0)


def test_extras_sleep_while_the_plan_keeps_them_and_are_not_told_twice():
    c = SleepCarrier(retry_s=10)
    workers = [w("w0"), w("w1"), w("w2"), w("w3")]
    plan = SleepPlan(keep=2, horizon_s=500)
    assert c.commands(0.0, workers, {K: 1}, {K: plan}, set()) == [("w3", "sleep"), ("w2", "sleep")]
    assert c.pending(K) == 2  # the export counts them until their records say so
    assert c.commands(1.0, workers, {K: 1}, {K: plan}, set()) == []  # told already; the one left over is not kept
    workers = [w("w0"), w("w1"), w("w2", True, 1.0), w("w3", True, 1.0)]
    assert c.commands(2.0, workers, {K: 1}, {K: plan}, set()) == [] and c.pending(K) == 0
    # a plan that keeps none: the extra awake worker is left to the orchestrator (the export's count drops)
    assert c.commands(3.0, workers, {K: 1}, {K: SleepPlan(keep=0, horizon_s=0)}, set()) == []


def test_sleepers_wake_before_new_pods_most_recent_first_and_those_exiting_last():
    c = SleepCarrier()
    workers = [w("w0"), w("a", True, 100.0), w("b", True, 300.0), w("c", True, 200.0)]
    plan = SleepPlan(keep=3, horizon_s=500, exit=("b",))
    assert c.commands(0.0, workers, {K: 3}, {K: plan}, set()) == [("c", "wake"), ("a", "wake")]
    assert c.commands(1.0, workers, {K: 3}, {K: plan}, set()) == []  # not repeated before retry_s
    assert c.commands(11.0, workers, {K: 3}, {K: plan}, set()) == [("c", "wake"), ("a", "wake")]  # retried


def test_a_noticed_worker_never_sleeps_and_pools_without_a_count_are_left_alone():
    c = SleepCarrier()
    workers = [w("w0"), w("w1"), w("x0", pool="spot"), w("x1", pool="spot")]
    plans = {K: SleepPlan(keep=1, horizon_s=500), "m/1/spot": SleepPlan(keep=1, horizon_s=500)}
    assert c.commands(0.0, workers, {K: 1}, plans, {"w1"}) == []  # w1 leaves (preemption): not an extra
    assert c.commands(0.0, workers, {K: 0}, plans, {"w1"}) == [("w0", "sleep")]
