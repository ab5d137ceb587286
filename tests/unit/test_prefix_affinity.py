"""Pure tests of prefix-affinity routing: chained block hashes and the worker index."""

from __future__ import annotations

import pytest

from actors.scheduler.policy import WorkerTable
from actors.scheduler.prefix_affinity import PrefixIndex, block_hashes


def test_chained_hashes_depend_on_the_whole_prefix():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # the 8-token tail is not a full block
    b = block_hashes([99] + list(range(1, 40)), 16)
    assert a[0] != b[0] and a[1] != b[1]  # block 1 equal, but its chain differs
    assert block_hashes(list(range(32)) + [7] * 16, 16)[:2] == a


def test_index_matches_leading_blocks_and_is_bounded():
    idx = PrefixIndex(capacity=3)
    h = block_hashes(list(range(64)), 16)
    idx.record(h[:2], "w1")
    assert idx.matched_blocks(h, "w1") == 2 and idx.matched_blocks(h, "w2") == 0
    idx.record(h[2:], "w2")
    assert len(idx) == 3 and idx.matched_blocks(h, "w1") == 0  # oldest (first) block evicted: no match
    idx.forget_worker("w2")
    assert len(idx) == 1
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_pick_prefers_affinity_then_load():
    t = WorkerTable()
    for wid, slots in (("w1", 5), ("w2", 6)):
        t.on_lease(wid, True)
        t.on_credits(wid, 100, slots, 16, False, 0.0, 100, 8)
    assert t.pick(10, 0.1).worker_id == "w2"
    assert t.pick(10, 0.1, lambda w: 5 if w.worker_id == "w1" else 0).worker_id == "w1"


def test_affinity_yields_to_load_when_its_worker_is_much_busier():
    from actors.scheduler.policy import WorkerTable

    t = WorkerTable()
    for wid in ("w1", "w2"):
        t.on_lease(wid, True)
        t.on_credits(wid, 100, 8, 16, False, 0.0, 100, 8)
    home = lambda w: 3 if w.worker_id == "w1" else 0  # noqa: E731 - every prompt shares w1's cached prefix
    got = []
    for i in range(8):
        w = t.pick(10, 0.1, home)
        w.take(f"r{i}", 10)
        got.append(w.worker_id)
    assert got.count("w1") == 5 and got.count("w2") == 3  # w1 while at most 2 slots busier, then spread
    t.workers["w2"].free_slots = 7  # a prefix on a barely busier worker still wins
    t.workers["w1"].free_slots = 6
    assert t.pick(10, 0.1, home).worker_id == "w1"
