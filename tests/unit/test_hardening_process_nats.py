"""A nats-server restart must not stall requests (issue 21 item 4; measured in
tests/cluster/test_hardening_process.py): the pieces, in memory, about 1.5 s in all.

* the scheduler's journal removal, called by its dispatch loop after every dispatch, never waits for the
  server (a tombstone written in the background: decision 0054), even when JetStream never answers (it used
  to hold the loop for the JetStream timeout, 5 s per request dispatched around the restart);
* a cancel the bus could not carry (the streams failed with ``bus_disconnected``) is sent again once the
  bus is back, so the worker stops generating for nobody;
* a job whose store calls failed with the bus runs again in-process after ~1 s instead of waiting for
  JetStream's redelivery (ack wait 10 s).
"""

from __future__ import annotations

import asyncio
import time


from bus import subjects
from bus.base import BusDisconnected
from bus.memory import MemoryBus
from bus.messages import Cancel


async def test_journal_remove_does_not_hold_the_dispatch_loop_when_jetstream_is_silent():
    from bus import journal

    started = asyncio.Event()

    class SilentJs:
        async def publish(self, subject, data, **kw):
            started.set()
            await asyncio.sleep(5.0)  # the tombstone went out as the server died: no ack

    j = journal.JetStreamJournal(SilentJs(), "m", "1")
    j._seq = {"r1": 7}
    t0 = time.monotonic()
    await j.remove("r1")
    took = time.monotonic() - t0
    await asyncio.sleep(0.05)
    assert started.is_set() and took < 0.05, f"remove held its caller {took:.2f} s"
    assert "r1" not in j._seq and j._removed == [7]  # the tombstone goes on in the background
    t0 = time.monotonic()
    await j.flush(timeout=0.2)  # a scheduler stepping down waits for it, bounded
    assert time.monotonic() - t0 < 0.5
    j._flusher.cancel()


async def test_a_cancel_lost_to_a_disconnect_is_sent_once_the_bus_is_back(monkeypatch):
    from gateway import pipeline
    from gateway.frontend import Frontend, FrontendConfig, Submitted

    monkeypatch.setattr(pipeline, "CANCEL_RESEND_POLL_S", 0.02)
    bus = MemoryBus()
    fe = Frontend(bus, resolver=None, cfg=FrontendConfig("gw-1"))
    await fe.start()
    entry = fe.table.open("r", time.time() + 5, 5.0)
    sub = Submitted(entry, "r", "chat", "m", "1", {"gateway_in": time.time()}, 1)
    run = asyncio.create_task(pipeline.run(fe, sub, {"model": "m"}))
    await asyncio.sleep(0.05)
    bus.disconnect()  # the gateway fails its streams (bus_disconnected); the cancel cannot be published
    out = await asyncio.wait_for(run, 2)
    assert out.status == 503 and out.failure.code == "bus_disconnected"
    sent = lambda: [Cancel.decode(d).request_id for s, d in bus.published if s == subjects.cancel("r")]  # noqa: E731
    assert sent() == []
    bus.connected = True  # reconnected
    t_end = time.monotonic() + 2
    while not sent() and time.monotonic() < t_end:
        await asyncio.sleep(0.02)
    assert sent() == ["r"], "the cancel was never sent after the bus came back"


async def test_a_job_interrupted_by_the_bus_runs_again_without_waiting_for_redelivery(monkeypatch):
    from actors.jobs import service

    monkeypatch.setattr(service, "BUS_RETRY_S", 0.05)
    calls = []

    async def run(job):
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise TimeoutError() if len(calls) == 1 else BusDisconnected("NATS is not connected")

    acked = []

    class Msg:
        data = b'{"id": "job_1", "tenant": "t"}'

        async def ack(self):
            acked.append(True)

        async def in_progress(self):
            pass

    svc = service.JobsService(js=None, frontend=None)
    svc.run = run
    t0 = time.monotonic()
    await svc._handle(Msg())
    assert len(calls) == 3 and acked == [True] and time.monotonic() - t0 < 1.0
