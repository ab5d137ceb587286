"""``actorserve pools ...``: accelerator pool records in etcd (control/state/pools.py).

    actorserve pools set NAME [--accelerator TYPE] [--memory-bytes N] [--price-on-demand-per-h USD]
                              [--price-spot-per-h USD] [--market on_demand|spot] [--preemption-rate-per-h R]
                              [--max-workers N]
    actorserve pools list [--json]

``set`` creates the pool or changes only the fields given (a new pool starts from the defaults: cpu, 0 bytes,
free, on demand, no preemption, 1 worker). etcd is found like every other verb (``--etcd``,
``$ACTORSERVE_ETCD``, ``<state-dir>/endpoints.json``). Exit 0 done, 1 invalid record, 3 etcd unreachable.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from actors.runtime import common_arguments
from control.ops.argtypes import non_negative_int
from control.ops.cli_errors import run_on_registry


def _non_negative_float(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} must be a finite number >= 0")
    return v


def add_pools_command(sub: Any) -> None:
    """Add the ``pools`` verb (``set``, ``list``) to the CLI's subparsers ``sub``."""
    p = sub.add_parser("pools", help="accelerator pools: type, memory, prices, market, preemption rate (etcd)")
    ps = p.add_subparsers(dest="pools_command", metavar="SUBCOMMAND", required=True)
    s = ps.add_parser("set", help="create a pool or change the given fields of its record")
    common_arguments(s)
    s.add_argument("name", help="pool name, e.g. local, h100-spot")
    s.add_argument("--accelerator", default=None, metavar="TYPE", help="accelerator type (default cpu)")
    s.add_argument("--memory-bytes", type=non_negative_int, default=None, metavar="N",
                   help="accelerator memory of one worker, bytes")
    s.add_argument("--price-on-demand-per-h", type=_non_negative_float, default=None, metavar="USD",
                   help="on-demand price of one worker-hour")
    s.add_argument("--price-spot-per-h", type=_non_negative_float, default=None, metavar="USD",
                   help="spot price of one worker-hour")
    s.add_argument("--market", choices=("on_demand", "spot"), default=None, help="market its workers use")
    s.add_argument("--preemption-rate-per-h", type=_non_negative_float, default=None, metavar="R",
                   help="spot preemptions per worker-hour")
    s.add_argument("--max-workers", type=non_negative_int, default=None, metavar="N", help="most workers")
    s.set_defaults(func=lambda args: _run(_set, args))
    ls = ps.add_parser("list", help="list pools")
    common_arguments(ls)
    ls.add_argument("--json", action="store_true", help="print machine-readable JSON")
    ls.set_defaults(func=lambda args: _run(_list, args))


def _run(func, args: argparse.Namespace) -> int:
    return run_on_registry(func, args)


_FIELDS = ("accelerator", "memory_bytes", "price_on_demand_per_h", "price_spot_per_h", "market",
           "preemption_rate_per_h", "max_workers")


async def _set(reg, args) -> int:
    from control.state.pools import PoolRecord, get_pool, put_pool

    old = await get_pool(reg, args.name)
    rec = (old or PoolRecord(args.name)).with_changes({f: getattr(args, f) for f in _FIELDS})
    await put_pool(reg, rec)
    print(f"{'updated' if old else 'created'} pool {rec.name}: {json.dumps(rec.to_json(), sort_keys=True)}")
    return 0


async def _list(reg, args) -> int:
    from control.state.pools import list_pools

    pools = await list_pools(reg)
    if args.json:
        print(json.dumps({n: r.to_json() for n, r in pools.items()}, indent=2, sort_keys=True))
        return 0
    rows = [("POOL", "ACCEL", "MEMORY_GIB", "ON_DEMAND/H", "SPOT/H", "MARKET", "PREEMPT/H", "MAX")]
    for n, r in pools.items():
        rows.append((n, r.accelerator, f"{r.memory_bytes / 2**30:.1f}", f"{r.price_on_demand_per_h:g}",
                     f"{r.price_spot_per_h:g}", r.market, f"{r.preemption_rate_per_h:g}", str(r.max_workers)))
    if len(rows) == 1:
        print("(no pools)")
        return 0
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0
