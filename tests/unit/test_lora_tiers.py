"""AdapterTiers (pure): LRU slots that never evict an adapter a running sequence uses; a CPU tier that never
drops a pinned adapter and shrinks back once pins are gone."""

from __future__ import annotations

import pytest

from actors.worker.engine.lora_tiers import AdapterTiers, Placement


def test_free_slots_first_then_least_recently_used_unused_slot():
    t = AdapterTiers(2, 4)
    assert t.place("a", set()) == Placement(0, True, None)
    assert t.place("b", set()) == Placement(1, True, None)
    assert t.place("a", set()) == Placement(0, False, None)  # resident: touched, no load
    assert t.place("c", set()) == Placement(1, True, "b")  # b is the least recently used
    assert (t.num_slot_loads, t.num_slot_evictions) == (3, 1)


def test_a_slot_used_by_a_running_sequence_is_never_taken():
    t = AdapterTiers(2, 4)
    t.place("a", set())
    t.place("b", set())
    assert not t.can_place("c", {"a", "b"}) and t.place("c", {"a", "b"}) is None
    assert t.slots == ["a", "b"]
    assert t.place("c", {"a"}) == Placement(1, True, "b")
    assert t.can_place("a", {"a", "c"})  # resident adapters can always be placed


def test_cpu_tier_keeps_pinned_adapters_and_shrinks_back_later():
    t = AdapterTiers(1, 2)
    assert t.add_cpu("a", set()) == [] and t.add_cpu("b", set()) == []
    assert t.add_cpu("c", {"a", "b"}) == []  # every other member pinned: over its size for now
    assert list(t.cpu) == ["a", "b", "c"]
    assert t.add_cpu("c", {"b"}) == ["a"]  # a later touch trims the unpinned least recently used
    assert t.add_cpu("a", set()) == ["b"] and t.num_disk_loads == 4 and t.num_cpu_evictions == 2


def test_forget_frees_the_slot_and_the_cpu_entry():
    t = AdapterTiers(1, 1)
    t.place("a", set())
    t.add_cpu("a", set())
    assert t.forget("a") == 0 and t.slots == [None] and not t.in_cpu("a")
    assert t.forget("a") is None


@pytest.mark.parametrize("slots,cpu", [(0, 4), (3, 2)])
def test_bad_sizes(slots, cpu):
    with pytest.raises(ValueError):
        AdapterTiers(slots, cpu)
