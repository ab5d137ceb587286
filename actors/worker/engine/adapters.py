"""The engine's LoRA adapters: registered names, lazy loading through the tiers (lora_tiers.py), slot contents.

``AdapterManager`` carries out ``AdapterTiers``' decisions: it reads an adapter from disk (lora.py) into the
CPU tier when a request first names it, copies it into an accelerator slot when a sequence that needs it is
admitted, and builds each step's products over the slots (lora_slots.py) with an identity check (``batch``): a
slot whose adapter is not the one a sequence was admitted with raises instead of computing with the wrong
weights.
Load times are kept (``load_ms``) for the bench and ``/metrics``.
"""

from __future__ import annotations

import time

import torch

from .lora import AdapterError, HostAdapter, load_peft
from .lora_slots import LoraBatch, SlotStack, make_batch
from .lora_tiers import AdapterTiers


class AdapterManager:
    """Adapters of one engine.  ``max_loras`` accelerator slots, ``max_cpu_loras`` in the CPU tier,
    ``max_rank`` the largest r accepted (each slot holds that rank; ValueError below 1). Not thread-safe: the engine's step thread calls it."""

    def __init__(self, model_config, dtype: torch.dtype, device: str, max_loras: int = 4,
                 max_cpu_loras: int = 16, max_rank: int = 64) -> None:
        if max_rank < 1:
            raise ValueError("max_rank must be >= 1")
        self.model_config, self.dtype, self.device, self.max_rank = model_config, dtype, device, max_rank
        self.tiers = AdapterTiers(max_loras, max_cpu_loras)
        self.paths: dict[str, str] = {}  # registered adapter name -> PEFT directory
        self._host: dict[str, HostAdapter] = {}  # the CPU tier's contents
        self.stack = SlotStack(model_config, max_loras, max_rank, dtype, device)  # the accelerator slots
        self.stack.kernels = _sgmv_kernels(dtype, device)
        self.load_ms: dict[str, list[float]] = {"disk": [], "cpu": []}  # ready times (ms) by source tier

    def register(self, name: str, path: str) -> None:
        """Make ``name`` servable from ``path`` (read lazily). ValueError for an empty name or a name holding
        ':' or '@' (those separate model, version and adapter in request model ids)."""
        if not name or any(c in name for c in ":@/ "):
            raise ValueError(f"adapter name {name!r} must be non-empty without ':', '@', '/' or spaces")
        if self.paths.get(name) not in (None, path):
            self.unregister(name)
        self.paths[name] = path

    def unregister(self, name: str) -> None:
        """Forget ``name`` in every tier (the caller makes sure no live request names it)."""
        self.paths.pop(name, None)
        self._host.pop(name, None)
        slot = self.tiers.forget(name)
        if slot is not None:
            self.stack.clear(slot)

    def ensure_host(self, name: str, pinned: set[str]) -> None:
        """Read ``name`` into the CPU tier unless there; AdapterError (unregistered, corrupt, does not fit).
        ``pinned``: adapters live requests name (never dropped from the tier)."""
        if name not in self.paths:
            raise AdapterError(f"adapter {name!r} is not registered on this worker")
        if not (self.tiers.in_cpu(name) and name in self._host):
            t0 = time.perf_counter()
            self._host[name] = load_peft(name, self.paths[name], self.model_config, self.max_rank)
            self.load_ms["disk"].append((time.perf_counter() - t0) * 1e3)
        for dropped in self.tiers.add_cpu(name, pinned):  # read, or touched
            self._host.pop(dropped, None)

    def can_place(self, name: str, in_use: set[str]) -> bool:
        """True when a sequence of ``name`` can be admitted now (see AdapterTiers.can_place)."""
        return self.tiers.can_place(name, in_use)

    def place(self, name: str, in_use: set[str]) -> int | None:
        """Slot for a sequence of ``name`` admitted now, copying the adapter in when needed; None = no free
        slot (every slot used by a running sequence). The adapter must be in the CPU tier (``ensure_host``)."""
        decision = self.tiers.place(name, in_use)
        if decision is None or not decision.load:
            return None if decision is None else decision.slot
        t0 = time.perf_counter()
        self.stack.load(decision.slot, self._host[name])
        self.load_ms["cpu"].append((time.perf_counter() - t0) * 1e3)
        return decision.slot

    def slot_for(self, name: str) -> int:
        """The slot of a running sequence of ``name``; RuntimeError when the adapter is not in a slot or its slot
        holds another adapter (must never happen: admission placed it and eviction skips adapters of running
        sequences)."""
        slot = self.tiers.slot_of(name)
        held = None if slot is None else self.stack.names[slot]
        if held != name:
            raise RuntimeError(f"adapter {name!r}: its slot holds {held!r}")
        return slot

    def batch(self, names: list[str | None], query_lens: list[int]) -> LoraBatch | None:
        """The step's low-rank products for its sequences' adapters (None = base), identity checked; None when
        no sequence has an adapter."""
        if not any(names):
            return None
        return make_batch(self.stack, [self.slot_for(n) if n else None for n in names], query_lens, self.device)

    def slot_bytes(self) -> int:
        """Bytes the accelerator slots hold now (0 before the first adapter is placed)."""
        return self.stack.nbytes

    def stats(self) -> dict:
        """Counters for ``EngineStats.extra`` (lora_*): loads and evictions per tier, resident names, bytes."""
        t = self.tiers
        return {"lora_slot_loads": t.num_slot_loads, "lora_slot_evictions": t.num_slot_evictions,
                "lora_disk_loads": t.num_disk_loads, "lora_cpu_evictions": t.num_cpu_evictions,
                "lora_resident": [s for s in t.slots if s is not None], "lora_cpu": list(t.cpu),
                "lora_slot_bytes": self.slot_bytes(), "lora_registered": sorted(self.paths)}


def _sgmv_kernels(dtype: torch.dtype, device):
    """The native kernels when they serve this dtype and device (``lora_sgmv``), else None (torch products)."""
    from . import cpu_kernels

    if not cpu_kernels.CpuKernels.supports(dtype, device):
        return None
    return cpu_kernels.load()
