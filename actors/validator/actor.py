"""``actorserve actor validator``: CPU validation tier (queue group "validators"; start more to scale)."""

from __future__ import annotations

import argparse
import asyncio
import logging

log = logging.getLogger("actorserve.validator")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Validator options (common --nats/--etcd/--state-dir are added by actors.runtime)."""
    parser.add_argument("--max-tokens-cap", type=int, default=4096, help="server-side cap on max_tokens")
    parser.add_argument("--max-concurrency", type=int, default=64, help="requests processed at once")
    parser.add_argument("--max-n", type=int, default=8, help="server-side cap on n")
    parser.add_argument("--max-choices", type=int, default=32, help="server-side cap on n x number of prompts")


async def main(args: argparse.Namespace) -> None:
    """Serve until cancelled, then finish requests already taken (bounded)."""
    from actors.runtime import resolve_endpoints
    from actors.validator.service import ValidatorConfig, ValidatorService
    from bus.nats_bus import NatsBus
    from control.registry import Registry

    nats_url, etcd_url = resolve_endpoints(args)
    async with Registry.connect(etcd_url) as reg:
        bus = await NatsBus.connect(nats_url, name="validator")
        svc = ValidatorService(bus, reg, ValidatorConfig(args.max_tokens_cap, args.max_concurrency,
                                                         max_n=args.max_n, max_choices=args.max_choices))
        await svc.start()
        log.info("validator ready")
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.shield(_shutdown(svc, bus))


async def _shutdown(svc, bus) -> None:
    await svc.stop(timeout=10.0)
    await bus.close()
