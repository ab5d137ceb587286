"""IterationScheduler: pure continuous-batching policy."""

import pytest

from actors.worker.engine.block_manager import BlockManager
from actors.worker.engine.iteration_scheduler import IterationScheduler


def make(num_blocks=100, block_size=4, max_seqs=8, max_tokens=64):
    bm = BlockManager(num_blocks, block_size)
    return bm, IterationScheduler(bm, max_seqs, max_tokens)


def run_step(sched, plan):
    """Simulate the engine: commit, then one generated token per sampling sequence."""
    sched.commit(plan)
    for item in plan.seqs:
        if item.samples:
            sched.append_token(item.seq_id)


def test_prefill_then_decode():
    _, s = make()
    s.add("a", 10)
    plan = s.schedule()
    assert [(i.seq_id, i.start, i.num_new_tokens, i.samples) for i in plan.seqs] == [("a", 0, 10, True)]
    run_step(s, plan)
    plan = s.schedule()
    assert [(i.start, i.num_new_tokens) for i in plan.seqs] == [(10, 1)]


def test_mixed_prefill_and_decode_in_one_step():
    _, s = make()
    s.add("a", 5)
    run_step(s, s.schedule())
    s.add("b", 7)
    plan = s.schedule()
    assert [(i.seq_id, i.num_new_tokens) for i in plan.seqs] == [("a", 1), ("b", 7)]
    assert plan.num_batched_tokens == 8


def test_max_num_seqs_limits_admission():
    _, s = make(max_seqs=2)
    for sid in "abc":
        s.add(sid, 3)
    plan = s.schedule()
    assert [i.seq_id for i in plan.seqs] == ["a", "b"]
    assert s.num_waiting == 1


def test_token_budget_chunks_long_prompt():
    _, s = make(max_tokens=8)
    s.add("a", 20)
    p1 = s.schedule()
    assert [(i.start, i.num_new_tokens, i.samples) for i in p1.seqs] == [(0, 8, False)]
    run_step(s, p1)
    p2 = s.schedule()
    assert [(i.start, i.num_new_tokens, i.samples) for i in p2.seqs] == [(8, 8, False)]
    run_step(s, p2)
    p3 = s.schedule()
    assert [(i.start, i.num_new_tokens, i.samples) for i in p3.seqs] == [(16, 4, True)]


def test_fcfs_head_blocks_queue():
    bm, s = make(num_blocks=4, block_size=4)
    s.add("big", 20)  # needs 5 blocks: never admitted with 4
    s.add("small", 2)
    assert s.schedule().is_empty()
    assert s.num_waiting == 2


def test_blocks_grow_with_decodes():
    bm, s = make(num_blocks=10, block_size=4)
    s.add("a", 4)
    run_step(s, s.schedule())
    assert len(bm.block_table("a")) == 1
    run_step(s, s.schedule())  # computes token 5 -> needs a second block
    assert len(bm.block_table("a")) == 2


def test_preempts_newest_when_out_of_blocks():
    bm, s = make(num_blocks=2, block_size=4)
    s.add("old", 4)
    s.add("new", 4)
    run_step(s, s.schedule())  # both prefilled: 2 blocks used, both need a new block to decode
    plan = s.schedule()
    assert plan.preempted == ["new"]
    assert [i.seq_id for i in plan.seqs] == ["old"]
    assert s.waiting[0].seq_id == "new" and s.waiting[0].num_computed_tokens == 0
    assert not bm.has_seq("new")


def test_preempted_sequence_recomputes_all_its_tokens():
    bm, s = make(num_blocks=3, block_size=4)
    s.add("old", 4)
    s.add("new", 4)
    run_step(s, s.schedule())
    run_step(s, s.schedule())  # preempts "new" (5 tokens now: 4 prompt + 1 generated)
    s.remove("old")
    plan = s.schedule()
    assert [(i.seq_id, i.start, i.num_new_tokens, i.samples) for i in plan.seqs] == [("new", 0, 5, True)]


def test_self_preemption_when_only_sequence_left_is_newest():
    bm, s = make(num_blocks=2, block_size=2, max_tokens=64)
    s.add("a", 2)
    s.add("b", 2)
    run_step(s, s.schedule())
    plan = s.schedule()  # "a" needs a block: "b" is preempted, "a" proceeds
    assert plan.preempted == ["b"] and [i.seq_id for i in plan.seqs] == ["a"]


def test_remove_frees_blocks_and_forgets():
    bm, s = make(num_blocks=10, block_size=4)
    s.add("a", 8)
    run_step(s, s.schedule())
    assert bm.num_free_blocks == 8
    assert s.remove("a")
    assert bm.num_free_blocks == 10
    assert not s.has_unfinished()
    assert not s.remove("a")


def test_join_and_leave_between_steps():
    _, s = make()
    s.add("a", 3)
    run_step(s, s.schedule())
    s.add("b", 3)
    run_step(s, s.schedule())
    s.remove("a")
    plan = s.schedule()
    assert [i.seq_id for i in plan.seqs] == ["b"]


def test_duplicate_and_invalid():
    _, s = make()
    s.add("a", 1)
    with pytest.raises(ValueError):
        s.add("a", 1)
    with pytest.raises(ValueError):
        IterationScheduler(BlockManager(1, 1), 0, 1)


def test_module_is_pure():
    import ast

    import actors.worker.engine.iteration_scheduler as m

    tree = ast.parse(open(m.__file__).read())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(x.split(".")[0] in ("torch", "nats") for x in names)
