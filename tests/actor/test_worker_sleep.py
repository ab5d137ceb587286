"""A worker sleeps and wakes (issue [28], actors/worker/sleep.py): the KV cache is freed and the resident memory
falls by at least its bytes, no work is taken while asleep (credits say so), and after a wake the worker serves
again with the same outputs. One worker on the in-memory bus with a real engine (tiny model, 96 MB KV cache so the
drop is well above the allocator's noise); the live path through etcd and the scheduler is tests/e2e/test_sleep.py.
"""

from __future__ import annotations

import asyncio

import pytest

from actors.worker.engine.engine import EngineConfig, LLMEngine
from actors.worker.service import WorkerConfig, WorkerService
from actors.worker.sleep import SleepControl, parse_command, rss_bytes
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import Credits
from tests.actor.test_worker_service import collect, dispatch, gen, tiny_path, wait_final  # noqa: F401 (fixture)

KV_BYTES = 96 * 1024 * 1024


def _engine(path: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=path, kv_cache_bytes=KV_BYTES, max_num_seqs=4, progress=False))


async def _until(check, timeout: float = 2.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


async def _run(bus, rid: str) -> list[int]:
    chunks = await collect(bus, f"_INBOX.t.{rid}")
    assert await dispatch(bus, gen(rid))
    await wait_final(chunks)
    return [t for c in chunks for t in c.token_ids]


async def test_sleep_frees_the_kv_cache_and_wake_serves_again(tiny_path):
    bus = MemoryBus()
    svc = WorkerService(bus, _engine(tiny_path), WorkerConfig("w1", "m", "1"))
    credits = await collect(bus, subjects.credits("m", "1", "w1"), Credits)
    changes = []

    async def on_change(state):
        changes.append(state.record())
    async with svc:
        before = await _run(bus, "a")
        ctl = SleepControl(svc, on_change, drain_s=5.0)
        kv = svc.engine.kv.num_blocks * svc.engine.kv.block_bytes
        assert ctl.state.kv_bytes == kv >= KV_BYTES - svc.engine.kv.block_bytes
        rss = rss_bytes()
        await ctl.apply("sleep")
        assert svc.sleeping and changes[-1]["state"] == "sleeping" and svc.engine.kv.num_blocks == 1
        assert rss - rss_bytes() >= 0.9 * kv, (rss, rss_bytes(), kv)  # the resident memory fell by the cache
        assert ctl.state.freed_bytes >= 0.9 * kv
        blocks = kv // svc.engine.kv.block_bytes  # what it holds awake: the prompt bound schedulers check
        await _until(lambda: credits[-1].sleeping and credits[-1].draining and credits[-1].total_blocks == blocks)
        assert not await dispatch(bus, gen("refused"))  # asleep: no work
        await ctl.apply("sleep")  # a second sleep does nothing
        assert len(changes) == 1
        await ctl.apply("wake")
        assert not svc.sleeping and changes[-1]["state"] == "running" and changes[-1]["wakes"] == 1
        assert svc.engine.kv.num_blocks * svc.engine.kv.block_bytes == kv
        assert ctl.state.wake_s < 2.0
        await _until(lambda: not credits[-1].sleeping and not credits[-1].draining)
        assert await _run(bus, "b") == before  # same greedy outputs after the cache was re-made


async def test_a_busy_worker_sleeps_once_its_requests_have_finished(tiny_path):
    bus = MemoryBus()
    svc = WorkerService(bus, _engine(tiny_path), WorkerConfig("w1", "m", "1"))
    async with svc:
        chunks = await collect(bus, "_INBOX.t.long")
        assert await dispatch(bus, gen("long", max_tokens=48))
        ctl = SleepControl(svc, drain_s=30.0)
        await asyncio.sleep(0.05)
        await ctl.apply("sleep")
        assert chunks and chunks[-1].final and chunks[-1].finish_reason == "length"  # finished, not cut
        assert ctl.state.state == "sleeping" and not svc.live


def test_commands_are_checked():
    assert parse_command({"want": "wake", "by": "scheduler"}) == "wake"
    for bad in (None, {}, {"want": "nap"}, "sleep"):
        with pytest.raises(ValueError):
            parse_command(bad)
