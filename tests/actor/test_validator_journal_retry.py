"""The validator retries a scheduler's explicit journal_unavailable refusal (a JetStream leader election:
the scheduler did not take the request), within failover_wait_s, and no other refusal; a refusal's hint
fields (gateway/shed.py) reach the gateway."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from actors.validator.service import ValidatorConfig, ValidatorService
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import ApiRequest, Chunk
from tests.actor.test_validator_service import Registry, manifest
from tests.engine_fixtures import write_tiny_llama_gguf


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama_gguf(str(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


def refusal(code: str, status: int = 503) -> bytes:
    return orjson.dumps({"accepted": False, "error": {"status": status, "message": code, "code": code,
                                                      "type": "unavailable"}})


async def run(tiny_path: str, refusals: list[bytes | None], wait_s: float = 4.0,
              ack_s: float = 2.0) -> tuple[int, list[Chunk]]:
    """One chat request through a validator whose scheduler answers ``refusals`` first (None: no answer,
    as a busy scheduler whose ack comes too late), then accepts. Returns (submit attempts the scheduler
    saw, reply chunks)."""
    bus = MemoryBus()
    svc = ValidatorService(bus, Registry(manifest(tiny_path)),
                           ValidatorConfig(failover_wait_s=wait_s, scheduler_ack_s=ack_s))
    await svc.start()
    attempts, chunks, left = [0], [], list(refusals)

    async def scheduler(msg):
        attempts[0] += 1
        answer = left.pop(0) if left else b'{"accepted":true}'
        if answer is not None:
            await msg.respond(answer)

    async def reply(msg):
        chunks.append(Chunk.decode(msg.data))
    await bus.subscribe(subjects.sched_submit("m", "1"), scheduler)
    await bus.subscribe("_INBOX.t.r", reply)
    req = ApiRequest("r", "t", "m", "m", "1", "chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                     "_INBOX.t.r", deadline=time.time() + 30)
    await bus.request(subjects.VALIDATE, req.encode(), 2.0)
    for _ in range(150):
        if chunks or (attempts[0] > len(refusals) and not left):
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)
    await svc.stop()
    return attempts[0], chunks


async def test_journal_unavailable_is_retried_until_the_scheduler_takes_it(tiny_path):
    attempts, chunks = await run(tiny_path, [refusal("journal_unavailable")] * 3)
    assert attempts == 4 and chunks == []  # taken on the 4th try: no error reached the client


async def test_other_refusals_are_not_retried(tiny_path):
    attempts, chunks = await run(tiny_path, [refusal("queue_full", 429)])
    assert attempts == 1 and chunks and chunks[0].error["code"] == "queue_full"


async def test_journal_unavailable_past_the_wait_reaches_the_client(tiny_path):
    attempts, chunks = await run(tiny_path, [refusal("journal_unavailable")] * 50, wait_s=0.5)
    assert 2 <= attempts <= 4 and chunks and chunks[0].error["code"] == "journal_unavailable"


async def test_a_refusal_hint_reaches_the_gateway_with_the_error(tiny_path):
    hinted = orjson.dumps({"accepted": False, "error": {
        "status": 503, "message": "late", "code": "deadline_unmeetable", "type": "overloaded",
        "queue_clear_at": 1234.5, "decode_step_s": 0.1, "internal": "not passed on"}})
    attempts, chunks = await run(tiny_path, [hinted])
    err = chunks[0].error
    assert attempts == 1 and err["code"] == "deadline_unmeetable" and err["retry_after"] == 1.0
    assert (err["queue_clear_at"], err["decode_step_s"]) == (1234.5, 0.1) and "internal" not in err
    assert chunks[0].model == "m@1"  # what the gateway keys the hint by (gateway/shed.py)


async def test_an_ack_timeout_is_retried_within_the_wait(tiny_path):
    # the scheduler acks a request id it already holds without queueing it twice
    # (actors/scheduler/service.py _known), so a retry after a lost or late ack is safe
    attempts, chunks = await run(tiny_path, [None, None], ack_s=0.2)
    assert attempts == 3 and chunks == []


async def test_ack_timeouts_past_the_wait_reach_the_client(tiny_path):
    attempts, chunks = await run(tiny_path, [None] * 50, wait_s=0.5, ack_s=0.2)
    assert 2 <= attempts <= 3 and chunks and chunks[0].error["code"] == "scheduler_unavailable"


async def test_a_request_handed_over_twice_is_validated_once(tiny_path):
    # a gateway asks again when the first ack came late (gateway/frontend.py _ask_validator)
    bus = MemoryBus()
    svc = ValidatorService(bus, Registry(manifest(tiny_path)), ValidatorConfig())
    await svc.start()
    submits: list[str] = []

    async def scheduler(msg):
        submits.append(orjson.loads(msg.data)["request_id"])
        await msg.respond(b'{"accepted":true}')
    await bus.subscribe(subjects.sched_submit("m", "1"), scheduler)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = ApiRequest("r", "t", "m", "m", "1", "chat", body, "_INBOX.t.r", deadline=time.time() + 30,
                     marks={"gateway_out": 100.0})
    again = ApiRequest("r", "t", "m", "m", "1", "chat", body, "_INBOX.t.r", deadline=time.time() + 30,
                       marks={"gateway_out": 101.0})  # a new hand-off under the same id (a client's retry)
    for r in (req, req, again):
        assert b'"accepted":true' in (await bus.request(subjects.VALIDATE, r.encode(), 2.0)).data
    for _ in range(100):
        if len(submits) >= 2:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)
    await svc.stop()
    assert submits == ["r", "r"]
