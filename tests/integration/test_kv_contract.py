"""The contract of bus/kv.py, run against the in-memory twin and a real nats-server JetStream KV.

Each test gets two handles (``a``, ``b``) on one fresh bucket: two processes' views of it (separate
update locks), so compare-and-swap races are real races on the server.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid

import pytest

from bus.kv import KvConflict, MemoryBuckets
from bus.streams import BucketConfig

_names = itertools.count()


@pytest.fixture(params=["memory", "jetstream"])
async def pair(request, infra):
    """``(a, b)``: two KeyValue handles on one new bucket (history 3) of the parametrised kind."""
    config = BucketConfig(f"kvc_{uuid.uuid4().hex[:8]}_{next(_names)}", history=3, file=False)
    if request.param == "memory":
        buckets = MemoryBuckets()
        yield await buckets.bucket(config), await buckets.bucket(config)
        return
    import nats

    from bus.jetstream import JetStream

    conns = [await nats.connect(infra.nats_url) for _ in range(2)]
    try:
        yield await JetStream(conns[0]).bucket(config), await JetStream(conns[1]).bucket(config)
    finally:
        await conns[0].jetstream().delete_key_value(config.name)
        for nc in conns:
            await nc.close()


async def test_get_put_round_trip_json_and_revisions(pair):
    a, b = pair
    assert await a.get("k") is None
    value = {"n": 1, "f": 0.5, "s": "é", "l": [1, None, True], "d": {"x": {}}}
    r1 = await a.put("k", value)
    e = await b.get("k")
    assert (e.key, e.value, e.revision, e.deleted) == ("k", value, r1, False)
    r2 = await b.put("other", [1])
    r3 = await b.put("k", "v2")
    assert r1 < r2 < r3 and (await a.get("k")).value == "v2"


async def test_create_fails_on_existing_key_and_works_after_delete(pair):
    a, b = pair
    rev = await a.create("c", {"v": 1})
    with pytest.raises(KvConflict):
        await b.create("c", {"v": 2})
    assert (await a.get("c")).revision == rev
    await b.delete("c")
    assert await a.get("c") is None
    await a.create("c", {"v": 3})
    assert (await b.get("c")).value == {"v": 3}


async def test_swap_only_at_the_expected_revision(pair):
    a, b = pair
    rev = await a.put("s", 1)
    rev2 = await b.swap("s", 2, rev)
    with pytest.raises(KvConflict):
        await a.swap("s", 3, rev)  # b moved it on
    assert (await a.get("s")).value == 2
    assert await a.swap("s", 4, rev2) > rev2


async def test_delete_with_last_revision_and_history(pair):
    a, b = pair
    revs = [await a.put("h", i) for i in range(4)]
    with pytest.raises(KvConflict):
        await b.delete("h", last=revs[0])
    assert (await a.get("h")).value == 3
    await b.delete("h", last=revs[-1])
    assert await a.get("h") is None
    hist = await a.history("h")
    assert [(e.value, e.deleted) for e in hist] == [(2, False), (3, False), (None, True)]  # history=3 kept
    assert [e.revision for e in hist[:2]] == revs[2:] and hist[2].revision > revs[-1]
    assert await a.history("never") == []


async def test_update_creates_changes_and_leaves_alone(pair):
    a, b = pair
    up = await a.update("u", lambda v: {"n": 1} if v is None else None)
    assert up.changed and up.value == {"n": 1} and up.revision == (await b.get("u")).revision
    same = await b.update("u", lambda v: None)
    assert (same.changed, same.value, same.revision) == (False, {"n": 1}, up.revision)
    assert (await a.update("missing", lambda v: None)).value is None
    with pytest.raises(ZeroDivisionError):
        await a.update("u", lambda v: 1 / 0)


async def test_concurrent_updates_from_two_replicas_lose_nothing(pair):
    a, b = pair

    async def bump(kv, n: int) -> None:
        for _ in range(n):
            await kv.update("cnt", lambda v: {"n": (v or {}).get("n", 0) + 1})
    await asyncio.gather(bump(a, 25), bump(b, 25), bump(a, 10))
    assert (await b.get("cnt")).value == {"n": 60}


async def test_update_retries_lost_races_a_bounded_number_of_times(pair):
    a, b = pair
    await a.put("r", 0)
    calls = []

    def change(v):
        calls.append(v)
        return v + 1
    real_swap = a.swap

    async def racing_swap(key, value, last):  # another replica writes between our read and our swap
        await b.put(key, -1)
        return await real_swap(key, value, last)
    a.swap = racing_swap
    with pytest.raises(TimeoutError):
        await a.update("r", change, attempts=3)
    assert calls == [0, -1, -1] and (await b.get("r")).value == -1
    a.swap = real_swap
    assert (await a.update("r", change)).value == 0


async def test_watch_current_values_then_changes(pair):
    a, b = pair
    await a.put("w.1", 1)
    await a.put("w.2", 2)
    await a.delete("w.2")
    await a.put("x.1", 9)
    async with a.watch("w.*") as w:
        first = [await w.__anext__(), await w.__anext__()]
        assert [(e.key, e.value) for e in first[:1]] == [("w.1", 1)] and first[1] is None
        await b.put("w.3", 3)
        await b.put("x.2", 0)  # not matched
        await b.delete("w.1")
        got = [await asyncio.wait_for(w.__anext__(), 2.0) for _ in range(2)]
    assert [(e.key, e.value, e.deleted) for e in got] == [("w.3", 3, False), ("w.1", None, True)]


async def test_values_lists_the_keys_matching_a_filter(pair):
    a, b = pair
    for key in ("j.t1.a", "j.t1.b", "j.t2.a", "j.t1.c"):
        await a.put(key, {"k": key})
    await b.delete("j.t1.c")
    assert [e.key for e in await b.values("j.t1.*")] == ["j.t1.a", "j.t1.b"]
    assert len(await a.values(">")) == 3 and await a.values("none.*") == []


async def test_values_right_after_many_writes(pair):
    """Every key written is listed at once, in revision order (a watch-based listing could end early)."""
    a, b = pair
    for i in range(200):
        await a.put(f"m.t.{i}", i)
    assert [e.value for e in await b.values("m.t.*")] == list(range(200))


async def test_bad_keys_are_refused_alike(pair):
    a, _ = pair
    for key in ("", ".k", "k.", "a b", "k*"):
        with pytest.raises(ValueError):
            await a.put(key, 1)
    with pytest.raises(TypeError):
        await a.put("k", {1, 2})  # not JSON
