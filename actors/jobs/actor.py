"""``actorserve actor jobs``: runs durable async jobs from JetStream (``AS_JOBS``) at batch priority.

Start more to scale: they share the durable consumer. On SIGTERM: stop pulling, give running jobs up to
10 s, leave the rest unacknowledged (redelivered to another jobs actor or after a restart).
"""

from __future__ import annotations

import argparse
import logging
import os

from actors.serve import ActorContext, serve

log = logging.getLogger("actorserve.jobs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Jobs actor options (common --nats/--etcd/--state-dir are added by actors.runtime)."""
    parser.add_argument("--concurrency", type=int, default=4, help="jobs run at once by this process")
    parser.add_argument("--jobs-id", default=None, help="unique id (default jobs-<pid>)")


async def main(args: argparse.Namespace) -> None:
    """Serve until cancelled, then drain (bounded)."""
    jid = args.jobs_id or f"jobs-{os.getpid()}"
    await serve(args, jid, build)


async def build(ctx: ActorContext) -> None:
    """Start a front end (hour-long deadlines, 5 min inactivity) and the job runner on it; on stop the
    runner gives running jobs up to 10 s and leaves the rest unacknowledged."""
    from actors.jobs.service import JobsService
    from gateway.actor import start_frontend
    from gateway.frontend import FrontendConfig

    args = ctx.args
    fe = await start_frontend(ctx, FrontendConfig(ctx.name, default_deadline_ms=3_600_000, inactivity_s=300.0))
    bus = ctx.bus
    gate = await _budget_gate(ctx, bus.js(), fe)
    svc = JobsService(bus.js(), fe, concurrency=args.concurrency, budgets=gate)
    await svc.start()
    ctx.on_stop(lambda: svc.stop(timeout=10.0), timeout_s=15.0, what="job runner")
    log.info("jobs actor %s ready", ctx.name)


async def _budget_gate(ctx: ActorContext, js, fe):
    """The spend-budget gate of job requests (gateway.budget_store.BudgetGate), fed by a tenant cache (the
    registry's tenants, watched) and the front end's model snapshot for prices; both stop with the actor."""
    from gateway.auth import TenantCache
    from gateway.budget_store import BudgetGate

    cache = TenantCache(ctx.registry)
    await cache.start()
    ctx.on_stop(cache.stop, what="tenant cache")

    def budget_of(tenant_id: str):
        t = cache.tenants.get(tenant_id)
        return t.budget if t is not None else None

    async def manifests(name: str, version: str):
        return fe.resolver.snapshot.versions.get(name, {}).get(version)

    gate = BudgetGate(js, budget_of=budget_of, manifests=manifests)
    await gate.open()
    return gate
