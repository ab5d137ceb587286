"""Scheduler side of latency isolation (issue [17], in-memory bus, a recording worker): priority class
before fair share in preemption, the ``urgent`` flag, deadline refusal from the predicted completion and
the per-tenant service counters fed by heartbeats."""

from __future__ import annotations

import asyncio
import time

import orjson

from actors.scheduler.service import SchedulerConfig, SchedulerService
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import Credits, Dispatch, DispatchAck, GenerateRequest, SamplingParams


def req(rid: str, tenant: str, priority: str = "interactive", max_tokens: int = 4, deadline_s: float = 30,
        ignore_eos: bool = False) -> GenerateRequest:
    return GenerateRequest(rid, tenant, "m", "1", f"_INBOX.{tenant}.{rid}", (1, 2, 3),
                           SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), priority=priority,
                           deadline=time.time() + deadline_s)


async def started(slots: int, **credit_fields) -> tuple[MemoryBus, SchedulerService, list]:
    """Scheduler for m@1 and one leased worker "w1" with ``slots`` free slots that acks every dispatch
    into the returned list as (request id, preempted id, urgent)."""
    bus, sent = MemoryBus(), []
    svc = SchedulerService(bus, SchedulerConfig("m", "1", drain_s=0.2))
    await svc.start()

    async def on(msg):
        d = Dispatch.decode(msg.data)
        sent.append((d.request.request_id, d.preempt, d.urgent))
        await msg.respond(DispatchAck(True).encode())
    await bus.subscribe(subjects.work("w1"), on)
    svc.on_worker_lease("w1", True)
    await credits(bus, slots, slots, **credit_fields)
    await asyncio.sleep(0.05)  # the heartbeat is handled
    return bus, svc, sent


async def credits(bus: MemoryBus, free: int, total: int, **fields) -> None:
    await bus.publish(subjects.credits("m", "1", "w1"), Credits("w1", "m", "1", 100, 100, free, total, 16,
                                                                **fields).encode())


async def submit(bus: MemoryBus, r: GenerateRequest) -> dict:
    return orjson.loads((await bus.request(subjects.sched_submit("m", "1"), r.encode(), 1.0)).data)


async def batch_filled(slots: int, tenant: str) -> tuple[MemoryBus, SchedulerService, list]:
    """A started scheduler whose one worker's ``slots`` slots all run batch requests b0.. of ``tenant``."""
    bus, svc, sent = await started(slots)
    for i in range(slots):
        await submit(bus, req(f"b{i}", tenant, "batch"))
    await asyncio.sleep(0.2)
    await credits(bus, 0, slots)
    return bus, svc, sent


async def test_interactive_displaces_batch_and_batch_never_displaces_interactive():
    bus, svc, sent = await batch_filled(4, "D")
    await submit(bus, req("i0", "C"))  # an interactive tenant arrives: takes D's newest batch request
    await asyncio.sleep(0.2)
    assert sent[-1] == ("i0", "b3", True)
    await submit(bus, req("b9", "E", "batch"))  # a batch newcomer below its share finds only ...
    await asyncio.sleep(0.2)
    assert sent[-1] == ("b9", "b2", True)  # ... batch work of the over-share tenant to displace
    await credits(bus, 0, 4)
    await submit(bus, req("b10", "E", "batch"))  # E still below its 2 fair slots (of 4, three tenants)
    await submit(bus, req("b11", "E", "batch"))  # E at its share: waits
    await asyncio.sleep(0.2)
    assert sent[-1][0] == "b10" and sent[-1][1] in ("b0", "b1", "b3") and all(p != "i0" for _, p, _ in sent)
    assert "b11" not in [r for r, _, _ in sent]
    await svc.stop(fail_queued=False)


async def test_an_interactive_tenant_alone_with_its_own_batch_work_still_goes_first():
    bus, svc, sent = await batch_filled(2, "A")
    await submit(bus, req("i0", "A"))
    await asyncio.sleep(0.2)
    assert sent[-1] == ("i0", "b1", True) and svc.num_preemptions == 1
    await svc.stop(fail_queued=False)


async def test_deadline_refusal_predicts_the_requests_own_decode_at_the_measured_step_time():
    bus, svc, sent = await started(8, step_ms=50.0, prefill_tokens_per_s=1000.0)
    # 100 decode steps of 50 ms = 5 s > a 2 s deadline: refused at once, even with an empty queue
    ack = await submit(bus, req("slow", "A", max_tokens=100, deadline_s=2, ignore_eos=True))
    assert not ack["accepted"] and ack["error"]["code"] == "deadline_unmeetable" and ack["error"]["status"] == 503
    assert ack["error"]["retry_after"] > 0
    assert (await submit(bus, req("fast", "A", max_tokens=10, deadline_s=2, ignore_eos=True)))["accepted"]
    await svc.stop(fail_queued=False)


async def test_heartbeats_feed_per_tenant_service_counters_and_shares():
    bus, svc, _ = await started(8, served={"A": [30, 10], "B": [10, 5]})
    await asyncio.sleep(0.05)
    rows = {(r[1]["tenant"], r[1]["kind"]): r[0] for r in svc.service_rows()}
    assert rows == {("A", "prompt"): 30, ("A", "completion"): 10, ("B", "prompt"): 10, ("B", "completion"): 5}
    shares = {r[1]["tenant"]: r[0] for r in svc.share_rows()[0]}
    assert abs(shares["A"] - 50 / 70) < 1e-9 and abs(shares["B"] - 20 / 70) < 1e-9
    await svc.stop(fail_queued=False)


async def test_a_queued_request_that_can_no_longer_finish_is_ended_instead_of_dispatched():
    bus, svc, sent = await started(0, step_ms=200.0)  # no free slot: the request waits in the queue
    chunks: list = []

    async def on(msg):
        chunks.append(orjson.loads(msg.data))
    await bus.subscribe("_INBOX.A.late", on)
    # 10 steps of 200 ms = 2 s: it fits a 2.5 s deadline now, and no longer after ~0.5 s in the queue
    assert (await submit(bus, req("late", "A", max_tokens=10, deadline_s=2.5, ignore_eos=True)))["accepted"]
    t0 = time.monotonic()
    while not chunks and time.monotonic() - t0 < 3:
        await asyncio.sleep(0.05)
    assert chunks and chunks[0]["error"]["code"] == "deadline_unmeetable", chunks
    assert 0.4 < time.monotonic() - t0 < 1.5 and not sent  # ended about when it became hopeless, never dispatched
    await svc.stop(fail_queued=False)


async def test_a_deadline_refusal_carries_the_hints_a_gateway_sheds_with():
    bus, svc, _ = await started(8, step_ms=50.0)
    ack = await submit(bus, req("slow", "A", max_tokens=100, deadline_s=2, ignore_eos=True))
    err = ack["error"]
    assert err["code"] == "deadline_unmeetable" and abs(err["decode_step_s"] - 0.05) < 1e-9
    assert abs(err["queue_clear_at"] - time.time()) < 1.0  # nothing queued: the queue is clear now
    await svc.stop(fail_queued=False)


async def test_a_victim_is_chosen_again_once_its_worker_no_longer_lists_it_paused():
    bus, svc, sent = await batch_filled(4, "D")
    await submit(bus, req("i0", "C"))
    await asyncio.sleep(0.2)
    assert sent[-1][:2] == ("i0", "b3")
    await credits(bus, 0, 4, num_waiting=1, paused=["b3"])  # b3 waits to resume: not a victim again
    await submit(bus, req("i1", "C"))
    await asyncio.sleep(0.2)
    assert sent[-1][:2] == ("i1", "b2")
    await credits(bus, 0, 4, num_waiting=1, paused=["b2"])  # b3 runs again (the waiting one is b2)
    await submit(bus, req("i2", "C"))
    await asyncio.sleep(0.2)
    assert sent[-1][:2] == ("i2", "b3")
    await svc.stop(fail_queued=False)
