"""The scheduler's load report and scale-from-zero hold (actors/scheduler/load.py) on the in-memory bus: a request
for a version with no worker waits for one (cold_start_waiting), or -- scale-to-zero versions only -- gets 503
``cold_start`` + Retry-After at once when its deadline cannot allow a cold start."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from actors.scheduler.load import DEFAULT_COLD_START_S, RateWindow, SchedulerLoad, cold_start_refusal, scale_to_zero_of
from actors.scheduler.service import SchedulerConfig, SchedulerService
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import ActorLoad, Credits, Dispatch, DispatchAck, GenerateRequest, SamplingParams


def req(i: int, deadline_s: float = 60.0, max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(f"r{i}", "t", "m", "1", "_INBOX.t.r", (1, 2, 3), SamplingParams(max_tokens=max_tokens),
                           deadline=time.time() + deadline_s)


async def submit(bus, r: GenerateRequest) -> dict:
    return orjson.loads((await bus.request(subjects.sched_submit("m", "1"), r.encode(), 1.0)).data)


async def scheduler(scale_to_zero: bool) -> tuple[MemoryBus, SchedulerService]:
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1", scheduler_id="sched-t"))
    await svc.start()
    svc.load.scale_to_zero = scale_to_zero
    svc.load.started -= 10.0  # past the new term's grace (its worker table is complete)
    return bus, svc


def test_pure_parts():
    assert cold_start_refusal(deadline=100.0, now=90.0, own_s=0.0, cold_start_left_s=20.0)
    assert not cold_start_refusal(deadline=130.0, now=90.0, own_s=5.0, cold_start_left_s=20.0)
    assert cold_start_refusal(deadline=112.0, now=90.0, own_s=5.0, cold_start_left_s=20.0)  # 22 - 5 < 20
    assert not cold_start_refusal(deadline=0.0, now=90.0, own_s=0.0, cold_start_left_s=20.0)  # no deadline: wait
    w = RateWindow(5.0)
    w.add(0.0, 50.0)
    w.add(4.0, 50.0)
    assert w.rate(4.0) == 20.0 and w.rate(6.0) == 10.0
    assert scale_to_zero_of({"autoscale": {"scale_to_zero": True}}) and not scale_to_zero_of({"autoscale": {}})
    assert not scale_to_zero_of(None) and not scale_to_zero_of({"autoscale": {"scale_to_zero": "yes"}})


async def test_without_scale_to_zero_a_request_is_held_for_a_worker_and_reported():
    bus, svc = await scheduler(scale_to_zero=False)
    assert (await submit(bus, req(1, deadline_s=5.0)))["accepted"]  # short deadline: still held (old behaviour)
    extras = svc.load.extras()
    assert (extras["workers"], extras["queue_len"], extras["cold_start_waiting"]) == (0, 1, 1)
    assert extras["queue_tokens"] == 8.0 and extras["arrivals_tokens_per_s"] > 0
    got: list[str] = []

    async def worker(msg):
        got.append(Dispatch.decode(msg.data).request.request_id)
        await msg.respond(DispatchAck(True).encode())
    await bus.subscribe(subjects.work("w1"), worker)
    svc.load._zero_since -= 7.0  # the request has waited 7 s for the worker
    svc.on_worker_lease("w1", True)
    await bus.publish(subjects.credits("m", "1", "w1"), Credits("w1", "m", "1", 100, 100, 4, 4, 16).encode())
    for _ in range(50):
        if got:
            break
        await asyncio.sleep(0.02)
    assert got == ["r1"]
    svc.load.check()
    assert svc.load.measured_cold_start_s == pytest.approx(7.0, abs=0.5)  # first held request -> first worker
    assert svc.load.extras()["cold_start_waiting"] == 0 and svc.load.extras()["workers"] == 1
    await svc.stop(fail_queued=False)


async def test_scale_to_zero_refuses_what_cannot_wait_for_a_cold_start():
    bus, svc = await scheduler(scale_to_zero=True)
    ack = await submit(bus, req(1, deadline_s=5.0))
    assert not ack["accepted"]
    err = ack["error"]
    assert (err["status"], err["code"], err["retryable"]) == (503, "cold_start", True)
    assert DEFAULT_COLD_START_S - 1 <= err["retry_after"] <= DEFAULT_COLD_START_S
    assert (await submit(bus, req(2, deadline_s=60.0)))["accepted"]  # 60 s allows a 20 s cold start
    assert svc.load.refused == 1 and len(svc.queue) == 1
    assert svc.load.extras()["arrivals_tokens_per_s"] == pytest.approx(16 / 5.0)  # the refused one is demand too
    svc.load.measured_cold_start_s = 3.0  # measured: a faster cold start
    assert (await submit(bus, req(3, deadline_s=5.0)))["accepted"]
    await svc.stop(fail_queued=False)


async def test_a_young_term_never_refuses():
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"))
    await svc.start()
    svc.load.scale_to_zero = True  # the term just began: its worker list may not be loaded yet
    assert (await submit(bus, req(1, deadline_s=5.0)))["accepted"]
    await svc.stop(fail_queued=False)


async def test_the_scheduler_publishes_its_load_report():
    bus, svc = await scheduler(scale_to_zero=False)
    got: list[ActorLoad] = []

    async def on(msg):
        got.append(ActorLoad.decode(msg.data))
    await bus.subscribe(subjects.LOAD_ALL, on)
    await submit(bus, req(1))
    for _ in range(80):
        if got:
            break
        await asyncio.sleep(0.025)
    await svc.stop(fail_queued=False)
    assert got, "no load report within 2 s"
    r = got[0]
    assert (r.kind, r.actor_id, r.name, r.version, r.queue_len, r.cold_start_waiting) == \
        ("scheduler", "sched-t", "m", "1", 1, 1)


async def test_follow_reads_scale_to_zero_from_the_manifest():
    class Reg:
        manifest = {"autoscale": {"scale_to_zero": True}}

        async def get_model_version(self, name, version):
            return self.manifest

    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"))
    load = SchedulerLoad(svc)
    load.follow(Reg(), poll_s=0.01)
    await asyncio.sleep(0.05)
    assert load.scale_to_zero is True
    await load.stop()
