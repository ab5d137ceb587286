"""``actorserve actor gateway``: HTTP (OpenAI-compatible) and NATS API front.

On SIGTERM: stop accepting connections, let requests in flight finish (bounded), close.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

log = logging.getLogger("actorserve.gateway")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Gateway options (common --nats/--etcd/--state-dir are added by actors.runtime)."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument("--gateway-id", default=None, help="unique id (default gw-<pid>)")
    parser.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="request body limit (413 above)")
    parser.add_argument("--default-deadline-ms", type=int, default=120_000, help="deadline of requests without one")


async def main(args: argparse.Namespace) -> None:
    """Serve until cancelled, then drain (bounded)."""
    from aiohttp import web

    from actors.runtime import resolve_endpoints
    from bus.nats_bus import NatsBus
    from control.state.registry import Registry
    from gateway.frontend import Frontend, FrontendConfig
    from gateway.http import HttpFront
    from gateway.models import ModelResolver
    from gateway.nats_api import NatsApi

    nats_url, etcd_url = resolve_endpoints(args)
    gid = args.gateway_id or f"gw-{os.getpid()}"
    async with Registry.connect(etcd_url) as reg:
        bus = await NatsBus.connect(nats_url, name=f"gateway-{gid}")
        resolver = ModelResolver(reg)
        await resolver.start()
        fe = Frontend(bus, resolver, FrontendConfig(gid, default_deadline_ms=args.default_deadline_ms))
        from gateway.metrics import GatewayMetrics
        fe.observer = GatewayMetrics(bus)
        await fe.observer.start()
        await fe.start()
        from gateway.tenancy import Tenancy
        tenancy = Tenancy(reg, bus.client.jetstream(), gateway_id=gid)
        await tenancy.start()
        api = NatsApi(fe, tenancy)
        await api.start()
        runner = web.AppRunner(HttpFront(fe, tenancy).app(args.max_body_bytes), shutdown_timeout=10.0)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        log.info("gateway %s listening on http://%s:%d", gid, args.host, args.port)
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.shield(_shutdown(runner, api, fe, resolver, bus, tenancy))


async def _shutdown(runner, api, fe, resolver, bus, tenancy=None) -> None:
    """Stop listening, wait (<= 10 s) for requests in flight, then close the bus."""
    await api.stop()
    await runner.cleanup()
    for _ in range(100):
        if not len(fe.table):
            break
        await asyncio.sleep(0.1)
    if tenancy is not None:
        await tenancy.stop()
    await fe.stop()
    if fe.observer is not None:
        await fe.observer.stop()
    await resolver.stop()
    await bus.close()
