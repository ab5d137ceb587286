"""Pure tests of the scheduler policy: bounded FCFS queue and credit-based worker choice."""

from __future__ import annotations

import pytest

from actors.scheduler.policy import FcfsQueue, WorkerTable


def test_queue_is_bounded_fcfs():
    q: FcfsQueue[str] = FcfsQueue(2)
    assert q.push("a", 10, 0, "A") and q.push("b", 10, 0, "B")
    assert not q.push("c", 10, 0, "C")
    assert q.pop()[3] == "A"
    q.push_front("a", 10, 0, "A")
    assert [q.pop()[3], q.pop()[3]] == ["A", "B"]
    with pytest.raises(ValueError):
        FcfsQueue(0)


def test_queue_remove_and_expiry():
    q: FcfsQueue[str] = FcfsQueue(5)
    q.push("a", 1, 100.0, "A")
    q.push("b", 1, 0.0, "B")  # no deadline
    q.push("c", 1, 300.0, "C")
    assert q.remove("c") == "C" and q.remove("zz") is None
    assert q.pop_expired(200.0) == ["A"]
    assert len(q) == 1


def _table(now=0.0) -> WorkerTable:
    t = WorkerTable(stale_after_s=2.0)
    for wid, slots in (("w1", 2), ("w2", 5)):
        t.on_lease(wid, True)
        t.on_credits(wid, free_blocks=10, free_slots=slots, block_size=16, draining=False, now=now)
    return t


def test_pick_least_loaded_within_credits():
    t = _table()
    assert t.pick(10, now=0.5).worker_id == "w2"
    w = t.get("w1")
    assert w.can_take(16 * 9, 0.5, 2.0) and not w.can_take(16 * 10, 0.5, 2.0)  # needs prompt + 1 token
    assert t.pick(16 * 20, now=0.5) is None  # no worker has the blocks


def test_dispatch_charges_credits_and_stale_credits_are_ignored():
    t = _table()
    for i in range(5):
        t.pick(10, 0.1).take(f"r{i}", 10)
    assert t.get("w2").free_slots == 1 or t.get("w1").free_slots < 2
    total_slots = sum(w.free_slots for w in t.workers.values())
    assert total_slots == 2 and t.num_inflight() == 5
    assert t.pick(10, now=5.0) is None  # credits 5 s old: not trusted


def test_lease_loss_returns_inflight_with_started_flags():
    t = _table()
    t.get("w1").take("r1", 10)
    t.get("w1").take("r2", 10)
    t.on_first_token("r2")
    lost = t.on_lease("w1", False)
    assert lost == {"r1": False, "r2": True}
    assert "w1" not in t.workers
    t.on_credits("w1", 10, 2, 16, False, 0.0)  # late heartbeat of a dead worker: ignored
    assert "w1" not in t.workers


def test_refusal_distrusts_worker_until_next_heartbeat():
    t = _table()
    t.get("w2").take("r1", 10)
    t.on_refused("w2", "r1")
    assert t.pick(10, 0.2).worker_id == "w1"
    t.on_credits("w2", 10, 5, 16, False, 0.3)
    assert t.pick(10, 0.4).worker_id == "w2"
    t.on_credits("w2", 10, 5, 16, True, 0.5)  # draining
    assert t.pick(10, 0.6).worker_id == "w1"


def test_prompt_no_worker_can_hold_is_detected():
    t = WorkerTable(stale_after_s=2.0)
    assert not t.fits_nowhere(10_000, 0.0)  # no worker yet: wait, do not refuse
    t.on_lease("w1", True)
    t.on_credits("w1", free_blocks=3, free_slots=4, block_size=16, draining=False, now=0.0, total_blocks=100)
    assert not t.fits_nowhere(16 * 100 - 1, 0.1)  # fits once blocks free up
    assert t.fits_nowhere(16 * 100, 0.1)  # prompt + 1 token needs 101 blocks: never fits
    assert not t.fits_nowhere(16 * 100, 10.0)  # credits stale: no verdict
