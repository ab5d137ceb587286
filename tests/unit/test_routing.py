"""Routing table rules (control/state/routing.py) and gateway resolution through them (gateway/models.py)."""

import uuid

import pytest

from control.state import routing as r
from gateway.models import ModelSnapshot
from gateway.openai_format import ApiError


def _snap(versions=("1", "2"), table=None, workers=None, statuses=None):
    statuses = statuses or {}
    vers = {"m": {v: {"status": statuses.get(v, "active")} for v in versions}}
    w = {("m", v): n for v, n in (workers or {v: 1 for v in versions}).items()}
    return ModelSnapshot(vers, {"m": table.to_dict() if table else {}}, w)


def _share(snap, n=4000, tenant_of=lambda i: "t", key_of=lambda i: uuid.uuid4().hex, version="2"):
    got = [snap.resolve("m", tenant=tenant_of(i), request_key=key_of(i))[1] for i in range(n)]
    return got.count(version) / n


@pytest.mark.parametrize("stable,canary", [("1", "2"), ("2", "1"), ("10", "9")])
def test_split_follows_weight_whatever_the_version_order(stable, canary):
    t = r.start_rollout(r.RoutingTable(), stable=stable, canary=canary, weight=10)
    snap = _snap(versions=(stable, canary), table=t)
    assert abs(_share(snap, version=canary) - 0.10) < 0.02


def test_request_stickiness_is_deterministic_per_key():
    t = r.start_rollout(r.RoutingTable(), stable="1", canary="2", weight=50)
    snap = _snap(table=t)
    for i in range(50):
        key = f"req-{i}"
        assert len({snap.resolve("m", tenant="t", request_key=key)[1] for _ in range(5)}) == 1


def test_tenant_stickiness_keeps_a_tenant_on_one_side_and_splits_tenants():
    t = r.start_rollout(r.RoutingTable(), stable="1", canary="2", weight=30, sticky="tenant")
    snap = _snap(table=t)
    sides = {}
    for i in range(2000):
        tenant = f"tenant-{i % 400}"
        v = snap.resolve("m", tenant=tenant, request_key=uuid.uuid4().hex)[1]
        assert sides.setdefault(tenant, v) == v
    share = sum(v == "2" for v in sides.values()) / len(sides)
    assert 0.22 < share < 0.38


def test_tenant_on_canary_stays_there_as_weight_grows():
    t = r.start_rollout(r.RoutingTable(), stable="1", canary="2", weight=5, sticky="tenant")
    on_canary = [f"t{i}" for i in range(1000) if r.bucket("m", f"t{i}") < 500]
    t2 = r.set_weight(t, 25, by="test")
    snap = _snap(table=t2)
    assert on_canary and all(snap.resolve("m", tenant=x, request_key="k")[1] == "2" for x in on_canary)


def test_pin_bypasses_split_and_unknown_or_retired_pins_are_404():
    t = r.start_rollout(r.RoutingTable(), stable="1", canary="2", weight=100)
    snap = _snap(versions=("1", "2", "3"), table=t, statuses={"3": "retired"})
    assert all(snap.resolve("m@1", tenant="t", request_key=str(i)) == ("m", "1") for i in range(50))
    for ref in ("m@3", "m@4", "nope", "m@1:adapter"):
        with pytest.raises(ApiError) as e:
            snap.resolve(ref)
        assert e.value.status == 404


def test_rollback_sends_everything_to_stable_and_promote_to_canary():
    t = r.start_rollout(r.RoutingTable(), stable="1", canary="2", weight=50)
    assert _share(_snap(table=r.rollback(t)), n=500) == 0.0
    promoted = r.promote(t)
    assert _share(_snap(table=promoted), n=500) == 1.0
    back = r.rollback(promoted)
    assert (back.stable, back.state) == ("1", "rolled_back")
    assert _share(_snap(table=back), n=500) == 0.0
    assert [d["action"] for d in back.decisions] == ["start", "promote", "rollback"]


def test_canary_that_is_not_active_gets_no_traffic():
    t = r.start_rollout(r.RoutingTable(), stable="1", canary="2", weight=100)
    assert _share(_snap(table=t, statuses={"2": "retired"}), n=200) == 0.0


def test_without_stable_new_unserved_version_takes_no_traffic():
    snap = _snap(versions=("1", "2"), workers={"1": 1, "2": 0})
    assert snap.resolve("m") == ("m", "1")
    assert snap.all_versions_served()  # version 1 is routed and served: ready
    assert snap.routed_versions() == [("m", "1")]
    snap2 = _snap(versions=("1", "2"), workers={"1": 1, "2": 1})
    assert snap2.resolve("m") == ("m", "2")


def test_readiness_needs_the_running_canary_served():
    t = r.start_rollout(r.RoutingTable(), stable="1", canary="2", weight=5)
    assert not _snap(table=t, workers={"1": 1, "2": 0}).all_versions_served()
    assert _snap(table=t, workers={"1": 1, "2": 1}).all_versions_served()


@pytest.mark.parametrize("field,record", [
    ("weight", {"weight": 101}), ("weight", {"weight": True}), ("sticky", {"sticky": "user"}),
    ("state", {"state": "paused"}), ("steps", {"steps": [5, 50, 25, 100]}), ("steps", {"steps": [5, 50]}),
    ("canary", {"canary": "Bad.Version"}), ("canary", {"stable": "1", "canary": "1"}),
])
def test_invalid_records_name_the_field(field, record):
    with pytest.raises(ValueError, match=field):
        r.RoutingTable.from_dict(record)


def test_edits_refuse_what_makes_no_sense():
    t = r.start_rollout(r.RoutingTable(), stable="1", canary="2", weight=5)
    with pytest.raises(ValueError, match="already running"):
        r.start_rollout(t, stable="1", canary="3", weight=5)
    with pytest.raises(ValueError, match="no rollout"):
        r.promote(r.RoutingTable())
    with pytest.raises(ValueError, match="nothing to roll back"):
        r.rollback(r.RoutingTable(stable="1"))
    with pytest.raises(ValueError, match="already the stable"):
        r.start_rollout(r.RoutingTable(), stable="1", canary="1", weight=5)


def test_round_trip_and_decision_log_is_bounded():
    t = r.start_rollout(r.RoutingTable(), stable="1", canary="2", weight=5, steps=[10, 100])
    for i in range(r.MAX_DECISIONS + 10):
        t = r.set_weight(t, 10, by="controller", reasons=[f"step {i}"])
    assert len(t.decisions) == r.MAX_DECISIONS and t.decisions[-1]["reasons"] == [f"step {r.MAX_DECISIONS + 9}"]
    assert r.RoutingTable.from_dict(t.to_dict()) == t


def test_invalid_stored_table_falls_back_to_defaults():
    snap = ModelSnapshot({"m": {"1": {}, "2": {}}}, {"m": {"weight": "lots"}}, {("m", "1"): 1, ("m", "2"): 1})
    assert snap.resolve("m") == ("m", "2")


def test_model_list_leaves_out_retired_and_disabled_versions():
    snap = _snap(versions=("1", "2", "3"), statuses={"2": "retired", "3": "disabled"})
    assert [m["id"] for m in snap.model_list()] == ["m", "m@1"]
    gone = _snap(versions=("1",), statuses={"1": "retired"})
    assert gone.model_list() == []  # no active version: the name answers 404, so it is not listed
