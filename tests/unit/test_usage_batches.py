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
