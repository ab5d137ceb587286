"""Pure tests of the scheduler's weighted fair queue (no NATS, etcd or torch)."""

from __future__ import annotations

from collections import Counter

import pytest

from actors.scheduler.fair_queue import (ADMITTED, DEADLINE_UNMEETABLE, QUEUE_FULL, QUEUE_FULL_TENANT, FairQueue,
                                         FairQueueConfig)


def drain(q: FairQueue) -> list[str]:
    out = []
    while (p := q.pop()) is not None:
        out.append(p.request_id)
    return out


def test_light_tenant_is_not_stuck_behind_heavy_one():
    q: FairQueue[str] = FairQueue()
    for i in range(10):
        q.push(f"a{i}", "A", 1.0, "interactive", 100, 0, f"a{i}")
    q.push("b0", "B", 1.0, "interactive", 100, 0, "b0")
    order = drain(q)
    assert order.index("b0") <= 1  # FCFS would serve it 11th


def test_fcfs_mode_serves_in_arrival_order():
    q: FairQueue[str] = FairQueue(FairQueueConfig(fcfs=True))
    for i in range(5):
        q.push(f"a{i}", "A", 1.0, "interactive", 100, 0, f"a{i}")
    q.push("b0", "B", 1.0, "batch", 100, 0, "b0")
    q.push("a9", "A", 1.0, "interactive", 100, 0, "a9")
    assert drain(q) == ["a0", "a1", "a2", "a3", "a4", "b0", "a9"]


def test_weights_split_service_by_tokens():
    q: FairQueue[str] = FairQueue()
    for i in range(400):
        q.push(f"a{i}", "A", 3.0, "interactive", 50, 0, "A")
        q.push(f"b{i}", "B", 1.0, "interactive", 50, 0, "B")
    served = Counter(q.pop().tenant for _ in range(400))  # saturation: both always backlogged
    assert abs(served["A"] / served["B"] - 3.0) < 0.1


def test_cost_not_count_decides_share():
    q: FairQueue[str] = FairQueue()
    for i in range(100):
        q.push(f"a{i}", "A", 1.0, "interactive", 400, 0, "A")  # big requests
        q.push(f"b{i}", "B", 1.0, "interactive", 100, 0, "B")  # small requests
    tokens = Counter()
    for _ in range(100):
        p = q.pop()
        tokens[p.tenant] += p.cost
    assert abs(tokens["A"] / tokens["B"] - 1.0) < 0.15


def test_interactive_strictly_before_batch():
    q: FairQueue[str] = FairQueue()
    q.push("b1", "A", 1.0, "batch", 10, 0, "b1")
    q.push("i1", "B", 1.0, "interactive", 10, 0, "i1")
    q.push("b2", "C", 1.0, "batch", 10, 0, "b2")
    q.push("i2", "A", 1.0, "interactive", 10, 0, "i2")
    order = drain(q)
    assert set(order[:2]) == {"i1", "i2"} and set(order[2:]) == {"b1", "b2"}


def test_edf_within_a_tenant_and_front_requeue():
    q: FairQueue[str] = FairQueue()
    q.push("late", "A", 1.0, "interactive", 10, 500.0, "late")
    q.push("none", "A", 1.0, "interactive", 10, 0, "none")
    q.push("soon", "A", 1.0, "interactive", 10, 100.0, "soon")
    q.push("again", "A", 1.0, "interactive", 10, 900.0, "again", front=True)
    assert drain(q) == ["again", "soon", "late", "none"]


def test_idle_tenant_does_not_bank_credit():
    q: FairQueue[str] = FairQueue()
    for i in range(50):  # A alone for a while
        q.push(f"a{i}", "A", 1.0, "interactive", 10, 0, "A")
    for _ in range(40):
        q.pop()
    q.push("b0", "B", 1.0, "interactive", 10, 0, "B")
    q.push("b1", "B", 1.0, "interactive", 10, 0, "B")
    order = [q.pop().tenant for _ in range(6)]
    assert order.count("B") == 2 and order.count("A") >= 3  # B interleaves, does not monopolize


def test_bounds_and_deadline_admission():
    q: FairQueue[str] = FairQueue(FairQueueConfig(max_total=3, max_per_tenant=2))
    assert q.can_admit("A", "interactive", 10, 0, 0.0, None) == ADMITTED
    q.push("a0", "A", 1.0, "interactive", 1000, 0, "a0")
    q.push("a1", "A", 1.0, "interactive", 1000, 0, "a1")
    assert q.can_admit("A", "interactive", 10, 0, 0.0, None) == QUEUE_FULL_TENANT
    q.push("b0", "B", 1.0, "batch", 10, 0, "b0")
    assert q.can_admit("C", "interactive", 10, 0, 0.0, None) == QUEUE_FULL
    q.remove("b0")
    # A's own 2000 tokens are ahead of its next request at 1000 tok/s: due in 1 s cannot make it, 5 s can
    q.cfg = FairQueueConfig(max_total=3, max_per_tenant=3)
    assert q.can_admit("A", "interactive", 100, 1.0, 0.0, 1000.0) == DEADLINE_UNMEETABLE
    assert q.can_admit("A", "interactive", 100, 5.0, 0.0, 1000.0) == ADMITTED
    assert FairQueue().can_admit("C", "interactive", 10**6, 1.0, 0.0, 1.0) == ADMITTED  # no backlog: no verdict
    assert q.can_admit("C", "interactive", 100, 1.0, 0.0, 1000.0) == ADMITTED  # fair share: C goes next


def test_remove_expiry_and_correction():
    q: FairQueue[str] = FairQueue()
    q.push("x", "A", 1.0, "interactive", 10, 50.0, "x")
    q.push("y", "A", 1.0, "interactive", 10, 0, "y")
    assert q.pop_expired(60.0) == ["x"] and len(q) == 1
    assert q.remove("y") == "y" and q.remove("y") is None and len(q) == 0
    for i in range(3):
        q.push(f"a{i}", "A", 1.0, "interactive", 100, 0, "A")
        q.push(f"b{i}", "B", 1.0, "interactive", 100, 0, "B")
    q.correct("A", "interactive", estimated=100, actual=1000)  # A used far more than estimated
    assert [q.pop().tenant for _ in range(4)] == ["B", "B", "B", "A"]
    with pytest.raises(ValueError):
        q.push("z", "A", 0.0, "interactive", 1, 0, "z")
    with pytest.raises(ValueError):
        q.push("z", "A", 1.0, "urgent", 1, 0, "z")


def test_deadline_admission_uses_fair_position_not_whole_backlog():
    q: FairQueue[str] = FairQueue()
    for i in range(50):
        q.push(f"a{i}", "A", 1.0, "interactive", 100, 0, "A")  # 5,000 tokens of A queued
    # at 1,000 tok/s B's 100-token request is served after ~100 of A's tokens, not after all 5,000
    assert q.tokens_ahead("interactive", "B", 1.0, 100) == 100
    assert q.can_admit("B", "interactive", 100, 1.0, 0.0, 1000.0) == ADMITTED
    assert q.can_admit("A", "interactive", 100, 1.0, 0.0, 1000.0) == DEADLINE_UNMEETABLE
    q.push("x", "C", 1.0, "batch", 10, 0, "x")
    assert q.tokens_ahead("batch", "C", 1.0, 10) == 5000 + 10  # every interactive token first
    fcfs: FairQueue[str] = FairQueue(FairQueueConfig(fcfs=True))
    fcfs.push("a", "A", 1.0, "interactive", 100, 0, "a")
    assert fcfs.tokens_ahead("interactive", "B", 1.0, 100) == 100


def test_refused_dispatches_do_not_cost_the_tenant_its_share():
    """A popped request re-queued at the front (dispatch refused) is refunded: with every other pop refused,
    3:1 weights still give 3:1 of the successful dispatches."""
    q = FairQueue()
    n = 0
    for t in ("a", "b"):
        for i in range(200):
            q.push(f"{t}{i}", t, 3.0 if t == "a" else 1.0, "interactive", 60.0, 0.0, t)
    served = {"a": 0, "b": 0}
    for k in range(200):
        p = q.pop()
        if k % 2:  # refused: back to the front of its tenant
            q.push(p.request_id, p.tenant, 3.0 if p.tenant == "a" else 1.0, "interactive", p.cost, 0.0, p.item,
                   front=True)
        else:
            served[p.tenant] += 1
    assert 2.6 <= served["a"] / served["b"] <= 3.4, served
