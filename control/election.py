"""Leader election on one etcd key (e.g. ``/actorserve/schedulers/{name}/{version}``).

A candidate creates the key under its own short lease, atomically and only if the key is absent
(etcd transaction, create_revision == 0). The holder keeps the lease alive; if it dies the key
vanishes after at most ``ttl`` seconds and a waiting candidate, polling every ``poll_s``, takes over.
Takeover time after a kill -9 is therefore <= ttl + poll_s (+ one etcd round trip).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Mapping

log = logging.getLogger(__name__)


async def campaign(registry, key: str, info: Mapping[str, Any], *, ttl: int = 2, poll_s: float = 0.25):
    """Block until this candidate holds ``key``; return its lease (``control.registry.WorkerLease``).

    etcd errors while campaigning are logged and retried (every ``poll_s``); cancellation propagates."""
    announced = False
    while True:
        try:
            lease = await registry.acquire_leased(key, info, ttl)
            if lease is not None:
                return lease
            if not announced:
                holder = await registry.get_json(key)
                log.info("standing by: %s is held by %s", key, holder)
                announced = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # etcd away: keep trying
            log.warning("campaign for %s: %s", key, exc)
        await asyncio.sleep(poll_s)
