"""The usage meter's batches (decision 0029): records of one tenant metered together give exactly what
metering them one by one gives, with one compare-and-swap per KV key instead of one per record."""

from __future__ import annotations

import time

import pytest

from bus import streams
from bus.kv import MemoryBuckets
from bus.messages import CompletionRecord
from gateway.quotas import QuotaStore
from gateway.usage import UsageMeter


def records(now: float) -> list[CompletionRecord]:
    day = 86400.0
    return [CompletionRecord(f"r{i}", "acme", "m", str(1 + i % 2), "ok" if i % 3 else "error", "stop", 10 + i, 5 + i,
                             {}, ts=now - (day if i == 4 else 0) + i, choice_index=1 if i == 2 else 0)
            for i in range(6)]


async def state(buckets: MemoryBuckets, now: float) -> dict:
    out = {}
    quota_kv, usage_kv = await buckets.bucket(streams.QUOTAS), await buckets.bucket(streams.USAGE)
    for key in ["tpm.acme"] + [f"day.acme.{time.strftime('%Y%m%d', time.gmtime(t))}" for t in (now, now - 86400)]:
        e = await quota_kv.get(key)
        out[key] = e.value if e else None
    e = await usage_kv.get("u.acme")
    out["u.acme"] = e.value if e else None
    return out


async def metered(batch: bool, now: float) -> tuple[dict, int]:
    buckets = MemoryBuckets()
    quotas = QuotaStore(buckets)
    await quotas.open()
    meter = UsageMeter(buckets, quotas)
    await meter.open(consume=False)
    swaps = [0]
    for kv in (quotas.kv, meter.kv):
        orig = kv.update

        async def counted(key, change, orig=orig, **kw):
            swaps[0] += 1
            return await orig(key, change, **kw)
        kv.update = counted
    try:
        if batch:
            await meter.apply_many(records(now))
        else:
            for r in records(now):
                await meter.apply(r)
        return await state(buckets, now), swaps[0]
    finally:
        await quotas.close()


async def test_a_batch_meters_like_records_one_by_one_with_fewer_updates():
    now = time.time()
    (one, n_one), (many, n_many) = await metered(False, now), await metered(True, now)
    assert one == many and one["u.acme"]["m@1"]["requests"] == 2 and one["tpm.acme"]
    assert n_one == 6 * 3 and n_many == 1 + 2 + 1  # tpm, two UTC days, usage


async def test_a_batch_of_several_tenants_is_refused():
    meter = UsageMeter(MemoryBuckets())
    await meter.open(consume=False)
    recs = [CompletionRecord("a", "t1", "m", "1", "ok", "stop", 1, 1, {}),
            CompletionRecord("b", "t2", "m", "1", "ok", "stop", 1, 1, {})]
    with pytest.raises(ValueError, match="one tenant"):
        await meter.apply_many(recs)


class _Msg:
    def __init__(self, rec: CompletionRecord) -> None:
        self.data, self.acked = rec.encode(), False

    async def ack(self) -> None:
        self.acked = True


class _Pull:
    """A pull consumer that hands out the given batches, one per fetch, and records when each fetch began."""

    def __init__(self, batches: list[list[_Msg]]) -> None:
        self.batches, self.fetched_at = list(batches), []

    async def fetch(self, batch: int, timeout: float) -> list[_Msg]:
        import asyncio
        self.fetched_at.append(time.monotonic())
        if self.batches:
            return self.batches.pop(0)
        await asyncio.sleep(timeout)
        return []


async def test_hooks_see_applied_records_and_fetches_keep_the_interval():
    """Issue [25] item 2: the gateway's metrics hear the records the meter applied (each once, after its ack);
    after a fetch that brought records the next waits out ``min_interval_s``."""
    import asyncio

    buckets, now = MemoryBuckets(), time.time()
    meter = UsageMeter(buckets, None, min_interval_s=0.3)
    await meter.open(consume=False)
    seen: list[str] = []
    meter.on_records.append(lambda recs: seen.extend(r.request_id for r in recs))
    meter.on_records.append(lambda recs: 1 / 0)  # a failing hook is logged, never stops the meter
    recs = records(now)
    msgs = [_Msg(r) for r in recs]
    meter._sub = _Pull([msgs[:3], msgs[3:]])
    task = asyncio.create_task(meter._consume())
    await asyncio.sleep(0.45)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [r.request_id for r in recs] and all(m.acked for m in msgs)
    t = meter._sub.fetched_at
    assert t[1] - t[0] >= 0.29  # the second fetch waited for the interval
    u = (await (await buckets.bucket(streams.USAGE)).get("u.acme")).value
    assert sum(v["requests"] for v in u.values()) == 5  # choice 1 of a request is not a request of its own
