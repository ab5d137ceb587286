"""A worker whose etcd lease is lost (e.g. revoked or expired during a stall) registers again."""

from __future__ import annotations

import asyncio
import time

from actors.worker.actor import keep_registered
from control.state.names import parse_model_ref
from control.state.registry import Registry


async def test_worker_registers_again_after_losing_its_lease(infra):
    async with Registry.connect(infra.etcd_url) as reg, Registry.connect(infra.etcd_url) as admin:
        ref = parse_model_ref("leasetest@1")
        holder = [await reg.register_worker(ref.name, ref.version, "wk", {"pid": 1}, ttl=2)]
        task = asyncio.create_task(keep_registered(reg, holder, ref, "wk", {"pid": 1}, 2))
        first = holder[0].lease_id
        await admin.client.revoke_lease(first)  # the lease vanishes behind the worker's back
        t0 = time.monotonic()
        while "wk" not in await admin.list_workers("leasetest", "1") or holder[0].lease_id == first:
            assert time.monotonic() - t0 < 6, "worker did not register again"
            await asyncio.sleep(0.1)
        task.cancel()
        await holder[0].revoke()
