"""Step frames (issue [25] item 1, decision 0052): the worker's Outbox puts the chunks of one step for one
receiver into one StepFrame message; the gateway's Frontend takes a frame apart as if each chunk came alone.
Over the in-memory bus (one actor's logic each); the e2e tests run the same path over nats-server."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from bus import subjects
from bus.base import BusError
from bus.memory import MemoryBus
from bus.messages import Chunk, GenerateRequest, SamplingParams, StepFrame
from actors.worker.live import Live
from actors.worker.outputs import Outbox


def _live(rid: str, frames: str = "", gw: str = "gw1", tenant: str = "t1") -> Live:
    req = GenerateRequest(rid, tenant, "m", "1", subjects.gateway_reply(tenant, gw, rid), (1, 2), SamplingParams(),
                          frames=frames)
    return Live(req, time.time())


def _chunks_of(data: bytes) -> list[tuple[str, int, str]]:
    return [(c.request_id, c.seq, c.text) for c in StepFrame.decode(data).chunks]


def test_subjects_and_wire():
    assert subjects.frames("gw-1") == "as.int.frames.gw-1"
    with pytest.raises(ValueError):
        subjects.frames("a.b")  # a receiver id can never widen the subject
    parts = [Chunk("r1", 0, "a").encode(), Chunk("r2", 0, "b", final=True).encode()]
    frame = StepFrame.decode(StepFrame.join(parts))
    assert [(c.request_id, c.text, c.final) for c in frame.chunks] == [("r1", "a", False), ("r2", "b", True)]
    assert StepFrame.join(parts) == orjson.dumps(StepFrame(frame.chunks))  # join == encode of the same chunks
    with pytest.raises(ValueError):
        StepFrame.decode(b'{"chunks": 3}')


def test_one_frame_per_receiver_per_flush_in_order():
    async def run():
        bus, live = MemoryBus(), {}
        fa, fb = subjects.frames("gwA"), subjects.frames("gwB")
        a1, a2, b1, plain = _live("a1", fa), _live("a2", fa), _live("b1", fb), _live("p1")
        live.update({x.request_id: x for x in (a1, a2, b1, plain)})
        box = Outbox(bus, "w0", live)
        box.send(a1, Chunk("a1", 0, "x"))
        box.send(plain, Chunk("p1", 0, "p"))
        box.send(b1, Chunk("b1", 0, "y"))
        box.send(a2, Chunk("a2", 0, "z"))
        box.send(a1, Chunk("a1", 1, "w", final=True))
        assert len(box) == 3  # frame A, the plain chunk, frame B
        assert await box.flush() == 3
        return bus.published, box, live
    published, box, live = asyncio.run(run())
    assert [s for s, _ in published] == [subjects.frames("gwA"), subjects.gateway_reply("t1", "gw1", "p1"),
                                         subjects.frames("gwB")]
    assert _chunks_of(published[0][1]) == [("a1", 0, "x"), ("a2", 0, "z"), ("a1", 1, "w")]
    assert _chunks_of(published[2][1]) == [("b1", 0, "y")]
    assert Chunk.decode(published[1][1]).text == "p"
    assert "a1" not in live and box.num_finished == 1  # the final chunk ended its request, framed or not


def test_a_full_frame_opens_the_next_and_a_flush_starts_afresh():
    async def run():
        bus, live = MemoryBus(), {}
        f = subjects.frames("gwA")
        lvs = [_live(f"r{i}", f) for i in range(5)]
        live.update({x.request_id: x for x in lvs})
        one = len(Chunk("r0", 0, "t" * 50).encode())
        box = Outbox(bus, "w0", live, frame_max_bytes=2 * one + 2)  # two chunks per frame
        for lv in lvs:
            box.send(lv, Chunk(lv.request_id, 0, "t" * 50))
        await box.flush()
        box.send(lvs[0], Chunk("r0", 1, "next"))
        await box.flush()
        return bus.published
    published = asyncio.run(run())
    assert [len(StepFrame.decode(d).chunks) for _, d in published] == [2, 2, 1, 1]
    assert [c[0] for _, d in published[:3] for c in _chunks_of(d)] == ["r0", "r1", "r2", "r3", "r4"]
    assert _chunks_of(published[3][1]) == [("r0", 1, "next")]


def test_a_failed_publish_is_logged_and_the_rest_still_go(caplog):
    class Flaky(MemoryBus):
        async def publish(self, subject, data, reply="", headers=None):
            if subject == subjects.frames("bad"):
                raise BusError("no route")
            await super().publish(subject, data, reply, headers)

    async def run():
        bus, live = Flaky(), {}
        x, y = _live("x", subjects.frames("bad")), _live("y", subjects.frames("good"))
        live.update(x=x, y=y)
        box = Outbox(bus, "w0", live)
        box.send(x, Chunk("x", 0, "1"))
        box.send(y, Chunk("y", 0, "2"))
        assert await box.flush() == 2
        return bus.published
    published = asyncio.run(run())
    assert [s for s, _ in published] == [subjects.frames("good")]
    assert "publish to as.int.frames.bad failed" in caplog.text


def test_frontend_asks_for_frames_and_delivers_each_chunk_of_a_frame(caplog):
    from gateway.frontend import Frontend, FrontendConfig

    async def run():
        bus = MemoryBus()
        fe = Frontend(bus, resolver=None, cfg=FrontendConfig("gw7"))
        await fe.start()
        e1 = fe.table.open("r1", time.time() + 5, 5.0)
        e2 = fe.table.open("r2", time.time() + 5, 5.0)
        parts = [Chunk("r1", 0, "a").encode(), orjson.dumps({"seq": 0}),  # the second lacks its request id
                 Chunk("r2", 0, "b").encode(), Chunk("r1", 1, "c", final=True).encode()]
        await bus.publish(subjects.frames("gw7"), StepFrame.join(parts))
        await bus.publish(subjects.frames("gw7"), b"not json")
        await asyncio.sleep(0.05)
        got1 = [e1.queue.get_nowait().text for _ in range(e1.queue.qsize())]
        got2 = [e2.queue.get_nowait().text for _ in range(e2.queue.qsize())]
        await fe.stop()
        return got1, got2
    got1, got2 = asyncio.run(run())
    assert got1 == ["a", "c"] and got2 == ["b"]
    assert "undecodable chunk in a step frame" in caplog.text and "undecodable step frame" in caplog.text


def test_the_validator_carries_the_frame_subject_to_every_choice(tmp_path):
    from actors.validator.service import ValidatorService, load_assets
    from bus.messages import ApiRequest
    from tests.engine_fixtures import write_tiny_llama_gguf

    path = str(tmp_path / "tiny.gguf")
    write_tiny_llama_gguf(path)
    assets = load_assets({"artifact": path})
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "n": 2}
    with_frames = ApiRequest("r1", "t", "m", "m", "1", "completions", body, "_INBOX.t.gw.g.r1",
                             frames=subjects.frames("g"))
    gens = ValidatorService(None, None)._prepare_sync(with_frames, assets)
    assert [g.frames for g in gens] == [subjects.frames("g")] * 2
    plain = ApiRequest("r2", "t", "m", "m", "1", "completions", body, "_INBOX.t.gw.g.r2")
    assert [g.frames for g in ValidatorService(None, None)._prepare_sync(plain, assets)] == ["", ""]
