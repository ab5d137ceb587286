"""The worker splits a reasoning model's thinking out of the engine's text before it parses tool calls
(GenerateRequest.reasoning_parser / reasoning_state; docs/decisions/0044-reasoning-output.md): chunks carry it
in ``Chunk.reasoning``, the usage counts its tokens, tool calls written inside the thinking stay thinking.

The engine replays a fixed text, one piece (one token) per step: the parsing of any split is the subject."""

from __future__ import annotations

import asyncio
import time

from actors.worker.service import WorkerConfig, WorkerService
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import Chunk, Dispatch, DispatchAck, GenerateRequest, SamplingParams
from gateway.merge import ChoiceMerger
from tests.actor.test_worker_tool_calls import ReplayEngine, split
from tests.unit.test_tool_calls import CALL


async def run(pieces: list[str], state: str = "start", parser: str | None = "think_tags",
              tools: str | None = None) -> list[Chunk]:
    bus = MemoryBus()
    chunks: list[Chunk] = []

    async def on_chunk(msg):
        chunks.append(Chunk.decode(msg.data))
    await bus.subscribe("_INBOX.t.r", on_chunk)
    async with WorkerService(bus, ReplayEngine(pieces), WorkerConfig("w1", "m", "1")):
        req = GenerateRequest("r", "t", "m", "1", "_INBOX.t.r", (1, 2, 3), SamplingParams(max_tokens=50),
                              deadline=time.time() + 30, tool_parser=tools, reasoning_parser=parser,
                              reasoning_state=state)
        reply = await bus.request(subjects.work("w1"), Dispatch(req).encode(), 1.0)
        assert DispatchAck.decode(reply.data).accepted
        async with asyncio.timeout(10):
            while not (chunks and chunks[-1].final):
                await asyncio.sleep(0.01)
    return chunks


def message(chunks: list[Chunk]) -> tuple[dict, dict]:
    m = ChoiceMerger("chat", "r", "m@1", {}, {}, 1)
    for c in chunks:
        m.add(c)
    body = m.body()
    return body["choices"][0], body["usage"]


async def test_thinking_is_split_out_and_its_tokens_counted():
    thinking = "<think>\nShould I call it? " + CALL + "\n</think>\n\n"
    text = thinking + "The answer.\n" + CALL
    chunks = await run(split(text, 5), tools="hermes")
    assert "".join(c.reasoning for c in chunks) == "Should I call it? " + CALL  # a call inside stays thinking
    assert "".join(c.text for c in chunks) == "The answer."
    choice, usage = message(chunks)
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
    assert choice["message"]["reasoning_content"] == "Should I call it? " + CALL
    n_think = len(split(thinking.rstrip("\n"), 5))  # every step up to the one that closed the block
    assert usage["completion_tokens_details"] == {"reasoning_tokens": n_think}


async def test_prompt_opened_thinking_and_no_parser():
    chunks = await run(["wa", "it", "</th", "ink>", "\n\n", "ok"], state="reasoning")
    choice, usage = message(chunks)
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == ("wait", "ok")
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 4}
    chunks = await run(["<think>", "x", "</think>", "ok"], parser=None)  # no reasoning format: all content
    choice, usage = message(chunks)
    assert choice["message"]["content"] == "<think>x</think>ok" and "reasoning_content" not in choice["message"]
    assert "completion_tokens_details" not in usage
