"""Leases through an etcd outage longer than their TTL (real etcd; killed and restarted, or frozen).

A lease holder keeps its lease (and its role) while etcd does not answer, learns when etcd answers again
(``recovered``), and re-registers / re-takes its key at once when the lease expired meanwhile."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from actors.scheduler.actor import hold_leadership
from actors.worker.actor import keep_registered
from control.ops.embedded import EmbeddedEtcd
from control.state.names import parse_model_ref
from control.state.registry import Registry

OUTAGE_S = 6.0  # > every TTL below


async def wait_key(reg: Registry, name: str, wid: str, timeout: float) -> float:
    """Seconds until worker ``wid`` of ``name@1`` is listed (AssertionError after ``timeout``)."""
    t0 = time.monotonic()
    while True:
        try:
            if wid in await reg.list_workers(name, "1"):
                return time.monotonic() - t0
        except Exception:
            pass
        assert time.monotonic() - t0 < timeout, f"{wid} not registered again within {timeout} s"
        await asyncio.sleep(0.1)


async def test_lease_kept_through_etcd_kill_and_restart(tmp_path):
    etcd = EmbeddedEtcd(tmp_path)
    etcd.start()
    try:
        async with Registry.connect(etcd.url, timeout=2) as reg:
            lease = await reg.register_worker("m", "1", "w1", {"pid": 1}, ttl=2)
            etcd.kill()
            await asyncio.sleep(OUTAGE_S)
            assert not lease.lost.is_set() and not lease.reachable  # kept, quietly retrying
            await asyncio.to_thread(etcd.start)  # same ports and data directory
            back = await wait_key(reg, "m", "w1", 5)
            await asyncio.wait_for(lease.recovered.wait(), 5)
            assert not lease.lost.is_set() and lease.outages == 1  # etcd extends leases across its restart
            print(f"key listed {back:.2f} s after etcd restarted; same lease kept")
            await lease.revoke()
    finally:
        etcd.stop()


async def test_worker_and_elected_scheduler_after_a_frozen_etcd(tmp_path):
    """SIGSTOP etcd longer than the TTLs: on resume etcd expires the leases; the worker registers again and
    the elected scheduler re-takes its (now free) key without standing down."""
    etcd = EmbeddedEtcd(tmp_path)
    etcd.start()
    frozen = False
    try:
        async with Registry.connect(etcd.url, timeout=2) as reg:
            ref = parse_model_ref("m@1")
            holder = [await reg.register_worker("m", "1", "w1", {"pid": 1}, ttl=2)]
            worker = asyncio.create_task(keep_registered(reg, holder, ref, "w1", {"pid": 1}, 2))
            key, info = "/actorserve/schedulers/m/1", {"scheduler_id": "s1", "pid": 1}
            held = [await reg.acquire_leased(key, info, 2)]
            guard = asyncio.create_task(hold_leadership(reg, held, key, info, 2))
            os.kill(etcd.pid, signal.SIGSTOP)
            frozen = True
            await asyncio.sleep(OUTAGE_S)
            assert not guard.done(), "the scheduler stood down while etcd was away"
            os.kill(etcd.pid, signal.SIGCONT)
            frozen = False
            back = await wait_key(reg, "m", "w1", 5)
            t0 = time.monotonic()
            while (await reg.get_json(key) or {}).get("scheduler_id") != "s1":
                assert time.monotonic() - t0 < 5, "election key not re-taken"
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)
            assert not guard.done(), "the scheduler stood down after etcd came back"
            print(f"worker key back {back:.2f} s after the resume; leader kept")
            guard.cancel()
            worker.cancel()
            await asyncio.gather(guard, worker, return_exceptions=True)
            await held[0].revoke()
            await holder[0].revoke()
    finally:
        if frozen:
            os.kill(etcd.pid, signal.SIGCONT)
        etcd.stop()


async def test_leader_stands_down_when_another_holds_the_key_after_an_outage(tmp_path):
    etcd = EmbeddedEtcd(tmp_path)
    etcd.start()
    try:
        async with Registry.connect(etcd.url, timeout=2) as reg, Registry.connect(etcd.url, timeout=2) as other:
            key, info = "/actorserve/schedulers/m/1", {"scheduler_id": "s1", "pid": 1}
            held = [await reg.acquire_leased(key, info, 2)]
            guard = asyncio.create_task(hold_leadership(reg, held, key, info, 2))
            await held[0].stop_keepalive()  # frozen holder: its lease expires, a standby takes the key
            rival = None
            t0 = time.monotonic()
            while rival is None:
                rival = await other.acquire_leased(key, {"scheduler_id": "s2", "pid": 2}, 2)
                assert time.monotonic() - t0 < 6
                await asyncio.sleep(0.1)
            held[0].recovered.set()  # what the keepalive signals when etcd answers again
            await asyncio.wait_for(guard, 5)  # returned: stood down
            assert (await reg.get_json(key))["scheduler_id"] == "s2"
            await rival.revoke()
    finally:
        etcd.stop()
