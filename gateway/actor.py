"""``actorserve actor gateway``: HTTP (OpenAI-compatible) and NATS API front.

On SIGTERM: stop accepting connections, let requests in flight finish (bounded), close.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os

from typing import TYPE_CHECKING

from actors.serve import ActorContext, serve

if TYPE_CHECKING:
    from gateway.frontend import Frontend, FrontendConfig

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
    gid = args.gateway_id or f"gw-{os.getpid()}"
    await serve(args, f"gateway-{gid}", functools.partial(build, gid=gid))


async def build(ctx: ActorContext, gid: str) -> None:
    """Start the front end, the tenancy (keys, quotas, usage, idempotency), the NATS API and the HTTP
    server. On stop: stop listening (NATS API, then HTTP: its handlers get <= 10 s), wait <= 10 s for
    requests still in flight, then stop the parts in reverse order."""
    from aiohttp import web

    from gateway.frontend import FrontendConfig
    from gateway.http import HttpFront
    from gateway.nats_api import NatsApi
    from gateway.tenancy import Tenancy

    args, reg = ctx.args, ctx.registry
    fe = await start_frontend(ctx, FrontendConfig(gid, default_deadline_ms=args.default_deadline_ms), metrics=True)
    bus = ctx.bus
    tenancy = Tenancy(reg, bus.js(), gateway_id=gid)
    await tenancy.start()
    ctx.on_stop(tenancy.stop, what="tenancy")
    ctx.on_stop(lambda: wait_idle(fe, 10.0), timeout_s=11.0, what="requests in flight")
    api = NatsApi(fe, tenancy)
    runner = web.AppRunner(HttpFront(fe, tenancy).app(args.max_body_bytes), shutdown_timeout=10.0)
    ctx.on_stop(lambda: _stop_listening(api, runner), timeout_s=15.0, what="listeners")
    await api.start()
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    log.info("gateway %s listening on http://%s:%d", gid, args.host, args.port)


async def start_frontend(ctx: ActorContext, cfg: FrontendConfig, *, metrics: bool = False) -> Frontend:
    """Connect the context's bus and start a :class:`gateway.frontend.Frontend` on it with a model
    resolver over the context's registry (and the gateway's request metrics when ``metrics``); each is
    stopped on the context's stop. Used by the gateway and the jobs actor."""
    from gateway.frontend import Frontend
    from gateway.models import ModelResolver

    bus = await ctx.connect_bus()
    resolver = ModelResolver(ctx.registry)
    await resolver.start()
    ctx.on_stop(resolver.stop, what="model resolver")
    fe = Frontend(bus, resolver, cfg)
    if metrics:
        from gateway.metrics import GatewayMetrics

        fe.observer = GatewayMetrics(bus)
        await fe.observer.start()
        ctx.on_stop(fe.observer.stop, what="gateway metrics")
    await fe.start()
    ctx.on_stop(fe.stop, what="front end")
    return fe


async def wait_idle(fe: Frontend, timeout_s: float) -> None:
    """Return once ``fe`` has no request in flight, or after ``timeout_s`` seconds (polled every 0.1 s)."""
    for _ in range(max(1, round(timeout_s / 0.1))):
        if not len(fe.table):
            return
        await asyncio.sleep(0.1)


async def _stop_listening(api, runner) -> None:
    """No new requests: unsubscribe the NATS API, then close the HTTP server (its handlers get <= 10 s)."""
    await api.stop()
    await runner.cleanup()
