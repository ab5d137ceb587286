"""The gateway's feed of the operator dashboard (the shell around gateway/dashboard_data.py).

It listens only while someone watches: the first ``GET /dashboard/data`` subscribes to every completion
record (``as.int.done.*.*``, outside the ``gateway-metrics`` queue group, so each gateway's page shows the
whole deployment) and to the schedulers' load reports (``as.int.load.scheduler.*``); :data:`IDLE_S` seconds
after the last read it unsubscribes again, so an unwatched gateway pays nothing. Worker rows come from the
gateway's metrics (``GatewayMetrics.workers``, already fed by ``as.int.stats.*``); etcd (worker records,
preemption notices, desired counts, the autoscaler's decisions) is read at most every :data:`ETCD_EVERY_S`
seconds, whatever the number of open pages; a failed read keeps the last listing and names the source in
``errors``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from actors.aio import cancel_tasks
from bus import subjects
from bus.messages import ActorLoad, CompletionRecord
from gateway import dashboard_data as dd

log = logging.getLogger(__name__)

IDLE_S = 120.0  # unsubscribe this long after the last read (s)
ETCD_EVERY_S = 1.0  # etcd listings are re-read at most this often (s)
ETCD_TIMEOUT_S = 2.0  # one etcd read's bound (s)


class DashboardFeed:
    """Figures for ``GET /dashboard/data``: ``bus`` (subscriptions), ``registry`` (etcd reads, may be None),
    ``workers`` (an ``actors.metrics.WorkerGauges`` or None)."""

    def __init__(self, bus: Any, registry: Any, workers: Any = None, *, idle_s: float = IDLE_S) -> None:
        self.bus, self.registry, self.workers, self.idle_s = bus, registry, workers, float(idle_s)
        self.traffic = dd.Traffic()
        self.loads: dict[str, tuple[float, dict]] = {}  # version -> (monotonic s heard, ActorLoad dict)
        self._subs: list = []
        self._lock = asyncio.Lock()
        self._last_read = 0.0
        self._idle_task: asyncio.Task | None = None
        self._etcd: dict[str, Any] = {}
        self._etcd_at = 0.0
        self._errors: dict[str, str] = {}

    async def snapshot(self, show_tenants: bool) -> dict:
        """The dashboard JSON now (subscribing first if not listening yet)."""
        self._last_read = time.monotonic()
        await self._ensure_listening()
        await self._refresh_etcd()
        from control.state import names

        now, etcd = time.monotonic(), self._etcd
        loads = {v: (now - t, load) for v, (t, load) in self.loads.items() if now - t <= dd.LOAD_STALE_S}
        rows = self.workers.rows() if self.workers is not None else []
        workers = dd.workers_by_version(etcd.get("workers", {}), names.all_workers_prefix(), etcd.get("notices", {}),
                                        names.notices_prefix(), rows)
        return dd.build_snapshot(taken_at=time.time(), traffic=self.traffic.figures(now), loads=loads,
                                 workers=workers, desired=dd.desired_targets(etcd.get("desired", {}),
                                                                             names.desired_prefix()),
                                 decisions=dd.recent_decisions(etcd.get("decisions")), show_tenants=show_tenants,
                                 errors=self._errors)

    # ---- subscriptions ---------------------------------------------------------------------------
    async def _ensure_listening(self) -> None:
        async with self._lock:
            if self._subs:
                return
            self._subs = [await self.bus.subscribe(subjects.done_all(), self._on_done),
                          await self.bus.subscribe(subjects.load_of_kind("scheduler"), self._on_load)]
            self._idle_task = asyncio.create_task(self._stop_when_idle(), name="dashboard-idle")
            log.info("dashboard: listening to completion records and scheduler load reports")

    async def _stop_when_idle(self) -> None:
        while time.monotonic() - self._last_read < self.idle_s:
            await asyncio.sleep(min(5.0, self.idle_s))
        await self._unsubscribe()
        log.info("dashboard: nobody watched for %.0f s; stopped listening", self.idle_s)

    async def _unsubscribe(self) -> None:
        async with self._lock:
            subs, self._subs = self._subs, []
            for s in subs:
                try:
                    await s.unsubscribe()
                except Exception as exc:  # bus gone: nothing left to stop
                    log.debug("dashboard unsubscribe: %r", exc)

    async def stop(self) -> None:
        """Unsubscribe and stop the idle watch."""
        await cancel_tasks([self._idle_task])
        self._idle_task = None
        await self._unsubscribe()

    async def _on_done(self, msg: Any) -> None:
        try:
            self.traffic.add_record(time.monotonic(), CompletionRecord.decode(msg.data))
        except (ValueError, TypeError) as exc:
            log.debug("dashboard: undecodable completion record: %s", exc)

    async def _on_load(self, msg: Any) -> None:
        try:
            load = ActorLoad.decode(msg.data)
        except (ValueError, TypeError) as exc:
            log.debug("dashboard: undecodable load report: %s", exc)
            return
        if load.kind == "scheduler" and load.name and load.version:
            d = {k: getattr(load, k) for k in ("actor_id", "queue_len", "queue_tokens", "arrivals_tokens_per_s",
                                               "served_tokens_per_s", "workers", "cold_start_waiting", "tenants")}
            self.loads[f"{load.name}@{load.version}"] = (time.monotonic(), d)

    # ---- etcd -------------------------------------------------------------------------------------
    async def _refresh_etcd(self) -> None:
        if self.registry is None or time.monotonic() - self._etcd_at < ETCD_EVERY_S:
            return
        self._etcd_at = time.monotonic()
        from control.state import names

        reads = {"workers": self.registry.get_prefix_json(names.all_workers_prefix()),
                 "notices": self.registry.get_prefix_json(names.notices_prefix()),
                 "desired": self.registry.get_prefix_json(names.desired_prefix()),
                 "decisions": self.registry.get_json(names.autoscaler_decisions_key())}
        got = await asyncio.gather(*(asyncio.wait_for(c, ETCD_TIMEOUT_S) for c in reads.values()),
                                   return_exceptions=True)
        for key, value in zip(reads, got):
            if isinstance(value, BaseException):
                self._errors[f"etcd {key}"] = f"{type(value).__name__}: {value}"[:200]
            else:
                self._errors.pop(f"etcd {key}", None)
                self._etcd[key] = value if value is not None else {}
