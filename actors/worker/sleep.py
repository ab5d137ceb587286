"""Sleeping replicas (issue [28]): a worker that scales down can sleep instead of exiting, and wake in about a second.

A sleeping worker keeps its process, its weights (in host memory, or the converted-weights cache mapped), its lease
and its NATS subscriptions; it frees its KV cache (the engine's cache is resized to one block and the heap is
trimmed, so the resident memory falls by at least the cache's bytes), takes no work (its credits say ``draining`` and
``sleeping``), and its etcd record says ``state: "sleeping"``. Waking re-creates the cache at its former size and
publishes credits again: the scheduler dispatches to it at the next heartbeat. vLLM's sleep mode (level 1: weights
offloaded, KV cache discarded) is the model; here the weights stay where they are, since on a CPU they already live
in host memory.

Commands arrive as the etcd record ``sleep_key(worker_id)`` = ``{"want": "sleep" | "wake", "by", "ts"}`` (the
supervisor's scale-down and scale-up, or a scheduler whose queue waits while only sleepers are left), watched by
:func:`watch_sleep`. A worker asked to sleep while it runs requests stops taking new ones and sleeps once they have
finished (bounded by ``drain_s``; what is still running then is handed to another worker of the version, as a drain
does, or ends with a retryable 503). docs/autoscaling.md ("Sleeping replicas") and decision 0042 say more.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)

__all__ = ["SleepHost", "SleepControl", "SleepState", "watch_sleep", "rss_bytes", "parse_command"]

WANTS = ("sleep", "wake")


class SleepHost(Protocol):
    """What :class:`SleepControl` uses of the worker service (actors/worker/service.py)."""

    engine: Any  # LLMEngine: resize_kv(bytes), has_unfinished(); its runner's kv (block_bytes, num_blocks) if any
    sleeping: bool  # set here: the service refuses work and its credits say so
    awake_blocks: int  # set here before a sleep: the KV blocks its credits report while asleep (what it will hold)
    draining: bool  # set by drain(); cleared after a sleep's hand-on (a sleep is not a stop)
    live: dict  # requests held (request id -> Live)

    async def publish_credits(self) -> None: ...

    async def run_on_engine_thread(self, fn, *args): ...

    async def drain(self, timeout: float = 30.0) -> None: ...


@dataclass
class SleepState:
    """What the worker's etcd record shows of its sleep (``record()``), and the last transition's figures."""

    state: str = "running"  # running | sleeping (a transition in progress shows the state it leaves)
    since: float = field(default_factory=time.time)  # epoch s of the last transition
    kv_bytes: int = 0  # the KV cache's bytes while awake
    freed_bytes: int = 0  # resident bytes the last sleep gave back (RSS before - after)
    sleep_s: float = 0.0  # the last sleep's duration, command -> asleep (s)
    wake_s: float = 0.0  # the last wake's duration, command -> serving (s)
    wakes: int = 0  # how many times this worker woke

    def record(self) -> dict:
        """The ``sleep`` entry of the worker's etcd record."""
        return {"state": self.state, "since": round(self.since, 3), "kv_bytes": self.kv_bytes,
                "freed_bytes": self.freed_bytes, "sleep_s": round(self.sleep_s, 4), "wake_s": round(self.wake_s, 4),
                "wakes": self.wakes}


def rss_bytes() -> int:
    """This process's resident set size in bytes (``/proc/self/statm``); 0 where /proc cannot say."""
    try:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _trim_heap() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim(0)``; a no-op elsewhere)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)


def parse_command(value: Any) -> str:
    """The ``want`` of a sleep record (``{"want": "sleep" | "wake", ...}``); ValueError naming what is wrong."""
    if not isinstance(value, dict) or value.get("want") not in WANTS:
        raise ValueError(f"a sleep record is {{\"want\": \"sleep\" | \"wake\", ...}}, got {value!r}")
    return value["want"]


class SleepControl:
    """Puts one worker to sleep and wakes it (module docstring). ``host``: the worker service (:class:`SleepHost`);
    ``on_change(state)``: called after each transition (the actor rewrites its etcd record); ``drain_s``: how long
    running requests may take before a sleep hands them on."""

    def __init__(self, host: SleepHost, on_change=None, drain_s: float = 10.0) -> None:
        self.host, self.on_change, self.drain_s = host, on_change, drain_s
        self.state = SleepState(kv_bytes=self._kv_bytes())
        self._lock = asyncio.Lock()

    def _block_bytes(self) -> int:
        kv = getattr(self.host.engine, "kv", None)
        return int(kv.block_bytes) if kv is not None else 0

    def _kv_bytes(self) -> int:
        kv = getattr(self.host.engine, "kv", None)
        return int(kv.num_blocks * kv.block_bytes) if kv is not None else 0

    async def apply(self, want: str) -> None:
        """Carry out one command (``sleep`` / ``wake``); a command for the state it is in does nothing."""
        async with self._lock:
            if want == "sleep" and self.state.state != "sleeping":
                await self._sleep()
            elif want == "wake" and self.state.state == "sleeping":
                await self._wake()
            else:
                return
        if self.on_change is not None:
            await self.on_change(self.state)

    async def _sleep(self) -> None:
        t0, host, before = time.monotonic(), self.host, rss_bytes()
        block = self._block_bytes()
        host.awake_blocks = self._kv_bytes() // block if block else 0  # what it holds once awake: the prompt bound
        host.sleeping = True
        await host.publish_credits()  # the scheduler stops dispatching here at once
        t_end = t0 + self.drain_s
        while (host.live or host.engine.has_unfinished()) and time.monotonic() < t_end:
            await asyncio.sleep(0.02)
        if host.live:
            await host.drain(timeout=2.0)  # hand on (or end, retryably) what is still running
            host.draining = False  # a sleep, not a stop: the service takes work again once awake
        self.state.kv_bytes = self._kv_bytes() or self.state.kv_bytes
        if block:  # (no reference to the old cache is kept here: it must be freed)
            await host.run_on_engine_thread(host.engine.resize_kv, block)
        await asyncio.to_thread(_trim_heap)
        self.state.freed_bytes = max(0, before - rss_bytes())
        self.state.state, self.state.since = "sleeping", time.time()
        self.state.sleep_s = time.monotonic() - t0
        log.info("asleep in %.2f s: KV cache of %d bytes freed, resident memory %d bytes lower",
                 self.state.sleep_s, self.state.kv_bytes, self.state.freed_bytes)

    async def _wake(self) -> None:
        t0, host = time.monotonic(), self.host
        if self.state.kv_bytes and self._block_bytes():
            await host.run_on_engine_thread(host.engine.resize_kv, self.state.kv_bytes)
        host.sleeping = False
        await host.publish_credits()
        self.state.state, self.state.since = "running", time.time()
        self.state.wake_s, self.state.wakes = time.monotonic() - t0, self.state.wakes + 1
        log.info("awake in %.3f s: KV cache of %d bytes again", self.state.wake_s, self.state.kv_bytes)


async def sleep_commands(reg, worker_id: str):
    """Async generator of the commands ("sleep" / "wake", parse_command) put at ``sleep_key(worker_id)``, its
    existing value first; a malformed record is logged and skipped, a record older than this call (an earlier
    worker of this id; 1 s of clock slack) too. Runs until cancelled."""
    from control.state.names import sleep_key

    key, started = sleep_key(worker_id), time.time()
    async for event, k, value in reg.watch_prefix(key, include_existing=True):
        if event != "put" or k != key:  # the prefix also matches longer worker ids
            continue
        try:
            want = parse_command(value)
        except ValueError as exc:
            log.warning("ignoring %s: %s", key, exc)
            continue
        if float(value.get("ts", started)) < started - 1.0:
            continue
        yield want


async def watch_sleep(reg, worker_id: str, control: SleepControl) -> None:
    """Carry out each command of sleep_commands(reg, worker_id) on ``control``; a failed transition is logged and
    the watch goes on. Runs until cancelled."""
    async for want in sleep_commands(reg, worker_id):
        try:
            await control.apply(want)
        except Exception:  # noqa: BLE001 - one failed transition must not end the watch
            log.exception("%s of worker %s failed", want, worker_id)
