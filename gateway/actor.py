"""``actorserve actor gateway``: HTTP (OpenAI-compatible) and NATS API front.

On SIGTERM: stop accepting connections, let requests in flight finish (bounded), close.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import time

from typing import TYPE_CHECKING

from actors.serve import ActorContext, serve

DRAIN_BUDGET_S = 10.0  # seconds, from the start of a stop, for listeners and requests in flight together

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
    parser.add_argument("--no-step-frames", dest="step_frames", action="store_false",
                        help="ask workers for one message per chunk instead of one step frame per step "
                        "(docs/decisions/0052-step-frames.md; for comparisons)")
    parser.add_argument("--tls-cert", metavar="PEM", default=None,
                        help=f"serve HTTPS with this certificate (default: ${ENV_HTTPS_CERT}; none: plain HTTP)")
    parser.add_argument("--tls-key", metavar="PEM", default=None,
                        help=f"private key of --tls-cert (default: ${ENV_HTTPS_KEY})")


ENV_HTTPS_CERT = "ACTORSERVE_HTTPS_CERT"  # set by `actorserve up --tls` (control/ops/tls_stack.py)
ENV_HTTPS_KEY = "ACTORSERVE_HTTPS_KEY"


def https_context(args: argparse.Namespace):
    """The server ``ssl.SSLContext`` of the gateway's HTTPS port: ``--tls-cert``/``--tls-key``, else
    ``ACTORSERVE_HTTPS_CERT``/``_KEY``; None (plain HTTP) when neither names a certificate. Raises
    SystemExit naming the option when only one of the pair is given or a file does not load."""
    import ssl

    from bus.tls import TlsFiles
    cert = getattr(args, "tls_cert", None) or os.environ.get(ENV_HTTPS_CERT) or None
    key = getattr(args, "tls_key", None) or os.environ.get(ENV_HTTPS_KEY) or None
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise SystemExit("actorserve gateway: --tls-cert and --tls-key come together")
    try:
        return TlsFiles(cert=cert, key=key).server_context()
    except (OSError, ssl.SSLError, ValueError) as e:
        raise SystemExit(f"actorserve gateway: cannot load --tls-cert/--tls-key: {e}") from None


async def main(args: argparse.Namespace) -> None:
    """Serve until cancelled, then drain (bounded)."""
    gid = args.gateway_id or f"gw-{os.getpid()}"
    await serve(args, f"gateway-{gid}", functools.partial(build, gid=gid))


async def build(ctx: ActorContext, gid: str) -> None:
    """Start the front end, the tenancy (keys, quotas, usage, idempotency), the NATS API and the HTTP
    server. On stop: stop listening (NATS API, then HTTP), and wait for requests still in flight, both within
    one DRAIN_BUDGET_S budget counted from the start of the stop (so a gateway drains within the
    supervisor's stop deadline, docs/cli.md), then stop the parts in reverse order."""
    from aiohttp import web

    from gateway.frontend import FrontendConfig
    from gateway.http import HttpFront
    from gateway.nats_api import NatsApi
    from gateway.tenancy import Tenancy

    args, reg = ctx.args, ctx.registry
    ssl_ctx = https_context(args)
    fe = await start_frontend(ctx, FrontendConfig(gid, default_deadline_ms=args.default_deadline_ms,
                                                      step_frames=getattr(args, "step_frames", True)),
                              metrics=True)
    bus = ctx.bus
    await _report_load(ctx, fe, gid)
    tenancy = Tenancy(reg, bus.js(), gateway_id=gid, models=fe.resolver)
    if tenancy.usage is not None:  # request metrics from the records this gateway meters (gateway/metrics.py)
        tenancy.usage.on_records.append(fe.observer.apply_many)
    else:
        await fe.observer.hear_done()
    await tenancy.start()
    ctx.on_stop(tenancy.stop, what="tenancy")
    drain_end: list[float] = []  # monotonic deadline of the drain, set when the stop begins
    ctx.on_stop(lambda: wait_idle(fe, max(0.0, drain_end[0] - time.monotonic()) if drain_end else DRAIN_BUDGET_S),
                timeout_s=DRAIN_BUDGET_S + 1.0, what="requests in flight")
    api = NatsApi(fe, tenancy)
    runner = web.AppRunner(HttpFront(fe, tenancy).app(args.max_body_bytes), shutdown_timeout=DRAIN_BUDGET_S)

    async def stop_listening() -> None:
        drain_end.append(time.monotonic() + DRAIN_BUDGET_S)
        await _stop_listening(api, runner)
    ctx.on_stop(stop_listening, timeout_s=DRAIN_BUDGET_S + 1.0, what="listeners")
    await api.start()
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port, ssl_context=ssl_ctx).start()
    log.info("gateway %s listening on %s://%s:%d", gid, "https" if ssl_ctx else "http", args.host, args.port)


async def start_frontend(ctx: ActorContext, cfg: FrontendConfig, *, metrics: bool = False) -> Frontend:
    """Connect the context's bus and start a :class:`gateway.frontend.Frontend` on it with a model
    resolver over the context's registry (and the gateway's request metrics when ``metrics``: worker statistics
    only; the caller gives them completion records, gateway/metrics.py); each is stopped on the context's stop.
    Used by the gateway and the jobs actor."""
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
        await fe.observer.start(hear_done=False)
        ctx.on_stop(fe.observer.stop, what="gateway metrics")
    await fe.start()
    ctx.on_stop(fe.stop, what="front end")
    return fe


async def _report_load(ctx: ActorContext, fe: Frontend, gid: str) -> None:
    """Publish this gateway's load on ``as.int.load.gateway.<gid>`` (~1 Hz, actors/load_report.py): loop lag,
    CPU, and as its wait each request's time from arrival to the hand-off to a validator (stopped on stop)."""
    from actors.load_report import LoadReporter

    fe.load = LoadReporter(ctx.bus, "gateway", gid)
    await fe.load.start()
    ctx.on_stop(fe.load.stop, timeout_s=2.0, what="load report")


async def wait_idle(fe: Frontend, timeout_s: float) -> None:
    """Return once ``fe`` has no request in flight, or after ``timeout_s`` seconds (polled every 0.1 s)."""
    for _ in range(max(1, round(timeout_s / 0.1))):
        if not len(fe.table):
            return
        await asyncio.sleep(0.1)


async def _stop_listening(api, runner) -> None:
    """No new requests: unsubscribe the NATS API, then close the HTTP server (its handlers get at most
    DRAIN_BUDGET_S seconds)."""
    await api.stop()
    await runner.cleanup()
