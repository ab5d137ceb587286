"""``actorserve actor scheduler --model NAME@VERSION``: the scheduler of one model version.

Replicas elect one active per version on ``/actorserve/schedulers/{name}/{version}`` (etcd lease,
TTL 2 s); the others stand by. The active one journals its queue in JetStream, so a standby that
takes over re-queues what was accepted and not yet dispatched (docs/decisions/0010-scheduler-ha.md).

Feeds tenant weights (``/actorserve/tenants/``) and worker lease events from etcd (``/actorserve/workers/{name}/{version}/``: initial listing,
then a watch, reconciled by a periodic re-list) into ``SchedulerService``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import time

import orjson

from actors.cache_salt import tenant_cache_groups
from actors.scheduler.service import SchedulerConfig, SchedulerService
from actors.serve import ActorContext, serve
from bus import subjects

log = logging.getLogger("actorserve.scheduler")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Scheduler options (common --nats/--etcd/--state-dir are added by actors.runtime)."""
    parser.add_argument("--model", required=True, help="NAME@VERSION scheduled by this process")
    parser.add_argument("--max-queue-len", type=int, default=1024, help="queued requests before 503")
    parser.add_argument("--max-queue-per-tenant", type=int, default=256, help="queued requests per tenant before 429")
    parser.add_argument("--fcfs", action="store_true", help="first-come-first-served instead of fair share")
    parser.add_argument("--no-preemption", dest="preemption", action="store_false",
                        help="never preempt an over-share tenant's running request (slot headroom only)")
    parser.add_argument("--no-urgent", dest="urgent", action="store_false",
                        help="never mark dispatches urgent (no prefill priority for under-share tenants; "
                             "for comparisons, docs/decisions/0021)")
    parser.add_argument("--routing", default="affinity", choices=("affinity", "least_loaded", "random"),
                        help="worker choice: prefix-cache affinity then least loaded (default), or a baseline")
    parser.add_argument("--scheduler-id", default=None, help="id of this replica (default sched-<pid>)")
    parser.add_argument("--lease-ttl", type=int, default=2, help="election lease TTL in seconds (1..5)")


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


def incarnation_of(info) -> str:
    """The process identity in a worker's registration (``incarnation``, else its pid; "" if neither)."""
    if not isinstance(info, dict):
        return ""
    return str(info.get("incarnation") or info.get("pid") or "")


async def sync_workers(reg, svc: SchedulerService, name: str, version: str, period_s: float = 2.0) -> None:
    """Keep ``svc``'s worker table equal to the leased worker keys in etcd (watch + periodic re-list)."""
    from control.state.names import workers_prefix

    async def relist() -> None:
        tenants = await reg.list_tenants()
        svc.weights, svc.cache_groups = tenant_weights(tenants), tenant_cache_groups(tenants)
        listed = await reg.list_workers(name, version)
        live = set(listed)
        known = {w for w, v in svc.table.workers.items() if v.leased}
        for wid in live:
            inc = incarnation_of(listed[wid])
            if wid not in known or (inc and svc.table.workers[wid].incarnation not in ("", inc)):
                svc.on_worker_lease(wid, True, inc)
        for wid in known - live:
            log.warning("worker %s lease gone", wid)
            svc.on_worker_lease(wid, False)

    async def watch() -> None:
        async for kind, key, value in reg.watch_prefix(workers_prefix(name, version)):
            wid = key.rsplit("/", 1)[-1]
            if kind == "delete":
                log.warning("worker %s lease deleted", wid)
            svc.on_worker_lease(wid, kind == "put", incarnation_of(value))

    from control.state.registry import OutageLog

    outage = OutageLog(log, f"worker re-list of {name}@{version}")
    watcher = asyncio.create_task(watch())
    try:
        while True:
            try:
                async with asyncio.timeout(max(period_s, 1.0)):  # not wait_for: it can swallow a cancel
                    await relist()
                outage.ok()
            except Exception as exc:  # etcd unreachable: keep the last known table (logged once per outage)
                outage.failed(exc)
            await asyncio.sleep(period_s)
    finally:
        watcher.cancel()


async def main(args: argparse.Namespace) -> None:
    """Stand by until elected active for the version, then schedule until cancelled or the lease is lost."""
    from control.state.names import parse_model_ref

    ref = parse_model_ref(args.model)
    if not ref.version:
        raise SystemExit("--model must be NAME@VERSION")
    sid = args.scheduler_id or f"sched-{os.getpid()}"
    await serve(args, f"scheduler-{sid}", functools.partial(run_terms, ref=ref, sid=sid))


async def run_terms(ctx: ActorContext, ref, sid: str) -> None:
    """The scheduler's loop on the context's bus and registry: each turn wins the election and serves one
    term (:func:`serve_term`, which stops its own service) until the lease is lost; never returns. A term
    that could not start because JetStream kept failing (:data:`JOURNAL_RETRY_S`) has resigned; the
    replica campaigns again after a second."""
    from bus.base import BusError

    bus = await ctx.connect_bus()
    while True:
        try:
            await serve_term(ctx.registry, bus, ref, sid, ctx.args)
        except (BusError, TimeoutError) as exc:
            log.error("scheduler %s: term ended, JetStream unavailable (%r); campaigning again", sid, exc)
            await asyncio.sleep(1.0)


JOURNAL_RETRY_S = 30.0  # how long a new term retries JetStream (journal open, replay) before it resigns


async def _retrying(what: str, fn, deadline_s: float = JOURNAL_RETRY_S):
    """``await fn()``, again every 0.5 s while it raises BusError or TimeoutError -- JetStream without a
    leader for a while after a server loss or a partition (the stream or meta leader being elected) --
    for at most ``deadline_s`` seconds; then the last error is raised."""
    from bus.base import BusError

    t_end = time.monotonic() + deadline_s
    while True:
        try:
            return await fn()
        except (BusError, TimeoutError) as exc:
            if time.monotonic() >= t_end:
                raise
            log.warning("%s failed (%r); retrying", what, exc)
            await asyncio.sleep(0.5)


async def serve_term(reg, bus, ref, sid: str, args: argparse.Namespace) -> None:
    """One term as the active scheduler: campaign, recover the journal, schedule until leadership is lost.

    An etcd outage does not end the term (nobody else can win the election while etcd is away): the
    scheduler keeps serving from its last worker table; when etcd answers again it re-checks that the
    election key is still its own (docs/decisions/0017-drain-and-control-plane-loss.md)."""
    from bus.journal import JetStreamJournal
    from control.state.election import campaign
    from control.state.names import scheduler_key

    key, info = scheduler_key(ref.name, ref.version), {"scheduler_id": sid, "pid": os.getpid()}
    held = [await campaign(reg, key, info, ttl=args.lease_ttl)]
    try:
        journal = await _retrying("journal open", lambda: JetStreamJournal.open(bus, ref.name, ref.version))
    except BaseException:
        with contextlib.suppress(Exception):  # resign: a standby may do better
            await asyncio.shield(asyncio.wait_for(held[0].revoke(), 3.0))
        raise
    svc = SchedulerService(bus, SchedulerConfig(ref.name, ref.version, sid, args.max_queue_len,
                                                args.max_queue_per_tenant, args.fcfs, routing=args.routing,
                                                preemption=args.preemption, urgent=args.urgent,
                                                direct_dispatch=os.environ.get("ACTORSERVE_DIRECT_DISPATCH", "1") != "0"),
                          journal)
    await svc.start()
    svc.load.follow(reg)  # the manifest's autoscale.scale_to_zero (actors/scheduler/load.py); stopped by svc.stop()
    _export_queue(svc)
    try:
        recovered = await _retrying("journal replay", svc.recover)
    except BaseException:
        await asyncio.shield(_shutdown(svc, held[0]))
        raise
    await bus.publish(subjects.sched_leader(ref.name, ref.version),
                      orjson.dumps({"scheduler_id": sid, "ts": time.time(), "recovered": recovered}))
    log.info("scheduler %s active for %s@%s (recovered %d queued requests)", sid, ref.name, ref.version, recovered)
    from actors.scheduler.host_ask import follow_hosts
    svc.run_alongside(follow_hosts(reg, bus, svc, ref.name, ref.version))  # stopped by svc.stop()
    sync = asyncio.create_task(sync_workers(reg, svc, ref.name, ref.version))
    guard = asyncio.create_task(hold_leadership(reg, held, key, info, args.lease_ttl))
    stood_down = False
    try:
        await asyncio.wait([sync, guard], return_when=asyncio.FIRST_COMPLETED)
        stood_down = guard.done() and not guard.cancelled() and guard.exception() is None
        if stood_down:
            log.error("scheduler %s lost its election; standing down (its queue stays journaled)", sid)
        else:
            log.error("scheduler %s: worker sync ended (%r); restarting the term", sid,
                      sync.exception() if sync.done() and not sync.cancelled() else None)
    finally:
        sync.cancel()
        guard.cancel()
        await asyncio.shield(_shutdown(svc, held[0], fail_queued=not stood_down))


async def hold_leadership(reg, held: list, key: str, info: dict, ttl: int, retry_s: float = 3.0) -> None:
    """Return when this replica is no longer the elected one; ``held[0]`` is the current lease.

    * etcd away: keep the role (the lease's keepalive retries quietly).
    * etcd back (``lease.recovered``): re-check the key; another holder means we lost.
    * lease gone (expired during an outage, ``lease.lost``): take the key again at once if it is free
      (the term goes on without a gap); if another replica holds it, or etcd keeps failing for
      ``retry_s`` seconds, we lost."""
    from control.state.election import still_holds

    while True:
        lease = held[0]
        lost = asyncio.ensure_future(lease.lost.wait())
        back = asyncio.ensure_future(lease.recovered.wait())
        try:
            await asyncio.wait([lost, back], return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            back.cancel()
        if lease.lost.is_set():
            t_end = time.monotonic() + retry_s
            while True:
                try:
                    again = await reg.acquire_leased(key, info, ttl)
                except Exception as exc:
                    if time.monotonic() >= t_end:
                        log.error("could not re-take %s after the lease was lost: %r", key, exc)
                        return
                    await asyncio.sleep(0.25)
                    continue
                if again is None:
                    log.error("%s is held by another replica now", key)
                    return
                held[0] = again
                log.warning("election lease of %s expired during an etcd outage; re-elected with a new lease", key)
                break
            continue
        lease.recovered.clear()
        if await still_holds(reg, lease, "scheduler_id", info["scheduler_id"]) is False:
            log.error("%s no longer names this replica after the etcd outage", key)
            return


_active: list = []  # the SchedulerService of the current term (read by the queue-length gauge)


def _export_queue(svc: SchedulerService) -> None:
    """Point this scheduler's gauges at ``svc``: ``actorserve_num_requests_waiting{model}`` (queue length),
    ``actorserve_tenant_service_tokens_total{model,tenant,kind}`` (tokens served, kind prompt|completion,
    from the workers' heartbeats), ``actorserve_tenant_service_share{model,tenant}`` (share of the weighted
    service over the last 60 s) and ``actorserve_tenant_weight_share{model,tenant}`` (the share its weight
    entitles it to among the tenants active then)."""
    from actors.metrics import observable_counter, observable_gauge

    if not _active:
        observable_gauge("actorserve_num_requests_waiting", "Requests waiting in the scheduler's queue.", "1",
                         lambda: [(len(s.queue), {"model": f"{s.cfg.name}@{s.cfg.version}"}) for s in _active[-1:]])
        observable_counter("actorserve_tenant_service_tokens", "Tokens served per tenant (prompt tokens "
                           "computed, completion tokens generated), from the workers' heartbeats.", "1",
                           lambda: [r for s in _active[-1:] for r in s.service_rows()])
        observable_gauge("actorserve_tenant_service_share", "Tenant's share of the weighted tokens served over "
                         "the last 60 s (VTC currency: prompt x1, completion x2).", "1",
                         lambda: [r for s in _active[-1:] for r in s.share_rows()[0]])
        observable_gauge("actorserve_tenant_weight_share", "Tenant's weight over the weights of the tenants "
                         "active in the last 60 s: the share fair scheduling aims at.", "1",
                         lambda: [r for s in _active[-1:] for r in s.share_rows()[1]])
    _active[:] = [svc]


async def _shutdown(svc: SchedulerService, lease, fail_queued: bool = True) -> None:
    """Stop scheduling (bounded), then resign so a standby takes over at once."""
    try:
        await asyncio.wait_for(svc.stop(fail_queued), svc.cfg.drain_s + 3.0)
    finally:
        await asyncio.wait_for(lease.revoke(), 3.0)
