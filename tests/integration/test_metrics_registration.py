"""An actor's metrics endpoint is held in etcd under a lease: registered, re-registered after a lost
lease, removed at once when the actor stops; the served URL answers with Prometheus text."""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

from actors.metrics import actor_metrics, keep_metrics_registered
from control.state.names import metrics_key
from control.state.registry import Registry


async def _wait_for(pred, timeout: float = 6.0) -> None:
    t0 = time.monotonic()
    while not await pred():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        await asyncio.sleep(0.1)


async def test_registration_survives_lease_loss_and_goes_on_cancel(infra):
    key = metrics_key("validator", "mt-1")
    info = {"url": "http://127.0.0.1:1/metrics", "kind": "validator", "id": "mt-1", "pid": 1}
    async with Registry.connect(infra.etcd_url) as admin:
        task = asyncio.create_task(keep_metrics_registered(infra.etcd_url, "validator", "mt-1", info, ttl=2,
                                                           retry_s=0.2))
        await _wait_for(lambda: _has(admin, key))
        lease = (await admin.client.get(key.encode())).lease
        await admin.client.revoke_lease(lease)  # lost behind the actor's back
        await _wait_for(lambda: _has(admin, key))
        assert (await admin.get_json(key)) == info
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await admin.get_json(key) is None  # revoked, not left to expire


async def _has(reg: Registry, key: str) -> bool:
    return await reg.get_json(key) is not None


async def test_actor_metrics_serves_and_registers(infra):
    args = argparse.Namespace(metrics_port=0, etcd=infra.etcd_url, worker_id="mt-w")
    async with Registry.connect(infra.etcd_url) as admin:
        async with actor_metrics(args, "worker:mt-w") as url:
            key = metrics_key("worker", "mt-w")
            await _wait_for(lambda: _has(admin, key))
            assert (await admin.get_json(key))["url"] == url
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient() as client:
                r = await client.get(url)
            assert r.status_code == 200 and "actorserve_event_loop_lag_seconds" in r.text
        assert await admin.get_json(key) is None
