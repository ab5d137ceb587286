"""Worker actor logic on the in-memory bus with the real engine on the tiny GGUF model."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from actors.worker.engine.engine import EngineConfig, LLMEngine
from actors.worker.engine.types import EngineStats
from actors.worker.live import Live
from actors.worker.service import WorkerConfig, WorkerService
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import (Cancel, Chunk, CompletionRecord, Credits, Dispatch, DispatchAck, GenerateRequest,
                          SamplingParams)
from tests.engine_fixtures import write_tiny_llama_gguf
from tests.actor.test_worker_tool_calls import ReplayEngine


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    write_tiny_llama_gguf(p)
    return p


def engine(path: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=path, kv_cache_bytes=2_000_000, max_num_seqs=4, progress=False))


def gen(rid: str, max_tokens: int = 8, deadline: float = 0.0) -> GenerateRequest:
    return GenerateRequest(rid, "t", "m", "1", f"_INBOX.t.{rid}", (5, 6, 7, 8),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           deadline=deadline or time.time() + 30)


async def dispatch(bus, r: GenerateRequest) -> bool:
    reply = await bus.request(subjects.work("w1"), Dispatch(r).encode(), 1.0)
    return DispatchAck.decode(reply.data).accepted


async def collect(bus, subject: str, decoder=Chunk) -> list:
    got = []

    async def on(msg):
        got.append(decoder.decode(msg.data))
    await bus.subscribe(subject, on)
    return got


async def wait_final(chunks: list, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not (chunks and chunks[-1].final):
            await asyncio.sleep(0.01)


async def test_streams_ordered_chunks_and_a_completion_record(tiny_path):
    bus = MemoryBus()
    async with WorkerService(bus, engine(tiny_path), WorkerConfig("w1", "m", "1")):
        chunks = await collect(bus, "_INBOX.t.a")
        records = await collect(bus, subjects.done("m", "1"), CompletionRecord)
        assert await dispatch(bus, gen("a", max_tokens=8))
        await wait_final(chunks)
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert sum(len(c.token_ids) for c in chunks) == 8
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 8
        assert set(chunks[-1].timing) >= {"queue_ms", "prefill_ms", "decode_ms"}
        await asyncio.sleep(0.05)
        assert [r.request_id for r in records] == ["a"] and records[0].status == "ok"


async def test_chunks_and_record_carry_the_choice_index(tiny_path):
    bus = MemoryBus()
    async with WorkerService(bus, engine(tiny_path), WorkerConfig("w1", "m", "1")):
        chunks = await collect(bus, "_INBOX.t.a-3")
        records = await collect(bus, subjects.done("m", "1"), CompletionRecord)
        assert await dispatch(bus, dataclasses.replace(gen("a-3", max_tokens=3), choice_index=3))
        await wait_final(chunks)
        assert chunks and all(c.choice_index == 3 for c in chunks)
        await asyncio.sleep(0.05)
        assert [r.choice_index for r in records] == [3]


async def test_cancel_ends_request_within_a_step(tiny_path):
    bus = MemoryBus()
    svc = WorkerService(bus, engine(tiny_path), WorkerConfig("w1", "m", "1"))
    async with svc:
        chunks = await collect(bus, "_INBOX.t.c")
        assert await dispatch(bus, gen("c", max_tokens=400))
        async with asyncio.timeout(10):
            while not chunks:
                await asyncio.sleep(0.005)
        steps_at_cancel = svc.engine.stats().num_steps
        await bus.publish(subjects.cancel("c"), Cancel("c").encode())
        await wait_final(chunks)
        assert chunks[-1].error["code"] == "cancelled"
        assert svc.engine.stats().num_steps - steps_at_cancel <= 2
        assert not svc.live and svc.engine.credits()[0] == svc.engine.stats().num_total_blocks


async def test_cancel_heard_during_the_step_that_finishes_the_request_ends_it_cancelled(tiny_path):
    """A cancel that arrives while the step finishing the request runs (e.g. a long prefill that samples
    EOS) wins: the gone client's request ends "cancelled" and counts as aborted, not "ok"."""
    import threading
    bus = MemoryBus()
    svc = WorkerService(bus, engine(tiny_path), WorkerConfig("w1", "m", "1"))
    in_step, step = threading.Event(), svc.engine.step

    def slow_step():
        in_step.set()
        time.sleep(0.3)
        return step()
    svc.engine.step = slow_step
    async with svc:
        chunks = await collect(bus, "_INBOX.t.s")
        records = await collect(bus, subjects.done("m", "1"), CompletionRecord)
        assert await dispatch(bus, gen("s", max_tokens=1))  # its first step is its last
        async with asyncio.timeout(10):
            while not in_step.is_set():
                await asyncio.sleep(0.005)
        await bus.publish(subjects.cancel("s"), Cancel("s", "disconnect").encode())
        await wait_final(chunks)
        assert [c.error["code"] for c in chunks] == ["cancelled"]
        await asyncio.sleep(0.05)
        assert [r.status for r in records] == ["cancelled"] and records[0].completion_tokens == 1
        assert svc.num_aborted == 1 and svc.num_finished == 1 and svc.max_cancel_steps <= 2
        assert not svc.live and svc.engine.credits()[0] == svc.engine.stats().num_total_blocks


async def test_cancel_heard_before_the_dispatch_ends_the_request_unrun(tiny_path):
    """A cancel that overtakes the dispatch (different publishers) is remembered for the dispatch."""
    bus = MemoryBus()
    svc = WorkerService(bus, engine(tiny_path), WorkerConfig("w1", "m", "1"))
    async with svc:
        chunks = await collect(bus, "_INBOX.t.e")
        await bus.publish(subjects.cancel("e"), Cancel("e", "disconnect").encode())
        assert await dispatch(bus, gen("e", max_tokens=400))
        await wait_final(chunks)
        assert [c.error["code"] for c in chunks] == ["cancelled"]
        assert svc.num_aborted == 1 and svc.engine.stats().num_prompt_tokens == 0 and not svc.live


def slowed(eng: LLMEngine, step_s: float) -> LLMEngine:
    """``eng`` whose every step takes at least ``step_s`` more seconds: keeps requests running for a check
    however fast this CPU decodes (CI saw 200 tokens x 4 sequences end in under 0.2 s)."""
    step = eng.step

    def slow_step():
        time.sleep(step_s)
        return step()
    eng.step = slow_step
    return eng


async def test_refuses_beyond_credits_and_when_draining(tiny_path):
    bus = MemoryBus()
    svc = WorkerService(bus, slowed(engine(tiny_path), 0.01), WorkerConfig("w1", "m", "1"))
    async with svc:
        results = [await dispatch(bus, gen(f"r{i}", max_tokens=200)) for i in range(6)]
        assert results == [True] * 4 + [False] * 2  # max_num_seqs = 4
        credits = await collect(bus, subjects.credits("m", "1", "w1"), Credits)
        await asyncio.sleep(0.4)
        assert credits and credits[-1].free_slots == 0
        for i in range(4):
            await bus.publish(subjects.cancel(f"r{i}"), Cancel(f"r{i}").encode())
        svc.draining = True
        await asyncio.sleep(0.2)
        assert not await dispatch(bus, gen("late"))


async def test_deadline_aborts_with_retryable_error(tiny_path):
    bus = MemoryBus()
    async with WorkerService(bus, engine(tiny_path), WorkerConfig("w1", "m", "1")):
        chunks = await collect(bus, "_INBOX.t.d")
        assert await dispatch(bus, gen("d", max_tokens=100000 // 200, deadline=time.time() + 0.05))
        await wait_final(chunks)
        err = chunks[-1].error
        assert err and err["code"] == "deadline_exceeded" and err["retryable"]


async def test_stream_without_receiver_is_aborted(tiny_path):
    bus = MemoryBus()
    svc = WorkerService(bus, engine(tiny_path), WorkerConfig("w1", "m", "1", probe_interval_s=0.2))
    async with svc:
        records = await collect(bus, subjects.done("m", "1"), CompletionRecord)

        async def alive(msg):
            if msg.reply:
                await msg.respond(b'{"alive":true}')
        await bus.subscribe("_INBOX.t.kept", alive)
        assert await dispatch(bus, gen("gone", max_tokens=400))  # nobody subscribes to _INBOX.t.gone
        assert await dispatch(bus, gen("kept", max_tokens=400))
        async with asyncio.timeout(10):
            while not any(r.request_id == "gone" for r in records):
                await asyncio.sleep(0.05)
        assert [r.status for r in records if r.request_id == "gone"] == ["cancelled"]
        assert "kept" in svc.live  # a receiver that answers keeps its stream


async def test_engine_failure_ends_the_batch_and_the_worker_goes_on(tiny_path, monkeypatch):
    bus = MemoryBus()
    svc = WorkerService(bus, engine(tiny_path), WorkerConfig("w1", "m", "1"))
    async with svc:
        chunks = await collect(bus, "_INBOX.t.bad")
        real_step = svc.engine.step
        calls = {"n": 0}

        def failing_step():
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom")
            return real_step()
        monkeypatch.setattr(svc.engine, "step", failing_step)
        assert await dispatch(bus, gen("bad", max_tokens=50))
        await wait_final(chunks)
        assert chunks[-1].error["status"] == 500 and chunks[-1].error["retryable"]
        later = await collect(bus, "_INBOX.t.good")
        assert await dispatch(bus, gen("good", max_tokens=4))
        await wait_final(later)
        assert later[-1].finish_reason == "length" and not later[-1].error


def test_tiny_top_p_keeps_the_top_token():
    import torch
    from actors.worker.engine.sampler import make_generator, sample_batch
    from actors.worker.engine.types import SamplingParams
    logits = torch.randn(1, 300)
    [tok] = sample_batch(logits, [SamplingParams(top_p=4.6e-284, temperature=2.0)], [make_generator(1)])
    assert tok == int(torch.argmax(logits[0]))


async def test_cancel_from_another_tenant_is_ignored(tiny_path):
    bus = MemoryBus()
    svc = WorkerService(bus, engine(tiny_path), WorkerConfig("w1", "m", "1"))
    async with svc:
        chunks = await collect(bus, "_INBOX.t.x")
        assert await dispatch(bus, gen("x", max_tokens=60))  # tenant "t"
        await bus.publish(subjects.cancel("x"), Cancel("x", "client", tenant="intruder").encode())
        await wait_final(chunks)
        assert chunks[-1].finish_reason == "length" and not chunks[-1].error


async def test_credits_carry_the_slot_and_block_totals(tiny_path):
    bus = MemoryBus()
    svc = WorkerService(bus, engine(tiny_path), WorkerConfig("w1", "m", "1"))
    async with svc:
        credits = await collect(bus, subjects.credits("m", "1", "w1"), Credits)
        async with asyncio.timeout(5):
            while not credits:
                await asyncio.sleep(0.05)
        c = credits[-1]
        assert c.total_slots == 4 and c.free_slots == 4  # max_num_seqs of the engine (the scheduler's caps use it)
        assert c.block_size == svc.engine.config.block_size and c.total_blocks == svc.engine.stats().num_total_blocks


class RecordingEngine(ReplayEngine):
    """ReplayEngine that records the EngineRequests it is given and reports set speed and service counters."""

    def __init__(self) -> None:
        super().__init__(["x"] * 3)
        self.added, self.served = [], {}

    def add_request(self, req, front: bool = False) -> None:
        self.added.append(req)
        super().add_request(req, front)

    def stats(self) -> EngineStats:
        return EngineStats(num_total_blocks=100, num_free_blocks=100, step_ms=31.25, prefill_tokens_per_s=2000.0,
                           served={t: list(c) for t, c in self.served.items()})


async def test_urgent_dispatch_reaches_the_engine_with_priority_and_tenant():
    bus = MemoryBus()
    eng = RecordingEngine()
    async with WorkerService(bus, eng, WorkerConfig("w1", "m", "1")):
        chunks = await collect(bus, "_INBOX.t.u")
        r = dataclasses.replace(gen("u"), priority="batch")
        reply = await bus.request(subjects.work("w1"), Dispatch(r, urgent=True).encode(), 1.0)
        assert DispatchAck.decode(reply.data).accepted
        assert await dispatch(bus, gen("o"))
        await wait_final(chunks)
    (u, o) = eng.added
    assert (u.urgent, u.priority, u.tenant) == (True, "batch", "t") and (o.urgent, o.priority) == (False, "interactive")


def test_batch_newcomer_never_displaces_an_interactive_request():
    svc = WorkerService(MemoryBus(), RecordingEngine(), WorkerConfig("w1", "m", "1"))
    for rid, prio in (("vi", "interactive"), ("vb", "batch")):
        svc.live[rid] = Live(dataclasses.replace(gen(rid), priority=prio), time.time())
        svc.engine.reqs[rid] = 0  # running in the engine
    assert not svc.can_preempt("vi", "batch") and svc.can_preempt("vi", "interactive")
    assert svc.can_preempt("vb", "batch") and svc.can_preempt("vb", "interactive")


def test_credits_carry_speed_and_the_tokens_served_since_the_previous_heartbeat():
    eng = RecordingEngine()
    svc = WorkerService(MemoryBus(), eng, WorkerConfig("w1", "m", "1"))
    eng.served = {"a": [40, 3], "b": [10, 0]}
    c = svc.credits_msg()
    assert (c.step_ms, c.prefill_tokens_per_s, c.served) == (31.25, 2000.0, {"a": [40, 3], "b": [10, 0]})
    svc._host_ms = 2.5  # the step loop's own time per step (EWMA), on top of the engine's step time
    assert svc.credits_msg().step_ms == 33.75
    eng.served = {"a": [40, 7], "b": [10, 0], "c": [5, 1]}
    assert svc.credits_msg().served == {"a": [0, 4], "c": [5, 1]}  # only what changed
    assert svc.credits_msg().served == {}
