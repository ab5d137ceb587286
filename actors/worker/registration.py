"""A worker's etcd registration: its record's load phases and memory figures, and re-registration after a
lost lease. Shared by the one-version worker (actors/worker/actor.py) and the multi-version host
(host_slot.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
import uuid

from actors.worker.load_phases import LoadTimeline

log = logging.getLogger("actorserve.worker")


def add_engine_phases(timeline: LoadTimeline, phases: dict) -> None:
    """The engine's own phases; what else the load took (tokenizer tables, grammar set-up) counts as reading
    the artifact."""
    now = time.monotonic()
    rest = max(0.0, now - timeline.last - sum(phases.values()))
    timeline.add_all({**phases, "artifact_read": phases.get("artifact_read", 0.0) + rest}, now=now)


def worker_info(engine, args: argparse.Namespace, worker_id: str, adapters=(), **extra) -> dict:
    """The fields of a worker's etcd record that come from its engine and flags (docs/architecture.md etcd
    keys): id, pid, a fresh incarnation, device, dtype, quantization, the engine path and why, why the native
    kernels do not run the model's architecture (``native_off``, None where they may), slots, adapters,
    pool, engine kind; ``extra`` adds fields (a host's ``host``)."""
    return {"worker_id": worker_id, "pid": os.getpid(), "incarnation": uuid.uuid4().hex[:12],
            "device": args.device, "dtype": getattr(engine, "dtype_name", args.dtype),
            "quantization": getattr(engine, "quantization", None),
            "path": getattr(getattr(engine, "path_choice", None), "reason", None),
            "holds": getattr(engine, "held", None),  # what the projections are held as (engine/kquant.py)
            "row_kernels": _row_line(engine),  # the measured kernel per step row count (engine/row_kernels.py)
            "whole_step": getattr(engine, "whole_step_line", None),  # small decode steps in one call (whole_step.py)
            "native_off": getattr(engine, "native_off_reason", None),  # torch path: why (arch_spec.native_unsupported)
            "max_num_seqs": args.max_num_seqs, "adapters": sorted(adapters), "pool": getattr(args, "pool", "default"),
            "engine": getattr(args, "engine", "torch"), **extra}


def memory_record(engine, manifest: dict, args: argparse.Namespace, ref) -> dict | None:
    """The worker record's ``memory`` (bytes): ``budget_bytes`` (``--memory-budget-bytes``, else weights + KV +
    adapter slots), ``weights_bytes``, ``kv_bytes``, ``adapters_bytes`` (LoRA slots reserved) and ``resident``: one row per resident version (``model``, ``quantization``,
    ``weights_bytes``, ``kv_bytes``, ``share_key``: the artifact + quantization its weights come from). None
    for an engine that holds no weights (zero-compute)."""
    weights = getattr(engine, "weights_bytes", None)
    if weights is None or not hasattr(engine, "kv"):
        return None
    kv, quant = int(engine.kv.num_bytes), getattr(engine, "quantization", None)
    row = {"model": f"{ref.name}@{ref.version}", "quantization": quant or engine.dtype_name,
           "weights_bytes": int(weights), "kv_bytes": kv, "share_key": f"{manifest['artifact']}|{quant or 'none'}"}
    adapters = int(getattr(engine, "lora_reserve_bytes", 0))  # LoRA slots kept out of the budget (docs/lora.md)
    return {"budget_bytes": int(getattr(args, "memory_budget_bytes", 0) or weights + kv + adapters),
            "weights_bytes": int(weights), "kv_bytes": kv, "adapters_bytes": adapters, "resident": [row]}


async def keep_registered(reg, holder: list, ref, worker_id: str, info: dict, ttl: int) -> None:
    """Re-register whenever the lease is lost; runs until cancelled.

    While etcd is away the lease's keepalive keeps retrying and the worker keeps serving (the
    scheduler keeps dispatching from its last table and credits travel on NATS). ``lease.lost`` is
    set only when etcd answers again and no longer knows the lease (it expired during the outage, or
    was revoked): then register again at once, retrying every second while etcd does not answer
    (logged once per outage). ``holder[0]`` is the current lease (so shutdown revokes the live one)."""
    from control.state.registry import OutageLog

    outage = OutageLog(log, f"worker {worker_id} registration")
    while True:
        await holder[0].lost.wait()
        log.error("worker %s lost its etcd lease; registering again", worker_id)
        while True:
            try:
                holder[0] = await reg.register_worker(ref.name, ref.version, worker_id, info, ttl=ttl)
                outage.ok()
                log.warning("worker %s registered again", worker_id)
                break
            except Exception as exc:  # etcd still away: keep trying, the service keeps running
                outage.failed(exc)
                await asyncio.sleep(1.0)


def _row_line(engine) -> str | None:
    """``"1 avx2, 2-4 avx512, 5-8 avx512, 9-32 avx512"`` for an engine running a measured row table, else None."""
    try:
        table = engine.row_table
    except AttributeError:  # zero-compute: no runner attribute
        return None
    return table.line() if table is not None else None
