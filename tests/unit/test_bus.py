"""Pure tests of bus/: subjects, message codec, in-memory bus semantics."""

from __future__ import annotations

import asyncio

import pytest

from bus import subjects
from bus.base import BusTimeout, NoResponders
from bus.memory import MemoryBus, subject_matches
from bus.messages import Chunk, Dispatch, GenerateRequest, SamplingParams


def test_subjects_follow_architecture():
    assert subjects.sched_submit("m", "1") == "as.int.sched.m.1.submit"
    assert subjects.work("w-1") == "as.int.work.w-1"
    assert subjects.cancel("abc") == "as.int.cancel.abc"
    assert subjects.credits("m", "1", "w") == "as.int.credits.m.1.w"
    assert subjects.stats("w") == "as.int.stats.w"
    assert subjects.done("m", "2") == "as.int.done.m.2"
    assert subjects.tenant_inbox_prefix("acme") == "_INBOX.acme"
    assert subjects.API_CHAT == "as.api.v1.chat" and subjects.VALIDATE == "as.int.validate"
    assert subject_matches(subjects.gateway_replies("gw-0"), subjects.gateway_reply("acme", "gw-0", "r1"))


@pytest.mark.parametrize("bad", ["a.b", "a b", "*", ">", "", "x>"])
def test_subject_tokens_refuse_injection(bad):
    with pytest.raises(ValueError):
        subjects.cancel(bad)
    with pytest.raises(ValueError):
        subjects.sched_submit(bad, "1")


def test_message_roundtrip_and_unknown_fields():
    req = GenerateRequest("r1", "t", "m", "1", "_INBOX.t.x", (1, 2, 3), SamplingParams(temperature=0.0, stop=("x",)),
                          "batch", 123.5, {"gateway_in": 1.0})
    again = Dispatch.decode(Dispatch(req, "s").encode()).request
    assert again.prompt_token_ids == [1, 2, 3] or tuple(again.prompt_token_ids) == (1, 2, 3)
    assert again.deadline == 123.5 and again.priority == "batch" and again.marks == {"gateway_in": 1.0}
    c = Chunk.decode(b'{"request_id":"r","seq":2,"text":"hi","future_field":1}')
    assert c.seq == 2 and c.text == "hi" and not c.final
    with pytest.raises(ValueError):
        Chunk.decode(b'{"seq":1}')
    with pytest.raises(ValueError):
        Chunk.decode(b"[1,2]")


def test_wildcards():
    assert subject_matches("a.*.c", "a.b.c") and not subject_matches("a.*.c", "a.b.d")
    assert subject_matches("a.>", "a.b.c") and not subject_matches("a.>", "a")
    assert not subject_matches("a.b", "a.b.c")


async def test_memory_bus_queue_group_and_request():
    bus = MemoryBus()
    got: dict[str, int] = {"a": 0, "b": 0}

    def make(name):
        async def h(msg):
            got[name] += 1
            if msg.reply:
                await msg.respond(name.encode())
        return h
    await bus.subscribe("s", make("a"), queue="q")
    await bus.subscribe("s", make("b"), queue="q")
    for _ in range(10):
        await bus.publish("s", b"x")
    await asyncio.sleep(0.01)
    assert got == {"a": 5, "b": 5}
    assert (await bus.request("s", b"", 1.0)).data in (b"a", b"b")
    with pytest.raises(NoResponders):
        await bus.request("nobody", b"", 0.1)

    async def silent(msg):
        pass
    await bus.subscribe("quiet", silent)
    with pytest.raises(BusTimeout):
        await bus.request("quiet", b"", 0.05)
    await bus.close()


def test_hop_acks_and_probes_round_trip_and_read_the_older_bytes():
    from bus.messages import HopAck, ProbeAnswer, ReceiverProbe, ValidatorPing, ValidatorPong
    import orjson
    refused = HopAck(False, {"status": 503, "message": "full", "code": "queue_full"})
    assert HopAck.decode(refused.encode()) == refused and refused.code == "queue_full"
    assert HopAck.decode(HopAck(True).encode()) == HopAck(True) and HopAck(True).code is None
    # the bytes older validators and schedulers sent, and what older readers look up in the new ones
    assert HopAck.decode(b'{"accepted":true}').accepted and not HopAck.decode(b'{"accepted":false}').accepted
    assert orjson.loads(refused.encode())["accepted"] is False and orjson.loads(refused.encode())["error"]["code"] == "queue_full"
    with pytest.raises(ValueError):
        HopAck(False, "no")  # type: ignore[arg-type]
    assert ValidatorPing().encode() == b'{"ping":true}' and ValidatorPong().encode() == b'{"pong":true}'
    assert ValidatorPing.matches(orjson.loads(ValidatorPing().encode()))
    assert not ValidatorPing.matches({"ping": True, "request_id": "r"})  # an ApiRequest is never a ping
    probe = ReceiverProbe("abc")
    assert probe.encode() == b'{"probe":"abc"}' and ReceiverProbe.decode(probe.encode()).request_id == "abc"
    assert ReceiverProbe.matches(orjson.loads(probe.encode()))
    assert not ReceiverProbe.matches(orjson.loads(Chunk("abc", 0).encode()))
    assert ProbeAnswer.decode(ProbeAnswer(False).encode()) == ProbeAnswer(False)
    assert ProbeAnswer.decode(b'{"alive":false}').alive is False and ProbeAnswer.decode(b"{}").alive is True


def test_serve_error_is_the_one_error_from_hop_to_answer():
    from actors.validator.errors import RequestError
    from bus.errors import ServeError
    from bus.messages import HopAck
    from gateway.openai_format import ApiError
    assert RequestError is ServeError and ApiError is ServeError
    err = ServeError(503, "full", code="queue_full", type="overloaded", retryable=True, retry_after=2.0,
                     extra={"queue_clear_at": 5.0})
    wire = err.to_wire()
    assert wire == {"status": 503, "message": "full", "type": "overloaded", "param": None, "code": "queue_full",
                    "retryable": True, "retry_after": 2.0, "queue_clear_at": 5.0}
    back = ServeError.from_wire(wire)
    assert back.to_wire() == wire and back.extra == {"queue_clear_at": 5.0}
    assert back.body() == {"error": {"message": "full", "type": "overloaded", "param": None, "code": "queue_full"}}
    assert back.http_headers() == {"Retry-After": "2"}
    cancelled = ServeError.from_wire({"status": 499, "message": "gone"})
    assert cancelled.type == "server_error" and cancelled.for_client().status == 408 and cancelled.status == 499
    assert ServeError.from_wire("junk").status == 500  # type: ignore[arg-type]
    # it crosses the bus in a Chunk's error and in a refusing HopAck
    chunk = Chunk.decode(Chunk("r", 0, final=True, error=wire).encode())
    assert chunk.failure.to_wire() == wire and Chunk("r", 0).failure is None
    assert HopAck.decode(HopAck(False, wire).encode()).failure.code == "queue_full" and HopAck(True).failure is None
    with pytest.raises(ServeError) as ei:
        raise back
    assert ei.value is back and str(back) == "full" and hash(back) == hash(back)
