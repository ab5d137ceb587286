"""One resident model version of a multi-version worker host (actors/worker/host.py): load it (its own engine,
or one sharing the weights of a resident version of the same artifact and quantization), serve it as a worker
of its version (dispatch subject, credits, etcd lease with ``"host"`` in the record), pause its admissions,
resize its KV cache, evict it.

The engine's steps of every version of a host run on the host's one engine thread (one OpenMP team on the
cores; versions that share a model never run forwards at once); loads run on a thread of their own, so the
resident versions keep serving while another loads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from actors.worker.load_phases import LoadTimeline
from actors.worker.service import WorkerConfig, WorkerService
from control.state.names import ModelRef

log = logging.getLogger("actorserve.worker")


@dataclass
class Slot:
    """A resident version. Bytes are what the engine holds (measured after the load)."""

    ref: str  # name@version
    name: str
    version: str
    worker_id: str  # its worker id (dispatch subject, etcd lease): ``<host id>-v<n>``
    share_key: str  # artifact | dtype | quantization: equal keys share one copy of the weights
    engine: Any
    svc: WorkerService
    info: dict  # the worker record
    holder: list = field(default_factory=list)  # [WorkerLease] (replaced when re-registered)
    tasks: list = field(default_factory=list)  # re-registration and adapter followers (cancelled at eviction)
    shared: bool = False  # True: the weights belong to another slot's engine
    load_s: float = 0.0  # seconds the load took (ready to serve)
    resize_to: int = 0  # > 0: admissions paused until idle, then the KV cache gets this many bytes
    generated: int = 0  # the engine's generated tokens at the previous demand sample
    sleep: Any = None  # its SleepControl (actors/worker/host_sleep.py): a sleeping version holds no KV cache

    @property
    def weights_bytes(self) -> int:
        return int(getattr(self.engine, "weights_bytes", 0))

    @property
    def kv_bytes(self) -> int:
        kv = getattr(self.engine, "kv", None)
        return int(kv.num_bytes) if kv is not None else 0

    @property
    def extra_bytes(self) -> int:
        """LoRA slots reserved by this version's engine (bytes)."""
        return int(getattr(self.engine, "lora_reserve_bytes", 0))

    def idle(self) -> bool:
        """True when nothing runs or waits here (an eviction or a resize may happen now)."""
        return not self.svc.live and not self.svc.num_queued and not self.engine.has_unfinished()

    def row(self) -> dict:
        """The host record's row of this version."""
        asleep = self.sleep is not None and self.sleep.state.state == "sleeping"
        state = "sleeping" if asleep else "paused" if self.resize_to else (
            "draining" if self.svc.draining else "serving")
        return {"model": self.ref, "worker_id": self.worker_id, "weights_bytes": self.weights_bytes,
                "kv_bytes": self.kv_bytes, "adapters_bytes": self.extra_bytes, "shared": self.shared,
                "share_key": self.share_key, "quantization": self.info.get("quantization") or self.info.get("dtype"),
                "state": state, "running": len(self.svc.live), "load_s": round(self.load_s, 3)}


def slot_args(args: argparse.Namespace, kv_bytes: int) -> argparse.Namespace:
    """The worker flags for one version's engine: its KV share in bytes, no budget of its own (the host keeps
    the budget), no progress bar when several loads may print at once."""
    out = argparse.Namespace(**vars(args))
    out.kv_cache_bytes, out.memory_budget_bytes, out.tensor_parallel = int(kv_bytes), 0, 1
    return out


def build_slot_engine(manifest: dict, args: argparse.Namespace, kv_bytes: int, donor=None):
    """The engine of one version (blocking: run off the event loop): a fresh load, or with ``donor`` (a
    resident engine of the same share key) an engine over the donor's weights."""
    from actors.worker.engine_build import build_engine

    if donor is None:
        return build_engine(manifest, slot_args(args, kv_bytes))
    from actors.worker.engine.engine import EngineConfig, LLMEngine

    cfg = EngineConfig(model_path=manifest["artifact"], dtype=donor.dtype_name, device=args.device,
                       quantization=donor.quantization, kv_cache_bytes=int(kv_bytes), max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=manifest.get("context_length") or None,
                       max_loras=getattr(args, "max_loras", 4), max_cpu_loras=getattr(args, "max_cpu_loras", 16),
                       max_lora_rank=getattr(args, "max_lora_rank", 16))
    engine = LLMEngine(cfg, share_weights_of=donor)
    engine.path_choice = getattr(donor, "path_choice", None)
    return engine


async def open_slot(host, ref: str, manifest: dict, kv_bytes: int, donor: Slot | None) -> Slot:
    """Load ``ref`` and make it serve (service started, lease taken). Raises what the load raises (the
    caller logs it and forgets the version's ask)."""
    from actors.worker.registration import add_engine_phases, memory_record, worker_info

    name, _, version = ref.partition("@")
    timeline = LoadTimeline(start=time.monotonic())
    timeline.mark("registry")
    engine = await asyncio.to_thread(build_slot_engine, manifest, host.args, kv_bytes,
                                     donor.engine if donor else None)
    add_engine_phases(timeline, getattr(engine, "load_phases", {}))
    worker_id = host.next_worker_id()
    svc = WorkerService(host.bus, engine, WorkerConfig(worker_id, name, version), engine_thread=host.engine_thread)
    if donor is None and getattr(host.args, "warmup", True):  # shared weights: the kernels are warm already
        from actors.worker.engine.warmup import warm_up
        await svc.run_on_engine_thread(warm_up, engine)
        timeline.mark("warmup")
    await svc.start()
    timeline.mark("credits")
    info = worker_info(engine, host.args, worker_id, host=host.host_id)
    slot = Slot(ref, name, version, worker_id, host.share_key(manifest), engine, svc, info, shared=donor is not None)
    slot.holder.append(await host.reg.register_worker(name, version, worker_id, info, ttl=host.args.lease_ttl))
    timeline.mark("register")
    slot.load_s = timeline.ready_s
    info.update(load_phases=timeline.as_dict(), load_s=round(timeline.ready_s, 3))
    if (memory := memory_record(engine, manifest, slot_args(host.args, kv_bytes), ModelRef(name, version))) is not None:
        memory["budget_bytes"] = host.budget  # the host's one budget, shared by its versions
        memory["resident"][0]["shared"] = slot.shared
        info["memory"] = memory
    with contextlib.suppress(Exception):
        async with asyncio.timeout(3.0):
            await host.reg.put_json(slot.holder[0].key, info, lease=slot.holder[0].lease_id)
    _start_followers(host, slot)
    log.info("host %s: %s resident as worker %s (%s), %s", host.host_id, ref, worker_id,
             "weights shared" if slot.shared else "weights loaded", timeline.line())
    return slot


def _start_followers(host, slot: Slot) -> None:
    """Re-registration after a lost lease, and the registry's adapters of the version kept in the engine."""
    from actors.worker.registration import keep_registered
    from actors.worker.adapter_sync import AdapterSync, follow_registry

    ref = ModelRef(slot.name, slot.version)
    slot.tasks.append(asyncio.create_task(keep_registered(host.reg, slot.holder, ref, slot.worker_id, slot.info,
                                                          host.args.lease_ttl)))
    if getattr(slot.engine, "adapters", None) is not None:
        slot.tasks.append(asyncio.create_task(follow_registry(host.reg, slot.svc, slot.name, slot.version,
                                                              AdapterSync())))


async def pause(slot: Slot) -> None:
    """Admit nothing more (draining credits): schedulers stop dispatching here; what runs goes on."""
    slot.svc.draining = True
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await slot.svc.publish_credits()


async def resume(slot: Slot) -> None:
    """Admit again after a pause (a resize done, or a drain called off)."""
    slot.svc.draining = False
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await slot.svc.publish_credits()


async def close_slot(slot: Slot, forced: bool, drain_timeout_s: float = 5.0) -> None:
    """Evict: stop admissions, drop the lease (schedulers stop routing here), end what still runs (only when
    ``forced``: a retryable 503, as a worker drain does), stop the service and free the engine."""
    await pause(slot)
    with contextlib.suppress(Exception):
        async with asyncio.timeout(3.0):
            await slot.holder[0].revoke()
    for t in slot.tasks:
        t.cancel()
    if forced or slot.svc.live:
        await slot.svc.drain(timeout=0.0 if forced else drain_timeout_s)
    await slot.svc.stop()
    close = getattr(slot.engine, "close", None)
    if close is not None:
        await asyncio.to_thread(close)
    slot.engine = slot.svc.engine = None
    await asyncio.to_thread(gc.collect)  # the tensors go now, not at the next collection
