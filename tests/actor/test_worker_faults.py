"""Test-only fault injection of the worker (actors/worker/faults.py) on the in-memory bus, tiny GGUF engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.worker.engine.engine import EngineConfig, LLMEngine
from actors.worker.faults import FAULT_CODE, FaultInjector, from_manifest
from actors.worker.service import WorkerConfig, WorkerService
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import Chunk, CompletionRecord, Dispatch, DispatchAck, GenerateRequest, SamplingParams
from tests.engine_fixtures import write_tiny_llama_gguf

ON = {"ACTORSERVE_TEST_FAULTS": "1"}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("tiny-faults") / "tiny.gguf")
    write_tiny_llama_gguf(p)
    return p


def engine(path: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=path, kv_cache_bytes=2_000_000, max_num_seqs=32, progress=False))


def gen(rid: str, max_tokens: int = 3) -> GenerateRequest:
    return GenerateRequest(rid, "t", "m", "2", f"_INBOX.t.{rid}", (5, 6, 7, 8),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           deadline=time.time() + 30)


async def dispatch(bus, r: GenerateRequest) -> bool:
    reply = await bus.request(subjects.work("w1"), Dispatch(r).encode(), 1.0)
    return DispatchAck.decode(reply.data).accepted


async def collect(bus, subject: str, decoder=Chunk, stamps: list | None = None) -> list:
    got = []

    async def on(msg):
        got.append(decoder.decode(msg.data))
        if stamps is not None:
            stamps.append(time.monotonic())
    await bus.subscribe(subject, on)
    return got


async def wait_for(cond, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


def test_faults_need_the_environment_switch():
    manifest = {"artifact": "x", "test_faults": {"error_rate": 0.5, "ttft_delay_ms": 10}}
    assert from_manifest(manifest, env={}) is None
    assert from_manifest(manifest, env={"ACTORSERVE_TEST_FAULTS": "0"}) is None
    inj = from_manifest(manifest, env=ON)
    assert (inj.error_rate, inj.ttft_delay_ms, inj.seed) == (0.5, 10, 0)
    assert from_manifest({"artifact": "x"}, env=ON) is None
    assert from_manifest({"test_faults": {"error_rate": 0}}, env=ON) is None
    with pytest.raises(ValueError, match="error_rate"):
        from_manifest({"test_faults": {"error_rate": 1.5}}, env=ON)
    with pytest.raises(ValueError, match="unknown"):
        from_manifest({"test_faults": {"error_rat": 0.5}}, env=ON)
    with pytest.raises(ValueError, match="ttft_delay_ms"):
        FaultInjector(ttft_delay_ms=-1)


def test_error_draws_are_seeded():
    a, b = FaultInjector(error_rate=0.3, seed=7), FaultInjector(error_rate=0.3, seed=7)
    draws = [a.should_fail() for _ in range(1000)]
    assert draws == [b.should_fail() for _ in range(1000)]
    assert 250 < sum(draws) < 350 and a.injected_errors == sum(draws)


async def test_error_rate_fails_that_share_with_a_retryable_500_and_error_records(tiny_path):
    bus = MemoryBus()
    inj = FaultInjector(error_rate=0.5, seed=3)
    twin = FaultInjector(error_rate=0.5, seed=3)
    expected = [twin.should_fail() for _ in range(20)]
    async with WorkerService(bus, engine(tiny_path), WorkerConfig("w1", "m", "2"), faults=inj):
        records = await collect(bus, subjects.done("m", "2"), CompletionRecord)
        finals: dict[str, Chunk] = {}

        async def on_chunk(msg):
            c = Chunk.decode(msg.data)
            if c.final:
                finals[c.request_id] = c
        await bus.subscribe("_INBOX.t.*", on_chunk)
        for i in range(20):
            assert await dispatch(bus, gen(f"r{i}"))
        await wait_for(lambda: len(records) == 20 and len(finals) == 20)
    status = {r.request_id: r.status for r in records}
    assert [status[f"r{i}"] == "error" for i in range(20)] == expected, (status, expected)
    assert 0 < sum(expected) < 20
    for i, failing in enumerate(expected):
        c = finals[f"r{i}"]
        if failing:
            assert c.error["status"] == 500 and c.error["code"] == FAULT_CODE and c.error["retryable"]
            assert c.model == "m@2"
        else:
            assert c.error is None and c.usage["completion_tokens"] == 3
    assert inj.injected_errors == sum(expected)


async def test_ttft_delay_holds_the_first_token_without_blocking_other_requests(tiny_path):
    bus = MemoryBus()
    svc = WorkerService(bus, engine(tiny_path), WorkerConfig("w1", "m", "2"))
    async with svc:
        x_times: list[float] = []
        x = await collect(bus, "_INBOX.t.x", stamps=x_times)
        y_times: list[float] = []
        y = await collect(bus, "_INBOX.t.y", stamps=y_times)
        assert await dispatch(bus, gen("x", max_tokens=400))
        await wait_for(lambda: bool(x))
        svc.faults = FaultInjector(ttft_delay_ms=300)  # from now on requests are held 300 ms
        t_y = time.monotonic()
        assert await dispatch(bus, gen("y", max_tokens=3))
        await wait_for(lambda: bool(y) and y[-1].final)
        assert y_times[0] - t_y >= 0.3  # y's first token came after the delay
        assert y[-1].timing["prefill_ms"] >= 300 and y[-1].error is None
        # x kept streaming while y was held: the engine loop did not wait for the delay
        assert any(t_y < t < t_y + 0.3 for t in x_times) or (x[-1].final and x_times[-1] < t_y + 0.3)
        # a request cancelled during its delay never reaches the engine and ends "cancelled"
        records = await collect(bus, subjects.done("m", "2"), CompletionRecord)
        z = await collect(bus, "_INBOX.t.z")
        assert await dispatch(bus, gen("z", max_tokens=3))
        from bus.messages import Cancel
        await bus.publish(subjects.cancel("z"), Cancel("z").encode())
        await wait_for(lambda: bool(z) and z[-1].final)
        assert z[-1].error["code"] == "cancelled"
        await asyncio.sleep(0.4)  # past the delay: nothing more for z
        assert [c.final for c in z] == [True]
        assert [r.status for r in records if r.request_id == "z"] == ["cancelled"]
        await bus.publish(subjects.cancel("x"), Cancel("x").encode())
