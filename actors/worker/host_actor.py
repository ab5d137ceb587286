"""``actorserve actor worker --host``: the process shell of a multi-version worker host (actors/worker/host.py).

Start-up: connect the bus, serve ``as.int.host.<host_id>.load``, ask for the ``--model`` / ``--pin`` versions,
run the residency loop; the host record ``/actorserve/hosts/{host_id}`` is written every round. On SIGTERM
every resident version drains (bounded by ``--drain-timeout``) and its lease goes, then the record's.
"""

from __future__ import annotations

import asyncio
import logging

from actors.serve import ActorContext
from actors.worker.host import ModelHost, machine_budget_bytes

log = logging.getLogger("actorserve.worker")


async def run_host(ctx: ActorContext, host_id: str) -> None:
    """Run the host until cancelled (then drain it)."""
    args = ctx.args
    if getattr(args, "tensor_parallel", 0) > 1 or getattr(args, "engine", "torch") != "torch":
        raise SystemExit("--host serves one-rank torch engines (no --tensor-parallel, no --engine zero-compute)")
    budget = args.memory_budget_bytes or machine_budget_bytes()
    bus = await ctx.connect_bus()
    preload = (args.model,) if isinstance(args.model, str) else tuple(args.model or ())
    host = ModelHost(ctx.registry, bus, host_id, args, budget, preload=preload,
                     pinned=tuple(args.pin))
    await host.start()
    log.info("host %s: budget %d bytes (%s), versions %s loaded at start", host_id, budget,
             "--memory-budget-bytes" if args.memory_budget_bytes else "80% of the machine's memory",
             ", ".join(host.preload) or "none")
    drain_timeout = getattr(args, "drain_timeout", 10.0)
    ctx.on_stop(lambda: host.stop(drain_timeout), timeout_s=drain_timeout + 8.0, what="host drain")
    loop = asyncio.create_task(host.run())

    async def cancel() -> None:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    ctx.on_stop(cancel, timeout_s=5.0, what="residency loop")  # closers run in reverse: the loop stops first
    await asyncio.Event().wait()
