"""Pure tests of the gateway's in-flight table: order, gaps, deadline, inactivity, failures."""

from __future__ import annotations

import asyncio
import time

import pytest

from bus.errors import ServeError
from bus.messages import Chunk
from gateway.inflight import InflightTable, StreamError, next_chunk
from gateway.openai_format import ApiError, full_timing, TIMING_KEYS


def ck(seq, final=False, worker="w", **kw):
    return Chunk("r", seq, text=f"t{seq}", final=final, worker_id=worker, **kw)


async def test_in_order_chunks_pass():
    t = InflightTable()
    e = t.open("r", time.time() + 5, 5)
    for c in (ck(0), ck(1), ck(2, final=True)):
        assert t.deliver(c)
    assert [(await next_chunk(e)).seq for _ in range(3)] == [0, 1, 2]
    assert not t.deliver(Chunk("other", 0))


async def test_gap_and_a_handed_over_worker_are_errors():
    t = InflightTable()
    e = t.open("r", time.time() + 5, 5)
    t.deliver(ck(0))
    t.deliver(ck(2))
    await next_chunk(e)
    with pytest.raises(StreamError) as ei:
        await next_chunk(e)
    assert ei.value.error["code"] == "stream_gap"
    assert ei.value.error["retryable"] and ei.value.error["retry_after"] == 1.0  # HTTP: Retry-After: 1
    # another worker may take the stream over at the next seq (a migrated sequence); after that the
    # previous worker's chunks are errors, even at the expected seq
    e2 = InflightTable().open("r", time.time() + 5, 5)
    for c in (ck(0, worker="a"), ck(1, worker="b"), ck(2, worker="b"), ck(3, worker="a")):
        e2.queue.put_nowait(c)
    assert [(await next_chunk(e2)).worker_id for _ in range(3)] == ["a", "b", "b"]
    with pytest.raises(StreamError) as ei:
        await next_chunk(e2)
    assert ei.value.error["code"] == "stream_gap"


async def test_error_chunk_ends_stream_regardless_of_seq():
    t = InflightTable()
    e = t.open("r", time.time() + 5, 5)
    t.deliver(ck(0))
    t.deliver(Chunk("r", 0, final=True, error=ServeError(503, "lost", retryable=True).to_wire()))
    await next_chunk(e)
    c = await next_chunk(e)
    assert c.final and c.error["status"] == 503


async def test_deadline_and_inactivity():
    e = InflightTable().open("r", time.time() + 0.1, 5)
    with pytest.raises(StreamError) as ei:
        await next_chunk(e)
    assert ei.value.error["code"] == "deadline_exceeded"
    e = InflightTable().open("r", time.time() + 5, 0.1)
    assert await next_chunk(e, poll_s=0.3) is None  # queued, nothing streamed yet: only the deadline bounds it
    e.queue.put_nowait(Chunk("r", 0, token_ids=(5,), text="a"))
    assert (await next_chunk(e)).seq == 0
    with pytest.raises(StreamError) as ei:
        await next_chunk(e)
    assert ei.value.error["code"] == "upstream_timeout"  # streaming started, then 0.1 s of silence
    e = InflightTable().open("r", time.time() + 5, 5)
    assert await next_chunk(e, poll_s=0.01) is None  # poll slice, not an error


async def test_fail_all_reaches_waiters():
    t = InflightTable()
    e = t.open("r", time.time() + 5, 5)
    waiter = asyncio.create_task(next_chunk(e))
    await asyncio.sleep(0.01)
    t.fail_all(ServeError(503, "bus down", code="bus_disconnected", retryable=True))
    with pytest.raises(StreamError) as ei:
        await waiter
    assert ei.value.error["code"] == "bus_disconnected"
    with pytest.raises(ValueError):
        t.open("r", time.time() + 1, 1)


def test_timing_breakdown_has_every_key_and_sums():
    marks = {"gateway_in": 100.0, "auth_done": 100.001, "gateway_out": 100.002}
    t = full_timing({"validation_ms": 3.0, "queue_ms": 1.0, "prefill_ms": 10.0, "decode_ms": 50.0}, marks, 100.1)
    assert tuple(t) == TIMING_KEYS
    assert abs(sum(t.values()) - 100.0) < 0.01


def test_api_error_shape():
    e = ApiError(503, "busy", code="queue_full", type="overloaded", retry_after=0.2)
    assert e.body() == {"error": {"message": "busy", "type": "overloaded", "param": None, "code": "queue_full"}}
    assert e.http_headers()["Retry-After"] == "1"
    assert ApiError.from_chunk_error(ServeError(499, "gone").to_wire()).status == 408


async def test_gateway_answers_worker_probes():
    from bus import subjects
    from bus.memory import MemoryBus
    from gateway.frontend import Frontend, FrontendConfig

    bus = MemoryBus()
    fe = Frontend(bus, resolver=None, cfg=FrontendConfig("gw-1"))
    await fe.start()
    fe.table.open("abc", time.time() + 5, 5)
    live = await bus.request(subjects.gateway_reply("t", "gw-1", "abc"), b'{"probe":"abc"}', 1.0)
    gone = await bus.request(subjects.gateway_reply("t", "gw-1", "zzz"), b'{"probe":"zzz"}', 1.0)
    assert live.data == b'{"alive":true}' and gone.data == b'{"alive":false}'
    await fe.stop()


async def test_gateway_cancels_generation_when_it_gives_up():
    from bus import subjects
    from bus.memory import MemoryBus
    from gateway.frontend import Frontend, FrontendConfig, Submitted

    bus = MemoryBus()
    fe = Frontend(bus, resolver=None, cfg=FrontendConfig("gw-1"))
    await fe.start()
    entry = fe.table.open("slow", time.time() + 0.2, 0.1)  # nothing arrives before the deadline
    sub = Submitted(entry, "slow", "chat", "m", "1", {}, 1)
    with pytest.raises(StreamError):
        await fe.next(sub)
    assert (subjects.cancel("slow"), ) == tuple(s for s, _ in bus.published if s.startswith("as.int.cancel"))
    await fe.stop()


async def test_disconnect_watch_ends_only_the_gone_request_and_stops_when_idle():
    t = InflightTable()
    a, b = t.open("a", time.time() + 5, 5), t.open("b", time.time() + 5, 5)
    gone = {"a": False}
    t.watch("a", lambda: gone["a"])
    t.watch("b", lambda: False)
    wait_b = asyncio.create_task(next_chunk(b))
    wait_a = asyncio.create_task(next_chunk(a))
    await asyncio.sleep(0.05)
    gone["a"] = True
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(wait_a, 1.0)  # found by the one watch task within WATCH_S
    assert not wait_b.done()
    t.deliver(Chunk("b", 0, "x", worker_id="w"))
    assert (await asyncio.wait_for(wait_b, 1.0)).seq == 0
    task = t._watch_task
    t.close("a"), t.close("b")
    await asyncio.wait_for(task, 1.0)  # nothing watched any more: the task ends
    t.watch("gone-already", lambda: True)  # not open: nothing to watch
    assert t._watch_task is task


def test_choices_are_routed_by_the_ids_registered_at_open_never_parsed():
    from bus.messages import choice_request_id
    t = InflightTable()
    parent = t.open("a-b", time.time() + 5, 5.0, children=2)
    assert t.get(choice_request_id("a-b", 1)) is parent and t.get("a-b-7") is None  # only its own choices
    single = t.open("c", time.time() + 5, 5.0)
    assert t.get("c") is single and t.get(choice_request_id("c", 0)) is None  # an unsplit request has none
    t.close("a-b")
    assert t.get(choice_request_id("a-b", 0)) is None


def test_api_body_reads_the_gateway_fields_once():
    from gateway.request_body import ApiBody
    b = ApiBody.parse("completions", {"model": "m", "prompt": ["x", "y"], "n": 2, "max_completion_tokens": 7,
                                      "ignore_eos": True, "logprobs": 0, "stream": True,
                                      "stream_options": {"include_usage": True}, "priority": "batch"})
    assert (b.model, b.priority, b.max_tokens, b.ignore_eos, b.num_choices, b.n, b.logprobs, b.stream,
            b.include_usage) == ("m", "batch", 7, True, 4, 2, True, True, True)
    chat = ApiBody.parse("chat", {"model": "m", "logprobs": False, "max_tokens": True, "n": 0})
    assert (chat.max_tokens, chat.n, chat.num_choices, chat.logprobs, chat.priority) == (0, 1, 1, False, "interactive")
    assert ApiBody.parse("chat", ["not", "an", "object"]).raw == {}


async def test_each_fanned_out_choice_has_its_own_sequence_and_worker_by_its_choice_index():
    from bus.messages import choice_request_id
    t = InflightTable()
    e = t.open("r", time.time() + 5, 5, children=2)
    c0, c1 = choice_request_id("r", 0), choice_request_id("r", 1)
    for c in (Chunk(c1, 0, worker_id="a", choice_index=1), Chunk(c0, 0, worker_id="a"),
              Chunk(c1, 1, worker_id="b", choice_index=1),  # choice 1 migrated to b at its next seq
              Chunk(c0, 1, worker_id="a"), Chunk(c1, 2, worker_id="a", choice_index=1)):
        assert t.deliver(c)
    assert [(await next_chunk(e)).seq for _ in range(4)] == [0, 0, 1, 1]
    with pytest.raises(StreamError) as ei:  # a's chunk of choice 1 after it handed that choice over
        await next_chunk(e)
    assert ei.value.error["code"] == "stream_gap"
