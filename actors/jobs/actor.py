"""``actorserve actor jobs``: runs durable async jobs from JetStream (``AS_JOBS``) at batch priority.

Start more to scale: they share the durable consumer. On SIGTERM: stop pulling, give running jobs up to
10 s, leave the rest unacknowledged (redelivered to another jobs actor or after a restart).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

log = logging.getLogger("actorserve.jobs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Jobs actor options (common --nats/--etcd/--state-dir are added by actors.runtime)."""
    parser.add_argument("--concurrency", type=int, default=4, help="jobs run at once by this process")
    parser.add_argument("--jobs-id", default=None, help="unique id (default jobs-<pid>)")


async def main(args: argparse.Namespace) -> None:
    """Serve until cancelled, then drain (bounded)."""
    from actors.jobs.service import JobsService
    from actors.runtime import resolve_endpoints
    from bus.nats_bus import NatsBus
    from control.state.registry import Registry
    from gateway.frontend import Frontend, FrontendConfig
    from gateway.models import ModelResolver

    nats_url, etcd_url = resolve_endpoints(args)
    jid = args.jobs_id or f"jobs-{os.getpid()}"
    async with Registry.connect(etcd_url) as reg:
        bus = await NatsBus.connect(nats_url, name=jid)
        resolver = ModelResolver(reg)
        await resolver.start()
        fe = Frontend(bus, resolver, FrontendConfig(jid, default_deadline_ms=3_600_000, inactivity_s=300.0))
        await fe.start()
        svc = JobsService(bus.client.jetstream(), fe, concurrency=args.concurrency)
        await svc.start()
        log.info("jobs actor %s ready", jid)
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.shield(_shutdown(svc, fe, resolver, bus))


async def _shutdown(svc, fe, resolver, bus) -> None:
    await svc.stop(timeout=10.0)
    await fe.stop()
    await resolver.stop()
    await bus.close()
