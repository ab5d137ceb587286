"""Validator service on the in-memory bus: the SamplingParams it hands the scheduler (request > manifest
default > server default), choice ids / indexes / seeds of a fanned-out request, invalid stored defaults."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.validator.service import ValidatorService
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import ApiRequest, Chunk, GenerateRequest
from tests.engine_fixtures import write_tiny_llama_gguf


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama_gguf(str(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


class Registry:
    """The one registry call the validator makes."""

    def __init__(self, manifest: dict) -> None:
        self.manifest = manifest

    async def get_model_version(self, name: str, version: str) -> dict | None:
        return self.manifest if (name, version) == ("m", "1") else None


async def validate(manifest: dict, body: dict, endpoint: str = "chat") -> tuple[list[GenerateRequest], list[Chunk]]:
    """Send one ApiRequest through a ValidatorService; return what reached the scheduler and the reply chunks."""
    bus = MemoryBus()
    svc = ValidatorService(bus, Registry(manifest))
    await svc.start()
    submitted: list[GenerateRequest] = []
    chunks: list[Chunk] = []

    async def scheduler(msg):
        submitted.append(GenerateRequest.decode(msg.data))
        await msg.respond(b'{"accepted":true}')

    async def reply(msg):
        chunks.append(Chunk.decode(msg.data))
    await bus.subscribe(subjects.sched_submit("m", "1"), scheduler)
    await bus.subscribe("_INBOX.t.r", reply)
    req = ApiRequest("r", "t", "m", "m", "1", endpoint, {"model": "m", **body}, "_INBOX.t.r",
                     deadline=time.time() + 30)
    await bus.request(subjects.VALIDATE, req.encode(), 2.0)
    want = body.get("n", 1)
    for _ in range(200):
        if len(submitted) >= want or chunks:
            break
        await asyncio.sleep(0.02)
    await svc.stop()
    return submitted, chunks


def manifest(path: str, **defaults) -> dict:
    return {"name": "m", "version": "1", "artifact": path, "format": "gguf", "defaults": defaults}


async def test_manifest_defaults_fill_what_the_request_leaves_out(tiny_path):
    m = manifest(tiny_path, temperature=0.2, top_k=7, max_tokens=5, stop=["END"], seed=40)
    msgs = [{"role": "user", "content": "hi"}]
    [silent], _ = await validate(m, {"messages": msgs})
    p = silent.sampling
    assert (p.temperature, p.top_k, p.max_tokens, p.stop, p.seed) == (0.2, 7, 5, ("END",), 40)  # manifest
    assert (p.top_p, p.frequency_penalty) == (1.0, 0.0)  # server defaults
    assert silent.request_id == "r" and silent.choice_index == 0
    two, _ = await validate(m, {"messages": msgs, "temperature": 1.3, "max_tokens": 9, "stop": "X", "n": 2})
    assert [(g.request_id, g.choice_index, g.sampling.seed) for g in two] == [("r-0", 0, 40), ("r-1", 1, 41)]
    assert all((g.sampling.temperature, g.sampling.max_tokens, g.sampling.stop, g.sampling.top_k)
               == (1.3, 9, ("X",), 7) for g in two)  # the request wins; the manifest fills top_k and seed


async def test_completions_without_manifest_defaults_get_the_server_defaults(tiny_path):
    [g], _ = await validate(manifest(tiny_path), {"prompt": "hello"}, endpoint="completions")
    assert (g.sampling.max_tokens, g.sampling.temperature, g.sampling.seed) == (16, 1.0, None)


async def test_min_p_and_repetition_penalty_defaults_reach_the_sampling_params(tiny_path):
    m = manifest(tiny_path, min_p=0.1, repetition_penalty=1.2)
    [g], chunks = await validate(m, {"messages": [{"role": "user", "content": "x"}]})
    assert not chunks and (g.sampling.min_p, g.sampling.repetition_penalty) == (0.1, 1.2)
    [plain], _ = await validate(manifest(tiny_path), {"messages": [{"role": "user", "content": "x"}]})
    assert (plain.sampling.min_p, plain.sampling.repetition_penalty) == (0.0, 1.0)  # server defaults: off


async def test_a_stored_default_that_is_not_valid_is_never_ignored(tiny_path):
    # a hand-edited record (registration refuses it): min_p out of [0, 1], or a key that is no default
    for bad in ({"min_p": 5}, {"ignore_eos": True}):
        submitted, chunks = await validate(manifest(tiny_path, **bad), {"messages": [{"role": "user", "content": "x"}]})
        assert not submitted
        [err] = chunks
        assert err.final and err.error["status"] == 503 and err.error["code"] == "model_unavailable"
