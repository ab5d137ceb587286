"""Leased etcd keys kept alive by a task (worker registrations, elections, metrics endpoints), and the
once-per-outage etcd logger every long-lived etcd user shares.

``Registry.put_leased`` / ``acquire_leased`` / ``register_worker`` create the :class:`WorkerLease`; it
only needs the registry's client, call timeout and ``put_json`` (no import of the registry module).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

log = logging.getLogger(__name__)


class OutageLog:
    """Logs an etcd outage once when it starts and once when it ends (not once per failed attempt).

    ``failed(exc)`` on each failed call, ``ok()`` on each successful one; ``down_since`` is the
    monotonic time of the first failure of the current outage (None while etcd answers)."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.log, self.what = logger, what
        self.down_since: float | None = None
        self.outages = 0  # outages seen so far

    def failed(self, exc: BaseException) -> bool:
        """Record a failed attempt; True (and one warning logged) when it starts a new outage."""
        if self.down_since is not None:
            return False
        self.down_since = time.monotonic()
        self.outages += 1
        self.log.warning("%s: etcd unreachable (%r); retrying quietly until it answers", self.what, exc)
        return True

    def ok(self) -> float | None:
        """Record a success; returns the outage's length in seconds when this ends one (logged), else None."""
        if self.down_since is None:
            return None
        took, self.down_since = time.monotonic() - self.down_since, None
        self.log.warning("%s: etcd answers again after %.1f s", self.what, took)
        return took


class WorkerLease:
    """A leased key (worker registration, election, metrics endpoint): an etcd lease plus the key,
    kept alive by a task.

    The keepalive refreshes every ``ttl / 3`` seconds. While etcd does not answer (stopped,
    restarting, unreachable) it keeps the lease and keeps retrying (backoff from ``ttl / 6`` up to
    ``ttl / 3`` s; each try bounded by ``ttl / 2`` s), logging once per outage: etcd keeps leases
    across its own restart and extends them, so the key usually survives; the owner keeps serving
    from what it knows. ``reachable`` is False during an outage, and ``recovered`` is set each
    time etcd answers again after one (owners that must re-check what they hold, e.g. an elected
    scheduler, wait on it and clear it). ``lost`` is set, and the task ends, only when etcd says
    the lease is gone (expired during the outage, or revoked behind our back); the owner should then
    register again. ``revoke()`` deletes the key at once (clean stop).

    ``give_up_after``: seconds without a successful refresh after which ``lost`` is set anyway
    (None, the default: never; an owner that must not hold a key it cannot renew sets it).
    ``registry``: the ``control.state.registry.Registry`` that granted the lease.
    """

    def __init__(self, registry: Any, key: str, lease: Any, ttl: int,
                 give_up_after: float | None = None) -> None:
        self.registry = registry
        self.key = key
        self.ttl = int(ttl)
        self._lease = lease
        self.lost = asyncio.Event()
        self.recovered = asyncio.Event()
        self.give_up_after = give_up_after
        self._task: asyncio.Task[None] | None = None
        self._last_ok = time.monotonic()
        self._outage = OutageLog(log, f"lease {key}")
        self.refreshes = 0

    @property
    def lease_id(self) -> int:
        """The etcd lease id."""
        return int(self._lease.id)

    @property
    def active(self) -> bool:
        """True while the keepalive task runs and the lease is not known to be lost."""
        return self._task is not None and not self._task.done() and not self.lost.is_set()

    @property
    def reachable(self) -> bool:
        """False while refreshes fail (etcd away); True otherwise."""
        return self._outage.down_since is None

    @property
    def outages(self) -> int:
        """How many etcd outages this lease has lived through (or is in)."""
        return self._outage.outages

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._keepalive(), name=f"lease-keepalive:{self.key}"
        )

    async def _keepalive(self) -> None:
        interval = max(self.ttl / 3.0, 0.2)
        retry = max(self.ttl / 6.0, 0.1)
        per_try = max(0.5, min(self.registry.timeout, self.ttl / 2.0))
        delay = interval
        while True:
            await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(per_try):  # not wait_for: on 3.11 it can drop a cancel (registry._call)
                    reply = await self.registry.client.refresh_lease(self.lease_id)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd away: keep the lease, keep trying (quietly)
                self._outage.failed(e)
                if self.give_up_after is not None and time.monotonic() - self._last_ok >= self.give_up_after:
                    log.error("lease for %s given up: no refresh for %.1f s (%r)", self.key,
                              time.monotonic() - self._last_ok, e)
                    self.lost.set()
                    return
                delay = min(interval, (delay if delay < interval else retry) * 1.5)
                continue
            if self._outage.ok() is not None:
                self.recovered.set()
            if reply is None or int(getattr(reply, "TTL", 0)) <= 0:
                log.error("lease for %s lost: etcd no longer knows lease %x", self.key, self.lease_id)
                self.lost.set()
                return
            self._last_ok = time.monotonic()
            self.refreshes += 1
            delay = interval

    async def stop_keepalive(self) -> None:
        """Stop refreshing without revoking: the key expires after at most ``ttl`` seconds
        (what a crashed worker looks like to everyone else)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def revoke(self) -> None:
        """Stop the keepalive and revoke the lease, deleting the key now (clean shutdown).

        Errors from etcd (e.g. lease already expired) are logged, not raised.
        """
        await self.stop_keepalive()
        try:
            await self.registry._call(self.registry.client.revoke_lease(self.lease_id))
        except Exception as e:
            log.warning("revoking lease for %s failed: %r", self.key, e)

    async def update(self, info: dict[str, Any]) -> None:
        """Replace the registered info, keeping the same lease."""
        await self.registry.put_json(self.key, info, lease=self.lease_id)

    async def __aenter__(self) -> "WorkerLease":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.revoke()
