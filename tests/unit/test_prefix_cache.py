"""Prefix caching: pure block-manager behaviour (hits, reference counts, LRU eviction) and the
engine's use of it (a warm prefix gives the same logits and greedy tokens as a cold one)."""

from __future__ import annotations

import pytest
import torch

from actors.worker.engine.block_manager import BlockManager, block_hash
from actors.worker.engine.iteration_scheduler import IterationScheduler


def filled(bm: BlockManager, seq_id: str, tokens: list[int]) -> list[int]:
    """Allocate ``tokens`` for ``seq_id`` and mark them all computed (cached)."""
    table = bm.allocate(seq_id, len(tokens), tokens)
    bm.cache_blocks(seq_id, tokens, len(tokens))
    return table


def test_hash_chains_on_parent():
    assert block_hash(b"", [1, 2]) != block_hash(block_hash(b"", [0, 0]), [1, 2])
    assert block_hash(b"", [1, 2]) == block_hash(b"", [1, 2])


def test_hit_shares_full_blocks_and_counts_tokens():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = filled(bm, "a", list(range(10)))  # blocks 0..1 full, block 2 partial
    prompt = list(range(8)) + [99, 98, 97]
    assert bm.cached_prefix_tokens(prompt) == 8
    b = bm.allocate("b", len(prompt), prompt)
    assert b[:2] == a[:2] and b[2] not in a
    assert bm.ref_count(a[0]) == 2 and bm.ref_count(a[2]) == 1
    assert bm.prefix_hit_tokens == 8
    # a partial block never hits; one token is always left to compute
    assert bm.cached_prefix_tokens(list(range(9))) == 8
    assert bm.cached_prefix_tokens(list(range(8))) == 4


def test_no_hit_when_disabled_or_different_prefix():
    bm = BlockManager(16, 4)
    filled(bm, "a", list(range(10)))
    assert bm.cached_prefix_tokens(list(range(10))) == 0
    bm2 = BlockManager(16, 4, enable_prefix_caching=True)
    filled(bm2, "a", list(range(10)))
    assert bm2.cached_prefix_tokens([1] + list(range(1, 10))) == 0  # first block differs -> chain breaks


def test_refcount_free_keeps_cached_blocks_until_evicted():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a = filled(bm, "a", [1, 2, 3, 4])
    b = bm.allocate("b", 3, [1, 2, 3])
    assert b[0] == a[0] and bm.ref_count(a[0]) == 2
    bm.free("a")
    assert bm.ref_count(a[0]) == 1 and bm.num_free_blocks == 4 - 2  # a[1] evictable, b holds 2
    bm.free("b")
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    assert bm.cached_prefix_tokens([1, 2, 3, 4, 5]) == 4  # still cached after everyone left


def test_lru_eviction_order_tail_first_oldest_first():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    filled(bm, "a", [1, 2, 3, 4])
    bm.free("a")
    filled(bm, "b", [11, 12, 13, 14])
    bm.free("b")
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 4
    bm.allocate("c", 2)  # evicts the least recently freed: a's tail
    assert bm.cached_prefix_tokens([1, 2, 3, 4, 5]) == 2
    assert bm.cached_prefix_tokens([11, 12, 13, 14, 15]) == 4
    bm.allocate("d", 2)  # then a's head
    assert bm.cached_prefix_tokens([1, 2, 3, 4, 5]) == 0
    assert bm.allocate("e", 5) is None  # b's two blocks are all that is left


def test_hit_blocks_are_taken_from_lru_not_evicted():
    bm = BlockManager(3, 2, enable_prefix_caching=True)
    filled(bm, "a", [1, 2, 3, 4])
    bm.free("a")
    t = bm.allocate("b", 6, [1, 2, 3, 4, 5, 6])  # 2 hits + 1 new block: fits in 3
    assert t is not None and len(set(t)) == 3 and bm.num_free_blocks == 0
    assert bm.prefix_hit_tokens == 4


def test_reset_prefix_cache():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    filled(bm, "a", [1, 2, 3, 4])
    bm.free("a")
    assert bm.reset_prefix_cache() == 2
    assert bm.cached_prefix_tokens([1, 2, 3, 4, 5]) == 0 and bm.num_free_blocks == 4


def test_scheduler_starts_hit_sequences_after_the_cached_prefix():
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    sched = IterationScheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    first = list(range(20))
    sched.add("a", 20, first)
    plan = sched.schedule()
    sched.commit(plan)
    sched.remove("a")
    second = list(range(16)) + [50, 51, 52]
    sched.add("b", len(second), second)
    plan = sched.schedule()
    assert [(s.start, s.num_new_tokens) for s in plan.seqs] == [(16, 3)]
    assert sched.cached_prompt_tokens("b") == 16 and sched.cached_prompt_tokens("nope") == 0


def test_cached_prompt_tokens_is_the_first_admission_not_a_recompute():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    sched = IterationScheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add("a", 9, list(range(9)))
    assert sched.cached_prompt_tokens("a") == 0  # not admitted yet
    sched.commit(sched.schedule())
    assert sched.cached_prompt_tokens("a") == 0  # a miss
    sched._preempt(sched.running.pop(), None)  # its blocks are now cached: the recompute hits them
    plan = sched.schedule()
    assert plan.seqs[0].start == 8 and sched.cached_prompt_tokens("a") == 0  # still the request's own figure


# --------------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tests.engine_fixtures import write_tiny_llama_gguf

    return write_tiny_llama_gguf(str(tmp_path_factory.mktemp("tinypc") / "tiny.gguf"))


def _first_logits_and_tokens(engine, rid, prompt, n):
    from actors.worker.engine.types import EngineRequest, SamplingParams

    captured = []
    orig = engine.runner.forward

    def forward(plan):
        out = orig(plan)
        if any(s.seq_id == rid and s.samples for s in plan.seqs) and not captured:
            captured.append(out[[s.seq_id for s in plan.seqs if s.samples].index(rid)].clone())
        return out

    engine.runner.forward = forward
    try:
        engine.add_request(EngineRequest(rid, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=n,
                                                                            ignore_eos=True)))
        tokens = []
        while engine.has_unfinished():
            for o in engine.step():
                tokens += o.new_token_ids
    finally:
        engine.runner.forward = orig
    return captured[0], tokens


def test_engine_warm_prefix_equals_cold(tiny_path):
    from actors.worker.engine.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model_path=tiny_path, dtype="float32", kv_cache_bytes=2 * 2**20))
    shared = [(7 * i) % 250 + 3 for i in range(100)]
    prompt = shared + [5, 6, 7, 8, 9]
    cold_logits, cold_tokens = _first_logits_and_tokens(engine, "cold", prompt, 10)
    engine.reset_prefix_cache()
    _first_logits_and_tokens(engine, "fill", shared + [40, 41], 1)
    hits = engine.stats().extra["prefix_cache_hit_tokens"]
    finished = []
    orig_step = engine.step
    engine.step = lambda: [o for o in orig_step() if not o.finished or finished.append(o) or True]
    warm_logits, warm_tokens = _first_logits_and_tokens(engine, "warm", prompt, 10)
    assert engine.stats().extra["prefix_cache_hit_tokens"] - hits == 96  # 6 full blocks of 16
    assert [(o.request_id, o.num_cached_tokens) for o in finished] == [("warm", 96)]  # usage's cached_tokens
    assert warm_tokens == cold_tokens
    assert torch.allclose(warm_logits, cold_logits, atol=1e-4, rtol=0)
