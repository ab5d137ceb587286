"""Scheduler actor logic on the in-memory bus: admission, credits, worker loss."""

from __future__ import annotations

import asyncio
import time

import orjson

from actors.scheduler.service import SchedulerConfig, SchedulerService
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import Chunk, CompletionRecord, Credits, Dispatch, DispatchAck, GenerateRequest, SamplingParams


def req(i: int, reply: str = "_INBOX.t.r") -> GenerateRequest:
    return GenerateRequest(f"r{i}", "t", "m", "1", reply, (1, 2, 3), SamplingParams(max_tokens=4),
                           deadline=time.time() + 30)


async def fake_worker(bus: MemoryBus, wid: str, accepted: list) -> None:
    async def on(msg):
        d = Dispatch.decode(msg.data)
        accepted.append(d.request.request_id)
        await msg.respond(DispatchAck(True).encode())
    await bus.subscribe(subjects.work(wid), on)


async def heartbeat(bus, wid, slots, blocks=100):
    await bus.publish(subjects.credits("m", "1", wid), Credits(wid, "m", "1", blocks, 100, slots, 8, 16).encode())


async def draining_worker(bus, svc) -> None:
    """A leased worker whose credits show free slots but which drains: a submit counts on its slot (direct
    dispatch), yet nothing is dispatched to it, so the submit stays queued."""
    svc.on_worker_lease("w1", True)
    await bus.publish(subjects.credits("m", "1", "w1"),
                      Credits("w1", "m", "1", 100, 100, 2, 8, 16, draining=True).encode())
    await asyncio.sleep(0.05)


async def submit(bus, r: GenerateRequest) -> dict:
    return orjson.loads((await bus.request(subjects.sched_submit("m", "1"), r.encode(), 1.0)).data)


async def collect(bus, subject) -> list:
    got = []

    async def on(msg):
        got.append(Chunk.decode(msg.data))
    await bus.subscribe(subject, on)
    return got


async def test_queue_full_is_503_with_retry_after():
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1", max_queue_len=2))
    await svc.start()
    acks = [await submit(bus, req(i)) for i in range(3)]  # no worker: all stay queued
    assert [a["accepted"] for a in acks] == [True, True, False]
    assert acks[2]["error"]["status"] == 503 and acks[2]["error"]["retry_after"] >= 1
    await svc.stop()


async def test_dispatch_only_within_credits():
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"))
    await svc.start()
    accepted: list = []
    await fake_worker(bus, "w1", accepted)
    svc.on_worker_lease("w1", True)
    await heartbeat(bus, "w1", slots=2)
    for i in range(5):
        await submit(bus, req(i))
    await asyncio.sleep(0.3)
    assert accepted == ["r0", "r1"]  # two slots, two dispatches
    await heartbeat(bus, "w1", slots=3)
    await asyncio.sleep(0.3)
    assert accepted == ["r0", "r1", "r2", "r3", "r4"]
    await svc.stop()


async def test_a_resubmitted_request_is_acked_once_queued_and_dispatched_once():
    # a validator retries a submit whose ack it did not hear (actors/validator/service.py _submit): same id,
    # same validation (validate_out mark)
    from dataclasses import replace
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"))
    await svc.start()
    first = replace(req(1), marks={"validate_out": 100.0})
    acks = [await submit(bus, first) for _ in range(3)]  # no worker yet: queued once
    assert all(a["accepted"] for a in acks) and len(svc.queue) == 1
    accepted: list = []
    await fake_worker(bus, "w1", accepted)
    svc.on_worker_lease("w1", True)
    await heartbeat(bus, "w1", slots=4)
    await asyncio.sleep(0.3)
    assert (await submit(bus, first))["accepted"]  # dispatched: still one copy
    await bus.publish(subjects.done("m", "1"), CompletionRecord("r1", "t", "m", "1", "ok", "stop", 3, 4, {},
                                                                ts=time.time()).encode())
    await asyncio.sleep(0.1)
    assert (await submit(bus, first))["accepted"]  # finished lately: not run again
    await asyncio.sleep(0.3)
    assert accepted == ["r1"]
    # the same id validated again (a client's new attempt, e.g. one Idempotency-Key of the Responses API)
    # is a new submit: it runs
    assert (await submit(bus, replace(req(1), marks={"validate_out": 101.0})))["accepted"]
    await asyncio.sleep(0.3)
    assert accepted == ["r1", "r1"]
    await svc.stop()


async def test_worker_loss_redispatches_unstarted_and_fails_started():
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"))
    await svc.start()
    chunks = await collect(bus, "_INBOX.t.r")
    on_w1: list = []
    await fake_worker(bus, "w1", on_w1)
    svc.on_worker_lease("w1", True)
    await heartbeat(bus, "w1", slots=2)
    await submit(bus, req(1))
    await submit(bus, req(2))
    await asyncio.sleep(0.2)
    assert on_w1 == ["r1", "r2"]
    await bus.publish(subjects.sched_events("m", "1"), b'{"request_id":"r2","event":"first_token"}')
    await asyncio.sleep(0.05)
    on_w2: list = []
    await fake_worker(bus, "w2", on_w2)
    svc.on_worker_lease("w2", True)
    await heartbeat(bus, "w2", slots=4)
    svc.table.workers["w1"].last_credit_ts -= 10  # a dead worker's heartbeats stopped before its lease expired
    svc.on_worker_lease("w1", False)  # lease expired
    await asyncio.sleep(0.3)
    assert on_w2 == ["r1"]  # not started: re-dispatched
    [err] = [c for c in chunks if c.request_id == "r2"]
    assert err.final and err.error["status"] == 503 and err.error["retryable"]  # started: clear retryable error
    await svc.stop()


async def test_unleased_worker_still_heartbeating_keeps_its_requests_and_gets_no_new_ones():
    """A worker that revoked its lease to drain (or lost it in an etcd outage) but still heartbeats: its
    requests finish there (no error, no re-dispatch), new ones go elsewhere; lost only once heartbeats stop."""
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1", credit_stale_s=0.5))
    await svc.start()
    chunks = await collect(bus, "_INBOX.t.r")
    on_w1: list = []
    on_w2: list = []
    await fake_worker(bus, "w1", on_w1)
    svc.on_worker_lease("w1", True)
    await heartbeat(bus, "w1", slots=2)
    await submit(bus, req(1))
    await submit(bus, req(2))
    await asyncio.sleep(0.2)
    assert on_w1 == ["r1", "r2"]
    await bus.publish(subjects.sched_events("m", "1"), b'{"request_id":"r2","event":"first_token"}')
    await heartbeat(bus, "w1", slots=4)
    assert svc.on_worker_lease("w1", False) == []  # lease revoked (drain): nothing re-dispatched or failed
    await fake_worker(bus, "w2", on_w2)
    svc.on_worker_lease("w2", True)
    await heartbeat(bus, "w2", slots=4)
    await submit(bus, req(3))
    await asyncio.sleep(0.2)
    assert on_w1 == ["r1", "r2"] and on_w2 == ["r3"]  # new work only to the leased worker
    assert chunks == []
    for _ in range(8):  # w2 keeps heartbeating, w1 stops (it died after all)
        await heartbeat(bus, "w2", slots=4)
        await asyncio.sleep(0.1)
    assert on_w2 == ["r3", "r1"]  # r1 had no token yet: re-dispatched
    [err] = [c for c in chunks if c.request_id == "r2"]
    assert err.final and err.error["code"] == "worker_lost" and err.error["retryable"]
    await svc.stop()


async def test_lease_back_after_etcd_outage_keeps_in_flight_requests():
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"))
    await svc.start()
    chunks = await collect(bus, "_INBOX.t.r")
    on_w1: list = []
    await fake_worker(bus, "w1", on_w1)
    svc.on_worker_lease("w1", True)
    await heartbeat(bus, "w1", slots=2)
    await submit(bus, req(1))
    await asyncio.sleep(0.2)
    svc.on_worker_lease("w1", False)  # expired during the outage
    svc.on_worker_lease("w1", True)  # registered again
    await heartbeat(bus, "w1", slots=2)
    await submit(bus, req(2))
    await asyncio.sleep(0.2)
    assert on_w1 == ["r1", "r2"] and chunks == []
    assert set(svc.table.workers["w1"].inflight) == {"r1", "r2"}
    await svc.stop()


async def test_expired_in_queue_gets_deadline_error():
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"))
    await svc.start()
    chunks = await collect(bus, "_INBOX.t.r")
    r = GenerateRequest("late-2", "t", "m", "1", "_INBOX.t.r", (1,), SamplingParams(), deadline=time.time() + 0.2,
                        choice_index=2)
    assert (await submit(bus, r))["accepted"]
    await asyncio.sleep(0.5)
    assert chunks and chunks[0].error["code"] == "deadline_exceeded"
    assert chunks[0].choice_index == 2  # the gateway merges it into the right choice
    await svc.stop()


async def test_prompt_larger_than_any_kv_cache_is_refused_not_blocking():
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"))
    await svc.start()
    chunks = await collect(bus, "_INBOX.t.r")
    accepted: list = []
    await fake_worker(bus, "w1", accepted)
    svc.on_worker_lease("w1", True)
    await bus.publish(subjects.credits("m", "1", "w1"), Credits("w1", "m", "1", 4, 4, 8, 8, 16).encode())
    big = GenerateRequest("big", "t", "m", "1", "_INBOX.t.r", tuple(range(64)), SamplingParams(),
                          deadline=time.time() + 30)
    await submit(bus, big)
    await submit(bus, req(1))
    await asyncio.sleep(0.3)
    [err] = [c for c in chunks if c.request_id == "big"]
    assert err.error["status"] == 400 and err.error["code"] == "context_length_exceeded"
    assert accepted == ["r1"]  # the request behind it was not blocked
    await svc.stop()


def treq(rid: str, tenant: str, priority: str = "interactive") -> GenerateRequest:
    return GenerateRequest(rid, tenant, "m", "1", "_INBOX.t.r", (1, 2, 3), SamplingParams(max_tokens=4), priority,
                           time.time() + 30)


async def test_fair_share_and_priority_decide_dispatch_order():
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"))
    await svc.start()
    for i in range(6):
        await submit(bus, treq(f"a{i}", "heavy"))
    await submit(bus, treq("b0", "light"))
    await submit(bus, treq("x0", "bulk", "batch"))
    await submit(bus, treq("b1", "light"))
    accepted: list = []
    await fake_worker(bus, "w1", accepted)
    svc.on_worker_lease("w1", True)
    for _ in range(9):
        await heartbeat(bus, "w1", slots=1)
        await asyncio.sleep(0.05)
    assert accepted.index("b0") <= 1 and accepted.index("b1") <= 3  # FCFS would put them 7th and 9th
    assert accepted[-1] == "x0"  # batch class only after every interactive request
    await svc.stop()


async def test_tenant_queue_full_is_429_others_unaffected():
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1", max_queue_per_tenant=2))
    await svc.start()
    acks = [await submit(bus, treq(f"a{i}", "heavy")) for i in range(3)]
    assert [a["accepted"] for a in acks] == [True, True, False]
    assert acks[2]["error"]["status"] == 429 and acks[2]["error"]["retry_after"] >= 1
    assert (await submit(bus, treq("b0", "light")))["accepted"]
    await svc.stop()


async def test_heavy_tenant_leaves_headroom_for_a_newcomer():
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1", drain_s=0.2))
    await svc.start()
    accepted: list = []
    await fake_worker(bus, "w1", accepted)
    svc.on_worker_lease("w1", True)
    await bus.publish(subjects.credits("m", "1", "w1"), Credits("w1", "m", "1", 100, 100, 8, 8, 16).encode())
    await submit(bus, treq("c0", "other"))  # a second tenant was active recently: the cap applies
    await asyncio.sleep(0.1)
    await bus.publish(subjects.done("m", "1"), CompletionRecord("c0", "other", "m", "1", "ok", "stop", 3, 4,
                                                                {}).encode())
    for i in range(12):
        await submit(bus, treq(f"a{i}", "heavy"))
    await asyncio.sleep(0.3)
    assert accepted == ["c0"] + [f"a{i}" for i in range(7)]  # 8 slots: heavy holds 7, one kept free
    await bus.publish(subjects.credits("m", "1", "w1"), Credits("w1", "m", "1", 90, 100, 1, 8, 16).encode())
    await asyncio.sleep(0.1)
    assert len(accepted) == 8  # the free slot stays free for others
    await submit(bus, treq("b0", "light"))
    await asyncio.sleep(0.3)
    assert accepted[-1] == "b0"  # the newcomer starts at once, no preemption needed
    await svc.stop()


async def test_single_tenant_may_use_every_slot():
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1", drain_s=0.2))
    await svc.start()
    accepted: list = []
    await fake_worker(bus, "w1", accepted)
    svc.on_worker_lease("w1", True)
    await bus.publish(subjects.credits("m", "1", "w1"), Credits("w1", "m", "1", 100, 100, 8, 8, 16).encode())
    for i in range(10):
        await submit(bus, treq(f"a{i}", "solo"))
    await asyncio.sleep(0.3)
    assert len(accepted) == 8
    await svc.stop()


async def test_standby_recovers_queued_requests_from_the_journal():
    from bus.journal import MemoryJournal
    bus, journal = MemoryBus(), MemoryJournal()
    first = SchedulerService(bus, SchedulerConfig("m", "1"), journal)
    await first.start()
    accepted: list = []
    await fake_worker(bus, "w1", accepted)
    first.on_worker_lease("w1", True)
    await heartbeat(bus, "w1", slots=1)
    for i in range(3):
        await submit(bus, req(i))
    await asyncio.sleep(0.2)
    assert accepted == ["r0"] and set(journal.entries) == {"r1", "r2"}  # dispatched ones leave the journal
    for t in first._tasks:  # the active dies (no graceful stop)
        t.cancel()
    for s in first._subs:
        await s.unsubscribe()
    second = SchedulerService(bus, SchedulerConfig("m", "1"), journal)
    await second.start()
    assert await second.recover() == 2
    second.on_worker_lease("w1", True)
    await heartbeat(bus, "w1", slots=2)
    await asyncio.sleep(0.3)
    assert accepted == ["r0", "r1", "r2"] and not journal.entries
    await second.stop()


async def test_shared_prefixes_stick_to_one_worker():
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"))
    await svc.start()
    on: dict[str, list] = {"w1": [], "w2": []}
    for wid in on:
        await fake_worker(bus, wid, on[wid])
        svc.on_worker_lease(wid, True)
        await heartbeat(bus, wid, slots=8)
    prefixes = {"p": tuple(range(64)), "q": tuple(range(100, 164))}
    for i in range(8):
        name = "pq"[i % 2]
        r = GenerateRequest(f"{name}{i}", "t", "m", "1", "_INBOX.t.r", prefixes[name] + (i,),
                            SamplingParams(max_tokens=4), deadline=time.time() + 30)
        await submit(bus, r)
        await asyncio.sleep(0.05)
    homes = {name: {w for w, got in on.items() if any(g.startswith(name) for g in got)} for name in "pq"}
    assert len(homes["p"]) == 1 and len(homes["q"]) == 1  # every request of a prefix on one worker
    await svc.stop()


async def test_cancel_while_queued_or_before_submit_ends_the_request_cancelled():
    from bus.messages import Cancel
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"))
    await svc.start()
    chunks = await collect(bus, "_INBOX.t.r")
    records: list = []

    async def on_done(msg):
        records.append(CompletionRecord.decode(msg.data))
    await bus.subscribe(subjects.done("m", "1"), on_done)
    assert (await submit(bus, req(1)))["accepted"]  # no worker: stays queued
    await bus.publish(subjects.cancel("r1"), Cancel("r1", "disconnect").encode())
    await bus.publish(subjects.cancel("r2"), Cancel("r2", "disconnect").encode())  # before its submit arrives
    assert (await submit(bus, req(2)))["accepted"]
    await asyncio.sleep(0.1)
    assert [(c.request_id, c.final, c.error["code"]) for c in chunks] == [("r1", True, "cancelled"),
                                                                            ("r2", True, "cancelled")]
    assert [(r.request_id, r.status) for r in records] == [("r1", "cancelled"), ("r2", "cancelled")]
    assert not svc.queue.contains("r1") and not svc.queue.contains("r2")
    await svc.stop()


async def test_cancel_from_another_tenant_is_ignored():
    from bus.messages import Cancel
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"))
    await svc.start()
    chunks = await collect(bus, "_INBOX.t.r")
    assert (await submit(bus, req(1)))["accepted"]  # tenant "t", queued (no worker)
    await bus.publish(subjects.cancel("r1"), Cancel("r1", "client", tenant="intruder").encode())
    await asyncio.sleep(0.1)
    assert svc.queue.contains("r1") and chunks == []
    await bus.publish(subjects.cancel("r1"), Cancel("r1", "client", tenant="t").encode())
    await asyncio.sleep(0.1)
    assert not svc.queue.contains("r1") and chunks[-1].error["code"] == "cancelled"
    await svc.stop()


async def test_stop_drains_the_queue_to_running_workers_before_failing_the_rest():
    """SIGTERM (version retired): submits stop, the queue keeps going to the workers while slots free up,
    and only what cannot be dispatched within drain_s ends with a retryable 503."""
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1", drain_s=1.0))
    await svc.start()
    accepted: list = []
    await fake_worker(bus, "w1", accepted)
    svc.on_worker_lease("w1", True)
    await heartbeat(bus, "w1", slots=1)
    chunks = await collect(bus, "_INBOX.t.r")
    for i in range(3):
        assert (await submit(bus, req(i)))["accepted"]
    await asyncio.sleep(0.2)
    assert accepted == ["r0"]

    async def worker_frees_a_slot():
        await asyncio.sleep(0.3)
        await heartbeat(bus, "w1", slots=1)  # r0 done: room for one more
    freeing = asyncio.create_task(worker_frees_a_slot())
    t0 = time.monotonic()
    await svc.stop()
    await freeing
    assert accepted == ["r0", "r1"]  # dispatched during the drain
    assert [(c.request_id, c.error["code"]) for c in chunks] == [("r2", "unavailable")]  # not dispatchable in time
    assert chunks[0].error["retryable"] and 0.9 < time.monotonic() - t0 < 3


async def test_worker_restarted_under_the_same_id_loses_the_old_processes_requests():
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"))
    await svc.start()
    chunks = await collect(bus, "_INBOX.t.r")
    on_w1: list = []
    await fake_worker(bus, "w1", on_w1)
    svc.on_worker_lease("w1", True, "a")
    await heartbeat(bus, "w1", slots=2)
    await submit(bus, req(1))
    await submit(bus, req(2))
    await asyncio.sleep(0.2)
    await bus.publish(subjects.sched_events("m", "1"), b'{"request_id":"r2","event":"first_token"}')
    await asyncio.sleep(0.05)
    svc.on_worker_lease("w1", True, "a")  # same process: nothing happens
    assert chunks == []
    svc.on_worker_lease("w1", True, "b")  # restarted (kill -9, supervisor) before the old lease expired
    await heartbeat(bus, "w1", slots=2)
    await asyncio.sleep(0.3)
    assert on_w1 == ["r1", "r2", "r1"]  # r1 (no token yet) re-dispatched, to the new process
    [err] = [c for c in chunks if c.request_id == "r2"]
    assert err.error["code"] == "worker_lost" and err.error["retryable"]
    await svc.stop()


async def test_a_resume_on_the_submit_subject_is_refused():
    # hand-overs come only on as.int.sched.<n>.<v>.migrate, which only workers may publish (nats_roles.py)
    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"))
    await svc.start()
    from dataclasses import replace
    ack = await submit(bus, replace(req(1), resume={"v": 1, "from_worker": "w1", "output_ids": [5], "seq": 1}))
    assert not ack["accepted"] and ack["error"]["status"] == 400 and ack["error"]["param"] == "resume"
    assert len(svc.queue) == 0
    await svc.stop()


async def test_a_submit_to_an_empty_queue_is_dispatched_before_its_ack_and_never_journaled():
    """Direct dispatch (decision 0054): the submit's ack follows the worker's, with no journal entry; one
    that has to wait is journaled before its ack, so a standby still recovers it."""
    from bus.journal import MemoryJournal

    class Counting(MemoryJournal):
        def __init__(self):
            super().__init__()
            self.appended = []

        async def append(self, r):
            self.appended.append(r.request_id)
            await super().append(r)

    bus, journal = MemoryBus(), Counting()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"), journal)
    await svc.start()
    accepted: list = []
    await fake_worker(bus, "w1", accepted)
    svc.on_worker_lease("w1", True)
    await heartbeat(bus, "w1", slots=1)
    await asyncio.sleep(0.05)  # the credits are in: a slot awaits the first submit
    first = await submit(bus, req(0))
    assert first["accepted"] and accepted == ["r0"] and journal.appended == []  # acked once dispatched
    await heartbeat(bus, "w1", slots=3)
    await asyncio.sleep(0.05)
    burst = await asyncio.gather(*(submit(bus, req(i)) for i in (5, 6, 7)))  # queued back to back, slots for all
    assert all(a["accepted"] for a in burst) and accepted == ["r0", "r5", "r6", "r7"] and journal.appended == []
    second = await submit(bus, req(1))  # no slot left: it waits, so it is journaled before its ack
    assert second["accepted"] and accepted == ["r0", "r5", "r6", "r7"] and journal.appended == ["r1"]
    assert [r.request_id for r in await journal.replay()] == ["r1"]
    await svc.stop(fail_queued=False)


async def test_a_direct_submit_its_worker_refuses_is_journaled_before_its_ack():
    from bus.journal import MemoryJournal

    bus, journal = MemoryBus(), MemoryJournal()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"), journal)
    await svc.start()
    refused: list = []

    async def refusing(msg):
        refused.append(Dispatch.decode(msg.data).request.request_id)
        await msg.respond(DispatchAck(False).encode())
    await bus.subscribe(subjects.work("w1"), refusing)
    svc.on_worker_lease("w1", True)
    await heartbeat(bus, "w1", slots=1)
    await asyncio.sleep(0.05)
    ack = await submit(bus, req(0))
    assert ack["accepted"] and refused == ["r0"] and list(journal.entries) == ["r0"]  # durable before its ack
    assert svc.queue.contains("r0") and not svc._unjournaled
    await svc.stop(fail_queued=False)


async def test_without_direct_dispatch_every_submit_is_journaled_first():
    from bus.journal import MemoryJournal

    bus, journal = MemoryBus(), MemoryJournal()
    svc = SchedulerService(bus, SchedulerConfig("m", "1", direct_dispatch=False), journal)
    await svc.start()
    assert (await submit(bus, req(0)))["accepted"] and list(journal.entries) == ["r0"]
    await svc.stop(fail_queued=False)


async def test_a_direct_submit_the_journal_refuses_goes_back_to_its_validator_and_its_retry_is_a_new_submit():
    """A submit taken without a journal entry, then refused by the journal, is forgotten (queue, taken ids):
    the validator's retry of it is judged afresh, never acknowledged as taken (decision 0054)."""
    from bus.journal import MemoryJournal

    class Refusing(MemoryJournal):
        async def append(self, r):
            raise TimeoutError("JetStream has no leader")

    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"), Refusing())
    await svc.start()
    await draining_worker(bus, svc)
    from dataclasses import replace
    r = replace(req(0), marks={"validate_out": 1.0})  # the validator's mark: its retry carries the same
    for _ in range(2):  # the submit, then the validator's retry of the same bytes
        ack = await submit(bus, r)
        assert not ack["accepted"] and ack["error"]["code"] == "journal_unavailable"
    assert not svc.queue.contains("r0") and not svc._unjournaled
    await svc.stop()


async def test_standing_down_hands_a_pending_direct_submit_back_to_its_validator():
    """stop(fail_queued=False) (lease lost): a submit taken without a journal entry and never acknowledged is
    refused with the retryable journal_unavailable, so its validator retries it to the new active scheduler
    at once instead of it being acknowledged into a journal nobody replays."""
    from bus.journal import MemoryJournal

    class Stalled(MemoryJournal):
        async def append(self, r):
            await asyncio.sleep(10.0)  # JetStream stalls: the write is still in flight when the lease is lost

    bus = MemoryBus()
    svc = SchedulerService(bus, SchedulerConfig("m", "1"), Stalled())
    await svc.start()
    await draining_worker(bus, svc)
    pending = asyncio.ensure_future(submit(bus, req(0)))
    await asyncio.sleep(0.1)
    assert not pending.done()  # queued, not journaled (its append stalls), not acknowledged
    await svc.stop(fail_queued=False)
    ack = await asyncio.wait_for(pending, 1.0)
    assert not ack["accepted"] and ack["error"]["code"] == "journal_unavailable" and not svc.queue.contains("r0")


async def test_a_direct_submit_whose_worker_does_not_answer_is_journaled_and_acknowledged_within_the_wait():
    """The worker's dispatch acknowledgement may take the whole dispatch timeout (a worker just killed): the
    submit is journaled and acknowledged DIRECT_WAIT_S after it was taken, not after that timeout."""
    from actors.scheduler import service as sched
    from bus.journal import MemoryJournal

    bus, journal = MemoryBus(), MemoryJournal()
    svc = SchedulerService(bus, SchedulerConfig("m", "1", dispatch_timeout_s=2.0), journal)
    await svc.start()

    async def silent(msg):  # takes the dispatch, never answers
        pass
    await bus.subscribe(subjects.work("w1"), silent)
    svc.on_worker_lease("w1", True)
    await heartbeat(bus, "w1", slots=2)
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    ack = await submit(bus, req(0))
    assert ack["accepted"] and time.monotonic() - t0 < sched.DIRECT_WAIT_S + 0.5 and "r0" in journal.entries
    await svc.stop(fail_queued=False)
