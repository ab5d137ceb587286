"""The worker's step loop publishes a step's outputs while the next step computes, on one engine thread
(actors/worker/service.py; docs/decisions/0030-served-vs-offline.md)."""

from __future__ import annotations

import asyncio
import threading
import time

from actors.worker.service import WorkerConfig, WorkerService
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import Chunk, CompletionRecord, Dispatch, DispatchAck, GenerateRequest, SamplingParams
from tests.actor.test_worker_tool_calls import ReplayEngine


class SlowReplay(ReplayEngine):
    """ReplayEngine whose steps take ``step_s`` and log (start time, thread id) of every call."""

    def __init__(self, pieces: list[str], step_s: float) -> None:
        super().__init__(pieces, "length")
        self.step_s, self.calls = step_s, []

    def step(self):
        self.calls.append((time.monotonic(), threading.get_ident()))
        time.sleep(self.step_s)
        return super().step()


class SlowBus(MemoryBus):
    """MemoryBus whose chunk publishes take ``publish_s`` (a slow bus stands for heavy publishing)."""

    def __init__(self, publish_s: float) -> None:
        super().__init__()
        self.publish_s = publish_s

    async def publish(self, subject: str, data: bytes, reply: str = "", headers=None) -> None:
        if subject.startswith("_INBOX.t."):
            await asyncio.sleep(self.publish_s)
        await super().publish(subject, data, reply, headers)


async def _run(engine: SlowReplay, n_requests: int = 1, publish_s: float = 0.0):
    bus = SlowBus(publish_s)
    chunks: dict[str, list[tuple[float, Chunk]]] = {}
    records = []

    async def on_chunk(msg):
        c = Chunk.decode(msg.data)
        chunks.setdefault(c.request_id, []).append((time.monotonic(), c))

    async def on_record(msg):
        records.append(CompletionRecord.decode(msg.data))
    await bus.subscribe("_INBOX.t.>", on_chunk)
    await bus.subscribe(subjects.done("m", "1"), on_record)
    async with WorkerService(bus, engine, WorkerConfig("w1", "m", "1")):
        for i in range(n_requests):
            req = GenerateRequest(f"r{i}", "t", "m", "1", f"_INBOX.t.r{i}", (1, 2, 3), SamplingParams(max_tokens=50),
                                  deadline=time.time() + 30)
            reply = await bus.request(subjects.work("w1"), Dispatch(req).encode(), 1.0)
            assert DispatchAck.decode(reply.data).accepted
        async with asyncio.timeout(10):
            while len(records) < n_requests:
                await asyncio.sleep(0.01)
    return chunks, records


async def test_outputs_of_a_step_are_published_while_the_next_step_runs():
    engine = SlowReplay(["a", "b", "c", "d", "e"], step_s=0.05)
    chunks, records = await _run(engine, publish_s=0.04)
    got = chunks["r0"]
    assert "".join(c.text for _, c in got) == "abcde" and [c.seq for _, c in got] == list(range(5))
    assert got[-1][1].final and got[-1][1].finish_reason == "length" and records[0].status == "ok"
    starts = [t for t, _ in engine.calls]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # serial publishing would space the steps by step_s + publish_s = 90 ms; overlapped, by max(...) = 50 ms
    assert max(gaps) < 0.075, gaps
    assert len({tid for _, tid in engine.calls}) == 1  # every step on the one engine thread


async def test_last_outputs_are_published_when_the_engine_goes_idle():
    engine = SlowReplay(["x", "y"], step_s=0.01)
    chunks, records = await _run(engine, n_requests=3)
    assert sorted(chunks) == ["r0", "r1", "r2"] and len(records) == 3
    for rid, got in chunks.items():
        assert "".join(c.text for _, c in got) == "xy" and got[-1][1].final, rid
