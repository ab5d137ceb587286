"""The zero-compute engine (actors/worker/zero_compute.py) through the worker service on the in-memory bus,
and the worker option that builds it (never chosen unless asked for)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

import pytest

from actors.worker import actor as worker_actor
from actors.worker.engine.types import EngineRequest
from actors.worker.service import WorkerConfig, WorkerService
from actors.worker.zero_compute import ZeroComputeConfig, ZeroComputeEngine, word_cycle
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import Chunk, CompletionRecord, Dispatch, DispatchAck, GenerateRequest, SamplingParams
from tests.engine_fixtures import write_tiny_llama_gguf


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    write_tiny_llama_gguf(p)
    return p


def zc(path: str, **kw) -> ZeroComputeEngine:
    return ZeroComputeEngine(ZeroComputeConfig(path, kv_cache_bytes=2_000_000, max_num_seqs=kw.pop("seqs", 4), **kw))


def gen(rid: str, max_tokens: int = 8, **sp) -> GenerateRequest:
    return GenerateRequest(rid, "t", "m", "1", f"_INBOX.t.{rid}", (5, 6, 7, 8),
                           SamplingParams(max_tokens=max_tokens, temperature=0.8, **sp), deadline=time.time() + 30)


async def serve_one(engine, req: GenerateRequest, decoders: dict, done) -> dict[str, list]:
    """Dispatch ``req`` to a worker service over ``engine``; collect, per subject of ``decoders`` (subject ->
    decode function), the decoded messages, until ``done(collected)`` (5 s at most)."""
    bus = MemoryBus()
    got: dict[str, list] = {s: [] for s in decoders}
    async with WorkerService(bus, engine, WorkerConfig("w1", "m", "1")):
        for subject, decode in decoders.items():
            async def on(msg, subject=subject, decode=decode):
                got[subject].append(decode(msg.data))
            await bus.subscribe(subject, on)
        ack = await bus.request(subjects.work("w1"), Dispatch(req).encode(), 1.0)
        assert DispatchAck.decode(ack.data).accepted
        async with asyncio.timeout(5):
            while not done(got):
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # anything sent after the end would show up here
    return got


async def run_one(engine, req: GenerateRequest) -> tuple[list[Chunk], list[CompletionRecord]]:
    done = subjects.done("m", "1")
    got = await serve_one(engine, req, {req.reply: Chunk.decode, done: CompletionRecord.decode},
                          lambda g: g[req.reply] and g[req.reply][-1].final and g[done])
    return got[req.reply], got[done]


async def test_streams_the_token_cycle_up_to_max_tokens(tiny_path):
    eng = zc(tiny_path)
    chunks, records = await run_one(eng, gen("a", max_tokens=20))
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == [eng.cycle[i % len(eng.cycle)] for i in range(20)]
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 20
    assert "".join(c.text for c in chunks) == b"".join(eng.token_bytes[i] for i in ids).decode()
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert records[0].status == "ok" and records[0].completion_tokens == 20


async def test_the_same_request_gives_the_same_output(tiny_path):
    a, _ = await run_one(zc(tiny_path), gen("a", max_tokens=5))
    b, _ = await run_one(zc(tiny_path), gen("b", max_tokens=5))
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


async def test_eos_stops_unless_ignore_eos(tiny_path):
    chunks, _ = await run_one(zc(tiny_path, eos_after=3), gen("a", max_tokens=10))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage["completion_tokens"] == 3
    chunks, _ = await run_one(zc(tiny_path, eos_after=3), gen("b", max_tokens=10, ignore_eos=True))
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 10


async def test_stop_string_cuts_the_text(tiny_path):
    eng = zc(tiny_path)
    first_two = b"".join(eng.token_bytes[i] for i in eng.cycle[:2]).decode()
    stop = eng.token_bytes[eng.cycle[2]].decode()
    chunks, _ = await run_one(eng, gen("a", max_tokens=10, stop=(stop,)))
    assert chunks[-1].finish_reason == "stop"
    assert "".join(c.text for c in chunks) == first_two


async def test_one_step_batches_every_running_request(tiny_path):
    eng = zc(tiny_path, seqs=4)
    for i in range(3):
        eng.add_request(EngineRequest(f"r{i}", (5, 6, 7), SamplingParams(max_tokens=4)))
    outs = eng.step()
    assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2"]
    assert eng.stats().max_batch_size_seen == 3 and eng.stats().num_prompt_tokens == 9
    eng.abort_request("r1")
    outs = eng.step()
    assert {o.request_id: o.finish_reason for o in outs if o.finished} == {"r1": "abort"}
    assert eng.credits()[1] == 2


def test_grammar_and_bad_prompts_are_refused(tiny_path):
    eng = zc(tiny_path)
    with pytest.raises(ValueError, match="structured outputs"):
        eng.add_request(EngineRequest("g", (5,), SamplingParams(grammar='{"grammars": []}')))
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request(EngineRequest("v", (eng.vocab_size,), SamplingParams()))
    with pytest.raises(ValueError, match="empty"):
        eng.add_request(EngineRequest("e", (), SamplingParams()))


def test_word_cycle_prefers_space_words():
    table = [b"", b"a", b" ab", b"xy", b" cd", b" 12"]
    assert word_cycle(table, 3) == (2, 4, 1)
    with pytest.raises(ValueError):
        word_cycle([b""], 2)


def test_worker_builds_it_only_when_asked(tiny_path):
    parser = argparse.ArgumentParser()
    worker_actor.add_arguments(parser)
    base = ["--model", "m@1", "--kv-cache-bytes", "2000000"]
    assert parser.parse_args(base).engine == "torch"
    args = parser.parse_args(base + ["--engine", "zero-compute"])
    eng = worker_actor.build_engine({"artifact": tiny_path, "format": "gguf"}, args)
    assert isinstance(eng, ZeroComputeEngine) and "NO MODEL COMPUTE" in eng.describe()
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--engine", "zero"])


def test_config_rejects_bad_values(tiny_path):
    with pytest.raises(ValueError, match="max_num_seqs"):
        ZeroComputeConfig(tiny_path, max_num_seqs=0)
    with pytest.raises(ValueError, match="eos_after"):
        dataclasses.replace(ZeroComputeConfig(tiny_path), eos_after=-1)


async def _events_and_frames(engine, req: GenerateRequest) -> tuple[list[dict], list]:
    """The scheduler events and the step frames one request causes (its receiver asks for frames)."""
    import orjson
    from bus.messages import StepFrame

    events, frames = subjects.sched_events("m", "1"), subjects.frames("gw")
    got = await serve_one(engine, req, {events: orjson.loads, frames: StepFrame.decode},
                          lambda g: g[frames] and g[frames][-1].chunks[-1].final)
    return got[events], got[frames]


async def test_first_token_event_only_for_a_request_that_goes_on(tiny_path):
    """Issue [25] item 2: a request that ends in the step of its first token sends no first-token event (its
    completion record, in the same flush, ends it at the scheduler); one that goes on sends exactly one.
    Both stream through step frames when the receiver asked for them."""
    one = dataclasses.replace(gen("one", max_tokens=1), frames=subjects.frames("gw"))
    events, frames = await _events_and_frames(zc(tiny_path), one)
    assert events == [] and [c.final for f in frames for c in f.chunks] == [True]
    many = dataclasses.replace(gen("many", max_tokens=4), frames=subjects.frames("gw"))
    events, frames = await _events_and_frames(zc(tiny_path), many)
    assert events == [{"request_id": "many", "event": "first_token"}]
    assert [c.seq for f in frames for c in f.chunks] == list(range(4))
