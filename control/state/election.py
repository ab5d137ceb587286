"""Leader election on one etcd key (e.g. ``/actorserve/schedulers/{name}/{version}``).

A candidate creates the key under its own short lease, atomically and only if the key is absent
(etcd transaction, create_revision == 0). The holder keeps the lease alive; if it dies the key
vanishes after at most ``ttl`` seconds and a waiting candidate, polling every ``poll_s``, takes over.
Takeover time after a kill -9 is therefore <= ttl + poll_s (+ one etcd round trip).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any, Awaitable, Callable, Mapping

log = logging.getLogger(__name__)


async def campaign(registry, key: str, info: Mapping[str, Any], *, ttl: int = 2, poll_s: float = 0.25):
    """Block until this candidate holds ``key``; return its lease (``control.state.leases.WorkerLease``).

    etcd errors while campaigning are retried (every ``poll_s``) and logged once per outage;
    cancellation propagates. The lease keeps the key while etcd is away (``WorkerLease``): the holder
    keeps its role through an etcd outage, re-checks it with :func:`still_holds` when etcd answers
    again (``lease.recovered``), and stands down when ``lease.lost`` is set."""
    from control.state.leases import OutageLog

    announced = False
    outage = OutageLog(log, f"campaign for {key}")
    while True:
        try:
            lease = await registry.acquire_leased(key, info, ttl)
            outage.ok()
            if lease is not None:
                return lease
            if not announced:
                holder = await registry.get_json(key)
                log.info("standing by: %s is held by %s", key, holder)
                announced = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # etcd away: keep trying
            outage.failed(exc)
        await asyncio.sleep(poll_s)


async def still_holds(registry, lease, field: str, ident: Any) -> bool | None:
    """Whether ``lease``'s key still names this holder (``value[field] == ident``) under this lease.

    True / False from etcd; None when etcd cannot say right now (the caller keeps its role and asks
    again later). Used after an etcd outage, when a lease may have expired and the key moved on."""
    try:
        value, lease_id = await registry.get_json_lease(lease.key)
    except Exception:
        return None
    return value is not None and value.get(field) == ident and lease_id == lease.lease_id


async def lead(registry, key: str, ident: str, *, elect: bool, ttl: int, interval_s: Callable[[], float],
               tick: Callable[[], Awaitable[None]], on_lead: Callable[[Any], Awaitable[None]],
               on_stand_down: Callable[[], None], what: str) -> None:
    """The loop of a controller with one active instance (the autoscaler, the rollout controller): win
    ``key`` (with ``elect``; else lead at once, lease None), ``await on_lead(lease)``, then ``await tick()``
    every ``interval_s()`` seconds while the lease holds (a failed tick is logged and the loop goes on);
    on losing the lease, ``on_stand_down()``, revoke what is left of it and campaign again. Runs until
    cancelled. ``what`` names the controller in the log."""
    while True:
        lease = None
        try:
            if elect:
                lease = await campaign(registry, key, {"id": ident, "pid": os.getpid(), "since": time.time()},
                                       ttl=ttl)
                log.info("%s %s is active", what, ident)
            await on_lead(lease)
            while lease is None or not lease.lost.is_set():
                t0 = time.monotonic()
                try:
                    await tick()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # etcd away, a bad record: log, keep going
                    log.warning("%s tick failed: %r", what, exc)
                await asyncio.sleep(max(0.0, interval_s() - (time.monotonic() - t0)))
            log.error("%s %s lost its election lease; standing by", what, ident)
        finally:
            on_stand_down()
            if lease is not None and not lease.lost.is_set():
                with contextlib.suppress(Exception):
                    await asyncio.shield(lease.revoke())
