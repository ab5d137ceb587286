"""Where LoRA adapters live: accelerator slots, a CPU tier, disk (pure: no torch, no nats).

Tiers as in vLLM's multi-LoRA (``max_loras`` slots on the device, ``max_cpu_loras`` adapters cached on the
host; vLLM docs "LoRA Adapters") and S-LoRA's unified memory (Sheng et al. 2023): an adapter is read from disk
on first use into the CPU tier, copied into a free accelerator slot when a sequence that needs it is admitted,
and evicted least recently used.  Two rules keep outputs right:

* a slot is reused only when no running sequence uses its adapter (``place`` returns None otherwise: the
  caller keeps the sequence waiting), so a load can never change the weights under a running sequence;
* the CPU tier never drops an adapter that a live request (waiting or running) names (``pinned``), so an
  admitted request never has to go back to disk.

Decisions are returned as ``Placement`` and carried out by the caller (actors/worker/engine/adapters.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Where an adapter goes for a sequence admitted now."""

    slot: int  # accelerator slot index, 0 .. max_loras - 1
    load: bool  # True: copy the adapter into the slot now (it was not resident)
    evicted: str | None  # adapter that held the slot (None: the slot was free or already held this one)


class AdapterTiers:
    """LRU book-keeping of ``max_loras`` accelerator slots over a ``max_cpu_loras`` CPU tier."""

    def __init__(self, max_loras: int, max_cpu_loras: int) -> None:
        if max_loras < 1 or max_cpu_loras < max_loras:
            raise ValueError("max_loras must be >= 1 and max_cpu_loras >= max_loras")
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self.slots: list[str | None] = [None] * max_loras  # adapter name per slot
        self._slot_lru: OrderedDict[int, None] = OrderedDict()  # slots, least recently used first
        self.cpu: OrderedDict[str, None] = OrderedDict()  # adapters in the CPU tier, least recently used first
        self.num_slot_loads = self.num_slot_evictions = self.num_disk_loads = self.num_cpu_evictions = 0

    def slot_of(self, name: str) -> int | None:
        """Accelerator slot holding ``name``, or None."""
        return self.slots.index(name) if name in self.slots else None

    def can_place(self, name: str, in_use: set[str]) -> bool:
        """True when ``place`` would succeed (resident, a free slot, or a slot no running sequence uses)."""
        return self.slot_of(name) is not None or self._victim(in_use) is not None

    def place(self, name: str, in_use: set[str]) -> Placement | None:
        """Slot for a sequence of ``name`` admitted now; None = no slot can be freed (every slot's adapter is
        used by a running sequence): the caller keeps the sequence waiting. ``in_use``: adapters of the
        running sequences."""
        slot = self.slot_of(name)
        if slot is not None:
            self._touch_slot(slot)
            return Placement(slot, False, None)
        slot = self._victim(in_use)
        if slot is None:
            return None
        evicted, self.slots[slot] = self.slots[slot], name
        self.num_slot_loads += 1
        self.num_slot_evictions += evicted is not None
        self._touch_slot(slot)
        return Placement(slot, True, evicted)

    def _victim(self, in_use: set[str]) -> int | None:
        """A free slot, else the least recently used slot whose adapter no running sequence uses."""
        if None in self.slots:
            return self.slots.index(None)
        return next((s for s in self._slot_lru if self.slots[s] not in in_use), None)

    def _touch_slot(self, slot: int) -> None:
        self._slot_lru.pop(slot, None)
        self._slot_lru[slot] = None

    def in_cpu(self, name: str) -> bool:
        """True when ``name`` is in the CPU tier."""
        return name in self.cpu

    def add_cpu(self, name: str, pinned: set[str]) -> list[str]:
        """Record ``name`` read from disk into the CPU tier (or touch it when there); returns the adapters dropped
        from the tier to stay within ``max_cpu_loras``: least recently used first, never ``name`` nor one in
        ``pinned`` (so the tier may stay over its size while its members are pinned, and shrinks back at a
        later call once they are not)."""
        if name in self.cpu:
            self.cpu.move_to_end(name)
        else:
            self.cpu[name] = None
            self.num_disk_loads += 1
        dropped = []
        for old in list(self.cpu):
            if len(self.cpu) <= self.max_cpu_loras:
                break
            if old != name and old not in pinned:
                del self.cpu[old]
                dropped.append(old)
        self.num_cpu_evictions += len(dropped)
        return dropped

    def forget(self, name: str) -> int | None:
        """Drop ``name`` from every tier (adapter retired); returns the slot it left, or None."""
        self.cpu.pop(name, None)
        slot = self.slot_of(name)
        if slot is not None:
            self.slots[slot] = None
            self._slot_lru.pop(slot, None)
        return slot
