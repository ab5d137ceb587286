"""What only the in-memory twin of bus/kv.py can show fast (TTL on a fake clock, timeouts, lock
bookkeeping), and the KV-backed stores (quotas, usage, jobs) running on it. The shared contract of
both implementations is tests/integration/test_kv_contract.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors import job_store as jobs
from bus.kv import KvConflict, MemoryBuckets, MemoryKV
from bus.messages import CompletionRecord
from bus.streams import BucketConfig
from control.state.tenants import Tenant
from gateway.openai_format import ApiError
from gateway.quotas import SLOT_TTL_S, QuotaStore
from gateway.usage import UsageMeter


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def test_bucket_ttl_expires_values_after_their_last_write():
    clock = Clock()
    kv = await MemoryBuckets(clock).bucket(BucketConfig("ttl", ttl_s=10.0))
    await kv.put("a", 1)
    clock.t = 6.0
    await kv.put("b", 2)
    clock.t = 10.0
    assert await kv.get("a") is None and (await kv.get("b")).value == 2
    assert [e.key for e in await kv.values()] == ["b"]
    await kv.create("a", 3)  # an expired key is free again
    clock.t = 16.0
    assert await kv.get("b") is None and await kv.history("b") == []


async def test_handles_share_data_and_buckets_keep_their_first_config():
    buckets = MemoryBuckets()
    a = await buckets.bucket(BucketConfig("shared", history=2))
    b = await buckets.bucket(BucketConfig("shared", history=5))
    await a.put("k", 1)
    with pytest.raises(KvConflict):
        await b.create("k", 2)
    assert b.config.history == 2 and a is not b


async def test_every_call_is_bounded_by_the_timeout():
    class Slow(MemoryKV):
        async def _entry(self, key):
            await asyncio.sleep(1.0)
    kv = Slow((await MemoryBuckets().bucket(BucketConfig("slow")))._b, timeout=0.05)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        await kv.get("k")
    with pytest.raises(TimeoutError):
        await kv.update("k", lambda v: 1)
    assert time.monotonic() - t0 < 0.5


async def test_update_locks_are_dropped_when_idle():
    kv = await MemoryBuckets().bucket(BucketConfig("locks"))
    await asyncio.gather(*(kv.update(f"k{i % 3}", lambda v: (v or 0) + 1) for i in range(30)))
    assert [(await kv.get(f"k{i}")).value for i in range(3)] == [10, 10, 10]
    assert kv._locks == {}


# -- the stores on the twin ------------------------------------------------------------------------

async def test_quota_store_on_the_twin_two_replicas_share_limits():
    buckets = MemoryBuckets()
    gws = [QuotaStore(buckets), QuotaStore(buckets)]
    for g in gws:
        await g.open()
    tenant = Tenant.from_record("acme", {"quotas": {"rpm": 3, "concurrency": 2}})
    try:
        a1 = await gws[0].admit(tenant, "r1", now=1000.0)
        await gws[1].admit(tenant, "r2", now=1000.0)
        with pytest.raises(ApiError, match="concurrent"):
            await gws[1].admit(tenant, "r3", now=1000.0)
        await gws[0].release(a1)
        a3 = await gws[1].admit(tenant, "r3", now=1000.5)
        assert a3.headers["x-ratelimit-remaining-requests"] == "0"
        await gws[1].release(a3)
        with pytest.raises(ApiError, match="requests per minute") as ei:
            await gws[0].admit(tenant, "r4", now=1001.0)
        assert ei.value.headers["x-ratelimit-reset-requests"] == "59s"
        await gws[0].admit(tenant, "r5", now=1000.0 + 60 + SLOT_TTL_S)  # window moved, r2's slot lapsed
    finally:
        for g in gws:
            await g.close()


async def test_usage_meter_applies_records_and_charges_tokens():
    buckets = MemoryBuckets()
    quotas = QuotaStore(buckets)
    await quotas.open()
    meter = UsageMeter(buckets, quotas)
    await meter.open(consume=False)
    try:
        now = time.time()
        for i, rid in enumerate(("a", "a", "b")):
            await meter.apply(CompletionRecord(rid, "acme", "m", "1", "ok", "stop", 10, 5, {}, ts=now,
                                               choice_index=i % 2 if rid == "a" else 0))
        await meter.apply(CompletionRecord("x", "", "m", "1", "ok", "stop", 10, 5, {}))  # no tenant: ignored
        rows = await meter.usage("acme")
        assert [(r["model"], r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == \
            [("m@1", 2, 20, 15)]
        tenant = Tenant.from_record("acme", {"quotas": {"tpm": 35}})
        with pytest.raises(ApiError, match="tokens per minute"):
            await quotas.admit(tenant, "next", now=now)
    finally:
        await quotas.close()


async def test_job_record_updates_on_the_twin():
    kv = await MemoryBuckets().bucket(BucketConfig("jobs"))
    assert await jobs.update_job(kv, "t", "job_1", lambda r: {**r, "status": "x"}) is None  # never created
    await kv.create(jobs.job_key("t", "job_1"), {"id": "job_1", "status": "validating", "expires_at": 1e12})
    rec = await jobs.update_job(kv, "t", "job_1", lambda r: jobs.begin(r, 5.0))
    assert rec["status"] == "in_progress" and "updated_at" in rec
    assert (await jobs.read_job(kv, "t", "job_1"))[0] == rec
    assert await jobs.update_job(kv, "t", "job_1", jobs.finalizing) == {**rec, "status": "finalizing",
                                                                        "updated_at": pytest.approx(time.time(), abs=5)}
    assert (await jobs.update_job(kv, "t", "job_1", jobs.finalizing))["status"] == "finalizing"  # no change
