"""In-memory tests of the gateway request pipeline (gateway/pipeline.py): outcomes, sinks, cancel and close
exactly once, quota release on every exit."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import orjson
import pytest

from bus.errors import ServeError
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import Cancel, Chunk
from gateway import pipeline
from gateway.frontend import Frontend, FrontendConfig, Submitted
from gateway.openai_format import ApiError

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


async def frontend() -> tuple[MemoryBus, Frontend]:
    bus = MemoryBus()
    fe = Frontend(bus, resolver=None, cfg=FrontendConfig("gw-1"))
    await fe.start()
    return bus, fe


def submitted(fe: Frontend, rid: str = "r", k: int = 1, deadline_s: float = 5.0, endpoint: str = "chat"):
    entry = fe.table.open(rid, time.time() + deadline_s, 5.0, children=k)
    return Submitted(entry, rid, endpoint, "m", "1", {"gateway_in": time.time()}, k)


def ok_chunks(rid: str = "r") -> list[Chunk]:
    return [Chunk(rid, 0, "Hi", (1,), model="m@1", worker_id="w"),
            Chunk(rid, 1, "!", (2,), True, "stop", USAGE, {"decode_ms": 1.0}, model="m@1", worker_id="w")]


def cancels(bus: MemoryBus) -> list[tuple[str, str]]:
    """(request id, reason) of every cancel published."""
    return [(s.rsplit(".", 1)[-1], Cancel.decode(d).reason) for s, d in bus.published
            if s.startswith(subjects.cancel("x")[:-1])]


class Recorder:
    """A sink that keeps every call."""

    def __init__(self, fail_at: int | None = None, exc: type[BaseException] = ConnectionResetError) -> None:
        self.calls: list[list[dict]] = []
        self.fail_at, self.exc = fail_at, exc

    async def emit(self, events, merger) -> None:
        self.calls.append(list(events))
        if self.fail_at is not None and len(self.calls) > self.fail_at:
            raise self.exc("sink failed")


def deliver(fe: Frontend, *chunks: Chunk) -> None:
    for c in chunks:
        assert fe.table.deliver(c)


async def test_success_non_stream_builds_the_body_and_closes_once():
    bus, fe = await frontend()
    sub = submitted(fe)
    deliver(fe, *ok_chunks())
    out = await pipeline.run(fe, sub, {"model": "m"})
    assert out.ok and out.status == 200 and out.error is None
    body = out.merger.body()
    assert body["choices"][0]["message"]["content"] == "Hi!" and body["choices"][0]["finish_reason"] == "stop"
    assert body["model"] == "m@1" and body["usage"]["total_tokens"] == 5
    assert fe.table.get("r") is None and cancels(bus) == []


async def test_success_stream_hands_every_chunk_to_the_sink():
    bus, fe = await frontend()
    sub = submitted(fe)
    deliver(fe, *ok_chunks())
    sink = Recorder()
    out = await pipeline.run(fe, sub, {"model": "m", "stream": True}, sink)
    assert out.ok and len(sink.calls) == 2  # one call per chunk
    events = [e for call in sink.calls for e in call]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"].get("content") for e in events[1:3]] == ["Hi", "!"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop" and "actorserve_timing" in events[-1]
    assert cancels(bus) == [] and fe.table.get("r") is None


async def test_error_chunk_first_reaches_no_sink_and_sends_no_cancel():
    bus, fe = await frontend()
    sub = submitted(fe)
    deliver(fe, Chunk("r", 0, final=True, error=ServeError(429, "queue full", type="overloaded",
                                                             code="queue_full", retryable=True, retry_after=2.0).to_wire()))
    sink = Recorder()
    out = await pipeline.run(fe, sub, {"model": "m", "stream": True}, sink)
    assert not out.ok and out.status == 429 and out.error.code == "queue_full" and out.error.retry_after == 2.0
    assert out.failure.retryable is True and sink.calls == []
    # a refusal (validator or scheduler) was never queued: no cancel crosses the bus for it
    assert cancels(bus) == [] and fe.table.get("r") is None


async def test_error_chunk_mid_stream_keeps_what_was_streamed():
    bus, fe = await frontend()
    sub = submitted(fe)
    deliver(fe, ok_chunks()[0], Chunk("r", 1, final=True, error=ServeError(503, "worker lost", code="worker_lost").to_wire()))
    sink = Recorder()
    out = await pipeline.run(fe, sub, {"model": "m", "stream": True}, sink)
    assert out.status == 503 and out.failure.code == "worker_lost" and len(sink.calls) == 1
    assert out.merger.texts[0] == ["Hi"]
    assert cancels(bus) == [] and fe.table.get("r") is None  # its sender (the scheduler) ended it


async def test_cancelled_by_worker_is_a_408():
    bus, fe = await frontend()
    sub = submitted(fe)
    deliver(fe, Chunk("r", 0, final=True, error=ServeError(499, "cancelled", code="cancelled").to_wire()))
    out = await pipeline.run(fe, sub, {"model": "m"})
    assert out.status == 408 and out.failure.status == 499


async def test_deadline_is_a_stream_error_cancelled_once_by_the_pipeline():
    bus, fe = await frontend()
    sub = submitted(fe, deadline_s=0.1)
    out = await pipeline.run(fe, sub, {"model": "m"})
    assert out.status == 503 and out.error.code == "deadline_exceeded"
    # Frontend.next gives up (gateway_gave_up); the pipeline cancels exactly once more, with its own reason
    assert cancels(bus) == [("r", "gateway_gave_up"), ("r", "stream_error")] and fe.table.get("r") is None


async def test_gap_mid_stream_is_a_stream_error():
    bus, fe = await frontend()
    sub = submitted(fe)
    deliver(fe, ok_chunks()[0], Chunk("r", 5, "?", (3,), worker_id="w"))
    sink = Recorder()
    out = await pipeline.run(fe, sub, {"model": "m", "stream": True}, sink)
    assert out.error.code == "stream_gap" and out.status == 502 and len(sink.calls) == 1
    assert [r for _, r in cancels(bus)].count("stream_error") == 1


async def test_fanned_out_request_cancels_every_choice_once():
    bus, fe = await frontend()
    sub = submitted(fe, k=2)
    deliver(fe, Chunk("r-0", 0, "a", (1,), worker_id="w"),
            Chunk("r-1", 0, final=True, choice_index=1,
                  error=ServeError(400, "context too long", code="context_length_exceeded").to_wire()))
    out = await pipeline.run(fe, sub, {"model": "m", "n": 2})
    assert out.status == 400
    assert sorted(cancels(bus)) == [("r", "sibling_failed"), ("r-0", "sibling_failed"), ("r-1", "sibling_failed")]


async def test_fanned_out_success_waits_for_every_choice():
    bus, fe = await frontend()
    sub = submitted(fe, k=2)
    deliver(fe, Chunk("r-1", 0, "b", (1,), True, "stop", USAGE, worker_id="w", choice_index=1),
            Chunk("r-0", 0, "a", (1,), True, "length", USAGE, worker_id="w"))
    out = await pipeline.run(fe, sub, {"model": "m", "n": 2})
    assert out.ok and [c["message"]["content"] for c in out.merger.body()["choices"]] == ["a", "b"]


async def test_client_gone_is_a_499_and_one_disconnect_cancel():
    bus, fe = await frontend()
    sub = submitted(fe)
    gone = {"now": False}
    task = asyncio.create_task(pipeline.run(fe, sub, {"model": "m"}, gone=lambda: gone["now"]))
    await asyncio.sleep(0.05)
    gone["now"] = True
    out = await asyncio.wait_for(task, 2.0)
    assert out.disconnected and out.status == 499 and out.error is None and not out.ok
    assert cancels(bus) == [("r", "disconnect")] and fe.table.get("r") is None


async def test_sink_write_failure_is_a_disconnect():
    bus, fe = await frontend()
    sub = submitted(fe)
    deliver(fe, *ok_chunks())
    out = await pipeline.run(fe, sub, {"model": "m", "stream": True}, Recorder(fail_at=0))
    assert out.disconnected and cancels(bus) == [("r", "disconnect")] and fe.table.get("r") is None


async def test_unexpected_failure_is_a_500_that_still_cancels_and_closes():
    bus, fe = await frontend()
    sub = submitted(fe)
    deliver(fe, *ok_chunks())
    out = await pipeline.run(fe, sub, {"model": "m", "stream": True}, Recorder(fail_at=0, exc=KeyError))
    assert out.status == 500 and out.error.type == "server_error" and "internal error" in out.error.message
    assert cancels(bus) == [("r", "stream_error")] and fe.table.get("r") is None


async def test_task_cancellation_still_closes_the_entry():
    bus, fe = await frontend()
    sub = submitted(fe)
    task = asyncio.create_task(pipeline.run(fe, sub, {"model": "m"}))
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fe.table.get("r") is None


# -- admission and submit ---------------------------------------------------------------------------


class Snapshot:
    def resolve(self, ref, *, tenant="", request_key=""):
        return ref, "1"

    def resolve_ref(self, ref, *, tenant="", request_key=""):
        return ref, "1", None

    def adapter_path(self, name, adapter):
        return ""


class Tenancy:
    """Records admissions and releases; ``refuse`` = the ApiError admission raises."""

    def __init__(self, refuse: ApiError | None = None) -> None:
        self.refuse, self.admitted, self.released = refuse, [], []

    async def admit(self, tenant, body, request_id, headers):
        if self.refuse is not None:
            raise self.refuse
        headers["x-ratelimit-limit-requests"] = "10"
        self.admitted.append(request_id)
        return SimpleNamespace(request_id=request_id)

    async def release(self, adm):
        self.released.append(adm.request_id)


async def submitting_frontend(accept: bool = True) -> tuple[MemoryBus, Frontend]:
    bus = MemoryBus()
    fe = Frontend(bus, resolver=SimpleNamespace(snapshot=Snapshot()), cfg=FrontendConfig("gw-1", validator_ack_s=0.5))
    await fe.start()
    if accept:
        async def validator(msg):
            await msg.respond(orjson.dumps({"accepted": True}))
        await bus.subscribe(subjects.VALIDATE, validator)
    return bus, fe


def request(rid: str = "q1") -> pipeline.Request:
    tenant = SimpleNamespace(id="acme")
    return pipeline.Request("acme", "chat", {"model": "m"}, rid, 5000, {"gateway_in": time.time()}, tenant)


async def test_admitted_releases_once_on_normal_exit_and_fills_headers():
    bus, fe = await submitting_frontend()
    tenancy, req = Tenancy(), request()
    async with pipeline.admitted(fe, req, tenancy) as sub:
        assert sub.request_id == "q1" and fe.table.get("q1") is not None and tenancy.released == []
    assert tenancy.admitted == ["q1"] and tenancy.released == ["q1"]
    assert req.headers["x-ratelimit-limit-requests"] == "10"


async def test_admitted_releases_once_when_the_body_raises():
    bus, fe = await submitting_frontend()
    tenancy = Tenancy()
    with pytest.raises(RuntimeError):
        async with pipeline.admitted(fe, request(), tenancy):
            raise RuntimeError("front failed")
    assert tenancy.released == ["q1"]


async def test_failed_submit_releases_and_raises():
    bus, fe = await submitting_frontend(accept=False)
    tenancy = Tenancy()
    with pytest.raises(ApiError) as ei:
        await pipeline.start(fe, request(), tenancy)
    assert ei.value.status == 503 and ei.value.code == "validator_unavailable"
    assert tenancy.released == ["q1"] and fe.table.get("q1") is None


async def test_refused_admission_submits_nothing():
    bus, fe = await submitting_frontend()
    tenancy = Tenancy(refuse=ApiError(429, "rate limit", code="rate_limit_exceeded"))
    with pytest.raises(ApiError) as ei:
        await pipeline.start(fe, request(), tenancy)
    assert ei.value.status == 429 and tenancy.released == []
    assert not [s for s, _ in bus.published if s == subjects.VALIDATE]


async def test_started_release_is_idempotent_and_no_tenancy_admits_nothing():
    bus, fe = await submitting_frontend()
    tenancy = Tenancy()
    started = await pipeline.start(fe, request(), tenancy)
    await started.release()
    await started.release()
    assert tenancy.released == ["q1"]
    plain = await pipeline.start(fe, pipeline.Request("acme", "chat", {"model": "m"}, "q2", 5000, {}))
    await plain.release()
    assert plain.admission is None and plain.sub.request_id == "q2"


def test_request_refuses_a_mismatched_tenant():
    with pytest.raises(ValueError, match="tenant_id"):
        pipeline.Request("other", "chat", {}, "r", 1000, {}, SimpleNamespace(id="acme"))


async def test_a_late_validator_ack_is_asked_once_more():
    # a stalled validator loop (or a NATS server reloading its users) misses the 0.5 s ack once
    bus = MemoryBus()
    fe = Frontend(bus, resolver=SimpleNamespace(snapshot=Snapshot()), cfg=FrontendConfig("gw-1", validator_ack_s=0.5))
    await fe.start()
    asked: list[str] = []

    async def validator(msg):
        asked.append(orjson.loads(msg.data)["request_id"])
        if len(asked) > 1:
            await msg.respond(orjson.dumps({"accepted": True}))
    await bus.subscribe(subjects.VALIDATE, validator)
    tenancy = Tenancy()
    async with pipeline.admitted(fe, request(), tenancy) as sub:
        assert sub.request_id == "q1"
    assert asked == ["q1", "q1"]


async def test_no_validator_answering_twice_is_503():
    bus = MemoryBus()
    fe = Frontend(bus, resolver=SimpleNamespace(snapshot=Snapshot()), cfg=FrontendConfig("gw-1", validator_ack_s=0.3))
    await fe.start()
    asked: list[bytes] = []

    async def silent(msg):
        asked.append(msg.data)
    await bus.subscribe(subjects.VALIDATE, silent)
    with pytest.raises(ApiError) as ei:
        await pipeline.start(fe, request(), Tenancy())
    assert ei.value.code == "validator_unavailable" and len(asked) == 2
