"""Isolation between tenants in the engine's KV cache (issue [11] item 2): the prefix-cache salt (block manager,
scheduler affinity index) and the weighted KV share under contention (iteration scheduler, kv_share.py)."""

from __future__ import annotations

import pytest

from actors.cache_salt import cache_salt, cache_scope, tenant_cache_groups
from actors.scheduler.prefix_affinity import block_hashes
from actors.worker.engine.block_manager import BlockManager
from actors.worker.engine.iteration_scheduler import IterationScheduler
from actors.worker.engine.kv_share import below_share, kv_shares, reclaim_from
from bus.messages import GenerateRequest, SamplingParams

BS = 4
PROMPT = list(range(1, 18))  # 4 full blocks + 1 token
GROUPS = {"a": "team", "b": "team"}
SALT_A = cache_salt("m@1", cache_scope("a", {}))
SALT_B = cache_salt("m@1", cache_scope("b", {}))


def cached_bm() -> BlockManager:
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    assert bm.allocate("first", len(PROMPT), PROMPT, SALT_A) is not None
    bm.cache_blocks("first", PROMPT, len(PROMPT))
    bm.free("first")
    return bm


def test_salt_is_derived_from_version_scope_and_adapter_only():
    assert cache_scope("a", {}) == "tenant:a" and cache_scope("a", GROUPS) == "group:team"
    assert cache_salt("m@1", "tenant:a") == cache_salt("m@1", "tenant:a") and len(SALT_A) == 16
    others = {cache_salt("m@1", "tenant:b"), cache_salt("m@2", "tenant:a"), cache_salt("m@1", "tenant:a", "lora1")}
    assert SALT_A not in others and len(others) == 3
    assert cache_salt("m@1", cache_scope("a", GROUPS)) == cache_salt("m@1", cache_scope("b", GROUPS))
    assert tenant_cache_groups({"a": {"cache_group": "team"}, "b": {}, "c": {"cache_group": 3}, "d": None}) == {
        "a": "team"}


def test_a_prompt_hits_only_blocks_cached_under_its_own_salt():
    bm = cached_bm()
    assert bm.cached_prefix_tokens(PROMPT, SALT_A) == 16  # the positive control: same tenant hits
    assert bm.cached_prefix_tokens(PROMPT, SALT_B) == 0  # another tenant: never
    assert bm.cached_prefix_tokens(PROMPT) == 0  # unsalted: never
    assert bm.allocate("b", len(PROMPT), PROMPT, SALT_B) is not None and bm.prefix_hit_tokens == 0
    assert bm.allocate("a", len(PROMPT), PROMPT, SALT_A) is not None and bm.prefix_hit_tokens == 16


def test_blocks_a_salted_sequence_fills_are_registered_under_its_salt():
    bm = cached_bm()
    assert bm.allocate("b", len(PROMPT), PROMPT, SALT_B) is not None
    bm.cache_blocks("b", PROMPT, len(PROMPT))
    bm.free("b")
    assert bm.cached_prefix_tokens(PROMPT, SALT_B) == 16 and bm.cached_prefix_tokens(PROMPT, SALT_A) == 16
    assert bm.num_cached_blocks == 8  # two copies: one per salt, no block shared between them


def test_scheduler_affinity_index_is_keyed_by_the_salt_too():
    assert block_hashes(PROMPT, BS, salt=SALT_A) == block_hashes(PROMPT, BS, salt=SALT_A)
    assert not set(block_hashes(PROMPT, BS, salt=SALT_A)) & set(block_hashes(PROMPT, BS, salt=SALT_B))
    assert block_hashes(PROMPT, BS) != block_hashes(PROMPT, BS, salt=SALT_A)


def test_iteration_scheduler_counts_prefix_hits_per_tenant():
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    s = IterationScheduler(bm, 8, 64)
    for i, (tenant, salt) in enumerate([("a", SALT_A), ("a", SALT_A), ("b", SALT_B)]):
        s.add(f"r{i}", len(PROMPT), list(PROMPT), tenant=tenant, salt=salt)
        s.commit(s.schedule())
    assert s.prefix_hits_by_tenant == {"a": 16}


def test_kv_shares_and_reclaim_policy():
    assert kv_shares({"a": 1, "b": 3}, 100) == {"a": 25.0, "b": 75.0}
    assert kv_shares({"a": 0, "b": -1}, 10) == {"a": 5.0, "b": 5.0}  # non-positive weights count as 1
    held = {"a": 90}
    assert reclaim_from(held, {"a": 1, "b": 1}, 100, "b", 10) == "a"
    assert reclaim_from(held, {"a": 1, "b": 1}, 100, "b", 60) is None  # b would pass its own share
    assert reclaim_from({"a": 40, "b": 10}, {"a": 1, "b": 1}, 100, "b", 10) is None  # nobody above its share
    assert reclaim_from({"a": 60, "c": 70}, {"a": 1, "b": 1, "c": 1}, 150, "b", 10) == "c"  # furthest above
    assert below_share({"a": 90}, {"a": 1, "b": 1}, 100) == {"a": -40.0, "b": 50.0}


def run_steps(s: IterationScheduler, n: int) -> None:
    for _ in range(n):
        plan = s.schedule()
        s.commit(plan)
        for item in plan.seqs:
            if item.samples:
                s.append_token(item.seq_id)


def test_a_tenant_holds_at_most_its_share_while_another_waits():
    bm = BlockManager(40, BS)  # 160 token slots
    s = IterationScheduler(bm, 16, 256)
    for i in range(4):  # tenant a fills the cache: 4 sequences of 9 blocks + growth
        s.add(f"a{i}", 36, tenant="a")
    run_steps(s, 2)
    assert bm.num_free_blocks < 9 and all(s.is_running(f"a{i}") for i in range(4))
    s.add("b0", 36, tenant="b")  # b's sequences do not fit: a holds more than half the blocks
    s.add("b1", 36, tenant="b")
    run_steps(s, 2)
    assert s.is_running("b0") and s.is_running("b1") and s.num_kv_reclaims >= 2
    held = {t: sum(len(bm.block_table(q.seq_id)) for q in s.running if q.tenant == t) for t in "ab"}
    assert held["a"] <= 20, held  # a at most its share (40 blocks x 1/2) while b waited
    assert s.paused_ids(), "a's newest sequence was preempted and waits to resume"


def test_no_reclaim_within_one_tenant_or_for_a_claimant_above_its_share():
    bm = BlockManager(40, BS)
    s = IterationScheduler(bm, 16, 256)
    for i in range(4):
        s.add(f"a{i}", 36, tenant="a")
    run_steps(s, 2)
    s.add("a9", 36, tenant="a")  # the same tenant waits: plain FCFS, nobody preempted for it
    run_steps(s, 1)
    assert not s.is_running("a9") and s.num_kv_reclaims == 0
    s.add("b0", 150, tenant="b")  # b asks for more than its share: no reclaim for it either
    run_steps(s, 1)
    assert not s.is_running("b0") and s.num_kv_reclaims == 0


def test_weights_give_the_heavier_tenant_the_larger_share():
    bm = BlockManager(40, BS)
    s = IterationScheduler(bm, 16, 256)
    for i in range(4):
        s.add(f"a{i}", 36, tenant="a", weight=1.0)
    run_steps(s, 2)
    for i in range(3):  # 3 x 8-9 blocks: within b's share (40 x 3/4 = 30), above an equal share (20)
        s.add(f"b{i}", 32, tenant="b", weight=3.0)
    run_steps(s, 4)
    held = {t: sum(len(bm.block_table(q.seq_id)) for q in s.running if q.tenant == t) for t in "ab"}
    assert all(s.is_running(f"b{i}") for i in range(3)) and held["a"] <= 12, held


def test_generate_request_checks_the_scheduler_fields():
    base = dict(request_id="r", tenant="t", name="m", version="1", reply="x", prompt_token_ids=(1,),
                sampling=SamplingParams())
    assert GenerateRequest(**base, cache_salt=SALT_A.hex(), tenant_weight=2).tenant_weight == 2
    for bad in ({"cache_salt": "zz"}, {"cache_salt": "AB" * 16}, {"tenant_weight": 0}, {"tenant_weight": True},
                {"tenant_weight": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GenerateRequest(**base, **bad)


def test_isolation_bench_verdicts():
    from bench.cache_isolation_bench import compare

    rng = __import__("random").Random(3)
    fresh = [500 + rng.gauss(0, 20) for _ in range(50)]
    same = compare({"fresh": fresh, "probe": [500 + rng.gauss(0, 20) for _ in range(50)],
                    "hit": [40 + rng.gauss(0, 5) for _ in range(50)]})
    assert same["met"] and same["median_ttft_ms"]["hit"] < 60
    leak = compare({"fresh": fresh, "probe": [40 + rng.gauss(0, 5) for _ in range(50)], "hit": fresh})
    assert not leak["isolated"] and not leak["control_detects_hit"] and not leak["met"]
