"""The HTTP and NATS fronts over the one pipeline, in memory (MemoryBus, a scripted validator): statuses,
error bodies, the SSE sequence ending in ``data: [DONE]``, in-band errors, the NATS ``final`` marker, and the
idempotent run's result shapes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson
from aiohttp.test_utils import TestClient, TestServer

from bus.errors import ServeError
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import ApiRequest, Chunk
from gateway import pipeline
from gateway.frontend import Frontend, FrontendConfig
from gateway.http import HttpFront
from gateway.idempotency import LiveRun, _result
from gateway.merge import ChoiceMerger
from gateway.nats_api import NatsApi

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
SCRIPTS = {  # prompt -> the chunks the "worker" sends
    "ok": lambda r: [Chunk(r, 0, "Hi", (1,), model="tiny@1", worker_id="w"),
                     Chunk(r, 1, "!", (2,), True, "stop", USAGE, model="tiny@1", worker_id="w")],
    "err_first": lambda r: [Chunk(r, 0, final=True, error=ServeError(400, "too long", code="context_length_exceeded").to_wire())],
    "full": lambda r: [Chunk(r, 0, final=True, model="tiny@1", error=ServeError(
         503, "the model's queue is full; retry later", type="overloaded", code="queue_full", retryable=True,
         retry_after=1.0).to_wire())],
    "err_mid": lambda r: [Chunk(r, 0, "Hi", (1,), model="tiny@1", worker_id="w"),
                          Chunk(r, 1, final=True, error=ServeError(503, "worker lost", type="unavailable",
                                                                    code="worker_lost", retryable=True,
                                                                    retry_after=1.0).to_wire())],
}


class Snapshot:
    def resolve(self, ref, *, tenant="", request_key=""):
        return ref, "1"

    def resolve_ref(self, ref, *, tenant="", request_key=""):
        return ref, "1", None

    def adapter_path(self, name, adapter):
        return ""


async def stack() -> tuple[MemoryBus, Frontend]:
    """A Frontend on a MemoryBus whose validator accepts every request and plays its prompt's script."""
    bus = MemoryBus()
    fe = Frontend(bus, SimpleNamespace(snapshot=Snapshot()), FrontendConfig("gw-1", validator_ack_s=0.5))
    await fe.start()

    async def play(req: ApiRequest) -> None:
        for c in SCRIPTS[req.body["prompt"]](req.request_id):
            await bus.publish(req.reply, c.encode())

    async def validator(msg) -> None:
        await msg.respond(orjson.dumps({"accepted": True}))
        asyncio.get_running_loop().call_later(0.01, asyncio.ensure_future, play(ApiRequest.decode(msg.data)))
    await bus.subscribe(subjects.VALIDATE, validator)
    return bus, fe


async def http(body: dict) -> tuple[int, dict, bytes]:
    bus, fe = await stack()
    async with TestClient(TestServer(HttpFront(fe).app())) as client:
        r = await client.post("/v1/completions", json={"model": "tiny", **body})
        data = await r.read()
        assert len(fe.table) == 0  # the in-flight entry is closed whatever the outcome
        return r.status, dict(r.headers), data


def sse_events(data: bytes) -> list:
    lines = [x[6:] for x in data.decode().split("\n\n") if x.startswith("data: ")]
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    return [orjson.loads(x) for x in lines[:-1]]


async def test_http_non_stream_success():
    status, headers, data = await http({"prompt": "ok"})
    body = orjson.loads(data)
    assert status == 200 and body["choices"][0]["text"] == "Hi!" and body["choices"][0]["finish_reason"] == "stop"
    assert headers["x-actorserve-model-version"] == "tiny@1" and "x-actorserve-timing" in headers


async def test_http_stream_success_ends_in_done():
    status, headers, data = await http({"prompt": "ok", "stream": True})
    events = sse_events(data)
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    assert [e["choices"][0]["text"] for e in events] == ["Hi", "!", ""]
    assert events[-1]["choices"][0]["finish_reason"] == "stop" and "actorserve_timing" in events[-1]


async def test_http_error_before_streaming_is_a_real_status():
    for stream in (False, True):
        status, _, data = await http({"prompt": "err_first", "stream": stream})
        assert status == 400 and orjson.loads(data)["error"]["code"] == "context_length_exceeded"


async def test_http_error_mid_stream_is_an_inband_event_then_done():
    status, _, data = await http({"prompt": "err_mid", "stream": True})
    events = sse_events(data)
    assert status == 200 and events[0]["choices"][0]["text"] == "Hi"
    err = events[-1]["error"]
    assert err["code"] == "worker_lost" and err["status"] == 503 and err["retryable"] is True
    status, headers, data = await http({"prompt": "err_mid"})
    assert status == 503 and headers["Retry-After"] == "1" and orjson.loads(data)["error"]["code"] == "worker_lost"


async def nats(body: dict) -> list[dict]:
    bus, fe = await stack()
    api = NatsApi(fe)
    await api.start()
    replies: asyncio.Queue = asyncio.Queue()

    async def on_reply(msg) -> None:
        replies.put_nowait(orjson.loads(msg.data))
    await bus.subscribe("_INBOX.dev.x", on_reply)
    await bus.publish(subjects.API_COMPLETIONS, orjson.dumps({"model": "tiny", **body}), reply="_INBOX.dev.x")
    out = [await asyncio.wait_for(replies.get(), 2.0)]
    while body.get("stream") and not out[-1].get("final"):
        out.append(await asyncio.wait_for(replies.get(), 2.0))
    await api.stop()
    return out


async def test_nats_stream_marks_the_last_object_final():
    out = await nats({"prompt": "ok", "stream": True})
    assert [o["choices"][0]["text"] for o in out] == ["Hi", "!", ""]
    assert [o.get("final", False) for o in out] == [False, False, True]


async def test_nats_errors_carry_status_and_final():
    (one,) = await nats({"prompt": "ok"})
    assert one["choices"][0]["text"] == "Hi!" and "final" not in one
    (err,) = await nats({"prompt": "err_first", "stream": True})
    assert err["status"] == 400 and err["final"] is True and err["error"]["code"] == "context_length_exceeded"
    out = await nats({"prompt": "err_mid", "stream": True})
    assert out[0]["choices"][0]["text"] == "Hi" and out[-1]["status"] == 503 and out[-1]["final"] is True


def outcome(stream: bool, detail: dict | None = None, streamed: int = 0) -> tuple[pipeline.Outcome, LiveRun]:
    """An Outcome and the LiveRun it ended, ``streamed`` events already sent."""
    live = LiveRun(stream)
    for i in range(streamed):
        live.push(b'{"n":%d}' % i)
    failure = ServeError.from_wire(detail) if detail is not None else None
    return pipeline.Outcome(ChoiceMerger("completions", "r", "tiny@1", {}, {}, 1), failure), live


async def test_nats_cancel_refuses_a_malformed_id_and_finds_no_unknown_one():
    """A request id that is not a string (5, null) is a 400 naming the field (docs/nats-api.md); a string
    nobody holds is ``found: false`` and no cancel is sent (tests/unit/test_hardening_gateway.py has more)."""
    bus, fe = await stack()
    api = NatsApi(fe)
    await api.start()
    sent: list[str] = []

    async def on_cancel(msg) -> None:
        sent.append(msg.subject)
    await bus.subscribe(subjects.cancel_all(), on_cancel)
    answers = []
    for rid in (5, None, "a.b", "chatcmpl-abc123"):
        reply = await bus.request(subjects.API_CANCEL, orjson.dumps({"request_id": rid}), 2.0)
        answers.append(orjson.loads(reply.data))
    await api.stop()
    assert [(a.get("status"), (a.get("error") or {}).get("param")) for a in answers[:2]] == [(400, "request_id")] * 2
    assert [(a["found"], a["cancelled"]) for a in answers[2:]] == [(False, False)] * 2
    assert sent == []


def test_idempotent_result_shapes():
    err = ServeError(400, "too long", code="context_length_exceeded").to_wire()
    out, live = outcome(True, err)  # a streamed request failing before any output: a plain JSON error
    headers, body = _result(out, live)
    assert body["error"]["code"] == "context_length_exceeded" and live.events == []
    out, live = outcome(True, err, streamed=2)  # after output: one more event, no JSON body
    headers, body = _result(out, live)
    assert body is None and orjson.loads(live.events[-1])["error"]["code"] == "context_length_exceeded"
    assert "x-actorserve-timing" not in headers
    out, live = outcome(True)
    assert _result(out, live)[1] is None and live.events == []  # success: the events are the answer
    out, live = outcome(False)
    headers, body = _result(out, live)
    assert body["object"] == "text_completion" and "x-actorserve-timing" in headers
    assert headers["x-actorserve-model-version"] == "tiny@1"


async def test_http_refusal_hint_answers_the_next_request_without_the_bus():
    bus, fe = await stack()
    async with TestClient(TestServer(HttpFront(fe).app())) as client:
        first = await client.post("/v1/completions", json={"model": "tiny", "prompt": "full"})
        sent = len([s for s, _ in bus.published if s == subjects.VALIDATE])
        assert sent == 1
        second = await client.post("/v1/completions", json={"model": "tiny", "prompt": "ok"})
        body = orjson.loads(await second.read())
        assert first.status == second.status == 503 and second.headers["Retry-After"] == "1"
        assert body["error"]["code"] == "queue_full" and fe.shed.num_shed == 1
        assert len([s for s, _ in bus.published if s == subjects.VALIDATE]) == sent  # no hop for the second
        assert len(fe.table) == 0
