"""The active scheduler's load report and its scale-from-zero hold (issue [13]): :class:`SchedulerLoad`.

**Load.** Every second the active scheduler of a version publishes an ``ActorLoad`` (actors/load_report.py:
loop lag, CPU) with the version's figures in generated tokens (the unit of the throughput curves,
control/policy/curves.py): ``queue_tokens`` / ``queue_len`` (completion tokens the queued requests are
expected to generate, by the scheduler's output-length model; requests), ``arrivals_tokens_per_s`` (the
same of every submit over the last :data:`RATE_WINDOW_S` seconds, refused ones included: they are demand),
``served_tokens_per_s`` (tokens its workers generated, from their heartbeats, over the same window),
``workers`` (leased, not draining), ``cold_start_waiting`` (requests queued while there is no such worker) and
``tenants`` (each tenant's share of service against its weight's share, for the operator dashboard).

**Scale from zero.** With no live worker a request is queued as always and waits for one, bounded by its
deadline minus its predicted service time (the dispatch loop's ``cannot_finish`` check and the deadline
expiry end it then). For a version whose manifest says ``autoscale.scale_to_zero: true`` a submit that cannot
wait for a cold start is refused at once instead: 503 ``cold_start`` with ``Retry-After`` = the cold start
still ahead, when ``deadline - now - predicted service < cold start left``. The cold start is measured --
from the first request that met zero workers to the first worker's lease -- and :data:`DEFAULT_COLD_START_S`
until measured. Versions that are not scale-to-zero keep the older behaviour (hold until the deadline,
no refusal): their worker comes back by a supervisor restart, often faster than an estimate, and refusing
there would turn a short outage into failures (docs/autoscaling.md). A term younger than
:data:`TERM_GRACE_S` has not listed its workers yet and never refuses.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from typing import Any, Protocol

from actors.aio import cancel_tasks
from actors.load_report import LoadReporter, new_actor_id
from actors.scheduler.policy import weight_share
from bus.messages import MAX_LOAD_TENANTS, GenerateRequest, error_dict

log = logging.getLogger(__name__)

DEFAULT_COLD_START_S = 20.0  # cold start (first held request -> first worker lease) until one is measured (s)
RATE_WINDOW_S = 5.0  # arrivals and served tokens are rates over this window (s)
TERM_GRACE_S = 3.0  # a scheduler term younger than this never refuses for a cold start (its table is filling)
CHECK_S = 0.25  # how often the zero-worker state is checked (cold start measurement resolution, s)
MANIFEST_POLL_S = 5.0  # how often the version's manifest is re-read for ``autoscale.scale_to_zero`` (s)
WAKE_S = 2.0  # expected wake of a sleeping worker, command -> serving (issue [28] target; actors/worker/sleep.py)
WAKE_RETRY_S = 2.0  # a sleeping worker is asked to wake again after this long when it has not (s)
_SAFE = re.compile(r"^[A-Za-z0-9_-]+$")


class RateWindow:
    """Amounts over a sliding window: ``add(now, amount)``, ``rate(now)`` = sum / window (per s). Pure."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError("window_s must be > 0")
        self.window_s = float(window_s)
        self._items: deque[tuple[float, float]] = deque()

    def add(self, now: float, amount: float) -> None:
        """Record ``amount`` at ``now`` (monotonic s)."""
        self._items.append((now, float(amount)))
        self._trim(now)

    def rate(self, now: float) -> float:
        """Sum of the amounts of the last ``window_s`` seconds, per second."""
        self._trim(now)
        return sum(a for _, a in self._items) / self.window_s

    def _trim(self, now: float) -> None:
        while self._items and self._items[0][0] < now - self.window_s:
            self._items.popleft()


def cold_start_refusal(deadline: float, now: float, own_s: float, cold_start_left_s: float) -> bool:
    """True when a request with ``deadline`` (epoch s; 0 = none) arriving at ``now`` cannot wait
    ``cold_start_left_s`` for a worker and still get its predicted ``own_s`` of service before it. Pure."""
    return bool(deadline) and deadline - now - max(0.0, own_s) < max(0.0, cold_start_left_s)


class LoadHost(Protocol):
    """What the load report and the cold-start hold read of their scheduler (``SchedulerService``
    implements it; read only)."""

    bus: Any
    cfg: Any  # SchedulerConfig (scheduler_id, name, version)
    queue: Any  # FairQueue of queued requests
    table: Any  # WorkerTable
    lengths: Any  # OutputLengthModel
    ledger: Any  # ServiceLedger: tokens served per tenant
    weights: dict[str, float]  # tenant -> fair-share weight
    fair: Any  # FairShare (active_tenants)

    def own_service_s(self, req: GenerateRequest, calibrated: bool = True) -> float:
        """Predicted seconds ``req`` spends on a worker."""


class SchedulerLoad:
    """Load figures and the cold-start hold of one scheduler (``svc``, through :class:`LoadHost`)."""

    def __init__(self, svc: LoadHost, *, cold_start_s: float = DEFAULT_COLD_START_S, period_s: float = 1.0) -> None:
        if not cold_start_s > 0:
            raise ValueError("cold_start_s must be > 0")
        self.svc = svc
        self.default_cold_start_s = float(cold_start_s)
        self.measured_cold_start_s: float | None = None  # latest measured: first held request -> first worker
        self.scale_to_zero = False  # from the manifest (follow()); False: hold until the deadline, never refuse
        self.refused = 0  # submits refused because no cold start fits their deadline
        self.started = time.monotonic()
        self._zero_since: float | None = None  # monotonic s when a request first met zero live workers
        self._arrivals = RateWindow()
        self._served = RateWindow()
        self._served_total = 0
        sid = svc.cfg.scheduler_id
        self.reporter = LoadReporter(svc.bus, "scheduler", sid if _SAFE.match(sid) else new_actor_id("sched"),
                                     period_s=period_s, extras=self.extras)
        self._tasks: list[asyncio.Task] = []
        self._reported_queue_len = 0  # queue_len of the latest report (a queue that starts to grow kicks one)
        self.registry = None  # control.state.registry.Registry of follow(): where sleeping workers are woken
        self._woken: dict[str, float] = {}  # worker id -> monotonic s of its last wake command

    # ---- state -----------------------------------------------------------------------------------
    def live_workers(self) -> int:
        """Workers of the version that are leased and not draining."""
        return sum(1 for w in self.svc.table.workers.values() if w.leased and not w.draining)

    def sleepers(self) -> list[str]:
        """Ids of the version's leased workers that sleep (actors/worker/sleep.py), in id order."""
        return sorted(w.worker_id for w in self.svc.table.workers.values() if w.leased and w.sleeping)

    def cold_start_s(self) -> float:
        """The cold-start estimate: a wake's when a sleeping worker can be woken, else the latest measured cold
        start, else the default (s)."""
        if self.sleepers():
            return WAKE_S
        return self.measured_cold_start_s if self.measured_cold_start_s is not None else self.default_cold_start_s

    def cold_start_left_s(self, now: float) -> float:
        """Seconds of the cold start still ahead (the estimate minus what has passed since a request first met
        zero workers; the whole estimate when none is under way)."""
        if self._zero_since is None:
            return self.cold_start_s()
        return max(0.0, self.cold_start_s() - (now - self._zero_since))

    def check(self, now: float | None = None) -> None:
        """Measure a cold start that just ended (a live worker while one was awaited); forget a wait that
        lasted over 3 cold starts with nothing arriving (nobody started a worker: the next request restarts
        the estimate)."""
        now = time.monotonic() if now is None else now
        if self._zero_since is None:
            return
        if self.live_workers() > 0:
            took = now - self._zero_since
            self.measured_cold_start_s = min(600.0, max(1.0, took))
            self._zero_since = None
            log.info("%s@%s: cold start measured %.1f s (first held request -> first worker)",
                     self.svc.cfg.name, self.svc.cfg.version, took)
        elif now - self._zero_since > 3 * self.cold_start_s() and not len(self.svc.queue):
            self._zero_since = None

    # ---- hooks of the service ----------------------------------------------------------------------
    def on_submit(self, req: GenerateRequest) -> dict | None:
        """Count a submit's tokens as an arrival; at zero live workers start the cold-start clock, and for a
        scale-to-zero version return the 503 ``cold_start`` error dict (Retry-After) of a request that cannot
        wait for it. None: go on with admission as usual."""
        now, wall = time.monotonic(), time.time()
        self._arrivals.add(now, self.tokens_of(req))
        if self.live_workers() > 0:
            return None
        self.check(now)
        if self._zero_since is None:
            self._zero_since = now
        if not self.scale_to_zero or now - self.started < TERM_GRACE_S:
            return None
        left = self.cold_start_left_s(now)
        if not cold_start_refusal(req.deadline, wall, self.svc.own_service_s(req), left):
            return None
        self.refused += 1
        return error_dict(503, f"model {req.model_ref} has no running worker and one cannot start before the "
                          f"request's deadline (cold start about {self.cold_start_s():.0f} s); retry later",
                          type_="unavailable", code="cold_start", retryable=True, retry_after=max(1.0, round(left, 1)))

    def tokens_of(self, req: GenerateRequest) -> int:
        """The completion tokens the scheduler expects ``req`` to generate."""
        s = req.sampling
        return self.svc.lengths.expected(s.max_tokens, s.ignore_eos)

    def extras(self) -> dict[str, Any]:
        """The scheduler fields of this scheduler's ActorLoad (see the module docstring)."""
        now = time.monotonic()
        self.check(now)
        total = sum(self.svc.ledger.completion_tokens.values())
        if total > self._served_total:
            self._served.add(now, total - self._served_total)
        self._served_total = total
        queued = list(_queued_requests(self.svc.queue))
        self._reported_queue_len = len(queued)
        live = self.live_workers()
        return {"name": self.svc.cfg.name, "version": self.svc.cfg.version,
                "queue_tokens": float(sum(self.tokens_of(r) for r in queued)), "queue_len": len(queued),
                "arrivals_tokens_per_s": round(self._arrivals.rate(now), 3),
                "served_tokens_per_s": round(self._served.rate(now), 3), "workers": live,
                "cold_start_waiting": len(queued) if live == 0 else 0, "tenants": self.tenant_shares(now)}

    def tenant_shares(self, now: float) -> list[list]:
        """``[[tenant, service share, weight share], ...]``: each tenant's share of the weighted service over the
        ledger's window (``actorserve_tenant_service_share``) against its weight's share among the active
        tenants (``actorserve_tenant_weight_share``), largest first, at most ``MAX_LOAD_TENANTS`` (the operator
        dashboard shows them, gateway/dashboard_data.py)."""
        svc = self.svc
        shares = svc.ledger.shares(now)
        weights = {t: svc.weights.get(t, 1.0) for t in svc.fair.active_tenants()}
        rows = [[t, round(min(1.0, shares.get(t, 0.0)), 4), round(min(1.0, weight_share(t, weights)), 4)]
                for t in {*shares, *weights}]
        rows.sort(key=lambda r: (-max(r[1], r[2]), r[0]))
        return rows[:MAX_LOAD_TENANTS]

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the load report and the zero-worker check."""
        self.started = time.monotonic()
        self._served_total = sum(self.svc.ledger.completion_tokens.values())
        await self.reporter.start()
        self._tasks.append(asyncio.create_task(self._check_loop(), name="scheduler-cold-start"))

    async def wake_if_needed(self, now: float | None = None) -> str | None:
        """Requests wait and no awake worker is left but a sleeping one is: write its ``sleep_key`` = wake (one
        worker, again at most every ``WAKE_RETRY_S`` s while it has not woken). Returns the woken id, or None.
        Needs the registry of :meth:`follow`; an etcd error is logged and retried at the next check."""
        now = time.monotonic() if now is None else now
        if self.registry is None or not len(self.svc.queue) or self.live_workers() > 0:
            return None
        wid = next((w for w in self.sleepers() if now - self._woken.get(w, -1e9) >= WAKE_RETRY_S), None)
        if wid is None:
            return None
        self._woken[wid] = now
        from control.state.names import sleep_key
        try:
            async with asyncio.timeout(2.0):
                await self.registry.put_json(sleep_key(wid), {"want": "wake", "by": "scheduler", "ts": time.time()})
        except Exception as exc:  # noqa: BLE001 - etcd away: the next check tries again
            log.warning("could not wake %s: %r", wid, exc)
            return None
        log.info("%s@%s: requests wait and only sleeping workers are left: waking %s", self.svc.cfg.name,
                 self.svc.cfg.version, wid)
        return wid

    def follow(self, registry, poll_s: float = MANIFEST_POLL_S) -> None:
        """Follow the version's manifest in ``registry`` for ``autoscale.scale_to_zero`` (re-read every
        ``poll_s`` s; an unreadable registry keeps the last value), and wake sleeping workers through it
        (:meth:`wake_if_needed`). Stopped by :meth:`stop`."""
        self.registry = registry
        self._tasks.append(asyncio.create_task(self._follow(registry, poll_s), name="scheduler-manifest"))

    async def stop(self) -> None:
        """Stop the report and the checks."""
        await self.reporter.stop()
        await cancel_tasks(self._tasks)
        self._tasks = []

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            self.check()
            await self.wake_if_needed()
            if len(self.svc.queue) and not self._reported_queue_len:
                self.reporter.kick()  # the queue started to grow: the autoscaler hears it now, not up to 1 s later

    async def _follow(self, registry, poll_s: float) -> None:
        while True:
            try:
                manifest = await registry.get_model_version(self.svc.cfg.name, self.svc.cfg.version)
                flag = scale_to_zero_of(manifest)
                if flag != self.scale_to_zero:
                    log.info("%s@%s: scale_to_zero %s", self.svc.cfg.name, self.svc.cfg.version, flag)
                self.scale_to_zero = flag
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # etcd away: keep the last value
                log.debug("manifest of %s@%s not read: %r", self.svc.cfg.name, self.svc.cfg.version, exc)
            await asyncio.sleep(poll_s)


def scale_to_zero_of(manifest: Any) -> bool:
    """``manifest["autoscale"]["scale_to_zero"]`` is True (anything else, a missing manifest included: False)."""
    if not isinstance(manifest, dict):
        return False
    autoscale = manifest.get("autoscale")
    return isinstance(autoscale, dict) and autoscale.get("scale_to_zero") is True


def _queued_requests(queue):
    """Every request queued in a ``FairQueue`` (any order)."""
    for cls in queue.classes.values():
        for tenant in cls.tenants.values():
            for entry in tenant.queue:
                yield entry.item
