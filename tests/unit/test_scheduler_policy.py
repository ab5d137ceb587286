"""Pure tests of the scheduler policy: credit-based worker choice, in-flight table, throughput meter."""

from __future__ import annotations

from actors.scheduler.policy import ThroughputMeter, WorkerTable


def test_throughput_meter_window():
    m = ThroughputMeter(window_s=10.0, min_records=2, started=0.0)
    m.add(0.0, 100)
    assert m.tokens_per_s(0.0) is None  # too few records
    m.add(5.0, 300)
    assert m.tokens_per_s(5.0) == 80.0  # 400 tokens over the 5 s observed so far, not the 10 s window
    m.add(20.0, 100)
    m.add(21.0, 100)
    assert m.tokens_per_s(21.0) == 20.0  # full window: 200 tokens / 10 s
    assert m.tokens_per_s(40.0) is None  # records left the window


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


def test_equally_loaded_workers_take_turns_and_a_new_worker_takes_the_next_request():
    t = WorkerTable(stale_after_s=2.0)
    t.on_lease("old", True)
    t.on_credits("old", free_blocks=10, free_slots=1, block_size=16, draining=False, now=0.0)
    for i in range(3):  # alone, it takes everything; each heartbeat gives its slot back
        t.pick(10, 0.1).take(f"r{i}", 10)
        t.on_credits("old", free_blocks=10, free_slots=1, block_size=16, draining=False, now=0.1)
    t.on_lease("new", True)
    t.on_credits("new", free_blocks=10, free_slots=1, block_size=16, draining=False, now=0.2)
    order = []
    for i in range(4):  # both idle with equal credits: the least recently dispatched one wins the tie
        w = t.pick(10, 0.3)
        w.take(f"s{i}", 10)
        order.append(w.worker_id)
        t.on_credits(w.worker_id, free_blocks=10, free_slots=1, block_size=16, draining=False, now=0.3)
    assert order == ["new", "old", "new", "old"]


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


def test_tenant_weights_from_records():
    from actors.scheduler.actor import tenant_weights
    assert tenant_weights({"a": {"weight": 3}, "b": {}, "c": {"weight": -1}, "d": {"weight": "x"}}) == {
        "a": 3.0, "b": 1.0, "c": 1.0, "d": 1.0}


def test_tenant_cap_keeps_headroom():
    from actors.scheduler.policy import tenant_cap
    assert tenant_cap(0, 0.125) == 1 and tenant_cap(1, 0.125) == 1
    assert tenant_cap(8, 0.125) == 7 and tenant_cap(32, 0.125) == 28 and tenant_cap(2, 0.5) == 1


def test_tenant_cap_grows_to_the_weighted_share():
    from actors.scheduler.policy import tenant_cap, weight_share
    w = {"a": 3.0, "b": 1.0}
    assert weight_share("a", w) == 0.75 and weight_share("c", w) == 0.0 and weight_share("a", {}) == 0.0
    assert tenant_cap(2, 0.125, weight_share("a", w)) == 2  # 1.5 of 2 slots: may hold both
    assert tenant_cap(2, 0.125, weight_share("b", w)) == 1  # headroom rule
    assert tenant_cap(8, 0.125, weight_share("a", w)) == 7  # headroom already above the share (6)
    assert tenant_cap(16, 0.125, 0.95) == 16


def test_a_heartbeat_heard_before_the_lease_is_used_at_the_lease():
    t = WorkerTable(stale_after_s=2.0)
    t.on_credits("w9", free_blocks=10, free_slots=1, block_size=16, draining=False, now=1.0)
    assert "w9" not in t.workers and t.pick(10, now=1.1) is None  # no lease yet: no dispatch
    t.on_lease("w9", True, now=1.5)
    assert t.pick(10, now=1.5).worker_id == "w9"  # takes dispatches at once, not at its next heartbeat
    t.on_credits("w8", free_blocks=10, free_slots=1, block_size=16, draining=False, now=1.0)
    t.on_lease("w8", True, now=3.5)  # that heartbeat is stale by the lease: not used
    assert t.workers["w8"].free_slots == 0 and "w8" not in t.early_credits


def test_early_heartbeats_are_bounded():
    t = WorkerTable()
    t.max_early_credits = 3
    for i in range(5):
        t.on_credits(f"w{i}", free_blocks=1, free_slots=1, block_size=16, draining=False, now=float(i))
    assert list(t.early_credits) == ["w2", "w3", "w4"]
