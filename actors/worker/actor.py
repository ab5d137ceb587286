"""``actorserve actor worker --model NAME@VERSION``: one engine on one device slot.

Start-up: read the version's manifest from etcd, load the GGUF (progress bar), size the KV cache
from the byte budget, start the service (dispatch, cancel, credits, stats), then take an etcd lease
on ``/actorserve/workers/{name}/{version}/{id}`` (TTL 3 s) so schedulers see it. On SIGTERM: drop
the lease first (no new dispatches), move running requests to another live worker of the version when one
exists, else drain them (bounded by ``--drain-timeout``), exit. A preemption notice (etcd
``preemption_notice_key(worker_id)``, or SIGUSR1) moves them while the worker is still up
(actors/worker/migration.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import time
import uuid

from actors.serve import ActorContext, serve
from actors.worker.engine_build import build_engine, choose_path, tensor_parallel_of  # noqa: F401 (re-exported)
from actors.worker.load_phases import LoadTimeline
from actors.worker.registration import (add_engine_phases, keep_registered, memory_record,  # noqa: F401 (re-exported)
                                        worker_info)
from actors.worker.service import WorkerConfig, WorkerService

log = logging.getLogger("actorserve.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Worker options (common --nats/--etcd/--state-dir are added by actors.runtime)."""
    parser.add_argument("--model", action="append", default=None, metavar="NAME@VERSION",
                        help="the version served by this worker (required, once) or, with --host, a version loaded "
                        "at start (repeatable)")
    parser.add_argument("--host", action="store_true", help="multi-version host: hold the versions schedulers ask "
                        "for within --memory-budget-bytes, evicting by the residency policy (docs/model-loading.md)")
    parser.add_argument("--pin", action="append", default=[], metavar="NAME@VERSION",
                        help="with --host: a version always resident (repeatable)")
    parser.add_argument("--kv-floor-bytes", type=int, default=64 * 2**20, metavar="N",
                        help="with --host: the least KV cache of a resident version (bytes, default 64 MiB)")
    parser.add_argument("--drain-bound", type=float, default=30.0, metavar="S",
                        help="with --host: seconds a version chosen for eviction may drain before what still "
                        "runs on it is ended with a retryable 503 (default 30)")
    parser.add_argument("--worker-id", default=None, help="unique id (default: host-pid-random)")
    parser.add_argument("--kv-cache-bytes", type=int, default=256 * 1024 * 1024, help="KV cache budget (bytes)")
    parser.add_argument("--memory-budget-bytes", type=int, default=0, metavar="N",
                        help="bytes for weights + KV cache together: the KV cache gets what the loaded weights "
                        "leave (default 0: --kv-cache-bytes of KV beside the weights; docs/model-loading.md)")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="sequence slots in the running batch")
    parser.add_argument("--max-loras", type=int, default=4, help="LoRA adapters in accelerator slots at once "
                        "(0: adapter requests are refused; docs/lora.md)")
    parser.add_argument("--max-cpu-loras", type=int, default=16, help="LoRA adapters kept in CPU memory (>= --max-loras)")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank r accepted")
    parser.add_argument("--tensor-parallel", type=int, default=0, metavar="N",
                        help="ranks sharing the model in this worker (heads and MLP columns split, Megatron-LM; "
                        "one logical worker). 0 (default): the manifest's tensor_parallel, else 1 (docs/tensor-parallel.md)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    parser.add_argument("--small-step-tokens", type=int, default=1, metavar="N",
                        help="steps of at most N tokens run on one torch thread (default 1: a one-row decode; 0: "
                        "never). Measured 52.7 -> 110.8 tok/s served at 1 stream on 2 cores with the kernel per "
                        "row count (decision 0051); a --host keeps 0")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="compute dtype (default auto: the fastest correct path for this CPU and model, "
                        "chosen with --quantization; docs/engine.md, docs/decisions/0028-default-kernel-choice.md)")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                        help="weight-only quantization of the projections (default auto: the model manifest's "
                        "pin if it names int8/int4/none, else the GGUF's own precision where that path is "
                        "the faster one here, else none)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    parser.add_argument("--lease-ttl", type=int, default=3, help="etcd lease TTL in seconds (<= 5)")
    parser.add_argument("--no-progress", action="store_true", help="hide the model loading progress bar")
    parser.add_argument("--no-weights-cache", dest="weights_cache", action="store_false",
                        help="read the GGUF on every load instead of the converted-weights cache "
                        "($ACTORSERVE_CACHE_DIR/weights, default ~/.cache/actorserve/weights; docs/model-loading.md)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="advertise credits without the warm-up pass (a few prefill and decode shapes run "
                        "before the first request; docs/model-loading.md)")
    parser.add_argument("--drain-timeout", type=float, default=10.0, metavar="S",
                        help="on SIGTERM: seconds running requests may take to finish before they are ended "
                        "with a retryable 503 (default 10); with another live worker of the version they "
                        "move there instead")
    parser.add_argument("--engine", default="torch", choices=["torch", "zero-compute"],
                        help="torch: the model (default); zero-compute: NO model compute, deterministic tokens, "
                        "only to measure the platform (actorserve bench platform; actors/worker/zero_compute.py)")
    parser.add_argument("--zero-compute-step-ms", type=float, default=0.0, metavar="MS",
                        help="with --engine zero-compute: sleep per step standing for a forward pass (default 0)")
    parser.add_argument("--zero-compute-curve", default=None, metavar="PATH",
                        help="with --engine zero-compute: sleep per step as this measured throughput curve says (JSON "
                        "of actorserve profile --json; ITL at the step's decode rows plus its prefill)")
    parser.add_argument("--pool", default="default", help="accelerator pool this worker belongs to (its etcd "
                        "record's \"pool\"; the pool records of `actorserve pools`)")


def default_worker_id() -> str:
    """``<host>-<pid>-<4 hex>``, safe as a subject token."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:24]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:4]}".lower()


def _leave_on_group_loss(engine) -> None:
    """A tensor-parallel worker whose rank is gone exits at once (status 75): its lease lapses and the
    scheduler re-dispatches its requests that had no token yet to other workers; the other ranks die with it."""
    tp = getattr(engine, "tp", None)
    if tp is None:
        return

    def leave(why: str) -> None:
        log.error("worker leaving: %s", why)
        logging.shutdown()
        os._exit(75)
    tp.on_lost = leave


async def main(args: argparse.Namespace) -> None:
    """Run the worker until cancelled, then drain."""
    from control.state.names import parse_model_ref

    models = [args.model] if isinstance(args.model, str) else list(args.model or [])
    refs = [parse_model_ref(m) for m in models + list(args.pin)]
    if any(not r.version for r in refs):
        raise SystemExit("--model and --pin must be NAME@VERSION")
    worker_id = args.worker_id or default_worker_id()
    if args.host:
        from actors.worker.host_actor import run_host
        await serve(args, f"worker-{worker_id}", functools.partial(run_host, host_id=worker_id))
        return
    if len(models) != 1 or args.pin:
        raise SystemExit("a worker serves one --model NAME@VERSION (several, and --pin, need --host)")
    await serve(args, f"worker-{worker_id}", functools.partial(run_worker, ref=refs[0], worker_id=worker_id))


async def run_worker(ctx: ActorContext, ref, worker_id: str) -> None:
    """Load the engine, connect the bus, start the service, take the etcd lease and keep it until
    cancelled; on stop the worker drains (see :func:`_drain`) before the service and the bus close."""
    args, reg = ctx.args, ctx.registry
    timeline = LoadTimeline(start=time.monotonic() - process_age_s())
    manifest = await reg.get_model_version(ref.name, ref.version)
    if manifest is None:
        raise SystemExit(f"model version {ref.name}@{ref.version} is not registered")
    timeline.mark("registry")
    engine = await asyncio.to_thread(build_engine, manifest, args)
    _leave_on_group_loss(engine)
    if getattr(engine, "tp", None) is not None:  # runs last (closers in reverse): after the service stopped
        ctx.on_stop(lambda: asyncio.to_thread(engine.close), timeout_s=8.0, what="tensor-parallel ranks")
    add_engine_phases(timeline, getattr(engine, "load_phases", {}))
    log.info("worker %s loaded %s@%s; %s", worker_id, ref.name, ref.version,
             engine.kv.describe() if hasattr(engine, "kv") else getattr(engine, "describe", lambda: "?")())
    bus = await ctx.connect_bus()
    from actors.worker.faults import from_manifest as faults_from_manifest
    svc = WorkerService(bus, engine, WorkerConfig(worker_id, ref.name, ref.version),
                        faults=faults_from_manifest(manifest))  # None unless ACTORSERVE_TEST_FAULTS=1
    if getattr(args, "warmup", True) and hasattr(engine, "load_phases"):  # a model engine (not zero-compute)
        from actors.worker.engine.warmup import warm_up
        await svc.run_on_engine_thread(warm_up, engine)  # the thread whose OpenMP team serves the steps
        timeline.mark("warmup")
    sync = await _follow_adapters(ctx, reg, svc, ref)  # before credits: the registry's adapters are servable
    await svc.start()
    timeline.mark("credits")
    ctx.on_stop(svc.stop, timeout_s=10.0, what="worker service")
    _track_gauges(ctx, svc)
    _track_load(timeline, f"{ref.name}@{ref.version}")
    info = worker_info(engine, args, worker_id, sync.applied)
    if getattr(engine, "tp", None) is not None:  # one logical worker over several ranks: bytes per rank
        info.update(tensor_parallel=engine.tp.world, ranks=engine.tp.rank_bytes)
    info.update(load_phases=timeline.as_dict(), load_s=round(timeline.ready_s, 3))
    if (memory := memory_record(engine, manifest, args, ref)) is not None:
        info["memory"] = memory
        _track_memory(memory)
    holder = [await reg.register_worker(ref.name, ref.version, worker_id, info, ttl=args.lease_ttl)]
    timeline.mark("register")
    log.info("worker %s %s", worker_id, timeline.line())
    _record_load(svc, reg, holder, info, timeline)
    _watch_notices(ctx, reg, svc, ref, worker_id)
    _follow_sleep(ctx, reg, svc, holder, info, worker_id, getattr(args, "drain_timeout", 10.0))
    drain_timeout = getattr(args, "drain_timeout", 10.0)
    ctx.on_stop(lambda: _drain(holder, svc, drain_timeout), timeout_s=drain_timeout + 5.0, what="drain")
    await keep_registered(reg, holder, ref, worker_id, info, args.lease_ttl)


def process_age_s() -> float:
    """Seconds since this process started (``/proc/self/stat`` start time against CLOCK_BOOTTIME); 0.0
    where /proc cannot say."""
    try:
        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def _track_memory(memory: dict) -> None:
    """``actorserve_worker_resident_bytes{model, kind=weights|kv}`` and ``actorserve_worker_memory_budget_bytes``
    on this worker's /metrics."""
    from actors.metrics import observable_gauge

    observable_gauge("actorserve_worker_resident_bytes", "Bytes a resident model version holds on this worker, "
                     "by kind (weights, kv; docs/model-loading.md).", "By",
                     lambda: [(r[f"{k}_bytes"], {"model": r["model"], "kind": k})
                              for r in memory["resident"] for k in ("weights", "kv")])
    observable_gauge("actorserve_worker_memory_budget_bytes", "Bytes this worker may hold for weights and KV "
                     "caches together.", "By", lambda: [(memory["budget_bytes"], {})])


def _track_load(timeline: LoadTimeline, model: str) -> None:
    """``actorserve_model_load_seconds{phase, model}`` on this worker's /metrics."""
    from actors.metrics import observable_gauge

    observable_gauge("actorserve_model_load_seconds", "Seconds of the worker's model load by phase (registry, "
                     "artifact_read, convert, kernels, quantize, warmup, credits, register, first_token; "
                     "docs/model-loading.md).", "s",
                     lambda: [(v, {"phase": k, "model": model}) for k, v in timeline.as_dict().items()])


def _record_load(svc: WorkerService, reg, holder: list, info: dict, timeline: LoadTimeline) -> None:
    """Write the load phases into the worker's etcd record now (``register`` included) and again at the
    worker's first token (``first_token``: seconds from registration), logging the whole load then."""
    pending: list = []  # the writes, referenced until done

    def put() -> None:
        info.update(load_phases=timeline.as_dict(), load_s=round(timeline.ready_s, 3))

        async def write() -> None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(3.0):
                    await reg.put_json(holder[0].key, info, lease=holder[0].lease_id)
        pending.append(asyncio.get_running_loop().create_task(write()))

    def first() -> None:
        timeline.mark("first_token")
        log.info("first token %.2f s after registration; %s", timeline.phases["first_token"], timeline.line())
        put()
    put()
    svc.on_first_token = first


async def _follow_adapters(ctx: ActorContext, reg, svc: WorkerService, ref):
    """The registry's adapters of this version registered in the engine now, then kept in step (until stop)."""
    from actors.worker.adapter_sync import AdapterSync, follow_registry, track_lora_metrics
    from control.state.adapters import served_by

    sync = AdapterSync()
    with contextlib.suppress(Exception):  # etcd slow: the follower below retries
        async with asyncio.timeout(5.0):
            records = await reg.list_model_adapters(ref.name)
            await svc.run_on_engine_thread(sync.apply, svc.engine, served_by(records, ref.version))
    task = asyncio.create_task(follow_registry(reg, svc, ref.name, ref.version, sync))
    track_lora_metrics(svc.engine, f"{ref.name}@{ref.version}")

    async def cancel() -> None:
        task.cancel()
    ctx.on_stop(cancel, timeout_s=1.0, what="adapter follower")
    return sync


def _watch_notices(ctx: ActorContext, reg, svc: WorkerService, ref, worker_id: str) -> None:
    """Preemption notices of this worker: its etcd key (put -> ``Migrator.notice``) and SIGUSR1 (a notice
    of ``signal_notice_s``); peers for drains: the other leased workers of the version."""
    import time

    from actors.worker.migration import watch_notice

    async def peers() -> int:
        return len(set(await reg.list_workers(ref.name, ref.version)) - {worker_id})

    mig = svc.migration
    mig.peers = peers
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):  # no signals off the main thread / on Windows
        loop.add_signal_handler(signal.SIGUSR1, lambda: mig.notice(time.time() + mig.cfg.signal_notice_s, "SIGUSR1"))
    task = asyncio.create_task(watch_notice(reg, worker_id, mig))

    async def cancel() -> None:
        task.cancel()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGUSR1)

    ctx.on_stop(cancel, timeout_s=1.0, what="preemption notice watch")


def _follow_sleep(ctx: ActorContext, reg, svc: WorkerService, holder: list, info: dict, worker_id: str,
                  drain_s: float) -> None:
    """Sleep and wake on this worker's ``sleep_key`` (actors/worker/sleep.py): the record's ``sleep`` entry and
    ``actorserve_worker_sleeping`` / ``actorserve_worker_wake_seconds`` on /metrics follow each transition."""
    from actors.metrics import observable_gauge
    from actors.worker.sleep import SleepControl, watch_sleep

    async def on_change(state) -> None:
        info["sleep"] = state.record()
        with contextlib.suppress(Exception):  # etcd slow: the next lease refresh rewrites nothing, so log it
            async with asyncio.timeout(3.0):
                await reg.put_json(holder[0].key, info, lease=holder[0].lease_id)
                return
        log.warning("sleep state %s not written to the worker record", state.state)

    control = SleepControl(svc, on_change, drain_s=drain_s)
    info["sleep"] = control.state.record()
    observable_gauge("actorserve_worker_sleeping", "1 while this worker sleeps (KV cache freed, no work; "
                     "docs/autoscaling.md).", "1", lambda: [(1 if control.state.state == "sleeping" else 0, {})])
    observable_gauge("actorserve_worker_wake_seconds", "Seconds the last wake took, command -> serving.", "s",
                     lambda: [(control.state.wake_s, {})])
    task = asyncio.create_task(watch_sleep(reg, worker_id, control))

    async def cancel() -> None:
        task.cancel()
        from control.state.names import sleep_key

        async with asyncio.timeout(1.0):  # its last command dies with it (a killed worker's is ignored by age)
            await reg.delete(sleep_key(worker_id))
    ctx.on_stop(cancel, timeout_s=1.5, what="sleep watch")


def _track_gauges(ctx: ActorContext, svc: WorkerService) -> None:
    """KV cache usage, running/waiting, batch size and tokens/s on this worker's /metrics (until stop)."""
    from actors.metrics import WorkerGauges, track_worker

    gauges = WorkerGauges()
    gauges.register()
    tracker = asyncio.create_task(track_worker(svc.stats_msg, gauges))

    async def cancel() -> None:
        tracker.cancel()

    ctx.on_stop(cancel, timeout_s=1.0, what="gauge tracker")


async def _drain(holder: list, svc: WorkerService, drain_timeout: float = 10.0) -> None:
    """Bounded graceful stop: refuse new dispatches (draining credits), revoke the lease (schedulers stop
    dispatching here and keep its requests in flight), let running requests finish (at most
    ``drain_timeout`` s; the rest end with a retryable 503). The service and the bus close after it."""
    svc.draining = True
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await svc.publish_credits()
    log.info("draining: revoking lease")
    try:
        async with asyncio.timeout(3.0):
            await holder[0].revoke()
    except Exception as exc:  # lease may already be gone (etcd down); drain anyway
        log.warning("lease revoke failed: %s", exc)
    log.info("draining: %d requests in flight", len(svc.live))
    await svc.drain(timeout=drain_timeout)
    log.info("drained; stopping the service")
