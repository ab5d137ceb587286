"""Fair-share preemption across scheduler and worker logic (in-memory bus; the worker runs the real
engine on the tiny GGUF model): a tenant below its fair slots displaces the newest request of a tenant
above its share, and the displaced request resumes and completes with all its tokens."""

from __future__ import annotations

import asyncio
import time

from actors.scheduler.service import SchedulerConfig, SchedulerService
from actors.worker.service import WorkerConfig, WorkerService
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import CompletionRecord, Credits, Dispatch, DispatchAck, GenerateRequest, SamplingParams
from tests.actor.test_worker_service import collect, engine, gen, tiny_path, wait_final  # noqa: F401


def treq(rid: str, tenant: str) -> GenerateRequest:
    return GenerateRequest(rid, tenant, "m", "1", f"_INBOX.{tenant}.{rid}", (1, 2, 3), SamplingParams(max_tokens=4),
                           deadline=time.time() + 30)


async def full_worker(bus: MemoryBus, wid: str, dispatches: list) -> None:
    """A worker that acks every dispatch, recording (request id, preempted id)."""
    async def on(msg):
        d = Dispatch.decode(msg.data)
        dispatches.append((d.request.request_id, d.preempt))
        await msg.respond(DispatchAck(True).encode())
    await bus.subscribe(subjects.work(wid), on)


async def scheduler_with_worker() -> tuple[MemoryBus, SchedulerService, list]:
    """A started scheduler for m@1 with one leased worker "w1" that acks every dispatch into ``sent``."""
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1", drain_s=0.2))
    await svc.start()
    sent: list = []
    await full_worker(bus, "w1", sent)
    svc.on_worker_lease("w1", True)
    return bus, svc, sent


async def test_scheduler_preempts_the_over_share_tenant_up_to_the_fair_split():
    bus, svc, sent = await scheduler_with_worker()
    await bus.publish(subjects.credits("m", "1", "w1"), Credits("w1", "m", "1", 100, 100, 8, 8, 16).encode())
    await bus.request(subjects.sched_submit("m", "1"), treq("l0", "light").encode(), 1.0)
    for i in range(12):
        await bus.request(subjects.sched_submit("m", "1"), treq(f"h{i}", "heavy").encode(), 1.0)
    await asyncio.sleep(0.3)
    assert [r for r, _ in sent] == ["l0"] + [f"h{i}" for i in range(7)] and all(not p for _, p in sent)
    await bus.publish(subjects.credits("m", "1", "w1"), Credits("w1", "m", "1", 90, 100, 0, 8, 16).encode())
    for i in range(1, 6):
        await bus.request(subjects.sched_submit("m", "1"), treq(f"l{i}", "light").encode(), 1.0)
    await asyncio.sleep(0.3)
    # light holds 1 of its 4 fair slots: l1..l3 each displace heavy's newest; l4 (light at 4) waits
    assert sent[8:] == [("l1", "h6"), ("l2", "h5"), ("l3", "h4")] and svc.num_preemptions == 3
    await bus.publish(subjects.done("m", "1"), CompletionRecord("l0", "light", "m", "1", "ok", "length", 3, 4,
                                                                {}).encode())
    await asyncio.sleep(0.3)
    assert ("l4", "h3") in sent  # light is below its share again
    await svc.stop(fail_queued=False)


async def test_fcfs_or_disabled_preemption_never_preempts():
    for cfg in (SchedulerConfig("m", "1", drain_s=0.2, fcfs=True), SchedulerConfig("m", "1", drain_s=0.2,
                                                                                    preemption=False)):
        bus = MemoryBus()
        svc = SchedulerService(bus, cfg)
        await svc.start()
        sent: list = []
        await full_worker(bus, "w1", sent)
        svc.on_worker_lease("w1", True)
        await bus.publish(subjects.credits("m", "1", "w1"), Credits("w1", "m", "1", 100, 100, 2, 2, 16).encode())
        for rid, t in (("h0", "heavy"), ("h1", "heavy"), ("l0", "light")):
            await bus.request(subjects.sched_submit("m", "1"), treq(rid, t).encode(), 1.0)
        await asyncio.sleep(0.3)
        assert all(not p for _, p in sent) and "l0" not in [r for r, _ in sent]
        await svc.stop(fail_queued=False)


async def test_worker_displaces_the_victim_which_resumes_and_completes(tiny_path):
    bus = MemoryBus()
    svc = WorkerService(bus, engine(tiny_path), WorkerConfig("w1", "m", "1"))  # 4 slots
    async with svc:
        streams = {r: await collect(bus, f"_INBOX.t.{r}") for r in ("a0", "a1", "a2", "a3", "b0", "b1")}
        for i in range(4):
            assert await dispatch_to(bus, gen(f"a{i}", max_tokens=40))
        async with asyncio.timeout(10):
            while not streams["a3"]:
                await asyncio.sleep(0.01)
        assert not await dispatch_to(bus, gen("b1", max_tokens=4))  # full, no victim named: refused
        assert not await dispatch_to(bus, gen("b1", max_tokens=4), preempt="nope")  # unknown victim: refused
        assert await dispatch_to(bus, gen("b0", max_tokens=4), preempt="a3")
        await wait_final(streams["b0"])
        assert not streams["a3"][-1].final  # b0 finished while the displaced a3 waited
        for r in ("a0", "a1", "a2", "a3"):
            await wait_final(streams[r], timeout=30)
        got = {r: sum(len(c.token_ids) for c in streams[r]) for r in ("a0", "a1", "a2", "a3", "b0")}
        assert got == {"a0": 40, "a1": 40, "a2": 40, "a3": 40, "b0": 4}
        assert all(c.error is None for r in got for c in streams[r])
        assert svc.engine.stats().extra["num_preemptions"] == 1


async def dispatch_to(bus, r: GenerateRequest, preempt: str = "") -> bool:
    reply = await bus.request(subjects.work("w1"), Dispatch(r, "s", preempt).encode(), 1.0)
    return DispatchAck.decode(reply.data).accepted


async def test_a_resumed_victim_may_be_preempted_again_once_its_worker_has_nothing_waiting():
    bus, svc, sent = await scheduler_with_worker()

    async def credits(free: int, waiting: int) -> None:
        await bus.publish(subjects.credits("m", "1", "w1"),
                          Credits("w1", "m", "1", 90, 100, free, 4, 16, num_waiting=waiting).encode())

    async def submit(rid: str, tenant: str) -> None:
        await bus.request(subjects.sched_submit("m", "1"), treq(rid, tenant).encode(), 1.0)

    async def done(rid: str, tenant: str) -> None:
        await bus.publish(subjects.done("m", "1"), CompletionRecord(rid, tenant, "m", "1", "ok", "length", 3, 4,
                                                                    {}).encode())
    await credits(4, 0)
    await submit("l0", "light")
    await asyncio.sleep(0.1)
    await done("l0", "light")
    for i in range(3):  # 4 slots: heavy's cap is 3, fair share 2 each
        await submit(f"h{i}", "heavy")
    await asyncio.sleep(0.2)
    await credits(0, 0)
    await submit("l1", "light")
    await asyncio.sleep(0.2)
    await done("l1", "light")
    await credits(0, 1)  # h2 paused on the worker
    await submit("l2", "light")
    await asyncio.sleep(0.2)
    assert sent[-2:] == [("l1", "h2"), ("l2", "h1")]  # h2 is paused: not chosen again
    await done("l2", "light")
    await credits(0, 0)  # both resumed: nothing waits on the worker any more
    await asyncio.sleep(0.1)
    await submit("l3", "light")
    await asyncio.sleep(0.2)
    assert sent[-1] == ("l3", "h2")
    await svc.stop(fail_queued=False)


async def test_the_victim_is_the_newest_request_already_decoding_and_a_refusal_tries_the_next_at_once():
    import orjson

    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1", drain_s=0.2))
    await svc.start()
    sent: list = []

    async def worker(msg):  # refuses to displace h4 (say, not admitted into its batch yet)
        d = Dispatch.decode(msg.data)
        sent.append((d.request.request_id, d.preempt))
        await msg.respond(DispatchAck(d.preempt != "h4").encode())
    await bus.subscribe(subjects.work("w1"), worker)
    svc.on_worker_lease("w1", True)
    await bus.publish(subjects.credits("m", "1", "w1"), Credits("w1", "m", "1", 100, 100, 8, 8, 16).encode())
    await bus.request(subjects.sched_submit("m", "1"), treq("l0", "light").encode(), 1.0)
    for i in range(7):
        await bus.request(subjects.sched_submit("m", "1"), treq(f"h{i}", "heavy").encode(), 1.0)
    await asyncio.sleep(0.2)
    for rid in ("h3", "h4"):  # h3 and h4 are decoding; h5, h6 have not streamed a token yet
        await bus.publish(subjects.sched_events("m", "1"), orjson.dumps({"event": "first_token", "request_id": rid}))
    await bus.publish(subjects.credits("m", "1", "w1"), Credits("w1", "m", "1", 90, 100, 0, 8, 16).encode())
    await asyncio.sleep(0.05)
    await bus.request(subjects.sched_submit("m", "1"), treq("l1", "light").encode(), 1.0)
    async with asyncio.timeout(1):
        while ("l1", "h3") not in sent:
            await asyncio.sleep(0.005)
    assert sent[8:] == [("l1", "h4"), ("l1", "h3")]  # newest decoding first; refused -> the next one
    await svc.stop(fail_queued=False)
