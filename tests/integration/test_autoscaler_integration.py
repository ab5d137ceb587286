"""The autoscaler actor against real nats-server + etcd (a few seconds): synthetic load reports on
``as.int.load.validator.<id>`` -> a desired key and a logged decision in etcd; two replicas, one active
(election), the standby takes over and adopts the stored desired count."""

from __future__ import annotations

import asyncio
import contextlib
import time

from actors.autoscaler.service import Autoscaler, AutoscalerConfig
from actors.autoscaler.signals import Limits
from bus import subjects
from bus.messages import ActorLoad
from bus.nats_bus import NatsBus
from control.state import names


def config(cid: str) -> AutoscalerConfig:
    # workers 0:1: the other tests' registered versions have no worker and no demand, so nothing is written for them
    return AutoscalerConfig(cpu_limits={"validator": Limits(1, 3)}, worker_limits=Limits(0, 1), tick_s=0.1,
                            warmup_s=0.3, controller_id=cid, lease_ttl=2)  # 2 s: a loaded machine keeps it


@contextlib.asynccontextmanager
async def overloaded_validator(bus, period_s: float = 0.1):
    """Report one validator with 20 messages pending every ``period_s`` until the block ends."""
    async def loop() -> None:
        while True:
            await bus.publish(subjects.load_subject("validator", "it-v1"),
                              ActorLoad("validator", "it-v1", time.time(), period_s, pending=20, handled=3).encode())
            await asyncio.sleep(period_s)
    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_for(cond, timeout: float) -> bool:
    t_end = time.monotonic() + timeout
    while not cond() and time.monotonic() < t_end:
        await asyncio.sleep(0.05)
    return bool(cond())


async def test_load_reports_become_a_desired_count_and_one_replica_decides(infra, registry):
    await registry.delete(names.desired_key("validator"))
    await registry.delete(names.autoscaler_decisions_key())
    buses = [await NatsBus.connect(infra.nats_url, name=f"test-autoscaler-{i}") for i in range(3)]
    a, b = Autoscaler(buses[0], registry, config("as-a")), Autoscaler(buses[1], registry, config("as-b"))
    try:
        await a.start()
        assert await wait_for(lambda: a.is_leader, 10.0)
        await b.start()
        async with overloaded_validator(buses[2]):
            desired: dict = {}

            async def poll() -> None:
                desired.update(await registry.get_json(names.desired_key("validator")) or {})
            t_end = time.monotonic() + 10.0
            while not desired and time.monotonic() < t_end:
                await poll()
                await asyncio.sleep(0.1)
            assert desired.get("count") == 2 and desired.get("by") == "as-a", desired
            assert a.is_leader and not b.is_leader and b.decisions_written == 0
            assert (await registry.get_json(names.controller_key("autoscaler")))["id"] == "as-a"
            history = (await registry.get_json(names.autoscaler_decisions_key()))["decisions"]
            d = history[-1]
            assert (d["loop"], d["target"], d["current"], d["desired"]) == ("cpu", "validator", 1, 2)
            assert "pending per replica 20" in d["reason"] and d["inputs"]["pending"] == 20.0
            await a.stop()  # resigns: b takes over and adopts the count a wrote
            t0 = time.monotonic()
            assert await wait_for(lambda: b.is_leader, 5.0) and time.monotonic() - t0 < 2.5  # resigned: no TTL wait
            assert b.cpu_policy.desired("validator") == 2
    finally:
        await a.stop()
        await b.stop()
        for bus in buses:
            await bus.close()
        await registry.delete(names.desired_key("validator"))
        await registry.delete(names.autoscaler_decisions_key())
