"""The load report every CPU-tier actor publishes for the autoscaler (issue [13]): :class:`LoadReporter`.

Each report (``bus.messages.ActorLoad`` on ``as.int.load.<kind>.<actor_id>``, about once a second) covers the
time since the previous one:

* ``loop_lag_ms_p95``: event-loop lag, sampled by sleep drift -- a task sleeps ``lag_sample_s`` (50 ms) and
  records how much later than asked it woke up (ms) -- counted only as far as this process was running
  meanwhile: ``min(drift, process CPU time used over the interval)``; the p95 of the window's samples. A loop
  busy with its own CPU work or too many callbacks wakes late and has used the CPU: the first sign an asyncio
  actor is saturated. A loop that wakes late because the machine's cores were busy elsewhere (another
  process starving it) has used none: another replica on the same cores would not help, so that drift is not
  load (measured: an idle validator next to a busy worker on 2 cores drifted 30-55 ms at 0.01 CPU s/s).
  The raw drift p95 goes in ``loop_drift_ms_p95``.
* ``cpu_util``: ``time.process_time()`` over wall time in the window (process CPU seconds per second, every
  thread counted, so tokenization in threads shows; on N cores it can reach N).
* ``wait_ms_p90``: p90 of the queue waits the actor reported with :meth:`LoadReporter.waited` (the handler calls
  it when it starts a message, with the message's enqueue time, e.g. the gateway's ``gateway_out`` mark).
* ``pending``: what the ``pending`` callable returns at report time (messages waiting in the actor's queue-group
  subscription plus its own backlog).
* ``handled``: messages started in the window (each :meth:`waited` or :meth:`count` call).

The window arithmetic is in :class:`LoadWindow` (pure: times are passed in); the reporter is the shell that
samples the clocks and publishes. A failed publish (bus reconnecting) drops that report only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from bus import subjects
from bus.base import BusError
from bus.messages import ActorLoad
from actors.aio import cancel_tasks, wait_event

log = logging.getLogger(__name__)

MAX_SAMPLES = 10_000  # per window and series: a burst of waits beyond this keeps the most recent ones


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by the nearest-rank method; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


def new_actor_id(prefix: str = "") -> str:
    """A subject-safe id for a process without one of its own: ``[<prefix>-]<pid>-<6 hex>``."""
    tail = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
    return f"{prefix}-{tail}" if prefix else tail


@dataclass
class LoadWindow:
    """The figures of one report window (pure: every time is an argument).

    ``started`` (monotonic s) and ``cpu_started`` (process CPU s) mark the window's start;
    :meth:`close` returns the window's figures and starts the next one."""

    started: float
    cpu_started: float
    lags_ms: list[float] = field(default_factory=list)
    drifts_ms: list[float] = field(default_factory=list)
    waits_ms: list[float] = field(default_factory=list)
    handled: int = 0

    def add_lag(self, drift_ms: float, cpu_ms: float | None = None) -> None:
        """One sleep-drift sample (ms; negative counts as 0) and the process CPU time used over its interval
        (ms; None: unknown, the whole drift counts): the lag is ``min(drift, cpu)``."""
        if len(self.lags_ms) < MAX_SAMPLES:
            drift = max(0.0, float(drift_ms))
            self.drifts_ms.append(drift)
            self.lags_ms.append(drift if cpu_ms is None else min(drift, max(0.0, float(cpu_ms))))

    def add_wait(self, wait_ms: float | None) -> None:
        """One message started after waiting ``wait_ms`` (None: wait unknown, only counted)."""
        self.handled += 1
        if wait_ms is not None and math.isfinite(wait_ms):
            if len(self.waits_ms) >= MAX_SAMPLES:
                self.waits_ms.pop(0)
            self.waits_ms.append(max(0.0, float(wait_ms)))

    def close(self, now: float, cpu_now: float) -> dict[str, float | int]:
        """``{window_s, loop_lag_ms_p95, loop_drift_ms_p95, cpu_util, wait_ms_p90, handled}`` of the window
        ending at ``now`` (monotonic s; ``cpu_now``: process CPU s), then reset for the next window."""
        span = max(1e-6, now - self.started)
        out = {"window_s": round(span, 3), "loop_lag_ms_p95": round(percentile(self.lags_ms, 0.95), 3),
               "loop_drift_ms_p95": round(percentile(self.drifts_ms, 0.95), 3),
               "cpu_util": round(max(0.0, cpu_now - self.cpu_started) / span, 4),
               "wait_ms_p90": round(percentile(self.waits_ms, 0.90), 3), "handled": self.handled}
        self.started, self.cpu_started = now, cpu_now
        self.lags_ms, self.drifts_ms, self.waits_ms, self.handled = [], [], [], 0
        return out


class LoadReporter:
    """Publishes this actor's :class:`~bus.messages.ActorLoad` every ``period_s`` seconds.

    ``pending() -> int``: messages waiting (called at report time; None: 0). ``extras() -> dict``: more
    ActorLoad fields (the scheduler's queue figures), merged into each report. ``start()`` / ``stop()``;
    ``kick()`` sends the next report early (at most one per ``period_s / 4``): a change the autoscaler must
    see soon (a queue that starts to grow) does not wait for the period."""

    def __init__(self, bus, kind: str, actor_id: str, *, period_s: float = 1.0, lag_sample_s: float = 0.05,
                 pending: Callable[[], int] | None = None, extras: Callable[[], dict[str, Any]] | None = None) -> None:
        if not period_s > 0 or not lag_sample_s > 0:
            raise ValueError("period_s and lag_sample_s must be > 0")
        self.subject = subjects.load_subject(kind, actor_id)  # ValueError for an unsafe kind or id
        self.bus, self.kind, self.actor_id = bus, kind, actor_id
        self.period_s, self.lag_sample_s = float(period_s), float(lag_sample_s)
        self._pending, self._extras = pending, extras
        self.window = LoadWindow(time.monotonic(), time.process_time())
        self.last: ActorLoad | None = None  # the latest report sent (for tests and status)
        self.sent = 0
        self._tasks: list[asyncio.Task] = []
        self._kicked = asyncio.Event()

    def kick(self) -> None:
        """Send the next report early (see the class docstring)."""
        self._kicked.set()

    def waited(self, enqueued_at: float | None, now: float | None = None) -> None:
        """A message starts being handled; it was enqueued at ``enqueued_at`` (epoch s, e.g. a timing mark;
        None or 0: unknown, only counted). ``now``: epoch s (default: the clock)."""
        if not enqueued_at:
            return self.window.add_wait(None)
        now = time.time() if now is None else now
        self.window.add_wait((now - float(enqueued_at)) * 1e3)

    def count(self, n: int = 1) -> None:
        """``n`` messages handled whose wait is unknown."""
        for _ in range(max(0, int(n))):
            self.window.add_wait(None)

    def report(self) -> ActorLoad:
        """Close the current window and build its ActorLoad (no publish)."""
        figures = self.window.close(time.monotonic(), time.process_time())
        pending = int(self._pending()) if self._pending is not None else 0
        extra = dict(self._extras()) if self._extras is not None else {}
        return ActorLoad(self.kind, self.actor_id, time.time(), pending=max(0, pending), **figures, **extra)

    async def start(self) -> None:
        """Start the lag sampler and the publishing loop."""
        self.window = LoadWindow(time.monotonic(), time.process_time())
        self._tasks = [asyncio.create_task(self._sample_lag(), name=f"load-lag-{self.kind}"),
                       asyncio.create_task(self._publish_loop(), name=f"load-report-{self.kind}")]

    async def stop(self) -> None:
        """Stop both tasks (bounded by their cancellation)."""
        await cancel_tasks(self._tasks)
        self._tasks = []

    async def _sample_lag(self) -> None:
        while True:
            t0, c0 = time.monotonic(), time.process_time()
            await asyncio.sleep(self.lag_sample_s)
            self.window.add_lag((time.monotonic() - t0 - self.lag_sample_s) * 1e3, (time.process_time() - c0) * 1e3)

    async def _publish_loop(self) -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(self.period_s / 4)
            await wait_event(self._kicked, max(0.0, self.period_s - (time.monotonic() - t0)))  # a kick: early
            self._kicked.clear()
            try:
                msg = self.report()
                await self.bus.publish(self.subject, msg.encode())
                self.last, self.sent = msg, self.sent + 1
            except BusError as exc:  # reconnecting: this report is lost, the next window starts anyway
                log.debug("load report of %s not sent: %s", self.actor_id, exc)
            except Exception:  # a faulty extras/pending callable must not stop the reports
                log.exception("load report of %s failed", self.actor_id)
