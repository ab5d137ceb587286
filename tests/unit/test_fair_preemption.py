"""Fair-share preemption: the pure victim choice, the iteration scheduler's preempt/front-add, and the
engine's tokens after a preempt-and-resume (same greedy tokens as an uninterrupted run)."""

from __future__ import annotations

from actors.scheduler.policy import fair_slots, preemption_victim
from actors.worker.engine.block_manager import BlockManager
from actors.worker.engine.iteration_scheduler import IterationScheduler
from actors.worker.engine.types import EngineRequest, SamplingParams
from tests.unit.test_engine_tiny import GREEDY, make_engine, req, run_all, solo_tokens, tiny_path, tokens  # noqa: F401

RUNNING = [("a1", "A"), ("a2", "A"), ("b1", "B"), ("a3", "A"), ("c1", "C")]


def test_fair_slots_rounds_up_the_weighted_share():
    assert fair_slots(8, 0.5) == 4 and fair_slots(8, 0.25) == 2 and fair_slots(8, 1 / 3) == 3
    assert fair_slots(8, 0.0) == 0 and fair_slots(0, 0.5) == 0


def test_victim_is_the_newest_request_of_the_tenant_most_over_its_share():
    held, fair = {"A": 6, "B": 1, "C": 1}, {"A": 3, "B": 3, "C": 3}
    assert preemption_victim("B", held, fair, RUNNING) == "a3"
    held = {"A": 4, "B": 1, "C": 6}
    assert preemption_victim("B", held, fair, RUNNING) == "c1"


def test_no_preemption_at_or_above_fair_share_or_without_an_over_share_tenant():
    fair = {"A": 4, "B": 4}
    assert preemption_victim("B", {"A": 4, "B": 4}, fair, RUNNING) is None  # B already has its share
    assert preemption_victim("B", {"A": 4, "B": 1}, fair, RUNNING) is None  # A is not over its share
    assert preemption_victim("A", {"A": 7, "B": 1}, fair, RUNNING) is None  # the over-share tenant itself
    assert preemption_victim("B", {"A": 7, "B": 1}, fair, [("b1", "B")]) is None  # nothing of A preemptible


def test_weights_set_the_fair_slots():
    fair = {"A": fair_slots(8, 0.75), "B": fair_slots(8, 0.25)}  # 6 and 2
    assert preemption_victim("B", {"A": 7, "B": 1}, fair, RUNNING) == "a3"
    assert preemption_victim("B", {"A": 6, "B": 2}, fair, RUNNING) is None


def scheduler(max_seqs=2):
    return IterationScheduler(BlockManager(100, 4), max_seqs, 64)


def step(s):
    plan = s.schedule()
    s.commit(plan)
    for item in plan.seqs:
        if item.samples:
            s.append_token(item.seq_id)
    return plan


def test_preempt_then_front_add_runs_the_newcomer_next_and_the_victim_after():
    s = scheduler()
    s.add("a1", 5)
    s.add("a2", 5)
    step(s)
    step(s)
    assert s.preempt("a2") and not s.preempt("a2")  # a second call finds it waiting, not running
    s.add("b", 3, front=True)
    plan = step(s)
    assert [i.seq_id for i in plan.seqs] == ["a1", "b"] and [w.seq_id for w in s.waiting] == ["a2"]
    s.remove("a1")
    plan = step(s)
    a2 = next(i for i in plan.seqs if i.seq_id == "a2")
    assert (a2.start, a2.num_new_tokens, a2.samples) == (0, 7, True)  # recomputes prompt + its 2 tokens


def test_the_victim_waits_behind_requests_admitted_with_the_newcomer():
    s = scheduler(max_seqs=3)
    for sid in ("a1", "a2"):
        s.add(sid, 5)
    step(s)
    s.add("n", 3)  # an ordinary dispatch into the free slot...
    s.add("b", 3, front=True)  # ...and one that displaces a2, accepted in the same batch
    assert s.preempt("a2") and s.is_running("a1") and not s.is_running("a2")
    plan = step(s)
    assert {i.seq_id for i in plan.seqs} == {"a1", "b", "n"} and [w.seq_id for w in s.waiting] == ["a2"]


def test_preempt_of_unknown_or_waiting_sequence_is_false():
    s = scheduler(max_seqs=1)
    s.add("a", 3)
    s.add("b", 3)
    step(s)
    assert not s.preempt("b") and not s.preempt("nope") and s.preempt("a")


def test_engine_preempted_request_resumes_with_the_same_greedy_tokens(tiny_path):
    prompts = [[1, 40, 50, 60, 70, 80, 90] * 2, [1, 41, 52, 60, 71, 80] * 3, [1, 45, 55, 65]]
    solo = [solo_tokens(tiny_path, p, n=16) for p in prompts]
    e = make_engine(tiny_path, max_num_seqs=2)
    e.add_request(req("a", prompts[0], max_tokens=16, **GREEDY))
    e.add_request(req("b", prompts[1], max_tokens=16, **GREEDY))
    outs: dict[str, list] = {}
    for _ in range(5):
        for o in e.step():
            outs.setdefault(o.request_id, []).append(o)
    assert e.preempt_request("b") and e.has_request("b")
    e.add_request(req("c", prompts[2], max_tokens=16, **GREEDY), front=True)
    first = e.step()
    assert {o.request_id for o in first} == {"a", "c"}  # the newcomer runs at once, "b" waits
    for o in first:
        outs.setdefault(o.request_id, []).append(o)
    for rid, more in run_all(e).items():
        outs.setdefault(rid, []).extend(more)
    assert [tokens(outs[r]) for r in ("a", "b", "c")] == solo
    assert not e.has_request("b")


# ---- priority class and prefill priority (issue 23) -------------------------------------------------------

def test_block_shortage_preempts_the_newest_batch_sequence_before_any_interactive_one():
    s = IterationScheduler(BlockManager(3, 4), 8, 64)
    s.add("b1", 4, priority="batch")
    s.add("b2", 4, priority="batch")
    s.add("i", 4)  # newest, but interactive
    step(s)  # all three prefilled: 3 blocks used, each needs a new block to decode
    assert [q.seq_id for q in s.running] == ["i", "b1", "b2"]  # interactive first, each class oldest first
    plan = step(s)
    assert plan.preempted == ["b2", "b1"] and [i.seq_id for i in plan.seqs] == ["i"]
    s2 = IterationScheduler(BlockManager(2, 4), 8, 64)
    s2.add("i1", 4)
    s2.add("i2", 4)
    step(s2)
    assert step(s2).preempted == ["i2"]  # no batch sequence runs: the newest, as before


def test_urgent_sequences_queue_fcfs_ahead_of_ordinary_waiting_ones():
    s = scheduler(max_seqs=1)
    s.add("run", 3)
    step(s)
    for sid, urgent in (("o1", False), ("u1", True), ("o2", False), ("u2", True)):
        s.add(sid, 3, urgent=urgent)
    assert [w.seq_id for w in s.waiting] == ["u1", "u2", "o1", "o2"]
    s.add("f", 3, front=True)  # a displacing newcomer still goes first
    assert [w.seq_id for w in s.waiting] == ["f", "u1", "u2", "o1", "o2"]


def test_urgent_prefill_gets_the_step_budget_before_a_running_prefill_chunk():
    for urgent, expect in ((True, [("long", 6), ("u", 10)]), (False, [("long", 16)])):
        s = IterationScheduler(BlockManager(100, 4), 4, 16)
        s.add("long", 60)
        step(s)  # first 16-token chunk
        s.add("u", 10, urgent=urgent)
        plan = step(s)
        assert [(i.seq_id, i.num_new_tokens) for i in plan.seqs] == expect  # urgent: whole prefill, first token


def test_engine_batch_victim_of_block_shortage_resumes_unchanged_and_service_counts_once(tiny_path):
    """12 blocks of 16 slots; two 48-token prompts generating 56 tokens need 14: block shortage preempts the
    *older* batch request, never the interactive one; both give their solo greedy tokens, and the recomputed
    prompt tokens are not counted as service again (prefix caching off, so the prompt is recomputed)."""
    prompts = [[1, 40, 50, 60, 70, 80, 90, 100] * 6, [1, 41, 52, 63, 74, 85, 96, 107] * 6]
    solo = [solo_tokens(tiny_path, p, n=56) for p in prompts]
    e = make_engine(tiny_path, kv_cache_bytes=12 * 8192, block_size=16, enable_prefix_caching=False)
    e.add_request(EngineRequest("b", tuple(prompts[0]), SamplingParams(max_tokens=56, **GREEDY),
                                priority="batch", tenant="tb"))
    e.add_request(EngineRequest("i", tuple(prompts[1]), SamplingParams(max_tokens=56, **GREEDY), tenant="ti"))
    outs: dict[str, list] = {}
    preempted = set()
    while e.has_unfinished():
        for o in e.step():
            outs.setdefault(o.request_id, []).append(o)
        preempted |= {sid for sid, q in e.scheduler._seqs.items() if q.num_preemptions}
    assert preempted == {"b"} and [tokens(outs["b"]), tokens(outs["i"])] == solo
    st = e.stats()
    assert st.served == {"tb": [48, 56], "ti": [48, 56]} and st.num_prompt_tokens > 96  # b's prompt recomputed
    assert st.step_ms > 0 and st.prefill_tokens_per_s > 0


def test_a_step_that_admits_an_urgent_sequence_admits_no_ordinary_one():
    s = scheduler(max_seqs=4)
    s.add("o1", 5)
    s.add("u", 3, urgent=True)
    plan = step(s)
    assert [i.seq_id for i in plan.seqs] == ["u"] and [w.seq_id for w in s.waiting] == ["o1"]
    plan = step(s)
    assert [(i.seq_id, i.num_new_tokens) for i in plan.seqs] == [("u", 1), ("o1", 5)]  # the ordinary one next
