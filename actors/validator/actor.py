"""``actorserve actor validator``: CPU validation tier (queue group "validators"; start more to scale)."""

from __future__ import annotations

import argparse
import logging

from actors.serve import ActorContext, serve

log = logging.getLogger("actorserve.validator")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Validator options (common --nats/--etcd/--state-dir are added by actors.runtime)."""
    parser.add_argument("--max-tokens-cap", type=int, default=4096, help="server-side cap on max_tokens")
    parser.add_argument("--max-concurrency", type=int, default=64, help="requests processed at once")
    parser.add_argument("--max-n", type=int, default=8, help="server-side cap on n")
    parser.add_argument("--max-choices", type=int, default=32, help="server-side cap on n x number of prompts")
    parser.add_argument("--test-delay-ms", type=float, default=0.0, metavar="MS",
                        help="test only (honoured with ACTORSERVE_TEST_FAULTS=1): burn MS ms of CPU per request")


async def main(args: argparse.Namespace) -> None:
    """Serve until cancelled, then finish requests already taken (bounded)."""
    await serve(args, "validator", build)


async def build(ctx: ActorContext) -> None:
    """Start the validation service on the context's bus and registry; on stop it finishes the requests
    already taken (at most 10 s). It reports its load on ``as.int.load.validator.<id>`` (actors/load_report.py);
    with ``ACTORSERVE_TEST_FAULTS=1`` it honours ``ACTORSERVE_FAULT_VALIDATOR_DELAY_MS`` (actors/validator/faults.py)."""
    from actors.validator import faults
    from actors.validator.service import ValidatorConfig, ValidatorService

    args = ctx.args
    try:
        fault = faults.from_env()
    except ValueError as exc:
        raise SystemExit(f"actorserve validator: {exc}") from None
    svc = ValidatorService(await ctx.connect_bus(), ctx.registry,
                           ValidatorConfig(args.max_tokens_cap, args.max_concurrency, max_n=args.max_n,
                                           max_choices=args.max_choices, test_delay_ms=_test_delay_ms(args)),
                           fault=fault)
    await svc.start()
    ctx.on_stop(lambda: svc.stop(timeout=10.0), timeout_s=15.0, what="validator service")
    log.info("validator ready")


def _test_delay_ms(args: argparse.Namespace) -> float:
    """``--test-delay-ms`` when ``ACTORSERVE_TEST_FAULTS=1``, else 0 (ignored with a warning)."""
    import os

    delay = float(getattr(args, "test_delay_ms", 0.0) or 0.0)
    if delay > 0 and os.environ.get("ACTORSERVE_TEST_FAULTS", "") != "1":
        log.warning("--test-delay-ms ignored: test faults are off (set ACTORSERVE_TEST_FAULTS=1)")
        return 0.0
    return max(0.0, delay)
