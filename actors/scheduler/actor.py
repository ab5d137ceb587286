"""``actorserve actor scheduler --model NAME@VERSION``: the scheduler of one model version.

Feeds tenant weights (``/actorserve/tenants/``) and worker lease events from etcd (``/actorserve/workers/{name}/{version}/``: initial listing,
then a watch, reconciled by a periodic re-list) into ``SchedulerService``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from actors.scheduler.service import SchedulerConfig, SchedulerService

log = logging.getLogger("actorserve.scheduler")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Scheduler options (common --nats/--etcd/--state-dir are added by actors.runtime)."""
    parser.add_argument("--model", required=True, help="NAME@VERSION scheduled by this process")
    parser.add_argument("--max-queue-len", type=int, default=1024, help="queued requests before 503")
    parser.add_argument("--max-queue-per-tenant", type=int, default=256, help="queued requests per tenant before 429")
    parser.add_argument("--fcfs", action="store_true", help="first-come-first-served instead of fair share")
    parser.add_argument("--scheduler-id", default=None, help="id of this replica (default sched-<pid>)")


def tenant_weights(tenants: dict[str, dict]) -> dict[str, float]:
    """Fair-share weight per tenant id from tenant records (``weight``, default 1; non-positive -> 1)."""
    out = {}
    for tid, rec in tenants.items():
        try:
            w = float((rec or {}).get("weight", 1.0))
        except (TypeError, ValueError):
            w = 1.0
        out[tid] = w if w > 0 else 1.0
    return out


async def sync_workers(reg, svc: SchedulerService, name: str, version: str, period_s: float = 2.0) -> None:
    """Keep ``svc``'s worker table equal to the leased worker keys in etcd (watch + periodic re-list)."""
    from control.names import workers_prefix

    async def relist() -> None:
        svc.weights = tenant_weights(await reg.list_tenants())
        live = set(await reg.list_workers(name, version))
        known = {w for w, v in svc.table.workers.items() if v.leased}
        for wid in live - known:
            svc.on_worker_lease(wid, True)
        for wid in known - live:
            log.warning("worker %s lease gone", wid)
            svc.on_worker_lease(wid, False)

    async def watch() -> None:
        async for kind, key, _ in reg.watch_prefix(workers_prefix(name, version)):
            wid = key.rsplit("/", 1)[-1]
            if kind == "delete":
                log.warning("worker %s lease deleted", wid)
            svc.on_worker_lease(wid, kind == "put")

    watcher = asyncio.create_task(watch())
    try:
        while True:
            try:
                await relist()
            except Exception as exc:  # etcd briefly unreachable: keep the last known table
                log.warning("worker re-list failed: %s", exc)
            await asyncio.sleep(period_s)
    finally:
        watcher.cancel()


async def main(args: argparse.Namespace) -> None:
    """Run the scheduler until cancelled."""
    from actors.runtime import resolve_endpoints
    from bus.nats_bus import NatsBus
    from control.names import parse_model_ref
    from control.registry import Registry

    ref = parse_model_ref(args.model)
    if not ref.version:
        raise SystemExit("--model must be NAME@VERSION")
    nats_url, etcd_url = resolve_endpoints(args)
    sid = args.scheduler_id or f"sched-{os.getpid()}"
    async with Registry.connect(etcd_url) as reg:
        bus = await NatsBus.connect(nats_url, name=f"scheduler-{sid}")
        svc = SchedulerService(bus, SchedulerConfig(ref.name, ref.version, sid, args.max_queue_len,
                                                    args.max_queue_per_tenant, args.fcfs))
        await svc.start()
        log.info("scheduler %s active for %s@%s", sid, ref.name, ref.version)
        try:
            await sync_workers(reg, svc, ref.name, ref.version)
        finally:
            await asyncio.shield(_shutdown(svc, bus))


async def _shutdown(svc: SchedulerService, bus) -> None:
    await asyncio.wait_for(svc.stop(), 5.0)
    await bus.close()
