"""actors.recent.RecentIds: bounded, expiring memory of ids (early cancels)."""

from __future__ import annotations

import pytest

from actors.recent import RecentIds


def test_pop_returns_the_value_once_within_ttl():
    r = RecentIds(ttl_s=10)
    r.add("a", "disconnect", now=100.0)
    assert r.pop("b", now=101.0) is None
    assert r.pop("a", now=101.0) == "disconnect"
    assert r.pop("a", now=101.0) is None


def test_expired_ids_are_forgotten_and_size_is_bounded():
    r = RecentIds(ttl_s=10, max_size=3)
    r.add("old", now=0.0)
    assert r.pop("old", now=10.5) is None  # expired
    r.add("x", now=0.0)
    r.add("y", now=20.0)  # "x" expired: pruned on add
    assert len(r) == 1
    for i in range(5):
        r.add(f"k{i}", now=21.0 + i)
    assert len(r) == 3 and r.pop("k4", now=26.0) is True and r.pop("k0", now=26.0) is None


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        RecentIds(ttl_s=0)
    with pytest.raises(ValueError):
        RecentIds(max_size=0)
