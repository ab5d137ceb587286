"""A worker's LoRA adapters follow the registry: the active adapter records of its model version
(control/state/adapters.py) are registered in its engine; retired or deleted ones are dropped once no request
uses them. Engines are not thread-safe, so changes are applied on the engine's step thread
(``WorkerService.run_on_engine_thread``, between steps). Adapters are read lazily by the engine, on the first
request that names one (actors/worker/engine/adapters.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from control.state.adapters import served_by

log = logging.getLogger(__name__)


class AdapterSync:
    """The adapters registered in one engine, brought to a desired ``{adapter: path}`` set."""

    def __init__(self) -> None:
        self.applied: dict[str, str] = {}  # adapter -> path registered in the engine

    def apply(self, engine, desired: dict[str, str]) -> list[str]:
        """Register new or moved adapters, unregister the others unless a live request names them (retried at
        the next call). Step thread only. Returns the adapters still registered that should not be."""
        if getattr(engine, "adapters", None) is None:  # adapters disabled (max_loras 0) or a zero-compute engine
            return []
        for name, path in desired.items():
            if self.applied.get(name) != path:
                engine.register_adapter(name, path)
                self.applied[name] = path
                log.info("adapter %s registered from %s", name, path)
        left = []  # registered here, or by a request carrying the path (engine.adapters.paths), and no longer wanted
        for name in [n for n in {**self.applied, **engine.adapters.paths} if n not in desired]:
            if engine.unregister_adapter(name):
                self.applied.pop(name, None)
                log.info("adapter %s unregistered", name)
            else:
                left.append(name)
        return left


async def follow_registry(reg, svc, name: str, version: str, sync: AdapterSync, period_s: float = 2.0) -> None:
    """Keep ``svc``'s engine's adapters equal to the registry's for ``name@version``: at once, on every change
    under the model's adapters prefix (watch), and every ``period_s`` (heals a broken watch). Runs until
    cancelled; a failing etcd read is logged and retried at the next period."""
    from control.state.names import adapters_prefix

    changed = asyncio.Event()
    changed.set()

    async def watch() -> None:
        while True:
            with contextlib.suppress(Exception):
                async for _ in reg.watch_prefix(adapters_prefix(name)):
                    changed.set()
            await asyncio.sleep(period_s)

    watcher = asyncio.create_task(watch())
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), period_s)
            changed.clear()
            try:
                async with asyncio.timeout(5.0):
                    records = await reg.list_model_adapters(name)
                await svc.run_on_engine_thread(sync.apply, svc.engine, served_by(records, version))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # etcd away: keep today's adapters, retry next period
                log.warning("adapter records of %s@%s unreadable: %s", name, version, exc)
    finally:
        watcher.cancel()


def track_lora_metrics(engine, model: str) -> None:
    """``actorserve_worker_lora_loads_total{model, tier}`` (tier ``disk``: read into the CPU tier; ``cpu``: copied
    into an accelerator slot), ``actorserve_worker_lora_evictions_total{model, tier}`` (``slot``, ``cpu``),
    ``actorserve_worker_lora_resident{model}`` (adapters in slots) and ``actorserve_worker_lora_bytes{model}``
    (bytes the slots hold) on this worker's /metrics. Nothing for an engine without adapters."""
    from actors.metrics import observable_counter, observable_gauge

    mgr = getattr(engine, "adapters", None)
    if mgr is None:
        return
    t, lab = mgr.tiers, {"model": model}
    observable_counter("actorserve_worker_lora_loads", "LoRA adapter loads by source tier (disk: into the CPU "
                       "tier; cpu: into an accelerator slot; docs/lora.md).", "1",
                       lambda: [(t.num_disk_loads, {**lab, "tier": "disk"}), (t.num_slot_loads, {**lab, "tier": "cpu"})])
    observable_counter("actorserve_worker_lora_evictions", "LoRA adapters evicted, by tier (slot, cpu).", "1",
                       lambda: [(t.num_slot_evictions, {**lab, "tier": "slot"}),
                                (t.num_cpu_evictions, {**lab, "tier": "cpu"})])
    observable_gauge("actorserve_worker_lora_resident", "LoRA adapters in accelerator slots.", "1",
                     lambda: [(sum(s is not None for s in t.slots), lab)])
    observable_gauge("actorserve_worker_lora_bytes", "Bytes the LoRA accelerator slots hold.", "By",
                     lambda: [(mgr.slot_bytes(), lab)])
