"""``actorserve plan``: the fleet (types x market x count) that serves a constant load within the SLO, and its
cost (control/sim/plan.py), optionally checked in the simulator.

    actorserve plan --rate R --prompt-tokens P --output-tokens O [--slo ttft_ms=500,itl_ms=50] [--inputs F]
                    [--json] [--verify [--verify-s S] [--seed N]]

Reads the simulator's inputs file (default control/sim/inputs/fleet.toml; ``--inputs`` another), plans with
the live autoscaler's mix planner and prints one row per pool (type, market, replicas, USD/h) and the totals
(USD per hour, per 1M output tokens). ``--slo`` defaults to the inputs file's SLO. ``--verify`` simulates
``--verify-s`` (default 3600) seconds of that constant load with the fleet fixed and prints attainment and
simulated against predicted cost (targets: attainment >= 99.5 %, cost within +-10 %). ``--json`` prints
one JSON object instead of the table. Needs no running stack. Exit 0 planned (and, with ``--verify``, both
targets met), 1 no feasible fleet, a bad inputs file or a missed target.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any


def _positive_float(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be a finite number > 0")
    return v


def parse_slo(value: str) -> dict[str, float]:
    """argparse type for ``--slo ttft_ms=500,itl_ms=50``: ``{"ttft_ms": 500.0, "itl_ms": 50.0}`` (either key
    may be left out; the other comes from the inputs file)."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in value.split(",") if p.strip()):
        key, sep, num = part.partition("=")
        key = key.strip()
        if not sep or key not in ("ttft_ms", "itl_ms"):
            raise argparse.ArgumentTypeError(f"--slo: {part!r} is not ttft_ms=MS or itl_ms=MS")
        out[key] = _positive_float(num.strip())
    if not out:
        raise argparse.ArgumentTypeError("--slo: give ttft_ms=MS and/or itl_ms=MS")
    return out


def add_plan_command(sub: Any) -> None:
    """Add the ``plan`` verb to the CLI's subparsers ``sub``."""
    from control.ops.argtypes import non_negative_int, positive_int

    p = sub.add_parser("plan", help="capacity planning: the cheapest fleet for a constant load within the SLO",
                       description="Plan the fleet (accelerator types x market x count) that serves a constant "
                                   "load within the SLO, from the simulator's inputs file (curves, prices, "
                                   "spot preemption) and the live autoscaler's mix planner.")
    p.add_argument("--rate", type=_positive_float, required=True, metavar="R", help="requests per second")
    p.add_argument("--prompt-tokens", type=positive_int, required=True, metavar="P", help="prompt tokens per request")
    p.add_argument("--output-tokens", type=positive_int, required=True, metavar="O",
                   help="output tokens per request")
    p.add_argument("--slo", type=parse_slo, default=None, metavar="ttft_ms=MS,itl_ms=MS",
                   help="latency SLO (default: the inputs file's, e.g. ttft_ms=500,itl_ms=50)")
    p.add_argument("--inputs", default=None, metavar="PATH",
                   help="simulator inputs file (default: control/sim/inputs/fleet.toml)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--verify", action="store_true",
                   help="simulate the planned fleet on that constant load and compare attainment and cost")
    p.add_argument("--verify-s", type=_positive_float, default=3600.0, metavar="S",
                   help="simulated seconds of --verify (default 3600)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of --verify's simulation (default 0)")
    p.set_defaults(func=main_plan, extras=("sim",))  # the simulator's latency model: scipy (control/ops/extras.py)


def _print(plan: Any, inputs: Any, verify: dict | None) -> None:
    r = plan.request
    print(f"load: {r.rate_rps:g} req/s x {r.prompt_tokens} prompt + {r.output_tokens} output tokens = "
          f"{plan.demand_tokens_per_s:.0f} output tokens/s; SLO TTFT <= {r.slo.ttft_ms:g} ms, ITL <= "
          f"{r.slo.itl_ms:g} ms; planned at {plan.planned_tokens_per_s:.0f} tokens/s (headroom)")
    rows = [("pool", "replicas", "USD/h each", "USD/h")]
    for key, n in sorted(plan.pools.items()):
        t, market = key.rsplit("/", 1)
        price = inputs.types[t].price_per_h(market)
        rows.append((key, str(n), f"{price:.3f}", f"{n * price:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print(f"total: {plan.cost_per_h:.2f} USD/h, {plan.cost_per_1m_output_tokens:.4f} USD per 1M output tokens, "
          f"{plan.accelerators} accelerators, spot {100 * plan.spot_fraction:.0f} % of capacity"
          f"{'' if plan.feasible else '  (NOT FEASIBLE)'}")
    for note in plan.notes:
        print(f"note: {note}")
    if verify is not None:
        print(f"verify ({verify['duration_s']:.0f} simulated s, {verify['wall_s']:.1f} s wall): attainment "
              f"{100 * verify['slo_attainment']:.2f} % (target >= {100 * verify['min_attainment']:.1f} %: "
              f"{'met' if verify['attainment_met'] else 'MISSED'}); cost {verify['simulated_cost_per_h']:.2f} "
              f"USD/h simulated vs {verify['predicted_cost_per_h']:.2f} predicted ({verify['cost_error']:+.1%}; "
              f"target +-{verify['cost_tolerance']:.0%}: {'met' if verify['cost_met'] else 'MISSED'})")


def main_plan(args: argparse.Namespace) -> int:
    """Entry of ``actorserve plan``: exit status (module docstring)."""
    from actors.autoscaler.signals import Slo
    from control.sim.inputs import load_inputs
    from control.sim.plan import PlanRequest, plan_checked, verify_plan

    try:
        inputs = load_inputs(args.inputs)
        slo = Slo(**{"ttft_ms": inputs.slo.ttft_ms, "itl_ms": inputs.slo.itl_ms, **(args.slo or {})})
        plan = plan_checked(inputs, PlanRequest(args.rate, args.prompt_tokens, args.output_tokens, slo), seed=args.seed)
    except (OSError, ValueError) as e:
        print(f"actorserve plan: {e}", file=sys.stderr)
        return 1
    verify = None
    if args.verify and plan.feasible:
        t0 = time.monotonic()
        verify = verify_plan(inputs, plan, duration_s=args.verify_s, seed=args.seed)
        verify["wall_s"] = round(time.monotonic() - t0, 2)
    if args.json:
        print(json.dumps({**plan.to_json(), **({"verify": verify} if verify is not None else {})}, indent=2,
                         sort_keys=True))
    else:
        _print(plan, inputs, verify)
    if not plan.feasible:
        return 1
    return 0 if verify is None or (verify["attainment_met"] and verify["cost_met"]) else 1
