"""Sleeping versions on a multi-version worker host (issue [28] on issue [11]'s host; actors/worker/host.py).

A resident version of a host sleeps as a worker does (actors/worker/sleep.py): told on its ``sleep_key(worker
id)``, it stops taking work, its KV cache is freed (resized to one block) and its weights stay resident. The host
counts what a version holds (``Slot.kv_bytes`` reads the engine's cache), so a sleep raises the host's free bytes
at once, and the residency policy counts no KV floor for a sleeper: the room is **lent** to the other versions --
one that waits to load loads into it, a sleeping one wakes into it.

A wake (the scheduler's word when requests wait with only sleepers left, or the autoscaler's) is not carried out
by the watch but queued for the host's round (:meth:`HostSleep.wake_round`): the waking version needs its KV
cache back. With enough free bytes it wakes at its former size (at most the host's KV cap); with less, but at
least the KV floor, it wakes smaller; otherwise the room is **handed back**: the awake versions that are idle and
not pinned sleep (least demand first) until it fits, and a busy one is paused (no admissions) so that it becomes
idle at a later round. No request is ended: what runs on a version that yields finishes first.

The host's record shows a sleeper's row with ``state: "sleeping"`` and counts ``sleeps``, ``wakes`` and
``handbacks`` (sleeps that gave memory back to a waking version). Decision 0042 says more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from actors.worker.sleep import SleepControl, sleep_commands

log = logging.getLogger("actorserve.worker")

__all__ = ["HostSleep"]


class HostSleep:
    """The sleep state of one host (module docstring). ``host``: the :class:`~actors.worker.host.ModelHost`."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.pending: dict[str, float] = {}  # ref -> monotonic s its wake was asked for (served at the next round)
        self.yielding: set[str] = set()  # refs paused to hand memory back to a waking version
        self.sleeps = self.wakes = self.handbacks = 0

    # ---- per slot ------------------------------------------------------------------------------------------
    def follow(self, slot) -> None:
        """Give ``slot`` a :class:`SleepControl` (``slot.sleep``) and watch its ``sleep_key``: a sleep is carried
        out at once, a wake queued for :meth:`wake_round`. The watch is one of the slot's tasks (cancelled at
        eviction)."""
        host = self.host

        async def on_change(state) -> None:
            slot.info["sleep"] = state.record()
            if state.state == "sleeping":
                self.sleeps += 1
            else:
                self.wakes += 1
            with contextlib.suppress(Exception):  # etcd slow: the host record still says it; logged below
                async with asyncio.timeout(3.0):
                    await host.reg.put_json(slot.holder[0].key, slot.info, lease=slot.holder[0].lease_id)
            host.wake.set()  # the residency round sees the bytes freed or taken at once

        slot.sleep = SleepControl(slot.svc, on_change, drain_s=getattr(host.args, "drain_timeout", 10.0))
        slot.info["sleep"] = slot.sleep.state.record()
        slot.tasks.append(asyncio.create_task(self._watch(slot), name=f"sleep-{slot.worker_id}"))

    async def _watch(self, slot) -> None:
        async for want in sleep_commands(self.host.reg, slot.worker_id):
            if want == "wake":
                self.pending.setdefault(slot.ref, time.monotonic())
                self.host.wake.set()
                continue
            self.pending.pop(slot.ref, None)
            try:
                await slot.sleep.apply("sleep")
            except Exception:  # noqa: BLE001 - one failed transition must not end the watch
                log.exception("sleep of %s on host %s failed", slot.ref, self.host.host_id)

    # ---- the host's view -------------------------------------------------------------------------------------
    @staticmethod
    def asleep(slot) -> bool:
        """True while ``slot`` sleeps (its KV cache freed)."""
        return slot.sleep is not None and slot.sleep.state.state == "sleeping"

    def asleep_refs(self) -> set[str]:
        """Refs of the resident versions that sleep."""
        return {r for r, s in self.host.slots.items() if self.asleep(s)}

    def held(self, ref: str) -> bool:
        """True when ``ref`` is paused to hand memory back (the round's "drain called off" must leave it)."""
        return ref in self.yielding

    # ---- the round -------------------------------------------------------------------------------------------
    async def wake_round(self, demand) -> None:
        """Serve the queued wakes, oldest first (module docstring). ``demand``: ref -> Demand (residency.py) of
        the resident versions, for the order in which awake versions yield."""
        host = self.host
        for ref in sorted(self.pending, key=self.pending.get):
            slot = host.slots.get(ref)
            if slot is None or not self.asleep(slot):  # evicted (its scheduler asks for a load) or awake already
                del self.pending[ref]
                continue
            floor = int(host.args.kv_floor_bytes)
            want = max(floor, min(slot.sleep.state.kv_bytes or floor, host.kv_cap()))
            free = host.free_bytes() + slot.kv_bytes  # its one block comes back too
            if free < floor:
                free += await self._hand_back(ref, want - free, demand)
            if free < floor:
                continue  # the yielding versions are still busy: the next round
            slot.sleep.state.kv_bytes = min(want, free)
            try:
                await slot.sleep.apply("wake")
            except Exception:  # noqa: BLE001 - a failed wake leaves it asleep; its scheduler asks again
                log.exception("wake of %s on host %s failed", ref, host.host_id)
            del self.pending[ref]
            log.info("host %s: %s awake with a KV cache of %d bytes, %.2f s after its wake was asked", host.host_id,
                     ref, slot.kv_bytes, slot.sleep.state.wake_s)
        for ref in list(self.yielding):  # a yielder that slept, or left, or whose waker is served: admits again
            slot = host.slots.get(ref)
            if slot is None or self.asleep(slot) or not self.pending:
                self.yielding.discard(ref)
                if slot is not None and not self.asleep(slot):
                    from actors.worker.host_slot import resume
                    await resume(slot)

    async def _hand_back(self, waker: str, need: int, demand) -> int:
        """Put idle awake versions to sleep (least demand first) until ``need`` bytes are free; pause a busy one
        when that is short. Returns the bytes freed now."""
        from actors.worker.host_slot import pause

        host, freed = self.host, 0
        awake = [(r, s) for r, s in host.slots.items() if r != waker and not self.asleep(s) and r not in host.pinned
                 and s.sleep is not None and not s.resize_to]
        awake.sort(key=lambda rs: (rs[0] not in self.yielding, _value(demand.get(rs[0])), rs[0]))
        for ref, slot in awake:
            if freed >= need:
                break
            if slot.idle():
                before = slot.kv_bytes
                await slot.sleep.apply("sleep")
                freed += max(0, before - slot.kv_bytes)
                self.handbacks += 1
                self.yielding.discard(ref)
                log.info("host %s: %s sleeps, handing %d bytes back to %s", host.host_id, ref, before, waker)
            elif ref not in self.yielding:
                self.yielding.add(ref)
                await pause(slot)
                log.info("host %s: %s paused until idle, to hand memory back to %s", host.host_id, ref, waker)
                break  # one at a time: the room comes when it is idle
        return freed

    def record(self) -> dict:
        """The host record's sleep counts."""
        return {"sleeps": self.sleeps, "wakes": self.wakes, "handbacks": self.handbacks,
                "waking": sorted(self.pending)}


def _value(demand) -> float:
    """A version's recent demand (tokens/s plus queued and running requests), the order in which it yields."""
    if demand is None:
        return 0.0
    return demand.tokens_per_s + 100.0 * (demand.queue_len + demand.running)
