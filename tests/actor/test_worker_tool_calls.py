"""The worker parses tool calls out of the engine's text (GenerateRequest.tool_parser) and the gateway's
merger renders them: the streamed deltas join into the non-streamed message (docs/tools.md).

The engine here replays a fixed text, one piece per step (what a model writes is not the subject: the
parsing of any split of it is): it has the LLMEngine interface the worker shell drives."""

from __future__ import annotations

import asyncio
import json
import time

from actors.worker.engine.types import EngineStats, StepOutput
from actors.worker.service import WorkerConfig, WorkerService
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import Chunk, CompletionRecord, Dispatch, DispatchAck, GenerateRequest, SamplingParams
from gateway.merge import ChoiceMerger
from tests.unit.test_tool_calls import CALL, CALL2


class ReplayEngine:
    """Emits ``pieces`` of text for every request, one per step, then finishes with ``reason``."""

    max_num_seqs, block_size = 4, 16

    def __init__(self, pieces: list[str], reason: str = "stop") -> None:
        self.pieces, self.reason, self.reqs = pieces, reason, {}

    def add_request(self, req, front: bool = False) -> None:
        self.reqs[req.request_id] = 0

    def abort_request(self, rid: str) -> None:
        self.reqs.pop(rid, None)

    def preempt_request(self, rid: str) -> bool:
        return False

    def has_request(self, rid: str) -> bool:
        return rid in self.reqs

    def is_running(self, rid: str) -> bool:
        return rid in self.reqs

    def has_unfinished(self) -> bool:
        return bool(self.reqs)

    def credits(self) -> tuple[int, int]:
        return 100, self.max_num_seqs - len(self.reqs)

    def stats(self) -> EngineStats:
        return EngineStats(num_total_blocks=100, num_free_blocks=100)

    def step(self) -> list[StepOutput]:
        outs = []
        for rid, k in list(self.reqs.items()):
            done = k + 1 == len(self.pieces)
            outs.append(StepOutput(rid, (k + 10,), self.pieces[k], done, self.reason if done else None, 3, k + 1))
            self.reqs[rid] = k + 1
            if done:
                del self.reqs[rid]
        return outs


async def run(pieces: list[str], parser: str | None = "hermes", parallel: bool = True, reason: str = "stop",
              forced: bool = False):
    bus = MemoryBus()
    chunks, records = [], []

    async def on_chunk(msg):
        chunks.append(Chunk.decode(msg.data))

    async def on_record(msg):
        records.append(CompletionRecord.decode(msg.data))
    await bus.subscribe("_INBOX.t.r", on_chunk)
    await bus.subscribe(subjects.done("m", "1"), on_record)
    async with WorkerService(bus, ReplayEngine(pieces, reason), WorkerConfig("w1", "m", "1")):
        req = GenerateRequest("r", "t", "m", "1", "_INBOX.t.r", (1, 2, 3), SamplingParams(max_tokens=50),
                              deadline=time.time() + 30, tool_parser=parser, parallel_tool_calls=parallel,
                              tool_calls_forced=forced)
        reply = await bus.request(subjects.work("w1"), Dispatch(req).encode(), 1.0)
        assert DispatchAck.decode(reply.data).accepted
        async with asyncio.timeout(10):
            while not (chunks and chunks[-1].final):
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
    return chunks, records


def merged(chunks: list[Chunk]) -> tuple[list[dict], dict]:
    m = ChoiceMerger("chat", "r", "m@1", {}, {}, 1)
    events = [e for c in chunks for e in m.add(c)]
    return events, m.body()["choices"][0]


def split(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


async def test_calls_are_parsed_in_the_worker_and_the_stream_joins_into_the_message():
    text = "Checking.\n" + CALL + "\n" + CALL2
    chunks, records = await run(split(text, 7))
    assert "".join(c.text for c in chunks) == "Checking."  # the calls' text is not content
    assert chunks[-1].finish_reason == "tool_calls" and records[0].finish_reason == "tool_calls"
    assert records[0].tool_calls == 2
    events, choice = merged(chunks)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]
    deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", ())]
    joined: dict[int, dict] = {}
    for d in deltas:
        j = joined.setdefault(d["index"], {"id": d.get("id"), "name": d["function"].get("name"), "arguments": ""})
        j["arguments"] += d["function"]["arguments"]
    assert [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in calls] == [joined[i] for i in sorted(joined)]


async def test_only_calls_give_null_content_and_parallel_false_keeps_one():
    chunks, records = await run(split(CALL + "\n" + CALL2, 5), parallel=False)
    _, choice = merged(chunks)
    assert choice["message"]["content"] is None and len(choice["message"]["tool_calls"]) == 1
    assert records[0].tool_calls == 1


async def test_without_a_parser_the_text_is_untouched_and_length_stays_length():
    chunks, _ = await run(split(CALL, 9), parser=None)
    assert "".join(c.text for c in chunks) == CALL and not any(c.tool_calls for c in chunks)
    assert chunks[-1].finish_reason == "stop"
    chunks, _ = await run(split(CALL + "\n" + CALL2[:20], 9), reason="length")
    _, choice = merged(chunks)
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "\n" + CALL2[:20]  # as written
    assert len(choice["message"]["tool_calls"]) == 1


async def test_forced_calls_stream_arguments_as_generated():
    chunks, _ = await run(split(CALL, 6), parallel=False, forced=True)
    pieces = [d["function"]["arguments"] for c in chunks for d in c.tool_calls if "id" not in d]
    assert len(pieces) > 3 and json.loads("".join(pieces)) == {"city": "Paris", "unit": "celsius"}
    events, choice = merged(chunks)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == "".join(pieces)
