"""The autoscaler's desired counts as a gauge (actors/autoscaler/export.py, issue [27] item 3): the leader exports
one series per target, its record else the observed count; a standby exports nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors.autoscaler import export
from actors.autoscaler.collect import Desired


def scaler(leader=True, desired=None, cpu=None, pools=None):
    return SimpleNamespace(is_leader=leader, state=SimpleNamespace(desired=desired or {}),
                           snapshot={"cpu": cpu or {}, "pools": pools or {}})


def test_labels_of_each_target_kind():
    assert export.target_labels("validator") == {"target": "validator", "tier": "validator"}
    assert export.target_labels("m/1/local") == {"target": "worker/m/1/local", "tier": "worker", "model": "m",
                                                 "version": "1", "pool": "local"}
    for bad in ("", "m/1", "a/b/c/d", "m//local"):
        with pytest.raises(ValueError):
            export.target_labels(bad)


def test_the_leader_exports_records_over_observed_counts():
    s = scaler(desired={"validator": Desired(3, 1.0), "m/1/local": Desired(0, 1.0)},
               cpu={"validator": {"replicas": 1}, "gateway": {"replicas": 2}},
               pools={"m/1/local": {"replicas": 2}, "m/1/spot": {"replicas": 1}})
    got = {labels["target"]: value for value, labels in export.desired_samples(s)}
    # records win (0 included: scale to zero); a target without a record keeps its observed count
    assert got == {"validator": 3.0, "gateway": 2.0, "worker/m/1/local": 0.0, "worker/m/1/spot": 1.0}


def test_a_standby_exports_nothing():
    s = scaler(leader=False, desired={"validator": Desired(3, 1.0)}, cpu={"validator": {"replicas": 1}})
    assert export.desired_samples(s) == []
    s.is_leader = True
    assert export.desired_samples(s) == [(3.0, {"target": "validator", "tier": "validator"})]
    s.is_leader = False  # lost its lease: its last values go with it
    assert export.desired_samples(s) == []


def test_bad_values_and_keys_are_skipped():
    s = scaler(desired={"validator": Desired(-1, 0.0), "x/y": Desired(2, 0.0), "m/1/p": True},
               cpu={"validator": {"replicas": 2}}, pools={"m/1/p": {"replicas": None}})
    assert export.desired_samples(s) == [(2.0, {"target": "validator", "tier": "validator"})]


def test_a_snapshot_without_state_uses_its_desired_counts():
    s = SimpleNamespace(is_leader=True, snapshot={"desired": {"m/2/local": 4}})
    assert export.desired_samples(s) == [(4.0, export.target_labels("m/2/local"))]


def test_a_pools_count_is_running_plus_the_sleepers_that_stay():
    """Issue [28]: sleepers are pods that stay, so KEDA sees running + sleeping; sleepers the plan lets exit are
    not counted, workers told to sleep (record not yet changed) are."""
    from actors.autoscaler.sleep_carry import SleepCarrier

    s = scaler(desired={"m/1/local": Desired(2, 1.0)}, pools={"m/1/local": {"replicas": 2, "sleeping": 3}})
    s.snapshot["sleep"] = {"m/1/local": {"keep": 2, "exit": ["w9"]}}
    assert dict((lab["target"], v) for v, lab in export.desired_samples(s)) == {"worker/m/1/local": 4.0}
    s.snapshot["sleep"] = {}
    assert export.desired_samples(s)[0][0] == 5.0  # no plan: every sleeper stays
    s.carrier = SleepCarrier()
    s.carrier._sent["w3"] = ("sleep", 0.0, "m/1/local")
    assert export.desired_samples(s)[0][0] == 6.0
    s.is_leader = False
    assert export.desired_samples(s) == []
