"""Pure tests of the worker's residency policy (actors/worker/residency.py): what to load, drain and evict
within a memory budget, shared weights, the KV split."""

from __future__ import annotations

import pytest

from actors.worker.residency import Demand, ResidencyConfig, ResidencyPolicy, VersionSpec

GB = 10**9


def spec(ref, weights=4 * GB, key=None, kv=1 * GB, **kw) -> VersionSpec:
    return VersionSpec(ref, weights, key or ref, kv, **kw)


def test_the_busier_version_takes_the_room_and_an_idle_one_is_evicted():
    specs = {"a@1": spec("a@1"), "b@1": spec("b@1")}
    pol = ResidencyPolicy()
    plan = pol.plan(6 * GB, specs, {"a@1": Demand(), "b@1": Demand(tokens_per_s=50)}, {"a@1"}, now=0.0)
    assert (plan.evict, plan.load, plan.drain) == (["a@1"], ["b@1"], [])
    assert plan.kv_bytes == {"b@1": 2 * GB} and plan.weights_bytes == 4 * GB


def test_a_version_with_running_sequences_drains_first_and_the_load_waits():
    specs = {"a@1": spec("a@1"), "b@1": spec("b@1")}
    pol = ResidencyPolicy(ResidencyConfig(drain_bound_s=10.0))
    demand = {"a@1": Demand(running=2), "b@1": Demand(queue_len=3)}
    plan = pol.plan(6 * GB, specs, demand, {"a@1"}, now=0.0)
    assert (plan.drain, plan.evict, plan.load, plan.waiting) == (["a@1"], [], [], ["b@1"])
    assert set(plan.kv_bytes) == {"a@1"}  # still resident while it drains
    demand["a@1"] = Demand(running=0)
    plan = pol.plan(6 * GB, specs, demand, {"a@1"}, now=3.0)
    assert (plan.evict, plan.load, plan.forced) == (["a@1"], ["b@1"], [])


def test_a_drain_past_its_bound_is_forced():
    specs = {"a@1": spec("a@1"), "b@1": spec("b@1")}
    pol = ResidencyPolicy(ResidencyConfig(drain_bound_s=10.0))
    demand = {"a@1": Demand(running=1), "b@1": Demand(queue_len=1)}
    assert pol.plan(6 * GB, specs, demand, {"a@1"}, now=0.0).drain == ["a@1"]
    assert pol.plan(6 * GB, specs, demand, {"a@1"}, now=9.0).drain == ["a@1"]
    plan = pol.plan(6 * GB, specs, demand, {"a@1"}, now=10.0)
    assert plan.evict == plan.forced == ["a@1"] and plan.load == ["b@1"]
    assert "drained 10 s" in plan.reasons["a@1"]


def test_a_drain_is_called_off_when_the_version_is_wanted_again():
    specs = {"a@1": spec("a@1"), "b@1": spec("b@1")}
    pol = ResidencyPolicy(ResidencyConfig(drain_bound_s=10.0))
    assert pol.plan(6 * GB, specs, {"a@1": Demand(running=1), "b@1": Demand(queue_len=1)}, {"a@1"}, 0.0).drain
    plan = pol.plan(6 * GB, specs, {"a@1": Demand(running=1, tokens_per_s=500)}, {"a@1"}, 5.0)
    assert plan.drain == plan.evict == [] and pol.draining_since == {}


def test_shared_artifact_costs_its_weights_once():
    specs = {"a@1": spec("a@1", key="f.gguf|int8"), "a@2": spec("a@2", key="f.gguf|int8"),
             "c@1": spec("c@1", key="f.gguf|int4")}
    plan = ResidencyPolicy().plan(7 * GB, specs, {r: Demand(tokens_per_s=10) for r in specs}, {"a@1"}, 0.0)
    assert plan.load == ["a@2"] and plan.weights_bytes == 4 * GB  # c@1 (another quantization) does not fit
    assert sum(plan.kv_bytes.values()) == 3 * GB


def test_pins_stay_and_an_unasked_version_is_never_loaded():
    specs = {"p@1": spec("p@1", pinned=True), "q@1": spec("q@1"), "r@1": spec("r@1")}
    plan = ResidencyPolicy().plan(6 * GB, specs, {"q@1": Demand(tokens_per_s=1e6)}, {"p@1"}, 0.0)
    assert plan.evict == [] and plan.load == [] and plan.waiting == []  # q does not fit beside the pin
    plan = ResidencyPolicy().plan(20 * GB, specs, {}, {"p@1"}, 0.0)
    assert plan.load == []  # r@1 and q@1: no demand, no load


def test_hysteresis_and_load_cost_keep_a_resident_version_against_a_slightly_busier_one():
    specs = {"a@1": spec("a@1"), "b@1": spec("b@1", load_cost_s=10.0)}
    demand = {"a@1": Demand(tokens_per_s=100), "b@1": Demand(tokens_per_s=150)}
    assert ResidencyPolicy().plan(6 * GB, specs, demand, {"a@1"}, 0.0).load == []
    demand["b@1"] = Demand(tokens_per_s=400)
    assert ResidencyPolicy().plan(6 * GB, specs, demand, {"a@1"}, 0.0).load == ["b@1"]


def test_batch_demand_weighs_less_than_interactive():
    specs = {"i@1": spec("i@1"), "b@1": spec("b@1", slo_class="batch")}
    demand = {"i@1": Demand(tokens_per_s=100), "b@1": Demand(tokens_per_s=300)}
    assert ResidencyPolicy().plan(6 * GB, specs, demand, set(), 0.0).load == ["i@1"]


def test_kv_split_gives_floors_and_the_rest_by_demand():
    specs = [spec("a@1", kv=100), spec("b@1", kv=100)]
    out = ResidencyPolicy.split_kv(1200, specs, {"a@1": Demand(tokens_per_s=3.0)})
    assert out == {"a@1": 100 + 800, "b@1": 100 + 200}
    assert ResidencyPolicy.split_kv(1200, [], {}) == {}


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="name@version"):
        VersionSpec("a", 1, "k")
    with pytest.raises(ValueError, match="weights_bytes"):
        VersionSpec("a@1", -1, "k")
    with pytest.raises(ValueError, match="running"):
        Demand(running=-1)
    with pytest.raises(ValueError, match="drain_bound_s"):
        ResidencyConfig(drain_bound_s=-1)
    with pytest.raises(ValueError, match="without a spec"):
        ResidencyPolicy().plan(GB, {}, {}, {"x@1"}, 0.0)


def test_a_sleeping_version_lends_its_kv_room_and_gets_no_kv_share():
    """Issue [28] on a host (actors/worker/host_sleep.py): the host gives a sleeper's spec no KV floor; the plan
    keeps it resident beside a newcomer that would not fit beside it awake, and splits the KV room without it."""
    pol = ResidencyPolicy()
    demand = {"a@1": Demand(), "b@1": Demand(queue_len=1)}
    awake = {"a@1": spec("a@1", weights=2 * GB), "b@1": spec("b@1", weights=2 * GB)}
    plan = pol.plan(5 * GB + GB // 2, awake, demand, {"a@1"}, now=0.0)
    assert (plan.evict, plan.load) == (["a@1"], ["b@1"])  # negative control: awake, a@1 is evicted for b@1
    asleep = dict(awake, **{"a@1": spec("a@1", weights=2 * GB, kv=0)})
    plan = ResidencyPolicy().plan(5 * GB + GB // 2, asleep, demand, {"a@1"}, now=0.0, asleep={"a@1"})
    assert (plan.evict, plan.load) == ([], ["b@1"])
    assert plan.kv_bytes == {"a@1": 0, "b@1": GB + GB // 2} and plan.weights_bytes == 4 * GB
